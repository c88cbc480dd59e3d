"""Many speech-token requests through Turbo's or Nano's T3 at once (continuous batching).

generation/batch.py ``SpeechTokenBatch`` for the GPT-2 T3 of generation/turbo.py, with the same interface, so
that the server's worker can drive either: requests join between two steps (the ones waiting are prefilled
together, left-padded to the longest, then right-aligned with the others in a ``BatchKVCache``) and leave after
their stop token, their budget, or a step with nothing left to draw.

Row for row this computes what ``generate_turbo_tokens`` computes for the request alone, upstream's rules
included (the start id in the penalty history of the first token only, the first token never a stop, at most
``1 + max_new_tokens`` tokens, an all -inf step ends the request): the same prefill (up to float rounding: the
rows' padding is masked), the same decode with per-row positions and masks, the same logits chain with per-row
knobs (``sampling.process_turbo_rows``) and the same draws (``sampling.draw_turbo_rows``), so a request's
tokens do not depend on what else is in the batch (tests/test_turbo_batch.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx

from ..models.cache import BatchKVCache
from ..models.gpt2 import T3Turbo
from ..sampling import TurboParams, draw_turbo_rows, process_turbo_rows, turbo_row_knobs
from .batch import BatchRequest, ContinuousBatch, _Active
from .speech_tokens import compiled, speech_ids
from .turbo import _NO_TOKEN, check_request, make_draws

logger = logging.getLogger(__name__)

# What ``step`` reports, finished, for a request whose processed logits were all -inf: it ends there without a
# token (``generate_turbo_tokens`` returns there, or raises when it is the first token). Never a speech id.
NO_TOKEN = _NO_TOKEN


class TurboTokenBatch(ContinuousBatch):
    """Continuous batching over Turbo's or Nano's T3 (``SpeechTokenBatch``'s interface). ``add`` requests
    (``BatchRequest`` with ``TurboParams``) at any time; each ``step`` advances every request by one token and
    returns ``(uid, token, finished)`` for each: raw ids as ``generate_turbo_tokens`` yields them, the stop
    token included when it comes, and ``NO_TOKEN`` (finished) where a request's logits were all -inf. A
    finished request has left the batch (``ContinuousBatch``)."""

    def __init__(self, model: T3Turbo, stop_on_eos: bool = True, window_size: int = 32):
        super().__init__(model, stop_on_eos, window_size)
        self._uses = (False, False, False, False)  # ``_uses`` of the active requests

    def _check(self, request: BatchRequest) -> None:
        if not isinstance(request.params, TurboParams):
            raise TypeError(
                f"a Turbo request takes TurboParams, got {type(request.params).__name__}: "
                "temperature, top_k, top_p, repetition_penalty and max_new_tokens"
            )
        check_request(self.model, request.voice, request.text_ids, request.params)
        make_draws(1 + request.params.max_new_tokens, request.key, request.uniforms)  # checks the draws

    def _ends(self, a: _Active, token: int) -> bool:
        first = a.drawn == 1
        if token == NO_TOKEN:
            if first:
                # generate_turbo_tokens raises here; in a batch the request ends and the others go on.
                logger.error("request %d: every logit of its first speech token is -inf", a.uid)
            else:
                logger.warning(
                    "request %d: every speech logit is -inf at token %d; it ends", a.uid, a.drawn - 1
                )
        # The first token is never a stop (upstream checks from the second on).
        stop = token == NO_TOKEN or (
            self.stop_on_eos and not first and token == self.model.config.stop_speech_token
        )
        return stop or a.drawn == 1 + a.request.params.max_new_tokens

    def _prefill(
        self, pending: list[tuple[int, BatchRequest]]
    ) -> tuple[list[_Active], mx.array, mx.array, BatchKVCache]:
        """Prefill the waiting requests together, left-padded to the longest (one prefill call for them all):
        their slots, first tokens, seen-masks and cache rows."""
        model, cfg = self.model, self.model.config
        embeds = []
        for _, r in pending:
            text = mx.array([list(r.text_ids)], dtype=mx.int32)
            embeds.append(model.prepare_input_embeds(r.voice.speaker_emb, r.voice.t3_prompt_tokens, text))
        n = max(e.shape[1] for e in embeds)
        pad = [n - e.shape[1] for e in embeds]
        x = mx.concatenate([mx.pad(e, [(0, 0), (n - e.shape[1], 0), (0, 0)]) for e in embeds])
        logits, cache = model.prefill(x, pad=mx.array(pad, dtype=mx.int32) if any(pad) else None)
        joining = []
        for uid, r in pending:
            draws = make_draws(1 + r.params.max_new_tokens, r.key, r.uniforms)
            joining.append(_Active(uid, r, draws))
        # The first token's penalty history is the start-of-speech id; after it, the generated ids alone.
        vocab = mx.arange(cfg.speech_vocab_size)
        start_seen = mx.broadcast_to(vocab == cfg.start_speech_token, logits.shape)
        by_key = [a.draws.ndim == 2 for a in joining]
        keys = mx.stack([a.draws[0] if k else mx.zeros((2,), mx.uint32) for a, k in zip(joining, by_key)])
        uniforms = mx.stack([mx.zeros(()) if k else a.draws[0] for a, k in zip(joining, by_key)])
        params = [a.request.params for a in joining]
        tokens = _pick(
            logits,
            start_seen,
            turbo_row_knobs(params),
            keys,
            uniforms,
            mx.array([not k for k in by_key]),
            _uses(params, by_key, cfg.speech_vocab_size),
        )
        seen = mx.zeros((len(pending), cfg.speech_vocab_size), dtype=mx.bool_)
        rows = BatchKVCache(cache.kv, cache.offset, pad, cache.step, self.window_size)
        return joining, tokens, seen, rows

    def _lay_out(self) -> None:
        """What changes only when requests join or leave, kept on the device so that a step costs the host a
        few calls whatever the number of requests: knobs, draw kind and draws (padded to a table), each
        request's last draw index, how many tokens it has drawn, and the rows' left padding."""
        by_key = [a.draws.ndim == 2 for a in self._active]
        params = [a.request.params for a in self._active]
        keys, uniforms = self._draw_tables()
        self._layout = {
            "knobs": turbo_row_knobs(params),
            "by_uniform": mx.array([not k for k in by_key]),
            "keys": keys,
            "uniforms": uniforms,
            "last": mx.array([p.max_new_tokens for p in params], dtype=mx.int32),
            "pad": mx.array(self._cache.pad, dtype=mx.int32),
        }
        self._drawn = mx.array([a.drawn for a in self._active], dtype=mx.int32)
        # Work that no active request needs is left out of the step (it is traced once per such set).
        self._uses = _uses(params, by_key, self.model.config.speech_vocab_size)

    def _queue_next(self) -> tuple[mx.array, mx.array]:
        """Feed every request's last token (token i at its position L + i, as alone) and draw the next with
        ``draws[i + 1]``; a request that ends with its last token draws again with its last draw, unread."""
        cache = self._cache
        at = mx.array([cache.claim(), cache.base], dtype=mx.int32)  # claim first: it may flush (move base)
        token, seen, self._drawn, cache.window = _batch_step(self.model, self._uses)(
            self._tokens, self._drawn, at, self._seen, self._layout, cache.kv, cache.window
        )
        mx.async_eval(token)
        return token, seen


def _uses(params: list[TurboParams], by_key: list[bool], vocab: int) -> tuple[bool, bool, bool, bool]:
    """Whether any request filters by top_k, by top_p, draws by key, draws by uniform."""
    return (
        any(0 < p.top_k < vocab for p in params),
        any(p.top_p < 1.0 for p in params),
        any(by_key),
        not all(by_key),
    )


def _pick(
    logits: mx.array,
    seen: mx.array,
    knobs: dict[str, mx.array],
    keys: mx.array,
    uniforms: mx.array,
    by_uniform: mx.array,
    uses: tuple[bool, bool, bool, bool],
) -> mx.array:
    """The chain and the draw for every row (R,), or ``NO_TOKEN`` where every processed logit is -inf
    (generation/turbo.py ``_pick``)."""
    x = process_turbo_rows(logits, seen, knobs, top_k=uses[0], top_p=uses[1])
    drawn = draw_turbo_rows(x, keys, uniforms, by_uniform, kinds=uses[2:])
    return mx.where(x.max(axis=-1) == -mx.inf, NO_TOKEN, drawn).astype(mx.int32)


def _batch_step(model: T3Turbo, uses: tuple[bool, bool, bool, bool]):
    """The compiled batched decode step (traced again for each new number of rows or capacity; the token's
    buffer index and the window's base are values, not shapes) for requests that use top_k, top_p, keyed
    draws, uniform draws, as ``uses`` says."""
    last_position = model.config.n_positions - 1

    def build() -> Callable:
        vocab = speech_ids(model.config.speech_vocab_size)

        def step(
            tokens: mx.array,
            drawn: mx.array,
            at: mx.array,
            seen: mx.array,
            layout: dict,
            kv: list[mx.array],
            window: list[mx.array],
        ) -> tuple[mx.array, mx.array, mx.array, list[mx.array]]:
            pad = layout["pad"]
            # Row b's buffer index at[0] is its position at[0] - pad[b]. check_request keeps every fed token
            # inside the wpe table; only the unread step after a request's last token can pass its end, and
            # a NO_TOKEN is fed only by such a step: both are clamped so that it reads in bounds.
            positions = mx.minimum(at[0] - pad, last_position)
            logits, window = model.decode_window(mx.maximum(tokens, 0), positions, at, pad, kv, window)
            seen = seen | (vocab == tokens[:, None])
            which = mx.minimum(drawn, layout["last"])
            requests = mx.arange(which.shape[0])
            keys, uniforms = layout["keys"][requests, which], layout["uniforms"][requests, which]
            token = _pick(logits, seen, layout["knobs"], keys, uniforms, layout["by_uniform"], uses)
            return token, seen, drawn + 1, window

        return step

    return compiled(model, ("batch", uses), build)
