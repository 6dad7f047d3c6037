"""Which part of ``kitty``'s cache loses a passkey: the eval's passkeys under variants of one preset.

Each variant changes one thing of the base preset (``kitty`` unless ``--base``): keys only quantized (values 16-bit),
values only quantized (keys 16-bit), the key low plane only (``boost_fraction=0``: plain 2-bit keys, i.e. without
what the boost adds), and other local-window and sink sizes. Prompts, keys and answers are exactly those of
``kitty.tools.eval.passkey_table`` (``kitty.tools.prompts.passkey_prompt``, ``kitty.tools.eval.passkey_answer``, seed
0). The base runs first on every prompt; ``--cases failed`` then runs the variants only on the prompts the base fails,
``--cases all`` on all of them; fp16 runs on every prompt some variant fails (a prompt counts as lost only if fp16
solves it). Answers accumulate in ``--out/answers.json`` (a (variant, prompt) pair already
measured is not run again), and ``--out/attribution.csv`` holds one row per (variant, prompt).

    python benchmarks/passkey_attribution.py run --cases failed --out /tmp/attribution
    python benchmarks/passkey_attribution.py table --out /tmp/attribution
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import torch

from kitty.core.config import get_preset
from kitty.tools.eval import passkey_answer, passkey_cases
from kitty.tools.prompts import passkey_prompt

# label -> the change to the base preset (get_preset's "+field=value" overrides); "" is the base itself
VARIANTS = {
    "base": "",
    "keys-only": "+value_bits=16",
    "values-only": "+key_bits=16+boost_fraction=0",
    "low-plane-keys": "+boost_fraction=0",
    "local-64": "+local_window=64",
    "local-256": "+local_window=256",
    "sink-0": "+sink_tokens=0",
    "sink-64": "+sink_tokens=64",
}
REFERENCE = "fp16"  # a prompt counts as lost only if fp16 solves it


def case_id(c: tuple) -> str:
    return f"{c[0]}@{c[1]}#{c[2]}"


def run(a, store: dict, path: Path) -> None:
    from kitty.hf.models import load_model

    torch.set_num_threads(1)
    model, tokenizer = load_model()
    cases = passkey_cases()

    def measure(label: str, method: str, todo: list[tuple]) -> None:
        cfg = get_preset(method)
        runs = store.setdefault(label, {"method": method, "answers": {}})
        for c in todo:
            cid = case_id(c)
            if cid in runs["answers"]:
                continue
            if time.time() > a.deadline:
                print(f"deadline reached: {label} stops before {cid}")
                return
            t0 = time.perf_counter()
            answer = passkey_answer(model, tokenizer, passkey_prompt(tokenizer, *c), cfg)
            runs["answers"][cid] = {"answer": answer, "solved": str(c[2]) in answer, "s": time.perf_counter() - t0}
            path.write_text(json.dumps(store, indent=1))  # after every prompt: an interrupted run keeps its answers
            print(f"{label:15s} {cid:22s} solved={str(c[2]) in answer!s:5s} {time.perf_counter() - t0:6.1f}s")

    measure("base", a.base, cases)
    base = store["base"]["answers"]
    failed = [c for c in cases if case_id(c) in base and not base[case_id(c)]["solved"]]
    todo = failed if a.cases == "failed" else cases
    measure(REFERENCE, REFERENCE, failed)  # the base's failures count only where fp16 solves the prompt
    for label in a.variants:
        measure(label, a.base + VARIANTS[label], todo)
        lost = store[label]["answers"]
        measure(REFERENCE, REFERENCE, [c for c in cases if case_id(c) in lost and not lost[case_id(c)]["solved"]])


def rows(store: dict) -> list[dict]:
    out = []
    for label, runs in store.items():
        if label.startswith("_"):
            continue
        for cid, r in runs["answers"].items():
            n, rest = cid.split("@")
            depth, key = rest.split("#")
            out.append(
                dict(
                    variant=label,
                    method=runs["method"],
                    length=int(n),
                    depth=float(depth),
                    key=int(key),
                    solved=int(r["solved"]),
                    answer=r["answer"].strip(),
                    seconds=round(r["s"], 1),
                )
            )
    return out


def table(store: dict) -> str:
    """Markdown: one row per prompt that some run fails, one column per variant (ok / FAIL / — not run), and the
    solved count of each over the prompts it ran."""
    labels = [k for k in store if not k.startswith("_")]
    order = [case_id(c) for c in passkey_cases()]
    lost = {cid for lb in labels for cid, r in store[lb]["answers"].items() if not r["solved"]}
    lines = ["| prompt (length@depth#key) | " + " | ".join(labels) + " |", "|---" * (1 + len(labels)) + "|"]
    for cid in sorted(lost, key=order.index):
        cells = []
        for label in labels:
            x = store[label]["answers"].get(cid)
            cells.append("—" if x is None else ("ok" if x["solved"] else "FAIL"))
        lines.append(f"| {cid} | " + " | ".join(cells) + " |")
    lines.append(
        "| solved / run | "
        + " | ".join(
            f"{sum(x['solved'] for x in store[lb]['answers'].values())}/{len(store[lb]['answers'])}" for lb in labels
        )
        + " |"
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("run", "table"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--base", default="kitty", help="the preset whose lost passkeys are attributed")
    p.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "base"))
    p.add_argument("--cases", choices=("failed", "all"), default="failed", help="prompts the variants run on")
    p.add_argument("--csv", type=Path, default=None, help="where the CSV goes (default: --out/attribution.csv)")
    p.add_argument("--minutes", type=float, default=1e9, help="stop starting prompts after this many minutes")
    a = p.parse_args()
    a.variants = [v for v in a.variants.split(",") if v]
    for v in a.variants:
        if v not in VARIANTS:
            raise ValueError(f"--variants must name entries of {sorted(VARIANTS)}, got {v!r}")
        get_preset(a.base + VARIANTS[v])  # a ValueError before any work
    a.deadline = time.time() + 60 * a.minutes
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "answers.json"
    store = json.loads(path.read_text()) if path.exists() else {}
    if a.part == "run":
        run(a, store, path)
    with open(a.csv or a.out / "attribution.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows(store)[0]) if rows(store) else ["variant"])
        w.writeheader()
        w.writerows(rows(store))
    print(table(store))


if __name__ == "__main__":
    main()
