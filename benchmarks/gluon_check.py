"""The Gluon decode kernel on one GPU: correctness on every check case, then timing against SDPA and the tl kernel.

    python -m benchmarks.gluon_check [--out DIR] [--shapes 8x32768,...] [--check-budget-s 250] [--deadline-s 450]

One GPU call of at most ~8 minutes (the deadlines cut what does not fit and say so in the output):
1. Correctness (``layout_sweep.py``'s cases and tolerance rule, both ``full_qbuffer`` layouts, 1 to 40 splits):
   ``max|out - ref| <= 2 max|pt - ref| + floor``.
2. Timing (CUDA-graph replays over rotating inputs larger than L2, ``benchmarks/kernels.py``): every SDPA backend for
   FP16 (the fastest is the baseline), the tl kernel's default launch, the Gluon kernel over programs per SM, for
   kitty and kitty-pro, fp16 and bf16.

Writes ``gluon_check.json`` and ``gluon_check.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import kernels as kb  # noqa: E402
from benchmarks.layout_sweep import CHECK_CASES  # noqa: E402
from benchmarks.results_dir import default_out, run_env, unused_path  # noqa: E402
from kitty.core.config import PRESETS  # noqa: E402
from kitty.kernels import decode_attention_ref, decode_attention_triton  # noqa: E402
from kitty.kernels.decode_gluon import decode_attention_gluon  # noqa: E402
from kitty.kernels.gluon_launch import GluonLaunch, default_gluon_launch, gluon_supports  # noqa: E402
from kitty.kernels.testing import attention_tolerance, make_state, planted_kv  # noqa: E402

EXTRA_CASES = [("kitty-pro", 8, 64, {}), ("kitty", 1, 128, {}), ("kitty-pro", 3, 128, {}), ("kitty", 2, 64, {})]


def check(results: dict, t0: float, budget_s: float, variants: bool = False, bf16_forms: bool = False) -> bool:
    """Every case in two passes, the most telling first (each pass compiles one kernel per case): full_qbuffer over
    1, 3, 7 and 40 splits (40: the two-level merge) and with the full-precision chunks on their own splits (8 splits
    of which 3 tail splits, 40 of which 4) and at equal cost (``chunk_cost``), then the other qbuffer layout.
    Launches are ``(splits, tail_splits[, chunk_cost])``.
    Cases past ``budget_s`` are recorded as skipped. ``variants``: the first pass only. ``bf16_forms``: bf16 cases
    run both unpack forms (``GluonLaunch.bf16_magic``), the subnormal one first."""
    ok_all = True
    passes = [
        (True, ((3, 0), (1, 0), (7, 0), (40, 0), (8, 3), (40, 4), (7, 0, 13))),
        (False, ((3, 0), (40, 0), (8, 3), (16, 0, 8))),
    ]
    if variants:
        passes = passes[:1]
    for (fq, launches), (preset, gqa, D, kw), dtype in itertools.product(
        passes, CHECK_CASES + EXTRA_CASES, (torch.float16, torch.bfloat16)
    ):
        cfg = PRESETS[preset].with_(**kw)
        key = f"{preset}{kw or ''} gqa{gqa} D{D} {str(dtype)[6:]} fq={int(fq)}"
        if not gluon_supports(cfg, D, dtype, torch.device("cuda"), gqa):
            results["check"][key] = {"supported": False}
            continue
        if time.time() - t0 > budget_s:
            results["check"][key] = {"skipped": "time"}
            ok_all = False
            continue
        S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
        lengths = [S + 9 * G + 5, S + R + 2 * G, 1, S + G, S + 2 * G + R - 1, max(S, 1), S + R + G + 1, S + 5 * G]
        B, Hkv = len(lengths), 2
        k, v = planted_kv(B, Hkv, max(lengths), D, dtype, kb.DEV, seed=gqa * D)
        state = make_state(cfg, k, v, lengths, seed=1, full_qbuffer=fq)
        q = torch.randn(B, Hkv * gqa, D, generator=torch.Generator().manual_seed(2)).to(dtype).to(kb.DEV)
        ref = decode_attention_ref(q, state, cfg, upcast=True, full_qbuffer=fq).float()
        pt = decode_attention_ref(q, state, cfg, upcast=False, full_qbuffer=fq).float()
        tol = attention_tolerance(ref, pt, dtype)
        forms = (False, True) if bf16_forms and dtype == torch.bfloat16 else (None,)
        for (splits, tail, *cost), form in itertools.product(launches, forms):
            cost = cost[0] if cost else 0
            name = f"splits={splits}" + (f" tail={tail}" if tail else "") + (f" chunk_cost={cost}" if cost else "")
            launch = GluonLaunch(splits, tail_splits=tail, chunk_cost=cost)
            if form is not None:
                launch = dataclasses.replace(launch, bf16_magic=form)
                name += " magic" if form else " subnormal"
            try:
                ws = {}
                out = decode_attention_gluon(q, state, cfg, full_qbuffer=fq, workspace=ws, launch=launch).float()
                out2 = decode_attention_gluon(
                    q, state, cfg, full_qbuffer=fq, workspace=ws, launch=launch
                ).float()  # tickets were reset
                err = (out - ref).abs().max().item() if torch.isfinite(out).all() else float("inf")
                err = max(err, (out2 - ref).abs().max().item() if torch.isfinite(out2).all() else float("inf"))
            except Exception as e:  # noqa: BLE001
                kb.log(f"  ERROR {key} {name}: {type(e).__name__}: {str(e)[:300]}")
                err = float("inf")
            ok = err <= tol
            ok_all &= ok
            results["check"][f"{key} {name}"] = {"err": err, "tol": tol, "ok": ok}
            kb.log(f"  {'PASS' if ok else 'FAIL'} {key} {name}: err {err:.3g} tol {tol:.3g}")
        kb.write(results)
    return ok_all


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="8x32768,64x8192,16x8192,1x32768,1x4096")
    ap.add_argument("--check-budget-s", type=float, default=250, help="correctness cases past this are skipped")
    ap.add_argument("--budget-s", type=float, default=330, help="after this, only the default launch is timed")
    ap.add_argument("--deadline-s", type=float, default=450, help="stop timing here (one <= 8 minute GPU call)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument(
        "--variants",
        action="store_true",
        help="the first check pass only; time the default launch against one without prefetch and with 4 tail splits",
    )
    ap.add_argument(
        "--launches",
        default=None,
        help="explicit Gluon launches per shape instead of the sweep over programs per SM, as '8x32768=16:0,15:1;"
        "64x8192=3:0' (page splits:tail splits[:maxnreg][:cN]); the default launch is timed too",
    )
    ap.add_argument(
        "--bf16-forms",
        action="store_true",
        help="time only the default launch and, in bf16, the same launch with the other unpack form (bf16_magic)",
    )
    ap.add_argument(
        "--methods", default=None, help="only these preset/dtype pairs, as 'kitty/float16,kitty-pro/bfloat16'"
    )
    args = ap.parse_args()
    explicit = parse_launches(args.launches)
    methods = None if args.methods is None else {tuple(m.split("/")) for m in args.methods.split(",")}
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    out = args.out or default_out(props.name)
    os.makedirs(out, exist_ok=True)
    kb.RESULT_PATH = str(unused_path(out, "gluon_check.json"))
    env = run_env(props)
    results = {"env": env, "check": {}, "timing": [], "fastest_fp16": {}}
    kb.log("env", json.dumps(env))
    if not args.no_check:
        results["correct"] = check(results, t0, args.check_budget_s, args.variants, args.bf16_forms)
        kb.log(f"correctness: {'PASS' if results['correct'] else 'FAIL'} ({time.time() - t0:.0f} s)")
        kb.write(results)
    copy_bw, _ = kb.copy_bandwidth()
    results["copy_bw"] = copy_bw
    HQ, HKV, D = kb.HQ, kb.HKV, kb.D
    for B, L in [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]:
        kb.log(f"== B={B} L={L}")
        kv_bytes = 2 * B * HKV * L * D * 2
        nrot = kb.n_rotations(kv_bytes)
        qs = [torch.randn(B, HQ, 1, D, device=kb.DEV, dtype=torch.float16) for _ in range(nrot)]
        kvs = [kb.gpu_kv(B, L, seed=i) for i in range(nrot)]
        best = None
        for name, t, _ in kb.sdpa_timings(qs, kvs, B):
            results["timing"].append(dict(B=B, L=L, method=name, us=t * 1e6, bytes=kv_bytes))
            if best is None or t < best[0]:
                best = (t, name)
        kb.log(f"  fastest FP16: {best[1]} {best[0] * 1e6:.1f} us")
        results["fastest_fp16"][f"{B},{L}"] = {"name": best[1], "us": best[0] * 1e6}
        k_full, v_full = kvs[0]
        qs = kvs = None
        torch.cuda.empty_cache()
        for preset, dtype in itertools.product(("kitty", "kitty-pro"), (torch.float16, torch.bfloat16)):
            if methods is not None and (preset, str(dtype)[6:]) not in methods:
                continue
            cfg = PRESETS[preset]
            states, qs, cache_b = kb.rotating_kitty(cfg, k_full, v_full, B, L, dtype)
            nrot = len(states)
            tag = f"{preset} {str(dtype)[6:]}"
            units = states[0].k_page_table.shape[1] + 1

            def row(method, t, **extra):
                r = dict(
                    B=B,
                    L=L,
                    method=f"{tag} {method}",
                    us=t * 1e6,
                    bytes=cache_b,
                    vs_fp16=best[0] / t,
                    pct_copy=100 * cache_b / t / copy_bw,
                    **extra,
                )
                results["timing"].append(r)
                kb.log(f"  {tag} {method} {extra}: {t * 1e6:.1f} us, {best[0] / t:.2f}x, {r['pct_copy']:.0f}% copy")

            t = kb.bench([lambda i=i: decode_attention_triton(qs[i], states[i], cfg) for i in range(nrot)])
            row("tl default", t)
            ws = [{} for _ in range(nrot)]
            # (ctas_per_sm, min_pages, tail_splits, GluonLaunch overrides)
            launches = [(cps, 2, 0, {}) for cps in (8, 4, 16)]
            if B * HKV <= 16:  # small batch: one page per program, the full-precision chunks on programs of their own
                launches += [(8, 1, 4, {}), (8, 1, 8, {})]
            else:  # lower register caps: 10 or 11 one-warp programs per SM instead of 8 (spill-free, CPU-compiled)
                launches += [(10, 2, 0, {"maxnreg": 200}), (11, 2, 0, {"maxnreg": 176})]
            if args.variants:  # the default launch (tail None: its own) against the previous one: no prefetch and,
                # at small batch, 4 tail programs with the sink on split 0
                small = B * HKV <= 16
                old = {"prefetch": False}
                mp = 1 if small else 2
                launches = [(8, mp, 4 if small else 0, old), (8, mp, None, {})]
            if args.bf16_forms:  # the default launch, in bf16 the same with the other unpack form, the default again
                mp = 1 if B * HKV <= 16 else 2
                launches = [(8, mp, None, {})]
                if dtype == torch.bfloat16:
                    other = {"bf16_magic": not GluonLaunch(1).bf16_magic}
                    launches += [(8, mp, None, other), (8, mp, None, {})]
            if (B, L) in explicit:  # the default launch, then the given ones
                launches = [(8, None, None, {})] + [(None, None, None, launch) for launch in explicit[(B, L)]]
            for cps, min_pages, tail, over in launches:
                if time.time() - t0 > args.deadline_s or (time.time() - t0 > args.budget_s and cps != 8):
                    results.setdefault("cut", []).append(f"({B}, {L}) {tag} gluon cps={cps} {over}")
                    kb.log(f"  {tag} gluon cps={cps} {over}: cut by the time budget")
                    continue
                if isinstance(over, GluonLaunch):
                    gl_launch, tail = over, over.tail_splits
                    over = {k: getattr(over, k) for k in ("maxnreg", "chunk_cost")}
                else:
                    gl_launch = default_gluon_launch(B, HKV, units, torch.device("cuda"), cps, min_pages)
                    pages_splits = gl_launch.num_splits - gl_launch.tail_splits  # the default's own tail replaced
                    tail = gl_launch.tail_splits if tail is None else tail
                    gl_launch = dataclasses.replace(gl_launch, num_splits=pages_splits + tail, tail_splits=tail, **over)
                ws = [{} for _ in range(nrot)]
                try:
                    t = kb.bench(
                        [
                            lambda i=i: decode_attention_gluon(qs[i], states[i], cfg, workspace=ws[i], launch=gl_launch)
                            for i in range(nrot)
                        ]
                    )
                except Exception as e:  # noqa: BLE001
                    kb.log(f"  {tag} gluon cps={cps}: failed {type(e).__name__}: {str(e)[:200]}")
                    continue
                splits = gl_launch.num_splits
                # the launch's own bf16_magic last (an override in over names it too)
                row(
                    "gluon",
                    t,
                    **{
                        "ctas_per_sm": cps,
                        "splits": splits,
                        "tail_splits": tail,
                        **over,
                        "bf16_magic": gl_launch.bf16_magic,
                    },
                )
            states = qs = None
            torch.cuda.empty_cache()
        kb.write(results)
        write_markdown(results, out)
    kb.write(results)
    write_markdown(results, out)
    print("wrote", kb.RESULT_PATH)


def parse_launches(spec: str | None) -> dict[tuple[int, int], list[GluonLaunch]]:
    """``--launches``: ``'8x32768=16:0,15:1:200;64x8192=3:0'`` (page splits : tail splits [: register cap],
    ``:cN`` anywhere for ``chunk_cost=N``) ->
    ``{(8, 32768): [GluonLaunch(16), GluonLaunch(16, tail_splits=1, maxnreg=200)], ...}``."""
    out: dict[tuple[int, int], list[GluonLaunch]] = {}
    for part in filter(None, (spec or "").split(";")):
        shape, _, items = part.partition("=")
        try:
            B, L = (int(x) for x in shape.split("x"))
            launches = []
            for item in filter(None, items.split(",")):  # '1x4096=': the default launch only
                fields = item.split(":")
                cost = [int(x[1:]) for x in fields if x.startswith("c")]  # chunk_cost
                f = [int(x) for x in fields if not x.startswith("c")]
                splits, tail, maxnreg = f[0], f[1] if len(f) > 1 else 0, f[2] if len(f) > 2 else 255
                launches.append(
                    GluonLaunch(splits + tail, tail_splits=tail, maxnreg=maxnreg, chunk_cost=(cost or [0])[0])
                )
        except ValueError as e:
            raise ValueError(f"--launches: cannot read {part!r} as 'BxL=splits:tail[:maxnreg],...' ({e})") from e
        out[(B, L)] = launches
    return out


def write_markdown(results: dict, out: str) -> None:
    """``gluon_check.md``: correctness counts and failures, then per shape the fastest FP16 SDPA and every kitty
    method's time and speedup."""
    chk = [(k, v) for k, v in results["check"].items() if "ok" in v]
    lines = [f"# Gluon check ({results['env']['gpu']}, {results['env']['date']})", ""]
    lines.append(f"Correctness: {sum(v['ok'] for _, v in chk)} / {len(chk)} pass.")
    lines += [f"- FAIL {k}: err {v['err']:.3g} tol {v['tol']:.3g}" for k, v in chk if not v["ok"]]
    lines += ["", "| (B, L) | fastest FP16 | method | us | vs FP16 | % copy |", "|---|---|---|---|---|---|"]
    for r in results["timing"]:
        if "vs_fp16" not in r:
            continue
        best = results["fastest_fp16"].get(f"{r['B']},{r['L']}", {})
        defaults = {"tail_splits": 0, "maxnreg": 255, "prefetch": True, "prefetch_l1": False, "chunk_cost": 0}
        keys = ("ctas_per_sm", "splits", "tail_splits", "maxnreg", "prefetch", "prefetch_l1", "chunk_cost")
        extra = " ".join(f"{k}={r[k]}" for k in keys if k in r and r[k] != defaults.get(k))
        lines.append(
            f"| ({r['B']}, {r['L']}) | {best.get('name')} {best.get('us', 0):.1f} | {r['method']} {extra} | "
            f"{r['us']:.1f} | {r['vs_fp16']:.2f}x | {r['pct_copy']:.0f}% |"
        )
    with open(os.path.join(out, "gluon_check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
