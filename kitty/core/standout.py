"""Which groups of a page hold a *standout* value: the test behind ``key_range="fit-standout"``.

A group is a row of ``n`` values quantized with one ``(scale, zero)`` (of a key page: one channel over the page's
``G`` tokens). Its *standout score* is the distance of its extreme from the rest, in units of the row's robust
spread::

    score = max_t |x_t - median(x)| / (1.4826 * median_t |x_t - median(x)|)

(the median absolute deviation, scaled so that it estimates the standard deviation of Gaussian rows). A row stands out
where ``score > threshold``. The threshold is fixed a priori from Gaussian rows: of 128 Gaussian values the largest
``|z|`` exceeds 4 with probability about 0.8% (about 3% with the row's own median and MAD in place of the true mean
and deviation), so a score above 4 says that some value lies beyond what a page of Gaussian noise usually gives. A
row whose spread is zero (more than half its values equal) stands out where any value differs from the median. Torch
only, no host read and fixed shapes (usable ``sync_free``).

``range_params(..., "fit-standout")`` (:mod:`kitty.core.ranges`) then keeps min-max ranges (every extreme reconstructs
exactly) on standout rows and a fitted range elsewhere; ``"fit-peak-standout"`` the same with ``fit-peak`` elsewhere.

``"fit-token-standout"`` asks instead whether a *token* stands out across the page (:func:`standout_tokens`): each
position ``t`` of the rows (a key page's token) gets the root mean square over rows (channels) of its robust z,
``sqrt(mean_c z_ct^2)`` with ``z_ct = (x_ct - median_c) / (1.4826 MAD_c)``, and a token stands out where that score's
own robust z across the page's tokens exceeds the same threshold. A row keeps min-max where its min or its max is
at a standout token, and ``fit-bounded`` elsewhere (``"fit-peak-token-standout"``: ``fit-peak`` elsewhere;
``"fit-loose-token-standout"``: ``fit-loose`` elsewhere, the bounded search with every value within one min-max step
instead of half of one, :data:`kitty.core.ranges.LOOSE_BOUND_STEPS`; ``"fit-attn-token-standout"``: ``fit-attn``
elsewhere, the bounded search ranked by the error weighted by each token's attention, :mod:`kitty.core.attnfit`).
"""

from __future__ import annotations

import torch

STANDOUT_THRESHOLD = 4.0  # robust z of a row's extreme above which the row keeps min-max ranges
MAD_TO_STD = 1.4826  # median absolute deviation -> standard deviation of a Gaussian
# range rule of the rows that do not stand out, by key_range / value_range value
STANDOUT_FITS = {
    "fit-standout": "fit-bounded",
    "fit-peak-standout": "fit-peak",
    "fit-token-standout": "fit-bounded",
    "fit-peak-token-standout": "fit-peak",
    "fit-loose-token-standout": "fit-loose",
    "fit-attn-token-standout": "fit-attn",
}
# tested by standout_tokens (the others: standout_rows)
TOKEN_RULES = ("fit-token-standout", "fit-peak-token-standout", "fit-loose-token-standout", "fit-attn-token-standout")


def _robust_z(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x - median) / (1.4826 MAD)`` over the last dim (0 where the spread is 0) and the spread ``[..., 1]``."""
    xf = x.float()
    dev = xf - xf.median(-1, keepdim=True).values
    spread = dev.abs().median(-1, keepdim=True).values * MAD_TO_STD
    return torch.where(spread > 0, dev / torch.where(spread > 0, spread, 1.0), 0.0), spread


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
    return standout_score(x) > _check_threshold(threshold)


def standout_tokens(x: torch.Tensor, threshold: float | None = None) -> torch.Tensor:
    """Boolean ``[..., n]``: which positions of rows ``x`` ``[..., R, n]`` stand out across the ``R`` rows (of a key
    page ``[..., D, G]``: which tokens stand out in the page; module docstring)."""
    threshold = _check_threshold(threshold)
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or 0 in x.shape[-2:]:
        raise ValueError(f"x must be a tensor [..., R, n] with R, n >= 1, got {getattr(x, 'shape', type(x).__name__)}")
    score = _robust_z(x)[0].square().mean(-2).sqrt()  # [..., n]
    return _robust_z(score)[0] > threshold


def token_standout_rows(x: torch.Tensor, threshold: float | None = None) -> torch.Tensor:
    """Boolean ``[..., R]``: rows of ``x`` ``[..., R, n]`` whose min or max sits at a standout position
    (:func:`standout_tokens`)."""
    tokens = standout_tokens(x, threshold)[..., None, :].expand(x.shape)
    return tokens.gather(-1, x.argmax(-1, keepdim=True))[..., 0] | tokens.gather(-1, x.argmin(-1, keepdim=True))[..., 0]


def _check_threshold(threshold: float | None) -> float:
    """``threshold`` (``None``: :data:`STANDOUT_THRESHOLD`, read at call time); ``ValueError`` unless a number >= 0."""
    threshold = STANDOUT_THRESHOLD if threshold is None else threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
    return threshold
