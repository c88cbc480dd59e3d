"""Continuous batching over T3 (generation/batch.py) on a tiny random model: each request's tokens are the tokens
it gets alone, whatever joins or leaves the batch around it (no torch)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from mlx_chatterbox.generation import speech_tokens
from mlx_chatterbox.generation.batch import BatchRequest, ContinuousBatch, SpeechTokenBatch, batch_size
from mlx_chatterbox.generation.speech_tokens import generate_speech_tokens, prefill_embeds
from mlx_chatterbox.models.cache import BatchKVCache
from mlx_chatterbox.models.t3 import T3, T3Cond
from mlx_chatterbox.sampling import SamplingParams
from tests.conftest import random_voice


def alone(model: T3, request: BatchRequest, stop_on_eos: bool = True) -> list[int]:
    return list(
        generate_speech_tokens(
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
    """Different texts (so prefills of different lengths), voices, knobs, draw kinds and lengths."""
    return [
        BatchRequest([5, 17, 42, 2, 99], random_voice(1, prompt_len=150), SamplingParams(max_new_tokens=12),
                     uniforms=uniforms(12, 1)),
        BatchRequest(list(range(3, 12)), random_voice(2, prompt_len=40),
                     SamplingParams(temperature=0, cfg_weight=0, max_new_tokens=8)),
        BatchRequest([9, 8, 7], random_voice(3, prompt_len=75),
                     SamplingParams(top_p=0.9, min_p=0, repetition_penalty=1.5, cfg_weight=1.0, max_new_tokens=15),
                     key=mx.random.key(3)),
        BatchRequest([30, 31, 32, 33], random_voice(4, prompt_len=10),
                     SamplingParams(exaggeration=0.8, temperature=1.3, max_new_tokens=10), uniforms=uniforms(10, 4)),
        BatchRequest([44] * 20, random_voice(5, prompt_len=150),
                     SamplingParams(temperature=0.5, cfg_weight=0, max_new_tokens=9), key=mx.random.key(5)),
    ]  # fmt: skip


def run_batch(
    model: T3, joins: dict[int, list[BatchRequest]], stop_on_eos: bool = True, window_size: int = 32
) -> dict[int, list]:
    """Add ``joins[k]`` before step k; step until every request has finished. Returns each request's tokens by
    its place in the join order."""
    batch, tokens, order, k = SpeechTokenBatch(model, stop_on_eos, window_size), {}, [], 0
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


def closed_loop(
    batch: ContinuousBatch, queue: list[BatchRequest], at_once: int, sizes: list | None = None
) -> list[list[int]]:
    """``at_once`` requests in the batch, each one that finishes replaced by the next of ``queue`` before the
    next step, as a server's full batch runs. Returns each request's tokens in queue order; ``sizes`` gets the
    cache's (rows, capacity) at each step."""
    uids = [batch.add(r) for r in queue[:at_once]]
    tokens: dict[int, list[int]] = {}
    while len(batch):
        out = batch.step()
        if sizes is not None and batch._cache is not None:
            sizes.append(batch._cache.kv[0].shape[::2])
        for uid, token, finished in out:
            tokens.setdefault(uid, []).append(token)
            if finished and len(uids) < len(queue):
                uids.append(batch.add(queue[len(uids)]))
    return [tokens[u] for u in uids]


def count_calls(monkeypatch, cls: type, names: list[str]) -> dict[str, int]:
    """Calls of ``cls``'s methods ``names``, counted from now on."""
    calls = dict.fromkeys(names, 0)
    for name in names:

        def counted(*args, name=name, method=getattr(cls, name)):
            calls[name] += 1
            return method(*args)

        monkeypatch.setattr(cls, name, counted)
    return calls


def traced_shapes(model):
    """``model`` with its ``decode_window`` counted: the list of the cache shapes it is traced for."""
    shapes, decode_window = [], model.decode_window

    def counted(*args):
        shapes.append(args[4][0].shape)  # runs only while mx.compile traces
        return decode_window(*args)

    model.decode_window = counted
    return shapes


def test_requests_decoded_together_get_the_tokens_they_get_alone(tiny_t3):
    reqs = requests()
    got = run_batch(tiny_t3, {0: reqs})
    for i, request in enumerate(reqs):
        assert got[i] == alone(tiny_t3, request), f"request {i}"
        assert len(got[i]) == request.params.max_new_tokens  # random weights do not stop


def test_requests_join_and_leave_between_steps(tiny_t3):
    """Requests join a running batch (with shorter and longer prefills than it has), others leave after their
    last token, and the batch empties and fills again."""
    a, b, c, d, e = requests()
    f = dataclasses.replace(
        a, text_ids=list(range(60)), key=mx.random.key(6), uniforms=None
    )  # a long prefill
    got = run_batch(tiny_t3, {0: [b, c], 2: [f], 3: [a], 5: [d], 9: [e], 30: [b]})
    for i, request in enumerate([b, c, f, a, d, e, b]):
        assert got[i] == alone(tiny_t3, request), f"request {i}"


def test_a_request_replacing_a_finished_one_takes_its_slot(tiny_t3, monkeypatch):
    """A closed loop of 3 CFG requests at a time, each newcomer's prefill no longer than the batch's: it takes a
    dead slot, so the cache keeps its shape and the step is not traced again until the batch drains to one
    request; every request gets the tokens it gets alone."""
    model = T3(tiny_t3.config)
    model.update(tiny_t3.parameters())
    shapes = traced_shapes(model)
    a, _, c, d, _ = requests()  # prefills of 43, 41 and 42 positions
    # One sampling set-up (one compiled step), other budgets.
    queue = [
        dataclasses.replace(
            r, params=dataclasses.replace(c.params, max_new_tokens=n), key=mx.random.key(i), uniforms=None
        )
        for i, (r, n) in enumerate(zip([a, c, d, c, d, c, d, c], [9, 12, 15, 7, 10, 13, 8, 11]))
    ]
    calls = count_calls(monkeypatch, BatchKVCache, ["put", "extend", "keep"])
    traced = speech_tokens.traces()
    got = closed_loop(SpeechTokenBatch(model), queue, 3)
    assert speech_tokens.traces() - traced == len(shapes)  # the process's count (serve's /metrics) sees them
    for i, request in enumerate(queue):
        assert got[i] == alone(tiny_t3, request), f"request {i}"
    assert [s[0] for s in shapes] == [6, 2]  # 3 slots of a CFG pair; one, draining
    assert calls["put"] >= 3 and calls["extend"] == 0 and calls["keep"] == 1  # the one: draining


def test_requests_of_other_row_counts_and_longer_prefills_come_and_go(tiny_t3, monkeypatch):
    """A closed loop over requests with and without CFG (slots of 2 and 1 rows) and prefills longer than the
    batch's: newcomers take dead slots where they fit and join beside the others where not."""
    again = [r if r.params.greedy else dataclasses.replace(r, key=mx.random.key(20 + i), uniforms=None)
             for i, r in enumerate(requests())]  # fmt: skip
    queue = requests() + again
    calls = count_calls(monkeypatch, BatchKVCache, ["put", "extend"])
    got = closed_loop(SpeechTokenBatch(tiny_t3), queue, 3)
    for i, request in enumerate(queue):
        assert got[i] == alone(tiny_t3, request), f"request {i}"
    assert calls["put"] and calls["extend"]  # both ways in


def test_a_batch_that_never_empties_keeps_its_cache_short(tiny_t3):
    """Newcomers take dead slots right-aligned at the cache's end, so the cache's positions grow with every
    step while the batch runs; the positions before every live row go, 256 at a time. 60 requests of 12 to 21
    tokens, 2 at a time: about 500 steps in one batch, the cache at most 512 positions long throughout."""
    _, b, c, d, _ = requests()
    queue = [
        dataclasses.replace(r, params=dataclasses.replace(c.params, max_new_tokens=12 + i % 10),
                            key=mx.random.key(i), uniforms=None)
        for i, r in enumerate([b, c, d] * 20)
    ]  # fmt: skip
    sizes = []
    got = closed_loop(SpeechTokenBatch(tiny_t3), queue, 2, sizes)
    for i, request in enumerate(queue):
        assert got[i] == alone(tiny_t3, request), f"request {i}"
    assert len(sizes) > 450 and max(capacity for _, capacity in sizes) == 512


def test_batch_sizes():
    """Slots for n requests: n up to 8, then 4 sizes a doubling, never more than a quarter of them idle."""
    sizes = [batch_size(n) for n in range(1, 300)]
    assert sizes[:12] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 10, 12, 12]
    assert sorted(set(sizes))[8:20] == [10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    assert all(n <= s and (s - n) * 4 < s for n, s in zip(range(1, 300), sizes))


def test_a_request_leaves_at_its_stop_token(tiny_t3):
    a, b, c, *_ = requests()
    free = alone(tiny_t3, b, stop_on_eos=False)  # greedy: the same ids with any stop id
    stop = free[3]
    model = T3(dataclasses.replace(tiny_t3.config, stop_speech_token=stop))
    model.update(tiny_t3.parameters())
    got = run_batch(model, {0: [a, b, c]})
    assert got[1] == alone(model, b) == free[: free.index(stop) + 1]
    assert got[0] == alone(model, a) and got[2] == alone(model, c)
    assert run_batch(model, {0: [a, b, c]}, stop_on_eos=False)[1] == free


def test_left_padded_decode_matches_each_row_alone(tiny_t3):
    """One decode step of two rows of different prefill lengths, right-aligned in a ``BatchKVCache``, against
    each row decoded alone."""
    model, caches, alone_logits = tiny_t3, [], []
    for seed, prompt_len, text in [(1, 150, [5, 6, 7]), (2, 20, list(range(40)))]:
        voice = random_voice(seed, prompt_len=prompt_len)
        cond = T3Cond(voice.speaker_emb, voice.t3_prompt_tokens, 0.5)
        _, cache = model.prefill(prefill_embeds(model, cond, text, 0.5))
        position = mx.array(cache.claim(), dtype=mx.int32)
        logits, _ = model.decode(mx.array([7, 7]), mx.array(1, dtype=mx.int32), position, cache.kv)
        alone_logits.append(logits)
        cache.offset -= 1  # unclaim: the batch claims it again
        caches.append(BatchKVCache.from_cache(cache))
    batch = caches[0]
    batch.extend(caches[1])
    assert batch.pad == [37, 37, 0, 0]  # the first pair's prefill is 37 positions shorter than the second's
    position = mx.array(batch.claim(), dtype=mx.int32)
    pad = mx.array(batch.pad, dtype=mx.int32)
    logits, _ = model.decode(mx.array([7, 7, 7, 7]), mx.array(1, dtype=mx.int32), position, batch.kv, pad)
    expected = mx.concatenate(alone_logits)
    err = float(mx.abs(logits - expected).max() / mx.abs(expected).max())
    assert err < 1e-5, err


@pytest.mark.parametrize(
    "mine,theirs,capacity",
    [
        ((41, 256), (40, 256), 256),
        ((40, 256), (41, 256), 256),
        ((300, 768), (100, 256), 512),
        ((256, 256), (9, 256), 512),
    ],
)
def test_joined_rows_take_the_fewest_steps_that_hold_them(mine, theirs, capacity):
    """``BatchKVCache.extend`` right-aligns both caches' written positions at the later end, in the fewest whole
    steps that hold it and the next position, whatever their buffers' lengths: a prefill of 40 positions in
    256 joining rows at 41 stays at 256 (it made 512 when whole buffers were shifted), and a cache grown to 768
    at 300 goes back to 512. The written positions move unchanged; the rest is zeros (masked)."""
    rng = np.random.default_rng(0)
    caches = []
    for offset, size in (mine, theirs):
        kv = [mx.array(rng.standard_normal((2, 3, size, 4)).astype(np.float32)) for _ in range(2)]
        caches.append(BatchKVCache(kv, offset, [0, 0]))
    before = [[np.array(a) for a in c.kv] for c in caches]
    joined, other = caches
    joined.extend(other)
    end = max(mine[0], theirs[0])
    assert joined.capacity == capacity and joined.offset == end
    assert joined.pad == [end - mine[0]] * 2 + [end - theirs[0]] * 2
    for a, old_mine, old_theirs in zip(joined.kv, *before):
        a = np.array(a)
        for rows, old, offset in ((slice(0, 2), old_mine, mine[0]), (slice(2, 4), old_theirs, theirs[0])):
            np.testing.assert_array_equal(a[rows, :, end - offset : end], old[:, :, :offset])
            assert not a[rows, :, : end - offset].any() and not a[rows, :, end:].any()


def test_left_padded_prefill_matches_each_request_alone(tiny_t3):
    """Requests of different lengths prefilled together, left-padded to the longest (``SpeechTokenBatch``
    admits its waiting requests so): each row's logits and keys/values against its request prefilled alone."""
    model, embeds = tiny_t3, []
    for seed, prompt_len, text, cfg_weight in [(1, 150, [5, 6, 7], 0.5), (2, 20, list(range(40)), 0.0)]:
        voice = random_voice(seed, prompt_len=prompt_len)
        embeds.append(
            prefill_embeds(model, T3Cond(voice.speaker_emb, voice.t3_prompt_tokens, 0.5), text, cfg_weight)
        )
    n = max(e.shape[1] for e in embeds)
    pad = [n - e.shape[1] for e in embeds for _ in range(e.shape[0])]
    assert pad == [37, 37, 0]
    x = mx.concatenate([mx.pad(e, [(0, 0), (n - e.shape[1], 0), (0, 0)]) for e in embeds])
    logits, cache = model.prefill(x, pad=mx.array(pad, dtype=mx.int32))
    first = 0
    for e in embeds:
        rows, length = e.shape[0], e.shape[1]
        alone_logits, alone_cache = model.prefill(e)
        got = logits[first : first + rows]
        assert float(mx.abs(got - alone_logits).max() / mx.abs(alone_logits).max()) < 1e-5
        for a, b in zip(cache.kv, alone_cache.kv):
            a, b = a[first : first + rows, :, n - length : n], b[:, :, :length]
            assert float(mx.abs(a - b).max() / mx.abs(b).max()) < 1e-5
        first += rows
    assert all(bool(mx.isfinite(a).all()) for a in cache.kv)  # the padding's keys and values too


def test_bad_requests_are_refused_when_added(tiny_t3):
    batch = SpeechTokenBatch(tiny_t3)
    voice = random_voice()
    with pytest.raises(ValueError, match="at most 4096"):
        batch.add(BatchRequest([5], voice, SamplingParams(max_new_tokens=5000)))
    with pytest.raises(ValueError, match="uniforms must have shape"):
        batch.add(BatchRequest([5], voice, SamplingParams(max_new_tokens=3), uniforms=uniforms(2, 0)))
    assert len(batch) == 0 and batch.step() == []


def test_cancelled_requests_leave_and_the_rest_are_unchanged(tiny_t3):
    a, b, c, d, _ = requests()
    batch = SpeechTokenBatch(tiny_t3)
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
    assert tokens[uids[0]] == alone(tiny_t3, a) and tokens[uids[2]] == alone(tiny_t3, c)
    assert tokens[uids[1]] == alone(tiny_t3, b)[:2]


# --- the cache's window (models/cache.py BatchKVCache): positions base .. offset - 1 sit in a small buffer that is
# flushed into the big ones every window_size steps and before every join or leave.


def two_rows_cache(model: T3, window_size: int) -> BatchKVCache:
    """Two CFG pairs of different prefill lengths, right-aligned in one cache."""
    caches = []
    for seed, prompt_len, text in [(1, 150, [5, 6, 7]), (2, 20, list(range(40)))]:
        voice = random_voice(seed, prompt_len=prompt_len)
        cond = T3Cond(voice.speaker_emb, voice.t3_prompt_tokens, 0.5)
        _, cache = model.prefill(prefill_embeds(model, cond, text, 0.5))
        caches.append(BatchKVCache.from_cache(cache, window_size))
    caches[0].extend(caches[1])
    return caches[0]


def test_windowed_decode_matches_the_sdpa_decode_across_flushes(tiny_t3):
    """``T3.decode_window`` (attention written out over big buffer + window) against ``T3.decode`` (sdpa over
    one buffer written at every step) on the same rows, for 11 steps of a 4-position window: two full flushes and
    a partly filled window."""
    model, rng = tiny_t3, np.random.default_rng(0)
    cache = two_rows_cache(model, window_size=4)
    pad = mx.array(cache.pad, dtype=mx.int32)
    reference, errors, bases = list(cache.kv), [], []
    for k in range(11):
        token = mx.array(rng.integers(0, 6561, 4), dtype=mx.int32)
        speech_position = mx.array(k + 1, dtype=mx.int32)
        position = cache.claim()
        bases.append(cache.base)
        at = mx.array([position, cache.base], dtype=mx.int32)
        logits, cache.window = model.decode_window(token, speech_position, at, pad, cache.kv, cache.window)
        expected, reference = model.decode(
            token, speech_position, mx.array(position, dtype=mx.int32), reference, pad
        )
        assert not mx.isnan(logits).any()
        errors.append(float(mx.abs(logits - expected).max() / mx.abs(expected).max()))
    start = bases[0]
    assert bases == [start] * 4 + [start + 4] * 4 + [start + 8] * 3  # flushed when full, not before
    assert max(errors) < 1e-5, errors  # measured 5e-7 (fp32, tiny)
    # After a flush the big buffers hold what the one-buffer decode wrote: the first layer's keys and values
    # exactly (same inputs), the later ones up to the rounding of the attention above them.
    cache.flush()
    written = slice(0, cache.offset)
    for i, (a, b) in enumerate(zip(cache.kv, reference)):
        a, b = a[:, :, written], b[:, :, written]
        assert mx.array_equal(a, b) if i < 2 else mx.allclose(a, b, rtol=1e-5, atol=1e-6), f"buffer {i}"


@pytest.mark.parametrize("window_size", [4, 5])
def test_requests_get_their_tokens_alone_across_flushes_joins_and_leaves(tiny_t3, window_size):
    """Requests longer than two windows, joining and leaving in the middle of a window (4 divides the step
    numbers of some joins, 5 of others)."""
    a, b, c, d, e = requests()
    f = dataclasses.replace(a, text_ids=list(range(60)), key=mx.random.key(6), uniforms=None)
    joins = {0: [b, c], 2: [f], 3: [a], 5: [d], 9: [e], 30: [b]}
    got = run_batch(tiny_t3, joins, window_size=window_size)
    for i, request in enumerate([b, c, f, a, d, e, b]):
        assert got[i] == alone(tiny_t3, request), f"request {i}"


def test_a_long_request_with_the_default_window(tiny_t3):
    """70 tokens (more than two 32-position windows), another request joining at step 40 (mid-window)."""
    long = dataclasses.replace(requests()[2], params=SamplingParams(top_p=0.9, max_new_tokens=70))
    short = requests()[4]
    got = run_batch(tiny_t3, {0: [long], 40: [short]}, stop_on_eos=False)
    assert got[0] == alone(tiny_t3, long, stop_on_eos=False)
    assert got[1] == alone(tiny_t3, short, stop_on_eos=False)


def test_the_cache_grows_past_256_positions_with_the_window(tiny_t3):
    """A 62-token text (a ~97-position prefill) decoding 170 tokens crosses the first 256-position capacity;
    a request joins at step 100 (mid-window) and leaves at step 130 (mid-window) around it."""
    a, _, _, d, _ = requests()
    long = dataclasses.replace(a, text_ids=list(range(60)), params=SamplingParams(max_new_tokens=170),
                               uniforms=uniforms(170, 7))  # fmt: skip
    got = run_batch(tiny_t3, {0: [long], 100: [d]}, stop_on_eos=False, window_size=16)
    assert got[0] == alone(tiny_t3, long, stop_on_eos=False)
    assert got[1] == alone(tiny_t3, d, stop_on_eos=False)


def test_window_flushes_do_not_retrace_the_step(tiny_t3):
    """The token's position and the window's base are values of one int32 array: a batch whose rows and
    capacity do not change is traced once however often its window is flushed."""
    model = T3(tiny_t3.config)
    model.update(tiny_t3.parameters())
    traces = []

    def counted(*args):
        traces.append(args[2].shape)  # runs only while mx.compile traces
        return T3.decode_window(model, *args)

    model.decode_window = counted
    run_batch(model, {0: [requests()[1]]}, window_size=2)  # 8 tokens: 3 flushes
    assert len(traces) == 1


def test_bad_window_sizes_are_refused(tiny_t3):
    with pytest.raises(ValueError, match="window_size must be at least 1"):
        SpeechTokenBatch(tiny_t3, window_size=0)
    with pytest.raises(ValueError, match="window_size must be at least 1"):
        two_rows_cache(tiny_t3, window_size=0)
