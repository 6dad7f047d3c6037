"""Static Kitty layers: every tensor preallocated, a decode step that never waits on the host (capturable).

``KittyCache(config, preset, max_batch_size=..., max_cache_len=...)`` (transformers ``StaticCache``'s names) builds
these layers instead of the growing ones of ``kitty.cache``. Per layer, with ``B`` rows (the first batch, at most
``max_batch_size``), ``L = max_cache_len`` columns, sink ``S``, page size ``G``, local window ``R``::

    key pages per row     Wk = max(L - S, 0) // G          key pool   B * Wk pages: row b's page j is id b * Wk + j
    value pages per row   Wv = max(L - S - R, 0) // G      value pool B * Wv pages: id b * Wv + j
    page tables           int32 [B, Wk] / [B, Wv], -1 until the page is written (then its fixed id)
    sink, qbuffers, local as in ``kitty.layer.KittyLayer``; lengths int32 [B], updated in place
    kernel workspace      the fused decode kernel's split buffers and output, allocated on the first decode step

No allocator is needed (a page's id follows from its row and index), and the shapes never change, so the
Triton kernels' grids (they come from ``B`` and the table widths) are the same at every step.

A decode step (one new token in every row) runs only device operations in a fixed order:

1. insert: the new token goes to its sink / key-qbuffer / local slot of every row (``torch.where`` on slots computed
   from ``lengths`` on the device), the oldest local value to the value qbuffer; ``lengths += 1`` in place;
2. attend: the fused kernel over the storage (the qbuffer this token filled in full precision), or the torch path;
3. pack: every row whose key (value) qbuffer just filled is packed into its page by the layer's ops object
   (``kitty.backend``, ``pack_completed``): ``kitty.kernels.pack_completed`` (Triton backend, configs it packs
   bit-identically) launches one program per (row, KV head) that reads ``lengths[b]`` and returns unless its row
   completed a page, else :func:`pack_completed_torch` quantizes all rows and keeps the completed ones with
   ``torch.where``.

Host counters (columns fed, steps since the prompt) are plain Python integers, advanced by the step's Python code or,
for a replayed CUDA graph (where no Python runs), by :meth:`StaticKittyLayer.advance`. Capacity is checked on them
before anything changes: more than ``max_cache_len`` columns or ``max_batch_size`` rows raise ``ValueError``.

A decode step stores the new token of every row without reading the attention mask (reading it would synchronize):
``generate`` and :func:`kitty.generate.generate_static` always feed real tokens after the prompt. Prompts (several
tokens per row, left padding) run the same code as the growing cache, with the host work it needs.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers.cache_utils import StaticSlidingWindowLayer

from .backend import check_triton, pack_completed_torch
from .config import KVQuantConfig, is_int
from .layer import KittyLayer, WindowLayerMixin
from .memory import MemoryReport, token_layout
from .pages import PagePool
from .storage import ROW_FIELDS, KittyLayerState, PendingKV, key_page_from_storage, pool_fields, value_page_from_storage

__all__ = ["StaticKittyLayer", "StaticPagePool", "StaticSlidingLayer", "check_static_args", "pack_completed_torch"]


def check_static_args(max_batch_size, max_cache_len, max_pages) -> bool:
    """Whether the cache is static (``max_cache_len`` given); ``ValueError`` for bad or conflicting values."""
    if max_cache_len is None:
        if max_batch_size is not None:
            raise ValueError("max_batch_size needs max_cache_len (a static cache is sized by both)")
        return False
    if not is_int(max_cache_len) or max_cache_len < 1:
        raise ValueError(f"max_cache_len must be a positive integer, got {max_cache_len!r}")
    if max_batch_size is not None and (not is_int(max_batch_size) or max_batch_size < 1):
        raise ValueError(f"max_batch_size must be a positive integer or None, got {max_batch_size!r}")
    if max_pages is not None:
        raise ValueError("max_pages does not apply to a static cache (its pools follow from max_cache_len)")
    return True


def page_widths(cfg: KVQuantConfig, max_cache_len: int) -> tuple[int, int]:
    """Key and value pages one row can hold with ``max_cache_len`` tokens: ``(Wk, Wv)``."""
    lay = token_layout(cfg, max_cache_len)
    return lay.key_pages, lay.value_pages


class StaticPagePool(PagePool):
    """A page pool of ``pages`` preallocated pages with fixed owners (row b's page j is id ``b * W + j``)."""

    def __init__(self, fields, device: torch.device, pages: int, kind: str):
        self.fields, self.max_pages, self.kind = fields, pages, kind
        # zeros, not empty: the torch reference dequantizes whole rows of the table, unused pages included
        self.tensors = {n: torch.zeros((pages, *shape), dtype=dt, device=device) for n, (shape, dt) in fields.items()}
        self.used = pages

    def check(self, n: int) -> None:
        """Nothing to check: ``max_cache_len`` (checked before a step) bounds every row's pages."""

    def allocate(self, n: int) -> torch.Tensor:
        raise RuntimeError("a static page pool has no allocator: row b's page j is pool id b * width + j")

    def reset(self) -> None:
        """Pages keep their storage; the page tables say which are live."""


class StaticKittyLayer(KittyLayer):
    """A :class:`kitty.layer.KittyLayer` with fixed storage (module docstring); ``is_compileable``."""

    is_compileable = True

    def __init__(
        self,
        cfg: KVQuantConfig,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int = 0,
        backend: str = "auto",
        model_kv_heads: int | None = None,
        max_cache_len: int = 1,
        max_batch_size: int | None = None,
    ):
        super().__init__(cfg, num_kv_heads, head_dim, layer_idx, backend, None, model_kv_heads)
        self.max_cache_len, self.max_batch_size = max_cache_len, max_batch_size
        self.key_width, self.value_width = page_widths(cfg, max_cache_len)
        self._lengths: torch.Tensor | None = None
        self._workspace: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------------------ host mirrors, in place

    @property
    def lengths(self) -> torch.Tensor:
        """int32 ``[B]`` valid tokens per row: one tensor for the layer's life (written in place)."""
        return self._lengths

    @lengths.setter
    def lengths(self, value: torch.Tensor) -> None:
        if self._lengths is not None and self._lengths.shape == value.shape and self._lengths.device == value.device:
            self._lengths.copy_(value)
        else:
            self._lengths = value

    @property
    def _n(self) -> list[int]:
        """Host copy of ``lengths``: the lengths after the prompt plus one per decode step since (no device read)."""
        return [n + self._steps for n in self._n0]

    @_n.setter
    def _n(self, value: list[int]) -> None:
        self._n0, self._steps = list(value), 0

    # ------------------------------------------------------------------------------------------- setup

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate everything for ``B = key_states.shape[0]`` rows and ``max_cache_len`` columns."""
        super().lazy_initialization(key_states, value_states)  # per-row buffers, lengths, query statistics
        B, H, device = key_states.shape[0], self.num_kv_heads, key_states.device
        key_fields, value_fields = pool_fields(self.cfg, H, self.head_dim, key_states.dtype)
        self.key_pool = StaticPagePool(key_fields, device, B * self.key_width, "key")
        self.value_pool = StaticPagePool(value_fields, device, B * self.value_width, "value")
        self.k_page_table = torch.full((B, self.key_width), -1, dtype=torch.int32, device=device)
        self.v_page_table = torch.full((B, self.value_width), -1, dtype=torch.int32, device=device)
        self._rows = torch.arange(B, device=device)
        self._all_valid = torch.ones(B, 1, dtype=torch.bool, device=device)
        self._workspace = {}

    def _prepare(self, key_states: torch.Tensor) -> None:
        """The growing layer's checks, plus the static bounds: at most ``max_batch_size`` rows and
        ``max_cache_len`` columns (``ValueError`` before anything changes)."""
        if key_states.dim() == 4:
            B, T = key_states.shape[0], key_states.shape[2]
            if self.max_batch_size is not None and B > self.max_batch_size:
                raise ValueError(
                    f"got a batch of {B} rows but the cache was built with max_batch_size={self.max_batch_size}"
                )
            fed = self.seen_tokens if self.is_initialized else 0
            if fed + T > self.max_cache_len:
                raise ValueError(
                    f"{fed} columns cached + {T} new exceed max_cache_len={self.max_cache_len}; build the cache with "
                    "a larger max_cache_len (prompt columns, padding included, plus new tokens)"
                )
        super()._prepare(key_states)

    def check_room(self, steps: int = 1) -> None:
        """``ValueError`` if ``steps`` more decode steps would exceed ``max_cache_len`` (host counters only)."""
        if self.seen_tokens + steps > self.max_cache_len:
            raise ValueError(
                f"{self.seen_tokens} columns cached + {steps} new exceed max_cache_len={self.max_cache_len}; build "
                "the cache with a larger max_cache_len"
            )

    def advance(self, steps: int = 1) -> None:
        """Count ``steps`` decode steps that ran without this layer's Python code (a replayed CUDA graph)."""
        self.seen_tokens += steps
        self._steps += steps

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Static sizes ``(max_cache_len, 0)``, as transformers' ``StaticLayer``."""
        if query_length == 0:
            raise ValueError("got 0 new tokens: a prompt needs at least one token")
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        """Drop every cached token; all storage is kept (tables back to -1)."""
        if self.is_initialized:
            self.lengths.zero_()
            self._n = [0] * len(self._n0)
            self.k_page_table.fill_(-1)
            self.v_page_table.fill_(-1)
            self.q_stat_sum.zero_()
            self.q_count.zero_()
        self.seen_tokens = 0
        self._undo = None

    # ------------------------------------------------------------------------------------ all-or-nothing

    def begin_step(self, forward: int = 0) -> None:
        """Record the host counters; device writes register their own undo actions (no copies on the way)."""
        self._undo = SimpleNamespace(
            forward=forward, n0=self._n0, steps=self._steps, seen_tokens=self.seen_tokens, actions=[]
        )

    def rollback_step(self) -> None:
        u, self._undo = self._undo, None
        if u is None:
            return
        for undo in reversed(u.actions):
            undo()
        self._n0, self._steps, self.seen_tokens = u.n0, u.steps, u.seen_tokens

    # --------------------------------------------------------------------------------------- prompts

    def _append(self, key_states, value_states, valid) -> None:
        """The growing layer's insertion (prompts: host bookkeeping allowed), pages written at their fixed ids."""
        if self._undo is not None:
            saved = self.lengths.clone()
            self._on_undo(lambda: self.lengths.copy_(saved))
        super()._append(key_states, value_states, valid)

    def _grow_page_tables(self, key_pages: int, value_pages: int) -> None:
        """Tables are allocated at their full width (``max_cache_len`` bounds the pages needed)."""

    def _store(self, pool, table, dest, fields) -> None:
        """Write pages ``dest`` = [(row, first page, count)] at their fixed pool ids and point the table at them."""
        width = table.shape[1]
        ids = torch.cat([torch.arange(b * width + j, b * width + j + n) for b, j, n in dest]).to(self.device)
        pool.write(ids, fields)
        self._point(table, dest, ids.to(torch.int32))

    def _append_one(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.insert_static(key_states, value_states)
        self.pack_static()

    # ---------------------------------------------------------------------------------- decode steps

    def new_tokens(self, mask, batch_size: int, q_length: int) -> torch.Tensor | None:
        """Which new columns are real tokens: ``None`` for a decode step (every row's token is stored, the mask is
        not read), else bool ``[B, T]`` on the CPU from columns ``[seen, seen + T)`` of the 2-D padding mask (a
        ``[B, max_cache_len]`` static mask or generate's growing one)."""
        if q_length == 1:
            return None
        m = getattr(mask, "padding_mask", mask)
        if m is None:
            return torch.ones(batch_size, q_length, dtype=torch.bool)
        start = self.seen_tokens
        if m.dim() != 2 or m.shape[0] != batch_size or m.shape[1] < start + q_length:
            raise ValueError(
                f"attention_mask must be 2-D [batch, >= cached + new columns] with batch {batch_size} and >= "
                f"{start + q_length} columns, got {tuple(m.shape)}"
            )
        return m[:, start : start + q_length].to(device="cpu", dtype=torch.bool)

    def attend_and_insert(self, query: torch.Tensor, key: PendingKV, valid, scale: float) -> torch.Tensor:
        """One layer's step ``[B, Hq, T, D]``; ``valid`` from :meth:`new_tokens` (``None``: a decode step)."""
        from . import attention as kattention

        if valid is not None:  # a prompt: the growing layer's path
            return kattention._attend_and_insert(self, query, key, valid, scale)
        B, Hq, T, D = query.shape
        if key.key_states.shape[0] != len(self._n0):
            raise ValueError(f"the cache holds {len(self._n0)} rows but got a batch of {key.key_states.shape[0]}")
        self.observe_queries(query, self._all_valid)
        if self.ops.fused_decode:  # the fused kernel (check_triton refused configs it cannot run at setup)
            self.insert_static(key.key_states, key.value_states)
            out = self.ops.attend(query[:, :, 0], self.storage(), scale, full_qbuffer=True, workspace=self._workspace)[
                :, :, None
            ]  # (B, Hq, 1, D)
        else:
            out = kattention.attend_torch(
                query, key.key_states, key.value_states, self._all_valid, self.storage(), self.cfg, scale
            )
            self.insert_static(key.key_states, key.value_states)
        self.pack_static()
        return out

    def insert_static(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Stage 1 of a decode step for every row: device writes at slots from ``lengths``, then ``lengths += 1``
        in place (the slots are those of ``kitty.layer.KittyLayer.insert_decode``)."""
        if self.ops.fused_decode:
            check_triton(None, None, key_states.device)
        self.check_room(1)
        k, v = key_states[:, :, 0], value_states[:, :, 0]  # (B, H, D)
        self.write_token_slots(k, v, self._rows)
        self.lengths.add_(1)
        self._on_undo(lambda: self.lengths.sub_(1))
        self.seen_tokens += 1
        self._steps += 1

    def pack_static(self) -> None:
        """Stage 3 of a decode step: pack the qbuffers that filled, every row predicated on the device."""
        if self.key_width == 0:  # no row can ever complete a page
            return
        self._on_undo(self._unpoint_completed)  # a packed page lies past the row's old pages: only tables change
        self.ops.pack_completed(
            self.lengths,
            self.k_qbuf,
            self.v_qbuf,
            self.key_pool.tensors,
            self.value_pool.tensors,
            self.k_page_table,
            self.v_page_table,
            self.layer_idx,
            self.query_scale(),
        )

    def _unpoint_completed(self) -> None:
        """Undo of :meth:`pack_static` (``lengths`` still count the step's token): the completed pages' table
        entries back to -1."""
        S, G, R = self.cfg.sink_tokens, self.cfg.group_size, self.cfg.local_window
        n = self.lengths.long()
        for table, start in ((self.k_page_table, n - S), (self.v_page_table, n - S - R)):
            if table.shape[1]:
                done = (start > 0) & (start % G == 0)
                j = (start // G - 1).clamp(0, table.shape[1] - 1)
                table[self._rows, j] = torch.where(done, -1, table[self._rows, j])

    # -------------------------------------------------------------------------------------------- reading

    def storage(self) -> KittyLayerState:
        """Every tensor of the layer as a :class:`kitty.storage.KittyLayerState` (docs/LAYOUT.md names, plus
        ``lengths``), whole: tables and pools at full size (fixed shapes, so captured kernels see the same ones)."""
        return KittyLayerState(
            **{name: getattr(self, name) for name in ROW_FIELDS},
            k_page_table=self.k_page_table,
            v_page_table=self.v_page_table,
            **self.key_pool.tensors,
            **self.value_pool.tensors,
        )

    def held_bytes(self) -> int:
        """Bytes this layer allocated (everything is preallocated; the decode workspace included)."""
        if not self.is_initialized:
            return 0
        tensors = [self.sink_k, self.sink_v, self.k_qbuf, self.v_qbuf, self.v_local, self.lengths]
        tensors += [self.k_page_table, self.v_page_table, self.q_stat_sum, self.q_count]
        tensors += list(self.key_pool.tensors.values()) + list(self.value_pool.tensors.values())
        tensors += list(self._workspace.values())
        return sum(t.nbytes for t in tensors)

    def memory_report(self) -> MemoryReport:
        """Bytes of live data (the pages each row holds, filled buffer slots), as the growing layer reports them."""
        ranks = self.model_kv_heads // self.num_kv_heads
        if not self.is_initialized:
            return MemoryReport(0, 0, 0, 0, 0, ranks=ranks)
        lays = [token_layout(self.cfg, n) for n in self._n]

        def live(width: int, pages: list[int]) -> torch.Tensor:
            ids = [b * width + j for b, p in enumerate(pages) for j in range(p)]
            return torch.tensor(ids, dtype=torch.long, device=self.device)

        kp = key_page_from_storage(
            self.key_pool.tensors, live(self.key_width, [x.key_pages for x in lays]), self.cfg, self.dtype
        )
        vp = value_page_from_storage(
            self.value_pool.tensors, live(self.value_width, [x.value_pages for x in lays]), self.cfg, self.dtype
        )
        full = 0
        for b, lay in enumerate(lays):
            full += self.sink_k[b, :, : lay.sink].nbytes + self.sink_v[b, :, : lay.sink].nbytes
            full += self.k_qbuf[b, :, : lay.key_qbuffer].nbytes + self.v_qbuf[b, :, : lay.value_qbuffer].nbytes
            full += self.v_local[b, :, : lay.local].nbytes
        tokens = sum(x.tokens for x in lays)
        fp16_bytes = 2 * tokens * self.num_kv_heads * self.head_dim * 2
        return MemoryReport(
            tokens,
            fp16_bytes,
            kp.payload_nbytes + vp.payload_nbytes,
            kp.metadata_nbytes + vp.metadata_nbytes,
            full,
            ranks=ranks,
        )


class StaticSlidingLayer(WindowLayerMixin, StaticSlidingWindowLayer):
    """A sliding-window layer of a static cache: transformers' ``StaticSlidingWindowLayer`` (a full-precision
    window of ``min(sliding_window, max_cache_len)`` columns, written in place), with the memory report and
    Kitty's refusal of cache reordering. A failed step is not undone in its window (it is written in place)."""

    def __init__(self, max_cache_len: int, sliding_window: int, model_kv_heads: int, ranks: int = 1):
        super().__init__(max_cache_len=max_cache_len, sliding_window=sliding_window)
        self.model_kv_heads, self.ranks = model_kv_heads, ranks
        self._undo = None
        self._owner = lambda: None

    def begin_step(self, forward: int = 0) -> None:
        """Nothing to record (see the class docstring)."""

    def end_step(self) -> None:
        """Nothing recorded."""

    def rollback_step(self) -> None:
        """Nothing recorded."""

    def check_room(self, steps: int = 1) -> None:
        """A window never runs out of room."""

    def advance(self, steps: int = 1) -> None:
        """Count ``steps`` replayed decode steps (transformers keeps the columns fed as a host integer too)."""
        self.cumulative_length_int += steps


def static_layers(
    cfg: KVQuantConfig,
    layer_types: list[str],
    layer_kwargs: list[dict],
    num_kv_heads: int,
    model_kv_heads: int,
    head_dim: int,
    backend: str,
    tp_size: int,
    max_cache_len: int,
    max_batch_size: int | None,
) -> list:
    """The layers of a static ``KittyCache``: :class:`StaticKittyLayer` for full attention, :class:`StaticSlidingLayer`
    for sliding windows."""
    n = len(layer_types)
    return [
        StaticKittyLayer(
            cfg.for_layer(i, n), num_kv_heads, head_dim, i, backend, model_kv_heads, max_cache_len, max_batch_size
        )
        if kind == "full_attention"
        else StaticSlidingLayer(max_cache_len, kw["sliding_window"], model_kv_heads, tp_size)
        for i, (kind, kw) in enumerate(zip(layer_types, layer_kwargs))
    ]
