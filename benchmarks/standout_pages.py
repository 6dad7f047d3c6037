"""Do the needle's tokens stand out? The standout test of ``key_range="fit-standout"`` on a passkey prompt's key pages
(a diagnostic for ``docs/PRESETS_RESEARCH.md``, run after the fact: the threshold is not chosen here).

Each prompt goes through the model with a full-precision ``DynamicCache``; the keys of every full-attention layer are
cut into the pages a Kitty cache quantizes (after the sink), and each channel row gets its standout score
(``kitty.core.standout.standout_score``). Printed per prompt, for the needle's pages (located as
``benchmarks/needle_pages.py`` does) and for the other pages: the share of channel rows whose score passes each
threshold, and the share of rows whose extreme (largest ``|x - median|``) is a needle token, with their median score;
then for the token test of ``fit-token-standout`` (``kitty.core.standout.standout_tokens``) at each threshold, the
share of the needle's tokens and of the other tokens that stand out, and the share of rows it keeps min-max.

    python benchmarks/standout_pages.py --model gemma-3-270m --cases 2048:0.5:46941 --thresholds 3,4
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from kitty.core.config import get_preset
from kitty.core.standout import standout_score, standout_tokens, token_standout_rows
from kitty.hf.models import load_model
from kitty.tools.prompts import needle_positions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--cases", required=True, help="length:depth:key,... (passkey_prompt's arguments)")
    p.add_argument("--thresholds", default="3,4")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(a.model)
    cfg = get_preset("kitty")
    S, G = cfg.sink_tokens, cfg.group_size
    thresholds = [float(t) for t in a.thresholds.split(",")]
    text_cfg = model.config.get_text_config()
    types = getattr(text_cfg, "layer_types", None) or ["full_attention"] * text_cfg.num_hidden_layers
    for case in a.cases.split(","):
        _, enc, needle = needle_positions(tok, case)
        n, depth, key = case.split(":")  # for the table's label
        pages = (enc["input_ids"].shape[1] - S) // G
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(enc["input_ids"], past_key_values=cache, use_cache=True)
        keys = [cache.layers[i].keys[0] for i, t in enumerate(types) if t == "full_attention"]  # [H, T, D]
        x = torch.stack([k[:, S : S + pages * G].reshape(k.shape[0], pages, G, -1) for k in keys])  # L, H, P, G, D
        rows = x.float().transpose(-1, -2)  # [L, H, P, D, G]
        score = standout_score(rows)
        dev = (rows - rows.median(-1, keepdim=True).values).abs()
        top = S + torch.arange(pages)[:, None] * G + dev.argmax(-1)  # position of each row's extreme
        is_needle = torch.isin(top, torch.tensor(needle))
        on = torch.zeros(pages, dtype=torch.bool)
        on[sorted({(q - S) // G for q in needle if S <= q < S + pages * G})] = True
        for part, sel in (("needle's pages", on), ("other pages", ~on)):
            s, nd = score[:, :, sel], is_needle[:, :, sel]
            shares = ", ".join(f"> {t:g}: {(s > t).float().mean():.1%}" for t in thresholds)
            med = s[nd].median().item() if nd.any() else float("nan")
            print(
                f"| {n}@{depth}#{key} | {part} ({int(sel.sum())} of {pages}) | {shares} | "
                f"extreme is a needle token: {nd.float().mean():.1%} (median score {med:.2f}) |"
            )
        pos = S + torch.arange(pages)[:, None] * G + torch.arange(G)  # [P, G] positions
        in_needle = torch.isin(pos, torch.tensor(needle))
        for t in thresholds:
            tokens = standout_tokens(rows, t)  # [L, H, P, G]
            kept = token_standout_rows(rows, t)  # [L, H, P, D]
            mine, rest = tokens[..., in_needle].float().mean(), tokens[..., ~in_needle].float().mean()
            print(
                f"| {n}@{depth}#{key} | token test > {t:g} | "
                f"needle tokens standing out: {mine:.1%}, other tokens: {rest:.1%} "
                f"| rows min-max: needle's pages {kept[:, :, on].float().mean():.1%}, "
                f"other pages {kept[:, :, ~on].float().mean():.1%} |"
            )


if __name__ == "__main__":
    main()
