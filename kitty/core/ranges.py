"""Ranges and codes of asymmetric quantization (paper §3.2): the ``(scale, zero)`` of a group of values by min-max or
by a fitted search (:func:`range_params`, the ``key_range`` / ``value_range`` options), and the codes they give
(:func:`quantize_codes`, :func:`dequantize_codes`). ``kitty.core.quant`` builds pages from them.

``sync_free=True``: no host read and no data-dependent shape, the same result (``kitty.core.quant``'s docstring).
"""

from __future__ import annotations

import torch

from .attnfit import ATTN_FITS, ATTN_MAX_FITS, ATTN_TOKEN_RULES, attention_weights, observed_weights, token_bound_steps
from .standout import STANDOUT_FITS, TOKEN_RULES, standout_rows, token_standout_rows


def _levels_on(levels: torch.Tensor | int, device: torch.device) -> torch.Tensor:
    """``levels`` as a tensor on ``device`` (``torch.as_tensor``'s result); an int is filled there, since a tensor
    made from a Python number is copied from the host (on CUDA a synchronizing copy, which a graph capture refuses)."""
    if isinstance(levels, torch.Tensor):
        return levels.to(device)
    return torch.full((), levels, device=device)


def minmax_params(
    x: torch.Tensor, levels: torch.Tensor | int, dim: int, dtype: torch.dtype, sync_free: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min-max parameters over ``dim``: ``(scale, zero)`` stored in ``dtype``.

    ``zero`` is the minimum (exact in the input dtype). ``scale = (max - min) / levels`` is rounded *up* to the
    next representable value of ``dtype`` so that every code fits in ``[0, levels]`` and the reconstruction error
    stays within half a step. A zero range gives ``scale = 0`` and reconstructs exactly. A range wider than fp32
    can hold (``max - min > 3.4e38``, finite inputs near the fp32/bf16 limits) takes ``max / levels - min /
    levels`` instead, rounded up by two fp32 ulps: finite, and still covering the range. ``sync_free``: that
    replacement is computed for every group and selected where needed (the same bits) instead of after a host read
    of whether any group needs it.
    """
    xf = x.float()
    zero = xf.amin(dim)
    hi = xf.amax(dim)
    scale = (hi - zero) / levels
    wide = torch.isinf(scale)  # the fp32 range overflowed; every other group keeps the formula above bit for bit
    if sync_free or wide.any():
        split = hi / levels - zero / levels  # each term <= 3.4e38 / levels: no overflow
        up = torch.full_like(split, float("inf"))
        scale = torch.where(wide, torch.nextafter(torch.nextafter(split, up), up), scale)
    scale_q = scale.to(dtype)
    if dtype != torch.float32:  # bump to the next 16-bit value where rounding went down
        bump = (scale_q.float() < scale).to(torch.int16)
        scale_q = (scale_q.view(torch.int16) + bump).view(dtype)
    return scale_q, zero.to(dtype)


CLIP_GRID = tuple(i / 16 for i in range(6))  # share of the range cut off below / above: 0 .. 0.3125
REFINE_STEPS = 2  # least-squares refits of (scale, zero) after the grid search
# fit-loose: the largest error any value may get, in min-max steps (fit-bounded: 0.5, min-max's own bound). One step
# is the smallest round bound that admits every cut of CLIP_GRID at 2 bits (5/16 of the range = 15/16 of a step, the
# cuts fit-peak makes opposite the peak), while a refit may still not move any value by more than a step
LOOSE_BOUND_STEPS = 1.0


def fitted_params(
    x: torch.Tensor,
    levels: torch.Tensor | int,
    dtype: torch.dtype,
    grid: tuple[float, ...] = CLIP_GRID,
    refine: int = REFINE_STEPS,
    keep_peak: bool = False,
    sync_free: bool = False,
    bounded: bool = False,
    bound_steps: float | torch.Tensor = 0.5,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped asymmetric parameters over the last dim: a ``(scale, zero)`` with small squared error.

    1. grid search: ``lo = min + a * range``, ``hi = max - b * range`` for every ``a, b`` in ``grid`` (min-max itself
       is the first candidate, so the result is never worse than :func:`minmax_params`);
    2. ``refine`` alternating steps: with the codes fixed, the least-squares ``scale, zero`` (a linear regression of
       ``x`` on its codes); kept where it lowers the error.

    Codes clamp to ``[0, levels]``. For keys (per channel) the error weight of a channel in the attention logits is a
    constant ``q_i^2``, and for values (per token) the weight of a token in the output is its attention
    probability, so the least-squares fit of each group is also its least logit (output) error fit. Cost:
    ``len(grid)**2 + 2 * refine`` quantizations of the group.

    ``keep_peak``: never clip the group's *peak*, its value of largest ``|x|`` (of a key channel: the token that
    moves that channel's logit most, e.g. the one a retrieval head looks for). Only the opposite tail is cut
    (``len(grid) - 1`` candidates), and a refit is kept only where the peak still reconstructs within half a step.

    ``bounded``: a candidate (grid point or refit) is kept only where **every** value of the group still
    reconstructs within half a min-max step (:func:`minmax_params`' bound, the same fp32 tolerance as ``keep_peak``):
    no value is worse off than min-max guarantees, while the step may shrink (by up to a third at 2 bits, the
    extremes then sitting up to half a min-max step from the nearest level) or the grid shift, which lowers the error
    of the bulk. ``bound_steps``: that bound in min-max steps (0.5, min-max's own guarantee, unless looser, as
    :data:`LOOSE_BOUND_STEPS` for ``"fit-loose"``); a tensor broadcast against ``x`` gives each value its own bound
    (``fit-attn-bound``: one per token, :func:`kitty.core.attnfit.token_bound_steps`).

    ``weight``: a weight per value, broadcast against ``x`` (``fit-attn``: a token's expected attention,
    :mod:`kitty.core.attnfit`): every candidate is ranked by the weighted squared error and refitted by weighted
    least squares. ``sync_free``: no host read (module docstring), the same result.
    """
    xf = x.float()
    w = torch.ones_like(xf) if weight is None else weight.float().expand(xf.shape)
    levels = _levels_on(levels, x.device)
    lv = levels[..., None] if levels.dim() else levels
    best_scale, best_zero = minmax_params(x, levels, -1, dtype, sync_free)
    best_err = (_dequant_error(xf, best_scale, best_zero, levels, sync_free).square() * w).sum(-1)
    if bounded:  # bound_steps min-max steps (0.5: the most min-max allows any value); fp32 tolerance as for the peak
        # [..., 1] (one bound) or [..., n] (one per value), against every value's error
        limit = bound_steps * best_scale.float()[..., None] * (1 + 2**-10) + 2**-20 * xf.abs().amax(-1, keepdim=True)
    lo0, hi0 = xf.amin(-1), xf.amax(-1)
    span = hi0 - lo0
    peak_on_top = hi0.abs() >= lo0.abs()  # [...]: which tail holds the largest |x|
    peak = torch.where(peak_on_top, hi0, lo0)

    def keep(scale: torch.Tensor, zero: torch.Tensor) -> None:
        nonlocal best_err, best_scale, best_zero
        scale, zero = scale.to(dtype), zero.to(dtype)
        diff = _dequant_error(xf, scale, zero, levels, sync_free)  # the (weighted) squared and the largest error
        err = (diff.square() * w).sum(-1)
        better = err < best_err
        if bounded:
            better &= (diff.abs() <= limit).all(-1)
        if keep_peak:  # the peak's own error stays within half a step (the min-max guarantee), up to fp32 rounding
            s = scale.float()
            code = quantize_codes(peak, s, zero, levels)
            peak_err = (dequantize_codes(code, s, zero, torch.float32, sync_free) - peak).abs()
            better &= peak_err <= 0.5 * s * (1 + 2**-10) + 2**-20 * peak.abs()
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)

    if keep_peak:  # one-sided cuts: the tail opposite the peak loses a share of the range
        for a in grid:
            if 0 < a < 0.9:
                lo = torch.where(peak_on_top, lo0 + a * span, lo0)
                hi = torch.where(peak_on_top, hi0, hi0 - a * span)
                keep((hi - lo) / levels, lo)
    else:
        for a in grid:
            for b in grid:
                if a + b == 0 or a + b >= 0.9:
                    continue
                lo, hi = lo0 + a * span, hi0 - b * span
                keep((hi - lo) / levels, lo)
    for _ in range(refine):
        c = quantize_codes(xf, best_scale[..., None], best_zero[..., None], lv).float()
        if weight is None:
            cm, xm = c.mean(-1, keepdim=True), xf.mean(-1, keepdim=True)
        else:  # weighted means
            wsum = w.sum(-1, keepdim=True).clamp_min(1e-30)
            cm, xm = (w * c).sum(-1, keepdim=True) / wsum, (w * xf).sum(-1, keepdim=True) / wsum
        var = (w * (c - cm).square()).sum(-1)
        scale = torch.where(var > 0, (w * (c - cm) * (xf - xm)).sum(-1) / var.clamp_min(1e-30), best_scale.float())
        keep(scale.clamp_min(0), xm[..., 0] - scale.clamp_min(0) * cm[..., 0])
    return best_scale, best_zero


def _dequant_error(
    xf: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: torch.Tensor | int, sync_free: bool = False
) -> torch.Tensor:
    """Reconstruction error ``[..., n]`` (dequantized minus ``xf``, fp32) for per-row ``scale``/``zero`` ``[...]``."""
    lv = _levels_on(levels, xf.device)
    codes = quantize_codes(xf, scale[..., None], zero[..., None], lv[..., None] if lv.dim() else lv)
    return dequantize_codes(codes, scale[..., None], zero[..., None], torch.float32, sync_free) - xf


def _sq_error(
    xf: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: torch.Tensor | int, sync_free: bool = False
) -> torch.Tensor:
    """Squared reconstruction error summed over the last dim, for per-row ``scale``/``zero`` ``[...]``."""
    return _dequant_error(xf, scale, zero, levels, sync_free).square().sum(-1)


def range_params(
    x: torch.Tensor,
    levels: torch.Tensor | int,
    dtype: torch.dtype,
    method: str,
    sync_free: bool = False,
    query_stat: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero)`` over the last dim by ``method``: ``"minmax"``, ``"fit"`` (:func:`fitted_params`),
    ``"fit-peak"`` (the same search, never clipping the group's largest-``|x|`` value: ``keep_peak=True``) or
    ``"fit-bounded"`` (the same search, every value within half a min-max step: ``bounded=True``), ``"fit-loose"``
    (every value within :data:`LOOSE_BOUND_STEPS` min-max steps; the fitted part of ``"fit-loose-token-standout"``), or
    ``"fit-standout"`` / ``"fit-peak-standout"``: min-max on the rows that hold a standout value
    (:func:`kitty.core.standout.standout_rows`), ``"fit-bounded"`` / ``"fit-peak"`` on the others;
    ``"fit-token-standout"`` / ``"fit-peak-token-standout"`` / ``"fit-loose-token-standout"``: min-max on the rows
    whose min or max is a token that stands out across the rows (:func:`kitty.core.standout.token_standout_rows`; for
    key pages ``x`` is ``[..., D, G]``), ``"fit-bounded"`` / ``"fit-peak"`` / ``"fit-loose"`` elsewhere;
    ``"fit-attn"`` / ``"fit-attn-free"``: ``"fit-bounded"`` / ``"fit"`` ranked by the squared error weighted by each
    token's attention under the mean query (:mod:`kitty.core.attnfit`; key rows ``x`` ``[..., D, G]``,
    ``query_stat`` the mean query ``[..., D]`` or ``None``; ``"fit-attn-token-standout"``: the token test,
    ``"fit-attn"`` elsewhere).
    ``"fit-attn-bound"``: ``"fit-attn"`` with a bound per token set by its weight
    (:func:`kitty.core.attnfit.token_bound_steps`; ``"fit-attn-token-bound"``: the token test, ``"fit-attn-bound"``
    elsewhere). ``"fit-attn-max-bound"``: ``"fit-attn-bound"``'s search and bounds with each token's largest observed
    attention as its weight (``query_stat`` ``[..., G]`` or ``None``, :func:`kitty.core.attnfit.observed_weights`;
    ``"fit-attn-max-token-bound"``: the token test, ``"fit-attn-max-bound"`` elsewhere; ``"fit-attn-max-rel-bound"`` /
    ``"fit-attn-max-rel-token-bound"``: the same weights divided by their mean over the page). ``sync_free``: no host
    read (module docstring), the same result."""
    if method in ATTN_MAX_FITS:
        w = observed_weights(x, query_stat, relative=method == "fit-attn-max-rel-bound")
        steps = token_bound_steps(x, w)
        return fitted_params(x, levels, dtype, sync_free=sync_free, bounded=True, bound_steps=steps, weight=w)
    if method in ATTN_FITS:
        w = attention_weights(x, query_stat)
        steps = token_bound_steps(x, w) if method == "fit-attn-bound" else 0.5
        bounded = ATTN_FITS[method] == "fit-bounded"
        return fitted_params(x, levels, dtype, sync_free=sync_free, bounded=bounded, bound_steps=steps, weight=w)
    rows_fit = STANDOUT_FITS.get(method, ATTN_TOKEN_RULES.get(method))
    if rows_fit is not None:
        fitted = range_params(x, levels, dtype, rows_fit, sync_free, query_stat)
        exact = minmax_params(x, levels, -1, dtype, sync_free)
        out = token_standout_rows(x) if method in TOKEN_RULES or method in ATTN_TOKEN_RULES else standout_rows(x)
        return torch.where(out, exact[0], fitted[0]), torch.where(out, exact[1], fitted[1])
    if method == "minmax":
        return minmax_params(x, levels, -1, dtype, sync_free)
    if method == "fit":
        return fitted_params(x, levels, dtype, sync_free=sync_free)
    if method == "fit-peak":
        return fitted_params(x, levels, dtype, keep_peak=True, sync_free=sync_free)
    if method == "fit-bounded":
        return fitted_params(x, levels, dtype, sync_free=sync_free, bounded=True)
    if method == "fit-loose":
        return fitted_params(x, levels, dtype, sync_free=sync_free, bounded=True, bound_steps=LOOSE_BOUND_STEPS)
    raise ValueError(
        "range method must be 'minmax', 'fit', 'fit-peak', 'fit-bounded', 'fit-loose' or one of "
        f"{tuple(STANDOUT_FITS) + tuple(ATTN_FITS) + ATTN_MAX_FITS + tuple(ATTN_TOKEN_RULES)}, got {method!r}"
    )


def quantize_codes(
    x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: torch.Tensor | int
) -> torch.Tensor:
    """``code = clamp(floor((x - zero) / scale + 1/2), 0, levels)`` in fp32 (0 where scale is 0), as uint8."""
    s = scale.float()
    q = torch.where(s > 0, (x.float() - zero.float()) / torch.where(s > 0, s, 1.0), 0.0)
    return torch.minimum(torch.floor(q + 0.5).clamp_min(0), _levels_on(levels, x.device)).to(torch.uint8)


def dequantize_codes(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype, sync_free: bool = False
) -> torch.Tensor:
    """``codes * scale + zero`` in fp32, cast to ``dtype``.

    Groups whose reconstruction could leave the range of fp32 or of ``dtype`` (a range near the dtype's limits,
    see :func:`minmax_params`) are computed as ``2 * (codes * scale/2 + zero/2)`` and clamped to ``dtype``'s
    finite range, so finite input never comes back Inf or NaN; every other group is ``codes * scale + zero``
    exactly as written. ``sync_free``: both forms are computed and selected per group (the same bits) instead of
    the plain form alone after a host read of whether any group is at risk.
    """
    s, z = scale.float(), zero.float()
    top = float(torch.finfo(dtype).max)
    risky = s.abs() * 15 + z.abs() > top / 2  # per group (15 = the most levels a code has): no product can overflow
    if not sync_free and not risky.any():
        return (codes.float() * s + z).to(dtype)
    c = codes.float()
    x = torch.where(risky, (c * (s * 0.5) + z * 0.5).clamp(-top / 2, top / 2) * 2, c * s + z)
    return x.clamp(-top, top).to(dtype)
