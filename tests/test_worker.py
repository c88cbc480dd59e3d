"""The server's engine (server/worker.py) on a tiny random model: jobs decoded together give what each gives
alone through ``TTS.generate`` / ``TTS.stream``; cancel, queue limit, errors, asyncio readers (no torch)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import re
import threading
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

from mlx_chatterbox import TTS
from mlx_chatterbox.convert import convert
from mlx_chatterbox.generation import watermark
from mlx_chatterbox.generation.batch import ContinuousBatch
from mlx_chatterbox.generation.speech_tokens import traces
from mlx_chatterbox.models.cfm import Estimator
from mlx_chatterbox.sampling import SamplingParams
from mlx_chatterbox.server import vocoding
from mlx_chatterbox.server import worker as worker_module
from mlx_chatterbox.server.worker import IDLE_COLLECT_S, QueueFull, SpeechJob, Worker
from tests.conftest import TINY_MODEL, TINY_TURBO, random_voice, write_upstream_checkpoint

LONG = "First sentence of a text long enough for two pieces. " * 7  # 378 characters: two pieces


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("worker")
    return convert(write_upstream_checkpoint(tmp / "up"), tmp / "mlx", config=TINY_MODEL)


@pytest.fixture(scope="module")
def tts(folder):
    return TTS.load(folder)


def jobs(stream: bool) -> list[SpeechJob]:
    """Different texts, voices, knobs, seeds; random weights never stop, so max_new_tokens sets the lengths."""
    return [
        SpeechJob("Hello there.", random_voice(1), SamplingParams(max_new_tokens=20), cfm_steps=2, seed=1,
                  watermark=False, stream=stream, first_chunk=12),
        SpeechJob(LONG, random_voice(2, prompt_len=60), SamplingParams(max_new_tokens=12, cfg_weight=0), cfm_steps=2,
                  seed=2, stream=stream),
        SpeechJob("Short.", random_voice(3), SamplingParams(max_new_tokens=9, temperature=0), cfm_steps=3, seed=3,
                  stream=stream),
    ]  # fmt: skip


def endless_job() -> SpeechJob:
    """A stream that runs until its reader cancels it: random weights never stop, and its three pieces' budgets
    (about 850 tokens each; "Hello." would have 69) outlast any test's wait for its first chunk."""
    text = "Words for a stream that runs on until its reader cancels it, one clause after another. " * 9
    return SpeechJob(text, random_voice(4), SamplingParams(max_new_tokens=4000), cfm_steps=2, stream=True)


def alone(tts: TTS, job: SpeechJob) -> list[np.ndarray]:
    """The job's chunks through ``TTS.stream``, or its whole audio from ``TTS.generate`` as one chunk."""
    kwargs = dict(cfm_steps=job.cfm_steps, seed=job.seed, watermark=job.watermark)
    if job.stream:
        return list(
            tts.stream(
                job.text,
                job.voice,
                job.params,
                context=job.stream_context,
                first_chunk=job.first_chunk,
                **kwargs,
            )
        )
    return [tts.generate(job.text, job.voice, job.params, **kwargs)]


def wait_until(done: Callable[[], bool], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not done() and time.monotonic() < end:
        time.sleep(0.01)
    assert done(), "the worker did not get there in time"


def wait_idle(worker: Worker, timeout: float = 20.0) -> None:
    wait_until(lambda: worker.jobs == 0, timeout)


@pytest.mark.parametrize("stream", [False, True])
def test_jobs_together_give_what_each_gives_alone(tts, stream):
    # vocode_batch=1: every whole piece vocoded alone, exactly TTS.generate (pieces that share an S3Gen call
    # differ by float error: test_pieces_finished_together_are_vocoded_together).
    with Worker(tts, max_batch=2, vocode_batch=1) as worker:  # the third job waits for a free place
        specs = jobs(stream)
        tickets = [worker.submit(job) for job in specs]
        got = [list(t) for t in tickets]
    for job, chunks, ticket in zip(specs, got, tickets):
        # Streamed, a piece longer than its first chunk comes in several chunks; whole, in one.
        assert len(chunks) > 1 if stream and job.params.max_new_tokens > job.first_chunk else len(chunks) == 1
        # Chunk for chunk: a chunk is watermarked on its own, so the chunking shows in the samples.
        expected = alone(tts, job)
        assert [len(c) for c in chunks] == [len(c) for c in expected]
        assert all(np.array_equal(a, b) for a, b in zip(chunks, expected))
        assert ticket.speech_tokens == job.params.max_new_tokens * (2 if job.text == LONG else 1)
        if job.text != LONG:
            assert ticket.text_tokens == len(tts.text_ids(job.text))


def test_asyncio_readers(tts):
    async def read(ticket) -> np.ndarray:
        return np.concatenate([chunk async for chunk in ticket])

    async def main(worker: Worker) -> list[np.ndarray]:
        return await asyncio.gather(*(read(worker.submit(job)) for job in jobs(True)[:2]))

    with Worker(tts) as worker:
        got = asyncio.run(main(worker))
    for job, wav in zip(jobs(True), got):
        assert np.array_equal(wav, np.concatenate(alone(tts, job)))


@pytest.mark.parametrize("context", [0, "whole"])
def test_a_streamed_jobs_context(tts, context):
    """SpeechJob.stream_context is TTS.stream's context, chunk for chunk: 60 tokens at most, whose last decode
    a window of 0 cuts."""
    job = SpeechJob("Hello there.", random_voice(1), SamplingParams(max_new_tokens=60), cfm_steps=1, seed=1,
                    stream=True, stream_context=context)  # fmt: skip
    with Worker(tts) as worker:
        chunks = list(worker.submit(job))
        with pytest.raises(ValueError, match="context=-1 must be a number of speech tokens"):
            worker.submit(dataclasses.replace(job, stream_context=-1))
    kwargs = dict(cfm_steps=1, seed=1)
    expected = list(tts.stream(job.text, job.voice, job.params, context=context, **kwargs))
    assert [len(c) for c in chunks] == [len(c) for c in expected]
    assert all(np.array_equal(a, b) for a, b in zip(chunks, expected))
    other = list(
        tts.stream(job.text, job.voice, job.params, context="whole" if context == 0 else 0, **kwargs)
    )
    assert not np.array_equal(np.concatenate(chunks), np.concatenate(other))


def test_cancel_queue_limit_and_errors(tts):
    endless = endless_job()
    with Worker(tts, max_queue=2) as worker:
        first = worker.submit(endless)
        next(iter(first))  # it is decoding and streaming
        second = worker.submit(endless)
        with pytest.raises(QueueFull, match="limit is 2"):
            worker.submit(endless)
        # Cancelled while waiting or right after joining, it leaves the queue at the worker's next step. (The
        # limit is checked before: the worker may drop a cancelled job before a submit that follows at once.)
        second.cancel()
        wait_until(lambda: worker.jobs == 1)
        worker.submit(endless).cancel()
        first.cancel()
        wait_idle(worker)
        assert list(first) == [] and list(second) == []  # their streams ended

        # A job that fails (a voice T3 cannot take) fails alone; the worker goes on.
        bad = dataclasses.replace(
            jobs(False)[0], voice=dataclasses.replace(random_voice(), speaker_emb=mx.zeros((1, 7)))
        )
        ticket = worker.submit(bad)
        with pytest.raises(ValueError):
            list(ticket)
        assert len(list(worker.submit(jobs(False)[2]))) == 1

        with pytest.raises(ValueError, match="empty"):
            worker.submit(dataclasses.replace(endless, text="  "))
        with pytest.raises(ValueError, match="max_new_tokens"):
            worker.submit(dataclasses.replace(endless, params=SamplingParams(max_new_tokens=5000)))
        with pytest.raises(ValueError, match="cfm_steps"):
            worker.submit(dataclasses.replace(endless, cfm_steps=0))
        assert worker.run(sum, [1, 2]).result() == 3
        with pytest.raises(ZeroDivisionError):
            worker.run(divmod, 1, 0).result()
    with pytest.raises(RuntimeError, match="not running"):
        worker.submit(endless)


def test_no_mlx_work_on_other_threads_while_a_worker_runs(tts, monkeypatch):
    """The worker thread records CUDA graphs (MLX-CUDA), and MLX work on another thread meanwhile breaks the
    recording and aborts the process ("cudaStreamEndCapture failed", H200 runs of 1 to 8 requests). So
    ``submit`` evaluates nothing (a lazy voice made here is refused, with the fix), and Python's garbage
    collection, which frees MLX arrays on whatever thread it runs, runs only on the worker thread."""
    base = jobs(False)[0]
    here, calls = threading.current_thread(), []
    for name in ("eval", "async_eval"):

        def counted(*args, _real=getattr(mx, name)):
            calls.append(threading.current_thread())
            return _real(*args)

        monkeypatch.setattr(mx, name, counted)

    class Cycle:  # garbage only a collection frees; records where
        def __init__(self):
            self.me = self

        def __del__(self):
            freed.append(threading.current_thread())

    freed = []
    assert gc.isenabled()
    with Worker(tts) as worker:
        assert not gc.isenabled()
        lazy = dataclasses.replace(base.voice, speaker_emb=base.voice.speaker_emb * 1.0)  # not evaluated
        ticket = worker.submit(dataclasses.replace(base, voice=lazy))
        with pytest.raises(ValueError, match="mx.eval them on the thread that made them"):
            list(ticket)
        (wav,) = list(worker.submit(base))
        assert here not in calls
        for _ in range(gc.get_threshold()[0] + 1):
            Cycle()
        end = time.monotonic() + 5 * IDLE_COLLECT_S
        while not freed and time.monotonic() < end:
            time.sleep(0.05)
        assert freed and here not in freed
    assert gc.isenabled()
    monkeypatch.undo()
    assert np.array_equal(wav, alone(tts, base)[0])


def test_start_finishes_the_callers_queued_work_first(tts, monkeypatch):
    """A worker started while MLX work is still queued on the caller's stream aborted on the H200 (its stream
    waited on the caller's during a CUDA-graph capture): ``start`` synchronises the caller's thread before the
    worker thread exists."""
    seen = []
    real = mx.synchronize
    monkeypatch.setattr(
        mx,
        "synchronize",
        lambda *a: seen.append((threading.current_thread(), threading.active_count())) or real(*a),
    )
    before = threading.active_count()
    with Worker(tts):
        pass
    assert seen[0] == (threading.current_thread(), before)


@pytest.mark.parametrize("cfm_dtype", ["float32", "bfloat16"])
def test_a_model_loaded_on_one_thread_serves_on_another(folder, cfm_dtype):
    """MLX evaluates a lazy array only on the thread that made it, and the worker has a thread of its own:
    loading must leave nothing lazy behind (T3's rope table once did, and a server's first request failed with
    "There is no Stream(cpu, 0) in current thread"), the bf16 estimator and the watermarker included."""
    fresh = TTS.load(folder, cfm_dtype=cfm_dtype)
    fresh.watermarker()  # loaded on this thread, used on the worker's
    job = SpeechJob("Hello.", random_voice(1), SamplingParams(max_new_tokens=5), cfm_steps=1, seed=0)
    with Worker(fresh) as worker:
        (wav,) = list(worker.submit(job))
    assert wav.shape == (5 * 960,) and np.isfinite(wav).all()


@pytest.mark.parametrize("vocode_thread", [True, False])
@pytest.mark.parametrize("vocode_batch", [3, 2])
def test_pieces_finished_together_are_vocoded_together(tts, monkeypatch, vocode_batch, vocode_thread):
    """Whole jobs that T3 finishes in the same step share S3Gen calls (``S3Gen.batch``, up to vocode_batch
    rows), on the vocoding thread or the worker's: each equals its job alone up to float error; one left alone
    goes through ``TTS.vocode``, exactly.
    """
    calls = []
    batch = tts.s3gen.batch_steps

    def spy(tokens, voices, **kwargs):
        calls.append(len(tokens))
        return batch(tokens, voices, **kwargs)

    monkeypatch.setattr(tts.s3gen, "batch_steps", spy)
    specs = [
        SpeechJob("Hello there.", random_voice(1), SamplingParams(max_new_tokens=11), cfm_steps=2, seed=s,
                  watermark=s != 5)
        for s in (5, 6, 7)
    ]  # fmt: skip
    with Worker(tts, vocode_batch=vocode_batch, vocode_thread=vocode_thread) as worker:
        hold = worker.run(time.sleep, 0.3)  # the worker sleeps while all three arrive: they start together
        tickets = [worker.submit(job) for job in specs]
        hold.result()
        got = [list(t) for t in tickets]
    assert calls == ([3] if vocode_batch == 3 else [2])
    for k, (job, chunks) in enumerate(zip(specs, got)):
        (wav,), (expected,) = chunks, alone(tts, job)
        assert wav.shape == expected.shape
        if k >= vocode_batch:  # alone in its group
            assert np.array_equal(wav, expected)
        else:  # measured 2.3e-7 to 3.8e-7 (fp32, tiny), watermark on or off
            assert np.linalg.norm(wav - expected) / np.linalg.norm(expected) < 1e-5


def test_first_chunk_gap_times_two_chunks_and_checks_first_chunk(tts):
    """``first_chunk_gap``: seconds between a stream's first two chunks (``serve --first-chunk auto``); a job's
    first_chunk is checked at submit."""
    with Worker(tts) as worker:
        gap = worker.first_chunk_gap(random_voice(1))
        assert 0 < gap < 60
        with pytest.raises(ValueError, match="first_chunk=3 is too small"):
            worker.submit(SpeechJob("Hi.", random_voice(1), stream=True, first_chunk=3))
        assert worker.jobs == 0


def test_warm_up_traces_the_decode_step_and_leaves_the_worker_idle(tts):
    t3 = tts.speech.t3
    t3.compiled_steps.clear()
    with Worker(tts) as worker:
        submit, jobs = worker.submit, []
        worker.submit = lambda job: jobs.append(job) or submit(job)
        worker.warm_up(random_voice(1), first_chunk=9)
        assert worker.jobs == 0
        assert t3.compiled_steps, "no decode step was traced"
    # The stream runs past its first chunk of the server's length, so that its first decode is made.
    (stream,) = [job for job in jobs if job.stream]
    assert stream.first_chunk == 9 and stream.params.max_new_tokens > 9 and len(jobs) == 2


def test_warm_up_marks_a_first_chunk_on_every_marking_thread(tts, monkeypatch):
    """Jobs take the marking threads in turn, and each thread marks on an MLX stream of its own: the warm-up
    streams once per thread, so that no request's first chunk is a thread's first mark."""
    marked: set[str] = set()
    mark = tts._mark_chunk

    def noting(chunk):
        marked.add(threading.current_thread().name)
        return mark(chunk)

    monkeypatch.setattr(tts, "_mark_chunk", noting)
    with Worker(tts, vocode_thread=True, vocoding="thread", mark_threads=3) as worker:
        submit, jobs = worker.submit, []
        worker.submit = lambda job: jobs.append(job) or submit(job)
        worker.warm_up(random_voice(1), first_chunk=9)
        assert worker.jobs == 0
        assert marked == {f"mlx-chatterbox-marker-{i}" for i in range(3)}, marked
        assert [job.stream for job in jobs] == [True, True, True, False]
        # serve's second warm-up, at the first chunk --first-chunk auto chose: the streams alone
        marked.clear()
        worker.warm_up(random_voice(1), first_chunk=12, whole=False)
        assert marked == {f"mlx-chatterbox-marker-{i}" for i in range(3)}, marked
        assert [(job.stream, job.first_chunk) for job in jobs[4:]] == [(True, 12)] * 3


@pytest.mark.parametrize("variant", ["english", "turbo"])
def test_warm_batches_traces_each_batch_size_once(tts, tmp_path, variant):
    """``warm_batches`` steps T3's batch (English's CFG pairs, Turbo's single rows) at every ``batch_size`` up to
    ``max_batch``: one trace each, kept on the worker's thread for the requests to come (a second warm-up
    traces nothing) and the worker left idle, the batches' buffers given back (not kept in MLX's cache, where on
    an H200 they slowed the requests after)."""
    if variant == "turbo":
        src = write_upstream_checkpoint(tmp_path / "up", TINY_TURBO)
        tts = TTS.load(convert(src, tmp_path / "mlx", config=TINY_TURBO))
    tts.t3.compiled_steps.clear()
    with Worker(tts, max_batch=10) as worker:
        before = traces()
        assert worker.warm_batches(random_voice(1)) == [1, 2, 3, 4, 5, 6, 7, 8, 10]
        assert traces() - before == 9
        # Kept, the tiny batches' buffers held 32 MiB of MLX's cache here; given back, a few small arrays freed
        # after the clear (tens of KiB).
        assert mx.get_cache_memory() < 2**20
        worker.warm_batches(random_voice(2))
        assert traces() - before == 9 and worker.jobs == 0


# Per-row bound of a whole job vocoded in a shared S3Gen call against TTS.generate alone (fp32, tiny model):
# measured 2.3e-7 to 1.2e-6 (watermark on and off), the rows padded to the bucket.
SHARED_TOL = 1e-5


@pytest.mark.parametrize("fit", ["all", "two"])
def test_t3_steps_while_s3gen_runs_and_ready_pieces_share_a_call(tts, monkeypatch, fit):
    """On the vocoding thread (``vocode_thread=True``) S3Gen runs while T3 keeps stepping: the first job's
    piece is vocoded (alone) until every other job has finished T3, and those, ready together by then, share
    one S3Gen call (different token counts, voices and prompt lengths, padded to the bucket), each equal to
    its job alone within SHARED_TOL. A job of other cfm_steps is vocoded apart; ``vocode_frames`` bounds a
    call ("two": only two rows fit, the third goes alone)."""
    first = SpeechJob("Hi.", random_voice(1), SamplingParams(max_new_tokens=5), cfm_steps=2, seed=10)
    rest = [
        SpeechJob("Hello there.", random_voice(2, gen_tokens=13), SamplingParams(max_new_tokens=9), cfm_steps=2,
                  seed=11),
        SpeechJob("Good morning.", random_voice(3, gen_tokens=30), SamplingParams(max_new_tokens=12),
                  cfm_steps=2, seed=12, watermark=False),
        SpeechJob("Other steps.", random_voice(4), SamplingParams(max_new_tokens=13), cfm_steps=3, seed=13),
        SpeechJob("Last one.", random_voice(1), SamplingParams(max_new_tokens=16), cfm_steps=2, seed=14),
    ]  # fmt: skip
    bucket = 8
    rows = [-(-(j.voice.s3gen_prompt_tokens.shape[1] + j.params.max_new_tokens) // bucket) * bucket
            for j in (rest[0], rest[1])]  # fmt: skip
    frames = {"all": 10**6, "two": 2 * 2 * max(rows)}[fit]  # "two": the first two rows and no third
    tickets: list = []
    stepped: list[bool] = []
    calls: list[int] = []
    real_vocode, real_batch = vocoding.vocode_tokens, tts.s3gen.batch_steps

    took_first = threading.Event()

    def slow_vocode(*args, **kwargs):
        took_first.set()
        if not stepped:  # the first piece: hold S3Gen until T3 has finished every other job
            end = time.monotonic() + 30
            while time.monotonic() < end and any(
                t.speech_tokens < j.params.max_new_tokens for t, j in zip(tickets[1:], rest)
            ):
                time.sleep(0.01)
            stepped.append(all(t.speech_tokens == j.params.max_new_tokens for t, j in zip(tickets[1:], rest)))
        return real_vocode(*args, **kwargs)

    def spy(tokens, voices, **kwargs):
        calls.append(len(tokens))
        assert kwargs["bucket"] == bucket
        return real_batch(tokens, voices, **kwargs)

    monkeypatch.setattr(vocoding, "vocode_tokens", slow_vocode)
    monkeypatch.setattr(tts.s3gen, "batch_steps", spy)
    with Worker(tts, vocode_frames=frames, vocode_bucket=bucket, vocode_thread=True) as worker:
        real_end_pieces = worker._end_pieces

        def end_pieces(ended):
            # The first piece is queued: T3 steps on once the vocoding thread has taken it, alone (a thread
            # woken late on a loaded machine would otherwise find the next piece ready too).
            more = real_end_pieces(ended)
            if any(j.job is first for j in ended):
                took_first.wait(30)
            return more

        monkeypatch.setattr(worker, "_end_pieces", end_pieces)
        hold = worker.run(time.sleep, 0.3)  # all five start together
        tickets += [worker.submit(job) for job in [first] + rest]
        hold.result()
        got = [list(t) for t in tickets]
    monkeypatch.undo()
    assert stepped == [True]
    assert calls == ([3] if fit == "all" else [2])
    errors = []
    for job, chunks in zip([first] + rest, got):
        (wav,), (expected,) = chunks, alone(tts, job)
        assert wav.shape == expected.shape
        errors.append(float(np.linalg.norm(wav - expected) / np.linalg.norm(expected)))
    print("rel. L2 per job:", ["%.1e" % e for e in errors])
    shared = [1, 2, 4] if fit == "all" else [1, 2]
    for k, error in enumerate(errors):
        if k in shared:
            assert 0 < error < SHARED_TOL, errors
        else:  # vocoded alone: exactly TTS.generate
            assert error == 0, errors


@pytest.mark.parametrize("catch_up", [False, True])
def test_t3_steps_while_streams_decode_and_decodes_due_meanwhile_share_a_call(tts, monkeypatch, catch_up):
    """With a vocoding thread, streamed decodes run there while T3 keeps stepping: the first (A's first chunk)
    is held until T3 has drawn all of B's tokens; the decodes that fell due meanwhile (A's last, B's first)
    then share one call. Without catch-up each stream is TTS.stream's chunk for chunk (the same cuts), within
    SHARED_TOL. With it, B, whose 40 tokens all waited, takes them into one decode: TTS.stream's audio with a
    first chunk past its end (one chunk); A, whose tokens after its first chunk cross no boundary, is
    TTS.stream's either way."""
    a = SpeechJob(
        "Hi.", random_voice(1), SamplingParams(max_new_tokens=14), cfm_steps=2, seed=20, stream=True
    )
    b = SpeechJob("Hello there.", random_voice(2, gen_tokens=13), SamplingParams(max_new_tokens=40), cfm_steps=2,
                  seed=21, stream=True, first_chunk=12)  # fmt: skip
    tickets: list = []
    stepped: list[bool] = []
    rows: list[int] = []
    real = vocoding.decode_together_steps

    def spy(vocoders, **kwargs):
        if not stepped:  # the first decode: hold it until T3 has drawn all of B's tokens
            end = time.monotonic() + 30
            while time.monotonic() < end and tickets[1].speech_tokens < b.params.max_new_tokens:
                time.sleep(0.01)
            stepped.append(tickets[1].speech_tokens == b.params.max_new_tokens)
        rows.append(len(vocoders))
        return real(vocoders, **kwargs)

    monkeypatch.setattr(vocoding, "decode_together_steps", spy)
    with Worker(tts, vocode_thread=True, stream_catch_up=catch_up) as worker:
        hold = worker.run(time.sleep, 0.3)  # both start together
        tickets += [worker.submit(job) for job in (a, b)]
        hold.result()
        got = [list(t) for t in tickets]
    monkeypatch.undo()
    assert stepped == [True]
    assert rows[0] == 1 and rows[1] == 2, rows
    b_alone = dataclasses.replace(b, first_chunk=b.params.max_new_tokens + 1) if catch_up else b
    for job, chunks in zip((a, b_alone), got):
        expected = alone(tts, job)
        assert [len(c) for c in chunks] == [len(c) for c in expected]
        wav, ref = np.concatenate(chunks), np.concatenate(expected)
        assert np.linalg.norm(wav - ref) / np.linalg.norm(ref) < SHARED_TOL
    assert len(got[1]) == (1 if catch_up else len(alone(tts, b)))


def test_a_failed_or_cancelled_stream_on_the_vocoding_thread_ends_alone(tts, monkeypatch, caplog):
    """With a vocoding thread, a stream whose decode fails gets the error and leaves T3's batch (the log says
    what the failed call held, for a replay); a stream whose reader leaves while its decode runs is dropped;
    the other streams and the worker go on."""
    doomed = SpeechJob("Doomed.", random_voice(5), SamplingParams(max_new_tokens=400), cfm_steps=2, seed=30,
                       stream=True)  # fmt: skip
    left = dataclasses.replace(doomed, text="Left.", voice=random_voice(6), seed=31)
    fine = SpeechJob(
        "Fine.", random_voice(1), SamplingParams(max_new_tokens=20), cfm_steps=2, seed=32, stream=True
    )
    real = vocoding.decode_together_steps
    running = threading.Event()

    def spy(vocoders, **kwargs):
        if any(v.voice is doomed.voice and v.pushed > 20 for v in vocoders):
            raise RuntimeError("no memory left")
        if any(v.voice is left.voice for v in vocoders):
            running.set()
            time.sleep(0.2)  # its reader leaves meanwhile
        return real(vocoders, **kwargs)

    monkeypatch.setattr(vocoding, "decode_together_steps", spy)
    with Worker(tts, vocode_thread=True, stream_catch_up=False) as worker:
        bad = worker.submit(doomed)
        with pytest.raises(RuntimeError, match="no memory left"):
            list(bad)
        assert re.search(r"streamed decodes failed; .* a stream: \[\(\d+, \d+, False\)\]", caplog.text)
        gone = worker.submit(left)
        assert running.wait(30)
        gone.cancel()
        got = list(worker.submit(fine))
        wait_idle(worker)
        time.sleep(IDLE_COLLECT_S + 0.2)  # a turn of the idle loop sets the gauges
        metrics = worker.metrics()
        assert metrics["requests"] == {"finished": 1, "failed": 1, "cancelled": 1}
        assert metrics["running"] == metrics["waiting"] == 0  # the failed stream's T3 row is gone too
    monkeypatch.undo()
    assert np.array_equal(np.concatenate(got), np.concatenate(alone(tts, fine)))


def test_a_gone_readers_audio_is_not_watermarked(tts, monkeypatch):
    """With the marking thread (``vocode_thread=True``), chunks that wait for it when their reader leaves are
    dropped unmarked: only the chunk being marked then is."""
    job = SpeechJob("Gone soon.", random_voice(7), SamplingParams(max_new_tokens=400), cfm_steps=2, seed=40,
                    stream=True, first_chunk=12)  # fmt: skip
    marking, reader_left, marked = threading.Event(), threading.Event(), []
    real = tts._mark_chunk

    def spy(chunk):
        marked.append(len(chunk))
        marking.set()
        assert reader_left.wait(30)
        return real(chunk)

    monkeypatch.setattr(tts, "_mark_chunk", spy)
    with Worker(tts, vocode_thread=True) as worker:
        ticket = worker.submit(job)
        assert marking.wait(30)
        deadline = time.perf_counter() + 30
        (lane,) = worker._deliveries  # one marking thread
        while lane.qsize() < 2 and time.perf_counter() < deadline:  # chunks wait behind it
            time.sleep(0.01)
        assert lane.qsize() >= 2
        ticket.cancel()
        reader_left.set()
        wait_idle(worker)
        while lane.qsize():
            time.sleep(0.01)
    assert len(marked) == 1


@pytest.mark.parametrize("on_device", [False, True])
def test_marking_threads_mark_jobs_at_once_each_in_order(tts, monkeypatch, on_device):
    """``mark_threads=2``: two jobs' audio is watermarked on two threads at the same time (each thread's first
    mark waits at a barrier for the other's), and every job's chunks still arrive in order, equal to
    ``TTS.stream`` / ``TTS.generate`` alone within SHARED_TOL (whole and streamed, watermarked); also with the
    watermark's spectra in MLX on each marking thread's own stream (``SPECTRA_ON_DEVICE``), against the host
    path alone."""
    monkeypatch.setattr(watermark, "SPECTRA_ON_DEVICE", on_device)
    specs = [
        dataclasses.replace(job, stream=stream, watermark=True, seed=60 + k)
        for k, (job, stream) in enumerate(zip(jobs(True) + jobs(False)[1:2], (True, True, True, False)))
    ]
    barrier, threads = threading.Barrier(2, timeout=30), set()
    real_chunk, real_whole = tts._mark_chunk, tts._mark

    def meet(real):
        def spy(wav):
            name = threading.current_thread().name
            if name not in threads:  # each marking thread's first mark waits for the other thread's
                threads.add(name)
                barrier.wait()
            return real(wav)

        return spy

    monkeypatch.setattr(tts, "_mark_chunk", meet(real_chunk))
    monkeypatch.setattr(tts, "_mark", meet(real_whole))
    with Worker(tts, max_batch=4, vocode_thread=True, stream_catch_up=False, mark_threads=2) as worker:
        hold = worker.run(time.sleep, 0.3)  # all start together
        tickets = [worker.submit(job) for job in specs]
        hold.result()
        got = [list(t) for t in tickets]
        assert worker.metrics()["threads"] == {"worker": 1, "vocoder": 1, "marker": 2}
    assert threads == {"mlx-chatterbox-marker-0", "mlx-chatterbox-marker-1"}
    monkeypatch.undo()
    for job, chunks in zip(specs, got):
        expected = alone(tts, job)
        assert [len(c) for c in chunks] == [len(c) for c in expected]
        wav, ref = np.concatenate(chunks), np.concatenate(expected)
        assert np.linalg.norm(wav - ref) / np.linalg.norm(ref) < SHARED_TOL


def test_a_sliced_call_gives_the_whole_call_a_part_a_turn(tts):
    """``Vocoding(sliced=True)`` queues a call a part a turn (the flow encoder, each CFM step, HiFT) and answers
    in the turn after its last part, exactly (bitwise) what the same call run in one turn gives: whole pieces
    batched, and streams' decodes batched."""
    voices = [random_voice(1), random_voice(2, gen_tokens=13)]
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 6561, 20 + 7 * k).astype(np.int32) for k in range(2)]
    pieces = [("piece", k, vocoding.PieceOrder(k, ids[k], voices[k], 60 + k, 2)) for k in range(2)]
    streams = [("open", k, vocoding.StreamOrder(voices[k], 70 + k, 2, 12, 50)) for k in range(2)]
    streams += [("end", k, rng.integers(0, 6561, 16 + 3 * k).tolist()) for k in range(2)]

    def run(messages: list[tuple], sliced: bool) -> tuple[list, int]:
        engine = vocoding.Vocoding(tts.s3gen, batch=8, frames=10**6, bucket=1, catch_up=True, sliced=sliced,
                                   timed=lambda *args: contextlib.nullcontext())  # fmt: skip
        turns, answers = 0, []
        while not answers:
            answers = engine.turn(messages if turns == 0 else [])
            turns += 1
        assert not engine.busy()
        return answers, turns

    parts = 1 + 2 + 1  # the flow encoder, two CFM steps, HiFT
    for messages in (pieces, streams):
        (whole,), turns = run(messages, sliced=False)
        (sliced,), sliced_turns = run(messages, sliced=True)
        assert turns == 1 and sliced_turns == parts + 1
        if isinstance(whole, vocoding.Vocoded):
            assert whole.keys == sliced.keys == [0, 1] and whole.error is sliced.error is None
            wavs = zip(whole.wavs, sliced.wavs)
        else:
            assert [c[0] for c in whole.chunks] == [c[0] for c in sliced.chunks] == [0, 1]
            wavs = ((a[1], b[1]) for a, b in zip(whole.chunks, sliced.chunks))
        for a, b in wavs:
            assert len(a) > 0 and np.array_equal(a, b)


def test_a_sliced_call_that_raises_past_its_handler_ends_there(tts, monkeypatch):
    """A sliced call that raises what the calls do not catch (KeyboardInterrupt) is dropped: a later turn does
    not read the dead call's end as an answer (None, the worker's stop signal), and new calls run."""
    engine = vocoding.Vocoding(tts.s3gen, batch=8, frames=10**6, bucket=1, catch_up=True, sliced=True,
                               timed=lambda *args: contextlib.nullcontext())  # fmt: skip
    rng = np.random.default_rng(1)

    def pieces(first: int) -> list[tuple]:
        return [
            (
                "piece",
                k,
                vocoding.PieceOrder(k, rng.integers(0, 6561, 20).astype(np.int32), random_voice(k), k, 2),
            )
            for k in (first, first + 1)
        ]

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    assert engine.turn(pieces(0)) == []  # the flow encoder
    monkeypatch.setattr(Estimator, "__call__", interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.turn([])  # the first CFM step
    monkeypatch.undo()
    assert not engine.busy() and engine.keys() == []
    answers, turns = engine.turn(pieces(2)), 1
    while not answers:
        answers, turns = engine.turn([]), turns + 1
    (answer,) = answers
    assert turns == 1 + 2 + 1 + 1 and answer.keys == [2, 3] and answer.error is None


@pytest.mark.parametrize("steps_per_part", [1, 2])
def test_interleaved_vocoding_runs_t3_steps_between_the_parts_of_a_call(tts, monkeypatch, steps_per_part):
    """``vocoding="interleaved"``: S3Gen's calls run on the worker thread, and ``T3_STEPS_PER_PART`` T3 steps
    (a long job's) between two CFM steps of one call (two short jobs' pieces; a lone piece is one part)."""
    monkeypatch.setattr(worker_module, "T3_STEPS_PER_PART", steps_per_part)
    events: list[str] = []
    real_step, real_estimator = ContinuousBatch.step, Estimator.__call__

    def step(self, *args, **kwargs):
        events.append("t3")
        return real_step(self, *args, **kwargs)

    def estimator(self, *args, **kwargs):
        events.append("cfm" if threading.current_thread().name == "mlx-chatterbox-worker" else "elsewhere")
        return real_estimator(self, *args, **kwargs)

    monkeypatch.setattr(ContinuousBatch, "step", step)
    monkeypatch.setattr(Estimator, "__call__", estimator)
    long = SpeechJob("Hello there.", random_voice(1), SamplingParams(max_new_tokens=60), cfm_steps=3, seed=1)
    short = dataclasses.replace(long, params=SamplingParams(max_new_tokens=5), seed=2)
    with Worker(tts, vocode_thread=True, vocoding="interleaved") as worker:
        hold = worker.run(time.sleep, 0.3)  # both start together
        tickets = [worker.submit(job) for job in (long, short, dataclasses.replace(short, seed=3))]
        hold.result()
        for ticket in tickets:
            assert len(np.concatenate(list(ticket))) > 0
    assert "elsewhere" not in events
    first = events.index("cfm")
    between = ["t3"] * steps_per_part
    assert events[first : first + 3 + 2 * steps_per_part] == ["cfm", *between, "cfm", *between, "cfm"], events


def test_vocoding_settings_are_checked(tts):
    assert (
        Worker(tts, vocode_batch=3).vocode_frames == 3 * worker_module.VOCODE_FRAMES_PER_ROW
    )  # scaled with it
    for name in ("vocode_batch", "vocode_frames", "vocode_bucket", "mark_threads"):
        for bad in (0, 1.5, True):
            with pytest.raises(ValueError, match=f"{name}={bad!r} must be an integer of at least 1"):
                Worker(tts, **{name: bad})
    with pytest.raises(ValueError, match="mark_threads=2: marking threads run beside the vocoding thread"):
        Worker(tts, mark_threads=2)
    with pytest.raises(ValueError, match="pass vocode_thread=True too"):
        Worker(tts, vocoding="process")
    with pytest.raises(ValueError, match="vocoding='elsewhere': choose one of thread, process, interleaved"):
        Worker(tts, vocode_thread=True, vocoding="elsewhere")


def test_a_vocoding_process_that_fails_to_start_or_dies(folder, tmp_path, monkeypatch, caplog):
    """The vocoding process loads S3Gen from the model's folder: one it cannot read fails ``start`` with the
    cause, and leaves no thread running and MLX's memory limit as it was. While it runs, the server and the
    process each have half the limit. If the process dies, the jobs it held fail with a clear error, and a new
    process starts at once and serves the next job; not sooner than ``PROCESS_RESTART_S`` after the last start,
    and meanwhile what needs S3Gen fails and ``vocoder_error`` says why; the worker still stops cleanly."""

    def memory_limit() -> int:
        limit = mx.set_memory_limit(0)
        mx.set_memory_limit(limit)
        return limit

    limit = memory_limit()
    tts = TTS.load(folder)
    tts.path = tmp_path / "gone"
    with pytest.raises(RuntimeError, match="the vocoding process could not start: .*config.json"):
        Worker(tts, vocode_thread=True, vocoding="process").start()
    assert memory_limit() == limit
    assert not [t.name for t in threading.enumerate() if t.name.startswith("mlx-chatterbox")]
    tts.path = folder
    slow = SpeechJob("Hello there.", random_voice(1), SamplingParams(max_new_tokens=300), cfm_steps=2, seed=1,
                     stream=True, first_chunk=8)  # fmt: skip
    whole = dataclasses.replace(slow, stream=False, params=SamplingParams(max_new_tokens=5))
    caplog.set_level(logging.WARNING, logger=worker_module.__name__)
    monkeypatch.setattr(worker_module, "PROCESS_RESTART_S", 3600.0)
    with Worker(tts, vocode_thread=True, vocoding="process") as worker:
        assert memory_limit() == limit // 2
        ticket = worker.submit(slow)
        next(iter(ticket))  # its first chunk came through the process
        worker._process._process.kill()
        with pytest.raises(RuntimeError, match=r"the vocoding process ended \(exit code -9\)"):
            list(ticket)
        assert not worker._failed  # its job has ended: nothing of it is kept
        assert len(np.concatenate(list(worker.submit(whole)))) > 0  # through a new process
        assert worker.metrics()["vocoder_restarts"] == 1
        assert "a new vocoding process runs (restart 1)" in caplog.text
        assert worker.vocoder_error is None
        worker._process._process.kill()  # again, within PROCESS_RESTART_S of the last start
        wait_idle(worker)
        with pytest.raises(RuntimeError, match="the vocoding process ended"):
            list(worker.submit(whole))
        assert worker.vocoder_error == "RuntimeError: the vocoding process ended (exit code -9)"
        wait_idle(worker)
        assert worker.metrics()["requests"]["failed"] == 2
        assert worker.metrics()["vocoder_restarts"] == 1
    assert memory_limit() == limit


def test_a_job_sent_as_the_vocoding_process_dies_goes_to_the_next(folder, monkeypatch):
    """A stream opened after the process died but before its reader noticed (here made slow) never reached it:
    the send fails, and the job goes to the new process instead of failing with the dead one's."""
    real = Worker._process_lost

    def slow(self, error):
        time.sleep(0.5)
        real(self, error)

    monkeypatch.setattr(Worker, "_process_lost", slow)
    job = SpeechJob("Hello there.", random_voice(1), SamplingParams(max_new_tokens=8), cfm_steps=2, seed=1,
                    stream=True)  # fmt: skip
    with Worker(TTS.load(folder), vocode_thread=True, vocoding="process") as worker:
        first = np.concatenate(list(worker.submit(job)))
        worker._process._process.kill()
        worker._process._process.join()
        again = np.concatenate(list(worker.submit(job)))
        assert worker.metrics()["vocoder_restarts"] == 1
    assert len(again) == len(first)


@pytest.mark.parametrize("preset", [None, "0", "1"])
def test_the_vocoding_process_keeps_the_servers_cuda_graphs(tts, monkeypatch, caplog, preset):
    """The vocoding process runs MLX with the server's MLX_USE_CUDA_GRAPHS (none: MLX's default, graphs on);
    "0" also keeps the estimator's products MLX's, since our tiled kernel pays only with graphs. It says which
    in the log, and the server's own environment is left as it was."""
    name = vocoding.GRAPHS_VARIABLE
    if preset is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, preset)
    caplog.set_level(logging.INFO, logger=vocoding.__name__)
    with Worker(tts, vocode_thread=True, vocoding="process"):
        pass
    products = "MLX's products" if preset == "0" else "our tiled products"
    assert f"runs MLX with {name}={preset or ''}, the estimator on {products}" in caplog.text
    assert os.environ.get(name) == preset


@pytest.mark.parametrize("vocoding", ["thread", "process", "interleaved"])
def test_streamed_and_whole_jobs_at_once(tts, vocoding):
    """Streamed and whole jobs at once, their S3Gen on the vocoding thread (or in the vocoding process, or in
    parts between T3's steps) while T3 steps: the streamed chunks are TTS.stream's, cut at the same samples,
    within SHARED_TOL (decodes that fall due while another call runs share the next one), the whole audio
    TTS.generate's within SHARED_TOL."""
    specs = [
        dataclasses.replace(job, stream=k % 2 == 0, seed=40 + k)
        for k, job in enumerate(jobs(False) + jobs(True))
    ]
    with Worker(tts, max_batch=6, vocode_thread=True, vocoding=vocoding, stream_catch_up=False) as worker:
        hold = worker.run(time.sleep, 0.3)
        tickets = [worker.submit(job) for job in specs]
        hold.result()
        got = [list(t) for t in tickets]
    for job, chunks in zip(specs, got):
        expected = alone(tts, job)
        assert [len(c) for c in chunks] == [len(c) for c in expected]
        wav, ref = np.concatenate(chunks), np.concatenate(expected)
        assert np.linalg.norm(wav - ref) / np.linalg.norm(ref) < SHARED_TOL


def same_tokens_jobs() -> list[SpeechJob]:
    """Streamed jobs whose T3 draws the same tokens (T3 reads a voice's speaker embedding and T3 prompt only),
    so that their decodes fall due in the same steps, with different S3Gen rows: voice prompts of 40, 13 and 30
    tokens with their own x-vectors, decode windows of 50, 0 and "whole" tokens, watermarked or not."""
    t3_voice = random_voice(1)
    jobs = []
    for seed, gen_tokens, context, watermark in (
        (1, 40, 50, True),
        (6, 13, 0, False),
        (7, 30, "whole", True),
    ):
        other = random_voice(seed, gen_tokens=gen_tokens)
        voice = dataclasses.replace(
            t3_voice,
            s3gen_prompt_tokens=other.s3gen_prompt_tokens,
            s3gen_prompt_mel=other.s3gen_prompt_mel,
            xvector=other.xvector,
        )
        jobs.append(SpeechJob("Hello there.", voice, SamplingParams(max_new_tokens=60), cfm_steps=2, seed=3,
                              watermark=watermark, stream=True, stream_context=context))  # fmt: skip
    return jobs


# A streamed job's chunks against TTS.stream alone when its decodes shared S3Gen calls (fp32, tiny model, rows
# padded to the bucket, watermark on and off): measured relative L2 per job 1.0e-7 to 2.8e-7; lengths exact.
STREAM_SHARED_TOL = 1e-5


@pytest.mark.parametrize("vocode_batch", [3, 2])
def test_streamed_decodes_due_in_one_step_share_an_s3gen_call(tts, monkeypatch, vocode_batch):
    """The chunk decodes that fall due in the same T3 step run together (``decode_together``, up to
    vocode_batch rows a call): one S3Gen call for them, not one each; each job's chunks equal TTS.stream's
    within STREAM_SHARED_TOL, chunk for chunk."""
    rows, singles = [], []
    real_batch_mel, real_mel = tts.s3gen.batch_mel_steps, tts.s3gen.mel

    def batch_spy(tokens, voices, **kwargs):
        rows.append(len(tokens))
        return real_batch_mel(tokens, voices, **kwargs)

    def mel_spy(*args, **kwargs):
        singles.append(threading.current_thread().name)
        return real_mel(*args, **kwargs)

    monkeypatch.setattr(tts.s3gen, "batch_mel_steps", batch_spy)
    monkeypatch.setattr(tts.s3gen, "mel", mel_spy)
    specs = same_tokens_jobs()
    with Worker(tts, vocode_batch=vocode_batch) as worker:
        hold = worker.run(time.sleep, 0.3)  # all three start together
        tickets = [worker.submit(job) for job in specs]
        hold.result()
        got = [list(t) for t in tickets]
    monkeypatch.undo()
    expected = [alone(tts, job) for job in specs]
    # TTS.stream's chunks: one per chunk decode, the last the end's. Each step's three decodes share a call
    # (vocode_batch=2: a call of two, one alone), and each job's end decodes alone.
    decodes = len(expected[0]) - 1
    assert decodes >= 2 and all(len(e) == decodes + 1 for e in expected)
    assert rows == [min(3, vocode_batch)] * decodes
    assert singles.count("mlx-chatterbox-worker") == 3 + (3 - vocode_batch) * decodes
    errors = []
    for job, chunks, expected in zip(specs, got, expected):
        assert [len(c) for c in chunks] == [len(c) for c in expected]
        a, b = np.concatenate(chunks), np.concatenate(expected)
        errors.append(float(np.linalg.norm(a - b) / np.linalg.norm(b)))
    print("rel. L2 per job:", ["%.1e" % e for e in errors])
    assert 0 < max(errors) < STREAM_SHARED_TOL, errors


def test_a_streamed_jobs_error_after_a_shared_decode_ends_that_job_alone(tts, monkeypatch):
    """Three streams' decodes share an S3Gen call; handing one job's audio over fails (its watermark, here):
    that job ends with the error, the other two stream on to TTS.stream's audio. A shared call that fails
    ends the jobs in it, and the worker goes on."""
    specs = same_tokens_jobs()
    specs[0] = dataclasses.replace(specs[0], watermark=False)  # job 2 alone is watermarked now
    real_mark = tts._mark_chunk

    def broken(chunk):
        raise RuntimeError("watermark broke")

    monkeypatch.setattr(tts, "_mark_chunk", broken)
    with Worker(tts) as worker:
        hold = worker.run(time.sleep, 0.3)
        tickets = [worker.submit(job) for job in specs]
        hold.result()
        with pytest.raises(RuntimeError, match="watermark broke"):
            list(tickets[2])
        got = [list(t) for t in tickets[:2]]
        monkeypatch.setattr(tts, "_mark_chunk", real_mark)

        def out_of_memory(vocoders, **kwargs):
            raise RuntimeError("out of memory")

        monkeypatch.setattr(worker_module, "decode_together", out_of_memory)
        hold = worker.run(time.sleep, 0.3)
        tickets = [worker.submit(job) for job in specs]
        hold.result()
        for ticket in tickets:
            with pytest.raises(RuntimeError, match="out of memory"):
                list(ticket)
        assert len(list(worker.submit(jobs(False)[2]))) == 1
    for job, chunks in zip(specs, got):
        expected = alone(tts, job)
        assert [len(c) for c in chunks] == [len(c) for c in expected]
        a, b = np.concatenate(chunks), np.concatenate(expected)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < STREAM_SHARED_TOL


def phases(metrics: dict, thread: str = "worker") -> dict[str, dict]:
    return {p["phase"]: p for p in metrics["phases"] if p["thread"] == thread}


@pytest.mark.parametrize("vocoder", ["inline", "thread", "process", "interleaved"])
def test_metrics_count_where_the_time_goes(tts, vocoder):
    """``Worker.metrics``: after N whole jobs the T3 rows are their tokens, each piece is vocoded once (on the
    vocoding thread when there is one), N jobs finished; a streamed job moves the streamed decodes instead (on
    the same thread as the pieces; the vocoding process's calls count as that thread's, interleaved calls as
    the worker thread's, each call once however many parts it ran in), a
    bad voice counts as failed and a cancelled job as cancelled; the worker thread's phases take no more than
    its uptime."""
    specs = [dataclasses.replace(job, seed=50 + k) for k, job in enumerate(jobs(False)[::2])]  # a piece each
    start = time.perf_counter()
    vocode_thread = vocoder != "inline"
    vocoding = "thread" if vocoder == "inline" else vocoder
    with Worker(tts, vocode_thread=vocode_thread, vocoding=vocoding) as worker:
        before = worker.metrics()
        assert before["requests"] == {"finished": 0, "failed": 0, "cancelled": 0}
        assert all(p["calls"] == 0 for p in before["phases"] if p["phase"] not in ("gc", "idle"))
        hold = worker.run(time.sleep, 0.3)  # both start together
        tickets = [worker.submit(job) for job in specs]
        hold.result()
        for ticket in tickets:
            list(ticket)
        whole = worker.metrics()
        streamed = jobs(True)[0]
        list(worker.submit(streamed))
        bad = dataclasses.replace(
            specs[0], voice=dataclasses.replace(random_voice(), speaker_emb=mx.zeros((1, 7)))
        )
        with pytest.raises(ValueError):
            list(worker.submit(bad))
        ticket = worker.submit(endless_job())
        next(iter(ticket))
        ticket.cancel()
        wait_idle(worker)
        after = worker.metrics()
    wall = time.perf_counter() - start
    on = "vocoder" if vocoder in ("thread", "process") else "worker"

    w = phases(whole)
    threads = {"worker": 1, "vocoder": 1, "marker": 1} if vocode_thread else {"worker": 1}
    if vocoder == "interleaved":
        del threads["vocoder"]
    assert whole["threads"] == threads
    assert whole["requests"] == {"finished": 2, "failed": 0, "cancelled": 0}
    tokens = [j.params.max_new_tokens for j in specs]
    assert w["t3_step"]["rows"] == sum(t.speech_tokens for t in tickets) == sum(tokens)
    assert w["t3_step"]["calls"] == max(tokens)  # together from the first step
    assert w["admit"]["calls"] == 2 and w["hand_over"]["calls"] == 2
    v = phases(whole, on)["vocode"]
    assert v["rows"] == 2 and 1 <= v["calls"] <= 2
    assert w["stream_decode"]["calls"] == w["emit"]["calls"] == 0
    for phase in ("t3_step", "admit", "hand_over"):
        assert w[phase]["seconds"] > 0, phase
    assert v["seconds"] > 0
    if on == "vocoder":
        assert w["vocode"]["calls"] == 0 and phases(whole, "vocoder")["idle"]["seconds"] > 0
    if vocode_thread:
        marker = phases(
            whole, "marker"
        )  # what readers get goes through it; one of the two jobs is watermarked
        assert marker["idle"]["calls"] > 0 and marker["mark"]["calls"] == 1 and marker["mark"]["seconds"] > 0
    else:
        assert {p["thread"] for p in whole["phases"]} == {"worker"}

    a = phases(after)
    assert after["requests"] == {"finished": 3, "failed": 1, "cancelled": 1}
    # The streamed job: its chunk decodes (tokens past its first chunk) and the end's, each chunk emitted.
    decodes = phases(after, on)["stream_decode"]
    assert decodes["calls"] >= 2 and decodes["rows"] >= decodes["calls"] and decodes["seconds"] > 0
    assert a["emit"]["calls"] >= 2 and a["emit"]["seconds"] > 0
    assert phases(after, on)["vocode"]["rows"] == 2  # the failed job never reached S3Gen
    assert a["idle"]["calls"] > 0 and a["idle"]["seconds"] > 0
    assert after["jobs"] == after["waiting"] == after["running"] == after["vocode_pending"] == 0
    assert after["t3_traces"] >= whole["t3_traces"] >= before["t3_traces"]  # counted exactly: test_batch.py
    busy = sum(p["seconds"] for p in a.values())
    assert busy <= after["uptime"] < wall, (busy, after["uptime"], wall)
