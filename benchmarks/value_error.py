"""Value reconstruction error of real values with their scales and zeros in 8 bits: a screen of re-spending the bytes.

A value page stores, per token, a scale and a zero in the model's dtype: at head_dim 64 those take 0.5 of the 2.5 bits
a quantized value costs, more than the whole boost of ``kitty``'s keys (0.25 bits per key element). This screen asks
what the same bytes buy if each token's scale and zero are kept in 8 bits each instead, either saved or spent on
smaller groups (each token's channels in groups of ``g``, a scale and a zero per group).

One text window (the eval's first, 1280 tokens of ``kitty/texts/essay.txt``) goes through the model with a
full-precision ``DynamicCache``; the values of every full-attention layer are cut into the 9 pages after the 32 sink
tokens, as ``benchmarks/key_error.py`` does for keys. Each row quantizes those pages with the cache's own value
quantizer (``kitty.core.quant.quantize_value_page``: 2 bits, min-max ranges over each token's group of channels) and
prints the relative squared error ``sum |v - v_hat|^2 / sum |v|^2`` (over all pages, heads and layers), the largest
absolute error, and the value page's bits per element (``kitty.core.memory.asymptotic_bits``).

The 8-bit form is the cache's (``value_scale_bits=8``, :func:`kitty.core.quant.encode_value_meta8`): per page and
KV head one reference in the dtype; each group's step the smallest of the grid ``ref * 2**(-c/16)`` (``c`` a uint8)
at least its scale, widened where needed so that its zero, rounded to a quarter step (an int8), lies within 31.75
steps of 0 ("zeros widened": the share of groups where that happened). The codes are then chosen for the stored step
and zero, as the pack does.

    python -m benchmarks.value_error                       # the default model
    python -m benchmarks.value_error --model gemma-3-270m
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from benchmarks.key_error import full_attention_pages
from kitty.core.config import get_preset
from kitty.core.memory import asymptotic_bits
from kitty.core.quant import dequantize_value_page, quantize_value_page, value_group_params
from kitty.hf.models import load_model
from kitty.tools.eval import TEXTS, text_windows

SINK, GROUP, PAGES = 32, 128, 9  # the pages a Kitty cache quantizes in the first 1280 tokens


def value_rows(values: torch.Tensor, channels: list[int]) -> list[tuple[str, float, float, float, float]]:
    """``(label, relative squared error, largest error, bits per element, share of steps widened)`` of each form:
    for each group width in ``channels``, the cache's value page (``value_groups = D / width``) with scales and zeros
    in the dtype, then in 8 bits (``value_scale_bits=8``). Widened: 8-bit steps more than one grid step above the
    dtype scale (a zero that needed room).

    ``values``: ``[layers, pages, heads, G, D]`` in the model's dtype.
    """
    ref = values.float()
    D = values.shape[-1]
    rows = []
    for g in channels:
        pages = {}
        for name, bits in (("dtype", 16), ("8-bit", 8)):
            cfg = get_preset(f"kitty+value_groups={D // g}+value_scale_bits={bits}")
            pages[bits] = page = quantize_value_page(values, cfg)
            err = dequantize_value_page(page).float() - ref
            widened = 0.0
            if bits == 8:
                step, scale = value_group_params(page)[0], pages[16].scale.float().reshape(page.scale.shape)
                widened = (step > scale * 2 ** (1 / 16) * (1 + 1e-6)).float().mean().item()
            label = f"{D // g} group{'s' if D // g > 1 else ''} of {g}, scale and zero in {name}"
            rel = (err.square().sum() / ref.square().sum()).item()
            rows.append((label, rel, err.abs().max().item(), asymptotic_bits(cfg, D)["value_total"], widened))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="as for load_model: a packaged model's name, a folder or a hub id")
    p.add_argument("--groups", default=None, help="comma-separated channel counts per group (default D, D/2, D/4)")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(a.model)
    window = text_windows(tok, TEXTS, 1024, 256, 1, with_names=True)[0][1]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(window[None, :1280], past_key_values=cache, use_cache=True)
    full, pages = full_attention_pages(model, cache, "values", SINK, GROUP, PAGES)
    D = pages.shape[-1]
    groups = [int(g) for g in a.groups.split(",")] if a.groups else [D, D // 2, D // 4]
    print(
        f"{len(full)} full-attention layers, value pages {tuple(pages.shape)} (layer, page, head, G, D), {pages.dtype}"
    )
    print("| value groups | relative squared error | largest error | value page bits/element | zeros widened |")
    print("|---|---|---|---|---|")
    for label, rel, top, bits, widened in value_rows(pages, groups):
        print(f"| {label} | {rel:.4f} | {top:.3f} | {bits:.4f} | {widened:.2%} |")


if __name__ == "__main__":
    main()
