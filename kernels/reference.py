"""Torch reference of Kitty decode attention: the specification the kernels are tested against (no Triton needed).

The kernels' torch references live here: :func:`decode_attention_ref` (the fused and unfused attention kernels),
:func:`pack_pages_ref` and :func:`pack_completed_ref` (``kernels/pack.py``).

One layer's storage (``docs/LAYOUT.md``; the contract is ``kitty/core/storage.py``) is read back in position order by
:func:`dequantize_cache` -- sink | dequantized pages (``kitty.core.quant``) | qbuffers | local ring, all rows at once --
and :func:`decode_attention_ref` runs softmax attention of one query token per row over it. The generation path's
torch backend (``kitty.cache.attention``) attends over the same :func:`dequantize_cache` output with SDPA, so
generation, the kernel tests and the benchmarks share one reading of the storage.
"""

from __future__ import annotations

import math

import torch

from kitty.core.config import KVQuantConfig
from kitty.core.memory import token_layout
from kitty.core.pages import filled_pages
from kitty.core.quant import (
    KeyPage,
    ValuePage,
    dequantize_key_page,
    dequantize_value_page,
    quantize_key_page,
    quantize_value_page,
)
from kitty.core.storage import (  # noqa: F401 (the contract, re-exported)
    FLOAT_DTYPES,
    KittyLayerState,
    check_state,
    key_page_from_storage,
    page_fields,
    value_page_from_storage,
)


def dequantize_cache(
    storage: KittyLayerState | dict[str, torch.Tensor],
    cfg: KVQuantConfig,
    new_keys: torch.Tensor | None = None,
    new_values: torch.Tensor | None = None,
    full_qbuffer: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every cached token of one layer in position order: keys, values ``[B, H, L (+T), D]`` and valid ``[B, L]``.

    ``storage``: a :class:`KittyLayerState`, or a dict of the tensors named as in ``docs/LAYOUT.md`` plus
    ``lengths`` (``KittyLayer.storage()``); ``L = max(lengths)``; column ``p`` of row ``b`` holds position ``p``
    for ``p < lengths[b]`` (zeros beyond). ``new_keys``/``new_values`` ``[B, H, T, D]``, if given, fill columns
    ``L .. L+T-1`` (saves a concatenation). ``full_qbuffer``: the storage is mid-step, qbuffers hold 1..G tokens
    (``kitty.core.memory.token_layout``). Pages are dequantized with ``kitty.core.quant`` for all rows at once; the
    result is transient.
    """
    n = storage["lengths"].tolist()
    sink_k, sink_v = storage["sink_k"], storage["sink_v"]
    B, H, S, D = sink_k.shape
    G, R = cfg.group_size, cfg.local_window
    L = max(n, default=0)
    T = 0 if new_keys is None else new_keys.shape[2]
    lay = [token_layout(cfg, x, full_qbuffer) for x in n]
    keys = sink_k.new_empty(B, H, L + T, D)
    values = sink_v.new_empty(B, H, L + T, D)
    if T:
        keys[:, :, L:] = new_keys
        values[:, :, L:] = new_values

    # pages: page j of every row covers positions S + j*G .. S + (j+1)*G - 1 (a row with fewer pages reads page 0
    # there: finite data that its own buffers overwrite below, or that the zeroed tail replaces)
    pk = max((x.key_pages for x in lay), default=0)
    if pk:
        ids = storage["k_page_table"][:, :pk].long().clamp_min(0)  # (B, pk)
        k = dequantize_key_page(key_page_from_storage(storage, ids, cfg, sink_k.dtype))  # (B, pk, H, G, D)
        keys[:, :, S : S + pk * G] = k.permute(0, 2, 1, 3, 4).reshape(B, H, pk * G, D)
    pv = max((x.value_pages for x in lay), default=0)
    if pv:
        ids = storage["v_page_table"][:, :pv].long().clamp_min(0)  # (B, pv)
        v = dequantize_value_page(value_page_from_storage(storage, ids, cfg, sink_v.dtype))  # (B, pv, H, G, D)
        values[:, :, S : S + pv * G] = v.permute(0, 2, 1, 3, 4).reshape(B, H, pv * G, D)

    for b, x in enumerate(lay):  # full-precision buffers: contiguous position ranges per row
        keys[b, :, : x.sink] = sink_k[b, :, : x.sink]
        values[b, :, : x.sink] = sink_v[b, :, : x.sink]
        k0 = S + x.key_pages * G  # key qbuffer: slot s holds position k0 + s
        keys[b, :, k0 : k0 + x.key_qbuffer] = storage["k_qbuf"][b, :, : x.key_qbuffer]
        v0 = S + x.value_pages * G  # value qbuffer: slot s holds position v0 + s
        values[b, :, v0 : v0 + x.value_qbuffer] = storage["v_qbuf"][b, :, : x.value_qbuffer]
        if x.local:  # local ring: positions [n - local, n), position p in slot (p - S) % R; at most two pieces
            first = x.tokens - x.local
            slot = (first - S) % R
            head = min(x.local, R - slot)
            values[b, :, first : first + head] = storage["v_local"][b, :, slot : slot + head]
            values[b, :, first + head : x.tokens] = storage["v_local"][b, :, : x.local - head]
        keys[b, :, x.tokens : L] = 0  # columns past this row's length: masked, but must be finite
        values[b, :, x.tokens : L] = 0
    valid = torch.arange(L, device=sink_k.device)[None, :] < storage["lengths"].to(sink_k.device)[:, None]  # (B, L)
    return keys, values, valid


def decode_attention_ref(
    q: torch.Tensor,
    state: KittyLayerState,
    cfg: KVQuantConfig,
    scaling: float | None = None,
    upcast: bool = True,
    full_qbuffer: bool = False,
) -> torch.Tensor:
    """Torch reference of :func:`kitty.kernels.decode_attention_triton` (and the unfused path): ``[B, Hq, D]`` in
    ``q.dtype``.

    ``q`` ``[B, Hq, D]``: the token at position ``lengths[b] - 1`` of each row (already in ``state``). GQA: query
    head h reads KV head ``h // (Hq / Hkv)``. ``upcast=True``: scores, softmax and ``p @ V`` in fp32 (the
    specification). ``upcast=False``: the same in ``q.dtype`` (what a kernel in that dtype could at worst be; used
    for tolerances). Rows with length 0 give 0. ``full_qbuffer``: the state is mid-step, qbuffers hold 1..G tokens.
    """
    B, Hq, D = q.shape
    Hkv = state.k_qbuf.shape[1]
    scaling = 1.0 / math.sqrt(D) if scaling is None else scaling
    cdt = torch.float32 if upcast else q.dtype
    keys, values, valid = dequantize_cache(state, cfg, full_qbuffer=full_qbuffer)  # (B, Hkv, L, D), (B, L)
    qg = q.to(cdt).view(B, Hkv, Hq // Hkv, D)  # (B, Hkv, QH, D): the GQA group of each KV head
    s = torch.einsum("bhqd,bhnd->bhqn", qg, keys.to(cdt)) * scaling
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row of length 0 has no valid column: all -inf -> 0
    out = torch.einsum("bhqn,bhnd->bhqd", p, values.to(cdt))
    return out.reshape(B, Hq, D).to(q.dtype)


def pack_pages_ref(
    cfg: KVQuantConfig,
    k_qbuf: torch.Tensor | None = None,
    v_qbuf: torch.Tensor | None = None,
    *,
    k_rows=None,
    v_rows=None,
    salt: int = 0,
    query_scale: torch.Tensor | None = None,
) -> tuple[KeyPage | None, ValuePage | None]:
    """Torch reference of ``kitty.kernels.pack_pages`` (without ``pool``): ``kitty.core.quant`` on the selected rows
    (``query_scale`` ``[N, Hkv, D]`` of those rows)."""
    kp = vp = None
    if k_qbuf is not None:
        rows = slice(None) if k_rows is None else torch.as_tensor(k_rows, device=k_qbuf.device).long()
        kp = quantize_key_page(k_qbuf[rows], cfg, salt, query_scale=query_scale)
    if v_qbuf is not None:
        rows = slice(None) if v_rows is None else torch.as_tensor(v_rows, device=v_qbuf.device).long()
        vp = quantize_value_page(v_qbuf[rows], cfg)
    return kp, vp


def pack_completed_ref(
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
    skip_idle: bool = False,
    keys: bool = True,
    values: bool = True,
) -> None:
    """Torch reference of ``kitty.kernels.pack_completed``: pack every row whose qbuffer the last token filled (a
    static layer's stage 3 on the torch backend).

    ``lengths`` int32 ``[B]`` count that token. Row b's key qbuffer filled when ``m = lengths[b] - S > 0`` and
    ``m % G == 0``: it becomes key page ``j = m // G - 1`` at pool id ``b * Wk + j`` (``Wk = k_page_table.shape[1]``)
    and ``k_page_table[b, j]`` is set to that id; values likewise with ``m - R``. All rows are quantized and the
    completed ones kept with ``torch.where``.

    ``skip_idle=False`` (CUDA): no host read, no host-to-device copy and no data-dependent shape, for every config
    (fitted ranges and every channel selection included), so that a static layer's decode step that runs this
    reference can be captured in a CUDA graph. The quantizers then run with ``sync_free=True``
    (``kitty.core.quant``): the same bytes, but the qbuffers are not checked for NaN or Inf (nor are they in the
    pack kernel; non-finite tokens give meaningless pages instead of the default quantizers' ``ValueError``). The
    random selection's scores reach the device on the first call (a warm-up step before any capture) and stay there.
    ``skip_idle=True`` (the CPU, where reading is free): return early, after one host read, when no row completed a
    page, and quantize with the default checks. ``keys`` / ``values``: the sides to pack (the other side's pool and
    table are left alone).
    """
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    n = lengths.long()
    rows = torch.arange(n.shape[0], device=n.device)
    sync_free = not skip_idle  # the quantizers without host reads (and without their finiteness check)
    for is_key, table, pool, start in ((True, k_page_table, key_pool, S), (False, v_page_table, value_pool, S + R)):
        if not (keys if is_key else values):
            continue
        width = table.shape[1]
        if width == 0:  # max_cache_len leaves no room for a page on this side
            continue
        done, j = filled_pages(n, start, G, width)  # (B,), (B,): did row b's qbuffer just fill, into page j
        if skip_idle and not bool(done.any()):
            continue
        ids = rows * width + j  # (B,) the fixed pool id of that page
        if not (cfg.quantizes_keys if is_key else cfg.quantizes_values):
            # a 16-bit side stores the qbuffer itself (what quantize_*_page returns for 16 bits) without its
            # finiteness check, which reads a flag back to the host and would end a CUDA-graph capture
            fields = {"k_raw": k_qbuf} if is_key else {"v_raw": v_qbuf}
        elif is_key:
            page = quantize_key_page(k_qbuf, cfg, salt=salt, query_scale=query_scale, sync_free=sync_free)
            fields = page_fields(page)
        else:
            fields = page_fields(quantize_value_page(v_qbuf, cfg, sync_free=sync_free))
        for name, new in fields.items():  # new: (B, Hkv, ...)
            t = pool[name]
            keep = done.view(-1, *([1] * (new.dim() - 1)))
            t[ids] = torch.where(keep, new, t[ids])
        table[rows, j] = torch.where(done, ids.to(table.dtype), table[rows, j])


def insert_token_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    k_qbuf: torch.Tensor,
    v_qbuf: torch.Tensor,
    v_local: torch.Tensor,
) -> None:
    """Torch reference of ``kitty.kernels.insert_token``: the new token of every row (``k``, ``v`` ``[B, Hkv, D]``)
    at the slots of position ``p = lengths[b]`` (sink slot ``p``; key qbuffer slot ``(p - S) % G``; local ring slot
    ``(p - S) % R``, whose old value, position ``p - R``, first moves to value qbuffer slot ``(p - R - S) % G``; no
    local window: the value goes to the value qbuffer), then ``lengths += 1`` in place. ``S``, ``G``, ``R`` are the
    buffers' slot counts. Every row is written at once with ``torch.where`` (no host read)."""
    S, G, R = sink_k.shape[2], k_qbuf.shape[2], v_local.shape[2]
    rows = torch.arange(k.shape[0], device=k.device)
    p = lengths.long()
    if S:
        slot, here = p.clamp(max=S - 1), (p < S)[:, None, None]
        sink_k[rows, :, slot] = torch.where(here, k, sink_k[rows, :, slot])
        sink_v[rows, :, slot] = torch.where(here, v, sink_v[rows, :, slot])
    m = (p - S).clamp(min=0)
    past = (p >= S)[:, None, None]
    slot = m % G
    k_qbuf[rows, :, slot] = torch.where(past, k, k_qbuf[rows, :, slot])
    if R:
        local, qslot = m % R, (m - R).clamp(min=0) % G
        leaving = past & (m >= R)[:, None, None]
        v_qbuf[rows, :, qslot] = torch.where(leaving, v_local[rows, :, local], v_qbuf[rows, :, qslot])
        v_local[rows, :, local] = torch.where(past, v, v_local[rows, :, local])
    else:
        v_qbuf[rows, :, slot] = torch.where(past, v, v_qbuf[rows, :, slot])
    lengths.add_(1)


def merge_splits_ref(
    ws_m: torch.Tensor, ws_l: torch.Tensor, ws_acc: torch.Tensor, B: int, Hkv: int, QH: int, splits: int, block_h: int
) -> torch.Tensor:
    """Torch reference of the split-K merge of ``kitty.kernels.decode_attention_triton`` (its second launch, or the
    last program of each (row, KV head) with ``Launch.merge_inside``): fp32 ``[B, Hkv * QH, D]`` from the splits'
    base-2 running maxima ``ws_m``, sums ``ws_l`` ``[B * Hkv * splits * block_h]`` and unnormalized outputs ``ws_acc``
    ``[.., D]``: ``sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s`` with ``M = max_s m_s``; rows of length 0 give 0."""
    D = ws_acc.shape[-1]
    m = ws_m.view(B, Hkv, splits, block_h)[..., :QH].float()
    l = ws_l.view(B, Hkv, splits, block_h)[..., :QH].float()
    acc = ws_acc.view(B, Hkv, splits, block_h, D)[..., :QH, :].float()
    M = m.amax(2, keepdim=True)
    M = torch.where(M > float("-inf"), M, torch.zeros_like(M))
    w = torch.exp2(m - M)  # (B, Hkv, splits, QH); empty splits weigh 0
    L = (w * l).sum(2)
    o = (w[..., None] * acc).sum(2) / torch.where(L > 0, L, torch.ones_like(L))[..., None]
    return o.reshape(B, Hkv * QH, D)
