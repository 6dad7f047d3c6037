"""The page math and the storage contract: presets and their configs, quantization and bit packing, the pool's tensors,
the memory model, page arithmetic. Imports torch only; ``kernels/`` may import this package and nothing else of
``kitty``.
"""

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


def __getattr__(name: str):
    # names load on first use, so importing one module of the package does not import the others
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
