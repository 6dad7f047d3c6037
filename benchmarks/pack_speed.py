"""Time the predicated pack of a static decode step (``kitty.kernels.pack_completed``, one launch per layer) against
the kernel it replaced (``benchmarks/pack_old.py``), after checking that both write the same bytes.

    python -m benchmarks.pack_speed [--out DIR] [--variants all|default|wide|caps]   # CUDA: about a minute on an H200
    python -m benchmarks.pack_speed --cpu-smoke          # the plumbing on the CPU (Triton interpreter, tiny shapes)
    PYTHONPATH=.ci/envs/triton-3.6 python -m benchmarks.pack_speed --sass [--out DIR]   # sm_90 build, no GPU

CUDA: static-cache-shaped qbuffers, pools and page tables of one layer (8 KV heads, D=128, G=128, bf16; presets
kitty and kitty-pro, S=32, R=128) for B in 1, 16, 28, 100 rows, with lengths at which every row completes a key page
and a value page this step (``complete``: the worst step) or none does (``idle``: what every other step pays). For
each, the old kernel and the new one over a grid of (key programs per page, value programs per page, warps); the
default launch (``pack_splits``, ``PACK_WARPS``) is marked ``*``. Before timing, every variant's pools and page tables
are compared with the old kernel's, field by field. Each launch is timed inside a CUDA graph of ``--reps`` launches
(no Python in the way, as in the captured step), median over ``--replays`` replays, per launch. The issue's target
for a complete step: p99 within 10% of p50, i.e. the pack at most 26 us per layer at B=1 and 89 us at B=100 (a 9.5 ms
and 32.1 ms step over 36 layers). Writes ``pack_speed.json`` to ``--out`` (default
``benchmarks/results/<gpu>-<date>/``).

``--sass``: compiles both kernels for sm_90 with the Triton on the path (the repository's triton-3.6 side env) and
reports registers per thread, local-memory (spill) instructions and the SASS of each branch (key / value program);
the new kernel's branches are straight-line code except for its IEEE-division fallback and its equal-score re-rank,
so its count on the path every program with ordinary ranges and distinct scores takes (``fast``) is that of a build
with both compiled out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--cpu-smoke" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

# the repository root, not this folder: benchmarks/kernels.py would shadow the hub package transformers imports
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from kitty.core.config import get_preset  # noqa: E402
from kitty.core.storage import pool_fields  # noqa: E402

TARGET_US = {1: 26.0, 100: 89.0}  # the budget per layer for a page-completing step
# (key programs per page, value programs per page), warps, register tile: the new kernel's launches timed
GRID = [(s, w, 4096) for s in ((1, 1), (2, 2), (8, 8)) for w in (4, 8)] + [(s, 4, 2048) for s in ((1, 1), (2, 2))]
# --variants wide: the launches a large batch could use (few programs per page, warps, register tile), and the default
# launch packing one side only (``keys`` / ``values``: where a page-completing step's pack time goes)
WIDE = [(s, w, t) for s in ((1, 1), (1, 2), (2, 1), (2, 2)) for w in (4, 8) for t in (2048, 4096, 8192)]
# --variants caps: one program per page under a register cap (more programs per SM, some spilled registers), with
# the warps and tiles the cap suits; (warps, tile, maxnreg), None: the compiler's choice
CAPS = [(8, 4096, None), (8, 4096, 96), (8, 4096, 80), (8, 2048, 80), (8, 2048, 64), (16, 4096, None),
        (16, 4096, 64), (16, 8192, 64), (16, 2048, 64), (4, 2048, 128)]  # fmt: skip


def layer(cfg, B: int, Hkv: int, D: int, dtype, device, width: int, seed: int = 0) -> dict:
    """One static layer's pack inputs: qbuffers, pools of random bytes (``B * width`` pages a side) and empty page
    tables. The qbuffers are random without zeros, each key channel of a head scaled by its own factor (0.5 .. 3).
    Keys are multiples of 2**-8 below 2**5 (rounded so before the cast; bf16 keeps them), so that a channel's sum of
    |k| over G tokens is exact in fp32 whatever the order: the two kernels (and torch) sum in different orders, which
    would otherwise decide a near tie at the top-NB boundary either way (an exact tie both kernels break alike)."""
    G = cfg.group_size
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, Hkv, G, D, generator=g), torch.randn(B, Hkv, G, D, generator=g)
    factor = torch.stack([torch.linspace(0.5, 3.0, D)[torch.randperm(D, generator=g)] for _ in range(Hkv)])
    k = (k * factor[None, :, None, :] * 256).round().clamp(-8191, 8191) / 256
    k, v = (torch.where(x == 0, torch.full_like(x, 2.0**-8), x).to(dtype).to(device) for x in (k, v))
    key_spec, value_spec = pool_fields(cfg, Hkv, D, dtype)
    pools = [
        {n: torch.randint(1, 200, (B * width, *s), generator=g).to(dt).to(device) for n, (s, dt) in spec.items()}
        for spec in (key_spec, value_spec)
    ]
    tables = [torch.full((B, width), -1, dtype=torch.int32, device=device) for _ in range(2)]
    lengths = torch.zeros(B, dtype=torch.int32, device=device)
    return dict(lengths=lengths, k=k, v=v, key_pool=pools[0], value_pool=pools[1], k_pt=tables[0], v_pt=tables[1])


def set_lengths(cfg, st: dict, complete: bool) -> None:
    """Lengths (counting the new token) at which every row completes a key and a value page (pages 1 .. width - 1,
    ragged over rows; needs R a multiple of G), or none does."""
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    assert R % G == 0, "every row completes both sides only when R is a multiple of G"
    B, width = st["k_pt"].shape
    pages = R // G + 1 + torch.arange(B) % max(width - R // G - 1, 1)  # key page index + 1 (>= value's + R / G)
    n = S + G * pages + (0 if complete else 5)
    st["lengths"].copy_(n.to(torch.int32))


def clone(st: dict) -> dict:
    return {
        n: ({f: t.clone() for f, t in x.items()} if isinstance(x, dict) else x.clone()) if n not in ("k", "v") else x
        for n, x in st.items()
    }


def launchers(cfg, B: int, Hkv: int, grid: str = "all") -> dict:
    """name -> (callable(state), meta): the old kernel and the new one over the split / warp grid (``grid``
    ``"wide"``: over :data:`WIDE`, and the default launch of each side alone, ``meta["side"]``; ``"caps"``: over
    :data:`CAPS`)."""
    from benchmarks.pack_old import pack_completed_old
    from kitty.kernels.launch import PACK_WARPS
    from kitty.kernels.pack import PACK_TILE, pack_completed, pack_splits

    splits = pack_splits(B * Hkv, cfg.group_size, cfg.value_bits)
    default = (splits, PACK_WARPS, PACK_TILE)
    out = {
        "old": (
            lambda st: pack_completed_old(
                cfg, st["lengths"], st["k"], st["v"], st["key_pool"], st["value_pool"], st["k_pt"], st["v_pt"]
            ),
            dict(kernel="old", splits=None, warps=4, tile=None, default=False),
        )
    }
    per = 8 // cfg.value_bits
    if grid == "caps":
        variants = [((1, 1), w, t, None, cap) for w, t, cap in CAPS]
    else:
        variants = [(*g, None, None) for g in (WIDE if grid == "wide" else GRID) if max(g[0]) <= cfg.group_size // per]
    if (*default, None, None) not in variants:
        variants.append((*default, None, None))
    if grid == "wide":
        variants += [(*default, "keys", None), (*default, "values", None)]
    for splits, warps, tile, side, cap in variants:
        scratch = {}

        def run(st, splits=splits, warps=warps, tile=tile, scratch=scratch, side=side, cap=cap):
            pack_completed(
                cfg, st["lengths"], st["k"], st["v"], st["key_pool"], st["value_pool"], st["k_pt"], st["v_pt"],
                scratch=scratch, splits=splits, num_warps=warps, tile=tile, keys=side != "values",
                values=side != "keys", maxnreg=cap,
            )  # fmt: skip

        star = "*" if (splits, warps, tile, cap) == (*default, None) and side is None else ""
        name = f"new k{splits[0]}v{splits[1]} w{warps} t{tile}" + (f" r{cap}" if cap else "") + star
        name += f" {side} only" if side else ""
        meta = dict(kernel="new", splits=list(splits), warps=warps, tile=tile, maxnreg=cap, default=bool(star),
                    side=side)  # fmt: skip
        out[name] = (run, meta)
    return out


def same_bytes(a: dict, b: dict) -> list[str]:
    """Names of the pool fields / tables where two states differ."""
    bad = [f for pool in ("key_pool", "value_pool") for f in a[pool] if not torch.equal(a[pool][f], b[pool][f])]
    return bad + [t for t in ("k_pt", "v_pt") if not torch.equal(a[t], b[t])]


def time_graph(fn, st: dict, reps: int, replays: int) -> float:
    """Median microseconds per launch of ``fn(st)``, from CUDA-graph replays of ``reps`` launches."""
    for _ in range(2):
        fn(st)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn(st)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(times)[len(times) // 2]


def bench(args) -> dict:
    smoke = args.cpu_smoke
    device = "cpu" if smoke else "cuda"
    dtype = torch.bfloat16
    Hkv, D = (2, 32) if smoke else (8, 128)
    rows, failures = [], []
    for preset in args.presets.split(","):
        cfg = get_preset(preset)
        if smoke:
            cfg = cfg.with_(group_size=16, local_window=16, sink_tokens=4)
        for B in [int(b) for b in args.batches.split(",")]:
            width = 2 + cfg.local_window // cfg.group_size + min(B, 4)  # room for ragged page indices
            base = layer(cfg, B, Hkv, D, dtype, device, width)
            runs = launchers(cfg, B, Hkv, grid=args.variants)
            if args.variants == "default":
                runs = {n: r for n, r in runs.items() if n == "old" or r[1]["default"]}
            if smoke:  # the interpreter: the old kernel, the default launch and one split launch
                keep = ("old", "new k2v2 w4 t2048")
                runs = {n: r for n, r in runs.items() if n in keep or r[1]["default"]}
            set_lengths(cfg, base, complete=True)
            ref = clone(base)
            runs["old"][0](ref)
            for name, (fn, meta) in runs.items():
                if meta.get("side"):  # one side only: the other side's pool keeps its random bytes
                    continue
                got = clone(base)
                fn(got)
                bad = same_bytes(got, ref)
                if bad:
                    failures.append(f"{preset} B={B} {name}: {', '.join(bad)} differ from the old kernel")
            for case in ("complete", "idle"):
                set_lengths(cfg, base, complete=case == "complete")
                st = clone(base)
                for name, (fn, meta) in runs.items():
                    if smoke:
                        t0 = time.perf_counter()
                        fn(st)
                        us = (time.perf_counter() - t0) * 1e6
                    else:
                        us = time_graph(fn, st, args.reps, args.replays)
                    rows.append(dict(preset=preset, B=B, case=case, variant=name, us=round(us, 2), **meta))
                    print(f"{preset:9s} B={B:<3d} {case:8s} {name:18s} {us:9.2f} us", flush=True)
    return dict(rows=rows, failures=failures)


def table(rows: list[dict]) -> str:
    """Markdown: one line per (preset, B, case), one column per variant."""
    names = list(dict.fromkeys(r["variant"] for r in rows))
    keys = list(dict.fromkeys((r["preset"], r["B"], r["case"]) for r in rows))
    us = {(r["preset"], r["B"], r["case"], r["variant"]): r["us"] for r in rows}
    lines = ["| preset | B | case | target | " + " | ".join(names) + " |", "|---" * (len(names) + 4) + "|"]
    for p, B, case in keys:
        target = TARGET_US.get(B, "") if case == "complete" else ""
        cells = [f"{us[(p, B, case, n)]:.1f}" if (p, B, case, n) in us else "" for n in names]
        lines.append(f"| {p} | {B} | {case} | {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- sm_90 build (--sass)


def compile_sass(fn, cfg, dtype, D: int, num_warps: int, extra: dict, options: dict | None = None) -> dict:
    """Build ``fn`` (a ``_pack_kernel``) for sm_90 as ``pack_completed`` launches it (``options``: further compile
    options, e.g. a fitted key range's); registers, local-memory instructions and SASS per branch (the instructions
    before / after the key-or-value branch)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from benchmarks.sass import sass_text
    from kitty.kernels._tiles import TLTYPE

    tl_dtype = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    nb = cfg.num_boosted(D)
    consts = dict(
        G=cfg.group_size, D=D, NB=nb, NBQP=triton.next_power_of_2(max(-(-nb // 4), 1)),
        KEY_LEVELS=(1 << cfg.key_bits) - 1, VBITS=cfg.value_bits, USE_MASK=False, DTYPE=TLTYPE[dtype],
        ITYPE=triton.language.int16 if dtype != torch.float32 else triton.language.int32,
        ROUND_UP=dtype != torch.float32, PREDICATED=True, S=cfg.sink_tokens, R=cfg.local_window, **extra,
    )  # fmt: skip
    ptr = dict.fromkeys(("kq_ptr", "vq_ptr", "k_scale_ptr", "k_zero_ptr", "v_scale_ptr", "v_zero_ptr"), tl_dtype)
    ptr.update(dict.fromkeys(("k_low_ptr", "k_high_ptr", "k_idx_ptr", "v_codes_ptr", "k_mask_ptr"), "u8"))
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):  # the rest: int32 rows, pages, lengths, page tables
            sig[name] = "*" + ptr.get(name, "i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name.startswith(("skq", "svq")):  # qbuffer strides: multiples of 16 at these shapes
                attrs[(i,)] = [["tt.divisibility", 16]]
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **(options or {})})
    sass = sass_text(k.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    branch = int(re.search(r"@!?U?P\d BRA (0x[0-9a-f]+)", sass).group(1), 16)  # key programs / value programs
    ops = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for _, t in ins]
    local = [op.startswith(("LDL", "STL")) for op in ops]
    n_key = sum(a < branch for a, _ in ins)
    return dict(
        regs=int(re.search(r"REG:(\d+)", usage).group(1)),
        stack_bytes=int(re.search(r"STACK:(\d+)", usage).group(1)),
        local_instructions=sum(local),
        sass=len(ins),
        key_sass=n_key,
        value_sass=len(ins) - n_key,
        shared_bytes=k.metadata.shared,
    )


def fast_path_kernel():
    """``kernels/pack.py``'s ``_pack_kernel`` with the IEEE-division fallback (``fast = True``) and the equal-score
    re-rank compiled out: the straight-line code of a program whose ranges are ordinary and whose channel scores are
    distinct, to count what such a program executes (the equal-score check's own reduction, a few instructions, is
    compiled out with it)."""
    import importlib.util
    import re
    import tempfile

    src = (_HERE.parent / "kernels" / "pack.py").read_text()
    src = src.replace("from ._", "from kitty.kernels._").replace("from .launch", "from kitty.kernels.launch")
    src, n = re.subn(r"(\n\s*)(v?fast) = tl\.min\(.*\n", r"\1\2 = True\n", src)
    assert n == 2, "expected the key and the value program's fast flags"
    tie = "if tl.sum(rank, axis=0) != D * (D - 1) // 2:"
    assert src.count(tie) == 1, "expected the key program's equal-score check"
    src = src.replace(tie, "if False:")
    path = Path(tempfile.mkdtemp()) / "pack_fast_path.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("pack_fast_path", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._pack_kernel


def sass_report(args) -> dict:
    import benchmarks.pack_old as old
    import kitty.kernels.pack as new

    fast = fast_path_kernel()
    rows = []
    for preset in args.presets.split(","):
        cfg = get_preset(preset)
        fit, options = new._fit_args(cfg, True)  # fitted key ranges: the search's meta-parameters, no FMA contraction
        if not fit["FIT"]:  # the old kernel packs min-max ranges only
            row = dict(preset=preset, kernel="old", splits=None, warps=4, tile=None)
            rows.append({**row, **compile_sass(old._pack_kernel, cfg, torch.bfloat16, 128, 4, {})})
        for splits, warps, tile in GRID:
            if fit["FIT"] and splits[0] != 1:  # a fitted page packs in one key program (pack.py _default_splits)
                continue
            steps = {**new._steps(cfg.group_size, 128, cfg.value_bits, *splits, tile), **fit}
            row = dict(preset=preset, kernel="new", splits=list(splits), warps=warps, tile=tile)
            built = compile_sass(new._pack_kernel, cfg, torch.bfloat16, 128, warps, steps, options)
            path = compile_sass(fast, cfg, torch.bfloat16, 128, warps, steps, options)
            rows.append({**row, **built, "fast_key_sass": path["key_sass"], "fast_value_sass": path["value_sass"]})
    for r in rows:
        threads = 32 * r["warps"]
        fast = f", fast path key {r['fast_key_sass']} value {r['fast_value_sass']}" if "fast_key_sass" in r else ""
        print(
            f"{r['preset']:9s} {r['kernel']} splits={r['splits']} warps={r['warps']} tile={r['tile']}: "
            f"{r['regs']} registers, {r['stack_bytes']} B stack, {r['local_instructions']} LDL/STL, "
            f"SASS key {r['key_sass']} value {r['value_sass']} per thread ({threads} threads){fast}"
        )
    return dict(rows=rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for the JSON (default: benchmarks/results/<gpu>-<date>/)")
    ap.add_argument("--presets", default="kitty,kitty-pro")
    ap.add_argument("--batches", default=None, help="rows B, comma-separated (default 1,16,28,100; smoke 1,3)")
    ap.add_argument("--reps", type=int, default=10, help="launches per CUDA graph")
    ap.add_argument("--replays", type=int, default=11, help="timed replays (the median is reported)")
    ap.add_argument(
        "--variants",
        choices=("all", "default", "wide", "caps"),
        default="all",
        help="new kernel: the grid, the default only, the large-batch grid and each side alone, or register caps",
    )
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    ap.add_argument("--sass", action="store_true", help="build for sm_90 and count registers / spills / SASS")
    args = ap.parse_args(argv)
    args.batches = args.batches or ("1,3" if args.cpu_smoke else "1,16,28,100")
    import triton

    if args.sass:
        name, result = "pack_sass.json", sass_report(args)
        out = Path(args.out) if args.out else None
    else:
        if not args.cpu_smoke and not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --cpu-smoke, or --sass)")
        from benchmarks.results_dir import default_out

        gpu = torch.cuda.get_device_name(0) if not args.cpu_smoke else "cpu"
        out = Path(args.out) if args.out else (None if args.cpu_smoke else default_out(gpu))
        t0 = time.time()
        result = bench(args)
        result.update(device=gpu, seconds=round(time.time() - t0, 1))
        print(table(result["rows"]))
        name = "pack_speed.json"
    result.update(torch=torch.__version__, triton=triton.__version__)
    if out is not None:
        from benchmarks.results_dir import unused_path

        out.mkdir(parents=True, exist_ok=True)
        path = unused_path(out, name)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print("wrote", path)
    if result.get("failures"):
        raise SystemExit("bytes differ:\n" + "\n".join(result["failures"]))


if __name__ == "__main__":
    main()
