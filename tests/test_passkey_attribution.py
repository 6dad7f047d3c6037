"""benchmarks/passkey_attribution.py: each variant changes only what its name says, and the committed CSV is what
the script measured (answers and solved flags agree, prompts are the eval's). Needs no model."""

from __future__ import annotations

import csv
import importlib.util
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from kitty.core.config import get_preset

ROOT = Path(__file__).resolve().parent.parent
CSV = ROOT / "assets" / "eval_passkey_attribution.csv"


def load():
    spec = importlib.util.spec_from_file_location(
        "benchmarks.passkey_attribution", ROOT / "benchmarks" / "passkey_attribution.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


CHANGED = {
    "base": {},
    "keys-only": {"value_bits": 16},
    "values-only": {"key_bits": 16, "boost_fraction": 0},
    "low-plane-keys": {"boost_fraction": 0},
    "local-64": {"local_window": 64},
    "local-256": {"local_window": 256},
    "sink-0": {"sink_tokens": 0},
    "sink-64": {"sink_tokens": 64},
}


@pytest.mark.parametrize("label", sorted(CHANGED))
def test_variant_changes_only_its_fields(label):
    pa = load()
    base, cfg = get_preset("kitty"), get_preset("kitty" + pa.VARIANTS[label])
    diff = {
        f.name: getattr(cfg, f.name) for f in fields(cfg) if f.compare and getattr(cfg, f.name) != getattr(base, f.name)
    }
    assert diff == CHANGED[label]


def test_committed_csv_is_consistent():
    pa = load()
    cases = {pa.case_id(c) for c in pa.passkey_cases()}
    assert len(cases) == 30
    with open(CSV) as f:
        rows = list(csv.DictReader(f))
    base = [r for r in rows if r["variant"] == "base"]
    assert {f"{r['length']}@{r['depth']}#{r['key']}" for r in base} == cases  # the base ran every prompt
    for r in rows:
        assert f"{r['length']}@{r['depth']}#{r['key']}" in cases
        assert r["method"] == ("fp16" if r["variant"] == "fp16" else "kitty" + pa.VARIANTS[r["variant"]])
        assert int(r["solved"]) == (r["key"] in r["answer"])
