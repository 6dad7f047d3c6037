"""How the fused decode kernel (``kernels/decode_attention.py``) is launched: one frozen :class:`Launch`, the same
value for the kernel wrapper, ``benchmarks/kernels.py``, ``benchmarks/layout_sweep.py`` and ``benchmarks/sass.py``
(which compiles the kernel that runs). Change the heuristic here: :func:`default_launch`. A sweep is a list of
``dataclasses.replace(default_launch(...), field=value)``.

Also the launch facts every kernel of ``kernels/`` shares: whether kernels run under Triton's interpreter
(:data:`INTERPRETING`), the register cap (:func:`register_cap`) and the dtype the products multiply in
(:func:`dot_dtype`). Imports neither Triton nor a kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# Whether kernels run under Triton's interpreter: read once, at import, as Triton itself reads TRITON_INTERPRET
# when it decorates a kernel (the kernel modules import this module before they define a kernel).
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
H200_SMS = 132  # streaming multiprocessors of the GPU the defaults were timed on (docs/BENCHMARKS.md)


def register_cap(maxnreg: int | None) -> dict:
    """Launch option capping registers per thread (CUDA backend only; ignored by the interpreter)."""
    return {} if (maxnreg is None or INTERPRETING) else {"maxnreg": int(maxnreg)}


def dot_dtype(dtype: torch.dtype) -> torch.dtype:
    """Operand dtype of a kernel's products for ``dtype`` inputs: the model dtype, except fp32 (and bf16 under the
    interpreter, whose bf16 ``tl.dot`` is wrong), which multiply in fp32."""
    if dtype == torch.float32 or (INTERPRETING and dtype == torch.bfloat16):
        return torch.float32
    return dtype


@dataclass(frozen=True)
class Launch:
    """How the fused kernel is launched for one call.

    ``num_splits``: programs per (row, KV head), each taking a contiguous run of pages; ``num_warps``; ``num_stages``
    (Triton's software pipelining of the page loop); ``maxnreg``: a register cap per thread (``None``: none);
    ``block_h``: query rows per program (at least the GQA group; 16 fills a tensor-core tile, fewer rows cut the
    softmax work on padding); ``operand_parts``: which small operands are carried as two 16-bit parts, their
    rounding and its remainder: ``q * key scale`` (bit 1), ``p * value scale`` (bit 2), both (3) or neither (0)
    (the module docstring of ``kernels/decode_attention.py``, choice 3); ``merge_inside``: the split-K partials are
    merged by the last program of each (row, KV head) inside the attention launch (an atomic ticket in the
    workspace) instead of by a second launch (off by default until it is timed on the GPU).
    """

    num_splits: int
    num_warps: int
    num_stages: int
    maxnreg: int | None
    block_h: int = 4
    operand_parts: int = 1
    merge_inside: bool = False

    def options(self) -> dict:
        """The Triton launch options of every kernel of this launch: ``num_warps``, ``num_stages`` and, where it
        applies, ``maxnreg``."""
        return dict(num_warps=self.num_warps, num_stages=self.num_stages, **register_cap(self.maxnreg))


def num_sms(device: torch.device | int) -> int:
    """Streaming multiprocessors of ``device`` (an ``int`` is taken as the count; 4 for a CPU device)."""
    if isinstance(device, int):
        return device
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_num_splits(B: int, Hkv: int, max_blocks: int, device: torch.device | int, waves: int = 4) -> int:
    """Splits so that ``B * Hkv * splits`` programs fill ~``waves`` per SM, never more than the work units of a row;
    at most 2 once ``B * Hkv`` alone gives two programs per SM (more splits then only add programs)."""
    programs, sms = max(B * Hkv, 1), num_sms(device)
    want = -(-waves * sms // programs)
    if programs >= 2 * sms:
        want = min(want, 2)
    return max(1, min(want, max_blocks, 256))


def default_launch(B: int, Hkv: int, max_blocks: int, device: torch.device | int) -> Launch:
    """The launch for ``B * Hkv`` (row, KV head) pairs over at most ``max_blocks`` page slots per row on ``device``
    (or that many SMs).

    With at least a quarter as many pairs as SMs: 2 warps, one stage, a 128-register cap and splits for ~8 programs
    per SM (enough resident programs to hide load latency); below that (batch 1): 2 warps, one stage, no cap and ~4
    programs per SM. The key operand ``q * scale`` is carried as two parts (``operand_parts=1``), which the swap-AB
    kernel holds in the spare columns of its small side. The measurements behind each choice are in
    ``docs/BENCHMARKS.md`` ("The default launch"); ``tests/test_kernels.py`` pins the values.
    """
    if B * Hkv * 4 >= num_sms(device):
        maxnreg, waves = 128, 8
    else:
        maxnreg, waves = None, 4
    return Launch(
        num_splits=default_num_splits(B, Hkv, max_blocks, device, waves),
        num_warps=2,
        num_stages=1,
        maxnreg=maxnreg,
        block_h=4,
        operand_parts=1,
    )


# Programs per page: a key page's statistics pass reads the whole page in each of its programs, so key splits pay
# for themselves only while the launch has fewer busy programs than the GPU has room for; a value page's programs
# share nothing. A program keeps at least MIN_TOKENS tokens and runs PACK_WARPS warps: split launches (few pages)
# are latency-bound, and one program per page is too (H100, one layer of 8 KV heads whose every row completes a key
# and a value page: 21.6 us at 28 rows and 74.1 us at 100 with 8 warps, 26.0 and 93.5 with 4, whose 208 registers
# per thread let only two programs of 4 warps run per SM; benchmarks/pack_speed.py --variants wide); a fitted key
# range's search needs 8 (built for sm_90 at G = D = 128: 246 registers and no local memory, where 4 warps spill).
# A register tile is about PACK_TILE elements.
MIN_TOKENS = 16
PACK_WARPS = 8  # registers per thread are the compiler's choice (128 at 8 warps: two programs per SM); caps that
# fit 3-4 programs per SM spill and were slower (H100, 100 rows: 74.3 us uncapped, 77.3 at 80, 103.3 at 64)
BUSY_PROGRAMS = 2 * H200_SMS  # busy programs per side that fill the GPU (2 per SM), no more splitting
PACK_TILE = 4096


# key ranges (KVQuantConfig.key_range) the pack kernel packs (kernels/pack.py; fitted ones: kernels/_pack_fit.py)
PACK_KEY_RANGES = ("minmax", "fit", "fit-peak")
MAX_FIT_GROUP = 4096  # tokens per page the kernel fits a key range over (its sums follow torch's order up to here)


def kernel_packs_key_range(key_range: str, group_size: int) -> bool:
    """Whether the pack kernel packs key pages of ``key_range`` and ``group_size`` tokens (else kitty.core.quant)."""
    return key_range in PACK_KEY_RANGES and (key_range == "minmax" or group_size <= MAX_FIT_GROUP)


def pack_splits(pages: int, G: int, value_bits: int, busy: int = BUSY_PROGRAMS) -> tuple[int, int]:
    """``(key programs per page, value programs per page)`` for a launch over ``pages`` (row, KV head) pages a side:
    powers of two, as many as keep the side's busy programs within ``busy``, each program keeping at least
    ``MIN_TOKENS`` of the page's ``G`` tokens (a value program: whole bytes of a channel's row)."""

    def fit(limit: int) -> int:
        n = 1
        while 2 * n <= limit and 2 * n * max(pages, 1) <= busy:
            n *= 2
        return n

    per = 8 // value_bits  # value tokens per byte
    return fit(G // MIN_TOKENS), fit(min(G // per, G // max(MIN_TOKENS, per)))
