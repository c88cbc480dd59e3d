"""Turbo's text front end against upstream: `turbo_punc_norm` vs ``chatterbox.tts_turbo.punc_norm``, and
`GPT2Tokenizer` vs ``transformers.AutoTokenizer`` (5.2, as ``ChatterboxTurboTTS.from_local`` loads it) on the
toy GPT-2 files, in each layout transformers reads differently."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlx_chatterbox.text import GPT2Tokenizer, turbo_punc_norm
from tests.toy_gpt2_tokenizer import MODEL_MAX_LENGTH, TAGS, write_toy_gpt2_tokenizer

pytestmark = [
    pytest.mark.reference,
    # transformers' GPT2Tokenizer hands file paths to tokenizers' BPE (its own deprecation, not ours).
    pytest.mark.filterwarnings("ignore:Deprecated in 0.9.0:DeprecationWarning"),
]

TEXTS = [
    "",
    " ",
    "   ",
    "a",
    ".",
    "hello world",
    "Hello, world!",
    "Wait... what?",
    "So\u2026 anyway",
    "one: two; three",
    "a - b - c",
    "em\u2014dash and en\u2013dash",
    "x , y ,z",
    "\u201cDouble\u201d and \u2018single\u2019 quotes",
    "\"Straight\" quotes and it's, don't, we're, they've, I'm, she'll, he'd",
    "  leading and trailing spaces   ",
    "multiple    inner     spaces",
    "tabs\tand\nnew\n\nlines\r\nhere",
    "\u00a0non-breaking\u00a0space\u2003em space",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00dfe \u00c5ngstr\u00f6m",
    "e\u0301 combining accent",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \ud55c\uad6d\uc5b4 "
    "\u0420\u0443\u0441\u0441\u043a\u0438\u0439 \u0627\u0644\u0639\u0631\u0628\u064a\u0629",
    "emoji \U0001f600\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 "
    "flags \U0001f1eb\U0001f1f7",
    "digits 0 12 345 6789 3.14159 1,000,000 2024-05-01 10:30",
    "punctuation!!! ??? ... ;; -- (brackets) {braces} <angles> #hash @at $5 50% a&b a*b a/b a\\b ~ ` ^ |",
    "[laugh]",
    " [laugh]",
    "[laugh] ",
    "Hello [laugh] world",
    "That's so funny[laugh]!",
    "a[sigh]b",
    "[sigh][cough][laugh]",
    "[clear throat] Listen up. [sniff] ugh! [groan] [cough] Well, [sigh] fine. "
    "[laugh] [chuckle] [gasp] [shush]",
    "[whispering] quiet [angry] loud [happy] [sarcastic] [surprised] [fear] [crying] [dramatic] [narration]",
    "[advertisement] Buy now!",
    "[Laugh] [LAUGH] [ laugh ] [laugh [laugh]] [clear  throat] [clearthroat] laugh] [laughing]",
    "<|endoftext|>",
    "before <|endoftext|> after",
    "\u200b zero width \ufeff bom",
    "x" * 300,
]

VARIANTS: dict[str, dict[str, Any]] = {
    "decoder": {},
    "legacy": {"decoder": False},
    "special_tags": {"special_tags": True},
    "legacy_special_tags": {"decoder": False, "special_tags": True},
    "lstrip": {"tag_lstrip": True},
    "rstrip": {"tag_rstrip": True},
    "strip_special": {"tag_lstrip": True, "tag_rstrip": True, "special_tags": True},
    "bos": {"add_bos_token": True},
    "eos": {"extra_config": {"add_eos_token": True}},
    "prefix_space": {"extra_config": {"add_prefix_space": True}},
    "split_special": {"extra_config": {"split_special_tokens": True}},
    "fast_class": {"extra_config": {"tokenizer_class": "GPT2TokenizerFast"}},
    "pad_is_a_tag": {"decoder": False, "extra_config": {"pad_token": "[laugh]"}},
    "extra_special": {"extra_config": {"extra_special_tokens": ["[sigh]"]}},
    "no_limit": {"model_max_length": None},
}


def upstream_tokenizer(folder: Path):
    """What ``ChatterboxTurboTTS.from_local`` builds."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def upstream_ids(tokenizer, text: str) -> list[int]:
    """``ChatterboxTurboTTS.generate``'s call."""
    ids = tokenizer(text, return_tensors="pt", padding=True, truncation=True).input_ids
    assert ids.shape[0] == 1
    return ids[0].tolist()


def test_punc_norm_matches_upstream() -> None:
    from chatterbox.tts_turbo import punc_norm

    for text in TEXTS + [t.lower() for t in TEXTS]:
        assert turbo_punc_norm(text) == punc_norm(text), repr(text)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tokenizer_matches_transformers(variant: str, tmp_path: Path) -> None:
    folder = write_toy_gpt2_tokenizer(tmp_path, **VARIANTS[variant])
    theirs, ours = upstream_tokenizer(folder), GPT2Tokenizer.from_folder(folder)
    assert ours.vocab_size == len(theirs)
    # The whole backend: model, pre-tokenizer, post-processor, and each added token's id and flags.
    theirs_json, ours_json = json.loads(theirs.backend_tokenizer.to_str()), json.loads(ours._tok.to_str())
    differ = [k for k in theirs_json if theirs_json[k] != ours_json.get(k)]
    assert not differ, f"backend fields differ: {differ}"
    for text in TEXTS:
        for t in (text, turbo_punc_norm(text)):
            assert ours.encode(t) == upstream_ids(theirs, t), repr(t)
            assert ours.decode(ours.encode(t)) == theirs.decode(upstream_ids(theirs, t)), repr(t)


def test_pipeline_matches_generate(tmp_path: Path) -> None:
    """punc_norm then the tokenizer, as ``ChatterboxTurboTTS.generate`` runs them."""
    from chatterbox.tts_turbo import punc_norm

    folder = write_toy_gpt2_tokenizer(tmp_path)
    theirs, ours = upstream_tokenizer(folder), GPT2Tokenizer.from_folder(folder)
    laugh = ours.encode("[laugh]")[0]
    for text in TEXTS:
        assert ours.encode(turbo_punc_norm(text)) == upstream_ids(theirs, punc_norm(text)), repr(text)
    # " [laugh]" is "Ġ" (a lone space) then the tag, on both sides.
    assert upstream_ids(theirs, " [laugh]") == [theirs.convert_tokens_to_ids("\u0120"), laugh]
    assert {t: ours.encode(t) for t in TAGS} == {t: upstream_ids(theirs, t) for t in TAGS}


def test_over_long_text_upstream_cuts_ours_refuses(tmp_path: Path) -> None:
    folder = write_toy_gpt2_tokenizer(tmp_path)
    theirs, ours = upstream_tokenizer(folder), GPT2Tokenizer.from_folder(folder)
    assert theirs.model_max_length == ours.max_length == MODEL_MAX_LENGTH
    exact = " [laugh]" * (MODEL_MAX_LENGTH // 2)
    assert ours.encode(exact) == upstream_ids(theirs, exact)
    longer = exact + " [sigh] [cough]"
    assert len(upstream_ids(theirs, longer)) == MODEL_MAX_LENGTH  # silently cut
    with pytest.raises(ValueError, match="upstream would silently drop the tokens past it"):
        ours.encode(longer)
