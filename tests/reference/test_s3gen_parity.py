"""The whole S3Gen, tokens -> waveform, against upstream ``S3Token2Wav.inference`` at full size.

Upstream's own ``S3Token2Wav`` (all five networks) is built with random weights, every network randomised, and its
whole state dict goes through our conversion of ``s3gen.safetensors`` (``convert_s3gen``), so the key tables are
checked against the real module layout too. Both sides get the same draws: upstream's ``torch.randn_like`` (CFM
noise, SineGen noise) and SineGen's ``Uniform`` phases are patched to return ours.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np
import pytest
import torch
from chatterbox.models.s3gen import hifigan

from mlx_chatterbox.convert import convert_s3gen
from mlx_chatterbox.generation.vocode import Draws, S3Gen
from mlx_chatterbox.generation.voice import Voice
from mlx_chatterbox.models.campplus import CAMPPlus
from mlx_chatterbox.models.cfm import Estimator
from mlx_chatterbox.models.flow import Flow
from mlx_chatterbox.models.hift import HiFT
from mlx_chatterbox.models.s3tokenizer import S3Tokenizer
from mlx_chatterbox.variants import ENGLISH

from . import oracle
from .oracle import rel_l2

pytestmark = [pytest.mark.reference, pytest.mark.slow]

MEL_TOL = 1e-4  # relative L2 over the generated mel
WAV_TOL = (
    1e-3  # relative L2 over the waveform (the SineGen phase integrates f0's rounding, see test_hift_parity)
)


@pytest.fixture(scope="module")
def models():
    upstream = oracle.upstream_s3gen(seed=0)
    weights = {k: mx.array(v.detach().numpy()) for k, v in upstream.state_dict().items()}
    parts = convert_s3gen(weights, ENGLISH)
    built = {}
    for name, network in [
        ("flow", Flow),
        ("cfm", Estimator),
        ("hift", HiFT),
        ("s3tokenizer", S3Tokenizer),
        ("campplus", CAMPPlus),
    ]:
        built[name] = network(getattr(ENGLISH, name))
        built[name].load_weights(list(parts[name].items()), strict=True)  # every key of the real layout
    return upstream, S3Gen(built["flow"], built["cfm"], built["hift"])


def voice_and_tokens(prompt_tokens: int, prompt_frames: int, tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    voice = Voice(
        speaker_emb=mx.zeros((1, 256)),  # T3's parts: unused here
        t3_prompt_tokens=mx.zeros((1, 1), dtype=mx.int32),
        s3gen_prompt_tokens=mx.array(rng.integers(0, 6561, (1, prompt_tokens)).astype(np.int32)),
        s3gen_prompt_mel=mx.array((rng.standard_normal((1, prompt_frames, 80)) - 4).astype(np.float32)),
        xvector=mx.array(rng.standard_normal((1, 192)).astype(np.float32)),
    )
    return voice, mx.array(rng.integers(0, 6561, (1, tokens)).astype(np.int32))


def random_draws(total_frames: int, new_frames: int, seed: int) -> Draws:
    rng = np.random.default_rng(seed)
    phases = np.concatenate([[0.0], rng.uniform(-np.pi, np.pi, 8)])[None]
    return Draws(
        cfm_noise=mx.array(rng.standard_normal((1, total_frames, 80)).astype(np.float32)),
        phases=mx.array(phases.astype(np.float32)),
        source_noise=mx.array(rng.standard_normal((1, 480 * new_frames, 9)).astype(np.float32)),
    )


@contextlib.contextmanager
def injected(draws: Draws):
    """Upstream's draws return ours: randn_like by shape (CFM z is (1, 80, T), SineGen noise (1, 9, L); the unused
    noise branch of SourceModuleHnNSF draws as usual), SineGen's Uniform(-pi, pi).sample -> our phases."""
    by_shape = {}
    for array in (draws.cfm_noise, draws.source_noise):
        ref = np.ascontiguousarray(np.array(array).transpose(0, 2, 1))
        by_shape[ref.shape] = torch.from_numpy(ref)
    phases = torch.from_numpy(np.array(draws.phases))[:, :, None]
    randn_like, uniform = torch.randn_like, hifigan.Uniform
    used = set()

    def fake_randn_like(t, *args, **kwargs):
        ref = by_shape.get(tuple(t.shape))
        if ref is None:
            return randn_like(t, *args, **kwargs)
        used.add(tuple(t.shape))
        return ref.clone().to(t.dtype)

    class FakeUniform:
        def __init__(self, low, high):
            assert (low, high) == (-np.pi, np.pi)

        def sample(self, sample_shape):
            assert tuple(sample_shape) == tuple(phases.shape)
            used.add("phases")
            return phases.clone()

    torch.randn_like, hifigan.Uniform = fake_randn_like, FakeUniform
    try:
        yield
    finally:
        torch.randn_like, hifigan.Uniform = randn_like, uniform
    assert used == set(by_shape) | {"phases"}, f"not every injected draw was used: {used}"


def upstream_wav(
    upstream, voice: Voice, tokens: mx.array, draws: Draws, steps: int
) -> tuple[np.ndarray, np.ndarray]:
    ref_dict = dict(
        prompt_token=torch.from_numpy(np.array(voice.s3gen_prompt_tokens).astype(np.int64)),
        prompt_token_len=torch.tensor([voice.s3gen_prompt_tokens.shape[1]]),
        prompt_feat=torch.from_numpy(np.array(voice.s3gen_prompt_mel)),
        prompt_feat_len=None,
        embedding=torch.from_numpy(np.array(voice.xvector)),
    )
    speech = torch.from_numpy(np.array(tokens).astype(np.int64))
    vocoder, mels = upstream.mel2wav.inference, []

    def capture(speech_feat, **kwargs):  # the mel that inference() hands the vocoder
        mels.append(speech_feat.clone())
        return vocoder(speech_feat=speech_feat, **kwargs)

    upstream.mel2wav.inference = capture
    try:
        with injected(draws):
            wav, _ = upstream.inference(speech, ref_dict=ref_dict, n_cfm_timesteps=steps)
    finally:
        del upstream.mel2wav.inference
    return mels[0].numpy().transpose(0, 2, 1), wav.numpy()


@pytest.mark.parametrize(
    "prompt_tokens, prompt_frames, tokens, steps",
    # An odd prompt mel gives 2N - 1 frames; a voice may have no S3Gen prompt at all.
    [(23, 47, 20, 10), (17, 34, 25, 1), (0, 0, 15, 2)],
)
def test_tokens_to_waveform_matches_upstream(models, prompt_tokens, prompt_frames, tokens, steps):
    upstream, ours = models
    voice, speech = voice_and_tokens(prompt_tokens, prompt_frames, tokens, seed=prompt_tokens)
    total = 2 * (prompt_tokens + tokens)
    new_frames = total - prompt_frames
    draws = random_draws(total, new_frames, seed=tokens)
    ref_mel, ref_wav = upstream_wav(upstream, voice, speech, draws, steps)
    mel = np.array(ours.mel(speech, voice, cfm_steps=steps, cfm_noise=draws.cfm_noise))
    wav = np.array(ours(speech, voice, cfm_steps=steps, draws=draws))
    assert mel.shape == ref_mel.shape == (1, new_frames, 80)
    assert wav.shape == ref_wav.shape == (1, 480 * new_frames)
    mel_err, wav_err = rel_l2(mel, ref_mel), rel_l2(wav, ref_wav)
    assert mel_err < MEL_TOL, f"mel rel. L2 {mel_err:.2e}"
    assert wav_err < WAV_TOL, f"waveform rel. L2 {wav_err:.2e} (mel {mel_err:.2e})"
    np.testing.assert_array_equal(wav[0, :480], 0.0)  # upstream's fade-in mutes the first 20 ms
    print(f"S3Gen {prompt_tokens}+{tokens} tokens, {steps} steps: mel {mel_err:.2e}, wav {wav_err:.2e}")
