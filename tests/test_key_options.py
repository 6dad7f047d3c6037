"""Key options beyond the paper (torch path only): ``key_rotation`` and ``key_outlier_fraction`` (random data).

Their arithmetic on random pages, their validation, their bytes (``memory_report()`` counts the outliers) and a cache
that stores and reads them back through the real path.
"""

import pytest
import torch
from test_cache import HKV, G, R, S, check_state, feed, tiny_llama_config

from kitty import PRESETS, KittyCache, KVQuantConfig, analytic_report, get_preset
from kitty.cache.backend import resolve_backend
from kitty.core.memory import asymptotic_bits
from kitty.core.quant import (
    dequantize_key_page,
    quantize_key_page,
    rotate_keys,
    rotation_matrix,
    split_key_outliers,
)
from kitty.core.storage import key_page_from_storage, page_fields, pool_fields

KITTY = PRESETS["kitty"]
ROTATIONS = ("hadamard", "hadamard-signs")


def random_keys(*shape, dtype=torch.float32, seed=0):
    """Keys with per-channel offsets and scales and a few planted spikes (what real keys look like, roughly)."""
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    k = torch.randn(*shape, generator=g) * (0.5 + 3 * torch.rand(D, generator=g)) + torch.randn(D, generator=g)
    spikes = torch.rand(*shape, generator=g) < 0.003
    return torch.where(spikes, k * 12, k).to(dtype)


# ------------------------------------------------------------------------------------------------ rotation


@pytest.mark.parametrize("kind", ROTATIONS)
@pytest.mark.parametrize("D", [4, 64, 256])
def test_rotation_is_orthogonal_and_exact_in_full_precision(kind, D):
    r = rotation_matrix(kind, D, 3, torch.device("cpu"))
    assert torch.allclose(r @ r.T, torch.eye(D), atol=1e-6)
    assert torch.allclose(r.abs(), torch.full((D, D), D**-0.5))  # a (signed) normalized Hadamard matrix
    k = random_keys(2, 128, D)
    back = rotate_keys(rotate_keys(k, kind, 3), kind, 3, inverse=True)
    assert torch.allclose(back, k, atol=1e-5 * k.abs().max())


def test_hadamard_signs_are_fixed_by_the_seed():
    cpu = torch.device("cpu")
    plain, a = rotation_matrix("hadamard", 64, 0, cpu), rotation_matrix("hadamard-signs", 64, 0, cpu)
    assert torch.equal(a, rotation_matrix("hadamard-signs", 64, 0, cpu))
    assert not torch.equal(a, plain) and not torch.equal(a, rotation_matrix("hadamard-signs", 64, 1, cpu))
    signs = (a * plain).sum(1)  # row i of a is s_i times row i of plain (rows of norm 1)
    assert torch.allclose(signs.abs(), torch.ones(64)) and (signs < 0).any() and (signs > 0).any()
    k = torch.ones(3, 4)
    assert rotate_keys(k, "none") is k


@pytest.mark.parametrize("kind", ROTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotated_page_is_the_plain_page_of_rotated_keys(kind, dtype):
    """A rotated config quantizes ``k @ R`` exactly as the plain config quantizes it, and reads back ``k_hat @ R.T``."""
    k = random_keys(3, 128, 64, dtype=dtype)
    cfg = KITTY.with_(key_rotation=kind, seed=5)
    page = quantize_key_page(k, cfg)
    plain = quantize_key_page(rotate_keys(k, kind, 5), KITTY)
    for name, t in plain.tensors().items():
        assert torch.equal(getattr(page, name), t), name
    want = rotate_keys(dequantize_key_page(plain), kind, 5, inverse=True)
    assert torch.equal(dequantize_key_page(page), want)
    assert page.nbytes == plain.nbytes  # a fixed matrix: nothing more is stored


def test_rotation_spreads_an_outlier_channel():
    """Why rotate: one channel 30x the others dominates its page's range; rotated, every channel shares it."""
    k = random_keys(128, 64)
    k[:, 7] *= 30
    rotated = rotate_keys(k, "hadamard-signs")
    spread = lambda x: (x.amax(0) - x.amin(0)).max() / (x.amax(0) - x.amin(0)).median()  # noqa: E731
    assert spread(k) > 10 and spread(rotated) < 2


# ------------------------------------------------------------------------------------------- dense-and-sparse


@pytest.mark.parametrize("rule", ["zscore", "absolute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_outliers_are_the_largest_channel_deviations_kept_exactly(dtype, rule):
    k = random_keys(2, 3, 128, 64, dtype=dtype)
    n = 32
    dense, val, tok, ch = split_key_outliers(k, n, rule)
    assert val.shape == tok.shape == ch.shape == (2, 3, n) and tok.dtype == ch.dtype == torch.uint8
    x = k.float()
    z = (x - x.mean(-2, keepdim=True)).abs()
    if rule == "zscore":
        z = z / x.std(-2, correction=0, keepdim=True)
    flat = tok.long() * 64 + ch.long()
    assert torch.equal(val, k.flatten(-2).gather(-1, flat))  # the exact values at (tok, ch)
    chosen = z.flatten(-2).gather(-1, flat)
    mask = torch.zeros(2, 3, 128 * 64, dtype=torch.bool).scatter_(-1, flat, True)
    assert (chosen.amin(-1) >= z.flatten(-2).masked_fill(mask, -1).amax(-1)).all()  # no larger deviation left out
    # dense: unchanged off the outliers; at each outlier a value inside its channel's remaining range
    mask = mask.view(2, 3, 128, 64)
    assert torch.equal(dense[~mask], k[~mask])
    rest_lo = x.masked_fill(mask, float("inf")).amin(-2, keepdim=True)
    rest_hi = x.masked_fill(mask, float("-inf")).amax(-2, keepdim=True)
    filled = dense.float()
    assert ((filled >= rest_lo) & (filled <= rest_hi) | ~mask).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotation", ["none", "hadamard-signs"])
def test_outlier_page_reads_back_exact_outliers_and_the_rest_within_half_a_step(dtype, rotation):
    k = random_keys(3, 128, 64, dtype=dtype)
    cfg = KITTY.with_(boost_fraction=0.0625, key_outlier_fraction=1 / 256, key_rotation=rotation)
    page = quantize_key_page(k, cfg)
    assert page.out_val.shape == (3, 32)
    back = rotate_keys(dequantize_key_page(page), rotation, cfg.seed)  # compare in the basis that was quantized
    kr = rotate_keys(k, rotation, cfg.seed)
    flat = page.out_tok.long() * 64 + page.out_ch.long()
    got, want = back.flatten(-2).gather(-1, flat), kr.flatten(-2).gather(-1, flat)
    if rotation == "none":
        assert torch.equal(got, want)  # exact
    else:  # exact in the stored basis; here read through two rotations, so up to their rounding
        assert torch.allclose(got.float(), want.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    if rotation == "none":  # the same page read without its outliers is the min-max page of the dense keys
        dense = split_key_outliers(k, 32)[0]
        mask = torch.zeros(3, 128 * 64, dtype=torch.bool).scatter_(-1, flat, True).view(3, 128, 64)
        step = page.scale.float()[:, None, :].expand_as(mask)
        err = (back.float() - dense.float()).abs()
        rounding = 2**-8 * dense.float().abs() if dtype == torch.bfloat16 else 1e-5  # of the output dtype
        assert (err <= 0.5 * step + rounding)[~mask].all()
        plain_err = (dequantize_key_page(quantize_key_page(k, KITTY.with_(boost_fraction=0.0625))) - k).float()
        assert (back.float() - k.float()).square().sum() < plain_err.square().sum()  # the outliers pay off here


def test_outlier_storage_roundtrip_and_honest_bytes():
    """Page -> pool fields -> page reads the same keys; the outliers' 4 bytes each are in nbytes and in the formula."""
    cfg = KITTY.with_(boost_fraction=0.0625, key_outlier_fraction=1 / 256)
    k = random_keys(5, 2, 128, 64, dtype=torch.bfloat16)
    page = quantize_key_page(k, cfg)
    back = key_page_from_storage(page_fields(page), None, cfg, torch.bfloat16)
    assert torch.equal(dequantize_key_page(back), dequantize_key_page(page))
    spec = pool_fields(cfg, 2, 64, torch.bfloat16)[0]
    assert {name: shape for name, (shape, _) in spec.items() if name.startswith("k_out")} == {
        "k_out_val": (2, 32),
        "k_out_tok": (2, 32),
        "k_out_ch": (2, 32),
    }
    plain = quantize_key_page(k, KITTY.with_(boost_fraction=0.0625))
    assert page.nbytes - plain.nbytes == 5 * 2 * 32 * 4  # value (bf16) + token + channel index
    assert page.nbytes == quantize_key_page(k, KITTY).nbytes  # paid for by 4 boosted channels fewer per page


@pytest.mark.parametrize("D", [64, 256])
def test_outliers_in_place_of_boosted_channels_cost_kittys_bits(D):
    """Each 4 boosted channels fewer per page (4 x G x 2 bits) pay for G x 4 x 2 / 32 = G / 4 outliers, at any D."""
    for frac, out in ((0.0625, 1 / 256), (0.0, 1 / 128)):
        cfg = KITTY.with_(boost_fraction=frac, key_outlier_fraction=out)
        assert asymptotic_bits(cfg, D)["total"] == pytest.approx(asymptotic_bits(KITTY, D)["total"])
        for n in (100, 1280, 5000):
            assert analytic_report(cfg, n, D, 3, 2).stored_bytes == analytic_report(KITTY, n, D, 3, 2).stored_bytes


# --------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"key_rotation": "spin"}, "key_rotation"),
        ({"key_rotation": "hadamard", "key_bits": 16, "boost_fraction": 0.0}, "key_rotation"),
        ({"key_rotation": "hadamard", "channel_selection": "oracle"}, "key_rotation"),
        ({"key_outlier_fraction": -0.01}, "key_outlier_fraction"),
        ({"key_outlier_fraction": 1.0}, "key_outlier_fraction"),
        ({"key_outlier_fraction": "0.01"}, "key_outlier_fraction"),
        ({"key_outlier_fraction": True}, "key_outlier_fraction"),
        ({"key_outlier_fraction": 0.01, "key_bits": 16, "boost_fraction": 0.0}, "key_outlier_fraction"),
        ({"key_outlier_fraction": 0.01, "group_size": 512}, "key_outlier_fraction"),
        ({"key_outlier_rule": "largest"}, "key_outlier_rule"),
    ],
)
def test_invalid_key_options_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        KVQuantConfig(**kwargs)


def test_rotation_needs_a_power_of_two_head_dim_and_options_parse_from_names():
    with pytest.raises(ValueError, match="power of two"):
        KITTY.with_(key_rotation="hadamard").check_head_dim(96)
    KITTY.check_head_dim(96)  # unchanged without rotation
    cfg = get_preset("kitty+key_rotation=hadamard-signs+boost_fraction=0.0625+key_outlier_fraction=0.00390625")
    assert (cfg.key_rotation, cfg.key_outlier_fraction, cfg.num_key_outliers(64)) == ("hadamard-signs", 1 / 256, 32)
    assert cfg.torch_only and not KITTY.torch_only
    # on a CUDA device "auto" would pick the kernels, which do not read these options: the torch backend runs them
    assert resolve_backend("auto", torch.device("cuda"), cfg, 64) == "torch"


# ------------------------------------------------------------------------------------------------ the cache

SMALL = {
    "rotated": PRESETS["kitty"].with_(sink_tokens=S, group_size=G, local_window=R, key_rotation="hadamard-signs"),
    "outliers": PRESETS["kitty"].with_(sink_tokens=S, group_size=G, local_window=R, key_outlier_fraction=1 / 32),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_cache_stores_and_reads_the_options(name):
    """Through the real path (cache.update -> attention -> pages): every page equals quantizing its keys with the
    option, and memory_report() equals the formula, outliers included."""
    torch.manual_seed(0)
    cfg = SMALL[name]
    cache = KittyCache(tiny_llama_config(num_hidden_layers=1), cfg)
    D = 16
    T = S + 3 * G + R + 2
    k, v = torch.randn(2, HKV, T, D) + 0.1, torch.randn(2, HKV, T, D) + 0.1
    valid = torch.ones(2, T, dtype=torch.bool)
    feed(cache, k, v, valid)
    check_state(cache, cfg, list(k), list(v))
    assert cache.layers[0].key_page(0, 0).rotation == cfg.key_rotation
    assert cache.memory_report() == analytic_report(cfg, cache.lengths, D, HKV, 1, 4)
