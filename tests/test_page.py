"""The browser page at ``GET /`` in a real browser: Debian's Chromium, headless, driven
by Playwright (no browser download), against a real stack with auth on.

Chromium's fake microphone plays an espeak-ng WAV in a loop; the page streams it
through its AudioWorklet (resampled to 16 kHz) over ``/v1/stream`` and the words
must show up in its transcript. An upload through the file input must reach
``completed`` and show the text, word timings and an SRT download.

Set ``LANEGATE_SCREENSHOTS=docs`` to write the README's screenshots
(``page-stream.png``, ``page-upload.png``) there instead of a temporary folder.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from phrases import MOST, SHORT, recall
from playwright.sync_api import Browser, Page, expect, sync_playwright
from stack import Stack, start_stack

CHROMIUM = "/usr/bin/chromium"
KEY = "page-key"
#: seconds for the looped speech to come back as finals (the file is about 7 s long)
LIVE_TIMEOUT_S = 60.0
#: an upload goes through the batch lane: queue, decode, transcribe
UPLOAD_TIMEOUT_MS = 90_000
PHONE = {"width": 390, "height": 844}

pytestmark = pytest.mark.skipif(shutil.which(CHROMIUM) is None,
                                reason="Debian's chromium is not installed")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_stack(tmp_path_factory.mktemp("page-stack"),
                          settings={"LANEGATE_API_KEYS": KEY})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def capture_wav(speech: Callable[..., Path]) -> Path:
    # 48 kHz like a real microphone: the worklet's resampling is part of what is tested
    return speech(SHORT, rate=48000)


@pytest.fixture(scope="module")
def browser(capture_wav: Path) -> Iterator[Browser]:
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox",  # the tests may run as root
            "--use-fake-ui-for-media-stream",
            "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={capture_wav}",
        ])
        yield chromium
        chromium.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("LANEGATE_SCREENSHOTS") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)
    return target


def _open(browser: Browser, stack: Stack, **context: Any) -> Page:
    page = browser.new_context(**context).new_page()
    page.goto(stack.url + "/")
    page.get_by_label("API key").fill(KEY)
    return page


def test_microphone_words_appear_live(browser: Browser, stack: Stack, shots: Path) -> None:
    page = _open(browser, stack, viewport={"width": 1000, "height": 900})
    mic = page.locator("#mic")
    expect(mic).to_have_accessible_name("Start microphone")
    mic.focus()
    page.keyboard.press("Enter")  # usable from the keyboard
    expect(page.locator("#mic-status")).to_contain_text("Listening", timeout=15_000)
    expect(mic).to_have_attribute("aria-pressed", "true")

    finals = page.locator("#finals")
    deadline = time.monotonic() + LIVE_TIMEOUT_S
    text = ""
    while time.monotonic() < deadline:
        text = finals.inner_text()
        if recall(SHORT, text) >= MOST:
            break
        page.wait_for_timeout(500)
    assert recall(SHORT, text) >= MOST, f"finals so far: {text!r}"
    assert finals.get_attribute("aria-live") == "polite"
    page.screenshot(path=str(shots / "page-stream.png"), full_page=True)

    page.get_by_role("button", name="Stop microphone").click()
    expect(page.locator("#mic-status")).to_have_text("Done.", timeout=15_000)
    assert page.locator("#error").inner_text() == ""
    page.context.close()


def test_upload_reaches_completed_with_text(browser: Browser, stack: Stack, shots: Path,
                                            capture_wav: Path) -> None:
    page = _open(browser, stack, viewport=PHONE, is_mobile=True, has_touch=True,
                 accept_downloads=True)
    page.get_by_label("Audio or video file").set_input_files(str(capture_wav))
    page.get_by_role("button", name="Transcribe").click()

    expect(page.locator("#job-status")).to_have_text("completed", timeout=UPLOAD_TIMEOUT_MS)
    expect(page.locator("#progress")).to_have_attribute("value", "1")
    text = page.locator("#result-text").inner_text()
    assert recall(SHORT, text) >= MOST, text
    page.get_by_text("Word timings").click()
    assert page.locator("#words tr").count() >= 5

    with page.expect_download() as download:
        page.get_by_role("button", name="Download SRT").click()
    srt = Path(download.value.path()).read_text()
    assert " --> " in srt
    assert recall(SHORT, srt) >= MOST

    # readable on a phone: nothing wider than the screen
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0
    page.screenshot(path=str(shots / "page-upload.png"), full_page=True)
    page.context.close()
