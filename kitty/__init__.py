"""Kitty: accurate 2-bit KV-cache quantization with dynamic channel-wise precision boost (arXiv 2511.18643)."""

from .config import PRESETS, KVQuantConfig, get_preset
from .memory import MemoryReport, analytic_report, token_layout

__all__ = ["KVQuantConfig", "PRESETS", "get_preset", "MemoryReport", "analytic_report", "token_layout"]
__version__ = "0.1.0"
