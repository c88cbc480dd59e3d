"""Chatterbox's English text tokenizer: a Hugging Face ``tokenizers`` BPE read from ``tokenizer.json``."""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import Tokenizer

START = "[START]"
STOP = "[STOP]"
SPACE = "[SPACE]"
UNK = "[UNK]"

_FIX = "Use the tokenizer.json that ships with the checkpoint (Hugging Face repo ResembleAI/chatterbox)."


class TokenizerError(ValueError):
    """The tokenizer file is missing, unreadable, or does not fit the model."""


class EnTokenizer:
    """Text -> token ids, exactly as upstream ``chatterbox.models.tokenizers.EnTokenizer``.

    No normalisation happens here: callers apply `punc_norm` first, as upstream does.
    """

    def __init__(self, tokenizer: Tokenizer, source: str = "<in-memory tokenizer>") -> None:
        self._tok = tokenizer
        self._source = source
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        for name in (START, STOP):
            if name not in vocab:
                raise TokenizerError(
                    f"{source} has no {name} token, so it is not Chatterbox's tokenizer. {_FIX}"
                )
        # [SPACE] must be an added token: otherwise the pre-tokenizer would split the literal "[SPACE]" into
        # "[", "SPACE", "]" and every space would silently become three wrong tokens.
        if tokenizer.encode(SPACE, add_special_tokens=False).ids != [vocab.get(SPACE)]:
            raise TokenizerError(
                f"{source} has no {SPACE} special token, so it is not Chatterbox's tokenizer. {_FIX}"
            )
        self._start_id = vocab[START]
        self._stop_id = vocab[STOP]
        # The id range an embedding table must cover (not the entry count, in case ids have holes).
        self._vocab_size = max(vocab.values()) + 1

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> EnTokenizer:
        """Load a Hugging Face ``tokenizer.json``."""
        path = Path(path)
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise TokenizerError(f"Tokenizer file {path} {what}. Pass the path of tokenizer.json. {_FIX}")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # ``tokenizers`` raises a bare Exception for any parse failure
            raise TokenizerError(f"{path} is not a valid tokenizer.json ({err}). {_FIX}") from err
        return cls(tokenizer, source=str(path))

    @property
    def start_id(self) -> int:
        return self._start_id

    @property
    def stop_id(self) -> int:
        return self._stop_id

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without [START]/[STOP]."""
        # Spaces become the literal [SPACE], which the tokenizer matches as an added token before its
        # whitespace pre-tokenizer (which would otherwise drop them) runs.
        return self._tok.encode(text.replace(" ", SPACE)).ids

    def decode(self, ids: list[int]) -> str:
        """Inverse of `encode`, as upstream's ``decode``: [STOP] and [UNK] are dropped, [START] is kept."""
        # Upstream joins the tokens with spaces and then deletes every space, so a " " token vanishes too.
        text = "".join(self._tok.id_to_token(i) or "" for i in ids).replace(" ", "")
        return text.replace(SPACE, " ").replace(STOP, "").replace(UNK, "")

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
            raise TokenizerError(f"{self._source} does not fit this model: {'; '.join(problems)}. {_FIX}")
