"""Where the worker's wall time goes: cumulative seconds, calls and rows of its phases by thread (``Meter``, which
``Worker`` keeps), and their Prometheus text (``prometheus``) for ``GET /metrics``.

The seconds are the wall time a thread spends in a call as it is, with no MLX synchronisation added: a T3 step
that waits for the step queued before it counts that wait. A worker thread's phases do not overlap, so their
seconds over a span, subtracted from the span, leave the time spent elsewhere (routing tokens, receiving jobs,
work run through ``Worker.run``); the vocoding thread's run beside them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping

# The phases timed on each thread.
PHASES = {
    "worker": (
        "idle",  # blocked on the inbox: no job to step
        "gc",  # Python's garbage collection, checked once a turn of the loop (worker.py's _collect_garbage)
        "admit",  # a job's next piece put into T3's batch (it is prefilled in the step after)
        "t3_step",  # T3's batch stepped: a token for each row (and the rows added since, prefilled)
        "stream_decode",  # streamed chunks decoded (S3Gen)
        "emit",  # streamed chunks joined, watermarked (without a marking thread) and handed to their readers
        "vocode",  # whole pieces vocoded (S3Gen), without a vocoding thread
        "hand_over",  # a whole job's pieces joined, watermarked (without a marking thread) and handed over
    ),
    # The vocoding thread's (``vocode_thread=True``): streamed chunks and whole pieces decoded there.
    "vocoder": ("idle", "stream_decode", "vocode"),
    # The marking threads' (``vocode_thread=True`` too): the watermark of what readers get.
    "marker": ("idle", "mark"),
}
ROW_PHASES = ("t3_step", "stream_decode", "vocode")  # whose calls take several rows at once
OUTCOMES = ("finished", "failed", "cancelled")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text exposition format


class Meter:
    """Per (thread, phase): wall seconds, calls and rows, summed since the meter was made; and jobs ended by
    outcome. The worker's threads add (``timed``), any thread reads (``snapshot``: a copy, under the lock)."""

    def __init__(self, threads: Mapping[str, int]):
        """``threads``: how many threads of each kind (``PHASES``' keys) the worker runs; the seconds of a kind
        are summed over its threads."""
        self._lock = threading.Lock()
        self._since = time.perf_counter()
        self._threads = dict(threads)
        self._phases = {(t, p): [0.0, 0, 0] for t in threads for p in PHASES[t]}  # [seconds, calls, rows]
        # (kind, thread id) -> the phase that thread is in and since when
        self._open: dict[tuple[str, int], tuple[str, float]] = {}
        self._outcomes = dict.fromkeys(OUTCOMES, 0)

    @contextlib.contextmanager
    def timed(self, thread: str, phase: str, rows: int = 0, calls: int = 1) -> Iterator[None]:
        """The block's wall time, ``calls`` (one: a part of a call timed on its own counts none) and ``rows``
        added to ``phase`` of ``thread`` (whose phases do not nest)."""
        key = (thread, threading.get_ident())
        with self._lock:
            self._open[key] = (phase, time.perf_counter())
        try:
            yield
        finally:
            with self._lock:
                _, start = self._open.pop(key)
                self._count(thread, phase, time.perf_counter() - start, rows, calls)

    def add(self, thread: str, phase: str, seconds: float, rows: int = 0, calls: int = 1) -> None:
        """A call (or part of one) timed elsewhere (the vocoding process's), as ``timed`` counts it."""
        with self._lock:
            self._count(thread, phase, seconds, rows, calls)

    def _count(self, thread: str, phase: str, seconds: float, rows: int, calls: int) -> None:
        tally = self._phases.setdefault((thread, phase), [0.0, 0, 0])
        tally[0] += seconds
        tally[1] += calls
        tally[2] += rows

    def ended(self, outcome: str) -> None:
        with self._lock:
            self._outcomes[outcome] += 1

    def snapshot(self) -> dict:
        """``{"uptime": seconds since the meter was made, "threads": {kind: count}, "phases": [{"thread",
        "phase", "seconds", "calls", "rows"}], "requests": {outcome: count}}``. A phase a thread is in counts its
        seconds so far: two snapshots' differences then cover exactly the time between them (times the kind's
        thread count)."""
        with self._lock:
            now = time.perf_counter()
            seconds = {key: tally[0] for key, tally in self._phases.items()}
            for (thread, _), (phase, start) in self._open.items():
                seconds[thread, phase] += now - start
            phases = [
                {"thread": t, "phase": p, "seconds": seconds[t, p], "calls": c, "rows": r}
                for (t, p), (_, c, r) in self._phases.items()
            ]
            return {
                "uptime": now - self._since,
                "threads": dict(self._threads),
                "phases": phases,
                "requests": dict(self._outcomes),
            }


def prometheus(metrics: dict) -> str:
    """``Worker.metrics()`` in Prometheus' text exposition format (version 0.0.4)."""
    lines: list[str] = []

    def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{labels} {value!r}" for labels, value in samples)

    family(
        "mlx_chatterbox_worker_uptime_seconds",
        "gauge",
        "Seconds since the worker was made: the span its phases' seconds are counted over.",
        [("", float(metrics["uptime"]))],
    )
    family(
        "mlx_chatterbox_worker_threads",
        "gauge",
        "Threads of each kind the worker runs: a kind's phase seconds are summed over them.",
        [(f'{{thread="{t}"}}', n) for t, n in metrics["threads"].items()],
    )
    phases = metrics["phases"]
    label = '{{thread="{thread}",phase="{phase}"}}'.format
    family(
        "mlx_chatterbox_worker_seconds_total",
        "counter",
        "Wall seconds the worker's threads spent in each phase, summed over the threads of a kind.",
        [(label(**p), float(p["seconds"])) for p in phases],
    )
    family(
        "mlx_chatterbox_worker_calls_total",
        "counter",
        "Times each phase ran (t3_step: steps; stream_decode and vocode: S3Gen calls).",
        [(label(**p), p["calls"]) for p in phases],
    )
    family(
        "mlx_chatterbox_worker_rows_total",
        "counter",
        "Rows summed over a phase's calls: T3 steps' requests, S3Gen calls' pieces or streams.",
        [(label(**p), p["rows"]) for p in phases if p["phase"] in ROW_PHASES],
    )
    family(
        "mlx_chatterbox_t3_traces_total",
        "counter",
        "Times T3's compiled decode steps were traced in this process (each new shape: rows, KV capacity).",
        [("", metrics["t3_traces"])],
    )
    family(
        "mlx_chatterbox_vocoder_restarts_total",
        "counter",
        "New vocoding processes started after one died (serve --vocoding process).",
        [("", metrics["vocoder_restarts"])],
    )
    family(
        "mlx_chatterbox_requests_total",
        "counter",
        "Speech jobs ended, by outcome.",
        [(f'{{outcome="{k}"}}', n) for k, n in metrics["requests"].items()],
    )
    for name, key, help_ in (
        ("mlx_chatterbox_jobs", "jobs", "Speech jobs submitted and not ended (waiting, in T3 or vocoding)."),
        ("mlx_chatterbox_jobs_waiting", "waiting", "Jobs waiting for a row in T3's batch (max_batch)."),
        ("mlx_chatterbox_jobs_running", "running", "Jobs in T3's batch."),
        (
            "mlx_chatterbox_vocode_pending",
            "vocode_pending",
            "Whole pieces T3 finished and S3Gen not yet (waiting or in its running call).",
        ),
    ):
        family(name, "gauge", help_, [("", metrics[key])])
    return "\n".join(lines) + "\n"
