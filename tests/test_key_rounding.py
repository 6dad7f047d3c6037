"""Query-aware rounding of key codes (``key_rounding="query"``, torch path only): nearest rounding where the queries
are isotropic, a lower expected logit error than nearest rounding where they are not, the same ranges, boost and
bytes, the running second moment a cache keeps, and the refusals (random data throughout)."""

from __future__ import annotations

import pytest
import torch
from test_cache import HKV, HQ, tiny_llama_config

from kitty import KittyCache, get_preset
from kitty.core.config import KVQuantConfig
from kitty.core.quant import dequantize_key_page, quantize_key_page
from kitty.core.ranges import quantize_codes
from kitty.core.rounding import feedback_codes

QUERY = "kitty+key_rounding=query"


def anisotropic_cov(heads: int, D: int, seed: int = 0) -> torch.Tensor:
    """A second moment ``[heads, D, D]`` with correlated channels of unequal weight, as real queries have."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(heads, D, D, generator=g) * torch.linspace(0.1, 2.0, D)
    return a @ a.transpose(-1, -2) / D


def random_keys(*shape: int, seed: int = 0) -> torch.Tensor:
    """Keys whose channels differ in scale and offset (never all equal)."""
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    return torch.randn(*shape, generator=g) * torch.linspace(0.2, 3.0, D) + torch.linspace(-1.0, 1.0, D)


def test_isotropic_queries_round_to_nearest() -> None:
    x = random_keys(3, 2, 128, 64).transpose(-1, -2)  # channel rows [3, 2, D, G]
    scale, zero = torch.rand(3, 2, 64) * 0.5 + 0.1, -torch.rand(3, 2, 64) - 1.0
    levels = torch.where(torch.rand(3, 2, 64) < 0.125, 15.0, 3.0)
    want = quantize_codes(x, scale[..., None], zero[..., None], levels[..., None])
    for c in (1.0, 7.5, 0.0):  # a multiple of the identity, and no query seen at all
        assert torch.equal(feedback_codes(x, scale, zero, levels, c * torch.eye(64).expand(3, 2, 64, 64)), want)


def test_codes_follow_a_permutation_of_the_channels() -> None:
    x = random_keys(2, 32, 16).transpose(-1, -2)  # [2, D=16, G=32]
    scale, zero, levels = torch.rand(2, 16) + 0.2, torch.randn(2, 16), torch.full((2, 16), 3.0)
    cov = anisotropic_cov(2, 16)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    codes = feedback_codes(x, scale, zero, levels, cov)
    moved = feedback_codes(x[:, perm], scale[:, perm], zero[:, perm], levels[:, perm], cov[:, perm][:, :, perm])
    assert torch.equal(moved, codes[:, perm])


@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_logit_error_same_ranges_and_bytes(D: int, dtype: torch.dtype) -> None:
    k = random_keys(4, 3, 128, D).to(dtype)
    cov = anisotropic_cov(3, D)
    near = quantize_key_page(k, get_preset("kitty"))
    fed = quantize_key_page(k, get_preset(QUERY), query_cov=cov)
    for name in ("scale", "zero", "boost_idx"):
        assert torch.equal(getattr(near, name), getattr(fed, name)), name
    assert near.low.shape == fed.low.shape and near.high.shape == fed.high.shape
    assert not torch.equal(near.low, fed.low)
    errors = [dequantize_key_page(p).float() - k.float() for p in (near, fed)]
    logit = [torch.einsum("nhgd,hde,nhge->", e, cov, e).item() for e in errors]
    assert logit[1] < 0.8 * logit[0]  # the queries' expected squared logit error falls
    keyerr = [e.square().sum().item() for e in errors]
    assert keyerr[1] > keyerr[0]  # bought with a larger key error: nearest rounding minimizes that one


def test_cache_keeps_the_queries_second_moment_and_packs_with_it() -> None:
    cfg = get_preset(QUERY).with_(sink_tokens=4, group_size=16, local_window=8)
    cache = KittyCache(tiny_llama_config(num_hidden_layers=1), cfg)
    from kitty.cache.attention import kitty_attention_forward

    torch.manual_seed(0)
    T, D = 4 + 2 * 16 + 3, 16
    k, v = random_keys(1, HKV, T, D), torch.randn(1, HKV, T, D)
    q = torch.randn(1, HQ, T, D) * torch.linspace(0.1, 3.0, D)
    kitty_attention_forward(None, q, *cache.update(k, v, 0), None, scaling=D**-0.5)
    layer = cache.layers[0]
    grouped = q.reshape(1, HKV, HQ // HKV, T, D)
    want = torch.einsum("bhgtd,bhgte->bhde", grouped, grouped) / (T * HQ // HKV)
    torch.testing.assert_close(layer.query_cov(), want)
    page = layer.key_page(0, 1)  # the prompt's second page, rounded against the prompt's queries
    ref = quantize_key_page(k[0][:, 4 + 16 : 4 + 32], cfg, query_cov=want[0])
    assert torch.equal(dequantize_key_page(page), dequantize_key_page(ref))
    cache.reset()
    assert not layer.q_cov_sum.any()


def test_generates_through_a_cache_with_kittys_bits() -> None:
    from fixtures import check_generates_on_torch, checked_cache_bits

    check_generates_on_torch(get_preset(QUERY))
    kitty = get_preset("kitty")
    T = kitty.sink_tokens + 3 * kitty.group_size + kitty.local_window + 5
    assert checked_cache_bits(get_preset(QUERY), 64, T) == checked_cache_bits(kitty, 64, T)


def test_refusals_name_the_field() -> None:
    for bad in (
        {"key_rounding": "stochastic"},
        {"key_rounding": "query", "key_bits": 16, "boost_fraction": 0.0},
        {"key_rounding": "query", "key_rotation": "hadamard"},
        {"key_rounding": "query", "key_outlier_fraction": 0.01},
    ):
        with pytest.raises(ValueError, match="key_rounding"):
            KVQuantConfig(**bad)
    cfg = get_preset(QUERY)
    assert cfg.torch_only and not get_preset("kitty").torch_only
    with pytest.raises(ValueError, match="query_cov"):
        quantize_key_page(random_keys(1, 128, 64), cfg)
    with pytest.raises(ValueError, match="key_rounding"):
        KittyCache(tiny_llama_config(num_hidden_layers=1), cfg, max_cache_len=512)


def test_kernel_backends_and_the_pack_refuse_query_rounding() -> None:
    """The Triton pack rounds to nearest, so a cache of this config runs on torch; the decode kernels could read its
    pages (the layout is nearest rounding's), which is why ``triton_supports`` is not what refuses it."""
    pytest.importorskip("triton")
    from kitty.cache.backend import check_triton, resolve_backend
    from kitty.kernels import pack_pages

    cfg, cuda = get_preset(QUERY), torch.device("cuda")
    assert resolve_backend("auto", cuda, cfg, 64) == "torch"
    for backend in ("triton", "gluon"):
        with pytest.raises(ValueError, match="key_rounding"):
            check_triton(cfg, 64, cuda, backend)
    with pytest.raises(ValueError, match="key_rounding"):
        pack_pages(cfg, torch.randn(1, 2, 128, 64), None)
