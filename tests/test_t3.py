"""T3 on a tiny random config: cache vs full recompute, batch independence, shapes (no torch)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_chatterbox.generation.speech_tokens import prefill_embeds
from mlx_chatterbox.models.t3 import T3Cond

TEXT = [5, 17, 42, 2, 99, 7]


def cond(voice, exaggeration=0.5):
    return T3Cond(voice.speaker_emb, voice.t3_prompt_tokens, exaggeration)


def test_cached_decode_equals_full_recompute(tiny_t3, voice):
    """Logits from prefill + one-token cached steps equal a single causal pass over the whole sequence, with
    the cache growing past its step on the way, eagerly and compiled."""
    model = tiny_t3
    feed = [100, 2000, 6000, 31, 4242, 7, 8]
    embeds = prefill_embeds(model, cond(voice), TEXT, cfg_weight=0.5)
    steps = [model.embed_speech(mx.array([[tok], [tok]]), start=i + 1) for i, tok in enumerate(feed)]
    full = model.speech_head(model.tfmr(mx.concatenate([embeds, *steps], axis=1)))
    full = full[:, embeds.shape[1] - 1 :]
    for decode in (model.decode, mx.compile(model.decode)):
        logits, cache = model.prefill(embeds, cache_step=embeds.shape[1] + 3)
        cached = [logits]
        for i, tok in enumerate(feed):
            logits, cache.kv = decode(
                mx.array([tok, tok]), mx.array(i + 1), mx.array(cache.claim()), cache.kv
            )
            cached.append(logits)
        assert cache.offset == embeds.shape[1] + len(feed) and cache.capacity == 2 * cache.step
        for i, logits in enumerate(cached):
            np.testing.assert_allclose(np.array(logits), np.array(full[:, i]), rtol=1e-4, atol=1e-5)


def test_cache_grows_by_whole_steps_and_keeps_what_it_holds():
    from mlx_chatterbox.models.cache import KVCache

    k = mx.arange(2 * 3 * 3 * 2, dtype=mx.float32).reshape(2, 3, 3, 2)
    cache = KVCache.from_prefill([k, -k], step=4)
    assert cache.offset == 3 and cache.capacity == 4
    cache.reserve(4)
    assert cache.capacity == 4
    cache.reserve(9)
    assert cache.capacity == 12
    np.testing.assert_array_equal(np.array(cache.kv[0][:, :, :3]), np.array(k))
    np.testing.assert_array_equal(np.array(cache.kv[1][:, :, :3]), -np.array(k))
    assert not np.array(cache.kv[0][:, :, 3:]).any()


def test_batch_rows_are_independent(tiny_t3, voice):
    model = tiny_t3
    one = prefill_embeds(model, cond(voice), TEXT, cfg_weight=0.0)
    two = prefill_embeds(model, cond(voice), TEXT, cfg_weight=0.5)
    assert one.shape[0] == 1 and two.shape[0] == 2
    # The conditional row of the CFG batch is the batch-1 prefill; the unconditional row differs only in text.
    np.testing.assert_array_equal(np.array(two[0]), np.array(one[0]))
    logits_one, _ = model.prefill(one)
    logits_two, _ = model.prefill(two)
    np.testing.assert_allclose(np.array(logits_two[0]), np.array(logits_one[0]), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.array(logits_two[1]), np.array(logits_one[0]))


def test_prefill_layout(tiny_t3, voice):
    model = tiny_t3
    cfg = model.config
    embeds = prefill_embeds(model, cond(voice), TEXT, cfg_weight=0.5)
    # [cond (1 + 32 + 1) | SOT text EOT | BOS | BOS]
    assert embeds.shape == (2, 34 + len(TEXT) + 2 + 2, cfg.hidden_size)
    bos = np.array(model.speech_emb.weight[cfg.start_speech_token] + model.speech_pos_emb.weight[0])
    np.testing.assert_array_equal(np.array(embeds[0, -1]), bos)
    np.testing.assert_array_equal(np.array(embeds[1, -2]), bos)
    # CFG zeroes the unconditional row's text *token* embeddings but keeps its positions.
    text_start = 34
    np.testing.assert_array_equal(
        np.array(embeds[1, text_start : text_start + len(TEXT) + 2]),
        np.array(model.text_pos_emb.weight[: len(TEXT) + 2]),
    )


def test_without_prompt_tokens_cond_is_speaker_and_emotion_only(tiny_t3, voice):
    c = T3Cond(voice.speaker_emb, None, 0.5)
    assert tiny_t3.embed_cond(c).shape == (1, 2, tiny_t3.config.hidden_size)


def test_teacher_forced_forward_shape_and_causality(tiny_t3, voice):
    text = mx.array([[255, *TEXT, 0]])
    speech = mx.array([[6561, 10, 20, 30]])
    logits = tiny_t3(cond(voice), text, speech)
    assert logits.shape == (1, 4, tiny_t3.config.speech_vocab_size)
    # Position s only sees speech tokens up to s: changing the last token leaves earlier logits alone.
    other = tiny_t3(cond(voice), text, mx.array([[6561, 10, 20, 31]]))
    np.testing.assert_array_equal(np.array(logits[:, :3]), np.array(other[:, :3]))
    assert not np.array_equal(np.array(logits[:, 3]), np.array(other[:, 3]))
