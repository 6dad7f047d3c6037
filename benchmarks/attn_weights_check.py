"""Do fit-attn's token weights predict which tokens of a page later queries attend? A check of the weight model.

One text window (the eval's first, 1280 tokens of ``kitty/texts/essay.txt``) goes through the model in full precision
while the queries of every full-attention layer are recorded (after RoPE). For each of the 9 pages after the 32 sink
tokens and each KV head, the *actual* weights are the attention the 96 queries after the pages (positions 1184-1279,
averaged over them and the GQA group) give the page's tokens, renormalized within the page; the *predicted* weights
come from the queries a cache has seen when the page completes (positions before its end):

- ``gauss``: a zero-mean Gaussian query with the oracle's per-channel ``E[q^2]``:
  ``softmax_t(tau^2 / 2 * sum_c E[q_c^2] (k_ct - kbar_c)^2)``;
- ``mean``: the mean query, ``softmax_t(tau * qbar . k_t)`` (what ``kitty.core.attnfit.attention_weights`` computes).

Printed per rule: the Spearman rank correlation of predicted and actual weights (median and mean over pages and
heads) and both effective sample sizes ``(sum w)^2 / sum w^2`` (of 128 tokens).

    python benchmarks/attn_weights_check.py --model gemma-3-270m
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kitty.hf.models import load_model
from kitty.tools.eval import TEXTS, text_windows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="as for load_model: a packaged model's name, a folder or a hub id")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(a.model)
    window = text_windows(tok, TEXTS, 1024, 256, 1, with_names=True)[0][1]
    queries = {}

    def record(module, query, key, value, attention_mask, **kw):
        queries[module.layer_idx] = (query[0].detach(), kw.get("scaling") or query.shape[-1] ** -0.5)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("weights_check", record)
    AttentionMaskInterface.register("weights_check", sdpa_mask)
    model.set_attn_implementation("weights_check")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(window[None, :1280], past_key_values=cache, use_cache=True)
    text = model.config.get_text_config()
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    S, G, n = 32, 128, 9
    start = S + n * G
    stats = {rule: ([], []) for rule in ("gauss", "mean")}  # rule -> (Spearman per page and head, predicted ESS)
    actual_ess = []

    def ess(w: torch.Tensor) -> float:
        return float((w.sum(-1).square() / w.square().sum(-1)).mean())

    for i in (i for i, t in enumerate(types) if t == "full_attention"):
        k = cache.layers[i].keys[0].float()
        H, T, D = k.shape
        q, scale = queries[i]
        q = q.float().reshape(H, -1, T, D)
        mask = torch.arange(T)[None, :] > torch.arange(start, T)[:, None]
        logits = torch.einsum("hgqd,htd->hgqt", q[:, :, start:], k) * scale
        attn = torch.softmax(logits.masked_fill(mask, float("-inf")), -1).mean((1, 2))  # [H, T]
        for j in range(n):
            page = slice(S + j * G, S + (j + 1) * G)
            act = attn[:, page] / attn[:, page].sum(-1, keepdim=True)
            actual_ess.append(ess(act))
            seen = q[:, :, : S + (j + 1) * G]
            dev = k[:, page] - k[:, page].mean(1, keepdim=True)
            pred = {
                "gauss": 0.5 * scale**2 * (dev.square() * seen.square().mean((1, 2))[:, None]).sum(-1),
                "mean": torch.einsum("hd,htd->ht", seen.mean((1, 2)), k[:, page]) * scale,
            }
            for rule, lw in pred.items():
                w = torch.softmax(lw, -1)
                stats[rule][1].append(ess(w))
                for h in range(H):
                    ranks = torch.stack([w[h].argsort().argsort(), act[h].argsort().argsort()]).float()
                    stats[rule][0].append(float(torch.corrcoef(ranks)[0, 1]))
    for rule, (cors, ess_pred) in stats.items():
        print(
            f"| {rule} | {statistics.median(cors):+.2f} | {statistics.mean(cors):+.2f} | "
            f"{statistics.mean(ess_pred):.1f} | {statistics.mean(actual_ess):.1f} |"
        )


if __name__ == "__main__":
    main()
