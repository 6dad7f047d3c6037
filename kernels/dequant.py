"""Page dequantization in Triton: Algorithm 1 of the paper (Dequantize KeyCache Page), and its value-page twin.

Torch references: ``kitty.core.quant.dequantize_key_page`` / ``dequantize_value_page`` (re-exported here as ``*_ref``).

Algorithm 1, one program per (page, KV head) (see ``kernels/_tiles.py::_key_page_T`` for the line mapping):

    scale, zero  = load per-channel metadata                         # (D,)
    boost_idx    = load(boost_idx).to(int32)                         # cast BEFORE address arithmetic
    boost_mask   = boost_idx < nb                                    # sentinel 255 -> not boosted
    X_low[t, s*D/4 + j] = (low[t, j] >> 2s) & 3                      # (G, D): quarters of a token's row
    X_high[t, c] = (high[t, slot % nq] >> 2 (slot // nq)) & 3        # slot = boost_idx[c], nq = ceil(nb/4);
                                                                     # masked (unboosted) channels read 0
    X            = X_low | X_high << 2                               # no per-element branching
    K^T          = X * scale + zero                                  # (D, G), stored transposed as (G, D)

Values: ``v_codes`` rows are channels, token ``e*G/4 + i`` at bits ``2e`` of byte ``i`` (4-bit: ``e*G/2 + i``, bits
``4e``); ``V[t, c] = code * scale[t] + zero[t]``.

Used by notebooks and tests (the attention kernels call the same device functions on tiles in registers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kitty.core.quant import KeyPage, ValuePage, high_plane_bytes
from kitty.core.quant import dequantize_key_page as dequantize_key_page_ref
from kitty.core.quant import dequantize_value_page as dequantize_value_page_ref

from ._tiles import TLTYPE, _key_page_T, _value_page, check_page_layout, check_power_of_two

__all__ = ["dequantize_key_page_triton", "dequantize_value_page_triton", "dequantize_key_page_ref", "dequantize_value_page_ref"]



@triton.jit
def _dequant_key_kernel(
    # pointers
    low_ptr, high_ptr, idx_ptr, scale_ptr, zero_ptr, out_ptr,
    # meta-parameters
    G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, DTYPE: tl.constexpr, UNPACK_RESHAPE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # flattened (page, head)
    kT = _key_page_T(low_ptr, high_ptr, idx_ptr, scale_ptr, zero_ptr, low_ptr, pid, 0,
                     G, G, D, NB, False, DTYPE, UNPACK_RESHAPE)  # (D, G)
    d = tl.arange(0, D)
    t = tl.arange(0, G)
    tl.store(out_ptr + pid * (G * D) + t[None, :] * D + d[:, None], kT)


@triton.jit
def _dequant_value_kernel(
    codes_ptr, scale_ptr, zero_ptr, out_ptr,
    G: tl.constexpr, D: tl.constexpr, VBITS: tl.constexpr, DTYPE: tl.constexpr, UNPACK_RESHAPE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    v = _value_page(codes_ptr, scale_ptr, zero_ptr, codes_ptr, pid, 0, G, G, D, VBITS, False, DTYPE, UNPACK_RESHAPE)
    t = tl.arange(0, G)
    d = tl.arange(0, D)
    tl.store(out_ptr + pid * (G * D) + t[:, None] * D + d[None, :], v)


def _checked_output(page: KeyPage | ValuePage, lead: list[int], per: int, G: int, D: int) -> torch.Tensor:
    """Check ``scale``/``zero`` ``[*lead, per]``, the dtype and the power-of-two sizes; allocate ``[*lead, G, D]``."""
    if tuple(page.scale.shape) != (*lead, per) or tuple(page.zero.shape) != (*lead, per):
        raise ValueError(f"scale/zero must be {(*lead, per)}, got {tuple(page.scale.shape)} / {tuple(page.zero.shape)}")
    if page.dtype not in TLTYPE:
        raise ValueError(f"page dtype must be one of {tuple(TLTYPE)}, got {page.dtype}")
    check_power_of_two({"group_size": G, "head_dim": D}, 4, "Triton dequantization kernel")
    return torch.empty(*lead, G, D, dtype=page.dtype, device=page.scale.device)


def dequantize_key_page_triton(page: KeyPage, unpack_reshape: bool = True) -> torch.Tensor:
    """Reconstruct keys ``[..., G, D]`` in ``page.dtype`` from a :class:`kitty.core.quant.KeyPage` (Algorithm 1).

    ``unpack_reshape``: read each packed byte once and reshape its quarters (``kernels/_tiles.py``), or once per
    code it holds."""
    if page.raw.numel():
        return page.raw
    check_page_layout("Triton dequantizer", boost_bits=page.boost_bits)
    low, high, idx = page.low, page.high, page.boost_idx
    if low.dtype != torch.uint8 or high.dtype != torch.uint8 or idx.dtype != torch.uint8:
        raise ValueError("low, high and boost_idx must be uint8")
    *lead, G, D4 = low.shape
    D, nb = 4 * D4, page.num_boosted
    if tuple(high.shape) != (*lead, G, high_plane_bytes(nb)) or tuple(idx.shape) != (*lead, D):
        raise ValueError(
            f"inconsistent page of {nb} boosted channels: low {tuple(low.shape)}, high {tuple(high.shape)}, "
            f"boost_idx {tuple(idx.shape)}"
        )
    out = _checked_output(page, lead, D, G, D)
    n = low.numel() // (G * D4)
    if n == 0:
        return out
    low, high, idx = low.contiguous(), high.contiguous(), idx.contiguous()
    if nb == 0:
        high = low  # never read (NB == 0); any valid pointer
    _dequant_key_kernel[(n,)](
        low, high, idx, page.scale.contiguous(), page.zero.contiguous(), out,
        G=G, D=D, NB=nb, DTYPE=TLTYPE[page.dtype], UNPACK_RESHAPE=unpack_reshape,
    )
    return out


def dequantize_value_page_triton(page: ValuePage, unpack_reshape: bool = True) -> torch.Tensor:
    """Reconstruct values ``[..., G, D]`` in ``page.dtype`` from a :class:`kitty.core.quant.ValuePage`
    (``unpack_reshape`` as in :func:`dequantize_key_page_triton`)."""
    if page.raw.numel():
        return page.raw
    check_page_layout("Triton dequantizer", grouped_values=page.grouped)
    codes = page.codes
    if codes.dtype != torch.uint8:
        raise ValueError("codes must be uint8")
    *lead, D, GB = codes.shape
    G = GB * 8 // page.bits
    out = _checked_output(page, lead, G, G, D)
    n = codes.numel() // (D * GB)
    if n == 0:
        return out
    _dequant_value_kernel[(n,)](
        codes.contiguous(), page.scale.contiguous(), page.zero.contiguous(), out,
        G=G, D=D, VBITS=page.bits, DTYPE=TLTYPE[page.dtype], UNPACK_RESHAPE=unpack_reshape,
    )
    return out
