"""Leading/trailing silence trim of the voice encoder's input, as ``librosa.effects.trim``."""

from __future__ import annotations

import numpy as np

from .spectral import as_waveform, frame

AMIN_POWER = 1e-10  # librosa amplitude_to_db's amin = 1e-5, squared


def trim_silence(
    wav: np.ndarray, top_db: float = 20.0, frame_length: int = 2048, hop_length: int = 512
) -> tuple[int, int]:
    """Sample interval [start, end) of the non-silent part, equal to ``librosa.effects.trim(wav, top_db=...)[1]``
    (upstream's voice encoder uses top_db=20; architecture §5).

    Frame RMS over ``frame_length`` samples every ``hop_length``, centered with zero padding; a frame is
    non-silent when its level relative to the loudest frame is strictly above -top_db dB, with levels floored
    at -100 dB (librosa's amin) before the comparison. Hence a clip whose loudest frame is below -100 dB (all
    zeros, say) is kept whole, as librosa does.

    Args:
        wav: (L,) float samples; multichannel input is refused.
    Returns:
        (start, end) sample indices: start = first non-silent frame · hop, end = min(L, (last + 1) · hop);
        (0, 0) when no frame is non-silent (only possible with top_db <= 0).
    """
    if frame_length < 1 or hop_length < 1:
        raise ValueError(f"frame_length and hop_length must be >= 1, got {frame_length}, {hop_length}")
    x = as_waveform(wav, ndims=(1,), name="wav")
    half = frame_length // 2
    padded = np.pad(x, (half, half))
    if padded.shape[-1] < frame_length:
        raise ValueError(f"trim_silence needs at least {frame_length - 2 * half} samples, got {x.shape[-1]}")
    power = (frame(padded, frame_length, hop_length) ** 2).mean(axis=-1)  # (n_frames,) mean square
    level_db = 10.0 * np.log10(np.maximum(power, AMIN_POWER)) - 10.0 * np.log10(max(power.max(), AMIN_POWER))
    loud = np.flatnonzero(level_db > -top_db)
    if loud.size == 0:
        return 0, 0
    return int(loud[0]) * hop_length, min(x.shape[-1], (int(loud[-1]) + 1) * hop_length)
