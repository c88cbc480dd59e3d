"""The two resamplers upstream uses (architecture §9.15): librosa's soxr_hq and torchaudio's sinc-Hann."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import soxr

__all__ = ["resample_soxr_hq", "resample_sinc_hann"]

# torchaudio.transforms.Resample defaults, as s3gen.py get_resampler builds it.
LOWPASS_FILTER_WIDTH = 6
ROLLOFF = 0.99


def _check(wav: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    wav = np.asarray(wav)
    if wav.ndim != 1:
        raise ValueError(f"expected a 1-d waveform, got shape {wav.shape}")
    for name, sr in (("sr_in", sr_in), ("sr_out", sr_out)):
        if int(sr) != sr or sr <= 0:
            raise ValueError(f"{name} must be a positive integer rate in Hz, got {sr!r}")
    return wav


def resample_soxr_hq(wav: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Resample as ``librosa.resample(wav, orig_sr=sr_in, target_sr=sr_out)`` does (librosa 0.11, res_type
    'soxr_hq'): one soxr call at HQ quality, then zero-padded or cut to ``ceil(len * sr_out / sr_in)`` samples.

    Args:
        wav: (T,) samples; cast to float32 first, the dtype ``librosa.load`` hands to it upstream.
        sr_in, sr_out: rates in Hz.

    Returns:
        (ceil(T * sr_out / sr_in),) float32; ``wav`` itself (as float32) when the rates are equal, as librosa returns
        its input unchanged.

    Raises:
        ValueError: not 1-d, a bad rate, or non-finite samples (librosa's ``valid_audio`` refuses those too).
    """
    wav = np.ascontiguousarray(_check(wav, sr_in, sr_out), dtype=np.float32)
    if not np.isfinite(wav).all():
        raise ValueError("audio buffer is not finite everywhere (NaN or inf samples)")
    if sr_in == sr_out:
        return wav
    # librosa computes the target length from a float ratio, not exact integer arithmetic; keep its rounding.
    n_out = int(np.ceil(wav.shape[0] * (float(sr_out) / sr_in)))
    # 'soxr_hq' is the quality name librosa forwards; python-soxr maps it to HQ. The output dtype follows the input.
    out = soxr.resample(wav, sr_in, sr_out, quality="soxr_hq")
    # librosa.util.fix_length: soxr's own length can fall short (it does for very short inputs); pad with zeros.
    if out.shape[0] >= n_out:
        return np.ascontiguousarray(out[:n_out], dtype=np.float32)
    return np.concatenate([out, np.zeros(n_out - out.shape[0], dtype=np.float32)])


@lru_cache(maxsize=16)
def _sinc_hann_kernel(orig: int, new: int) -> tuple[np.ndarray, int]:
    """torchaudio.functional._get_sinc_resample_kernel for reduced rates (orig, new) with dtype=None: built in
    float64, cast to float32. Returns the (new, 2·width + orig) kernel, read-only, and width."""
    base_freq = min(orig, new) * ROLLOFF
    width = math.ceil(LOWPASS_FILTER_WIDTH * orig / base_freq)
    idx = np.arange(-width, width + orig, dtype=np.float64)[None, :] / orig
    # torchaudio's output-phase term is an int64 arange divided in the default dtype (float32), then promoted
    # to float64 by the sum: keep that float32 rounding of j / new.
    phase = (np.arange(0, -new, -1, dtype=np.float32)[:, None] / np.float32(new)).astype(np.float64)
    t = (phase + idx) * base_freq
    t = np.clip(t, -LOWPASS_FILTER_WIDTH, LOWPASS_FILTER_WIDTH)
    window = np.cos(t * math.pi / LOWPASS_FILTER_WIDTH / 2) ** 2
    t = t * math.pi
    scale = base_freq / orig
    with np.errstate(invalid="ignore", divide="ignore"):
        kernel = np.where(t == 0, 1.0, np.sin(t) / t)
    kernel = (kernel * (window * scale)).astype(np.float32)
    kernel.flags.writeable = False
    return kernel, width


def resample_sinc_hann(wav: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Resample as ``torchaudio.transforms.Resample(sr_in, sr_out)`` does with its defaults (sinc_interp_hann,
    lowpass_filter_width 6, rolloff 0.99): a polyphase FIR over the zero-padded signal with stride ``sr_in/gcd``.

    The float32 kernel matches torchaudio's; the convolution sums in float64 and rounds once to float32, so the
    output differs from torch's float32 conv1d only by that conv's own rounding (~1e-7 for |x| <= 1).

    Args:
        wav: (T,) samples, cast to float32 (upstream feeds a float32 tensor).
        sr_in, sr_out: integer rates in Hz.

    Returns:
        (ceil(T * sr_out / sr_in),) float32; ``wav`` itself (as float32) when the rates are equal, as torchaudio
        returns its input. An empty input gives an empty output (torchaudio raises on it).
    """
    wav = np.ascontiguousarray(_check(wav, sr_in, sr_out), dtype=np.float32)
    if sr_in == sr_out:
        return wav
    gcd = math.gcd(int(sr_in), int(sr_out))
    orig, new = int(sr_in) // gcd, int(sr_out) // gcd
    kernel, width = _sinc_hann_kernel(orig, new)
    length = wav.shape[0]
    # torchaudio: ceil of a Python float quotient.
    n_out = math.ceil(new * length / orig)
    if length == 0:
        return np.zeros(0, dtype=np.float32)
    padded = np.concatenate(
        [np.zeros(width, np.float64), wav.astype(np.float64), np.zeros(width + orig, np.float64)]
    )
    # Frame j starts at input sample j·orig and yields output samples j·new .. j·new + new - 1.
    frames = np.lib.stride_tricks.sliding_window_view(padded, kernel.shape[1])[::orig]  # (F, K)
    out = frames @ kernel.astype(np.float64).T  # (F, new)
    return out.reshape(-1)[:n_out].astype(np.float32)


@lru_cache(maxsize=16)
def _kaiser_lowpass(up: int, down: int, dtype: str) -> tuple[np.ndarray, int]:
    """scipy.signal.resample_poly's default filter for reduced rates (up, down): firwin(2·half + 1, 1/max(up, down),
    window=('kaiser', 5.0)), half = 10·max(up, down), built in float64, cast to the signal's dtype, times up (in
    that dtype). Returns (filter, half), the filter read-only."""
    rate = max(up, down)
    half = 10 * rate
    m = np.arange(2 * half + 1, dtype=np.float64) - half
    cutoff = 1.0 / rate  # relative to Nyquist
    h = cutoff * np.sinc(cutoff * m)
    beta = 5.0
    window = np.i0(beta * np.sqrt(1.0 - (m / half) ** 2)) / np.i0(beta)  # symmetric Kaiser
    h = h * window
    h = h / h.sum()  # unit gain at DC, firwin's scale=True
    h = h.astype(dtype) * np.dtype(dtype).type(up)
    h.flags.writeable = False
    return h, half


def resample_polyphase(x: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Resample as ``librosa.resample(x, orig_sr=sr_in, target_sr=sr_out, res_type='polyphase')`` (librosa 0.11),
    which is ``scipy.signal.resample_poly(x, up, down)`` with the rates reduced by their gcd: zero-stuff by up,
    Kaiser-windowed sinc low-pass (beta 5, 20·max(up, down) + 1 taps), keep every down-th sample, centred.

    scipy casts the filter to the signal's dtype and accumulates in it; this sums in float64 over the same
    float32 taps and rounds once, so it differs from scipy by float32 rounding (~1e-7 relative).

    Args:
        x: (L,) float samples; float32 (and float64) keep their dtype, as librosa returns ``y.dtype``.
        sr_in, sr_out: positive integer rates in Hz.
    Returns:
        (ceil(L · up / down),) samples; a copy of ``x`` when the rates are equal.
    """
    x = np.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"expected a 1-d waveform, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"expected float samples, got dtype {x.dtype}")
    for name, sr in (("sr_in", sr_in), ("sr_out", sr_out)):
        if int(sr) != sr or sr <= 0:
            raise ValueError(f"{name} must be a positive integer rate in Hz, got {sr!r}")
    g = math.gcd(int(sr_in), int(sr_out))
    up, down = int(sr_out) // g, int(sr_in) // g
    if up == down:
        return x.copy()
    n_in = x.shape[0]
    n_out = -(-n_in * up // down)
    h, half = _kaiser_lowpass(up, down, x.dtype.str)
    h = h.astype(np.float64)
    # Output k sits at position k·down on the up-sampled grid; the filter is centred there (scipy's pre-pad and
    # pre-remove cancel to exactly that): y[k] = sum_m x[m] · h[half + k·down - m·up].
    k = np.arange(n_out, dtype=np.int64)
    pos = half + k * down
    phase, base = pos % up, pos // up  # taps h[phase + i·up] meet x[base - i]
    n_taps = -(-h.shape[0] // up)
    taps = np.zeros(n_taps * up)
    taps[: h.shape[0]] = h
    taps = taps.reshape(n_taps, up)  # taps[i, p] = h[p + i·up]
    # Zeros outside the signal (scipy's padtype='constant').
    xp = np.concatenate([np.zeros(n_taps), x.astype(np.float64), np.zeros(n_taps)])
    y = np.zeros(n_out)
    for i in range(n_taps):
        y += taps[i, phase] * xp[base - i + n_taps]
    return y.astype(x.dtype)
