"""Progress on stderr: a bar redrawn in place on a terminal."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from ..api import TOKENS_PER_SECOND, Progress


class ProgressLine:
    """A progress bar over the pieces of a text on one line of a terminal, with where the current piece is."""

    WIDTH = 24

    def __init__(self, stream):
        self.stream = stream
        self.drawn = False

    def __call__(self, p: Progress) -> None:
        finished = p.piece - 1 + (p.stage == "vocode" and p.done == p.total)
        filled = round(self.WIDTH * finished / p.pieces)
        if p.stage == "tokens":
            where = f"speech tokens {p.done} ({p.done / TOKENS_PER_SECOND:.1f} s)"
        else:
            where = "vocoding" if p.done < p.total else "done"
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        # \r and "erase to the end of the line" redraw the line in place.
        self.stream.write(f"\r[{bar}] piece {p.piece}/{p.pieces}: {where}\x1b[K")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:  # end the line; nothing to end if an error came first
            self.stream.write("\n")


@contextlib.contextmanager
def progress():
    """A ``ProgressLine`` on stderr when it is a terminal (None otherwise), ended with a newline."""
    line = ProgressLine(sys.stderr) if sys.stderr.isatty() else None
    try:
        yield line
    finally:
        if line is not None:
            line.close()


class ItemsLine:
    """A progress bar over a jobs file's items on one line of stderr (a terminal only), with an estimate of the
    time left; failed items are reported on lines of their own (on any stderr)."""

    WIDTH = 24

    def __init__(self, jobs: Path, stream):
        self.jobs, self.stream = jobs, stream
        self.tty = stream.isatty()
        self.drawn = False

    def __call__(self, result, p) -> None:
        erase = "\r\x1b[K" if self.drawn else ""
        if result.status == "failed":
            name = f" ({result.output})" if result.output else ""
            self.stream.write(f"{erase}{self.jobs}:{result.line}{name}: {result.error}\n")
            self.drawn = False
        if self.tty:
            finished = p.done + p.failed + p.skipped
            filled = round(self.WIDTH * finished / p.total)
            left = "" if p.eta is None else f", {clock(p.eta)} left"
            failed = f", {p.failed} failed" if p.failed else ""
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            self.stream.write(f"\r[{bar}] {finished}/{p.total} items{failed}{left}\x1b[K")
            self.drawn = True
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.drawn = False


def clock(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}:{m:02d}:{s:02d}" if hours else f"{m}:{s:02d}"


def log_format(stream) -> str:
    """On a terminal a log line first erases the progress line it interrupts (which is redrawn below it)."""
    return ("\r\x1b[K" if stream.isatty() else "") + "%(name)s: %(message)s"
