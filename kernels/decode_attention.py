"""Fused split-K decode attention over a Kitty cache (flash-decoding over sink | pages | qbuffers | local window).

The paper (§4.3, step 2) computes decode attention with a ``qk`` kernel, a torch softmax and an ``sv`` kernel, one
program per (batch, KV head) walking every page serially, and leaves fusion as future work. This kernel fuses it:
for each row's new query token it reads the storage of ``docs/LAYOUT.md`` directly -- the full-precision sink, the
key/value pages through the page tables (dequantized in registers by Algorithm 1, ``kernels/_tiles.py``), the key
and value qbuffers and the value local window -- and never writes scores to memory.

Algorithm (program = (row b, KV head h, split); all QH = Hq/Hkv query heads of h share every load):

    n = lengths[b];  m = max(n - S, 0);  pk = m // G (key pages);  mv = max(m - R, 0);  pv = mv // G (value pages)
    token blocks jb = 0 .. ceil(m / BLOCK_N) - 1 (BLOCK_N divides G: page j = jb // (G/BLOCK_N), offset n0 in it)
    cover positions S + jb*BLOCK_N + t; split s takes a contiguous run of them
    m_i = -inf; l_i = 0; acc = 0                                  # per query head, fp32
    if s == 0 and S > 0: attend(sink_k, sink_v, positions < min(n, S))
    for jb in run(s):                                            # three loops, no branch in the hot one
        K^T = j < pk ? Algorithm1(k_pages[k_page_table[b, j]], n0) : k_qbuf[b, h][(p - S) % G]
        V   = j < pv ? dequant(v_pages[v_page_table[b, j]], n0)  : p - S < mv ? v_qbuf[b, h][(p - S) % G]
                                                                  : v_local[b, h][(p - S) % R]
        s_  = q @ K^T * scaling / ln 2 ; masked where p >= n
        m_new = max(m_i, rowmax(s_)); p_ = 2^(s_ - m_new); alpha = 2^(m_i - m_new)
        l_i = alpha * l_i + rowsum(p_);  acc = alpha * acc + p_ @ V;  m_i = m_new
    write (m_i, l_i, acc) of the split
    reduce over splits:  out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,  M = max_s m_s

The torch reference ``decode_attention_ref`` dequantizes with ``kitty.quant``, assembles position-ordered K/V per
row and runs softmax attention in fp32 (``upcast=True``) or in the model dtype (``upcast=False``, for tolerances).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kitty.config import KVQuantConfig

from ._tiles import (
    _key_from_raw,
    _key_page_T,
    _key_scores_folded,
    _load_key_raw,
    _load_value_raw,
    _pv_folded,
    _value_from_raw,
    _value_page,
    cast_to,
)
from .reference import KittyLayerState, check_state, decode_attention_ref  # noqa: F401 (re-exported)

__all__ = ["KittyLayerState", "decode_attention", "decode_attention_ref", "decode_attention_triton", "triton_supports"]

LOG2E = 1.4426950408889634  # 1 / ln 2: softmax in base 2
_TLTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# ------------------------------------------------------------------------------------------------ the kernels


@triton.jit
def _softmax_step(s, valid, m_i, l_i):
    """Online-softmax bookkeeping for base-2 scores ``s`` (BLOCK_H, N): returns (p, alpha, m_new, l_new)."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend(q, kT, v, valid, m_i, l_i, acc, qk_scale, DOT_DTYPE: tl.constexpr):
    """One online-softmax step: scores ``q @ kT`` (BLOCK_H, N), masked by ``valid`` (N,), values ``v`` (N, D)."""
    s = tl.dot(q, kT.to(DOT_DTYPE)) * qk_scale  # (BLOCK_H, N) fp32, base-2 logits
    p, alpha, m_i, l_i = _softmax_step(s, valid, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE))
    return m_i, l_i, acc


@triton.jit
def _fp_values(vq_ptr, vl_ptr, rel, m, mv, d, G: tl.constexpr, D: tl.constexpr, R: tl.constexpr):
    """Values (BN, D) of positions S + rel (rel = p - S): v_qbuf slot rel % G where rel < mv, else v_local slot
    rel % R where rel < m; 0 elsewhere."""
    in_q = rel < mv
    v = tl.load(vq_ptr + (rel % G)[:, None] * D + d[None, :], mask=in_q[:, None], other=0.0)
    if R > 0:
        in_l = (rel >= mv) & (rel < m)
        v += tl.load(vl_ptr + (rel % R)[:, None] * D + d[None, :], mask=in_l[:, None], other=0.0)
    return v


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
    S: tl.constexpr, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, VBITS: tl.constexpr,
    KEY_RAW: tl.constexpr, VALUE_RAW: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, UNPACK_RESHAPE: tl.constexpr,
    PREFETCH: tl.constexpr, FOLD: tl.constexpr, NBP: tl.constexpr,
):
    tl.static_assert(BLOCK_N >= 16 and BLOCK_H >= 16 and D >= 16, "tl.dot needs every dimension >= 16")
    tl.static_assert(G % BLOCK_N == 0, "BLOCK_N must divide the page size")
    NPB: tl.constexpr = G // BLOCK_N  # token blocks per page
    # ---- program id -> (row, KV head, split); the split's run of token blocks
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    b64 = b.to(tl.int64)
    n = tl.load(len_ptr + b)
    m = tl.maximum(n - S, 0)
    mv = tl.maximum(m - R, 0)
    kb = (m // G) * NPB  # token blocks inside full key pages
    vb = (mv // G) * NPB  # token blocks inside full value pages (vb <= kb)
    nblk = tl.cdiv(m, BLOCK_N)
    per = tl.cdiv(nblk, NUM_SPLITS)
    start = split * per
    end = tl.minimum(start + per, nblk)
    # ---- query tile: the QH query heads of KV head h, padded to BLOCK_H rows
    r = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    tn = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + b64 * sq_b + (h * QH + r)[:, None] * sq_h + d[None, :], mask=(r < QH)[:, None], other=0.0)
    q32 = q.to(tl.float32)
    q = q.to(DOT_DTYPE)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    # ---- sink (split 0)
    if S > 0:
        if split == 0:
            if n > 0:
                ps = tl.arange(0, BLOCK_S)
                vs = (ps < S) & (ps < n)
                kT = tl.load(sink_k_ptr + b64 * ssk_b + h * ssk_h + ps[None, :] * D + d[:, None], mask=vs[None, :], other=0.0)
                v = tl.load(sink_v_ptr + b64 * ssv_b + h * ssv_h + ps[:, None] * D + d[None, :], mask=vs[:, None], other=0.0)
                m_i, l_i, acc = _attend(q, kT, v, vs, m_i, l_i, acc, qk_scale, DOT_DTYPE)
    kq_ptr = k_qbuf_ptr + b64 * skq_b + h * skq_h
    vq_ptr = v_qbuf_ptr + b64 * svq_b + h * svq_h
    vl_ptr = v_local_ptr + b64 * svl_b + h * svl_h
    # ---- blocks with a key page and a value page (the hot loop: no branches)
    stop1 = tl.minimum(end, vb)
    if FOLD and not KEY_RAW and not VALUE_RAW:
        # scale/zero folded into q and p; codes multiplied as exact integers (kernels/_tiles.py)
        for jb in range(start, stop1):
            j = jb // NPB
            n0 = (jb % NPB) * BLOCK_N
            kpage = tl.load(k_pt_ptr + b64 * spk_b + j).to(tl.int64) * Hkv + h
            vpage = tl.load(v_pt_ptr + b64 * spv_b + j).to(tl.int64) * Hkv + h
            s = _key_scores_folded(q32, k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, kpage, n0,
                                   G, BLOCK_N, D, NB, NBP, DOT_DTYPE, UNPACK_RESHAPE) * qk_scale
            p, alpha, m_i, l_i = _softmax_step(s, tn >= 0, m_i, l_i)
            acc = acc * alpha[:, None] + _pv_folded(p, v_codes_ptr, v_scale_ptr, v_zero_ptr, vpage, n0, G, BLOCK_N, D,
                                                    VBITS, DOT_DTYPE, UNPACK_RESHAPE)
    elif PREFETCH and not KEY_RAW and not VALUE_RAW:
        # software pipelining by hand: the packed bytes of block jb+1 are requested before block jb is unpacked
        # and multiplied, so two blocks of loads are in flight per program (Triton's pipeliner does not take
        # these indirect, unpacked loads)
        ok = start < stop1
        kpage = tl.load(k_pt_ptr + b64 * spk_b + start // NPB, mask=ok, other=0).to(tl.int64) * Hkv + h
        vpage = tl.load(v_pt_ptr + b64 * spv_b + start // NPB, mask=ok, other=0).to(tl.int64) * Hkv + h
        n0 = (start % NPB) * BLOCK_N
        k_lo, k_hi, k_sc, k_ze = _load_key_raw(k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, kpage, n0, ok,
                                               G, BLOCK_N, D, NB, UNPACK_RESHAPE)
        v_co, v_sc, v_ze = _load_value_raw(v_codes_ptr, v_scale_ptr, v_zero_ptr, vpage, n0, ok, G, BLOCK_N, D, VBITS,
                                           UNPACK_RESHAPE)
        for jb in range(start, stop1):
            nxt = jb + 1
            ok = nxt < stop1
            kpage = tl.load(k_pt_ptr + b64 * spk_b + nxt // NPB, mask=ok, other=0).to(tl.int64) * Hkv + h
            vpage = tl.load(v_pt_ptr + b64 * spv_b + nxt // NPB, mask=ok, other=0).to(tl.int64) * Hkv + h
            n0 = (nxt % NPB) * BLOCK_N
            k_lo2, k_hi2, k_sc2, k_ze2 = _load_key_raw(k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, kpage,
                                                       n0, ok, G, BLOCK_N, D, NB, UNPACK_RESHAPE)
            v_co2, v_sc2, v_ze2 = _load_value_raw(v_codes_ptr, v_scale_ptr, v_zero_ptr, vpage, n0, ok, G, BLOCK_N, D,
                                                  VBITS, UNPACK_RESHAPE)
            kT = _key_from_raw(k_lo, k_hi, k_sc, k_ze, BLOCK_N, D, NB, DTYPE, UNPACK_RESHAPE)
            v = _value_from_raw(v_co, v_sc, v_ze, BLOCK_N, D, VBITS, DTYPE, UNPACK_RESHAPE)
            m_i, l_i, acc = _attend(q, kT, v, tn >= 0, m_i, l_i, acc, qk_scale, DOT_DTYPE)
            k_lo, k_hi, k_sc, k_ze = k_lo2, k_hi2, k_sc2, k_ze2
            v_co, v_sc, v_ze = v_co2, v_sc2, v_ze2
    else:
        for jb in range(start, stop1):
            j = jb // NPB
            n0 = (jb % NPB) * BLOCK_N
            kpage = tl.load(k_pt_ptr + b64 * spk_b + j).to(tl.int64) * Hkv + h
            vpage = tl.load(v_pt_ptr + b64 * spv_b + j).to(tl.int64) * Hkv + h
            kT = _key_page_T(k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, k_raw_ptr, kpage, n0,
                             G, BLOCK_N, D, NB, KEY_RAW, DTYPE, UNPACK_RESHAPE)
            v = _value_page(v_codes_ptr, v_scale_ptr, v_zero_ptr, v_raw_ptr, vpage, n0, G, BLOCK_N, D, VBITS,
                            VALUE_RAW, DTYPE, UNPACK_RESHAPE)
            m_i, l_i, acc = _attend(q, kT, v, tn >= 0, m_i, l_i, acc, qk_scale, DOT_DTYPE)
    # ---- blocks with a key page, values in full precision (value qbuffer / local window)
    for jb in range(tl.maximum(start, vb), tl.minimum(end, kb)):
        j = jb // NPB
        n0 = (jb % NPB) * BLOCK_N
        kpage = tl.load(k_pt_ptr + b64 * spk_b + j).to(tl.int64) * Hkv + h
        v = _fp_values(vq_ptr, vl_ptr, jb * BLOCK_N + tn, m, mv, d, G, D, R)
        if FOLD and not KEY_RAW:
            s = _key_scores_folded(q32, k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, kpage, n0,
                                   G, BLOCK_N, D, NB, NBP, DOT_DTYPE, UNPACK_RESHAPE) * qk_scale
            p, alpha, m_i, l_i = _softmax_step(s, tn >= 0, m_i, l_i)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE))
        else:
            kT = _key_page_T(k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, k_raw_ptr, kpage, n0,
                             G, BLOCK_N, D, NB, KEY_RAW, DTYPE, UNPACK_RESHAPE)
            m_i, l_i, acc = _attend(q, kT, v, tn >= 0, m_i, l_i, acc, qk_scale, DOT_DTYPE)
    # ---- the last, partial page: keys from the key qbuffer (slot = rel % G)
    for jb in range(tl.maximum(start, kb), end):
        rel = jb * BLOCK_N + tn
        valid = rel < m
        kT = tl.load(kq_ptr + (rel % G)[None, :] * D + d[:, None], mask=valid[None, :], other=0.0)
        v = _fp_values(vq_ptr, vl_ptr, rel, m, mv, d, G, D, R)
        m_i, l_i, acc = _attend(q, kT, v, valid, m_i, l_i, acc, qk_scale, DOT_DTYPE)
    # ---- write-back of this split's partial state
    ws = (pid_bh * NUM_SPLITS + split) * BLOCK_H + r
    tl.store(ws_m_ptr + ws, m_i)
    tl.store(ws_l_ptr + ws, l_i)
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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _reg_cap(maxnreg: int | None) -> dict:
    """Launch option capping registers per thread (CUDA backend only; ignored by the interpreter)."""
    return {} if (maxnreg is None or _interpreting()) else {"maxnreg": int(maxnreg)}


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_num_splits(B: int, Hkv: int, max_blocks: int, device: torch.device, waves: int = 4) -> int:
    """Splits so that B*Hkv*splits programs fill ~``waves`` per SM, never more than the token blocks of a row."""
    want = triton.cdiv(waves * _num_sms(device), max(B * Hkv, 1))
    return max(1, min(want, max_blocks, 256))


def decode_attention_triton(q: torch.Tensor, state: KittyLayerState, cfg: KVQuantConfig, scaling: float | None = None,
                            num_splits: int | None = None, unpack_reshape: bool = True, num_warps: int | None = None,
                            num_stages: int = 1, block_n: int = 32, prefetch: bool = False,
                            maxnreg: int | None = 128, fold: bool = False) -> torch.Tensor:
    """The fused Triton kernel (see module docstring). ``q``: ``[B, Hq, D]`` -> ``[B, Hq, D]`` in ``q.dtype``.

    Tuning knobs (defaults from the H200 sweep in benchmarks/RESULTS.md): ``num_splits`` programs per (row, KV head)
    (default: enough to fill the GPU ~4 times), ``block_n`` tokens per step (divides the page), ``num_warps``,
    ``maxnreg`` (register cap per thread: more programs resident per SM, more loads in flight), ``prefetch``
    (request block i+1's bytes before computing block i), ``unpack_reshape`` (see kernels/_tiles.py), ``fold``
    (multiply the integer codes and fold scale/zero into q and p instead of dequantizing tiles; kernels/_tiles.py).
    """
    z = check_state(q, state, cfg)
    B, Hq, Hkv, D, S, G, R, nb = (z[k] for k in ("B", "Hq", "Hkv", "D", "S", "G", "R", "nb"))
    for size, what in ((G, "group_size"), (D, "head_dim")):
        if size < 16 or size & (size - 1):
            raise ValueError(f"the fused kernel needs a power-of-two {what} >= 16, got {size}")
    if cfg.quantizes_values and cfg.value_bits not in (2, 4):
        raise ValueError(f"value_bits must be 2, 4 or 16, got {cfg.value_bits}")
    scaling = 1.0 / math.sqrt(D) if scaling is None else float(scaling)
    QH = Hq // Hkv
    BLOCK_H = max(16, triton.next_power_of_2(QH))
    BLOCK_S = max(16, triton.next_power_of_2(S))
    BLOCK_N = min(block_n, G)
    if BLOCK_N < 16 or G % BLOCK_N:
        raise ValueError(f"block_n must be >= 16 and divide group_size={G}, got {block_n}")
    max_blocks = (state.k_page_table.shape[1] + 1) * (G // BLOCK_N)
    if num_warps is None:
        num_warps = 8 if BLOCK_N >= 64 else 4
    splits = num_splits or default_num_splits(B, Hkv, max_blocks, q.device)
    dev, f32 = q.device, torch.float32
    ws_m = torch.empty(B * Hkv * splits * BLOCK_H, dtype=f32, device=dev)
    ws_l = torch.empty_like(ws_m)
    ws_acc = torch.empty(B * Hkv * splits * BLOCK_H, D, dtype=f32, device=dev)
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=dev)
    if q.stride(-1) != 1:
        q = q.contiguous()
    dummy = state.k_qbuf
    st = state
    lengths = st.lengths.to(torch.int32)
    dtype = _TLTYPE[q.dtype]
    # the interpreter's tl.dot is wrong for bf16: feed it fp32 (exact for 16-bit inputs)
    dot_dtype = tl.float32 if ((_interpreting() and q.dtype == torch.bfloat16) or q.dtype == torch.float32) else dtype
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
        S=S, G=G, R=R, D=D, NB=nb, VBITS=cfg.value_bits if cfg.quantizes_values else 2,
        KEY_RAW=not cfg.quantizes_keys, VALUE_RAW=not cfg.quantizes_values, BLOCK_H=BLOCK_H, BLOCK_S=BLOCK_S,
        BLOCK_N=BLOCK_N, DTYPE=dtype, DOT_DTYPE=dot_dtype, UNPACK_RESHAPE=unpack_reshape, PREFETCH=prefetch,
        FOLD=fold, NBP=max(16, triton.next_power_of_2(max(nb, 1))), num_warps=num_warps, num_stages=num_stages, **_reg_cap(maxnreg),
    )
    _decode_reduce_kernel[(B * Hkv, QH)](
        ws_m, ws_l, ws_acc, out, Hkv, QH, splits, out.stride(0), out.stride(1),
        D=D, BLOCK_H=BLOCK_H, SPLITS_P2=triton.next_power_of_2(splits),
    )
    return out


BACKENDS = ("auto", "triton", "torch")


def triton_supports(cfg: KVQuantConfig, head_dim: int) -> bool:
    """Whether the fused kernel handles pages of ``cfg`` with ``head_dim`` channels: power-of-two group size and
    head_dim >= 16 (``tl.dot`` tiles, 4-byte aligned plane rows), 2/4/16-bit keys and values."""
    pow2 = lambda n: n >= 16 and not n & (n - 1)  # noqa: E731
    return pow2(cfg.group_size) and pow2(head_dim) and cfg.key_bits in (2, 4, 16) and cfg.value_bits in (2, 4, 16)


def decode_attention(q: torch.Tensor, state: KittyLayerState, cfg: KVQuantConfig, scaling: float | None = None,
                     backend: str = "auto", **kernel_options) -> torch.Tensor:
    """Decode attention of one new query token per row over a Kitty layer: ``[B, Hq, D]`` -> ``[B, Hq, D]``.

    ``backend="auto"`` runs the fused Triton kernel on CUDA tensors or under ``TRITON_INTERPRET=1`` when
    :func:`triton_supports` the config, else the torch reference; ``"triton"`` / ``"torch"`` force one (``"triton"``
    raises ``ValueError`` for an unsupported config). ``scaling`` defaults to ``1/sqrt(D)``. ``kernel_options``:
    tuning knobs of :func:`decode_attention_triton`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        ok = (q.is_cuda or _interpreting()) and q.dim() == 3 and triton_supports(cfg, q.shape[-1])
        backend = "triton" if ok else "torch"
    if backend == "torch":
        check_state(q, state, cfg)
        return decode_attention_ref(q, state, cfg, scaling)
    return decode_attention_triton(q, state, cfg, scaling, **kernel_options)
