"""``mlx-chatterbox serve``: the OpenAI-compatible speech server."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

from ..api import FIRST_CHUNK, MAX_FIRST_CHUNK, STREAM_CONTEXT, TTS, check_chunks
from ..server.worker import VOCODINGS
from . import common

# serve's start line: where the vocoding thread's S3Gen work runs (--vocoding)
S3GEN_PLACES = {
    "thread": "on a thread of its own",
    "process": "in a process of its own",
    "interleaved": "between T3's steps",
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible speech server",
        description="Serve POST /v1/audio/speech (OpenAI's text-to-speech API, plus Chatterbox's knobs) and a "
        "voice library under /v1/audio/voices over HTTP, batching concurrent requests through one model "
        "(needs mlx-chatterbox[serve]; README: Server).",
    )
    common.model_arguments(p)  # here --voice is the voice named "default" (instead of the built-in one)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (default: 8000)")
    p.add_argument(
        "--max-batch",
        type=common.at_least_1,
        default=32,
        help="requests whose speech tokens are drawn together, at most (default: 32)",
    )
    p.add_argument(
        "--vocode-batch",
        type=common.at_least_1,
        default=8,
        help="requests whose speech tokens are vocoded together, at most: whole ones that T3 has finished while "
        "S3Gen was busy, and streams' chunks due in the same step (default: 8; S3Gen's memory grows with it; "
        "with --cfm-dtype bfloat16 on a GPU more pay: on an H200 a bf16 decoder step for 32 requests took 2x "
        "the time of one for 8)",
    )
    p.add_argument(
        "--vocode-thread",
        choices=("auto", "on", "off"),
        nargs="?",
        const="on",
        default="auto",
        help="vocode whole requests and streamed chunks on a thread of their own while T3 keeps stepping, and "
        "watermark the audio on a third (on), or both on the model thread after each step (off); auto (the default): on with MLX-CUDA, where it took 128 concurrent "
        "requests from 11x to 20x real time on an H200, off elsewhere (no gain on CPUs; not measured on Macs)",
    )
    p.add_argument(
        "--vocoding",
        choices=("auto", *VOCODINGS),
        default="auto",
        help="with the vocoding thread: where its S3Gen work runs: on that thread; in a process of its own, which "
        "loads its own S3Gen at start and shares neither MLX's process-wide throttles nor Python's GIL with T3 (on an "
        "H200: 16 English streams 30.5x real time against the thread's 32.7x, a lone stream's first audio 0.25 s "
        "against 0.22, Turbo's 0.18 s each; launched without CUDA graphs, MLX_USE_CUDA_GRAPHS=0, it gave 64 Turbo "
        "streams 76x against 55x in an older build, but 16 English streams 18.0x now); "
        "auto (the default): the process with MLX-CUDA, the thread elsewhere; or interleaved: on "
        "the model thread, a part of each S3Gen call (a flow-matching step) between two T3 steps, so that the GPU "
        "runs them one after the other instead of side by side (on an H200, 32 streams: 20.8x real time against "
        "the thread's 33.7x, first audio 2.6 s against 2.1)",
    )
    p.add_argument(
        "--mark-threads",
        type=_mark_threads,
        default="auto",
        metavar="N|auto",
        help="with the vocoding thread: threads that watermark the audio, each request's on one of them (Perth's "
        "resampling and FFTs run on the CPU and release the GIL); auto (the default): a quarter of the CPU's cores, "
        "1 to 4, with the vocoding thread, else 1 (on an H200 four took 128 whole requests from 53x to 74x real time, "
        "Turbo's from 98x to 145x)",
    )
    p.add_argument(
        "--stream-catch-up",
        choices=("on", "off"),
        help="with the vocoding thread: a stream whose tokens waited for a busy S3Gen takes them all into its next "
        "decode (on, the default: fewer, longer decodes when the server is loaded; chunk boundaries then depend on "
        "timing), or decodes at the fixed chunk boundaries of `say --stream` whatever the load (off)",
    )
    p.add_argument(
        "--warm-batches",
        choices=("auto", "on", "off"),
        default="auto",
        help="before listening, step T3's batch once at every size it takes up to --max-batch, in the default voice, "
        "so that the first requests of each size wait for no kernel builds (auto, the default: on with MLX-CUDA, "
        "where a new size costs seconds the first time on a machine, when there is a default voice; off elsewhere)",
    )
    p.add_argument(
        "--max-queue",
        type=common.at_least_1,
        default=128,
        help="requests running or waiting, at most; more are answered 429 (default: 128)",
    )
    p.add_argument(
        "--voices",
        type=Path,
        metavar="DIR",
        help="folder of the stored voices (<name>.safetensors; uploads go there); default: "
        "$XDG_CACHE_HOME/mlx-chatterbox/voices or ~/.cache/mlx-chatterbox/voices",
    )
    p.add_argument(
        "--cfm-steps",
        type=common.at_least_1,
        help="Euler steps of the flow-matching decoder for requests that give none (default: the model's, 10; Turbo/Nano 2)",
    )
    common.stream_context_argument(p, "streamed requests that give no stream_context")
    p.add_argument(
        "--first-chunk",
        type=_first_chunk,
        default="auto",
        metavar="N|auto",
        help="speech tokens a streamed request waits for before its first audio; auto (the default): at start, "
        f"time how long the second chunk takes to follow the first, and wait for the fewest tokens from "
        f"{FIRST_CHUNK} to {MAX_FIRST_CHUNK} whose first chunk lasts that long (a listener then hears no gap "
        f"between them); {FIRST_CHUNK} on CPUs, where no first chunk lasts long enough, and without a default "
        "voice to time it with",
    )
    common.cfm_dtype_argument(p)
    p.add_argument(
        "--memory-limit",
        type=float,
        metavar="GB",
        help="cap MLX's memory (mx.set_memory_limit) and its buffer cache at this many GB (default: no cap)",
    )
    p.add_argument(
        "--vocode-memory",
        type=_vocode_memory,
        default="auto",
        metavar="GB|auto|none",
        help="memory an S3Gen call may take above what is in use when it starts; beyond it MLX waits for the "
        "call's queued work before queueing more (MLX's limit is process-wide: T3's steps wait too). auto (the "
        "default): on a GPU 0.25 GB for a lone request and 1 GB a request of a batched call, up to 8 "
        "(0.25 GB a request on a CPU); none: MLX's own limit only (fastest, several times the "
        "memory)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="on SIGTERM/SIGINT, seconds the requests in flight get to finish before they are cut "
        "(new ones are refused with 503; a second signal exits at once; default: 10)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every path but /health and / (repeatable; "
        "$MLX_CHATTERBOX_API_KEY adds comma-separated keys)",
    )
    p.add_argument(
        "--allowed-origins",
        action="append",
        metavar="ORIGINS",
        help="web origins whose pages may call the server (CORS), comma-separated, e.g. "
        "https://app.example.com, or * (default: none, same origin only)",
    )
    p.add_argument("--no-ui", action="store_true", help="do not serve the playground page at /")


def _times_first_chunk() -> bool:
    """``--first-chunk auto`` times the chunks on GPUs; on a CPU a chunk's decode outlasts any first chunk."""
    import mlx.core as mx

    return mx.default_device() != mx.cpu


def _first_chunk(text: str) -> int | str:
    """An argparse type: ``--first-chunk``'s number of speech tokens, or auto."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of speech tokens nor auto") from None
    try:
        check_chunks(value, 1)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace(f"first_chunk={value} ", f"{value} ")) from None
    return value


def _mark_threads(text: str) -> int | str:
    """An argparse type: ``--mark-threads``' count of threads, or auto."""
    return text if text == "auto" else common.at_least_1(text)


_mark_threads.__name__ = "thread count"


def _vocode_memory(text: str) -> int | str | None:
    """An argparse type: ``--vocode-memory`` as ``S3Gen.memory_budget`` (bytes, "auto" or None)."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of GB nor auto or none") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: give a positive number of GB, auto or none")
    return int(value * 2**30)


_vocode_memory.__name__ = "memory budget"


def _port(text: str) -> int:
    """An argparse type: a TCP port, 1-65535."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is out of range: a port is in 1-65535")
    return value


_port.__name__ = "port"


def run(args: argparse.Namespace) -> None:
    # Fail before the model loads when the server's packages are missing.
    missing = [m for m in ("fastapi", "uvicorn", "python_multipart") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"the server needs {', '.join(missing)}, which is not installed: pip install 'mlx-chatterbox[serve]'"
        )
    import mlx.core as mx

    from ..server import gate
    from ..server.app import create_app
    from ..server.run import check_shutdown_timeout, serve
    from ..server.voices import VoiceStore, default_voices_dir
    from ..server.worker import (
        Worker,
        default_mark_threads,
        default_vocode_thread,
        default_vocoding,
        default_warm_batches,
    )

    given_voice = common.read_voice(args.voice)
    if args.memory_limit is not None and not args.memory_limit > 0:
        raise ValueError(f"--memory-limit {args.memory_limit}: give a positive number of GB")
    check_shutdown_timeout(args.shutdown_timeout, "--shutdown-timeout")
    vocode_thread = default_vocode_thread() if args.vocode_thread == "auto" else args.vocode_thread == "on"
    if args.stream_catch_up is not None and not vocode_thread:
        raise common.UsageError(
            "--stream-catch-up applies to streams decoded on the vocoding thread, which is off here; add "
            "--vocode-thread on, or leave --stream-catch-up out"
        )
    if args.mark_threads != "auto" and args.mark_threads > 1 and not vocode_thread:
        raise common.UsageError(
            f"--mark-threads {args.mark_threads}: the marking threads run beside the vocoding thread, which is off "
            "here; add --vocode-thread on, or leave --mark-threads out"
        )
    if args.vocoding not in ("auto", "thread") and not vocode_thread:
        raise common.UsageError(
            f"--vocoding {args.vocoding} places the vocoding thread's S3Gen work, and the thread is off here; add "
            "--vocode-thread on, or leave --vocoding out"
        )
    mark_threads = default_mark_threads(vocode_thread) if args.mark_threads == "auto" else args.mark_threads
    keys, origins = gate.api_keys(args.api_key), gate.allowed_origins(args.allowed_origins)
    folder = args.voices if args.voices is not None else default_voices_dir()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--voices {folder}: not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--voices {folder}: the folder is not writable (uploaded voices are saved there)")
    tts = TTS.load(args.model, variant=args.variant, cfm_dtype=args.cfm_dtype)
    if args.vocode_memory != "auto":
        if tts.torch_s3gen is not None:
            raise common.UsageError(
                "--vocode-memory bounds MLX's S3Gen, and this model vocodes with upstream's (hybrid mode); "
                "leave --vocode-memory out"
            )
        tts.s3gen.memory_budget = args.vocode_memory
    if args.memory_limit is not None:
        limit = int(args.memory_limit * 2**30)
        mx.set_memory_limit(limit)
        mx.set_cache_limit(limit)
    default = common.voice(tts, given_voice) or tts.builtin_voice
    warm_batches = default_warm_batches() if args.warm_batches == "auto" else args.warm_batches == "on"
    if args.warm_batches == "on" and default is None:
        raise common.UsageError(
            "--warm-batches on steps T3's batch in the default voice, and this model has no built-in voice: give "
            "--voice FILE, or leave --warm-batches at auto or off"
        )
    voices = VoiceStore(folder, default)
    model_name = Path(args.model).name or str(args.model)
    with Worker(
        tts,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        vocode_batch=args.vocode_batch,
        vocode_thread=vocode_thread,
        vocoding=default_vocoding(tts, vocode_thread) if args.vocoding == "auto" else args.vocoding,
        stream_catch_up=args.stream_catch_up != "off",
        mark_threads=mark_threads,
    ) as worker:
        first_chunk = FIRST_CHUNK if args.first_chunk == "auto" else args.first_chunk
        if default is not None:  # so that the first request pays no kernel compilation nor step tracing
            worker.warm_up(default, common.english(tts), first_chunk)
            if warm_batches:
                start = time.perf_counter()
                counts = worker.warm_batches(default, common.english(tts))
                print(
                    f"T3's batch stepped at {len(counts)} sizes, 1 to {counts[-1]} requests, in "
                    f"{time.perf_counter() - start:.1f} s (--warm-batches)",
                    file=sys.stderr,
                )
            if args.first_chunk == "auto" and _times_first_chunk():
                try:
                    first_chunk = worker.playback_first_chunk(default, common.english(tts))
                except RuntimeError as e:  # the timing request ended early: the server still serves
                    print(
                        f"warning: --first-chunk auto: {e}; streams start after {first_chunk} tokens",
                        file=sys.stderr,
                    )
                if first_chunk != FIRST_CHUNK:  # a stream's first decode at the length it will have
                    worker.warm_up(default, common.english(tts), first_chunk, whole=False)
        app = create_app(
            worker,
            voices,
            model_name=model_name,
            cfm_steps=args.cfm_steps,
            stream_context=STREAM_CONTEXT if args.stream_context is None else args.stream_context,
            first_chunk=first_chunk,
            api_keys=keys,
            allowed_origins=origins,
            ui=not args.no_ui,
        )
        log_level = "info" if args.verbose else "warning"
        # Where S3Gen runs: a vocoding process shows as a second process on the GPU (nvidia-smi, top).
        where = S3GEN_PLACES[worker.vocoding] if worker.vocode_thread else "on the model thread"
        print(
            f"serving {model_name} on http://{args.host}:{args.port} (voices: {folder}; streams' first chunk: "
            f"{first_chunk} speech tokens; S3Gen {where})",
            file=sys.stderr,
        )
        serve(
            app, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout, log_level=log_level
        )
