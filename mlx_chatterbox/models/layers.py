"""Layers shared by several networks: 1-d convolutions that run as matrix products on the CPU, and
elementwise functions (exp, exact GELU, Mish) and attention that are fast on the CPU.

MLX's CPU convolution kernels are direct loops: on a Linux CPU a (4000 x 256) -> 256, kernel 11 conv took 4.1 s
against 50 ms as a product with OpenBLAS (benchmarks/bench_conv.py), and 31 ms as a sum of products (``conv1d``).
On GPUs MLX's own kernels are as fast or faster (H200: 0.12-0.34 ms vs 0.15-0.32 ms), so there the layers call
them. Both paths compute the same convolution; they keep ``nn.Conv1d``/``nn.ConvTranspose1d``'s parameters
(weight (out, k, in), bias), so checkpoints and key tables do not change.

MLX's CPU exp, erf and tanh are scalar loops (on a 2-core EPYC: exp 9 ns, erf 21 ns per element; an add takes
0.2 ns), and they dominated the CFM on the CPU. The functions below build them from adds, multiplies and bit
shifts that ``mx.compile`` turns into vectorised C++ (exp 8x, GELU 4x, Mish 8x faster there), as accurate as
MLX's or more. They take that path for float32 on the CPU; elsewhere, or for other dtypes, they call MLX's own
functions, which are fast on GPUs.
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Callable
from functools import cache, partial
from typing import NamedTuple, TypeVar

import mlx.core as mx
import mlx.nn as nn

# exp: x = n·ln2 + r with |r| <= ln2/2 (ln2 in two parts, so n·LN2_HI is exact), exp(r) by its Taylor series
# to r^7/7! (max. relative error 1.0e-7 over [-87, 88] in fp32; MLX's CPU exp: 3.9e-6), 2^n from the bits.
_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693145751953125, 1.428606765330187e-06
_ROUND = 12582912.0  # 1.5 * 2^23: adding it rounds a float32 of magnitude < 2^22 to an integer
_ROUND_BITS = 0x4B400000  # its bit pattern; the low bits of (t + _ROUND) then hold round(t)
_EXP_TAYLOR = tuple(1.0 / math.factorial(k) for k in range(8))
# erf, our fit (a Lawson-weighted linearised least-squares iteration in float64, not from a library):
# |x| < 1: x·P(x²); |x| >= 1: 1 - exp(-x²)·t·P(t)/Q(t), t = 1/|x|. Max. abs. error 1.4e-7 in fp32 (MLX's
# CPU erf: 5.3e-7), checked in tests/test_layers.py.
_ERF_SMALL = (
    1.1283791659163818,
    -0.37612627141822136,
    0.11283600209547515,
    -0.0268544452347977,
    0.005189535539301779,
    -0.0008020835656073477,
    7.889079383699427e-05,
)
_ERFC_NUM = (
    0.5641895665299962,
    1.5846785169713864,
    2.870040696178331,
    2.0696042394592182,
    0.01256281249949489,
)
# sin: x = k·pi + r, |r| <= pi/2 (pi in three parts: k·_PI_A and k·_PI_B are exact for |k| < 2^12), sin(r)
# by its Taylor series to r^15/15!, and the sign (-1)^k from k's lowest bit.
_INV_PI = 0.3183098861837907
_PI_A, _PI_B, _PI_C = 3.140625, 0.0009670257568359375, 6.278329573009626e-07
_SIN_TAYLOR = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(8))  # in r², times r
_ERFC_DEN = (1.0, 2.8087602098771103, 5.587476222824679, 5.063992825004679, 2.147227026841558)


def conv1d(
    x: mx.array,
    weight: mx.array,
    padding: int = 0,
    dilation: int = 1,
    stride: int = 1,
    bias: mx.array | None = None,
) -> mx.array:
    """x (B, T, C_in), weight (C_out, k, C_in), bias (C_out,) or None: the convolution as matrix products.

    Long inputs (rows of output at least ``_TAPS_ROWS_PER_CHANNEL`` times C_out, as HiFT's): one product per
    kernel tap, summed, the view of x shifted by j·dilation times the kernel's j-th (C_in, C_out) slice, each
    added by ``addmm``. Nothing holds k copies of x, and the copy is of the kernel, once. Shorter ones: the k
    shifted views side by side (im2col) times the flattened kernel, one larger product. On 2 EPYC cores with
    OpenBLAS, HiFT's convolutions of 10 s ran 1.4-2.8x faster as taps and held 4-12x less memory; the flow's
    and the estimator's ran up to 1.4x slower (benchmarks/RESULTS.md, "convolutions as a sum of taps")."""
    c_out, k, c_in = weight.shape
    if padding:
        x = mx.pad(x, [(0, 0), (padding, padding), (0, 0)])
    length = (x.shape[1] - dilation * (k - 1) - 1) // stride + 1
    span = (length - 1) * stride + 1  # the frames a view spans
    taps = k > 1 and x.shape[0] * length >= _TAPS_ROWS_PER_CHANNEL * c_out
    # One row goes as 2-d products, which broadcast nothing: a GPU's host pays for every primitive (HiFT's call
    # as taps: 4,786 primitives with 3-d products, 3,888 so).
    one = taps and x.shape[0] == 1
    if one:
        x = x.reshape(x.shape[1:])
    if k == 1 and stride == 1:
        views = [x]  # the input itself: no slice
    else:
        views = [x[..., j * dilation : j * dilation + span : stride, :] for j in range(k)]
    if not taps:
        cols = views[0] if k == 1 else mx.concatenate(views, axis=-1)
        w = weight.reshape(c_out, -1).T  # (k·C_in, C_out)
        return cols @ w if bias is None else mx.addmm(bias, cols, w)
    w = mx.contiguous(weight.transpose(1, 2, 0)).reshape(k * c_in, c_out)  # tap j's rows: a plain matrix
    y = views[0] @ w[:c_in] if bias is None else mx.addmm(bias, views[0], w[:c_in])
    for j in range(1, k):
        y = mx.addmm(y, views[j], w[j * c_in : (j + 1) * c_in])
    return y[None] if one else y


# conv1d's taps pay from this many output rows per output channel: below it the kernel's copy and the smaller
# products cost more than the im2col's copy of x saves.
_TAPS_ROWS_PER_CHANNEL = 4


def conv_transpose1d(
    x: mx.array, weight: mx.array, stride: int, padding: int = 0, bias: mx.array | None = None
) -> mx.array:
    """x (B, T, C_in), weight (C_out, k, C_in), bias (C_out,) or None: torch's ``conv_transpose1d`` (dilation
    1, no output padding), output length (T - 1)·stride - 2·padding + k.

    Output frame f·stride + r sums x[f - j] times tap j·stride + r, over the ceil(k / stride) blocks j. That is
    ``conv1d`` of x padded by blocks - 1 frames with a kernel of ``blocks`` taps, each giving all ``stride``
    phases' channels (stride·C_out), read out frame by frame, so that HiFT's upsampling runs as taps too. On
    2 EPYC cores its three at 10 s took 14, 22 and 21 ms and held 23, 20 and 25 MiB above their inputs, where
    one product for all blocks and the blocks' shifted copies took 26, 36 and 47 ms and held 32, 62 and 89."""
    w = _transposed_taps(weight, stride)
    y = conv1d(x, w, w.shape[1] - 1, bias=None if bias is None else mx.tile(bias, stride))
    return _phases_out(y, weight.shape, x.shape[1], stride, padding)


def _transposed_taps(weight: mx.array, stride: int) -> mx.array:
    """A transposed convolution's weight (C_out, k, C_in) as ``conv_transpose1d``'s convolution's,
    (stride·C_out, blocks, C_in): out channel r·C_out + c, conv tap blocks - 1 - j (tap j reads x[f - j])."""
    c_out, k, c_in = weight.shape
    blocks = -(-k // stride)
    w = mx.pad(weight, [(0, 0), (0, blocks * stride - k), (0, 0)])  # zero taps up to whole blocks
    return w.reshape(c_out, blocks, stride, c_in).transpose(2, 0, 1, 3)[:, :, ::-1].reshape(-1, blocks, c_in)


def _phases_out(y: mx.array, shape: tuple[int, int, int], t: int, stride: int, padding: int) -> mx.array:
    """The transposed convolution's output, frame by frame, from its convolution's y (B, t + blocks - 1,
    stride·C_out) (``shape``: the transposed weight's)."""
    c_out, k, _ = shape
    y = y.reshape(y.shape[0], -1, c_out)
    return y[:, padding : padding + (t - 1) * stride + k - 2 * padding]


# --- values kept with the parameters they are made from ---

_Made = TypeVar("_Made")


class Kept:
    """A value computed from parameters (``kept``), with the arrays it was computed from. A plain object: MLX
    takes a module's array, list, tuple and dict attributes for parameters or children, and this one must stay
    out of ``parameters()``, ``load_weights(strict=True)`` and saved weights."""

    __slots__ = ("sources", "value")

    def __init__(self, sources: tuple[mx.array | None, ...], value: object):
        self.sources, self.value = sources, value


def kept(
    module: nn.Module, name: str, sources: tuple[mx.array | None, ...], build: Callable[..., _Made]
) -> _Made:
    """``build(*sources)``, computed once and kept on ``module`` under ``name`` until one of the source arrays
    is replaced (``load_weights``, ``update`` and ``set_dtype`` put new arrays in place; the sources are held,
    so a new array cannot reuse an old one's identity). Evaluated when built: later calls find a leaf of their
    graphs, and a server's other thread never reads an array queued on the stream of the thread that built it
    (ADR 10)."""
    cache = module.__dict__.get(name)  # a plain lookup: this runs for every linear of every call
    if cache is None or not all(map(operator.is_, cache.sources, sources)):
        value = build(*sources)
        mx.eval(value)
        cache = Kept(sources, value)
        object.__setattr__(module, name, cache)
    return cache.value


# --- float32 convolutions (HiFT's, the flow's, a float32 estimator's) as our kernel on CUDA ---

# On (CUDA only; run AT, ADR 6). MLX's cuDNN convolutions plan a graph for every new shape and run HiFT's float32
# convolutions at ~11 TFLOPs with a layout transpose on each side (run AJ's Nsight: 77 implicit GEMMs, ~19 ms,
# and 257 transposes, 4.2 ms, in S3Gen.batch at 10 s). Ours plans nothing, reads channels-last as it is, and
# takes the mask of the padded frames, the bias and a residual sum into the same launch. Its sizes come at run
# time, and whether it has a bias, a mask and a sum too: one kernel per tile height, both compiled at a
# process's first kernel convolution (a first version compiled ~60, one per shape, 0.6 s each, as a process met
# them: run AQ). ``Conv1d.padded`` takes it too (the flow's look-ahead and upsampling convolutions, a float32
# estimator's causal ones), with its zero frames on each side. Run AR (H100), alone: a 10 s decode 12.8 ms
# against 17.0, a new length 14-16 ms against 58-89, text -> wav 0.511 s against 0.554 with S3Gen's peak 3,580
# MiB against 3,888, a served English stream's first audio 239 ms against 271. Run AR's 16 served Turbo streams
# ran 3.7x slower with it, but that server was the machine's first to meet 16 streams' shapes (run AS: the
# first, whatever its way, compiles MLX's kernels for them); run AT alternated the ways on one machine: 16
# streams' decodes replayed in one process 1.5-1.7 s against 3.4-5.0, served 20.1x and 18.5x real time against
# 14.6x and 15.5x. Off: the benchmarks' "cudnn" way.
KERNEL_CONVS = True

# A block's columns (output channels); its rows: 128 where every SM still gets two blocks, else 64.
_CONV_BN = 64
_conv_kernels: dict[int, object] = {}

# An implicit GEMM in float32 (no tensor cores: HiFT stays float32, as upstream's on a CPU), x (B, T_in, C_in)
# channels-last, the weight as rows (taps·C_in, NP): tap j's C_in rows, C_out columns zero-padded to NP, a
# multiple of BN. ``geometry`` holds (C_out, dilation, left, right): the zero frames before and after x. Output
# row m = b·T_out + t sums, over taps j and channels c, x[b, t + j·dilation - left, c] (0 outside the sequence,
# or where the mask is false) times row j·C_in + c. The bias (C_out), the mask (B, T_in, 1) and the sum (B,
# T_out, C_out) are each read only if given: a missing one comes as a (1, 1) stand-in, told apart by its ndim,
# so that their 8 combinations share one compiled kernel. A block of 256 threads takes BM rows and BN columns;
# each thread RM = BM / 16 adjacent rows and 4 columns, as 16 x 16 groups. Slices of BK = 16 of the K = taps·C_in
# products (C_in a multiple of 16: a slice lies in one tap) go through shared memory, x's transposed so that a
# thread's RM rows are one 16-byte read; the next slice is in registers while this one is multiplied, and the
# two shared buffers take turns (one barrier a slice).
_CONV_SOURCE = """
  constexpr int BN = %(bn)d, BK = 16, THREADS = 256, RM = BM / 16, LDA = BM + 4;
  constexpr int XQ = BM * BK / 4 / THREADS;  // x's 16-byte pieces a thread moves a slice
  __shared__ __align__(16) float xs[2][BK][LDA];
  __shared__ __align__(16) float ws[2][BK][BN];
  const int T_IN = x_shape[1], C_IN = x_shape[2], K = w_shape[0], NP = w_shape[1], SLICES = K / BK;
  const int C_OUT = geometry[0], DIL = geometry[1], LEFT = geometry[2];
  const int T_OUT = T_IN + LEFT + geometry[3] - DIL * (K / C_IN - 1), M = x_shape[0] * T_OUT;
  const bool BIAS = bias_ndim == 1, MASK = mask_ndim == 3, ADD = add_ndim == 3;
  const int tid = threadIdx.x, m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  // Piece i: tile row (tid + i·THREADS) / 4, the slice's channels (tid %% 4)·4 on; its sequence's first row
  // in x, and its output frame (-1 past the last row).
  int first[XQ], frame[XQ];
  #pragma unroll
  for (int i = 0; i < XQ; ++i) {
    const int m = m0 + (tid + i * THREADS) / 4, b = m / T_OUT;
    first[i] = b * T_IN;
    frame[i] = m < M ? m - b * T_OUT : -1;
  }
  float4 xr[XQ], wr;
  auto fetch = [&](int s) {
    const int k0 = s * BK, tap = k0 / C_IN, c = k0 - tap * C_IN + (tid %% 4) * 4;
    #pragma unroll
    for (int i = 0; i < XQ; ++i) {
      const int t = frame[i] + tap * DIL - LEFT;
      const bool read = frame[i] >= 0 && t >= 0 && t < T_IN && (!MASK || mask[first[i] + t]);
      xr[i] = read ? *reinterpret_cast<const float4*>(x + (size_t)(first[i] + t) * C_IN + c)
                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    wr = *reinterpret_cast<const float4*>(w + (size_t)(k0 + tid / 16) * NP + n0 + (tid %% 16) * 4);
  };
  auto stash = [&](int buf) {
    const int q = (tid %% 4) * 4;
    #pragma unroll
    for (int i = 0; i < XQ; ++i) {
      const int r = (tid + i * THREADS) / 4;
      xs[buf][q][r] = xr[i].x;
      xs[buf][q + 1][r] = xr[i].y;
      xs[buf][q + 2][r] = xr[i].z;
      xs[buf][q + 3][r] = xr[i].w;
    }
    *reinterpret_cast<float4*>(&ws[buf][tid / 16][(tid %% 16) * 4]) = wr;
  };
  const int tr = tid / 16, tc = tid %% 16;
  float acc[RM][4];
  #pragma unroll
  for (int i = 0; i < RM; ++i)
    #pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
  auto multiply = [&](int buf) {
    #pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      float a[RM];
      #pragma unroll
      for (int i = 0; i < RM; i += 4) {
        const float4 v = *reinterpret_cast<const float4*>(&xs[buf][kk][tr * RM + i]);
        a[i] = v.x;
        a[i + 1] = v.y;
        a[i + 2] = v.z;
        a[i + 3] = v.w;
      }
      const float4 v = *reinterpret_cast<const float4*>(&ws[buf][kk][tc * 4]);
      #pragma unroll
      for (int i = 0; i < RM; ++i) {
        acc[i][0] = fmaf(a[i], v.x, acc[i][0]);
        acc[i][1] = fmaf(a[i], v.y, acc[i][1]);
        acc[i][2] = fmaf(a[i], v.z, acc[i][2]);
        acc[i][3] = fmaf(a[i], v.w, acc[i][3]);
      }
    }
  };
  fetch(0);
  stash(0);
  __syncthreads();
  for (int s = 0; s < SLICES; ++s) {
    if (s + 1 < SLICES) fetch(s + 1);
    multiply(s %% 2);
    if (s + 1 < SLICES) stash((s + 1) %% 2);
    __syncthreads();
  }
  #pragma unroll
  for (int i = 0; i < RM; ++i) {
    const int m = m0 + tr * RM + i;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + tc * 4 + j;
      if (m < M && n < C_OUT) {
        const size_t at = (size_t)m * C_OUT + n;
        out[at] = acc[i][j] + (BIAS ? bias[n] : 0.0f) + (ADD ? add[at] : 0.0f);
      }
    }
  }
"""


class KernelWeight(NamedTuple):
    """A convolution's weight as ``conv1d_kernel`` takes it: ``rows`` (taps·C_in, NP), tap j's C_in rows, the
    columns zero-padded to a multiple of the kernel's tile; ``geometry`` (C_out, dilation, left, right: the zero
    frames before and after x) in device memory, which the kernel reads, so that one compiled kernel serves every
    convolution."""

    rows: mx.array
    geometry: mx.array
    c_out: int
    dilation: int
    left: int
    right: int


def kernel_weight(weight: mx.array, dilation: int = 1, left: int = 0, right: int = 0) -> KernelWeight:
    """``weight`` (C_out, k, C_in), x padded by ``left`` and ``right`` zero frames, as ``conv1d_kernel``'s
    ``KernelWeight``."""
    c_out, k, c_in = weight.shape
    rows = weight.transpose(1, 2, 0).reshape(k * c_in, c_out)
    rows = mx.contiguous(mx.pad(rows, [(0, 0), (0, -c_out % _CONV_BN)]))
    # Every thread reads the geometry: a copy made on the device, as ``DEVICE_SCALARS`` does for T3's scalars
    # (runs AE), since MLX keeps arrays made from host data in managed memory, whose pages a busy host's writes
    # to other small arrays move back and forth. Not what slowed run AR's 16 streams, as it turned out (run AS
    # served them as fast with the host-made array), but every thread reads it, and the copy is made once a weight.
    geometry = _in_device_memory(mx.array([c_out, dilation, left, right], dtype=mx.int32))
    return KernelWeight(rows, geometry, c_out, dilation, left, right)


def kernel_conv_fits(x: mx.array, weight: mx.array, stride: int = 1) -> bool:
    """Whether x's convolution by ``weight`` (C_out, k, C_in) takes ``conv1d_kernel``: ``KERNEL_CONVS``, on
    CUDA, both float32, stride 1, C_in a multiple of 16."""
    if not KERNEL_CONVS:  # first: every convolution of every call asks
        return False
    fp32 = x.dtype == weight.dtype == mx.float32
    return _use_cuda_paths() and fp32 and stride == 1 and weight.shape[-1] % 16 == 0


def conv1d_kernel(
    x: mx.array,
    weight: KernelWeight,
    bias: mx.array | None = None,
    mask: mx.array | None = None,
    add: mx.array | None = None,
    tile_rows: int | None = None,
) -> mx.array:
    """The stride-1 convolution of ``x * mask`` padded by the weight's ``left`` and ``right`` zero frames, plus
    ``bias`` and ``add``, by our CUDA kernel: x (B, T, C_in) float32, ``weight`` from ``kernel_weight``, mask
    (B, T, 1) bool or None, add (B, T_out, C_out) or None. ``tile_rows``: a block's rows, 64 or 128 (None: by
    the number of blocks)."""
    b, t, c_in = x.shape
    c_out, dilation = weight.c_out, weight.dilation
    t_out = t + weight.left + weight.right - dilation * (weight.rows.shape[0] // c_in - 1)
    if t_out < 1:
        raise ValueError(f"the convolution (dilation {dilation}) needs more than {t} frames and its padding")
    if bias is not None and bias.shape != (c_out,):
        raise ValueError(f"bias must have shape {(c_out,)}, got {bias.shape}")
    if mask is not None and (mask.dtype != mx.bool_ or mask.shape != (b, t, 1)):
        raise ValueError(f"mask must be bool of shape {(b, t, 1)}, got {mask.dtype} {mask.shape}")
    if add is not None and add.shape != (b, t_out, c_out):
        raise ValueError(f"add must have the output's shape {(b, t_out, c_out)}, got {add.shape}")
    m = b * t_out
    blocks = weight.rows.shape[1] // _CONV_BN
    if tile_rows is None:
        tile_rows = 128 if -(-m // 128) * blocks >= 2 * _sm_count() else 64
        if not _conv_kernels:
            _compile_kernel_convs()
    if tile_rows not in _conv_kernels:
        source = _CONV_SOURCE % dict(bn=_CONV_BN)
        _conv_kernels[tile_rows] = cuda_kernel(
            "conv", ["x", "w", "geometry", "bias", "mask", "add"], ["out"], source
        )
    optional = ((bias, mx.float32), (mask, mx.bool_), (add, mx.float32))
    given = [a if a is not None else _absent(dtype) for a, dtype in optional]
    (out,) = _conv_kernels[tile_rows](
        inputs=[x, weight.rows, weight.geometry, *given],
        template=[("BM", tile_rows)],
        grid=(blocks * 256, -(-m // tile_rows), 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(b, t_out, c_out)],
        output_dtypes=[mx.float32],
    )
    return out


@cache
def _absent(dtype: mx.Dtype) -> mx.array:
    """The (1, 1) stand-in for a missing bias, mask or sum of ``conv1d_kernel``, made and evaluated once."""
    stand_in = mx.zeros((1, 1), dtype)
    mx.eval(stand_in)
    return stand_in


def _compile_kernel_convs() -> None:
    """Launch the convolution kernel at both tile heights once on a few zeros: ``conv1d_kernel`` does at a
    process's first call, so that the process compiles them together (NVRTC, ~0.6 s each), not as later calls
    meet them (run AQ's served requests stalled on such compiles)."""
    x, weight = mx.zeros((1, 1, 16)), kernel_weight(mx.zeros((_CONV_BN, 1, 16)))
    mx.eval([conv1d_kernel(x, weight, tile_rows=rows) for rows in (64, 128)])


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


# Off the CPU, Conv1d and ConvTranspose1d are MLX's convolutions where our kernel does not take them. (Our
# products there too, a benchmark's switch until 2026-12-06, were rejected: run AP (H100) took whole served
# requests of varied length from 801 to 631 ms with them, since MLX-CUDA plans a cuDNN graph per shape and
# products plan nothing, but 16 streams ran a server out of GPU memory, with the im2col's k copies (run AP)
# and with taps (run AQ, where a warm 10 s decode took 18.6 ms against cuDNN's 16.1); the kernel plans
# nothing either.)


class Conv1d(nn.Conv1d):
    """``nn.Conv1d`` (groups 1), computed by ``conv1d_kernel`` where it fits (CUDA), by ``conv1d`` on the CPU,
    else by MLX."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        padding: int = 0,
        dilation: int = 1,
        bias: bool = True,
        stride: int = 1,
    ):
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=padding,
            dilation=dilation,
            bias=bias,
        )

    def __call__(self, x: mx.array, mask: mx.array | None = None, add: mx.array | None = None) -> mx.array:
        """The convolution of ``x * mask`` (mask (B, T, 1) bool: zero beyond each row's frames), plus ``add``
        (B, T_out, C_out), each where given."""
        if kernel_conv_fits(x, self.weight, self.stride):
            return conv1d_kernel(x, self._kernel_weight(0, 0), self.get("bias"), mask, add)
        x = x if mask is None else x * mask  # bool promotes to x's dtype
        if not _on_cpu():
            y = super().__call__(x)
        else:
            y = conv1d(x, self.weight, self.padding, self.dilation, self.stride, self.get("bias"))
        return y if add is None else y + add

    def padded(self, x: mx.array, left: int, right: int) -> mx.array:
        """The convolution of x (B, T, C_in) with ``left`` and ``right`` more zero frames on its ends (causal
        and look-ahead convolutions). Off the CPU the convolution pads itself: ``mx.pad`` would be two more
        primitives (a fill and a copy), and S3Gen's host-bound estimator has 31 such convolutions a call."""
        if kernel_conv_fits(x, self.weight, self.stride):
            return conv1d_kernel(x, self._kernel_weight(left, right), self.get("bias"))
        if _on_cpu():  # Conv1d's own call: a subclass's (CausalConv1d) pads through this method
            return Conv1d.__call__(self, mx.pad(x, [(0, 0), (left, right), (0, 0)]))
        pad = self.padding
        y = mx.conv_general(
            x, self.weight, padding=([pad + left], [pad + right]), kernel_dilation=self.dilation
        )
        return y + self.bias if "bias" in self else y

    def _kernel_weight(self, left: int, right: int) -> KernelWeight:
        """The weight as ``conv1d_kernel``'s, x padded by ``left`` and ``right`` more frames than ``padding``."""
        pad, dilation = self.padding, self.dilation
        build = partial(kernel_weight, dilation=dilation, left=pad + left, right=pad + right)
        return kept(self, f"_kernel_weight_{left}_{right}", (self.weight,), build)


class ConvTranspose1d(nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` (dilation 1, groups 1), computed by ``conv1d_kernel`` where it fits (CUDA), by
    ``conv_transpose1d`` on the CPU, else by MLX."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int, padding: int = 0):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding)

    def __call__(self, x: mx.array, mask: mx.array | None = None) -> mx.array:
        """The transposed convolution of ``x * mask`` (mask as ``Conv1d``'s)."""
        if kernel_conv_fits(x, self.weight):
            stride = self.stride

            def as_conv(w: mx.array, b: mx.array) -> tuple[KernelWeight, mx.array]:
                taps = _transposed_taps(w, stride)
                blocks = taps.shape[1]
                return kernel_weight(taps, 1, blocks - 1, blocks - 1), mx.tile(b, stride)

            weight, bias = kept(self, "_kernel_weight", (self.weight, self.bias), as_conv)
            y = conv1d_kernel(x, weight, bias, mask)
            return _phases_out(y, self.weight.shape, x.shape[1], stride, self.padding)
        x = x if mask is None else x * mask
        if not _on_cpu():
            return super().__call__(x)
        return conv_transpose1d(x, self.weight, self.stride, self.padding, self.bias)


# --- elementwise functions ---


# False sends every function below to MLX's own ops (benchmarks/bench_s3gen.py --variants mlx-math).
FAST_CPU_MATH = True


def _fast_path(x: mx.array) -> bool:
    return FAST_CPU_MATH and x.dtype == mx.float32 and _on_cpu()


def _horner(coefficients: tuple[float, ...], t: mx.array) -> mx.array:
    y = coefficients[-1]
    for c in coefficients[-2::-1]:
        y = y * t + c
    return y


def _exp_cpu(x: mx.array, high: float = 88.0) -> mx.array:
    # Clipping branches, so it is fast only where inputs rarely leave the range (then it predicts well).
    x = mx.clip(x, -87.0, high)
    t = x * _LOG2E + _ROUND
    n = t - _ROUND
    r = x - n * _LN2_HI - n * _LN2_LO
    two_n = mx.left_shift(t.view(mx.int32) - (_ROUND_BITS - 127), 23).view(mx.float32)
    return _horner(_EXP_TAYLOR, r) * two_n


def _erf_cpu(x: mx.array) -> mx.array:
    # Branch-free: both pieces are computed and blended with a 0/1 weight (mx.where branches per element).
    ax = mx.abs(x)
    tail = (ax >= 1.0).astype(x.dtype)
    xs = x * (1.0 - tail)  # 0 where the tail applies, so the polynomial stays small
    t = 1.0 / (ax + (1.0 - tail))  # 1/|x| on the tail, finite elsewhere
    erfc = _exp_cpu(-ax * ax) * (t * _horner(_ERFC_NUM, t) / _horner(_ERFC_DEN, t))
    return xs * _horner(_ERF_SMALL, xs * xs) + tail * mx.sign(x) * (1.0 - erfc)


def _sin_cpu(x: mx.array, shift: float = 0.0) -> mx.array:
    # With shift 0.5 the reduction is x = (k + 1/2)·pi + r, and cos(x) = -(-1)^k sin(r).
    t = x * _INV_PI - shift + _ROUND
    h = (t - _ROUND) + shift
    r = ((x - h * _PI_A) - h * _PI_B) - h * _PI_C
    sign = 1.0 - 2.0 * mx.bitwise_and(t.view(mx.int32), 1).astype(x.dtype)
    return (sign if shift == 0 else -sign) * (r * _horner(_SIN_TAYLOR, r * r))


_sin_cpu_compiled = mx.compile(_sin_cpu)
_cos_cpu_compiled = mx.compile(lambda x: _sin_cpu(x, 0.5))


@mx.compile
def _gelu_cpu(x: mx.array) -> mx.array:
    return 0.5 * x * (1.0 + _erf_cpu(x * 0.7071067811865476))


@mx.compile
def _mish_cpu(x: mx.array) -> mx.array:
    # tanh(softplus(x)) = n / (n + 2) with n = e^x (e^x + 2); past x = 20 it is 1 in fp32.
    u = _exp_cpu(x, high=20.0)
    n = u * (u + 2.0)
    return x * (n / (n + 2.0))


@mx.compile
def _shifted_exp_cpu(x: mx.array) -> mx.array:
    """exp(x - max of its row): a softmax's numerators."""
    return _exp_cpu(x - mx.max(x, axis=-1, keepdims=True))


_exp_cpu_compiled = mx.compile(_exp_cpu)


def exp(x: mx.array) -> mx.array:
    """``mx.exp``; on the CPU in float32, a vectorised polynomial (relative error <= 1.0e-7 down to e^-87,
    below which it returns about 1.6e-38 instead of smaller numbers or 0)."""
    return _exp_cpu_compiled(x) if _fast_path(x) else mx.exp(x)


def sin(x: mx.array) -> mx.array:
    """``mx.sin``; on the CPU in float32, a vectorised polynomial (abs. error <= 2e-7 for |x| < 1e4; MLX's CPU
    sin takes 40 ns per element there)."""
    return _sin_cpu_compiled(x) if _fast_path(x) else mx.sin(x)


def cos(x: mx.array) -> mx.array:
    """``mx.cos``; on the CPU in float32, the polynomial of ``sin`` (the same error bound)."""
    return _cos_cpu_compiled(x) if _fast_path(x) else mx.cos(x)


def gelu(x: mx.array) -> mx.array:
    """Exact (erf) GELU, x·Φ(x), as ``nn.gelu`` and torch's default."""
    return _gelu_cpu(x) if _fast_path(x) else nn.gelu(x)


# Shapeless: one trace for every number of rows (the estimator's frame counts vary), as nn.gelu's.
@partial(mx.compile, shapeless=True)
def _gelu_biased(y: mx.array, bias: mx.array) -> mx.array:
    return nn.gelu(y + bias)


def gelu_linear(x: mx.array, w_t: mx.array, bias: mx.array) -> mx.array:
    """``gelu(x @ w_t + bias)``: a linear layer (its weight transposed, (in, out)) and the exact GELU. In
    float32 off the fast CPU path the bias is added inside the compiled GELU: one primitive fewer than the
    product taking it (``addmm`` broadcasts its bias as a primitive of its own), for host-bound callers, and
    the same sum. Elsewhere ``addmm``: in bfloat16 the product and the bias apart would round twice (the bf16
    estimator's 10-step mel drifted from 1.13e-2 to 1.20e-2 relative L2 from upstream's fp32)."""
    if _fast_path(x) or x.dtype != mx.float32:
        return gelu(mx.addmm(bias, x, w_t))
    return _gelu_biased(x @ w_t, bias)


def mish(x: mx.array, mask: mx.array | None = None, add: mx.array | None = None) -> mx.array:
    """x·tanh(softplus(x)), as ``nn.mish``; then times ``mask`` and plus ``add`` (each broadcasting to x) where
    given. Off the CPU's fast path that is one fused kernel: S3Gen's estimator is bound by its host, and a
    separate multiply and add are a kernel each (its resnets add the time embedding and a bias after Mish)."""
    if _fast_path(x):
        y = _mish_cpu(x)
        y = y if mask is None else y * mask
        return y if add is None else y + add
    return _mish_then(mask is not None, add is not None)(x, *(a for a in (mask, add) if a is not None))


@cache
def _mish_then(masked: bool, added: bool) -> Callable[..., mx.array]:
    def chain(x: mx.array, *rest: mx.array) -> mx.array:
        y = nn.mish(x)
        y = y * rest[0] if masked else y
        return y + rest[-1] if added else y

    return mx.compile(chain, shapeless=True)


# CPU attention computes at most this many scores a piece (16 MiB in fp32), in chunks of query rows, so that a
# long sequence's scores are never all held at once. Pieces of 2^18 kept them in cache but made every product
# 16 query rows tall: on 2 EPYC cores the estimator's attention over 2 x 8 heads x 1,000 frames took 160 ms in
# those and 111 in these (medians of 5), its whole call at 1,000 frames 12.3 s against 9.2.
_CHUNK_SCORES = 2**22


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None = None) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` (q, k, v: (B, H, T, D); mask: an additive bias that broadcasts
    to (B, H, T_q, T_k), or None). On the CPU in float32 the softmax takes our exp (MLX's CPU attention spends
    most of its time in a scalar exp), and its row sums come out of the product with v, as a column of ones
    appended to v: two passes over the scores (max, exp) instead of four, 1.1-1.4x faster at 160-1000 frames.
    """
    if not _fast_path(q):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    b, h, t_q, _ = q.shape
    per_row = b * h * k.shape[-2]
    rows = min(t_q, max(1, _CHUNK_SCORES // per_row))
    # k and v made contiguous once (v by the concatenation): a head-split view would be copied again for every
    # chunk's product.
    q, k_t = q * scale, mx.contiguous(k).swapaxes(-1, -2)
    v_ones = mx.concatenate([v, mx.ones(v.shape[:-1] + (1,), v.dtype)], axis=-1)
    out = []
    for start in range(0, t_q, rows):
        scores = q[:, :, start : start + rows] @ k_t
        if mask is not None:
            scores = scores + (mask if mask.shape[-2] == 1 else mask[..., start : start + rows, :])
        weighted = _shifted_exp_cpu(scores) @ v_ones
        out.append(weighted[..., :-1] / weighted[..., -1:])
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=2)


def left_pad_mask(n: int, pad: mx.array) -> mx.array:
    """The (B, 1, N, N) attention mask of rows left-padded to a common length N: causal, and no index sees one
    before its row's ``pad[b]``. A padding index sees itself alone, which keeps its keys and values finite
    (later masks give them probability 0, but 0 times NaN would still be NaN). T3 and Turbo's T3 batches."""
    index = mx.arange(n)
    causal = index[None, :] <= index[:, None]  # (N, N): query, key
    own = (index[None, None, :] >= pad[:, None, None]) | (index[None, :] == index[:, None])
    return (causal & own)[:, None]


def window_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    at: mx.array,
    pad: mx.array,
    keys: mx.array,
    values: mx.array,
    window_keys: mx.array,
    window_values: mx.array,
    kernel: bool | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """One decode token's attention over a batch cache whose newest positions sit in a small window (models/
    cache.py ``BatchKVCache``): q, k, v (B, H, 1, hd) of the token at buffer index ``at[0]``; ``at[1]`` is the
    window's first buffer index (base). keys, values: (B, H, capacity, hd) holding the positions before base,
    read only; window_keys, window_values: (B, H, W, hd) holding base .. at[0] - 1, returned with this token
    written at index at[0] - base. Every row's pad is below base, so only the big buffers need the pad mask.
    Returns the heads merged, (B, 1, H·hd). Nothing depends on the values of at or pad: one trace per shape.
    kernel: as ``decode_attention``'s (on CUDA our kernel reads both key sets in one primitive; with
    ``KV_IN_PLACE`` it also writes k and v into the windows where they are, as ``heads`` writes a cache, and the
    windows come back through ``mx.depends`` on its output)."""
    fits = _kernel_fits(q, kernel)
    if fits and KV_IN_PLACE:
        out = _attention_kernel(
            q, [q, keys, values, at, pad, window_keys, window_values, k, v], True, True, True
        )
        return out, *mx.depends([window_keys, window_values], [out])
    position, base = at[0], at[1]
    slot = (position - base)[None]
    window_keys = mx.slice_update(window_keys, k, slot, axes=(2,))
    window_values = mx.slice_update(window_values, v, slot, axes=(2,))
    if fits:
        out = _attention_kernel(q, [q, keys, values, at, pad, window_keys, window_values], True, True)
        return out, window_keys, window_values
    # sdpa cannot join two key sets under one softmax, so attention is written out: scores of both parts
    # (B, H, 1, capacity + W), one softmax over them, then each part's values. Scaling q first, as sdpa.
    q = q * q.shape[-1] ** -0.5
    index = mx.arange(keys.shape[2])
    old = ((index < base) & (index >= pad[:, None]))[:, None, None]  # (B, 1, 1, capacity)
    new = mx.arange(window_keys.shape[2]) <= position - base  # (W,): the window past this token is stale
    # Scores and softmax in fp32 whatever the cache's dtype (as sdpa accumulates). -inf never meets an all
    # -inf row: every row sees at least its own new token.
    scores = mx.concatenate(
        [
            mx.where(old, (q @ keys.swapaxes(2, 3)).astype(mx.float32), -mx.inf),
            mx.where(new, (q @ window_keys.swapaxes(2, 3)).astype(mx.float32), -mx.inf),
        ],
        axis=-1,
    )
    p = mx.softmax(scores, axis=-1).astype(values.dtype)
    capacity = keys.shape[2]
    out = p[..., :capacity] @ values + p[..., capacity:] @ window_values
    return _merged(out), window_keys, window_values


# --- decode steps on CUDA ---
#
# A decode step is bound by the host work MLX does per primitive, not by the GPU (ADR 12). On an H200 a product
# with 2 rows goes to cuBLAS (14-20 us of host time each, as does any product with a bias epilogue), while MLX's
# matrix-vector kernel costs 6-7 us; attention with an array mask falls back to a chain of unfused primitives
# (28-37 us). What follows cuts both, and fuses a residual add or SwiGLU into the product, on CUDA; elsewhere
# it is the plain MLX ops it stands for.

# Rows up to which a projection runs as matrix-vector products on CUDA; beyond, reading the weight once per row
# costs more GPU time than cuBLAS's host time saves.
GEMV_ROWS = 4


# False keeps MLX's own ops on CUDA too (benchmarks/probe_step.py compares the two in one run).
CUDA_DECODE = True

# Whether ``heads`` writes k and v into the cache buffers in place on CUDA (ADR 13), and ``window_attention``'s
# kernel into a batch's windows, instead of two ``slice_update``s a layer, each of which copies its whole buffer:
# a decode loop queues step t + 1 while step t still holds the buffers, so MLX cannot donate them (English bf16
# on the H200: 2.11 ms a step against 3.16, 2026-12-04). MLX does not know of the write, so it is ordered before
# later readers only when each decode step is evaluated on its own: every T3 decode loop does (tests/
# test_decode_cuda.py holds them to it), and the H200 tests pass step by step and fail in a lazy 300-step graph
# of fixed tokens.
KV_IN_PLACE = True

# Whether the decode kernels take the norms' epsilon in their source and the step's position from a copy in
# device memory, instead of the 4-byte arrays the host makes: MLX keeps every array of 8 bytes or less in
# managed memory, pages the host writes every step (a new position) and the GPU then reads across the bus. On
# the H200 (ADR 15, runs AE) a step's GPU time fell from 1.88 to 1.12 ms (Turbo fp32) and 2.08 to 1.32 ms
# (English fp32); off only to measure it (probe_step's "ours-host-scalars", probe_layer --scalars).
DEVICE_SCALARS = True


def cuda_kernel(
    name: str, input_names: list[str], output_names: list[str], source: str, header: str = "", **options
) -> Callable[..., list[mx.array]]:
    """``mx.fast.cuda_kernel`` of ``source`` and ``header`` without their comments, indentation and blank lines.
    MLX puts the header and source into one new string at every call of the kernel and hashes it at every
    launch (by its source, 0.32): our sources explain themselves at length, and a third of what a T3 step or an
    estimator call copied and hashed (0.56 MB a step for English's 151 launches, 1.8 MB an estimator call) was
    comments and indentation. The compiled code is the same (NVRTC's PTX unchanged)."""
    return mx.fast.cuda_kernel(
        name, input_names, output_names, _bare(source), header=_bare(header), **options
    )


def _bare(source: str) -> str:
    """C++ source without ``//`` comments (outside string literals), leading and trailing blanks and empty
    lines. Lines stay lines, and the last ends in a newline: preprocessor directives (``#pragma unroll``, a
    header's ``#define``) keep theirs, and MLX writes its own code right after the header."""
    lines = []
    for line in source.splitlines():
        quote, i = None, 0
        while i < len(line):
            if quote:
                if line[i] == "\\":
                    i += 1
                elif line[i] == quote:
                    quote = None
            elif line[i] in "\"'":
                quote = line[i]
            elif line.startswith("//", i):
                line = line[:i]
                break
            i += 1
        if line := line.strip():
            lines.append(line + "\n")
    return "".join(lines)


def _float_literal(value: float) -> str:
    """C++ source for ``value`` rounded to float32, as ``mx.array([value], mx.float32)`` holds it."""
    return repr(struct.unpack("f", struct.pack("f", value))[0]) + "f"


def _eps_source(norm: nn.Module | None, name: str) -> str:
    """The source that gives a kernel's ``eps[0]``: a constant (``DEVICE_SCALARS``) or the input ``name``."""
    if norm is None or (name == "eps" and not DEVICE_SCALARS):
        return ""
    if DEVICE_SCALARS:
        return f"const float eps[1] = {{{_float_literal(norm.eps)}}};"
    return f"const float* eps = {name};"


def _in_device_memory(a: mx.array) -> mx.array:
    """A copy of a small array in a buffer of 16 bytes or more, which MLX puts in device memory (one
    primitive)."""
    flat = a.reshape(1, -1)
    return mx.contiguous(mx.broadcast_to(flat, (4, flat.shape[1])))[:1].reshape(a.shape)


# Whether MLX runs on CUDA here, asked once (``mx.cuda`` is absent from MLX builds older than the CUDA backend).
_CUDA = hasattr(mx, "cuda") and mx.cuda.is_available()


def _use_cuda_paths() -> bool:
    return CUDA_DECODE and _CUDA and mx.default_device() == mx.gpu


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and keys) whose few-row calls on CUDA (decode steps: CFG's 2 rows, Turbo's
    1) take a matrix-vector kernel: ours, or MLX's (as a batch of ``W @ row`` products, the bias added apart)
    where ours does not fit. ``project`` and ``heads`` fuse a norm before it and more after it into ours."""

    def __call__(self, x: mx.array) -> mx.array:
        if _fused_gemv_fits(x, self.weight):
            return _gemv(x, self, None, None, "none")
        if not _few_rows(x):
            return super().__call__(x)
        return few_rows_linear(x, self.weight, self.get("bias"))


def project(
    layer: nn.Module,
    x: mx.array,
    *,
    norm: nn.Module | None = None,
    residual: mx.array | None = None,
    act: str = "none",
) -> mx.array:
    """``residual + act(layer(norm(x)))``, each part optional; act "swiglu" is ``silu(gate) * up`` of the two
    halves of ``layer``'s output (Llama's fused gate/up projection), "gelu" GPT-2's tanh GELU. On CUDA one
    primitive when ``layer`` is a few-row ``Linear`` and ``norm`` an ``nn.RMSNorm``, an affine
    ``nn.LayerNorm`` or None; the plain ops otherwise."""
    if act not in _ACTS:
        raise ValueError(f"act={act!r}: expected one of {sorted(_ACTS)}")
    if _fusable(layer, x, norm) and not (act == "swiglu" and "bias" in layer):
        return _gemv(x, layer, norm, residual, act)
    y = layer(x if norm is None else norm(x))
    if act == "swiglu":
        gate, up = mx.split(y, 2, axis=-1)
        y = nn.silu(gate) * up
    elif act == "gelu":
        y = nn.gelu_approx(y)  # GPT-2's "gelu_new" is exactly this tanh approximation
    return y if residual is None else residual + y


def heads(
    layer: nn.Module,
    x: mx.array,
    num_heads: int,
    *,
    norm: nn.Module | None = None,
    position: mx.array | None = None,
    pad: mx.array | None = None,
    rope_periods: mx.array | None = None,
    cache: tuple[mx.array, mx.array] | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """One token's fused q/k/v projection ``layer(norm(x))`` of x (B, 1, D), whose output columns are
    [q | k | v], as q, k, v (B, H, 1, hd).

    rope_periods: rotate q and k as T3 does (``mx.fast.rope`` with these periods, non-traditional) at buffer
        index ``position`` (an int32 scalar array) less each row's ``pad`` (B,) when given.
    cache: key and value buffers (B, H, capacity, hd): k and v are written at index ``position`` and the
        buffers are returned in their place, (q, keys, values).

    On CUDA one primitive (as ``project``), and with ``KV_IN_PLACE`` that primitive also writes k and v into
    the buffers where they are: MLX has no in-place update for a custom kernel, so the kernel writes through its
    read-only inputs. MLX then does not know the buffers changed, so they are returned through ``mx.depends``
    on q, which orders MLX's evaluation of later readers after the write (not the GPU's, within one CUDA
    graph: see ``KV_IN_PLACE``). The buffers are made whole by MLX (``models/cache.py``: pads and
    concatenations, row-contiguous), so MLX hands the kernel the buffer itself, not a copy. Elsewhere the plain
    ops, with two ``slice_update``s."""
    b = x.shape[0]
    hd = layer.weight.shape[0] // (3 * num_heads)
    if (rope_periods is not None or cache is not None) and position is None:
        raise ValueError("RoPE and the cache write need the token's position")
    if _fusable(layer, x, norm) and hd % 2 == 0:
        in_place = cache if KV_IN_PLACE else None
        out = _gemv(
            x,
            layer,
            norm,
            None,
            "heads",
            num_heads=num_heads,
            heads_args=(position, pad, rope_periods, in_place),
        )
        if cache is None:
            return tuple(out)
        if in_place is not None:
            return out[0], *mx.depends(list(cache), [out[0]])
        q, k, v = out
    else:
        # One token's (B, 1, 3·H·hd) is (B, 3, H, 1, hd) in memory: reshapes alone, no transposes.
        qkv = layer(x if norm is None else norm(x)).reshape(b, 3, num_heads, 1, hd)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        if rope_periods is not None:
            offset = position if pad is None else position - pad  # a (B,) offset is one per row (axis 0)
            # q and k in one call: one kernel instead of two.
            qk = mx.fast.rope(
                qkv[:, :2], hd, traditional=False, base=None, scale=1.0, offset=offset, freqs=rope_periods
            )
            q, k = qk[:, 0], qk[:, 1]
        if cache is None:
            return q, k, v
    keys, values = cache
    keys = mx.slice_update(keys, k, position[None], axes=(2,))
    values = mx.slice_update(values, v, position[None], axes=(2,))
    return q, keys, values


_ACTS = ("none", "swiglu", "gelu")


def _few_rows(x: mx.array) -> bool:
    return _use_cuda_paths() and x.size <= GEMV_ROWS * x.shape[-1]


def few_rows_linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """``x @ weight.T (+ bias)`` for x (..., K) as one ``weight @ row`` product per row (batched): the form
    MLX computes with its matrix-vector kernel."""
    y = (weight @ x.reshape(-1, x.shape[-1], 1)).reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def _fused_gemv_fits(x: mx.array, weight: mx.array) -> bool:
    # 32 lanes x one 16-byte load must tile a row; our kernel reads float32, bfloat16 and float16 weights.
    return _few_rows(x) and weight.dtype == x.dtype and x.shape[-1] % (32 * 16 // x.dtype.size) == 0


def _norm_kind(norm: nn.Module | None) -> str | None:
    """How our kernel applies ``norm`` before the product: "none", "rms", "layer", or None where it cannot."""
    if norm is None:
        return "none"
    if type(norm) is nn.RMSNorm:
        return "rms"
    if type(norm) is nn.LayerNorm and "weight" in norm and "bias" in norm:
        return "layer"
    return None


def _fusable(layer: nn.Module, x: mx.array, norm: nn.Module | None) -> bool:
    return (
        isinstance(layer, Linear)
        and _fused_gemv_fits(x, layer.weight)
        and _norm_kind(norm) is not None
        and all(a.dtype == x.dtype for a in (norm.parameters().values() if norm is not None else ()))
    )


# One warp per output column (two for SwiGLU's gate and up, or a rotary pair: columns i and i + hd/2 of a head)
# reads its weight rows once for all M rows (16-byte loads, fp32 sums). Before: the rows' norm, computed by every
# warp (the rows are a few KiB, in cache). After: bias, activation, residual, or the q/k/v split with RoPE.
# A lane issues a chunk of its loads (weights, x, the norm's parameters: C steps of 16 bytes) before it adds up
# any: written as one loop, the compiler did not unroll it and a warp waited on each load in turn, 8-32 trips to
# memory a row (benchmarks/RESULTS.md run AC). Each lane still adds its products in the order of k.
# Intermediate values are rounded to T where MLX's separate ops would store them, so that fp32 is the same math.
# LOAD_X reads 16 bytes of x, LOAD one element of an activation: plain loads, except in the fused layer kernel
# (``_BLOCK``), whose activations other thread blocks of the same kernel wrote: it reads them from L2
# (``__ldcg``), never from an SM's L1 cache, which is not coherent.
_PLAIN_LOADS = """
#define LOAD_X(p) (*reinterpret_cast<const uint4*>(p))
#define LOAD(p) (*(p))
"""
_GEMV_UNIT = """
    %(columns)s
    // A lane reads 16 bytes at each of STEPS places along a row, C of them at once: at most 8, and at most
    // GEMV_LOADS loads in flight (the weight rows, M rows of x, the norm's parameters).
    constexpr int STEPS = K / (32 * V);
    constexpr int C = [] {
        int c = 8;
        while (STEPS %% c || c * (1 + PAIR + M + %(norm_count)d) > %(loads)d) --c;
        return c;
    }();
    // The norm's passes over a row of x load nothing else: up to GEMV_LOADS steps of it at once.
    constexpr int CR = [] {
        int c = STEPS < %(loads)d ? STEPS : %(loads)d;
        while (STEPS %% c) --c;
        return c;
    }();
    const T* w0 = w + (size_t)n0 * K;
    const T* w1 = w + (size_t)n1 * K;
    float scale[M], shift[M];
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        scale[m] = 1.f;
        shift[m] = 0.f;
        %(prologue)s
    }
    float a0[M], a1[M];
    #pragma unroll
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = 0.f;
    for (int s0 = 0; s0 < STEPS; s0 += C) {
        uint4 r0[C], r1[C], xs[C][M], gs[C], bs[C];
        #pragma unroll
        for (int c = 0; c < C; ++c) {
            int k = (s0 + c) * 32 * V + lane * V;
            r0[c] = *reinterpret_cast<const uint4*>(w0 + k);
            r1[c] = PAIR ? *reinterpret_cast<const uint4*>(w1 + k) : r0[c];
            %(norm_load)s
            #pragma unroll
            for (int m = 0; m < M; ++m) xs[c][m] = LOAD_X(x + m * K + k);
        }
        // Loads may not move past it; the compiler still interleaves the chunk's loads with the products 2-3
        // steps deep (sm_90a, 64 registers), more than the one step of a plain loop.
        __syncwarp();
        #pragma unroll
        for (int c = 0; c < C; ++c) {
            const T* wv0 = reinterpret_cast<const T*>(&r0[c]);
            const T* wv1 = reinterpret_cast<const T*>(&r1[c]);
            const T* gv = reinterpret_cast<const T*>(&gs[c]);
            const T* bv = reinterpret_cast<const T*>(&bs[c]);
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                const T* xv = reinterpret_cast<const T*>(&xs[c][m]);
                #pragma unroll
                for (int j = 0; j < V; ++j) {
                    float xj = %(x_value)s;
                    a0[m] += static_cast<float>(wv0[j]) * xj;
                    if (PAIR) a1[m] += static_cast<float>(wv1[j]) * xj;
                }
            }
        }
    }
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        float g = a0[m], u = a1[m];
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            g += __shfl_xor_sync(0xffffffff, g, o);
            if (PAIR) u += __shfl_xor_sync(0xffffffff, u, o);
        }
        if (lane != 0) continue;
        %(epilogue)s
    }
"""
# The norm of row m, from the x it is about to read (the same 16-byte lanes as the product): MLX's RMSNorm
# (rsqrt of the mean square + eps) and LayerNorm (mean, then the mean squared deviation).
_ROW_SUM = """
        float s_%(name)s = 0.f;
        for (int s0 = 0; s0 < STEPS; s0 += CR) {
            uint4 xr[CR];
            #pragma unroll
            for (int c = 0; c < CR; ++c) xr[c] = LOAD_X(x + m * K + (s0 + c) * 32 * V + lane * V);
            #pragma unroll
            for (int c = 0; c < CR; ++c) {
                const T* xv = reinterpret_cast<const T*>(&xr[c]);
                #pragma unroll
                for (int j = 0; j < V; ++j) {
                    float t = static_cast<float>(xv[j]) - shift[m];
                    s_%(name)s += %(term)s;
                }
            }
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) s_%(name)s += __shfl_xor_sync(0xffffffff, s_%(name)s, o);
"""
_PROLOGUES = {
    "none": "",
    "rms": _ROW_SUM % dict(name="sq", term="t * t") + "scale[m] = rsqrtf(s_sq / K + eps[0]);",
    "layer": _ROW_SUM % dict(name="sum", term="t")
    + "shift[m] = s_sum / K;"
    + _ROW_SUM % dict(name="sq", term="t * t")
    + "scale[m] = rsqrtf(s_sq / K + eps[0]);",
}
_NORM_LOADS = {
    "none": "",
    "rms": "gs[c] = *reinterpret_cast<const uint4*>(norm_w + k);",
    "layer": """gs[c] = *reinterpret_cast<const uint4*>(norm_w + k);
            bs[c] = *reinterpret_cast<const uint4*>(norm_b + k);""",
}
_NORM_COUNT = {"none": 0, "rms": 1, "layer": 2}  # the norm's parameter loads a step (``_GEMV_UNIT``'s C)
# The most 16-byte loads a lane of ``_GEMV_UNIT`` has in flight: 16 keeps a kernel to 64 registers on sm_90a
# (benchmarks/probe_step.py --gemv-loads tries others).
GEMV_LOADS = 16
_NORMED = "static_cast<float>(static_cast<T>((static_cast<float>(xv[j]) - shift[m]) * scale[m]))"
_X_VALUES = {
    "none": "static_cast<float>(xv[j])",
    "rms": f"static_cast<float>(static_cast<T>(static_cast<float>(gv[j]) * {_NORMED}))",
    "layer": f"static_cast<float>(static_cast<T>(static_cast<float>(static_cast<T>(static_cast<float>(gv[j]) * "
    f"{_NORMED})) + static_cast<float>(bv[j])))",
}
_GEMV = """
    constexpr int V = 16 / sizeof(T);
    int lane = threadIdx.x & 31;
    int unit = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (unit >= UNITS) return;
""" + _GEMV_UNIT
_ROWS_COLUMNS = "int n0 = unit, n1 = PAIR ? unit + UNITS : unit;"
_ROWS_EPILOGUE = """
        float y = g;
        %(bias)s
        %(act)s
        %(residual)s
        out[m * UNITS + n0] = static_cast<T>(y);
"""
_ACT_CODE = {
    "none": "",
    "swiglu": "y = g / (1.f + expf(-g)) * u;",
    "gelu": "y = 0.5f * y * (1.f + tanhf(0.7978845608028654f * (y + 0.044715f * y * y * y)));",
}
# Heads: unit = (head block of 3H, i < hd/2); columns n0 = i and n1 = i + hd/2 of that head, q, k or v.
_HEADS_COLUMNS = """
    constexpr int HALF = HD / 2;
    int block = unit / HALF, i = unit % HALF;
    int n0 = block * HD + i, n1 = n0 + HALF;
"""
_HEADS_EPILOGUE = """
        float x1 = static_cast<float>(static_cast<T>(g %(bias0)s));
        float x2 = static_cast<float>(static_cast<T>(u %(bias1)s));
        int part = block / H;
        %(rope)s
        %(store)s
"""
_STORE_HEADS = """
        T* dst = part == 0 ? q : (part == 1 ? k : v);
        size_t o = (size_t)m * H * HD + (size_t)(block % H) * HD + i;
        dst[o] = static_cast<T>(x1);
        dst[o + HALF] = static_cast<T>(x2);
"""
# q to the output; k and v into the cache buffers at the token's index, through the read-only inputs (``heads``).
_STORE_CACHE = """
        size_t o = (size_t)m * H * HD + (size_t)(block % H) * HD + i;
        if (part > 0) o = (o - i) * keys_shape[2] + (size_t)position[0] * HD + i;
        T* dst = part == 0 ? q : const_cast<T*>(part == 1 ? keys : values);
        dst[o] = static_cast<T>(x1);
        dst[o + HALF] = static_cast<T>(x2);
"""
# q and k rotate as MLX's rope kernel does: inverse frequency 1.0 / period, theta = position * it, in float.
_ROPE = """
        if (part < 2) {
            float inv_freq = 1.0 / periods[i];
            float theta = static_cast<float>(%(position)s) * inv_freq;
            float c = cos(theta), s = sin(theta);
            float r1 = x1 * c - x2 * s;
            x2 = x1 * s + x2 * c;
            x1 = r1;
        }
"""
_gemv_kernels: dict[tuple, object] = {}


def _norm_fields(kind: str) -> dict:
    """``_GEMV_UNIT``'s fields that follow the norm before the product (``_norm_kind``), and its load depth."""
    return dict(
        prologue=_PROLOGUES[kind],
        norm_load=_NORM_LOADS[kind],
        norm_count=_NORM_COUNT[kind],
        loads=GEMV_LOADS,
        x_value=_X_VALUES[kind],
    )


def _gemv(
    x: mx.array,
    layer: nn.Linear,
    norm: nn.Module | None,
    residual: mx.array | None,
    act: str,
    num_heads: int = 0,
    heads_args: tuple = (None, None, None, None),
) -> mx.array | list[mx.array]:
    """Our kernel for ``project`` (act "none", "swiglu", "gelu") or ``heads`` (act "heads", with
    ``heads_args`` = its position, pad, rope_periods, cache)."""
    bias = layer.get("bias")
    kind = _norm_kind(norm)
    position, pad, periods, cache = heads_args
    rope, has_cache = periods is not None, cache is not None
    has_pad = rope and pad is not None  # pad only moves RoPE's position
    eps = _eps_source(norm, "eps")
    key = (kind, bias is not None, residual is not None, act, rope, has_pad, has_cache, eps)
    if key not in _gemv_kernels:
        names = ["x", "w"] + {"none": [], "rms": ["norm_w"], "layer": ["norm_w", "norm_b"]}[kind]
        names += ["eps"] if kind != "none" and not DEVICE_SCALARS else []
        names += ["bias"] if bias is not None else []
        names += ["residual"] if residual is not None else []
        names += ["periods"] if rope else []
        names += ["position"] if rope or has_cache else []
        names += ["pad"] if has_pad else []
        names += ["keys", "values"] if has_cache else []
        if act == "heads":
            columns, outputs = _HEADS_COLUMNS, (["q"] if has_cache else ["q", "k", "v"])
            epilogue = _HEADS_EPILOGUE % dict(
                bias0="+ static_cast<float>(bias[n0])" if bias is not None else "",
                bias1="+ static_cast<float>(bias[n1])" if bias is not None else "",
                rope=(
                    ""
                    if not rope
                    else _ROPE % dict(position="position[0] - pad[m]" if has_pad else "position[0]")
                ),
                store=_STORE_CACHE if has_cache else _STORE_HEADS,
            )
        else:
            columns, outputs = _ROWS_COLUMNS, ["out"]
            epilogue = _ROWS_EPILOGUE % dict(
                bias="y += static_cast<float>(bias[n0]);" if bias is not None else "",
                act=_ACT_CODE[act],
                residual=(
                    "y += static_cast<float>(LOAD(residual + m * UNITS + n0));"
                    if residual is not None
                    else ""
                ),
            )
        source = eps + _GEMV % dict(columns=columns, epilogue=epilogue, **_norm_fields(kind))
        name = "_".join(
            ["gemv", kind, act] + [n for n in names if n in ("bias", "residual", "periods", "pad", "keys")]
        )
        _gemv_kernels[key] = cuda_kernel(name, names, outputs, source, header=_PLAIN_LOADS)
    k = x.shape[-1]
    m = x.size // k
    inputs = [x, layer.weight]
    if kind != "none":
        inputs += [norm.weight] + ([norm.bias] if kind == "layer" else [])
        inputs += [] if DEVICE_SCALARS else [mx.array([norm.eps], dtype=mx.float32)]
    inputs += [bias] if bias is not None else []
    inputs += [residual] if residual is not None else []
    template = [("T", x.dtype), ("M", m), ("K", k)]
    if act == "heads":
        hd = layer.weight.shape[0] // (3 * num_heads)
        units = 3 * num_heads * hd // 2
        inputs += [periods.astype(mx.float32)] if rope else []
        inputs += [position] if rope or has_cache else []
        inputs += [pad] if has_pad else []
        inputs += list(cache) if has_cache else []
        template += [("UNITS", units), ("PAIR", True), ("H", num_heads), ("HD", hd)]
        shape, n_out = (m, num_heads, 1, hd), 1 if has_cache else 3
    else:
        units = layer.weight.shape[0] // (2 if act == "swiglu" else 1)
        template += [("UNITS", units), ("PAIR", act == "swiglu")]
        shape, n_out = x.shape[:-1] + (units,), 1
    outs = _gemv_kernels[key](
        inputs=inputs,
        template=template,
        grid=(units * 32, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[shape] * n_out,
        output_dtypes=[x.dtype] * n_out,
    )
    if act != "heads":
        return outs[0]
    return outs


def visible_mask(capacity: int, position: mx.array, pad: mx.array | None = None) -> mx.array:
    """Which of a decode step's ``capacity`` buffer positions its token sees: those up to ``position`` (the
    tail is unwritten), from each row's ``pad[b]`` on when rows are left-padded: (capacity,) or (B, 1, 1,
    capacity)."""
    index = mx.arange(capacity)
    visible = index <= position
    if pad is not None:
        visible = (visible & (index >= pad[:, None]))[:, None, None]
    return visible


# One block of WARPS warps per (row, head); each warp takes every WARPS-th visible key with an online softmax
# (running max, sum and weighted values: no scores stored, so no shared memory that depends on the capacity),
# then warp 0 merges the warps'. A warp takes UNROLL of its keys at a time: their rows are loaded before any is
# used, so UNROLL loads are in flight per warp instead of one, and a key costs one memory latency per UNROLL.
# All in fp32 whatever T. at = [position, base]: indices from base on are read from the window buffers
# (models/cache.py BatchKVCache), those before from keys/values; without a window base is past position.
_ATTENTION_ITEM = """
    int capacity = keys_shape[2];
    int last = at[0];
    int first = %(first)s;
    %(range)s
    const T* kb = keys + (size_t)bh * capacity * D + lane * PER;
    const T* vb = values + (size_t)bh * capacity * D + lane * PER;
    %(window)s
    float qv[PER], acc[PER];
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
        qv[i] = static_cast<float>(LOAD(q + (size_t)bh * D + lane * PER + i)) * (1.0f / sqrtf((float)D));
        acc[i] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (int j0 = first + warp; j0 <= stop; j0 += WARPS * UNROLL) {
        float kf[UNROLL][PER], vf[UNROLL][PER], s[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            int j = j0 + u * WARPS;
            if (j <= stop) {
                const T* kr = %(key_row)s;
                const T* vr = %(value_row)s;
                #pragma unroll
                for (int i = 0; i < PER; ++i) {
                    kf[u][i] = static_cast<float>(LOAD(kr + i));
                    vf[u][i] = static_cast<float>(LOAD(vr + i));
                }
            } else {  // past the last key: its score is computed but never used
                #pragma unroll
                for (int i = 0; i < PER; ++i) kf[u][i] = vf[u][i] = 0.f;
            }
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            s[u] = 0.f;
            #pragma unroll
            for (int i = 0; i < PER; ++i) s[u] += qv[i] * kf[u][i];
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) s[u] += __shfl_xor_sync(0xffffffff, s[u], o);
        }
        float m_new = m;
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) if (j0 + u * WARPS <= stop) m_new = fmaxf(m_new, s[u]);
        float correction = expf(m - m_new);
        l *= correction;
        #pragma unroll
        for (int i = 0; i < PER; ++i) acc[i] *= correction;
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (j0 + u * WARPS <= stop) {
                float p = expf(s[u] - m_new);
                l += p;
                #pragma unroll
                for (int i = 0; i < PER; ++i) acc[i] += p * vf[u][i];
            }
        }
        m = m_new;
    }
    __shared__ float warp_m[WARPS], warp_l[WARPS], warp_acc[WARPS][D];
    if (lane == 0) {
        warp_m[warp] = m;
        warp_l[warp] = l;
    }
    #pragma unroll
    for (int i = 0; i < PER; ++i) warp_acc[warp][lane * PER + i] = acc[i];
    __syncthreads();
    if (warp == 0) {
        float m_all = -INFINITY;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) m_all = fmaxf(m_all, warp_m[w]);
        float l_all = 0.f, o[PER];
        #pragma unroll
        for (int i = 0; i < PER; ++i) o[i] = 0.f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            float c = warp_l[w] > 0.f ? expf(warp_m[w] - m_all) : 0.f;  // a warp that saw no key adds nothing
            l_all += warp_l[w] * c;
            #pragma unroll
            for (int i = 0; i < PER; ++i) o[i] += warp_acc[w][lane * PER + i] * c;
        }
        %(store)s
    }
"""
# Keys first .. last, and the heads' output normalised (the whole range of one (row, head) in one block).
_WHOLE_RANGE = dict(
    range="int stop = last;",
    store="""#pragma unroll
        for (int i = 0; i < PER; ++i) out[(size_t)bh * D + lane * PER + i] = static_cast<T>(o[i] / l_all);""",
)
# The kernel: one block per (row, head).
_DECODE_ATTENTION = """
    constexpr int PER = D / 32;
    int bh = blockIdx.x;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
""" + _ATTENTION_ITEM
# Keys a warp loads at a time (1 is one key per memory latency).
DECODE_UNROLL = 4
# Up to this many (row, head) blocks, 16 warps a block (a lone stream's 32 blocks leave most of the GPU idle, so
# its keys are split 16 ways); beyond, 4 (a batch's blocks fill the GPU on their own).
DECODE_WIDE_BLOCKS = 256


_WINDOW_SETUP = """
    int window = window_keys_shape[2], base = at[1];
    const T* wkb = window_keys + (size_t)bh * window * D + lane * PER;
    const T* wvb = window_values + (size_t)bh * window * D + lane * PER;
"""
# k and v of the token into the windows at its index, through the read-only inputs (``window_attention``).
_WINDOW_WRITE = """
    const T* nkb = k + (size_t)bh * D + lane * PER;
    const T* nvb = v + (size_t)bh * D + lane * PER;
    if (warp == 0) {
        size_t slot = (size_t)(last - base) * D;
        #pragma unroll
        for (int i = 0; i < PER; ++i) {
            const_cast<T*>(wkb)[slot + i] = nkb[i];
            const_cast<T*>(wvb)[slot + i] = nvb[i];
        }
    }
"""
_decode_attention_kernels: dict[tuple[bool, bool, bool], object] = {}


def _attention_kernel(
    q: mx.array, inputs: list[mx.array], has_pad: bool, window: bool, write: bool = False
) -> mx.array:
    """Our decode attention kernel on ``inputs`` = q, keys, values, at[, pad][, window_keys, window_values[, k,
    v]]; ``write`` (with the token's k and v): it writes them into the windows at index at[0] - base itself.
    """
    if (has_pad, window, write) not in _decode_attention_kernels:
        names = ["q", "keys", "values", "at"] + (["pad"] if has_pad else [])
        names += ["window_keys", "window_values"] if window else []
        names += ["k", "v"] if write else []
        # The token's own key and value are read from k and v, never from the slot this kernel writes.
        own = ("j == last ? nkb : ", "j == last ? nvb : ") if write else ("", "")
        rows = (
            dict(
                window=_WINDOW_SETUP + (_WINDOW_WRITE if write else ""),
                key_row=own[0] + "j >= base ? wkb + (size_t)(j - base) * D : kb + (size_t)j * D",
                value_row=own[1] + "j >= base ? wvb + (size_t)(j - base) * D : vb + (size_t)j * D",
                first="pad[bh / H]",
            )
            if window
            else dict(
                window="",
                key_row="kb + (size_t)j * D",
                value_row="vb + (size_t)j * D",
                first="pad[bh / H]" if has_pad else "0",
            )
        ) | _WHOLE_RANGE
        name = "decode_attention" + ("_pad" if has_pad else "") + ("_window" if window else "")
        _decode_attention_kernels[has_pad, window, write] = cuda_kernel(
            name + ("_write" if write else ""), names, ["out"], _DECODE_ATTENTION % rows, header=_PLAIN_LOADS
        )
    b, h, _, hd = q.shape
    warps = 16 if b * h <= DECODE_WIDE_BLOCKS else 4
    return _decode_attention_kernels[has_pad, window, write](
        inputs=inputs,
        template=[("T", q.dtype), ("D", hd), ("H", h), ("WARPS", warps), ("UNROLL", DECODE_UNROLL)],
        grid=(b * h * 32 * warps, 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(b, 1, h * hd)],
        output_dtypes=[q.dtype],
    )[0]


def _merged(out: mx.array) -> mx.array:
    """(B, H, 1, hd) -> (B, 1, H·hd), the output projection's input: one query, so a reshape."""
    b, h, _, hd = out.shape
    return out.reshape(b, 1, h * hd)


def _kernel_fits(q: mx.array, kernel: bool | None) -> bool:
    return (_use_cuda_paths() and q.shape[-1] % 32 == 0) if kernel is None else kernel


def decode_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    position: mx.array,
    pad: mx.array | None = None,
    kernel: bool | None = None,
) -> mx.array:
    """One decode token's attention over fixed-size key and value buffers: q (B, H, 1, hd), keys and values
    (B, H, capacity, hd), the token at buffer index ``position`` (int32 scalar array) already written in; row b
    sees indices pad[b] .. position (``visible_mask``). Scale hd^-0.5. Returns the heads merged, (B, 1, H·hd).

    kernel: our CUDA kernel (one primitive) or ``mx.fast.scaled_dot_product_attention`` with the mask (which
    MLX-CUDA runs unfused); None picks the kernel on CUDA for head dims that are a multiple of 32."""
    if not _kernel_fits(q, kernel):
        mask = visible_mask(keys.shape[2], position, pad)
        return _merged(
            mx.fast.scaled_dot_product_attention(q, keys, values, scale=q.shape[-1] ** -0.5, mask=mask)
        )
    at = position.reshape(1)  # no window: the kernel reads at[0] alone
    return _attention_kernel(
        q, [q, keys, values, at] + ([] if pad is None else [pad]), pad is not None, False
    )


# One layer's keys and values in a decode step, as the two caches of models/cache.py hold them. ``attend`` runs
# the layer's q/k/v projection (``heads``) and its attention, so that a model has one decode for both.


class BufferState(NamedTuple):
    """Fixed-size buffers (``KVCache``): keys, values (B, H, capacity, hd), the token at buffer index
    ``position`` (int32 scalar array), ``pad`` (B,) int32 for rows left-padded to a common length (row b
    starts at index pad[b]). tap: called with q, the keys, the mask and the scale (t3.py ``AttentionTaps``).
    sync: the step's counters for ``decode_layer``'s kernel (``per_layer``).
    """

    keys: mx.array
    values: mx.array
    position: mx.array
    pad: mx.array | None = None
    tap: Callable | None = None
    sync: mx.array | None = None

    @classmethod
    def per_layer(
        cls, kv: list[mx.array], position: mx.array, pad: mx.array | None, arch: str
    ) -> list[BufferState]:
        """One state per layer from a cache's ``kv = [keys_0, values_0, keys_1, ...]``; where ``FUSED_LAYERS``
        holds for the model's ``arch`` ("gpt2" or "llama") on CUDA, with ``KV_IN_PLACE``, they share the step's
        counters for ``decode_layer``'s kernel, zeros (one primitive a step). With ``DEVICE_SCALARS`` on CUDA
        they share a copy of ``position`` in device memory (one primitive more)."""
        fused = FUSED_LAYERS[arch] and KV_IN_PLACE and _use_cuda_paths()
        sync = mx.zeros((_SYNC_INTS,), dtype=mx.int32) if fused else None
        if DEVICE_SCALARS and _use_cuda_paths():
            position = _in_device_memory(position)
        return [cls(k, v, position, pad, sync=sync) for k, v in zip(kv[::2], kv[1::2])]

    @property
    def written(self) -> tuple[mx.array, mx.array]:
        """What a step gives back to the cache: the buffers."""
        return self.keys, self.values

    def attend(
        self, layer: nn.Module, x: mx.array, num_heads: int, **kw: object
    ) -> tuple[mx.array, BufferState]:
        """``heads(layer, x, num_heads, **kw)`` (kw: its norm, rope_periods) of x (B, 1, D), k and v
        written into the buffers at ``position``, then ``decode_attention``: the heads merged (B, 1, H·hd) and
        the state with the token written in."""
        q, keys, values = heads(
            layer, x, num_heads, position=self.position, pad=self.pad, cache=(self.keys, self.values), **kw
        )
        if self.tap is not None:
            self.tap(q, keys, visible_mask(keys.shape[2], self.position, self.pad), q.shape[-1] ** -0.5)
        out = decode_attention(q, keys, values, self.position, self.pad)
        return out, self._replace(keys=keys, values=values)


class WindowState(NamedTuple):
    """A batch cache (``BatchKVCache``) in ``window_attention``'s terms: big buffers (read only), the
    windows, at = [buffer index of the token, the window's base], the rows' left padding."""

    keys: mx.array
    values: mx.array
    window_keys: mx.array
    window_values: mx.array
    at: mx.array
    pad: mx.array

    @classmethod
    def per_layer(
        cls, kv: list[mx.array], window: list[mx.array], at: mx.array, pad: mx.array
    ) -> list[WindowState]:
        """One state per layer from a ``BatchKVCache``'s ``kv`` and ``window``, both in layer order."""
        return [cls(*a, at, pad) for a in zip(kv[::2], kv[1::2], window[::2], window[1::2])]

    @property
    def written(self) -> tuple[mx.array, mx.array]:
        """What a step gives back to the cache: the windows."""
        return self.window_keys, self.window_values

    def attend(
        self, layer: nn.Module, x: mx.array, num_heads: int, **kw: object
    ) -> tuple[mx.array, WindowState]:
        """As ``BufferState.attend``, the token written into the windows by ``window_attention``."""
        q, k, v = heads(layer, x, num_heads, position=self.at[0], pad=self.pad, **kw)
        out, window_keys, window_values = window_attention(
            q, k, v, self.at, self.pad, self.keys, self.values, self.window_keys, self.window_values
        )
        return out, self._replace(window_keys=window_keys, window_values=window_values)


# --- one kernel per decoder layer (ADR 15) ---


class LayerParts(NamedTuple):
    """A pre-norm decoder layer as a decode step runs it (T3's Llama layer, GPT-2's block): h = x +
    out(attention(qkv(norm1(x)))), then h + down(act(up(norm2(h)))). act: "gelu" or "swiglu" (``project``);
    rope_periods: T3's RoPE (``heads``)."""

    qkv: nn.Module
    norm1: nn.Module
    out: nn.Module
    norm2: nn.Module
    up: nn.Module
    down: nn.Module
    act: str
    num_heads: int
    rope_periods: mx.array | None = None


# Whether a decode step's layers are one kernel each on CUDA where they fit (``decode_layer``), by architecture
# (ADR 15): it halves a step's primitives and cuts the host's time by 40%, but its GPU time is longer than five
# kernels'. GPT-2's smaller layers (Turbo, Nano) come out ahead on the H200, Llama's (English) behind.
# benchmarks/probe_step.py runs both ways in one process ("ours-layer-kernel", "ours-five-kernels").
FUSED_LAYERS = {"gpt2": True, "llama": False}
# Thread blocks of the layer kernel; None: the GPU's SM count. Blocks claim their work as they start (``_BLOCK``),
# so any number is correct, but one block fills an SM (512 threads of ~90 registers), and blocks past the SM
# count start only as others leave, with nothing left to claim: on the H200 (132 SMs) a 256-block grid was 3-26%
# slower than 132 (run AC2), and still as slow with those blocks leaving at once (run AC3). The kernel leaves
# blocks past the SM count idle all the same.
LAYER_BLOCKS: int | None = None
_MAX_SPLIT = 16  # chunks of keys a (row, head) at most in the attention phase
_LAYER_WARPS = 16  # warps a block, as ``_attention_kernel`` gives a lone stream's
# The counters a layer kernel claims and reports its work with: a claim per phase, a "done" per phase but the
# last, and the exit count, each on a 128-byte line of its own (blocks polling one hold up no atomic on another).
_SYNC_LINE = 32
_PHASES = 6
_SYNC_INTS = 2 * _PHASES * _SYNC_LINE


def decode_layer(
    x: mx.array, state: BufferState | WindowState, parts: LayerParts
) -> tuple[mx.array, BufferState | WindowState]:
    """One token x (B, 1, D) through a pre-norm decoder layer whose keys and values are ``state``'s; returns
    the layer's output and the state with the token written in.

    With a ``BufferState`` that has counters (``per_layer``: a lone request's decode loop) and no tap, one kernel
    (``_fused_layer``): one primitive where the composed path is five (``heads``, the attention kernel, three
    ``project``s), the same arithmetic but for the attention's sums (its keys split over blocks). Otherwise the
    composed path: ``BufferState.attend`` or ``WindowState.attend``, then the projections."""
    if _layer_kernel_fits(x, state, parts):
        return _fused_layer(x, state, parts)
    out, state = state.attend(
        parts.qkv, x, parts.num_heads, norm=parts.norm1, rope_periods=parts.rope_periods
    )
    h = project(parts.out, out, residual=x)
    return project(parts.down, project(parts.up, h, norm=parts.norm2, act=parts.act), residual=h), state


def _layer_kernel_fits(x: mx.array, state: BufferState | WindowState, parts: LayerParts) -> bool:
    if not (type(state) is BufferState and state.sync is not None and state.tap is None):
        return False
    if parts.act == "swiglu" and "bias" in parts.up:
        return False
    hd = parts.qkv.weight.shape[0] // (3 * parts.num_heads)
    widths = (x, parts.out.weight, parts.down.weight)  # K of the products: x's, the attention's, up's
    return (
        hd % 32 == 0
        and _fusable(parts.qkv, x, parts.norm1)
        and _fusable(parts.up, x, parts.norm2)
        and all(isinstance(p, Linear) and p.weight.dtype == x.dtype for p in (parts.out, parts.down))
        and all(a.shape[-1] % (32 * 16 // x.dtype.size) == 0 for a in widths)
    )


# The layer kernel's phases, each run by whichever blocks claim its items (``claimed``: thread 0 takes the next
# item for its block) and ended by a wait until every item is done, so that each phase reads only what the
# previous one finished. A block waits only for items that blocks already running have claimed, so the kernel
# cannot deadlock however many of its blocks the GPU holds at once (a software barrier over all blocks would, if
# some of them could not start: MLX launches no cooperative kernels). The last block out sets the counters back
# to zero for the next layer's kernel (kernels on one stream run in order); every step starts from zeros
# (``BufferState.per_layer``). A block that finds no item left reports the count of the items it did.
_PHASE = """
    {  // %(name)s
        %(setup)s
        const int ITEMS = %(items)s;
        int done = 0;
        if (threadIdx.x == 0) claimed = atomicAdd(counters + %(claim)d, 1);
        __syncthreads();
        int item = claimed;
        __syncthreads();
        while (item < ITEMS) {
            int next = 0;  // the next claim is in flight while this item runs
            if (threadIdx.x == 0) next = atomicAdd(counters + %(claim)d, 1);
            %(body)s
            ++done;
            if (threadIdx.x == 0) claimed = next;
            __syncthreads();
            item = claimed;
            __syncthreads();
        }
        %(wait)s
    }
"""
_WAIT = """
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(counters + %(done)d, done);
            while (*reinterpret_cast<volatile int*>(counters + %(done)d) < ITEMS) {}
            __threadfence();
        }
        __syncthreads();
"""
_GEMV_ITEM = """
            int unit = item * WARPS + warp;
            if (unit < UNITS) {
"""
_BLOCK = """
    constexpr int V = 16 / sizeof(T), LINE = %(line)d, PHASES = %(phases_count)d;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int* counters = const_cast<int*>(sync);
    __shared__ int claimed;
    unsigned sms;
    asm("mov.u32 %%0, %%%%nsmid;" : "=r"(sms));
    const int working = min((int)gridDim.x, (int)sms);
    // The attention's keys of each (row, head) in as many chunks as fill the working blocks once, up to MAX_SPLIT.
    const int SPLIT = max(1, min(MAX_SPLIT, working / (M * H)));
    if (blockIdx.x < working) {
        %(phases)s
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(counters + (2 * PHASES - 1) * LINE, 1) == gridDim.x - 1) {
            for (int i = 0; i < 2 * PHASES; ++i) atomicExch(counters + i * LINE, 0);
        }
    }
"""
_BLOCK_LOADS = """
#define LOAD_X(p) __ldcg(reinterpret_cast<const uint4*>(p))
#define LOAD(p) __ldcg(p)
"""
# The attention phase splits each (row, head)'s keys into SPLIT chunks, one a block, so that a lone stream's few
# (row, head) pairs keep many blocks busy; each chunk's max, sum and unnormalised sums go to the fp32 partials,
# (SPLIT, 2 + D) per (row, head), and the next phase merges them as a block merges its warps'.
_CHUNK_RANGE = """int stop;
    {
        int n = last - first + 1, size = (n + SPLIT - 1) / SPLIT;
        first += chunk * size;
        stop = min(last, first + size - 1);
    }"""
_CHUNK_STORE = """float* part = partials + ((size_t)bh * SPLIT + chunk) * (2 + D);
        if (lane == 0) {
            part[0] = m_all;
            part[1] = l_all;
        }
        #pragma unroll
        for (int i = 0; i < PER; ++i) part[2 + lane * PER + i] = o[i];"""
_MERGE_CHUNKS = """
            if (warp == 0) {
                const float* part = partials + (size_t)bh * SPLIT * (2 + D);
                float m_all = -INFINITY;
                for (int c = 0; c < SPLIT; ++c) m_all = fmaxf(m_all, LOAD(part + c * (2 + D)));
                float l_all = 0.f, o[PER];
                #pragma unroll
                for (int i = 0; i < PER; ++i) o[i] = 0.f;
                for (int c = 0; c < SPLIT; ++c) {
                    float l = LOAD(part + c * (2 + D) + 1);
                    float scale = l > 0.f ? expf(LOAD(part + c * (2 + D)) - m_all) : 0.f;  // an empty chunk: none
                    l_all += l * scale;
                    #pragma unroll
                    for (int i = 0; i < PER; ++i) o[i] += LOAD(part + c * (2 + D) + 2 + lane * PER + i) * scale;
                }
                #pragma unroll
                for (int i = 0; i < PER; ++i) out[(size_t)bh * D + lane * PER + i] = static_cast<T>(o[i] / l_all);
            }
"""
_layer_kernels: dict[tuple, object] = {}


def _gemv_phase(index: int, name: str, setup: str, kind: str, epilogue: str, pair: bool) -> str:
    """A phase of ``_GEMV_UNIT``s, 16 output columns (or column pairs) an item; every phase but the last waits."""
    body = (
        _GEMV_ITEM
        + _GEMV_UNIT
        % dict(
            columns=_HEADS_COLUMNS if index == 0 else _ROWS_COLUMNS, epilogue=epilogue, **_norm_fields(kind)
        )
        + "\n            }"
    )
    setup += f"\n        constexpr bool PAIR = {'true' if pair else 'false'};"
    return _PHASE % dict(
        name=name,
        setup=setup,
        items="(UNITS + WARPS - 1) / WARPS",
        claim=_SYNC_LINE * index,
        body=body,
        wait=_WAIT % dict(done=_SYNC_LINE * (_PHASES + index)) if index < _PHASES - 1 else "",
    )


# The scratch output's regions, M rows each: q, the attention's output, h (the layer's input plus attention), and
# the up projection's activation.
_REGIONS = dict(
    q="scratch",
    attention="scratch + M * H * HD",
    h="scratch + 2 * M * H * HD",
    up="scratch + 2 * M * H * HD + M * DIM",
)


def _layer_source(
    kinds: tuple[str, str],
    biases: tuple[bool, ...],
    act: str,
    rope: bool,
    has_pad: bool,
    eps: tuple[str, str],
) -> str:
    """The layer kernel's body: ``_GEMV_UNIT`` and ``_ATTENTION_ITEM`` in six phases (q/k/v, attention by
    chunks of keys, their merge, output projection, up projection, down projection) over the scratch output
    (``_REGIONS``) and the attention's fp32 partials. eps: each norm's ``_eps_source``."""

    def setup(x: str, w: str, out: str, k: str, units: str, has_bias: bool, norm: int = 0) -> str:
        """The names a phase's ``_GEMV_UNIT`` reads: x, w, out, bias, the norm's parameters, K and UNITS."""
        text = (
            f"const T* x = {x}; const T* w = {w}_w; T* out = {out}; constexpr int K = {k}, UNITS = {units};"
        )
        text += f" const T* bias = {w}_b;" if has_bias else ""
        if norm:
            text += f" const T* norm_w = norm{norm}_w; {eps[norm - 1]}"
            text += f" const T* norm_b = norm{norm}_b;" if kinds[norm - 1] == "layer" else ""
        return text

    def rows_epilogue(has_bias: bool, act: str, residual: str | None) -> str:
        return _ROWS_EPILOGUE % dict(
            bias="y += static_cast<float>(bias[n0]);" if has_bias else "",
            act=_ACT_CODE[act],
            residual=(
                f"const T* residual = {residual}; y += static_cast<float>(LOAD(residual + m * UNITS + n0));"
                if residual
                else ""
            ),
        )

    bias_qkv, bias_out, bias_up, bias_down = biases
    heads_epilogue = _HEADS_EPILOGUE % dict(
        bias0="+ static_cast<float>(bias[n0])" if bias_qkv else "",
        bias1="+ static_cast<float>(bias[n1])" if bias_qkv else "",
        rope="" if not rope else _ROPE % dict(position="position[0] - pad[m]" if has_pad else "position[0]"),
        store=_STORE_CACHE,
    )
    r = _REGIONS
    phases = [
        _gemv_phase(
            0,
            "q, k, v: q to the scratch, k and v into the cache",
            setup("layer_x", "qkv", r["q"], "DIM", "3 * H * HD / 2", bias_qkv, norm=1) + " T* q = out;",
            kinds[0],
            heads_epilogue,
            True,
        ),
        _PHASE
        % dict(
            name="attention: a (row, head, chunk of its keys) an item, its softmax's max, sum and sums to partials",
            setup="constexpr int D = HD, PER = D / 32; const T* q = scratch; const int* at = position;",
            items="M * H * SPLIT",
            claim=_SYNC_LINE,
            body="int bh = item / SPLIT, chunk = item % SPLIT;\n"
            + _ATTENTION_ITEM
            % dict(
                window="",
                key_row="kb + (size_t)j * D",
                value_row="vb + (size_t)j * D",
                first="pad[bh / H]" if has_pad else "0",
                range=_CHUNK_RANGE,
                store=_CHUNK_STORE,
            ),
            wait=_WAIT % dict(done=_SYNC_LINE * (_PHASES + 1)),
        ),
        _PHASE
        % dict(
            name="attention: a (row, head) an item, its chunks merged",
            setup=f"constexpr int D = HD, PER = D / 32; T* out = {r['attention']};",
            items="M * H",
            claim=_SYNC_LINE * 2,
            body="int bh = item;\n" + _MERGE_CHUNKS,
            wait=_WAIT % dict(done=_SYNC_LINE * (_PHASES + 2)),
        ),
        _gemv_phase(
            3,
            "the output projection and the residual: h",
            setup(r["attention"], "out", r["h"], "H * HD", "DIM", bias_out),
            "none",
            rows_epilogue(bias_out, "none", "layer_x"),
            False,
        ),
        _gemv_phase(
            4,
            "norm, up projection, activation",
            setup(r["h"], "up", r["up"], "DIM", "FW", bias_up, norm=2),
            kinds[1],
            rows_epilogue(bias_up, act, None),
            act == "swiglu",
        ),
        _gemv_phase(
            5,
            "the down projection and the residual: the layer's output",
            setup(r["up"], "down", "layer_out", "FW", "DIM", bias_down),
            "none",
            rows_epilogue(bias_down, "none", r["h"]),
            False,
        ),
    ]
    return _BLOCK % dict(phases="".join(phases), line=_SYNC_LINE, phases_count=_PHASES)


@cache
def _sm_count() -> int:
    """The GPU's streaming multiprocessors, read once by a one-thread kernel (MLX's device_info has no such
    field)."""
    kernel = cuda_kernel(
        "sm_count", ["unused"], ["out"], 'unsigned n; asm("mov.u32 %0, %%nsmid;" : "=r"(n)); out[0] = n;'
    )
    (count,) = kernel(
        inputs=[mx.zeros((1,), mx.int32)],
        grid=(1, 1, 1),
        threadgroup=(1, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
    )
    return count.item()


def _fused_layer(x: mx.array, state: BufferState, parts: LayerParts) -> tuple[mx.array, BufferState]:
    """``decode_layer`` as one kernel: the phases of ``_layer_source``, with the keys and values written into
    ``state``'s buffers in place (as ``heads`` with ``KV_IN_PLACE``) and returned through ``mx.depends`` on the
    layer's output."""
    kinds = (_norm_kind(parts.norm1), _norm_kind(parts.norm2))
    linears = (parts.qkv, parts.out, parts.up, parts.down)
    biases = tuple("bias" in layer for layer in linears)
    rope, has_pad = parts.rope_periods is not None, state.pad is not None
    eps = (_eps_source(parts.norm1, "norm1_eps"), _eps_source(parts.norm2, "norm2_eps"))
    key = (kinds, biases, parts.act, rope, has_pad, eps)
    names = ["layer_x", "sync", "position"] + (["pad"] if has_pad else []) + (["periods"] if rope else [])
    names += ["keys", "values"]
    inputs = [x, state.sync, state.position.reshape(1)] + ([state.pad] if has_pad else [])
    inputs += [parts.rope_periods.astype(mx.float32)] if rope else []
    inputs += [state.keys, state.values]
    for i, (layer, norm) in enumerate(zip(linears, (parts.norm1, None, parts.norm2, None))):
        label = ("qkv", "out", "up", "down")[i]
        if norm is not None:
            n = 1 if i == 0 else 2
            names += [f"norm{n}_w"] + ([f"norm{n}_b"] if _norm_kind(norm) == "layer" else [])
            inputs += [norm.weight] + ([norm.bias] if _norm_kind(norm) == "layer" else [])
            if not DEVICE_SCALARS:
                names.append(f"norm{n}_eps")
                inputs.append(mx.array([norm.eps], dtype=mx.float32))
        names += [f"{label}_w"] + ([f"{label}_b"] if "bias" in layer else [])
        inputs += [layer.weight] + ([layer.bias] if "bias" in layer else [])
    if key not in _layer_kernels:
        name = "_".join(["decode_layer", *kinds, parts.act] + ["rope"] * rope + ["pad"] * has_pad)
        _layer_kernels[key] = cuda_kernel(
            name, names, ["layer_out", "scratch", "partials"], _layer_source(*key), header=_BLOCK_LOADS
        )
    m, d = x.size // x.shape[-1], x.shape[-1]
    h, hd = parts.num_heads, parts.qkv.weight.shape[0] // (3 * parts.num_heads)
    fw = parts.up.weight.shape[0] // (2 if parts.act == "swiglu" else 1)
    out, *_ = _layer_kernels[key](
        inputs=inputs,
        template=[
            ("T", x.dtype), ("M", m), ("DIM", d), ("H", h), ("HD", hd), ("FW", fw),
            ("WARPS", _LAYER_WARPS), ("UNROLL", DECODE_UNROLL), ("MAX_SPLIT", _MAX_SPLIT),
        ],  # fmt: skip
        grid=((LAYER_BLOCKS or _sm_count()) * 32 * _LAYER_WARPS, 1, 1),
        threadgroup=(32 * _LAYER_WARPS, 1, 1),
        output_shapes=[x.shape, (m * (2 * h * hd + d + fw),), (m * h * _MAX_SPLIT * (2 + hd),)],
        output_dtypes=[x.dtype, x.dtype, mx.float32],
    )
    keys, values = mx.depends([state.keys, state.values], [out])
    return out, state._replace(keys=keys, values=values)
