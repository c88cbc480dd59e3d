"""Progress on stderr: on a terminal one line redrawn in place (a bar over the whole work, where it is, the time
spent and an estimate of the time left, tqdm-style); elsewhere (a pipe, a log file) a line per stage."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from ..api import TOKENS_PER_SECOND, Progress

WIDTH = 24  # characters of the bar


class Stages:
    """A command's progress: ``stage`` names each stage as it begins (with the fraction of the whole work done,
    when known); ``update`` moves within it (a terminal only). ``__call__`` takes ``TTS.generate``'s,
    ``speech_tokens``' and ``convert_voice``'s ``Progress``: pieces of a text (or a source), each its speech
    tokens (of at most its budget) then its vocoding, which takes ``vocode_share`` of a piece's time in the
    estimate (voice conversion: all of it)."""

    def __init__(self, stream, vocode_share: float = 0.5):
        self.stream = stream
        self.tty = stream.isatty()
        self.vocode_share = vocode_share
        self.began = time.perf_counter()
        self.working: float | None = None  # when the first piece began: the estimate leaves loading out
        self.drawn = False
        self.name: str | None = None

    def stage(self, name: str, fraction: float | None = None, note: str = "", where: str = "") -> None:
        """A stage begins: off a terminal, its line with ``note`` (e.g. its total); on one, ``update``."""
        self.name = name
        if self.tty:
            self.update(fraction, where)
        else:
            self.stream.write(f"{name}{f' ({note})' if note else ''} {self._times(fraction)}\n")
            self.stream.flush()

    def update(self, fraction: float | None, where: str = "") -> None:
        """Redraw the terminal's line: the bar (when ``fraction`` is known), the stage and ``where`` in it."""
        if not self.tty:
            return
        bar = "" if fraction is None else f"[{'#' * round(WIDTH * fraction):-<{WIDTH}}] "
        where = f" {where}" if where else ""
        # \r and "erase to the end of the line" redraw the line in place.
        self.stream.write(f"\r{bar}{self.name}{where} {self._times(fraction)}\x1b[K")
        self.stream.flush()
        self.drawn = True

    def __call__(self, p: Progress) -> None:
        if self.working is None:
            self.working = time.perf_counter()
        tokens = 1 - self.vocode_share
        if p.stage == "tokens":  # Turbo draws up to 1 + its budget
            within = tokens * min(1.0, p.done / p.total)
        else:
            within = tokens + self.vocode_share * p.done / p.total
        fraction = (p.piece - 1 + within) / p.pieces
        piece = f"piece {p.piece}/{p.pieces}: "
        if p.stage == "tokens":
            where = f"{p.done}/{p.total} ({p.done / TOKENS_PER_SECOND:.1f} s)"
            if p.done == 1:  # the piece's first token
                self.stage(piece + "speech tokens", fraction, f"at most {p.total}", where)
            else:
                self.update(fraction, where)
        elif p.done == 0:
            self.stage(piece + "vocoding", fraction)
        elif p.piece == p.pieces:
            self.stage("done", 1.0)
        else:
            self.update(fraction)

    def _times(self, fraction: float | None) -> str:
        """[elapsed<left], tqdm's form; left is ? until some work is done."""
        now = time.perf_counter()
        left = "?"
        if fraction and self.working is not None:
            left = clock((now - self.working) * (1 - fraction) / fraction)
        return f"[{clock(now - self.began)}<{left}]"

    def close(self) -> None:
        if self.drawn:  # end the line; nothing to end if an error came first
            self.stream.write("\n")
            self.drawn = False


@contextlib.contextmanager
def stages(vocode_share: float = 0.5):
    """A ``Stages`` on stderr, its terminal line ended when the command ends (or fails)."""
    line = Stages(sys.stderr, vocode_share)
    try:
        yield line
    finally:
        line.close()


class ItemsLine:
    """A progress bar over a jobs file's items on one line of a terminal, with an estimate of the time left (off
    a terminal, a line per item finished); failed items are reported on lines of their own."""

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
        finished = p.done + p.failed + p.skipped
        left = "?" if p.eta is None else clock(p.eta)
        failed = f", {p.failed} failed" if p.failed else ""
        counts = f"{finished}/{p.total} items{failed} [{clock(p.elapsed)}<{left}]"
        if self.tty:
            filled = round(WIDTH * finished / p.total)
            self.stream.write(f"\r[{'#' * filled:-<{WIDTH}}] {counts}\x1b[K")
            self.drawn = True
        else:
            self.stream.write(f"{counts}\n")
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
