"""Pause tags: ``[pause:500ms]``, ``[pause:1.5s]`` and SSML's ``<break time="500ms"/>`` in a text mark silences
of that length between the words around them.

A tag's length is exact: ``seconds * sample_rate`` rounded to the nearest whole sample, halves up (at 24 kHz,
1 ms is 24 samples and 0.1 ms rounds to 2). A tag is at most ``MAX_PAUSE_S`` long; tags with only whitespace
between them add up. Anything that starts like a tag (``[pause``, ``<break``) but is not one is an error naming
it, so that a typo is never spoken aloud. Turbo's paralinguistic tags (``[laugh]``, ...) are not pause tags and
stay in the text.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_PAUSE_S = 10
_LENGTH = r"(\d+(?:\.\d+)?|\.\d+)\s*(ms|s)"
_TAG = re.compile(
    rf"\[\s*pause\s*:\s*{_LENGTH}\s*\]|<\s*break\s+time\s*=\s*(?P<q>[\"']){_LENGTH}(?P=q)\s*/?\s*>",
    re.IGNORECASE,
)
# What looks like the start of a tag: a tag, or a malformed one up to its closing bracket (or the text's end).
_CANDIDATE = re.compile(r"\[\s*pause\b[^\[\]]*\]?|<\s*break\b[^<>]*>?", re.IGNORECASE)
_FIX = 'write [pause:500ms], [pause:1.5s] or <break time="500ms"/>'


def split_pauses(text: str, sample_rate: int) -> list[str | int]:
    """``text`` as its spoken parts (str, stripped, never blank) and the silences between them (int samples,
    consecutive tags summed), in order. A text without tags is ``[text.strip()]`` (``[]`` if blank)."""
    parts: list[str | int] = []
    start = 0
    for match in _CANDIDATE.finditer(text):
        parts.append(text[start : match.start()].strip())
        parts.append(pause_samples(match.group(), sample_rate))
        start = match.end()
    parts.append(text[start:].strip())
    out: list[str | int] = []
    for part in parts:
        if isinstance(part, int) and out and isinstance(out[-1], int):
            out[-1] += part
        elif part != "":
            out.append(part)
    return out


def pause_samples(tag: str, sample_rate: int) -> int:
    """The samples of silence one pause ``tag`` stands for; ValueError naming a malformed or too long tag."""
    match = _TAG.fullmatch(tag.strip())
    if match is None:
        shown = tag if len(tag) <= 40 else tag[:37] + "..."
        raise ValueError(f"malformed pause tag {shown!r}: {_FIX}")
    number, unit = match.group(1, 2) if match.group(1) else match.group(4, 5)
    seconds = Fraction(number) / (1000 if unit.lower() == "ms" else 1)
    if seconds > MAX_PAUSE_S:
        raise ValueError(
            f"pause tag {tag!r} is {float(seconds):g} s long; a pause is at most {MAX_PAUSE_S} s "
            "(put several tags in a row for a longer silence)"
        )
    return int(seconds * sample_rate + Fraction(1, 2))  # nearest sample, halves up (exact: no float)
