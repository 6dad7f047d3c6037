"""Layer-adaptive boost: spend the same number of 4-bit key channels as uniform Kitty, where the model needs them.

Uniform Kitty boosts ``round(boost_fraction * D)`` channels in every layer. Layers are not equally sensitive to 2-bit
keys, so a one-off calibration on a shipped text measures, for every layer ``l`` and boosted-channel count ``c``,
the damage ``KL(fp16 || model with only layer l's keys quantized with c boosted channels)`` averaged over the
tokens that read quantized pages, then picks the counts ``c_l`` minimizing ``sum_l KL_l(c_l)`` under
``sum_l c_l = L * round(boost_fraction * D)`` (exact dynamic programming). Same total, so the same bits per element
(``memory_report`` shows it) as long as every count is a multiple of 4, as ``DEFAULT_COUNTS`` are: a page's compact
high plane holds ``ceil(c / 4)`` bytes per token. The result is a per-layer ``boost_profile`` of fractions ``c_l / D``
stored as JSON in ``kitty/profiles/``.

The measurement is teacher-forced: one forward pass over the calibration text with the layer's keys past the sink
replaced by their quantize -> dequantize round trip page by page (values exact; the other layers exact, or with
``in_context`` quantized uniformly), through an
attention function registered as ``"kitty-calibrate"`` that reads which layer to quantize from the forward call's
``kitty_calibration`` argument (a :class:`CalibrationTarget`). Query statistics for ``"query"``/``"oracle"`` selection
come from the same pass.

``python -m kitty.calibrate [--model M] [--base kitty-query+key_range=fit] [--in-context]
[--out kitty/profiles/NAME.json]``

Measured on the default model (README): both calibration modes give profiles that lose to uniform allocation in
decode perplexity; they are kept as a tool and a negative result.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..core.config import PROFILES_DIR, QUERY_SELECTIONS, KVQuantConfig, get_preset
from ..core.quant import dequantize_key_page, quantize_key_page, query_scale_from, query_statistic
from ..hf.compat import attention_implementation
from . import cliargs
from .prompts import shipped_text

CALIB_ATTN = "kitty-calibrate"
DEFAULT_COUNTS = (0, 4, 8, 12, 16, 24, 32, 48)
CALIB_TEXT = "python_reference.txt"
CALIB_OFFSET = (
    20_000  # first calibration token: past the evaluation windows (kitty.tools.eval reads the first ~2.6K tokens)
)


@dataclass(frozen=True)
class CalibrationTarget:
    """Which layer the calibration attention function quantizes, and how; passed with each forward call
    (``model(x, kitty_calibration=target)``), so no state outlives a call."""

    layer: int = -1  # -1: no layer
    cfg: KVQuantConfig | None = None
    context: KVQuantConfig | None = None  # config of every other layer (None: exact keys)


def fake_quantize_keys(key: torch.Tensor, query: torch.Tensor, cfg: KVQuantConfig, salt: int = 0) -> torch.Tensor:
    """Keys ``[B, Hkv, T, D]`` with every full page past the sink replaced by its quantize -> dequantize round trip.

    ``query`` ``[B, Hq, T, D]`` gives the per-channel query statistics of ``"query"``/``"oracle"`` selection.
    """
    B, H, T, D = key.shape
    S, G = cfg.sink_tokens, cfg.group_size
    pages = max(T - S, 0) // G
    if pages == 0 or not cfg.quantizes_keys:
        return key
    body = key[:, :, S : S + pages * G].reshape(B, H, pages, G, D).transpose(1, 2)  # (B, pages, H, G, D)
    sel, qs = cfg.channel_selection, None
    if sel in QUERY_SELECTIONS:
        qs = query_scale_from(query_statistic(query.reshape(B, H, -1, T, D), sel).mean((2, 3)), sel)[
            :, None
        ]  # (B, 1, H, D)
    page = quantize_key_page(body, cfg, salt=salt, query_scale=qs)
    body_hat = dequantize_key_page(page).transpose(1, 2).reshape(B, H, pages * G, D)
    return torch.cat([key[:, :, :S], body_hat, key[:, :, S + pages * G :]], dim=2)


def _calibration_attention(
    module, query, key, value, attention_mask, kitty_calibration: CalibrationTarget | None = None, **kwargs
):
    """SDPA, with the keys of ``kitty_calibration``'s layers fake-quantized (see :func:`fake_quantize_keys`)."""
    target = kitty_calibration or CalibrationTarget()
    layer = getattr(module, "layer_idx", None)
    cfg = target.cfg if layer == target.layer else target.context
    if cfg is not None:
        key = fake_quantize_keys(key, query, cfg, salt=layer)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CALIB_ATTN, _calibration_attention)
AttentionMaskInterface.register(CALIB_ATTN, sdpa_mask)


@torch.no_grad()
def layer_sensitivity(
    model,
    ids: torch.Tensor,
    cfg: KVQuantConfig,
    counts: tuple[int, ...] = DEFAULT_COUNTS,
    progress: bool = True,
    context: KVQuantConfig | None = None,
) -> torch.Tensor:
    """``KL[l, j]``: mean KL divergence (nats/token) from fp16 when layer ``l``'s keys are quantized by ``cfg`` with
    ``counts[j]`` boosted channels and every other layer's keys by ``context`` (``None``: exact); scored on tokens
    past the first page. ``ids``: ``[T]`` token ids."""
    from ..hf.models import kv_dims

    num_layers, _, head_dim = kv_dims(model.config)
    if any(not 0 <= c <= head_dim for c in counts):
        raise ValueError(f"counts must lie in [0, head_dim={head_dim}], got {counts}")
    first = cfg.sink_tokens + cfg.group_size  # tokens before this never read a quantized key
    if ids.numel() <= first:
        raise ValueError(f"ids must hold more than sink_tokens + group_size = {first} tokens, got {ids.numel()}")
    with attention_implementation(model.config, CALIB_ATTN):
        x = ids[None].to(model.device)
        ref = F.log_softmax(model(x).logits[0, first:].float(), -1)
        kl = torch.zeros(num_layers, len(counts))
        todo = [(l, j) for l in range(num_layers) for j in range(len(counts))]
        for l, j in tqdm(todo, desc="calibrating layers", disable=not progress):
            target = CalibrationTarget(l, cfg.with_(boost_fraction=counts[j] / head_dim, boost_profile=None), context)
            logp = F.log_softmax(model(x, kitty_calibration=target).logits[0, first:].float(), -1)
            kl[l, j] = F.kl_div(logp, ref, log_target=True, reduction="batchmean").item()
    return kl


def allocate(kl: torch.Tensor, counts: tuple[int, ...], total: int) -> list[int]:
    """Counts ``c_l`` (one of ``counts`` per layer) with ``sum c_l == total`` minimizing ``sum_l kl[l, c_l]``
    (exact DP)."""
    step = math.gcd(*counts) if any(counts) else 1
    if total % step:
        raise ValueError(f"total must be a multiple of {step} (the gcd of counts), got {total}")
    units = [c // step for c in counts]
    budget = total // step
    L = kl.shape[0]
    inf = float("inf")
    best = [[inf] * (budget + 1) for _ in range(L + 1)]
    choice = [[-1] * (budget + 1) for _ in range(L + 1)]
    best[0][0] = 0.0
    for l in range(L):
        for b in range(budget + 1):
            if best[l][b] == inf:
                continue
            for j, u in enumerate(units):
                nb = b + u
                if nb <= budget and best[l][b] + kl[l, j].item() < best[l + 1][nb]:
                    best[l + 1][nb], choice[l + 1][nb] = best[l][b] + kl[l, j].item(), j
    if best[L][budget] == inf:
        raise ValueError(f"no choice of counts {counts} per layer sums to total={total}")
    out, b = [], budget
    for l in range(L, 0, -1):
        j = choice[l][b]
        out.append(counts[j])
        b -= units[j]
    return out[::-1]


def calibration_ids(
    tokenizer, n_tokens: int = 1024, text: str = CALIB_TEXT, offset: int = CALIB_OFFSET
) -> torch.Tensor:
    """``n_tokens`` token ids of a shipped text (``kitty/texts/``), starting at token ``offset``."""
    ids = tokenizer(shipped_text(text), return_tensors="pt").input_ids[0]
    if ids.numel() < offset + n_tokens:
        raise ValueError(f"{text} has {ids.numel()} tokens, fewer than offset + n_tokens = {offset + n_tokens}")
    return ids[offset : offset + n_tokens]


def calibrate_profile(
    model,
    tokenizer,
    base: KVQuantConfig,
    fractions: tuple[float, ...] = (0.125, 0.25),
    counts=DEFAULT_COUNTS,
    n_tokens: int = 1024,
    in_context: bool = False,
    progress: bool = True,
) -> dict:
    """Measure :func:`layer_sensitivity` and allocate a profile for each average boost fraction.

    ``in_context``: measure each layer with every other layer quantized at the uniform ``fraction`` (one
    measurement per fraction), else with the other layers exact (one measurement shared by all fractions).
    Returns a JSON-ready dict: ``profiles[str(fraction)]`` is the per-layer list of boost fractions.
    """
    from ..hf.models import kv_dims

    num_layers, _, head_dim = kv_dims(model.config)
    t0 = time.time()
    ids = calibration_ids(tokenizer, n_tokens)
    profiles, kls = {}, {}
    for f in fractions:
        per_layer = round(f * head_dim)
        if in_context or not kls:
            context = base.with_(boost_fraction=f, boost_profile=None) if in_context else None
            kl = layer_sensitivity(model, ids, base, counts, progress, context=context)
        kls[str(f)] = [[round(v, 6) for v in row] for row in kl.tolist()]
        profiles[str(f)] = [c / head_dim for c in allocate(kl, counts, per_layer * num_layers)]
    return {
        "model": getattr(model.config, "_name_or_path", ""),
        "num_layers": num_layers,
        "head_dim": head_dim,
        "text": f"kitty/texts/{CALIB_TEXT}, tokens {CALIB_OFFSET}..{CALIB_OFFSET + n_tokens}",
        "base": base.name,
        "other_layers": "uniform at the profile's fraction" if in_context else "exact",
        "counts": list(counts),
        "kl": kls,
        "profiles": profiles,
        "seconds": round(time.time() - t0, 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kitty.calibrate", description=__doc__.splitlines()[0])
    cliargs.add_model(p)
    p.add_argument(
        "--base",
        default="kitty-query+key_range=fit",
        help="method (preset[+field=value...]) whose selection and key ranges are calibrated "
        "(default: kitty-query+key_range=fit)",
    )
    p.add_argument("--tokens", type=int, default=1024, help="calibration tokens (default: 1024)")
    p.add_argument(
        "--fractions",
        default="0.125,0.25",
        help="average boost fractions to allocate, comma-separated (default: 0.125,0.25)",
    )
    p.add_argument(
        "--in-context",
        action="store_true",
        help="measure each layer with the other layers quantized uniformly at each fraction (default: the other "
        "layers exact)",
    )
    p.add_argument("--out", default=None, help="JSON path (default: kitty/profiles/<model name>.json)")
    a = p.parse_args(argv)
    try:  # the flags, before the model loads
        base = get_preset(cliargs.check_method(a.base, "--base"))
        fractions = cliargs.parse_numbers(a.fractions, "--fractions", float)
        cliargs.check_at_least_one(tokens=a.tokens)
        cliargs.check_model_path(a.model)
    except ValueError as e:
        cliargs.say_error(str(e))
        raise SystemExit(2) from None
    from ..hf.models import DEFAULT_MODEL_NAME, load_model

    model, tokenizer = load_model(a.model)
    data = calibrate_profile(model, tokenizer, base, fractions, n_tokens=a.tokens, in_context=a.in_context)
    name = Path(a.model).name if a.model else DEFAULT_MODEL_NAME
    out = Path(a.out) if a.out else PROFILES_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():  # keep the other fractions' profiles of an earlier run with the same settings
        old = json.loads(out.read_text())
        if {k: old.get(k) for k in ("base", "other_layers", "counts", "text")} == {
            k: data[k] for k in ("base", "other_layers", "counts", "text")
        }:
            data["kl"] = {**old["kl"], **data["kl"]}
            data["profiles"] = {**old["profiles"], **data["profiles"]}
    out.write_text(json.dumps(data, indent=1) + "\n")
    for f, prof in data["profiles"].items():
        print(f"boost {f}: channels per layer {[round(x * data['head_dim']) for x in prof]}")
    print(f"wrote {out} ({data['seconds']} s)")


if __name__ == "__main__":
    main()
