"""Speech tokens -> waveform on a tiny S3Gen (no torch): lengths, the prompt cut, the fade-in, randomness, errors."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from mlx_chatterbox import TTS
from mlx_chatterbox.convert import convert
from mlx_chatterbox.generation.vocode import Draws, fade_in
from tests.conftest import TINY_MODEL, random_voice, write_upstream_checkpoint


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vocode")
    return TTS.load(convert(write_upstream_checkpoint(tmp / "up"), tmp / "mlx", config=TINY_MODEL))


def tokens(n: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, 6561, (1, n)).astype(np.int32))


@pytest.mark.parametrize("prompt_frames, frames", [(20, 14), (21, 13)])  # odd prompt mel: 2N - 1 frames
def test_lengths_follow_upstream(tts, prompt_frames, frames):
    voice = dataclasses.replace(
        random_voice(gen_tokens=10), s3gen_prompt_mel=mx.zeros((1, prompt_frames, 80))
    )
    mel = tts.s3gen.mel(tokens(7), voice, cfm_steps=2, key=mx.random.key(0))
    assert mel.shape == (1, frames, 80)
    wav = tts.s3gen(tokens(7), voice, cfm_steps=2, key=mx.random.key(0))
    assert wav.shape == (1, 480 * frames) and wav.dtype == mx.float32
    assert bool(mx.all(mx.abs(wav) <= 0.99))


def test_without_a_prompt(tts):
    v = random_voice()
    bare = dataclasses.replace(
        v, s3gen_prompt_tokens=mx.zeros((1, 0), mx.int32), s3gen_prompt_mel=mx.zeros((1, 0, 80))
    )
    assert tts.s3gen.mel(tokens(7), bare, cfm_steps=2, key=mx.random.key(0)).shape == (1, 14, 80)
    assert tts.vocode([5, 6, 7], bare, seed=0).shape == (3 * 960,)


def test_prompt_conditions_the_output(tts):
    voice = random_voice(gen_tokens=10)
    other = dataclasses.replace(voice, s3gen_prompt_mel=voice.s3gen_prompt_mel + 1)
    a = tts.s3gen.mel(tokens(9), voice, cfm_steps=2, key=mx.random.key(1))
    b = tts.s3gen.mel(tokens(9), other, cfm_steps=2, key=mx.random.key(1))
    assert a.shape == b.shape and not np.allclose(np.array(a), np.array(b))


def test_steps_and_keys(tts):
    voice = random_voice(gen_tokens=10)
    run = lambda steps, seed: np.array(tts.s3gen(tokens(6), voice, cfm_steps=steps, key=mx.random.key(seed)))
    np.testing.assert_array_equal(run(3, 4), run(3, 4))
    assert not np.allclose(run(3, 4), run(3, 5))
    assert not np.allclose(run(1, 4), run(10, 4))
    assert tts.vocode([1, 2, 3], voice, seed=3).tolist() == tts.vocode([1, 2, 3], voice, seed=3).tolist()


def test_injected_draws_replace_every_random_input(tts):
    voice = random_voice(gen_tokens=10)
    rng = np.random.default_rng(0)
    frames = 2 * (10 + 5)
    draws = Draws(
        cfm_noise=mx.array(rng.standard_normal((1, frames, 80)).astype(np.float32)),
        phases=mx.array(np.concatenate([[0.0], rng.uniform(-3, 3, 8)])[None].astype(np.float32)),
        source_noise=mx.array(rng.standard_normal((1, 480 * (frames - 20), 9)).astype(np.float32)),
    )
    a = np.array(tts.s3gen(tokens(5), voice, cfm_steps=2, draws=draws))
    mx.random.seed(123)  # the global generator must not matter
    np.testing.assert_array_equal(a, np.array(tts.s3gen(tokens(5), voice, cfm_steps=2, draws=draws)))
    with pytest.raises(ValueError, match="either key or draws"):
        tts.s3gen(tokens(5), voice, key=mx.random.key(0), draws=draws)
    wrong = dataclasses.replace(draws, cfm_noise=draws.cfm_noise[:, 1:])
    with pytest.raises(ValueError, match="cfm_noise has shape"):
        tts.s3gen(tokens(5), voice, draws=wrong)
    with pytest.raises(ValueError, match="either key or cfm_noise"):
        tts.s3gen.mel(tokens(5), voice, cfm_noise=draws.cfm_noise, key=mx.random.key(0))


def test_fade_in_is_upstreams_trim_fade():
    wav = fade_in(mx.ones((1, 2000)))
    ramp = (np.cos(np.linspace(np.pi, 0, 480)) + 1) / 2
    np.testing.assert_allclose(np.array(wav[0, :960]), np.concatenate([np.zeros(480), ramp]), atol=1e-7)
    np.testing.assert_array_equal(np.array(wav[0, 960:]), 1.0)
    assert fade_in(mx.ones((1, 700))).shape == (1, 700)  # shorter than the fade: cut, not an error


@pytest.mark.parametrize(
    "ids, message",
    [
        ([], "no speech tokens"),
        ([1, 6561], r"must lie in \[0, 6561\), found 6561; drop T3's start/stop ids"),
        ([-1, 5], "found -1"),
        ([[1, 2]], "1-d sequence"),
        (np.array([1.5]), "1-d sequence of integer ids"),
    ],
)
def test_bad_tokens(tts, ids, message):
    with pytest.raises(ValueError, match=message):
        tts.vocode(ids, random_voice())


@pytest.mark.parametrize("steps", [0, -2, 1.5, True])
def test_bad_step_counts(tts, steps):
    with pytest.raises(ValueError, match="cfm_steps"):
        tts.vocode([1, 2], random_voice(), cfm_steps=steps)


def test_watermark_is_on_by_default_and_detected(tts):
    voice = random_voice(gen_tokens=10)
    ids = tts.speech_tokens("Hello there.", voice, seed=2, max_new_tokens=40, min_p=0.0)
    plain = tts.vocode(ids, voice, seed=2, watermark=False)
    marked = tts.vocode(ids, voice, seed=2)
    assert marked.shape == plain.shape and not np.array_equal(marked, plain)
    np.testing.assert_array_equal(marked, tts.watermarker().apply(plain, 24000))
    wm = tts.watermarker()
    assert wm.is_watermarked(marked, 24000) and not wm.is_watermarked(plain, 24000)


def test_generate_is_speech_tokens_then_vocode(tts):
    voice = random_voice(gen_tokens=10)
    knobs = dict(max_new_tokens=6, min_p=0.0)
    wav = tts.generate("Hello there.", voice, seed=11, cfm_steps=2, **knobs)
    ids = tts.speech_tokens("Hello there.", voice, seed=11, **knobs)
    np.testing.assert_array_equal(wav, tts.vocode(ids, voice, seed=11, cfm_steps=2))
    assert wav.dtype == np.float32 and wav.shape == (960 * len(ids),) and tts.sample_rate == 24000


def test_bad_arguments_are_refused_before_any_work(tts, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("generation ran before the arguments were checked")

    monkeypatch.setattr(tts, "_voice", no_work)  # the first step of the work (a recording would be cloned)
    for kwargs, message in [
        (dict(cfm_steps=0), "cfm_steps=0 must be an integer >= 1"),
        (dict(temperature=-1.0), "temperature=-1.0 is out of range"),
        (dict(max_new_tokens=0), "max_new_tokens=0 is out of range"),
        (dict(max_new_tokens=5000), "max_new_tokens=5000 is out of range: at most 4096"),
    ]:
        with pytest.raises(ValueError, match=message):
            tts.generate("Hello there.", "me.wav", **kwargs)
    with pytest.raises(ValueError, match="the text is empty"):
        tts.generate(" \n", "me.wav")
    with pytest.raises(TypeError, match="unknown knob 'temprature'"):
        tts.generate("Hello there.", "me.wav", temprature=0.5)


def test_speech_tokens_warn_when_cut_at_max_new_tokens(tts, caplog):
    # Random weights (almost) never give the stop token: T3 runs to max_new_tokens.
    ids = tts.speech_tokens("Hello there.", random_voice(), seed=1, max_new_tokens=5, min_p=0.0)
    assert 0 < len(ids) <= 5
    assert "T3 stopped at max_new_tokens=5 (0.2 s) without its stop token" in caplog.text


def test_long_text_in_pieces_each_within_its_budget(tts, monkeypatch, caplog):
    from mlx_chatterbox.generation import pieces as pieces_module
    from mlx_chatterbox.generation.pieces import split_pieces, spoken_length, token_budget
    from mlx_chatterbox.generation.vocode import crossfade_join

    # Pieces of at most 24 spoken characters instead of 300, so that a short text makes several short pieces.
    monkeypatch.setattr(pieces_module, "PIECE_LENGTH", 24)
    text = "Hello there. This is a test, with clauses; and more words here! Short. In 1999 it ended."
    voice, cap = random_voice(gen_tokens=10), 75
    knobs = dict(max_new_tokens=cap, min_p=0.0, cfm_steps=1)
    pieces = split_pieces(text, tts._fits)
    assert len(pieces) >= 4 and " ".join(pieces).split() == text.split()
    assert all(spoken_length(p) <= 24 for p in pieces)
    budgets = [min(cap, token_budget(p)) for p in pieces]
    assert min(budgets) < cap == max(budgets)  # some pieces are held to their own budget, some to the cap

    seen = []
    wav = tts.generate(text, voice, seed=5, watermark=False, progress=seen.append, **knobs)
    for i, budget in enumerate(budgets, 1):
        stages = [(p.stage, p.done, p.total) for p in seen if p.piece == i]
        assert {p.pieces for p in seen} == {len(pieces)}
        # Random weights never stop: T3 runs to the piece's budget, then the piece is vocoded.
        assert stages == [("tokens", n, budget) for n in range(1, budget + 1)] + [
            ("vocode", 0, 1),
            ("vocode", 1, 1),
        ]
        assert f"piece {i} of {len(pieces)} stopped at its budget of {budget} speech tokens" in caplog.text
    assert "(raise max_new_tokens)" in caplog.text and "(try another seed)" in caplog.text

    # Each piece is speech_tokens (with its budget) then vocode, with seed 5 + i; joined with a 40 ms crossfade.
    alone = []
    for i, (piece, budget) in enumerate(zip(pieces, budgets)):
        ids = tts.speech_tokens(piece, voice, seed=5 + i, max_new_tokens=budget, min_p=0.0)
        alone.append(tts.vocode(ids, voice, seed=5 + i, cfm_steps=1, watermark=False))
    np.testing.assert_array_equal(wav, crossfade_join(alone, 960))
    # The watermark goes on once, over the joined audio.
    marked = tts.generate(text, voice, seed=5, **knobs)
    np.testing.assert_array_equal(marked, tts.watermarker().apply(wav, 24000))


def test_text_too_long_for_one_t3_pass_is_split_too(tmp_path):
    short = dataclasses.replace(TINY_MODEL, t3=dataclasses.replace(TINY_MODEL.t3, max_text_tokens=24))
    tts = TTS.load(convert(write_upstream_checkpoint(tmp_path / "up", short), tmp_path / "mlx", config=short))
    text = "Hello there. This is a test, with clauses; and more words here! Short. The end is near."
    voice = random_voice(gen_tokens=10)
    with pytest.raises(ValueError, match="at most 24"):
        tts.speech_tokens(text, voice)  # one T3 pass cannot take it
    seen = []
    tts.generate(text, voice, seed=5, max_new_tokens=2, min_p=0.0, cfm_steps=1, progress=seen.append)
    assert seen[-1].pieces > 2


def test_crossfade_join():
    from mlx_chatterbox.generation.vocode import crossfade_join

    a, b = np.ones(3000, np.float32), np.full(2000, 3.0, np.float32)
    out = crossfade_join([a, b], 960)
    assert out.shape == (3000 + 2000 - 960,) and out[0] == 1 and out[-1] == 3
    assert np.all(np.diff(out[2040:3000]) > 0)  # a smooth ramp from one to the other
    assert crossfade_join([a, np.ones(10, np.float32)], 960).shape == (3000,)  # a piece shorter than the fade
