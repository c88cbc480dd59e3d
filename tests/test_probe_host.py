"""benchmarks/probe_host.py: the summary of py-spy's raw samples (a written file, no sampler needed) and a smoke run
of its watermark workload."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import probe_host  # noqa: E402

SERVE = 'process 10:"python -m mlx_chatterbox serve --model m"'
CHILD = 'process 11:"python -B -c from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle=8)"'
# py-spy's raw format: frames from the root, ";"-separated, then the sample count.
RAW = [
    "0x1 (libc.so.6);<module> (probe_host.py:1);profiled (probe_host.py:70);once (probe_host.py:50);"
    "S3Gen.batch (mlx_chatterbox/generation/vocode.py:280);mlx::core::eval (libmlx.so);"
    "mlx::core::cu::CommandEncoder::add_kernel_node(void*, dim3) (libmlx.so) 6",
    "0x1 (libc.so.6);<module> (probe_host.py:1);profiled (probe_host.py:70);once (probe_host.py:50);"
    "Estimator.__call__ (mlx_chatterbox/models/cfm.py:300) 3",
    "0x1 (libc.so.6);<module> (probe_host.py:1);profiled (probe_host.py:70);mlx::core::synchronize (libmlx.so);"
    "__futex_abstimed_wait_common (libc.so.6) 1",
    "0x1 (libc.so.6);<module> (probe_host.py:1);random_s3gen (probe_s3gen.py:55) 90",  # model building: left out
]


def test_the_summary_keeps_the_loop_and_names_what_worked_and_what_waited(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text("\n".join(RAW) + "\n")
    row = probe_host.summarize(str(raw), top=10)
    assert row["samples"] == 10 and row["waiting_pct"] == 10.0
    assert dict(row["python_innermost"]) == {
        "S3Gen.batch (mlx_chatterbox/generation/vocode.py)": 60.0,
        "Estimator.__call__ (mlx_chatterbox/models/cfm.py)": 30.0,
    }
    # C++ names without argument lists; inclusive shares count a function once a sample.
    assert dict(row["native_self"]) == {"mlx::core::cu::CommandEncoder::add_kernel_node": 60.0}
    assert dict(row["native_inclusive"])["mlx::core::eval"] == 60.0
    assert dict(row["library_self"]) == {"libmlx.so": 60.0}


def test_a_served_run_is_summed_by_process_and_thread(tmp_path):
    """``--subprocesses --threads`` put the process and the thread first; a command's ";" is no frame border."""
    raw = tmp_path / "spy.txt"
    raw.write_text(
        f"{SERVE};thread (12): mlx-chatterbox-worker;step (batch.py:10);mlx::core::async_eval (libmlx.so) 3\n"
        f"{SERVE};{CHILD};thread (11): MainThread;decode (stream.py:5) 1\n"
    )
    everything = probe_host.summarize(str(raw), top=10, within="")
    assert dict(everything["roots"]) == {
        "python -m mlx_chatterbox serve / mlx-chatterbox-worker": 75.0,
        "python -m mlx_chatterbox serve / python -B -c from / MainThread": 25.0,
    }
    worker = probe_host.summarize(str(raw), top=10, within="mlx-chatterbox-worker")
    assert worker["samples"] == 3 and dict(worker["python_innermost"]) == {"step (batch.py)": 100.0}
    with pytest.raises(SystemExit, match="no sample under"):
        probe_host.summarize(str(raw), top=10, within="nothing-of-the-kind")


def test_the_watermark_workload_runs_and_times_its_loop(tmp_path):
    out = tmp_path / "host.jsonl"
    argv = [sys.executable, "benchmarks/probe_host.py", "--workload", "mark", "--seconds", "0.5", "--warm", "0",
            "--out", str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (row,) = map(json.loads, out.read_text().splitlines())
    assert row["workload"] == "mark" and row["calls"] >= 1 and row["ms_per_call"] > 0
