"""Speech tokens -> 24 kHz waveform: the flow encoder, the flow-matching decoder (CFM) and the HiFT vocoder.

Upstream ``S3Token2Wav.inference`` with ``finalize=True`` (architecture §4.2-§4.6): the voice's prompt tokens go
in front of the new tokens, the prompt mel conditions the CFM, and the output starts after the prompt. Turbo
and Nano's ``S3Gen(meanflow=True)`` differ only in the CFM's solver (variants.md §3), which the estimator's
config picks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Literal, TypeVar

import mlx.core as mx
import numpy as np

from ..models import cfm, memory
from ..models.cfm import Estimator, Steps, drain, meanflow_steps, solve_steps
from ..models.flow import Flow
from ..models.hift import HiFT
from ..sampling import seed_keys
from .voice import Voice

SAMPLE_RATE = 24000
SAMPLES_PER_TOKEN = 960  # 2 mel frames of 480 samples
FADE_IN = 480  # samples muted, then as many faded in (S3Token2Wav.trim_fade: half a token each)
R = TypeVar("R")


@dataclass(frozen=True)
class Draws:
    """Every random draw of one vocoding call, for tests that inject upstream's.

    cfm_noise: (1, T_prompt + T, 80) N(0, 1), the CFM's initial point, the prompt frames included.
        (Upstream's meanflow draws it twice, variants.md §3.2: pass its ``randn_like`` with the new tokens'
        frames replaced by flow_inference's draw.)
    phases: (1, 9) SineGen start phases in [-pi, pi), the first harmonic's 0.
    source_noise: (1, 480 T, 9) N(0, 1), SineGen's additive noise.
    """

    cfm_noise: mx.array
    phases: mx.array
    source_noise: mx.array


# Bytes an S3Gen call may hold above the memory in use when it starts ("auto"; see bounded_memory): a lone
# request's, and each request's of a batched call, for up to AUTO_ROWS requests. Measured at 10 s prompt +
# 10 s output, full size, fp32 (peak above the weights; time). CPU, 2 cores: 695 -> 446 MiB at 256 MiB, no
# slower. H200, CUDA graphs of 100 kernels: 5482 MiB, 308 ms unbounded; 2089 MiB, 320 ms at 2 GiB; 1084 MiB,
# 312-338 ms at 1 GiB; 756 MiB, 508 ms at 512 MiB (too little work stays queued to keep the GPU busy). H100,
# graphs of 20 (_backend.py, run BA): 1,067 MiB, 301 ms at 1 GiB; 341 MiB, 341-349 ms at 256 MiB, which a
# lone request takes (issue 25: text -> wav peaks no higher than upstream's). Batched (H200, 2026-12-02,
# graphs of 100, benchmarks/probe_s3gen.py): 8 requests took 2135 ms under 1 GiB, 1709 ms under 8 GiB (8.5
# GB peak) and 1679 ms unbounded (20.8 GB); 32 requests 7496, 6513 (10.4 GB) and 6483 ms (37 GB): a fixed
# budget starves batches, 1 GiB a request up to 8 does not.
MEMORY_BUDGETS = {"cpu": (256 * 2**20, 256 * 2**20), "gpu": (256 * 2**20, 2**30)}
AUTO_ROWS = 8


def bounded_memory(method: Callable[..., R]) -> Callable[..., R]:
    """Run an ``S3Gen`` method under ``memory.bounded`` with the call's memory budget, and queue its result
    (``mx.async_eval``) inside the bound. Unbounded, a call held 5.4 GiB above the weights on an H200, and
    HiFT alone 691 MiB on the CPU."""

    @functools.wraps(method)
    def run(self: S3Gen, *args, **kwargs) -> R:
        tokens = args[0] if args else kwargs.get("tokens")
        with memory.bounded(
            resolve_memory_budget(self.memory_budget, len(tokens) if isinstance(tokens, list) else 1)
        ):
            out = method(self, *args, **kwargs)
            mx.async_eval(out)  # queued under the limit: the caller's later eval finds the work in flight
        return out

    return run


def bounded_steps(s3gen: S3Gen, requests: int, steps: Steps[R]) -> Steps[R]:
    """``steps`` (a call of ``requests`` requests queued in parts) with each part queued under the call's bound,
    as ``bounded_memory``'s: the memory in use when the call starts plus its budget. Between parts the caller's
    limit is back, for whatever runs in between."""
    budget = resolve_memory_budget(s3gen.memory_budget, requests)
    if budget is None:
        return (yield from steps)
    limit = mx.get_active_memory() + budget
    while True:
        memory.raise_limit(limit)
        try:
            next(steps)
        except StopIteration as stop:
            mx.async_eval(stop.value)  # queued under the limit, as bounded_memory's result
            return stop.value
        finally:
            memory.lower_limit()
        yield


def use_tiled_products(on: bool) -> None:
    """Whether this process's estimator runs its products as our tensor-core kernel where that applies
    (``cfm.TILED_PRODUCTS``: CUDA, a half-precision estimator, one request's rows): on by default; the server's
    vocoding process turns it off under MLX_USE_CUDA_GRAPHS=0, as it pays only with graphs (server/vocoding.py).
    """
    cfm.TILED_PRODUCTS = on


def resolve_memory_budget(budget: int | str | None, requests: int = 1) -> int | None:
    """``S3Gen.memory_budget`` -> bytes (or None: unbounded) for a call that vocodes ``requests`` requests;
    "auto" gives a lone request the default device's lone budget (``MEMORY_BUDGETS``), and each request of a
    batched call (up to ``AUTO_ROWS``) its budget a request; a number of bytes is the whole call's."""
    if budget == "auto":
        lone, each = MEMORY_BUDGETS["cpu" if mx.default_device() == mx.cpu else "gpu"]
        return lone if requests == 1 else each * min(requests, AUTO_ROWS)
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ValueError(f"memory_budget={budget!r} must be a number of bytes >= 0, 'auto' or None")
    return budget


@dataclass
class S3Gen:
    """The three networks that turn speech tokens into audio. ``memory_budget``: bytes a call may hold above
    the memory in use when it starts; "auto" (``MEMORY_BUDGETS`` for the default device: a lone request's, or
    each request's of a batched call) or None (no bound beyond MLX's own limit: fastest on GPUs, 5x the
    memory). See ``bounded_memory``."""

    flow: Flow
    estimator: Estimator
    hift: HiFT
    memory_budget: int | Literal["auto"] | None = "auto"

    @bounded_memory
    def mel(
        self,
        tokens: mx.array,
        voice: Voice,
        *,
        cfm_steps: int | None = None,
        cfm_noise: mx.array | None = None,
        key: mx.array | None = None,
        finalize: bool = True,
    ) -> mx.array:
        """(1, N) int32 speech tokens -> (1, 2N or 2N - 1, 80) log-mel at 50 frames/s (one frame fewer when
        the voice's prompt mel has an odd length, as upstream). ``cfm_steps`` defaults to the config's
        (upstream's 10, or 2 for a meanflow decoder).
        ``finalize=False`` (streaming, upstream's flow ``finalize``): the frames of the last
        ``pre_lookahead_len`` tokens are dropped, they wait for tokens that have not come yet."""
        check_tokens(tokens, self.flow.config.vocab_size)
        cfm = self.estimator.config
        check_cfm_steps(cfm_steps)
        cfm_steps = cfm.n_timesteps if cfm_steps is None else cfm_steps
        prompt_tokens, prompt_mel = voice.s3gen_prompt_tokens, voice.s3gen_prompt_mel
        everything = mx.concatenate([prompt_tokens, tokens], axis=1)
        lengths = mx.array([everything.shape[1]], dtype=mx.int32)
        mu, _ = self.flow.encode(everything, lengths)
        prompt_frames = prompt_mel.shape[1]
        if not finalize:
            mu = mu[:, : mu.shape[1] - self.flow.config.pre_lookahead_len * self.flow.config.upsample_stride]
            if mu.shape[1] <= prompt_frames:
                raise ValueError(
                    f"{tokens.shape[1]} speech tokens leave no frame once the last "
                    f"{self.flow.config.pre_lookahead_len} are held back; pass more or finalize"
                )
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
        mel = drain(_solve_steps(self.estimator, mu, None, spks, cond, cfm_noise, cfm_steps))
        return mel[:, prompt_frames:]

    @bounded_memory
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

    def batch_mel(
        self,
        tokens: list[mx.array | np.ndarray],
        voices: list[Voice],
        *,
        cfm_steps: int | None = None,
        keys: list[mx.array | None] | None = None,
        bucket: int = 1,
        cfm_noises: list[mx.array | None] | None = None,
        finalize: list[bool] | None = None,
    ) -> list[mx.array]:
        """Several requests through one flow encoder and one CFM solve: ``mel`` for each (tokens[i],
        voices[i], keys[i] or cfm_noises[i], finalize[i]), as a list of (1, T_i, 80) log-mels equal to the
        one-by-one results up to float error. Tokens: (N_i,) or (1, N_i) integer ids; keys default to MLX's
        global generator; finalize to True (False: the row's last ``pre_lookahead_len`` tokens' frames are
        dropped, and masked in the solve like padding). A meanflow decoder batches too (upstream runs it at
        batch 1 only): padded rows are masked as in English's solve. ``bucket``: the rows (prompt tokens
        included) are right-padded to a multiple of this many tokens, so that calls of similar lengths share
        shapes (GPU kernel plans and graphs are per shape); the padding is masked and changes no row beyond
        float error."""
        return drain(self.batch_mel_steps(tokens, voices, cfm_steps=cfm_steps, keys=keys, bucket=bucket,
                                          cfm_noises=cfm_noises, finalize=finalize))  # fmt: skip

    def batch_mel_steps(
        self,
        tokens: list[mx.array | np.ndarray],
        voices: list[Voice],
        *,
        cfm_steps: int | None = None,
        keys: list[mx.array | None] | None = None,
        bucket: int = 1,
        cfm_noises: list[mx.array | None] | None = None,
        finalize: list[bool] | None = None,
    ) -> Steps[list[mx.array]]:
        """``batch_mel`` queued a part at a time (``Steps``: the flow encoder, then each CFM step), each part
        under the call's memory bound."""
        return bounded_steps(
            self,
            len(tokens),
            _batch_mel_steps(self, tokens, voices, cfm_steps, keys, bucket, cfm_noises, finalize),
        )

    def batch(
        self,
        tokens: list[mx.array | np.ndarray],
        voices: list[Voice],
        *,
        cfm_steps: int | None = None,
        keys: list[mx.array | None] | None = None,
        bucket: int = 1,
    ) -> list[mx.array]:
        """Several requests vocoded together: ``__call__`` for each (tokens[i], voices[i], keys[i]), as a
        list of (1, samples_i) float32 waveforms at 24 kHz, faded in, equal to the one-by-one results up to
        float error. Token counts and voices (prompt lengths) may differ between requests; ``bucket`` as
        for ``batch_mel``. HiFT runs once for all of them too (``vocode_rows``: shorter rows padded and
        masked)."""
        return drain(self.batch_steps(tokens, voices, cfm_steps=cfm_steps, keys=keys, bucket=bucket))

    def batch_steps(
        self,
        tokens: list[mx.array | np.ndarray],
        voices: list[Voice],
        *,
        cfm_steps: int | None = None,
        keys: list[mx.array | None] | None = None,
        bucket: int = 1,
    ) -> Steps[list[mx.array]]:
        """``batch`` queued a part at a time (``Steps``: the flow encoder, each CFM step, HiFT), each part under
        the call's memory bound."""
        return bounded_steps(
            self, len(tokens), _batch_wav_steps(self, tokens, voices, cfm_steps, keys, bucket)
        )


def _solve_steps(
    estimator: Estimator,
    mu: mx.array,
    mask: mx.array | None,
    spks: mx.array,
    cond: mx.array,
    noise: mx.array,
    steps: int,
) -> Steps[mx.array]:
    """The CFM solve of the estimator's kind: meanflow (Turbo/Nano) or Euler with the config's guidance."""
    if estimator.config.meanflow:
        return meanflow_steps(estimator, mu, mask, spks, cond, noise, steps)
    return solve_steps(estimator, mu, mask, spks, cond, noise, steps, estimator.config.cfg_rate)


def vocode_tokens(
    s3gen: S3Gen, tokens: np.ndarray, voice: Voice, cfm_steps: int | None, seed: int | None
) -> np.ndarray:
    """One request's speech ids -> its float32 samples (``TTS.vocode`` without the watermark): the seed's S3Gen
    key, or fresh draws when None."""
    key = None if seed is None else seed_keys(seed)[1]
    out = s3gen(mx.array(np.asarray(tokens).astype(np.int32))[None], voice, cfm_steps=cfm_steps, key=key)
    return np.array(out[0], dtype=np.float32)


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


# --- batched vocoding ---


def _batch_mel_steps(
    s3gen: S3Gen,
    tokens: list[mx.array | np.ndarray],
    voices: list[Voice],
    cfm_steps: int | None,
    keys: list[mx.array | None] | None,
    bucket: int,
    cfm_noises: list[mx.array | None] | None = None,
    finalize: list[bool] | None = None,
) -> Steps[list[mx.array]]:
    n = len(tokens)
    if n == 0:
        raise ValueError("there are no requests to vocode: pass at least one token sequence")
    if len(voices) != n:
        raise ValueError(f"{n} token sequences but {len(voices)} voices: pass one voice per request")
    keys = [None] * n if keys is None else list(keys)
    if len(keys) != n:
        raise ValueError(f"{n} token sequences but {len(keys)} keys: pass one key (or None) per request")
    cfm_noises = [None] * n if cfm_noises is None else list(cfm_noises)
    if len(cfm_noises) != n:
        raise ValueError(
            f"{n} token sequences but {len(cfm_noises)} cfm_noises: pass one (or None) per request"
        )
    finalize = [True] * n if finalize is None else list(finalize)
    if len(finalize) != n or not all(isinstance(f, bool) for f in finalize):
        raise ValueError(f"finalize must be one bool per request ({n}), got {finalize!r}")
    check_cfm_steps(cfm_steps)
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
        raise ValueError(f"bucket={bucket!r} must be a number of tokens >= 1")
    cfm = s3gen.estimator.config
    cfm_steps = cfm.n_timesteps if cfm_steps is None else cfm_steps
    vocab, stride = s3gen.flow.config.vocab_size, s3gen.flow.config.upsample_stride
    rows = [
        mx.concatenate([voice.s3gen_prompt_tokens, _token_row(ids, vocab, i)], axis=1)
        for i, (ids, voice) in enumerate(zip(tokens, voices))
    ]
    lengths = [row.shape[1] for row in rows]
    width = -(-max(lengths) // bucket) * bucket
    padded = mx.concatenate([mx.pad(row, [(0, 0), (0, width - row.shape[1])]) for row in rows], axis=0)
    # Right padding, the lengths and the masks keep each row's valid frames to what it computes alone.
    mu, mask = s3gen.flow.encode(padded, mx.array(lengths, dtype=mx.int32), isolate_rows=True)
    mx.async_eval(mu, mask)
    yield
    frames, mel_dim = mu.shape[1], mu.shape[2]
    held = s3gen.flow.config.pre_lookahead_len * stride  # frames a row without finalize drops
    conds, noises, spans = [], [], []
    for i, (voice, key, noise, length, final) in enumerate(zip(voices, keys, cfm_noises, lengths, finalize)):
        own, prompt = stride * length - (0 if final else held), voice.s3gen_prompt_mel.shape[1]
        if not final and own <= prompt:
            raise ValueError(
                f"request {i}: {length - voice.s3gen_prompt_tokens.shape[1]} speech tokens leave no frame "
                f"once the last {s3gen.flow.config.pre_lookahead_len} are held back; pass more or finalize"
            )
        if prompt > own:
            raise ValueError(
                f"request {i}: the voice's prompt mel has {prompt} frames, more than the {own} frames of its "
                "prompt and new tokens; the voice's prompt tokens and mel do not belong together"
            )
        pad = mx.zeros((1, frames - prompt, mel_dim), mu.dtype)
        conds.append(mx.concatenate([voice.s3gen_prompt_mel.astype(mu.dtype), pad], axis=1))
        if noise is None:  # each row draws the noise of its own shape from its own key, as alone
            noise = mx.random.normal((1, own, mel_dim), key=key)
        elif key is not None:
            raise ValueError(f"request {i}: pass either a key or cfm_noise, not both")
        elif noise.shape != (1, own, mel_dim):
            raise ValueError(f"request {i}: cfm_noise has shape {noise.shape}, expected {(1, own, mel_dim)}")
        noises.append(mx.pad(noise, [(0, 0), (0, frames - own), (0, 0)]))
        spans.append((prompt, own))
    if not all(finalize):  # a non-final row's dropped frames are masked as padding (mel: sliced off)
        mask = mask & (mx.arange(frames)[None] < mx.array([own for _, own in spans])[:, None])
    elif all(length == width for length in lengths):
        # No row padded and every one final (one request, or rows of one length): every frame is valid, and
        # the solve runs without a mask as ``mel`` does (about 80 kernels a call fewer, the attention without
        # a bias), the same up to float error.
        mask = None
    spks = s3gen.flow.embed_speaker(mx.concatenate([voice.xvector for voice in voices], axis=0))
    cond, noise = mx.concatenate(conds, axis=0), mx.concatenate(noises, axis=0)
    mel = yield from _solve_steps(s3gen.estimator, mu, mask, spks, cond, noise, cfm_steps)
    return [mel[i : i + 1, start:stop] for i, (start, stop) in enumerate(spans)]


def _batch_wav_steps(
    s3gen: S3Gen,
    tokens: list[mx.array | np.ndarray],
    voices: list[Voice],
    cfm_steps: int | None,
    keys: list[mx.array | None] | None,
    bucket: int,
) -> Steps[list[mx.array]]:
    if keys is None:
        keys = [None] * len(tokens)
    split = [(None, None) if key is None else tuple(mx.random.split(key)) for key in keys]
    mels = yield from _batch_mel_steps(
        s3gen, tokens, voices, cfm_steps, [cfm_key for cfm_key, _ in split], bucket
    )
    wavs = [fade_in(wav) for wav in vocode_rows(s3gen.hift, mels, [source_key for _, source_key in split])]
    mx.async_eval(wavs)
    yield
    return wavs


def vocode_rows(hift: HiFT, mels: list[mx.array], keys: list[mx.array | None]) -> list[mx.array]:
    """HiFT over rows of any lengths in one call: (1, T_i, 80) mels -> (1, 480 T_i) waveforms, each with the
    source draws of its own shape from its own key, equal to the row alone up to float error. Rows shorter
    than the longest are zero-padded and masked (``HiFT.decode``'s lengths)."""
    frames = [mel.shape[1] for mel in mels]
    width = max(frames)
    draws = [hift.draw_source(1, n, key) for n, key in zip(frames, keys)]
    spf = hift.config.samples_per_frame
    wav = hift(
        stack_padded(mels, width),
        phases=mx.concatenate([phases for phases, _ in draws]),
        noise=stack_padded([noise for _, noise in draws], width * spf),
        lengths=None if min(frames) == width else mx.array(frames, dtype=mx.int32),
    )
    return [wav[i : i + 1, : n * spf] for i, n in enumerate(frames)]


def stack_padded(rows: list[mx.array], width: int) -> mx.array:
    """(1, T_i, ...) rows -> (len(rows), width, ...), each right-padded with zeros to ``width`` along axis 1."""
    rest = [(0, 0)] * (rows[0].ndim - 2)
    padded = [mx.pad(x, [(0, 0), (0, width - x.shape[1])] + rest) if x.shape[1] < width else x for x in rows]
    return mx.concatenate(padded)


def _token_row(ids: mx.array | np.ndarray, vocab_size: int, index: int) -> mx.array:
    """One request's speech tokens, (N,) or (1, N) integer ids -> a checked (1, N) int32 array."""
    ids = ids if isinstance(ids, mx.array) else mx.array(np.asarray(ids))
    if ids.ndim == 1:
        ids = ids[None]
    if ids.size == 0:
        raise ValueError(f"request {index}: there are no speech tokens to vocode")
    if ids.ndim != 2 or ids.shape[0] != 1 or not mx.issubdtype(ids.dtype, mx.integer):
        raise ValueError(
            f"request {index}: speech tokens must be integer ids of shape (N,) or (1, N), "
            f"got {ids.dtype} {ids.shape}"
        )
    low, high = mx.min(ids).item(), mx.max(ids).item()
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"request {index}: speech tokens must lie in [0, {vocab_size}), "
            f"found {low if low < 0 else high}; drop T3's start/stop ids first (drop_invalid_tokens)"
        )
    return ids.astype(mx.int32)
