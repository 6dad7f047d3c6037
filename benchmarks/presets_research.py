"""Preset research: decode perplexity with a paired interval, passkeys, and bits from ``memory_report()``.

Same protocol as ``python -m kitty.eval`` (its windows, ``decode_nll``, passkey prompts and seed), with what the eval
table lacks for comparing presets at equal bits: per-token NLL kept on disk, a paired bootstrap interval of each
preset's perplexity change against fp16 (per text and over both), and the bits of a real cache after one window.
Results accumulate in ``--out`` (a method already measured is not run again), so runs can be split and resumed.

    python benchmarks/presets_research.py ppl --methods kitty,kitty-fit --out /tmp/research
    python benchmarks/presets_research.py passkey --methods kitty,kitty-fit --out /tmp/research
    python benchmarks/presets_research.py table --methods kitty,kitty-fit --out /tmp/research

``--standout-threshold T`` runs the ``fit-standout`` / ``fit-peak-standout`` ranges with threshold ``T`` instead of
``kitty.core.standout.STANDOUT_THRESHOLD`` (the method names do not carry it: give such a run its own ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kitty.core import standout
from kitty.core.config import get_preset
from kitty.hf import generate as gen
from kitty.hf.models import load_model
from kitty.tools.eval import DEPTHS, TEXTS, decode_nll, passkey_answer, passkey_cases, text_windows
from kitty.tools.prompts import passkey_prompt

BLOCK = 32  # tokens per bootstrap block: neighbouring tokens' NLLs are correlated, blocks are resampled whole
RESAMPLES = 2000
BITS_TOLERANCE = 0.01  # "equal bits" in a pair: the preset goal's tolerance on memory_report()'s bits per element


def paired_interval(nll: torch.Tensor, ref: torch.Tensor, seed: int = 0) -> tuple[float, float, float]:
    """Perplexity change ``exp(mean(nll - ref)) - 1`` and its 95% paired block-bootstrap interval.

    ``nll``, ``ref``: ``[N]`` per-token NLL of a method and of fp16 on the same tokens (``N`` a multiple of BLOCK).
    """
    d = (nll - ref).double().reshape(-1, BLOCK).mean(-1)  # (blocks,)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, d.numel(), (RESAMPLES, d.numel()), generator=g)
    boot = d[idx].mean(-1).exp() - 1
    lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return math.exp(d.mean().item()) - 1, lo, hi


def cache_bits(model, ids: torch.Tensor, method: str) -> float:
    """Bits per element of a real cache after ``ids`` went through it (``memory_report()``)."""
    cache = gen.make_cache(model, get_preset(method))
    with torch.no_grad():
        gen.prefill(model, ids[None], cache)
    return cache.memory_report().bits_per_element


def run_ppl(a, model, tokenizer, out: Path) -> None:
    path = out / "nll.pt"
    store = torch.load(path) if path.exists() else {}
    named = text_windows(tokenizer, TEXTS, a.prefill, a.scored, a.windows_per_text, with_names=True)
    store["_texts"] = [n for n, _ in named]
    for m in tqdm(["fp16"] + a.methods, desc="perplexity methods"):
        if m in store:
            continue
        cfg = get_preset(m)
        start = time.perf_counter()
        nll = [decode_nll(model, w, cfg, a.prefill) for _, w in tqdm(named, desc=m)]
        store[m] = {"nll": nll, "bits": cache_bits(model, named[0][1], m), "seconds": time.perf_counter() - start}
        torch.save(store, path)  # after every method: an interrupted run keeps what it measured


def run_passkey(a, model, tokenizer, out: Path) -> None:
    path = out / "passkey.json"
    store = json.loads(path.read_text()) if path.exists() else {}
    cases = passkey_cases(a.lengths, a.depths, a.trials)  # kitty.tools.eval.passkey_table's (seed 0)
    store["_cases"] = cases
    order = a.order if "fp16" in a.order else a.order + ["fp16"]  # fp16 defines which prompts count, run it anywhere
    for m in tqdm(order, desc="passkey methods"):
        if m in store:
            continue
        cfg = get_preset(m)
        start = time.perf_counter()
        answers = [passkey_answer(model, tokenizer, passkey_prompt(tokenizer, *c), cfg) for c in tqdm(cases, desc=m)]
        store[m] = [str(c[2]) in a for c, a in zip(cases, answers)]
        store[f"_answers/{m}"] = answers  # the raw greedy answers, to tell a near miss from a failed retrieval
        store[f"_seconds/{m}"] = time.perf_counter() - start
        path.write_text(json.dumps(store))


def table(a, out: Path) -> str:
    store = torch.load(out / "nll.pt") if (out / "nll.pt").exists() else {}
    pk = json.loads((out / "passkey.json").read_text()) if (out / "passkey.json").exists() else {}
    texts = store.get("_texts", [])
    groups = [("all", list(range(len(texts))))] + [
        (Path(t).stem, [i for i, n in enumerate(texts) if n == t]) for t in dict.fromkeys(texts)
    ]
    head = "| method | bits/element | " + " | ".join(f"ppl vs fp16 ({g}) [95% CI]" for g, _ in groups) + " | passkeys |"
    lines = [head, "|---" * (3 + len(groups)) + "|"]
    ok16 = pk.get("fp16")
    for m in ["fp16"] + a.methods:
        cells = []
        if m in store:
            for _, idx in groups:
                nll = torch.cat([store[m]["nll"][i] for i in idx])
                ref = torch.cat([store["fp16"]["nll"][i] for i in idx])
                c, lo, hi = paired_interval(nll, ref)
                cells.append(f"{100 * c:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]")
            bits = f"{store[m]['bits']:.3f}"
        else:
            cells, bits = ["—"] * len(groups), "—"
        solved = "—"
        if m in pk and ok16 is not None:
            solved = f"{sum(s and f for s, f in zip(pk[m], ok16))}/{sum(ok16)}"
        lines.append(f"| {m} | {bits} | " + " | ".join(cells) + f" | {solved} |")
    for pair in a.pairs:  # candidate:reference at equal bits, their paired perplexity ratio over both texts
        m, ref = pair.split(":")
        if m not in store or ref not in store:
            continue
        if abs(store[m]["bits"] - store[ref]["bits"]) > BITS_TOLERANCE:
            raise ValueError(f"{m} holds {store[m]['bits']} bits/element, {ref} {store[ref]['bits']}: not equal bits")
        c, lo, hi = paired_interval(torch.cat(store[m]["nll"]), torch.cat(store[ref]["nll"]))
        lines.append(
            f"\n{m} vs {ref} ({store[m]['bits']:.4f} and {store[ref]['bits']:.4f} bits): "
            f"ppl {100 * c:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]"
        )
    return "\n".join(lines)


def write_rows(a, out: Path, csv_path: Path) -> None:
    """One CSV row per (method, passkey prompt): its answer and whether it holds the key; and one per (method,
    perplexity window): its mean NLL and tokens. ``--model`` names the model in every row."""
    import csv

    store = torch.load(out / "nll.pt") if (out / "nll.pt").exists() else {}
    pk = json.loads((out / "passkey.json").read_text()) if (out / "passkey.json").exists() else {}
    model = a.model or "SmolLM2-135M-Instruct"
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "method", "part", "length", "depth", "key", "answer", "solved", "text", "window", "nll"])
        for m in ["fp16"] + a.methods:
            for c, ok, ans in zip(pk.get("_cases", []), pk.get(m, []), pk.get(f"_answers/{m}", [])):
                w.writerow([model, m, "passkey", c[0], c[1], c[2], ans, int(ok), "", "", ""])
            for i, (text, nll) in enumerate(zip(store.get("_texts", []), store.get(m, {}).get("nll", []))):
                w.writerow([model, m, "ppl", "", "", "", "", "", text, i, f"{nll.double().mean().item():.6f}"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("ppl", "passkey", "table"))
    p.add_argument("--methods", required=True, help="comma-separated presets (+field=value overrides allowed)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default=None, help="as for load_model: a packaged model's name, a folder or a hub id")
    p.add_argument("--prefill", type=int, default=1024)
    p.add_argument("--scored", type=int, default=256)
    p.add_argument("--windows-per-text", type=int, default=2)
    p.add_argument("--passkey-lengths", default="1024,2048,4096")
    p.add_argument("--passkey-trials", type=int, default=2)
    p.add_argument("--pairs", default="", help="table: candidate:reference,... at equal bits (within BITS_TOLERANCE)")
    p.add_argument("--csv", type=Path, default=None, help="table: also write the per-prompt and per-window rows here")
    p.add_argument("--standout-threshold", type=float, default=None, help="threshold of the fit-standout ranges")
    a = p.parse_args()
    a.order = [m for m in a.methods.split(",") if m]
    a.methods = [m for m in a.order if m != "fp16"]
    a.lengths = [int(x) for x in a.passkey_lengths.split(",")]
    a.pairs = [x for x in a.pairs.split(",") if x]
    a.depths, a.trials = DEPTHS, a.passkey_trials
    for m in a.methods:
        get_preset(m)  # ValueError naming the choices before any work
    if a.standout_threshold is not None:
        standout.standout_rows(torch.zeros(1), a.standout_threshold)  # ValueError for a bad threshold
        standout.STANDOUT_THRESHOLD = a.standout_threshold
    a.out.mkdir(parents=True, exist_ok=True)
    if a.part != "table":
        torch.set_num_threads(1)
        model, tokenizer = load_model(a.model)
        (run_ppl if a.part == "ppl" else run_passkey)(a, model, tokenizer, a.out)
    print(table(a, a.out))
    if a.part == "table" and a.csv is not None:
        write_rows(a, a.out, a.csv)


if __name__ == "__main__":
    main()
