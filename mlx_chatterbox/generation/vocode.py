"""Speech tokens -> 24 kHz waveform: the flow encoder, the flow-matching decoder (CFM) and the HiFT vocoder.

Upstream ``S3Token2Wav.inference`` with ``finalize=True`` (architecture §4.2-§4.6): the voice's prompt tokens go
in front of the new tokens, the prompt mel conditions the CFM, and the output starts after the prompt.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..models.cfm import Estimator, solve
from ..models.flow import Flow
from ..models.hift import HiFT
from .voice import Voice

SAMPLE_RATE = 24000
SAMPLES_PER_TOKEN = 960  # 2 mel frames of 480 samples
FADE_IN = 480  # samples muted, then as many faded in (S3Token2Wav.trim_fade: half a token each)


@dataclass(frozen=True)
class Draws:
    """Every random draw of one vocoding call, for tests that inject upstream's.

    cfm_noise: (1, T_prompt + T, 80) N(0, 1), the CFM's initial point, the prompt frames included.
    phases: (1, 9) SineGen start phases in [-pi, pi), the first harmonic's 0.
    source_noise: (1, 480 T, 9) N(0, 1), SineGen's additive noise.
    """

    cfm_noise: mx.array
    phases: mx.array
    source_noise: mx.array


@dataclass
class S3Gen:
    """The three networks that turn speech tokens into audio."""

    flow: Flow
    estimator: Estimator
    hift: HiFT

    def mel(
        self,
        tokens: mx.array,
        voice: Voice,
        *,
        cfm_steps: int | None = None,
        cfm_noise: mx.array | None = None,
        key: mx.array | None = None,
    ) -> mx.array:
        """(1, N) int32 speech tokens -> (1, 2N or 2N - 1, 80) log-mel at 50 frames/s (one frame fewer when
        the voice's prompt mel has an odd length, as upstream). ``cfm_steps`` defaults to the config's 10."""
        check_tokens(tokens, self.flow.config.vocab_size)
        cfm = self.estimator.config
        check_cfm_steps(cfm_steps)
        cfm_steps = cfm.n_timesteps if cfm_steps is None else cfm_steps
        prompt_tokens, prompt_mel = voice.s3gen_prompt_tokens, voice.s3gen_prompt_mel
        everything = mx.concatenate([prompt_tokens, tokens], axis=1)
        lengths = mx.array([everything.shape[1]], dtype=mx.int32)
        mu, _ = self.flow.encode(everything, lengths)
        prompt_frames = prompt_mel.shape[1]
        # The condition is the prompt mel over the prompt frames and zeros after (flow.py inference).
        cond = mx.concatenate(
            [prompt_mel.astype(mu.dtype), mx.zeros((1, mu.shape[1] - prompt_frames, mu.shape[2]), mu.dtype)],
            axis=1,
        )
        if cfm_noise is None:
            cfm_noise = mx.random.normal(mu.shape, key=key)
        elif key is not None:
            raise ValueError("pass either key or cfm_noise, not both")
        elif cfm_noise.shape != mu.shape:
            raise ValueError(f"cfm_noise has shape {cfm_noise.shape}, expected {mu.shape}")
        spks = self.flow.embed_speaker(voice.xvector)
        # One utterance has no padded frame: no mask (the same numbers; fused attention on GPUs).
        mel = solve(self.estimator, mu, None, spks, cond, cfm_noise, cfm_steps, cfm.cfg_rate)
        return mel[:, prompt_frames:]

    def __call__(
        self,
        tokens: mx.array,
        voice: Voice,
        *,
        cfm_steps: int | None = None,
        key: mx.array | None = None,
        draws: Draws | None = None,
    ) -> mx.array:
        """(1, N) int32 speech tokens -> (1, samples) float32 waveform at 24 kHz, faded in over its first
        40 ms as upstream. Randomness comes from ``key`` (or the global MLX generator), or all of it from
        ``draws``."""
        if draws is not None and key is not None:
            raise ValueError("pass either key or draws, not both")
        cfm_key = source_key = None
        if key is not None:
            cfm_key, source_key = mx.random.split(key)
        mel = self.mel(
            tokens,
            voice,
            cfm_steps=cfm_steps,
            cfm_noise=None if draws is None else draws.cfm_noise,
            key=cfm_key,
        )
        if draws is None:
            wav = self.hift(mel, key=source_key)
        else:
            wav = self.hift(mel, phases=draws.phases, noise=draws.source_noise)
        return fade_in(wav)


def check_cfm_steps(cfm_steps: int | None) -> None:
    """None (the config's count) or an integer >= 1."""
    if cfm_steps is not None and (
        isinstance(cfm_steps, bool) or not isinstance(cfm_steps, int) or cfm_steps < 1
    ):
        raise ValueError(f"cfm_steps={cfm_steps!r} must be an integer >= 1")


def check_tokens(tokens: mx.array, vocab_size: int) -> None:
    if tokens.ndim != 2 or tokens.shape[0] != 1 or tokens.dtype != mx.int32:
        raise ValueError(f"speech tokens must be an int32 (1, N) array, got {tokens.dtype} {tokens.shape}")
    if tokens.shape[1] == 0:
        raise ValueError("there are no speech tokens to vocode")
    low, high = mx.min(tokens).item(), mx.max(tokens).item()
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"speech tokens must lie in [0, {vocab_size}), found {low if low < 0 else high}; "
            "drop T3's start/stop ids first (drop_invalid_tokens)"
        )


def fade_in(wav: mx.array) -> mx.array:
    """Upstream's trim_fade: 480 zeros, then a 480-sample raised cosine, on the first 960 samples."""
    n = min(wav.shape[1], 2 * FADE_IN)
    return mx.concatenate([wav[:, :n] * _fade_window()[:n], wav[:, n:]], axis=1)


@functools.lru_cache(maxsize=1)
def _fade_window() -> mx.array:
    ramp = [(math.cos(math.pi * (1 - i / (FADE_IN - 1))) + 1) / 2 for i in range(FADE_IN)]
    return mx.array([0.0] * FADE_IN + ramp)


def crossfade_join(wavs: list[np.ndarray], overlap: int) -> np.ndarray:
    """Concatenate (L_i,) waveforms, each consecutive pair overlapping by ``overlap`` samples with an
    equal-gain raised-cosine crossfade (fewer where a piece is shorter)."""
    out = wavs[0]
    for wav in wavs[1:]:
        n = min(overlap, len(out), len(wav))
        if n == 0:
            out = np.concatenate([out, wav])
            continue
        fade = (1 - np.cos(np.pi * (np.arange(n) + 0.5) / n)) / 2  # 0 -> 1
        mixed = out[-n:] * (1 - fade) + wav[:n] * fade
        out = np.concatenate([out[:-n], mixed.astype(out.dtype), wav[n:]])
    return out
