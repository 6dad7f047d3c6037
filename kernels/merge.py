"""The split-K merge of the fused decode kernel (``kernels/decode_attention.py``): each split of a (row, KV head)
leaves its softmax state ``(m, l, acc)`` per query head in the workspace, and the merge rescales the splits to their
common maximum and sums them (flash-decoding's combine). It runs either inside the attention launch, by the program
that finishes last (``Launch.merge_inside``), or as a second launch, ``_decode_reduce_kernel``; both call
``_merge_splits``. Torch reference: ``kernels/reference.py``'s ``merge_splits_ref``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tiles import cast_to


@triton.jit
def _merge_splits(ws_m_ptr, ws_l_ptr, ws_acc_ptr, out_ptr, pid_bh, b, h, r, QH, NUM_SPLITS, so_b, so_h,
                  D: tl.constexpr, BLOCK_H: tl.constexpr, SPLITS_P2: tl.constexpr, CACHE: tl.constexpr):
    """Query head ``r`` of (row ``b``, KV head ``h``): the splits' ``(m, l, acc)`` merged into ``out`` (one row of
    ``D``). ``CACHE``: the loads' cache modifier (``".cg"``, past L1, when other programs of the same launch wrote
    the partials)."""
    sp = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, D)
    ok = sp < NUM_SPLITS
    ws = (pid_bh * NUM_SPLITS + sp) * BLOCK_H + r
    m = tl.load(ws_m_ptr + ws, mask=ok, other=float("-inf"), cache_modifier=CACHE)
    l = tl.load(ws_l_ptr + ws, mask=ok, other=0.0, cache_modifier=CACHE)
    acc = tl.load(ws_acc_ptr + ws[:, None] * D + d[None, :], mask=ok[:, None], other=0.0, cache_modifier=CACHE)
    M = tl.max(m, 0)
    M = tl.where(M > float("-inf"), M, 0.0)  # every split empty (length 0): avoid -inf - -inf
    w = tl.exp2(m - M)  # empty splits (m = -inf) weigh 0
    L = tl.sum(w * l, 0)
    o = tl.sum(w[:, None] * acc, 0) / tl.where(L > 0, L, 1.0)  # rows of length 0 give 0
    tl.store(out_ptr + b.to(tl.int64) * so_b + (h * QH + r) * so_h + d, cast_to(o, out_ptr.dtype.element_ty))


@triton.jit
def _decode_reduce_kernel(
    ws_m_ptr, ws_l_ptr, ws_acc_ptr, out_ptr,
    Hkv, QH, NUM_SPLITS, so_b, so_h,
    D: tl.constexpr, BLOCK_H: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    r = tl.program_id(1)  # query head within the group
    _merge_splits(ws_m_ptr, ws_l_ptr, ws_acc_ptr, out_ptr, pid_bh, pid_bh // Hkv, pid_bh % Hkv, r, QH, NUM_SPLITS,
                  so_b, so_h, D, BLOCK_H, SPLITS_P2, "")
