"""Generation, models and every transformers release difference (compat.py)."""

from ..lazy import lazy_exports

__all__ = ["Sampling", "generate_static", "generate_tokens", "load_model"]
_EXPORTS = {
    "load_model": "models",
    "generate_tokens": "generate",
    "generate_static": "generate",
    "Sampling": "generate",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
