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
function), attends, then calls :meth:`KittyLayer.append`. ``KittyCache`` makes ``config._attn_implementation`` read
``"kitty"`` during its own forward passes only; other caches keep the user's attention implementation.

    model, tok = kitty.load_model()
    cache = kitty.KittyCache(model.config, "kitty")
    out = model.generate(**tok(["Hello"], return_tensors="pt"), cache=cache, max_new_tokens=32)
    print(cache.token_counts(), cache.memory_report().summary())
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from . import attention as kattention
from .compat import get_kv_heads_per_rank, layer_types_and_kwargs
from .config import KVQuantConfig, get_preset, is_int
from .kernels import interpreting
from .memory import MemoryReport, token_layout
from .models import kv_dims
from .quant import KeyPage, ValuePage, quantize_key_page, quantize_value_page, query_scale_from, query_statistic
from .storage import FLOAT_DTYPES, PendingKV, key_page_from_storage, page_fields, pool_fields, value_page_from_storage

BACKENDS = ("auto", "torch", "triton")
LAYER_TYPES = ("full_attention", "sliding_attention")  # Kitty pages, or a bounded full-precision window
QUERY_SELECTIONS = ("query", "oracle")  # channel selections that rank channels with running query statistics
_BEAM_MESSAGE = (
    "KittyCache does not support beam search or other cache reordering (num_beams > 1, contrastive search, "
    "assisted decoding): pages are shared storage indexed per row. Use greedy decoding or sampling (num_beams=1)."
)


def check_triton_backend(cfg: KVQuantConfig, head_dim: int) -> None:
    """Refuse ``backend="triton"`` where it cannot run, before any token is stored: ``NotImplementedError`` without
    the kernels, ``ValueError`` without a CUDA GPU (and not under ``TRITON_INTERPRET=1``) or for a config the fused
    kernel does not handle (``kernels.triton_supports``)."""
    kernels = kattention._kernels(required=True)  # NotImplementedError without Triton
    if not torch.cuda.is_available() and not interpreting():
        raise ValueError(
            "backend='triton' needs a CUDA GPU, and torch sees none (CPU runs need TRITON_INTERPRET=1 set "
            "before triton is imported); use backend='auto' or 'torch'"
        )
    supports = getattr(kernels, "triton_supports", None)
    if supports is not None and not supports(cfg, head_dim):
        raise ValueError(
            f"backend='triton' cannot run group_size={cfg.group_size}, head_dim={head_dim}, "
            f"value_bits={cfg.value_bits} (see kernels.triton_supports); use backend='auto'"
        )


def check_triton_device(device: torch.device) -> None:
    """``ValueError`` if ``backend="triton"`` cannot run on tensors of ``device`` (CPU without the interpreter)."""
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"backend='triton' runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1), got tensors "
            f"on {device}; move the model to the GPU or use backend='auto' or 'torch'"
        )


class PagePool:
    """Page storage of one layer, for keys or for values: tensors ``[P, ...]`` named as in ``docs/LAYOUT.md``.

    Pages are handed out in order (a bump allocator: a page is never freed alone, :meth:`reset` frees them all) and
    the tensors grow by doubling when full, never beyond ``max_pages``. Only ``[:used]`` holds live pages.
    """

    def __init__(
        self,
        fields: dict[str, tuple[tuple[int, ...], torch.dtype]],
        device: torch.device,
        max_pages: int | None,
        kind: str,
    ):
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


@dataclass
class _Undo:
    """How to put one layer back as it was before a step: its bookkeeping then, and undo actions (run newest first).

    Only what a step overwrites while it is still live needs an action: slots past a row's length, pages past a
    pool's ``used`` and page-table entries past a row's pages hold nothing that anything reads.
    """

    forward: int  # the KittyCache forward this step belongs to
    n: list[int]
    lengths: torch.Tensor
    seen_tokens: int
    key_used: int
    value_used: int
    k_page_table: torch.Tensor
    v_page_table: torch.Tensor
    actions: list[Callable[[], None]] = field(default_factory=list)


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
        self._undo: _Undo | None = None  # the open step, if any (see begin_step)
        self._owner: Callable[[], "KittyCache | None"] = lambda: None  # the cache this layer belongs to (weak)

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
        if self.backend == "triton":
            check_triton_device(device)
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
        self._undo = _Undo(
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

    def _pack(
        self, pool: PagePool, table: torch.Tensor, dest: list[tuple[int, int, int]], rows: list[int], keys: bool
    ) -> None:
        """Quantize the full qbuffers of ``rows`` into fresh pages of ``pool`` and point ``table`` at them."""
        idx = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        if self._triton_pack(keys):
            from .kernels import pack_pages

            ids = pool.allocate(len(rows))
            qbuf = self.k_qbuf if keys else self.v_qbuf
            pack_pages(
                self.cfg,
                qbuf if keys else None,
                None if keys else qbuf,
                k_rows=idx if keys else None,
                v_rows=None if keys else idx,
                pool=pool.tensors,
                k_pages=ids if keys else None,
                v_pages=None if keys else ids,
                salt=self.layer_idx,
            )
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
        """Page-table entries ``table[b, first : first + n]`` = the next ``n`` of ``ids``, for each ``dest``."""
        self._on_undo(lambda: [table[b, first : first + n].fill_(-1) for b, first, n in dest])
        i = 0
        for b, first, n in dest:
            table[b, first : first + n] = ids[i : i + n]
            i += n

    def _grow_page_tables(self, key_pages: int, value_pages: int) -> None:
        def grow(table: torch.Tensor, need: int) -> torch.Tensor:
            if need <= table.shape[1]:
                return table
            new = torch.full(
                (table.shape[0], max(need, 2 * table.shape[1])), -1, dtype=torch.int32, device=table.device
            )
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


class SlidingWindowLayer(DynamicSlidingWindowLayer):
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
        self._owner: Callable[[], "KittyCache | None"] = lambda: None  # the cache this layer belongs to (weak)

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


class KittyCache(Cache):
    """A transformers ``Cache`` holding every layer's keys and values in Kitty's paged 2-bit format.

    Args:
        config: the model's config (``model.config``). From this cache's ``update``/``get_mask_sizes`` until the
            layer's attention returns, the config's ``_attn_implementation`` reads ``"kitty"`` (on that thread), so
            the model picks ``kitty.attention`` and its mask; at any other time it reads what the user set (eager,
            sdpa, ...), which other caches run.
        cfg: a :class:`KVQuantConfig` or a preset name from ``kitty.PRESETS`` (e.g. ``"kitty"``, ``"fp16"``).
        backend: ``"auto"`` (Triton on CUDA tensors, else torch), ``"torch"`` or ``"triton"``; ``None`` (default):
            the environment variable ``KITTY_BACKEND``, else ``"auto"``. ``"triton"`` is refused here, with a
            message, where it cannot run (no kernels, no GPU, a config the kernel does not handle).
        max_pages: most pages each layer's key pool (and, separately, value pool) may hold, summed over rows;
            ``None`` grows on demand. Running out raises ``RuntimeError`` and leaves the cache unchanged.
        max_cache_len, max_batch_size: build a static cache (``kitty.static``, transformers ``StaticCache``'s
            names): every tensor preallocated for the first batch (at most ``max_batch_size`` rows) and
            ``max_cache_len`` columns, decode steps free of host synchronization (capturable in a CUDA graph).

    Use as ``model.generate(**inputs, cache=cache)`` (or ``past_key_values=cache``); call :meth:`reset` before
    reusing it for a new prompt. Batches may be left-padded: padding is never stored. Greedy decoding and sampling
    work; beam search raises ``NotImplementedError``. A step that raises inside the cache or its attention (bad
    input, a full pool, a failing kernel in any layer) leaves every layer as it was before that forward pass.
    Keys and values must be float16, bfloat16 or float32 (a float64 model is refused at its first forward pass).

    One cache serves one generation at a time: a forward pass entering it from a second thread while another
    thread's pass is still open raises ``RuntimeError`` (use one cache per thread, e.g. ``kitty.make_cache`` per
    request). Successive steps may come from different threads (a streaming server's worker pool).
    """

    def __init__(
        self,
        config,
        cfg: KVQuantConfig | str = "kitty",
        backend: str | None = None,
        max_pages: int | None = None,
        max_batch_size: int | None = None,
        max_cache_len: int | None = None,
    ):
        if isinstance(cfg, str):
            cfg = get_preset(cfg)
        if not isinstance(cfg, KVQuantConfig):
            raise ValueError(f"cfg must be a KVQuantConfig or a preset name, got {type(cfg).__name__}")
        backend = kattention.requested_backend(backend)
        from .static import check_static_args, static_layers

        static = check_static_args(max_batch_size, max_cache_len, max_pages)
        if max_pages is not None and (not is_int(max_pages) or max_pages < 1):
            raise ValueError(f"max_pages must be a positive integer or None, got {max_pages!r}")
        text = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = layer_types_and_kwargs(text)
        unsupported = sorted(set(layer_types) - set(LAYER_TYPES))
        if unsupported:
            raise ValueError(f"KittyCache supports layer types {LAYER_TYPES}, config has {unsupported}")
        for i, (kind, kw) in enumerate(zip(layer_types, layer_kwargs)):
            window = kw.get("sliding_window")
            # transformers keeps the newest ``window - 1`` columns: a window below 2 would keep everything
            if kind == "sliding_attention" and (not isinstance(window, int) or isinstance(window, bool) or window < 2):
                raise ValueError(f"config.sliding_window must be an integer >= 2 for sliding layer {i}, got {window!r}")
        num_layers, num_kv_heads, head_dim = kv_dims(text)
        cfg.check_head_dim(head_dim)
        tp_size = self._tp_size(config, text, num_kv_heads)
        if backend == "triton":
            check_triton_backend(cfg, head_dim)
        self.cfg, self.backend, self.max_pages = cfg, backend, max_pages
        self.head_dim, self.num_layers, self.tp_size = head_dim, num_layers, tp_size
        self.num_kv_heads = num_kv_heads // tp_size  # this rank's KV heads (each layer re-sizes from its tensors)
        self.layer_types = list(layer_types)
        layers = [
            KittyLayer(cfg.for_layer(i, num_layers), self.num_kv_heads, head_dim, i, backend, max_pages, num_kv_heads)
            if kind == "full_attention"
            else SlidingWindowLayer(kw["sliding_window"], num_kv_heads, tp_size)
            for i, (kind, kw) in enumerate(zip(layer_types, layer_kwargs))
        ]
        if static:  # every tensor preallocated, decode steps capturable (kitty.static)
            layers = static_layers(
                cfg,
                layer_types,
                layer_kwargs,
                self.num_kv_heads,
                num_kv_heads,
                head_dim,
                backend,
                tp_size,
                max_cache_len,
                max_batch_size,
            )
        # held privately: older transformers releases (5.17) define read-only Cache.max_batch_size/max_cache_len
        self._max_batch_size, self._max_cache_len = max_batch_size, max_cache_len
        if not any(kind == "full_attention" for kind in layer_types):
            warnings.warn(
                "every layer of this model is a sliding-window layer: KittyCache quantizes nothing here "
                "(each window is held in full precision, as DynamicCache holds it)",
                stacklevel=2,
            )
        super().__init__(layers=layers)
        owner = weakref.ref(self)
        for layer in layers:
            layer._owner = owner
        self._forward, self._last_layer = 0, num_layers  # forward passes seen, and the last layer updated
        self._pass_thread: int | None = None  # the thread whose forward pass is open (None between passes)
        self._pass_lock = threading.Lock()
        kattention.use_kitty_attention(config)
        if text is not config:
            kattention.use_kitty_attention(text)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Layer ``layer_idx``'s pending keys/values (see :meth:`KittyLayer.update`); a bad input here also rolls
        back the layers this forward pass already changed."""
        with self._pass_lock:  # layers of two threads interleaved in one cache would give garbage: refuse them
            me = threading.get_ident()
            if self._pass_thread not in (None, me):
                raise RuntimeError(
                    "this KittyCache is in use by a forward pass of another thread: use one cache per thread "
                    "(kitty.make_cache), or call cache.reset() if that pass was abandoned"
                )
            if layer_idx <= self._last_layer:  # layers run in order: back at (or before) the start is a new pass
                self._forward += 1
            self._last_layer, self._pass_thread = layer_idx, me
        kattention.kitty_forward(True)
        try:
            if key_states.dtype not in FLOAT_DTYPES:  # at the first forward pass, before any token is generated
                raise ValueError(
                    f"key_states must be one of {FLOAT_DTYPES}, got {key_states.dtype}: KittyCache stores 16- or "
                    "32-bit floats; load the model with dtype=torch.float32 (or bfloat16/float16)"
                )
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException:
            self.rollback_forward()
            raise
        finally:  # a last sliding layer's window is handed over here (a Kitty layer closes in end_step)
            if layer_idx == self.num_layers - 1 and not isinstance(self.layers[layer_idx], KittyLayer):
                self._pass_thread = None

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        sizes = super().get_mask_sizes(query_length, layer_idx)
        kattention.kitty_forward(True)  # transformers picks the mask function right after: the "kitty" one
        return sizes

    def begin_step(self, layer: KittyLayer) -> None:
        """Open ``layer``'s step within the current forward pass (called by the attention function)."""
        layer.begin_step(self._forward)

    def end_step(self, layer: KittyLayer) -> None:
        """``layer``'s step succeeded: Kitty attention is switched off until the next layer's :meth:`update`, and
        after the last layer the whole pass is kept (the undo records of every layer are dropped)."""
        kattention.kitty_forward(False)
        if layer.layer_idx == self.num_layers - 1:
            for other in self.layers:
                other.end_step()
            self._pass_thread = None

    def rollback_forward(self) -> None:
        """Put every layer the current forward pass changed back as it was before the pass."""
        for layer in self.layers:
            if layer._undo is not None and layer._undo.forward == self._forward:
                layer.rollback_step()
        kattention.kitty_forward(False)
        self._pass_thread = None

    @staticmethod
    def _tp_size(config, text, num_kv_heads: int) -> int:
        """Tensor-parallel ranks sharing the KV heads (``from_pretrained(..., tp_plan="auto")`` records them in
        ``config.distributed_config``); ``ValueError`` when the heads do not split evenly over them."""
        dist = getattr(config, "distributed_config", None) or getattr(text, "distributed_config", None)
        tp_size = getattr(dist, "tp_size", None) or 1
        if tp_size == 1:
            return 1
        plan = getattr(text, "base_model_tp_plan", None) or {}
        per_rank = get_kv_heads_per_rank(plan, num_kv_heads, tp_size)
        if per_rank is None:
            raise ValueError(
                f"the model's {num_kv_heads} KV heads do not divide by the tensor-parallel size "
                f"tp_size={tp_size}: every rank must hold whole, equal KV heads; choose a tp_size dividing "
                f"{num_kv_heads}"
            )
        return num_kv_heads // per_rank

    def reset(self) -> None:
        """Drop every cached token (page pools keep their storage); the cache can take a new batch."""
        super().reset()
        self._last_layer, self._pass_thread = self.num_layers, None
        kattention.kitty_forward(False)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(_BEAM_MESSAGE)

    @property
    def max_batch_size(self) -> int | None:
        """Most rows a static cache takes (``None``: a growing cache)."""
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int | None:
        """Columns (padding included) a static cache holds per row (``None``: a growing cache)."""
        return self._max_cache_len

    @property
    def lengths(self) -> list[int]:
        """Valid (non-padding) tokens cached per row (in a model of sliding layers only: columns fed, padding
        included, since transformers' window keeps padding columns)."""
        layer = self._paged_layer()
        if layer is not None:
            return list(layer._n)
        first = self.layers[0]
        return [first.cumulative_length] * (first.keys.shape[0] if first.is_initialized else 0)

    def _paged_layer(self) -> KittyLayer | None:
        """The first full-attention (Kitty) layer; every such layer holds the same tokens."""
        return next((layer for layer in self.layers if isinstance(layer, KittyLayer)), None)

    def token_counts(self, per_row: bool = False) -> dict[str, int] | list[dict[str, int]]:
        """Tokens per place (first layer; all layers hold the same): sink, key_pages, key_qbuffer, value_pages,
        value_qbuffer, local and tokens. ``key_pages``/``value_pages`` count tokens (pages x G), read from the page
        tables (full-attention layers; sliding-window layers hold their window in full precision). Summed over rows
        unless ``per_row``.
        """
        layer = self._paged_layer()
        G = self.cfg.group_size
        rows = []
        for b, n in enumerate(layer._n if layer is not None else []):
            lay = token_layout(self.cfg, n)
            pk = int((layer.k_page_table[b] >= 0).sum()) if layer.is_initialized else 0
            pv = int((layer.v_page_table[b] >= 0).sum()) if layer.is_initialized else 0
            rows.append(
                {
                    "tokens": n,
                    "sink": lay.sink,
                    "key_pages": pk * G,
                    "key_qbuffer": n - lay.sink - pk * G,
                    "value_pages": pv * G,
                    "value_qbuffer": n - lay.sink - pv * G - lay.local,
                    "local": lay.local,
                }
            )
        if per_row:
            return rows
        keys = ("tokens", "sink", "key_pages", "key_qbuffer", "value_pages", "value_qbuffer", "local")
        return {k: sum(r[k] for r in rows) for k in keys}

    def memory_report(self) -> MemoryReport:
        """A :class:`kitty.memory.MemoryReport` over all layers from the real ``nbytes`` of live data.

        Equals ``kitty.memory.analytic_report(cfg, cache.lengths, head_dim, num_kv_heads, num_layers, dtype_bytes)``
        for a model of full-attention layers; sliding-window layers add their keys and values as ``window_bytes``.
        Under tensor parallelism the bytes are this rank's and ``ranks``/``total_stored_bytes`` cover all ranks.
        """
        reports = [layer.memory_report() for layer in self.layers]
        total = sum(reports[1:], reports[0])
        return replace(total, tokens=sum(self.lengths))  # tokens per layer, summed over rows
