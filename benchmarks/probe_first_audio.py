"""Where a lone stream's first audio goes (issue 25): one streamed request through ``TTS.stream`` and through the
server's ``Worker`` (inline, with its vocoding thread, or with the vocoding process), on the full-size English
model with random weights, with the events of its first audio timed from the request's start: T3's steps up to
the first decode (the Worker's batch; ``TTS.stream``'s loop is not split), the first decode, its watermark, and
the hand-over to the reader. A one-off probe for the H200; prints one table.

    python benchmarks/probe_first_audio.py --cfm-dtype bfloat16 --first-chunk 15 --out first_audio.jsonl
    python benchmarks/probe_first_audio.py --model /tmp/serve-turbo/mlx --voice /tmp/serve-turbo/voice.safetensors \
        --modes stream,worker-thread,worker-process

Each mode runs the same request once untimed first (its traces and kernels; the Worker's modes after its
``warm_up``, as ``serve`` runs it), then ``--repeats`` times timed; the table gives the medians. The events
are the library's own methods, wrapped here to note when they ran; the vocoding process's decodes are timed
there and noted as ending when their answer reached the server (the pipe's time falls in "to the decode"), and
that mode needs ``--model`` (the process loads S3Gen from the folder).
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx_chatterbox  # noqa: F401  isort: skip

import argparse
import concurrent.futures
import functools
import statistics
import threading
import time

import mlx.core as mx
from bench_stream import TEXT
from common import machine_info, memory_budget, write_line
from probe_worker import load

from mlx_chatterbox import TTS
from mlx_chatterbox.generation import batch as t3_batch
from mlx_chatterbox.generation import stream
from mlx_chatterbox.generation.voice import Voice
from mlx_chatterbox.models import cfm
from mlx_chatterbox.server import worker as worker_module
from mlx_chatterbox.server.worker import SpeechJob, Worker

# (owner, attribute, event): the calls timed, each noted with its start and end. English's and Turbo's batches
# both step through ContinuousBatch.step.
EVENTS = (
    (t3_batch.ContinuousBatch, "step", "t3_step"),
    (stream.StreamVocoder, "_decode", "decode"),
    (TTS, "_mark_chunk", "mark"),
    (worker_module.Ticket, "_put", "put"),
)


class Recorder:
    """Notes (event, start, end) of every wrapped call, from any thread, while on (the active one)."""

    active: Recorder | None = None

    def __init__(self):
        self.notes: list[tuple[str, float, float]] = []
        self.lock = threading.Lock()
        self.saved = []

    def __enter__(self) -> Recorder:
        for owner, name, event in EVENTS:
            fn = getattr(owner, name)
            self.saved.append((owner, name, fn))
            setattr(owner, name, self.wrap(fn, event))
        Recorder.active = self
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)
        self.saved = []
        Recorder.active = None

    def wrap(self, fn, event: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.notes.append((event, t0, time.perf_counter()))

        return timed


def note_child_decodes(worker: Worker) -> None:
    """The worker's vocoding process, each turn's stream decodes (timed there) noted by the active recorder as
    one decode ending when the turn arrived. Its hand-over was bound at start, so it is wrapped on the instance.
    """
    process = worker._process
    on_turn = process._on_turn

    def answered(answers, times):
        now, rec = time.perf_counter(), Recorder.active
        seconds = sum(s for phase, s, _, _ in times if phase == "stream_decode")
        if seconds and rec is not None:
            with rec.lock:
                rec.notes.append(("decode", now - seconds, now))
        on_turn(answers, times)

    process._on_turn = answered


def first_audio(notes: list[tuple[str, float, float]], start: float, read: float) -> dict:
    """The first audio's parts from the notes of one request started at ``start`` and first read at ``read``."""
    # The decode that made the first audio: the last to end before it was read (TTS.stream's pushes before a
    # chunk falls due return at once).
    decode = max((n for n in notes if n[0] == "decode" and n[2] <= read), key=lambda n: n[2])
    steps = [n for n in notes if n[0] == "t3_step" and n[2] <= decode[1]]
    marks = [n for n in notes if n[0] == "mark" and n[1] >= decode[2]]
    puts = [n for n in notes if n[0] == "put" and n[1] >= decode[2]]
    mark = min(marks, key=lambda n: n[1]) if marks else None
    put = min(puts, key=lambda n: n[1]) if puts else None
    ms = lambda s: round(1e3 * s, 1)  # noqa: E731
    return dict(
        first_audio_ms=ms(read - start),
        to_first_step_ms=ms(steps[0][1] - start) if steps else None,
        first_step_ms=ms(steps[0][2] - steps[0][1]) if steps else None,
        t3_steps=len(steps),
        t3_steps_ms=ms(sum(e - s for _, s, e in steps)),
        to_decode_ms=ms(decode[1] - start),
        decode_ms=ms(decode[2] - decode[1]),
        mark_ms=ms(mark[2] - mark[1]) if mark else None,
        decode_end_to_put_ms=ms(put[1] - decode[2]) if put else None,
        put_to_read_ms=ms(read - put[2]) if put else None,
    )


def run_stream(tts: TTS, voice: Voice, tokens: int, first_chunk: int) -> tuple[float, float]:
    start = time.perf_counter()
    for _chunk in tts.stream(TEXT, voice, seed=0, max_new_tokens=tokens, first_chunk=first_chunk):
        read = time.perf_counter()
        break
    return start, read


class OnAThread:
    """Runs calls on one thread of its own with its own default stream, kept for the warm-up and the timed
    runs, as the Worker's threads run."""

    def __init__(self):
        device = mx.default_device()
        self.pool = concurrent.futures.ThreadPoolExecutor(
            1, initializer=lambda: mx.set_default_stream(mx.new_stream(device))
        )

    def __call__(self, run, *args):
        return self.pool.submit(run, *args).result()


def run_worker(worker: Worker, tts: TTS, voice: Voice, tokens: int, first_chunk: int) -> tuple[float, float]:
    job = SpeechJob(
        TEXT,
        voice,
        tts.speech.params_type(max_new_tokens=tokens),
        seed=0,
        stream=True,
        first_chunk=first_chunk,
    )
    start = time.perf_counter()
    read = None
    for _chunk in worker.submit(job):  # read to the end: the next request starts on an idle worker
        read = time.perf_counter() if read is None else read
    return start, read


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="stream,worker-inline,worker-thread")
    p.add_argument("--tokens", type=int, default=100, help="speech tokens of the request")
    p.add_argument("--first-chunk", type=int, default=15)
    p.add_argument("--cfm-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--mark-threads",
        type=int,
        help="the Worker's marking threads (default: serve's, worker.default_mark_threads)",
    )
    p.add_argument("--max-batch", type=int, default=32, help="the Worker's max_batch (serve's default: 32)")
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--tiny", action="store_true", help="tiny networks (a smoke run)")
    p.add_argument(
        "--model", help="a converted model folder, loaded as serve loads it (default: English built here)"
    )
    p.add_argument("--voice", help="a voice file for --model (default: its built-in voice)")
    p.add_argument("--memory-budget", default="auto", type=memory_budget, help="S3Gen.memory_budget")
    p.add_argument(
        "--switch-interval",
        type=float,
        help="sys.setswitchinterval (seconds; Python's default 0.005): how long a thread that wants the GIL waits "
        "for one that holds it, a cost of every hand-over between the Worker's threads",
    )
    p.add_argument(
        "--plain-products",
        action="store_true",
        help="the estimator's products as MLX's ops, not our tensor-core kernel (cfm.TILED_PRODUCTS off; in this "
        "process: not with worker-process, whose process sets its own)",
    )
    p.add_argument("--out", help="append JSON lines here")
    args = p.parse_args()
    modes = args.modes.split(",")
    if set(modes) - {"stream", "stream-thread", "worker-inline", "worker-thread", "worker-process"}:
        p.error(f"--modes {args.modes}: stream, stream-thread, worker-inline, worker-thread, worker-process")
    if "worker-process" in modes and args.model is None:
        p.error("--modes worker-process needs --model: the vocoding process loads S3Gen from a model folder")
    if args.plain_products and (args.device == "cpu" or not mx.cuda.is_available()):
        p.error("--plain-products turns off a CUDA kernel: it needs MLX's CUDA backend and the GPU")
    if args.plain_products and "worker-process" in modes:
        p.error(
            "--plain-products sets this process's switch: the vocoding process of worker-process would not see it"
        )
    cfm.TILED_PRODUCTS = not args.plain_products
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    mx.set_default_device(getattr(mx, args.device))
    tts, voice = load(args)  # evaluated here: the Worker's threads cannot evaluate this thread's lazy arrays
    info = machine_info()
    print(
        "\n| mode | first audio ms | to T3's first step | first step | T3 steps (ms) | to the decode | decode | "
        "mark | decode end to put | put to read |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for mode in modes:
        marking = None  # the Worker's marking threads (its modes)
        if mode == "stream":
            run, close = functools.partial(run_stream, tts, voice), None
        elif mode == "stream-thread":
            thread = OnAThread()
            run, close = functools.partial(thread, run_stream, tts, voice), thread.pool.shutdown
        else:
            vocoding = "process" if mode == "worker-process" else "thread"
            threaded = mode != "worker-inline"
            marking = args.mark_threads or worker_module.default_mark_threads(threaded)
            worker = Worker(
                tts, max_batch=args.max_batch, vocode_thread=threaded, vocoding=vocoding, mark_threads=marking
            )
            worker.start()
            if vocoding == "process":
                note_child_decodes(worker)
            worker.warm_up(voice, first_chunk=args.first_chunk)  # as serve's: every marking thread marks once
            run, close = functools.partial(run_worker, worker, tts, voice), worker.close
        rows = []
        try:
            run(args.tokens, args.first_chunk)  # untimed: traces and kernels
            for _ in range(args.repeats):
                with Recorder() as rec:
                    start, read = run(args.tokens, args.first_chunk)
                rows.append(first_audio(rec.notes, start, read))
        finally:
            if close is not None:
                close()
        med = {k: statistics.median(r[k] for r in rows) if rows[0][k] is not None else None for k in rows[0]}
        write_line(
            dict(bench="first_audio", mode=mode, variant=tts.speech.variant, model=args.model or "built",
                 tokens=args.tokens, first_chunk=args.first_chunk, cfm_dtype=args.cfm_dtype,
                 max_batch=args.max_batch, mark_threads=marking,
                 tiled_products=not args.plain_products,
                 switch_interval=sys.getswitchinterval(), **med, runs=rows, **info),
            args.out,
        )  # fmt: skip
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(
            f"| {mode} | {f(med['first_audio_ms'])} | {f(med['to_first_step_ms'])} | {f(med['first_step_ms'])} | "
            f"{med['t3_steps']:.0f} ({f(med['t3_steps_ms'])}) | {f(med['to_decode_ms'])} | {f(med['decode_ms'])} | "
            f"{f(med['mark_ms'])} | {f(med['decode_end_to_put_ms'])} | {f(med['put_to_read_ms'])} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
