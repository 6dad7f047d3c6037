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

The 8-bit form (:func:`log8_scale_zero`): per page and KV head one reference, the largest scale of the page (kept in
the dtype, 16 bits a page and head); each scale rounded *up* to the grid ``ref * 2**(-c/16)``, ``c`` in 0..255 (steps
of 4.4%, 16 octaves below the reference); each zero rounded to the nearest quarter of its own rounded scale, ``zero =
z * scale / 4`` with ``z`` an int8 (within 32 steps of 0; clamped beyond). The codes are then chosen for the rounded
scale and zero, as the pack would.

    python -m benchmarks.value_error                       # the default model
    python -m benchmarks.value_error --model gemma-3-270m
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from kitty.core.ranges import dequantize_codes, minmax_params, quantize_codes
from kitty.hf.models import load_model
from kitty.tools.eval import TEXTS, text_windows

LEVELS = 3  # 2-bit codes
SINK, GROUP, PAGES = 32, 128, 9  # the pages a Kitty cache quantizes in the first 1280 tokens


def log8_scale_zero(scale: torch.Tensor, zero: torch.Tensor, ref_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero)`` as the 8-bit form of the module docstring represents them, in fp32.

    ``scale``, ``zero``: ``[..., n]`` per token (and group); the reference is the largest scale over the last
    ``ref_dims`` dimensions (a page and head's tokens and groups).
    """
    s, z = scale.float(), zero.float()
    dims = tuple(range(-ref_dims, 0))
    ref = s.amax(dims, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    c = torch.floor(-16 * torch.log2(s.clamp_min(ref * 2.0**-16) / ref)).clamp(0, 255)  # rounding down c: scale up
    s8 = torch.where(s > 0, ref * torch.exp2(-c / 16), 0.0)
    z8 = torch.where(s8 > 0, (z / torch.where(s8 > 0, s8, 1.0) * 4).round().clamp(-128, 127) * s8 / 4, z)
    return s8, z8


def clamped_zeros(scale: torch.Tensor, zero: torch.Tensor) -> float:
    """Share of groups whose zero lies beyond the int8's reach (more than 32 of its rounded steps from 0)."""
    return (
        ((zero.float() / scale.float().clamp_min(torch.finfo(torch.float32).tiny) * 4).round().abs() > 127)
        .float()
        .mean()
        .item()
    )


def value_rows(
    values: torch.Tensor, dtype: torch.dtype, groups: list[int]
) -> list[tuple[str, float, float, float, float]]:
    """``(label, relative squared error, largest error, bits per element, share of zeros clamped)`` of each form.

    ``values``: ``[layers, pages, heads, G, D]`` in the model's ``dtype``.
    """
    ref = values.float()
    D = values.shape[-1]
    rows = []
    for g in groups:
        x = values.reshape(*values.shape[:-1], D // g, g)  # [..., G, D/g, g]: one group per token and g channels
        scale, zero = minmax_params(x, LEVELS, -1, dtype)
        s8, z8 = log8_scale_zero(scale, zero, 2)  # reference over the page's tokens and groups
        forms = [("dtype", scale.float(), zero.float(), 16, 0.0), ("8-bit", s8, z8, 8, clamped_zeros(s8, zero))]
        for name, s, z, bits, clamped in forms:
            codes = quantize_codes(x, s[..., None], z[..., None], LEVELS)
            err = dequantize_codes(codes, s[..., None], z[..., None], torch.float32).reshape(ref.shape) - ref
            page_bits = 2 + 2 * bits / g + (16 / (GROUP * D) if bits == 8 else 0)
            label = f"{D // g} group{'s' if D // g > 1 else ''} of {g}, scale and zero in {name}"
            rel = (err.square().sum() / ref.square().sum()).item()
            rows.append((label, rel, err.abs().max().item(), page_bits, clamped))
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
    text = model.config.get_text_config()
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    vals = [cache.layers[i].values[0] for i in full]  # [H, T, D] each
    end = SINK + PAGES * GROUP
    pages = torch.stack([v[:, SINK:end].reshape(v.shape[0], PAGES, GROUP, -1).transpose(0, 1) for v in vals])
    D = pages.shape[-1]
    groups = [int(g) for g in a.groups.split(",")] if a.groups else [D, D // 2, D // 4]
    print(
        f"{len(vals)} full-attention layers, value pages {tuple(pages.shape)} (layer, page, head, G, D), {pages.dtype}"
    )
    print("| value groups | relative squared error | largest error | value page bits/element | zeros clamped |")
    print("|---|---|---|---|---|")
    for label, rel, top, bits, clamped in value_rows(pages, pages.dtype, groups):
        print(f"| {label} | {rel:.4f} | {top:.3f} | {bits:.4f} | {clamped:.2%} |")


if __name__ == "__main__":
    main()
