"""Voice conversion, source recording -> waveform in a target voice: ours against upstream
``ChatterboxVC.generate``, before the watermark.

Upstream's ``ChatterboxVC`` is built as ``from_local`` builds it: the full-size randomised S3Gen (flow, CFM, HiFT,
S3 tokenizer, CAM++) and ``conds.pt``'s ``gen`` as the built-in target. Ours is made from the same upstream files
by ``convert`` and ``TTS.load`` (a tiny T3 fills the folder; voice conversion does not use it). Upstream's S3Gen
draws return ours (``test_s3gen_parity.injected``) and its Perth watermarker is an identity.

Our public API takes a seed, not injected draws, so our side runs what ``TTS.convert_voice`` runs, step by step:
``read_recording`` at 16 kHz -> ``vc.source_tokens`` -> ``tts.s3gen(tokens, voice, draws=)`` (as ``TTS.vocode``);
tests/test_vc.py checks that ``convert_voice`` is exactly that. The source tokens must be equal, the target's S3Gen
prompt must be what upstream's ``set_target_voice`` makes (``embed_ref`` of the first 10 s), and the waveform is
held to the English end-to-end test's bounds (test_e2e_parity, test_s3gen_parity's docstring says why they are
loose next to the mel's).

Long sources only differ in the tokenizer (past 30 s it works in windows; S3Gen's pieces past 40 s are ours, with
no upstream counterpart), so there only the tokens are compared, with upstream's S3Gen call skipped.
"""

from __future__ import annotations

import subprocess
import time

import mlx.core as mx
import numpy as np
import pytest
import soundfile as sf
import torch
from chatterbox.tts import Conditionals
from chatterbox.vc import ChatterboxVC

from mlx_chatterbox import convert
from mlx_chatterbox.api import TTS
from mlx_chatterbox.generation import vc
from mlx_chatterbox.generation.voice import S3_SR, read_recording
from mlx_chatterbox.variants import ModelConfig
from tests.toy_tokenizer import write_toy_tokenizer

from . import oracle
from .oracle import rel_l2
from .test_e2e_parity import MEL_TOL, S3GEN_PROMPT_TOKENS
from .test_s3gen_parity import CHAINED_WAV_TOL, WAV_TOL, injected, random_draws, vocoder_errors

pytestmark = [pytest.mark.reference, pytest.mark.slow]

# Short clips keep the full-size CFM cheap on a CPU (test_e2e_parity: upstream slows down several-fold past ~130
# frames of prompt + new): 1.2 s of source is 30 tokens, 60 frames; the cloned target's prompt is 1.2 s too.
SOURCE_TEXT = "Convert this sentence into another voice."
TARGET_TEXT = "A short reference clip, read clearly by one speaker."
VOICE_TOL = 1e-5  # rel. L2 of the target's prompt mel and x-vector (test_voice_cloning_parity's bound)


class _NoWatermark:
    """Stands in for ``perth.PerthImplicitWatermarker``: we compare the waveform before the watermark."""

    def apply_watermark(self, wav: np.ndarray, sample_rate: int) -> np.ndarray:
        return wav


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    src = tmp_path_factory.mktemp("upstream")
    oracle.write_t3_checkpoint(oracle.upstream_t3(oracle.TINY, seed=31), src)
    s3gen = oracle.upstream_s3gen(seed=32)
    oracle.write_s3gen_checkpoint(s3gen, src)
    oracle.write_ve_checkpoint(src, seed=33)
    write_toy_tokenizer(src / "tokenizer.json")
    oracle.random_conds(oracle.TINY, seed=34, gen_tokens=S3GEN_PROMPT_TOKENS).save(src / "conds.pt")
    builtin = Conditionals.load(src / "conds.pt").gen
    upstream = ChatterboxVC(s3gen, "cpu", ref_dict=builtin)
    upstream.watermarker = _NoWatermark()
    ours = TTS.load(
        convert(src, tmp_path_factory.mktemp("mlx") / "model", config=ModelConfig(t3=oracle.TINY))
    )
    return upstream, ours, builtin


def espeak(folder, name: str, text: str, *sox_effects: str):
    """espeak-ng speech at 22.05 kHz (the loads resample it), shaped by sox without dither (-D: reproducible)."""
    raw, out = folder / f"{name}-raw.wav", folder / f"{name}.wav"
    subprocess.run(["espeak-ng", "-w", str(raw), text], check=True, capture_output=True)
    subprocess.run(["sox", "-D", str(raw), str(out), *sox_effects], check=True)
    return out


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    return {
        "source": espeak(d, "source", SOURCE_TEXT, "gain", "-3", "pad", "0.1", "trim", "0", "1.2"),
        # Another speaker: a third higher, louder.
        "target": espeak(
            d, "target", TARGET_TEXT, "pitch", "400", "gain", "-1", "pad", "0.2", "trim", "0", "1.2"
        ),
    }


def intercepted(upstream: ChatterboxVC, seen: dict, draws_seed: int | None):
    """Upstream's ``s3gen.inference`` and HiFT wrapped: ``seen`` gets the source's tokens, the target's ref_dict,
    the S3Gen draws (made once the token count is known; injected) and the mel HiFT is handed. With
    ``draws_seed`` None S3Gen is skipped (a 960-sample dummy wav comes back): only the tokens are wanted."""
    s3gen_inference, hift_inference = upstream.s3gen.inference, upstream.s3gen.mel2wav.inference

    def vocode(speech_tokens, ref_dict, **kwargs):
        seen["tokens"] = speech_tokens[0].tolist()
        seen["ref_dict"] = ref_dict
        if draws_seed is None:
            return torch.zeros(1, 960), None
        total = 2 * (ref_dict["prompt_token"].shape[1] + speech_tokens.shape[1])
        seen["draws"] = random_draws(total, total - ref_dict["prompt_feat"].shape[1], draws_seed)
        with injected(seen["draws"]):
            return s3gen_inference(speech_tokens=speech_tokens, ref_dict=ref_dict, **kwargs)

    def hift(speech_feat, **kwargs):
        seen["mel"] = speech_feat.numpy().transpose(0, 2, 1)
        return hift_inference(speech_feat=speech_feat, **kwargs)

    upstream.s3gen.inference, upstream.s3gen.mel2wav.inference = vocode, hift


def run_upstream(upstream: ChatterboxVC, builtin: dict, source, target, draws_seed: int | None):
    """``ChatterboxVC.generate(source, target)`` (target None: the built-in voice); what S3Gen was given and the
    (1, samples) waveform."""
    seen = {}
    upstream.ref_dict = builtin  # a target path replaces it (set_target_voice): put the built-in one back
    intercepted(upstream, seen, draws_seed)
    try:
        wav = upstream.generate(str(source), target_voice_path=None if target is None else str(target))
    finally:
        del upstream.s3gen.inference, upstream.s3gen.mel2wav.inference
    return seen, wav.numpy()


def ours_tokens(tts: TTS, source) -> np.ndarray:
    return vc.source_tokens(tts._voice_cloner().s3tokenizer, read_recording(source, None, S3_SR))


@pytest.mark.parametrize("target", ["builtin", "cloned"])
def test_conversion_matches_upstream_generate(models, clips, target):
    upstream, ours, builtin = models
    seed = 40 + (target == "cloned")
    target_path = None if target == "builtin" else clips["target"]
    start = time.perf_counter()
    seen, ref_wav = run_upstream(upstream, builtin, clips["source"], target_path, seed)
    upstream_s = time.perf_counter() - start

    start = time.perf_counter()
    tokens = ours_tokens(ours, clips["source"])
    voice = ours.builtin_voice if target_path is None else ours.voice(target_path)
    hift, mels = ours.s3gen.hift, []

    def capture(mel, **kwargs):
        mels.append(mel)
        return hift(mel, **kwargs)

    ours.s3gen.hift = capture
    try:
        wav = np.array(ours.s3gen(mx.array(tokens)[None], voice, draws=seen["draws"]), dtype=np.float32)
    finally:
        ours.s3gen.hift = hift
    ours_s = time.perf_counter() - start
    mel = np.array(mels[0])

    assert tokens.tolist() == seen["tokens"], "the source's S3 tokens differ"
    assert len(tokens) == 30 and len(set(tokens.tolist())) > 10, "pick another clip to test something"
    ref = seen["ref_dict"]
    assert (
        np.array(voice.s3gen_prompt_tokens).tolist() == ref["prompt_token"].tolist()
    ), "prompt tokens differ"
    errors = {
        "prompt mel": rel_l2(voice.s3gen_prompt_mel, ref["prompt_feat"].detach().numpy()),
        "x-vector": rel_l2(voice.xvector, ref["embedding"].detach().numpy()),
        "mel": rel_l2(mel, seen["mel"]),
        "waveform": rel_l2(wav, ref_wav),
    }
    assert mel.shape == seen["mel"].shape and wav.shape == ref_wav.shape
    errors.update(vocoder_errors(ours.s3gen, upstream.s3gen, wav, mel, ref_wav, seen["mel"], seen["draws"]))
    numbers = ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
    print(
        f"{target} target, prompt {voice.s3gen_prompt_tokens.shape[1]} tokens: {len(tokens)} source tokens, "
        f"exact; rel. L2: {numbers} (upstream {upstream_s:.1f} s, ours {ours_s:.1f} s)"
    )
    assert errors["prompt mel"] < VOICE_TOL and errors["x-vector"] < VOICE_TOL, numbers
    assert errors["mel"] < MEL_TOL, numbers
    assert errors["vocoder"] < WAV_TOL and errors["vocoder on our mel"] < WAV_TOL, numbers
    assert errors["waveform"] < CHAINED_WAV_TOL, numbers


@pytest.fixture(scope="module")
def long_speech(tmp_path_factory, clips):
    """About 60 s of espeak-ng speech at 16 kHz, sentences one after another."""
    d = tmp_path_factory.mktemp("long")
    text = " ".join([SOURCE_TEXT, TARGET_TEXT, "The quick brown fox jumps over the lazy dog."] * 8)
    wav, sr = sf.read(espeak(d, "long", text, "rate", "16000"), dtype="float32")
    assert sr == S3_SR and len(wav) > 58 * S3_SR, len(wav) / sr
    return d, wav


def write_seconds(folder, wav: np.ndarray, seconds: float):
    path = folder / f"long-{seconds}.wav"
    sf.write(path, wav[: int(seconds * S3_SR)], S3_SR, subtype="FLOAT")
    return path


def test_long_source_tokens_match_upstream(models, long_speech):
    """57 s: three 30 s windows (the last 5 s long), merged as upstream merges them."""
    upstream, ours, builtin = models
    path = write_seconds(*long_speech, 57.0)
    seen, _ = run_upstream(upstream, builtin, path, None, None)
    tokens = ours_tokens(ours, path)
    assert len(tokens) == 1425 == len(seen["tokens"])
    assert tokens.tolist() == seen["tokens"], f"{sum(a != b for a, b in zip(tokens, seen['tokens']))} differ"


def test_long_source_keeps_the_tokens_upstream_loses(models, long_speech):
    """54.5 s: upstream's second window already reaches the end, but a third starts at 52 s; it gives back only
    its tokens past 54 s, so 52.52-54 s (37 tokens) is lost. Ours stops at the second window: the tokens before the
    gap are upstream's, and ours have all 1363."""
    upstream, ours, builtin = models
    path = write_seconds(*long_speech, 54.5)
    seen, _ = run_upstream(upstream, builtin, path, None, None)
    tokens = ours_tokens(ours, path).tolist()
    assert len(tokens) == 1363 and len(seen["tokens"]) == 1363 - 37
    assert tokens[:1313] == seen["tokens"][:1313]
