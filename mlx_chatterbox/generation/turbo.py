"""Text ids -> speech tokens with Turbo/Nano's T3 (upstream ``T3.inference_turbo``, variants.md §2.7-§2.9).

Pipelined as generation/speech_tokens.py: step i + 1 is queued with ``mx.async_eval`` before token i is read
on the host, and the stop checks (EOS, all logits -inf) are the only host syncs, one step behind.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import mlx.core as mx

from ..models.campplus import CAMPPlus
from ..models.gpt2 import T3Turbo
from ..models.s3tokenizer import S3Tokenizer
from ..models.voice_encoder import VoiceEncoder
from ..sampling import TurboParams, check_max_new_tokens, draw_turbo, process_turbo_logits
from ..text import GPT2Tokenizer, turbo_punc_norm
from . import fused_sampling
from .speech_tokens import compiled, refuse_language, speech_ids
from .voice import Voice, VoiceCloner

logger = logging.getLogger(__name__)

S3_CODEBOOK = 6561  # ids below this are S3 speech codes; start (6561) and stop (6562) are not
S3GEN_SIL = 4299  # upstream ``s3gen/const.py``: a silence token
SILENCE_TOKENS = 3  # upstream ``ChatterboxTurboTTS.generate`` appends three
# A step whose processed logits are all -inf returns this instead of a token (upstream breaks there).
_NO_TOKEN = -1


def check_request(model: T3Turbo, voice: Voice, text_ids: Sequence[int], params: TurboParams) -> None:
    """Reject what the model cannot take, before any work: MLX's gathers do not check bounds, so an id or a
    position out of range would read garbage instead of failing."""
    cfg = model.config
    bad = [i for i in text_ids if not 0 <= i < cfg.text_vocab_size]
    if bad:
        raise ValueError(f"text id {bad[0]} is outside the model's text vocabulary of {cfg.text_vocab_size}")
    prompt = voice.t3_prompt_tokens
    if prompt.shape[1] > cfg.speech_cond_prompt_len:
        raise ValueError(
            f"the voice's T3 prompt has {prompt.shape[1]} tokens; Turbo takes at most "
            f"{cfg.speech_cond_prompt_len} (15 s of reference): build the voice with Turbo's settings"
        )
    if prompt.size and not 0 <= prompt.min().item() <= prompt.max().item() < S3_CODEBOOK:
        raise ValueError(f"the voice's T3 prompt holds ids outside the speech codebook [0, {S3_CODEBOOK})")
    if voice.speaker_emb.shape[1] != cfg.speaker_embed_size:
        raise ValueError(
            f"the voice's speaker embedding has {voice.speaker_emb.shape[1]} values; T3 takes "
            f"{cfg.speaker_embed_size}"
        )
    # Prefill positions 0 .. L - 1, then one position per fed token: the last drawn token is never fed.
    length = prefill_length(model, voice, text_ids)
    if length + params.max_new_tokens > cfg.n_positions:
        raise ValueError(
            f"{length} prefill positions + max_new_tokens={params.max_new_tokens} exceed the model's "
            f"{cfg.n_positions} positions: shorten the text or lower max_new_tokens"
        )


def prefill_length(model: T3Turbo, voice: Voice, text_ids: Sequence[int]) -> int:
    """1 (speaker) + P (prompt) + N (text) + 1 (start of speech)."""
    return 1 + voice.t3_prompt_tokens.shape[1] + len(text_ids) + 1


def generate_turbo_tokens(
    model: T3Turbo,
    voice: Voice,
    text_ids: Sequence[int],
    params: TurboParams = TurboParams(),
    *,
    key: mx.array | None = None,
    uniforms: mx.array | None = None,
    stop_on_eos: bool = True,
) -> Iterator[int]:
    """Yield raw speech ids one by one, at most ``1 + params.max_new_tokens``, the stop id included when it
    comes (as ``generate_speech_tokens``; upstream drops a final stop id, ``postprocess_tokens`` does here).

    voice: its ``speaker_emb`` (1, 256) and ``t3_prompt_tokens`` (1, P <= 375) are used.
    text_ids: the tokenized text as the GPT-2 tokenizer gives it (Turbo adds no start/stop text ids).
    key: PRNG key for the draws (a fresh one if None).
    uniforms: (1 + max_new_tokens,) floats in [0, 1) that replace the PRNG with inverse-CDF draws.
    stop_on_eos: False decodes all 1 + max_new_tokens tokens (benchmarks).

    As upstream: the first token is drawn with the start-of-speech id as the penalty history and is never
    taken as a stop (an EOS there is fed back and dropped later); after it the history is the generated ids;
    the loop stops after a stop id, or before drawing when every processed logit is -inf.
    """
    check_request(model, voice, text_ids, params)
    cfg = model.config
    total = 1 + params.max_new_tokens
    draws = make_draws(total, key, uniforms)
    by_uniform = uniforms is not None
    embeds = model.prepare_input_embeds(
        voice.speaker_emb, voice.t3_prompt_tokens, mx.array([list(text_ids)], dtype=mx.int32)
    )
    logits, cache = model.prefill(embeds)
    start_seen = (mx.arange(cfg.speech_vocab_size) == cfg.start_speech_token)[None]
    token = _pick(process_turbo_logits(logits, start_seen, params), draws[0], by_uniform)
    # From the second token on the history is the generated ids alone: 6561 leaves it (unless drawn).
    seen = mx.zeros((1, cfg.speech_vocab_size), dtype=mx.bool_)
    step = decode_step(model, params, by_uniform)
    mx.async_eval(token)
    for i in range(total):
        next_token = None
        if i + 1 < total:
            position = mx.array(cache.claim(), dtype=mx.int32)
            next_token, seen, cache.kv = step(token, position, seen, draws[i + 1], cache.kv)
            mx.async_eval(next_token)
        t = token.item()
        if t == _NO_TOKEN:
            if i == 0:
                # Upstream checks from the second token on; here its multinomial fails on NaN probabilities.
                raise RuntimeError("every logit of the first speech token is -inf: the T3 weights are broken")
            logger.warning("every speech logit is -inf at token %d; stopping there (as upstream)", i)
            return
        yield t
        if stop_on_eos and i > 0 and t == cfg.stop_speech_token:
            return
        token = next_token


def make_draws(total: int, key: mx.array | None, uniforms: mx.array | None) -> mx.array:
    """One draw per token: (total, 2) PRNG keys split from ``key`` (a fresh one if None) or the (total,)
    ``uniforms`` given."""
    if uniforms is not None:
        if key is not None:
            raise ValueError("uniforms replace the random draws: give either a key or uniforms, not both")
        if uniforms.shape != (total,):
            raise ValueError(
                f"uniforms must have shape ({total},) (one per token: 1 + max_new_tokens), "
                f"got {uniforms.shape}"
            )
        return uniforms.astype(mx.float32)
    return mx.random.split(mx.random.key(secrets.randbits(63)) if key is None else key, total)


def _pick(logits: mx.array, d: mx.array, by_uniform: bool) -> mx.array:
    """The drawn id (1,), or ``_NO_TOKEN`` where every processed logit is -inf (nothing can be drawn)."""
    drawn = draw_turbo(logits, uniform=d) if by_uniform else draw_turbo(logits, key=d)
    dead = logits.max(axis=-1) == -mx.inf
    return mx.where(dead, _NO_TOKEN, drawn).astype(mx.int32)


def decode_step(model: T3Turbo, params: TurboParams, by_uniform: bool) -> Callable:
    """The compiled ``(token, position, seen, draw, kv) -> (next token, seen, kv)``: feed the last token
    through T3 at ``position``, add it to the history, run the chain and draw, all on the device."""
    knobs = replace(params, max_new_tokens=0)  # the step does not depend on it

    def build() -> Callable:
        vocab = speech_ids(model.config.speech_vocab_size)

        def step(
            token: mx.array, position: mx.array, seen: mx.array, d: mx.array, kv: list[mx.array]
        ) -> tuple[mx.array, mx.array, list[mx.array]]:
            # A _NO_TOKEN fed here ends the loop on the host; clamped, the (discarded) step reads in bounds.
            logits, kv = model.decode(mx.maximum(token, 0), position, kv)
            if fused_sampling.fits(logits, knobs):
                return (*fused_sampling.turbo_pick(logits, seen, token, d, by_uniform, knobs, _NO_TOKEN), kv)
            seen = seen | (vocab == token)
            return _pick(process_turbo_logits(logits, seen, knobs), d, by_uniform), seen, kv

        return step

    return compiled(model, (knobs, by_uniform), build)


def postprocess_tokens(tokens: Sequence[int]) -> list[int]:
    """Upstream ``ChatterboxTurboTTS.generate`` between T3 and S3Gen: keep the speech codes (< 6561: drops the
    start and stop ids wherever they are, an EOS drawn first included), then append three silence tokens."""
    return [t for t in tokens if t < S3_CODEBOOK] + [S3GEN_SIL] * SILENCE_TOKENS


class TurboSpeech:
    """Turbo's and Nano's text -> speech tokens, as ``TTS`` drives every variant (the counterpart of
    generation/speech_tokens.py ``EnglishSpeech``): upstream Turbo's ``punc_norm`` and GPT-2 tokenizer,
    ``generate_turbo_tokens`` and ``ChatterboxTurboTTS.generate``'s post-processing."""

    params_type = TurboParams
    tail: tuple[int, ...] = (S3GEN_SIL,) * SILENCE_TOKENS  # appended before S3Gen (``finish`` includes it)
    batchable = True

    def __init__(self, t3: T3Turbo, tokenizer: GPT2Tokenizer, variant: str = "turbo"):
        self.t3, self.tokenizer, self.variant = (
            t3,
            tokenizer,
            variant,
        )  # "turbo" or "nano": the name in errors
        self.start_token, self.stop_token = t3.config.start_speech_token, t3.config.stop_speech_token

    def text_ids(self, text: str, language: str | None = None) -> list[int]:
        """Normalised and tokenized ``text`` (Turbo adds no start/stop text ids)."""
        refuse_language(self.variant, language)
        return self.tokenizer.encode(turbo_punc_norm(text))

    def fits(self, ids: Sequence[int]) -> bool:
        """Whether T3 takes the ids in one pass with the longest prompt (375) and the default budget: the
        prefill and every fed token need a row of the position table. (Ids past the tokenizer's
        ``model_max_length``, which upstream cuts silently, are refused by ``GPT2Tokenizer.encode``.)"""
        cfg = self.t3.config
        return 1 + cfg.speech_cond_prompt_len + len(ids) + 1 + cfg.max_new_tokens <= cfg.n_positions

    def check(self, params: TurboParams) -> None:
        """Knob values this model cannot take whatever the text (``check_request`` checks the exact length)."""
        check_max_new_tokens(params.max_new_tokens, self.t3.config.most_new_tokens)

    def tokens(
        self, voice: Voice, ids: Sequence[int], params: TurboParams, key: mx.array | None = None
    ) -> Iterator[int]:
        """Raw speech ids, the stop token included when it comes. A stop id drawn as the *first* token is left
        out: upstream does not stop there, feeds it back and drops it before S3Gen, so callers may take every
        stop id they see as the end."""
        for i, token in enumerate(generate_turbo_tokens(self.t3, voice, ids, params, key=key)):
            if i == 0 and token == self.stop_token:
                continue
            yield token

    def finish(self, raw: Sequence[int]) -> list[int]:
        """Raw ids -> the speech tokens S3Gen takes: the speech codes, then ``tail`` (``postprocess_tokens``)."""
        return postprocess_tokens(raw)

    def cut_samples(self, tokens: int) -> int:
        return 0

    def cloner(
        self, voice_encoder: VoiceEncoder, s3tokenizer: S3Tokenizer, campplus: CAMPPlus
    ) -> VoiceCloner:
        """Voice cloning as upstream ``ChatterboxTurboTTS.prepare_conditionals``."""
        return VoiceCloner.turbo(voice_encoder, s3tokenizer, campplus, self.t3.config.speech_cond_prompt_len)
