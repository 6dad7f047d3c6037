"""Fused split-K decode attention over a Kitty cache (flash-decoding over sink | pages | qbuffers | local window).

The paper (§4.3, step 2) computes decode attention with a ``qk`` kernel, a torch softmax and an ``sv`` kernel, one
program per (batch, KV head) walking every page serially, and leaves fusion as future work. This kernel fuses it:
for each row's new query token it reads the storage of ``docs/LAYOUT.md`` directly -- the full-precision sink, the
key/value pages through the page tables, the key and value qbuffers and the value local window -- and never writes
scores to memory. Program = (row b, KV head h, split); the QH = Hq/Hkv query heads of h share every load.

Decode attention reads each cached byte once and does little arithmetic with it, so the kernel is fast only if
turning 2-bit codes into tensor-core operands costs a few instructions per code. Four choices serve that:

1. **Codes run along each product's reduction axis** (``docs/LAYOUT.md``). A key byte holds 4 channels of one token,
   a value byte 4 tokens of one channel: the axes ``q . k`` and ``p . V`` sum over, which are the axes a tensor-core
   fragment holds consecutive elements of. Byte ``j`` of a row of ``n`` codes holds codes ``j + s n/4`` at bits
   ``2s``, so ``(byte >> 2s) & 3`` over a tile of bytes is a plain tile of codes -- the ``s``-th quarter of the row.
   A page is read as four token quarters ``u`` (tokens ``u G/4 ..``): its key scores are four products of
   ``(G/4, D/4)`` code tiles (channel quarters ``s``) with the matching quarter of ``q * scale``, and its values are
   bits ``2u`` of the page's ``(D, G/4)`` value bytes, loaded once per page.
2. **The KV tile is the large side of every product** (swap-AB, as LMDeploy's TurboMind decode does): scores are
   computed transposed, ``(G/4 tokens, heads) = codes (G/4, D/4) @ (q * scale)^T (D/4, heads)``, and the output as
   ``(D, heads) = value codes (D, G/4) @ (p * scale)^T (G/4, heads)``. The few query heads of a KV head are the
   small side, padded to ``BLOCK_H`` (4 for GQA 4) instead of to a 16-row tile.
3. **Scale and zero off the per-code path** (keys: per channel ``c`` of a page, values: per token ``t``)::

       q . k_t   = sum_c (q_c scale_c) code_ct + sum_c q_c zero_c        (+ 4 (q scale)_c high_ct, boosted c)
       p . V[:,c] = sum_t (p_t scale_t) code_tc + sum_t p_t zero_t

   so the big operands are exact small integers. ``q * scale`` is formed once per page in fp32 and carried as two
   16-bit parts, its rounding and the remainder, side by side in the columns of the small side (``TWO_PART``,
   ``kernels/operands.py``): the product is then as accurate as dequantizing first. The boosted channels' high
   bits are a second product over the compact high plane, its four slot quarters joined into one
   ``(G/4, 4 * slots/4)`` tile, with ``q * scale`` gathered to the slots by a one-hot product with ``boost_idx``
   (exact: one nonzero term per slot).
4. **Codes as 16-bit floats by bit placement** (``kernels/operands.py``: ``magic_code``): one inline-PTX block
   turns four packed bytes into four exact fp16 subnormals (bf16: ``128 + code``); the unit and offset are undone
   on the fp32 product.

Per program (``m`` = tokens past the sink, ``pk = m // G`` full key pages, ``pv = max(m - R, 0) // G`` full value
pages; split ``s`` owns a contiguous run of the ``cdiv(m, G)`` page slots)::

    for page j in run:   j < pv:  quantized keys, quantized values        (the hot loop: no branches)
                         j < pk:  quantized keys, values from v_qbuf / v_local (full precision)
                         else:    keys from k_qbuf (masked past m), values full precision
        4 quarters: scores (base-2 logits) -> one online-softmax step for the page -> P @ V per quarter
    split 0: the sink;  write (m_i, l_i, acc) of the split;  a second kernel reduces the splits, or, with
    ``Launch.merge_inside``, the last program of the (row, KV head) to finish does (an int32 ticket per (row, KV head)
    in the workspace, taken with an atomic add and reset to 0 by that program): one launch instead of two.

Mid-step (``full_qbuffer=True``, how the cache calls it during a decode step): a qbuffer the new token filled is not
packed yet, so ``pk = max(cdiv(m, G) - 1, 0)`` (and likewise ``pv``) and that qbuffer is attended in full precision.

The torch reference ``decode_attention_ref`` (``kernels/reference.py``) dequantizes with ``kitty.core.quant``,
assembles position-ordered K/V per row and runs softmax attention in fp32. The launch (splits, warps, stages,
register cap, two-part operands) is a ``kernels/launch.py`` ``Launch``; which kernel a layer runs is decided by its
ops object in ``kitty/cache/backend.py``, never here.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kitty.core.config import KVQuantConfig
from kitty.core.quant import high_plane_bytes
from kitty.core.storage import KittyLayerState, check_state

from ._tiles import (
    INTERPRETING,
    TLTYPE,
    check_page_layout,
    check_power_of_two,
    is_power_of_two,
    program_row,
)
from .launch import Launch, default_launch, dot_dtype
from .merge import _decode_reduce_kernel, _merge_splits
from .operands import _codes, _merge, _mm, _operand, _widen, magic_code

__all__ = ["decode_attention_triton", "kernel_constants", "triton_supports"]

LOG2E = 1.4426950408889634  # 1 / ln 2: softmax in base 2


# ------------------------------------------------------------------------------------------- one page, keys


@triton.jit
def _key_operands(q0, q1, q2, q3, scale_ptr, zero_ptr, idx_ptr, pbase, D: tl.constexpr, NB: tl.constexpr,
                  NB4: tl.constexpr, NB4P: tl.constexpr, DOT: tl.constexpr, KOFF: tl.constexpr, TWO_PART: tl.constexpr):
    """Per key page: the small operands ``(q * scale)^T`` of the four channel quarters ``(D/4, N)``, the boosted
    slots' ``4 (q * scale)^T`` ``(4 NB4P, N)``, ``sum_c q_c zero_c`` ``(BLOCK_H,)`` and the operands' column sums
    ``(N,)`` (their ``OFF`` term); ``N`` = ``BLOCK_H`` or ``2 BLOCK_H`` with ``TWO_PART``."""
    D4: tl.constexpr = D // 4
    j = tl.arange(0, D4)
    meta = pbase * D + j
    sc0 = tl.load(scale_ptr + meta).to(tl.float32)
    sc1 = tl.load(scale_ptr + meta + D4).to(tl.float32)
    sc2 = tl.load(scale_ptr + meta + 2 * D4).to(tl.float32)
    sc3 = tl.load(scale_ptr + meta + 3 * D4).to(tl.float32)
    z0 = tl.load(zero_ptr + meta).to(tl.float32)
    z1 = tl.load(zero_ptr + meta + D4).to(tl.float32)
    z2 = tl.load(zero_ptr + meta + 2 * D4).to(tl.float32)
    z3 = tl.load(zero_ptr + meta + 3 * D4).to(tl.float32)
    qz = tl.sum(q0 * z0[:, None] + q1 * z1[:, None] + q2 * z2[:, None] + q3 * z3[:, None], 0)
    qs0 = _operand(q0 * sc0[:, None], DOT, TWO_PART)  # exact fp32 products, rounded once
    qs1 = _operand(q1 * sc1[:, None], DOT, TWO_PART)
    qs2 = _operand(q2 * sc2[:, None], DOT, TWO_PART)
    qs3 = _operand(q3 * sc3[:, None], DOT, TWO_PART)
    if KOFF != 0:
        corr = tl.sum(qs0.to(tl.float32) + qs1.to(tl.float32) + qs2.to(tl.float32) + qs3.to(tl.float32), 0)
    else:
        corr = qz  # unused: no offset to remove
    if NB > 0:
        # column k of the joined high tile is slot k // 4 + (k % 4) * NB4 (see _key_quarter); padding columns match
        # no channel. int32 before any comparison: boost_idx is uint8 and the sentinel 255 must not wrap.
        k = tl.arange(0, 4 * NB4P)
        slot = k // 4 + (k % 4) * NB4
        slot = tl.where((k // 4 < NB4) & (slot < NB), slot, -1)
        i0 = tl.load(idx_ptr + meta).to(tl.int32)
        i1 = tl.load(idx_ptr + meta + D4).to(tl.int32)
        i2 = tl.load(idx_ptr + meta + 2 * D4).to(tl.int32)
        i3 = tl.load(idx_ptr + meta + 3 * D4).to(tl.int32)
        qb = _mm((slot[:, None] == i0[None, :]).to(DOT), qs0, DOT)  # one-hot gather: exact
        qb += _mm((slot[:, None] == i1[None, :]).to(DOT), qs1, DOT)
        qb += _mm((slot[:, None] == i2[None, :]).to(DOT), qs2, DOT)
        qb += _mm((slot[:, None] == i3[None, :]).to(DOT), qs3, DOT)
        qb4 = (qb * 4.0).to(DOT)
        if KOFF != 0:
            corr += tl.sum(qb4.to(tl.float32), 0)
    else:
        qb4 = qs0
    return qs0, qs1, qs2, qs3, qb4, qz, corr


@triton.jit
def _key_quarter(low_ptr, high_ptr, pbase, u: tl.constexpr, qs0, qs1, qs2, qs3, qb4, qz, corr, qk_scale,
                 G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, NB4: tl.constexpr, NB4P: tl.constexpr,
                 DOT: tl.constexpr, KA0: tl.constexpr, KA1: tl.constexpr, KA2: tl.constexpr, KA3: tl.constexpr,
                 KOFF: tl.constexpr, KUNIT: tl.constexpr, TWO_PART: tl.constexpr):
    """Base-2 logits ``(G/4, BLOCK_H)`` of token quarter ``u`` of a quantized key page (``pbase`` = pool page * Hkv
    + head, int64): four channel-quarter products over the low plane and one over the joined high plane."""
    G4: tl.constexpr = G // 4
    D4: tl.constexpr = D // 4
    t = u * G4 + tl.arange(0, G4)
    j = tl.arange(0, D4)
    low = tl.load(low_ptr + pbase * (G * D4) + t[:, None] * D4 + j[None, :])  # (G/4, D/4) bytes
    acc = _mm(_codes(low, 0, 2, KA0, KOFF, KUNIT, DOT), qs0, DOT)
    acc += _mm(_codes(low, 2, 2, KA1, KOFF, KUNIT, DOT), qs1, DOT)
    acc += _mm(_codes(low, 4, 2, KA2, KOFF, KUNIT, DOT), qs2, DOT)
    acc += _mm(_codes(low, 6, 2, KA3, KOFF, KUNIT, DOT), qs3, DOT)
    if NB > 0:
        jh = tl.arange(0, NB4P)
        high = tl.load(high_ptr + pbase * (G * NB4) + t[:, None] * NB4 + jh[None, :], mask=(jh < NB4)[None, :],
                       other=0)  # (G/4, NB4P) bytes of the compact high plane
        # [.., j, x, y] of the two joins is quarter 2x + y, which a row-major reshape puts at column 4j + 2x + y
        h02 = tl.join(_codes(high, 0, 2, KA0, KOFF, KUNIT, DOT), _codes(high, 4, 2, KA2, KOFF, KUNIT, DOT))
        h13 = tl.join(_codes(high, 2, 2, KA1, KOFF, KUNIT, DOT), _codes(high, 6, 2, KA3, KOFF, KUNIT, DOT))
        hc = tl.reshape(tl.join(h02, h13), (G4, 4 * NB4P))  # column 4j + s: slot j + s * NB4
        acc += _mm(hc, qb4, DOT)
    if KOFF != 0:
        acc -= KOFF * corr[None, :]
    return _merge(acc, TWO_PART) * (qk_scale / KUNIT) + (qz * qk_scale)[None, :]


@triton.jit
def _fp_key_quarter(qT, k_ptr, rel0, u: tl.constexpr, m, qk_scale, G: tl.constexpr, D: tl.constexpr,
                    DOT: tl.constexpr):
    """Base-2 logits ``(G/4, BLOCK_H)`` of token quarter ``u`` of a page of 16-bit keys ``(G, D)`` at ``k_ptr`` (a
    ``k_raw`` page, or the key qbuffer, slot = token) whose first token is ``rel0``; ``-inf`` past ``m``."""
    G4: tl.constexpr = G // 4
    t = u * G4 + tl.arange(0, G4)
    c = tl.arange(0, D)
    ok = rel0 + t < m
    k = tl.load(k_ptr + t[:, None] * D + c[None, :], mask=ok[:, None], other=0.0).to(DOT)  # (G/4, D)
    return tl.where(ok[:, None], _mm(k, qT, DOT) * qk_scale, float("-inf"))


@triton.jit
def _stored_key_page(q0, q1, q2, q3, qT, k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, k_raw_ptr, kpage,
                     qk_scale, G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, NB4: tl.constexpr,
                     NB4P: tl.constexpr, KEY_RAW: tl.constexpr, DOT: tl.constexpr, KA0: tl.constexpr,
                     KA1: tl.constexpr, KA2: tl.constexpr, KA3: tl.constexpr, KOFF: tl.constexpr, KUNIT: tl.constexpr,
                     KEY_TWO_PART: tl.constexpr):
    """Base-2 logits of the four token quarters of a stored key page (``kpage`` = pool page * Hkv + head): from the
    planes, or from ``k_raw`` rows for 16-bit keys."""
    if KEY_RAW:
        kr = k_raw_ptr + kpage * (G * D)
        s0 = _fp_key_quarter(qT, kr, 0, 0, G, qk_scale, G, D, DOT)
        s1 = _fp_key_quarter(qT, kr, 0, 1, G, qk_scale, G, D, DOT)
        s2 = _fp_key_quarter(qT, kr, 0, 2, G, qk_scale, G, D, DOT)
        s3 = _fp_key_quarter(qT, kr, 0, 3, G, qk_scale, G, D, DOT)
    else:
        qs0, qs1, qs2, qs3, qb4, qz, corr = _key_operands(q0, q1, q2, q3, k_scale_ptr, k_zero_ptr, k_idx_ptr, kpage, D,
                                                          NB, NB4, NB4P, DOT, KOFF, KEY_TWO_PART)
        s0 = _key_quarter(k_low_ptr, k_high_ptr, kpage, 0, qs0, qs1, qs2, qs3, qb4, qz, corr, qk_scale, G, D, NB, NB4,
                          NB4P, DOT, KA0, KA1, KA2, KA3, KOFF, KUNIT, KEY_TWO_PART)
        s1 = _key_quarter(k_low_ptr, k_high_ptr, kpage, 1, qs0, qs1, qs2, qs3, qb4, qz, corr, qk_scale, G, D, NB, NB4,
                          NB4P, DOT, KA0, KA1, KA2, KA3, KOFF, KUNIT, KEY_TWO_PART)
        s2 = _key_quarter(k_low_ptr, k_high_ptr, kpage, 2, qs0, qs1, qs2, qs3, qb4, qz, corr, qk_scale, G, D, NB, NB4,
                          NB4P, DOT, KA0, KA1, KA2, KA3, KOFF, KUNIT, KEY_TWO_PART)
        s3 = _key_quarter(k_low_ptr, k_high_ptr, kpage, 3, qs0, qs1, qs2, qs3, qb4, qz, corr, qk_scale, G, D, NB, NB4,
                          NB4P, DOT, KA0, KA1, KA2, KA3, KOFF, KUNIT, KEY_TWO_PART)
    return s0, s1, s2, s3


@triton.jit
def _page_softmax(s0, s1, s2, s3, m_i):
    """One online-softmax step over a page's four quarters ``(G/4, BLOCK_H)``: ``(p0, p1, p2, p3, alpha, m_new)``."""
    m_new = tl.maximum(m_i, tl.max(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)), 0))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_safe)
    return (tl.exp2(s0 - m_safe[None, :]), tl.exp2(s1 - m_safe[None, :]), tl.exp2(s2 - m_safe[None, :]),
            tl.exp2(s3 - m_safe[None, :]), alpha, m_new)


# ----------------------------------------------------------------------------------------- one page, values


@triton.jit
def _value_quarter(p, u: tl.constexpr, vb, vscale_ptr, vzero_ptr, pbase, acc, cq, az,
                   G: tl.constexpr, VBITS: tl.constexpr, DOT: tl.constexpr, VA: tl.constexpr, VOFF: tl.constexpr,
                   VUNIT: tl.constexpr, TWO_PART: tl.constexpr):
    """Add ``(p @ V)^T`` of token quarter ``u`` of a quantized value page to ``acc`` ``(D, N)`` (magic units):
    ``vb`` = the page's ``(D, G/4)`` value bytes holding the quarter (2-bit: bits ``2u``; 4-bit: bits ``4 (u // 2)``
    of the half ``u % 2``); ``cq += p * scale`` (the ``OFF`` term, per token and column), ``az += p * zero``."""
    G4: tl.constexpr = G // 4
    QB: tl.constexpr = VBITS // 2  # quarters per column block of bytes: 1 (2-bit), 2 (4-bit)
    t = u * G4 + tl.arange(0, G4)
    vs = tl.load(vscale_ptr + pbase * G + t).to(tl.float32)
    vz = tl.load(vzero_ptr + pbase * G + t).to(tl.float32)
    pv = _operand(p * vs[:, None], DOT, TWO_PART)  # (G/4, N)
    if VOFF != 0:
        cq += pv.to(tl.float32)
    az += p * vz[:, None]
    acc += _mm(_codes(vb, VBITS * (u // QB), VBITS, VA, VOFF, VUNIT, DOT), pv, DOT)
    return acc, cq, az


@triton.jit
def _value_bytes(codes_ptr, pbase, half: tl.constexpr, G: tl.constexpr, D: tl.constexpr, VBITS: tl.constexpr):
    """The ``(D, G/4)`` value bytes of byte columns ``half * G/4 ..`` of a page (2-bit: every column, ``half`` 0)."""
    G4: tl.constexpr = G // 4
    GB: tl.constexpr = G * VBITS // 8  # bytes per channel row
    c = tl.arange(0, D)
    i = tl.arange(0, G4)
    return tl.load(codes_ptr + pbase * (D * GB) + c[:, None] * GB + half * G4 + i[None, :])


@triton.jit
def _value_page(p0, p1, p2, p3, codes_ptr, vscale_ptr, vzero_ptr, pbase, acc, cq, az,
                G: tl.constexpr, D: tl.constexpr, VBITS: tl.constexpr, DOT: tl.constexpr, VA0: tl.constexpr,
                VA1: tl.constexpr, VA2: tl.constexpr, VA3: tl.constexpr, VOFF: tl.constexpr, VUNIT: tl.constexpr,
                TWO_PART: tl.constexpr):
    """``(p @ V)^T`` of the four quarters of a quantized value page (see :func:`_value_quarter`): 2-bit codes hold
    every quarter in the same bytes, 4-bit ones quarters 0, 2 in the first half of each row and 1, 3 in the second."""
    vb0 = _value_bytes(codes_ptr, pbase, 0, G, D, VBITS)
    if VBITS == 4:
        vb1 = _value_bytes(codes_ptr, pbase, 1, G, D, VBITS)
    else:
        vb1 = vb0
    acc, cq, az = _value_quarter(p0, 0, vb0, vscale_ptr, vzero_ptr, pbase, acc, cq, az, G, VBITS, DOT, VA0, VOFF,
                                 VUNIT, TWO_PART)
    acc, cq, az = _value_quarter(p1, 1, vb1, vscale_ptr, vzero_ptr, pbase, acc, cq, az, G, VBITS, DOT, VA1, VOFF,
                                 VUNIT, TWO_PART)
    acc, cq, az = _value_quarter(p2, 2, vb0, vscale_ptr, vzero_ptr, pbase, acc, cq, az, G, VBITS, DOT, VA2, VOFF,
                                 VUNIT, TWO_PART)
    acc, cq, az = _value_quarter(p3, 3, vb1, vscale_ptr, vzero_ptr, pbase, acc, cq, az, G, VBITS, DOT, VA3, VOFF,
                                 VUNIT, TWO_PART)
    return acc, cq, az


@triton.jit
def _fp_value_quarter(p, u: tl.constexpr, acc_nat, vq_ptr, vl_ptr, rel0, m, mv, G: tl.constexpr, D: tl.constexpr,
                      R: tl.constexpr, DOT: tl.constexpr):
    """``acc_nat += (p @ V)^T`` ``(D, BLOCK_H)`` for token quarter ``u`` of the page at ``rel0`` with
    full-precision values: position ``S + rel`` from ``v_qbuf`` slot ``rel % G`` where ``rel < mv``, else from
    ``v_local`` slot ``rel % R`` where ``rel < m``; 0 elsewhere."""
    G4: tl.constexpr = G // 4
    rel = rel0 + u * G4 + tl.arange(0, G4)
    c = tl.arange(0, D)
    in_q = rel < mv
    vT = tl.load(vq_ptr + (rel % G)[None, :] * D + c[:, None], mask=in_q[None, :], other=0.0)  # (D, G/4)
    if R > 0:
        in_l = (rel >= mv) & (rel < m)
        vT += tl.load(vl_ptr + (rel % R)[None, :] * D + c[:, None], mask=in_l[None, :], other=0.0)
    return acc_nat + _mm(vT.to(DOT), p.to(DOT), DOT)


@triton.jit
def _raw_value_quarter(p, u: tl.constexpr, acc_nat, raw_ptr, pbase, G: tl.constexpr, D: tl.constexpr,
                       DOT: tl.constexpr):
    """``acc_nat += (p @ V)^T`` for token quarter ``u`` of a 16-bit value page (``v_raw`` rows)."""
    G4: tl.constexpr = G // 4
    t = u * G4 + tl.arange(0, G4)
    c = tl.arange(0, D)
    vT = tl.load(raw_ptr + pbase * (G * D) + t[None, :] * D + c[:, None])  # (D, G/4)
    return acc_nat + _mm(vT.to(DOT), p.to(DOT), DOT)


# ------------------------------------------------------------------------------------------------ the kernels


@triton.jit
def _decode_split_kernel(
    # ---- pointers: query, split outputs; with MERGE the tickets of (row, KV head) and the output
    q_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, ticket_ptr, out_ptr,
    # ---- per-row state
    len_ptr, sink_k_ptr, sink_v_ptr, k_qbuf_ptr, v_qbuf_ptr, v_local_ptr, k_pt_ptr, v_pt_ptr,
    # ---- page pool
    k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, k_raw_ptr,
    v_codes_ptr, v_scale_ptr, v_zero_ptr, v_raw_ptr,
    # ---- sizes
    Hkv, QH, NUM_SPLITS, qk_scale,
    # ---- strides (row, head) of q and the per-row buffers; page-table row strides
    sq_b, sq_h, ssk_b, ssk_h, ssv_b, ssv_h, skq_b, skq_h, svq_b, svq_h, svl_b, svl_h, spk_b, spv_b, so_b, so_h,
    # ---- meta-parameters
    S: tl.constexpr, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, NB4: tl.constexpr,
    NB4P: tl.constexpr, VBITS: tl.constexpr, KEY_RAW: tl.constexpr, VALUE_RAW: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr, DOT: tl.constexpr, FULL_QBUF: tl.constexpr,
    KA0: tl.constexpr, KA1: tl.constexpr, KA2: tl.constexpr, KA3: tl.constexpr, KOFF: tl.constexpr,
    KUNIT: tl.constexpr, VA0: tl.constexpr, VA1: tl.constexpr, VA2: tl.constexpr, VA3: tl.constexpr,
    VOFF: tl.constexpr, VUNIT: tl.constexpr, KEY_TWO_PART: tl.constexpr, VALUE_TWO_PART: tl.constexpr,
    MERGE: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    tl.static_assert(G % 4 == 0 and D % 4 == 0, "4 codes per byte")
    G4: tl.constexpr = G // 4
    NV: tl.constexpr = BLOCK_H * (2 if VALUE_TWO_PART else 1)  # columns of the quantized-value products
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
    # ---- query tiles, transposed (channels, heads): the QH query heads of KV head h, padded to BLOCK_H columns
    r = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    q_off = b64 * sq_b + h * QH * sq_h
    qT = tl.load(q_ptr + q_off + r[None, :] * sq_h + d[:, None], mask=(r < QH)[None, :], other=0.0).to(DOT)
    q0 = tl.zeros([D // 4, BLOCK_H], tl.float32)
    q1 = q0
    q2 = q0
    q3 = q0
    if not KEY_RAW:
        D4: tl.constexpr = D // 4
        jq = tl.arange(0, D4)
        qbase = q_ptr + q_off + r[None, :] * sq_h + jq[:, None]
        q0 = tl.load(qbase, mask=(r < QH)[None, :], other=0.0).to(tl.float32)
        q1 = tl.load(qbase + D4, mask=(r < QH)[None, :], other=0.0).to(tl.float32)
        q2 = tl.load(qbase + 2 * D4, mask=(r < QH)[None, :], other=0.0).to(tl.float32)
        q3 = tl.load(qbase + 3 * D4, mask=(r < QH)[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([G4, BLOCK_H], tl.float32)  # row sums kept per token, reduced once at the end
    acc_nat = tl.zeros([D, BLOCK_H], tl.float32)  # (p @ V)^T over full-precision values
    acc = tl.zeros([D, NV], tl.float32)  # (p @ V)^T over quantized values (magic units)
    cq = tl.zeros([G4, NV], tl.float32)  # sum p * value scale (the magic codes' OFF term)
    az = tl.zeros([G4, BLOCK_H], tl.float32)  # sum p * value zero
    kq_ptr = k_qbuf_ptr + b64 * skq_b + h * skq_h
    vq_ptr = v_qbuf_ptr + b64 * svq_b + h * svq_h
    vl_ptr = v_local_ptr + b64 * svl_b + h * svl_h
    # ---- pages with a key page and a value page: the hot loop
    for j in range(start, tl.minimum(end, vp)):
        kpage = tl.load(k_pt_ptr + b64 * spk_b + j).to(tl.int64) * Hkv + h
        vpage = tl.load(v_pt_ptr + b64 * spv_b + j).to(tl.int64) * Hkv + h
        s0, s1, s2, s3 = _stored_key_page(q0, q1, q2, q3, qT, k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr,
                                          k_zero_ptr, k_raw_ptr, kpage, qk_scale, G, D, NB, NB4, NB4P, KEY_RAW, DOT,
                                          KA0, KA1, KA2, KA3, KOFF, KUNIT, KEY_TWO_PART)
        p0, p1, p2, p3, alpha, m_i = _page_softmax(s0, s1, s2, s3, m_i)
        l_i = l_i * alpha[None, :] + ((p0 + p1) + (p2 + p3))
        # this loop runs first: only the accumulator its values feed holds anything yet, so only it is rescaled
        if VALUE_RAW:
            acc_nat = _raw_value_quarter(p0, 0, acc_nat * alpha[None, :], v_raw_ptr, vpage, G, D, DOT)
            acc_nat = _raw_value_quarter(p1, 1, acc_nat, v_raw_ptr, vpage, G, D, DOT)
            acc_nat = _raw_value_quarter(p2, 2, acc_nat, v_raw_ptr, vpage, G, D, DOT)
            acc_nat = _raw_value_quarter(p3, 3, acc_nat, v_raw_ptr, vpage, G, D, DOT)
        else:
            av = _widen(alpha, VALUE_TWO_PART)
            acc, cq, az = _value_page(p0, p1, p2, p3, v_codes_ptr, v_scale_ptr, v_zero_ptr, vpage, acc * av[None, :],
                                      cq * av[None, :], az * alpha[None, :], G, D, VBITS, DOT, VA0, VA1, VA2, VA3,
                                      VOFF, VUNIT, VALUE_TWO_PART)
    # ---- pages whose values are still in full precision (value qbuffer / local window); the last, partial page's
    # keys come from the key qbuffer
    for j in range(tl.maximum(start, vp), end):
        if j < kp:
            kpage = tl.load(k_pt_ptr + b64 * spk_b + j).to(tl.int64) * Hkv + h
            s0, s1, s2, s3 = _stored_key_page(q0, q1, q2, q3, qT, k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr,
                                              k_zero_ptr, k_raw_ptr, kpage, qk_scale, G, D, NB, NB4, NB4P, KEY_RAW,
                                              DOT, KA0, KA1, KA2, KA3, KOFF, KUNIT, KEY_TWO_PART)
        else:
            s0 = _fp_key_quarter(qT, kq_ptr, j * G, 0, m, qk_scale, G, D, DOT)
            s1 = _fp_key_quarter(qT, kq_ptr, j * G, 1, m, qk_scale, G, D, DOT)
            s2 = _fp_key_quarter(qT, kq_ptr, j * G, 2, m, qk_scale, G, D, DOT)
            s3 = _fp_key_quarter(qT, kq_ptr, j * G, 3, m, qk_scale, G, D, DOT)
        p0, p1, p2, p3, alpha, m_i = _page_softmax(s0, s1, s2, s3, m_i)
        l_i = l_i * alpha[None, :] + ((p0 + p1) + (p2 + p3))
        av = _widen(alpha, VALUE_TWO_PART)
        acc = acc * av[None, :]
        cq = cq * av[None, :]
        az = az * alpha[None, :]
        acc_nat = _fp_value_quarter(p0, 0, acc_nat * alpha[None, :], vq_ptr, vl_ptr, j * G, m, mv, G, D, R, DOT)
        acc_nat = _fp_value_quarter(p1, 1, acc_nat, vq_ptr, vl_ptr, j * G, m, mv, G, D, R, DOT)
        acc_nat = _fp_value_quarter(p2, 2, acc_nat, vq_ptr, vl_ptr, j * G, m, mv, G, D, R, DOT)
        acc_nat = _fp_value_quarter(p3, 3, acc_nat, vq_ptr, vl_ptr, j * G, m, mv, G, D, R, DOT)
    l_sum = tl.sum(l_i, 0)
    # ---- sink (split 0)
    if S > 0:
        if (split == 0) & (n > 0):
            ps = tl.arange(0, BLOCK_S)
            vs = (ps < S) & (ps < n)
            k = tl.load(sink_k_ptr + b64 * ssk_b + h * ssk_h + ps[:, None] * D + d[None, :], mask=vs[:, None], other=0.0)
            vT = tl.load(sink_v_ptr + b64 * ssv_b + h * ssv_h + ps[None, :] * D + d[:, None], mask=vs[None, :],
                         other=0.0)
            s = tl.where(vs[:, None], _mm(k.to(DOT), qT, DOT) * qk_scale, float("-inf"))  # (BLOCK_S, BLOCK_H)
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp2(m_i - m_new)  # m_new is finite: the sink holds >= 1 token here
            p = tl.exp2(s - m_new[None, :])
            l_sum = l_sum * alpha + tl.sum(p, 0)
            av = _widen(alpha, VALUE_TWO_PART)
            acc = acc * av[None, :]
            cq = cq * av[None, :]
            az = az * alpha[None, :]
            acc_nat = acc_nat * alpha[None, :] + _mm(vT.to(DOT), p.to(DOT), DOT)
            m_i = m_new
    # ---- the split's result (D, BLOCK_H): quantized values' units, offset and zero undone once
    out = acc_nat
    if not VALUE_RAW:
        zero_term = tl.sum(az, 0)
        if VOFF != 0:
            zero_term -= tl.sum(_merge(cq, VALUE_TWO_PART), 0) * (VOFF / VUNIT)
        out += _merge(acc, VALUE_TWO_PART) * (1.0 / VUNIT) + zero_term[None, :]
    ws = (pid_bh * NUM_SPLITS + split) * BLOCK_H + r
    tl.store(ws_m_ptr + ws, m_i)
    tl.store(ws_l_ptr + ws, l_sum)
    tl.store(ws_acc_ptr + ws[None, :] * D + d[:, None], out)
    if MERGE:
        # the last program of (row, KV head) to finish merges the splits: every thread's partial is stored before
        # the ticket is taken (barrier), and the ticket's release / acquire makes the other programs' partials
        # visible to this one; it resets the ticket, so that the next launch (a replayed graph) starts at 0
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + pid_bh, 1, sem="acq_rel", scope="gpu")
        if ticket == NUM_SPLITS - 1:
            tl.store(ticket_ptr + pid_bh, 0)
            for rr in tl.static_range(BLOCK_H):
                if rr < QH:
                    _merge_splits(ws_m_ptr, ws_l_ptr, ws_acc_ptr, out_ptr, pid_bh, b, h, rr, QH, NUM_SPLITS, so_b,
                                  so_h, D, BLOCK_H, SPLITS_P2, ".cg")


# -------------------------------------------------------------------------------------------------- wrappers


def kernel_constants(cfg: KVQuantConfig, head_dim: int, group: int, dtype: torch.dtype, launch: Launch,
                     full_qbuffer: bool) -> dict:
    """The compile-time constants of ``_decode_split_kernel`` for pages of ``cfg`` with ``head_dim`` channels,
    ``group`` query heads per KV head, ``dtype`` queries and ``launch``: what the wrapper launches and what
    ``benchmarks/sass.py`` compiles."""
    S, G, R, D = cfg.sink_tokens, cfg.group_size, cfg.local_window, head_dim
    nb = cfg.num_boosted(D)
    nb4 = high_plane_bytes(nb)  # bytes of a token's high-plane row
    dot = dot_dtype(dtype)
    vbits = cfg.value_bits if cfg.quantizes_values else 2
    ka = [magic_code(dot, 2, s) for s in (0, 2, 4, 6)]
    va = [magic_code(dot, vbits, vbits * (u // (vbits // 2))) for u in range(4)]  # the shift of token quarter u
    if G < 64 or D < 64:  # small tiles: plain conversions (same values) instead of the PTX blocks
        ka = [("",) + x[1:] for x in ka]
        va = [("",) + x[1:] for x in va]
    parts = 0 if dot == torch.float32 else int(launch.operand_parts)  # fp32 operands are exact: one part each
    return dict(
        # the joined high tile has 4 * NB4P columns: at least 32, since a 16-column one (nb <= 16, e.g. kitty at
        # D = 128) gave wrong products on the H200 (triton 3.6) with and without the PTX conversion, and 32 did not;
        # the padding bytes are masked loads (no traffic), their columns meet zero rows of the gathered operand
        S=S, G=G, R=R, D=D, NB=nb, NB4=nb4, NB4P=max(8, triton.next_power_of_2(max(nb4, 1))), VBITS=vbits,
        KEY_RAW=not cfg.quantizes_keys, VALUE_RAW=not cfg.quantizes_values,
        BLOCK_H=max(launch.block_h, triton.next_power_of_2(group)), BLOCK_S=max(16, triton.next_power_of_2(S)),
        DOT=TLTYPE[dot], FULL_QBUF=bool(full_qbuffer), KEY_TWO_PART=bool(parts & 1), VALUE_TWO_PART=bool(parts & 2),
        KA0=ka[0][0], KA1=ka[1][0], KA2=ka[2][0], KA3=ka[3][0], KOFF=ka[0][1], KUNIT=ka[0][2],
        VA0=va[0][0], VA1=va[1][0], VA2=va[2][0], VA3=va[3][0], VOFF=va[0][1], VUNIT=va[0][2],
        MERGE=bool(launch.merge_inside), SPLITS_P2=triton.next_power_of_2(launch.num_splits),
    )


def decode_attention_triton(q: torch.Tensor, state: KittyLayerState, cfg: KVQuantConfig, scaling: float | None = None,
                            *, full_qbuffer: bool = False, workspace: dict[str, torch.Tensor] | None = None,
                            launch: Launch | None = None) -> torch.Tensor:
    """The fused Triton kernel (see module docstring). ``q``: ``[B, Hq, D]`` -> ``[B, Hq, D]`` in ``q.dtype``;
    ``scaling`` defaults to ``1/sqrt(D)``. ``ValueError`` for a config the kernel does not handle
    (:func:`triton_supports`).

    ``full_qbuffer``: the state is mid-step, after the new token was inserted and before a qbuffer it filled is
    packed (qbuffers hold 1..G tokens, ``kitty.core.memory.token_layout``): the filled qbuffer is attended in full precision.

    ``workspace``: a dict that the first call fills with the split buffers and the output and later calls reuse
    (a static cache passes one per layer, so that a captured step allocates nothing); the result is then a view of
    ``workspace["out"]``, valid until the next call. With ``launch.merge_inside`` it also holds ``"tickets"``, int32
    ``[B * Hkv]`` zeros that each launch leaves at zero.

    ``launch``: a :class:`kernels.launch.Launch` (split count, warps, stages, register cap, query rows per program,
    two-part operands); ``None``: :func:`kernels.launch.default_launch` for the batch at hand.
    """
    check_page_layout("fused kernel", cfg.boost_bits, cfg.grouped_values)
    z = check_state(q, state, cfg)
    B, Hq, Hkv, D, S, G, R, nb = (z[k] for k in ("B", "Hq", "Hkv", "D", "S", "G", "R", "nb"))
    check_power_of_two({"group_size": G, "head_dim": D}, 16, "fused kernel")
    if cfg.quantizes_values and cfg.value_bits not in (2, 4):
        raise ValueError(f"value_bits must be 2, 4 or 16, got {cfg.value_bits}")
    if not INTERPRETING and not triton_supports(cfg, D, compiled=True):
        raise ValueError(f"on the GPU the fused kernel needs group_size >= 64 and, for quantized keys, head_dim >= 64, "
                         f"got group_size={G}, head_dim={D}, key_bits={cfg.key_bits} (use the torch backend)")
    scaling = 1.0 / math.sqrt(D) if scaling is None else float(scaling)
    QH = Hq // Hkv
    max_pages = state.k_page_table.shape[1] + 1
    launch = launch or default_launch(B, Hkv, max_pages, q.device)
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
    tickets = None
    if launch.merge_inside:  # int32 per (row, KV head), 0 between launches (the merging program resets its own)
        tickets = None if workspace is None else workspace.get("tickets")
        if tickets is None or tickets.shape != (B * Hkv,):
            tickets = torch.zeros(B * Hkv, dtype=torch.int32, device=dev)
            if workspace is not None:
                workspace["tickets"] = tickets
    if q.stride(-1) != 1:
        q = q.contiguous()
    dummy = state.k_qbuf
    st = state
    lengths = st.lengths.to(torch.int32)
    _decode_split_kernel[(B * Hkv, splits)](
        q, ws_m, ws_l, ws_acc, lengths if tickets is None else tickets, out,
        lengths, st.sink_k, st.sink_v, st.k_qbuf, st.v_qbuf, st.v_local, st.k_page_table, st.v_page_table,
        *((st.k_low, st.k_high if nb else dummy, st.k_boost_idx, st.k_scale, st.k_zero, dummy)
          if cfg.quantizes_keys else (dummy,) * 5 + (st.k_raw,)),
        *((st.v_codes, st.v_scale, st.v_zero, dummy) if cfg.quantizes_values else (dummy,) * 3 + (st.v_raw,)),
        Hkv, QH, splits, scaling * LOG2E,
        q.stride(0), q.stride(1), st.sink_k.stride(0), st.sink_k.stride(1), st.sink_v.stride(0), st.sink_v.stride(1),
        st.k_qbuf.stride(0), st.k_qbuf.stride(1), st.v_qbuf.stride(0), st.v_qbuf.stride(1),
        st.v_local.stride(0), st.v_local.stride(1), st.k_page_table.stride(0), st.v_page_table.stride(0),
        out.stride(0), out.stride(1),
        **consts, **launch.options(),
    )
    if not launch.merge_inside:
        _decode_reduce_kernel[(B * Hkv, QH)](
            ws_m, ws_l, ws_acc, out, Hkv, QH, splits, out.stride(0), out.stride(1),
            D=D, BLOCK_H=BLOCK_H, SPLITS_P2=consts["SPLITS_P2"], **launch.options(),
        )
    return out


def triton_supports(cfg: KVQuantConfig, head_dim: int, compiled: bool | None = None) -> bool:
    """Whether the fused kernel handles pages of ``cfg`` with ``head_dim`` channels: power-of-two group size and
    head_dim >= 16, 2/4/16-bit keys and values, 4-bit boosted channels. ``compiled`` (default: not under ``TRITON_INTERPRET=1``): on the
    GPU the kernel also needs token and channel quarters of >= 16 (``group_size >= 64``; ``head_dim >= 64`` for
    quantized keys): smaller tiles fall back to broadcast sums, which were measured wrong there (H200, triton 3.6),
    so they take the torch path."""
    ok = is_power_of_two(cfg.group_size, 16) and is_power_of_two(head_dim, 16) and cfg.key_bits in (2, 4, 16) and cfg.value_bits in (2, 4, 16)
    ok = ok and cfg.boost_bits == 4 and not cfg.grouped_values  # 2-bit slots in k_high, a scale per value token
    if compiled if compiled is not None else not INTERPRETING:
        ok = ok and cfg.group_size >= 64 and (not cfg.quantizes_keys or head_dim >= 64)
    return ok

