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
:func:`kitty.core.standout.token_standout_rows`, ``fit-attn`` elsewhere. Same page layout and bytes as min-max;
nothing more is stored in a page. Torch only, sync-free (no host read). Needs ``channel_selection="oracle"`` (the
cache keeps query statistics only for it).
"""

from __future__ import annotations

import torch

# key_range values whose fitted error is weighted by the tokens' expected attention, and the fit each one weights
ATTN_FITS = {"fit-attn": "fit-bounded", "fit-attn-free": "fit"}


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


def split_query_stats(query_scale: torch.Tensor | None, D: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(query_scale, query_mean)`` from what a fit-attn cache passes as ``query_scale``: ``[..., 2D]``, the
    oracle's root mean square of ``q`` then the mean ``q`` (:meth:`kitty.cache.layer.KittyLayer.query_scale`);
    ``[..., D]`` (no mean kept) or ``None`` gives no mean."""
    if query_scale is not None and query_scale.shape[-1] == 2 * D:
        return query_scale[..., :D], query_scale[..., D:]
    return query_scale, None
