"""The predicated pack kernel as it was before a page was spread over several programs (one program per page held
the whole G x D tile), kept so that ``benchmarks/pack_speed.py`` can time it against ``kernels/pack.py`` and check
that both write the same bytes. Not used by the library.

``pack_completed_old`` launches it as ``kitty.kernels.pack_completed`` did for a ``"magnitude"`` selection (the
kernel ranks the channels itself) with min-max ranges on both sides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kitty.core.config import KVQuantConfig
from kitty.kernels._pack_math import _range_scale, _roundup_to  # unchanged by the rewrite
from kitty.kernels._tiles import TLTYPE

# fmt: off


@triton.jit
def _quantize(x, zero, scale, levels):
    """``clamp(floor((x - zero) / scale + 1/2), 0, levels)`` in fp32 with IEEE division; 0 where scale == 0."""
    pos = scale > 0
    q = tl.div_rn(x - zero, tl.where(pos, scale, 1.0))
    q = tl.where(pos, q, 0.0)
    code = tl.minimum(tl.maximum(tl.floor(q + 0.5), 0.0), levels)
    return code.to(tl.int32)


@triton.jit
def _filled_page(len_ptr, i, start, G: tl.constexpr):
    """The rule of ``kitty.core.pages.filled_page`` for row ``i`` after one new token (``lengths[i]`` counts it): did
    its qbuffer, whose first token is at position ``start`` (``S`` keys, ``S + R`` values), just fill, and which page
    ``j`` of the row it becomes (``m = lengths[i] - start``: ``m > 0``, ``m % G == 0``, ``j = m // G - 1``)."""
    m = tl.load(len_ptr + i) - start
    return (m > 0) & (m % G == 0), m // G - 1


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
):
    pid = tl.program_id(0)
    if pid < n_key_progs:
        # ================================================================= key page: per channel, boosted
        D4: tl.constexpr = D // 4  # bytes of a low-plane row: channel s * D4 + j at bits 2s of byte j
        NBQ: tl.constexpr = (NB + 3) // 4  # bytes of a high-plane row: slot s * NBQ + j at bits 2s of byte j
        i = pid // Hkv
        h = pid % Hkv
        if PREDICATED:  # program (row i, head h) of every row: only a row whose key qbuffer just filled packs
            done, j = _filled_page(len_ptr, i, S, G)
            if done == 0:
                return
            row = i.to(tl.int64)
            page = (i * k_width + j).to(tl.int64)
            if h == 0:  # the page-table entry, once per row
                tl.store(k_pt_ptr + i * spt_k + j, page.to(tl.int32))
        else:
            row = tl.load(k_rows_ptr + i).to(tl.int64)
            page = tl.load(k_pages_ptr + i).to(tl.int64)
        t = tl.arange(0, G)
        c = tl.arange(0, D)
        q4 = tl.arange(0, 4)
        kbase = kq_ptr + row * skq_b + h * skq_h
        x = tl.load(kbase + t[:, None] * skq_t + c[None, :]).to(tl.float32)  # (G, D) tokens x channels
        # -- importance and top-NB selection (rank by counting larger scores, ties -> lower index)
        if USE_MASK:
            boost = tl.load(k_mask_ptr + (i * Hkv + h) * D + c) != 0
        else:
            score = tl.sum(tl.abs(x), axis=0) / G  # (D,)
            sc = score[:, None]
            so = score[None, :]
            before = (so > sc) | ((so == sc) & (c[None, :] < c[:, None]))  # (D, D): channel c' ranks before c
            rank = tl.sum(before.to(tl.int32), axis=1)
            boost = rank < NB
        slot = tl.sum(((c[None, :] < c[:, None]) & boost[None, :]).to(tl.int32), axis=1)  # boosted channels before c
        levels = tl.where(boost, 15.0, KEY_LEVELS * 1.0)  # (D,)
        # -- min-max per channel over tokens
        mn = tl.min(x, axis=0)
        mx = tl.max(x, axis=0)
        if ROUND_UP:
            scale_q = _roundup_to(_range_scale(mx, mn, levels), DTYPE, ITYPE)
        else:
            scale_q = _range_scale(mx, mn, levels).to(DTYPE)
        zero_q = mn.to(DTYPE)
        scale_f = scale_q.to(tl.float32)
        zero_f = zero_q.to(tl.float32)
        code = _quantize(x, zero_f[None, :], scale_f[None, :], levels[None, :])  # (G, D) int32
        # -- low plane: a token's row of D codes as 4 quarters of D/4 channels, quarter s at bits 2s
        quarters = tl.reshape(code & 3, (G, 4, D4))  # [t, s, j] = channel s * D4 + j
        low = tl.sum(quarters << (2 * q4)[None, :, None], axis=1)  # (G, D4), disjoint bits: sum == or
        pbase = page * Hkv + h
        jd = tl.arange(0, D4)
        tl.store(k_low_ptr + pbase * (G * D4) + t[:, None] * D4 + jd[None, :], low.to(tl.uint8))
        if NB > 0:
            # -- high plane, compact by slot: the boosted channel of each slot, its scale/zero (a one-hot pick from
            # the per-channel vectors: exact) and its tokens re-read from the qbuffer (the codes come out the same)
            jq = tl.arange(0, NBQP)
            tgt = q4[:, None] * NBQ + jq[None, :]  # (4, NBQP): the slot at bits 2s of byte jq
            live = (jq[None, :] < NBQ) & (tgt < NB)  # slots nb .. 4 * NBQ - 1 and the tile's padding hold code 0
            pick = (tgt[:, :, None] == slot[None, None, :]) & boost[None, None, :]  # (4, NBQP, D)
            chan = tl.sum(tl.where(pick, c[None, None, :], 0), axis=2)  # (4, NBQP)
            hscale = tl.sum(tl.where(pick, scale_f[None, None, :], 0.0), axis=2)
            hzero = tl.sum(tl.where(pick, zero_f[None, None, :], 0.0), axis=2)
            xh = tl.load(kbase + t[:, None, None] * skq_t + chan[None, :, :], mask=live[None, :, :],
                         other=0.0).to(tl.float32)  # (G, 4, NBQP)
            hcode = _quantize(xh, hzero[None, :, :], hscale[None, :, :], 15.0) >> 2
            hcode = tl.where(live[None, :, :], hcode, 0)
            high = tl.sum(hcode << (2 * q4)[None, :, None], axis=1)  # (G, NBQP)
            tl.store(k_high_ptr + pbase * (G * NBQ) + t[:, None] * NBQ + jq[None, :], high.to(tl.uint8),
                     mask=(jq < NBQ)[None, :])
        tl.store(k_idx_ptr + pbase * D + c, tl.where(boost, slot, 255).to(tl.uint8))
        tl.store(k_scale_ptr + pbase * D + c, scale_q)
        tl.store(k_zero_ptr + pbase * D + c, zero_q)
    else:
        # ================================================================= value page: per token
        PER: tl.constexpr = 8 // VBITS  # codes per byte
        GQ: tl.constexpr = G // PER  # bytes of a channel's row: token e * GQ + i at bits VBITS * e of byte i
        vi = (pid - n_key_progs) // Hkv
        vh = (pid - n_key_progs) % Hkv
        if PREDICATED:  # likewise for a value qbuffer (filled once R more tokens came)
            vdone, vj = _filled_page(len_ptr, vi, S + R, G)
            if vdone == 0:
                return
            vrow = vi.to(tl.int64)
            vpage = (vi * v_width + vj).to(tl.int64)
            if vh == 0:
                tl.store(v_pt_ptr + vi * spt_v + vj, vpage.to(tl.int32))
        else:
            vrow = tl.load(v_rows_ptr + vi).to(tl.int64)
            vpage = tl.load(v_pages_ptr + vi).to(tl.int64)
        e = tl.arange(0, PER)
        iq = tl.arange(0, GQ)
        cv = tl.arange(0, D)
        tok = e[:, None] * GQ + iq[None, :]  # (PER, GQ) token index
        vx = tl.load(vq_ptr + vrow * svq_b + vh * svq_h + tok[:, :, None] * svq_t + cv[None, None, :]).to(tl.float32)
        vmn = tl.min(vx, axis=2)  # (PER, GQ): per token, over channels
        vmx = tl.max(vx, axis=2)
        VLEVELS: tl.constexpr = (1 << VBITS) - 1
        vlevels = tl.full(vmx.shape, VLEVELS, tl.float32)
        if ROUND_UP:
            vscale_q = _roundup_to(_range_scale(vmx, vmn, vlevels), DTYPE, ITYPE)
        else:
            vscale_q = _range_scale(vmx, vmn, vlevels).to(DTYPE)
        vzero_q = vmn.to(DTYPE)
        vcode = _quantize(vx, vzero_q.to(tl.float32)[:, :, None], vscale_q.to(tl.float32)[:, :, None], VLEVELS * 1.0)
        packed = tl.sum(vcode << (VBITS * e)[:, None, None], axis=0)  # (GQ, D): tokens e * GQ + i of channel c
        vbase = vpage * Hkv + vh
        tl.store(v_codes_ptr + vbase * (D * GQ) + cv[None, :] * GQ + iq[:, None], packed.to(tl.uint8))
        tl.store(v_scale_ptr + vbase * G + tok, vscale_q)
        tl.store(v_zero_ptr + vbase * G + tok, vzero_q)



_ITYPE = {torch.float16: tl.int16, torch.bfloat16: tl.int16, torch.float32: tl.int32}


def pack_completed_old(cfg: KVQuantConfig, lengths, k_qbuf, v_qbuf, key_pool, value_pool, k_page_table, v_page_table):
    """One launch of the old kernel over every (row, KV head, side), predicated on ``lengths`` like
    ``kitty.kernels.pack_completed`` (magnitude selection, both sides packed)."""
    assert cfg.channel_selection == "magnitude" and cfg.key_range == cfg.value_range == "minmax"
    B, Hkv, G, D = k_qbuf.shape
    nb = cfg.num_boosted(D)
    wk, wv = k_page_table.shape[1], v_page_table.shape[1]
    dummy = k_qbuf.new_empty(1)
    _pack_kernel[(2 * B * Hkv,)](
        k_qbuf, lengths, lengths, dummy,
        key_pool["k_low"], key_pool["k_high"] if nb else dummy, key_pool["k_boost_idx"], key_pool["k_scale"],
        key_pool["k_zero"],
        v_qbuf, lengths, lengths,
        value_pool["v_codes"], value_pool["v_scale"], value_pool["v_zero"],
        B * Hkv, Hkv, lengths, k_page_table, v_page_table, wk, wv, k_page_table.stride(0), v_page_table.stride(0),
        k_qbuf.stride(0), k_qbuf.stride(1), k_qbuf.stride(2), v_qbuf.stride(0), v_qbuf.stride(1), v_qbuf.stride(2),
        G=G, D=D, NB=nb, NBQP=triton.next_power_of_2(max(-(-nb // 4), 1)), KEY_LEVELS=(1 << cfg.key_bits) - 1,
        VBITS=cfg.value_bits, USE_MASK=False, DTYPE=TLTYPE[k_qbuf.dtype], ITYPE=_ITYPE[k_qbuf.dtype],
        ROUND_UP=k_qbuf.dtype != torch.float32, PREDICATED=True, S=cfg.sink_tokens, R=cfg.local_window,
        num_warps=4,
    )
