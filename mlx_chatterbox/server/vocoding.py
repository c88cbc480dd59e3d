"""The server's S3Gen side: whole pieces and streams' chunk decodes, grouped into batched S3Gen calls.

``Vocoding`` holds what the worker has sent it (pieces to vocode, streams and their tokens) and runs one call a
turn: the streams' due decodes first (a listener may be waiting), else the oldest pieces. It runs on the worker's
vocoding thread, or in a process of its own (``VocodingProcess``): there neither MLX's process-wide throttles
nor the GIL tie T3's steps to S3Gen's calls (H200, 2026-12-03: a 64-row T3 step took 50 ms beside S3Gen on a
thread, 23 ms beside S3Gen in another process, 11 ms alone; RESULTS run R). It knows jobs only by the keys the
worker gives it (the worker's own objects on a thread, numbers across the process boundary).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar

import mlx.core as mx
import numpy as np

from ..generation.stream import StreamVocoder, decode_together_steps
from ..generation.vocode import S3Gen, Steps, drain, use_tiled_products, vocode_tokens
from ..generation.voice import Voice
from ..sampling import seed_keys

logger = logging.getLogger(__name__)
GRAPHS_VARIABLE = "MLX_USE_CUDA_GRAPHS"  # "0" keeps the estimator on MLX's products (_process_main)
T = TypeVar("T")
Timed = Callable[..., contextlib.AbstractContextManager]  # (phase, rows, calls)


@dataclasses.dataclass(frozen=True, eq=False)
class PieceOrder:
    """A whole piece to vocode: its speech ids (the variant's tail included), voice, S3Gen seed and steps."""

    key: Any
    tokens: np.ndarray  # (N,) int32
    voice: Voice
    seed: int
    cfm_steps: int | None

    def row_tokens(self) -> int:
        """Its row's length in S3Gen's batch: the voice's prompt tokens and its own."""
        return self.voice.s3gen_prompt_tokens.shape[1] + len(self.tokens)


@dataclasses.dataclass(frozen=True)
class StreamOrder:
    """A streamed piece's vocoder settings (``StreamVocoder``'s), sent with its "open" message."""

    voice: Voice
    seed: int
    cfm_steps: int | None
    first_chunk: int
    context: int | Literal["whole"]


@dataclasses.dataclass(frozen=True, eq=False)
class Vocoded:
    """Some pieces' unmarked audio (by their keys), or the error that lost them."""

    keys: list
    wavs: list[np.ndarray] | None
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Streamed:
    """Some streams' decodes: per stream key its samples, whether they end its piece and the tokens its vocoder
    took (what the variant's end cut depends on: ``cut_end``), or (error set) the error that lost them."""

    chunks: list[tuple[Any, np.ndarray | None, bool, int]]
    error: BaseException | None = None


@dataclasses.dataclass(eq=False)
class _Stream:
    """A streamed piece: its vocoder, and the token lists it was sent and has not taken (None: the end)."""

    key: Any
    vocoder: StreamVocoder
    held: deque = dataclasses.field(default_factory=deque)
    final: bool = False  # the decode due is the piece's last
    started: bool = False  # its first decode has run


def group(
    items: list[T], rows: list[int], steps: list[int | None], batch: int, frames: int, bucket: int
) -> list[T]:
    """The first item and the later ones of its cfm_steps (``steps[i]``) that fit with it in one S3Gen call:
    ``batch`` rows of ``rows[i]`` tokens, ``frames`` mel frames with rows padded to multiples of ``bucket``.
    """
    width = _bucketed(rows[0], bucket)
    chosen = [items[0]]
    for item, tokens, step in zip(items[1:], rows[1:], steps[1:]):
        if len(chosen) == batch:
            break
        wider = max(width, _bucketed(tokens, bucket))
        if step == steps[0] and 2 * wider * (len(chosen) + 1) <= frames:  # 2 mel frames a token
            chosen.append(item)
            width = wider
    return chosen


def _bucketed(tokens: int, bucket: int) -> int:
    return -(-tokens // bucket) * bucket


class Vocoding:
    """Pieces and streams sent as messages, vocoded a call per ``turn``: ("piece", key, PieceOrder), ("open",
    key, StreamOrder), ("take", key, token list), ("end", key, the tail's token list), ("drop", key). A stream
    takes its tokens up to its next due decode, one sent list at a time as ``TTS.stream`` pushes them, or
    (``catch_up``) all it holds at once, so that a stream whose decode waited for a busy S3Gen makes up for it in
    one longer decode. ``timed(phase, rows, calls)`` times the calls; ``vocode_one`` vocodes a piece alone
    (hybrid mode's upstream S3Gen; by default ours, exactly ``TTS.vocode``).

    ``sliced``: a turn queues one part of a call (the flow encoder, a CFM step, HiFT: ``Steps``) and returns,
    so that the worker thread queues a T3 step between two parts on the same MLX stream: the device runs them
    one after the other instead of side by side (on an H200 a T3 step took 3x as long beside S3Gen on another
    thread, and S3Gen about 3x as long beside T3: RESULTS run Q). A lone piece or decode is one part."""

    def __init__(
        self,
        s3gen: S3Gen,
        *,
        batch: int,
        frames: int,
        bucket: int,
        catch_up: bool,
        timed: Timed,
        vocode_one: Callable[[PieceOrder], np.ndarray] | None = None,
        sliced: bool = False,
    ):
        self.s3gen, self.batch, self.frames, self.bucket, self.catch_up = (
            s3gen,
            batch,
            frames,
            bucket,
            catch_up,
        )
        self.timed = timed
        self.vocode_one = vocode_one
        self.sliced = sliced
        self.pending: deque[PieceOrder] = deque()
        self.streams: dict[Any, _Stream] = {}
        self._call: Steps[Vocoded | Streamed] | None = None  # the call under way (sliced)
        self._call_keys: list = []  # its pieces' keys (no longer pending)

    def busy(self) -> bool:
        """Whether a call is under way or due: pieces wait, or a stream has a decode due."""
        return (
            self._call is not None or bool(self.pending) or any(s.vocoder.due for s in self.streams.values())
        )

    def keys(self) -> list:
        """The keys of every piece and stream held."""
        return self._call_keys + [order.key for order in self.pending] + list(self.streams)

    def clear(self) -> None:
        """Forget every piece and stream, and the call under way."""
        self.pending.clear()
        self.streams.clear()
        self._call, self._call_keys = None, []

    def turn(self, messages: list[tuple]) -> list[Vocoded | Streamed]:
        """Take the messages, then run one call if one is due (``sliced``: the next part of the call under way,
        or of a new one); the answers (failed streams' too). Streams take what they hold between calls only.
        """
        answers: list[Vocoded | Streamed] = self._apply(messages)
        if self._call is None:
            answers += self._feed()
            due = sorted((s for s in self.streams.values() if s.vocoder.due), key=lambda s: s.started)
            if due:  # those yet to give their first audio first (time to first audio)
                self._call = self._decode(due)
            elif self.pending:
                self._call_keys, self._call = self._vocode_call()
        if self._call is None:
            return answers
        try:
            if self.sliced:
                next(self._call)
                return answers
            answer = drain(self._call)
        except StopIteration as done:
            answer = done.value
        except BaseException:
            # The calls catch their errors; this one (e.g. KeyboardInterrupt) ends the call, so that a later turn
            # cannot read the dead call's end as its answer.
            self._call, self._call_keys = None, []
            raise
        self._call, self._call_keys = None, []
        # what they hold up to their next due decode, so only new messages wait
        return answers + [answer] + self._feed()

    def _apply(self, messages: list[tuple]) -> list[Streamed]:
        failed = []
        for kind, key, value in messages:
            if kind == "piece":
                self.pending.append(value)
            elif kind == "open":
                try:
                    vocoder = StreamVocoder(
                        self.s3gen,
                        value.voice,
                        cfm_steps=value.cfm_steps,
                        key=seed_keys(value.seed)[1],
                        first_chunk=value.first_chunk,
                        context=value.context,
                    )
                    self.streams[key] = _Stream(key, vocoder)
                except Exception as error:
                    failed.append(Streamed([(key, None, False, 0)], error))
            elif kind == "drop":
                self.streams.pop(key, None)
            elif key in self.streams:  # else dropped: the job has ended
                held = self.streams[key].held
                if value:
                    held.append(value)
                if kind == "end":
                    held.append(None)
        return failed

    def _feed(self) -> list[Streamed]:
        failed = []
        for stream in list(self.streams.values()):
            held, vocoder = stream.held, stream.vocoder
            try:
                while held and not vocoder.due and not stream.final:
                    tokens = []
                    while held and held[0] is not None and (self.catch_up or not tokens):
                        tokens += held.popleft()
                    if held and held[0] is None and (self.catch_up or not tokens):
                        held.popleft()
                        vocoder.end(tokens)
                        stream.final = True
                    else:
                        vocoder.take(tokens)
            except Exception as error:
                del self.streams[stream.key]
                failed.append(Streamed([(stream.key, None, False, 0)], error))
        return failed

    def _decode(self, due: list[_Stream]) -> Steps[Streamed]:
        """The due decodes that fit in one S3Gen call, run together; their samples. (A stream dropped while
        they ran is answered all the same: the worker skips what has ended.)"""
        chosen = group(due, [s.vocoder.due for s in due], [s.vocoder.cfm_steps for s in due], *self._limits())
        # what a replay needs (probe_stream_decode), read before the call moves the vocoders on
        rows = [(s.vocoder.due, s.vocoder.pushed, s.final) for s in chosen]
        try:
            steps = decode_together_steps([s.vocoder for s in chosen], bucket=self.bucket)
            outs = yield from self._timed_steps("stream_decode", len(chosen), steps)
        except Exception as error:  # the group is lost (e.g. out of memory): fail its jobs
            logger.exception("streamed decodes failed; (row tokens, tokens pushed, final) a stream: %s", rows)
            for stream in chosen:
                self.streams.pop(stream.key, None)
            return Streamed([(stream.key, None, False, 0) for stream in chosen], error)
        chunks = []
        for stream, out in zip(chosen, outs):
            stream.started = True
            if stream.final:
                self.streams.pop(stream.key, None)
            chunks.append((stream.key, out, stream.final, stream.vocoder.pushed))
        return Streamed(chunks)

    def vocode_ready(self) -> Vocoded:
        """Vocode the oldest pending piece with the later ones of its ``cfm_steps`` that fit in one call."""
        return drain(self._vocode_call()[1])

    def _vocode_call(self) -> tuple[list, Steps[Vocoded]]:
        """The oldest pending piece and the later ones of its ``cfm_steps`` that fit in one call, taken out of
        ``pending``: their keys, and their call."""
        pending = list(self.pending)
        chosen = group(
            pending, [o.row_tokens() for o in pending], [o.cfm_steps for o in pending], *self._limits()
        )
        for order in chosen:
            self.pending.remove(order)
        return [order.key for order in chosen], self._vocode_steps(chosen)

    def _vocode_steps(self, chosen: list[PieceOrder]) -> Steps[Vocoded]:
        keys = [order.key for order in chosen]
        try:
            wavs = yield from self._timed_steps("vocode", len(chosen), self._vocode(chosen))
            return Vocoded(keys, wavs)
        except Exception as error:  # the group is lost (e.g. out of memory): fail its jobs
            logger.exception("vocoding failed")
            return Vocoded(keys, None, error)

    def _timed_steps(self, phase: str, rows: int, steps: Steps[T]) -> Steps[T]:
        """``steps`` with each part timed: one call and its rows counted with the first."""
        first = True
        while True:
            with self.timed(phase, rows if first else 0, int(first)):
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value
            first = False
            yield

    def _limits(self) -> tuple[int, int, int]:
        return self.batch, self.frames, self.bucket

    def _vocode(self, orders: list[PieceOrder]) -> Steps[list[np.ndarray]]:
        """One piece as ``TTS.vocode`` (exactly what ``TTS.generate`` gives), several with ``S3Gen.batch`` (the
        same up to float error, in one flow-encoder pass and one CFM solve)."""
        if self.vocode_one is not None:  # hybrid mode: upstream's S3Gen, one at a time
            return [self.vocode_one(order) for order in orders]
        if len(orders) == 1:
            order = orders[0]
            return [vocode_tokens(self.s3gen, order.tokens, order.voice, order.cfm_steps, order.seed)]
        wavs = yield from self.s3gen.batch_steps(
            [order.tokens for order in orders],
            [order.voice for order in orders],
            cfm_steps=orders[0].cfm_steps,
            keys=[seed_keys(order.seed)[1] for order in orders],
            bucket=self.bucket,
        )
        return [np.array(w[0], dtype=np.float32) for w in wavs]


# The vocoding process.

_VOICE_FIELDS = tuple(f.name for f in dataclasses.fields(Voice))


def _to_wire(message: tuple) -> tuple:
    """A message (its key a serial number) with its voice as numpy arrays (made into MLX arrays again on the
    process's MLX thread), and a piece's order keyed by the serial too."""
    kind, key, value = message
    if kind in ("piece", "open"):
        voice = tuple(np.array(getattr(value.voice, f)) for f in _VOICE_FIELDS)
        value = dataclasses.replace(value, voice=voice)
    if kind == "piece":
        value = dataclasses.replace(value, key=key)
    return kind, key, value


def _from_wire(message: tuple) -> tuple:
    kind, key, value = message
    if kind in ("piece", "open"):
        value = dataclasses.replace(value, voice=Voice(*(mx.array(a) for a in value.voice)))
    return kind, key, value


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """What the vocoding process loads and how it groups calls."""

    memory_limit: int  # MLX's memory limit there (bytes)
    model: str  # the converted model folder
    cfm_dtype: str  # the estimator's ("float32" or "bfloat16")
    memory_budget: int | str | None  # S3Gen.memory_budget
    device: str  # "gpu" or "cpu"
    batch: int
    frames: int
    bucket: int
    catch_up: bool


def cfm_dtype_name(s3gen: S3Gen) -> str:
    """The estimator's dtype as ``TTS.load``'s ``cfm_dtype`` names it."""
    from ..api import CFM_DTYPES

    dtype = s3gen.estimator.dtype
    return next(name for name, d in CFM_DTYPES.items() if d == dtype)


class VocodingProcess:
    """``Vocoding`` in a child process (spawned: MLX's state is not forked). ``send`` messages (any thread);
    ``on_turn`` gets each turn's answers and the (phase, seconds, rows, calls) of its calls, on a reader thread;
    if the process dies, ``on_exit`` gets the error. ``close`` stops it after its running call."""

    def __init__(
        self,
        spec: ProcessSpec,
        on_turn: Callable[[list[Vocoded | Streamed], list[tuple[str, float, int, int]]], None],
        on_exit: Callable[[BaseException], None],
    ):
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_process_main, args=(child_conn, spec), name="mlx-chatterbox-vocoder", daemon=True
        )
        self._process.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._closing = False
        try:
            ready = self._conn.recv()
        except EOFError:
            self._process.join()
            ready = RuntimeError(f"it ended with exit code {self._process.exitcode}")
        if isinstance(ready, BaseException):
            self._process.join()
            raise RuntimeError(f"the vocoding process could not start: {ready}") from ready
        logger.info("the vocoding process (pid %d) runs MLX with %s", self._process.pid, ready)
        self._on_turn, self._on_exit = on_turn, on_exit
        self._reader = threading.Thread(target=self._read, name="mlx-chatterbox-vocoder-reader", daemon=True)
        self._reader.start()

    def send(self, messages: list[tuple]) -> None:
        with self._send_lock:
            self._conn.send([_to_wire(m) for m in messages])

    def wait_ended(self) -> None:
        """Once a send has failed: return when the reader has seen the process end and told ``on_exit``."""
        self._reader.join()

    def close(self) -> None:
        """Stop after the running call: its answers are still handed over."""
        self._closing = True
        with self._send_lock, contextlib.suppress(OSError):
            self._conn.send(None)
        self._reader.join()
        self._process.join()

    def _read(self) -> None:
        while True:
            try:
                answers, times = self._conn.recv()
            except (EOFError, OSError):
                break
            self._on_turn(answers, times)
        self._process.join()
        if not self._closing:
            self._on_exit(RuntimeError(f"the vocoding process ended (exit code {self._process.exitcode})"))


def _process_main(conn: Any, spec: ProcessSpec) -> None:
    """The vocoding process: load S3Gen, then take messages (a reader thread receives them meanwhile, so the
    sender never waits for a call) and answer each turn's calls."""
    # MLX-CUDA records each run of about 100 kernels as a CUDA graph, and the process keeps MLX's default, as
    # T3 does. With graphs, and so with our tiled products, S3Gen here did better than without (H200, run AL:
    # a lone English stream's first audio the same, 0.25 s, its whole stream 0.97 s against 1.13, and 16 streams
    # 30.5x real time against 18.0x). Run AA had chosen to launch without them, before the tiled kernel existed.
    # MLX_USE_CUDA_GRAPHS=0 from the server's environment still turns them off here, and then the estimator
    # keeps MLX's products: without graphs ours made a first audio slower (207 against 172 ms, runs AF and AG).
    graphs = os.environ.get(GRAPHS_VARIABLE) != "0"
    try:
        from ..api import CFM_DTYPES
        from ..weights import load_s3gen

        use_tiled_products(graphs)

        mx.set_default_device(mx.gpu if spec.device == "gpu" else mx.cpu)
        mx.set_memory_limit(spec.memory_limit)
        s3gen = load_s3gen(spec.model, CFM_DTYPES[spec.cfm_dtype])
        s3gen.memory_budget = spec.memory_budget
    except BaseException as error:
        conn.send(RuntimeError(f"{type(error).__name__}: {error}"))
        return
    times: list[tuple[str, float, int, int]] = []

    @contextlib.contextmanager
    def timed(phase: str, rows: int = 0, calls: int = 1) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            times.append((phase, time.perf_counter() - start, rows, calls))

    engine = Vocoding(
        s3gen, batch=spec.batch, frames=spec.frames, bucket=spec.bucket, catch_up=spec.catch_up, timed=timed
    )
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def receive() -> None:
        while True:
            try:
                item = conn.recv()
            except (EOFError, OSError):
                item = None
            inbox.put(item)
            if item is None:
                return

    threading.Thread(target=receive, daemon=True).start()
    setting = f"{GRAPHS_VARIABLE}={os.environ.get(GRAPHS_VARIABLE, '')}"
    products = "our tiled products" if graphs else "MLX's products"
    conn.send(f"{setting}, the estimator on {products}")  # ready
    while True:
        idle = not engine.busy()
        with timed("idle") if idle else contextlib.nullcontext():
            batches = [inbox.get()] if idle else []
        while not inbox.empty():
            batches.append(inbox.get())
        if any(b is None for b in batches):
            break
        answers = [
            # the parent gets a plain error (MLX's may not pickle)
            (
                dataclasses.replace(a, error=RuntimeError(f"{type(a.error).__name__}: {a.error}"))
                if a.error
                else a
            )
            for a in engine.turn([_from_wire(m) for b in batches for m in b])
        ]
        conn.send((answers, times[:]))
        times.clear()
    mx.synchronize()
    conn.close()
