"""The demo's pure formatting and figures (:mod:`kitty.tools.demo_view`), on hand-made columns: no model, no UI.

Readouts and memory come from the analytic model (:func:`kitty.core.memory.analytic_report`), so each test says what a
column of that many tokens shows; a toy tokenizer (one character per token id) makes texts readable.
"""

from __future__ import annotations

import pytest
import torch

from kitty import PRESETS
from kitty.core.memory import analytic_report, token_layout
from kitty.tools import demo as kd
from kitty.tools import demo_figures as dfig
from kitty.tools import demo_view as dv

HEAD_DIM, KV_HEADS, LAYERS = 64, 3, 30  # SmolLM2-135M's shape


class CharTokenizer:
    """Token id = ``ord(character)``: decode joins the characters."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


TOK = CharTokenizer()


def column(method: str, text: str, prompt_tokens: int = 800, index: int = 1) -> kd.Column:
    """A finished column of ``method`` that generated ``text`` after a prompt of ``prompt_tokens``."""
    cfg = PRESETS[method]
    ids = [ord(ch) for ch in text]
    n = prompt_tokens + len(ids) - 1
    rep = analytic_report(cfg, n, HEAD_DIM, KV_HEADS, LAYERS)
    readout = kd.Readout(method, len(ids), 5.0, 100.0, rep, token_layout(cfg, n).as_dict())
    col = kd.Column(f"{index} · {method}", method, None, torch.Generator(), ids=ids, text=text, status="done")
    col.readout = readout
    col.history = [(n - 1, rep.stored_bytes), (n, rep.stored_bytes)]
    return col


def test_fmt_bytes():
    assert dv.fmt_bytes(512) == "512 B"
    assert dv.fmt_bytes(1536) == "1.5 KiB"
    assert dv.fmt_bytes(5 * 2**20) == "5.0 MiB"
    assert dv.fmt_bytes(300 * 2**20) == "300 MiB"


def test_divergence_and_reference_column():
    assert dv.divergence([1, 2, 3], [1, 2, 4]) == 2
    assert dv.divergence([1, 2, 3], [1, 2]) is None
    cols = [column("kitty", "ab", index=1), column("fp16", "ab", index=2)]
    assert dv.reference_column(cols) is cols[1]
    assert dv.reference_column(cols[:1]) is cols[0]


def test_first_divergent_token_is_marked():
    ref, col = column("fp16", "The sky is blue."), column("kitty", "The sky is red.", index=3)
    line = dv.text_vs_reference(col, ref, TOK, "#123456")
    assert line.startswith("differs from 1 · fp16 at token 12:")
    marked = line.split("<mark")[1].split("</mark>")[0].split(">", 1)[1]
    assert marked == "r" and "#123456" in line
    same = column("kivi-k2v2", "The ")
    assert dv.text_vs_reference(same, ref, TOK, "#000") == "same as 1 · fp16 so far (4 tokens)"


def test_page_start_note_and_full_precision_parts():
    cfg = PRESETS["kitty"]
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    early = token_layout(cfg, S + G - 1).as_dict()
    assert dv.page_start_note(cfg, early).startswith(f"nothing quantized yet: pages start after {S + G} tokens")
    mid = token_layout(cfg, S + G + 1).as_dict()
    assert dv.page_start_note(cfg, mid).startswith(f"values not quantized yet: value pages start after {S + R + G}")
    assert dv.page_start_note(cfg, token_layout(cfg, 2000).as_dict()) == ""
    parts = dv.full_precision_parts(cfg, token_layout(cfg, 2000).as_dict())
    assert parts.startswith(f"sink {S} (K+V) · K qbuffer") and "local" in parts


def test_readout_and_summary_show_the_measured_numbers():
    cols = [column("fp16", "abc"), column("kivi-k2v2-sink", "abd", index=2), column("kitty", "abc", index=3)]
    ref = cols[0]
    md = dv.format_readout(cols[2], HEAD_DIM, ref, TOK)
    rep = cols[2].readout.report
    assert f"<b>{rep.bits_per_element:.2f}</b> bits/element" in md
    assert f"{dv.fmt_bytes(rep.stored_bytes)} of {dv.fmt_bytes(rep.fp16_bytes)}" in md
    assert "long context" in md and "same as 1 · fp16 so far (3 tokens)" in md
    assert "all full precision" in dv.format_readout(ref, HEAD_DIM, ref, TOK)
    summary = dv.summarize(cols, TOK, stopped=False, head_dim=HEAD_DIM)
    assert summary.startswith("**Done**") and "diverges at token 3" in summary and "identical (3 tokens)" in summary
    assert "Why more than 2 bits now" in summary
    assert dv.summarize(cols, TOK, stopped=True).startswith("**Stopped**")


def test_memory_rows_and_figure():
    cols = [column("fp16", "ab"), column("kitty", "ab", index=2), column("kitty", "ab", index=3)]
    snap = kd.Snapshot("done", 800, cols)
    rows = dv.memory_rows(snap)
    assert set(rows.column) == {c.label for c in cols}
    assert list(rows.stored_MiB[rows.column == cols[0].label]) == pytest.approx([b / 2**20 for _, b in cols[0].history])
    fig = dfig.memory_figure(snap)
    assert "3 · kitty lies on 2 · kitty" in fig.axes[0].get_title()


class Dims:
    num_layers, num_kv_heads, head_dim = LAYERS, KV_HEADS, HEAD_DIM


def test_bits_table_lists_every_preset_that_fits_the_model():
    table = dv.bits_table(Dims(), 800, 32)
    fits = [n for n, c in PRESETS.items() if c.boost_profile is None or len(c.boost_profile) == LAYERS]
    assert list(table.method) == fits
    assert table.set_index("method").loc["fp16", "cache at 832 tokens"] == 16.0


def test_method_intro_names_the_selection():
    intro = dv.method_intro(PRESETS["kitty"], HEAD_DIM, 0, LAYERS)
    assert "picks its own 8 of 64 channels" in intro and "largest mean |K|" in intro
    assert "no boost" in dv.method_intro(PRESETS["kivi-k2v2-sink"], HEAD_DIM, 0, LAYERS)


def test_agreement_and_the_marked_text():
    ref, col = column("fp16", "abcdef"), column("kitty", "abXdeY", index=3)
    assert dv.agreement(ref.ids, col.ids) == (2, 6, pytest.approx(4 / 6))
    assert dv.agreement(ref.ids, ref.ids[:3]) == (3, 3, 1.0)
    assert dv.agreement_text(col, ref) == "agrees for 2 tokens / 67%"
    assert dv.agreement_text(column("kitty", "abc"), ref) == "agrees for all 3 tokens / 100%"
    marked = dv.text_html(col, ref, TOK, "#2563eb")
    assert "ab<mark class='diverged'" in marked and ">XdeY</mark>" in marked
    assert "<mark" not in dv.text_html(ref, ref, TOK, "#000")
    assert dv.text_html(column("kitty", "a<b"), column("fp16", "a<b"), TOK, "#000").count("&lt;") == 1


def test_verdict_has_one_line_per_column_with_size_and_agreement():
    cols = [column("fp16", "abcd"), column("kivi-k2v2-sink", "abXd", index=2), column("kitty", "abcd", index=3)]
    marks = [dv.answer_mark(c.text, 123, lambda t, c=c: c is not cols[1]) for c in cols]
    html_ = dv.verdict(cols, marks)
    lines = html_.split("<li")[1:]
    assert len(lines) == 3 and "the reference" in lines[0]
    for c, line in zip(cols[1:], lines[1:]):
        assert f"{c.readout.report.compression:.1f}× smaller than fp16" in line
    assert "agrees for 2 tokens / 75%" in lines[1] and "wrong" in lines[1]
    assert "agrees for all 4 tokens / 100%" in lines[2] and "right" in lines[2]


def test_fair_baseline_differs_by_the_boost_alone():
    kivi, kitty = PRESETS[kd.DEFAULT_METHODS[1]], PRESETS[kd.DEFAULT_METHODS[2]]
    same = ("sink_tokens", "group_size", "local_window", "key_bits", "value_bits")
    assert all(getattr(kivi, f) == getattr(kitty, f) for f in same) and kivi.num_boosted(HEAD_DIM) == 0
    line = dv.cost_line(list(kd.DEFAULT_METHODS), 900, Dims())
    reps = [analytic_report(PRESETS[m], 900, HEAD_DIM, KV_HEADS, LAYERS) for m in kd.DEFAULT_METHODS]
    extra = reps[2].stored_bytes - reps[1].stored_bytes
    assert f"Column 3 stores {dv.fmt_bytes(extra)} more than column 2" in line
    assert reps[2].full_precision_bytes == reps[1].full_precision_bytes  # equal 16-bit buffers


def test_knobs_change_only_what_differs():
    assert dv.with_knobs("kitty", 0.125, 32, 128) == "kitty"
    assert dv.with_knobs("kitty", 0.25, 16, 128) == "kitty+boost_fraction=0.25+sink_tokens=16"
    assert dv.with_knobs("kivi-k2v2-sink", 0.25, 16, 64) == "kivi-k2v2-sink+sink_tokens=16+local_window=64"
    assert dv.with_knobs("fp16", 0.25, 0, 0) == "fp16"
    assert PRESETS["kitty"].description == dv.preset_info("kitty")
    assert all(c.description for c in PRESETS.values())


def test_eval_figures_come_from_the_committed_csvs():
    import csv

    from kitty.tools.demo_view import _assets

    rows = {
        r["method"]: r
        for r in csv.DictReader((_assets() / "eval_ppl_full.csv").open())
        if r.get("text", "all") == "all"  # the figure over every text, not a per-text row
    }
    figs = dv.eval_figures()
    assert figs["kitty"]["ppl"] == pytest.approx(float(rows["kitty"]["ppl"]))
    assert 0 <= figs["kitty"]["passkey"] <= 1
    assert dv.eval_line("kitty").startswith(f"eval: perplexity {float(rows['kitty']['ppl']):.1f}")
    assert dv.eval_line("no-such-preset") == ""
    cols = [column("fp16", "abcd"), column("kivi-k2v2-sink", "abXd", index=2), column("kitty", "abcd", index=3)]
    fig = dfig.summary_figure(cols)
    ax, bx = fig.axes
    assert [t.get_text() for t in bx.get_yticklabels()] == [c.label for c in cols]
    assert len(ax.collections) == 3


def test_inside_sentences_give_the_reasons():
    from kitty.core.quant import inspect_keys

    adaptive = PRESETS["kitty-fit-adaptive"]
    layer = next(i for i, f in enumerate(adaptive.boost_profile) if round(f * HEAD_DIM) == 0)
    intro = dv.method_intro(adaptive, HEAD_DIM, layer, LAYERS)
    assert "KIVI-style keys" in intro and "calibrated profile" in intro and "other layers boost more" in intro
    keys = torch.randn(32 + 3 * 128, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    keys[:, 5] *= 20  # one large channel
    random_note = dv.attention_note(inspect_keys(keys, PRESETS["kitty-random"]))
    assert "at random" in random_note and "those are the ones kept at 4 bits" not in random_note
    assert "those are the ones kept at 4 bits" in dv.attention_note(inspect_keys(keys, PRESETS["kitty"]))
