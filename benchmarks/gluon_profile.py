"""Launch the Gluon decode kernel (``kitty.kernels.decode_gluon``) a few times at one shape, for a profiler to read:
the default launch (``default_gluon_launch``), ``--repeat`` times (the first compiles).

    ncu --clock-control none --kernel-name regex:gluon --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis python -m benchmarks.gluon_profile --rows 8 --context 32768

The layer is ``benchmarks/gluon_check.py``'s (``benchmarks/kernels.py``: 32 query heads over 8 KV heads, D = 128,
random keys and values); ``--preset`` and ``--dtype`` as there, ``--ctas-per-sm`` and ``--min-pages`` as
``default_gluon_launch`` takes them (default: its own). Prints the launch and the time of the last call.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import kernels as kb
from kitty.core.config import get_preset
from kitty.kernels.decode_gluon import decode_attention_gluon
from kitty.kernels.gluon_launch import default_gluon_launch
from kitty.kernels.testing import make_state

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--preset", default="kitty")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float16")
    ap.add_argument("--ctas-per-sm", type=int, default=None)
    ap.add_argument("--min-pages", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    if args.rows < 1 or args.context < 1 or args.repeat < 1:
        raise ValueError(f"--rows, --context and --repeat must be >= 1, got {args.rows}, {args.context}, {args.repeat}")
    cfg, dtype, B, L = get_preset(args.preset), DTYPES[args.dtype], args.rows, args.context
    k, v = kb.gpu_kv(B, L, seed=0)
    state = make_state(cfg, k.to(dtype), v.to(dtype), [L] * B, seed=B)
    q = torch.randn(B, kb.HQ, kb.D, device=kb.DEV, dtype=dtype)
    over = {k: v for k, v in (("ctas_per_sm", args.ctas_per_sm), ("min_pages", args.min_pages)) if v is not None}
    launch = default_gluon_launch(B, kb.HKV, state.k_page_table.shape[1] + 1, q.device, **over)
    workspace: dict = {}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(args.repeat):
        start.record()
        decode_attention_gluon(q, state, cfg, workspace=workspace, launch=launch)
        end.record()
    torch.cuda.synchronize()
    print(f"{args.preset} {args.dtype} B={B} L={L} {launch}: last call {start.elapsed_time(end) * 1e3:.1f} us")


if __name__ == "__main__":
    main()
