"""The texts ship inside the package: a wheel built from the repository, installed into a scratch folder, has them.

eval, calibration and the demo's examples read ``kitty/texts/`` through ``importlib.resources``; this test builds a
wheel (no network, no build isolation), installs it with ``pip --target`` and reads every text from there in a fresh
interpreter whose working folder is neither the repository nor the scratch folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXTS_DIR = ROOT / "kitty" / "texts"

# Not needed to build the package: left out of the copy so that it stays small and the build writes nothing here.
NOT_PACKAGED = (".git", "build", "*.egg-info", "__pycache__", ".*cache", ".hypothesis", "tmp", "notebooks", "tests")

READ_ALL = """
    import hashlib, types
    from importlib import resources
    import torch
    import kitty
    from kitty.tools import calibrate, eval as keval, prompts

    assert kitty.__file__.startswith({scratch!r}), kitty.__file__  # the installed copy, not the repository's
    shipped = sorted(p.name for p in (resources.files("kitty") / "texts").iterdir())
    print("FILES", *shipped)
    for name in prompts.TEXTS:
        print("TEXT", name, hashlib.sha256(prompts.shipped_text(name).encode()).hexdigest())

    class WordTokenizer:  # one id per word: enough for the readers' slicing
        def __call__(self, text, return_tensors=None):
            ids = torch.arange(len(text.split()))
            return types.SimpleNamespace(input_ids=ids[None] if return_tensors == "pt" else ids.tolist())

        def decode(self, ids):
            return " ".join(map(str, ids))

    tok = WordTokenizer()
    assert len(keval.text_windows(tok, prefill=64, scored=16, per_text=2)) == 2 * len(prompts.TEXTS)
    assert len(keval.agreement_prompts(tok, n=2, length=32)) == 2
    assert calibrate.calibration_ids(tok, n_tokens=16, offset=0).numel() == 16
    assert "navigators" in prompts.example_prompts()[1][0]  # the demo's essay example
    print("OK")
"""


def test_wheel_installs_and_reads_every_text(tmp_path):
    src, wheels, scratch, elsewhere = (tmp_path / d for d in ("src", "wheels", "scratch", "elsewhere"))
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_PACKAGED))
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def pip_run(*args: str) -> None:
        r = subprocess.run(pip + list(args), cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]

    pip_run("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(src))
    (wheel,) = wheels.glob("kitty_kv-*.whl")
    pip_run("install", "--no-deps", "--no-index", "--target", str(scratch), str(wheel))

    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(READ_ALL.format(scratch=str(scratch)))],
        cwd=elsewhere,
        env=dict(env, PYTHONPATH=str(scratch)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), r.stdout + r.stderr[-3000:]
    lines = [line.split() for line in r.stdout.splitlines()]

    # Every file of kitty/texts/ is in the wheel, and each text read from the install is the repository's text.
    files = next(line[1:] for line in lines if line[0] == "FILES")
    assert files == sorted(p.name for p in TEXTS_DIR.iterdir() if p.is_file()), files
    texts = {line[1]: line[2] for line in lines if line[0] == "TEXT"}
    assert set(texts) == {p.name for p in TEXTS_DIR.glob("*.txt")}, texts
    for name, digest in texts.items():
        assert digest == hashlib.sha256((TEXTS_DIR / name).read_text(encoding="utf-8").encode()).hexdigest(), name


def test_shipped_text_names_the_parameter_for_an_unknown_text():
    from kitty.tools.prompts import shipped_text

    with pytest.raises(ValueError, match="name must be one of"):
        shipped_text("../pyproject.toml")
