"""Turbo's text front end: `turbo_punc_norm` and `GPT2Tokenizer` on the toy GPT-2 files (no torch, no
upstream)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mlx_chatterbox.text import (
    EMPTY_TEXT,
    TURBO_EVENT_TAGS,
    TURBO_PUNCTUATION_REPLACEMENTS,
    TURBO_STYLE_TAGS,
    GPT2Tokenizer,
    TokenizerError,
    punc_norm,
    turbo_punc_norm,
)
from tests.toy_gpt2_tokenizer import (
    BPE_SIZE,
    EOT,
    MODEL_MAX_LENGTH,
    TAGS,
    VOCAB_SIZE,
    write_toy_gpt2_tokenizer,
)

# (input, expected), each worked out by hand from upstream's tts_turbo.punc_norm.
TURBO_CASES = [
    ("", EMPTY_TEXT),
    ("hello world", "Hello world."),
    ("Really?", "Really?"),
    ("Wait...", "Wait..."),  # Turbo keeps "..." (English: "Wait,")
    ("Wait\u2026 what", "Wait,  what."),
    ("a - b", "A - b."),  # kept (English: "A, b.")
    ("a; b", "A; b."),  # kept (English: "A,  b.")
    ("one: two", "One, two."),
    ("x ,y", "X,y."),
    ("em\u2014dash", "Em-dash."),
    ("en\u2013dash", "En-dash."),
    ("\u201cquoted\u201d", '"quoted".'),
    ("\u2018single\u2019", "'single'."),
    ("  leading spaces", "leading spaces."),
    ("tab\there\nnew  line", "Tab here new line."),
    ("[laugh] that was funny", "[laugh] that was funny."),  # "[" is not lower case: no capital
    ("oh [sigh]", "Oh [sigh]."),
    ("ends with dash -", "Ends with dash -"),
    ("\u00dfe", "SSe."),
]


@pytest.mark.parametrize(("text", "expected"), TURBO_CASES)
def test_turbo_punc_norm(text: str, expected: str) -> None:
    assert turbo_punc_norm(text) == expected


def test_english_punc_norm_is_unchanged() -> None:
    assert punc_norm("Wait... a - b; c") == "Wait,  a, b,  c."


def test_turbo_replacement_table_keeps_its_unicode_rules() -> None:
    olds = [old for old, _ in TURBO_PUNCTUATION_REPLACEMENTS]
    assert [hex(ord(c)) for c in olds if ord(c[0]) > 127] == [
        "0x2026",
        "0x2014",
        "0x2013",
        "0x201c",
        "0x201d",
        "0x2018",
        "0x2019",
    ]
    assert not {"...", " - ", ";"} & set(olds)


def test_tag_lists() -> None:
    assert len(TURBO_EVENT_TAGS) == 9 and len(TURBO_STYLE_TAGS) == 10
    assert sorted(TURBO_EVENT_TAGS + TURBO_STYLE_TAGS) == sorted(TAGS)


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_gpt2_tokenizer(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def tok(toy: Path) -> GPT2Tokenizer:
    return GPT2Tokenizer.from_folder(toy)


def test_tags_are_single_ids_from_added_tokens_json(tok: GPT2Tokenizer, toy: Path) -> None:
    declared = json.loads((toy / "added_tokens.json").read_text())
    for tag in TAGS:
        assert tok.encode(tag) == [declared[tag]]
    assert tok.added_tokens == {EOT: BPE_SIZE, **declared}


def test_a_space_before_a_tag_is_its_own_token(tok: GPT2Tokenizer, toy: Path) -> None:
    vocab = json.loads((toy / "vocab.json").read_text())
    laugh = tok.encode("[laugh]")[0]
    assert tok.encode(" [laugh]") == [vocab["\u0120"], laugh]  # "Ġ" is GPT-2's byte symbol for a space
    assert tok.encode("Hi [laugh]")[-2:] == [vocab["\u0120"], laugh]
    assert tok.encode("a[laugh]b") == [vocab["a"], laugh, vocab["b"]]


def test_no_start_or_stop_ids(tok: GPT2Tokenizer) -> None:
    ids = tok.encode("Hello world.")
    assert BPE_SIZE not in ids and tok.encode("") == []
    assert tok.encode(EOT) == [BPE_SIZE]  # a special token in the text is matched whole


def test_decode_round_trip(tok: GPT2Tokenizer) -> None:
    for text in [
        "Hello [laugh] world.",
        "  two  spaces",
        "caf\u00e9 \U0001f600 \u65e5\u672c",
        "[clear throat]ok",
    ]:
        assert tok.decode(tok.encode(text)) == text


def test_vocab_size_and_check_compatible(tok: GPT2Tokenizer) -> None:
    assert tok.vocab_size == VOCAB_SIZE
    tok.check_compatible(VOCAB_SIZE)
    with pytest.raises(
        TokenizerError, match=f"it has {VOCAB_SIZE} tokens but the model's text vocabulary has 50276"
    ):
        tok.check_compatible(50276)


def test_too_long_text_is_an_error_not_a_cut(tok: GPT2Tokenizer) -> None:
    assert tok.max_length == MODEL_MAX_LENGTH
    fits = " [laugh]" * (MODEL_MAX_LENGTH // 2)
    assert len(tok.encode(fits)) == MODEL_MAX_LENGTH
    with pytest.raises(ValueError, match=r"1026 tokens long, more than the tokenizer's limit of 1024"):
        tok.encode(fits + " [sigh]")
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(["a"])  # type: ignore[arg-type]


def test_no_model_max_length_means_no_limit(tmp_path: Path) -> None:
    tok = GPT2Tokenizer.from_folder(write_toy_gpt2_tokenizer(tmp_path, model_max_length=None))
    assert tok.max_length is None and len(tok.encode(" [laugh]" * 600)) == 1200


def test_bos_when_the_config_asks(tmp_path: Path) -> None:
    tok = GPT2Tokenizer.from_folder(write_toy_gpt2_tokenizer(tmp_path, add_bos_token=True))
    assert tok.encode("[laugh]") == [BPE_SIZE, BPE_SIZE + 1]


def test_legacy_layout_gives_the_same_ids(tok: GPT2Tokenizer, tmp_path: Path) -> None:
    legacy = GPT2Tokenizer.from_folder(write_toy_gpt2_tokenizer(tmp_path, decoder=False))
    text = "Oh [sigh] well, [clear throat] fine [laugh]."
    assert legacy.encode(text) == tok.encode(text)


def test_file_errors(toy: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        GPT2Tokenizer.from_folder(tmp_path / "none")
    with pytest.raises(TokenizerError, match="is a file, not a folder"):
        GPT2Tokenizer.from_folder(toy / "vocab.json")

    def copy(name: str) -> Path:
        folder = tmp_path / name
        shutil.copytree(toy, folder)
        return folder

    folder = copy("no_merges")
    (folder / "merges.txt").unlink()
    with pytest.raises(TokenizerError, match="has no merges.txt"):
        GPT2Tokenizer.from_folder(folder)

    folder = copy("bad_json")
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json is not a readable JSON file"):
        GPT2Tokenizer.from_folder(folder)

    folder = copy("other_class")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(TokenizerError, match="names tokenizer_class 'LlamaTokenizer'"):
        GPT2Tokenizer.from_folder(folder)

    # An id the files declare that transformers would not give (here: a hole after the BPE entries).
    folder = copy("hole")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    table = config["added_tokens_decoder"]
    config["added_tokens_decoder"] = {
        str(int(k) + 1) if int(k) > BPE_SIZE else k: v for k, v in table.items()
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=r"'\[laugh\]' is declared as id 702 but gets id 701"):
        GPT2Tokenizer.from_folder(folder)

    folder = copy("bad_limit")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 0}))
    with pytest.raises(TokenizerError, match="model_max_length 0 is not a positive length"):
        GPT2Tokenizer.from_folder(folder)
