"""Layers shared by several networks: 1-d convolutions that run as one matrix product on the CPU.

MLX's CPU convolution kernels are direct loops: on a Linux CPU a (4000 x 256) -> 256, kernel 11 conv took 4.1 s
against 50 ms as a product with OpenBLAS (benchmarks/bench_conv.py). On GPUs MLX's own kernels are as fast or
faster (H200: 0.12-0.34 ms vs 0.15-0.32 ms), so there the layers call them. Both paths compute the same
convolution; they keep ``nn.Conv1d``/``nn.ConvTranspose1d``'s parameters (weight (out, k, in), bias), so checkpoints
and key tables do not change.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def conv1d(x: mx.array, weight: mx.array, padding: int = 0, dilation: int = 1) -> mx.array:
    """x (B, T, C_in), weight (C_out, k, C_in), stride 1: the k shifted views side by side (im2col), then one
    product with the flattened kernel."""
    k = weight.shape[1]
    if padding:
        x = mx.pad(x, [(0, 0), (padding, padding), (0, 0)])
    length = x.shape[1] - dilation * (k - 1)
    if k == 1:
        cols = x
    else:
        cols = mx.concatenate([x[:, j * dilation : j * dilation + length] for j in range(k)], axis=-1)
    return cols @ weight.reshape(weight.shape[0], -1).T  # (B, T', k·C_in) @ (k·C_in, C_out)


def conv_transpose1d(x: mx.array, weight: mx.array, stride: int, padding: int = 0) -> mx.array:
    """x (B, T, C_in), weight (C_out, k, C_in): torch's ``conv_transpose1d`` (dilation 1, no output padding),
    output length (T - 1)·stride - 2·padding + k. Each input frame's k·C_out contributions come from one
    product; they are laid out as ceil(k / stride) blocks of ``stride`` frames and overlap-added by shifting.
    """
    c_out, k, c_in = weight.shape
    b, t, _ = x.shape
    blocks = -(-k // stride)
    w = mx.pad(weight, [(0, 0), (0, blocks * stride - k), (0, 0)])  # zero taps up to whole blocks
    y = (x @ w.transpose(2, 1, 0).reshape(c_in, blocks * stride * c_out)).reshape(b, t, blocks, stride, c_out)
    out = y[:, :, 0]
    if blocks > 1:
        out = mx.pad(out, [(0, 0), (0, blocks - 1), (0, 0), (0, 0)])
        for j in range(1, blocks):  # block j of frame i lands at frames i + j
            out = out + mx.pad(y[:, :, j], [(0, 0), (j, blocks - 1 - j), (0, 0), (0, 0)])
    out = out.reshape(b, (t + blocks - 1) * stride, c_out)
    return out[:, padding : padding + (t - 1) * stride + k - 2 * padding]


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


class Conv1d(nn.Conv1d):
    """``nn.Conv1d`` (stride 1, groups 1), computed by ``conv1d`` on the CPU."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        padding: int = 0,
        dilation: int = 1,
        bias: bool = True,
    ):
        super().__init__(
            in_channels, out_channels, kernel_size, padding=padding, dilation=dilation, bias=bias
        )

    def __call__(self, x: mx.array) -> mx.array:
        if not _on_cpu():
            return super().__call__(x)
        y = conv1d(x, self.weight, self.padding, self.dilation)
        return y + self.bias if "bias" in self else y


class ConvTranspose1d(nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` (dilation 1, groups 1), computed by ``conv_transpose1d`` on the CPU."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int, padding: int = 0):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding)

    def __call__(self, x: mx.array) -> mx.array:
        if not _on_cpu():
            return super().__call__(x)
        return conv_transpose1d(x, self.weight, self.stride, self.padding) + self.bias
