"""The Gradio demo, driven over HTTP with ``gradio_client`` as a user's browser would, plus its streaming logic.

The app is launched in-process once for the test session (``demo_url`` in conftest) (the model loads once, at
import of ``app``). Expected values come from the library itself: a :class:`kitty.KittyCache` of the same preset run through ``model.generate`` on the
same prompt, greedy, for the same number of tokens.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402

from kitty import PRESETS, get_preset  # noqa: E402
from kitty.core.quant import inspect_keys  # noqa: E402
from kitty.hf.compat import cache_kwargs  # noqa: E402
from kitty.hf.generate import Sampling, make_cache, prompt_keys, prompt_query_scale  # noqa: E402
from kitty.tools import demo as kd  # noqa: E402
from kitty.tools import demo_figures as dfig
from kitty.tools import demo_view as dv  # noqa: E402
from kitty.tools import prompts as kp  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SHORT = "What is the capital of France?"
OTHER = "Name two colors of the rainbow."
STORY = "Write a long story about a cat who learns to sail."  # runs far past the moment Stop is pressed
NEW = 6  # small: each generation is 3 columns x NEW decode steps on a 2-core CPU
METHODS = list(kd.DEFAULT_METHODS)


@pytest.fixture(scope="module")
def app_module():
    import app

    return app


@pytest.fixture(scope="module")
def client(app_module, demo_url):
    from gradio_client import Client

    return Client(demo_url, verbose=False)


def args(prompt: str, new: int = NEW, chat: bool = True, methods=METHODS) -> tuple:
    """Positional inputs of the /generate endpoint: greedy sampling, seed 0, the advanced knobs at kitty's values."""
    kitty = PRESETS["kitty"]
    return (prompt, chat, new, 0.0, 1.0, 0, *methods, kitty.boost_fraction, kitty.sink_tokens, kitty.local_window)


def plain(html_text: str) -> str:
    """A column's generated text from its HTML (tags stripped, entities decoded)."""
    import html
    import re

    return html.unescape(re.sub(r"<[^>]+>", "", html_text or ""))


def library_run(engine, prompt: str, method: str, new: int):
    """The same preset run through the library: ``model.generate`` with a fresh KittyCache, greedy."""
    from kitty.cache import KittyCache

    tok, model = engine.tokenizer, engine.model
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    cache = KittyCache(model.config, PRESETS[method])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), max_new_tokens=new, do_sample=False
        )
    new_ids = out[0, ids.shape[1] :]
    return tok.decode(new_ids, skip_special_tokens=True), cache.memory_report(), cache.token_counts(), ids.shape[1]


# Output tuple of /generate (see app.build_generate_tab): note, 3 texts (HTML), 3 readouts, plot, summary, json,
# verdict, summary plot, buttons (the client leaves out the state that the handler yields after json).
NOTE, TEXTS, READOUTS, PLOT, SUMMARY, JSON, VERDICT = 0, slice(1, 4), slice(4, 7), 7, 8, 9, 10


def check_against_library(engine, final, prompt: str, new: int) -> None:
    from kitty.tools.demo_view import fmt_bytes

    readouts = final[JSON]
    texts = [plain(t) for t in final[TEXTS]]
    assert len(readouts) == 3
    for i, (label, got) in enumerate(readouts.items()):
        method = got["method"]
        assert label == f"{i + 1} · {method}"
        text, report, counts, prompt_tokens = library_run(engine, prompt, method, new)
        assert texts[i] == text, f"{method}: app text {texts[i]!r} != library {text!r}"
        assert got["new_tokens"] >= 1
        assert got["tokens"] == report.tokens == prompt_tokens + got["new_tokens"] - 1
        for k in ("fp16_bytes", "payload_bytes", "metadata_bytes", "full_precision_bytes", "stored_bytes"):
            assert got[k] == getattr(report, k), (method, k)
        assert got["bits_per_element"] == pytest.approx(report.bits_per_element)
        assert got["compression"] == pytest.approx(report.compression)
        assert got["layout"] == counts
        # the readout under the column shows the same numbers, one headline figure first
        md = final[READOUTS][i]
        assert f"<div class='headline'><b>{report.bits_per_element:.2f}</b> bits/element</div>" in md
        assert f"{report.tokens} tokens ({got['new_tokens']} new)" in md
        if method == "fp16":
            assert "all full precision" in md and "qbuffer" not in md
        else:
            assert f"{fmt_bytes(report.stored_bytes)} of {fmt_bytes(report.fp16_bytes)}" in md
            assert f"qbuffer {counts['key_qbuffer']}" in md and f"local {counts['local']}" in md
            assert "long context" in md and "(pages alone)" in md


def test_streams_all_three_columns_and_matches_library(app_module, client):
    job = client.submit(*args(SHORT), api_name="/generate")
    outputs = list(job)  # every streamed update, in order
    final = job.outputs()[-1]
    assert "Done" in final[SUMMARY] and "reference" in final[SUMMARY]
    for i in range(3):
        texts = [plain(o[TEXTS][i]) for o in outputs if plain(o[TEXTS][i])]
        assert len(set(texts)) >= 2, f"column {i} did not stream: {texts}"
        assert all(plain(final[TEXTS][i]).startswith(t) or t in plain(final[TEXTS][i]) for t in texts)
        readouts = {o[READOUTS][i] for o in outputs if "cached" in o[READOUTS][i]}
        assert len(readouts) >= 2, f"column {i} readout never updated while streaming"
    # columns stream together: some update shows all three with text before the last one finished
    assert any(all(map(plain, o[TEXTS])) and "Done" not in (o[SUMMARY] or "") for o in outputs)
    # the verdict: one line per column, "N× smaller than fp16, agrees for K tokens / M%"
    assert final[VERDICT].count("<li") == 3 and "as large as fp16 so far (no page yet" in final[VERDICT]
    assert "agrees for" in final[VERDICT] and "agreement" in final[READOUTS][2]
    assert final[PLOT] is not None and final[PLOT]["type"] == "matplotlib"  # the memory figure, drawn at the end
    check_against_library(app_module.get_engine(app_module.ARGS.model), final, SHORT, NEW)


def test_empty_prompt_gives_friendly_message(client):
    for prompt in ("", "   \n "):
        out = client.predict(*args(prompt), api_name="/generate")
        assert out[NOTE] == kp.EMPTY_PROMPT_MESSAGE
        assert [plain(t) for t in out[TEXTS]] == ["", "", ""]
    _, note, heat, pages, _ = client.predict("", True, "kitty", 0, 0, 8, api_name="/inspect")
    assert note == kp.EMPTY_PROMPT_MESSAGE and heat is None


def test_over_long_prompt_is_truncated_with_a_visible_note(app_module, client):
    text = kp.shipped_text("essay.txt") + "\n\nQuestion: what is this essay about?"
    out = client.predict(*args(text, new=1), api_name="/generate")
    cap = app_module.ARGS.max_prompt_tokens
    assert "Truncated" in out[NOTE] and f"Prompt: {cap} tokens" in out[NOTE]
    assert all(r["tokens"] == cap for r in out[JSON].values())  # 1 new token: the cache holds the prompt only


def test_two_concurrent_requests_are_independent(app_module, client):
    from gradio_client import Client

    other = Client(client.src, verbose=False)  # a second user: its own session
    runs = [(client, SHORT, 5), (other, OTHER, 7)]
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * 2
    results: list = [None] * 2

    def drive(k: int) -> None:
        c, prompt, new = runs[k]
        job = c.submit(*args(prompt, new), api_name="/generate")
        start = None
        for _ in job:
            start = start or time.perf_counter()
        spans[k] = (start, time.perf_counter())
        results[k] = job.outputs()[-1]

    threads = [threading.Thread(target=drive, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert all(r is not None for r in results)
    (a0, a1), (b0, b1) = spans
    assert a0 < b1 and b0 < a1, "the two requests did not run at the same time"
    engine = app_module.get_engine(app_module.ARGS.model)
    for (_, prompt, new), final in zip(runs, results):
        check_against_library(engine, final, prompt, new)
    assert app_module.get_engine.cache_info().misses == 1, "the model was loaded more than once"


def test_stop_ends_generation_and_reports(client):
    job = client.submit(*args(STORY, new=kd.MAX_NEW_TOKENS_CAP), api_name="/generate")
    deadline = time.time() + 120
    while time.time() < deadline:
        outs = job.outputs()
        if outs and all(map(plain, outs[-1][TEXTS])):
            break
        time.sleep(0.05)
    seen = len(job.outputs())
    msg = client.predict(api_name="/stop")
    assert "Stopping" in msg
    job.result(timeout=60)
    final = job.outputs()[-1]
    assert "Stopped" in final[SUMMARY]
    # the generator keeps Stop's message up until the run ends: once an update shows it, no later one writes over
    # it (updates already in flight when Stop was clicked may still show the old note: how many depends on the load)
    after = [o[NOTE] for o in job.outputs()[seen:-1]]
    first = next((i for i, n in enumerate(after) if "Stopping" in n), len(after))
    assert all("Stopping" in n for n in after[first:]), after
    assert all(r["new_tokens"] < kd.MAX_NEW_TOKENS_CAP for r in final[JSON].values())


def test_inside_the_cache_marks_boosted_channels(app_module, client):
    prompt = kp.example_prompts()[1][0]  # the long document: several full pages
    layer, head = 3, 1
    intro, note, heat, pages, bits = client.predict(prompt, True, "kitty", layer, head, 8, api_name="/inspect")
    assert heat is not None and "page" in note and "largest mean |K|" in intro
    assert "attention" in note  # the line from key error to attention error
    engine = app_module.get_engine(app_module.ARGS.model)
    # independent check: top mean-|K| channels of each full page, from a DynamicCache run of the same prompt
    ids = kp.prepare_prompt(engine.tokenizer, prompt, True).ids
    keys = prompt_keys(engine.model, ids)[layer][head].float()  # (T, D)
    cfg = PRESETS["kitty"]
    S, G, nb = cfg.sink_tokens, cfg.group_size, cfg.num_boosted(keys.shape[-1])
    rows = pages["data"]
    full = [r for r in rows if r[0].startswith("page")]
    assert len(full) == (keys.shape[0] - S) // G >= 2
    for j, row in enumerate(full):
        page = keys[S + j * G : S + (j + 1) * G]
        expected = sorted(page.abs().mean(0).topk(nb).indices.tolist())
        assert [int(c) for c in row[2].split(", ")] == expected
        assert row[3] < row[4], "boosting the largest channels should lower this page's key error"
    methods = [r[0] for r in bits["data"]]
    assert methods == list(PRESETS)


@pytest.mark.parametrize("schedule", kd.SCHEDULES)
def test_stop_frees_every_cache(app_module, schedule):
    """Logic level: after Stop, every cache the run created is reset and released, readouts kept."""
    engine = app_module.get_engine(app_module.ARGS.model)
    made = []

    def factory(model, cfg):
        cache = make_cache(model, cfg)
        made.append(cache)
        return cache

    stop = kd.StopFlag()
    prompt = kp.prepare_prompt(engine.tokenizer, STORY, True)
    gen = kd.stream_side_by_side(
        engine.model, engine.tokenizer, prompt, METHODS, 50, Sampling(), stop, factory, schedule
    )
    for snap in gen:
        if snap.phase == "decode" and all(len(c.ids) >= 2 for c in snap.columns):
            assert all(c.get_seq_length() > 0 for c in made)
            stop.set()
    assert snap.phase == "stopped" and "Stopped" in dv.summarize(snap.columns, engine.tokenizer, True)
    assert len(made) == 3 and all(c.get_seq_length() == 0 for c in made)
    assert all(c.cache is None and c.readout is not None for c in snap.columns)


def test_cancelled_request_stops_workers_and_frees_caches(client, monkeypatch):
    """A client that goes away mid-generation: its column threads end and its caches are emptied."""
    made = []
    real = kd.make_cache

    def recording(model, cfg):
        made.append(real(model, cfg))
        return made[-1]

    monkeypatch.setattr(kd, "make_cache", recording)
    job = client.submit(*args(STORY, new=kd.MAX_NEW_TOKENS_CAP), api_name="/generate")
    deadline = time.time() + 120
    while len(job.outputs()) < 6 and time.time() < deadline:
        time.sleep(0.05)
    assert len(made) == 3 and any(c.get_seq_length() > 0 for c in made)
    assert job.cancel()

    def workers_alive() -> bool:
        return any(t.name.startswith("kitty-column") for t in threading.enumerate())

    deadline = time.time() + 30
    while (workers_alive() or any(c.get_seq_length() for c in made)) and time.time() < deadline:
        time.sleep(0.1)
    assert not workers_alive()
    assert all(c.get_seq_length() == 0 for c in made)


@pytest.mark.parametrize("method", ["kitty+channel_selection=oracle+key_range=fit", "kitty-query"])
def test_inspector_shows_the_channels_the_cache_boosts(app_module, method):
    """Query-aware selections need the prompt's query statistics: the inspector's boosted channels per page equal
    the ones a KittyCache stores for that layer and head."""
    from kitty import KittyCache

    engine = app_module.get_engine(app_module.ARGS.model)
    ids = kp.prepare_prompt(engine.tokenizer, kp.example_prompts()[1][0], True).ids
    cfg, layer, head = get_preset(method), 5, 2
    qs = prompt_query_scale(engine.model, ids, cfg, layer, head)
    assert qs is not None and qs.shape == (engine.head_dim,)
    ins = inspect_keys(prompt_keys(engine.model, ids)[layer][head], cfg, layer, head, qs)
    cache = KittyCache(engine.model.config, cfg)
    with torch.no_grad():
        engine.model(ids, **cache_kwargs(cache), use_cache=True)
    full = [p for p in ins.pages if p.quantized]
    assert len(full) >= 2
    for j, p in enumerate(full):
        page = cache.layers[layer].key_page(0, j)
        assert p.boosted == (page.boost_idx[head].long() < page.num_boosted).nonzero().flatten().tolist()
    assert prompt_query_scale(engine.model, ids, get_preset("kitty"), layer, head) is None


def raw_call(url: str, api: str, body: str) -> list:
    """One call of the app's HTTP API with a hand-written JSON body, as a non-Python client may send it (lone
    surrogate escapes, NaN, Infinity: ``gradio_client`` refuses to encode these). Returns the last data event."""
    import json

    import httpx

    base = url.rstrip("/") + "/gradio_api/call/" + api
    event = httpx.post(base, content=body.encode(), headers={"Content-Type": "application/json"}, timeout=60)
    event.raise_for_status()
    with httpx.stream("GET", f"{base}/{event.json()['event_id']}", timeout=120) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    return json.loads(lines[-1][5:])


def test_hostile_inputs_over_the_api_give_clear_messages(client, demo_url):
    """Values the UI's widgets never send but the API accepts: each a message naming the problem, no run."""
    out = client.predict(SHORT, True, 2.5, 0.0, 1.0, 0, *METHODS, api_name="/generate")
    assert "max_new_tokens must be a whole number in [1, 256], got 2.5" in out[NOTE]
    assert [plain(t) for t in out[TEXTS]] == ["", "", ""] and not out[JSON]
    methods = ", ".join([*(f'"{m}"' for m in METHODS), *map(str, args(SHORT)[-3:])])  # and the advanced knobs
    cases = {
        "lone surrogate": (f'"What is \\ud800 here?", true, {NEW}, 0, 1, 0', "a lone surrogate"),
        "temperature NaN": (f'"{SHORT}", true, {NEW}, NaN, 1, 0', "temperature must be a number, got NaN"),
        "max_new_tokens NaN": (f'"{SHORT}", true, NaN, 0, 1, 0', "max_new_tokens must be a number, got NaN"),
    }
    for name, (inputs, expected) in cases.items():
        out = raw_call(demo_url, "generate", f'{{"data": [{inputs}, {methods}]}}')
        assert expected in out[NOTE], (name, out[NOTE])
        assert [plain(t) for t in out[TEXTS]] == ["", "", ""] and not out[JSON], name
    _, note, heat, _, _ = raw_call(demo_url, "inspect", f'{{"data": ["{SHORT}", true, "kitty", NaN, 0, 8]}}')
    assert "layer must be a number, got NaN" in note and heat is None
    out = client.predict(SHORT, True, NEW, 1e-300, 1.0, 0, *METHODS, api_name="/generate")  # near-zero temperature
    assert "temperature must be 0 (greedy) or >= 0.0001" in out[NOTE]
    assert [plain(t) for t in out[TEXTS]] == ["", "", ""] and not out[JSON]
    with pytest.raises(AppError, match="Value 1e-300 is less than minimum value 0.05"):  # the top-p slider's own
        client.predict(SHORT, True, NEW, 1.0, 1e-300, 0, *METHODS, api_name="/generate")


def test_short_prompt_says_when_pages_start(app_module, client):
    """Before the first page, each quantizing column says why nothing is quantized and when it will be, from its
    preset's sink and page size; fp16 says it keeps everything."""
    final = client.predict(*args(SHORT, new=2), api_name="/generate")
    for method, md in zip(METHODS, final[READOUTS]):
        cfg = PRESETS[method]
        if method == "fp16":
            assert "all full precision" in md and "nothing quantized" not in md
        else:
            start = cfg.sink_tokens + cfg.group_size
            assert f"nothing quantized yet: pages start after {start} tokens" in md


def test_page_pack_is_recorded_and_plotted(app_module):
    """A prompt two tokens short of kitty's first page: the page packs during decoding, the column records it, the
    readout then shows a page and the figure marks it; KIVI (no sink) packed its page in the prefill already."""
    engine = app_module.get_engine(app_module.ARGS.model)
    cfg = PRESETS["kitty"]
    first_page = cfg.sink_tokens + cfg.group_size
    ids = kp.encode_prompt(engine.tokenizer, kp.essay_excerpt())[:, : first_page - 2]
    prompt = kp.PreparedPrompt(ids, "")
    snaps = list(kd.stream_side_by_side(engine.model, engine.tokenizer, prompt, ["kitty", "kitty", "kivi-k2v2"], 5))
    snap = snaps[-1]
    kitty, twin, kivi = snap.columns
    # the first token comes from the prefill (first_page - 2 cached), each later step caches one more
    assert kitty.packs == [(first_page, "K")] and kivi.packs == []
    assert kitty.readout.layout["key_pages"] == cfg.group_size
    assert dv.page_start_note(cfg, kitty.readout.layout).startswith("values not quantized yet")
    fig = dfig.memory_figure(snap)
    ax = fig.axes[0]
    markers = [ln for ln in ax.lines if ln.get_marker() == "v"]
    assert [(ln.get_xdata()[0], ln.get_color()) for ln in markers][:1] == [(first_page, dv.COLUMN_COLORS[0])]
    assert "3 · kivi-k2v2" not in ax.get_title() and "2 · kitty lies on 1 · kitty" in ax.get_title()
    rows = dv.memory_rows(snap)
    for c in snap.columns:
        got = rows[rows.column == c.label]
        assert list(got.tokens) == [t for t, _ in c.history]
        assert list(got.stored_MiB) == pytest.approx([b / 2**20 for _, b in c.history])
    readout = dv.format_readout(kitty, engine.head_dim, kitty, engine.tokenizer)
    assert f"{cfg.group_size} in 1 page " in readout


def test_the_captured_path_streams_the_same_columns_in_chunks(app_module):
    """The columns on the static step of ``decode_chunks`` (what CUDA captures; the CPU runs it eagerly) give the
    eager loop's greedy tokens and its final readouts; their tokens arrive in chunks, one readout and plot point
    each; the page that packs during decoding is recorded on both paths."""
    engine = app_module.get_engine(app_module.ARGS.model)
    cfg = PRESETS["kitty"]
    first_page = cfg.sink_tokens + cfg.group_size
    ids = kp.encode_prompt(engine.tokenizer, kp.essay_excerpt())[:, : first_page - 5]
    prompt = kp.PreparedPrompt(ids, "")
    methods, new = ["fp16", "kivi-k2v2-sink", "kitty"], 20
    runs = {
        path: list(kd.stream_side_by_side(engine.model, engine.tokenizer, prompt, methods, new, path=path))[-1]
        for path in ("eager", "captured")
    }
    for eager, captured in zip(runs["eager"].columns, runs["captured"].columns, strict=True):
        assert captured.ids == eager.ids and len(eager.ids) == new
        assert captured.readout.as_dict() | {"tokens_per_s": 0, "step_ms": 0} == eager.readout.as_dict() | {
            "tokens_per_s": 0,
            "step_ms": 0,
        }
        assert len(captured.step_times) == len(eager.step_times) == new - 1
        assert len(eager.history) == new and 2 <= len(captured.history) < new  # the prompt's token, then chunks
        assert captured.history[-1] == eager.history[-1] and captured.cache is None
    kitty_eager, kitty_captured = runs["eager"].columns[2], runs["captured"].columns[2]
    assert kitty_eager.packs == [(first_page, "K")]
    assert [side for _, side in kitty_captured.packs] == ["K"]
    with pytest.raises(ValueError, match="path must be one of"):
        next(kd.stream_side_by_side(engine.model, engine.tokenizer, prompt, methods, new, path="graph"))
