"""Which groups of a page hold a *standout* value: the test behind ``key_range="fit-standout"``.

A group is a row of ``n`` values quantized with one ``(scale, zero)`` (of a key page: one channel over the page's
``G`` tokens). Its *standout score* is the distance of its extreme from the rest, in units of the row's robust
spread::

    score = max_t |x_t - median(x)| / (1.4826 * median_t |x_t - median(x)|)

(the median absolute deviation, scaled so that it estimates the standard deviation of Gaussian rows). A row stands out
where ``score > threshold``. The threshold is fixed a priori from Gaussian rows: of 128 Gaussian values the largest
``|z|`` exceeds 4 with probability about 0.8%, so a score above 4 says that some value lies beyond what a page of
Gaussian noise gives. A row whose spread is zero (more than half its values equal) stands out where any value differs
from the median. Torch only, no host read and fixed shapes (usable ``sync_free``).

``range_params(..., "fit-standout")`` (:mod:`kitty.core.quant`) then keeps min-max ranges (every extreme reconstructs
exactly) on standout rows and a fitted range elsewhere; ``"fit-peak-standout"`` the same with ``fit-peak`` elsewhere.
"""

from __future__ import annotations

import torch

STANDOUT_THRESHOLD = 4.0  # robust z of a row's extreme above which the row keeps min-max ranges
MAD_TO_STD = 1.4826  # median absolute deviation -> standard deviation of a Gaussian
# range rule of the rows that do not stand out, by key_range / value_range value
STANDOUT_FITS = {"fit-standout": "fit-bounded", "fit-peak-standout": "fit-peak"}


def standout_score(x: torch.Tensor) -> torch.Tensor:
    """Standout score ``[...]`` of each row of ``x`` ``[..., n]`` (module docstring), fp32; ``inf`` where the row's
    robust spread is zero but some value differs from the median, ``0`` for a constant row."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be a tensor [..., n] with n >= 1, got {getattr(x, 'shape', type(x).__name__)}")
    xf = x.float()
    dev = (xf - xf.median(-1, keepdim=True).values).abs()
    spread = dev.median(-1).values * MAD_TO_STD
    peak = dev.amax(-1)
    score = peak / torch.where(spread > 0, spread, 1.0)
    return torch.where(spread > 0, score, torch.where(peak > 0, torch.inf, 0.0))


def standout_rows(x: torch.Tensor, threshold: float | None = None) -> torch.Tensor:
    """Boolean ``[...]``: which rows of ``x`` ``[..., n]`` hold a standout value (``score > threshold``;
    ``None``: :data:`STANDOUT_THRESHOLD`, read at call time)."""
    threshold = STANDOUT_THRESHOLD if threshold is None else threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
    return standout_score(x) > threshold
