"""Hybrid models: Kitty pages on full-attention layers, transformers' full-precision window on sliding ones.

Tiny random-weight Gemma 3 (sliding, sliding, full), Mistral with ``sliding_window`` (every layer sliding) and
Qwen2 with sliding layers (full, sliding), in fp32, with a window of W=16 columns and tiny Kitty sizes (S=4, G=8,
R=8) so that generation crosses the window boundary and fills pages within a few dozen tokens.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from fixtures import W, tiny_config, tiny_model
from transformers import DynamicCache

from kitty import PRESETS, KittyCache, analytic_report
from kitty.cache.layer import KittyLayer
from kitty.cache.window import SlidingWindowLayer
from kitty.hf.compat import cache_kwargs

SMALL = {name: PRESETS[name].with_(sink_tokens=4, group_size=8, local_window=8) for name in ("fp16", "kitty")}


def build(family: str) -> torch.nn.Module:
    return tiny_model(family)  # seed 0; gemma3: sliding, sliding, full; mistral: all sliding; qwen2: full, sliding


def kitty_cache(model, name: str) -> KittyCache:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the all-sliding Mistral warns that nothing is quantized
        return KittyCache(model.config, SMALL[name])


def generate(model, ids, cache, mask=None, n: int = 24):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        **cache_kwargs(cache),
        max_new_tokens=n,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )


@pytest.mark.parametrize("family", ["gemma3", "mistral", "qwen2"])
def test_fp16_equals_dynamic_cache_across_the_window(family):
    """fp16: the same greedy tokens and logits as DynamicCache, 11 prompt + 24 new tokens with a 16-token window."""
    model = build(family)
    ids = torch.randint(1, 128, (1, 11), generator=torch.Generator().manual_seed(1))
    ref = generate(model, ids, DynamicCache(config=model.config))
    cache = kitty_cache(model, "fp16")
    out = generate(model, ids, cache)
    assert out.sequences.tolist() == ref.sequences.tolist()
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), rtol=1e-4, atol=1e-4)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [SlidingWindowLayer if t == "sliding_attention" else KittyLayer for t in cache.layer_types]
    assert SlidingWindowLayer in kinds
    sliding = next(layer for layer in cache.layers if isinstance(layer, SlidingWindowLayer))
    assert sliding.cumulative_length == 11 + 23 > W and sliding.keys.shape[2] == W - 1  # the window has moved on


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_padded_batch_rows_equal_alone_and_windows_stay_bounded(family, monkeypatch):
    """kitty (pages really filled on full layers): each row of a left-padded batch generates what it does alone;
    no sliding layer ever holds more than W - 1 columns; the memory report counts pages and windows."""
    model = build(family)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 128, (n,), generator=gen) for n in (23, 9)]
    held = []
    update = SlidingWindowLayer.update

    def recording_update(self, *args, **kwargs):
        out = update(self, *args, **kwargs)
        held.append(self.keys.shape[2])
        return out

    monkeypatch.setattr(SlidingWindowLayer, "update", recording_update)
    alone = [
        generate(model, p[None], kitty_cache(model, "kitty"), n=16).sequences[0, len(p) :].tolist() for p in prompts
    ]
    L = max(len(p) for p in prompts)
    ids = torch.zeros(2, L, dtype=torch.long)
    mask = torch.zeros(2, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p) :], mask[b, L - len(p) :] = p, 1
    cache = kitty_cache(model, "kitty")
    out = generate(model, ids, cache, mask, n=16).sequences[:, L:].tolist()
    assert out == alone
    assert held and max(held) <= W - 1

    report = cache.memory_report()
    sliding = [layer for layer in cache.layers if isinstance(layer, SlidingWindowLayer)]
    assert report.window_bytes == sum(layer.keys.nbytes + layer.values.nbytes for layer in sliding) > 0
    full = [layer for layer in cache.layers if isinstance(layer, KittyLayer)]
    if full:  # Gemma 3: its full layer holds pages, counted as the layout formula says
        assert cache.lengths == [len(p) + 15 for p in prompts]
        assert cache.token_counts()["key_pages"] > 0
        paged = analytic_report(SMALL["kitty"], cache.lengths, 16, 2, len(full), 4)
        assert (report.payload_bytes, report.metadata_bytes, report.full_precision_bytes) == (
            paged.payload_bytes,
            paged.metadata_bytes,
            paged.full_precision_bytes,
        )
        assert report.stored_bytes == paged.stored_bytes + report.window_bytes


def test_bad_hybrid_configs_raise_before_any_work():
    with pytest.raises(ValueError, match="sliding_window"):
        KittyCache(tiny_config("mistral", sliding_window=1), "kitty")  # would keep every column
    config = tiny_config()
    config.layer_types, config.attention_chunk_size = ["chunked_attention", "full_attention"], 8
    with pytest.raises(ValueError, match="chunked_attention"):
        KittyCache(config, "kitty")
    with pytest.warns(UserWarning, match="quantizes nothing"):
        KittyCache(tiny_config("mistral"), "kitty")


def test_failure_in_a_later_full_layer_restores_the_windows(monkeypatch):
    """Gemma 3 here runs sliding, sliding, full: a failure in the full layer's step puts the windows the same forward
    pass already updated back as they were."""
    model = build("gemma3")
    cache = kitty_cache(model, "kitty")
    ids = torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids, **cache_kwargs(cache), use_cache=True)
    windows = [
        (layer.keys.clone(), layer.values.clone(), layer.cumulative_length)
        for layer in cache.layers
        if isinstance(layer, SlidingWindowLayer)
    ]
    assert windows

    def fail(self, valid):
        raise RuntimeError("injected")

    monkeypatch.setattr(KittyLayer, "check_append", fail)
    with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
        model(ids[:, :1], **cache_kwargs(cache), use_cache=True)
    after = [layer for layer in cache.layers if isinstance(layer, SlidingWindowLayer)]
    for (k, v, n), layer in zip(windows, after):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v) and layer.cumulative_length == n
