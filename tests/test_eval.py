"""The evaluation CLI in --quick mode, end to end on the default model (part of `make test`)."""

import csv

import pytest

from kitty import eval as keval


def test_eval_quick_writes_tables_and_plots(tmp_path):
    keval.main(["--quick", "--methods", "fp16,kivi-k2v2,kitty", "--out", str(tmp_path)])
    for name in ("eval_quick.md", "eval_ppl_quick.csv", "eval_pareto_quick.png", "eval_agreement_quick.csv", "eval_passkey_quick.csv", "eval_passkey_quick.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    ppl = {r["method"]: r for r in csv.DictReader(open(tmp_path / "eval_ppl_quick.csv"))}
    assert set(ppl) == {"fp16", "kivi-k2v2", "kitty"}
    assert float(ppl["fp16"]["ppl_change"]) == 0.0
    assert all(float(r["ppl"]) > 1.0 for r in ppl.values())
    assert float(ppl["kitty"]["bits_per_element"]) < float(ppl["fp16"]["bits_per_element"]) == pytest.approx(16.0)
    agreement = {r["method"]: r for r in csv.DictReader(open(tmp_path / "eval_agreement_quick.csv"))}
    assert set(agreement) == {"kivi-k2v2", "kitty"}
    assert all(0.0 <= float(r["match_rate"]) <= 1.0 for r in agreement.values())
    assert "Decode perplexity" in (tmp_path / "eval_quick.md").read_text()


def test_passkey_prompt_places_the_key_and_ends_in_plain_form():
    from kitty.models import load_model

    _, tok = load_model()
    p = keval.passkey_prompt(tok, 600, 0.5, 12345)
    assert p.endswith("The pass key is") and "12345" in p
    assert 450 < len(tok(p).input_ids) <= 600
    with pytest.raises(ValueError, match="method"):
        keval.main(["--quick", "--methods", "nope"])
