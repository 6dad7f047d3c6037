"""What every layer kind of a KittyCache shares: the all-or-nothing step record, the owning cache, and the refusal of
cache reordering.

One protocol serves every layer (paged or window, growing or static): :meth:`LayerSteps.begin_step` records the
layer's bookkeeping (what its ``_save`` returns) in a :class:`StepRecord`, writes made in place register undo actions
with :meth:`LayerSteps.on_undo`, and :meth:`LayerSteps.rollback_step` runs them (newest first) and restores the
bookkeeping, so that a failed forward pass leaves every layer as it was. :attr:`LayerSteps.step_forward` says which
forward pass the open step belongs to (``KittyCache.rollback_forward`` rolls back the layers of the failing pass).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

BEAM_MESSAGE = (
    "KittyCache does not support beam search or other cache reordering (num_beams > 1, contrastive search, "
    "assisted decoding): pages are shared storage indexed per row. Use greedy decoding or sampling (num_beams=1)."
)


def new_batch_error(rows: int, batch: int) -> ValueError:
    """The refusal of a batch of ``batch`` rows by a cache holding ``rows`` (every layer kind and the cache say it
    alike)."""
    return ValueError(f"the cache holds {rows} rows but got a batch of {batch}; call cache.reset() before a new batch")


@dataclass
class StepRecord:
    """How to put one layer back as it was before a step: its bookkeeping then, and undo actions (run newest first).

    Only what a step overwrites while it is still live needs an action: slots past a row's length, pages past a
    pool's ``used`` and page-table entries past a row's pages hold nothing that anything reads.
    """

    forward: int  # the KittyCache forward pass this step belongs to
    state: Any  # what the layer's _save returned at begin_step (None: nothing to restore)
    actions: list[Callable[[], None]] = field(default_factory=list)


class LayerSteps:
    """Mixed into every layer of a KittyCache (listed first, so that its refusals win): the step protocol of the
    module docstring, the owning cache, and ``NotImplementedError`` for beam search and other reordering.

    A layer kind says what a rollback restores with ``_save`` (its bookkeeping, e.g. host counters and tensor
    references) and ``_restore``; the default saves nothing (a layer written only in place, with undo actions)."""

    _record: StepRecord | None = None
    _cache: Callable[[], Any] | None = None

    # ------------------------------------------------------------------------------------------ the owner

    def attach(self, cache) -> None:
        """Belong to ``cache`` (held weakly): steps then join its forward passes."""
        self._cache = weakref.ref(cache)

    @property
    def cache(self):
        """The KittyCache this layer belongs to, or ``None``."""
        return self._cache() if self._cache is not None else None

    # ------------------------------------------------------------------------------------ all-or-nothing steps

    def _save(self) -> Any:
        return None

    def _restore(self, state: Any) -> None:
        pass

    @property
    def step_forward(self) -> int | None:
        """The forward pass of the open step, ``None`` when no step is open."""
        return None if self._record is None else self._record.forward

    def begin_step(self, forward: int = 0) -> None:
        """Record this layer's state, so that :meth:`rollback_step` can restore it if the step fails.

        The record is dropped by :meth:`end_step` or replaced by the next step. ``forward`` names the cache's
        forward pass, so that a failure in a later layer rolls back the layers this pass already changed
        (``KittyCache.rollback_forward``).
        """
        self._record = StepRecord(forward, self._save())

    def end_step(self) -> None:
        """Keep what the open step did (frees its record)."""
        self._record = None

    def rollback_step(self) -> None:
        """Put the layer back as it was at :meth:`begin_step` (nothing happens if no step is open)."""
        record, self._record = self._record, None
        if record is None:
            return
        for undo in reversed(record.actions):
            undo()
        self._restore(record.state)

    def on_undo(self, action: Callable[[], None]) -> None:
        """Run ``action`` if the open step rolls back (nothing when no step is open)."""
        if self._record is not None:
            self._record.actions.append(action)

    @contextmanager
    def atomic(self):
        """The body changes the layer completely or not at all: inside an open step the step's owner rolls back,
        otherwise this opens a step of its own and rolls it back on any exception."""
        if self._record is not None:
            yield
            return
        self.begin_step()
        try:
            yield
        except BaseException:
            self.rollback_step()
            raise
        self.end_step()

    # ------------------------------------------------------------------------------------------- no reordering

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(BEAM_MESSAGE)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(BEAM_MESSAGE)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(BEAM_MESSAGE)
