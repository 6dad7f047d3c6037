"""Fitted key ranges in the pack kernel (``kernels/pack.py``): the search of ``kitty.core.ranges.fitted_params``, per
channel over a key page's ``G`` tokens, operation for operation.

    best = min-max (scale, zero), err = sq_error(best)
    "fit":       for a in grid, for b in grid (a + b > 0, a + b < 0.9):  lo = min + a * span, hi = max - b * span
    "fit-peak":  for a in grid (0 < a < 0.9): the tail opposite the channel's peak (its largest |x|) loses a * span
                 candidate (scale, zero) = ((hi - lo) / levels, lo)
    REFINE_STEPS times: codes of best, least-squares (scale, zero) of x on them
    each candidate: rounded to the storage dtype, kept where its squared error over the G tokens is lower (and, for
    "fit-peak", where the peak still reconstructs within half a step)

Bit-identity with torch rests on three things:

- The same fp32 operations in the same order: every product and sum is its own rounded operation (the kernel is
  compiled without FMA contraction, ``enable_fp_fusion=False``, as torch's CPU kernels do not contract either);
  division is ``tl.div_rn``; the scalars of the grid are ``i / 16`` (exact in fp32).
- The same summation order over tokens. Torch's CPU sum over the token axis of a ``[..., D, G]`` view of a
  ``[..., G, D]`` tensor is an outer reduction (``aten/src/ATen/native/cpu/SumKernel.cpp``, ``multi_row_sum``):
  tokens are added in order into a chunk sum of 16 (from 0), chunk sums in order into a level-1 sum, which every 16
  chunks (256 tokens) is added into a level-2 sum; the result is ``0 + l1 + l2``. ``_sum_tokens`` follows that
  order (``G`` up to 4096; a mean is that sum divided by ``G``).
- The same codes: ``clamp(floor((x - zero) / scale + 1/2), 0, levels)`` with the IEEE quotient, 0 where the scale
  is 0, and the dequantization of ``kitty.core.ranges.dequantize_codes`` including its halved form for scales and
  zeros near the fp32 limits.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _codes(x, zero, scale, levels):
    """``kitty.core.ranges.quantize_codes`` in fp32: ``clamp(floor((x - zero) / scale + 1/2), 0, levels)``, 0 where
    ``scale == 0``."""
    pos = scale > 0
    q = tl.where(pos, tl.div_rn(x - zero, tl.where(pos, scale, 1.0)), 0.0)
    return tl.minimum(tl.maximum(tl.floor(q + 0.5), 0.0), levels)


@triton.jit
def _dequant(code, scale, zero):
    """``kitty.core.ranges.dequantize_codes`` to fp32: ``code * scale + zero`` (two roundings), or where that could
    leave the fp32 range, ``2 * clamp(code * (scale / 2) + zero / 2)``, clamped to fp32's finite range."""
    top: tl.constexpr = FP32_MAX
    risky = tl.abs(scale) * 15.0 + tl.abs(zero) > top * 0.5
    plain = code * scale + zero
    half = tl.minimum(tl.maximum(code * (scale * 0.5) + zero * 0.5, -top * 0.5), top * 0.5) * 2.0
    return tl.minimum(tl.maximum(tl.where(risky, half, plain), -top), top)


@triton.jit
def _add2(acc, w):
    """``acc + w[..., 0] + w[..., 1]``, in that order."""
    a, b = tl.split(w)
    return acc + a + b


@triton.jit
def _add4(acc, w):
    lo, hi = tl.split(w)  # the last axis is the highest of the 2 index bits: tokens 0-1, then 2-3
    return _add2(_add2(acc, lo), hi)


@triton.jit
def _add8(acc, w):
    lo, hi = tl.split(w)
    return _add4(_add4(acc, lo), hi)


@triton.jit
def _add16(acc, w):
    lo, hi = tl.split(w)
    return _add8(_add8(acc, lo), hi)


@triton.jit
def _add_rows(acc, v, N: tl.constexpr, D: tl.constexpr):
    """``acc + v[0] + v[1] + ... + v[N - 1]`` in that order, for a ``(N, D)`` tile (``N`` in 4, 8, 16): the tile is
    viewed as ``(D, b0, b1, ...)`` with its highest token bit last, and halved along it down to single tokens."""
    if N == 16:
        w = tl.permute(tl.reshape(v, (2, 2, 2, 2, D)), (4, 3, 2, 1, 0))
        return _add16(acc, w)
    elif N == 8:
        w = tl.permute(tl.reshape(v, (2, 2, 2, D)), (3, 2, 1, 0))
        return _add8(acc, w)
    else:
        w = tl.permute(tl.reshape(v, (2, 2, D)), (2, 1, 0))
        return _add4(acc, w)


@triton.jit
def _terms(kbase, t0, skq_t, scale, zero, levels, cmean, xmean, N: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr):
    """Per-element terms of the ``N`` tokens from ``t0``, two ``(N, D)`` tiles by ``MODE``: 0: the squared error of
    ``(scale, zero)`` (twice); 1: the codes and ``x``; 2: ``(code - cmean)**2`` and ``(code - cmean) * (x - xmean)``."""
    t = t0 + tl.arange(0, N)
    c = tl.arange(0, D)
    x = tl.load(kbase + t[:, None] * skq_t + c[None, :]).to(tl.float32)
    code = _codes(x, zero[None, :], scale[None, :], levels[None, :])
    if MODE == 0:
        d = _dequant(code, scale[None, :], zero[None, :]) - x
        a = d * d
        b = a
    elif MODE == 1:
        a = code
        b = x
    else:
        cc = code - cmean[None, :]
        a = cc * cc
        b = cc * (x - xmean[None, :])
    return a, b


@triton.jit
def _sum_tokens(kbase, skq_t, scale, zero, levels, cmean, xmean, G: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr):
    """Two per-channel sums over the page's ``G`` tokens of the terms of ``_terms``, in torch's order (module
    docstring): chunks of 16 tokens in order, chunk sums in order, every 256 tokens into a second level (``MODE``
    0: the second sum is not computed, 0)."""
    zeros = tl.zeros((D,), tl.float32)
    if G < 16:
        a, b = _terms(kbase, 0, skq_t, scale, zero, levels, cmean, xmean, G, D, MODE)
        sa = _add_rows(zeros, a, G, D)
        sb = zeros
        if MODE != 0:
            sb = _add_rows(zeros, b, G, D)
    else:
        L1: tl.constexpr = 256 if G > 256 else G  # tokens per level-1 sum
        sa = zeros
        sb = zeros
        for t1 in range(0, G, L1):
            la = zeros
            lb = zeros
            for t0 in range(t1, t1 + L1, 16):
                a, b = _terms(kbase, t0, skq_t, scale, zero, levels, cmean, xmean, 16, D, MODE)
                la += _add_rows(zeros, a, 16, D)
                if MODE != 0:
                    lb += _add_rows(zeros, b, 16, D)
            sa += la
            sb += lb
    return sa, sb


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to nearest (ties to even) in ``DTYPE``, as torch's ``.to(dtype)``. bf16 is rounded on the
    bits (add half an ulp less one, plus the kept lowest bit, and drop 16 bits), because the interpreter's fp32 ->
    bf16 cast truncates; on the GPU this is what ``cvt.rn.bf16.f32`` gives for finite ``x``."""
    if DTYPE == tl.float32:
        return x
    elif DTYPE == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _keep(
    kbase,
    skq_t,
    scale,
    zero,
    levels,
    best_err,
    best_s,
    best_z,
    peak,
    G: tl.constexpr,
    D: tl.constexpr,
    KEEP_PEAK: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """``fitted_params``'s ``keep``: the fp32 candidate ``(scale, zero)`` rounded to ``DTYPE``, taken per channel
    where its squared error is lower than the best so far (and with ``KEEP_PEAK``, where the peak reconstructs
    within half a step up to fp32 rounding)."""
    s_q = _round(scale, DTYPE)
    z_q = _round(zero, DTYPE)
    s = s_q.to(tl.float32)
    z = z_q.to(tl.float32)
    err, _ = _sum_tokens(kbase, skq_t, s, z, levels, s, s, G, D, 0)
    better = err < best_err
    if KEEP_PEAK:
        peak_err = tl.abs(_dequant(_codes(peak, z, s, levels), s, z) - peak)
        better &= peak_err <= 0.5 * s * 1.0009765625 + 9.5367431640625e-07 * tl.abs(peak)  # (1 + 2**-10), 2**-20
    return tl.where(better, err, best_err), tl.where(better, s_q, best_s), tl.where(better, z_q, best_z)


@triton.jit
def _fit(
    kbase,
    skq_t,
    mn,
    mx,
    levels,
    scale_q,
    zero_q,
    G: tl.constexpr,
    D: tl.constexpr,
    KEEP_PEAK: tl.constexpr,
    NGRID: tl.constexpr,
    CUT: tl.constexpr,
    REFINE: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """``kitty.core.ranges.fitted_params`` of every channel (``mn``, ``mx``: its min and max over the ``G`` tokens;
    ``scale_q``, ``zero_q``: its min-max parameters in ``DTYPE``): the fitted ``(scale, zero)`` in ``DTYPE``. The
    grid is ``i / 16`` for ``i < NGRID``; a cut of ``k / 16`` of the range is tried only for ``k < CUT`` (torch's
    ``a + b < 0.9``)."""
    s0 = scale_q.to(tl.float32)
    z0 = zero_q.to(tl.float32)
    best_err, _ = _sum_tokens(kbase, skq_t, s0, z0, levels, s0, s0, G, D, 0)
    best_s = scale_q
    best_z = zero_q
    span = mx - mn
    top = tl.abs(mx) >= tl.abs(mn)  # the peak (largest |x|) is the max
    peak = tl.where(top, mx, mn)
    # fit-peak: one-sided cuts a / 16 of the tail opposite the peak (b stays 0); fit: both tails, a then b
    for ai in range(0, NGRID):
        for bi in range(0, 1 if KEEP_PEAK else NGRID):
            if (ai + bi > 0) & (ai + bi < CUT):
                if KEEP_PEAK:
                    cut = (ai * 0.0625) * span
                    lo = tl.where(top, mn + cut, mn)
                    hi = tl.where(top, mx, mx - cut)
                else:
                    lo = mn + (ai * 0.0625) * span
                    hi = mx - (bi * 0.0625) * span
                best_err, best_s, best_z = _keep(
                    kbase, skq_t, tl.div_rn(hi - lo, levels), lo, levels, best_err, best_s, best_z, peak, G, D,
                    KEEP_PEAK, DTYPE,
                )  # fmt: skip
    for _ in range(REFINE):
        s = best_s.to(tl.float32)
        z = best_z.to(tl.float32)
        csum, xsum = _sum_tokens(kbase, skq_t, s, z, levels, s, s, G, D, 1)
        cmean = tl.div_rn(csum, G * 1.0)  # torch's mean: the sum divided by the count
        xmean = tl.div_rn(xsum, G * 1.0)
        var, cov = _sum_tokens(kbase, skq_t, s, z, levels, cmean, xmean, G, D, 2)
        scale = tl.maximum(tl.where(var > 0, tl.div_rn(cov, tl.maximum(var, 1e-30)), s), 0.0)
        best_err, best_s, best_z = _keep(
            kbase, skq_t, scale, xmean - scale * cmean, levels, best_err, best_s, best_z, peak, G, D, KEEP_PEAK, DTYPE
        )
    return best_s, best_z
