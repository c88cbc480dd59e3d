"""Turbo and Nano's sampling chain after the head as one CUDA kernel (issue 25): mark the fed token as seen,
temperature -> top_k -> top_p -> repetition penalty (``sampling.process_turbo_logits``), then the draw and the
all -inf check (``generation/turbo._pick``). Composed of MLX's ops the chain is about 20 primitives a decode
step, among them a partition and an argsort of the whole vocabulary, each some microseconds of host time and
a single-block kernel on the GPU; here it is one primitive, plus two for the Gumbel noise when drawing by key.

The same numbers as the composed chain, except where a sum's order differs: top_p's and the inverse-CDF draw's
cumulative probabilities are summed in another order than MLX's softmax and cumsum, so a threshold within a
rounding error of a cumulative sum could fall the other way (tests/test_decode_cuda.py compares the two).
Only on CUDA (``layers._use_cuda_paths``); every other backend runs the composed chain.
"""

from __future__ import annotations

import mlx.core as mx

from ..models import layers
from ..sampling import TurboParams

# False keeps the composed chain on CUDA too (benchmarks/probe_step.py compares the two in one run).
SAMPLING_KERNEL = True

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

_SOURCE = """
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
#pragma unroll
for (int e = 0; e < E; ++e) {
  const int i = base + e;
  x[e] = -INFINITY;
  if (i < V) {
    x[e] = static_cast<float>(logits[i]);
    if (SCALE) x[e] = x[e] / knobs[0];
  }
}

if (TOP_K) {
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

if (TOP_P) {
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

#pragma unroll
for (int e = 0; e < E; ++e) {
  const int i = base + e;
  if (i < V) {
    const bool s = seen[i] || i == fed;
    seen_out[i] = s;
    if (PENALTY && s) x[e] = x[e] < 0.0f ? x[e] * knobs[2] : x[e] / knobs[2];
  }
}

float m = -INFINITY;
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

_kernels: dict = {}


def fits(logits: mx.array, params: TurboParams) -> bool:
    """Whether the kernel takes this step's chain: one row on CUDA and a vocabulary the block holds."""
    rows, vocab = logits.shape
    return SAMPLING_KERNEL and layers._use_cuda_paths() and rows == 1 and vocab <= _MAX_VOCAB


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
    shared = 8 * (1 << (vocab - 1).bit_length()) if flags["TOP_P"] else 0  # the sort's keys
    key = (*flags.values(), shared)
    if key not in _kernels:
        name = "turbo_pick_" + "_".join(k.lower() for k, on in flags.items() if on)
        _kernels[key] = mx.fast.cuda_kernel(
            name,
            ["logits", "seen", "token", "knobs", "draws"],
            ["out", "seen_out"],
            _SOURCE,
            header=_HEADER,
            shared_memory=shared,
        )
    # As float32, the numbers the composed chain divides and compares by; the no-token id here too, since MLX
    # names a kernel after its template values and a "-" is no part of a name.
    knobs = mx.array(
        [t, 1 - params.top_p, params.repetition_penalty, params.top_k, no_token], dtype=mx.float32
    )
    # The uniform, or the Gumbel noise ``sampling.gumbel_max`` adds (the same draw of the same key and shape).
    draws = draw.reshape(1) if by_uniform else mx.random.gumbel(logits.shape, key=draw)
    out, seen_out = _kernels[key](
        inputs=[logits, seen, fed.reshape(1), knobs, draws],
        template=[("T", logits.dtype), ("V", vocab), *flags.items()],
        grid=(_THREADS, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(1,), seen.shape],
        output_dtypes=[mx.int32, mx.bool_],
    )
    return out, seen_out
