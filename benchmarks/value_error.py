"""Value reconstruction error of real values with their scales and zeros in 8 bits: a screen of re-spending the bytes.

A value page stores, per token, a scale and a zero in the model's dtype: at head_dim 64 those take 0.5 of the 2.5 bits
a quantized value costs, more than the whole boost of ``kitty``'s keys (0.25 bits per key element). This screen asks
what the same bytes buy if each token's scale and zero are kept in 8 bits each instead, either saved or spent on
smaller groups (each token's channels in groups of ``g``, a scale and a zero per group).

One text window (the eval's first, 1280 tokens of ``kitty/texts/essay.txt``) goes through the model with a
full-precision ``DynamicCache``; the values of every full-attention layer are cut into the 9 pages after the 32 sink
tokens, as ``benchmarks/key_error.py`` does for keys. Each row quantizes every token of those pages to 2 bits with
min-max ranges over its group of channels, and prints the relative squared error ``sum |v - v_hat|^2 / sum |v|^2``
(over all pages, heads and layers), the largest absolute error, and the value page's bits per element.

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
from kitty.core.quant import decode_value_meta8, encode_value_meta8
from kitty.core.ranges import dequantize_codes, minmax_params, quantize_codes
from kitty.hf.models import load_model
from kitty.tools.eval import TEXTS, text_windows

LEVELS = 3  # 2-bit codes
SINK, GROUP, PAGES = 32, 128, 9  # the pages a Kitty cache quantizes in the first 1280 tokens


def value_rows(
    values: torch.Tensor, dtype: torch.dtype, groups: list[int]
) -> list[tuple[str, float, float, float, float]]:
    """``(label, relative squared error, largest error, bits per element, share of zeros widened)`` of each form.

    ``values``: ``[layers, pages, heads, G, D]`` in the model's ``dtype``.
    """
    ref = values.float()
    D = values.shape[-1]
    rows = []
    for g in groups:
        x = values.reshape(*values.shape[:-1], D // g, g)  # [..., G, D/g, g]: one group per token and g channels
        scale, zero = minmax_params(x, LEVELS, -1, dtype)
        c, zq, top = encode_value_meta8(scale, zero)  # the reference over each page's tokens and groups
        s8, z8 = decode_value_meta8(c, zq, top)
        widened = (s8 > scale.float() * 2 ** (1 / 16) * (1 + 1e-6)).float().mean().item()
        forms = [("dtype", scale.float(), zero.float(), 16, 0.0), ("8-bit", s8, z8, 8, widened)]
        for name, s, z, bits, widened_share in forms:
            codes = quantize_codes(x, s[..., None], z[..., None], LEVELS)
            err = dequantize_codes(codes, s[..., None], z[..., None], torch.float32).reshape(ref.shape) - ref
            page_bits = 2 + 2 * bits / g + (16 / (GROUP * D) if bits == 8 else 0)
            label = f"{D // g} group{'s' if D // g > 1 else ''} of {g}, scale and zero in {name}"
            rel = (err.square().sum() / ref.square().sum()).item()
            rows.append((label, rel, err.abs().max().item(), page_bits, widened_share))
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
    for label, rel, top, bits, widened in value_rows(pages, pages.dtype, groups):
        print(f"| {label} | {rel:.4f} | {top:.3f} | {bits:.4f} | {widened:.2%} |")


if __name__ == "__main__":
    main()
