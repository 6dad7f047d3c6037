"""Compile the fused decode kernel for the H100/H200 (sm_90a) without a GPU and count the SASS of its hot loop.

    python -m benchmarks.sass [--preset kitty] [--dtype float16] [--out DIR]

Builds ``kernels.decode_attention._decode_split_kernel`` exactly as the wrapper launches it during a decode step at the
benchmark's target shape (B=8 rows, 32 query / 8 KV heads, D=128, L=32K; the preset's G, S, R): the constants of
``kernel_constants`` and the launch of ``kernels.launch.default_launch`` (for the H200's 132 SMs), through Triton's
own compiler and ptxas, disassembles the cubin
(``cuobjdump`` shipped with Triton), finds the loop that holds the most tensor-core instructions (the page loop
over quantized keys and values) and reports its instructions per cached element: one iteration covers one page of
one KV head, ``G * D`` key codes and ``G * D`` value codes, spread over ``32 * num_warps`` threads.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kitty.kernels.decode_attention as da
from kitty.core.config import PRESETS
from kitty.kernels.launch import H200_SMS, Launch, default_launch


def compile_kernel(
    preset: str,
    dtype: torch.dtype,
    launch: Launch,
    D: int = 128,
    QH: int = 4,
    arch: int = 90,
) -> dict:
    """Compile ``_decode_split_kernel`` as ``decode_attention_triton`` launches it with ``launch`` during a decode
    step (``full_qbuffer=True``): the same constants (``kernel_constants``) and launch options."""
    cfg = PRESETS[preset]
    tdt = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    ptr_types = {
        "ws_m_ptr": "fp32",
        "ws_l_ptr": "fp32",
        "ws_acc_ptr": "fp32",
        "len_ptr": "i32",
        "k_pt_ptr": "i32",
        "v_pt_ptr": "i32",
        "k_low_ptr": "u8",
        "k_high_ptr": "u8",
        "k_idx_ptr": "u8",
        "v_codes_ptr": "u8",
    }
    fn = da._decode_split_kernel
    constexprs = da.kernel_constants(cfg, D, QH, dtype, launch, full_qbuffer=True)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):  # the kernel's tensors (its pointer arguments)
            signature[name] = "*" + ptr_types.get(name, tdt)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch.options())
    return {
        "ptx": k.asm["ptx"],
        "cubin": k.asm["cubin"],
        "n_regs": getattr(k, "n_regs", None),
        "shared": k.metadata.shared,
        "G": cfg.group_size,
        "D": D,
        "threads": 32 * launch.num_warps,
    }


def sass_text(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def loops(sass: str) -> list[list[tuple[str, str]]]:
    """The loops of a SASS listing (bodies from a backward branch's target to the branch), in address order, each
    as instructions ``(opcode, text)``."""
    lines = []
    for line in sass.splitlines():
        mm = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if mm:
            lines.append((int(mm.group(1), 16), mm.group(2).strip()))
    addr = {a: i for i, (a, _) in enumerate(lines)}
    found = []
    for i, (a, text) in enumerate(lines):
        tgt = re.search(r"0x([0-9a-f]+)", text) if "BRA" in text else None
        if tgt is None:
            continue
        t = int(tgt.group(1), 16)
        if t < a and t in addr:
            found.append((t, lines[addr[t] : i + 1]))
    out = []
    for _, body in sorted(found, key=lambda x: x[0]):
        out.append([(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0], text) for _, text in body])
    return out


def hot_loop(sass: str) -> list[tuple[str, str]]:
    """The page loop over quantized keys and values: the first loop with tensor-core instructions (the fused kernel
    runs it before the loop over pages whose values are still in full precision, which can hold more HMMAs)."""
    return next((body for body in loops(sass) if any("HMMA" in op for op, _ in body)), [])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kitty")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument(
        "--batch", type=int, default=8, help="rows B: the launch is the kernel's default for (B, 8 KV heads)"
    )
    ap.add_argument("--context", type=int, default=32768, help="tokens per row L (the split count's page slots)")
    ap.add_argument("--sms", type=int, default=H200_SMS, help="SMs of the target GPU (the launch heuristic reads it)")
    ap.add_argument(
        "--num-warps", type=int, default=None, help="replace the default launch's warps (and drop its register cap)"
    )
    ap.add_argument("--block-h", type=int, default=4, help="query rows per program (the kernel's block_h)")
    ap.add_argument(
        "--operand-parts",
        type=int,
        default=1,
        help="small operands carried as two 16-bit parts: 1 q*scale (the default launch), 2 p*scale, 3 both, 0 neither",
    )
    ap.add_argument("--out", default=None, help="folder to write the PTX and SASS to")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    cfg = PRESETS[args.preset]
    slots = max(args.context - cfg.sink_tokens, 0) // cfg.group_size + 1  # as the wrapper: page-table width + 1
    launch = dataclasses.replace(
        default_launch(args.batch, 8, slots, args.sms), block_h=args.block_h, operand_parts=args.operand_parts
    )
    if args.num_warps is not None:  # the register cap goes with the default warp count
        launch = dataclasses.replace(launch, num_warps=args.num_warps, maxnreg=None)
    k = compile_kernel(args.preset, dtype, launch)
    sass = sass_text(k["cubin"])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        open(os.path.join(args.out, "decode.ptx"), "w").write(k["ptx"])
        open(os.path.join(args.out, "decode.sass"), "w").write(sass)
    loop = hot_loop(sass)
    elems = 2 * k["G"] * k["D"]  # key codes + value codes of one page of one KV head
    per_thread = elems / k["threads"]
    ops = collections.Counter(op.split(".")[0] for op, _ in loop)
    print(f"{args.preset} {args.dtype} {launch}: registers {k['n_regs']}, shared {k['shared']} B")
    print(
        f"hot loop: {len(loop)} instructions per thread per page = {len(loop) / per_thread:.2f} per cached element "
        f"({per_thread:.0f} codes per thread per page)"
    )
    print("  " + ", ".join(f"{op} {c}" for op, c in ops.most_common(24)))
    for i, body in enumerate(loops(sass)):
        hmma = sum("HMMA" in op for op, _ in body)
        print(f"loop {i}: {len(body)} instructions ({len(body) / per_thread:.2f} per cached element), {hmma} HMMA")


if __name__ == "__main__":
    main()
