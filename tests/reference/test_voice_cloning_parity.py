"""A recording -> voice, against upstream ``ChatterboxTTS.prepare_conditionals`` (and ``S3Gen.embed_ref``).

Upstream's full-size S3Gen (S3 tokenizer, CAM++) and voice encoder with random weights; ours load the same weights
through our conversion. Input: espeak-ng speech, 12.6 s long so that both of upstream's cuts (6 s for T3's prompt,
10 s for S3Gen's) bite, at 22.05 kHz so that the load resamples too. Every field of the voice is compared.
"""

from __future__ import annotations

import subprocess
import types

import mlx.core as mx
import numpy as np
import pytest
from chatterbox.tts import ChatterboxTTS

from mlx_chatterbox.convert import convert_s3gen, sanitize
from mlx_chatterbox.generation.voice import VoiceCloner
from mlx_chatterbox.models.campplus import CAMPPlus
from mlx_chatterbox.models.s3tokenizer import S3Tokenizer
from mlx_chatterbox.models.voice_encoder import VoiceEncoder
from mlx_chatterbox.variants import ENGLISH

from . import oracle
from .oracle import rel_l2

pytestmark = [pytest.mark.reference, pytest.mark.slow]

TEXT = (
    "The quick brown fox jumps over the lazy dog. A voice of one speaker, read slowly and clearly, "
    "makes a good reference for cloning. Ten seconds of it is plenty."
)
TOL = 1e-5  # relative L2 of the float fields


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    raw, ref = d / "espeak.wav", d / "ref.wav"
    subprocess.run(["espeak-ng", "-s", "120", "-w", str(raw), TEXT], check=True, capture_output=True)
    # 0.3 s of silence in front (the voice encoder's trim has an edge to cut), 12.6 s in all, 22.05 kHz.
    subprocess.run(
        ["sox", "-D", str(raw), str(ref), "gain", "-3", "pad", "0.3", "trim", "0", "12.6"], check=True
    )
    return ref


@pytest.fixture(scope="module")
def models():
    s3gen = oracle.upstream_s3gen(seed=7)
    from chatterbox.models.voice_encoder import VoiceEncoder as UpstreamVoiceEncoder

    ve = UpstreamVoiceEncoder().eval()
    oracle.randomize_voice_encoder_(ve, seed=8)
    parts = convert_s3gen({k: mx.array(v.numpy()) for k, v in s3gen.state_dict().items()}, ENGLISH)
    ve_weights = {k: mx.array(v.detach().numpy()) for k, v in ve.state_dict().items()}
    built = {
        "s3tokenizer": (S3Tokenizer(ENGLISH.s3tokenizer), parts["s3tokenizer"]),
        "campplus": (CAMPPlus(ENGLISH.campplus), parts["campplus"]),
        "voice_encoder": (
            VoiceEncoder(ENGLISH.voice_encoder),
            sanitize(ve_weights, VoiceEncoder.checkpoint_table(ENGLISH.voice_encoder), "ve.safetensors"),
        ),
    }
    for network, weights in built.values():
        network.load_weights(list(weights.items()), strict=True)
    cloner = VoiceCloner(built["voice_encoder"][0], built["s3tokenizer"][0], built["campplus"][0])
    return s3gen, ve, cloner


def upstream_conds(s3gen, ve, path):
    """``prepare_conditionals`` on an object holding only what it reads (the T3 hyperparameter, S3Gen, VE)."""
    host = types.SimpleNamespace(
        s3gen=s3gen,
        ve=ve,
        t3=types.SimpleNamespace(hp=types.SimpleNamespace(speech_cond_prompt_len=150)),
        device="cpu",
        ENC_COND_LEN=ChatterboxTTS.ENC_COND_LEN,
        DEC_COND_LEN=ChatterboxTTS.DEC_COND_LEN,
    )
    ChatterboxTTS.prepare_conditionals(host, str(path))
    return host.conds


def test_voice_matches_prepare_conditionals(models, reference):
    import librosa

    s3gen, ve, cloner = models
    conds = upstream_conds(s3gen, ve, reference)
    voice = cloner(librosa.load(str(reference), sr=24000)[0])
    ref = {
        "speaker_emb": conds.t3.speaker_emb.detach().numpy(),
        "t3_prompt_tokens": conds.t3.cond_prompt_speech_tokens.detach().numpy(),
        "s3gen_prompt_tokens": conds.gen["prompt_token"].detach().numpy(),
        "s3gen_prompt_mel": conds.gen["prompt_feat"].detach().numpy(),
        "xvector": conds.gen["embedding"].detach().numpy(),
    }
    assert ref["s3gen_prompt_mel"].shape == (1, 500, 80) and ref["t3_prompt_tokens"].shape == (1, 150)
    for name in ("t3_prompt_tokens", "s3gen_prompt_tokens"):
        ours = np.array(getattr(voice, name))
        assert ours.shape == ref[name].shape, name
        differ = int((ours != ref[name]).sum())
        assert differ == 0, f"{name}: {differ} of {ours.size} codes differ"
    errors = {}
    for name in ("speaker_emb", "s3gen_prompt_mel", "xvector"):
        ours = np.array(getattr(voice, name))
        assert ours.shape == ref[name].shape, name
        errors[name] = rel_l2(ours, ref[name])
    assert all(e < TOL for e in errors.values()), errors
    print("voice vs prepare_conditionals:", {k: f"{v:.1e}" for k, v in errors.items()}, "codes exact")
