"""Per-call generation knobs and T3's logits chain, in upstream order (``T3.inference``, architecture §3.6):
CFG combine -> repetition penalty -> temperature -> min_p -> top_p -> draw. Turbo and Nano have their own
knobs and order (``TurboParams``, ``process_turbo_logits``; variants.md §2.8):
temperature -> top_k -> top_p -> repetition penalty -> draw.

Each step is a small pure function on device arrays; nothing here synchronises with the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693145751953125, 1.428606765330187e-06  # ln 2 split so that k * _LN2_HI is exact

# Below this temperature we take the argmax: dividing by ~0 is how other ports produced NaNs, and sampling at
# such a temperature is greedy decoding anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Knobs of one generation call; defaults are upstream ``ChatterboxTTS.generate``'s."""

    temperature: float = 0.8  # 0 (anything below 1e-5) means greedy decoding
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]; 1 disables it
    min_p: float = 0.05  # drop tokens below min_p * p_max, in [0, 1]; 0 disables it
    repetition_penalty: float = 1.2  # > 0; 1 disables it
    cfg_weight: float = 0.5  # classifier-free guidance weight, >= 0; 0 runs without the unconditional row
    exaggeration: float = 0.5  # emotion exaggeration of the voice, >= 0
    max_new_tokens: int = 1000  # speech tokens to generate at most (25 per second of audio)

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, allowed: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not ok:
                raise ValueError(f"{name}={value!r} is out of range: it must be {allowed}")

        def real(name: str) -> bool:
            v = getattr(self, name)
            return isinstance(v, (int, float)) and math.isfinite(v)

        check("temperature", real("temperature") and self.temperature >= 0, "a number >= 0 (0 = greedy)")
        check("top_p", real("top_p") and 0 < self.top_p <= 1, "in (0, 1]")
        check("min_p", real("min_p") and 0 <= self.min_p <= 1, "in [0, 1]")
        check(
            "repetition_penalty", real("repetition_penalty") and self.repetition_penalty > 0, "a number > 0"
        )
        check("cfg_weight", real("cfg_weight") and self.cfg_weight >= 0, "a number >= 0")
        check("exaggeration", real("exaggeration") and self.exaggeration >= 0, "a number >= 0")
        check(
            "max_new_tokens",
            isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
            "an integer >= 1",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


SEED_LIMIT = 2**63  # mx.random.key takes seeds in [0, 2**64); piece i of a long text is spoken with seed + i


def check_seed(seed: int | None) -> None:
    """A seed MLX can take (None: a fresh one is drawn)."""
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT
    ):
        raise ValueError(f"seed={seed!r} is out of range: it must be an integer in [0, 2**63)")


def check_max_new_tokens(max_new_tokens: int, most: int) -> None:
    """``max_new_tokens`` against the most a model takes (its T3 config's ``most_new_tokens``)."""
    if max_new_tokens > most:
        raise ValueError(f"max_new_tokens={max_new_tokens} is out of range: at most {most}")


def seed_keys(seed: int) -> tuple[mx.array, mx.array]:
    """Independent PRNG keys for T3's draws and S3Gen's noise from one user seed."""
    check_seed(seed)
    t3, s3gen = mx.random.split(mx.random.key(seed))
    return t3, s3gen


def _exp(x: mx.array) -> mx.array:
    """exp for x <= 0 to about 1e-7 relative error. MLX's CPU exp is a fast approximation (up to ~4e-6),
    which would put our distributions visibly off upstream's; this is Cody-Waite range reduction plus a
    degree-7 Taylor polynomial on |r| <= ln(2) / 2, scaled by 2^k built from exponent bits."""
    x = mx.maximum(x, -110.0)  # exp(-110) underflows to 0 in fp32; -inf lands here too
    k = mx.round(x * _LOG2E)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = mx.array(1 / 5040, dtype=mx.float32)
    for c in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0):
        p = p * r + c
    # 2^k as two exact powers of two, so that results down in the subnormal range round only once.
    k = k.astype(mx.int32)
    half = k // 2
    return p * mx.view((half + 127) << 23, mx.float32) * mx.view((k - half + 127) << 23, mx.float32)


def _sum(x: mx.array, width: int = 16) -> mx.array:
    """Sum over the last axis (kept) as a tree of ``width``-wide partial sums. A plain fp32 reduction over
    8194 probabilities drifted by ~3e-6 here (MLX's CPU sum accumulates sequentially); torch sums pairwise."""
    while x.shape[-1] > 1:
        pad = -x.shape[-1] % width
        if pad:
            x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
        x = x.reshape(*x.shape[:-1], -1, width).sum(axis=-1)
    return x


def mlx_math() -> bool:
    """Whether softmax uses MLX's own exp and sum: on a GPU, where they are accurate (CUDA's expf, Metal's exp
    without fast math, tree reductions) and about 20 fewer primitives than ``_exp`` and ``_sum``, each some
    microseconds of host time in every decode step; not on the CPU (a fast exp, a sequential sum)."""
    return mx.default_device() != mx.cpu


def _numerators(logits: mx.array) -> tuple[mx.array, mx.array]:
    """A softmax's numerators exp(x - max of the row) and their row sums (kept axis); -inf gives 0, and the
    row's largest logit exactly 1."""
    e = logits - logits.max(axis=-1, keepdims=True)
    if mlx_math():
        e = mx.exp(e)
        return e, e.sum(axis=-1, keepdims=True)
    e = _exp(e)
    return e, _sum(e)


def softmax(logits: mx.array) -> mx.array:
    """Softmax over the last axis (``_numerators``); -inf logits get probability 0."""
    e, total = _numerators(logits)
    return e / total


def cfg_combine(logits: mx.array, weight: float) -> mx.array:
    """(B, V) logits with the conditional row first -> (1, V); a batch of one passes through."""
    if logits.shape[0] == 1:
        return logits
    cond, uncond = logits[0:1], logits[1:2]
    return cond + weight * (cond - uncond)


def repetition_penalty(logits: mx.array, seen: mx.array, penalty: float) -> mx.array:
    """HF's penalty over the ids marked in the boolean ``seen`` mask (upstream: start-of-speech + all
    generated ids): positive logits divided by ``penalty``, negative ones multiplied."""
    if penalty == 1.0:
        return logits
    penalised = mx.where(logits < 0, logits * penalty, logits / penalty)
    return mx.where(seen, penalised, logits)


def apply_temperature(logits: mx.array, temperature: float) -> mx.array:
    """Upstream divides by the temperature unless it is 1. We subtract the row maximum first: softmax, min_p
    and top_p are shift-invariant, and the shift keeps a tiny temperature from overflowing into NaN."""
    if temperature == 1.0:
        return logits
    return (logits - logits.max(axis=-1, keepdims=True)) / temperature


def min_p_filter(logits: mx.array, min_p: float) -> mx.array:
    """HF ``MinPLogitsWarper``: drop ids with p < min_p * max(p); the arg-max always survives."""
    if min_p == 0.0:
        return logits
    return _min_p_rows(logits, min_p)


def top_p_filter(logits: mx.array, top_p: float) -> mx.array:
    """HF ``TopPLogitsWarper``: sort ascending, drop ids whose cumulative probability is <= 1 - top_p, always
    keep the most likely id. Nothing is divided, so underflowed probabilities cannot produce NaN."""
    if top_p >= 1.0:
        # Upstream then drops only ids of probability exactly 0, which can never be drawn anyway.
        return logits
    return _top_p_rows(logits, 1 - top_p)  # compared in float32, as row_knobs rounds it


def process_logits(logits: mx.array, seen: mx.array, params: SamplingParams) -> mx.array:
    """The whole chain before the draw: (B, V) backbone logits -> (1, V) filtered logits."""
    x = cfg_combine(logits.astype(mx.float32), params.cfg_weight)
    x = repetition_penalty(x, seen, params.repetition_penalty)
    if params.greedy:
        return x  # min_p and top_p keep the arg-max, so greedy needs neither
    x = apply_temperature(x, params.temperature)
    x = min_p_filter(x, params.min_p)
    return top_p_filter(x, params.top_p)


def draw(
    logits: mx.array, params: SamplingParams, key: mx.array | None, uniform: mx.array | None
) -> mx.array:
    """Pick the next id, shape (1,), from processed (1, V) logits: the arg-max when greedy, else a categorical
    draw with ``key``, or, when ``uniform`` (a scalar in [0, 1)) is given, the inverse-CDF draw
    ``min{i : cdf_i > u * cdf_last}`` (the hook through which tests inject upstream's random draws)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    if uniform is not None:
        cdf = mx.cumsum(softmax(logits), axis=-1)
        idx = (cdf <= uniform * cdf[:, -1:]).sum(axis=-1)
        return mx.minimum(idx, logits.shape[-1] - 1).astype(mx.int32)
    return gumbel_max(logits, key)


def gumbel_max(logits: mx.array, key: mx.array) -> mx.array:
    """A categorical draw from a row of (V,) or (1, V) logits (the same noise: MLX draws by element count):
    the arg-max of logits + Gumbel noise drawn with ``key``. Written out rather than ``mx.random.categorical``
    so that ``mx.vmap`` draws many rows, each with its own key, in one go, each exactly as alone
    (``draw_rows``)."""
    return mx.argmax(logits + mx.random.gumbel(logits.shape, key=key), axis=-1).astype(mx.int32)


# --- many requests at once (generation/batch.py) ---

ROW_KNOBS = ("cfg_weight", "repetition_penalty", "temperature", "min_p", "top_p")


def row_knobs(params: list[SamplingParams]) -> dict[str, mx.array]:
    """Each request's knobs as a (R, 1) float32 column, and ``greedy`` as a (R, 1) bool column."""
    knobs = {k: mx.array([[getattr(p, k)] for p in params], dtype=mx.float32) for k in ROW_KNOBS}
    knobs["greedy"] = mx.array([[p.greedy] for p in params])
    # 1 - top_p in double precision, then rounded, as ``top_p_filter`` compares with it: 1 - float32(0.95) is
    # 0.0500000119, float32(1 - 0.95) 0.0500000007, and a row must drop what it drops alone.
    knobs["top_p_tail"] = mx.array([[1.0 - p.top_p] for p in params], dtype=mx.float32)
    return knobs


def process_rows(
    logits: mx.array,
    cond: mx.array,
    uncond: mx.array,
    seen: mx.array,
    knobs: dict[str, mx.array],
    *,
    min_p: bool = True,
    top_p: bool = True,
) -> mx.array:
    """``process_logits`` for R requests at once, each with its own knobs (``row_knobs``), row for row the same
    numbers: (B, V) backbone logits, whose rows ``cond`` (R,) and ``uncond`` (R,) are each request's CFG pair
    (the same row twice for a request without CFG: c + w·(c - c) is c), and (R, V) ``seen`` -> (R, V).
    Greedy rows come back after the repetition penalty, as ``process_logits`` returns them.
    min_p, top_p: False where no row uses that filter (min_p 0, top_p 1), which skips its work (the sort)."""
    x = logits.astype(mx.float32)
    c, u = x[cond], x[uncond]
    x = c + knobs["cfg_weight"] * (c - u)
    # A penalty of 1 multiplies or divides by 1, which is exact: no row needs to skip it.
    p = knobs["repetition_penalty"]
    x = mx.where(seen, mx.where(x < 0, x * p, x / p), x)
    greedy, t = knobs["greedy"], knobs["temperature"]
    # apply_temperature per row (a greedy row's temperature, ~0, is never used: its row is x).
    sampled = mx.where(t == 1.0, x, (x - x.max(axis=-1, keepdims=True)) / mx.where(greedy, 1.0, t))
    # min_p = 0 drops nothing (p < 0 never holds); top_p = 1 is skipped as top_p_filter skips it.
    if min_p:
        sampled = _min_p_rows(sampled, knobs["min_p"])
    if top_p:
        sampled = mx.where(knobs["top_p"] >= 1.0, sampled, _top_p_rows(sampled, knobs["top_p_tail"]))
    return mx.where(greedy, x, sampled)


def _min_p_rows(logits: mx.array, min_p: float | mx.array) -> mx.array:
    """``min_p_filter`` with ``min_p`` a number or (R, 1) per row (``row_knobs``). The largest p is 1 / total
    (its numerator is exactly 1): the same float32 number as the row maximum of the probabilities, without
    that reduction."""
    e, total = _numerators(logits)
    return mx.where(e / total < min_p * (1.0 / total), -mx.inf, logits)


def _top_p_rows(logits: mx.array, tail: float | mx.array) -> mx.array:
    """``top_p_filter`` with the threshold ``tail`` = 1 - top_p, a number or (R, 1) per row (``row_knobs``)."""
    order = mx.argsort(logits, axis=-1)
    cumulative = mx.cumsum(softmax(mx.take_along_axis(logits, order, axis=-1)), axis=-1)
    keep_last = mx.arange(logits.shape[-1]) == logits.shape[-1] - 1
    drop_sorted = (cumulative <= tail) & ~keep_last
    # order is a permutation, so the scatter writes every id: its base needs no zeros of its own.
    drop = mx.put_along_axis(drop_sorted, order, drop_sorted, axis=-1)
    return mx.where(drop, -mx.inf, logits)


def draw_rows(
    logits: mx.array,
    greedy: mx.array,
    keys: mx.array,
    uniforms: mx.array,
    by_uniform: mx.array,
    *,
    kinds: tuple[bool, bool] = (True, True),
) -> mx.array:
    """``draw`` for R rows of processed logits (``process_rows``), each as its request would draw alone: the
    arg-max where ``greedy`` (R, 1); else the inverse-CDF draw of ``uniforms`` (R,) where ``by_uniform`` (R,);
    else a categorical draw with the row's own key, ``keys`` (R, 2).
    kinds: whether any row draws by key, and whether any draws by uniform (a kind no row uses is skipped)."""
    drawn = draw_turbo_rows(logits, keys, uniforms, by_uniform, kinds=kinds)
    return mx.where(greedy[:, 0], mx.argmax(logits, axis=-1), drawn).astype(mx.int32)


# --- Turbo and Nano (upstream ``T3.inference_turbo``, variants.md §2.8) ---


@dataclass(frozen=True)
class TurboParams:
    """Knobs of one Turbo/Nano generation call; defaults are upstream ``ChatterboxTurboTTS.generate``'s.

    Integer temperature, top_p or repetition_penalty are taken as floats (upstream raises on an int
    temperature or penalty; variants.md §6 row 2). Turbo has no CFG, min_p or exaggeration: there are no
    such knobs here.
    """

    # Upstream divides only when T > 0 and T != 1: T = 0 means *no* scaling, and it still samples (at T = 1),
    # it is not greedy decoding (§6 row 2). We keep that meaning.
    temperature: float = 0.8  # >= 0
    top_k: int = 1000  # keep the logits >= the k-th largest (ties survive), integer >= 0; 0 disables it
    top_p: float = 0.95  # nucleus mass kept, in [0, 1]; 1 disables it
    repetition_penalty: float = 1.2  # > 0, applied last; 1 disables it
    max_new_tokens: int = (
        1000  # decode steps after the first token (upstream max_gen_len): <= 1 + this many tokens
    )

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))

        def check(name: str, ok: bool, allowed: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not ok:
                raise ValueError(f"{name}={value!r} is out of range: it must be {allowed}")

        def real(name: str) -> bool:
            v = getattr(self, name)
            return isinstance(v, float) and math.isfinite(v)

        def integer(name: str) -> bool:
            return isinstance(getattr(self, name), int)

        check(
            "temperature",
            real("temperature") and self.temperature >= 0,
            "a number >= 0 (0 and 1 leave the logits unscaled)",
        )
        check("top_k", integer("top_k") and self.top_k >= 0, "an integer >= 0 (0 disables it)")
        check("top_p", real("top_p") and 0 <= self.top_p <= 1, "in [0, 1] (1 disables it)")
        check(
            "repetition_penalty",
            real("repetition_penalty") and self.repetition_penalty > 0,
            "a number > 0 (1 disables it)",
        )
        check("max_new_tokens", integer("max_new_tokens") and self.max_new_tokens >= 0, "an integer >= 0")


def top_k_filter(logits: mx.array, top_k: int) -> mx.array:
    """HF ``TopKLogitsWarper``: -inf for every logit strictly below the k-th largest (counted with repeats),
    so ties with it survive; k is capped at the vocabulary size, and k <= 0 filters nothing."""
    k = min(top_k, logits.shape[-1])
    if k <= 0 or k == logits.shape[-1]:
        return logits  # all V kept: nothing is below the smallest value
    v = logits.shape[-1]
    kth = mx.partition(logits, v - k, axis=-1)[..., v - k : v - k + 1]  # the k-th largest: one primitive less
    return mx.where(logits < kth, -mx.inf, logits)


def process_turbo_logits(logits: mx.array, seen: mx.array, params: TurboParams) -> mx.array:
    """Upstream Turbo's chain in its order: temperature -> top_k -> top_p -> repetition penalty, on (B, V)
    speech logits; ``seen`` (B, V) bool marks the history ids (upstream: [start-of-speech] at the first token,
    then the generated ids). The penalty comes last, after the division: a logit's sign, which decides
    whether it is divided or multiplied, is that of the tempered logit, so the temperature here is a plain
    division, without ``apply_temperature``'s max shift."""
    x = logits.astype(mx.float32)
    t = params.temperature
    if t > 0 and t != 1.0:
        x = x / t
    x = top_k_filter(x, params.top_k)
    x = top_p_filter(x, params.top_p)
    # -inf entries stay -inf (-inf·r), as upstream's gather/scatter leaves them.
    return repetition_penalty(x, seen, params.repetition_penalty)


def draw_turbo(logits: mx.array, key: mx.array | None = None, uniform: mx.array | None = None) -> mx.array:
    """Sample the next id, shape (1,), from processed (1, V) logits (upstream: softmax, then multinomial): a
    categorical draw with ``key``, or with ``uniform`` (a scalar in [0, 1)) the inverse-CDF draw
    ``min{i : cdf_i > u * cdf_last}`` (how tests inject upstream's draws). Exactly one of the two is given."""
    if (key is None) == (uniform is None):
        raise ValueError("give exactly one of key and uniform")
    if uniform is not None:
        cdf = mx.cumsum(softmax(logits), axis=-1)
        idx = (cdf <= uniform * cdf[:, -1:]).sum(axis=-1)
        return mx.minimum(idx, logits.shape[-1] - 1).astype(mx.int32)
    return gumbel_max(logits, key)


# --- Turbo and Nano, many requests at once (generation/turbo_batch.py) ---


def turbo_row_knobs(params: list[TurboParams]) -> dict[str, mx.array]:
    """Each request's Turbo knobs as (R, 1) columns, in the form ``process_turbo_rows`` reads them. What
    ``process_turbo_logits`` decides or computes in Python is decided or computed here, in Python, so that
    every row gets the same float32 numbers: ``1 - top_p`` is rounded to float32 once, from the double (as
    the scalar chain compares with it), not computed in float32."""

    def column(values: list, dtype: mx.Dtype) -> mx.array:
        return mx.array([[v] for v in values], dtype=dtype)

    return {
        # x / 1 is exact, so the rows the scalar chain does not scale divide by 1.
        "temperature": column([p.temperature if p.temperature > 0 else 1.0 for p in params], mx.float32),
        "top_k": column([min(p.top_k, 2**31 - 1) for p in params], mx.int32),
        "top_p": column([p.top_p < 1.0 for p in params], mx.bool_),
        "top_p_tail": column([1 - p.top_p for p in params], mx.float32),
        "repetition_penalty": column([p.repetition_penalty for p in params], mx.float32),
    }


def process_turbo_rows(
    logits: mx.array, seen: mx.array, knobs: dict[str, mx.array], *, top_k: bool = True, top_p: bool = True
) -> mx.array:
    """``process_turbo_logits`` for R requests at once, each with its own knobs (``turbo_row_knobs``), row for
    row the same numbers: (R, V) speech logits and (R, V) ``seen`` -> (R, V).
    top_k, top_p: False where no row uses that filter (top_k 0 or >= V, top_p 1), which skips its sort."""
    x = logits.astype(mx.float32) / knobs["temperature"]
    if top_k:
        v = x.shape[-1]
        k = mx.minimum(knobs["top_k"], v)
        on = (k > 0) & (k < v)
        # The k-th largest with repeats (what top_k_filter's topk min is), from an ascending sort.
        kth = mx.take_along_axis(mx.sort(x, axis=-1), mx.where(on, v - k, 0), axis=-1)
        x = mx.where(on & (x < kth), -mx.inf, x)
    if top_p:
        x = mx.where(knobs["top_p"], _top_p_rows(x, knobs["top_p_tail"]), x)
    # A penalty of 1 multiplies or divides by 1, which is exact: no row needs to skip it.
    p = knobs["repetition_penalty"]
    return mx.where(seen, mx.where(x < 0, x * p, x / p), x)


def draw_turbo_rows(
    logits: mx.array,
    keys: mx.array,
    uniforms: mx.array,
    by_uniform: mx.array,
    *,
    kinds: tuple[bool, bool] = (True, True),
) -> mx.array:
    """``draw_turbo`` for R rows of processed logits (``process_turbo_rows``), each as its request would draw
    alone: the inverse-CDF draw of ``uniforms`` (R,) where ``by_uniform`` (R,), else a categorical draw with
    the row's own key, ``keys`` (R, 2). Returns (R,) int32.
    kinds: whether any row draws by key, and whether any draws by uniform (a kind no row uses is skipped)."""
    drawn = mx.zeros(logits.shape[:1], mx.int32)
    if kinds[0]:
        drawn = mx.vmap(gumbel_max)(logits, keys)  # each row with its own key, as alone
    if kinds[1]:
        cdf = mx.cumsum(softmax(logits), axis=-1)
        by_cdf = mx.minimum((cdf <= uniforms[:, None] * cdf[:, -1:]).sum(axis=-1), logits.shape[-1] - 1)
        drawn = mx.where(by_uniform, by_cdf.astype(mx.int32), drawn)
    return drawn.astype(mx.int32)
