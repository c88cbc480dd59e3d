"""``mlx-chatterbox bench``: time text -> speech on this machine."""

from __future__ import annotations

import argparse
import sys
import time

from ..api import TTS
from . import common

BENCH_TEXT = (
    "The quick brown fox jumps over the lazy dog, and then it runs back home again before the sun goes down."
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="time text -> speech on this machine",
        description="Time speech-token generation (T3) and vocoding (S3Gen) of a fixed sentence with the model's "
        "built-in voice (or --voice): a warm-up, then --repeats runs; prints T3's decode steps per second and "
        "the real-time factor. (benchmarks/ in the repository compares with upstream.)",
    )
    common.model_arguments(p)
    p.add_argument(
        "--repeats", type=common.at_least_1, default=3, help="timed runs after the warm-up (default: 3)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=common.at_least_1,
        default=250,
        help="speech tokens per run, at most (default: 250 = 10 s)",
    )
    common.cfm_dtype_argument(p)


def run(args: argparse.Namespace) -> None:
    given_voice = common.read_voice(args.voice)
    tts = TTS.load(args.model, variant=args.variant, cfm_dtype=args.cfm_dtype)
    voice = common.voice(tts, given_voice)
    rows = []
    for repeat in range(args.repeats + 1):  # repeat 0 warms up
        steps = []  # T3 decode steps, the stop token and dropped ids included: what the time was spent on
        start = time.perf_counter()
        tokens = tts.speech_tokens(
            BENCH_TEXT,
            voice,
            language=common.english(tts),
            seed=repeat,
            progress=lambda p: steps.append(p.done),
            max_new_tokens=args.max_new_tokens,
        )
        middle = time.perf_counter()
        wav = tts.vocode(tokens, voice, seed=repeat)
        end = time.perf_counter()
        if repeat:
            rows.append((steps[-1], len(tokens), middle - start, end - middle, len(wav) / tts.sample_rate))
    print(
        f"{'run':>3} {'steps':>6} {'tokens':>6} {'T3 s':>7} {'steps/s':>7} {'S3Gen s':>8} {'audio s':>8} {'RTF':>6}"
    )
    for i, (n, kept, t3, s3, audio) in enumerate(rows, 1):
        print(
            f"{i:>3} {n:>6} {kept:>6} {t3:>7.2f} {n / t3:>7.1f} {s3:>8.2f} {audio:>8.2f} {(t3 + s3) / audio:>6.3f}"
        )
    print(common.backend_lines(), file=sys.stderr)
