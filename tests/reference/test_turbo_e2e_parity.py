"""Turbo end to end, text -> waveform: ours against upstream ``ChatterboxTurboTTS.generate``, before the
watermark.

The Turbo counterpart of test_e2e_parity. Upstream's ``ChatterboxTurboTTS`` is built from modules as
``from_local`` builds it: T3 with Turbo's hp at a tiny GPT-2 size (``test_t3_turbo_parity.upstream_turbo``,
which registers the size into 0.1.7's ``LLAMA_CONFIGS``) and the toy GPT-2 vocabulary, the full-size
``S3Gen(meanflow=True)`` with every network randomised, the time_embed_mixer included
(``test_meanflow_parity.upstream_meanflow_s3gen``), a randomised voice encoder, and the toy GPT-2 tokenizer
loaded through transformers' ``AutoTokenizer`` with the pad token set, as ``from_local`` does. All of them are
written in upstream's file layout (t3_turbo_v1.safetensors, s3gen_meanflow.safetensors, ve.safetensors, the
tokenizer files) and ours is made from that folder by ``mlx_chatterbox.convert`` and ``TTS.load``, so that the
real conversion sits in the loop. The voice is one set of random conditionals (a ``chatterbox.tts_turbo``
``Conditionals``) given to upstream as its ``conds`` and to ours as the ``Voice`` holding the same arrays
(cloning is test_turbo_voice_parity's).

Both sides get the same draws: upstream's ``torch.multinomial`` is replaced by the inverse-CDF draw of the
injected uniforms (``oracle.injected_multinomial_tie_safe``: a uniform within 1e-6 of a step of upstream's CDF
gives ours the middle of the picked id's interval; the count is printed as "ties"), and its S3Gen draws return
ours: flow_inference's ``torch.randn`` of the new frames (``test_meanflow_parity.injected_randn``), the CFM's
``randn_like`` of the whole sequence and HiFT's source draws (``test_s3gen_parity.injected``). Upstream's
Perth watermarker is replaced by an identity.

``TTS.generate`` takes a seed but no injected draws, so our side runs what it runs for a short text, step by
step, with the draws injected: ``tts.text_ids`` (Turbo's punc_norm + GPT-2 tokenizer) ->
``generate_turbo_tokens(..., uniforms=)`` -> ``tts.speech.finish`` (speech codes + three 4299 silence tokens)
-> ``tts.s3gen(tokens, voice, draws=)`` with the model's CFM steps (Turbo's 2, as upstream generate's
``n_cfm_timesteps=2``).

Random weights almost never emit the stop token, so both sides are bounded to ``MAX_NEW_TOKENS``: upstream's
``generate`` leaves ``inference_turbo``'s ``max_gen_len`` at its 1000, so that call is wrapped to pass the
bound; ours takes it as ``TurboParams.max_new_tokens``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import mlx.core as mx
import numpy as np
import pytest
import torch
from chatterbox.models.voice_encoder import VoiceEncoder as UpstreamVoiceEncoder
from chatterbox.tts_turbo import ChatterboxTurboTTS, Conditionals
from chatterbox.tts_turbo import punc_norm as upstream_punc_norm
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from mlx_chatterbox import convert
from mlx_chatterbox.api import TTS
from mlx_chatterbox.generation.turbo import S3GEN_SIL, SILENCE_TOKENS, generate_turbo_tokens
from mlx_chatterbox.generation.voice import Voice
from mlx_chatterbox.models.gpt2 import T3TurboConfig
from mlx_chatterbox.sampling import TurboParams
from mlx_chatterbox.variants import TURBO
from tests.toy_gpt2_tokenizer import TAGS, VOCAB_SIZE, write_toy_gpt2_tokenizer

from . import oracle
from .oracle import rel_err, rel_l2
from .test_e2e_parity import _NoWatermark
from .test_meanflow_parity import MEL_TOL, injected_randn, upstream_meanflow_s3gen
from .test_s3gen_parity import CHAINED_WAV_TOL, WAV_TOL, injected, random_draws, vocoder_errors
from .test_t3_turbo_parity import upstream_turbo

pytestmark = [pytest.mark.reference, pytest.mark.slow]

# punc_norm has work to do (a lower-case start, a colon -> comma, a double space, no final full stop); a tag.
TEXT = "hello there: the quick  brown fox [laugh] jumps over the lazy dog"
MAX_NEW_TOKENS = 24
T3_TINY = T3TurboConfig(
    hidden_size=64, num_layers=2, num_heads=4, n_positions=512, text_vocab_size=VOCAB_SIZE
)
CONFIG = dataclasses.replace(TURBO, t3=T3_TINY)
KNOBS = {
    "defaults": {},  # upstream generate's: temperature 0.8, top_k 1000, top_p 0.95, repetition_penalty 1.2
    "other": dict(temperature=1.3, top_k=50, top_p=0.8, repetition_penalty=2.0),
}
# The voice: a short S3Gen prompt keeps upstream's full-size CPU S3Gen cheap; T3's takes any length <= 375.
T3_PROMPT_TOKENS = 40
S3GEN_PROMPT_TOKENS = 16
# Bounds: the mel as test_meanflow_parity (MEL_TOL, 1e-5; measured there ~2e-6 rel. L2), our vocoder on the
# same mel and the whole waveform as test_s3gen_parity (WAV_TOL 3e-3, CHAINED_WAV_TOL 1e-2; measured in
# test_meanflow_parity ~3e-4). Measured here (2-core CPU): mel 2.8e-6 (rel. max 2.7e-6), vocoder 2.3e-4 to
# 4.0e-4, waveform 2.2e-4 to 2.7e-4.


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    src = tmp_path_factory.mktemp("upstream")
    t3 = upstream_turbo(T3_TINY, seed=31)
    save_file({k: v.contiguous() for k, v in t3.state_dict().items()}, str(src / "t3_turbo_v1.safetensors"))
    s3gen = upstream_meanflow_s3gen(seed=32)
    # from_local loads s3gen_meanflow.safetensors strictly: the whole state dict, front-end buffers included.
    save_file(
        {k: v.contiguous() for k, v in s3gen.state_dict().items()}, str(src / "s3gen_meanflow.safetensors")
    )
    ve = UpstreamVoiceEncoder()
    ve.load_state_dict(load_file(oracle.write_ve_checkpoint(src, seed=33)))
    write_toy_gpt2_tokenizer(src)
    tokenizer = AutoTokenizer.from_pretrained(src)  # as from_local
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    conds = oracle.random_conds(T3_TINY, seed=34, prompt_len=T3_PROMPT_TOKENS, gen_tokens=S3GEN_PROMPT_TOKENS)
    conds = Conditionals(conds.t3, conds.gen)  # tts_turbo's own class
    upstream = ChatterboxTurboTTS(t3, s3gen, ve.eval(), tokenizer, device="cpu", conds=conds)
    upstream.watermarker = _NoWatermark()
    ours = TTS.load(convert(src, tmp_path_factory.mktemp("mlx") / "model", config=CONFIG))
    assert ours.speech.variant == "turbo" and ours.s3gen.estimator.config.meanflow
    voice = Voice(
        speaker_emb=mx.array(conds.t3.speaker_emb.numpy()),
        t3_prompt_tokens=mx.array(conds.t3.cond_prompt_speech_tokens.numpy().astype(np.int32)),
        s3gen_prompt_tokens=mx.array(conds.gen["prompt_token"].numpy().astype(np.int32)),
        s3gen_prompt_mel=mx.array(conds.gen["prompt_feat"].numpy()),
        xvector=mx.array(conds.gen["embedding"].numpy()),
    )
    return upstream, ours, voice


@contextlib.contextmanager
def bounded_and_injected(upstream: ChatterboxTurboTTS, uniforms: np.ndarray, draws_seed: int, seen: dict):
    """Upstream's generate with T3 bounded to MAX_NEW_TOKENS and every draw injected. ``seen`` receives the
    uniforms our sampler needs for the same picks, the text ids T3 gets, the speech tokens S3Gen gets, the
    S3Gen draws as upstream takes them and as ours takes them (made once the token count is known) and the mel
    S3Gen hands HiFT."""
    t3_inference, s3gen_inference = upstream.t3.inference_turbo, upstream.s3gen.inference
    hift_inference = upstream.s3gen.mel2wav.inference

    def bounded(*args, **kwargs):
        assert "max_gen_len" not in kwargs  # generate leaves it at 1000; replaced by our bound
        seen["text_ids"] = kwargs["text_tokens"][0].tolist()
        return t3_inference(*args, **kwargs, max_gen_len=MAX_NEW_TOKENS)

    def vocode(speech_tokens, ref_dict, **kwargs):
        assert kwargs["n_cfm_timesteps"] == 2
        seen["tokens"] = speech_tokens.tolist()
        prompt_frames = ref_dict["prompt_feat"].shape[1]
        total, new = (
            2 * (ref_dict["prompt_token"].shape[1] + speech_tokens.numel()),
            2 * speech_tokens.numel(),
        )
        upstream_draws = random_draws(
            total, total - prompt_frames, draws_seed
        )  # cfm_noise: the CFM's randn_like
        noised = np.random.default_rng(100 + draws_seed).standard_normal((1, new, 80)).astype(np.float32)
        z = np.array(upstream_draws.cfm_noise)
        # Ours takes the CFM's noise with the new frames replaced by flow_inference's draw (Draws' docstring).
        seen["draws"] = dataclasses.replace(
            upstream_draws, cfm_noise=mx.array(np.concatenate([z[:, : total - new], noised], axis=1))
        )
        seen["upstream_draws"] = upstream_draws
        with injected_randn(noised), injected(upstream_draws):
            return s3gen_inference(speech_tokens, ref_dict=ref_dict, **kwargs)

    def hift(speech_feat, **kwargs):  # the mel S3Gen hands its vocoder
        seen["mel"] = speech_feat.numpy().transpose(0, 2, 1)
        return hift_inference(speech_feat=speech_feat, **kwargs)

    upstream.t3.inference_turbo, upstream.s3gen.inference = bounded, vocode
    upstream.s3gen.mel2wav.inference = hift
    try:
        with oracle.injected_multinomial_tie_safe(uniforms, seen.setdefault("ours_uniforms", [])):
            yield
    finally:
        del upstream.t3.inference_turbo, upstream.s3gen.inference, upstream.s3gen.mel2wav.inference


def run_ours(tts: TTS, voice: Voice, params: TurboParams, uniforms: np.ndarray, draws):
    """``TTS.generate`` on TEXT step by step, with the draws injected (module docstring): text ids, raw T3
    output, speech tokens, the mel S3Gen hands HiFT, and the (1, samples) waveform."""
    ids = tts.text_ids(TEXT)
    raw = list(generate_turbo_tokens(tts.t3, voice, ids, params, uniforms=mx.array(uniforms)))
    tokens = tts.speech.finish(raw)
    hift, mels = tts.s3gen.hift, []

    def capture(mel, **kwargs):
        mels.append(mel)
        return hift(mel, **kwargs)

    tts.s3gen.hift = capture
    try:
        wav = tts.s3gen(mx.array([tokens], dtype=mx.int32), voice, draws=draws)
    finally:
        tts.s3gen.hift = hift
    return ids, raw, tokens, np.array(mels[0]), np.array(wav, dtype=np.float32)


def test_text_ids_match_upstream_tokenizer(models):
    upstream, ours, _ = models
    ref = upstream.tokenizer(upstream_punc_norm(TEXT), return_tensors="pt", padding=True, truncation=True)
    ids = ours.text_ids(TEXT)
    assert ids == ref.input_ids[0].tolist()
    assert VOCAB_SIZE - len(TAGS) + TAGS.index("[laugh]") in ids  # the tag is one id, after <|endoftext|>


@pytest.mark.parametrize("knobs_name", list(KNOBS))
def test_text_to_waveform_matches_upstream_generate(models, knobs_name):
    upstream, ours, voice = models
    params = TurboParams(max_new_tokens=MAX_NEW_TOKENS, **KNOBS[knobs_name])
    seed = 7 + list(KNOBS).index(knobs_name)
    uniforms = np.random.default_rng(seed).random(1 + MAX_NEW_TOKENS).astype(np.float32)

    start = time.perf_counter()
    seen = {}
    with bounded_and_injected(upstream, uniforms, seed, seen), torch.inference_mode():
        ref_wav = upstream.generate(TEXT, **KNOBS[knobs_name]).numpy()
    upstream_s = time.perf_counter() - start
    start = time.perf_counter()
    # Upstream may stop early (EOS); the uniforms it did not use are not used by ours either.
    ours_uniforms = np.array(
        seen["ours_uniforms"] + uniforms[len(seen["ours_uniforms"]) :].tolist(), np.float32
    )
    ties = int((ours_uniforms != uniforms).sum())
    ids, raw, tokens, mel, wav = run_ours(ours, voice, params, ours_uniforms, seen["draws"])
    ours_s = time.perf_counter() - start

    assert ids == seen["text_ids"], "text ids differ"
    assert tokens == seen["tokens"], f"speech tokens differ (raw T3 output {raw})"
    assert tokens[-SILENCE_TOKENS:] == [S3GEN_SIL] * SILENCE_TOKENS
    assert len(tokens) - SILENCE_TOKENS >= 10, f"only {len(tokens)} speech tokens: pick other uniforms"
    frames = 2 * len(tokens)
    assert mel.shape == seen["mel"].shape == (1, frames, 80)
    assert wav.shape == ref_wav.shape == (1, 480 * frames)
    errors = {
        "mel": rel_l2(mel, seen["mel"]),
        "mel max": rel_err(mel, seen["mel"]),
        "waveform": rel_l2(wav, ref_wav),
    }
    errors.update(vocoder_errors(ours.s3gen, upstream.s3gen, wav, mel, ref_wav, seen["mel"], seen["draws"]))
    stop = "the stop token" if ours.t3.config.stop_speech_token in raw else f"the bound of {MAX_NEW_TOKENS}"
    numbers = ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
    print(
        f"turbo, {knobs_name} knobs: {len(raw)} raw -> {len(tokens)} speech tokens (3 of silence), exact "
        f"(stopped at {stop}, {ties} ties); rel. L2: {numbers} "
        f"(upstream {upstream_s:.1f} s, ours {ours_s:.1f} s)"
    )
    assert errors["mel"] < MEL_TOL and errors["mel max"] < MEL_TOL, numbers
    assert errors["vocoder"] < WAV_TOL and errors["vocoder on our mel"] < WAV_TOL, numbers
    assert errors["waveform"] < CHAINED_WAV_TOL, numbers
    np.testing.assert_array_equal(wav[0, :480], 0.0)  # trim_fade mutes the first 20 ms
