"""Long text: sentence-packed pieces of at most ~20 s of speech, and the most speech tokens a piece may take.

T3 keeps its quality over ~20-30 s of speech (upstream recommends at most 30 s per call; its examples keep to 300
characters), and upstream's generate cuts every call at 1000 tokens (40 s) whatever the text. So a text is spoken
in pieces of at most ``PIECE_LENGTH`` spoken characters, and each piece gets a token budget from its own length:
enough for its text read at half the usual pace, so that the budget cuts a piece only when T3 fails to stop.

Pause tags (``text.pauses``) cut the text first: the words between two tags never share a piece, and the
silence goes between their audio exactly, with no crossfade across it (``Plan``, ``join_audio``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from ..text import split_text
from ..text.pauses import split_pauses
from .vocode import crossfade_join

TOKENS_PER_SECOND = 25
# ~20 s at the ~15 characters a second of read English; upstream's examples keep to 300 characters.
PIECE_LENGTH = 300
# The budget: the text at 8 characters a second (half the usual pace) plus 2 s for pauses at the ends.
SLOWEST_CHARS_PER_SECOND = 8
SLACK_SECONDS = 2.0
DIGIT_WEIGHT = 4  # a digit is spoken as a word of ~4 characters ("1500" -> "fifteen hundred")


def spoken_length(text: str) -> int:
    """Characters of ``text``, each digit counted as ``DIGIT_WEIGHT``: a measure of how long it takes to say."""
    return len(text) + (DIGIT_WEIGHT - 1) * sum(c.isdigit() for c in text)


def token_budget(piece: str) -> int:
    """The most speech tokens ``piece`` can need: at most 988 for a piece of ``PIECE_LENGTH``."""
    seconds = SLACK_SECONDS + spoken_length(piece) / SLOWEST_CHARS_PER_SECOND
    return math.ceil(TOKENS_PER_SECOND * seconds)


def split_pieces(text: str, fits: Callable[[str], bool]) -> list[str]:
    """``text`` in pieces of at most ``PIECE_LENGTH`` spoken characters that each satisfy ``fits`` (one T3 pass
    takes them): whole sentences packed greedily, then clauses, then words (``split_text``)."""
    return split_text(text, lambda piece: spoken_length(piece) <= PIECE_LENGTH and fits(piece))


@dataclasses.dataclass(frozen=True)
class Plan:
    """A text as the pieces T3 speaks and the silences around them.

    pauses: ``len(pieces) + 1`` entries; ``pauses[i]`` is the silence (samples) right before piece i and
        ``pauses[-1]`` the silence after the last, or None where no pause tag separates piece i - 1 from piece
        i: those two are crossfaded (only between two pieces; the first and last entries are ints).
    """

    pieces: list[str]
    pauses: list[int | None]

    def crossfades(self, i: int) -> bool:
        """Whether piece ``i + 1`` follows piece ``i`` with a crossfade (no pause between them)."""
        return self.pauses[i + 1] is None


def plan_text(text: str, fits: Callable[[str], bool], sample_rate: int) -> Plan:
    """``text`` cut at its pause tags, each part split into pieces (``split_pieces``); a malformed or too long
    tag is a ValueError naming it. A text of pause tags alone is no pieces and its silence; a text with
    neither words nor silence is refused."""
    parts = split_pauses(text, sample_rate)
    if parts in ([], [0]):
        raise ValueError("the text is empty; give some words to speak (or a pause tag)")
    pieces: list[str] = []
    pauses: list[int | None] = [0]
    for part in parts:
        if isinstance(part, int):
            pauses[-1] = (pauses[-1] or 0) + part
            continue
        for piece in split_pieces(part, fits):
            pieces.append(piece)
            pauses.append(None)
    if pauses[-1] is None:
        pauses[-1] = 0
    return Plan(pieces, pauses)


def join_audio(wavs: list[np.ndarray], plan: Plan, overlap: int) -> np.ndarray:
    """The audio of ``plan``'s pieces (one waveform each) as one: pieces without a pause between them
    crossfaded over ``overlap`` samples (``crossfade_join``), the silences put in as exact zeros."""
    if len(wavs) != len(plan.pieces):
        raise ValueError(f"{len(wavs)} waveforms for {len(plan.pieces)} pieces")
    out: list[np.ndarray] = []
    run: list[np.ndarray] = []  # pieces crossfaded together
    for wav, pause in zip(wavs, plan.pauses):
        if pause is not None:
            if run:
                out.append(crossfade_join(run, overlap))
            out.append(np.zeros(pause, np.float32))
            run = []
        run.append(wav)
    if run:
        out.append(crossfade_join(run, overlap))
    out.append(np.zeros(plan.pauses[-1], np.float32))
    return np.concatenate(out)
