"""The playground page (``serve`` at ``/``) in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by scripts/install_test_tools.sh), against a live server with an API key: the key
prompt, Speak streaming into WebAudio and a WAV to download, a voice upload, and a refused upload's message.
"""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest
import soundfile as sf

from mlx_chatterbox.server.app import create_app
from mlx_chatterbox.server.voices import VoiceStore
from mlx_chatterbox.server.worker import Worker
from tests.conftest import random_voice
from tests.test_server import serving, tts  # noqa: F401  (the module's tiny model fixture)

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="no Chromium with chromedriver found (Debian: apt-get install chromium chromium-driver, as "
    "scripts/install_test_tools.sh does)",
)
KEY = "playground-key"


@pytest.fixture(scope="module")
def url(tts, tmp_path_factory):  # noqa: F811
    voices = VoiceStore(tmp_path_factory.mktemp("voices"), builtin=random_voice(seed=5))
    with Worker(tts, max_batch=4, max_queue=16) as worker:
        with serving(create_app(worker, voices, model_name="tiny", api_keys=[KEY])) as base:
            yield base


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--autoplay-policy=no-user-gesture-required",
        "--window-size=1100,1000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    yield driver
    driver.quit()


def wait_for(driver, script: str, timeout: float = 30):
    """The value of the JavaScript expression ``script`` once it is truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(f"return {script}")
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for: {script}"
        time.sleep(0.1)


def text_of(driver, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById('{element_id}').textContent")


def test_playground_in_chromium(url, browser, tmp_path):
    from selenium.webdriver.common.by import By

    b = browser
    b.get(f"{url}/")
    # Without a key: the server's 401 message, and the key prompt.
    wait_for(b, "document.body.dataset.state === 'error'")
    assert "needs an API key" in text_of(b, "error")
    assert b.find_element(By.ID, "key-box").is_displayed()
    b.find_element(By.ID, "api-key").send_keys(KEY)
    b.find_element(By.ID, "key-save").click()
    wait_for(b, "document.body.dataset.state === 'idle'")
    assert not b.find_element(By.ID, "error").is_displayed()
    assert "tiny" in [o.text for o in b.find_elements(By.CSS_SELECTOR, "#model option")]
    assert [o.text for o in b.find_elements(By.CSS_SELECTOR, "#voice option")] == ["default"]
    for knob in (
        "exaggeration",
        "cfg_weight",
        "temperature",
        "min_p",
        "max_new_tokens",
        "cfm_steps",
        "speed",
    ):
        assert b.find_element(By.ID, f"k-{knob}").get_attribute("max")
    # Speak: streamed pcm played through WebAudio, then a WAV in the player and the download link.
    text = b.find_element(By.ID, "text")
    text.clear()
    text.send_keys("Hello from the playground.")
    b.execute_script("const n = document.getElementById('n-max_new_tokens'); n.value = 30; n.oninput();")
    b.find_element(By.ID, "seed").send_keys("3")
    b.find_element(By.ID, "speak").click()
    wait_for(b, "document.body.dataset.state === 'done'", timeout=60)
    seconds = b.execute_script("return window.playground.audioSeconds")
    assert 0 < seconds <= 30 / 25 + 0.1  # 25 speech tokens per second of audio
    duration = wait_for(b, "document.getElementById('result').duration")
    assert abs(duration - seconds) < 0.01
    wait_for(b, "window.playground.playedSeconds >= window.playground.audioSeconds")  # WebAudio played it all
    assert "s of audio received" in text_of(b, "progress") and "elapsed" in text_of(b, "progress")
    # The time to the first audio, the client's and the server's (Server-Timing), which is within it.
    first, server_first = b.execute_script(
        "return [window.playground.firstAudio, window.playground.serverFirst]"
    )
    assert 0 < server_first <= first, (server_first, first)
    assert f"first audio after {first:.2f} s (the server's {server_first:.2f} s)" in text_of(b, "progress")
    assert b.find_element(By.ID, "download").get_attribute("href").startswith("blob:")
    # speed != 1 needs the whole audio (a time-stretch): asked for as one WAV, then played.
    b.execute_script("const n = document.getElementById('n-speed'); n.value = 2; n.oninput();")
    b.execute_script("document.body.dataset.state = ''")  # so that 'done' is this request's
    b.find_element(By.ID, "speak").click()
    wait_for(b, "document.body.dataset.state === 'done'", timeout=60)
    fast = wait_for(b, "document.getElementById('result').duration")
    assert abs(fast - seconds / 2) < 0.05  # the same seed, stretched to half the length
    b.execute_script("const n = document.getElementById('n-speed'); n.value = 1; n.oninput();")
    # A new voice from a recording: uploaded, listed and selected.
    clip = tmp_path / "me.wav"
    sf.write(clip, 0.1 * np.random.default_rng(0).standard_normal(32000), 16000)
    b.find_element(By.ID, "voice-name").send_keys("mine")
    b.find_element(By.ID, "voice-file").send_keys(str(clip))
    b.find_element(By.ID, "upload").click()
    wait_for(b, "document.getElementById('voice').value === 'mine'", timeout=60)
    shot = (
        tmp_path / "playground.png"
    )  # a test artifact; PLAYGROUND_SCREENSHOT=path copies it (README's image)
    assert b.save_screenshot(str(shot))
    if os.environ.get("PLAYGROUND_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["PLAYGROUND_SCREENSHOT"])
    # A refused request: the server's message, shown.
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not audio at all")
    b.find_element(By.ID, "voice-name").clear()
    b.find_element(By.ID, "voice-name").send_keys("other")
    b.find_element(By.ID, "voice-file").send_keys(str(bad))
    b.find_element(By.ID, "upload").click()
    wait_for(b, "document.getElementById('error').textContent")
    assert "bad.wav (16 bytes) is not audio this server can read" in text_of(b, "error")
    assert b.find_element(By.ID, "error").is_displayed()
