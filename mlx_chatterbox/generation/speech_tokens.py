"""Text ids -> speech tokens with T3: the upstream prefill, then a pipelined decode loop (architecture §3.5-§3.7).

The loop queues step i + 1 with ``mx.async_eval`` before it reads token i on the host, so the device never
waits for Python; the EOS check is the only host sync and runs one step behind.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import mlx.core as mx

from ..models.cache import KVCache
from ..models.campplus import CAMPPlus
from ..models.s3tokenizer import S3Tokenizer
from ..models.t3 import T3, T3Cond
from ..models.voice_encoder import VoiceEncoder
from ..sampling import SamplingParams, check_max_new_tokens, draw, process_logits
from ..text import EnTokenizer, punc_norm
from . import fused_sampling
from .voice import Voice, VoiceCloner


def check_request(model: T3, text_ids: Sequence[int], params: SamplingParams) -> None:
    """Reject what the model cannot take, before any work."""
    cfg = model.config
    if len(text_ids) + 2 > cfg.text_positions:
        raise ValueError(
            f"the text is {len(text_ids)} tokens long; the model takes at most {cfg.text_positions - 2}. "
            "Split it into shorter pieces (e.g. at sentence ends)."
        )
    bad = [i for i in text_ids if not 0 <= i < cfg.text_vocab_size]
    if bad:
        raise ValueError(f"text id {bad[0]} is outside the model's text vocabulary of {cfg.text_vocab_size}")
    check_params(model, params)


def check_params(model: T3, params: SamplingParams) -> None:
    """Knob values that this model cannot take (the rest are checked by ``SamplingParams`` itself)."""
    check_max_new_tokens(params.max_new_tokens, model.config.most_new_tokens)


def prefill_embeds(model: T3, cond: T3Cond, text_ids: Sequence[int], cfg_weight: float) -> mx.array:
    """``[cond | SOT text EOT | BOS@0 | BOS@0]``, batch 2 (conditional, unconditional) when cfg_weight > 0.

    Upstream embeds the start-of-speech token once in ``prepare_input_embeds`` and appends it again in
    ``inference``, both at speech position 0; we reproduce the double BOS on purpose.
    """
    cfg = model.config
    batch = 2 if cfg_weight > 0 else 1
    text = mx.array([[cfg.start_text_token, *text_ids, cfg.stop_text_token]] * batch, dtype=mx.int32)
    cond_emb = model.embed_cond(cond)
    cond_emb = mx.broadcast_to(cond_emb, (batch,) + cond_emb.shape[1:])
    bos = model.embed_speech(mx.full((batch, 1), cfg.start_speech_token, dtype=mx.int32), start=0)
    return mx.concatenate([cond_emb, model.embed_text(text, cfg_uncond_row=batch == 2), bos, bos], axis=1)


def generate_speech_tokens(
    model: T3,
    voice: Voice,
    text_ids: Sequence[int],
    params: SamplingParams = SamplingParams(),
    *,
    key: mx.array | None = None,
    uniforms: mx.array | None = None,
    stop_on_eos: bool = True,
) -> Iterator[int]:
    """Yield raw speech ids one by one, the stop token included when it comes.

    text_ids: the tokenized text without SOT/EOT.
    key: PRNG key for the draws (a fresh one if None; greedy decoding draws nothing).
    uniforms: (max_new_tokens,) floats in [0, 1) that replace the PRNG with inverse-CDF draws.
    stop_on_eos: False decodes exactly max_new_tokens (benchmarks).
    """
    check_request(model, text_ids, params)
    cfg = model.config
    n = params.max_new_tokens
    draws = make_draws(params, key, uniforms)
    token, seen, cache = start(model, voice, text_ids, params, draws, uniforms is not None)
    step = decode_step(model, params, uniforms is not None)
    mx.async_eval(token)
    for i in range(n):
        next_token = None
        if i + 1 < n:
            # Generated token i is fed back at speech position i + 1.
            position = mx.array([i + 1, cache.claim()], dtype=mx.int32)
            next_token, seen, cache.kv = step(token, position, seen, draws[i + 1], cache.kv)
            mx.async_eval(next_token)
        t = token.item()
        yield t
        if stop_on_eos and t == cfg.stop_speech_token:
            return
        token = next_token


def make_draws(params: SamplingParams, key: mx.array | None, uniforms: mx.array | None) -> mx.array:
    """One draw per token: (n, 2) PRNG keys split from ``key`` (a fresh one if None), the (n,) ``uniforms``
    given, or (n,) zeros that greedy decoding never reads; n = ``params.max_new_tokens``."""
    n = params.max_new_tokens
    if uniforms is not None:
        if key is not None or params.greedy:
            raise ValueError("uniforms replace the random draws: give no key, and a temperature > 0")
        if uniforms.shape != (n,):
            raise ValueError(f"uniforms must have shape ({n},) (one per token), got {uniforms.shape}")
        return uniforms.astype(mx.float32)
    if params.greedy:
        return mx.zeros((n,))
    return mx.random.split(mx.random.key(secrets.randbits(63)) if key is None else key, n)


def start(
    model: T3,
    voice: Voice,
    text_ids: Sequence[int],
    params: SamplingParams,
    draws: mx.array,
    uniform_draws: bool,
) -> tuple[mx.array, mx.array, KVCache]:
    """The prefill and the first token (1,), drawn with ``draws[0]``; the seen-mask (1, V) and the cache."""
    logits, cache = model.prefill(request_embeds(model, voice, text_ids, params))
    return (*first_token(model, logits, params, draws, uniform_draws), cache)


def request_embeds(model: T3, voice: Voice, text_ids: Sequence[int], params: SamplingParams) -> mx.array:
    """A request's prefill input (``prefill_embeds`` of its voice and knobs)."""
    cond = T3Cond(voice.speaker_emb, voice.t3_prompt_tokens, params.exaggeration)
    return prefill_embeds(model, cond, text_ids, params.cfg_weight)


def first_token(
    model: T3, logits: mx.array, params: SamplingParams, draws: mx.array, uniform_draws: bool
) -> tuple[mx.array, mx.array]:
    """The first token (1,) from the prefill's logits (the request's rows), drawn with ``draws[0]``, and the
    seen-mask (1, V)."""
    cfg = model.config
    # The repetition penalty covers the start-of-speech id and every generated id.
    seen = (mx.arange(cfg.speech_vocab_size) == cfg.start_speech_token)[None]
    token = draw(process_logits(logits, seen, params), params, *_draw_args(params, uniform_draws, draws[0]))
    return token, seen


def _draw_args(
    params: SamplingParams, uniform_draws: bool, d: mx.array
) -> tuple[mx.array | None, mx.array | None]:
    """``draw``'s (key, uniform) from one entry of the per-token draws."""
    if params.greedy:
        return None, None
    return (None, d) if uniform_draws else (d, None)


# Compiled decode steps per model and sampling set-up, reused across calls (each is traced again per new input
# shape: rows, capacity of the KV cache). Knob values are constants of a trace, so each distinct set is its own
# entry.
_MAX_COMPILED = 16
_traces = [0]  # traces of every compiled step in this process (``traces``)


def compiled(model: object, key: object, build: Callable[[], Callable]) -> Callable:
    """``model.compiled_steps[key]``: ``mx.compile(build())`` on first use, at most ``_MAX_COMPILED`` kept per
    model (the oldest goes first). Every T3 decode loop (single, batched, aligned; English and Turbo) keeps
    its steps here, and loading weights clears them."""
    steps = model.compiled_steps
    if key not in steps:
        if len(steps) >= _MAX_COMPILED:
            steps.pop(next(iter(steps)))
        step = build()

        def traced(*args, **kwargs):  # mx.compile runs the Python function only when it traces (a new shape)
            _traces[0] += 1
            return step(*args, **kwargs)

        steps[key] = mx.compile(traced)
    return steps[key]


def traces() -> int:
    """How many times a compiled T3 decode step has been traced in this process: once per new input shape (rows,
    KV capacity, draw table), each costing the host the whole step's graph and, on a GPU, its new kernels
    (``serve``'s ``/metrics``)."""
    return _traces[0]


def speech_ids(vocab_size: int) -> mx.array:
    """``arange(vocab_size)``, evaluated now: a compiled step keeps the lazy arrays it closes over, and MLX
    evaluates a lazy array only on the thread that made it (a server steps on a thread of its own)."""
    ids = mx.arange(vocab_size)
    mx.eval(ids)
    return ids


def decode_step(model: T3, params: SamplingParams, uniform_draws: bool) -> Callable:
    """The compiled ``(token, [speech position, position], seen, draw, kv) -> (next token, seen, kv)``: feed
    the last token through T3, mark it as seen, filter the logits and draw, all on the device."""
    knobs = replace(params, max_new_tokens=1, exaggeration=0.0)  # neither changes the step

    def build() -> Callable:
        vocab = speech_ids(model.config.speech_vocab_size)

        def step(
            token: mx.array, position: mx.array, seen: mx.array, d: mx.array, kv: list[mx.array]
        ) -> tuple[mx.array, mx.array, list[mx.array]]:
            batch = kv[0].shape[0]
            logits, kv = model.decode(mx.broadcast_to(token, (batch,)), position[0], position[1], kv)
            if fused_sampling.fits_english(logits, knobs):
                return (*fused_sampling.english_pick(logits, seen, token, d, uniform_draws, knobs), kv)
            seen = seen | (vocab == token)
            args = _draw_args(knobs, uniform_draws, d)
            return draw(process_logits(logits, seen, knobs), knobs, *args), seen, kv

        return step

    return compiled(model, (knobs, uniform_draws), build)


def drop_invalid_tokens(tokens: Sequence[int], start: int, stop: int) -> list[int]:
    """Upstream post-processing: keep what follows a start-of-speech id, cut at the stop id, then keep only
    real speech ids (< start). Upstream crashes when the start id occurs twice; we cut after the first."""
    tokens = list(tokens)
    begin = tokens.index(start) + 1 if start in tokens else 0
    end = tokens.index(stop) if stop in tokens else len(tokens)
    return [t for t in tokens[begin:end] if t < start]


def refuse_language(variant: str, language: str | None) -> None:
    """A language for a model that speaks English only is an error, not ignored."""
    if language is not None:
        raise ValueError(
            f"language={language!r}: the {variant} model speaks English only; the multilingual models "
            "(variant='multilingual' or 'multilingual-v3' of ResembleAI/chatterbox) take a language"
        )


class EnglishSpeech:
    """The English model's text -> speech tokens, as ``TTS`` drives every variant (``generation/turbo.py``
    has Turbo's): upstream's ``punc_norm`` and tokenizer, T3 with CFG (``generate_speech_tokens``) and
    upstream's post-processing (``drop_invalid_tokens``)."""

    variant = "english"
    params_type = SamplingParams
    tail: tuple[int, ...] = ()  # speech tokens appended before S3Gen (Turbo appends silence)
    batchable = True  # the server's engine can decode its requests together (generation/batch.py)

    def __init__(self, t3: T3, tokenizer: EnTokenizer):
        self.t3, self.tokenizer = t3, tokenizer
        self.start_token, self.stop_token = t3.config.start_speech_token, t3.config.stop_speech_token

    def text_ids(self, text: str, language: str | None = None) -> list[int]:
        """Normalised and tokenized ``text``, without SOT/EOT. ``language`` is for the multilingual models."""
        refuse_language(self.variant, language)
        return self.tokenizer.encode(punc_norm(text))

    def fits(self, ids: Sequence[int]) -> bool:
        """Whether T3 takes the ids in one pass (SOT and EOT included)."""
        return len(ids) + 2 <= self.t3.config.text_positions

    def check(self, params: SamplingParams) -> None:
        check_params(self.t3, params)

    def tokens(
        self, voice: Voice, ids: Sequence[int], params: SamplingParams, key: mx.array | None = None
    ) -> Iterator[int]:
        """Raw speech ids, the stop token included when it comes (``generate_speech_tokens``)."""
        return generate_speech_tokens(self.t3, voice, ids, params, key=key)

    def finish(self, raw: Sequence[int]) -> list[int]:
        """Raw ids -> the speech tokens S3Gen takes."""
        return drop_invalid_tokens(raw, self.start_token, self.stop_token)

    def cut_samples(self, tokens: int) -> int:
        """Samples to cut from the end of a piece's audio (Multilingual v3 cuts its last token's)."""
        return 0

    def cloner(
        self, voice_encoder: VoiceEncoder, s3tokenizer: S3Tokenizer, campplus: CAMPPlus
    ) -> VoiceCloner:
        """Voice cloning as upstream ``ChatterboxTTS.prepare_conditionals``."""
        return VoiceCloner(voice_encoder, s3tokenizer, campplus, self.t3.config.speech_cond_prompt_len)
