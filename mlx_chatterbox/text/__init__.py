"""Text front ends: punctuation clean-up and tokenisation (English; Turbo and Nano)."""

from .normalize import (
    EMPTY_TEXT,
    PUNCTUATION_REPLACEMENTS,
    SENTENCE_ENDERS,
    TURBO_PUNCTUATION_REPLACEMENTS,
    punc_norm,
    turbo_punc_norm,
)
from .split import split_text
from .tokenize import TURBO_EVENT_TAGS, TURBO_STYLE_TAGS, EnTokenizer, GPT2Tokenizer, TokenizerError

__all__ = [
    "EMPTY_TEXT",
    "PUNCTUATION_REPLACEMENTS",
    "SENTENCE_ENDERS",
    "TURBO_EVENT_TAGS",
    "TURBO_PUNCTUATION_REPLACEMENTS",
    "TURBO_STYLE_TAGS",
    "EnTokenizer",
    "TokenizerError",
    "GPT2Tokenizer",
    "punc_norm",
    "split_text",
    "turbo_punc_norm",
]
