"""Device functions of the Gluon decode kernel (``kernels/decode_gluon.py``): page bytes to ``mma_v2`` operands in
registers, one warp.

The unpack is one shift and eight ``and`` per 32-bit word of 16 codes: ``w & (0x00030003 << 2s)`` read as two
16-bit lanes is field ``s`` of bytes 0 and 2 as a subnormal, fp16 ``4^s code 2^-24`` and bf16 ``4^s code 2^-133``
(bits 0-7 of a bf16 read as ``n 2^-133`` for every byte value ``n``: the subnormals and the first normal binade share
one spacing), exact with no offset (the ``4^s`` is folded into the small operand, bf16's with ``2^90`` more so that
the products stay normal in fp32, and the unit is undone on the fp32 product); the same on ``w >> 8`` gives bytes 1
and 3. The earlier bf16 form (``MAGIC``): ``lop3(w, mask_s, MAGIC_s)`` with ``0x4300, 0x4200, 0x4100`` gives ``128,
32, 8 + code`` for a field at bit 0, 2, 4 of its byte: fields 0-2 of bytes 0 and 2 in place, field 3 from ``w >> 6``;
bytes 1 and 3 from ``w >> 6`` (fields 0, 1 at bits 2, 4) and ``w >> 10`` (fields 2, 3), offsets 32, 8, 32, 8
(``gluon_launch.BF16_LOW_SOURCE``), two shifts a word as ``mul.hi.u32``; its offsets' share is a tensor-core product
with a constant operand (``kernels/_gluon_page.py``).

The bytes a lane loads and the register order of the unpacked halves are chosen so that a reshape and a permute
make the codes the ``DotOperandLayout(0, mma, 2)`` fragment: ``convert_layout(..., assert_trivial=True)`` proves
no data moves (``kernels/gluon_launch.py`` says which byte feeds which column; ``tests/test_gluon.py`` checks it).

Also here: the orders of the small operands (``low_channel``, ``adjacent_channel``, ``zero_channel``, the page
loop's ``token_perm``), the zero term's fragment, the one-hot of the high-plane gather and packed 16-bit products.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# per output register: fields 0..3 of bytes (0, 2) of w, then of bytes (1, 3) (h = w >> 8), fp16 and bf16 alike; the
# shift is a shr (SHF, the ALU pipe): as mul.hi.u32 by 2^24 (IMAD.HI, the FMA pipe) it lowered the ALU share but was
# equal or 1-3% slower on an H100 (docs/GLUON.md)
LOW_ASM = gl.constexpr(
    "{ .reg .b32 h; shr.b32 h, $8, 8; "
    "and.b32 $0, $8, 0x00030003; and.b32 $1, h, 0x00030003; "
    "and.b32 $2, $8, 0x000C000C; and.b32 $3, h, 0x000C000C; "
    "and.b32 $4, $8, 0x00300030; and.b32 $5, h, 0x00300030; "
    "and.b32 $6, $8, 0x00C000C0; and.b32 $7, h, 0x00C000C0; }"
)
# bf16 with magic numbers (MAGIC): the fields ORed into 0x4300 / 0x4200 / 0x4100, two shifts a word as mul.hi.u32
LOW_ASM_BF16_MAGIC = gl.constexpr(
    "{ .reg .b32 a, b; mul.hi.u32 a, $8, 0x04000000; mul.hi.u32 b, $8, 0x00400000; "
    "lop3.b32 $0, $8, 0x00030003, 0x43004300, 0xEA; lop3.b32 $1, a, 0x000C000C, 0x42004200, 0xEA; "
    "lop3.b32 $2, $8, 0x000C000C, 0x42004200, 0xEA; lop3.b32 $3, a, 0x00300030, 0x41004100, 0xEA; "
    "lop3.b32 $4, $8, 0x00300030, 0x41004100, 0xEA; lop3.b32 $5, b, 0x000C000C, 0x42004200, 0xEA; "
    "lop3.b32 $6, a, 0x00030003, 0x43004300, 0xEA; lop3.b32 $7, b, 0x00300030, 0x41004100, 0xEA; }"
)
# the high plane: the lane's field masked in place ($6: 0x00030003 << 2q), read as the subnormal 4^q code times the
# unit, fp16 and bf16 alike (bytes 1, 3: the shift of LOW_ASM)
HIGH_ASM = gl.constexpr("{ .reg .b32 h; shr.b32 h, $2, 8; and.b32 $0, $2, $6; and.b32 $1, h, $6; }")
# bf16 with magic numbers: field 0 of a word the lane has already shifted to its field (bytes 1, 3: the mul.hi shift)
HIGH_ASM_BF16_MAGIC = gl.constexpr(
    "{ .reg .b32 h; mul.hi.u32 h, $2, 0x01000000; lop3.b32 $0, $2, 0x00030003, 0x43004300, 0xEA; "
    "lop3.b32 $1, h, 0x00030003, 0x43004300, 0xEA; }"
)
# a bf16 pair (one 32-bit register) as two fp32, exactly: the low half shifted up (IMAD, the FMA pipe), the high half
# with the low bits cleared (one LOP3; the compiler's own conversion spends a PRMT and an IMAD on it)
F32_OF_BF16_ASM = gl.constexpr("{ mul.lo.u32 $0, $2, 0x10000; and.b32 $1, $2, 0xFFFF0000; }")
F16_UNIT = 2.0**-24  # fp16: a code c of field s reads as 4^s c 2^-24


@gluon.jit
def unpack_low(
    ptr,
    row0,
    M: gl.constexpr,
    BPR: gl.constexpr,
    IS_BF16: gl.constexpr,
    DA: gl.constexpr,
    TOKPERM: gl.constexpr,
    MAGIC: gl.constexpr,
):
    """Codes of ``M`` rows of ``BPR`` bytes at ``ptr + row0`` as the ``(M, 4 BPR)`` A fragment ``DA`` (column
    ``k``: ``gluon_launch.low_plane_order``): the field masked in place and read as a subnormal, fp16 ``4^s code
    2^-24``, bf16 ``4^s code 2^-133`` (a byte's bits 0-7 read as bf16 are ``n 2^-133`` for every ``n < 256``: the
    subnormals and the first normal binade share one spacing); or, ``MAGIC`` (bf16 only), ``OFF_s + code``.
    ``TOKPERM`` (32 rows): row ``r`` reads row ``token_perm(r)``, so the lane holding rows ``g + 8 i`` holds rows
    ``4 g + i``."""
    W: gl.constexpr = BPR // 16  # 32-bit words a lane loads per row, one contiguous run
    LP: gl.constexpr = gl.BlockedLayout([1, 1, 4 * W], [8, 4, 1], [1, 1, 1], [2, 1, 0])
    t = gl.arange(0, M, gl.SliceLayout(1, gl.SliceLayout(2, LP)))
    q = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, LP)))
    j = gl.arange(0, 4 * W, gl.SliceLayout(0, gl.SliceLayout(1, LP)))
    if TOKPERM:
        t = token_perm(t)
    off = t[:, None, None] * BPR + q[None, :, None] * (4 * W) + j[None, None, :]
    x = gl.reshape(gl.load(ptr + row0 + off), [M, 4, W, 4])
    if MAGIC:
        a0, a1, a2, a3 = gl.inline_asm_elementwise(
            LOW_ASM_BF16_MAGIC, "=r,=r,=r,=r,=r,=r,=r,=r,r", [x], dtype=(gl.bfloat16,) * 4, is_pure=True, pack=4
        )
    elif IS_BF16:  # the same PTX, one branch per dtype: triton 3.6's inline_asm_elementwise takes no constexpr dtype
        a0, a1, a2, a3 = gl.inline_asm_elementwise(
            LOW_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [x], dtype=(gl.bfloat16,) * 4, is_pure=True, pack=4
        )
    else:
        a0, a1, a2, a3 = gl.inline_asm_elementwise(
            LOW_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [x], dtype=(gl.float16,) * 4, is_pure=True, pack=4
        )
    a = gl.join(gl.join(a0, a1), gl.join(a2, a3))  # (M, q, kt, b, s0, s1)
    a = gl.reshape(a, [M, 4, W, 2, 2, 2, 2])  # b = 2 h + e
    a = gl.permute(a, [0, 6, 5, 2, 3, 1, 4])  # (M, s1, s0, kt, h, q, e)
    a = gl.reshape(a, [M, 4 * BPR])
    return gl.convert_layout(a, DA, assert_trivial=True)


@gluon.jit
def unpack_high(
    ptr,
    row0,
    M: gl.constexpr,
    NWH: gl.constexpr,
    RW: gl.constexpr,
    IS_BF16: gl.constexpr,
    DA: gl.constexpr,
    TOKPERM: gl.constexpr,
    MAGIC: gl.constexpr,
):
    """High-plane codes of ``M`` token rows as the ``(M, 16 NWH)`` A fragment ``DA`` (``gluon_launch.
    high_plane_order``): ``ptr`` reads a row as ``RW`` elements of 8, 16 or 32 bits (``NWH`` words), lane ``q``
    unpacks field ``q``: masked in place, no shift, fp16 ``4^q code 2^-24`` or bf16 ``4^q code 2^-133``; ``MAGIC``
    (bf16) ``128 + code``. ``TOKPERM``: rows as ``unpack_low``."""
    if TOKPERM and RW == NWH and M == 32:
        # a lane's rows g + 8 i are the 4 adjacent tokens 4 g + i: one contiguous run of 4 NWH words
        LH: gl.constexpr = gl.BlockedLayout([1, 1, 4 * NWH, 4], [8, 4, 1, 1], [1, 1, 1, 1], [3, 2, 1, 0])
        L3: gl.constexpr = gl.SliceLayout(3, LH)
        g = gl.arange(0, 8, gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        q = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        j = gl.arange(0, 4 * NWH, gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        off = g[:, None, None] * (4 * RW) + j[None, None, :] + q[None, :, None] * 0
    else:
        LH: gl.constexpr = gl.BlockedLayout([1, 1, NWH, 4], [8, 4, 1, 1], [1, 1, 1, 1], [3, 2, 1, 0])
        L3: gl.constexpr = gl.SliceLayout(3, LH)
        t = gl.arange(0, M, gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        q = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        w = gl.arange(0, NWH, gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        if TOKPERM:
            t = token_perm(t)
        off = t[:, None, None] * RW + w[None, None, :] + q[None, :, None] * 0
    word = gl.load(ptr + row0 + off).to(gl.int32)
    b = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LH))))
    if MAGIC:
        word = word >> (2 * q)[None, :, None]  # lane q's field to bits 0-1 of each byte
        x = word[:, :, :, None] + (b * 0)[None, None, None, :]
        a = gl.inline_asm_elementwise(
            HIGH_ASM_BF16_MAGIC, "=r,=r,r,r,r,r", [x], dtype=gl.bfloat16, is_pure=True, pack=4
        )
    else:  # field q masked in place: 4^q code times the unit (the caller's operand carries 4^-q)
        x = word[:, :, :, None] + (b * 0)[None, None, None, :]
        mask = (0x00030003 << (2 * q))[None, :, None, None] + (x * 0)
        if IS_BF16:  # one branch per dtype, as in unpack_low
            a = gl.inline_asm_elementwise(
                HIGH_ASM, "=r,=r,r,r,r,r,r,r,r,r", [x, mask], dtype=gl.bfloat16, is_pure=True, pack=4
            )
        else:
            a = gl.inline_asm_elementwise(
                HIGH_ASM, "=r,=r,r,r,r,r,r,r,r,r", [x, mask], dtype=gl.float16, is_pure=True, pack=4
            )
    if TOKPERM and RW == NWH and M == 32:
        a = gl.reshape(a, [8, 4, 4, NWH, 2, 2])  # (g, q, i, kt, h, e)
        a = gl.permute(a, [2, 0, 3, 4, 1, 5])  # (i, g, kt, h, q, e): row 8 i + g
    else:
        a = gl.reshape(a, [M, 4, NWH, 2, 2])
        a = gl.permute(a, [0, 2, 3, 1, 4])  # (M, kt, h, q, e)
    a = gl.reshape(a, [M, 16 * NWH])
    return gl.convert_layout(a, DA, assert_trivial=True)


@gluon.jit
def token_perm(r):
    """Token of score row ``r`` of a 32-token chunk in the page loop: ``4 (r % 8) + r // 8``, so that the lane
    holding rows ``g + 8 i`` (the accumulator layout) holds the 4 adjacent tokens ``4 g + i``."""
    return 4 * (r % 8) + r // 8


@gluon.jit
def token_vector(ptr, base, OUT: gl.constexpr):
    """``ptr[base + token_perm(r)]`` for the 32 rows ``r`` of a chunk, in ``OUT`` (the row slice of the scores'
    layout, lane ``g`` holding rows ``g + 8 i``): each lane loads its 4 adjacent tokens as one run."""
    L2: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0])
    g = gl.arange(0, 8, gl.SliceLayout(1, L2))
    i = gl.arange(0, 4, gl.SliceLayout(0, L2))
    x = gl.load(ptr + base + 4 * g[:, None] + i[None, :])  # (g, i): token 4 g + i = token_perm(8 i + g)
    x = gl.reshape(gl.permute(x, [1, 0]), [32])
    return gl.convert_layout(x, OUT)


@gluon.jit
def low_channel(k, D4: gl.constexpr):
    """Row element (channel of a key row, token of a value row) of logical column ``k`` (``low_plane_order``)."""
    W: gl.constexpr = D4 // 16
    s = k // D4
    r = k % D4
    return 4 * W * ((r // 2) % 4) + 4 * (r // 16) + 2 * (r % 2) + (r // 8) % 2 + s * D4


@gluon.jit
def zero_channel(k, t, D4: gl.constexpr):
    """Channel of row ``k`` of half ``t`` of the zero term's operands (``zero_fragment``): with ``u = k // 8``,
    field ``u // W``, k-tile ``u % W``, lane ``(k // 2) % 4``, channel pair ``t``, ``k % 2`` the channel in it."""
    W: gl.constexpr = D4 // 16
    u = k // 8
    return (u // W) * D4 + 4 * W * ((k // 2) % 4) + 4 * (u % W) + 2 * t + k % 2


@gluon.jit
def zero_fragment(ptr, base, D4: gl.constexpr, DA: gl.constexpr):
    """The ``(16, 2 D4)`` A fragment whose row ``8 t + g`` holds ``ptr[base + zero_channel(k, t)]`` (the same for
    every ``g``): each (field, lane) loads its ``4 W`` channels as one contiguous run, and each 4-register quad of
    the fragment (rows ``g``, ``g + 8`` x columns ``2 q``, ``2 q + 8``) is 8 adjacent channels as loaded
    (``assert_trivial``). So the zeros go to the tensor cores with no register moves; the other operand holds
    the ``q`` of both channel pairs side by side (``2 N`` columns), and ``zero_rows`` adds the two halves."""
    W: gl.constexpr = D4 // 16
    LZ: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4 * W], [8, 1, 4, 1], [1, 1, 1, 1], [3, 2, 1, 0])
    g = gl.arange(0, 8, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LZ))))
    s = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LZ))))
    q = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LZ))))
    j = gl.arange(0, 4 * W, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LZ))))
    off = (
        g[:, None, None, None] * 0
        + s[None, :, None, None] * D4
        + q[None, None, :, None] * (4 * W)
        + j[None, None, None, :]
    )
    x = gl.load(ptr + base + off)
    x = gl.reshape(x, [8, 4, 4, W, 2, 2])  # (g, s, q, kt, t, h): channel s D4 + 4 W q + 4 kt + 2 t + h
    x = gl.permute(x, [4, 0, 1, 3, 2, 5])  # (t, g, s, kt, q, h): row 8 t + g, column 8 (s W + kt) + 2 q + h
    x = gl.reshape(x, [16, 2 * D4])
    return gl.convert_layout(x, DA, assert_trivial=True)


@gluon.jit
def zero_rows(c, NK: gl.constexpr, MMA: gl.constexpr):
    """The zero term from ``zero_fragment``'s product ``c`` ``(16, 2 NK)`` (columns ``t NK + n``): the sum over
    both halves is row half 0 of column half 0 plus row half 1 of column half 1; returned stacked to ``(32, NK)``
    in ``MMA`` (every row the same), the layout of the scores' accumulator."""
    c = gl.permute(gl.reshape(c, [2, 8, 2, NK]), [1, 3, 2, 0])  # (g, n, t, b): row 8 b + g, column t NK + n
    upper, lower = gl.split(c)  # row halves b = 0, 1
    top, _ = gl.split(upper)  # column half t = 0
    _, bottom = gl.split(lower)  # t = 1
    c8 = top + bottom
    c8 = gl.join(c8, c8)
    c8 = gl.join(c8, c8)  # (g, n, b, a)
    c8 = gl.reshape(gl.permute(c8, [3, 2, 0, 1]), [32, NK])
    return gl.convert_layout(c8, MMA)


@gluon.jit
def to_f32(x, IS_BF16: gl.constexpr):
    """A 16-bit tensor as fp32 (exact); bf16 two lanes at a time (``F32_OF_BF16_ASM``)."""
    if IS_BF16:
        return gl.inline_asm_elementwise(F32_OF_BF16_ASM, "=r,=r,r", [x], dtype=gl.float32, is_pure=True, pack=2)
    else:
        return x.to(gl.float32)


@gluon.jit
def token_order(p, PV: gl.constexpr):
    """``p`` ``(32, BH)`` of a token quarter (row ``r``: token ``token_perm(r)``) as the value product's
    ``(32, BH PV)`` K rows in ``low_plane_order`` (BPR 32), head ``r`` in column ``r PV`` (zeros beside it when
    ``PV`` is 2)."""
    if PV == 2:
        p = gl.reshape(gl.join(p, gl.zeros_like(p)), [p.shape[0], 2 * p.shape[1]])
    N: gl.constexpr = p.shape[1]
    p = gl.reshape(p, [2, 2, 4, 2, N])  # row 16 e + 8 h + 2 q + kt = token_perm^-1(token 8 q + 4 kt + 2 e + h)
    p = gl.permute(p, [3, 1, 2, 0, 4])  # (kt, h, q, e)
    return gl.reshape(p, [32, N])


@gluon.jit
def cat4(a0, a1, a2, a3):
    """Four ``(T, N)`` tensors stacked along rows: ``(4 T, N)``."""
    T: gl.constexpr = a0.shape[0]
    N: gl.constexpr = a0.shape[1]
    a = gl.join(gl.join(a0, a1), gl.join(a2, a3))  # (T, N, u0, u1)
    a = gl.permute(a, [3, 2, 0, 1])
    return gl.reshape(a, [4 * T, N])


@gluon.jit
def widen(x, PV: gl.constexpr):
    """A per-head vector ``(BH,)`` as ``(BH PV,)``: entry ``r`` at ``r PV`` and beside it."""
    if PV == 2:
        x = gl.reshape(gl.join(x, x), [2 * x.shape[0]])
    return x


@gluon.jit
def rescale(acc, a, PV: gl.constexpr):
    """``acc`` ``(T, BH PV)`` times ``a`` ``(BH,)`` per head (column ``r PV``); with ``PV`` 2 the pad columns beside the
    heads (always exactly 0: their operand columns are 0) are left as they are, half the multiplies."""
    L: gl.constexpr = acc.type.layout
    if PV == 2:
        T: gl.constexpr = acc.shape[0]
        N: gl.constexpr = acc.shape[1]
        r, z = gl.split(gl.reshape(acc, [T, N // 2, 2]))
        r = r * gl.convert_layout(a, gl.SliceLayout(0, r.type.layout))[None, :]
        return gl.convert_layout(gl.reshape(gl.join(r, z), [T, N]), L, assert_trivial=True)
    else:
        return acc * gl.convert_layout(a, gl.SliceLayout(0, L))[None, :]


@gluon.jit
def merge_parts(s):
    """``(T, 2 BH) -> (T, BH)``: the two columns of a head added (the key operand's rounding and remainder, or a
    head's column and its zero pad)."""
    a, b = gl.split(gl.reshape(s, [s.shape[0], s.shape[1] // 2, 2]))
    return a + b


@gluon.jit
def channel_vector(ptr, base, D4: gl.constexpr, OUT: gl.constexpr, ADJACENT: gl.constexpr = False):
    """``ptr[base + low_channel(k)]`` for ``k < 4 D4`` in the 1-D layout ``OUT`` (the K slice of an operand
    fragment), loaded as contiguous runs: in ``low_plane_order`` lane ``q`` holds channels ``4 W q .. 4 W q + 4 W - 1``
    of every field ``s``, so each (field, lane) is one vector load of ``4 W`` elements, broadcast over the lanes of
    the other rows; a reshape and a permute then put them in the fragment's column order (register moves only)."""
    W: gl.constexpr = D4 // 16
    LV: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4 * W], [8, 1, 4, 1], [1, 1, 1, 1], [3, 2, 1, 0])
    z = gl.arange(0, 1, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LV))))
    s = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LV))))
    q = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LV))))
    j = gl.arange(0, 4 * W, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LV))))
    off = (
        z[:, None, None, None] + s[None, :, None, None] * D4 + q[None, None, :, None] * (4 * W) + j[None, None, None, :]
    )
    x = gl.load(ptr + base + off)
    x = gl.reshape(x, [4, 4, W, 2, 2])  # (s, q, kt, e, h): channel 4 W q + 4 kt + 2 e + h
    if ADJACENT:  # column s D4 + 16 kt + 8 e + 2 q + h (adjacent_channel): the loaded pairs as they are
        x = gl.permute(x, [0, 2, 3, 1, 4])
    else:
        x = gl.permute(x, [0, 2, 4, 1, 3])  # (s, kt, h, q, e): column s D4 + 16 kt + 8 h + 2 q + e
    x = gl.reshape(x, [4 * D4])
    return gl.convert_layout(x, OUT)


@gluon.jit
def adjacent_channel(k, D4: gl.constexpr):
    """``low_channel`` with the bits ``h`` and ``e`` swapped: a fragment register pair holds adjacent channels (the
    order in which ``channel_vector(..., ADJACENT=True)`` loads with no register moves)."""
    W: gl.constexpr = D4 // 16
    s = k // D4
    r = k % D4
    return 4 * W * ((r // 2) % 4) + 4 * (r // 16) + 2 * ((r // 8) % 2) + r % 2 + s * D4


@gluon.jit
def adjacent_to_low(x, D4: gl.constexpr):
    """A ``(4 D4, N)`` operand in ``adjacent_channel`` order as the same operand in ``low_channel`` order, in its
    own layout (the h and e bits of K swapped: two PRMT per two registers)."""
    OUT: gl.constexpr = x.type.layout
    W: gl.constexpr = D4 // 16
    N: gl.constexpr = x.shape[1]
    x = gl.reshape(x, [4, W, 2, 4, 2, N])  # (s, kt, e, q, h)
    x = gl.permute(x, [0, 1, 4, 3, 2, 5])  # (s, kt, h, q, e)
    return gl.convert_layout(gl.reshape(x, [4 * D4, N]), OUT)


# one-hot rows of the high-plane gather: the bytes (0, 2) / (1, 3) of a word of four boost_idx bytes as fp16
# 1024 + byte (magic number), then one set.eq per pair and row against 1024 + the row's slot: 1.0 (0x3C00) where
# the channel is the slot's, else 0
IDX_F16_ASM = gl.constexpr(
    "{ .reg .b32 h; shr.b32 h, $2, 8; lop3.b32 $0, $2, 0x00FF00FF, 0x64006400, 0xEA; "
    "lop3.b32 $1, h, 0x00FF00FF, 0x64006400, 0xEA; }"
)
EQ_ASM = gl.constexpr("set.eq.f16x2.f16x2 $0, $1, $2;")
# 16-bit packed product (the high operand's units)
MUL_ASM_F16 = gl.constexpr("mul.rn.f16x2 $0, $1, $2;")
MUL_ASM_BF16 = gl.constexpr("mul.rn.bf16x2 $0, $1, $2;")
ONE_BITS = 0x3C00  # a one-hot entry: fp16 1.0, read as bf16 2^-7


@gluon.jit
def mul16(a, b, IS_BF16: gl.constexpr):
    """``a * b`` of two 16-bit tensors, two lanes per instruction, rounded once (``mul.rn``)."""
    if IS_BF16:
        return gl.inline_asm_elementwise(MUL_ASM_BF16, "=r,r,r", [a, b], dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise(MUL_ASM_F16, "=r,r,r", [a, b], dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def high_slot(r, NB: gl.constexpr, NB4: gl.constexpr):
    """Slot of row ``r`` of the high operand (``gluon_launch.high_plane_order``: byte + field * NB4), 256 past the
    plane (never a ``boost_idx`` byte)."""
    byte = 4 * (r // 16) + 2 * (r % 2) + (r // 8) % 2
    sl = byte + ((r // 2) % 4) * NB4
    return gl.where((byte < NB4) & (sl < NB), sl, 256)


@gluon.jit
def one_hot(
    idx_ptr,
    base,
    KH: gl.constexpr,
    D4: gl.constexpr,
    NB: gl.constexpr,
    NB4: gl.constexpr,
    IS_BF16: gl.constexpr,
    DA: gl.constexpr,
):
    """The ``(KH, 4 D4)`` A fragment ``DA`` of ``(boost_idx[low_channel(k)] == slot[r])`` as the 16-bit pattern
    ``0x3C00`` (fp16 1.0, bf16 2^-7; the caller folds the unit into the other operand): row ``r`` picks the channel
    of slot ``high_slot(r)`` out of a ``(4 D4, N)`` operand in ``low_plane_order``. Each lane loads its channels'
    bytes once (contiguous runs, as ``channel_vector``) and turns each word into fp16 ``1024 + byte`` once (3
    integer ops per 4 bytes); each row then costs one ``set.eq`` per pair."""
    W: gl.constexpr = D4 // 16
    L5: gl.constexpr = gl.BlockedLayout([1, 1, 1, W, 4], [8, 1, 4, 1, 1], [1, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    L4: gl.constexpr = gl.SliceLayout(0, L5)
    s = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    q = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    kt = gl.arange(0, W, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
    b = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    off = s[:, None, None, None] * D4 + q[None, :, None, None] * (4 * W) + kt[None, None, :, None] * 4
    idx = gl.load(idx_ptr + base + off + b[None, None, None, :])  # (s, q, kt, byte): channel 4 W q + 4 kt + byte
    # element b of a word after the conversion: channel 4 kt + 2 (b % 2) + b // 2
    cv = gl.inline_asm_elementwise(IDX_F16_ASM, "=r,=r,r", [idx], dtype=gl.float16, is_pure=True, pack=4)
    L1: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L5))))
    r = gl.arange(0, KH, L1)
    sl = (high_slot(r, NB, NB4) + 1024).to(gl.float16)
    cvb, slb = gl.broadcast(gl.expand_dims(cv, 0), sl[:, None, None, None, None])
    if IS_BF16:
        oh = gl.inline_asm_elementwise(EQ_ASM, "=r,r,r", [cvb, slb], dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        oh = gl.inline_asm_elementwise(EQ_ASM, "=r,r,r", [cvb, slb], dtype=gl.float16, is_pure=True, pack=2)
    oh = gl.reshape(oh, [KH, 4, 4, W, 2, 2])  # (r, s, q, kt, h, e)
    oh = gl.permute(oh, [0, 1, 3, 4, 2, 5])  # (r, s, kt, h, q, e)
    oh = gl.reshape(oh, [KH, 4 * D4])
    return gl.convert_layout(oh, DA)
