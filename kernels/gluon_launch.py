"""The Gluon decode kernel's launch and capability check (``kernels/decode_gluon.py``), importable without Gluon.

Also the register-layout contract between the page bytes and the kernel's tensor-core fragments, in plain Python:
:func:`low_plane_order` / :func:`high_plane_order` say which byte (and bit field) of a page row feeds logical column
``k`` of the ``mma_v2`` operand the kernel builds, which ``tests/test_gluon.py`` checks against a NumPy model of
the fragment registers (from ``gl.to_linear_layout`` bases) and the unpack.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass

import torch

from kitty.core.config import KVQuantConfig
from kitty.core.quant import high_plane_bytes

from .launch import num_sms

GLUON_TRITON = "3.6"  # the triton release the Gluon kernel was written and compile-tested for (the H200's)


@dataclass(frozen=True)
class GluonLaunch:
    """How the Gluon kernel is launched: ``num_splits`` one-warp programs per (row, KV head), each streaming a
    contiguous run of pages with its own softmax state (the key operand ``q * scale`` carried as its fp16/bf16
    rounding and remainder: twice the key product's columns, as accurate as dequantizing first); ``merge_group``:
    splits per first-level merge (0: :func:`merge_group` picks ~sqrt(num_splits)), so that no program merges more
    than ~2 sqrt(num_splits) partials one after another; ``tail_splits``: the last ``tail_splits`` of the
    ``num_splits`` programs of a (row, KV head) share its full-precision chunks (qbuffers, local window: up to ~12
    chunks of 32 tokens) in equal parts and the others its quantized pages, so that at small batch no program runs
    the whole tail after its pages (0: each split runs the tail of its own page range); ``maxnreg``: the register
    cap per thread (255: ~8 one-warp programs per SM fit; <= 200 gives 10, <= 176 gives 11, <= 168 gives 12;
    CPU-compiled, kitty and kitty-pro are spill-free at 200, and at 176 all but kitty-pro bf16 with GQA 8 and D 64,
    which spills 6 words); ``prefetch``: each program prefetches its first page into L2 before it waits on anything,
    and the page loop keeps one page ahead (``prefetch.global.L2`` of every line of the next key and value page);
    ``chunk_cost`` (without tail splits): 0 splits a row's page slots evenly (the last split also runs the
    full-precision chunks of its slots), > 0 splits its work at equal cost, a quantized page costing 8 and a
    full-precision 32-token chunk ``chunk_cost`` (the sink's on split 0 first);
    ``bf16_magic``: ``False`` (the default) reads bf16 codes as exact subnormals like fp16's (9% fewer instructions
    in kitty-pro's page loop than the magic form; correct in every check case and CUDA test on an H100, and 1-6%
    faster there at the large shapes); ``True``: the earlier unpack with magic numbers (``OFF_s + code``, the
    offsets' share on the tensor cores), kept for comparison."""

    num_splits: int
    merge_group: int = 0
    tail_splits: int = 0
    maxnreg: int = 255
    prefetch: bool = True
    chunk_cost: int = 0
    bf16_magic: bool = False


MERGE_STEP = 4  # partials a merge reads per step for 4 heads per KV head (16 // heads)


def merge_group(launch: GluonLaunch) -> int:
    """Splits merged by the last program of each group (then the groups' rows by the last group): the launch's
    ``merge_group``, or ~sqrt(num_splits) rounded up to a multiple of :data:`MERGE_STEP`. One group (the whole
    launch) when there are at most ``2 MERGE_STEP`` splits."""
    if launch.merge_group > 0:
        return launch.merge_group
    n = launch.num_splits
    if n <= 2 * MERGE_STEP:
        return max(n, 1)
    root = math.isqrt(n - 1) + 1  # ceil(sqrt(n))
    return -(-root // MERGE_STEP) * MERGE_STEP


SMALL_PAIRS = 16  # (row, KV head) pairs up to which the default launch gives the full-precision tail its own programs
SMALL_TAIL_SPLITS = 8  # programs sharing the full-precision chunks (and the sink) at small batch, 4 where 8 would
# start more than ctas_per_sm programs per SM (H100, kitty fp16, with prefetch: (1, 4K) 13.1 us with 4 tail programs
# and the sink on split 0, 12.3 with the sink on a tail program, 10.9 with 8 of them; (1, 32K) 21.0 with 4, 22.0 with 8)


def small_tail_splits(page_splits: int, ctas_per_sm: int, sms: int, pairs: int) -> int:
    """Programs for the full-precision chunks and the sink at small batch: :data:`SMALL_TAIL_SPLITS`, or 4 where
    ``page_splits`` plus 8 would start more than ``ctas_per_sm`` programs per SM over ``pairs`` (row, KV head)
    pairs."""
    want = -(-ctas_per_sm * sms // max(pairs, 1))
    return SMALL_TAIL_SPLITS if page_splits + SMALL_TAIL_SPLITS <= want else 4


CHUNK_COST = 13  # a full-precision 32-token chunk against a quantized page (8): their bytes' ratio, ~1.6 for kitty
# and kitty-pro at D 64 and 128 (H100, (8, 32K) kitty fp16, 16 splits: 95.5 us by page slots, 84.8 at cost 8, 80.0 at
# cost 13, as fast as a program of its own for the chunks)
WAVE_EFFICIENCY = 0.95  # split counts whose programs fill the SMs' slots at least this well, relative to the best
# (H100, (64, 8K) kitty fp16 at cost 13: 2 splits (0.97 of one wave) 160.4 us, 3 (0.73 of two) 181.7, 4 (0.97) 163.8)


def wave_efficiency(programs: int, slots: int) -> float:
    """The share of ``slots`` (programs resident at once) that ``programs`` equal programs keep busy over their
    waves."""
    return programs / (-(-programs // slots) * slots)


def default_gluon_launch(
    B: int,
    Hkv: int,
    max_blocks: int,
    device: torch.device | int,
    ctas_per_sm: int = 8,
    min_pages: int | None = None,
) -> GluonLaunch:
    """The launch :func:`decode_attention_gluon` uses unless given one.

    Above :data:`SMALL_PAIRS` (row, KV head) pairs: up to ``ceil(ctas_per_sm * SMs / pairs)`` splits (each >=
    ``min_pages`` pages, default 2), the most whose ``B * Hkv * splits`` one-warp programs keep the ``ctas_per_sm``
    slots per SM busy within :data:`WAVE_EFFICIENCY` of the best count (so one full wave rather than a wave and a
    small second one), each split given equal work (``chunk_cost`` :data:`CHUNK_COST`: the full-precision tail
    weighs as its bytes, so the split holding it runs fewer pages). All programs then end together.

    At most :data:`SMALL_PAIRS` pairs (``min_pages`` ``None`` or 1): ~``ctas_per_sm`` programs per SM of one page
    each, then as few splits as give every split the same page count, and :data:`SMALL_TAIL_SPLITS` more programs
    for the full-precision chunks (qbuffers, local window) and the sink, which would otherwise run after a split's
    pages (4 where 8 would exceed ``ctas_per_sm`` programs per SM). At batch 1 that is many short splits; the
    two-level merge (:func:`merge_group`) keeps their serial tail short."""
    pairs, sms = max(B * Hkv, 1), num_sms(device)
    small = pairs <= SMALL_PAIRS
    if min_pages is None:
        min_pages = 1 if small else 2
    cap = max(1, min(max_blocks // min_pages, 512))
    want = -(-ctas_per_sm * sms // pairs)
    if not (small and min_pages == 1):
        slots = ctas_per_sm * sms
        eff = [wave_efficiency(pairs * s, slots) for s in range(1, min(want, cap) + 1)]
        splits = max(i + 1 for i, e in enumerate(eff) if e >= WAVE_EFFICIENCY * max(eff))
        return GluonLaunch(num_splits=splits, chunk_cost=CHUNK_COST)
    splits = max(1, min(want, cap))
    per = -(-max_blocks // splits)
    splits = max(1, -(-max_blocks // per))
    tail = small_tail_splits(splits, ctas_per_sm, sms, pairs)
    return GluonLaunch(num_splits=splits + tail, tail_splits=tail)


def split_work(
    n: int,
    S: int,
    G: int,
    R: int,
    full_qbuffer: bool,
    num_splits: int,
    tail_splits: int,
    split: int,
    chunk_cost: int = 0,
) -> tuple[range, range, bool]:
    """What program ``split`` of a row of ``n`` tokens runs, as ``_decode_gluon_kernel`` computes it: the quantized
    pages (key and value) of its page loop, its full-precision chunks of 32 tokens (after the sink; chunk ``c`` is
    tokens ``32 c ..``), and whether it runs the sink chunks."""
    m = max(n - S, 0)
    mv = max(m - R, 0)
    if full_qbuffer:
        vp = max(-(-mv // G) - 1, 0)
    else:
        vp = mv // G
    slots, nck = -(-m // G), -(-m // 32)
    if tail_splits > 0:
        nps = num_splits - tail_splits
        per = -(-vp // nps)
        if split < nps:
            start, end, c_lo, c_hi = split * per, min(split * per + per, vp), 0, 0
        else:
            tper = -(-max(nck - vp * 4, 0) // tail_splits)
            c_lo = vp * 4 + (split - nps) * tper
            start, end, c_hi = 0, 0, max(min(c_lo + tper, nck), c_lo)
    elif chunk_cost > 0:
        nfp = max(nck - vp * 4, 0)
        base = -(-S // 32) * chunk_cost if n > 0 else 0
        per = -(-(base + vp * 8 + nfp * chunk_cost) // num_splits)
        lo = split * per - base
        hi = lo + per
        start, end = min(-(-max(lo, 0) // 8), vp), min(-(-max(hi, 0) // 8), vp)
        c_lo = vp * 4 + min(-(-max(lo - vp * 8, 0) // chunk_cost), nfp)
        c_hi = vp * 4 + min(-(-max(hi - vp * 8, 0) // chunk_cost), nfp)
    else:
        per = -(-slots // num_splits)
        start, end = split * per, min(split * per + per, slots)
        c_lo = max(start, vp) * 4
        c_hi = max(min(end * 4, nck), c_lo)
    sink_split = num_splits - 1 if tail_splits > 0 else 0  # the last tail split, else split 0
    return range(start, min(end, vp)), range(c_lo, c_hi), split == sink_split and n > 0


@functools.cache  # asked per decode call (gluon_supports); the installed triton does not change in a process
def gluon_available() -> bool:
    """Whether this triton is the release the Gluon kernel was written for and ships ``triton.experimental.gluon``."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton

    if not triton.__version__.startswith(GLUON_TRITON):
        return False
    return importlib.util.find_spec("triton.experimental.gluon") is not None


def gluon_supports(
    cfg: KVQuantConfig, head_dim: int, dtype: torch.dtype, device: torch.device | None, gqa: int
) -> bool:
    """Whether the Gluon kernel was written and tested for these pages on ``device``: a Hopper GPU (sm_90) with
    triton 3.6's Gluon, 2-bit keys and values of group size 128, head_dim 64 or 128, fp16/bf16, at most 8 query
    heads per KV head, and a high plane of 1, 2 or a multiple of 4 bytes per token. Anything else runs the ``tl``
    kernel."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) != (9, 0) or not gluon_available():
        return False
    return pages_supported(cfg, head_dim, dtype, gqa)


def gluon_applies(cfg: KVQuantConfig, q: torch.Tensor, k_qbuf: torch.Tensor) -> bool:
    """:func:`gluon_supports` for one decode call: query ``q`` ``[B, Hq, D]`` over the KV heads of ``k_qbuf``
    ``[B, Hkv, G, D]`` (the Gluon backend's eager steps and its compiled op ask the same)."""
    return gluon_supports(cfg, q.shape[-1], q.dtype, q.device, q.shape[1] // k_qbuf.shape[1])


def pages_supported(cfg: KVQuantConfig, head_dim: int, dtype: torch.dtype, gqa: int) -> bool:
    """The config half of :func:`gluon_supports` (no device or triton check)."""
    nb4 = high_plane_bytes(cfg.num_boosted(head_dim))
    return (
        cfg.key_bits == 2
        and cfg.boost_bits == 4
        and cfg.value_bits == 2
        and not cfg.grouped_values
        and cfg.group_size == 128
        and head_dim in (64, 128)
        and dtype in (torch.float16, torch.bfloat16)
        and 1 <= gqa <= 8
        and (nb4 in (0, 1, 2) or nb4 % 4 == 0)
        and cfg.sink_tokens <= 128
    )


# ------------------------------------------------------------------ the fragment contract (pure Python)


def low_plane_order(bytes_per_row: int) -> list[tuple[int, int]]:
    """``(byte, field)`` of a plane row (``bytes_per_row`` bytes, 4 quarter-strided 2-bit fields each) feeding
    logical column ``k`` of the kernel's operand, ``k = n/4 * s + 16 kt + 8 h + 2 q + e`` (``n = 4 bytes_per_row``):
    lane ``q = k/2 % 4`` loads bytes ``4 W q ..`` (``W`` = words per lane), its unpack puts bytes ``0, 2`` of a word
    in one register and ``1, 3`` in the next, so column ``k`` holds byte ``4 W q + 4 kt + 2 e + h``, field ``s``.
    The code is then row element ``byte + s * bytes_per_row`` (``docs/LAYOUT.md``)."""
    W = bytes_per_row // 16
    out = []
    for k in range(4 * bytes_per_row):
        s, r = divmod(k, bytes_per_row)
        kt, h, q, e = r // 16, (r // 8) % 2, (r // 2) % 4, r % 2
        out.append((4 * W * q + 4 * kt + 2 * e + h, s))
    return out


def unpack_low_bits(word, field: int, magic: bool) -> list:
    """The four 16-bit patterns ``unpack_low`` (``kernels/_gluon_parts.py``: ``LOW_ASM``, or
    ``LOW_ASM_BF16_MAGIC`` with ``magic``) makes of field ``field`` of a little-endian 32-bit
    ``word``, in register order: bytes 0 and 2 (one register, low and high half), then bytes 1 and 3 (the word
    shifted right by 8). The field masked in place, read as the subnormal ``4^field code 2^-24`` (fp16) or ``4^field
    code 2^-133`` (bf16), exact, no offset; ``magic`` (bf16's earlier unpack): ``lop3`` with the magic numbers
    ``0x4300``, ``0x4200``, ``0x4100`` (128, 32, 8, whose last mantissa bit is 1, 1/4, 1/16) gives ``OFF + code`` for
    fields 0-2, and field 3 is field 0 of the word shifted right by 6 (offset 128). ``word``: a Python int or an
    integer tensor or array (elementwise)."""
    out = []
    for h, src in enumerate((word, word >> 8)):
        if not magic:
            reg = src & (0x00030003 << (2 * field))
        else:  # the field at bits p, p + 1 of (word >> shift), read with the magic number of p
            shift, p = BF16_LOW_SOURCE[h][field]
            reg = ((word >> shift) & (0x00030003 << p)) | (0x43004300 - 0x00800080 * p)
        out += [reg & 0xFFFF, (reg >> 16) & 0xFFFF]
    return out


# bf16's magic-number unpack, (shift, bit position) of field s of bytes (0, 2) (h = 0) and (1, 3) (h = 1): two
# shifts a word (6 and 10); the offset of a field read at bit p is 128 / 2^p
BF16_LOW_SOURCE = (((0, 0), (0, 2), (0, 4), (6, 0)), ((6, 2), (6, 4), (10, 2), (10, 4)))


def bf16_low_offset(field: int, h: int) -> float:
    """The offset ``unpack_low_bits`` (``magic``) adds to a code of ``field`` in bytes (0, 2) (``h`` 0) or (1, 3)."""
    return 128.0 / 2 ** BF16_LOW_SOURCE[h][field][1]


def high_plane_order(nb4: int) -> list[tuple[int, int]]:
    """``(byte, field)`` of a high-plane row (``nb4`` bytes) feeding logical column ``k`` of the high operand
    (``16 * ceil(nb4 / 4)`` columns): lane ``q`` takes field ``q`` of word ``kt``, bytes ordered as in
    :func:`low_plane_order`. Its slot is ``byte + field * nb4``; columns whose byte is past ``nb4`` hold 0."""
    out = []
    for k in range(16 * max(1, -(-nb4 // 4))):
        kt, h, q, e = k // 16, (k // 8) % 2, (k // 2) % 4, k % 2
        out.append((4 * kt + 2 * e + h, q))
    return out


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (``triton.next_power_of_2``, without importing Triton)."""
    return 1 << max(n - 1, 0).bit_length()


def gluon_constants(
    cfg: KVQuantConfig, head_dim: int, group: int, dtype: torch.dtype, launch: GluonLaunch, full_qbuffer: bool
) -> dict:
    """The compile-time constants of ``_decode_gluon_kernel`` (what the wrapper launches and the compile gates
    compile)."""
    nb = cfg.num_boosted(head_dim)
    nb4 = high_plane_bytes(nb)
    return dict(
        S=cfg.sink_tokens,
        G=cfg.group_size,
        R=cfg.local_window,
        D=head_dim,
        NB=nb,
        NB4=nb4,
        NWH=max(1, nb4 // 4),
        RW=nb4 // 4 if nb4 % 4 == 0 else 1,
        BH=heads_block(group),
        IS_BF16=dtype == torch.bfloat16,
        FULL_QBUF=bool(full_qbuffer),
        PREFETCH=bool(launch.prefetch),
        MAGIC=dtype == torch.bfloat16 and bool(launch.bf16_magic),
    )


GLUON_WORKSPACE = ("g_m", "g_l", "g_z", "g_acc", "g_t")  # the split buffers and merge tickets, in this order


def heads_block(group: int) -> int:
    """Query heads per KV head as the kernel holds them (``BH``): the GQA group rounded up to a power of two, >= 4."""
    return max(4, next_power_of_2(group))


def gluon_workspace_shapes(
    B: int, Hq: int, Hkv: int, D: int, launch: GluonLaunch
) -> dict[str, tuple[tuple, torch.dtype]]:
    """Shape and dtype of each buffer ``_decode_gluon_kernel`` writes besides its output (:data:`GLUON_WORKSPACE`):
    per (row, KV head, split) the partial maxima, sums and value offsets of ``BH`` query heads and their ``BH x D``
    outputs, and the merge tickets (one per merge group and one for the last merge, per (row, KV head))."""
    bh, splits = heads_block(Hq // Hkv), launch.num_splits
    rows = B * Hkv * splits * bh
    tickets = B * Hkv * (-(-splits // merge_group(launch)) + 1)
    f32 = torch.float32
    return dict(
        g_m=((rows,), f32),
        g_l=((rows,), f32),
        g_z=((rows,), f32),
        g_acc=((B * Hkv * splits, bh * D), f32),
        g_t=((tickets,), torch.int32),
    )


def gluon_workspace(q: torch.Tensor, Hkv: int, launch: GluonLaunch) -> dict[str, torch.Tensor]:
    """The buffers of :func:`gluon_workspace_shapes` for query ``q`` ``[B, Hq, D]``, the tickets zeroed (the kernel
    leaves them zero after each launch, so a caller allocates them once and passes them to every call)."""
    B, Hq, D = q.shape
    return {
        name: (torch.zeros if name == "g_t" else torch.empty)(shape, dtype=dtype, device=q.device)
        for name, (shape, dtype) in gluon_workspace_shapes(B, Hq, Hkv, D, launch).items()
    }


def high_plane_view(k_high: torch.Tensor, nb4: int) -> torch.Tensor:
    """``k_high`` ``[P, Hkv, G, nb4]`` as rows of 32-bit words (``nb4 % 4 == 0``), 16-bit (2) or 8-bit (1)
    elements, the unit the kernel loads."""
    if nb4 % 4 == 0:
        return k_high.view(torch.int32)
    if nb4 == 2:
        return k_high.view(torch.int16)
    return k_high
