"""Value pages with channel groups per token and 8-bit scales and zeros (``value_groups``, ``value_scale_bits``):
the page against a direct per-group min-max computation, the 8-bit form's bounds, the bytes against ``kitty``'s, a
cache that stores and reads the pages, and the refusals of the kernels, which read one dtype scale per token."""

from __future__ import annotations

import pytest
import torch
from test_boost_bits3 import random_pages as random_values  # [2, 3, 128, D], channels of varied scale and offset
from test_cache import HKV, G, S

from kitty import get_preset
from kitty.core.config import KVQuantConfig
from kitty.core.memory import asymptotic_bits
from kitty.core.quant import (
    META8_STEPS,
    decode_value_meta8,
    dequantize_value_page,
    encode_value_meta8,
    quantize_value_page,
)
from kitty.core.storage import page_fields, pool_fields, value_page_from_storage

TWO8 = "kitty+value_groups=2+value_scale_bits=8"


def test_validation_and_torch_only() -> None:
    for bad in ({"value_groups": 3}, {"value_groups": 0}, {"value_groups": 2.0}):
        with pytest.raises(ValueError, match="value_groups"):
            KVQuantConfig(**bad)
    for bad in ({"value_scale_bits": 4}, {"value_scale_bits": "8"}):
        with pytest.raises(ValueError, match="value_scale_bits"):
            KVQuantConfig(**bad)
    assert get_preset(TWO8).torch_only and get_preset("kitty+value_groups=2").torch_only
    assert not get_preset("kitty").torch_only
    assert not get_preset("kitty+value_bits=16+value_groups=2").grouped_values  # nothing to group: raw values
    with pytest.raises(ValueError, match="value_groups=4"):
        quantize_value_page(torch.randn(1, 128, 6), get_preset("kitty+value_groups=4"))
    with pytest.raises(ValueError, match="value_groups=4"):  # refused when the cache is built, not at the first page
        get_preset("kitty+key_bits=16+boost_fraction=0+value_groups=4").check_head_dim(6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("groups", [2, 4])
def test_dtype_groups_are_per_group_min_max(dtype: torch.dtype, groups: int) -> None:
    v = random_values(groups, dtype, 64)
    page = quantize_value_page(v, get_preset(f"kitty+value_groups={groups}"))
    assert page.grouped and page.scale.shape == (2, 3, 128, groups) and page.scale.dtype == dtype
    x = v.float().reshape(2, 3, 128, groups, 64 // groups)
    lo, hi = x.amin(-1), x.amax(-1)
    assert torch.equal(page.zero.float(), lo)  # the minimum, exact in the dtype
    assert (page.scale.float() >= (hi - lo) / 3).all()  # rounded up to the dtype: every code fits
    rebuilt = dequantize_value_page(page).float().reshape(x.shape)
    step = page.scale.float()[..., None]
    assert ((rebuilt - x).abs() <= step / 2 + 1e-2 * step + torch.finfo(dtype).eps * x.abs()).all()
    one = get_preset("kitty+value_groups=1")
    assert one == get_preset("kitty") and not one.grouped_values  # one group in the dtype: kitty's own layout


def test_eight_bit_form_bounds() -> None:
    gen = torch.Generator().manual_seed(1)
    scale = (torch.rand(4, 128, 2, generator=gen) * torch.logspace(-3, 0, 2) + 1e-4).to(torch.bfloat16)
    zero = ((torch.rand(4, 128, 2, generator=gen) - 0.7) * 60 * scale.float()).to(torch.bfloat16)
    c, z, ref = encode_value_meta8(scale, zero)
    assert c.dtype == torch.uint8 and z.dtype == torch.int8 and ref.dtype == torch.bfloat16 and ref.shape == (4,)
    step, zero8 = decode_value_meta8(c, z, ref)
    need = torch.maximum(scale.float(), zero.float().abs() / 31.75)
    assert (step >= need).all()  # the step covers the scale and lets the zero fit
    ratio = step / need
    assert (ratio[c < 255] <= 2 ** (1 / META8_STEPS) * (1 + 1e-5)).all()  # by under one grid step
    assert ((zero8 - zero.float()).abs() <= step / 8 * (1 + 1e-5)).all()  # the nearest quarter step
    assert (c.flatten(1).amin(1) == 0).all()  # each page's largest need is its reference


@pytest.mark.parametrize("D", [64, 256])
def test_eight_bit_page_error_and_hostile_groups(D: int) -> None:
    v = random_values(D, torch.bfloat16, D)
    err = {}
    for name in ("kitty", "kitty+value_groups=2", TWO8):
        rebuilt = dequantize_value_page(quantize_value_page(v, get_preset(name))).float()
        err[name] = ((rebuilt - v.float()).square().sum() / v.float().square().sum()).item()
    assert err["kitty+value_groups=2"] <= err[TWO8] < min(1.1 * err["kitty+value_groups=2"], err["kitty"])
    # constant groups (zero range), zero and nonzero, and a token far from 0: reconstructed within the widened step
    w = torch.zeros(1, 1, 128, D, dtype=torch.bfloat16)
    w[..., 5, :] = 3.0
    w[..., 6, :] = 1000.0 + torch.arange(D) / D
    page = quantize_value_page(w, get_preset(TWO8))
    out = dequantize_value_page(page).float()
    assert torch.equal(out[..., 0, :], w[..., 0, :].float())
    bf16 = 2.0**-8  # the reconstruction's own rounding to bf16, relative
    assert (out[..., 5, :] - 3.0).abs().max() <= 3.0 / 31.75 / 8 * 1.01 + 3.0 * bf16
    assert (out[..., 6, :] - w[..., 6, :].float()).abs().max() <= 1001 / 31.75 * 0.51 + 1001 * bf16
    assert torch.equal(page_fields(quantize_value_page(v, get_preset(TWO8), sync_free=True))["v_scale"], page_fields(
        quantize_value_page(v, get_preset(TWO8)))["v_scale"])  # fmt: skip


@pytest.mark.parametrize("D", [64, 256])
def test_bytes_equal_kittys(D: int) -> None:
    two8, kitty = get_preset(TWO8), get_preset("kitty")
    fields = pool_fields(two8, 1, D, torch.bfloat16)[1]
    assert fields["v_scale"] == ((1, two8.group_size, 2), torch.uint8) and fields["v_ref"] == ((1,), torch.bfloat16)
    ref_bits = 16 / (two8.group_size * D)  # one dtype reference per page and head
    assert asymptotic_bits(two8, D)["value_total"] == pytest.approx(asymptotic_bits(kitty, D)["value_total"] + ref_bits)
    from fixtures import checked_cache_bits

    T = kitty.sink_tokens + 3 * kitty.group_size + kitty.local_window + 5  # value pages too
    assert abs(checked_cache_bits(two8, D, T) - checked_cache_bits(kitty, D, T)) <= 0.01


def test_cache_stores_and_reads_grouped_pages() -> None:
    from fixtures import checked_fed_cache

    cache, cfg, _, v = checked_fed_cache(TWO8)
    layer = cache.layers[0]
    page = layer.value_page(0, 0)
    want = quantize_value_page(v[0][:, S : S + G], cfg)
    assert page.ref is not None and torch.equal(dequantize_value_page(page), dequantize_value_page(want))
    whole = value_page_from_storage(layer.value_pool.live([1, 1]), None, cfg, torch.float32)
    assert whole.ref.shape == (whole.codes.shape[0], HKV)  # one reference per live page and head


def test_generates_through_a_cache() -> None:
    from fixtures import check_generates_on_torch

    check_generates_on_torch(get_preset(TWO8))


def test_kernels_refuse_grouped_values() -> None:
    pytest.importorskip("triton")
    from fixtures import check_kernels_refuse

    from kitty.kernels import decode_attention_triton, dequantize_value_page_triton, pack_pages

    cfg = get_preset(TWO8)
    check_kernels_refuse(cfg, "value_groups")
    with pytest.raises(ValueError, match="value_groups"):
        dequantize_value_page_triton(quantize_value_page(random_values(0, torch.float32, 64), cfg))
    q = torch.randn(1, 2, 128, 64)
    with pytest.raises(ValueError, match="value_groups"):  # refused before the state is read
        decode_attention_triton(q[:, :, 0], None, cfg)
    with pytest.raises(ValueError, match="value_groups"):
        pack_pages(cfg, None, q)
