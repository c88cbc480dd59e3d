"""Batched S3Gen (``S3Gen.batch_mel`` / ``S3Gen.batch``) against one request at a time on a tiny random S3Gen:
different token counts and different voices (prompt lengths) per row, the same keys, the same results."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from mlx_chatterbox import TTS
from mlx_chatterbox.convert import convert
from mlx_chatterbox.generation import vocode
from tests.conftest import TINY_MODEL, random_voice, write_upstream_checkpoint

# fp32, measured on the 2-core CPU: mel rel. L2 0 to 1.8e-8 per request, waveform 2.1e-7 to 2.5e-7 (float
# error of batched against single matrix products, amplified a little by HiFT); bounds with 40x room or more.
# (Full size on an H200: mel 4e-8, waveform 6.6e-7, with fan-in scaled random weights. conftest's 0.05-std
# weights drive full-size HiFT's Snake inputs to ~5e5, where sin() turns any 1e-8 into a different waveform.)
MEL_TOL = 1e-5
WAV_TOL = 1e-5


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vocode_batch")
    return TTS.load(convert(write_upstream_checkpoint(tmp / "up"), tmp / "mlx", config=TINY_MODEL))


def tokens(n: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, 6561, (1, n)).astype(np.int32))


def requests() -> tuple[list[mx.array], list, list[mx.array]]:
    """Four requests: prompts of 10, 7, 13 and 7 tokens (one with an odd prompt mel of 2 x 13 + 1 frames), 9,
    14, 5 and 14 new tokens, so that every row is padded differently and the last two share a mel length
    (one HiFT call)."""
    voices = [random_voice(seed=1, gen_tokens=10), random_voice(seed=2, gen_tokens=7)]
    odd = random_voice(seed=3, gen_tokens=13)
    extra = mx.concatenate([odd.s3gen_prompt_mel, odd.s3gen_prompt_mel[:, :1] + 1], axis=1)
    voices.append(dataclasses.replace(odd, s3gen_prompt_mel=extra))  # 2 x 13 + 1 frames
    voices.append(random_voice(seed=4, gen_tokens=7))
    ids = [tokens(9, 11), tokens(14, 12), tokens(5, 13), tokens(14, 14)]
    keys = [mx.random.key(20 + i) for i in range(len(ids))]
    return ids, voices, keys


def rel_l2(a: mx.array, b: mx.array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# bucket=16: every row padded past the longest (prompt + new tokens: 19, 21, 18, 21 -> 32 tokens, 64 frames).
@pytest.mark.parametrize("bucket", [1, 16])
def test_batched_mel_equals_one_by_one(tts, bucket):
    ids, voices, keys = requests()
    batched = tts.s3gen.batch_mel(ids, voices, cfm_steps=3, keys=keys, bucket=bucket)
    errors = []
    for row, t, v, k in zip(batched, ids, voices, keys):
        alone = tts.s3gen.mel(t, v, cfm_steps=3, key=k)
        assert row.shape == alone.shape
        errors.append(rel_l2(row, alone))
    print("mel rel. L2 per request:", ["%.1e" % e for e in errors])
    assert max(errors) < MEL_TOL, errors
    assert [m.shape[1] for m in batched] == [18, 28, 9, 28]


@pytest.mark.parametrize("bucket", [1, 16])
def test_batched_waveform_equals_one_by_one(tts, bucket, monkeypatch):
    ids, voices, keys = requests()
    hift_rows, real_decode = [], type(tts.s3gen.hift).decode

    def decode(self, mel, *args, **kwargs):
        hift_rows.append(mel.shape[0])
        return real_decode(self, mel, *args, **kwargs)

    monkeypatch.setattr(type(tts.s3gen.hift), "decode", decode)
    batched = tts.s3gen.batch(ids, voices, cfm_steps=3, keys=keys, bucket=bucket)
    assert hift_rows == [len(ids)]  # one HiFT call for mels of three lengths
    monkeypatch.undo()
    errors = []
    for row, t, v, k in zip(batched, ids, voices, keys):
        alone = tts.s3gen(t, v, cfm_steps=3, key=k)
        assert row.shape == alone.shape and row.dtype == mx.float32
        errors.append(rel_l2(row, alone))
    print("waveform rel. L2 per request:", ["%.1e" % e for e in errors])
    assert max(errors) < WAV_TOL, errors
    # The fade-in is applied per request, and rows do not borrow each other's randomness.
    assert all(float(mx.max(mx.abs(w[:, :480]))) == 0.0 for w in batched)
    assert not np.allclose(np.asarray(batched[1]), np.asarray(batched[3]))


@pytest.mark.parametrize("bucket", [1, 16])
def test_batched_mel_with_given_noise_and_rows_not_final(tts, bucket):
    """Streaming's rows: each row's CFM noise given, and rows with ``finalize=False`` (the frames of their
    last 3 tokens dropped, masked in the batch) next to final ones, each equal to its ``mel`` alone."""
    ids, voices, _ = requests()
    finalize = [False, True, False, False]
    noises = []
    for i, (t, v, final) in enumerate(zip(ids, voices, finalize)):
        frames = 2 * (v.s3gen_prompt_tokens.shape[1] + t.shape[1] - (0 if final else 3))
        noises.append(mx.random.normal((1, frames, 80), key=mx.random.key(40 + i)))
    s3gen = tts.s3gen
    batched = s3gen.batch_mel(ids, voices, cfm_steps=3, cfm_noises=noises, finalize=finalize, bucket=bucket)
    errors = []
    for row, t, v, noise, final in zip(batched, ids, voices, noises, finalize):
        alone = tts.s3gen.mel(t, v, cfm_steps=3, cfm_noise=noise, finalize=final)
        assert row.shape == alone.shape
        errors.append(rel_l2(row, alone))
    print("mel rel. L2 per request:", ["%.1e" % e for e in errors])
    assert max(errors) < MEL_TOL, errors  # measured 0 to 2.0e-8
    assert [m.shape[1] for m in batched] == [12, 28, 3, 22]


def test_one_request_and_numpy_ids(tts):
    ids, voices, keys = requests()
    (row,) = tts.s3gen.batch([np.asarray(ids[0])[0].astype(np.int64)], voices[:1], cfm_steps=2, keys=keys[:1])
    alone = tts.s3gen(ids[0], voices[0], cfm_steps=2, key=keys[0])
    assert rel_l2(row, alone) < WAV_TOL


def test_isolated_rows_in_the_flow_encoder(tts):
    """Upstream's padded batch lets a short row's last tokens read the padding in the pre-lookahead conv;
    ``isolate_rows`` gives each row its batch-of-one value, which batching needs."""
    flow = tts.s3gen.flow
    long, short = tokens(12, 1), tokens(7, 2)
    padded = mx.concatenate([long, mx.pad(short, [(0, 0), (0, 5)])], axis=0)
    lengths = mx.array([12, 7], dtype=mx.int32)
    alone, _ = flow.encode(short, mx.array([7], dtype=mx.int32))
    isolated, mask = flow.encode(padded, lengths, isolate_rows=True)
    quirk, _ = flow.encode(padded, lengths)
    assert rel_l2(isolated[1:, :14], alone) < MEL_TOL
    assert rel_l2(quirk[1:, :14], alone) > 1e-3
    np.testing.assert_array_equal(np.asarray(mask).sum(axis=1), [24, 14])


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(tokens=[], voices=[]), "no requests"),
        (dict(tokens=[[1, 2]], voices=[]), "1 token sequences but 0 voices"),
        (dict(tokens=[[1, 2]], keys=[None, None]), "1 token sequences but 2 keys"),
        (dict(tokens=[[1, 6561]]), r"request 0: speech tokens must lie in \[0, 6561\), found 6561"),
        (dict(tokens=[[1], []]), "request 1: there are no speech tokens"),
        (dict(tokens=[np.array([1.5])]), "request 0: speech tokens must be integer ids"),
        (dict(tokens=[np.zeros((2, 3), np.int32)]), r"must be integer ids of shape \(N,\) or \(1, N\)"),
        (dict(tokens=[[1]], cfm_steps=0), "cfm_steps=0 must be an integer >= 1"),
        (dict(tokens=[[1]], bucket=0), "bucket=0 must be a number of tokens >= 1"),
    ],
)
def test_bad_batches(tts, args, message):
    voices = args.pop("voices", [random_voice(gen_tokens=10)] * len(args["tokens"]))
    with pytest.raises(ValueError, match=message):
        tts.s3gen.batch(voices=voices, **args)


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(cfm_noises=[None]), "2 token sequences but 1 cfm_noises"),
        (dict(finalize=[True]), r"finalize must be one bool per request \(2\)"),
        (dict(finalize=[1, 0]), "finalize must be one bool per request"),
        (dict(cfm_noises=[mx.zeros((1, 22, 80)), None], keys=[mx.random.key(0), None]), "0: pass either"),
        (dict(cfm_noises=[None, mx.zeros((1, 23, 80))]), r"1: cfm_noise has shape \(1, 23, 80\), expected"),
        (dict(finalize=[True, False]), "request 1: 3 speech tokens leave no frame once the last 3 are held"),
    ],
)
def test_bad_rows_of_a_batched_mel(tts, args, message):
    voices = [random_voice(gen_tokens=10)] * 2
    with pytest.raises(ValueError, match=message):
        tts.s3gen.batch_mel([[1], [2, 2, 2]], voices, **args)


def test_memory_budget_changes_no_number_and_restores_the_limit(tts):
    """``bounded_memory`` only holds evaluation back (mx.set_memory_limit): the same waveform bit for bit
    under any budget, MLX's limit restored afterwards, and a bad budget refused."""
    ids, voices, keys = requests()
    s3gen = dataclasses.replace(tts.s3gen, memory_budget=None)
    free = np.asarray(s3gen(ids[0], voices[0], cfm_steps=2, key=keys[0]))
    limit = mx.set_memory_limit(mx.get_memory_limit())
    for budget in (0, 2**20, "auto"):
        bounded = dataclasses.replace(tts.s3gen, memory_budget=budget)
        np.testing.assert_array_equal(np.asarray(bounded(ids[0], voices[0], cfm_steps=2, key=keys[0])), free)
        rows = bounded.batch(ids[:2], voices[:2], cfm_steps=2, keys=keys[:2])
        assert rel_l2(rows[0], free) < WAV_TOL
        assert mx.get_memory_limit() == limit
    for bad in (-1, 1.5, "lots"):
        with pytest.raises(
            ValueError, match="memory_budget=.* must be a number of bytes >= 0, 'auto' or None"
        ):
            dataclasses.replace(tts.s3gen, memory_budget=bad)(ids[0], voices[0], cfm_steps=1)
        assert mx.get_memory_limit() == limit


def test_auto_budget_grows_with_the_requests_of_a_call(tts, monkeypatch):
    """ "auto" gives every request of a batched call its budget a request, up to AUTO_ROWS requests (a fixed
    budget starved batches on the H200), and a lone request its own (on a GPU 256 MiB against 1 GiB a request
    of a batch: run BA); a budget in bytes is the whole call's."""
    assert vocode.resolve_memory_budget("auto") == 256 * 2**20
    one = vocode.MEMORY_BUDGETS["cpu"][1]
    assert vocode.resolve_memory_budget("auto", 3) == 3 * one
    assert vocode.resolve_memory_budget("auto", 50) == vocode.AUTO_ROWS * one
    assert vocode.resolve_memory_budget(2**20, 3) == 2**20
    with monkeypatch.context() as gpu:
        gpu.setattr(mx, "default_device", lambda: mx.gpu)
        assert vocode.resolve_memory_budget("auto") == 256 * 2**20
        assert vocode.resolve_memory_budget("auto", 2) == 2 * 2**30
        assert vocode.resolve_memory_budget("auto", 50) == vocode.AUTO_ROWS * 2**30
    limits = []
    real = mx.set_memory_limit
    monkeypatch.setattr(mx, "set_memory_limit", lambda n: limits.append(n) or real(n))
    ids, voices, keys = requests()
    active = mx.get_active_memory()
    tts.s3gen.batch(ids[:3], voices[:3], cfm_steps=1, keys=keys[:3])
    assert abs(limits[0] - 3 * one - active) < one  # the call raised it by 3 requests' budgets


@pytest.mark.parametrize(
    ("new_tokens", "bucket", "finalize", "masked"),
    [
        ([9], 1, [True], False),  # one request, unpadded: every frame valid
        ([9, 9], 1, [True, True], False),  # rows of one length
        ([9], 16, [True], True),  # padded to the bucket
        ([9, 5], 1, [True, True], True),  # the shorter row padded
        ([9], 1, [False], True),  # the lookahead's frames dropped
    ],
)
def test_the_solve_is_masked_only_where_a_frame_is_not_valid(
    tts, new_tokens, bucket, finalize, masked, monkeypatch
):
    """``S3Gen.batch_mel`` hands the CFM solve a mask only where some row has padding or dropped frames; with
    every frame valid it runs unmasked, as ``mel`` does, and gives ``mel``'s result."""
    masks, real = [], vocode._solve_steps

    def solve_steps(estimator, mu, mask, *args):
        masks.append(mask)
        return real(estimator, mu, mask, *args)

    monkeypatch.setattr(vocode, "_solve_steps", solve_steps)
    voice = random_voice(seed=1, gen_tokens=10)  # 10 prompt tokens
    ids = [tokens(n, 30 + i) for i, n in enumerate(new_tokens)]
    frames = [2 * (10 + n - (0 if final else 3)) for n, final in zip(new_tokens, finalize)]
    noises = [mx.random.normal((1, f, 80), key=mx.random.key(50 + i)) for i, f in enumerate(frames)]
    s3gen = tts.s3gen
    batched = s3gen.batch_mel(
        ids, [voice] * len(ids), cfm_steps=2, cfm_noises=noises, finalize=finalize, bucket=bucket
    )
    assert (masks[0] is not None) == masked
    for row, t, noise, final in zip(batched, ids, noises, finalize):
        assert rel_l2(row, s3gen.mel(t, voice, cfm_steps=2, cfm_noise=noise, finalize=final)) < MEL_TOL
