"""``key_range="fit-attn"`` / ``"fit-attn-free"`` / ``"fit-attn-bound"``: key ranges fitted to the squared error weighted by each token's
attention under the mean query; ``"fit-attn-max-bound"`` / ``"fit-attn-max-token-bound"``: by its largest observed attention
(kitty/core/attnfit.py; random data, never zeros)."""

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
    observed_page_attention,
    observed_weights,
    split_query_stats,
    token_bound_steps,
    visible_page_weights,
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


@pytest.mark.parametrize(
    "family,key_range",
    [
        ("llama", "fit-attn-token-standout"),
        ("gemma3", "fit-attn-token-standout"),
        ("llama", "fit-attn-max-token-bound"),
    ],
)
def test_static_cache_gives_the_growing_caches_tokens(family, key_range):
    """The static cache (preallocated state, the mean query in its query statistics, or fit-attn-max's running
    maxima) decodes the same greedy tokens as the growing cache, and both really packed pages."""
    model = build(family)
    ids, mask = ragged_batch()
    cfg = PRESETS["kitty-fit"].with_(sink_tokens=S, group_size=G, local_window=R, key_range=key_range)
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


# ------------------------------------------------------------------------ fit-attn-max: the largest observed attention


def _brute_max_attention(q, k, q_pos, k_pos, G, scale):
    """``observed_page_attention`` one query head, query and page at a time: ``[H, L]``."""
    Hq, T, _ = q.shape
    H, L, _ = k.shape
    best = torch.zeros(H, L)
    for h in range(Hq):
        kv = h // (Hq // H)
        for t in range(T):
            for p0 in range(0, L, G):
                page = slice(p0, min(p0 + G, L))
                w = visible_page_weights(k[kv, page] @ q[h, t] * scale, k_pos[page] <= q_pos[t])
                best[kv, page] = torch.maximum(best[kv, page], w)
    return best


def test_visible_page_weights_have_mean_one_over_what_a_query_sees_and_refuse_bad_input():
    g = torch.Generator().manual_seed(20)
    logits = torch.randn(5, 16, generator=g) * 3
    visible = torch.arange(16)[None, :] <= torch.tensor([0, 3, 7, 15, -1])[:, None]  # the last row sees nothing
    w = visible_page_weights(logits, visible)
    assert (w[~visible] == 0).all() and (w[4] == 0).all()
    torch.testing.assert_close(w[:4].sum(-1), visible[:4].sum(-1).float())  # mean 1 over the visible tokens
    torch.testing.assert_close(w[3], torch.softmax(logits[3], -1) * 16)  # a whole page: G * softmax
    assert w[0, 0] == 1  # a query that sees one token of the page
    with pytest.raises(ValueError, match="logits"):
        visible_page_weights(torch.ones(0), torch.ones(0, dtype=torch.bool))


def test_observed_page_attention_is_the_causal_page_local_maximum_in_chunks():
    """Against a loop over query heads, queries and pages: GQA groups of 2, a stream of 2.5 pages after the sink,
    queries before the stream (which see none of it), chunks of 3 queries or all at once."""
    g = torch.Generator().manual_seed(21)
    H, Hq, D, G, S = 2, 4, 16, 8, 4
    L, T = 20, 14
    k = torch.randn(H, L, D, generator=g) + 0.2
    q = torch.randn(Hq, T, D, generator=g) * 2
    k_pos, q_pos = torch.arange(S, S + L), torch.arange(S + L - T - 2, S + L - 2)  # the last two keys: no query
    want = _brute_max_attention(q, k, q_pos, k_pos, G, D**-0.5)
    for chunk in (3, 256):
        got = observed_page_attention(q, k, q_pos, k_pos, G, D**-0.5, chunk=chunk)
        torch.testing.assert_close(got, want)
    assert (want[:, -2:] == 0).all() and (want[:, :-2] > 0).all()
    with pytest.raises(ValueError, match="query must be"):
        observed_page_attention(q[:3], k, q_pos, k_pos, G, 1.0)
    with pytest.raises(ValueError, match="query_pos"):
        observed_page_attention(q, k, q_pos[:-1], k_pos, G, 1.0)
    with pytest.raises(ValueError, match="group_size"):
        observed_page_attention(q, k, q_pos, k_pos, 0, 1.0)


def test_a_token_one_query_attends_keeps_half_a_step_where_the_mean_query_ignores_it():
    """Token 17 lies against the mean of 64 queries and along one of them (orthogonal to the mean), without standing
    out: the mean query gives it a weight near 0 (bound: one step), its largest observed attention is far above 1,
    so ``fit-attn-max-bound`` holds it within half a min-max step."""
    g = torch.Generator().manual_seed(22)
    D, G = 64, 128
    x = torch.randn(D, G, generator=g) * (torch.rand(D, 1, generator=g) * 2 + 0.5)
    queries = torch.randn(64, D, generator=g) * 0.5 + torch.randn(D, generator=g)  # around a common direction
    qbar = queries.mean(0)
    spike = torch.randn(D, generator=g)
    spike -= (spike @ qbar) / (qbar @ qbar) * qbar  # orthogonal to the mean query
    x[:, 17] = 0.8 * spike / spike.norm() * D**0.5 - 0.5 * qbar / qbar.norm() * D**0.5
    queries[40] = spike / spike.norm() * D**0.5 * 3
    assert not standout_tokens(x)[17]
    mean_w = attention_weights(x, queries.mean(0))
    assert mean_w[0, 17] < 0.25 and token_bound_steps(x, mean_w)[0, 17] == LOOSE_STEPS
    seen = observed_page_attention(queries[None], x.T[None], torch.full((64,), G), torch.arange(G), G, D**-0.5)
    w = observed_weights(x, seen[0])
    assert w[0, 17] > 4 and token_bound_steps(x, w)[0, 17] == TIGHT_STEPS
    levels = torch.full((D,), 3)
    scale, zero = range_params(x, levels, torch.float32, "fit-attn-max-bound", query_stat=seen[0])
    mm_scale = minmax_params(x, levels, -1, torch.float32)[0]
    assert (_dequant_error(x, scale, zero, levels)[:, 17].abs() <= 0.5 * mm_scale * (1 + 2**-10) + 1e-6).all()
    loose = range_params(x, levels, torch.float32, "fit-attn-bound", query_stat=queries.mean(0))
    assert (_dequant_error(x, *loose, levels)[:, 17].abs() > 0.5 * mm_scale * (1 + 2**-10) + 1e-6).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_bound_holds_per_token_and_reduces_to_the_unweighted_rules(dtype):
    """``fit-attn-max-bound`` with random observed weights: every value within its token's bound, some beyond half a
    step; ``fit-attn-max-token-bound`` keeps min-max on the token test's rows; ``fit-attn-max-rel-bound`` is the same
    with the weights over their page's mean; without weights all are ``fit-bounded`` / ``fit-token-standout`` bit for
    bit; bad weights are refused."""
    x, _, levels = _standout_page(dtype, seed=23)
    seen = torch.rand(3, 128, generator=torch.Generator().manual_seed(24)).square() * 3
    w = observed_weights(x, seen)
    scale, zero = range_params(x, levels, dtype, "fit-attn-max-bound", query_stat=seen)
    mm_scale = minmax_params(x, levels, -1, dtype)[0].float()[..., None]
    diff = _dequant_error(x.float(), scale, zero, levels).abs()
    tol = 2**-20 * x.float().abs().amax(-1, keepdim=True)
    assert (diff <= token_bound_steps(x, w) * mm_scale * (1 + 2**-10) + tol).all()
    assert (diff > 0.5 * mm_scale * (1 + 2**-10) + tol).any()
    _assert_standout_rows_min_max(x, seen, levels, dtype, "fit-attn-max-token-bound", "fit-attn-max-bound")
    rel = range_params(x, levels, dtype, "fit-attn-max-rel-bound", query_stat=seen)
    want = range_params(x, levels, dtype, "fit-attn-max-bound", query_stat=seen / seen.mean(-1, keepdim=True))
    assert torch.equal(rel[0], want[0]) and torch.equal(rel[1], want[1])  # the maxima over their page's mean
    torch.testing.assert_close(observed_weights(x, seen, relative=True).mean(-1), torch.ones(3, 1))
    assert torch.equal(observed_weights(x, torch.zeros(3, 128), relative=True), torch.ones(3, 1, 128))
    for method, plain in (
        ("fit-attn-max-bound", "fit-bounded"),
        ("fit-attn-max-token-bound", "fit-token-standout"),
        ("fit-attn-max-rel-bound", "fit-bounded"),
        ("fit-attn-max-rel-token-bound", "fit-token-standout"),
    ):
        got, want = range_params(x, levels, dtype, method), range_params(x, levels, dtype, plain)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="weight must be"):
        range_params(x, levels, dtype, "fit-attn-max-bound", query_stat=seen[..., :64])
    with pytest.raises(ValueError, match="oracle"):
        PRESETS["kitty"].with_(key_range="fit-attn-max-token-bound")
    with pytest.raises(ValueError, match="value_range"):
        PRESETS["kitty-fit"].with_(value_range="fit-attn-max-bound")


def test_max_token_bound_pages_have_kitty_fits_bytes_and_sync_free_bytes():
    cfg = get_preset("kitty-fit+key_range=fit-attn-max-token-bound")
    g = torch.Generator().manual_seed(25)
    k = (torch.randn(2, 3, 128, 64, generator=g) * torch.rand(64, generator=g) * 4 + 0.3).to(torch.bfloat16)
    qs = torch.rand(2, 3, 64, generator=g) + 0.5
    stats = torch.cat([qs, torch.rand(2, 3, 128, generator=g) * 3], -1)  # [..., D + G], as the cache passes it
    page = quantize_key_page(k, cfg, query_scale=stats)
    ref = quantize_key_page(k, PRESETS["kitty-fit"], query_scale=qs)
    assert {n: (t.shape, t.dtype) for n, t in page.tensors().items()} == {
        n: (t.shape, t.dtype) for n, t in ref.tensors().items()
    }
    assert page.nbytes == ref.nbytes
    free = quantize_key_page(k, cfg, query_scale=stats, sync_free=True)
    assert all(torch.equal(t, free.tensors()[n]) for n, t in page.tensors().items())
    assert not all(torch.equal(t, ref.tensors()[n]) for n, t in page.tensors().items())


def test_cache_keeps_the_largest_observed_attention_per_slot_and_packs_with_it(monkeypatch):
    """Through the real path: a prompt, then decode steps. A page of the prompt is packed with the largest attention
    of the prompt queries at or after each token; a page filled in decode with that of the queries seen while it sat
    in the qbuffer (the prompt's, then each step's); the layer's slots hold the same running maximum."""
    import kitty.cache.backend as backend
    import kitty.cache.layer as layer_module

    packed = []  # the query statistics each key page was quantized with

    def spy(k, cfg, **kwargs):
        packed.append(kwargs["query_scale"].clone())
        return quantize_key_page(k, cfg, **kwargs)

    monkeypatch.setattr(layer_module, "quantize_key_page", spy)
    monkeypatch.setattr(backend, "quantize_key_page", spy)
    torch.manual_seed(3)
    cfg = PRESETS["kitty-fit"].with_(sink_tokens=S, group_size=G, local_window=R, key_range="fit-attn-max-token-bound")
    cache = KittyCache(tiny_llama_config(num_hidden_layers=1), cfg, backend="torch")
    T0, T1, T = S + G + 3, S + 3 * G, S + 3 * G + 2
    k, v = torch.randn(1, HKV, T, D) + 0.1, torch.randn(1, HKV, T, D) + 0.1
    q = torch.randn(1, HQ, T, D) * 2 + 0.3
    pos = torch.arange(T)
    for a, z in [(0, T0)] + [(t, t + 1) for t in range(T0, T)]:
        cols = slice(a, z)
        kitty_attention_forward(
            None, q[:, :, cols], *cache.update(k[:, :, cols], v[:, :, cols], 0), None, scaling=D**-0.5
        )
    assert len(packed) == 3 and all(p.shape == (1, HKV, D + G) for p in packed)
    for j, queries in ((0, T0), (1, S + 2 * G), (2, T1)):  # up to the query of the step that filled the page
        keys = slice(S + j * G, S + (j + 1) * G)
        seen = _brute_max_attention(q[0, :, :queries], k[0, :, keys], pos[:queries], pos[keys], G, D**-0.5)
        torch.testing.assert_close(packed[j][0, :, D:], seen)
    layer = cache.layers[0]
    kept = slice(T1, T)
    seen = _brute_max_attention(q[0], k[0, :, kept], pos, pos[kept], G, D**-0.5)
    torch.testing.assert_close(layer.k_attn_max[0, :, : T - T1], seen)
    assert layer.query_scale().shape == (1, HKV, D + G)


def test_a_rolled_back_step_restores_the_running_maxima():
    """A decode step tried and rolled back (as when a later layer fails): ``k_attn_max`` and ``q_stat_sum`` are as
    before, and the step run again gives the state of a layer that never tried."""
    cfg = PRESETS["kitty-fit"].with_(sink_tokens=S, group_size=G, local_window=R, key_range="fit-attn-max-token-bound")
    g = torch.Generator().manual_seed(26)
    T0 = S + G + 3
    k, v = torch.randn(2, 1, HKV, T0 + 1, D, generator=g) + 0.1
    q = torch.randn(1, HQ, T0 + 1, D, generator=g) * 2
    caches = [KittyCache(tiny_llama_config(num_hidden_layers=2), cfg, backend="torch") for _ in range(2)]
    for cache in caches:  # layer 0 only: the pass stays open (a later layer could still fail)
        kitty_attention_forward(None, q[:, :, :T0], *cache.update(k[:, :, :T0], v[:, :, :T0], 0), None, scaling=D**-0.5)
        cache.layers[0].end_step()
    tried, ref = (c.layers[0] for c in caches)
    before = (tried.k_attn_max.clone(), tried.q_stat_sum.clone())
    step = slice(T0, T0 + 1)
    kitty_attention_forward(
        None, q[:, :, step], *caches[0].update(k[:, :, step], v[:, :, step], 0), None, scaling=D**-0.5
    )
    assert not torch.equal(tried.k_attn_max, before[0])
    caches[0].rollback_forward()  # as when layer 1 fails
    assert torch.equal(tried.k_attn_max, before[0]) and torch.equal(tried.q_stat_sum, before[1])
    for cache in caches:
        kitty_attention_forward(
            None, q[:, :, step], *cache.update(k[:, :, step], v[:, :, step], 0), None, scaling=D**-0.5
        )
    assert torch.equal(tried.k_attn_max, ref.k_attn_max)


def test_needle_weights_screen_statistics_match_brute_force():
    """``benchmarks/needle_weights.py``'s screen: the maximum equals ``observed_page_attention``; the sum and the
    top-k mean equal a loop over every (query, query head) on random keys (a partial last page, queries inside the
    pages, fewer than ``TOP_K`` pairs for the last keys)."""
    import runpy
    from pathlib import Path

    screen = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks" / "needle_weights.py"))
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(4, 70, 8, generator=g) * 2, torch.randn(2, 50, 8, generator=g) + 0.3
    qpos, kpos, Gs, scale = torch.arange(20, 90), torch.arange(30, 80), 8, 0.35
    got = screen["observed_statistics"](q, k, qpos, kpos, Gs, scale, chunk=16)
    assert torch.equal(got["max"], observed_page_attention(q, k, qpos, kpos, Gs, scale))
    top_k = screen["TOP_K"]
    kp = torch.nn.functional.pad(k, (0, 0, 0, 6))  # 56 keys: 7 whole pages
    vals = [[[] for _ in range(50)] for _ in range(2)]
    for t in range(70):
        for hq in range(4):
            h = hq // 2
            visible = torch.cat([kpos <= qpos[t], torch.zeros(6, dtype=torch.bool)])
            w = visible_page_weights((kp[h] @ q[hq, t] * scale).reshape(7, Gs), visible.reshape(7, Gs)).reshape(-1)
            for j in range(50):
                if visible[j]:
                    vals[h][j].append(float(w[j]))
    total = torch.tensor([[sum(v) for v in row] for row in vals])
    top = torch.tensor([[sum(sorted(v, reverse=True)[:top_k]) / top_k for v in row] for row in vals])
    assert min(len(v) for row in vals for v in row) < top_k < max(len(v) for row in vals for v in row)
    torch.testing.assert_close(got["sum"], total, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[f"top{top_k}"], top, rtol=1e-5, atol=1e-5)
