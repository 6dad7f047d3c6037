"""Fused decode attention with layer-adaptive boost vs uniform boost, at equal bits, on one NVIDIA GPU.

    python -m benchmarks.boost_profile_speed [--out DIR] [--batch 32] [--context 8192]

Everything beyond the paper (query/oracle channel selection, fitted ranges) happens at pack time: the decode kernel
reads the same page layout and the same bytes, so its speed cannot change. The one thing that does reach the kernel
is a layer-adaptive ``boost_profile``: each layer's pages hold its own number ``nb`` of boosted channels (a high plane
of ``ceil(nb / 4)`` bytes per token). This script times the fused kernel for every ``nb`` the shipped SmolLM2-135M
profiles use, at that model's shape (9 query / 3 KV heads, D=64), and compares one decode step summed over the 30
layers: uniform ``kitty`` (8 channels everywhere) against the profile (the same 240 channels in total), and the same
for ``kitty-pro`` (16 / 480).

Page contents do not change what the kernel reads, so the states are packed with magnitude selection and min-max
ranges (the layout of every selection). Timing: ``benchmarks/kernels.py``'s ``bench`` (median of 30 replays of a
CUDA graph of many calls) rotating over 4 states per ``nb`` (more than the L2 cache). Also checks each state's output
against the torch reference.
Writes ``boost_profile_<gpu>.json`` to ``--out`` (default ``benchmarks/results/<gpu>-<date>/``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import benchmarks.kernels as bk  # noqa: E402  (bench: median of CUDA-graph replays over rotating inputs)
from benchmarks.results_dir import default_out, unused_path
from kitty.core.config import DEFAULT_PROFILE, PRESETS, load_boost_profile
from kitty.kernels import decode_attention_ref, decode_attention_triton
from kitty.kernels.testing import make_state

HQ, HKV, D, LAYERS = 9, 3, 64, 30
DEV = "cuda"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for the JSON (default: benchmarks/results/<gpu>-<date>/)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny run under TRITON_INTERPRET=1 (plumbing only)")
    a = ap.parse_args()
    global DEV
    if a.cpu_smoke:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--cpu-smoke needs TRITON_INTERPRET=1"
        DEV = bk.DEV = "cpu"
    else:
        assert torch.cuda.is_available(), "needs a CUDA GPU"
    B, L = a.batch, a.context
    plans = {}
    for preset, frac in (("kitty", 0.125), ("kitty-pro", 0.25)):
        counts = [round(f * D) for f in load_boost_profile(DEFAULT_PROFILE, frac)]
        assert sum(counts) == LAYERS * PRESETS[preset].num_boosted(D)
        plans[preset] = {"uniform": [PRESETS[preset].num_boosted(D)] * LAYERS, "profile": counts}
    needed = sorted({c for p in plans.values() for cs in p.values() for c in cs})
    per_nb = {}
    for nb in needed:
        cfg = PRESETS["kitty"].with_(boost_fraction=nb / D)
        states, qs, max_err = [], [], 0.0
        for seed in range(4):
            g = torch.Generator(device=DEV).manual_seed(seed)
            k = torch.randn(B, HKV, L, D, device=DEV, generator=g, dtype=torch.float16)
            k[..., :: D // 8] *= 6  # a few outlier channels, as real keys have
            v = torch.randn(B, HKV, L, D, device=DEV, generator=g, dtype=torch.float16)
            st = make_state(cfg, k, v, [L] * B)
            q = torch.randn(B, HQ, D, device=DEV, generator=g, dtype=torch.float16)
            out = decode_attention_triton(q, st, cfg)
            ref = decode_attention_ref(q, st, cfg) if seed == 0 else out
            max_err = max(max_err, (out.float() - ref.float()).abs().max().item())
            states.append(st)
            qs.append(q)
            del k, v
        t = bk.bench([lambda st=st, q=q: decode_attention_triton(q, st, cfg) for st, q in zip(states, qs)])
        per_nb[nb] = {"us": t * 1e6, "max_abs_err_vs_ref": max_err}
        print(f"nb={nb:2d}: {t * 1e6:8.2f} us per layer call (B={B}, L={L}), max |out - ref| {max_err:.2e}", flush=True)
        del states, qs
        torch.cuda.empty_cache()
    summary = {}
    for preset, p in plans.items():
        tot = {k: sum(per_nb[c]["us"] for c in cs) for k, cs in p.items()}
        summary[preset] = {**tot, "profile_over_uniform": tot["profile"] / tot["uniform"], "counts": p["profile"]}
        print(
            f"{preset}: one decode step over {LAYERS} layers: uniform {tot['uniform']:.1f} us, "
            f"profile {tot['profile']:.1f} us "
            f"({tot['profile'] / tot['uniform']:.3f}x)"
        )
    gpu = torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu-smoke"
    res = {
        "gpu": gpu,
        "torch": torch.__version__,
        "batch": B,
        "context": L,
        "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "layers": LAYERS},
        "per_nb": per_nb,
        "summary": summary,
    }
    name = gpu.split()[-1].lower()
    out = a.out or default_out(gpu)
    os.makedirs(out, exist_ok=True)
    path = unused_path(out, f"boost_profile_{name}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
