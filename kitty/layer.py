"""One decoder layer of a :class:`kitty.KittyCache`: :class:`KittyLayer` (sink, qbuffers, local window, page pools
and page tables: ``docs/LAYOUT.md``) and :class:`SlidingWindowLayer` (a hybrid model's full-precision window)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from types import SimpleNamespace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from .backend import backend_ops
from .config import QUERY_SELECTIONS, KVQuantConfig
from .memory import MemoryReport, token_layout
from .pages import PagePool, grow_page_table, pages_completed, point
from .quant import KeyPage, ValuePage, quantize_key_page, quantize_value_page, query_scale_from, query_statistic
from .step import StepRecord
from .storage import (
    ROW_FIELDS,
    KittyLayerState,
    PendingKV,
    key_page_from_storage,
    page_fields,
    pool_fields,
    value_page_from_storage,
)

_BEAM_MESSAGE = (
    "KittyCache does not support beam search or other cache reordering (num_beams > 1, contrastive search, "
    "assisted decoding): pages are shared storage indexed per row. Use greedy decoding or sampling (num_beams=1)."
)


class KittyLayer(CacheLayerMixin):
    """Kitty cache of one decoder layer: sink, qbuffers, local window, page pools and page tables.

    Storage (``B`` rows, ``H`` KV heads, ``D`` head_dim; exactly ``docs/LAYOUT.md``):

        lengths                 int32 [B]             valid tokens cached per row (padding never counted)
        sink_k, sink_v          [B, H, S, D]          positions [0, S), slot p
        k_qbuf, v_qbuf          [B, H, G, D]          slot (p - S) % G
        v_local                 [B, H, R, D]          ring, slot (p - S) % R
        key pool                k_low [P, H, G, D/4], k_high [P, H, G, ceil(nb/4)], k_boost_idx [P, H, D],
                                k_scale / k_zero [P, H, D]   (or k_raw [P, H, G, D] for 16-bit keys)
        value pool              v_codes [P, H, D, G*bits/8], v_scale / v_zero [P, H, G]   (or v_raw [P, H, G, D])
        k_page_table, v_page_table   int32 [B, W]     pool id of the row's j-th page, -1 unused

    Key page ids index the key pool and value page ids the value pool (two independent pools per layer).
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(
        self,
        cfg: KVQuantConfig,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int = 0,
        backend: str = "auto",
        max_pages: int | None = None,
        model_kv_heads: int | None = None,
    ):
        super().__init__()
        self.cfg, self.num_kv_heads, self.head_dim = cfg, num_kv_heads, head_dim
        # the model's KV heads; a tensor-parallel rank holds ``num_kv_heads`` of them (resized from the first tensors)
        self.model_kv_heads = num_kv_heads if model_kv_heads is None else model_kv_heads
        self.layer_idx, self.backend, self.max_pages = layer_idx, backend, max_pages
        self.seen_tokens = 0  # columns fed so far, padding included: what transformers calls the sequence length
        self._n: list[int] = []  # CPU mirror of ``lengths``
        self._undo: StepRecord | None = None  # the open step, if any (see begin_step)
        self._owner: Callable[[], "Cache | None"] = lambda: None  # the KittyCache this layer belongs to (weak)

    # ------------------------------------------------------------------------------------------------ setup

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the per-row buffers for ``B = key_states.shape[0]`` rows; page pools start empty."""
        B, H, _, D = key_states.shape
        # sized from the tensors: under tensor parallelism each rank receives its shard of the model's KV heads
        if D != self.head_dim or H < 1 or self.model_kv_heads % H:
            raise ValueError(
                f"key_states must have head_dim {self.head_dim} and a number of KV heads dividing the "
                f"model's {self.model_kv_heads} (a tensor-parallel shard), got shape {tuple(key_states.shape)}"
            )
        self.num_kv_heads = H
        cfg, dtype, device = self.cfg, key_states.dtype, key_states.device
        self.ops = backend_ops(self.backend, device, cfg, D)  # torch or Triton, resolved once for these tensors
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
        if (key_states.shape[1], key_states.shape[3]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"key_states must have {self.num_kv_heads} KV heads of head_dim {self.head_dim}, got shape {tuple(key_states.shape)}"
            )
        if not self.is_initialized or (
            self.seen_tokens == 0
            and (B != len(self._n) or key_states.dtype != self.dtype or key_states.device != self.device)
        ):
            self.lazy_initialization(key_states, key_states)
        elif B != len(self._n):
            raise ValueError(
                f"the cache holds {len(self._n)} rows but got a batch of {B}; call cache.reset() before a new batch"
            )
        elif key_states.dtype != self.dtype:
            raise ValueError(
                f"the cache holds {self.dtype} tensors but got {key_states.dtype}; call cache.reset() first"
            )

    # -------------------------------------------------------------------------------------- transformers API

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[PendingKV, PendingKV]:
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
        self._undo = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(_BEAM_MESSAGE)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError(
                "KittyCache cannot crop: quantized pages cannot give tokens back (assisted decoding is unsupported)"
            )

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(_BEAM_MESSAGE)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(_BEAM_MESSAGE)

    # ------------------------------------------------------------------------------------ all-or-nothing steps

    def begin_step(self, forward: int = 0) -> None:
        """Record this layer's state, so that :meth:`rollback_step` can restore it if the step fails.

        The attention function opens a step before it changes anything; the record is dropped by :meth:`end_step`
        or replaced by the next step. ``forward`` names the cache's forward pass, so that a failure in a later
        layer rolls back the layers this pass already changed (:meth:`KittyCache.rollback_forward`).
        """
        self._undo = StepRecord(
            forward,
            list(self._n),
            self.lengths,
            self.seen_tokens,
            self.key_pool.used,
            self.value_pool.used,
            self.k_page_table,
            self.v_page_table,
        )

    def end_step(self) -> None:
        """Keep what the open step did (frees its record)."""
        self._undo = None

    def rollback_step(self) -> None:
        """Put the layer back as it was at :meth:`begin_step` (nothing happens if no step is open)."""
        u, self._undo = self._undo, None
        if u is None:
            return
        for undo in reversed(u.actions):
            undo()
        self._n, self.lengths, self.seen_tokens = u.n, u.lengths, u.seen_tokens
        self.key_pool.used, self.value_pool.used = u.key_used, u.value_used
        self.k_page_table, self.v_page_table = u.k_page_table, u.v_page_table

    def _on_undo(self, action: Callable[[], None]) -> None:
        if self._undo is not None:
            self._undo.actions.append(action)

    @contextmanager
    def _atomic(self):
        """The body changes the layer completely or not at all: inside an open step the step's owner rolls back,
        otherwise this opens a step of its own and rolls it back on any exception."""
        if self._undo is not None:
            yield
            return
        self.begin_step()
        try:
            yield
        except BaseException:
            self.rollback_step()
            raise
        self.end_step()

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
            raise ValueError(
                f"row(s) {empty} of the batch hold no tokens (attention_mask is all zeros): every prompt needs at least one token"
            )
        self.key_pool.check(sum(new_key_pages))
        self.value_pool.check(sum(new_value_pages))
        return n0, n1

    def _growth(self, valid: torch.Tensor) -> tuple[list[int], list[int], list[int], list[int]]:
        """Old and new lengths per row, and the key/value pages each row completes, for inserting ``valid``."""
        counts = valid.sum(1).tolist()
        n0 = list(self._n)
        n1 = [a + c for a, c in zip(n0, counts)]
        return n0, n1, *pages_completed(self.cfg, n0, n1)

    def append_fills_page(self, valid: torch.Tensor) -> bool:
        """Whether inserting these tokens completes a key or value page in some row (stage 3 would run)."""
        _, _, new_key_pages, new_value_pages = self._growth(valid)
        return any(new_key_pages) or any(new_value_pages)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Insert the valid new tokens of every row (stage 1) and quantize every qbuffer that fills (stage 3).

        ``key_states``/``value_states``: ``[B, H, T, D]``; ``valid``: bool ``[B, T]`` (``None``: all valid), True for
        real tokens. Row b's valid tokens, in column order, take positions ``lengths[b], lengths[b] + 1, ...``.
        Any exception leaves the layer as it was.
        """
        self._prepare(key_states)
        with self._atomic():
            self._append(key_states, value_states, valid)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor, valid: torch.Tensor | None) -> None:
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
        if self._undo is not None and max(n1) > S:  # the qbuffers and the local window are rewritten below
            saved = {name: getattr(self, name).clone() for name in ("k_qbuf", "v_qbuf", "v_local")}
            self._on_undo(lambda: [getattr(self, name).copy_(t) for name, t in saved.items()])

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
            page = quantize_key_page(
                torch.cat(key_groups), cfg, salt=self.layer_idx, query_scale=self.query_scale(key_rows)
            )
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
        n0 = self._n
        n1 = [n + 1 for n in n0]
        k, v = key_states[:, :, 0], value_states[:, :, 0]  # (B, H, D)
        new_key_pages, new_value_pages = pages_completed(cfg, n0, n1)
        key_rows = [b for b, c in enumerate(new_key_pages) if c]  # rows whose key qbuffer completes a page
        value_rows = [b for b, c in enumerate(new_value_pages) if c]  # rows whose value qbuffer does
        self.key_pool.check(len(key_rows))
        self.value_pool.check(len(value_rows))

        self.write_token_slots(k, v, torch.arange(len(n0), device=dev))
        widest = token_layout(cfg, max(n1))
        self._grow_page_tables(widest.key_pages, widest.value_pages)
        self._n = n1
        self.lengths = self.lengths + 1  # a new tensor: storage() snapshots taken earlier stay as they were
        self.seen_tokens += 1
        return key_rows, value_rows

    def write_token_slots(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
        """Write one new token per row (``k``, ``v``: ``[B, H, D]``) at the device-side slots of ``lengths``:
        sink slot ``p``, key qbuffer slot ``(p - S) % G``, local ring slot ``(p - S) % R`` whose previous value
        first moves to the value qbuffer; ``lengths`` is not changed. Every row is written at once (no host index
        lists, no copies to the device): a row whose token goes elsewhere rewrites the slot's old content."""
        S, G, R = self.cfg.sink_tokens, self.cfg.group_size, self.cfg.local_window
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
            self.v_qbuf[rows, :, qslot] = torch.where(
                leaving, self.v_local[rows, :, local], self.v_qbuf[rows, :, qslot]
            )
            self.v_local[rows, :, local] = torch.where(past, v, self.v_local[rows, :, local])

            def undo_local() -> None:  # the value that left the local window is still in its qbuffer slot
                self.v_local[rows, :, local] = torch.where(
                    leaving, self.v_qbuf[rows, :, qslot], self.v_local[rows, :, local]
                )

            self._on_undo(undo_local)
        else:
            self.v_qbuf[rows, :, slot] = torch.where(past, v, self.v_qbuf[rows, :, slot])

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

    def _pack(
        self, pool: PagePool, table: torch.Tensor, dest: list[tuple[int, int, int]], rows: list[int], keys: bool
    ) -> None:
        """Quantize the full qbuffers of ``rows`` into fresh pages of ``pool`` (the layer's backend ops) and point
        ``table`` at them."""
        idx = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        ids = pool.allocate(len(rows))
        if keys:
            self.ops.pack_keys(self.k_qbuf, idx, pool, ids, self.layer_idx, self.query_scale(idx))
        else:
            self.ops.pack_values(self.v_qbuf, idx, pool, ids, self.layer_idx)
        self._point(table, dest, ids)

    def observe_queries(self, query: torch.Tensor, valid: torch.Tensor) -> None:
        """Add the new queries ``[B, Hq, T, D]`` (real tokens per ``valid`` ``[B, T]``) to the running statistics of
        ``q`` per KV head that ``channel_selection="query"``/``"oracle"`` rank key channels with (else a no-op)."""
        if self.cfg.channel_selection not in QUERY_SELECTIONS:
            return
        B, Hq, T, D = query.shape
        H = self.num_kv_heads
        w = valid.to(device=query.device, dtype=torch.float32)[:, None, None, :, None]  # (B, 1, 1, T, 1)
        stat = query_statistic(query.reshape(B, H, Hq // H, T, D), self.cfg.channel_selection)  # (B, Hkv, group, T, D)
        if self._undo is not None:
            old_sum, old_count = self.q_stat_sum.clone(), self.q_count.clone()
            self._on_undo(lambda: (self.q_stat_sum.copy_(old_sum), self.q_count.copy_(old_count)))
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

    def _store(
        self, pool: PagePool, table: torch.Tensor, dest: list[tuple[int, int, int]], fields: dict[str, torch.Tensor]
    ) -> None:
        ids = pool.allocate(sum(n for *_, n in dest))
        pool.write(ids, fields)
        self._point(table, dest, ids)

    def _point(self, table: torch.Tensor, dest: list[tuple[int, int, int]], ids: torch.Tensor) -> None:
        """Point ``table`` at ``ids`` (:func:`kitty.pages.point`), undoable within the open step."""
        self._on_undo(lambda: [table[b, first : first + n].fill_(-1) for b, first, n in dest])
        point(table, dest, ids)

    def _grow_page_tables(self, key_pages: int, value_pages: int) -> None:
        self.k_page_table = grow_page_table(self.k_page_table, key_pages)
        self.v_page_table = grow_page_table(self.v_page_table, value_pages)

    # ------------------------------------------------------------------------------------------------ reading

    def storage(self) -> KittyLayerState:
        """Every tensor of this layer as a :class:`kitty.storage.KittyLayerState` (views, no copies; named as in
        ``docs/LAYOUT.md``, plus ``lengths``): pool tensors cut to the pages in use, page tables to the widest row."""
        widest = token_layout(self.cfg, max(self._n, default=0))  # page counts grow with length
        pk, pv = widest.key_pages, widest.value_pages
        return KittyLayerState(
            **{name: getattr(self, name) for name in ROW_FIELDS},
            k_page_table=self.k_page_table[:, :pk],
            v_page_table=self.v_page_table[:, :pv],
            **self.key_pool.in_use(),
            **self.value_pool.in_use(),
        )

    def key_page(self, row: int, j: int) -> KeyPage:
        """Key page ``j`` of ``row`` as a :class:`kitty.quant.KeyPage` over ``[H, ...]`` (views into the pool)."""
        return key_page_from_storage(self.storage(), self.k_page_table[row, j].long(), self.cfg, self.dtype)

    def value_page(self, row: int, j: int) -> ValuePage:
        """Value page ``j`` of ``row`` as a :class:`kitty.quant.ValuePage` over ``[H, ...]``."""
        return value_page_from_storage(self.storage(), self.v_page_table[row, j].long(), self.cfg, self.dtype)

    def memory_report(self) -> MemoryReport:
        """Bytes of live data in this layer: pages in use, filled buffer slots (real ``nbytes``)."""
        ranks = self.model_kv_heads // self.num_kv_heads
        if not self.is_initialized:
            return MemoryReport(0, 0, 0, 0, 0, ranks=ranks)
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
        return MemoryReport(
            tokens,
            fp16_bytes,
            kp.payload_nbytes + vp.payload_nbytes,
            kp.metadata_nbytes + vp.metadata_nbytes,
            full,
            ranks=ranks,
        )


class WindowLayerMixin:
    """What Kitty adds to transformers' full-precision sliding-window layers (growing and static): the memory
    report and the refusal of cache reordering. The layer sets ``model_kv_heads`` and ``ranks``."""

    def memory_report(self) -> MemoryReport:
        """Bytes of the window's keys and values (padding columns included, as transformers holds them)."""
        if not self.is_initialized:
            return MemoryReport(0, 0, 0, 0, 0, ranks=self.ranks)
        held = self.keys.nbytes + self.values.nbytes
        fp16 = 2 * (self.keys.numel() + self.values.numel())
        return MemoryReport(0, fp16, 0, 0, 0, window_bytes=held, ranks=self.model_kv_heads // self.keys.shape[1])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(_BEAM_MESSAGE)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(_BEAM_MESSAGE)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(_BEAM_MESSAGE)


class SlidingWindowLayer(WindowLayerMixin, DynamicSlidingWindowLayer):
    """A sliding-window layer of a hybrid model: transformers' ``DynamicSlidingWindowLayer`` (the newest
    ``sliding_window - 1`` columns of keys and values, ``[B, H, <= W - 1, D]``, in full precision), plus the memory
    report and Kitty's refusal of cache reordering.

    Why full precision and not Kitty pages freed as the window passes (bytes from ``analytic_report``, which the
    tests check against real ``nbytes``; Gemma-3-12B shape, 40 sliding + 8 full layers, 8 KV heads, D=256, W=1024,
    bf16): a full-precision window costs 7.99 MiB per sliding layer and sequence, Kitty pages over the window would
    cost 2.45-2.59 MiB, so the whole cache would hold 0.395 vs ~0.18 GiB at 8K tokens and 0.615 vs ~0.40 GiB at 32K.
    Pages would win on bytes; they are not built yet because the window start falls inside a page (a per-token mask
    inside pages that neither the torch reference nor the fused kernel has), pages would be freed one by one (the
    pool is a bump allocator), and the sink does not apply to a window. Full precision is exact and is what
    transformers' own sliding layer keeps (``docs/SERVING.md`` has the engine side).
    """

    def __init__(self, sliding_window: int, model_kv_heads: int, ranks: int = 1, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.model_kv_heads, self.ranks = model_kv_heads, ranks  # ranks: expected until the first tensors arrive
        self._undo: SimpleNamespace | None = None  # the open step, if any (see begin_step)
        self._owner: Callable[[], "Cache | None"] = lambda: None  # the KittyCache this layer belongs to (weak)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' window update, its step opened first: the attention over the window is the user's own
        function, so the record is taken here rather than by Kitty's attention function."""
        owner = self._owner()
        self.begin_step(owner._forward if owner is not None else 0)
        return super().update(key_states, value_states, *args, **kwargs)

    def begin_step(self, forward: int = 0) -> None:
        """Record the window before an update (``update`` replaces its tensors, never writes them in place), so
        that a failure later in the same forward pass can put it back (:meth:`KittyCache.rollback_forward`)."""
        self._undo = SimpleNamespace(
            forward=forward, state=(self.is_initialized, self.keys, self.values, self.cumulative_length)
        )

    def end_step(self) -> None:
        """Keep what the open step did (frees its record)."""
        self._undo = None

    def rollback_step(self) -> None:
        """Put the window back as it was at :meth:`begin_step` (nothing happens if no step is open)."""
        u, self._undo = self._undo, None
        if u is not None:
            self.is_initialized, self.keys, self.values, self.cumulative_length = u.state
