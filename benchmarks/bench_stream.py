"""Serving: time to first audio of a streamed request, and many requests at once through the server's engine
(server/worker.py), on the full-size English model with random weights.

- ``stream``: one ``TTS.stream`` request alone: seconds to its first chunk, and to its end; then the parts of
  the first audio, each timed alone (T3 to the 10th token, the first S3Gen decode, the chunk's watermark).
- ``worker``: N requests submitted at once to one ``Worker`` (T3 batched, S3Gen per request), streamed or
  not: time to each request's first audio (median and worst), the wall time until all are done, and the
  aggregate real-time factor (wall / seconds of audio made).

The voice is random at upstream's sizes (6 s T3 prompt, 10 s S3Gen prompt); random weights never stop, so
each request speaks ``--tokens`` speech tokens (``max_new_tokens``). Watermark on, as users get it.

    python benchmarks/bench_stream.py --tokens 250 --concurrency 1,8,32 --out benchmarks/out/stream.jsonl
    python benchmarks/bench_stream.py --cfm-dtype bfloat16 --first-chunk 15 --concurrency 1   # as served on a GPU

``--stream-context whole`` times the streams that re-decode the whole prefix (default: the 50-token window).
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the toy tokenizer
import mlx_chatterbox  # noqa: F401  isort: skip  (before mlx.core: see _backend.py)
from mlx_chatterbox import _backend  # isort: skip

import argparse
import dataclasses
import statistics
import threading
import time

import mlx.core as mx
import numpy as np
from common import machine_info, memory_budget, write_line
from mlx.utils import tree_flatten
from toy_tokenizer import build_toy_tokenizer

from mlx_chatterbox import TTS
from mlx_chatterbox.generation.speech_tokens import EnglishSpeech, generate_speech_tokens
from mlx_chatterbox.cli.common import stream_context
from mlx_chatterbox.generation.stream import CONTEXT as STREAM_CONTEXT
from mlx_chatterbox.generation.stream import FIRST_CHUNK
from mlx_chatterbox.generation.stream import StreamVocoder
from mlx_chatterbox.generation.vocode import S3Gen
from mlx_chatterbox.generation.voice import Voice
from mlx_chatterbox.models.cfm import Estimator
from mlx_chatterbox.models.flow import Flow
from mlx_chatterbox.models.hift import HiFT
from mlx_chatterbox.models.t3 import T3
from mlx_chatterbox.sampling import SamplingParams
from mlx_chatterbox.server.worker import SpeechJob, Worker
from mlx_chatterbox.text import EnTokenizer
from mlx_chatterbox.variants import ModelConfig
from mlx_chatterbox.weights import ModelFolder

TEXT = "Speech synthesis turns written text into spoken words, and this voice was cloned a moment ago."
SAMPLE_RATE = 24000


def build(tiny: bool = False) -> TTS:
    mx.random.seed(0)
    cfg = ModelConfig()
    if tiny:  # a smoke run (tests/conftest.py's tiny networks; the voice keeps upstream's sizes)
        from conftest import TINY_MODEL as cfg
    t3 = T3(cfg.t3)
    s3gen = S3Gen(Flow(cfg.flow), Estimator(cfg.cfm), HiFT(cfg.hift))
    # Every array they hold (rope periods too, as weights.py loads): the Worker's thread cannot evaluate them.
    mx.eval([a for m in (t3, s3gen.flow, s3gen.estimator, s3gen.hift) for _, a in tree_flatten(m)])
    voice = Voice(
        speaker_emb=mx.random.normal((1, cfg.t3.speaker_embed_size)),
        t3_prompt_tokens=mx.random.randint(0, 6561, (1, 150)).astype(mx.int32),
        s3gen_prompt_tokens=mx.random.randint(0, 6561, (1, 250)).astype(mx.int32),
        s3gen_prompt_mel=mx.random.normal((1, 500, 80)) - 5,
        xvector=mx.random.normal((1, 192)),
    )
    mx.eval(dataclasses.astuple(voice))  # made here: the Worker's thread refuses lazy voices
    tokenizer = EnTokenizer(build_toy_tokenizer())
    folder = ModelFolder(Path("."), {}, cfg, t3, s3gen, tokenizer, voice, EnglishSpeech(t3, tokenizer))
    return TTS(folder)


def bench_stream(
    tts: TTS, tokens: int, context: int | str = STREAM_CONTEXT, first_chunk: int = FIRST_CHUNK
) -> dict:
    start = time.perf_counter()
    first, samples = None, 0
    for chunk in tts.stream(TEXT, seed=0, max_new_tokens=tokens, context=context, first_chunk=first_chunk):
        first = time.perf_counter() - start if first is None else first
        samples += len(chunk)
    return dict(first_audio_s=first, total_s=time.perf_counter() - start, audio_s=samples / SAMPLE_RATE)


def first_audio_parts(tts: TTS, first_chunk: int = FIRST_CHUNK) -> dict:
    """Where a stream's first audio goes, each part alone (medians of 3): T3 to the first_chunk-th token (prefill
    included), the first S3Gen decode of that many tokens, and Perth's mark on the chunk it gives."""
    ids, voice = tts.text_ids(TEXT), tts.builtin_voice
    params = SamplingParams(max_new_tokens=first_chunk)
    tokens = [t % 6561 for t in generate_speech_tokens(tts.t3, voice, ids, params, key=mx.random.key(0))]
    parts: dict[str, list[float]] = {"t3_s": [], "s3gen_s": [], "watermark_s": []}
    for _ in range(3):
        t0 = time.perf_counter()
        list(generate_speech_tokens(tts.t3, voice, ids, params, key=mx.random.key(0)))
        t1 = time.perf_counter()
        chunk = StreamVocoder(tts.s3gen, voice, key=mx.random.key(1)).push(tokens)
        t2 = time.perf_counter()
        tts._mark_chunk(chunk)
        t3 = time.perf_counter()
        for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
            parts[name].append(dt)
    return {name: statistics.median(v) for name, v in parts.items()}


def bench_worker(
    tts: TTS,
    n: int,
    tokens: int,
    stream: bool,
    vocode_batch: int = 8,
    context: int | str = STREAM_CONTEXT,
    thread: bool = False,
    spread: bool = False,
    first_chunk: int = FIRST_CHUNK,
) -> dict:
    """``n`` concurrent requests of ``tokens`` speech tokens (``spread``: tokens/2 .. tokens, so that they end
    in different steps); ``thread``: the Worker's vocode_thread."""
    counts = np.linspace(max(1, tokens // 2), tokens, n).round().astype(int) if spread else [tokens] * n
    firsts, samples = [], []

    def read(ticket, start: float) -> None:
        count = 0
        for chunk in ticket:
            if not count:
                firsts.append(time.perf_counter() - start)
            count += len(chunk)
        samples.append(count)

    with Worker(tts, max_batch=max(n, 1), vocode_batch=vocode_batch, vocode_thread=thread) as worker:
        start = time.perf_counter()
        readers = [
            threading.Thread(target=read, args=(worker.submit(job), start))
            for job in (
                SpeechJob(TEXT, tts.builtin_voice, SamplingParams(max_new_tokens=int(c)), seed=i, stream=stream,
                          stream_context=context, first_chunk=first_chunk)
                for i, c in enumerate(counts)
            )
        ]  # fmt: skip
        for r in readers:
            r.start()
        for r in readers:
            r.join()
        wall = time.perf_counter() - start
    audio = sum(samples) / SAMPLE_RATE
    return dict(
        first_audio_median_s=statistics.median(firsts),
        first_audio_max_s=max(firsts),
        wall_s=wall,
        audio_s=audio,
        rtf=wall / audio,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=250, help="speech tokens per request (25 per second)")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated request counts (worker)")
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument(
        "--vocode-batch", type=int, default=8, help="the Worker's vocode_batch (1: every piece vocoded alone)"
    )
    parser.add_argument(
        "--memory-budget",
        default="auto",
        type=memory_budget,
        help="S3Gen.memory_budget: auto, none, or MiB above the memory in use at a call's start",
    )
    parser.add_argument(
        "--stream-context",
        type=stream_context,
        default=STREAM_CONTEXT,
        help=f"streamed requests' decode window: speech tokens or 'whole' (default {STREAM_CONTEXT})",
    )
    parser.add_argument(
        "--first-chunk", type=int, default=FIRST_CHUNK, help="speech tokens before a stream's first decode"
    )
    parser.add_argument(
        "--cfm-dtype", choices=("float32", "bfloat16"), default="float32", help="the CFM estimator's dtype"
    )
    parser.add_argument("--worker-only", action="store_true", help="skip the rows of tts.stream alone")
    parser.add_argument(
        "--vocode-thread", action="store_true", help="the Worker vocodes on a thread of its own"
    )
    parser.add_argument(
        "--spread", action="store_true", help="request i of n: tokens/2 .. tokens, ending in different steps"
    )
    parser.add_argument("--formats", default="streamed,whole", help="worker rows: streamed,whole")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny networks instead of the full size (a smoke run)"
    )
    parser.add_argument("--out", help="append JSON lines here")
    args = parser.parse_args(argv)
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    tts = build(args.tiny)
    # As TTS.load(cfm_dtype=) does, evaluated here: the Worker's thread cannot evaluate this thread's lazy arrays.
    tts.s3gen.estimator.set_dtype(getattr(mx, args.cfm_dtype))
    mx.eval(tts.s3gen.estimator.parameters())
    tts.s3gen.memory_budget = args.memory_budget
    info = machine_info()
    rows = []
    if not args.worker_only:
        bench_stream(tts, 30, args.stream_context, args.first_chunk)  # warm-up: traces and compiles
        rows.append(
            dict(
                mode="stream",
                requests=1,
                **bench_stream(tts, args.tokens, args.stream_context, args.first_chunk),
                peak_mem_bytes=mx.get_peak_memory(),
            )
        )
        # Each row is written as soon as it is measured, so that a run cut short keeps what it measured.
        line = dict(bench="stream", tokens=args.tokens, memory_budget=args.memory_budget,
                    stream_context=args.stream_context, first_chunk=args.first_chunk, cfm_dtype=args.cfm_dtype,
                    **rows[0])  # fmt: skip
        write_line(dict(**line, machine=info, backend=_backend.STATUS), args.out)
        parts = first_audio_parts(tts, args.first_chunk)
        print(
            "# first audio, part by part (s): " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()),
            file=sys.stderr,
        )
        write_line(dict(bench="stream", mode="first audio parts", first_chunk=args.first_chunk,
                        cfm_dtype=args.cfm_dtype, **parts, machine=info), args.out)  # fmt: skip
    shape = dict(vocode_batch=args.vocode_batch, thread=args.vocode_thread, spread=args.spread,
                 first_chunk=args.first_chunk)  # fmt: skip
    for stream in [f == "streamed" for f in args.formats.split(",")]:
        for n in (int(c) for c in args.concurrency.split(",")):
            knobs = dict(context=args.stream_context, **shape)
            bench_worker(tts, n, 30, stream, **knobs)  # warm-up for this batch's shapes
            mx.reset_peak_memory()
            row = bench_worker(tts, n, args.tokens, stream, **knobs)
            rows.append(dict(mode="worker, " + ("streamed" if stream else "whole"), requests=n, **row,
                             peak_mem_bytes=mx.get_peak_memory()))  # fmt: skip
            row = dict(bench="stream", tokens=args.tokens, **shape, memory_budget=args.memory_budget,
                       cfm_dtype=args.cfm_dtype,
                       stream_context=args.stream_context,
                       **rows[-1])  # fmt: skip
            write_line(dict(**row, machine=info), args.out)
    print("\n| mode | requests | first audio (median / worst) s | wall s | audio s | RTF | peak GB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        first = f"{r.get('first_audio_median_s', r.get('first_audio_s')):.3f} / {r.get('first_audio_max_s', r.get('first_audio_s')):.3f}"
        wall = r.get("wall_s", r.get("total_s"))
        print(
            f"| {r['mode']} | {r['requests']} | {first} | {wall:.2f} | {r['audio_s']:.1f} | {wall / r['audio_s']:.3f} | {r['peak_mem_bytes'] / 1e9:.1f} |"
        )


if __name__ == "__main__":
    main()
