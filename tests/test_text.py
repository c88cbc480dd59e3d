"""The English text front end: `punc_norm` and `EnTokenizer` (no torch, no upstream)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlx_chatterbox.text import (
    EMPTY_TEXT,
    PUNCTUATION_REPLACEMENTS,
    EnTokenizer,
    TokenizerError,
    punc_norm,
)
from tests.toy_tokenizer import write_toy_tokenizer

# (input, expected), each expected string worked out by hand from upstream's rules.
PUNC_NORM_CASES = [
    ("", EMPTY_TEXT),
    ("hello world", "Hello world."),
    ("Hello world.", "Hello world."),
    ("Really?", "Really?"),
    ("Wow!", "Wow!"),
    ("Wait...", "Wait,"),  # "..." -> ", ", then the trailing space is stripped
    ("Wait\u2026 what", "Wait,  what."),  # the replacement's space plus the original one
    ("a...b", "A, b."),
    ("Dots....", "Dots, ."),
    ("\u2026", ","),
    ("one: two", "One, two."),
    ("time: 10:30", "Time, 10,30."),
    ("a - b", "A, b."),
    ("a -- b", "A -- b."),
    ("a; b", "A,  b."),  # collapse ran before the replacement, so the double space stays
    ("a ; b", "A,  b."),  # ";" -> ", " first, then " ," -> ","
    ("x ,y", "X,y."),
    ("Hi , there", "Hi, there."),
    ("em\u2014dash", "Em-dash."),
    ("en\u2013dash", "En-dash."),
    ("ok\u2014", "Ok-"),
    ("ends with dash -", "Ends with dash -"),
    ("\u201cquoted\u201d", '"quoted".'),  # a quote is not a sentence ender
    ("\u2018single\u2019", "'single'."),
    ("  leading spaces", "leading spaces."),  # capitalisation looked at the space, not the "l"
    ("   ", "."),
    ("trailing   ", "Trailing."),
    ("tab\there\nnew  line", "Tab here new line."),
    ("\u00dfe", "SSe."),  # str.upper() of sharp s is two letters
    ("\u00e9t\u00e9", "\u00c9t\u00e9."),
    ("123 go", "123 go."),
    ("\u65e5\u672c", "\u65e5\u672c."),
]


@pytest.mark.parametrize(("text", "expected"), PUNC_NORM_CASES)
def test_punc_norm(text: str, expected: str) -> None:
    assert punc_norm(text) == expected


def test_replacement_table_keeps_its_unicode_rules() -> None:
    # Guards against an editor turning the escapes into look-alike or plain characters.
    olds = [old for old, _ in PUNCTUATION_REPLACEMENTS]
    assert [hex(ord(c)) for c in olds if len(c) == 1 and ord(c) > 127] == [
        "0x2026",
        "0x2014",
        "0x2013",
        "0x201c",
        "0x201d",
        "0x2018",
        "0x2019",
    ]
    assert olds[0] == "..."


@pytest.fixture(scope="module")
def toy_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def tok(toy_path: Path) -> EnTokenizer:
    return EnTokenizer.from_file(toy_path)


def _edited(toy_path: Path, tmp_path: Path, drop_vocab: tuple[str, ...], drop_added: tuple[str, ...]) -> Path:
    spec = json.loads(toy_path.read_text(encoding="utf-8"))
    for name in drop_vocab:
        del spec["model"]["vocab"][name]
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["content"] not in drop_added]
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(spec), encoding="utf-8")
    return out


# --- the toy file itself ---------------------------------------------------------------------------------


def test_toy_tokenizer_is_deterministic_and_shaped_like_the_real_one(toy_path: Path, tmp_path: Path) -> None:
    again = write_toy_tokenizer(tmp_path)
    assert again == tmp_path / "tokenizer.json"
    assert again.read_bytes() == toy_path.read_bytes()
    spec = json.loads(toy_path.read_text(encoding="utf-8"))
    assert spec["normalizer"] is None and spec["post_processor"] is None
    assert spec["pre_tokenizer"] == {"type": "Whitespace"}
    model = spec["model"]
    assert model["type"] == "BPE" and model["unk_token"] == "[UNK]" and model["fuse_unk"] is False
    vocab = model["vocab"]
    assert sorted(vocab.values()) == list(range(len(vocab))) and len(vocab) < 704
    assert {k: vocab[k] for k in ("[STOP]", "[UNK]", "[SPACE]", "[START]")} == {
        "[STOP]": 0,
        "[UNK]": 1,
        "[SPACE]": 2,
        "[START]": 255,
    }
    assert {"[PAD]", "[SEP]", "[CLS]", "[MASK]"} <= {a["content"] for a in spec["added_tokens"]}
    assert len(model["merges"]) > 50


# --- loading ---------------------------------------------------------------------------------------------


def test_loads_the_toy(tok: EnTokenizer) -> None:
    assert (tok.start_id, tok.stop_id) == (255, 0)
    assert 256 < tok.vocab_size < 704


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(TokenizerError, match="does not exist") as err:
        EnTokenizer.from_file(missing)
    assert str(missing) in str(err.value) and "ResembleAI/chatterbox" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="is a directory"):
        EnTokenizer.from_file(tmp_path)


@pytest.mark.parametrize("content", ["{not json", '{"hello": 1}', ""])
def test_not_a_tokenizer_json(tmp_path: Path, content: str) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text(content, encoding="utf-8")
    with pytest.raises(TokenizerError, match="is not a valid tokenizer.json") as err:
        EnTokenizer.from_file(bad)
    assert str(bad) in str(err.value) and "ResembleAI/chatterbox" in str(err.value)


@pytest.mark.parametrize("name", ["[START]", "[STOP]"])
def test_missing_start_or_stop(toy_path: Path, tmp_path: Path, name: str) -> None:
    edited = _edited(toy_path, tmp_path, drop_vocab=(name,), drop_added=(name,))
    with pytest.raises(TokenizerError, match=rf"no \{name[:-1]}\] token") as err:
        EnTokenizer.from_file(edited)
    assert str(edited) in str(err.value)


def test_space_must_be_a_special_token(toy_path: Path, tmp_path: Path) -> None:
    # Still in the vocabulary, but no longer matched whole: spaces would turn into "[", "SPACE", "]".
    edited = _edited(toy_path, tmp_path, drop_vocab=(), drop_added=("[SPACE]",))
    with pytest.raises(TokenizerError, match=r"no \[SPACE\] special token"):
        EnTokenizer.from_file(edited)


# --- compatibility with the model ------------------------------------------------------------------------


def test_compatible_with_the_english_t3(tok: EnTokenizer) -> None:
    tok.check_compatible(start_text_token=255, stop_text_token=0, text_vocab_size=704)


@pytest.mark.parametrize(
    ("start", "stop", "size", "needle"),
    [
        (0, 255, 704, "start-of-text token is 0"),
        (255, 1, 704, "end-of-text token is 1"),
        (255, 0, 300, "text vocabulary has only 300 entries"),
    ],
)
def test_incompatible_with_the_model(tok: EnTokenizer, start: int, stop: int, size: int, needle: str) -> None:
    with pytest.raises(TokenizerError, match=needle) as err:
        tok.check_compatible(start_text_token=start, stop_text_token=stop, text_vocab_size=size)
    assert "does not fit this model" in str(err.value) and isinstance(err.value, ValueError)


# --- encoding --------------------------------------------------------------------------------------------


def test_spaces_become_space_tokens(tok: EnTokenizer) -> None:
    a, b = tok.encode("a"), tok.encode("b")
    assert tok.encode("a b") == a + [2] + b
    assert tok.encode("a  b") == a + [2, 2] + b
    assert tok.encode(" a ") == [2] + a + [2]
    # Only " " is replaced; the pre-tokenizer drops other whitespace (punc_norm has collapsed it anyway).
    assert tok.encode("a\tb\nb") == a + b + b


def test_bpe_merges_and_case(tok: EnTokenizer) -> None:
    assert len(tok.encode("the")) == 1
    assert tok.encode("The") != tok.encode("the")
    assert len(tok.encode("qzx")) == 3


def test_unknown_characters_are_unk_one_each(tok: EnTokenizer) -> None:
    assert tok.encode("\u65e5\u672c") == [1, 1]
    assert tok.encode("a\U0001f600") == tok.encode("a") + [1]


def test_round_trip(tok: EnTokenizer) -> None:
    for text in ["Hello there, how are you?", "The quick brown fox. 123!", "  two  spaces  "]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("a\u65e5b")) == "ab"  # [UNK] is dropped, as upstream
    assert tok.decode([255, *tok.encode("Hi."), 0]) == "[START]Hi."  # upstream keeps [START], drops [STOP]


def test_split_text_prefers_sentence_ends_then_clauses_then_words():
    from mlx_chatterbox.text import split_text

    fits = lambda s: len(s) <= 30  # noqa: E731
    text = "One two. Three four five six, seven eight nine ten eleven; twelve! Thirteen fourteen."
    pieces = split_text(text, fits)
    assert all(fits(p) for p in pieces) and " ".join(pieces).split() == text.split()
    assert pieces[0] == "One two." and "Three four five six," in pieces
    assert split_text("  Short enough.  ", fits) == ["Short enough."]
    with pytest.raises(ValueError, match="does not fit even on its own"):
        split_text("Supercalifragilisticexpialidocious-and-then-some.", fits)
