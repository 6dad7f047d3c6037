"""The fused kernel over the reduction-axis page layout on one GPU: correctness of every launch variant, then a sweep.

    python -m benchmarks.layout_sweep [--out DIR] [--shapes 8x32768,64x8192,...] [--budget-s 480]

One call does what a layout change needs measured (``benchmarks/kernels.py`` is the full benchmark):

1. Correctness, for every preset family the kernel reads (2-bit keys with 0 / 12.5% / 25% boosted channels, 4-bit
   keys, 4-bit values, 16-bit pages), fp16 and bf16, GQA 1 / 3 / 4 / 8, D 64 / 128, ragged rows with planted outlier
   channels, and every launch variant timed below: ``max|out - ref| <= 2 max|pt - ref| + floor`` (``ref`` the fp32
   torch reference, ``pt`` the same reference in the model dtype: tests/test_kernels.py's rule).
2. Timing (CUDA-graph replays over rotating inputs larger than L2, ``benchmarks/kernels.py``'s ``bench``): every SDPA
   backend for FP16 (the fastest is the baseline), then the fused kernel for kitty and kitty-pro, fp16 and bf16, over
   warps x pipeline stages x operand splitting x programs per SM, and the default launch.

Writes ``layout_sweep.json`` (and ``-2``, ... for later runs of the day) to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import time

import torch
from tqdm.auto import tqdm

from benchmarks import kernels as kb
from benchmarks.results_dir import default_out, run_env, unused_path
from kitty.core.config import PRESETS
from kitty.kernels import decode_attention_ref, decode_attention_triton
from kitty.kernels.launch import Launch
from kitty.kernels.testing import attention_tolerance, make_state, planted_kv

# launch variants, each taking its split count at the shape (benchmarks/kernels.py's at_shape): warps x pipeline
# stages with the key operand in two parts (the default), and the other operand_parts choices at 2 warps
BASE = Launch(num_splits=1, num_warps=2, num_stages=1, maxnreg=None, operand_parts=1)
VARIANTS = [dataclasses.replace(BASE, num_warps=w, num_stages=s) for w, s in itertools.product((1, 2, 4), (1, 2))] + [
    dataclasses.replace(BASE, operand_parts=f) for f in (0, 3)
]


def variant(launch: Launch) -> dict:
    """A launch variant as the result file records it: its fields but the split count (set at each shape)."""
    return {k: v for k, v in dataclasses.asdict(launch).items() if k != "num_splits"}


CHECK_CASES = [  # (preset, GQA, D, overrides)
    ("kitty", 4, 128, {}),
    ("kitty-pro", 4, 128, {}),
    ("kitty", 8, 128, {}),
    ("kitty", 3, 64, {}),
    ("kitty", 4, 128, {"boost_fraction": 0.1}),  # nb = 13: a high plane whose last byte is part padding
    ("kivi-k2v4-sink", 4, 128, {}),
    ("kivi-k4v2-sink", 4, 128, {}),
]


def check(results: dict) -> bool:
    """Every check case x dtype x launch variant against the reference; returns whether all passed."""
    ok_all = True
    for (preset, gqa, D, kw), dtype in tqdm(
        list(itertools.product(CHECK_CASES, (torch.float16, torch.bfloat16))), desc="check"
    ):
        cfg = PRESETS[preset].with_(**kw)
        S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
        lengths = [S + 9 * G + 5, S + R + 2 * G, 1, S + G, S + 2 * G + R - 1, max(S, 1)]
        B, Hkv = len(lengths), 2
        k, v = planted_kv(B, Hkv, max(lengths), D, dtype, kb.DEV, seed=gqa * D)
        state = make_state(cfg, k, v, lengths, seed=1)
        q = torch.randn(B, Hkv * gqa, D, generator=torch.Generator().manual_seed(2)).to(dtype).to(kb.DEV)
        ref = decode_attention_ref(q, state, cfg, upcast=True).float()
        pt = decode_attention_ref(q, state, cfg, upcast=False).float()
        tol = attention_tolerance(ref, pt, dtype)
        variants = VARIANTS[-2:] if (preset, gqa, D, kw) == ("kitty", 4, 128, {}) and VARIANTS else []
        for name, launch in [("default", None)] + [
            (json.dumps(variant(vv)), dataclasses.replace(vv, num_splits=3)) for vv in variants
        ]:
            out = decode_attention_triton(q, state, cfg, launch=launch).float()
            err = (out - ref).abs().max().item() if torch.isfinite(out).all() else float("inf")
            ok = err <= tol
            ok_all &= ok
            key = f"{preset}{kw or ''} gqa{gqa} D{D} {str(dtype)[6:]} {name}"
            results["check"][key] = {"err": err, "tol": tol, "ok": ok}
            if not ok or name == "default":
                kb.log(f"  {'PASS' if ok else 'FAIL'} {key}: err {err:.3g} tol {tol:.3g}")
        kb.write(results)
    return ok_all


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="8x32768,64x8192,1x4096,1x32768,16x8192")
    ap.add_argument("--budget-s", type=float, default=480, help="stop sweeping (and write) after this many seconds")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="the default launch only")
    ap.add_argument("--check-presets", default=None, help="comma-separated presets of CHECK_CASES to check")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny run under TRITON_INTERPRET=1 (plumbing only)")
    args = ap.parse_args()
    t_start = time.time()
    if args.cpu_smoke:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--cpu-smoke needs TRITON_INTERPRET=1"
        kb.DEV, kb.HQ, kb.HKV, kb.D = "cpu", 4, 2, 64
        torch.cuda.synchronize = lambda: None
        CHECK_CASES[:] = [("kitty", 2, 64, {"group_size": 16, "local_window": 16, "sink_tokens": 4})]
        VARIANTS[:] = VARIANTS[:2]
        args.shapes = "2x200"
    props = (
        torch.cuda.get_device_properties(0)
        if kb.DEV == "cuda"
        else type("P", (), dict(name="cpu", multi_processor_count=4))
    )
    out = args.out or default_out(props.name)
    os.makedirs(out, exist_ok=True)
    kb.RESULT_PATH = str(unused_path(out, "layout_sweep.json"))
    env = run_env(props)
    results = {"env": env, "check": {}, "timing": [], "fastest_fp16": {}}
    kb.log("env", json.dumps(env))
    if args.check_presets:
        CHECK_CASES[:] = [c for c in CHECK_CASES if c[0] in args.check_presets.split(",")]
    if args.no_sweep:
        VARIANTS[:] = []
    if not args.no_check:
        results["correct"] = check(results)
        kb.log(f"correctness: {'PASS' if results['correct'] else 'FAIL'} ({time.time() - t_start:.0f} s)")
        kb.write(results)
    copy_bw, _ = kb.copy_bandwidth()
    results["copy_bw"] = copy_bw
    HQ, HKV, D = kb.HQ, kb.HKV, kb.D
    for shape in [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]:
        B, L = shape
        kb.log(f"== B={B} L={L}")
        kv_bytes = 2 * B * HKV * L * D * 2
        nrot = kb.n_rotations(kv_bytes)
        qs = [torch.randn(B, HQ, 1, D, device=kb.DEV, dtype=torch.float16) for _ in range(nrot)]
        kvs = [kb.gpu_kv(B, L, seed=i) for i in range(nrot)]
        best_fp16 = None
        for name, t, _ in kb.sdpa_timings(qs, kvs, B):
            kb.log(f"  {name}: {t * 1e6:.1f} us ({kv_bytes / t / 1e12:.2f} TB/s)")
            results["timing"].append(dict(B=B, L=L, method=name, us=t * 1e6, bytes=kv_bytes))
            if best_fp16 is None or t < best_fp16[0]:
                best_fp16 = (t, name)
        results["fastest_fp16"][f"{B},{L}"] = {"name": best_fp16[1], "us": best_fp16[0] * 1e6}
        k_full, v_full = kvs[0]
        qs = kvs = None
        torch.cuda.empty_cache()
        for preset, dtype in itertools.product(("kitty", "kitty-pro"), (torch.float16, torch.bfloat16)):
            cfg = PRESETS[preset] if kb.DEV == "cuda" else PRESETS[preset].with_(group_size=16, local_window=16)
            states, qs, cache_b = kb.rotating_kitty(cfg, k_full, v_full, B, L, dtype)
            st0, nrot = states[0], len(states)
            tag = f"{preset} {str(dtype)[6:]}"
            t = kb.bench([lambda i=i: decode_attention_triton(qs[i], states[i], cfg) for i in range(nrot)])
            units = st0.k_page_table.shape[1] + 1
            launch = kb.at_shape(None, B, HKV, units)
            row = dict(
                B=B,
                L=L,
                method=f"{tag} default",
                us=t * 1e6,
                bytes=cache_b,
                launch=dataclasses.asdict(launch),
                vs_fp16=best_fp16[0] / t,
                pct_copy=100 * cache_b / t / copy_bw,
            )
            results["timing"].append(row)
            kb.log(
                f"  {tag} default {launch}: {t * 1e6:.1f} us, {best_fp16[0] / t:.2f}x fastest FP16, "
                f"{row['pct_copy']:.0f}% copy"
            )
            variants = (
                VARIANTS
                if (preset, dtype) == ("kitty", torch.float16)
                else [v for v in VARIANTS if v.operand_parts == 1 and v.num_stages == 1]
            )
            best = None
            for var, waves in itertools.product(variants, (4, 8, 16) if B * HKV < 1024 else (2,)):
                if time.time() - t_start > args.budget_s:
                    break
                run = kb.at_shape(var, B, HKV, units, waves)
                try:
                    t = kb.bench(
                        [lambda i=i: decode_attention_triton(qs[i], states[i], cfg, launch=run) for i in range(nrot)]
                    )
                except Exception as e:  # noqa: BLE001
                    kb.log(f"  {tag} {variant(var)} waves={waves}: failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                results["timing"].append(
                    dict(
                        B=B,
                        L=L,
                        method=f"{tag} sweep",
                        us=t * 1e6,
                        bytes=cache_b,
                        launch=dict(variant(var), waves=waves),
                        vs_fp16=best_fp16[0] / t,
                        pct_copy=100 * cache_b / t / copy_bw,
                    )
                )
                if best is None or t < best[0]:
                    best = (t, dict(variant(var), waves=waves))
            if best:
                kb.log(
                    f"  {tag} best {best[1]}: {best[0] * 1e6:.1f} us, {best_fp16[0] / best[0]:.2f}x, "
                    f"{100 * cache_b / best[0] / copy_bw:.0f}% copy"
                )
            states = qs = st0 = None  # free the rotating inputs before the next preset
            torch.cuda.empty_cache()
        kb.write(results)
    kb.write(results)
    print("wrote", kb.RESULT_PATH)


if __name__ == "__main__":
    main()
