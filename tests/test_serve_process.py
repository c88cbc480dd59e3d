"""``mlx-chatterbox serve`` as a process: a tiny converted model, real signals (shutdown), the flags for API keys
and CORS, checked with the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI

from mlx_chatterbox.convert import convert
from tests.conftest import TINY_MODEL, random_voice, write_upstream_checkpoint

ROOT = Path(__file__).resolve().parents[1]
# About 80 pieces of up to ~20 s: thousands of speech tokens, many seconds even for the tiny model.
LONG_TEXT = " ".join(["This sentence is here to make the speech long."] * 85)[:4096]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("model")
    random_voice(seed=7).save(tmp / "voice.safetensors")  # the tiny model has no built-in voice
    return convert(write_upstream_checkpoint(tmp / "up"), tmp / "mlx", config=TINY_MODEL)


class Serve:
    """A running ``serve`` process on a free local port; its stderr is read once it has exited."""

    def __init__(self, model: Path, voices: Path, *args: str, env: dict | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable,
            "-m",
            "mlx_chatterbox",
            "serve",
            "--model",
            str(model),
            "--voices",
            str(voices),
        ]
        argv += ["--voice", str(model.parent / "voice.safetensors")]
        argv += ["--port", str(self.port), *args]
        env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"serve exited: {self.proc.stderr.read()}"
            assert time.monotonic() < deadline, "serve did not start"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> tuple[int, str]:
        """(exit code, stderr); fails if the process is still running after ``timeout`` seconds."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"serve still running {timeout} s later: {self.proc.communicate()[1]}")
        return code, self.proc.stderr.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def serve(model, tmp_path):
    started = []

    def start(*args: str, env: dict | None = None) -> Serve:
        started.append(Serve(model, tmp_path / "voices", *args, env=env))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def speech_body(text: str = LONG_TEXT, **extra) -> dict:
    return {"model": "tts-1", "input": text, "response_format": "pcm", "seed": 1, **extra}


def test_sigterm_refuses_new_requests_cuts_streams_at_the_timeout_and_exits_0(serve):
    s = serve("--shutdown-timeout", "1", "--host", "0.0.0.0")
    health = httpx.get(f"{s.url}/health").json()
    assert health["cfm_steps"] == 10  # the decoder's steps in effect (issue 27 item 5), not null
    url = f"{s.url}/v1/audio/speech"

    def sse() -> list[dict]:
        with httpx.stream("POST", url, json=speech_body(stream_format="sse"), timeout=60) as r:
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]

    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(httpx.post, url, json=speech_body(stream=False), timeout=60)
        events = pool.submit(sse)
        with httpx.stream("POST", url, json=speech_body(), timeout=60) as r:
            assert r.status_code == 200
            raw = r.iter_raw()
            received = len(next(raw))
            while httpx.get(f"{s.url}/health").json()["queue"] < 3:  # all three running
                time.sleep(0.05)
            s.signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(url, json=speech_body("Hi."), timeout=10)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "shutting_down"
            assert httpx.get(f"{s.url}/health", timeout=10).status_code == 503
            start = time.monotonic()
            received += sum(len(b) for b in raw)  # the stream ends cleanly (a chunked body's last chunk)
            cut_after = time.monotonic() - start
        cut = whole.result()
        assert cut.status_code == 503 and "--shutdown-timeout" in cut.json()["error"]["message"]
        events = events.result()
    assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "error"
    assert events[-1]["error"]["code"] == "shutting_down"
    assert received % 2 == 0 and received < 80 * 20 * 24000 * 2  # 16-bit samples, far from all of the text
    assert cut_after < 1 + 3 + 2  # the timeout, the grace for the cut responses, slack for a busy machine
    code, err = s.wait(15)
    assert code == 0, err
    assert "without an API key" in err  # --host 0.0.0.0 and no key
    assert "SIGTERM: shutting down" in err and "cancelled 3 speech request" in err


def test_sigint_lets_requests_in_flight_finish(serve):
    s = serve("--shutdown-timeout", "60", "--api-key", "k1")
    client = OpenAI(base_url=f"{s.url}/v1", api_key="k1", max_retries=0)
    body = {"seed": 2, "max_new_tokens": 30, "stream": True}
    args = dict(model="tts-1", voice="default", input="Hello there.", response_format="pcm", extra_body=body)
    whole = client.audio.speech.create(**args).content
    with client.audio.speech.with_streaming_response.create(**args) as r:
        chunks = r.iter_bytes()
        first = next(chunks)
        s.signal(signal.SIGINT)
        data = first + b"".join(chunks)
    assert data == whole  # finished, not cut
    code, err = s.wait(20)  # exits once the stream ended, long before the 60 s
    assert code == 0, err
    assert "SIGINT: shutting down" in err and "cancelled" not in err and "without an API key" not in err


def test_second_signal_exits_at_once_and_cors_is_same_origin_by_default(serve):
    s = serve("--shutdown-timeout", "60")
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(f"{s.url}/v1/audio/speech", headers=preflight)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{s.url}/v1/models", headers={"Origin": "http://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    with httpx.stream("POST", f"{s.url}/v1/audio/speech", json=speech_body(), timeout=60) as r:
        raw = r.iter_raw()  # kept: a dropped iterator would close the connection at once
        next(raw)
        s.signal(signal.SIGTERM)
        time.sleep(0.3)
        s.signal(signal.SIGTERM)
        code, err = s.wait(5)
    assert code == 128 + signal.SIGTERM, err
    assert "SIGTERM again: exiting now" in err


def test_api_keys_and_cors(serve):
    origin = "http://app.example"
    s = serve(
        "--api-key",
        "k1",
        "--allowed-origins",
        f"{origin},http://other.example",
        env={"MLX_CHATTERBOX_API_KEY": "k2, k3"},
    )
    for key in ("k1", "k3"):
        client = OpenAI(base_url=f"{s.url}/v1", api_key=key, max_retries=0)
        assert "tts-1" in [m.id for m in client.models.list()]
        pcm = client.audio.speech.create(
            model="tts-1",
            voice="default",
            input="Hi.",
            response_format="pcm",
            extra_body={"max_new_tokens": 4, "seed": 3},  # unseeded, ~1 in 100 has no speech token
        ).content
        assert 0 < len(pcm) <= 4 * 960 * 2
    client = OpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        client.audio.speech.create(model="tts-1", voice="default", input="Hi.")
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.post(f"{s.url}/v1/audio/speech", json=speech_body("Hi."))  # no Authorization header
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    for path in ("/v1/models", "/v1/audio/voices", "/audio/speech", "/docs"):
        r = httpx.get(f"{s.url}{path}")
        assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"], path
    assert httpx.get(f"{s.url}/health").json()["auth"] is True  # open, and says a key is needed
    # CORS: a preflight from an allowed origin is answered (without a key), another origin's is not.
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = httpx.options(f"{s.url}/v1/audio/speech", headers={"Origin": origin, **preflight})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.options(f"{s.url}/v1/audio/speech", headers={"Origin": "http://evil.example", **preflight})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{s.url}/v1/models", headers={"Origin": origin})  # a 401 the page can read
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin
    # A speech response's Server-Timing is exposed to the page's fetch().
    body = speech_body("Hi.", max_new_tokens=4, seed=3)
    r = httpx.post(
        f"{s.url}/v1/audio/speech", json=body, headers={"Origin": origin, "Authorization": "Bearer k1"}
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    assert (
        r.headers["access-control-expose-headers"] == "Server-Timing"
        and "first-audio" in r.headers["server-timing"]
    )
    s.signal(signal.SIGTERM)
    assert s.wait(15)[0] == 0


def test_vocoding_process_serves_streams(serve):
    """``--vocoding process`` through the CLI: S3Gen's work runs in a child process that keeps the server's
    MLX_USE_CUDA_GRAPHS (here none, so MLX's default, and the estimator's products ours where they apply; logged
    with -v), a streamed request comes back whole, the health check reports where vocoding runs; killed, the
    child is replaced at once (/health degraded meanwhile; counted in /metrics) and serves the next request;
    SIGTERM stops both processes."""
    s = serve("-v", "--vocode-thread", "on", "--vocoding", "process", env={"MLX_USE_CUDA_GRAPHS": ""})
    assert httpx.get(f"{s.url}/health").json()["vocoding"] == "process"
    client = OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
    body = {"seed": 2, "max_new_tokens": 30, "stream": True}
    args = dict(model="tts-1", voice="default", input="Hello there.", response_format="pcm", extra_body=body)
    with client.audio.speech.with_streaming_response.create(**args) as r:
        streamed = b"".join(r.iter_bytes())
    assert 0 < len(streamed) <= 30 * 960 * 2
    # The vocoding process is the server's child started by multiprocessing's spawn (not its resource tracker).
    child = subprocess.run(
        ["pgrep", "-P", str(s.proc.pid), "-f", "spawn_main"], capture_output=True, text=True
    )
    (pid,) = child.stdout.split()
    os.kill(int(pid), signal.SIGKILL)
    # /health is a 503 until the new process runs (a balancer steps aside), then ok again, unasked
    health, end = [], time.monotonic() + 60
    while (not health or health[-1][0] != 200) and time.monotonic() < end:
        r = httpx.get(f"{s.url}/health")
        health.append((r.status_code, r.json()["status"], r.json().get("error")))
        time.sleep(0.01)
    assert (503, "degraded", "RuntimeError: the vocoding process ended (exit code -9)") in health, health
    assert health[-1] == (200, "ok", None)
    with client.audio.speech.with_streaming_response.create(**args) as r:
        again = np.frombuffer(b"".join(r.iter_bytes()), np.int16)
    # The same seed through the new process: the same audio, up to where its decodes fell (the stream's catch-up
    # merges decodes by timing; the chunk seams then differ: 1.1e-2 seen).
    first = np.frombuffer(streamed, np.int16).astype(float)
    assert len(again) == len(first) and np.linalg.norm(again - first) / np.linalg.norm(first) < 5e-2
    metrics = httpx.get(f"{s.url}/metrics").text
    assert "\nmlx_chatterbox_vocoder_restarts_total 1\n" in metrics
    s.signal(signal.SIGTERM)
    code, err = s.wait(20)
    assert code == 0, err
    assert err.count("runs MLX with MLX_USE_CUDA_GRAPHS=, the estimator on our tiled products") == 2
    assert "the vocoding process died: the vocoding process ended (exit code -9)" in err
    assert "a new vocoding process runs (restart 1)" in err
