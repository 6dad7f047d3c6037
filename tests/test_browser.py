"""The demo in a real browser: Playwright drives Debian's chromium (never ``playwright install``).

Opens the page, picks the long-document example, clicks Generate, waits until all three columns stream text and
show readouts, checks the readouts in the DOM against the analytic memory model, and saves the screenshot the
README opens with (``assets/demo_screenshot.png``).
"""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# The README's screenshot is rewritten only on request (KITTY_UPDATE_SCREENSHOT=1), so `make test` leaves the tree clean.
README_SCREENSHOT = Path(__file__).resolve().parent.parent / "assets" / "demo_screenshot.png"
NEW_TOKENS = 24

pytestmark = [
    pytest.mark.skipif(
        not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing (`make chromium` installs Debian's chromium)"
    ),
    pytest.mark.timeout(300),
]


def parse_readout(text: str) -> dict:
    """Numbers from one column's readout as the browser renders it."""
    num = r"([\d.]+)"
    out = {
        "bits": float(re.search(rf"bits / element\s+{num}", text).group(1)),
        "compression": float(re.search(rf"compression\s+{num}×", text).group(1)),
        "tokens": int(re.search(r"tokens\s+(\d+) cached", text).group(1)),
        "new": int(re.search(r"cached \((\d+) new\)", text).group(1)),
        "tok_s": float(re.search(rf"speed\s+{num} tok/s", text).group(1)),
        "stored": re.search(r"KV stored\s+(.+?) of (.+?) fp16-equivalent", text).groups(),
    }
    k = re.search(r"K: sink (\d+) · pages (\d+) · qbuffer (\d+)", text)
    v = re.search(r"V: sink (\d+) · pages (\d+) · qbuffer (\d+) · local (\d+)", text)
    out["keys"], out["values"] = tuple(map(int, k.groups())), tuple(map(int, v.groups()))
    return out


def test_generate_in_browser(demo_url, tmp_path):
    from playwright.sync_api import sync_playwright

    import app
    from kitty import PRESETS
    from kitty import demo as kd
    from kitty.memory import analytic_report, token_layout

    engine = app.get_engine(app.ARGS.model)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1500})
            page.goto(demo_url)
            page.wait_for_selector("#generate")
            page.get_by_text("Long document + question (essay excerpt)").first.click()
            page.wait_for_function("document.querySelector('#prompt textarea').value.length > 1000")
            box = page.locator("#max-new input[type=number]")
            box.fill(str(NEW_TOKENS))
            box.press("Enter")
            page.locator("#generate").click()

            # every column streams: text in all three while the run is still going
            page.wait_for_function(
                "[0, 1, 2].every(i => document.querySelector(`#out-${i} textarea`).value.length > 0"
                " && document.querySelector(`#readout-${i}`).innerText.includes('cached'))",
                timeout=180_000,
            )
            assert "Done" not in page.locator("#summary").inner_text(), "the first text arrived only at the end"
            early = [page.locator(f"#out-{i} textarea").input_value() for i in range(3)]
            page.wait_for_function("document.querySelector('#summary').innerText.includes('Done')", timeout=240_000)
            page.wait_for_timeout(500)  # let the last plot update render before the screenshot

            texts = [page.locator(f"#out-{i} textarea").input_value() for i in range(3)]
            readouts = [parse_readout(page.locator(f"#readout-{i}").inner_text()) for i in range(3)]
            methods = [page.locator(f"#method-{i} input").input_value() for i in range(3)]
            summary = page.locator("#summary").inner_text()
            note = page.locator("#note").inner_text()
            shot = (
                README_SCREENSHOT
                if os.environ.get("KITTY_UPDATE_SCREENSHOT") == "1"
                else tmp_path / "demo_screenshot.png"
            )
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()

    assert methods == list(kd.DEFAULT_METHODS)
    prompt_tokens = int(re.search(r"Prompt: (\d+) tokens", note).group(1))
    for i, (method, text, r) in enumerate(zip(methods, texts, readouts)):
        assert text.strip() and text.startswith(early[i][: len(early[i]) // 2]), (
            f"column {i} text did not grow in place"
        )
        assert 1 <= r["new"] <= NEW_TOKENS and r["tokens"] == prompt_tokens + r["new"] - 1
        # the readout agrees with the analytic memory model for this many tokens
        rep = analytic_report(PRESETS[method], r["tokens"], engine.head_dim, engine.num_kv_heads, engine.num_layers)
        assert r["bits"] == pytest.approx(round(rep.bits_per_element, 2))
        assert r["compression"] == pytest.approx(round(rep.compression, 2))
        assert r["stored"] == (app.fmt_bytes(rep.stored_bytes), app.fmt_bytes(rep.fp16_bytes))
        assert r["tok_s"] > 0
        lay = token_layout(PRESETS[method], r["tokens"])  # where the tokens live, from the layout formula
        G = PRESETS[method].group_size
        assert r["keys"] == (lay.sink, lay.key_pages * G, lay.key_qbuffer)
        assert r["values"] == (lay.sink, lay.value_pages * G, lay.value_qbuffer, lay.local)
        assert f"{i + 1} · {method}" in summary
    fp16, kivi, kitty = readouts
    assert fp16["bits"] == 16.0 and fp16["compression"] == 1.0
    assert kivi["compression"] > kitty["compression"] > 1.0  # kitty keeps a sink and boosted channels: a bit bigger
    assert shot.stat().st_size > 20_000
