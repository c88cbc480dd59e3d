"""Slaney mel filterbanks and the three mel front-ends: S3Gen's 24 kHz log-mel, the S3 tokenizer's and the VE's."""

from __future__ import annotations

import functools

import numpy as np

from .spectral import as_waveform, reflect_pad, stft

# S3Gen prompt mel (upstream s3gen/utils/mel.py; architecture §4.1)
S3GEN_SR = 24_000
S3GEN_N_FFT = 1920  # 80 ms window
S3GEN_HOP = 480  # 20 ms: 50 frames/s, two per speech token
S3GEN_N_MELS = 80
S3GEN_FMAX = 8000.0
S3GEN_PAD = (S3GEN_N_FFT - S3GEN_HOP) // 2  # 720 samples of manual reflect padding, then center=False

# S3 tokenizer log-mel (Chatterbox's S3Tokenizer.log_mel_spectrogram; architecture §6)
S3TOK_SR = 16_000
S3TOK_N_FFT = 400  # 25 ms
S3TOK_HOP = 160  # 10 ms: 100 frames/s, four per speech token
S3TOK_N_MELS = 128

# Voice-encoder mel (voice_encoder/melspec.py + config.py; architecture §5)
VE_SR = 16_000
VE_N_FFT = 400
VE_HOP = 160
VE_N_MELS = 40
VE_FMAX = 8000.0

# Slaney's mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above (27 mels per factor 6.4).
_F_SP = 200.0 / 3.0
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP  # 15 mels
_LOG_STEP = np.log(6.4) / 27.0


def hz_to_mel_slaney(f: np.ndarray) -> np.ndarray:
    """Hz -> Slaney mel (librosa's ``hz_to_mel(htk=False)``), float64."""
    f = np.asarray(f, np.float64)
    log_part = _MIN_LOG_MEL + np.log(np.maximum(f, _MIN_LOG_HZ) / _MIN_LOG_HZ) / _LOG_STEP
    return np.where(f >= _MIN_LOG_HZ, log_part, f / _F_SP)


def mel_to_hz_slaney(m: np.ndarray) -> np.ndarray:
    """Slaney mel -> Hz (librosa's ``mel_to_hz(htk=False)``), float64."""
    m = np.asarray(m, np.float64)
    log_part = _MIN_LOG_HZ * np.exp(_LOG_STEP * (np.maximum(m, _MIN_LOG_MEL) - _MIN_LOG_MEL))
    return np.where(m >= _MIN_LOG_MEL, log_part, _F_SP * m)


@functools.lru_cache(maxsize=16)
def slaney_mel_filters(
    sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> np.ndarray:
    """Mel filterbank equal to ``librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)``:
    triangles on the Slaney mel scale, each scaled to unit area (Slaney norm).

    Returns:
        float32 (n_mels, n_fft // 2 + 1), read-only (it is cached and shared). ``fmax=None`` means sr / 2.
    """
    fmax = sr / 2.0 if fmax is None else float(fmax)
    if not 0.0 <= fmin < fmax <= sr / 2.0:
        raise ValueError(f"need 0 <= fmin < fmax <= sr/2, got fmin={fmin}, fmax={fmax}, sr={sr}")
    bin_hz = np.fft.rfftfreq(n_fft, 1.0 / sr)  # (F,)
    edges_hz = mel_to_hz_slaney(np.linspace(hz_to_mel_slaney(fmin), hz_to_mel_slaney(fmax), n_mels + 2))
    widths = np.diff(edges_hz)  # (n_mels + 1,)
    offsets = edges_hz[:, None] - bin_hz[None, :]  # (n_mels + 2, F)
    rising = -offsets[:-2] / widths[:-1, None]
    falling = offsets[2:] / widths[1:, None]
    # librosa stores the triangles in float32 before scaling by the norm; round the same way to match it bitwise.
    tri = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)
    area_norm = 2.0 / (edges_hz[2:] - edges_hz[:-2])
    filters = (tri.astype(np.float64) * area_norm[:, None]).astype(np.float32)
    filters.flags.writeable = False
    return filters


def _require_length(x: np.ndarray, minimum: int, what: str) -> None:
    if x.shape[-1] < minimum:
        raise ValueError(f"{what} needs at least {minimum} samples, got {x.shape[-1]}")


def s3gen_mel(wav_24k: np.ndarray) -> np.ndarray:
    """S3Gen's prompt mel (upstream ``mel_spectrogram``): 80-bin natural-log magnitude mel at 24 kHz, hop 480.

    Reflect-pad 720 samples per side, STFT (n_fft = win = 1920, periodic Hann, center=False), magnitude
    sqrt(re² + im² + 1e-9), Slaney mel (0..8 kHz), ln(max(·, 1e-5)).

    Args:
        wav_24k: (L,) or (B, L) float samples at 24 kHz; rows of a batch are independent, as upstream.
            Upstream's reflect padding needs L >= 721, so shorter input raises ``ValueError``.
    Returns:
        float32 (T, 80) or (B, T, 80), T = L // 480.
    """
    x = as_waveform(wav_24k, name="wav_24k")
    _require_length(x, S3GEN_PAD + 1, "s3gen_mel (reflect padding of 720)")
    spec = stft(
        reflect_pad(x, S3GEN_PAD, S3GEN_PAD), S3GEN_N_FFT, S3GEN_HOP, center=False, dtype=np.complex128
    )
    # A magnitude with 1e-9 inside the sqrt, not a power (architecture §9.10).
    mag = np.sqrt(spec.real**2 + spec.imag**2 + 1e-9)
    mel = mag @ slaney_mel_filters(S3GEN_SR, S3GEN_N_FFT, S3GEN_N_MELS, 0.0, S3GEN_FMAX).T.astype(np.float64)
    return np.log(np.maximum(mel, 1e-5)).astype(np.float32)


def s3tokenizer_log_mel(wav_16k: np.ndarray, max_len: int | None = None) -> np.ndarray:
    """The S3 tokenizer's input (Chatterbox's ``S3Tokenizer.log_mel_spectrogram`` as its ``forward`` applies it).

    STFT (n_fft 400, hop 160, periodic Hann, centered reflect), the last frame dropped, power |X|², Slaney mel
    with 128 bins (0..8 kHz), log10(max(·, 1e-10)), floored at (its maximum - 8), then (L + 4) / 4.

    Args:
        wav_16k: (L,) or (B, L) float samples at 16 kHz. The maximum behind the floor is taken per row, as
            upstream's ``forward`` handles each wav on its own (calling ``log_mel_spectrogram`` on a batch
            would share one maximum). Upstream's reflect padding needs L >= 201, so shorter input raises.
        max_len: upstream's ``max_len`` in speech tokens: keep the first 4·max_len frames. The floor's maximum
            still comes from the whole clip, as upstream truncates after computing the mel.
    Returns:
        float32 (T, 128) or (B, T, 128), T = L // 160 (capped at 4·max_len).
    """
    x = as_waveform(wav_16k, name="wav_16k")
    _require_length(x, S3TOK_N_FFT // 2 + 1, "s3tokenizer_log_mel (reflect padding of 200)")
    # Dropping the last frame makes T = L // 160 rather than 1 + L // 160 (architecture §6).
    spec = stft(x, S3TOK_N_FFT, S3TOK_HOP, dtype=np.complex128)[..., :-1, :]
    power = spec.real**2 + spec.imag**2
    mel = power @ slaney_mel_filters(S3TOK_SR, S3TOK_N_FFT, S3TOK_N_MELS).T.astype(np.float64)
    log_mel = np.log10(np.maximum(mel, 1e-10))
    log_mel = np.maximum(log_mel, log_mel.max(axis=(-2, -1), keepdims=True) - 8.0)
    log_mel = (log_mel + 4.0) / 4.0
    if max_len is not None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1 token, got {max_len}")
        log_mel = log_mel[..., : 4 * max_len, :]
    return log_mel.astype(np.float32)


def voice_encoder_mel(wav_16k: np.ndarray) -> np.ndarray:
    """The voice encoder's input (upstream ``melspec.melspectrogram`` with ``VoiceEncConfig``): a 40-bin
    *linear power* mel, no log, no pre-emphasis, no normalisation.

    STFT (n_fft = win = 400, hop 160, periodic Hann, centered reflect as ``librosa.stft``), |X|², Slaney mel
    (0..8 kHz).

    Args:
        wav_16k: (L,) or (B, L) float samples at 16 kHz (upstream trims silence first: ``trim.trim_silence``);
            rows of a batch are independent. Any L >= 1 works: as librosa, padding longer than the signal
            reflects again.
    Returns:
        float32 (T, 40) or (B, T, 40), T = 1 + L // 160.
    """
    x = as_waveform(wav_16k, name="wav_16k")
    _require_length(x, 1, "voice_encoder_mel")
    spec = stft(x, VE_N_FFT, VE_HOP, dtype=np.complex128)
    power = spec.real**2 + spec.imag**2
    mel = power @ slaney_mel_filters(VE_SR, VE_N_FFT, VE_N_MELS, 0.0, VE_FMAX).T.astype(np.float64)
    return mel.astype(np.float32)
