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

``"fit-attn-max-bound"``: ``fit-attn-bound``'s rule with a weight that sees the queries, not their mean: each token's
**largest** attention from the queries the cache observed while its page was still in full precision (at a prompt,
every prompt query at or after it; in decode, the queries of the steps while it sat in the qbuffer), each query's
attention normalized within the page (:func:`visible_page_weights`: the softmax over the page's tokens the query sees,
times how many it sees, so mean 1 as ``attention_weights``; ``G * softmax`` for a query that sees the whole page).
The bound and the weighted search are ``fit-attn-bound``'s, unchanged: ``b_t = min(max(0.5 / sqrt(w_t), 0.5), 1)``,
half a step at standout tokens. ``"fit-attn-max-token-bound"``: min-max on the token test's rows,
``fit-attn-max-bound`` elsewhere. The cache keeps the running maximum per qbuffer slot
(:meth:`kitty.cache.layer.PagedLayer.observe_key_attention`) and passes it after the oracle's scale (``query_scale``
``[..., D + G]``); without it every weight is 1: ``fit-bounded`` / ``fit-token-standout``, bit for bit.
``"fit-attn-max-rel-bound"`` / ``"fit-attn-max-rel-token-bound"`` (a follow-up, chosen after the first failed its
perplexity gate): the same maxima divided by their mean over the page, so that the bound's anchor ``w = 1`` is again
the page's average token (:func:`observed_weights` ``relative=True``).

Same page layout and bytes as min-max; nothing more is stored in a page. Torch only, sync-free (no host read). Needs
``channel_selection="oracle"`` (the cache keeps query statistics only for it).
"""

from __future__ import annotations

import torch

from .standout import standout_tokens

# key_range values whose fitted error is weighted by the tokens' expected attention, and the fit each one weights
ATTN_FITS = {"fit-attn": "fit-bounded", "fit-attn-free": "fit", "fit-attn-bound": "fit-bounded"}
# min-max on the rows of standout.token_standout_rows, the weighted fit named here elsewhere (as STANDOUT_FITS)
ATTN_TOKEN_RULES = {
    "fit-attn-token-bound": "fit-attn-bound",
    "fit-attn-max-token-bound": "fit-attn-max-bound",
    "fit-attn-max-rel-token-bound": "fit-attn-max-rel-bound",
}
# key_range values weighted by each token's largest observed attention (the cache's per-slot running maximum)
ATTN_MAX_FITS = ("fit-attn-max-bound", "fit-attn-max-rel-bound")
ATTN_MAX_RANGES = ATTN_MAX_FITS + ("fit-attn-max-token-bound", "fit-attn-max-rel-token-bound")
QUERY_CHUNK = 256  # prompt queries per block of observed_page_attention: memory O(QUERY_CHUNK x keys)
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


def observed_weights(x: torch.Tensor, weight: torch.Tensor | None = None, relative: bool = False) -> torch.Tensor:
    """``fit-attn-max-bound``'s weights ``[..., 1, G]`` fp32 for key rows ``x`` ``[..., D, G]``: ``weight``
    ``[..., G]`` (each token's largest observed attention, :func:`observed_page_attention`), ``None``: all ones.
    ``relative`` (``fit-attn-max-rel-bound``): divided by their mean over the page's tokens (mean 1 after the
    maximum; all ones where every weight is 0)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or 0 in x.shape[-2:]:
        raise ValueError(f"x must be a tensor [..., D, G] with D, G >= 1, got {getattr(x, 'shape', type(x).__name__)}")
    G = x.shape[-1]
    if weight is None:
        return torch.ones((*x.shape[:-2], 1, G), dtype=torch.float32, device=x.device)
    if weight.shape[-1] != G or weight.dim() != x.dim() - 1:
        raise ValueError(f"weight must be [..., G] (G = {G}) for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    w = weight.float().to(x.device)[..., None, :]
    if relative:
        mean = w.mean(-1, keepdim=True)
        w = torch.where(mean > 0, w / torch.where(mean > 0, mean, 1.0), 1.0)
    return w


def visible_page_weights(logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Each query's attention within one page, mean 1 over what it sees: ``n * softmax`` over the entries of the last
    dim (the page's ``G`` tokens) that ``visible`` marks (``n`` of them), 0 at the others and where none is visible;
    ``[..., G]`` fp32 for ``logits`` ``[..., G]`` and a bool ``visible`` broadcastable to it. No host read."""
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., G] with G >= 1, got {tuple(logits.shape)}")
    visible = visible.to(torch.bool).expand(logits.shape)
    lf = torch.where(visible, logits.float(), float("-inf"))
    top = lf.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)  # no visible token: every entry comes out 0
    e = torch.where(visible, (lf - top).exp(), 0.0)
    total = e.sum(-1, keepdim=True)
    n = visible.sum(-1, keepdim=True).float()
    return torch.where(total > 0, e * n / torch.where(total > 0, total, 1.0), 0.0)


def observed_page_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    group_size: int,
    scale: float,
    chunk: int = QUERY_CHUNK,
) -> torch.Tensor:
    """Each key's largest page-local attention over ``query`` (:func:`visible_page_weights`, causal), the maximum
    over the GQA group's query heads and the queries: ``[H, L]`` fp32.

    ``query`` ``[Hq, T, D]`` at positions ``query_pos`` ``[T]``; ``keys`` ``[H, L, D]`` (``Hq`` a multiple of
    ``H``) at positions ``key_pos`` ``[L]``, the first at a page boundary (key ``j`` is in page ``j // group_size``);
    a query sees the keys at or before its position; logits ``scale * q . k``. The queries go ``chunk`` at a time,
    each block over the pages it sees, so memory is ``O(chunk x L)`` per query head (one host read per block: for a
    prompt, not a decode step)."""
    if query.dim() != 3 or keys.dim() != 3 or query.shape[-1] != keys.shape[-1] or query.shape[0] % keys.shape[0]:
        raise ValueError(
            f"query must be [Hq, T, D] and keys [H, L, D], H dividing Hq; got {tuple(query.shape)}, {tuple(keys.shape)}"
        )
    Hq, T, D = query.shape
    H, L, _ = keys.shape
    if query_pos.shape != (T,) or key_pos.shape != (L,):
        raise ValueError(
            f"query_pos must be [{T}], key_pos [{L}], got {tuple(query_pos.shape)}, {tuple(key_pos.shape)}"
        )
    if group_size < 1 or chunk < 1:
        raise ValueError(f"group_size and chunk must be >= 1, got {group_size}, {chunk}")
    P = -(-L // group_size)
    pad = P * group_size - L
    kf = torch.nn.functional.pad(keys.float(), (0, 0, 0, pad))  # whole pages; the padding is never seen
    q = query.float().reshape(H, Hq // H, T, D)
    kpos = key_pos.to(keys.device, torch.int64)
    kpos = torch.cat([kpos, kpos.new_full((pad,), torch.iinfo(torch.int64).max)])
    qpos = query_pos.to(keys.device, torch.int64)
    best = torch.zeros(H, P * group_size, dtype=torch.float32, device=keys.device)
    for a in range(0, T, chunk):
        qc, pos = q[:, :, a : a + chunk], qpos[a : a + chunk]  # (H, g, c, D), (c,)
        n = -(-int((kpos <= pos.max()).sum()) // group_size) * group_size  # the pages this chunk sees (a host read)
        if n == 0:
            continue
        c = qc.shape[2]
        logits = torch.einsum("hgcd,hld->hgcl", qc, kf[:, :n]) * scale
        seen = kpos[None, :n] <= pos[:, None]  # (c, n)
        w = visible_page_weights(
            logits.reshape(H, -1, c, n // group_size, group_size), seen.reshape(c, -1, group_size)[None, None]
        )  # (H, g, c, pages, G)
        best[:, :n] = torch.maximum(best[:, :n], w.amax((1, 2)).reshape(H, n))
    return best[:, :L]


def split_query_stats(query_scale: torch.Tensor | None, D: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(query_scale, query_stat)`` from what a fit-attn cache passes as ``query_scale``: the oracle's root mean
    square of ``q`` (the first ``D`` channels), then what the key range weights tokens with
    (:meth:`kitty.cache.layer.PagedLayer.query_scale`): the mean ``q`` ``[..., D]`` (``fit-attn``, ...) or each token's
    largest observed attention ``[..., G]`` (``fit-attn-max-bound``, ...). ``[..., D]`` or ``None``: nothing more."""
    if query_scale is not None and query_scale.shape[-1] > D:
        return query_scale[..., :D], query_scale[..., D:]
    return query_scale, None
