"""The demo's pure formatting, free of any UI: readouts, the verdict, the summary, byte sizes, tables and the
Inside tab's sentences (its figures: :mod:`kitty.tools.demo_figures`). ``app.py`` lays out Gradio widgets around
them; every function here takes plain values (columns from :mod:`kitty.tools.demo`, presets, key inspections) and
returns text or a DataFrame (pandas is imported when a table is made).
"""

from __future__ import annotations

import csv
import functools
import html
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..core.config import PRESETS, get_preset
from ..core.memory import analytic_report, asymptotic_bits
from ..core.quant import KeyInspection
from . import demo as kd

if TYPE_CHECKING:
    import pandas as pd


class ModelDims(Protocol):
    """What the tables need of a model: its layer count, KV heads and head size (``app.Engine`` has them)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


COLUMN_COLORS = ("#64748b", "#ea580c", "#2563eb")  # column 1, 2, 3: the readout's top border and the plot line


def reference_column(columns: Sequence[kd.Column]) -> kd.Column:
    """The column the others' texts are compared with: the first fp16 column, else column 1."""
    return next((c for c in columns if c.method == "fp16"), columns[0])


def divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first generated token where ``other`` differs from ``reference``, ``None`` if one is a prefix."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None


def _esc(text: str) -> str:
    return html.escape(text).replace("\n", "⏎")


def text_vs_reference(col: kd.Column, ref: kd.Column, tokenizer, color: str) -> str:
    """One HTML line: where this column's text leaves the reference column's, the first differing token marked."""
    if col is ref:
        return "the reference text" if ref.method == "fp16" else "the reference text (column 1)"
    d = divergence(ref.ids, col.ids)
    if d is None:
        same = min(len(ref.ids), len(col.ids))
        return f"same as {ref.label} so far ({same} tokens)"
    before = tokenizer.decode(col.ids[max(0, d - 4) : d], skip_special_tokens=True)
    mine = tokenizer.decode(col.ids[d : d + 1])
    theirs = tokenizer.decode(ref.ids[d : d + 1])
    return (
        f"differs from {ref.label} at token {d + 1}: “…{_esc(before)}<mark style='background:{color}55'>"
        f"{_esc(mine)}</mark>” (there: “{_esc(theirs)}”)"
    )


def page_start_note(cfg, layout: dict[str, int]) -> str:
    """Why a quantizing column stores (some) tokens in full precision still, and when its first pages come; ``""``
    once both keys and values have a page. The thresholds follow from the preset's sink S, page G and window R."""
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    n = layout["tokens"]
    key_at, value_at = S + G, S + R + G  # token_layout: m // G key pages, (m - R) // G value pages, m = n - S
    key_why = f"sink {S} + page {G}" if S else f"page {G}"
    value_why = f"sink {S} + local {R} + page {G}" if S else f"local {R} + page {G}"
    if cfg.quantizes_keys and layout["key_pages"] == 0:
        return (
            f"nothing quantized yet: pages start after {key_at} tokens ({key_why}; values after {value_at}: "
            f"{value_why}), now {n}"
        )
    if cfg.quantizes_values and layout["value_pages"] == 0:
        return f"values not quantized yet: value pages start after {value_at} tokens ({value_why}), now {n}"
    return ""


def full_precision_parts(cfg, layout: dict[str, int]) -> str:
    """The tokens a column holds at 16 bits, by place (K and V each count once per token)."""
    parts = [f"sink {layout['sink']} (K+V)"] if layout["sink"] else []
    if cfg.quantizes_keys:
        parts.append(f"K qbuffer {layout['key_qbuffer']}")
    if cfg.quantizes_values:
        parts += [f"V qbuffer {layout['value_qbuffer']}", f"local {layout['local']}"]
    return " · ".join(parts)


def format_readout(
    col: kd.Column, head_dim: int | None = None, ref: kd.Column | None = None, tokenizer=None, color: str = "#888"
) -> str:
    """HTML readout under one column: one headline (bits/element now), then compression and bytes, the
    long-context figure (pages alone, :func:`kitty.core.memory.asymptotic_bits`), what is still full precision and
    why, where tokens live (counted in tokens; pages also counted as pages), the text's first divergence, speed."""
    r = col.readout
    style = f"style='border-top: 4px solid {color}'"
    if r is None:
        return f"<div class='readout' {style}><i>{col.status}…</i></div>"
    m, lay, cfg = r.report, r.layout, get_preset(col.method)
    G, S = cfg.group_size, lay["sink"]
    full = not (cfg.quantizes_keys or cfg.quantizes_values)
    head = f"<div class='headline'><b>{m.bits_per_element:.2f}</b> bits/element</div>"
    rows = []
    if full:
        sub = f"all full precision: the reference (1.00×) · {fmt_bytes(m.stored_bytes)}"
        rows.append(("tokens live in", f"all {m.tokens} tokens, K and V at 16 bits"))
    else:
        note = page_start_note(cfg, lay)
        size = f"{fmt_bytes(m.stored_bytes)} of {fmt_bytes(m.fp16_bytes)}"
        sub = f"{m.compression:.2f}× smaller than fp16 · {size}" if m.compression > 1 else f"fp16 size so far · {size}"
        if note:
            rows.append(("note", f"<span class='pagenote'>{note}</span>"))
        if head_dim is not None:
            a = asymptotic_bits(cfg, head_dim)["total"]
            rows.append(("long context", f"{a:.2f} bits/element · {16 / a:.2f}× (pages alone)"))
        share = m.full_precision_bytes / m.stored_bytes if m.stored_bytes else 0.0
        rows.append(("full precision", f"{share:.0%} of the bytes: {full_precision_parts(cfg, lay)}"))
        kp, vp = lay["key_pages"] // G, lay["value_pages"] // G
        keys = f"sink {S} · {lay['key_pages']} in {kp} page{'s' * (kp != 1)} · qbuffer {lay['key_qbuffer']}"
        values = (
            f"sink {S} · {lay['value_pages']} in {vp} page{'s' * (vp != 1)} · qbuffer {lay['value_qbuffer']}"
            f" · local {lay['local']}"
        )
        rows.append(("tokens live in", f"K: {keys}<br>V: {values}"))
    rows.append(("cached", f"{m.tokens} tokens ({r.new_tokens} new)"))
    if ref is not None and col is not ref:
        prefix, n, rate = agreement(ref.ids, col.ids)
        rows.append(("agreement", f"{prefix} of {n} tokens before the first difference · {rate:.0%} match"))
    if ref is not None and tokenizer is not None:
        rows.append(("text", text_vs_reference(col, ref, tokenizer, color)))
    line = eval_line(col.method)
    if line:
        rows.append(("measured", line))
    rows += [("speed", f"{r.tokens_per_s:.1f} tok/s ({r.step_ms:.0f} ms/step own)"), ("status", col.status)]
    body = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows)
    return f"<div class='readout' {style}>{head}<div class='sub'>{sub}</div><table>{body}</table></div>"


def why_line(columns: Sequence[kd.Column], head_dim: int) -> str:
    """Why a quantized column can store more bits now than its pages alone cost, or more than another column with
    cheaper-or-equal pages: its full-precision share, from the measured bytes (``""`` when nothing to explain)."""
    quant = [
        c
        for c in columns
        if c.readout and (get_preset(c.method).quantizes_keys or get_preset(c.method).quantizes_values)
    ]
    if not quant:
        return ""
    parts = []
    for c in quant:
        cfg, m = get_preset(c.method), c.readout.report
        a = asymptotic_bits(cfg, head_dim)["total"]
        share = m.full_precision_bytes / m.stored_bytes if m.stored_bytes else 0.0
        parts.append(
            f"{c.label} {m.bits_per_element:.2f} now vs {a:.2f} for pages alone, {share:.0%} of its bytes at 16 bits "
            f"({full_precision_parts(cfg, c.readout.layout)})"
        )
    return (
        "**Why more than 2 bits now:** the sink, the qbuffers (packed into a page only every "
        f"{get_preset(quant[0].method).group_size} tokens) and the local window stay at 16 bits — "
        + "; ".join(parts)
        + ". The plot drops where a qbuffer packs."
    )


def summarize(columns: Sequence[kd.Column], tokenizer, stopped: bool, head_dim: int | None = None) -> str:
    """A readable markdown summary: memory per column, where each left the reference column's tokens, and why
    the bits now differ from the pages-alone figure."""
    ref = reference_column(columns)
    lines = ["**Stopped** — caches freed." if stopped else "**Done** — caches freed.", ""]
    lines += [
        "| column | tokens | KV stored | fp16-equivalent | bits/elem | compression | tok/s | text |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in columns:
        r = c.readout
        if r is None:
            lines.append(f"| {c.label} | – | – | – | – | – | – | {c.status} |")
            continue
        if c is ref:
            vs = "reference"
        else:
            d = divergence(ref.ids, c.ids)
            if d is None:
                same = min(len(ref.ids), len(c.ids))
                vs = (
                    f"identical ({same} tokens)"
                    if len(ref.ids) == len(c.ids)
                    else f"identical over the {same} tokens both have"
                )
            else:
                ctx = tokenizer.decode(ref.ids[max(0, d - 4) : d]).replace("\n", " ").replace("|", "\\|")
                vs = f"diverges at token {d + 1} (after “…{ctx}”)"
        m = r.report
        lines.append(
            f"| {c.label} | {r.new_tokens} new / {m.tokens} cached | {fmt_bytes(m.stored_bytes)} "
            f"| {fmt_bytes(m.fp16_bytes)} | {m.bits_per_element:.2f} | {m.compression:.2f}× | {r.tokens_per_s:.1f} "
            f"| {vs} |"
        )
    why = why_line(columns, head_dim) if head_dim is not None else ""
    return "\n".join(lines + (["", why] if why else []))


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}" if n < 100 else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def bits_table(engine: ModelDims, prompt_tokens: int, new_tokens: int) -> pd.DataFrame:
    """Bits per element of every preset: pages alone (the long-context limit) split by component, and the whole
    cache (sink, qbuffers and local window included) at ``prompt_tokens + new_tokens`` tokens."""
    import pandas as pd

    rows = []
    n = prompt_tokens + new_tokens
    for name, cfg in PRESETS.items():
        if cfg.boost_profile is not None and len(cfg.boost_profile) != engine.num_layers:
            continue  # a layer-adaptive profile calibrated for another model
        a = asymptotic_bits(cfg, engine.head_dim)
        rep = analytic_report(cfg, n, engine.head_dim, engine.num_kv_heads, engine.num_layers)
        rows.append(
            {
                "method": name,
                "pages (K+V)/2": a["total"],
                f"cache at {n} tokens": rep.bits_per_element,
                "× there": rep.compression,
                "K page": a["key_total"],
                "K low plane": a["key_low"],
                "K high plane": a["key_high"],
                "K boost_idx": a["key_boost_idx"],
                "K scale, zero": a["key_scale_zero"],
                "K at 16 bits": a["key_raw"],
                "V page": a["value_total"],
                "V codes": a["value_codes"],
                "V scale, zero": a["value_scale_zero"],
            }
        )
    return pd.DataFrame(rows).round(3)


def memory_rows(snap: kd.Snapshot) -> pd.DataFrame:
    """The memory plot's data: one row per column and step (column label, cached tokens, stored MiB)."""
    import pandas as pd

    rows = snap.plot_rows()  # series "column 1", "column 2", ... in column order
    names = {f"column {i + 1}": c.label for i, c in enumerate(snap.columns)}
    df = pd.DataFrame(rows, columns=["column", "tokens", "stored_KiB"]).replace({"column": names})
    return df.assign(stored_MiB=df.pop("stored_KiB") / 1024)


# Line styles per column: a wide pale line under narrower ones, so identical lines stay visible as a band


SELECTION_WORDS = {
    "magnitude": "the channels with the largest mean |K| over the page",
    "random": "channels drawn at random (seeded per layer), an ablation",
    "range": "the channels with the widest range (max − min) over the page",
    "query": "the channels with the largest mean |q| × range (the prompt's query statistics)",
    "oracle": "the channels whose boost removes the most expected attention-logit error (E[q²] × error drop)",
}


def method_intro(cfg, head_dim: int, layer: int, num_layers: int) -> str:
    """The Inside tab's intro for ``cfg``: what a page of keys is and how this method picks its boosted channels."""
    lay_cfg = cfg.for_layer(layer, num_layers)
    nb = lay_cfg.num_boosted(head_dim)
    text = (
        f"Keys of the **current prompt** after RoPE, as the cache receives them, for **{cfg.name}**. The first "
        f"{cfg.sink_tokens} tokens (the sink) stay at 16 bits; every page of {cfg.group_size} tokens after them "
    )
    if nb == 0 and cfg.boost_profile is not None:
        text += (
            f"stores all {head_dim} channels with 2 bits (KIVI-style keys) at this layer: its calibrated profile "
            f"spends the same total of boosted channels as uniform {cfg.boost_fraction:.1%}, where a boost lowered "
            f"the model's error most on calibration text (kitty.tools.calibrate), and layer {layer} gained too little "
            "to get any; other layers boost more."
        )
    elif nb == 0:
        text += f"stores all {head_dim} channels with 2 bits (no boost: KIVI-style keys)."
    else:
        text += (
            f"picks its own {nb} of {head_dim} channels — {SELECTION_WORDS[cfg.channel_selection]} — and stores "
            f"them with 4 bits (low + high plane); every other channel gets 2 bits."
        )
        if cfg.boost_profile is not None:
            text += f" The share boosted varies by layer (calibrated profile): layer {layer} boosts {nb}."
    if cfg.key_range != "minmax":
        text += f" Each channel's range is fitted by a clipping search ({cfg.key_range}) instead of min–max."
    return text


def attention_note(ins: KeyInspection) -> str:
    """One line connecting this table's key error to the attention error the boost is for."""
    ratios = [p.error_boosted / p.error_2bit for p in ins.pages if p.quantized and p.error_2bit]
    if not ratios or all(r == 1 for r in ratios):
        return ""
    mean = sum(ratios) / len(ratios)
    head = (
        f"Key error weighs every channel alike, so the boost lowers it only to {mean:.2f}× of all-2-bit here "
        "(mean error ratio over full pages). Attention sees q·k, which the few large channels dominate"
    )
    selection = get_preset(ins.method).channel_selection
    if selection == "random":
        return head + (
            ". This ablation draws its boosted channels at random, so the large channels are mostly not the ones kept "
            "at 4 bits (compare the brightest rows of the heatmap with the boxes): its attention-score error falls "
            "little, which is why kitty picks channels by magnitude (the eval's kitty-random row)."
        )
    if selection == "magnitude":
        return head + (
            ", and those are the ones kept at 4 bits: the attention-score error falls much more (notebook 02, "
            "section 5, measures it against 2-bit keys on every layer and head)."
        )
    return head + (
        f"; this method keeps {SELECTION_WORDS[selection]} at 4 bits, aimed at that error rather than the key error "
        "(notebook 02, section 5, measures attention-score error on every layer and head)."
    )


# ------------------------------------------------------------------------------- agreement and the verdict


def agreement(reference: Sequence[int], ids: Sequence[int]) -> tuple[int, int, float]:
    """``(identical prefix, positions compared, match rate)`` of ``ids`` against ``reference`` over the tokens both
    have: the eval's greedy-agreement measures (:func:`kitty.tools.eval_metrics.agreement_table`) for one text."""
    n = min(len(reference), len(ids))
    same = [a == b for a, b in zip(reference, ids)]
    prefix = same.index(False) if False in same else n
    return prefix, n, (sum(same) / n if n else 1.0)


def agreement_text(col: kd.Column, ref: kd.Column) -> str:
    """``"agrees for K tokens / M%"`` (the whole text so far when nothing differs)."""
    prefix, n, rate = agreement(ref.ids, col.ids)
    if prefix == n:
        return f"agrees for all {n} tokens / 100%"
    return f"agrees for {prefix} token{'s' * (prefix != 1)} / {rate:.0%}"


def text_html(col: kd.Column, ref: kd.Column, tokenizer, color: str) -> str:
    """The column's generated text as HTML, everything from its first token that differs from the reference
    column's marked (``<mark class='diverged'>``); stripping the tags gives the text back exactly."""
    d = None if col is ref else divergence(ref.ids, col.ids)
    if d is None:
        body = html.escape(col.text)
    else:
        head = tokenizer.decode(col.ids[:d], skip_special_tokens=True)
        if col.text.startswith(head):
            rest = col.text[len(head) :]
            body = f"{html.escape(head)}<mark class='diverged' style='background:{color}40'>{html.escape(rest)}</mark>"
        else:  # a token boundary inside a character: mark nothing rather than split it
            body = html.escape(col.text)
    return f"<div class='gen' style='border-left: 4px solid {color}'>{body}</div>"


def verdict_line(col: kd.Column, ref: kd.Column, answer: str = "") -> str:
    """One column's verdict: ``"3 · kitty: 3.6× smaller than fp16, agrees for K tokens / M%"`` (HTML), with
    ``answer`` (e.g. whether it gave the key) after it."""
    r = col.readout
    if r is None:
        return f"<b>{html.escape(col.label)}</b>: {html.escape(col.status)}…"
    m = r.report
    if col is ref:
        size = f"the reference, {fmt_bytes(m.stored_bytes)}"
        line = f"<b>{html.escape(col.label)}</b>: {size} ({m.bits_per_element:.2f} bits/element)"
    else:
        if m.compression > 1.005:
            size = f"{m.compression:.1f}× smaller than fp16"
        else:
            cfg = get_preset(col.method)
            size = f"as large as fp16 so far (no page yet: pages start after {cfg.sink_tokens + cfg.group_size} tokens)"
        line = f"<b>{html.escape(col.label)}</b>: {size} ({fmt_bytes(m.stored_bytes)}), {agreement_text(col, ref)}"
    return line + (f" · {answer}" if answer else "")


def verdict(columns: Sequence[kd.Column], answers: Sequence[str] = ()) -> str:
    """The verdict block: one line per column (:func:`verdict_line`), the first thing the page shows."""
    ref = reference_column(columns)
    answers = list(answers) + [""] * (len(columns) - len(answers))
    lines = "".join(
        f"<li style='border-left: 6px solid {COLUMN_COLORS[i % len(COLUMN_COLORS)]}'>{verdict_line(c, ref, a)}</li>"
        for i, (c, a) in enumerate(zip(columns, answers))
    )
    return f"<ul class='verdict'>{lines}</ul>"


def answer_mark(text: str, key: int, gives_key) -> str:
    """``"gives the key 68351 (right)"`` or ``"… does not give the key (wrong)"`` for one column's text."""
    if gives_key(text):
        return f"<span class='right'>gives the answer {key}: right</span>"
    return f"<span class='wrong'>does not give {key}: wrong</span>"


# ------------------------------------------------------------------------------- presets and knobs


def preset_info(method: str) -> str:
    """The one-line description of a preset (what its dropdown shows under it)."""
    return get_preset(method).description


def with_knobs(method: str, boost_fraction: float, sink: int, window: int) -> str:
    """``method`` with the advanced controls applied where they differ from the preset: sink and local window on
    every quantizing preset (so the columns stay comparable), the boost fraction on presets that boost."""
    cfg = get_preset(method)
    if not (cfg.quantizes_keys or cfg.quantizes_values):
        return method
    changes = []
    if cfg.key_bits == 2 and cfg.boost_fraction > 0 and cfg.boost_profile is None:
        if abs(boost_fraction - cfg.boost_fraction) > 1e-9:
            changes.append(f"boost_fraction={boost_fraction:g}")
    if sink != cfg.sink_tokens:
        changes.append(f"sink_tokens={int(sink)}")
    if window != cfg.local_window:
        changes.append(f"local_window={int(window)}")
    return "+".join([method, *changes])


def cost_line(methods: Sequence[str], tokens: int, dims: ModelDims) -> str:
    """What each column would store at ``tokens`` tokens (the analytic model), and what column 3 costs over column
    2: with the fair baseline that difference is the boost alone. Shown before Generate."""
    reps = [analytic_report(get_preset(m), tokens, dims.head_dim, dims.num_kv_heads, dims.num_layers) for m in methods]
    parts = [
        f"{i + 1} · {m}: {fmt_bytes(r.stored_bytes)} ({r.bits_per_element:.2f} bits/element)"
        for i, (m, r) in enumerate(zip(methods, reps))
    ]
    text = f"**Memory at {tokens} tokens** (prompt + max new): " + " · ".join(parts)
    if len(reps) >= 3 and reps[1].stored_bytes:
        extra = reps[2].stored_bytes - reps[1].stored_bytes
        text += f". Column 3 stores {fmt_bytes(abs(extra))} {'more' if extra >= 0 else 'less'} than column 2"
        text += f" ({extra / reps[1].stored_bytes:+.1%})."
    return text


# ------------------------------------------------------------------------------- the eval's measured figures


def _assets() -> Path:
    """The repository's ``assets/`` folder (the eval's committed CSVs), found upward from this file."""
    here = Path(__file__).resolve()
    return next((p / "assets" for p in here.parents if (p / "assets").is_dir()), here.parent / "assets")


@functools.lru_cache(maxsize=None)
def eval_figures() -> dict[str, dict[str, float]]:
    """The eval's measured figures per preset from the committed CSVs in ``assets/`` (the full run first, the
    "beyond" run for the presets it adds): ``ppl``, ``ppl_change`` (relative to fp16), ``passkey`` (share solved)
    and ``match_rate`` (greedy agreement), where measured. Empty when the files are missing (an installed wheel)."""
    out: dict[str, dict[str, float]] = {}
    root = _assets()

    def rows(name: str) -> list[dict]:
        path = root / name
        return list(csv.DictReader(path.open())) if path.is_file() else []

    for name in ("eval_ppl_full.csv", "eval_ppl_beyond.csv"):
        for r in rows(name):
            if r.get("text", "all") != "all":  # a per-text row: the preset's figure is the one over every text
                continue
            d = out.setdefault(r["method"], {})
            d.setdefault("ppl", float(r["ppl"]))
            d.setdefault("ppl_change", float(r["ppl_change"]))
    for name in ("eval_passkey_full.csv", "eval_passkey_beyond.csv"):
        solved: dict[str, list[int]] = {}
        for r in rows(name):
            s = solved.setdefault(r["method"], [0, 0])
            s[0] += int(r["solved"])
            s[1] += int(r["total"])
        for m, (s, t) in solved.items():
            if t:
                out.setdefault(m, {}).setdefault("passkey", s / t)
                out[m].setdefault("passkey_total", t)
    for r in rows("eval_agreement_full.csv"):
        out.setdefault(r["method"], {}).setdefault("match_rate", float(r["match_rate"]))
    return out


def eval_line(method: str) -> str:
    """``"eval: perplexity 17.6 (+10%), passkeys 97% of 30"`` for a preset, or ``""`` when it was not measured."""
    base = method.split("+")[0]
    f = eval_figures().get(base)
    if not f:
        return ""
    parts = []
    if "ppl" in f:
        parts.append(f"perplexity {f['ppl']:.1f}" + (f" ({f['ppl_change']:+.0%})" if base != "fp16" else ""))
    if "passkey" in f:
        parts.append(f"passkeys {f['passkey']:.0%} of {f['passkey_total']:.0f}")
    changed = " (the preset's own figures; this run changes it)" if "+" in method else ""
    return "eval: " + ", ".join(parts) + changed if parts else ""
