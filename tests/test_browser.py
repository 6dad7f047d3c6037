"""The demo in a real browser: Playwright drives Debian's chromium (never ``playwright install``).

Opens the page and presses Generate on what it shows (the default prompt: a long document), waits until all three
columns stream text and show readouts, checks the readouts in the DOM against the analytic memory model (the kitty
column compresses on this first run), opens the Inside tab (filled before any click), then runs the short example
and checks the page-start note. Saves the screenshots the README uses (``assets/demo_screenshot*.png``).
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
ASSETS = Path(__file__).resolve().parent.parent / "assets"
SCREENSHOTS = {"generate": ASSETS / "demo_screenshot.png", "inside": ASSETS / "demo_screenshot_inside.png"}

pytestmark = [
    pytest.mark.skipif(
        not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing (`make chromium` installs Debian's chromium)"
    ),
    pytest.mark.timeout(420),
]


def parse_readout(text: str) -> dict:
    """Numbers from one column's readout as the browser renders it."""
    num = r"([\d.]+)"
    out = {
        "bits": float(re.search(rf"{num} bits/element", text).group(1)),
        "tokens": int(re.search(r"cached\s+(\d+) tokens", text).group(1)),
        "new": int(re.search(r"tokens \((\d+) new\)", text).group(1)),
        "tok_s": float(re.search(rf"speed\s+{num} tok/s", text).group(1)),
        "text": text,
    }
    if "all full precision" in text:
        out["compression"], out["stored"] = 1.0, (re.search(r"\(1\.00×\) · (.+)", text).group(1).strip(),) * 2
        return out
    out["compression"] = float(m.group(1)) if (m := re.search(rf"{num}× smaller than fp16", text)) else 1.0
    out["stored"] = re.search(r"· (\S+ \S+) of (\S+ \S+)", text).groups()
    k = re.search(r"K: sink (\d+) · (\d+) in (\d+) pages? · qbuffer (\d+)", text)
    v = re.search(r"V: sink (\d+) · (\d+) in (\d+) pages? · qbuffer (\d+) · local (\d+)", text)
    out["keys"], out["values"] = tuple(map(int, k.groups())), tuple(map(int, v.groups()))
    out["long"] = float(re.search(rf"long context\s+{num} bits/element", text).group(1))
    return out


def wait_done(page, timeout_ms: int) -> None:
    page.wait_for_function("document.querySelector('#summary').innerText.includes('Done')", timeout=timeout_ms)
    page.wait_for_timeout(500)  # let the last plot update render


def test_generate_in_browser(demo_url, tmp_path):
    import time

    from playwright.sync_api import sync_playwright

    import app
    from kitty import PRESETS
    from kitty import demo as kd
    from kitty.demo_view import fmt_bytes
    from kitty.memory import analytic_report, asymptotic_bits, token_layout

    engine = app.get_engine(app.ARGS.model)
    update = os.environ.get("KITTY_UPDATE_SCREENSHOT") == "1"  # rewritten on request only: `make test` stays clean
    shots = SCREENSHOTS if update else {k: tmp_path / v.name for k, v in SCREENSHOTS.items()}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1500})
            page.goto(demo_url)
            page.wait_for_selector("#generate")
            # the first run as a new user makes it: the prompt box already holds the default long prompt
            assert page.locator("#prompt textarea").input_value() == app.examples()[0][1]
            t0 = time.perf_counter()
            page.locator("#generate").click()

            # every column streams: text in all three while the run is still going
            page.wait_for_function(
                "[0, 1, 2].every(i => document.querySelector(`#out-${i} textarea`).value.length > 0"
                " && document.querySelector(`#readout-${i}`).innerText.includes('cached'))",
                timeout=180_000,
            )
            assert "Done" not in page.locator("#summary").inner_text(), "the first text arrived only at the end"
            early = [page.locator(f"#out-{i} textarea").input_value() for i in range(3)]
            wait_done(page, 240_000)
            first_run_s = time.perf_counter() - t0
            # printed, never asserted: the speed is benchmarks/demo_timing.py's job, and a loaded CI machine varies
            print(f"default first generation: {first_run_s:.1f} s")

            texts = [page.locator(f"#out-{i} textarea").input_value() for i in range(3)]
            readouts = [parse_readout(page.locator(f"#readout-{i}").inner_text()) for i in range(3)]
            methods = [page.locator(f"#method-{i} input").input_value() for i in range(3)]
            summary = page.locator("#summary").inner_text()
            note = page.locator("#note").inner_text()
            page.screenshot(path=str(shots["generate"]), full_page=True)

            # the Inside tab is filled before any click there: no placeholder tables
            page.get_by_role("tab", name="Inside the cache").click()
            page.wait_for_selector("#inside-heatmap img", timeout=60_000)
            # opening the tab re-reads the prompt box: wait until that run has finished
            page.wait_for_timeout(1000)
            page.wait_for_function(
                "!['#inside-heatmap', '#inside-pages', '#inside-bits'].some("
                "s => document.querySelector(s).innerText.includes('processing'))",
                timeout=120_000,
            )
            inside = page.locator("#inside-pages").inner_text()
            bits_text = page.locator("#inside-bits").inner_text()
            intro = page.locator("#inside-intro").inner_text()
            page.wait_for_timeout(500)
            page.screenshot(path=str(shots["inside"]), full_page=True)

            # a short prompt: each quantizing column says when its pages start
            page.get_by_role("tab", name="Generate").click()
            page.get_by_text("Short chat question").first.click()
            page.wait_for_function("document.querySelector('#prompt textarea').value.length < 200")
            box = page.locator("#max-new input[type=number]")
            box.fill("3")
            box.press("Enter")
            page.locator("#generate").click()
            page.wait_for_function("!document.querySelector('#summary').innerText.includes('Done')", timeout=30_000)
            wait_done(page, 120_000)
            short = [page.locator(f"#readout-{i}").inner_text() for i in range(3)]
        finally:
            browser.close()

    assert methods == list(kd.DEFAULT_METHODS)
    prompt_tokens = int(re.search(r"Prompt: (\d+) tokens", note).group(1))
    for i, (method, text, r) in enumerate(zip(methods, texts, readouts)):
        assert text.strip() and text.startswith(early[i][: len(early[i]) // 2]), (
            f"column {i} text did not grow in place"
        )
        assert 1 <= r["new"] <= kd.DEFAULT_MAX_NEW_TOKENS and r["tokens"] == prompt_tokens + r["new"] - 1
        # the readout agrees with the analytic memory model for this many tokens
        cfg = PRESETS[method]
        rep = analytic_report(cfg, r["tokens"], engine.head_dim, engine.num_kv_heads, engine.num_layers)
        assert r["bits"] == pytest.approx(round(rep.bits_per_element, 2))
        assert r["compression"] == pytest.approx(round(rep.compression, 2))
        assert r["stored"][0] == fmt_bytes(rep.stored_bytes)
        assert r["tok_s"] > 0
        assert f"{i + 1} · {method}" in summary
        if method == "fp16":
            continue
        assert r["stored"][1] == fmt_bytes(rep.fp16_bytes)
        assert r["long"] == pytest.approx(round(asymptotic_bits(cfg, engine.head_dim)["total"], 2))
        lay = token_layout(cfg, r["tokens"])  # where the tokens live, from the layout formula
        G = cfg.group_size
        assert r["keys"] == (lay.sink, lay.key_pages * G, lay.key_pages, lay.key_qbuffer)
        assert r["values"] == (lay.sink, lay.value_pages * G, lay.value_pages, lay.value_qbuffer, lay.local)
        assert "nothing quantized yet" not in r["text"]
    fp16, kivi, kitty = readouts
    assert fp16["bits"] == 16.0 and "all full precision" in fp16["text"]
    assert kitty["bits"] < 16 and kitty["compression"] > 1.0, "the first run shows no compression"
    assert "Why more than 2 bits now" in summary

    assert "page 0" in inside and "qbuffer" in inside and "largest mean |K|" in intro
    assert "cache at 0 tokens" not in bits_text and "kitty" in bits_text

    cfg = PRESETS["kitty"]
    assert f"nothing quantized yet: pages start after {cfg.sink_tokens + cfg.group_size} tokens" in short[2]
    assert "all full precision" in short[0] and "nothing quantized" not in short[0]
    for path in shots.values():
        assert path.stat().st_size > 20_000
