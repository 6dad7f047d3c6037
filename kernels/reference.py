"""Torch reference of Kitty decode attention (no Triton needed to import this).

``KittyLayerState`` (the storage contract, ``kitty/storage.py``) names one decoder layer's cache tensors exactly as
``docs/LAYOUT.md`` does; the cache builds it and hands it to :func:`kernels.decode_attention` (fused Triton) or
:func:`decode_attention_ref` (this file): dequantize with ``kitty.quant`` -> position-ordered K/V per row -> softmax
attention in fp32.
"""

from __future__ import annotations

import math

import torch

from kitty.config import KVQuantConfig
from kitty.memory import token_layout
from kitty.quant import KeyPage, ValuePage, dequantize_key_page, dequantize_value_page
from kitty.storage import FLOAT_DTYPES, KittyLayerState, check_state  # noqa: F401 (the contract, re-exported)


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
