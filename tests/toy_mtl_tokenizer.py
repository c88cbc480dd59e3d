"""Small stand-ins for Chatterbox Multilingual's text files, for tests: the tokenizer
``grapheme_mtl_merged_expanded_v1.json``, the Chinese map ``Cangjie5_TC.json``, and a spacy-pkuseg model.

The real files (Hugging Face ``ResembleAI/chatterbox``) cannot be downloaded here. The tokenizer has the
shape of the English one (tests/toy_tokenizer.py): a ``tokenizers`` grapheme BPE with no normaliser, a
``Whitespace`` pre-tokenizer, unknown characters one ``[UNK]`` each, ids without holes, ``[STOP]`` at 0 and
``[START]`` at 255 (the multilingual T3's stop/start text tokens). After [START] come the 23 ``[xx]`` language
tags and the ``[cj_*]`` Cangjie tokens (added tokens, like the control tokens), then more graphemes, then
merges learnt from a small text in every language, lower-cased and NFKD-decomposed as the tokenizer sees it.
The graphemes cover Latin with combining accents, Cyrillic, Greek, Arabic, Hebrew, Devanagari, Hangul jamo,
kana and a few Han characters, well under the 2454 ids of the real vocabulary; emoji, Thai and most Han
characters stay unknown.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import unicodedata
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from mlx_chatterbox.text import LANGUAGES
from tests.toy_tokenizer import CONTROL_TOKENS, START_ID, START_TOKEN, _learn_merges

TEXT_VOCAB_SIZE = 2454  # the multilingual T3's text embedding rows
MAX_MERGES = 300
LANGUAGE_TAGS = tuple(f"[{code}]" for code in LANGUAGES)
# The letters of Cangjie codes, the digits of the index suffix, and the end-of-glyph mark.
CANGJIE_TOKENS = tuple(f"[cj_{c}]" for c in "abcdefghijklmnopqrstuvwxyz0123456789.")


def _span(first: int, last: int) -> list[str]:
    return [chr(c) for c in range(first, last + 1) if unicodedata.category(chr(c)) != "Cn"]


# The characters that get a single id, in id order. The first ones fill ids 7-254 (before [START]).
GRAPHEMES: tuple[str, ...] = tuple(
    dict.fromkeys(
        _span(0x21, 0x7E)  # printable ASCII
        + list("\u00df\u00e6\u00f8\u0142\u0131\u0153\u0111\u00f0\u00fe\u00b7\u00a1\u00bf\u00ab\u00bb")
        + _span(0x0300, 0x0331)  # combining accents (NFKD splits them off their letters)
        + _span(0x03B1, 0x03C9)  # Greek lower case (with final sigma)
        + _span(0x0430, 0x044F)  # Cyrillic lower case
        + ["\u0456", "\u0454"]
        + _span(0x05D0, 0x05EA)  # Hebrew letters
        + _span(0x05B0, 0x05BC)  # Hebrew points
        + _span(0x0621, 0x064A)  # Arabic letters
        + _span(0x064B, 0x0652)  # Arabic vowel marks
        + ["\u060c", "\u061f", "\u061b"]
        + _span(0x0901, 0x0939)  # Devanagari signs, vowels, consonants
        + _span(0x093C, 0x094D)  # nukta, vowel signs, virama
        + ["\u0964", "\u0965"]
        + _span(0x1100, 0x1112)  # Hangul leading consonants
        + _span(0x1161, 0x1175)  # Hangul vowels
        + _span(0x11A8, 0x11C2)  # Hangul trailing consonants
        + _span(0x3041, 0x3096)  # hiragana
        + [
            "\u3099",
            "\u309a",
            "\u30fc",
            "\u30fb",
        ]  # combining (semi-)voiced marks, prolonged sound, middle dot
        + _span(0x30A1, 0x30FA)  # katakana
        + list("\u3001\u3002\u300c\u300d\u300e\u300f")  # 、。「」『』
        + list("\u7684\u4e00\u662f\u4e0d\u4e86\u4eba\u6211\u5728\u6709\u4ed6")  # 的一是不了人我在有他
    )
)

# A few sentences per language (plus some Japanese readings in hiragana) for the merges.
_CORPUS = """
The quick brown fox jumps over the lazy dog. Hello there, how are you doing today? I am doing well.
Le renard brun saute par-dessus le chien paresseux. Bonjour, comment allez-vous aujourd'hui ? Très bien.
Der schnelle braune Fuchs springt über den faulen Hund. Guten Tag, wie geht es Ihnen heute? Schön.
El rápido zorro marrón salta sobre el perro perezoso. ¿Cómo estás hoy? Muy bien, gracias, señor.
La volpe veloce salta sopra il cane pigro. Come stai oggi? Molto bene, grazie. Perché no?
A rápida raposa marrom pula sobre o cão preguiçoso. Como você está hoje? Estou bem, obrigado.
De snelle bruine vos springt over de luie hond. Hoe gaat het vandaag met je? Het gaat goed.
Den snabba bruna räven hoppar över den lata hunden. Hur mår du idag? Jag mår bra, tack så mycket.
Den hurtige brune ræv hopper over den dovne hund. Hvordan har du det i dag? Jeg har det godt, tak.
Den raske brune reven hopper over den late hunden. Hvordan har du det i dag? Jeg har det bra, takk.
Nopea ruskea kettu hyppää laiskan koiran yli. Mitä kuuluu tänään? Kiitos, hyvää kuuluu.
Szybki brązowy lis przeskakuje nad leniwym psem. Jak się dzisiaj masz? Dziękuję, dobrze.
Hızlı kahverengi tilki tembel köpeğin üzerinden atlar. Bugün nasılsın? İyiyim, teşekkür ederim.
Musang coklat yang pantas melompat ke atas anjing yang malas. Apa khabar hari ini? Saya baik.
Mbweha mwepesi wa kahawia anaruka juu ya mbwa mvivu. Habari za leo? Nzuri sana, asante.
Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο. Πώς είσαι σήμερα; Καλά, ευχαριστώ.
Быстрая коричневая лиса прыгает через ленивую собаку. Как у тебя дела сегодня? Хорошо, спасибо.
الثعلب البني السريع يقفز فوق الكلب الكسول. كيف حالك اليوم؟ أنا بخير، شكرا جزيلا.
השועל החום המהיר קופץ מעל הכלב העצלן. מה שלומך היום? אני בסדר, תודה רבה.
तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है। आज आप कैसे हैं? मैं ठीक हूँ, धन्यवाद।
빠른 갈색 여우가 게으른 개를 뛰어넘습니다. 오늘 어떻게 지내세요? 잘 지내요, 감사합니다.
すばやい ちゃいろの きつねが なまけものの いぬを とびこえます。 きょうは おげんきですか？ げんきです。
カタカナの テキストも あります。 わたしは がっこうへ いきます。 とうきょう たわー。
"""


def _corpus_words() -> collections.Counter[str]:
    text = unicodedata.normalize("NFKD", _CORPUS.lower())
    return collections.Counter(piece for piece, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text))


def build_toy_mtl_tokenizer() -> Tokenizer:
    vocab = dict(CONTROL_TOKENS)
    graphemes = list(GRAPHEMES)
    for ch in graphemes[: START_ID - len(vocab)]:
        vocab[ch] = len(vocab)
    vocab[START_TOKEN] = START_ID
    specials = [*CONTROL_TOKENS, START_TOKEN, *LANGUAGE_TAGS, *CANGJIE_TOKENS]
    for token in (*LANGUAGE_TAGS, *CANGJIE_TOKENS, *graphemes[START_ID - len(CONTROL_TOKENS) :]):
        vocab.setdefault(token, len(vocab))

    pre = pre_tokenizers.Whitespace()
    kept = []
    for a, b in _learn_merges(_corpus_words(), MAX_MERGES):
        # Merges of characters outside the toy's graphemes are dropped, and with them the later merges of
        # what they would have made.
        if a in vocab and b in vocab:
            vocab.setdefault(a + b, len(vocab))
            kept.append((a, b))
    assert len(vocab) <= TEXT_VOCAB_SIZE and sorted(vocab.values()) == list(range(len(vocab)))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=kept, unk_token="[UNK]", fuse_unk=False))
    tokenizer.pre_tokenizer = pre
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in sorted(specials, key=vocab.__getitem__)]
    )
    return tokenizer


def write_toy_mtl_tokenizer(path: str | Path) -> Path:
    """Write the toy tokenizer JSON to ``path`` (a file, or a directory to put
    grapheme_mtl_merged_expanded_v1.json in); return its path."""
    path = Path(path)
    if path.is_dir():
        path = path / "grapheme_mtl_merged_expanded_v1.json"
    build_toy_mtl_tokenizer().save(str(path))
    return path


# "glyph\tcode" entries in the real file's format. Codes are the glyphs' Cangjie codes where known; a few are
# shared on purpose so the index suffix appears (日/曰 "a"; eleven glyphs "oiar" for a two-digit suffix), one
# entry has a third field, and 中 is listed a second time under "a": the later code wins, and 中 still counts in
# "l", so 丨 (after it) gets suffix 1.
CANGJIE_ENTRIES: tuple[str, ...] = (
    "日\ta",
    "曰\ta",
    "月\tb",
    "金\tc",
    "木\td",
    "水\te",
    "火\tf",
    "土\tg",
    "中\tl",
    "一\tm",
    "人\to",
    "心\tp",
    "口\tr",
    "大\tk",
    "天\tmk",
    "你\tonf",
    "好\tvnd",
    "我\thqi",
    "是\tamyo",
    "的\thapi",
    "爱\tbbpe",
    "愛\tbbpe",
    "北\tlmp",
    "京\tyrf",
    "安\tjv",
    "门\tlsl",
    "們\toan",
    "们\toln",
    "今\toin",
    "气\tomn",
    "很\thoav",
    "世\tpt",
    "界\twol",
    "国\twmgi",
    "國\twirm",
    "文\tyk\tx",
    "学\tfbnd",
    "校\tdyck",
    "去\tgi",
    "起\tgorus",
    "有\tkb",
    "个\tol",
    "首\tthbu",
    "都\tjanl",
    "豈\tumrt",
    "中\ta",
    "丨\tl",
    *(f"{g}\toiar" for g in "侖倫倆侶俞偷儉儈儋儐儔"),
)


def write_toy_cangjie(path: str | Path) -> Path:
    """Write the toy ``Cangjie5_TC.json`` to ``path`` (a file, or a directory to put one in); return its
    path."""
    path = Path(path)
    if path.is_dir():
        path = path / "Cangjie5_TC.json"
    path.write_text(json.dumps(list(CANGJIE_ENTRIES), ensure_ascii=False, indent=0), encoding="utf-8")
    return path


# Pre-segmented sentences (words between spaces) for a toy pkuseg model.
_SEGMENTED = (
    "我 爱 北京 天安门",
    "北京 是 中国 的 首都",
    "我 爱 中国",
    "今天 天气 很 好",
    "你好 ， 世界 。",
    "我们 一起 去 学校 吧",
    "他 是 我 的 朋友",
    "我们 有 三 个 人",
)


def write_toy_pkuseg_home(folder: str | Path) -> Path:
    """Train a tiny spacy-pkuseg model (needs spacy-pkuseg) into ``folder/spacy_ontonotes`` beside an empty
    ``spacy_ontonotes.zip``, so that ``pkuseg()`` with ``config.pkuseg_home = folder`` loads it instead of
    downloading the real one. Returns ``folder``."""
    import spacy_pkuseg

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train = folder / "train.txt"
    train.write_text("\n".join(_SEGMENTED * 4) + "\n", encoding="utf-8")
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer reports progress on stdout
        spacy_pkuseg.train(str(train), str(train), str(folder / "spacy_ontonotes"), train_iter=3)
    (folder / "spacy_ontonotes.zip").touch()  # pkuseg downloads only when the zip is absent
    return folder
