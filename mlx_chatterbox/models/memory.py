"""Bounds on the memory a call's queued work holds: MLX's memory limit lowered to (what is in use + a budget)
while the call's graph is queued.

MLX's evaluation runs ahead of the kernels, and what queued kernels use (their inputs, and on CUDA each cuBLAS
or cuDNN call's workspace) stays allocated until the run of kernels they belong to has finished. Above its
limit MLX waits for queued work before queueing more, so a bounded call peaks near its budget (plus its
largest single kernels) and computes the same numbers; a call under the budget is never held back. S3Gen's
calls (generation/vocode.py) and T3's prefill (``PREFILL_BUDGET_PER_ROW``) run under such bounds. On CUDA,
MLX can wait only for kernels whose CUDA graph it has closed, so an open graph's work passes any bound: hence
graphs of 20 kernels, not 100 (``_backend.py``).

The limit is process-wide, and bounded calls may run on two threads at once (the server's worker and its
vocoding thread): the limit is the highest any running call asked for, and the caller's own limit comes back
when the last one ends (a plain save and restore per call, interleaved, could leave a call's bound set); no
bound goes above the caller's limit (serve --memory-limit).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import mlx.core as mx

# Bytes T3's prefill may hold above the memory in use, per row (a CFG pair is two). On H100s (compare's
# checkpoint and cloned voice, fp32, graphs of 20 kernels; runs BB-BD, benchmarks/RESULTS.md) the unbounded
# English prefill (2 rows of ~70 positions) rose 446-677 MiB above the resident 3,203 MiB, its outputs (the
# logits and a key/value cache of 256 positions) 120 of that and the rest the queued kernels' inputs and
# cuBLAS workspaces (32 MiB each on Hopper), and was text -> wav's peak: 3,649-3,880 MiB against upstream's
# 3,647. At 192 MiB a row it rose 386-407 (3,589-3,610) and the first token came 0.9-2.1 ms later; at 128,
# 272-277 MiB and 4 ms later; at 96, 213 MiB and 6 ms. Once a call is over its limit MLX waits after every
# kernel until queued work has ended, hence the cost of a small budget. On the CPU (2 cores, built full-size
# model) the prefill rose 272 MiB, under the bound: first token 2.64 s against 2.63 unbounded. Turbo's prefill
# (one row, GPT-2) has no bound: its memory is no goal, its first audio is (issue 25's 120 ms).
PREFILL_BUDGET_PER_ROW: int | None = 192 * 2**20  # None: no bound

_lock = threading.Lock()
_calls: list = [0, None]  # bounded calls running, MLX's limit before the first


def raise_limit(limit: int) -> None:
    """Start a bounded call: MLX's limit becomes ``limit`` bytes, or the highest bound of the calls running,
    never above the caller's own limit. ``lower_limit`` ends it."""
    with _lock:
        if _calls[0] == 0:
            _calls[1] = mx.get_memory_limit()
        else:  # another call's bound may be higher: keep it
            limit = max(limit, mx.get_memory_limit())
        # Never above the caller's own limit: a bound only holds work back.
        mx.set_memory_limit(min(limit, _calls[1]))
        _calls[0] += 1


def lower_limit() -> None:
    """End a bounded call; the last to end gives the caller's limit back."""
    with _lock:
        _calls[0] -= 1
        if _calls[0] == 0:
            mx.set_memory_limit(_calls[1])


@contextlib.contextmanager
def bounded(budget: int | None) -> Iterator[None]:
    """Queue what is evaluated inside (``mx.async_eval``: the caller's later reads find it in flight) with at
    most ``budget`` bytes above the memory in use now; None: no bound."""
    if budget is None:
        yield
        return
    raise_limit(mx.get_active_memory() + budget)
    try:
        yield
    finally:
        lower_limit()


def prefill_bound(rows: int) -> contextlib.AbstractContextManager:
    """The bound of a T3 prefill of ``rows`` rows (``PREFILL_BUDGET_PER_ROW`` each)."""
    per_row = PREFILL_BUDGET_PER_ROW
    return bounded(None if per_row is None else per_row * rows)
