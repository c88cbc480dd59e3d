"""``mlx-chatterbox voice``: a recording -> a voice file."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..api import VOICE_SUFFIX, read_reference
from ..convert import DEFAULT_REPO
from . import common
from .progress import stages


def add_parser(sub) -> None:
    p = sub.add_parser(
        "voice",
        help="clone a voice from a recording into a voice file",
        description="Clone the voice in REFERENCE (an audio file of one speaker; 5-10 s of clean speech works "
        "best) into a voice file, to pass as --voice later.",
    )
    p.add_argument("reference", type=Path, help="audio file (wav, flac, ogg, mp3, ...)")
    p.add_argument("-o", "--output", required=True, type=Path, help="voice file to write (.safetensors)")
    p.add_argument(
        "--model",
        default=DEFAULT_REPO,
        help=f"a converted folder, an upstream checkpoint folder or a Hub repo id (default: {DEFAULT_REPO})",
    )
    common.variant_argument(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens and print timings")


def run(args: argparse.Namespace) -> None:
    common.check_output(args.output, (VOICE_SUFFIX,))
    reference = read_reference(args.reference)  # a bad recording is refused before the model loads
    with stages() as line:
        start = time.perf_counter()
        tts = common.load(line, args)
        loaded = time.perf_counter()
        line.stage("cloning the voice")
        voice = tts.voice(*reference)
    done = time.perf_counter()
    voice.save(args.output)  # atomic too
    if args.verbose:
        print(
            f"load {loaded - start:.2f} s, cloning {done - loaded:.2f} s\n" + common.backend_lines(),
            file=sys.stderr,
        )
