"""Every difference between the transformers releases Kitty admits (``transformers>=5.17,<6``), in one place.

Each entry names the releases that differ and what Kitty does on each; the rest of the library imports these
names and never tests a version itself. CI runs the cache, generate and CLI tests on the lower bound (5.17, the
GPU image's release), on 5.23 (the last release without ``cache=``) and on the newest release.

- How a cache reaches a forward or ``generate``: 5.24 renamed ``past_key_values=`` to ``cache=`` (the old name
  still works there, with a ``FutureWarning``). Earlier forwards take ``**kwargs`` and *silently ignore* ``cache=``
  (the model then decodes without any cache), so the name is chosen here per release: :func:`cache_kwargs`.
- The layer types and cache-layer arguments of a config (``cache_utils.get_layer_types_and_kwargs``): up to 5.18
  the arguments come as one dict shared by every layer, from 5.19 as one dict per layer:
  :func:`layer_types_and_kwargs` always returns one dict per layer.
- ``distributed.tensor_parallel.get_kv_heads_per_rank`` (KV heads per tensor-parallel rank) exists from 5.20:
  :func:`get_kv_heads_per_rank` is transformers' own where it exists, else :func:`kv_heads_per_rank` (the same rule).
- ``Cache.max_batch_size`` / ``Cache.max_cache_len``: 5.17 defines both as read-only (deprecated) properties of
  every cache, so a subclass cannot assign them; 5.23 and later have neither. :class:`StaticCacheSizes` gives a
  cache its own read-only properties over the values it was built with, on every release.
- A static cache's mask in ``generate``: 5.18-5.23 prepare a static (compileable) cache's mask ahead of the forward
  and, given the ``"kitty"`` mask function's object (``kitty.cache.attention.KittyMask``), call tensor methods on it
  (``.contiguous()``); 5.17 and 5.24 pass it through. ``KittyMask`` answers those methods with itself.
- The columns a ``generate`` call needs: no public API tells a user-supplied cache how long the call will run.
  Every admitted release (5.17 to 5.25 tested) marks such a cache with ``cache._is_user_defined = True`` from
  ``GenerationMixin._prepare_cache_for_generation``, whose argument ``max_cache_length`` is prompt +
  ``max_new_tokens`` - 1. :func:`generate_cache_columns` reads that argument from the caller's frame and returns
  ``None`` on a release that no longer has it; the static cache's up-front room check then simply does not run,
  and a too-small cache fails at the step that overflows, as before.
- The attention implementation of a config: :func:`attention_implementation` sets it for a block and puts the
  user's back (``config._attn_implementation``, which every admitted release reads at each forward).

Everything else Kitty uses (``AttentionInterface``, ``AttentionMaskInterface``, ``sdpa_mask``,
``sdpa_attention_forward``, ``Cache``/``CacheLayerMixin``/``DynamicSlidingWindowLayer``, ``DistributedConfig``)
has the same names and the signatures Kitty relies on across the admitted range.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from ..core.config import kv_dims

MIN_TRANSFORMERS = (5, 17)  # requirements.txt / pyproject.toml: transformers>=5.17,<6

# transformers is imported on first use only: ``kitty.hf.generate`` (and with it the CLI's argument checks) imports
# this module before any model is loaded.


def generate_cache_columns(frame) -> int | None:
    """The columns ``generate`` sized the call for (``max_cache_length`` of ``_prepare_cache_for_generation``, the
    ``frame`` that sets ``cache._is_user_defined``), or ``None`` where the release does not show it."""
    need = frame.f_locals.get("max_cache_length") if frame is not None else None
    return need if isinstance(need, int) and not isinstance(need, bool) else None


@functools.cache
def transformers_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed transformers; ``ImportError`` naming the fix below the lower bound,
    whose releases lack APIs Kitty builds on (rather than an unrelated error, or a cache with no layers, later)."""
    import transformers

    major, minor = re.match(r"(\d+)\.(\d+)", transformers.__version__).groups()  # "5.24.0", "5.25.0.dev0"
    version = (int(major), int(minor))
    if version < MIN_TRANSFORMERS:
        need = "transformers>={}.{},<6".format(*MIN_TRANSFORMERS)
        raise ImportError(f"kitty needs {need}, found transformers {transformers.__version__}: pip install '{need}'")
    return version


def cache_kwarg() -> str:
    """The keyword this transformers release reads a forward's / ``generate``'s cache from: ``"cache"`` from 5.24,
    ``"past_key_values"`` before (see the module docstring)."""
    return "cache" if transformers_version() >= (5, 24) else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``{cache_kwarg(): cache}``, for ``model(ids, **cache_kwargs(cache))`` and
    ``model.generate(..., **cache_kwargs(cache))``.

    ``cache=`` on a release before 5.24 is silently ignored by forwards (no cache at all) and ``past_key_values=``
    warns from 5.24 on; this picks the one the running release honours."""
    return {cache_kwarg(): cache}


# Layer types whose cache layer takes the config's ``sliding_window`` (on 5.17 the shared dict carries it for all)
_WINDOWED = ("sliding_attention", "chunked_attention", "hybrid_sliding", "reference_sliding_attention")


def layer_types_and_kwargs(text) -> tuple[list[str], list[dict]]:
    """Per layer of the text config ``text``: its attention type and the keyword arguments of its cache layer,
    inferred as ``DynamicCache`` infers them (``transformers.cache_utils.get_layer_types_and_kwargs``).

    Always one dict per layer, as 5.19 and later return them; 5.17-5.18 return one dict for all layers, which is
    given here to each layer (``sliding_window`` only to the windowed ones, as later releases do). Where
    transformers' function fails on the config or gives no entry per layer, the same rule is applied here:
    ``config.layer_types`` when given, else sliding layers where ``sliding_window`` is set, chunked where
    ``attention_chunk_size`` is."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    transformers_version()
    num_layers = kv_dims(text)[0]
    try:
        types, kwargs = get_layer_types_and_kwargs(text)
    except (AttributeError, TypeError, ValueError):  # a config lacking fields the release's function reads
        types, kwargs = [], []
    types = list(types)
    if isinstance(kwargs, Mapping):  # 5.17-5.18: one dict shared by every layer
        kwargs = [{k: v for k, v in kwargs.items() if t in _WINDOWED or k != "sliding_window"} for t in types]
    if len(types) == num_layers and len(kwargs) == num_layers:
        return types, [dict(kw) for kw in kwargs]
    types = getattr(text, "layer_types", None)
    if types is None:
        window, chunk = getattr(text, "sliding_window", None), getattr(text, "attention_chunk_size", None)
        kind = "sliding_attention" if window is not None else "chunked_attention" if chunk is not None else None
        types = [kind or "full_attention"] * num_layers
    window = getattr(text, "sliding_window", None)
    return list(types), [{"sliding_window": window} if t == "sliding_attention" else {} for t in types]


def kv_heads_per_rank(tp_plan: dict[str, str], num_heads: int, tp_size: int) -> int | None:
    """KV heads per rank under ``tp_plan``: all of them unless a key projection is split column-wise, else an
    equal share, ``None`` when ``num_heads`` does not divide by ``tp_size`` (transformers' rule, for releases
    without ``get_kv_heads_per_rank``: 5.17-5.19)."""
    names = ("k_proj", "qkv_proj", "query_key_value")
    if not any(k.rsplit(".", 1)[-1] in names and style == "colwise" for k, style in tp_plan.items()):
        return num_heads
    return None if num_heads % tp_size else num_heads // tp_size


def get_kv_heads_per_rank(tp_plan: dict[str, str], num_heads: int, tp_size: int) -> int | None:
    """KV heads per tensor-parallel rank: transformers' ``get_kv_heads_per_rank`` where the release has it (5.20
    and later), else :func:`kv_heads_per_rank`, the same rule."""
    try:
        from transformers.distributed.tensor_parallel import get_kv_heads_per_rank as own
    except ImportError:  # transformers 5.17-5.19
        own = kv_heads_per_rank
    return own(tp_plan, num_heads, tp_size)


class StaticCacheSizes:
    """``max_batch_size`` / ``max_cache_len`` of a cache as read-only properties over the values given to
    :meth:`hold_static_sizes` (``None``: a growing cache). Listed before ``Cache`` among a cache's bases, so that on
    5.17, whose ``Cache`` defines both as read-only deprecated properties (which warn and read the layers), these
    win; later releases have neither."""

    _static_sizes: tuple[int | None, int | None] = (None, None)

    def hold_static_sizes(self, max_batch_size: int | None, max_cache_len: int | None) -> None:
        self._static_sizes = (max_batch_size, max_cache_len)

    @property
    def max_batch_size(self) -> int | None:
        """Most rows a static cache takes (``None``: a growing cache, or no bound given)."""
        return self._static_sizes[0]

    @property
    def max_cache_len(self) -> int | None:
        """Columns (padding included) a static cache holds per row (``None``: a growing cache)."""
        return self._static_sizes[1]


@contextmanager
def attention_implementation(config, name: str) -> Iterator[None]:
    """Inside the block, ``config._attn_implementation`` is ``name`` (an implementation registered with
    ``transformers.AttentionInterface``); the previous one is put back however the block ends."""
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous
