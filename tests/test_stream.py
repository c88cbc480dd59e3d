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
    CONTEXT,
    CROSSFADE,
    FIRST_CHUNK,
    HIFT_HOLDBACK,
    MAX_CHUNK,
    MAX_FIRST_CHUNK,
    StreamVocoder,
    decode_together,
    first_chunk_seconds,
    join_pieces,
    min_first_chunk,
    playback_first_chunk,
)
from mlx_chatterbox.generation.vocode import S3Gen, crossfade_join
from mlx_chatterbox.models.cfm import Estimator
from mlx_chatterbox.models.flow import Flow
from mlx_chatterbox.models.hift import HiFT
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


@pytest.mark.parametrize("context", [CONTEXT, 0])  # 0: the window cuts from the third decode on
@pytest.mark.parametrize("prompt_frames", [2 * PROMPT, 2 * PROMPT + 1])  # odd: one frame fewer
@pytest.mark.parametrize(
    "first_chunk, chunk, max_chunk", [(10, 25, MAX_CHUNK), (8, 7, MAX_CHUNK), (8, 7, 20)]
)
def test_chunk_schedule_and_total_length(
    tts, monkeypatch, prompt_frames, first_chunk, chunk, max_chunk, context
):
    monkeypatch.setattr(stream_module, "MAX_CHUNK", max_chunk)  # 20: capped at 8, 15, 29, 49, 69
    voice = random_voice(gen_tokens=PROMPT)
    mel = mx.array(np.random.default_rng(1).standard_normal((1, prompt_frames, 80)).astype(np.float32))
    voice = dataclasses.replace(voice, s3gen_prompt_mel=mel)
    odd = prompt_frames - 2 * PROMPT
    tokens = ids(70)
    vocoder = StreamVocoder(
        tts.s3gen,
        voice,
        cfm_steps=1,
        key=mx.random.key(0),
        first_chunk=first_chunk,
        chunk=chunk,
        context=context,
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
    # The windows' frames line up with the one-shot's, an odd prompt mel too (measured up to 1.2e-4).
    streamed = np.concatenate(outs)
    assert np.linalg.norm(streamed - whole) / np.linalg.norm(whole) < 5e-4


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
        ({"context": -1}, "context=-1 must be a number of speech tokens >= 0"),
        ({"context": 2.5}, "context=2.5 must be a number of speech tokens >= 0"),
        ({"context": True}, "context=True must be a number"),
        ({"context": "all"}, "context='all' must be a number of speech tokens >= 0 .*, or 'whole'"),
        ({"context": None}, "context=None must be"),
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
        ({"context": -5}, ValueError, "context=-5 must be"),
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


# --- the bounded context: a decode re-reads the voice prompt and CONTEXT tokens before its new ones ---

LONG = 400  # speech tokens: with CONTEXT = 50 the window cuts from the decode at 185 tokens on
UPSTREAM_PROMPT = 250  # prompt tokens: upstream's 10 s S3Gen prompt


@pytest.fixture(scope="module")
def far_sighted():
    """The tiny S3Gen at MLX's default initialisation. The converted test model's weights (0.05·N(0, 1)) make
    attention nearly uniform and faint: its mel barely changes with what a decode leaves out (context 0 and
    "whole" within 1e-4 of the one-shot mel alike). Here the encoder's and the CFM's attention reach far
    both ways, so the error of leaving tokens out shows."""
    mx.random.seed(0)
    return S3Gen(Flow(TINY_MODEL.flow), Estimator(TINY_MODEL.cfm), HiFT(TINY_MODEL.hift))


def streamed_mel(s3gen: S3Gen, vocoder: StreamVocoder, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    """``tokens`` pushed one by one, then finish: the mel frames each decode made final (those whose audio
    HiFT vocoded as new), joined, and the speech tokens each decode handed to ``S3Gen.mel`` with the prompt.
    (The voice's prompt mel must be 2·prompt tokens long.)"""
    prompt = vocoder.voice.s3gen_prompt_tokens.shape[1]
    assert vocoder.voice.s3gen_prompt_mel.shape[1] == 2 * prompt
    mels, read, real = [], [], s3gen.mel

    def mel(tokens, *args, **kwargs):
        out = real(tokens, *args, **kwargs)
        mels.append(np.array(out[0]))
        read.append(prompt + tokens.shape[1])
        return out

    rows = []
    s3gen.mel = mel  # an instance attribute: the class's stays as it is
    try:
        for i in range(len(tokens) + 1):
            done, decodes = vocoder._final_frames, len(mels)
            if i < len(tokens):
                vocoder.push(tokens[i : i + 1])
                frames = 2 * (vocoder.pushed - 3)  # the lookahead held back
            else:
                vocoder.finish()
                frames = 2 * len(tokens)
            if len(mels) > decodes:  # the decode's mel ends at the utterance's frame `frames`
                m, end = mels[-1], vocoder._final_frames
                rows.append(m[len(m) - (frames - done) : len(m) - (frames - end)])
    finally:
        del s3gen.mel
    return np.concatenate(rows), read


@pytest.mark.parametrize(
    "context, rel_l2, per_frame",
    [(CONTEXT, 0.015, 0.05), ("whole", 0.012, 0.05), (0, None, None)],
)
def test_streamed_mel_against_the_one_shot_mel(far_sighted, context, rel_l2, per_frame):
    """Attention is bidirectional, so no chunked decode equals the one-shot mel; this is the bound. 400 tokens
    behind a 10 s prompt, 2 CFM steps. Measured (relative L2 of the whole mel; worst frame's relative L2):
    context 50: 8.7e-3, 2.7e-2; "whole": 7.4e-3, 2.7e-2 (the tokens to come, beyond the lookahead, are
    what both miss); context 0: 4.0e-2, 0.43. (Seeds 1, 2: 0.012 and 0.012 at 50, 0.0097 and 0.010 whole,
    0.037 and 0.048 at 0; 10 CFM steps: 8.5e-3 at 50, 7.3e-3 whole.) The windowed decodes read at most the
    prompt + 50 + the chunk + 11 tokens."""
    s3gen, tokens = far_sighted, ids(LONG)
    voice = random_voice(gen_tokens=UPSTREAM_PROMPT)
    vocoder = StreamVocoder(s3gen, voice, cfm_steps=2, key=mx.random.key(1), context=context)
    mel, read = streamed_mel(s3gen, vocoder, tokens)
    noise = vocoder.draws(LONG).cfm_noise
    row = mx.array(tokens, dtype=mx.int32)[None]
    whole = np.array(s3gen.mel(row, voice, cfm_steps=2, cfm_noise=noise)[0])
    assert mel.shape == whole.shape == (2 * LONG, 80)
    error = np.linalg.norm(mel - whole) / np.linalg.norm(whole)
    frame = (np.linalg.norm(mel - whole, axis=1) / np.linalg.norm(whole, axis=1)).max()
    decodes = [10, 35, 85, 185, 385]  # and the end
    if context == "whole":
        assert read == [UPSTREAM_PROMPT + n for n in [*decodes, LONG]]
    else:  # each decode reads at most the prompt, the window, the tokens pushed since the decode before + 11
        pushed = np.diff([0, *decodes, LONG]).tolist()
        assert all(r <= vocoder.max_decode_tokens(new) for r, new in zip(read, pushed))
        assert vocoder.max_decode_tokens(200) == UPSTREAM_PROMPT + context + 200 + 11
    if context == CONTEXT:
        assert read == [UPSTREAM_PROMPT + n for n in [10, 35, 85, 160, 260, 75]]  # cut from the 4th decode
    if rel_l2 is None:  # no window: 4x further than with one of 2 s, which is what keeps the error down
        assert error > 0.025 and frame > 0.2
    else:
        assert error < rel_l2 and frame < per_frame


def test_a_decode_stays_bounded_however_long_the_stream(tts, monkeypatch):
    """Chunks of 25 tokens over 600 tokens: every decode after the first few reads the prompt, the 50-token
    window, the chunk and 10 tokens of HiFT context and lookahead, no more (with "whole" the last would read
    all 600)."""
    monkeypatch.setattr(stream_module, "MAX_CHUNK", 25)
    voice, tokens = random_voice(gen_tokens=PROMPT), ids(600)
    vocoder = StreamVocoder(tts.s3gen, voice, cfm_steps=1, key=mx.random.key(0))
    read = []
    real = tts.s3gen.mel
    monkeypatch.setattr(tts.s3gen, "mel", lambda t, *a, **k: (read.append(t.shape[1]), real(t, *a, **k))[1])
    out = run(vocoder, tokens, step=5)
    assert sum(len(o) for o in out) == 600 * 960
    assert len(read) == 25 and read[:4] == [10, 35, 60, 85]
    assert set(read[3:-1]) == {CONTEXT + 25 + 10} and read[-1] == CONTEXT + 15 + 10  # the end: 15 new
    assert max(PROMPT + r for r in read) <= vocoder.max_decode_tokens(25)


def test_the_window_noise_rows_follow_their_frames(far_sighted, monkeypatch):
    """A frame gets the same CFM noise row in every decode, wherever the window puts it. Given instead the
    rows of the utterance's first frames (the table sliced at the prompt, not at the window), the streamed
    mel is as far from the one-shot mel as another noise draw: measured relative L2 1.22 against 8.7e-3."""
    s3gen, tokens = far_sighted, ids(LONG)
    voice = random_voice(gen_tokens=UPSTREAM_PROMPT)
    prompt_frames = 2 * UPSTREAM_PROMPT
    take = stream_module._NoiseTable.take

    def unshifted(self, start, stop):
        if self.width == 80 and start > prompt_frames:
            return take(self, prompt_frames, prompt_frames + stop - start)
        return take(self, start, stop)

    monkeypatch.setattr(stream_module._NoiseTable, "take", unshifted)
    vocoder = StreamVocoder(s3gen, voice, cfm_steps=2, key=mx.random.key(1))
    mel, _ = streamed_mel(s3gen, vocoder, tokens)
    monkeypatch.setattr(stream_module._NoiseTable, "take", take)
    noise = vocoder.draws(LONG).cfm_noise
    row = mx.array(tokens, dtype=mx.int32)[None]
    whole = np.array(s3gen.mel(row, voice, cfm_steps=2, cfm_noise=noise)[0])
    assert np.linalg.norm(mel - whole) / np.linalg.norm(whole) > 0.5


@pytest.mark.parametrize("context", [0, CONTEXT, "whole"])
def test_windowed_audio_joins_like_the_whole_prefix_audio(voiced, context):
    """The audio side (HiFT's source carried, the crossfade, the length) holds with any window: 200 tokens
    pushed 7 at a time; the 0.05-scale test model barely sees the window (measured relative L2 from the
    one-shot audio 6.1e-5 at 0, 50 and "whole")."""
    tts, voice, tokens = voiced, random_voice(gen_tokens=PROMPT), ids(200)
    vocoder = StreamVocoder(tts.s3gen, voice, cfm_steps=2, key=mx.random.key(1), context=context)
    streamed = np.concatenate(run(vocoder, tokens, step=7))
    whole = one_shot(tts, vocoder, tokens, voice, 2)
    assert streamed.shape == whole.shape == (200 * 960,)
    assert np.linalg.norm(streamed - whole) / np.linalg.norm(whole) < 5e-4


def test_tts_stream_context(tts):
    """``TTS.stream``'s context reaches the vocoder: a window of 0 cuts the last decode of a piece of 35 to 85
    speech tokens, "whole" does not, so the audio differs (a little, on this model) but keeps its length."""
    voice = random_voice(seed=5)
    args = dict(seed=4, cfm_steps=1, watermark=False, max_new_tokens=60)
    cut = np.concatenate(list(tts.stream("Hello there.", voice, context=0, **args)))
    whole = np.concatenate(list(tts.stream("Hello there.", voice, context="whole", **args)))
    default = np.concatenate(list(tts.stream("Hello there.", voice, **args)))
    assert 35 * 960 <= len(cut) == len(whole) == len(default) < 85 * 960
    assert not np.array_equal(cut, whole)
    np.testing.assert_array_equal(default, whole)  # under 85 tokens the default window (50) cuts nothing


# --- several streams' due decodes in one batched S3Gen call (decode_together) ---

# Per round, each stream's samples against its own push/finish (fp32, tiny, f0 near 150 Hz): measured relative
# L2 1.7e-7 to 2.3e-7 (float error of the batched, masked matrix products); 40x room.
TOGETHER_TOL = 1e-5


def together_streams(s3gen: S3Gen) -> list[tuple[StreamVocoder, list[list[int]]]]:
    """Four streams (voice prompts of 20, 13 with an odd prompt mel, 30 and 7 tokens; windows of 50, 0,
    "whole" and 10 tokens; two chunk schedules) and the tokens each takes per round before it ends: rounds
    where 4, 3 and 2 of them are due, final and non-final rows together, windows that cut, a last round
    alone."""
    odd = random_voice(seed=3, gen_tokens=13)
    odd = dataclasses.replace(
        odd, s3gen_prompt_mel=mx.concatenate([odd.s3gen_prompt_mel, odd.s3gen_prompt_mel[:, :1] + 1], axis=1)
    )
    small = dict(first_chunk=8, chunk=7)  # decodes at 8, 15, 29, 57, 113 tokens
    specs = [  # default chunks: decodes at 10, 35, 85, 185
        (random_voice(1, gen_tokens=PROMPT), CONTEXT, {}, [12, 30, 45, 20]),  # due, due, due, -; end
        (odd, 0, small, [9, 8, 14, 30]),  # due, due, due, due; end
        (random_voice(2, gen_tokens=30), "whole", {}, [10, 25, 50]),  # due, due, due; end
        (random_voice(4, gen_tokens=7), 10, small, [8, 7, 14, 28, 40]),  # due x 4, -; end alone
    ]
    streams = []
    for i, (voice, context, chunks, sizes) in enumerate(specs):
        vocoder = StreamVocoder(s3gen, voice, cfm_steps=2, key=mx.random.key(i), context=context, **chunks)
        tokens = ids(sum(sizes), seed=i)
        cuts = np.cumsum([0, *sizes])
        streams.append((vocoder, [tokens[a:b] for a, b in zip(cuts[:-1], cuts[1:])]))
    return streams


def test_streams_decoded_together_equal_their_own_decodes(voiced, monkeypatch):
    """Round by round, the streams take their tokens (or end), then ``decode_together`` runs the due decodes in
    one S3Gen call: each round's samples are each stream's own push/finish's, within TOGETHER_TOL."""
    tts = voiced
    expected = [[v.push(g) for g in groups] + [v.finish()] for v, groups in together_streams(tts.s3gen)]
    estimator_calls, hift_calls, rows = [], [], []
    real_call, real_decode, real_batch_mel = Estimator.__call__, HiFT.decode, tts.s3gen.batch_mel_steps

    def counted(self, *args, **kwargs):
        estimator_calls.append(args[0].shape[0])  # the rows of one call (CFG doubles them)
        return real_call(self, *args, **kwargs)

    def decode(self, mel, *args, **kwargs):
        hift_calls.append(mel.shape[0])
        return real_decode(self, mel, *args, **kwargs)

    def spy(tokens, voices, **kwargs):
        rows.append([(t.shape[1], f) for t, f in zip(tokens, kwargs["finalize"])])
        return real_batch_mel(tokens, voices, **kwargs)

    monkeypatch.setattr(Estimator, "__call__", counted)
    monkeypatch.setattr(HiFT, "decode", decode)
    monkeypatch.setattr(tts.s3gen, "batch_mel_steps", spy)
    streams = together_streams(tts.s3gen)
    got: list[list[np.ndarray]] = [[] for _ in streams]
    cut = []  # the streams whose window left tokens out, per decode
    for r in range(max(len(groups) for _, groups in streams) + 1):
        live = [i for i, (_, groups) in enumerate(streams) if r <= len(groups)]
        for i in live:
            vocoder, groups = streams[i]
            if r < len(groups):
                vocoder.take(groups[r])
            else:
                vocoder.end()
        due = {i: streams[i][0].due for i in live if streams[i][0].due}
        for i in due:
            vocoder = streams[i][0]
            if due[i] < vocoder.voice.s3gen_prompt_tokens.shape[1] + vocoder.pushed:
                cut.append(i)
        estimator_calls.clear()
        hift_calls.clear()
        for i, out in zip(live, decode_together([streams[i][0] for i in live], bucket=8)):
            got[i].append(out)
        assert all(not streams[i][0].due for i in live)
        # Several due decodes: one S3Gen call (2 CFM steps, 2 estimator calls of 2 x their rows).
        assert estimator_calls == [2 * len(due)] * 2, (r, due, estimator_calls)
        assert hift_calls == [len(due)], (r, due, hift_calls)  # and one HiFT call, its segments padded
        if len(due) > 1:  # the rows as each stream's `due` said: prompt, window and new tokens
            prompts = [streams[i][0].voice.s3gen_prompt_tokens.shape[1] for i in due]
            assert [n + p for (n, _), p in zip(rows[-1], prompts)] == list(due.values())
    assert sorted(set(cut)) == [0, 1, 3]  # all but "whole"
    # Rounds 3 and 4: the "whole" stream's end between two chunk decodes, then two ends (round 5: one alone).
    finals = [[final for _, final in call] for call in rows]
    assert finals == [[False] * 4] * 3 + [[False, True, False], [True] * 2]
    errors = []
    for i, (outs, refs) in enumerate(zip(got, expected)):
        assert [len(o) for o in outs] == [len(o) for o in refs]
        a, b = np.concatenate(outs), np.concatenate(refs)
        errors.append(float(np.linalg.norm(a - b) / np.linalg.norm(b)))
    print("rel. L2 per stream:", ["%.1e" % e for e in errors])
    assert max(errors) < TOGETHER_TOL, errors


def test_take_end_and_decode_together_refuse_misuse(tts):
    voice, tokens = random_voice(gen_tokens=PROMPT), ids(20)
    a = StreamVocoder(tts.s3gen, voice, cfm_steps=1, key=mx.random.key(0))
    b = StreamVocoder(tts.s3gen, voice, cfm_steps=2, key=mx.random.key(1))
    a.take(tokens[:5])
    assert a.due == 0 and decode_together([a])[0].shape == (0,)
    a.take(tokens[5:12])
    b.take(tokens[:12])
    assert a.due == b.due == PROMPT + 12
    for call in (lambda: a.take([1]), a.end, lambda: a.push([1]), a.finish):
        with pytest.raises(RuntimeError, match=r"a decode is due: run it \(decode_together\)"):
            call()
    with pytest.raises(ValueError, match="differ in S3Gen or cfm_steps"):
        decode_together([a, b])
    with pytest.raises(ValueError, match="a vocoder is given twice"):
        decode_together([a, a])
    assert a.due and b.due  # nothing ran
    outs = decode_together([a]) + decode_together([b])
    assert [len(o) for o in outs] == [480 * (2 * (12 - 3) - HIFT_HOLDBACK) - CROSSFADE] * 2
    # A due decode alone runs as push runs it: exactly.
    twin = StreamVocoder(tts.s3gen, voice, cfm_steps=1, key=mx.random.key(0))
    np.testing.assert_array_equal(outs[0], np.concatenate([twin.push(tokens[:5]), twin.push(tokens[5:12])]))
    assert decode_together([]) == []


@pytest.mark.parametrize("first_chunk", [10, 17])
def test_first_chunk_seconds_is_the_first_chunks_length(tts, first_chunk):
    """``first_chunk_seconds`` (what ``serve --first-chunk auto`` sizes by) is the first push's audio, exactly."""
    vocoder = StreamVocoder(
        tts.s3gen, random_voice(gen_tokens=PROMPT), cfm_steps=1, key=mx.random.key(0), first_chunk=first_chunk
    )
    first = vocoder.push(ids(first_chunk))
    assert len(first) == round(first_chunk_seconds(first_chunk) * 24000) > 0


def test_playback_first_chunk_lasts_past_the_gap():
    """The fewest tokens whose first chunk plays 1.25x the gap to the second chunk, within its bounds."""
    assert playback_first_chunk(0.0) == playback_first_chunk(0.1) == FIRST_CHUNK  # 0.14 s covers 0.125
    n = playback_first_chunk(0.58)  # the gap of one English stream on an H200 (2026-12-02)
    assert first_chunk_seconds(n) >= 1.25 * 0.58 > first_chunk_seconds(n - 1) and n == 25
    assert playback_first_chunk(100.0) == MAX_FIRST_CHUNK
