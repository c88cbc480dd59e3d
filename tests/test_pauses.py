"""Pause tags: the parser, the plan of pieces and silences, and exact silences through TTS.generate / TTS.stream
in every model kind (tiny random models). The CLI, server and bulk paths are in test_cli.py, test_server.py and
test_bulk.py."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mlx_chatterbox import TTS
from mlx_chatterbox.convert import convert
from mlx_chatterbox.generation.pieces import Plan, join_audio, plan_text
from mlx_chatterbox.text.pauses import pause_samples, split_pauses
from tests.conftest import TINY_MODEL, TINY_MTL_V3, TINY_TURBO, random_voice, write_upstream_checkpoint
from tests.test_turbo import TINY_NANO

SR = 24000


@pytest.mark.parametrize(
    "tag, samples",
    [
        ("[pause:500ms]", 12000),
        ("[pause:1.5s]", 36000),
        ('<break time="500ms"/>', 12000),
        ("<break time='1.5s' />", 36000),
        ('<break time="2s">', 48000),
        ("[PAUSE: 250 ms]", 6000),
        ("[pause:.5s]", 12000),
        ("[pause:10s]", 240000),  # the longest
        ("[pause:0ms]", 0),
        ("[pause:1ms]", 24),
        ("[pause:0.0625ms]", 2),  # 1.5 samples: halves round up
        ("[pause:0.02083ms]", 0),  # 0.49992 samples
        ("[pause:0.1ms]", 2),  # 2.4 samples
    ],
)
def test_a_tag_is_its_length_rounded_to_the_nearest_sample(tag, samples):
    assert pause_samples(tag, SR) == samples


@pytest.mark.parametrize(
    "text, message",
    [
        ("Hi [pause] there", "malformed pause tag '[pause]'"),
        ("Hi [pause:5 sec] there", "malformed pause tag '[pause:5 sec]'"),
        ("Hi [pause:-1s] there", "malformed pause tag '[pause:-1s]'"),
        ("Hi [pause:500ms there", "malformed pause tag '[pause:500ms there'"),
        ('Hi <break strength="strong"/> there', "malformed pause tag '<break strength=\"strong\"/>'"),
        ('Hi <break time="1,5s"/>', "malformed pause tag"),
        ("Hi [pause:10.001s]", "pause tag '[pause:10.001s]' is 10.001 s long; a pause is at most 10 s"),
        ('<break time="20000ms"/>', "is 20 s long"),
    ],
)
def test_a_malformed_or_too_long_tag_is_an_error_naming_it(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        split_pauses(text, SR)


def test_split_pauses_keeps_other_brackets_and_sums_consecutive_tags():
    assert split_pauses("Hello there.", SR) == ["Hello there."]
    assert split_pauses("  ", SR) == []
    # Turbo's tags, other brackets and words that merely start with the tag's name are text.
    text = "Ha [laugh] a [pauses] list [1] <breaking> [sigh]"
    assert split_pauses(text, SR) == [text]
    assert split_pauses(" A. [pause:1s] B. <break time='2s'/>[pause:500ms]\n [pause:1ms] C. ", SR) == [
        "A.",
        24000,
        "B.",
        48000 + 12000 + 24,
        "C.",
    ]
    assert split_pauses("[pause:1s] A [pause:2s]", SR) == [24000, "A", 48000]
    assert split_pauses("[pause:1s][pause:1s]", SR) == [48000]


def test_plan_cuts_pieces_at_tags_and_crossfades_only_between_untagged_pieces():
    fits = lambda piece: len(piece) <= 12  # noqa: E731 (a piece of at most 12 characters)
    plan = plan_text("One two. Three four. [pause:1s] Five.", fits, SR)
    assert plan == Plan(["One two.", "Three four.", "Five."], [0, None, 24000, 0])
    assert [plan.crossfades(i) for i in range(3)] == [True, False, False]
    # Words on either side of a tag never share a piece, even where they would fit together.
    assert plan_text("A. [pause:0ms] B.", fits, SR) == Plan(["A.", "B."], [0, 0, 0])
    assert plan_text("[pause:20ms] A. [pause:1ms]", fits, SR) == Plan(["A."], [480, 24])
    assert plan_text("[pause:1s] [pause:1s]", fits, SR) == Plan([], [48000])
    for empty in ("", "  ", "[pause:0s]"):
        with pytest.raises(ValueError, match="the text is empty"):
            plan_text(empty, fits, SR)


def test_join_audio_puts_exact_zeros_without_crossfading_across_a_pause():
    a, b, c = (np.full(n, v, np.float32) for n, v in ((2000, 1.0), (3000, 2.0), (1500, 3.0)))
    out = join_audio([a, b, c], Plan(["a", "b", "c"], [7, None, 100, 5]), 960)
    assert len(out) == 7 + 2000 + 3000 - 960 + 100 + 1500 + 5
    assert not out[:7].any() and not out[-5:].any()
    k = 7 + 2000 + 3000 - 960
    np.testing.assert_array_equal(out[k - 1000 : k], 2.0)  # b's own end, not faded
    assert not out[k : k + 100].any()
    np.testing.assert_array_equal(out[k + 100 : k + 1600], 3.0)  # c's own start, not faded
    np.testing.assert_array_equal(join_audio([], Plan([], [480]), 960), np.zeros(480, np.float32))


# Through the models: the audio with tags is the pieces' own audio with exact zeros between them.

KNOBS = dict(max_new_tokens=8, cfm_steps=1, watermark=False)
TEXT = "[pause:20ms] Hello there. [pause:250ms] How are you? [pause:0.1s]<break time='50ms'/>"
SILENCES = (480, 6000, 2400 + 1200)  # before the first piece, between the two, after the last


@pytest.fixture(
    scope="module", params=[TINY_MODEL, TINY_TURBO, TINY_NANO, TINY_MTL_V3], ids=lambda c: c.variant
)
def model(request, tmp_path_factory):
    if request.param.variant.startswith("multilingual"):
        pytest.importorskip("torch")  # writes the .pt files
    tmp = tmp_path_factory.mktemp(request.param.variant)
    tts = TTS.load(
        convert(write_upstream_checkpoint(tmp / "up", request.param), tmp / "mlx", config=request.param)
    )
    language = "en" if request.param.variant.startswith("multilingual") else None
    return tts, language


def test_generate_puts_exact_silences_between_the_pieces_own_audio(model):
    tts, language = model
    voice = random_voice(seed=5)
    wav = tts.generate(TEXT, voice, seed=7, language=language, **KNOBS)
    a = tts.generate("Hello there.", voice, seed=7, language=language, **KNOBS)
    b = tts.generate("How are you?", voice, seed=8, language=language, **KNOBS)  # seeds count pieces only
    lead, gap, tail = SILENCES
    assert len(wav) == lead + len(a) + gap + len(b) + tail
    np.testing.assert_array_equal(wav, np.concatenate([np.zeros(lead), a, np.zeros(gap), b, np.zeros(tail)]))


def test_stream_gives_the_silences_as_chunks_of_zeros(model):
    tts, language = model
    voice = random_voice(seed=5)
    chunks = list(tts.stream(TEXT, voice, seed=7, language=language, **KNOBS))
    a = np.concatenate(list(tts.stream("Hello there.", voice, seed=7, language=language, **KNOBS)))
    b = np.concatenate(list(tts.stream("How are you?", voice, seed=8, language=language, **KNOBS)))
    lead, gap, tail = SILENCES
    np.testing.assert_array_equal(chunks[0], np.zeros(lead))
    np.testing.assert_array_equal(chunks[-1], np.zeros(tail))
    assert any(len(c) == gap and not c.any() for c in chunks)
    np.testing.assert_array_equal(
        np.concatenate(chunks), np.concatenate([np.zeros(lead), a, np.zeros(gap), b, np.zeros(tail)])
    )


def test_tags_alone_are_silence_and_bad_tags_fail_before_any_work(model, monkeypatch):
    tts, language = model
    voice = random_voice(seed=5)

    def no_work(*args, **kwargs):
        raise AssertionError("T3 ran")

    monkeypatch.setattr(tts.speech, "tokens", no_work)
    for watermark in (False, True):  # silence alone is left unmarked
        wav = tts.generate("[pause:1.5s] <break time='1ms'/>", voice, language=language, watermark=watermark)
        np.testing.assert_array_equal(wav, np.zeros(36024, np.float32))
    chunks = list(tts.stream("[pause:1.5s]", voice, language=language))
    assert len(chunks) == 1 and len(chunks[0]) == 36000 and not chunks[0].any()
    with pytest.raises(ValueError, match="the text has pause tags, which are silences in audio"):
        tts.speech_tokens("Hello. [pause:1s] There.", voice, language=language)
    for call in (tts.generate, tts.stream, tts.speech_tokens):
        with pytest.raises(ValueError, match=r"pause tag '\[pause:11s\]' is 11 s long"):
            call("Hello. [pause:11s] There.", voice, language=language)
        with pytest.raises(ValueError, match="malformed pause tag"):
            call("Hello. [pause:soon] There.", voice, language=language)
