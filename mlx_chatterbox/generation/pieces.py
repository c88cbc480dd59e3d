"""Long text: sentence-packed pieces of at most ~20 s of speech, and the most speech tokens a piece may take.

T3 keeps its quality over ~20-30 s of speech (upstream recommends at most 30 s per call; its examples keep to 300
characters), and upstream's generate cuts every call at 1000 tokens (40 s) whatever the text. So a text is spoken
in pieces of at most ``PIECE_LENGTH`` spoken characters, and each piece gets a token budget from its own length:
enough for its text read at half the usual pace, so that the budget cuts a piece only when T3 fails to stop.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..text import split_text

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
