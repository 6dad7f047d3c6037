"""Triton device functions of the dequantization and unfused kernels: one dequantized page tile in registers.

(The fused decode kernel, ``kernels/decode_attention.py``, never builds dequantized tiles: it multiplies the codes.)

``_key_page_T`` is Algorithm 1 of the paper (Dequantize KeyCache Page) for one (page, KV head), returning the tile
channel-major ``(D, G)`` as Algorithm 1 does (``K^T``, the operand of ``q @ K^T``). ``_value_page`` is the per-token
counterpart for a value page, ``(G, D)``. Both return the model dtype, rounded exactly like the torch reference
(``codes * scale + zero`` in fp32, then cast).

Every plane is quarter-strided (``docs/LAYOUT.md``): a row of ``N`` 2-bit codes is ``N/4`` bytes whose bits ``2s``
hold codes ``s N/4 .. (s+1) N/4 - 1`` (4-bit: bits ``4s``, halves). Key rows are tokens (codes along channels),
value rows are channels (codes along tokens). Two ways to expand them (``UNPACK_RESHAPE``):
  * ``False`` -- Algorithm 1 literally: code ``k`` of a row from byte ``k % (N/4)`` shifted by ``2 (k // (N/4))``;
    every byte is loaded once per code it holds (4 loads of the same address, served by L1).
  * ``True``  -- every byte once: the ``(rows, N/4)`` byte tile, broadcast against the 4 shifts to
    ``(rows, 4, N/4)`` (the row's quarters, in order) and reshaped to ``(rows, N)``. A block of a value page that
    is smaller than a quarter lies inside one quarter: its bytes are read once with one shift.
The compact high plane is gathered per channel (byte ``slot % ceil(nb/4)``, shift ``2 (slot // ceil(nb/4))``)
either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING

# kernels/launch.py's reading of TRITON_INTERPRET, for use inside kernels. The interpreter (triton 3.9) truncates
# fp32 -> bf16 casts instead of rounding to nearest even; under it, cast_to rounds by hand so that results stay
# bit-identical to torch.
INTERPRET = tl.constexpr(INTERPRETING)

TLTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}  # torch -> Triton dtype


def is_power_of_two(n: int, minimum: int = 1) -> bool:
    """``n`` is a power of two and at least ``minimum``."""
    return n >= minimum and not n & (n - 1)


def check_power_of_two(sizes: dict[str, int], minimum: int, kernel: str) -> None:
    """``ValueError`` naming the first of ``sizes`` (name -> value) that is not a power of two >= ``minimum``."""
    for what, n in sizes.items():
        if not is_power_of_two(n, minimum):
            raise ValueError(f"the {kernel} needs a power-of-two {what} >= {minimum}, got {n}")


def check_page_layout(
    kernel: str, boost_bits: int = 4, grouped_values: bool = False, key_rounding: str = "nearest"
) -> None:
    """``ValueError`` for pages only ``kitty.core.quant`` packs and reads: naming ``boost_bits`` unless it is 4 (the
    kernels read and write ``k_high`` as 2-bit slots, bits 2-3 of a 4-bit code; ``boost_bits=3`` has 1-bit slots),
    ``value_groups`` / ``value_scale_bits`` for ``grouped_values`` (``KVQuantConfig.grouped_values``: the
    kernels read one dtype scale and zero per value token), and ``key_rounding`` unless it is ``"nearest"`` (a pack
    rounds each key entry to its nearest level; the layout is the same, so readers need not pass it)."""
    if boost_bits != 4:
        raise ValueError(
            f"the {kernel} handles 4-bit boosted channels (2-bit slots in k_high), got boost_bits={boost_bits}: "
            "use the torch backend (kitty.core.quant)"
        )
    if grouped_values:
        raise ValueError(
            f"the {kernel} reads one scale and zero per value token in the model dtype, got value_groups or "
            "value_scale_bits changed: use the torch backend (kitty.core.quant)"
        )
    if key_rounding != "nearest":
        raise ValueError(
            f"the {kernel} rounds each key entry to its nearest level, got key_rounding={key_rounding!r}: use the "
            "torch backend (kitty.core.quant)"
        )


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
    """Packed codes of a ``(ROWS, N)`` tile: row ``r``'s ``N`` codes are the ``NQ = N * BITS / 8`` bytes at
    ``ptr + row_off[r]``, quarter-strided (code ``e * NQ + j`` at bits ``BITS * e`` of byte ``j``). Rows where
    ``mask_rows`` is False read 0, no memory traffic. With ``UNPACK_RESHAPE`` every byte is loaded once,
    ``(ROWS, NQ)``; else ``(ROWS, N)``, byte ``k % NQ`` for code ``k`` (each byte loaded once per code it holds)."""
    PER: tl.constexpr = 8 // BITS
    NQ: tl.constexpr = N // PER
    if UNPACK_RESHAPE:
        j = tl.arange(0, NQ)
        b = tl.load(ptr + row_off[:, None] + j[None, :], mask=mask_rows[:, None], other=0)
    else:
        k = tl.arange(0, N)
        b = tl.load(ptr + row_off[:, None] + (k % NQ)[None, :], mask=mask_rows[:, None], other=0)
    return b


@triton.jit
def _expand_packed(b, ROWS: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr, UNPACK_RESHAPE: tl.constexpr):
    """Codes ``(ROWS, N)`` int32 from :func:`_load_packed`'s bytes: with ``UNPACK_RESHAPE`` the ``8 / BITS`` shifts
    of the ``(ROWS, NQ)`` bytes are the row's parts in order, ``(ROWS, 8 / BITS, NQ)``, reshaped to ``(ROWS, N)``;
    else byte ``k % NQ`` shifted by ``BITS * (k // NQ)``."""
    CODE_MASK: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS
    NQ: tl.constexpr = N // PER
    if UNPACK_RESHAPE:
        e = tl.arange(0, PER)
        parts = (b.to(tl.int32)[:, None, :] >> (BITS * e)[None, :, None]) & CODE_MASK  # [r, e, j] = code e*NQ + j
        codes = tl.reshape(parts, (ROWS, N))
    else:
        k = tl.arange(0, N)
        codes = (b.to(tl.int32) >> (BITS * (k // NQ))[None, :]) & CODE_MASK
    return codes


# ----------------------------------------------------------------------------------------------------- key pages


@triton.jit
def _load_key_bytes(low_ptr, high_ptr, idx_ptr, scale_ptr, zero_ptr, pbase, n0, ok,
                  G: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
                  UNPACK_RESHAPE: tl.constexpr):
    """Algorithm 1, the loads (lines 4-12 before unpacking) of tokens ``n0 .. n0+BN-1`` of one key page:
    ``(low bytes, high bytes (BN, D), high shift (D,), scale, zero)``. Both planes are token-major: a token's low row
    holds its ``D`` channels (channel ``s * D/4 + j`` at bits ``2s`` of byte ``j``), its high row the ``nb`` boosted
    channels by slot (slot ``s * NBQ + j`` at bits ``2s`` of byte ``j``, ``NBQ = ceil(nb / 4)``). Nothing is read
    where the scalar ``ok`` is False."""
    D4: tl.constexpr = D // 4
    NBQ: tl.constexpr = (NB + 3) // 4
    d = tl.arange(0, D)
    t = n0 + tl.arange(0, BN)
    okd = d < tl.where(ok, D, 0)  # all channels, or none where not ok
    okt = t < tl.where(ok, G, 0)
    # lines 4-5: metadata
    scale = tl.load(scale_ptr + pbase * D + d, mask=okd, other=0.0)
    zero = tl.load(zero_ptr + pbase * D + d, mask=okd, other=0.0)
    # line 8: low plane, every channel of the block's token rows
    low = _load_packed(low_ptr + pbase * (G * D4), t * D4, okt, BN, D, 2, UNPACK_RESHAPE)
    if NB > 0:
        # lines 5-6: boost mask from boost_idx (sentinel 255 >= NB); int32 BEFORE address arithmetic (uint8 address
        # terms wrap at 256)
        idx = tl.load(idx_ptr + pbase * D + d, mask=okd, other=255).to(tl.int32)
        boosted = idx < NB
        slot = tl.where(boosted, idx, 0)
        # line 11: each boosted channel's byte of the high rows through boost_idx, masked load (no branching)
        high = tl.load(high_ptr + pbase * (G * NBQ) + t[:, None] * NBQ + (slot % NBQ)[None, :],
                       mask=okt[:, None] & boosted[None, :], other=0)  # (BN, D)
        hshift = 2 * (slot // NBQ)
    else:
        high = low
        hshift = d
    return low, high, hshift, scale, zero


@triton.jit
def _key_from_bytes(low, high, hshift, scale, zero, BN: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
                  DTYPE: tl.constexpr, UNPACK_RESHAPE: tl.constexpr):
    """Algorithm 1, lines 9, 12, 14, 15: unpack, ``X_low | X_high << 2``, ``X * scale + zero`` -> ``(BN, D)``."""
    code = _expand_packed(low, BN, D, 2, UNPACK_RESHAPE)
    if NB > 0:
        code = code | (((high.to(tl.int32) >> hshift[None, :]) & 3) << 2)  # unboosted channels read 0
    # fp32, then the model dtype, as kitty.core.ranges.dequantize_codes
    return cast_to(code.to(tl.float32) * scale.to(tl.float32)[None, :] + zero.to(tl.float32)[None, :], DTYPE)


@triton.jit
def _key_page_T(
    # pool pointers (docs/LAYOUT.md): k_low [P, Hkv, G, D/4], k_high [P, Hkv, G, ceil(NB/4)], k_boost_idx/scale/zero [P, Hkv, D]
    low_ptr, high_ptr, idx_ptr, scale_ptr, zero_ptr, raw_ptr,
    # which (page, head): pbase = page * Hkv + head, int64; tokens n0 .. n0 + BN - 1 of the page
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
        low, high, hshift, scale, zero = _load_key_bytes(low_ptr, high_ptr, idx_ptr, scale_ptr, zero_ptr, pbase, n0,
                                                       True, G, BN, D, NB, UNPACK_RESHAPE)
        kT = tl.trans(_key_from_bytes(low, high, hshift, scale, zero, BN, D, NB, DTYPE, UNPACK_RESHAPE))
    return kT


# --------------------------------------------------------------------------------------------------- value pages


@triton.jit
def _load_value_bytes(codes_ptr, scale_ptr, zero_ptr, pbase, n0, ok, G: tl.constexpr, BN: tl.constexpr,
                    D: tl.constexpr, VBITS: tl.constexpr, UNPACK_RESHAPE: tl.constexpr):
    """Loads of tokens ``n0 .. n0+BN-1`` (``n0 % BN == 0``) of one value page: ``(code bytes (D, *), scale, zero)``;
    nothing if not ``ok``. ``v_codes`` rows are channels: token ``e * GQ + i`` at bits ``VBITS * e`` of byte ``i``
    (``GQ = G * VBITS / 8`` bytes a row). With ``UNPACK_RESHAPE`` the block's bytes are loaded once: a block of
    whole parts (``BN >= GQ``) reads every byte of the row, ``(D, GQ)``; a smaller block lies in one part and reads
    its ``(D, BN)`` bytes. Else ``(D, BN)``, byte ``t % GQ`` for token ``t``."""
    PER: tl.constexpr = 8 // VBITS
    GQ: tl.constexpr = G // PER
    t = n0 + tl.arange(0, BN)
    d = tl.arange(0, D)
    okt = t < tl.where(ok, G, 0)
    okd = d < tl.where(ok, D, 0)
    scale = tl.load(scale_ptr + pbase * G + t, mask=okt, other=0.0)
    zero = tl.load(zero_ptr + pbase * G + t, mask=okt, other=0.0)
    rows = codes_ptr + pbase * (D * GQ) + d[:, None] * GQ  # (D, 1)
    if UNPACK_RESHAPE:
        if BN >= GQ:
            codes = tl.load(rows + tl.arange(0, GQ)[None, :], mask=okd[:, None], other=0)
        else:
            codes = tl.load(rows + (n0 % GQ + tl.arange(0, BN))[None, :], mask=okd[:, None], other=0)
    else:
        codes = tl.load(rows + (t % GQ)[None, :], mask=okd[:, None], other=0)
    return codes, scale, zero


@triton.jit
def _value_from_bytes(codes, scale, zero, n0, G: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                    VBITS: tl.constexpr, DTYPE: tl.constexpr, UNPACK_RESHAPE: tl.constexpr):
    """Tokens ``n0 ..`` of :func:`_load_value_bytes`'s bytes, dequantized: ``(BN, D)`` in ``DTYPE``."""
    CODE_MASK: tl.constexpr = (1 << VBITS) - 1
    PER: tl.constexpr = 8 // VBITS
    GQ: tl.constexpr = G // PER
    b = codes.to(tl.int32)
    if UNPACK_RESHAPE:
        if BN >= GQ:
            e = n0 // GQ + tl.arange(0, BN // GQ)  # the block's parts, in token order
            parts = (b[:, None, :] >> (VBITS * e)[None, :, None]) & CODE_MASK  # [c, e, i] = token e*GQ + i
            code = tl.reshape(parts, (D, BN))
        else:
            code = (b >> (VBITS * (n0 // GQ))) & CODE_MASK
    else:
        t = n0 + tl.arange(0, BN)
        code = (b >> (VBITS * (t // GQ))[None, :]) & CODE_MASK
    code = tl.trans(code)  # (BN, D)
    return cast_to(code.to(tl.float32) * scale.to(tl.float32)[:, None] + zero.to(tl.float32)[:, None], DTYPE)


@triton.jit
def _value_page(
    # pool pointers: v_codes [P, Hkv, D, G*VBITS/8], v_scale/v_zero [P, Hkv, G], v_raw [P, Hkv, G, D]
    codes_ptr, scale_ptr, zero_ptr, raw_ptr,
    pbase, n0,
    G: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, VBITS: tl.constexpr, VALUE_RAW: tl.constexpr,
    DTYPE: tl.constexpr, UNPACK_RESHAPE: tl.constexpr,
):
    """The dequantized values ``(BN, D)`` of tokens ``n0 ..`` of one page in ``DTYPE`` (per-token scale/zero);
    ``n0`` a multiple of ``BN``."""
    if VALUE_RAW:
        t = n0 + tl.arange(0, BN)
        d = tl.arange(0, D)
        v = tl.load(raw_ptr + pbase * (G * D) + t[:, None] * D + d[None, :])
    else:
        codes, scale, zero = _load_value_bytes(codes_ptr, scale_ptr, zero_ptr, pbase, n0, True, G, BN, D, VBITS,
                                             UNPACK_RESHAPE)
        v = _value_from_bytes(codes, scale, zero, n0, G, BN, D, VBITS, DTYPE, UNPACK_RESHAPE)
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
