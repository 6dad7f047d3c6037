"""Torch reference of Kitty decode attention and the layer-state contract (no Triton needed to import this).

``KittyLayerState`` names one decoder layer's cache tensors exactly as ``docs/LAYOUT.md`` does; the cache builds it
and hands it to :func:`kernels.decode_attention` (fused Triton) or :func:`decode_attention_ref` (this file):
dequantize with ``kitty.quant`` -> position-ordered K/V per row -> softmax attention in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from kitty.config import KVQuantConfig
from kitty.memory import token_layout
from kitty.quant import KeyPage, ValuePage, dequantize_key_page, dequantize_value_page

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------------------------------ state


@dataclass
class KittyLayerState:
    """One layer's Kitty cache tensors, named exactly as in ``docs/LAYOUT.md``, plus per-row ``lengths``.

    B rows, Hkv KV heads, head_dim D, page size G, sink S, local window R, nb boosted channels, P pool pages.
    Per-row buffers may be views with any row/head strides (channels contiguous); pool tensors must be contiguous.
    Pool tensors of a side that is not quantized (``key_bits``/``value_bits`` = 16) may be empty; ``k_raw``/``v_raw``
    are needed only then.
    """

    lengths: torch.Tensor  # int32 [B]: valid tokens cached per row (the query is at position lengths[b] - 1)
    sink_k: torch.Tensor  # [B, Hkv, S, D] dtype
    sink_v: torch.Tensor  # [B, Hkv, S, D]
    k_qbuf: torch.Tensor  # [B, Hkv, G, D], slot (p - S) % G
    v_qbuf: torch.Tensor  # [B, Hkv, G, D], slot (p - S) % G
    v_local: torch.Tensor  # [B, Hkv, R, D], ring, slot (p - S) % R
    k_page_table: torch.Tensor  # int32 [B, max_pages]
    v_page_table: torch.Tensor  # int32 [B, max_pages]
    k_low: torch.Tensor  # uint8 [P, Hkv, D, G/4]
    k_high: torch.Tensor  # uint8 [P, Hkv, nb, G/4]
    k_boost_idx: torch.Tensor  # uint8 [P, Hkv, D]
    k_scale: torch.Tensor  # [P, Hkv, D] dtype
    k_zero: torch.Tensor  # [P, Hkv, D] dtype
    v_codes: torch.Tensor  # uint8 [P, Hkv, G, D * value_bits / 8]
    v_scale: torch.Tensor  # [P, Hkv, G] dtype
    v_zero: torch.Tensor  # [P, Hkv, G] dtype
    k_raw: torch.Tensor | None = None  # [P, Hkv, G, D] only for key_bits=16
    v_raw: torch.Tensor | None = None  # [P, Hkv, G, D] only for value_bits=16

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


# -------------------------------------------------------------------------------------------- torch reference


def _row_kv(state: KittyLayerState, cfg: KVQuantConfig, b: int, full_qbuffer: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-ordered keys and values ``[Hkv, n, D]`` of row ``b`` (dequantized with kitty.quant);
    ``full_qbuffer``: qbuffers hold 1..G tokens (see ``kitty.memory.token_layout``)."""
    n = int(state.lengths[b])
    lay = token_layout(cfg, n, full_qbuffer)
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    Hkv, D = state.k_qbuf.shape[1], state.k_qbuf.shape[3]
    dtype = state.k_qbuf.dtype
    empty = state.k_qbuf.new_empty(0)

    def pages(ids, raw, make, deq):
        if not len(ids):
            return state.k_qbuf.new_empty(Hkv, 0, D)
        x = raw[ids] if raw is not None and raw.numel() else deq(make(ids))  # (pages, Hkv, G, D)
        return x.transpose(0, 1).reshape(Hkv, -1, D)

    kid = state.k_page_table[b, : lay.key_pages].long()
    vid = state.v_page_table[b, : lay.value_pages].long()
    keys = pages(kid, state.k_raw if not cfg.quantizes_keys else None,
                 lambda i: KeyPage(state.k_low[i], state.k_high[i], state.k_boost_idx[i], state.k_scale[i],
                                   state.k_zero[i], empty, dtype), dequantize_key_page)
    values = pages(vid, state.v_raw if not cfg.quantizes_values else None,
                   lambda i: ValuePage(state.v_codes[i], state.v_scale[i], state.v_zero[i], empty, cfg.value_bits,
                                       dtype), dequantize_value_page)
    m = max(n - S, 0)
    mv = max(m - R, 0)
    local_slots = torch.arange(mv, m, device=keys.device) % max(R, 1)  # oldest first
    k = torch.cat([state.sink_k[b, :, : lay.sink], keys, state.k_qbuf[b, :, : lay.key_qbuffer]], 1)
    v = torch.cat([state.sink_v[b, :, : lay.sink], values, state.v_qbuf[b, :, : lay.value_qbuffer],
                   state.v_local[b][:, local_slots]], 1)
    assert k.shape[1] == n and v.shape[1] == n, (k.shape, v.shape, n)
    return k, v


def decode_attention_ref(q: torch.Tensor, state: KittyLayerState, cfg: KVQuantConfig, scaling: float | None = None,
                         upcast: bool = True, full_qbuffer: bool = False) -> torch.Tensor:
    """Torch reference of :func:`decode_attention`: ``[B, Hq, D]`` in ``q.dtype``.

    ``upcast=True``: scores, softmax and ``p @ V`` in fp32 (the specification). ``upcast=False``: the same in
    ``q.dtype`` (what a kernel in that dtype could at worst be; used for tolerances). Rows with length 0 give 0.
    ``full_qbuffer``: the state is mid-step, qbuffers hold 1..G tokens (``kitty.memory.token_layout``).
    """
    B, Hq, D = q.shape
    Hkv = state.k_qbuf.shape[1]
    scaling = 1.0 / math.sqrt(D) if scaling is None else scaling
    cdt = torch.float32 if upcast else q.dtype
    out = torch.zeros(B, Hq, D, dtype=q.dtype, device=q.device)
    for b in range(B):
        k, v = _row_kv(state, cfg, b, full_qbuffer)  # (Hkv, n, D)
        if k.shape[1] == 0:
            continue
        k = k.to(cdt).repeat_interleave(Hq // Hkv, 0)  # (Hq, n, D)
        v = v.to(cdt).repeat_interleave(Hq // Hkv, 0)
        s = torch.einsum("hd,hnd->hn", q[b].to(cdt), k) * scaling
        p = torch.softmax(s, -1)
        out[b] = torch.einsum("hn,hnd->hd", p, v).to(q.dtype)
    return out


def check_state(q: torch.Tensor, state: KittyLayerState, cfg: KVQuantConfig) -> dict:
    """Validate shapes/dtypes of ``q`` and ``state`` against ``cfg``; return the sizes. Raises ``ValueError``."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D] (one decode token per row), got shape {tuple(q.shape)}")
    B, Hq, D = q.shape
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q dtype must be one of {FLOAT_DTYPES}, got {q.dtype}")
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    kq = state.k_qbuf
    if kq.dim() != 4 or kq.shape[0] != B or kq.shape[2:] != (G, D):
        raise ValueError(f"k_qbuf must be [B={B}, Hkv, G={G}, D={D}], got {tuple(kq.shape)}")
    Hkv = kq.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    expect = {"sink_k": (B, Hkv, S, D), "sink_v": (B, Hkv, S, D), "v_qbuf": (B, Hkv, G, D), "v_local": (B, Hkv, R, D)}
    for name, shape in expect.items():
        x = getattr(state, name)
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must be {shape} per docs/LAYOUT.md, got {tuple(x.shape)}")
    for name in ("sink_k", "sink_v", "k_qbuf", "v_qbuf", "v_local"):
        x = getattr(state, name)
        if x.dtype != q.dtype or (x.numel() and x.stride(-1) != 1) or (x.shape[2] > 1 and x.stride(2) != D):
            raise ValueError(f"{name} must be {q.dtype} with contiguous (token, channel) dims, got {x.dtype} strides {x.stride()}")
    if tuple(state.lengths.shape) != (B,):
        raise ValueError(f"lengths must be [B={B}], got {tuple(state.lengths.shape)}")
    for name in ("k_page_table", "v_page_table"):
        pt = getattr(state, name)
        if pt.dim() != 2 or pt.shape[0] != B or pt.dtype != torch.int32 or (pt.numel() and pt.stride(1) != 1):
            raise ValueError(f"{name} must be int32 [B={B}, max_pages] with contiguous columns, got {pt.dtype} {tuple(pt.shape)}")
    nb = cfg.num_boosted(D)
    pool = {}
    if cfg.quantizes_keys:
        pool.update(k_low=(Hkv, D, G // 4), k_high=(Hkv, nb, G // 4), k_boost_idx=(Hkv, D), k_scale=(Hkv, D), k_zero=(Hkv, D))
    elif state.k_raw is None:
        raise ValueError("key_bits=16 needs state.k_raw [P, Hkv, G, D]")
    else:
        pool.update(k_raw=(Hkv, G, D))
    if cfg.quantizes_values:
        pool.update(v_codes=(Hkv, G, D * cfg.value_bits // 8), v_scale=(Hkv, G), v_zero=(Hkv, G))
    elif state.v_raw is None:
        raise ValueError("value_bits=16 needs state.v_raw [P, Hkv, G, D]")
    else:
        pool.update(v_raw=(Hkv, G, D))
    for name, shape in pool.items():
        x = getattr(state, name)
        if x.dim() != 4 - (len(shape) == 2) or tuple(x.shape[1:]) != shape or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous pool [P, {', '.join(map(str, shape))}], got {tuple(x.shape)}")
    return dict(B=B, Hq=Hq, Hkv=Hkv, D=D, S=S, G=G, R=R, nb=nb)


