"""The value screen of ``benchmarks/value_error.py``: its dtype row is ``kitty``'s value page, and the 8-bit form of
each scale and zero stays within the grid's promised distance of the original."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from kitty.core.config import get_preset
from kitty.core.quant import dequantize_value_page, quantize_value_page

SCREEN = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks" / "value_error.py"))
log8_scale_zero = SCREEN["log8_scale_zero"]
value_rows = SCREEN["value_rows"]


def random_values(seed: int, dtype: torch.dtype, D: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 2, 128, D, generator=gen) * (torch.rand(D, generator=gen) * 3 + 0.1)
    return (x + torch.randn(D, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 256])
def test_dtype_row_is_kittys_value_page(dtype: torch.dtype, D: int) -> None:
    v = random_values(D, dtype, D)
    label, rel, top, bits, clamped = value_rows(v, dtype, [D])[0]
    page = dequantize_value_page(quantize_value_page(v, get_preset("kitty"))).float()
    err = page - v.float()
    # the screen reconstructs in fp32, the page in the dtype: equal up to the dtype's last rounding
    assert rel == pytest.approx((err.square().sum() / v.float().square().sum()).item(), rel=1e-3)
    assert top == pytest.approx(err.abs().max().item(), rel=1e-2)
    assert bits == 2 + 32 / D and clamped == 0.0


def test_eight_bit_form_bounds() -> None:
    gen = torch.Generator().manual_seed(1)
    scale = torch.rand(4, 128, 2, generator=gen) * torch.logspace(-3, 0, 2)[None, None, :] + 1e-4
    zero = (torch.rand(4, 128, 2, generator=gen) - 0.7) * 20 * scale  # within the int8's 32 steps of 0
    s8, z8 = log8_scale_zero(scale, zero, 2)
    ratio = s8 / scale
    assert (ratio >= 1).all() and (ratio <= 2 ** (1 / 16) * (1 + 1e-6)).all()  # rounded up, by under one grid step
    assert ((z8 - zero).abs() <= s8 / 8 * (1 + 1e-5)).all()  # the nearest quarter step
    assert (s8.amax((-1, -2)) == scale.amax((-1, -2))).all()  # each page's largest scale is the exact reference


def test_eight_bit_rows_cost_little_and_smaller_groups_help() -> None:
    v = random_values(3, torch.bfloat16, 64)
    rows = {label: (rel, bits) for label, rel, _, bits, _ in value_rows(v, torch.bfloat16, [64, 32])}
    one16, one8 = rows["1 group of 64, scale and zero in dtype"], rows["1 group of 64, scale and zero in 8-bit"]
    two8 = rows["2 groups of 32, scale and zero in 8-bit"]
    assert one16[0] <= one8[0] < 1.2 * one16[0]  # rounding the scale up only widens the steps, a little
    assert two8[0] < one16[0] and abs(two8[1] - one16[1]) < 0.01  # the same bytes, smaller groups
