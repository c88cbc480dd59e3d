"""Spectral front-end parity with upstream: S3Gen's mel24 (``s3gen/utils/mel.py``), the S3 tokenizer's log-mel
(``S3Tokenizer.log_mel_spectrogram``), the voice encoder's mel (``voice_encoder/melspec.py``), CAM++'s Kaldi fbank
(``torchaudio.compliance.kaldi.fbank`` via ``xvector.extract_feature``), ``librosa.effects.trim``, the Slaney and
Kaldi filterbanks, and ``torch.stft``.

Inputs are real speech (espeak-ng, resampled with sox) with silent and near-silent edges, white noise, a
logarithmic chirp, and lengths that are not multiples of the hops (160, 480, 640). Upstream runs in float32;
ours computes in float64, so the differences below are upstream's own float32 rounding.
"""

from __future__ import annotations

import shutil
import subprocess
import warnings
from pathlib import Path

import librosa
import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio.compliance.kaldi as kaldi
from chatterbox.models.s3gen.utils.mel import mel_spectrogram
from chatterbox.models.s3gen.xvector import extract_feature
from chatterbox.models.s3tokenizer.s3tokenizer import S3Tokenizer
from chatterbox.models.voice_encoder.config import VoiceEncConfig
from chatterbox.models.voice_encoder.melspec import melspectrogram

from mlx_chatterbox.audio.fbank import campplus_features, kaldi_fbank, kaldi_mel_banks
from mlx_chatterbox.audio.mel import (
    s3gen_mel,
    s3tokenizer_log_mel,
    slaney_mel_filters,
    voice_encoder_mel,
)
from mlx_chatterbox.audio.spectral import stft
from mlx_chatterbox.audio.trim import trim_silence

from .oracle import rel_err, rel_l2

pytestmark = pytest.mark.reference

TOL_REL = 1e-5  # relative L2, every feature
TOL_FILTERS = 1e-6  # max |ours - librosa| / max |librosa|
# torchaudio builds its Kaldi banks in float32 (1127·ln(1 + f/700) ~ 2800, ulp 2.4e-4, over mel steps of ~34).
TOL_KALDI_BANKS = 3e-5
# Absolute bounds on log features: a bin far below its frame's peak carries torch's float32 rounding (DC removal,
# window, FFT), relative ~1e-7 of the peak amplitude, so its ln error grows as 10^(depth/20): ~2e-4 at -60 dB,
# ~1e-2 at -110 dB. Speech and noise have little such depth; a pure chirp has 100+ dB, hence its looser bounds.
ABS_S3GEN, ABS_S3TOK, ABS_FBANK = 3e-4, 2e-4, 2e-3
# The chirp in log domains without a floor near the peak: measured rel L2 7.3e-5 (mel24), 3.3e-5 (fbank),
# 8.7e-5 (fbank after CMN); max abs 1.3e-2, 9.6e-3, 9.6e-3. The tokenizer's (max - 8) floor caps the depth at 80 dB.
CHIRP = dict(tol=2e-4, abs_tol=3e-2)
SPEECH = "Hello there. This is a short test of the voice cloning front end, with numbers: 1, 2, 3."


def _sox(src: Path, dst: Path, rate: int) -> np.ndarray:
    subprocess.run(
        ["sox", str(src), "-b", "32", "-e", "floating-point", str(dst), "rate", str(rate)], check=True
    )
    wav, sr = sf.read(dst, dtype="float32")
    assert sr == rate and wav.ndim == 1
    return wav


def _with_remainder(wav: np.ndarray, period: int, remainder: int) -> np.ndarray:
    """Trim to the longest length congruent to ``remainder`` mod ``period``: never a multiple of a hop."""
    n = (len(wav) - remainder) // period * period + remainder
    return wav[:n]


def _clips(speech: np.ndarray, sr: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lead = np.zeros(int(0.25 * sr), np.float32)
    tail = (1e-4 * rng.standard_normal(int(0.4 * sr))).astype(np.float32)
    padded = _with_remainder(np.concatenate([lead, speech, tail]), 960, 137)
    t = np.arange(int(1.3 * sr) + 91) / sr
    f0, f1 = 60.0, 0.45 * sr
    phase = 2 * np.pi * f0 * t[-1] / np.log(f1 / f0) * (np.exp(np.log(f1 / f0) * t / t[-1]) - 1)
    chirp = 0.7 * np.sin(phase) * np.minimum(1.0, np.minimum(t, t[-1] - t) / 0.05)
    return {
        "speech": padded,
        "speech_short": padded[: int(0.3 * sr) + 37],  # mostly the silent lead
        "noise": np.clip(0.3 * rng.standard_normal(int(1.1 * sr) + 13), -1, 1).astype(np.float32),
        "chirp": chirp.astype(np.float32),
    }


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[int, dict[str, np.ndarray]]:
    """Clips at 16 kHz and 24 kHz: {rate: {name: float32 (L,)}}."""
    for tool in ("espeak-ng", "sox"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    folder = tmp_path_factory.mktemp("speech")
    raw = folder / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(raw), SPEECH], check=True)  # 22050 Hz mono int16
    return {sr: _clips(_sox(raw, folder / f"speech_{sr}.wav", sr), sr, seed=sr) for sr in (16000, 24000)}


@pytest.fixture(scope="module")
def tokenizer() -> S3Tokenizer:
    return S3Tokenizer().eval()


def _check(name: str, ours: np.ndarray, ref: np.ndarray, abs_tol: float | None = None, tol: float = TOL_REL):
    assert ours.shape == ref.shape, f"{name}: shape {ours.shape} vs upstream {ref.shape}"
    assert ours.dtype == np.float32, f"{name}: dtype {ours.dtype}"
    err, max_abs = rel_l2(ours, ref), float(np.abs(ours.astype(np.float64) - ref).max())
    assert err < tol, f"{name}: rel L2 {err:.2e} (max abs {max_abs:.2e}) >= {tol:.0e}"
    if abs_tol is not None:
        assert max_abs < abs_tol, f"{name}: max abs {max_abs:.2e} >= {abs_tol:.0e} (rel L2 {err:.2e})"


# --- filterbanks and STFT -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sr,n_fft,n_mels,fmin,fmax",
    [
        (24000, 1920, 80, 0.0, 8000.0),
        (16000, 400, 128, 0.0, None),
        (16000, 400, 40, 0.0, 8000.0),
        (22050, 2048, 64, 30.0, 7000.0),
    ],
)
def test_slaney_filters_match_librosa(sr, n_fft, n_mels, fmin, fmax):
    ours = slaney_mel_filters(sr, n_fft, n_mels, fmin, fmax)
    ref = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    err = rel_err(ours, ref)
    assert err < TOL_FILTERS, f"max abs err / max = {err:.2e}"


def test_kaldi_banks_match_torchaudio():
    ref, _ = kaldi.get_mel_banks(80, 512, 16000.0, 20.0, 0.0, 100.0, -500.0, 1.0)
    ours = kaldi_mel_banks(80)
    assert not ours[:, -1].any()  # fbank appends this zero Nyquist column to torchaudio's banks
    err = float(np.abs(ours[:, :-1] - ref.numpy()).max())
    assert err < TOL_KALDI_BANKS, f"max abs {err:.2e}"


@pytest.mark.parametrize("n_fft,hop,win", [(400, 160, None), (1920, 480, None), (512, 128, 300), (16, 5, 12)])
@pytest.mark.parametrize("center", [True, False])
def test_stft_matches_torch(clips, n_fft, hop, win, center):
    for name, wav in clips[16000].items():
        ref = torch.stft(
            torch.from_numpy(wav),
            n_fft,
            hop,
            win_length=win,
            window=torch.hann_window(win or n_fft),
            center=center,
            pad_mode="reflect",
            return_complex=True,
        ).numpy()
        ours = stft(wav, n_fft, hop, win, center=center)
        assert ours.shape == ref.T.shape and ours.dtype == np.complex64
        err = float(np.linalg.norm(ours - ref.T) / np.linalg.norm(ref))
        assert err < 1e-6, f"{name}: rel L2 {err:.2e}"


# --- the three mels ------------------------------------------------------------------------------------------


def test_s3gen_mel_matches_upstream(clips):
    for name, wav in clips[24000].items():
        ref = mel_spectrogram(torch.from_numpy(wav))[0].numpy().T  # (1, 80, T) -> (T, 80)
        assert ref.shape[0] == len(wav) // 480
        bounds = CHIRP if name == "chirp" else dict(abs_tol=ABS_S3GEN)
        _check(f"s3gen_mel {name} (L={len(wav)})", s3gen_mel(wav), ref, **bounds)
    batch = np.stack([clips[24000]["noise"], clips[24000]["speech"][: len(clips[24000]["noise"])]])
    ref = mel_spectrogram(torch.from_numpy(batch)).numpy().transpose(0, 2, 1)
    _check("s3gen_mel batch", s3gen_mel(batch), ref, ABS_S3GEN)


def test_s3tokenizer_log_mel_matches_upstream(clips, tokenizer):
    with torch.no_grad():
        for name, wav in clips[16000].items():
            # forward() hands each wav to log_mel_spectrogram as (1, L): one maximum per utterance
            ref = tokenizer.log_mel_spectrogram(torch.from_numpy(wav)[None])[0].numpy().T
            assert ref.shape[0] == len(wav) // 160
            _check(f"s3tokenizer_log_mel {name} (L={len(wav)})", s3tokenizer_log_mel(wav), ref, ABS_S3TOK)
            # forward's max_len cuts after the floor, so the cut mel keeps the whole clip's maximum
            max_len = ref.shape[0] // 4 // 2
            ours = s3tokenizer_log_mel(wav, max_len=max_len)
            _check(f"s3tokenizer_log_mel {name} max_len={max_len}", ours, ref[: 4 * max_len], ABS_S3TOK)


def test_voice_encoder_mel_matches_upstream(clips):
    hp = VoiceEncConfig()
    for name, wav in clips[16000].items():
        # as embeds_from_wavs: trim (top_db 20), then the mel of what is left
        trimmed, (start, end) = librosa.effects.trim(wav, top_db=20)
        assert trim_silence(wav) == (start, end), name
        for label, x in ((name, wav), (f"{name} trimmed", trimmed)):
            ref = melspectrogram(x, hp).T
            _check(f"voice_encoder_mel {label} (L={len(x)})", voice_encoder_mel(x), ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # librosa warns that n_fft exceeds these lengths
        for n in (1, 7, 150, 250):
            x = clips[16000]["noise"][:n]
            _check(f"voice_encoder_mel L={n}", voice_encoder_mel(x), melspectrogram(x, hp).T)


# --- Kaldi fbank / CAM++ features ------------------------------------------------------------------------------


def test_kaldi_fbank_matches_torchaudio(clips):
    for name, wav in clips[16000].items():
        ref = kaldi.fbank(torch.from_numpy(wav)[None], num_mel_bins=80).numpy()
        assert ref.shape[0] == 1 + (len(wav) - 400) // 160
        bounds = CHIRP if name == "chirp" else dict(abs_tol=ABS_FBANK)
        _check(f"kaldi_fbank {name} (L={len(wav)})", kaldi_fbank(wav), ref, **bounds)
    wav = clips[16000]["speech"][:400]  # exactly one frame
    _check(
        "kaldi_fbank L=400",
        kaldi_fbank(wav),
        kaldi.fbank(torch.from_numpy(wav)[None], num_mel_bins=80).numpy(),
    )


def test_campplus_features_match_extract_feature(clips):
    for name, wav in clips[16000].items():
        ref = extract_feature(torch.from_numpy(wav)[None])[0][0].numpy()
        bounds = CHIRP if name == "chirp" else dict(abs_tol=ABS_FBANK)
        _check(f"campplus_features {name}", campplus_features(wav), ref, **bounds)
    n = len(clips[16000]["noise"])
    batch = np.stack([clips[16000]["noise"], clips[16000]["speech"][:n]])
    ref = extract_feature(torch.from_numpy(batch))[0].numpy()
    _check("campplus_features batch", campplus_features(batch), ref, ABS_FBANK)


# --- trim ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_db", [20, 30, 60])
def test_trim_matches_librosa(clips, top_db):
    for sr, named in clips.items():
        for name, wav in named.items():
            _, ref = librosa.effects.trim(wav, top_db=top_db)
            assert trim_silence(wav, top_db=top_db) == tuple(
                ref.tolist()
            ), f"{name} at {sr} Hz, top_db {top_db}"
    for frame_length, hop in ((1024, 256), (2047, 300)):
        wav = clips[16000]["speech"]
        _, ref = librosa.effects.trim(wav, top_db=20, frame_length=frame_length, hop_length=hop)
        assert trim_silence(wav, 20, frame_length, hop) == tuple(ref.tolist()), (frame_length, hop)
