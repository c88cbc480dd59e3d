"""The ``mlx-chatterbox`` command: ``convert`` and ``tokens`` (``say`` arrives with the vocoder)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from . import _backend
from .api import TTS
from .convert import DEFAULT_REPO, DTYPES, convert
from .sampling import SamplingParams

PROG = "mlx-chatterbox"
_DEFAULTS = SamplingParams()
KNOBS = {  # SamplingParams field -> help
    "temperature": "sampling temperature, >= 0; 0 = greedy",
    "top_p": "nucleus probability mass kept, in (0, 1]",
    "min_p": "drop tokens below min_p x the top probability, in [0, 1]",
    "repetition_penalty": "penalty on tokens already generated, > 0",
    "cfg_weight": "classifier-free guidance weight, >= 0",
    "exaggeration": "emotion exaggeration, >= 0",
    "max_new_tokens": "most speech tokens to generate, 25 per second of audio",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Chatterbox text-to-speech on Apple's MLX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "convert",
        help="convert an upstream checkpoint to an MLX model folder",
        description="Convert an upstream Chatterbox checkpoint (a local folder or a Hugging Face repo id) "
        "into an MLX model folder. Needs no torch.",
    )
    p.add_argument(
        "src", help=f"upstream checkpoint folder, or a Hugging Face repo id such as {DEFAULT_REPO}"
    )
    p.add_argument("dst", type=Path, help="MLX model folder to create")
    p.add_argument(
        "--dtype", choices=list(DTYPES), default="float32", help="weight precision (default: float32)"
    )
    p.add_argument("--revision", help="Hub branch, tag or commit (repo ids only)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens")

    p = sub.add_parser(
        "tokens",
        help="generate speech tokens for a text",
        description="Generate Chatterbox speech tokens (25 per second of audio) for TEXT with T3, and print "
        "them space-separated (or write them to a file).",
    )
    p.add_argument("text", help="text to speak; '-' reads standard input")
    p.add_argument(
        "--model", required=True, type=Path, help="MLX model folder (from 'mlx-chatterbox convert')"
    )
    p.add_argument("--voice", type=Path, help="saved voice file (.safetensors); default: the built-in voice")
    p.add_argument("-o", "--output", type=Path, help="write the tokens to this file instead of stdout")
    knobs = p.add_argument_group("sampling")
    for name, help_text in KNOBS.items():
        default = getattr(_DEFAULTS, name)
        knobs.add_argument(
            f"--{name.replace('_', '-')}",
            type=type(default),
            default=default,
            help=f"{help_text} (default: {default})",
        )
    knobs.add_argument("--seed", type=int, help="seed for reproducible output (default: random)")
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens and print timings")
    return parser


def _progress(label: str):
    """A one-line progress display on stderr when it is a terminal; nothing otherwise."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        sys.stderr.write(f"\r{label} {done}/{total}")
        sys.stderr.flush()

    return show


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _convert(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    dst = convert(args.src, args.dst, dtype=args.dtype, revision=args.revision, overwrite=args.overwrite)
    print(
        f"converted {args.src} -> {dst} ({args.dtype}) in {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )


def _tokens(args: argparse.Namespace) -> None:
    text = sys.stdin.read() if args.text == "-" else args.text
    params = SamplingParams(**{name: getattr(args, name) for name in KNOBS})
    start = time.perf_counter()
    tts = TTS.load(args.model)
    loaded = time.perf_counter()
    progress = _progress("tokens")
    tokens = tts.speech_tokens(text, args.voice, params, seed=args.seed, progress=progress)
    done = time.perf_counter()
    if progress is not None:
        sys.stderr.write("\n")
    line = " ".join(map(str, tokens.tolist())) + "\n"
    if args.output is None:
        sys.stdout.write(line)
    else:
        _write_atomic(args.output, line)
    if args.verbose:
        print(
            f"load {loaded - start:.2f} s, generation {done - loaded:.2f} s, {len(tokens)} tokens "
            f"({len(tokens) / 25:.1f} s of audio)\n"
            + "\n".join(f"{k}: {v}" for k, v in _backend.STATUS.items()),
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    try:
        {"convert": _convert, "tokens": _tokens}[args.command](args)
    except (ValueError, OSError) as e:  # our errors say what is wrong and how to fix it; no traceback
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 0
