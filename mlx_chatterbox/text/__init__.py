"""English text front end: punctuation clean-up and tokenisation."""

from .normalize import EMPTY_TEXT, PUNCTUATION_REPLACEMENTS, SENTENCE_ENDERS, punc_norm
from .split import split_text
from .tokenize import EnTokenizer, TokenizerError

__all__ = [
    "EMPTY_TEXT",
    "PUNCTUATION_REPLACEMENTS",
    "SENTENCE_ENDERS",
    "EnTokenizer",
    "TokenizerError",
    "punc_norm",
    "split_text",
]
