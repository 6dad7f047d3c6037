"""Generation, models and every transformers release difference (compat.py)."""

__all__ = ["Sampling", "generate_static", "generate_tokens", "load_model"]
_EXPORTS = {
    "load_model": "models",
    "generate_tokens": "generate",
    "generate_static": "generate",
    "Sampling": "generate",
}


def __getattr__(name: str):
    # names load on first use, so importing one module of the package does not import the others
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
