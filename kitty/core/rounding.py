"""Query-aware rounding of key codes (``key_rounding="query"``): the codes of a page chosen so that the logits, not
the keys, come out closest.

A key error ``e = k - k_hat`` moves a query's logit by ``q . e``; over the queries a head sees, the expected square is
``e^T Q e`` with ``Q = E[q q^T]`` the queries' second moment (after RoPE, as the cache sees them). Nearest rounding
minimizes ``|e|^2`` entry by entry and ignores ``Q``. Here each token's codes are chosen channel after channel, and
each channel's rounding error is fed forward into the channels not yet rounded, through the Cholesky factor of
``Q^-1``: GPTQ's update (Frantar et al., 2022), with a token's key as the weight row and ``Q`` as the Hessian. The
ranges (``scale``, ``zero``) and the boosted channels are the page's own; only which level each entry takes
changes, so the page's layout and bytes are those of nearest rounding and any dequantizer reads it.

Channels are rounded in descending order of ``Q``'s diagonal (GPTQ's "act order": the channels the queries weigh
most are rounded first, while the most channels remain to absorb their error), and ``Q`` is damped by
``KEY_ROUNDING_DAMP`` times its mean diagonal (the queries seen are a sample; the damping also makes an all-zero
``Q``, before any query, round to nearest). No host read and no data-dependent shape.
"""

from __future__ import annotations

import torch

from .ranges import quantize_codes

KEY_ROUNDING_DAMP = 0.1  # Q + damp * mean(diag Q) * I


def feedback_factor(query_cov: torch.Tensor, damp: float = KEY_ROUNDING_DAMP) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, U)`` for ``query_cov`` ``[..., D, D]`` (the queries' second moment per head): the channel order
    (descending diagonal) and the upper Cholesky factor of the damped ``Q^-1`` in that order, ``[..., D, D]`` fp32."""
    q = query_cov.float()
    D = q.shape[-1]
    diag = q.diagonal(dim1=-2, dim2=-1)
    order = torch.argsort(diag, dim=-1, descending=True, stable=True)
    q = torch.gather(q, -2, order[..., :, None].expand_as(q))
    q = torch.gather(q, -1, order[..., None, :].expand_as(q))
    # the damping's floor keeps an all-zero Q (no query seen) positive definite: then U is diagonal, nearest rounding
    lam = damp * diag.mean(-1) + torch.finfo(torch.float32).tiny ** 0.5
    q = q + lam[..., None, None] * torch.eye(D, device=q.device)
    low, _ = torch.linalg.cholesky_ex(q)
    inv = torch.cholesky_inverse(low)
    upper, _ = torch.linalg.cholesky_ex(inv, upper=True)
    return order, upper


def query_moment_sum(q: torch.Tensor) -> torch.Tensor:
    """``sum q q^T`` ``[..., D, D]`` of queries ``q`` ``[..., group, T, D]`` over a KV head's GQA group and tokens
    (fp32): what ``key_rounding="query"`` divides by the count for ``Q``."""
    q = q.float()
    return torch.einsum("...gtd,...gte->...de", q, q)


def feedback_codes(
    x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: torch.Tensor, query_cov: torch.Tensor
) -> torch.Tensor:
    """Codes ``[..., D, G]`` (uint8, in ``[0, levels]``) of the channel rows ``x`` ``[..., D, G]`` with per-channel
    ``scale``, ``zero``, ``levels`` ``[..., D]``, rounded with the error fed forward through ``query_cov``
    ``[..., D, D]`` (module docstring). With ``query_cov`` a multiple of the identity they are
    :func:`kitty.core.ranges.quantize_codes`'s (nearest rounding)."""
    order, U = feedback_factor(query_cov)
    by = lambda t: torch.gather(t, -1, order)[..., None]  # noqa: E731  per-channel [..., D, 1] in rounding order
    s, z, lv = by(scale.float()), by(zero.float()), by(levels)
    w = torch.gather(x.float(), -2, order[..., None].expand_as(x)).clone()  # [..., D, G] in rounding order
    codes = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    for j in range(w.shape[-2]):  # channel j nearest given the error fed into it, then its own error fed onward
        codes[..., j, :] = c = quantize_codes(w[..., j, :], s[..., j, :], z[..., j, :], lv[..., j, :])
        err = (w[..., j, :] - (c * s[..., j, :] + z[..., j, :])) / U[..., j, j, None]
        w[..., j + 1 :, :] -= U[..., j, j + 1 :, None] * err[..., None, :]
    return torch.empty_like(codes).scatter_(-2, order[..., None].expand_as(codes), codes)
