"""The Gluon decode kernel's per-page math and its split merge (``kernels/decode_gluon.py`` launches them): the key
operand from ``q * scale`` at the permuted channels, the high plane's one-hot gather, the quantized and
full-precision scores, the full-precision values, and the workspace rows the last program of a group merges.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from ._gluon_parts import (
    channel_vector,
    merge_parts,
    one_hot,
    unpack_high,
    unpack_low,
)

LOG2E = 1.4426950408889634


@gluon.jit
def _key_operand(
    q_perm,
    scale_ptr,
    zero_ptr,
    meta,
    kk,
    part,
    D: gl.constexpr,
    D4: gl.constexpr,
    TWO: gl.constexpr,
    IS_BF16: gl.constexpr,
    DOT: gl.constexpr,
):
    """Per key page: ``B`` ``(D, N)`` (``q * scale`` at the permuted channels, two parts or hi and a zero column)
    and its per-column term ``corr`` ``(N,)``: ``sum q zero`` (part 0), minus the bf16 offsets' share."""
    OUT: gl.constexpr = kk.type.layout
    sc = channel_vector(scale_ptr, meta, D4, OUT).to(gl.float32)
    z = channel_vector(zero_ptr, meta, D4, OUT).to(gl.float32)
    s = kk // D4
    if IS_BF16:
        off = gl.where(s == 1, 32.0, gl.where(s == 2, 8.0, 128.0))
    else:
        sc = sc * gl.exp2(-2.0 * s.to(gl.float32))  # the unit 4^s of field s
    q_perm = q_perm.to(gl.float32)
    x = q_perm * sc[:, None]
    hi = x.to(DOT)
    if TWO:
        lo = (x - hi.to(gl.float32)).to(DOT)
        bop = gl.where(part[None, :] == 0, hi, lo)
    else:
        bop = gl.where(part[None, :] == 0, hi, gl.zeros_like(hi))
    corr = gl.sum(gl.where(part[None, :] == 0, q_perm, 0.0) * z[:, None], 0)
    if IS_BF16:
        corr = corr - gl.sum(bop.to(gl.float32) * off[:, None], 0)
    return bop, corr


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
):
    """The high plane's small operand ``4 B[channel of slot]`` ``(KH, N)``, gathered by a one-hot product (exact:
    one nonzero power-of-two term per entry), and its bf16 offset term."""
    oh = one_hot(idx_ptr, meta, KH, D4, NB, NB4, not IS_BF16, DOT, DA)
    g = mma_v2(oh, bop, gl.zeros([KH, NK], gl.float32, MMA))
    bh = gl.convert_layout(g.to(DOT), DB)
    if IS_BF16:
        corr = -128.0 * gl.sum(bh.to(gl.float32), 0)
    else:
        corr = gl.zeros([NK], gl.float32, gl.SliceLayout(0, DB))
    return bh, corr


@gluon.jit
def _quant_scores(
    low_ptr,
    high_ptr,
    kpage,
    bop,
    bh,
    corr_m,
    qk_scale,
    c,
    G: gl.constexpr,
    D4: gl.constexpr,
    NB: gl.constexpr,
    NWH: gl.constexpr,
    RW: gl.constexpr,
    NK: gl.constexpr,
    PK: gl.constexpr,
    IS_BF16: gl.constexpr,
    MMA: gl.constexpr,
    DA: gl.constexpr,
    LS: gl.constexpr,
):
    """Base-2 logits ``(32, BH)`` of tokens ``32 c ..`` of a quantized key page."""
    a = unpack_low(low_ptr, (kpage * G + 32 * c) * D4, 32, D4, IS_BF16, DA)
    acc = mma_v2(a, bop, gl.zeros([32, NK], gl.float32, MMA))
    if NB > 0:
        ah = unpack_high(high_ptr, (kpage * G + 32 * c) * RW, 32, NWH, RW, IS_BF16, DA)
        acc = mma_v2(ah, bh, acc)
    if IS_BF16:
        s = acc + corr_m[None, :]
    else:
        s = acc * 16777216.0 + corr_m[None, :]
    return gl.convert_layout(merge_parts(s, PK) * qk_scale, LS)  # in the softmax's layout


@gluon.jit
def _fp_scores(
    krow,
    ok,
    q_nat,
    qk_scale,
    D: gl.constexpr,
    NK: gl.constexpr,
    PK: gl.constexpr,
    DOT: gl.constexpr,
    MMA: gl.constexpr,
    DA: gl.constexpr,
    LS: gl.constexpr,
):
    """Base-2 logits ``(32, BH)`` of 32 full-precision key rows starting at the pointers ``krow`` (``-inf`` where
    not ``ok``)."""
    LK: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    rk = gl.convert_layout(krow, gl.SliceLayout(1, LK))
    okk = gl.convert_layout(ok, gl.SliceLayout(1, LK))
    d = gl.arange(0, D, gl.SliceLayout(0, LK))
    k = gl.load(rk[:, None] + d[None, :], mask=okk[:, None], other=0.0)
    acc = mma_v2(gl.convert_layout(k.to(DOT), DA), q_nat, gl.zeros([32, NK], gl.float32, MMA))
    s = gl.convert_layout(merge_parts(acc, PK) * qk_scale, LS)
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
    vr = gl.convert_layout(vrow, gl.SliceLayout(0, LV))
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
def _key_page_scores(
    q_perm, k_scale_ptr, k_zero_ptr, k_idx_ptr, k_low_ptr, k_high_ptr, kpage, kk, part, qk_scale,
    G: gl.constexpr, D: gl.constexpr, D4: gl.constexpr, KH: gl.constexpr, NK: gl.constexpr, NB: gl.constexpr,
    NB4: gl.constexpr, NWH: gl.constexpr, RW: gl.constexpr, PK: gl.constexpr, TWO: gl.constexpr,
    IS_BF16: gl.constexpr, DOT: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr,
    LS: gl.constexpr,
):  # fmt: skip
    """One quantized key page's scores, four 32-token chunks in the softmax's layout ``LS``: the key operand of the
    page (``q * scale`` at the permuted channels, the high plane's one-hot gather where channels are boosted), then
    the low (and high) plane codes against it."""
    bop, corr = _key_operand(q_perm, k_scale_ptr, k_zero_ptr, kpage * D, kk, part, D, D4, TWO, IS_BF16, DOT)
    bh = bop
    if NB > 0:
        bh, ch = _high_operand(bop, k_idx_ptr, kpage * D, D4, KH, NK, NB, NB4, IS_BF16, DOT, MMA, DA, DB)
        corr = corr + ch
    corr_m = gl.convert_layout(corr, gl.SliceLayout(0, MMA))
    s0 = _quant_scores(k_low_ptr, k_high_ptr, kpage, bop, bh, corr_m, qk_scale, 0, G, D4, NB, NWH, RW, NK, PK,
                        IS_BF16, MMA, DA, LS)  # fmt: skip
    s1 = _quant_scores(k_low_ptr, k_high_ptr, kpage, bop, bh, corr_m, qk_scale, 1, G, D4, NB, NWH, RW, NK, PK,
                        IS_BF16, MMA, DA, LS)  # fmt: skip
    s2 = _quant_scores(k_low_ptr, k_high_ptr, kpage, bop, bh, corr_m, qk_scale, 2, G, D4, NB, NWH, RW, NK, PK,
                        IS_BF16, MMA, DA, LS)  # fmt: skip
    s3 = _quant_scores(k_low_ptr, k_high_ptr, kpage, bop, bh, corr_m, qk_scale, 3, G, D4, NB, NWH, RW, NK, PK,
                        IS_BF16, MMA, DA, LS)  # fmt: skip
    return s0, s1, s2, s3


@gluon.jit
def _key_chunk_scores(
    q_perm, k_scale_ptr, k_zero_ptr, k_idx_ptr, k_low_ptr, k_high_ptr, kpage, c, kk, part, qk_scale,
    G: gl.constexpr, D: gl.constexpr, D4: gl.constexpr, KH: gl.constexpr, NK: gl.constexpr, NB: gl.constexpr,
    NB4: gl.constexpr, NWH: gl.constexpr, RW: gl.constexpr, PK: gl.constexpr, TWO: gl.constexpr,
    IS_BF16: gl.constexpr, DOT: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr,
    LS: gl.constexpr,
):  # fmt: skip
    """Scores of the 32 tokens ``32 c ..`` of a quantized key page (a page whose values are still in full
    precision): the page's key operand is built for this one chunk."""
    bop, corr = _key_operand(q_perm, k_scale_ptr, k_zero_ptr, kpage * D, kk, part, D, D4, TWO, IS_BF16, DOT)
    bh = bop
    if NB > 0:
        bh, ch = _high_operand(bop, k_idx_ptr, kpage * D, D4, KH, NK, NB, NB4, IS_BF16, DOT, MMA, DA, DB)
        corr = corr + ch
    corr_m = gl.convert_layout(corr, gl.SliceLayout(0, MMA))
    return _quant_scores(k_low_ptr, k_high_ptr, kpage, bop, bh, corr_m, qk_scale, c, G, D4, NB, NWH, RW, NK, PK,
                         IS_BF16, MMA, DA, LS)  # fmt: skip
