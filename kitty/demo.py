"""The demo's model logic, free of any UI: prompts, side-by-side streaming of several caches, cache inspection.

``app.py`` only lays out widgets and formats what these functions return. Read top to bottom:

1. limits and example prompts,
2. :func:`prepare_prompt` — empty/over-long prompts, chat template, truncation with a note,
3. one decode step (:func:`prefill`, :func:`decode_one_token`, :func:`sample_next`), gpt-fast style,
4. :func:`run_column` — one column as a generator (prefill, then one token per ``next()``), and
   :func:`stream_side_by_side` — runs the columns (one thread each, or interleaved) and yields a :class:`Snapshot`
   (texts + readouts) as they advance, so every column streams and Stop acts within one step,
5. :func:`inspect_keys` — the "Inside the cache" tab: post-RoPE keys of the prompt, the boosted channels of each
   page, and the key error of the page with and without the boost,
6. :func:`benchmark` — ``python -m kitty.demo`` measures tokens/s per column for each schedule.

Why not batch the three caches into one forward: the columns use different cache objects (different quantizers)
and a transformers forward takes one cache. Stepping single rows also gives per-column readouts and timing for
free. Measured numbers are in the README's demo section."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import PRESETS, KVQuantConfig, get_preset
from .memory import MemoryReport

ASSETS = Path(__file__).resolve().parent.parent / "assets"

# ------------------------------------------------------------------------------------------------- limits

DEFAULT_METHODS = ("fp16", "kivi-k2v2", "kitty")  # the three columns: reference, the baseline, the paper
MAX_NEW_TOKENS_CAP = 256  # per column; 3 columns x 256 steps is about a minute on a 2-core CPU
DEFAULT_MAX_NEW_TOKENS = 64
MAX_PROMPT_TOKENS = 2048  # longer prompts keep their last 2048 tokens: prefill stays a few seconds per column
MAX_PROMPT_CHARS = 100_000  # guard before tokenizing (about 20k tokens of English)
EMPTY_PROMPT_MESSAGE = "✋ The prompt is empty: type a question or pick an example below, then press Generate."


class PromptError(ValueError):
    """A prompt the demo refuses, with a message meant for the user."""


# ------------------------------------------------------------------------------------------------ examples


def _essay_excerpt(max_chars: int = 4500) -> str:
    """The first paragraphs of ``assets/essay.txt`` (whole paragraphs, at most ``max_chars``)."""
    paragraphs = (ASSETS / "essay.txt").read_text().split("\n\n")
    out: list[str] = []
    for p in paragraphs:
        if out and sum(len(q) + 2 for q in out) + len(p) > max_chars:
            break
        out.append(p.strip())
    return "\n\n".join(out)


def passkey_prompt(passkey: int = 68351, filler_repeats: int = 40, position: float = 0.4) -> str:
    """A passkey hidden in a haystack of filler, in plain form ending with "The pass key is" (no chat template)."""
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    at = int(filler_repeats * position)
    hay = filler * at + needle + filler * (filler_repeats - at)
    return (
        "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
        + hay
        + "\nWhat is the pass key? The pass key is"
    )


def example_prompts() -> list[tuple[str, bool, int]]:
    """``(prompt, use_chat_template, max_new_tokens)`` for the example gallery."""
    doc = _essay_excerpt()
    return [
        ("What are three simple tips for staying focused while studying?", True, 64),
        (doc + "\n\nQuestion: according to the essay, what did the first navigators carry instead of charts, "
         "and why? Answer in two sentences.", True, 64),
        (passkey_prompt(), False, 12),
    ]


# ------------------------------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class PreparedPrompt:
    """Token ids ready for prefill, and what was done to the user's text."""

    ids: torch.Tensor  # [1, T] int64
    note: str  # empty, or a visible note (e.g. truncation)

    @property
    def tokens(self) -> int:
        return self.ids.shape[-1]


def _template(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


def prepare_prompt(
    tokenizer,
    text: str | None,
    chat_template: bool = True,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
    max_prompt_chars: int = MAX_PROMPT_CHARS,
) -> PreparedPrompt:
    """Tokenize ``text`` (through the chat template if asked and available), keeping at most ``max_prompt_tokens``.

    Raises :class:`PromptError` for an empty prompt. An over-long prompt keeps its *end* (where the question is)
    and says so in ``note``.
    """
    text = (text or "").strip()
    if not text:
        raise PromptError(EMPTY_PROMPT_MESSAGE)
    notes = []
    if len(text) > max_prompt_chars:
        notes.append(f"the prompt had {len(text):,} characters; only the last {max_prompt_chars:,} were read")
        text = text[-max_prompt_chars:]
    use_template = chat_template and getattr(tokenizer, "chat_template", None)
    if chat_template and not use_template:
        notes.append("this tokenizer has no chat template, so the prompt is used as plain text")
    overhead = len(tokenizer(_template(tokenizer, ""), add_special_tokens=False).input_ids) if use_template else 0
    budget = max_prompt_tokens - overhead
    if budget < 1:
        raise PromptError(f"max_prompt_tokens={max_prompt_tokens} leaves no room after the chat template ({overhead} tokens)")
    body = tokenizer(text, add_special_tokens=False).input_ids
    if len(body) > budget:
        notes.append(f"the prompt had {len(body):,} tokens, over the cap of {budget:,}: the first "
                     f"{len(body) - budget:,} were dropped and the last {budget:,} kept")
        text = tokenizer.decode(body[-budget:])
    if use_template:
        ids = tokenizer(_template(tokenizer, text), add_special_tokens=False).input_ids
    else:
        ids = tokenizer(text).input_ids
    ids = ids[-max_prompt_tokens:]  # re-tokenizing a cut text can add a token or two
    note = ("✂️ Truncated: " + "; ".join(notes) + ".") if notes else ""
    return PreparedPrompt(torch.tensor([ids], dtype=torch.long), note)


# ----------------------------------------------------------------------------------------- one decode step


@dataclass(frozen=True)
class Sampling:
    """Greedy when ``temperature == 0`` (the default), else temperature + nucleus (top-p) sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> int:
    """Next token id from last-position ``logits`` ``[V]``."""
    if sampling.greedy:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < sampling.top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_cache(model, cfg: KVQuantConfig):
    """A fresh :class:`kitty.KittyCache` for ``model`` (one per column and request, never shared)."""
    from .cache import KittyCache

    return KittyCache(model.config, cfg)


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Run the prompt ``ids`` ``[1, T]`` through ``model`` into ``cache``; returns the last logits ``[V]``."""
    return model(ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]


@torch.no_grad()
def decode_one_token(model, cache, token_id: int) -> torch.Tensor:
    """Feed one token through ``model`` with ``cache``; returns its logits ``[V]``."""
    ids = torch.tensor([[token_id]], dtype=torch.long, device=model.device)
    return model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]


def eos_ids(model, tokenizer) -> set[int]:
    """Token ids that end a column's generation."""
    ids: set[int] = set()
    for e in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(e, int):
            ids.add(e)
        elif e is not None:
            ids.update(int(i) for i in e)
    return ids


# ----------------------------------------------------------------------------------- side-by-side streaming


@dataclass(frozen=True)
class Readout:
    """What one column's cache holds right now (from ``memory_report()`` and ``token_counts()``)."""

    method: str
    new_tokens: int  # tokens generated so far
    tokens_per_s: float  # generated tokens per wall-clock second since decoding began (what the viewer sees)
    step_ms: float  # mean time of this column's own decode steps
    report: MemoryReport
    layout: dict[str, int]  # where the cached tokens live

    @property
    def cached_tokens(self) -> int:
        return self.report.tokens

    def as_dict(self) -> dict:
        r = self.report
        return {
            "method": self.method,
            "new_tokens": self.new_tokens,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "step_ms": round(self.step_ms, 2),
            "tokens": r.tokens,
            "fp16_bytes": r.fp16_bytes,
            "payload_bytes": r.payload_bytes,
            "metadata_bytes": r.metadata_bytes,
            "full_precision_bytes": r.full_precision_bytes,
            "stored_bytes": r.stored_bytes,
            "bits_per_element": r.bits_per_element,
            "compression": r.compression,
            "layout": dict(self.layout),
        }


@dataclass
class Column:
    """One column's live state. ``cache`` is dropped (set to ``None``) once the column stops."""

    label: str  # e.g. "1 · kitty": unique even when two columns share a method
    method: str
    cache: object | None
    generator: torch.Generator
    ids: list[int] = field(default_factory=list)
    text: str = ""
    status: str = "waiting"  # waiting | prefill | decoding | done (eos) | done (max tokens) | stopped | error
    prefill_s: float = 0.0
    decode_start: float = 0.0
    last_token_at: float = 0.0
    step_times: list[float] = field(default_factory=list)
    readout: Readout | None = None
    history: list[tuple[int, int]] = field(default_factory=list)  # (cached tokens, stored bytes) after each step


@dataclass
class Snapshot:
    """Everything the UI shows, after one step."""

    phase: str  # prefill | decode | done | stopped
    prompt_tokens: int
    columns: list[Column]
    summary: str = ""

    def plot_rows(self) -> list[dict]:
        """Long-form rows for a line plot of stored KV bytes against cached tokens (series "column 1", ...)."""
        return [
            {"column": f"column {i + 1}", "tokens": t, "stored_KiB": b / 1024}
            for i, c in enumerate(self.columns)
            for t, b in c.history
        ]


class StopFlag:
    """A per-request stop signal, held in the session's ``gr.State`` and set by the Stop button."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


def _readout(col: Column) -> Readout:
    cache = col.cache
    report = cache.memory_report()
    layout = dict(cache.token_counts())
    n = len(col.ids)
    span = (col.last_token_at - col.decode_start) if n > 1 else 0.0
    tps = (n - 1) / span if span > 0 else 0.0
    step_ms = 1000 * sum(col.step_times) / len(col.step_times) if col.step_times else 0.0
    return Readout(col.method, n, tps, step_ms, report, layout)


def divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first generated token where ``other`` differs from ``reference``, ``None`` if one is a prefix."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None


def summarize(columns: Sequence[Column], tokenizer, stopped: bool) -> str:
    """A readable markdown summary: memory per column and where each left the fp16 column's tokens."""
    ref = next((c for c in columns if c.method == "fp16"), None)
    lines = ["**Stopped** — caches freed." if stopped else "**Done** — caches freed.", ""]
    lines += ["| column | tokens | KV stored | fp16-equivalent | bits/elem | compression | tok/s | vs fp16 |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
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
                vs = f"identical ({same} tokens)" if len(ref.ids) == len(c.ids) else f"identical over the {same} tokens both have"
            else:
                ctx = tokenizer.decode(ref.ids[max(0, d - 4) : d]).replace("\n", " ").replace("|", "\\|")
                vs = f"diverges at token {d + 1} (after “…{ctx}”)"
        m = r.report
        lines.append(
            f"| {c.label} | {r.new_tokens} new / {m.tokens} cached | {fmt_bytes(m.stored_bytes)} | {fmt_bytes(m.fp16_bytes)} "
            f"| {m.bits_per_element:.2f} | {m.compression:.2f}× | {r.tokens_per_s:.1f} | {vs} |"
        )
    return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}" if n < 100 else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _free(col: Column, status: str) -> None:
    """Take the final readout, then reset and drop the column's cache."""
    if col.cache is not None:
        if col.ids:
            col.readout = _readout(col)
        col.cache.reset()
        col.cache = None
    col.status = status


def run_column(model, tokenizer, col: Column, prompt: PreparedPrompt, max_new_tokens: int, sampling: Sampling,
               eos: set[int], stop: StopFlag) -> Iterator[Column]:
    """One column's generation as a generator: prefill, then one decode step per ``next()``; yields after each token.

    Ends (after freeing the cache) on EOS or ``max_new_tokens``; leaves the cache to the caller when ``stop`` is set.
    """

    def take(logits: torch.Tensor) -> None:
        tok = sample_next(logits, sampling, col.generator)
        now = time.perf_counter()
        if not col.ids:
            col.decode_start = now
        col.ids.append(tok)
        col.last_token_at = now
        col.text = tokenizer.decode(col.ids, skip_special_tokens=True)
        col.readout = _readout(col)
        col.history.append((col.readout.report.tokens, col.readout.report.stored_bytes))
        if tok in eos:
            _free(col, "done (eos)")
        elif len(col.ids) >= max_new_tokens:
            _free(col, "done (max tokens)")
        else:
            col.status = "decoding"

    if stop.is_set():
        return
    col.status = "prefill"
    t0 = time.perf_counter()
    logits = prefill(model, prompt.ids, col.cache)
    col.prefill_s = time.perf_counter() - t0
    take(logits)
    yield col
    while col.status == "decoding" and not stop.is_set():
        t0 = time.perf_counter()
        logits = decode_one_token(model, col.cache, col.ids[-1])
        col.step_times.append(time.perf_counter() - t0)
        take(logits)
        yield col


SCHEDULES = ("threads", "interleave")


def _interleave(runs: list[Iterator[Column]], stop: StopFlag) -> Iterator[Column]:
    """Round robin in the calling thread: one step of each column in turn (prefills first, in column order)."""
    active = list(runs)
    while active and not stop.is_set():
        for run in list(active):
            try:
                yield next(run)
            except StopIteration:
                active.remove(run)


def _threads(runs: list[Iterator[Column]], stop: StopFlag, min_interval: float) -> Iterator[Column]:
    """One worker thread per column; yields (at most every ``min_interval`` s) whenever some column stepped.

    torch releases the GIL inside its kernels, so with one intra-op thread the columns share both cores.
    Closing this generator sets ``stop`` and waits for the workers to finish their current step.
    """
    events: queue.Queue = queue.Queue()
    done = object()

    def work(run: Iterator[Column]) -> None:
        try:
            for col in run:
                events.put(col)
        except BaseException as e:  # re-raised in the consumer: the UI shows it
            events.put(e)
        finally:
            events.put(done)

    workers = [threading.Thread(target=work, args=(r,), daemon=True, name=f"kitty-column-{i}") for i, r in enumerate(runs)]
    for w in workers:
        w.start()
    running, last = len(workers), 0.0
    try:
        while running:
            items = [events.get()]
            wait = last + min_interval - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            while True:  # coalesce what arrived meanwhile into one update
                try:
                    items.append(events.get_nowait())
                except queue.Empty:
                    break
            running -= sum(it is done for it in items)
            for it in items:
                if isinstance(it, BaseException):
                    raise it
            stepped = [it for it in items if isinstance(it, Column)]
            if stepped:
                last = time.perf_counter()
                yield stepped[-1]
    finally:
        stop.set() if running else None
        for w in workers:
            w.join()


def stream_side_by_side(
    model,
    tokenizer,
    prompt: PreparedPrompt,
    methods: Sequence[str] = DEFAULT_METHODS,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    sampling: Sampling = Sampling(),
    stop: StopFlag | None = None,
    cache_factory=None,
    schedule: str = "threads",
    min_interval: float = 0.05,
) -> Iterator[Snapshot]:
    """Generate with one fresh cache per method and yield a :class:`Snapshot` as the columns advance.

    ``schedule="threads"``: each column decodes in its own thread (fastest on a 2-core CPU, see the README);
    ``"interleave"``: one step per column in turn in the calling thread. Either way each column gets its own cache
    (``cache_factory(model, cfg)``, default :func:`make_cache`) and its own sampling generator seeded with
    ``sampling.seed``, so a greedy column is exactly ``model.generate(..., cache=cache)``. Caches are freed
    (``reset()`` and dropped) when a column ends, when ``stop`` is set, or when the consumer closes this
    generator; the readouts taken before that stay in the snapshot.
    """
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS_CAP:
        raise ValueError(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS_CAP}], got {max_new_tokens}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    cfgs = [get_preset(m) for m in methods]
    stop = stop or StopFlag()
    eos = eos_ids(model, tokenizer)
    factory = cache_factory or make_cache
    columns = [
        Column(f"{i + 1} · {cfg.name}", cfg.name, factory(model, cfg), torch.Generator().manual_seed(sampling.seed))
        for i, cfg in enumerate(cfgs)
    ]
    snap = Snapshot("prefill", prompt.tokens, columns)
    runs = [run_column(model, tokenizer, c, prompt, max_new_tokens, sampling, eos, stop) for c in columns]
    steps = _threads(runs, stop, min_interval) if schedule == "threads" else _interleave(runs, stop)
    try:
        yield snap
        for _ in steps:
            snap.phase = "prefill" if any(c.status in ("waiting", "prefill") for c in columns) else "decode"
            yield snap
        stopped = stop.is_set()
        for col in columns:
            _free(col, "stopped" if stopped and col.status in ("waiting", "prefill", "decoding") else col.status)
        snap.phase = "stopped" if stopped else "done"
        snap.summary = summarize(columns, tokenizer, stopped)
        yield snap
    finally:  # also when the UI closes this generator (client gone, error): never keep a cache alive
        steps.close()  # threads: sets stop for running workers and joins them
        for col in columns:
            if col.cache is not None:
                col.cache.reset()
                col.cache = None


# ------------------------------------------------------------------------------------------ inside the cache


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
    """Post-RoPE keys of one layer and KV head for the prompt, and how ``cfg`` would store them."""

    method: str
    layer: int
    head: int
    abs_keys: torch.Tensor  # [T, D] fp32 |K|
    sink: int  # tokens [0, sink) stay in full precision
    pages: list[PageInspection]
    group_size: int


@torch.no_grad()
def prompt_keys(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Post-RoPE keys of every layer for ``ids`` ``[1, T]``: a list of ``[Hkv, T, D]``, read from a DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
    return [layer.keys[0].detach().cpu() for layer in cache.layers]  # each (Hkv, T, D)


@torch.no_grad()
def prompt_query_scale(model, ids: torch.Tensor, cfg: KVQuantConfig, layer: int, head: int) -> torch.Tensor | None:
    """The per-channel query magnitude ``[D]`` a ``KittyCache`` under ``cfg`` ranks channels of ``layer``/``head`` by
    after the prompt ``ids`` ``[1, T]`` (``None`` unless ``channel_selection`` is ``"query"`` or ``"oracle"``)."""
    from .cache import QUERY_SELECTIONS, KittyCache

    if cfg.channel_selection not in QUERY_SELECTIONS:
        return None
    cache = KittyCache(model.config, cfg)
    model(ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
    return cache.layers[layer].query_scale()[0, head].cpu()


def inspect_keys(keys: torch.Tensor, cfg: KVQuantConfig, layer: int = 0, head: int = 0, query_scale: torch.Tensor | None = None) -> KeyInspection:
    """Boosted channels and key error of every page of ``keys`` ``[T, D]`` (one layer, one KV head) under ``cfg``.

    Follows the cache layout: the first ``sink_tokens`` stay full precision, then pages of ``group_size`` tokens;
    the trailing partial group (the qbuffer) is shown with the channels it would boost if quantized now.
    ``query_scale`` ``[D]``: for query-aware selections (:func:`prompt_query_scale`). A ``boost_profile`` is
    applied for ``layer``.
    """
    from .quant import channel_importance, dequantize_key_page, quantize_key_page, select_boosted

    if cfg.key_bits != 2:
        raise ValueError(f"pick a method with 2-bit keys to see boosted channels, got {cfg.name} (key_bits={cfg.key_bits})")
    cfg = cfg.for_layer(layer)
    T, D = keys.shape
    S, G = min(cfg.sink_tokens, T), cfg.group_size
    nb = cfg.num_boosted(D)
    plain = cfg.with_(boost_fraction=0.0, channel_selection="magnitude")
    pages = []
    for start in range(S, T, G):
        end = min(start + G, T)
        chunk = keys[start:end]
        usable = (end - start) // 4 * 4  # pages need a multiple of 4 tokens; the qbuffer may not have one
        if usable == 0:
            continue
        chunk = chunk[:usable]
        mask = select_boosted(channel_importance(chunk, cfg, salt=layer, query_scale=query_scale), nb)
        ref = chunk.float()
        errs = []
        for c, m in ((cfg, mask), (plain, None)):
            deq = dequantize_key_page(quantize_key_page(chunk, c, salt=layer, boost_mask=m)).float()
            errs.append(float((deq - ref).norm() / ref.norm().clamp_min(1e-12)))
        pages.append(PageInspection(start, end, end - start == G, mask.nonzero().flatten().tolist(), errs[0], errs[1]))
    return KeyInspection(cfg.name, layer, head, keys.float().abs(), S, pages, G)


def all_methods() -> list[str]:
    """Preset names in the order they are declared."""
    return list(PRESETS)


# ----------------------------------------------------------------------------------------------- benchmark


def benchmark(model, tokenizer, prompt: str, new_tokens: int = 32, repeats: int = 3,
              threads: Sequence[int] = (1, 2), methods: Sequence[str] = DEFAULT_METHODS) -> list[dict]:
    """Per-column decode tokens/s of each schedule x torch thread count, repeats interleaved (load drifts).

    Each row: schedule, torch threads, repeat, the slowest and mean column tokens/s and the prefill seconds.
    """
    from tqdm.auto import tqdm

    p = prepare_prompt(tokenizer, prompt, True)
    rows = []
    saved = torch.get_num_threads()
    runs = tqdm(total=repeats * len(SCHEDULES) * len(threads), desc="demo benchmark", unit="run")
    try:
        for rep in range(repeats):
            for schedule in SCHEDULES:
                for n in threads:
                    runs.set_postfix_str(f"{schedule}, {n} torch threads")
                    torch.set_num_threads(n)
                    t0 = time.perf_counter()
                    for snap in stream_side_by_side(model, tokenizer, p, methods, new_tokens, Sampling(), schedule=schedule):
                        pass
                    rates = [c.readout.tokens_per_s for c in snap.columns]
                    rows.append({"schedule": schedule, "torch_threads": n, "repeat": rep,
                                 "min_tok_s": min(rates), "mean_tok_s": sum(rates) / len(rates),
                                 "prefill_s": max(c.prefill_s for c in snap.columns),
                                 "wall_s": time.perf_counter() - t0, "new_tokens": min(len(c.ids) for c in snap.columns)})
                    runs.update()
    finally:
        runs.close()
        torch.set_num_threads(saved)
    return rows


def _main(argv: list[str] | None = None) -> None:
    import argparse
    import os
    import statistics

    from .models import load_model

    ap = argparse.ArgumentParser(description="Measure the demo's per-column tokens/s for each schedule.")
    ap.add_argument("--model", default=os.environ.get("KITTY_MODEL") or None)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", default=example_prompts()[0][0])
    a = ap.parse_args(argv)
    model, tok = load_model(a.model)
    torch.set_grad_enabled(False)
    rows = benchmark(model, tok, a.prompt, a.new_tokens, a.repeats)
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, load average {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} CPUs, {a.new_tokens} new tokens per column, median of {a.repeats}")
    print("| schedule | torch threads | slowest column tok/s | mean column tok/s | prefill s |\n|---|---:|---:|---:|---:|")
    for schedule in SCHEDULES:
        for n in sorted({r["torch_threads"] for r in rows}):
            sel = [r for r in rows if r["schedule"] == schedule and r["torch_threads"] == n]
            med = {k: statistics.median(r[k] for r in sel) for k in ("min_tok_s", "mean_tok_s", "prefill_s")}
            print(f"| {schedule} | {n} | {med['min_tok_s']:.1f} | {med['mean_tok_s']:.1f} | {med['prefill_s']:.2f} |")


if __name__ == "__main__":
    _main()
