"""Reading audio files as upstream does (``librosa.load``): mono float32 at a chosen rate, with clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import soundfile as sf

from .resample import resample_soxr_hq

__all__ = ["AudioError", "load_audio"]


class AudioError(ValueError):
    """An audio file that cannot be used: missing, unreadable, empty, or holding NaN/inf samples."""


def load_audio(path: str | os.PathLike, sr: int) -> np.ndarray:
    """Read an audio file as ``librosa.load(path, sr=sr)`` does (librosa 0.11, what tts.py prepare_conditionals
    calls): libsndfile decodes to float32 (integer PCM scaled by 1/2^(bits-1)), channels are averaged, and the
    result is resampled with soxr_hq (``resample_soxr_hq``) when the file's rate differs from ``sr``.

    Any format this libsndfile reads works (``soundfile.available_formats()``: WAV, FLAC, OGG/Vorbis/Opus, MP3 with
    libsndfile >= 1.1, AIFF, ...). librosa would fall back to audioread (ffmpeg) for the others, e.g. AAC/M4A; we
    do not, and name the file instead.

    Very short audio is returned as it is (even one sample): whether a reference is long enough is for the voice
    builder to decide.

    Args:
        path: the file.
        sr: the wanted rate in Hz.

    Returns:
        (T,) float32 mono samples at ``sr``.

    Raises:
        AudioError: the file is missing, is not audio libsndfile can read, holds no samples, or holds NaN/inf
            samples. The message names the file.
    """
    if int(sr) != sr or sr <= 0:
        raise ValueError(f"sr must be a positive integer rate in Hz, got {sr!r}")
    p = Path(path)
    if not p.exists():
        raise AudioError(f"{p}: no such file")
    if p.is_dir():
        raise AudioError(f"{p}: is a directory, not an audio file")
    try:
        with sf.SoundFile(p) as f:
            sr_native = f.samplerate
            # (T,) or (T, C) -> (C, T), the layout librosa averages over.
            y = f.read(dtype="float32", always_2d=False).T
    except sf.LibsndfileError as exc:
        raise AudioError(
            f"{p}: not an audio file libsndfile can read ({exc.error_string}); convert it to WAV or FLAC"
        ) from None
    except (RuntimeError, OSError) as exc:
        raise AudioError(f"{p}: cannot be read as audio ({exc})") from None
    if y.shape[-1] == 0:
        raise AudioError(f"{p}: contains no samples")
    bad = int(np.size(y) - np.count_nonzero(np.isfinite(y)))
    if bad:
        raise AudioError(f"{p}: {bad} of {np.size(y)} samples are NaN or inf")
    if y.ndim > 1:
        # librosa.to_mono: a float32 mean over the channel axis.
        y = np.mean(y, axis=0)
    return resample_soxr_hq(y, sr_native, int(sr))
