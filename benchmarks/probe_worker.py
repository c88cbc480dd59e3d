"""Where a served T3 step's time goes (issue 24): the same N requests through T3's batch alone on a thread (as
``bench_batch --thread``), through the server's Worker (vocoding thread on), or through ``serve`` itself, on one
model. A one-off probe for the H200; prints one table.

    python benchmarks/probe_worker.py --requests 128 --tokens 250 [--model DIR --voice FILE]
    python benchmarks/probe_worker.py --paths serve --model DIR --voice FILE

Run J (benchmarks/RESULTS.md) found the served T3 step 3x slower than the Worker's in a process of its own at 128
rows, with nothing else running in the server meanwhile. Every step is timed here (median, p90, max, total), so a
few slow steps (traces, joins) show apart from a uniformly slow one. The model is built here at full size
(``bench_stream.build``), or loaded from a converted folder as ``serve`` loads it (``--model``). ``--paths
serve`` runs ``mlx-chatterbox serve`` in this process (uvicorn on the main thread, as the CLI runs it) and sends
it requests over HTTP through bench_serve.py from another process.
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx_chatterbox  # noqa: F401  isort: skip

import argparse
import dataclasses
import functools
import os
import signal
import statistics
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable

import mlx.core as mx
from bench_batch import on_a_thread
from bench_serve import TEXT
from bench_stream import build
from common import cache_step, machine_info, memory_budget, set_cache_step, write_line
from mlx.utils import tree_map

from mlx_chatterbox import TTS, cli, weights
from mlx_chatterbox.generation import batch as batch_module
from mlx_chatterbox.generation import stream as stream_module
from mlx_chatterbox.generation import vocode
from mlx_chatterbox.generation.batch import BatchRequest, ContinuousBatch, SpeechTokenBatch
from mlx_chatterbox.generation.speech_tokens import request_embeds
from mlx_chatterbox.generation.voice import Voice
from mlx_chatterbox.models import cfm
from mlx_chatterbox.models.t3 import T3
from mlx_chatterbox.sampling import SamplingParams
from mlx_chatterbox.server import worker as worker_module
from mlx_chatterbox.server.worker import VOCODINGS, SpeechJob, Worker

HERE = Path(__file__).resolve().parent
STEPS: list[tuple[float, int]] = []  # (seconds, rows) of every ContinuousBatch.step while a path runs
QUEUED: list[float] = []  # seconds of each step's _queue_next: the host's work of queueing it (no waiting)
_step, _queue_next = ContinuousBatch.step, SpeechTokenBatch._queue_next


def _timed_step(self):
    t = time.perf_counter()
    out = _step(self)
    STEPS.append((time.perf_counter() - t, len(out)))
    return out


def _timed_queue_next(self):
    t = time.perf_counter()
    out = _queue_next(self)
    QUEUED.append(time.perf_counter() - t)
    return out


ContinuousBatch.step, SpeechTokenBatch._queue_next = _timed_step, _timed_queue_next
# (rows, capacity, the step it came in) of every trace of T3's batched step, in any path (speech_tokens.traces
# counts them without their shapes)
TRACES: list[tuple[int, int, int]] = []
_decode_window = T3.decode_window


def _traced(self, *args):  # the compiled step calls the Python function only when it traces
    TRACES.append((args[4][0].shape[0], args[4][0].shape[2], len(STEPS)))
    return _decode_window(self, *args)


T3.decode_window = _traced


def new_batch(tts: TTS, voice: Voice, n: int, tokens: int, stop_on_eos: bool = True) -> SpeechTokenBatch:
    """T3's batch with n requests of TEXT and ``tokens`` tokens each added (admitted at its first step)."""
    batch, ids = SpeechTokenBatch(tts.t3, stop_on_eos), tts.text_ids(TEXT)
    for i in range(n):
        batch.add(BatchRequest(ids, voice, SamplingParams(max_new_tokens=tokens), key=mx.random.key(i)))
    return batch


def batch_alone(tts: TTS, voice: Voice, n: int, tokens: int) -> None:
    batch = new_batch(tts, voice, n, tokens)
    while len(batch):
        batch.step()


def shapes(tts: TTS, voice: Voice, sizes: list[int], capacities: list[int]) -> list[dict]:
    """What a new (slots, capacity) costs a step: for each slot count, a batch of that many requests is
    admitted (its first step: the prefill and a trace at its capacity), stepped, then its cache grown to each
    capacity and stepped again; every step timed, with its host's queueing time (a trace happens there)."""
    rows = []
    for n in sizes:
        batch = new_batch(tts, voice, n, 1000, stop_on_eos=False)
        for capacity in capacities:
            if batch._cache is not None:  # (the first step admits the requests at their prefill's capacity)
                batch._cache.reserve(capacity)
            for kind in ("new", "plain", "plain"):
                clear()
                batch.step()
                rows.append(dict(slots=n, capacity=batch._cache.capacity, kind=kind, step_ms=1000 * STEPS[0][0],
                                 queue_ms=1000 * QUEUED[0], traces=len(TRACES)))  # fmt: skip
    return rows


def prefills(tts: TTS, voice: Voice, sizes: list[int], extra: list[int]) -> list[dict]:
    """What a prefill of a new shape costs: groups of N requests whose texts are TEXT plus ``extra`` tokens (so
    prefills of other lengths), each prefilled and evaluated alone, a first time and again; then what the first
    allocation of the largest group's KV buffers at 512 positions costs (a key and a value buffer a layer),
    a first time and again."""
    ids, rows, c = tts.text_ids(TEXT), [], tts.t3.config
    for n in sizes:
        for more in extra:
            embeds = request_embeds(tts.t3, voice, ids + ids[:more], SamplingParams())
            for kind in ("new", "again"):
                t = time.perf_counter()
                mx.eval(tts.t3.prefill(mx.concatenate([embeds] * n))[0])
                rows.append(
                    dict(requests=n, length=embeds.shape[1], kind=kind, ms=1000 * (time.perf_counter() - t))
                )
    shape = (2 * max(sizes), c.num_heads, 512, c.head_dim)
    for kind in ("KV buffers", "KV buffers again"):
        t = time.perf_counter()
        mx.eval([mx.zeros(shape) for _ in range(2 * c.num_layers)])
        rows.append(dict(requests=max(sizes), length=512, kind=kind, ms=1000 * (time.perf_counter() - t)))
    return rows


def prefill_table(args: argparse.Namespace) -> None:
    tts, voice = load(args)
    print("| requests | prefill positions (KV: buffers at 512) | first ms | again ms |\n|---|---|---|---|")
    rows = on_a_thread(prefills, tts, voice, [1, 3, 8, 24, 64, 128], [0, 7, 40])
    for first, again in zip(rows[0::2], rows[1::2]):
        what = first["length"] if first["kind"] == "new" else "KV buffers"
        print(f"| {first['requests']} | {what} | {first['ms']:.1f} | {again['ms']:.1f} |")
        write_line(dict(bench="probe_worker", path="prefill", first=first, again=again,
                        model=str(args.model or "built"), machine=machine_info()), args.out)  # fmt: skip


def worker(
    tts: TTS,
    voice: Voice,
    n: int,
    tokens: int,
    stream: bool,
    over: float = 0.0,
    mark_threads: int = 1,
    vocode_batch: int = 32,
    vocoding: str = "thread",
) -> dict:
    """n jobs through a Worker, submitted at once or one every over/n seconds (as HTTP requests trickle in)."""
    with Worker(
        tts,
        max_batch=n,
        vocode_batch=vocode_batch,
        vocode_thread=True,
        mark_threads=mark_threads,
        vocoding=vocoding,
    ) as w:
        readers = []
        for i in range(n):
            job = SpeechJob(TEXT, voice, SamplingParams(max_new_tokens=tokens), seed=i, stream=stream)
            readers.append(threading.Thread(target=lambda t: [None for _ in t], args=(w.submit(job),)))
            readers[-1].start()
            time.sleep(over / n)
        for r in readers:
            r.join()
        return w.metrics()["phases"]


def clear() -> None:
    STEPS.clear()
    QUEUED.clear()
    TRACES.clear()


def summary(path: str, wall: float, phases: dict | None = None) -> dict:
    times = sorted(s for s, rows in STEPS if rows)
    row = dict(
        path=path,
        wall_s=wall,
        steps=len(times),
        rows_per_step=statistics.mean(rows for _, rows in STEPS if rows),
        median_ms=1000 * statistics.median(times),
        p90_ms=1000 * times[int(0.9 * (len(times) - 1))],
        max_ms=1000 * times[-1],
        queue_median_ms=1000 * statistics.median(QUEUED),
        total_s=sum(times),
        traces=list(TRACES),
    )
    if phases is not None:
        row["phases"] = {
            f"{p['thread']} {p['phase']}": round(p["seconds"], 2) for p in phases if p["seconds"] > 0.05
        }
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--tokens", type=int, default=250)
    p.add_argument(
        "--model", type=Path, help="a converted folder, loaded as `serve` loads it (default: built)"
    )
    p.add_argument("--voice", type=Path, help="with --model: a voice file (default: the folder's built-in)")
    p.add_argument("--cfm-dtype", default="bfloat16")
    p.add_argument(
        "--memory-budget",
        type=memory_budget,
        default="auto",
        help="S3Gen.memory_budget: auto (default), none, MiB (--paths serve: serve's --vocode-memory)",
    )
    p.add_argument("--streams", type=int, default=64, help="streamed requests through the Worker at once")
    p.add_argument(
        "--paths",
        default="batch,whole,streamed",
        help="which of batch,whole,trickled,streamed to run; or shapes alone: the cost of a step's new shapes; or prefill alone: the cost of a prefill's new shapes and of a first KV allocation; or serve alone: `serve` on --model in this process, whole "
        "and streamed requests sent over HTTP by bench_serve.py; or contention alone: T3's batch of --streams rows "
        "beside a thread that holds the GIL, the GPU, or both (S3Gen)",
    )
    p.add_argument(
        "--arrive-over", type=float, default=1.0, help="trickled: seconds over which the jobs arrive"
    )
    p.add_argument(
        "--layout",
        choices=["buckets", "pow2", "fixed"],
        default="buckets",
        help="slots a batch is laid out in (batch.batch_size patched): its 4 sizes a doubling (as shipped), powers "
        "of two, or always --requests (newcomers then take dead slots)",
    )
    p.add_argument(
        "--device-copy",
        action="store_true",
        help="copy every loaded network's parameters with a GPU op after loading (MLX-CUDA reads safetensors into "
        "managed memory; a kernel's output lands in device memory)",
    )
    p.add_argument(
        "--serial-hift",
        action="store_true",
        help="streams' decodes: each stream's HiFT a call of its own, read back before the next is built (as "
        "before 2026-12-03; now one masked call for all of a decode's streams)",
    )
    p.add_argument(
        "--switch-intervals",
        default="5",
        help="in-process paths: each run once per value, the interpreter's thread switch interval in ms "
        "(sys.setswitchinterval; Python's default is 5): how long a thread that released the GIL may wait for it",
    )
    p.add_argument(
        "--mark-threads", default="1", help="worker paths: each run once per value, the Worker's mark_threads"
    )
    p.add_argument(
        "--vocode-batches",
        default="32",
        help="worker paths: each run once per value, the Worker's vocode_batch",
    )
    p.add_argument(
        "--cache-step",
        type=cache_step,
        default=256,
        help="T3's KV capacity grows this many positions at a time (default 256, the library's)",
    )
    p.add_argument(
        "--vocoding",
        choices=VOCODINGS,
        default="thread",
        help="where the vocoding thread's S3Gen work runs: the Worker's vocoding (worker paths), serve --vocoding "
        "(--paths serve)",
    )
    p.add_argument(
        "--t3-steps-per-part",
        type=int,
        metavar="N",
        help="with --vocoding interleaved: T3 steps between two parts of an S3Gen call (worker.T3_STEPS_PER_PART; "
        "default: the library's)",
    )
    p.add_argument(
        "--step-waits",
        type=int,
        metavar="N",
        help="S3Gen's decoder solve keeps at most N steps queued ahead of the running one (cfm.solve's "
        "in_flight), in every path; default: no wait, as shipped",
    )
    p.add_argument("--tiny", action="store_true", help="tiny networks instead of the full size (a smoke run)")
    p.add_argument("--s3gen-loop", type=int, help=argparse.SUPPRESS)  # contention's other process
    p.add_argument("--out")
    args = p.parse_args()
    if args.s3gen_loop:
        return s3gen_loop(args)
    set_cache_step(args.cache_step)
    if args.t3_steps_per_part is not None:
        if args.vocoding != "interleaved" or args.t3_steps_per_part < 1:
            p.error("--t3-steps-per-part: a number >= 1, with --vocoding interleaved")
        worker_module.T3_STEPS_PER_PART = args.t3_steps_per_part
    if args.step_waits is not None:
        if args.step_waits < 1:
            p.error(f"--step-waits {args.step_waits}: give a number of steps >= 1")
        vocode.solve_steps = functools.partial(cfm.solve_steps, in_flight=args.step_waits)
    if args.device_copy and args.model is None:
        p.error("--device-copy: the built model's weights are made on the GPU already; give --model")
    if args.layout == "pow2":
        batch_module.batch_size = lambda n: 1 << (n - 1).bit_length()
    elif args.layout == "fixed":
        batch_module.batch_size = lambda n: max(n, args.requests)
    if args.device_copy:
        weights._load_network = _copied(weights._load_network)
    if args.serial_hift:
        stream_module._vocode = _serial(stream_module._vocode)
    if args.paths == "shapes":
        return shapes_table(args)
    if args.paths == "prefill":
        return prefill_table(args)
    if args.paths == "contention":
        return contention_table(args)
    if args.paths == "serve":
        given = [flag for flag, v in (("--tiny", args.tiny),
                                      ("--switch-intervals", args.switch_intervals != "5"),
                                      ("--mark-threads", args.mark_threads != "1"),
                                      ("--vocode-batches", args.vocode_batches != "32")) if v]  # fmt: skip
        if given:
            p.error(f"{', '.join(given)}: not with --paths serve (serve runs with its own settings)")
        rows = served(args)
    else:
        rows = in_process(args)
    print(f"\n# layout {args.layout}, device copy {args.device_copy}, memory budget {args.memory_budget}, "
          f"serial HiFT {args.serial_hift}")  # fmt: skip
    print(
        "| path | wall s | steps | rows/step | step ms median / p90 / max | queueing ms median | steps total s | traces |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['wall_s']:.1f} | {r['steps']} | {r['rows_per_step']:.1f} | "
              f"{r['median_ms']:.1f} / {r['p90_ms']:.1f} / {r['max_ms']:.1f} | {r['queue_median_ms']:.1f} | "
              f"{r['total_s']:.1f} | {len(r['traces'])} |")  # fmt: skip
    for r in rows:
        print(
            f"# {r['path']}: traced (rows, capacity) {r['traces']}"
            + (f"; {r['phases']}" if "phases" in r else "")
        )


def _serial(vocode: Callable) -> Callable:
    def serial(vocoders, decodes, mels):
        out = []
        for v, d, mel in zip(vocoders, decodes, mels):
            out += vocode([v], [d], [mel])
            mx.eval(out[-1])
        return out

    return serial


def _copied(load: Callable) -> Callable:
    def copied(*args, **kwargs):
        model = load(*args, **kwargs)
        model.update(tree_map(lambda a: a * 1, model.parameters()))  # (* 1 keeps -0.0, + 0 would not)
        mx.eval(model.parameters())
        return model

    return copied


def contention_table(args: argparse.Namespace) -> None:
    """T3's batch of --streams requests stepped on a thread while another thread loads the machine, to tell the
    GIL's share of a served step's slowdown from the GPU's: nothing; a pure-Python loop (the GIL only); chains
    of large bf16 products (the GPU only: a few primitives a call, milliseconds of device time); ``S3Gen.batch``
    calls of half as many 10 s requests (both, as the vocoding thread's decodes do); the same calls in another
    process (what a vocoder process would leave T3: no GIL, MLX scheduler or memory limit shared, the GPU
    time-sliced between the two). Every T3 step timed."""
    tts, voice = load(args)
    n, tokens, device = args.streams, args.tokens, mx.default_device()
    size = 256 if args.tiny else 8192  # the products' side: 1.1 TFLOP each at full size
    speech = _speech()  # evaluated here: the other thread cannot evaluate an array made lazily on this one

    def python_load() -> None:
        sum(i * i for i in range(200_000))

    def gpu_load(a: mx.array) -> None:
        y = a
        for _ in range(8):
            y = y @ a
        mx.eval(y)

    def s3gen_load() -> None:
        _s3gen_call(tts, voice, speech, max(1, n // 2))

    def hog(work: Callable, stop: threading.Event, calls: list[int], errors: list[BaseException]) -> None:
        mx.set_default_stream(mx.new_stream(device))
        try:
            if work is gpu_load:
                a = mx.random.normal((size, size), key=mx.random.key(2)).astype(mx.bfloat16) / size**0.5
                work = functools.partial(gpu_load, a)
            while not stop.is_set():
                work()
                calls[0] += 1
        except BaseException as error:  # re-raised on the main thread: a load that failed measured nothing
            errors.append(error)
        finally:
            mx.synchronize()
            mx.clear_streams()

    def another_process(stop: threading.Event, calls: list[int], errors: list[BaseException]) -> None:
        """``S3Gen.batch`` calls as ``s3gen_load``, in a process of its own (its own MLX scheduler, memory limit
        and interpreter: none of them shared with T3's), counted as it reports them."""
        child = subprocess.Popen(
            [sys.executable, __file__, "--s3gen-loop", str(max(1, n // 2)), "--cfm-dtype", args.cfm_dtype,
             "--memory-budget", _budget_arg(args.memory_budget), *(["--tiny"] if args.tiny else []),
             *(["--model", str(args.model)] if args.model else []),
             *(["--voice", str(args.voice)] if args.voice else []),
             *(["--step-waits", str(args.step_waits)] if args.step_waits else [])],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            for line in child.stdout:
                if stop.is_set():
                    break
                calls[0] += line.startswith("call")
        finally:
            child.terminate()
            if child.wait() not in (0, -signal.SIGTERM):
                errors.append(RuntimeError(f"the S3Gen process ended with {child.returncode}"))

    print(f"| T3's batch of {n} rows, {tokens} tokens, beside | wall s | step ms median / p90 / max | steps total s "
          "| the other thread's calls |\n|---|---|---|---|---|")  # fmt: skip
    for name, work in (("nothing", None), ("Python", python_load), ("GPU products", gpu_load),
                       ("S3Gen.batch", s3gen_load), ("S3Gen.batch, another process", another_process)):  # fmt: skip
        on_a_thread(batch_alone, tts, voice, n, 30)  # its shapes traced
        stop, calls, errors = threading.Event(), [0], []
        if work is another_process:
            # daemon: should T3's run fail, the process ends, and the child with it at its next line (pipe)
            other = threading.Thread(target=another_process, args=(stop, calls, errors), daemon=True)
            other.start()
            while calls[0] < 2 and other.is_alive():  # built, and past its first call's kernel builds
                time.sleep(0.5)
        else:
            other = threading.Thread(target=hog, args=(work, stop, calls, errors)) if work else None
            if other:
                other.start()
                time.sleep(2.0)  # its first calls (and their kernel builds) before T3 starts
        calls[0] = 0
        clear()
        t = time.perf_counter()
        on_a_thread(batch_alone, tts, voice, n, tokens)
        row = summary(f"T3 {n} rows beside {name}", time.perf_counter() - t)
        stop.set()
        if other:
            other.join()
        if errors:
            raise RuntimeError(f"the {name} load failed") from errors[0]
        print(f"| {name} | {row['wall_s']:.2f} | {row['median_ms']:.1f} / {row['p90_ms']:.1f} / "
              f"{row['max_ms']:.1f} | {row['total_s']:.2f} | {calls[0]} |")  # fmt: skip
        write_line(dict(bench="probe_worker", beside=name, other_calls=calls[0], **row,
                        memory_budget=args.memory_budget, step_waits=args.step_waits,
                        model=str(args.model or "built"), machine=machine_info()), args.out)  # fmt: skip


def _budget_arg(budget: int | str | None, gb: bool = False) -> str:
    """``--memory-budget``'s value back as its argument (MiB), or as ``serve --vocode-memory``'s (GB)."""
    if budget is None or budget == "auto":
        return budget or "none"
    return str(budget / 2**30) if gb else str(budget // 2**20)


def _speech() -> mx.array:
    """The speech tokens of the contention probe's S3Gen calls: 250 (10 s), evaluated."""
    speech = mx.random.randint(0, 6561, (1, 250), key=mx.random.key(1))
    mx.eval(speech)
    return speech


def _s3gen_call(tts: TTS, voice: Voice, speech: mx.array, requests: int) -> None:
    """One ``S3Gen.batch`` of ``requests`` copies of ``speech``, as the vocoding thread's calls are made."""
    mx.eval(tts.s3gen.batch([speech] * requests, [voice] * requests, bucket=25))


def s3gen_loop(args: argparse.Namespace) -> None:
    """``contention``'s other process: ``S3Gen.batch`` of ``--s3gen-loop`` 10 s requests again and again, a line
    on stdout after each, until it is terminated."""
    tts, voice = load(args)
    speech = _speech()
    while True:
        _s3gen_call(tts, voice, speech, args.s3gen_loop)
        print("call", flush=True)


def shapes_table(args: argparse.Namespace) -> None:
    """``shapes`` twice, each on a thread and MLX stream of its own: the second pass traces the same shapes again
    (compiled steps are kept per stream) with their kernels built by the first."""
    tts, voice = load(args)
    sizes, capacities = [1, 4, 16, 64, 128], [256, 512, 768]
    print("| pass | slots | capacity | new shape: step ms (queueing ms) | plain step ms (queueing ms) |")
    print("|---|---|---|---|---|")
    for name in ("first", "again, new stream"):
        rows = on_a_thread(shapes, tts, voice, sizes, capacities)
        for new, plain in zip(rows[0::3], rows[2::3]):
            print(f"| {name} | {new['slots']} | {new['capacity']} | {new['step_ms']:.1f} ({new['queue_ms']:.1f}), "
                  f"{new['traces']} traces | {plain['step_ms']:.1f} ({plain['queue_ms']:.1f}) |")  # fmt: skip
            write_line(dict(bench="probe_worker", path="shapes", pass_=name, new=new, plain=plain,
                            model=str(args.model or "built"), machine=machine_info()), args.out)  # fmt: skip


def load(args: argparse.Namespace) -> tuple[TTS, Voice]:
    """The model (built, or loaded as ``serve`` loads it) and the voice, evaluated on this thread."""
    if args.model is None:
        tts = build(args.tiny)
        tts.s3gen.estimator.set_dtype(getattr(mx, args.cfm_dtype))
        mx.eval(tts.s3gen.estimator.parameters())  # here: the Worker's threads cannot evaluate lazy weights
    else:
        tts = TTS.load(args.model, cfm_dtype=args.cfm_dtype)
    tts.s3gen.memory_budget = args.memory_budget
    voice = Voice.load(args.voice) if args.voice else tts.builtin_voice
    mx.eval(dataclasses.astuple(voice))  # here: the threads below cannot evaluate a lazily loaded voice
    return tts, voice


def in_process(args: argparse.Namespace) -> list[dict]:
    tts, voice = load(args)
    n, tokens = args.requests, args.tokens
    over = args.arrive_over
    runs = []
    knobs = [
        (m, b)
        for m in map(int, args.mark_threads.split(","))
        for b in map(int, args.vocode_batches.split(","))
    ]
    for name in args.paths.split(","):
        for m, b in knobs if name != "batch" else [(None, None)]:
            also = f", {m} marking, vocode batch {b}" if m is not None else ""
            runs.append({
                "batch": ("batch alone, thread", lambda k: on_a_thread(batch_alone, tts, voice, n, k)),
                "whole": (f"worker, whole{also}",
                          lambda k, m=m, b=b: worker(tts, voice, n, k, False, 0, m, b, args.vocoding)),
                "trickled": (f"worker, whole, arriving over {over:g} s{also}",
                             lambda k, m=m, b=b: worker(tts, voice, n, k, False, over, m, b, args.vocoding)),
                "streamed": (f"worker, {args.streams} streamed{also}",
                             lambda k, m=m, b=b: worker(tts, voice, args.streams, k, True, 0, m, b, args.vocoding)),
            }[name])  # fmt: skip
    info, rows, default_interval = machine_info(), [], sys.getswitchinterval()
    for name, run in runs:
        for ms in map(float, args.switch_intervals.split(",")):
            sys.setswitchinterval(ms / 1000)
            run(30)  # warm-up: this batch's shapes traced
            clear()
            t = time.perf_counter()
            phases = run(tokens)
            rows.append(summary(f"{name}, switch {ms:g} ms", time.perf_counter() - t, phases))
            write_line(dict(bench="probe_worker", model=str(args.model or "built"), tokens=tokens, **rows[-1],
                            layout=args.layout, device_copy=args.device_copy, serial_hift=args.serial_hift,
                            memory_budget=tts.s3gen.memory_budget, switch_ms=ms, cache_step=args.cache_step,
                            vocoding=args.vocoding, t3_steps_per_part=worker_module.T3_STEPS_PER_PART,
                            machine=info), args.out)  # fmt: skip
    sys.setswitchinterval(default_interval)
    return rows


def served(args: argparse.Namespace) -> list[dict]:
    """``serve`` as the CLI runs it (uvicorn on this, the main, thread), every T3 step timed; a thread sends
    whole and then streamed requests (a warm-up round of 30 tokens before each) through bench_serve.py, then
    stops the server with SIGINT."""
    if args.model is None:
        raise SystemExit("--paths serve needs --model (and --voice): a converted folder")
    port, rows = 8011, []
    url = f"http://127.0.0.1:{port}"

    def drive() -> None:
        try:
            wait_for(url)
            for fmt, n in (("whole", args.requests), ("streamed", args.streams)):
                if n == 0:  # --requests 0 or --streams 0: that scenario left out
                    continue
                for tokens in (30, args.tokens):
                    clear()
                    t = time.perf_counter()
                    load = ["--concurrency", n, "--formats", fmt, "--requests", n, "--tokens", tokens]
                    subprocess.run(
                        [sys.executable, str(HERE / "bench_serve.py"), "--url", url, *map(str, load)]
                    )
                rows.append(summary(f"served, {n} {fmt}", time.perf_counter() - t))
                write_line(dict(bench="probe_worker", model=str(args.model), tokens=args.tokens, **rows[-1],
                                layout=args.layout, device_copy=args.device_copy, serial_hift=args.serial_hift,
                                memory_budget=args.memory_budget, step_waits=args.step_waits,
                                vocoding=args.vocoding, t3_steps_per_part=worker_module.T3_STEPS_PER_PART,
                                machine=machine_info()), args.out)  # fmt: skip
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=drive, daemon=True).start()
    flags = ["--model", str(args.model), "--port", str(port), "--max-batch", "128", "--max-queue", "256"]
    flags += [
        "--cfm-dtype",
        args.cfm_dtype,
        "--vocode-batch",
        "32",
        "--vocode-thread",
        "on",
    ]  # (auto on a GPU)
    flags += [
        "--vocode-memory",
        _budget_arg(args.memory_budget, gb=True),
        "--vocoding",
        args.vocoding,
    ]
    cli.main(["serve", *flags, *(["--voice", str(args.voice)] if args.voice else [])])
    return rows


def wait_for(url: str, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{url}/health did not answer in {timeout:g} s")


if __name__ == "__main__":
    main()
