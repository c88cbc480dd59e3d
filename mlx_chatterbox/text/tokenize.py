"""Chatterbox's text tokenizers: English (a ``tokenizers`` BPE read from ``tokenizer.json``) and Turbo/Nano
(GPT-2's byte-level BPE read from vocab.json + merges.txt + the added-token files)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

START = "[START]"
STOP = "[STOP]"
SPACE = "[SPACE]"
UNK = "[UNK]"

_FIX = "Use the tokenizer.json that ships with the checkpoint (Hugging Face repo ResembleAI/chatterbox)."


class TokenizerError(ValueError):
    """The tokenizer file is missing, unreadable, or does not fit the model."""


class GraphemeTokenizer:
    """What Chatterbox's grapheme tokenizers (English, Multilingual) share: a ``tokenizers`` BPE with [START],
    [STOP] and [SPACE] among its added tokens, and the ids T3 checks it against."""

    fix = _FIX  # the end of every error message: which file to use

    def __init__(self, tokenizer: Tokenizer, source: str = "<in-memory tokenizer>") -> None:
        self._tok = tokenizer
        self._source = source
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        for name in (START, STOP):
            if name not in vocab:
                raise TokenizerError(
                    f"{source} has no {name} token, so it is not Chatterbox's tokenizer. {self.fix}"
                )
        # [SPACE] must be an added token: otherwise the pre-tokenizer would split the literal "[SPACE]" into
        # "[", "SPACE", "]" and every space would silently become three wrong tokens.
        if not self._is_added(SPACE, vocab):
            raise TokenizerError(
                f"{source} has no {SPACE} special token, so it is not Chatterbox's tokenizer. {self.fix}"
            )
        self._start_id = vocab[START]
        self._stop_id = vocab[STOP]
        # The id range an embedding table must cover (not the entry count, in case ids have holes).
        self._vocab_size = max(vocab.values()) + 1

    def _is_added(self, token: str, vocab: dict[str, int]) -> bool:
        """Whether ``token`` is matched whole, as an added token."""
        return token in vocab and self._tok.encode(token, add_special_tokens=False).ids == [vocab[token]]

    @classmethod
    def _read(cls, path: str | os.PathLike[str], name: str, kind: str) -> Tokenizer:
        """The ``tokenizers`` file at ``path`` (which should be ``name``); errors call it a ``kind``."""
        path = Path(path)
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise TokenizerError(f"Tokenizer file {path} {what}. Pass the path of {name}. {cls.fix}")
        try:
            return Tokenizer.from_file(str(path))
        except Exception as err:  # ``tokenizers`` raises a bare Exception for any parse failure
            raise TokenizerError(f"{path} is not a valid {kind} ({err}). {cls.fix}") from err

    @property
    def start_id(self) -> int:
        return self._start_id

    @property
    def stop_id(self) -> int:
        return self._stop_id

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def check_compatible(self, start_text_token: int, stop_text_token: int, text_vocab_size: int) -> None:
        """Raise `TokenizerError` unless this tokenizer's ids fit a T3 with this text config.

        T3 brackets the text with the SOT/EOT ids of its own config, which must be the tokenizer's
        [START]/[STOP], and every id must index T3's text embedding.
        """
        problems = []
        if self._start_id != start_text_token:
            problems.append(
                f"{START} is id {self._start_id} but the model's start-of-text token is {start_text_token}"
            )
        if self._stop_id != stop_text_token:
            problems.append(
                f"{STOP} is id {self._stop_id} but the model's end-of-text token is {stop_text_token}"
            )
        if self._vocab_size > text_vocab_size:
            problems.append(
                f"it has ids up to {self._vocab_size - 1} but the model's text vocabulary has only "
                f"{text_vocab_size} entries"
            )
        if problems:
            raise TokenizerError(f"{self._source} does not fit this model: {'; '.join(problems)}. {self.fix}")

    def _decode(self, ids: list[int]) -> str:
        # Upstream joins the tokens with spaces and then deletes every space, so a " " token vanishes too.
        text = "".join(self._tok.id_to_token(i) or "" for i in ids).replace(" ", "")
        return text.replace(SPACE, " ").replace(STOP, "").replace(UNK, "")


class EnTokenizer(GraphemeTokenizer):
    """Text -> token ids, exactly as upstream ``chatterbox.models.tokenizers.EnTokenizer``.

    No normalisation happens here: callers apply `punc_norm` first, as upstream does.
    """

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> EnTokenizer:
        """Load a Hugging Face ``tokenizer.json``."""
        return cls(cls._read(path, "tokenizer.json", "tokenizer.json"), source=str(Path(path)))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without [START]/[STOP]."""
        # Spaces become the literal [SPACE], which the tokenizer matches as an added token before its
        # whitespace pre-tokenizer (which would otherwise drop them) runs.
        return self._tok.encode(text.replace(" ", SPACE)).ids

    def decode(self, ids: list[int]) -> str:
        """Inverse of `encode`, as upstream's ``decode``: [STOP] and [UNK] are dropped, [START] is kept."""
        return self._decode(ids)


# --- Turbo / Nano: GPT-2 byte-level BPE --------------------------------------------------------------------

# The paralinguistic tags the Turbo checkpoint adds to GPT-2's vocabulary (variants.md §2.4): the nine
# "events" upstream's Turbo demo app offers, and ten "style" tags. Their ids come from the checkpoint's
# files, not from here.
TURBO_EVENT_TAGS = (
    "[clear throat]",
    "[sigh]",
    "[shush]",
    "[cough]",
    "[groan]",
    "[sniff]",
    "[gasp]",
    "[chuckle]",
    "[laugh]",
)
TURBO_STYLE_TAGS = (
    "[whispering]",
    "[angry]",
    "[happy]",
    "[sarcastic]",
    "[surprised]",
    "[fear]",
    "[crying]",
    "[dramatic]",
    "[narration]",
    "[advertisement]",
)

GPT2_VOCAB_FILE = "vocab.json"
GPT2_MERGES_FILE = "merges.txt"
GPT2_CONFIG_FILE = "tokenizer_config.json"
GPT2_ADDED_TOKENS_FILE = "added_tokens.json"
GPT2_SPECIAL_TOKENS_FILE = "special_tokens_map.json"

_TURBO_FIX = (
    "Use the tokenizer files that ship with the checkpoint (vocab.json, merges.txt, added_tokens.json, "
    "special_tokens_map.json, tokenizer_config.json from ResembleAI/chatterbox-turbo or -nano)."
)
# transformers' named special tokens, in the order it adds them; GPT2Tokenizer defaults three of them.
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GPT2_SPECIAL_DEFAULTS = {
    "bos_token": "<|endoftext|>",
    "eos_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>",
}
_ADDED_TOKEN_FIELDS = {"content", "single_word", "lstrip", "rstrip", "normalized", "special"}
_NO_LIMIT = int(1e20)  # transformers: a model_max_length above this means "no limit"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenizerError(f"{path} is not a readable JSON file ({err}). {_TURBO_FIX}") from err


def _added_token(value: Any, where: str) -> AddedToken | str | None:
    """A token as tokenizer_config.json / special_tokens_map.json store it: a string, a serialized AddedToken
    (a dict, possibly tagged ``"__type": "AddedToken"``), or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):
        fields = {k: v for k, v in value.items() if k != "__type"}
        unknown = set(fields) - _ADDED_TOKEN_FIELDS
        if "content" not in fields or unknown:
            raise TokenizerError(
                f"{where}: {value!r} is not a token (unknown fields {sorted(unknown)}). {_TURBO_FIX}"
            )
        return AddedToken(**fields)
    raise TokenizerError(f"{where}: {value!r} is neither a token string nor a token object. {_TURBO_FIX}")


class GPT2Tokenizer:
    """Text -> token ids for Chatterbox-Turbo and -Nano: GPT-2's byte-level BPE plus the checkpoint's added
    tokens (the bracket tags), giving exactly ``AutoTokenizer.from_pretrained(folder)(text).input_ids`` of
    transformers 5.2, as upstream ``ChatterboxTurboTTS`` tokenizes.

    No normalisation happens here (callers apply `turbo_punc_norm` first) and no start/stop text ids are
    added: Turbo's T3 takes the ids as they are. A text longer than the files' ``model_max_length`` is an
    error, where upstream (``truncation=True``) silently drops the tail.
    """

    def __init__(
        self, tokenizer: Tokenizer, max_length: int | None, source: str = "<in-memory tokenizer>"
    ) -> None:
        """tokenizer: a built ``tokenizers.Tokenizer``; max_length: the most ids one text may give (None: no
        limit). Use `from_folder` to build both from a checkpoint."""
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be a positive number of tokens or None, got {max_length!r}")
        self._tok = tokenizer
        self._source = source
        self._max_length = max_length

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> GPT2Tokenizer:
        """Build the tokenizer from a checkpoint folder the way transformers 5.2 does for ``GPT2Tokenizer``.

        Read: vocab.json + merges.txt (the BPE); tokenizer_config.json (``add_prefix_space``,
        ``add_bos_token`` / ``add_eos_token``, ``model_max_length``, ``split_special_tokens``, the special
        tokens, and ``added_tokens_decoder`` with each added token's flags). Only when the config has no
        ``added_tokens_decoder``, transformers' legacy files are read instead: special_tokens_map.json (it
        overrides the config's special tokens) and added_tokens.json (tokens without flags: not stripped,
        normalised unless special).
        """
        folder = Path(folder)
        if not folder.is_dir():
            what = "is a file, not a folder" if folder.exists() else "does not exist"
            raise TokenizerError(f"Tokenizer folder {folder} {what}. {_TURBO_FIX}")
        paths = {name: folder / name for name in (GPT2_VOCAB_FILE, GPT2_MERGES_FILE, GPT2_CONFIG_FILE)}
        missing = [name for name, path in paths.items() if not path.is_file()]
        if missing:
            raise TokenizerError(f"{folder} has no {', '.join(missing)}. {_TURBO_FIX}")
        config = _read_json(paths[GPT2_CONFIG_FILE])
        if not isinstance(config, dict):
            raise TokenizerError(f"{paths[GPT2_CONFIG_FILE]} does not hold a JSON object. {_TURBO_FIX}")
        kind = config.get("tokenizer_class")
        if kind not in (None, "GPT2Tokenizer", "GPT2TokenizerFast"):
            raise TokenizerError(
                f"{paths[GPT2_CONFIG_FILE]} names tokenizer_class {kind!r}; Turbo's tokenizer is "
                f"GPT2Tokenizer. "
                f"{_TURBO_FIX}"
            )

        try:
            vocab, merges = BPE.read_file(str(paths[GPT2_VOCAB_FILE]), str(paths[GPT2_MERGES_FILE]))
        except Exception as err:  # ``tokenizers`` raises a bare Exception for any parse failure
            raise TokenizerError(
                f"{folder}: vocab.json / merges.txt do not parse ({err}). {_TURBO_FIX}"
            ) from err
        # GPT2Tokenizer's BPE: no subword prefix/suffix, no unknown token (every byte is in the alphabet).
        tokenizer = Tokenizer(
            BPE(
                vocab,
                merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
            add_prefix_space=bool(config.get("add_prefix_space", False))
        )
        tokenizer.decoder = decoders.ByteLevel()

        named, extra, declared = cls._special_and_added_tokens(folder, config)
        cls._add_tokens(tokenizer, named, extra, declared)
        # The ids the files declare must be the ids the tokens get: transformers numbers added tokens on from
        # the BPE vocabulary in file order and would silently disagree with a file that has holes or another
        # order.
        for token_id, token in sorted(declared.items()):
            got = tokenizer.token_to_id(token.content)
            if got != token_id:
                raise TokenizerError(
                    f"{folder}: the added token {token.content!r} is declared as id {token_id} but gets id "
                    f"{got} "
                    f"after the {len(vocab)} BPE entries of vocab.json. {_TURBO_FIX}"
                )
        tokenizer.post_processor = cls._template(tokenizer, config, named, folder)
        tokenizer.encode_special_tokens = bool(config.get("split_special_tokens", False))

        limit = config.get("model_max_length", config.get("max_len"))
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit < 1
        ):
            raise TokenizerError(
                f"{paths[GPT2_CONFIG_FILE]}: model_max_length {limit!r} is not a positive length"
            )
        max_length = None if limit is None or limit > _NO_LIMIT else int(limit)
        return cls(tokenizer, max_length, source=str(folder))

    @staticmethod
    def _special_and_added_tokens(
        folder: Path, config: dict[str, Any]
    ) -> tuple[dict[str, AddedToken | str], list[AddedToken | str], dict[int, AddedToken]]:
        """(named special tokens, extra special tokens, {id: added token} the files declare)."""
        where = str(folder / GPT2_CONFIG_FILE)
        named: dict[str, AddedToken | str] = {}
        for key in _SPECIAL_KEYS:
            value = _added_token(config.get(key, _GPT2_SPECIAL_DEFAULTS.get(key)), f"{where} {key}")
            if value is not None:
                named[key] = value
        extra_value = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        if isinstance(extra_value, dict):  # model-specific named tokens: special like the others
            extra_value = list(extra_value.values())
        if not isinstance(extra_value, list):
            raise TokenizerError(f"{where}: extra_special_tokens must be a list or an object. {_TURBO_FIX}")
        extra = [
            t
            for t in (_added_token(v, f"{where} extra_special_tokens") for v in extra_value)
            if t is not None
        ]
        # Other "<name>_token" string entries are special tokens too for transformers.
        for key, value in config.items():
            if key.endswith("_token") and key not in _SPECIAL_KEYS and isinstance(value, (str, dict)):
                token = _added_token(value, f"{where} {key}")
                if token is not None:
                    extra.append(token)

        declared: dict[int, AddedToken] = {}
        if "added_tokens_decoder" in config:
            table = config["added_tokens_decoder"]
            if not isinstance(table, dict):
                raise TokenizerError(f"{where}: added_tokens_decoder must be an object. {_TURBO_FIX}")
            for key, value in table.items():
                token = _added_token(value, f"{where} added_tokens_decoder[{key}]")
                if not isinstance(token, AddedToken) or not str(key).isdigit():
                    raise TokenizerError(
                        f"{where}: added_tokens_decoder[{key!r}] is not an id -> token entry"
                    )
                declared[int(key)] = token
            return named, extra, declared

        # Legacy layout (no added_tokens_decoder): special_tokens_map.json, then added_tokens.json.
        special_map = folder / GPT2_SPECIAL_TOKENS_FILE
        if special_map.is_file():
            mapping = _read_json(special_map)
            if not isinstance(mapping, dict):
                raise TokenizerError(f"{special_map} does not hold a JSON object. {_TURBO_FIX}")
            for key, value in mapping.items():
                if key == "extra_special_tokens" and isinstance(value, list):
                    for v in value:
                        token = _added_token(v, f"{special_map} {key}")
                        if isinstance(token, AddedToken):
                            token.special = True
                        if token is not None and token not in extra:
                            extra.append(token)
                elif key in _SPECIAL_KEYS or (key.endswith("_token") and isinstance(value, (str, dict))):
                    token = _added_token(value, f"{special_map} {key}")
                    if isinstance(token, AddedToken):
                        token.special = True
                    if key not in _SPECIAL_KEYS:
                        if token is not None:
                            extra.append(token)
                    elif token is None:
                        named.pop(key, None)
                    else:
                        named[key] = token
                # Anything else, "additional_special_tokens" included, transformers 5.2 reads from this file
                # and then drops: those tokens are not made special (added_tokens.json still adds them).

        added = folder / GPT2_ADDED_TOKENS_FILE
        if added.is_file():
            table = _read_json(added)
            if not isinstance(table, dict) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in table.values()
            ):
                raise TokenizerError(f"{added} must map each token to an integer id. {_TURBO_FIX}")
            specials = {str(t) for t in named.values()} | {str(t) for t in extra}
            for content, token_id in table.items():
                special = content in specials
                declared[token_id] = AddedToken(
                    content,
                    single_word=False,
                    lstrip=False,
                    rstrip=False,
                    normalized=not special,
                    special=special,
                )
        return named, extra, declared

    @staticmethod
    def _add_tokens(
        tokenizer: Tokenizer,
        named: dict[str, AddedToken | str],
        extra: list[AddedToken | str],
        declared: dict[int, AddedToken],
    ) -> None:
        """One ``add_tokens`` call, in transformers' order: the declared tokens by id, then the special tokens
        not among them (a plain string becomes a special, unnormalised token; a named one is marked special).
        """
        tokens: list[AddedToken | str] = [declared[i] for i in sorted(declared)]
        present = {str(t) for t in tokens}
        for value in [*named.values(), *extra]:
            if str(value) not in present and value not in tokens:
                tokens.append(value)
        names = {str(v) for v in named.values()}
        final = []
        for token in tokens:
            if isinstance(token, str):
                token = AddedToken(token, special=True)
            elif not token.special and token.content in names:
                token.special = True
            final.append(token)
        if final:
            tokenizer.add_tokens(final)

    @staticmethod
    def _template(
        tokenizer: Tokenizer, config: dict[str, Any], named: dict[str, AddedToken | str], folder: Path
    ) -> processors.TemplateProcessing:
        """What transformers adds around the ids: a BOS and/or EOS only if the config asks (GPT-2:
        neither)."""
        ends = []
        for flag, key in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
            if config.get(flag, False):
                if key not in named:
                    raise TokenizerError(
                        f"{folder / GPT2_CONFIG_FILE} sets {flag} but has no {key}. {_TURBO_FIX}"
                    )
                content = str(named[key])
                ends.append((flag, content, tokenizer.token_to_id(content)))
        bos = [e for e in ends if e[0] == "add_bos_token"]
        eos = [e for e in ends if e[0] == "add_eos_token"]

        def side(seq: str, type_id: int) -> str:
            parts = (
                [f"{c}:{type_id}" for _, c, _ in bos]
                + [f"${seq}:{type_id}"]
                + [f"{c}:{type_id}" for _, c, _ in eos]
            )
            return " ".join(parts)

        special = [(c, i) for _, c, i in ends]
        return processors.TemplateProcessing(
            single=side("A", 0), pair=f"{side('A', 0)} {side('B', 1)}", special_tokens=special
        )

    @property
    def max_length(self) -> int | None:
        """The most ids one text may give (the files' ``model_max_length``), None for no limit."""
        return self._max_length

    @property
    def vocab_size(self) -> int:
        """Entries including the added tokens (transformers' ``len(tokenizer)``)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def added_tokens(self) -> dict[str, int]:
        """The added tokens (the tags, ``<|endoftext|>``) and their ids."""
        return {t.content: i for i, t in sorted(self._tok.get_added_tokens_decoder().items())}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``. Raises ValueError when they exceed `max_length` (upstream would cut
        them)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self._tok.encode(text).ids
        if self._max_length is not None and len(ids) > self._max_length:
            raise ValueError(
                f"the text is {len(ids)} tokens long, more than the tokenizer's limit of {self._max_length} "
                f"(model_max_length in {self._source}); upstream would silently drop the tokens past it. "
                "Split the text into shorter pieces (generate does this for long text)."
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        """The text the ids spell, added tokens included (transformers' ``decode`` with its defaults)."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def check_compatible(self, text_vocab_size: int) -> None:
        """Raise `TokenizerError` unless this tokenizer's ids are exactly the rows of T3's text embedding
        (Turbo and Nano: 50276 = GPT-2's 50257 + 19 tags). Upstream only prints a warning on a mismatch."""
        size = self.vocab_size
        top = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        problems = []
        if size != text_vocab_size:
            problems.append(f"it has {size} tokens but the model's text vocabulary has {text_vocab_size}")
        if top != size:
            problems.append(f"its ids run up to {top - 1} with holes ({size} tokens)")
        if problems:
            raise TokenizerError(
                f"{self._source} does not fit this model: {'; '.join(problems)}. {_TURBO_FIX}"
            )
