"""Search for the demo's long-document example: a fact in a shipped text that 2-bit KIVI loses and Kitty keeps.

    OMP_NUM_THREADS=1 python -m benchmarks.demo_example_search [--budget-s 1100] [--out benchmarks/results/...]

Candidates are :class:`kitty.tools.demo.NeedleDocument` prompts: paragraphs of ``essay.txt`` or ``python_reference.txt``
(:mod:`kitty.tools.prompts`) with one numbered fact (:data:`kitty.tools.demo.NEEDLES`) at some depth, then the question,
in the plain form. Each runs greedily on the default model (SmolLM2-135M, offline), cheapest test first:
``kivi-k2v2-sink``; only where KIVI misses the key, ``kitty``; only where Kitty gives it, ``fp16``. A winner is a prompt
where fp16 and kitty give the key and KIVI does not. The search stops at ``--winners`` winners or when ``--budget-s``
seconds are spent, and writes every candidate tried (``-`` where a column was not run) to a CSV; the app's example
(:data:`kitty.tools.demo.EXAMPLE_NEEDLE`) is the shortest winner.
"""

from __future__ import annotations

import argparse
import csv
import random
import time
from pathlib import Path

import torch

from kitty import get_preset
from kitty.hf.generate import eos_ids, generate_tokens, make_cache
from kitty.hf.models import load_model
from kitty.tools.demo import NEEDLES, NeedleDocument
from kitty.tools.prompts import encode_prompt

OUT = Path(__file__).resolve().parent / "results" / "demo_example_search.csv"
ORDER = ("kivi-k2v2-sink", "kitty", "fp16")  # cheapest rejection first: most candidates KIVI answers right
MAX_NEW_TOKENS = 10


def candidates(seed: int = 0) -> list[NeedleDocument]:
    """Every candidate, shuffled with ``seed`` (shorter documents first within each shuffle pass)."""
    rng = random.Random(seed)
    out = []
    for paragraphs, first_choices in ((3, (1, 5, 9, 13)), (4, (1, 6, 11)), (5, (1, 8, 14))):
        for first in first_choices:
            for depth in (0.0, 0.34, 0.67):
                for needle in NEEDLES:
                    out.append(
                        NeedleDocument("essay.txt", first, paragraphs, depth, needle, rng.randrange(10**4, 10**5))
                    )
    for paragraphs in (30, 45):
        for first in (40, 300, 700):
            for depth in (0.0, 0.34, 0.67):
                for needle in NEEDLES:
                    out.append(
                        NeedleDocument(
                            "python_reference.txt", first, paragraphs, depth, needle, rng.randrange(10**4, 10**5)
                        )
                    )
    rng.shuffle(out)
    return out


def answer(model, tokenizer, eos, doc: NeedleDocument, method: str, ids: torch.Tensor) -> str:
    new = generate_tokens(model, ids, make_cache(model, get_preset(method)), MAX_NEW_TOKENS, eos=eos)
    return tokenizer.decode(new, skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=1100.0, help="stop after this many seconds (default 1100)")
    p.add_argument("--winners", type=int, default=3, help="stop after this many winners (default 3)")
    p.add_argument("--max-tokens", type=int, default=1300, help="skip candidates longer than this (prefill cost)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load_model(None)
    eos = eos_ids(model, tokenizer)
    t0, rows, winners = time.perf_counter(), [], []
    with torch.no_grad():
        for doc in candidates():
            if time.perf_counter() - t0 > args.budget_s or len(winners) >= args.winners:
                break
            ids = encode_prompt(tokenizer, doc.prompt())
            if ids.shape[1] > args.max_tokens:
                continue
            row = {
                "text": doc.text,
                "first": doc.first,
                "paragraphs": doc.paragraphs,
                "depth": doc.depth,
                "needle": doc.needle,
                "key": doc.key,
                "tokens": ids.shape[1],
            }
            for m in ORDER:
                got = answer(model, tokenizer, eos, doc, m, ids)
                ok = doc.answered(got)
                row[f"{m} answer"], row[f"{m} right"] = got.strip(), int(ok)
                if ok == (m == "kivi-k2v2-sink"):  # KIVI right, or kitty/fp16 wrong: not a winner
                    break
            row["winner"] = int(row.get("fp16 right", 0) == 1)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            winners += [row] if row["winner"] else []
            print(
                f"{row['seconds']:7.1f}s {doc.text[:6]} first={doc.first} paras={doc.paragraphs} depth={doc.depth} "
                f"{doc.needle} {ids.shape[1]} tok: "
                + " | ".join(f"{m} {row[m + ' answer']!r}" for m in ORDER if m + " answer" in row)
                + (" WINNER" if row["winner"] else ""),
                flush=True,
            )
    fields = list(rows[0]) if rows else []
    for m in ORDER:
        fields += [f for f in (f"{m} answer", f"{m} right") if f not in fields]
    fields = [f for f in fields if f not in ("winner", "seconds")] + ["winner", "seconds"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="-")
        w.writeheader()
        w.writerows(rows)
    kivi_wrong = sum(r["kivi-k2v2-sink right"] == 0 for r in rows)
    print(
        f"{len(rows)} candidates in {time.perf_counter() - t0:.0f} s: KIVI missed {kivi_wrong}, winners {len(winners)}"
    )
    for r in sorted(winners, key=lambda r: r["tokens"]):
        print(
            f"winner: NeedleDocument({r['text']!r}, {r['first']}, {r['paragraphs']}, {r['depth']}, "
            f"{r['needle']!r}, {r['key']})"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
