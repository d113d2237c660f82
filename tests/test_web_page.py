"""The web page at ``/`` in a real browser: Debian's headless Chromium, driven by Python playwright, against a
real ``mossrt serve`` process. It loads, lists the voices, speaks a typed sentence over the WebSocket and
plays the binary PCM frames with Web Audio (headless Chromium plays into a fake output device).

Chromium comes from the distribution (``bash .ci/install-debian.sh`` installs it), not from
``playwright install``: the test skips, loudly, when ``/usr/bin/chromium`` is missing.

``MOSSRT_SAVE_SCREENSHOT=1`` also copies the screenshot to ``tests/artifacts/web_page.png``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from service_helpers import Server

CHROMIUM = Path(os.environ.get("MOSSRT_CHROMIUM", "/usr/bin/chromium"))
ARTIFACT = Path(__file__).parent / "artifacts" / "web_page.png"
SENTENCE = "Hello from the browser test. The page streams this text and plays the audio as it arrives."
SPEAK_TIMEOUT_S = 60
CHROMIUM_ARGS = [
    "--no-sandbox",                  # CI containers run as root, where the sandbox cannot start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",  # AudioContext starts "running" without a gesture
    "--no-proxy-server",             # loopback only: never route the page through a CI proxy
]


@pytest.fixture(scope="module")
def chromium(request) -> Path:
    """Debian's chromium, or a loud skip (before anything is built or started)."""
    if not CHROMIUM.exists():
        banner = (f"\n{'#' * 78}\n# SKIPPED tests/test_web_page.py: the web page test needs Debian's chromium at "
                  f"{CHROMIUM}.\n# Install it with:  bash .ci/install-debian.sh   (apt-get install chromium)\n"
                  f"{'#' * 78}")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if capture is not None:
            with capture.global_and_fixture_disabled():
                print(banner, flush=True)
        else:
            print(banner)
        pytest.skip(f"chromium not installed at {CHROMIUM}: run `bash .ci/install-debian.sh` to install it")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    return CHROMIUM


@pytest.fixture(scope="module")
def server(chromium, full_bundle_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("web")
    with Server(full_bundle_dir, tmp / "voices", tmp / "server.log", "--max-streams", "2") as s:
        yield s


@pytest.fixture
def browser_page(chromium, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # a fresh profile per test; headless Chromium plays Web Audio into its fake output device
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=str(chromium), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 900, "height": 900})
        try:
            page = context.pages[0] if context.pages else context.new_page()
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            failed: list[str] = []
            page.on("response", lambda r: failed.append(f"{r.status} {r.request.method} {r.url}")
                    if r.status >= 400 and not r.url.endswith("/favicon.ico") else None)
            page.console_lines, page.failed_responses = console, failed
            yield page
        finally:
            context.close()


def _state(page) -> dict:
    """What the page shows, and the state of its audio player (app.js's script-level bindings)."""
    return page.evaluate("""() => ({
        status: document.getElementById("status").textContent,
        ttfa: document.getElementById("ttfa").textContent,
        seconds: document.getElementById("seconds").textContent,
        frames: document.getElementById("frames").textContent,
        rtf: document.getElementById("rtf").textContent,
        log: document.getElementById("log").textContent,
        audio: typeof audioCtx === "undefined" || audioCtx === null ? null : {
            state: audioCtx.state, sampleRate: audioCtx.sampleRate, currentTime: audioCtx.currentTime,
            scheduledUntil: playAt, playedFrames: frames, playedSamples: samples},
    })""")


def test_page_speaks_a_typed_sentence(server, browser_page, tmp_path):
    page = browser_page
    started = time.monotonic()
    page.goto(server.base + "/", wait_until="load")
    assert "mossrt" in page.title()
    page.wait_for_function("() => document.querySelectorAll('#voice option').length > 0", timeout=10_000)
    voices = page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)")
    assert "default" in voices, voices
    assert page.input_value("#voice") == "default"
    assert page.text_content("#status") == "idle"
    assert page.is_disabled("#stop")

    page.fill("#text", SENTENCE)
    page.check("#typing")                       # the LLM-like deltas path: several input.text messages
    page.click("#speak")
    try:
        page.wait_for_function(
            """() => document.getElementById("status").textContent.startsWith("done")
                     || document.getElementById("status").textContent.startsWith("error")""",
            timeout=SPEAK_TIMEOUT_S * 1000)
    except Exception:
        pytest.fail(f"the page did not finish speaking in {SPEAK_TIMEOUT_S} s: {_state(page)}\n"
                    f"console: {page.console_lines}\nserver log:\n{server.log()[-3000:]}")
    # let the scheduled audio start playing so the context's clock has visibly moved
    page.wait_for_timeout(300)
    state = _state(page)
    shot = tmp_path / "web_page.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("MOSSRT_SAVE_SCREENSHOT") == "1":
        ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, ARTIFACT)
    print(f"\nweb page: {time.monotonic() - started:.1f} s; status {state['status']!r}, ttfa {state['ttfa']!r}, "
          f"audio {state['seconds']!r}, frames {state['frames']!r}, rtf {state['rtf']!r}; "
          f"AudioContext {state['audio']}; screenshot {shot}")

    detail = f"{state}\nconsole: {page.console_lines}"
    assert state["status"].startswith("done ("), detail
    assert re.fullmatch(r"\d+ ms", state["ttfa"]), detail
    assert int(state["frames"]) > 0, detail
    assert re.fullmatch(r"\d+\.\d\d s", state["seconds"]) and float(state["seconds"].split()[0]) > 0, detail
    assert state["rtf"] != "–", detail

    # the protocol log: the session, the voice and format update, one response and its end
    events = [line for line in state["log"].splitlines() if line]
    kinds = [re.search(r'"type":"([^"]+)"', e).group(1) for e in events]
    assert kinds[0] == "session.created", kinds
    for kind in ("session.updated", "response.created", "response.done"):
        assert kind in kinds, kinds
    # the random-weight test bundle may end a turn (EOS) while the page is still typing: the server then
    # refuses the late text with response_ended, which is the protocol working; any other error is not
    errors = [json.loads(e) for e in events if '"type":"error"' in e]
    assert all(e["error"]["code"] == "response_ended" for e in errors), errors
    done = next(e for e in events if '"type":"response.done"' in e)
    frames_done = int(re.search(r'"frames":(\d+)', done).group(1))

    # binary frames were received and handed to Web Audio: one buffer source per frame, scheduled back to back
    audio = state["audio"]
    assert audio is not None, detail
    assert audio["state"] == "running", detail
    assert audio["sampleRate"] == 24000, detail
    assert audio["playedFrames"] == int(state["frames"]) > 0, detail
    assert audio["playedFrames"] <= frames_done, (audio, done)
    assert audio["playedSamples"] > 0 and audio["scheduledUntil"] > 0, detail
    assert audio["currentTime"] > 0, detail     # the context's clock runs: the audio is being played
    # no script error, and no failed request (the browser's own /favicon.ico probe aside: the page has none)
    assert not [line for line in page.console_lines if line.startswith("pageerror")], page.console_lines
    assert not [line for line in page.console_lines
                if line.startswith("error") and "Failed to load resource" not in line], page.console_lines
    assert not page.failed_responses, page.failed_responses
