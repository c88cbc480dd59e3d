"""benchmarks/probe_first_audio.py (a smoke run on the CPU, tiny networks): a lone stream's first audio by event,
through TTS.stream and the Worker, each part inside the whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_serve_process import model  # noqa: F401  (the fixture: a tiny converted model)

ROOT = Path(__file__).resolve().parents[1]


def test_first_audio_parts_per_mode(tmp_path, model):  # noqa: F811
    """A tiny converted folder (``--model``), as the vocoding process needs one."""
    out = tmp_path / "first_audio.jsonl"
    argv = [sys.executable, "benchmarks/probe_first_audio.py", "--model", str(model), "--voice",
            str(model.parent / "voice.safetensors"), "--cfm-dtype", "float32", "--device", "cpu", "--tokens", "20",
            "--repeats", "1", "--first-chunk", "8", "--modes", "stream,worker-inline,worker-process",
            "--out", str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {r["mode"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"stream", "worker-inline", "worker-process"}
    for row in rows.values():
        assert row["variant"] == "english" and row["first_chunk"] == 8 and len(row["runs"]) == 1
        # The first decode starts after T3's tokens and ends before the audio is read.
        assert 0 < row["to_decode_ms"] and 0 < row["decode_ms"]
        assert row["to_decode_ms"] + row["decode_ms"] <= row["first_audio_ms"]
    for worker in (rows["worker-inline"], rows["worker-process"]):
        # The Worker's batched T3 stepped at least once a token of the first chunk before the decode.
        assert worker["t3_steps"] >= 8 and worker["to_first_step_ms"] < worker["to_decode_ms"]
        assert worker["decode_end_to_put_ms"] >= 0 and worker["put_to_read_ms"] >= 0
    assert "| worker-inline |" in done.stdout and "| worker-process |" in done.stdout


def test_the_process_mode_needs_a_model_folder():
    argv = [sys.executable, "benchmarks/probe_first_audio.py", "--tiny", "--device", "cpu", "--modes",
            "worker-process"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "worker-process needs --model" in done.stderr


def test_the_plain_products_switch_needs_cuda():
    """--plain-products turns a CUDA kernel off: refused where it could not run (here, the CPU) rather than
    timing the same ops under two names."""
    argv = [sys.executable, "benchmarks/probe_first_audio.py", "--tiny", "--device", "cpu", "--modes", "stream",
            "--plain-products"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--plain-products turns off a CUDA kernel" in done.stderr
