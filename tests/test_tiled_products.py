"""models/cfm.py's tiled products: the estimator's products as our tensor-core kernel on CUDA (off by default
until these GPU tests have run on one). What it takes is checked on any device; the kernel itself only where
CUDA is (run with pytest on the H200), since CI has no GPU.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from scipy.special import erf

from mlx_chatterbox.models import cfm, layers
from tests import compiled_cuda

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend (an NVIDIA GPU)")

# The estimator's products at full size, (N, K) with what each takes (LayerNorm before; bias, GELU, sum after):
# q/k/v, the output projection, the feed-forward's two, the resnets' 1x1 convolutions (the first one's input
# is x, mu, spks and cond: 320 channels), and everything at once. A kernel is built for each set (NVRTC, about a
# second).
PRODUCTS = [
    ((1536, 256), (True, False, False, False)),
    ((256, 512), (False, True, False, True)),
    ((1024, 256), (True, True, True, False)),
    ((256, 1024), (False, True, False, True)),
    ((256, 320), (False, False, False, True)),
    ((256, 256), (True, True, True, True)),
]


# The tile widths of the GPU tests: 64 columns everywhere; ``TILED_WIDE_NORMED`` as shipped (128 columns and 8
# warps for a norm of x, where blocks are enough).
COLUMNS = ["64", "wide"]


def use_columns(monkeypatch, columns: str) -> None:
    monkeypatch.setattr(cfm, "TILED_WIDE_NORMED", columns == "wide")


def check_launched_columns(columns: str) -> None:
    """Every launch since ``_tiled_launches`` was emptied had the tile width ``columns`` asks for: 128 for the
    products with a norm of x onto a multiple of 128 channels (wide), 64 for the rest."""
    for signature, (_, options) in cfm._tiled_launches.items():
        wide = signature[6] is not None and signature[2][0] % 128 == 0
        want = 128 if columns == "wide" and wide else 64
        assert dict(options["template"])["BN"] == want, (signature, columns)


def operands(seed: int, m: int, n: int, k: int, dtype: mx.Dtype) -> tuple[mx.array, ...]:
    """x (m, k) off zero mean and unit scale, weight (n, k) scaled as a layer's, bias (n,), add (m, n)."""
    rng = np.random.default_rng(seed)
    x, w, bias, add = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (n, k), (n,), (m, n)))
    return tuple(mx.array(a).astype(dtype) for a in (3 * x + 1, w / np.sqrt(k), bias, add))


def layer_norm(k: int, seed: int, dtype: mx.Dtype) -> nn.LayerNorm:
    """An affine LayerNorm with random weight (1 + 0.1·N) and bias (0.1·N)."""
    norm = nn.LayerNorm(k, eps=1e-5)
    rng = np.random.default_rng(seed)
    norm.update(
        {"weight": mx.array(1 + 0.1 * rng.standard_normal(k)), "bias": mx.array(0.1 * rng.standard_normal(k))}
    )
    norm.set_dtype(dtype)
    return norm


@pytest.mark.parametrize(
    "x_shape, w_shape, dtype, on_gpu, fits",
    [
        ((64, 256), (512, 256), mx.bfloat16, True, True),
        ((2000, 1024), (256, 1024), mx.float16, True, True),
        ((64, 256), (512, 256), mx.bfloat16, False, False),  # on the CPU: MLX's ops
        ((64, 256), (512, 256), mx.float32, True, False),  # float32: TF32 on tensor cores
        ((63, 256), (512, 256), mx.bfloat16, True, False),  # a few rows: cuBLAS or a matrix-vector product
        ((2049, 256), (512, 256), mx.bfloat16, True, False),  # many: the GPU bounds them (a batch)
        ((2, 1025, 256), (256, 3, 256), mx.bfloat16, True, False),  # the same as frames
        ((64, 256), (80, 256), mx.bfloat16, True, False),  # N not a multiple of the tile's 64 (final_proj)
        ((64, 80), (256, 80), mx.bfloat16, True, False),  # K not a multiple of 64
        ((64, 96), (256, 96), mx.bfloat16, True, False),  # nor here (a multiple of 32)
        ((2, 32, 256), (512, 256), mx.bfloat16, True, False),  # a product's rows as 2-D only
        ((2, 530, 320), (256, 3, 320), mx.bfloat16, True, True),  # a causal convolution (the first resnet's)
        ((1, 63, 256), (256, 3, 256), mx.bfloat16, True, False),  # a few frames
        ((2, 530, 84), (256, 3, 84), mx.bfloat16, True, False),  # K = 252, not a multiple of 64
        ((2, 530, 4), (256, 16, 4), mx.bfloat16, True, False),  # channels not a multiple of 8 (K = 64)
        ((2, 530, 256), (80, 3, 256), mx.bfloat16, True, False),  # N not a multiple of 64
        ((1060, 256), (256, 3, 256), mx.bfloat16, True, False),  # a convolution's x as (B, T, C) only
    ],
)
def test_the_tiled_product_takes_only_what_its_kernel_computes(
    monkeypatch, x_shape, w_shape, dtype, on_gpu, fits
):
    monkeypatch.setattr(cfm, "TILED_PRODUCTS", True)
    monkeypatch.setattr(layers, "_use_cuda_paths", lambda: on_gpu)
    x, w = mx.zeros(x_shape, dtype), mx.zeros(w_shape, dtype)
    assert cfm.tiled_fits(x, w) is fits
    monkeypatch.setattr(cfm, "TILED_PRODUCTS", False)
    assert not cfm.tiled_fits(x, w)  # off: MLX's ops everywhere


@pytest.mark.parametrize(
    "x_shape, w_shape, options, message",
    [
        ((64, 256), (256, 256), dict(add=(64, 128)), "add has shape"),
        ((64, 256), (256, 256), dict(norm_mish=True), "follow a norm"),
        ((2, 40, 256), (256, 3, 256), dict(shift=(256, 2)), "follow a norm"),
        ((2, 40, 256), (256, 3, 256), dict(norm=256, shift=(2, 256)), "shift"),
        ((80, 256), (256, 256), dict(norm=256, shift=(256, 80)), "shift"),  # a product has no sequences
        ((64, 256), (256, 256), dict(add_norm=256), "add_norm takes add"),
        ((2, 40, 256), (256, 3, 256), dict(mask=(2, 40)), "mask has shape"),
    ],
)
def test_the_tiled_product_refuses_what_its_kernel_does_not_take(x_shape, w_shape, options, message):
    """Checked before any kernel is built (so on any device)."""
    dtype = mx.bfloat16
    x, w = mx.zeros(x_shape, dtype), mx.zeros(w_shape, dtype)
    args = {
        k: (v if isinstance(v, bool) else mx.zeros(v, dtype)) for k, v in options.items() if "norm" not in k
    }
    args.update({k: layer_norm(v, 0, dtype) for k, v in options.items() if k in ("norm", "add_norm")})
    args.update(norm_mish=options.get("norm_mish", False))
    with pytest.raises(ValueError, match=message):
        cfm.tiled_product(x, w, **args)


def test_the_linear_of_the_estimator_is_its_ops_in_order_without_the_kernel():
    """Where the kernel does not run, ``cfm.linear`` is the layer, then GELU, then the sum, bit for bit."""
    x, w, bias, add = operands(0, 40, 64, 32, mx.float32)
    layer = cfm.Linear(32, 64)
    layer.update({"weight": w, "bias": bias})
    assert np.array_equal(cfm.linear(layer, x), layer(x))
    assert np.array_equal(cfm.linear(layer, x, add=add), layer(x) + add)
    assert np.array_equal(cfm.linear(layer, x, gelu=True), layers.gelu_linear(x, layer.weight_t(), bias))
    norm = layer_norm(32, 1, mx.float32)
    assert np.array_equal(cfm.linear(layer, x, gelu=True, norm=norm), cfm.linear(layer, norm(x), gelu=True))


def f64(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32), np.float64)


def normed(x: mx.array, norm: nn.LayerNorm) -> np.ndarray:
    """LayerNorm in float64 on the rounded operands."""
    x = f64(x)
    y = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + norm.eps)
    return y * f64(norm.weight) + f64(norm.bias)


def reference(x, w, bias, gelu, add) -> np.ndarray:
    """The epilogue's math in float64 on the rounded operands (x an array, or already float64)."""
    y = (x if isinstance(x, np.ndarray) else f64(x)) @ f64(w).T
    y = y if bias is None else y + np.asarray(bias.astype(mx.float32), np.float64)
    y = 0.5 * y * (1 + erf(y / np.sqrt(2))) if gelu else y
    return y if add is None else y + np.asarray(add.astype(mx.float32), np.float64)


def check_products(dtype: mx.Dtype, m: int) -> None:
    """The estimator's products with what each takes, at m rows: within one rounding to the output dtype
    (2^-8 of bf16, 2^-11 of fp16, relative) of float64's result, plus the float accumulators' order (1e-5 of the
    largest); with a LayerNorm, whose output the kernel rounds to the dtype as MLX's does, plus that rounding's
    reach: 2^-8 (2^-11) of sum_k |norm(x)_k w_k|, with GELU's slope (at most 1.13)."""
    ulp = 2.0**-8 if dtype == mx.bfloat16 else 2.0**-11
    for (n, k), (with_norm, with_bias, gelu, with_add) in PRODUCTS:
        x, w, bias, add = operands(n + k + m, m, n, k, dtype)
        assert cfm.tiled_fits(x, w)
        norm = layer_norm(k, n + m, dtype) if with_norm else None
        bias, add = (bias if with_bias else None), (add if with_add else None)
        out = cfm.tiled_product(x, w, bias, gelu=gelu, add=add, norm=norm)
        got = np.asarray(out.astype(mx.float32), np.float64)
        xn = normed(x, norm) if with_norm else f64(x)
        want = reference(xn, w, bias, gelu, add)
        assert got.shape == (m, n)
        err = np.abs(got - want)
        if with_norm:
            err -= 1.13 * ulp * (np.abs(xn) @ np.abs(f64(w)).T)
        bound = ulp * np.abs(want) + 1e-5 * np.abs(want).max()
        assert (err <= bound).all(), (n, k, with_norm, with_bias, gelu, with_add)


def check_convolutions(dtype: mx.Dtype, b: int, t: int) -> None:
    """The estimator's causal k=3 convolutions (320, 256 and 512 channels in, 256 out) of b sequences of t
    frames, with the bias, against float64's convolution of the zero-padded input: within one rounding to the
    output dtype, plus the float accumulators' order."""
    ulp = 2.0**-8 if dtype == mx.bfloat16 else 2.0**-11
    rng = np.random.default_rng(b * t)
    for c in (320, 256, 512):
        x = mx.array(rng.standard_normal((b, t, c)).astype(np.float32)).astype(dtype)
        w = mx.array((rng.standard_normal((256, 3, c)) / np.sqrt(3 * c)).astype(np.float32)).astype(dtype)
        bias = mx.array(rng.standard_normal(256).astype(np.float32)).astype(dtype)
        assert cfm.tiled_fits(x, w)
        got = np.asarray(cfm.tiled_product(x, w, bias).astype(mx.float32), np.float64)
        xp = np.pad(f64(x), [(0, 0), (2, 0), (0, 0)])
        want = sum(xp[:, j : j + t] @ f64(w)[:, j].T for j in range(3)) + f64(bias)
        err = np.abs(got - want)
        assert got.shape == (b, t, 256) and (err <= ulp * np.abs(want) + 1e-5 * np.abs(want).max()).all(), c


def mish(y: np.ndarray) -> np.ndarray:
    return y * np.tanh(np.logaddexp(y, 0.0))


def check_resnet(dtype: mx.Dtype, b: int, t: int, padded: int) -> None:
    """A resnet's two products with its blocks' LayerNorms and Mish inside (256 channels; the last request
    ``padded`` frames shorter, masked, when not 0), against float64 from the rounded operands (the norms'
    outputs not rounded: the kernel's float statistics and float64's may round a value either way):

    - the second k=3 convolution, reading Mish(LayerNorm(x)) plus the time embedding of each frame's sequence,
      masked frames as zeros: within the product's bound (one rounding of the output, the accumulators' order)
      plus what the two roundings of its input reach (the norm's output as MLX rounds it, through Mish's slope
      of at most 1.1, and the input's own), through the weight's magnitudes;
    - the 1x1 convolution (masked frames read as zeros) plus its bias and Mish(LayerNorm(add)) where the frame
      is not masked: within the output's rounding and the accumulators' order, plus the norm's rounding through
      Mish's slope."""
    ulp = 2.0**-8 if dtype == mx.bfloat16 else 2.0**-11
    c, rng = 256, np.random.default_rng(b * t + padded)
    rand = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    x = mx.array(3 * rand(b, t, c) + 1).astype(dtype)
    w = mx.array(rand(c, 3, c) / np.sqrt(3 * c)).astype(dtype)
    bias, shift = mx.array(rand(c)).astype(dtype), mx.array(rand(c, b)).astype(dtype)
    norm1, norm2 = layer_norm(c, 1, dtype), layer_norm(c, 2, dtype)
    keep = (np.arange(t)[None] < t - padded * (np.arange(b)[:, None] == b - 1)).astype(np.float32)
    mask = mx.array(keep.reshape(-1)).astype(dtype) if padded else None
    assert cfm.tiled_fits(x, w)
    out = cfm.tiled_product(x, w, bias, norm=norm1, norm_mish=True, shift=shift, mask=mask)
    got = f64(out)
    ln = normed(x, norm1)
    xin = (mish(ln) + f64(shift).T[:, None, :]) * keep[..., None]
    reach = ulp * (1.1 * np.abs(ln) + np.abs(xin)) * keep[..., None]
    pad = [(0, 0), (2, 0), (0, 0)]
    xp, rp, wf = np.pad(xin, pad), np.pad(reach, pad), f64(w)
    want = sum(xp[:, j : j + t] @ wf[:, j].T for j in range(3)) + f64(bias)
    spread = sum(rp[:, j : j + t] @ np.abs(wf[:, j]).T for j in range(3))
    err = np.abs(got - want) - spread
    assert got.shape == (b, t, c) and (err <= ulp * np.abs(want) + 1e-5 * np.abs(want).max()).all()

    rows, w1 = mx.array(rand(b * t, c)).astype(dtype), mx.array(rand(c, c) / np.sqrt(c)).astype(dtype)
    add = out.reshape(b * t, c)
    got = f64(cfm.tiled_product(rows, w1, bias, add=add, add_norm=norm2, mask=mask))
    ln = normed(add, norm2)
    kept = keep.reshape(-1, 1)
    want = (f64(rows) * kept) @ f64(w1).T + f64(bias) + mish(ln) * kept
    err = np.abs(got - want) - 1.1 * ulp * np.abs(ln) * kept
    assert (err <= ulp * np.abs(want) + 1e-5 * np.abs(want).max()).all()


@cuda
@pytest.mark.parametrize("columns", COLUMNS)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("m", [64, 65, 127, 1060, 2000])
def test_the_tiled_product_is_the_product_rounded_once(monkeypatch, dtype, m, columns):
    """``check_products`` on the GPU, at row counts past a tile's edge (tiles of 32 and 64 rows)."""
    monkeypatch.setattr(cfm, "TILED_PRODUCTS", True)
    use_columns(monkeypatch, columns)
    check_products(dtype, m)


@cuda
@pytest.mark.parametrize("columns", COLUMNS)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("b, t", [(1, 64), (2, 530), (3, 37)])
def test_the_tiled_causal_convolution_is_the_convolution_rounded_once(monkeypatch, dtype, b, t, columns):
    """``check_convolutions`` on the GPU (the sequences cross the kernel's tiles)."""
    monkeypatch.setattr(cfm, "TILED_PRODUCTS", True)
    use_columns(monkeypatch, columns)
    check_convolutions(dtype, b, t)


@cuda
@pytest.mark.parametrize("columns", COLUMNS)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("b, t, padded", [(1, 64, 0), (2, 530, 0), (2, 530, 130), (3, 37, 5)])
def test_the_resnet_products_take_its_norms_and_mish(monkeypatch, dtype, b, t, padded, columns):
    """``check_resnet`` on the GPU: sequences across tiles, masked frames."""
    monkeypatch.setattr(cfm, "TILED_PRODUCTS", True)
    use_columns(monkeypatch, columns)
    check_resnet(dtype, b, t, padded)


@pytest.mark.parametrize("sm_count, columns", [(132, "64"), (1, "64"), (1, "wide")])
def test_the_kernel_source_computes_the_products_on_the_cpu(emulated, monkeypatch, sm_count, columns):
    """The kernel's source run on the CPU (tests/emulated_cuda.py: each thread a std::thread, the warp's
    mma.sync traded as the PTX ISA lays out its fragments), bf16, through the same checks as on the GPU: the
    products at 64 and 127 rows, the convolutions of 1 x 64 and 3 x 37 frames; with an H200's 132 SMs (tiles
    of 32 rows here) and with one (tiles of 64, but for a norm of x); with ``TILED_WIDE_NORMED`` (one SM: blocks
    enough), 128 columns and 8 warps for a norm of x. What a GPU alone can say (its compiler, timing, memory
    model) is for the tests above; this one found a lane index shadowed by the loop's in an earlier version."""
    monkeypatch.setattr(layers, "_sm_count", lambda: sm_count)
    monkeypatch.setattr(cfm, "TILED_PRODUCTS", True)
    use_columns(monkeypatch, columns)
    monkeypatch.setattr(cfm, "_tiled_launches", {})
    for m in (64, 127):
        check_products(mx.bfloat16, m)
    for b, t in ((1, 64), (3, 37)):
        check_convolutions(mx.bfloat16, b, t)
    for b, t, padded in ((1, 64, 0), (3, 37, 5)):
        check_resnet(mx.bfloat16, b, t, padded)
    check_launched_columns(columns)


# The smallest estimator whose every product and convolution the kernel takes (channels, widths and the
# q/k/v width multiples of 64): its calls on the CPU through the kernel's source take seconds.
SMALL = cfm.CFMConfig(
    in_channels=64, out_channels=16, channels=64, n_blocks=1, num_mid_blocks=2, num_heads=2, head_dim=32
)


def check_estimator(cfg: cfm.CFMConfig, frames: int, padded: int, monkeypatch) -> None:
    """One bf16 estimator call (2 rows of ``frames`` frames; the second request ``padded`` frames shorter,
    masked, when not 0) against the same call in float32: the kernel's rounding (once per product and
    epilogue) is no farther from it than MLX's ops in bf16 (which round after each op), within 10%."""
    mx.random.seed(0)  # the weights MLX draws
    est = cfm.Estimator(cfg)
    mx.eval(est.parameters())
    rng = np.random.default_rng(0)
    mel = cfg.out_channels
    x, mu, cond = (mx.array(rng.standard_normal((2, frames, mel)).astype(np.float32)) for _ in range(3))
    spks, t = mx.array(rng.standard_normal((2, mel)).astype(np.float32)), mx.array([0.3, 0.3])
    lengths = np.array([[frames], [frames - padded]])
    mask = mx.array(np.arange(frames)[None] < lengths) if padded else None

    def call(dtype: mx.Dtype) -> np.ndarray:
        y = est(x.astype(dtype), mask, mu.astype(dtype), t, spks.astype(dtype), cond.astype(dtype))
        return np.asarray(y.astype(mx.float32), np.float64)

    want = call(mx.float32)
    est.set_dtype(mx.bfloat16)
    composed = call(mx.bfloat16)
    monkeypatch.setattr(cfm, "TILED_PRODUCTS", True)
    monkeypatch.setattr(cfm, "_tiled_kernels", {})
    monkeypatch.setattr(cfm, "_tiled_launches", {})
    tiled = call(mx.bfloat16)
    # The kernel ran: q/k/v; with a bias and a sum; a bias and GELU; a bias (the k=3 convolutions); the resnets'
    # second convolution with norm, Mish and the time embedding, and their 1x1 with the norm and Mish of its sum;
    # padded, the resnets' first convolution reads the mask (the others read masked inputs).
    assert len(cfm._tiled_kernels) == 6 + bool(padded)
    if padded:
        assert not tiled[1, frames - padded :].any()  # the estimator zeroes padded frames

    def distance(y: np.ndarray) -> float:
        return float(np.linalg.norm(y - want) / np.linalg.norm(want))

    assert distance(tiled) <= 1.1 * distance(composed), (distance(tiled), distance(composed))


@pytest.mark.parametrize("padded, columns", [(0, "64"), (13, "64"), (13, "wide")])
def test_the_estimator_with_the_kernel_source_on_the_cpu(emulated, monkeypatch, padded, columns):
    """``check_estimator`` of a small estimator (every call site of the kernel: q/k/v with norm1, the output
    projection and the feed-forward's with their sums, norm3 and GELU, the resnets' convolutions with their
    norms, Mish, time embedding and mask), the kernel's source run on the CPU, plain and as a padded batch
    (tiled 1.31e-2 and 1.27e-2 from fp32, MLX's bf16 ops 1.27e-2 and 1.41e-2, when written); padded, with 128
    columns for the norms of x too (``TILED_WIDE_NORMED``, one SM)."""
    if columns == "wide":
        monkeypatch.setattr(layers, "_sm_count", lambda: 1)
    use_columns(monkeypatch, columns)
    check_estimator(SMALL, 40, padded, monkeypatch)
    check_launched_columns(columns)


@cuda
@pytest.mark.parametrize("columns", COLUMNS)
@pytest.mark.parametrize("padded", [0, 130])
def test_the_estimator_with_the_kernel_is_as_near_float32_as_without(monkeypatch, padded, columns):
    """``check_estimator`` at full size on the GPU: 2 rows of 530 frames, a stream's first decode after a 10 s
    prompt, plain and as a padded batch."""
    use_columns(monkeypatch, columns)
    check_estimator(cfm.CFMConfig(), 530, padded, monkeypatch)


def record_launches(monkeypatch) -> list[dict]:
    """``tiled_product``'s launches on an H200's 132 SMs without a GPU: each call's options go into the list
    returned, and its output is zeros."""
    launched: list[dict] = []

    def kernel(name, inputs, outputs, source, header="", **options):
        return lambda **call: launched.append(call) or [
            mx.zeros(call["output_shapes"][0], call["output_dtypes"][0])
        ]

    monkeypatch.setattr(mx.fast, "cuda_kernel", kernel, raising=False)
    monkeypatch.setattr(layers, "_sm_count", lambda: 132)
    monkeypatch.setattr(cfm, "_tiled_kernels", {})
    monkeypatch.setattr(cfm, "_tiled_launches", {})
    return launched


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("tile_rows, want", [(None, 64), (32, 32), (64, 64), (48, None)])
def test_the_tile_rows_follow_the_rule_unless_set(monkeypatch, tile_rows, want, normed):
    """``TILED_TILE_ROWS`` (the benchmarks' "ours-tiles-32") sets a tile's rows; None leaves them to the rule:
    64 for a plain product here (2,000 rows x 1,536 columns make 768 blocks of 64, over two an SM of 132), 32
    for one with a norm of x (its registers); others are refused."""
    launched = record_launches(monkeypatch)
    monkeypatch.setattr(cfm, "TILED_TILE_ROWS", tile_rows)
    x, w = mx.zeros((2000, 256), mx.bfloat16), mx.zeros((1536, 256), mx.bfloat16)
    norm = layer_norm(256, 0, mx.bfloat16) if normed else None
    if want is None:
        with pytest.raises(ValueError, match="TILED_TILE_ROWS = 48"):
            cfm.tiled_product(x, w, norm=norm)
        return
    want = 32 if normed and tile_rows is None else want
    cfm.tiled_product(x, w, norm=norm)
    (launch,) = launched
    assert dict(launch["template"])["BM"] == want and launch["grid"][1] == -(-2000 // want)


@pytest.mark.parametrize("wide", [False, True])
def test_wide_tiles_only_for_a_norm_of_x_with_blocks_enough(monkeypatch, wide):
    """``TILED_WIDE_NORMED`` (off: the benchmarks' "ours-narrow-normed"): q/k/v with norm1 at 2,000 rows in
    tiles of 32 x 128 and 8 warps (12 x 63 blocks for 132 SMs); not at 100 rows (12 x 4 blocks), nor without a
    norm."""
    launched = record_launches(monkeypatch)
    monkeypatch.setattr(cfm, "TILED_WIDE_NORMED", wide)
    w, norm = mx.zeros((1536, 256), mx.bfloat16), layer_norm(256, 0, mx.bfloat16)
    for rows, with_norm in ((2000, True), (100, True), (2000, False)):
        cfm.tiled_product(mx.zeros((rows, 256), mx.bfloat16), w, norm=norm if with_norm else None)
    got = [
        (dict(c["template"])["BN"], dict(c["template"])["WN"], c["threadgroup"][0], c["grid"])
        for c in launched
    ]
    normed = (128, 4, 256, (12 * 256, 63, 1)) if wide else (64, 2, 128, (24 * 128, 63, 1))
    assert got == [normed, (64, 2, 128, (24 * 128, 4, 1)), (64, 2, 128, (24 * 128, 32, 1))]


@pytest.mark.skipif(compiled_cuda.NVCC is None, reason="needs nvcc (CUDA's toolkit; no GPU)")
@pytest.mark.parametrize("columns", COLUMNS)
def test_every_kernel_of_the_estimator_builds_for_hopper_without_spills(monkeypatch, columns):
    """Each kernel a full-size bf16 estimator launches (2 rows of 1,000 frames, plain and padded; 2 of 530, a
    stream's first decode), on an H200's 132 SMs, at each tile width, built by nvcc for sm_90a
    (tests/compiled_cuda.py): no spills and static shared memory within 48 KB. (Registers when written, a
    thread: shipped 120-140, the resnets' normed convolution the 140; wide 118-120.)"""
    programs = compiled_cuda.record(monkeypatch)
    monkeypatch.setattr(layers, "_use_cuda_paths", lambda: True)
    monkeypatch.setattr(layers, "_sm_count", lambda: 132)
    monkeypatch.setattr(cfm, "TILED_PRODUCTS", True)
    monkeypatch.setattr(cfm, "_tiled_kernels", {})
    monkeypatch.setattr(cfm, "_tiled_launches", {})
    use_columns(monkeypatch, columns)
    est = cfm.Estimator(cfm.CFMConfig())
    est.set_dtype(mx.bfloat16)
    mel = est.config.out_channels
    for frames, padded in ((1000, 0), (1000, 130), (530, 0)):
        x, mu, cond = (mx.zeros((2, frames, mel), mx.bfloat16) for _ in range(3))
        mask = mx.array(np.arange(frames)[None] < np.array([[frames], [frames - padded]])) if padded else None
        mx.eval(est(x, mask, mu, mx.array([0.3, 0.3]), mx.zeros((2, mel), mx.bfloat16), cond))
    tiled = [p for p in programs if p.name.startswith("tiled_product")]
    assert {dict(p.template)["BN"] for p in tiled} == {"64": {64}, "wide": {64, 128}}[columns]
    for program in tiled:
        used = compiled_cuda.resources(program)
        assert used.spill_bytes == 0 and used.shared_bytes <= compiled_cuda.STATIC_SHARED_LIMIT, (
            program,
            used,
        )
