"""Turbo/Nano T3 (GPT-2 backbone), its sampling chain and its decode loop on tiny random configs, no
torch."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_chatterbox.convert import sanitize
from mlx_chatterbox.generation.turbo import (
    S3GEN_SIL,
    generate_turbo_tokens,
    make_draws,
    postprocess_tokens,
)
from mlx_chatterbox.models.gpt2 import NANO, TURBO, T3Turbo, T3TurboConfig
from mlx_chatterbox.sampling import (
    TurboParams,
    draw_turbo,
    process_turbo_logits,
    softmax,
    top_k_filter,
    top_p_filter,
)
from tests.conftest import random_voice

TINY = T3TurboConfig(hidden_size=64, num_layers=2, num_heads=4, n_positions=512, text_vocab_size=300)
TEXT = [5, 17, 42, 2, 99, 7]
START, STOP = 6561, 6562


def upstream_weights(cfg: T3TurboConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under upstream's key names and shapes (Conv1D weights as (in, out)); LayerNorm weights
    near 1 and every bias non-zero, so that no term hides as an identity."""
    rng = np.random.default_rng(seed)
    weights = {}
    for key, (_, shape, *_) in T3Turbo.checkpoint_table(cfg).items():
        if ".ln_" in key and key.endswith("weight"):
            w = 1 + 0.1 * rng.standard_normal(shape)
        elif key.endswith("bias"):
            w = 0.1 * rng.standard_normal(shape)
        elif key.endswith(("_emb.weight", "wpe.weight", "wte.weight")):
            w = 0.5 * rng.standard_normal(shape)
        else:
            w = 0.1 * rng.standard_normal(shape)
        weights[key] = w.astype(np.float32)
    return weights


def load(cfg: T3TurboConfig, weights: dict[str, np.ndarray]) -> T3Turbo:
    model = T3Turbo(cfg)
    table = T3Turbo.checkpoint_table(cfg)
    converted = sanitize({k: mx.array(v) for k, v in weights.items()}, table, "t3_turbo_v1.safetensors")
    model.load_weights(list(converted.items()), strict=True)
    return model


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return upstream_weights(TINY)


@pytest.fixture
def model(weights) -> T3Turbo:
    return load(TINY, weights)


@pytest.fixture(scope="module")
def voice():
    return random_voice(seed=3, prompt_len=20)


def embeds(model, voice, text=TEXT):
    return model.prepare_input_embeds(voice.speaker_emb, voice.t3_prompt_tokens, mx.array([text]))


# --- network ---


def test_presets_and_checkpoint_tables():
    assert (TURBO.hidden_size, TURBO.num_layers, TURBO.num_heads, TURBO.head_dim) == (1024, 24, 16, 64)
    assert (TURBO.n_positions, TURBO.intermediate_size, TURBO.layer_norm_eps) == (8196, 4096, 1e-5)
    assert (TURBO.text_vocab_size, TURBO.speech_vocab_size, TURBO.speech_cond_prompt_len) == (
        50276,
        6563,
        375,
    )
    assert (NANO.hidden_size, NANO.num_layers, NANO.num_heads, NANO.head_dim) == (768, 12, 12, 64)
    # variants.md §2.3 / §4: 299 tensors in t3_turbo_v1, 155 in t3_nano_v1; wte and text_head are dropped.
    for cfg, count in ((TURBO, 299), (NANO, 155)):
        table = T3Turbo.checkpoint_table(cfg)
        assert len(table) == count
        assert [k for k, (target, *_) in table.items() if target is None] == [
            "tfmr.wte.weight",
            "text_head.weight",
        ]
    with pytest.raises(ValueError, match="multiple of num_heads"):
        T3TurboConfig(hidden_size=100, num_heads=16)


def test_model_keys_are_exactly_the_table_targets():
    from mlx.utils import tree_flatten

    ours = {k: v.shape for k, v in tree_flatten(T3Turbo(TINY).parameters())}
    table = T3Turbo.checkpoint_table(TINY)
    targets = {t: (shape[::-1] if rule else shape) for t, shape, *rule in table.values() if t is not None}
    assert ours == {k: tuple(v) for k, v in targets.items()}


def numpy_gpt2(w: dict[str, np.ndarray], cfg: T3TurboConfig, x: np.ndarray) -> np.ndarray:
    """GPT-2 on input embeddings (N, D) in float64 straight from upstream-layout weights (Conv1D: x @ W + b),
    then the speech head: (N, V). An independent check of the conversion's transposes."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    h, hd, n = cfg.num_heads, cfg.head_dim, x.shape[0]

    def ln(v, p):
        mu, var = v.mean(-1, keepdims=True), v.var(-1, keepdims=True)
        return (v - mu) / np.sqrt(var + cfg.layer_norm_eps) * w[p + ".weight"] + w[p + ".bias"]

    def conv1d(v, p):
        return v @ w[p + ".weight"] + w[p + ".bias"]

    x = x.astype(np.float64) + w["tfmr.wpe.weight"][:n]
    causal = np.tril(np.ones((n, n), bool))
    for i in range(cfg.num_layers):
        p = f"tfmr.h.{i}."
        q, k, v = np.split(conv1d(ln(x, p + "ln_1"), p + "attn.c_attn"), 3, axis=-1)
        q, k, v = (a.reshape(n, h, hd).transpose(1, 0, 2) for a in (q, k, v))
        s = np.where(causal, q @ k.transpose(0, 2, 1) / math.sqrt(hd), -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a = (a / a.sum(-1, keepdims=True)) @ v
        x = x + conv1d(a.transpose(1, 0, 2).reshape(n, -1), p + "attn.c_proj")
        f = conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc")
        f = 0.5 * f * (1 + np.tanh(math.sqrt(2 / math.pi) * (f + 0.044715 * f**3)))
        x = x + conv1d(f, p + "mlp.c_proj")
    return ln(x, "tfmr.ln_f") @ w["speech_head.weight"].T + w["speech_head.bias"]


def test_forward_matches_a_numpy_gpt2_on_upstream_layout(model, weights, voice):
    e = embeds(model, voice)
    ours = np.array(model(e)[0])
    ref = numpy_gpt2(weights, TINY, np.array(e[0]))
    assert ours.shape == (1 + 20 + len(TEXT) + 1, TINY.speech_vocab_size)
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-5


def test_prefill_layout_single_bos_no_position_tables(model, weights, voice):
    e = np.array(embeds(model, voice)[0])
    p = np.array(voice.t3_prompt_tokens[0])
    spk = (
        np.array(voice.speaker_emb[0]) @ weights["cond_enc.spkr_enc.weight"].T
        + weights["cond_enc.spkr_enc.bias"]
    )
    assert e.shape == (1 + len(p) + len(TEXT) + 1, TINY.hidden_size)
    np.testing.assert_allclose(e[0], spk, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(e[1 : 1 + len(p)], weights["speech_emb.weight"][p])
    np.testing.assert_array_equal(e[1 + len(p) : -1], weights["text_emb.weight"][TEXT])
    np.testing.assert_array_equal(e[-1], weights["speech_emb.weight"][START])


def test_cached_decode_equals_teacher_forced_pass(model, voice):
    """Prefill + one-token cached steps give the logits of one causal pass over the whole sequence, with the
    cache growing past its step on the way, eagerly and compiled."""
    feed = [100, 2000, 6000, 31, 4242, 7, 6562, 8]
    e = embeds(model, voice)
    full = model(mx.concatenate([e, model.speech_emb(mx.array([feed]))], axis=1))[0, e.shape[1] - 1 :]
    for decode in (model.decode, mx.compile(model.decode)):
        logits, cache = model.prefill(e, cache_step=e.shape[1] + 3)
        cached = [logits[0]]
        for tok in feed:
            logits, cache.kv = decode(mx.array([tok]), mx.array(cache.claim(), dtype=mx.int32), cache.kv)
            cached.append(logits[0])
        assert cache.offset == e.shape[1] + len(feed) and cache.capacity == 2 * cache.step
        np.testing.assert_allclose(np.array(mx.stack(cached)), np.array(full), rtol=1e-4, atol=1e-5)


def test_prefill_longer_than_the_position_table_is_refused(model):
    with pytest.raises(ValueError, match="512"):
        model.prefill(mx.zeros((1, 513, TINY.hidden_size)))


# --- TurboParams and the chain ---


def test_turbo_defaults_are_upstreams():
    p = TurboParams()
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.max_new_tokens) == (
        0.8,
        1000,
        0.95,
        1.2,
        1000,
    )


@pytest.mark.parametrize(
    "knob, value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", True),
        ("top_k", -1),
        ("top_k", 5.0),
        ("top_k", True),
        ("top_p", -0.01),
        ("top_p", 1.01),
        ("top_p", "0.5"),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.2),
        ("max_new_tokens", -1),
        ("max_new_tokens", 2.5),
    ],
)
def test_bad_turbo_params_are_refused_by_name(knob, value):
    with pytest.raises(ValueError, match=f"^{knob}="):
        TurboParams(**{knob: value})


def test_integer_knobs_are_taken_as_floats():
    p = TurboParams(temperature=2, top_p=1, repetition_penalty=1)
    assert (p.temperature, p.top_p, p.repetition_penalty) == (2.0, 1.0, 1.0)
    assert all(isinstance(v, float) for v in (p.temperature, p.top_p, p.repetition_penalty))


def chain(logits, seen=None, **knobs):
    x = mx.array(np.asarray(logits, np.float32)[None])
    s = mx.zeros(x.shape, mx.bool_) if seen is None else mx.array(np.isin(np.arange(x.shape[1]), seen)[None])
    return np.array(process_turbo_logits(x, s, TurboParams(**knobs))[0])


OFF = dict(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)


def test_temperature_zero_and_one_leave_logits_unscaled():
    x = [2.0, -1.0, 0.5, 3.0]
    np.testing.assert_array_equal(chain(x, **dict(OFF, temperature=0.0)), np.float32(x))
    np.testing.assert_array_equal(chain(x, **OFF), np.float32(x))
    np.testing.assert_array_equal(chain(x, **dict(OFF, temperature=0.5)), np.float32(x) / np.float32(0.5))


def test_top_k_keeps_ties_and_caps_k_at_the_vocabulary():
    x = np.float32([1.0, 3.0, 2.0, 2.0, 0.0, 2.0])
    out = chain(x, **dict(OFF, top_k=2))
    # The 2nd largest is 2.0, and all three 2.0s tie with it.
    np.testing.assert_array_equal(np.isfinite(out), [False, True, True, True, False, True])
    np.testing.assert_array_equal(out[np.isfinite(out)], x[np.isfinite(out)])
    for k in (6, 7, 10**6, 0):
        np.testing.assert_array_equal(chain(x, **dict(OFF, top_k=k)), x)
    np.testing.assert_array_equal(np.isfinite(chain(x, **dict(OFF, top_k=1))), x == 3.0)
    # Fewer than k finite values: the k-th is -inf and nothing more is removed.
    y = np.float32([-np.inf, 1.0, -np.inf, 0.5])
    np.testing.assert_array_equal(np.array(top_k_filter(mx.array(y[None]), 3))[0], y)


def test_top_p_drops_the_tail_at_or_below_one_minus_p_and_keeps_the_max():
    x = np.log(np.float32([0.1, 0.5, 0.15, 0.25]))
    # Ascending: 0.1, 0.15, 0.25, 0.5 -> cumulative 0.1, 0.25, 0.5, 1.0; p = 0.8 drops those <= 0.2.
    np.testing.assert_array_equal(np.isfinite(chain(x, **dict(OFF, top_p=0.8))), [False, True, True, True])
    np.testing.assert_array_equal(np.isfinite(chain(x, **dict(OFF, top_p=0.0))), [False, True, False, False])
    np.testing.assert_array_equal(chain(x, **dict(OFF, top_p=1.0)), x)


def test_repetition_penalty_comes_last_on_each_seen_id_once():
    x = np.float32([2.0, -1.0, 0.5, 3.0, -4.0])
    out = chain(x, seen=[0, 1, 1, 4], **dict(OFF, temperature=0.5, repetition_penalty=2.0))
    t = x / np.float32(0.5)
    np.testing.assert_allclose(out, [t[0] / 2, t[1] * 2, t[2], t[3], t[4] * 2], rtol=1e-6)
    # After top_k the dropped ids stay -inf even when seen (-inf·r).
    out = chain(x, seen=[4, 2], **dict(OFF, top_k=2, repetition_penalty=1.5))
    np.testing.assert_array_equal(out, [2.0, -np.inf, -np.inf, 3.0, -np.inf])


def numpy_chain(x: np.ndarray, history: list[int], p: TurboParams) -> np.ndarray:
    """The chain of variants.md §2.8 written out in float64 with sorting, as transformers' processors do."""
    x = x.astype(np.float64)
    if p.temperature > 0 and p.temperature != 1.0:
        x = x / np.float64(np.float32(p.temperature))
    if p.top_k > 0:
        kth = np.sort(x)[::-1][min(p.top_k, len(x)) - 1]
        x = np.where(x < kth, -np.inf, x)
    if p.top_p < 1.0:
        order = np.argsort(x, kind="stable")
        e = np.exp(x[order] - x.max())
        drop = np.cumsum(e / e.sum()) <= 1 - p.top_p
        drop[-1] = False
        x = np.where(np.isin(np.arange(len(x)), order[drop]), -np.inf, x)
    ids = np.unique(history)
    x[ids] = np.where(x[ids] < 0, x[ids] * p.repetition_penalty, x[ids] / p.repetition_penalty)
    return x


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        dict(temperature=1.3, top_k=50, top_p=0.8, repetition_penalty=2.0),
        dict(temperature=0.0, top_k=7000, top_p=0.5, repetition_penalty=1.0),
    ],
)
def test_chain_matches_a_numpy_chain_on_random_logits(knobs):
    rng = np.random.default_rng(7)
    x = (3 * rng.standard_normal(6563)).astype(np.float32)
    history = [START, 17, 17, 4000, 6562]
    p = TurboParams(**knobs)
    ours = chain(x, seen=history, **knobs)
    ref = numpy_chain(x, history, p)
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
    np.testing.assert_allclose(ours[np.isfinite(ours)], ref[np.isfinite(ref)], rtol=1e-6)


def test_draw_turbo_inverse_cdf_and_key():
    x = mx.array(np.float32([[np.log(0.2), -np.inf, np.log(0.5), np.log(0.3)]]))
    for u, expected in ((0.0, 0), (0.19, 0), (0.21, 2), (0.69, 2), (0.71, 3), (0.9999, 3)):
        assert draw_turbo(x, uniform=mx.array(u)).tolist() == [expected]
    drawn = {draw_turbo(x, key=k).item() for k in mx.random.split(mx.random.key(0), 200)}
    assert drawn == {0, 2, 3}
    with pytest.raises(ValueError, match="exactly one"):
        draw_turbo(x)
    with pytest.raises(ValueError, match="exactly one"):
        draw_turbo(x, key=mx.random.key(0), uniform=mx.array(0.5))


# --- the decode loop ---


def reference_loop(model, voice, text, p: TurboParams, uniforms: np.ndarray) -> list[int]:
    """``T3.inference_turbo`` step by step, without pipelining or compilation: history [start] for the first
    token, then the generated ids; no EOS check on the first token; stop at EOS; at most 1 + n tokens. The
    final EOS is kept, as ``generate_turbo_tokens`` yields it."""
    v = model.config.speech_vocab_size

    def pick(logits, history, u):
        seen = mx.array(np.isin(np.arange(v), history)[None])
        x = process_turbo_logits(logits, seen, p)
        if bool(mx.all(x == -mx.inf)):
            return None
        return draw_turbo(x, uniform=mx.array(u)).item()

    logits, cache = model.prefill(embeds(model, voice, text))
    tokens = [pick(logits, [START], uniforms[0])]
    for i in range(p.max_new_tokens):
        logits, cache.kv = model.decode(
            mx.array(tokens[-1:]), mx.array(cache.claim(), dtype=mx.int32), cache.kv
        )
        t = pick(logits, tokens, uniforms[i + 1])
        if t is None:
            break
        tokens.append(t)
        if t == STOP:
            break
    return tokens


def with_stop_bias(model, bias: float) -> T3Turbo:
    """The model with its stop logit raised by ``bias`` (through ``update``, which drops compiled steps)."""
    b = model.speech_head.bias
    model.update({"speech_head": {"bias": b + bias * (mx.arange(b.shape[0]) == STOP)}})
    return model


@pytest.mark.parametrize("stop_bias", [0.0, 4.0, 30.0])
def test_pipelined_loop_equals_the_step_by_step_loop(model, voice, stop_bias):
    model = with_stop_bias(model, stop_bias)
    p = TurboParams(max_new_tokens=25)
    uniforms = np.random.default_rng(11).random(26).astype(np.float32)
    ours = list(generate_turbo_tokens(model, voice, TEXT, p, uniforms=mx.array(uniforms)))
    ref = reference_loop(model, voice, TEXT, p, uniforms)
    assert ours == ref
    if stop_bias == 0.0:
        assert len(ours) == 26 and STOP not in ours  # the cap: 1 + max_new_tokens
    elif stop_bias == 30.0:
        assert ours == [STOP, STOP]  # a first EOS is fed back, not taken as a stop
    else:
        assert STOP in ours[1:] and ours[-1] == STOP


def test_stop_on_eos_false_runs_to_the_cap_and_keys_are_reproducible(model, voice):
    model = with_stop_bias(model, 4.0)
    p = TurboParams(max_new_tokens=12)
    full = list(generate_turbo_tokens(model, voice, TEXT, p, key=mx.random.key(5), stop_on_eos=False))
    assert len(full) == 13
    again = list(generate_turbo_tokens(model, voice, TEXT, p, key=mx.random.key(5), stop_on_eos=False))
    assert again == full
    stopped = list(generate_turbo_tokens(model, voice, TEXT, p, key=mx.random.key(5)))
    assert stopped == full[: len(stopped)]
    assert len(list(generate_turbo_tokens(model, voice, TEXT, TurboParams(max_new_tokens=0)))) == 1


class DeadAfter(T3Turbo):
    """A model whose logits are all -inf from buffer position ``dead_from`` on."""

    dead_from = 10**9

    def prefill(self, embeds, cache_step=256):
        logits, cache = super().prefill(embeds, cache_step)
        return (logits if embeds.shape[1] < self.dead_from else logits - mx.inf), cache

    def decode(self, token, position, kv):
        logits, kv = super().decode(token, position, kv)
        return mx.where(position >= self.dead_from, -mx.inf, logits), kv


def test_all_minus_inf_logits_stop_before_drawing(weights, voice):
    model = load(TINY, weights)
    model.__class__ = DeadAfter
    length = 1 + 20 + len(TEXT) + 1
    model.dead_from = length + 3  # the 4th fed token, which would draw token 5
    p = TurboParams(max_new_tokens=20)
    uniforms = mx.array(np.random.default_rng(2).random(21).astype(np.float32))
    tokens = list(generate_turbo_tokens(model, voice, TEXT, p, uniforms=uniforms))
    assert len(tokens) == 4
    model.dead_from = 0
    with pytest.raises(RuntimeError, match="first speech token"):
        list(generate_turbo_tokens(model, voice, TEXT, p, uniforms=uniforms))


def test_requests_the_model_cannot_take_are_refused(model, voice):
    p = TurboParams(max_new_tokens=10)
    with pytest.raises(ValueError, match="text id 300"):
        list(generate_turbo_tokens(model, voice, [1, 300], p))
    # 1 + 20 + 481 + 1 prefill positions + 10 fed tokens: 513 > 512.
    list(generate_turbo_tokens(model, voice, [1] * 480, p, stop_on_eos=False))
    with pytest.raises(ValueError, match="exceed"):
        list(generate_turbo_tokens(model, voice, [1] * 481, p))
    with pytest.raises(ValueError, match="at most 375"):
        list(generate_turbo_tokens(model, random_voice(prompt_len=376), TEXT, p))
    with pytest.raises(ValueError, match=r"shape \(11,\)"):
        list(generate_turbo_tokens(model, voice, TEXT, p, uniforms=mx.zeros((10,))))
    with pytest.raises(ValueError, match="not both"):
        make_draws(11, mx.random.key(0), mx.zeros((11,)))


def test_postprocess_keeps_speech_codes_and_appends_three_silences():
    assert postprocess_tokens([6562, 5, 6561, 6560, 0, 6562]) == [5, 6560, 0, S3GEN_SIL, S3GEN_SIL, S3GEN_SIL]
    assert postprocess_tokens([]) == [4299, 4299, 4299]


def test_softmax_of_processed_logits_is_a_distribution():
    x = mx.array((3 * np.random.default_rng(0).standard_normal((1, 6563))).astype(np.float32))
    probs = np.array(softmax(process_turbo_logits(x, mx.zeros(x.shape, mx.bool_), TurboParams()))[0])
    assert abs(probs.sum() - 1) < 1e-5 and (probs > 0).sum() <= 1000
    assert np.array_equal(np.array(top_p_filter(x, 1.0)), np.array(x))


# --- TurboSpeech: how TTS drives Turbo and Nano ---


def test_turbo_speech_adapter(model, voice, tmp_path):
    from mlx_chatterbox.generation.turbo import TurboSpeech
    from mlx_chatterbox.models.campplus import CAMPPlus
    from mlx_chatterbox.models.s3tokenizer import S3Tokenizer
    from mlx_chatterbox.models.voice_encoder import VoiceEncoder
    from mlx_chatterbox.text import GPT2Tokenizer, turbo_punc_norm
    from tests.conftest import TINY_MODEL
    from tests.toy_gpt2_tokenizer import write_toy_gpt2_tokenizer

    tokenizer = GPT2Tokenizer.from_folder(write_toy_gpt2_tokenizer(tmp_path / "tok"))
    speech = TurboSpeech(model, tokenizer)
    assert (speech.variant, speech.params_type, speech.tail) == ("turbo", TurboParams, (S3GEN_SIL,) * 3)
    assert speech.text_ids("hello there [laugh]") == tokenizer.encode(turbo_punc_norm("hello there [laugh]"))
    # 1 + 375 + N + 1 + 1000 positions against the tiny model's 512.
    assert not speech.fits([1]) and TurboSpeech(T3Turbo(TURBO), tokenizer).fits([1] * 6000)
    speech.check(TurboParams(max_new_tokens=509))
    with pytest.raises(ValueError, match="^max_new_tokens=510"):
        speech.check(TurboParams(max_new_tokens=510))
    # A first-token EOS is not a stop: left out here, so that callers may stop at any stop id they see.
    with_stop_bias(model, 40.0)
    p = TurboParams(max_new_tokens=10)
    raw = list(generate_turbo_tokens(model, voice, TEXT, p, key=mx.random.key(1)))
    assert raw == [STOP, STOP]
    assert list(speech.tokens(voice, TEXT, p, key=mx.random.key(1))) == [STOP]
    assert speech.finish([STOP]) == speech.finish(raw) == [S3GEN_SIL] * 3
    cloner = speech.cloner(
        VoiceEncoder(TINY_MODEL.voice_encoder),
        S3Tokenizer(TINY_MODEL.s3tokenizer),
        CAMPPlus(TINY_MODEL.campplus),
    )
    assert (cloner.t3_prompt_len, cloner.t3_prompt_seconds, cloner.target_lufs) == (375, 15.0, -27.0)
