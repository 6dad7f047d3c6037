"""The evaluation CLI in --quick mode, end to end on the default model (part of `make test`)."""

import csv

import pytest
import torch

from kitty import eval as keval


def test_eval_quick_writes_tables_and_plots(tmp_path):
    keval.main(["--quick", "--methods", "fp16,kivi-k2v2,kitty", "--out", str(tmp_path)])
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


def test_perplexity_in_worker_processes_equals_in_process():
    """``jobs=2`` runs methods in spawned workers that load the model themselves: the same numbers."""
    from kitty.models import load_model

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


def test_eval_rejects_an_unknown_method():
    with pytest.raises(ValueError, match="method"):
        keval.main(["--quick", "--methods", "nope"])


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
