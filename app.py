"""Kitty's Gradio demo: FP16 vs KIVI vs Kitty KV caches streaming side by side, with live KV-memory readouts.

    python app.py [--model NAME] [--host 127.0.0.1] [--port 7860] [--share]     (or: make demo)

The model loads once, when this module is imported (the default embedded SmolLM2-135M-Instruct, or ``--model`` /
``$KITTY_MODEL``). Every request builds its own caches and frees them when it ends or is stopped. This file only
lays out widgets and formats results (readouts, the summary table, byte sizes); the streaming of several caches
lives in :mod:`kitty.demo`, prompts in :mod:`kitty.prompts`, the key inspector in :func:`kitty.quant.inspect_keys`.
"""

from __future__ import annotations

import os

# Before torch loads: idle OpenMP workers sleep instead of spinning; spinning threads starve the decoding ones
# on a small shared CPU (measured: 2-thread interleaved decoding fell from ~7 to ~0.3 tok/s per column).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import functools  # noqa: E402
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

from kitty import PRESETS, get_preset  # noqa: E402
from kitty import demo as kd  # noqa: E402
from kitty import prompts as kp  # noqa: E402
from kitty.generate import Sampling, prompt_keys, prompt_query_scale  # noqa: E402
from kitty.memory import analytic_report, asymptotic_bits  # noqa: E402
from kitty.quant import KeyInspection, inspect_keys  # noqa: E402

# A Hugging Face Space sets these two (0.0.0.0, 7860); an explicit server_name would override Gradio's own reading
DEFAULT_HOST = os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
DEFAULT_PORT = int(os.environ.get("GRADIO_SERVER_PORT", "7860"))
CONCURRENCY_LIMIT = 2  # generations running at once; more queue up (2 CPU cores: each would only get slower)
QUEUE_MAX_SIZE = 16
TORCH_THREADS = 1  # torch intra-op threads: the columns already run in parallel threads (README: measured)
SCHEDULE = "threads"  # one thread per column (measured fastest, README); "interleave": one step each in turn
PLOT_EVERY_S = 0.5  # the plot redraws at most this often while streaming (text and readouts update every step)
METHODS = list(PRESETS)
BOOST_METHODS = [m for m, c in PRESETS.items() if c.key_bits == 2]

CSS = """
.readout {font-size: 0.9em; line-height: 1.35; padding: 0 4px;}
.readout table {width: 100%; border-collapse: collapse; margin: 0;}
.readout td {padding: 3px 6px; border: none; border-bottom: 1px solid var(--border-color-primary); vertical-align: top;}
.readout td:first-child {white-space: nowrap; width: 1%; color: var(--body-text-color-subdued);}
#note {min-height: 1.5em;}
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
        from kitty.models import kv_dims

        return kv_dims(self.model.config)[2]


@functools.lru_cache(maxsize=None)
def get_engine(name: str | None = None) -> Engine:
    """Load ``(model, tokenizer)`` for ``name`` (``None``: the default model) the first time; reuse it after."""
    from kitty.models import DEFAULT_MODEL_NAME, load_model

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


def format_readout(col: kd.Column) -> str:
    """HTML readout under one column: bytes, bits/element, compression, tokens, speed and where tokens live."""
    r = col.readout
    if r is None:
        return f"<div class='readout'><i>{col.status}…</i></div>"
    m, lay = r.report, r.layout
    keys = f"sink {lay['sink']} · pages {lay['key_pages']} · qbuffer {lay['key_qbuffer']}"
    values = f"sink {lay['sink']} · pages {lay['value_pages']} · qbuffer {lay['value_qbuffer']} · local {lay['local']}"
    rows = [
        ("KV stored", f"<b>{fmt_bytes(m.stored_bytes)}</b> of {fmt_bytes(m.fp16_bytes)} fp16-equivalent"),
        ("bits / element", f"<b>{m.bits_per_element:.2f}</b>"),
        ("compression", f"<b>{m.compression:.2f}×</b>"),
        ("tokens", f"<b>{m.tokens}</b> cached ({r.new_tokens} new)"),
        ("speed", f"<b>{r.tokens_per_s:.1f} tok/s</b> ({r.step_ms:.0f} ms/step own)"),
        ("tokens live in", f"K: {keys}<br>V: {values}"),
        ("status", col.status),
    ]
    body = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows)
    return f"<div class='readout'><table>{body}</table></div>"


def divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first generated token where ``other`` differs from ``reference``, ``None`` if one is a prefix."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None


def summarize(columns: Sequence[kd.Column], tokenizer, stopped: bool) -> str:
    """A readable markdown summary: memory per column and where each left the fp16 column's tokens."""
    ref = next((c for c in columns if c.method == "fp16"), None)
    lines = ["**Stopped** — caches freed." if stopped else "**Done** — caches freed.", ""]
    lines += [
        "| column | tokens | KV stored | fp16-equivalent | bits/elem | compression | tok/s | vs fp16 |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in columns:
        r = c.readout
        if r is None:
            lines.append(f"| {c.label} | – | – | – | – | – | – | {c.status} |")
            continue
        if ref is None:
            vs = "no fp16 column to compare"
        elif c is ref:
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
    return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}" if n < 100 else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def bits_table(engine: Engine, prompt_tokens: int, new_tokens: int) -> pd.DataFrame:
    """Bits per element of every preset: the long-context limit split by component, and at this length."""
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
                "key low": a["key_low"],
                "key high (boost)": a["key_high"],
                "key boost_idx": a["key_boost_idx"],
                "key scale+zero": a["key_scale_zero"],
                "key raw": a["key_raw"],
                "key pages": a["key_total"],
                "value codes": a["value_codes"],
                "value scale+zero": a["value_scale_zero"],
                "value pages": a["value_total"],
                "pages (K+V)/2": a["total"],
                f"whole cache at {n} tokens": rep.bits_per_element,
                "compression there": rep.compression,
            }
        )
    return pd.DataFrame(rows).round(3)


def memory_plot(snap: kd.Snapshot) -> pd.DataFrame:
    """The memory plot's rows: one line per column, named by the column's label and method ("1 · kitty")."""
    rows = snap.plot_rows()  # series "column 1", "column 2", ... in column order
    names = {f"column {i + 1}": c.label for i, c in enumerate(snap.columns)}
    return pd.DataFrame(rows).replace({"column": names})


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
            prompt_ = kp.prepare_prompt(engine.tokenizer, prompt, bool(chat_template), max_prompt_tokens)
            sampling = Sampling(float(temperature), float(top_p), parse_seed(seed))
            n = int(max(1, min(int(max_new_tokens), kd.MAX_NEW_TOKENS_CAP)))
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
                # Gradio fixes the plot's colors at its first value: send one only when all 3 lines have a point
                if (final or now - last_plot >= PLOT_EVERY_S) and all(c.history for c in snap.columns):
                    plot = memory_plot(snap)
                    last_plot = now
                else:
                    plot = gr.skip()
                cols = snap.columns
                yield (
                    note,
                    *(c.text for c in cols),
                    *(format_readout(c) for c in cols),
                    plot,
                    summarize(cols, engine.tokenizer, snap.phase == "stopped") if final else f"_{snap.phase}…_",
                    {c.label: (c.readout.as_dict() if c.readout else None) for c in cols} if final else gr.skip(),
                    None if final else stop,  # a finished run has nothing left to stop
                    *(idle if final else busy),
                )
        except Exception as e:  # shown in the UI, buttons re-enabled; the generator's finally freed the caches
            yield message(f"⚠️ Generation failed: {type(e).__name__}: {e}")

    return generate


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


def make_inspect(engine: Engine, max_prompt_tokens: int):
    """The "Inside the cache" handler: heatmap, per-page table and bits/element breakdown for the current prompt."""

    def inspect(prompt: str, chat_template: bool, method: str, layer: float, head: float, max_new_tokens: float):
        try:
            prompt_ = kp.prepare_prompt(engine.tokenizer, prompt, bool(chat_template), max_prompt_tokens)
            cfg = get_preset(method)
            layer, head = int(layer), int(head)
            keys = prompt_keys(engine.model, prompt_.ids)[layer][head]  # (T, D)
            query_scale = prompt_query_scale(engine.model, prompt_.ids, cfg, layer, head)  # query-aware selections
            ins = inspect_keys(keys, cfg, layer, head, query_scale)
        except (ValueError, TypeError, IndexError) as e:
            return (str(e) if isinstance(e, kp.PromptError) else f"⚠️ {e}"), None, None, bits_table(engine, 0, 0)
        pages = pd.DataFrame(
            [
                {
                    "group": (f"page {i}" if p.quantized else "qbuffer (not yet a page)"),
                    "tokens": f"{p.start}–{p.end - 1}",
                    "boosted channels": ", ".join(map(str, p.boosted)),
                    "key error, boosted": round(p.error_boosted, 4),
                    "key error, all 2-bit": round(p.error_2bit, 4),
                    "error ratio": round(p.error_boosted / p.error_2bit, 3) if p.error_2bit else None,
                }
                for i, p in enumerate(ins.pages)
            ]
        )
        full = sum(p.quantized for p in ins.pages)
        note = (
            f"{prompt_.tokens} prompt tokens: {ins.sink} sink, {full} full page(s) of {ins.group_size}, "
            f"{prompt_.tokens - ins.sink - full * ins.group_size} in the qbuffer. "
            "Key error = ‖K − dequant(quant(K))‖ / ‖K‖ for this page."
        )
        if full == 0:
            note += f" No full page yet: pages start after {ins.sink + ins.group_size} tokens — try the long-document example."
        if prompt_.note:
            note += "\n\n" + prompt_.note
        return note, heatmap_figure(ins), pages, bits_table(engine, prompt_.tokens, int(max_new_tokens))

    return inspect


# ---------------------------------------------------------------------------------------------- layout


def build_controls() -> dict:
    """Prompt box, settings and buttons."""
    c: dict = {}
    with gr.Row():
        with gr.Column(scale=3):
            c["prompt"] = gr.Textbox(
                label="Prompt",
                lines=5,
                max_lines=12,
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
    gr.Examples(
        examples=[list(e) for e in kp.example_prompts()],
        inputs=[c["prompt"], c["chat"], c["max_new"]],
        example_labels=[
            "Short chat question",
            "Long document + question (essay excerpt)",
            "Passkey in a haystack (plain)",
        ],
        label="Examples",
    )
    c.update(build_columns())
    c["summary"] = gr.Markdown(elem_id="summary")
    c["plot"] = gr.LinePlot(
        None,
        x="tokens",
        y="stored_KiB",
        color="column",
        title="Stored KV bytes vs cached tokens",
        x_title="cached tokens",
        y_title="KV stored (KiB)",
        height=280,
        elem_id="memory-plot",
    )
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


def build_inside_tab(engine: Engine, max_prompt_tokens: int, controls: dict) -> None:
    """The "Inside the cache" tab: what Kitty does to the keys of the current prompt."""
    gr.Markdown(
        "Keys of the **current prompt** after RoPE, as the cache receives them. Each page of "
        f"{PRESETS['kitty'].group_size} tokens after the sink picks its own top channels by mean |K| and stores them "
        "with 4 bits (2 planes); every other channel gets 2 bits."
    )
    with gr.Row():
        method = gr.Dropdown(BOOST_METHODS, value="kitty", label="Method (2-bit keys)", elem_id="inside-method")
        layer = gr.Slider(
            0, engine.num_layers - 1, value=min(engine.num_layers - 1, engine.num_layers // 2), step=1, label="Layer"
        )
        head = gr.Slider(0, engine.num_kv_heads - 1, value=0, step=1, label="KV head")
        show = gr.Button("Look inside", variant="primary", elem_id="inside-show")
    note = gr.Markdown(elem_id="inside-note")
    heat = gr.Plot(label="|K| heatmap", elem_id="inside-heatmap")
    pages = gr.Dataframe(label="Pages: boosted channels and key error", wrap=True, elem_id="inside-pages")
    bits = gr.Dataframe(
        bits_table(engine, 0, 0),
        label=f"Bits per element (head_dim {engine.head_dim}): pages alone, and the "
        "whole cache (sink, qbuffers, local window included) at the current length",
        wrap=True,
        elem_id="inside-bits",
    )
    inputs = [controls["prompt"], controls["chat"], method, layer, head, controls["max_new"]]
    handler = make_inspect(engine, max_prompt_tokens)
    outputs = [note, heat, pages, bits]
    show.click(handler, inputs, outputs, api_name="inspect", concurrency_id="inspect")
    for w in (layer, head):
        w.release(handler, inputs, outputs, api_name=False, concurrency_id="inspect")
    method.input(handler, inputs, outputs, api_name=False, concurrency_id="inspect")


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
        with gr.Tab("Inside the cache"):
            build_inside_tab(engine, max_prompt_tokens, controls)
    demo.queue(default_concurrency_limit=concurrency, max_size=QUEUE_MAX_SIZE)
    return demo


ARGS = parse_args(None if __name__ == "__main__" else [])  # flags only when run as a script; env otherwise
demo = build_demo(get_engine(ARGS.model), ARGS.max_prompt_tokens, ARGS.concurrency, ARGS.schedule)

if __name__ == "__main__":
    torch.set_num_threads(ARGS.torch_threads)  # here only: importing app (tests) leaves torch's setting alone
    demo.launch(server_name=ARGS.host, server_port=ARGS.port, share=ARGS.share, **LAUNCH_STYLE)
