"""The public entry point: ``TTS.load(folder)`` then ``tts.speech_tokens(text, ...)``.

Text -> speech tokens (T3) is what exists so far; ``generate`` (tokens -> 24 kHz audio) arrives with S3Gen.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from .generation.speech_tokens import drop_invalid_tokens, generate_speech_tokens
from .generation.voice import Voice
from .models.t3 import T3
from .sampling import SamplingParams
from .text import EnTokenizer, punc_norm
from .weights import load_folder


class TTS:
    """A loaded Chatterbox model. Build it with ``TTS.load``."""

    def __init__(self, t3: T3, tokenizer: EnTokenizer, voice: Voice | None, path: Path | None = None):
        self.t3 = t3
        self.tokenizer = tokenizer
        self.builtin_voice = voice
        self.path = path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TTS":
        """Load a folder written by ``mlx_chatterbox.convert`` (``mlx-chatterbox convert``)."""
        folder = load_folder(path)
        return cls(folder.t3, folder.tokenizer, folder.voice, folder.path)

    def text_ids(self, text: str) -> list[int]:
        """Normalise (upstream ``punc_norm``) and tokenize ``text``, without SOT/EOT."""
        if not text.strip():
            raise ValueError("the text is empty; give some words to speak")
        return self.tokenizer.encode(punc_norm(text))

    def speech_tokens(
        self,
        text: str,
        voice: Voice | str | os.PathLike | None = None,
        params: SamplingParams | None = None,
        *,
        seed: int | None = None,
        progress: Callable[[int, int], None] | None = None,
        **knobs: float,
    ) -> np.ndarray:
        """Speech tokens (int32, 25 per second of audio) for ``text``, upstream ``T3.inference`` + post-processing.

        voice: a Voice, a saved voice file, or None for the model's built-in voice.
        params: sampling knobs; keyword knobs (``temperature=0.5``, ...) override single fields.
        seed: makes the draws reproducible; None draws a fresh seed.
        progress: called as progress(tokens_done, max_new_tokens) after every token.
        """
        unknown = sorted(set(knobs) - set(SamplingParams.__dataclass_fields__))
        if unknown:
            raise TypeError(
                f"unknown knob {unknown[0]!r}; the knobs are {', '.join(SamplingParams.__dataclass_fields__)}"
            )
        params = dataclasses.replace(params or SamplingParams(), **knobs)
        ids = self.text_ids(text)
        voice = self._voice(voice)
        key = None if seed is None else mx.random.key(seed)
        raw = []
        for token in generate_speech_tokens(self.t3, voice, ids, params, key=key):
            raw.append(token)
            if progress is not None:
                progress(len(raw), params.max_new_tokens)
        cfg = self.t3.config
        return np.array(
            drop_invalid_tokens(raw, cfg.start_speech_token, cfg.stop_speech_token), dtype=np.int32
        )

    def _voice(self, voice: Voice | str | os.PathLike | None) -> Voice:
        if isinstance(voice, Voice):
            return voice
        if voice is not None:
            return Voice.load(voice)
        if self.builtin_voice is None:
            raise ValueError(f"{self.path} has no built-in voice (no conds.pt was converted); pass a voice")
        return self.builtin_voice
