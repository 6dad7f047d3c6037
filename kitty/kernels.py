"""Triton kernels for the Kitty cache (paper arXiv 2511.18643, §4), each with its torch reference: ``kitty.kernels``.

    pack_pages                  quantize + pack full qbuffers into key/value pages, one launch; pack_completed: a
                                static layer's filled qbuffers, predicated on the device (kernels/pack.py)
    insert_token                a decode step's new token into sink / qbuffer / local slots of every row and
                                lengths += 1, one launch (kernels/insert.py)
    dequantize_key_page_triton  Algorithm 1 page dequantization (kernels/dequant.py)
    decode_attention_triton     fused split-K decode attention over sink | pages | qbuffers | local, and
                                triton_supports, the configs it handles (kernels/decode_attention.py; its
                                code-to-operand primitives: kernels/operands.py)
    decode_attention_unfused    the paper's qk kernel -> torch softmax -> sv kernel path (kernels/unfused.py)
    decode_attention_ref        the torch references: decode_attention_ref, pack_pages_ref, pack_completed_ref,
                                insert_token_ref, merge_splits_ref (the split-K merge);
                                dequantize_cache reads a layer back in position order (kernels/reference.py);
                                KittyLayerState = the tensors of docs/LAYOUT.md
    launch.Launch               the fused kernel's launch and its heuristic, default_launch (kernels/launch.py)

Which kernel a layer runs is decided once, in ``kitty/cache/backend.py`` (the ops objects); this package holds no
dispatcher. ``kernels/`` imports only the data contract of ``kitty``: ``kitty.core.config``, ``kitty.core.quant``,
``kitty.core.storage``, ``kitty.core.memory``, ``kitty.core.pages`` (``tests/test_package.py`` checks it).

The code lives in the repository's top-level ``kernels/`` folder; this module makes that folder the package
``kitty.kernels`` (its ``__path__``), so that the name ``kernels`` stays free for Hugging Face's hub package,
which transformers imports by that name. ``kernels/`` has no ``__init__.py`` on purpose: from the repository root
it is then only a namespace directory, and an installed ``kernels`` hub package takes precedence over it (README,
"Installing"; docs/ARCHITECTURE.md says why the folder is top-level). An installed wheel holds the folder as
``kitty/_kernels`` (the one ``package-dir`` entry of ``pyproject.toml``).

Importing this module imports neither Triton nor any kernel: names load on first use. Kernels run on CUDA
tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` is set before Triton is first imported. Without Triton
installed only the torch references are available (``kitty/cache/backend.py`` then runs the torch backend).
"""

from __future__ import annotations

import os
import sys
import types
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# an installed wheel: kitty/_kernels; a source checkout or an editable install: <repository>/kernels
__path__ = [str(p) for p in (_HERE / "_kernels", _HERE.parent / "kernels") if (p / "reference.py").is_file()][:1]

HAS_TRITON = find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``): the kernels' own reading,
    taken once when they are imported (as Triton reads it), or the environment's before that."""
    launch = sys.modules.get(__name__ + ".launch")
    return launch.INTERPRETING if launch is not None else os.environ.get("TRITON_INTERPRET", "0") == "1"


_EXPORTS = {  # name -> the submodule defining it; every submodule but the reference needs Triton
    "KittyLayerState": "reference",
    "check_state": "reference",
    "decode_attention_ref": "reference",
    "dequantize_cache": "reference",
    "pack_pages_ref": "reference",
    "pack_completed_ref": "reference",
    "insert_token_ref": "reference",
    "merge_splits_ref": "reference",
    "decode_attention_triton": "decode_attention",
    "triton_supports": "decode_attention",
    "dequantize_key_page_triton": "dequant",
    "dequantize_value_page_triton": "dequant",
    "pack_pages": "pack",
    "pack_completed": "pack",
    "insert_token": "insert",
    "decode_attention_unfused": "unfused",
}
__all__ = ["HAS_TRITON", "interpreting", *(n for n, m in _EXPORTS.items() if HAS_TRITON or m == "reference")]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not HAS_TRITON and _EXPORTS[name] != "reference":
        raise AttributeError(f"kitty.kernels.{name} needs Triton, which is not installed (torch: decode_attention_ref)")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)


class _Kernels(types.ModuleType):
    """This module's type: the import system binds every loaded submodule as an attribute of its package, which
    would hide an exported function behind a submodule of the same name; exported names win."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and name in _EXPORTS:
            return  # the submodule stays reachable through sys.modules / importlib.import_module
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Kernels
