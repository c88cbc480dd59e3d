"""BS.1770 loudness and the Turbo normalisation, without pyloudnorm: the filter, the standard's calibration
point, gating, scaling, and the errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mlx_chatterbox.audio.loudness import (
    _K_WEIGHTING,
    _biquad,
    _design,
    integrated_loudness,
    loudness_gain,
    normalize_loudness,
)

SR = 24000


def direct_biquad(b: np.ndarray, a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The difference equation, one sample at a time."""
    y = np.zeros_like(x)
    for n in range(x.shape[0]):
        y[n] = b[0] * x[n] - a[1] * (y[n - 1] if n > 0 else 0.0) - a[2] * (y[n - 2] if n > 1 else 0.0)
        y[n] += (b[1] * x[n - 1] if n > 0 else 0.0) + (b[2] * x[n - 2] if n > 1 else 0.0)
    return y


@pytest.mark.parametrize("length", [1, 511, 512, 513, 3000])
def test_block_parallel_biquad_equals_the_difference_equation(length: int) -> None:
    x = np.random.default_rng(length).standard_normal(length)
    for kind, gain, q, corner in _K_WEIGHTING:
        b, a = _design(kind, gain, q, corner, float(SR))
        np.testing.assert_allclose(_biquad(b, a, x), direct_biquad(b, a, x), rtol=0, atol=1e-12)


def test_k_weighting_response() -> None:
    """The shelf adds ~4 dB at high frequencies, the high-pass removes DC; ~0 dB around 1 kHz."""

    def response_db(f: float) -> float:
        z = np.exp(-2j * np.pi * f / SR * np.arange(3))
        h = 1.0
        for kind, gain, q, corner in _K_WEIGHTING:
            b, a = _design(kind, gain, q, corner, float(SR))
            h *= (b @ z) / (a @ z)
        return 20 * math.log10(abs(h))

    assert abs(response_db(1000.0)) < 0.7 and abs(response_db(10000.0) - 4.0) < 0.1
    assert response_db(2.0) < -40


def tone(freq: float, seconds: float, amplitude: float = 1.0, sr: int = SR) -> np.ndarray:
    return amplitude * np.sin(2 * np.pi * freq * np.arange(int(seconds * sr)) / sr)


def test_full_scale_997_hz_tone_reads_about_minus_3_lufs() -> None:
    # BS.1770's calibration: -3.01 LKFS with its 48 kHz coefficients; pyloudnorm's cookbook design gives
    # -3.06 at 24 kHz.
    for sr in (24000, 48000):
        assert integrated_loudness(tone(997.0, 5.0, sr=sr), sr) == pytest.approx(-3.01, abs=0.1)


def test_gain_shifts_loudness_by_its_decibels() -> None:
    x = 0.1 * np.random.default_rng(0).standard_normal(SR * 4)
    base = integrated_loudness(x, SR)
    assert integrated_loudness(2 * x, SR) - base == pytest.approx(20 * math.log10(2), abs=1e-9)


def test_gating_ignores_blocks_below_the_gates() -> None:
    speech = 0.1 * np.random.default_rng(1).standard_normal(SR * 3)
    after_silence = integrated_loudness(np.concatenate([speech, np.zeros(SR * 3)]), SR)
    # Blocks at about -120 LUFS fall under the absolute gate: as if they were silent.
    whisper = integrated_loudness(np.concatenate([speech, 1e-5 * speech]), SR)
    assert whisper == pytest.approx(after_silence, abs=1e-6)
    # Blocks 20 dB down pass the absolute gate but not the relative one (10 LU under the gated mean); only
    # the few blocks that straddle the step see them.
    quieter = integrated_loudness(np.concatenate([speech, 0.1 * speech]), SR)
    assert quieter == pytest.approx(after_silence, abs=0.05)
    assert integrated_loudness(np.concatenate([speech, 0.1 * speech]), SR) > integrated_loudness(
        np.concatenate([speech, 0.5 * speech]), SR
    )


def test_silence_is_minus_infinity_and_left_unscaled() -> None:
    for x in (np.zeros(SR, np.float32), np.full(SR, 1e-6, np.float32)):
        assert integrated_loudness(x, SR) == -math.inf
        assert loudness_gain(x, SR, -27.0) is None
        assert normalize_loudness(x, SR, -27.0) is x


def test_normalize_reaches_the_target_and_keeps_the_dtype() -> None:
    x = (0.3 * np.random.default_rng(2).standard_normal(SR * 6)).astype(np.float32)
    y = normalize_loudness(x, SR, -27.0)
    assert y.dtype == np.float32
    assert integrated_loudness(y, SR) == pytest.approx(-27.0, abs=1e-4)
    gain = loudness_gain(x, SR, -27.0)
    assert gain == pytest.approx(10 ** ((-27.0 - integrated_loudness(x, SR)) / 20), rel=1e-12)
    np.testing.assert_array_equal(y, x * np.float32(gain))


def test_one_block_is_the_shortest_clip() -> None:
    assert math.isfinite(integrated_loudness(tone(440.0, 0.4), SR))  # exactly 9600 samples
    with pytest.raises(
        ValueError, match=r"9599 samples \(0.400 s\) are shorter than one 0.4 s loudness block"
    ):
        integrated_loudness(np.ones(9599), SR)
    with pytest.raises(ValueError, match="at least 9600 samples"):
        normalize_loudness(np.ones(100, np.float32), SR, -27.0)


@pytest.mark.parametrize(
    ("samples", "rate", "message"),
    [
        (np.ones((SR, 2)), SR, "mono"),
        (np.ones(SR, np.int16), SR, "float32 or float64"),
        (np.ones(SR), 0, "positive integer rate"),
        (np.ones(SR), 24000.5, "positive integer rate"),
        (np.concatenate([np.ones(SR), [np.nan]]), SR, "NaN or infinite"),
    ],
)
def test_bad_input(samples: np.ndarray, rate: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        integrated_loudness(samples, rate)  # type: ignore[arg-type]


def test_bad_target() -> None:
    with pytest.raises(ValueError, match="target_lufs must be a finite loudness"):
        loudness_gain(np.ones(SR), SR, math.nan)
