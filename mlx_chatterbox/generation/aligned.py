"""Text ids -> speech tokens with T3 and multilingual v2's alignment analyzer (upstream 0.1.7 ``T3.inference``
with ``hp.is_multilingual``; variants.md §5.8): the v2-legacy parity mode.

Each step's draw depends on host logic over that step's attention maps, so this loop waits for the device once per
step: it evaluates the drawn token together with the next pass (its logits and maps) and runs the analyzer on
those maps while nothing else is queued. ``speech_tokens.generate_speech_tokens`` is the loop without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import mlx.core as mx
import numpy as np

from ..models.t3 import T3, AttentionTaps
from ..sampling import SamplingParams, cfg_combine, draw, process_logits
from .alignment import ALIGNED_HEADS, AlignmentAnalyzer, steer_eos
from .speech_tokens import _draw_args, check_request, compiled, make_draws, request_embeds, speech_ids
from .voice import Voice


def generate_aligned_speech_tokens(
    model: T3,
    voice: Voice,
    text_ids: Sequence[int],
    params: SamplingParams = SamplingParams(),
    *,
    key: mx.array | None = None,
    uniforms: mx.array | None = None,
) -> Iterator[int]:
    """Yield raw speech ids one by one, the stop token included when it comes, with the alignment analyzer
    suppressing or forcing the stop token after CFG (``AlignmentAnalyzer``); otherwise as
    ``generate_speech_tokens``.

    text_ids: the tokenized text without SOT/EOT.
    key: PRNG key for the draws (a fresh one if None; greedy decoding draws nothing).
    uniforms: (max_new_tokens,) floats in [0, 1) that replace the PRNG with inverse-CDF draws.
    """
    check_request(model, text_ids, params)
    cfg = model.config
    if cfg.num_layers <= max(layer for layer, _ in ALIGNED_HEADS) or cfg.num_heads <= max(
        head for _, head in ALIGNED_HEADS
    ):
        raise ValueError(
            f"the alignment analyzer reads (layer, head) pairs {ALIGNED_HEADS}; this T3 has {cfg.num_layers} "
            f"layers of {cfg.num_heads} heads"
        )
    n = params.max_new_tokens
    draws = make_draws(params, key, uniforms)
    embeds = request_embeds(model, voice, text_ids, params)
    # [cond | SOT text EOT | BOS | BOS]: the analyzer reads the text columns and, at first, both BOS rows.
    text_end = embeds.shape[1] - 2
    analyzer = AlignmentAnalyzer(text_end - (len(text_ids) + 2), text_end)
    # Batch 1 when cfg_weight is 0 (upstream still runs the unconditional row, whose weight is then 0): row 0 is
    # the conditional row either way, and its attention does not depend on the other row.
    taps = AttentionTaps(ALIGNED_HEADS, first_row=text_end)
    logits, cache = model.prefill(embeds, taps=taps)
    maps = taps.maps
    sample = _sampler(model, params, uniforms is not None)
    forward = _tapped_decode(model)
    seen = (mx.arange(cfg.speech_vocab_size) == cfg.start_speech_token)[None]
    last = cfg.start_speech_token
    for i in range(n):
        verdict = analyzer.step(np.stack([np.array(m) for m in maps]), last)
        flags = mx.array([verdict.suppress_eos, verdict.force_eos])
        token, seen = sample(logits, flags, seen, draws[i])
        if i + 1 < n:
            # Generated token i is fed back at speech position i + 1.
            position = mx.array([i + 1, cache.claim()], dtype=mx.int32)
            logits, maps, cache.kv = forward(token, position, cache.kv)
            mx.async_eval(token, logits, maps)
        last = token.item()
        yield last
        if last == cfg.stop_speech_token:
            return


def _sampler(model: T3, params: SamplingParams, uniform_draws: bool) -> Callable:
    """The compiled ``(logits, [suppress, force], seen, draw) -> (token, seen)``: CFG, the analyzer's verdict,
    then upstream's chain and the draw (``process_logits`` passes the combined row through its CFG step); the
    drawn token is marked as seen for the next step's repetition penalty."""
    knobs = replace(params, max_new_tokens=1, exaggeration=0.0)  # neither changes the step
    cfg = model.config

    def build() -> Callable:
        vocab = speech_ids(cfg.speech_vocab_size)

        def sample(
            logits: mx.array, flags: mx.array, seen: mx.array, d: mx.array
        ) -> tuple[mx.array, mx.array]:
            x = cfg_combine(logits.astype(mx.float32), knobs.cfg_weight)
            x = steer_eos(x, flags[0], flags[1], cfg.stop_speech_token)
            token = draw(process_logits(x, seen, knobs), knobs, *_draw_args(knobs, uniform_draws, d))
            return token, seen | (vocab == token)

        return sample

    return compiled(model, ("aligned sampler", knobs, uniform_draws), build)


def _tapped_decode(model: T3) -> Callable:
    """The compiled ``(token, [speech position, position], kv) -> (logits, maps, kv)``: ``T3.decode`` of the
    token (on every CFG row) that also returns the analyzer's heads' attention maps, each (1, capacity)."""

    def forward(
        token: mx.array, position: mx.array, kv: list[mx.array]
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        taps = AttentionTaps(ALIGNED_HEADS)
        batch = kv[0].shape[0]
        logits, kv = model.decode(mx.broadcast_to(token, (batch,)), position[0], position[1], kv, taps=taps)
        return logits, taps.maps, kv

    return compiled(model, ("aligned decode", ALIGNED_HEADS), lambda: forward)
