"""Kitty: accurate 2-bit KV-cache quantization with dynamic channel-wise precision boost (arXiv 2511.18643)."""

from .core.config import PRESETS, KVQuantConfig, get_preset
from .core.memory import MemoryReport, analytic_report, token_layout
from .lazy import lazy_exports

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


# KittyCache pulls in transformers, which `import kitty` alone should not pay for: names load on first use
__getattr__ = lazy_exports(__name__, {"KittyCache": "cache.kitty_cache", "load_model": "hf.models"})
