"""Multilingual v2's alignment analyzer against upstream chatterbox-tts 0.1.7 on random weights, fp32.

(a) The three tapped heads' attention maps equal what upstream's hooks capture (eager attention), at prefill and
    cached steps; max abs error < 1e-5.
(b) ``generate_aligned_speech_tokens`` gives exactly upstream ``T3.inference``'s ids with the analyzer on (text
    vocabulary 2454), with injected draws, on cases where the analyzer changes the outcome.

Upstream's analyzer registers hooks that are never removed and switches the model to eager attention for good, so
every case builds a fresh upstream model.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import mlx.core as mx
import numpy as np
import pytest
import torch
from chatterbox.models.t3.inference.alignment_stream_analyzer import AlignmentStreamAnalyzer
from chatterbox.models.t3.inference.t3_hf_backend import T3HuggingfaceBackend

from mlx_chatterbox.generation.aligned import generate_aligned_speech_tokens
from mlx_chatterbox.generation.alignment import ALIGNED_HEADS
from mlx_chatterbox.generation.speech_tokens import generate_speech_tokens, prefill_embeds
from mlx_chatterbox.models.t3 import T3, AttentionTaps, T3Cond, T3Config
from mlx_chatterbox.sampling import SamplingParams
from tests.conftest import random_voice

from . import oracle

pytestmark = pytest.mark.reference

MAP_TOL = 1e-5  # max abs error of the attention probabilities
# Enough layers and heads for the pairs (12, 15), (13, 11), (9, 2); multilingual text vocabulary.
CFG = T3Config(
    hidden_size=64, num_layers=14, num_heads=16, head_dim=4, intermediate_size=128, text_vocab_size=2454
)
EOS = CFG.stop_speech_token
TEXT = [5, 17, 42, 2, 99, 300, 7, 2, 64, 11]  # S = 12 with SOT and EOT; no 0 (the EOT id, marked below)
MARK = 0  # the hidden dimension that the engineered cases below drive


def build(seed: int, edit=None):
    """A fresh multilingual upstream T3 (``edit``ed in place first), its conditioning, our T3 with the same
    weights and our voice of the same conditioning."""
    upstream = oracle.upstream_t3(CFG, seed=seed)
    assert upstream.hp.is_multilingual
    if edit is not None:
        with torch.no_grad():
            edit(upstream)
    conds = oracle.random_conds(CFG, seed=seed)
    voice = dataclasses.replace(
        random_voice(seed),
        speaker_emb=mx.array(conds.t3.speaker_emb.numpy()),
        t3_prompt_tokens=mx.array(conds.t3.cond_prompt_speech_tokens.numpy().astype(np.int32)),
    )
    return upstream, conds, oracle.ours_from(upstream, T3, CFG), voice


def head_row(token: int, logit: float):
    """An edit that makes ``token``'s logit about ``logit`` at every speech step: every speech embedding gets
    +10 on dimension MARK, which then dominates the final hidden state there, and the token's head row reads
    that dimension alone."""

    def edit(model):
        model.speech_emb.weight[:, MARK] += 10.0
        model.speech_head.weight[token] = 0.0
        model.speech_head.weight[token, MARK] = logit

    return edit


def sharp_heads(scale: float):
    """Never EOS by itself; the tapped layers' queries scaled, which makes their attention nearly one-hot."""

    def edit(model):
        head_row(EOS, -100.0)(model)
        for layer in {layer for layer, _ in ALIGNED_HEADS}:
            model.tfmr.layers[layer].self_attn.q_proj.weight.mul_(scale)

    return edit


def heads_on_eot(model):
    """Never EOS by itself; the three tapped heads look at the EOT column from every speech step: the EOT
    embedding gets +10 on dimension 1, and each head's query reads dimension MARK (large at speech positions)
    and its key dimension 1, both in the slowly rotating half of the head."""
    head_row(EOS, -100.0)(model)
    model.text_emb.weight[CFG.stop_text_token, 1] += 10.0
    hd = CFG.head_dim
    for layer, head in ALIGNED_HEADS:
        attn = model.tfmr.layers[layer].self_attn
        attn.q_proj.weight[head * hd : (head + 1) * hd] = 0.0
        attn.k_proj.weight[head * hd : (head + 1) * hd] = 0.0
        attn.q_proj.weight[head * hd + 1, MARK] = 1.0
        attn.k_proj.weight[head * hd + 1, 1] = 1.0


@torch.inference_mode()
def upstream_tokens(upstream, conds, text, params: SamplingParams, uniforms):
    """Upstream ``T3.inference`` as ``ChatterboxMultilingualTTS.generate`` calls it (both CFG rows always),
    with injected draws; returns its ids and the uniforms that make our sampler draw the same ids (None when
    greedy: upstream at temperature 1 with arg-max draws is our greedy decoding)."""
    hp = upstream.hp
    row = [hp.start_text_token, *text, hp.stop_text_token]
    knobs = dict(
        temperature=1.0 if params.greedy else params.temperature,
        cfg_weight=params.cfg_weight,
        repetition_penalty=params.repetition_penalty,
        min_p=params.min_p,
        top_p=params.top_p,
    )
    cond = oracle.upstream_cond(conds, params.exaggeration)
    args = dict(t3_cond=cond, text_tokens=torch.tensor([row, row]), max_new_tokens=params.max_new_tokens)
    if uniforms is None:
        with oracle.injected_multinomial(None):
            return upstream.inference(**args, **knobs)[0].tolist(), None
    ours: list[float] = []
    with oracle.injected_multinomial_tie_safe(uniforms, ours):
        out = upstream.inference(**args, **knobs)[0].tolist()
    # Draws past upstream's stop are never used; pad to one per token as our loop takes them.
    ours += uniforms[len(ours) :].tolist()
    return out, mx.array(np.array(ours, np.float32))


def ours(model, voice, text, params, uniforms, aligned=True):
    generate = generate_aligned_speech_tokens if aligned else generate_speech_tokens
    return list(generate(model, voice, text, params, uniforms=uniforms))


def check_case(case, text, params, sampled, caplog):
    """Ours with the analyzer == upstream; returns (ours, ours without the analyzer, our log lines)."""
    upstream, conds, model, voice = case
    uniforms = np.random.default_rng(7).random(params.max_new_tokens).astype(np.float32) if sampled else None
    ref, our_uniforms = upstream_tokens(upstream, conds, text, params, uniforms)
    with caplog.at_level(logging.INFO, logger="mlx_chatterbox.generation.alignment"):
        caplog.clear()
        got = ours(model, voice, text, params, our_uniforms)
        forced = [r.getMessage() for r in caplog.records]
    assert got == ref
    return got, ours(model, voice, text, params, our_uniforms, aligned=False), forced


# --- (a) the maps ---


@torch.inference_mode()
def upstream_maps(upstream, conds, text, feed):
    """The three heads' maps (3, rows, keys) that upstream's analyzer hooks capture, batch row 0: prefill, then
    each cached step feeding ``feed[i]`` at speech position i + 1 (as ``T3.inference`` runs them)."""
    spy = AlignmentStreamAnalyzer(upstream.tfmr, None, text_tokens_slice=(0, 1), eos_idx=EOS)
    backend = T3HuggingfaceBackend(
        upstream.cfg,
        upstream.tfmr,
        speech_enc=upstream.speech_emb,
        speech_head=upstream.speech_head,
        alignment_stream_analyzer=spy,
    )
    embeds = oracle.prefill_embeds(upstream, oracle.upstream_cond(conds, 0.5), text, 0.5)
    kw = dict(output_attentions=True, output_hidden_states=True, return_dict=True)
    out = backend(inputs_embeds=embeds, past_key_values=None, use_cache=True, **kw)
    maps = [np.stack([a.numpy() for a in spy.last_aligned_attns])]
    for i, tok in enumerate(feed):
        emb = upstream.speech_emb(torch.tensor([[tok]])) + upstream.speech_pos_emb.get_fixed_embedding(i + 1)
        out = backend(inputs_embeds=torch.cat([emb, emb]), past_key_values=out.past_key_values, **kw)
        maps.append(np.stack([a.numpy() for a in spy.last_aligned_attns]))
    return maps


def our_maps(model, voice, text, feed, cache_step=256):
    cond = T3Cond(voice.speaker_emb, voice.t3_prompt_tokens, 0.5)
    taps = AttentionTaps(ALIGNED_HEADS)
    _, cache = model.prefill(prefill_embeds(model, cond, text, 0.5), cache_step=cache_step, taps=taps)
    maps = [np.stack([np.array(m) for m in taps.maps])]
    for i, tok in enumerate(feed):
        taps = AttentionTaps(ALIGNED_HEADS)
        position = cache.claim()
        _, cache.kv = model.decode(
            mx.array([tok, tok]), mx.array(i + 1), mx.array(position), cache.kv, taps=taps
        )
        m = np.stack([np.array(m) for m in taps.maps])
        assert not m[..., position + 1 :].any()  # nothing past the token, unwritten buffer included
        maps.append(m[..., : position + 1])
    return maps


def compare_maps(upstream, conds, model, voice, steps, seed, **kw):
    feed = np.random.default_rng(seed).integers(0, 6561, steps).tolist()
    ref, got = upstream_maps(upstream, conds, TEXT, feed), our_maps(model, voice, TEXT, feed, **kw)
    assert [g.shape for g in got] == [r.shape for r in ref]
    errors = [float(np.abs(g - r).max()) for g, r in zip(got, ref)]
    rel = max(oracle.rel_err(g, r) for g, r in zip(got, ref))
    return max(errors), rel


def test_tapped_maps_equal_upstream_eager_attention():
    case = build(seed=1)
    # A cache step of 40 positions makes the buffer grow during the steps (prefill is 34 + 12 + 2 = 48).
    err, rel = compare_maps(*case, steps=40, seed=3, cache_step=40)
    print(f"tiny T3 (14 layers x 16 heads) maps, prefill + 40 steps: max abs err {err:.1e}, rel {rel:.1e}")
    assert err < MAP_TOL


@pytest.mark.slow
def test_tapped_maps_equal_upstream_eager_attention_full_size():
    start = time.perf_counter()
    upstream = oracle.upstream_t3(oracle.FULL, seed=2)
    conds = oracle.random_conds(oracle.FULL, seed=2)
    voice = dataclasses.replace(
        random_voice(2),
        speaker_emb=mx.array(conds.t3.speaker_emb.numpy()),
        t3_prompt_tokens=mx.array(conds.t3.cond_prompt_speech_tokens.numpy().astype(np.int32)),
    )
    model = oracle.ours_from(upstream, T3, oracle.FULL)
    err, rel = compare_maps(upstream, conds, model, voice, steps=3, seed=4)
    print(f"full-size T3 maps, prefill + 3 steps: max abs err {err:.1e}, rel {rel:.1e}")
    print(f"({time.perf_counter() - start:.1f} s)")
    assert err < MAP_TOL


# --- (b) the tokens ---


def test_two_equal_tokens_force_eos(caplog):
    # Token 1234 wins every greedy step: upstream forces EOS on the second in a row (#549: 2x, not 3x).
    params = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_new_tokens=30)
    got, plain, forced = check_case(build(1, head_row(1234, 100.0)), TEXT, params, False, caplog)
    assert got == [1234, 1234, EOS]
    assert plain == [1234] * 30
    assert len(forced) == 1 and "token_repetition=True" in forced[0]


def test_eos_is_suppressed_until_the_alignment_nears_the_text_end(caplog):
    # EOS wins every step by itself; the analyzer forbids it while the attention sits before the last 3 columns.
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, max_new_tokens=60)
    got, plain, forced = check_case(build(1, head_row(EOS, 100.0)), TEXT, params, False, caplog)
    assert plain == [EOS]
    assert len(got) > len(TEXT) - 1 and got[-1] == EOS and EOS not in got[:-1]
    assert not forced  # it stops because EOS is allowed again, not forced


def test_suppressed_eos_changes_a_sampled_distribution(caplog):
    # No engineering: forbidding EOS renormalises the distribution, so some inverse-CDF draws change.
    params = SamplingParams(temperature=0.8, repetition_penalty=2.0, max_new_tokens=40)
    got, plain, _ = check_case(build(1), TEXT, params, True, caplog)
    assert got != plain


def test_long_tail_forces_eos(caplog):
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, max_new_tokens=60)
    got, plain, forced = check_case(build(1, heads_on_eot), [5, 17, 42, 2, 99, 300], params, False, caplog)
    assert got[-1] == EOS and len(got) < 60 and EOS not in plain
    assert len(forced) == 1 and "long_tail=True" in forced[0]


def test_alignment_repetition_forces_eos(caplog):
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, max_new_tokens=120)
    got, plain, forced = check_case(build(4, sharp_heads(100.0)), TEXT[:8], params, False, caplog)
    assert got[-1] == EOS and len(got) < 120 and EOS not in plain
    assert len(forced) == 1 and "alignment_repetition=True" in forced[0]


@pytest.mark.parametrize("cfg_weight", [0.0, 0.5])
def test_sampled_with_top_p_and_cfg_weights(caplog, cfg_weight):
    # Our cfg_weight 0 runs batch 1; upstream still runs both rows, and the conditional row's maps and logits
    # are the same.
    params = SamplingParams(
        temperature=1.2,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.5,
        cfg_weight=cfg_weight,
        max_new_tokens=40,
    )
    check_case(build(2, head_row(EOS, 100.0)), TEXT, params, True, caplog)


@pytest.mark.parametrize("text", [[5], [5, 17, 42]])
@pytest.mark.parametrize("repeating", [False, True])
def test_short_text_upstream_crashes_and_we_do_not(text, repeating):
    # S <= 5 (SOT and EOT included): upstream's alignment-repetition check reduces over no columns (#548).
    upstream, conds, model, voice = build(1, head_row(1234, 100.0) if repeating else None)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.0 if repeating else 2.0, max_new_tokens=40)
    with pytest.raises(IndexError) as crash:
        upstream_tokens(upstream, conds, text, params, None)
    assert crash.traceback[-1].path.name == "alignment_stream_analyzer.py"
    got = ours(model, voice, text, params, None)
    plain = ours(model, voice, text, params, None, aligned=False)
    if repeating:  # the other rules still apply
        assert got == [1234, 1234, EOS] and plain == [1234] * 40
    else:  # at this size the analyzer never forbids EOS
        assert got == plain and len(got) == 40
