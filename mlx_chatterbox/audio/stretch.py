"""Pitch-preserving time-stretch (WSOLA), for the server's OpenAI ``speed`` (Chatterbox has no speed control).

WSOLA (waveform-similarity overlap-add, Verhelst & Roelands 1993): the output is built from Hann-windowed frames
at a fixed hop; each frame is copied from the input near where the time scale says it should come from, shifted
by up to ``tolerance`` to the place most alike to what naturally follows the previous frame, so periods line up
and the pitch stays. Frames of 40 ms (a few pitch periods of speech) with a 10 ms search work well for speech.
"""

from __future__ import annotations

import numpy as np

__all__ = ["time_stretch"]

SPEED_RANGE = (0.25, 4.0)  # OpenAI's range for ``speed``


def time_stretch(
    samples: np.ndarray, speed: float, sample_rate: int, frame_ms: float = 40.0, tolerance_ms: float = 10.0
) -> np.ndarray:
    """(T,) float32 mono samples played ``speed`` times as fast at the same pitch: round(T / speed) samples.

    speed: in [0.25, 4]; > 1 is faster (shorter), 1 returns the samples unchanged.
    sample_rate: of the samples, in Hz (sets the frame and the search in samples).
    """
    lo, hi = SPEED_RANGE
    if not (isinstance(speed, (int, float)) and lo <= speed <= hi):
        raise ValueError(f"speed={speed!r} is out of range: it must be in [{lo}, {hi}]")
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"samples must be mono (T,), got shape {x.shape}")
    if speed == 1 or x.size == 0:
        return x.copy()
    n = max(4, int(round(frame_ms * sample_rate / 1000)) // 2 * 2)  # frame length, even
    hop_out = n // 2
    hop_in = hop_out * speed
    delta = int(round(tolerance_ms * sample_rate / 1000))
    n_out = int(round(x.size / speed))
    frames = n_out // hop_out + 2
    # Leading half frame of zeros, so that the first frame's fade-in covers silence, not the first samples.
    pad_end = int(frames * hop_in) + n + 2 * delta + hop_out
    xp = np.concatenate([np.zeros(hop_out, np.float32), x, np.zeros(max(pad_end - x.size, 0), np.float32)])
    # A periodic Hann window at half-frame hops sums to 1: plain overlap-add keeps the level.
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(np.float32)
    out = np.zeros(frames * hop_out + n, np.float32)
    norm = np.zeros_like(out)
    prev = 0
    for k in range(frames):
        nominal = int(round(k * hop_in))
        if k == 0:
            start = 0
        else:
            # Most alike (cross-correlation) to the input that follows the previous frame.
            natural = xp[prev + hop_out : prev + hop_out + n]
            first = max(nominal - delta, 0)
            last = min(nominal + delta, xp.size - n)
            scores = np.correlate(xp[first : last + n], natural, mode="valid")
            start = first + int(np.argmax(scores))
        out[k * hop_out : k * hop_out + n] += window * xp[start : start + n]
        norm[k * hop_out : k * hop_out + n] += window
        prev = start
    out = out[hop_out : hop_out + n_out]
    norm = norm[hop_out : hop_out + n_out]
    return out / np.maximum(norm, 1e-3)
