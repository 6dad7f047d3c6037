"""What to quantize and how: ``KVQuantConfig`` and the named ``PRESETS`` (paper: arXiv 2511.18643)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

VALID_BITS = (2, 4, 16)  # 16 = kept in full precision (no quantization)
CHANNEL_SELECTIONS = ("magnitude", "random", "range", "query", "oracle")
QUERY_SELECTIONS = ("query", "oracle")  # channel selections that rank channels with running query statistics
BACKENDS = (
    "auto",
    "torch",
    "triton",
    "gluon",
)  # KittyCache(backend=): kitty/cache/backend.py resolves it once per layer
KEY_ONLY_RANGES = (
    "fit-attn",
    "fit-attn-free",
    "fit-attn-token-standout",
    "fit-attn-bound",
    "fit-attn-token-bound",
    "fit-attn-max-bound",
    "fit-attn-max-token-bound",
    "fit-attn-max-rel-bound",
    "fit-attn-max-rel-token-bound",
)  # weighted by the tokens' expected attention: key pages only
# a group's [lo, hi]: min-max, a clipping search, one sparing the peak, one keeping every value within min-max's bound,
# or min-max where a value (or a token of the page) stands out and fit-bounded / fit-peak / the bounded search within
# one min-max step (fit-loose) elsewhere (core/standout.py), or a search weighted by attention (core/attnfit.py)
RANGE_FITS = (
    "minmax",
    "fit",
    "fit-peak",
    "fit-bounded",
    "fit-standout",
    "fit-peak-standout",
    "fit-token-standout",
    "fit-peak-token-standout",
    "fit-loose-token-standout",
) + KEY_ONLY_RANGES
VALUE_RANGES = tuple(r for r in RANGE_FITS if r not in KEY_ONLY_RANGES)
# key_rotation: each key head's channels multiplied by a fixed orthogonal matrix before quantization (and back after):
# "hadamard" the normalized Walsh-Hadamard matrix of size head_dim, "hadamard-signs" the same after a fixed random
# sign flip per channel (QuaRot's randomized Hadamard), drawn from ``seed``
KEY_ROTATIONS = ("none", "hadamard", "hadamard-signs")
# key_rounding: how a key entry takes its level within its channel's range: "nearest", or "query" (each token's codes
# chosen channel after channel with the rounding error fed forward through the queries' second moment, so that the
# logits rather than the keys come out closest: kitty.core.rounding), torch path only
KEY_ROUNDINGS = ("nearest", "query")
# key_outlier_rule: how a page's outliers are ranked, by deviation from their channel's mean over the page's tokens:
# "zscore" in units of that channel's std, "absolute" as is (favours the widest channels)
KEY_OUTLIER_RULES = ("zscore", "absolute")
MAX_OUTLIER_GROUP = 256  # key outliers store their token index in a uint8: pages of at most this many tokens
MAX_HEAD_DIM = 256  # boost_idx is uint8: one slot per channel
# boost_bits: 4 (the paper's INT4: a boosted channel's bits 2-3 in a high plane of 2-bit slots, 4 a byte) or 3 (its
# bit 2 in a high plane of 1-bit slots, 8 a byte: twice the channels at the same bytes); 3 is read by the torch
# quantizer only (KVQuantConfig.torch_only)
BOOST_BITS = (4, 3)
# value_groups / value_scale_bits (torch path only when changed): channel groups per value token, bits of their
# scale and zero
VALUE_GROUPS = (1, 2, 4)
VALUE_SCALE_BITS = (16, 8)
# sink, qbuffers and local window are allocated per row and layer up front: sizes beyond this are typing mistakes
# (the paper uses S = 32, G = R = 128), refused before they allocate gigabytes
MAX_BUFFER_TOKENS = 4096


def is_int(x: object) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an ``int`` in Python, never a size or a bit width here)."""
    return isinstance(x, int) and not isinstance(x, bool)


def kv_dims(config) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers config (its text part for multimodal ones).

    The key/value head count is ``num_key_value_heads``, or Falcon's spelling ``num_kv_heads``; a config with
    neither has one key/value head per query head (multi-head attention). Raises ``ValueError`` naming the field
    when a count is not a positive integer or does not divide the query heads."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config

    def positive(name: str, value: object, rule: str = "a positive integer") -> None:
        if not is_int(value) or value <= 0:
            raise ValueError(f"config.{name} must be {rule}, got {value!r}")

    positive("num_hidden_layers", getattr(text, "num_hidden_layers", None))
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None)
    field = next((f for f in ("num_key_value_heads", "num_kv_heads") if getattr(text, f, None) is not None), None)
    if head_dim is None or field is None:  # read from the query heads
        positive("num_attention_heads", heads)
    head_dim = head_dim or text.hidden_size // heads
    num_kv_heads = getattr(text, field) if field else heads
    if field:
        positive(field, num_kv_heads)
    if field and is_int(heads) and heads % num_kv_heads:
        raise ValueError(f"config.{field} must divide num_attention_heads={heads}, got {num_kv_heads}")
    return text.num_hidden_layers, num_kv_heads, head_dim


def is_number(x: object) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class KVQuantConfig:
    """Kitty KV-cache quantization settings.

    Keys are quantized per channel over pages of ``group_size`` tokens; in each page the top
    ``round(boost_fraction * head_dim)`` channels by mean |K| get ``boost_bits``, the rest ``key_bits``.
    Values are quantized per token. The first ``sink_tokens`` tokens and the newest ``local_window`` values stay
    in full precision.

    Key-side options beyond the paper, read by the torch quantizer (``kitty.core.quant``) only; the Triton pack
    and the fused kernels do not read them, so a config that sets any runs on the torch backend
    (:attr:`torch_only`):

    - ``boost_bits=3`` (``BOOST_BITS``): boosted channels get 3-bit codes, the low 2 bits in the dense low plane and
      bit 2 in a high plane of 1-bit slots (``ceil(nb / 8)`` bytes a token): ``boost_fraction=0.25, boost_bits=3``
      takes the bytes of ``boost_fraction=0.125`` at 4 bits (``kitty``'s).

    - ``key_rotation`` (``KEY_ROTATIONS``): each page's keys ``[G, D]`` are multiplied by a fixed orthogonal ``D x D``
      matrix before quantization and by its transpose after dequantization (exact in full precision, so only the
      quantization error changes); needs a power-of-two ``head_dim``. Channel selection, ranges and boost then act
      on the rotated channels.
    - ``key_rounding="query"`` (``KEY_ROUNDINGS``): the same ranges, boosted channels and bytes as nearest
      rounding, but each token's codes are chosen channel after channel with the rounding error fed forward
      through the second moment of the queries the cache has seen (``kitty.core.rounding``): the expected squared
      logit error, not the key error, is what the rounding lowers.
    - ``key_outlier_fraction``: per page and head, the ``round(fraction * G * D)`` key entries of largest deviation
      from their channel (``key_outlier_rule``: ``|k - mean| / std`` over the page's tokens, or ``|k - mean|``) are
      stored exactly (a value in the model dtype
      plus a uint8 token and a uint8 channel index, 4 bytes at 16 bits) and the rest is quantized with ranges over
      the remaining entries. The outliers are counted by ``memory_report()``: at equal bits they must be paid for,
      e.g. by a smaller ``boost_fraction`` (4 bytes an outlier against 2 bits x G tokens a boosted channel).

    Value-side options, also read by the torch quantizer only:

    - ``value_groups`` (``VALUE_GROUPS``): each token's channels in this many equal groups, a scale and a zero per
      group (``head_dim`` must divide by it).
    - ``value_scale_bits`` (``VALUE_SCALE_BITS``): 8 stores each group's scale and zero in a byte each, against one
      reference per page and head in the model dtype: the scale rounded up on the grid ``ref * 2**(-c/16)`` (``c``
      a uint8), the zero rounded to a quarter of that step (an int8); a zero more than 31.75 steps from 0 widens the
      step until it fits (``kitty.core.quant.encode_value_meta8``). ``value_groups=2, value_scale_bits=8`` takes the
      bytes of one group in 16 bits, plus the reference.
    """

    key_bits: int = 2  # 2 or 4, or 16 for unquantized keys
    value_bits: int = 2  # 2 or 4, or 16 for unquantized values
    boost_bits: int = 4  # precision of boosted key channels (paper: INT4); 3: see BOOST_BITS, torch path only
    boost_fraction: float = 0.125  # share of key channels boosted per page (kitty 12.5%, kitty-pro 25%)
    sink_tokens: int = 32  # S: first tokens kept in full precision for K and V (attention sinks)
    group_size: int = 128  # G: tokens per quantization group = page size; multiple of 4 (4 codes per byte)
    local_window: int = 128  # R: newest values kept in full precision
    channel_selection: str = "magnitude"  # how boosted channels are chosen: see CHANNEL_SELECTIONS
    seed: int = 0  # for channel_selection="random"
    key_range: str = "minmax"  # "fit": per-channel clipping search minimizing reconstruction error at pack time;
    # "fit-peak": the same search, never clipping a channel's largest-|k| token (ranges.fitted_params keep_peak);
    # "fit-bounded": the same search, every token within half a min-max step (ranges.fitted_params bounded);
    # "fit-standout" / "fit-peak-standout": min-max on channels where a token stands out, fit-bounded / fit-peak elsewhere;
    # "fit-token-standout" / "fit-peak-token-standout": min-max on channels whose min or max is a token standing out
    # across the page's channels, fit-bounded / fit-peak elsewhere; "fit-loose-token-standout": the same test, and
    # elsewhere the bounded search with every token within one min-max step (ranges.LOOSE_BOUND_STEPS); "fit-attn" /
    # "fit-attn-free": fit-bounded / fit ranked by the error weighted by each token's attention under the mean query
    # (core/attnfit.py); "fit-attn-token-standout": the token test, and fit-attn elsewhere; "fit-attn-bound": fit-attn
    # with each token's bound set by its weight (half a step where attended or standing out, up to one step elsewhere);
    # "fit-attn-token-bound": the token test, and fit-attn-bound elsewhere; "fit-attn-max-bound" /
    # "fit-attn-max-token-bound": the same with each token's largest attention from the queries seen while its page
    # was in full precision (the cache's running maximum per qbuffer slot) in place of the mean query's;
    # "fit-attn-max-rel-bound" / "fit-attn-max-rel-token-bound": those maxima divided by their mean over the page
    value_range: str = "minmax"  # "fit": the same per token for values
    value_groups: int = 1  # channel groups per value token, a scale and a zero each; torch path only when not 1
    value_scale_bits: int = 16  # 8: each value group's scale and zero in a byte each; torch path only
    key_rotation: str = "none"  # see KEY_ROTATIONS: a fixed orthogonal rotation of key channels, torch path only
    key_rounding: str = "nearest"  # see KEY_ROUNDINGS: "query" rounds keys against the queries, torch path only
    key_outlier_fraction: float = 0.0  # share of a key page's entries (per head) kept exactly; torch path only
    key_outlier_rule: str = "zscore"  # see KEY_OUTLIER_RULES: which entries are the outliers
    boost_profile: tuple[float, ...] | None = None  # per-layer boost fractions (mean = boost_fraction), or uniform
    name: str = field(default="custom", compare=False)
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for f in ("key_bits", "value_bits"):
            if not is_int(getattr(self, f)) or getattr(self, f) not in VALID_BITS:
                raise ValueError(f"{f} must be one of the integers {VALID_BITS}, got {getattr(self, f)!r}")
        if not is_int(self.boost_bits) or self.boost_bits not in BOOST_BITS:
            raise ValueError(
                f"boost_bits must be one of {BOOST_BITS} (a 2-bit low plane + a 2-bit high plane, or + a 1-bit high "
                f"plane: torch path only), got {self.boost_bits!r}"
            )
        if self.boost_bits != 4 and self.key_bits != 2:  # 4-bit keys store every channel in the 2-bit high plane
            raise ValueError(f"boost_bits={self.boost_bits} needs key_bits=2, got key_bits={self.key_bits}")
        if not is_number(self.boost_fraction) or not 0.0 <= self.boost_fraction <= 1.0:
            raise ValueError(f"boost_fraction must be a number in [0, 1], got {self.boost_fraction!r}")
        if self.boost_fraction > 0 and self.key_bits != 2:
            raise ValueError(
                f"boost_fraction > 0 needs key_bits=2 (boosting 2-bit channels to 4), got key_bits={self.key_bits}"
            )
        for f, low in (("sink_tokens", 0), ("group_size", 4), ("local_window", 0)):
            n = getattr(self, f)
            if not is_int(n) or not low <= n <= MAX_BUFFER_TOKENS:
                raise ValueError(
                    f"{f} must be an integer in [{low}, {MAX_BUFFER_TOKENS}] (buffers of this many tokens "
                    f"are allocated per row and layer), got {n!r}"
                )
        if self.group_size % 4:
            raise ValueError(f"group_size must be a positive multiple of 4, got {self.group_size!r}")
        if self.channel_selection not in CHANNEL_SELECTIONS:
            raise ValueError(f"channel_selection must be one of {CHANNEL_SELECTIONS}, got {self.channel_selection!r}")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for f, allowed in (("key_range", RANGE_FITS), ("value_range", VALUE_RANGES)):
            if getattr(self, f) not in RANGE_FITS:
                raise ValueError(f"{f} must be one of {allowed}, got {getattr(self, f)!r}")
        if self.value_range in KEY_ONLY_RANGES:
            raise ValueError(f"value_range={self.value_range!r} is a key range (weights tokens by their attention)")
        if self.key_range in KEY_ONLY_RANGES and self.channel_selection != "oracle":
            raise ValueError(
                f"key_range={self.key_range!r} needs channel_selection='oracle' (the query statistics it weights "
                f"tokens with), got {self.channel_selection!r}"
            )
        if self.key_rotation not in KEY_ROTATIONS:
            raise ValueError(f"key_rotation must be one of {KEY_ROTATIONS}, got {self.key_rotation!r}")
        if self.key_rotation != "none" and not self.quantizes_keys:
            raise ValueError(f"key_rotation={self.key_rotation!r} needs quantized keys (key_bits 2 or 4), got 16")
        if self.key_rotation != "none" and self.channel_selection in QUERY_SELECTIONS:
            # query statistics are kept per unrotated channel; ranking rotated channels by them would be wrong
            raise ValueError(
                f"key_rotation={self.key_rotation!r} needs a channel_selection that reads only the keys "
                f"(magnitude, random, range), got {self.channel_selection!r}"
            )
        if self.key_rounding not in KEY_ROUNDINGS:
            raise ValueError(f"key_rounding must be one of {KEY_ROUNDINGS}, got {self.key_rounding!r}")
        if self.key_rounding != "nearest" and not self.quantizes_keys:
            raise ValueError(f"key_rounding={self.key_rounding!r} needs quantized keys (key_bits 2 or 4), got 16")
        if self.key_rounding != "nearest" and (self.key_rotation != "none" or self.key_outlier_fraction):
            # the queries' second moment is kept per unrotated channel, over every entry of the page
            raise ValueError(
                f"key_rounding={self.key_rounding!r} needs key_rotation='none' and key_outlier_fraction=0, got "
                f"{self.key_rotation!r} and {self.key_outlier_fraction!r}"
            )
        if not is_int(self.value_groups) or self.value_groups not in VALUE_GROUPS:
            raise ValueError(f"value_groups must be one of {VALUE_GROUPS}, got {self.value_groups!r}")
        if not is_int(self.value_scale_bits) or self.value_scale_bits not in VALUE_SCALE_BITS:
            raise ValueError(f"value_scale_bits must be one of {VALUE_SCALE_BITS}, got {self.value_scale_bits!r}")
        f = self.key_outlier_fraction
        if not is_number(f) or not 0.0 <= f < 1.0:
            raise ValueError(f"key_outlier_fraction must be a number in [0, 1), got {f!r}")
        if f > 0 and not self.quantizes_keys:
            raise ValueError(f"key_outlier_fraction > 0 needs quantized keys (key_bits 2 or 4), got {f!r} with 16")
        if self.key_outlier_rule not in KEY_OUTLIER_RULES:
            raise ValueError(f"key_outlier_rule must be one of {KEY_OUTLIER_RULES}, got {self.key_outlier_rule!r}")
        if f > 0 and self.group_size > MAX_OUTLIER_GROUP:
            raise ValueError(
                f"key_outlier_fraction > 0 needs group_size <= {MAX_OUTLIER_GROUP} (uint8 token index), "
                f"got group_size={self.group_size}"
            )
        if self.boost_profile is not None:
            prof = self.boost_profile
            if not isinstance(prof, tuple) or not prof or not all(is_number(f) and 0.0 <= f <= 1.0 for f in prof):
                raise ValueError(
                    f"boost_profile must be a non-empty tuple of fractions in [0, 1] (one per layer), got {prof!r}"
                )
            if self.key_bits != 2:
                raise ValueError(f"boost_profile needs key_bits=2, got key_bits={self.key_bits}")
            if abs(sum(prof) / len(prof) - self.boost_fraction) > 1e-6:
                raise ValueError(
                    f"boost_profile must average to boost_fraction={self.boost_fraction} (the same total of boosted "
                    f"channels as uniform allocation), its mean is {sum(prof) / len(prof):.6f}"
                )

    @property
    def quantizes_keys(self) -> bool:
        return self.key_bits != 16

    @property
    def quantizes_values(self) -> bool:
        return self.value_bits != 16

    @property
    def torch_only(self) -> bool:
        """Whether only the torch quantizer reads this config's key options (``key_rotation``, ``key_rounding``,
        ``key_outlier_fraction``, ``boost_bits=3``) or value options (``value_groups``, ``value_scale_bits``): the
        Triton pack and the fused kernels would ignore them or misread the planes, so such a config runs on the torch
        backend (``kitty.cache.backend``)."""
        keys = self.key_rotation != "none" or self.key_rounding != "nearest"
        keys = keys or self.key_outlier_fraction > 0 or self.boost_bits != 4
        return keys or self.grouped_values

    @property
    def grouped_values(self) -> bool:
        """Whether value pages keep ``[..., G, value_groups]`` scales and zeros (``value_groups`` or
        ``value_scale_bits`` changed) instead of one per token in the dtype."""
        return self.quantizes_values and (self.value_groups != 1 or self.value_scale_bits != 16)

    def num_key_outliers(self, head_dim: int) -> int:
        """Key entries kept exactly per page and head: ``round(key_outlier_fraction * group_size * head_dim)``."""
        if not self.quantizes_keys:
            return 0
        return int(round(self.key_outlier_fraction * self.group_size * head_dim))

    def num_boosted(self, head_dim: int) -> int:
        """Channels per key page stored with ``boost_bits``: all of them for 4-bit keys, else ``round(fraction * D)``."""
        if self.key_bits == 4:
            return head_dim
        if self.key_bits == 16:
            return 0
        return int(round(self.boost_fraction * head_dim))

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ``ValueError`` if pages of this config cannot hold heads of ``head_dim`` channels.

        Only the storage decides: quantized key pages index channels in a uint8 ``boost_idx`` (``head_dim <=
        256``) and pack 4 channels per byte. Full-precision keys (``key_bits=16``, the ``fp16`` preset)
        take any ``head_dim``; which attention backend runs a shape is chosen per backend, not here.
        """
        if not is_int(head_dim) or head_dim <= 0:
            raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}")
        if self.quantizes_keys and head_dim > MAX_HEAD_DIM:
            raise ValueError(
                f"head_dim must be <= {MAX_HEAD_DIM} for quantized keys (uint8 boost_idx), got {head_dim}; "
                "key_bits=16 (e.g. the fp16 preset) takes any head_dim"
            )
        if self.quantizes_keys and head_dim % 4:
            raise ValueError(f"head_dim must be a multiple of 4 to pack 2-bit key codes along channels, got {head_dim}")
        if self.key_rotation != "none" and head_dim & (head_dim - 1):
            raise ValueError(
                f"head_dim must be a power of two for key_rotation={self.key_rotation!r} (a Hadamard matrix of "
                f"size head_dim), got {head_dim}"
            )
        self.check_value_groups(head_dim)

    def check_value_groups(self, head_dim: int) -> None:
        """``ValueError`` naming ``value_groups`` unless it divides ``head_dim`` (grouped value pages only)."""
        if self.grouped_values and head_dim % self.value_groups:
            raise ValueError(f"value_groups={self.value_groups} must divide head_dim, got head_dim={head_dim}")

    def for_layer(self, layer_idx: int, num_layers: int | None = None) -> "KVQuantConfig":
        """The config layer ``layer_idx`` uses: its ``boost_profile`` entry as ``boost_fraction`` (else ``self``).

        ``num_layers`` (the model's) is checked against the profile's length with a ``ValueError``.
        """
        if self.boost_profile is None:
            return self
        n = len(self.boost_profile)
        if num_layers is not None and num_layers != n:
            raise ValueError(
                f"boost_profile has {n} layers but the model has {num_layers}; calibrate a profile for this model "
                "with `python -m kitty.calibrate --model ...` (kitty.tools.calibrate.calibrate_profile)"
            )
        if not 0 <= layer_idx < n:
            raise ValueError(f"layer_idx must be in [0, {n}), got {layer_idx}")
        return replace(self, boost_fraction=float(self.boost_profile[layer_idx]), boost_profile=None)

    def with_(self, **changes) -> "KVQuantConfig":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


PROFILES_DIR = (
    Path(__file__).resolve().parent.parent / "profiles"
)  # layer-adaptive boost profiles (kitty.tools.calibrate)
DEFAULT_PROFILE = "SmolLM2-135M-Instruct"


def load_boost_profile(name: str, fraction: float) -> tuple[float, ...]:
    """Per-layer boost fractions averaging ``fraction`` from ``kitty/profiles/<name>.json`` (``kitty.tools.calibrate``)."""
    path = PROFILES_DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"no boost profile {name!r}: {path} is missing (make one with python -m kitty.calibrate)")
    profiles = json.loads(path.read_text())["profiles"]
    if str(fraction) not in profiles:
        raise ValueError(f"boost profile {name!r} holds fractions {sorted(profiles)}, not {fraction}")
    return tuple(float(f) for f in profiles[str(fraction)])


def _preset(name: str, description: str, **kw) -> KVQuantConfig:
    kw.setdefault("boost_fraction", 0.0)
    return KVQuantConfig(name=name, description=description, **kw)


class PresetTable(Mapping[str, KVQuantConfig]):
    """Preset name -> :class:`KVQuantConfig`, in declaration order. A preset added with :meth:`add_lazy` is built
    on first access (a layer-adaptive preset reads its profile JSON then, not when ``kitty`` is imported)."""

    def __init__(self, presets: dict[str, KVQuantConfig]) -> None:
        self._made = dict(presets)
        self._lazy: dict[str, Callable[[], KVQuantConfig]] = {}
        self._names = list(presets)

    def add_lazy(self, name: str, make: Callable[[], KVQuantConfig]) -> None:
        self._lazy[name] = make
        self._names.append(name)

    def __getitem__(self, name: str) -> KVQuantConfig:
        if name not in self._made:
            if name not in self._lazy:
                raise KeyError(name)
            self._made[name] = self._lazy.pop(name)()
        return self._made[name]

    def __contains__(self, name: object) -> bool:
        return name in self._made or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


PRESETS = PresetTable(
    {
        p.name: p
        for p in (
            _preset(
                "fp16",
                "No quantization: every key and value in full precision (the reference).",
                key_bits=16,
                value_bits=16,
            ),
            _preset("kivi-k2v2", "KIVI: 2-bit keys per channel, 2-bit values per token, no sink.", sink_tokens=0),
            _preset(
                "kivi-k2v2-sink", "KIVI-K2V2*: KIVI 2-bit keys and values, first 32 tokens kept in full precision."
            ),
            _preset("kivi-k2v4-sink", "K2V4*: 2-bit keys, 4-bit values, 32 sink tokens.", value_bits=4),
            _preset("kivi-k4v2-sink", "K4V2*: 4-bit keys, 2-bit values, 32 sink tokens.", key_bits=4),
            _preset("kivi-k4v4", "KIVI-K4V4: 4-bit keys and values, no sink.", key_bits=4, value_bits=4, sink_tokens=0),
            _preset(
                "kitty",
                "Kitty: 2-bit keys with the top 12.5% channels by mean |K| boosted to 4 bits, 2-bit values, sink.",
                boost_fraction=0.125,
            ),
            _preset(
                "kitty-pro", "Kitty-Pro: like Kitty with 25% of key channels boosted to 4 bits.", boost_fraction=0.25
            ),
            _preset(
                "kitty-random",
                "Ablation: Kitty with 12.5% of key channels boosted at random instead of by magnitude.",
                boost_fraction=0.125,
                channel_selection="random",
            ),
            _preset(
                "kitty-range",
                "Beyond the paper (negative result): Kitty boosting the 12.5% of key channels with the widest range (max - min).",
                boost_fraction=0.125,
                channel_selection="range",
            ),
            _preset(
                "kitty-query",
                "Beyond the paper: Kitty boosting the 12.5% of key channels with the largest mean |q| x range (query-aware).",
                boost_fraction=0.125,
                channel_selection="query",
            ),
            _preset(
                "kitty-pro-query",
                "Beyond the paper: Kitty-Pro (25% boosted) with query-aware channel selection.",
                boost_fraction=0.25,
                channel_selection="query",
            ),
            _preset(
                "kitty-oracle",
                "Beyond the paper: Kitty boosting the 12.5% of key channels whose boost removes the most expected attention-logit error (E[q^2] x error drop).",
                boost_fraction=0.125,
                channel_selection="oracle",
            ),
            _preset(
                "kitty-fit",
                "Beyond the paper: Kitty with oracle channel selection and per-channel key ranges fitted by a clipping search (same bits as kitty).",
                boost_fraction=0.125,
                channel_selection="oracle",
                key_range="fit",
            ),
            _preset(
                "kitty-pro-fit",
                "Beyond the paper: Kitty-Pro (25% boosted) with oracle channel selection and fitted key ranges (same bits as kitty-pro).",
                boost_fraction=0.25,
                channel_selection="oracle",
                key_range="fit",
            ),
            _preset(
                "kitty-pro-fit-peak",
                "Beyond the paper: kitty-pro-fit whose clipping search never clips a channel's largest-|k| token "
                "in a page (same bits as kitty-pro).",
                boost_fraction=0.25,
                channel_selection="oracle",
                key_range="fit-peak",
            ),
        )
    }
)


def _adaptive(name: str, base: str, fraction: float) -> KVQuantConfig:
    return PRESETS[base].with_(
        name=name,
        boost_profile=load_boost_profile(DEFAULT_PROFILE, fraction),
        description=f"Beyond the paper: {base} with the same total of boosted channels spread over layers by a calibrated "
        f"profile (kitty/profiles/{DEFAULT_PROFILE}.json; models with its 30 layers only).",
    )


PRESETS.add_lazy("kitty-fit-adaptive", lambda: _adaptive("kitty-fit-adaptive", "kitty-fit", 0.125))
PRESETS.add_lazy("kitty-pro-fit-adaptive", lambda: _adaptive("kitty-pro-fit-adaptive", "kitty-pro-fit", 0.25))


_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?")


def _override_value(text: str) -> int | float | str:
    """A ``+field=value`` override's value: plain decimal digits are an int, a plain decimal number a float, the rest
    a string (Python's ``int``/``float`` would also take ``1_28``, `` 5`` or ``nan``, which no user means)."""
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text


def get_preset(name: str) -> KVQuantConfig:
    """Look up a preset by name, with a ``ValueError`` listing the choices.

    ``name`` may add field overrides after ``+``: ``"kitty+key_range=fit+channel_selection=oracle"`` is ``kitty``
    with those fields changed (named by the full string); numbers are parsed as numbers.
    """
    base, *changes = name.split("+")
    if base not in PRESETS:
        raise ValueError(f"method must be one of {sorted(PRESETS)} (optionally +field=value...), got {name!r}")
    if not changes:
        return PRESETS[base]
    kw: dict[str, object] = {}
    names = {f.name for f in fields(KVQuantConfig)} - {"name", "description", "boost_profile"}
    for change in changes:
        key, eq, value = change.partition("=")
        if not eq or key not in names:
            raise ValueError(
                f"method override must be field=value with a field in {sorted(names)}, got {change!r} in {name!r}"
            )
        kw[key] = _override_value(value)
    description = f"{PRESETS[base].description} Changed: {', '.join(changes)}."
    return PRESETS[base].with_(name=name, description=description, **kw)
