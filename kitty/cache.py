"""KittyCache: a paged 2-bit KV cache for Hugging Face ``generate`` (paper: arXiv 2511.18643, §4.2–4.3).

Per decoder layer, per batch row, tokens live in the places of the paper's runtime pipeline
(storage names and shapes: ``docs/LAYOUT.md``; counts: :func:`kitty.memory.token_layout`)::

    keys:   sink [0, S) | key pages (G tokens each, 2-bit + boosted channels) | key qbuffer (< G, full precision)
    values: sink [0, S) | value pages (G tokens each, 2-bit per token)      | value qbuffer | local (newest R)

1. insert: new tokens enter the sink, the key qbuffer and the value local window in full precision; the oldest
   local value moves to the value qbuffer;
2. attend: ``kitty.attention`` reads sink | pages | qbuffer (| local) and the new tokens;
3. quantize: a qbuffer that holds G tokens becomes one page from the layer's page pool (``kitty.quant``); its
   pool id is appended to the row's page table and the qbuffer is cleared.

The only per-row state is ``lengths[b]``: valid tokens cached in row b. Padding is never stored, so it never enters
a page's statistics. Quantized tokens exist only as pages: no full-precision copy is kept.

How it plugs into transformers 5.x: ``KittyLayer.update`` does not store anything; it returns a :class:`PendingKV`
handle (for both keys and values) that the attention function registered as ``"kitty"`` (``kitty.attention``)
receives instead of tensors. That function knows the padding of the new tokens (from the ``"kitty"`` mask
function), attends, then calls :meth:`KittyLayer.append`. ``KittyCache`` sets ``config._attn_implementation``
to ``"kitty"``; with ordinary tensors (another cache, or none) the function falls back to SDPA.

    model, tok = kitty.load_model()
    cache = kitty.KittyCache(model.config, "kitty")
    out = model.generate(**tok(["Hello"], return_tensors="pt"), cache=cache, max_new_tokens=32)
    print(cache.token_counts(), cache.memory_report().summary())
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from . import attention as kattention
from .config import KVQuantConfig, get_preset
from .memory import MemoryReport, token_layout
from .models import kv_dims
from .quant import KeyPage, ValuePage, quantize_key_page, quantize_value_page, query_scale_from, query_statistic
from .storage import PendingKV, key_page_from_storage, page_fields, pool_fields, value_page_from_storage

BACKENDS = ("auto", "torch", "triton")
QUERY_SELECTIONS = ("query", "oracle")  # channel selections that rank channels with running query statistics
_BEAM_MESSAGE = (
    "KittyCache does not support beam search or other cache reordering (num_beams > 1, contrastive search, "
    "assisted decoding): pages are shared storage indexed per row. Use greedy decoding or sampling (num_beams=1)."
)


class PagePool:
    """Page storage of one layer, for keys or for values: tensors ``[P, ...]`` named as in ``docs/LAYOUT.md``.

    Pages are handed out in order (a bump allocator: a page is never freed alone, :meth:`reset` frees them all) and
    the tensors grow by doubling when full, never beyond ``max_pages``. Only ``[:used]`` holds live pages.
    """

    def __init__(self, fields: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device, max_pages: int | None, kind: str):
        self.fields = fields  # name -> (shape of one page, dtype)
        self.max_pages = max_pages
        self.kind = kind  # "key" or "value", for messages
        self.tensors = {name: torch.empty((0, *shape), dtype=dt, device=device) for name, (shape, dt) in fields.items()}
        self.used = 0

    @property
    def capacity(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def check(self, n: int) -> None:
        """Raise ``RuntimeError`` if ``n`` more pages would exceed ``max_pages`` (nothing is changed)."""
        if self.max_pages is not None and self.used + n > self.max_pages:
            raise RuntimeError(
                f"the {self.kind} page pool is exhausted: {self.used} pages in use, {n} more needed, "
                f"max_pages={self.max_pages}. The cache is unchanged; call cache.reset() or build it with a larger "
                "max_pages (or max_pages=None to grow on demand)."
            )

    def allocate(self, n: int) -> torch.Tensor:
        """Ids (int32 ``[n]``) of ``n`` fresh pages, growing the storage if needed."""
        self.check(n)
        need = self.used + n
        if need > self.capacity:
            new_cap = max(need, 2 * self.capacity, 4)
            if self.max_pages is not None:
                new_cap = min(new_cap, self.max_pages)
            for name, t in self.tensors.items():
                grown = t.new_empty((new_cap, *t.shape[1:]))
                grown[: self.used] = t[: self.used]
                self.tensors[name] = grown
        ids = torch.arange(self.used, need, dtype=torch.int32, device=next(iter(self.tensors.values())).device)
        self.used = need
        return ids

    def write(self, ids: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        for name, t in values.items():
            self.tensors[name][ids.long()] = t

    def in_use(self) -> dict[str, torch.Tensor]:
        return {name: t[: self.used] for name, t in self.tensors.items()}

    def reset(self) -> None:
        self.used = 0


class KittyLayer(CacheLayerMixin):
    """Kitty cache of one decoder layer: sink, qbuffers, local window, page pools and page tables.

    Storage (``B`` rows, ``H`` KV heads, ``D`` head_dim; exactly ``docs/LAYOUT.md``):

        lengths                 int32 [B]             valid tokens cached per row (padding never counted)
        sink_k, sink_v          [B, H, S, D]          positions [0, S), slot p
        k_qbuf, v_qbuf          [B, H, G, D]          slot (p - S) % G
        v_local                 [B, H, R, D]          ring, slot (p - S) % R
        key pool                k_low [P, H, D, G/4], k_high [P, H, nb, G/4], k_boost_idx [P, H, D],
                                k_scale / k_zero [P, H, D]   (or k_raw [P, H, G, D] for 16-bit keys)
        value pool              v_codes [P, H, G, D*bits/8], v_scale / v_zero [P, H, G]   (or v_raw [P, H, G, D])
        k_page_table, v_page_table   int32 [B, W]     pool id of the row's j-th page, -1 unused

    Key page ids index the key pool and value page ids the value pool (two independent pools per layer).
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cfg: KVQuantConfig, num_kv_heads: int, head_dim: int, layer_idx: int = 0, backend: str = "auto", max_pages: int | None = None):
        super().__init__()
        self.cfg, self.num_kv_heads, self.head_dim = cfg, num_kv_heads, head_dim
        self.layer_idx, self.backend, self.max_pages = layer_idx, backend, max_pages
        self.seen_tokens = 0  # columns fed so far, padding included: what transformers calls the sequence length
        self._n: list[int] = []  # CPU mirror of ``lengths``

    # ------------------------------------------------------------------------------------------------ setup

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the per-row buffers for ``B = key_states.shape[0]`` rows; page pools start empty."""
        B, H, _, D = key_states.shape
        if (H, D) != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"key_states must have {self.num_kv_heads} KV heads of head_dim {self.head_dim}, got shape {tuple(key_states.shape)}")
        cfg, dtype, device = self.cfg, key_states.dtype, key_states.device
        S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
        self.dtype, self.device = dtype, device
        self.lengths = torch.zeros(B, dtype=torch.int32, device=device)
        self._n = [0] * B
        self.sink_k = torch.zeros(B, H, S, D, dtype=dtype, device=device)
        self.sink_v = torch.zeros(B, H, S, D, dtype=dtype, device=device)
        self.k_qbuf = torch.zeros(B, H, G, D, dtype=dtype, device=device)
        self.v_qbuf = torch.zeros(B, H, G, D, dtype=dtype, device=device)
        self.v_local = torch.zeros(B, H, R, D, dtype=dtype, device=device)
        key_fields, value_fields = pool_fields(cfg, H, D, dtype)
        # Fresh pools here (the layer is empty); reset() keeps their storage for the next prompt of the same batch.
        self.key_pool = PagePool(key_fields, device, self.max_pages, "key")
        self.value_pool = PagePool(value_fields, device, self.max_pages, "value")
        self.k_page_table = torch.full((B, 0), -1, dtype=torch.int32, device=device)
        self.v_page_table = torch.full((B, 0), -1, dtype=torch.int32, device=device)
        # channel_selection="query"/"oracle": running sum of |q| ("query") or q^2 ("oracle") per (row, KV head,
        # channel) over the GQA group, and its count
        self.q_stat_sum = torch.zeros(B, H, D, dtype=torch.float32, device=device)
        self.q_count = torch.zeros(B, 1, 1, dtype=torch.float32, device=device)
        self.seen_tokens = 0
        self.is_initialized = True

    def _prepare(self, key_states: torch.Tensor) -> None:
        """Lazy init; re-init while empty if the batch size changed; refuse a new batch size once tokens are cached."""
        if key_states.dim() != 4:
            raise ValueError(f"key_states must be [B, H, T, D], got shape {tuple(key_states.shape)}")
        B = key_states.shape[0]
        if not self.is_initialized or (self.seen_tokens == 0 and (B != len(self._n) or key_states.dtype != self.dtype or key_states.device != self.device)):
            self.lazy_initialization(key_states, key_states)
        elif B != len(self._n):
            raise ValueError(f"the cache holds {len(self._n)} rows but got a batch of {B}; call cache.reset() before a new batch")
        elif key_states.dtype != self.dtype:
            raise ValueError(f"the cache holds {self.dtype} tensors but got {key_states.dtype}; call cache.reset() first")

    # -------------------------------------------------------------------------------------- transformers API

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[PendingKV, PendingKV]:
        """Hand the new keys/values ``[B, H, T, D]`` to the ``"kitty"`` attention function (nothing stored yet).

        The attention function knows the padding of the new tokens; it attends and then calls :meth:`append`.
        """
        self._prepare(key_states)
        pending = PendingKV(self, key_states, value_states)
        return pending, pending

    def get_seq_length(self) -> int:
        """Columns fed so far, padding included (transformers derives mask sizes and positions from it)."""
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the mask; the first place a forward shows the cache its new tokens."""
        if query_length == 0:  # fail here, before the model reshapes an empty tensor
            raise ValueError("got 0 new tokens: a prompt needs at least one token")
        return self.seen_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Drop every cached token; the page pools keep their storage for reuse."""
        if self.is_initialized:
            self.lengths.zero_()
            self._n = [0] * len(self._n)
            self.k_page_table = self.k_page_table[:, :0]
            self.v_page_table = self.v_page_table[:, :0]
            self.key_pool.reset()
            self.value_pool.reset()
            self.q_stat_sum.zero_()
            self.q_count.zero_()
        self.seen_tokens = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(_BEAM_MESSAGE)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError("KittyCache cannot crop: quantized pages cannot give tokens back (assisted decoding is unsupported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(_BEAM_MESSAGE)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(_BEAM_MESSAGE)

    # ---------------------------------------------------------------------------------- insertion (stages 1, 3)

    def check_append(self, valid: torch.Tensor) -> tuple[list[int], list[int]]:
        """Validate inserting the tokens marked in ``valid`` ``[B, T]``; return (old lengths, new lengths).

        Raises ``ValueError`` for zero new tokens or a row that would hold no token, ``RuntimeError`` when the page
        pool cannot take the pages these tokens fill. Nothing is changed either way.
        """
        B, T = valid.shape
        if T == 0:
            raise ValueError("got 0 new tokens: a prompt needs at least one token")
        if B != len(self._n):
            raise ValueError(f"valid must have {len(self._n)} rows, got {B}")
        n0, n1, new_key_pages, new_value_pages = self._growth(valid)
        empty = [b for b, n in enumerate(n1) if n == 0]
        if empty:
            raise ValueError(f"row(s) {empty} of the batch hold no tokens (attention_mask is all zeros): every prompt needs at least one token")
        self.key_pool.check(sum(new_key_pages))
        self.value_pool.check(sum(new_value_pages))
        return n0, n1

    def _growth(self, valid: torch.Tensor) -> tuple[list[int], list[int], list[int], list[int]]:
        """Old and new lengths per row, and the key/value pages each row completes, for inserting ``valid``."""
        counts = valid.sum(1).tolist()
        n0 = list(self._n)
        n1 = [a + c for a, c in zip(n0, counts)]
        lay0 = [token_layout(self.cfg, n) for n in n0]
        lay1 = [token_layout(self.cfg, n) for n in n1]
        new_key_pages = [b.key_pages - a.key_pages for a, b in zip(lay0, lay1)]
        new_value_pages = [b.value_pages - a.value_pages for a, b in zip(lay0, lay1)]
        return n0, n1, new_key_pages, new_value_pages

    def append_fills_page(self, valid: torch.Tensor) -> bool:
        """Whether inserting these tokens completes a key or value page in some row (stage 3 would run)."""
        _, _, new_key_pages, new_value_pages = self._growth(valid)
        return any(new_key_pages) or any(new_value_pages)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Insert the valid new tokens of every row (stage 1) and quantize every qbuffer that fills (stage 3).

        ``key_states``/``value_states``: ``[B, H, T, D]``; ``valid``: bool ``[B, T]`` (``None``: all valid), True for
        real tokens. Row b's valid tokens, in column order, take positions ``lengths[b], lengths[b] + 1, ...``.
        """
        self._prepare(key_states)
        B, H, T, D = key_states.shape
        if valid is None:
            valid = torch.ones(B, T, dtype=torch.bool)
        valid = valid.to(dtype=torch.bool)
        if T == 1 and B == len(self._n) and bool(valid.all()):  # a decode step: one token per row, vectorized
            self._append_one(key_states, value_states)
            return
        valid = valid.to(device=key_states.device)
        n0, n1 = self.check_append(valid)
        cfg = self.cfg
        S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
        lay0 = [token_layout(cfg, n) for n in n0]
        lay1 = [token_layout(cfg, n) for n in n1]
        self._grow_page_tables(max(l.key_pages for l in lay1), max(l.value_pages for l in lay1))

        key_groups, value_groups = [], []  # full qbuffers to quantize, each (pages, H, G, D)
        key_rows = []  # the row of every key page, in order
        key_dest, value_dest = [], []  # (row, first page index, number of pages)
        for b in range(B):
            a, z = n0[b], n1[b]
            if z == a:
                continue
            cols = valid[b].nonzero().flatten()
            kb, vb = key_states[b][:, cols], value_states[b][:, cols]  # (H, z - a, D): positions a .. z-1
            l0, l1 = lay0[b], lay1[b]
            # sink: positions [a, min(z, S))
            if a < S:
                e = min(z, S)
                self.sink_k[b, :, a:e] = kb[:, : e - a]
                self.sink_v[b, :, a:e] = vb[:, : e - a]
            if z <= S:
                continue
            new_k, new_v = kb[:, max(S - a, 0) :], vb[:, max(S - a, 0) :]  # new tokens past the sink
            # keys past the last key page, in position order: old qbuffer then new tokens
            k_stream = torch.cat([self.k_qbuf[b, :, : l0.key_qbuffer], new_k], dim=1)  # (H, z - S - pk0*G, D)
            full = (l1.key_pages - l0.key_pages) * G
            if full:
                key_groups.append(k_stream[:, :full].reshape(H, -1, G, D).transpose(0, 1))  # (pages, H, G, D)
                key_dest.append((b, l0.key_pages, l1.key_pages - l0.key_pages))
                key_rows.extend([b] * (l1.key_pages - l0.key_pages))
            self.k_qbuf[b, :, : l1.key_qbuffer] = k_stream[:, full:]
            # values past the last value page: old qbuffer, old local window (oldest first), new tokens
            old_local = (torch.arange(a - l0.local, a, device=self.device) - S) % max(R, 1)  # ring slots, oldest first
            v_stream = torch.cat([self.v_qbuf[b, :, : l0.value_qbuffer], self.v_local[b][:, old_local], new_v], dim=1)
            full = (l1.value_pages - l0.value_pages) * G
            if full:
                value_groups.append(v_stream[:, :full].reshape(H, -1, G, D).transpose(0, 1))  # (pages, H, G, D)
                value_dest.append((b, l0.value_pages, l1.value_pages - l0.value_pages))
            self.v_qbuf[b, :, : l1.value_qbuffer] = v_stream[:, full : full + l1.value_qbuffer]
            if l1.local:
                new_local = (torch.arange(z - l1.local, z, device=self.device) - S) % R
                self.v_local[b][:, new_local] = v_stream[:, full + l1.value_qbuffer :]

        if key_groups:
            page = quantize_key_page(torch.cat(key_groups), cfg, salt=self.layer_idx, query_scale=self.query_scale(key_rows))
            self._store(self.key_pool, self.k_page_table, key_dest, page_fields(page))
        if value_groups:
            page = quantize_value_page(torch.cat(value_groups), cfg)
            self._store(self.value_pool, self.v_page_table, value_dest, page_fields(page))
        self._n = n1
        self.lengths = torch.tensor(n1, dtype=torch.int32, device=self.device)
        self.seen_tokens += T

    def _append_one(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Decode step: insert one new token ``[B, H, 1, D]`` in every row (stage 1), then pack the qbuffers it
        filled (stage 3)."""
        self.pack_filled(self.insert_decode(key_states, value_states))

    def insert_decode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[list[int], list[int]]:
        """Stage 1 of a decode step: insert one new token ``[B, H, 1, D]`` in every row with batched writes (no
        per-row loop), leaving any qbuffer it fills unpacked; returns the rows whose key / value qbuffer is now
        full, for :meth:`pack_filled` after attention (the paper's order: attend with the full qbuffer in full
        precision, then quantize it). Between the two calls the layer is mid-step: ``lengths`` count the new token
        and qbuffers hold 1..G tokens (``kitty.memory.token_layout(..., full_qbuffer=True)``).

        Slots follow ``docs/LAYOUT.md``: sink slot ``p``; key qbuffer slot ``(p - S) % G``; local ring slot
        ``(p - S) % R``, whose previous value (position ``p - R``) first moves to value qbuffer slot ``(p - R - S) % G``.
        Raises ``RuntimeError`` (nothing changed) when the page pools cannot take the pages this step fills.
        """
        self._prepare(key_states)
        cfg, dev = self.cfg, self.device
        S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
        n0 = self._n
        n1 = [n + 1 for n in n0]
        k, v = key_states[:, :, 0], value_states[:, :, 0]  # (B, H, D)
        key_rows = [b for b, n in enumerate(n1) if n > S and (n - S) % G == 0]  # key qbuffer completes a page
        value_rows = [b for b, n in enumerate(n1) if n - S - R > 0 and (n - S - R) % G == 0]  # value qbuffer does
        self.key_pool.check(len(key_rows))
        self.value_pool.check(len(value_rows))

        # every row is written at once with device-side slots from ``lengths`` (no host index lists, no copies to
        # the device): a row whose token goes elsewhere rewrites the slot's old content
        rows = torch.arange(len(n0), device=dev)
        p = self.lengths.long()  # (B,) position of the new token
        if S:
            slot = p.clamp(max=S - 1)
            here = (p < S)[:, None, None]
            self.sink_k[rows, :, slot] = torch.where(here, k, self.sink_k[rows, :, slot])
            self.sink_v[rows, :, slot] = torch.where(here, v, self.sink_v[rows, :, slot])
        m = (p - S).clamp(min=0)  # tokens past the sink before this one
        past = (p >= S)[:, None, None]
        slot = m % G
        self.k_qbuf[rows, :, slot] = torch.where(past, k, self.k_qbuf[rows, :, slot])
        if R:
            local = m % R
            # the local window is full: its oldest value (position p - R) moves to the value qbuffer first
            leaving = past & (m >= R)[:, None, None]
            qslot = (m - R).clamp(min=0) % G
            self.v_qbuf[rows, :, qslot] = torch.where(leaving, self.v_local[rows, :, local], self.v_qbuf[rows, :, qslot])
            self.v_local[rows, :, local] = torch.where(past, v, self.v_local[rows, :, local])
        else:
            self.v_qbuf[rows, :, slot] = torch.where(past, v, self.v_qbuf[rows, :, slot])
        widest = token_layout(cfg, max(n1))
        self._grow_page_tables(widest.key_pages, widest.value_pages)
        self._n = n1
        self.lengths = self.lengths + 1  # a new tensor: storage() snapshots taken earlier stay as they were
        self.seen_tokens += 1
        return key_rows, value_rows

    def pack_filled(self, filled: tuple[list[int], list[int]]) -> None:
        """Stage 3 of a decode step: pack the qbuffers :meth:`insert_decode` reported full into new pages."""
        key_rows, value_rows = filled
        cfg, n1 = self.cfg, self._n
        if key_rows:
            dest = [(b, token_layout(cfg, n1[b]).key_pages - 1, 1) for b in key_rows]
            self._pack(self.key_pool, self.k_page_table, dest, key_rows, keys=True)
        if value_rows:
            dest = [(b, token_layout(cfg, n1[b]).value_pages - 1, 1) for b in value_rows]
            self._pack(self.value_pool, self.v_page_table, dest, value_rows, keys=False)

    def _triton_pack(self, keys: bool) -> bool:
        """Whether full qbuffers of this side are packed by ``kitty.kernels.pack_pages`` (CUDA, and a config it packs
        bit-identically to ``kitty.quant``: 2/4 bits, min-max ranges, magnitude or random channel selection)."""
        cfg = self.cfg
        if self.device.type != "cuda" or (cfg.key_bits if keys else cfg.value_bits) == 16:
            return False
        if cfg.key_range != "minmax" or cfg.value_range != "minmax" or cfg.boost_profile is not None:
            return False
        if keys and cfg.channel_selection in QUERY_SELECTIONS:
            return False
        from .kernels import HAS_TRITON

        return HAS_TRITON

    def _pack(self, pool: PagePool, table: torch.Tensor, dest: list[tuple[int, int, int]], rows: list[int], keys: bool) -> None:
        """Quantize the full qbuffers of ``rows`` into fresh pages of ``pool`` and point ``table`` at them."""
        idx = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        if self._triton_pack(keys):
            from .kernels import pack_pages

            ids = pool.allocate(len(rows))
            qbuf = self.k_qbuf if keys else self.v_qbuf
            pack_pages(self.cfg, qbuf if keys else None, None if keys else qbuf, k_rows=idx if keys else None,
                       v_rows=None if keys else idx, pool=pool.tensors, k_pages=ids if keys else None,
                       v_pages=None if keys else ids, salt=self.layer_idx)
            self._point(table, dest, ids)
        elif keys:
            page = quantize_key_page(self.k_qbuf[idx], self.cfg, salt=self.layer_idx, query_scale=self.query_scale(idx))
            self._store(pool, table, dest, page_fields(page))
        else:
            self._store(pool, table, dest, page_fields(quantize_value_page(self.v_qbuf[idx], self.cfg)))

    def observe_queries(self, query: torch.Tensor, valid: torch.Tensor) -> None:
        """Add the new queries ``[B, Hq, T, D]`` (real tokens per ``valid`` ``[B, T]``) to the running statistics of
        ``q`` per KV head that ``channel_selection="query"``/``"oracle"`` rank key channels with (else a no-op)."""
        if self.cfg.channel_selection not in QUERY_SELECTIONS:
            return
        B, Hq, T, D = query.shape
        H = self.num_kv_heads
        w = valid.to(device=query.device, dtype=torch.float32)[:, None, None, :, None]  # (B, 1, 1, T, 1)
        stat = query_statistic(query.reshape(B, H, Hq // H, T, D), self.cfg.channel_selection)  # (B, Hkv, group, T, D)
        self.q_stat_sum += (stat * w).sum((2, 3))
        self.q_count += (w.sum((1, 2, 3, 4)) * (Hq // H))[:, None, None]

    def query_scale(self, rows: torch.Tensor | list[int] | None = None) -> torch.Tensor | None:
        """Per-channel query magnitude ``[rows, Hkv, D]`` seen so far: mean ``|q|`` for ``channel_selection="query"``,
        root mean square of ``q`` for ``"oracle"``, ``None`` for other selections."""
        sel = self.cfg.channel_selection
        if sel not in QUERY_SELECTIONS:
            return None
        scale = query_scale_from(self.q_stat_sum / self.q_count.clamp_min(1), sel)
        return scale if rows is None else scale[rows]

    def _store(self, pool: PagePool, table: torch.Tensor, dest: list[tuple[int, int, int]], fields: dict[str, torch.Tensor]) -> None:
        ids = pool.allocate(sum(n for *_, n in dest))
        pool.write(ids, fields)
        self._point(table, dest, ids)

    @staticmethod
    def _point(table: torch.Tensor, dest: list[tuple[int, int, int]], ids: torch.Tensor) -> None:
        """Page-table entries ``table[b, first : first + n]`` = the next ``n`` of ``ids``, for each ``dest``."""
        i = 0
        for b, first, n in dest:
            table[b, first : first + n] = ids[i : i + n]
            i += n

    def _grow_page_tables(self, key_pages: int, value_pages: int) -> None:
        def grow(table: torch.Tensor, need: int) -> torch.Tensor:
            if need <= table.shape[1]:
                return table
            new = torch.full((table.shape[0], max(need, 2 * table.shape[1])), -1, dtype=torch.int32, device=table.device)
            new[:, : table.shape[1]] = table
            return new

        self.k_page_table = grow(self.k_page_table, key_pages)
        self.v_page_table = grow(self.v_page_table, value_pages)

    # ------------------------------------------------------------------------------------------------ reading

    def storage(self) -> dict[str, torch.Tensor]:
        """Every tensor of this layer named as in ``docs/LAYOUT.md`` (views, no copies), plus ``lengths``.

        Pool tensors are cut to the pages in use; page tables to the widest row.
        """
        widest = token_layout(self.cfg, max(self._n, default=0))  # page counts grow with length
        pk, pv = widest.key_pages, widest.value_pages
        out = {
            "lengths": self.lengths,
            "sink_k": self.sink_k,
            "sink_v": self.sink_v,
            "k_qbuf": self.k_qbuf,
            "v_qbuf": self.v_qbuf,
            "v_local": self.v_local,
            "k_page_table": self.k_page_table[:, :pk],
            "v_page_table": self.v_page_table[:, :pv],
        }
        out.update(self.key_pool.in_use())
        out.update(self.value_pool.in_use())
        return out

    def key_page(self, row: int, j: int) -> KeyPage:
        """Key page ``j`` of ``row`` as a :class:`kitty.quant.KeyPage` over ``[H, ...]`` (views into the pool)."""
        return key_page_from_storage(self.storage(), self.k_page_table[row, j].long(), self.cfg, self.dtype)

    def value_page(self, row: int, j: int) -> ValuePage:
        """Value page ``j`` of ``row`` as a :class:`kitty.quant.ValuePage` over ``[H, ...]``."""
        return value_page_from_storage(self.storage(), self.v_page_table[row, j].long(), self.cfg, self.dtype)

    def memory_report(self) -> MemoryReport:
        """Bytes of live data in this layer: pages in use, filled buffer slots (real ``nbytes``)."""
        if not self.is_initialized:
            return MemoryReport(0, 0, 0, 0, 0)
        kp = key_page_from_storage(self.key_pool.in_use(), None, self.cfg, self.dtype)
        vp = value_page_from_storage(self.value_pool.in_use(), None, self.cfg, self.dtype)
        full = 0
        for b, n in enumerate(self._n):
            lay = token_layout(self.cfg, n)
            full += self.sink_k[b, :, : lay.sink].nbytes + self.sink_v[b, :, : lay.sink].nbytes
            full += self.k_qbuf[b, :, : lay.key_qbuffer].nbytes + self.v_qbuf[b, :, : lay.value_qbuffer].nbytes
            full += self.v_local[b, :, : lay.local].nbytes
        tokens = sum(self._n)
        fp16_bytes = 2 * tokens * self.num_kv_heads * self.head_dim * 2  # keys and values at 2 bytes
        return MemoryReport(tokens, fp16_bytes, kp.payload_nbytes + vp.payload_nbytes, kp.metadata_nbytes + vp.metadata_nbytes, full)


class KittyCache(Cache):
    """A transformers ``Cache`` holding every layer's keys and values in Kitty's paged 2-bit format.

    Args:
        config: the model's config (``model.config``). Its ``_attn_implementation`` is set to ``"kitty"`` so that
            the model calls ``kitty.attention``; that function falls back to SDPA for any other cache.
        cfg: a :class:`KVQuantConfig` or a preset name from ``kitty.PRESETS`` (e.g. ``"kitty"``, ``"fp16"``).
        backend: ``"auto"`` (Triton on CUDA tensors, else torch), ``"torch"`` or ``"triton"``; the environment
            variable ``KITTY_BACKEND`` overrides it.
        max_pages: most pages each layer's key pool (and, separately, value pool) may hold, summed over rows;
            ``None`` grows on demand. Running out raises ``RuntimeError`` and leaves the cache unchanged.

    Use as ``model.generate(**inputs, cache=cache)`` (or ``past_key_values=cache``); call :meth:`reset` before
    reusing it for a new prompt. Batches may be left-padded: padding is never stored. Greedy decoding and sampling
    work; beam search raises ``NotImplementedError``.
    """

    def __init__(self, config, cfg: KVQuantConfig | str = "kitty", backend: str = "auto", max_pages: int | None = None):
        if isinstance(cfg, str):
            cfg = get_preset(cfg)
        if not isinstance(cfg, KVQuantConfig):
            raise ValueError(f"cfg must be a KVQuantConfig or a preset name, got {type(cfg).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if max_pages is not None and (not isinstance(max_pages, int) or max_pages < 1):
            raise ValueError(f"max_pages must be a positive integer or None, got {max_pages!r}")
        text = config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(text)  # inferred as DynamicCache does
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"KittyCache supports full-attention layers only, config has layer types {sorted(set(layer_types))} "
                "(for a sliding-window model used within its window, set config.sliding_window = None)"
            )
        num_layers, num_kv_heads, head_dim = kv_dims(text)
        cfg.check_head_dim(head_dim)
        self.cfg, self.backend, self.max_pages = cfg, backend, max_pages
        self.head_dim, self.num_kv_heads, self.num_layers = head_dim, num_kv_heads, num_layers
        layers = [KittyLayer(cfg.for_layer(i, num_layers), num_kv_heads, head_dim, i, backend, max_pages) for i in range(num_layers)]
        super().__init__(layers=layers)
        config._attn_implementation = kattention.ATTN_NAME

    def reset(self) -> None:
        """Drop every cached token (page pools keep their storage); the cache can take a new batch."""
        super().reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(_BEAM_MESSAGE)

    @property
    def lengths(self) -> list[int]:
        """Valid (non-padding) tokens cached per row."""
        return list(self.layers[0]._n)

    def token_counts(self, per_row: bool = False) -> dict[str, int] | list[dict[str, int]]:
        """Tokens per place (first layer; all layers hold the same): sink, key_pages, key_qbuffer, value_pages,
        value_qbuffer, local and tokens. ``key_pages``/``value_pages`` count tokens (pages x G), read from the page
        tables. Summed over rows unless ``per_row``.
        """
        layer = self.layers[0]
        G = self.cfg.group_size
        rows = []
        for b, n in enumerate(layer._n):
            lay = token_layout(self.cfg, n)
            pk = int((layer.k_page_table[b] >= 0).sum()) if layer.is_initialized else 0
            pv = int((layer.v_page_table[b] >= 0).sum()) if layer.is_initialized else 0
            rows.append({"tokens": n, "sink": lay.sink, "key_pages": pk * G, "key_qbuffer": n - lay.sink - pk * G,
                         "value_pages": pv * G, "value_qbuffer": n - lay.sink - pv * G - lay.local, "local": lay.local})
        if per_row:
            return rows
        keys = ("tokens", "sink", "key_pages", "key_qbuffer", "value_pages", "value_qbuffer", "local")
        return {k: sum(r[k] for r in rows) for k in keys}

    def memory_report(self) -> MemoryReport:
        """A :class:`kitty.memory.MemoryReport` over all layers from the real ``nbytes`` of live data.

        Equals ``kitty.memory.analytic_report(cfg, cache.lengths, head_dim, num_kv_heads, num_layers, dtype_bytes)``.
        """
        reports = [layer.memory_report() for layer in self.layers]
        total = sum(reports[1:], reports[0])
        return replace(total, tokens=sum(self.lengths))  # tokens per layer, summed over rows
