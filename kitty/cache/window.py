"""The sliding-window layers of a hybrid model's KittyCache: transformers' full-precision window layers (growing and
static) with Kitty's step protocol (``kitty.cache.step``), memory report and refusal of cache reordering.

Why full precision and not Kitty pages freed as the window passes (bytes from ``analytic_report``, which the tests
check against real ``nbytes``; Gemma-3-12B shape, 40 sliding + 8 full layers, 8 KV heads, D=256, W=1024, bf16): a
full-precision window costs 7.99 MiB per sliding layer and sequence, Kitty pages over the window would cost
2.45-2.59 MiB, so the whole cache would hold 0.395 vs ~0.18 GiB at 8K tokens and 0.615 vs ~0.40 GiB at 32K. Pages
would win on bytes; they are not built yet because the window start falls inside a page (a per-token mask inside
pages that neither the torch reference nor the fused kernel has), pages would be freed one by one (the pool is a bump
allocator), and the sink does not apply to a window. Full precision is exact and is what transformers' own sliding
layer keeps (``docs/SERVING.md`` has the engine side).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer, StaticSlidingWindowLayer

from ..core.memory import MemoryReport
from .step import LayerSteps, new_batch_error


def check_batch(layer, key_states: torch.Tensor) -> None:
    """A window layer takes a new batch size only while empty (it is re-allocated then); else ``ValueError``, as
    the Kitty layers refuse it, rather than a shape error deep in transformers' window update."""
    if not layer.is_initialized or key_states.dim() != 4:
        return
    rows, batch = layer.keys.shape[0], key_states.shape[0]
    if batch == rows:
        return
    if layer.get_seq_length() == 0:
        layer.is_initialized = False  # allocated again for this batch by the update
        return
    raise new_batch_error(rows, batch)


class WindowMemory:
    """The memory report of a window layer; the layer sets ``model_kv_heads`` and ``ranks`` (expected until the
    first tensors arrive)."""

    def memory_report(self) -> MemoryReport:
        """Bytes of the window's keys and values (padding columns included, as transformers holds them)."""
        if not self.is_initialized:
            return MemoryReport(0, 0, 0, 0, 0, ranks=self.ranks)
        held = self.keys.nbytes + self.values.nbytes
        fp16 = 2 * (self.keys.numel() + self.values.numel())
        return MemoryReport(0, fp16, 0, 0, 0, window_bytes=held, ranks=self.model_kv_heads // self.keys.shape[1])


class SlidingWindowLayer(LayerSteps, WindowMemory, DynamicSlidingWindowLayer):
    """A sliding-window layer of a hybrid model: transformers' ``DynamicSlidingWindowLayer`` (the newest
    ``sliding_window - 1`` columns of keys and values, ``[B, H, <= W - 1, D]``, in full precision); a step records
    the window (``update`` replaces its tensors, never writes them in place), so that a failure later in the same
    forward pass puts it back."""

    def __init__(self, sliding_window: int, model_kv_heads: int, ranks: int = 1, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.model_kv_heads, self.ranks = model_kv_heads, ranks

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' window update, its step opened first: the attention over the window is the user's own
        function, so the record is taken here rather than by Kitty's attention function."""
        check_batch(self, key_states)
        cache = self.cache
        if cache is not None:
            cache.begin_step(self)
        else:
            self.begin_step()
        return super().update(key_states, value_states, *args, **kwargs)

    def reset(self) -> None:
        """Drop the window: ``update`` grows it by concatenation, so zeroed columns would stay (transformers 5.17's
        reset zeroes them; later releases drop them, as here)."""
        self.keys = self.values = None
        self.is_initialized = False
        super().reset()
        self.cumulative_length = 0

    def _save(self) -> tuple:
        return self.is_initialized, self.keys, self.values, self.cumulative_length

    def _restore(self, state: tuple) -> None:
        self.is_initialized, self.keys, self.values, self.cumulative_length = state


class StaticSlidingLayer(LayerSteps, WindowMemory, StaticSlidingWindowLayer):
    """A sliding-window layer of a static cache: transformers' ``StaticSlidingWindowLayer`` (a full-precision
    window of ``min(sliding_window, max_cache_len)`` columns, written in place). A failed step is not undone in its
    window (it is written in place): its step records nothing."""

    def __init__(self, max_cache_len: int, sliding_window: int, model_kv_heads: int, ranks: int = 1):
        super().__init__(max_cache_len=max_cache_len, sliding_window=sliding_window)
        self.model_kv_heads, self.ranks = model_kv_heads, ranks

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' static window update, a batch change checked first (:func:`check_batch`)."""
        check_batch(self, key_states)
        return super().update(key_states, value_states, *args, **kwargs)

    def check_room(self, steps: int = 1) -> None:
        """A window never runs out of room."""

    def advance(self, steps: int = 1) -> None:
        """Count ``steps`` replayed decode steps (transformers keeps the columns fed as a host integer too)."""
        self.cumulative_length_int += steps
