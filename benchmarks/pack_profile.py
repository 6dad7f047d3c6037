"""Launch the static decode step's pack (``kitty.kernels.pack_completed``) a few times on one page-completing layer,
for a profiler to read: the keys alone, the values alone, then both, ``--repeat`` launches each (the first of each
compiles).

    ncu --clock-control none --kernel-name regex:_pack_kernel --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats python -m benchmarks.pack_profile

The layer is ``benchmarks/pack_speed.py``'s (8 KV heads, D = 128, G = 128, bf16, every row completing a key and a
value page); ``--rows`` rows, ``--preset``, ``--warps`` and ``--tile`` as :func:`kitty.kernels.pack_completed` takes
them (default: its own launch).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.pack_speed import clone, layer, set_lengths
from kitty.core.config import get_preset
from kitty.kernels.pack import pack_completed


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument("--preset", default="kitty")
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--tile", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    cfg = get_preset(args.preset)
    width = 2 + cfg.local_window // cfg.group_size + min(args.rows, 4)
    st = layer(cfg, args.rows, 8, 128, torch.bfloat16, "cuda", width)
    set_lengths(cfg, st, complete=True)
    extra = {k: v for k, v in (("num_warps", args.warps), ("tile", args.tile)) if v}
    for keys, values in ((True, False), (False, True), (True, True)):
        for _ in range(args.repeat):
            s = clone(st)
            pack_completed(cfg, s["lengths"], s["k"], s["v"], s["key_pool"], s["value_pool"], s["k_pt"], s["v_pt"],
                           keys=keys, values=values, **extra)  # fmt: skip
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
