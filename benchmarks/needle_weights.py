"""The weights and bounds ``key_range="fit-attn-token-bound"`` gives a passkey needle's tokens (a diagnostic for
``docs/PRESETS_RESEARCH.md``, not a quantizer).

Each prompt goes through a prefill with the given config, which packs the prompt's key pages one call per layer
(``kitty.cache.layer``); ``kitty.core.ranges.token_bound_steps`` is wrapped to record each call's weights
(:func:`kitty.core.attnfit.attention_weights`, the mean query's attention within the page times ``G``) and bounds.
Printed per prompt, for the needle's tokens (``kitty.tools.prompts._needle``, located by the tokenizer's character
offsets) and, for comparison, every token of the needle's pages: the median weight, its rank among the page's tokens,
and the share of (layer, head, token) bounds at half a step and at one step.

    python benchmarks/needle_weights.py --model gemma-3-270m --cases 2048:0.3:76150,2048:0.5:28316

``--observed`` (with a ``--method`` whose cache records the prompt's attention, ``kitty.core.attnfit.ATTN_MAX_RANGES``)
screens statistics of each token's page-local attention over the prompt queries that saw it
(:func:`observed_statistics`), each divided by its mean over the page: ``max`` (what ``fit-attn-max-rel-bound``
weights with), ``sum`` (the attention mass the token receives) and ``top64`` (the mean of its 64 largest
(query, query head) attentions, a high quantile's stand-in). Each goes through ``token_bound_steps`` on the page's
key rows as the rule would; printed per prompt and statistic, for the needle's tokens and for the other tokens of its
pages: the median weight, the median rank within the page, and the share of bounds at half a step and looser.
``--show`` adds each needle token's median rank and bound, and the best-ranked tokens of the needle's pages.

    python benchmarks/needle_weights.py --model gemma-3-270m --observed \
        --method kitty-fit+key_range=fit-attn-max-rel-token-bound --cases 2048:0.3:76150
"""

from __future__ import annotations

import argparse

import torch

import kitty.cache.layer as layer
import kitty.core.ranges as ranges
from kitty.core.attnfit import visible_page_weights
from kitty.core.config import get_preset
from kitty.hf import generate as gen
from kitty.hf.models import load_model
from kitty.tools.prompts import needle_positions

CALLS: list[tuple[torch.Tensor, torch.Tensor]] = []  # (weights, bounds) [pages, H, 1, G] of each recorded call
_bounds = ranges.token_bound_steps


def _recording(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    steps = _bounds(x, weight)
    if x.dim() == 4:  # a prefill's batch of pages [pages, H, D, G]
        CALLS.append((weight.float().clone(), steps.clone()))
    return steps


TOP_K = 64  # the top-k mean's k: (query, query head) pairs per token
STATS = ("max", "sum", f"top{TOP_K}")
# --observed: the statistics [H, L] of the last observed_page_attention call, and per recorded page fit
# {statistic: (weights, bounds)} [pages, H, 1, G]
PENDING: dict[str, torch.Tensor] = {}
OBSERVED: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []


def observed_statistics(
    query: torch.Tensor,
    keys: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    group_size: int,
    scale: float,
    chunk: int = 256,
) -> dict[str, torch.Tensor]:
    """Per key ``[H, L]`` fp32: the largest, the summed and the mean of the ``TOP_K`` largest page-local attentions
    (:func:`kitty.core.attnfit.visible_page_weights`, causal) over the GQA group's query heads and the queries, the
    arguments as :func:`kitty.core.attnfit.observed_page_attention` (whose maximum ``max`` equals). A key seen by fewer
    than ``TOP_K`` (query, head) pairs counts the missing ones as 0."""
    Hq, T, D = query.shape
    H, L, _ = keys.shape
    P = -(-L // group_size)
    pad = P * group_size - L
    kf = torch.nn.functional.pad(keys.float(), (0, 0, 0, pad))
    q = query.float().reshape(H, Hq // H, T, D)
    kpos = key_pos.to(torch.int64)
    kpos = torch.cat([kpos, kpos.new_full((pad,), torch.iinfo(torch.int64).max)])
    qpos = query_pos.to(torch.int64)
    n_all = P * group_size
    best = torch.zeros(H, n_all)
    total = torch.zeros(H, n_all)
    top = torch.zeros(H, TOP_K, n_all)
    for a in range(0, T, chunk):
        qc, pos = q[:, :, a : a + chunk], qpos[a : a + chunk]
        n = -(-int((kpos <= pos.max()).sum()) // group_size) * group_size
        if n == 0:
            continue
        c = qc.shape[2]
        logits = torch.einsum("hgcd,hld->hgcl", qc, kf[:, :n]) * scale
        seen = kpos[None, :n] <= pos[:, None]
        w = visible_page_weights(
            logits.reshape(H, -1, c, n // group_size, group_size), seen.reshape(c, -1, group_size)[None, None]
        ).reshape(H, -1, n)  # (H, g * c, n)
        best[:, :n] = torch.maximum(best[:, :n], w.amax(1))
        total[:, :n] += w.sum(1)
        top[:, :, :n] = torch.cat([top[:, :, :n], w], 1).topk(TOP_K, 1).values
    return {"max": best[:, :L], "sum": total[:, :L], f"top{TOP_K}": top.mean(1)[:, :L]}


def _observed(query, keys, query_pos, key_pos, group_size, scale, chunk=256):
    stats = observed_statistics(query, keys, query_pos, key_pos, group_size, scale)
    PENDING.clear()
    PENDING.update(stats)
    return stats["max"]


def _recording_observed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The first page fit after each prompt's attention pass: every statistic's per-page weights and bounds."""
    if x.dim() == 4 and PENDING:
        P, H, _, G = x.shape
        fit = {}
        for name, stat in PENDING.items():
            w = stat[:, : P * G].reshape(H, P, G).transpose(0, 1)[:, :, None, :]  # (P, H, 1, G)
            mean = w.mean(-1, keepdim=True)
            w = torch.where(mean > 0, w / torch.where(mean > 0, mean, 1.0), 1.0)
            fit[name] = (w, _bounds(x, w))
        OBSERVED.append(fit)
        PENDING.clear()
    return _bounds(x, weight)


def _screen(a: argparse.Namespace, model, tok, cfg) -> None:
    """``--observed``: per prompt and statistic, the needle's tokens against the other tokens of its pages."""
    S, G = cfg.sink_tokens, cfg.group_size
    layer.observed_page_attention = _observed
    ranges.token_bound_steps = _recording_observed
    print("| prompt | statistic | tokens | median weight | median rank of 128 (1: highest) | bounds at 0.5 / looser |")
    print("|---|---|---|---|---|---|")
    for case in a.cases.split(","):
        _, enc, positions = needle_positions(tok, case)
        n, depth, key = case.split(":")
        OBSERVED.clear()
        with torch.no_grad():
            gen.prefill(model, enc["input_ids"], gen.make_cache(model, cfg))
        pages = sorted({(q - S) // G for q in positions if q >= S})
        needle = set(positions)
        others = [S + j * G + t for j in pages for t in range(G) if S + j * G + t not in needle]
        for name in STATS:
            for label, chosen in (("needle", positions), ("its pages' others", others)):
                w, b, r = [], [], []
                for fit in OBSERVED:
                    weight, steps = fit[name]
                    rank = (-weight).argsort(-1).argsort(-1) + 1
                    for q in chosen:
                        j, t = (q - S) // G, (q - S) % G
                        if 0 <= j < weight.shape[0]:
                            w.append(weight[j, :, 0, t]), b.append(steps[j, :, 0, t])
                            r.append(rank[j, :, 0, t].float())
                w, b, r = torch.cat(w), torch.cat(b), torch.cat(r)
                print(
                    f"| {n}@{depth}#{key} | {name} | {label} ({len(chosen)}) | {w.median():.2f} | {r.median():.0f} | "
                    f"{(b == 0.5).float().mean():.0%} / {(b > 0.5).float().mean():.0%} |",
                    flush=True,
                )
        if a.show:
            _show(tok, enc["input_ids"][0], S, G, positions, pages, f"{n}@{depth}#{key}")


def _show(tok, ids: torch.Tensor, S: int, G: int, positions: list[int], pages: list[int], label: str) -> None:
    """``--show``: each needle token's median rank in its page and median bound (min-max steps) per statistic, and
    the 5 best-ranked tokens of each of the needle's pages (medians over the recorded fits and heads)."""

    def median_rank(name: str, q: int) -> float:
        j, t = (q - S) // G, (q - S) % G
        r = [(-fit[name][0]).argsort(-1).argsort(-1)[j, :, 0, t].float() + 1 for fit in OBSERVED]
        return float(torch.cat(r).median())

    def median_bound(name: str, q: int) -> float:
        j, t = (q - S) // G, (q - S) % G
        return float(torch.cat([fit[name][1][j, :, 0, t] for fit in OBSERVED]).median())

    for name in STATS:
        needle = " ".join(
            f"{tok.decode([int(ids[q])])!r}:{median_rank(name, q):.0f}/{median_bound(name, q):.2f}"
            for q in positions
            if q >= S
        )
        print(f"{label} {name} needle rank/bound: {needle}")
        for j in pages:
            ranked = sorted(range(S + j * G, S + (j + 1) * G), key=lambda q: median_rank(name, q))[:5]
            best = " ".join(f"{tok.decode([int(ids[q])])!r}@{(q - S) % G}:{median_rank(name, q):.0f}" for q in ranked)
            print(f"{label} {name} page {j} best (token@offset:rank): {best}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--method", default="kitty-fit+key_range=fit-attn-token-bound")
    p.add_argument("--cases", required=True, help="length:depth:key,... (passkey_prompt's arguments)")
    p.add_argument("--observed", action="store_true", help="screen the observed-attention statistics (docstring)")
    p.add_argument("--show", action="store_true", help="with --observed: the needle's tokens and the pages' best")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(a.model)
    cfg = get_preset(a.method)
    if a.observed:
        return _screen(a, model, tok, cfg)
    S, G = cfg.sink_tokens, cfg.group_size
    ranges.token_bound_steps = _recording
    print("| prompt | tokens | median weight | median rank of 128 (1: most attended) | bounds at 0.5 / at 1 step |")
    print("|---|---|---|---|---|")
    for case in a.cases.split(","):
        _, enc, positions = needle_positions(tok, case)
        n, depth, key = case.split(":")  # for the table's label
        CALLS.clear()
        with torch.no_grad():
            gen.prefill(model, enc["input_ids"], gen.make_cache(model, cfg))
        pages = sorted({(q - S) // G for q in positions if q >= S})
        for label, chosen in (("needle", positions), ("its pages", [S + j * G + t for j in pages for t in range(G)])):
            w, b, r = [], [], []
            for weight, steps in CALLS:  # [pages, H, 1, G]
                rank = (-weight).argsort(-1).argsort(-1) + 1  # 1: the page's most attended token
                for q in chosen:
                    j, t = (q - S) // G, (q - S) % G
                    if 0 <= j < weight.shape[0]:
                        w.append(weight[j, :, 0, t]), b.append(steps[j, :, 0, t]), r.append(rank[j, :, 0, t].float())
            w, b, r = torch.cat(w), torch.cat(b), torch.cat(r)
            print(
                f"| {n}@{depth}#{key} | {label} ({len(chosen)}) | {w.median():.2f} | {r.median():.0f} | "
                f"{(b == 0.5).float().mean():.0%} / {(b == 1.0).float().mean():.0%} |"
            )


if __name__ == "__main__":
    main()
