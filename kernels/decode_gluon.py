"""Decode attention over a Kitty cache in Gluon: 2-bit codes become ``mma_v2`` operands in registers, one warp per
program.

The same contract as the ``tl`` kernel (``kernels/decode_attention.py``, the reference and fallback): sink | key
and value pages | qbuffers | local window, ``full_qbuffer`` mid-step, split-K partials merged inside the launch by
the last program of each (row, KV head) (an int32 ticket that program resets, so a replayed graph starts clean).

Program = (row, KV head, split), one warp with its own online softmax: first its full-precision chunks of 32 tokens (the
sink on split 0, then the tokens whose values are in the qbuffer or the local window), then a contiguous run of
quantized pages (``GluonLaunch.tail_splits`` can give the chunks, and then the sink, programs of their own). Per page
(128 tokens), swap-AB as the ``tl`` kernel: scores ``(32 tokens, N) = codes (32, D) @ (q * scale)^T (D, N)`` for four
token chunks (key low plane, then the boosted channels' high plane, ``kernels/_gluon_parts.py`` ``unpack_low`` /
``unpack_high``: the unpacked codes land in the A fragment with ``assert_trivial``), one softmax step, then ``(32
channels, N) += value codes (32, 128) @ (p * scale) (128, N)`` per channel chunk. ``N`` is the small side: the query
heads of the KV head, padded to 4 or 8, twice (the key operand ``q * scale`` as its 16-bit rounding and remainder).
The permutation the unpack gives the reduction axis (``kernels/gluon_launch.py``) is applied to the small operands:
key scales, zeros and boost slots are read at the permuted channels; the score rows are permuted (``token_perm``) and
``p`` goes to the value operand's K order through shared memory (not codes). Zero points, bf16 offsets and the fp16
unit fold into per-page terms: the scores' initial accumulator (a tensor-core product), and the value zero term per
head.

Which kernel runs is decided in ``kitty/cache/backend.py`` by ``gluon_launch.gluon_supports``; this file is imported
only where triton 3.6's Gluon is available.
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kitty.core.config import KVQuantConfig
from kitty.core.storage import KittyLayerState, check_state

from ._gluon_page import (
    _fp_scores,
    _fp_values,
    _key_chunk_scores,
    _key_page_scores,
    _merge_rows,
    _offset_operands,
    _offset_tile,
    _store_out,
    _store_row,
)
from ._gluon_parts import (
    adjacent_channel,
    cat4,
    rescale,
    to_f32,
    token_order,
    token_vector,
    unpack_low,
    widen,
    zero_channel,
)
from .gluon_launch import (
    GLUON_WORKSPACE,
    GluonLaunch,
    default_gluon_launch,
    gluon_constants,
    gluon_workspace,
    gluon_workspace_shapes,
    high_plane_view,
    merge_group,
    pages_supported,
)

__all__ = ["decode_attention_gluon", "gluon_constants"]

LOG2E = 1.4426950408889634


@gluon.jit
def _prefetch_l2(ptrs):
    """``prefetch.global.L2`` of the lines at ``ptrs`` (valid addresses; nothing is read into registers)."""
    gl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l", [ptrs], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _prefetch_page(
    k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr, kpage, vpage,
    G: gl.constexpr, D: gl.constexpr, NB: gl.constexpr, NB4: gl.constexpr, RW: gl.constexpr,
):  # fmt: skip
    """``prefetch.global.L2`` of every 128-byte line of one key page (``kpage``) and one value page (``vpage``), one
    line per lane and array, so that the page loop's dependent loads of that page wait on L2 rather than DRAM."""
    LR: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    t = gl.arange(0, 32, LR)
    KL: gl.constexpr = G * D // 4 // 128  # key low plane lines
    VL: gl.constexpr = D * G // 4 // 128  # value code lines (2-bit codes)
    _prefetch_l2(k_low_ptr + kpage * (G * D // 4) + (t % KL) * 128)
    _prefetch_l2(v_codes_ptr + vpage * (D * G // 4) + (t % VL) * 128)
    # scales and zeros (16-bit, 64 a line): D per key page, G per value page, 8 lanes each
    KS: gl.constexpr = D // 64
    VS: gl.constexpr = G // 64
    quarter = t // 8
    key_side = gl.where(quarter == 0, k_scale_ptr, k_zero_ptr) + kpage * D + (t % KS) * 64
    value_side = gl.where(quarter == 2, v_scale_ptr, v_zero_ptr) + vpage * G + (t % VS) * 64
    _prefetch_l2(gl.where(quarter < 2, key_side, value_side))
    if NB > 0:
        HL: gl.constexpr = G * NB4 // 128  # high plane lines, of 128 RW // NB4 view elements each
        _prefetch_l2(k_high_ptr + kpage * (G * RW) + (t % HL) * (128 * RW // NB4))
        _prefetch_l2(k_idx_ptr + kpage * D + t * 0)


# NUM_SPLITS and MERGE_GROUP stay runtime values: Triton would turn a 1 into a constant, and triton 3.6's LLVM lowering
# asserts (PassManager::run failed) on the kernel with both at 1 (a one-split launch). TAIL likewise.
@gluon.jit(do_not_specialize=["NUM_SPLITS", "MERGE_GROUP", "TAIL", "CHUNK_COST"])
def _decode_gluon_kernel(
    q_ptr, out_ptr, ws_m_ptr, ws_l_ptr, ws_z_ptr, ws_acc_ptr, ticket_ptr, len_ptr, sink_k_ptr, sink_v_ptr, k_qbuf_ptr,
    v_qbuf_ptr, v_local_ptr, k_pt_ptr, v_pt_ptr, k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr,
    v_scale_ptr, v_zero_ptr, Hkv, QH, NUM_SPLITS, MERGE_GROUP, TAIL, CHUNK_COST, qk_scale, sq_b, sq_h, so_b, so_h,
    ssk_b, ssk_h, ssv_b, ssv_h, skq_b, skq_h, svq_b, svq_h, svl_b, svl_h, spk_b, spv_b, S: gl.constexpr,
    G: gl.constexpr, R: gl.constexpr, D: gl.constexpr, NB: gl.constexpr, NB4: gl.constexpr, NWH: gl.constexpr,
    RW: gl.constexpr, BH: gl.constexpr, IS_BF16: gl.constexpr, FULL_QBUF: gl.constexpr, PREFETCH: gl.constexpr,
    MAGIC: gl.constexpr,
):
    gl.static_assert(G == 128, "pages of 128 tokens: four chunks of 32")
    D4: gl.constexpr = D // 4
    NCH: gl.constexpr = D // 32  # value channel chunks
    KH: gl.constexpr = 16 * NWH
    PK: gl.constexpr = 2  # key product columns per head: q * scale's 16-bit rounding and its remainder
    NK: gl.constexpr = BH * PK
    PV: gl.constexpr = 2 if BH == 4 else 1
    NV: gl.constexpr = BH * PV
    if IS_BF16:
        DOT: gl.constexpr = gl.bfloat16
    else:
        DOT: gl.constexpr = gl.float16
    # the page loop's codes read as subnormals, 4^s code 2^-24 (fp16) or 4^s code 2^-133 (bf16); bf16 folds 2^90
    # into its small operands (q4 and p * scale, exact), so that both products are in units of 2^-43, and 2^-19
    # into the zero term's q (the page terms' 2^-24 does the rest). MAGIC (bf16 only): codes as OFF_s + code,
    # natural units, the offsets' share on the tensor cores.
    if IS_BF16:
        QS: gl.constexpr = 1237940039285380274899124224.0  # 2^90
        ZS: gl.constexpr = 1.9073486328125e-06  # 2^-19
        UNIT: gl.constexpr = 1.1368683772161603e-13  # 2^-43
        INV_UNIT: gl.constexpr = 8796093022208.0  # 2^43
    else:
        QS: gl.constexpr = 1.0
        ZS: gl.constexpr = 1.0
        UNIT: gl.constexpr = 5.9604644775390625e-08  # 2^-24
        INV_UNIT: gl.constexpr = 16777216.0  # 2^24
    qk_q = qk_scale  # the quantized pages' scores: their units' remaining 2^19 (bf16) undone with the scale
    if IS_BF16 and not MAGIC:
        qk_q = qk_scale * 524288.0  # 2^19
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    DA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    DB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    LS: gl.constexpr = gl.SliceLayout(2, gl.BlockedLayout([1, 1, 2], [8, 4, 1], [1, 1, 1], [2, 1, 0]))
    LH: gl.constexpr = gl.SliceLayout(0, LS)  # per-head vectors

    pid_bh = gl.program_id(0)
    split = gl.program_id(1)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    b64 = b.to(gl.int64)
    n = gl.load(len_ptr + b)
    m = gl.maximum(n - S, 0)
    mv = gl.maximum(m - R, 0)
    if FULL_QBUF:
        kp = gl.maximum(gl.cdiv(m, G) - 1, 0)
        vp = gl.maximum(gl.cdiv(mv, G) - 1, 0)
    else:
        kp = m // G
        vp = mv // G
    slots = gl.cdiv(m, G)
    nck = gl.cdiv(m, 32)  # 32-token chunks holding tokens
    NSC: gl.constexpr = (S + 31) // 32  # sink chunks
    if TAIL > 0:  # the last TAIL splits share the full-precision chunks, the others the quantized pages
        nps = NUM_SPLITS - TAIL
        per = gl.cdiv(vp, nps)
        if split < nps:
            start = split * per
            end = gl.minimum(start + per, vp)
            c_lo = 0
            c_hi = 0
        else:
            start = 0
            end = 0
            tper = gl.cdiv(gl.maximum(nck - vp * 4, 0), TAIL)
            c_lo = vp * 4 + (split - nps) * tper
            c_hi = gl.maximum(gl.minimum(c_lo + tper, nck), c_lo)
    elif CHUNK_COST > 0:  # equal cost per split: the sink chunks, the pages (8 each), then the full-precision
        # chunks (CHUNK_COST each) laid end to end; an item runs on the split whose range holds its start
        nfp = gl.maximum(nck - vp * 4, 0)
        base = gl.where(n > 0, NSC * CHUNK_COST, 0)
        per = gl.cdiv(base + vp * 8 + nfp * CHUNK_COST, NUM_SPLITS)
        lo = split * per - base
        hi = lo + per
        start = gl.minimum(gl.cdiv(gl.maximum(lo, 0), 8), vp)
        end = gl.minimum(gl.cdiv(gl.maximum(hi, 0), 8), vp)
        c_lo = vp * 4 + gl.minimum(gl.cdiv(gl.maximum(lo - vp * 8, 0), CHUNK_COST), nfp)
        c_hi = vp * 4 + gl.minimum(gl.cdiv(gl.maximum(hi - vp * 8, 0), CHUNK_COST), nfp)
    else:  # each split: a run of page slots, then the full-precision chunks among them
        per = gl.cdiv(slots, NUM_SPLITS)
        start = split * per
        end = gl.minimum(start + per, slots)
        c_lo = gl.maximum(start, vp) * 4
        c_hi = gl.maximum(gl.minimum(end * 4, nck), c_lo)
    stop = gl.minimum(end, vp)  # this split's quantized pages: start .. stop
    k0 = 0
    v0 = 0
    kn = 0
    vn = 0
    if PREFETCH:  # the first page's table entries now, its lines into L2 once q's loads are out (below); the page
        # loop keeps one page ahead (kn, vn)
        pt_k = k_pt_ptr + b64 * spk_b
        pt_v = v_pt_ptr + b64 * spv_b
        k0 = gl.load(pt_k + start, mask=start < stop, other=0).to(gl.int64)
        v0 = gl.load(pt_v + start, mask=start < stop, other=0).to(gl.int64)
        kn = gl.load(pt_k + start + 1, mask=start + 1 < stop, other=0).to(gl.int64)
        vn = gl.load(pt_v + start + 1, mask=start + 1 < stop, other=0).to(gl.int64)

    # ---- the small key operand's loop-invariant part: q at the permuted channels, column r * PK + part
    kk = gl.arange(0, D, gl.SliceLayout(1, DB))
    nn = gl.arange(0, NK, gl.SliceLayout(0, DB))
    part = nn % PK
    head = nn // PK
    q_off = b64 * sq_b + h * QH * sq_h
    q_perm = gl.load(  # at adjacent_channel: the order the page's scales load in, before bop goes to low_channel
        q_ptr + q_off + head[None, :] * sq_h + adjacent_channel(kk, D4)[:, None], mask=(head < QH)[None, :], other=0.0
    )
    if MAGIC:
        q4 = q_perm
    else:  # the unit 4^-s of field s folded into q (exact unless q4 is subnormal), and bf16's 2^90
        q4 = (q_perm.to(gl.float32) * (gl.exp2(-2.0 * (kk // D4).to(gl.float32)) * QS)[:, None]).to(DOT)
    mneg, _ = gl.broadcast(gl.where(part == 1, -1.0, 0.0).to(DOT)[None, :], q4)  # -1 in remainder columns
    # the zero term's operand: q at zero_channel, column t * NK + n (half t of the channels), zero in part-1 columns
    kz = gl.arange(0, D // 2, gl.SliceLayout(1, DB))
    nz = gl.arange(0, 2 * NK, gl.SliceLayout(0, DB))
    hz = (nz % NK) // PK
    qz = gl.load(
        q_ptr + q_off + hz[None, :] * sq_h + zero_channel(kz[:, None], (nz // NK)[None, :], D4),
        mask=((hz < QH) & ((nz % NK) % PK == 0))[None, :],
        other=0.0,
    )
    if IS_BF16 and not MAGIC:
        qz = (qz.to(gl.float32) * ZS).to(DOT)  # exact: a power of two within bf16's range
    if PREFETCH:
        if start < stop:
            _prefetch_page(k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr,
                           v_zero_ptr, k0 * Hkv + h, v0 * Hkv + h, G, D, NB, NB4, RW)  # fmt: skip
    # the loop-invariant operands wait in shared memory (read back per page: 8 ldmatrix), not in ~48 registers
    # through both loops
    QL: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [0, 1])
    q4buf = gl.allocate_shared_memory(DOT, [D, NK], QL, q4)
    qzbuf = gl.allocate_shared_memory(DOT, [D // 2, 2 * NK], QL, qz)
    offk = None  # codes as subnormals: no offsets
    if MAGIC:  # the offsets' constant A operands of the key low plane and the value codes, read back per page (the
        # high plane's one or two k-tiles are built in registers where they are used)
        OL: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
        LT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
        offk = gl.allocate_shared_memory(DOT, [16, D], OL, _offset_tile(D, D4, True, DOT, LT))
        if D == 4 * 32:  # the value codes' tile is the key low plane's (a page's 128 tokens as 4 fields of 32)
            offv = offk
        else:
            offv = gl.allocate_shared_memory(DOT, [16, 4 * 32], OL, _offset_tile(4 * 32, 32, True, DOT, LT))
    tt = gl.arange(0, 32, gl.SliceLayout(1, LS))
    m_i = gl.full([BH], float("-inf"), gl.float32, LH)
    l_i = gl.zeros([BH], gl.float32, LH)
    az = gl.zeros([BH], gl.float32, LH)
    acc0 = gl.zeros([32, NV], gl.float32, MMA)
    acc1 = gl.zeros([32, NV], gl.float32, MMA)
    acc2 = gl.zeros([32, NV], gl.float32, MMA)
    acc3 = gl.zeros([32, NV], gl.float32, MMA)
    # ---- first the full-precision values, 32 tokens per step, before the page loop so that their buffers, the
    # natural-order q and the per-chunk pointers are dead while the page loop runs: the sink (split 0, or the last
    # tail split), then this split's tokens whose values are in the qbuffer or the local window (keys quantized below
    # kp, else in the qbuffer). They accumulate into the page loop's accumulators, in natural units until the loop
    # starts.
    sink_split = gl.where(TAIL > 0, NUM_SPLITS - 1, 0)  # with tail splits, the last one (split 0 runs a page)
    ns = gl.where((split == sink_split) & (n > 0), NSC, 0)
    qnbuf = gl.allocate_shared_memory(
        DOT,
        [D, NK],
        QL,
        gl.load(
            q_ptr + q_off + head[None, :] * sq_h + kk[:, None], mask=((head < QH) & (part == 0))[None, :], other=0.0
        ).to(DOT),
    )
    sk_ptr = sink_k_ptr + b64 * ssk_b + h * ssk_h
    sv_ptr = sink_v_ptr + b64 * ssv_b + h * ssv_h
    kq_ptr = k_qbuf_ptr + b64 * skq_b + h * skq_h
    vq_ptr = v_qbuf_ptr + b64 * svq_b + h * svq_h
    vl_ptr = v_local_ptr + b64 * svl_b + h * svl_h
    Rm = gl.maximum(R, 1)
    # warm L2 with this split's full-precision key and value rows (2 lines of 128 B each), so that the chunk loop's
    # dependent steps wait on L2 rather than DRAM: at small batch these chunks are a program's critical path
    LR: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tr = gl.arange(0, 32, LR)
    for i in range(c_lo, c_hi):
        rr = i * 32 + tr
        kr = kq_ptr + (rr % G) * D
        vr = gl.where((rr < mv) | (rr >= m), vq_ptr + (rr % G) * D, vl_ptr + (rr % Rm) * D)  # always a real row
        for line in gl.static_range(0, D * 2 // 128):
            _prefetch_l2(kr + line * (128 // 2))
            _prefetch_l2(vr + line * (128 // 2))
    for i in range(c_lo - ns, c_hi):
        rel = i * 32 + tt  # token after the sink (tail chunks)
        if i < c_lo:  # sink chunk
            r = (i - c_lo + ns) * 32 + tt
            ok = r < gl.minimum(n, S)
            krow = sk_ptr + r * D
            vrow = sv_ptr + r * D
        else:
            ok = rel < m
            krow = kq_ptr + (rel % G) * D
            vrow = gl.where(rel < mv, vq_ptr + (rel % G) * D, vl_ptr + (rel % Rm) * D)
        if (i >= c_lo) & (i // 4 < kp):
            kpage = gl.load(k_pt_ptr + b64 * spk_b + i // 4).to(gl.int64) * Hkv + h
            ak, ah = _offset_operands(offk, kk, KH, D4, MAGIC, DOT, DA)
            s = _key_chunk_scores(
                q4buf.load(DB), qzbuf.load(DB), mneg, k_scale_ptr, k_zero_ptr, k_idx_ptr, k_low_ptr, k_high_ptr, kpage,
                i % 4, kk, ak, ah, qk_q, G, D, D4, KH, NK, NB, NB4, NWH, RW, IS_BF16, DOT, MMA, DA, DB, LS, MAGIC
            )
        else:
            s = _fp_scores(krow, ok, qnbuf.load(DB), qk_scale, D, NK, DOT, MMA, DA, LS)
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_safe = gl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[None, :])
        m_i = m_new
        l_i = l_i * alpha + gl.sum(p, 0)  # az is still 0: no quantized values yet
        acc0, acc1, acc2, acc3 = _fp_values(
            vrow, ok, p, acc0, acc1, acc2, acc3, gl.convert_layout(widen(alpha, PV), gl.SliceLayout(0, MMA)), D,
            NCH, PV, DOT, MMA, DA, DB
        )
    if not MAGIC:  # the page loop's units: codes read as subnormals
        acc0 = acc0 * UNIT
        acc1 = acc1 * UNIT
        acc2 = acc2 * UNIT
        acc3 = acc3 * UNIT
    # ---- pages with quantized keys and values
    # p * scale's trip to the value operand (tokens on rows, heads on lanes -> the B fragment): through shared
    # memory, K-contiguous, 16 four-byte stores and 4 ldmatrix a page (convert_layout chose ~50 shuffles and selects)
    pbuf = gl.allocate_shared_memory(DOT, [4 * 32, NV], gl.SwizzledSharedLayout(8, 1, 8, [0, 1]))
    azo = gl.zeros([16, NV], gl.float32, MMA)  # bf16: the value offsets' share, every row the same
    for j in range(start, stop):
        if PREFETCH:  # page j's table entries were loaded two pages ago (k0, v0), page j + 1's a page ago (kn, vn):
            # page j + 1 into L2, then page j + 2's entries
            kpage = k0 * Hkv + h
            vpage = v0 * Hkv + h
            if j + 1 < stop:
                _prefetch_page(k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr,
                               v_zero_ptr, kn * Hkv + h, vn * Hkv + h, G, D, NB, NB4, RW)  # fmt: skip
            k0 = kn
            v0 = vn
            kn = gl.load(pt_k + j + 2, mask=j + 2 < stop, other=0).to(gl.int64)
            vn = gl.load(pt_v + j + 2, mask=j + 2 < stop, other=0).to(gl.int64)
        else:
            kpage = gl.load(k_pt_ptr + b64 * spk_b + j).to(gl.int64) * Hkv + h
            vpage = gl.load(v_pt_ptr + b64 * spv_b + j).to(gl.int64) * Hkv + h
        ak, ah = _offset_operands(offk, kk, KH, D4, MAGIC, DOT, DA)
        s0, s1, s2, s3 = _key_page_scores(
            q4buf.load(DB), qzbuf.load(DB), mneg, k_scale_ptr, k_zero_ptr, k_idx_ptr, k_low_ptr, k_high_ptr, kpage, kk,
            ak, ah, qk_q, G, D, D4, KH, NK, NB, NB4, NWH, RW, IS_BF16, DOT, MMA, DA, DB, LS, MAGIC
        )
        m_new = gl.maximum(m_i, gl.max(gl.maximum(gl.maximum(s0, s1), gl.maximum(s2, s3)), 0))
        alpha = gl.exp2(m_i - m_new)
        p0 = gl.exp2(s0 - m_new[None, :])
        p1 = gl.exp2(s1 - m_new[None, :])
        p2 = gl.exp2(s2 - m_new[None, :])
        p3 = gl.exp2(s3 - m_new[None, :])
        m_i = m_new
        l_i = l_i * alpha + gl.sum((p0 + p1) + (p2 + p3), 0)
        # value operand: p * scale per token (times 4^-u, the unit of token quarter u, and bf16's 2^90)
        # (rows in token_perm order, as the scores: each lane loads 4 adjacent tokens' scale and zero at once)
        vb = vpage * G
        TV: gl.constexpr = gl.SliceLayout(1, LS)
        vs0 = to_f32(token_vector(v_scale_ptr, vb, TV), IS_BF16)
        vs1 = to_f32(token_vector(v_scale_ptr, vb + 32, TV), IS_BF16)
        vs2 = to_f32(token_vector(v_scale_ptr, vb + 64, TV), IS_BF16)
        vs3 = to_f32(token_vector(v_scale_ptr, vb + 96, TV), IS_BF16)
        vz0 = to_f32(token_vector(v_zero_ptr, vb, TV), IS_BF16)
        vz1 = to_f32(token_vector(v_zero_ptr, vb + 32, TV), IS_BF16)
        vz2 = to_f32(token_vector(v_zero_ptr, vb + 64, TV), IS_BF16)
        vz3 = to_f32(token_vector(v_zero_ptr, vb + 96, TV), IS_BF16)
        if MAGIC:
            w0 = (p0 * vs0[:, None]).to(DOT)
            w1 = (p1 * vs1[:, None]).to(DOT)
            w2 = (p2 * vs2[:, None]).to(DOT)
            w3 = (p3 * vs3[:, None]).to(DOT)
        else:
            w0 = (p0 * (vs0 * QS)[:, None]).to(DOT)
            w1 = (p1 * (vs1 * (0.25 * QS))[:, None]).to(DOT)
            w2 = (p2 * (vs2 * (0.0625 * QS))[:, None]).to(DOT)
            w3 = (p3 * (vs3 * (0.015625 * QS))[:, None]).to(DOT)
        zt = (p0 * vz0[:, None] + p1 * vz1[:, None]) + (p2 * vz2[:, None] + p3 * vz3[:, None])
        az = az * alpha + gl.sum(zt, 0)
        pbuf.store(cat4(token_order(w0, PV), token_order(w1, PV), token_order(w2, PV), token_order(w3, PV)))
        pb = pbuf.load(DB)
        vrow = vpage * (D * 32)
        if MAGIC:  # the value codes' offsets' share, -sum_t off(t) w_t per column, on the tensor cores
            azo = mma_v2(offv.load(DA), pb, rescale(azo, alpha, PV))
        # the accumulators rescaled by alpha per head (rescale leaves GQA 4's zero pad columns alone), then += the
        # codes of channel chunk c (32 rows of 32 bytes) against pb
        acc0 = mma_v2(unpack_low(v_codes_ptr, vrow, 32, 32, IS_BF16, DA, False, MAGIC), pb, rescale(acc0, alpha, PV))
        a1 = rescale(acc1, alpha, PV)
        acc1 = mma_v2(unpack_low(v_codes_ptr, vrow + 32 * 32, 32, 32, IS_BF16, DA, False, MAGIC), pb, a1)
        if NCH > 2:
            a2 = rescale(acc2, alpha, PV)
            acc2 = mma_v2(unpack_low(v_codes_ptr, vrow + 64 * 32, 32, 32, IS_BF16, DA, False, MAGIC), pb, a2)
            a3 = rescale(acc3, alpha, PV)
            acc3 = mma_v2(unpack_low(v_codes_ptr, vrow + 96 * 32, 32, 32, IS_BF16, DA, False, MAGIC), pb, a3)
    # ---- the split's product as one (D, NV) tile in output units
    if NCH > 2:
        acc_q = cat4(acc0, acc1, acc2, acc3)
    else:
        acc_q = gl.reshape(gl.permute(gl.join(acc0, acc1), [2, 0, 1]), [D, NV])
    if not MAGIC:
        acc_q = acc_q * INV_UNIT
    LO: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, 1], [0, 1])
    # ---- the split's partial: (m, l, zero term) per head, (BH, D) product; merged in two levels: the last program
    # of each group of MERGE_GROUP splits merges the group into the group's first row, the last group merges the rows
    res = acc_q
    if PV == 2:
        res, _ = gl.split(gl.reshape(res, [D, BH, 2]))  # the zero columns beside each head dropped
    res = gl.convert_layout(res, LO)
    hv = gl.arange(0, BH, LH)
    row = pid_bh * NUM_SPLITS + split
    gl.store(ws_m_ptr + row * BH + hv, m_i)
    gl.store(ws_l_ptr + row * BH + hv, l_i)
    if MAGIC:  # one row of the value offsets' share, its head columns, added to the zero term
        azh = gl.max(azo, 0)  # every row holds the same sums
        if PV == 2:
            azh, _ = gl.split(gl.reshape(azh, [BH, 2]))
        az = az + gl.convert_layout(azh, LH)
    gl.store(ws_z_ptr + row * BH + hv, az)
    dd = gl.arange(0, D, gl.SliceLayout(1, LO))
    hd = gl.arange(0, BH, gl.SliceLayout(0, LO))
    gl.store(ws_acc_ptr + row * (BH * D) + hd[None, :] * D + dd[:, None], res)
    NG = gl.cdiv(NUM_SPLITS, MERGE_GROUP)
    grp = split // MERGE_GROUP
    first = grp * MERGE_GROUP
    tickets = ticket_ptr + pid_bh * (NG + 1)
    gl.thread_barrier()
    ticket = gl.atomic_add(tickets + grp, 1, sem="acq_rel", scope="gpu")
    if ticket == gl.minimum(MERGE_GROUP, NUM_SPLITS - first) - 1:
        M, L, O = _merge_rows(
            ws_m_ptr,
            ws_l_ptr,
            ws_z_ptr,
            ws_acc_ptr,
            pid_bh * NUM_SPLITS + first,
            1,
            gl.minimum(MERGE_GROUP, NUM_SPLITS - first),
            BH,
            D,
        )
        gl.store(tickets + grp, 0)
        if NG == 1:
            _store_out(out_ptr + b64 * so_b + h * QH * so_h, so_h, QH, M, L, O, BH, D)
        else:
            _store_row(ws_m_ptr, ws_l_ptr, ws_z_ptr, ws_acc_ptr, pid_bh * NUM_SPLITS + first, M, L, O, BH, D)
            gl.thread_barrier()
            top = gl.atomic_add(tickets + NG, 1, sem="acq_rel", scope="gpu")
            if top == NG - 1:
                M, L, O = _merge_rows(
                    ws_m_ptr, ws_l_ptr, ws_z_ptr, ws_acc_ptr, pid_bh * NUM_SPLITS, MERGE_GROUP, NG, BH, D
                )
                _store_out(out_ptr + b64 * so_b + h * QH * so_h, so_h, QH, M, L, O, BH, D)
                gl.store(tickets + NG, 0)


def decode_attention_gluon(
    q: torch.Tensor,
    state: KittyLayerState,
    cfg: KVQuantConfig,
    scaling: float | None = None,
    *,
    full_qbuffer: bool = False,
    workspace: dict[str, torch.Tensor] | None = None,
    launch: GluonLaunch | None = None,
) -> torch.Tensor:
    """The Gluon kernel (module docstring): the ``decode_attention_triton`` contract. ``ValueError`` for pages it
    was not written for (``gluon_launch.pages_supported``)."""
    z = check_state(q, state, cfg)
    B, Hq, Hkv, D = (z[k] for k in ("B", "Hq", "Hkv", "D"))
    QH = Hq // Hkv
    if not pages_supported(cfg, D, q.dtype, QH):
        raise ValueError(
            f"the Gluon kernel does not handle these pages (key_bits={cfg.key_bits}, boost_bits={cfg.boost_bits}, "
            f"value_bits={cfg.value_bits}, group_size={cfg.group_size}, head_dim={D}, dtype={q.dtype}, GQA {QH})"
        )
    scaling = 1.0 / math.sqrt(D) if scaling is None else float(scaling)
    max_pages = state.k_page_table.shape[1] + 1
    launch = launch or default_gluon_launch(B, Hkv, max_pages, q.device)
    if not 0 <= launch.tail_splits < launch.num_splits:
        raise ValueError(f"tail_splits={launch.tail_splits} must leave a page split of num_splits={launch.num_splits}")
    consts = gluon_constants(cfg, D, QH, q.dtype, launch, full_qbuffer)
    splits, group = launch.num_splits, merge_group(launch)
    shapes = gluon_workspace_shapes(B, Hq, Hkv, D, launch) | {"g_out": ((B, Hq, D), q.dtype)}
    if workspace is not None and all(
        workspace.get(name) is not None and (tuple(workspace[name].shape), workspace[name].dtype) == want
        for name, want in shapes.items()
    ):
        ws = workspace
    else:  # no workspace, or one sized for another launch: allocate (and keep in the caller's dict, if any)
        ws = gluon_workspace(q, Hkv, launch) | {"g_out": torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)}
        if workspace is not None:
            workspace.update(ws)
    ws_m, ws_l, ws_z, ws_acc, tickets, out = (ws[k] for k in (*GLUON_WORKSPACE, "g_out"))
    if q.stride(-1) != 1:
        q = q.contiguous()
    st = state
    for name in ("sink_k", "sink_v", "k_qbuf", "v_qbuf", "v_local"):  # their rows are read as 16-byte vectors
        t = getattr(st, name)
        if t.numel() and (t.data_ptr() % 16 or t.stride(-1) != 1 or t.stride(-2) != D):
            raise ValueError(f"the Gluon kernel reads {name} as 16-byte aligned rows of {D} contiguous elements")
    high = high_plane_view(st.k_high, consts["NB4"]) if consts["NB"] else st.k_low
    _decode_gluon_kernel[(B * Hkv, splits)](
        q,
        out,
        ws_m,
        ws_l,
        ws_z,
        ws_acc,
        tickets,
        st.lengths,
        st.sink_k,
        st.sink_v,
        st.k_qbuf,
        st.v_qbuf,
        st.v_local,
        st.k_page_table,
        st.v_page_table,
        st.k_low,
        high,
        st.k_boost_idx,
        st.k_scale,
        st.k_zero,
        st.v_codes,
        st.v_scale,
        st.v_zero,
        Hkv,
        QH,
        splits,
        group,
        launch.tail_splits,
        launch.chunk_cost,
        scaling * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        st.sink_k.stride(0),
        st.sink_k.stride(1),
        st.sink_v.stride(0),
        st.sink_v.stride(1),
        st.k_qbuf.stride(0),
        st.k_qbuf.stride(1),
        st.v_qbuf.stride(0),
        st.v_qbuf.stride(1),
        st.v_local.stride(0),
        st.v_local.stride(1),
        st.k_page_table.stride(0),
        st.v_page_table.stride(0),
        **consts,
        num_warps=1,
        maxnreg=launch.maxnreg,
    )
    return out
