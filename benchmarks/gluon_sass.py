"""Compile the Gluon decode kernel for sm_90 (no GPU needed) and count its page loop's SASS.

    PYTHONPATH=.ci/envs/triton-3.6 python benchmarks/gluon_sass.py [--preset kitty] [--dtype float16] [--gqa 4]
        [--head-dim 128] [--json]

Prints (or writes as JSON) registers, spill/local-memory instructions, shared-memory instructions, the hot loop's
SASS count and SASS per cached element (a page is G tokens x D channels of keys and of values), and its integer
instructions per element (loop_int; loop_alu without IMAD, which issues to the FMA pipe).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from benchmarks.sass import loops, sass_text  # noqa: E402
from kitty.core.config import PRESETS  # noqa: E402
from kitty.kernels import decode_gluon as dg  # noqa: E402
from kitty.kernels.gluon_launch import GluonLaunch  # noqa: E402

MAXNREG = int(os.environ.get("GLUON_MAXNREG", "0"))
# integer and logic instructions (loop_int); loop_alu leaves out IMAD, which Hopper issues to the FMA pipe, not to
# the half-rate ALU pipe that runs the rest (LOP3, SHF, IADD3, PRMT, LEA, ...)
INT_OPS = ("LOP3", "SHF", "IADD3", "IMAD", "ISETP", "SEL", "PRMT", "LEA", "SHL", "IMNMX", "I2F", "F2I")
PTR_TYPES = {
    "ws_m_ptr": "fp32",
    "ws_l_ptr": "fp32",
    "ws_z_ptr": "fp32",
    "ws_acc_ptr": "fp32",
    "ticket_ptr": "i32",
    "len_ptr": "i32",
    "k_pt_ptr": "i32",
    "v_pt_ptr": "i32",
    "k_low_ptr": "u8",
    "k_idx_ptr": "u8",
    "v_codes_ptr": "u8",
}


def page_loop(sass: str) -> list[tuple[str, str]]:
    """The page loop over quantized keys and values: the loop with the most tensor-core instructions (the kernel
    runs its full-precision chunk loop first, which holds fewer)."""
    return max(loops(sass), key=lambda body: sum("HMMA" in op for op, _ in body), default=[])


def _regs(k) -> int | None:
    """Registers per thread, from the cubin's resource usage (cuobjdump -res-usage)."""
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    mm = re.search(r"REG:(\d+)", out)
    return int(mm.group(1)) if mm else None


def compile_gluon(
    preset: str,
    dtype: torch.dtype,
    gqa: int = 4,
    D: int = 128,
    one_split: bool = False,
    prefetch: bool = True,
    bf16_magic: bool | None = None,
) -> dict:
    """Compile ``_decode_gluon_kernel`` as the wrapper launches it mid-step; returns cubin, registers, SASS.
    ``one_split``: as the JIT compiles a one-split launch, where every integer argument equal to 1 (the split count
    and merge group) becomes a constant unless the kernel lists it in ``do_not_specialize``. ``prefetch``: the
    launch's ``prefetch`` (pages into L2 one ahead; on by default, as in the wrapper); ``bf16_magic``: the launch's
    ``bf16_magic`` (bf16 codes with magic numbers instead of as subnormals; ``None``: the launch's default)."""
    cfg = PRESETS[preset]
    tdt = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    launch = GluonLaunch(1, prefetch=prefetch)
    if bf16_magic is not None:
        launch = dataclasses.replace(launch, bf16_magic=bf16_magic)
    consts = dg.gluon_constants(cfg, D, gqa, dtype, launch, full_qbuffer=True)
    high = {1: "u8", 2: "i16"}.get(consts["NB4"], "i32")
    fn = dg._decode_gluon_kernel
    if one_split:
        kept = {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
        consts = {**consts, **{n: 1 for n in ("NUM_SPLITS", "MERGE_GROUP") if n not in kept}}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + (high if name == "k_high_ptr" else PTR_TYPES.get(name, tdt))
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    src = GluonASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    k = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, **({"maxnreg": MAXNREG} if MAXNREG else {})}
    )
    sass = sass_text(k.asm["cubin"])
    loop = page_loop(sass)
    ops = [op for op, _ in loop]
    elems = 2 * cfg.group_size * D
    return {
        "preset": preset,
        "dtype": tdt,
        "gqa": gqa,
        "D": D,
        "prefetch": prefetch,
        "bf16_magic": launch.bf16_magic,
        "regs": getattr(k.metadata, "num_regs", None) or _regs(k),
        "spills": None,
        "shared": k.metadata.shared,
        "local_all": sum(1 for line in sass.splitlines() if re.search(r"\b(LDL|STL)\b", line)),
        "loop_sass": len(ops),
        "sass_per_element": len(ops) * 32 / elems,
        "loop_local": sum(op.startswith(("LDL", "STL")) for op in ops),
        "loop_shared": sum(op.startswith(("LDS", "STS")) for op in ops),
        "loop_shared_ops": sorted({t for op, t in loop if op.startswith(("LDS", "STS"))})[:8],
        "loop_int": sum(op.split(".")[0] in INT_OPS for op in ops) * 32 / elems,
        "loop_alu": sum(op.split(".")[0] in INT_OPS and not op.startswith("IMAD") for op in ops) * 32 / elems,
        "loop_hmma": sum(op.startswith("HMMA") for op in ops),
        "ops": {o: ops.count(o) for o in sorted(set(ops), key=lambda o: -ops.count(o))[:25]},
        "_sass": sass,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kitty")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--gqa", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--one-split", action="store_true", help="as the JIT compiles a one-split launch")
    ap.add_argument(
        "--no-prefetch", action="store_true", help="without the launch's prefetch (pages into L2 one ahead)"
    )
    ap.add_argument(
        "--bf16-magic", dest="bf16_magic", action="store_const", const=True, help="bf16 codes with magic numbers"
    )
    ap.add_argument(
        "--bf16-subnormal", dest="bf16_magic", action="store_const", const=False, help="bf16 codes as subnormals"
    )
    ap.add_argument("--sass-out", default=None)
    args = ap.parse_args()
    r = compile_gluon(
        args.preset,
        getattr(torch, args.dtype),
        args.gqa,
        args.head_dim,
        args.one_split,
        not args.no_prefetch,
        args.bf16_magic,
    )
    if args.sass_out:
        open(args.sass_out, "w").write(r["_sass"])
    r.pop("_sass")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
