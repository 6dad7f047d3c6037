"""``key_range="fit-standout"`` / ``"fit-peak-standout"`` / the token rules: min-max on rows where a value (or a token
of the page) stands out, a fitted range elsewhere (kitty/core/standout.py; random data, never zeros)."""

import pytest
import torch

from kitty import PRESETS, get_preset
from kitty.core.quant import (
    _sq_error,
    dequantize_key_page,
    quantize_key_page,
    range_params,
)
from kitty.core.ranges import LOOSE_BOUND_STEPS, _dequant_error, minmax_params
from kitty.core.standout import (
    STANDOUT_FITS,
    STANDOUT_THRESHOLD,
    standout_rows,
    standout_score,
    standout_tokens,
    token_standout_rows,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rows(dtype, seed, rows=32, n=128):
    """Gaussian rows (random offset and spread); the even rows get one planted value 12 spreads from their median."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.rand(rows, 1, generator=g) * 3 + 0.2
    x = torch.randn(rows, n, generator=g) * spread + torch.randn(rows, 1, generator=g)
    planted = torch.arange(rows) % 2 == 0
    sign = torch.where(torch.rand(rows, generator=g) < 0.5, -1.0, 1.0)
    tok = torch.randint(0, n, (rows,), generator=g)
    x[planted, tok[planted]] = x[planted].median(-1).values + sign[planted] * 12 * spread[planted, 0]
    return x.to(dtype), planted


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["fit-standout", "fit-peak-standout"])
def test_a_standout_row_keeps_min_max_and_the_others_the_fitted_rule(dtype, method):
    """A planted standout keeps its row's exact min (the zero) and min-max's scale; a row without one gets exactly
    the fitted rule's parameters; 2-bit and 4-bit rows mixed in one call."""
    x, planted = _rows(dtype, seed=3)
    levels = torch.where(torch.arange(x.shape[0]) % 3 == 0, 15, 3)
    out = standout_rows(x)
    assert out[planted].all()
    assert (~out[~planted]).float().mean() >= 0.75  # Gaussian rows of 128 rarely pass a robust z of 4
    scale, zero = range_params(x, levels, dtype, method)
    mm_scale, mm_zero = minmax_params(x, levels, -1, dtype)
    fit_scale, fit_zero = range_params(x, levels, dtype, STANDOUT_FITS[method])
    assert torch.equal(scale[out], mm_scale[out]) and torch.equal(zero[out], mm_zero[out])
    assert torch.equal(zero[planted], x[planted].amin(-1))  # the min is a level, exactly
    assert torch.equal(scale[~out], fit_scale[~out]) and torch.equal(zero[~out], fit_zero[~out])
    assert not torch.equal(fit_scale[planted], mm_scale[planted])  # the fitted rule alone would move the extremes


def test_standout_score_on_simple_rows():
    """The score is the extreme's robust z; a constant row scores 0, a row of equal values but one scores inf."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 129, generator=g) + 2.5
    x[1] = 1.75
    x[2, :] = -0.5
    x[2, 7] = 3.0
    med = x[0].median()
    dev = (x[0] - med).abs()
    expected = dev.max() / (dev.median() * 1.4826)
    score = standout_score(x)
    assert torch.allclose(score[0], expected) and score[1] == 0 and score[2] == torch.inf
    assert standout_rows(x).tolist() == [bool(expected > STANDOUT_THRESHOLD), False, True]
    with pytest.raises(ValueError, match="threshold"):
        standout_rows(x, threshold=-1.0)
    with pytest.raises(ValueError, match="x must"):
        standout_score(torch.randn(3, 0))


@pytest.mark.parametrize(
    "name",
    [
        "kitty-fit+key_range=fit-standout",
        "kitty+key_range=fit-peak-standout",
        "kitty-fit+key_range=fit-token-standout",
        "kitty-fit+key_range=fit-loose-token-standout",
    ],
)
def test_standout_key_pages_have_min_max_layout_and_sync_free_bytes(name):
    """A key page with a standout range has min-max's tensors (shapes, dtypes, bytes), and ``sync_free`` gives the
    same bytes; its error is at most min-max's on keys with planted standouts."""
    cfg = get_preset(name)
    g = torch.Generator().manual_seed(2)
    k = (torch.randn(2, 3, 128, 64, generator=g) * torch.rand(64, generator=g) * 4 + 0.3).to(torch.bfloat16)
    k[..., 5, 9] = 40.0  # a token that stands out in channel 9 of every page
    qs = torch.rand(2, 3, 64, generator=g) + 0.5
    page = quantize_key_page(k, cfg, query_scale=qs)
    ref = quantize_key_page(k, PRESETS["kitty"].with_(channel_selection=cfg.channel_selection), query_scale=qs)
    assert {n: (t.shape, t.dtype) for n, t in page.tensors().items()} == {
        n: (t.shape, t.dtype) for n, t in ref.tensors().items()
    }
    assert page.nbytes == ref.nbytes
    free = quantize_key_page(k, cfg, query_scale=qs, sync_free=True)
    assert all(torch.equal(t, free.tensors()[n]) for n, t in page.tensors().items())
    back = dequantize_key_page(page).float()
    assert ((back[..., 5, 9] - 40.0).abs() <= 0.25).all()  # the top level, up to the scale's rounding up
    assert (back - k.float()).square().sum() <= (dequantize_key_page(ref).float() - k.float()).square().sum()
    with pytest.raises(ValueError, match="key_range"):
        PRESETS["kitty"].with_(key_range="standout")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["fit-token-standout", "fit-peak-token-standout", "fit-loose-token-standout"])
def test_a_token_standing_out_across_channels_keeps_min_max_where_it_is_an_extreme(dtype, method):
    """``fit-token-standout``: a token shifted by 3 spreads in every channel stands out (no other token does on
    Gaussian pages); the channels whose min or max it is keep min-max ranges, every other channel the fitted rule's."""
    g = torch.Generator().manual_seed(4)
    k = torch.randn(2, 128, 64, generator=g) * (torch.rand(64, generator=g) * 2 + 0.3)  # [pages, G, D]
    k[:, 17] = k[:, 17] + 3 * torch.where(torch.rand(2, 64, generator=g) < 0.5, -1.0, 1.0) * k.std(-2)
    x = k.to(dtype).transpose(-1, -2)  # [pages, D, G]: one row per channel
    tokens = standout_tokens(x)
    assert tokens[:, 17].all() and tokens.sum() == 2
    rows = token_standout_rows(x)
    extreme = (x.argmax(-1) == 17) | (x.argmin(-1) == 17)
    assert torch.equal(rows, extreme) and rows.float().mean() > 0.5
    levels = torch.where(torch.arange(64) % 8 == 0, 15, 3)
    scale, zero = range_params(x, levels, dtype, method)
    mm_scale, mm_zero = minmax_params(x, levels, -1, dtype)
    fit_scale, fit_zero = range_params(x, levels, dtype, STANDOUT_FITS[method])
    assert torch.equal(scale[rows], mm_scale[rows]) and torch.equal(zero[rows], mm_zero[rows])
    assert torch.equal(scale[~rows], fit_scale[~rows]) and torch.equal(zero[~rows], fit_zero[~rows])
    assert torch.equal(zero[rows], x[rows].amin(-1))  # the standout rows' min is a level, exactly
    err = _dequant_error(x.float(), scale, zero, levels.expand(scale.shape))
    at_max = err.gather(-1, x.argmax(-1, keepdim=True))[..., 0].abs()  # the max on the top level, up to the rounding
    assert (at_max[rows] <= (levels * scale.float() * 2**-7 + 1e-5 * x.float().abs().amax(-1))[rows]).all()  # of scale
    with pytest.raises(ValueError, match="x must"):
        standout_tokens(torch.randn(5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_fit_loose_keeps_every_value_within_one_minmax_step(dtype, seed):
    """``fit-loose`` (the fitted part of ``fit-loose-token-standout``): no value reconstructs farther than
    ``LOOSE_BOUND_STEPS`` min-max steps from itself, each row's squared error is at most min-max's and the total below
    ``fit-bounded``'s (its grid candidates are a superset; the refits start from another point, so not row by row), and
    it does use the looser bound: on Gaussian rows some value moves by more than half a step; 2-bit and 4-bit rows
    mixed."""
    x, _ = _rows(dtype, seed, rows=96)
    levels = torch.where(torch.arange(x.shape[0]) % 3 == 0, 15, 3)
    xf = x.float()
    mm_scale = minmax_params(x, levels, -1, dtype)[0].float()
    scale, zero = range_params(x, levels, dtype, "fit-loose")
    worst = _dequant_error(xf, scale, zero, levels).abs().amax(-1)
    assert LOOSE_BOUND_STEPS == 1.0
    assert (worst <= LOOSE_BOUND_STEPS * mm_scale * (1 + 2**-10) + 2**-20 * xf.abs().amax(-1)).all()
    err = _sq_error(xf, scale, zero, levels)
    assert (err <= _sq_error(xf, *minmax_params(x, levels, -1, dtype), levels) * (1 + 1e-6)).all()
    assert err.sum() < 0.9 * _sq_error(xf, *range_params(x, levels, dtype, "fit-bounded"), levels).sum()
    gauss = torch.randn(200, 128, generator=torch.Generator().manual_seed(seed)).to(dtype)
    g_scale, g_zero = range_params(gauss, 3, dtype, "fit-loose")
    g_mm = minmax_params(gauss, 3, -1, dtype)[0].float()
    assert (_dequant_error(gauss.float(), g_scale, g_zero, 3).abs().amax(-1) > 0.5 * g_mm * (1 + 2**-10)).any()
    e_loose = _sq_error(gauss.float(), g_scale, g_zero, 3).sum()
    assert e_loose < _sq_error(gauss.float(), *range_params(gauss, 3, dtype, "fit-bounded"), 3).sum()
    assert get_preset("kitty-fit+key_range=fit-loose-token-standout").key_range == "fit-loose-token-standout"
    with pytest.raises(ValueError, match="fit-loose"):
        range_params(x, 3, dtype, "loose")
