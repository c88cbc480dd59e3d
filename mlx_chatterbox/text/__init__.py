"""English text front end: punctuation clean-up and tokenisation."""

from .normalize import EMPTY_TEXT, PUNCTUATION_REPLACEMENTS, SENTENCE_ENDERS, punc_norm
from .tokenize import MAX_TEXT_TOKENS, EnTokenizer, TextTooLongError, TokenizerError

__all__ = [
    "EMPTY_TEXT",
    "MAX_TEXT_TOKENS",
    "PUNCTUATION_REPLACEMENTS",
    "SENTENCE_ENDERS",
    "EnTokenizer",
    "TextTooLongError",
    "TokenizerError",
    "punc_norm",
]
