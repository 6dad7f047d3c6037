"""One decoder layer of a :class:`kitty.KittyCache` in Kitty's paged format (sink, qbuffers, local window, page
pools and page tables: ``docs/LAYOUT.md``): :class:`PagedLayer`, the parts every paged layer shares, and
:class:`KittyLayer`, the growing layer. The static layer (``kitty.cache.static``) is its sibling over the same parts, as
transformers' ``DynamicLayer`` and ``StaticLayer`` are; the window layers of hybrid models live in ``kitty.cache.window``.

The two siblings differ in their page-id policy (``kitty.core.pages``: a bump allocator, or fixed ids ``b * W + j``,
chosen when the layer is built), in how a decode step keeps its bookkeeping (host lists and new tensors, or device
writes in place with no host read) and in their bounds; everything else (buffers, prompt insertion, the token
slots, query statistics, reading, the memory report, the step record) is written once, here.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..core.attnfit import ATTN_MAX_RANGES, observed_page_attention, visible_page_weights
from ..core.config import KEY_ONLY_RANGES, QUERY_SELECTIONS, KVQuantConfig
from ..core.memory import MemoryReport, token_layout
from ..core.pages import FixedPages, GrowingPages, PagePool, filled_page, pages_completed, point
from ..core.quant import KeyPage, ValuePage, quantize_key_page, quantize_value_page, query_scale_from, query_statistic
from ..core.rounding import query_moment_sum
from ..core.storage import (
    ROW_FIELDS,
    KittyLayerState,
    PendingKV,
    allocate_rows,
    key_page_from_storage,
    page_fields,
    pool_fields,
    row_fields,
    value_page_from_storage,
)
from .attention import KittyMask, attend_torch
from .backend import backend_ops
from .step import LayerSteps, new_batch_error


class PagedLayer(LayerSteps, CacheLayerMixin):
    """Kitty cache of one decoder layer: sink, qbuffers, local window, page pools and page tables.

    Storage (``B`` rows, ``H`` KV heads, ``D`` head_dim; exactly ``docs/LAYOUT.md``; per-row buffers from
    ``kitty.core.storage.row_fields``, pools from ``pool_fields``):

        lengths                 int32 [B]             valid tokens cached per row (padding never counted)
        sink_k, sink_v          [B, H, S, D]          positions [0, S), slot p
        k_qbuf, v_qbuf          [B, H, G, D]          slot (p - S) % G
        v_local                 [B, H, R, D]          ring, slot (p - S) % R
        key pool                k_low [P, H, G, D/4], k_high [P, H, G, ceil(nb/4)], k_boost_idx [P, H, D],
                                k_scale / k_zero [P, H, D]   (or k_raw [P, H, G, D] for 16-bit keys)
        value pool              v_codes [P, H, D, G*bits/8], v_scale / v_zero [P, H, G]   (or v_raw [P, H, G, D])
        k_page_table, v_page_table   int32 [B, W]     pool id of the row's j-th page, -1 unused

    Key page ids index the key pool and value page ids the value pool (two independent pools per layer).

    A sibling supplies its step (:meth:`attend_and_append`, from the shared :meth:`_attend_tokens` and
    :meth:`_attend_decode`), the two stages of a decode step (:meth:`insert_decode`, :meth:`pack_filled`) and
    :meth:`new_tokens`; ``page_ids`` is its page-id policy.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(
        self,
        cfg: KVQuantConfig,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        backend: str,
        model_kv_heads: int | None,
        page_ids: GrowingPages | FixedPages,
    ):
        super().__init__()
        self.cfg, self.num_kv_heads, self.head_dim = cfg, num_kv_heads, head_dim
        # the model's KV heads; a tensor-parallel rank holds ``num_kv_heads`` of them (resized from the first tensors)
        self.model_kv_heads = num_kv_heads if model_kv_heads is None else model_kv_heads
        self.layer_idx, self.backend, self.page_ids = layer_idx, backend, page_ids
        self.seen_tokens = 0  # columns fed so far, padding included: what transformers calls the sequence length
        # host copy of ``lengths``: the lengths after the last insertion of several tokens, plus one per decode step
        # since (a replayed CUDA graph counts its steps with ``advance``), so a decode step reads nothing back
        self._n0: list[int] = []
        self._steps = 0
        self.workspace: dict[str, torch.Tensor] | None = None  # the fused kernel's buffers, where a sibling keeps them
        self.k_attn_max: torch.Tensor | None = None  # fit-attn-max's running maxima (lazy_initialization)
        self._prompt_queries: tuple[torch.Tensor, float] | None = None

    @property
    def host_lengths(self) -> list[int]:
        """Valid tokens cached per row, on the host (no device read)."""
        return [n + self._steps for n in self._n0]

    # ------------------------------------------------------------------------------------------------ setup

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the per-row buffers for ``B = key_states.shape[0]`` rows, and the pools of the page-id policy."""
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
        self.dtype, self.device = dtype, device
        self.lengths = torch.zeros(B, dtype=torch.int32, device=device)
        self._n0, self._steps = [0] * B, 0
        for name, t in allocate_rows(row_fields(cfg, H, D, dtype), B, device).items():
            setattr(self, name, t)
        # fresh pools here (the layer is empty); reset() keeps their storage for the next prompt of the same batch
        self.key_pool, self.value_pool = self.page_ids.pools(*pool_fields(cfg, H, D, dtype), B, device)
        self.k_page_table = self.key_pool.new_table(B)
        self.v_page_table = self.value_pool.new_table(B)
        # channel_selection="query"/"oracle": running sum of |q| ("query") or q^2 ("oracle") per (row, KV head,
        # channel) over the GQA group, and its count
        # (key_range "fit-attn"/"fit-attn-free": then the running sum of q itself, channels D..2D; core/attnfit.py)
        width = 2 * D if self._keeps_mean_query else D
        self.q_stat_sum = torch.zeros(B, H, width, dtype=torch.float32, device=device)
        # key_rounding="query": the running sum of q q^T per (row, KV head) over the GQA group (kitty.core.rounding)
        self.q_cov_sum = (
            torch.zeros(B, H, D, D, dtype=torch.float32, device=device) if cfg.key_rounding == "query" else None
        )
        # key_range "fit-attn-max-bound" and the other ATTN_MAX_RANGES: each key qbuffer slot's largest page-local
        # attention from the queries seen while it sat there (observe_key_attention; core/attnfit.py)
        self.k_attn_max = (
            torch.zeros(B, H, cfg.group_size, dtype=torch.float32, device=device)
            if cfg.key_range in ATTN_MAX_RANGES and cfg.channel_selection in QUERY_SELECTIONS
            else None
        )
        self._prompt_queries = None  # set by _attend_tokens around its append
        self.q_count = torch.zeros(B, 1, 1, dtype=torch.float32, device=device)
        self._rows = torch.arange(B, device=device)
        self._all_valid = torch.ones(B, 1, dtype=torch.bool, device=device)  # a decode step's new tokens
        self.seen_tokens = 0
        self.is_initialized = True

    def check_capacity(self, batch_size: int, new_columns: int) -> None:
        """``ValueError`` if the layer's fixed bounds cannot take these tokens (none here: pools check pages)."""

    def prepare(self, key_states: torch.Tensor) -> None:
        """Lazy init; re-init while empty if the batch size changed; refuse a new batch size once tokens are cached."""
        if key_states.dim() != 4:
            raise ValueError(f"key_states must be [B, H, T, D], got shape {tuple(key_states.shape)}")
        B = key_states.shape[0]
        self.check_capacity(B, key_states.shape[2])
        if (key_states.shape[1], key_states.shape[3]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"key_states must have {self.num_kv_heads} KV heads of head_dim {self.head_dim}, "
                f"got shape {tuple(key_states.shape)}"
            )
        rows = len(self._n0)
        if not self.is_initialized or (
            self.seen_tokens == 0 and (B != rows or key_states.dtype != self.dtype or key_states.device != self.device)
        ):
            self.lazy_initialization(key_states, key_states)
        elif B != rows:
            raise new_batch_error(rows, B)
        elif key_states.dtype != self.dtype:
            raise ValueError(
                f"the cache holds {self.dtype} tensors but got {key_states.dtype}; call cache.reset() first"
            )

    # -------------------------------------------------------------------------------------- transformers API

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[PendingKV, PendingKV]:
        """Hand the new keys/values ``[B, H, T, D]`` to the ``"kitty"`` attention function (nothing stored yet).

        The attention function knows the padding of the new tokens; it calls :meth:`attend_and_append`.
        """
        self.prepare(key_states)
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
        """``-1``: no maximum (transformers' ``Cache.get_max_length`` asks every layer)."""
        return -1

    def reset(self) -> None:
        """Drop every cached token; the page pools keep their storage for reuse."""
        if self.is_initialized:
            self.lengths.zero_()
            self._n0, self._steps = [0] * len(self._n0), 0
            self.k_page_table = self.key_pool.clear(self.k_page_table)
            self.v_page_table = self.value_pool.clear(self.v_page_table)
            self.q_stat_sum.zero_()
            self.q_count.zero_()
            if self.q_cov_sum is not None:
                self.q_cov_sum.zero_()
            if self.k_attn_max is not None:
                self.k_attn_max.zero_()
        self.seen_tokens = 0
        self._record = None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError(
                "KittyCache cannot crop: quantized pages cannot give tokens back (assisted decoding is unsupported)"
            )

    # ------------------------------------------------------------------------------------ the step record

    def _save(self) -> tuple:
        """The bookkeeping a rollback restores; in-place writes register their own undo actions."""
        return (
            self._n0,
            self._steps,
            self.lengths,
            self.seen_tokens,
            self.key_pool.mark(),
            self.value_pool.mark(),
            self.k_page_table,
            self.v_page_table,
        )

    def _restore(self, state: tuple) -> None:
        self._n0, self._steps, self.lengths, self.seen_tokens, key_mark, value_mark, *tables = state
        self.key_pool.rewind(key_mark)
        self.value_pool.rewind(value_mark)
        self.k_page_table, self.v_page_table = tables

    # -------------------------------------------------------------------------------------------- the step

    def new_tokens(self, mask: KittyMask | None, batch_size: int, q_length: int) -> torch.Tensor | None:
        """Which new columns are real tokens: bool ``[B, T]`` on the CPU (``None``: a decode step whose tokens are
        all real, told without reading the mask)."""
        raise NotImplementedError

    def attend_and_append(
        self,
        query: torch.Tensor,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        valid: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """One layer's step: attend the new queries ``[B, Hq, T, D]`` over the cache and the new tokens, then store
        the new tokens (``valid`` from :meth:`new_tokens`); returns ``[B, Hq, T, D]``."""
        raise NotImplementedError

    def _attend_tokens(self, query, key_states, value_states, valid: torch.Tensor, scale: float) -> torch.Tensor:
        """A step of several tokens per row (or padding): observe the queries, attend with the torch path, then
        :meth:`append` the valid tokens (``valid`` checked by :meth:`check_append` already)."""
        self.observe_queries(query, valid)  # channel_selection="query" ranks the channels of pages packed below
        out = self._read_back(query, key_states, value_states, valid, scale)
        self._prompt_queries = (query, scale) if self.k_attn_max is not None else None  # fit-attn-max's weights
        try:
            self.append(key_states, value_states, valid)
        finally:
            self._prompt_queries = None
        return out

    def _attend_decode(self, query, key_states, value_states, scale: float) -> torch.Tensor:
        """A decode step, every row at once: with the fused kernel, insert, attend over the qbuffers in full
        precision (a qbuffer this token filled included), then pack what filled (the paper's order); with the
        torch path, attend, insert, pack."""
        self.observe_queries(query, self._all_valid)
        if self.ops.fused_decode:
            filled = self.insert_decode(key_states, value_states)
            out = self.attend_fused(query[:, :, 0], scale)[:, :, None]  # (B, Hq, 1, D)
        else:
            out = self._read_back(query, key_states, value_states, self._all_valid, scale)
            filled = self.insert_decode(key_states, value_states)
        self.observe_key_attention(query[:, :, 0], scale)  # before the qbuffers this token filled are packed
        self.pack_filled(filled)
        return out

    def attend_fused(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Stage 2 of a decode step with the fused backend: ``q`` ``[B, Hq, D]`` over :meth:`storage` (the qbuffers
        this step filled in full precision) -> ``[B, Hq, D]``."""
        return self.ops.attend(q, self.storage(), scale, full_qbuffer=True, workspace=self.workspace)

    def _read_back(self, query, key_states, value_states, valid: torch.Tensor, scale: float) -> torch.Tensor:
        """The torch path (``kitty.cache.attention.attend_torch``) over this layer's storage and the new tokens."""
        valid = valid.to(query.device)
        return attend_torch(query, key_states, value_states, valid, self.storage(), self.cfg, scale)

    def insert_decode(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Stage 1 of a decode step (one token ``[B, H, 1, D]`` in every row); returns what :meth:`pack_filled`
        needs."""
        raise NotImplementedError

    def pack_filled(self, filled) -> None:
        """Stage 3 of a decode step: pack the qbuffers :meth:`insert_decode` filled into their pages."""
        raise NotImplementedError

    # ---------------------------------------------------------------------------------- insertion (stages 1, 3)

    def check_append(self, valid: torch.Tensor) -> tuple[list[int], list[int]]:
        """Validate inserting the tokens marked in ``valid`` ``[B, T]``; return (old lengths, new lengths).

        Raises ``ValueError`` for zero new tokens or a row that would hold no token, ``RuntimeError`` when the page
        pool cannot take the pages these tokens fill. Nothing is changed either way.
        """
        B, T = valid.shape
        n0 = self.host_lengths
        if T == 0:
            raise ValueError("got 0 new tokens: a prompt needs at least one token")
        if B != len(n0):
            raise ValueError(f"valid must have {len(n0)} rows, got {B}")
        n1 = [a + c for a, c in zip(n0, valid.sum(1).tolist())]
        new_key_pages, new_value_pages = pages_completed(self.cfg, n0, n1)
        empty = [b for b, n in enumerate(n1) if n == 0]
        if empty:
            raise ValueError(
                f"row(s) {empty} of the batch hold no tokens (attention_mask is all zeros): every prompt needs at "
                "least one token"
            )
        self.key_pool.check(sum(new_key_pages))
        self.value_pool.check(sum(new_value_pages))
        return n0, n1

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Insert the valid new tokens of every row (stage 1) and quantize every qbuffer that fills (stage 3).

        ``key_states``/``value_states``: ``[B, H, T, D]``; ``valid``: bool ``[B, T]`` (``None``: all valid), True for
        real tokens. Row b's valid tokens, in column order, take positions ``lengths[b], lengths[b] + 1, ...``.
        Any exception leaves the layer as it was.
        """
        self.prepare(key_states)
        B, H, T, D = key_states.shape
        valid = torch.ones(B, T, dtype=torch.bool) if valid is None else valid.to(dtype=torch.bool)
        with self.atomic():
            if T == 1 and B == len(self._n0) and bool(valid.all()):  # a decode step: one token per row, vectorized
                self.pack_filled(self.insert_decode(key_states, value_states))
            else:
                self._append_tokens(key_states, value_states, valid)

    def _append_tokens(self, key_states: torch.Tensor, value_states: torch.Tensor, valid: torch.Tensor) -> None:
        """Several tokens per row (or padding): host bookkeeping per row, pages placed by the page-id policy."""
        B, H, T, D = key_states.shape
        valid = valid.to(device=key_states.device)
        n0, n1 = self.check_append(valid)
        cfg = self.cfg
        S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
        lay0 = [token_layout(cfg, n) for n in n0]
        lay1 = [token_layout(cfg, n) for n in n1]
        self._grow_page_tables(max(l.key_pages for l in lay1), max(l.value_pages for l in lay1))
        attn_max = self.k_attn_max is not None
        if self._record is not None and max(n1) > S:  # the qbuffers and the local window are rewritten below
            names = ("k_qbuf", "v_qbuf", "v_local") + (("k_attn_max",) if attn_max else ())
            saved = {name: getattr(self, name).clone() for name in names}
            self.on_undo(lambda: [getattr(self, name).copy_(t) for name, t in saved.items()])

        key_groups, value_groups = [], []  # full qbuffers to quantize, each (pages, H, G, D)
        weight_groups = []  # fit-attn-max: the observed weights of key_groups' tokens, each (pages, H, G)
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
            if attn_max:
                w_stream = self._stream_weights(b, cols, k_stream, S + l0.key_pages * G, l0.key_qbuffer, a)  # (H, L)
                if full:
                    weight_groups.append(w_stream[:, :full].reshape(H, -1, G).transpose(0, 1))  # (pages, H, G)
                self.k_attn_max[b, :, : l1.key_qbuffer] = w_stream[:, full:]
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
            weight = torch.cat(weight_groups) if weight_groups else None
            page = quantize_key_page(
                torch.cat(key_groups),
                cfg,
                salt=self.layer_idx,
                query_scale=self.query_scale(key_rows, weight),
                query_cov=self.query_cov(key_rows),
            )
            self._store(self.key_pool, self.k_page_table, key_dest, page_fields(page))
        if value_groups:
            page = quantize_value_page(torch.cat(value_groups), cfg)
            self._store(self.value_pool, self.v_page_table, value_dest, page_fields(page))
        self._n0, self._steps = n1, 0
        old_lengths = self.lengths.clone()
        self.on_undo(lambda: self.lengths.copy_(old_lengths))
        self.lengths.copy_(torch.tensor(n1, dtype=torch.int32))  # in place: a static layer's tensors never move
        self.seen_tokens += T

    def write_token_slots(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
        """Write one new token per row (``k``, ``v``: ``[B, H, D]``) at the device-side slots of ``lengths``:
        sink slot ``p``, key qbuffer slot ``(p - S) % G``, local ring slot ``(p - S) % R`` whose previous value
        (position ``p - R``) first moves to value qbuffer slot ``(p - R - S) % G``; ``lengths`` is not changed.
        Every row is written at once (no host index lists, no copies to the device): a row whose token goes
        elsewhere rewrites the slot's old content."""
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

            self.on_undo(undo_local)
        else:
            self.v_qbuf[rows, :, slot] = torch.where(past, v, self.v_qbuf[rows, :, slot])

    def observe_queries(self, query: torch.Tensor, valid: torch.Tensor) -> None:
        """Add the new queries ``[B, Hq, T, D]`` (real tokens per ``valid`` ``[B, T]``) to the running statistics of
        ``q`` per KV head that ``channel_selection="query"``/``"oracle"`` rank key channels with, and to the second
        moment that ``key_rounding="query"`` rounds key codes against (:meth:`query_cov`); else a no-op."""
        selects = self.cfg.channel_selection in QUERY_SELECTIONS
        if not selects and self.q_cov_sum is None:
            return
        B, Hq, T, D = query.shape
        H = self.num_kv_heads
        w = valid.to(device=query.device, dtype=torch.float32)[:, None, None, :, None]  # (B, 1, 1, T, 1)
        if self._record is not None:
            kept = [t for t in (self.q_stat_sum, self.q_count, self.q_cov_sum) if t is not None]
            old = [t.clone() for t in kept]
            self.on_undo(lambda: [t.copy_(o) for t, o in zip(kept, old)])
        grouped = query.reshape(B, H, Hq // H, T, D)
        if selects:
            stat = query_statistic(grouped, self.cfg.channel_selection)  # (B, Hkv, group, T, D)
            if self._keeps_mean_query:  # the mean query that weights fit-attn's tokens
                stat = torch.cat([stat, grouped.float()], -1)
            self.q_stat_sum += (stat * w).sum((2, 3))
        if self.q_cov_sum is not None:
            self.q_cov_sum += query_moment_sum(grouped.float() * w)
        self.q_count += (w.sum((1, 2, 3, 4)) * (Hq // H))[:, None, None]

    @property
    def _keeps_mean_query(self) -> bool:
        """Whether ``q_stat_sum`` also sums ``q`` itself (channels ``D..2D``): the fit-attn ranges weighted by the mean
        query (not the fit-attn-max ones, weighted by :attr:`k_attn_max`)."""
        return self.cfg.key_range in KEY_ONLY_RANGES and self.cfg.key_range not in ATTN_MAX_RANGES

    def query_scale(
        self, rows: torch.Tensor | list[int] | None = None, token_weight: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Per-channel query magnitude ``[rows, Hkv, D]`` seen so far: mean ``|q|`` for ``channel_selection="query"``,
        root mean square of ``q`` for ``"oracle"``, ``None`` for other selections; with ``key_range="fit-attn"`` /
        ``"fit-attn-free"`` ``[rows, Hkv, 2D]``, the mean ``q`` after it (kitty/core/attnfit.py); with
        the fit-attn-max ranges (``ATTN_MAX_RANGES``) ``[rows, Hkv, D + G]``, after it the largest observed
        attention of each token of the page: ``token_weight`` ``[rows, Hkv, G]`` where given (a prompt's pages), else
        the rows' key qbuffer slots (:attr:`k_attn_max`, a page packed from its full qbuffer)."""
        sel = self.cfg.channel_selection
        if sel not in QUERY_SELECTIONS:
            return None
        mean = self.q_stat_sum / self.q_count.clamp_min(1)
        if self._keeps_mean_query:  # fit-attn: the oracle's scale, then the mean query
            D = mean.shape[-1] // 2
            scale = torch.cat([query_scale_from(mean[..., :D], sel), mean[..., D:]], -1)
        else:
            scale = query_scale_from(mean, sel)
        scale = scale if rows is None else scale[rows]
        if self.k_attn_max is not None:  # fit-attn-max: the oracle's scale, then the tokens' observed weights
            weight = token_weight if token_weight is not None else self.k_attn_max
            scale = torch.cat([scale, weight if rows is None or token_weight is not None else weight[rows]], -1)
        return scale

    def query_cov(self, rows: torch.Tensor | list[int] | None = None) -> torch.Tensor | None:
        """The second moment ``E[q q^T]`` ``[rows, Hkv, D, D]`` of the queries seen so far, per KV head over its GQA
        group (``key_rounding="query"``; else ``None``)."""
        if self.q_cov_sum is None:
            return None
        cov = self.q_cov_sum / self.q_count[..., None].clamp_min(1)
        return cov if rows is None else cov[rows]

    def _stream_weights(
        self, b: int, cols: torch.Tensor, k_stream: torch.Tensor, start: int, kept: int, a: int
    ) -> torch.Tensor:
        """fit-attn-max: the observed weights ``[H, L]`` of row ``b``'s key stream ``k_stream`` ``[H, L, D]`` (the
        ``kept`` tokens of the old qbuffer, then the new ones; positions ``start ..``): the running maximum of the old
        slots and, where :meth:`_attend_tokens` passed the prompt's queries (row ``b``'s valid columns ``cols``, at
        positions ``a, a + 1, ...``), the
        largest page-local attention they give every token (:func:`kitty.core.attnfit.observed_page_attention`);
        without queries the new tokens' weights are 0."""
        H, L, _ = k_stream.shape
        w = torch.cat([self.k_attn_max[b, :, :kept], k_stream.new_zeros(H, L - kept, dtype=torch.float32)], 1)
        if self._prompt_queries is None or L == 0:
            return w
        query, scale = self._prompt_queries
        key_pos = torch.arange(start, start + L, device=k_stream.device)
        q_pos = torch.arange(a, a + cols.numel(), device=k_stream.device)
        seen = observed_page_attention(query[b][:, cols], k_stream, q_pos, key_pos, self.cfg.group_size, scale)
        return torch.maximum(w, seen)

    def observe_key_attention(self, q: torch.Tensor, scale: float) -> None:
        """fit-attn-max (else a no-op): a decode step's queries ``q`` ``[B, Hq, D]`` after the new token went into its
        slot of the key qbuffer: each slot's page-local attention from them (the slots up to the new token's,
        :func:`kitty.core.attnfit.visible_page_weights`, the maximum over the GQA group) raises the slot's running
        maximum; the new token's slot starts from it. Device operations only (no host read); undone with the step."""
        if self.k_attn_max is None:
            return
        S, G = self.cfg.sink_tokens, self.cfg.group_size
        B, Hq, D = q.shape
        H = self.num_kv_heads
        p = self.lengths.long() - 1  # the new token's position (insert_decode counted it)
        slot = torch.arange(G, device=q.device)
        m = ((p - S) % G)[:, None]  # its slot
        visible = (slot[None, :] <= m) & (p >= S)[:, None]  # (B, G)
        logits = torch.einsum("bhgd,bhsd->bhgs", q.float().reshape(B, H, Hq // H, D), self.k_qbuf.float()) * scale
        w = visible_page_weights(logits, visible[:, None, None]).amax(2)  # (B, H, G)
        old = self.k_attn_max
        new = torch.where((slot[None, :] == m)[:, None], w, torch.maximum(old, w))
        new = torch.where(visible[:, None], new, old)
        if self._record is not None:
            saved = old.clone()
            self.on_undo(lambda: self.k_attn_max.copy_(saved))
        self.k_attn_max.copy_(new)

    def _store(self, pool, table: torch.Tensor, dest: list[tuple[int, int, int]], fields: dict) -> None:
        """Write pages ``dest`` = ``[(row, first page, count)]`` at the ids the page-id policy gives them."""
        ids = pool.place(dest)
        pool.write(ids, fields)
        self._point(table, dest, ids)

    def _point(self, table: torch.Tensor, dest: list[tuple[int, int, int]], ids: torch.Tensor) -> None:
        """Point ``table`` at ``ids`` (:func:`kitty.core.pages.point`), undoable within the open step."""
        self.on_undo(lambda: [table[b, first : first + n].fill_(-1) for b, first, n in dest])
        point(table, dest, ids)

    def _grow_page_tables(self, key_pages: int, value_pages: int) -> None:
        self.k_page_table = self.key_pool.widen(self.k_page_table, key_pages)
        self.v_page_table = self.value_pool.widen(self.v_page_table, value_pages)

    # ------------------------------------------------------------------------------------------------ reading

    def storage(self) -> KittyLayerState:
        """Every tensor of this layer as a :class:`kitty.core.storage.KittyLayerState` (views, no copies; named as in
        ``docs/LAYOUT.md``, plus ``lengths``): what the page-id policy shows (a growing layer's pools cut to the
        pages in use and tables to the widest row; a static layer's whole, fixed shapes)."""
        widest = token_layout(self.cfg, max(self.host_lengths, default=0))  # page counts grow with length
        k_table, key_pool = self.key_pool.view(self.k_page_table, widest.key_pages)
        v_table, value_pool = self.value_pool.view(self.v_page_table, widest.value_pages)
        return KittyLayerState(
            **{name: getattr(self, name) for name in ROW_FIELDS},
            k_page_table=k_table,
            v_page_table=v_table,
            **key_pool,
            **value_pool,
        )

    def key_page(self, row: int, j: int) -> KeyPage:
        """Key page ``j`` of ``row`` as a :class:`kitty.core.quant.KeyPage` over ``[H, ...]`` (views into the pool)."""
        return key_page_from_storage(self.storage(), self.k_page_table[row, j].long(), self.cfg, self.dtype)

    def value_page(self, row: int, j: int) -> ValuePage:
        """Value page ``j`` of ``row`` as a :class:`kitty.core.quant.ValuePage` over ``[H, ...]``."""
        return value_page_from_storage(self.storage(), self.v_page_table[row, j].long(), self.cfg, self.dtype)

    def memory_report(self) -> MemoryReport:
        """Bytes of live data in this layer: the pages each row holds, filled buffer slots (real ``nbytes``)."""
        ranks = self.model_kv_heads // self.num_kv_heads
        if not self.is_initialized:
            return MemoryReport(0, 0, 0, 0, 0, ranks=ranks)
        lays = [token_layout(self.cfg, n) for n in self.host_lengths]
        keys = self.key_pool.live([lay.key_pages for lay in lays])
        values = self.value_pool.live([lay.value_pages for lay in lays])
        kp = key_page_from_storage(keys, None, self.cfg, self.dtype)
        vp = value_page_from_storage(values, None, self.cfg, self.dtype)
        full = 0
        for b, lay in enumerate(lays):
            full += self.sink_k[b, :, : lay.sink].nbytes + self.sink_v[b, :, : lay.sink].nbytes
            full += self.k_qbuf[b, :, : lay.key_qbuffer].nbytes + self.v_qbuf[b, :, : lay.value_qbuffer].nbytes
            full += self.v_local[b, :, : lay.local].nbytes
        tokens = sum(lay.tokens for lay in lays)
        fp16_bytes = 2 * tokens * self.num_kv_heads * self.head_dim * 2  # keys and values at 2 bytes
        payload = kp.payload_nbytes + vp.payload_nbytes
        return MemoryReport(tokens, fp16_bytes, payload, kp.metadata_nbytes + vp.metadata_nbytes, full, ranks=ranks)


class KittyLayer(PagedLayer):
    """The growing Kitty layer: pages from a bump allocator (at most ``max_pages`` per pool, ``None``: on demand),
    page tables widening as rows grow, a decode step's bookkeeping on the host."""

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
        super().__init__(cfg, num_kv_heads, head_dim, layer_idx, backend, model_kv_heads, GrowingPages(max_pages))
        self.max_pages = max_pages

    def new_tokens(self, mask: KittyMask | None, batch_size: int, q_length: int) -> torch.Tensor:
        """bool ``[B, T]`` on the CPU (bookkeeping only): the new columns of the 2-D padding mask."""
        return (mask or KittyMask(None)).new_token_mask(batch_size, q_length, "cpu")

    def attend_and_append(self, query, key_states, value_states, valid: torch.Tensor, scale: float) -> torch.Tensor:
        self.check_append(valid)  # errors before anything changes
        if query.shape[2] == 1 and bool(valid.all()):
            return self._attend_decode(query, key_states, value_states, scale)
        return self._attend_tokens(query, key_states, value_states, valid, scale)

    def insert_decode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[list, list]:
        """Stage 1 of a decode step: insert one new token ``[B, H, 1, D]`` in every row with batched writes (no
        per-row loop), leaving any qbuffer it fills unpacked; returns the ``(row, page index)`` of every key / value
        qbuffer now full (:func:`kitty.core.pages.filled_page`), for :meth:`pack_filled` after attention (the paper's
        order: attend with the full qbuffer in full precision, then quantize it). Between the two calls the layer is
        mid-step: ``lengths`` count the new token and qbuffers hold 1..G tokens
        (``kitty.core.memory.token_layout(..., full_qbuffer=True)``). Slots: :meth:`write_token_slots`.

        Raises ``RuntimeError`` (nothing changed) when the page pools cannot take the pages this step fills.
        """
        self.prepare(key_states)
        cfg = self.cfg
        S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
        n1 = [n + 1 for n in self.host_lengths]
        key_pages = [(b, j) for b, n in enumerate(n1) if (j := filled_page(n, S, G)) is not None]
        value_pages = [(b, j) for b, n in enumerate(n1) if (j := filled_page(n, S + R, G)) is not None]
        self.key_pool.check(len(key_pages))
        self.value_pool.check(len(value_pages))

        self.write_token_slots(key_states[:, :, 0], value_states[:, :, 0], self._rows)
        widest = token_layout(cfg, max(n1))
        self._grow_page_tables(widest.key_pages, widest.value_pages)
        self._steps += 1
        self.lengths = self.lengths + 1  # a new tensor: storage() snapshots taken earlier stay as they were
        self.seen_tokens += 1
        return key_pages, value_pages

    def pack_filled(self, filled: tuple[list, list]) -> None:
        """Stage 3 of a decode step: pack the qbuffers :meth:`insert_decode` reported full into fresh pages."""
        key_pages, value_pages = filled
        if key_pages:
            self._pack(self.key_pool, self.k_page_table, key_pages, keys=True)
        if value_pages:
            self._pack(self.value_pool, self.v_page_table, value_pages, keys=False)

    def _pack(self, pool: PagePool, table: torch.Tensor, pages: list[tuple[int, int]], keys: bool) -> None:
        """Quantize the full qbuffers of ``pages`` = ``[(row, page index)]`` into fresh pages of ``pool`` (the
        layer's backend ops) and point ``table`` at them."""
        rows = [b for b, _ in pages]
        dest = [(b, j, 1) for b, j in pages]
        idx = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        ids = pool.place(dest)
        if keys:
            self.ops.pack_keys(self.k_qbuf, idx, pool, ids, self.layer_idx, self.query_scale(idx), self.query_cov(idx))
        else:
            self.ops.pack_values(self.v_qbuf, idx, pool, ids, self.layer_idx)
        self._point(table, dest, ids)
