"""The value screen of ``benchmarks/value_error.py``: its dtype row is ``kitty``'s value page, and its 8-bit row is
the cache's (``value_groups=2, value_scale_bits=8``; the form's own bounds are in ``tests/test_value_groups.py``)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from kitty.core.config import get_preset
from kitty.core.quant import dequantize_value_page, quantize_value_page

SCREEN = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks" / "value_error.py"))
value_rows = SCREEN["value_rows"]


def random_values(seed: int, dtype: torch.dtype, D: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 2, 128, D, generator=gen) * (torch.rand(D, generator=gen) * 3 + 0.1)
    return (x + torch.randn(D, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 256])
def test_dtype_row_is_kittys_value_page(dtype: torch.dtype, D: int) -> None:
    v = random_values(D, dtype, D)
    label, rel, top, bits, widened = value_rows(v, [D])[0]
    page = dequantize_value_page(quantize_value_page(v, get_preset("kitty"))).float()
    err = page - v.float()
    # the screen runs the cache's quantizer: the same page
    assert rel == pytest.approx((err.square().sum() / v.float().square().sum()).item(), rel=1e-3)
    assert top == pytest.approx(err.abs().max().item(), rel=1e-2)
    assert bits == 2 + 32 / D and widened == 0.0


def test_eight_bit_rows_cost_little_and_smaller_groups_help() -> None:
    v = random_values(3, torch.bfloat16, 64)
    rows = {label: (rel, bits) for label, rel, _, bits, _ in value_rows(v, [64, 32])}
    one16, one8 = rows["1 group of 64, scale and zero in dtype"], rows["1 group of 64, scale and zero in 8-bit"]
    two8 = rows["2 groups of 32, scale and zero in 8-bit"]
    assert one16[0] <= one8[0] < 1.2 * one16[0]  # rounding the scale up only widens the steps, a little
    assert two8[0] < one16[0] and abs(two8[1] - one16[1]) < 0.01  # the same bytes, smaller groups


def test_eight_bit_row_is_the_caches_page() -> None:
    from kitty.core.quant import dequantize_value_page, quantize_value_page

    v = random_values(5, torch.bfloat16, 64)
    rel = {label: r for label, r, *_ in value_rows(v, [32])}["2 groups of 32, scale and zero in 8-bit"]
    page = dequantize_value_page(quantize_value_page(v, get_preset("kitty+value_groups=2+value_scale_bits=8")))
    err = page.float() - v.float()
    assert rel == pytest.approx((err.square().sum() / v.float().square().sum()).item(), rel=1e-3)
