"""Evaluation harness: decode perplexity, greedy agreement with fp16 and passkey retrieval per preset.

``python -m kitty.eval [--model NAME] [--methods a,b,...] [--quick]`` writes a markdown table, a CSV and plots
into ``./kitty-eval/`` under the working folder (or ``--out``; ``--out assets`` refreshes the files the README cites). Every number is measured through :class:`kitty.KittyCache` exactly as generation
uses it: the prompt (prefill) is attended in full precision, every later token reads the quantized cache.

``torchrun --nproc-per-node N -m kitty.eval --model PATH ...`` shards the model over N ranks (``tp_plan="auto"``,
or ``--tp``); every rank runs the same evaluation on its KV heads, rank 0 alone shows progress and writes results.
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm as _tqdm

from . import cliargs
from . import generate as gen
from .config import PRESETS, KVQuantConfig, get_preset
from .generate import eos_ids, generate_tokens, make_cache
from .models import tp_rank_and_size
from .prompts import TEXTS, encode_prompt, passkey_prompt, shipped_text

DEFAULT_OUT = "kitty-eval"  # relative to the working folder: a run never overwrites the committed assets/ unless asked


def tqdm(*args, **kwargs):
    """A progress bar shown by rank 0 only: under tensor parallelism every rank runs the same loops."""
    kwargs.setdefault("disable", tp_rank_and_size()[0] != 0)
    return _tqdm(*args, **kwargs)


# ------------------------------------------------------------------------------------- decode perplexity


@torch.no_grad()
def decode_nll(model, ids: torch.Tensor, cfg: KVQuantConfig, prefill: int) -> torch.Tensor:
    """Teacher-forced NLL of ``ids[prefill:]``, scored one decode step at a time through a Kitty cache.

    ``ids``: ``[T]`` token ids. Returns ``[T - prefill]`` per-token NLL (nats): token ``prefill`` is scored from
    the prefill's last logits, every later token from a single-token decode step that reads the quantized cache.
    """
    if not 0 < prefill < ids.numel():
        raise ValueError(f"prefill must be in (0, {ids.numel()}), got {prefill}")
    ids = ids.to(model.device)
    cache = make_cache(model, cfg)
    logits = gen.prefill(model, ids[None, :prefill], cache)
    nll = []
    for t in range(prefill, ids.numel()):
        nll.append(F.cross_entropy(logits.float()[None], ids[t : t + 1]))
        if t + 1 < ids.numel():
            logits = gen.decode_one_token(model, cache, ids[t])
    return torch.stack(nll)


def text_windows(
    tokenizer, names=TEXTS, prefill: int = 1024, scored: int = 256, per_text: int = 2, with_names: bool = False
) -> list:
    """Non-overlapping windows of ``prefill + scored`` tokens from the texts shipped in ``kitty/texts/``.

    Returns ``[T]`` id tensors, or ``(text name, ids)`` pairs with ``with_names``.
    """
    windows = []
    for name in names:
        ids = tokenizer(shipped_text(name), return_tensors="pt").input_ids[0]
        size = prefill + scored
        n = min(per_text, ids.numel() // size)
        if n == 0:
            raise ValueError(f"{name} has {ids.numel()} tokens, fewer than prefill + scored = {size}")
        windows += [(name, ids[i * size : (i + 1) * size]) for i in range(n)]
    return windows if with_names else [w for _, w in windows]


@dataclass
class PerplexityResult:
    method: str
    nll: float
    ppl: float
    ppl_change: float  # relative to fp16 on the same text(s), e.g. 0.10 = +10%
    bits_per_element: float  # of the cache after the run, one window (includes full-precision parts)
    tokens_scored: int
    text: str = "all"  # "all" or the shipped text the windows came from


_WORKER: dict = {}


def _worker_init(model_name: str | None) -> None:
    torch.set_num_threads(1)
    from .models import load_model

    _WORKER["model"] = load_model(model_name)[0]


def _worker_nll(cfg: KVQuantConfig, windows: list[torch.Tensor], prefill: int) -> list[torch.Tensor]:
    return [decode_nll(_WORKER["model"], w, cfg, prefill) for w in windows]


def perplexity_table(
    model, tokenizer, methods, prefill=1024, scored=256, per_text=2, names=TEXTS, by_text: bool = False, jobs: int = 1
) -> list[PerplexityResult]:
    """Decode-mode perplexity of each method (preset name or :class:`KVQuantConfig`) on the shipped texts, with the
    change against ``fp16``; ``fp16`` is always evaluated first.

    ``by_text``: after the ``text="all"`` rows, one row per (text, method), its change against fp16 on that text.
    ``jobs > 1``: methods run in that many worker processes (each loads the model from
    ``model.config._name_or_path`` with one torch thread; set ``OMP_WAIT_POLICY=PASSIVE`` on small CPUs).
    """
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    named = text_windows(tokenizer, names, prefill, scored, per_text, with_names=True)
    windows = [w for _, w in named]
    cfgs = [get_preset(m) if isinstance(m, str) else m for m in methods]
    cfgs = [get_preset("fp16")] + [c for c in cfgs if c.name != "fp16"]
    if jobs == 1:
        with tqdm(total=len(cfgs) * len(windows), desc="perplexity", unit="window") as bar:
            nlls = []
            for c in cfgs:
                nlls.append([])
                for w in windows:
                    bar.set_postfix_str(c.name)
                    nlls[-1].append(decode_nll(model, w, c, prefill))
                    bar.update()
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        ctx = mp.get_context("spawn")
        with ProcessPoolExecutor(
            jobs, mp_context=ctx, initializer=_worker_init, initargs=(model.config._name_or_path,)
        ) as pool:
            futures = [pool.submit(_worker_nll, c, windows, prefill) for c in cfgs]
            nlls = [f.result() for f in tqdm(futures, desc=f"perplexity ({jobs} processes)")]
    groups = [("all", list(range(len(windows))))]
    if by_text:
        groups += [(Path(t).stem, [i for i, (n, _) in enumerate(named) if n == t]) for t in names]
    results = []
    for text, idx in groups:
        rows = []
        for c, per_window in zip(cfgs, nlls):
            nll = torch.cat([per_window[i] for i in idx]).mean().item()
            rows.append(
                PerplexityResult(
                    c.name, nll, math.exp(nll), 0.0, _bits_after(model, c, prefill + scored), len(idx) * scored, text
                )
            )
        for r in rows:
            r.ppl_change = r.ppl / rows[0].ppl - 1
        results += rows
    return results


# ------------------------------------------------------------------------------------------- pack-time cost


@dataclass
class PackCost:
    method: str
    channel_selection: str
    key_range: str
    value_range: str
    us_per_key_page: float  # one page of G tokens x D channels, one KV head (median, torch on this CPU)
    us_per_value_page: float
    vs_paper_rule: float  # (key + value page time) / the same with magnitude selection and min-max ranges


def pack_cost_table(
    methods,
    head_dim: int = 64,
    heads: int = 3,
    pages: int = 8,
    repeats: int = 7,
    dtype=torch.bfloat16,
    device: str | torch.device = "cpu",
) -> list[PackCost]:
    """Time to pack ``pages x heads`` pages per call with the torch quantizers, per page, for each method
    (on ``device``; CUDA calls are synchronized before the clock stops).

    Decode attention never sees the difference (it reads the same page layout); this is the one-off cost of
    choosing channels and ranges when a qbuffer fills, once per ``G`` tokens.
    """
    from .quant import quantize_key_page, quantize_value_page

    g = torch.Generator().manual_seed(0)
    cfgs = [get_preset(m) if isinstance(m, str) else m for m in methods]
    G = cfgs[0].group_size
    k = (torch.randn(pages, heads, G, head_dim, generator=g) * torch.linspace(0.2, 4, head_dim)).to(device, dtype)
    v = torch.randn(pages, heads, G, head_dim, generator=g).to(device, dtype)
    q = (torch.rand(pages, heads, head_dim, generator=g) + 0.5).to(device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def median_us(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return 1e6 * sorted(times)[len(times) // 2] / (pages * heads)

    rows = []
    for c in tqdm(cfgs, desc="pack cost"):
        c = c.with_(boost_profile=None) if c.boost_profile else c  # a profile's average layer: the uniform budget
        tk = median_us(lambda: quantize_key_page(k, c, query_scale=q))
        tv = median_us(lambda: quantize_value_page(v, c))
        plain = c.with_(channel_selection="magnitude", key_range="minmax", value_range="minmax")
        if plain == c:  # the paper rule itself: its own time, exactly 1 (two timings would differ by noise)
            base = tk + tv
        else:
            base = median_us(lambda: quantize_key_page(k, plain)) + median_us(lambda: quantize_value_page(v, plain))
        rows.append(PackCost(c.name, c.channel_selection, c.key_range, c.value_range, tk, tv, (tk + tv) / base))
    return rows


def _bits_after(model, cfg, n_tokens: int) -> float:
    from .memory import analytic_report
    from .models import kv_dims

    num_layers, num_kv_heads, head_dim = kv_dims(model.config)
    rep = analytic_report(cfg, n_tokens, head_dim, num_kv_heads, num_layers, model.dtype.itemsize)
    return rep.bits_per_element


# -------------------------------------------------------------------------------------- greedy agreement


def agreement_prompts(tokenizer, n: int = 6, length: int = 512, names=TEXTS) -> list[str]:
    """``n`` plain-text prompts of about ``length`` tokens cut from the texts shipped in ``kitty/texts/`` (alternating texts).

    Long enough that decode steps read quantized pages (a short chat question never leaves the full-precision
    sink, qbuffer and local window, so it would agree with fp16 trivially).
    """
    streams = [tokenizer(shipped_text(name)).input_ids for name in names]
    prompts = []
    for i in range(n):
        ids = streams[i % len(streams)]
        start = (i // len(streams)) * length
        if start + length > len(ids):
            raise ValueError(f"{names[i % len(names)]} is too short for {n} prompts of {length} tokens")
        prompts.append(tokenizer.decode(ids[start : start + length]))
    return prompts


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, cfg: KVQuantConfig, max_new_tokens: int, chat: bool = False) -> list[int]:
    """Greedy continuation of ``prompt`` (plain text, or wrapped in the chat template) through a Kitty cache:
    exactly ``max_new_tokens`` tokens (end-of-sequence tokens are never picked, like ``min_new_tokens``)."""
    ids = encode_prompt(tokenizer, prompt, chat)
    eos = eos_ids(model, tokenizer)
    return generate_tokens(model, ids, make_cache(model, cfg), max_new_tokens, eos=eos, min_new_tokens=max_new_tokens)


@dataclass
class AgreementResult:
    method: str
    mean_identical_prefix: float  # tokens before the first difference from fp16
    match_rate: float  # share of positions with the same token as fp16


def agreement_table(model, tokenizer, methods, prompts: list[str], max_new_tokens: int = 64) -> list[AgreementResult]:
    """Greedy agreement of each preset with ``fp16`` over a prompt set (see :func:`agreement_prompts`)."""
    ref = [greedy(model, tokenizer, p, PRESETS["fp16"], max_new_tokens) for p in tqdm(prompts, desc="agreement fp16")]
    results = []
    bar = tqdm(total=len(methods) * len(prompts), desc="agreement", unit="prompt")
    for m in methods:
        cfg = get_preset(m)
        bar.set_postfix_str(cfg.name)
        prefixes, matches = [], []
        for p, r in zip(prompts, ref):
            out = greedy(model, tokenizer, p, cfg, max_new_tokens)
            bar.update()
            same = [a == b for a, b in zip(out, r)]
            prefixes.append(same.index(False) if False in same else len(same))
            matches.append(sum(same) / len(same))
        results.append(AgreementResult(cfg.name, sum(prefixes) / len(prefixes), sum(matches) / len(matches)))
    bar.close()
    return results


# ---------------------------------------------------------------------------------------------- passkey


def passkey_answer(model, tokenizer, prompt: str, cfg: KVQuantConfig, max_new_tokens: int = 8) -> str:
    """Greedy answer (up to ``max_new_tokens``, ending at end-of-sequence) to a plain ``prompt`` through a Kitty
    cache under ``cfg`` (prompts: :func:`kitty.prompts.passkey_prompt`)."""
    ids = encode_prompt(tokenizer, prompt)
    new = generate_tokens(model, ids, make_cache(model, cfg), max_new_tokens, eos=eos_ids(model, tokenizer))
    return tokenizer.decode(new, skip_special_tokens=True)


@dataclass
class PasskeyResult:
    method: str
    length: int
    depth: float
    solved: int  # prompts answered correctly, among those fp16 solves
    total: int  # prompts fp16 solves


def passkey_table(
    model, tokenizer, methods, lengths=(1024, 2048, 4096), depths=(0.1, 0.3, 0.5, 0.7, 0.9), trials=2, seed=0
) -> list[PasskeyResult]:
    """Passkey accuracy per (length, depth) on the prompts that ``fp16`` solves."""
    rng = random.Random(seed)
    cases = [(n, d, rng.randint(10000, 99999)) for n in lengths for d in depths for _ in range(trials)]
    prompts = {c: passkey_prompt(tokenizer, c[0], c[1], c[2]) for c in cases}
    fp16_ok = [
        c
        for c in tqdm(cases, desc="passkey fp16")
        if str(c[2]) in passkey_answer(model, tokenizer, prompts[c], PRESETS["fp16"])
    ]
    results = []
    bar = tqdm(total=len(methods) * len(fp16_ok), desc="passkey", unit="prompt")
    for m in methods:
        cfg = get_preset(m)
        bar.set_postfix_str(cfg.name)
        ok = {}
        for c in fp16_ok:
            ok[c] = str(c[2]) in passkey_answer(model, tokenizer, prompts[c], cfg)
            bar.update()
        for n in lengths:
            for d in depths:
                cs = [c for c in fp16_ok if c[0] == n and c[1] == d]
                results.append(PasskeyResult(cfg.name, n, d, sum(ok[c] for c in cs), len(cs)))
    bar.close()
    return results


# -------------------------------------------------------------------------------------------------- output


def markdown_table(rows: list, floatfmt: str = ".3f") -> str:
    """A markdown table from a list of dataclass rows."""
    if not rows:
        return ""
    d = [asdict(r) for r in rows]
    head = list(d[0])
    fmt = lambda v: format(v, floatfmt) if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in head) + " |" for r in d]
    return "\n".join(lines)


def ppl_markdown(rows: list[PerplexityResult]) -> str:
    """Perplexity rows as one markdown table: bits, ppl and change over all windows, then the change per text."""
    texts = list(dict.fromkeys(r.text for r in rows if r.text != "all"))
    by = {(r.method, r.text): r for r in rows}
    lines = [
        "| method | bits/element | ppl | change | " + " | ".join(f"change ({t})" for t in texts) + " |",
        "|---" * (4 + len(texts)) + "|",
    ]
    for r in rows:
        if r.text == "all":
            per = " | ".join(f"{100 * by[(r.method, t)].ppl_change:+.1f}%" for t in texts)
            lines.append(
                f"| {r.method} | {r.bits_per_element:.3f} | {r.ppl:.2f} | {100 * r.ppl_change:+.1f}% | {per} |"
            )
    return "\n".join(lines)


def write_csv(rows: list, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        w.writerows(asdict(r) for r in rows)


def _markers(n: int) -> list[tuple]:
    """``n`` distinct (colour, marker) pairs: tab20 colours, cycling through markers past 20."""
    import matplotlib

    colours = matplotlib.colormaps["tab20"].colors
    marks = "osD^vP*Xh<>"
    return [(colours[i % 20], marks[(i // 20 + i) % len(marks)]) for i in range(n)]


def plot_pareto(ppl: list[PerplexityResult], path: Path) -> None:
    """Perplexity change against bits per element, one point per preset: every preset on a log-2 bits axis with
    whole-number ticks, and the quantized presets alone (they cluster at 2-5 bits), named in one legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    quantized = [r for r in ppl if r.bits_per_element < 16]
    panels = 2 if quantized and len(quantized) < len(ppl) else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels + 2.6, 4.2), squeeze=False)
    style = dict(zip((r.method for r in ppl), _markers(len(ppl))))
    for ax, rows in zip(axes[0], [ppl, quantized][:panels]):
        for r in rows:
            colour, marker = style[r.method]
            ax.scatter(r.bits_per_element, 100 * r.ppl_change, color=colour, marker=marker, s=40, label=r.method)
        ax.set_ylabel("decode perplexity change vs fp16 (%)")
        ax.grid(alpha=0.3)
    ax = axes[0][0]
    bits = [r.bits_per_element for r in ppl]
    ax.set_xscale("log", base=2)
    lo, hi = min(bits) / 1.15, max(bits) * 1.15
    ax.set_xlim(lo, hi)
    ax.xaxis.set_major_locator(
        FixedLocator([t for t in (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 32) if lo <= t <= hi])
    )
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("KV bits per element (whole cache, log scale)")
    ax.set_title("all presets", fontsize=10)
    if panels == 2:
        axes[0][1].set_xlabel("KV bits per element (whole cache)")
        axes[0][1].set_title("quantized presets (fp16 left out)", fontsize=10)
    fig.legend(
        *axes[0][0].get_legend_handles_labels(),
        loc="center left",
        bbox_to_anchor=(0.995, 0.5),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_passkey(results: list[PasskeyResult], path: Path, per_row: int = 4) -> None:
    """One heatmap of accuracy per (length, depth) for each preset, ``per_row`` presets per row of panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    methods = list(dict.fromkeys(r.method for r in results))
    lengths = sorted({r.length for r in results})
    depths = sorted({r.depth for r in results})
    cols = min(per_row, len(methods))
    rows = -(-len(methods) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(0.9 * len(lengths) * cols + 1.2, 0.45 * len(depths) * rows + 1.1 * rows), squeeze=False
    )
    for i, ax in enumerate(axes.flat):
        if i >= len(methods):
            ax.axis("off")
            continue
        m = methods[i]
        grid = [
            [
                next(
                    (r.solved / r.total if r.total else float("nan"))
                    for r in results
                    if r.method == m and r.length == n and r.depth == d
                )
                for n in lengths
            ]
            for d in depths
        ]
        sns.heatmap(
            grid,
            ax=ax,
            vmin=0,
            vmax=1,
            cmap="viridis",
            cbar=False,
            annot=True,
            fmt=".1f",
            xticklabels=lengths,
            yticklabels=depths if i % cols == 0 else False,
        )
        ax.set_title(m, fontsize=8)
        ax.tick_params(axis="y", rotation=0)
        ax.set_xlabel("context (tokens)", fontsize=8)
        if i % cols == 0:
            ax.set_ylabel("key depth")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ command line

PARTS = ("ppl", "agreement", "passkey", "pack")
QUICK = dict(prefill=160, scored=32, windows_per_text=1, agreement=(2, 200, 16), lengths=(256,), depths=(0.5,))
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
AGREEMENT_LENGTH = 512  # tokens per agreement prompt (long enough that decode steps read quantized pages)
PASSKEY_ANSWER_TOKENS = 8  # passkey_answer's max_new_tokens
TAG_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m kitty.eval``, each with its help and default."""
    p = argparse.ArgumentParser(
        prog="python -m kitty.eval",
        description=__doc__.splitlines()[0],
        epilog=f"parts (--skip): ppl = decode perplexity, agreement = greedy agreement with fp16, passkey = passkey "
        f"retrieval, pack = pack-time cost per page. presets: {', '.join(PRESETS)}.",
    )
    cliargs.add_model(p)
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated presets, each optionally +field=value... (default: every preset that fits the model)",
    )
    p.add_argument(
        "--out", default=DEFAULT_OUT, help=f"folder for the markdown, CSV and plots (default: ./{DEFAULT_OUT})"
    )
    p.add_argument("--prefill", type=int, default=1024, help="prompt tokens per perplexity window (default: 1024)")
    p.add_argument("--scored", type=int, default=256, help="decode-scored tokens per perplexity window (default: 256)")
    p.add_argument("--windows-per-text", type=int, default=2, help="perplexity windows per shipped text (default: 2)")
    p.add_argument(
        "--passkey-lengths",
        default="1024,2048,4096",
        help="comma-separated passkey prompt lengths in tokens (default: 1024,2048,4096)",
    )
    p.add_argument("--agreement-prompts", type=int, default=6, help="prompts for greedy agreement (default: 6)")
    p.add_argument("--agreement-tokens", type=int, default=64, help="greedy tokens per agreement prompt (default: 64)")
    p.add_argument("--passkey-trials", type=int, default=2, help="passkey prompts per (length, depth) (default: 2)")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny run for CI (default: off): prefill {QUICK['prefill']}, {QUICK['scored']} scored tokens, one "
        "window per text, 2 agreement prompts of 200 tokens x 16 tokens, one 256-token passkey per method; "
        "overrides the size flags above",
    )
    p.add_argument("--skip", default="", help=f"comma-separated parts to skip, from {','.join(PARTS)} (default: none)")
    p.add_argument(
        "--jobs", type=int, default=1, help="worker processes for perplexity, one torch thread each (default: 1)"
    )
    p.add_argument("--tag", default=None, help="suffix of the output files (default: full, or quick with --quick)")
    cliargs.add_tp(p)
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    with cliargs.closing_distributed():
        _run(a)


def _fail(message: str) -> None:
    """Exit with status 2 and ``message`` (said once, by rank 0: every rank meets the same error)."""
    cliargs.say_error(message)
    raise SystemExit(2)


def _check_flags(a: argparse.Namespace) -> tuple[list[str] | None, set[str]]:
    """Every flag that can be checked without the model, each refused with a message naming it: the methods (or
    ``None`` for every preset that fits), the parts to skip; ``a.passkey_lengths`` becomes a tuple of ints."""
    try:
        methods = None if a.methods is None else cliargs.parse_methods(a.methods)
        skip = {s.strip() for s in a.skip.split(",")} - {""}
        if skip - set(PARTS):
            raise ValueError(f"--skip takes parts from {PARTS}, got {sorted(skip - set(PARTS))}")
        if skip == set(PARTS):
            raise ValueError(f"--skip {a.skip!r} skips every part: nothing to run")
        cliargs.check_at_least_one(
            prefill=a.prefill,
            scored=a.scored,
            windows_per_text=a.windows_per_text,
            agreement_prompts=a.agreement_prompts,
            agreement_tokens=a.agreement_tokens,
            passkey_trials=a.passkey_trials,
            jobs=a.jobs,
        )
        a.passkey_lengths = cliargs.parse_numbers(a.passkey_lengths, "--passkey-lengths")
        if min(a.passkey_lengths) < 1:
            raise ValueError(f"--passkey-lengths must be >= 1 each, got {a.passkey_lengths}")
        if a.tag is not None and (not a.tag or set(a.tag) - TAG_CHARS):
            raise ValueError(f"--tag must be letters, digits, '.', '_' or '-' (it names files), got {a.tag!r}")
        cliargs.check_model_path(a.model)
    except ValueError as e:
        _fail(str(e))
    problem = cliargs.writable_folder(Path(a.out), "--out")
    if problem:
        _fail(problem)
    if a.quick:
        a.prefill, a.scored, a.windows_per_text = QUICK["prefill"], QUICK["scored"], QUICK["windows_per_text"]
    return methods, skip


def measure_step(model, cfg: KVQuantConfig, context: int = 192, steps: int = 3) -> tuple[float, float]:
    """Rough ``(seconds per decode step, seconds per prompt token)`` of ``model`` through a cache under ``cfg`` on
    this machine: one prefill of ``context`` tokens, then ``steps`` decode steps (the runtime estimate)."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = (torch.arange(context) * 7919 % vocab).to(model.device)
    cache = make_cache(model, cfg)
    start = time.perf_counter()
    gen.prefill(model, ids[None], cache)
    mid = time.perf_counter()
    for i in range(steps):
        gen.decode_one_token(model, cache, ids[i])
    return (time.perf_counter() - mid) / steps, (mid - start) / context


def _duration(seconds: float) -> str:
    return (
        f"{seconds:.0f} s"
        if seconds < 90
        else f"{seconds / 60:.0f} min"
        if seconds < 5400
        else f"{seconds / 3600:.1f} h"
    )


def _run(a: argparse.Namespace) -> None:
    methods, skip = _check_flags(a)
    from .models import check_tensor_parallel, kv_dims, load_model

    try:
        rank, world, tp = cliargs.tensor_parallel(a.tp)
    except ValueError as e:
        _fail(str(e))
    if tp and a.jobs > 1:
        _fail("--jobs > 1 starts unsharded worker processes; under tensor parallelism use --jobs 1")
    if tp:
        try:
            check_tensor_parallel(a.model, world)  # before the weights load
        except ValueError as e:
            _fail(f"cannot shard the model over {world} ranks: {e}")
    try:
        model, tokenizer = load_model(a.model, tp_plan="auto" if tp else None)
    except (OSError, ValueError, RuntimeError) as e:
        _fail(f"--model {a.model!r}: cannot load the model: {e}")
    text = model.config.get_text_config(decoder=True)
    num_layers = kv_dims(model.config)[0]
    if methods is None:  # layer-adaptive presets are calibrated for one model: keep those that fit this one
        methods = [
            m for m in PRESETS if PRESETS[m].boost_profile is None or len(PRESETS[m].boost_profile) == num_layers
        ]
    for m in methods:  # the cache's own checks (boost_profile length, head_dim, ...) before any work
        try:
            make_cache(model, get_preset(m))
        except ValueError as e:
            _fail(f"--methods: {m!r} does not fit this model: {e}")
    others = [m for m in methods if get_preset(m).name != "fp16"]
    pack_methods = [m for m in methods if get_preset(m).quantizes_keys]
    runs = {
        "ppl": True,
        "agreement": bool(others),
        "passkey": bool(others),
        "pack": bool(pack_methods),
    }
    parts = [p for p in PARTS if p not in skip and runs[p]]
    for p in PARTS:
        if p not in skip and not runs[p] and rank == 0:
            print(f"note: {p} is skipped: it needs a method other than fp16{' with quantized keys' * (p == 'pack')}")
    if not parts:
        _fail("nothing to run with these --methods and --skip")

    # sizes that depend on the tokenizer and the model, checked before any part runs
    n_prompts, length, n_new = (
        QUICK["agreement"] if a.quick else (a.agreement_prompts, AGREEMENT_LENGTH, a.agreement_tokens)
    )
    lengths = QUICK["lengths"] if a.quick else a.passkey_lengths
    depths = QUICK["depths"] if a.quick else DEPTHS
    trials = 1 if a.quick else a.passkey_trials
    max_pos = getattr(text, "max_position_embeddings", None)
    windows = prompts = None
    if "ppl" in parts:
        try:
            windows = text_windows(tokenizer, TEXTS, a.prefill, a.scored, a.windows_per_text)
        except ValueError as e:
            _fail(f"--prefill {a.prefill} + --scored {a.scored} do not fit the shipped texts: {e}")
        if max_pos and a.prefill + a.scored > max_pos:
            _fail(f"--prefill + --scored = {a.prefill + a.scored} exceeds the model's {max_pos} positions")
    if "agreement" in parts:
        try:
            prompts = agreement_prompts(tokenizer, n_prompts, length)
        except ValueError as e:
            _fail(f"--agreement-prompts {n_prompts}: {e}")
    if "passkey" in parts and max_pos and max(lengths) + PASSKEY_ANSWER_TOKENS > max_pos:
        _fail(f"--passkey-lengths {max(lengths)} exceeds the model's {max_pos} positions")

    out = Path(a.out)
    tag = a.tag or ("quick" if a.quick else "full")
    step_s, token_s = measure_step(model, get_preset(pack_methods[0] if pack_methods else methods[0]))
    n_cfg = 1 + len(others)
    steps = tokens = 0.0
    if "ppl" in parts:
        share = 1 / min(a.jobs, n_cfg)  # methods run side by side in the worker processes
        steps += n_cfg * len(windows) * a.scored * share
        tokens += n_cfg * len(windows) * a.prefill * share
    if "agreement" in parts:
        steps, tokens = steps + n_cfg * n_prompts * n_new, tokens + n_cfg * n_prompts * length
    if "passkey" in parts:
        cases = len(lengths) * len(depths) * trials
        steps += n_cfg * cases * PASSKEY_ANSWER_TOKENS
        tokens += n_cfg * trials * len(depths) * sum(lengths)
    t0 = time.time()
    if rank == 0:
        print(
            f"parts: {', '.join(parts)}; {len(methods)} methods. Estimated runtime: about "
            f"{_duration(steps * step_s + tokens * token_s)} ({steps:.0f} decode steps at {1e3 * step_s:.0f} ms, "
            f"{tokens:.0f} prompt tokens at {1e3 * token_s:.1f} ms each, measured just now; rough: longer contexts "
            "run slower)",
            flush=True,
        )
    report = [f"# Kitty evaluation ({tag})\n", f"model: {a.model or 'SmolLM2-135M-Instruct (embedded)'}\n"]
    wrote: list[Path] = []

    def save(name: str, write) -> None:
        """Write one result file now (rank 0), so that a later failure keeps it; and the report so far."""
        if rank == 0:
            write(out / name)
            (out / f"eval_{tag}.md").write_text("\n".join(report))
            wrote.extend(p for p in (out / name, out / f"eval_{tag}.md") if p not in wrote)

    if "ppl" in parts:
        ppl = perplexity_table(
            model, tokenizer, methods, a.prefill, a.scored, a.windows_per_text, by_text=True, jobs=a.jobs
        )
        report += [
            f"## Decode perplexity (prefill {a.prefill}, {a.scored} scored tokens per window, {a.windows_per_text} windows per text)\n",
            ppl_markdown(ppl),
            "",
        ]
        save(f"eval_ppl_{tag}.csv", lambda p: write_csv(ppl, p))
        save(f"eval_pareto_{tag}.png", lambda p: plot_pareto([r for r in ppl if r.text == "all"], p))
    if "agreement" in parts:
        agr = agreement_table(model, tokenizer, others, prompts, n_new)
        report += [
            f"## Greedy agreement with fp16 ({n_prompts} plain-text prompts of {length} tokens from kitty/texts/, {n_new} new tokens)\n",
            markdown_table(agr),
            "",
        ]
        save(f"eval_agreement_{tag}.csv", lambda p: write_csv(agr, p))
    if "passkey" in parts:
        pk = passkey_table(model, tokenizer, others, lengths, depths, trials)
        totals = {}
        for r in pk:
            s, t = totals.get(r.method, (0, 0))
            totals[r.method] = (s + r.solved, t + r.total)
        report += ["## Passkey (plain form, prompts fp16 solves)\n", "| method | solved |", "|---|---|"]
        report += [f"| {m} | {s}/{t} |" for m, (s, t) in totals.items()] + [""]
        save(f"eval_passkey_{tag}.csv", lambda p: write_csv(pk, p))
        save(f"eval_passkey_{tag}.png", lambda p: plot_passkey(pk, p))
    if "pack" in parts:
        pack = pack_cost_table(pack_methods, repeats=3 if a.quick else 7)
        report += [
            "## Pack-time cost per page (torch quantizers on this CPU; decode attention is unchanged)\n",
            markdown_table(pack, ".1f"),
            "",
        ]
        save(f"eval_pack_{tag}.csv", lambda p: write_csv(pack, p))
    where = f" per rank, {world} tensor-parallel ranks" if tp else ""
    report.append(f"_{time.time() - t0:.0f} s on {torch.get_num_threads()} CPU threads{where}_\n")
    if rank == 0:
        text = "\n".join(report)
        (out / f"eval_{tag}.md").write_text(text)
        print(text)
        for path in wrote:
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
