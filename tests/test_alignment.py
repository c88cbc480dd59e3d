"""Multilingual v2's alignment analyzer on synthetic attention maps, the EOS steering, and the attention taps of
T3 on a tiny random model (no torch)."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

from mlx_chatterbox.convert import sanitize
from mlx_chatterbox.generation.aligned import generate_aligned_speech_tokens
from mlx_chatterbox.generation.alignment import ALIGNED_HEADS, AlignmentAnalyzer, steer_eos
from mlx_chatterbox.generation.speech_tokens import generate_speech_tokens, prefill_embeds
from mlx_chatterbox.models.t3 import T3, AttentionTaps, T3Cond, T3Config
from mlx_chatterbox.sampling import SamplingParams
from tests.conftest import upstream_t3_weights

BOS, EOS = 6561, 6562
COND = 4  # text columns start after 4 conditioning positions in these synthetic maps


def frame(analyzer, columns, token=1, rows=1):
    """One step whose three heads all put probability 1 on text column ``columns`` (None: outside the text)
    for ``rows`` query rows; keys cover the conditioning, the text and 40 more positions."""
    maps = np.zeros((3, rows, analyzer.text_end + 40), np.float32)
    if columns is not None:
        maps[:, :, COND + columns] = 1.0
    else:
        maps[:, :, 0] = 1.0  # the conditioning
    return analyzer.step(maps, token)


def walk(analyzer, positions):
    """Steps attending to ``positions`` in turn (the first one is the prefill's two BOS rows); distinct
    tokens, so that token repetition never fires. Returns the verdicts."""
    verdicts = [frame(analyzer, positions[0], BOS, rows=2)]
    return verdicts + [frame(analyzer, p, 100 + i) for i, p in enumerate(positions[1:])]


def test_eos_is_suppressed_until_the_attention_reaches_the_last_three_columns():
    s = 10
    a = AlignmentAnalyzer(COND, COND + s)
    verdicts = walk(a, list(range(s)))
    assert [v.suppress_eos for v in verdicts] == [True] * (s - 3) + [False] * 3
    assert not any(v.force_eos for v in verdicts)
    assert a.complete and a.text_position == s - 1


def test_monotonic_mask_hides_columns_past_the_frame_count():
    a = AlignmentAnalyzer(COND, COND + 10)
    # Frame 0 sees only column 0, frame 1 columns 0-1: attention on column 5 is masked, the arg-max is 0.
    walk(a, [5, 5])
    assert a.text_position == 0 and not a.complete


def test_discontinuity_keeps_the_position_but_not_the_suppression():
    s = 12
    a = AlignmentAnalyzer(COND, COND + s)
    verdicts = walk(a, [0] * 10 + [9])
    # A jump of 9 (>= 7) is ignored for the position, so the text is not complete...
    assert a.text_position == 0 and not a.complete
    # ...but the EOS suppression looks at the raw arg-max, which is past S - 3.
    assert verdicts[-1].suppress_eos is False and not verdicts[-1].force_eos
    # A backward jump of 4 or more is ignored too; 3 back is taken.
    a = AlignmentAnalyzer(COND, COND + s)
    walk(a, [0, 1, 2, 3, 4, 5, 6, 2])
    assert a.text_position == 6
    frame(a, 3, 200)
    assert a.text_position == 3


def test_long_tail_forces_eos_after_five_frames_on_the_last_columns():
    s = 8
    a = AlignmentAnalyzer(COND, COND + s)
    verdicts = walk(a, list(range(s - 2)))  # completes at column S - 3, on frame S - 3
    assert a.complete and not any(v.force_eos for v in verdicts)
    # The completing frame does not count; 5 full frames on the last columns after it do (>= 5).
    tail = [frame(a, s - 2, 300 + i) for i in range(5)]  # column S - 1 is still masked on frame S - 2
    assert [v.long_tail for v in tail] == [False] * 4 + [True]
    assert not any(v.alignment_repetition for v in tail)


def test_alignment_repetition_forces_eos_when_attention_goes_back_after_completion():
    s = 12
    a = AlignmentAnalyzer(COND, COND + s)
    walk(a, list(range(s - 2)))
    assert a.complete
    # Back to column 1 (< S - 5): each frame adds its row maximum, 1; more than 5 forces EOS.
    back = [frame(a, 1, 300 + i) for i in range(6)]
    assert [v.alignment_repetition for v in back] == [False] * 5 + [True]
    assert not any(v.long_tail for v in back)


def test_two_equal_tokens_in_a_row_force_eos():
    a = AlignmentAnalyzer(COND, COND + 10)
    assert not frame(a, 0, BOS, rows=2).force_eos
    assert not frame(a, 0, 7).force_eos  # [BOS, 7]
    v = frame(a, 0, 7)  # [BOS, 7, 7]: upstream checks 2 in a row, not 3 (#549)
    assert v.token_repetition and v.force_eos and v.suppress_eos  # forcing wins (steer_eos)
    assert not frame(a, 0, 8).force_eos


def test_text_start_at_the_beginning_is_accepted_and_an_empty_span_is_not():
    AlignmentAnalyzer(0, 3)
    with pytest.raises(ValueError, match="non-empty"):
        AlignmentAnalyzer(5, 5)


@pytest.mark.parametrize("s", [2, 3, 4, 5])
def test_short_text_neither_crashes_nor_suppresses(s):
    # Upstream raises IndexError here once complete (#548); we skip the alignment-repetition rule instead.
    a = AlignmentAnalyzer(COND, COND + s)
    verdicts = walk(a, [0] + [min(i, s - 1) for i in range(1, 12)])
    assert a.complete
    assert not any(v.suppress_eos or v.alignment_repetition for v in verdicts)
    # long_tail still works: the frames after completion all sit on the last columns.
    assert verdicts[-1].long_tail


def test_forcing_is_logged(caplog):
    a = AlignmentAnalyzer(COND, COND + 10)
    with caplog.at_level(logging.INFO, logger="mlx_chatterbox.generation.alignment"):
        for token in (BOS, 7, 7):
            frame(a, 0, token, rows=2 if token == BOS else 1)
    assert len(caplog.records) == 1 and "token_repetition=True" in caplog.records[0].getMessage()


def test_steer_eos():
    logits = mx.array([[1.0, -2.0, 3.0, 0.5]])
    t, f = mx.array(True), mx.array(False)
    np.testing.assert_array_equal(np.array(steer_eos(logits, f, f, 2)), np.array(logits))
    np.testing.assert_array_equal(np.array(steer_eos(logits, t, f, 2)), [[1.0, -2.0, -32768.0, 0.5]])
    forced = [[-32768.0, -32768.0, 32768.0, -32768.0]]
    np.testing.assert_array_equal(np.array(steer_eos(logits, f, t, 2)), forced)
    np.testing.assert_array_equal(np.array(steer_eos(logits, t, t, 2)), forced)


# --- T3's attention taps and the aligned loop on a tiny model deep enough for the pairs ---

DEEP = T3Config(hidden_size=32, num_layers=14, num_heads=16, head_dim=2, intermediate_size=64)
TEXT = [5, 17, 42, 2, 99, 7]


def deep_model(mark_token: int | None = None) -> T3:
    """A random T3 with the pairs' layers and heads. mark_token: that token wins every greedy step (every
    speech embedding gets +10 on dimension 0, which dominates the final hidden state, and the token's head row
    reads that dimension alone)."""
    weights = upstream_t3_weights(DEEP, seed=3)
    if mark_token is not None:
        weights["speech_emb.weight"][:, 0] += 10.0
        weights["speech_head.weight"][mark_token] = 0.0
        weights["speech_head.weight"][mark_token, 0] = 100.0
    model = T3(DEEP)
    weights = {k: mx.array(v) for k, v in weights.items()}
    model.load_weights(list(sanitize(weights, T3.checkpoint_table(DEEP), "test").items()), strict=True)
    return model


@pytest.fixture(scope="module")
def deep_t3() -> T3:
    return deep_model()


def test_taps_leave_the_pass_alone_and_agree_between_prefill_and_decode(deep_t3, voice):
    model = deep_t3
    embeds = prefill_embeds(model, T3Cond(voice.speaker_emb, voice.t3_prompt_tokens, 0.5), TEXT, 0.5)
    plain, plain_cache = model.prefill(embeds)
    taps = AttentionTaps(ALIGNED_HEADS)
    logits, cache = model.prefill(embeds, taps=taps)
    assert np.array_equal(np.array(logits), np.array(plain))
    n = embeds.shape[1]
    full = np.stack([np.array(m) for m in taps.maps])
    assert full.shape == (3, n, n)
    np.testing.assert_allclose(full.sum(-1), 1.0, atol=1e-5)
    assert not np.triu(full, k=1).any()  # causal
    # first_row keeps the last rows only.
    tail = AttentionTaps(ALIGNED_HEADS, first_row=n - 2)
    model.prefill(embeds, taps=tail)
    np.testing.assert_allclose(np.stack([np.array(m) for m in tail.maps]), full[:, n - 2 :], atol=1e-7)
    # A decoded token's row equals that token's row in a prefill one position longer.
    tok = 1234
    step = AttentionTaps(ALIGNED_HEADS)
    position = mx.array(cache.claim())
    out, _ = model.decode(mx.array([tok, tok]), mx.array(1), position, cache.kv, taps=step)
    plain_out, _ = model.decode(
        mx.array([tok, tok]), mx.array(1), mx.array(plain_cache.claim()), plain_cache.kv
    )
    assert np.array_equal(np.array(out), np.array(plain_out))
    longer = AttentionTaps(ALIGNED_HEADS, first_row=n)
    model.prefill(
        mx.concatenate([embeds, model.embed_speech(mx.array([[tok], [tok]]), 1)], axis=1), taps=longer
    )
    decoded = np.stack([np.array(m) for m in step.maps])[..., : n + 1]
    np.testing.assert_allclose(decoded, np.stack([np.array(m) for m in longer.maps]), atol=1e-6)
    with pytest.raises(ValueError, match="first_row"):
        model.decode(mx.array([tok, tok]), mx.array(1), position, cache.kv, taps=longer)


def test_aligned_generation_is_per_call_and_stops_where_plain_generation_would_go_on(voice):
    model = deep_model(mark_token=77)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=30)
    assert list(generate_speech_tokens(model, voice, TEXT, params)) == [77] * 30
    # Two equal tokens in a row force EOS; a second call starts afresh (nothing leaks from the first).
    assert list(generate_aligned_speech_tokens(model, voice, TEXT, params)) == [77, 77, EOS]
    assert list(generate_aligned_speech_tokens(model, voice, TEXT, params)) == [77, 77, EOS]


def test_aligned_generation_yields_what_it_draws_with_keys_and_uniforms(deep_t3, voice):
    params = SamplingParams(max_new_tokens=12)
    key = mx.random.key(5)
    a = list(generate_aligned_speech_tokens(deep_t3, voice, TEXT, params, key=key))
    assert a == list(generate_aligned_speech_tokens(deep_t3, voice, TEXT, params, key=key))
    assert 1 <= len(a) <= 12
    u = mx.array(np.random.default_rng(0).random(12).astype(np.float32))
    assert len(list(generate_aligned_speech_tokens(deep_t3, voice, TEXT, params, uniforms=u))) >= 1
    with pytest.raises(ValueError, match="uniforms"):
        list(generate_aligned_speech_tokens(deep_t3, voice, TEXT, params, key=key, uniforms=u))


def test_aligned_generation_needs_the_heads(tiny_t3, voice):
    with pytest.raises(ValueError, match="layers of"):
        next(generate_aligned_speech_tokens(tiny_t3, voice, TEXT, SamplingParams(max_new_tokens=3)))
