"""The cache and its layers: ``KittyCache`` (kitty_cache.py), the growing and static layers, the window layers, the
attention function transformers calls, the ops objects that pick a kernel (backend.py).
"""

__all__ = ["KittyCache"]
_EXPORTS = {"KittyCache": "kitty_cache"}


def __getattr__(name: str):
    # names load on first use, so importing one module of the package does not import the others
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
