"""Key reconstruction error of real keys under several configs: a fast screen before perplexity and passkeys.

One text window (the eval's first, 1280 tokens of ``kitty/texts/essay.txt``) goes through the model with a
full-precision ``DynamicCache``; the keys of every full-attention layer (Gemma 3: the 3 global layers; sliding layers
hold no Kitty pages) are cut into the 9 pages a Kitty cache would quantize (after the 32 sink tokens), and each config
quantizes and dequantizes them with ``kitty.core.quant``. Printed per config: the relative squared error
``sum |k - k_hat|^2 / sum |k|^2`` averaged over pages and heads, and the largest absolute error of any entry.
Query-aware selections get ``query_scale = 1`` (so ``oracle`` ranks by squared key error alone, not the cache's
running query statistics).

    python benchmarks/key_error.py --model gemma-3-270m --methods kitty,kitty+key_range=fit-peak
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from kitty.core.config import QUERY_SELECTIONS, get_preset
from kitty.core.quant import dequantize_key_page, quantize_key_page
from kitty.hf.models import load_model
from kitty.tools.eval import TEXTS, text_windows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="as for load_model: a packaged model's name, a folder or a hub id")
    p.add_argument("--methods", required=True, help="comma-separated presets (+field=value overrides allowed)")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(a.model)
    window = text_windows(tok, TEXTS, 1024, 256, 1, with_names=True)[0][1]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(window[None, :1280], past_key_values=cache, use_cache=True)
    text = model.config.get_text_config()
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    keys = [cache.layers[i].keys[0] for i, t in enumerate(types) if t == "full_attention"]  # [H, T, D] each
    S, G, n = 32, 128, 9
    pages = torch.stack([k[:, S : S + n * G].reshape(k.shape[0], n, G, -1).transpose(0, 1) for k in keys])
    print(f"{len(keys)} full-attention layers, pages {tuple(pages.shape)} (layer, page, head, G, D), {pages.dtype}")
    ref = pages.float()
    for m in a.methods.split(","):
        cfg = get_preset(m)
        qs = torch.ones(pages.shape[:-2] + pages.shape[-1:]) if cfg.channel_selection in QUERY_SELECTIONS else None
        err = dequantize_key_page(quantize_key_page(pages, cfg, query_scale=qs)).float() - ref
        rel = err.square().sum((-1, -2)) / ref.square().sum((-1, -2))
        print(f"| {m} | {rel.mean():.4f} | {err.abs().amax():.2f} |")


if __name__ == "__main__":
    main()
