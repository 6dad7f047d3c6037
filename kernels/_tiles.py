"""Triton device functions of the dequantization and unfused kernels: one dequantized page tile in registers.

(The fused decode kernel, ``kernels/decode_attention.py``, never builds dequantized tiles: it multiplies the codes.)

``_key_page_T`` is Algorithm 1 of the paper (Dequantize KeyCache Page) for one (page, KV head), returning the tile
channel-major ``(D, G)`` as Algorithm 1 does (``K^T``, the operand of ``q @ K^T``). ``_value_page`` is the per-token
counterpart for a value page, ``(G, D)``. Both return the model dtype, rounded exactly like the torch reference
(``codes * scale + zero`` in fp32, then cast).

Two ways to expand packed codes (``UNPACK_RESHAPE``):
  * ``False`` -- Algorithm 1 literally: ``shifts = [0, 2, 4, 6, 0, ...]``; every byte is loaded once per code it holds
    (4 loads of the same address, served by L1).
  * ``True``  -- the plane is read as little-endian 32-bit words ``(rows, n/16)`` (2-bit codes: code ``k`` of a row
    at bits ``2 (k % 16)`` of word ``k // 16``, the same bits as byte ``k // 4``, bits ``2 (k % 4)``), broadcast
    against the 16 shifts to ``(rows, n/16, 16)`` and reshaped to ``(rows, n)``. Rows must start 4-byte aligned
    (G % 16 == 0 for key planes, D * bits % 32 == 0 for value codes). Word loads cut the load/address instructions
    ~4x against byte loads (measured on the H200, benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Whether kernels run under Triton's interpreter: read once, at import, as Triton itself reads TRITON_INTERPRET
# when it decorates a kernel. The interpreter (triton 3.9) truncates fp32 -> bf16 casts instead of rounding to
# nearest even; under it, cast_to rounds by hand so that results stay bit-identical to torch.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
INTERPRET = tl.constexpr(INTERPRETING)  # the same flag, for use inside kernels

TLTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}  # torch -> Triton dtype


def is_power_of_two(n: int, minimum: int = 1) -> bool:
    """``n`` is a power of two and at least ``minimum``."""
    return n >= minimum and not n & (n - 1)


def check_power_of_two(sizes: dict[str, int], minimum: int, kernel: str) -> None:
    """``ValueError`` naming the first of ``sizes`` (name -> value) that is not a power of two >= ``minimum``."""
    for what, n in sizes.items():
        if not is_power_of_two(n, minimum):
            raise ValueError(f"the {kernel} needs a power-of-two {what} >= {minimum}, got {n}")


@triton.jit
def cast_to(x, DTYPE: tl.constexpr):
    """``x.to(DTYPE)`` with round-to-nearest-even, also for bf16 under the interpreter (finite fp32 ``x``)."""
    if INTERPRET and DTYPE == tl.bfloat16:
        u = x.to(tl.float32).to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000  # rtne to the top 16 bits
        y = u.to(tl.float32, bitcast=True).to(DTYPE)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def _load_packed(ptr, row_off, mask_rows, ROWS: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr,
                 UNPACK_RESHAPE: tl.constexpr):
    """Packed codes of a ``(ROWS, N)`` tile at ``ptr + row_off[r] + byte`` (rows where ``mask_rows`` is False read
    0, no memory traffic). With ``UNPACK_RESHAPE`` the bytes are read as little-endian 32-bit words,
    ``(ROWS, N / codes_per_word)`` (code ``k`` of a row at bits ``BITS * (k % codes_per_word)`` of word
    ``k // codes_per_word``; needs 4-byte aligned rows); else ``(ROWS, N)`` bytes, each loaded once per code it
    holds (Algorithm 1's ``shifts = [0, 2, 4, 6, 0, ...]``)."""
    if UNPACK_RESHAPE:
        PERW: tl.constexpr = 32 // BITS
        jw = tl.arange(0, N // PERW)
        wptr = ptr.to(tl.pointer_type(tl.int32))
        b = tl.load(wptr + (row_off // 4)[:, None] + jw[None, :], mask=mask_rows[:, None], other=0)
    else:
        PER: tl.constexpr = 8 // BITS
        k = tl.arange(0, N)
        b = tl.load(ptr + row_off[:, None] + (k // PER)[None, :], mask=mask_rows[:, None], other=0)
    return b


@triton.jit
def _expand_packed(b, ROWS: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr, UNPACK_RESHAPE: tl.constexpr):
    """Codes ``(ROWS, N)`` int32 from :func:`_load_packed`'s words / bytes."""
    CODE_MASK: tl.constexpr = (1 << BITS) - 1
    if UNPACK_RESHAPE:
        PERW: tl.constexpr = 32 // BITS
        e = tl.arange(0, PERW)
        codes3 = (b[:, :, None] >> (BITS * e)[None, None, :]) & CODE_MASK  # (ROWS, N/PERW, PERW)
        codes = tl.reshape(codes3, (ROWS, N))
    else:
        PER: tl.constexpr = 8 // BITS
        k = tl.arange(0, N)
        codes = (b.to(tl.int32) >> (BITS * (k % PER))[None, :]) & CODE_MASK
    return codes


# ----------------------------------------------------------------------------------------------------- key pages


@triton.jit
def _load_key_raw(low_ptr, high_ptr, idx_ptr, scale_ptr, zero_ptr, pbase, n0, ok,
                  G: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
                  UNPACK_RESHAPE: tl.constexpr):
    """Algorithm 1, the loads (lines 4-12 before unpacking) of tokens ``n0 .. n0+BN-1`` of one key page:
    ``(low bytes, high bytes, scale, zero)``. Nothing is read where the scalar ``ok`` is False."""
    G4: tl.constexpr = G // 4
    d = tl.arange(0, D)
    byte0 = n0 // 4  # first byte of the token block in each plane row
    okd = d < tl.where(ok, D, 0)  # all channels, or none where not ok
    # lines 4-5: metadata
    scale = tl.load(scale_ptr + pbase * D + d, mask=okd, other=0.0)
    zero = tl.load(zero_ptr + pbase * D + d, mask=okd, other=0.0)
    # lines 8: low plane, every channel
    low = _load_packed(low_ptr + pbase * (D * G4) + byte0, d * G4, okd, D, BN, 2, UNPACK_RESHAPE)
    if NB > 0:
        # lines 5-6: boost mask from boost_idx (sentinel 255 >= NB); int32 BEFORE address arithmetic (uint8 * row
        # bytes wraps at 256: slots 8+ alias slots 0-7 at G=128, as in the paper's own kernel)
        idx = tl.load(idx_ptr + pbase * D + d, mask=okd, other=255).to(tl.int32)
        boosted = idx < NB
        slot = tl.where(boosted, idx, 0)
        # line 11: high-plane rows of boosted channels through boost_idx, masked load (no branching)
        high = _load_packed(high_ptr + pbase * (NB * G4) + byte0, slot * G4, boosted, D, BN, 2, UNPACK_RESHAPE)
    else:
        high = low
    return low, high, scale, zero


@triton.jit
def _key_from_raw(low, high, scale, zero, BN: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, DTYPE: tl.constexpr,
                  UNPACK_RESHAPE: tl.constexpr):
    """Algorithm 1, lines 9, 12, 14, 15: unpack, ``X_low | X_high << 2``, ``X * scale + zero`` -> ``(D, BN)``."""
    code = _expand_packed(low, D, BN, 2, UNPACK_RESHAPE)
    if NB > 0:
        code = code | (_expand_packed(high, D, BN, 2, UNPACK_RESHAPE) << 2)
    # fp32, then the model dtype, as kitty.quant.dequantize_codes
    return cast_to(code.to(tl.float32) * scale.to(tl.float32)[:, None] + zero.to(tl.float32)[:, None], DTYPE)


@triton.jit
def _key_page_T(
    # pool pointers (docs/LAYOUT.md): k_low [P, Hkv, D, G/4], k_high [P, Hkv, NB, G/4], k_boost_idx/scale/zero [P, Hkv, D]
    low_ptr, high_ptr, idx_ptr, scale_ptr, zero_ptr, raw_ptr,
    # which (page, head): pbase = page * Hkv + head, int64; tokens n0 .. n0 + BN - 1 of the page (n0 % 4 == 0)
    pbase, n0,
    # meta-parameters
    G: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, KEY_RAW: tl.constexpr,
    DTYPE: tl.constexpr, UNPACK_RESHAPE: tl.constexpr,
):
    """Algorithm 1: the dequantized keys ``(D, BN)`` of one page in ``DTYPE`` (channel-major, ``K^T``)."""
    d = tl.arange(0, D)
    if KEY_RAW:  # key_bits=16: k_raw [P, Hkv, G, D]
        t = n0 + tl.arange(0, BN)
        kT = tl.load(raw_ptr + pbase * (G * D) + t[None, :] * D + d[:, None])
    else:
        low, high, scale, zero = _load_key_raw(low_ptr, high_ptr, idx_ptr, scale_ptr, zero_ptr, pbase, n0, True,
                                               G, BN, D, NB, UNPACK_RESHAPE)
        kT = _key_from_raw(low, high, scale, zero, BN, D, NB, DTYPE, UNPACK_RESHAPE)
    return kT


# --------------------------------------------------------------------------------------------------- value pages


@triton.jit
def _load_value_raw(codes_ptr, scale_ptr, zero_ptr, pbase, n0, ok, G: tl.constexpr, BN: tl.constexpr,
                    D: tl.constexpr, VBITS: tl.constexpr, UNPACK_RESHAPE: tl.constexpr):
    """Loads of tokens ``n0 .. n0+BN-1`` of one value page: ``(code bytes, scale, zero)``; nothing if not ``ok``."""
    DB: tl.constexpr = D * VBITS // 8
    t = n0 + tl.arange(0, BN)
    okt = t < tl.where(ok, G, 0)
    scale = tl.load(scale_ptr + pbase * G + t, mask=okt, other=0.0)
    zero = tl.load(zero_ptr + pbase * G + t, mask=okt, other=0.0)
    codes = _load_packed(codes_ptr + pbase * (G * DB), t * DB, okt, BN, D, VBITS, UNPACK_RESHAPE)
    return codes, scale, zero


@triton.jit
def _value_from_raw(codes, scale, zero, BN: tl.constexpr, D: tl.constexpr, VBITS: tl.constexpr, DTYPE: tl.constexpr,
                    UNPACK_RESHAPE: tl.constexpr):
    code = _expand_packed(codes, BN, D, VBITS, UNPACK_RESHAPE)  # (BN, D)
    return cast_to(code.to(tl.float32) * scale.to(tl.float32)[:, None] + zero.to(tl.float32)[:, None], DTYPE)


@triton.jit
def _value_page(
    # pool pointers: v_codes [P, Hkv, G, D*VBITS/8], v_scale/v_zero [P, Hkv, G], v_raw [P, Hkv, G, D]
    codes_ptr, scale_ptr, zero_ptr, raw_ptr,
    pbase, n0,
    G: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, VBITS: tl.constexpr, VALUE_RAW: tl.constexpr,
    DTYPE: tl.constexpr, UNPACK_RESHAPE: tl.constexpr,
):
    """The dequantized values ``(BN, D)`` of tokens ``n0 ..`` of one page in ``DTYPE`` (per-token scale/zero)."""
    if VALUE_RAW:
        t = n0 + tl.arange(0, BN)
        d = tl.arange(0, D)
        v = tl.load(raw_ptr + pbase * (G * D) + t[:, None] * D + d[None, :])
    else:
        codes, scale, zero = _load_value_raw(codes_ptr, scale_ptr, zero_ptr, pbase, n0, True, G, BN, D, VBITS,
                                             UNPACK_RESHAPE)
        v = _value_from_raw(codes, scale, zero, BN, D, VBITS, DTYPE, UNPACK_RESHAPE)
    return v


@triton.jit
def fp_values(vq_ptr, vl_ptr, rel, m, mv, d, G: tl.constexpr, D: tl.constexpr, R: tl.constexpr):
    """Values (len(rel), D) of positions S + rel (rel = p - S): v_qbuf slot rel % G where rel < mv, else v_local
    slot rel % R where rel < m; 0 elsewhere."""
    in_q = rel < mv
    v = tl.load(vq_ptr + (rel % G)[:, None] * D + d[None, :], mask=in_q[:, None], other=0.0)
    if R > 0:
        in_l = (rel >= mv) & (rel < m)
        v += tl.load(vl_ptr + (rel % R)[:, None] * D + d[None, :], mask=in_l[:, None], other=0.0)
    return v


@triton.jit
def program_row(len_ptr, Hkv, S: tl.constexpr):
    """Program ids -> ``(pid_bh, split, row b, KV head h, b as int64, the row's length n, tokens past the sink m)``
    for a decode program over (row, KV head) x split."""
    pid_bh = tl.program_id(0)
    b = pid_bh // Hkv
    n = tl.load(len_ptr + b)
    return pid_bh, tl.program_id(1), b, pid_bh % Hkv, b.to(tl.int64), n, tl.maximum(n - S, 0)
