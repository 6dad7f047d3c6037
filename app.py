"""Kitty's Gradio demo: FP16 vs KIVI vs Kitty KV caches streaming side by side, with live KV-memory readouts.

    python app.py [--model NAME] [--host 127.0.0.1] [--port 7860] [--share]     (or: make demo)

The model loads once, when this module is imported (the default embedded SmolLM2-135M-Instruct, or ``--model`` /
``$KITTY_MODEL``). Every request builds its own caches and frees them when it ends or is stopped. This file only
lays out widgets and formats results (readouts, the summary table, byte sizes); the streaming of several caches
lives in :mod:`kitty.tools.demo`, prompts in :mod:`kitty.tools.prompts`, the key inspector in
:func:`kitty.core.quant.inspect_keys`.
"""

from __future__ import annotations

import os

# Before torch loads: idle OpenMP workers sleep instead of spinning; spinning threads starve the decoding ones
# on a small shared CPU (measured: 2-thread interleaved decoding fell from ~7 to ~0.3 tok/s per column).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import gradio as gr  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from kitty import PRESETS, get_preset  # noqa: E402
from kitty.core.quant import inspect_keys  # noqa: E402
from kitty.hf.generate import Sampling, prompt_keys, prompt_query_scale  # noqa: E402
from kitty.tools import demo as kd  # noqa: E402
from kitty.tools import prompts as kp  # noqa: E402
from kitty.tools.demo_figures import heatmap_figure, memory_figure, summary_figure  # noqa: E402
from kitty.tools.demo_view import (  # noqa: E402
    COLUMN_COLORS,
    answer_mark,
    attention_note,
    bits_table,
    cost_line,
    format_readout,
    method_intro,
    preset_info,
    reference_column,
    summarize,
    text_html,
    verdict,
    with_knobs,
)

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

CSS = """
.readout {font-size: 0.9em; line-height: 1.35; padding: 0 4px;}
.readout table {width: 100%; border-collapse: collapse; margin: 0;}
.readout td {padding: 3px 6px; border: none; border-bottom: 1px solid var(--border-color-primary);
  vertical-align: top; overflow-wrap: anywhere;}
.readout td:first-child {white-space: nowrap; width: 1%; color: var(--body-text-color-subdued);}
#note {min-height: 1.5em;}
.readout .headline {font-size: 1.7em; margin: 4px 0 0 0;}
.readout .sub {margin: 0 0 4px 0; color: var(--body-text-color-subdued);}
.readout .pagenote {color: #b45309; font-weight: 600;}
.gen {white-space: pre-wrap; overflow-wrap: anywhere; min-height: 7em; max-height: 16em; overflow-y: auto;
  padding: 6px 10px; line-height: 1.4; background: var(--block-background-fill); border-radius: 4px;}
.gen mark.diverged {color: inherit; text-decoration: underline wavy #b91c1c;}
.verdict {list-style: none; padding: 0; margin: 2px 0;}
.verdict li {padding: 3px 10px; margin: 3px 0; font-size: 1.1em; line-height: 1.35;}
.verdict .right {color: #15803d; font-weight: 700;}
.verdict .wrong {color: #b91c1c; font-weight: 700;}
#summary table {display: block; overflow-x: auto; max-width: 100%;}
#summary th {white-space: nowrap;}
#summary td {min-width: 4.5em;}
#inside-pages th, #inside-bits th {white-space: normal; word-break: normal; overflow-wrap: normal; min-width: 5.5em;}
#memory-plot, #summary-plot, #inside-heatmap {overflow-x: auto;}
@media (max-width: 700px) {
  #memory-plot img, #summary-plot img, #inside-heatmap img {min-width: 620px;}
  .verdict li {font-size: 1em;}
}
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
        boost_fraction: float | None = None,
        sink: float | None = None,
        window: float | None = None,
    ) -> Iterator[tuple]:
        stop = kd.StopFlag()
        idle = (gr.update(interactive=True), gr.update(interactive=False))
        busy = (gr.update(interactive=False), gr.update(interactive=True))

        def message(note: str) -> tuple:
            return (note, "", "", "", "", "", "", gr.skip(), "", {}, None, "", None, *idle)

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
            methods = apply_knobs(methods, boost_fraction, sink, window)
        except (ValueError, TypeError, OverflowError) as e:  # PromptError included: a message, never a crash
            yield message(str(e) if isinstance(e, kp.PromptError) else f"⚠️ {e}")
            return
        template = " (chat template)" if chat_template else ""
        head = f"Prompt: {prompt_.tokens} tokens{template}, up to {n} new tokens per column."
        note = head + (f"\n\n{prompt_.note}" if prompt_.note else "")
        key = answer_keys().get(prompt) if not chat_template else None
        if key is not None:
            note += f"\n\nThe answer is checked in each column: the right one is **{key}**."
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
                answers = [answer_mark(c.text, key, lambda t: kd.gives_key(t, key)) for c in cols] if key else ()
                shown = STOPPING if stop.is_set() and not final else note  # Stop's message stays until the end
                yield (
                    shown,
                    *(text_html(c, ref, engine.tokenizer, COLUMN_COLORS[i]) for i, c in enumerate(cols)),
                    *(
                        format_readout(c, engine.head_dim, ref, engine.tokenizer, COLUMN_COLORS[i])
                        for i, c in enumerate(cols)
                    ),
                    plot,
                    summarize(cols, engine.tokenizer, snap.phase == "stopped", engine.head_dim)
                    if final
                    else f"_{snap.phase}…_",
                    {c.label: (c.readout.as_dict() | {"text": c.text}) if c.readout else None for c in cols}
                    if final
                    else gr.skip(),
                    None if final else stop,  # a finished run has nothing left to stop
                    verdict(cols, answers),
                    summary_figure(cols) if final else None,
                    *(idle if final else busy),
                )
        except Exception as e:  # shown in the UI, buttons re-enabled; the generator's finally freed the caches
            yield message(f"⚠️ Generation failed: {type(e).__name__}: {e}")

    return generate


def apply_knobs(methods: list[str], boost_fraction, sink, window) -> list[str]:
    """The columns' methods with the advanced controls applied (:func:`kitty.tools.demo_view.with_knobs`); ``None``
    knobs (an API call without them) leave the presets as they are."""
    if boost_fraction is None and sink is None and window is None:
        return methods
    out = []
    for m in methods:
        cfg = get_preset(m)
        b = cfg.boost_fraction if boost_fraction is None else parse_number("boost fraction", boost_fraction, 0, 1)
        s = cfg.sink_tokens if sink is None else parse_whole("sink", sink, 0, 512)
        w = cfg.local_window if window is None else parse_whole("local window", window, 0, 512)
        out.append(with_knobs(m, b, s, w))
    return out


def memory_cost(engine: Engine, max_prompt_tokens: int):
    """The handler of the memory line above the columns: each column's stored bytes at the prompt's length plus
    max new tokens, before Generate (the analytic model, :func:`kitty.tools.demo_view.cost_line`)."""

    def cost(prompt, chat, max_new, method_1, method_2, method_3, boost_fraction, sink, window) -> str:
        try:
            check_text(prompt)
            prompt_ = kp.prepare_prompt(engine.tokenizer, prompt, bool(chat), max_prompt_tokens)
            n = parse_whole("max_new_tokens", max_new, 1, kd.MAX_NEW_TOKENS_CAP)
            methods = apply_knobs([method_1, method_2, method_3], boost_fraction, sink, window)
            return cost_line(methods, prompt_.tokens + n - 1, engine)
        except (ValueError, TypeError) as e:
            return f"_{e}_"

    return cost


STOPPING = "Stopping… (caches are freed after the current step)"


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
    return STOPPING


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
    show 16 bits/element in every column. The second is the measured example (:data:`kitty.tools.demo.EXAMPLE_NEEDLE`):
    a number in a long document that 2-bit KIVI gets wrong and Kitty and fp16 get right (docs/DEMO.md)."""
    short, doc, passkey = kp.example_prompts()
    return [
        ("Long document + question (essay excerpt)", doc[0], doc[1], kd.DEFAULT_MAX_NEW_TOKENS),
        ("Long document: a number 2-bit KIVI gets wrong", kd.EXAMPLE_NEEDLE.prompt(), False, 12),
        ("Short chat question", *short),
        ("Passkey in a haystack (plain)", *passkey),
    ]


@functools.lru_cache(maxsize=1)
def answer_keys() -> dict[str, int]:
    """The examples whose answer is a number the app checks in each column (:func:`kitty.tools.demo.gives_key`)."""
    keys = {kd.EXAMPLE_NEEDLE.prompt(): kd.EXAMPLE_NEEDLE.key}
    for _, prompt, _, _ in examples():
        found = re.search(r"The pass key is (\d+)\.", prompt)
        if found and prompt not in keys:
            keys[prompt] = int(found.group(1))
    return keys


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
            with gr.Accordion("Advanced: boost, sink, window", open=False, elem_id="advanced"):
                kitty = PRESETS["kitty"]
                c["boost"] = gr.Slider(
                    0.0,
                    0.5,
                    value=kitty.boost_fraction,
                    step=1 / 64,
                    label="Boost fraction: key channels at 4 bits per page (boosting presets)",
                    elem_id="boost",
                )
                c["sink"] = gr.Slider(
                    0,
                    128,
                    value=kitty.sink_tokens,
                    step=8,
                    label="Sink tokens (every quantizing column)",
                    elem_id="sink",
                )
                c["window"] = gr.Slider(
                    0, 256, value=kitty.local_window, step=16, label="Local window (every quantizing column)"
                )
            with gr.Accordion("Sampling", open=False):
                c["temperature"] = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                c["top_p"] = gr.Slider(0.05, 1.0, value=0.95, step=0.05, label="Top-p")
                c["seed"] = gr.Number(value=0, precision=0, label="Seed (same in every column)")
            with gr.Row():
                c["generate"] = gr.Button("Generate", variant="primary", elem_id="generate")
                c["stop"] = gr.Button("Stop", variant="stop", interactive=False, elem_id="stop")
    c["note"] = gr.Markdown(elem_id="note")
    c["verdict"] = gr.HTML("", elem_id="verdict")  # after a run: one line per column, the first thing in view
    return c


def build_columns() -> dict:
    """Three columns: method dropdown, streamed text, live readout."""
    c: dict = {"methods": [], "outputs": [], "readouts": []}
    with gr.Row(equal_height=False):
        for i, default in enumerate(kd.DEFAULT_METHODS):
            with gr.Column(min_width=280):
                c["methods"].append(
                    gr.Dropdown(
                        METHODS,
                        value=default,
                        label=f"Column {i + 1}: cache method",
                        info=preset_info(default),
                        elem_id=f"method-{i}",
                    )
                )
                # the text as HTML: from the first token that differs from the fp16 column on, it is marked
                c["outputs"].append(gr.HTML("<div class='gen'></div>", elem_id=f"out-{i}"))
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
    c["cost"] = gr.Markdown(elem_id="cost")
    c.update(build_columns())
    c["summary_plot"] = gr.Plot(None, show_label=False, elem_id="summary-plot")  # summary_figure, at the end
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
        c["verdict"],
        c["summary_plot"],
        c["generate"],
        c["stop"],
    ]
    knobs = [c["boost"], c["sink"], c["window"]]
    inputs = [c["prompt"], c["chat"], c["max_new"], c["temperature"], c["top_p"], c["seed"], *c["methods"], *knobs]
    handler = make_generate(engine, max_prompt_tokens, schedule)
    # one concurrency group: the button and Enter in the prompt box share the limit set in demo.queue()
    c["generate"].click(handler, inputs, outputs, api_name="generate", concurrency_id="generate")
    c["prompt"].submit(handler, inputs, outputs, api_name=False, concurrency_id="generate")
    c["stop"].click(stop_generation, [c["state"]], [c["note"]], api_name="stop", concurrency_limit=None)
    for dropdown in c["methods"]:
        dropdown.change(lambda m: gr.update(info=preset_info(m)), dropdown, dropdown, api_name=False, queue=False)
    cost_inputs = [c["prompt"], c["chat"], c["max_new"], *c["methods"], *knobs]
    cost = memory_cost(engine, max_prompt_tokens)
    c["cost"].value = cost(*(w.value for w in cost_inputs))
    for w in cost_inputs:
        w.change(cost, cost_inputs, c["cost"], api_name=False, queue=False, show_progress="hidden")
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
            "`fp16` keeps everything; `kivi-k2v2-sink` stores 2-bit keys and values with the same 32-token sink and "
            "windows as `kitty`, which also boosts each key page's largest channels to 4 bits "
            "([arXiv 2511.18643](https://arxiv.org/abs/2511.18643)): columns 2 and 3 differ by the boost alone."
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
