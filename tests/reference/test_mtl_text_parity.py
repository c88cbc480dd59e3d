"""`mtl_punc_norm` and `MtlTokenizer` against upstream chatterbox-tts (``chatterbox.mtl_tts.punc_norm``,
``chatterbox.models.tokenizers.tokenizer.MTLTokenizer``) on the toy multilingual files.

Upstream fetches Cangjie5_TC.json from the Hub, and its pkuseg downloads a model: here both read toy files
instead (``hf_hub_download`` patched in upstream's module; pkuseg's home pointed at a toy model), so the two
sides segment and spell Chinese from the same data. Japanese needs pykakasi and Chinese spacy-pkuseg (the
``test`` extra installs both); without them those cases are skipped, since upstream would silently skip the
transform where we raise.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

import pytest

from mlx_chatterbox.text import LANGUAGES, MtlTokenizer, mtl_punc_norm, multilingual
from tests.toy_mtl_tokenizer import write_toy_cangjie, write_toy_mtl_tokenizer, write_toy_pkuseg_home

pytestmark = pytest.mark.reference

HAVE_PYKAKASI = importlib.util.find_spec("pykakasi") is not None
HAVE_PKUSEG = importlib.util.find_spec("spacy_pkuseg") is not None

# (language, text): every language in its own script, then the hard cases.
TEXTS = [
    ("ar", "مرحبا، كيف حالك اليوم؟"),
    ("ar", "ال\u0652ع\u064eر\u064eب\u0650ي\u0651\u064eة\u064f ل\u064fغ\u064eة\u064c"),
    ("da", "Den hurtige brune ræv hopper over den dovne hund. Hvordan har du det?"),
    ("de", "Der schnelle braune Fuchs springt über den faulen Hund. Schöne Grüße!"),
    ("el", "Η γρήγορη καφέ αλεπού. Πώς είσαι;"),
    ("en", "The quick brown fox jumps over the lazy dog."),
    ("es", "¿Cómo estás hoy? ¡Muy bien, señor!"),
    ("fi", "Nopea ruskea kettu hyppää laiskan koiran yli."),
    ("fr", "Le renard brun saute par-dessus le chien paresseux\u2026 \u00ab Très bien \u00bb, dit-il."),
    ("he", "השועל החום המהיר. מה שלומך?"),
    ("he", "ש\u05b8לו\u05b9ם עו\u05b9ל\u05b8ם"),
    ("hi", "तेज़ भूरी लोमड़ी। आज आप कैसे हैं?"),
    ("hi", "\u095b\u093f\u0902दग\u0940 क\u093c\u093eन\u0942न"),  # precomposed nukta letters
    ("it", "La volpe veloce salta sopra il cane pigro. Perché no?"),
    ("ja", "私は学校へ行きます。"),
    ("ja", "東京タワーに行った\uff01カタカナとひらがな。"),
    ("ja", "花が好きです。部屋へ入る。"),  # readings in は / へ
    ("ja", "今日は雨\uff1fはい、そうです。"),
    ("ja", "これはペンです。コーヒーを一杯。"),
    ("ja", "你\uff1f 日本語"),  # a kanji pykakasi cannot read swallows what follows
    ("ja", "「こんにちは」と彼は言った。 \U0001f600"),
    ("ko", "빠른 갈색 여우가 게으른 개를 뛰어넘습니다."),
    ("ko", "  오늘 어떻게 지내세요?  "),
    ("ms", "Musang coklat yang pantas melompat ke atas anjing yang malas."),
    ("nl", "De snelle bruine vos springt over de luie hond. Hoe gaat het?"),
    ("no", "Den raske brune reven hopper over den late hunden. Blåbær!"),
    ("pl", "Szybki brązowy lis przeskakuje nad leniwym psem. Zażółć gęślą jaźń."),
    ("pt", "A rápida raposa marrom pula sobre o cão preguiçoso. Olá!"),
    ("ru", "Быстрая коричневая лиса. Йогурт и ёжик!"),
    ("sv", "Den snabba bruna räven hoppar över den lata hunden. Hur mår du?"),
    ("sw", "Mbweha mwepesi wa kahawia anaruka juu ya mbwa mvivu. Habari za leo?"),
    ("tr", "İstanbul'da hızlı kahverengi tilki. Iğdır İZMİR şişli"),
    ("zh", "我爱北京天安门。"),
    ("zh", "你好\uff0c世界\uff01今天天气很好。"),
    ("zh", "我们有三个人\uff1f 中文 and English 123"),  # unmapped 三, Latin, digits
    ("zh", "日曰中丨愛侖儔文 \uf900 龍 のカ"),  # suffixes, compat, unmapped
    ("zh", "  北京   是中国的首都  "),  # spaces pkuseg collapses
    ("zh", "「引用」、逗号\uff1b冒号\uff1a\uff08括号\uff09 \U0001f44d"),
    # Mixed scripts, punctuation, emoji, combining marks, empty-ish and padded text.
    ("en", "Mixed Русский, Ελληνικά, العربية and 日本"),
    ("fr", "Full-width\uff1a\uff08括弧\uff09\uff1f\uff01\uff0c\uff1b \uff21\uff22\uff23 \uff11\uff12\uff13"),
    ("de", "Emoji \U0001f600\U0001f44d\U0001f3fd family \U0001f468\u200d\U0001f469\u200d\U0001f467"),
    ("de", "Flaggen \U0001f1eb\U0001f1f7 \U0001f1e9\U0001f1ea"),
    ("es", "e\u0301 combining, n\u0303 and a\u0300\u0301 stacked, \u212b ohm \u2126 \ufb01 ligature"),
    ("it", "Punctuation!!! ??? ... ;; -- (brackets) [SPACE] {braces} <angles> #hash @at $5 50% a&b"),
    ("pt", "\u201cAspas\u201d e \u2018simples\u2019 \u2014 travessão \u2013 meia-risca"),
    ("en", ""),
    ("en", " "),
    ("fr", "."),
    ("ko", "   "),
    ("zh", ""),
    ("ja", ""),
    ("en", "   leading and trailing spaces   "),
    ("en", "tabs\tand\nnew\r\nlines"),
    ("fi", "non\u00a0breaking\u3000ideographic\u2003em space"),
    ("sw", "สว\u0e31สด\u0e35 Thai is unknown"),
    ("tr", "ıİiI ÇŞĞÜÖ"),
    ("hi", "१२३ ٠١٢ digits"),
    ("he", "מיקס English ועברית 2024"),
    ("ru", "ЕЩЁ РАЗ, пожалуйста"),
    ("el", "\u1f08θῆναι \u0386\u0388\u0389; \u03ca\u03cb"),
]
# Language-free calls (upstream's language_id=None) on some of them.
UNTAGGED = [TEXTS[i][1] for i in (0, 5, 14, 21, 32, 38, 41, 44)]


def _needs(language: str) -> None:
    if language == "ja" and not HAVE_PYKAKASI:
        pytest.skip("Japanese needs pykakasi (pip install 'mlx-chatterbox[ja]')")
    if language == "zh" and not HAVE_PKUSEG:
        pytest.skip("Chinese needs spacy-pkuseg (pip install 'mlx-chatterbox[zh]')")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("mtl")
    return {
        "tokenizer": write_toy_mtl_tokenizer(folder),
        "cangjie": write_toy_cangjie(folder),
        "folder": folder,
    }


@pytest.fixture(scope="module")
def pkuseg_home(tmp_path_factory: pytest.TempPathFactory):
    """Both sides' default ``pkuseg()`` loads a toy model from a temporary home instead of downloading."""
    if not HAVE_PKUSEG:
        yield None
        return
    import spacy_pkuseg

    home = write_toy_pkuseg_home(tmp_path_factory.mktemp("pkuseg"))
    multilingual._pkuseg_cut.cache_clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spacy_pkuseg.config, "pkuseg_home", str(home))
        yield home
    multilingual._pkuseg_cut.cache_clear()


@pytest.fixture(scope="module")
def ours(files: dict[str, Path], pkuseg_home) -> MtlTokenizer:
    return MtlTokenizer.from_folder(files["folder"])


@pytest.fixture(scope="module")
def theirs(files: dict[str, Path], pkuseg_home):
    from chatterbox.models.tokenizers import tokenizer as upstream

    def local_cangjie(repo_id: str, filename: str, **kwargs) -> str:
        assert (repo_id, filename) == ("ResembleAI/chatterbox", "Cangjie5_TC.json")
        return str(files["cangjie"])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(upstream, "hf_hub_download", local_cangjie)
        tok = upstream.MTLTokenizer(str(files["tokenizer"]))
    # Upstream swallows a failed map load with a warning: make sure it really has the toy map.
    assert tok.cangjie_converter.word2cj and (tok.cangjie_converter.segmenter is not None) == HAVE_PKUSEG
    return tok


@pytest.fixture(scope="module")
def upstream_punc_norm() -> Callable[[str], str]:
    from chatterbox.mtl_tts import punc_norm

    return punc_norm


def test_enough_texts() -> None:
    assert len(TEXTS) >= 50 and len(set(TEXTS)) == len(TEXTS)
    assert {language for language, _ in TEXTS} == set(LANGUAGES)


def test_languages_match_upstream() -> None:
    from chatterbox.mtl_tts import SUPPORTED_LANGUAGES

    assert LANGUAGES == SUPPORTED_LANGUAGES and list(LANGUAGES) == list(SUPPORTED_LANGUAGES)


@pytest.mark.parametrize(("language", "text"), TEXTS)
def test_punc_norm_matches_upstream(upstream_punc_norm, language: str, text: str) -> None:
    assert mtl_punc_norm(text) == upstream_punc_norm(text)


@pytest.mark.parametrize(("language", "text"), TEXTS)
def test_ids_match_upstream(ours: MtlTokenizer, theirs, upstream_punc_norm, language: str, text: str) -> None:
    _needs(language)
    # As generate does: punc_norm, then the tokenizer with the language.
    want = theirs.text_to_tokens(upstream_punc_norm(text), language_id=language).squeeze(0).tolist()
    assert ours.encode(mtl_punc_norm(text), language) == want
    # And on the raw text, whitespace and all.
    assert ours.encode(text, language) == theirs.encode(text, language_id=language)
    assert ours.decode(want) == theirs.decode(want)


@pytest.mark.parametrize("text", UNTAGGED)
def test_ids_without_a_language_match_upstream(
    ours: MtlTokenizer, theirs, upstream_punc_norm, text: str
) -> None:
    want = theirs.text_to_tokens(upstream_punc_norm(text), language_id=None).squeeze(0).tolist()
    assert ours.encode(mtl_punc_norm(text), None) == want
    assert ours.encode(text, "") == theirs.encode(text, language_id="")


def test_toy_files_exercise_merges_cangjie_and_unknowns(ours: MtlTokenizer) -> None:
    """The parity above means something only if the toy files make real merges, Cangjie spellings and
    [UNK]s."""
    ids = [i for language, text in TEXTS if language not in ("ja", "zh") for i in ours.encode(text, language)]
    assert max(ids) > 255 + len(LANGUAGES) + 37  # merged pieces (ids after the tags and [cj_*] tokens)
    assert 1 in ids  # [UNK]
    if HAVE_PKUSEG:
        suffixes = next(text for language, text in TEXTS if "\u5114" in text)  # 儔: "oiar10"
        assert "[cj_1][cj_0]" in ours.preprocess(suffixes, "zh")
