"""The sampling chain after the head as one CUDA kernel (issue 25). Turbo and Nano (``turbo_pick``): mark the fed
token as seen, temperature -> top_k -> top_p -> repetition penalty (``sampling.process_turbo_logits``), then
the draw and the all -inf check (``generation/turbo._pick``). English and multilingual (``english_pick``):
mark the fed token, classifier-free guidance -> repetition penalty -> temperature -> min_p
(``sampling.process_logits``), then the draw (``sampling.draw``). Composed of MLX's ops a chain is 15-20
primitives a decode step (Turbo's with a partition and an argsort of the whole vocabulary), each some
microseconds of host time and a single-block kernel on the GPU; here it is one primitive, plus two for the
Gumbel noise when drawing by key.

The same numbers as the composed chain, except where a sum's order differs: top_p's, min_p's and the
inverse-CDF draw's sums of probabilities are taken in another order than MLX's softmax, sum and cumsum, so a
threshold within a rounding error of one could fall the other way (tests/test_decode_cuda.py compares the
two). Only on CUDA (``layers._use_cuda_paths``); every other backend runs the composed chain.
"""

from __future__ import annotations

import mlx.core as mx

from ..models import layers
from ..sampling import SamplingParams, TurboParams

# False keeps the composed chain on CUDA too (benchmarks/probe_step.py compares the two in one run).
SAMPLING_KERNEL = True
# English's chain (``english_pick``) stays composed until its tests in tests/test_decode_cuda.py have run on a
# GPU: a kernel that has not run does not ship (the probes' "ours-english-sampling" turns it on).
ENGLISH_SAMPLING_KERNEL = False

# The kernel's one block: 1024 threads, each holding ceil(V / 1024) logits in registers; top_p sorts the kept
# logits' keys (8 bytes each, a power of two of them) in dynamic shared memory, 64 KiB at most.
_THREADS = 1024
_MAX_VOCAB = 8 * _THREADS

_HEADER = """
constexpr int THREADS = 1024;

// Reductions over the block's 32 warps, the same order every call; buf holds 32 values.
template <typename U, typename F>
__device__ U block_reduce(U v, F op, U* buf) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) buf[threadIdx.x >> 5] = v;
  __syncthreads();
  v = buf[threadIdx.x & 31];
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  return v;
}

// The block's exclusive prefix sum of v in thread order, and the total.
template <typename U>
__device__ U block_exclusive_scan(U v, U* buf, U& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  U inclusive = v;
  for (int o = 1; o < 32; o <<= 1) {
    U y = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += y;
  }
  if (lane == 31) buf[warp] = inclusive;
  __syncthreads();
  U w = buf[lane];
  U w_inclusive = w;
  for (int o = 1; o < 32; o <<= 1) {
    U y = __shfl_up_sync(0xffffffffu, w_inclusive, o);
    if (lane >= o) w_inclusive += y;
  }
  total = __shfl_sync(0xffffffffu, w_inclusive, 31);
  U before = __shfl_sync(0xffffffffu, w_inclusive - w, warp);
  __syncthreads();
  return before + inclusive - v;
}

// The warp's largest value and its first id, in every lane. A macro, not a function: the code as written
// out at each use is what ran on the H200 (a device function compiled to other instructions).
#define WARP_ARGMAX(best, at)                                        \
  for (int o = 16; o > 0; o >>= 1) {                                 \
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);          \
    const int oa = __shfl_xor_sync(0xffffffffu, at, o);              \
    if (ob > best || (ob == best && oa < at)) {                      \
      best = ob;                                                     \
      at = oa;                                                       \
    }                                                                \
  }

// Unsigned keys in the order of the floats (-0 taken as +0, which compares equal to it).
__device__ unsigned order_key(float v) {
  unsigned b = __float_as_uint(v == 0.0f ? 0.0f : v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ float key_value(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
"""

# The kernel's source in pieces, put together in each model's order: Turbo's temperature, top_k, top_p and
# penalty; English's guidance, penalty, temperature and min_p. Template flags switch each piece on or off.
_DECLARATIONS = """
constexpr int E = (V + THREADS - 1) / THREADS;
const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
__shared__ float f_buf[32];
__shared__ int i_buf[32];
__shared__ unsigned hist[256];
__shared__ unsigned bin_found, below_found;
__shared__ unsigned char dropped[E * THREADS];
extern __shared__ unsigned long long order[];  // top_p's sort (dynamic: the kernel's shared_memory)
auto fmax_ = [](float a, float b) { return fmaxf(a, b); };
auto fadd_ = [](float a, float b) { return a + b; };
auto iadd_ = [](int a, int b) { return a + b; };

const int base = t * E;
const int fed = token[0];
float x[E];
"""

_LOAD = """#pragma unroll
for (int e = 0; e < E; ++e) {
  const int i = base + e;
  x[e] = -INFINITY;
  if (i < V) {
    x[e] = static_cast<float>(logits[i]);
    if (SCALE) x[e] = x[e] / knobs[0];
  }
}

"""

_TOP_K = """if (TOP_K) {
  // The top_k-th largest logit (repeats counted) by radix selection: the value at ascending rank V - k.
  int rank = V - static_cast<int>(knobs[3]);
  unsigned prefix = 0, mask = 0;
  unsigned keys[E];
#pragma unroll
  for (int e = 0; e < E; ++e) keys[e] = order_key(x[e]);
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (t < 256) hist[t] = 0;
    __syncthreads();
    // One atomic per distinct bin a warp holds: most logits share a few bins of the top byte, and one atomic
    // each on those few counters was most of the kernel's time.
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const bool in = base + e < V && (keys[e] & mask) == prefix;
      const unsigned bin = in ? (keys[e] >> shift) & 255u : 256u;
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (in && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
    }
    __syncthreads();
    if (warp == 0) {
      unsigned counts[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        counts[j] = hist[8 * lane + j];
        sum += counts[j];
      }
      unsigned inclusive = sum;
      for (int o = 1; o < 32; o <<= 1) {
        unsigned y = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += y;
      }
      unsigned acc = inclusive - sum;
      if (acc <= (unsigned)rank && (unsigned)rank < inclusive) {
        for (int j = 0; j < 8; ++j) {
          if ((unsigned)rank < acc + counts[j]) {
            bin_found = 8 * lane + j;
            below_found = acc;
            break;
          }
          acc += counts[j];
        }
      }
    }
    __syncthreads();
    prefix |= bin_found << shift;
    mask |= 255u << shift;
    rank -= below_found;
    __syncthreads();
  }
  const float kth = key_value(prefix);
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = x[e] < kth ? -INFINITY : x[e];
}

"""

_TOP_P = """if (TOP_P) {
  // Drop ids whose cumulative probability in ascending order (ties by id, as a stable sort) is <= 1 - top_p,
  // the largest never: the kept logits sorted (bitonic, in dynamic shared memory) by value then id, then
  // summed in that order, each thread a run of them.
  float m = -INFINITY;
#pragma unroll
  for (int e = 0; e < E; ++e) m = fmaxf(m, x[e]);
  m = block_reduce(m, fmax_, f_buf);
  if (m > -INFINITY) {
    float sum = 0.0f;
    int finite = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      sum += expf(x[e] - m);
      finite += x[e] > -INFINITY;
    }
    const float total = block_reduce(sum, fadd_, f_buf);
    int kept;
    int slot = block_exclusive_scan(finite, i_buf, kept);
    int n = 1;
    while (n < kept) n <<= 1;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if (x[e] > -INFINITY) order[slot++] = ((unsigned long long)order_key(x[e]) << 32) | (base + e);
      if (base + e < V) dropped[base + e] = 0;
    }
    for (int i = kept + t; i < n; i += THREADS) order[i] = ~0ull;
    __syncthreads();
    for (int k = 2; k <= n; k <<= 1) {
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int i = t; i < n / 2; i += THREADS) {
          const int lo = ((i & ~(j - 1)) << 1) | (i & (j - 1)), hi = lo + j;
          const unsigned long long a = order[lo], b = order[hi];
          if ((a > b) == ((lo & k) == 0)) {
            order[lo] = b;
            order[hi] = a;
          }
        }
        __syncthreads();
      }
    }
    const int run = (n + THREADS - 1) / THREADS, first = t * run;
    float own = 0.0f;
    for (int r = first; r < min(first + run, kept); ++r) own += expf(key_value(order[r] >> 32) - m) / total;
    float last;
    float cumulative = block_exclusive_scan(own, f_buf, last);
    for (int r = first; r < min(first + run, kept); ++r) {
      cumulative += expf(key_value(order[r] >> 32) - m) / total;
      if (cumulative <= knobs[1] && r < kept - 1) dropped[order[r] & 0xffffffffu] = 1;
    }
    __syncthreads();
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if (base + e < V && dropped[base + e]) x[e] = -INFINITY;
    }
  }
}

"""

_PENALTY = """#pragma unroll
for (int e = 0; e < E; ++e) {
  const int i = base + e;
  if (i < V) {
    const bool s = seen[i] || i == fed;
    seen_out[i] = s;
    if (PENALTY && s) x[e] = x[e] < 0.0f ? x[e] * knobs[2] : x[e] / knobs[2];
  }
}

"""

_DRAW = """float m = -INFINITY;
#pragma unroll
for (int e = 0; e < E; ++e) m = fmaxf(m, x[e]);
m = block_reduce(m, fmax_, f_buf);
int drawn;
if (BY_UNIFORM) {
  // Inverse CDF: the number of ids whose cumulative probability is <= u * the last one.
  float p[E], sum = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    p[e] = expf(x[e] - m);
    sum += p[e];
  }
  const float total = block_reduce(sum, fadd_, f_buf);
  float own = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    p[e] = p[e] / total;
    own += p[e];
  }
  float last;
  float cumulative = block_exclusive_scan(own, f_buf, last);
  const float bar = draws[0] * last;
  int below = 0;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    cumulative += p[e];
    below += (base + e < V) && cumulative <= bar;
  }
  drawn = min(block_reduce(below, iadd_, i_buf), V - 1);
} else {
  // Gumbel-max: the first id of the largest logit + noise.
  float best = -INFINITY;
  int at = V;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    if (base + e < V) {
      const float y = x[e] + draws[base + e];
      if (y > best || at == V) {
        best = y;
        at = base + e;
      }
    }
  }
  WARP_ARGMAX(best, at);
  if (lane == 0) {
    f_buf[warp] = best;
    i_buf[warp] = at;
  }
  __syncthreads();
  best = f_buf[lane];
  at = i_buf[lane];
  WARP_ARGMAX(best, at);
  drawn = at;
}
if (t == 0) out[0] = m == -INFINITY ? static_cast<int>(knobs[4]) : drawn;
"""

_LOAD_GUIDED = """#pragma unroll
for (int e = 0; e < E; ++e) {
  const int i = base + e;
  x[e] = -INFINITY;
  if (i < V) {
    x[e] = static_cast<float>(logits[i]);
    // sampling.cfg_combine's cond + w * (cond - uncond), the unconditional row second, written as there: NVRTC
    // contracts it into one multiply-add, as it does in MLX's fused kernel of the composed chain.
    if (CFG) x[e] = x[e] + knobs[5] * (x[e] - static_cast<float>(logits[V + i]));
  }
}

"""

_TEMPERATURE_MIN_P = """if (SHIFT) {
  // sampling.apply_temperature: the row's largest logit subtracted, then divided by the temperature.
  float m = -INFINITY;
#pragma unroll
  for (int e = 0; e < E; ++e) m = fmaxf(m, x[e]);
  m = block_reduce(m, fmax_, f_buf);
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = (x[e] - m) / knobs[0];
}

if (MIN_P) {
  // sampling._min_p_rows: drop p < min_p * p_max as e / total < min_p * (1 / total), e = exp(x - max).
  float m = -INFINITY;
#pragma unroll
  for (int e = 0; e < E; ++e) m = fmaxf(m, x[e]);
  m = block_reduce(m, fmax_, f_buf);
  float p[E], sum = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    p[e] = expf(x[e] - m);
    sum += p[e];
  }
  const float total = block_reduce(sum, fadd_, f_buf);
  const float bar = knobs[6] * (1.0f / total);
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = p[e] / total < bar ? -INFINITY : x[e];
}

"""

_TURBO_SOURCE = _DECLARATIONS + _LOAD + _TOP_K + _TOP_P + _PENALTY + _DRAW
_ENGLISH_SOURCE = _DECLARATIONS + _LOAD_GUIDED + _PENALTY + _TEMPERATURE_MIN_P + _DRAW

_kernels: dict = {}


def fits(logits: mx.array, params: TurboParams) -> bool:
    """Whether the kernel takes this Turbo step's chain: one row on CUDA and a vocabulary the block holds."""
    rows, vocab = logits.shape
    return SAMPLING_KERNEL and layers._use_cuda_paths() and rows == 1 and vocab <= _MAX_VOCAB


def fits_english(logits: mx.array, params: SamplingParams) -> bool:
    """Whether the kernel takes this English step's chain: ``ENGLISH_SAMPLING_KERNEL`` on, CUDA, one request
    (its conditional and unconditional rows, or one row without guidance), a vocabulary of at most 16 logits a
    thread, and a draw (greedy decoding takes the composed arg-max); top_p, which sorts, stays composed."""
    rows, vocab = logits.shape
    return (
        SAMPLING_KERNEL
        and ENGLISH_SAMPLING_KERNEL
        and layers._use_cuda_paths()
        and rows == (2 if params.cfg_weight > 0 else 1)
        and vocab <= 16 * _THREADS
        and not params.greedy
        and params.top_p >= 1.0
    )


def turbo_pick(
    logits: mx.array,
    seen: mx.array,
    fed: mx.array,
    draw: mx.array,
    by_uniform: bool,
    params: TurboParams,
    no_token: int,
) -> tuple[mx.array, mx.array]:
    """(1, V) head logits -> (the drawn id (1,) int32, or ``no_token`` where every processed logit is -inf;
    the history ``seen | (ids == fed)``). ``draw`` is a PRNG key (2,), or with ``by_uniform`` a uniform in
    [0, 1) (a scalar), as ``generation/turbo._pick`` takes it. Call only where ``fits``."""
    vocab = logits.shape[1]
    t = params.temperature
    flags = dict(
        SCALE=t > 0 and t != 1.0,
        TOP_K=0 < params.top_k < vocab,
        TOP_P=params.top_p < 1.0,
        PENALTY=params.repetition_penalty != 1.0,
        BY_UNIFORM=by_uniform,
    )
    # As float32, the numbers the composed chain divides and compares by; the no-token id here too, since MLX
    # names a kernel after its template values and a "-" is no part of a name.
    knobs = [t, 1 - params.top_p, params.repetition_penalty, params.top_k, no_token]
    shared = 8 * (1 << (vocab - 1).bit_length()) if flags["TOP_P"] else 0  # the sort's keys
    return _launch("turbo_pick", _TURBO_SOURCE, flags, knobs, shared, logits, seen, fed, draw, by_uniform)


def english_pick(
    logits: mx.array, seen: mx.array, fed: mx.array, draw: mx.array, by_uniform: bool, params: SamplingParams
) -> tuple[mx.array, mx.array]:
    """English's chain after the head (``sampling.process_logits`` then ``sampling.draw``: guidance, penalty,
    temperature, min_p, the draw) in one kernel: (2, V) conditional and unconditional logits, or (1, V)
    without guidance -> (the drawn id (1,) int32, the history ``seen | (ids == fed)``). ``draw`` as for
    ``turbo_pick``. Call only where ``fits_english``."""
    t = params.temperature
    flags = dict(
        CFG=logits.shape[0] == 2,
        PENALTY=params.repetition_penalty != 1.0,
        SHIFT=t != 1.0,
        MIN_P=params.min_p != 0.0,
        BY_UNIFORM=by_uniform,
    )
    # knobs[4], the id where every logit is -inf, is the composed draw's there: the arg-max of a row of -inf, 0.
    knobs = [t, 0.0, params.repetition_penalty, 0, 0, params.cfg_weight, params.min_p]
    return _launch("english_pick", _ENGLISH_SOURCE, flags, knobs, 0, logits, seen, fed, draw, by_uniform)


def _launch(
    name: str,
    source: str,
    flags: dict[str, bool],
    knobs: list[float],
    shared: int,
    logits: mx.array,
    seen: mx.array,
    fed: mx.array,
    draw: mx.array,
    by_uniform: bool,
) -> tuple[mx.array, mx.array]:
    """One block of the kernel made from ``source`` with these flags (built once per set): (out, seen_out)."""
    key = (name, *flags.values(), shared)
    if key not in _kernels:
        full = "_".join([name] + [k.lower() for k, on in flags.items() if on])
        _kernels[key] = layers.cuda_kernel(
            full,
            ["logits", "seen", "token", "knobs", "draws"],
            ["out", "seen_out"],
            source,
            header=_HEADER,
            shared_memory=shared,
        )
    # The uniform, or the Gumbel noise ``sampling.gumbel_max`` adds (the same draw of the same key and shape).
    draws = draw.reshape(1) if by_uniform else mx.random.gumbel((1, logits.shape[1]), key=draw)
    out, seen_out = _kernels[key](
        inputs=[logits, seen, fed.reshape(1), mx.array(knobs, dtype=mx.float32), draws],
        template=[("T", logits.dtype), ("V", logits.shape[1]), *flags.items()],
        grid=(_THREADS, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(1,), seen.shape],
        output_dtypes=[mx.int32, mx.bool_],
    )
    return out, seen_out
