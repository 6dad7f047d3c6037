"""The fused decode kernel's launch choice (``kernels/decode_attention.py``): one frozen :class:`Launch`, the same
object for the kernel wrapper, ``benchmarks/kernels.py`` and ``benchmarks/sass.py`` (which compiles the kernel that
runs). Change the heuristic here: :func:`default_launch`.

Imports neither Triton nor a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

H200_SMS = 132  # streaming multiprocessors of the GPU the defaults were timed on (benchmarks/RESULTS.md)


@dataclass(frozen=True)
class Launch:
    """How the fused kernel is launched for one call.

    ``num_splits``: programs per (row, KV head), each taking a contiguous run of pages; ``num_warps``; ``num_stages``
    (Triton's software pipelining of the page loop); ``maxnreg``: a register cap per thread (``None``: none);
    ``block_h``: query rows per program (at least the GQA group; 16 fills a tensor-core tile, fewer rows cut the
    softmax work on padding); ``split_fold``: carry ``q * key scale`` (1), ``p * value scale`` (2) or both (3) as two
    16-bit operands (see ``decode_attention_triton``).
    """

    num_splits: int
    num_warps: int
    num_stages: int
    maxnreg: int | None
    block_h: int = 4
    split_fold: int = 1

    def replace(self, **changes) -> Launch:
        return replace(self, **changes)


def num_sms(device: torch.device | int) -> int:
    """Streaming multiprocessors of ``device`` (an ``int`` is taken as the count; 4 for a CPU device)."""
    if isinstance(device, int):
        return device
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_num_splits(B: int, Hkv: int, max_blocks: int, device: torch.device | int, waves: int = 4) -> int:
    """Splits so that B*Hkv*splits programs fill ~``waves`` per SM, never more than the work units of a row; at
    most 2 once B*Hkv alone gives two programs per SM (measured on the H200: more splits only add programs then)."""
    programs, sms = max(B * Hkv, 1), num_sms(device)
    want = -(-waves * sms // programs)
    if programs >= 2 * sms:
        want = min(want, 2)
    return max(1, min(want, max_blocks, 256))


def default_launch(
    B: int,
    Hkv: int,
    max_blocks: int,
    device: torch.device | int,
    *,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    waves: int | None = None,
    block_h: int = 4,
    split_fold: int = 1,
) -> Launch:
    """The launch for ``B * Hkv`` (row, KV head) pairs over at most ``max_blocks`` page slots per row on ``device``
    (or that many SMs); a given argument replaces its default (``waves``: programs per SM the splits aim at).

    Measured on the H200 (triton 3.6, benchmarks/RESULTS.md): with at least a quarter as many pairs as SMs, 2 warps
    with a 128-register cap and ~8 programs per SM (enough resident programs to hide load latency); below that
    (batch 1), 2 warps with no cap and ~4 programs per SM (33 us at (1, 32K) against 57 us with the earlier 4 warps,
    2 stages and ~2 per SM). ``split_fold=1``: the key operand ``q * scale`` as rounded part + remainder, which the
    swap-AB kernel carries in the spare columns of its small side (what the correctness rule needs at no measured
    cost). The register cap goes with its warp count: it applies only when neither warps, stages nor a cap are given.
    """
    if B * Hkv * 4 >= num_sms(device):
        auto = dict(num_warps=2, num_stages=1, maxnreg=128, waves=8)
    else:
        auto = dict(num_warps=2, num_stages=1, maxnreg=None, waves=4)
    if num_warps is None and num_stages is None and maxnreg is None:
        maxnreg = auto["maxnreg"]
    waves = auto["waves"] if waves is None else waves
    return Launch(
        num_splits=num_splits or default_num_splits(B, Hkv, max_blocks, device, waves),
        num_warps=auto["num_warps"] if num_warps is None else num_warps,
        num_stages=auto["num_stages"] if num_stages is None else num_stages,
        maxnreg=maxnreg,
        block_h=block_h,
        split_fold=split_fold,
    )
