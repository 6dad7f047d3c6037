"""``python -m kitty``: a short smoke run of streaming generation and of --compare, in a subprocess."""

import subprocess
import sys

import pytest

from kitty.__main__ import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kitty", *args], capture_output=True, text=True, timeout=300)


def test_cli_streams_text_then_memory_report():
    r = run("Name a color.", "--method", "kitty", "--max-new-tokens", "6", "--chat")
    assert r.returncode == 0, r.stderr
    text, _, report = r.stdout.partition("[kitty]")
    assert text.strip()  # the streamed continuation came first
    assert " new tokens in " in report and "bits/element" in report and "x)" in report
    assert "sink" in report and "local" in report


def test_cli_compare_prints_a_table_per_preset():
    r = run("Name a color.", "--compare", "--methods", "fp16,kitty", "--max-new-tokens", "4", "--chat")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| method | bits/element | compression | tokens/s | text")
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["fp16", "kitty"]
    assert "16.00 | 1.00x" in rows[1]  # fp16 stores every token at 16 bits


@pytest.mark.parametrize(
    "argv, message",
    [
        (["  "], "prompt is empty"),
        (["hi", "--compare", "--methods", "fp16,nope"], "unknown method"),
        (["hi", "--max-new-tokens", "0"], "max-new-tokens"),
    ],
)
def test_cli_rejects_bad_input(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
