"""Integrated loudness (ITU-R BS.1770-4, mono) and the loudness normalisation Turbo applies to a reference.

Upstream (``ChatterboxTurboTTS.norm_loudness``) measures with pyloudnorm's ``Meter(rate)`` at its defaults and
scales the clip to -27 LUFS. This module reproduces that meter, numerically included:

* K-weighting is pyloudnorm's: two RBJ-cookbook biquads designed at the clip's own rate (a +4 dB high shelf at
  1500 Hz, Q 1/sqrt(2), then a 38 Hz high-pass, Q 0.5), not BS.1770's tabulated 48 kHz coefficients.
* pyloudnorm filters a copy of the input array, so each stage's float64 output is rounded back to the input's
  dtype (float32 for ``librosa.load``), and block energies are summed in that dtype. We round at the same
  points; measuring a float32 clip in float64 throughout would differ by up to ~2e-7 dB.
* Block bounds come from the same float expressions, truncation included, so a block covers the same samples.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

__all__ = ["integrated_loudness", "loudness_gain", "normalize_loudness"]

BLOCK_SECONDS = 0.4  # gating block length T_g
BLOCK_HOP = 1.0 - 0.75  # 75% overlap: a block starts every quarter block
ABSOLUTE_GATE_LUFS = -70.0
RELATIVE_GATE_LU = -10.0
LOUDNESS_OFFSET = -0.691  # BS.1770 eq. 2: the constant that makes a 1 kHz tone at 0 dBFS read -3.01 LUFS

# K-weighting stages as (type, gain dB, Q, corner Hz), in the order they are applied.
_K_WEIGHTING = (("high_shelf", 4.0, 1.0 / math.sqrt(2.0), 1500.0), ("high_pass", 0.0, 0.5, 38.0))
# Samples per chunk of the block-parallel IIR below; any size gives the same filter, this one is fast.
_CHUNK = 256


def _design(
    kind: str, gain_db: float, q: float, corner_hz: float, rate: float
) -> tuple[np.ndarray, np.ndarray]:
    """Biquad (b, a) from the Audio EQ Cookbook (R. Bristow-Johnson), normalised so that a[0] = 1."""
    w0 = 2.0 * math.pi * corner_hz / rate
    cos_w0, alpha = math.cos(w0), math.sin(w0) / (2.0 * q)
    if kind == "high_shelf":
        amp = 10.0 ** (gain_db / 40.0)
        root = 2.0 * math.sqrt(amp) * alpha
        b = [
            amp * ((amp + 1) + (amp - 1) * cos_w0 + root),
            -2 * amp * ((amp - 1) + (amp + 1) * cos_w0),
            amp * ((amp + 1) + (amp - 1) * cos_w0 - root),
        ]
        a = [
            (amp + 1) - (amp - 1) * cos_w0 + root,
            2 * ((amp - 1) - (amp + 1) * cos_w0),
            (amp + 1) - (amp - 1) * cos_w0 - root,
        ]
    elif kind == "high_pass":
        b = [(1 + cos_w0) / 2, -(1 + cos_w0), (1 + cos_w0) / 2]
        a = [1 + alpha, -2 * cos_w0, 1 - alpha]
    else:
        raise ValueError(f"unknown biquad type {kind!r}")
    b, a = np.array(b), np.array(a)
    return b / a[0], a / a[0]


@lru_cache(maxsize=32)
def _chunk_operators(b: tuple[float, ...], a: tuple[float, ...], n: int) -> tuple[np.ndarray, ...]:
    """The biquad over one chunk of ``n`` samples as linear maps, in transposed direct form II with a 2-value
    state s; for row vectors x (n,) and s0 (2,):

        y = x @ fir + s0 @ free        (n,)   the chunk's output from its input and start state
        s1 = x @ feed + carry @ s0     (2,)   the state handed to the next chunk

    Found by running the recursion on unit inputs, so they equal what a sample loop computes.
    """
    b0, b1, b2 = b
    _, a1, a2 = a

    def run(x: np.ndarray, s: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
        s1, s2 = s
        y, states = np.empty(n), np.empty((n, 2))
        for i in range(n):
            y[i] = b0 * x[i] + s1
            s1, s2 = b1 * x[i] - a1 * y[i] + s2, b2 * x[i] - a2 * y[i]
            states[i] = s1, s2
        return y, states

    impulse = np.zeros(n)
    impulse[0] = 1.0
    h, h_states = run(impulse, (0.0, 0.0))
    # Output i depends on input j <= i through h[i - j]: an upper-triangular Toeplitz matrix for x @ fir.
    lag = np.arange(n)[None, :] - np.arange(n)[:, None]
    fir = np.where(lag >= 0, h[np.clip(lag, 0, None)], 0.0)  # (n, n)
    # Input j leaves the state the impulse response's state reached n - 1 - j samples after it.
    feed = np.ascontiguousarray(h_states[::-1])  # (n, 2)
    zeros = np.zeros(n)
    free_1, states_1 = run(zeros, (1.0, 0.0))
    free_2, states_2 = run(zeros, (0.0, 1.0))
    free = np.stack([free_1, free_2])  # (2, n)
    carry = np.stack([states_1[-1], states_2[-1]], axis=1)  # (2, 2)
    for m in (fir, feed, free, carry):
        m.flags.writeable = False
    return fir, feed, free, carry


def _biquad(b: np.ndarray, a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``scipy.signal.lfilter(b, a, x)`` for a biquad from rest, in float64, without a per-sample Python loop:
    chunks are filtered with matrix products, and only the 2-value state is passed from chunk to chunk."""
    fir, feed, free, carry = _chunk_operators(tuple(b), tuple(a), _CHUNK)
    length = x.shape[0]
    chunks = -(-length // _CHUNK)
    padded = np.zeros(chunks * _CHUNK)  # trailing zeros do not change earlier outputs
    padded[:length] = x
    blocks = padded.reshape(chunks, _CHUNK)
    pushed = (blocks @ feed).tolist()  # each chunk's input carried into the state after it
    (c00, c01), (c10, c11) = carry.tolist()
    starts, s0, s1 = [(0.0, 0.0)], 0.0, 0.0
    for p0, p1 in pushed[:-1]:  # Python floats: a 2x2 numpy product per chunk costs more than the chunk
        s0, s1 = c00 * s0 + c01 * s1 + p0, c10 * s0 + c11 * s1 + p1
        starts.append((s0, s1))
    return (blocks @ fir + np.array(starts) @ free).reshape(-1)[:length]


def _check(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    samples = np.asarray(samples)
    if samples.ndim != 1:
        raise ValueError(
            f"loudness is measured on mono (L,) samples, got shape {samples.shape}; average the channels"
        )
    if samples.dtype not in (np.float32, np.float64):
        raise ValueError(
            f"samples must be float32 or float64, got {samples.dtype}; scale integer PCM to [-1, 1]"
        )
    if isinstance(sample_rate, bool) or int(sample_rate) != sample_rate or sample_rate <= 0:
        raise ValueError(f"sample_rate must be a positive integer rate in Hz, got {sample_rate!r}")
    # pyloudnorm refuses fewer samples than one block (and accepts exactly one block).
    if samples.shape[0] < BLOCK_SECONDS * sample_rate:
        raise ValueError(
            f"{samples.shape[0]} samples ({samples.shape[0] / sample_rate:.3f} s) are shorter than one "
            f"{BLOCK_SECONDS} s loudness block at {sample_rate} Hz; integrated loudness needs at least "
            f"{math.ceil(BLOCK_SECONDS * sample_rate)} samples"
        )
    if not np.isfinite(samples).all():
        raise ValueError("samples hold NaN or infinite values; loudness is undefined")
    return samples


def integrated_loudness(samples: np.ndarray, sample_rate: int) -> float:
    """Gated integrated loudness of a mono clip in LUFS, as ``pyloudnorm.Meter(sample_rate)
    .integrated_loudness(samples)`` returns it (BS.1770-4: K-weighting, 0.4 s blocks with 75% overlap, an
    absolute gate at -70 LUFS and a relative gate 10 LU below the absolutely gated loudness).

    Args:
        samples: (L,) float32 or float64 samples, nominally in [-1, 1]; at least 0.4 s of them.
        sample_rate: Hz; the K-weighting filters are designed at this rate.

    Returns:
        Loudness in LUFS; ``-inf`` when no block passes the gates (silence, or everything below -70 LUFS).

    Raises:
        ValueError: not 1-d, not float, shorter than one 0.4 s block, non-finite samples or a bad rate.
    """
    samples = _check(samples, sample_rate)
    weighted = samples
    for kind, gain_db, q, corner in _K_WEIGHTING:
        b, a = _design(kind, gain_db, q, corner, float(sample_rate))
        # Rounded back to the input dtype after each stage, as pyloudnorm writes into a copy of its input.
        weighted = _biquad(b, a, weighted.astype(np.float64)).astype(samples.dtype)

    duration = samples.shape[0] / sample_rate
    count = int(np.round((duration - BLOCK_SECONDS) / (BLOCK_SECONDS * BLOCK_HOP))) + 1
    scale = 1.0 / (BLOCK_SECONDS * sample_rate)  # mean square over a nominal block, also for a cut last block
    energy = np.empty(count)
    for j in range(count):
        start = int(BLOCK_SECONDS * (j * BLOCK_HOP) * sample_rate)
        stop = int(BLOCK_SECONDS * (j * BLOCK_HOP + 1) * sample_rate)
        # Summed (and scaled) in the samples' dtype, like pyloudnorm; the block energies are then float64.
        energy[j] = scale * np.sum(np.square(weighted[start:stop]))

    with np.errstate(divide="ignore"):
        block_lufs = LOUDNESS_OFFSET + 10.0 * np.log10(energy)
        above_absolute = block_lufs >= ABSOLUTE_GATE_LUFS
        if not above_absolute.any():
            return -math.inf
        relative_gate = LOUDNESS_OFFSET + 10.0 * np.log10(np.mean(energy[above_absolute])) + RELATIVE_GATE_LU
        # Strict comparisons in this second pass (the first one is >=), as pyloudnorm.
        gated = (block_lufs > relative_gate) & (block_lufs > ABSOLUTE_GATE_LUFS)
        if not gated.any():
            return -math.inf
        return float(LOUDNESS_OFFSET + 10.0 * np.log10(np.mean(energy[gated])))


def loudness_gain(samples: np.ndarray, sample_rate: int, target_lufs: float) -> float | None:
    """The linear gain that brings the clip to ``target_lufs``, 10^((target - L) / 20), or None where upstream
    leaves the clip as it is: when the gain is not finite and positive (L = -inf for silence)."""
    if not math.isfinite(target_lufs):
        raise ValueError(f"target_lufs must be a finite loudness in LUFS, got {target_lufs!r}")
    loudness = integrated_loudness(samples, sample_rate)
    gain = 10.0 ** ((target_lufs - loudness) / 20.0)  # inf for L = -inf (gated L >= -70 cannot overflow)
    return gain if math.isfinite(gain) and gain > 0.0 else None


def normalize_loudness(samples: np.ndarray, sample_rate: int, target_lufs: float) -> np.ndarray:
    """``samples`` scaled to ``target_lufs`` integrated loudness (upstream ``ChatterboxTurboTTS.norm_loudness``
    uses -27), in the samples' dtype; ``samples`` itself, unscaled, when it has no measurable loudness.

    Unlike upstream, which prints a warning and carries on unscaled when pyloudnorm raises, an unmeasurable
    input (shorter than 0.4 s, not mono float, non-finite) raises ValueError here.
    """
    gain = loudness_gain(samples, sample_rate, target_lufs)
    if gain is None:
        return samples
    return samples * gain  # a Python float keeps float32 samples float32, as upstream's multiplication
