"""Kitty's Gradio demo: FP16 vs KIVI vs Kitty KV caches streaming side by side, with live KV-memory readouts.

    python app.py [--model NAME] [--host 127.0.0.1] [--port 7860] [--share]     (or: make demo)

The model loads once, when this module is imported (the default embedded SmolLM2-135M-Instruct, or ``--model`` /
``$KITTY_MODEL``). Every request builds its own caches and frees them when it ends or is stopped. This file only
lays out widgets and formats results (readouts, the summary table, byte sizes); the streaming of several caches
lives in :mod:`kitty.tools.demo`, prompts in :mod:`kitty.tools.prompts`, the key inspector in :func:`kitty.core.quant.inspect_keys`.
"""

from __future__ import annotations

import os

# Before torch loads: idle OpenMP workers sleep instead of spinning; spinning threads starve the decoding ones
# on a small shared CPU (measured: 2-thread interleaved decoding fell from ~7 to ~0.3 tok/s per column).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import functools  # noqa: E402
import html  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import gradio as gr  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from kitty import PRESETS, get_preset  # noqa: E402
from kitty.core.memory import analytic_report, asymptotic_bits  # noqa: E402
from kitty.core.quant import KeyInspection, inspect_keys  # noqa: E402
from kitty.hf.generate import Sampling, prompt_keys, prompt_query_scale  # noqa: E402
from kitty.tools import demo as kd  # noqa: E402
from kitty.tools import prompts as kp  # noqa: E402

# A Hugging Face Space sets these two (0.0.0.0, 7860); an explicit server_name would override Gradio's own reading
DEFAULT_HOST = os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
DEFAULT_PORT = int(os.environ.get("GRADIO_SERVER_PORT", "7860"))
CONCURRENCY_LIMIT = 2  # generations running at once; more queue up (2 CPU cores: each would only get slower)
QUEUE_MAX_SIZE = 16
TORCH_THREADS = 1  # torch intra-op threads: the columns already run in parallel threads (README: measured)
SCHEDULE = "threads"  # one thread per column (measured fastest, README); "interleave": one step each in turn
PLOT_EVERY_S = 1.0  # the plot (a matplotlib figure) redraws at most this often while streaming; texts every step
METHODS = list(PRESETS)
BOOST_METHODS = [m for m, c in PRESETS.items() if c.key_bits == 2]
COLUMN_COLORS = ("#64748b", "#ea580c", "#2563eb")  # column 1, 2, 3: the readout's top border and the plot line

CSS = """
.readout {font-size: 0.9em; line-height: 1.35; padding: 0 4px;}
.readout table {width: 100%; border-collapse: collapse; margin: 0;}
.readout td {padding: 3px 6px; border: none; border-bottom: 1px solid var(--border-color-primary); vertical-align: top;}
.readout td:first-child {white-space: nowrap; width: 1%; color: var(--body-text-color-subdued);}
#note {min-height: 1.5em;}
.readout .headline {font-size: 1.7em; margin: 4px 0 0 0;}
.readout .sub {margin: 0 0 4px 0; color: var(--body-text-color-subdued);}
.readout .pagenote {color: #b45309; font-weight: 600;}
#inside-pages th, #inside-bits th {white-space: normal; word-break: normal; overflow-wrap: normal; min-width: 5.5em;}
"""
LAUNCH_STYLE = {"css": CSS, "theme": gr.themes.Soft()}  # Gradio 6 takes these at launch(); tests reuse them


# ---------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Engine:
    """The model and tokenizer, loaded once per process and shared read-only by every request."""

    name: str
    model: object
    tokenizer: object

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.model.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        from kitty.hf.models import kv_dims

        return kv_dims(self.model.config)[2]


@functools.lru_cache(maxsize=None)
def get_engine(name: str | None = None) -> Engine:
    """Load ``(model, tokenizer)`` for ``name`` (``None``: the default model) the first time; reuse it after."""
    from kitty.hf.models import DEFAULT_MODEL_NAME, load_model

    model, tokenizer = load_model(name)  # bf16, never trust_remote_code
    return Engine(name or DEFAULT_MODEL_NAME, model, tokenizer)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; ``--model`` defaults to ``$KITTY_MODEL`` (unset: the default embedded model)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default=os.environ.get("KITTY_MODEL") or None,
        help="HF id or local path (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--host", default=DEFAULT_HOST, help="interface to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    p.add_argument("--max-prompt-tokens", type=int, default=kp.MAX_PROMPT_TOKENS, help="longer prompts keep their end")
    p.add_argument("--concurrency", type=int, default=CONCURRENCY_LIMIT, help="generations running at once")
    p.add_argument("--schedule", choices=kd.SCHEDULES, default=SCHEDULE, help="how the three columns share the CPU")
    p.add_argument("--torch-threads", type=int, default=TORCH_THREADS, help="torch intra-op threads per column")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------- formatting


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
    if ref is not None and tokenizer is not None:
        rows.append(("text", text_vs_reference(col, ref, tokenizer, color)))
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


def bits_table(engine: Engine, prompt_tokens: int, new_tokens: int) -> pd.DataFrame:
    """Bits per element of every preset: pages alone (the long-context limit) split by component, and the whole
    cache (sink, qbuffers and local window included) at ``prompt_tokens + new_tokens`` tokens."""
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
    rows = snap.plot_rows()  # series "column 1", "column 2", ... in column order
    names = {f"column {i + 1}": c.label for i, c in enumerate(snap.columns)}
    df = pd.DataFrame(rows, columns=["column", "tokens", "stored_KiB"]).replace({"column": names})
    return df.assign(stored_MiB=df.pop("stored_KiB") / 1024)


# Line styles per column: a wide pale line under narrower ones, so identical lines stay visible as a band
LINE_STYLES = (
    {"lw": 6.0, "alpha": 0.45, "ls": "-"},
    {"lw": 2.6, "alpha": 0.95, "ls": "--"},
    {"lw": 1.4, "alpha": 1.0, "ls": "-"},
)


def memory_figure(snap: kd.Snapshot):
    """Stored KV MiB against cached tokens, one line per column in the column's colour (integer token ticks),
    a marker where a column packed a page, and a note naming lines that lie on top of each other."""
    fig, ax = plt.subplots(figsize=(12, 3.1), dpi=90)
    same = []
    for i, c in enumerate(snap.columns):
        if not c.history:
            continue
        t, b = zip(*c.history)
        mib = [x / 2**20 for x in b]
        color = COLUMN_COLORS[i % len(COLUMN_COLORS)]
        twin = next((j for j in range(i) if snap.columns[j].history == c.history), None)
        if twin is not None:
            same.append(f"{c.label} lies on {snap.columns[twin].label}")
        ax.plot(t, mib, color=color, label=c.label, **LINE_STYLES[i % len(LINE_STYLES)])
        at = dict(c.history)
        for tokens, sides in c.packs:
            ax.plot([tokens], [at[tokens] / 2**20], marker="v", ms=9, color=color, ls="none")
            ax.annotate(
                f"{sides} page packed",
                (tokens, at[tokens] / 2**20),
                xytext=(4, -12),
                textcoords="offset points",
                fontsize=8,
                color=color,
            )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=8))
    ax.set_xlabel("cached tokens")
    ax.set_ylabel("KV stored (MiB)")
    top = max((b for c in snap.columns for _, b in c.history), default=0) / 2**20
    ax.set_ylim(0, 1.35 * top or 1)  # headroom above the highest line for the legend
    ax.grid(alpha=0.3)
    title = "Stored KV cache vs cached tokens (▼: a qbuffer packed into a 2-bit page)"
    ax.set_title(title + (" — " + "; ".join(same) if same else ""), fontsize=10)
    if ax.lines:
        ax.legend(loc="upper left", fontsize=9, ncol=3, frameon=False)
    fig.tight_layout()
    plt.close(fig)
    return fig


def heatmap_figure(ins: KeyInspection):
    """|K| as channels x tokens, sink and page boundaries as lines, each page's boosted channels marked."""
    T, D = ins.abs_keys.shape
    fig, ax = plt.subplots(figsize=(12, 4.6), dpi=90)
    img = ins.abs_keys.T.numpy()
    vmax = float(ins.abs_keys.quantile(0.995)) if T * D < 2**24 else float(ins.abs_keys.max())
    im = ax.imshow(
        img,
        aspect="auto",
        origin="lower",
        cmap="magma",
        vmin=0,
        vmax=vmax,
        interpolation="nearest",
        extent=(-0.5, T - 0.5, -0.5, D - 0.5),
    )
    fig.colorbar(im, ax=ax, pad=0.01, label="|K|")
    if ins.sink:
        ax.axvline(ins.sink - 0.5, color="white", lw=1.2)
        ax.text(ins.sink / 2, D + 0.5, "sink", ha="center", va="bottom", fontsize=8)
    for pg in ins.pages:
        ax.axvline(pg.start - 0.5, color="white", lw=0.8, ls="--")
        for ch in pg.boosted:  # a hollow box around each boosted row keeps the |K| values inside visible
            ax.add_patch(
                Rectangle(
                    (pg.start - 0.5, ch - 0.5),
                    pg.end - pg.start,
                    1,
                    fill=False,
                    ec="#00e5ff",
                    lw=0.9,
                    ls="-" if pg.quantized else ":",
                )
            )
        label = f"page {ins.pages.index(pg)}" if pg.quantized else "qbuffer"
        ax.text((pg.start + pg.end) / 2, D + 0.5, label, ha="center", va="bottom", fontsize=8)
    ax.set_xlim(-0.5, T - 0.5)
    ax.set_ylim(-0.5, D + 3)
    ax.set_xlabel("token position")
    ax.set_ylabel("key channel")
    ax.set_title(
        f"|K| post-RoPE, layer {ins.layer}, KV head {ins.head} — cyan boxes: boosted channels under {ins.method} "
        "(solid: quantized page; dotted: qbuffer, if it were quantized now)",
        fontsize=9,
    )
    fig.tight_layout()
    plt.close(fig)
    return fig


# -------------------------------------------------------------------------------------------- handlers


def make_generate(engine: Engine, max_prompt_tokens: int, schedule: str = SCHEDULE):
    """The Generate handler: a generator yielding the whole output tuple after every decode step."""

    def generate(
        prompt: str,
        chat_template: bool,
        max_new_tokens: float,
        temperature: float,
        top_p: float,
        seed: float,
        method_1: str,
        method_2: str,
        method_3: str,
    ) -> Iterator[tuple]:
        stop = kd.StopFlag()
        idle = (gr.update(interactive=True), gr.update(interactive=False))
        busy = (gr.update(interactive=False), gr.update(interactive=True))

        def message(note: str) -> tuple:
            return (note, "", "", "", "", "", "", gr.skip(), "", {}, None, *idle)

        try:
            check_text(prompt)
            prompt_ = kp.prepare_prompt(engine.tokenizer, prompt, bool(chat_template), max_prompt_tokens)
            temperature = parse_number("temperature", temperature, 0.0, math.inf, "0 = greedy")
            top_p = parse_number("top_p", top_p, 0.0, 1.0, "0 < top_p <= 1", low_open=True)
            sampling = Sampling(temperature, top_p, parse_seed(seed))
            n = parse_whole("max_new_tokens", max_new_tokens, 1, kd.MAX_NEW_TOKENS_CAP)
            methods = [method_1, method_2, method_3]
            for i, m in enumerate(methods):
                if not isinstance(m, str) or not m:
                    raise ValueError(f"choose a cache method for column {i + 1} (one of {', '.join(METHODS)})")
                get_preset(m)
        except (ValueError, TypeError, OverflowError) as e:  # PromptError included: a message, never a crash
            yield message(str(e) if isinstance(e, kp.PromptError) else f"⚠️ {e}")
            return
        head = f"Prompt: {prompt_.tokens} tokens{' (chat template)' if chat_template else ''}, up to {n} new tokens per column."
        note = head + (f"\n\n{prompt_.note}" if prompt_.note else "")
        last_plot = 0.0
        try:
            for snap in kd.stream_side_by_side(
                engine.model, engine.tokenizer, prompt_, methods, n, sampling, stop, schedule=schedule
            ):
                final = snap.phase in ("done", "stopped")
                now = time.perf_counter()
                if (final or now - last_plot >= PLOT_EVERY_S) and any(c.history for c in snap.columns):
                    plot = memory_figure(snap)
                    last_plot = now
                else:
                    plot = gr.skip()
                cols = snap.columns
                ref = reference_column(cols)
                yield (
                    note,
                    *(c.text for c in cols),
                    *(
                        format_readout(c, engine.head_dim, ref, engine.tokenizer, COLUMN_COLORS[i])
                        for i, c in enumerate(cols)
                    ),
                    plot,
                    summarize(cols, engine.tokenizer, snap.phase == "stopped", engine.head_dim)
                    if final
                    else f"_{snap.phase}…_",
                    {c.label: (c.readout.as_dict() if c.readout else None) for c in cols} if final else gr.skip(),
                    None if final else stop,  # a finished run has nothing left to stop
                    *(idle if final else busy),
                )
        except Exception as e:  # shown in the UI, buttons re-enabled; the generator's finally freed the caches
            yield message(f"⚠️ Generation failed: {type(e).__name__}: {e}")

    return generate


def check_text(prompt: object) -> None:
    """Refuse a prompt that is not text a tokenizer can read (a lone UTF-16 surrogate, sent over the API), with
    the position of the first bad character."""
    if prompt is None or not isinstance(prompt, str):
        if prompt is None:
            return  # prepare_prompt says the prompt is empty
        raise ValueError(f"the prompt must be text, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"the prompt contains a character that is not valid text ({prompt[e.start]!r} at character {e.start + 1}, "
            "a lone surrogate): remove it or paste the text again"
        ) from None


def _number(name: str, value: object) -> float:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got NaN")
    return value


def parse_number(name: str, value: object, lo: float, hi: float, meaning: str = "", low_open: bool = False) -> float:
    """``value`` as a finite float in ``[lo, hi]`` (``(lo, hi]`` with ``low_open``), or a ``ValueError`` naming
    ``name`` and the range."""
    v = _number(name, value)
    ok = (lo < v if low_open else lo <= v) and v <= hi and math.isfinite(v)
    if not ok:
        span = f"{'(' if low_open else '['}{lo:g}, {hi:g}]" if math.isfinite(hi) else f">= {lo:g} and finite"
        raise ValueError(f"{name} must be {span}{f' ({meaning})' if meaning else ''}, got {v:g}")
    return float(v)


def parse_whole(name: str, value: object, lo: int, hi: int) -> int:
    """``value`` as an integer in ``[lo, hi]``; a fraction (2.5) or NaN is a ``ValueError`` naming ``name``, never
    rounded."""
    v = _number(name, value)
    if isinstance(v, float) and not v.is_integer():
        raise ValueError(f"{name} must be a whole number in [{lo}, {hi}], got {v:g}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v:g}")
    return int(v)


def parse_seed(seed: float | int | None) -> int:
    """The seed box's value as an integer in ``[0, 2**63)`` (what ``torch.Generator.manual_seed`` takes), or a
    ``ValueError`` saying so."""
    if seed is None or isinstance(seed, bool) or not isinstance(seed, (int, float)):
        raise ValueError(f"the seed must be a whole number, got {seed!r}")
    if isinstance(seed, float) and not seed.is_integer():
        raise ValueError(f"the seed must be a whole number, got {seed!r}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"the seed must be in [0, 2**63), got {seed:g}")
    return int(seed)


def stop_generation(stop: kd.StopFlag | None) -> str:
    """Set this session's stop flag; the running generation frees its caches and reports where it stopped."""
    if stop is None:
        return "Nothing is running."
    stop.set()
    return "Stopping… (caches are freed after the current step)"


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
    if nb == 0:
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
    return (
        f"Key error weighs every channel alike, so the boost lowers it only to {mean:.2f}× of all-2-bit here "
        "(mean error ratio over full pages). Attention sees q·k, which the few large channels dominate, and those "
        "are the ones kept at 4 bits: the attention-score error falls much more (notebook 02, section 5, measures "
        "it against 2-bit keys on every layer and head)."
    )


def make_inspect(engine: Engine, max_prompt_tokens: int):
    """The "Inside the cache" handler: intro, heatmap, per-page table and bits/element breakdown for the prompt."""

    def inspect(prompt: str, chat_template: bool, method: str, layer: float, head: float, max_new_tokens: float):
        try:
            check_text(prompt)
            cfg = get_preset(method)
            layer = parse_whole("layer", layer, 0, engine.num_layers - 1)
            head = parse_whole("KV head", head, 0, engine.num_kv_heads - 1)
            new = parse_whole("max_new_tokens", max_new_tokens, 1, kd.MAX_NEW_TOKENS_CAP)
            intro = method_intro(cfg, engine.head_dim, layer, engine.num_layers)
            prompt_ = kp.prepare_prompt(engine.tokenizer, prompt, bool(chat_template), max_prompt_tokens)
            keys = prompt_keys(engine.model, prompt_.ids)[layer][head]  # (T, D)
            query_scale = prompt_query_scale(engine.model, prompt_.ids, cfg, layer, head)  # query-aware selections
            ins = inspect_keys(keys, cfg, layer, head, query_scale)
        except (ValueError, TypeError, IndexError) as e:
            msg = str(e) if isinstance(e, kp.PromptError) else f"⚠️ {e}"
            return gr.skip(), msg, None, None, gr.skip()
        pages = pd.DataFrame(
            [
                {
                    "page": (f"page {i}" if p.quantized else "qbuffer (not yet a page)"),
                    "tokens": f"{p.start}–{p.end - 1}",
                    "boosted channels": ", ".join(map(str, p.boosted)) or "none",
                    "key error, boosted": round(p.error_boosted, 4),
                    "key error, all 2-bit": round(p.error_2bit, 4),
                    "ratio": round(p.error_boosted / p.error_2bit, 3) if p.error_2bit else None,
                }
                for i, p in enumerate(ins.pages)
            ],
            columns=["page", "tokens", "boosted channels", "key error, boosted", "key error, all 2-bit", "ratio"],
        )
        full = sum(p.quantized for p in ins.pages)
        S = cfg.sink_tokens  # the sink holds min(S, prompt tokens)
        qbuf = prompt_.tokens - ins.sink - full * ins.group_size
        note = (
            f"{prompt_.tokens} prompt tokens: {ins.sink} in the sink, {full * ins.group_size} in {full} full "
            f"page{'s' * (full != 1)} of {ins.group_size}, {qbuf} in the qbuffer. "
            "Key error = ‖K − dequant(quant(K))‖ / ‖K‖ over the page."
        )
        if full == 0:
            note += (
                f" No full page yet: pages start after {S + ins.group_size} tokens "
                f"(sink {S} + page {ins.group_size}); try the long-document example."
            )
        line = attention_note(ins)
        if line:
            note += "\n\n" + line
        if prompt_.note:
            note += "\n\n" + prompt_.note
        return intro, note, heatmap_figure(ins), pages, bits_table(engine, prompt_.tokens, new)

    return inspect


# ---------------------------------------------------------------------------------------------- layout


def examples() -> list[tuple[str, str, bool, int]]:
    """``(label, prompt, chat template, max new tokens)`` of the gallery. The long document comes first and is the
    prompt box's default: a short prompt never reaches the first page (sink + one page of tokens), so it would
    show 16 bits/element in every column."""
    short, doc, passkey = kp.example_prompts()
    return [
        ("Long document + question (essay excerpt)", doc[0], doc[1], kd.DEFAULT_MAX_NEW_TOKENS),
        ("Short chat question", *short),
        ("Passkey in a haystack (plain)", *passkey),
    ]


def build_controls() -> dict:
    """Prompt box, settings and buttons."""
    c: dict = {}
    with gr.Row():
        with gr.Column(scale=3):
            c["prompt"] = gr.Textbox(
                label="Prompt",
                lines=5,
                max_lines=12,
                value=examples()[0][1],  # long enough to fill pages: the first run already shows compression
                elem_id="prompt",
                placeholder="Ask something, paste a document and a question, or pick an example below.",
            )
        with gr.Column(scale=1, min_width=240):
            c["chat"] = gr.Checkbox(value=True, label="Use the chat template", elem_id="chat-template")
            c["max_new"] = gr.Slider(
                1,
                kd.MAX_NEW_TOKENS_CAP,
                value=kd.DEFAULT_MAX_NEW_TOKENS,
                step=1,
                label=f"Max new tokens per column (cap {kd.MAX_NEW_TOKENS_CAP})",
                elem_id="max-new",
            )
            with gr.Accordion("Sampling", open=False):
                c["temperature"] = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                c["top_p"] = gr.Slider(0.05, 1.0, value=0.95, step=0.05, label="Top-p")
                c["seed"] = gr.Number(value=0, precision=0, label="Seed (same in every column)")
            with gr.Row():
                c["generate"] = gr.Button("Generate", variant="primary", elem_id="generate")
                c["stop"] = gr.Button("Stop", variant="stop", interactive=False, elem_id="stop")
    c["note"] = gr.Markdown(elem_id="note")
    return c


def build_columns() -> dict:
    """Three columns: method dropdown, streamed text, live readout."""
    c: dict = {"methods": [], "outputs": [], "readouts": []}
    with gr.Row(equal_height=False):
        for i, default in enumerate(kd.DEFAULT_METHODS):
            with gr.Column(min_width=280):
                c["methods"].append(
                    gr.Dropdown(METHODS, value=default, label=f"Column {i + 1}: cache method", elem_id=f"method-{i}")
                )
                c["outputs"].append(
                    gr.Textbox(
                        label="Generated", lines=9, max_lines=9, autoscroll=True, interactive=False, elem_id=f"out-{i}"
                    )
                )
                c["readouts"].append(gr.HTML("<div class='readout'><i>idle</i></div>", elem_id=f"readout-{i}"))
    return c


def build_generate_tab(engine: Engine, max_prompt_tokens: int, schedule: str = SCHEDULE) -> dict:
    """The main tab: controls, examples, three columns, the memory plot and the summary."""
    c = build_controls()
    gallery = examples()
    gr.Examples(
        examples=[list(e[1:]) for e in gallery],
        inputs=[c["prompt"], c["chat"], c["max_new"]],
        example_labels=[e[0] for e in gallery],
        label="Examples",
    )
    c.update(build_columns())
    c["summary"] = gr.Markdown(elem_id="summary")
    c["plot"] = gr.Plot(None, show_label=False, elem_id="memory-plot")  # memory_figure: title, axes, legend
    with gr.Accordion("Raw readouts (JSON, final)", open=False):
        c["json"] = gr.JSON(elem_id="readouts-json")
    c["state"] = gr.State(None)  # this session's StopFlag: set by Stop, replaced by every Generate
    outputs = [
        c["note"],
        *c["outputs"],
        *c["readouts"],
        c["plot"],
        c["summary"],
        c["json"],
        c["state"],
        c["generate"],
        c["stop"],
    ]
    inputs = [c["prompt"], c["chat"], c["max_new"], c["temperature"], c["top_p"], c["seed"], *c["methods"]]
    handler = make_generate(engine, max_prompt_tokens, schedule)
    # one concurrency group: the button and Enter in the prompt box share the limit set in demo.queue()
    c["generate"].click(handler, inputs, outputs, api_name="generate", concurrency_id="generate")
    c["prompt"].submit(handler, inputs, outputs, api_name=False, concurrency_id="generate")
    c["stop"].click(stop_generation, [c["state"]], [c["note"]], api_name="stop", concurrency_limit=None)
    return c


def build_inside_tab(engine: Engine, max_prompt_tokens: int, controls: dict) -> dict:
    """The "Inside the cache" tab: what a method does to the keys of the current prompt. It opens filled with the
    default prompt's keys; opening the tab again (or Look inside) reads the prompt box as it is then."""
    handler = make_inspect(engine, max_prompt_tokens)
    layer0 = min(engine.num_layers - 1, engine.num_layers // 2)
    first = handler(controls["prompt"].value, True, "kitty", layer0, 0, controls["max_new"].value)
    intro = gr.Markdown(first[0], elem_id="inside-intro")
    with gr.Row():
        method = gr.Dropdown(BOOST_METHODS, value="kitty", label="Method (2-bit keys)", elem_id="inside-method")
        layer = gr.Slider(0, engine.num_layers - 1, value=layer0, step=1, label="Layer")
        head = gr.Slider(0, engine.num_kv_heads - 1, value=0, step=1, label="KV head")
        show = gr.Button("Look inside (reads the prompt box)", variant="primary", elem_id="inside-show")
    note = gr.Markdown(first[1], elem_id="inside-note")
    heat = gr.Plot(first[2], show_label=False, elem_id="inside-heatmap")  # the figure's own title says what it is
    pages = gr.Dataframe(
        first[3], label="Pages of this layer and KV head: boosted channels and key error", elem_id="inside-pages"
    )
    bits = gr.Dataframe(
        first[4],
        label=f"Bits per element (head_dim {engine.head_dim}): pages alone, by component, and the whole cache "
        "(sink, qbuffers, local window included) at the prompt's length plus max new tokens",
        elem_id="inside-bits",
    )
    inputs = [controls["prompt"], controls["chat"], method, layer, head, controls["max_new"]]
    outputs = [intro, note, heat, pages, bits]
    show.click(handler, inputs, outputs, api_name="inspect", concurrency_id="inspect")
    for w in (layer, head):
        w.release(handler, inputs, outputs, api_name=False, concurrency_id="inspect")
    method.input(handler, inputs, outputs, api_name=False, concurrency_id="inspect")
    return {"inputs": inputs, "outputs": outputs, "handler": handler}


def build_demo(
    engine: Engine,
    max_prompt_tokens: int = kp.MAX_PROMPT_TOKENS,
    concurrency: int = CONCURRENCY_LIMIT,
    schedule: str = SCHEDULE,
) -> gr.Blocks:
    """The whole app, queued with a concurrency limit."""
    with gr.Blocks(title="Kitty: 2-bit KV caches side by side") as demo:
        gr.Markdown(
            "# 🐱 Kitty — 2-bit KV caches, side by side\n"
            f"Three KV caches generate from the same prompt with **{engine.name}** "
            f"({engine.num_layers} layers, {engine.num_kv_heads} KV heads, head_dim {engine.head_dim}). "
            "Watch the text and the memory: `fp16` keeps everything, `kivi-k2v2` stores 2-bit keys and values, "
            "`kitty` boosts each key page's most important channels to 4 bits "
            "([arXiv 2511.18643](https://arxiv.org/abs/2511.18643))."
        )
        with gr.Tab("Generate"):
            controls = build_generate_tab(engine, max_prompt_tokens, schedule)
        with gr.Tab("Inside the cache", elem_id="inside-tab") as inside_tab:
            inside = build_inside_tab(engine, max_prompt_tokens, controls)
        # opening the tab reads the prompt box as it is now (the tab opened filled with the default prompt)
        inside_tab.select(
            inside["handler"], inside["inputs"], inside["outputs"], api_name=False, concurrency_id="inspect"
        )
    demo.queue(default_concurrency_limit=concurrency, max_size=QUEUE_MAX_SIZE)
    return demo


ARGS = parse_args(None if __name__ == "__main__" else [])  # flags only when run as a script; env otherwise
demo = build_demo(get_engine(ARGS.model), ARGS.max_prompt_tokens, ARGS.concurrency, ARGS.schedule)

if __name__ == "__main__":
    torch.set_num_threads(ARGS.torch_threads)  # here only: importing app (tests) leaves torch's setting alone
    demo.launch(server_name=ARGS.host, server_port=ARGS.port, share=ARGS.share, **LAUNCH_STYLE)
