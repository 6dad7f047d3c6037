"""The page math and the storage contract: presets and their configs, quantization and bit packing, the pool's tensors,
the memory model, page arithmetic. Imports torch only; ``kernels/`` may import this package and nothing else of
``kitty``.
"""

from ..lazy import lazy_exports

__all__ = [
    "KVQuantConfig",
    "KittyLayerState",
    "MemoryReport",
    "PRESETS",
    "analytic_report",
    "asymptotic_bits",
    "get_preset",
    "token_layout",
]
_EXPORTS = {
    "PRESETS": "config",
    "KVQuantConfig": "config",
    "get_preset": "config",
    "MemoryReport": "memory",
    "analytic_report": "memory",
    "token_layout": "memory",
    "asymptotic_bits": "memory",
    "KittyLayerState": "storage",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
