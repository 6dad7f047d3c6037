"""Static Kitty layers: every tensor preallocated, a decode step that never waits on the host (capturable).

``KittyCache(config, preset, max_batch_size=..., max_cache_len=...)`` (transformers ``StaticCache``'s names) builds
these layers instead of the growing ones of ``kitty.cache.kitty_cache``. Per layer, with ``B`` rows (the first batch, at
most ``max_batch_size``), ``L = max_cache_len`` columns, sink ``S``, page size ``G``, local window ``R``::

    key pages per row     Wk = max(L - S, 0) // G          key pool   B * Wk pages: row b's page j is id b * Wk + j
    value pages per row   Wv = max(L - S - R, 0) // G      value pool B * Wv pages: id b * Wv + j
    page tables           int32 [B, Wk] / [B, Wv], -1 until the page is written (then its fixed id)
    sink, qbuffers, local as in ``kitty.cache.layer.PagedLayer``; lengths int32 [B], updated in place
    kernel workspace      the fused decode kernel's split buffers, merge tickets and output, allocated by the prompt
                          (once the query heads are known) for the launch every decode step then uses

No allocator is needed (a page's id follows from its row and index), and the shapes never change, so the
Triton kernels' grids (they come from ``B`` and the table widths) are the same at every step.

A decode step (one new token in every row) runs only device operations in a fixed order:

1. insert: the new token goes to its sink / key-qbuffer / local slot of every row, the oldest local value to the value
   qbuffer, ``lengths += 1`` in place: one launch of ``kitty.kernels.insert_token`` with the fused backend, else
   ``torch.where`` on slots computed from ``lengths`` on the device (:meth:`PagedLayer.write_token_slots`);
2. attend: the fused kernel over the storage (the qbuffer this token filled in full precision) with the preallocated
   workspace and its launch (``Launch.merge_inside`` where ``$KITTY_MERGE_INSIDE=1`` or the layer's
   ``merge_inside`` says so), or the torch path;
3. pack: every row whose key (value) qbuffer just filled (``kitty.core.pages.filled_pages``) is packed into its page by
   the layer's ops object (``kitty.cache.backend``, ``pack_completed``): ``kitty.kernels.pack_completed`` (Triton
   backend, configs it packs bit-identically) launches one program per (row, KV head) that reads ``lengths[b]`` and
   returns unless its row completed a page, else ``kernels/reference.py``'s ``pack_completed_ref`` quantizes all rows
   and keeps the completed ones with ``torch.where``.

With ``defer_keys`` / ``defer_values`` (set by :func:`stagger_packs`, which :func:`kitty.hf.generate.generate_static`
calls for its loop unless ``$KITTY_STAGGER_PACK=0``), stage 3 leaves that side of a completed page to the start of
the next step, which packs it before its insert overwrites the qbuffer's first slot. With ``R = G`` a row completes a
key and a value page in the same step; :func:`stagger_packs` defers the values on even layers and the keys on odd
ones, so that each of the two steps packs about half of the pages. Between those two steps the page is pending (its
table entry -1, its tokens in the full qbuffer, which the attention reads in full precision as in the completing
step); :meth:`StaticKittyLayer.pack_pending` packs it, and the loop calls it whenever it hands the cache back (at
every host read and at the end), so that no reader sees a pending page; a prompt packs it first too. A host flag per
side says whether a deferred step ran since the last such pack (the pack reads the full qbuffer, which a decode step
fills but a prompt does not: a prompt packs its pages from its own tokens). Keys are never deferred with a query
channel selection (the next step's query would change the statistics the boost is chosen with).
A step that ``torch.compile`` traces defers nothing (its stage 3 packs both sides).

While ``torch.compile`` traces the step, the three stages are the ``kitty::`` custom ops of
``kitty.cache.custom_ops`` (opaque to the compiler, their mutations declared), called with arguments flattened once
at the prompt (no config, state or launch object is built in the traced code), and nothing host-side is traced: no
step record, no capacity check, no host counter (a Python integer read there would be guarded, and change at every
step). The layer's tensors are marked as static addresses (``torch._dynamo.mark_static_address``, as transformers'
``StaticLayer`` does) so that ``mode="reduce-overhead"`` captures the step in place.

Host counters (columns fed, steps since the prompt) are plain Python integers, advanced by the step's Python code or,
for a replayed CUDA graph (where no Python runs), by :meth:`StaticKittyLayer.advance`. A compiled step leaves them
behind (it only marks them so); the next host read derives them from the device (``lengths[0]`` less the prompt's
length of row 0: every decode step adds one to every row), one synchronization. Capacity is checked on them before
anything changes: more than ``max_cache_len`` columns or ``max_batch_size`` rows raise ``ValueError``.

A decode step stores the new token of every row without reading the attention mask (reading it would synchronize):
``generate`` and :func:`kitty.hf.generate.generate_static` always feed real tokens after the prompt. Prompts (several
tokens per row, left padding) run the same code as the growing cache, with the host work it needs.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from .. import kernels
from ..core.config import QUERY_SELECTIONS, KVQuantConfig, is_int
from ..core.memory import token_layout
from ..core.pages import FixedPages, filled_pages
from ..core.storage import ROW_FIELDS, KittyLayerState, PendingKV
from ..kernels.gluon_launch import GLUON_WORKSPACE, default_gluon_launch, gluon_applies, gluon_workspace
from ..kernels.launch import default_launch
from . import custom_ops
from .backend import check_triton
from .layer import PagedLayer

__all__ = [
    "MERGE_INSIDE_ENV",
    "STAGGER_PACK_ENV",
    "StaticKittyLayer",
    "check_static_args",
    "merge_inside_requested",
    "page_widths",
    "stagger_packs",
    "stagger_requested",
]

MERGE_INSIDE_ENV = "KITTY_MERGE_INSIDE"
STAGGER_PACK_ENV = "KITTY_STAGGER_PACK"


def stagger_requested() -> bool:
    """Whether :func:`kitty.hf.generate.generate_static`'s loop staggers the packs of a completed page over two
    decode steps (:func:`stagger_packs`): ``$KITTY_STAGGER_PACK``, ``"0"`` or ``"1"`` (default ``"1"``)."""
    value = os.environ.get(STAGGER_PACK_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"${STAGGER_PACK_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def stagger_packs(layers) -> list[StaticKittyLayer]:
    """Spread the packs of the pages a step completes over that step and the next: of the static layers among
    ``layers``, even ones (in order) defer their value pages and odd ones their key pages (their value pages where
    the channel selection reads queries; only the fused backend defers). Returns the layers it set; the caller packs
    what is pending whenever it hands the cache back and clears the flags (:meth:`StaticKittyLayer.pack_pending`)."""
    static = [la for la in layers if isinstance(la, StaticKittyLayer)]
    for i, layer in enumerate(static):
        keys = i % 2 == 1 and layer.cfg.channel_selection not in QUERY_SELECTIONS
        layer.defer_keys, layer.defer_values = keys, not keys
    return static


def merge_inside_requested() -> bool:
    """Whether ``$KITTY_MERGE_INSIDE=1`` asks static layers to merge the split-K partials inside the attention
    launch (``Launch.merge_inside``; off by default until it is timed on the GPU)."""
    return os.environ.get(MERGE_INSIDE_ENV, "0") == "1"


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing this call (the step then calls the ``kitty::`` custom ops)."""
    return torch.compiler.is_compiling()


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


class StaticKittyLayer(PagedLayer):
    """The static Kitty layer, sibling of the growing :class:`kitty.cache.layer.KittyLayer` over the shared parts of
    :class:`kitty.cache.layer.PagedLayer`: fixed storage and page ids (module docstring); ``is_compileable``."""

    is_compileable = True
    # Launch.merge_inside for this layer's decode steps: None follows $KITTY_MERGE_INSIDE (set before the prompt)
    merge_inside: bool | None = None
    # pack a completed key (value) page at the start of the next decode step (module docstring), fused backend only
    defer_keys: bool = False
    defer_values: bool = False

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
        self.key_width, self.value_width = page_widths(cfg, max_cache_len)
        page_ids = FixedPages(self.key_width, self.value_width)
        self._behind = False  # compiled steps ran since the host counters were last exact
        # a step that deferred its key (value) pages ran since the last pack of pending pages
        self._keys_pending = self._values_pending = False
        self._seen, self._steps_done = 0, 0
        super().__init__(cfg, num_kv_heads, head_dim, layer_idx, backend, model_kv_heads, page_ids)
        self.max_cache_len, self.max_batch_size = max_cache_len, max_batch_size

    # ---------------------------------------------------------------------------------- host counters

    def _catch_up(self) -> None:
        """Bring the host counters up to date after compiled steps (which run no host code): every decode step adds
        one token to every row, so the steps since the last prompt are row 0's device length less its host length
        then (one synchronization)."""
        if not self._behind:
            return
        self._behind = False
        steps = int(self.lengths[0]) - self._n0[0]
        self._seen += steps - self._steps_done
        self._steps_done = steps
        if self._seen > self.max_cache_len:  # a compiled step checks no room: say so at the first host read
            raise ValueError(
                f"compiled decode steps went {self._seen - self.max_cache_len} column(s) past max_cache_len="
                f"{self.max_cache_len}; the tokens past it were not stored. Call cache.reset() and build the cache "
                "with a larger max_cache_len (prompt columns, padding included, plus new tokens)"
            )

    @property
    def seen_tokens(self) -> int:
        """Columns fed so far, padding included (exact on the host, also after compiled steps)."""
        self._catch_up()
        return self._seen

    @seen_tokens.setter
    def seen_tokens(self, value: int) -> None:
        self._catch_up()
        self._seen = value

    @property
    def _steps(self) -> int:
        """Decode steps since the last insertion of several tokens."""
        self._catch_up()
        return self._steps_done

    @_steps.setter
    def _steps(self, value: int) -> None:
        self._catch_up()
        self._steps_done = value

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate everything for ``B = key_states.shape[0]`` rows and ``max_cache_len`` columns; the kernel
        workspace is allocated by the prompt (:meth:`prepare_workspace`: the query heads are known there)."""
        self._behind = False
        super().lazy_initialization(key_states, value_states)
        self.workspace, self.launch, self._op_workspace, self._op_args = None, None, [], None
        # columns fed less row 0's length (the prompt's padding of row 0): get_seq_length on the device while traced
        self._column_offset = torch.zeros((), dtype=torch.int32, device=self.device)
        if not compiling():  # fixed data pointers: a reduce-overhead graph reads and writes them in place
            for t in self._tensors():
                torch._dynamo.mark_static_address(t)

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor a decode step reads or writes (fixed for the layer's life, until a new batch)."""
        named = [getattr(self, name) for name in ROW_FIELDS] + [self.k_page_table, self.v_page_table]
        named += [self.q_stat_sum, self.q_count, self._rows, self._all_valid, self._column_offset]
        named += [self.k_attn_max] if self.k_attn_max is not None else []
        return named + list(self.key_pool.tensors.values()) + list(self.value_pool.tensors.values())

    def reset(self) -> None:
        """Drop every cached token (tensors kept, zeroed in place; the host counters need no catching up)."""
        self._behind = self._keys_pending = self._values_pending = False
        super().reset()
        if self.is_initialized:
            self._column_offset.zero_()

    def check_capacity(self, batch_size: int, new_columns: int) -> None:
        """At most ``max_batch_size`` rows and ``max_cache_len`` columns (``ValueError`` before anything changes)."""
        if self.max_batch_size is not None and batch_size > self.max_batch_size:
            raise ValueError(
                f"got a batch of {batch_size} rows but the cache was built with max_batch_size={self.max_batch_size}"
            )
        fed = self.seen_tokens if self.is_initialized else 0
        if fed + new_columns > self.max_cache_len:
            raise ValueError(
                f"{fed} columns cached + {new_columns} new exceed max_cache_len={self.max_cache_len}; build the cache "
                "with a larger max_cache_len (prompt columns, padding included, plus new tokens)"
            )

    def check_room(self, steps: int = 1) -> None:
        """``ValueError`` if ``steps`` more decode steps would exceed ``max_cache_len`` (host counters only)."""
        if self.seen_tokens + steps > self.max_cache_len:
            raise ValueError(
                f"{self.seen_tokens} columns cached + {steps} new exceed max_cache_len={self.max_cache_len}; build "
                "the cache with a larger max_cache_len"
            )

    def _append_tokens(self, key_states: torch.Tensor, value_states: torch.Tensor, valid: torch.Tensor) -> None:
        """Several tokens per row (the shared insertion), then the device copy of row 0's padding columns that
        :meth:`get_seq_length` reads while traced."""
        old = self._column_offset.clone()
        super()._append_tokens(key_states, value_states, valid)
        self.on_undo(lambda: self._column_offset.copy_(old))
        self._column_offset.fill_(self.seen_tokens - self._n0[0])

    @property
    def traceable(self) -> bool:
        """Whether a decode step can run inside a compiled graph: the fused backend (the torch path reads the host),
        and a prompt that allocated everything (the layer's tensors, the kernel workspace, the flattened op
        arguments). Otherwise the step runs eagerly, outside the graph."""
        return self.is_initialized and self.ops.fused_decode and self._op_args is not None

    def traced_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[PendingKV, PendingKV]:
        """:meth:`update` of a decode step while ``torch.compile`` traces it: checks on fixed shapes only (no host
        counter is read; the prompt, run eagerly, allocated everything)."""
        B, H, T, D = key_states.shape
        if T != 1 or not self.traceable or (B, H, D) != (len(self._n0), self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"a compiled step of a static KittyCache takes one token per row of the {len(self._n0)} rows the "
                f"prompt started (run the prompt eagerly), got key_states of shape {tuple(key_states.shape)}"
            )
        pending = PendingKV(self, key_states, value_states)
        return pending, pending

    def get_seq_length(self):
        """Columns fed so far, padding included; while ``torch.compile`` traces, a 0-d device tensor (row 0's length
        plus the prompt's padding columns of row 0), so that no host counter is read (transformers' ``StaticLayer``
        returns a tensor too)."""
        if not self.is_initialized:
            return 0
        if compiling():
            return self.lengths[0] + self._column_offset
        return self.seen_tokens

    def advance(self, steps: int = 1) -> None:
        """Count ``steps`` decode steps that ran without this layer's Python code (a replayed CUDA graph): one
        catch-up check, then the plain counters (called per layer at every replay of the product's loop)."""
        self._catch_up()
        self._seen += steps
        self._steps_done += steps
        if steps > 0:
            self._keys_pending |= self.defer_keys
            self._values_pending |= self.defer_values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Static sizes ``(max_cache_len, 0)``, as transformers' ``StaticLayer``."""
        if query_length == 0:
            raise ValueError("got 0 new tokens: a prompt needs at least one token")
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        """``max_cache_len`` (transformers' ``Cache.get_max_length`` asks every layer)."""
        return self.max_cache_len

    # ---------------------------------------------------------------------------------- the step

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

    def attend_and_append(self, query, key_states, value_states, valid, scale: float) -> torch.Tensor:
        """One layer's step ``[B, Hq, T, D]``; ``valid`` from :meth:`new_tokens` (``None``: a decode step, which
        runs only device operations)."""
        if valid is not None:  # a prompt: host bookkeeping allowed
            self.check_append(valid)
            self.pack_pending()  # before the prompt's tokens reuse the qbuffers
            out = self._attend_tokens(query, key_states, value_states, valid, scale)
            self.prepare_workspace(query.shape[1])
            return out
        if key_states.shape[0] != len(self._n0):
            raise ValueError(f"the cache holds {len(self._n0)} rows but got a batch of {key_states.shape[0]}")
        return self._attend_decode(query, key_states, value_states, scale)

    def prepare_workspace(self, num_heads: int) -> None:
        """Allocate the fused kernel's workspace for ``num_heads`` query heads once (eagerly, at the prompt: never
        inside a compiled or captured step), sized by :func:`kitty.cache.custom_ops.attention_workspace` for the
        launch every decode step then uses (:attr:`launch`), and the Gluon kernel's split buffers and merge tickets
        where the layer decodes with it (``kitty.kernels.gluon_launch.gluon_workspace``); nothing for the torch
        backend."""
        if not self.ops.fused_decode:
            return
        B, H, D = len(self._n0), self.num_kv_heads, self.head_dim
        if self.workspace is not None and self.workspace["out"].shape == (B, num_heads, D):
            return
        merge = merge_inside_requested() if self.merge_inside is None else bool(self.merge_inside)
        launch = dataclasses.replace(default_launch(B, H, self.key_width + 1, self.device), merge_inside=merge)
        q = torch.empty(B, num_heads, D, dtype=self.dtype, device=self.device)
        ws, self.launch = custom_ops.attention_workspace(q, self.storage(), launch)
        self.workspace = dict(zip(("m", "l", "acc", "tickets"), ws), out=q)
        if self.ops.decodes_with_gluon and gluon_applies(self.cfg, q, self.k_qbuf):  # the Gluon kernel's own buffers
            g = gluon_workspace(q, H, default_gluon_launch(B, H, self.k_page_table.shape[1] + 1, self.device))
            ws = ws + [g[name] for name in GLUON_WORKSPACE]
            self.workspace |= g | {"g_out": q}
        self._op_workspace = ws  # m, l, acc, tickets (and the Gluon buffers): what kitty::decode_attention writes
        self.ops.launch = self.launch
        # the custom ops' arguments, flattened here once: traced code then builds no config, state or launch object
        self._op_args = custom_ops.flat_args(self.storage(), self.cfg, self.launch, self.key_pool.tensors,
                                             self.value_pool.tensors, self.ops.decodes_with_gluon)  # fmt: skip
        if not compiling():
            for t in [*ws, q]:
                torch._dynamo.mark_static_address(t)

    def storage(self) -> KittyLayerState:
        """Every tensor of this layer, whole (fixed shapes; no host counter is read)."""
        return KittyLayerState(
            **{name: getattr(self, name) for name in ROW_FIELDS},
            k_page_table=self.k_page_table,
            v_page_table=self.v_page_table,
            **self.key_pool.tensors,
            **self.value_pool.tensors,
        )

    def attend_fused(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Stage 2 with the fused backend: the kernel over the whole storage with the preallocated workspace and
        launch (``kitty::decode_attention`` while compiling)."""
        if compiling():  # a traceable step: the prompt prepared the workspace and the flat arguments
            a = self._op_args
            return custom_ops.decode_attention_flat(q, a.state, a.cfg, scale, True, self._op_workspace, a.launch)
        if self.workspace is None:  # no prompt prepared it (a step built by hand): allocate here, outside capture
            self.prepare_workspace(q.shape[1])
        return self.ops.attend(q, self.storage(), scale, full_qbuffer=True, workspace=self.workspace)

    def insert_decode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Stage 1 of a decode step for every row: with the fused backend one launch of ``kitty.kernels.insert_token``
        (``kitty::insert_token`` while compiling), else device writes at slots from ``lengths``
        (:meth:`write_token_slots`) and ``lengths += 1``; both in place, no host read."""
        k, v = key_states[:, :, 0], value_states[:, :, 0]
        buffers = (self.lengths, self.sink_k, self.sink_v, self.k_qbuf, self.v_qbuf, self.v_local)
        if compiling():  # a traceable step (fused backend): no host work, the counters are derived when next read
            if self._keys_pending or self._values_pending:  # a compiled step defers nothing (stage 3 packs all)
                raise RuntimeError("an eager step left pages pending: call pack_pending() before a compiled step")
            custom_ops.insert_token(k, v, *buffers)
            self._behind = True
            return
        self.check_room(1)
        if self.ops.fused_decode:
            check_triton(None, None, key_states.device)
            # stage 0: the pages a deferred step left, before slot 0 is reused (no undo: the page is packed from the
            # full qbuffer, and stays right); nothing unless a side is pending
            self.pack_pending()
            kernels.insert_token(k, v, *buffers)
            self.on_undo(self._undo_insert)
        else:
            self.write_token_slots(k, v, self._rows)
            self.lengths.add_(1)
            self.on_undo(lambda: self.lengths.sub_(1))
        self.seen_tokens += 1
        self._steps += 1

    def _undo_insert(self) -> None:
        """Undo of the fused insert: ``lengths -= 1``, then the value that left the local window (still in its value
        qbuffer slot) back to its ring slot, the slots computed from the restored lengths (the other writes went to
        slots past each row's length, which nothing reads)."""
        self.lengths.sub_(1)
        S, G, R = self.cfg.sink_tokens, self.cfg.group_size, self.cfg.local_window
        if not R:
            return
        rows, p = self._rows, self.lengths.long()
        m = (p - S).clamp(min=0)
        local, qslot = m % R, (m - R).clamp(min=0) % G
        leaving = ((p >= S) & (m >= R))[:, None, None]
        self.v_local[rows, :, local] = torch.where(leaving, self.v_qbuf[rows, :, qslot], self.v_local[rows, :, local])

    def _pack_args(self, keys: bool = True) -> tuple:
        """The layer's arguments of ``ops.pack_completed``; the query scale only where keys are packed (values never
        read it, and with a query selection it costs kernels)."""
        return (
            self.lengths,
            self.k_qbuf,
            self.v_qbuf,
            self.key_pool.tensors,
            self.value_pool.tensors,
            self.k_page_table,
            self.v_page_table,
            self.layer_idx,
            self.query_scale() if keys else None,
        )

    def pack_pending(self) -> None:
        """Pack every row's key and value qbuffers that the last decode step filled and left (``lengths`` as that
        step left them), predicated on the device like stage 3, for each side a deferred step left since the last
        call (a page packed again gets the same bytes: the qbuffer has not changed). The start of a deferred step,
        and what makes a cache whose steps deferred pages whole again."""
        keys = self._keys_pending and self.key_width > 0
        values = self._values_pending and self.value_width > 0
        if (keys or values) and self.ops.fused_decode and self.is_initialized:
            self.ops.pack_completed(*self._pack_args(keys=keys), keys=keys, values=values)
        self._keys_pending = self._values_pending = False

    def pack_filled(self, filled: None = None) -> None:
        """Stage 3 of a decode step: pack the qbuffers that filled (but the sides :attr:`defer_keys` /
        :attr:`defer_values` leave to the next step), every row predicated on the device."""
        if self.key_width == 0:  # no row can ever complete a page
            return
        if compiling():  # a traceable step (the torch path's pack below is only reached eagerly)
            a = self._op_args
            custom_ops.pack_completed_flat(a.cfg, self.lengths, self.k_qbuf, self.v_qbuf, a.pools, self.k_page_table,
                                           self.v_page_table, self.layer_idx, self.query_scale())  # fmt: skip
            return
        self.on_undo(self._unpoint_completed)  # a packed page lies past the row's old pages: only tables change
        fused = self.ops.fused_decode
        later_keys, later_values = self.defer_keys and fused, self.defer_values and fused
        if later_keys and self.cfg.channel_selection in QUERY_SELECTIONS:
            raise ValueError(
                f"defer_keys: channel_selection={self.cfg.channel_selection!r} ranks key channels with the queries "
                "seen so far, which the next step changes; defer the values only"
            )
        if not (later_keys and later_values):
            self.ops.pack_completed(*self._pack_args(keys=not later_keys), keys=not later_keys, values=not later_values)
        if later_keys or later_values:
            before = self._keys_pending, self._values_pending
            self._keys_pending |= later_keys
            self._values_pending |= later_values
            self.on_undo(lambda: self._set_pending(*before))

    def _set_pending(self, keys: bool, values: bool) -> None:
        self._keys_pending, self._values_pending = keys, values

    def _unpoint_completed(self) -> None:
        """Undo of :meth:`pack_filled` (``lengths`` still count the step's token): the completed pages' table
        entries back to -1."""
        S, G, R = self.cfg.sink_tokens, self.cfg.group_size, self.cfg.local_window
        for table, start in ((self.k_page_table, S), (self.v_page_table, S + R)):
            if table.shape[1]:
                done, j = filled_pages(self.lengths, start, G, table.shape[1])
                table[self._rows, j] = torch.where(done, -1, table[self._rows, j])
