"""The logits chain and SamplingParams on hand-made distributions (no torch)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_chatterbox.sampling import (
    SamplingParams,
    apply_temperature,
    cfg_combine,
    draw,
    min_p_filter,
    process_logits,
    repetition_penalty,
    top_p_filter,
)


def test_defaults_are_upstreams():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.cfg_weight, p.exaggeration) == (
        0.8,
        1.0,
        0.05,
        1.2,
        0.5,
        0.5,
    )
    assert p.max_new_tokens == 1000 and not p.greedy


@pytest.mark.parametrize(
    "knob, value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("cfg_weight", -1.0),
        ("exaggeration", math.inf),
        ("max_new_tokens", 0),
        ("max_new_tokens", 2.5),
        ("temperature", True),
        ("top_p", "0.5"),
    ],
)
def test_out_of_range_knobs_are_rejected_by_name(knob, value):
    with pytest.raises(ValueError, match=f"^{knob}="):
        SamplingParams(**{knob: value})


def test_zero_and_tiny_temperature_are_greedy():
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=1e-7).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_cfg_combine():
    logits = mx.array([[1.0, 2.0, 3.0], [0.0, 3.0, 1.0]])
    np.testing.assert_allclose(np.array(cfg_combine(logits, 0.5)), [[1.5, 1.5, 4.0]])
    np.testing.assert_array_equal(np.array(cfg_combine(logits[:1], 0.5)), [[1.0, 2.0, 3.0]])


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = mx.array([[2.0, -2.0, 2.0, -2.0]])
    seen = mx.array([[True, True, False, False]])
    np.testing.assert_allclose(np.array(repetition_penalty(logits, seen, 2.0)), [[1.0, -4.0, 2.0, -2.0]])


def test_temperature_shift_keeps_distribution_and_avoids_overflow():
    logits = mx.array([[1.0, 2.0, 4.0]])
    np.testing.assert_allclose(
        np.array(mx.softmax(apply_temperature(logits, 0.5), axis=-1)),
        np.array(mx.softmax(logits / 0.5, axis=-1)),
        rtol=1e-6,
    )
    tiny = apply_temperature(mx.array([[1e30, -1e30, 0.0]]), 1e-10)
    assert not np.isnan(np.array(mx.softmax(tiny, axis=-1))).any()


def test_min_p_keeps_tokens_above_the_scaled_max():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    out = np.array(min_p_filter(mx.array(np.log(probs)[None]), 0.2))
    assert np.isfinite(out[0, :3]).all() and out[0, 3] == -np.inf  # 0.05 < 0.2 * 0.5
    assert np.isfinite(np.array(min_p_filter(mx.array(np.log(probs)[None]), 0.0))).all()
    only_max = np.array(min_p_filter(mx.array(np.log(probs)[None]), 1.0))
    assert np.isfinite(only_max).sum() == 1 and np.isfinite(only_max[0, 0])


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = np.array([0.1, 0.5, 0.25, 0.15])
    out = np.array(top_p_filter(mx.array(np.log(probs)[None]), 0.7))
    # ascending cumulative: 0.1, 0.25, 0.5, 1.0; drop where <= 0.3 -> ids 0 (0.1) and 3 (0.15)
    assert list(np.isfinite(out[0])) == [False, True, True, False]
    out = np.array(top_p_filter(mx.array(np.log(probs)[None]), 1e-9))
    assert list(np.isfinite(out[0])) == [False, True, False, False]  # the arg-max always stays


def test_top_p_is_nan_free_when_probabilities_underflow():
    logits = mx.array([[0.0, -200.0, -300.0, -1e30, -mx.inf]])
    out = top_p_filter(logits, 0.5)
    probs = np.array(mx.softmax(out, axis=-1))
    assert not np.isnan(probs).any() and probs[0, 0] == 1.0


def test_draw_greedy_categorical_and_inverse_cdf():
    logits = mx.log(mx.array([[0.2, 0.5, 0.3]]))
    assert draw(logits, SamplingParams(temperature=0), None, None).tolist() == [1]
    # inverse CDF: cdf = 0.2, 0.7, 1.0
    for u, want in [(0.0, 0), (0.19, 0), (0.21, 1), (0.69, 1), (0.71, 2), (0.999, 2)]:
        assert draw(logits, SamplingParams(), None, mx.array(u)).tolist() == [want]
    counts = np.bincount(
        [draw(logits, SamplingParams(), k, None).item() for k in mx.random.split(mx.random.key(0), 2000)],
        minlength=3,
    )
    np.testing.assert_allclose(counts / 2000, [0.2, 0.5, 0.3], atol=0.04)


def test_process_logits_order_penalty_before_temperature():
    # A positive logit penalised by 2 then tempered by 0.5 returns to itself relative to the others.
    logits = mx.array([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    seen = mx.array([[True, False, False]])
    params = SamplingParams(temperature=0.5, cfg_weight=0.0, repetition_penalty=2.0, min_p=0.0)
    out = np.array(process_logits(logits[:1], seen, params))
    np.testing.assert_allclose(out - out.max(), [[0.0, 0.0, -2.0]], atol=1e-6)


def test_rows_with_their_own_knobs_match_each_request_alone():
    """process_rows / draw_rows (many requests at once, generation/batch.py) give each row exactly what
    process_logits / draw give its request alone: CFG pairs and single rows, every knob on and off."""
    from mlx_chatterbox.sampling import draw_rows, process_rows, row_knobs

    params = [
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, cfg_weight=0, repetition_penalty=1.0),
        SamplingParams(temperature=1.0, top_p=0.8, min_p=0.0, cfg_weight=1.5),
        SamplingParams(temperature=0.3, top_p=0.95, min_p=0.2, repetition_penalty=2.0, cfg_weight=0),
        SamplingParams(temperature=1.7, top_p=1.0, min_p=0.0, repetition_penalty=1.0),
    ]
    rng = np.random.default_rng(0)
    v = 300
    rows = [2 if p.cfg_weight > 0 else 1 for p in params]  # a request without CFG has one T3 row
    logits = mx.array(3 * rng.standard_normal((sum(rows), v)).astype(np.float32))
    seen = mx.array(rng.random((len(params), v)) < 0.1)
    first = np.cumsum([0] + rows)[:-1]
    cond, uncond = mx.array(first), mx.array(first + np.array(rows) - 1)
    processed = process_rows(logits, cond, uncond, seen, row_knobs(params))
    keys = mx.random.split(mx.random.key(7), len(params))
    u = mx.array(rng.random(len(params)).astype(np.float32))
    by_uniform = mx.array([i % 2 == 0 for i in range(len(params))])
    drawn = draw_rows(processed, row_knobs(params)["greedy"], keys, u, by_uniform).tolist()
    for i, p in enumerate(params):
        own = logits[int(first[i]) : int(first[i]) + rows[i]]
        expected = process_logits(own, seen[i : i + 1], p)
        np.testing.assert_array_equal(np.array(processed[i : i + 1]), np.array(expected), err_msg=f"row {i}")
        draw_args = (None, None) if p.greedy else ((None, u[i]) if i % 2 == 0 else (keys[i], None))
        assert drawn[i] == draw(expected, p, *draw_args).item(), f"row {i}"


def test_row_thresholds_round_as_the_single_request_chain():
    """A batched row must drop exactly what ``top_p_filter`` drops alone: it compares the cumulative
    probabilities with 1 - top_p taken in double precision, then rounded (float32(1 - 0.95) = 0.0500000007,
    while 1 - float32(0.95) = 0.0500000119: a cumulative mass between the two was kept alone, dropped batched)."""
    from mlx_chatterbox.sampling import SamplingParams, TurboParams, row_knobs, turbo_row_knobs

    tail = mx.array(1 - 0.95, dtype=mx.float32)
    assert not mx.array_equal(tail, 1 - mx.array(0.95, dtype=mx.float32))
    assert mx.array_equal(row_knobs([SamplingParams(top_p=0.95)])["top_p_tail"][0, 0], tail)
    assert mx.array_equal(turbo_row_knobs([TurboParams(top_p=0.95)])["top_p_tail"][0, 0], tail)
