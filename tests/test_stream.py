"""Streaming synthesis on a tiny random model: the stream against the one-shot vocoder, the chunk schedule,
joining pieces, ``TTS.stream`` and its argument checks."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from mlx_chatterbox import TTS
from mlx_chatterbox.audio.mel import s3gen_mel
from mlx_chatterbox.convert import convert
from mlx_chatterbox.generation import stream as stream_module
from mlx_chatterbox.generation.stream import (
    CROSSFADE,
    HIFT_HOLDBACK,
    MAX_CHUNK,
    StreamVocoder,
    join_pieces,
    min_first_chunk,
)
from mlx_chatterbox.generation.vocode import crossfade_join
from tests.conftest import TINY_MODEL, random_voice, write_upstream_checkpoint

PROMPT = 20  # prompt tokens of the test voice (40 prompt mel frames)


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stream")
    return TTS.load(convert(write_upstream_checkpoint(tmp / "up"), tmp / "mlx", config=TINY_MODEL))


@pytest.fixture
def voiced(tts):
    """The tiny HiFT with f0 near 150 Hz (random weights give f0 < 10 Hz: unvoiced, no sines), so that the
    sine source and its phase carry between chunks matter."""
    classifier = tts.s3gen.hift.f0_predictor.classifier
    bias = classifier.bias
    classifier.bias = mx.array([150.0])
    yield tts
    classifier.bias = bias


def ids(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 6561, n).tolist()


def run(vocoder: StreamVocoder, tokens: list[int], step: int = 1) -> list[np.ndarray]:
    """push ``step`` tokens at a time, then finish: every returned array, the empty ones included."""
    outs = [vocoder.push(tokens[i : i + step]) for i in range(0, len(tokens), step)]
    return outs + [vocoder.finish()]


def one_shot(tts, vocoder: StreamVocoder, tokens: list[int], voice, steps: int) -> np.ndarray:
    wav = tts.s3gen(
        mx.array(tokens, dtype=mx.int32)[None], voice, cfm_steps=steps, draws=vocoder.draws(len(tokens))
    )
    return np.array(wav[0])


def test_stream_is_close_to_the_one_shot_vocoder(voiced):
    tts, voice, tokens = voiced, random_voice(gen_tokens=PROMPT), ids(80)
    vocoder = StreamVocoder(tts.s3gen, voice, cfm_steps=2, key=mx.random.key(1))
    streamed = np.concatenate(run(vocoder, tokens))
    whole = one_shot(tts, vocoder, tokens, voice, 2)
    assert streamed.dtype == np.float32 and streamed.shape == whole.shape == (80 * 960,)
    # Measured: relative L2 9.4e-5, max |difference| 6.0e-5 of a 0.037 peak.
    assert np.linalg.norm(streamed - whole) / np.linalg.norm(whole) < 5e-4
    np.testing.assert_array_equal(streamed[:480], 0.0)  # upstream's trim_fade: 20 ms of silence first
    # The log-mel of the audio: measured max |difference| 0.027 (at a chunk boundary), mean 2.3e-4.
    a, b = s3gen_mel(streamed), s3gen_mel(whole)
    assert np.abs(a - b).max() < 0.1 and np.abs(a - b).mean() < 1e-3


def test_the_phase_carry_matters(voiced, monkeypatch):
    """Without the sine phase carried from chunk to chunk, the stream is 7x further from the one-shot audio
    (measured 6.7e-4 against 9.4e-5): the closeness above is not an accident of the tiny model."""
    tts, voice, tokens = voiced, random_voice(gen_tokens=PROMPT), ids(80)
    vocoder = StreamVocoder(tts.s3gen, voice, cfm_steps=2, key=mx.random.key(1))
    outs = []
    for t in tokens:
        outs.append(vocoder.push([t]))
        vocoder._cycles[:] = 0  # drop the carried phase
    streamed = np.concatenate(outs + [vocoder.finish()])
    whole = one_shot(tts, vocoder, tokens, voice, 2)
    assert np.linalg.norm(streamed - whole) / np.linalg.norm(whole) > 3e-4


def test_re_decoded_mel_prefix_stays_put(tts):
    """The fixed noise table: a decode at n tokens (lookahead held back) gives nearly the final mel over its
    frames. Measured max |difference| 7.4e-4 (n = 10) and 4.5e-4 (n = 35) of a mean |mel| 0.8 (the tiny model
    looks little ahead); another noise draw moves it by far more."""
    voice, tokens = random_voice(gen_tokens=PROMPT), ids(60)
    vocoder = StreamVocoder(tts.s3gen, voice, cfm_steps=2, key=mx.random.key(2))
    noise = vocoder.draws(60).cfm_noise
    full = np.array(
        tts.s3gen.mel(mx.array(tokens, dtype=mx.int32)[None], voice, cfm_steps=2, cfm_noise=noise)
    )
    for n in (10, 35):
        frames = 2 * (PROMPT + n - 3)
        part = tts.s3gen.mel(
            mx.array(tokens[:n], dtype=mx.int32)[None],
            voice,
            cfm_steps=2,
            cfm_noise=noise[:, :frames],
            finalize=False,
        )
        assert part.shape == (1, 2 * (n - 3), 80)
        assert np.abs(np.array(part) - full[:, : part.shape[1]]).max() < 3e-3
        other = mx.random.normal(noise[:, :frames].shape, key=mx.random.key(7))
        moved = tts.s3gen.mel(
            mx.array(tokens[:n], dtype=mx.int32)[None], voice, cfm_steps=2, cfm_noise=other, finalize=False
        )
        assert np.abs(np.array(moved) - full[:, : part.shape[1]]).max() > 0.1


@pytest.mark.parametrize("prompt_frames", [2 * PROMPT, 2 * PROMPT + 1])  # odd: one frame fewer
@pytest.mark.parametrize(
    "first_chunk, chunk, max_chunk", [(10, 25, MAX_CHUNK), (8, 7, MAX_CHUNK), (8, 7, 20)]
)
def test_chunk_schedule_and_total_length(tts, monkeypatch, prompt_frames, first_chunk, chunk, max_chunk):
    monkeypatch.setattr(stream_module, "MAX_CHUNK", max_chunk)  # 20: capped at 8, 15, 29, 49, 69
    voice = random_voice(gen_tokens=PROMPT)
    mel = mx.array(np.random.default_rng(1).standard_normal((1, prompt_frames, 80)).astype(np.float32))
    voice = dataclasses.replace(voice, s3gen_prompt_mel=mel)
    odd = prompt_frames - 2 * PROMPT
    tokens = ids(70)
    vocoder = StreamVocoder(
        tts.s3gen, voice, cfm_steps=1, key=mx.random.key(0), first_chunk=first_chunk, chunk=chunk
    )
    outs = run(vocoder, tokens)
    decodes, n, step = [], first_chunk, chunk  # chunks double after the second, up to MAX_CHUNK
    while n <= 70:
        decodes.append(n)
        n, step = n + step, max(chunk, min(2 * step, max_chunk))
    assert [i + 1 for i, out in enumerate(outs[:-1]) if out.size] == decodes
    assert all(out.dtype == np.float32 and out.ndim == 1 for out in outs)
    # The decode at n tokens makes the audio of its first 2(n - 3) - odd - HIFT_HOLDBACK frames final, less
    # the crossfade tail.
    final = [2 * (n - 3) - odd - HIFT_HOLDBACK for n in decodes]
    assert len(outs[first_chunk - 1]) == 480 * final[0] - CROSSFADE
    for k in range(1, len(decodes)):
        assert len(outs[decodes[k] - 1]) == 480 * (final[k] - final[k - 1])
    whole = one_shot(tts, vocoder, tokens, voice, 1)
    assert sum(len(out) for out in outs) == len(whole) == 480 * (2 * 70 - odd)


def test_a_push_across_boundaries_decodes_once_with_all_its_tokens(tts):
    voice, tokens = random_voice(gen_tokens=PROMPT), ids(90)
    vocoder = StreamVocoder(tts.s3gen, voice, cfm_steps=1, key=mx.random.key(0))
    assert vocoder.push(tokens[:9]).shape == (0,)
    out = vocoder.push(tokens[9:40])  # past 10 and 35: one decode of 40 tokens
    assert len(out) == 480 * (2 * (40 - 3) - HIFT_HOLDBACK) - CROSSFADE
    assert vocoder.pushed == 40
    assert vocoder.push(tokens[40:84]).size == 0  # the next boundary is 85: the third chunk is 2 x 25
    at_85 = vocoder.push(tokens[84:85])
    assert len(at_85) == 480 * 2 * (85 - 40)
    assert len(out) + len(at_85) + len(vocoder.finish()) == 85 * 960


def test_short_utterances_and_the_end_of_a_stream(tts):
    voice = random_voice(gen_tokens=PROMPT)
    vocoder = StreamVocoder(tts.s3gen, voice, cfm_steps=1, key=mx.random.key(0))
    assert vocoder.push([5, 6, 7]).size == 0
    assert vocoder.push([]).size == 0
    assert len(vocoder.finish()) == 3 * 960  # fewer tokens than the first chunk: all at the end
    with pytest.raises(RuntimeError, match="this stream is finished"):
        vocoder.push([1])
    with pytest.raises(RuntimeError, match="this stream is finished"):
        vocoder.finish()
    with pytest.raises(ValueError, match="no speech tokens were pushed"):
        StreamVocoder(tts.s3gen, voice).finish()


def test_same_key_same_stream_and_the_global_generator(tts):
    voice, tokens = random_voice(gen_tokens=PROMPT), ids(40)

    def stream(key=None):
        return np.concatenate(run(StreamVocoder(tts.s3gen, voice, cfm_steps=1, key=key), tokens, step=7))

    np.testing.assert_array_equal(stream(mx.random.key(3)), stream(mx.random.key(3)))
    assert not np.allclose(stream(mx.random.key(3)), stream(mx.random.key(4)))
    mx.random.seed(9)
    a = stream()
    mx.random.seed(9)
    np.testing.assert_array_equal(a, stream())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"first_chunk": min_first_chunk(3) - 1}, f"first_chunk={min_first_chunk(3) - 1} is too small"),
        ({"first_chunk": 10.0}, "first_chunk=10.0 must be an integer"),
        ({"first_chunk": True}, "first_chunk=True must be an integer"),
        ({"chunk": 0}, "chunk=0 is too small: it must be >= 1"),
        ({"cfm_steps": 0}, "cfm_steps=0 must be an integer >= 1"),
    ],
)
def test_bad_settings(tts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        StreamVocoder(tts.s3gen, random_voice(gen_tokens=PROMPT), **kwargs)


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([6561], r"must lie in \[0, 6561\), found 6561; drop T3's start/stop ids"),
        ([-1], "found -1"),
        ([[1, 2]], "1-d sequence of integer ids"),
        ([1.5], "1-d sequence of integer ids"),
    ],
)
def test_bad_tokens(tts, tokens, message):
    vocoder = StreamVocoder(tts.s3gen, random_voice(gen_tokens=PROMPT))
    with pytest.raises(ValueError, match=message):
        vocoder.push(tokens)
    assert vocoder.pushed == 0


@pytest.mark.parametrize("lengths", [[5000, 3000], [5000, 300, 4000], [200, 5000], [100, 50, 7000]])
def test_joined_pieces_equal_crossfade_join(lengths):
    rng = np.random.default_rng(len(lengths))
    pieces = [rng.standard_normal(n).astype(np.float32) for n in lengths]

    def chunked(wav):  # random chunk sizes, some empty
        cuts = np.sort(rng.integers(0, len(wav), 4))
        return iter(np.split(wav, cuts))

    out = list(join_pieces([chunked(p) for p in pieces], 960))
    assert all(len(c) for c in out)
    np.testing.assert_allclose(np.concatenate(out), crossfade_join(pieces, 960), atol=1e-7)


def test_tts_stream_speaks_like_generate(tts, monkeypatch):
    voice = random_voice(seed=5)
    args = dict(seed=4, cfm_steps=1, watermark=False, max_new_tokens=30)
    chunks = list(tts.stream("Hello there.", voice, **args))
    assert len(chunks) >= 2 and all(c.dtype == np.float32 and c.ndim == 1 and c.size for c in chunks)
    # The same seed gives T3 the same draws as generate: the same tokens, the same length; the audio is close
    # but not equal (the stream's noise tables are its own).
    wav = tts.generate("Hello there.", voice, **args)
    assert sum(len(c) for c in chunks) == len(wav)
    again = list(tts.stream("Hello there.", voice, **args))
    np.testing.assert_array_equal(np.concatenate(again), np.concatenate(chunks))
    # Two pieces, each with its own seed and budget, joined with the 40 ms crossfade.
    from mlx_chatterbox.generation import pieces

    monkeypatch.setattr(pieces, "PIECE_LENGTH", 20)
    text = "Hello there. How are you?"
    two = np.concatenate(list(tts.stream(text, voice, **args)))
    assert len(two) == len(tts.generate(text, voice, **args))


def test_tts_stream_marks_each_chunk_and_keeps_its_length(tts):
    voice = random_voice(seed=5)
    args = dict(seed=4, cfm_steps=1, max_new_tokens=40, first_chunk=8, chunk=10)
    plain = list(tts.stream("Hello there.", voice, watermark=False, **args))
    marked = list(tts.stream("Hello there.", voice, **args))
    assert [len(c) for c in marked] == [len(c) for c in plain]
    assert all(not np.array_equal(a, b) for a, b in zip(marked, plain) if len(a) > 1000)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"first_chunk": 2}, ValueError, "first_chunk=2 is too small"),
        ({"chunk": -1}, ValueError, "chunk=-1 is too small"),
        ({"cfm_steps": 0}, ValueError, "cfm_steps=0"),
        ({"temprature": 0.5}, TypeError, "unknown knob 'temprature'"),
        ({"top_p": 0.0}, ValueError, "top_p=0.0 is out of range"),
        ({"text": "  "}, ValueError, "the text is empty"),
    ],
)
def test_tts_stream_checks_every_argument_before_any_work(tts, monkeypatch, kwargs, error, message):
    def no_work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(tts.speech, "tokens", no_work)
    monkeypatch.setattr(stream_module.StreamVocoder, "_decode", no_work)
    text = kwargs.pop("text", "Hello there.")
    with pytest.raises(error, match=message):
        tts.stream(text, random_voice(seed=5), **kwargs)


def test_mel_without_finalize_holds_back_the_lookahead(tts):
    voice, tokens = random_voice(gen_tokens=PROMPT), mx.array(ids(9), dtype=mx.int32)[None]
    assert tts.s3gen.mel(tokens, voice, cfm_steps=1, finalize=False).shape == (1, 2 * (9 - 3), 80)
    assert tts.s3gen.mel(tokens, voice, cfm_steps=1).shape == (1, 2 * 9, 80)
    with pytest.raises(ValueError, match="3 speech tokens leave no frame once the last 3 are held back"):
        tts.s3gen.mel(tokens[:, :3], voice, finalize=False)
