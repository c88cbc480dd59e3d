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

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
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
    """A slot of the batch: its request's id, stop rule, draws and T3 rows, how many of its tokens were drawn so
    far, and whether it is dead (finished or cancelled but still in the batch's arrays, ``ContinuousBatch``).
    """

    uid: int
    request: BatchRequest
    draws: mx.array  # one key (2,) or uniform () per token
    rows: int = 1  # T3 rows: a CFG pair, or one
    drawn: int = 1  # the prefill draws token 0
    dead: bool = False
    table: tuple | None = None  # (rows, keys row, uniforms row) of the draw tables (``_draw_tables``)


def batch_size(requests: int) -> int:
    """The number of slots a batch of ``requests`` is laid out in: the smallest m * 2**k >= requests with m in
    4 .. 7 (1, 2, .. 8, 10, 12, 14, 16, 20, 24, ..): at most 25% idle slots, and 4 sizes per doubling, so that a
    batch whose requests come and go is traced for a few shapes, not for every count (ADR 14)."""
    if requests <= 8:
        return requests
    unit = 1 << (requests.bit_length() - 3)
    return -(-requests // unit) * unit


class ContinuousBatch:
    """What every T3's continuous batch shares (``SpeechTokenBatch`` here, Turbo's ``TurboTokenBatch``): the
    waiting and active requests, ``add``/``cancel``/``step``. A subclass checks requests (``_check``), says when
    a drawn token ends its request (``_ends``), and owns the device state (``_prefill``, ``_lay_out``,
    ``_queue_next``).

    The device arrays (tokens, seen-masks, the cache, the layout) keep their slots between joins, so that the
    compiled step keeps its shapes (ADR 14): a request that finishes or is cancelled stays in them, dead (its
    rows go on decoding, unread). A joining request takes a dead slot of its number of rows when the cache's
    positions hold its prefill (``BatchKVCache.put``: one copy of the cache, no new shape); else the dead slots
    go and the joining requests are appended, in ``batch_size`` slots whose idle ones are dead clones of a
    request. When half the slots or more are dead after the joins, the dead ones go too.

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
        self._active: list[_Active] = []
        # Device state of the slots, in their order: the last drawn (not yet read) token of each, the seen-masks,
        # how many tokens each has drawn, the cache of their T3 rows, and ``_lay_out``'s layout.
        self._tokens = self._seen = self._drawn = None
        self._cache: BatchKVCache | None = None
        self._layout: dict[str, mx.array] = {}
        self._ended = False  # a request ended since the last ``_trim`` (only then can the cache be trimmed)

    def add(self, request: BatchRequest) -> int:
        """Queue a request (checked now, prefilled at the next step); returns its id."""
        self._check(request)
        uid = next(self._uids)
        self._pending.append((uid, request))
        return uid

    def cancel(self, uid: int) -> None:
        """Drop a request that has not finished, waiting or decoding (it is never reported again)."""
        for j, (u, _) in enumerate(self._pending):
            if u == uid:
                del self._pending[j]
                return
        for a in self._active:
            if a.uid == uid and not a.dead:
                a.dead = self._ended = True
                return
        raise KeyError(f"request {uid} is not in the batch (finished, cancelled or never added)")

    def __len__(self) -> int:
        """Requests not finished yet, waiting or decoding."""
        return len(self._pending) + len(self._live())

    def step(self) -> list[tuple[int, int, bool]]:
        """Admit waiting requests, queue the next decode step, then read the tokens drawn by the last one (the
        device works on the next step while the host reads, as in ``generate_speech_tokens``)."""
        if self._pending:
            self._admit()
        live = self._live()
        if len(live) * 2 <= len(self._active):  # half the slots or more are dead, after the joins: drop them
            self._keep(live, batch_size(len(live)))
            if live:
                self._lay_out()
        if not self._active:
            return []
        if self._ended:
            self._trim(self._live())
        queued = self._queue_next()
        out, alive = [], False
        for a, token in zip(self._active, self._tokens.tolist()):
            if a.dead:
                continue
            finished = self._ends(a, token)
            out.append((a.uid, token, finished))
            a.dead = finished
            a.drawn += not finished
            alive |= not finished
        self._tokens, self._seen = queued
        self._ended |= any(finished for _, _, finished in out)
        if not alive:  # nothing left to step: the cache goes now, not at the next step
            self._keep([], 0)
        return out

    def _live(self) -> list[int]:
        return [i for i, a in enumerate(self._active) if not a.dead]

    def _trim(self, live: list[int]) -> None:
        """Drop the cache's positions before every live row's sequence, whole steps of them, once there are any
        (dead rows see only their last position): requests that take dead slots are right-aligned at the
        cache's end, so without this the cache would grow as long as the batch never empties. Only a request's
        end can make such positions, so ``step`` asks only after one."""
        self._ended = False
        cache = self._cache
        rows = self._rows(live)
        if min(cache.pad[r] for r in rows) < cache.step:
            return
        for r in set(range(len(cache.pad))) - set(rows):
            cache.pad[r] = cache.offset - 1
        cache.keep(list(range(len(cache.pad))))
        self._lay_out()

    def _admit(self) -> None:
        """Prefill the waiting requests and put them in dead slots (rows of their size, a cache long enough), or
        else next to the live requests, in ``batch_size`` slots."""
        pending, self._pending = self._pending, []
        joining, tokens, seen, rows = self._prefill(pending)
        slots = self._dead_slots(joining, rows.offset)
        if slots is not None:
            self._cache.put(self._rows(slots), rows)
            index = mx.array(slots, dtype=mx.int32)
            # New handles, as the cache's (BatchKVCache.flush): what the queued step holds stays as it is.
            self._tokens, self._seen = mx.array(self._tokens), mx.array(self._seen)
            self._tokens[index], self._seen[index] = tokens, seen
            mx.async_eval(self._tokens)
            for k, a in zip(slots, joining):
                self._active[k] = a
            self._lay_out()
            return
        live = self._live()
        size = batch_size(len(live) + len(joining))
        if live and (len(live) < len(self._active) or len(live) + len(joining) < size):
            self._keep(live, size - len(joining))  # the dead go; idle slots come before the joining ones
        elif not live:
            self._keep([], 0)
        self._active += joining
        self._tokens = tokens if self._tokens is None else mx.concatenate([self._tokens, tokens])
        mx.async_eval(self._tokens)
        self._seen = seen if self._seen is None else mx.concatenate([self._seen, seen])
        if self._cache is None:
            self._cache = rows
        else:
            self._cache.extend(rows)
        if len(self._active) < size:  # the batch was empty: the joining requests' own idle slots
            self._keep(list(range(len(self._active))), size)
        self._lay_out()

    def _dead_slots(self, joining: list[_Active], length: int) -> list[int] | None:
        """A dead slot of the same number of rows for each joining request, if there are enough and the cache's
        positions hold ``length`` (their prefill's); else None."""
        if self._cache is None or self._cache.offset < length:
            return None
        free, slots = [k for k, a in enumerate(self._active) if a.dead], []
        for a in joining:
            k = next((k for k in free if self._active[k].rows == a.rows), None)
            if k is None:
                return None
            free.remove(k)
            slots.append(k)
        return slots

    def _draw_tables(self) -> tuple[mx.array, mx.array]:
        """Every slot's draws as a row of a keys table and of a uniforms table (zeros where it has none of the
        kind), ``table_rows`` long: a request's draws[i] draws its token i, the entries past its own are never
        read. A slot's rows are made once and kept with it, so that laying out the batch costs the host one op
        a table, not a few a slot."""
        n = table_rows(a.draws.shape[0] for a in self._active)
        for a in self._active:
            if a.table is None or a.table[0] != n:
                keyed = a.draws.ndim == 2
                keys = _fill(a.draws if keyed else None, n, (2,), mx.uint32)
                a.table = (n, keys, _fill(None if keyed else a.draws, n, (), mx.float32))
        return mx.stack([a.table[1] for a in self._active]), mx.stack([a.table[2] for a in self._active])

    def _rows(self, slots: list[int]) -> list[int]:
        """The cache rows of the slots, in that order."""
        first = list(itertools.accumulate((a.rows for a in self._active), initial=0))
        return [r for k in slots for r in range(first[k], first[k] + self._active[k].rows)]

    def _keep(self, keep: list[int], size: int) -> None:
        """Keep the slots at ``keep`` (in that order), then dead clones of the first (rows and all) up to
        ``size`` slots; nothing at all when ``keep`` is empty. The caller lays them out."""
        if not keep:
            self._active = []
            self._tokens = self._seen = self._drawn = self._cache = None
            return
        slots = keep + [keep[0]] * (size - len(keep))
        self._cache.keep(self._rows(slots))
        index = mx.array(slots, dtype=mx.int32)
        self._tokens, self._seen = self._tokens[index], self._seen[index]
        self._active = [
            a if i < len(keep) else dataclasses.replace(a, uid=-1, dead=True)
            for i, a in enumerate(self._active[k] for k in slots)
        ]


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

    def _prefill(
        self, pending: list[tuple[int, BatchRequest]]
    ) -> tuple[list[_Active], mx.array, mx.array, BatchKVCache]:
        """Prefill the waiting requests together, their rows left-padded to the longest (one prefill call for
        them all: T3 is host-bound per call, ADR 9): their slots, first tokens, seen-masks and cache rows."""
        model, embeds = self.model, []
        for _, request in pending:
            embeds.append(request_embeds(model, request.voice, request.text_ids, request.params))
        n = max(e.shape[1] for e in embeds)
        pad = [n - e.shape[1] for e in embeds for _ in range(e.shape[0])]
        x = mx.concatenate([mx.pad(e, [(0, 0), (n - e.shape[1], 0), (0, 0)]) for e in embeds])
        logits, cache = model.prefill(x, pad=mx.array(pad, dtype=mx.int32) if any(pad) else None)
        joining, tokens, seen, first = [], [], [], 0
        for (uid, request), e in zip(pending, embeds):
            draws = make_draws(request.params, request.key, request.uniforms)
            rows = e.shape[0]
            token, s = first_token(
                model, logits[first : first + rows], request.params, draws, request.uniforms is not None
            )
            tokens.append(token)
            seen.append(s)
            joining.append(_Active(uid, request, draws, rows=rows))
            first += rows
        rows = BatchKVCache(cache.kv, cache.offset, pad, cache.step, self.window_size)
        return joining, mx.concatenate(tokens), mx.concatenate(seen), rows

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
        by_key = [a.draws.ndim == 2 for a in self._active]
        keys, uniforms = self._draw_tables()
        self._layout = {
            "row_request": mx.array(row_request, dtype=mx.int32),
            "cond": mx.array(cond, dtype=mx.int32),
            "uncond": mx.array(uncond, dtype=mx.int32),
            "knobs": row_knobs([a.request.params for a in self._active]),
            "by_uniform": mx.array([a.request.uniforms is not None for a in self._active]),
            "keys": keys,
            "uniforms": uniforms,
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


def table_rows(lengths: Iterable[int]) -> int:
    """Rows of a draw table for draws of these lengths: the longest, rounded up to 256 so that the table's shape
    (an input of the compiled step) changes seldom as requests of other budgets come and go."""
    return -(-max(lengths) // 256) * 256


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
            # A dead slot goes on stepping (ContinuousBatch): its speech position stops at the one after its
            # last token, which a live request never passes, so that it stays inside the position table.
            fed = mx.minimum(drawn, layout["last"] + 1)[rows]
            logits, window = model.decode_window(tokens[rows], fed, at, layout["pad"], kv, window)
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
