"""What a Kitty cache costs: where each token lives, analytic bits per element, and the same measured from nbytes.

Every token of a sequence is addressed by its absolute position ``p`` (0-based). With ``S`` sink tokens, page
size ``G`` and value window ``R``, a sequence of ``n`` tokens is laid out as (``m = max(n - S, 0)``):

    keys:   sink [0, min(n, S)) | key pages: m // G full pages | key qbuffer: m % G tokens
    values: sink [0, min(n, S)) | value pages: mv // G | value qbuffer: mv % G | local: min(m, R) newest
            where mv = max(m - R, 0)

so the counts in every place follow from ``n`` alone (:func:`token_layout`). Full-precision buffers are slotted by
position: key qbuffer slot ``(p - S) % G``, value qbuffer slot ``(p - S) % G``, local slot ``(p - S) % R``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, astuple, dataclass, replace

from .config import KVQuantConfig


@dataclass(frozen=True)
class TokenLayout:
    """How many tokens of one sequence sit in each place (see module docstring)."""

    tokens: int
    sink: int
    key_pages: int  # number of full key pages
    key_qbuffer: int
    value_pages: int
    value_qbuffer: int
    local: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def token_layout(cfg: KVQuantConfig, n: int, full_qbuffer: bool = False) -> TokenLayout:
    """Where the ``n`` tokens of one sequence live under ``cfg``.

    Between steps a qbuffer holds 0 .. G-1 tokens (a full one is packed at once). ``full_qbuffer=True`` describes
    the moment inside a decode step after the new token was inserted and before a qbuffer it filled is packed: the
    qbuffers then hold 1 .. G tokens (a filled qbuffer is not yet a page).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    m = max(n - S, 0)
    mv = max(m - R, 0)
    if full_qbuffer:
        kp, vp = max(-(-m // G) - 1, 0), max(-(-mv // G) - 1, 0)
        return TokenLayout(n, min(n, S), kp, m - kp * G, vp, mv - vp * G, min(m, R))
    return TokenLayout(n, min(n, S), m // G, m % G, mv // G, mv % G, min(m, R))


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by a KV cache (all layers and KV heads, summed over batch rows).

    Under tensor parallelism a cache holds one rank's shard of the KV heads: the byte counts are this rank's and
    ``ranks`` says how many ranks hold an equal shard; ``total_*`` are the bytes over all of them.
    """

    tokens: int  # tokens cached per layer, summed over rows
    fp16_bytes: int  # the same keys and values at 16 bits
    payload_bytes: int  # quantized codes: low/high planes, value codes (and raw pages of 16-bit configs)
    metadata_bytes: int  # scale, zero, boost_idx
    full_precision_bytes: int  # sink, qbuffers, local window
    window_bytes: int = 0  # keys and values of sliding-window layers (full precision, at most the window)
    ranks: int = 1  # tensor-parallel ranks, each holding an equal shard of the KV heads (the bytes are one rank's)

    @property
    def stored_bytes(self) -> int:
        return self.payload_bytes + self.metadata_bytes + self.full_precision_bytes + self.window_bytes

    @property
    def total_stored_bytes(self) -> int:
        """Bytes stored over all ``ranks`` (every rank holds the same number of KV heads and tokens)."""
        return self.stored_bytes * self.ranks

    @property
    def total_fp16_bytes(self) -> int:
        return self.fp16_bytes * self.ranks

    @property
    def bits_per_element(self) -> float:
        elems = self.fp16_bytes / 2
        return 8 * self.stored_bytes / elems if elems else 0.0

    @property
    def compression(self) -> float:
        return self.fp16_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def __add__(self, other: "MemoryReport") -> "MemoryReport":
        if self.ranks != other.ranks:
            raise ValueError(f"cannot add reports of {self.ranks} and {other.ranks} tensor-parallel ranks")
        sums = [a + b for a, b in zip(astuple(self)[:-1], astuple(other)[:-1])]
        return MemoryReport(*sums, ranks=self.ranks)

    def summary(self) -> str:
        text = (
            f"{self.tokens} tokens: {self.stored_bytes / 2**20:.2f} MiB stored vs {self.fp16_bytes / 2**20:.2f} MiB fp16 "
            f"({self.bits_per_element:.2f} bits/element, {self.compression:.2f}x)"
        )
        if self.window_bytes:
            text += f"; {self.window_bytes / 2**20:.2f} MiB of it in sliding-window layers"
        if self.ranks > 1:
            text += (
                f"; per rank of {self.ranks}, total {self.total_stored_bytes / 2**20:.2f} MiB vs "
                f"{self.total_fp16_bytes / 2**20:.2f} MiB fp16"
            )
        return text


def field_bytes(cfg: KVQuantConfig, head_dim: int, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes of each pool tensor (``docs/LAYOUT.md`` names) in one page of one KV head, from ``kitty.core.storage``'s
    shapes: e.g. the compact high plane ``k_high`` holds ``G * ceil(nb / 4)`` bytes.

    ``dtype_bytes`` is the element size of the model dtype, which scale/zero and raw pages use (integer fields: their
    own size).
    """
    import torch  # the page tensors' own shapes (kitty.core.storage); imported here: `import kitty` stays light

    from .storage import pool_fields

    cfg.check_head_dim(head_dim)
    key, value = pool_fields(cfg, 1, head_dim, torch.float16)
    return {
        name: math.prod(shape) * (dtype_bytes if dt.is_floating_point else dt.itemsize)
        for name, (shape, dt) in {**key, **value}.items()
    }


def page_bytes(cfg: KVQuantConfig, head_dim: int, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes of one key page and one value page of one KV head, split into payload and metadata.

    ``dtype_bytes`` is the element size of the model dtype: full-precision buffers and scale/zero use it.
    """
    from .storage import PAYLOAD_FIELDS

    out = {"key_payload": 0, "key_meta": 0, "value_payload": 0, "value_meta": 0}
    for name, n in field_bytes(cfg, head_dim, dtype_bytes).items():
        side = "key" if name.startswith("k_") else "value"
        out[f"{side}_payload" if name in PAYLOAD_FIELDS else f"{side}_meta"] += n
    return out


def analytic_report(
    cfg: KVQuantConfig,
    lengths: int | list[int],
    head_dim: int,
    num_kv_heads: int = 1,
    num_layers: int = 1,
    dtype_bytes: int = 2,
) -> MemoryReport:
    """Bytes a Kitty cache holds for sequences of ``lengths`` tokens, from the layout formula alone.

    With a ``cfg.boost_profile`` the layers are summed one by one (``num_layers`` must match the profile).
    """
    lengths = [lengths] if isinstance(lengths, int) else list(lengths)
    if cfg.boost_profile is not None:  # layer-adaptive boost: each layer's pages hold its own number of high planes
        layers = [
            analytic_report(cfg.for_layer(i, num_layers), lengths, head_dim, num_kv_heads, 1, dtype_bytes)
            for i in range(num_layers)
        ]
        return replace(sum(layers[1:], layers[0]), tokens=sum(lengths))
    pb = page_bytes(cfg, head_dim, dtype_bytes)
    payload = meta = full = 0
    for n in lengths:
        lay = token_layout(cfg, n)
        payload += lay.key_pages * pb["key_payload"] + lay.value_pages * pb["value_payload"]
        meta += lay.key_pages * pb["key_meta"] + lay.value_pages * pb["value_meta"]
        full_tokens = 2 * lay.sink + lay.key_qbuffer + lay.value_qbuffer + lay.local
        full += full_tokens * head_dim * dtype_bytes
    scale = num_kv_heads * num_layers
    n_total = sum(lengths)
    return MemoryReport(n_total, 2 * n_total * head_dim * 2 * scale, payload * scale, meta * scale, full * scale)


def asymptotic_bits(cfg: KVQuantConfig, head_dim: int, dtype_bytes: int = 2) -> dict[str, float]:
    """Bits per element of pages alone (long-context limit), keys and values, split by component.

    Every component is the bytes of its pool tensor (:func:`field_bytes`) over the ``G * D`` elements of a page, so
    the high plane costs ``8 * ceil(nb / 4) / D`` bits (its last byte is padded to 4 slots). With a
    ``cfg.boost_profile`` the components are the mean over the profile's layers (each has its own ``nb``).
    """
    if cfg.boost_profile is not None:
        layers = [asymptotic_bits(cfg.for_layer(i), head_dim, dtype_bytes) for i in range(len(cfg.boost_profile))]
        return {name: sum(a[name] for a in layers) / len(layers) for name in layers[0]}
    fb = field_bytes(cfg, head_dim, dtype_bytes)
    per = 8 / (cfg.group_size * head_dim)  # bits per element of one byte per page

    def bits(*names: str) -> float:
        return sum(fb.get(name, 0) for name in names) * per

    out = {
        "key_low": bits("k_low"),
        "key_high": bits("k_high"),
        "key_boost_idx": bits("k_boost_idx"),
        "key_scale_zero": bits("k_scale", "k_zero"),
        "key_raw": bits("k_raw"),
        "key_outliers": bits("k_out_val", "k_out_tok", "k_out_ch"),  # cfg.key_outlier_fraction: value + 2 indices
        "value_codes": bits("v_codes", "v_raw"),
        "value_scale_zero": bits("v_scale", "v_zero", "v_ref"),  # v_ref: value_scale_bits=8's reference
    }
    out["key_total"] = sum(v for k, v in out.items() if k.startswith("key_"))
    out["value_total"] = out["value_codes"] + out["value_scale_zero"]
    out["total"] = (out["key_total"] + out["value_total"]) / 2
    return out
