"""The evaluation CLI in --quick mode, end to end on the default model (part of `make test`)."""

import csv
import os

import pytest
import torch

from kitty.tools import eval as keval


def test_eval_quick_writes_tables_and_plots(tmp_path, capsys):
    keval.main(["--quick", "--methods", "fp16,kivi-k2v2,kitty", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "Estimated runtime: about" in out.splitlines()[0]
    for name in (
        "eval_quick.md",
        "eval_ppl_quick.csv",
        "eval_pack_quick.csv",
        "eval_pareto_quick.png",
        "eval_agreement_quick.csv",
        "eval_passkey_quick.csv",
        "eval_passkey_quick.png",
    ):
        assert (tmp_path / name).stat().st_size > 0, name
        assert f"wrote {tmp_path / name}" in out, name
    rows = list(csv.DictReader(open(tmp_path / "eval_ppl_quick.csv")))
    ppl = {r["method"]: r for r in rows if r["text"] == "all"}
    assert set(ppl) == {"fp16", "kivi-k2v2", "kitty"}
    per_text = {(r["method"], r["text"]) for r in rows if r["text"] != "all"}
    assert per_text == {(m, t) for m in ppl for t in ("essay", "python_reference")}
    assert float(ppl["fp16"]["ppl_change"]) == 0.0
    assert all(float(r["ppl"]) > 1.0 for r in ppl.values())
    assert float(ppl["kitty"]["bits_per_element"]) < float(ppl["fp16"]["bits_per_element"]) == pytest.approx(16.0)
    agreement = {r["method"]: r for r in csv.DictReader(open(tmp_path / "eval_agreement_quick.csv"))}
    assert set(agreement) == {"kivi-k2v2", "kitty"}
    assert all(0.0 <= float(r["match_rate"]) <= 1.0 for r in agreement.values())
    assert "Decode perplexity" in (tmp_path / "eval_quick.md").read_text()
    pack = {r["method"]: float(r["vs_paper_rule"]) for r in csv.DictReader(open(tmp_path / "eval_pack_quick.csv"))}
    assert set(pack) == {"kivi-k2v2", "kitty"} and all(v > 0 for v in pack.values())
    assert pack["kitty"] == 1.0  # kitty is the paper rule itself (magnitude selection, min-max ranges)


def test_perplexity_in_worker_processes_equals_in_process():
    """``jobs=2`` runs methods in spawned workers that load the model themselves: the same numbers."""
    from kitty.hf.models import load_model

    model, tok = load_model()
    cfgs = ["kitty+key_range=fit+value_range=fit"]
    one = keval.perplexity_table(model, tok, cfgs, prefill=160, scored=8, per_text=1, names=("essay.txt",))
    two = keval.perplexity_table(model, tok, cfgs, prefill=160, scored=8, per_text=1, names=("essay.txt",), jobs=2)
    assert [r.method for r in two] == ["fp16", cfgs[0]]
    assert [r.nll for r in two] == pytest.approx([r.nll for r in one], rel=1e-4)


def test_pack_cost_covers_every_strategy():
    rows = keval.pack_cost_table(["kitty", "kitty+channel_selection=oracle", "kitty+key_range=fit"], pages=2, repeats=1)
    assert [r.channel_selection for r in rows] == ["magnitude", "oracle", "magnitude"]
    assert rows[2].key_range == "fit" and all(r.us_per_key_page > 0 for r in rows)
    assert rows[0].vs_paper_rule == 1.0 and rows[1].vs_paper_rule != 1.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "nope"], "--methods 'nope': method must be one of"),
        (["--methods", ""], "--methods names no preset"),
        (["--methods", " , "], "--methods names no preset"),
        (["--skip", "bogus"], "--skip takes parts from"),
        (["--skip", "ppl,agreement,passkey,pack"], "nothing to run"),
        (["--prefill", "0"], "--prefill must be >= 1"),
        (["--scored", "0"], "--scored must be >= 1"),
        (["--windows-per-text", "0"], "--windows-per-text must be >= 1"),
        (["--jobs", "0"], "--jobs must be >= 1"),
        (["--agreement-prompts", "0"], "--agreement-prompts must be >= 1"),
        (["--agreement-tokens", "-3"], "--agreement-tokens must be >= 1"),
        (["--passkey-trials", "0"], "--passkey-trials must be >= 1"),
        (["--passkey-lengths", "1024,lots"], "--passkey-lengths must be comma-separated integers"),
        (["--passkey-lengths", "0"], "--passkey-lengths must be >= 1"),
        (["--tag", "../up"], "--tag must be"),
        (["--model", "/nonexistent/model"], "--model '/nonexistent/model': no such folder"),
        (["--out", "{file}"], "is a file, not a folder"),
        pytest.param(
            ["--out", "/proc/kitty-eval"],
            "cannot take files",
            marks=pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc, where no folder can be made"),
        ),
    ],
)
def test_eval_refuses_bad_flags_before_loading_the_model(argv, message, tmp_path, monkeypatch, capsys):
    import kitty.hf.models

    monkeypatch.setattr(kitty.hf.models, "load_model", lambda *a, **kw: pytest.fail("the model was loaded"))
    file = tmp_path / "a-file"
    file.write_text("")
    argv = [a.replace("{file}", str(file)) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        keval.main([*argv, *out])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_eval_refuses_windows_the_texts_cannot_hold_before_any_part_runs(default_model, monkeypatch, tmp_path, capsys):
    import kitty.hf.models

    monkeypatch.setattr(kitty.hf.models, "load_model", lambda *a, **kw: default_model)
    monkeypatch.setattr(keval, "measure_step", lambda *a, **kw: pytest.fail("work started"))
    with pytest.raises(SystemExit):
        keval.main(["--prefill", "100000", "--methods", "kitty", "--out", str(tmp_path)])
    assert "--prefill 100000 + --scored 256 do not fit the shipped texts" in capsys.readouterr().err


def test_eval_help_gives_every_flag_a_help_and_a_default():
    parser = keval.build_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, action.dest
        assert "default" in action.help, action.dest


def test_plots_have_whole_number_bit_ticks_and_one_legend(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [keval.PerplexityResult(m, 1.0, 2.0, c, b, 32) for m, c, b in [("fp16", 0, 16.0), ("kitty", 0.1, 3.2)]]
    rows += [keval.PerplexityResult(f"kitty+seed={i}", 1.0, 2.0, 0.05, 3.2, 32) for i in range(6)]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at its axes
    keval.plot_pareto(rows, tmp_path / "pareto.png")
    (fig,) = figures
    ticks = [t for t in fig.axes[0].get_xticks() if 3.2 / 1.15 <= t <= 16 * 1.15]
    assert ticks == [3, 4, 5, 6, 8, 10, 12, 14, 16]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [f"{t:g}" for t in ticks]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [r.method for r in rows]
    assert (tmp_path / "pareto.png").stat().st_size > 0


def test_eval_passes_caches_with_cache_keyword(default_model):
    """transformers 5 deprecates ``past_key_values=``: eval's forward and generate calls must not trigger it."""
    import warnings

    model, tok = default_model
    ids = tok("The grass is green. The sky is blue. " * 30, return_tensors="pt").input_ids[0, :200]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*", category=FutureWarning)
        nll = keval.decode_nll(model, ids, keval.PRESETS["kitty"], prefill=196)
        out = keval.greedy(model, tok, "The sky is", keval.PRESETS["kitty"], max_new_tokens=2)
    assert nll.shape == (4,) and torch.isfinite(nll).all() and len(out) == 2


def test_eval_refuses_an_unsupported_transformers_before_loading(tmp_path, monkeypatch, capsys):
    """transformers below the admitted range is refused with the fix, before the model loads."""
    import transformers

    import kitty.hf.models
    from kitty.hf.compat import transformers_version

    monkeypatch.setattr(kitty.hf.models, "load_model", lambda *a, **kw: pytest.fail("the model was loaded"))
    monkeypatch.setattr(transformers, "__version__", "5.16.0")
    transformers_version.cache_clear()
    try:
        with pytest.raises(SystemExit) as exit_:
            keval.main(["--quick", "--out", str(tmp_path / "out")])
        assert exit_.value.code == 2
        assert "kitty needs transformers>=5.17,<6, found transformers 5.16.0" in capsys.readouterr().err
    finally:
        monkeypatch.undo()
        transformers_version.cache_clear()
