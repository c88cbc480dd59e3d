"""The multilingual text front end: languages, `mtl_punc_norm`, `MtlTokenizer` and CJK splitting (no torch,
no upstream)."""

from __future__ import annotations

import sys
import types
import unicodedata
from pathlib import Path

import pytest

from mlx_chatterbox.text import (
    LANGUAGES,
    LanguageSupportError,
    MtlTokenizer,
    TokenizerError,
    check_language,
    mtl_punc_norm,
    multilingual,
    punc_norm,
    read_cangjie,
    split_text,
)
from mlx_chatterbox.text.multilingual import decompose_hangul
from tests.toy_mtl_tokenizer import (
    CANGJIE_TOKENS,
    LANGUAGE_TAGS,
    TEXT_VOCAB_SIZE,
    write_toy_cangjie,
    write_toy_mtl_tokenizer,
    write_toy_pkuseg_home,
)


def _split_words(text: str) -> list[str]:
    return text.split()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("mtl")
    write_toy_mtl_tokenizer(folder)
    write_toy_cangjie(folder)
    return folder


@pytest.fixture(scope="module")
def tok(folder: Path) -> MtlTokenizer:
    # Words split at spaces: these tests are about the Cangjie spelling, not about pkuseg.
    return MtlTokenizer.from_folder(folder, segmenter=_split_words)


@pytest.fixture()
def fresh_caches():
    """Forget the cached pykakasi / pkuseg instances, before and after, so a faked import is really tried."""
    multilingual._kakasi.cache_clear()
    multilingual._pkuseg_cut.cache_clear()
    yield
    multilingual._kakasi.cache_clear()
    multilingual._pkuseg_cut.cache_clear()


# --- languages ----------------------------------------------------------------------------------------------


def test_the_23_languages() -> None:
    assert len(LANGUAGES) == 23 and list(LANGUAGES) == sorted(LANGUAGES)
    assert LANGUAGES["zh"] == "Chinese" and LANGUAGES["no"] == "Norwegian" and LANGUAGES["sw"] == "Swahili"


def test_check_language_lowercases() -> None:
    assert check_language("fr") == "fr"
    assert check_language("FR") == "fr"
    assert check_language("Zh") == "zh"


@pytest.mark.parametrize("bad", ["xx", "", " fr", "fr-FR", "english", "jp"])
def test_unknown_language_names_the_code_and_the_choices(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        check_language(bad)
    message = str(info.value)
    assert repr(bad) in message
    assert all(f"{code} ({name})" in message for code, name in LANGUAGES.items())


def test_language_must_be_a_string() -> None:
    with pytest.raises(TypeError, match="must be a str"):
        check_language(None)  # type: ignore[arg-type]


# --- punctuation --------------------------------------------------------------------------------------------

MTL_PUNC_CASES = [
    ("", "You need to add some text for me to talk."),
    ("hello world", "Hello world."),
    ("Wait...", "Wait,"),
    ("\u4f60\u597d", "\u4f60\u597d."),
    ("\u4f60\u597d\u3002", "\u4f60\u597d\u3002"),  # 。
    ("\u4f60\u597d\uff01", "\u4f60\u597d\uff01"),  # ！
    ("\u4f60\u597d\uff1f", "\u4f60\u597d\uff1f"),  # ？
    ("\u4f60\u597d\uff0c", "\u4f60\u597d\uff0c"),  # ，
    ("\u4f60\u597d\u3001", "\u4f60\u597d\u3001"),  # 、
    ("\u4f60\u597d\uff0e", "\u4f60\u597d\uff0e."),  # full-width full stop is not an ender upstream
    ("\u3053\u3093\u306b\u3061\u306f\u3002  ", "\u3053\u3093\u306b\u3061\u306f\u3002"),
    ("\u0645\u0631\u062d\u0628\u0627\u061f", "\u0645\u0631\u062d\u0628\u0627\u061f."),  # Arabic ? is not
    (
        "\u0928\u092e\u0938\u094d\u0924\u0947\u0964",
        "\u0928\u092e\u0938\u094d\u0924\u0947\u0964.",
    ),  # nor danda
    ("\u00e7a va\u2026", "\u00c7a va,"),
]


@pytest.mark.parametrize(("text", "expected"), MTL_PUNC_CASES)
def test_mtl_punc_norm(text: str, expected: str) -> None:
    assert mtl_punc_norm(text) == expected


def test_english_punc_norm_keeps_its_enders() -> None:
    assert punc_norm("\u4f60\u597d\u3002") == "\u4f60\u597d\u3002."
    assert punc_norm("a\uff01") == "A\uff01."


# --- tokenizer: files and ids -------------------------------------------------------------------------------


def test_ids_line_up_with_the_multilingual_t3(tok: MtlTokenizer) -> None:
    assert (tok.start_id, tok.stop_id) == (255, 0)
    assert tok.vocab_size <= TEXT_VOCAB_SIZE
    tok.check_compatible(255, 0, TEXT_VOCAB_SIZE)


def test_check_compatible_names_every_problem_and_the_file(tok: MtlTokenizer, folder: Path) -> None:
    with pytest.raises(TokenizerError) as info:
        tok.check_compatible(256, 1, 704)
    message = str(info.value)
    assert str(folder / "grapheme_mtl_merged_expanded_v1.json") in message
    assert "start-of-text token is 256" in message and "end-of-text token is 1" in message
    assert "only 704 entries" in message and "ResembleAI/chatterbox" in message


def test_missing_or_bad_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        MtlTokenizer.from_files(tmp_path / "nope.json")
    with pytest.raises(TokenizerError, match="is a directory"):
        MtlTokenizer.from_files(tmp_path)
    with pytest.raises(TokenizerError, match="does not exist"):
        MtlTokenizer.from_folder(tmp_path / "nowhere")
    (tmp_path / "broken.json").write_text("{", encoding="utf-8")
    with pytest.raises(TokenizerError, match="not a valid tokenizer JSON"):
        MtlTokenizer.from_files(tmp_path / "broken.json")
    with pytest.raises(TokenizerError, match="grapheme_mtl_merged_expanded_v1.json"):
        MtlTokenizer.from_folder(tmp_path)  # a folder without the tokenizer


def test_a_tokenizer_without_start_is_refused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    path = tmp_path / "other.json"
    Tokenizer(models.BPE(vocab={"a": 0, "[UNK]": 1}, merges=[], unk_token="[UNK]")).save(str(path))
    with pytest.raises(TokenizerError, match=r"no \[START\] token"):
        MtlTokenizer.from_files(path)


def test_language_tag_leads_and_case_does_not_matter(tok: MtlTokenizer) -> None:
    ids = tok.encode("bonjour", "fr")
    assert ids[0] == tok._tok.token_to_id("[fr]") and ids[1:] == tok.encode("bonjour", None)
    assert tok.encode("bonjour", "FR") == ids
    assert tok.encode("Bonjour", "fr") == ids  # the text is lower-cased
    assert tok.encode("bonjour", "") == tok.encode("bonjour", None)  # "" is no language, as upstream


def test_every_language_tag_and_cangjie_mark_is_one_token(tok: MtlTokenizer) -> None:
    for token in (*LANGUAGE_TAGS, *CANGJIE_TOKENS):
        assert len(tok._tok.encode(token).ids) == 1, token
    assert tok._tagged == set(LANGUAGES)
    for code in LANGUAGES:
        if code != "ja":  # (needs pykakasi)
            assert tok.preprocess("a b", code).startswith(f"[{code}]")


def test_a_language_whose_tag_the_file_lacks_is_an_error(folder: Path, tmp_path: Path) -> None:
    import json

    data = json.loads((folder / "grapheme_mtl_merged_expanded_v1.json").read_text(encoding="utf-8"))
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "[fr]"]
    (tmp_path / "grapheme_mtl_merged_expanded_v1.json").write_text(json.dumps(data), encoding="utf-8")
    tok = MtlTokenizer.from_folder(tmp_path)
    assert tok.encode("hallo", "de")
    with pytest.raises(TokenizerError, match=r"has no \[fr\] token, so it cannot tag French text"):
        tok.encode("bonjour", "fr")


def test_unknown_language_in_encode(tok: MtlTokenizer) -> None:
    with pytest.raises(ValueError, match="unsupported language 'xx'"):
        tok.encode("hello", "xx")


def test_spaces_become_space_tokens_and_unknowns_unk(tok: MtlTokenizer) -> None:
    space, unk = 2, 1
    assert tok.encode(" a  b ", None).count(space) == 4
    assert tok.encode("a\U0001f600\U0001f600", None)[-2:] == [unk, unk]
    assert tok.encode("\u0e2a\u0e27\u0e31\u0e2a", "en")[1:] == [unk] * 4  # Thai is not in the toy


def test_nfkd_splits_accents_and_full_width_forms(tok: MtlTokenizer) -> None:
    assert tok.preprocess("Caf\u00e9", "fr") == "[fr]cafe\u0301"
    assert tok.preprocess("\u4f60\uff1f", "fr") == "[fr]\u4f60?"  # full-width ？ is NFKD ?
    assert (
        tok.preprocess("\u0130stanbul", "tr") == "[tr]i\u0307stanbul"
    )  # Python's lower(), not Turkish rules


def test_decode(tok: MtlTokenizer) -> None:
    ids = tok.encode("bonjour le monde", "fr")
    assert tok.decode([255, *ids, 0]) == "[START][fr]bonjour le monde"


# --- Chinese: Cangjie ---------------------------------------------------------------------------------------


def test_cangjie_index_suffix(folder: Path) -> None:
    codes = read_cangjie(folder / "Cangjie5_TC.json")
    assert codes["\u65e5"] == "a" and codes["\u66f0"] == "a1"  # 日, 曰 share "a"
    assert codes["\u611b"] == "bbpe1"  # 愛 after 爱
    assert codes["\u5114"] == "oiar10"  # 儔: the eleventh "oiar", a two-digit suffix
    assert codes["\u6587"] == "yk"  # a third field is ignored
    # 中 is listed under "l" and later under "a": the later code wins, and the earlier listing still counts,
    # so 丨 (the next "l") is "l1".
    assert codes["\u4e2d"] == "a2" and codes["\u4e28"] == "l1"


@pytest.mark.parametrize(
    "entries",
    [["\u65e5"], ["\u65e5\t"], ["\tm"], [3], {"\u65e5": "a"}],
    ids=["no-tab", "no-code", "no-glyph", "int", "dict"],
)
def test_a_bad_cangjie_file_is_an_error(tmp_path: Path, entries) -> None:
    import json

    path = tmp_path / "Cangjie5_TC.json"
    path.write_text(json.dumps(entries), encoding="utf-8")
    with pytest.raises(TokenizerError, match="Cangjie5_TC|glyph<TAB>code"):
        read_cangjie(path)


def test_chinese_is_spelled_in_cangjie_codes(tok: MtlTokenizer) -> None:
    # 你 onf, 好 vnd; ，(full-width) is NFKD ","; 中 a2; 侖 oiar; kana and unmapped Han pass through.
    assert tok.preprocess("\u4f60\u597d\uff0c\u4e2d \u4f96\u306e\u9f8d", "zh") == (
        "[zh][cj_o][cj_n][cj_f][cj_.][cj_v][cj_n][cj_d][cj_.],[cj_a][cj_2][cj_.]"
        "[SPACE][cj_o][cj_i][cj_a][cj_r][cj_.]\u306e\u9f8d"
    )
    # A compatibility ideograph (U+F900) is NFKD 豈 (U+8C48), which the map knows.
    assert tok.preprocess("\uf900", "zh") == "[zh][cj_u][cj_m][cj_r][cj_t][cj_.]"
    # Two-digit suffix: one token per digit.
    assert tok.preprocess("\u5114", "zh") == "[zh][cj_o][cj_i][cj_a][cj_r][cj_1][cj_0][cj_.]"
    ids = tok.encode("\u4f60\u597d", "zh")
    assert 1 not in ids and len(ids) == 1 + 4 + 4


def test_chinese_without_the_cangjie_map_names_the_file(folder: Path) -> None:
    tok = MtlTokenizer.from_files(folder / "grapheme_mtl_merged_expanded_v1.json", segmenter=_split_words)
    assert tok.encode("bonjour", "fr")  # other languages need no map
    with pytest.raises(TokenizerError) as info:
        tok.encode("\u4f60\u597d", "zh")
    assert "Cangjie5_TC.json" in str(info.value) and str(folder) in str(info.value)


def test_segmenter_words_are_joined_by_spaces(folder: Path) -> None:
    tok = MtlTokenizer.from_folder(folder, segmenter=lambda text: [text[:1], text[1:]])
    assert (
        tok.preprocess("\u6211\u7231", "zh")
        == "[zh][cj_h][cj_q][cj_i][cj_.][SPACE][cj_b][cj_b][cj_p][cj_e][cj_.]"
    )


def test_chinese_with_pkuseg(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_caches
) -> None:
    spacy_pkuseg = pytest.importorskip("spacy_pkuseg")
    # The real model would be downloaded; a toy one trained here stands in, found where pkuseg looks.
    monkeypatch.setattr(spacy_pkuseg.config, "pkuseg_home", str(write_toy_pkuseg_home(tmp_path / "pkuseg")))
    tok = MtlTokenizer.from_folder(folder)
    spelled = tok.preprocess("\u6211\u7231\u5317\u4eac", "zh")  # 我爱北京: 我 | 爱 | 北京
    me, love = "[cj_h][cj_q][cj_i][cj_.]", "[cj_b][cj_b][cj_p][cj_e][cj_.]"
    beijing = "[cj_l][cj_m][cj_p][cj_.][cj_y][cj_r][cj_f][cj_.]"
    assert spelled == f"[zh]{me}[SPACE]{love}[SPACE]{beijing}"


# --- optional packages --------------------------------------------------------------------------------------


def test_japanese_without_pykakasi_names_the_extra(
    tok: MtlTokenizer, monkeypatch: pytest.MonkeyPatch, fresh_caches
) -> None:
    monkeypatch.setitem(sys.modules, "pykakasi", None)  # makes ``import pykakasi`` raise ImportError
    with pytest.raises(LanguageSupportError, match=r"pykakasi.*pip install 'mlx-chatterbox\[ja\]'") as info:
        tok.encode("\u65e5\u672c", "ja")
    assert isinstance(info.value, ImportError)
    assert tok.encode("bonjour", "fr")  # nothing else needs it


def test_chinese_without_pkuseg_names_the_extra(
    folder: Path, monkeypatch: pytest.MonkeyPatch, fresh_caches
) -> None:
    monkeypatch.setitem(sys.modules, "spacy_pkuseg", None)
    tok = MtlTokenizer.from_folder(folder)
    with pytest.raises(LanguageSupportError, match=r"spacy-pkuseg.*pip install 'mlx-chatterbox\[zh\]'"):
        tok.encode("\u4f60\u597d", "zh")


def test_a_pkuseg_model_that_cannot_be_downloaded_is_an_error(
    folder: Path, monkeypatch: pytest.MonkeyPatch, fresh_caches
) -> None:
    def offline(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'github.com'")

    fake = types.SimpleNamespace(pkuseg=offline, config=types.SimpleNamespace(pkuseg_home="/nowhere/.pkuseg"))
    monkeypatch.setitem(sys.modules, "spacy_pkuseg", fake)
    tok = MtlTokenizer.from_folder(folder)
    with pytest.raises(LanguageSupportError) as info:
        tok.encode("\u4f60\u597d", "zh")
    message = str(info.value)
    assert "'spacy_ontonotes'" in message and "/nowhere/.pkuseg" in message and "github.com" in message


def test_pykakasi_is_imported_once(monkeypatch: pytest.MonkeyPatch, fresh_caches) -> None:
    made = []

    class Kakasi:
        def __init__(self) -> None:
            made.append(self)

        def convert(self, text: str) -> list[dict[str, str]]:
            return [{"orig": text, "hira": text}]

    monkeypatch.setitem(sys.modules, "pykakasi", types.SimpleNamespace(kakasi=Kakasi))
    assert multilingual.kanji_to_hiragana("a") == "a" and multilingual.kanji_to_hiragana("b") == "b"
    assert len(made) == 1


def test_kanji_segments_become_hiragana(monkeypatch: pytest.MonkeyPatch, fresh_caches) -> None:
    segments = [
        {"orig": "\u82b1", "hira": "\u306f\u306a"},  # 花 -> はな: a space in front (は)
        {"orig": "\u304c", "hira": "\u304c"},
        {"orig": "\u90e8\u5c4b", "hira": "\u3078\u3084"},  # 部屋 -> へや: a space in front (へ)
        {"orig": "\u30bf\u30ef\u30fc", "hira": "\u305f\u308f\u30fc"},  # katakana stays katakana
        {"orig": "\u6771\u4eac", "hira": "\u3068\u3046\u304d\u3087\u3046"},  # 東京 -> とうきょう
    ]
    fake = types.SimpleNamespace(kakasi=lambda: types.SimpleNamespace(convert=lambda text: segments))
    monkeypatch.setitem(sys.modules, "pykakasi", fake)
    got = multilingual.kanji_to_hiragana("ignored")
    want = " \u306f\u306a\u304c \u3078\u3084\u30bf\u30ef\u30fc\u3068\u3046\u304d\u3087\u3046"
    assert got == unicodedata.normalize("NFKD", want)  # が comes out decomposed: NFKD again at the end


def test_japanese_with_pykakasi(tok: MtlTokenizer, fresh_caches) -> None:
    pytest.importorskip("pykakasi")
    spelled = tok.preprocess("\u82b1\u304c\u597d\u304d\u3067\u3059", "ja")  # 花が好きです
    assert spelled == "[ja][SPACE]" + unicodedata.normalize(
        "NFKD", "\u306f\u306a\u304c\u3059\u304d\u3067\u3059"
    )
    assert tok.preprocess("\u30ab\u30bf\u30ab\u30ca", "ja") == "[ja]" + unicodedata.normalize(
        "NFKD", "\u30ab\u30bf\u30ab\u30ca"
    )
    assert 1 not in tok.encode("\u6771\u4eac\u30bf\u30ef\u30fc\u306b\u884c\u3063\u305f", "ja")


# --- Korean -------------------------------------------------------------------------------------------------


def test_hangul_decomposition() -> None:
    text = "\ud55c\uad6d\uc5b4 \uac00"  # 한국어 가
    assert decompose_hangul(text) == unicodedata.normalize("NFD", text)
    assert decompose_hangul("\ud55c") == "\u1112\u1161\u11ab"  # ㅎ ㅏ ㄴ
    assert decompose_hangul("\uac00") == "\u1100\u1161"  # no tail
    assert decompose_hangul("\ud7a3") == "\u1112\u1175\u11c2"  # the last syllable
    # Upstream's range runs past the last syllable into unassigned code points; the formula runs there too.
    assert decompose_hangul("\ud7a4") == "\u1113\u1161"
    assert decompose_hangul("  \uac00 abc\n") == "\u1100\u1161 abc"  # and strips


def test_korean_is_stripped(tok: MtlTokenizer) -> None:
    assert tok.preprocess("  \uc548\ub155 ", "ko") == "[ko]" + unicodedata.normalize("NFD", "\uc548\ub155")
    assert tok.preprocess("  a ", "en") == "[en][SPACE][SPACE]a[SPACE]"  # other languages keep the spaces


def test_hebrew_and_russian_are_left_as_they_are(tok: MtlTokenizer) -> None:
    assert tok.preprocess("\u05e9\u05dc\u05d5\u05dd", "he") == "[he]\u05e9\u05dc\u05d5\u05dd"
    assert tok.preprocess("\u0419\u043e\u0433\u0430", "ru") == "[ru]\u0438\u0306\u043e\u0433\u0430"


# --- long text: CJK sentence ends ---------------------------------------------------------------------------


def test_split_at_cjk_sentence_ends_without_spaces() -> None:
    text = "\u4f60\u597d\u3002\u6211\u5f88\u597d\uff01\u4f60\u5462\uff1f"  # 你好。我很好！你呢？
    assert split_text(text, lambda s: len(s) <= 4) == [
        "\u4f60\u597d\u3002",
        "\u6211\u5f88\u597d\uff01",
        "\u4f60\u5462\uff1f",
    ]
    # Packed greedily and rejoined without a space, so the pieces give back the text.
    pieces = split_text(text, lambda s: len(s) <= 7)
    assert pieces == ["\u4f60\u597d\u3002\u6211\u5f88\u597d\uff01", "\u4f60\u5462\uff1f"]
    assert split_text(text, lambda s: True) == [text]


def test_split_at_full_width_and_halfwidth_stops() -> None:
    assert split_text("ab\uff0ecd\uff61ef", lambda s: len(s) <= 3) == ["ab\uff0e", "cd\uff61", "ef"]


def test_split_cjk_clauses_then_characters() -> None:
    text = "\u4eca\u5929\uff0c\u5929\u6c14\u5f88\u597d\u3001\u5f88\u597d"  # 今天，天气很好、很好
    pieces = split_text(text, lambda s: len(s) <= 5)
    assert pieces == ["\u4eca\u5929\uff0c", "\u5929\u6c14\u5f88\u597d\u3001", "\u5f88\u597d"]
    long_run = "\u4e00" * 12
    pieces = split_text(long_run, lambda s: len(s) <= 5)
    assert "".join(pieces) == long_run and all(len(p) <= 5 for p in pieces)


def test_split_mixed_scripts_and_spaces_after_cjk_marks() -> None:
    text = "Hello there. \u4f60\u597d\u3002 \u518d\u89c1\uff01 Bye now."
    pieces = split_text(text, lambda s: len(s) <= 12)
    assert pieces == ["Hello there.", "\u4f60\u597d\u3002 \u518d\u89c1\uff01", "Bye now."]


def test_split_latin_marks_still_need_a_space() -> None:
    text = "Pi is 3.14 or so. e.g. this!That"
    assert split_text(text, lambda s: len(s) <= 18) == ["Pi is 3.14 or so.", "e.g. this!That"]
    with pytest.raises(ValueError, match="does not fit even on its own"):
        split_text("abcdef", lambda s: len(s) <= 3)  # Latin words are never cut
