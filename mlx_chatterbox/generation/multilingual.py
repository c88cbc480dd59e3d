"""Chatterbox Multilingual's text -> speech tokens, as ``TTS`` drives every variant (variants.md §5).

The T3 is English's with a 2454-id text vocabulary and the language as a text tag (``MtlTokenizer``), so the
English decode and its batch serve it. The two checkpoints follow the upstream code that ships them:

- ``multilingual`` (``t3_mtl23ls_v2``): upstream 0.1.7, the published package: the alignment analyzer steers
  the stop token (``generate_aligned_speech_tokens``), and the repetition penalty defaults to 2.0.
- ``multilingual-v3`` (``t3_mtl23ls_v3``): upstream HEAD (3f35dfc): no analyzer, the penalty defaults to 1.2,
  and the last token's 960 samples are cut from the audio (upstream calls them an artifact).
- the Single Language Pack (``multilingual-v3-pt-br``, ...: ``variants.PACKS``): v3 finetunes that upstream runs
  through the same HEAD code; each speaks one language, which is their default and the only one accepted.

Where upstream breaks we do not follow it: ids >= 6561 are dropped before S3Gen as English does (upstream
passes them on, and S3Gen fails on them), and a text of 5 tokens or fewer does not crash the analyzer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..models.t3 import T3
from ..sampling import SamplingParams
from ..text import MtlTokenizer, check_language, mtl_punc_norm
from ..text.multilingual import LANGUAGES
from .aligned import generate_aligned_speech_tokens
from .speech_tokens import EnglishSpeech
from .voice import Voice

SAMPLES_PER_TOKEN = 960  # 24 kHz / 25 tokens per second


@dataclass(frozen=True)
class MultilingualParams(SamplingParams):
    """The knobs of ``ChatterboxMultilingualTTS.generate`` in 0.1.7: English's, but the repetition penalty
    defaults to 2.0 (v3's code lowered it back to 1.2, English's, so v3 takes ``SamplingParams``)."""

    repetition_penalty: float = 2.0


class MultilingualSpeech(EnglishSpeech):
    """The multilingual models' text -> speech tokens: upstream's multilingual ``punc_norm`` and tokenizer
    (``language`` required: one of the 23 codes), then English's T3 decode and post-processing; v2 with the
    alignment analyzer, v3 with its audio trim (module docstring); ``language``: a language pack's."""

    def __init__(self, t3: T3, tokenizer: MtlTokenizer, variant: str, language: str | None = None):
        super().__init__(t3, tokenizer)
        self.variant = variant
        self.analyzer = variant == "multilingual"  # v2: upstream 0.1.7's behaviour
        self.params_type = MultilingualParams if self.analyzer else SamplingParams
        # The analyzer reads one request's attention step by step: it cannot run in the server's batch.
        self.batchable = not self.analyzer
        self.language = language  # a language pack's one language (variants.PACK_LANGUAGES)

    def text_ids(self, text: str, language: str | None = None) -> list[int]:
        """Normalised and tokenized ``text`` in ``language`` (its ``[xx]`` tag first), without SOT/EOT. A
        language pack takes its own language only, and by default."""
        if self.language is not None and language not in (None, self.language):
            raise ValueError(
                f"language={language!r}: the {self.variant} model is a finetune for {self.language!r} only; "
                f"leave the language out (or give {self.language!r}), or use multilingual-v3 for other languages"
            )
        language = language or self.language
        if language is None:
            raise ValueError(
                f"the {self.variant} model needs a language (language=): one of "
                f"{', '.join(LANGUAGES)}"
            )
        return self.tokenizer.encode(mtl_punc_norm(text), check_language(language))

    def tokens(
        self, voice: Voice, ids: Sequence[int], params: SamplingParams, key: mx.array | None = None
    ) -> Iterator[int]:
        """Raw speech ids, the stop token included when it comes; v2 with the alignment analyzer."""
        if self.analyzer:
            return generate_aligned_speech_tokens(self.t3, voice, ids, params, key=key)
        return super().tokens(voice, ids, params, key)

    def cut_samples(self, tokens: int) -> int:
        """Samples to cut from the end of a piece's audio of ``tokens`` speech tokens: v3 drops the last
        token's (``wav[: max(1, n - 1) * 960]``), v2 nothing."""
        return SAMPLES_PER_TOKEN if not self.analyzer and tokens > 1 else 0
