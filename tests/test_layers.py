"""The shared conv layers: the matrix-product path (used on the CPU) equals MLX's own kernels."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_chatterbox.models import layers
from mlx_chatterbox.models.layers import Conv1d, ConvTranspose1d, conv1d, conv_transpose1d

# The last two: HiFT's first source_downs (kernel 2u, stride u, padding u // 2) and a dilated strided one.
CONV_CASES = [
    (1, 0, 1, 1),
    (3, 1, 1, 1),
    (4, 0, 1, 1),
    (7, 9, 3, 1),
    (11, 25, 5, 1),
    (1, 0, 1, 2),
    (6, 1, 1, 3),
]


@pytest.mark.parametrize("rows_per_channel", [0, 10**9], ids=["taps", "im2col"])
@pytest.mark.parametrize("k, padding, dilation, stride", CONV_CASES + [(30, 7, 1, 15), (5, 2, 2, 4)])
def test_conv1d_matches_mlx(k, padding, dilation, stride, rows_per_channel, monkeypatch):
    """Both of conv1d's ways (a sum of taps, an im2col), with and without the bias."""
    monkeypatch.setattr(layers, "_TAPS_ROWS_PER_CHANNEL", rows_per_channel)
    x = mx.random.normal((2, 47, 6), key=mx.random.key(k))
    w = mx.random.normal((5, k, 6), key=mx.random.key(k + 1))
    bias = mx.random.normal((5,), key=mx.random.key(k + 2))
    want = mx.conv1d(x, w, stride=stride, padding=padding, dilation=dilation)
    got = conv1d(x, w, padding, dilation, stride)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5)
    biased = conv1d(x, w, padding, dilation, stride, bias)
    np.testing.assert_allclose(np.array(biased), np.array(want + bias), atol=2e-5)


@pytest.mark.parametrize("rows_per_channel", [0, 10**9], ids=["taps", "im2col"])
@pytest.mark.parametrize("k, stride, padding", [(16, 8, 4), (11, 5, 3), (7, 3, 2), (4, 4, 0), (3, 5, 1)])
def test_conv_transpose1d_matches_mlx(k, stride, padding, rows_per_channel, monkeypatch):
    """Through either of conv1d's ways, with and without the bias."""
    monkeypatch.setattr(layers, "_TAPS_ROWS_PER_CHANNEL", rows_per_channel)
    x = mx.random.normal((2, 9, 6), key=mx.random.key(k))
    w = mx.random.normal((5, k, 6), key=mx.random.key(k + 1))
    bias = mx.random.normal((5,), key=mx.random.key(k + 2))
    want = mx.conv_transpose1d(x, w, stride=stride, padding=padding)
    got = conv_transpose1d(x, w, stride, padding)
    assert got.shape == want.shape == (2, (9 - 1) * stride - 2 * padding + k, 5)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5)
    biased = conv_transpose1d(x, w, stride, padding, bias)
    np.testing.assert_allclose(np.array(biased), np.array(want + bias), atol=2e-5)


@pytest.mark.parametrize("device", [mx.cpu, mx.gpu])
def test_layers_give_the_same_result_on_either_path(device):
    if not mx.is_available(device):
        pytest.skip(f"no MLX {device} here")
    conv, up = Conv1d(6, 4, 5, padding=4, dilation=2), ConvTranspose1d(6, 4, 11, 5, padding=3)
    no_bias, strided = Conv1d(6, 4, 3, bias=False), Conv1d(6, 4, 6, padding=1, stride=3)
    x = mx.random.normal((1, 17, 6))
    previous = mx.default_device()
    mx.set_default_device(device)
    try:
        for ours, native in (
            (conv, nn.Conv1d),
            (up, nn.ConvTranspose1d),
            (no_bias, nn.Conv1d),
            (strided, nn.Conv1d),
        ):
            np.testing.assert_allclose(np.array(ours(x)), np.array(native.__call__(ours, x)), atol=2e-5)
    finally:
        mx.set_default_device(previous)


@pytest.mark.parametrize("device", [mx.cpu, mx.gpu])
def test_mlx_convs_off_the_cpu(device, monkeypatch):
    """Off the CPU (a GPU, or the CPU backend taken for another device) the layers run MLX's convolutions where
    our kernel does not take them, with the numbers of our products on the CPU."""
    if not mx.is_available(device):
        pytest.skip(f"no MLX {device} here")
    if device == mx.gpu and mx.default_device() != mx.gpu:
        pytest.skip("the GPU is not MLX's default device here")
    calls = []
    for name in ("conv1d", "conv_transpose1d"):
        real = getattr(layers, name)
        monkeypatch.setattr(
            layers, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw)
        )
    if device == mx.cpu:
        monkeypatch.setattr(layers, "_on_cpu", lambda: False)
    conv, up = Conv1d(6, 4, 5, padding=4, dilation=2), ConvTranspose1d(6, 4, 11, 5, padding=3)
    x = mx.random.normal((1, 17, 6), key=mx.random.key(0))
    got = [conv(x), up(x), conv.padded(x, 2, 1)]
    assert calls == []
    monkeypatch.setattr(layers, "_on_cpu", lambda: True)
    for off, on in zip(got, [conv(x), up(x), conv.padded(x, 2, 1)]):
        np.testing.assert_allclose(np.array(off), np.array(on), atol=2e-5)
    # conv_transpose1d is a conv1d of its own.
    assert calls == ["conv1d", "conv_transpose1d", "conv1d", "conv1d"]


@pytest.mark.parametrize("device", [mx.cpu, mx.gpu])
@pytest.mark.parametrize(
    "k, padding, dilation, left, right", [(3, 0, 1, 2, 0), (4, 0, 1, 0, 3), (5, 1, 2, 4, 1)]
)
def test_a_padded_convolution_is_the_same_off_the_cpu(k, padding, dilation, left, right, device, monkeypatch):
    """``Conv1d.padded``: the padding inside the convolution (``mx.conv_general``'s own: the path off the CPU,
    on a GPU or forced on the CPU backend) gives what ``mx.pad`` then the convolution gives on the CPU."""
    if not mx.is_available(device):
        pytest.skip(f"no MLX {device} here")
    conv = Conv1d(6, 4, k, padding=padding, dilation=dilation)
    conv.bias = mx.random.normal((4,), key=mx.random.key(3))
    x = mx.random.normal((2, 17, 6), key=mx.random.key(k))
    previous = mx.default_device()
    try:
        mx.set_default_device(mx.cpu)
        want = conv.padded(x, left, right)
        mx.eval(want)
        mx.set_default_device(device)
        if device == mx.cpu:
            monkeypatch.setattr(layers, "_on_cpu", lambda: False)
        got = conv.padded(x, left, right)
        mx.eval(got)
    finally:
        mx.set_default_device(previous)
    assert got.shape == want.shape == (2, 17 + 2 * padding + left + right - dilation * (k - 1), 4)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5)


# --- float32 convolutions (HiFT's, the flow's) as our CUDA kernel (layers.KERNEL_CONVS) ---

# (C_in, C_out, k, dilation, padding, rows, frames), then Conv1d's bias, mask and add: a "same" dilated one with
# all three, output columns past a tile's 64 and rows past a tile's; a wide kernel, no bias, one row; a
# pointwise one; the causal-style one-sided length change (padding 0).
KERNEL_CASES = [
    (32, 80, 3, 2, 2, 2, 37, (True, True, True)),
    (16, 18, 11, 5, 25, 1, 60, (False, False, False)),
    (48, 64, 1, 1, 0, 2, 70, (True, False, True)),
    (16, 8, 7, 1, 0, 1, 20, (True, True, False)),
]


def _kernel_layers(c_in, c_out, k, dilation, padding, bias, seed):
    conv = Conv1d(c_in, c_out, k, padding=padding, dilation=dilation, bias=bias)
    keys = mx.random.split(mx.random.key(seed), 2)
    conv.weight = mx.random.normal(conv.weight.shape, key=keys[0]) / np.sqrt(k * c_in)
    if bias:
        conv.bias = mx.random.normal((c_out,), key=keys[1])
    return conv


def _kernel_inputs(c_in, c_out, rows, frames, t_out, mask, add, seed):
    keys = mx.random.split(mx.random.key(seed), 3)
    x = mx.random.normal((rows, frames, c_in), key=keys[0])
    lengths = mx.array([frames, frames - 9][:rows])
    m = (mx.arange(frames)[None] < lengths[:, None])[..., None] if mask else None
    a = mx.random.normal((rows, t_out, c_out), key=keys[2]) if add else None
    return x, m, a


@pytest.fixture
def launched_alone(monkeypatch):
    """The kernel's cache holds what the test launched: no compiling of all HiFT's kernels at the first call."""
    monkeypatch.setattr(layers, "_compile_kernel_convs", lambda: None)


def _composed(layer, *args):
    """The layer's call off the kernel: x * mask, MLX's convolution (or our products on the CPU), + add."""
    previous = layers.KERNEL_CONVS
    layers.KERNEL_CONVS = False
    try:
        return layer(*args)
    finally:
        layers.KERNEL_CONVS = previous


@pytest.mark.parametrize("sms", [132, 0], ids=["64-row-tiles", "128-row-tiles"])
@pytest.mark.parametrize("c_in, c_out, k, dilation, padding, rows, frames, flags", KERNEL_CASES)
def test_conv_kernel_matches_the_composed_convolution(
    emulated, launched_alone, monkeypatch, c_in, c_out, k, dilation, padding, rows, frames, flags, sms
):
    """The kernel's source (emulated on the CPU: its indexing, tiles, barriers) against x * mask, MLX's
    convolution, the bias and + add; 132 SMs keep 64-row tiles, none makes 128 rows pay."""
    monkeypatch.setattr(layers, "_sm_count", lambda: sms)
    monkeypatch.setattr(layers, "KERNEL_CONVS", True)
    bias, mask, add = flags
    conv = _kernel_layers(c_in, c_out, k, dilation, padding, bias, seed=k)
    t_out = frames + 2 * padding - dilation * (k - 1)
    x, m, a = _kernel_inputs(c_in, c_out, rows, frames, t_out, mask, add, seed=c_in)
    got = conv(x, m, a)
    assert list(layers._conv_kernels) == [64 if sms == 132 else 128]
    want = _composed(conv, x, m, a)
    assert got.shape == want.shape == (rows, t_out, c_out)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("k, stride, padding", [(16, 8, 4), (11, 5, 3), (7, 3, 2)])
def test_conv_kernel_upsamples_as_the_transposed_convolution(
    emulated, launched_alone, monkeypatch, k, stride, padding
):
    """HiFT's three upsamplings (k, stride, padding) at small channels, with a mask of the padded frames."""
    monkeypatch.setattr(layers, "KERNEL_CONVS", True)
    up = ConvTranspose1d(16, 8, k, stride, padding=padding)
    up.weight = mx.random.normal(up.weight.shape, key=mx.random.key(k)) / 8
    up.bias = mx.random.normal((8,), key=mx.random.key(k + 1))
    x, m, _ = _kernel_inputs(16, 8, 2, 13, 0, True, False, seed=k)
    got = up(x, m)
    assert len(layers._conv_kernels) == 1
    want = _composed(up, x, m)
    assert got.shape == want.shape == (2, 12 * stride - 2 * padding + k, 8)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "k, padding, dilation, left, right", [(3, 0, 1, 2, 0), (4, 0, 1, 0, 3), (5, 1, 2, 4, 1)]
)
def test_conv_kernel_pads_as_the_padded_convolution(
    emulated, launched_alone, monkeypatch, k, padding, dilation, left, right
):
    """``Conv1d.padded`` (the estimator's causal convolutions, the flow's look-ahead ones) through the kernel,
    against ``mx.pad`` then the convolution on the CPU."""
    monkeypatch.setattr(layers, "KERNEL_CONVS", True)
    conv = _kernel_layers(32, 40, k, dilation, padding, True, seed=k)
    x = mx.random.normal((2, 23, 32), key=mx.random.key(k))
    got = conv.padded(x, left, right)
    assert len(layers._conv_kernels) == 1
    want = _composed(lambda *a: conv.padded(*a), x, left, right)
    assert got.shape == want.shape == (2, 23 + 2 * padding + left + right - dilation * (k - 1), 40)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-5)


def test_the_first_kernel_convolution_compiles_the_kernel_at_both_tile_heights(emulated, monkeypatch):
    """A process's first kernel convolution launches the kernel at both tile heights, so that their compiles
    come together; later calls at other sizes, with or without a bias, a mask and a sum (read or not by the
    same kernel), compile nothing more."""
    monkeypatch.setattr(layers, "KERNEL_CONVS", True)
    conv = _kernel_layers(16, 24, 3, 1, 1, True, seed=0)
    x, m, a = _kernel_inputs(16, 24, 2, 30, 30, True, True, seed=0)
    np.testing.assert_allclose(np.array(conv(x)), np.array(_composed(conv, x)), atol=2e-5, rtol=1e-5)
    assert set(layers._conv_kernels) == {64, 128}
    wider = _kernel_layers(32, 80, 7, 3, 9, False, seed=1)
    x32 = mx.random.normal((2, 50, 32), key=mx.random.key(2))
    mx.eval(wider(x32, mx.ones((2, 50, 1), mx.bool_)), conv(x, m, a))
    assert set(layers._conv_kernels) == {64, 128}


def test_the_emulation_refuses_a_0d_input_whose_ndim_the_source_reads():
    """MLX gives a 0-d input no shape or ndim parameter, yet passes one (a silent misread on a GPU): so the
    stand-ins for a missing bias, mask or sum are (1, 1), and the emulation refuses a 0-d input."""
    from tests import emulated_cuda

    kernel = emulated_cuda.cuda_kernel("probe", ["a"], ["out"], "out[0] = float(a_ndim);")
    with pytest.raises(ValueError, match="a is 0-d, but the source reads its shape, strides or ndim"):
        kernel(inputs=[mx.array(1.0)], template=[], grid=(32, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(1,)], output_dtypes=[mx.float32])  # fmt: skip


def test_conv_kernel_takes_only_what_it_computes(emulated, launched_alone, monkeypatch):
    """Off the switch, or for bfloat16, a stride, or C_in not a multiple of 16, the composed path runs; the
    kernel's weight is made once per weight array, and is no parameter; a bad bias, mask or add is refused
    by name (the kernel reads each only at its own ndim)."""
    x = mx.random.normal((1, 20, 16))
    conv = _kernel_layers(16, 8, 3, 1, 1, True, seed=0)
    assert layers.kernel_conv_fits(x, conv.weight)  # on by default
    monkeypatch.setattr(layers, "KERNEL_CONVS", False)
    assert not layers.kernel_conv_fits(x, conv.weight)
    monkeypatch.setattr(layers, "KERNEL_CONVS", True)
    assert not layers.kernel_conv_fits(x.astype(mx.bfloat16), conv.weight)
    assert not layers.kernel_conv_fits(x, conv.weight, stride=2)
    assert not layers.kernel_conv_fits(x[..., :12], conv.weight[..., :12])
    conv(x)
    kept = conv.__dict__["_kernel_weight_0_0"].value
    assert kept.geometry.tolist() == [8, 1, 1, 1] and kept.rows.shape == (3 * 16, 64)
    conv(x)
    assert conv.__dict__["_kernel_weight_0_0"].value is kept
    assert [k for k, _ in nn.utils.tree_flatten(conv.parameters())] == ["weight", "bias"]
    conv.weight = conv.weight * 2
    conv(x)
    assert conv.__dict__["_kernel_weight_0_0"].value is not kept
    conv.padded(x, 2, 0)  # other padding: kept apart
    assert conv.__dict__["_kernel_weight_2_0"].value.geometry.tolist() == [8, 1, 3, 1]
    with pytest.raises(ValueError, match="bias must have shape"):
        layers.conv1d_kernel(x, kept, conv.bias[None])
    with pytest.raises(ValueError, match="mask must be bool"):
        conv(x, mx.ones((1, 20, 1)))
    with pytest.raises(ValueError, match="add must have the output's shape"):
        conv(x, None, mx.ones((1, 19, 8)))


@pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("c_in, c_out, k, dilation, padding, rows, frames", [
    (512, 256, 16, 1, 1, 1, 500), (256, 256, 11, 5, 25, 2, 4000), (64, 64, 7, 3, 9, 1, 60001),
    (64, 18, 7, 1, 3, 2, 24001), (80, 512, 7, 1, 3, 1, 500),
])  # fmt: skip
def test_conv_kernel_on_cuda_matches_mlx(monkeypatch, c_in, c_out, k, dilation, padding, rows, frames):
    """The compiled kernel on a GPU at HiFT's sizes (10 s: 500 mel frames, 60,001 at the last stage), with
    the mask of a shorter second row, the bias and a residual sum, against MLX's convolution in float32."""
    monkeypatch.setattr(layers, "KERNEL_CONVS", True)
    monkeypatch.setattr(layers, "_use_cuda_paths", lambda: True)
    conv = _kernel_layers(c_in, c_out, k, dilation, padding, True, seed=k)
    t_out = frames + 2 * padding - dilation * (k - 1)
    x, m, a = _kernel_inputs(c_in, c_out, rows, frames, t_out, True, True, seed=c_in)
    got, want = conv(x, m, a), _composed(conv, x, m, a)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("c_in, c_out, k, left, right", [(320, 256, 3, 2, 0), (512, 512, 4, 0, 3)])
def test_padded_conv_kernel_on_cuda_matches_mlx(monkeypatch, c_in, c_out, k, left, right):
    """The float32 estimator's causal convolution and the flow's look-ahead one, 2 rows of 1,000 frames."""
    monkeypatch.setattr(layers, "KERNEL_CONVS", True)
    monkeypatch.setattr(layers, "_use_cuda_paths", lambda: True)
    conv = _kernel_layers(c_in, c_out, k, 1, 0, True, seed=k)
    x = mx.random.normal((2, 1000, c_in), key=mx.random.key(k))
    got, want = conv.padded(x, left, right), _composed(lambda *a: conv.padded(*a), x, left, right)
    assert got.shape == want.shape == (2, 1000 + left + right - k + 1, c_out)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)


# --- the elementwise functions (their CPU path is our polynomials; elsewhere MLX's own ops) ---

# Bounds measured on a 2-core EPYC (MLX 0.32.4 CPU), with a little margin: exp rel. 1.0e-7, erf abs. 1.34e-7,
# GELU abs. 4.5e-7 (nn.gelu: 4.7e-7), Mish rel. ~2e-7. MLX's own CPU functions: exp rel. 3.9e-6, erf abs. 5.3e-7.
EXP_REL = 1.2e-7
ERF_ABS = 1.5e-7
GELU_ABS = 5e-7
MISH_REL = 5e-7


def _on_cpu(fn, *args):
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        return np.asarray(fn(*args).astype(mx.float32)).astype(np.float64)
    finally:
        mx.set_default_device(previous)


def test_exp_relative_error():
    x = np.linspace(-87, 88, 400_001).astype(np.float32)
    got = _on_cpu(layers.exp, mx.array(x))
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - ref) / ref) <= EXP_REL


def test_exp_saturates_instead_of_overflowing_the_exponent_bits():
    got = _on_cpu(layers.exp, mx.array([-1e10, -200.0, 0.0], mx.float32))
    assert np.all(got[:2] < 1e-37) and np.all(got[:2] >= 0) and got[2] == 1.0


def test_erf_and_gelu_absolute_error():
    erf = pytest.importorskip("scipy.special").erf
    x = np.linspace(-12, 12, 600_001).astype(np.float32)
    xd = x.astype(np.float64)
    got = _on_cpu(mx.compile(layers._erf_cpu), mx.array(x))
    assert np.max(np.abs(got - erf(xd))) <= ERF_ABS
    got = _on_cpu(layers.gelu, mx.array(x))
    assert np.max(np.abs(got - 0.5 * xd * (1 + erf(xd / np.sqrt(2))))) <= GELU_ABS


def test_mish_relative_error():
    x = np.concatenate([np.linspace(-30, 60, 300_001), [0.0, 1e-30, -1e-30]]).astype(np.float32)
    xd = x.astype(np.float64)
    ref = xd * np.tanh(np.logaddexp(xd, 0.0))
    got = _on_cpu(layers.mish, mx.array(x))
    assert np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-30)) <= MISH_REL


@pytest.mark.parametrize("masked", [False, True])
def test_attention_matches_mlx_fast_sdpa(masked):
    q, k, v = (mx.random.normal((2, 3, 17, 8), key=mx.random.key(i)) for i in range(3))
    mask = None
    if masked:  # key padding as the CFM builds it: -1e10 on the last 5 keys of the second row
        pad = np.zeros((2, 1, 1, 17), np.float32)
        pad[1, ..., 12:] = -1.0e10
        mask = mx.array(pad)
    got = _on_cpu(layers.attention, q, k, v, 8**-0.5, mask)
    want = _on_cpu(
        lambda *a: mx.fast.scaled_dot_product_attention(*a[:3], scale=a[3], mask=a[4]), q, k, v, 8**-0.5, mask
    )
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("mask_kind", ["none", "keys", "full"])
def test_attention_in_query_chunks_matches_one_piece(monkeypatch, mask_kind):
    # Head-split views, as the estimator passes them; 17 queries in chunks of 5, 5, 5 and 2.
    q, k, v = (
        mx.random.normal((2, 17, 3 * 8), key=mx.random.key(i)).reshape(2, 17, 3, 8).transpose(0, 2, 1, 3)
        for i in range(3)
    )
    mask = {
        "none": None,
        "keys": mx.where(mx.arange(17) >= 12, -1.0e10, 0.0).reshape(1, 1, 1, 17),
        "full": mx.random.normal((2, 3, 17, 17), key=mx.random.key(7)),
    }[mask_kind]
    whole = _on_cpu(layers.attention, q, k, v, 8**-0.5, mask)
    monkeypatch.setattr(layers, "_CHUNK_SCORES", 5 * 2 * 3 * 17)
    chunked = _on_cpu(layers.attention, q, k, v, 8**-0.5, mask)
    np.testing.assert_allclose(chunked, whole, atol=1e-6, rtol=1e-6)


def test_other_dtypes_and_the_switch_use_mlx_ops(monkeypatch):
    x = mx.random.normal((3, 5), key=mx.random.key(3))
    half = x.astype(mx.bfloat16)
    assert _on_cpu(layers.gelu, half).tolist() == _on_cpu(nn.gelu, half).tolist()
    monkeypatch.setattr(layers, "FAST_CPU_MATH", False)
    assert _on_cpu(layers.mish, x).tolist() == _on_cpu(nn.mish, x).tolist()


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_mish_then_a_mask_and_a_sum_as_one_chain(monkeypatch, fast, dtype):
    """``mish(x, mask, add)``: Mish times a frame mask plus a broadcast sum (the estimator's resnets), on the
    CPU's fast path and as one fused kernel off it, against the three steps apart; each of mask and add alone
    too. Fused, a multiply-add may round once where the steps apart round twice: 2 ulp of the result."""
    monkeypatch.setattr(layers, "FAST_CPU_MATH", fast)
    rng = np.random.default_rng(5)
    x = mx.array(3 * rng.standard_normal((2, 7, 6)).astype(np.float32)).astype(dtype)
    mask = mx.array((rng.random((2, 7, 1)) < 0.7).astype(np.float32)).astype(dtype)
    add = mx.array(rng.standard_normal((2, 1, 6)).astype(np.float32)).astype(dtype)
    y = _on_cpu(layers.mish, x)
    ulp = 2 * float(np.finfo(np.float32).eps if dtype == mx.float32 else 2.0**-7)
    for m, a in ((mask, add), (mask, None), (None, add)):
        want = y * (1 if m is None else np.asarray(m.astype(mx.float32))) + (
            0 if a is None else np.asarray(a.astype(mx.float32))
        )
        got = _on_cpu(lambda v, m=m, a=a: layers.mish(v, m, a), x)
        np.testing.assert_allclose(got, want, rtol=ulp, atol=ulp * np.abs(want).max())


SIN_ABS = 2e-7  # measured 1.6e-7 up to |x| = 1e4 (MLX's CPU sin: 7.7e-8, at 40 ns per element)


@pytest.mark.parametrize("limit", [10.0, 1e4])
def test_sin_and_cos_absolute_error(limit):
    x = np.linspace(-limit, limit, 400_001).astype(np.float32)
    xd = x.astype(np.float64)
    assert np.max(np.abs(_on_cpu(layers.sin, mx.array(x)) - np.sin(xd))) <= SIN_ABS
    assert np.max(np.abs(_on_cpu(layers.cos, mx.array(x)) - np.cos(xd))) <= SIN_ABS


def test_kernel_sources_go_to_mlx_without_comments_and_indentation(monkeypatch):
    """``layers.cuda_kernel`` hands MLX the source and header without ``//`` comments (a ``//`` inside a string
    literal stays), leading blanks and empty lines; each line stays a line (``#pragma`` and ``#define`` need
    theirs) and the header ends in a newline (MLX writes its code right after it)."""
    got = {}
    monkeypatch.setattr(
        mx.fast, "cuda_kernel", lambda *args, **kw: got.update(args=args, kw=kw), raising=False
    )
    source = """
      // why this loop
      #pragma unroll
      for (int i = 0; i < 4; ++i) out[i] = x[i];  // the copy

      asm("mov.u32 %0, 1; // not a comment" : "=r"(n));  /* kept */
    """
    layers.cuda_kernel("copy", ["x"], ["out"], source, header="#define TWO 2  // a macro", shared_memory=8)
    name, inputs, outputs, bare = got["args"]
    assert (name, inputs, outputs) == ("copy", ["x"], ["out"])
    assert bare == (
        "#pragma unroll\n"
        "for (int i = 0; i < 4; ++i) out[i] = x[i];\n"
        'asm("mov.u32 %0, 1; // not a comment" : "=r"(n));  /* kept */\n'
    )
    assert got["kw"] == {"header": "#define TWO 2\n", "shared_memory": 8}


def test_conv1d_taps_hold_no_copies_of_the_input():
    """A long input's convolution (HiFT's) adds products of the shifted views: on the CPU its peak above the
    input and weights is about the padded input and the output, not the k-fold im2col of the input. (A GPU
    keeps each product's buffer until its kernel has run, so there the bound is MLX's memory limit's.)"""
    with mx.stream(mx.cpu):
        x = mx.random.normal((1, 20000, 32), key=mx.random.key(0))
        w = mx.random.normal((32, 11, 32), key=mx.random.key(1))
        mx.eval(x, w)
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        y = conv1d(x, w, padding=25, dilation=5)
        mx.eval(y)
    above = mx.get_peak_memory() - before
    assert above < 3 * y.nbytes, f"{above} bytes above the input for an output of {y.nbytes}"
