"""The Gluon decode kernel's per-page math and its split merge (``kernels/decode_gluon.py`` launches them): the key
operand from ``q * scale`` (packed 16-bit math), the high plane's one-hot gather, the per-page term (zeros and bf16
offsets on the tensor cores, the scores' initial accumulator), the quantized and full-precision scores, the
full-precision values, and the workspace rows the last program of a group merges.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from ._gluon_parts import (
    adjacent_to_low,
    channel_vector,
    merge_parts,
    mul16,
    one_hot,
    unpack_high,
    unpack_low,
    zero_fragment,
    zero_rows,
)

LOG2E = 1.4426950408889634


# the key operand of one column pair: hi = rn(q4 * scale), then rn(q4 * scale + hi * m) with m = 0 (hi again) or,
# in remainder columns, m = -1 (lo = the exact remainder of the exact product, one rounding): three packed ops
OPERAND_ASM_F16 = gl.constexpr(
    "{ .reg .b32 h, c; mul.rn.f16x2 h, $1, $2; mul.rn.f16x2 c, h, $3; fma.rn.f16x2 $0, $1, $2, c; }"
)
OPERAND_ASM_BF16 = gl.constexpr(
    "{ .reg .b32 h, c; mul.rn.bf16x2 h, $1, $2; mul.rn.bf16x2 c, h, $3; fma.rn.bf16x2 $0, $1, $2, c; }"
)


@gluon.jit
def _key_operand(
    q4,
    qz,
    mneg,
    scale_ptr,
    zero_ptr,
    meta,
    kk,
    D: gl.constexpr,
    D4: gl.constexpr,
    NK: gl.constexpr,
    IS_BF16: gl.constexpr,
    DOT: gl.constexpr,
    MMA: gl.constexpr,
    DA: gl.constexpr,
):
    """Per key page: ``B`` ``(D, N)``, ``q4 * scale`` at the permuted channels as its 16-bit rounding (even
    columns) and remainder (odd columns), packed 16-bit math (``OPERAND_ASM_*``)."""
    OUT: gl.constexpr = kk.type.layout
    sc = channel_vector(scale_ptr, meta, D4, OUT, True)  # q4 is in adjacent_channel order too
    scb, _ = gl.broadcast(sc[:, None], q4)
    if IS_BF16:
        bop = gl.inline_asm_elementwise(
            OPERAND_ASM_BF16, "=r,r,r,r", [q4, scb, mneg], dtype=gl.bfloat16, is_pure=True, pack=2
        )
    else:
        bop = gl.inline_asm_elementwise(
            OPERAND_ASM_F16, "=r,r,r,r", [q4, scb, mneg], dtype=gl.float16, is_pure=True, pack=2
        )
    return adjacent_to_low(bop, D4)


@gluon.jit
def _zero_term(zero_ptr, meta, qz, init, D4: gl.constexpr, NK: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr):
    """``init + sum q zero`` per column, stacked to ``(32, N)`` in ``MMA`` (``init`` ``(16, N)``, rows equal): a
    tensor-core product of the zeros (``zero_fragment``) with ``qz`` (``q`` at ``zero_channel``, zero in remainder
    columns), ``init`` riding in its first column half."""
    za = zero_fragment(zero_ptr, meta, D4, DA)
    c = gl.permute(gl.reshape(gl.join(init, gl.zeros_like(init)), [16, NK, 2]), [0, 2, 1])
    c = gl.convert_layout(gl.reshape(c, [16, 2 * NK]), MMA)
    return zero_rows(mma_v2(za, qz, c), NK, MMA)


@gluon.jit
def _offset_tile(K: gl.constexpr, D4: gl.constexpr, LOW: gl.constexpr, DOT: gl.constexpr, L: gl.constexpr):
    """The ``(16, K)`` constant A operand of the bf16 offsets' share (every row ``-off_k``): the unpack's offsets
    (``LOW``: the low plane's, 128, 32, 8, 128 for the fields of bytes 0 and 2 and 32, 8, 32, 8 for those of bytes 1
    and 3, ``gluon_launch.bf16_low_offset``; else 128, the high plane's), in layout ``L``. The kernel
    stores the low plane's and the value codes' in shared memory once and reads them back per page (one ``ldmatrix``
    a k-tile): built in registers in the loop, ptxas spent three register moves a k-tile filling the operand's four
    registers."""
    k = gl.arange(0, K, gl.SliceLayout(0, L))
    if LOW:
        s = k // D4
        h = (k // 8) % 2  # bytes (0, 2) or (1, 3) of the unpacked word
        off0 = gl.where(s == 1, -32.0, gl.where(s == 2, -8.0, -128.0))
        off1 = gl.where(s % 2 == 0, -32.0, -8.0)
        off = gl.where(h == 0, off0, off1).to(DOT)
    else:
        off = gl.full([K], -128.0, DOT, gl.SliceLayout(0, L))
    a, _ = gl.broadcast(off[None, :], gl.zeros([16, K], DOT, L))
    return a


@gluon.jit
def _offset_operands(offk, kk, KH: gl.constexpr, D4: gl.constexpr, MAGIC: gl.constexpr, DOT: gl.constexpr,
                     DA: gl.constexpr):  # fmt: skip
    """The constant A operands of a key page's offsets' share, low plane then high plane: bf16, the low plane's tile
    read back from shared memory (``offk``) and the high plane's built in registers where it is used; without
    ``MAGIC`` (no offsets, ``offk`` None) the kernel's ``kk`` for both."""
    if MAGIC:
        ak = offk.load(DA)
        ah = _offset_tile(KH, D4, False, DOT, DA)
    else:
        ak = kk
        ah = kk
    return ak, ah


@gluon.jit
def _high_operand(
    bop,
    idx_ptr,
    meta,
    D4: gl.constexpr,
    KH: gl.constexpr,
    NK: gl.constexpr,
    NB: gl.constexpr,
    NB4: gl.constexpr,
    IS_BF16: gl.constexpr,
    DOT: gl.constexpr,
    MMA: gl.constexpr,
    DA: gl.constexpr,
    DB: gl.constexpr,
    MAGIC: gl.constexpr,
):
    """The high plane's small operand ``4 B[channel of slot]`` ``(KH, N)``, gathered by a one-hot product (exact:
    one nonzero power-of-two term per entry). The one-hot entries are ``0x3C00`` (fp16
    1.0, bf16 2^-7): the unit goes into ``B`` (``4^(s+1)``, undoing the low operand's ``4^-s``, bf16 times 2^7;
    ``MAGIC``: ``4 * 2^7``), one packed product per pair."""
    kk = gl.arange(0, bop.shape[0], gl.SliceLayout(1, bop.type.layout))
    if MAGIC:
        unit = gl.full([bop.shape[0]], 512.0, DOT, gl.SliceLayout(1, bop.type.layout))
    elif IS_BF16:
        unit = gl.exp2(2.0 * (kk // D4).to(gl.float32) + 9.0).to(DOT)
    else:
        unit = gl.exp2(2.0 * (kk // D4).to(gl.float32) + 2.0).to(DOT)
    ub, _ = gl.broadcast(unit[:, None], bop)
    oh = one_hot(idx_ptr, meta, KH, D4, NB, NB4, IS_BF16, DA)
    g = mma_v2(oh, mul16(bop, ub, IS_BF16), gl.zeros([KH, NK], gl.float32, MMA))
    if not MAGIC:  # row r meets the high codes of field (r // 2) % 4, unpacked as 4^field code times the unit
        rr = gl.arange(0, KH, gl.SliceLayout(1, MMA))
        g = g * gl.exp2(-2.0 * ((rr // 2) % 4).to(gl.float32))[:, None]
    return gl.convert_layout(g.to(DOT), DB)


@gluon.jit
def _quant_scores(
    low_ptr,
    high_ptr,
    kpage,
    bop,
    bh,
    c0,
    qk_scale,
    c,
    G: gl.constexpr,
    D4: gl.constexpr,
    NB: gl.constexpr,
    NWH: gl.constexpr,
    RW: gl.constexpr,
    NK: gl.constexpr,
    IS_BF16: gl.constexpr,
    MMA: gl.constexpr,
    DA: gl.constexpr,
    LS: gl.constexpr,
    TOKPERM: gl.constexpr,
    MAGIC: gl.constexpr,
):
    """Base-2 logits ``(32, BH)`` of tokens ``32 c ..`` of a quantized key page (row ``r``: token ``token_perm(r)``
    with ``TOKPERM``, else ``r``); ``c0`` ``(32, N)``: the page's per-column term, the product's initial
    accumulator."""
    a = unpack_low(low_ptr, (kpage * G + 32 * c) * D4, 32, D4, IS_BF16, DA, TOKPERM, MAGIC)
    acc = mma_v2(a, bop, c0)  # c0: the page's per-column term (in the codes' unit)
    if NB > 0:
        ah = unpack_high(high_ptr, (kpage * G + 32 * c) * RW, 32, NWH, RW, IS_BF16, DA, TOKPERM, MAGIC)
        acc = mma_v2(ah, bh, acc)
    if MAGIC:
        s = merge_parts(acc) * qk_scale
    else:
        s = merge_parts(acc) * (qk_scale * 16777216.0)
    return gl.convert_layout(s, LS)  # in the softmax's layout


@gluon.jit
def _fp_scores(
    krow,
    ok,
    q_nat,
    qk_scale,
    D: gl.constexpr,
    NK: gl.constexpr,
    DOT: gl.constexpr,
    MMA: gl.constexpr,
    DA: gl.constexpr,
    LS: gl.constexpr,
):
    """Base-2 logits ``(32, BH)`` of 32 full-precision key rows starting at the pointers ``krow`` (``-inf`` where
    not ``ok``)."""
    LK: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    rk = gl.multiple_of(gl.convert_layout(krow, gl.SliceLayout(1, LK)), 16)  # rows 16-byte aligned: vector loads
    okk = gl.convert_layout(ok, gl.SliceLayout(1, LK))
    d = gl.arange(0, D, gl.SliceLayout(0, LK))
    k = gl.load(rk[:, None] + d[None, :], mask=okk[:, None], other=0.0)
    acc = mma_v2(gl.convert_layout(k.to(DOT), DA), q_nat, gl.zeros([32, NK], gl.float32, MMA))
    s = gl.convert_layout(merge_parts(acc) * qk_scale, LS)
    return gl.where(ok[:, None], s, float("-inf"))


@gluon.jit
def _fp_value_chunk(vr, ok, pb, acc, av, c: gl.constexpr, DOT: gl.constexpr, DA: gl.constexpr):
    """``acc * av + V[:, 32 c .. 32 c + 31]^T p`` ``(32, NV)`` for 32 value rows at the pointers ``vr``."""
    LV: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [1, 1], [0, 1])
    d = gl.arange(0, 32, gl.SliceLayout(1, LV))
    vT = gl.load(vr[None, :] + (32 * c + d)[:, None], mask=ok[None, :], other=0.0)
    return mma_v2(gl.convert_layout(vT.to(DOT), DA), pb, acc * av[None, :])


@gluon.jit
def _fp_values(
    vrow,
    ok,
    p,
    acc0,
    acc1,
    acc2,
    acc3,
    av,
    D: gl.constexpr,
    NCH: gl.constexpr,
    PV: gl.constexpr,
    DOT: gl.constexpr,
    MMA: gl.constexpr,
    DA: gl.constexpr,
    DB: gl.constexpr,
):
    """The four 32-channel accumulators ``acc_c * av + V_c^T p`` over 32 full-precision value rows at the pointers
    ``vrow`` (masked by ``ok``), in natural token order (``p`` ``(32, BH)``)."""
    LV: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [1, 1], [0, 1])
    vr = gl.multiple_of(gl.convert_layout(vrow, gl.SliceLayout(0, LV)), 16)  # rows 16-byte aligned: vector loads
    okv = gl.convert_layout(ok, gl.SliceLayout(0, LV))
    pp = p.to(DOT)
    if PV == 2:
        pp = gl.reshape(gl.join(pp, gl.zeros_like(pp)), [32, 2 * p.shape[1]])
    pb = gl.convert_layout(pp, DB)
    acc0 = _fp_value_chunk(vr, okv, pb, acc0, av, 0, DOT, DA)
    acc1 = _fp_value_chunk(vr, okv, pb, acc1, av, 1, DOT, DA)
    if NCH > 2:
        acc2 = _fp_value_chunk(vr, okv, pb, acc2, av, 2, DOT, DA)
        acc3 = _fp_value_chunk(vr, okv, pb, acc3, av, 3, DOT, DA)
    return acc0, acc1, acc2, acc3


@gluon.jit
def _merge_rows(ws_m_ptr, ws_l_ptr, ws_z_ptr, ws_acc_ptr, row0, stride, count, BH: gl.constexpr, D: gl.constexpr):
    """Online-softmax merge of the partials in workspace rows ``row0 + i stride`` (``i < count``), read ``SPB``
    rows per step so a step's loads are in flight together: ``(M, L, O)`` per head, zero terms folded into ``O``."""
    SPB: gl.constexpr = 16 // BH if BH < 16 else 1
    L3: gl.constexpr = gl.BlockedLayout([1, 1, D // 32], [1, 1, 32], [1, 1, 1], [2, 1, 0])
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    LO2: gl.constexpr = gl.SliceLayout(0, L3)
    sp = gl.arange(0, SPB, gl.SliceLayout(1, L2))
    hh = gl.arange(0, BH, gl.SliceLayout(0, L2))
    d = gl.arange(0, D, gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    M = gl.full([BH], float("-inf"), gl.float32, gl.SliceLayout(0, L2))
    L = gl.zeros([BH], gl.float32, gl.SliceLayout(0, L2))
    O = gl.zeros([BH, D], gl.float32, LO2)
    for t in range(0, count, SPB):
        ok = (t + sp) < count
        mh = ((row0 + (t + sp) * stride) * BH)[:, None] + hh[None, :]
        ms = gl.load(ws_m_ptr + mh, mask=ok[:, None], other=float("-inf"), cache_modifier=".cg")
        ls = gl.load(ws_l_ptr + mh, mask=ok[:, None], other=0.0, cache_modifier=".cg")
        zs = gl.load(ws_z_ptr + mh, mask=ok[:, None], other=0.0, cache_modifier=".cg")
        os_ = gl.load(
            ws_acc_ptr + mh[:, :, None] * D + d[None, None, :], mask=ok[:, None, None], other=0.0, cache_modifier=".cg"
        )
        Mn = gl.maximum(M, gl.max(ms, 0))
        Ms = gl.where(Mn > float("-inf"), Mn, 0.0)
        a = gl.exp2(M - Ms)
        w = gl.exp2(ms - Ms[None, :])
        L = L * a + gl.sum(ls * w, 0)
        O = O * gl.convert_layout(a, gl.SliceLayout(1, LO2))[:, None] + gl.sum(
            (os_ + zs[:, :, None]) * w[:, :, None], 0
        )
        M = Mn
    return M, L, O


@gluon.jit
def _store_row(ws_m_ptr, ws_l_ptr, ws_z_ptr, ws_acc_ptr, row, M, L, O, BH: gl.constexpr, D: gl.constexpr):
    """A merged ``(M, L, O)`` written back as workspace row ``row`` (zero term 0: it is folded into ``O``)."""
    hh = gl.arange(0, BH, M.type.layout)
    gl.store(ws_m_ptr + row * BH + hh, M)
    gl.store(ws_l_ptr + row * BH + hh, L)
    gl.store(ws_z_ptr + row * BH + hh, gl.zeros_like(L))
    hr = gl.arange(0, BH, gl.SliceLayout(1, O.type.layout))
    d = gl.arange(0, D, gl.SliceLayout(0, O.type.layout))
    gl.store(ws_acc_ptr + row * (BH * D) + hr[:, None] * D + d[None, :], O)


@gluon.jit
def _store_out(out_ptr, so_h, QH, M, L, O, BH: gl.constexpr, D: gl.constexpr):
    """``O / L`` of the ``QH`` real heads into the output rows at ``out_ptr`` (head stride ``so_h``)."""
    LO2: gl.constexpr = O.type.layout
    hr = gl.arange(0, BH, gl.SliceLayout(1, LO2))
    d = gl.arange(0, D, gl.SliceLayout(0, LO2))
    Lr = gl.convert_layout(L, gl.SliceLayout(1, LO2))
    o = O / gl.where(Lr > 0, Lr, 1.0)[:, None]
    gl.store(out_ptr + hr[:, None] * so_h + d[None, :], o.to(out_ptr.dtype.element_ty), mask=(hr < QH)[:, None])


@gluon.jit
def _key_page_terms(
    q4, qz, mneg, k_scale_ptr, k_zero_ptr, k_idx_ptr, kpage, kk, ak, ah,
    D: gl.constexpr, D4: gl.constexpr, KH: gl.constexpr, NK: gl.constexpr, NB: gl.constexpr,
    NB4: gl.constexpr, IS_BF16: gl.constexpr, DOT: gl.constexpr, MMA: gl.constexpr,
    DA: gl.constexpr, DB: gl.constexpr, MAGIC: gl.constexpr,
):  # fmt: skip
    """A quantized key page's operands: the low plane's ``bop``, the high plane's ``bh`` (one-hot gather) and the
    ``(32, N)`` initial accumulator holding the per-column term, in the codes' unit (``MAGIC``: in natural units,
    with the offsets' share, ``ak`` and ``ah`` the ``_offset_tile`` A operands of the low and high plane; unused
    otherwise)."""
    bop = _key_operand(q4, qz, mneg, k_scale_ptr, k_zero_ptr, kpage * D, kk, D, D4, NK, IS_BF16, DOT, MMA, DA)
    init = gl.zeros([16, NK], gl.float32, MMA)
    if MAGIC:
        init = mma_v2(ak, bop, init)  # -sum_k off_k bop[k, :], every row
    bh = bop
    if NB > 0:
        bh = _high_operand(bop, k_idx_ptr, kpage * D, D4, KH, NK, NB, NB4, IS_BF16, DOT, MMA, DA, DB, MAGIC)
        if MAGIC:
            init = mma_v2(ah, bh, init)
    c0 = _zero_term(k_zero_ptr, kpage * D, qz, init, D4, NK, MMA, DA)
    if not MAGIC:
        c0 = c0 * 5.9604644775390625e-08  # the codes' unit 2^-24 (bf16: qz carries the rest of its 2^-43)
    return bop, bh, c0


@gluon.jit
def _key_page_scores(
    q4, qz, mneg, k_scale_ptr, k_zero_ptr, k_idx_ptr, k_low_ptr, k_high_ptr, kpage, kk, ak, ah, qk_scale,
    G: gl.constexpr, D: gl.constexpr, D4: gl.constexpr, KH: gl.constexpr, NK: gl.constexpr, NB: gl.constexpr,
    NB4: gl.constexpr, NWH: gl.constexpr, RW: gl.constexpr,
    IS_BF16: gl.constexpr, DOT: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr,
    LS: gl.constexpr, MAGIC: gl.constexpr,
):  # fmt: skip
    """One quantized key page's scores, four 32-token chunks in the softmax's layout ``LS`` (row ``r`` of chunk
    ``c``: token ``32 c + token_perm(r)``): the key operands of the page (``_key_page_terms``), then the low (and
    high) plane codes against them."""
    bop, bh, c0 = _key_page_terms(q4, qz, mneg, k_scale_ptr, k_zero_ptr, k_idx_ptr, kpage, kk, ak, ah, D, D4, KH, NK,
                                  NB, NB4, IS_BF16, DOT, MMA, DA, DB, MAGIC)  # fmt: skip
    s0 = _quant_scores(k_low_ptr, k_high_ptr, kpage, bop, bh, c0, qk_scale, 0, G, D4, NB, NWH, RW, NK,
                        IS_BF16, MMA, DA, LS, True, MAGIC)  # fmt: skip
    s1 = _quant_scores(k_low_ptr, k_high_ptr, kpage, bop, bh, c0, qk_scale, 1, G, D4, NB, NWH, RW, NK,
                        IS_BF16, MMA, DA, LS, True, MAGIC)  # fmt: skip
    s2 = _quant_scores(k_low_ptr, k_high_ptr, kpage, bop, bh, c0, qk_scale, 2, G, D4, NB, NWH, RW, NK,
                        IS_BF16, MMA, DA, LS, True, MAGIC)  # fmt: skip
    s3 = _quant_scores(k_low_ptr, k_high_ptr, kpage, bop, bh, c0, qk_scale, 3, G, D4, NB, NWH, RW, NK,
                        IS_BF16, MMA, DA, LS, True, MAGIC)  # fmt: skip
    return s0, s1, s2, s3


@gluon.jit
def _key_chunk_scores(
    q4, qz, mneg, k_scale_ptr, k_zero_ptr, k_idx_ptr, k_low_ptr, k_high_ptr, kpage, c, kk, ak, ah, qk_scale,
    G: gl.constexpr, D: gl.constexpr, D4: gl.constexpr, KH: gl.constexpr, NK: gl.constexpr, NB: gl.constexpr,
    NB4: gl.constexpr, NWH: gl.constexpr, RW: gl.constexpr,
    IS_BF16: gl.constexpr, DOT: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr,
    LS: gl.constexpr, MAGIC: gl.constexpr,
):  # fmt: skip
    """Scores of the 32 tokens ``32 c ..`` of a quantized key page (a page whose values are still in full
    precision): the page's key operands are built for this one chunk."""
    bop, bh, c0 = _key_page_terms(q4, qz, mneg, k_scale_ptr, k_zero_ptr, k_idx_ptr, kpage, kk, ak, ah, D, D4, KH, NK,
                                  NB, NB4, IS_BF16, DOT, MMA, DA, DB, MAGIC)  # fmt: skip
    return _quant_scores(k_low_ptr, k_high_ptr, kpage, bop, bh, c0, qk_scale, c, G, D4, NB, NWH, RW, NK,
                         IS_BF16, MMA, DA, LS, False, MAGIC)  # fmt: skip
