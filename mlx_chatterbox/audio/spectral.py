"""Short-time Fourier transform with torch/librosa conventions (periodic Hann, centered reflect padding)."""

from __future__ import annotations

import functools

import numpy as np


def as_waveform(x: object, ndims: tuple[int, ...] = (1, 2), name: str = "wav") -> np.ndarray:
    """Validate a waveform and return it as float64 for computation.

    Floating input of any precision is rounded to float32 first, as upstream's ``.float()`` does, so a float64
    clip gives the same features as its float32 copy. Integer PCM is refused rather than guessed: upstream
    expects float samples in [-1, 1] (architecture §4.7), so divide int16 by 32768 before calling.

    Args:
        x: a numpy array (or anything ``np.asarray`` takes, an ``mx.array`` included), samples last.
        ndims: the accepted numbers of dimensions.
        name: how error messages call the argument.
    Returns:
        float64 array of the same shape.
    """
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(
            f"{name} must hold float samples in [-1, 1], got dtype {a.dtype}; "
            "convert integer PCM first (int16: x / 32768)"
        )
    if a.ndim not in ndims:
        want = " or ".join(f"{n}-D" for n in ndims)
        raise ValueError(f"{name} must be {want} (samples last), got shape {a.shape}")
    return a.astype(np.float32).astype(np.float64)


@functools.lru_cache(maxsize=16)
def hann_window(n: int, periodic: bool = True) -> np.ndarray:
    """Hann window of ``n`` points, float64, read-only. ``periodic=True`` is ``torch.hann_window``'s default and
    librosa's ``'hann'`` (architecture §9.9); ``periodic=False`` is the symmetric one Kaldi's Povey window uses.
    """
    if n < 1:
        raise ValueError(f"window length must be >= 1, got {n}")
    if n == 1:
        w = np.ones(1)
    else:
        denom = n if periodic else n - 1
        w = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / denom)
    w.flags.writeable = False
    return w


def frame(x: np.ndarray, size: int, hop: int) -> np.ndarray:
    """Frames of ``size`` samples every ``hop`` samples, without padding: (..., L) -> (..., 1 + (L - size)//hop,
    size), a read-only strided view."""
    if x.shape[-1] < size:
        raise ValueError(f"signal of {x.shape[-1]} samples is shorter than one {size}-sample frame")
    return np.lib.stride_tricks.sliding_window_view(x, size, axis=-1)[..., ::hop, :]


def reflect_pad(x: np.ndarray, left: int, right: int) -> np.ndarray:
    """Reflect padding of the last axis that excludes the edge sample ([2, 1, 0, 1, 2]), as torch's and numpy's
    ``reflect``. Torch needs pads shorter than the signal; numpy, used here, reflects again beyond that (as
    librosa does)."""
    pad = [(0, 0)] * (x.ndim - 1) + [(left, right)]
    return np.pad(x, pad, mode="reflect")


def stft(
    x: np.ndarray,
    n_fft: int,
    hop: int,
    win_length: int | None = None,
    center: bool = True,
    dtype: type = np.complex64,
) -> np.ndarray:
    """One-sided STFT as ``torch.stft(..., window=torch.hann_window(win_length), center, pad_mode='reflect',
    return_complex=True)`` and ``librosa.stft``, but frames before bins.

    Args:
        x: (..., L) float samples (integer PCM is refused, see ``as_waveform``).
        n_fft: FFT size; a shorter window is zero-padded on both sides to it, as torch and librosa do.
        hop: hop in samples.
        win_length: periodic Hann window length, ``n_fft`` if None.
        center: reflect-pad ``n_fft // 2`` samples on each side first, so frame t is centered on sample t·hop.
        dtype: the output dtype; computed in float64 either way (the mels keep complex128 until their output).
    Returns:
        (..., frames, n_fft // 2 + 1) of ``dtype``, frames = 1 + L // hop when centered, else
        1 + (L - n_fft) // hop.
    """
    win_length = n_fft if win_length is None else win_length
    if not 1 <= win_length <= n_fft:
        raise ValueError(f"win_length must lie in [1, n_fft={n_fft}], got {win_length}")
    if hop < 1:
        raise ValueError(f"hop must be >= 1, got {hop}")
    x = as_waveform(x, ndims=tuple(range(1, 8)), name="x")
    if x.shape[-1] == 0:
        raise ValueError("cannot take the STFT of an empty signal")
    if center:
        x = reflect_pad(x, n_fft // 2, n_fft // 2)
    left = (n_fft - win_length) // 2
    window = np.zeros(n_fft)
    window[left : left + win_length] = hann_window(win_length)
    frames = frame(x, n_fft, hop)  # (..., T, n_fft)
    return np.fft.rfft(frames * window, axis=-1).astype(dtype, copy=False)


@functools.lru_cache(maxsize=16)
def _synthesis_tables(n_fft: int, hop: int, win_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``istft``'s window zero-padded to ``n_fft``, its square cut into J = ceil(n_fft / hop) blocks
    (J, hop), and the overlap-add envelope of J frames (2J - 1, hop); float64, read-only. The envelope of
    T >= J frames is this one with row J - 1 (all blocks summed) repeated T - J + 1 times; each row is summed
    in the same order whatever T is, so this is exact."""
    left = (n_fft - win_length) // 2
    window = np.zeros(n_fft)
    window[left : left + win_length] = hann_window(win_length)
    n_blocks = -(-n_fft // hop)
    squared = np.concatenate([window**2, np.zeros(n_blocks * hop - n_fft)]).reshape(n_blocks, hop)
    envelope = np.zeros((2 * n_blocks - 1, hop))
    for j in range(n_blocks):
        envelope[j : j + n_blocks] += squared[j]
    for table in (window, squared, envelope):
        table.flags.writeable = False
    return window, squared, envelope


def istft(
    spec: np.ndarray,
    n_fft: int,
    hop: int,
    win_length: int | None = None,
    center: bool = True,
    length: int | None = None,
    dtype: type = np.float32,
    precision: type = np.float64,
) -> np.ndarray:
    """Inverse of ``stft``, as ``torch.istft(spec, n_fft, hop, win_length, window=torch.hann_window(win_length),
    center, normalized=False, onesided=True, length)``, but frames before bins: a one-sided inverse FFT per frame,
    periodic-Hann weighted overlap-add, division by the summed squared window (architecture §9.9).

    Args:
        spec: (..., frames, n_fft // 2 + 1) complex; the imaginary parts of the DC and Nyquist bins are ignored.
        n_fft, hop, win_length: as for ``stft`` (``0 < hop <= win_length <= n_fft``).
        center: drop ``n_fft // 2`` samples from the start (and from the end when ``length`` is None).
        length: samples to return; past the last frame it is zero-padded, as torch does.
        dtype: the output dtype.
        precision: np.float64 or np.float32, the dtype of the inverse FFT and the overlap-add (the envelope
            and the division by it are float64 either way). float32, as torch computes, takes about half the
            time and adds float32 rounding (~1e-7 relative).
    Returns:
        (..., samples) of ``dtype``; samples = hop·(frames - 1) centered (n_fft + hop·(frames - 1) if not) unless
        ``length`` is given.
    Raises:
        ValueError: bad sizes, or a window envelope below 1e-11 inside the output (torch's "window overlap add
        min" error).
    """
    win_length = n_fft if win_length is None else win_length
    if not 0 < hop <= win_length <= n_fft:
        raise ValueError(
            f"need 0 < hop <= win_length <= n_fft, got hop={hop}, win_length={win_length}, n_fft={n_fft}"
        )
    spec = np.asarray(spec)
    if spec.ndim < 2 or spec.shape[-1] != n_fft // 2 + 1 or spec.shape[-2] == 0:
        raise ValueError(f"expected (..., frames >= 1, {n_fft // 2 + 1}) bins, got shape {spec.shape}")
    if length is not None and length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    precision = np.dtype(precision)
    if precision not in (np.float64, np.float32):
        raise ValueError(f"precision must be np.float64 or np.float32, got {precision}")
    n_frames = spec.shape[-2]
    window, squared, edges = _synthesis_tables(n_fft, hop, win_length)
    complex_dtype = np.complex128 if precision == np.float64 else np.complex64
    frames = np.fft.irfft(spec.astype(complex_dtype, copy=False), n=n_fft, axis=-1)  # (..., T, n_fft), fresh
    frames *= window.astype(precision, copy=False)

    # Overlap-add in hop-sized blocks: frame t's block j lands on output block t + j (the last may be short).
    n_blocks = -(-n_fft // hop)
    y = np.zeros(spec.shape[:-2] + (n_frames + n_blocks - 1, hop), precision)
    for j in range(n_blocks):
        block = frames[..., j * hop : (j + 1) * hop]
        y[..., j : j + n_frames, : block.shape[-1]] += block
    if n_frames >= n_blocks:
        middle = np.broadcast_to(edges[n_blocks - 1], (n_frames - n_blocks + 1, hop))
        envelope = np.concatenate([edges[: n_blocks - 1], middle, edges[n_blocks:]])
    else:  # fewer frames than blocks: no row sums them all
        envelope = np.zeros((n_frames + n_blocks - 1, hop))
        for j in range(n_blocks):
            envelope[j : j + n_frames] += squared[j]
    expected = n_fft + hop * (n_frames - 1)
    y = y.reshape(spec.shape[:-2] + (-1,))[..., :expected]
    envelope = envelope.reshape(-1)[:expected]

    start = n_fft // 2 if center else 0
    if length is not None:
        end = start + length
    else:
        end = expected - n_fft // 2 if center else expected
    kept = envelope[start : min(end, expected)]
    if kept.size and kept.min() < 1e-11:
        raise ValueError(
            "the window overlap-add falls below 1e-11 inside the output; use a larger window or smaller hop"
        )
    y = y[..., start : min(end, expected)] / kept
    if end > expected:
        y = np.concatenate([y, np.zeros(y.shape[:-1] + (end - max(expected, start),))], axis=-1)
    return y.astype(dtype, copy=False)
