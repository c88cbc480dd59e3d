"""Punctuation clean-up applied to text before tokenisation.

`punc_norm` reproduces upstream ``chatterbox.tts.punc_norm`` and `turbo_punc_norm` upstream
``chatterbox.tts_turbo.punc_norm``, character for character, quirks included: each model was trained on text
that went through its own, so "fixing" them would change what the model hears. The multilingual one
(``chatterbox.mtl_tts.punc_norm``) is `punc_norm` with `MTL_SENTENCE_ENDERS`.
"""

from __future__ import annotations

# What upstream speaks instead of an empty string.
EMPTY_TEXT = "You need to add some text for me to talk."

# Applied in this order with ``str.replace``; the order is part of the function ("..." must go before any
# rule that could see a lone "."). Non-ASCII characters are written as escapes on purpose: an editor or a
# copy-paste that "normalises" the literal characters would silently drop these rules.
PUNCTUATION_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    ("...", ", "),
    ("\u2026", ", "),  # horizontal ellipsis
    (":", ","),
    (" - ", ", "),
    (";", ", "),
    ("\u2014", "-"),  # em dash
    ("\u2013", "-"),  # en dash
    (" ,", ","),
    ("\u201c", '"'),  # left double quotation mark
    ("\u201d", '"'),  # right double quotation mark
    ("\u2018", "'"),  # left single quotation mark
    ("\u2019", "'"),  # right single quotation mark
)

# Turbo's table (tts_turbo.py): English's without "...", " - " and ";" (Turbo keeps those as written).
TURBO_PUNCTUATION_REPLACEMENTS: tuple[tuple[str, str], ...] = tuple(
    r for r in PUNCTUATION_REPLACEMENTS if r[0] not in ("...", " - ", ";")
)

# A text that ends in none of these gets a full stop (English and Turbo alike).
SENTENCE_ENDERS: tuple[str, ...] = (".", "!", "?", "-", ",")
# Multilingual (mtl_tts.py): English's plus the CJK enumeration comma, full-width comma, full stop, ? and !.
MTL_SENTENCE_ENDERS: tuple[str, ...] = (
    *SENTENCE_ENDERS,
    "\u3001",  # ideographic comma
    "\uff0c",  # full-width comma
    "\u3002",  # ideographic full stop
    "\uff1f",  # full-width question mark
    "\uff01",  # full-width exclamation mark
)


def punc_norm(text: str, enders: tuple[str, ...] = SENTENCE_ENDERS) -> str:
    """Clean up punctuation the way upstream Chatterbox does before tokenising. ``enders``: the endings that
    need no added full stop (`MTL_SENTENCE_ENDERS` gives the multilingual model's function)."""
    return _clean(text, PUNCTUATION_REPLACEMENTS, enders)


def turbo_punc_norm(text: str) -> str:
    """Clean up punctuation the way upstream Chatterbox-Turbo (and -Nano) does before tokenising: the same
    steps as `punc_norm` with Turbo's shorter replacement table. The bracket tags ("[laugh]") pass through."""
    return _clean(text, TURBO_PUNCTUATION_REPLACEMENTS, SENTENCE_ENDERS)


def _clean(text: str, replacements: tuple[tuple[str, str], ...], enders: tuple[str, ...]) -> str:
    if len(text) == 0:
        return EMPTY_TEXT

    # Only the very first character, and before whitespace is collapsed: " hello" stays lower case.
    # ``str.upper`` may return more than one character ("\u00df" -> "SS"), as upstream's does.
    if text[0].islower():
        text = text[0].upper() + text[1:]

    # Collapse every whitespace run (tabs, newlines, ...) to one space and trim the ends. This runs before
    # the replacements, so two spaces can come back: "a; b" becomes "a,  b", as upstream.
    text = " ".join(text.split())

    for old, new in replacements:
        text = text.replace(old, new)

    text = text.rstrip(" ")
    if not text.endswith(enders):
        text += "."
    return text
