"""Many speech-token requests through one T3 at once (continuous batching).

Each request has its own text, voice, knobs, draws and stop; all of them decode together, one token each per
step, so that the per-step host cost (what bounds T3 on a GPU, ADR 9) is paid once for every request. Requests
join between two steps (the ones waiting are prefilled together, left-padded to the longest, then their keys and
values are right-aligned with the others' in a ``BatchKVCache``) and leave after their stop token or their
``max_new_tokens``.

Row for row this computes what ``generate_speech_tokens`` computes for the request alone: the same prefill (up
to float rounding: the rows' padding is masked), the same decode with per-row sequence positions and masks, the same logits chain with per-row knobs
(``sampling.process_rows``) and the same draws (``sampling.draw_rows``), so a request's tokens do not depend on
what else is in the batch (tests/test_batch.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..models.cache import BatchKVCache
from ..models.t3 import T3
from ..sampling import SamplingParams, draw_rows, process_rows, row_knobs
from .speech_tokens import check_request, compiled, first_token, make_draws, request_embeds, speech_ids
from .voice import Voice


@dataclass(frozen=True)
class BatchRequest:
    """One request: as the arguments of ``generate_speech_tokens``."""

    text_ids: Sequence[int]  # the tokenized text without SOT/EOT
    voice: Voice
    params: SamplingParams = SamplingParams()
    key: mx.array | None = None  # PRNG key for the draws (a fresh one if None; greedy draws nothing)
    uniforms: mx.array | None = None  # (max_new_tokens,) inverse-CDF draws instead of the PRNG


@dataclass
class _Active:
    """A request in the batch: its id, its stop rule, and how many of its tokens were drawn so far."""

    uid: int
    request: BatchRequest
    draws: mx.array  # (n, 2) keys or (n,) uniforms, one per token
    drawn: int = 1  # the prefill draws token 0
    rows: int = 2  # T3 rows: the CFG pair, or one without CFG


class ContinuousBatch:
    """What every T3's continuous batch shares (``SpeechTokenBatch`` here, Turbo's ``TurboTokenBatch``): the
    waiting and active requests, ``add``/``cancel``/``step``. A subclass checks requests (``_check``), says when
    a drawn token ends its request (``_ends``), and owns the device state (``_join``, ``_leave``, ``_lay_out``,
    ``_queue_next``).

    stop_on_eos: False decodes every request to its budget (benchmarks).
    window_size: positions written per step into the cache's small window before it is flushed into the big
    buffers (models/cache.py ``BatchKVCache``).
    """

    def __init__(self, model, stop_on_eos: bool = True, window_size: int = 32):
        if window_size < 1:
            raise ValueError(f"window_size must be at least 1 position, got {window_size}; the default is 32")
        self.model, self.stop_on_eos, self.window_size = model, stop_on_eos, window_size
        self._uids = itertools.count()
        self._pending: list[tuple[int, BatchRequest]] = []
        self._active: list = []
        # Device state of the active requests, in their order: the last drawn (not yet read) token of each, the
        # seen-masks, how many tokens each has drawn, the cache of their T3 rows, and ``_lay_out``'s layout.
        self._tokens = self._seen = self._drawn = None
        self._cache: BatchKVCache | None = None
        self._layout: dict[str, mx.array] = {}

    def add(self, request: BatchRequest) -> int:
        """Queue a request (checked now, prefilled at the next step); returns its id."""
        self._check(request)
        uid = next(self._uids)
        self._pending.append((uid, request))
        return uid

    def cancel(self, uid: int) -> None:
        """Drop a request that has not finished, waiting or decoding (its rows leave the batch now)."""
        for j, (u, _) in enumerate(self._pending):
            if u == uid:
                del self._pending[j]
                return
        for i, a in enumerate(self._active):
            if a.uid == uid:
                self._leave([k for k in range(len(self._active)) if k != i])
                return
        raise KeyError(f"request {uid} is not in the batch (finished, cancelled or never added)")

    def __len__(self) -> int:
        """Requests not finished yet, waiting or decoding."""
        return len(self._pending) + len(self._active)

    def step(self) -> list[tuple[int, int, bool]]:
        """Admit waiting requests, queue the next decode step, then read the tokens drawn by the last one (the
        device works on the next step while the host reads, as in ``generate_speech_tokens``)."""
        if self._pending:
            self._join(self._pending)
            self._pending = []
            self._lay_out()
        if not self._active:
            return []
        queued = self._queue_next()
        out, keep = [], []
        for i, (a, token) in enumerate(zip(self._active, self._tokens.tolist())):
            finished = self._ends(a, token)
            out.append((a.uid, token, finished))
            if not finished:
                keep.append(i)
                a.drawn += 1
        self._tokens, self._seen = queued
        if len(keep) < len(self._active):
            self._leave(keep)
        return out

    def _rows(self, keep: list[int]) -> list[int]:
        """The cache rows of the requests at ``keep`` (one row each unless a subclass says otherwise)."""
        return keep

    def _leave(self, keep: list[int]) -> None:
        """Keep only the requests at ``keep`` (and their rows of the cache)."""
        rows = self._rows(keep)
        self._active = [self._active[i] for i in keep]
        if not keep:
            self._tokens = self._seen = self._drawn = self._cache = None
            return
        index = mx.array(keep, dtype=mx.int32)
        self._tokens, self._seen = self._tokens[index], self._seen[index]
        self._cache.keep(rows)
        self._lay_out()


class SpeechTokenBatch(ContinuousBatch):
    """Continuous batching over T3. ``add`` requests at any time; each ``step`` advances every request by one
    token and returns ``(uid, token, finished)`` for each: raw ids, the stop token included when it comes (as
    ``generate_speech_tokens`` yields them). A finished request has left the batch (``ContinuousBatch``)."""

    def __init__(self, model: T3, stop_on_eos: bool = True, window_size: int = 32):
        super().__init__(model, stop_on_eos, window_size)

    def _check(self, request: BatchRequest) -> None:
        check_request(self.model, request.text_ids, request.params)
        make_draws(request.params, request.key, request.uniforms)  # checks the draws

    def _ends(self, a: _Active, token: int) -> bool:
        stop = self.stop_on_eos and token == self.model.config.stop_speech_token
        return stop or a.drawn == a.request.params.max_new_tokens

    def _join(self, pending: list[tuple[int, BatchRequest]]) -> None:
        """Prefill the waiting requests together, their rows left-padded to the longest (one prefill call for
        them all: T3 is host-bound per call, ADR 9), and append them to the batch."""
        model, embeds = self.model, []
        for _, request in pending:
            embeds.append(request_embeds(model, request.voice, request.text_ids, request.params))
        n = max(e.shape[1] for e in embeds)
        pad = [n - e.shape[1] for e in embeds for _ in range(e.shape[0])]
        x = mx.concatenate([mx.pad(e, [(0, 0), (n - e.shape[1], 0), (0, 0)]) for e in embeds])
        logits, cache = model.prefill(x, pad=mx.array(pad, dtype=mx.int32) if any(pad) else None)
        tokens, seen, first = [], [], 0
        for (uid, request), e in zip(pending, embeds):
            draws = make_draws(request.params, request.key, request.uniforms)
            rows = e.shape[0]
            token, s = first_token(
                model, logits[first : first + rows], request.params, draws, request.uniforms is not None
            )
            tokens.append(token)
            seen.append(s)
            self._active.append(_Active(uid, request, draws, rows=rows))
            first += rows
        tokens = mx.concatenate(tokens if self._tokens is None else [self._tokens, *tokens])
        mx.async_eval(tokens)
        self._tokens = tokens
        self._seen = mx.concatenate(seen if self._seen is None else [self._seen, *seen])
        rows = BatchKVCache(cache.kv, cache.offset, pad, cache.step, self.window_size)
        if self._cache is None:
            self._cache = rows
        else:
            self._cache.extend(rows)

    def _rows(self, keep: list[int]) -> list[int]:
        """The T3 rows of the requests at ``keep``: their CFG pairs (or single rows without CFG)."""
        first = list(itertools.accumulate((a.rows for a in self._active), initial=0))
        return [r for i in keep for r in range(first[i], first[i] + self._active[i].rows)]

    def _lay_out(self) -> None:
        """What changes only when requests join or leave, kept on the device so that a step costs the host a
        few calls whatever the number of requests: which request each T3 row serves, each request's conditional
        and unconditional row (the conditional one twice without CFG), knobs, draw kind and its draws (padded
        to a table), how many tokens it has drawn, and the rows' left padding."""
        row_request, cond, uncond = [], [], []
        for i, a in enumerate(self._active):
            cond.append(len(row_request))
            uncond.append(len(row_request) + a.rows - 1)
            row_request += [i] * a.rows
        n = max(a.request.params.max_new_tokens for a in self._active)
        by_key = [a.draws.ndim == 2 for a in self._active]
        self._layout = {
            "row_request": mx.array(row_request, dtype=mx.int32),
            "cond": mx.array(cond, dtype=mx.int32),
            "uncond": mx.array(uncond, dtype=mx.int32),
            "knobs": row_knobs([a.request.params for a in self._active]),
            "by_uniform": mx.array([a.request.uniforms is not None for a in self._active]),
            # A request's draws[i] draws its token i; the entries past its own max_new_tokens are never read.
            "keys": mx.stack(
                [_fill(a.draws if k else None, n, (2,), mx.uint32) for a, k in zip(self._active, by_key)]
            ),
            "uniforms": mx.stack(
                [_fill(None if k else a.draws, n, (), mx.float32) for a, k in zip(self._active, by_key)]
            ),
            "last": mx.array([a.request.params.max_new_tokens - 1 for a in self._active], dtype=mx.int32),
            "pad": mx.array(self._cache.pad, dtype=mx.int32),
        }
        self._drawn = mx.array([a.drawn for a in self._active], dtype=mx.int32)
        # Work that no active request needs is left out of the step (it is traced once per such set).
        sampled = [a.request.params for a in self._active if not a.request.params.greedy]
        self._uses = (
            any(p.min_p > 0 for p in sampled),
            any(p.top_p < 1 for p in sampled),
            any(by_key),
            any(a.request.uniforms is not None for a in self._active),
        )

    def _queue_next(self) -> tuple[mx.array, mx.array]:
        """Feed every request's last token (token i at speech position i + 1, as alone) and draw the next with
        ``draws[i + 1]``; a request that ends with its last token draws again with its last draw, unread."""
        cache = self._cache
        at = mx.array([cache.claim(), cache.base], dtype=mx.int32)  # claim first: it may flush (move base)
        token, seen, self._drawn, cache.window = _batch_step(self.model, self._uses)(
            self._tokens, self._drawn, at, self._seen, self._layout, cache.kv, cache.window
        )
        mx.async_eval(token)
        return token, seen


def _fill(draws: mx.array | None, n: int, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """A request's draws as n rows of a draw table: zero-padded, or all zeros where it has none of this kind."""
    if draws is None:
        return mx.zeros((n, *shape), dtype=dtype)
    return mx.concatenate([draws.astype(dtype), mx.zeros((n - draws.shape[0], *shape), dtype=dtype)])


def _batch_step(model: T3, uses: tuple[bool, bool, bool, bool]):
    """The compiled batched decode step (traced again for each new number of rows or capacity; the token's
    position and the window's base are values, not shapes) for requests that use min_p, top_p, keyed draws,
    uniform draws, as ``uses`` says."""

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
            rows = layout["row_request"]
            # Drawn token i is fed back at speech position i + 1, the position ``drawn`` counts. The big
            # buffers are only read here (models/cache.py BatchKVCache: the step copies the windows alone).
            logits, window = model.decode_window(tokens[rows], drawn[rows], at, layout["pad"], kv, window)
            seen = seen | (vocab == tokens[:, None])
            knobs = layout["knobs"]
            x = process_rows(
                logits, layout["cond"], layout["uncond"], seen, knobs, min_p=uses[0], top_p=uses[1]
            )
            which = mx.minimum(drawn, layout["last"])
            requests = mx.arange(which.shape[0])
            keys, uniforms = layout["keys"][requests, which], layout["uniforms"][requests, which]
            token = draw_rows(x, knobs["greedy"], keys, uniforms, layout["by_uniform"], kinds=uses[2:])
            return token, seen, drawn + 1, window

        return step

    return compiled(model, ("batch", uses), build)
