"""benchmarks/bench_e2e.py --built (a smoke run on the CPU): ours end to end on a model built with random weights,
the way the device machine measures text -> wav and its peak memory without upstream's checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "benchmarks/bench_e2e.py", "--device", "cpu", *args]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_built_model_row(tmp_path):
    out = tmp_path / "e2e.jsonl"
    done = run("--built", "tiny", "--tokens", "20", "--repeats", "1", "--cfm-dtype", "bfloat16",
               "--no-watermark", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (
        row["system"] == "ours" and row["model"].startswith("built tiny") and row["cfm_dtype"] == "bfloat16"
    )
    assert row["voice_s"] is None and row["clip_s"] is None  # no voice is cloned
    assert (
        row["audio_s"] == 20 * 0.04 and row["t3_s"] > 0 and row["s3gen_s"] > 0 and row["watermark_s"] < 0.01
    )
    assert row["peak_mem_bytes"] > 0
    # Each stage's peak, the row's the largest; every stage holds the weights, and the watermark is off.
    peaks = row["stage_peak_mib"]
    assert set(peaks) == {"t3_prefill", "t3", "s3gen", "watermark"}
    assert row["peak_mem_bytes"] // 2**20 <= max(peaks.values())
    assert min(peaks["t3_prefill"], peaks["t3"], peaks["s3gen"]) >= row["resident_mib"] - 1
    assert peaks["s3gen"] > peaks["watermark"]


def test_built_refuses_upstream_unknown_dtypes_and_plain_products_in_float32():
    done = run("--built", "tiny", "--systems", "ours,upstream")
    assert done.returncode == 2 and "--built runs ours alone" in done.stderr
    done = run("--built", "tiny", "--cfm-dtype", "int8")
    assert done.returncode == 2 and "--cfm-dtype int8" in done.stderr
    done = run("--built", "tiny", "--plain-products")  # the default float32 estimator
    assert done.returncode == 2 and "--plain-products applies to ours" in done.stderr
    done = run("--built", "tiny", "--cfm-dtype", "bfloat16", "--plain-products")  # --device cpu
    assert done.returncode == 2 and "--plain-products turns off a CUDA kernel" in done.stderr


def test_mark_spectra_and_memory_budget_rows_and_refusal(tmp_path):
    out = tmp_path / "e2e.jsonl"
    for spectra in ("device", "auto"):  # auto: the host on the CPU
        done = run("--built", "tiny", "--tokens", "20", "--repeats", "1", "--mark-spectra", spectra,
                   "--memory-budget", "64", "--out", str(out))  # fmt: skip
        assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["mark_on_device"] for row in rows] == [True, False]
    assert all(row["watermark"] is True and row["watermark_s"] > 0 for row in rows)
    assert rows[0]["memory_budget"] == 64 * 2**20
    done = run("--built", "tiny", "--mark-spectra", "host", "--no-watermark")
    assert done.returncode == 2 and "--mark-spectra applies to ours" in done.stderr


def test_tokens_spread_gives_each_run_its_length(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import request_budget

    out = tmp_path / "e2e.jsonl"
    done = run("--built", "tiny", "--tokens", "20", "--tokens-spread", "6", "--repeats", "3", "--no-watermark",
               "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    lengths = sorted(request_budget(20, 6, seed) for seed in (1, 2, 3))  # the timed runs' seeds
    assert len(set(lengths)) > 1 and row["tokens_spread"] == 6
    assert row["audio_s"] == round(lengths[1] * 0.04, 3)  # the median run's audio
    done = run("--built", "tiny", "--tokens", "20", "--tokens-spread", "20")
    assert done.returncode == 2 and "--tokens-spread 20: it must lie in [0, --tokens)" in done.stderr
