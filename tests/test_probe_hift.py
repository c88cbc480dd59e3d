"""benchmarks/probe_hift.py: a smoke run on a small HiFT, every way (on the CPU the convolutions are our
products whatever the switches)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_probe_writes_a_line_per_way(tmp_path):
    out = tmp_path / "hift.jsonl"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probe_hift.py"), "--repeats", "1", "--frames", "25",
         "--base-channels", "32", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["way"] for line in lines] == ["cudnn", "kernel"]
    for line in lines:
        assert line["frames"] == 25 and line["warm_ms"] > 0 and line["four_rows_ms"] > 0
        assert len(line["new_length_ms"]) == 6 and min(line["new_length_ms"]) > 0 and line["primitives"] > 100
    assert "25 frames ms" in run.stdout


def test_the_stream_decode_replay_writes_a_line_per_way_and_round(tmp_path):
    """benchmarks/probe_stream_decode.py on the tests' tiny networks: 2 streams to their ends, both ways."""
    out = tmp_path / "stream_decode.jsonl"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probe_stream_decode.py"), "--tiny", "--streams", "2",
         "--rounds", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(line["way"], line["round"]) for line in lines] == [("cudnn", 0), ("kernel", 0)]
    for line in lines:
        # 150-350 tokens a stream, 10 a round: a first chunk, doubling chunks, and an end each.
        assert 6 <= line["audio_s"] <= 28 and line["calls"] >= 4 and 1 <= line["rows_per_call"] <= 2
        assert 1 <= line["split_calls"] <= line["calls"] and line["total_s"] > line["hift_total_s"] > 0
        assert line["s3gen_ms"] > 0 and line["hift_ms"] > 0
    assert "| kernel | 0 |" in run.stdout
