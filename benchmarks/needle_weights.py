"""The weights and bounds ``key_range="fit-attn-token-bound"`` gives a passkey needle's tokens (a diagnostic for
``docs/PRESETS_RESEARCH.md``, not a quantizer).

Each prompt goes through a prefill with the given config, which packs the prompt's key pages one call per layer
(``kitty.cache.layer``); ``kitty.core.ranges.token_bound_steps`` is wrapped to record each call's weights
(:func:`kitty.core.attnfit.attention_weights`, the mean query's attention within the page times ``G``) and bounds.
Printed per prompt, for the needle's tokens (``kitty.tools.prompts._needle``, located by the tokenizer's character
offsets) and, for comparison, every token of the needle's pages: the median weight, its rank among the page's tokens,
and the share of (layer, head, token) bounds at half a step and at one step.

    python benchmarks/needle_weights.py --model gemma-3-270m --cases 2048:0.3:76150,2048:0.5:28316
"""

from __future__ import annotations

import argparse

import torch

import kitty.core.ranges as ranges
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--method", default="kitty-fit+key_range=fit-attn-token-bound")
    p.add_argument("--cases", required=True, help="length:depth:key,... (passkey_prompt's arguments)")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(a.model)
    cfg = get_preset(a.method)
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
