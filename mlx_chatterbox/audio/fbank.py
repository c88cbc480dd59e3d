"""Kaldi log-mel filterbank features (``torchaudio.compliance.kaldi.fbank`` defaults) for CAM++."""

from __future__ import annotations

import functools

import numpy as np

from .spectral import as_waveform, frame, hann_window

# torchaudio.compliance.kaldi.fbank defaults as CAMPPlus.extract_feature calls it (architecture §4.7, §9.14)
SAMPLE_RATE = 16_000
FRAME_LENGTH = 400  # 25 ms
FRAME_SHIFT = 160  # 10 ms
PADDED_LENGTH = 512  # the next power of two: the FFT size
PREEMPHASIS = 0.97
POVEY_POWER = 0.85
LOW_FREQ = 20.0  # Hz
LOG_FLOOR = float(np.finfo(np.float32).eps)  # 1.19e-7, Kaldi's numeric_limits<float>::epsilon()


def kaldi_mel_scale(f: np.ndarray) -> np.ndarray:
    """Hz -> Kaldi/HTK mel, 1127·ln(1 + f/700), float64."""
    return 1127.0 * np.log1p(np.asarray(f, np.float64) / 700.0)


@functools.lru_cache(maxsize=8)
def kaldi_mel_banks(
    num_bins: int,
    n_fft: int = PADDED_LENGTH,
    sample_rate: int = SAMPLE_RATE,
    low_freq: float = LOW_FREQ,
    high_freq: float = 0.0,
) -> np.ndarray:
    """Kaldi's triangular mel banks (torchaudio ``get_mel_banks`` without VTLN, plus its zero Nyquist column).

    Unlike librosa's, the triangles are linear in the *mel* domain and not area-normalised. ``high_freq <= 0``
    is an offset from Nyquist, as in Kaldi.

    Returns:
        float64 (num_bins, n_fft // 2 + 1), read-only; the last column (Nyquist) is zero.
    """
    nyquist = 0.5 * sample_rate
    high = high_freq + nyquist if high_freq <= 0.0 else high_freq
    if num_bins <= 3 or not 0.0 <= low_freq < high <= nyquist:
        raise ValueError(
            f"bad mel banks: num_bins={num_bins} (> 3), low={low_freq}, high={high}, nyquist={nyquist}"
        )
    mel_low, mel_high = kaldi_mel_scale(low_freq), kaldi_mel_scale(high)
    # num_bins + 1 steps: the outer triangles spread half a step beyond the bank's centres.
    delta = (mel_high - mel_low) / (num_bins + 1)
    left = mel_low + delta * np.arange(num_bins)[:, None]  # (num_bins, 1)
    center, right = left + delta, left + 2.0 * delta
    bin_mel = kaldi_mel_scale(sample_rate / n_fft * np.arange(n_fft // 2))[None, :]  # (1, n_fft // 2)
    banks = np.maximum(
        0.0, np.minimum((bin_mel - left) / (center - left), (right - bin_mel) / (right - center))
    )
    banks = np.pad(banks, [(0, 0), (0, 1)])
    banks.flags.writeable = False
    return banks


@functools.lru_cache(maxsize=1)
def _povey_window() -> np.ndarray:
    # Kaldi's Povey window: a symmetric Hann raised to 0.85, zero at both ends.
    w = hann_window(FRAME_LENGTH, periodic=False) ** POVEY_POWER
    w.flags.writeable = False
    return w


def _fbank64(x: np.ndarray, num_mel_bins: int) -> np.ndarray:
    if x.shape[-1] < FRAME_LENGTH:
        raise ValueError(
            f"kaldi_fbank needs at least {FRAME_LENGTH} samples (one 25 ms frame, snip_edges), got {x.shape[-1]}"
        )
    frames = frame(x, FRAME_LENGTH, FRAME_SHIFT)  # (..., T, 400), T = 1 + (L - 400) // 160
    frames = frames - frames.mean(axis=-1, keepdims=True)  # per-frame DC removal
    # Pre-emphasis inside each frame; the first sample uses itself as predecessor (replicate padding, §9.14).
    previous = np.concatenate([frames[..., :1], frames[..., :-1]], axis=-1)
    frames = (frames - PREEMPHASIS * previous) * _povey_window()
    spectrum = np.fft.rfft(frames, n=PADDED_LENGTH, axis=-1)  # zero-padded to 512
    power = spectrum.real**2 + spectrum.imag**2
    mel = power @ kaldi_mel_banks(num_mel_bins).T
    return np.log(np.maximum(mel, LOG_FLOOR))


def kaldi_fbank(wav_16k: np.ndarray, num_mel_bins: int = 80) -> np.ndarray:
    """``torchaudio.compliance.kaldi.fbank(wav[None], num_mel_bins=num_mel_bins)`` with every other argument at
    its default: 25 ms frames every 10 ms with snip_edges, no dither, DC removal, pre-emphasis 0.97, Povey
    window, 512-point power spectrum, Kaldi mel banks 20 Hz..8 kHz, ln(max(·, float32 eps)).

    Args:
        wav_16k: (L,) or (B, L) float samples in [-1, 1] at 16 kHz (not int16-scaled, as upstream feeds it);
            rows of a batch are independent. L < 400 raises ``ValueError``, as upstream asserts.
        num_mel_bins: number of mel bins (> 3).
    Returns:
        float32 (T, num_mel_bins) or (B, T, num_mel_bins), T = 1 + (L - 400) // 160.
    """
    return _fbank64(as_waveform(wav_16k, name="wav_16k"), num_mel_bins).astype(np.float32)


def campplus_features(wav_16k: np.ndarray) -> np.ndarray:
    """What ``CAMPPlus.extract_feature`` feeds the network: the 80-bin ``kaldi_fbank`` minus its mean over time
    (per-utterance CMN).

    Args:
        wav_16k: (L,) or (B, L) float samples in [-1, 1] at 16 kHz; each row is normalised by its own mean
            (equal lengths, so upstream's zero padding of a list never applies). L < 400 raises ``ValueError``.
    Returns:
        float32 (T, 80) or (B, T, 80), T = 1 + (L - 400) // 160.
    """
    feats = _fbank64(as_waveform(wav_16k, name="wav_16k"), 80)
    return (feats - feats.mean(axis=-2, keepdims=True)).astype(np.float32)
