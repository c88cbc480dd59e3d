"""A small stand-in for Chatterbox's English ``tokenizer.json``, for tests and demos.

The real file (Hugging Face ``ResembleAI/chatterbox``) cannot be downloaded here. This one has the same
shape: a ``tokenizers`` BPE with no normaliser (case-sensitive), a ``Whitespace`` pre-tokenizer, no
post-processor or decoder, unknown characters mapped one by one to ``[UNK]`` (``fuse_unk`` off), and ids
without holes: the control tokens first, single characters up to 254, ``[START]`` at 255, merged pieces
after it. Its merges are learnt here, deterministically, from a small built-in English text.
"""

from __future__ import annotations

import collections
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

# Ids as in the real file (the T3 config's stop/start text tokens are 0 and 255).
CONTROL_TOKENS = {"[STOP]": 0, "[UNK]": 1, "[SPACE]": 2, "[PAD]": 3, "[SEP]": 4, "[CLS]": 5, "[MASK]": 6}
START_TOKEN, START_ID = "[START]", 255
MAX_MERGES = 200

_CORPUS = """
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of
foolishness. There is nothing either good or bad, but thinking makes it so. All that glitters is not gold.
To be, or not to be, that is the question. I think, therefore I am. The rain in Spain stays mainly in the
plain. Hello there! How are you doing today? I'm doing well, thank you. Where are we going this evening?
Speech synthesis turns written text into spoken words. This model speaks English with a natural voice,
and the voice can be cloned from a short reference recording. Numbers like 1, 2, 3 and 2024 appear too.
Nothing is impossible when you believe in something and work for it every single day. The weather is
nice this morning, so we will walk through the park and then have breakfast at the little cafe.
Once upon a time there lived a king who had three daughters. The youngest was the kindest of them all,
and the king loved her more than anything in the whole kingdom. One morning she went walking in the
forest, where she found a golden ball lying beside the well. "What a wonderful thing," she said, "I shall
keep it forever." But the ball slipped from her hands and rolled into the water, and she began to cry.
Please remember to bring your umbrella; the forecast says it will be raining this afternoon. We're
meeting at the station at half past four, then taking the train into the city. Don't be late!
Science is the systematic study of the structure and behaviour of the physical and natural world
through observation and experiment. Students learn reading, writing, mathematics and history.
"""


def _learn_merges(words: collections.Counter[str], limit: int) -> list[tuple[str, str]]:
    """Classic BPE: repeatedly merge the most frequent adjacent pair (ties: smallest pair first)."""
    splits = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < limit:
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for word, parts in splits.items():
            for pair in zip(parts, parts[1:]):
                pairs[pair] += words[word]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        for word, parts in splits.items():
            i, merged = 0, []
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            splits[word] = merged
    return merges


def build_toy_tokenizer() -> Tokenizer:
    vocab = dict(CONTROL_TOKENS)
    # Printable ASCII, then Latin-1 and Latin Extended-A letters and signs to fill the ids up to 254.
    chars = [chr(c) for c in range(0x21, 0x7F)] + [chr(c) for c in range(0xA1, 0x100) if c != 0xAD]
    chars += [chr(c) for c in range(0x100, 0x180)]
    for ch in chars[: START_ID - len(vocab)]:
        vocab[ch] = len(vocab)
    vocab[START_TOKEN] = START_ID

    pre = pre_tokenizers.Whitespace()
    words = collections.Counter(piece for piece, _ in pre.pre_tokenize_str(_CORPUS))
    merges = _learn_merges(words, MAX_MERGES)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))  # ids 0..255 are all taken, so this stays hole-free

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="[UNK]", fuse_unk=False))
    tokenizer.pre_tokenizer = pre
    specials = sorted([*CONTROL_TOKENS, START_TOKEN], key=vocab.__getitem__)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer


def write_toy_tokenizer(path: str | Path) -> Path:
    """Write the toy ``tokenizer.json`` to ``path`` (a file, or a directory to put one in); return its path."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    build_toy_tokenizer().save(str(path))
    return path
