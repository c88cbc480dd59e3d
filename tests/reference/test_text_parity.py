"""`punc_norm` and `EnTokenizer` against upstream chatterbox-tts, on the toy tokenizer.json."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from mlx_chatterbox.text import EnTokenizer, punc_norm
from tests.toy_tokenizer import write_toy_tokenizer

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def upstream_punc_norm() -> Callable[[str], str]:
    from chatterbox.tts import punc_norm as upstream

    return upstream


@pytest.fixture(scope="module")
def toy_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def ours(toy_path: Path) -> EnTokenizer:
    return EnTokenizer.from_file(toy_path)


@pytest.fixture(scope="module")
def theirs(toy_path: Path):
    from chatterbox.models.tokenizers import EnTokenizer as UpstreamEnTokenizer

    return UpstreamEnTokenizer(str(toy_path))


TEXTS = [
    "",
    " ",
    "   ",
    "a",
    ".",
    "?",
    "-",
    ",",
    "hello world",
    "Hello, world!",
    "Is this the real life? Is this just fantasy?",
    "Wait... what?",
    "Wait...",
    "So\u2026 anyway",
    "Dots.... and more.....",
    "one: two; three",
    "time: 10:30 am",
    "a - b - c",
    " - ",
    "em\u2014dash and en\u2013dash",
    "\u2014",
    "range 1990\u20132000",
    "x ,y , z",
    "\u201cQuoted,\u201d she said, \u2018and single\u2019.",
    "\"Straight quotes\" and 'apostrophes' aren't changed",
    "It's a dog's life",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00dcber",
    "\u00dfe is sharp",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "Mixed \u4e2d\u6587 and English",
    "emoji \U0001f600 here \U0001f44d\U0001f3fd",
    "Numbers 3.14, 2,048 and 1990s; 50% off $20",
    "multiple   spaces   here",
    "  leading spaces",
    "trailing spaces   ",
    "\tTabbed start",
    "line one\nline two\r\nline three",
    "non\u00a0breaking\u3000ideographic spaces",
    "supercalifragilisticexpialidocious" * 3,
    "antidisestablishmentarianism",
    "ALL CAPS SHOUTING!!!",
    "lowercase start with no end",
    "Ends with dash -",
    "Ends with comma,",
    "(parentheses) and [brackets] and {braces}",
    "a literal [SPACE] and [START] in text",
    "email@example.com / path\\to\\file #tag",
    "Mr. Smith went to Washington D.C. on Jan. 5th.",
    "What?! No way!?",
    "Once upon a time there lived a king who had three daughters.",
]


def test_enough_texts() -> None:
    assert len(TEXTS) >= 40 and len(set(TEXTS)) == len(TEXTS)


@pytest.mark.parametrize("text", TEXTS)
def test_punc_norm_matches_upstream(upstream_punc_norm: Callable[[str], str], text: str) -> None:
    assert punc_norm(text) == upstream_punc_norm(text)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_upstream(ours: EnTokenizer, theirs, upstream_punc_norm, text: str) -> None:
    normalised = upstream_punc_norm(text)
    want = theirs.text_to_tokens(normalised).squeeze(0).tolist()
    assert ours.encode(punc_norm(text)) == want
    # And without punc_norm, raw whitespace and all.
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(want) == theirs.decode(want)
