"""Audio file reading and the two resamplers, without torch or librosa: errors that name the file, round trips of
written files, channel averaging, length rules and identities."""

from __future__ import annotations

import math

import numpy as np
import pytest
import soundfile as sf

from mlx_chatterbox.audio.io import AudioError, load_audio
from mlx_chatterbox.audio.resample import resample_sinc_hann, resample_soxr_hq

RESAMPLERS = [resample_soxr_hq, resample_sinc_hann]


def tone(n: int, sr: int, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    return (amp * np.sin(2 * np.pi * freq * np.arange(n) / sr)).astype(np.float32)


# ---------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    path = tmp_path / "nope.wav"
    with pytest.raises(AudioError, match="nope.wav: no such file"):
        load_audio(path, 24000)


def test_directory(tmp_path):
    with pytest.raises(AudioError, match="is a directory"):
        load_audio(tmp_path, 24000)


def test_not_audio(tmp_path):
    path = tmp_path / "notes.wav"
    path.write_text("these are not samples\n" * 20)
    with pytest.raises(AudioError, match="notes.wav: not an audio file"):
        load_audio(path, 24000)


def test_empty_file_of_zero_bytes(tmp_path):
    path = tmp_path / "zero.wav"
    path.write_bytes(b"")
    with pytest.raises(AudioError, match="zero.wav"):
        load_audio(path, 24000)


def test_no_samples(tmp_path):
    path = tmp_path / "empty.wav"
    sf.write(path, np.zeros((0, 2), np.float32), 16000, subtype="PCM_16")
    with pytest.raises(AudioError, match="empty.wav: contains no samples"):
        load_audio(path, 24000)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_samples(tmp_path, bad):
    wav = tone(1000, 24000)
    wav[[10, 500]] = bad
    path = tmp_path / "bad.wav"
    sf.write(path, wav, 24000, subtype="FLOAT")
    with pytest.raises(AudioError, match=r"bad.wav: 2 of 1000 samples are NaN or inf"):
        load_audio(path, 24000)


def test_audio_error_is_value_error():
    assert issubclass(AudioError, ValueError)


@pytest.mark.parametrize("sr", [0, -16000, 16000.5])
def test_bad_rate(tmp_path, sr):
    path = tmp_path / "a.wav"
    sf.write(path, tone(100, 16000), 16000)
    with pytest.raises(ValueError, match="positive integer rate"):
        load_audio(path, sr)


# ---------------------------------------------------------------- reading


@pytest.mark.parametrize("subtype", ["FLOAT", "DOUBLE"])
def test_round_trip_float_exact(tmp_path, subtype):
    wav = tone(12345, 24000)
    path = tmp_path / "f.wav"
    sf.write(path, wav, 24000, subtype=subtype)
    out = load_audio(str(path), 24000)
    assert out.dtype == np.float32 and out.shape == (12345,)
    np.testing.assert_array_equal(out, wav)


@pytest.mark.parametrize("subtype", ["PCM_16", "PCM_24", "PCM_32"])
def test_round_trip_int_scaling(tmp_path, subtype):
    # Integer PCM reads back as q / 2^(bits-1); 16-bit values written as int32 are q·2^16 at any depth.
    rng = np.random.default_rng(0)
    q = rng.integers(-(2**15), 2**15, 777)
    path = tmp_path / "i.wav"
    sf.write(path, (q * 2**16).astype(np.int32), 16000, subtype=subtype)
    out = load_audio(path, 16000)
    np.testing.assert_array_equal(out, (q / 2**15).astype(np.float32))


def test_flac_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    q = rng.integers(-(2**15), 2**15, 4001).astype(np.int16)
    path = tmp_path / "a.flac"
    sf.write(path, q, 22050, subtype="PCM_16")
    np.testing.assert_array_equal(load_audio(path, 22050), (q / 2**15).astype(np.float32))


def test_channels_are_averaged(tmp_path):
    left, right = tone(2000, 16000, 300), tone(2000, 16000, 700, 0.25)
    path = tmp_path / "st.wav"
    sf.write(path, np.stack([left, right], axis=1), 16000, subtype="FLOAT")
    np.testing.assert_allclose(load_audio(path, 16000), (left + right) / 2, atol=1e-7, rtol=0)


def test_four_channels_are_averaged(tmp_path):
    chans = np.stack([tone(999, 8000, f, 0.2) for f in (100, 200, 300, 400)], axis=1)
    path = tmp_path / "quad.wav"
    sf.write(path, chans, 8000, subtype="FLOAT")
    np.testing.assert_allclose(load_audio(path, 8000), chans.mean(axis=1), atol=1e-7, rtol=0)


def test_resampled_on_read(tmp_path):
    wav = tone(22050, 22050)
    path = tmp_path / "r.wav"
    sf.write(path, wav, 22050, subtype="FLOAT")
    out = load_audio(path, 24000)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, resample_soxr_hq(wav, 22050, 24000))
    # librosa's float ratio: 22050 * (24000 / 22050) = 24000.000000000004, so ceil gives one sample more.
    assert out.shape == (24001,)


def test_very_short_audio_is_returned(tmp_path):
    path = tmp_path / "one.wav"
    sf.write(path, np.array([0.25], np.float32), 16000, subtype="FLOAT")
    assert load_audio(path, 16000).tolist() == [0.25]
    assert load_audio(path, 24000).shape == (2,)  # ceil(1 * 1.5)


# ---------------------------------------------------------------- resamplers


@pytest.mark.parametrize("fn", RESAMPLERS)
@pytest.mark.parametrize(
    "sr_in,sr_out",
    [(24000, 16000), (16000, 24000), (44100, 24000), (22050, 16000), (8000, 24000), (48000, 16000)],
)
@pytest.mark.parametrize("n", [1, 2, 3, 1000, 4801])
def test_output_length(fn, sr_in, sr_out, n):
    out = fn(np.ones(n, np.float32), sr_in, sr_out)
    assert out.dtype == np.float32
    if fn is resample_soxr_hq:  # librosa: ceil of n times a float ratio
        expected = math.ceil(n * (sr_out / sr_in))
    else:  # torchaudio: ceil of a float quotient of the gcd-reduced rates
        g = math.gcd(sr_in, sr_out)
        expected = math.ceil((sr_out // g) * n / (sr_in // g))
    assert out.shape == (expected,)


@pytest.mark.parametrize("fn", RESAMPLERS)
def test_equal_rates_is_identity(fn):
    wav = tone(1001, 24000)
    out = fn(wav, 24000, 24000)
    np.testing.assert_array_equal(out, wav)
    assert fn(wav.astype(np.float64), 16000, 16000).dtype == np.float32


@pytest.mark.parametrize("fn", RESAMPLERS)
def test_empty_input(fn):
    assert fn(np.zeros(0, np.float32), 24000, 16000).shape == (0,)


@pytest.mark.parametrize("fn", RESAMPLERS)
@pytest.mark.parametrize("sr_in,sr_out", [(24000, 16000), (16000, 24000), (44100, 24000)])
def test_band_limited_tone_survives(fn, sr_in, sr_out):
    # A 440 Hz tone away from the edges comes out as the same tone at the new rate.
    n = sr_in // 2
    out = fn(tone(n, sr_in), sr_in, sr_out)
    ref = tone(out.shape[0], sr_out)
    mid = slice(out.shape[0] // 4, 3 * out.shape[0] // 4)
    np.testing.assert_allclose(out[mid], ref[mid], atol=2e-3)


@pytest.mark.parametrize("fn", RESAMPLERS)
def test_rejects_bad_input(fn):
    with pytest.raises(ValueError, match="1-d"):
        fn(np.zeros((2, 100), np.float32), 24000, 16000)
    with pytest.raises(ValueError, match="positive integer"):
        fn(np.zeros(100, np.float32), 24000, 0)


def test_soxr_rejects_non_finite():
    wav = tone(100, 24000)
    wav[3] = np.nan
    with pytest.raises(ValueError, match="not finite"):
        resample_soxr_hq(wav, 24000, 16000)
