"""The demo's per-column decode speed for each schedule (threads / interleave) and torch thread count, on the CPU.

    python -m benchmarks.demo_timing [--model NAME] [--new-tokens 32] [--repeats 3] [--prompt TEXT]

Runs :func:`kitty.tools.demo.stream_side_by_side` as the app does (three columns, greedy) and prints a markdown table of
the median slowest-column and mean-column tokens/s and the prefill seconds (numbers quoted in the README's demo
section). Repeats are interleaved across settings because the load of a shared machine drifts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence

import torch

from kitty.hf.generate import Sampling
from kitty.tools.demo import DEFAULT_METHODS, SCHEDULES, stream_side_by_side
from kitty.tools.prompts import example_prompts, prepare_prompt


def benchmark(
    model,
    tokenizer,
    prompt: str,
    new_tokens: int = 32,
    repeats: int = 3,
    threads: Sequence[int] = (1, 2),
    methods: Sequence[str] = DEFAULT_METHODS,
) -> list[dict]:
    """Per-column decode tokens/s of each schedule x torch thread count, repeats interleaved (load drifts).

    Each row: schedule, torch threads, repeat, the slowest and mean column tokens/s and the prefill seconds.
    """
    p = prepare_prompt(tokenizer, prompt, True)
    rows = []
    saved = torch.get_num_threads()
    try:
        for rep in range(repeats):
            for schedule in SCHEDULES:
                for n in threads:
                    torch.set_num_threads(n)
                    t0 = time.perf_counter()
                    for snap in stream_side_by_side(
                        model, tokenizer, p, methods, new_tokens, Sampling(), schedule=schedule
                    ):
                        pass
                    rates = [c.readout.tokens_per_s for c in snap.columns]
                    rows.append(
                        {
                            "schedule": schedule,
                            "torch_threads": n,
                            "repeat": rep,
                            "min_tok_s": min(rates),
                            "mean_tok_s": sum(rates) / len(rates),
                            "prefill_s": max(c.prefill_s for c in snap.columns),
                            "wall_s": time.perf_counter() - t0,
                            "new_tokens": min(len(c.ids) for c in snap.columns),
                        }
                    )
    finally:
        torch.set_num_threads(saved)
    return rows


def main(argv: list[str] | None = None) -> None:
    from kitty.hf.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("KITTY_MODEL") or None)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", default=example_prompts()[0][0])
    a = ap.parse_args(argv)
    model, tok = load_model(a.model)
    torch.set_grad_enabled(False)
    rows = benchmark(model, tok, a.prompt, a.new_tokens, a.repeats)
    print(
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, load average {os.getloadavg()[0]:.1f}, "
        f"{os.cpu_count()} CPUs, {a.new_tokens} new tokens per column, median of {a.repeats}"
    )
    print(
        "| schedule | torch threads | slowest column tok/s | mean column tok/s | prefill s |\n|---|---:|---:|---:|---:|"
    )
    for schedule in SCHEDULES:
        for n in sorted({r["torch_threads"] for r in rows}):
            sel = [r for r in rows if r["schedule"] == schedule and r["torch_threads"] == n]
            med = {k: statistics.median(r[k] for r in sel) for k in ("min_tok_s", "mean_tok_s", "prefill_s")}
            print(f"| {schedule} | {n} | {med['min_tok_s']:.1f} | {med['mean_tok_s']:.1f} | {med['prefill_s']:.2f} |")


if __name__ == "__main__":
    main()
