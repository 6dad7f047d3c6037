"""Where a captured decode step idles: the GPU gap before each kernel, by kernel, for Kitty and the FP16 bound.

    python -m benchmarks.step_gaps [--points kitty:1:8192,fp16-static-unmasked-cudnn:1:8192] [--layers 36] --out DIR
    python -m benchmarks.step_gaps --parse TRACE.json        # the tables of an exported trace (no GPU)

At batch 1 the kitty step's kernels take as long as FP16's, yet its step is longer: the difference is idle time
between kernels. For each point (``method:batch:context``, the Qwen3-8B shape of ``benchmarks/throughput.py``, random
bf16 weights) this fills a static cache, captures one decode step in a CUDA graph, profiles ``--steps`` replays,
exports the Chrome trace and charges each kernel with the idle gap since the previous kernel ended. It writes
``step_gaps.json`` (per point: wall, kernel and idle time per step, and the kernels and kernel pairs with the most idle
time before them) and ``step_gaps.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks import throughput

TOP = 12


def short(name: str) -> str:
    """A kernel's name without template arguments and parameters, at most 70 characters."""
    name = re.sub(r"<.*", "", re.sub(r"\(.*", "", name)).strip()
    return name[:70]


def gaps(trace: dict, steps: int) -> dict:
    """Per-step kernel time, idle time and the kernels (and pairs) preceded by the most idle time, from a Chrome
    trace's ``kernel`` events (microseconds)."""
    events = sorted(
        (e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"]
    )
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # count, busy, idle before
    by_pair: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    idle = 0.0
    for prev, e in zip(events, events[1:]):
        gap = max(0.0, e["ts"] - (prev["ts"] + prev["dur"]))
        if gap > 200:  # between profiled steps (the host's loop), not inside one
            continue
        name = short(e["name"])
        k = by_kernel[name]
        k[0] += 1
        k[1] += e["dur"]
        k[2] += gap
        pair = by_pair[f"{short(prev['name'])} -> {name}"]
        pair[0] += 1
        pair[1] += gap
        idle += gap
    busy = sum(e["dur"] for e in events)

    def top(table, key):
        rows = sorted(table.items(), key=lambda kv: -kv[1][key])[:TOP]
        return rows

    return dict(
        kernels_per_step=len(events) / steps,
        kernel_us_per_step=busy / steps,
        idle_us_per_step=idle / steps,
        by_kernel=[
            dict(kernel=n, per_step=c / steps, busy_us=b / steps, idle_before_us=i / steps, idle_each_us=i / max(c, 1))
            for n, (c, b, i) in top(by_kernel, 2)
        ],
        by_pair=[
            dict(pair=n, per_step=c / steps, idle_before_us=i / steps, idle_each_us=i / max(c, 1))
            for n, (c, i) in top(by_pair, 1)
        ],
    )


def markdown(results: list[dict]) -> str:
    lines = ["# Idle time inside a captured decode step, by the kernel it precedes", ""]
    for r in results:
        g = r["gaps"]
        lines += [
            f"## {r['method']}, batch {r['batch']}, context {r['context']}",
            "",
            f"wall {r['wall_us_per_step']:.0f} us per step (profiled), kernels {g['kernel_us_per_step']:.0f} us, "
            f"idle between kernels {g['idle_us_per_step']:.0f} us, {g['kernels_per_step']:.0f} kernels per step",
            "",
            "| kernel | per step | busy us/step | idle before, us/step | idle before each, us |",
            "|---|---|---|---|---|",
            *(
                f"| `{k['kernel']}` | {k['per_step']:.0f} | {k['busy_us']:.0f} | {k['idle_before_us']:.0f} | "
                f"{k['idle_each_us']:.2f} |"
                for k in g["by_kernel"]
            ),
            "",
            "| previous -> kernel | per step | idle before, us/step | each, us |",
            "|---|---|---|---|",
            *(
                f"| `{p['pair']}` | {p['per_step']:.0f} | {p['idle_before_us']:.0f} | {p['idle_each_us']:.2f} |"
                for p in g["by_pair"]
            ),
            "",
        ]
    return "\n".join(lines)


@torch.no_grad()
def measure(model, method: str, batch: int, context: int, steps: int, out: Path) -> dict:
    lengths = throughput.static_row_lengths(batch, context, False)
    cache, mask = throughput.fill_static(method, model, lengths, context, 64)
    trace_path = out / f"trace-{method}-{batch}-{context}.json"
    unmasked = "-unmasked-" in method
    old_impl = model.config._attn_implementation
    try:
        if unmasked:
            from torch.nn.attention import sdpa_kernel

            model.config._attn_implementation = throughput.UNMASKED
            with sdpa_kernel([throughput.SDPA_BACKENDS[method.rsplit("-", 1)[1]]]):
                _, busy = throughput.static_decode(model, cache, mask, lengths, context, 8, 2, True, steps, trace_path)
        else:
            _, busy = throughput.static_decode(model, cache, mask, lengths, context, 8, 2, True, steps, trace_path)
    finally:
        model.config._attn_implementation = old_impl
    trace = json.loads(trace_path.read_text())
    trace_path.unlink()  # tens of MB: the tables are what is kept
    del cache
    torch.cuda.empty_cache()
    return dict(
        method=method,
        batch=batch,
        context=context,
        wall_us_per_step=busy["wall_ms_per_step"] * 1e3,
        gaps=gaps(trace, steps),
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", default="kitty:1:8192,fp16-static-unmasked-cudnn:1:8192,kitty:16:8192")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--steps", type=int, default=3, help="profiled replays per point")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--parse", type=Path, help="only print the tables of this exported trace")
    args = p.parse_args(argv)
    if args.parse:
        print(markdown([dict(method=args.parse.name, batch=0, context=0, wall_us_per_step=0.0,
                             gaps=gaps(json.loads(args.parse.read_text()), args.steps))]))  # fmt: skip
        return
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = throughput.build_model(args.layers)
    results = []
    for item in filter(None, args.points.split(",")):
        method, batch, context = item.split(":")
        results.append(measure(model, method, int(batch), int(context), args.steps, args.out))
        print(f"{time.perf_counter() - t0:6.0f}s {item}: {json.dumps(results[-1]['gaps'])[:300]}", flush=True)
    (args.out / "step_gaps.json").write_text(json.dumps(results, indent=1))
    (args.out / "step_gaps.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
