"""T3 parity with upstream chatterbox-tts 0.1.7 on random weights, fp32.

The upstream state dict is written as ``t3_cfg.safetensors``, goes through *our* conversion and loads into
*our* T3. Tolerance: relative error (max |ours - ref| / max |ref|) < 1e-4 on logits and embeddings.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
import torch

from mlx_chatterbox import SamplingParams, convert
from mlx_chatterbox.generation.speech_tokens import (
    drop_invalid_tokens,
    generate_speech_tokens,
    prefill_embeds,
)
from mlx_chatterbox.models.t3 import T3Cond, llama3_inv_freq
from mlx_chatterbox.weights import load_folder
from tests.conftest import TINY_MODEL, write_s3gen_and_ve
from tests.toy_tokenizer import write_toy_tokenizer

from . import oracle

pytestmark = pytest.mark.reference

TOL = 1e-4
TEXT = [5, 17, 42, 2, 99, 300, 7, 2, 64, 11, 3]  # arbitrary text ids below the toy vocabulary


def build(tmp_path_factory, cfg, seed):
    upstream = oracle.upstream_t3(cfg, seed=seed)
    src = tmp_path_factory.mktemp("upstream")
    oracle.write_t3_checkpoint(upstream, src)
    write_toy_tokenizer(src / "tokenizer.json")
    conds = oracle.random_conds(cfg, seed=seed)
    conds.save(src / "conds.pt")
    config = dataclasses.replace(TINY_MODEL, t3=cfg)
    write_s3gen_and_ve(src, config)
    dst = convert(src, tmp_path_factory.mktemp("mlx") / "model", config=config)
    return upstream, conds, load_folder(dst)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build(tmp_path_factory, oracle.TINY, seed=1)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return build(tmp_path_factory, oracle.FULL, seed=2)


def ours_cond(folder, exaggeration):
    v = folder.voice
    return T3Cond(v.speaker_emb, v.t3_prompt_tokens, exaggeration)


def test_rope_inverse_frequencies_match_transformers():
    from chatterbox.models.t3.llama_configs import LLAMA_520M_CONFIG_DICT
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    ref = LlamaRotaryEmbedding(LlamaConfig(**LLAMA_520M_CONFIG_DICT)).inv_freq.numpy()
    ours = np.array(llama3_inv_freq(oracle.FULL))
    assert np.array_equal(ours, ref)  # bit-exact: the scaling runs in fp32 in the same order


@pytest.mark.parametrize("exaggeration", [0.5, 1.3])
def test_cond_encoder(tiny, exaggeration):
    upstream, conds, folder = tiny
    ref = oracle.cond_embeds(upstream, oracle.upstream_cond(conds, exaggeration))
    ours = folder.t3.embed_cond(ours_cond(folder, exaggeration))
    assert ours.shape == ref.shape == (1, 34, oracle.TINY.hidden_size)
    err = oracle.rel_err(ours, ref)
    print(f"cond encoder (exaggeration {exaggeration}): rel err {err:.1e}")
    assert err < TOL


@pytest.mark.parametrize("cfg_weight", [0.5, 0.0])
def test_prefill_embeds_including_cfg_zeroing_and_double_bos(tiny, cfg_weight):
    upstream, conds, folder = tiny
    if cfg_weight == 0:
        # Upstream crashes with cfg_weight=0 (batch-1 text, batch-2 BOS); compare with its conditional row.
        ref = oracle.prefill_embeds(upstream, oracle.upstream_cond(conds, 0.5), TEXT, 0.5)[:1].numpy()
    else:
        ref = oracle.prefill_embeds(upstream, oracle.upstream_cond(conds, 0.5), TEXT, cfg_weight).numpy()
    ours = prefill_embeds(folder.t3, ours_cond(folder, 0.5), TEXT, cfg_weight)
    assert ours.shape == ref.shape
    err = oracle.rel_err(ours, ref)
    print(f"prefill embeds (cfg_weight {cfg_weight}): rel err {err:.1e}")
    assert err < TOL


def teacher_forced(upstream, conds, folder, steps, seed):
    cond = oracle.upstream_cond(conds, 0.5)
    return oracle.compare_teacher_forced(upstream, cond, folder.t3, folder.voice, TEXT, steps, seed)


def test_prefill_and_cached_decode_logits_tiny(tiny):
    errors = teacher_forced(*tiny, steps=30, seed=3)
    print(f"tiny T3 prefill + 30 cached steps: max rel err {max(errors):.2e}")
    assert max(errors) < TOL


@pytest.mark.slow
def test_prefill_and_cached_decode_logits_full_size(full):
    errors = teacher_forced(*full, steps=20, seed=4)
    print(f"full-size T3 prefill + 20 cached steps: max rel err {max(errors):.2e}")
    assert max(errors) < TOL


@pytest.fixture(scope="module")
def full_multilingual(tmp_path_factory):
    """Upstream ``T3Config.multilingual()``: the full-size English T3 with the 2454-id text vocabulary."""
    return build(tmp_path_factory, dataclasses.replace(oracle.FULL, text_vocab_size=2454), seed=5)


@pytest.mark.slow
def test_prefill_and_cached_decode_logits_full_size_multilingual(full_multilingual):
    upstream, conds, folder = full_multilingual
    assert upstream.hp.is_multilingual  # upstream's own test for the multilingual T3
    cond = oracle.upstream_cond(conds, 0.5)
    text = [2453, 1999, 705, *TEXT]  # ids past English's 704 read the larger tables
    errors = oracle.compare_teacher_forced(upstream, cond, folder.t3, folder.voice, text, 10, 6)
    print(f"full-size multilingual T3 prefill + 10 cached steps: max rel err {max(errors):.2e}")
    assert max(errors) < TOL


def test_teacher_forced_forward_matches_upstream_forward(tiny):
    upstream, conds, folder = tiny
    hp = upstream.hp
    text = torch.tensor([[hp.start_text_token, *TEXT, hp.stop_text_token]])
    speech = torch.tensor([[hp.start_speech_token, *np.random.default_rng(5).integers(0, 6561, 24).tolist()]])
    with torch.inference_mode():
        out = upstream(
            t3_cond=oracle.upstream_cond(conds, 0.5),
            text_tokens=text,
            text_token_lens=torch.tensor([text.shape[1]]),
            speech_tokens=speech,
            speech_token_lens=torch.tensor([speech.shape[1]]),
        )
    ours = folder.t3(ours_cond(folder, 0.5), mx.array(text.numpy()), mx.array(speech.numpy()))
    ref = out.speech_logits.numpy()
    assert ours.shape == ref.shape
    err = oracle.rel_err(ours, ref)
    print(f"teacher-forced forward: rel err {err:.1e}")
    assert err < TOL


def ours_tokens(folder, params, uniforms=None):
    raw = list(generate_speech_tokens(folder.t3, folder.voice, TEXT, params, uniforms=uniforms))
    return raw


@pytest.mark.parametrize("repetition_penalty", [1.2, 2.0])
def test_greedy_decoding_equals_upstream_argmax_loop(tiny, repetition_penalty):
    upstream, conds, folder = tiny
    n = 40
    # temperature 1.0 upstream skips the division, and the arg-max of the filtered distribution is the
    # arg-max of the penalised CFG logits: that is our greedy decoding (temperature 0).
    ref = oracle.upstream_inference(
        upstream,
        oracle.upstream_cond(conds, 0.5),
        TEXT,
        n,
        None,
        temperature=1.0,
        cfg_weight=0.5,
        repetition_penalty=repetition_penalty,
        min_p=0.05,
        top_p=1.0,
    )
    ours = ours_tokens(
        folder, SamplingParams(temperature=0.0, repetition_penalty=repetition_penalty, max_new_tokens=n)
    )
    assert len(set(ours)) > 3  # the penalty makes the random model wander, so the test sees a real sequence
    assert ours == ref


@pytest.mark.parametrize(
    "knobs",
    [
        dict(
            temperature=0.8, cfg_weight=0.5, repetition_penalty=1.2, min_p=0.05, top_p=1.0
        ),  # upstream defaults
        dict(temperature=1.3, cfg_weight=1.0, repetition_penalty=1.5, min_p=0.0, top_p=0.9),
        dict(temperature=0.5, cfg_weight=0.3, repetition_penalty=1.0, min_p=0.2, top_p=0.5),
    ],
)
def test_sampled_tokens_equal_upstream_with_injected_draws(tiny, knobs):
    upstream, conds, folder = tiny
    n = 40
    uniforms = np.random.default_rng(6).random(n).astype(np.float32)
    ref = oracle.upstream_inference(upstream, oracle.upstream_cond(conds, 0.7), TEXT, n, uniforms, **knobs)
    params = SamplingParams(exaggeration=0.7, max_new_tokens=n, **knobs)
    ours = ours_tokens(folder, params, uniforms=mx.array(uniforms))
    assert ours == ref
    cfg = folder.t3.config
    assert drop_invalid_tokens(ours, cfg.start_speech_token, cfg.stop_speech_token) == [
        t
        for t in ref[: ref.index(cfg.stop_speech_token) if cfg.stop_speech_token in ref else None]
        if t < 6561
    ]
