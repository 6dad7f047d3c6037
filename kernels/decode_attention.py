"""Fused split-K decode attention over a Kitty cache (flash-decoding over sink | pages | qbuffers | local window).

The paper (§4.3, step 2) computes decode attention with a ``qk`` kernel, a torch softmax and an ``sv`` kernel, one
program per (batch, KV head) walking every page serially, and leaves fusion as future work. This kernel fuses it:
for each row's new query token it reads the storage of ``docs/LAYOUT.md`` directly -- the full-precision sink, the
key/value pages through the page tables, the key and value qbuffers and the value local window -- and never writes
scores to memory. Program = (row b, KV head h, split); the QH = Hq/Hkv query heads of h share every load.

Decode attention reads each cached byte once and does little arithmetic with it, so the kernel is fast only if
turning 2-bit codes into tensor-core operands costs a few instructions per code at most. Three identities bring it
down (about 4 SASS instructions per cached element in the hot loop, from 17 for dequantized tiles;
``benchmarks/sass.py``, ``benchmarks/RESULTS.md``):

1. **Token order inside a page is free.** Softmax and ``P @ V`` do not change when the tokens of a page are permuted,
   as long as keys and values follow the same permutation. A key plane byte holds tokens ``4i .. 4i+3`` of one
   channel (token ``4i+s`` at bits ``2s``), so ``(byte >> 2s) & 3`` over the page's ``(D, G/4)`` bytes *is* the
   ``K^T`` tile of the tokens ``{4i + s}``: a page is four "quarters" of ``G/4`` tokens, each a plain tile of the
   same shape as the bytes, with no reshape or interleave. Values of quarter ``s`` are the value rows ``4i + s``
   (an address change only). A value byte holds channels ``4j .. 4j+3`` of one token, so ``(byte >> 2r) & 3`` is
   the ``(G/4, D/4)`` tile of channels ``{4j + r}``: ``P @ V`` is accumulated per channel quarter and interleaved
   once, when the split's result is stored.
2. **Scale and zero off the per-code path** (keys: per channel ``c`` of a page, values: per token ``t``)::

       q . k_t   = sum_c (q_c scale_c) code_ct + sum_c q_c zero_c        (+ 4 (q scale)_c high_ct, boosted c)
       p . V[:,c] = sum_t (p_t scale_t) code_tc + sum_t p_t zero_t

   so the big operands are exact small integers; ``q * scale`` is formed once per page, ``p * scale`` once per
   quarter, and the boosted channels' high bits are a second, small product over the compact high plane
   (``q'`` gathered to the boosted channels' slots by a one-hot product with ``boost_idx``).
3. **Codes as 16-bit floats by bit placement.** A code in the low bits of a zero fp16 lane is the subnormal
   ``code * 2^-24``, exact (tensor cores keep fp16 subnormals); ``0x4300 | code`` read as bf16 is ``128 + code``.
   One inline-PTX block turns four packed bytes into four such values (shift, AND, two byte permutes: one
   instruction per code for fp16). The scale ``UNIT`` is undone on the fp32 product; bf16's offset ``OFF`` is
   removed after it, ``dot(x, OFF + code) = OFF * sum(x) + dot(x, code)``, from ``sum(x)`` of the same rounded
   ``x`` (an offset of 128 costs ~7 of fp32's 24 bits: far below bf16 rounding).
   Under ``TRITON_INTERPRET=1`` the same values come from plain integer ops.

Per program (``m`` = tokens past the sink, ``pk = m // G`` full key pages, ``pv = max(m - R, 0) // G`` full value
pages; split ``s`` owns a contiguous run of the ``cdiv(m, G)`` page slots)::

    for page j in run:   j < pv:  quantized keys, quantized values        (the hot loop: no branches)
                         j < pk:  quantized keys, values from v_qbuf / v_local (full precision)
                         else:    keys from k_qbuf (masked past m), values full precision
        4 quarters: scores (base-2 logits) -> one online-softmax step for the page -> P @ V per quarter
    split 0: the sink;  write (m_i, l_i, acc) of the split;  a second kernel reduces the splits.

Mid-step (``full_qbuffer=True``, how the cache calls it during a decode step): a qbuffer the new token filled is not
packed yet, so ``pk = max(cdiv(m, G) - 1, 0)`` (and likewise ``pv``) and that qbuffer is attended in full precision.

The torch reference ``decode_attention_ref`` (``kernels/reference.py``) dequantizes with ``kitty.quant``,
assembles position-ordered K/V per row and runs softmax attention in fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kitty.config import BACKENDS, KVQuantConfig

from ._tiles import (
    INTERPRET,
    INTERPRETING,
    TLTYPE,
    cast_to,
    check_power_of_two,
    fp_values,
    is_power_of_two,
    program_row,
)
from .launch import Launch, default_launch
from .reference import KittyLayerState, check_state, decode_attention_ref  # noqa: F401 (re-exported)

__all__ = ["KittyLayerState", "decode_attention", "decode_attention_ref", "decode_attention_triton", "triton_supports"]

LOG2E = 1.4426950408889634  # 1 / ln 2: softmax in base 2


# ------------------------------------------------------------------------------------- codes -> MMA operands


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
        asm = ("{ .reg .b32 t; "
               f"shr.b32 t, $2, {shift}; and.b32 t, t, 0x{mask:08X}; "
               "prmt.b32 $0, t, 0, 0x4140; prmt.b32 $1, t, 0, 0x4342; }")
        return asm, 0.0, 2.0**-24
    if dtype == torch.bfloat16:
        mask = (0xFF00 | ((1 << bits) - 1)) * 0x10001  # keep the OFF byte and the code bits of both lanes
        asm = ("{ .reg .b32 t, c; "
               f"mov.b32 c, 0x43434343; shr.b32 t, $2, {shift}; "
               "prmt.b32 $0, t, c, 0x4140; prmt.b32 $1, t, c, 0x4342; "
               f"and.b32 $0, $0, 0x{mask:08X}; and.b32 $1, $1, 0x{mask:08X}; }}")
        return asm, 128.0, 1.0
    return "", 0.0, 1.0


@triton.jit
def _codes(b, SHIFT: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, OFF: tl.constexpr, UNIT: tl.constexpr,
           DOT: tl.constexpr):
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
def _mm2(a, a_lo, b, DOT: tl.constexpr, SPLIT: tl.constexpr):
    """``(a + a_lo) @ b`` when ``SPLIT`` (an operand carried as rounded part + remainder), else ``a @ b``."""
    y = _mm(a, b, DOT)
    if SPLIT:
        y += _mm(a_lo, b, DOT)
    return y


# ------------------------------------------------------------------------------------------- one page, keys


@triton.jit
def _key_page_scores(q, low_ptr, high_ptr, idx_ptr, scale_ptr, zero_ptr, raw_ptr, pbase, qk_scale,
                     G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, KEY_RAW: tl.constexpr,
                     DOT: tl.constexpr, KA0: tl.constexpr, KA1: tl.constexpr, KA2: tl.constexpr, KA3: tl.constexpr,
                     KOFF: tl.constexpr, KUNIT: tl.constexpr, SPLIT: tl.constexpr):
    """Base-2 logits ``(BLOCK_H, G/4)`` of the four token quarters ``{4i + s}`` of one key page (``pbase`` = pool
    page * Hkv + head, int64), from the 2-bit planes (or ``k_raw`` rows when ``KEY_RAW``). ``SPLIT``: ``q * scale``
    is carried as two 16-bit operands (rounded part + remainder), one more product over the same codes."""
    G4: tl.constexpr = G // 4
    d = tl.arange(0, D)
    i = tl.arange(0, G4)
    if KEY_RAW:  # k_raw [P, Hkv, G, D]: every row of the page holds a token
        s0, s1, s2, s3 = _fp_key_scores(q, raw_ptr + pbase * (G * D), 0, G, qk_scale, G, D, DOT)
    else:
        scale = tl.load(scale_ptr + pbase * D + d)
        zero = tl.load(zero_ptr + pbase * D + d).to(tl.float32)
        # q * scale, once per page (exact in fp32), rounded to the operand dtype; with SPLIT its rounding error is a
        # second operand, so that the folded product is as accurate as dequantizing first (the codes reach up to
        # 3x the scale, the dequantized key only |k|: a single rounding of q * scale can err up to 2x more)
        qsf = q.to(tl.float32) * scale[None, :].to(tl.float32)  # (BLOCK_H, D)
        qs = qsf.to(DOT)
        qs_lo = (qsf - qs.to(tl.float32)).to(DOT)
        low = tl.load(low_ptr + pbase * (D * G4) + d[:, None] * G4 + i[None, :])  # (D, G/4) bytes
        if KOFF != 0:
            corr = tl.sum(qs.to(tl.float32), 1)  # the OFF term of every code's product
            if SPLIT & 1:
                corr += tl.sum(qs_lo.to(tl.float32), 1)
        if NB > 0:
            # int32 before any arithmetic: uint8 slot * row bytes wraps at 256 (the paper kernel's slot-8 alias)
            idx = tl.load(idx_ptr + pbase * D + d).to(tl.int32)
            if KOFF != 0:
                qsum = qs.to(tl.float32)
                if SPLIT & 1:
                    qsum += qs_lo.to(tl.float32)
                corr += 4.0 * tl.sum(tl.where((idx < NB)[None, :], qsum, 0.0), 1)
            slots = tl.arange(0, NBP)
            if NB == D:  # 4-bit keys: every channel, slots in channel order
                qb4 = (qs.to(tl.float32) * 4.0).to(DOT)
                qb4_lo = (qs_lo.to(tl.float32) * 4.0).to(DOT)
            else:  # q' of the boosted channels at their slots: a one-hot product, exact
                sel = (idx[:, None] == slots[None, :]).to(DOT)  # (D, NBP)
                qb4 = (_mm(qs, sel, DOT) * 4.0).to(DOT)
                qb4_lo = (_mm(qs_lo, sel, DOT) * 4.0).to(DOT)
            high = tl.load(high_ptr + pbase * (NB * G4) + slots[:, None] * G4 + i[None, :],
                           mask=(slots < NB)[:, None], other=0)  # (NBP, G/4) bytes of the compact high plane
        qz = tl.sum(q.to(tl.float32) * zero[None, :], 1)
        a = qk_scale * (1.0 / KUNIT)
        if KOFF != 0:
            bias = (qz - corr * (KOFF / KUNIT)) * qk_scale  # (BLOCK_H,)
        else:
            bias = qz * qk_scale
        s0 = _mm2(qs, qs_lo, _codes(low, 0, 2, KA0, KOFF, KUNIT, DOT), DOT, (SPLIT & 1) != 0)
        s1 = _mm2(qs, qs_lo, _codes(low, 2, 2, KA1, KOFF, KUNIT, DOT), DOT, (SPLIT & 1) != 0)
        s2 = _mm2(qs, qs_lo, _codes(low, 4, 2, KA2, KOFF, KUNIT, DOT), DOT, (SPLIT & 1) != 0)
        s3 = _mm2(qs, qs_lo, _codes(low, 6, 2, KA3, KOFF, KUNIT, DOT), DOT, (SPLIT & 1) != 0)
        if NB > 0:
            s0 += _mm2(qb4, qb4_lo, _codes(high, 0, 2, KA0, KOFF, KUNIT, DOT), DOT, (SPLIT & 1) != 0)
            s1 += _mm2(qb4, qb4_lo, _codes(high, 2, 2, KA1, KOFF, KUNIT, DOT), DOT, (SPLIT & 1) != 0)
            s2 += _mm2(qb4, qb4_lo, _codes(high, 4, 2, KA2, KOFF, KUNIT, DOT), DOT, (SPLIT & 1) != 0)
            s3 += _mm2(qb4, qb4_lo, _codes(high, 6, 2, KA3, KOFF, KUNIT, DOT), DOT, (SPLIT & 1) != 0)
        s0 = s0 * a + bias[:, None]
        s1 = s1 * a + bias[:, None]
        s2 = s2 * a + bias[:, None]
        s3 = s3 * a + bias[:, None]
    return s0, s1, s2, s3


@triton.jit
def _fp_key_scores(q, k_ptr, rel0, m, qk_scale, G: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr):
    """Base-2 logits of the four quarters of a page of 16-bit keys ``(G, D)`` at ``k_ptr`` (a ``k_raw`` page, or the
    key qbuffer, slot = token) whose first token is ``rel0`` (a multiple of G), ``-inf`` for tokens past ``m``."""
    G4: tl.constexpr = G // 4
    d = tl.arange(0, D)
    i = tl.arange(0, G4)
    base = k_ptr + d[:, None]
    v0 = rel0 + 4 * i < m
    v1 = rel0 + 4 * i + 1 < m
    v2 = rel0 + 4 * i + 2 < m
    v3 = rel0 + 4 * i + 3 < m
    s0 = _mm(q, tl.load(base + (4 * i)[None, :] * D, mask=v0[None, :], other=0.0).to(DOT), DOT) * qk_scale
    s1 = _mm(q, tl.load(base + (4 * i + 1)[None, :] * D, mask=v1[None, :], other=0.0).to(DOT), DOT) * qk_scale
    s2 = _mm(q, tl.load(base + (4 * i + 2)[None, :] * D, mask=v2[None, :], other=0.0).to(DOT), DOT) * qk_scale
    s3 = _mm(q, tl.load(base + (4 * i + 3)[None, :] * D, mask=v3[None, :], other=0.0).to(DOT), DOT) * qk_scale
    s0 = tl.where(v0[None, :], s0, float("-inf"))
    s1 = tl.where(v1[None, :], s1, float("-inf"))
    s2 = tl.where(v2[None, :], s2, float("-inf"))
    s3 = tl.where(v3[None, :], s3, float("-inf"))
    return s0, s1, s2, s3


@triton.jit
def _page_softmax(s0, s1, s2, s3, m_i):
    """One online-softmax step over a page's four quarters: ``(p0, p1, p2, p3, alpha, m_new)``."""
    m_new = tl.maximum(m_i, tl.max(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)), 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_safe)
    return (tl.exp2(s0 - m_safe[:, None]), tl.exp2(s1 - m_safe[:, None]), tl.exp2(s2 - m_safe[:, None]),
            tl.exp2(s3 - m_safe[:, None]), alpha, m_new)


@triton.jit
def _key_page_step(q, low_ptr, high_ptr, idx_ptr, scale_ptr, zero_ptr, raw_ptr, kpage, qk_scale, m_i, l_i,
                   G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, KEY_RAW: tl.constexpr,
                   DOT: tl.constexpr, KA0: tl.constexpr, KA1: tl.constexpr, KA2: tl.constexpr, KA3: tl.constexpr,
                   KOFF: tl.constexpr, KUNIT: tl.constexpr, SPLIT: tl.constexpr):
    """Scores of a stored key page and their online-softmax step: ``(p0, p1, p2, p3, alpha, m_i, l_i)``."""
    s0, s1, s2, s3 = _key_page_scores(q, low_ptr, high_ptr, idx_ptr, scale_ptr, zero_ptr, raw_ptr, kpage, qk_scale,
                                      G, D, NB, NBP, KEY_RAW, DOT, KA0, KA1, KA2, KA3, KOFF, KUNIT, SPLIT)
    p0, p1, p2, p3, alpha, m_i = _page_softmax(s0, s1, s2, s3, m_i)
    return p0, p1, p2, p3, alpha, m_i, l_i * alpha[:, None] + ((p0 + p1) + (p2 + p3))


@triton.jit
def _rescale(alpha, acc0, acc1, acc2, acc3, cq, az):
    """The quantized-value accumulators times the softmax correction ``alpha`` (per query row)."""
    a = alpha[:, None]
    return acc0 * a, acc1 * a, acc2 * a, acc3 * a, cq * a, az * a


# ----------------------------------------------------------------------------------------- one page, values


@triton.jit
def _value_quarter(p, t, codes_ptr, vscale_ptr, vzero_ptr, pbase, acc0, acc1, acc2, acc3, cq, az,
                   G: tl.constexpr, D: tl.constexpr, VBITS: tl.constexpr, DOT: tl.constexpr,
                   VA0: tl.constexpr, VA1: tl.constexpr, VA2: tl.constexpr, VA3: tl.constexpr,
                   VOFF: tl.constexpr, VUNIT: tl.constexpr, SPLIT: tl.constexpr):
    """Add ``p @ V`` of value rows ``t`` (one quarter, ``(G/4,)``) of a quantized value page: per channel group
    ``r`` (channels ``VPER*j + r``) into ``acc_r`` in units of the magic codes; ``cq += sum p*scale`` (their OFF
    term) and ``az += sum p*zero``. ``SPLIT``: ``p * scale`` as two 16-bit operands, as for the keys."""
    VPER: tl.constexpr = 8 // VBITS
    DB: tl.constexpr = D // VPER  # bytes per token row
    vs = tl.load(vscale_ptr + pbase * G + t).to(tl.float32)
    vz = tl.load(vzero_ptr + pbase * G + t).to(tl.float32)
    pvf = p * vs[None, :]  # (BLOCK_H, G/4)
    pv = pvf.to(DOT)
    pv_lo = (pvf - pv.to(tl.float32)).to(DOT)
    if VOFF != 0:
        cq += pv.to(tl.float32)
        if SPLIT & 2:
            cq += pv_lo.to(tl.float32)
    az += p * vz[None, :]
    jb = tl.arange(0, DB)
    vb = tl.load(codes_ptr + pbase * (G * DB) + t[:, None] * DB + jb[None, :])  # (G/4, DB) bytes
    acc0 += _mm2(pv, pv_lo, _codes(vb, 0, VBITS, VA0, VOFF, VUNIT, DOT), DOT, (SPLIT & 2) != 0)
    acc1 += _mm2(pv, pv_lo, _codes(vb, VBITS, VBITS, VA1, VOFF, VUNIT, DOT), DOT, (SPLIT & 2) != 0)
    if VPER == 4:
        acc2 += _mm2(pv, pv_lo, _codes(vb, 4, VBITS, VA2, VOFF, VUNIT, DOT), DOT, (SPLIT & 2) != 0)
        acc3 += _mm2(pv, pv_lo, _codes(vb, 6, VBITS, VA3, VOFF, VUNIT, DOT), DOT, (SPLIT & 2) != 0)
    return acc0, acc1, acc2, acc3, cq, az


@triton.jit
def _fp_value_page(p0, p1, p2, p3, acc_nat, vq_ptr, vl_ptr, rel0, m, mv, G: tl.constexpr, D: tl.constexpr,
                   R: tl.constexpr, DOT: tl.constexpr):
    """``acc_nat += p @ V`` over the four quarters of the page at ``rel0`` with full-precision values."""
    G4: tl.constexpr = G // 4
    d = tl.arange(0, D)
    i = tl.arange(0, G4)
    acc_nat += _mm(p0.to(DOT), fp_values(vq_ptr, vl_ptr, rel0 + 4 * i, m, mv, d, G, D, R).to(DOT), DOT)
    acc_nat += _mm(p1.to(DOT), fp_values(vq_ptr, vl_ptr, rel0 + 4 * i + 1, m, mv, d, G, D, R).to(DOT), DOT)
    acc_nat += _mm(p2.to(DOT), fp_values(vq_ptr, vl_ptr, rel0 + 4 * i + 2, m, mv, d, G, D, R).to(DOT), DOT)
    acc_nat += _mm(p3.to(DOT), fp_values(vq_ptr, vl_ptr, rel0 + 4 * i + 3, m, mv, d, G, D, R).to(DOT), DOT)
    return acc_nat


@triton.jit
def _raw_value_page(p0, p1, p2, p3, acc_nat, raw_ptr, pbase, G: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr):
    """``acc_nat += p @ V`` over the four quarters of a 16-bit value page (``v_raw`` rows ``4i + s``)."""
    G4: tl.constexpr = G // 4
    d = tl.arange(0, D)
    i = tl.arange(0, G4)
    base = raw_ptr + pbase * (G * D) + d[None, :]
    acc_nat += _mm(p0.to(DOT), tl.load(base + (4 * i)[:, None] * D).to(DOT), DOT)
    acc_nat += _mm(p1.to(DOT), tl.load(base + (4 * i + 1)[:, None] * D).to(DOT), DOT)
    acc_nat += _mm(p2.to(DOT), tl.load(base + (4 * i + 2)[:, None] * D).to(DOT), DOT)
    acc_nat += _mm(p3.to(DOT), tl.load(base + (4 * i + 3)[:, None] * D).to(DOT), DOT)
    return acc_nat


# ------------------------------------------------------------------------------------------------ the kernels


@triton.jit
def _decode_split_kernel(
    # ---- pointers: query, split outputs
    q_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
    # ---- per-row state
    len_ptr, sink_k_ptr, sink_v_ptr, k_qbuf_ptr, v_qbuf_ptr, v_local_ptr, k_pt_ptr, v_pt_ptr,
    # ---- page pool
    k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, k_raw_ptr,
    v_codes_ptr, v_scale_ptr, v_zero_ptr, v_raw_ptr,
    # ---- sizes
    Hkv, QH, NUM_SPLITS, qk_scale,
    # ---- strides (row, head) of q and the per-row buffers; page-table row strides
    sq_b, sq_h, ssk_b, ssk_h, ssv_b, ssv_h, skq_b, skq_h, svq_b, svq_h, svl_b, svl_h, spk_b, spv_b,
    # ---- meta-parameters
    S: tl.constexpr, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr,
    VBITS: tl.constexpr, KEY_RAW: tl.constexpr, VALUE_RAW: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr, DOT: tl.constexpr, FULL_QBUF: tl.constexpr,
    KA0: tl.constexpr, KA1: tl.constexpr, KA2: tl.constexpr, KA3: tl.constexpr, KOFF: tl.constexpr,
    KUNIT: tl.constexpr, VA0: tl.constexpr, VA1: tl.constexpr, VA2: tl.constexpr, VA3: tl.constexpr,
    VOFF: tl.constexpr, VUNIT: tl.constexpr, SPLIT: tl.constexpr,
):
    tl.static_assert(G % 4 == 0 and D % 4 == 0, "4 codes per byte")
    G4: tl.constexpr = G // 4
    VPER: tl.constexpr = 8 // VBITS
    DB: tl.constexpr = D // VPER
    # ---- program id -> (row, KV head, split); the split's run of page slots
    pid_bh, split, b, h, b64, n, m = program_row(len_ptr, Hkv, S)
    mv = tl.maximum(m - R, 0)
    if FULL_QBUF:  # mid-step: a qbuffer the new token filled is not packed yet (qbuffers hold 1..G tokens)
        kp = tl.maximum(tl.cdiv(m, G) - 1, 0)
        vp = tl.maximum(tl.cdiv(mv, G) - 1, 0)
    else:
        kp = m // G  # full key pages
        vp = mv // G  # full value pages (vp <= kp)
    per = tl.cdiv(tl.cdiv(m, G), NUM_SPLITS)
    start = split * per
    end = tl.minimum(start + per, tl.cdiv(m, G))
    # ---- query tile: the QH query heads of KV head h, padded to BLOCK_H rows
    r = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    i = tl.arange(0, G4)
    q = tl.load(q_ptr + b64 * sq_b + (h * QH + r)[:, None] * sq_h + d[None, :], mask=(r < QH)[:, None], other=0.0)
    q = q.to(DOT)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H, G4], tl.float32)  # row sums kept per column, reduced once at the end
    acc_nat = tl.zeros([BLOCK_H, D], tl.float32)  # p @ V over full-precision values, natural channel order
    acc0 = tl.zeros([BLOCK_H, DB], tl.float32)  # p @ V over quantized values, channel group r (magic units)
    acc1 = tl.zeros([BLOCK_H, DB], tl.float32)
    acc2 = tl.zeros([BLOCK_H, DB], tl.float32)
    acc3 = tl.zeros([BLOCK_H, DB], tl.float32)
    cq = tl.zeros([BLOCK_H, G4], tl.float32)  # sum p * value scale (the magic codes' OFF term)
    az = tl.zeros([BLOCK_H, G4], tl.float32)  # sum p * value zero
    kq_ptr = k_qbuf_ptr + b64 * skq_b + h * skq_h
    vq_ptr = v_qbuf_ptr + b64 * svq_b + h * svq_h
    vl_ptr = v_local_ptr + b64 * svl_b + h * svl_h
    # ---- pages with a key page and a value page: the hot loop
    for j in range(start, tl.minimum(end, vp)):
        kpage = tl.load(k_pt_ptr + b64 * spk_b + j).to(tl.int64) * Hkv + h
        vpage = tl.load(v_pt_ptr + b64 * spv_b + j).to(tl.int64) * Hkv + h
        p0, p1, p2, p3, alpha, m_i, l_i = _key_page_step(q, k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr,
                                                         k_raw_ptr, kpage, qk_scale, m_i, l_i, G, D, NB, NBP, KEY_RAW,
                                                         DOT, KA0, KA1, KA2, KA3, KOFF, KUNIT, SPLIT)
        if VALUE_RAW:
            acc_nat = _raw_value_page(p0, p1, p2, p3, acc_nat * alpha[:, None], v_raw_ptr, vpage, G, D, DOT)
        else:
            acc0, acc1, acc2, acc3, cq, az = _rescale(alpha, acc0, acc1, acc2, acc3, cq, az)
            acc0, acc1, acc2, acc3, cq, az = _value_quarter(p0, 4 * i, v_codes_ptr, v_scale_ptr, v_zero_ptr, vpage,
                                                            acc0, acc1, acc2, acc3, cq, az, G, D, VBITS, DOT,
                                                            VA0, VA1, VA2, VA3, VOFF, VUNIT, SPLIT)
            acc0, acc1, acc2, acc3, cq, az = _value_quarter(p1, 4 * i + 1, v_codes_ptr, v_scale_ptr, v_zero_ptr,
                                                            vpage, acc0, acc1, acc2, acc3, cq, az, G, D, VBITS, DOT,
                                                            VA0, VA1, VA2, VA3, VOFF, VUNIT, SPLIT)
            acc0, acc1, acc2, acc3, cq, az = _value_quarter(p2, 4 * i + 2, v_codes_ptr, v_scale_ptr, v_zero_ptr,
                                                            vpage, acc0, acc1, acc2, acc3, cq, az, G, D, VBITS, DOT,
                                                            VA0, VA1, VA2, VA3, VOFF, VUNIT, SPLIT)
            acc0, acc1, acc2, acc3, cq, az = _value_quarter(p3, 4 * i + 3, v_codes_ptr, v_scale_ptr, v_zero_ptr,
                                                            vpage, acc0, acc1, acc2, acc3, cq, az, G, D, VBITS, DOT,
                                                            VA0, VA1, VA2, VA3, VOFF, VUNIT, SPLIT)
    # ---- pages with a key page whose values are still in full precision (value qbuffer / local window)
    for j in range(tl.maximum(start, vp), tl.minimum(end, kp)):
        kpage = tl.load(k_pt_ptr + b64 * spk_b + j).to(tl.int64) * Hkv + h
        p0, p1, p2, p3, alpha, m_i, l_i = _key_page_step(q, k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr,
                                                         k_raw_ptr, kpage, qk_scale, m_i, l_i, G, D, NB, NBP, KEY_RAW,
                                                         DOT, KA0, KA1, KA2, KA3, KOFF, KUNIT, SPLIT)
        acc0, acc1, acc2, acc3, cq, az = _rescale(alpha, acc0, acc1, acc2, acc3, cq, az)
        acc_nat = _fp_value_page(p0, p1, p2, p3, acc_nat * alpha[:, None], vq_ptr, vl_ptr, j * G, m, mv, G, D, R, DOT)
    # ---- the last, partial page: keys from the key qbuffer
    for j in range(tl.maximum(start, kp), end):
        s0, s1, s2, s3 = _fp_key_scores(q, kq_ptr, j * G, m, qk_scale, G, D, DOT)
        p0, p1, p2, p3, alpha, m_i = _page_softmax(s0, s1, s2, s3, m_i)
        l_i = l_i * alpha[:, None] + ((p0 + p1) + (p2 + p3))
        acc0, acc1, acc2, acc3, cq, az = _rescale(alpha, acc0, acc1, acc2, acc3, cq, az)
        acc_nat = _fp_value_page(p0, p1, p2, p3, acc_nat * alpha[:, None], vq_ptr, vl_ptr, j * G, m, mv, G, D, R, DOT)
    l_sum = tl.sum(l_i, 1)
    # ---- sink (split 0)
    if S > 0:
        if (split == 0) & (n > 0):
            ps = tl.arange(0, BLOCK_S)
            vs = (ps < S) & (ps < n)
            kT = tl.load(sink_k_ptr + b64 * ssk_b + h * ssk_h + ps[None, :] * D + d[:, None], mask=vs[None, :], other=0.0)
            v = tl.load(sink_v_ptr + b64 * ssv_b + h * ssv_h + ps[:, None] * D + d[None, :], mask=vs[:, None], other=0.0)
            s = tl.where(vs[None, :], _mm(q, kT.to(DOT), DOT) * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)  # m_new is finite: the sink holds >= 1 token here
            p = tl.exp2(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            acc0, acc1, acc2, acc3, cq, az = _rescale(alpha, acc0, acc1, acc2, acc3, cq, az)
            acc_nat = acc_nat * alpha[:, None] + _mm(p.to(DOT), v.to(DOT), DOT)
            m_i = m_new
    # ---- the split's result in natural channel order: quantized channel groups interleaved once
    acc = acc_nat
    if not VALUE_RAW:
        zero_term = tl.sum(az, 1)
        if VOFF != 0:
            zero_term -= tl.sum(cq, 1) * (VOFF / VUNIT)  # (BLOCK_H,)
        o0 = acc0 * (1.0 / VUNIT) + zero_term[:, None]
        o1 = acc1 * (1.0 / VUNIT) + zero_term[:, None]
        if VPER == 4:  # channel 4j + r <- o_r[:, j]
            o = tl.join(tl.join(o0, acc2 * (1.0 / VUNIT) + zero_term[:, None]),
                        tl.join(o1, acc3 * (1.0 / VUNIT) + zero_term[:, None]))
        else:  # channel 2j + r <- o_r[:, j]
            o = tl.join(o0, o1)
        acc += tl.reshape(o, (BLOCK_H, D))
    ws = (pid_bh * NUM_SPLITS + split) * BLOCK_H + r
    tl.store(ws_m_ptr + ws, m_i)
    tl.store(ws_l_ptr + ws, l_sum)
    tl.store(ws_acc_ptr + ws[:, None] * D + d[None, :], acc)


@triton.jit
def _decode_reduce_kernel(
    ws_m_ptr, ws_l_ptr, ws_acc_ptr, out_ptr,
    Hkv, QH, NUM_SPLITS, so_b, so_h,
    D: tl.constexpr, BLOCK_H: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    r = tl.program_id(1)  # query head within the group
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    sp = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, D)
    ok = sp < NUM_SPLITS
    ws = (pid_bh * NUM_SPLITS + sp) * BLOCK_H + r
    m = tl.load(ws_m_ptr + ws, mask=ok, other=float("-inf"))
    l = tl.load(ws_l_ptr + ws, mask=ok, other=0.0)
    acc = tl.load(ws_acc_ptr + ws[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    M = tl.max(m, 0)
    M = tl.where(M > float("-inf"), M, 0.0)  # every split empty (length 0): avoid -inf - -inf
    w = tl.exp2(m - M)  # empty splits (m = -inf) weigh 0
    L = tl.sum(w * l, 0)
    o = tl.sum(w[:, None] * acc, 0) / tl.where(L > 0, L, 1.0)  # rows of length 0 give 0
    tl.store(out_ptr + b.to(tl.int64) * so_b + (h * QH + r) * so_h + d, cast_to(o, out_ptr.dtype.element_ty))


# -------------------------------------------------------------------------------------------------- wrappers


def register_cap(maxnreg: int | None) -> dict:
    """Launch option capping registers per thread (CUDA backend only; ignored by the interpreter)."""
    return {} if (maxnreg is None or INTERPRETING) else {"maxnreg": int(maxnreg)}


def _dot_dtype(dtype: torch.dtype):
    """Operand dtype of the kernel's products: the model dtype, except fp32 (and bf16 under the interpreter, whose
    bf16 ``tl.dot`` is wrong), which multiply in fp32."""
    if dtype == torch.float32 or (INTERPRETING and dtype == torch.bfloat16):
        return torch.float32
    return dtype


def kernel_constants(cfg: KVQuantConfig, head_dim: int, group: int, dtype: torch.dtype, launch: Launch,
                     full_qbuffer: bool) -> dict:
    """The compile-time constants of ``_decode_split_kernel`` for pages of ``cfg`` with ``head_dim`` channels,
    ``group`` query heads per KV head, ``dtype`` queries and ``launch``: what the wrapper launches and what
    ``benchmarks/sass.py`` compiles."""
    S, G, R, D = cfg.sink_tokens, cfg.group_size, cfg.local_window, head_dim
    nb = cfg.num_boosted(D)
    dot = _dot_dtype(dtype)
    vbits = cfg.value_bits if cfg.quantizes_values else 2
    ka = [magic_code(dot, 2, s) for s in (0, 2, 4, 6)]
    va = [magic_code(dot, vbits, vbits * r) for r in range(4)]
    if G < 64 or D * vbits // 8 < 16:  # small tiles: plain conversions (same values) instead of the PTX blocks
        ka = [("",) + x[1:] for x in ka]
        va = [("",) + x[1:] for x in va]
    return dict(
        S=S, G=G, R=R, D=D, NB=nb, NBP=max(16, triton.next_power_of_2(max(nb, 1))), VBITS=vbits,
        KEY_RAW=not cfg.quantizes_keys, VALUE_RAW=not cfg.quantizes_values,
        BLOCK_H=max(launch.block_h, triton.next_power_of_2(group)), BLOCK_S=max(16, triton.next_power_of_2(S)),
        DOT=TLTYPE[dot], FULL_QBUF=bool(full_qbuffer), SPLIT=0 if dot == torch.float32 else int(launch.split_fold),
        KA0=ka[0][0], KA1=ka[1][0], KA2=ka[2][0], KA3=ka[3][0], KOFF=ka[0][1], KUNIT=ka[0][2],
        VA0=va[0][0], VA1=va[1][0], VA2=va[2][0], VA3=va[3][0], VOFF=va[0][1], VUNIT=va[0][2],
    )


def decode_attention_triton(q: torch.Tensor, state: KittyLayerState, cfg: KVQuantConfig, scaling: float | None = None,
                            launch: Launch | None = None, full_qbuffer: bool = False,
                            workspace: dict[str, torch.Tensor] | None = None, **tuning) -> torch.Tensor:
    """The fused Triton kernel (see module docstring). ``q``: ``[B, Hq, D]`` -> ``[B, Hq, D]`` in ``q.dtype``.

    ``full_qbuffer``: the state is mid-step, after the new token was inserted and before a qbuffer it filled is
    packed (qbuffers hold 1..G tokens, ``kitty.memory.token_layout``): the filled qbuffer is attended in full precision.

    ``launch``: a :class:`kernels.launch.Launch`; ``None``: :func:`kernels.launch.default_launch` for the batch at
    hand (the fastest configuration timed on the H200, checked for correctness there: benchmarks/RESULTS.md), with
    ``tuning`` (its keyword arguments: ``num_splits``, ``num_warps``, ``num_stages``, ``maxnreg``, ``waves``,
    ``block_h``, ``split_fold``) replacing defaults. Folding the key scale into one 16-bit ``q * scale``
    (``split_fold=0``) rounds a product that multiplies codes up to 3, where dequantizing first rounds the key
    itself: on outlier-heavy keys, fp16 outputs were measured up to 2.2x further from the fp32 reference than the
    fp16 torch reference is; ``split_fold=1`` cuts that error 2-3x but costs ~45% more time at (8, 32K) on the H200
    (benchmarks/RESULTS.md), so it is off by default.

    ``workspace``: a dict that the first call fills with the split buffers and the output and later calls reuse
    (a static cache passes one per layer, so that a captured step allocates nothing); the result is then a view of
    ``workspace["out"]``, valid until the next call.
    """
    z = check_state(q, state, cfg)
    B, Hq, Hkv, D, S, G, R, nb = (z[k] for k in ("B", "Hq", "Hkv", "D", "S", "G", "R", "nb"))
    check_power_of_two({"group_size": G, "head_dim": D}, 16, "fused kernel")
    if cfg.quantizes_values and cfg.value_bits not in (2, 4):
        raise ValueError(f"value_bits must be 2, 4 or 16, got {cfg.value_bits}")
    if not INTERPRETING and not triton_supports(cfg, D, compiled=True):
        raise ValueError(f"on the GPU the fused kernel needs group_size >= 64 and head_dim * value_bits / 8 >= 16, got "
                         f"group_size={G}, head_dim={D}, value_bits={cfg.value_bits} (use the torch backend)")
    if launch is not None and tuning:
        raise ValueError(f"pass either launch or its fields, got launch and {sorted(tuning)}")
    scaling = 1.0 / math.sqrt(D) if scaling is None else float(scaling)
    QH = Hq // Hkv
    max_pages = state.k_page_table.shape[1] + 1
    launch = launch or default_launch(B, Hkv, max_pages, q.device, **tuning)
    consts = kernel_constants(cfg, D, QH, q.dtype, launch, full_qbuffer)
    BLOCK_H, splits = consts["BLOCK_H"], launch.num_splits
    dev, f32 = q.device, torch.float32
    if workspace is not None and workspace.get("out") is not None:
        ws_m, ws_l, ws_acc, out = (workspace[k] for k in ("m", "l", "acc", "out"))
        if ws_m.shape[0] != B * Hkv * splits * BLOCK_H or out.shape != (B, Hq, D) or out.dtype != q.dtype:
            raise ValueError(f"workspace was filled for other shapes (out {tuple(out.shape)} {out.dtype}, "
                             f"{ws_m.shape[0]} split rows); pass an empty dict for B={B}, Hq={Hq}, splits={splits}")
    else:
        ws_m = torch.empty(B * Hkv * splits * BLOCK_H, dtype=f32, device=dev)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty(B * Hkv * splits * BLOCK_H, D, dtype=f32, device=dev)
        out = torch.empty(B, Hq, D, dtype=q.dtype, device=dev)
        if workspace is not None:
            workspace.update(m=ws_m, l=ws_l, acc=ws_acc, out=out)
    if q.stride(-1) != 1:
        q = q.contiguous()
    dummy = state.k_qbuf
    st = state
    lengths = st.lengths.to(torch.int32)
    _decode_split_kernel[(B * Hkv, splits)](
        q, ws_m, ws_l, ws_acc,
        lengths, st.sink_k, st.sink_v, st.k_qbuf, st.v_qbuf, st.v_local, st.k_page_table, st.v_page_table,
        *((st.k_low, st.k_high if nb else dummy, st.k_boost_idx, st.k_scale, st.k_zero, dummy)
          if cfg.quantizes_keys else (dummy,) * 5 + (st.k_raw,)),
        *((st.v_codes, st.v_scale, st.v_zero, dummy) if cfg.quantizes_values else (dummy,) * 3 + (st.v_raw,)),
        Hkv, QH, splits, scaling * LOG2E,
        q.stride(0), q.stride(1), st.sink_k.stride(0), st.sink_k.stride(1), st.sink_v.stride(0), st.sink_v.stride(1),
        st.k_qbuf.stride(0), st.k_qbuf.stride(1), st.v_qbuf.stride(0), st.v_qbuf.stride(1),
        st.v_local.stride(0), st.v_local.stride(1), st.k_page_table.stride(0), st.v_page_table.stride(0),
        **consts, num_warps=launch.num_warps, num_stages=launch.num_stages, **register_cap(launch.maxnreg),
    )
    _decode_reduce_kernel[(B * Hkv, QH)](
        ws_m, ws_l, ws_acc, out, Hkv, QH, splits, out.stride(0), out.stride(1),
        D=D, BLOCK_H=BLOCK_H, SPLITS_P2=triton.next_power_of_2(splits),
    )
    return out


def triton_supports(cfg: KVQuantConfig, head_dim: int, compiled: bool | None = None) -> bool:
    """Whether the fused kernel handles pages of ``cfg`` with ``head_dim`` channels: power-of-two group size and
    head_dim >= 16, 2/4/16-bit keys and values. ``compiled`` (default: not under ``TRITON_INTERPRET=1``): on the
    GPU the kernel also needs page quarters and value rows of >= 16 (``group_size >= 64``, ``head_dim * value_bits
    / 8 >= 16``); smaller tiles were measured wrong there (H200, triton 3.6) and take the torch path."""
    ok = is_power_of_two(cfg.group_size, 16) and is_power_of_two(head_dim, 16) and cfg.key_bits in (2, 4, 16) and cfg.value_bits in (2, 4, 16)
    if compiled if compiled is not None else not INTERPRETING:
        ok = ok and cfg.group_size >= 64 and (not cfg.quantizes_values or head_dim * cfg.value_bits // 8 >= 16)
    return ok


def decode_attention(q: torch.Tensor, state: KittyLayerState, cfg: KVQuantConfig, scaling: float | None = None,
                     backend: str = "auto", full_qbuffer: bool = False, **kernel_options) -> torch.Tensor:
    """Decode attention of one new query token per row over a Kitty layer: ``[B, Hq, D]`` -> ``[B, Hq, D]``.

    ``backend="auto"`` runs the fused Triton kernel on CUDA tensors or under ``TRITON_INTERPRET=1`` when
    :func:`triton_supports` the config, else the torch reference; ``"triton"`` / ``"torch"`` force one (``"triton"``
    raises ``ValueError`` for an unsupported config). ``scaling`` defaults to ``1/sqrt(D)``. ``kernel_options``:
    the launch of :func:`decode_attention_triton` (``launch=`` or its fields).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        ok = (q.is_cuda or INTERPRETING) and q.dim() == 3 and triton_supports(cfg, q.shape[-1])
        backend = "triton" if ok else "torch"
    if backend == "torch":
        check_state(q, state, cfg)
        return decode_attention_ref(q, state, cfg, scaling, full_qbuffer=full_qbuffer)
    return decode_attention_triton(q, state, cfg, scaling, full_qbuffer=full_qbuffer, **kernel_options)
