"""The generation loop (``kitty.hf.generate``) and prompt preparation (``kitty.tools.prompts``) on the default model.

Expected tokens come from transformers itself: ``model.generate`` with a fresh cache of the same config, greedy.
"""

from __future__ import annotations

import pytest
import torch

from kitty import PRESETS
from kitty.hf.compat import cache_kwargs
from kitty.hf.generate import Sampling, eos_ids, generate_tokens, make_cache, sample_next, stream_tokens
from kitty.tools import prompts as kp

SHORT = "What is the capital of France?"
# small pages so that a short run quantizes: sink 4, pages of 16 tokens, 8 local values
SMALL = PRESETS["kitty"].with_(sink_tokens=4, group_size=16, local_window=8)


def hf_greedy(model, ids: torch.Tensor, cfg, new: int, **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **cache_kwargs(make_cache(model, cfg)),
            max_new_tokens=new,
            do_sample=False,
            **kw,
        )
    return out[0, ids.shape[1] :].tolist()


def test_stream_tokens_is_model_generate_greedy(default_model):
    model, tok = default_model
    ids = kp.encode_prompt(tok, SHORT, chat=True)
    cache = make_cache(model, SMALL)
    got = list(stream_tokens(model, ids, cache, 20, Sampling(), eos_ids(model, tok)))
    assert got == hf_greedy(model, ids, SMALL, 20)
    assert cache.token_counts()["key_pages"] >= 1  # pages were quantized along the way
    assert cache.get_seq_length() == ids.shape[1] + len(got) - 1  # the last token is never fed back


def test_eos_stops_and_min_new_tokens_masks_it(default_model):
    """The greedy first token declared EOS: generation stops at once, unless ``min_new_tokens`` masks it (as
    transformers' ``min_new_tokens`` does)."""
    model, tok = default_model
    ids = kp.encode_prompt(tok, SHORT, chat=True)
    first = generate_tokens(model, ids, make_cache(model, SMALL), 1)[0]
    assert generate_tokens(model, ids, make_cache(model, SMALL), 6, eos={first}) == [first]
    got = generate_tokens(model, ids, make_cache(model, SMALL), 6, eos={first}, min_new_tokens=3)
    assert got[0] != first
    assert got == hf_greedy(model, ids, SMALL, 6, min_new_tokens=3, eos_token_id=first)


def test_sampled_stream_is_seeded(default_model):
    model, tok = default_model
    ids = kp.encode_prompt(tok, SHORT, chat=True)
    sampling = Sampling(temperature=1.2, top_p=0.9, seed=5)
    runs = [generate_tokens(model, ids, make_cache(model, "fp16"), 8, sampling) for _ in range(2)]
    assert runs[0] == runs[1]
    other = generate_tokens(model, ids, make_cache(model, "fp16"), 8, Sampling(1.2, 0.9, seed=6))
    assert other != runs[0]
    with pytest.raises(ValueError, match="max_new_tokens"):
        next(stream_tokens(model, ids, make_cache(model, "fp16"), 0))


def test_prompt_caps_and_truncation_note(default_model):
    tok = default_model[1]
    text = kp.shipped_text("essay.txt")
    p = kp.prepare_prompt(tok, text + "\nQuestion: what is this essay about?", True, max_prompt_tokens=300)
    assert p.tokens <= 300 and "Truncated" in p.note
    assert tok.decode(p.ids[0]).rstrip().endswith("assistant")  # the template and the question survive the cut
    assert "what is this essay about?" in tok.decode(p.ids[0])
    short = kp.prepare_prompt(tok, SHORT, False)
    assert short.note == "" and short.ids[0].tolist() == tok(SHORT).input_ids
    huge = kp.prepare_prompt(tok, "x " * (kp.MAX_PROMPT_CHARS // 2 + 10), False)
    assert "characters" in huge.note and huge.tokens <= kp.MAX_PROMPT_TOKENS
    with pytest.raises(kp.PromptError):
        kp.prepare_prompt(tok, "  ", True)


def test_sampling_settings():
    """Greedy is the argmax; top-p keeps the nucleus; the same seed gives the same draws (one per column)."""
    logits = torch.randn(500, generator=torch.Generator().manual_seed(0)) * 3
    top = int(logits.argmax())
    assert sample_next(logits, Sampling()) == top
    tiny_nucleus = Sampling(temperature=1.0, top_p=1e-6)
    assert {sample_next(logits, tiny_nucleus, torch.Generator().manual_seed(s)) for s in range(20)} == {top}

    def draws(seed: int, top_p: float) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [sample_next(logits, Sampling(temperature=1.5, top_p=top_p), g) for _ in range(50)]

    assert draws(7, 1.0) == draws(7, 1.0) and len(set(draws(7, 1.0))) > 5
    probs = torch.softmax(logits / 1.5, -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    assert set(draws(3, 0.5)) <= nucleus
    with pytest.raises(ValueError):
        Sampling(temperature=-1)


def test_passkey_prompts_share_one_haystack(default_model):
    tok = default_model[1]
    p = kp.passkey_prompt(tok, 600, 0.5, 12345)
    assert p.endswith("The pass key is") and "12345" in p
    assert 450 < len(tok(p).input_ids) <= 600
    n = p.count(kp.FILLER)
    assert p == kp.passkey_text(12345, round(n * 0.5), n - round(n * 0.5))
    example = kp.example_prompts()[2][0]
    assert example == kp.passkey_text(68351, 16, 24) and example.count(kp.FILLER) == 40
    text, enc, pos = kp.needle_positions(tok, "600:0.5:12345")
    assert text == p and pos == list(range(pos[0], pos[-1] + 1))  # one run of tokens
    assert "12345" in tok.decode(enc["input_ids"][0, pos[0] : pos[-1] + 1])
    with pytest.raises(ValueError, match="length:depth:key"):
        kp.needle_positions(tok, "600:0.5")
