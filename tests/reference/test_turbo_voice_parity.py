"""A recording -> Turbo voice, against upstream ``ChatterboxTurboTTS.prepare_conditionals``.

As tests/reference/test_voice_cloning_parity.py: upstream's full-size S3Gen (its S3 tokenizer and CAM++;
Turbo's meanflow S3Gen differs only in the CFM decoder, which cloning never runs) and voice encoder with
random weights, ours loaded with the same weights through our conversion. Inputs: espeak-ng speech at
22.05 kHz, so that the load resamples too. One clip is 17.4 s (all of upstream's cuts bite: 15 s for T3's
375 prompt tokens, 10 s for S3Gen; the voice encoder sees all of it), one is 7.5 s and 25 dB down (a short
prompt, a large loudness gain). Every field of the voice is compared.
"""

from __future__ import annotations

import subprocess
import types

import mlx.core as mx
import numpy as np
import pytest
from chatterbox.tts_turbo import ChatterboxTurboTTS

from mlx_chatterbox.convert import convert_s3gen, sanitize
from mlx_chatterbox.generation.voice import VoiceCloner
from mlx_chatterbox.models.campplus import CAMPPlus
from mlx_chatterbox.models.s3tokenizer import S3Tokenizer
from mlx_chatterbox.models.voice_encoder import VoiceEncoder
from mlx_chatterbox.variants import ENGLISH

from . import oracle
from .oracle import rel_l2
from .test_loudness_parity import upstream_norm_loudness

pytestmark = [pytest.mark.reference, pytest.mark.slow]

TEXT = (
    "The quick brown fox jumps over the lazy dog. A voice of one speaker, read slowly and clearly, "
    "makes a good reference for cloning. Fifteen seconds of it is what the turbo model listens to, "
    "and the rest still shapes the speaker embedding."
)
CLIPS = {"long": (17.4, -3), "short_quiet": (7.5, -25)}  # seconds, gain dB
TOL = 1e-5  # relative L2 of the float fields, as the English test


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    raw = d / "espeak.wav"
    subprocess.run(["espeak-ng", "-s", "120", "-w", str(raw), TEXT], check=True, capture_output=True)
    paths = {}
    for name, (seconds, gain) in CLIPS.items():
        paths[name] = d / f"{name}.wav"
        # 0.3 s of silence in front (the voice encoder's trim has an edge to cut), at 22.05 kHz.
        subprocess.run(
            [
                "sox",
                "-D",
                str(raw),
                str(paths[name]),
                "gain",
                str(gain),
                "pad",
                "0.3",
                "trim",
                "0",
                str(seconds),
            ],
            check=True,
        )
    return paths


@pytest.fixture(scope="module")
def models():
    s3gen = oracle.upstream_s3gen(seed=11)
    from chatterbox.models.voice_encoder import VoiceEncoder as UpstreamVoiceEncoder

    ve = UpstreamVoiceEncoder().eval()
    oracle.randomize_voice_encoder_(ve, seed=12)
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
    cloner = VoiceCloner.turbo(built["voice_encoder"][0], built["s3tokenizer"][0], built["campplus"][0])
    return s3gen, ve, cloner


def upstream_host(s3gen, ve) -> types.SimpleNamespace:
    """An object holding only what ``ChatterboxTurboTTS.prepare_conditionals`` reads (T3's prompt length as
    ``from_local`` sets it, S3Gen, VE, the loudness step)."""
    return types.SimpleNamespace(
        s3gen=s3gen,
        ve=ve,
        t3=types.SimpleNamespace(hp=types.SimpleNamespace(speech_cond_prompt_len=375)),
        device="cpu",
        ENC_COND_LEN=ChatterboxTurboTTS.ENC_COND_LEN,
        DEC_COND_LEN=ChatterboxTurboTTS.DEC_COND_LEN,
        # Upstream's own step, with the float32 result it has under its pinned numpy < 2 (with this venv's
        # numpy 2 the clip turns float64 and upstream's S3 tokenizer then rejects it).
        norm_loudness=upstream_norm_loudness,
    )


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_voice_matches_prepare_conditionals(models, references, clip):
    import librosa

    s3gen, ve, cloner = models
    host = upstream_host(s3gen, ve)
    ChatterboxTurboTTS.prepare_conditionals(host, str(references[clip]))
    conds = host.conds
    voice = cloner(librosa.load(str(references[clip]), sr=24000)[0])
    ref = {
        "speaker_emb": conds.t3.speaker_emb.detach().numpy(),
        "t3_prompt_tokens": conds.t3.cond_prompt_speech_tokens.detach().numpy(),
        "s3gen_prompt_tokens": conds.gen["prompt_token"].detach().numpy(),
        "s3gen_prompt_mel": conds.gen["prompt_feat"].detach().numpy(),
        "xvector": conds.gen["embedding"].detach().numpy(),
    }
    seconds = CLIPS[clip][0]
    # The 15 s cut gives the full 375 tokens; a shorter clip gives fewer (25 per second), unpadded.
    prompt = ref["t3_prompt_tokens"].shape[1]
    assert prompt == 375 if seconds > 15 else abs(prompt - seconds * 25) <= 1
    assert ref["s3gen_prompt_mel"].shape == (1, int(min(seconds, 10) * 50), 80)
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
    print(
        f"turbo voice ({clip}) vs prepare_conditionals:",
        {k: f"{v:.1e}" for k, v in errors.items()},
        "codes exact",
    )


def test_too_short_reference_is_refused_like_upstream(models, tmp_path):
    import soundfile as sf

    s3gen, ve, cloner = models
    wav = (0.1 * np.random.default_rng(0).standard_normal(5 * 24000)).astype(np.float32)  # exactly 5 s
    sf.write(tmp_path / "five.wav", wav, 24000, subtype="FLOAT")
    with pytest.raises(AssertionError, match="longer than 5 seconds"):
        ChatterboxTurboTTS.prepare_conditionals(upstream_host(s3gen, ve), str(tmp_path / "five.wav"))
    with pytest.raises(ValueError, match="longer than 5 s"):
        cloner(wav)
