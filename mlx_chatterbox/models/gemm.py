"""Products of many rows in half precision as one CUDA kernel of ours (issue 25): ``x @ weight.T``, or a causal
convolution as that product over the frames it sees, then the bias, GELU and a sum as its epilogue. For S3Gen's
estimator, which is bound by its host: MLX hands every product to cuBLAS and every convolution to cuDNN, which
cost 15-20 µs of host time a call (a matmul descriptor and an algorithm query each time, and a stream capture
under CUDA graphs; RESULTS, `probe_step --part micro`) against 7-10 µs for a kernel of ours. A bf16 estimator
call makes 242 products and 31 convolutions; their biases' sums, GELUs and residual sums are 199 kernels more.

The kernel: tiles of 64 x 64 outputs (32 x 64 where 64 rows would leave SMs idle), 128 threads in 4 warps,
tensor cores through WMMA (16 x 16 x 16 fragments, float accumulators), the next 32-wide slice of x and the
weight loaded into registers while the current one is multiplied from shared memory. Rows past x's end read zeros and write nothing, so any row count
runs; the weight's rows (N) must be a multiple of 64 and its columns (K) of 32. A causal convolution of x (B,
T, C) by a weight (N, taps, C) is the product of its weight's rows (N, taps·C) with rows that the kernel reads
from x as it goes: row (b, t) is frames t - taps + 1 .. t of sequence b side by side, zeros before its start
(no copy of x is made, and no padded one). float32 stays with MLX's
product: a tensor-core product in float32 would be TF32, and the fp32 estimator is upstream's numbers.

Sums differ from MLX's ops in rounding only: the bias, GELU and the sum are applied to the float accumulator
and rounded once, where the composed ops round after the product and after each op. Only on CUDA
(``layers._use_cuda_paths``); every other backend runs the composed ops.
"""

from __future__ import annotations

import mlx.core as mx

from . import layers

# Off until tests/test_gemm.py's GPU tests have run on a GPU: a kernel that has not run does not ship
# (benchmarks' "ours-tiled-products" turns it on).
TILED_PRODUCTS = False

# Below this many rows a product stays with MLX (a matrix-vector product, or cuBLAS for a few rows).
MIN_ROWS = 64

_TILE_N, _TILE_K, _THREADS = 64, 32, 128

_HEADER = "#include <mma.h>\n"

# T, N, K, TAPS (1: a product of x's rows) and BM (the tile's rows: 64, or 32 where 64 would leave SMs idle)
# come as template constants, x's rows and frames from its shape (2-D for a product, (B, T, C) for a
# convolution); the epilogue is put in by ``product``.
_SOURCE = """
  using namespace nvcuda;
  constexpr int BN = 64, BK = 32;
  constexpr int FM = BM / 32;  // a warp's 16-row fragments: its tile is BM / 2 x 32
  constexpr int LDS = BK + 8;  // a shared row of the x and weight tiles, in elements: 80 bytes, 16-byte aligned
  constexpr int LDC = BN + 4;  // a shared row of the output tile, in floats
  constexpr int TILES = K / BK;
  // Two buffers of the x and weight tiles (20,480 bytes at BM 64), which the output tile (17,408) reuses at the
  // end.
  __shared__ __align__(128) unsigned char smem[2 * (BM + BN) * LDS * sizeof(T)];
  T* xs = reinterpret_cast<T*>(smem);  // [2][BM][LDS]
  T* ws = xs + 2 * BM * LDS;           // [2][BN][LDS]
  float* cs = reinterpret_cast<float*>(smem);  // [BM][LDC]

  constexpr int C = K / TAPS;  // x's channels
  const int M = TAPS == 1 ? x_shape[0] : x_shape[0] * x_shape[1];
  const int FRAMES = TAPS == 1 ? 1 : x_shape[1];
  const int tid = threadIdx.x;
  const int warp_m = (tid >> 5) >> 1, warp_n = (tid >> 5) & 1;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;

  // Each thread moves FM 16-byte pieces of x's tile and two of the weight's: piece p is row p / 4, columns
  // (p % 4) * 8 on. Column k
  // of row m is x's element (m, k), or for a convolution channel k % C of tap k / C: frame m - TAPS + 1 + k / C,
  // zero before its sequence's first (C is a multiple of 8, so a piece lies within one tap).
  uint4 xr[FM], wr[2];
  auto fetch = [&](int k0) {
    #pragma unroll
    for (int i = 0; i < FM; ++i) {
      const int p = tid + i * 128, r = p >> 2, c = (p & 3) * 8;
      const int m = m0 + r, tap = (k0 + c) / C, back = TAPS - 1 - tap;
      const bool valid = m < M && (TAPS == 1 || m % FRAMES >= back);
      xr[i] = valid ? *reinterpret_cast<const uint4*>(x + (size_t)(m - back) * C + (k0 + c) % C)
                    : make_uint4(0, 0, 0, 0);
    }
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int p = tid + i * 128, r = p >> 2, c = (p & 3) * 8;
      wr[i] = *reinterpret_cast<const uint4*>(w + (size_t)(n0 + r) * K + k0 + c);
    }
  };
  auto stash = [&](int buf) {
    #pragma unroll
    for (int i = 0; i < FM; ++i) {
      const int p = tid + i * 128, r = p >> 2, c = (p & 3) * 8;
      *reinterpret_cast<uint4*>(xs + (buf * BM + r) * LDS + c) = xr[i];
    }
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int p = tid + i * 128, r = p >> 2, c = (p & 3) * 8;
      *reinterpret_cast<uint4*>(ws + (buf * BN + r) * LDS + c) = wr[i];
    }
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FM][2];
  #pragma unroll
  for (int i = 0; i < FM; ++i)
    #pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  fetch(0);
  stash(0);
  __syncthreads();
  for (int t = 0; t < TILES; ++t) {
    const int buf = t & 1;
    if (t + 1 < TILES) fetch((t + 1) * BK);  // in flight while this tile is multiplied
    #pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fx[FM];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fw[2];
      #pragma unroll
      for (int i = 0; i < FM; ++i)
        wmma::load_matrix_sync(fx[i], xs + (buf * BM + warp_m * (BM / 2) + i * 16) * LDS + kk, LDS);
      #pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::load_matrix_sync(fw[j], ws + (buf * BN + warp_n * 32 + j * 16) * LDS + kk, LDS);
      #pragma unroll
      for (int i = 0; i < FM; ++i)
        #pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fx[i], fw[j], acc[i][j]);
    }
    // The other buffer was last read in the previous tile, before the barrier that ended it.
    if (t + 1 < TILES) stash(buf ^ 1);
    __syncthreads();
  }

  // Every warp has read its last tile (the loop's last barrier): the output tile takes their place.
  #pragma unroll
  for (int i = 0; i < FM; ++i)
    #pragma unroll
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(cs + (warp_m * (BM / 2) + i * 16) * LDC + warp_n * 32 + j * 16, acc[i][j], LDC,
                              wmma::mem_row_major);
  __syncthreads();
  for (int e = tid; e < BM * BN; e += 128) {
    const int r = e / BN, c = e % BN;
    if (m0 + r >= M) break;  // rows only grow with e
    const size_t at = (size_t)(m0 + r) * N + n0 + c;
    float y = cs[r * LDC + c];
    // epilogue
    out[at] = static_cast<T>(y);
  }
"""

_EPILOGUE = {
    "bias": "y += static_cast<float>(bias[n0 + c]);",
    "gelu": "y = 0.5f * y * (1.0f + erff(y * 0.7071067811865476f));",
    "add": "y += static_cast<float>(add[at]);",
}

_kernels: dict[tuple[bool, bool, bool], object] = {}


def fits(x: mx.array, weight: mx.array) -> bool:
    """Whether ``product`` runs x (M, K) against weight (N, K), or the causal convolution of x (B, T, C) by
    weight (N, taps, C), as our kernel here."""
    n, c = weight.shape[0], weight.shape[-1]
    k = weight.size // n
    return (
        TILED_PRODUCTS
        and layers._use_cuda_paths()
        and x.dtype in (mx.bfloat16, mx.float16)
        and weight.dtype == x.dtype
        and x.ndim == weight.ndim in (2, 3)
        and x.shape[-1] == c
        and x.size // c >= MIN_ROWS
        and n % _TILE_N == 0
        and k % _TILE_K == 0
        and c % 8 == 0
    )


def product(
    x: mx.array,
    weight: mx.array,
    bias: mx.array | None = None,
    *,
    gelu: bool = False,
    add: mx.array | None = None,
) -> mx.array:
    """``x @ weight.T`` (+ bias) (then the exact GELU) (+ add), as one kernel; the caller asks ``fits`` first.
    x (M, K) and weight (N, K) (a ``Linear``'s), or the causal convolution of x (B, T, C) by weight (N, taps, C)
    (a ``Conv1d``'s: stride 1, no dilation), then x's shape with N channels; bias (N,), add as the output."""
    n, taps = weight.shape[0], weight.shape[1] if weight.ndim == 3 else 1
    shape = (*x.shape[:-1], n)
    if add is not None and add.shape != shape:
        raise ValueError(f"add has shape {add.shape}: the product's is {shape}")
    key = (bias is not None, gelu, add is not None)
    if key not in _kernels:
        parts = [part for part, on in zip(_EPILOGUE, key) if on]
        names = ["x", "w"] + [part for part in parts if part != "gelu"]
        source = _SOURCE.replace("// epilogue", "\n    ".join(_EPILOGUE[part] for part in parts))
        label = "_".join(["tiled_product", *parts])
        _kernels[key] = mx.fast.cuda_kernel(label, names, ["out"], source, header=_HEADER)
    # Tiles of 64 rows, or of 32 where those would give the GPU under two blocks an SM (the products onto 256
    # channels: one block of 4 warps an SM waits on each k-tile's loads).
    m = x.size // x.shape[-1]
    bm = 64 if -(-m // 64) * (n // _TILE_N) >= 2 * layers._sm_count() else 32
    inputs = [x, weight] + [a for a in (bias, add) if a is not None]
    (out,) = _kernels[key](
        inputs=inputs,
        template=[("T", x.dtype), ("N", n), ("K", weight.size // n), ("TAPS", taps), ("BM", bm)],
        grid=(n // _TILE_N * _THREADS, -(-m // bm), 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[shape],
        output_dtypes=[x.dtype],
    )
    return out
