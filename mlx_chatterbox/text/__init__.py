"""Text front ends: punctuation clean-up and tokenisation (English; Turbo and Nano; Multilingual)."""

from .multilingual import (
    CANGJIE_FILE,
    LANGUAGES,
    MTL_TOKENIZER_FILE,
    LanguageSupportError,
    MtlTokenizer,
    check_language,
    mtl_punc_norm,
    read_cangjie,
)
from .normalize import (
    EMPTY_TEXT,
    MTL_SENTENCE_ENDERS,
    PUNCTUATION_REPLACEMENTS,
    SENTENCE_ENDERS,
    TURBO_PUNCTUATION_REPLACEMENTS,
    punc_norm,
    turbo_punc_norm,
)
from .split import split_text
from .tokenize import TURBO_EVENT_TAGS, TURBO_STYLE_TAGS, EnTokenizer, GPT2Tokenizer, TokenizerError

__all__ = [
    "CANGJIE_FILE",
    "EMPTY_TEXT",
    "LANGUAGES",
    "MTL_SENTENCE_ENDERS",
    "MTL_TOKENIZER_FILE",
    "PUNCTUATION_REPLACEMENTS",
    "SENTENCE_ENDERS",
    "TURBO_EVENT_TAGS",
    "TURBO_PUNCTUATION_REPLACEMENTS",
    "TURBO_STYLE_TAGS",
    "EnTokenizer",
    "GPT2Tokenizer",
    "LanguageSupportError",
    "MtlTokenizer",
    "TokenizerError",
    "check_language",
    "mtl_punc_norm",
    "punc_norm",
    "read_cangjie",
    "split_text",
    "turbo_punc_norm",
]
