"""The ``mlx-chatterbox`` command: ``convert``, ``say`` (text or speech tokens -> audio file), ``voice`` (a recording
-> a voice file), ``vc`` (a recording -> the same speech in another voice), ``batch`` (a jobs file -> a folder of
audio files), ``bench``, ``tokens`` and ``serve``: one module per command, each with its parser (``add_parser``)
and its work (``run``); ``common`` holds what they share and the checks made before a model loads."""

from __future__ import annotations

import argparse
import logging
import sys

from .. import __version__
from . import batch, bench, convert, say, serve, tokens, vc, voice
from .common import PROG, Parser, UsageError, flags
from .progress import log_format

COMMANDS = {  # in the order --help lists them
    "convert": convert,
    "say": say,
    "voice": voice,
    "vc": vc,
    "bench": bench,
    "tokens": tokens,
    "serve": serve,
    "batch": batch,
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Chatterbox text-to-speech on Apple's MLX.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format=log_format(sys.stderr)
    )
    try:
        code = COMMANDS[args.command].run(args)  # batch's exit code says whether any item failed
    except UsageError as e:
        parser.exit(2, f"{PROG} {args.command}: error: {e} (see {PROG} {args.command} --help)\n")
    except (ValueError, OSError, ImportError) as e:  # our errors say what is wrong and how to fix it
        print(f"{PROG}: error: {flags(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return code or 0
