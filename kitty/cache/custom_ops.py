"""A static decode step's device work as ``torch.library`` custom ops (namespace ``kitty``), opaque to
``torch.compile``.

Traced through, the Triton launches of a decode step trip the compiler: Inductor re-types a loop-carried value of
the attention kernel as fp64, and ``mode="reduce-overhead"`` refuses the workspace allocations the wrappers make on
their first call. As custom ops with fake (meta) implementations, Dynamo and Inductor see each as one opaque node
with known outputs and declared mutations, and never look inside:

    kitty::insert_token(k, v, lengths!, sink_k!, sink_v!, k_qbuf!, v_qbuf!, v_local!)      one launch, stage 1
    kitty::decode_attention(q, state, cfg, scaling, full_qbuffer, workspace!, launch) -> out  stage 2
    kitty::pack_completed(cfg, lengths, k_qbuf, v_qbuf, pool fields!, page tables!, ...)   stage 3

(``!``: mutated in place.) Python callers use the wrappers :func:`insert_token`, :func:`decode_attention` and
:func:`pack_completed`, which take the library's own types (a ``KVQuantConfig``, a ``KittyLayerState``, pool dicts,
a ``Launch``) and flatten them into what an op schema holds:

- a config travels as a string key (:func:`config_key`, its ``repr``) registered in this process;
- a state as its tensors in ``KittyLayerState`` field order (``None`` for absent fields);
- a launch as 7 integers (``[]``: the default launch), and an 8th, ``1``, where the layer decodes with the Gluon
  kernel;
- the attention workspace as a list of preallocated tensors (:func:`attention_workspace`; ``[]``: allocate per call),
  followed, for a Gluon layer, by the Gluon kernel's own split buffers and tickets
  (``kitty.kernels.gluon_launch.GLUON_WORKSPACE``), which the op writes (declared mutated); its output is a fresh
  tensor (an op may not return an alias of an input).

A static layer flattens its arguments once, eagerly at the prompt (:func:`flat_args`), and its compiled decode step
calls :func:`decode_attention_flat` and :func:`pack_completed_flat` with them, so that traced code builds none of
those objects (and no frozen dataclass is live in it).

Each op runs the Triton kernel for CUDA tensors or under ``TRITON_INTERPRET=1``, else its torch reference
(``kernels/reference.py``), as the layer's ops objects (``kitty/cache/backend.py``) choose.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .. import kernels
from ..core.config import KVQuantConfig
from ..core.storage import KittyLayerState
from ..kernels.launch import Launch, default_launch

__all__ = [
    "STATE_FIELDS",
    "FlatArgs",
    "attention_workspace",
    "config_key",
    "decode_attention",
    "decode_attention_flat",
    "flat_args",
    "insert_token",
    "pack_completed",
    "pack_completed_flat",
]

STATE_FIELDS = tuple(f.name for f in dataclasses.fields(KittyLayerState))  # the order a state travels in
KEY_POOL_FIELDS = ("k_low", "k_high", "k_boost_idx", "k_scale", "k_zero", "k_raw")
VALUE_POOL_FIELDS = ("v_codes", "v_scale", "v_zero", "v_raw")
_CONFIGS: dict[str, KVQuantConfig] = {}


@torch.compiler.assume_constant_result  # traced code holds the string: the config is fixed for a compiled step
def config_key(cfg: KVQuantConfig) -> str:
    """The string that stands for ``cfg`` in an op call (its ``repr``), registered for this process."""
    if not isinstance(cfg, KVQuantConfig):
        raise ValueError(f"cfg must be a KVQuantConfig, got {type(cfg).__name__}")
    key = repr(cfg)
    _CONFIGS.setdefault(key, cfg)
    return key


def _config(key: str) -> KVQuantConfig:
    try:
        return _CONFIGS[key]
    except KeyError:
        raise ValueError(
            f"cfg {key!r} was not registered in this process (call kitty.cache.custom_ops.config_key)"
        ) from None


def _runs_kernels(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors like ``t`` (CUDA, or the CPU under the interpreter)."""
    return kernels.HAS_TRITON and (t.device.type == "cuda" or kernels.interpreting())


def _launch_ints(launch: Launch | None, gluon: bool = False) -> list[int]:
    """The ``tl`` kernel's launch as op integers, then ``1`` where the layer decodes with the Gluon kernel (its own
    launch, per call) wherever ``gluon_supports`` holds."""
    if launch is None:
        return [0] * 7 + [1] if gluon else []
    cap = -1 if launch.maxnreg is None else int(launch.maxnreg)
    return [launch.num_splits, launch.num_warps, launch.num_stages, cap, launch.block_h, launch.operand_parts,
            int(launch.merge_inside)] + ([1] if gluon else [])  # fmt: skip


def _launch_of(ints: Sequence[int]) -> Launch | None:
    if len(ints) == 0 or not any(ints[:7]):
        return None
    splits, warps, stages, cap, block_h, parts, merge = (int(x) for x in ints[:7])
    return Launch(splits, warps, stages, None if cap < 0 else cap, block_h, parts, bool(merge))


def _gluon_asked(ints: Sequence[int]) -> bool:
    return len(ints) > 7 and bool(ints[7])


class FlatArgs(NamedTuple):
    """A static layer's op arguments in schema form (:func:`flat_args`): a plain tuple of a string, lists of tensors
    and integers, which traced code reads without building anything."""

    cfg: str  # config_key(cfg)
    state: list  # the KittyLayerState's tensors in STATE_FIELDS order (None for absent fields)
    launch: list[int]  # _launch_ints(launch, gluon)
    pools: list  # key then value pool tensors in KEY_POOL_FIELDS + VALUE_POOL_FIELDS order (None for absent fields)


def flat_args(
    state: KittyLayerState,
    cfg: KVQuantConfig,
    launch: Launch | None,
    key_pool: dict[str, torch.Tensor],
    value_pool: dict[str, torch.Tensor],
    gluon: bool = False,
) -> FlatArgs:
    """Flatten a static layer's fixed op arguments once (eagerly): the tensors keep their identity, so the flat form
    stays valid for as long as the layer keeps its tensors. ``gluon``: the layer decodes with the Gluon kernel where
    it applies (``kitty.cache.backend.GluonOps``), so that its compiled steps run the kernel its eager ones run."""
    return FlatArgs(
        config_key(cfg),
        [getattr(state, n) for n in STATE_FIELDS],
        _launch_ints(launch, gluon),
        _flat_pools(key_pool, value_pool),
    )


def _flat_pools(key_pool: dict[str, torch.Tensor], value_pool: dict[str, torch.Tensor]) -> list:
    """Key then value pool tensors in ``KEY_POOL_FIELDS + VALUE_POOL_FIELDS`` order (``None`` for absent fields);
    ``ValueError`` for a field no pool has."""
    unknown = set(key_pool) - set(KEY_POOL_FIELDS) | set(value_pool) - set(VALUE_POOL_FIELDS)
    if unknown:
        raise ValueError(f"key_pool / value_pool hold fields no pool has: {sorted(unknown)}")
    return [key_pool.get(n) for n in KEY_POOL_FIELDS] + [value_pool.get(n) for n in VALUE_POOL_FIELDS]


# ------------------------------------------------------------------------------------------------ stage 1: insert


@torch.library.custom_op(
    "kitty::insert_token", mutates_args=("lengths", "sink_k", "sink_v", "k_qbuf", "v_qbuf", "v_local")
)
def _insert_token_op(
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    k_qbuf: torch.Tensor,
    v_qbuf: torch.Tensor,
    v_local: torch.Tensor,
) -> None:
    fn = kernels.insert_token if _runs_kernels(k) else kernels.insert_token_ref
    fn(k, v, lengths, sink_k, sink_v, k_qbuf, v_qbuf, v_local)


@_insert_token_op.register_fake
def _(k, v, lengths, sink_k, sink_v, k_qbuf, v_qbuf, v_local) -> None:
    return None


def insert_token(
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    k_qbuf: torch.Tensor,
    v_qbuf: torch.Tensor,
    v_local: torch.Tensor,
) -> None:
    """``kitty::insert_token``: ``kitty.kernels.insert_token`` (stage 1 of a decode step, ``lengths += 1``)."""
    torch.ops.kitty.insert_token(k, v, lengths, sink_k, sink_v, k_qbuf, v_qbuf, v_local)


# --------------------------------------------------------------------------------------------- stage 2: attend


@torch.library.custom_op("kitty::decode_attention", mutates_args=("workspace",))
def _decode_attention_op(
    q: torch.Tensor,
    state: Sequence[torch.Tensor | None],
    cfg: str,
    scaling: float,
    full_qbuffer: bool,
    workspace: Sequence[torch.Tensor],
    launch: Sequence[int],
) -> torch.Tensor:
    st = KittyLayerState(**dict(zip(STATE_FIELDS, state)))
    config = _config(cfg)
    if not _runs_kernels(q):
        return kernels.decode_attention_ref(q, st, config, scaling, full_qbuffer=full_qbuffer)
    if _gluon_asked(launch):
        from ..kernels.gluon_launch import GLUON_WORKSPACE, gluon_applies

        if gluon_applies(config, q, st.k_qbuf):
            from ..kernels.decode_gluon import decode_attention_gluon  # its own launch, per call

            ws = None  # the layer's Gluon buffers follow the tl kernel's four (StaticKittyLayer.prepare_workspace)
            if len(workspace) == 4 + len(GLUON_WORKSPACE):
                ws = dict(zip(GLUON_WORKSPACE, workspace[4:]), g_out=torch.empty_like(q))  # fresh output, as below
            return decode_attention_gluon(q, st, config, scaling, full_qbuffer=full_qbuffer, workspace=ws)
    ws = None
    if len(workspace):
        ws = dict(zip(("m", "l", "acc", "tickets"), workspace))
        ws["out"] = torch.empty_like(q)  # fresh: an op's output may not alias its inputs
    out = kernels.decode_attention_triton(
        q, st, config, scaling, full_qbuffer=full_qbuffer, workspace=ws, launch=_launch_of(launch)
    )
    return out


@_decode_attention_op.register_fake
def _(q, state, cfg, scaling, full_qbuffer, workspace, launch) -> torch.Tensor:
    return torch.empty_like(q)


def attention_workspace(
    q: torch.Tensor, state: KittyLayerState, launch: Launch | None = None
) -> tuple[list[torch.Tensor], Launch]:
    """The buffers :func:`decode_attention` writes for ``q`` ``[B, Hq, D]`` over ``state`` with ``launch`` (``None``:
    the default launch for these shapes, which is returned, so that every call uses the split count they are sized
    for): split maxima, sums and outputs, and the merge tickets (zeros)."""
    B, Hq, D = q.shape
    Hkv = state.k_qbuf.shape[1]
    launch = launch or default_launch(B, Hkv, state.k_page_table.shape[1] + 1, q.device)
    block_h = max(launch.block_h, 1 << max(Hq // Hkv - 1, 0).bit_length())
    rows = B * Hkv * launch.num_splits * block_h
    f32 = dict(dtype=torch.float32, device=q.device)
    ws = [torch.empty(rows, **f32), torch.empty(rows, **f32), torch.empty(rows, D, **f32)]
    ws.append(torch.zeros(B * Hkv, dtype=torch.int32, device=q.device))
    return ws, launch


def decode_attention(
    q: torch.Tensor,
    state: KittyLayerState,
    cfg: KVQuantConfig,
    scaling: float,
    *,
    full_qbuffer: bool = False,
    workspace: list[torch.Tensor] | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """``kitty::decode_attention``: the fused decode attention ``[B, Hq, D]`` (``kitty.kernels.
    decode_attention_triton``; the torch reference where no kernel runs). ``workspace``: from
    :func:`attention_workspace` with the same ``launch`` (``None``: the kernel allocates its own)."""
    tensors = [getattr(state, name) for name in STATE_FIELDS]
    return torch.ops.kitty.decode_attention(
        q, tensors, config_key(cfg), float(scaling), bool(full_qbuffer), workspace or [], _launch_ints(launch)
    )


def decode_attention_flat(
    q: torch.Tensor,
    state: list,
    cfg: str,
    scaling: float,
    full_qbuffer: bool,
    workspace: list[torch.Tensor],
    launch: list[int],
) -> torch.Tensor:
    """``kitty::decode_attention`` on arguments already flattened (:func:`flat_args`)."""
    return torch.ops.kitty.decode_attention(q, state, cfg, float(scaling), bool(full_qbuffer), workspace, launch)


# ------------------------------------------------------------------------------------------------ stage 3: pack


@torch.library.custom_op(
    "kitty::pack_completed", mutates_args=(*KEY_POOL_FIELDS, *VALUE_POOL_FIELDS, "k_page_table", "v_page_table")
)
def _pack_completed_op(
    cfg: str,
    lengths: torch.Tensor,
    k_qbuf: torch.Tensor,
    v_qbuf: torch.Tensor,
    k_low: torch.Tensor | None,
    k_high: torch.Tensor | None,
    k_boost_idx: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    k_raw: torch.Tensor | None,
    v_codes: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    v_raw: torch.Tensor | None,
    k_page_table: torch.Tensor,
    v_page_table: torch.Tensor,
    salt: int,
    query_scale: torch.Tensor | None,
) -> None:
    from .backend import TorchOps, TritonOps

    config = _config(cfg)
    pools = dict(zip(KEY_POOL_FIELDS + VALUE_POOL_FIELDS, (k_low, k_high, k_boost_idx, k_scale, k_zero, k_raw, v_codes,
                                                           v_scale, v_zero, v_raw)))  # fmt: skip
    key_pool = {n: pools[n] for n in KEY_POOL_FIELDS if pools[n] is not None}
    value_pool = {n: pools[n] for n in VALUE_POOL_FIELDS if pools[n] is not None}
    ops = (TritonOps if _runs_kernels(k_qbuf) else TorchOps)(config, k_qbuf.device)
    ops.pack_completed(lengths, k_qbuf, v_qbuf, key_pool, value_pool, k_page_table, v_page_table, salt, query_scale)


@_pack_completed_op.register_fake
def _(cfg, lengths, k_qbuf, v_qbuf, *rest) -> None:
    return None


def pack_completed(
    cfg: KVQuantConfig,
    lengths: torch.Tensor,
    k_qbuf: torch.Tensor,
    v_qbuf: torch.Tensor,
    key_pool: dict[str, torch.Tensor],
    value_pool: dict[str, torch.Tensor],
    k_page_table: torch.Tensor,
    v_page_table: torch.Tensor,
    salt: int = 0,
    query_scale: torch.Tensor | None = None,
) -> None:
    """``kitty::pack_completed``: stage 3 of a static decode step, predicated on the device (the layer's ops object's
    ``pack_completed``: the Triton kernel for the sides it packs bit-identically, the torch reference for the rest)."""
    pools = _flat_pools(key_pool, value_pool)
    pack_completed_flat(config_key(cfg), lengths, k_qbuf, v_qbuf, pools, k_page_table, v_page_table, salt, query_scale)


def pack_completed_flat(
    cfg: str,
    lengths: torch.Tensor,
    k_qbuf: torch.Tensor,
    v_qbuf: torch.Tensor,
    pools: list,
    k_page_table: torch.Tensor,
    v_page_table: torch.Tensor,
    salt: int = 0,
    query_scale: torch.Tensor | None = None,
) -> None:
    """``kitty::pack_completed`` on a config key and pool tensors already flattened (:func:`flat_args`)."""
    torch.ops.kitty.pack_completed(
        cfg, lengths, k_qbuf, v_qbuf, *pools, k_page_table, v_page_table, int(salt), query_scale
    )
