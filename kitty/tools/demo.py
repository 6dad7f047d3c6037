"""Side-by-side streaming of several caches: the demo's model logic, free of any UI.

:func:`stream_side_by_side` gives each method (preset name) its own fresh cache and sampling generator, advances
the columns (one thread each, or interleaved in the calling thread) and yields a :class:`Snapshot` (texts and
readouts) as they step, so every column streams and Stop acts within one step. One column is :func:`run_column`,
a generator over :func:`kitty.hf.generate.stream_tokens` (or, on CUDA, the captured static step of
:func:`kitty.hf.generate.decode_chunks`) that times its steps and reads the cache whenever tokens arrive.
``app.py`` lays out widgets and formats what these return; ``benchmarks/demo_timing.py`` times the schedules.

Why not batch the caches into one forward: the columns use different cache objects (different quantizers) and a
transformers forward takes one cache. Stepping single rows also gives per-column readouts and timing for free.
Measured numbers are in the README's demo section.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..core.config import get_preset
from ..core.memory import MemoryReport
from ..hf.generate import DECODE_PATHS, Sampling, decode_chunks, decode_path, eos_ids, make_cache, stream_tokens
from .prompts import PreparedPrompt, shipped_text

# The three columns: the reference, the fair baseline (KIVI 2-bit keys and values with kitty's own sink and windows,
# so the memory difference between columns 2 and 3 is exactly the boost's cost) and the paper's method. The app, the
# CLI's --compare and the docs use these.
DEFAULT_METHODS = ("fp16", "kivi-k2v2-sink", "kitty")
MAX_NEW_TOKENS_CAP = 256  # per column; 3 columns x 256 steps is about a minute on a 2-core CPU
DEFAULT_MAX_NEW_TOKENS = 32  # with the default prompt (~800 tokens) a first run takes ~30 s on 2 shared cores


# ------------------------------------------------------------------------------ a fact in a long document

# A fact with a number, and the question that asks for it (plain form: the prompt ends where the number comes)
NEEDLES = {
    "passkey": ("The pass key is {key}. Remember it. {key} is the pass key.", "What is the pass key? The pass key is"),
    "lighthouse": (
        "The keeper of the lighthouse wrote down one number: {key}.",
        "What number did the keeper of the lighthouse write down? The number was",
    ),
    "locker": ("Locker {key} holds the spare sails.", "Which locker holds the spare sails? The locker number is"),
}


@dataclass(frozen=True)
class NeedleDocument:
    """A shipped text with one fact (``NEEDLES[needle]`` holding ``key``) placed among its paragraphs, then the
    question for it: a long-document retrieval prompt whose answer can be checked (``str(key)`` in the answer)."""

    text: str  # one of kitty.tools.prompts.TEXTS
    first: int  # index of the first paragraph used
    paragraphs: int  # paragraphs used from there
    depth: float  # where the fact goes, as a share of those paragraphs (0: before the first)
    needle: str  # a key of NEEDLES
    key: int

    def prompt(self) -> str:
        if self.needle not in NEEDLES:
            raise ValueError(f"needle must be one of {sorted(NEEDLES)}, got {self.needle!r}")
        paras = [p.strip() for p in shipped_text(self.text).split("\n\n") if p.strip()]
        body = paras[self.first : self.first + self.paragraphs]
        if len(body) < self.paragraphs:
            raise ValueError(f"{self.text} has no {self.paragraphs} paragraphs from paragraph {self.first}")
        fact, question = NEEDLES[self.needle]
        at = round(self.depth * len(body))
        body.insert(at, fact.format(key=self.key))
        return "\n\n".join(body) + "\n\n" + question

    def answered(self, text: str) -> bool:
        """Whether a generated ``text`` gives the key (:func:`gives_key`)."""
        return gives_key(text, self.key)


def gives_key(text: str, key: int) -> bool:
    """Whether the first number in ``text`` is ``key`` (how a retrieval answer is checked)."""
    digits = "".join(ch if ch.isdigit() else " " for ch in text).split()
    return bool(digits) and digits[0] == str(key)


# The example the app shows under "Long document: a number 2-bit KIVI gets wrong": found by
# benchmarks/demo_example_search.py (kitty and fp16 give the number, kivi-k2v2-sink does not, greedy, on the default
# model), a winner of two searches run with different package versions; the search's table is in
# benchmarks/results/demo_example_search.csv.
EXAMPLE_NEEDLE = NeedleDocument("essay.txt", 11, 4, 0.67, "lighthouse", 68716)


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
    packs: list[tuple[int, str]] = field(default_factory=list)  # (cached tokens, "K"/"V"/"K+V") where a page packed


@dataclass
class Snapshot:
    """The state of every column after one step (``app.py`` formats it, e.g. ``app.summarize`` when done)."""

    phase: str  # prefill | decode | done | stopped
    prompt_tokens: int
    columns: list[Column]

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


def _packed(before: Readout | None, now: Readout) -> str:
    """Which quantized pages this step packed: ``"K"``, ``"V"``, ``"K+V"`` or ``""`` (none, or a 16-bit side)."""
    if before is None:
        return ""  # the prefill's pages were packed before the first point of the plot
    cfg = get_preset(now.method)
    sides = [
        side
        for side, key, quantized in (("K", "key_pages", cfg.quantizes_keys), ("V", "value_pages", cfg.quantizes_values))
        if quantized and now.layout[key] > before.layout[key]
    ]
    return "+".join(sides)


def _free(col: Column, status: str) -> None:
    """Take the final readout, then reset and drop the column's cache."""
    if col.cache is not None:
        if col.ids:
            col.readout = _readout(col)
        col.cache.reset()
        col.cache = None
    col.status = status


def run_column(
    model,
    tokenizer,
    col: Column,
    prompt: PreparedPrompt,
    max_new_tokens: int,
    sampling: Sampling,
    eos: set[int],
    stop: StopFlag,
    path: str = "eager",
) -> Iterator[Column]:
    """One column's generation as a generator: prefill, then decode; yields whenever new tokens reached the host.

    ``path="eager"``: :func:`kitty.hf.generate.stream_tokens` on ``col.cache``, one decode step (and one yield) per
    token. ``"captured"``: :func:`kitty.hf.generate.decode_chunks` builds a static cache (``col.cache``) and replays
    one captured decode step per token, its tokens arriving every few steps; each such chunk is one yield, one
    readout and one point of the plot, and its wall time is shared equally by its steps. Ends (after freeing the
    cache) on EOS or ``max_new_tokens``; leaves the cache to the caller when ``stop`` is set.
    """
    if stop.is_set():
        return
    col.status = "prefill"
    t0 = time.perf_counter()
    if path == "eager":
        stream = stream_tokens(model, prompt.ids, col.cache, max_new_tokens, sampling, eos, col.generator)
        chunks = ([tok] for tok in stream)
    else:
        col.cache, chunks = decode_chunks(model, prompt.ids, col.method, max_new_tokens, sampling, eos, path=path)
    for chunk in chunks:  # the first token comes from the prefill, every later one from one decode step
        now = time.perf_counter()
        decoded = chunk
        if not col.ids:
            col.prefill_s, col.decode_start = now - t0, now
            decoded = chunk[1:]
        if decoded:
            col.step_times.extend([(now - t0) / len(decoded)] * len(decoded))
        col.ids.extend(chunk)
        col.last_token_at = now
        col.text = tokenizer.decode(col.ids, skip_special_tokens=True)
        before = col.readout
        col.readout = _readout(col)
        col.history.append((col.readout.report.tokens, col.readout.report.stored_bytes))
        packed = _packed(before, col.readout)
        if packed:
            col.packs.append((col.readout.report.tokens, packed))
        if chunk[-1] in eos:
            _free(col, "done (eos)")
        elif len(col.ids) >= max_new_tokens:
            _free(col, "done (max tokens)")
        else:
            col.status = "decoding"
        yield col
        if col.status != "decoding" or stop.is_set():
            chunks.close()
            return
        t0 = time.perf_counter()


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

    workers = [
        threading.Thread(target=work, args=(r,), daemon=True, name=f"kitty-column-{i}") for i, r in enumerate(runs)
    ]
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
    path: str | None = None,
) -> Iterator[Snapshot]:
    """Generate with one fresh cache per method and yield a :class:`Snapshot` as the columns advance.

    ``schedule="threads"``: each column decodes in its own thread (fastest on a 2-core CPU, see the README);
    ``"interleave"``: one step per column in turn in the calling thread. Either way each column gets its own cache
    (``cache_factory(model, cfg)``, default :func:`make_cache`) and its own sampling generator seeded with
    ``sampling.seed``, so a greedy column is exactly ``model.generate(..., **cache_kwargs(cache))``. Caches are freed
    (``reset()`` and dropped) when a column ends, when ``stop`` is set, or when the consumer closes this
    generator; the readouts taken before that stay in the snapshot.

    ``path``: how the columns decode (:func:`run_column`); ``None`` takes :func:`kitty.hf.generate.decode_path`
    (the captured static step on CUDA, the eager loop elsewhere), or ``"eager"`` when ``cache_factory`` is given.
    """
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS_CAP:
        raise ValueError(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS_CAP}], got {max_new_tokens}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if path is not None and path not in DECODE_PATHS[1:]:
        raise ValueError(f"path must be one of {DECODE_PATHS[1:]} or None, got {path!r}")
    cfgs = [get_preset(m) for m in methods]
    path = path or ("eager" if cache_factory is not None else decode_path(model))
    stop = stop or StopFlag()
    eos = eos_ids(model, tokenizer)
    factory = cache_factory or make_cache
    columns = [
        Column(
            f"{i + 1} · {cfg.name}",
            cfg.name,
            factory(model, cfg) if path == "eager" else None,  # captured: run_column builds a static cache
            torch.Generator().manual_seed(sampling.seed),
        )
        for i, cfg in enumerate(cfgs)
    ]
    snap = Snapshot("prefill", prompt.tokens, columns)
    runs = [run_column(model, tokenizer, c, prompt, max_new_tokens, sampling, eos, stop, path) for c in columns]
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
        yield snap
    finally:  # also when the UI closes this generator (client gone, error): never keep a cache alive
        steps.close()  # threads: sets stop for running workers and joins them
        for col in columns:
            if col.cache is not None:
                col.cache.reset()
                col.cache = None
