"""The server's engine: one thread owns the model and runs every request's T3 together (continuous batching).

Request handlers (any thread, or asyncio) ``submit`` a ``SpeechJob`` and read its audio from the ``Ticket`` they
get back, as chunks. The worker thread admits jobs up to ``max_batch`` at a time into one ``SpeechTokenBatch``,
steps it, routes each token to its job, and vocodes a job's text piece when T3 finishes it (or, for streamed
jobs, chunk by chunk through a ``StreamVocoder`` as the tokens arrive). Whole pieces that are ready are vocoded
together (``S3Gen.batch``), and so are the streams' chunk decodes that are due (``decode_together``; both up to
``vocode_batch`` rows and ``vocode_frames`` frames a call). By default this runs on the worker thread after the
step that made it ready (T3 waits); with ``vocode_thread=True`` it runs on a second thread while T3 keeps
stepping, which takes, call after call, what became ready while it was busy (streams' decodes first). A job's
audio is what ``TTS.generate`` gives for the same arguments and seed (``TTS.stream`` for streamed jobs, chunk
for chunk, cut at the same samples: a stream takes its tokens one push at a time, as ``TTS.stream`` does, up to
its next due decode): pieces, budgets, seeds per piece, crossfades, pause tags' silences and watermark as
there; exactly, except that pieces and chunks decoded together are equal up to float error, and that an
unseeded job's S3Gen seed is drawn. With ``vocode_thread=True`` a third thread, the marking thread, watermarks
what readers get and hands it over, in order, so that Perth's work (on one H200 host 47 ms a whole request, on
the T3 thread) keeps neither T3 nor S3Gen waiting. Apart from those threads' work (each on its own MLX stream,
with arrays of its own: the vocoding thread makes the streams' vocoders), all MLX work happens on the worker
thread.

``serve`` runs the vocoding thread by default with MLX-CUDA only (``default_vocode_thread``): there it took 128
concurrent whole requests from 11.4x to 20.0x real time (H200, 2026-12-02); on 2 CPU cores it lost (T3 and
S3Gen share the cores, and S3Gen's process-wide memory bound holds T3's evaluations back too: 8 whole requests
13.2 s threaded against 6.7 s), and on Metal it has not been measured. Streams' decodes moved to it on
2026-12-02 after an H200 run (64 streams, bf16 CFM) spent 83% of the worker thread in them, 2.4 decodes a call,
T3 waiting: on 2 CPU cores 16 streams then shared 7.1 decodes a call instead of 1.4 (GPU not yet measured).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import itertools
import logging
import os
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Literal, TypeVar

import mlx.core as mx
import numpy as np

from ..api import CROSSFADE, TTS
from ..generation.batch import BatchRequest, SpeechTokenBatch, batch_size
from ..generation.pieces import Plan, join_audio, token_budget
from ..generation.speech_tokens import traces
from ..generation.stream import CHUNK
from ..generation.stream import CONTEXT as STREAM_CONTEXT
from ..generation.stream import (
    FIRST_CHUNK,
    PieceJoiner,
    StreamVocoder,
    check_chunks,
    check_context,
    cut_end,
    decode_together,
    finish_stream,
    playback_first_chunk,
)
from ..generation.turbo import TurboSpeech
from ..generation.turbo_batch import NO_TOKEN, TurboTokenBatch
from ..generation.vocode import check_cfm_steps
from ..generation.voice import Voice
from ..sampling import SEED_LIMIT, SamplingParams, TurboParams, seed_keys
from .metrics import Meter
from .vocoding import (
    PieceOrder,
    ProcessSpec,
    StreamOrder,
    Streamed,
    Vocoded,
    Vocoding,
    VocodingProcess,
    cfm_dtype_name,
    group,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")
_END = object()  # a ticket's last item
_SERIALS = itertools.count()  # jobs' and pieces' numbers: their keys in the vocoding process
# A warm-up request's tokens: past a stream's first chunk (10 tokens), and no more: on a CPU every warm-up token
# delays the server's start by most of a second.
WARM_UP_TOKENS = 12
# The text of ``first_chunk_gap``'s request: long enough that T3 does not stop before its two chunks.
MEASURE_TEXT = "This sentence is long enough to keep the model talking for a few seconds while it is timed."
# Pieces vocoded in one S3Gen call: by default at most this many mel frames (rows x the longest row, padded) for
# each of ``vocode_batch`` rows, a 10 s voice prompt and 20 s of speech; rows padded to a multiple of 25 tokens
# (1 s) so that calls repeat shapes (GPU kernel plans and graphs are per shape).
VOCODE_FRAMES_PER_ROW = 1500
VOCODE_BUCKET = 25
# Where the vocoding thread's S3Gen work runs (``Worker(vocoding=...)``, ``serve --vocoding``): on that thread,
# in a process of its own, or on the worker thread a part of a call between two T3 steps.
VOCODINGS = ("thread", "process", "interleaved")
# After the vocoding process dies, the vocoding thread starts a new one at once, but not sooner than this after
# the last start: a process that dies again at once (a lost GPU) is retried this often, not in a loop.
PROCESS_RESTART_S = 10.0
# With vocoding="interleaved": T3 steps between two parts of an S3Gen call while T3 has rows to step. A stream
# needs 25 tokens a second; on an H200 a 64-row T3 step took ~11 ms alone and a CFM step of 28 streams ~50 (an
# estimate from run E's estimator cost), so one step a part would give T3 about 17 a second. On the H200 (run U,
# 2026-12-04) 32 streams made 20.8x real time interleaved against 33.7x with the thread; not tuned further
# (``probe_worker --t3-steps-per-part``).
T3_STEPS_PER_PART = 1


def default_vocode_thread() -> bool:
    """``serve --vocode-thread auto``: a vocoding thread with MLX-CUDA, where S3Gen is GPU-bound while T3's steps
    are host-bound (128 concurrent whole requests on an H200: 11.4x real time without, 20.0x with, 2026-12-02);
    none on CPUs, where the two share the cores (8 whole requests: 6.7 s without, 13.2 s with, on 2 cores)."""
    return _on_cuda()


def default_vocoding(tts: TTS, vocode_thread: bool) -> str:
    """``serve --vocoding auto``: with the vocoding thread on MLX-CUDA, S3Gen's work in a process of its own.
    On an H200, against the thread: without CUDA graphs there (run AA) a lone English stream's first audio
    0.37-0.41 s against 0.49-0.51, Turbo's 0.22 against 0.27, 64 Turbo streams 76x real time against 55x; with
    them and the tiled kernel, as now (run AL), English's first audio 0.25 s against 0.22, 16 streams 30.5x
    against 32.7x, Turbo's first audio 0.18 s each. Elsewhere (and with upstream's S3Gen, which runs only here)
    the thread: not measured on Macs."""
    return "process" if vocode_thread and _on_cuda() and tts.torch_s3gen is None else "thread"


def default_mark_threads(vocode_thread: bool) -> int:
    """``serve --mark-threads auto``: with the vocoding thread, a quarter of the CPU's cores, 1 to 4 (Perth's host
    work per 10 s of audio is 55-75 ms: one marking thread was busy 8.4 s of a 19 s burst of 128 whole requests on
    an H200, the longest stage of Turbo's; with four, English went from 53.5x to 73.7x real time and Turbo from
    98x to 145x, RESULTS runs O and P); without it, the one thread there is."""
    return max(1, min(4, (os.cpu_count() or 1) // 4)) if vocode_thread else 1


def default_warm_batches() -> bool:
    """``serve --warm-batches auto``: with MLX-CUDA, where a batch of a new size costs its first requests seconds
    of kernel builds the first time on a machine (``Worker.warm_batches``); not elsewhere, where a new size
    costs a trace of tens of milliseconds and the warm-up's steps at every count (compute-bound there) would
    delay the start the most."""
    return _on_cuda()


def _on_cuda() -> bool:
    return mx.default_device() != mx.cpu and hasattr(mx, "cuda") and mx.cuda.is_available()


@dataclasses.dataclass(frozen=True)
class SpeechJob:
    """One request: as the arguments of ``TTS.generate`` (``stream``: of ``TTS.stream``)."""

    text: str
    voice: Voice
    params: SamplingParams | TurboParams = SamplingParams()  # the model's kind (TTS.speech.params_type)
    cfm_steps: int | None = None
    seed: int | None = None
    watermark: bool = True
    stream: bool = False  # chunks as T3's tokens arrive; else one chunk, the whole audio
    # A streamed job's decode window in speech tokens, or "whole" (TTS.stream's context).
    stream_context: int | Literal["whole"] = STREAM_CONTEXT
    first_chunk: int = FIRST_CHUNK  # a streamed job's speech tokens before its first decode (TTS.stream's)
    language: str | None = None  # the multilingual models' (required there)
    # Called with (piece, pieces, budget), 1-based, for a piece that stops at its budget without the stop token,
    # instead of the worker's warning (bulk synthesis names the item in its own).
    on_cut: Callable[[int, int, int], None] | None = None


class QueueFull(Exception):
    """``max_queue`` jobs are already waiting or running."""


class Ticket:
    """A submitted job's audio: float32 mono chunks at ``sample_rate``, read once, by a thread (``for``) or by
    asyncio (``async for``); the job's error, if it fails, is raised there."""

    def __init__(self, sample_rate: int, text_tokens: int):
        self.sample_rate = sample_rate
        self.text_tokens = text_tokens
        self.speech_tokens = 0  # grows as T3 draws (usage)
        self.cancelled = False
        # When each step towards the first audio happened (perf_counter; the worker's threads write each once):
        # "admitted" (into T3's batch), "first_token", "first_chunk" (a stream's first ``first_chunk`` tokens
        # drawn), "first_audio" (samples out of S3Gen, or a leading pause's silence, before the watermark) and
        # "first_ready" (handed to the reader). The server sends them as Server-Timing (app.server_timing).
        self.times: dict[str, float] = {}
        self._lock = threading.Lock()
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aitems: asyncio.Queue | None = None

    def cancel(self) -> None:
        """The reader is gone: the worker drops the job at its next step."""
        self.cancelled = True

    def _note(self, event: str) -> None:
        """From the worker's threads: ``event`` happened now, if it had not before (``times``)."""
        if event not in self.times:  # (every later chunk passes here too: no clock read for it)
            self.times[event] = time.perf_counter()

    def _put(self, item: Any) -> None:
        """From the worker thread: a chunk, an exception, or _END."""
        if isinstance(item, np.ndarray) and item.size:
            self._note("first_ready")
        with self._lock:
            if self._aitems is None:
                self._items.put(item)
                return
            try:
                self._loop.call_soon_threadsafe(self._aitems.put_nowait, item)
            except RuntimeError:  # the reader's event loop has closed: nobody reads any more
                self.cancelled = True

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            item = self._items.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def __aiter__(self) -> AsyncIterator[np.ndarray]:
        with self._lock:  # from now on the worker hands items to this loop
            if self._aitems is None:
                self._loop, self._aitems = asyncio.get_running_loop(), asyncio.Queue()
                while not self._items.empty():
                    self._aitems.put_nowait(self._items.get())
        while True:
            item = await self._aitems.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


@dataclasses.dataclass(eq=False)  # compared by identity: a key of the vocoding side's streams
class _Job:
    """A job on the worker thread: its pieces and pauses, the piece in T3 now and its raw tokens, and the
    audio so far."""

    job: SpeechJob
    ticket: Ticket
    plan: Plan
    piece_ids: list[list[int]]  # each piece's text token ids, tokenized once at submit
    piece: int = 0
    uid: int | None = None  # its request in the batch
    raw: list[int] = dataclasses.field(default_factory=list)
    wavs: list[np.ndarray] = dataclasses.field(default_factory=list)  # finished pieces (not streamed)
    vocoder: StreamVocoder | None = None  # the piece being streamed, on the worker thread
    piped: bool = False  # the piece being streamed has its StreamVocoder on the vocoding side (Vocoding)
    joiner: PieceJoiner = dataclasses.field(default_factory=lambda: PieceJoiner(CROSSFADE))  # streamed pieces
    ended: bool = False  # its reader has had the end or an error (_done)
    lane: int = 0  # the marking thread that watermarks all it hands over, in order
    serial: int = dataclasses.field(default_factory=lambda: next(_SERIALS))

    def seed(self) -> int | None:
        """Piece i is spoken with seed + i, as ``TTS.generate`` does."""
        return None if self.job.seed is None else self.job.seed + self.piece


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: a key of the vocoding side's pieces
class _Piece:
    """A whole piece T3 has finished, sent to be vocoded: its job, and the samples to drop from the end of its
    audio (TTS.speech.cut_samples)."""

    j: _Job
    cut: int
    serial: int = dataclasses.field(default_factory=lambda: next(_SERIALS))


class Worker:
    """Runs speech jobs on a background thread, T3 batched over up to ``max_batch`` jobs at once, and whole
    pieces and streamed chunks vocoded as they become ready, up to ``vocode_batch`` of them (and
    ``vocode_frames`` mel frames, by default ``VOCODE_FRAMES_PER_ROW`` a row, rows padded to multiples of
    ``vocode_bucket`` tokens) in one S3Gen call: after the step that made them ready, or, ``vocode_thread=True``,
    on a second thread while T3 keeps stepping (and the watermark on ``mark_threads`` more, each job's audio on
    one of them). At most ``max_queue`` jobs wait or run (``submit`` raises ``QueueFull`` beyond).

    vocoding (with ``vocode_thread``): where that thread's S3Gen work runs: "thread" (there), "process" (in a
    process of its own, ``VocodingProcess``: no GIL nor MLX throttle shared with T3; the device time-slices the
    two), or "interleaved" (on the worker thread, a part of a call (the flow encoder, a CFM step, HiFT) queued
    between two T3 steps on one MLX stream, so that the device runs them one after the other, not side by side;
    no vocoding thread then, the marking threads still run).

    stream_catch_up (with ``vocode_thread``): a stream whose tokens waited for S3Gen (its decode ran late, in a
    busy call, or the thread woke after several T3 steps) takes them all into its next decode, so a loaded
    server runs fewer, longer decodes per stream; its chunk boundaries then depend on timing. False: every
    stream's chunks are ``TTS.stream``'s, whatever the load."""

    def __init__(
        self,
        tts: TTS,
        *,
        max_batch: int = 32,
        max_queue: int = 128,
        vocode_batch: int = 8,
        vocode_frames: int | None = None,
        vocode_bucket: int = VOCODE_BUCKET,
        vocode_thread: bool = False,
        vocoding: str = "thread",
        stream_catch_up: bool = True,
        mark_threads: int = 1,
    ):
        if vocode_frames is None:  # as many long rows as vocode_batch allows: --vocode-batch sets both
            vocode_frames = vocode_batch * VOCODE_FRAMES_PER_ROW
        for name, value in (
            ("max_batch", max_batch),
            ("max_queue", max_queue),
            ("vocode_batch", vocode_batch),
            ("vocode_frames", vocode_frames),
            ("vocode_bucket", vocode_bucket),
            ("mark_threads", mark_threads),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer of at least 1")
        if not tts.speech.batchable:
            raise ValueError(
                f"the {tts.speech.variant} model decodes one request at a time (upstream 0.1.7's alignment "
                "analyzer reads each request's attention as it goes), and this engine batches requests: serve "
                "multilingual-v3, or call TTS.generate / TTS.stream directly"
            )
        self.tts, self.max_batch, self.max_queue = tts, max_batch, max_queue
        self.vocode_batch, self.vocode_frames, self.vocode_bucket = vocode_batch, vocode_frames, vocode_bucket
        self.vocode_thread, self.stream_catch_up = vocode_thread, stream_catch_up
        if mark_threads > 1 and not vocode_thread:
            raise ValueError(
                f"mark_threads={mark_threads}: marking threads run beside the vocoding thread, which is off; "
                "pass vocode_thread=True, or mark_threads=1"
            )
        if vocoding not in VOCODINGS:
            raise ValueError(f"vocoding={vocoding!r}: choose one of {', '.join(VOCODINGS)}")
        if vocoding != "thread" and not vocode_thread:
            raise ValueError(
                f"vocoding={vocoding!r} places the vocoding thread's S3Gen work, and the thread is off; pass "
                "vocode_thread=True too"
            )
        if vocoding != "thread" and tts.torch_s3gen is not None:
            raise ValueError(
                f"vocoding={vocoding!r} runs our S3Gen; this model vocodes with upstream's (hybrid mode)"
            )
        self.mark_threads, self.vocoding = mark_threads, vocoding
        self.sample_rate = tts.sample_rate
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # _Job or (fn, args, future) or None (stop)
        self._jobs = 0  # submitted and not finished (under _lock)
        self._submitted = 0  # jobs ever submitted (under _lock): they take the marking threads in turn
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._device = mx.default_device()  # MLX streams belong to a thread: the worker makes its own
        # S3Gen's side: on the worker thread (whole pieces; streams decode through their own vocoders there),
        # on the vocoding thread, or in the vocoding process (``_remote``: what was sent there and not
        # answered, by serial; ``_lost``: the error that ended it, until a new one starts; ``_failed``: the
        # serials of the jobs it held, whose later messages go nowhere until they end). The worker's messages
        # for it, oldest first, under _ready (``Vocoding``'s: ("piece", _Piece, order), ("open", job, order),
        # ("take"/"end", job, tokens), ("drop", job)); ``_outbox``: those not yet sent (``_send``).
        one = None
        if tts.torch_s3gen is not None:  # hybrid mode: upstream's S3Gen, one piece at a time
            one = lambda o: tts.vocode(
                o.tokens, o.voice, cfm_steps=o.cfm_steps, seed=o.seed, watermark=False
            )  # noqa: E731
        self._engine = Vocoding(
            tts.s3gen,
            batch=vocode_batch,
            frames=vocode_frames,
            bucket=vocode_bucket,
            catch_up=stream_catch_up,
            timed=self._timed,
            vocode_one=one,
            sliced=self.vocoding == "interleaved",
        )
        self._process: VocodingProcess | None = None
        self._remote: dict[int, _Job | _Piece] = {}
        self._remote_lock = threading.Lock()
        self._lost: BaseException | None = None
        self._failed: set[int] = set()
        self._spec: ProcessSpec | None = None
        self._next_start = 0.0  # time.monotonic() before which no new process starts
        self._restarts = 0
        self._pieces_out = 0  # whole pieces sent to be vocoded, not yet back
        self._ready = threading.Condition()
        self._vocoder: threading.Thread | None = None
        self._vocoder_stop = False
        self._messages: list[tuple] = []
        self._outbox: list[tuple] = []
        self._steps_since_part = 0  # vocoding="interleaved": T3 steps since S3Gen's last part
        # What readers get, oldest first, per marking thread when they run (vocode_thread=True): (ticket, item,
        # how to watermark it or None), watermarked there and handed over in order (``_deliver``); None stops it.
        # Perth's host work (resampling, FFTs) releases the GIL: several threads mark several jobs at once.
        self._deliveries: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(mark_threads)]
        self._markers: list[threading.Thread] = []
        threads = {"worker": 1, "vocoder": 1, "marker": mark_threads} if vocode_thread else {"worker": 1}
        if self.vocoding == "interleaved":
            del threads["vocoder"]
        self._meter = Meter(threads)
        # Jobs waiting for T3 and in its batch, as the worker loop's last turn began (``metrics``).
        self._waiting = self._running = 0

    def __enter__(self) -> Worker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def vocoder_error(self) -> str | None:
        """Why S3Gen's side is down (``vocoding="process"``: its process died and no new one runs yet), or
        None."""
        lost = self._lost
        return None if lost is None else f"{type(lost).__name__}: {lost}"

    @property
    def jobs(self) -> int:
        """Jobs waiting or running."""
        return self._jobs

    def metrics(self) -> dict:
        """Where the worker's time went and what it holds now: ``Meter.snapshot()`` (wall seconds, calls and
        rows of each thread's phases since the worker was made, jobs ended by outcome) with ``jobs``
        (submitted, not ended), ``waiting`` (for T3), ``running`` (in T3's batch), ``vocode_pending`` (whole
        pieces T3 has finished and S3Gen not yet: waiting or in its running call), ``t3_traces``
        (``speech_tokens.traces``: T3's compiled steps traced in this process) and ``vocoder_restarts`` (new
        vocoding processes after one died). Read from any thread, without waiting for the worker."""
        gauges = dict(jobs=self._jobs, waiting=self._waiting, running=self._running, t3_traces=traces())
        gauges["vocoder_restarts"] = self._restarts
        return {**self._meter.snapshot(), **gauges, "vocode_pending": self._pieces_out}

    def start(self) -> None:
        """Start the worker thread (and, ``vocoding="process"``, first the vocoding process: its S3Gen loaded
        from the model's folder, which takes seconds; an error there is raised here, with nothing left running).
        While it runs, Python's automatic garbage collection is off and the worker thread collects instead
        (``_collect_garbage``): a collection frees the MLX arrays in the cycles it breaks, and MLX-CUDA frees
        can make CUDA calls, which break a CUDA-graph capture running on the worker thread meanwhile and abort
        the process ("cudaStreamEndCapture failed"; H200 runs of 1 to 8 requests, whose readers' threads
        collected). For the same reason, do MLX work only through ``run`` while a worker runs.

        The caller's queued MLX work is finished first: the worker reads arrays made on the caller's stream
        (weights, voices, caches), and a read of one whose work is still queued there makes the worker's stream
        wait on the caller's. On the H200 a worker started right after ``tts.stream`` on the caller's thread
        aborted the same way (1 run of 1, 2026-12-02), and none of 3 runs did once the caller synchronised;
        workers started with no MLX work queued on the caller's thread ran 3 runs of 3 either way."""
        if self._thread is not None:
            raise RuntimeError("the worker has already been started")
        if self.vocode_thread:
            self.tts.watermarker()  # loaded here, once: the marking threads would each load it on first use
            self._vocoder_stop, self._lost = False, None
            if self.vocoding == "process":
                self._process = self._start_process()
        mx.synchronize()
        _pause_automatic_gc()
        self._thread = threading.Thread(target=self._loop, name="mlx-chatterbox-worker", daemon=True)
        self._thread.start()
        if self.vocode_thread:
            if self.vocoding != "interleaved":
                self._vocoder = threading.Thread(
                    target=self._send_loop if self.vocoding == "process" else self._vocode_loop,
                    name="mlx-chatterbox-vocoder",
                    daemon=True,
                )
                self._vocoder.start()
            self._markers = [
                threading.Thread(
                    target=self._mark_loop, args=(d,), name=f"mlx-chatterbox-marker-{i}", daemon=True
                )
                for i, d in enumerate(self._deliveries)
            ]
            for marker in self._markers:
                marker.start()

    def close(self) -> None:
        """Stop after the running step and S3Gen call; jobs not finished get an error."""
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join()
            self._thread = None
            if self._markers:  # after what the worker handed them last
                for deliveries in self._deliveries:
                    deliveries.put(None)
                for marker in self._markers:
                    marker.join()
                self._markers = []
            _resume_automatic_gc()

    def submit(self, job: SpeechJob) -> Ticket:
        """Check ``job`` (ValueError naming the problem) and queue it; its audio comes through the ticket."""
        tts = self.tts
        if not isinstance(job.params, tts.speech.params_type):
            raise ValueError(
                f"params must be a {tts.speech.params_type.__name__} for the {tts.speech.variant} model"
            )
        tts.speech.check(job.params)
        check_cfm_steps(job.cfm_steps)
        check_context(job.stream_context)
        check_chunks(job.first_chunk, CHUNK, tts.s3gen.flow.config.pre_lookahead_len)
        if job.stream and tts.torch_s3gen is not None:
            raise ValueError("streaming needs our S3Gen; this server runs upstream's (hybrid mode)")
        plan = tts._plan(job.text, job.language)  # an empty text or a bad pause tag is refused here
        piece_ids = [tts.text_ids(p, job.language) for p in plan.pieces]
        ticket = Ticket(self.sample_rate, sum(len(ids) for ids in piece_ids))
        with self._lock:
            if self._thread is None:
                raise RuntimeError("the worker is not running; start() it first")
            if self._jobs >= self.max_queue:
                raise QueueFull(f"{self._jobs} requests are already queued (the limit is {self.max_queue})")
            self._jobs += 1
            self._submitted += 1
            lane = self._submitted % self.mark_threads
        self._inbox.put(_Job(job, ticket, plan, piece_ids, lane=lane))
        return ticket

    def warm_up(
        self, voice: Voice, language: str | None = None, first_chunk: int = FIRST_CHUNK, whole: bool = True
    ) -> None:
        """Run a short streamed request and a short whole one to the end, so that the first real request does
        not pay for compiling kernels and tracing steps (issue 24: 1.56 s to the first byte of a cold server,
        0.68 s warm, on the H200). ``serve`` calls it before it listens. ``language``: for the multilingual
        models. ``first_chunk``: the streams' (their first decode's length: with MLX-CUDA its convolution
        graphs are then built, ~100 ms, run AP): the stream runs past it. The audio is dropped. ``whole=False``
        runs the streams alone (``serve`` warming streams again at another first chunk).

        The stream runs once for each marking thread (jobs take the threads in turn): each marks on an MLX stream
        of its own, whose CUDA graphs are its own, and a thread's first chunk took 17 ms to mark on an H100
        against 4 on a warm one (run AU)."""
        for stream in [True] * max(1, self.mark_threads) + ([False] if whole else []):
            budget = WARM_UP_TOKENS + (first_chunk if stream else 0)
            params = self.tts.speech.params_type(max_new_tokens=budget)
            job = SpeechJob(
                "Warming up.",
                voice,
                params,
                seed=0,
                stream=stream,
                first_chunk=first_chunk,
                language=language,
            )
            for _ in self.submit(job):
                pass

    def warm_batches(self, voice: Voice, language: str | None = None) -> list[int]:
        """Step T3's batch at every slot count it can be laid out in up to ``max_batch`` (``batch_size``'s: 1 ..
        8, 10, 12, 14, 16, 20, ...), so that requests arriving in groups of any size wait neither for the step
        to be traced nor for its kernels to be built (``serve --warm-batches``). Each count costs a prefill of
        that many short requests, two steps and, with MLX-CUDA, the first time on a machine, the kernels built
        for its number of rows (H200: 12 s for 4 requests, 1.8 s for 16, none new from 64; a trace of 10-90 ms and
        the prefill once they are on disk). Returns the slot counts."""
        text_ids = self.tts.text_ids("Warming up.", language)
        params = self.tts.speech.params_type(max_new_tokens=WARM_UP_TOKENS)
        counts = sorted({batch_size(n) for n in range(1, self.max_batch + 1)})
        self.run(self._warm_batches, text_ids, voice, params, counts).result()
        return counts

    def _warm_batches(
        self, text_ids: list[int], voice: Voice, params: SamplingParams | TurboParams, counts: list[int]
    ) -> None:
        for n in counts:
            batch = self._new_batch()
            for i in range(n):  # keyed draws, as the jobs' (seeded or not): the same compiled step
                batch.add(BatchRequest(text_ids, voice, params, key=seed_keys(i)[0]))
            batch.step()  # the prefill, and the first decode step queued: traced, its kernels built
            batch.step()
        mx.synchronize()
        # The batches' buffers go back to the device. Left in MLX's cache (30 GB at up to 128 requests on an
        # H200), they slowed every lone request after: on one machine 10 s of audio took 1.56 s instead of 1.24
        # and T3 stepped at 4.3 ms instead of 3.2 (run W). Why a full cache does that was not found.
        del batch
        mx.clear_cache()

    def playback_first_chunk(self, voice: Voice, language: str | None = None) -> int:
        """The first chunk (speech tokens) after which a lone stream plays on without a gap on this machine
        (``serve --first-chunk auto``): ``playback_first_chunk`` of ``first_chunk_gap``."""
        gap = self.first_chunk_gap(voice, language)
        first_chunk = playback_first_chunk(gap, self.tts.s3gen.flow.config.pre_lookahead_len)
        logger.info(
            "a stream's second chunk came %.3f s after its first: first chunks of %d tokens", gap, first_chunk
        )
        return first_chunk

    def first_chunk_gap(self, voice: Voice, language: str | None = None) -> float:
        """Seconds from a streamed request's first chunk to its second (``CHUNK`` tokens of T3, then a decode
        and its watermark), alone on a warm worker: what ``serve --first-chunk auto`` sizes first chunks by
        (``playback_first_chunk``). Runs a request of ``FIRST_CHUNK + CHUNK`` tokens twice and takes the second
        (the first may still compile kernels for the second decode's length); the audio is dropped."""
        params = self.tts.speech.params_type(max_new_tokens=FIRST_CHUNK + CHUNK)
        job = SpeechJob(MEASURE_TEXT, voice, params, seed=0, stream=True, language=language)
        for _ in range(2):
            times = [time.perf_counter() for chunk in self.submit(job) if chunk.size]
            if len(times) < 2:
                raise RuntimeError(
                    f"the measuring request gave {len(times)} chunk(s), not 2: T3 stopped early; pass "
                    "--first-chunk N"
                )
        return times[1] - times[0]

    def run(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` on the worker thread, between two steps (model work such as cloning a voice)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._thread is None:
            raise RuntimeError("the worker is not running; start() it first")
        self._inbox.put((fn, args, future))
        return future

    def memory(self) -> concurrent.futures.Future[dict[str, int]]:
        """MLX's active, peak and cache memory in bytes, read on the worker thread between two steps (ADR 10:
        no MLX call on another thread while the worker runs)."""
        return self.run(_mlx_memory)

    # The worker thread.

    def _loop(self) -> None:
        mx.set_default_device(self._device)
        mx.set_default_stream(mx.new_stream(self._device))
        try:
            self._serve()
        finally:
            # MLX 0.32 needs each thread's streams released before the thread ends, or the process aborts
            # at exit ("terminate called without an active exception", exit code 134); the work still queued
            # on them (the batch's step queued ahead) is waited for first.
            mx.synchronize()
            mx.clear_streams()

    def _serve(self) -> None:
        batch = self._new_batch()
        waiting: deque[_Job] = deque()
        running: dict[int, _Job] = {}  # by uid
        while True:
            self._waiting, self._running = len(waiting), len(running)
            if self.vocoding == "interleaved":  # the next part of S3Gen's call, queued before T3's next step
                self._steps_since_part += 1
                if self._steps_since_part >= T3_STEPS_PER_PART or not running:
                    self._steps_since_part = 0
                    self._slice()
            else:
                self._send()  # what the last turn said of streams, at once
            with self._timed("gc"):
                _collect_garbage()
            # Block for work only when there is nothing to step (waking now and then to collect garbage); the
            # vocoding thread's answers come through the inbox too.
            idle = (
                not running and not waiting and not (self.vocoding == "interleaved" and self._engine.busy())
            )
            try:
                with self._timed("idle") if idle else contextlib.nullcontext():
                    item = self._inbox.get(block=idle, timeout=IDLE_COLLECT_S if idle else None)
            except queue.Empty:
                item = False
            while item is not False:
                if item is None:
                    self._stop(list(running.values()) + list(waiting) + self._stop_vocoder())
                    return
                if isinstance(item, _Job):
                    self._receive(item, waiting)
                elif isinstance(item, Vocoded):
                    waiting.extendleft(reversed(self._vocoded(item)))  # their next pieces go in first
                elif isinstance(item, Streamed):
                    waiting.extendleft(reversed(self._streamed(item, running, batch)))
                else:
                    self._call(*item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = False
            for j in [j for j in running.values() if j.ticket.cancelled]:
                batch.cancel(j.uid)
                self._done(running.pop(j.uid), None)
            for j in [j for j in waiting if j.ticket.cancelled]:
                waiting.remove(j)
                self._done(j, None)
            while waiting and len(running) < self.max_batch:
                j = waiting.popleft()
                with self._timed("admit"):
                    admitted = self._guard(j, self._admit, j, batch)
                if admitted:
                    running[j.uid] = j
            if not running:
                continue
            try:
                with self._timed("t3_step", len(running)):
                    steps = batch.step()
            except Exception as error:  # the whole batch is lost (e.g. out of memory): fail its jobs
                logger.exception("T3 batch step failed")
                for j in running.values():
                    self._done(j, error)
                running.clear()
                batch = self._new_batch()
                continue
            ended = []  # jobs whose piece T3 finished in this step
            for uid, token, finished in steps:
                j = running[uid]
                if token != NO_TOKEN:  # Turbo's batch ends a request whose logits are all -inf with no token
                    j.raw.append(token)
                    j.ticket.speech_tokens += 1
                    if j.ticket.speech_tokens == 1:
                        j.ticket._note("first_token")
                    if j.ticket.speech_tokens == j.job.first_chunk and j.job.stream:
                        j.ticket._note("first_chunk")
                ok = self._guard(j, self._took, j, token, finished)
                if finished or not ok:
                    del running[uid]
                    if not ok and not finished:
                        batch.cancel(uid)
                    elif ok:
                        ended.append(j)
            for j in self._decode_streams([j for j in running.values() if j.vocoder is not None]):
                del running[j.uid]
                batch.cancel(j.uid)
            waiting.extendleft(reversed(self._end_pieces(ended)))  # their next pieces go in first
            if not self.vocode_thread:
                while self._engine.pending:  # T3 waits for S3Gen here
                    waiting.extendleft(reversed(self._vocoded(self._engine.vocode_ready())))

    def _receive(self, j: _Job, waiting: deque[_Job]) -> None:
        """A new job: queued for T3, or answered at once when its text is pause tags alone."""
        if not self._guard(j, _check_voice, j.job.voice):
            return
        if j.plan.pieces:
            waiting.append(j)
        elif self._guard(j, self._silence, j):
            self._done(j, None)

    def _call(self, fn: Callable, args: tuple, future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as error:
            future.set_exception(error)

    def _guard(self, j: _Job, fn: Callable, *args: Any) -> bool:
        """Run one job's step; an error ends that job (its reader gets it), not the worker."""
        try:
            fn(*args)
            return True
        except Exception as error:
            logger.debug("job failed", exc_info=True)
            self._done(j, error)
            return False

    def _new_batch(self) -> SpeechTokenBatch | TurboTokenBatch:
        """T3's batch for the variant: CFG pairs (English, Multilingual) or single rows (Turbo/Nano)."""
        turbo = isinstance(self.tts.speech, TurboSpeech)
        return (TurboTokenBatch if turbo else SpeechTokenBatch)(self.tts.t3)

    def _admit(self, j: _Job, batch: SpeechTokenBatch | TurboTokenBatch) -> None:
        """Put the job's next piece into T3's batch."""
        job, piece = j.job, j.plan.pieces[j.piece]
        params = dataclasses.replace(
            job.params, max_new_tokens=min(job.params.max_new_tokens, token_budget(piece))
        )
        seed = j.seed()
        key = None if seed is None else seed_keys(seed)[0]
        j.raw = []
        j.uid = batch.add(BatchRequest(j.piece_ids[j.piece], job.voice, params, key=key))
        j.ticket._note("admitted")
        if job.stream:
            if j.piece == 0 and j.plan.pauses[0]:
                self._emit_silence(j, j.plan.pauses[0])
            if self.vocode_thread:  # the vocoding side makes its vocoder (its arrays are that thread's)
                j.piped = True
                drawn = secrets.randbelow(SEED_LIMIT) if seed is None else seed
                order = StreamOrder(job.voice, drawn, job.cfm_steps, job.first_chunk, job.stream_context)
                self._post("open", j, order)
            else:
                j.vocoder = self._stream_vocoder(j, None if seed is None else seed_keys(seed)[1])

    def _stream_vocoder(self, j: _Job, key: mx.array | None) -> StreamVocoder:
        job = j.job
        return StreamVocoder(
            self.tts.s3gen,
            job.voice,
            cfm_steps=job.cfm_steps,
            key=key,
            first_chunk=job.first_chunk,
            context=job.stream_context,
        )

    def _took(self, j: _Job, token: int, finished: bool) -> None:
        """A token of the job's piece (streamed: taken by its vocoder); when the piece is finished, its checks
        and its speech tokens (``j.raw`` keeps the ids to vocode) or, streamed, its last audio."""
        speech = self.tts.speech
        if j.piped and 0 <= token < speech.start_token:
            self._post("take", j, [token])
        if j.vocoder is not None and 0 <= token < speech.start_token:  # only speech ids, as stream_piece
            if finished:  # the piece's end decodes on its own, right after
                j.vocoder.take([token])
                self._emit(j, self._decode_alone(j.vocoder))
            else:  # a decode it makes due runs with the others' after the step (_decode_streams)
                j.vocoder.take([token])
        if not finished:
            return
        if speech.stop_token not in j.raw:
            if j.job.on_cut is not None:
                budget = min(j.job.params.max_new_tokens, token_budget(j.plan.pieces[j.piece]))
                j.job.on_cut(j.piece + 1, len(j.plan.pieces), budget)
            else:
                logger.warning(
                    "piece %d of %d stopped at its budget without the stop token",
                    j.piece + 1,
                    len(j.plan.pieces),
                )
        j.raw = speech.finish(j.raw)  # the variant's tail (Turbo's silence) included
        if len(j.raw) == len(speech.tail):
            raise ValueError("T3 stopped before producing any speech token; try another seed or text")
        if j.piped:  # its last audio comes back from the vocoding thread (_streamed)
            self._post("end", j, list(speech.tail))
        if j.vocoder is not None:
            if speech.tail:
                j.vocoder.take(list(speech.tail))
                self._emit(j, self._decode_alone(j.vocoder))
            with self._timed("stream_decode", 1):  # a stream's last decode, always due
                out = finish_stream(j.vocoder, speech)
            self._emit(j, out, end=True)
            j.vocoder = None

    def _end_pieces(self, ended: list[_Job]) -> list[_Job]:
        """After a step: the whole (not streamed) pieces T3 finished in it go to the vocoder; streamed jobs
        move on to their next piece or end (those streamed through the vocoding thread once their last audio is
        back: ``_streamed``). Returns the jobs that have a next piece now."""
        for j in ended:
            if not j.job.stream:
                seed = (
                    j.seed()
                )  # an unseeded job's drawn here: the vocoding side never uses MLX's global generator
                piece = _Piece(j, self.tts.speech.cut_samples(len(j.raw)))
                order = PieceOrder(
                    piece,
                    np.array(j.raw, dtype=np.int32),
                    j.job.voice,
                    secrets.randbelow(SEED_LIMIT) if seed is None else seed,
                    j.job.cfm_steps,
                )
                self._pieces_out += 1
                if self.vocode_thread:
                    self._post("piece", piece, order)
                else:
                    self._engine.pending.append(order)
        self._send()  # now: the vocoding side may be idle
        return self._next_pieces([j for j in ended if j.job.stream and not j.piped])

    def _vocoded(self, answer: Vocoded) -> list[_Job]:
        """The vocoder's audio for some whole pieces (``answer.keys``: ``_Piece``), or the error that lost them
        and their jobs: each job moves on to its next piece or hands over its audio. Returns the jobs that have a
        next piece."""
        self._pieces_out -= len(answer.keys)
        if answer.error is not None:
            for piece in answer.keys:
                self._done(piece.j, answer.error)
            return []
        for piece, wav in zip(answer.keys, answer.wavs):
            piece.j.wavs.append(wav[: len(wav) - piece.cut])
        return self._next_pieces([piece.j for piece in answer.keys])

    def _streamed(
        self, answer: Streamed, running: dict[int, _Job], batch: SpeechTokenBatch | TurboTokenBatch
    ) -> list[_Job]:
        """The vocoding side's audio for some streams (``answer.chunks``' keys: ``_Job``): emitted, a piece's
        last less the variant's end cut; a piece's last moves its job on. An error ends the jobs it lost (and
        their T3 rows). Returns the jobs that have a next piece."""
        more = []
        for j, samples, end, pushed in answer.chunks:
            if j.ended:  # cancelled or failed while its decode ran
                continue
            if answer.error is not None:
                self._done(j, answer.error)
            elif self._guard(j, self._emit_streamed, j, samples, end, pushed):
                if end:
                    j.piped = False
                    more += self._next_pieces([j])
                continue
            if running.get(j.uid) is j:
                del running[j.uid]
                batch.cancel(j.uid)
        return more

    def _emit_streamed(self, j: _Job, samples: np.ndarray, end: bool, pushed: int) -> None:
        self._emit(j, cut_end(samples, pushed, self.tts.speech) if end else samples, end)

    def _next_pieces(self, jobs: list[_Job]) -> list[_Job]:
        """Jobs whose piece is finished (vocoded, or streamed to its end): on to the next piece, or, after the
        last, the whole job's audio handed over. Returns the jobs that have a next piece."""
        more = []
        for j in jobs:
            if j.ticket.cancelled and not j.job.stream:  # its reader left while the piece was vocoded
                self._done(j, None)
                continue
            last = j.piece == len(j.plan.pieces) - 1
            if last and not j.job.stream:
                if not self._guard(j, self._hand_over, j):
                    continue
            j.piece += 1
            if last:
                self._done(j, None)
            else:
                more.append(j)
        return more

    def _hand_over(self, j: _Job) -> None:
        with self._timed("hand_over"):
            self._deliver(
                j, join_audio(j.wavs, j.plan, CROSSFADE), self.tts._mark if j.job.watermark else None
            )

    def _deliver(self, j: _Job, item: Any, mark: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """Hand the job's reader ``item`` (samples, the end or an error), watermarked by ``mark`` if given: now,
        or through the job's marking thread when they run, in order with what the job handed it before. There
        the watermark (Perth: resampling, STFTs and a network, 55-75 ms for 10 s of audio on one core of our
        CPU) keeps neither T3 nor S3Gen waiting, and its MLX work runs on a stream of its own."""
        if isinstance(item, np.ndarray) and item.size:
            j.ticket._note("first_audio")
        if not self._markers:
            j.ticket._put(item if mark is None else mark(item))
        else:
            self._deliveries[j.lane].put((j.ticket, item, mark))

    def _mark_loop(self, deliveries: queue.SimpleQueue) -> None:
        mx.set_default_device(self._device)
        mx.set_default_stream(mx.new_stream(self._device))
        try:
            while True:
                with self._timed("idle"):
                    delivery = deliveries.get()
                if delivery is None:
                    return
                ticket, item, mark = delivery
                if ticket.cancelled and isinstance(item, np.ndarray):  # its reader has gone: nothing to mark
                    continue
                if mark is not None:
                    try:
                        with self._timed("mark"):
                            item = mark(item)
                    except Exception as error:  # the reader gets the error, and reads no further
                        logger.exception("watermarking failed")
                        item = error
                ticket._put(item)
        finally:
            mx.synchronize()
            mx.clear_streams()

    # The vocoding side (vocode_thread=True): T3 keeps stepping while S3Gen runs, on the vocoding thread or in the
    # vocoding process. The worker sends it whole pieces and each streamed piece's tokens (``_post``), and it answers
    # through the inbox (``Vocoding``: a call a turn, streams' due decodes first).

    def _vocode_loop(self) -> None:
        mx.set_default_device(self._device)
        mx.set_default_stream(mx.new_stream(self._device))
        try:
            while True:
                with self._ready, self._timed("idle"):
                    while not (self._messages or self._engine.busy()) and not self._vocoder_stop:
                        self._ready.wait()
                    if self._vocoder_stop:
                        return
                    messages, self._messages = self._messages, []
                for answer in self._engine.turn(messages):
                    self._inbox.put(answer)
        finally:
            mx.synchronize()
            mx.clear_streams()

    def _start_process(self) -> VocodingProcess:
        # Two processes on one device: each MLX would take the whole memory limit and keep freed buffers in its
        # cache (the server's T3 peaked at 52 GB on an H200, and the process ran out of memory: run R). Each gets
        # half the limit: MLX gives cached buffers back to the device whenever its active and cached memory
        # together would pass its limit, so what one frees the other can use. No lower cache limit: with a
        # quarter of the share (run S) the server's cache sat at it (17.8 GB) and T3's p90 step was 32 ms
        # against 21 on a thread, likely buffers given back and allocated again each step.
        self._memory_limit = mx.set_memory_limit(1 << 62)  # restored at close
        share = self._memory_limit // 2
        mx.set_memory_limit(share)
        self._spec = spec = ProcessSpec(
            memory_limit=share,
            model=str(self.tts.path),
            cfm_dtype=cfm_dtype_name(self.tts.s3gen),
            memory_budget=self.tts.s3gen.memory_budget,
            device="cpu" if self._device == mx.cpu else "gpu",
            batch=self.vocode_batch,
            frames=self.vocode_frames,
            bucket=self.vocode_bucket,
            catch_up=self.stream_catch_up,
        )
        try:
            return VocodingProcess(spec, self._answered, self._process_lost)
        except BaseException:
            mx.set_memory_limit(self._memory_limit)
            raise

    def _send_loop(self) -> None:
        """The vocoding thread with ``vocoding="process"``: it sends the worker's messages to the process, each
        key as its serial (what the process answers by, ``_answered``)."""
        while True:
            with self._ready:
                # A dead process is replaced as soon as ``PROCESS_RESTART_S`` allows, messages or none.
                while not (self._messages or self._vocoder_stop):
                    wait = None if self._lost is None else self._next_start - time.monotonic()
                    if wait is not None and wait <= 0:
                        break
                    self._ready.wait(wait)
                if self._vocoder_stop:
                    return
                messages, self._messages = self._messages, []
            if self._lost is not None:
                self._restart_process()
            if not messages:
                continue
            with self._remote_lock:
                lost = self._lost
                # a job the dead process held has failed: its later messages go nowhere
                messages = [m for m in messages if m[1].serial not in self._failed]
                for kind, key, _ in messages if lost is None else ():
                    if kind in ("piece", "open"):
                        self._remote[key.serial] = key
                    elif kind == "drop":  # its job has ended: no answer for it will be read
                        self._remote.pop(key.serial, None)
            if lost is None:
                try:
                    self._process.send([(kind, key.serial, value) for kind, key, value in messages])
                    continue
                except OSError:  # the process has died: these messages never reached it, so they wait
                    with self._remote_lock:  # for the next one (unless _process_lost failed their jobs first)
                        for kind, key, _ in messages:
                            if kind in ("piece", "open"):
                                self._remote.pop(key.serial, None)
                    self._process.wait_ended()  # its reader has failed what it held (_process_lost)
                    with self._ready:
                        self._messages[:0] = messages
                    continue
                except (
                    Exception
                ) as error:  # e.g. a message that does not pickle: its jobs fail, not the thread
                    logger.exception("sending to the vocoding process failed")
                    lost = error
            for kind, key, _ in messages:  # what needs the process fails at once
                with self._remote_lock:
                    self._remote.pop(key.serial, None)
                if kind == "piece":
                    self._inbox.put(Vocoded([key], None, lost))
                elif kind == "open":
                    self._inbox.put(Streamed([(key, None, False, 0)], lost))

    def _answered(self, answers: list[Vocoded | Streamed], times: list[tuple[str, float, int, int]]) -> None:
        """A turn of the process (on its reader thread): its calls' times metered (before any reader gets their
        audio), its answers' serials made the worker's keys again and put in the inbox; a stream dropped
        meanwhile (its job ended) left out."""
        for phase, seconds, rows, calls in times:
            self._meter.add("vocoder", phase, seconds, rows, calls)
        for answer in answers:
            with self._remote_lock:
                if isinstance(answer, Vocoded):
                    keys = [self._remote.pop(k) for k in answer.keys]
                    self._inbox.put(Vocoded(keys, answer.wavs, answer.error))
                    continue
                chunks = []
                for k, samples, end, pushed in answer.chunks:
                    j = self._remote.pop(k, None) if end or answer.error is not None else self._remote.get(k)
                    if j is not None:
                        chunks.append((j, samples, end, pushed))
            if chunks:
                self._inbox.put(Streamed(chunks, answer.error))

    def _process_lost(self, error: BaseException) -> None:
        """The vocoding process died: what it held fails with ``error``, and the vocoding thread starts a new
        one (``_restart_process``)."""
        logger.error("the vocoding process died: %s; the requests it held fail, a new one starts", error)
        with self._remote_lock:
            self._lost = error
            held, self._remote = list(self._remote.values()), {}
            jobs = [key for key in held if isinstance(key, _Job)]
            # their later messages go nowhere until they end (_done); a piece sends none after its own
            self._failed.update(j.serial for j in jobs)
        pieces = [key for key in held if isinstance(key, _Piece)]
        if pieces:
            self._inbox.put(Vocoded(pieces, None, error))
        if jobs:
            self._inbox.put(Streamed([(j, None, False, 0) for j in jobs], error))
        with self._ready:  # the vocoding thread starts a new one
            self._ready.notify()

    def _restart_process(self) -> None:
        """On the vocoding thread, after the process died: a new one from the same spec (seconds, while the
        worker's messages wait; its first calls plan and compile as a fresh server's), unless the last start
        was under ``PROCESS_RESTART_S`` ago or this one fails: then ``_lost`` stands (``vocoder_error``), what
        needs S3Gen fails, and the thread tries again once that time has passed."""
        if time.monotonic() < self._next_start:
            return
        self._next_start = time.monotonic() + PROCESS_RESTART_S
        try:
            process = VocodingProcess(self._spec, self._answered, self._process_lost)
        except Exception as error:
            logger.error("a new vocoding process could not start: %s", error)
            return
        self._process.close()  # the dead one's reader and process have ended: nothing waits
        with self._remote_lock:
            self._process, self._lost = process, None
        self._restarts += 1
        logger.warning("a new vocoding process runs (restart %d)", self._restarts)

    def _stop_vocoder(self) -> list[_Job]:
        """Stop the vocoding thread (and process) after its running call; the jobs whose pieces or streams it
        held, or whose answers came after the worker stopped reading them."""
        if self._vocoder is not None:
            with self._ready:
                self._vocoder_stop = True
                self._ready.notify()
            self._vocoder.join()
            self._vocoder = None
        if self._process is not None:
            self._process.close()  # its last answers reach the inbox
            self._process = None
            mx.set_memory_limit(self._memory_limit)
        keys = self._engine.keys() + list(self._remote.values())
        keys += [message[1] for message in self._messages + self._outbox]
        self._engine.clear()
        self._remote.clear()
        self._messages.clear()
        self._outbox.clear()
        jobs = [key.j if isinstance(key, _Piece) else key for key in keys]
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return jobs
            if isinstance(item, Vocoded):
                jobs.extend(piece.j for piece in item.keys)
            elif isinstance(item, Streamed):
                jobs.extend(j for j, _, _, _ in item.chunks)
            elif isinstance(item, _Job):  # submitted while the worker stopped
                jobs.append(item)
            elif isinstance(item, tuple):
                item[2].cancel()

    def _post(self, kind: str, key: _Job | _Piece, value: Any = None) -> None:
        """From the worker thread: a message for the vocoding side, sent with the turn's others (``_send``: one
        lock and one wake-up a step, not one a token)."""
        self._outbox.append((kind, key, value))

    def _send(self) -> None:
        if self._outbox and self.vocoding != "interleaved":  # interleaved: _slice takes them
            with self._ready:
                self._messages += self._outbox
                self._ready.notify()
            self._outbox = []

    def _slice(self) -> None:
        """With ``vocoding="interleaved"``: the vocoding side's turn on the worker thread (the messages since
        the last, and the next part of a call: ``Vocoding(sliced=True)``), its answers read from the inbox as a
        vocoding thread's."""
        messages, self._outbox = self._outbox, []
        for answer in self._engine.turn(messages):
            self._inbox.put(answer)

    def _decode_streams(self, jobs: list[_Job]) -> list[_Job]:
        """The streamed jobs' decodes that fell due in a step, run together (``decode_together``, grouped as
        whole pieces are), each job's audio emitted. Returns the jobs that failed (ended with their error): a
        shared call's error (e.g. out of memory) ends every job in it, an emit's only its own."""
        due = [j for j in jobs if j.vocoder.due]
        failed = []
        while due:
            chosen = group(
                due,
                [j.vocoder.due for j in due],
                [j.job.cfm_steps for j in due],
                self.vocode_batch,
                self.vocode_frames,
                self.vocode_bucket,
            )
            due = [j for j in due if j not in chosen]
            try:
                with self._timed("stream_decode", len(chosen)):
                    outs = decode_together([j.vocoder for j in chosen], bucket=self.vocode_bucket)
            except Exception as error:
                logger.exception("streamed decodes failed")
                for j in chosen:
                    self._done(j, error)
                failed += chosen
                continue
            failed += [j for j, out in zip(chosen, outs) if not self._guard(j, self._emit, j, out)]
        return failed

    def _decode_alone(self, vocoder: StreamVocoder) -> np.ndarray:
        """A stream's decode due at its piece's end, on its own: what ``push`` gives after ``take``."""
        if not vocoder.due:
            return np.zeros(0, np.float32)
        with self._timed("stream_decode", 1):
            return decode_together([vocoder])[0]

    def _emit(self, j: _Job, samples: np.ndarray, end: bool = False) -> None:
        """Hand a streamed job's samples to its reader, the pieces joined and each chunk watermarked exactly as
        ``TTS.stream`` does (``PieceJoiner``, ``join_pieces``: the pause after the piece comes after its end).
        """
        with self._timed("emit"):
            more = j.plan.crossfades(j.piece)  # the next piece crossfades onto this one
            outs = [j.joiner.push(samples, more)] + ([j.joiner.end_piece(more)] if end else [])
            for out in outs:
                if out.size:
                    self._deliver(j, out, self.tts._mark_chunk if j.job.watermark else None)
            if end and j.plan.pauses[j.piece + 1]:
                self._emit_silence(j, j.plan.pauses[j.piece + 1])

    def _emit_silence(self, j: _Job, samples: int) -> None:
        silence = np.zeros(samples, np.float32)
        self._deliver(j, silence, self.tts._mark_chunk if j.job.watermark else None)

    def _silence(self, j: _Job) -> None:
        """A job whose text is pause tags alone: its silence, as ``TTS.generate`` / ``TTS.stream`` give it."""
        if j.job.stream:
            self._emit_silence(j, j.plan.pauses[0])
        else:
            self._deliver(j, np.zeros(j.plan.pauses[0], np.float32))  # unmarked, as TTS.generate

    def _done(self, j: _Job, error: BaseException | None) -> None:
        if j.ended:  # e.g. a failed stream's job again, among the running ones at shutdown
            return
        j.ended = True
        with self._remote_lock:  # it sends nothing more: a message queued before is ignored by a new process
            self._failed.discard(j.serial)
        if j.piped:  # the vocoding thread forgets its stream
            self._post("drop", j)
        # Counted before the reader is told, so a client that saw its request end finds it in /metrics.
        self._meter.ended(
            "failed" if error is not None else "cancelled" if j.ticket.cancelled else "finished"
        )
        with self._lock:
            self._jobs -= 1
        self._deliver(j, _END if error is None else error)

    def _stop(self, jobs: list[_Job]) -> None:
        for j in jobs:
            self._done(j, RuntimeError("the server is shutting down"))

    def _timed(self, phase: str, rows: int = 0, calls: int = 1) -> contextlib.AbstractContextManager:
        """The block's wall time, ``calls`` and ``rows`` added to ``phase`` of the thread that runs it
        (``metrics``)."""
        current = threading.current_thread()
        thread = "vocoder" if current is self._vocoder else "marker" if current in self._markers else "worker"
        return self._meter.timed(thread, phase, rows, calls)


def _mlx_memory() -> dict[str, int]:
    return {"active": mx.get_active_memory(), "peak": mx.get_peak_memory(), "cache": mx.get_cache_memory()}


def _check_voice(voice: Voice) -> None:
    """Evaluate the job's voice on the worker thread (a no-op for the evaluated voices ``TTS`` and the server
    make). A lazy array made on another thread cannot be evaluated here, nor evaluated there meanwhile without
    racing the worker's CUDA-graph capture (``Worker.start``): it is refused."""
    try:
        mx.eval([getattr(voice, f.name) for f in dataclasses.fields(voice)])
    except RuntimeError as error:
        if "Stream" not in str(error):
            raise
        raise ValueError(
            "the voice's arrays are not evaluated: mx.eval them on the thread that made them before submitting"
        ) from None


# Python's automatic garbage collection, paused while workers run (``Worker.start``) and done on their
# threads instead, at the interpreter's own thresholds.
IDLE_COLLECT_S = 1.0  # an idle worker still collects the other threads' garbage this often
_gc_lock = threading.Lock()
_gc_pauses = [0, False]  # workers running, and whether automatic collection was on before the first


def _pause_automatic_gc() -> None:
    with _gc_lock:
        if _gc_pauses[0] == 0:
            _gc_pauses[1] = gc.isenabled()
            gc.disable()
        _gc_pauses[0] += 1


def _resume_automatic_gc() -> None:
    with _gc_lock:
        _gc_pauses[0] -= 1
        if _gc_pauses[0] == 0 and _gc_pauses[1]:
            gc.enable()


def _collect_garbage() -> None:
    """What automatic collection would do now: the youngest generation once its count passes the threshold,
    an older one as theirs do. Nothing when automatic collection was off before the workers started."""
    if not _gc_pauses[1]:
        return
    counts, thresholds = gc.get_count(), gc.get_threshold()
    if counts[0] >= thresholds[0]:
        gc.collect(2 if counts[2] >= thresholds[2] else 1 if counts[1] >= thresholds[1] else 0)
