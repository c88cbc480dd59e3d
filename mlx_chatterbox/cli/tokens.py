"""``mlx-chatterbox tokens``: a text -> T3's speech tokens."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..bulk import write_atomic
from . import common
from .progress import stages


def add_parser(sub) -> None:
    p = sub.add_parser(
        "tokens",
        help="generate speech tokens for a text",
        description="Generate Chatterbox speech tokens (25 per second of audio) for TEXT with T3, and print "
        "them space-separated (or write them to a file).",
    )
    p.add_argument("text", help="text to speak; '-' reads standard input")
    common.model_arguments(p)
    common.language_argument(p)
    p.add_argument("-o", "--output", type=Path, help="write the tokens to this file instead of stdout")
    common.knob_arguments(p)


def run(args: argparse.Namespace) -> None:
    if args.output is not None:
        common.check_output(args.output)
    given_voice = common.read_voice(args.voice)
    text, knobs, language = common.text(args), common.knobs(args), common.language(args)
    with stages(vocode_share=0.0) as line:  # speech tokens only
        start = time.perf_counter()
        tts = common.load(line, args)
        loaded = time.perf_counter()
        voice = common.voice(tts, given_voice, line)
        tokens = tts.speech_tokens(text, voice, language=language, seed=args.seed, progress=line, **knobs)
    done = time.perf_counter()
    out = " ".join(map(str, tokens.tolist())) + "\n"
    if args.output is None:
        sys.stdout.write(out)
    else:
        write_atomic(args.output, lambda tmp: tmp.write_text(out))
    if args.verbose:
        print(
            f"load {loaded - start:.2f} s, generation {done - loaded:.2f} s, {len(tokens)} tokens "
            f"({len(tokens) / 25:.1f} s of audio)\n" + common.backend_lines(),
            file=sys.stderr,
        )
