"""Chatterbox Multilingual's text front end: language codes, punctuation clean-up and text -> token ids.

`MtlTokenizer.encode` gives exactly the ids of upstream ``chatterbox.models.tokenizers.MTLTokenizer`` (0.1.7,
variants.md §5.4-5.5): lower-case, NFKD, the language's own transform, the ``[xx]`` language tag in front,
spaces as ``[SPACE]``, then the grapheme BPE of ``grapheme_mtl_merged_expanded_v1.json``. Where upstream falls
back silently (no Cangjie map, no segmenter, no pykakasi) this module raises instead, naming what to install
or which file is missing. Japanese needs pykakasi (extra ``ja``), Chinese spacy-pkuseg (extra ``zh``); both
are imported only when such text is first encoded.
"""

from __future__ import annotations

import functools
import json
import os
import unicodedata
from collections.abc import Callable, Mapping
from pathlib import Path

from tokenizers import Tokenizer

from .normalize import MTL_SENTENCE_ENDERS, punc_norm
from .tokenize import SPACE, GraphemeTokenizer, TokenizerError

# Upstream's SUPPORTED_LANGUAGES (mtl_tts.py), in its (alphabetical) order.
LANGUAGES: dict[str, str] = {
    "ar": "Arabic",
    "da": "Danish",
    "de": "German",
    "el": "Greek",
    "en": "English",
    "es": "Spanish",
    "fi": "Finnish",
    "fr": "French",
    "he": "Hebrew",
    "hi": "Hindi",
    "it": "Italian",
    "ja": "Japanese",
    "ko": "Korean",
    "ms": "Malay",
    "nl": "Dutch",
    "no": "Norwegian",
    "pl": "Polish",
    "pt": "Portuguese",
    "ru": "Russian",
    "sv": "Swedish",
    "sw": "Swahili",
    "tr": "Turkish",
    "zh": "Chinese",
}

MTL_TOKENIZER_FILE = "grapheme_mtl_merged_expanded_v1.json"
CANGJIE_FILE = "Cangjie5_TC.json"

_FIX = f"Use the {MTL_TOKENIZER_FILE} and {CANGJIE_FILE} that ship with ResembleAI/chatterbox."
# spacy-pkuseg's default model; pkuseg downloads it into $PKUSEG_HOME (default ~/.pkuseg) on first use.
_PKUSEG_MODEL = "spacy_ontonotes"


class LanguageSupportError(ImportError):
    """Text in this language needs an optional package (or its model) that is not installed."""


def check_language(language: str) -> str:
    """The language code in lower case (upstream lower-cases ``language_id``); ValueError if it is not one of
    the 23 in `LANGUAGES`."""
    if not isinstance(language, str):
        raise TypeError(f"language must be a str such as 'fr', got {type(language).__name__}")
    code = language.lower()
    if code not in LANGUAGES:
        choices = ", ".join(f"{c} ({name})" for c, name in LANGUAGES.items())
        raise ValueError(f"unsupported language {language!r}; Chatterbox Multilingual speaks: {choices}")
    return code


def mtl_punc_norm(text: str) -> str:
    """Clean up punctuation as upstream ``chatterbox.mtl_tts.punc_norm``: English's `punc_norm`, except that
    a text ending in a CJK or full-width mark (、，。？！) gets no full stop."""
    return punc_norm(text, MTL_SENTENCE_ENDERS)


def read_cangjie(path: str | os.PathLike[str]) -> dict[str, str]:
    """Glyph -> Cangjie code with its index suffix, from ``Cangjie5_TC.json`` (a JSON list of
    ``"glyph\\tcode[\\t...]"`` strings), as upstream's ``ChineseCangjieConverter`` reads it.

    Glyphs that share a code are told apart by a suffix: the glyph's position among that code's glyphs in
    file order ("" for the first, then "1", "2", ...). A glyph listed twice keeps its last code, and its
    suffix is its first position among that code's glyphs (upstream's ``list.index``).
    """
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"Cangjie map {path} does not exist. {_FIX}")
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenizerError(f"{path} is not a readable JSON file ({err}). {_FIX}") from err
    if not isinstance(entries, list):
        raise TokenizerError(f"{path} does not hold a JSON list of 'glyph<TAB>code' strings. {_FIX}")
    code_of: dict[str, str] = {}
    glyphs_of: dict[str, list[str]] = {}
    for n, entry in enumerate(entries):
        fields = entry.split("\t") if isinstance(entry, str) else []
        # Upstream stops reading at a bad entry and only warns; a half-read map is worse than an error.
        if len(fields) < 2 or not fields[0] or not fields[1]:
            raise TokenizerError(f"{path}: entry {n} ({entry!r}) is not a 'glyph<TAB>code' string. {_FIX}")
        glyph, code = fields[0], fields[1]
        code_of[glyph] = code
        glyphs_of.setdefault(code, []).append(glyph)
    suffixed = {}
    for glyph, code in code_of.items():
        index = glyphs_of[code].index(glyph)
        suffixed[glyph] = code + (str(index) if index > 0 else "")
    return suffixed


def decompose_hangul(text: str) -> str:
    """Hangul syllables as conjoining jamo (lead, vowel, optional tail), then stripped: upstream's
    ``korean_normalize``. Upstream runs it after NFKD, which has already decomposed every syllable, so there
    it only strips; the range is upstream's (U+AC00-U+D7AF, eleven unassigned code points included)."""
    out = []
    for char in text:
        if "\uac00" <= char <= "\ud7af":
            s = ord(char) - 0xAC00
            out.append(chr(0x1100 + s // 588) + chr(0x1161 + s % 588 // 28))  # 588 = 21 vowels x 28 tails
            if s % 28:
                out.append(chr(0x11A7 + s % 28))
        else:
            out.append(char)
    return "".join(out).strip()


@functools.lru_cache(maxsize=1)
def _kakasi():
    try:
        import pykakasi
    except ImportError as err:
        raise LanguageSupportError(
            "Japanese text needs pykakasi (2.3.0, as upstream): pip install 'mlx-chatterbox[ja]'"
        ) from err
    return pykakasi.kakasi()


def kanji_to_hiragana(text: str) -> str:
    """Upstream's ``hiragana_normalize``: each pykakasi segment that holds a kanji (U+4E00-U+9FFF) becomes
    its hiragana reading, with a space in front of a reading that starts with は or へ; kana and everything
    else stay as written. The result is NFKD-normalised again. Needs pykakasi (extra ``ja``)."""
    out = []
    for segment in _kakasi().convert(text):
        orig, hira = segment["orig"], segment["hira"]
        if any("\u4e00" <= c <= "\u9fff" for c in orig):
            out.append(" " + hira if hira[:1] in ("\u306f", "\u3078") else hira)
        else:
            out.append(orig)
    return unicodedata.normalize("NFKD", "".join(out))


@functools.lru_cache(maxsize=1)
def _pkuseg_cut() -> Callable[[str], list[str]]:
    try:
        import spacy_pkuseg
    except ImportError as err:
        raise LanguageSupportError(
            "Chinese text needs spacy-pkuseg for word segmentation: pip install 'mlx-chatterbox[zh]'"
        ) from err
    try:
        segmenter = spacy_pkuseg.pkuseg()
    except Exception as err:  # the download raises requests', urllib's or zipfile's own errors
        home = spacy_pkuseg.config.pkuseg_home
        raise LanguageSupportError(
            f"Chinese word segmentation needs spacy-pkuseg's {_PKUSEG_MODEL!r} model, which it downloads on "
            f"first use into {home}, and that failed ({type(err).__name__}: {err}). Run once with internet "
            f"access, or unzip {_PKUSEG_MODEL}.zip (from the explosion/spacy-pkuseg GitHub releases) into "
            f"{os.path.join(home, _PKUSEG_MODEL)} beside the zip itself (PKUSEG_HOME moves {home}), or give "
            "MtlTokenizer a segmenter."
        ) from err
    return segmenter.cut


class MtlTokenizer(GraphemeTokenizer):
    """Text -> token ids for Chatterbox Multilingual, equal to upstream ``MTLTokenizer.encode(text,
    language_id)``.

    No punctuation clean-up happens here: callers apply `mtl_punc_norm` first, as upstream's generate does.
    Build it with `from_folder` (a checkpoint folder) or `from_files`.
    """

    fix = _FIX

    def __init__(
        self,
        tokenizer: Tokenizer,
        cangjie: Mapping[str, str] | None = None,
        *,
        segmenter: Callable[[str], list[str]] | None = None,
        source: str = "<in-memory tokenizer>",
    ) -> None:
        """tokenizer: the built grapheme BPE; cangjie: glyph -> code with index suffix (`read_cangjie`),
        needed only for ``zh``; segmenter: Chinese text -> words (None: spacy-pkuseg's default model, as
        upstream)."""
        super().__init__(tokenizer, source)
        self._cangjie = dict(cangjie) if cangjie is not None else None
        self._segmenter = segmenter
        # The [xx] tags must be added tokens too, or "[fr]" would be cut into "[", "fr", "]".
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self._tagged = {code for code in LANGUAGES if self._is_added(f"[{code}]", vocab)}

    @classmethod
    def from_files(
        cls,
        tokenizer_path: str | os.PathLike[str],
        cangjie_path: str | os.PathLike[str] | None = None,
        *,
        segmenter: Callable[[str], list[str]] | None = None,
    ) -> MtlTokenizer:
        """Load ``grapheme_mtl_merged_expanded_v1.json`` and, for Chinese, ``Cangjie5_TC.json``. Without a
        Cangjie map every language but ``zh`` works; ``zh`` raises `TokenizerError`."""
        tokenizer = cls._read(tokenizer_path, MTL_TOKENIZER_FILE, "tokenizer JSON")
        cangjie = read_cangjie(cangjie_path) if cangjie_path is not None else None
        return cls(tokenizer, cangjie, segmenter=segmenter, source=str(Path(tokenizer_path)))

    @classmethod
    def from_folder(
        cls, folder: str | os.PathLike[str], *, segmenter: Callable[[str], list[str]] | None = None
    ) -> MtlTokenizer:
        """`from_files` on ``folder/grapheme_mtl_merged_expanded_v1.json`` and ``folder/Cangjie5_TC.json``
        (used if present)."""
        folder = Path(folder)
        if not folder.is_dir():
            what = "is a file, not a folder" if folder.exists() else "does not exist"
            raise TokenizerError(f"Tokenizer folder {folder} {what}. {_FIX}")
        cangjie = folder / CANGJIE_FILE
        return cls.from_files(
            folder / MTL_TOKENIZER_FILE, cangjie if cangjie.is_file() else None, segmenter=segmenter
        )

    def preprocess(self, text: str, language: str | None) -> str:
        """The string upstream hands to the BPE, [SPACE]s included (for inspection; `encode` tokenises it)."""
        code = None if language is None or language == "" else check_language(language)
        if code is not None and code not in self._tagged:
            raise TokenizerError(
                f"{self._source} has no [{code}] token, so it cannot tag {LANGUAGES[code]} text. {_FIX}"
            )
        # Python's lower() is not locale-aware: Turkish "İ" becomes "i" + combining dot, as upstream.
        text = unicodedata.normalize("NFKD", text.lower())
        if code == "zh":
            text = self._to_cangjie(text)
        elif code == "ja":
            text = kanji_to_hiragana(text)
        elif code == "ko":
            text = decompose_hangul(text)
        # he, ru: upstream's transforms (dicta_onnx diacritics, russian_text_stresser stress marks) never run
        # in 0.1.7: Dicta() raises TypeError (no model path) and the stresser is not installable, and upstream
        # catches both and goes on with the plain text. So plain text is parity.
        if code is not None:
            text = f"[{code}]{text}"
        return text.replace(" ", SPACE)

    def encode(self, text: str, language: str | None) -> list[int]:
        """Token ids of ``text`` in ``language`` (a code of `LANGUAGES`, any case), without [START]/[STOP].
        None or "" means no language tag, as upstream's ``language_id=None``. Raises `LanguageSupportError`
        when the language's optional package is missing (ja: pykakasi, zh: spacy-pkuseg)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._tok.encode(self.preprocess(text, language)).ids

    def decode(self, ids: list[int]) -> str:
        """The text the ids spell, as upstream's ``decode``: [STOP] and [UNK] dropped, [START] and tags
        kept."""
        return self._decode(ids)

    def _to_cangjie(self, text: str) -> str:
        """Upstream's ``ChineseCangjieConverter``: segment into words joined by spaces, then spell each letter
        (Unicode category Lo) that the map knows as [cj_x] tokens of its code and suffix, closed by [cj_.]."""
        if self._cangjie is None:
            where = Path(self._source).parent if self._source != "<in-memory tokenizer>" else "its folder"
            raise TokenizerError(
                f"Chinese (zh) text needs the Cangjie map {CANGJIE_FILE}, and the tokenizer {self._source} "
                f"was built without one. Put {CANGJIE_FILE} from ResembleAI/chatterbox in {where} "
                "(MtlTokenizer.from_folder reads it from there) or pass cangjie_path to "
                "MtlTokenizer.from_files."
            )
        cut = self._segmenter if self._segmenter is not None else _pkuseg_cut()
        out = []
        # Letters the map lacks (kana, Hangul, unmapped Han) pass through unchanged, as upstream.
        for char in " ".join(cut(text)):
            code = self._cangjie.get(char) if unicodedata.category(char) == "Lo" else None
            out.append(char if code is None else "".join(f"[cj_{c}]" for c in code) + "[cj_.]")
        return "".join(out)
