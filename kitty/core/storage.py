"""The storage contract of one Kitty layer: names, shapes and page <-> storage conversion (``docs/LAYOUT.md``).

One module that the cache (``kitty/cache/kitty_cache.py``), the attention function (``kitty/cache/attention.py``) and
the kernels (``kernels/``) all import, so that a field is named, shaped and checked in one place:

- :func:`pool_fields`: the page-pool tensors of a layer (shape of one page, dtype), for keys and for values, and
  :func:`allocate_pool`, the only code that allocates them;
- :func:`row_fields`: the per-row full-precision buffers (sink, qbuffers, local ring: shape of one row, dtype), and
  :func:`allocate_rows`, the only code that allocates them (the layers, ``kernels/testing.py``);
- :class:`KittyLayerState`: every tensor of one layer (``KittyLayer.storage()``, ``kernels/testing.py``), the one
  state type the cache, the torch reference and the kernels read (also a read-only mapping ``name -> tensor``);
  :func:`check_state` validates it against a config;
- :func:`key_page_from_storage` / :func:`value_page_from_storage`: pool pages as ``kitty.core.quant`` pages, and
  :func:`page_fields`, the other way;
- :class:`PendingKV`: the handle ``KittyLayer.update`` gives the attention function instead of tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from .config import KVQuantConfig
from .quant import KeyPage, ValuePage, high_plane_bytes

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FieldSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape of one page, dtype)
ROW_FIELDS = ("lengths", "sink_k", "sink_v", "k_qbuf", "v_qbuf", "v_local")  # per-row tensors, [B, ...]
BUFFER_FIELDS = ROW_FIELDS[1:]  # the full-precision per-row buffers of row_fields
# codes (or raw pages) and exact key outliers; the rest is metadata
PAYLOAD_FIELDS = ("k_low", "k_high", "k_raw", "k_out_val", "v_codes", "v_raw")


def pool_fields(
    cfg: KVQuantConfig, num_kv_heads: int, head_dim: int, dtype: torch.dtype, quantized: bool = False
) -> tuple[FieldSpec, FieldSpec]:
    """The key-pool and value-pool tensors of one layer: ``name -> (shape of one page, dtype)`` (``docs/LAYOUT.md``).

    A 16-bit side has its raw pages (``k_raw`` / ``v_raw``) only; ``quantized=True``: the quantized fields of both
    sides, whatever the bits (what ``kernels/pack.py`` writes; ``kernels/testing.py`` allocates both kinds)."""
    H, D, G = num_kv_heads, head_dim, cfg.group_size
    if cfg.quantizes_keys or quantized:
        key = {
            "k_low": ((H, G, D // 4), torch.uint8),
            "k_high": ((H, G, high_plane_bytes(cfg.num_boosted(D), cfg.boost_bits)), torch.uint8),
            "k_boost_idx": ((H, D), torch.uint8),
            "k_scale": ((H, D), dtype),
            "k_zero": ((H, D), dtype),
        }
        n_out = cfg.num_key_outliers(D)
        if n_out:  # cfg.key_outlier_fraction: the exact entries of a page, torch path only (KVQuantConfig.torch_only)
            key.update(
                k_out_val=((H, n_out), dtype), k_out_tok=((H, n_out), torch.uint8), k_out_ch=((H, n_out), torch.uint8)
            )
    else:
        key = {"k_raw": ((H, G, D), dtype)}
    if cfg.quantizes_values or quantized:
        value = {
            "v_codes": ((H, D, G * cfg.value_bits // 8), torch.uint8),
            "v_scale": ((H, G), dtype),
            "v_zero": ((H, G), dtype),
        }
        if cfg.grouped_values:  # a scale and zero per token and group, torch path only (KVQuantConfig.torch_only)
            eight = cfg.value_scale_bits == 8
            groups = (H, G, cfg.value_groups)
            value.update(
                v_scale=(groups, torch.uint8 if eight else dtype), v_zero=(groups, torch.int8 if eight else dtype)
            )
            if eight:
                value["v_ref"] = ((H,), dtype)
    else:
        value = {"v_raw": ((H, G, D), dtype)}
    return key, value


def row_fields(cfg: KVQuantConfig, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> FieldSpec:
    """The per-row full-precision buffers of one layer: ``name -> (shape of one row, dtype)`` (``docs/LAYOUT.md``):
    ``sink_k`` / ``sink_v`` ``[H, S, D]`` (slot ``p``), ``k_qbuf`` / ``v_qbuf`` ``[H, G, D]`` (slot ``(p - S) % G``),
    ``v_local`` ``[H, R, D]`` (ring, slot ``(p - S) % R``)."""
    H, D, S, G, R = num_kv_heads, head_dim, cfg.sink_tokens, cfg.group_size, cfg.local_window
    shapes = {"sink_k": S, "sink_v": S, "k_qbuf": G, "v_qbuf": G, "v_local": R}
    return {name: ((H, slots, D), dtype) for name, slots in shapes.items()}


def _allocate(spec: FieldSpec, n: int, device: torch.device | str, fill: float | None) -> dict[str, torch.Tensor]:
    make = torch.empty if fill is None else lambda *shape, **kw: torch.full(shape, fill, **kw)
    return {name: make(n, *shape, dtype=dt, device=device) for name, (shape, dt) in spec.items()}


def allocate_pool(
    spec: FieldSpec, pages: int, device: torch.device | str, fill: float | None = None
) -> dict[str, torch.Tensor]:
    """Pool tensors ``name -> [pages, *shape]`` of ``spec`` (:func:`pool_fields`) on ``device``: uninitialized, or
    filled with ``fill``."""
    return _allocate(spec, pages, device, fill)


def allocate_rows(spec: FieldSpec, rows: int, device: torch.device | str, fill: float = 0.0) -> dict[str, torch.Tensor]:
    """Per-row buffers ``name -> [rows, *shape]`` of ``spec`` (:func:`row_fields`) on ``device``, filled with ``fill``
    (zeros: a layer's unused slots; ``kernels/testing.py`` fills NaN)."""
    return _allocate(spec, rows, device, fill)


# ------------------------------------------------------------------------------------------------- the state


@dataclass(eq=False)
class KittyLayerState(Mapping):
    """One layer's Kitty cache tensors, named exactly as in ``docs/LAYOUT.md``, plus per-row ``lengths``.

    B rows, Hkv KV heads, head_dim D, page size G, sink S, local window R, nb boosted channels, P pool pages.
    Per-row buffers may be views with any row/head strides (channels contiguous); pool tensors must be contiguous.
    A side that is not quantized (``key_bits``/``value_bits`` = 16) needs only its raw pool (``k_raw`` / ``v_raw``);
    its quantized fields may be ``None``. Read as a mapping, the state holds the fields that are not ``None``.
    """

    lengths: torch.Tensor  # int32 [B]: valid tokens cached per row (the query is at position lengths[b] - 1)
    sink_k: torch.Tensor  # [B, Hkv, S, D] dtype
    sink_v: torch.Tensor  # [B, Hkv, S, D]
    k_qbuf: torch.Tensor  # [B, Hkv, G, D], slot (p - S) % G
    v_qbuf: torch.Tensor  # [B, Hkv, G, D], slot (p - S) % G
    v_local: torch.Tensor  # [B, Hkv, R, D], ring, slot (p - S) % R
    k_page_table: torch.Tensor  # int32 [B, max_pages]
    v_page_table: torch.Tensor  # int32 [B, max_pages]
    k_low: torch.Tensor | None = None  # uint8 [P, Hkv, G, D/4]
    k_high: torch.Tensor | None = None  # uint8 [P, Hkv, G, ceil(nb/4)] (boost_bits=3: ceil(nb/8))
    k_boost_idx: torch.Tensor | None = None  # uint8 [P, Hkv, D]
    k_scale: torch.Tensor | None = None  # [P, Hkv, D] dtype
    k_zero: torch.Tensor | None = None  # [P, Hkv, D] dtype
    v_codes: torch.Tensor | None = None  # uint8 [P, Hkv, D, G * value_bits / 8]
    v_scale: torch.Tensor | None = None  # [P, Hkv, G] dtype
    v_zero: torch.Tensor | None = None  # [P, Hkv, G] dtype
    k_raw: torch.Tensor | None = None  # [P, Hkv, G, D] only for key_bits=16
    v_raw: torch.Tensor | None = None  # [P, Hkv, G, D] only for value_bits=16
    k_out_val: torch.Tensor | None = None  # [P, Hkv, n] only for key_outlier_fraction > 0 (torch path)
    k_out_tok: torch.Tensor | None = None  # uint8 [P, Hkv, n]
    k_out_ch: torch.Tensor | None = None  # uint8 [P, Hkv, n]
    v_ref: torch.Tensor | None = None  # [P, Hkv] dtype only for value_scale_bits=8 (torch path)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields that are not ``None``, as a dict."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def __getitem__(self, name: str) -> torch.Tensor:
        value = getattr(self, name, None) if name in _FIELDS else None
        if value is None:
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors())

    def __len__(self) -> int:
        return len(self.tensors())


_FIELDS = frozenset(f.name for f in fields(KittyLayerState))


def check_state(q: torch.Tensor, state: KittyLayerState, cfg: KVQuantConfig) -> dict:
    """Validate shapes/dtypes of ``q`` and ``state`` against ``cfg``; return the sizes. Raises ``ValueError``."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D] (one decode token per row), got shape {tuple(q.shape)}")
    B, Hq, D = q.shape
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q dtype must be one of {FLOAT_DTYPES}, got {q.dtype}")
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    kq = state.k_qbuf
    if kq.dim() != 4 or kq.shape[0] != B or kq.shape[2:] != (G, D):
        raise ValueError(f"k_qbuf must be [B={B}, Hkv, G={G}, D={D}], got {tuple(kq.shape)}")
    Hkv = kq.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    for name, (shape, _) in row_fields(cfg, Hkv, D, q.dtype).items():
        x = getattr(state, name)
        if tuple(x.shape) != (B, *shape):
            raise ValueError(f"{name} must be {(B, *shape)} per docs/LAYOUT.md, got {tuple(x.shape)}")
    for name in BUFFER_FIELDS:
        x = getattr(state, name)
        if x.dtype != q.dtype or (x.numel() and x.stride(-1) != 1) or (x.shape[2] > 1 and x.stride(2) != D):
            raise ValueError(
                f"{name} must be {q.dtype} with contiguous (token, channel) dims, got {x.dtype} strides {x.stride()}"
            )
    if tuple(state.lengths.shape) != (B,):
        raise ValueError(f"lengths must be [B={B}], got {tuple(state.lengths.shape)}")
    for name in ("k_page_table", "v_page_table"):
        pt = getattr(state, name)
        if pt.dim() != 2 or pt.shape[0] != B or pt.dtype != torch.int32 or (pt.numel() and pt.stride(1) != 1):
            raise ValueError(
                f"{name} must be int32 [B={B}, max_pages] with contiguous columns, got {pt.dtype} {tuple(pt.shape)}"
            )
    nb = cfg.num_boosted(D)
    if not cfg.quantizes_keys and state.k_raw is None:
        raise ValueError("key_bits=16 needs state.k_raw [P, Hkv, G, D]")
    if not cfg.quantizes_values and state.v_raw is None:
        raise ValueError("value_bits=16 needs state.v_raw [P, Hkv, G, D]")
    key_fields, value_fields = pool_fields(cfg, Hkv, D, q.dtype)
    pool = {name: shape for name, (shape, _) in {**key_fields, **value_fields}.items()}
    for name, shape in pool.items():
        x = getattr(state, name)
        if x is None or x.dim() != 4 - (len(shape) == 2) or tuple(x.shape[1:]) != shape or not x.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous pool [P, {', '.join(map(str, shape))}], "
                f"got {None if x is None else tuple(x.shape)}"
            )
    return dict(B=B, Hq=Hq, Hkv=Hkv, D=D, S=S, G=G, R=R, nb=nb)


# ------------------------------------------------------------------------------------------ pages <-> storage


def _key_fields(page: KeyPage) -> dict[str, torch.Tensor]:
    if page.raw.numel():
        return {"k_raw": page.raw}
    out = {}
    if page.out_val is not None:
        out = {"k_out_val": page.out_val, "k_out_tok": page.out_tok, "k_out_ch": page.out_ch}
    return {
        "k_low": page.low,
        "k_high": page.high,
        "k_boost_idx": page.boost_idx,
        "k_scale": page.scale,
        "k_zero": page.zero,
        **out,
    }


def _value_fields(page: ValuePage) -> dict[str, torch.Tensor]:
    if page.raw.numel():
        return {"v_raw": page.raw}
    out = {"v_codes": page.codes, "v_scale": page.scale, "v_zero": page.zero}
    return out if page.ref is None else {**out, "v_ref": page.ref}


def _page_getter(storage: dict[str, torch.Tensor], ids: torch.Tensor | None):
    """``name -> storage[name][ids]`` (the whole pool when ``ids`` is None)."""
    return lambda name: storage[name] if ids is None else storage[name][ids]


def key_page_from_storage(
    storage: dict[str, torch.Tensor], ids: torch.Tensor | None, cfg: KVQuantConfig, dtype: torch.dtype
) -> KeyPage:
    """A :class:`KeyPage` over pool pages ``ids`` (any shape; ``None``: the whole pool) of a LAYOUT storage dict."""
    get = _page_getter(storage, ids)
    u8 = torch.empty(0, dtype=torch.uint8)
    if not cfg.quantizes_keys:
        return KeyPage(u8, u8, u8, u8.to(dtype), u8.to(dtype), get("k_raw"), dtype, 0)
    idx = get("k_boost_idx")
    nb = cfg.num_boosted(idx.shape[-1])
    extra = {"rotation": cfg.key_rotation, "rotation_seed": cfg.seed, "boost_bits": cfg.boost_bits}
    if cfg.num_key_outliers(idx.shape[-1]):
        extra.update(out_val=get("k_out_val"), out_tok=get("k_out_tok"), out_ch=get("k_out_ch"))
    return KeyPage(get("k_low"), get("k_high"), idx, get("k_scale"), get("k_zero"), u8.to(dtype), dtype, nb, **extra)


def value_page_from_storage(
    storage: dict[str, torch.Tensor], ids: torch.Tensor | None, cfg: KVQuantConfig, dtype: torch.dtype
) -> ValuePage:
    """A :class:`ValuePage` over pool pages ``ids`` (any shape; ``None``: the whole pool) of a LAYOUT storage dict."""
    get = _page_getter(storage, ids)
    u8 = torch.empty(0, dtype=torch.uint8)
    if not cfg.quantizes_values:
        return ValuePage(u8, u8.to(dtype), u8.to(dtype), get("v_raw"), 16, dtype)
    ref = get("v_ref") if cfg.grouped_values and cfg.value_scale_bits == 8 else None
    return ValuePage(get("v_codes"), get("v_scale"), get("v_zero"), u8.to(dtype), cfg.value_bits, dtype, ref)


def page_fields(page: KeyPage | ValuePage) -> dict[str, torch.Tensor]:
    """The pool tensors (LAYOUT names) of quantized pages, e.g. from ``kitty.core.quant.quantize_key_page``."""
    return _key_fields(page) if isinstance(page, KeyPage) else _value_fields(page)


# ------------------------------------------------------------------------------------------ cache -> attention


@dataclass
class PendingKV:
    """What :meth:`KittyLayer.update` hands to the attention function: the layer and the new tokens' keys/values.

    ``key_states`` / ``value_states``: ``[B, Hkv, T, D]`` in full precision, padding included (the attention
    function knows which columns are padding and inserts only the valid ones).
    """

    layer: Any  # the kitty.cache.layer.PagedLayer the tokens belong to
    key_states: torch.Tensor
    value_states: torch.Tensor

    # A few tensor-like attributes, so that model code which only inspects keys keeps working.
    @property
    def shape(self) -> torch.Size:
        return self.key_states.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.key_states.dtype

    @property
    def device(self) -> torch.device:
        return self.key_states.device
