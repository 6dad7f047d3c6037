"""Insert one decode token per row into a Kitty layer's full-precision buffers, one launch (a static step's stage 1).

A decode step brings one new key and value ``[B, Hkv, D]`` per row. Written with torch ops (``torch.where`` on slots
computed from ``lengths``) that is a few dozen small kernels per layer; this kernel does it in one launch, one
program per row that handles every KV head (``docs/ARCHITECTURE.md``, "The decode step's launches"):

    p = lengths[b]                                   # the new token's position
    p < S:   sink_k[b, :, p] = k;  sink_v[b, :, p] = v
    p >= S:  m = p - S
             k_qbuf[b, :, m % G] = k
             R > 0:  m >= R: v_qbuf[b, :, (m - R) % G] = v_local[b, :, m % R]   # the oldest local value leaves
                     v_local[b, :, m % R] = v
             R = 0:  v_qbuf[b, :, m % G] = v
    lengths[b] = p + 1

``S``, ``G`` and ``R`` are the buffers' slot counts, so the kernel needs no config. Nothing is read on the host and
the grid is ``(B,)`` at every step, so the launch can be captured in a CUDA graph. The program reads ``lengths[b]``,
and only that program writes it, after a barrier (every thread has read it by then). Torch reference:
``kernels/reference.py`` ``insert_token_ref`` (the slots of ``kitty.cache.layer.KittyLayer.write_token_slots``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["insert_token"]


@triton.jit
def _insert_kernel(
    k_ptr,
    v_ptr,
    len_ptr,
    sink_k_ptr,
    sink_v_ptr,
    k_qbuf_ptr,
    v_qbuf_ptr,
    v_local_ptr,
    Hkv,
    # strides (row, head) of the new k / v; (row, head, slot) of the buffers (channels contiguous everywhere)
    sk_b,
    sk_h,
    sv_b,
    sv_h,
    ssk_b,
    ssk_h,
    ssk_s,
    ssv_b,
    ssv_h,
    ssv_s,
    skq_b,
    skq_h,
    skq_s,
    svq_b,
    svq_h,
    svq_s,
    svl_b,
    svl_h,
    svl_s,
    S: tl.constexpr,
    G: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, D)
    ok = (h < Hkv)[:, None] & (c < D)[None, :]  # (BLOCK_H, D): the KV heads, padded to a power of two
    hh = h.to(tl.int64)[:, None]
    p = tl.load(len_ptr + b)
    pt = p + tl.zeros([BLOCK_H, D], tl.int32)  # the position as a tile: every mask below is a (BLOCK_H, D) tile
    k = tl.load(k_ptr + b * sk_b + hh * sk_h + c[None, :], mask=ok)
    v = tl.load(v_ptr + b * sv_b + hh * sv_h + c[None, :], mask=ok)
    if S > 0:
        in_sink = pt < S
        slot = tl.minimum(pt, S - 1).to(tl.int64)
        tl.store(sink_k_ptr + b * ssk_b + hh * ssk_h + slot * ssk_s + c[None, :], k, mask=ok & in_sink)
        tl.store(sink_v_ptr + b * ssv_b + hh * ssv_h + slot * ssv_s + c[None, :], v, mask=ok & in_sink)
    past = pt >= S
    m = tl.maximum(pt - S, 0)
    qslot = (m % G).to(tl.int64)
    tl.store(k_qbuf_ptr + b * skq_b + hh * skq_h + qslot * skq_s + c[None, :], k, mask=ok & past)
    if R > 0:
        lslot = (m % R).to(tl.int64)
        local = v_local_ptr + b * svl_b + hh * svl_h + lslot * svl_s + c[None, :]
        leaving = past & (m >= R)
        old = tl.load(local, mask=ok & leaving)
        vslot = (tl.maximum(m - R, 0) % G).to(tl.int64)
        tl.store(v_qbuf_ptr + b * svq_b + hh * svq_h + vslot * svq_s + c[None, :], old, mask=ok & leaving)
        tl.debug_barrier()  # every thread has read the slot's old value before any thread overwrites it
        tl.store(local, v, mask=ok & past)
    else:
        tl.store(v_qbuf_ptr + b * svq_b + hh * svq_h + qslot * svq_s + c[None, :], v, mask=ok & past)
    tl.debug_barrier()  # every thread has read lengths[b]
    tl.store(len_ptr + b, p + 1)


def _check_buffer(name: str, t: torch.Tensor, B: int, Hkv: int, D: int, dtype: torch.dtype) -> None:
    if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (B, Hkv, D) or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} [B={B}, Hkv={Hkv}, slots, D={D}], got {t.dtype} {tuple(t.shape)}")
    if t.shape[3] > 1 and t.stride(3) != 1:
        raise ValueError(f"{name} must have contiguous channels (stride 1 on the last axis), got {t.stride()}")


def insert_token(
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    k_qbuf: torch.Tensor,
    v_qbuf: torch.Tensor,
    v_local: torch.Tensor,
) -> None:
    """Write the new token of every row (``k``, ``v``: ``[B, Hkv, D]``, any row/head strides) into its sink,
    key-qbuffer and local slots at position ``lengths[b]`` and advance ``lengths`` (int32 ``[B]``) in place, in one
    launch (module docstring). Buffers as in ``docs/LAYOUT.md``: ``sink_k``/``sink_v`` ``[B, Hkv, S, D]``,
    ``k_qbuf``/``v_qbuf`` ``[B, Hkv, G, D]``, ``v_local`` ``[B, Hkv, R, D]``, in ``k.dtype``.

    The caller guarantees room: a qbuffer holds fewer than ``G`` tokens before the call (a full one was packed).
    """
    if k.dim() != 3 or v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(
            f"k and v must be [B, Hkv, D] of one dtype, got {tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}"
        )
    B, Hkv, D = k.shape
    if D & (D - 1) or D < 1:
        raise ValueError(f"k must have a power-of-two head_dim, got {D}")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"k and v must have contiguous channels, got strides {k.stride()} and {v.stride()}")
    if tuple(lengths.shape) != (B,) or lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be int32 [B={B}], got {lengths.dtype} {tuple(lengths.shape)}")
    for name, t in (
        ("sink_k", sink_k),
        ("sink_v", sink_v),
        ("k_qbuf", k_qbuf),
        ("v_qbuf", v_qbuf),
        ("v_local", v_local),
    ):
        _check_buffer(name, t, B, Hkv, D, k.dtype)
    S, G, R = sink_k.shape[2], k_qbuf.shape[2], v_local.shape[2]
    if sink_v.shape[2] != S or v_qbuf.shape[2] != G or G < 1:
        raise ValueError(
            f"sink_v must have S={S} slots and v_qbuf G={G} >= 1, got {sink_v.shape[2]} and {v_qbuf.shape[2]}"
        )
    if B == 0:
        return
    _insert_kernel[(B,)](
        k,
        v,
        lengths,
        sink_k,
        sink_v,
        k_qbuf,
        v_qbuf,
        v_local,
        Hkv,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *sink_k.stride()[:3],
        *sink_v.stride()[:3],
        *k_qbuf.stride()[:3],
        *v_qbuf.stride()[:3],
        *v_local.stride()[:3],
        S=S,
        G=G,
        R=R,
        D=D,
        BLOCK_H=triton.next_power_of_2(Hkv),
        num_warps=1 if Hkv * D <= 1024 else 4,
    )
