"""Streaming synthesis: 24 kHz audio chunks while T3's speech tokens still arrive (perf-serving.md §4.5).

S3Gen's flow encoder and CFM attend over the whole utterance, so nothing is cached between chunks: every
chunk re-decodes the voice prompt and a window of the tokens before it (``context``: ``CONTEXT`` tokens by
default, so a chunk's cost does not grow with the utterance; or all of them, "whole") into a mel, with one
fixed noise table for the utterance, sliced at the window's offset, so that re-decoded frames barely move.
HiFT then vocodes only the frames not yet final (plus a little left context), continuing the sine source of
the previous chunk, and a short crossfade hides what moved.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import mlx.core as mx
import numpy as np

from ..models.cfm import Steps, drain
from ..sampling import SamplingParams
from .speech_tokens import EnglishSpeech
from .vocode import (
    SAMPLE_RATE,
    SAMPLES_PER_TOKEN,
    Draws,
    S3Gen,
    check_cfm_steps,
    crossfade_join,
    fade_in,
    stack_padded,
)
from .voice import Voice

logger = logging.getLogger(__name__)

# HiFT is not causal: its convolutions (conv_pre, the F0 predictor, the resblocks) reach ~13 mel frames either
# way, most of it within a few frames. So each chunk vocodes HIFT_CONTEXT already-final frames in front of the
# new ones, and holds back its last HIFT_HOLDBACK frames, whose right context is still to come.
HIFT_CONTEXT = 8  # mel frames (20 ms each)
HIFT_HOLDBACK = 6  # mel frames
CROSSFADE = 480  # samples (20 ms) where a chunk's re-vocoded head meets the previous chunk's held-back tail
CFM_NOISE_BLOCK = 250  # mel frames per drawn block of the CFM noise table (5 s)
SOURCE_NOISE_BLOCK = 24000  # samples per drawn block of the sine source's noise table (1 s)
MAX_CHUNK = 200  # speech tokens (8 s): the chunks stop doubling here
FIRST_CHUNK = 10  # speech tokens before the first decode (0.14 s of audio)
CHUNK = 25  # speech tokens after it before the second (1 s)
# The most tokens ``playback_first_chunk`` waits for before the first decode (2 s of T3's time at real time).
MAX_FIRST_CHUNK = 50
# Speech tokens (2 s) already final that a decode re-reads in front of the frames it vocodes, after the voice
# prompt; the tokens before them are left out. A tiny S3Gen at MLX's default init, 10 s prompt, 400 tokens
# (tests/test_stream.py): the streamed mel's relative L2 from the one-shot mel is 8.7e-3 at 50, 1.0e-2 at 10,
# 4.0e-2 at 0, 7.4e-3 with the whole prefix (what it misses is mostly the tokens to come, which no chunk has).
CONTEXT = 50


def check_context(context: int | Literal["whole"]) -> None:
    """A decode's window of already-final tokens: an integer >= 0, or "whole" (every token so far, as before
    windows: a little nearer the one-shot mel, but a decode's cost grows with the utterance)."""
    if context == "whole":
        return
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(
            f"context={context!r} must be a number of speech tokens >= 0 (default {CONTEXT}), or 'whole'"
        )


def check_chunks(first_chunk: int, chunk: int, lookahead: int = 3) -> None:
    """Chunk sizes in speech tokens: integers, the first large enough to leave audio once the last
    ``lookahead`` tokens are held back for their lookahead and HiFT's holdback is taken off."""
    least = min_first_chunk(lookahead)
    for name, value, low in (("first_chunk", first_chunk, least), ("chunk", chunk, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r} must be an integer number of speech tokens")
        if value < low:
            why = "a chunk holds at least one token"
            if name == "first_chunk":
                why = f"the last {lookahead} wait for their lookahead, HiFT holds back {HIFT_HOLDBACK} frames"
            raise ValueError(f"{name}={value} is too small: it must be >= {low} ({why})")


def min_first_chunk(lookahead: int) -> int:
    """The fewest tokens whose non-final decode yields audio: 2 frames a token (one fewer after an odd prompt
    mel) for the tokens before the lookahead must cover HiFT's holdback, then the crossfade tail (a frame),
    then at least one frame."""
    return lookahead + math.ceil((1 + HIFT_HOLDBACK + 2) / 2)


def first_chunk_seconds(first_chunk: int, lookahead: int = 3) -> float:
    """The audio of a stream's first chunk, in seconds: the first 2·(n - lookahead) - ``HIFT_HOLDBACK`` generated
    frames of 20 ms of a decode at n tokens (``StreamVocoder``), less the held-back crossfade tail."""
    samples = (SAMPLES_PER_TOKEN // 2) * (2 * (first_chunk - lookahead) - HIFT_HOLDBACK) - CROSSFADE
    return samples / SAMPLE_RATE


def playback_first_chunk(gap: float, lookahead: int = 3) -> int:
    """The fewest speech tokens, from ``FIRST_CHUNK`` up to ``MAX_FIRST_CHUNK``, whose first chunk plays for 1.25
    times ``gap``, the seconds from the first chunk to the second (``CHUNK`` tokens of T3, then a decode), so
    that a listener does not wait between them; the later chunks are longer (``StreamVocoder``'s doubling)."""
    n = FIRST_CHUNK
    while n < MAX_FIRST_CHUNK and first_chunk_seconds(n, lookahead) < 1.25 * gap:
        n += 1
    return n


class _NoiseTable:
    """An endless N(0, 1) table of (rows, width), drawn block by block, each block from the next key of a
    split chain: any prefix is the same however far the table has been drawn (a longer mx.random.normal draw
    does not start with a shorter one)."""

    def __init__(self, key: mx.array, width: int, block: int):
        self.key, self.width, self.block = key, width, block
        self.blocks: list[mx.array] = []

    def take(self, start: int, stop: int) -> mx.array:
        """Rows [start, stop) as (1, stop - start, width) float32."""
        while len(self.blocks) * self.block < stop:
            block_key, self.key = mx.random.split(self.key)
            self.blocks.append(mx.random.normal((1, self.block, self.width), key=block_key))
        if stop <= start:
            return mx.zeros((1, 0, self.width))
        first, last = start // self.block, (stop - 1) // self.block
        rows = mx.concatenate(self.blocks[first : last + 1], axis=1)
        offset = first * self.block
        return rows[:, start - offset : stop - offset]


class StreamVocoder:
    """Speech tokens pushed as T3 makes them -> the waveform in final pieces (chunked S3Gen re-decoding).

    Chunk schedule: the first decode runs once ``first_chunk`` tokens have been pushed, the next ``chunk``
    tokens later, and each chunk after that is twice the one before, up to ``MAX_CHUNK`` tokens (or
    ``chunk`` if larger): with the defaults at 10, 35, 85, 185, 385, 585, ... tokens (a push that crosses
    several boundaries decodes once, with all its tokens); ``finish`` decodes the rest. Doubling spreads
    the cost of re-reading the voice prompt (10 s, 250 tokens, at upstream's sizes) over more audio while
    each decode still finishes well before the audio before it has played. A decode runs the flow encoder
    and the CFM over [voice prompt + the window + the tokens not yet final], the window being the ``context``
    tokens before the first frame HiFT needs (all of them with "whole", whose decodes then grow with the
    utterance: O(n²) over n tokens with constant chunks), with the frames of the last 3 tokens dropped
    (upstream's ``finalize=False``: they wait for their lookahead), then HiFT over the new frames with
    ``HIFT_CONTEXT`` frames of left context, holding back its last ``HIFT_HOLDBACK`` frames and ``CROSSFADE``
    samples that the next decode crossfades with its own. At 2 mel frames (960 samples) a token, the decode at
    n tokens makes final the audio of the first 2·(n - 3) - 6 generated frames (one fewer after an odd prompt
    mel), less the 20 ms tail: with the defaults, 0.14 s after 10 tokens, 1 s more after 35 (0.4 s of audio behind the
    tokens), then 2 s, 4 s, 8 s, ...; ``finish`` gives the rest.

    Randomness: one key (MLX's global generator when None) gives the CFM noise table, the sine source's
    start phases and its noise table, all fixed for the utterance and sliced per decode (a mel frame of the
    utterance gets the same noise row in every decode, wherever the window puts it); ``draws(n)`` returns
    them as a one-shot ``S3Gen.__call__`` of the same n tokens takes them, so the stream can be compared with
    (and is close to) the one-shot result.

    A decode reads at most ``prompt + context + new + lookahead + 8`` tokens, ``new`` being the tokens pushed
    since the decode before (at most ``max(chunk, MAX_CHUNK)`` when pushed one by one); the 8 cover the HiFT
    context and holdback frames re-decoded around the chunk (``max_decode_tokens``).

    ``take``/``end`` are ``push``/``finish`` that leave the decode due (``due``) instead of running it, so that
    ``decode_together`` can run several streams' due decodes in one batched S3Gen call.
    """

    def __init__(
        self,
        s3gen: S3Gen,
        voice: Voice,
        *,
        cfm_steps: int | None = None,
        key: mx.array | None = None,
        first_chunk: int = FIRST_CHUNK,
        chunk: int = CHUNK,
        context: int | Literal["whole"] = CONTEXT,
    ):
        flow = s3gen.flow.config
        check_cfm_steps(cfm_steps)
        check_chunks(first_chunk, chunk, flow.pre_lookahead_len)
        check_context(context)
        self.s3gen, self.voice, self.cfm_steps = s3gen, voice, cfm_steps
        self.first_chunk, self.chunk, self.context = first_chunk, chunk, context
        self._lookahead, self._stride = flow.pre_lookahead_len, flow.upsample_stride
        self._prompt_tokens = voice.s3gen_prompt_tokens.shape[1]
        self._prompt_frames = voice.s3gen_prompt_mel.shape[1]
        hift = s3gen.hift.config
        self._spf, self._harmonics = hift.samples_per_frame, hift.num_harmonics
        if key is None:  # from MLX's global generator, so that mx.random.seed makes it reproducible
            key = mx.random.key(mx.random.randint(0, 2**31 - 1, ()).item())
        cfm_key, source_key = mx.random.split(key)
        phase_key, noise_key = mx.random.split(source_key)
        self._cfm_noise = _NoiseTable(cfm_key, flow.mel_dim, CFM_NOISE_BLOCK)
        self._source_noise = _NoiseTable(noise_key, self._harmonics, SOURCE_NOISE_BLOCK)
        # SineGen's start phases, the fundamental's 0, as HiFT.draw_source draws them.
        phases = mx.random.uniform(-math.pi, math.pi, (1, self._harmonics), key=phase_key)
        self._phases = mx.concatenate([mx.zeros((1, 1)), phases[:, 1:]], axis=1)
        self._tokens: list[int] = []
        self._next = first_chunk  # the token count that triggers the next decode
        self._step = chunk  # the chunk after it
        self._final_frames = 0  # mel frames whose audio is out, but for the held-back tail
        self._tail = np.zeros(0, np.float32)  # the audio just before _final_frames·480, held back
        # HiFT's source over the HIFT_CONTEXT frames before _final_frames, reused by the next decode
        self._source_tail = mx.zeros((1, 0, 1))
        self._cycles = np.zeros(self._harmonics)  # sine phase at _final_frames, in cycles (float64, mod 1)
        self._finished = False
        self._due: _Decode | None = None  # the decode left by take/end, prepared

    @property
    def pushed(self) -> int:
        """How many speech tokens have been pushed."""
        return len(self._tokens)

    def push(self, tokens: Sequence[int]) -> np.ndarray:
        """New speech tokens (valid ids < 6561 only; the caller drops T3's start/stop ids) -> the float32
        samples that are final now (possibly empty, shape (0,))."""
        self.take(tokens)
        return self._decode()

    def finish(self) -> np.ndarray:
        """All remaining samples (finalize). After it, push/finish raise."""
        self.end()
        return self._decode()

    def take(self, tokens: Sequence[int]) -> None:
        """``push`` without its decode: when the tokens cross a chunk boundary, the decode is left due
        (``due``) for ``decode_together``, and no more tokens are taken until it has run."""
        self._check_open()
        self._add(tokens)
        if len(self._tokens) < self._next:
            return
        while self._next <= len(self._tokens):
            self._next += self._step
            self._step = max(self.chunk, min(2 * self._step, MAX_CHUNK))
        self._due = self._prepare(final=False)

    def end(self, tokens: Sequence[int] = ()) -> None:
        """``finish`` without its decode, the last ``tokens`` taken first (any number: the last decode reads them
        all, whatever chunk boundaries they cross): the last decode is left due for ``decode_together``."""
        self._check_open()
        self._add(tokens)
        self._finished = True
        if not self._tokens:
            raise ValueError("no speech tokens were pushed; there is nothing to vocode")
        self._due = self._prepare(final=True)

    def _add(self, tokens: Sequence[int]) -> None:
        ids = np.asarray(tokens)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"tokens must be a 1-d sequence of integer ids, got {ids.dtype} {ids.shape}")
        vocab = self.s3gen.flow.config.vocab_size
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise ValueError(
                f"speech tokens must lie in [0, {vocab}), found {bad}; drop T3's start/stop ids first"
            )
        self._tokens += ids.tolist()

    @property
    def due(self) -> int:
        """The tokens (voice prompt included) that the decode now due reads, its row in a batched S3Gen call;
        0 when no decode is due (none left by ``take``/``end``, or one that would make no audio final)."""
        return 0 if self._due is None else self._prompt_tokens + self._due.tokens.shape[1]

    def draws(self, tokens: int) -> Draws:
        """The random inputs with which a one-shot ``S3Gen.__call__`` of ``tokens`` tokens (the same voice)
        uses this stream's noise tables and phases."""
        frames = self._stride * (self._prompt_tokens + tokens)
        return Draws(
            cfm_noise=self._cfm_noise.take(0, frames),
            phases=self._phases,
            source_noise=self._source_noise.take(0, (frames - self._prompt_frames) * self._spf),
        )

    def max_decode_tokens(self, new: int) -> int | None:
        """The most tokens (voice prompt included) a decode reads when ``new`` tokens were pushed since the
        decode before; None for "whole" (no bound)."""
        if self.context == "whole":
            return None
        # Generated frames [done - HIFT_CONTEXT, ...) are re-decoded; done trails the tokens by the lookahead
        # and the HiFT holdback, and an odd prompt mel moves frames half a token.
        behind = self._lookahead + math.ceil((HIFT_HOLDBACK + HIFT_CONTEXT + 1) / self._stride)
        return self._prompt_tokens + self.context + new + behind

    def _window_start(self, start: int) -> int:
        """The first token a decode reads: ``context`` tokens before generated frame ``start``'s. A window
        from token t yields the generated frames from 2t on (after an odd prompt mel its first token's first
        frame lies under the prompt), so t counts from start // 2, not from the token that holds ``start``."""
        if self.context == "whole":
            return 0
        return max(0, start // self._stride - self.context)

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError("this stream is finished; start a new StreamVocoder for the next utterance")
        if self._due is not None:
            raise RuntimeError("a decode is due: run it (decode_together) before taking more tokens")

    def _decode(self) -> np.ndarray:
        """The due decode, alone (``S3Gen.mel``): the samples it makes final."""
        d, self._due = self._due, None
        if d is None:
            return np.zeros(0, np.float32)
        s3gen = self.s3gen
        mel = s3gen.mel(d.tokens, self.voice, cfm_steps=self.cfm_steps, cfm_noise=d.noise, finalize=d.final)
        return self._settle(d, *_vocode([self], [d], [mel])[0])

    def _prepare(self, final: bool) -> _Decode | None:
        """What a decode at the tokens so far reads and makes final; None when no audio would become final."""
        n = len(self._tokens)
        held = 0 if final else self._lookahead
        mu_frames = self._stride * (self._prompt_tokens + n - held)
        frames = mu_frames - self._prompt_frames  # generated mel frames of this decode
        end = frames if final else frames - HIFT_HOLDBACK  # the audio up to here becomes final
        if end <= self._final_frames and not final:
            return None
        start = max(0, self._final_frames - HIFT_CONTEXT)  # the first frame HiFT reads
        first = self._window_start(start)
        # The window's frames sit 2·first frames earlier than in the utterance: their noise rows go with them.
        prompt_noise = self._cfm_noise.take(0, self._prompt_frames)
        shift = self._stride * first
        noise = self._cfm_noise.take(self._prompt_frames + shift, mu_frames)
        return _Decode(
            tokens=mx.array(self._tokens[first:], dtype=mx.int32)[None],
            noise=mx.concatenate([prompt_noise, noise], axis=1),
            final=final,
            start=start,
            shift=shift,
            frames=frames,
            end=end,
        )

    def _settle(self, d: _Decode, wav: mx.array, freq: mx.array, source: mx.array) -> np.ndarray:
        """``_vocode``'s results read back: the stream's state moved past the decode, and the samples it makes
        final, the crossfade applied."""
        done, spf, start, end = self._final_frames, self._spf, d.start, d.end
        cycles = np.array(freq, dtype=np.float64)[0]  # (frames - done, H)
        self._cycles = (self._cycles + spf * cycles[: end - done].sum(axis=0)) % 1.0
        keep = max(0, end - HIFT_CONTEXT)
        self._source_tail = source[:, (keep - start) * spf : (end - start) * spf]
        audio = np.array(wav[0], dtype=np.float32)
        # Samples [done·spf - len(tail), end·spf) of the utterance; the head overlaps the held-back tail.
        x = len(self._tail)
        new = audio[done * spf - x - start * spf : end * spf - start * spf]
        fade = (1 - np.cos(np.pi * (np.arange(x) + 0.5) / max(x, 1))) / 2  # 0 -> 1
        new[:x] = self._tail * (1 - fade) + new[:x] * fade
        self._final_frames = end
        if d.final:
            self._tail = np.zeros(0, np.float32)
            return new
        self._tail = new[len(new) - CROSSFADE :].copy()
        return new[: len(new) - CROSSFADE]


def _vocode(
    vocoders: Sequence[StreamVocoder], decodes: Sequence[_Decode], mels: Sequence[mx.array]
) -> list[tuple[mx.array, mx.array, mx.array]]:
    """HiFT over each stream's decode segment, all in one call (shorter segments padded and masked), lazily:
    per stream the waveform, the sine's cycles per frame over its new frames, and its source (``_settle``
    reads them back). A single stream runs unpadded."""
    hift = vocoders[0].s3gen.hift
    spf = hift.config.samples_per_frame
    segments = [mel[:, d.start - d.shift : d.frames - d.shift] for d, mel in zip(decodes, mels)]
    sizes = [segment.shape[1] for segment in segments]
    news = [d.frames - v._final_frames for v, d in zip(vocoders, decodes)]  # frames after the HiFT context
    width, new_width = max(sizes), max(news)
    lengths = None if min(sizes) == width else mx.array(sizes, dtype=mx.int32)
    mel = stack_padded(segments, width)
    f0 = hift.predict_f0(mel, lengths)
    # the new frames' f0 of each stream, left-aligned
    f0 = stack_padded([f0[i : i + 1, n - new : n] for i, (n, new) in enumerate(zip(sizes, news))], new_width)
    # The sine continues the phase each stream had at its last final frame; over the context frames, the
    # previous decode's source is reused as it was (upstream's cache_source).
    fresh = hift.source(
        f0,
        phases=mx.concatenate(
            [v._phases + mx.array(2 * math.pi * v._cycles, dtype=mx.float32)[None] for v in vocoders]
        ),
        noise=stack_padded(
            [v._source_noise.take(v._final_frames * spf, d.frames * spf) for v, d in zip(vocoders, decodes)],
            new_width * spf,
        ),
    )
    sources = [
        mx.concatenate([v._source_tail.astype(fresh.dtype), fresh[i : i + 1, : new * spf]], axis=1)
        for i, (v, new) in enumerate(zip(vocoders, news))
    ]
    wav = hift.decode(mel, stack_padded(sources, width * spf), lengths)
    # Cycles per frame as HiFT.source computes its frequencies (fp32); summed in float64 by _settle.
    freq = f0.astype(mx.float32)[..., None] * mx.arange(1, vocoders[0]._harmonics + 1, dtype=mx.float32)
    freq = freq / hift.config.sampling_rate
    out = []
    for i, (d, n, new, source) in enumerate(zip(decodes, sizes, news, sources)):
        row = wav[i : i + 1, : n * spf]
        # upstream's trim_fade, on the utterance's first 40 ms only
        row = fade_in(row) if d.start == 0 else row
        out.append((row, freq[i : i + 1, :new], source))
    return out


@dataclass(frozen=True)
class _Decode:
    """A stream's decode, prepared: S3Gen's input row, and the generated frames it covers."""

    tokens: mx.array  # (1, N) int32: the window and the tokens after it
    noise: mx.array  # (1, 2·(prompt + N - held tokens), 80): the CFM noise rows of its frames
    final: bool  # finalize (else the lookahead tokens' frames are dropped)
    start: int  # the first generated frame HiFT reads
    shift: int  # generated frames before the window (2 per token left out)
    frames: int  # generated frames the mel reaches
    end: int  # the audio up to this frame becomes final


def decode_together(vocoders: Sequence[StreamVocoder], *, bucket: int = 1) -> list[np.ndarray]:
    """The due decodes (``StreamVocoder.due``) of several streams, their mels from one ``S3Gen.batch_mel``
    call (rows right-padded to a multiple of ``bucket`` tokens), then each one's HiFT: per vocoder, the
    float32 samples its ``push``/``finish`` would have returned (empty where no decode is due), equal up to
    float error; a single due decode runs as ``push`` runs it, exactly. The vocoders share one S3Gen and
    cfm_steps, as one batched call needs."""
    return drain(decode_together_steps(vocoders, bucket=bucket))


def decode_together_steps(vocoders: Sequence[StreamVocoder], *, bucket: int = 1) -> Steps[list[np.ndarray]]:
    """``decode_together`` queued a part at a time (``Steps``: S3Gen's parts, then HiFT; a single due decode
    in one part)."""
    if len({id(v) for v in vocoders}) != len(vocoders):
        raise ValueError("a vocoder is given twice; it has one decode due at most: pass each once")
    due = [v for v in vocoders if v._due is not None]
    if len(due) <= 1:
        return [v._decode() for v in vocoders]
    s3gen, steps = due[0].s3gen, due[0].cfm_steps
    if any(v.s3gen is not s3gen or v.cfm_steps != steps for v in due):
        raise ValueError("the vocoders differ in S3Gen or cfm_steps: decode each group of like ones together")
    decodes = [v._due for v in due]
    for v in due:
        v._due = None
    mels = yield from s3gen.batch_mel_steps(
        [d.tokens for d in decodes],
        [v.voice for v in due],
        cfm_steps=steps,
        cfm_noises=[d.noise for d in decodes],
        finalize=[d.final for d in decodes],
        bucket=bucket,
    )
    vocoded = _vocode(due, decodes, mels)
    mx.async_eval(vocoded)
    yield
    audio = {id(v): v._settle(d, *out) for v, d, out in zip(due, decodes, vocoded)}
    return [audio.get(id(v), np.zeros(0, np.float32)) for v in vocoders]


@dataclass(frozen=True)
class Piece:
    """One T3 pass of a streamed text: its token ids (no SOT/EOT), sampling knobs and keys (None: fresh)."""

    text_ids: list[int]
    params: SamplingParams
    t3_key: mx.array | None = None
    s3gen_key: mx.array | None = None


def stream_piece(
    speech: EnglishSpeech,
    s3gen: S3Gen,
    voice: Voice,
    piece: Piece,
    *,
    cfm_steps: int | None = None,
    first_chunk: int = FIRST_CHUNK,
    chunk: int = CHUNK,
    context: int | Literal["whole"] = CONTEXT,
) -> Iterator[np.ndarray]:
    """The speech tokens of one piece (``speech``: a variant's text -> speech tokens, ``EnglishSpeech`` or
    Turbo's), vocoded as they come (``StreamVocoder``): non-empty float32 chunks.

    Tokens are filtered online: the stop id ends the piece and other non-speech ids (>= 6561) are dropped;
    the variant's tail tokens (Turbo's silence) go in last. (Upstream's ``drop_invalid_tokens`` also drops what
    precedes a start-of-speech id inside the output; audio already streamed cannot be taken back, so the stream
    keeps it.)
    """
    vocoder = StreamVocoder(
        s3gen,
        voice,
        cfm_steps=cfm_steps,
        key=piece.s3gen_key,
        first_chunk=first_chunk,
        chunk=chunk,
        context=context,
    )
    stopped = False
    for token in speech.tokens(voice, piece.text_ids, piece.params, key=piece.t3_key):
        if token == speech.stop_token:
            stopped = True
            break
        if token >= speech.start_token:
            continue
        out = vocoder.push([token])
        if out.size:
            yield out
    if not stopped:
        logger.warning(
            "T3 stopped at its budget of %d speech tokens without the stop token: the end may be cut off "
            "(raise max_new_tokens, or try another seed)",
            piece.params.max_new_tokens,
        )
    if not vocoder.pushed:
        raise ValueError("T3 stopped before producing any speech token; try another seed or text")
    out = vocoder.push(list(speech.tail)) if speech.tail else np.zeros(0, np.float32)
    if out.size:
        yield out
    out = finish_stream(vocoder, speech)
    if out.size:
        yield out


def finish_stream(vocoder: StreamVocoder, speech: EnglishSpeech) -> np.ndarray:
    """The vocoder's last samples, less what the variant cuts from a piece's end (``speech.cut_samples``:
    Multilingual v3's last token). The vocoder holds back its lookahead tokens until now, so they are here."""
    return cut_end(vocoder.finish(), vocoder.pushed, speech)


def cut_end(out: np.ndarray, pushed: int, speech: EnglishSpeech) -> np.ndarray:
    """A stream's last samples ``out`` (its final decode's, after ``pushed`` tokens) less what the variant cuts
    from a piece's end."""
    cut = speech.cut_samples(pushed)
    if cut > out.size:
        raise RuntimeError(f"the stream's last {out.size} samples cannot lose {cut}")
    return out[: out.size - cut]


class PieceJoiner:
    """The chunks of a text's consecutive pieces -> one stream, each piece's head crossfaded over the end of the
    piece before as ``crossfade_join`` does: concatenated, the output equals ``crossfade_join`` of the whole
    pieces. While more pieces follow, the newest ``overlap`` samples are held back for the next head."""

    def __init__(self, overlap: int):
        self.overlap = overlap
        self._held = np.zeros(0, np.float32)  # the end of the output so far, not yet out
        self._head: list[np.ndarray] | None = None  # a new piece's first samples, until they cover _held

    def push(self, chunk: np.ndarray, more: bool) -> np.ndarray:
        """A chunk of the current piece (``more``: pieces follow it) -> the samples that are final now."""
        if self._head is not None:
            self._head.append(chunk)
            if sum(len(h) for h in self._head) < len(self._held):
                return np.zeros(0, np.float32)
            self._mix()
        else:
            self._held = np.concatenate([self._held, chunk])
        keep = self.overlap if more else 0
        if len(self._held) <= keep:
            return np.zeros(0, np.float32)
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return out

    def end_piece(self, more: bool) -> np.ndarray:
        """The current piece is over: the samples held back, unless the next piece's head will mix into them."""
        if self._head is not None:  # a piece shorter than the held tail
            self._mix()
        if more:
            self._head = []
            return np.zeros(0, np.float32)
        out, self._held = self._held, np.zeros(0, np.float32)
        return out

    def _mix(self) -> None:
        head = np.concatenate(self._head) if self._head else np.zeros(0, np.float32)
        self._held, self._head = crossfade_join([self._held, head], len(self._held)), None


def join_pieces(
    pieces: Sequence[Iterator[np.ndarray]], overlap: int, pauses: Sequence[int | None] | None = None
) -> Iterator[np.ndarray]:
    """``PieceJoiner`` over the chunk iterators of a text's pieces: the non-empty joined chunks. ``pauses``
    (``pieces.Plan.pauses``; default: none, every piece crossfaded onto the one before) puts silences between
    pieces: a piece followed by one is not held back for a crossfade, and the silence comes as a chunk of
    zeros. Concatenated, the output equals ``pieces.join_audio`` of the whole pieces."""
    pauses = [0, *[None] * (len(pieces) - 1), 0] if pauses is None else pauses
    if len(pauses) != len(pieces) + 1:
        raise ValueError(f"{len(pauses)} pauses for {len(pieces)} pieces: pass one more pause than pieces")
    joiner = PieceJoiner(overlap)
    if pauses[0]:
        yield np.zeros(pauses[0], np.float32)
    for i, chunks in enumerate(pieces):
        more = pauses[i + 1] is None  # the next piece crossfades onto this one
        for chunk in chunks:
            out = joiner.push(chunk, more)
            if len(out):
                yield out
        out = joiner.end_piece(more)
        if len(out):
            yield out
        if pauses[i + 1]:
            yield np.zeros(pauses[i + 1], np.float32)
