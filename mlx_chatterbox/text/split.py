"""Splitting a text that is too long for one T3 call into pieces that each fit, at the most natural boundary."""

from __future__ import annotations

import re
from collections.abc import Callable

# Boundaries from strongest to weakest: sentence ends, clause marks, spaces (the separator is kept with the left piece).
_BOUNDARIES = (r"(?<=[.!?…。！？])\s+", r"(?<=[,;:—])\s+", r"\s+")


def split_text(text: str, fits: Callable[[str], bool]) -> list[str]:
    """Pieces of ``text`` such that ``fits(piece)`` holds for each, in order, together covering every word.
    Whole sentences are packed greedily; a sentence that does not fit alone is cut at clause marks, then
    between words. A single word that does not fit is an error."""
    return _pack(text.strip(), fits, 0)


def _pack(text: str, fits: Callable[[str], bool], level: int) -> list[str]:
    if fits(text):
        return [text]
    if level == len(_BOUNDARIES):
        raise ValueError(f"cannot split the text: {text[:40]!r} does not fit even on its own")
    pieces, current = [], ""
    for part in (p for p in re.split(_BOUNDARIES[level], text) if p):
        joined = f"{current} {part}" if current else part
        if fits(joined):
            current = joined
            continue
        if current:
            pieces.append(current)
        if fits(part):
            current = part
        else:
            pieces += _pack(part, fits, level + 1)
            current = ""
    if current:
        pieces.append(current)
    return pieces
