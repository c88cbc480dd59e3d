"""benchmarks/bench_serve.py, the load generator, against live tiny servers: one it starts itself
(--random tiny) for closed and open loops, streamed and whole; one started here (--url, --pid) for a short
--soak that samples RSS and MLX memory through ``/health?memory=true``. Each scenario's row says where the
server's worker spent it (``/metrics`` deltas)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from tests.test_serve_process import Serve, model  # noqa: F401  (model: the fixture, a tiny converted model)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import request_budget  # noqa: E402


def bench(*args: str, timeout: float = 120) -> str:
    argv = [sys.executable, "benchmarks/bench_serve.py", *args]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout


def check_sane(row: dict, requests: int, streamed: bool) -> None:
    assert row["requests"] == row["ok"] == requests and row["errors"] == {} and row["incomplete"] == 0
    assert row["audio_s"] > 0 and row["audio_per_wall"] > 0
    for name in ("ttfa_s", "e2e_s", "rtf"):
        assert 0 < row[name]["p50"] <= row[name]["p95"], (name, row[name])
    assert row["ttfa_s"]["p95"] <= row["e2e_s"]["p95"] + 1e-9
    if streamed:
        under = row["underruns"]
        assert 0 <= under["streams_stalled"] <= under["stalls"] and under["wait_s"] >= 0
        assert 0 <= under["wait_s_per_stream"]["p50"] <= under["wait_s_per_stream"]["max"] <= under["wait_s"]
    else:
        assert "underruns" not in row
    # The server's Server-Timing of every response, p50 in ms, in the order its steps happened; the headers come
    # before the client's first read (a stream's, its first audio; a whole one's, all of it).
    timing = row["server_timing_ms"]
    steps = ["admitted", "first-token", *(["first-chunk"] if streamed else []), "first-audio", "first-ready"]
    assert list(timing) == [*steps, "response"], timing
    p50 = [timing[name]["p50"] for name in timing]
    assert 0 <= p50[0] and p50 == sorted(p50) and p50[-1] <= 1000 * row["ttfa_s"]["p50"], timing
    assert row["machine_info"]["commit"] and row["server"]["variant"] == "english"
    assert 0 < row["mlx_memory"]["active"] <= row["mlx_memory"]["peak"]
    check_worker(row, streamed)


def check_worker(row: dict, streamed: bool) -> None:
    """The scenario's /metrics deltas: its requests finished, T3 stepped them, whole ones were vocoded and
    handed over (here without a vocoding thread: the tiny server runs on a CPU), streamed ones decoded and
    emitted; the worker thread's phases and the rest add up to the span between the two reads of /metrics."""
    w = row["worker"]
    assert w["requests"] == {"finished": row["requests"], "failed": 0, "cancelled": 0}
    phases = w["phases"]["worker"]
    assert set(w["phases"]) == {"worker"}
    assert phases["t3_step"]["seconds"] > 0 and w["t3_rows_per_step"] >= 1
    # Random weights never stop: request i takes its whole budget.
    budgets = [
        request_budget(row["tokens"], row["tokens_spread"], row["seed"] + i) for i in range(row["requests"])
    ]
    assert phases["t3_step"]["rows"] == sum(budgets)
    busy, vocoded = ("stream_decode", "emit"), ("vocode", "hand_over")
    for name in busy if streamed else vocoded:
        assert phases[name]["seconds"] > 0 and phases[name]["calls"] > 0, name
    for name in vocoded if streamed else busy:
        assert phases[name]["calls"] == 0, name
    assert (w["stream_decode_rows_per_call"] is None) != streamed
    assert streamed or phases["vocode"]["rows"] == row["requests"] and w["vocode_rows_per_call"] >= 1
    assert row["wall_s"] < w["span_s"] < row["wall_s"] + 1  # around the scenario, by the server's clock
    total = sum(p["seconds"] for p in phases.values()) + w["other_s"]
    assert abs(total - w["span_s"]) < 1e-6 and w["other_s"] >= 0
    assert abs(sum(p["share"] for p in phases.values()) + w["other_share"] - 1) < 1e-6


def test_closed_and_open_loops_streamed_and_whole(tmp_path):
    """Each scenario after an unrecorded warm-up round (``--warm-up-tokens``), which its row reports."""
    out = tmp_path / "serve.jsonl"
    args = ["--random", "tiny", "--concurrency", "2", "--rate", "4", "--requests", "2", "--tokens", "20"]
    stdout = bench(*args, "--warm-up-tokens", "5", "--out", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["scenario"] for r in rows] == [
        "closed 2 streamed",
        "open 4/s streamed",
        "closed 2 whole",
        "open 4/s whole",
    ]
    for row in rows:
        check_sane(row, 2, row["format"] == "streamed")  # the worker's deltas: the scenario's requests alone
        clients = 2 if row["loop"] == "closed" else 4  # an open loop's warm-up: its rate's clients
        assert row["warm_up"] == {"tokens": 5, "requests": clients, "ok": clients}
    assert "| closed 2 whole | 2 / 2 | 0 |" in stdout  # the markdown table
    assert "| scenario | idle | gc | admit | t3_step |" in stdout  # the worker's
    timing = "| scenario | TTFA p50 ms | admitted | first-token | first-chunk | first-audio | first-ready |"
    assert timing in stdout  # Server-Timing's medians


def test_tokens_spread_gives_each_request_its_own_budget(model, tmp_path):  # noqa: F811
    """``--tokens-spread``: request i's budget drawn from tokens ± spread with seed + i (the worker's T3 rows are
    their sum: check_worker), so the lengths differ as real text's do; a spread that could reach 0 is refused.
    """
    budgets = [request_budget(20, 6, 3 + i) for i in range(4)]
    assert len(set(budgets)) > 1 and all(14 <= b <= 26 for b in budgets)
    s = Serve(model, tmp_path / "voices")
    try:
        out = tmp_path / "spread.jsonl"
        args = ["--url", s.url, *"--concurrency 2 --requests 4 --formats whole --tokens 20".split()]
        bench(*args, "--tokens-spread", "6", "--seed", "3", "--out", str(out))
        refused = subprocess.run(
            [sys.executable, "benchmarks/bench_serve.py", *args, "--tokens-spread", "20"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    finally:
        s.stop()
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["tokens_spread"] == 6 and row["seed"] == 3
    check_sane(row, 4, streamed=False)
    assert refused.returncode == 2 and "--tokens-spread 20: it must lie in [0, --tokens)" in refused.stderr


def test_soak_samples_rss_and_mlx_memory(model, tmp_path):  # noqa: F811
    s = Serve(model, tmp_path / "voices")
    try:
        assert "memory" not in httpx.get(f"{s.url}/health").json()  # asked for only
        memory = httpx.get(f"{s.url}/health", params={"memory": "true"}).json()["memory"]
        assert memory["active"] > 0 and memory["peak"] >= memory["active"] and memory["cache"] >= 0
        out = tmp_path / "soak.jsonl"
        args = ["--url", s.url, "--pid", str(s.proc.pid), "--soak", "3", "--concurrency", "2"]
        args += ["--formats", "whole", "--sample-every", "0.5", "--soak-warmup", "1", "--tokens", "20"]
        bench(*args, "--out", str(out))
    finally:
        s.stop()
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    check_sane(row, row["requests"], streamed=False)
    assert row["requests"] >= 2 and row["wall_s"] >= 3
    curves = row["memory"]
    assert len(curves["t"]) >= 4 and all(len(v) == len(curves["t"]) for v in curves.values())
    assert all(v > 0 for v in curves["rss"] + curves["mlx_active"] + curves["mlx_peak"])
    for name in ("rss", "mlx_active"):
        assert isinstance(row["growth"][name]["grew"], bool)


def test_underruns_replay_arrivals_against_real_time_playback():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_serve import underruns

    second = 24000 * 2  # bytes of 1 s of 16-bit audio at 24 kHz
    assert underruns([(0.0, second), (0.5, second), (1.9, second)], 24000) == (0, 0.0)
    # Plays 0.2-2.2 s; the third second comes at 3.2 s (1 s waited) and plays to 4.2 s; the fourth at 4.7 s.
    stalls, waited = underruns([(0.2, second), (0.5, second), (3.2, second), (4.7, second)], 24000)
    assert stalls == 2 and abs(waited - 1.5) < 1e-9
