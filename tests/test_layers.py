"""The shared conv layers: the matrix-product path (used on the CPU) equals MLX's own kernels."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_chatterbox.models.layers import Conv1d, ConvTranspose1d, conv1d, conv_transpose1d


@pytest.mark.parametrize("k, padding, dilation", [(1, 0, 1), (3, 1, 1), (4, 0, 1), (7, 9, 3), (11, 25, 5)])
def test_conv1d_matches_mlx(k, padding, dilation):
    x = mx.random.normal((2, 23, 6), key=mx.random.key(k))
    w = mx.random.normal((5, k, 6), key=mx.random.key(k + 1))
    want = mx.conv1d(x, w, padding=padding, dilation=dilation)
    np.testing.assert_allclose(np.array(conv1d(x, w, padding, dilation)), np.array(want), atol=2e-5)


@pytest.mark.parametrize("k, stride, padding", [(16, 8, 4), (11, 5, 3), (7, 3, 2), (4, 4, 0), (3, 5, 1)])
def test_conv_transpose1d_matches_mlx(k, stride, padding):
    x = mx.random.normal((2, 9, 6), key=mx.random.key(k))
    w = mx.random.normal((5, k, 6), key=mx.random.key(k + 1))
    want = mx.conv_transpose1d(x, w, stride=stride, padding=padding)
    got = conv_transpose1d(x, w, stride, padding)
    assert got.shape == want.shape == (2, (9 - 1) * stride - 2 * padding + k, 5)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5)


@pytest.mark.parametrize("device", [mx.cpu, mx.gpu])
def test_layers_give_the_same_result_on_either_path(device):
    if not mx.is_available(device):
        pytest.skip(f"no MLX {device} here")
    conv, up = Conv1d(6, 4, 5, padding=4, dilation=2), ConvTranspose1d(6, 4, 11, 5, padding=3)
    no_bias = Conv1d(6, 4, 3, bias=False)
    x = mx.random.normal((1, 17, 6))
    previous = mx.default_device()
    mx.set_default_device(device)
    try:
        for ours, native in ((conv, nn.Conv1d), (up, nn.ConvTranspose1d), (no_bias, nn.Conv1d)):
            np.testing.assert_allclose(np.array(ours(x)), np.array(native.__call__(ours, x)), atol=2e-5)
    finally:
        mx.set_default_device(previous)
