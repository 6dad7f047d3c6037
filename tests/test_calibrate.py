"""Layer-adaptive boost calibration: the fake-quantized pass, the exact allocation, the shipped profiles."""

from __future__ import annotations

import itertools

import pytest
import torch
from fixtures import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from kitty import PRESETS, analytic_report
from kitty.core.config import load_boost_profile
from kitty.core.quant import dequantize_key_page, quantize_key_page
from kitty.hf.compat import cache_kwargs
from kitty.tools.calibrate import allocate, fake_quantize_keys, layer_sensitivity

settings.register_profile("ci", deadline=None, derandomize=True, max_examples=40)
settings.load_profile("ci")


def test_fake_quantize_keys_rounds_full_pages_only():
    cfg = PRESETS["kitty"].with_(sink_tokens=4, group_size=8)
    torch.manual_seed(0)
    k, q = torch.randn(1, 2, 23, 16), torch.randn(1, 4, 23, 16)  # sink 4 | 2 pages of 8 | 3 tail tokens
    out = fake_quantize_keys(k, q, cfg)
    assert torch.equal(out[:, :, :4], k[:, :, :4]) and torch.equal(out[:, :, 20:], k[:, :, 20:])
    page = dequantize_key_page(quantize_key_page(k[0, :, 12:20], cfg))
    assert torch.equal(out[0, :, 12:20], page)
    assert not torch.equal(out[:, :, 4:20], k[:, :, 4:20])


@given(st.lists(st.lists(st.floats(0, 10), min_size=4, max_size=4), min_size=1, max_size=4), st.integers(0, 12))
def test_allocate_is_the_exact_optimum(rows, units):
    counts = (0, 4, 8, 12)
    kl = torch.tensor(rows)
    total = 4 * units
    combos = [c for c in itertools.product(range(4), repeat=len(rows)) if sum(counts[j] for j in c) == total]
    if not combos:
        with pytest.raises(ValueError, match="total"):
            allocate(kl, counts, total)
        return
    best = min(sum(kl[l, j].item() for l, j in enumerate(c)) for c in combos)
    got = allocate(kl, counts, total)
    assert sum(got) == total
    assert sum(kl[l, counts.index(c)].item() for l, c in enumerate(got)) == pytest.approx(best)


def test_layer_sensitivity_on_a_tiny_model():
    model = tiny_model(seed=1, initializer_range=0.3)  # peaked attention and logits
    cfg = PRESETS["kitty"].with_(sink_tokens=4, group_size=16)
    ids = torch.randint(0, 128, (100,))
    kl = layer_sensitivity(model, ids, cfg, counts=(0, 8, 16), progress=False)
    assert kl.shape == (2, 3) and (kl >= 0).all()
    assert (kl[:, 0] > kl[:, 2]).all()  # all channels at 4 bits hurts less than all at 2 bits
    assert model.config._attn_implementation != "kitty-calibrate"  # restored
    with pytest.raises(ValueError, match="ids"):
        layer_sensitivity(model, ids[:10], cfg, counts=(0, 8), progress=False)


@pytest.mark.parametrize("fraction,preset", [(0.125, "kitty"), (0.25, "kitty-pro")])
def test_shipped_profile_spends_exactly_the_uniform_budget(fraction, preset):
    prof = load_boost_profile("SmolLM2-135M-Instruct", fraction)
    assert len(prof) == 30 and all(round(f * 64) == f * 64 for f in prof)
    adaptive = PRESETS[preset].with_(boost_profile=prof)
    assert analytic_report(adaptive, 4096, 64, 3, 30) == analytic_report(PRESETS[preset], 4096, 64, 3, 30)
    assert len(set(prof)) > 1  # not uniform


def test_adaptive_presets_store_as_many_bytes_as_uniform_on_the_default_model():
    """memory_report of real caches after the same prompt: the adaptive presets cost exactly kitty's / kitty-pro's
    bytes."""
    from kitty import KittyCache, load_model

    model, tok = load_model()
    ids = torch.randint(100, 5000, (1, 32 + 3 * 128 + 5))
    reports = {}
    for name in ("kitty", "kitty-fit-adaptive", "kitty-pro", "kitty-pro-fit-adaptive"):
        cache = KittyCache(model.config, name)
        with torch.no_grad():
            model(ids, **cache_kwargs(cache), use_cache=True)
        reports[name] = cache.memory_report()
        nbs = {layer.cfg.num_boosted(64) for layer in cache.layers}
        assert (len(nbs) > 1) == ("adaptive" in name)  # adaptive layers pack different numbers of high planes
    assert reports["kitty-fit-adaptive"] == reports["kitty"]
    assert reports["kitty-pro-fit-adaptive"] == reports["kitty-pro"]
