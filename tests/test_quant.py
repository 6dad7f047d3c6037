"""Core quantizers: packing, key pages with channel boost, value pages, configs (random data, never zeros)."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kitty import PRESETS, KVQuantConfig, get_preset
from kitty.core.quant import (
    BOOST_SENTINEL,
    dequantize_key_page,
    dequantize_value_page,
    key_page_codes,
    pack_2bit,
    pack_bits,
    quantize_codes,
    quantize_key_page,
    quantize_value_page,
    unpack_2bit,
    unpack_bits,
)

settings.register_profile("ci", deadline=None, derandomize=True, max_examples=40)
settings.load_profile("ci")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KITTY = PRESETS["kitty"]


def planted_keys(shape, outliers, dtype=torch.float32, seed=0, gain=8.0):
    """Random keys ``[..., G, D]`` whose ``outliers`` channels have ``gain``x larger magnitude."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(*shape, generator=g)
    k[..., outliers] = k[..., outliers] * gain + gain
    return k.to(dtype)


# ------------------------------------------------------------------------------------------------ packing


@given(st.integers(1, 6), st.integers(1, 8), st.sampled_from([2, 4]), st.integers(0, 2**31 - 1))
def test_pack_unpack_roundtrip(rows, groups, bits, seed):
    n = groups * (8 // bits)
    codes = torch.randint(0, 2**bits, (rows, n, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_bits(codes, bits, dim=1)
    assert packed.shape == (rows, n * bits // 8, 3) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, bits, dim=1), codes)


def test_pack_2bit_bit_order():
    """Of n codes, code j + s*n/4 sits at bits 2s of byte j: bits 2s of the row's bytes are its s-th quarter."""
    codes = torch.tensor([[1, 2, 3, 0, 3, 3, 0, 1]], dtype=torch.uint8)
    packed = pack_2bit(codes)
    assert packed.tolist() == [[1 | 3 << 2 | 3 << 4 | 0 << 6, 2 | 0 << 2 | 3 << 4 | 1 << 6]]
    assert torch.equal(unpack_2bit(packed), codes)
    assert pack_bits(codes, 4).tolist() == [[1 | 3 << 4, 2 | 3 << 4, 3 | 0 << 4, 0 | 1 << 4]]  # j and j + n/2


def test_pack_rejects_bad_sizes():
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_2bit(torch.ones(3, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.ones(8, dtype=torch.uint8), 3)


# --------------------------------------------------------------------------------------------- key pages


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", ["kitty", "kitty-pro", "kivi-k2v2", "kivi-k4v4"])
def test_key_error_within_half_step(dtype, preset):
    cfg = PRESETS[preset]
    k = planted_keys((2, 3, 128, 64), [3, 17, 40], dtype)
    page = quantize_key_page(k, cfg)
    err = (dequantize_key_page(page).float() - k.float()).abs()  # (B, H, G, D)
    step = page.scale.float()[..., None, :]  # per channel
    out_ulp = k.float().abs().amax() * {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    assert (err <= step / 2 + out_ulp).all()
    assert dequantize_key_page(page).dtype == dtype


@given(st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0]))
@example(seed=1, fraction=0.125)
def test_key_error_property(seed, fraction):
    cfg = KITTY.with_(boost_fraction=fraction, group_size=16)
    k = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(seed)) * 3
    page = quantize_key_page(k, cfg)
    err = (dequantize_key_page(page) - k).abs()
    assert (err <= page.scale[..., None, :] / 2 + 1e-5).all()
    # re-quantizing the reconstruction (same boosted channels) is idempotent
    again = quantize_key_page(dequantize_key_page(page), cfg, boost_mask=page.boost_idx.long() < page.num_boosted)
    assert torch.equal(key_page_codes(again), key_page_codes(page))


@pytest.mark.parametrize("fraction,D", [(0.125, 64), (0.25, 128), (0.5, 128)])
def test_boosted_channels_are_top_k_by_mean_abs(fraction, D):
    """Planted outlier channels get boosted, and the boost set is exactly the top-k of mean |K| (>8 slots too)."""
    cfg = KITTY.with_(boost_fraction=fraction)
    nb = round(fraction * D)
    outliers = torch.randperm(D, generator=torch.Generator().manual_seed(1))[:nb].tolist()
    k = planted_keys((2, 128, D), outliers)
    page = quantize_key_page(k, cfg)
    boosted = page.boost_idx.long() < nb  # (2, D)
    expected = torch.zeros_like(boosted)
    expected[:, outliers] = True
    assert torch.equal(boosted, expected)
    top = k.abs().mean(-2).topk(nb).indices.sort().values
    assert torch.equal(boosted.nonzero()[:, 1].reshape(2, nb), top)
    # slots are 0..nb-1 in channel order, unboosted channels hold the sentinel
    assert torch.equal(page.boost_idx[boosted].reshape(2, nb).long(), torch.arange(nb).expand(2, nb))
    assert (page.boost_idx[~boosted] == BOOST_SENTINEL).all()
    assert page.high.shape == (2, 128, -(-nb // 4)) and page.low.shape == (2, 128, D // 4)  # token-major


def test_decomposition_is_exactly_invertible():
    """low | high << 2 through boost_idx gives back 4-bit codes on boosted channels, 2-bit elsewhere."""
    k = planted_keys((4, 128, 128), [0, 9, 77, 100])
    page = quantize_key_page(k, PRESETS["kitty-pro"])
    codes = key_page_codes(page)  # (4, D, G)
    boosted = page.boost_idx.long() < page.num_boosted
    assert codes[boosted].max() > 3  # boosted channels really use 4 bits
    assert codes[~boosted].max() <= 3
    xq = codes.float() * page.scale.float()[..., None] + page.zero.float()[..., None]
    assert torch.equal(xq.transpose(-1, -2), dequantize_key_page(page))


@pytest.mark.parametrize("D,fraction", [(64, 0.125), (40, 0.125), (36, 0.25), (128, 0.25), (256, 1.0)])
def test_stored_codes_are_the_quantizer_codes(D, fraction):
    """The planes hold exactly the codes of the min-max quantizer, whatever nb (a multiple of 4 or not: the high
    plane's padding slots hold 0 and are never read), so the dequantized page does not depend on the layout."""
    cfg = KITTY.with_(boost_fraction=fraction)
    nb = cfg.num_boosted(D)
    k = planted_keys((2, 128, D), [1, 5, 9])
    page = quantize_key_page(k, cfg)
    boosted = page.boost_idx.long() < nb  # at D = nb = 256 slot 255 is channel 255's, not the sentinel
    levels = torch.where(boosted, 15, 3)
    expect = quantize_codes(k.transpose(-1, -2), page.scale[..., None], page.zero[..., None], levels[..., None])
    assert torch.equal(key_page_codes(page), expect)
    assert page.num_boosted == nb == int(boosted.sum(-1)[0])
    assert page.high.shape[-1] == -(-nb // 4)
    padding = unpack_2bit(page.high)[..., nb:]  # slots past nb
    assert padding.numel() == 0 or padding.max() == 0


def test_full_boost_equals_plain_4bit_keys():
    k = planted_keys((2, 128, 64), [5])
    boosted_all = quantize_key_page(k, KITTY.with_(boost_fraction=1.0))
    four_bit = quantize_key_page(k, PRESETS["kivi-k4v4"])
    assert torch.equal(dequantize_key_page(boosted_all), dequantize_key_page(four_bit))
    assert torch.equal(key_page_codes(boosted_all), key_page_codes(four_bit))


def test_fp16_preset_is_identity():
    k = planted_keys((2, 3, 128, 64), [1], torch.bfloat16)
    cfg = PRESETS["fp16"]
    assert torch.equal(dequantize_key_page(quantize_key_page(k, cfg)), k)
    assert torch.equal(dequantize_value_page(quantize_value_page(k, cfg)), k)


def test_random_selection_differs_and_is_reproducible():
    D, nb = 64, 8
    outliers = list(range(0, 64, 8))
    k = planted_keys((128, D), outliers)
    mag = quantize_key_page(k, KITTY)
    rnd = quantize_key_page(k, PRESETS["kitty-random"])
    rnd_again = quantize_key_page(k, PRESETS["kitty-random"])
    other_seed = quantize_key_page(k, PRESETS["kitty-random"].with_(seed=7))
    sel = lambda p: set((p.boost_idx.long() < nb).nonzero().flatten().tolist())  # noqa: E731
    assert sel(mag) == set(outliers)
    assert sel(rnd) != set(outliers) and len(sel(rnd)) == nb
    assert sel(rnd) == sel(rnd_again)
    assert sel(rnd) != sel(other_seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_range_channels_and_tokens_are_exact(dtype):
    k = planted_keys((128, 64), [2], dtype)
    k[:, 5] = 1.5  # constant channel
    k[:, 9] = 0.0
    page = quantize_key_page(k, KITTY)
    deq = dequantize_key_page(page)
    assert torch.isfinite(deq).all()
    assert torch.equal(deq[:, 5], k[:, 5]) and torch.equal(deq[:, 9], k[:, 9])
    v = planted_keys((128, 64), [2], dtype)
    v[7] = -2.25  # constant token
    vp = dequantize_value_page(quantize_value_page(v, KITTY))
    assert torch.isfinite(vp).all() and torch.equal(vp[7], v[7])


def test_non_finite_input_raises():
    k = torch.randn(128, 64)
    k[3, 4] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_key_page(k, KITTY)
    k[3, 4] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_value_page(k, KITTY)


def test_large_fp16_values_do_not_overflow_scales():
    """A range wider than fp16's max (60000 - (-60000)) still gives finite scales and a faithful page."""
    k = planted_keys((128, 64), [1], torch.float16)
    k[0, :] = 60000.0
    k[1, :] = -60000.0
    page = quantize_key_page(k, KITTY)
    assert torch.isfinite(page.scale.float()).all() and torch.isfinite(page.zero.float()).all()
    err = (dequantize_key_page(page).float() - k.float()).abs()
    assert (err <= page.scale.float()[None, :] / 2 + 64).all()  # 64 = one fp16 ulp at 6e4


# ------------------------------------------------------------------------------------------- value pages


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4])
def test_value_error_within_half_step(dtype, bits):
    cfg = KITTY.with_(value_bits=bits)
    v = planted_keys((2, 3, 128, 64), [10], dtype, seed=3)
    page = quantize_value_page(v, cfg)
    assert page.codes.shape == (2, 3, 64, 128 * bits // 8) and page.scale.shape == (2, 3, 128)  # along tokens
    err = (dequantize_value_page(page).float() - v.float()).abs()
    out_ulp = v.float().abs().amax() * {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    assert (err <= page.scale.float()[..., None] / 2 + out_ulp).all()


def test_nbytes_counts_every_tensor():
    k = planted_keys((3, 128, 64), [1], torch.bfloat16)
    page = quantize_key_page(k, KITTY)
    nb = KITTY.num_boosted(64)
    assert page.nbytes == 3 * (64 * 32 + nb * 32 + 64 + 2 * 64 * 2)
    assert page.nbytes == page.payload_nbytes + page.metadata_nbytes
    vp = quantize_value_page(k, KITTY)
    assert vp.nbytes == 3 * (128 * 16 + 2 * 128 * 2)


# ---------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"key_bits": 3}, "key_bits"),
        ({"value_bits": 8}, "value_bits"),
        ({"boost_fraction": 1.5}, "boost_fraction"),
        ({"boost_fraction": -0.1}, "boost_fraction"),
        ({"group_size": 6}, "group_size"),
        ({"group_size": 0}, "group_size"),
        ({"sink_tokens": -1}, "sink_tokens"),
        ({"local_window": -4}, "local_window"),
        ({"channel_selection": "psychic"}, "channel_selection"),
        ({"boost_bits": 8}, "boost_bits"),
        ({"key_bits": 4, "boost_fraction": 0.25}, "boost_fraction"),
    ],
)
def test_invalid_configs_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        KVQuantConfig(**kwargs)


def test_head_dim_checks():
    with pytest.raises(ValueError, match="head_dim"):
        KITTY.check_head_dim(62)
    with pytest.raises(ValueError, match="head_dim"):
        KITTY.check_head_dim(512)
    assert quantize_value_page(torch.randn(128, 30), KITTY).codes.shape == (30, 32)  # values pack along tokens


def test_presets_match_the_paper():
    p = PRESETS
    assert set(p) >= {
        "fp16",
        "kivi-k2v2",
        "kivi-k2v2-sink",
        "kivi-k2v4-sink",
        "kivi-k4v2-sink",
        "kivi-k4v4",
        "kitty",
        "kitty-pro",
        "kitty-random",
    }
    assert all(c.description for c in p.values())
    assert p["kitty"].num_boosted(128) == 16 and p["kitty-pro"].num_boosted(128) == 32
    assert p["kivi-k2v2"].sink_tokens == 0 and p["kivi-k2v2-sink"].sink_tokens == 32
    assert (p["kivi-k4v2-sink"].key_bits, p["kivi-k4v2-sink"].value_bits) == (4, 2)
    assert (p["kivi-k2v4-sink"].key_bits, p["kivi-k2v4-sink"].value_bits) == (2, 4)
    assert p["kitty-random"].channel_selection == "random"
    assert p["fp16"].key_bits == p["fp16"].value_bits == 16


# ------------------------------------------------------------------------------ selection beyond the paper


def test_range_selection_picks_wide_channels_not_offset_ones():
    """A channel with a big constant offset has large mean |K| but a tiny range: magnitude boosts it, range does not."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(128, 64, generator=g) * 0.5
    k[:, 7] = 20.0 + 0.01 * torch.randn(128, generator=g)  # offset channel: mean |K| 20, range ~0.05
    k[:, 11] = 6.0 * torch.randn(128, generator=g)  # wide channel: mean |K| ~4.8, range ~30
    cfg = KITTY.with_(boost_fraction=1 / 64)  # one boosted channel
    boosted = lambda c: (quantize_key_page(k, c).boost_idx.long() < 1).nonzero().flatten().tolist()  # noqa: E731
    assert boosted(cfg) == [7]
    assert boosted(cfg.with_(channel_selection="range")) == [11]


def test_query_selection_weights_channels_by_mean_abs_query():
    """Two equally wide channels: query-aware selection boosts the one the queries use, magnitude cannot tell."""
    g = torch.Generator().manual_seed(4)
    k = torch.randn(2, 128, 64, generator=g)
    k[..., 20] *= 5
    k[..., 40] *= 5.5  # slightly wider: magnitude and range both prefer it
    q_scale = torch.ones(2, 64)
    q_scale[:, 20] = 10.0  # the queries lean on channel 20
    cfg = PRESETS["kitty-query"].with_(boost_fraction=1 / 64)
    mask = quantize_key_page(k, cfg, query_scale=q_scale).boost_idx.long() < 1
    assert mask[:, 20].all() and mask.sum() == 2
    assert (quantize_key_page(k, KITTY.with_(boost_fraction=1 / 64)).boost_idx.long() < 1)[:, 40].all()
    with pytest.raises(ValueError, match="query_scale"):
        quantize_key_page(k, cfg)


def test_new_presets_cost_the_same_bits_as_the_paper_presets():
    from kitty import analytic_report

    pairs = [
        ("kitty-range", "kitty"),
        ("kitty-query", "kitty"),
        ("kitty-pro-query", "kitty-pro"),
        ("kitty-oracle", "kitty"),
        ("kitty-fit", "kitty"),
        ("kitty-pro-fit", "kitty-pro"),
        ("kitty-pro-fit-peak", "kitty-pro"),
        ("kitty-fit-adaptive", "kitty"),
        ("kitty-pro-fit-adaptive", "kitty-pro"),
    ]
    for new, old in pairs:
        assert PRESETS[new].num_boosted(128) == PRESETS[old].num_boosted(128)
        for n in (300, 4096):  # the default model's shape (30 layers, 3 KV heads, D=64)
            assert analytic_report(PRESETS[new], n, 64, 3, 30) == analytic_report(PRESETS[old], n, 64, 3, 30)


def test_oracle_selection_boosts_where_boosting_removes_logit_error():
    """A two-level channel is exact at 2 bits however wide it is: range boosts it, the oracle does not.

    The oracle scores ``E[q_i^2] * (err_2bit - err_4bit)``: of two equally spread continuous channels it picks the
    one the queries use, and it never spends the boost on a channel 2 bits already store exactly.
    """
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 128, 64, generator=g) * 0.5
    k[..., 5] = torch.where(torch.rand(2, 128, generator=g) < 0.5, -12.0, 12.0)  # widest, but only two values
    k[..., 30] = 4 * torch.randn(2, 128, generator=g)
    k[..., 31] = 4 * torch.randn(2, 128, generator=g)
    q_rms = torch.ones(2, 64)
    q_rms[:, 31] = 3.0
    one = KITTY.with_(boost_fraction=1 / 64)
    boosted = lambda c, **kw: (quantize_key_page(k, c, **kw).boost_idx.long() < 1).nonzero()[:, -1].tolist()  # noqa: E731
    assert boosted(one.with_(channel_selection="range")) == [5, 5]
    assert boosted(one.with_(channel_selection="oracle"), query_scale=q_rms) == [31, 31]
    assert boosted(one.with_(channel_selection="oracle", key_range="fit"), query_scale=q_rms) == [31, 31]
    with pytest.raises(ValueError, match="query_scale"):
        quantize_key_page(k, one.with_(channel_selection="oracle"))


def test_oracle_score_is_the_logit_error_boosting_removes():
    """For one channel, the oracle score equals the measured drop of ``sum_t (q_i * (k - k_hat))^2`` at fixed q_i."""
    from kitty.core.quant import channel_importance

    g = torch.Generator().manual_seed(6)
    k = torch.randn(128, 16, generator=g) * torch.linspace(0.5, 3, 16)
    q = torch.rand(16, generator=g) + 0.5
    cfg = KITTY.with_(channel_selection="oracle", boost_fraction=0.0)
    score = channel_importance(k, cfg, query_scale=q)
    err2 = (dequantize_key_page(quantize_key_page(k, cfg.with_(boost_fraction=0.0))) - k).square().sum(0)
    err4 = (dequantize_key_page(quantize_key_page(k, cfg.with_(boost_fraction=1.0))) - k).square().sum(0)
    torch.testing.assert_close(score, q.square() * (err2 - err4), rtol=1e-4, atol=1e-4)


@given(st.integers(0, 2**31 - 1), st.sampled_from([2, 4]), st.sampled_from(DTYPES))
def test_fitted_ranges_never_lose_to_minmax(seed, bits, dtype):
    """Property: per group, the clipping search's squared error is at most min-max's (min-max is a candidate)."""
    from kitty.core.ranges import _sq_error, fitted_params, minmax_params

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(6, 64, generator=g) * torch.rand(6, 1, generator=g) * 4 + torch.randn(6, 1, generator=g)).to(dtype)
    levels = 2**bits - 1
    e_fit = _sq_error(x.float(), *fitted_params(x, levels, dtype), levels)
    e_mm = _sq_error(x.float(), *minmax_params(x, levels, -1, dtype), levels)
    assert (e_fit <= e_mm * (1 + 1e-6)).all()


def test_fitted_ranges_clip_outliers_and_halve_gaussian_error():
    """Gaussian groups with one outlier: min-max spends its 4 levels on the outlier, the fit clips it."""
    g = torch.Generator().manual_seed(8)
    k = torch.randn(128, 64, generator=g)
    k[3] = 9.0  # one outlier token in every channel
    fit = KITTY.with_(boost_fraction=0.0, key_range="fit")
    err = lambda c: (dequantize_key_page(quantize_key_page(k, c)) - k).square().mean().item()  # noqa: E731
    assert err(fit) < 0.5 * err(fit.with_(key_range="minmax"))
    v = k.T.contiguous()  # per-token values: the outlier channel 3 sits in every token
    verr = lambda c: (dequantize_value_page(quantize_value_page(v, c)) - v).square().mean().item()  # noqa: E731
    assert verr(KITTY.with_(value_range="fit")) < 0.5 * verr(KITTY)
    assert quantize_key_page(k, fit).nbytes == quantize_key_page(k, fit.with_(key_range="minmax")).nbytes


def _peaked_rows(dtype, seed, rows=24, n=128):
    """Gaussian rows ``[rows, n]`` (random offset and spread), each with one outlier token of random sign: its peak."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * (torch.rand(rows, 1, generator=g) * 3 + 0.2) + torch.randn(
        rows, 1, generator=g
    )
    sign = torch.where(torch.rand(rows, generator=g) < 0.5, -1.0, 1.0)
    x[torch.arange(rows), torch.randint(0, n, (rows,), generator=g)] = sign * (6 + 4 * torch.rand(rows, generator=g))
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_fit_peak_keeps_every_rows_largest_value_within_half_a_step(dtype, seed):
    """``fit-peak``: each row's largest-|x| value reconstructs within half a step (the min-max guarantee), where
    ``fit`` clips it; the error stays at most min-max's; 2-bit and 4-bit rows mixed in one call."""
    from kitty.core.ranges import _sq_error, dequantize_codes, minmax_params, quantize_codes, range_params

    x = _peaked_rows(dtype, seed)
    levels = torch.where(torch.arange(x.shape[0]) % 3 == 0, 15, 3)  # per-row levels, like boosted channels
    xf = x.float()
    peak = xf.gather(-1, xf.abs().argmax(-1, keepdim=True))[:, 0]

    def peak_error(method: str) -> tuple[torch.Tensor, torch.Tensor]:
        scale, zero = range_params(x, levels, dtype, method)
        back = dequantize_codes(quantize_codes(peak, scale, zero, levels), scale, zero, torch.float32)
        return (back - peak).abs(), scale.float()

    err, step = peak_error("fit-peak")
    assert (err <= 0.5 * step * (1 + 2**-10) + 2**-20 * peak.abs()).all()
    clipped, step_fit = peak_error("fit")
    assert (clipped > step_fit).any()  # the unconstrained fit does clip peaks on these rows
    e_peak = _sq_error(xf, *range_params(x, levels, dtype, "fit-peak"), levels)
    e_mm = _sq_error(xf, *minmax_params(x, levels, -1, dtype), levels)
    assert (e_peak <= e_mm * (1 + 1e-6)).all() and (e_peak < 0.9 * e_mm).any()  # it still clips the other tail


def test_fit_peak_grid_matches_a_per_row_loop():
    """Without refits, ``fit-peak`` is exactly the best one-sided cut (opposite the peak) of ``CLIP_GRID`` per row,
    min-max first and the first of equal errors kept, found here by a plain loop over rows and cuts."""
    from kitty.core.ranges import CLIP_GRID, _sq_error, fitted_params, minmax_params

    x = _peaked_rows(torch.float32, seed=2, rows=10, n=100)
    scale, zero = fitted_params(x, 3, torch.float32, refine=0, keep_peak=True)
    for r in range(x.shape[0]):
        row = x[r : r + 1]
        lo0, hi0 = row.amin(), row.amax()
        best = minmax_params(row, 3, -1, torch.float32)
        best_err = _sq_error(row, *best, 3)
        for a in CLIP_GRID[1:]:
            cut = a * (hi0 - lo0)
            lo, hi = (lo0 + cut, hi0) if hi0.abs() >= lo0.abs() else (lo0, hi0 - cut)
            cand = (((hi - lo) / 3).reshape(1), lo.reshape(1))
            err = _sq_error(row, *cand, 3)
            if err < best_err:
                best, best_err = cand, err
        assert torch.equal(scale[r : r + 1], best[0]) and torch.equal(zero[r : r + 1], best[1])


def test_fit_peak_is_a_range_option_at_equal_bytes():
    g = torch.Generator().manual_seed(9)
    k = torch.randn(2, 128, 64, generator=g).to(torch.float16)
    q = torch.rand(2, 64, generator=g) + 0.5
    peak = PRESETS["kitty-fit"].with_(key_range="fit-peak")
    page = quantize_key_page(k, peak, query_scale=q)
    assert page.nbytes == quantize_key_page(k, PRESETS["kitty"]).nbytes
    assert not torch.equal(page.scale, quantize_key_page(k, PRESETS["kitty-fit"], query_scale=q).scale)
    rel = (dequantize_key_page(page).float() - k.float()).norm() / k.float().norm()
    assert (
        rel
        < (dequantize_key_page(quantize_key_page(k, PRESETS["kitty"])).float() - k.float()).norm() / k.float().norm()
    )
    from kitty.core.ranges import range_params

    assert PRESETS["kitty-pro-fit-peak"] == get_preset("kitty-pro-fit+key_range=fit-peak")  # the measured config
    with pytest.raises(ValueError, match="fit-peak"):
        range_params(k, 3, k.dtype, "peak")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_fit_bounded_keeps_every_value_within_half_a_minmax_step(dtype, seed):
    """``fit-bounded``: no value of a row reconstructs worse than min-max's bound (half its step), the squared error
    is at most min-max's, and on Gaussian rows the bulk's error falls well below it; 2-bit and 4-bit rows mixed."""
    from kitty.core.ranges import _sq_error, dequantize_codes, minmax_params, quantize_codes, range_params

    x = _peaked_rows(dtype, seed)
    levels = torch.where(torch.arange(x.shape[0]) % 3 == 0, 15, 3)
    xf = x.float()
    mm_scale, mm_zero = minmax_params(x, levels, -1, dtype)
    scale, zero = range_params(x, levels, dtype, "fit-bounded")
    back = dequantize_codes(quantize_codes(xf, scale[:, None], zero[:, None], levels[:, None]), scale[:, None],
                            zero[:, None], torch.float32)  # fmt: skip
    bound = 0.5 * mm_scale.float() * (1 + 2**-10) + 2**-20 * xf.abs().amax(-1)
    assert ((back - xf).abs().amax(-1) <= bound).all()
    e_bounded = _sq_error(xf, scale, zero, levels)
    e_mm = _sq_error(xf, mm_scale, mm_zero, levels)
    assert (e_bounded <= e_mm * (1 + 1e-6)).all()
    gauss = torch.randn(200, 128, generator=torch.Generator().manual_seed(seed)).to(dtype)  # no outlier: a real gain
    e_b = _sq_error(gauss.float(), *range_params(gauss, 3, dtype, "fit-bounded"), 3)
    e_m = _sq_error(gauss.float(), *minmax_params(gauss, 3, -1, dtype), 3)
    assert e_b.sum() < 0.8 * e_m.sum()
    assert get_preset("kitty-fit+key_range=fit-bounded").key_range == "fit-bounded"
    with pytest.raises(ValueError, match="fit-bounded"):
        range_params(x, 3, dtype, "bounded")


def test_boost_profile_validation_and_layers():
    prof = (0.25, 0.0, 0.125, 0.125)  # mean 0.125
    cfg = KITTY.with_(boost_profile=prof)
    assert [cfg.for_layer(i).num_boosted(64) for i in range(4)] == [16, 0, 8, 8]
    assert cfg.for_layer(0).boost_profile is None and KITTY.for_layer(3) is KITTY
    with pytest.raises(ValueError, match="boost_profile"):
        KITTY.with_(boost_profile=(0.25, 0.25))  # mean 0.25 != boost_fraction 0.125
    with pytest.raises(ValueError, match="boost_profile"):
        KITTY.with_(boost_profile=(1.5, -1.25))
    with pytest.raises(ValueError, match="boost_profile"):
        cfg.for_layer(0, num_layers=30)
    with pytest.raises(ValueError, match="key_range"):
        KITTY.with_(key_range="percentile")


@pytest.mark.parametrize(
    "name,field",
    [
        ("kitty+group_size=1_28", "group_size"),
        ("kitty+group_size= 64", "group_size"),
        ("kitty+boost_fraction=nan", "boost_fraction"),
    ],
)
def test_preset_overrides_take_plain_numbers_only(name, field):
    """``+field=value`` reads plain decimals only: Python's int()/float() would take ``1_28`` (128), `` 64`` or
    ``nan``, silently running a setting nobody typed."""
    with pytest.raises(ValueError, match=field):
        get_preset(name)
    assert get_preset("kitty+group_size=64+boost_fraction=.25").group_size == 64
    assert get_preset("kitty+group_size=64+boost_fraction=.25").boost_fraction == 0.25
