"""Splitting a text that is too long for one T3 call into pieces that each fit, at the most natural boundary."""

from __future__ import annotations

import re
from collections.abc import Callable

# Han ideographs (with extension A and the compatibility block), kana and Hangul syllables: scripts that write
# no spaces between words (Korean does, but between phrases that can be long).
_CJK = r"\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7a3"

# Boundaries from strongest to weakest: sentence ends, clause marks, spaces, and last between two CJK
# characters. The separator is kept with the left piece. Latin marks need a space after them ("3.14" and "e.g."
# stay whole); the CJK and full-width ones (。！？．｡ and ，、；：) end a sentence or clause as they are, since CJK
# text puts no space after them.
_BOUNDARIES = (
    r"(?<=[.!?\u2026])\s+|(?<=[\u3002\uff01\uff1f\uff0e\uff61])\s*",
    r"(?<=[,;:\u2014])\s+|(?<=[\uff0c\u3001\uff1b\uff1a])\s*",
    r"\s+",
    rf"(?<=[{_CJK}])(?=[{_CJK}])",
)


def split_text(text: str, fits: Callable[[str], bool]) -> list[str]:
    """Pieces of ``text`` such that ``fits(piece)`` holds for each, in order, together covering every word.
    Whole sentences are packed greedily; a sentence that does not fit alone is cut at clause marks, then
    between words, then (CJK only) between characters. A single word that does not fit is an error.
    Pieces rejoin where the text had whitespace with one space, and where it had none (after a CJK mark) with
    nothing."""
    return _pack(text.strip(), fits, 0)


def _parts(text: str, boundary: str) -> list[tuple[str, str]]:
    """(joiner, part) pairs: ``text`` cut at ``boundary``, each part with what goes in front of it when it is
    appended to the part before (one space where the boundary was whitespace, nothing where it was empty)."""
    parts, start, joiner = [], 0, ""
    for match in re.finditer(boundary, text):
        parts.append((joiner, text[start : match.start()]))
        joiner, start = (" " if match.group() else ""), match.end()
    parts.append((joiner, text[start:]))
    return [(j, p) for j, p in parts if p]


def _pack(text: str, fits: Callable[[str], bool], level: int) -> list[str]:
    if fits(text):
        return [text]
    if level == len(_BOUNDARIES):
        raise ValueError(f"cannot split the text: {text[:40]!r} does not fit even on its own")
    pieces, current = [], ""
    for joiner, part in _parts(text, _BOUNDARIES[level]):
        joined = f"{current}{joiner}{part}" if current else part
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
