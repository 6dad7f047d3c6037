"""KittyCache: state after every insertion, generate equivalence, padded batches, memory, errors.

Model-free tests drive one cache layer through the real path (``cache.update`` -> the registered ``"kitty"``
attention function -> ``KittyLayer.append``) with random keys/values and tiny sizes (S=4, G=8, R=8) so pages really
fill. Model tests use the default SmolLM2 (session fixture) and tiny random-weight Llama / Qwen3 built from configs.
"""

from __future__ import annotations

import pytest
import torch
from fixtures import tiny_config
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3ForCausalLM

from kitty import PRESETS, KittyCache, analytic_report, token_layout
from kitty.cache.attention import KittyMask, kitty_attention_forward
from kitty.core.quant import dequantize_key_page, dequantize_value_page, quantize_key_page, quantize_value_page
from kitty.hf.compat import cache_kwargs
from kitty.kernels import dequantize_cache
from kitty.tools.prompts import shipped_text

S, G, R = 4, 8, 8  # tiny sink / page / local window: boundaries at 4, 12, 20
SMALL = {
    name: PRESETS[name].with_(sink_tokens=S, group_size=G, local_window=R)
    for name in ("fp16", "kivi-k2v2", "kitty", "kitty-pro")
}
SMALL["kivi-k2v2"] = SMALL["kivi-k2v2"].with_(sink_tokens=0)  # KIVI keeps no sink
HKV, HQ, D = 2, 4, 16


def tiny_llama_config(**kw) -> LlamaConfig:
    args = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=HQ,
        num_key_value_heads=HKV,
        head_dim=D,
        vocab_size=128,
        max_position_embeddings=512,
    )
    args.update(kw)
    return tiny_config(**args)


def feed(
    cache: KittyCache, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None = None, layer_idx: int = 0
) -> torch.Tensor:
    """One forward step of one layer through the real path: update -> kitty attention (-> append)."""
    B, _, T, _ = k.shape
    q = torch.randn(B, HQ, T, D, dtype=k.dtype)
    mask = (
        None
        if valid is None
        else KittyMask(torch.cat([torch.ones(B, cache.get_seq_length(), dtype=torch.bool), valid], 1))
    )
    out, _ = kitty_attention_forward(None, q, *cache.update(k, v, layer_idx), mask, scaling=D**-0.5)
    return out


def check_state(cache: KittyCache, cfg, rows_k: list[torch.Tensor], rows_v: list[torch.Tensor]) -> None:
    """Compare every buffer slot and every page of layer 0 with the stream of valid keys/values fed per row."""
    layer = cache.layers[0]
    counts = cache.token_counts(per_row=True)
    for b, (kb, vb) in enumerate(zip(rows_k, rows_v)):  # (H, n, D) valid tokens of row b, in position order
        n = kb.shape[1]
        lay = token_layout(cfg, n)
        expect = {
            "tokens": n,
            "sink": lay.sink,
            "key_pages": lay.key_pages * G,
            "key_qbuffer": lay.key_qbuffer,
            "value_pages": lay.value_pages * G,
            "value_qbuffer": lay.value_qbuffer,
            "local": lay.local,
        }
        assert counts[b] == expect
        assert int(layer.lengths[b]) == n
        Sc = cfg.sink_tokens
        assert torch.equal(layer.sink_k[b, :, : lay.sink], kb[:, : lay.sink])
        assert torch.equal(layer.sink_v[b, :, : lay.sink], vb[:, : lay.sink])
        # page tables: exactly key_pages / value_pages entries, then -1
        assert (layer.k_page_table[b] >= 0).sum() == lay.key_pages and (
            layer.k_page_table[b, : lay.key_pages] >= 0
        ).all()
        assert (layer.v_page_table[b] >= 0).sum() == lay.value_pages and (
            layer.v_page_table[b, : lay.value_pages] >= 0
        ).all()
        for j in range(lay.key_pages):  # the stored page is bit-identical to quantizing that group of valid keys
            want = quantize_key_page(kb[:, Sc + j * G : Sc + (j + 1) * G], cfg, salt=0)
            got = layer.key_page(b, j)
            for name, t in want.tensors().items():
                assert torch.equal(getattr(got, name), t), (b, j, name)
        for j in range(lay.value_pages):
            want = quantize_value_page(vb[:, Sc + j * G : Sc + (j + 1) * G], cfg)
            got = layer.value_page(b, j)
            for name, t in want.tensors().items():
                assert torch.equal(getattr(got, name), t), (b, j, name)
        k0 = Sc + lay.key_pages * G
        assert torch.equal(layer.k_qbuf[b, :, : lay.key_qbuffer], kb[:, k0:n])
        v0 = Sc + lay.value_pages * G
        assert torch.equal(layer.v_qbuf[b, :, : lay.value_qbuffer], vb[:, v0 : v0 + lay.value_qbuffer])
        for p in range(n - lay.local, n):  # ring slot (p - S) % R
            assert torch.equal(layer.v_local[b, :, (p - Sc) % cfg.local_window], vb[:, p])


@pytest.mark.parametrize("name", ["fp16", "kitty", "kivi-k2v2"])
@pytest.mark.parametrize(
    "prefill",
    [1, S - 1, S, S + 1, S + G - 1, S + G, S + G + 1, S + G + R - 1, S + G + R, S + G + R + 1, S + 5 * G + R + 3],
)
def test_state_matches_layout_every_step(name, prefill):
    """Ragged left-padded batch: counts, buffers and pages equal the formula and the fed tokens at every step."""
    torch.manual_seed(prefill)
    cfg = SMALL[name]
    cache = KittyCache(tiny_llama_config(num_hidden_layers=1), cfg)
    lens = [prefill, prefill + 3, max(prefill - 2, 1)]
    T = max(lens)
    k = torch.randn(3, HKV, T, D) + 0.1
    v = torch.randn(3, HKV, T, D) + 0.1
    valid = torch.arange(T)[None, :] >= (T - torch.tensor(lens))[:, None]  # left padding
    k[~valid[:, None, :, None].expand_as(k)] = 1e4  # padding that would wreck any page statistics it entered
    v[~valid[:, None, :, None].expand_as(v)] = -1e4
    feed(cache, k, v, valid)
    rows_k = [k[b][:, valid[b]] for b in range(3)]
    rows_v = [v[b][:, valid[b]] for b in range(3)]
    check_state(cache, cfg, rows_k, rows_v)
    assert cache.get_seq_length() == T  # columns, padding included
    for _ in range(G + R + 2):  # decode steps crossing the next page boundaries of every row
        k1, v1 = torch.randn(3, HKV, 1, D) + 0.1, torch.randn(3, HKV, 1, D) + 0.1
        feed(cache, k1, v1, torch.ones(3, 1, dtype=torch.bool))
        rows_k = [torch.cat([r, k1[b]], 1) for b, r in enumerate(rows_k)]
        rows_v = [torch.cat([r, v1[b]], 1) for b, r in enumerate(rows_v)]
        check_state(cache, cfg, rows_k, rows_v)
    assert cache.memory_report() == analytic_report(cfg, cache.lengths, D, HKV, 1, 4)


@pytest.mark.parametrize("name", ["fp16", "kitty"])
def test_dequantized_cache_is_positions_in_order(name):
    """dequantize_cache returns sink/qbuffer/local exactly and pages as their dequantization, paired by position."""
    torch.manual_seed(1)
    cfg = SMALL[name]
    cache = KittyCache(tiny_llama_config(num_hidden_layers=1), cfg)
    lens = [S + 3 * G + 5, S + 2, S + G + R + 1]
    T = max(lens)
    k, v = torch.randn(3, HKV, T, D) + 0.1, torch.randn(3, HKV, T, D) + 0.1
    valid = torch.arange(T)[None, :] >= (T - torch.tensor(lens))[:, None]
    feed(cache, k, v, valid)
    keys, values, ok = dequantize_cache(cache.layers[0].storage(), cfg)
    assert keys.shape == (3, HKV, T, D) and ok.sum(1).tolist() == lens
    for b in range(3):
        kb, vb, n = k[b][:, valid[b]], v[b][:, valid[b]], lens[b]
        lay = token_layout(cfg, n)
        kq0 = S + lay.key_pages * G
        vq0 = S + lay.value_pages * G
        assert torch.equal(keys[b, :, :S], kb[:, :S]) and torch.equal(keys[b, :, kq0:n], kb[:, kq0:])
        assert torch.equal(values[b, :, :S], vb[:, :S]) and torch.equal(values[b, :, vq0:n], vb[:, vq0:])
        for j in range(lay.key_pages):
            assert torch.equal(
                keys[b, :, S + j * G : S + (j + 1) * G], dequantize_key_page(cache.layers[0].key_page(b, j))
            )
        for j in range(lay.value_pages):
            assert torch.equal(
                values[b, :, S + j * G : S + (j + 1) * G], dequantize_value_page(cache.layers[0].value_page(b, j))
            )
        if cfg.quantizes_keys and lay.key_pages:  # quantization really happened
            assert not torch.equal(keys[b, :, S : S + G], kb[:, S : S + G])


def test_no_full_precision_copy_of_quantized_tokens():
    """Every tensor the cache holds is a buffer of LAYOUT.md or a 2-bit pool: nothing of full size per token."""
    torch.manual_seed(2)
    cfg = SMALL["kitty"]
    cache = KittyCache(tiny_llama_config(num_hidden_layers=1), cfg)
    n = S + 20 * G
    feed(cache, torch.randn(1, HKV, n, D), torch.randn(1, HKV, n, D))
    layer = cache.layers[0]
    fp_elems = sum(
        t.numel()
        for name, t in layer.storage().items()
        if t.is_floating_point() and name not in ("k_scale", "k_zero", "v_scale", "v_zero")
    )
    assert fp_elems == 2 * HKV * (S * D + G * D) + HKV * R * D  # sink_k/v + k/v qbuffers + local: independent of n
    assert set(layer.storage()) == {
        "lengths",
        "sink_k",
        "sink_v",
        "k_qbuf",
        "v_qbuf",
        "v_local",
        "k_page_table",
        "v_page_table",
        "k_low",
        "k_high",
        "k_boost_idx",
        "k_scale",
        "k_zero",
        "v_codes",
        "v_scale",
        "v_zero",
    }


def test_page_pool_grows_and_max_pages_errors_leave_cache_usable():
    torch.manual_seed(3)
    cfg = SMALL["kitty"]
    cache = KittyCache(tiny_llama_config(num_hidden_layers=1), cfg, max_pages=3)
    feed(cache, torch.randn(2, HKV, S + G + 2, D), torch.randn(2, HKV, S + G + 2, D))  # 2 key pages
    before = cache.token_counts(per_row=True)
    with pytest.raises(RuntimeError, match="max_pages=3"):
        feed(cache, torch.randn(2, HKV, G, D), torch.randn(2, HKV, G, D))  # 2 more key pages: 4 > 3
    assert cache.token_counts(per_row=True) == before and cache.get_seq_length() == S + G + 2
    assert cache.memory_report() == analytic_report(cfg, cache.lengths, D, HKV, 1, 4)
    feed(cache, torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D))  # smaller steps still fit
    assert cache.lengths == [S + G + 3] * 2
    cache.reset()
    assert cache.lengths == [0, 0] and cache.get_seq_length() == 0
    feed(cache, torch.randn(1, HKV, S + G, D), torch.randn(1, HKV, S + G, D))  # new batch size after reset
    assert cache.token_counts()["key_pages"] == G
    unbounded = KittyCache(tiny_llama_config(num_hidden_layers=1), cfg)
    feed(unbounded, torch.randn(1, HKV, S + 40 * G, D), torch.randn(1, HKV, S + 40 * G, D))
    assert unbounded.layers[0].key_pool.used == 40 and unbounded.layers[0].key_pool.capacity >= 40


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="head_dim"):
        KittyCache(tiny_llama_config(head_dim=6), "kitty")  # 2-bit values need D % 4 == 0
    with pytest.raises(ValueError, match="backend"):
        KittyCache(tiny_llama_config(), "kitty", backend="cuda")
    with pytest.raises(ValueError, match="method"):
        KittyCache(tiny_llama_config(), "nope")
    with pytest.raises(ValueError, match="max_pages"):
        KittyCache(tiny_llama_config(), "kitty", max_pages=0)
    cache = KittyCache(tiny_llama_config(num_hidden_layers=1), SMALL["kitty"])
    with pytest.raises(ValueError, match="0 new tokens"):
        feed(cache, torch.randn(1, HKV, 0, D), torch.randn(1, HKV, 0, D))
    with pytest.raises(ValueError, match=r"row\(s\) \[1\]"):
        feed(cache, torch.randn(2, HKV, 3, D), torch.randn(2, HKV, 3, D), torch.tensor([[True] * 3, [False] * 3]))
    assert cache.get_seq_length() == 0
    feed(cache, torch.randn(2, HKV, 3, D), torch.randn(2, HKV, 3, D))  # still usable
    assert cache.lengths == [3, 3]
    with pytest.raises(ValueError, match="reset"):
        feed(cache, torch.randn(3, HKV, 1, D), torch.randn(3, HKV, 1, D))
    with pytest.raises(NotImplementedError, match="beam"):
        cache.reorder_cache(torch.tensor([1, 0]))


def test_memory_report_at_4096_tokens_default_model(default_model):
    """kitty: measured nbytes == analytic formula and >= 4.8x; fp16: 1.0x. All 30 layers filled via append()."""
    model, _ = default_model
    torch.manual_seed(4)
    n = 4096
    reports = {}
    for name in ("kitty", "fp16"):
        cache = KittyCache(model.config, name)
        k = torch.randn(1, cache.num_kv_heads, n, cache.head_dim, dtype=torch.bfloat16)
        v = torch.randn(1, cache.num_kv_heads, n, cache.head_dim, dtype=torch.bfloat16)
        for layer in cache.layers:  # the insertion path the attention function calls (a 4096^2 prefill is too slow)
            layer.append(k, v)
        report = cache.memory_report()
        assert report == analytic_report(PRESETS[name], [n], 64, 3, 30, 2)
        assert cache.token_counts()["tokens"] == n
        reports[name] = report
    assert reports["kitty"].compression >= 4.8
    assert reports["fp16"].compression == pytest.approx(1.0)
    assert reports["kitty"].fp16_bytes == reports["fp16"].stored_bytes == 2 * n * 64 * 2 * 3 * 30


# ------------------------------------------------------------------------------------------------ with models


def greedy(model, enc, cache, n):
    with torch.no_grad():
        out = model.generate(**enc, **cache_kwargs(cache), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[:, enc["input_ids"].shape[1] :]


def reference_tokens(model, enc, n):
    """Greedy tokens with transformers' DynamicCache and SDPA, untouched by Kitty."""
    impl = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        return greedy(model, enc, DynamicCache(config=model.config), n)
    finally:
        model.config._attn_implementation = impl


def test_fp16_matches_dynamic_cache_default_model(default_model):
    model, tok = default_model
    enc = tok(["The three primary colors are"], return_tensors="pt")
    n = S + G + R + 4 - enc.input_ids.shape[1] + 8  # the sequence crosses S, S+G, S+G+R
    ref = reference_tokens(model, enc, n)
    cache = KittyCache(model.config, SMALL["fp16"])
    assert torch.equal(greedy(model, enc, cache, n), ref)
    assert cache.token_counts()["key_pages"] >= 2 * G and cache.token_counts()["value_pages"] >= G
    cache = KittyCache(model.config, "fp16")  # the preset itself (S=32): crosses the sink boundary
    enc = tok(["Once upon a time"], return_tensors="pt")
    assert torch.equal(greedy(model, enc, cache, 36), reference_tokens(model, enc, 36))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp16_matches_dynamic_cache_tiny_random_models(arch):
    torch.manual_seed(5)
    if arch == "llama":
        model = LlamaForCausalLM(tiny_llama_config()).eval()
    else:
        model = Qwen3ForCausalLM(
            tiny_config("qwen3", num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D)
        ).eval()
    ids = torch.randint(3, 128, (2, 7))
    mask = torch.ones_like(ids)
    enc = {"input_ids": ids, "attention_mask": mask}
    n = S + G + R + 6
    ref = reference_tokens(model, enc, n)
    cache = KittyCache(model.config, SMALL["fp16"])
    assert torch.equal(greedy(model, enc, cache, n), ref)
    assert cache.lengths == [7 + n - 1] * 2
    # quantized presets run through the same model and change nothing about the layout bookkeeping
    cache = KittyCache(model.config, SMALL["kitty"])
    out = greedy(model, enc, cache, n)
    assert out.shape == ref.shape and cache.memory_report() == analytic_report(
        SMALL["kitty"], cache.lengths, D, HKV, 2, 4
    )


@pytest.fixture(scope="module")
def default_model_fp32():
    from kitty.hf.models import load_model

    return load_model(dtype=torch.float32)


@pytest.mark.parametrize("name", ["fp16", "kivi-k2v2", "kitty"])
def test_padded_batch_rows_equal_prompts_alone(default_model_fp32, name):
    """Left-padded batch of 3 prompts of different lengths: each row's tokens equal its prompt generated alone.

    float32 on purpose: in bf16 the batched matmuls round differently from batch-1 ones, and with 2-bit KIVI (no
    sink) that noise flipped one greedy token after 13 steps; in float32 the rows match exactly for every preset.
    """
    model, tok = default_model_fp32
    prompts = ["Once upon a time", "The capital of France is", "List three fruits: apple, banana and"]  # 4, 5, 8 tokens
    n = 18  # every row ends past S + G + R = 20 cached tokens
    cfg = SMALL[name]
    alone = [greedy(model, tok([p], return_tensors="pt"), KittyCache(model.config, cfg), n)[0] for p in prompts]
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any()  # really padded
    cache = KittyCache(model.config, cfg)
    batch = greedy(model, enc, cache, n)
    for i in range(3):
        assert torch.equal(batch[i], alone[i]), (name, i)
    assert cache.lengths == [int(m.sum()) + n - 1 for m in enc.attention_mask]


def _score(model, ids: torch.Tensor, cfg, prefill: int) -> float:
    """Mean teacher-forced NLL of ids[prefill:], each token's logits from a single-token decode step."""
    cache = KittyCache(model.config, cfg)
    nll = []
    with torch.no_grad():
        logits = model(ids[None, :prefill], **cache_kwargs(cache)).logits[0, -1]
        for t in range(prefill, len(ids)):
            nll.append(torch.nn.functional.cross_entropy(logits.float()[None], ids[t : t + 1]))
            if t + 1 < len(ids):
                logits = model(ids[None, t : t + 1], **cache_kwargs(cache)).logits[0, -1]
    return torch.stack(nll).mean().item()


def test_nll_direction_kitty_closer_to_fp16_than_kivi(default_model):
    """Paper defaults (S=32, G=128, R=128): 300-token prefill, 64 tokens scored through the quantized cache."""
    model, tok = default_model
    text = shipped_text("python_reference.txt")
    ids = tok(text, return_tensors="pt").input_ids[0, :364]
    nll = {name: _score(model, ids, PRESETS[name], 300) for name in ("fp16", "kivi-k2v2", "kitty", "kitty-pro")}
    gap = {name: abs(nll[name] - nll["fp16"]) for name in nll}
    print({k: round(v, 4) for k, v in nll.items()})
    assert gap["kitty"] < gap["kivi-k2v2"] and gap["kitty-pro"] < gap["kivi-k2v2"], nll


@pytest.mark.filterwarnings(
    "ignore:`past_key_values` is deprecated"
)  # the old name is used on purpose: both are accepted
def test_sampling_reset_kwargs_and_beam_search(default_model):
    model, tok = default_model
    enc = tok(["Tell me a story about a cat."], return_tensors="pt")
    cache = KittyCache(model.config, SMALL["kitty"])
    outs = []
    for _ in range(2):
        cache.reset()
        torch.manual_seed(0)
        with torch.no_grad():
            outs.append(
                model.generate(
                    **enc,
                    past_key_values=cache,
                    max_new_tokens=12,
                    min_new_tokens=12,
                    do_sample=True,
                    temperature=1.0,
                    top_k=50,
                )
            )
        assert cache.lengths == [enc.input_ids.shape[1] + 11]
    assert torch.equal(outs[0], outs[1])  # reset makes the cache reusable; sampling is seeded
    greedy_out = greedy(model, enc, KittyCache(model.config, SMALL["kitty"]), 12)
    cache.reset()
    assert torch.equal(greedy(model, enc, cache, 12), greedy_out)
    with pytest.raises(NotImplementedError, match="beam"):
        cache.reset()
        model.generate(**enc, **cache_kwargs(cache), max_new_tokens=4, num_beams=2, do_sample=False)


def test_zero_token_prompt_and_empty_row_raise_and_cache_stays_usable(default_model):
    model, tok = default_model
    cache = KittyCache(model.config, SMALL["kitty"])
    with pytest.raises(ValueError, match="0 new tokens"):
        model(torch.zeros(1, 0, dtype=torch.long), **cache_kwargs(cache))
    with pytest.raises(ValueError, match="0 new tokens"):
        model.generate(**tok([""], return_tensors="pt"), **cache_kwargs(cache), max_new_tokens=2)
    enc = tok(["Hello there", "Hi"], return_tensors="pt", padding=True)
    enc["attention_mask"][1] = 0
    with pytest.raises(ValueError, match="no tokens"):
        model(**enc, **cache_kwargs(cache))
    assert cache.get_seq_length() == 0
    enc = tok(["Hello there"], return_tensors="pt")
    ref = greedy(model, enc, KittyCache(model.config, SMALL["kitty"]), 6)
    assert torch.equal(greedy(model, enc, cache, 6), ref)


# ----------------------------------------------------------------------------------- query-aware selection


def test_query_selection_tracks_mean_abs_query_and_boosts_the_channel_queries_use():
    """The cache's running mean |q| per KV head ranks channels at pack time; equal bits to kitty (memory_report)."""
    torch.manual_seed(7)
    cfg = SMALL["kitty"].with_(channel_selection="query", boost_fraction=1 / D)  # one boosted channel per page
    cache = KittyCache(tiny_llama_config(), cfg)
    B, T = 2, cfg.sink_tokens + cfg.group_size  # exactly one key page per row
    k = torch.randn(B, HKV, T, D)
    k[..., 3] *= 4  # widest channel: what magnitude/range would pick
    v = torch.randn(B, HKV, T, D)
    q = torch.randn(B, HQ, T, D) * 0.1
    q[..., 9] = 5.0  # every query leans on channel 9
    layer = cache.layers[0]
    kitty_attention_forward(None, q, *cache.update(k, v, 0), None, scaling=D**-0.5)
    expected = q.abs().view(B, HKV, HQ // HKV, T, D).mean((2, 3))
    torch.testing.assert_close(layer.query_scale(), expected)
    page = layer.key_page(0, 0)
    boosted = (page.boost_idx.long() < page.num_boosted).nonzero()[:, -1].tolist()
    assert boosted == [9] * HKV
    # the same tokens under plain kitty cost exactly the same bytes
    plain = KittyCache(tiny_llama_config(), SMALL["kitty"].with_(boost_fraction=1 / D))
    kitty_attention_forward(None, q, *plain.update(k, v, 0), None, scaling=D**-0.5)
    assert plain.layers[0].memory_report() == layer.memory_report()
    cache.reset()
    assert layer.query_scale().abs().sum() == 0


def test_oracle_selection_keeps_query_second_moments():
    """``"oracle"`` ranks channels with the root mean square of the GQA group's queries, kept per row and KV head."""
    torch.manual_seed(8)
    cfg = SMALL["kitty"].with_(channel_selection="oracle", boost_fraction=1 / D)
    cache = KittyCache(tiny_llama_config(), cfg)
    B, T = 2, cfg.sink_tokens + cfg.group_size
    k, v = torch.randn(B, HKV, T, D), torch.randn(B, HKV, T, D)
    q = torch.randn(B, HQ, T, D) * 0.1
    q[..., 12] = 4.0
    kitty_attention_forward(None, q, *cache.update(k, v, 0), None, scaling=D**-0.5)
    layer = cache.layers[0]
    torch.testing.assert_close(layer.query_scale(), q.square().view(B, HKV, HQ // HKV, T, D).mean((2, 3)).sqrt())
    page = layer.key_page(1, 0)
    assert (page.boost_idx.long() < 1).nonzero()[:, -1].tolist() == [12] * HKV
    cache.reset()
    assert layer.query_scale().abs().sum() == 0


def test_layer_adaptive_profile_moves_boost_between_layers_at_equal_bits():
    """Each layer packs its profile's number of high planes; the total (and memory_report) equals uniform kitty."""
    torch.manual_seed(9)
    uniform = SMALL["kitty"].with_(boost_fraction=4 / D)  # nb a multiple of 4: k_high bytes add up across layers
    adaptive = uniform.with_(boost_profile=(8 / D, 0.0))
    config = tiny_llama_config()
    caches = [KittyCache(config, c) for c in (uniform, adaptive)]
    B, T = 2, 29  # sink 4, 3 key pages of 8, 1 in the qbuffer
    k, v = torch.randn(B, HKV, T, D), torch.randn(B, HKV, T, D)
    for cache in caches:
        for layer_idx in range(2):
            feed(cache, k, v, layer_idx=layer_idx)
    assert [l.key_page(0, 1).num_boosted for l in caches[1].layers] == [8, 0]
    assert [l.key_page(0, 1).num_boosted for l in caches[0].layers] == [4, 4]
    reports = [c.memory_report() for c in caches]
    assert reports[0] == reports[1]
    assert reports[1] == analytic_report(adaptive, caches[1].lengths, D, HKV, 2, 4)
    with pytest.raises(ValueError, match="boost_profile"):
        KittyCache(tiny_llama_config(num_hidden_layers=3), adaptive)


@pytest.mark.parametrize("S, G, R", [(4, 8, 16), (0, 16, 0), (3, 8, 5)])
def test_pages_completed_agrees_with_token_layout(S, G, R):
    """The one "does this growth complete a page?" rule equals the difference of token_layout's page counts."""
    from kitty.core.pages import pages_completed

    cfg = PRESETS["kitty"].with_(sink_tokens=S, group_size=G, local_window=R)
    n0 = [n for n in range(0, 70) for _ in range(3)]
    n1 = [n + step for n, step in zip(n0, [1, 7, 40] * 70)]
    key, value = pages_completed(cfg, n0, n1)
    for a, b, k, v in zip(n0, n1, key, value):
        la, lb = token_layout(cfg, a), token_layout(cfg, b)
        assert (k, v) == (lb.key_pages - la.key_pages, lb.value_pages - la.value_pages), (a, b)
