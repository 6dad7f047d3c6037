"""The paper's unfused decode path, for comparison: ``qk`` kernel -> torch softmax -> ``sv`` kernel (§4.3, step 2).

    logits[b, hq, p] = q[b, hq] . K[b, hq // QH, p] * scaling      # qk kernel, written to memory (fp32)
    probs            = torch.softmax(logits, -1)                   # torch, reads/writes the logits again
    out[b, hq]       = sum_p probs[b, hq, p] * V[b, hq // QH, p]    # sv kernel, reads the probabilities back

It reads the same storage as the fused kernel (``docs/LAYOUT.md``) with the same device functions, so the only
difference measured is the fusion. Unlike the paper's kernels (one program per (batch, KV head) walking every page),
both kernels here are split over the sequence like the fused one: this baseline is stronger than the paper's.
Reference: :func:`kitty.kernels.decode_attention_ref` (``kernels/reference.py``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kitty.core.config import KVQuantConfig

from ._tiles import TLTYPE, _key_page_T, _value_page, check_power_of_two, fp_values, program_row
from .launch import default_num_splits, dot_dtype, register_cap
from .reference import KittyLayerState, check_state

__all__ = ["decode_attention_unfused"]


@triton.jit
def _split_blocks(m, split, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """``[start, end)``: the blocks of ``BLOCK_N`` tokens past the sink (of ``m``) that ``split`` owns."""
    nblk = tl.cdiv(m, BLOCK_N)
    per = tl.cdiv(nblk, NUM_SPLITS)
    start = split * per
    return start, tl.minimum(start + per, nblk)


@triton.jit
def _qk_kernel(
    # ---- pointers
    q_ptr, logits_ptr,
    len_ptr, sink_k_ptr, k_qbuf_ptr, k_pt_ptr,
    k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, k_raw_ptr,
    # ---- sizes and strides
    Hkv, QH, NUM_SPLITS, scaling, L_CAP,
    sq_b, sq_h, ssk_b, ssk_h, skq_b, skq_h, spk_b,
    # ---- meta-parameters
    S: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, KEY_RAW: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, UNPACK_RESHAPE: tl.constexpr,
):
    NPB: tl.constexpr = G // BLOCK_N
    pid_bh, split, b, h, b64, n, m = program_row(len_ptr, Hkv, S)
    kb = (m // G) * NPB
    start, end = _split_blocks(m, split, NUM_SPLITS, BLOCK_N)
    r = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    t = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + b64 * sq_b + (h * QH + r)[:, None] * sq_h + d[None, :], mask=(r < QH)[:, None], other=0.0)
    q = q.to(DOT_DTYPE)
    row_ptr = logits_ptr + (b64 * Hkv * QH + h * QH + r)[:, None] * L_CAP  # (BLOCK_H, 1)
    rows = (r < QH)[:, None]
    if S > 0:
        if split == 0:
            ps = tl.arange(0, BLOCK_S)
            vs = (ps < S) & (ps < n)
            kT = tl.load(sink_k_ptr + b64 * ssk_b + h * ssk_h + ps[None, :] * D + d[:, None], mask=vs[None, :], other=0.0)
            s = tl.dot(q, kT.to(DOT_DTYPE)) * scaling
            tl.store(row_ptr + ps[None, :], s, mask=rows & vs[None, :])
    for jb in range(start, tl.minimum(end, kb)):
        kpage = tl.load(k_pt_ptr + b64 * spk_b + jb // NPB).to(tl.int64) * Hkv + h
        kT = _key_page_T(k_low_ptr, k_high_ptr, k_idx_ptr, k_scale_ptr, k_zero_ptr, k_raw_ptr, kpage,
                         (jb % NPB) * BLOCK_N, G, BLOCK_N, D, NB, KEY_RAW, DTYPE, UNPACK_RESHAPE)
        s = tl.dot(q, kT.to(DOT_DTYPE)) * scaling
        tl.store(row_ptr + (S + jb * BLOCK_N + t)[None, :], s, mask=rows)
    for jb in range(tl.maximum(start, kb), end):
        rel = jb * BLOCK_N + t
        valid = rel < m
        kT = tl.load(k_qbuf_ptr + b64 * skq_b + h * skq_h + (rel % G)[None, :] * D + d[:, None], mask=valid[None, :], other=0.0)
        s = tl.dot(q, kT.to(DOT_DTYPE)) * scaling
        tl.store(row_ptr + (S + rel)[None, :], s, mask=rows & valid[None, :])


@triton.jit
def _sv_kernel(
    # ---- pointers
    probs_ptr, ws_ptr,
    len_ptr, sink_v_ptr, v_qbuf_ptr, v_local_ptr, v_pt_ptr,
    v_codes_ptr, v_scale_ptr, v_zero_ptr, v_raw_ptr,
    # ---- sizes and strides
    Hkv, QH, NUM_SPLITS, L_CAP,
    ssv_b, ssv_h, svq_b, svq_h, svl_b, svl_h, spv_b,
    # ---- meta-parameters
    S: tl.constexpr, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, VBITS: tl.constexpr,
    VALUE_RAW: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, UNPACK_RESHAPE: tl.constexpr,
):
    NPB: tl.constexpr = G // BLOCK_N
    pid_bh, split, b, h, b64, n, m = program_row(len_ptr, Hkv, S)
    mv = tl.maximum(m - R, 0)
    vb = (mv // G) * NPB
    start, end = _split_blocks(m, split, NUM_SPLITS, BLOCK_N)
    r = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    t = tl.arange(0, BLOCK_N)
    row_ptr = probs_ptr + (b64 * Hkv * QH + h * QH + r)[:, None] * L_CAP
    rows = (r < QH)[:, None]
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    if S > 0:
        if split == 0:
            ps = tl.arange(0, BLOCK_S)
            vs = (ps < S) & (ps < n)
            p = tl.load(row_ptr + ps[None, :], mask=rows & vs[None, :], other=0.0)
            v = tl.load(sink_v_ptr + b64 * ssv_b + h * ssv_h + ps[:, None] * D + d[None, :], mask=vs[:, None], other=0.0)
            acc += tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE))
    for jb in range(start, tl.minimum(end, vb)):
        vpage = tl.load(v_pt_ptr + b64 * spv_b + jb // NPB).to(tl.int64) * Hkv + h
        v = _value_page(v_codes_ptr, v_scale_ptr, v_zero_ptr, v_raw_ptr, vpage, (jb % NPB) * BLOCK_N, G, BLOCK_N, D,
                        VBITS, VALUE_RAW, DTYPE, UNPACK_RESHAPE)
        p = tl.load(row_ptr + (S + jb * BLOCK_N + t)[None, :], mask=rows, other=0.0)
        acc += tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE))
    for jb in range(tl.maximum(start, vb), end):
        rel = jb * BLOCK_N + t
        v = fp_values(v_qbuf_ptr + b64 * svq_b + h * svq_h, v_local_ptr + b64 * svl_b + h * svl_h,
                       rel, m, mv, d, G, D, R)
        p = tl.load(row_ptr + (S + rel)[None, :], mask=rows & (rel < m)[None, :], other=0.0)
        acc += tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE))
    ws = (pid_bh * NUM_SPLITS + split) * BLOCK_H + r
    tl.store(ws_ptr + ws[:, None] * D + d[None, :], acc)


def decode_attention_unfused(q: torch.Tensor, state: KittyLayerState, cfg: KVQuantConfig,
                             scaling: float | None = None, num_splits: int | None = None,
                             unpack_reshape: bool = True, num_warps: int = 4, block_n: int = 32,
                             maxnreg: int | None = 128) -> torch.Tensor:
    """Decode attention as the paper runs it: qk kernel -> torch softmax -> sv kernel. ``[B, Hq, D]`` in/out."""
    z = check_state(q, state, cfg)
    B, Hq, Hkv, D, S, G, R, nb = (z[k] for k in ("B", "Hq", "Hkv", "D", "S", "G", "R", "nb"))
    check_power_of_two({"group_size": G, "head_dim": D}, 16, "unfused kernels")
    scaling = 1.0 / math.sqrt(D) if scaling is None else float(scaling)
    QH = Hq // Hkv
    BLOCK_H = max(16, triton.next_power_of_2(QH))
    BLOCK_S = max(16, triton.next_power_of_2(S))
    BLOCK_N = min(block_n, G)
    if BLOCK_N < 16 or G % BLOCK_N:
        raise ValueError(f"block_n must be >= 16 and divide group_size={G}, got {block_n}")
    L_CAP = S + (state.k_page_table.shape[1] + 1) * G
    max_blocks = (L_CAP - S) // BLOCK_N
    splits = num_splits or default_num_splits(B, Hkv, max_blocks, q.device)
    dtype = TLTYPE[q.dtype]
    dot = TLTYPE[dot_dtype(q.dtype)]
    q = q.contiguous()
    st, dummy = state, state.k_qbuf
    lengths = st.lengths.to(torch.int32)
    grid = (B * Hkv, splits)
    # 1) qk kernel: logits to memory
    logits = torch.full((B, Hq, L_CAP), float("-inf"), dtype=torch.float32, device=q.device)
    _qk_kernel[grid](
        q, logits, lengths, st.sink_k, st.k_qbuf, st.k_page_table,
        *((st.k_low, st.k_high if nb else dummy, st.k_boost_idx, st.k_scale, st.k_zero, dummy)
          if cfg.quantizes_keys else (dummy,) * 5 + (st.k_raw,)),
        Hkv, QH, splits, scaling, L_CAP,
        q.stride(0), q.stride(1), st.sink_k.stride(0), st.sink_k.stride(1), st.k_qbuf.stride(0), st.k_qbuf.stride(1),
        st.k_page_table.stride(0),
        S=S, G=G, D=D, NB=nb, KEY_RAW=not cfg.quantizes_keys, BLOCK_H=BLOCK_H, BLOCK_S=BLOCK_S, BLOCK_N=BLOCK_N,
        DTYPE=dtype, DOT_DTYPE=dot, UNPACK_RESHAPE=unpack_reshape, num_warps=num_warps, **register_cap(maxnreg),
    )
    # 2) softmax in torch (fp32); rows of length 0 are all -inf -> NaN, zeroed
    probs = torch.softmax(logits, -1).nan_to_num_(0.0)
    # 3) sv kernel: partial sums per split, summed in torch
    ws = torch.empty(B * Hkv, splits, BLOCK_H, D, dtype=torch.float32, device=q.device)
    _sv_kernel[grid](
        probs, ws, lengths, st.sink_v, st.v_qbuf, st.v_local, st.v_page_table,
        *((st.v_codes, st.v_scale, st.v_zero, dummy) if cfg.quantizes_values else (dummy,) * 3 + (st.v_raw,)),
        Hkv, QH, splits, L_CAP,
        st.sink_v.stride(0), st.sink_v.stride(1), st.v_qbuf.stride(0), st.v_qbuf.stride(1),
        st.v_local.stride(0), st.v_local.stride(1), st.v_page_table.stride(0),
        S=S, G=G, R=R, D=D, VBITS=cfg.value_bits if cfg.quantizes_values else 2, VALUE_RAW=not cfg.quantizes_values,
        BLOCK_H=BLOCK_H, BLOCK_S=BLOCK_S, BLOCK_N=BLOCK_N, DTYPE=dtype, DOT_DTYPE=dot,
        UNPACK_RESHAPE=unpack_reshape,
        num_warps=num_warps, **register_cap(maxnreg),
    )
    out = ws.sum(1)[:, :QH].reshape(B, Hq, D)  # (B*Hkv, QH, D) -> (B, Hq, D)
    return out.to(q.dtype)
