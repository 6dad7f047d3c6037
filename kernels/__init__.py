"""Triton kernels for the Kitty cache (paper arXiv 2511.18643, §4), each with its torch reference.

    pack_pages                  quantize + pack full qbuffers into key/value pages, one launch (kernels/pack.py)
    dequantize_key_page_triton  Algorithm 1 page dequantization (kernels/dequant.py)
    decode_attention            fused split-K decode attention over sink | pages | qbuffers | local (kernels/decode_attention.py)
    decode_attention_unfused    the paper's qk kernel -> torch softmax -> sv kernel path (kernels/unfused.py)
    decode_attention_ref        torch reference; KittyLayerState = the tensors of docs/LAYOUT.md (kernels/reference.py)

Importing this package launches nothing and needs no GPU. Kernels run on CUDA tensors, or on CPU tensors when
``TRITON_INTERPRET=1`` is set before ``triton``/``kernels`` are first imported. Without Triton installed, only the
torch references are available and ``decode_attention`` runs the reference.
"""

from .reference import KittyLayerState, check_state, decode_attention_ref

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # e.g. macOS: no Triton wheels
    HAS_TRITON = False

if HAS_TRITON:
    from .decode_attention import BACKENDS, decode_attention, decode_attention_triton, triton_supports
    from .dequant import dequantize_key_page_triton, dequantize_value_page_triton
    from .pack import pack_pages, pack_pages_ref
    from .unfused import decode_attention_unfused
else:
    BACKENDS = ("auto", "torch")

    def triton_supports(cfg, head_dim, compiled=None) -> bool:
        return False

    def decode_attention(q, state, cfg, scaling=None, backend="auto", full_qbuffer=False, **kernel_options):
        """Torch reference only (Triton is not installed)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} without Triton installed, got {backend!r}")
        check_state(q, state, cfg)
        return decode_attention_ref(q, state, cfg, scaling, full_qbuffer=full_qbuffer)

__all__ = ["HAS_TRITON", "KittyLayerState", "decode_attention", "decode_attention_ref", "check_state", "triton_supports"]
if HAS_TRITON:
    __all__ += ["decode_attention_triton", "decode_attention_unfused", "pack_pages", "pack_pages_ref",
                "dequantize_key_page_triton", "dequantize_value_page_triton"]
