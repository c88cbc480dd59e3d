"""Continuous batching over Turbo's GPT-2 T3 (generation/turbo_batch.py) on a tiny random model: each request's
tokens are the tokens it gets alone through ``generate_turbo_tokens``, whatever joins or leaves the batch around
it (no torch)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_chatterbox.generation.batch import BatchRequest
from mlx_chatterbox.generation.turbo import generate_turbo_tokens
from mlx_chatterbox.generation.turbo_batch import NO_TOKEN, TurboTokenBatch
from mlx_chatterbox.models.cache import BatchKVCache
from mlx_chatterbox.models.gpt2 import T3Turbo, T3TurboConfig
from mlx_chatterbox.sampling import (
    SamplingParams,
    TurboParams,
    draw_turbo,
    draw_turbo_rows,
    process_turbo_logits,
    process_turbo_rows,
    turbo_row_knobs,
)
from tests.conftest import random_voice
from tests.test_batch import closed_loop, count_calls, traced_shapes

TINY = T3TurboConfig(hidden_size=64, num_layers=2, num_heads=4, n_positions=512, text_vocab_size=300)


def random_model(cfg: T3TurboConfig = TINY, seed: int = 0) -> T3Turbo:
    """LayerNorm weights near 1 and every bias non-zero, so that no term hides as an identity."""
    model, rng = T3Turbo(cfg), np.random.default_rng(seed)
    weights = []
    for name, p in tree_flatten(model.parameters()):
        noise = rng.standard_normal(p.shape).astype(np.float32)
        if ".ln_" in name and name.endswith("weight"):
            w = 1 + 0.1 * noise
        elif name.endswith(("emb.weight", "wpe.weight")):
            w = 0.5 * noise
        else:
            w = 0.1 * noise
        weights.append((name, mx.array(w)))
    model.update(tree_unflatten(weights))
    return model


def like(model: T3Turbo, **changes) -> T3Turbo:
    """The same weights under a config with ``changes`` (e.g. another stop id)."""
    other = T3Turbo(dataclasses.replace(model.config, **changes))
    other.update(model.parameters())
    return other


@pytest.fixture(scope="module")
def model() -> T3Turbo:
    return random_model()


def alone(model: T3Turbo, request: BatchRequest, stop_on_eos: bool = True) -> list[int]:
    return list(
        generate_turbo_tokens(
            model,
            request.voice,
            request.text_ids,
            request.params,
            key=request.key,
            uniforms=request.uniforms,
            stop_on_eos=stop_on_eos,
        )
    )


def uniforms(n: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).random(n).astype(np.float32))


def requests() -> list[BatchRequest]:
    """Different texts and prompts (prefills of 28 to 397 positions), knobs, draw kinds and lengths."""
    return [
        BatchRequest([5, 17, 42, 2, 99], random_voice(1, prompt_len=150), TurboParams(max_new_tokens=12),
                     uniforms=uniforms(13, 1)),
        BatchRequest(list(range(3, 12)), random_voice(2, prompt_len=40),
                     TurboParams(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0, max_new_tokens=8),
                     key=mx.random.key(2)),
        BatchRequest([9, 8, 7], random_voice(3, prompt_len=75),
                     TurboParams(temperature=1.3, top_k=50, top_p=0.8, repetition_penalty=2.0, max_new_tokens=15),
                     key=mx.random.key(3)),
        BatchRequest([30, 31, 32, 33], random_voice(4, prompt_len=10),
                     TurboParams(temperature=0.5, top_k=7000, top_p=0.5, max_new_tokens=10), uniforms=uniforms(11, 4)),
        BatchRequest([44] * 20, random_voice(5, prompt_len=375), TurboParams(top_k=3, max_new_tokens=9),
                     key=mx.random.key(5)),
        BatchRequest([1, 2], random_voice(6, prompt_len=25), TurboParams(top_p=0.0, max_new_tokens=0),
                     uniforms=uniforms(1, 6)),
    ]  # fmt: skip


def run_batch(
    model: T3Turbo, joins: dict[int, list[BatchRequest]], stop_on_eos: bool = True, window_size: int = 32
) -> dict[int, list]:
    """Add ``joins[k]`` before step k; step until every request has finished. Returns each request's tokens by
    its place in the join order."""
    batch, tokens, order, k = TurboTokenBatch(model, stop_on_eos, window_size), {}, [], 0
    while k in joins or len(batch) or k < max(joins):
        for request in joins.get(k, []):
            order.append(batch.add(request))
        for uid, token, finished in batch.step():
            assert uid not in tokens or not tokens[uid][1], "a finished request came back"
            tokens.setdefault(uid, [[], False])[0].append(token)
            tokens[uid][1] = finished
        k += 1
    assert all(done for _, done in tokens.values())
    return {i: tokens[uid][0] for i, uid in enumerate(order)}


# --- the per-row chain and draws (sampling.py) ---


@pytest.mark.parametrize("kinds", [(True, True), (True, False), (False, True)])
def test_the_row_chain_and_draws_are_the_scalar_ones_row_for_row(kinds):
    """Six rows with six knob sets (top_p 0.95 among them: 1 - top_p rounded from the double, as the scalar
    chain compares) against ``process_turbo_logits`` and ``draw_turbo`` row by row: bit for bit."""
    rng = np.random.default_rng(0)
    params = [
        TurboParams(),
        TurboParams(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0),
        TurboParams(temperature=1.3, top_k=50, top_p=0.8, repetition_penalty=2.0),
        TurboParams(temperature=0.5, top_k=7000, top_p=0.5, repetition_penalty=0.7),
        TurboParams(temperature=1.0, top_k=1, top_p=0.0),
        TurboParams(temperature=2.0, top_k=6563, top_p=0.999),
    ]
    v = TINY.speech_vocab_size
    logits = mx.array((3 * rng.standard_normal((len(params), v))).astype(np.float32))
    seen = mx.array(rng.random((len(params), v)) < 0.01)
    keys = mx.random.split(mx.random.key(1), len(params))
    us = mx.array(rng.random(len(params)).astype(np.float32))
    by_uniform = mx.array(
        [i % 2 == 1 for i in range(len(params))] if all(kinds) else [kinds[1]] * len(params)
    )
    rows = process_turbo_rows(logits, seen, turbo_row_knobs(params))
    drawn = draw_turbo_rows(rows, keys, us, by_uniform, kinds=kinds).tolist()
    for i, p in enumerate(params):
        alone = process_turbo_logits(logits[i : i + 1], seen[i : i + 1], p)
        assert mx.array_equal(rows[i : i + 1], alone, equal_nan=True), f"row {i}"
        d = draw_turbo(alone, uniform=us[i]) if by_uniform[i].item() else draw_turbo(alone, key=keys[i])
        assert drawn[i] == d.item(), f"row {i}"
    # Rows that skip a filter (no row uses it) keep the same numbers.
    plain = params[1:2] * 2
    knobs = turbo_row_knobs(plain)
    skipped = process_turbo_rows(logits[:2], seen[:2], knobs, top_k=False, top_p=False)
    assert mx.array_equal(skipped, process_turbo_rows(logits[:2], seen[:2], knobs))


# --- the network: left-padded prefill, padded and windowed decode (models/gpt2.py) ---


def prefills(model: T3Turbo) -> list[mx.array]:
    out = []
    for seed, prompt_len, text in [(1, 150, [5, 6, 7]), (2, 20, list(range(40)))]:
        voice = random_voice(seed, prompt_len=prompt_len)
        out.append(model.prepare_input_embeds(voice.speaker_emb, voice.t3_prompt_tokens, mx.array([text])))
    return out


def test_left_padded_prefill_matches_each_request_alone(model):
    """Requests of different lengths prefilled together, left-padded to the longest (``TurboTokenBatch`` admits
    its waiting requests so): each row's logits and keys/values against its request prefilled alone."""
    embeds = prefills(model)
    n = max(e.shape[1] for e in embeds)
    pad = [n - e.shape[1] for e in embeds]
    assert pad == [0, 93]  # 1 + 150 + 3 + 1 against 1 + 20 + 40 + 1 positions
    x = mx.concatenate([mx.pad(e, [(0, 0), (n - e.shape[1], 0), (0, 0)]) for e in embeds][::-1])
    logits, cache = model.prefill(x, pad=mx.array(pad[::-1], dtype=mx.int32))
    errors = []
    for row, e in zip((1, 0), embeds):
        length = e.shape[1]
        alone_logits, alone_cache = model.prefill(e)
        errors.append(float(mx.abs(logits[row] - alone_logits[0]).max() / mx.abs(alone_logits).max()))
        for a, b in zip(cache.kv, alone_cache.kv):
            a, b = a[row, :, n - length : n], b[0, :, :length]
            errors.append(float(mx.abs(a - b).max() / mx.abs(b).max()))
    assert max(errors) < 1e-5, errors
    assert all(bool(mx.isfinite(a).all()) for a in cache.kv)  # the padding's keys and values too


def right_aligned(model: T3Turbo, window_size: int = 32) -> tuple[BatchKVCache, list]:
    """Two requests' prefills right-aligned in one cache, and each one's own cache."""
    caches, own = [], []
    for e in prefills(model):
        _, cache = model.prefill(e)
        own.append(cache)
        caches.append(BatchKVCache.from_cache(cache, window_size))
    caches[0].extend(caches[1])
    return caches[0], own


def test_left_padded_decode_matches_each_row_alone(model):
    """Decode steps of two rows of different prefill lengths, right-aligned in a ``BatchKVCache`` (wpe at
    position index - pad), against each row decoded alone."""
    batch, own = right_aligned(model)
    assert batch.pad == [0, 93]
    pad, kv, rng = mx.array(batch.pad, dtype=mx.int32), batch.kv, np.random.default_rng(0)
    for _ in range(3):
        token = mx.array(rng.integers(0, 6561, 2), dtype=mx.int32)
        position = mx.array(batch.claim(), dtype=mx.int32)
        logits, kv = model.decode(token, position, kv, pad)
        for row, cache in enumerate(own):
            expected, cache.kv = model.decode(
                token[row : row + 1], mx.array(cache.claim(), dtype=mx.int32), cache.kv
            )
            err = float(mx.abs(logits[row] - expected[0]).max() / mx.abs(expected).max())
            assert err < 1e-5, err


def test_windowed_decode_matches_the_padded_decode_across_flushes(model):
    """``T3Turbo.decode_window`` (attention written out over big buffers + window) against ``T3Turbo.decode``
    (sdpa over one buffer written at every step) on the same rows, for 11 steps of a 4-position window: two
    full flushes and a partly filled window."""
    cache, _ = right_aligned(model, window_size=4)
    pad, rng = mx.array(cache.pad, dtype=mx.int32), np.random.default_rng(0)
    reference, errors, bases = list(cache.kv), [], []
    for _ in range(11):
        token = mx.array(rng.integers(0, 6561, 2), dtype=mx.int32)
        position = cache.claim()
        bases.append(cache.base)
        at = mx.array([position, cache.base], dtype=mx.int32)
        logits, cache.window = model.decode_window(token, at[0] - pad, at, pad, cache.kv, cache.window)
        expected, reference = model.decode(token, mx.array(position, dtype=mx.int32), reference, pad)
        errors.append(float(mx.abs(logits - expected).max() / mx.abs(expected).max()))
    start = bases[0]
    assert bases == [start] * 4 + [start + 4] * 4 + [start + 8] * 3  # flushed when full, not before
    assert max(errors) < 1e-5, errors
    cache.flush()
    written = slice(0, cache.offset)
    for i, (a, b) in enumerate(zip(cache.kv, reference)):
        a, b = a[:, :, written], b[:, :, written]
        assert mx.array_equal(a, b) if i < 2 else mx.allclose(a, b, rtol=1e-5, atol=1e-6), f"buffer {i}"


# --- the engine ---


def test_requests_decoded_together_get_the_tokens_they_get_alone(model):
    reqs = requests()
    got = run_batch(model, {0: reqs})
    for i, request in enumerate(reqs):
        assert got[i] == alone(model, request), f"request {i}"
        assert len(got[i]) == 1 + request.params.max_new_tokens  # random weights do not stop here


def test_requests_join_and_leave_between_steps(model):
    """Requests join a running batch (with shorter and longer prefills than it has), others leave after their
    last token, and the batch empties and fills again."""
    a, b, c, d, e, f = requests()
    g = dataclasses.replace(a, text_ids=list(range(60)), key=mx.random.key(6), uniforms=None)
    order = [b, c, g, a, f, d, e, b]
    got = run_batch(model, {0: [b, c], 2: [g], 3: [a, f], 5: [d], 9: [e], 30: [b]})
    for i, request in enumerate(order):
        assert got[i] == alone(model, request), f"request {i}"


@pytest.mark.parametrize("window_size", [4, 5])
def test_requests_get_their_tokens_alone_across_flushes_joins_and_leaves(model, window_size):
    a, b, c, d, e, f = requests()
    joins = {0: [b, c], 2: [a], 3: [f, e], 6: [d], 10: [b]}
    got = run_batch(model, joins, window_size=window_size)
    for i, request in enumerate([b, c, a, f, e, d, b]):
        assert got[i] == alone(model, request), f"request {i}"


def test_a_request_replacing_a_finished_one_takes_its_slot(model, monkeypatch):
    """As tests/test_batch.py's: a closed loop of 3 requests at a time, newcomers' prefills no longer than the
    batch's: each takes a dead slot, the step is traced for 3 slots and then 1 (draining), and every request
    gets its tokens alone."""
    counted = like(model)
    shapes = traced_shapes(counted)
    a, b, c, d, *_ = requests()  # prefills of 157, 51, 80 and 16 positions
    queue = [
        dataclasses.replace(r, params=dataclasses.replace(c.params, max_new_tokens=n), key=mx.random.key(i),
                            uniforms=None)
        for i, (r, n) in enumerate(zip([a, b, c, d, b, c, d, b], [9, 12, 15, 7, 10, 13, 8, 11]))
    ]  # fmt: skip
    calls = count_calls(monkeypatch, BatchKVCache, ["put", "extend", "keep"])
    got = closed_loop(TurboTokenBatch(counted), queue, 3)
    for i, request in enumerate(queue):
        assert got[i] == alone(model, request), f"request {i}"
    assert [s[0] for s in shapes] == [3, 1]
    assert calls["put"] >= 3 and calls["extend"] == 0 and calls["keep"] == 1


def test_requests_with_longer_prefills_than_the_batch_come_and_go(model, monkeypatch):
    """A closed loop of 2 at a time over prefills of 16 to 397 positions: newcomers take dead slots where
    their prefill fits and join beside the others where not."""
    again = [
        dataclasses.replace(r, key=mx.random.key(20 + i), uniforms=None) for i, r in enumerate(requests()[:5])
    ]
    queue = requests()[:5] + again
    calls = count_calls(monkeypatch, BatchKVCache, ["put", "extend"])
    got = closed_loop(TurboTokenBatch(model), queue, 2)
    for i, request in enumerate(queue):
        assert got[i] == alone(model, request), f"request {i}"
    assert calls["put"] and calls["extend"]  # both ways in


def test_a_stop_token_ends_a_row_but_never_as_the_first_token(model):
    a, b, c, *_ = requests()
    free = alone(model, c, stop_on_eos=False)  # keyed draws: the same ids whatever the stop id
    k = next(k for k in range(2, len(free)) if free[k] not in free[:k])
    stopping = like(model, stop_speech_token=free[k])
    got = run_batch(stopping, {0: [a, c, b]})
    assert got[1] == alone(stopping, c) == free[: k + 1]
    assert got[0] == alone(stopping, a) and got[2] == alone(stopping, b)
    assert run_batch(stopping, {0: [a, c, b]}, stop_on_eos=False)[1] == free
    # The first token as the stop id: fed back, not a stop (upstream checks from the second token on).
    first = like(model, stop_speech_token=free[0])
    expected = alone(first, c)
    assert len(expected) > 1 and expected == free[: len(expected)]
    assert run_batch(first, {0: [a, c]})[1] == expected


class DeadFrom(T3Turbo):
    """A model whose logits are all -inf from absolute position ``dead_from`` on (prefill: for rows that long)."""

    dead_from = 10**9

    def prefill(self, embeds, cache_step=256, pad=None):
        logits, cache = super().prefill(embeds, cache_step, pad)
        length = embeds.shape[1] - (mx.zeros(embeds.shape[:1], mx.int32) if pad is None else pad)
        return mx.where((length >= self.dead_from)[:, None], -mx.inf, logits), cache

    def decode(self, token, position, kv, pad=None):
        logits, kv = super().decode(token, position, kv, pad)
        return mx.where(position >= self.dead_from, -mx.inf, logits), kv

    def decode_window(self, token, positions, at, pad, kv, window):
        logits, window = super().decode_window(token, positions, at, pad, kv, window)
        return mx.where((positions >= self.dead_from)[:, None], -mx.inf, logits), window


def test_a_step_with_nothing_to_draw_ends_only_its_request(model):
    """Request a (157 prefill positions) has nothing to draw at its token 4, e (397 positions) at its first,
    d (16 positions) and b (51) only past their budgets: a ends after 4 tokens as alone, e at once (alone
    raises), d and b run on."""
    a, b, _, d, e, _ = requests()
    dead = like(model)
    dead.__class__ = DeadFrom
    dead.dead_from = 1 + 150 + 5 + 1 + 3  # a's 4th fed token, which would draw its token 4
    got = run_batch(dead, {0: [a, e, d, b]})
    # The request's end is reported as a NO_TOKEN, finished, in the step that finds nothing to draw.
    assert got[0] == alone(dead, a) + [NO_TOKEN] and len(got[0]) == 5
    assert got[1] == [NO_TOKEN]
    with pytest.raises(RuntimeError, match="first speech token"):
        alone(dead, e)
    assert got[2] == alone(dead, d) == alone(model, d) and got[3] == alone(dead, b) == alone(model, b)


def test_the_last_position_of_the_table(model):
    """A request that fills the wpe table exactly (502 prefill positions + 10 fed tokens = 512), beside a short
    one: the unread step after its last token would be past the table and reads in bounds."""
    long = BatchRequest([1] * 480, random_voice(7, prompt_len=20), TurboParams(max_new_tokens=10),
                        key=mx.random.key(7))  # fmt: skip
    short = requests()[2]
    got = run_batch(model, {0: [long, short]}, stop_on_eos=False)
    assert got[0] == alone(model, long, stop_on_eos=False) and len(got[0]) == 11
    assert got[1] == alone(model, short, stop_on_eos=False)


def test_the_cache_grows_past_256_positions_with_the_window(model):
    """A ~97-position prefill decoding 170 tokens crosses the first 256-position capacity; a request joins at
    step 100 (mid-window) and leaves 11 steps later (mid-window) around it."""
    a, _, _, d, _, _ = requests()
    long = dataclasses.replace(a, text_ids=list(range(60)), params=TurboParams(max_new_tokens=170),
                               uniforms=uniforms(171, 7))  # fmt: skip
    long = dataclasses.replace(long, voice=random_voice(8, prompt_len=35))
    got = run_batch(model, {0: [long], 100: [d]}, stop_on_eos=False, window_size=16)
    assert got[0] == alone(model, long, stop_on_eos=False)
    assert got[1] == alone(model, d, stop_on_eos=False)


def test_window_flushes_do_not_retrace_the_step(model):
    """The token's buffer index and the window's base are values of one int32 array: a batch whose rows and
    capacity do not change is traced once however often its window is flushed."""
    counted, traces = like(model), []

    def decode_window(*args):
        traces.append(args[2].shape)  # runs only while mx.compile traces
        return T3Turbo.decode_window(counted, *args)

    counted.decode_window = decode_window
    run_batch(counted, {0: [requests()[1]]}, window_size=2)  # 9 tokens: 3 flushes
    assert len(traces) == 1


def test_cancelled_requests_leave_and_the_rest_are_unchanged(model):
    a, b, c, d, *_ = requests()
    batch = TurboTokenBatch(model)
    uids = [batch.add(r) for r in (a, b, c)]
    waiting = batch.add(d)
    batch.cancel(waiting)  # never decoded
    tokens = {u: [] for u in uids}
    for uid, token, _ in batch.step() + batch.step():
        tokens[uid].append(token)
    batch.cancel(uids[1])  # mid-decode
    with pytest.raises(KeyError, match="not in the batch"):
        batch.cancel(uids[1])
    while len(batch):
        for uid, token, _ in batch.step():
            assert uid != uids[1]
            tokens[uid].append(token)
    assert tokens[uids[0]] == alone(model, a) and tokens[uids[2]] == alone(model, c)
    assert tokens[uids[1]] == alone(model, b)[:2]


def test_bad_requests_are_refused_when_added(model):
    batch = TurboTokenBatch(model)
    voice = random_voice(prompt_len=20)
    p = TurboParams(max_new_tokens=10)
    with pytest.raises(ValueError, match="text id 300"):
        batch.add(BatchRequest([1, 300], voice, p))
    with pytest.raises(ValueError, match="exceed"):
        batch.add(BatchRequest([1] * 481, voice, p))  # 503 prefill positions + 10 > 512
    with pytest.raises(ValueError, match="at most 375"):
        batch.add(BatchRequest([5], random_voice(prompt_len=376), p))
    with pytest.raises(ValueError, match=r"shape \(11,\)"):
        batch.add(BatchRequest([5], voice, p, uniforms=uniforms(10, 0)))
    with pytest.raises(ValueError, match="not both"):
        batch.add(BatchRequest([5], voice, p, key=mx.random.key(0), uniforms=uniforms(11, 0)))
    with pytest.raises(TypeError, match="takes TurboParams"):
        batch.add(BatchRequest([5], voice, SamplingParams(max_new_tokens=10)))
    assert len(batch) == 0 and batch.step() == []
    with pytest.raises(ValueError, match="window_size must be at least 1"):
        TurboTokenBatch(model, window_size=0)
