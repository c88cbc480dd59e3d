"""benchmarks/bench_batch.py --closed-loop on a tiny T3 (a smoke run on the CPU): a server's batch, requests of
other budgets and texts replacing the finished ones, traced for its first shapes and then no more (ADR 14)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_closed_loop_rows(tmp_path):
    out = tmp_path / "batch.jsonl"
    argv = [sys.executable, "benchmarks/bench_batch.py", "--tiny", "--device", "cpu", "--concurrency", "4",
            "--tokens", "20", "--closed-loop", "16", "--repeats", "1", "--out", str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    single, cold, warm = [json.loads(line) for line in out.read_text().splitlines()]
    assert single["system"] == "single loop" and single["layers"] == 2
    assert [cold["system"], warm["system"]] == ["closed loop, cold", "closed loop, warm"]
    for row in (cold, warm):
        assert row["requests"] == 4 and row["total"] == 16 and row["tok_s"] > 0
        # 16 requests of 10 to 30 tokens, 4 at a time: each step a token for every live request.
        assert 16 * 10 / 4 <= row["steps"] <= 16 * 30 / 4 + 30 and row["join_steps"] >= 4
    assert cold["traces"] >= 1 and warm["traces"] == 0  # the warm run's shapes were all met cold
    assert "| closed loop, warm | 4 |" in done.stdout
