"""Tiny random models of every supported family, built one way for all tests.

``tiny_config(family, **overrides)`` is a config of the shared tiny sizes (``TINY``) with the family's sliding
layers of window ``W`` (Gemma3, Mistral, Qwen2); keyword overrides replace any field. ``tiny_model`` seeds torch
and builds random weights from such a config, so one seed and one config give one model everywhere.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=256,
)
W = 16  # sliding window of the hybrid families

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(
            num_hidden_layers=3,
            sliding_window=W,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=W)),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=W, max_window_layers=1),
    ),
}


def tiny_config(family: str = "llama", **overrides) -> PretrainedConfig:
    """The tiny config of ``family`` (one of ``FAMILIES``): ``TINY`` sizes, the family's windows, then
    ``overrides``."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    config_class, _, extra = FAMILIES[family]
    return config_class(**(TINY | extra | overrides))


def tiny_model(family: str = "llama", seed: int = 0, **overrides) -> PreTrainedModel:
    """A random-weight model of ``tiny_config(family, **overrides)`` after ``torch.manual_seed(seed)``, in eval
    mode."""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    return FAMILIES[family][1](config).eval()


def check_generates_on_torch(cfg) -> None:
    """Greedy generation through a ``KittyCache`` with ``cfg`` on a tiny random Llama (head_dim 64): 24 new tokens,
    and ``backend="auto"`` gives the same ones (a torch-only config resolves to torch)."""
    from kitty.hf.generate import generate_fast

    model = tiny_model("llama", num_hidden_layers=2, head_dim=64, hidden_size=128, num_attention_heads=2)
    cfg = cfg.with_(sink_tokens=4, group_size=16, local_window=16)
    ids = torch.randint(0, model.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(0))
    out = generate_fast(model, ids, cfg, 24, backend="torch")
    assert len(out) == 24
    assert generate_fast(model, ids, cfg, 24, backend="auto") == out


def checked_cache_bits(cfg, head_dim: int, tokens: int) -> float:
    """Bits per element by ``memory_report()`` of a one-layer ``KittyCache`` after ``tokens`` random bf16 tokens (one
    prefill through the attention function), asserted equal to ``kitty.core.memory.analytic_report``."""
    from test_cache import HKV, HQ, tiny_llama_config

    from kitty import KittyCache
    from kitty.cache.attention import kitty_attention_forward
    from kitty.core.memory import analytic_report

    cache = KittyCache(tiny_llama_config(num_hidden_layers=1, head_dim=head_dim), cfg)
    k = torch.randn(1, HKV, tokens, head_dim, dtype=torch.bfloat16) + 0.1
    q = torch.randn(1, HQ, tokens, head_dim, dtype=torch.bfloat16)
    kitty_attention_forward(None, q, *cache.update(k, k.clone(), 0), None, scaling=head_dim**-0.5)
    assert cache.memory_report() == analytic_report(cfg, [tokens], head_dim, HKV, 1, 2)
    return cache.memory_report().bits_per_element


def check_kernels_refuse(cfg, match: str) -> None:
    """A torch-only ``cfg`` at head_dim 64: ``backend="auto"`` resolves to torch on a GPU, ``"triton"`` and
    ``"gluon"`` are refused with a ``ValueError`` matching ``match``, and neither kernel claims the config."""
    import pytest

    from kitty.cache.backend import check_triton, resolve_backend
    from kitty.kernels import triton_supports
    from kitty.kernels.gluon_launch import pages_supported

    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, cfg, 64) == "torch"
    for backend in ("triton", "gluon"):
        with pytest.raises(ValueError, match=match):
            check_triton(cfg, 64, cuda, backend)
    assert not triton_supports(cfg, 64, compiled=False) and not pages_supported(cfg, 64, torch.float16, 4)


def checked_fed_cache(preset: str):
    """``(cache, cfg, k, v)``: a one-layer ``KittyCache`` of ``preset`` at ``tests/test_cache.py``'s small sizes, fed
    two rows of random keys and values (head_dim 16) past three pages and the local window, its state checked
    against the stream (``test_cache.check_state``: every page equal to quantizing its tokens)."""
    from test_cache import HKV, G, R, S, check_state, feed, tiny_llama_config

    from kitty import KittyCache, get_preset

    torch.manual_seed(0)
    cfg = get_preset(preset).with_(sink_tokens=S, group_size=G, local_window=R)
    cache = KittyCache(tiny_llama_config(num_hidden_layers=1), cfg)
    T = S + 3 * G + R + 2
    k, v = torch.randn(2, HKV, T, 16) + 0.1, torch.randn(2, HKV, T, 16) + 0.1
    feed(cache, k, v, torch.ones(2, T, dtype=torch.bool))
    check_state(cache, cfg, list(k), list(v))
    return cache, cfg, k, v
