"""Kitty kernels on one NVIDIA GPU: correctness first, then timing.

    python -m benchmarks.kernels [--out DIR] [--quick] [--timing-only | --check-only]

Writes ``kernels_results.json`` (``kernels_timing.json`` with ``--timing-only``, ``kernels_check.json`` with
``--check-only``) and its log to ``--out`` (default ``benchmarks/results/<gpu>-<date>/``, see
``benchmarks/results_dir.py``); ``python benchmarks/summarize.py`` then regenerates ``benchmarks/RESULTS.md``.

1. Correctness on the GPU: pack bit-identical to kitty.core.quant; Algorithm 1 dequantization vs kitty.core.quant
(counts
   elements that differ, and by how many ulps: compiled code may fuse ``code*scale+zero`` into one FMA); fused and
   unfused attention vs the fp32 torch reference with flash-attention's tolerance rule (see tests/test_kernels.py).
2. Timing: every time is the median over 30 replays of a CUDA graph holding many calls, each call on the next of a
   set of rotating inputs that together exceed 4x the L2 cache, after warm-up; per call = replay time / calls.
   - device copy bandwidth (bytes read + written) of a 2 GiB device-to-device copy;
   - FP16 decode attention with scaled_dot_product_attention (flash backend), 32 query / 8 KV heads, D=128;
   - our fused kernel (a small sweep of split count / warps / unpacking; best and default reported) and the unfused
     path, for kitty and kitty-pro at the same shapes; the pack kernel (one page per row and KV head, keys+values).
   Bytes: what each method must read and write (cache, query, output, split workspace; the unfused path adds its
   logits/probabilities round trips), counted from the layout, not measured by counters.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from tqdm.auto import tqdm

from benchmarks import summarize
from benchmarks.results_dir import default_out, unused_path
from kitty.core.config import PRESETS
from kitty.core.memory import page_bytes, token_layout
from kitty.core.quant import dequantize_key_page, dequantize_value_page, quantize_key_page, quantize_value_page
from kitty.core.storage import pool_fields
from kitty.kernels import (
    KittyLayerState,
    decode_attention_ref,
    decode_attention_triton,
    decode_attention_unfused,
    dequantize_key_page_triton,
    dequantize_value_page_triton,
    pack_pages,
)
from kitty.kernels.launch import Launch, default_launch, default_num_splits
from kitty.kernels.testing import attention_tolerance, make_state, planted_kv

HQ, HKV, D = 32, 8, 128
SHAPES = [(8, 32768), (64, 8192), (1, 4096), (1, 32768), (16, 8192), (256, 8192)]  # target shapes first
TARGET_SHAPES = list(summarize.TARGET_SHAPES)  # the shapes the targets name: also timed in bf16
L2_BYTES = 60 * 2**20
DEV = "cuda"
LOG = []
# fused-kernel launches swept at every shape, each taking its split count at the shape (``at_shape``: from ``waves``
# programs per SM). The page loop is one hot loop (page quarters, magic-number codes, scale/zero folded into q and p);
# earlier runs' variants (dequantized tiles, FOLD, PREFETCH, byte vs word loads) are in benchmarks/RESULTS.md's git
# history. operand_parts: q*scale / p*scale as two 16-bit parts (1 keys, 2 values, 3 both; result files recorded
# before the rename call it split_fold). block_h=16 lost everywhere.
SWEEP_BASE = Launch(num_splits=1, num_warps=2, num_stages=1, maxnreg=128, block_h=4)
FUSED_LAUNCHES = [dataclasses.replace(SWEEP_BASE, operand_parts=f) for f in (0, 1, 3)] + [
    dataclasses.replace(SWEEP_BASE, num_warps=4, num_stages=2, maxnreg=None, operand_parts=f) for f in (0, 1)
]
SWEEP_WAVES = (2, 4, 8, 16)


def at_shape(launch: Launch | None, B: int, Hkv: int, units: int, waves: int | None = None) -> Launch:
    """``launch`` (``None``: the kernel's default launch) for ``B * Hkv`` (row, KV head) pairs over ``units`` page
    slots: its split count is the default launch's, or the one for ``waves`` programs per SM."""
    base = default_launch(B, Hkv, units, torch.device(DEV))
    splits = base.num_splits if waves is None else default_num_splits(B, Hkv, units, torch.device(DEV), waves)
    return dataclasses.replace(base if launch is None else launch, num_splits=splits)


def launch_tag(launch: Launch) -> str:
    """A launch as the result files name it: its fields (``maxnreg`` only when set), then ``splits=``."""
    fields = {k: v for k, v in dataclasses.asdict(launch).items() if k != "num_splits" and v is not None}
    return " ".join(f"{k}={v}" for k, v in fields.items()) + f" splits={launch.num_splits}"


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


# ------------------------------------------------------------------------------------------------------ timing


def bench(fns, reps: int = 30, target_ms: float = 3.0) -> float:
    """Median seconds per call over ``reps`` CUDA-graph replays; ``fns`` are zero-arg callables on rotating inputs."""
    if DEV == "cpu":  # --cpu-smoke: plumbing check under the interpreter, times meaningless
        fns[0]()
        t0 = time.perf_counter()
        fns[-1]()
        return time.perf_counter() - t0
    for f in fns:  # warm-up: compiles, autotunes nothing, fills allocator pools
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for f in fns:
        f()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) / len(fns)
    calls = len(fns) * max(1, math.ceil(target_ms * 1e-3 / max(est, 1e-6) / len(fns)))
    calls = min(calls, max(len(fns), 4000))
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for f in fns[:3]:
                f()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fns[i % len(fns)]()
        run = g.replay
    except Exception as e:  # noqa: BLE001
        log(f"  (graph capture failed: {type(e).__name__}: {e}; timing eager launches)")

        def run():
            for i in range(calls):
                fns[i % len(fns)]()

    run()
    torch.cuda.synchronize()
    return event_median(run, reps) / calls


def bench_eager(fn, reps: int = 20) -> float:
    """Median seconds of one eager call (for single large operations), CUDA events, after warm-up."""
    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return event_median(fn, reps)


def event_median(run, reps: int) -> float:
    """Median seconds of ``reps`` calls of ``run``, each between two CUDA events."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    times.sort()
    return times[len(times) // 2]


def n_rotations(nbytes: int, cap: int = 64) -> int:
    return max(1, min(cap, math.ceil(4 * L2_BYTES / max(nbytes, 1))))


# ------------------------------------------------------------------------------------------------ correctness


def check_pack_and_dequant(results: dict) -> bool:
    ok = True
    for preset in ("kitty", "kitty-pro"):
        cfg = PRESETS[preset]
        for dtype in (torch.float16, torch.bfloat16):
            k, v = planted_kv(16 if DEV == "cuda" else 2, HKV, cfg.group_size, D, dtype, DEV, seed=1)
            kp, vp = pack_pages(cfg, k, v)
            rk, rv = quantize_key_page(k, cfg), quantize_value_page(v, cfg)
            bad = {
                f: int((getattr(kp, f) != getattr(rk, f)).sum()) for f in ("low", "high", "boost_idx", "scale", "zero")
            }
            bad.update({"v_" + f: int((getattr(vp, f) != getattr(rv, f)).sum()) for f in ("codes", "scale", "zero")})
            same = not any(bad.values())
            ok &= same
            # dequantization: count differences and their size in ulps of the dtype
            stats = {}
            for name, out, ref in (
                ("key", dequantize_key_page_triton(rk), dequantize_key_page(rk)),
                ("value", dequantize_value_page_triton(rv), dequantize_value_page(rv)),
            ):
                diff = out != ref
                ulp = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs().max().item()
                stats[name] = (int(diff.sum()), out.numel(), ulp)
                ok &= ulp <= 1
            key = f"{preset} {str(dtype)[6:]}"
            results["pack"][key] = bad
            results["dequant"][key] = stats
            log(
                f"pack {key}: {'bit-identical' if same else 'MISMATCH ' + str(bad)}; dequant differing elements "
                f"(count/total/max ulp) key {stats['key']} value {stats['value']}"
            )
    return ok


def check_attention(results: dict, every_config: bool = True) -> bool:
    """Fused (and unfused) attention vs the fp32 reference on ragged rows: GQA 1/3/4/8, D 64/128, fp16/bf16,
    G 32/64/128, boost fractions 0 / 12.5% / 25% / 50% and 4-bit values, several split counts and warp counts."""
    ok = True
    cases = [
        ("kitty", 4, 128, torch.float16, 128, {}),
        ("kitty-pro", 4, 128, torch.bfloat16, 128, {}),
        ("kitty", 1, 64, torch.bfloat16, 128, {}),
        ("kitty-pro", 8, 64, torch.float16, 64, {}),
        ("kitty", 3, 128, torch.float16, 64, {}),
        ("kitty", 4, 128, torch.float16, 128, {"boost_fraction": 0.5}),
        ("kivi-k2v2-sink", 4, 128, torch.bfloat16, 128, {}),
        ("kivi-k2v4-sink", 2, 64, torch.float16, 64, {}),
        ("fp16", 4, 128, torch.float16, 128, {}),
    ]
    swept = {c[:5] for c in cases[:3]}

    def judge(key: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
        err = (out - ref).abs().max().item()
        good = bool(torch.isfinite(out).all()) and err <= tol
        results["attention"][key] = {"err": err, "tol": tol, "ok": good}
        log(f"{key}: max|out-ref| {err:.2e} (tol {tol:.2e}) {'ok' if good else 'FAIL'}")
        return good

    for preset, gqa, d, dtype, G, kw in cases:
        cfg = PRESETS[preset].with_(group_size=G, **kw)
        S, R = cfg.sink_tokens, cfg.local_window
        lengths = [S + 7 * G + 5, 1, S + G, S + R + 3 * G, 2000, S + 2 * G - 1, S + R + G, 0]
        k, v = planted_kv(len(lengths), 2, max(lengths), d, dtype, DEV, seed=gqa)
        st = make_state(cfg, k, v, lengths, seed=1)
        q = torch.randn(len(lengths), 2 * gqa, d, device=DEV).to(dtype)
        ref = decode_attention_ref(q, st, cfg, upcast=True).float()
        pt = decode_attention_ref(q, st, cfg, upcast=False).float()
        tol = attention_tolerance(ref, pt, dtype)
        extra = "".join(f" {k}={v}" for k, v in kw.items())
        tag = f"{preset}{extra} gqa{gqa} D{d} G{G} {str(dtype)[6:]}"
        # (each configuration compiles once per case: keep the list short, the correctness part took 248 s with 5)
        units = st.k_page_table.shape[1] + 1
        base = at_shape(None, len(lengths), 2, units)
        r = dataclasses.replace
        launches = [
            ("fused splits=3", r(base, num_splits=3)),
            ("fused auto", None),
            ("fused operand_parts=0", r(base, operand_parts=0)),
            ("fused operand_parts=3", r(base, operand_parts=3)),
            ("fused warps=4 stages=2", r(base, num_warps=4, num_stages=2, maxnreg=None)),
        ]
        runs = [(name, lambda lc=lc: decode_attention_triton(q, st, cfg, launch=lc)) for name, lc in launches]
        runs.append(("unfused", lambda: decode_attention_unfused(q, st, cfg, num_splits=2)))
        if not every_config:  # --check-only: the default launch everywhere, the B >= 8 launch on the first cases
            runs = [run for run in runs if run[0] == "fused auto"]
            if (preset, gqa, d, dtype, G) in swept:
                capped = at_shape(SWEEP_BASE, len(lengths), 2, units, waves=8)
                runs.append(("fused 2 warps maxnreg=128", lambda: decode_attention_triton(q, st, cfg, launch=capped)))
        elif (preset, gqa, d, dtype, G) in swept:  # every configuration the sweep times, on the first cases
            for lc in (at_shape(lc, len(lengths), 2, units, waves=8) for lc in FUSED_LAUNCHES):
                name = "fused " + launch_tag(lc).rsplit(" splits=", 1)[0]
                runs.append((name, lambda lc=lc: decode_attention_triton(q, st, cfg, launch=lc)))
        for name, fn in runs:
            ok &= judge(f"{name} {tag}", fn().float(), ref, tol)
        # mid-step layout (a qbuffer the new token filled is not packed yet), as the cache's decode step calls it
        st2 = make_state(cfg, k, v, lengths, seed=1, full_qbuffer=True)
        ref2 = decode_attention_ref(q, st2, cfg, upcast=True, full_qbuffer=True).float()
        pt2 = decode_attention_ref(q, st2, cfg, upcast=False, full_qbuffer=True).float()
        tol2 = attention_tolerance(ref2, pt2, dtype)
        ok &= judge(
            f"fused mid-step {tag}", decode_attention_triton(q, st2, cfg, full_qbuffer=True).float(), ref2, tol2
        )
    return ok


# --------------------------------------------------------------------------------------------------- builders


def gpu_kv(B, L, dtype=torch.float16, seed=0):
    """Keys with a few outlier channels per head and plain values, on the GPU: ``[B, HKV, L, D]``."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    chan = torch.ones(HKV, D, device=DEV)
    chan[:, :: D // 8] = 6.0  # 8 outlier channels per head
    k = torch.randn(B, HKV, L, D, device=DEV, generator=g, dtype=dtype) * chan[None, :, None, :].to(dtype)
    v = torch.randn(B, HKV, L, D, device=DEV, generator=g, dtype=dtype)
    return k, v


def kitty_bytes(cfg, B, L, splits, block_h):
    lay = token_layout(cfg, L)
    pb = page_bytes(cfg, D, 2)
    per_head = (
        lay.key_pages * (pb["key_payload"] + pb["key_meta"])
        + lay.value_pages * (pb["value_payload"] + pb["value_meta"])
        + (2 * lay.sink + lay.key_qbuffer + lay.value_qbuffer + lay.local) * D * 2
    )
    cache = B * HKV * per_head + B * 2 * (lay.key_pages + lay.value_pages) * 4  # + page-table entries
    qo = 2 * B * HQ * D * 2
    ws = 2 * B * HKV * splits * block_h * (D + 2) * 4  # split partials written then read
    return cache + qo + ws, cache


def clone_state(st: KittyLayerState) -> KittyLayerState:
    return KittyLayerState(**{k: v.clone() for k, v in st.tensors().items()})


def copy_bandwidth() -> tuple[float, dict[str, float]]:
    """The device's copy ceiling in bytes/s (read + written) over a 2 GiB buffer: the fastest of a device-to-device
    copy in a CUDA graph, eagerly, and an eager ``add`` (run 1: a graph's memcpy node ran at 2.77 TB/s, below what
    SDPA itself reached); with each way's TB/s."""
    x = torch.empty(2**30 if DEV == "cuda" else 2**20, dtype=torch.float16, device=DEV).normal_()
    y = torch.empty_like(x)
    t_graph = bench([lambda: y.copy_(x)], reps=20, target_ms=5)
    t_eager = bench_eager(lambda: y.copy_(x), reps=20)
    t_add = bench_eager(lambda: torch.add(x, 1, out=y), reps=20)
    detail = {
        "graph_copy_TBps": 2 * x.nbytes / t_graph / 1e12,
        "eager_copy_TBps": 2 * x.nbytes / t_eager / 1e12,
        "eager_add_TBps": 2 * x.nbytes / t_add / 1e12,
    }
    bw = 2 * x.nbytes / min(t_graph, t_eager, t_add)
    log(f"copy: {2 * x.nbytes / 1e9:.2f} GB moved; TB/s: {detail} -> ceiling {bw / 1e12:.3f} TB/s")
    return bw, detail


def rotating_kitty(cfg, k_full, v_full, B: int, L: int, dtype):
    """Kitty layers of ``B`` rows at length ``L`` built from ``k_full``/``v_full`` in ``dtype``, cloned into enough
    rotating copies to exceed L2, with a query per copy: ``(states, qs, cache bytes of one copy)``."""
    st0 = make_state(cfg, k_full.to(dtype), v_full.to(dtype), [L] * B, seed=B)
    _, cache_b = kitty_bytes(cfg, B, L, 1, 16)
    nrot = n_rotations(cache_b)
    states = [st0] + [clone_state(st0) for _ in range(nrot - 1)]
    qs = [torch.randn(B, HQ, D, device=DEV, dtype=dtype) for _ in range(nrot)]
    return states, qs, cache_b


def sdpa_timings(qs, kvs, B: int) -> list[tuple[str, float, torch.Tensor]]:
    """``(name, seconds per call, output of input set 0)`` of every SDPA backend in both GQA forms over the rotating
    inputs ``qs``/``kvs``; a backend that fails is logged and left out."""
    out = []
    for bname, backend in sdpa_backends():
        for form in ("enable_gqa", "gqa-folded"):
            name = f"sdpa-{bname} {form}"
            fn = sdpa_call(backend, form, qs, kvs, B)
            try:
                y = fn(0)
                t = bench([lambda i=i: fn(i) for i in range(len(qs))])
            except Exception as e:  # noqa: BLE001
                log(f"  {name}: failed: {type(e).__name__}: {str(e)[:160]}")
                continue
            out.append((name, t, y))
    return out


# ------------------------------------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for the results (default: benchmarks/results/<gpu>-<date>/)")
    ap.add_argument("--quick", action="store_true", help="fewer sweep points")
    ap.add_argument(
        "--timing-only",
        action="store_true",
        help="skip the correctness part (when it was run on the same code before) and time only the "
        "launches with one-part operands (operand_parts=0)",
    )
    ap.add_argument(
        "--check-only",
        action="store_true",
        help="only the correctness part, with the default launch (and the B >= 8 launch on the first cases); "
        "writes kernels_check.json",
    )
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny run on CPU under TRITON_INTERPRET=1 (plumbing only)")
    args = ap.parse_args()
    global DEV, SHAPES, TARGET_SHAPES, HQ, HKV, D
    if args.cpu_smoke:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--cpu-smoke needs TRITON_INTERPRET=1 in the environment"
        DEV, SHAPES, TARGET_SHAPES, HQ, HKV, D = "cpu", [(1, 300), (2, 200)], [(2, 200)], 4, 2, 64
        torch.cuda.synchronize = lambda: None
    else:
        assert torch.cuda.is_available(), "needs a CUDA GPU"
    props = (
        torch.cuda.get_device_properties(0)
        if DEV == "cuda"
        else type("P", (), {"name": "cpu", "multi_processor_count": 0})
    )
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except Exception:  # noqa: BLE001
        driver = "unknown"
    env = {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "driver": driver,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    log("env", json.dumps(env))
    global RESULT_PATH
    out = args.out or default_out(props.name)
    os.makedirs(out, exist_ok=True)
    kind = "kernels_check" if args.check_only else "kernels_timing" if args.timing_only else "kernels_results"
    RESULT_PATH = str(unused_path(out, kind + ".json"))  # a second run of the day gets -2: nothing is overwritten
    log("results to", RESULT_PATH)
    results = {"env": env, "pack": {}, "dequant": {}, "attention": {}, "timing": [], "pack_timing": [], "sweep": []}

    # ---- 1) correctness
    t0 = time.time()
    if args.check_only:
        ok_pack = check_pack_and_dequant(results)
        ok_attn = check_attention(results, every_config=False)
        results["correct"] = {"pack_dequant": ok_pack, "attention": ok_attn}
        log(
            f"check-only: pack/dequant {'PASS' if ok_pack else 'FAIL'}, attention {'PASS' if ok_attn else 'FAIL'} "
            f"({time.time() - t0:.0f}s)"
        )
        write(results)
        return
    if args.timing_only:
        results["correct"] = None
        FUSED_LAUNCHES[:] = [lc for lc in FUSED_LAUNCHES if not lc.operand_parts]
    else:
        ok_pack = check_pack_and_dequant(results)
        ok_attn = check_attention(results)
        results["correct"] = {"pack_dequant": ok_pack, "attention": ok_attn}
        log(
            f"correctness: pack/dequant {'PASS' if ok_pack else 'FAIL'}, attention {'PASS' if ok_attn else 'FAIL'} "
            f"({time.time() - t0:.0f}s)"
        )

    # ---- 2) copy bandwidth
    copy_bw, results["copy_detail"] = copy_bandwidth()
    results["copy_bw"] = copy_bw

    rows = []

    def record(shape, method, t, nbytes, extra=""):
        r = {
            "B": shape[0],
            "L": shape[1],
            "method": method,
            "us": t * 1e6,
            "bytes": nbytes,
            "gbps": nbytes / t / 1e9,
            "pct_copy": 100 * nbytes / t / copy_bw,
            "extra": extra,
        }
        rows.append(r)
        log(
            f"  {method:28s} {t * 1e6:9.1f} us  {nbytes / 1e6:9.2f} MB  {r['gbps']:7.0f} GB/s  "
            f"{r['pct_copy']:5.1f}% copy  {extra}"
        )
        return r

    sweep_waves = SWEEP_WAVES if not args.quick else (4,)
    dtypes = (torch.float16, torch.bfloat16)
    for B, L in tqdm(SHAPES, desc="shapes", unit="shape"):
        log(f"== B={B} L={L}")
        shape = (B, L)
        target = shape in TARGET_SHAPES
        # ---- FP16 attention: every SDPA backend, GQA as enable_gqa and folded into the query length
        kv_bytes = 2 * B * HKV * L * D * 2
        nrot = n_rotations(kv_bytes)
        qs = [torch.randn(B, HQ, 1, D, device=DEV, dtype=torch.float16) for _ in range(nrot)]
        kvs = [gpu_kv(B, L, seed=i) for i in range(nrot)]
        sdpa_t, sdpa_name = None, None
        ref = (
            torch.softmax((qs[0].view(B, HKV, HQ // HKV, D).float() @ kvs[0][0].float().transpose(-1, -2)) / D**0.5, -1)
            @ kvs[0][1].float()
        )
        for name, t, out in sdpa_timings(qs, kvs, B):
            err = (out.reshape(B, HKV, HQ // HKV, D).float() - ref).abs().max().item()
            record(shape, name, t, kv_bytes + 2 * B * HQ * D * 2, f"max err vs fp32 {err:.1e}")
            if sdpa_t is None or t < sdpa_t:
                sdpa_t, sdpa_name = t, name
        results.setdefault("fastest_fp16", {})[f"{B},{L}"] = {"name": sdpa_name, "us": sdpa_t * 1e6 if sdpa_t else None}
        log(f"  fastest FP16: {sdpa_name} {sdpa_t * 1e6 if sdpa_t else float('nan'):.1f} us")
        k_full, v_full = kvs[0]
        del qs, kvs, ref
        torch.cuda.empty_cache()
        # ---- Kitty presets (fp16 and, at the target shapes, bf16)
        for preset in ("kitty", "kitty-pro"):
            cfg = PRESETS[preset]
            for dtype in dtypes if target else dtypes[:1]:
                tag_dt = str(dtype)[6:]
                states, qs, cache_b = rotating_kitty(cfg, k_full, v_full, B, L, dtype)
                st0, nrot = states[0], len(states)
                best = None
                for swept in FUSED_LAUNCHES if not args.quick else FUSED_LAUNCHES[:1]:
                    max_units = st0.k_page_table.shape[1] + 1
                    for waves in sweep_waves:
                        launch = at_shape(swept, B, HKV, max_units, waves)
                        splits = launch.num_splits
                        tag = launch_tag(launch)
                        if any(
                            sw["config"] == tag
                            and sw["B"] == B
                            and sw["L"] == L
                            and sw["preset"] == preset
                            and sw["dtype"] == tag_dt
                            for sw in results["sweep"]
                        ):
                            continue  # two wave counts gave the same split count
                        try:
                            t = bench(
                                [
                                    lambda i=i, launch=launch: decode_attention_triton(
                                        qs[i], states[i], cfg, launch=launch
                                    )
                                    for i in range(nrot)
                                ]
                            )
                        except Exception as e:  # noqa: BLE001
                            log(f"    sweep {preset} {tag_dt} fused {tag}: failed: {type(e).__name__}: {str(e)[:300]}")
                            continue
                        nbytes, _ = kitty_bytes(cfg, B, L, splits, 16)
                        log(f"    sweep {preset} {tag_dt} fused {tag}: {t * 1e6:.1f} us ({nbytes / t / 1e9:.0f} GB/s)")
                        results["sweep"].append(
                            {"B": B, "L": L, "preset": preset, "dtype": tag_dt, "config": tag, "us": t * 1e6}
                        )
                        if best is None or t < best[0]:
                            best = (t, tag, nbytes)
                try:  # decode_attention_triton's own default launch (kernels/launch.py: default_launch)
                    launch = default_launch(B, HKV, st0.k_page_table.shape[1] + 1, torch.device(DEV))
                    t_def = bench([lambda i=i: decode_attention_triton(qs[i], states[i], cfg) for i in range(nrot)])
                    results.setdefault("default_launch", []).append(
                        {
                            "B": B,
                            "L": L,
                            "preset": preset,
                            "dtype": tag_dt,
                            "us": t_def * 1e6,
                            "speedup_vs_sdpa": sdpa_t / t_def if sdpa_t else None,
                            "launch": dataclasses.asdict(launch),
                        }
                    )
                    log(f"    default launch {preset} {tag_dt}: {t_def * 1e6:.1f} us")
                except Exception as e:  # noqa: BLE001
                    log(f"    default launch {preset} {tag_dt}: failed: {type(e).__name__}: {str(e)[:300]}")
                if best is None:
                    log(f"  {preset} {tag_dt}: every fused configuration failed")
                    continue
                t, tag, nbytes = best
                r = record(
                    shape,
                    f"{preset} {tag_dt} fused",
                    t,
                    nbytes,
                    f"best of sweep: {tag}" + (f"; {sdpa_t / t:.2f}x the fastest FP16 ({sdpa_name})" if sdpa_t else ""),
                )
                r["speedup_vs_sdpa"] = sdpa_t / t if sdpa_t else None
                r["preset"], r["dtype"] = preset, tag_dt
                if dtype == torch.float16:
                    fused_t = t
                    # pack: one full qbuffer per row and KV head, keys + values, one launch
                    kq = torch.randn(B, HKV, cfg.group_size, D, device=DEV, dtype=dtype)
                    vq = torch.randn_like(kq)
                    nrot_p = n_rotations(2 * kq.nbytes)
                    kqs = [kq.clone() for _ in range(nrot_p)]
                    vqs = [vq.clone() for _ in range(nrot_p)]
                    key_spec, value_spec = pool_fields(cfg, HKV, D, dtype)
                    pool = {name: st0[name].clone() for name in {**key_spec, **value_spec}}
                    pages = torch.arange(B, dtype=torch.int32, device=DEV)
                    try:
                        tp = bench(
                            [
                                lambda i=i: pack_pages(cfg, kqs[i], vqs[i], pool=pool, k_pages=pages, v_pages=pages)
                                for i in range(nrot_p)
                            ]
                        )
                        amort = tp / cfg.group_size / fused_t * 100
                        results["pack_timing"].append(
                            {
                                "B": B,
                                "L": L,
                                "preset": preset,
                                "us": tp * 1e6,
                                "us_per_page": tp * 1e6 / (B * HKV),
                                "amortized_pct_of_fused": amort,
                            }
                        )
                        log(
                            f"  {preset} pack {B}x{HKV} pages (k+v): {tp * 1e6:.1f} us; "
                            f"/G = {amort:.2f}% of one fused decode step"
                        )
                    except Exception as e:  # noqa: BLE001
                        log(f"  {preset} pack failed: {type(e).__name__}: {str(e)[:300]}")
                    del kqs, vqs, pool
                del states, qs, st0
                torch.cuda.empty_cache()
        # diagnostic: the same fused kernel over unquantized fp16 pages (no unpacking)
        if target:
            cfg = PRESETS["fp16"]
            st = make_state(cfg, k_full, v_full, [L] * B, seed=B)
            q0 = torch.randn(B, HQ, D, device=DEV, dtype=torch.float16)
            best = None
            for swept in [lc for lc in FUSED_LAUNCHES if not lc.operand_parts][:2]:  # 16-bit pages: one part
                for waves in (2, 4):
                    launch = at_shape(swept, B, HKV, st.k_page_table.shape[1] + 1, waves)
                    try:
                        t = bench([lambda: decode_attention_triton(q0, st, cfg, launch=launch)])
                    except Exception as e:  # noqa: BLE001
                        log(f"    fp16-pages fused failed: {type(e).__name__}: {str(e)[:300]}")
                        continue
                    if best is None or t < best[0]:
                        best = (t, launch_tag(launch))
            if best:
                lay = token_layout(cfg, L)
                nbytes = (
                    B * HKV * (lay.key_pages + lay.value_pages) * cfg.group_size * D * 2
                    + B * HKV * (2 * lay.sink + lay.key_qbuffer + lay.value_qbuffer + lay.local) * D * 2
                    + 2 * B * HQ * D * 2
                )
                record(shape, "fp16 pages fused (diagnostic)", best[0], nbytes, f"same kernel, 16-bit pages: {best[1]}")
            del st
        for r in rows:
            if (r["B"], r["L"]) == shape and sdpa_t and "speedup_vs_sdpa" not in r:
                r["speedup_vs_sdpa"] = sdpa_t / (r["us"] * 1e-6)
        del k_full, v_full
        torch.cuda.empty_cache()
        results["timing"] = rows
        write(results)  # after every shape: a run cut short keeps what it measured
    print("wrote", RESULT_PATH)


def sdpa_backends() -> list[tuple[str, object]]:
    """Every SDPA backend to time: (name, backend or None for PyTorch's own choice)."""
    if DEV == "cpu":
        from torch.nn.attention import SDPBackend

        return [("math", SDPBackend.MATH)]
    from torch.nn.attention import SDPBackend

    out = [("default", None)]
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        if hasattr(SDPBackend, name):
            out.append((name.split("_")[0].lower(), getattr(SDPBackend, name)))
    return out


def sdpa_call(backend, form: str, qs, kvs, B: int):
    """A callable ``fn(i)`` running SDPA decode on input set ``i`` with ``backend`` (None: PyTorch's choice)."""
    from contextlib import nullcontext

    from torch.nn.attention import sdpa_kernel

    def ctx():
        return nullcontext() if backend is None else sdpa_kernel(backend)

    def fn(i):
        with ctx():
            if form == "enable_gqa":
                return F.scaled_dot_product_attention(qs[i], kvs[i][0], kvs[i][1], enable_gqa=True)
            q4 = qs[i].view(B, HKV, HQ // HKV, D)  # GQA decode as QH query "tokens" per KV head (non-causal)
            return F.scaled_dot_product_attention(q4, kvs[i][0], kvs[i][1])

    return fn


RESULT_PATH = ""  # set by main: where this run's JSON goes; its log is the same name with _log.txt


def log_path() -> str:
    return RESULT_PATH[: -len(".json")] + "_log.txt" if RESULT_PATH else os.path.join(".", "kernels_log.txt")


def write(results: dict) -> None:
    """Write the results JSON and the log so far (``benchmarks/summarize.py`` renders them into RESULTS.md)."""
    with open(RESULT_PATH, "w") as f:
        json.dump(results, f, indent=1)
    with open(log_path(), "w") as f:
        f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        with open(log_path(), "w") as f:
            f.write("\n".join(LOG) + "\n" + traceback.format_exc())
        sys.exit(1)
