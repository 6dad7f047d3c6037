"""Packed codes -> tensor-core operands: the primitives of the fused decode kernel (``kernels/decode_attention.py``).

Decode attention reads each cached byte once and does little arithmetic with it, so turning 2-bit codes into
tensor-core operands must cost a few instructions per code. These device functions do it:

- :func:`magic_code` / :func:`_codes`: **codes as 16-bit floats by bit placement.** A code in the low bits of a zero
  fp16 lane is the subnormal ``code * 2^-24``, exact (tensor cores keep fp16 subnormals); ``0x4300 | code`` read as
  bf16 is ``128 + code``. One inline-PTX block turns four packed bytes into four such values. The scale ``UNIT`` is
  undone on the fp32 product; bf16's offset ``OFF`` is removed after it, ``dot(x, OFF + code) = OFF * sum(x) +
  dot(x, code)``, from ``sum(x)`` of the same rounded ``x``. Under ``TRITON_INTERPRET=1`` the same values come from
  plain integer ops.
- :func:`_operand` / :func:`_merge` / :func:`_widen`: **the two-part small operand** (``TWO_PART``). An fp32
  operand such as ``q * scale`` rounded once to 16 bits, multiplying codes up to 3 (15 when boosted), errs up to 2x
  more than dequantizing first; carried as its rounding and the rounding's remainder, side by side as the columns
  ``2r, 2r + 1`` of the small side, the product is as accurate as dequantizing first. With GQA 4 both parts fit in
  the 8 columns of one ``m16n8k16`` tile. :func:`_merge` adds the two columns of a product back together.
- :func:`_mm`: a product in fp32, on the tensor cores where the reduction is long enough.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tiles import INTERPRET

__all__ = ["magic_code"]


def magic_code(dtype: torch.dtype, bits: int, shift: int) -> tuple[str, float, float]:
    """``(asm, OFF, UNIT)`` for turning codes ``(byte >> shift) & (2**bits - 1)`` into ``OFF + UNIT * code``.

    ``asm`` is one PTX block for ``tl.inline_asm_elementwise(..., pack=4)``: its input ``$2`` holds four bytes, its
    outputs ``$0``/``$1`` two 16-bit values each. fp16: shift, one AND for all four codes, and two ``prmt`` that
    spread the bytes into the low bits of 16-bit lanes: the lane is the fp16 *subnormal* ``code * 2**-24``, exact,
    with no offset (4 instructions per 4 codes). bf16 (whose products of subnormals would underflow fp32): ``prmt``
    also inserts the high byte ``0x43`` and one AND per lane keeps the code bits: ``128 + code``, exact.
    ``asm`` is ``""`` where no such trick applies (fp32 operands): the kernel converts plainly.
    """
    if dtype == torch.float16:
        mask = ((1 << bits) - 1) * 0x01010101
        asm = (
            "{ .reg .b32 t; "
            f"shr.b32 t, $2, {shift}; and.b32 t, t, 0x{mask:08X}; "
            "prmt.b32 $0, t, 0, 0x4140; prmt.b32 $1, t, 0, 0x4342; }"
        )
        return asm, 0.0, 2.0**-24
    if dtype == torch.bfloat16:
        mask = (0xFF00 | ((1 << bits) - 1)) * 0x10001  # keep the OFF byte and the code bits of both lanes
        asm = (
            "{ .reg .b32 t, c; "
            f"mov.b32 c, 0x43434343; shr.b32 t, $2, {shift}; "
            "prmt.b32 $0, t, c, 0x4140; prmt.b32 $1, t, c, 0x4342; "
            f"and.b32 $0, $0, 0x{mask:08X}; and.b32 $1, $1, 0x{mask:08X}; }}"
        )
        return asm, 128.0, 1.0
    return "", 0.0, 1.0


@triton.jit
def _codes(
    b,
    SHIFT: tl.constexpr,
    BITS: tl.constexpr,
    ASM: tl.constexpr,
    OFF: tl.constexpr,
    UNIT: tl.constexpr,
    DOT: tl.constexpr,
):
    """``OFF + UNIT * ((b >> SHIFT) & (2^BITS - 1))`` in ``DOT`` for a uint8 tensor ``b`` (see :func:`magic_code`)."""
    if INTERPRET or ASM == "":
        c = ((b.to(tl.int32) >> SHIFT) & ((1 << BITS) - 1)).to(tl.float32)
        y = (c * UNIT + OFF).to(DOT)
    elif DOT == tl.float16:
        y = tl.inline_asm_elementwise(ASM, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
    else:
        y = tl.inline_asm_elementwise(ASM, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
    return y


@triton.jit
def _mm(a, b, DOT: tl.constexpr):
    """``a @ b`` in fp32 on the tensor cores (``tl.dot`` needs a reduction length >= 16), else as a broadcast sum."""
    if a.shape[1] >= 16:
        if DOT == tl.float32:
            y = tl.dot(a, b, input_precision="ieee")
        else:
            y = tl.dot(a, b)
    else:
        y = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    return y


@triton.jit
def _operand(x, DOT: tl.constexpr, TWO_PART: tl.constexpr):
    """The small operand ``x`` ``(K, N)`` fp32 in ``DOT``: ``(K, N)`` rounded, or with ``TWO_PART`` ``(K, 2N)`` whose
    columns ``2r, 2r + 1`` are ``x[:, r]`` rounded and the rounding's remainder (their sum is ``x`` to ~22 bits)."""
    hi = x.to(DOT)
    if TWO_PART:
        lo = (x - hi.to(tl.float32)).to(DOT)
        y = tl.reshape(tl.join(hi, lo), (x.shape[0], 2 * x.shape[1]))
    else:
        y = hi
    return y


@triton.jit
def _merge(y, TWO_PART: tl.constexpr):
    """Inverse layout of :func:`_operand` on a product: ``(M, 2N) -> (M, N)``, column ``r`` = ``y[:, 2r] +
    y[:, 2r + 1]`` with ``TWO_PART`` (else ``y``)."""
    if TWO_PART:
        a, b = tl.split(tl.reshape(y, (y.shape[0], y.shape[1] // 2, 2)))
        y = a + b
    return y


@triton.jit
def _widen(x, TWO_PART: tl.constexpr):
    """A per-column vector ``(N,)`` for the ``(.., 2N)`` layout of :func:`_operand` (each entry twice)."""
    if TWO_PART:
        x = tl.reshape(tl.join(x, x), (2 * x.shape[0],))
    return x
