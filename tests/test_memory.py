"""Bounds on queued work (models/memory.py): MLX's memory limit, raised and given back. S3Gen's calls under
their bounds: tests/test_vocode_batch.py."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_chatterbox.models import memory


def test_interleaved_memory_bounds_restore_the_callers_limit():
    """Bounded calls on two threads (the server's worker and its vocoding thread) interleave: the limit is the
    highest bound of the calls running, never above the caller's own limit, and the caller's limit comes back
    when the last one ends, whatever the order they end in."""
    limit = mx.get_memory_limit()
    memory.raise_limit(limit // 2)
    memory.raise_limit(limit // 4)  # a lower bound while the first call runs keeps the first's
    assert mx.get_memory_limit() == limit // 2
    memory.lower_limit()  # the first call ends first
    assert mx.get_memory_limit() == limit // 2
    memory.raise_limit(limit // 3 * 2)
    assert mx.get_memory_limit() == limit // 3 * 2
    memory.lower_limit()
    memory.lower_limit()
    assert mx.get_memory_limit() == limit
    memory.raise_limit(2 * limit)  # above the caller's limit (serve --memory-limit): capped at it
    assert mx.get_memory_limit() == limit
    memory.lower_limit()
    assert mx.get_memory_limit() == limit


def test_a_bound_is_given_back_when_its_call_fails():
    limit = mx.get_memory_limit()
    with pytest.raises(RuntimeError, match="failed inside"):
        with memory.bounded(2**20):
            assert mx.get_memory_limit() < limit
            raise RuntimeError("failed inside")
    assert mx.get_memory_limit() == limit
