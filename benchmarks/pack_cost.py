"""Pack-time cost per page of every key-selection and range strategy on one GPU (``kitty.tools.eval.pack_cost_table``).

    python -m benchmarks.pack_cost [--out DIR] [--repeats 7]

Pages of ``--pages`` rows x 8 KV heads x D=128 in fp16 (the kernel benchmark's layer shape), torch quantizers,
CUDA-synchronized median per page. Writes ``pack_cost.csv`` to ``--out`` (default
``benchmarks/results/<gpu>-<date>/``); ``--cpu-smoke`` runs 2 pages on the CPU (plumbing only).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.results_dir import default_out, unused_path
from kitty.tools.eval_metrics import pack_cost_table
from kitty.tools.eval_report import write_csv

# The strategies of README's pack-cost table: paper rule, the selection rules, fitted key / value ranges.
METHODS = [
    "kitty",
    "kitty-range",
    "kitty-query",
    "kitty-oracle",
    "kitty+key_range=fit",
    "kitty-fit",
    "kitty-fit+value_range=fit",
    "kitty-pro",
    "kitty-pro-fit",
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for pack_cost.csv (default: benchmarks/results/<gpu>-<date>/)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--pages", type=int, default=64, help="pages per call (one per batch row)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cpu-smoke", action="store_true", help="2 pages on the CPU (plumbing only)")
    a = ap.parse_args(argv)
    device = "cpu" if a.cpu_smoke else "cuda"
    if not a.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --cpu-smoke)")
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    out = Path(a.out) if a.out else default_out(name)
    out.mkdir(parents=True, exist_ok=True)
    rows = pack_cost_table(
        a.methods.split(","),
        head_dim=128,
        heads=8,
        pages=2 if a.cpu_smoke else a.pages,
        repeats=1 if a.cpu_smoke else a.repeats,
        dtype=torch.float16,
        device=device,
    )
    path = unused_path(out, "pack_cost.csv")
    write_csv(rows, path)
    print("wrote", path)


if __name__ == "__main__":
    main()
