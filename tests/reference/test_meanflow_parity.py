"""The meanflow S3Gen decoder (Turbo/Nano, variants.md §3) against upstream ``S3Gen(meanflow=True)``, full size,
random weights, fp32.

One upstream ``S3Token2Wav(meanflow=True)`` is built with every network randomised (oracle's randomisers; the
CFM's include ``time_embed_mixer``, which upstream initialises as [I | 0], so that r would otherwise never
matter) and its whole state dict, the tokenizer's front-end buffers included, goes through our
``convert_s3gen`` with a meanflow config. Compared: (a) one estimator call for fixed (x, mu, spks, cond, t, r);
(b) the meanflow solve (``CausalConditionalCFM.forward(meanflow=True)``) for 1 and 2 steps with injected noise;
(c) ``S3Token2Wav.inference`` from tokens to waveform with every draw injected: flow_inference's
``torch.randn`` of the new frames, the CFM's ``randn_like`` of the whole sequence (whose tail the former
replaces) and HiFT's source draws. Errors: relative max (``oracle.rel_err``) and relative L2
(``oracle.rel_l2``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import mlx.core as mx
import numpy as np
import pytest
import torch

from mlx_chatterbox.convert import convert_s3gen
from mlx_chatterbox.generation.vocode import S3Gen
from mlx_chatterbox.models.cfm import CFMConfig, Estimator, linear_schedule, solve_meanflow
from mlx_chatterbox.models.flow import Flow
from mlx_chatterbox.models.hift import HiFT
from mlx_chatterbox.variants import ENGLISH

from . import oracle
from .oracle import rel_err, rel_l2
from .test_cfm_parity import inputs, tch
from .test_s3gen_parity import (
    CHAINED_WAV_TOL,
    WAV_TOL,
    random_draws,
    upstream_wav,
    vocoder_errors,
    voice_and_tokens,
)

pytestmark = pytest.mark.reference

MEANFLOW = dataclasses.replace(ENGLISH, cfm=CFMConfig(meanflow=True))
# Measured on the 2-core CPU host (rel. max): estimator 2.7e-6 to 3.8e-6, 1- and 2-step solves 1.7e-6 to
# 2.5e-6; from tokens, the mel 1.3e-6 to 3.2e-6. The English CFM's bound (test_cfm_parity) holds for all.
CALL_TOL = 1e-5
SOLVE_TOL = 1e-5
MEL_TOL = 1e-5
# The waveform is held as test_s3gen_parity holds it, with its bounds (its docstring: HiFT's sine source
# integrates f0 rounding into phase, and the error moves with the host's BLAS). Measured here (rel. L2):
# our vocoder on the same mel 4.8e-5 to 3.3e-4, the waveform from tokens 2.1e-4 to 3.1e-4.


def upstream_meanflow_s3gen(seed: int = 0):
    """``oracle.upstream_s3gen`` for ``S3Gen(meanflow=True)``: full size, every network randomised, eval, fp32."""
    from chatterbox.models.s3gen import S3Gen as UpstreamS3Gen  # imports torchaudio: only where needed

    torch.manual_seed(seed)
    model = UpstreamS3Gen(meanflow=True).eval()
    oracle.randomize_flow_(model.flow, seed + 1)
    oracle.randomize_cfm_(model.flow.decoder, seed + 2)  # every Linear, the mixer included
    oracle.randomize_hift_(model.mel2wav, seed + 3)
    oracle.randomize_s3tokenizer_(model.tokenizer, seed + 4)
    oracle.randomize_campplus_(model.speaker_encoder, seed + 5)
    return model


@pytest.fixture(scope="module")
def models():
    upstream = upstream_meanflow_s3gen(seed=0)
    mixer = upstream.flow.decoder.estimator.time_embed_mixer.weight.detach()
    half = mixer.shape[0]
    # The randomised mixer is far from upstream's [I | 0]: the r half weighs as much as the t half.
    assert not torch.allclose(mixer[:, :half], torch.eye(half), atol=0.1)
    assert float(mixer[:, half:].norm() / mixer[:, :half].norm()) > 0.9
    weights = {k: mx.array(v.detach().numpy()) for k, v in upstream.state_dict().items()}
    assert {"tokenizer._mel_filters", "tokenizer.window"} <= set(weights)  # s3gen_meanflow holds them too
    parts = convert_s3gen(weights, MEANFLOW)
    built = {}
    for name, network in [("flow", Flow), ("cfm", Estimator), ("hift", HiFT)]:
        built[name] = network(getattr(MEANFLOW, name))
        built[name].load_weights(list(parts[name].items()), strict=True)
    return upstream, S3Gen(built["flow"], built["cfm"], built["hift"])


def upstream_velocity(estimator, d: dict, t: list[float], r: list[float]) -> np.ndarray:
    mask = torch.from_numpy(d["mask"].astype(np.float32))[:, None]
    with torch.inference_mode():
        out = estimator(
            tch(d["x"]),
            mask,
            tch(d["mu"]),
            torch.tensor(t),
            torch.from_numpy(d["spks"]),
            tch(d["cond"]),
            r=torch.tensor(r),
        )
    return out.numpy().transpose(0, 2, 1)


def ours_velocity(estimator: Estimator, d: dict, t: list[float], r: list[float]) -> mx.array:
    a = {k: mx.array(v) for k, v in d.items()}
    return estimator(a["x"], a["mask"], a["mu"], mx.array(t), a["spks"], a["cond"], r=mx.array(r))


@contextlib.contextmanager
def injected_randn(noise: np.ndarray):
    """``torch.randn(1, 80, F)`` (flow_inference's draw of the new frames) returns ``noise`` (1, F, 80)
    transposed; other shapes draw as usual. Asserts that it was drawn."""
    ref = torch.from_numpy(np.ascontiguousarray(noise.transpose(0, 2, 1)))
    original, used = torch.randn, []

    def fake(*size, **kwargs):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else tuple(size)
        if shape != tuple(ref.shape):
            return original(*size, **kwargs)
        used.append(shape)
        return ref.clone().to(kwargs.get("dtype") or ref.dtype)

    torch.randn = fake
    try:
        yield
    finally:
        torch.randn = original
    assert used == [tuple(ref.shape)], f"flow_inference's noise was drawn {len(used)} times"


def upstream_meanflow_mel(cfm, d: dict, z: np.ndarray, noised: np.ndarray, steps: int):
    """Upstream ``CausalConditionalCFM.forward(meanflow=True)``, batch 1, with ``randn_like`` -> z (1, T, 80)
    and ``noised_mels`` (1, F, 80) replacing z's last F frames; returns the mel and the t_span handed to
    ``basic_euler`` (which must be the solver used: ``solve_euler`` would run guidance)."""
    spans, basic_euler = [], cfm.basic_euler

    def spy(x, t_span, **kw):
        assert x.shape[0] == 1  # no batch doubling for guidance
        spans.append(t_span.clone())
        return basic_euler(x, t_span=t_span, **kw)

    def no_cfg(*args, **kwargs):
        raise AssertionError("meanflow ran solve_euler")

    cfm.basic_euler, cfm.solve_euler = spy, no_cfg
    mask = torch.ones(1, 1, z.shape[1])
    original = torch.randn_like
    torch.randn_like = lambda like, **_: tch(z).to(like.dtype)
    try:
        mel, _ = cfm(
            tch(d["mu"]),
            mask,
            steps,
            spks=torch.from_numpy(d["spks"]),
            cond=tch(d["cond"]),
            noised_mels=tch(noised),
            meanflow=True,
        )
    finally:
        torch.randn_like = original
        del cfm.basic_euler, cfm.solve_euler
    return mel.numpy().transpose(0, 2, 1), spans[0].numpy()


def test_linear_schedule_is_upstreams_linspace():
    """Exact at the counts Turbo uses (1, 2) and a few more; elsewhere within an ulp (torch's SIMD linspace)."""
    for n in (1, 2, 3, 4, 5, 8, 10, 16, 25):
        ours, ref = np.asarray(linear_schedule(n)), torch.linspace(0, 1, n + 1, dtype=torch.float32).numpy()
        assert ours.dtype == ref.dtype == np.float32
        if n <= 5 or n == 10:
            assert np.array_equal(ours, ref), (n, np.abs(ours - ref).max())
        else:
            assert np.abs(ours - ref).max() <= 1.2e-7, (n, np.abs(ours - ref).max())


@pytest.mark.slow
@pytest.mark.parametrize(
    "lengths, t, r",
    [([36], [0.0], [0.5]), ([36], [0.5], [1.0]), ([40, 27], [0.0, 0.3], [1.0, 0.8])],
    ids=["step-1-of-2", "step-2-of-2", "padded-batch-2"],
)
def test_estimator_call(models, lengths, t, r):
    upstream, ours = models
    estimator = upstream.flow.decoder.estimator
    d = inputs(lengths, seed=int(10 * t[0]) + len(lengths))
    ref = upstream_velocity(estimator, d, t, r)
    out = np.asarray(ours_velocity(ours.estimator, d, t, r))
    assert out.shape == ref.shape
    err, l2 = rel_err(out, ref), rel_l2(out, ref)
    print(f"meanflow estimator {lengths} t={t} r={r}: rel max {err:.2e}, rel L2 {l2:.2e}")
    assert err < CALL_TOL, f"rel max {err:.2e}, rel L2 {l2:.2e}"
    assert np.all(out[~d["mask"]] == 0)
    # r reaches the output: the same call with another r is far off (upstream's [I | 0] mixer would hide it).
    moved = upstream_velocity(estimator, d, t, [0.25 * x for x in r])
    assert rel_l2(moved, ref) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("steps", [1, 2])
def test_meanflow_solve_with_injected_noise(models, steps):
    upstream, ours = models
    d = inputs([38], seed=5)  # 38 frames: 26 of prompt, 12 generated
    rng = np.random.default_rng(steps)
    z = rng.standard_normal((1, 38, 80)).astype(np.float32)  # upstream's randn_like over every frame
    noised = rng.standard_normal((1, 12, 80)).astype(np.float32)  # flow_inference's draw of the new frames
    ref, span = upstream_meanflow_mel(upstream.flow.decoder, d, z, noised, steps)
    np.testing.assert_array_equal(span, np.asarray(linear_schedule(steps)))
    joined = mx.array(np.concatenate([z[:, :26], noised], axis=1))
    a = {k: mx.array(v) for k, v in d.items()}
    out = np.asarray(solve_meanflow(ours.estimator, a["mu"], None, a["spks"], a["cond"], joined, steps))
    err, l2 = rel_err(out, ref), rel_l2(out, ref)
    print(f"meanflow {steps}-step solve: rel max {err:.2e}, rel L2 {l2:.2e}")
    assert err < SOLVE_TOL, f"rel max {err:.2e}, rel L2 {l2:.2e}"
    # The prompt frames' noise matters (the estimator attends over the whole sequence).
    other = mx.concatenate([joined[:, :26] + 1.0, joined[:, 26:]], axis=1)
    moved = solve_meanflow(ours.estimator, a["mu"], None, a["spks"], a["cond"], other, steps)
    assert rel_l2(np.asarray(moved)[:, 26:], out[:, 26:]) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    "prompt_tokens, prompt_frames, tokens, steps",
    # None: both sides' default (2 for meanflow); an odd prompt mel (2P + 1 frames) gives 2N - 1 frames.
    [(12, 24, 10, None), (9, 19, 8, 1), (10, 20, 9, 2)],
)
def test_tokens_to_waveform_matches_upstream(models, prompt_tokens, prompt_frames, tokens, steps):
    upstream, ours = models
    voice, speech = voice_and_tokens(prompt_tokens, prompt_frames, tokens, seed=prompt_tokens)
    total, new = 2 * (prompt_tokens + tokens), 2 * tokens
    frames = total - prompt_frames  # what the output keeps
    upstream_draws = random_draws(total, frames, seed=tokens)  # cfm_noise: upstream's randn_like
    noised = np.random.default_rng(100 + tokens).standard_normal((1, new, 80)).astype(np.float32)
    z = np.array(upstream_draws.cfm_noise)
    draws = dataclasses.replace(
        upstream_draws, cfm_noise=mx.array(np.concatenate([z[:, : total - new], noised], axis=1))
    )
    with injected_randn(noised):
        ref_mel, ref_wav = upstream_wav(upstream, voice, speech, upstream_draws, steps)
    mel = np.array(ours.mel(speech, voice, cfm_steps=steps, cfm_noise=draws.cfm_noise))
    wav = np.array(ours(speech, voice, cfm_steps=steps, draws=draws))
    assert mel.shape == ref_mel.shape == (1, frames, 80)
    assert wav.shape == ref_wav.shape == (1, 480 * frames)
    errors = {
        "mel": rel_l2(mel, ref_mel),
        "mel max": rel_err(mel, ref_mel),
        "waveform": rel_l2(wav, ref_wav),
        "waveform max": rel_err(wav, ref_wav),
    }
    errors.update(vocoder_errors(ours, upstream, wav, mel, ref_wav, ref_mel, draws))
    numbers = ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
    print(f"meanflow S3Gen {prompt_tokens}+{tokens} tokens, {steps} steps: {numbers}")
    assert errors["mel"] < MEL_TOL and errors["mel max"] < MEL_TOL, numbers
    assert errors["vocoder"] < WAV_TOL and errors["vocoder on our mel"] < WAV_TOL, numbers
    assert errors["waveform"] < CHAINED_WAV_TOL, numbers
    np.testing.assert_array_equal(wav[0, :480], 0.0)  # trim_fade mutes the first 20 ms
