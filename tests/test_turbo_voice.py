"""Turbo's voice cloning (``VoiceCloner.turbo``) on the tiny model's networks (no torch): the 15 s / 375-token
prompt, the loudness step, the 5 s minimum, and the settings' validation."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from mlx_chatterbox import TTS
from mlx_chatterbox.convert import convert
from mlx_chatterbox.generation.voice import VoiceCloner
from tests.conftest import TINY_MODEL, write_upstream_checkpoint
from tests.test_cloning import speechlike

FIELDS = ("speaker_emb", "t3_prompt_tokens", "s3gen_prompt_tokens", "s3gen_prompt_mel", "xvector")


@pytest.fixture(scope="module")
def networks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("turbo_cloning")
    tts = TTS.load(convert(write_upstream_checkpoint(tmp / "up"), tmp / "mlx", config=TINY_MODEL))
    return tuple(tts.folder.load(name) for name in ("voice_encoder", "s3tokenizer", "campplus"))


def test_prompt_comes_from_the_first_15_seconds(networks):
    wav = speechlike(16.2, 24000)
    turbo, english = VoiceCloner.turbo(*networks)(wav), VoiceCloner(*networks)(wav)
    assert turbo.t3_prompt_tokens.shape == (1, 375) and english.t3_prompt_tokens.shape == (1, 150)
    assert turbo.s3gen_prompt_mel.shape == english.s3gen_prompt_mel.shape == (1, 500, 80)
    short = VoiceCloner.turbo(*networks)(wav[: int(7.3 * 24000)])
    assert short.t3_prompt_tokens.shape[1] < 375


def test_loudness_normalisation_removes_the_recording_level(networks):
    cloner = VoiceCloner.turbo(*networks)
    wav = speechlike(6.5, 24000, seed=3)
    # A power-of-two gain is exact in floating point, so the normalised clips are the same samples.
    a, b = cloner(wav), cloner(wav / 8)
    for field in FIELDS:
        np.testing.assert_array_equal(np.array(getattr(a, field)), np.array(getattr(b, field)), err_msg=field)
    # Without the loudness step the level changes the prompt mel (a log of the energy).
    plain = VoiceCloner(*networks, 375, t3_prompt_seconds=15.0)
    assert not np.array_equal(
        np.array(plain(wav).s3gen_prompt_mel), np.array(plain(wav / 8).s3gen_prompt_mel)
    )


def test_a_clip_below_the_loudness_gate_is_used_unscaled_with_a_warning(networks, caplog):
    wav = np.zeros(6 * 24000, np.float32)
    wav[::7] = 1e-6  # not all zeros, but about -140 LUFS
    with caplog.at_level(logging.WARNING, logger="mlx_chatterbox.generation.voice"):
        VoiceCloner.turbo(*networks)(wav)
    assert "too quiet to measure its loudness" in caplog.text


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        (5 * 24000, r"5.00 s long; this model needs a recording longer than 5 s"),  # upstream: > 5.0 s
        (3 * 24000, r"3.00 s long; this model needs a recording longer than 5 s"),
        (100, r"0.00 s long; this model needs a recording longer than 5 s"),
    ],
)
def test_turbo_needs_more_than_5_seconds(samples, message):
    cloner = VoiceCloner.turbo(None, None, None)  # refused before any network runs
    with pytest.raises(ValueError, match=message):
        cloner(np.full(samples, 0.1, np.float32))


def test_5_seconds_and_a_sample_is_enough(networks):
    voice = VoiceCloner.turbo(*networks)(np.append(speechlike(5.0, 24000), np.float32(0.0)))
    assert voice.t3_prompt_tokens.shape[1] >= 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"t3_prompt_len": 0}, "t3_prompt_len must be a positive number"),
        ({"t3_prompt_seconds": 0.0}, "t3_prompt_seconds must be positive"),
        ({"t3_prompt_seconds": 1.00001}, "a whole number of 16 kHz samples"),
        ({"target_lufs": float("inf")}, "target_lufs must be a finite loudness"),
        ({"longer_than_seconds": -1.0}, "longer_than_seconds must be >= 0"),
    ],
)
def test_settings_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VoiceCloner(None, None, None, **kwargs)
