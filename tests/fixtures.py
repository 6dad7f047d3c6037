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
