"""End to end, text -> waveform: ours against upstream ``ChatterboxTTS.generate``, before the watermark.

Upstream's ``ChatterboxTTS`` is built from modules: a tiny random T3, the full-size randomised S3Gen (flow, CFM,
HiFT, S3 tokenizer, CAM++), a randomised voice encoder, the toy tokenizer and random built-in conds. All of them
are written in upstream's file layout (t3_cfg.safetensors, s3gen.safetensors, ve.safetensors, tokenizer.json,
conds.pt) and ours is made from that folder by ``mlx_chatterbox.convert`` and ``TTS.load``, so that the real
conversion sits in the loop. Upstream's voice encoder and conds are read back from those files, as ``from_local``
does.

Both sides get the same draws: upstream's ``torch.multinomial`` is replaced by the inverse-CDF draw of the
injected uniforms, and its S3Gen draws (CFM noise, SineGen phases and noise) return ours
(``test_s3gen_parity.injected``). Upstream's Perth watermarker is replaced by an identity. One exception keeps the
token comparison exact but meaningful: a uniform that lands within 1e-6 of a step of upstream's CDF is a tie that
fp32 cannot settle (one draw here lands exactly on a step); ours then gets the middle of the CDF interval of
the id upstream picked (``oracle.injected_multinomial_tie_safe``; the count is printed as "ties").

Our public API takes a seed but no injected draws, so our side runs what ``TTS.generate`` runs, step by step, with
the draws injected: ``tts.text_ids`` (punc_norm + tokenizer) -> ``generate_speech_tokens(..., uniforms=)`` ->
``drop_invalid_tokens`` (as ``TTS.speech_tokens``) -> ``tts.s3gen(tokens, voice, draws=)`` (as ``TTS.vocode``).

Random weights almost never emit the stop token, so both sides are bounded to ``MAX_NEW_TOKENS``: upstream's
``generate`` hard-codes ``max_new_tokens=1000`` in its call to ``T3.inference`` (whose own default, None, would
fail in ``range(None)``), so that call is wrapped to pass the bound instead; ours takes it as
``SamplingParams.max_new_tokens``.
"""

from __future__ import annotations

import contextlib
import subprocess
import time

import mlx.core as mx
import numpy as np
import pytest
from chatterbox.models.tokenizers import EnTokenizer as UpstreamEnTokenizer
from chatterbox.models.voice_encoder import VoiceEncoder as UpstreamVoiceEncoder
from chatterbox.tts import ChatterboxTTS, Conditionals
from safetensors.torch import load_file

from mlx_chatterbox import SamplingParams, convert
from mlx_chatterbox.api import TTS
from mlx_chatterbox.generation.speech_tokens import drop_invalid_tokens, generate_speech_tokens
from mlx_chatterbox.generation.vocode import Draws
from mlx_chatterbox.variants import ModelConfig
from tests.toy_tokenizer import write_toy_tokenizer

from . import oracle
from .oracle import rel_l2
from .test_s3gen_parity import CHAINED_WAV_TOL, WAV_TOL, injected, random_draws, vocoder_errors

pytestmark = [pytest.mark.reference, pytest.mark.slow]

# punc_norm has work to do: a lower-case start, a colon (-> comma), a double space, no final full stop.
TEXT = "hello there: the quick  brown fox"
MAX_NEW_TOKENS = 25
MEL_TOL = 1e-5  # relative L2 of the mel S3Gen hands HiFT
# Our vocoder against upstream's on the same mel, and the whole waveform: as test_s3gen_parity (its docstring says
# why both are loose); measured end to end here over 5 BLAS settings: vocoder at most 7.4e-4, waveform 2.0e-3.
KNOBS = {
    "defaults": dict(  # upstream generate's
        exaggeration=0.5, cfg_weight=0.5, temperature=0.8, repetition_penalty=1.2, min_p=0.05, top_p=1.0
    ),
    # Upstream cannot run cfg_weight=0 (T3.inference always builds a CFG batch of two), so no set has it.
    "other": dict(
        exaggeration=0.8, cfg_weight=1.0, temperature=1.3, repetition_penalty=1.5, min_p=0.0, top_p=0.9
    ),
}
# CFM Euler steps: upstream's 10 with its default knobs (generate cannot change them); with the other knobs, 4 as
# ours ``cfm_steps=4`` against upstream ``S3Token2Wav.inference(n_cfm_timesteps=4)``, which also saves time.
CFM_STEPS = {"defaults": None, "other": 4}
# S3Gen's prompts are short to keep the full-size CFM cheap: upstream's CPU run slows down several-fold past
# ~130 frames in all (prompt + new; 10 s at 124 frames, 70 s at 168 here). The built-in voice has a 20-token
# prompt; the reference is 1.2 s of espeak-ng speech at 22.05 kHz (the load resamples), 30 tokens: shorter than
# both of upstream's cuts (6 s, 10 s), which test_voice_cloning_parity covers.
S3GEN_PROMPT_TOKENS = 20
REFERENCE_TEXT = "A short reference clip, read clearly by one speaker."


class _NoWatermark:
    """Stands in for ``perth.PerthImplicitWatermarker``: we compare the waveform before the watermark."""

    def apply_watermark(self, wav: np.ndarray, sample_rate: int) -> np.ndarray:
        return wav


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    src = tmp_path_factory.mktemp("upstream")
    t3 = oracle.upstream_t3(oracle.TINY, seed=21)
    oracle.write_t3_checkpoint(t3, src)
    s3gen = oracle.upstream_s3gen(seed=22)
    oracle.write_s3gen_checkpoint(s3gen, src)
    ve = UpstreamVoiceEncoder()
    ve.load_state_dict(load_file(oracle.write_ve_checkpoint(src, seed=23)))
    write_toy_tokenizer(src / "tokenizer.json")
    oracle.random_conds(oracle.TINY, seed=24, gen_tokens=S3GEN_PROMPT_TOKENS).save(src / "conds.pt")
    upstream = ChatterboxTTS(
        t3,
        s3gen,
        ve.eval(),
        UpstreamEnTokenizer(str(src / "tokenizer.json")),
        device="cpu",
        conds=Conditionals.load(src / "conds.pt"),
    )
    upstream.watermarker = _NoWatermark()
    ours = TTS.load(
        convert(src, tmp_path_factory.mktemp("mlx") / "model", config=ModelConfig(t3=oracle.TINY))
    )
    return upstream, ours, src / "conds.pt"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    raw, ref = d / "espeak.wav", d / "ref.wav"
    subprocess.run(["espeak-ng", "-w", str(raw), REFERENCE_TEXT], check=True, capture_output=True)
    # -D: no dither, which sox adds at random after "gain" and would make every run's clip different.
    subprocess.run(
        ["sox", "-D", str(raw), str(ref), "gain", "-3", "pad", "0.2", "trim", "0", "1.2"], check=True
    )
    return ref


@pytest.fixture(scope="module")
def voices(models, reference):
    """Ours: the built-in voice (from conds.pt) and the clone of the reference; upstream's clones per call."""
    _, ours, _ = models
    return {"builtin": ours.builtin_voice, "cloned": ours.voice(reference)}


@contextlib.contextmanager
def bounded_and_injected(
    upstream: ChatterboxTTS, uniforms: np.ndarray, cfm_steps: int | None, draws_seed: int, seen: dict
):
    """Upstream's generate with T3 bounded to MAX_NEW_TOKENS, ``cfm_steps`` CFM steps (None: its 10) and every
    draw injected. ``seen`` receives the uniforms our sampler needs for the same picks
    (``oracle.injected_multinomial_tie_safe``), the text ids T3 gets, the speech tokens S3Gen gets, the S3Gen
    draws (made once the token count is known) and the mel S3Gen hands HiFT."""
    t3_inference, s3gen_inference = upstream.t3.inference, upstream.s3gen.inference
    hift_inference = upstream.s3gen.mel2wav.inference

    def bounded(**kwargs):
        assert kwargs["max_new_tokens"] == 1000  # what generate passes; replaced by our bound
        seen["text_ids"] = kwargs["text_tokens"][0].tolist()
        return t3_inference(**{**kwargs, "max_new_tokens": MAX_NEW_TOKENS})

    def vocode(speech_tokens, ref_dict, **kwargs):
        seen["tokens"] = speech_tokens.tolist()
        total = 2 * (ref_dict["prompt_token"].shape[1] + speech_tokens.numel())
        seen["draws"] = random_draws(total, total - ref_dict["prompt_feat"].shape[1], draws_seed)
        if cfm_steps is not None:
            kwargs["n_cfm_timesteps"] = cfm_steps
        with injected(seen["draws"]):
            return s3gen_inference(speech_tokens, ref_dict=ref_dict, **kwargs)

    def hift(speech_feat, **kwargs):  # the mel S3Gen hands its vocoder
        seen["mel"] = speech_feat.numpy().transpose(0, 2, 1)
        return hift_inference(speech_feat=speech_feat, **kwargs)

    upstream.t3.inference, upstream.s3gen.inference, upstream.s3gen.mel2wav.inference = bounded, vocode, hift
    try:
        with oracle.injected_multinomial_tie_safe(uniforms, seen.setdefault("ours_uniforms", [])):
            yield
    finally:
        del upstream.t3.inference, upstream.s3gen.inference, upstream.s3gen.mel2wav.inference


def run_upstream(
    upstream: ChatterboxTTS, conds_path, reference, voice_name, knobs, uniforms, cfm_steps, draws_seed
):
    """Upstream ``generate`` on TEXT; returns what T3 and S3Gen were given (``bounded_and_injected``) and the
    (1, samples) waveform."""
    seen = {}
    kwargs = {}
    if voice_name == "builtin":
        # A cloning call replaces upstream's conds (prepare_conditionals): put the built-in voice back.
        upstream.conds = Conditionals.load(conds_path)
    else:
        kwargs["audio_prompt_path"] = str(reference)
    with bounded_and_injected(upstream, uniforms, cfm_steps, draws_seed, seen):
        wav = upstream.generate(TEXT, **kwargs, **knobs)
    return seen, wav.numpy()


def run_ours(tts: TTS, voice, knobs, uniforms: np.ndarray, cfm_steps: int | None, draws: Draws):
    """``TTS.generate`` on TEXT step by step, with the draws injected (module docstring): text ids, raw T3
    output, speech tokens, the mel S3Gen hands HiFT, and the (1, samples) waveform."""
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, **knobs)
    ids = tts.text_ids(TEXT)
    raw = list(generate_speech_tokens(tts.t3, voice, ids, params, uniforms=mx.array(uniforms)))
    cfg = tts.t3.config
    tokens = drop_invalid_tokens(raw, cfg.start_speech_token, cfg.stop_speech_token)
    hift, mels = tts.s3gen.hift, []

    def capture(mel, **kwargs):
        mels.append(mel)
        return hift(mel, **kwargs)

    tts.s3gen.hift = capture
    try:
        wav = tts.s3gen(mx.array([tokens], dtype=mx.int32), voice, cfm_steps=cfm_steps, draws=draws)
    finally:
        tts.s3gen.hift = hift
    return ids, raw, tokens, np.array(mels[0]), np.array(wav, dtype=np.float32)


@pytest.mark.parametrize("knobs_name", list(KNOBS))
@pytest.mark.parametrize("voice_name", ["builtin", "cloned"])
def test_text_to_waveform_matches_upstream_generate(models, voices, reference, voice_name, knobs_name):
    upstream, ours, conds_path = models
    knobs = KNOBS[knobs_name]
    seed = 10 * list(KNOBS).index(knobs_name) + (voice_name == "cloned")
    uniforms = np.random.default_rng(seed).random(MAX_NEW_TOKENS).astype(np.float32)

    start = time.perf_counter()
    steps = CFM_STEPS[knobs_name]
    seen, ref_wav = run_upstream(upstream, conds_path, reference, voice_name, knobs, uniforms, steps, seed)
    upstream_s = time.perf_counter() - start
    start = time.perf_counter()
    # Upstream may stop early (EOS); the uniforms it did not use are not used by ours either.
    ours_uniforms = np.array(
        seen["ours_uniforms"] + uniforms[len(seen["ours_uniforms"]) :].tolist(), np.float32
    )
    ties = int((ours_uniforms != uniforms).sum())
    ids, raw, tokens, mel, wav = run_ours(
        ours, voices[voice_name], knobs, ours_uniforms, steps, seen["draws"]
    )
    ours_s = time.perf_counter() - start

    t3 = ours.t3.config
    assert [t3.start_text_token, *ids, t3.stop_text_token] == seen["text_ids"], "text ids differ"
    assert tokens == seen["tokens"], f"speech tokens differ (raw T3 output {raw})"
    assert len(tokens) >= 10, f"only {len(tokens)} speech tokens: pick other uniforms to test something"
    assert mel.shape == seen["mel"].shape and wav.shape == ref_wav.shape
    errors = {"mel": rel_l2(mel, seen["mel"]), "waveform": rel_l2(wav, ref_wav)}
    errors.update(vocoder_errors(ours.s3gen, upstream.s3gen, wav, mel, ref_wav, seen["mel"], seen["draws"]))
    stop = "the stop token" if t3.stop_speech_token in raw else f"the bound of {MAX_NEW_TOKENS}"
    numbers = ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
    print(
        f"{voice_name} voice, {knobs_name} knobs, {steps or 10} CFM steps: {len(raw)} raw -> {len(tokens)} "
        f"speech tokens, exact (stopped at {stop}, {ties} ties); rel. L2: {numbers} (upstream {upstream_s:.1f} s, "
        f"ours {ours_s:.1f} s)"
    )
    assert errors["mel"] < MEL_TOL, numbers
    assert errors["vocoder"] < WAV_TOL and errors["vocoder on our mel"] < WAV_TOL, numbers
    assert errors["waveform"] < CHAINED_WAV_TOL, numbers
