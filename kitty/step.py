"""The all-or-nothing step record of one Kitty layer: what a step changed, so that a failure can put it back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class StepRecord:
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
