"""Torch reference quantizers: the math of one Kitty page (paper §3.2–3.3, §4.1, Algorithm 1).

Read top to bottom: bit packing primitives, the input check, then key pages (per-channel, with dynamic channel-wise
precision boost and the dense/sparse decomposition), then value pages (per-token), both with the ranges and codes of
:mod:`kitty.core.ranges`, then the query statistics of query-aware selection and :func:`inspect_keys` (what a
config does to one head's keys).

Shapes: inputs are ``[..., G, D]`` (tokens x channels, the layout of a transformers cache ``[B, H, T, D]``);
any leading dims are batched. Every plane packs its 2-bit codes along the axis that attention *reduces* over, so that
a byte feeds one product's reduction (``docs/LAYOUT.md``): key codes along channels (``q . k`` sums over channels),
value codes along tokens (``p . V`` sums over tokens). A key page stores, token-major:

    low        uint8 [..., G, D/4]          low 2 bits of every channel's code, 4 channels per byte
    high       uint8 [..., G, ceil(nb/4)]   high 2 bits of the nb boosted channels only (compact, by slot);
                                            boost_bits=3: bit 2 only, uint8 [..., G, ceil(nb/8)], 8 slots a byte
    boost_idx  uint8 [..., D]               slot of the channel in ``high``, or BOOST_SENTINEL if not boosted
    scale/zero       [..., D]               per channel; x ~= code * scale + zero

A value page stores ``codes`` uint8 ``[..., D, G*bits/8]`` (channel-major, packed along tokens) and per-token
scale/zero. Within a row of ``n`` codes, byte ``j`` holds codes ``j, j + n/4, j + 2n/4, j + 3n/4`` at bits 0, 2,
4, 6 (4-bit codes: ``j`` and ``j + n/2`` at bits 0 and 4; :func:`pack_bits`): bits ``2s`` of a row's bytes are
its ``s``-th quarter, a plain tile with no reshuffling. Scale/zero are kept in the input dtype (fp16/bf16: 16 bits;
fp32 stays fp32), so they never overflow.

``sync_free=True`` (the quantizers and the functions they call): no host read and no shape that depends on tensor
data, so that the call can run inside a captured CUDA graph (a static cache's decode step,
``kernels/reference.py`` ``pack_completed_ref``). Branches taken only for rare groups (a range wider than fp32, a
reconstruction near the dtype's limits) are then computed for every group and selected with ``torch.where``, which
gives the same bits, and the input is not checked for NaN or Inf (the caller's responsibility). The default
(``False``) checks the input and skips those branches after one host read each.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache

import torch

from .attnfit import split_query_stats
from .config import BOOST_BITS, KVQuantConfig
from .ranges import (
    _sq_error,
    dequantize_codes,
    quantize_codes,
    range_params,
)
from .rounding import feedback_codes

# boost_idx of an unboosted channel. A channel is boosted iff boost_idx < nb (the kernels' test too): at nb = D = 256
# every channel is boosted and slot 255 is a real slot, so the sentinel is never compared for equality.
BOOST_SENTINEL = 255
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# ----------------------------------------------------------------------------------------------- bit packing


def pack_bits(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` into uint8, ``per = 8 // bits`` codes per byte along ``dim``.

    A group of ``n`` codes (``n`` a multiple of ``per``) becomes ``n / per`` bytes, and byte ``j`` holds codes
    ``j + k * n / per`` at bit offset ``bits * k`` (``k < per``): the ``k``-th ``n / per`` codes sit at bits ``bits
    * k`` of the whole row. A kernel then reads one contiguous part of the row per shift: ``(byte >> 2k) & 3`` over
    the row's bytes is codes ``k n/4 .. (k+1) n/4 - 1``, in order.
    """
    if bits not in (1, 2, 4):
        raise ValueError(f"bits must be 1, 2 or 4, got {bits}")
    per_byte = 8 // bits
    dim = dim % codes.dim()
    if codes.shape[dim] % per_byte:
        raise ValueError(
            f"size of dim {dim} must be a multiple of {per_byte} to pack {bits}-bit codes, got {codes.shape[dim]}"
        )
    c = codes.to(torch.uint8).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], per_byte, c.shape[-1] // per_byte)  # (..., per, n/per): code k*n/per + j at [k, j]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)[:, None]
    packed = (c << shifts).sum(-2, dtype=torch.uint8)  # disjoint bit fields: sum == bitwise or
    return packed.movedim(-1, dim)


def unpack_bits(packed: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``[..., n/per_byte, ...]`` -> uint8 codes ``[..., n, ...]``."""
    if bits not in (1, 2, 4):
        raise ValueError(f"bits must be 1, 2 or 4, got {bits}")
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    dim = dim % packed.dim()
    p = packed.movedim(dim, -1)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)[:, None]
    codes = (p.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)  # (..., per, n/per)
    return codes.reshape(*p.shape[:-1], -1).movedim(-1, dim)


def high_plane_bytes(num_boosted: int, boost_bits: int = 4) -> int:
    """Bytes of a token's row of the compact high plane: ``ceil(nb / 4)`` (4 slots of 2 bits per byte, the last byte
    padded) for 4-bit boosted channels, ``ceil(nb / 8)`` (8 slots of 1 bit) for 3-bit ones (``cfg.boost_bits``)."""
    if boost_bits not in BOOST_BITS:
        raise ValueError(f"boost_bits must be one of {BOOST_BITS}, got {boost_bits!r}")
    per = 8 // (boost_bits - 2)
    return -(-num_boosted // per)


def pack_2bit(codes: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Four 2-bit codes per byte along ``dim`` (:func:`pack_bits`)."""
    return pack_bits(codes, 2, dim)


def unpack_2bit(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack_2bit`."""
    return unpack_bits(packed, 2, dim)


# ------------------------------------------------------------------------------------------------- input check


def _check_input(x: torch.Tensor, name: str, finite: bool = True) -> None:
    """``ValueError`` naming ``name`` unless ``x`` is a float tensor ``[..., G, D]`` with no empty dim, and finite
    (``finite=False``: not checked, the one check that reads the data back to the host)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor [..., G, D], got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be one of {FLOAT_DTYPES}, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{name} must be [..., G tokens, D channels] (at least 2-D), got shape {tuple(x.shape)}")
    if 0 in x.shape:
        raise ValueError(f"{name} must have at least one token, one channel and one row, got shape {tuple(x.shape)}")
    if finite and not torch.isfinite(x).all():
        raise ValueError(f"{name} holds NaN or Inf; Kitty quantizes only finite keys and values")


# ------------------------------------------------------------------------------------------------ key pages


@dataclass
class _Page:
    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    @property
    def nbytes(self) -> int:
        """Bytes of every stored tensor (payload + metadata)."""
        return sum(t.nbytes for t in self.tensors().values())


@dataclass
class KeyPage(_Page):
    """One page of keys (``G`` tokens x ``D`` channels, batched over leading dims), see the module docstring.

    For unquantized keys (``key_bits=16``) only ``raw`` ``[..., G, D]`` holds data and the planes are empty.
    """

    low: torch.Tensor  # uint8 [..., G, D/4]
    high: torch.Tensor  # uint8 [..., G, ceil(nb/4)] (boost_bits=3: ceil(nb/8)); slots past nb hold code 0
    boost_idx: torch.Tensor  # uint8 [..., D]
    scale: torch.Tensor  # [..., D]
    zero: torch.Tensor  # [..., D]
    raw: torch.Tensor  # [..., G, D] for key_bits=16, else empty
    dtype: torch.dtype  # dtype dequantization returns
    num_boosted: int  # nb: boosted channels per page (the high plane's bytes hold ceil(nb/4) * 4 slots)
    # cfg.key_outlier_fraction > 0: n entries per page kept exactly (in the rotated basis if key_rotation is set)
    out_val: torch.Tensor | None = None  # [..., n] in dtype
    out_tok: torch.Tensor | None = None  # uint8 [..., n] token of each outlier
    out_ch: torch.Tensor | None = None  # uint8 [..., n] channel of each outlier
    rotation: str = "none"  # cfg.key_rotation the codes were made in (a fixed matrix: nothing stored)
    rotation_seed: int = 0  # cfg.seed, for the sign flips of "hadamard-signs"
    boost_bits: int = 4  # cfg.boost_bits: 4 = 2-bit slots in ``high``, 3 = 1-bit slots

    @property
    def payload_nbytes(self) -> int:
        out = self.out_val.nbytes if self.out_val is not None else 0
        return self.low.nbytes + self.high.nbytes + self.raw.nbytes + out

    @property
    def metadata_nbytes(self) -> int:
        out = sum(t.nbytes for t in (self.out_tok, self.out_ch) if t is not None)
        return self.boost_idx.nbytes + self.scale.nbytes + self.zero.nbytes + out


def _hadamard(n: int) -> torch.Tensor:
    """The ``n x n`` Walsh-Hadamard matrix of +-1 (Sylvester's construction), fp32; ``n`` a power of two."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@lru_cache(maxsize=64)
def rotation_matrix(kind: str, head_dim: int, seed: int, device: torch.device) -> torch.Tensor:
    """The orthogonal ``[D, D]`` fp32 matrix ``R`` of ``key_rotation=kind``: keys (row vectors) are stored as
    ``k @ R`` and read back as ``k_hat @ R.T``.

    ``"hadamard"``: ``H / sqrt(D)`` (``H`` the Walsh-Hadamard matrix, symmetric, ``H @ H = D I``);
    ``"hadamard-signs"``: ``diag(s) @ H / sqrt(D)`` with ``s`` fixed random signs from a host generator seeded with
    ``seed`` (QuaRot's randomized Hadamard). Built on the host and copied once per device, then kept (read only), as
    ``_random_scores`` is: a copy inside a captured CUDA graph would fail the capture."""
    if kind not in ("hadamard", "hadamard-signs"):
        raise ValueError(f"key_rotation must be 'hadamard' or 'hadamard-signs' to build a matrix, got {kind!r}")
    if head_dim <= 0 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two for key_rotation={kind!r}, got {head_dim}")
    r = _hadamard(head_dim) / head_dim**0.5
    if kind == "hadamard-signs":
        gen = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1
        r = signs[:, None] * r
    with torch.inference_mode(False):  # a kept tensor must be usable outside an inference-mode region as well
        return r.to(device)


def rotate_keys(k: torch.Tensor, kind: str, seed: int = 0, inverse: bool = False) -> torch.Tensor:
    """Keys ``[..., D]`` times the ``key_rotation`` matrix (``inverse``: its transpose), computed in fp32 and
    returned in ``k.dtype``; ``kind="none"`` returns ``k`` itself."""
    if kind == "none":
        return k
    r = rotation_matrix(kind, k.shape[-1], seed, k.device)
    return (k.float() @ (r.T if inverse else r)).to(k.dtype)


def split_key_outliers(
    k: torch.Tensor, count: int, rule: str = "zscore"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense-and-sparse split of keys ``[..., G, D]`` (``cfg.key_outlier_fraction``): ``(dense, val, tok, ch)``.

    Per row (a page of one head) the ``count`` entries of largest deviation from their channel's mean over the ``G``
    tokens are the outliers, the deviation measured by ``rule`` (``cfg.key_outlier_rule``): ``"zscore"`` ``|k - mean|
    / std`` (population std; a constant channel deviates nowhere), ``"absolute"`` ``|k - mean|``. ``val`` their exact
    values ``[..., count]`` in ``k.dtype``, ``tok`` / ``ch`` their token and channel (uint8). ``dense`` is ``k`` with
    each outlier replaced by the mean of its channel's other entries, a value inside their range, so that any range
    rule (min-max included) then spans the remaining entries only. No host read, fixed shapes (``torch.topk``)."""
    *lead, G, D = k.shape
    x = k.float()
    mean = x.mean(-2, keepdim=True)
    std = x.std(-2, correction=0, keepdim=True)
    if rule not in ("zscore", "absolute"):
        raise ValueError(f"key_outlier_rule must be 'zscore' or 'absolute', got {rule!r}")
    dev = (x - mean).abs()
    if rule == "zscore":
        dev = torch.where(std > 0, dev / torch.where(std > 0, std, 1.0), 0.0)
    idx = dev.flatten(-2).topk(count, dim=-1).indices  # [..., count], flat index t * D + c
    val = k.flatten(-2).gather(-1, idx)
    mask = torch.zeros(*lead, G * D, dtype=torch.bool, device=k.device).scatter_(-1, idx, True).view(*lead, G, D)
    rest = (~mask).float()
    rest_mean = (x * rest).sum(-2, keepdim=True) / rest.sum(-2, keepdim=True).clamp_min(1)
    dense = torch.where(mask, rest_mean, x).to(k.dtype)
    return dense, val, (idx // D).to(torch.uint8), (idx % D).to(torch.uint8)


def channel_importance(
    k: torch.Tensor,
    cfg: KVQuantConfig,
    salt: int = 0,
    query_scale: torch.Tensor | None = None,
    sync_free: bool = False,
) -> torch.Tensor:
    """Score of each key channel, higher = boosted first. ``k``: ``[..., G, D]`` -> ``[..., D]`` fp32.

    - ``magnitude``: the paper's ``s_i = mean_t |K[t, i]|``.
    - ``random``: a fixed random score per channel from ``cfg.seed`` and ``salt`` (e.g. the layer index), the same
      for every page: the ablation baseline (drawn on the host once per device, then kept there: later calls copy
      nothing to the device).
    - ``range``: ``max_t K[t, i] - min_t K[t, i]``, the range 2-bit quantization divides into steps.
    - ``query``: ``query_scale_i * range_i``: a channel's contribution to the logit error ``q . (k - k_hat)`` grows
      with ``|q_i|`` times its quantization step; ``query_scale`` ``[..., D]`` is the mean ``|q|`` of the queries
      of the KV head's GQA group (``KittyCache`` keeps it per row and head).
    - ``oracle``: the attention-logit squared error boosting channel ``i`` removes on this page,
      ``query_scale_i**2 * (err_2bit_i - err_4bit_i)`` with ``err`` the squared reconstruction error of the channel
      quantized both ways (with ``cfg.key_range``) and ``query_scale`` the root mean square of ``q_i`` (so
      ``query_scale**2 = E[q_i^2]``). Under uncorrelated rounding errors this is exactly each channel's share of
      the expected logit MSE, so the top-``nb`` choice is the per-page optimum (expensive: two quantizations).

    ``sync_free``: no host read (module docstring), the same scores.
    """
    sel = cfg.channel_selection
    if sel == "magnitude":
        return k.float().abs().mean(-2)
    if sel == "random":
        scores = _random_scores(cfg.seed * 1_000_003 + salt, k.shape[-1], k.device)
        return scores.expand(*k.shape[:-2], k.shape[-1])
    kf = k.float()
    if sel == "range":
        return kf.amax(-2) - kf.amin(-2)
    query_scale, query_stat = split_query_stats(query_scale, k.shape[-1])
    qs = _require_query_scale(cfg, query_scale, k.device)
    if sel == "query":
        return qs.expand(kf.shape[:-2] + kf.shape[-1:]) * (kf.amax(-2) - kf.amin(-2))
    if sel == "oracle":
        return _oracle_scores(k.transpose(-1, -2), _both_precisions(k, cfg, sync_free, query_stat), qs, sync_free)
    raise ValueError(f"channel_selection {sel!r} has no importance rule")


@lru_cache(maxsize=1024)
def _random_scores(seed: int, num_channels: int, device: torch.device) -> torch.Tensor:
    """The ``random`` selection's scores ``[num_channels]`` fp32 on ``device``: drawn from a host generator seeded
    with ``seed`` (the same numbers on every device), copied once and kept, because a host-to-device copy inside a
    captured CUDA graph synchronizes and fails the capture. Read only (callers get views of the kept tensor)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode(False):  # a kept tensor must be usable outside an inference-mode region as well
        return torch.rand(num_channels, generator=gen).to(device)


def _require_query_scale(cfg: KVQuantConfig, query_scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``query_scale`` as fp32 on ``device``; a ``ValueError`` naming it if a query-aware selection lacks it."""
    if query_scale is None:
        raise ValueError(
            f"channel_selection={cfg.channel_selection!r} needs query_scale [..., D] (per-channel query magnitude of the GQA group)"
        )
    return query_scale.float().to(device)


def _both_precisions(
    k: torch.Tensor, cfg: KVQuantConfig, sync_free: bool = False, query_stat: torch.Tensor | None = None
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per-channel ``(scale, zero)`` of keys ``[..., G, D]`` at the low and at the boosted precision, by levels."""
    x = k.transpose(-1, -2)  # (..., D, G): one row per channel
    levels = (2**cfg.key_bits - 1, 2**cfg.boost_bits - 1)
    return {lv: range_params(x, lv, k.dtype, cfg.key_range, sync_free, query_stat) for lv in levels}


def _oracle_scores(
    x: torch.Tensor,
    params: dict[int, tuple[torch.Tensor, torch.Tensor]],
    query_scale: torch.Tensor,
    sync_free: bool = False,
) -> torch.Tensor:
    """``query_scale**2 * (err_low - err_high)`` per channel row of ``x`` ``[..., D, G]`` (see channel_importance)."""
    (lo, p_lo), (hi, p_hi) = sorted(params.items())
    err_lo = _sq_error(x.float(), *p_lo, lo, sync_free)
    err_hi = _sq_error(x.float(), *p_hi, hi, sync_free)
    return query_scale.square() * (err_lo - err_hi)


def select_boosted(importance: torch.Tensor, num_boosted: int) -> torch.Tensor:
    """Boolean mask ``[..., D]`` of the top ``num_boosted`` channels by importance."""
    mask = torch.zeros(importance.shape, dtype=torch.bool, device=importance.device)
    if num_boosted:
        mask.scatter_(-1, importance.topk(num_boosted, dim=-1).indices, True)
    return mask


def boost_slots(mask: torch.Tensor) -> torch.Tensor:
    """``boost_idx`` from a boost mask: rank among boosted channels (by channel index), sentinel elsewhere."""
    slot = mask.to(torch.int32).cumsum(-1) - 1
    return torch.where(mask, slot, BOOST_SENTINEL).to(torch.uint8)


def quantize_key_page(
    k: torch.Tensor,
    cfg: KVQuantConfig,
    salt: int = 0,
    boost_mask: torch.Tensor | None = None,
    query_scale: torch.Tensor | None = None,
    sync_free: bool = False,
    query_cov: torch.Tensor | None = None,
) -> KeyPage:
    """Quantize keys ``[..., G, D]`` per channel into a :class:`KeyPage`.

    Boosted channels (top ``cfg.num_boosted(D)`` by :func:`channel_importance`, or ``boost_mask`` if given, with
    that many channels per row) get ``cfg.boost_bits``-bit codes (4, or 3), the rest 2-bit (``query_scale``: for
    ``channel_selection="query"``/``"oracle"``); each channel's ``[lo, hi]`` comes from ``cfg.key_range``; each code
    is split into the dense low plane and, for boosted channels, the compact high plane.

    ``query_cov`` ``[..., D, D]`` (``key_rounding="query"``, required there): the second moment of the queries each
    row's head has seen, which the codes are rounded against (:mod:`kitty.core.rounding`).

    ``sync_free``: no host read and no data-dependent shape (module docstring), the same page; ``k`` is then not
    checked for NaN or Inf.
    """
    _check_input(k, "k", finite=not sync_free)
    *lead, G, D = k.shape
    cfg.check_head_dim(D)
    empty = k.new_empty(0)
    if not cfg.quantizes_keys:
        u8 = torch.empty(0, dtype=torch.uint8, device=k.device)
        return KeyPage(u8, u8, u8, empty, empty, k.clone(), k.dtype, 0)
    extra = {"rotation": cfg.key_rotation, "rotation_seed": cfg.seed, "boost_bits": cfg.boost_bits}
    if cfg.key_rotation != "none":  # quantize the rotated channels; dequantize_key_page rotates back
        k = rotate_keys(k, cfg.key_rotation, cfg.seed)
        if not sync_free and not torch.isfinite(k).all():
            raise ValueError(f"k overflows {k.dtype} after key_rotation={cfg.key_rotation!r} (|k| too large)")
    n_out = cfg.num_key_outliers(D)
    if n_out:  # dense-and-sparse: the outliers kept exactly, the rest quantized as usual
        k, *outliers = split_key_outliers(k, n_out, cfg.key_outlier_rule)
        extra.update(zip(("out_val", "out_tok", "out_ch"), outliers))
    nb = cfg.num_boosted(D)
    query_scale, query_stat = split_query_stats(query_scale, D)  # fit-attn: the mean query or weights after the RMS
    x = k.transpose(-1, -2)  # (..., D, G): one row per channel
    both = None  # oracle selection fits both precisions of every channel: reuse them rather than fit again
    if boost_mask is None and nb in (0, D):  # nothing to choose
        boost_mask = torch.full((*lead, D), nb == D, dtype=torch.bool, device=k.device)
    elif boost_mask is None and cfg.channel_selection == "oracle":
        qs = _require_query_scale(cfg, query_scale, k.device)
        both = _both_precisions(k, cfg, sync_free, query_stat)
        boost_mask = select_boosted(_oracle_scores(x, both, qs, sync_free), nb)
    elif boost_mask is None:
        boost_mask = select_boosted(channel_importance(k, cfg, salt, query_scale, sync_free), nb)
    levels = torch.where(boost_mask, 2**cfg.boost_bits - 1, 2**cfg.key_bits - 1)  # [..., D]
    if both is None:
        scale, zero = range_params(x, levels, k.dtype, cfg.key_range, sync_free, query_stat)  # in the input dtype
    else:  # the same per-channel fits as range_params(x, levels) would compute (fits are per channel row)
        (lo, p_lo), (hi, p_hi) = sorted(both.items())
        scale, zero = (torch.where(boost_mask, h, l) for h, l in zip(p_hi, p_lo))
    if cfg.key_rounding == "query":
        if query_cov is None or query_cov.shape[-2:] != (D, D):
            got = None if query_cov is None else tuple(query_cov.shape)
            raise ValueError(
                f"key_rounding='query' needs query_cov [..., {D}, {D}] (the queries' second moment), got {got}"
            )
        cov = query_cov.to(k.device).expand(*lead, D, D)
        codes = feedback_codes(x, scale, zero, levels, cov)  # (..., D, G) uint8
    else:
        codes = quantize_codes(x, scale[..., None], zero[..., None], levels[..., None])  # (..., D, G) uint8
    low = pack_2bit(codes.transpose(-1, -2) & 0x3).contiguous()  # (..., G, D/4): 4 channels per byte
    if sync_free:  # a stable sort puts each row's nb boosted channels first, in index order: a fixed shape
        boosted_channels = torch.argsort((~boost_mask).to(torch.uint8), dim=-1, stable=True)[..., :nb]
    else:
        boosted_channels = boost_mask.nonzero()[:, -1].reshape(*lead, nb)  # (..., nb) ascending channel index
    high_codes = torch.gather(codes >> 2, -2, boosted_channels[..., None].expand(*lead, nb, G))  # (..., nb, G)
    hb = cfg.boost_bits - 2  # bits a slot of the high plane holds (2, or 1 for 3-bit codes)
    slots = (8 // hb) * high_plane_bytes(nb, cfg.boost_bits)
    high_codes = torch.nn.functional.pad(high_codes, (0, 0, 0, slots - nb))  # padding slots: 0
    high = pack_bits(high_codes.transpose(-1, -2), hb).contiguous()  # (..., G, ceil(nb/4)) or (..., G, ceil(nb/8))
    return KeyPage(low, high, boost_slots(boost_mask), scale, zero, empty, k.dtype, nb, **extra)


def key_page_codes(page: KeyPage) -> torch.Tensor:
    """Algorithm 1, lines 5–14: integer codes ``[..., D, G]`` from ``low | high << 2`` through ``boost_idx`` (``high``
    a 2-bit slot, or a 1-bit one for ``boost_bits=3``)."""
    low = unpack_2bit(page.low).transpose(-1, -2)  # (..., D, G)
    if page.num_boosted == 0:
        return low
    boost_mask = page.boost_idx.long() < page.num_boosted  # (..., D); slot 255 is real when nb = 256
    slot = torch.where(boost_mask, page.boost_idx.long(), 0)
    high_slots = unpack_bits(page.high, page.boost_bits - 2)  # (..., G, slots): 2-bit slots, or 1-bit at 3 bits
    high = torch.gather(high_slots, -1, slot[..., None, :].expand(*high_slots.shape[:-1], slot.shape[-1]))
    return low | ((high.transpose(-1, -2) * boost_mask[..., None]) << 2)


def dequantize_key_page(page: KeyPage) -> torch.Tensor:
    """Reconstruct keys ``[..., G, D]`` in ``page.dtype`` (Algorithm 1, line 15: ``X * scale + zero``)."""
    if page.raw.numel():
        return page.raw
    x = dequantize_codes(key_page_codes(page), page.scale[..., None], page.zero[..., None], page.dtype)
    x = x.transpose(-1, -2)
    if page.out_val is not None and page.out_val.shape[-1]:  # the outliers overwrite their (meaningless) codes
        *lead, G, D = x.shape
        flat = page.out_tok.long() * D + page.out_ch.long()
        x = x.reshape(*lead, G * D).scatter(-1, flat, page.out_val.to(x.dtype)).view(*lead, G, D)
    return rotate_keys(x, page.rotation, page.rotation_seed, inverse=True)


# ---------------------------------------------------------------------------------------------- value pages


@dataclass
class ValuePage(_Page):
    """One page of values (``G`` tokens x ``D`` channels), quantized per token.

    ``codes``: uint8 ``[..., D, G * bits / 8]`` (channel-major, packed along tokens); ``scale``/``zero``:
    ``[..., G]``. For ``value_bits=16`` only
    ``raw`` ``[..., G, D]`` holds data.

    :attr:`grouped` (``KVQuantConfig.grouped_values``): ``scale``/``zero`` are ``[..., G, groups]``, one per token
    and group of ``D / groups`` channels, in the dtype, or with ``ref`` (``[...]``, the dtype) as 8-bit codes:
    ``scale`` uint8 and ``zero`` int8 (:func:`decode_value_meta8`).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    raw: torch.Tensor
    bits: int
    dtype: torch.dtype
    ref: torch.Tensor | None = None

    @property
    def grouped(self) -> bool:
        """Whether ``scale``/``zero`` hold a group axis (``[..., G, groups]``: as many dims as ``codes``)."""
        return not self.raw.numel() and self.scale.dim() == self.codes.dim()

    @property
    def payload_nbytes(self) -> int:
        return self.codes.nbytes + self.raw.nbytes

    @property
    def metadata_nbytes(self) -> int:
        return self.scale.nbytes + self.zero.nbytes + (0 if self.ref is None else self.ref.nbytes)


META8_STEPS = 16  # 8-bit value scales: grid steps per octave below the page's reference (255 steps: ~16 octaves)
META8_ZERO_STEPS = 127 / 4  # 8-bit value zeros: int8 quarters of the group's step, so at most this many steps from 0


def encode_value_meta8(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 8-bit form of value groups' ``(scale, zero)`` ``[..., G, groups]`` (the dtype): ``(c, z, ref)``.

    ``ref`` ``[...]`` (the dtype) is the largest step the page's groups need, rounded up to the dtype; a group's step
    is ``ref * 2**(-c / META8_STEPS)`` with ``c`` uint8, the smallest grid step at least its scale and at least
    ``|zero| / META8_ZERO_STEPS`` (so that the zero fits); the zero is ``z * step / 4`` with ``z`` the nearest int8.
    Rounding the step up keeps a min-max group's range covered up to the zero's rounding (an eighth of a step). No
    host read."""
    s, z = scale.float(), zero.float()
    need = torch.maximum(s, z.abs() / META8_ZERO_STEPS)
    top = need.amax((-1, -2))
    ref = top.to(scale.dtype)
    ref = torch.where(ref.float() < top, torch.nextafter(ref, torch.full_like(ref, float("inf"))), ref)
    r = ref.float()[..., None, None]
    ratio = torch.where(r > 0, need / torch.where(r > 0, r, 1.0), 1.0)
    c = torch.floor(-META8_STEPS * torch.log2(ratio.clamp_min(2.0 ** (-256 / META8_STEPS)))).clamp(0, 255)
    c = torch.where(r * torch.exp2(-c / META8_STEPS) < need, c - 1, c).clamp(0, 255)  # exp2/log2 rounding: cover
    step = r * torch.exp2(-c / META8_STEPS)
    zq = torch.where(step > 0, z / torch.where(step > 0, step, 1.0) * 4, 0.0).round().clamp(-128, 127)
    return c.to(torch.uint8), zq.to(torch.int8), ref


def decode_value_meta8(c: torch.Tensor, z: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero)`` in fp32 of :func:`encode_value_meta8`'s codes."""
    step = ref.float()[..., None, None] * torch.exp2(-c.float() / META8_STEPS)
    return step, z.float() * step / 4


def value_group_params(page: ValuePage) -> tuple[torch.Tensor, torch.Tensor]:
    """A page's ``(scale, zero)`` as its codes are reconstructed with: ``[..., G]``, or ``[..., G, groups]`` for a
    grouped page (decoded from 8 bits where it has a ``ref``)."""
    if page.ref is not None:
        return decode_value_meta8(page.scale, page.zero, page.ref)
    return page.scale, page.zero


def quantize_value_page(v: torch.Tensor, cfg: KVQuantConfig, sync_free: bool = False) -> ValuePage:
    """Quantize values ``[..., G, D]`` per token with ``cfg.value_bits``, each token's ``[lo, hi]`` over channels
    from ``cfg.value_range``. ``sync_free``: no host read (module docstring), the same page; ``v`` is then not
    checked for NaN or Inf."""
    _check_input(v, "v", finite=not sync_free)  # values pack along tokens: any channel count D >= 1 fits
    empty = v.new_empty(0)
    if not cfg.quantizes_values:
        return ValuePage(torch.empty(0, dtype=torch.uint8, device=v.device), empty, empty, v.clone(), 16, v.dtype)
    if v.shape[-2] % (8 // cfg.value_bits):
        raise ValueError(
            f"a value page packs {8 // cfg.value_bits} tokens per byte: its token count must be a multiple of that, "
            f"got {v.shape[-2]}"
        )
    levels = 2**cfg.value_bits - 1
    x = v
    if cfg.grouped_values:  # [..., G, groups, D / groups]: a range per token and group of channels
        cfg.check_value_groups(v.shape[-1])
        x = v.unflatten(-1, (cfg.value_groups, -1))
    scale, zero = range_params(x, levels, v.dtype, cfg.value_range, sync_free)  # [..., G] or [..., G, groups]
    ref, s, z = None, scale, zero
    if cfg.grouped_values and cfg.value_scale_bits == 8:  # stored as 8-bit codes, the codes chosen for what they hold
        scale, zero, ref = encode_value_meta8(scale, zero)
        s, z = decode_value_meta8(scale, zero, ref)
    codes = quantize_codes(x, s[..., None], z[..., None], levels).reshape(v.shape)
    packed = pack_bits(codes.transpose(-1, -2), cfg.value_bits).contiguous()  # (..., D, G*bits/8): along tokens
    return ValuePage(packed, scale, zero, empty, cfg.value_bits, v.dtype, ref)


def dequantize_value_page(page: ValuePage) -> torch.Tensor:
    """Reconstruct values ``[..., G, D]`` in ``page.dtype``."""
    if page.raw.numel():
        return page.raw
    codes = unpack_bits(page.codes, page.bits).transpose(-1, -2)  # (..., D, G) -> (..., G, D)
    s, z = value_group_params(page)
    x = codes.unflatten(-1, (s.shape[-1], -1)) if page.grouped else codes  # [..., G, groups, D / groups]
    return dequantize_codes(x, s[..., None], z[..., None], page.dtype).reshape(codes.shape)


# ------------------------------------------------------------------------------------ query statistics


def query_statistic(q: torch.Tensor, selection: str) -> torch.Tensor:
    """What query-aware selections average per channel over queries: ``|q|`` (``"query"``) or ``q**2``
    (``"oracle"``), in fp32, same shape as ``q``."""
    if selection not in ("query", "oracle"):
        raise ValueError(f"selection must be 'query' or 'oracle', got {selection!r}")
    q = q.float()
    return q.abs() if selection == "query" else q.square()


def query_scale_from(mean_statistic: torch.Tensor, selection: str) -> torch.Tensor:
    """``query_scale`` of :func:`channel_importance` from the mean of :func:`query_statistic`: mean ``|q|`` for
    ``"query"``, root mean square of ``q`` for ``"oracle"``."""
    return mean_statistic if selection == "query" else mean_statistic.sqrt()


# ------------------------------------------------------------------------------------------- inspection


@dataclass
class PageInspection:
    """One group of G key tokens of one KV head: its boosted channels and its key error with and without them."""

    start: int  # absolute position of the first token
    end: int  # one past the last
    quantized: bool  # a full page (True) or the qbuffer (False: what would be boosted if it were quantized now)
    boosted: list[int]  # channel indices, ascending
    error_boosted: float  # relative Frobenius error of the dequantized page, with the boost
    error_2bit: float  # the same page, every channel at 2 bits (KIVI-like)


@dataclass
class KeyInspection:
    """Keys of one layer and KV head, and how ``cfg`` would store them."""

    method: str
    layer: int
    head: int
    abs_keys: torch.Tensor  # [T, D] fp32 |K|
    sink: int  # tokens [0, sink) stay in full precision
    pages: list[PageInspection]
    group_size: int


def inspect_keys(
    keys: torch.Tensor, cfg: KVQuantConfig, layer: int = 0, head: int = 0, query_scale: torch.Tensor | None = None
) -> KeyInspection:
    """Boosted channels and key error of every page of ``keys`` ``[T, D]`` (one layer, one KV head) under ``cfg``.

    Follows the cache layout: the first ``sink_tokens`` stay full precision, then pages of ``group_size`` tokens;
    the trailing partial group (the qbuffer) is shown with the channels it would boost if quantized now.
    ``query_scale`` ``[D]``: for query-aware selections (``kitty.hf.generate.prompt_query_scale``). A
    ``boost_profile`` is applied for ``layer``.
    """
    if cfg.key_bits != 2:
        raise ValueError(
            f"pick a method with 2-bit keys to see boosted channels, got {cfg.name} (key_bits={cfg.key_bits})"
        )
    cfg = cfg.for_layer(layer)
    T, D = keys.shape
    S, G = min(cfg.sink_tokens, T), cfg.group_size
    nb = cfg.num_boosted(D)
    plain = cfg.with_(boost_fraction=0.0, channel_selection="magnitude")
    pages = []
    for start in range(S, T, G):
        end = min(start + G, T)
        chunk = keys[start:end]
        mask = select_boosted(channel_importance(chunk, cfg, salt=layer, query_scale=query_scale), nb)
        ref = chunk.float()
        errs = []
        for c, m in ((cfg, mask), (plain, None)):
            deq = dequantize_key_page(quantize_key_page(chunk, c, salt=layer, boost_mask=m)).float()
            errs.append(float((deq - ref).norm() / ref.norm().clamp_min(1e-12)))
        pages.append(PageInspection(start, end, end - start == G, mask.nonzero().flatten().tolist(), errs[0], errs[1]))
    return KeyInspection(cfg.name, layer, head, keys.float().abs(), S, pages, G)
