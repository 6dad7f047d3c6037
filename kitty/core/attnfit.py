"""Key ranges fitted against the attention error: the token weights behind ``key_range="fit-attn"``.

A key channel's quantization error ``e_ct = k_hat_ct - k_ct`` moves the logit of token ``t`` by ``tau * q . e_t``
(``tau`` the softmax scale). With the channels' errors uncorrelated, a query of per-channel mean square ``qs_c**2``
gives an expected squared logit error ``tau**2 * sum_c qs_c**2 e_ct**2``; weighted by how much each token is attended,
``p_t``, the error of the attention distribution (to first order, twice its KL divergence from full precision's) is::

    sum_t p_t * sum_c qs_c**2 e_ct**2 = sum_c qs_c**2 * (sum_t p_t e_ct**2)

so per channel the range that minimizes it is the one of least **token-weighted** squared error, one weight per token
shared by all channels of the page. Plain least squares (``fit``, ``fit-bounded``) weighs every token alike.

The weights: each token's attention within its page under the **mean query** of the KV head's GQA group (the running
mean of ``q`` per channel, which the cache keeps beside the oracle's ``E[q^2]`` for these ranges)::

    w_t = G * softmax_t(tau * qbar . k_t),   tau = 1 / sqrt(D)

(``tau`` is the scale of all supported models, whose ``query_pre_attn_scalar`` is ``head_dim`` where set). On one
essay window of each of the three models this ranks the page's tokens by the attention later queries give them with
a Spearman correlation of 0.5-0.7, where a zero-mean Gaussian query with the oracle's ``E[q^2]`` (weights growing
with ``sum_c E[q_c^2] (k_ct - kbar_c)^2``) ranks them no better than chance (-0.1 to 0.0): the queries' mean
direction, not their spread, decides which tokens are attended. Without a mean query (``None``) every weight is 1.

``"fit-attn"``: the bounded search of ``fit-bounded`` (every token within half a min-max step) ranked by the weighted
error, refitted by weighted least squares; ``"fit-attn-free"``: the two-sided clipping search of ``fit``, unbounded,
ranked and refitted the same way; ``"fit-attn-token-standout"``: min-max on the rows of
:func:`kitty.core.standout.token_standout_rows`, ``fit-attn`` elsewhere.

``"fit-attn-bound"``: the bounded weighted search with a bound **per token** set by its weight
(:func:`token_bound_steps`): ``min(max(0.5 / sqrt(w_t), 0.5), 1)`` min-max steps, half a step (min-max's own
guarantee) at the tokens :func:`kitty.core.standout.standout_tokens` finds. The budget is the weighted squared error
itself: token ``t`` adds ``w_t * e_t**2``, and ``e_t <= 0.5 / sqrt(w_t)`` steps holds that to what min-max allows a
token of average weight (``w = 1``, half a step), so a token attended at least as much as the average keeps min-max's
half step and one attended a quarter as much or less may move up to one step, never more (the largest bound whose cuts
of the clipping grid all fit at 2 bits, :data:`kitty.core.ranges.LOOSE_BOUND_STEPS`). No constant was chosen by an
eval. ``"fit-attn-token-bound"``: min-max on the token test's rows, ``fit-attn-bound`` elsewhere. Without a mean
query every bound is half a step: ``fit-bounded`` and ``fit-token-standout``, bit for bit.

Same page layout and bytes as min-max; nothing more is stored in a page. Torch only, sync-free (no host read). Needs
``channel_selection="oracle"`` (the cache keeps query statistics only for it).
"""

from __future__ import annotations

import torch

from .standout import standout_tokens

# key_range values whose fitted error is weighted by the tokens' expected attention, and the fit each one weights
ATTN_FITS = {"fit-attn": "fit-bounded", "fit-attn-free": "fit", "fit-attn-bound": "fit-bounded"}
# min-max on the rows of standout.token_standout_rows, the weighted fit named here elsewhere (as STANDOUT_FITS)
ATTN_TOKEN_RULES = {"fit-attn-token-bound": "fit-attn-bound"}
TIGHT_STEPS = 0.5  # fit-attn-bound's bound of an attended (w >= 1) or standout token: min-max's own, in min-max steps
LOOSE_STEPS = 1.0  # its bound of a lightly attended token (w <= 1/4): ranges.LOOSE_BOUND_STEPS, one min-max step


def attention_weights(x: torch.Tensor, query_mean: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each token within its page under the mean query, times ``G`` (mean 1): ``[..., 1, G]`` fp32 for
    key rows ``x`` ``[..., D, G]`` (one row per channel) and ``query_mean`` ``[..., D]`` (``None``: all ones)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or 0 in x.shape[-2:]:
        raise ValueError(f"x must be a tensor [..., D, G] with D, G >= 1, got {getattr(x, 'shape', type(x).__name__)}")
    D, G = x.shape[-2:]
    if query_mean is None:
        return torch.ones((*x.shape[:-2], 1, G), dtype=torch.float32, device=x.device)
    if query_mean.shape[-1] != D:
        raise ValueError(f"query_mean must end in D = {D} channels, got shape {tuple(query_mean.shape)}")
    logits = (query_mean.float().to(x.device)[..., None] * x.float()).sum(-2, keepdim=True) * D**-0.5
    return torch.softmax(logits, -1) * G


def token_bound_steps(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``fit-attn-bound``'s largest error of each token in min-max steps, ``[..., 1, G]`` fp32, for key rows ``x``
    ``[..., D, G]`` and weights ``[..., 1, G]`` (:func:`attention_weights`): ``0.5 / sqrt(w_t)`` clamped to
    ``[TIGHT_STEPS, LOOSE_STEPS]``, and ``TIGHT_STEPS`` where the token stands out (module docstring)."""
    if weight.shape != (*x.shape[:-2], 1, x.shape[-1]):
        raise ValueError(f"weight must be [..., 1, G] for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    steps = (TIGHT_STEPS * weight.float().rsqrt()).clamp(TIGHT_STEPS, LOOSE_STEPS)  # w = 0: rsqrt inf -> LOOSE
    return torch.where(standout_tokens(x)[..., None, :], TIGHT_STEPS, steps)


def split_query_stats(query_scale: torch.Tensor | None, D: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(query_scale, query_mean)`` from what a fit-attn cache passes as ``query_scale``: ``[..., 2D]``, the
    oracle's root mean square of ``q`` then the mean ``q`` (:meth:`kitty.cache.layer.KittyLayer.query_scale`);
    ``[..., D]`` (no mean kept) or ``None`` gives no mean."""
    if query_scale is not None and query_scale.shape[-1] == 2 * D:
        return query_scale[..., :D], query_scale[..., D:]
    return query_scale, None
