"""README.md, docs/ and notebooks/README.md: every measured figure comes from a results file, and every reference
can be followed.

The figures live in blocks that ``docs/quoted.py`` writes from the results files; these tests fail when a block is
stale (rerun ``python docs/quoted.py``), when a figure is typed outside a block, or when a page points to something a
reader cannot open.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("quoted", ROOT / "docs" / "quoted.py")
quoted = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quoted)

PAGES = [p for p in quoted.PAGES if (ROOT / p).is_file()]
# Pages whose every measured figure must sit in a quoted block (docs/SERVING.md and docs/LAYOUT.md derive their
# numbers from kitty.core.memory in the text; notebooks/README.md quotes notebook outputs).
STRICT = ["README.md", "docs/RESEARCH.md", "docs/GPU.md", "docs/TENSOR_PARALLEL.md", "docs/SPACE.md", "docs/DEMO.md"]
# What a measured figure looks like: a signed change, a ratio, bits, a speed, a time, a size, a score out of n.
FIGURE = re.compile(
    r"[+−-]\d+(\.\d+)?%|\b\d+(\.\d+)?x\b|\d+(\.\d+)?×|\b\d+\.\d+ bits|\d\s?tok(ens)?/s|\d\s?µs|\d\s?(ms|GiB|MiB|GB|TB/s)\b"
    r"|(?<![\w.])\d+/\d+(?![\w.])"
)
UNFOLLOWABLE = re.compile(r"issue \d+|the (kernel )?issue'?s|kernel of 20\d\d|\(issue|DESIGN\.md", re.I)


def strip_blocks(text: str) -> str:
    return quoted.BLOCK_RE.sub("", text)


def prose(text: str) -> str:
    """Text outside code blocks and inline code."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`]*`", "", text)


@pytest.mark.parametrize("page", PAGES)
def test_quoted_blocks_are_current(page):
    text = (ROOT / page).read_text()
    assert quoted.render(text) == text, f"{page} quotes stale figures: run python docs/quoted.py"


def test_every_block_is_used_once():
    names = [n for p in PAGES for n in quoted.block_names((ROOT / p).read_text())]
    assert sorted(names) == sorted(quoted.BLOCKS), "each generated block appears on exactly one page"


@pytest.mark.parametrize("page", STRICT)
def test_no_figure_typed_outside_the_blocks(page):
    text = prose(strip_blocks((ROOT / page).read_text()))
    found = [m.group() for m in FIGURE.finditer(text)]
    assert not found, f"{page}: figures typed by hand (put them in a docs/quoted.py block): {found}"


def test_the_guard_sees_typed_figures():
    """The figure pattern catches what the old README typed by hand, and leaves definitions alone."""
    for typed in ("+10.3% perplexity", "1.34x faster", "2.56 bits per element", "8.7 tok/s", "960 µs", "12/15"):
        assert FIGURE.search(typed), typed
    for definition in ("pages of 128 tokens", "12.5% of channels", "4 bits", "Qwen2/3", "depths 0.1/0.3"):
        assert not FIGURE.search(definition), definition


@pytest.mark.parametrize("page", PAGES)
def test_references_can_be_followed(page):
    text = (ROOT / page).read_text()
    assert not UNFOLLOWABLE.findall(prose(text)), f"{page} points to something a reader cannot see"
    for target in re.findall(r"\]\(([^)#\s]+)\)", text):
        if not target.startswith(("http://", "https://")):
            assert ((ROOT / page).parent / target).exists(), f"{page}: broken link {target}"


def test_front_matter_stays_first():
    assert (ROOT / "README.md").read_text().startswith("---\ntitle: ")


def test_readme_picture_is_a_small_crop():
    from PIL import Image

    text = (ROOT / "README.md").read_text()
    first_screen = text.split("\n## ", 1)[0]
    assert first_screen.count("![") == 1 and quoted.PICTURE in first_screen
    assert "make demo" in first_screen and "make test" in first_screen
    shot, pic = Image.open(ROOT / quoted.SCREENSHOT), Image.open(ROOT / quoted.PICTURE)
    assert pic.width < shot.width and pic.height < shot.height / 2
    assert (ROOT / quoted.PICTURE).stat().st_size < 150_000


def test_headline_says_what_the_tables_say():
    """The headline quotes kitty's perplexity change and never calls it lossless or accuracy-preserving."""
    first_screen = (ROOT / "README.md").read_text().split("\n## ", 1)[0]
    change = quoted.by_method("ppl_full", text="all")["kitty"]["ppl_change"]
    assert quoted.pct(change) in first_screen
    assert not re.search(r"keep(s)? (their|its) accuracy|lossless|no accuracy loss", first_screen, re.I)


def test_notebook_05_prints_the_figures_the_pages_quote():
    """Notebook 05's committed summary reads the same file with the same arithmetic as docs/GPU.md."""
    nb = json.loads((ROOT / "notebooks" / "05_fast_2bit_attention.ipynb").read_text())
    out = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))
    k = quoted.kernel_summary()
    span = lambda key, f: "–".join(f.format(x) for x in k[key])  # noqa: E731
    assert f"kitty: {span('copy_kitty', '{:.0f}')}% of copy bandwidth on the bytes" in out
    assert f"costs {span('spike', '{:.2f}')}x an ordinary step" in out
    assert f"pack is {span('pack', '{:.2f}')}% of attention" in out


def test_every_results_file_exists():
    """Each results file the pages quote is where docs/quoted.py's RESULTS says (a move is one edit there)."""
    for key, rel in quoted.RESULTS.items():
        assert (ROOT / rel).is_file(), f"RESULTS[{key!r}] = {rel!r} is missing"


def test_quoted_gluon_cells_are_the_default_launch(monkeypatch):
    """The rows that docs/GPU.md quotes as the Gluon kernel's default launch are the launch `default_gluon_launch`
    gives for that shape: at batch 1, 4 tail programs at (1, 32K) and 8 at (1, 4K)."""
    from kitty.kernels import gluon_launch as gl

    d = json.loads((ROOT / "benchmarks/results/h200-2026-12-06/gluon_check.json").read_text())
    sms = d["env"]["sms"]
    monkeypatch.setattr(gl, "num_sms", lambda device: sms)
    picked = [r for r in d["timing"] if " gluon" in r["method"] and quoted.gluon_default_row(r, sms=sms)]
    for L in (32768, 4096):
        rows = [r for r in picked if (r["B"], r["L"]) == (1, L)]
        pages = (L - 32) // 128 + 1  # the key page table's columns + 1, as the wrapper
        launch = gl.default_gluon_launch(1, 8, pages, "cuda")
        assert rows and all((r["splits"], r["tail_splits"]) == (launch.num_splits, launch.tail_splits) for r in rows)
