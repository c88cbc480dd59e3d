"""Bounds on the memory a call's queued work holds: MLX's memory limit lowered to (what is in use + a budget)
while the call's graph is queued.

MLX's evaluation runs ahead of the kernels, and what queued kernels use (their inputs, and on CUDA each cuBLAS
or cuDNN call's workspace) stays allocated until the run of kernels they belong to has finished. Above its
limit MLX waits for queued work before queueing more, so a bounded call peaks near its budget (plus its
largest single kernels) and computes the same numbers; a call under the budget is never held back. S3Gen's
calls (generation/vocode.py) run under such bounds, and T3's prefill can (``PREFILL_BUDGET_PER_ROW``).

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

# Bytes a prefill may hold above the memory in use, per row (a CFG pair is two); None: no bound (the default).
# Unbounded, T3's English prefill (fp32, 2 rows of ~70 positions) held 1,046 MiB above the weights on an H100,
# where its outputs (the logits and a key/value cache of 256 positions) are 120 MiB. Bounded, it held 741 MiB
# at 384 MiB a row and 349 at 128, but a lone stream's first audio came 4 and 10-12 ms later (115 ms unbounded):
# once a call is over its limit, MLX commits and waits after every kernel until enough queued work has ended,
# and the prefill's own outputs (the cache, padded once: twice its size for a moment) take most of a small
# budget. Text -> wav peaked in S3Gen all the same (run AV, benchmarks/RESULTS.md), so first audio keeps the
# unbounded prefill; a server given ``--memory-limit`` has MLX hold all its work back at that limit.
PREFILL_BUDGET_PER_ROW: int | None = None

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
    """The bound of a prefill of ``rows`` rows (``PREFILL_BUDGET_PER_ROW`` each; none by default)."""
    per_row = PREFILL_BUDGET_PER_ROW
    return bounded(None if per_row is None else per_row * rows)
