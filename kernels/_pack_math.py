"""The exact arithmetic of the pack kernel (``kernels/pack.py``): min-max parameters, codes, and division with the
IEEE result but without IEEE division instructions where the ranges allow it. Each function gives the bits of
``kitty.core.ranges``' torch formula (``minmax_params``, ``quantize_codes``), which the tests compare bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _roundup_to(scale, DTYPE: tl.constexpr, ITYPE: tl.constexpr):
    """fp32 ``scale`` -> ``DTYPE`` rounded to nearest, then bumped one ulp up where that rounded down."""
    s_q = scale.to(DTYPE)
    bump = (s_q.to(tl.float32) < scale).to(ITYPE)
    return (s_q.to(ITYPE, bitcast=True) + bump).to(DTYPE, bitcast=True)


@triton.jit
def _range_scale(mx, mn, levels):
    """``(mx - mn) / levels`` in fp32; where the range overflows fp32 (finite inputs near the fp32/bf16 limits),
    ``mx / levels - mn / levels`` bumped up two ulps instead, as ``kitty.core.ranges.minmax_params`` does."""
    scale = tl.div_rn(mx - mn, levels)
    split = tl.div_rn(mx, levels) - tl.div_rn(mn, levels)  # > 0 wherever the range overflowed
    split_up = (split.to(tl.int32, bitcast=True) + 2).to(tl.float32, bitcast=True)  # nextafter twice, towards +inf
    return tl.where(scale == float("inf"), split_up, scale)


# Division without IEEE division instructions: with ``y = RN(1 / b)`` and ``q0 = RN(a * y)``, one correction by the
# exact remainder, ``fma(fma(-b, q0, a), y, q0)``, is the correctly rounded ``a / b`` (Markstein's theorem; the IEEE
# division's own fast path ends with these two FMAs) as long as nothing under- or overflows. Scales are divided this
# way (by their levels) and codes (by the scale, whose reciprocal is computed once per channel or token) in a
# program whose ranges ``max - min`` are all 0 or within [RANGE_MIN, RANGE_MAX] (its scales are then within
# [2**-84, 2**80]); any other program (ranges near the fp32 limits or subnormal, non-finite tokens) divides with
# ``tl.div_rn`` and clamps its codes, the literal formula.
RANGE_MIN = tl.constexpr(2.0**-80)
RANGE_MAX = tl.constexpr(2.0**80)
RCP3 = tl.constexpr(float(torch.tensor(1.0) / 3))  # 1 / levels rounded to fp32, for 2- and 4-bit codes
RCP15 = tl.constexpr(float(torch.tensor(1.0) / 15))


@triton.jit
def _exact_range(mx, mn):
    """Whether the range ``mx - mn`` allows the reciprocal division (0 or within ``[RANGE_MIN, RANGE_MAX]``)."""
    v = mx - mn
    return (v == 0) | ((v >= RANGE_MIN) & (v <= RANGE_MAX))


@triton.jit
def _div(a, b, y):
    """``a / b`` rounded to nearest, from ``y = RN(1 / b)`` (see above; ``y = 0`` gives 0 for ``a = 0``)."""
    q0 = a * y
    return tl.fma(tl.fma(-b, q0, a), y, q0)


@triton.jit
def _params(mx, mn, levels, rlevels, fast, DTYPE: tl.constexpr, ITYPE: tl.constexpr, ROUND_UP: tl.constexpr):
    """Min-max parameters of ``kitty.core.ranges.minmax_params``: ``scale_q``, ``zero_q`` in ``DTYPE`` (the scale
    rounded up to it), and in fp32 the scale, the zero and the reciprocal of the scale (0 where the scale is 0).
    ``rlevels``: ``1 / levels`` rounded to fp32."""
    if fast:
        scale = _div(mx - mn, levels, rlevels)
    else:
        scale = _range_scale(mx, mn, levels)
    if ROUND_UP:
        scale_q = _roundup_to(scale, DTYPE, ITYPE)
    else:
        scale_q = scale.to(DTYPE)
    zero_q = mn.to(DTYPE)
    scale_f = scale_q.to(tl.float32)
    return scale_q, zero_q, scale_f, zero_q.to(tl.float32), _reciprocal(scale_f, DTYPE)


@triton.jit
def _reciprocal(b, DTYPE: tl.constexpr):
    """``1 / b`` rounded to nearest, 0 where ``b == 0``, for the scales of a fast program. A 16-bit scale (at most 11
    significant bits) takes four Newton steps ``y += y * (1 - b * y)`` (FMAs) from the bit-level first guess, the
    last of which is the Markstein correction: exactly ``RN(1 / b)`` for every significand of up to 16 bits and
    every ``b`` in ``[2**-90, 2**90]`` (checked exhaustively; three steps already suffice for 11 bits). An fp32 scale
    takes IEEE division."""
    pos = b > 0
    if DTYPE == tl.float32:
        y = tl.div_rn(1.0, tl.where(pos, b, 1.0))
    else:
        y = (0x7EF311C3 - b.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
        for _ in tl.static_range(4):
            y = tl.fma(tl.fma(-b, y, 1.0), y, y)
    return tl.where(pos, y, 0.0)


@triton.jit
def _quantize(x, zero, scale, rcp, levels, fast):
    """``clamp(floor((x - zero) / scale + 1/2), 0, levels)`` in fp32 with the IEEE quotient; 0 where scale == 0.
    ``fast``: the reciprocal division, and no clamp: ``x - zero`` is finite and at most the range, so the quotient is
    within ``[0, levels]`` up to rounding (the scale was rounded up, or to nearest in fp32) and ``+ 1/2`` then
    truncation is the floor."""
    a = x - zero
    if fast:
        code = (_div(a, scale, rcp) + 0.5).to(tl.int32)
    else:
        pos = scale > 0
        q = tl.where(pos, tl.div_rn(a, tl.where(pos, scale, 1.0)), 0.0)
        code = tl.minimum(tl.maximum(tl.floor(q + 0.5), 0.0), levels).to(tl.int32)
    return code
