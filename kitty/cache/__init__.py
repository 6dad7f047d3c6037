"""The cache and its layers: ``KittyCache`` (kitty_cache.py), the growing and static layers, the window layers, the
attention function transformers calls, the ops objects that pick a kernel (backend.py).
"""

from ..lazy import lazy_exports

__all__ = ["KittyCache"]
_EXPORTS = {"KittyCache": "kitty_cache"}

__getattr__ = lazy_exports(__name__, _EXPORTS)
