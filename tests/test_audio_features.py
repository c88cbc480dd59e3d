"""Spectral front-end without torch: frame counts around hop multiples, short input, silence, dtype policy,
batches, and the STFT against a direct DFT."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_chatterbox.audio.fbank import campplus_features, kaldi_fbank, kaldi_mel_banks
from mlx_chatterbox.audio.mel import (
    s3gen_mel,
    s3tokenizer_log_mel,
    slaney_mel_filters,
    voice_encoder_mel,
)
from mlx_chatterbox.audio.spectral import as_waveform, hann_window, stft
from mlx_chatterbox.audio.trim import trim_silence


def noise(n: int, seed: int = 0, scale: float = 0.1, rows: int | None = None) -> np.ndarray:
    shape = (n,) if rows is None else (rows, n)
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def tone(n: int, sr: int, hz: float = 440.0, amp: float = 0.5) -> np.ndarray:
    return (amp * np.sin(2 * np.pi * hz * np.arange(n) / sr)).astype(np.float32)


# --- spectral ---------------------------------------------------------------------------------------------


def test_hann_window_periodic_and_symmetric():
    p, s = hann_window(8), hann_window(8, periodic=False)
    assert p[0] == 0 and s[0] == 0 and s[-1] == pytest.approx(0) and p[-1] > 0
    np.testing.assert_allclose(p, hann_window(9, periodic=False)[:-1], atol=1e-15)
    assert not p.flags.writeable


@pytest.mark.parametrize("n_fft,hop,win", [(16, 4, None), (16, 5, 10), (15, 4, 15)])
def test_stft_equals_direct_dft(n_fft, hop, win):
    x = noise(101, seed=1)
    out = stft(x, n_fft, hop, win)
    assert out.dtype == np.complex64 and out.shape == (1 + 101 // hop, n_fft // 2 + 1)
    win = win or n_fft
    window = np.zeros(n_fft)
    window[(n_fft - win) // 2 : (n_fft - win) // 2 + win] = 0.5 - 0.5 * np.cos(
        2 * np.pi * np.arange(win) / win
    )
    pad = n_fft // 2
    xp = np.concatenate([x[1 : pad + 1][::-1], x, x[-pad - 1 : -1][::-1]]).astype(np.float64)
    k = np.arange(n_fft // 2 + 1)[:, None] * np.arange(n_fft)[None, :]
    basis = np.exp(-2j * np.pi * k / n_fft)
    for t in (0, 3, out.shape[0] - 1):
        ref = basis @ (xp[t * hop : t * hop + n_fft] * window)
        np.testing.assert_allclose(out[t], ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("length", [63, 64, 65, 127, 128, 129])
def test_stft_frame_counts(length):
    x = noise(length)
    assert stft(x, 32, 16).shape[0] == 1 + length // 16
    assert stft(x, 32, 16, center=False).shape[0] == 1 + (length - 32) // 16


def test_stft_batch_rows_independent_and_dtype():
    x = noise(300, rows=3)
    out = stft(x, 64, 16, dtype=np.complex128)
    assert out.shape == (3, 1 + 300 // 16, 33) and out.dtype == np.complex128
    np.testing.assert_array_equal(out[1], stft(x[1], 64, 16, dtype=np.complex128))


def test_stft_rejects_bad_arguments():
    with pytest.raises(ValueError, match="win_length"):
        stft(noise(100), 16, 4, win_length=17)
    with pytest.raises(ValueError, match="empty"):
        stft(np.zeros(0, np.float32), 16, 4)
    with pytest.raises(ValueError, match="shorter"):
        stft(noise(10), 16, 4, center=False)


# --- dtype policy (shared by every front-end) ---------------------------------------------------------------


def test_integer_pcm_is_refused_everywhere():
    pcm = (noise(4000) * 32767).astype(np.int16)
    for fn in (
        s3gen_mel,
        s3tokenizer_log_mel,
        voice_encoder_mel,
        kaldi_fbank,
        campplus_features,
        trim_silence,
    ):
        with pytest.raises(TypeError, match="int16"):
            fn(pcm)


def test_float64_is_rounded_to_float32_first():
    x64 = 0.1 * np.random.default_rng(3).standard_normal(5000)
    x32 = x64.astype(np.float32)
    for fn in (s3gen_mel, s3tokenizer_log_mel, voice_encoder_mel, kaldi_fbank, campplus_features):
        a, b = fn(x64), fn(x32)
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    assert trim_silence(x64) == trim_silence(x32)


def test_mx_array_input():
    x = noise(5000)
    np.testing.assert_array_equal(s3gen_mel(mx.array(x)), s3gen_mel(x))


def test_as_waveform_shape_check():
    with pytest.raises(ValueError, match="1-D or 2-D"):
        as_waveform(np.zeros((1, 2, 3), np.float32))
    with pytest.raises(ValueError, match="1-D"):
        trim_silence(noise(3000, rows=2))


# --- mel filterbanks ------------------------------------------------------------------------------------------


def test_slaney_filters_cached_readonly_and_bounded():
    f = slaney_mel_filters(24000, 1920, 80, 0.0, 8000.0)
    assert f.shape == (80, 961) and f.dtype == np.float32
    assert f is slaney_mel_filters(24000, 1920, 80, 0.0, 8000.0)
    assert not f.flags.writeable
    assert (f >= 0).all() and (f.max(axis=1) > 0).all()
    assert not f[:, 641:].any()  # nothing above 8 kHz (bin 640 = 8000 Hz at 12.5 Hz per bin)
    with pytest.raises(ValueError):
        slaney_mel_filters(16000, 400, 40, 0.0, 9000.0)


def test_kaldi_banks_shape_and_nyquist_column():
    b = kaldi_mel_banks(80)
    assert b.shape == (80, 257) and not b[:, -1].any() and not b.flags.writeable
    assert b.max() <= 1.0 and (b.max(axis=1) > 0.4).all()  # the lowest triangles fall between 31.25 Hz bins
    assert not b[:, 0].any()  # below 20 Hz


# --- s3gen_mel -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [721, 959, 960, 961, 1439, 1440, 1441, 24000 + 239])
def test_s3gen_mel_frames(length):
    out = s3gen_mel(noise(length))
    assert out.shape == (length // 480, 80) and out.dtype == np.float32 and np.isfinite(out).all()


def test_s3gen_mel_short_batch_and_silence():
    with pytest.raises(ValueError, match="721"):
        s3gen_mel(noise(720))
    x = noise(2000, rows=2)
    out = s3gen_mel(x)
    assert out.shape == (2, 4, 80)
    np.testing.assert_array_equal(out[0], s3gen_mel(x[0]))
    quiet = s3gen_mel(np.zeros(4800, np.float32))
    assert (quiet == quiet[:1]).all() and (quiet >= np.log(1e-5) - 1e-6).all()


# --- s3tokenizer_log_mel -------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [201, 319, 320, 321, 639, 640, 641, 16000 + 77])
def test_s3tokenizer_log_mel_frames(length):
    out = s3tokenizer_log_mel(noise(length))
    assert out.shape == (length // 160, 128) and out.dtype == np.float32
    assert out.max() - out.min() <= 2.0 + 1e-6  # the (max - 8) floor, divided by 4


def test_s3tokenizer_log_mel_short_silence_and_max_len():
    with pytest.raises(ValueError, match="201"):
        s3tokenizer_log_mel(noise(200))
    np.testing.assert_array_equal(s3tokenizer_log_mel(np.zeros(1000, np.float32)), np.full((6, 128), -1.5))
    x = noise(3200)
    full, cut = s3tokenizer_log_mel(x), s3tokenizer_log_mel(x, max_len=3)
    np.testing.assert_array_equal(cut, full[:12])
    assert s3tokenizer_log_mel(x, max_len=100).shape == full.shape
    with pytest.raises(ValueError, match="max_len"):
        s3tokenizer_log_mel(x, max_len=0)


def test_s3tokenizer_log_mel_floor_is_per_row():
    loud, quiet = tone(4000, 16000), noise(4000, scale=1e-4)
    out = s3tokenizer_log_mel(np.stack([loud, quiet]))
    np.testing.assert_array_equal(out[0], s3tokenizer_log_mel(loud))
    np.testing.assert_array_equal(out[1], s3tokenizer_log_mel(quiet))


# --- voice_encoder_mel ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 100, 159, 160, 161, 400, 16000 + 33])
def test_voice_encoder_mel_frames(length):
    out = voice_encoder_mel(noise(length))
    assert out.shape == (1 + length // 160, 40) and out.dtype == np.float32 and (out >= 0).all()


def test_voice_encoder_mel_empty_silence_and_power_scaling():
    with pytest.raises(ValueError, match="at least 1"):
        voice_encoder_mel(np.zeros(0, np.float32))
    assert not voice_encoder_mel(np.zeros(800, np.float32)).any()
    x = noise(1600)
    # a linear power mel: doubling the amplitude quadruples it
    np.testing.assert_allclose(voice_encoder_mel(2 * x), 4 * voice_encoder_mel(x), rtol=1e-6)


# --- kaldi fbank / campplus_features ----------------------------------------------------------------------------


@pytest.mark.parametrize("length", [400, 559, 560, 561, 16000, 16000 + 161])
def test_kaldi_fbank_frames(length):
    out = kaldi_fbank(noise(length))
    assert out.shape == (1 + (length - 400) // 160, 80) and out.dtype == np.float32


def test_kaldi_fbank_short_silence_and_dc():
    with pytest.raises(ValueError, match="400"):
        kaldi_fbank(noise(399))
    eps_log = np.log(np.finfo(np.float32).eps)
    np.testing.assert_allclose(kaldi_fbank(np.zeros(1000, np.float32)), eps_log, rtol=1e-7)
    # per-frame DC removal: a constant offset changes nothing
    x = noise(4000)
    np.testing.assert_allclose(kaldi_fbank(x + 0.25), kaldi_fbank(x), atol=1e-4)
    assert kaldi_fbank(x, num_mel_bins=40).shape == (23, 40)


def test_campplus_features_is_mean_normalised_fbank():
    x = noise(8000, rows=2)
    feats = campplus_features(x)
    assert feats.shape == (2, 48, 80)
    np.testing.assert_allclose(feats.mean(axis=1), 0.0, atol=1e-5)
    fb = kaldi_fbank(x[1])
    np.testing.assert_allclose(feats[1], fb - fb.mean(axis=0), atol=1e-5)


# --- trim_silence ------------------------------------------------------------------------------------------


def test_trim_brackets_a_tone_burst():
    sr = 16000
    x = np.zeros(3 * sr, np.float32)
    x[sr : 2 * sr] = tone(sr, sr)
    start, end = trim_silence(x)
    assert start % 512 == 0 and start <= sr < start + 2048
    assert end - 2048 < 2 * sr <= end <= len(x)
    quiet = x.copy()
    quiet[int(2.5 * sr) :] = 0.03 * tone(
        len(x) - int(2.5 * sr), sr
    )  # -30 dB: silent at top_db 20, kept at 40
    assert trim_silence(quiet) == (start, end)
    assert trim_silence(quiet, top_db=40)[1] == len(x)


def test_trim_edge_cases():
    assert trim_silence(np.zeros(5000, np.float32)) == (0, 5000)  # below librosa's amin: nothing is silent
    assert trim_silence(noise(300)) == (0, 300)
    assert trim_silence(np.zeros(0, np.float32)) == (0, 0)
    assert trim_silence(noise(3000), top_db=-1.0) == (0, 0)
    with pytest.raises(ValueError, match="hop_length"):
        trim_silence(noise(3000), hop_length=0)
