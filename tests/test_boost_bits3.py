"""``boost_bits=3`` (torch path only): boosted key channels at 3 bits, bit 2 in a high plane of 1-bit slots.

The page against 3-bit min-max quantization computed apart (``benchmarks/key_error.py``'s
``precision_reconstructions``), the bytes against ``kitty``'s (``boost_fraction=0.25`` at 3 bits = 0.125 at 4), a
cache that stores, reads back and generates with it, and the kernels' refusals (random data).
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from kitty import get_preset
from kitty.core.config import KVQuantConfig
from kitty.core.memory import asymptotic_bits
from kitty.core.quant import (
    channel_importance,
    dequantize_key_page,
    high_plane_bytes,
    key_page_codes,
    quantize_key_page,
    select_boosted,
)
from kitty.core.storage import key_page_from_storage, page_fields, pool_fields

SCREEN = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks" / "key_error.py"))
precision_reconstructions = SCREEN["precision_reconstructions"]

THREE = "kitty+boost_fraction=0.25+boost_bits=3"
FIT_THREE = "kitty-fit+boost_fraction=0.25+boost_bits=3+key_range=fit-attn-max-rel-token-bound"


def random_pages(seed: int, dtype: torch.dtype, D: int) -> torch.Tensor:
    """Pages ``[2, 3, 128, D]`` with per-channel scales and offsets (no zeros, no ties in the channel ranking)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 128, D, generator=gen) * (torch.rand(D, generator=gen) * 3 + 0.1)
    return (x + torch.randn(D, generator=gen)).to(dtype)


def test_high_plane_bytes_and_validation() -> None:
    assert [high_plane_bytes(n) for n in (0, 1, 4, 5, 32)] == [0, 1, 1, 2, 8]  # 4-bit: 2-bit slots, unchanged
    assert [high_plane_bytes(n, 3) for n in (0, 1, 8, 9, 16, 64)] == [0, 1, 1, 2, 2, 8]  # 3-bit: 1-bit slots
    with pytest.raises(ValueError, match="boost_bits"):
        high_plane_bytes(8, 2)
    for bad in ({"boost_bits": 5}, {"boost_bits": 2}, {"boost_bits": 3, "key_bits": 4, "boost_fraction": 0.0}):
        with pytest.raises(ValueError, match="boost_bits"):
            KVQuantConfig(**bad)
    assert get_preset(THREE).torch_only and not get_preset("kitty").torch_only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [64, 256])
def test_page_is_the_3_bit_min_max_reconstruction(dtype: torch.dtype, D: int) -> None:
    """``kitty``'s ranking picks ``2 nb`` channels; they hold the 3-bit min-max rebuild, the rest the 2-bit one."""
    x = random_pages(D, dtype, D)
    cfg = get_preset(THREE)
    page = quantize_key_page(x, cfg)
    nb = cfg.num_boosted(D)
    assert nb == 2 * get_preset("kitty").num_boosted(D)
    assert page.high.shape == (2, 3, 128, -(-nb // 8)) and page.boost_bits == 3
    rec = precision_reconstructions(x, bits=(2, 3))
    mask = select_boosted(channel_importance(x, cfg), nb)
    assert torch.equal(dequantize_key_page(page).float(), torch.where(mask[..., None, :], rec[3], rec[2]))
    codes = key_page_codes(page)
    assert int(codes.max()) == 7 and bool((codes[~mask] <= 3).all())
    assert torch.equal(page.boost_idx < nb, mask)
    same = quantize_key_page(x, cfg, sync_free=True)  # the static cache's host-read-free pack: the same page
    assert all(torch.equal(a, b) for a, b in zip(page.tensors().values(), same.tensors().values()))
    back = key_page_from_storage(page_fields(page), None, cfg, dtype)  # pool fields and back
    assert torch.equal(dequantize_key_page(back), dequantize_key_page(page))


def test_fitted_ranges_with_the_oracle_at_seven_levels() -> None:
    """The oracle's gain and the fitted ranges run at 7 levels: fewer errors than the 2-bit page, codes up to 7."""
    x = random_pages(3, torch.bfloat16, 64)
    cfg = get_preset(FIT_THREE)
    g = torch.Generator().manual_seed(4)
    qs = torch.cat([torch.rand(2, 3, 64, generator=g) + 0.5, torch.rand(2, 3, 128, generator=g) * 40], -1)
    page = quantize_key_page(x, cfg, query_scale=qs)
    err = (dequantize_key_page(page).float() - x.float()).square().sum()
    plain = quantize_key_page(x, cfg.with_(boost_fraction=0.0), query_scale=qs)
    assert float(err) < float((dequantize_key_page(plain).float() - x.float()).square().sum())
    assert int(key_page_codes(page).max()) == 7 and page.high.shape[-1] == 2


@pytest.mark.parametrize("D", [64, 256])
def test_bytes_equal_kittys(D: int) -> None:
    three, kitty = get_preset(THREE), get_preset("kitty")
    assert (
        pool_fields(three, 1, D, torch.bfloat16)[0]["k_high"][0]
        == pool_fields(kitty, 1, D, torch.bfloat16)[0]["k_high"][0]
    )
    assert asymptotic_bits(three, D) == asymptotic_bits(kitty, D)
    from fixtures import checked_cache_bits

    T = kitty.sink_tokens + 3 * kitty.group_size + 5
    assert abs(checked_cache_bits(three, D, T) - checked_cache_bits(kitty, D, T)) <= 0.01


def test_cache_stores_and_reads_three_bit_pages() -> None:
    from fixtures import checked_fed_cache

    cache = checked_fed_cache(THREE)[0]
    page = cache.layers[0].key_page(0, 0)
    assert page.boost_bits == 3 and page.high.shape[-1] == 1  # nb = 4 channels of 16: one byte a token


@pytest.mark.parametrize("name", [THREE, FIT_THREE])
def test_generates_through_a_cache(name: str) -> None:
    from fixtures import check_generates_on_torch

    check_generates_on_torch(get_preset(name))


def test_kernels_refuse_three_bit_boost() -> None:
    pytest.importorskip("triton")
    from fixtures import check_kernels_refuse

    from kitty import kernels
    from kitty.kernels import decode_attention_triton, dequantize_key_page_triton, pack_pages
    from kitty.kernels.gluon_launch import pages_supported

    cfg = get_preset(THREE)
    check_kernels_refuse(cfg, "boost_bits")
    assert pages_supported(get_preset("kitty"), 64, torch.float16, 4)
    q = torch.randn(1, 2, 128, 64)
    with pytest.raises(ValueError, match="boost_bits"):
        pack_pages(cfg, q, q)
    with pytest.raises(ValueError, match="boost_bits"):
        dequantize_key_page_triton(quantize_key_page(q, cfg))
    with pytest.raises(ValueError, match="boost_bits"):  # refused before the state is read
        decode_attention_triton(q[:, :, 0], None, cfg)
    assert kernels.HAS_TRITON
