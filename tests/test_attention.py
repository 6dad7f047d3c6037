"""The registered "kitty" attention/mask functions: SDPA fallback, masks, references, backend dispatch, Triton seam."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from fixtures import tiny_config
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kitty import PRESETS, KittyCache
from kitty.cache.attention import (
    ATTN_NAME,
    KittyMask,
    attend_torch,
    kitty_attention_forward,
    resolve_backend,
    user_implementation,
)
from kitty.core.pages import filled_page
from kitty.hf.compat import cache_kwargs
from kitty.kernels import decode_attention_ref, dequantize_cache

S, G, R = 4, 8, 8
HKV, HQ, D = 2, 6, 16  # GQA ratio 3
CFG = {
    name: PRESETS[name].with_(sink_tokens=S, group_size=G, local_window=R) for name in ("fp16", "kitty", "kitty-pro")
}


def config(**kw) -> LlamaConfig:
    args = dict(
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=HQ,
        num_key_value_heads=HKV,
        head_dim=D,
        vocab_size=128,
    )
    args.update(kw)
    return tiny_config(**args)


def feed(cache, k, v, valid=None, q=None):
    B, _, T, _ = k.shape
    q = torch.randn(B, HQ, T, D) if q is None else q
    mask = (
        None
        if valid is None
        else KittyMask(torch.cat([torch.ones(B, cache.get_seq_length(), dtype=torch.bool), valid], 1))
    )
    return kitty_attention_forward(None, q, *cache.update(k, v, 0), mask, scaling=D**-0.5)[0]  # (B, T, Hq, D)


def test_registered_under_kitty():
    assert ALL_ATTENTION_FUNCTIONS[ATTN_NAME] is kitty_attention_forward
    assert ATTN_NAME in ALL_MASK_ATTENTION_FUNCTIONS
    model = LlamaForCausalLM(config())
    KittyCache(model.config, "kitty")
    assert model.config._attn_implementation == "sdpa"  # the user's choice: "kitty" only during a KittyCache pass


def test_config_read_by_dynamo_while_tracing_reads_kitty_for_good():
    """Some dynamo releases (torch 2.11) evaluate a config's ``_attn_implementation`` as a real call while tracing and
    guard on the value, so the thread flag set inside the same trace is not seen: such a read (a tracing context is
    active, the code is not traced symbolically) makes that config read "kitty" from then on, in the guard checks and
    eager calls that follow. Other configs of the class, and reads with no trace under way, are untouched."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, other = LlamaForCausalLM(config()), LlamaForCausalLM(config())
    KittyCache(model.config, "kitty")
    assert model.config._attn_implementation == "sdpa"
    with tracing(TracingContext(FakeTensorMode())):
        assert model.config._attn_implementation == ATTN_NAME
    assert model.config._attn_implementation == ATTN_NAME  # the guard's read, after the trace
    assert other.config._attn_implementation == "sdpa"
    assert user_implementation(model.config) == "sdpa"  # the user's choice, for the functions that hand layers on


def test_plain_tensors_fall_back_to_sdpa_exactly():
    """With config "kitty" but a DynamicCache (or none), logits equal transformers' SDPA bit for bit, padding included."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(config()).eval()
    ids = torch.randint(3, 128, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    outs = {}
    for impl in ("sdpa", ATTN_NAME):
        model.config._attn_implementation = impl
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            first = model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache)).logits
            step = model(
                input_ids=ids[:, :1],
                attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1),
                **cache_kwargs(cache),
            ).logits
            no_cache = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        outs[impl] = (first, step, no_cache)
    for a, b in zip(outs["sdpa"], outs[ATTN_NAME]):
        assert torch.equal(a, b)


def test_chunk_attention_matches_dense_reference():
    """T new queries (left-padded) over a ragged cache: each valid query equals softmax over its row's cached tokens
    (dequantized) and the valid new tokens up to itself, in float32."""
    torch.manual_seed(1)
    cfg = CFG["kitty"]
    cache = KittyCache(config(), cfg)
    lens = [S + 2 * G + 3, S + 1, 2]
    T0 = max(lens)
    valid0 = torch.arange(T0)[None, :] >= (T0 - torch.tensor(lens))[:, None]
    feed(cache, torch.randn(3, HKV, T0, D), torch.randn(3, HKV, T0, D), valid0)
    past_k, past_v, past_ok = dequantize_cache(cache.layers[0].storage(), cfg)
    T = 5
    k, v, q = torch.randn(3, HKV, T, D), torch.randn(3, HKV, T, D), torch.randn(3, HQ, T, D)
    valid = torch.ones(3, T, dtype=torch.bool)
    valid[2, :2] = False  # a padded chunk for row 2
    out = feed(cache, k, v, valid, q)  # (B, T, Hq, D)
    for b in range(3):
        n = lens[b]
        for i in range(T):
            if not valid[b, i]:
                continue
            cols = [j for j in range(i + 1) if valid[b, j]]
            keys = torch.cat([past_k[b, :, :n], k[b][:, cols]], 1).repeat_interleave(HQ // HKV, 0)  # (Hq, n + c, D)
            vals = torch.cat([past_v[b, :, :n], v[b][:, cols]], 1).repeat_interleave(HQ // HKV, 0)
            p = torch.softmax(torch.einsum("hd,hnd->hn", q[b, :, i], keys) * D**-0.5, -1)
            ref = torch.einsum("hn,hnd->hd", p, vals)
            torch.testing.assert_close(out[b, i], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()
    assert cache.lengths == [n + int(c) for n, c in zip(lens, valid.sum(1))]


@pytest.mark.parametrize("name", ["fp16", "kitty", "kitty-pro"])
def test_decode_steps_match_kernels_reference(name):
    """The generation path (SDPA over the cache read back by ``dequantize_cache``) equals the kernels' reference
    ``decode_attention_ref`` (fp32 softmax attention) on the layer's storage.

    A step that completes no page equals it on the state after insertion; a step that fills a page attends that page
    in full precision (paper order: attend, then quantize), i.e. equals the reference on the state before.
    """
    torch.manual_seed(2)
    cfg = CFG[name]
    cache = KittyCache(config(), cfg)
    lens = [S + G + 5, S + 2 * G + R + 1, 3]
    T0 = max(lens)
    valid0 = torch.arange(T0)[None, :] >= (T0 - torch.tensor(lens))[:, None]
    feed(cache, torch.randn(3, HKV, T0, D), torch.randn(3, HKV, T0, D), valid0)
    layer = cache.layers[0]
    checked = {"after": 0, "fills": 0}
    for _ in range(G + 2):
        k, v, q = torch.randn(3, HKV, 1, D), torch.randn(3, HKV, 1, D), torch.randn(3, HQ, 1, D)
        fills = any(
            filled_page(n + 1, S, G) is not None or filled_page(n + 1, S + R, G) is not None for n in cache.lengths
        )
        out = feed(cache, k, v, torch.ones(3, 1, dtype=torch.bool), q)[:, 0]  # (B, Hq, D)
        state = layer.storage()
        ref = decode_attention_ref(q[:, :, 0], state, cfg, D**-0.5)
        if not fills:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            checked["after"] += 1
        else:
            checked["fills"] += 1
    assert checked["after"] >= G - 2 and checked["fills"] >= 1  # both kinds of step were exercised


def test_page_filling_step_attends_that_page_in_full_precision():
    """At the step whose token fills the key qbuffer, attention sees the G tokens unquantized, then they are paged."""
    torch.manual_seed(3)
    cfg = CFG["kitty"]
    cache = KittyCache(config(), cfg)
    n0 = S + G - 1
    k0, v0 = torch.randn(1, HKV, n0, D), torch.randn(1, HKV, n0, D)
    feed(cache, k0, v0)
    k, v, q = torch.randn(1, HKV, 1, D), torch.randn(1, HKV, 1, D), torch.randn(1, HQ, 1, D)
    out = feed(cache, k, v, None, q)[:, 0]
    full = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([k0, k], 2), torch.cat([v0, v], 2), enable_gqa=True
    )[:, :, 0]
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
    assert cache.token_counts()["key_pages"] == G  # and now the page exists


def test_backend_dispatch(monkeypatch):
    """``KITTY_BACKEND`` is only the default: an explicit backend wins over it."""
    monkeypatch.delenv("KITTY_BACKEND", raising=False)
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("triton", torch.device("cpu")) == "triton"
    assert resolve_backend(None, torch.device("cpu")) == "torch"
    monkeypatch.setenv("KITTY_BACKEND", "triton")
    assert resolve_backend("torch", torch.device("cpu")) == "torch"
    assert resolve_backend(None, torch.device("cpu")) == "triton"
    assert KittyCache(config(), CFG["kitty"], backend="torch").layers[0].backend == "torch"
    monkeypatch.setenv("KITTY_BACKEND", "fast")
    with pytest.raises(ValueError, match="KITTY_BACKEND"):
        resolve_backend(None, torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cpu")) == "torch"


def test_triton_backend_without_triton_raises_not_implemented(monkeypatch):
    import kitty.kernels

    monkeypatch.delenv("KITTY_BACKEND", raising=False)
    monkeypatch.setattr(kitty.kernels, "HAS_TRITON", False)  # as on a machine without Triton
    monkeypatch.setitem(sys.modules, "kernels", types.ModuleType("kernels"))  # Hugging Face's hub package: unrelated
    with pytest.raises(NotImplementedError, match="Triton"):  # refused before any token is stored
        KittyCache(config(), CFG["kitty"], backend="triton")


def test_first_prefill_is_exactly_causal_sdpa():
    """An empty cache and no padding: the prompt's attention is plain causal SDPA in full precision, bit for bit."""
    torch.manual_seed(4)
    cfg = CFG["kitty"]
    k, v = torch.randn(2, HKV, 30, D), torch.randn(2, HKV, 30, D)
    q = torch.randn(2, HQ, 30, D)
    out = attend_torch(q, k, v, torch.ones(2, 30, dtype=torch.bool), _empty_storage(2), cfg, D**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, ref)


def _empty_storage(B):
    layer = KittyCache(config(), CFG["kitty"]).layers[0]
    layer.lazy_initialization(torch.zeros(B, HKV, 0, D), torch.zeros(B, HKV, 0, D))
    return layer.storage()


TRITON_SCRIPT = textwrap.dedent(
    """
    import torch
    import kitty.kernels as kernels
    from transformers import LlamaConfig, LlamaForCausalLM
    from kitty import KittyCache, PRESETS
    from kitty.hf.compat import cache_kwargs
    calls = [0]
    fused = kernels.decode_attention_triton
    def counting(*a, **k):
        calls[0] += 1
        return fused(*a, **k)
    kernels.decode_attention_triton = counting
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, vocab_size=128)).eval()
    ids = torch.randint(3, 128, (2, 9)); mask = torch.ones_like(ids); mask[1, :3] = 0
    cfg = PRESETS["kitty"].with_(sink_tokens=4, group_size=16, local_window=16)
    # beyond the paper: oracle selection, fitted ranges, 4 boosted channels in layer 0 and none in layer 1
    plus = cfg.with_(channel_selection="oracle", key_range="fit", value_range="fit", boost_profile=(0.25, 0.0))
    for c in (cfg, plus):
        out = {}
        for backend in ("torch", "triton"):
            with torch.no_grad():
                out[backend] = model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(KittyCache(model.config, c, backend=backend)),
                                              max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
        assert torch.equal(out["torch"], out["triton"])
    assert calls[0] >= 80, calls
    print("OK", calls[0])
    """
)


def test_triton_seam_end_to_end_under_interpreter():
    """backend="triton" through generate (kernels under TRITON_INTERPRET=1, in a subprocess so the flag is set before
    triton is imported): the fused kernel runs the decode steps and the tokens equal the torch backend's."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("KITTY_BACKEND", None)
    r = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]
