"""Key reconstruction error of real keys under several configs: a fast screen before perplexity and passkeys.

One text window (the eval's first, 1280 tokens of ``kitty/texts/essay.txt``) goes through the model with a
full-precision ``DynamicCache``; the keys of every full-attention layer (Gemma 3: the 3 global layers; sliding layers
hold no Kitty pages) are cut into the 9 pages a Kitty cache would quantize (after the 32 sink tokens), and each config
quantizes and dequantizes them with ``kitty.core.quant``. Printed per config: the relative squared error
``sum |k - k_hat|^2 / sum |k|^2`` averaged over pages and heads, and the largest absolute error of any entry.
Query-aware selections get ``query_scale = 1`` (so ``oracle`` ranks by squared key error alone, not the cache's
running query statistics).

``--exact-extremes``: also how low the error can go while every 2-bit channel keeps its min and max as exact levels
(what min-max ranges do): ``kitty``'s boosted channels as they are, the others quantized to 4 levels ``{min, a, b,
max}`` with ``a, b`` either the uniform ones (``kitty`` itself), moved symmetrically toward the middle (``beta``: the
interior levels at ``1.5 -+ beta`` steps), or fitted per channel by Lloyd iterations (free levels that the page
layout has no room for: a bound, not a quantizer).

``--window 1``: the first window of ``kitty/texts/python_reference.txt`` instead (the eval's third).

``--attention``: also the attention error the quantized keys cause, which is what the logits see. The queries of the
same window are recorded (after RoPE, as the cache sees them); the 96 queries at positions 1184-1279 (after the 9
pages, so each attends all of them) attend the window's keys with the 9 pages dequantized and everything else (sink,
the tokens after the pages) in full precision, and the full-precision values. Printed per config, averaged over
queries, heads and layers: the KL divergence of the attention distribution from full precision's (nats) and the
relative squared error of the attention output. Query-aware selections then get the window's real ``query_scale``
(root mean square of each channel over the GQA group's queries of positions 0-1183, those a cache has seen when the
last page completes; ``"query"``: mean ``|q|``; ``fit-attn``: then the mean query of the same positions).

A config with ``key_rounding="query"`` needs ``--attention``: its codes are rounded against the second moment of the
same queries of positions 0-1183 (:func:`window_query_cov`), what the cache holds when the last page completes.

``--tail`` (with ``--attention``): also the tail of the same queries' errors, three more columns: the 99th percentile
and the largest per-query KL divergence over every layer, query head and query, and the mean over them of the query's
largest logit error over the page tokens (nats): whether a rule's rare large errors, which a mean hides, are what
decode perplexity follows.

``--variable-boost``: also ``kitty``'s total of boosted channels (``nb`` per page and KV head) spread unevenly, a
screen of a boost count per page or per head at the same average (:func:`variable_boost`; the allocation is done
here only, the page layout has no room for it). Each channel's gain is what boosting it saves in squared key error
on its page (both precisions with ``kitty``'s min-max ranges); the allocation maximizes the total gain of a KV head's
pages (``page``: up to half the channels a page), of a layer's heads (``head``: one count per head for all its pages)
or of every head (``head-all``), greedily, which is optimal here. Printed besides the usual columns: the error pooled
over pages (what the allocation minimizes per head), the key page's bits per element (a count byte per page added to
the variable rows) and the spread of the counts. With ``--attention`` the same allocations also run on the gain
weighted by the window's queries' mean square per channel (the ``oracle`` selection's logit-error score).

``--three-bit``: also ``kitty``'s extra key bits (``2 nb`` a token) spent on 3-bit channels (:func:`three_bit_rows`):
``2 nb`` channels at 3 bits chosen by ``kitty``'s magnitude ranking or by the squared error they save, and a mix of 2,
3 and 4 bits per channel with the same extra bits, chosen exactly (:func:`allocate_mixed`). Every channel keeps
``kitty``'s min-max ranges (3 bits: 8 levels). With ``--attention`` the gain-chosen rows also run on the gain weighted
by the window's queries' mean square per channel.

``--needle-cases L:DEPTH:KEY,...``: instead of the window, the counts the ``page`` allocation gives the key pages
that hold a passkey prompt's needle (a full-precision prefill of each prompt; :func:`needle_counts`).

``--standout-thresholds T1,T2``: each config whose range is ``fit-standout`` / ``fit-peak-standout`` runs once per
threshold of the standout test (``kitty.core.standout``), with the share of channel rows (of every page, layer and
head) that keep min-max ranges under it.

    python benchmarks/key_error.py --model gemma-3-270m --methods kitty,kitty+key_range=fit-peak
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kitty.core import standout
from kitty.core.attnfit import ATTN_MAX_RANGES
from kitty.core.config import KEY_ONLY_RANGES, QUERY_SELECTIONS, get_preset
from kitty.core.quant import (
    channel_importance,
    dequantize_key_page,
    quantize_key_page,
    query_scale_from,
    query_statistic,
    select_boosted,
)
from kitty.core.ranges import dequantize_codes, quantize_codes, range_params
from kitty.core.rounding import query_moment_sum
from kitty.hf.models import load_model
from kitty.tools.eval import TEXTS, text_windows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="as for load_model: a packaged model's name, a folder or a hub id")
    p.add_argument("--methods", required=True, help="comma-separated presets (+field=value overrides allowed)")
    p.add_argument("--exact-extremes", action="store_true", help="also the bound of 4 levels with exact min and max")
    p.add_argument("--window", type=int, default=0, help="the first window of which text: 0 essay, 1 python_reference")
    p.add_argument("--attention", action="store_true", help="also the attention error (KL, output) of real queries")
    p.add_argument("--tail", action="store_true", help="with --attention: also the tail of the per-query errors")
    p.add_argument("--variable-boost", action="store_true", help="also kitty's boost budget spread per page / head")
    p.add_argument("--three-bit", action="store_true", help="also kitty's extra bits spent on 3-bit channels")
    p.add_argument("--needle-cases", default=None, help="length:depth:key,...: the needle's pages' boost counts only")
    p.add_argument("--standout-thresholds", default=None, help="comma-separated thresholds of the standout test")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(a.model)
    if a.needle_cases:
        return needle_counts(model, tok, a.needle_cases)
    window = text_windows(tok, TEXTS, 1024, 256, 1, with_names=True)[a.window][1]
    cache = DynamicCache(config=model.config)
    queries: dict[int, tuple[torch.Tensor, float]] = {}
    if a.attention:  # record each layer's queries [Hq, T, D] and softmax scale on the way through

        def record(module, query, key, value, attention_mask, **kw):
            queries[module.layer_idx] = (query[0].detach(), kw.get("scaling") or query.shape[-1] ** -0.5)
            return own(module)(module, query, key, value, attention_mask, **kw)

        name = model.config._attn_implementation  # the model's own attention keeps the keys of later layers as they are
        own = lambda m: (  # noqa: E731
            getattr(sys.modules[type(m).__module__], "eager_attention_forward")
            if name == "eager"
            else ALL_ATTENTION_FUNCTIONS.get(name, sdpa_attention_forward)
        )
        AttentionInterface.register("key_error_record", record)
        AttentionMaskInterface.register("key_error_record", ALL_MASK_ATTENTION_FUNCTIONS.get(name, sdpa_mask))
        model.set_attn_implementation("key_error_record")
    with torch.no_grad():
        model(window[None, :1280], past_key_values=cache, use_cache=True)
    S = 32
    full, pages = full_attention_pages(model, cache, "keys", S)
    end = S + pages.shape[1] * pages.shape[3]  # the queries a cache has seen when the last page completes
    print(f"{len(full)} full-attention layers, pages {tuple(pages.shape)} (layer, page, head, G, D), {pages.dtype}")
    ref = pages.float()
    thresholds = [float(t) for t in a.standout_thresholds.split(",")] if a.standout_thresholds else []
    rows = pages.transpose(-1, -2)  # [layer, page, head, D, G]: one row per channel
    for m in a.methods.split(","):
        cfg = get_preset(m)
        qs = torch.ones(pages.shape[:-2] + pages.shape[-1:]) if cfg.channel_selection in QUERY_SELECTIONS else None
        if qs is not None and a.attention:  # the window's real query statistics, per layer and KV head
            qs = torch.stack([window_query_scale(queries[i][0], pages.shape[2], end, cfg) for i in full])
            qs = qs[:, None].expand(pages.shape[:-2] + qs.shape[-1:])
        runs = thresholds if cfg.key_range in standout.STANDOUT_FITS and thresholds else [None]
        for t in runs:
            default = standout.STANDOUT_THRESHOLD
            standout.STANDOUT_THRESHOLD = default if t is None else t
            cov = None
            if cfg.key_rounding == "query":  # the second moment of the queries a cache has seen, per layer and head
                if not a.attention:
                    raise ValueError(f"{m}: key_rounding='query' needs --attention (the window's queries)")
                cov = torch.stack([window_query_cov(queries[i][0], pages.shape[2], end) for i in full])
                cov = cov[:, None].expand(pages.shape[:-2] + cov.shape[-2:])
            try:
                page = quantize_key_page(pages, cfg, query_scale=qs, query_cov=cov)
                err = dequantize_key_page(page).float() - ref
                rule = standout.token_standout_rows if cfg.key_range in standout.TOKEN_RULES else standout.standout_rows
                share = rule(rows).float().mean()
            finally:
                standout.STANDOUT_THRESHOLD = default
            rel = err.square().sum((-1, -2)) / ref.square().sum((-1, -2))
            label = m if t is None else f"{m} (threshold {t:g}, {share:.1%} of channel rows min-max)"
            extra = ""
            if a.attention:
                kl, out, tail = attention_error(cache, full, queries, pages.float() + err, S)
                extra = f" {kl:.5f} | {out:.5f} |"
                if a.tail:
                    extra += f" {tail['kl_p99']:.4f} | {tail['kl_max']:.3f} | {tail['logit_max']:.4f} |"
            print(f"| {label} | {rel.mean():.4f} | {err.abs().amax():.2f} |{extra}")
    if a.exact_extremes:
        exact_extremes(pages)
    if a.variable_boost:
        variable_rows(pages, a.attention, cache, full, queries, S)
    if a.three_bit:
        three_bit_rows(pages, a.attention, cache, full, queries, S)


def full_attention_pages(
    model, cache: DynamicCache, side: str, sink: int = 32, group: int = 128, n: int = 9
) -> tuple[list[int], torch.Tensor]:
    """``(full, pages)``: the full-attention layers' indices, and their ``side`` (``"keys"`` or ``"values"``) of
    row 0 cut into the ``n`` pages of ``group`` tokens after ``sink`` that a Kitty cache would quantize,
    ``[layers, n, heads, group, D]`` (sliding layers hold no Kitty pages)."""
    text = model.config.get_text_config()
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    rows = [getattr(cache.layers[i], side)[0] for i in full]  # [H, T, D] each
    cut = [x[:, sink : sink + n * group].reshape(x.shape[0], n, group, -1).transpose(0, 1) for x in rows]
    return full, torch.stack(cut)


def window_query_scale(q: torch.Tensor, H: int, end: int, cfg) -> torch.Tensor:
    """What the cache would pass as ``query_scale`` ``[H, D]`` (fit-attn: ``[H, 2D]``, then the mean query) after the
    queries ``q`` ``[Hq, T, D]`` of positions before ``end`` (those it has seen when the last page completes). The
    fit-attn-max ranges (weighted per token by the queries the cache saw, not a statistic of the window) are refused."""
    if cfg.key_range in ATTN_MAX_RANGES:
        raise ValueError(f"key_range={cfg.key_range!r}: the screen passes no per-token attention maxima")
    q = q[:, :end].float().reshape(H, -1, q.shape[-1])
    out = query_scale_from(query_statistic(q, cfg.channel_selection).mean(1), cfg.channel_selection)
    return torch.cat([out, q.mean(1)], -1) if cfg.key_range in KEY_ONLY_RANGES else out


def window_query_cov(q: torch.Tensor, H: int, end: int) -> torch.Tensor:
    """What a ``key_rounding="query"`` cache would pass as ``query_cov`` ``[H, D, D]``: the second moment of the
    queries ``q`` ``[Hq, T, D]`` of positions before ``end``, per KV head over its GQA group."""
    grouped = q[:, :end].reshape(H, -1, end, q.shape[-1])  # [H, group, T, D]
    return query_moment_sum(grouped) / (grouped.shape[1] * end)


def attention_error(
    cache, full: list[int], queries: dict, pages_hat: torch.Tensor, sink: int
) -> tuple[float, float, dict[str, float]]:
    """Mean KL divergence (full precision's attention -> the quantized one's) and mean relative squared output error
    of the queries after the pages, over layers, query heads and queries (module docstring); and their tail
    (``--tail``): the 99th percentile and the largest per-query KL over every layer, query head and query, and the
    mean over them of the query's largest logit error (nats) over the page tokens, ``max_t |scale * q . e_t|``."""
    kls, outs, per_query, logit_max = [], [], [], []
    for j, i in enumerate(full):
        k, v = cache.layers[i].keys[0].float(), cache.layers[i].values[0].float()  # [H, T, D]
        H, T, D = k.shape
        n, G = pages_hat.shape[1], pages_hat.shape[3]
        k_hat = k.clone()
        k_hat[:, sink : sink + n * G] = pages_hat[j].transpose(0, 1).reshape(H, n * G, D)
        q, scale = queries[i]
        start = sink + n * G
        q = q[:, start:].float().reshape(H, -1, T - start, D)  # [H, group, Tq, D]
        mask = torch.arange(T)[None, :] > torch.arange(start, T)[:, None]  # causal: [Tq, T]
        logp, logits = [], []
        for kk in (k, k_hat):
            logits.append(torch.einsum("hgqd,htd->hgqt", q, kk) * scale)
            logp.append(torch.log_softmax(logits[-1].masked_fill(mask, float("-inf")), -1))
        p = logp[0].exp()
        kl_q = torch.where(mask, 0.0, p * (logp[0] - logp[1])).sum(-1)  # [H, group, Tq]
        kls.append(kl_q.mean())
        per_query.append(kl_q.flatten())
        logit_max.append((logits[1] - logits[0])[..., sink : sink + n * G].abs().amax(-1).flatten())
        o, o_hat = (torch.einsum("hgqt,htd->hgqd", lp.exp(), v) for lp in logp)
        outs.append(((o_hat - o).square().sum(-1) / o.square().sum(-1)).mean())
    per_query, logit_max = torch.cat(per_query), torch.cat(logit_max)
    tail = {"kl_p99": float(per_query.quantile(0.99)), "kl_max": float(per_query.max())}
    tail["logit_max"] = float(logit_max.mean())
    return float(torch.stack(kls).mean()), float(torch.stack(outs).mean()), tail


def exact_extremes(pages: torch.Tensor) -> None:
    """Relative error of ``kitty`` pages whose unboosted channels use 4 levels with exact min and max (module doc)."""
    cfg = get_preset("kitty")
    ref = pages.float()
    kitty = dequantize_key_page(quantize_key_page(pages, cfg)).float().transpose(-1, -2)  # [..., D, G]
    boosted = select_boosted(channel_importance(pages, cfg), cfg.num_boosted(pages.shape[-1]))[..., None]
    x = ref.transpose(-1, -2)  # one row per channel
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)

    def rel(levels: torch.Tensor) -> float:  # levels [..., D, 4]: each value to its nearest level
        near = levels.gather(-1, (x[..., None] - levels[..., None, :]).abs().argmin(-1))
        full = torch.where(boosted, kitty, near)
        return float(((full - x).square().sum((-1, -2)) / x.square().sum((-1, -2))).mean())

    span = hi - lo
    for beta in (0.5, 0.4, 0.3, 0.2):  # 0.5: the uniform levels of min-max
        inner = (1.5 - beta) / 3 * span
        error = rel(torch.cat([lo, lo + inner, hi - inner, hi], -1))
        print(f"| exact min/max, interior at 1.5 -+ {beta} steps | {error:.4f} |")
    levels = torch.cat([lo, lo + span / 3, hi - span / 3, hi], -1)
    for _ in range(20):  # Lloyd iterations on the two interior levels, the extremes fixed
        nearest = (x[..., None] - levels[..., None, :]).abs().argmin(-1)
        for j in (1, 2):
            member = (nearest == j).float()
            count = member.sum(-1)
            levels[..., j] = torch.where(count > 0, (x * member).sum(-1) / count.clamp_min(1), levels[..., j])
    print(f"| exact min/max, interior fitted per channel (bound) | {rel(levels):.4f} |")


def allocate_boost(gains: torch.Tensor, budget: int, cap: int, unit: int = 1) -> torch.Tensor:
    """Boosted channels per row of ``gains`` ``[R, D]`` (a row: one page, or one head) that maximize the summed gain.

    ``gains[r, i] >= 0``: what boosting channel ``i`` of row ``r`` saves (its squared key error at 2 bits minus at 4
    bits), each row's best channels boosted first. Counts are multiples of ``unit`` (4: whole bytes of the high
    plane, which holds 4 channels per byte), at most ``cap`` per row, and sum to ``budget`` exactly. Greedy: each
    row's gains sorted descending, summed per ``unit``, and the ``budget / unit`` largest of these steps over all rows
    taken. A row's steps never increase, so the steps taken form a prefix of each row and the greedy total is the
    optimum of this separable problem. Returns int64 ``[R]``.
    """
    R, D = gains.shape
    if budget % unit or cap % unit or cap > D or budget > R * cap or budget < 0:
        raise ValueError(f"budget {budget} and cap {cap} must be multiples of unit {unit}, cap <= {D}, budget <= R*cap")
    steps = gains.float().sort(-1, descending=True).values[:, :cap].reshape(R, cap // unit, unit).sum(-1)
    counts = torch.zeros(R * (cap // unit), dtype=torch.int64)
    counts[steps.flatten().topk(budget // unit).indices] = 1
    return counts.view(R, cap // unit).sum(-1) * unit


def variable_boost(
    pages: torch.Tensor,
    cfg_name: str = "kitty",
    cap_share: float = 0.5,
    weight: torch.Tensor | None = None,
    rec: dict[int, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Reconstructions ``[layer, page, head, G, D]`` of ``pages`` with ``cfg_name``'s total of boosted channels
    spread unevenly, and each allocation's counts (the ``--variable-boost`` rows; module docstring).

    Every channel of every page is quantized at both precisions with the config's ranges (what its pages would hold
    for it at 2 and at 4 bits); a channel's gain is its squared reconstruction error at 2 bits minus at 4 bits. The
    budget is the config's ``nb`` per page and head; each row boosts its largest-gain channels. Allocations:

    - ``page``: per (layer, KV head), its pages share ``pages x nb`` channels, at most ``cap_share x D`` a page;
    - ``head``: per layer, its KV heads share ``heads x nb`` per page, each head the same count on all its pages;
    - ``head-all``: the same over every KV head of every layer;

    each at ``unit`` 1 (any count: a bound, the high plane's padding not paid) and 4 (whole high-plane bytes, so the
    bytes equal ``cfg_name``'s plus the count). ``fixed, by gain``: ``nb`` on every page, chosen by gain (``oracle``
    selection with ``query_scale = 1``): what choosing by gain alone does, without moving any budget. ``rec``: the
    pages' 2- and 4-bit rebuilds (:func:`precision_reconstructions`) if the caller has them.
    """
    cfg = get_preset(cfg_name)
    L, P, H, G, D = pages.shape
    nb, cap = cfg.num_boosted(D), int(cap_share * D)
    rec = rec or precision_reconstructions(pages, (2, 4), cfg_name)
    lo, hi = rec[2], rec[4]
    ref = pages.float()
    gain = ((lo - ref).square() - (hi - ref).square()).sum(-2)  # [L, P, H, D]
    if weight is not None:
        gain = gain * weight[:, None]
    rank = gain.argsort(-1, descending=True).argsort(-1)  # 0: the page's largest gain
    out: dict[str, torch.Tensor] = {}

    def build(name: str, counts: torch.Tensor) -> None:  # counts [L, P, H]
        out[name] = torch.where((rank < counts[..., None])[..., None, :], hi, lo)
        out[name + ":counts"] = counts

    build("fixed, by gain", torch.full((L, P, H), nb))
    for unit in (1, 4):
        per_head = gain.permute(0, 2, 1, 3).reshape(L * H, P, D)  # [(layer, head), page, D]
        counts = torch.stack([allocate_boost(g, P * nb, cap, unit) for g in per_head])
        build(f"page, unit {unit}", counts.view(L, H, P).transpose(1, 2))
        summed = gain.sort(-1, descending=True).values.sum(1)  # [L, H, D]: a head's gain at each count, over pages
        counts = torch.stack([allocate_boost(g, H * nb, cap, unit) for g in summed])  # [L, H]
        build(f"head, unit {unit}", counts[:, None].expand(L, P, H))
        counts = allocate_boost(summed.reshape(L * H, D), L * H * nb, cap, unit).view(L, 1, H)
        build(f"head-all, unit {unit}", counts.expand(L, P, H))
    return out


def key_page_bits(counts: torch.Tensor, G: int, D: int, dtype_bytes: int, count_bytes: int) -> float:
    """Bits per key element of pages with ``counts`` boosted channels each: the 2-bit plane, the high plane
    (``ceil(count / 4)`` bytes a token), ``boost_idx`` (a byte a channel), scale and zero per channel, and
    ``count_bytes`` a page for the count itself (0 for a fixed count)."""
    high = (counts + 3).div(4, rounding_mode="floor").float().sum() * G
    per_page = G * D // 4 + D + 2 * D * dtype_bytes + count_bytes
    return float((high + counts.numel() * per_page) * 8 / (counts.numel() * G * D))


def query_weight(queries: dict, full: list[int], heads: int, end: int) -> torch.Tensor:
    """``[layer, KV head, D]``: the window's queries' mean square per channel (the ``oracle`` selection's logit-error
    score), which the query-weighted rows multiply the gains by."""
    cfg = get_preset("kitty+channel_selection=oracle")
    return torch.stack([window_query_scale(queries[i][0], heads, end, cfg) for i in full]).square()


def stored_rows(pages: torch.Tensor) -> dict[str, torch.Tensor]:
    """``kitty``'s and ``kitty-pro``'s key pages as the quantizer stores them, dequantized (fp32): the reference rows
    of the ``--variable-boost`` and ``--three-bit`` tables."""
    rows = {}
    for name in ("kitty", "kitty-pro"):
        rows[name] = dequantize_key_page(quantize_key_page(pages, get_preset(name))).float()
    return rows


def variable_rows(pages: torch.Tensor, attention: bool, cache, full: list[int], queries: dict, sink: int) -> None:
    """The ``--variable-boost`` table: ``kitty`` and ``kitty-pro`` as stored, and ``kitty``'s boost budget spread
    by :func:`variable_boost` (module docstring)."""
    L, P, H, G, D = pages.shape
    ref, size = pages.float(), pages.element_size()
    rows = stored_rows(pages)
    for name in ("kitty", "kitty-pro"):
        rows[name + ":counts"] = torch.full((L, P, H), get_preset(name).num_boosted(D))
    rec = precision_reconstructions(pages, (2, 4))
    alloc = variable_boost(pages, rec=rec)
    mag = select_boosted(channel_importance(pages, get_preset("kitty")), get_preset("kitty").num_boosted(D))
    same = torch.equal(torch.where(mag[..., None, :], rec[4], rec[2]), rows["kitty"])
    print(f"check: kitty's pages equal its magnitude mask over the two precisions: {same}")
    rows.update({f"kitty budget, {k}": v for k, v in alloc.items()})
    if attention:  # the same allocations by the query-weighted gain
        alloc = variable_boost(pages, weight=query_weight(queries, full, H, sink + P * G), rec=rec)
        for k, v in alloc.items():
            base, counts = k.removesuffix(":counts"), k.endswith(":counts")
            rows[f"kitty budget, {base}, query-weighted" + (":counts" if counts else "")] = v
    head = "| allocation | rel. error | max | pooled rel. error | key bits/element | count min / median / max |"
    print(head + (" KL | output |" if attention else ""))
    for name, hat in rows.items():
        if name.endswith(":counts"):
            continue
        counts, err = rows[name + ":counts"], hat - ref
        rel = err.square().sum((-1, -2)) / ref.square().sum((-1, -2))
        pooled = err.square().sum() / ref.square().sum()
        fixed = name in ("kitty", "kitty-pro") or "fixed" in name
        bits = key_page_bits(counts, G, D, size, 0 if fixed else 1)
        c = counts.flatten().float()
        spread = f"{c.min():.0f} / {c.median():.0f} / {c.max():.0f}"
        extra = ""
        if attention:
            kl, out, _ = attention_error(cache, full, queries, hat, sink)
            extra = f" {kl:.5f} | {out:.5f} |"
        print(f"| {name} | {rel.mean():.4f} | {err.abs().amax():.2f} | {pooled:.4f} | {bits:.4f} | {spread} |{extra}")


def precision_reconstructions(pages: torch.Tensor, bits=(2, 3, 4), cfg_name: str = "kitty") -> dict[int, torch.Tensor]:
    """Every channel of every page of ``pages`` ``[..., G, D]`` quantized at each of ``bits`` with ``cfg_name``'s ranges
    (``kitty``: min-max; ``b`` bits: ``2**b`` levels), by ``kitty.core.ranges``' own range and code functions, and
    reconstructed in the pages' dtype: ``{b: [..., G, D] fp32}``. At 2 and 4 bits these are what ``kitty``'s pages
    hold for an unboosted and a boosted channel."""
    cfg = get_preset(cfg_name)
    x = pages.transpose(-1, -2)  # one row per channel
    out = {}
    for b in bits:
        levels = 2**b - 1
        scale, zero = range_params(x, levels, pages.dtype, cfg.key_range)
        codes = quantize_codes(x, scale[..., None], zero[..., None], levels)
        out[b] = dequantize_codes(codes, scale[..., None], zero[..., None], pages.dtype).transpose(-1, -2).float()
    return out


def allocate_mixed(gain3: torch.Tensor, gain4: torch.Tensor, extra: int) -> torch.Tensor:
    """Bits (2, 3 or 4) of each channel of each row of ``gain3`` / ``gain4`` ``[..., D]`` (what 3 and 4 bits save
    against 2, any sign), their extra bits ``sum(bits - 2)`` exactly ``extra`` per row, maximizing the summed gain.

    The gains per extra bit need not be concave (a channel's 3->4 step can save more than its 2->3 step), so a greedy
    over bits is not safe; this is an exact dynamic programme over channels and extra bits used (``D x (extra + 1)``
    states per row, a choice of +0, +1 or +2 each), then a walk back. Returns int64 ``[..., D]``."""
    *lead, D = gain3.shape
    if not 0 <= extra <= 2 * D:
        raise ValueError(f"extra bits {extra} must be in [0, 2 D = {2 * D}]")
    g3, g4 = gain3.reshape(-1, D).double(), gain4.reshape(-1, D).double()
    R = g3.shape[0]
    best = torch.full((R, extra + 1), float("-inf"), dtype=torch.float64)
    best[:, 0] = 0.0
    pad = torch.full((R, 2), float("-inf"), dtype=torch.float64)
    choices = []
    for i in range(D):
        up3 = torch.cat([pad[:, :1], best], 1)[:, : extra + 1] + g3[:, i : i + 1]
        up4 = torch.cat([pad, best], 1)[:, : extra + 1] + g4[:, i : i + 1]
        best, choice = torch.stack([best, up3, up4], -1).max(-1)
        choices.append(choice)
    used = torch.full((R,), extra, dtype=torch.int64)
    bits = torch.zeros(R, D, dtype=torch.int64)
    for i in reversed(range(D)):
        step = choices[i].gather(1, used[:, None])[:, 0]
        bits[:, i] = 2 + step
        used = used - step
    if bool((used != 0).any()):
        raise AssertionError("allocate_mixed: the walk back did not end at zero extra bits")
    return bits.view(*lead, D)


def three_bit_page_bits(G: int, D: int, extra: int, dtype_bytes: int) -> float:
    """Bits per key element of a page whose channels spend ``extra`` bits a token above 2 on 3- and 4-bit channels,
    in the layout assumed here: the 2-bit low plane of every channel (as ``kitty``'s), a 1-bit plane of ``extra``
    slots a token (``ceil(extra / 8)`` bytes; a 3-bit channel's bit 2 in one slot, a 4-bit channel's bits 2 and 3 in
    two), a ``boost_idx`` byte per channel (its first slot, below ``extra <= 64`` so in 6 bits, a flag bit for 4 bits,
    255 for 2 bits: the same byte per channel as ``kitty``'s), and scale and zero per channel. At ``extra = 2 nb``
    that is ``kitty``'s bytes exactly (its high plane holds ``nb`` 2-bit slots, ``ceil(nb / 4)`` bytes a token)."""
    return (G * D // 4 + G * -(-extra // 8) + D + 2 * D * dtype_bytes) * 8 / (G * D)


def three_bit_boost(
    pages: torch.Tensor, weight: torch.Tensor | None = None, rec: dict[int, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Reconstructions ``[..., G, D]`` of ``pages`` with ``kitty``'s extra bits (``2 nb`` a token) spent on 3-bit
    channels, and each row's bits per channel (``name + ":bits"``): ``3-bit x 2nb by magnitude`` (``kitty``'s
    ranking, its top ``2 nb``), ``3-bit x 2nb by gain``, ``mixed 2/3/4 by gain`` (:func:`allocate_mixed`) and, for
    reference, ``4-bit x nb by gain`` (``kitty``'s budget chosen by gain). A channel's gain at ``b`` bits is its
    squared error at 2 bits minus at ``b`` bits on its page (times ``weight`` ``[..., D]``, broadcast over pages, if
    given: the by-magnitude row is then left out). ``rec``: the pages' 2-, 3- and 4-bit rebuilds
    (:func:`precision_reconstructions`) if the caller has them."""
    cfg = get_preset("kitty")
    D = pages.shape[-1]
    nb = cfg.num_boosted(D)
    ref = pages.float()
    rec = rec or precision_reconstructions(pages)
    err = {b: (r - ref).square().sum(-2) for b, r in rec.items()}  # [..., D]
    gain = {b: err[2] - err[b] for b in (3, 4)}
    if weight is not None:
        gain = {b: g * weight for b, g in gain.items()}

    def from_bits(bits: torch.Tensor) -> torch.Tensor:
        b = bits[..., None, :]
        return torch.where(b == 4, rec[4], torch.where(b == 3, rec[3], rec[2]))

    def top(score: torch.Tensor, n: int, b: int) -> torch.Tensor:
        return torch.where(select_boosted(score, n), b, 2).long()

    rows = {}
    if weight is None:
        rows["3-bit x 2nb by magnitude"] = top(channel_importance(pages, cfg), 2 * nb, 3)
    rows["4-bit x nb by gain"] = top(gain[4], nb, 4)
    rows["3-bit x 2nb by gain"] = top(gain[3], 2 * nb, 3)
    rows["mixed 2/3/4 by gain"] = allocate_mixed(gain[3], gain[4], 2 * nb)
    out: dict[str, torch.Tensor] = {}
    for name, bits in rows.items():
        out[name], out[name + ":bits"] = from_bits(bits), bits
    return out


def three_bit_rows(pages: torch.Tensor, attention: bool, cache, full: list[int], queries: dict, sink: int) -> None:
    """The ``--three-bit`` table: ``kitty`` and ``kitty-pro`` as stored, then :func:`three_bit_boost`'s rows, with the
    share of the way from ``kitty``'s relative key error to ``kitty-pro``'s (and of the KL, with ``attention``)."""
    L, P, H, G, D = pages.shape
    ref, size = pages.float(), pages.element_size()
    rows = stored_rows(pages)
    for name in ("kitty", "kitty-pro"):
        cfg = get_preset(name)
        rows[name + ":bits"] = torch.where(select_boosted(channel_importance(pages, cfg), cfg.num_boosted(D)), 4, 2)
    rec = precision_reconstructions(pages)
    same = torch.equal(torch.where(rows["kitty:bits"][..., None, :] == 4, rec[4], rec[2]), rows["kitty"])
    pro = torch.equal(torch.where(rows["kitty-pro:bits"][..., None, :] == 4, rec[4], rec[2]), rows["kitty-pro"])
    print(f"check: kitty's and kitty-pro's pages equal their masks over the 2- and 4-bit rebuilds: {same}, {pro}")
    rows.update(three_bit_boost(pages, rec=rec))
    if attention:  # the gain weighted by the window's queries' mean square per channel
        for k, v in three_bit_boost(
            pages, weight=query_weight(queries, full, H, sink + P * G)[:, None], rec=rec
        ).items():
            base, suffix = k.split(":") if ":" in k else (k, None)
            rows[f"{base}, query-weighted" + (f":{suffix}" if suffix else "")] = v
    stats = {}
    for name, hat in rows.items():
        if name.endswith(":bits"):
            continue
        err = hat - ref
        rel = float((err.square().sum((-1, -2)) / ref.square().sum((-1, -2))).mean())
        kl = out = None
        if attention:
            kl, out, _ = attention_error(cache, full, queries, hat, sink)
        stats[name] = (rel, float(err.square().sum() / ref.square().sum()), kl, out)
    head = "| allocation | rel. error | share | pooled | key bits | 3-bit / 4-bit a page (median; min-max of 4-bit) |"
    print(head + (" KL | KL share | output |" if attention else ""))
    rel_k, rel_p = stats["kitty"][0], stats["kitty-pro"][0]
    for name, (rel, pooled, kl, out) in stats.items():
        bits = rows[name + ":bits"]
        extra = (bits - 2).sum(-1)
        if not bool((extra == extra.flatten()[0]).all()):
            raise AssertionError(f"{name}: the extra bits differ between pages")
        kbits = three_bit_page_bits(G, D, int(extra.flatten()[0]), size)
        n3, n4 = (bits == 3).sum(-1).flatten().float(), (bits == 4).sum(-1).flatten().float()
        spread = f"{n3.median():.0f} / {n4.median():.0f} ({n4.min():.0f}-{n4.max():.0f})"
        share = (rel_k - rel) / (rel_k - rel_p)
        line = f"| {name} | {rel:.4f} | {share:.1%} | {pooled:.4f} | {kbits:.4f} | {spread} |"
        if attention:
            kl_k, kl_p = stats["kitty"][2], stats["kitty-pro"][2]
            line += f" {kl:.5f} | {(kl_k - kl) / (kl_k - kl_p):.1%} | {out:.5f} |"
        print(line)


def needle_counts(model, tok, cases: str) -> None:
    """``--needle-cases``: for each passkey prompt (``length:depth:key``), the boost counts the ``page`` allocation
    (plain gain, unit 4 and 1) gives the key pages holding the needle's tokens, against ``kitty``'s fixed count (and
    the share of (layer, KV head, needle page) above, at and below it). The
    prompt's keys come from a full-precision prefill (every page after the sink that a cache would quantize); each
    (layer, KV head) spreads its pages' budget as in :func:`variable_boost`."""
    from kitty.tools.prompts import _needle, passkey_prompt

    cfg = get_preset("kitty")
    S, G = cfg.sink_tokens, cfg.group_size
    head = "| prompt | needle's pages of all | unit | needle pages' counts (min / median / max)"
    print(head + " | above / at / below fixed | other pages above fixed |")
    for case in cases.split(","):
        n, depth, key = int(case.split(":")[0]), float(case.split(":")[1]), int(case.split(":")[2])
        text = passkey_prompt(tok, n, depth, key)
        enc = tok([text], return_offsets_mapping=True, return_tensors="pt")
        start = text.index(_needle(key))
        end = start + len(_needle(key))
        positions = [i for i, (s, e) in enumerate(enc["offset_mapping"][0].tolist()) if s < end and e > start]
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(enc["input_ids"], past_key_values=cache, use_cache=True)
        text_cfg = model.config.get_text_config()
        types = getattr(text_cfg, "layer_types", None) or ["full_attention"] * text_cfg.num_hidden_layers
        keys = [cache.layers[i].keys[0] for i, t in enumerate(types) if t == "full_attention"]
        P = (keys[0].shape[1] - S) // G
        pages = torch.stack([k[:, S : S + P * G].reshape(k.shape[0], P, G, -1).transpose(0, 1) for k in keys])
        needle = sorted({(q - S) // G for q in positions if S <= q < S + P * G})
        alloc = variable_boost(pages)
        for unit in (4, 1):
            counts = alloc[f"page, unit {unit}:counts"]  # [L, P, H]
            c = counts[:, needle].flatten().float()
            nb = cfg.num_boosted(pages.shape[-1])
            share = [float(v.float().mean()) for v in (c > nb, c == nb, c < nb)]
            others = float((counts[:, [j for j in range(P) if j not in needle]] > nb).float().mean())
            print(
                f"| {n}@{depth}#{key} | {needle} of {P} | {unit} | {c.min():.0f} / {c.median():.0f} / {c.max():.0f}"
                f" (fixed {nb}) | {share[0]:.0%} / {share[1]:.0%} / {share[2]:.0%} | {others:.0%} |"
            )


if __name__ == "__main__":
    main()
