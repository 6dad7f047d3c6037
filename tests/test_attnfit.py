"""``key_range="fit-attn"`` / ``"fit-attn-free"`` / ``"fit-attn-bound"``: key ranges fitted to the squared error weighted by each token's
attention under the mean query (kitty/core/attnfit.py; random data, never zeros)."""

import pytest
import torch
from test_cache import HKV, HQ, D, G, R, S, tiny_llama_config
from test_static import NEW, B, T, build, hf_greedy, ragged_batch

from kitty import PRESETS, KittyCache, get_preset
from kitty.cache.attention import kitty_attention_forward
from kitty.core.attnfit import (
    ATTN_FITS,
    LOOSE_STEPS,
    TIGHT_STEPS,
    attention_weights,
    split_query_stats,
    token_bound_steps,
)
from kitty.core.quant import (
    dequantize_key_page,
    key_page_codes,
    quantize_codes,
    quantize_key_page,
    range_params,
)
from kitty.core.ranges import _dequant_error, minmax_params
from kitty.core.standout import standout_tokens, token_standout_rows
from kitty.hf.generate import generate_static

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
METHODS = sorted(ATTN_FITS)


def _page(dtype, seed, lead=(3,), D=64, G=128):
    """Key rows ``[..., D, G]`` (random offset and spread per channel), a mean query ``[..., D]`` and mixed levels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, D, G, generator=g) * (torch.rand(D, 1, generator=g) * 3 + 0.2) + torch.randn(
        D, 1, generator=g
    )
    qbar = torch.randn(*lead, D, generator=g) * 2
    levels = torch.where(torch.arange(D) % 5 == 0, 15, 3)
    return x.to(dtype), qbar, levels


def _weighted_error(x, scale, zero, levels, w):
    return (_dequant_error(x.float(), scale, zero, levels).square() * w).sum(-1)


def test_attention_weights_are_the_mean_querys_softmax_times_G():
    x, qbar, _ = _page(torch.float32, seed=1)
    w = attention_weights(x, qbar)
    assert w.shape == (3, 1, 128)
    want = torch.softmax((qbar[..., None] * x).sum(-2) / 8.0, -1) * 128  # tau = 1 / sqrt(64)
    torch.testing.assert_close(w[:, 0], want)
    torch.testing.assert_close(w.mean(-1), torch.ones(3, 1))
    assert torch.equal(attention_weights(x, None), torch.ones(3, 1, 128))
    with pytest.raises(ValueError, match="query_mean"):
        attention_weights(x, qbar[..., :32])
    with pytest.raises(ValueError, match="x must be"):
        attention_weights(torch.ones(5), None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weighted_error_is_never_worse_than_min_max_and_codes_stay_in_range(dtype, method, seed):
    """On the weighted squared error it minimizes, each row is at most min-max's (min-max is the first candidate);
    the codes stay in [0, levels]; the bounded variant keeps every value within half a min-max step."""
    x, qbar, levels = _page(dtype, seed)
    w = attention_weights(x, qbar)
    scale, zero = range_params(x, levels, dtype, method, query_stat=qbar)
    mm_scale, mm_zero = minmax_params(x, levels, -1, dtype)
    err = _weighted_error(x, scale, zero, levels, w)
    mm_err = _weighted_error(x, mm_scale, mm_zero, levels, w)
    assert (err <= mm_err).all()
    assert (err < mm_err).float().mean() > 0.5  # and strictly better on most rows
    assert scale.dtype == dtype and zero.dtype == dtype
    codes = quantize_codes(x, scale[..., None], zero[..., None], levels[:, None])
    assert (codes <= levels[:, None]).all() and (codes == levels[:, None]).any(-1).float().mean() > 0.9
    assert torch.isfinite(scale.float()).all() and (scale.float() > 0).all()
    if ATTN_FITS[method] == "fit-bounded":  # half a step, or fit-attn-bound's bound per token
        steps = token_bound_steps(x, w) if method == "fit-attn-bound" else 0.5
        diff = _dequant_error(x.float(), scale, zero, levels).abs()
        tol = 2**-20 * x.float().abs().amax(-1, keepdim=True)
        assert (diff <= steps * mm_scale.float()[..., None] * (1 + 2**-10) + tol).all()


@pytest.mark.parametrize("method", METHODS)
def test_without_a_mean_query_the_weights_are_uniform_and_the_plain_fit_comes_back(method):
    x, _, levels = _page(torch.bfloat16, seed=4)
    got = range_params(x, levels, torch.bfloat16, method, query_stat=None)
    want = range_params(x, levels, torch.bfloat16, ATTN_FITS[method])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_attended_token_gets_a_smaller_error_than_under_the_unweighted_fit():
    """A token the mean query attends far more than the others: the unweighted clipping search moves it (it is an
    extreme of most rows), the weighted one keeps it close."""
    x, _, _ = _page(torch.float32, seed=5, lead=())
    qbar = torch.randn(64, generator=torch.Generator().manual_seed(6))
    x[:, 17] = x.mean(-1) + 3.0 * x.std(-1) * qbar.sign()  # token 17 lies along the mean query in every channel
    assert attention_weights(x, qbar)[0, 17] > 50
    levels = torch.full((64,), 3)
    fitted = range_params(x, levels, torch.float32, "fit-attn-free", query_stat=qbar)
    plain = range_params(x, levels, torch.float32, "fit")
    err_w = _dequant_error(x, *fitted, levels)[:, 17].square().sum()
    err_p = _dequant_error(x, *plain, levels)[:, 17].square().sum()
    assert err_w < 0.25 * err_p


@pytest.mark.parametrize("method", METHODS)
def test_key_pages_keep_kitty_fits_layout_bytes_and_sync_free_bytes(method):
    """``query_scale`` ``[..., 2D]`` (RMS then mean query, as the cache passes it) gives a page with kitty-fit's tensors
    and bytes, identical under ``sync_free``; ``[..., D]`` alone gives the unweighted fit's page."""
    cfg = get_preset(f"kitty-fit+key_range={method}")
    g = torch.Generator().manual_seed(2)
    k = (torch.randn(2, 3, 128, 64, generator=g) * torch.rand(64, generator=g) * 4 + 0.3).to(torch.bfloat16)
    qs = torch.rand(2, 3, 64, generator=g) + 0.5
    both = torch.cat([qs, torch.randn(2, 3, 64, generator=g)], -1)
    page = quantize_key_page(k, cfg, query_scale=both)
    ref = quantize_key_page(k, PRESETS["kitty-fit"], query_scale=qs)
    shapes = {n: (t.shape, t.dtype) for n, t in page.tensors().items()}
    assert shapes == {n: (t.shape, t.dtype) for n, t in ref.tensors().items()}
    assert page.nbytes == ref.nbytes
    free = quantize_key_page(k, cfg, query_scale=both, sync_free=True)
    assert all(torch.equal(t, free.tensors()[n]) for n, t in page.tensors().items())
    codes = key_page_codes(page)
    assert codes.max() <= 15 and torch.isfinite(dequantize_key_page(page).float()).all()
    plain = quantize_key_page(k, cfg.with_(key_range=ATTN_FITS[method]), query_scale=qs)
    unweighted = quantize_key_page(k, cfg, query_scale=qs)
    assert all(torch.equal(t, plain.tensors()[n]) for n, t in unweighted.tensors().items())
    assert split_query_stats(both, 64)[1] is not None and split_query_stats(qs, 64)[1] is None


def test_config_refuses_fit_attn_for_values_and_without_oracle_selection():
    with pytest.raises(ValueError, match="value_range"):
        PRESETS["kitty-fit"].with_(value_range="fit-attn")
    with pytest.raises(ValueError, match="oracle"):
        PRESETS["kitty"].with_(key_range="fit-attn-free")


@pytest.mark.parametrize("method", METHODS)
def test_cache_keeps_the_mean_query_and_packs_with_it_at_kitty_fits_bytes(method):
    """Through the real path: the layer's ``query_scale`` is the oracle's RMS of q then the mean q of the GQA group,
    every stored key page equals quantizing its keys with it, and ``memory_report()`` equals kitty-fit's."""
    torch.manual_seed(0)
    cfg = PRESETS["kitty-fit"].with_(sink_tokens=S, group_size=G, local_window=R, key_range=method)
    reports = []
    for c in (cfg, cfg.with_(key_range="fit")):
        cache = KittyCache(tiny_llama_config(num_hidden_layers=1), c)
        T = S + 3 * G + R + 2
        torch.manual_seed(1)
        k, v = torch.randn(2, HKV, T, D) + 0.1, torch.randn(2, HKV, T, D) + 0.1
        q = torch.randn(2, HQ, T, D) + 0.5
        kitty_attention_forward(None, q, *cache.update(k, v, 0), None, scaling=D**-0.5)
        reports.append(cache.memory_report())
        if c is not cfg:
            continue
        layer = cache.layers[0]
        stats = layer.query_scale()
        assert stats.shape == (2, HKV, 2 * D)
        grouped = q.reshape(2, HKV, HQ // HKV, T, D)
        torch.testing.assert_close(stats[..., D:], grouped.mean((2, 3)))
        torch.testing.assert_close(stats[..., :D], grouped.square().mean((2, 3)).sqrt())
        for b in range(2):
            for j in range(3):
                want = quantize_key_page(k[b, :, S + j * G : S + (j + 1) * G], cfg, query_scale=stats[b])
                got = layer.key_page(b, j)
                for name, t in want.tensors().items():
                    assert torch.equal(getattr(got, name), t), (b, j, name)
    assert reports[0] == reports[1]


def _assert_page_like_kitty_fit(key_range: str, x, qbar) -> None:
    """Pages of ``kitty-fit+key_range=<key_range>`` from two rows of ``x`` (as keys ``[2, G, D]``): the same bytes
    under ``sync_free``, and as many bytes as ``kitty-fit``'s (so ``kitty``'s bits)."""
    cfg = get_preset(f"kitty-fit+key_range={key_range}")
    k = x[:2].transpose(-1, -2).contiguous()  # [2, G, D]
    qs = torch.cat([torch.rand(2, 64) + 0.5, qbar[:2]], -1)
    page = quantize_key_page(k, cfg, query_scale=qs)
    free = quantize_key_page(k, cfg, query_scale=qs, sync_free=True)
    assert all(torch.equal(t, free.tensors()[n]) for n, t in page.tensors().items())
    assert page.nbytes == quantize_key_page(k, PRESETS["kitty-fit"], query_scale=qs[..., :64]).nbytes


def _assert_standout_rows_min_max(x, qbar, levels, dtype, method: str, inner: str) -> None:
    """``method``'s ranges: min-max's exact parameters on the token test's rows (most rows of ``x``), ``inner``'s
    (with the same mean query) on the others."""
    out = token_standout_rows(x)
    assert out.float().mean() > 0.9
    scale, zero = range_params(x, levels, dtype, method, query_stat=qbar)
    mm = minmax_params(x, levels, -1, dtype)
    fit = range_params(x, levels, dtype, inner, query_stat=qbar)
    assert torch.equal(scale[out], mm[0][out]) and torch.equal(zero[out], mm[1][out])
    assert torch.equal(scale[~out], fit[0][~out]) and torch.equal(zero[~out], fit[1][~out])


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_standout_rows_keep_min_max_and_the_others_get_the_weighted_fit(dtype):
    """``fit-attn-token-standout``: rows whose min or max is a token standing out across the page keep min-max's
    exact parameters; every other row gets ``fit-attn``'s, with the same mean query."""
    x, qbar, levels = _page(dtype, seed=7)
    x = x.float()
    x[..., 40] += 12 * x.std(-1)  # token 40 stands out in every channel (the max of every row)
    x = x.to(dtype)
    _assert_standout_rows_min_max(x, qbar, levels, dtype, "fit-attn-token-standout", "fit-attn")
    _assert_page_like_kitty_fit("fit-attn-token-standout", x, qbar)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_static_cache_gives_the_growing_caches_tokens(family):
    """The static cache (preallocated state, the mean query in its query statistics) decodes the same greedy tokens
    as the growing cache with ``fit-attn-token-standout``, and both really packed pages."""
    model = build(family)
    ids, mask = ragged_batch()
    cfg = PRESETS["kitty-fit"].with_(sink_tokens=S, group_size=G, local_window=R, key_range="fit-attn-token-standout")
    ref = hf_greedy(model, ids, mask, KittyCache(model.config, cfg, backend="torch"))
    cache = KittyCache(model.config, cfg, backend="torch", max_batch_size=B, max_cache_len=T + NEW)
    out = generate_static(model, ids, mask, cache, NEW)
    assert torch.equal(out, ref)
    assert all(c["key_pages"] > 0 for c in cache.token_counts(per_row=True))


def _standout_page(dtype, seed):
    """``_page`` with token 40 standing out in every channel (the max of every row)."""
    x, qbar, levels = _page(dtype, seed)
    x = x.float()
    x[..., 40] += 12 * x.std(-1)
    return x.to(dtype), qbar, levels


def test_token_bound_steps_follow_the_weight_and_are_tight_at_standout_tokens():
    """``0.5 / sqrt(w)`` min-max steps clamped to [0.5, 1]: half a step where ``w >= 1``, one step where
    ``w <= 1/4``; half a step at a standout token whatever its weight; a weight of the wrong shape is refused."""
    x, qbar, _ = _standout_page(torch.float32, seed=8)
    w = attention_weights(x, qbar)
    steps = token_bound_steps(x, w)
    assert steps.shape == w.shape == (3, 1, 128)
    tight = standout_tokens(x)
    assert tight[:, 40].all() and tight.sum() < 3 * 128 // 10
    torch.testing.assert_close(steps[:, 0][tight], torch.full((int(tight.sum()),), TIGHT_STEPS))
    free = ~tight
    want = (0.5 / w[:, 0].sqrt()).clamp(TIGHT_STEPS, LOOSE_STEPS)
    torch.testing.assert_close(steps[:, 0][free], want[free])
    assert (steps[:, 0][free & (w[:, 0] >= 1)] == TIGHT_STEPS).all()
    assert (steps[:, 0][free & (w[:, 0] <= 0.25)] == LOOSE_STEPS).all()
    assert (steps == LOOSE_STEPS).float().mean() > 0.2 and (steps == TIGHT_STEPS).float().mean() > 0.05
    assert torch.equal(token_bound_steps(x, torch.ones_like(w)), torch.full_like(w, TIGHT_STEPS))
    with pytest.raises(ValueError, match="weight must be"):
        token_bound_steps(x, w[..., :64])


@pytest.mark.parametrize("dtype", DTYPES)
def test_bound_per_token_holds_loosens_where_light_and_lowers_the_weighted_error(dtype):
    """``fit-attn-bound``: every value within its token's bound (checked above for all methods), some lightly attended
    values really beyond half a step, every attended (``w >= 1``) or standout token within half a step, and a
    weighted error below ``fit-attn``'s (whose half-step bound admits fewer candidates) on average."""
    x, qbar, levels = _standout_page(dtype, seed=9)
    w = attention_weights(x, qbar)
    scale, zero = range_params(x, levels, dtype, "fit-attn-bound", query_stat=qbar)
    mm_scale = minmax_params(x, levels, -1, dtype)[0].float()[..., None]
    diff = _dequant_error(x.float(), scale, zero, levels).abs()
    tol = 2**-20 * x.float().abs().amax(-1, keepdim=True)
    tight = (w >= 1) | standout_tokens(x)[..., None, :]
    assert (diff <= (0.5 * mm_scale * (1 + 2**-10) + tol)).expand_as(diff)[tight.expand_as(diff)].all()
    assert (diff > 0.5 * mm_scale * (1 + 2**-10) + tol).any()
    half = range_params(x, levels, dtype, "fit-attn", query_stat=qbar)
    assert _weighted_error(x, scale, zero, levels, w).mean() < _weighted_error(x, *half, levels, w).mean()


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_bound_keeps_min_max_on_standout_rows_and_reduces_to_fit_token_standout(dtype):
    """``fit-attn-token-bound``: the token test's rows keep min-max's exact parameters, the others get
    ``fit-attn-bound``'s; without a mean query it is ``fit-token-standout`` bit for bit; a page has kitty-fit's bytes
    (so ``kitty``'s bits), the same under ``sync_free``; bad values and missing oracle statistics are refused."""
    x, qbar, levels = _standout_page(dtype, seed=10)
    _assert_standout_rows_min_max(x, qbar, levels, dtype, "fit-attn-token-bound", "fit-attn-bound")
    plain, _, _ = _page(dtype, seed=11)
    got = range_params(plain, levels, dtype, "fit-attn-token-bound", query_stat=None)
    want = range_params(plain, levels, dtype, "fit-token-standout")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _assert_page_like_kitty_fit("fit-attn-token-bound", plain, qbar)
    with pytest.raises(ValueError, match="range method"):
        range_params(x, levels, dtype, "fit-attn-token-bounds", query_stat=qbar)
    with pytest.raises(ValueError, match="oracle"):
        PRESETS["kitty"].with_(key_range="fit-attn-token-bound")
    with pytest.raises(ValueError, match="value_range"):
        PRESETS["kitty-fit"].with_(value_range="fit-attn-bound")
