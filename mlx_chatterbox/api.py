"""The public entry point: ``TTS.load(folder)``, then ``tts.generate(text)`` (text -> 24 kHz audio), or its two
halves ``tts.speech_tokens(text)`` (T3) and ``tts.vocode(tokens)`` (S3Gen); ``tts.voice("me.wav")`` clones a voice,
``tts.convert_voice("src.wav", voice)`` re-speaks a recording in another voice.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import mlx.core as mx
import numpy as np

from . import _backend
from .convert import DEFAULT_REPO, prepare
from .generation import vc
from .generation.multilingual import MultilingualParams
from .generation.pieces import TOKENS_PER_SECOND, Plan, join_audio, plan_text, token_budget
from .generation.stream import CHUNK
from .generation.stream import CONTEXT as STREAM_CONTEXT
from .generation.stream import (
    FIRST_CHUNK,
    MAX_FIRST_CHUNK,
    Piece,
    check_chunks,
    check_context,
    join_pieces,
    stream_piece,
)
from .generation.vc import check_decoder as check_vc_decoder
from .generation.vocode import SAMPLE_RATE, check_cfm_steps, check_tokens, vocode_tokens
from .generation.voice import (
    REFERENCE_HINT,
    S3_SR,
    S3GEN_SR,
    Voice,
    VoiceCloner,
    check_recording,
    read_recording,
)
from .generation.watermark import Watermarker
from .sampling import SamplingParams, seed_keys
from .text import LANGUAGES, check_language
from .text.pauses import split_pauses
from .variants import ModelConfig
from .weights import ModelFolder, load_folder

if TYPE_CHECKING:
    from .hybrid import TorchS3Gen

# The public surface; the multilingual names are re-exported for the CLI and for users (``language=``),
# ``split_pauses`` for the CLI's check of pause tags before the model loads, and the first chunks' bounds for
# ``serve --first-chunk`` and for users (``TTS.stream(first_chunk=)``).
__all__ = [
    "TTS",
    "Progress",
    "Voice",
    "SamplingParams",
    "MultilingualParams",
    "LANGUAGES",
    "check_language",
    "check_vc_decoder",
    "read_reference",
    "read_source",
    "CFM_DTYPES",
    "TOKENS_PER_SECOND",
    "VOICE_SUFFIX",
    "split_pauses",
    "FIRST_CHUNK",
    "MAX_FIRST_CHUNK",
]
VOICE_SUFFIX = ".safetensors"
CFM_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}  # float16 overflowed (ADR 6)
CROSSFADE = 960  # samples (40 ms) shared by consecutive pieces of a long text
logger = logging.getLogger(__name__)


def read_reference(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """A reference recording read and checked as ``TTS.voice`` reads one, before any model loads: its (L,)
    float32 samples and their rate (24 kHz), for ``tts.voice(*read_reference(path))``. (Turbo's and Nano's
    longer minimum is the model's to check.)"""
    wav = read_recording(path, None, S3GEN_SR)
    check_recording(wav, S3GEN_SR, "the reference", REFERENCE_HINT)
    return wav, S3GEN_SR


def read_source(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """A voice conversion source read and checked as ``TTS.convert_voice`` reads one, before any model loads:
    its (L,) float32 samples and their rate (16 kHz), for ``convert_voice(wav, voice, sample_rate=rate)``."""
    wav = read_recording(path, None, S3_SR)
    check_recording(wav, S3_SR, "the source")
    return wav, S3_SR


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where a ``generate`` or ``speech_tokens`` call is, as handed to its ``progress`` callback.

    piece, pieces: the piece being spoken (1-based) and how many the text was split into.
    stage: "tokens" (T3: ``done`` speech tokens so far, of at most ``total``, the piece's budget) or "vocode"
        (S3Gen: ``done`` 0 when it starts, 1 when the piece's audio is ready; ``total`` 1).
    """

    piece: int
    pieces: int
    stage: str
    done: int
    total: int


class TTS:
    """A loaded Chatterbox model. Build it with ``TTS.load``."""

    sample_rate = SAMPLE_RATE

    def __init__(self, folder: ModelFolder, torch_s3gen: "TorchS3Gen | None" = None):
        self.folder = folder
        self.torch_s3gen = torch_s3gen
        self.path = folder.path
        self.t3 = folder.t3
        self.speech = folder.speech  # the variant's text -> speech tokens (generation/speech_tokens.py)
        self.s3gen = folder.s3gen
        self.tokenizer = folder.tokenizer
        self.builtin_voice = folder.voice
        self._cloner: VoiceCloner | None = None
        self._watermarker: Watermarker | None = None

    @classmethod
    def load(
        cls,
        source: str | os.PathLike = DEFAULT_REPO,
        *,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        variant: str | None = None,
        config: ModelConfig | None = None,
        dtype: str | None = None,
        quantize: int | None = None,
        q_group_size: int = 64,
        s3gen: str = "mlx",
        cfm_dtype: str = "float32",
    ) -> "TTS":
        """Load a model: a folder written by ``convert``, or an upstream checkpoint (a local folder, or a Hugging
        Face repo id, ``ResembleAI/chatterbox`` by default) that is converted on first use and cached
        (``convert.prepare``: ``revision`` pins a Hub branch, tag or commit; ``variant`` picks the model of a
        source holding several, e.g. ``"multilingual-v3"`` of ``ResembleAI/chatterbox``; ``cache_dir``,
        ``config`` and T3's precision, ``dtype``/``quantize``/``q_group_size``, as there; a converted folder
        keeps its own).

        s3gen: "mlx" (ours), or "torch" for hybrid mode: upstream's PyTorch S3Gen vocodes our MLX speech tokens
        (``pip install mlx-chatterbox[hybrid]``; see ``hybrid.py``).
        cfm_dtype: "float32" (upstream's numbers), or "bfloat16" to run the CFM estimator in bf16: 1.3x faster
            flow matching on an H200 (1.4x per CFM step, 1.2x for S3Gen), mel within 2e-2 relative L2 of fp32
            (benchmarks/RESULTS.md).
        """
        if s3gen not in ("mlx", "torch"):
            raise ValueError(f"s3gen={s3gen!r}: choose 'mlx' or 'torch'")
        if cfm_dtype not in CFM_DTYPES:
            raise ValueError(f"cfm_dtype={cfm_dtype!r}: choose one of {', '.join(CFM_DTYPES)}")
        if cfm_dtype != "float32" and s3gen == "torch":
            raise ValueError("cfm_dtype applies to our S3Gen; hybrid mode (s3gen='torch') runs upstream's")
        if (slow_blas := _backend.reference_blas_warning()) is not None:
            logger.warning(slow_blas)
        folder = load_folder(
            prepare(
                source,
                revision=revision,
                cache_dir=cache_dir,
                variant=variant,
                config=config,
                dtype=dtype,
                quantize=quantize,
                q_group_size=q_group_size,
            )
        )
        if cfm_dtype != "float32":
            folder.s3gen.estimator.set_dtype(CFM_DTYPES[cfm_dtype])
            mx.eval(folder.s3gen.estimator.parameters())  # materialised here: see weights._load_network
        torch_s3gen = None
        if s3gen == "torch" and folder.networks.variant != "english":
            raise ValueError(
                f"hybrid mode (s3gen='torch') runs upstream's English S3Gen; this is a {folder.networks.variant} "
                "model: leave s3gen at 'mlx'"
            )
        if s3gen == "torch":
            from .hybrid import TorchS3Gen  # imports torch: only in hybrid mode

            torch_s3gen = TorchS3Gen.load(folder.config["source"])
        return cls(folder, torch_s3gen)

    def voice(self, audio: str | os.PathLike | np.ndarray, sample_rate: int | None = None) -> Voice:
        """Clone a voice from a recording of one speaker (upstream ``prepare_conditionals``; 5-10 s of clean
        speech works best, only the first 10 s are used for S3Gen and 6 s for T3's prompt).

        audio: an audio file (wav, flac, ogg, mp3, ... read as ``librosa.load`` does: channels averaged,
        resampled to 24 kHz), or mono float samples in [-1, 1] with their ``sample_rate``.
        Save the result with ``voice.save(path)`` and pass the path (or the Voice) as ``voice=`` later.
        """
        return self._voice_cloner()(read_recording(audio, sample_rate, S3GEN_SR))

    def _voice_cloner(self) -> VoiceCloner:
        if self._cloner is None:
            load = self.folder.load
            self._cloner = self.speech.cloner(load("voice_encoder"), load("s3tokenizer"), load("campplus"))
        return self._cloner

    def convert_voice(
        self,
        source: str | os.PathLike | np.ndarray,
        voice: Voice | str | os.PathLike | None = None,
        *,
        sample_rate: int | None = None,
        cfm_steps: int | None = None,
        seed: int | None = None,
        watermark: bool = True,
        progress: Callable[[Progress], None] | None = None,
    ) -> np.ndarray:
        """Voice conversion, upstream ``ChatterboxVC.generate``: the speech of ``source`` re-synthesised in
        ``voice`` -> float32 mono waveform at ``sample_rate`` (24 kHz), 960 samples per 40 ms of source,
        watermarked as upstream (``watermark``).

        source: an audio file, or mono float samples with their ``sample_rate``, read as ``voice`` reads a
            reference (at 16 kHz here, as upstream); at least 0.5 s, not silent.
        voice: the target, as for ``vocode``; its S3Gen prompt (tokens, mel, x-vector) sets the timbre.
        cfm_steps, seed: as for ``vocode``. A source over 40 s is vocoded in pieces with seed s + i for piece i
            (``generation.vc``); up to 40 s this is ``vocode(tokens, voice, ...)`` of the source's S3 tokens.
        progress: called with a ``Progress`` ("vocode" stage) around every piece's vocoding.
        English and multilingual models only: Turbo/Nano's meanflow S3Gen has no voice conversion upstream."""
        check_vc_decoder(self.speech.variant, self.s3gen.estimator.config.meanflow)
        check_cfm_steps(cfm_steps)
        wav_16k = read_recording(source, sample_rate, S3_SR)
        check_recording(wav_16k, S3_SR, "the source")
        voice = self._voice(voice)
        tokens = vc.source_tokens(self._voice_cloner().s3tokenizer, wav_16k)
        spans = vc.pieces(len(tokens))
        if len(spans) > 1:
            logger.info("vocoding the source's %d speech tokens in %d pieces", len(tokens), len(spans))
        wavs = []
        for i, (a, b) in enumerate(spans):
            if progress is not None:
                progress(Progress(i + 1, len(spans), "vocode", 0, 1))
            piece_seed = None if seed is None else seed + i
            wavs.append(
                self.vocode(tokens[a:b], voice, cfm_steps=cfm_steps, seed=piece_seed, watermark=False)
            )
            if progress is not None:
                progress(Progress(i + 1, len(spans), "vocode", 1, 1))
        wav = vc.join(wavs, spans)
        return self._mark(wav) if watermark else wav

    def text_ids(self, text: str, language: str | None = None) -> list[int]:
        """Normalise (upstream ``punc_norm`` of the variant) and tokenize ``text``, without SOT/EOT.
        language: for the multilingual models (required there), one of ``mlx_chatterbox.text.LANGUAGES``."""
        if not text.strip():
            raise ValueError("the text is empty; give some words to speak")
        return self.speech.text_ids(text, language)

    def speech_tokens(
        self,
        text: str,
        voice: Voice | str | os.PathLike | None = None,
        params: SamplingParams | None = None,
        *,
        language: str | None = None,
        seed: int | None = None,
        progress: Callable[[Progress], None] | None = None,
        **knobs: float,
    ) -> np.ndarray:
        """Speech tokens (int32, 25 per second of audio) for ``text`` in one T3 pass, upstream ``T3.inference`` +
        post-processing. Logs a warning when T3 stops at ``max_new_tokens`` without its stop token (the speech
        may be cut off); ``generate`` splits long text instead.

        voice: a Voice, a saved voice file (.safetensors), a recording to clone (any other file), or None for
            the model's built-in voice.
        params: sampling knobs; keyword knobs (``temperature=0.5``, ...) override single fields.
        language: the text's language, for the multilingual models (required there; see ``text_ids``).
        seed: makes the draws reproducible; None draws a fresh seed.
        progress: called with a ``Progress`` after every token.
        """
        params = self._params(params, knobs)
        self.speech.check(params)
        if any(isinstance(part, int) for part in split_pauses(text, self.sample_rate)):
            raise ValueError(
                "the text has pause tags, which are silences in audio: speak it with generate or stream"
            )
        ids = self.text_ids(text, language)
        tokens, stopped = self._speech_tokens(ids, self._voice(voice), params, seed, progress, 1, 1)
        if not stopped:
            logger.warning(
                "T3 stopped at max_new_tokens=%d (%.1f s) without its stop token: the speech may be cut off",
                params.max_new_tokens,
                params.max_new_tokens / TOKENS_PER_SECOND,
            )
        return tokens

    def _speech_tokens(
        self,
        ids: list[int],
        voice: Voice,
        params: SamplingParams,
        seed: int | None,
        progress: Callable[[Progress], None] | None,
        piece: int,
        pieces: int,
    ) -> tuple[np.ndarray, bool]:
        """``speech_tokens`` for piece ``piece`` of ``pieces`` (its text ids), and whether T3 gave its stop
        token."""
        key = None if seed is None else seed_keys(seed)[0]
        raw = []
        for token in self.speech.tokens(voice, ids, params, key=key):
            raw.append(token)
            if progress is not None:
                progress(Progress(piece, pieces, "tokens", len(raw), params.max_new_tokens))
        tokens = self.speech.finish(raw)
        return np.array(tokens, dtype=np.int32), self.speech.stop_token in raw

    def vocode(
        self,
        tokens: np.ndarray | list[int],
        voice: Voice | str | os.PathLike | None = None,
        *,
        cfm_steps: int | None = None,
        seed: int | None = None,
        watermark: bool = True,
    ) -> np.ndarray:
        """Speech tokens (ids in [0, 6561), 25 per second) -> float32 mono waveform at ``sample_rate`` (24 kHz),
        960 samples per token; upstream ``S3Token2Wav.inference`` with its fade-in, then Perth's implicit
        watermark as upstream ``generate`` adds it (``watermark=False`` leaves it out; perth's iSTFT drops the
        last partial 10 ms frame).

        voice: as for ``speech_tokens``; its S3Gen prompt (tokens, mel, x-vector) sets the timbre.
        cfm_steps: Euler steps of the flow-matching decoder; None = the model's (upstream's 10; Turbo/Nano's 2).
            Fewer is faster and rougher.
        seed: makes the CFM noise and the vocoder's source noise reproducible; None draws fresh ones. (In hybrid
            mode upstream draws them from torch's generator, seeded with ``seed``.)
        """
        ids = np.asarray(tokens)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"tokens must be a 1-d sequence of integer ids, got {ids.dtype} {ids.shape}")
        check_cfm_steps(cfm_steps)
        if self.torch_s3gen is not None:
            check_tokens(mx.array(ids.astype(np.int32)).reshape(1, -1), self.s3gen.flow.config.vocab_size)
            wav = self.torch_s3gen(ids, self._voice(voice), cfm_steps, seed)
        else:
            wav = vocode_tokens(self.s3gen, ids, self._voice(voice), cfm_steps, seed)
        return self._mark(wav) if watermark else wav

    def watermarker(self) -> Watermarker:
        """Perth's implicit watermarker (loaded on first use), e.g. ``tts.watermarker().is_watermarked(wav, 24000)``."""
        if self._watermarker is None:
            self._watermarker = Watermarker.load()
        return self._watermarker

    def _mark(self, wav: np.ndarray) -> np.ndarray:
        return self.watermarker().apply(wav, self.sample_rate)

    def generate(
        self,
        text: str,
        voice: Voice | str | os.PathLike | None = None,
        params: SamplingParams | None = None,
        *,
        language: str | None = None,
        cfm_steps: int | None = None,
        seed: int | None = None,
        watermark: bool = True,
        progress: Callable[[Progress], None] | None = None,
        **knobs: float,
    ) -> np.ndarray:
        """Text -> float32 mono waveform at ``sample_rate`` (24 kHz), watermarked as upstream's (``watermark``).

        The text is spoken in pieces of at most ~20 s of speech (300 characters, digits counted as 4): whole
        sentences packed together, a sentence too long for one piece cut at clause marks, then between words.
        Each piece is ``speech_tokens`` then ``vocode`` with the same arguments, and seed s + i for piece i; its
        T3 pass stops at ``min(max_new_tokens, token_budget(piece))`` tokens (``generation.pieces``: the piece
        read at half the usual pace, plus 2 s), with a logged warning if it gets there without the stop token.
        Pieces are joined with a 40 ms crossfade, and the watermark goes on once, over the whole. So for a short
        text, ``generate(text, seed=s)`` equals ``vocode(speech_tokens(text, seed=s, max_new_tokens=b), seed=s)``
        with b its budget.

        Pause tags in the text, ``[pause:500ms]``, ``[pause:1.5s]`` or ``<break time="500ms"/>`` (at most 10 s
        each; tags in a row add up), become exactly that much silence (rounded to the nearest sample): the
        words on either side are spoken as separate pieces, joined to the silence without a crossfade
        (``generation.pieces.plan_text``; a malformed tag is an error naming it). A text of tags alone is
        silence (unmarked: Perth would only cut its end). Seeds count spoken pieces only: ``"A [pause:1s] B"``
        with seed s is ``"A"`` with seed s, one second of zeros and ``"B"`` with seed s + 1.

        language: the text's language, for the multilingual models (required there; see ``text_ids``). Multilingual
            v3 cuts each piece's last token's 960 samples after vocoding, as upstream HEAD.
        progress: called with a ``Progress`` after every speech token and around every piece's vocoding.
        Every argument is checked before any work."""
        params = self._params(params, knobs)
        self.speech.check(params)  # a cap above the model's limit is an error, even where budgets are lower
        check_cfm_steps(cfm_steps)
        plan = self._plan(text, language)
        pieces = plan.pieces
        voice = self._voice(voice)
        if len(pieces) > 1:
            logger.info("speaking the text in %d pieces", len(pieces))
        wavs = []
        for i, piece in enumerate(pieces, 1):
            piece_seed = None if seed is None else seed + i - 1
            budget = min(params.max_new_tokens, token_budget(piece))
            piece_params = dataclasses.replace(params, max_new_tokens=budget)
            tokens, stopped = self._speech_tokens(
                self.text_ids(piece, language), voice, piece_params, piece_seed, progress, i, len(pieces)
            )
            if not stopped:
                fix = "raise max_new_tokens" if budget == params.max_new_tokens else "try another seed"
                logger.warning(
                    "piece %d of %d stopped at its budget of %d speech tokens (%.1f s) without the stop token: "
                    "its end may be cut off (%s)",
                    i,
                    len(pieces),
                    budget,
                    budget / TOKENS_PER_SECOND,
                    fix,
                )
            if tokens.size == 0:
                raise ValueError("T3 stopped before producing any speech token; try another seed or text")
            if progress is not None:
                progress(Progress(i, len(pieces), "vocode", 0, 1))
            wav = self.vocode(tokens, voice, cfm_steps=cfm_steps, seed=piece_seed, watermark=False)
            wavs.append(wav[: len(wav) - self.speech.cut_samples(tokens.size)])
            if progress is not None:
                progress(Progress(i, len(pieces), "vocode", 1, 1))
        wav = join_audio(wavs, plan, CROSSFADE)
        return self._mark(wav) if watermark and pieces else wav  # silence alone: nothing to mark

    def stream(
        self,
        text: str,
        voice: Voice | str | os.PathLike | None = None,
        params: SamplingParams | None = None,
        *,
        language: str | None = None,
        cfm_steps: int | None = None,
        seed: int | None = None,
        watermark: bool = True,
        first_chunk: int = FIRST_CHUNK,
        chunk: int = CHUNK,
        context: int | Literal["whole"] = STREAM_CONTEXT,
        **knobs: float,
    ) -> Iterator[np.ndarray]:
        """Text -> float32 mono chunks at ``sample_rate`` (24 kHz), yielded while T3 still speaks.

        S3Gen re-decodes the tokens not yet final, behind ``context`` tokens already final, after
        ``first_chunk`` speech tokens, ``chunk`` tokens later, then after chunks that double up to 8 s, and at
        the end (``generation.stream.StreamVocoder``: the first audio after 10 tokens, then 1 s, 2 s, 4 s, 8 s,
        8 s, ... of audio). Long text is split into pieces as ``generate`` does, with the same budgets, seed
        s + i for piece i, 40 ms crossfades between pieces and pause tags' silences (a chunk of zeros each).
        Concatenated, the chunks have the length of ``generate``'s output for the same
        seed (the same speech tokens) and sound alike, but are not equal: the chunked decoding draws its own
        noise tables, and a decode sees neither the tokens to come nor, beyond its window, those before.
        context: the already-final speech tokens each decode re-reads in front of its new ones (default
            ``STREAM_CONTEXT``, 50 = 2 s: a chunk's cost stays bounded however long the piece), or "whole":
            every token so far, closer to ``generate`` (tests/test_stream.py has both bounds) but each decode
            grows with the piece.
        watermark: Perth's watermark is applied to each chunk on its own as it is yielded (each chunk keeps
            its length), not once over the whole as ``generate`` does.
        Every argument is checked before any work; the work starts with the first ``next()``."""
        params = self._params(params, knobs)
        self.speech.check(params)
        check_cfm_steps(cfm_steps)
        check_chunks(first_chunk, chunk, self.s3gen.flow.config.pre_lookahead_len)
        check_context(context)
        if self.torch_s3gen is not None:
            raise ValueError("streaming runs our MLX S3Gen; load the model with s3gen='mlx' to stream")
        plan = self._plan(text, language)
        voice = self._voice(voice)
        if watermark:
            self.watermarker()  # loaded now, so that a missing asset fails before any work
        pieces = []
        for i, piece in enumerate(plan.pieces):
            keys = (None, None) if seed is None else seed_keys(seed + i)
            budget = min(params.max_new_tokens, token_budget(piece))
            piece_params = dataclasses.replace(params, max_new_tokens=budget)
            pieces.append(Piece(self.text_ids(piece, language), piece_params, *keys))
        settings = {"cfm_steps": cfm_steps, "first_chunk": first_chunk, "chunk": chunk, "context": context}
        streams = [
            stream_piece(self.speech, self.s3gen, voice, p, **settings) for p in pieces
        ]  # lazy: no work yet
        chunks = join_pieces(streams, CROSSFADE, plan.pauses)
        return (self._mark_chunk(c) for c in chunks) if watermark else chunks

    def _mark_chunk(self, chunk: np.ndarray) -> np.ndarray:
        """Perth on one chunk, kept at its length: perth's iSTFT may drop up to 10 ms at the end, which is
        put back unmarked so that chunks still join sample for sample."""
        marked = self._mark(chunk)[: len(chunk)]
        return np.concatenate([marked, chunk[len(marked) :]])

    def _params(self, params: SamplingParams | None, knobs: dict[str, float]):
        """``params`` (default: the variant's upstream defaults) with single knobs overridden, each checked; a
        knob the variant does not have (Turbo has no cfg_weight, English no top_k) is an error."""
        kind = self.speech.params_type
        if params is not None and not isinstance(params, kind):
            raise TypeError(f"params must be a {kind.__name__} for the {self.speech.variant} model")
        unknown = sorted(set(knobs) - set(kind.__dataclass_fields__))
        if unknown:
            raise TypeError(
                f"unknown knob {unknown[0]!r} for the {self.speech.variant} model; its knobs are "
                f"{', '.join(kind.__dataclass_fields__)}"
            )
        return dataclasses.replace(params or kind(), **knobs)

    def _plan(self, text: str, language: str | None = None) -> Plan:
        """``text`` as pieces T3 takes and the pause tags' silences; an empty text or a bad tag is refused."""
        return plan_text(text, lambda t: self._fits(t, language), self.sample_rate)

    def _fits(self, text: str, language: str | None = None) -> bool:
        """Whether T3 takes ``text`` in one pass."""
        return self.speech.fits(self.text_ids(text, language))

    def _voice(self, voice: Voice | str | os.PathLike | None) -> Voice:
        """A Voice as given, a saved voice (.safetensors), a recording to clone, or the built-in voice."""
        if isinstance(voice, Voice):
            return voice
        if voice is not None:
            return Voice.load(voice) if Path(voice).suffix.lower() == VOICE_SUFFIX else self.voice(voice)
        if self.builtin_voice is None:
            raise ValueError(f"{self.path} has no built-in voice (no conds.pt was converted); pass a voice")
        return self.builtin_voice
