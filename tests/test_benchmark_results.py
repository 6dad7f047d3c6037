"""benchmarks/: RESULTS.md is what benchmarks/summarize.py makes of the result folders, and every result file has
its command in its folder's COMMANDS.md. Needs no GPU: only the committed files are read."""

from __future__ import annotations

import datetime
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks.{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_results_md_is_the_generated_summary():
    summarize = load("summarize")
    text = summarize.summarize()
    assert (BENCH / "RESULTS.md").read_text() == text, (
        "benchmarks/RESULTS.md is stale: run python benchmarks/summarize.py"
    )
    folders = sorted(p for p in (BENCH / "results").iterdir() if p.is_dir())
    assert folders and all(f"## `benchmarks/results/{f.name}/`" in text for f in folders)
    assert summarize.main(["--check"]) == 0


@pytest.mark.parametrize("folder", sorted(p.name for p in (BENCH / "results").iterdir() if p.is_dir()))
def test_every_result_file_has_its_command(folder):
    """One folder per GPU and date; COMMANDS.md names every other file of the folder in its table."""
    path = BENCH / "results" / folder
    gpu, day = folder.rsplit("-", 3)[0], "-".join(folder.rsplit("-", 3)[1:])
    assert gpu and datetime.date.fromisoformat(day), folder
    commands = (path / "COMMANDS.md").read_text()
    rows = [line for line in commands.splitlines() if line.startswith("| `")]
    for f in path.iterdir():
        if f.name != "COMMANDS.md":
            assert any(row.startswith(f"| `{f.name}`") for row in rows), f"{folder}/{f.name} has no command"


def test_scripts_default_to_one_folder_per_gpu_and_date(tmp_path):
    rd = load("results_dir")
    assert rd.default_out("NVIDIA H200", datetime.date(2026, 12, 1)) == BENCH / "results" / "h200-2026-12-01"
    assert rd.gpu_tag("NVIDIA GeForce RTX 4090") == "4090" and rd.gpu_tag("") == "unknown"
    assert rd.unused_path(tmp_path, "kernels_results.json") == tmp_path / "kernels_results.json"
    (tmp_path / "kernels_results.json").write_text("{}")
    (tmp_path / "kernels_results-2.json").write_text("{}")
    assert rd.unused_path(tmp_path, "kernels_results.json") == tmp_path / "kernels_results-3.json"
