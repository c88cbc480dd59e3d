"""The WSOLA time-stretch behind the server's ``speed`` (audio/stretch.py)."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_chatterbox.audio.stretch import time_stretch

SR = 24000


def peak_hz(x: np.ndarray) -> float:
    """The strongest frequency of ``x``, to 1/8 of an FFT bin (zero-padded 8x)."""
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x)), 8 * len(x)))
    return float(np.argmax(spec)) * SR / (8 * len(x))


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.3, 2.0, 4.0])
def test_length_and_pitch(speed):
    x = (0.5 * np.sin(2 * np.pi * 440 * np.arange(int(2.3 * SR)) / SR)).astype(np.float32)
    y = time_stretch(x, speed, SR)
    assert y.dtype == np.float32 and len(y) == round(len(x) / speed)
    mid = y[len(y) // 4 : 3 * len(y) // 4]
    # The tone keeps its frequency (within 0.5 Hz, under a tenth of a bin) and its level (RMS of 0.5 / sqrt 2).
    assert abs(peak_hz(mid) - 440) < 0.5
    assert abs(np.sqrt(np.mean(mid**2)) - 0.5 / np.sqrt(2)) < 0.01


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_content_moves_with_the_time_scale(speed):
    """300 Hz then 600 Hz: the switch lands at switch / speed (within one 40 ms frame), both pitches kept."""
    n, switch = 2 * SR, SR
    t = np.arange(n) / SR
    x = np.where(np.arange(n) < switch, np.sin(2 * np.pi * 300 * t), np.sin(2 * np.pi * 600 * t))
    y = time_stretch(x.astype(np.float32), speed, SR)
    frame = 960
    at = switch / speed
    assert abs(peak_hz(y[: int(at) - frame]) - 300) < 2
    assert abs(peak_hz(y[int(at) + frame :]) - 600) < 2
    # Where the 600 Hz energy starts (band energy per 10 ms): the switch, within a frame.
    spec = np.abs(np.fft.rfft(y[: len(y) // 240 * 240].reshape(-1, 240), axis=1))
    high = spec[:, 6] > spec[:, 3]  # 240-sample blocks: bin k is 100 k Hz
    assert abs(np.argmax(high) * 240 - at) <= frame


def test_speed_one_and_bad_arguments():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    np.testing.assert_array_equal(time_stretch(x, 1.0, SR), x)
    assert time_stretch(x[:10], 2.0, SR).shape == (5,)
    with pytest.raises(ValueError, match=r"speed=5 is out of range: it must be in \[0.25, 4.0\]"):
        time_stretch(x, 5, SR)
    with pytest.raises(ValueError, match="mono"):
        time_stretch(np.zeros((2, 10), np.float32), 2.0, SR)
