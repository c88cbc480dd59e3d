"""Bounds on queued work (models/memory.py): MLX's memory limit, raised and given back, and T3's prefill under
its bound. S3Gen's calls under their bounds: tests/test_vocode_batch.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_chatterbox.models import memory
from tests.test_gpt2 import TINY as TINY_TURBO
from tests.test_gpt2 import load, upstream_weights


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


def test_t3_prefill_runs_under_its_bound_and_changes_no_number(tiny_t3, monkeypatch):
    """T3's prefill is queued under rows x ``PREFILL_BUDGET_PER_ROW`` above the memory in use (the limit raised
    once by that much, then given back), and its logits and key/value cache are the same bit for bit at a budget
    of 0, where MLX waits after every kernel. Turbo's prefill runs unbounded (memory.py says why)."""
    width = tiny_t3.config.hidden_size
    embeds = mx.array(np.random.default_rng(0).standard_normal((3, 9, width)).astype(np.float32))
    budgets, real = [], memory.raise_limit

    def spy(limit: int) -> None:
        budgets.append(limit - mx.get_active_memory())
        real(limit)

    monkeypatch.setattr(memory, "raise_limit", spy)
    limit = mx.get_memory_limit()
    logits, cache = tiny_t3.prefill(embeds)
    assert len(budgets) == 1 and abs(budgets[0] - 3 * memory.PREFILL_BUDGET_PER_ROW) < 2**19, budgets
    assert mx.get_memory_limit() == limit
    monkeypatch.setattr(memory, "PREFILL_BUDGET_PER_ROW", 0)
    tight_logits, tight_cache = tiny_t3.prefill(embeds)
    np.testing.assert_array_equal(np.asarray(tight_logits), np.asarray(logits))
    for a, b in zip(tight_cache.kv, cache.kv, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    turbo = load(TINY_TURBO, upstream_weights(TINY_TURBO))
    budgets.clear()
    turbo.prefill(mx.zeros((1, 5, turbo.config.hidden_size)))
    assert budgets == []
