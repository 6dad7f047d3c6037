"""The boost allocation of the key-error screen (``benchmarks/key_error.py --variable-boost``): budget, cap, unit,
and greedy against brute force on tiny cases (the problem is separable, each row's gains taken largest first)."""

from __future__ import annotations

import itertools
import runpy
from pathlib import Path

import pytest
import torch

SCREEN = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks" / "key_error.py"))
allocate_boost = SCREEN["allocate_boost"]
variable_boost = SCREEN["variable_boost"]


def total_gain(gains: torch.Tensor, counts: torch.Tensor) -> float:
    """Summed gain of each row's ``counts[r]`` largest gains."""
    top = gains.sort(-1, descending=True).values
    return float(sum(top[r, : int(c)].sum() for r, c in enumerate(counts)))


@pytest.mark.parametrize("unit", [1, 4])
def test_budget_met_exactly_and_cap_holds(unit: int) -> None:
    gen = torch.Generator().manual_seed(0)
    gains = torch.rand(7, 64, generator=gen) * torch.rand(7, 1, generator=gen) * 5 + 0.01
    counts = allocate_boost(gains, 7 * 8, 32, unit)
    assert int(counts.sum()) == 56
    assert int(counts.max()) <= 32 and int(counts.min()) >= 0
    assert bool((counts % unit == 0).all())


def test_refuses_a_budget_it_cannot_meet() -> None:
    gains = torch.rand(2, 8) + 0.1
    with pytest.raises(ValueError):
        allocate_boost(gains, 9, 4)  # more than 2 rows x cap 4
    with pytest.raises(ValueError):
        allocate_boost(gains, 6, 4, unit=4)  # not whole units


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("unit", [1, 2])
def test_greedy_equals_brute_force(seed: int, unit: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows, D, cap, budget = 3, 6, 4, 6
    gains = torch.rand(rows, D, generator=gen) ** 3 * 10 + 0.01  # skewed, never zero
    counts = allocate_boost(gains, budget, cap, unit)
    best = max(
        total_gain(gains, torch.tensor(c))
        for c in itertools.product(range(0, cap + 1, unit), repeat=rows)
        if sum(c) == budget
    )
    assert total_gain(gains, counts) == pytest.approx(best, rel=1e-6)


def test_variable_boost_keeps_the_budget_and_never_raises_the_error() -> None:
    gen = torch.Generator().manual_seed(1)
    pages = (torch.randn(2, 3, 2, 128, 64, generator=gen) * (torch.rand(64, generator=gen) * 3 + 0.1)).bfloat16()
    out = variable_boost(pages)
    ref = pages.float()
    fixed = (out["fixed, by gain"] - ref).square().sum()
    for name in ("page", "head", "head-all"):
        for unit in (1, 4):
            counts = out[f"{name}, unit {unit}:counts"]
            assert int(counts.sum()) == 2 * 3 * 2 * 8  # kitty: 8 of 64 channels per page and head
            assert int(counts.max()) <= 32
            err = (out[f"{name}, unit {unit}"] - ref).square().sum()
            assert float(err) <= float(fixed) * (1 + 1e-6)  # fixed is one of the allocations each one searched


def test_key_page_bits_match_the_stored_page() -> None:
    """The screen's bit count of a fixed count equals the bytes ``quantize_key_page`` stores, and a count byte adds
    ``8 / (G x D)``."""
    from kitty.core.config import get_preset
    from kitty.core.quant import quantize_key_page

    gen = torch.Generator().manual_seed(2)
    pages = torch.randn(3, 2, 128, 64, generator=gen).bfloat16() + 0.5
    for name in ("kitty", "kitty-pro"):
        cfg = get_preset(name)
        stored = quantize_key_page(pages, cfg).nbytes * 8 / pages.numel()
        counts = torch.full((3, 2), cfg.num_boosted(64))
        assert SCREEN["key_page_bits"](counts, 128, 64, 2, 0) == pytest.approx(stored)
        assert SCREEN["key_page_bits"](counts, 128, 64, 2, 1) == pytest.approx(stored + 8 / (128 * 64))
