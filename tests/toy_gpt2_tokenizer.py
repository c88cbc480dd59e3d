"""A small stand-in for Chatterbox-Turbo's GPT-2 tokenizer files, for tests.

The real files (Hugging Face ``ResembleAI/chatterbox-turbo``: vocab.json, merges.txt, added_tokens.json,
special_tokens_map.json, tokenizer_config.json) cannot be downloaded here, and no GPT-2 vocabulary is on disk.
These have the same format and layout: a byte-level BPE whose first ids are the 256 byte symbols, merges
learnt here with ``tokenizers``' trainer from the English text of ``tests/toy_tokenizer.py``,
``<|endoftext|>`` as the last BPE id (GPT-2: 50256), and the 19 tags as added tokens right after it (Turbo:
50257-50275). The tags' order is one seen in a third-party copy of the real added_tokens.json; nothing here
depends on it.

``write_toy_gpt2_tokenizer`` can also write the variants transformers treats differently (flags in
``added_tokens_decoder`` or only the legacy files, special or plain tags, strip flags, BOS, a length limit).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tests.toy_tokenizer import _CORPUS

TAGS = (
    "[laugh]",
    "[chuckle]",
    "[sigh]",
    "[gasp]",
    "[cough]",
    "[clear throat]",
    "[sniff]",
    "[groan]",
    "[shush]",
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
EOT = "<|endoftext|>"
BPE_SIZE = 700  # entries the trainer makes: the 256 byte symbols + merges
VOCAB_SIZE = BPE_SIZE + 1 + len(TAGS)  # + <|endoftext|> + tags; the real files: 50257 + 19 = 50276
MODEL_MAX_LENGTH = 1024  # GPT-2's


@lru_cache(maxsize=1)
def _train() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([_CORPUS], trainer)
    return tokenizer


def _token(content: str, special: bool, normalized: bool, lstrip: bool = False, rstrip: bool = False) -> dict:
    return dict(
        content=content,
        lstrip=lstrip,
        normalized=normalized,
        rstrip=rstrip,
        single_word=False,
        special=special,
    )


def write_toy_gpt2_tokenizer(
    folder: str | Path,
    *,
    decoder: bool = True,
    special_tags: bool = False,
    tag_lstrip: bool = False,
    tag_rstrip: bool = False,
    add_bos_token: bool = False,
    model_max_length: int | None = MODEL_MAX_LENGTH,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write the five tokenizer files into ``folder`` (created if needed); return the folder.

    decoder: tokenizer_config.json carries ``added_tokens_decoder`` (as transformers >= 4.34 saves it); False
        leaves only added_tokens.json + special_tokens_map.json, transformers' legacy layout.
    special_tags: the tags are special tokens (listed as additional special tokens, flagged special).
    tag_lstrip, tag_rstrip: the tags' strip flags (only expressible with ``decoder``).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    trained = _train()
    trained.model.save(str(folder))  # vocab.json + merges.txt, "#version: 0.2" header included
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    if len(vocab) != BPE_SIZE or sorted(vocab.values()) != list(range(BPE_SIZE)):
        raise RuntimeError(f"the trainer made {len(vocab)} entries, expected {BPE_SIZE} without holes")
    vocab[EOT] = BPE_SIZE
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tag_ids = {tag: BPE_SIZE + 1 + i for i, tag in enumerate(TAGS)}
    (folder / "added_tokens.json").write_text(json.dumps(tag_ids), encoding="utf-8")

    special_map: dict[str, Any] = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    if special_tags:
        special_map["additional_special_tokens"] = list(TAGS)
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map), encoding="utf-8")

    config: dict[str, Any] = {
        "add_bos_token": add_bos_token,
        "add_prefix_space": False,
        "bos_token": EOT,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOT,
        "errors": "replace",
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": EOT,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    if decoder:
        table = {str(BPE_SIZE): _token(EOT, special=True, normalized=True)}
        for tag, i in tag_ids.items():
            table[str(i)] = _token(
                tag, special=special_tags, normalized=not special_tags, lstrip=tag_lstrip, rstrip=tag_rstrip
            )
        config["added_tokens_decoder"] = table
        if special_tags:
            config["additional_special_tokens"] = list(TAGS)
    elif tag_lstrip or tag_rstrip:
        raise ValueError("strip flags need the added_tokens_decoder layout")
    config.update(extra_config or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder
