"""KittyCache: a paged 2-bit KV cache for Hugging Face ``generate`` (paper: arXiv 2511.18643, §4.2–4.3).

Per decoder layer, per batch row, tokens live in the places of the paper's runtime pipeline
(storage names and shapes: ``docs/LAYOUT.md``; counts: :func:`kitty.core.memory.token_layout`)::

    keys:   sink [0, S) | key pages (G tokens each, 2-bit + boosted channels) | key qbuffer (< G, full precision)
    values: sink [0, S) | value pages (G tokens each, 2-bit per token)      | value qbuffer | local (newest R)

1. insert: new tokens enter the sink, the key qbuffer and the value local window in full precision; the oldest
   local value moves to the value qbuffer;
2. attend: ``kitty.cache.attention`` reads sink | pages | qbuffer (| local) and the new tokens;
3. quantize: a qbuffer that holds G tokens becomes one page from the layer's page pool (``kitty.core.quant``); its
   pool id is appended to the row's page table and the qbuffer is cleared.

The only per-row state is ``lengths[b]``: valid tokens cached in row b. Padding is never stored, so it never enters
a page's statistics. Quantized tokens exist only as pages: no full-precision copy is kept.

How it plugs into transformers 5.x: ``KittyLayer.update`` does not store anything; it returns a :class:`PendingKV`
handle (for both keys and values) that the attention function registered as ``"kitty"`` (``kitty.cache.attention``)
receives instead of tensors. That function knows the padding of the new tokens (from the ``"kitty"`` mask
function), attends, then calls :meth:`KittyLayer.append`. ``KittyCache`` makes ``config._attn_implementation`` read
``"kitty"`` during its own forward passes only; other caches keep the user's attention implementation.

    model, tok = kitty.load_model()
    cache = kitty.KittyCache(model.config, "kitty")
    out = model.generate(**tok(["Hello"], return_tensors="pt"), **kitty.hf.compat.cache_kwargs(cache), max_new_tokens=32)
    print(cache.token_counts(), cache.memory_report().summary())
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from contextlib import contextmanager
from dataclasses import replace

import torch
from transformers.cache_utils import Cache

from ..core.config import KVQuantConfig, get_preset, is_int, kv_dims
from ..core.memory import MemoryReport, analytic_report, token_layout
from ..core.storage import FLOAT_DTYPES
from ..hf.compat import StaticCacheSizes, generate_cache_columns, get_kv_heads_per_rank, layer_types_and_kwargs
from . import attention as kattention
from .backend import check_triton, requested_backend
from .layer import KittyLayer, PagedLayer
from .static import StaticKittyLayer, check_static_args
from .step import BEAM_MESSAGE, new_batch_error
from .window import SlidingWindowLayer, StaticSlidingLayer

__all__ = ["KittyCache", "KittyLayer", "SlidingWindowLayer", "build_layers", "start_generation"]

LAYER_TYPES = ("full_attention", "sliding_attention")  # Kitty pages, or a bounded full-precision window


def build_layers(
    cfg: KVQuantConfig,
    layer_types: list[str],
    layer_kwargs: list[dict],
    num_kv_heads: int,
    model_kv_heads: int,
    head_dim: int,
    backend: str,
    tp_size: int,
    max_pages: int | None = None,
    max_cache_len: int | None = None,
    max_batch_size: int | None = None,
) -> list:
    """The layers of a ``KittyCache``, one per entry of ``layer_types``: Kitty pages for full attention, a
    full-precision window for sliding attention; growing layers (:class:`KittyLayer`, :class:`SlidingWindowLayer`),
    or static ones when ``max_cache_len`` is given (:class:`kitty.cache.static.StaticKittyLayer`,
    :class:`kitty.cache.window.StaticSlidingLayer`). ``num_kv_heads``: this rank's KV heads, ``model_kv_heads`` the
    model's."""
    n = len(layer_types)
    static = max_cache_len is not None

    def build(i: int, kind: str, kw: dict):
        layer_cfg = cfg.for_layer(i, n)
        if kind == "full_attention" and static:
            return StaticKittyLayer(
                layer_cfg, num_kv_heads, head_dim, i, backend, model_kv_heads, max_cache_len, max_batch_size
            )
        if kind == "full_attention":
            return KittyLayer(layer_cfg, num_kv_heads, head_dim, i, backend, max_pages, model_kv_heads)
        if static:
            return StaticSlidingLayer(max_cache_len, kw["sliding_window"], model_kv_heads, tp_size)
        return SlidingWindowLayer(kw["sliding_window"], model_kv_heads, tp_size)

    return [build(i, kind, kw) for i, (kind, kw) in enumerate(zip(layer_types, layer_kwargs))]


def check_config(config) -> None:
    """``ValueError`` unless ``config`` is a transformers model config (``model.config``), not the model itself."""
    if isinstance(config, torch.nn.Module) or not hasattr(config, "get_text_config"):
        got = (
            "the model"
            if isinstance(config, torch.nn.Module)
            else repr(config)
            if config is None
            else type(config).__name__
        )
        raise ValueError(f"config must be the model's transformers config: pass model.config, got {got}")


def device_memory_bytes() -> int:
    """The most memory one device here offers: the largest CUDA GPU's, or the host's RAM (what a static cache
    could at best be allocated in)."""
    sizes = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    try:
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # no sysconf (not POSIX): trust the GPUs, or refuse nothing
        pass
    return max(sizes, default=0)


def static_bytes(
    cfg: KVQuantConfig,
    layer_types: list[str],
    layer_kwargs: list[dict],
    num_kv_heads: int,
    head_dim: int,
    max_cache_len: int,
    rows: int,
    dtype_bytes: int = 2,
) -> int:
    """A lower bound on the bytes a static cache preallocates: every full layer's pages and buffers for
    ``max_cache_len`` tokens per row, every window layer's ``min(window, max_cache_len)`` columns (keys and values,
    ``dtype_bytes`` per element)."""
    n = len(layer_types)
    total = 0
    for i, kind in enumerate(layer_types):
        if kind == "full_attention":
            total += analytic_report(cfg.for_layer(i, n), [max_cache_len], head_dim, num_kv_heads).stored_bytes * rows
    for kind, kw in zip(layer_types, layer_kwargs):
        if kind != "full_attention":
            total += 2 * min(kw["sliding_window"], max_cache_len) * num_kv_heads * head_dim * dtype_bytes * rows
    return total


def check_static_bytes(
    cfg: KVQuantConfig,
    layer_types: list[str],
    layer_kwargs: list[dict],
    num_kv_heads: int,
    head_dim: int,
    max_cache_len: int,
    rows: int,
) -> None:
    """``ValueError`` naming ``max_cache_len`` when the static cache could not fit on any device here."""
    need, have = (
        static_bytes(cfg, layer_types, layer_kwargs, num_kv_heads, head_dim, max_cache_len, rows),
        device_memory_bytes(),
    )
    if have and need > have:
        raise ValueError(
            f"max_cache_len={max_cache_len} (x {rows} rows) would preallocate at least {need / 2**30:,.1f} GiB of "
            f"cache, more than the {have / 2**30:,.1f} GiB of the largest device here: give a max_cache_len of "
            "prompt + max_new_tokens columns"
        )


def start_generation(cache, columns: int | None = None) -> None:
    """Check that ``cache`` (any transformers cache) can start a new generation of ``columns`` cache columns
    (prompt + new tokens - 1), before anything runs: a :class:`KittyCache` is claimed
    (:meth:`KittyCache.start_generation`); another cache must be empty (``ValueError``: call ``cache.reset()``, since
    positions would restart at 0 over its cached columns) and, if static, hold ``columns``."""
    if isinstance(cache, KittyCache):
        cache.start_generation(columns)
        return
    held = cache.get_seq_length()
    if held:
        raise ValueError(
            f"the cache holds {held} columns of an earlier generation: call cache.reset() before a new prompt "
            "(or pass a fresh cache)"
        )
    limit = getattr(cache, "max_cache_len", None)
    if limit is not None and limit < 0:  # transformers 5.17: -1 for a growing (DynamicCache) cache
        limit = None
    if limit is None and getattr(cache, "is_compileable", False):
        limit = next((getattr(layer, "max_cache_len", None) for layer in cache.layers), None)
    if limit is not None and columns is not None and columns > limit:
        raise ValueError(
            f"this generation needs {columns} cache columns (prompt + max_new_tokens - 1), the cache holds "
            f"max_cache_len={limit}: build the cache with max_cache_len >= {columns} or lower max_new_tokens"
        )


@torch.compiler.disable
def _eager_update(cache, key_states, value_states, layer_idx: int, *args, **kwargs):
    """:meth:`KittyCache.update` outside the graph of a compiled forward pass (a prompt, a growing or window layer):
    its host bookkeeping and first allocations run eagerly, so that no compiled graph (or CUDA graph) owns them."""
    return cache._update(key_states, value_states, layer_idx, *args, **kwargs)


class KittyCache(StaticCacheSizes, Cache):
    """A transformers ``Cache`` holding every layer's keys and values in Kitty's paged 2-bit format.

    Args:
        config: the model's config (``model.config``). From this cache's ``update``/``get_mask_sizes`` until the
            layer's attention returns, the config's ``_attn_implementation`` reads ``"kitty"`` (on that thread), so
            the model picks ``kitty.cache.attention`` and its mask; at any other time it reads what the user set (eager,
            sdpa, ...), which other caches run.
        cfg: a :class:`KVQuantConfig` or a preset name from ``kitty.PRESETS`` (e.g. ``"kitty"``, ``"fp16"``).
        backend: ``"auto"`` (Triton on CUDA tensors, else torch), ``"torch"`` or ``"triton"``; ``None`` (default):
            the environment variable ``KITTY_BACKEND``, else ``"auto"``. ``"triton"`` is refused here, with a
            message, where it cannot run (no kernels, no GPU, a config the kernel does not handle).
        max_pages: most pages each layer's key pool (and, separately, value pool) may hold, summed over rows;
            ``None`` grows on demand. Running out raises ``RuntimeError`` and leaves the cache unchanged.
        max_cache_len, max_batch_size: build a static cache (``kitty.cache.static``, transformers ``StaticCache``'s
            names): every tensor preallocated for the first batch (at most ``max_batch_size`` rows) and
            ``max_cache_len`` columns, decode steps free of host synchronization (capturable in a CUDA graph).

    Use as ``model.generate(**inputs, **kitty.hf.compat.cache_kwargs(cache))`` (``cache=`` from transformers 5.24, ``past_key_values=`` before); call :meth:`reset` before
    reusing it for a new prompt. Batches may be left-padded: padding is never stored. Greedy decoding and sampling
    work; beam search raises ``NotImplementedError``. A step that raises inside the cache or its attention (bad
    input, a full pool, a failing kernel in any layer) leaves every layer as it was before that forward pass.
    Keys and values must be float16, bfloat16 or float32 (a float64 model is refused at its first forward pass).

    A static cache works under ``torch.compile``: ``model.generate`` compiles its decode steps itself on CUDA
    (``generation_config.compile_config``), and a user may compile ``model.forward`` (``mode="reduce-overhead"``
    included) or a gpt-fast style one-token step. Run the prompt eagerly where you can (``generate`` does; a compiled
    forward that gets the prompt runs Kitty's part of it outside the graph). A compiled decode step is one graph with
    no host work: it takes no lock, keeps no rollback record and checks no room (size ``max_cache_len`` for the whole
    generation), and the host counters (``get_seq_length``, :attr:`lengths`) are read back from the device when next
    asked (``docs/ARCHITECTURE.md``, "What happens under torch.compile"). Only the fused (Triton) backend's decode step
    is traced; the torch backend's, a prompt's and a window layer's run eagerly outside the graph.

    One cache serves one generation at a time: a forward pass entering it from a second thread while another
    thread's pass is still open raises ``RuntimeError`` (use one cache per thread, e.g. ``kitty.make_cache`` per
    request). Successive steps may come from different threads (a streaming server's worker pool), but a prompt
    from a thread other than the one whose generation the cache holds raises ``RuntimeError``, and the loops of
    ``kitty.hf.generate`` claim the cache (:meth:`start_generation`): a second generation before :meth:`reset` is
    refused whatever the timing.
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
        check_config(config)
        if isinstance(cfg, str):
            cfg = get_preset(cfg)
        if not isinstance(cfg, KVQuantConfig):
            raise ValueError(f"cfg must be a KVQuantConfig or a preset name, got {type(cfg).__name__}")
        backend = requested_backend(backend)
        if check_static_args(max_batch_size, max_cache_len, max_pages) and cfg.key_rounding != "nearest":
            # a static step packs pages inside the step without the queries' second moment
            raise ValueError(f"cfg.key_rounding={cfg.key_rounding!r} needs a dynamic cache (no max_cache_len)")
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
        if backend in ("triton", "gluon"):
            check_triton(cfg, head_dim, backend=backend)
        if max_cache_len is not None:
            check_static_bytes(
                cfg, layer_types, layer_kwargs, num_kv_heads // tp_size, head_dim, max_cache_len, max_batch_size or 1
            )
        self.cfg, self.backend, self.max_pages = cfg, backend, max_pages
        self.head_dim, self.num_layers, self.tp_size = head_dim, num_layers, tp_size
        self.num_kv_heads = num_kv_heads // tp_size  # this rank's KV heads (each layer re-sizes from its tensors)
        self.layer_types = list(layer_types)
        layers = build_layers(
            cfg,
            layer_types,
            layer_kwargs,
            self.num_kv_heads,
            num_kv_heads,
            head_dim,
            backend,
            tp_size,
            max_pages,
            max_cache_len,
            max_batch_size,
        )
        self.hold_static_sizes(max_batch_size, max_cache_len)
        if not any(kind == "full_attention" for kind in layer_types):
            warnings.warn(
                "every layer of this model is a sliding-window layer: KittyCache quantizes nothing here "
                "(each window is held in full precision, as DynamicCache holds it)",
                stacklevel=2,
            )
        super().__init__(layers=layers)
        for layer in layers:
            layer.attach(self)
        self._forward, self._last_layer = 0, num_layers  # forward passes seen, and the last layer updated
        self._pass_thread: int | None = None  # the thread whose forward pass is open (None between passes)
        self._pass_lock = threading.Lock()
        # the generation this cache holds since the last reset(): the thread whose prompt started it, and whether a
        # generation loop claimed it (start_generation)
        self._owner: int | None = None
        self._claimed = False
        kattention.use_kitty_attention(config)
        if text is not config:
            kattention.use_kitty_attention(text)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Layer ``layer_idx``'s pending keys/values (see :meth:`KittyLayer.update`); a bad input here also rolls
        back the layers this forward pass already changed.

        While ``torch.compile`` traces the forward pass, a static layer's decode step takes
        :meth:`StaticKittyLayer.traced_update` (no lock, no pass bookkeeping, no host counter: none of it could be
        traced, and a Python integer read would be guarded and change at every step); anything else (a prompt, a
        growing or window layer) runs this method eagerly, outside the graph (``torch.compiler.disable``)."""
        if torch.compiler.is_compiling():
            layer = self.layers[layer_idx]
            if isinstance(layer, StaticKittyLayer) and layer.traceable and key_states.shape[2] == 1:
                kattention.kitty_forward(True)
                return layer.traced_update(key_states, value_states)
            return _eager_update(self, key_states, value_states, layer_idx, *args, **kwargs)
        return self._update(key_states, value_states, layer_idx, *args, **kwargs)

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        with self._pass_lock:  # layers of two threads interleaved in one cache would give garbage: refuse them
            me = threading.get_ident()
            if self._pass_thread not in (None, me):
                raise RuntimeError(
                    "this KittyCache is in use by a forward pass of another thread: use one cache per thread "
                    "(kitty.make_cache), or call cache.reset() if that pass was abandoned"
                )
            if layer_idx <= self._last_layer:  # layers run in order: back at (or before) the start is a new pass
                self._check_owner(me, key_states)
                self._check_static_room(key_states)
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
            if layer_idx == self.num_layers - 1 and not isinstance(self.layers[layer_idx], PagedLayer):
                self._pass_thread = None

    def _check_owner(self, me: int, key_states) -> None:
        """At the start of a forward pass (lock held): a prompt (several new tokens) from a thread other than the
        one whose generation the cache holds would be stored on top of that generation's tokens; refuse it.
        Single-token steps may come from any thread (a streaming server's worker pool)."""
        shape = getattr(key_states, "shape", ())
        prompt = len(shape) == 4 and shape[2] > 1
        held = self._claimed or self.get_seq_length() > 0
        if self._owner is not None and self._owner != me and prompt and held:
            raise RuntimeError(
                f"this KittyCache holds a generation started on another thread ({self.get_seq_length()} columns "
                "cached): a second prompt would be stored on top of it; call cache.reset() first, or use one cache "
                "per generation (kitty.make_cache)"
            )
        if self._owner is None or (prompt and not held):
            self._owner = me

    def _check_static_room(self, key_states) -> None:
        """At the start of a forward pass of a static cache: ``ValueError`` if the new columns exceed
        ``max_cache_len``, before any layer changes (a window layer, written in place, could not be put back)."""
        shape = getattr(key_states, "shape", ())
        if self.max_cache_len is None or len(shape) != 4:
            return
        fed = self.get_seq_length()
        rows = len(self.lengths) if fed else shape[0]
        if shape[0] != rows:  # a new batch: reset() is the advice, whatever room it would need
            raise new_batch_error(rows, shape[0])
        if fed + shape[2] > self.max_cache_len:
            raise ValueError(
                f"{fed} columns cached + {shape[2]} new exceed max_cache_len={self.max_cache_len}; build the cache "
                "with a larger max_cache_len (prompt columns, padding included, plus new tokens)"
            )

    def start_generation(self, columns: int | None = None) -> None:
        """Claim this cache for one generation (the generation loops of ``kitty.hf.generate`` call it first).

        ``ValueError`` if the cache holds tokens (call :meth:`reset` first) or, for a static cache, if ``columns``
        (prompt columns + new tokens - 1) exceed ``max_cache_len``; ``RuntimeError`` if another generation claimed
        it since the last :meth:`reset`, whichever thread or timing (one cache per generation)."""
        if self.max_cache_len is not None and columns is not None and columns > self.max_cache_len:
            raise ValueError(
                f"this generation needs {columns} cache columns (prompt + max_new_tokens - 1), the cache holds "
                f"max_cache_len={self.max_cache_len}: build the cache with max_cache_len >= {columns} or lower "
                "max_new_tokens"
            )
        with self._pass_lock:
            if self._claimed or self._pass_thread is not None:
                raise RuntimeError(
                    "this KittyCache is in use by another generation (claimed since its last reset()): use one cache "
                    "per generation (kitty.make_cache), or call cache.reset() once that generation is over"
                )
            if self.get_seq_length() > 0:
                raise ValueError(
                    f"the cache holds {self.get_seq_length()} columns of an earlier generation: call cache.reset() "
                    "before a new prompt (or pass a fresh cache, kitty.make_cache)"
                )
            self._claimed, self._owner = True, threading.get_ident()

    @property
    def _is_user_defined(self) -> bool:
        return getattr(self, "_user_defined", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        """``generate`` marks a cache the user passed before its first forward pass; a static cache then checks the
        columns this generation needs (prompt + max_new_tokens - 1, read by
        :func:`kitty.hf.compat.generate_cache_columns`), so that a cache too small fails before any token rather
        than after N."""
        self._user_defined = value
        if self.max_cache_len is None:
            return
        need = generate_cache_columns(sys._getframe(1))
        if need is not None and need > self.max_cache_len:
            raise ValueError(
                f"this generate call needs {need} cache columns (prompt + max_new_tokens - 1), the cache holds "
                f"max_cache_len={self.max_cache_len}: build the cache with max_cache_len >= {need} or lower "
                "max_new_tokens"
            )

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        sizes = super().get_mask_sizes(query_length, layer_idx)
        kattention.kitty_forward(True)  # transformers picks the mask function right after: the "kitty" one
        if not torch.compiler.is_compiling():  # a compiled step checks no mask (it would read the host)
            kattention.mask_owner(self)
        return sizes

    def check_decode_mask(self, mask: kattention.KittyMask) -> None:
        """A static cache stores every row's token in a one-token step: ``ValueError`` (from
        :meth:`KittyMask.check_decode_column`) when ``mask`` marks that token as padding in some row. Called by the
        mask function, before any layer of the forward pass changes. Also ``ValueError`` when the cache has no room
        for the token: a compiled step (whose mask ``generate`` builds eagerly) checks none itself."""
        layer = self._paged_layer()
        if self.max_cache_len is None or layer is None or not layer.is_initialized:
            return
        layer.check_room(1)
        mask.check_decode_column(layer.seen_tokens)

    def begin_step(self, layer) -> None:
        """Open ``layer``'s step within the current forward pass."""
        layer.begin_step(self._forward)

    @contextmanager
    def layer_step(self, layer: PagedLayer):
        """``layer``'s step within the current forward pass (the attention function's body): opened before
        anything changes, kept on success (:meth:`end_step`), and on any exception every layer this pass changed
        rolls back (:meth:`rollback_forward`)."""
        self.begin_step(layer)
        try:
            yield
        except BaseException:
            self.rollback_forward()
            raise
        self.end_step(layer)

    def end_step(self, layer: PagedLayer) -> None:
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
            if layer.step_forward == self._forward:
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
        self._owner, self._claimed = None, False
        kattention.kitty_forward(False)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(BEAM_MESSAGE)

    @property
    def lengths(self) -> list[int]:
        """Valid (non-padding) tokens cached per row (in a model of sliding layers only: columns fed, padding
        included, since transformers' window keeps padding columns)."""
        layer = self._paged_layer()
        if layer is not None:
            return layer.host_lengths
        first = self.layers[0]  # a window layer: columns fed (a static window counts them on the host)
        return [first.get_seq_length()] * (first.keys.shape[0] if first.is_initialized else 0)

    def _paged_layer(self) -> PagedLayer | None:
        """The first full-attention (Kitty) layer; every such layer holds the same tokens."""
        return next((layer for layer in self.layers if isinstance(layer, PagedLayer)), None)

    def token_counts(self, per_row: bool = False) -> dict[str, int] | list[dict[str, int]]:
        """Tokens per place (first layer; all layers hold the same): sink, key_pages, key_qbuffer, value_pages,
        value_qbuffer, local and tokens. ``key_pages``/``value_pages`` count tokens (pages x G), read from the page
        tables (full-attention layers; sliding-window layers hold their window in full precision). Summed over rows
        unless ``per_row``.
        """
        layer = self._paged_layer()
        G = self.cfg.group_size
        if layer is None:  # window layers only: every token is held in full precision in the window
            zero = dict.fromkeys(("sink", "key_pages", "key_qbuffer", "value_pages", "value_qbuffer", "local"), 0)
            window = [{"tokens": n, **zero} for n in self.lengths]
            return window if per_row else {"tokens": sum(self.lengths), **zero}
        rows = []
        for b, n in enumerate(layer.host_lengths if layer is not None else []):
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
        """A :class:`kitty.core.memory.MemoryReport` over all layers from the real ``nbytes`` of live data.

        Equals ``kitty.core.memory.analytic_report(cfg, cache.lengths, head_dim, num_kv_heads, num_layers, dtype_bytes)``
        for a model of full-attention layers; sliding-window layers add their keys and values as ``window_bytes``.
        Under tensor parallelism the bytes are this rank's and ``ranks``/``total_stored_bytes`` cover all ranks.
        """
        reports = [layer.memory_report() for layer in self.layers]
        total = sum(reports[1:], reports[0])
        return replace(total, tokens=sum(self.lengths))  # tokens per layer, summed over rows
