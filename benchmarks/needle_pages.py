"""Which key pages does a passkey's retrieval depend on? The needle's own pages under one range rule, the rest under
another (a diagnostic for ``docs/PRESETS_RESEARCH.md``, not a quantizer).

For each prompt, the key pages that hold the needle's tokens (``kitty.tools.prompts._needle``, located by the
tokenizer's character offsets; page ``j`` covers positions ``S + j G .. S + (j + 1) G - 1``) are quantized with one
config and every other key page with another, and the greedy answer is read as the eval does
(``kitty.tools.eval_metrics.passkey_answer``). The prompt's pages are all packed in one ``quantize_key_page`` call per
layer at prefill (``kitty.cache.layer``); this script replaces that module's name with a wrapper that quantizes the
batch of pages both ways and keeps, per page, the one asked for. Both configs must store the same fields (same bits,
no outliers). Pages packed later (during the answer) use the cache's config.

    python benchmarks/needle_pages.py --model gemma-3-270m --minmax kitty-fit+key_range=minmax \\
        --fitted kitty-fit+key_range=fit-bounded --cases 2048:0.5:46941,2048:0.7:91050,4096:0.1:29262
"""

from __future__ import annotations

import argparse

import torch

import kitty.cache.layer as layer_module
from kitty.core.config import get_preset
from kitty.hf.models import load_model
from kitty.tools.eval_metrics import passkey_answer
from kitty.tools.prompts import _needle, passkey_prompt

PLAN: dict = {"other": None, "pages": []}  # the config of the needle's pages (None: the cache's) and their indices
_quantize = layer_module.quantize_key_page


def _mixed_pages(k, cfg, salt=0, boost_mask=None, query_scale=None, sync_free=False):
    """``quantize_key_page`` of ``kitty.cache.layer``, with the pages in ``PLAN["pages"]`` quantized by
    ``PLAN["other"]`` instead of ``cfg`` (a batch ``[pages, H, G, D]`` of one row, as prefill packs it)."""
    page = _quantize(k, cfg, salt=salt, boost_mask=boost_mask, query_scale=query_scale, sync_free=sync_free)
    if PLAN["other"] is None or k.dim() != 4:
        return page
    other = _quantize(k, PLAN["other"], salt=salt, boost_mask=boost_mask, query_scale=query_scale, sync_free=sync_free)
    chosen = torch.zeros(k.shape[0], dtype=torch.bool)
    chosen[[j for j in PLAN["pages"] if j < k.shape[0]]] = True
    for name, t in page.tensors().items():
        if t.numel():
            t[chosen] = getattr(other, name)[chosen]
    return page


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--minmax", default="kitty-fit+key_range=minmax")
    p.add_argument("--fitted", default="kitty-fit+key_range=fit-bounded")
    p.add_argument("--cases", required=True, help="length:depth:key,... (passkey_prompt's arguments)")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(a.model)
    layer_module.quantize_key_page = _mixed_pages
    mm, fit = get_preset(a.minmax), get_preset(a.fitted)
    for case in a.cases.split(","):
        n, depth, key = int(case.split(":")[0]), float(case.split(":")[1]), int(case.split(":")[2])
        text = passkey_prompt(tok, n, depth, key)
        enc = tok([text], return_offsets_mapping=True)
        start = text.index(_needle(key))
        end = start + len(_needle(key))
        positions = [i for i, (s, e) in enumerate(enc["offset_mapping"][0]) if s < end and e > start]
        cfg = mm
        S, G = cfg.sink_tokens, cfg.group_size
        PLAN["pages"] = sorted({(q - S) // G for q in positions if q >= S})
        total = (len(enc["input_ids"][0]) - S) // G
        for base, needle, what in (
            (mm, None, "min-max everywhere"),
            (fit, None, "fitted everywhere"),
            (fit, mm, "fitted, the needle's pages min-max"),
            (mm, fit, "min-max, the needle's pages fitted"),
        ):
            PLAN["other"] = needle
            answer = passkey_answer(model, tok, text, base)
            print(f"| {n}@{depth}#{key} | {PLAN['pages']} of {total} | {what} | {answer!r} | {str(key) in answer} |")


if __name__ == "__main__":
    main()
