"""Kitty: accurate 2-bit KV-cache quantization with dynamic channel-wise precision boost (arXiv 2511.18643)."""

from .core.config import PRESETS, KVQuantConfig, get_preset
from .core.memory import MemoryReport, analytic_report, token_layout

__all__ = [
    "KVQuantConfig",
    "PRESETS",
    "get_preset",
    "MemoryReport",
    "analytic_report",
    "token_layout",
    "KittyCache",
    "load_model",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: KittyCache pulls in transformers, which `import kitty` alone should not pay for.
    if name == "KittyCache":
        from .cache.kitty_cache import KittyCache

        return KittyCache
    if name == "load_model":
        from .hf.models import load_model

        return load_model
    raise AttributeError(f"module 'kitty' has no attribute {name!r}")
