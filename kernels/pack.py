"""Quantize + pack full qbuffers into Kitty pages in one launch (paper §4.2 "Step (3): quantization and packing").

When a row's key (or value) qbuffer holds ``G`` tokens, the paper quantizes it with a Triton kernel and packs it into
one page (Fig. 3). This kernel does that for every full qbuffer of a layer at once: all listed batch rows and all
KV heads, keys and values, in a single launch. It is bit-identical to the torch reference in ``kitty.core.quant``:

    key page   (per channel, §3.2–3.3):  ``quantize_key_page``    -> low / high / boost_idx / scale / zero
    value page (per token, KIVI-style):  ``quantize_value_page``  -> codes / scale / zero

Algorithm, per (page, KV head), keys or values (the program id picks the branch, no per-element branching). Every
plane packs along the axis attention reduces over (``docs/LAYOUT.md``): a row of ``n`` codes is
4 quarters of ``n/4``, quarter ``s`` at bits ``2s`` of the row's ``n/4`` bytes (4-bit value codes: 2 halves):

    x      = qbuf[row, head]                              # (G, D) tokens x channels
    # keys: importance and top-k boost selection (§3.3)
    s[c]   = mean_t |x[t, c]|                              # channel importance
    rank[c]= #{c' : s[c'] > s[c]} + #{c' < c : s[c'] == s[c]}   # ties -> lower channel index first
    boost  = rank < nb ;  slot[c] = #{c' < c : boost[c']}  # compact high-plane slot, ascending channel index
    levels = boost ? 15 : 3
    # min-max over tokens, scale rounded UP to the next 16-bit value (kitty.core.ranges.minmax_params)
    zero   = min_t x ;  scale = roundup16((max_t x - zero) / levels)   (a range past fp32: max/levels - zero/levels)
    code   = clamp(floor((x - zero) / scale + 1/2), 0, levels)          # (G, D)
    low[t, j]       = OR_s (code[t, s*D/4 + j] & 3) << 2s              # (G, D/4), token-major
    chan[k]         = the boosted channel with slot k                  # k < nb
    high[t, j]      = OR_s (code[t, chan[s*nq + j]] >> 2) << 2s        # (G, nq), nq = ceil(nb/4); slots >= nb: 0
    boost_idx[c]    = boost ? slot : 255
    # values: min-max per token (over channels), codes packed along tokens, channel-major, PER = 8 / bits:
    codes[c, i]     = OR_e code[e*G/PER + i, c] << (bits * e)          # (D, G/PER)

Programs: a page is spread over ``KSPLIT`` (keys) or ``VSPLIT`` (values) programs of the same launch (``splits``,
default ``pack_splits``). A key program computes ``s``, the selection and the min-max of every channel over all ``G``
tokens (each of the page's programs the same), then the planes of its ``G / KSPLIT`` tokens; a value program packs
``G / PER / VSPLIT`` bytes of every channel's row (its tokens' statistics are its own). Both work in register tiles of
about ``PACK_TILE`` elements. The rank counts larger scores by their bits (a page with equal scores ranks again by
one int64 key per channel, the score's bits above the reversed channel index: the order above); ``slot`` is a
cumsum; ``chan[k]`` counts the channels whose running count of boosted channels is at most ``k``, and each slot's
scale / zero / reciprocal are gathered from the per-channel vectors (its tokens are read again from the qbuffer: the
same floats, so the same codes). The low plane is quantized one quarter
of the channels at a time and the value codes one bit position at a time, so that the codes of a byte meet in one
thread. Divisions are exact without IEEE division instructions where the ranges allow it (``kernels/_pack_math.py``: ``_div``, ``_reciprocal``;
other programs keep ``tl.div_rn``).

Selection other than ``"magnitude"`` (``"random"``, ``"range"``, ``"query"``, ``"oracle"``, the last two with the
rows' ``query_scale``) is computed by the torch reference's ``channel_importance`` and passed in as a ready boost mask,
so that it is the reference's choice by construction (the oracle's scores sum squared errors over tokens in torch's
order); the rest runs here.

Fitted key ranges (``key_range`` ``"fit"``, ``"fit-peak"``, constexpr ``FIT``): after the min-max statistics, the key
program replaces each channel's min-max (scale, zero) by ``kitty.core.ranges.fitted_params``' search over the page's
``G`` tokens (``kernels/_pack_fit.py``: the clipping grid, two-sided or one-sided opposite the channel's peak with the
peak guard, then ``REFINE_STEPS`` least-squares refits; each candidate rounded to the storage dtype, kept where its
squared error is lower), and quantizes with the IEEE quotient and a clamp (a clipped range's codes clamp). It runs
torch's fp32 operations one by one (compiled without FMA contraction) and sums over tokens in torch's CPU order
(chunks of 16), so the pages are ``kitty.core.quant``'s bytes: bit-identical in the tests on keys whose sums are
exact (multiples of 2**-8, as ``benchmarks/pack_speed.py`` builds them) and, measured under the interpreter on plain
random keys, 576 of 576 pages identical (4 fitted configurations x fp16/bf16, G = 32 / D = 64 and G = 128 / D =
128); the tests' documented tolerance for such keys is >= 90% identical pages and every page's reconstruction error
within 1e-3 of torch's. A fitted page packs in one key program (every program would repeat the search) of 8 warps
(sm_90, G = D = 128: 246 registers, no spills; 4 warps spill). Fitted value ranges are not packed here; a side with
a min-max range is packed whatever the other side's range.
Ties: ``torch.topk`` does not document which of equal scores it keeps; the kernel keeps the lower channel index.
Random float data has no ties; the tests plant distinct outlier channels. Near ties: the scores are fp32 sums, and
the kernel, torch (and the previous kernel) sum in different orders, so two channels whose sums differ by about an
ulp at the top-``nb`` boundary can be chosen differently (rare on real data; ``benchmarks/pack_speed.py`` uses keys
whose sums are exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kitty.core.config import KVQuantConfig
from kitty.core.quant import (
    BOOST_SENTINEL,
    KeyPage,
    ValuePage,
    channel_importance,
    high_plane_bytes,
    select_boosted,
)
from kitty.core.ranges import CLIP_GRID, REFINE_STEPS
from kitty.core.storage import allocate_pool, pool_fields

from ._pack_fit import _fit
from ._pack_math import RCP3, RCP15, _exact_range, _params, _quantize
from ._tiles import TLTYPE, check_page_layout, check_power_of_two, is_power_of_two
from .launch import (
    MAX_FIT_GROUP,
    PACK_KEY_RANGES,
    PACK_TILE,
    PACK_WARPS,
    kernel_packs_key_range,
    pack_splits,
    register_cap,
)

__all__ = ["pack_completed", "pack_pages"]


@triton.jit
def _filled_page(len_ptr, i, start, G: tl.constexpr):
    """The rule of ``kitty.core.pages.filled_page`` for row ``i`` after one new token (``lengths[i]`` counts it): did its
    qbuffer, whose first token is at position ``start`` (``S`` keys, ``S + R`` values), just fill, and which page
    ``j`` of the row it becomes (``m = lengths[i] - start``: ``m > 0``, ``m % G == 0``, ``j = m // G - 1``)."""
    m = tl.load(len_ptr + i) - start
    return (m > 0) & (m % G == 0), m // G - 1


@triton.jit
def _key_program(
    kq_ptr, k_mask_ptr, k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr,
    row, page, i, h, part, Hkv, skq_b, skq_h, skq_t,
    G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, NBQP: tl.constexpr, KEY_LEVELS: tl.constexpr,
    KEY_RLEVELS: tl.constexpr, USE_MASK: tl.constexpr, DTYPE: tl.constexpr, ITYPE: tl.constexpr, ROUND_UP: tl.constexpr,
    KSPLIT: tl.constexpr, TS: tl.constexpr, TQ: tl.constexpr, FIT: tl.constexpr, NGRID: tl.constexpr,
    CUT: tl.constexpr, REFINE: tl.constexpr,
):
    """Program ``part`` of ``KSPLIT`` of key page (row, head): the page's per-channel statistics over all ``G``
    tokens (every program of the page computes the same ones), then the low and high plane rows of its ``G / KSPLIT``
    tokens; program 0 also stores ``boost_idx``, ``scale`` and ``zero``."""
    D4: tl.constexpr = D // 4  # bytes of a low-plane row: channel s * D4 + j at bits 2s of byte j
    NBQ: tl.constexpr = (NB + 3) // 4  # bytes of a high-plane row: slot s * NBQ + j at bits 2s of byte j
    GP: tl.constexpr = G // KSPLIT  # tokens of this program; TS, TQ: tokens per step of the two passes
    c = tl.arange(0, D)
    kbase = kq_ptr + row * skq_b + h * skq_h
    # -- statistics over all G tokens, in steps of TS tokens: elementwise running |x| sum / min / max, reduced once
    ts = tl.arange(0, TS)
    x = tl.load(kbase + ts[:, None] * skq_t + c[None, :]).to(tl.float32)  # (TS, D) tokens x channels
    acc = tl.abs(x)
    lo = x
    hi = x
    for t0 in tl.static_range(TS, G, TS):
        x = tl.load(kbase + (t0 + ts)[:, None] * skq_t + c[None, :]).to(tl.float32)
        acc += tl.abs(x)
        lo = tl.minimum(lo, x)
        hi = tl.maximum(hi, x)
    mn = tl.min(lo, axis=0)  # (D,)
    mx = tl.max(hi, axis=0)
    # -- top-NB selection: rank by counting the channels that rank before, ties -> lower index (mean = sum / G, G a
    # power of two: the sums rank like the means). The sums are >= 0, so their bits order like them. Without equal
    # scores the rank is the count of larger scores; those counts then sum to D (D - 1) / 2, and only a page where
    # they don't (equal scores) ranks again by one int64 key per channel, the score's bits above the reversed channel
    # index, which orders channels as the rule does.
    if USE_MASK:
        boost = tl.load(k_mask_ptr + (i * Hkv + h) * D + c) != 0
    else:
        bits = tl.sum(acc, axis=0).to(tl.int32, bitcast=True)  # (D,)
        # (D, D): larger scores, counted by the sign bit of bits[c] - bits[c'] (no overflow: both are >= 0)
        rank = tl.sum(((bits[:, None] - bits[None, :]) >> 31) & 1, axis=1)
        if tl.sum(rank, axis=0) != D * (D - 1) // 2:
            key = (bits.to(tl.int64) << 16) | (D - 1 - c)
            rank = tl.sum((key[None, :] > key[:, None]).to(tl.int32), axis=1)
        boost = rank < NB
    b32 = boost.to(tl.int32)
    slot = tl.cumsum(b32, axis=0) - b32  # boosted channels before c
    levels = tl.where(boost, 15.0, KEY_LEVELS * 1.0)  # (D,)
    rlevels = tl.where(boost, RCP15, KEY_RLEVELS)
    fast = tl.min(_exact_range(mx, mn).to(tl.int32), axis=0) != 0  # every channel divides by its reciprocal
    scale_q, zero_q, scale_f, zero_f, rcp = _params(mx, mn, levels, rlevels, fast, DTYPE, ITYPE, ROUND_UP)
    if FIT != 0:  # fitted ranges (kernels/_pack_fit.py): clipped codes clamp, so quantize by the literal formula
        scale_q, zero_q = _fit(kbase, skq_t, mn, mx, levels, scale_q, zero_q, G, D, FIT == 2, NGRID, CUT, REFINE,
                               DTYPE)
        scale_f = scale_q.to(tl.float32)
        zero_f = zero_q.to(tl.float32)
        fast = fast & False
    pbase = page * Hkv + h
    if part == 0:
        tl.store(k_idx_ptr + pbase * D + c, tl.where(boost, slot, 255).to(tl.uint8))
        tl.store(k_scale_ptr + pbase * D + c, scale_q)
        tl.store(k_zero_ptr + pbase * D + c, zero_q)
    # -- this program's tokens, TQ at a time: the low plane (a token's D codes as 4 quarters of D/4 channels, quarter
    # s at bits 2s), each quarter loaded and quantized on its own so that the 4 codes of a byte meet in one thread;
    # the high plane likewise by quarter of its slots
    q0, q1, q2, q3 = _quarters(tl.join(tl.join(zero_f, scale_f), tl.join(rcp, levels)), D4)  # (D4, 2, 2) each
    z0, s0, r0, l0 = _params4(q0)
    z1, s1, r1, l1 = _params4(q1)
    z2, s2, r2, l2 = _params4(q2)
    z3, s3, r3, l3 = _params4(q3)
    if NB > 0:
        cum = slot + b32  # boosted channels up to and including c
        c0, v0, hs0, hz0, hr0 = _slot_params(cum, 0, scale_f, zero_f, rcp, D, NB, NBQ, NBQP)
        c1, v1, hs1, hz1, hr1 = _slot_params(cum, 1, scale_f, zero_f, rcp, D, NB, NBQ, NBQP)
        c2, v2, hs2, hz2, hr2 = _slot_params(cum, 2, scale_f, zero_f, rcp, D, NB, NBQ, NBQP)
        c3, v3, hs3, hz3, hr3 = _slot_params(cum, 3, scale_f, zero_f, rcp, D, NB, NBQ, NBQP)
        jq = tl.arange(0, NBQP)
    tq = tl.arange(0, TQ)
    jd = tl.arange(0, D4)
    for t0 in tl.static_range(0, GP, TQ):
        t = part * GP + t0 + tq
        rows = kbase + t[:, None] * skq_t
        low = _low_bits(rows + jd[None, :], z0, s0, r0, l0, fast, 0)  # (TQ, D4)
        low |= _low_bits(rows + (D4 + jd)[None, :], z1, s1, r1, l1, fast, 2)
        low |= _low_bits(rows + (2 * D4 + jd)[None, :], z2, s2, r2, l2, fast, 4)
        low |= _low_bits(rows + (3 * D4 + jd)[None, :], z3, s3, r3, l3, fast, 6)
        tl.store(k_low_ptr + pbase * (G * D4) + t[:, None] * D4 + jd[None, :], low.to(tl.uint8))
        if NB > 0:
            high = _high_bits(rows, c0, v0, hs0, hz0, hr0, fast, 0)  # (TQ, NBQP)
            high |= _high_bits(rows, c1, v1, hs1, hz1, hr1, fast, 2)
            high |= _high_bits(rows, c2, v2, hs2, hz2, hr2, fast, 4)
            high |= _high_bits(rows, c3, v3, hs3, hz3, hr3, fast, 6)
            tl.store(k_high_ptr + pbase * (G * NBQ) + t[:, None] * NBQ + jq[None, :], high.to(tl.uint8),
                     mask=(jq < NBQ)[None, :])


@triton.jit
def _quarters(v, D4: tl.constexpr):
    """The 4 quarters of a ``(4 * D4, 2, 2)`` tensor: ``v[s * D4 + j]`` is element ``j`` of quarter ``s``."""
    w = tl.permute(tl.reshape(v, (4, D4, 2, 2)), (1, 2, 3, 0))  # (D4, 2, 2, 4)
    lo, hi = tl.split(tl.reshape(w, (D4, 2, 2, 2, 2)))  # [j, ., ., a, b]: quarter 2a + b
    v0, v2 = tl.split(lo)
    v1, v3 = tl.split(hi)
    return v0, v1, v2, v3


@triton.jit
def _params4(q):
    """The 4 vectors joined as ``join(join(a, b), join(c, d))``."""
    ab, cd = tl.split(q)
    a, b = tl.split(ab)
    c, d = tl.split(cd)
    return a, b, c, d


@triton.jit
def _low_bits(ptrs, zero, scale, rcp, levels, fast, SHIFT: tl.constexpr):
    """The low 2 bits of the codes of the tokens x channels at ``ptrs``, shifted to bits ``SHIFT``."""
    x = tl.load(ptrs).to(tl.float32)
    return (_quantize(x, zero[None, :], scale[None, :], rcp[None, :], levels[None, :], fast) & 3) << SHIFT


@triton.jit
def _slot_params(cum, s: tl.constexpr, scale, zero, rcp, D: tl.constexpr, NB: tl.constexpr, NBQ: tl.constexpr,
                 NBQP: tl.constexpr):
    """Quarter ``s`` of the high plane's slots (slot ``s * NBQ + j`` at bits ``2s`` of byte ``j``, ``j <
    NBQP``): the boosted channel of each slot (the channels whose count ``cum`` of boosted channels up to them is at
    most the slot), whether the slot holds one (slots past ``NB`` and the tile's padding hold code 0), and its scale,
    zero and reciprocal gathered from the per-channel vectors."""
    jq = tl.arange(0, NBQP)
    k = s * NBQ + jq
    chan = tl.minimum(tl.sum((cum[None, :] <= k[:, None]).to(tl.int32), axis=1), D - 1)  # (NBQP,)
    live = (jq < NBQ) & (k < NB)
    return chan, live, tl.gather(scale, chan, 0), tl.gather(zero, chan, 0), tl.gather(rcp, chan, 0)


@triton.jit
def _high_bits(rows, chan, live, scale, zero, rcp, fast, SHIFT: tl.constexpr):
    """The high 2 bits of the 4-bit codes of the slots' channels (``_slot_params``) of the tokens at ``rows``
    (the tokens' rows of the qbuffer, re-read: the same floats give the same codes), shifted to bits ``SHIFT``."""
    x = tl.load(rows + chan[None, :], mask=live[None, :], other=0.0).to(tl.float32)  # (TQ, NBQP)
    code = _quantize(x, zero[None, :], scale[None, :], rcp[None, :], 15.0, fast) >> 2
    return tl.where(live[None, :], code, 0) << SHIFT


@triton.jit
def _value_program(
    vq_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr,
    vrow, vpage, vh, part, Hkv, svq_b, svq_h, svq_t,
    G: tl.constexpr, D: tl.constexpr, VBITS: tl.constexpr,
    DTYPE: tl.constexpr, ITYPE: tl.constexpr, ROUND_UP: tl.constexpr, VSPLIT: tl.constexpr, IC: tl.constexpr,
):
    """Program ``part`` of ``VSPLIT`` of value page (row, head): bytes ``i`` of ``[part * GQ / VSPLIT, (part + 1) *
    GQ / VSPLIT)`` of every channel's row, i.e. tokens ``e * GQ + i`` (statistics per token: nothing shared)."""
    PER: tl.constexpr = 8 // VBITS  # codes per byte
    GQ: tl.constexpr = G // PER  # bytes of a channel's row: token e * GQ + i at bits VBITS * e of byte i
    NI: tl.constexpr = GQ // VSPLIT  # bytes of each channel's row that this program writes, IC of them per step
    VLEVELS: tl.constexpr = (1 << VBITS) - 1
    VRLEVELS: tl.constexpr = RCP15 if VBITS == 4 else RCP3
    iq = tl.arange(0, IC)
    cv = tl.arange(0, D)
    vsrc = vq_ptr + vrow * svq_b + vh * svq_h
    vbase = vpage * Hkv + vh
    for i0 in tl.static_range(0, NI, IC):
        ib = part * NI + i0 + iq  # (IC,) bytes of a channel's row
        packed = tl.zeros((IC, D), tl.int32)
        for e in tl.static_range(PER):  # tokens e * GQ + ib: codes at bits VBITS * e of bytes ib
            tok = e * GQ + ib
            vx = tl.load(vsrc + tok[:, None] * svq_t + cv[None, :]).to(tl.float32)  # (IC, D)
            vmn = tl.min(vx, axis=1)  # (IC,): per token, over channels
            vmx = tl.max(vx, axis=1)
            vfast = tl.min(_exact_range(vmx, vmn).to(tl.int32), axis=0) != 0
            vscale_q, vzero_q, vscale_f, vzero_f, vrcp = _params(vmx, vmn, VLEVELS * 1.0, VRLEVELS, vfast, DTYPE,
                                                                  ITYPE, ROUND_UP)
            vcode = _quantize(vx, vzero_f[:, None], vscale_f[:, None], vrcp[:, None], VLEVELS * 1.0, vfast)
            packed |= vcode << (VBITS * e)
            tl.store(v_scale_ptr + vbase * G + tok, vscale_q)
            tl.store(v_zero_ptr + vbase * G + tok, vzero_q)
        tl.store(v_codes_ptr + vbase * (D * GQ) + cv[None, :] * GQ + ib[:, None], packed.to(tl.uint8))


@triton.jit
def _pack_kernel(
    # key side: qbuffer [*, Hkv, G, D], rows to pack, destination pages in the pool
    kq_ptr, k_rows_ptr, k_pages_ptr, k_mask_ptr,
    k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr,
    # value side
    vq_ptr, v_rows_ptr, v_pages_ptr,
    v_codes_ptr, v_scale_ptr, v_zero_ptr,
    # sizes; with PREDICATED, the rows' lengths, the page tables [B, width] (row b's page j is pool id b * width + j)
    # and their row strides
    n_key_progs, Hkv, len_ptr, k_pt_ptr, v_pt_ptr, k_width, v_width, spt_k, spt_v,
    # strides of the two qbuffers (row, head, token); channels are contiguous
    skq_b, skq_h, skq_t, svq_b, svq_h, svq_t,
    # meta-parameters; NBQP: ceil(NB / 4) rounded up to a power of two (the high plane's byte tile width)
    G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, NBQP: tl.constexpr, KEY_LEVELS: tl.constexpr,
    VBITS: tl.constexpr, USE_MASK: tl.constexpr,
    DTYPE: tl.constexpr, ITYPE: tl.constexpr, ROUND_UP: tl.constexpr,
    PREDICATED: tl.constexpr = False, S: tl.constexpr = 0, R: tl.constexpr = 0,
    # programs per key page / per value page; tokens per step of a key program's two passes, bytes of a channel's
    # row per step of a value program (_steps)
    KSPLIT: tl.constexpr = 1, VSPLIT: tl.constexpr = 1, TS: tl.constexpr = 1, TQ: tl.constexpr = 1,
    IC: tl.constexpr = 1,
    # key ranges: 0 min-max, 1 "fit", 2 "fit-peak" (kernels/_pack_fit.py: grid size, cut limit, refits)
    FIT: tl.constexpr = 0, NGRID: tl.constexpr = 0, CUT: tl.constexpr = 0, REFINE: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    if pid < n_key_progs:
        # ================================================================= key page: per channel, boosted
        page_prog = pid // KSPLIT  # (row i, head h) of the page
        part = pid % KSPLIT
        i = page_prog // Hkv
        h = page_prog % Hkv
        if PREDICATED:  # programs (row i, head h, part) of every row: only a row whose key qbuffer just filled packs
            done, j = _filled_page(len_ptr, i, S, G)
            if (done == 0) | (j >= k_width):  # past the row's last page (past max_cache_len): write nothing
                return
            row = i.to(tl.int64)
            page = (i * k_width + j).to(tl.int64)
            if page_prog % Hkv + part == 0:  # the page-table entry, once per row
                tl.store(k_pt_ptr + i * spt_k + j, page.to(tl.int32))
        else:
            row = tl.load(k_rows_ptr + i).to(tl.int64)
            page = tl.load(k_pages_ptr + i).to(tl.int64)
        _key_program(kq_ptr, k_mask_ptr, k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr,
                     row, page, i, h, part, Hkv, skq_b, skq_h, skq_t,
                     G, D, NB, NBQP, KEY_LEVELS, RCP15 if KEY_LEVELS == 15 else RCP3, USE_MASK, DTYPE, ITYPE,
                     ROUND_UP, KSPLIT, TS, TQ, FIT, NGRID, CUT, REFINE)
    else:
        # ================================================================= value page: per token
        vprog = (pid - n_key_progs) // VSPLIT
        vpart = (pid - n_key_progs) % VSPLIT
        vi = vprog // Hkv
        vh = vprog % Hkv
        if PREDICATED:  # likewise for a value qbuffer (filled once R more tokens came)
            vdone, vj = _filled_page(len_ptr, vi, S + R, G)
            if (vdone == 0) | (vj >= v_width):
                return
            vrow = vi.to(tl.int64)
            vpage = (vi * v_width + vj).to(tl.int64)
            if vh + vpart == 0:
                tl.store(v_pt_ptr + vi * spt_v + vj, vpage.to(tl.int32))
        else:
            vrow = tl.load(v_rows_ptr + vi).to(tl.int64)
            vpage = tl.load(v_pages_ptr + vi).to(tl.int64)
        _value_program(vq_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr, vrow, vpage, vh, vpart, Hkv, svq_b, svq_h, svq_t,
                       G, D, VBITS, DTYPE, ITYPE, ROUND_UP, VSPLIT, IC)


_ITYPE = {torch.float16: tl.int16, torch.bfloat16: tl.int16, torch.float32: tl.int32}


def _boost_mask(cfg: KVQuantConfig, k: torch.Tensor | None, nb: int, salt: int, query_scale: torch.Tensor | None,
                u8: dict, sync_free: bool = False) -> torch.Tensor:
    """The boost mask uint8 ``[N, Hkv, D]`` that ``kitty.core.quant.quantize_key_page`` picks for keys ``k``, for the
    selections the kernel does not rank itself (all but ``"magnitude"``: ``"random"``, ``"range"``, ``"query"``,
    ``"oracle"``), computed by the same torch function; empty where the kernel ranks (or nothing is to choose).
    ``sync_free``: no host read (the oracle's error sums, ``kitty.core.quant``), the same mask."""
    if k is None or cfg.channel_selection == "magnitude" or not 0 < nb < k.shape[-1]:
        return torch.empty(0, **u8)
    if query_scale is not None:
        query_scale = query_scale.to(k.device)
    scores = channel_importance(k, cfg, salt, query_scale, sync_free=sync_free)
    return select_boosted(scores, nb).to(torch.uint8).contiguous()


_FITS = {"minmax": 0, "fit": 1, "fit-peak": 2}


def _grid_steps() -> tuple[int, int]:
    """``CLIP_GRID`` as the kernel takes it: its length ``n`` (the grid must be ``i / 16`` for ``i < n``), and the
    least ``k`` whose cut ``k / 16`` reaches torch's limit ``a + b < 0.9`` (cuts of ``k`` or more are skipped)."""
    n = len(CLIP_GRID)
    if CLIP_GRID != tuple(i / 16 for i in range(n)):
        raise ValueError(f"the pack kernel's fitted ranges take a grid of i / 16, got CLIP_GRID={CLIP_GRID}")
    return n, next(k for k in range(64) if k / 16 >= 0.9)


def _fit_args(cfg: KVQuantConfig, keys: bool) -> tuple[dict, dict]:
    """The kernel's fitted-range meta-parameters for ``cfg.key_range`` (min-max where ``keys`` is false), and its
    compile options: a fitted range is compiled without FMA contraction, so that every product and sum is rounded
    on its own, as in torch on the CPU (``kernels/_pack_fit.py``)."""
    fit = _FITS[cfg.key_range] if keys else 0
    if not fit:
        return dict(FIT=0), {}
    n, cut = _grid_steps()
    return dict(FIT=fit, NGRID=n, CUT=cut, REFINE=REFINE_STEPS), dict(enable_fp_fusion=False)


def _default_splits(pages: int, G: int, value_bits: int, fit: dict) -> tuple[int, int]:
    """:func:`pack_splits`, with one program per key page where the key range is fitted: every program of a page
    would repeat the whole search, which costs far more than packing its tokens."""
    ks, vs = pack_splits(pages, G, value_bits)
    return (1 if fit["FIT"] else ks), vs


def _high_tile(nb: int) -> int:
    """Width of the kernel's high-plane byte tile: ``ceil(nb / 4)`` bytes per token, rounded up to a power of two."""
    return triton.next_power_of_2(max(high_plane_bytes(nb), 1))


def _steps(G: int, D: int, value_bits: int, ks: int, vs: int, tile: int = PACK_TILE) -> dict:
    """The kernel's step sizes for ``(ks, vs)`` programs per page: a register tile of about ``tile`` elements per
    step (tokens x channels): ``TS`` tokens per step of a key program's statistics pass, ``TQ`` of its packing
    pass, ``IC`` bytes of a channel's row per step of a value program (the tokens of one bit position of them)."""
    if not is_power_of_two(tile):
        raise ValueError(f"tile must be a power of two, got {tile}")
    per = 8 // value_bits
    rows = max(tile // D, 1)
    return dict(KSPLIT=ks, VSPLIT=vs, TS=min(G, rows), TQ=min(G // ks, rows), IC=min(G // per // vs, rows))


def _check_splits(splits, G: int, value_bits: int, fit: dict) -> tuple[int, int]:
    """``splits`` as two ints; ``ValueError`` unless they are powers of two that divide the page, with one key program
    per page where the key range is fitted: a page split over several key programs (each repeating the search)
    packed other bytes than torch on the H100 (``kitty-pro-fit``, bf16, D = 128, two key programs), while one program
    per page, the default, packed them bit-identically."""
    ks, vs = splits
    per = 8 // value_bits
    if not (is_power_of_two(ks) and is_power_of_two(vs) and ks <= G and vs <= G // per):
        raise ValueError(f"splits must be powers of two with key <= G = {G} and value <= G / {per}, got {splits}")
    if fit["FIT"] and ks != 1:
        raise ValueError(f"splits: a fitted key range packs in one key program per page, got {splits}")
    return int(ks), int(vs)


def _index(x: torch.Tensor | None, n: int, device, name: str) -> torch.Tensor:
    if x is None:
        return torch.arange(n, dtype=torch.int32, device=device)
    x = torch.as_tensor(x, device=device).to(torch.int32).contiguous()
    if x.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {tuple(x.shape)}")
    return x


def pack_pages(
    cfg: KVQuantConfig,
    k_qbuf: torch.Tensor | None = None,
    v_qbuf: torch.Tensor | None = None,
    *,
    k_rows=None,
    v_rows=None,
    pool: dict[str, torch.Tensor] | None = None,
    k_pages=None,
    v_pages=None,
    salt: int = 0,
    query_scale: torch.Tensor | None = None,
    splits: tuple[int, int] | None = None,
    num_warps: int | None = None,
    tile: int = PACK_TILE,
    maxnreg: int | None = None,
):
    """Quantize + pack full qbuffers into key and value pages with one kernel launch.

    Args:
        cfg: quantization config (key_bits 2 or 4, value_bits 2 or 4; 16-bit sides are plain copies, not handled here).
        k_qbuf, v_qbuf: ``[B, Hkv, G, D]`` full-precision qbuffers (either may be ``None``); channels contiguous.
        k_rows, v_rows: int ``[N]`` rows of the qbuffers to pack (default: all rows).
        pool: if given, pages are written into these pool tensors (docs/LAYOUT.md names: ``k_low [P, Hkv, G, D/4]``,
            ``k_high``, ``k_boost_idx``, ``k_scale``, ``k_zero``, ``v_codes``, ``v_scale``, ``v_zero``) at
            ``k_pages`` / ``v_pages`` (int ``[N]`` pool indices) and ``None`` is returned.
        salt: passed to ``channel_importance`` for ``channel_selection="random"``.
        query_scale: ``[N, Hkv, D]`` per-channel query magnitude of the packed key rows, for
            ``channel_selection="query"`` / ``"oracle"`` (as ``kitty.core.quant.quantize_key_page`` takes it).
        splits: ``(key, value)`` programs per page (default :func:`pack_splits`); num_warps: per program (default
            :data:`PACK_WARPS`); tile: elements of a register tile; maxnreg: registers per thread (default:
            the compiler's choice). They change the speed only, never the bytes.

    Returns:
        without ``pool``: ``(KeyPage | None, ValuePage | None)`` with leading dims ``[N, Hkv]``, equal bit for bit to
        ``kitty.core.quant.quantize_key_page`` / ``quantize_value_page`` of ``qbuf[rows]``.
    """
    # ---- checks
    keys = k_qbuf is not None
    check_page_layout("Triton pack", boost_bits=cfg.boost_bits if keys else 4,
                      grouped_values=v_qbuf is not None and cfg.grouped_values,
                      key_rounding=cfg.key_rounding if keys else "nearest")  # fmt: skip
    if k_qbuf is None and v_qbuf is None:
        raise ValueError("pack_pages needs k_qbuf, v_qbuf or both")
    ref = k_qbuf if k_qbuf is not None else v_qbuf
    if ref.dim() != 4:
        raise ValueError(f"qbuffers must be [B, Hkv, G, D], got shape {tuple(ref.shape)}")
    _, Hkv, G, D = ref.shape
    dtype, device = ref.dtype, ref.device
    for name, x in (("k_qbuf", k_qbuf), ("v_qbuf", v_qbuf)):
        if x is None:
            continue
        if x.shape[1:] != (Hkv, G, D) or x.dtype != dtype or x.device != device:
            raise ValueError(f"{name} must be [B, {Hkv}, {G}, {D}] {dtype} on {device}, got {tuple(x.shape)} {x.dtype} {x.device}")
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous channels (stride(-1) == 1)")
    if dtype not in TLTYPE:
        raise ValueError(f"qbuffer dtype must be one of {tuple(TLTYPE)}, got {dtype}")
    cfg.check_head_dim(D)
    if G != cfg.group_size:
        raise ValueError(f"qbuffer holds {G} tokens but cfg.group_size is {cfg.group_size}")
    check_power_of_two({"group_size": G, "head_dim": D}, 4, "Triton pack kernel")
    if v_qbuf is not None and cfg.value_range != "minmax":
        raise ValueError(f"pack_pages packs min-max value ranges; fitted ones (value_range={cfg.value_range!r}) pack with kitty.core.quant")
    if k_qbuf is not None and cfg.key_range not in PACK_KEY_RANGES:
        raise ValueError(f"pack_pages packs key ranges {PACK_KEY_RANGES}; key_range={cfg.key_range!r} packs with kitty.core.quant")
    if k_qbuf is not None and not kernel_packs_key_range(cfg.key_range, G):
        raise ValueError(f"pack_pages fits key ranges over at most {MAX_FIT_GROUP} tokens, got group_size={G}")
    if cfg.boost_profile is not None:
        raise ValueError("cfg has a per-layer boost_profile: pass the layer's config, cfg.for_layer(layer_idx)")
    if k_qbuf is not None and cfg.key_bits not in (2, 4):
        raise ValueError(f"pack_pages packs 2/4-bit keys, got key_bits={cfg.key_bits}")
    if v_qbuf is not None and cfg.value_bits not in (2, 4):
        raise ValueError(f"pack_pages packs 2/4-bit values, got value_bits={cfg.value_bits}")
    nb = cfg.num_boosted(D)
    nk = 0 if k_qbuf is None else (k_qbuf.shape[0] if k_rows is None else len(k_rows))
    nv = 0 if v_qbuf is None else (v_qbuf.shape[0] if v_rows is None else len(v_rows))
    k_rows = _index(k_rows, nk, device, "k_rows")
    v_rows = _index(v_rows, nv, device, "v_rows")
    # ---- outputs
    u8 = dict(dtype=torch.uint8, device=device)
    key_spec, value_spec = pool_fields(cfg, Hkv, D, dtype, quantized=True)
    if pool is None:
        out = {**allocate_pool(key_spec, nk, device), **allocate_pool(value_spec, nv, device)}
        k_pages, v_pages = k_rows.new_tensor(range(nk)), v_rows.new_tensor(range(nv))
    else:
        out = pool
        need = (tuple(key_spec) if nk else ()) + (tuple(value_spec) if nv else ())
        shapes = {name: shape for name, (shape, _) in {**key_spec, **value_spec}.items()}
        for name in need:
            if name not in pool:
                raise ValueError(f"pool is missing {name!r}; needs {need}")
            t = pool[name]
            if tuple(t.shape[1:]) != shapes[name] or not t.is_contiguous() or t.device != device:
                raise ValueError(f"pool[{name!r}] must be contiguous [P, {', '.join(map(str, shapes[name]))}] on {device}, got {tuple(t.shape)}")
        k_pages = _index(k_pages, nk, device, "k_pages")
        v_pages = _index(v_pages, nv, device, "v_pages")
    k_mask = _boost_mask(cfg, k_qbuf[k_rows.long()] if nk else None, nb, salt, query_scale, u8)
    use_mask = k_mask.numel() > 0
    dummy = torch.empty(1, dtype=dtype, device=device)
    kq = k_qbuf if k_qbuf is not None else dummy.view(1, 1, 1, 1)
    vq = v_qbuf if v_qbuf is not None else dummy.view(1, 1, 1, 1)
    fit, opts = _fit_args(cfg, nk > 0)
    ks, vs = _check_splits(splits or _default_splits(max(nk, nv) * Hkv, G, cfg.value_bits, fit), G, cfg.value_bits,
                           fit)  # fmt: skip
    grid = ((nk * ks + nv * vs) * Hkv,)
    if grid[0] == 0:
        return None if pool is not None else (None, None)
    _pack_kernel[grid](
        kq, k_rows, k_pages, k_mask,
        out.get("k_low", dummy), out.get("k_high", dummy), out.get("k_boost_idx", dummy),
        out.get("k_scale", dummy), out.get("k_zero", dummy),
        vq, v_rows, v_pages,
        out.get("v_codes", dummy), out.get("v_scale", dummy), out.get("v_zero", dummy),
        nk * Hkv * ks, Hkv, k_rows, k_rows, k_rows, 0, 0, 0, 0,
        kq.stride(0), kq.stride(1), kq.stride(2), vq.stride(0), vq.stride(1), vq.stride(2),
        G=G, D=D, NB=nb, NBQP=_high_tile(nb), KEY_LEVELS=(1 << cfg.key_bits) - 1, VBITS=cfg.value_bits, USE_MASK=use_mask,
        DTYPE=TLTYPE[dtype], ITYPE=_ITYPE[dtype], ROUND_UP=dtype != torch.float32, **_steps(G, D, cfg.value_bits, ks, vs, tile),
        **fit, num_warps=num_warps or PACK_WARPS, **register_cap(maxnreg), **opts,
    )
    if pool is not None:
        return None
    empty = torch.empty(0, dtype=dtype, device=device)
    kp = None if not nk else KeyPage(out["k_low"], out["k_high"], out["k_boost_idx"], out["k_scale"], out["k_zero"], empty, dtype,
                                       nb)
    vp = None if not nv else ValuePage(out["v_codes"], out["v_scale"], out["v_zero"], empty, cfg.value_bits, dtype)
    return kp, vp


def pack_completed(
    cfg: KVQuantConfig,
    lengths: torch.Tensor,
    k_qbuf: torch.Tensor,
    v_qbuf: torch.Tensor,
    key_pool: dict[str, torch.Tensor],
    value_pool: dict[str, torch.Tensor],
    k_page_table: torch.Tensor,
    v_page_table: torch.Tensor,
    salt: int = 0,
    query_scale: torch.Tensor | None = None,
    keys: bool = True,
    values: bool = True,
    scratch: dict | None = None,
    splits: tuple[int, int] | None = None,
    num_warps: int | None = None,
    tile: int = PACK_TILE,
    maxnreg: int | None = None,
) -> None:
    """Pack, in one launch, every row whose key or value qbuffer the last decode token filled (a static cache's
    stage 3: no host synchronization, the same grid at every step).

    ``scratch``: a dict kept by the caller per layer; the first call checks the arguments and stores its constant
    tensors there (the placeholder pointer, the empty boost mask), later calls with the same tensors skip the checks
    and allocate nothing (except the boost mask of a selection that torch ranks, computed from the keys each call,
    without a host read: ``kitty.core.quant``'s ``sync_free``).

    ``query_scale`` ``[B, Hkv, D]``: for ``channel_selection="query"`` / ``"oracle"``. ``keys`` / ``values``: which
    sides this launch packs (a side that ``kitty.core.quant`` must pack, e.g. fitted value ranges, is left to the caller;
    its pool and page table are not touched).

    ``lengths`` int32 ``[B]`` (counting that token); ``k_qbuf``/``v_qbuf`` ``[B, Hkv, G, D]``; pools as in
    :func:`pack_pages`, of ``B * Wk`` key and ``B * Wv`` value pages, where ``Wk``/``Wv`` are the widths of the int32
    page tables ``[B, Wk]``/``[B, Wv]``. Program (row b, head h) of the key side reads ``lengths[b]`` and returns
    unless ``m = lengths[b] - S > 0`` and ``m % G == 0``; then it packs key page ``j = m // G - 1`` at pool id
    ``b * Wk + j``. The value side likewise with ``m - R``. Completed rows get ``table[b, j] = id``.
    The completion test is the rule of ``kitty.core.pages.filled_page``, kept inline once (``_filled_page``).
    Each page is spread over ``splits = (key, value)`` programs (default :func:`pack_splits` for ``B * Hkv`` pages,
    fixed per shape, so the grid is the same at every step); ``num_warps`` per program (default :data:`PACK_WARPS`),
    ``tile`` elements per register tile, ``maxnreg`` registers per thread. Torch reference:
    ``kernels/reference.py`` ``pack_completed_ref``.
    """
    check_page_layout(  # every value qbuffer packs
        "Triton pack", cfg.boost_bits if keys else 4, cfg.grouped_values, cfg.key_rounding if keys else "nearest"
    )
    B, Hkv, G, D = k_qbuf.shape
    if tuple(v_qbuf.shape) != (B, Hkv, G, D) or v_qbuf.dtype != k_qbuf.dtype:
        raise ValueError(f"v_qbuf must be {tuple(k_qbuf.shape)} {k_qbuf.dtype}, got {tuple(v_qbuf.shape)} {v_qbuf.dtype}")
    if tuple(lengths.shape) != (B,) or lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be int32 [B={B}], got {lengths.dtype} {tuple(lengths.shape)}")
    for name, t in (("k_page_table", k_page_table), ("v_page_table", v_page_table)):
        if t.dim() != 2 or t.shape[0] != B or t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 [B={B}, width], got {t.dtype} {tuple(t.shape)}")
    wk, wv = k_page_table.shape[1], v_page_table.shape[1]
    if wk == 0 or not (keys or values):  # no page fits max_cache_len on either side (wv <= wk), or nothing to pack
        return
    scratch = {} if scratch is None else scratch
    tensors = (lengths, k_qbuf, v_qbuf, *key_pool.values(), *value_pool.values(), k_page_table, v_page_table)
    # what the checks below saw: the same tensors (storage, shape, dtype) under the same config and sides (a layer
    # whose packs are staggered alternates two selections of sides: the last few are remembered)
    seen = (cfg, keys, values, tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors))
    if seen not in scratch.get("checked", ()):
        # the config and qbuffer checks of pack_pages, on an empty selection (nothing is launched)
        none = torch.empty(0, dtype=torch.int32, device=k_qbuf.device)
        pack_pages(cfg, k_qbuf if keys else None, v_qbuf if values else None, k_rows=none, v_rows=none,
                   pool={**key_pool, **value_pool}, k_pages=none, v_pages=none, salt=salt)
        for name, pool, width, side in (("k_low", key_pool, wk, keys), ("v_codes", value_pool, wv, values)):
            if side and pool[name].shape[0] != B * width:
                raise ValueError(f"{name} must hold B * width = {B * width} pages, got {pool[name].shape[0]}")
        u8 = dict(dtype=torch.uint8, device=k_qbuf.device)
        scratch["checked"] = [*scratch.get("checked", ())[-3:], seen]
        if scratch.get("u8") != u8 or scratch["dummy"].dtype != k_qbuf.dtype:  # constants a captured step may hold
            scratch.update(u8=u8, no_mask=torch.empty(0, **u8), dummy=torch.empty(1, dtype=k_qbuf.dtype, device=k_qbuf.device))
    nb = cfg.num_boosted(D)
    if keys and cfg.channel_selection != "magnitude" and 0 < nb < D:  # torch ranks the channels: a mask per call
        k_mask = _boost_mask(cfg, k_qbuf, nb, salt, query_scale, scratch["u8"], sync_free=True)
    else:
        k_mask = scratch["no_mask"]
    use_mask = k_mask.numel() > 0
    dummy = scratch["dummy"]
    nk, nv = (B if keys else 0), (B if values and wv else 0)
    if nk + nv == 0:
        return
    kpool = key_pool if keys else {}
    vpool = value_pool if values else {}
    fit, opts = _fit_args(cfg, keys)
    ks, vs = _check_splits(splits or _default_splits(B * Hkv, G, cfg.value_bits, fit), G, cfg.value_bits, fit)
    _pack_kernel[((nk * ks + nv * vs) * Hkv,)](
        k_qbuf, lengths, lengths, k_mask,
        kpool.get("k_low", dummy), kpool.get("k_high", dummy) if nb else dummy, kpool.get("k_boost_idx", dummy),
        kpool.get("k_scale", dummy), kpool.get("k_zero", dummy),
        v_qbuf, lengths, lengths,
        vpool.get("v_codes", dummy), vpool.get("v_scale", dummy), vpool.get("v_zero", dummy),
        nk * Hkv * ks, Hkv, lengths, k_page_table, v_page_table if wv else lengths, wk, max(wv, 1), k_page_table.stride(0),
        v_page_table.stride(0),
        k_qbuf.stride(0), k_qbuf.stride(1), k_qbuf.stride(2), v_qbuf.stride(0), v_qbuf.stride(1), v_qbuf.stride(2),
        G=G, D=D, NB=nb, NBQP=_high_tile(nb), KEY_LEVELS=(1 << cfg.key_bits) - 1, VBITS=cfg.value_bits, USE_MASK=use_mask,
        DTYPE=TLTYPE[k_qbuf.dtype], ITYPE=_ITYPE[k_qbuf.dtype], ROUND_UP=k_qbuf.dtype != torch.float32,
        PREDICATED=True, S=cfg.sink_tokens, R=cfg.local_window, **_steps(G, D, cfg.value_bits, ks, vs, tile),
        **fit, num_warps=num_warps or PACK_WARPS, **register_cap(maxnreg), **opts,
    )


assert BOOST_SENTINEL == 255  # the kernel writes 255 for unboosted channels
