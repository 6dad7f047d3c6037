"""``python -m kitty``: a short smoke run of streaming generation and of --compare, in a subprocess."""

import io
import json
import subprocess
import sys

import pytest

from kitty import PRESETS
from kitty.core.config import BACKENDS
from kitty.core.memory import MemoryReport
from kitty.hf.generate import Sampling
from kitty.tools.cli import DEFAULT_COMPARE, Result, build_parser, main, sampling_of, table


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
    head = "| method | bits/element | compression | cached tokens | tokens/s | diverges from fp16 at | text"
    assert rows[0].startswith(head)
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["fp16", "kitty"]
    assert "16.00 | 1.00x" in rows[1]  # fp16 stores every token at 16 bits
    assert rows[1].split("|")[6].strip() == "(reference)"
    assert rows[1].split("|")[4] == rows[2].split("|")[4]  # both rows cached the same tokens
    assert "too short to fill a page: kitty quantized nothing yet" in r.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["  "], "prompt is empty"),
        (["hi", "--compare", "--methods", "fp16,nope"], "--methods 'nope': method must be one of"),
        (["hi", "--max-new-tokens", "0"], "max-new-tokens"),
    ],
)
def test_cli_rejects_bad_input(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_help_lists_presets_and_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare on single spaces
    for name in PRESETS:
        assert f" {name} " in out, name
    for default in ("(default: kitty)", "(default: 64)", "default: 0.95", "(default: 0)", DEFAULT_COMPARE):
        assert default in out, default
    assert "160 tokens for kitty" in out and "--prompt-file" in out


def test_cli_sampling_defaults_are_the_apps():
    """One set of defaults, ``kitty.hf.generate.Sampling``'s, which the demo app's sliders also start from."""
    assert Sampling() == Sampling(temperature=0.0, top_p=0.95, seed=0)
    args = build_parser().parse_args(["hi"])
    assert sampling_of(args) == Sampling() and sampling_of(args).greedy
    sampled = sampling_of(build_parser().parse_args(["hi", "--sample"]))
    assert not sampled.greedy and sampled.top_p == Sampling().top_p


def test_cli_backend_takes_every_cache_backend():
    """``--backend`` offers the cache's backends, the Gluon kernel's included; the default leaves the choice to
    ``$KITTY_BACKEND`` or auto."""
    assert build_parser().parse_args(["hi"]).backend is None
    for name in BACKENDS:
        assert build_parser().parse_args(["hi", "--backend", name]).backend == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["hi", "--backend", "cuda"])


def fake_result(method: str, tokens: list[int], text: str) -> Result:
    return Result(method, text, len(tokens), 1.0, MemoryReport(1, 2, 1, 0, 0), {}, tokens)


def test_compare_table_shows_divergence_and_whole_texts():
    long = "word " * 40  # 200 characters: never cut unless asked
    results = [
        fake_result("fp16", [5, 6, 7, 8], long),
        fake_result("kitty", [5, 6, 9, 8], "short"),
        fake_result("kitty-pro", [5, 6, 7, 8], long),
        fake_result("kivi-k2v2", [5, 6], "stopped early"),
    ]
    rows = [r.split("|") for r in table(results).splitlines()[2:]]
    assert [r[6].strip() for r in rows] == ["(reference)", "token 3", "never (4 tokens)", "token 3"]
    assert rows[0][7].strip() == long.strip()
    cut = table(results, width=20).splitlines()[2].split("|")[7].strip()
    assert len(cut) == 20 and cut.endswith("…")


@pytest.fixture
def cli(default_model, monkeypatch, tmp_path):
    """main() with the session's model, returning the new tokens of each run (read from --json)."""
    import kitty.hf.models

    monkeypatch.setattr(kitty.hf.models, "load_model", lambda name=None, *a, **kw: default_model)
    monkeypatch.delenv("KITTY_BACKEND", raising=False)

    def run_tokens(*argv: str, stdin: str | None = None) -> list[list[int]]:
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        out = tmp_path / "out.json"
        assert main([*argv, "--max-new-tokens", "3", "--json", str(out)]) == 0
        return [r["tokens"] for r in json.loads(out.read_text())]

    return run_tokens


def test_cli_reads_the_prompt_from_stdin_and_from_a_file(cli, tmp_path, capsys):
    prompt = "The capital of France is"
    expect = cli(prompt)
    assert len(expect[0]) == 3
    assert cli("-", stdin=prompt) == expect  # '-' reads stdin
    assert cli(stdin=prompt) == expect  # a piped stdin with no prompt
    path = tmp_path / "prompt.txt"
    path.write_text(prompt)
    assert cli("--prompt-file", str(path)) == expect
    capsys.readouterr()
    assert main(["hi", "--prompt-file", str(path)]) == 2
    assert "not both" in capsys.readouterr().err


def test_compare_table_counts_tokens_and_explains_short_prompts():
    """Each row says how many tokens it cached; rows of unequal length and a prompt too short to fill a page get
    a note under the table."""
    kitty = PRESETS["kitty"]
    first = kitty.sink_tokens + kitty.group_size
    results = [fake_result("fp16", [5, 6, 7], "abc"), fake_result("kitty", [5, 6, 7], "abc")]
    results[1] = Result("kitty", "ab", 2, 1.0, MemoryReport(1, 2, 1, 0, 0), {"key_pages": 0}, [5, 6])
    text = table(results)
    assert "| cached tokens |" in text
    assert f"too short to fill a page: kitty quantized nothing yet (pages start after {first} tokens" in text
    results[1] = Result("kitty", "ab", 2, 1.0, MemoryReport(2, 2, 1, 0, 0), {"key_pages": 128}, [5, 6])
    text = table(results)
    assert "too short" not in text and "the rows cached" in text
