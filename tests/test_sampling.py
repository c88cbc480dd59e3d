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
