"""CAM++: the speaker x-vector network of S3Gen (Kaldi fbank features -> a 192-d embedding).

Mirrors upstream ``chatterbox/models/s3gen/xvector.py`` (0.1.7, ``CAMPPlus(memory_efficient=False)``);
architecture notes §4.7 and §9.13. Attribute paths follow the checkpoint keys under ``speaker_encoder.``.
BatchNorm is inference-only here: it always uses the running statistics, whatever ``train()``/``eval()`` say.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class CAMPPlusConfig:
    """Sizes of CAM++; the defaults are upstream's (``CAMPPlus()`` and its hard-wired FCM/block settings)."""

    feat_dim: int = 80  # fbank bins
    embedding_size: int = 192
    growth_rate: int = 32  # channels each dense layer adds
    bn_size: int = 4  # dense-layer bottleneck = bn_size * growth_rate
    init_channels: int = 128  # TDNN output channels
    head_channels: int = 32  # FCM m_channels
    # BasicResBlocks in each of FCM layer1 and layer2 (upstream builds both from num_blocks[0])
    head_blocks: int = 2
    tdnn_kernel: int = 5
    tdnn_stride: int = 2
    block_layers: tuple[int, ...] = (12, 24, 16)
    block_kernels: tuple[int, ...] = (3, 3, 3)
    block_dilations: tuple[int, ...] = (1, 2, 2)
    cam_reduction: int = 2
    segment_length: int = 100  # frames per CAM segment-pooling window
    bn_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.feat_dim % 8:
            raise ValueError(
                f"feat_dim must be a multiple of 8 (the head halves it three times), got {self.feat_dim}"
            )
        if not len(self.block_layers) == len(self.block_kernels) == len(self.block_dilations):
            raise ValueError("block_layers, block_kernels and block_dilations must have the same length")
        if any(k % 2 == 0 for k in (self.tdnn_kernel, *self.block_kernels)):
            raise ValueError("TDNN and CAM kernel sizes must be odd (upstream pads symmetrically)")

    @property
    def head_out_channels(self) -> int:
        return self.head_channels * (self.feat_dim // 8)

    @property
    def block_channels(self) -> list[tuple[int, int]]:
        """(input channels, channels after the dense layers) of each CAM dense block."""
        out, c = [], self.init_channels
        for n in self.block_layers:
            out.append((c, c + n * self.growth_rate))
            c = (c + n * self.growth_rate) // 2
        return out

    @property
    def out_channels(self) -> int:
        return self.block_channels[-1][1] // 2


class BatchNorm(nn.Module):
    """Inference-only BatchNorm over the last axis with running statistics (affine=False drops weight/bias)."""

    def __init__(self, channels: int, eps: float, affine: bool = True):
        super().__init__()
        self.eps = eps
        if affine:
            self.weight = mx.ones((channels,))
            self.bias = mx.zeros((channels,))
        self.running_mean = mx.zeros((channels,))
        self.running_var = mx.ones((channels,))

    def __call__(self, x: mx.array) -> mx.array:
        scale = mx.rsqrt(self.running_var + self.eps)
        if "weight" in self:
            return (x - self.running_mean) * (scale * self.weight) + self.bias
        return (x - self.running_mean) * scale


class BatchNormReLU(nn.Module):
    """Upstream ``get_nonlinear("batchnorm-relu")``: a Sequential whose only weights sit under ``batchnorm``."""

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.batchnorm = BatchNorm(channels, eps)

    def __call__(self, x: mx.array) -> mx.array:
        return nn.relu(self.batchnorm(x))


class BasicResBlock(nn.Module):
    """2-D residual block of the FCM head; the stride halves the frequency axis (H) only."""

    def __init__(self, in_planes: int, planes: int, stride: int, eps: float):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=(stride, 1), padding=1, bias=False)
        self.bn1 = BatchNorm(planes, eps)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = BatchNorm(planes, eps)
        # upstream's Sequential(conv, bn) is keys shortcut.0 / shortcut.1; empty (identity) when shapes agree
        self.shortcut = []
        if stride != 1 or in_planes != planes:
            self.shortcut = [
                nn.Conv2d(in_planes, planes, 1, stride=(stride, 1), bias=False),
                BatchNorm(planes, eps),
            ]

    def __call__(self, x: mx.array) -> mx.array:
        out = nn.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        for layer in self.shortcut:
            x = layer(x)
        return nn.relu(out + x)


class FCM(nn.Module):
    """The 2-D convolutional head: (B, F, T, 1) in NHWC with H = frequency, W = time -> (B, T, C·F/8).

    H is frequency so that the "conv2d" layout (o, i, kh, kw) -> (o, kh, kw, i) keeps PyTorch's kh = F."""

    def __init__(self, cfg: CAMPPlusConfig):
        super().__init__()
        m, eps = cfg.head_channels, cfg.bn_eps
        self.conv1 = nn.Conv2d(1, m, 3, padding=1, bias=False)
        self.bn1 = BatchNorm(m, eps)
        strides = [2] + [1] * (cfg.head_blocks - 1)
        self.layer1 = [BasicResBlock(m, m, s, eps) for s in strides]
        self.layer2 = [BasicResBlock(m, m, s, eps) for s in strides]
        self.conv2 = nn.Conv2d(m, m, 3, stride=(2, 1), padding=1, bias=False)
        self.bn2 = BatchNorm(m, eps)

    def __call__(self, x: mx.array) -> mx.array:
        out = nn.relu(self.bn1(self.conv1(x)))
        for block in self.layer1 + self.layer2:
            out = block(out)
        out = nn.relu(self.bn2(self.conv2(out)))  # (B, F/8, T, C)
        b, f, t, c = out.shape
        # PyTorch flattens (B, C, F/8, T) to (B, C·F/8, T): channel-major, so C goes before F here too
        return out.transpose(0, 2, 3, 1).reshape(b, t, c * f)


class TDNNLayer(nn.Module):
    """Strided Conv1d + BN + ReLU (upstream ``TDNNLayer`` with padding=-1: 'same' padding)."""

    def __init__(self, cfg: CAMPPlusConfig):
        super().__init__()
        k = cfg.tdnn_kernel
        self.linear = nn.Conv1d(
            cfg.head_out_channels,
            cfg.init_channels,
            k,
            stride=cfg.tdnn_stride,
            padding=(k - 1) // 2,
            bias=False,
        )
        self.nonlinear = BatchNormReLU(cfg.init_channels, cfg.bn_eps)

    def __call__(self, x: mx.array) -> mx.array:
        return self.nonlinear(self.linear(x))


def segment_means(x: mx.array, seg_len: int) -> mx.array:
    """Means of consecutive windows of ``seg_len`` frames: (B, T, C) -> (B, ceil(T / seg_len), C).

    The last, partial window is averaged over its real length, as ``avg_pool1d(ceil_mode=True, padding=0)``
    does (architecture §9.13)."""
    b, t, c = x.shape
    n = -(-t // seg_len)
    padded = mx.pad(x, [(0, 0), (0, n * seg_len - t), (0, 0)]) if n * seg_len != t else x
    sums = padded.reshape(b, n, seg_len, c).sum(axis=2)
    counts = mx.array([min(seg_len, t - i * seg_len) for i in range(n)], dtype=x.dtype)
    return sums / counts[:, None]


class CAMLayer(nn.Module):
    """Context-aware masking: a local dilated conv gated by utterance + segment context."""

    def __init__(self, cfg: CAMPPlusConfig, kernel: int, dilation: int):
        super().__init__()
        bn_channels, out = cfg.bn_size * cfg.growth_rate, cfg.growth_rate
        self.seg_len = cfg.segment_length
        self.linear_local = nn.Conv1d(
            bn_channels, out, kernel, padding=(kernel - 1) // 2 * dilation, dilation=dilation, bias=False
        )
        self.linear1 = nn.Conv1d(bn_channels, bn_channels // cfg.cam_reduction, 1)
        self.linear2 = nn.Conv1d(bn_channels // cfg.cam_reduction, out, 1)

    def __call__(self, x: mx.array) -> mx.array:
        t = x.shape[1]
        y = self.linear_local(x)
        # The context is constant within each segment and the gate is pointwise in time, so the gate is
        # computed once per segment, then repeated (upstream computes it per frame: same values).
        context = x.mean(axis=1, keepdims=True) + segment_means(x, self.seg_len)  # (B, S, C)
        gate = mx.sigmoid(self.linear2(nn.relu(self.linear1(context))))
        gate = mx.repeat(gate, self.seg_len, axis=1)[:, :t]
        return y * gate


class CAMDenseTDNNLayer(nn.Module):
    def __init__(self, cfg: CAMPPlusConfig, in_channels: int, kernel: int, dilation: int):
        super().__init__()
        bn_channels = cfg.bn_size * cfg.growth_rate
        self.nonlinear1 = BatchNormReLU(in_channels, cfg.bn_eps)
        self.linear1 = nn.Conv1d(in_channels, bn_channels, 1, bias=False)
        self.nonlinear2 = BatchNormReLU(bn_channels, cfg.bn_eps)
        self.cam_layer = CAMLayer(cfg, kernel, dilation)

    def __call__(self, x: mx.array) -> mx.array:
        return self.cam_layer(self.nonlinear2(self.linear1(self.nonlinear1(x))))


class CAMDenseTDNNBlock(nn.Module):
    """Dense block: each layer's growth_rate channels are appended to its input. Layers are attributes
    ``tdnnd1``, ``tdnnd2``, ... as in upstream's ModuleList subclass."""

    def __init__(self, cfg: CAMPPlusConfig, num_layers: int, in_channels: int, kernel: int, dilation: int):
        super().__init__()
        self.num_layers = num_layers
        for i in range(num_layers):
            layer = CAMDenseTDNNLayer(cfg, in_channels + i * cfg.growth_rate, kernel, dilation)
            setattr(self, f"tdnnd{i + 1}", layer)

    def __call__(self, x: mx.array) -> mx.array:
        for i in range(self.num_layers):
            x = mx.concatenate([x, getattr(self, f"tdnnd{i + 1}")(x)], axis=-1)
        return x


class TransitLayer(nn.Module):
    """BN + ReLU + Conv1x1 (no bias) halving the channels after each dense block."""

    def __init__(self, in_channels: int, out_channels: int, eps: float):
        super().__init__()
        self.nonlinear = BatchNormReLU(in_channels, eps)
        self.linear = nn.Conv1d(in_channels, out_channels, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear(self.nonlinear(x))


class AffineFreeBatchNorm(nn.Module):
    """Upstream ``get_nonlinear("batchnorm_")``: a Sequential holding a BatchNorm1d(affine=False)."""

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.batchnorm = BatchNorm(channels, eps, affine=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.batchnorm(x)


class DenseLayer(nn.Module):
    """The embedding projection (a Conv1x1 on the pooled stats, no bias) + affine-free BN."""

    def __init__(self, in_channels: int, out_channels: int, eps: float):
        super().__init__()
        self.linear = nn.Conv1d(in_channels, out_channels, 1, bias=False)
        self.nonlinear = AffineFreeBatchNorm(out_channels, eps)

    def __call__(self, x: mx.array) -> mx.array:
        return self.nonlinear(self.linear(x[:, None, :])[:, 0, :])


class XVector(nn.Module):
    """Upstream's ``xvector`` Sequential: tdnn, block1, transit1, ..., out_nonlinear, stats, dense."""

    def __init__(self, cfg: CAMPPlusConfig):
        super().__init__()
        self.num_blocks = len(cfg.block_layers)
        self.tdnn = TDNNLayer(cfg)
        specs = zip(cfg.block_layers, cfg.block_kernels, cfg.block_dilations, cfg.block_channels)
        for i, (n, k, d, (c_in, c_out)) in enumerate(specs):
            setattr(self, f"block{i + 1}", CAMDenseTDNNBlock(cfg, n, c_in, k, d))
            setattr(self, f"transit{i + 1}", TransitLayer(c_out, c_out // 2, cfg.bn_eps))
        self.out_nonlinear = BatchNormReLU(cfg.out_channels, cfg.bn_eps)
        self.dense = DenseLayer(2 * cfg.out_channels, cfg.embedding_size, cfg.bn_eps)

    def frames(self, x: mx.array) -> mx.array:
        """Frame-level features (B, T', out_channels) before the statistics pooling."""
        x = self.tdnn(x)
        for i in range(self.num_blocks):
            x = getattr(self, f"transit{i + 1}")(getattr(self, f"block{i + 1}")(x))
        return self.out_nonlinear(x)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.frames(x)
        # upstream statistics_pooling: [mean, unbiased std] over time (its eps argument is unused)
        stats = mx.concatenate([x.mean(axis=1), mx.sqrt(mx.var(x, axis=1, ddof=1))], axis=-1)
        return self.dense(stats)


class CAMPPlus(nn.Module):
    """CAM++ speaker encoder: mean-normalised Kaldi fbank features -> x-vector."""

    def __init__(self, cfg: CAMPPlusConfig = CAMPPlusConfig()):
        super().__init__()
        self.config = cfg
        self.head = FCM(cfg)
        self.xvector = XVector(cfg)

    def _check(self, feats: mx.array) -> None:
        if feats.ndim != 3 or feats.shape[-1] != self.config.feat_dim:
            raise ValueError(
                f"expected features (B, T, {self.config.feat_dim}), got shape {tuple(feats.shape)}"
            )
        # the unbiased std needs two frames after the TDNN stride; upstream returns NaN instead
        frames = -(-feats.shape[1] // self.config.tdnn_stride)
        if frames < 2:
            raise ValueError(
                f"need at least {self.config.tdnn_stride + 1} feature frames, got {feats.shape[1]}"
            )

    def head_features(self, feats: mx.array) -> mx.array:
        """FCM head output (B, T, head_out_channels) for features (B, T, feat_dim)."""
        self._check(feats)
        return self.head(feats.transpose(0, 2, 1)[..., None])  # (B, F, T, 1): NHWC with H = F

    def __call__(self, feats: mx.array) -> mx.array:
        """x-vectors (B, embedding_size) of features (B, T, feat_dim).

        feats: 80-bin Kaldi fbank frames (10 ms hop) with the per-utterance mean over time subtracted, as
        upstream's ``extract_feature`` makes them. Rows are not masked: like upstream, a zero-padded row gives
        the embedding of the padded features, so embed utterances of different lengths one at a time.
        """
        return self.xvector(self.head_features(feats))

    @staticmethod
    def checkpoint_table(cfg: CAMPPlusConfig) -> dict[str, tuple]:
        """Upstream key (relative to ``speaker_encoder.``) -> (our key or None, upstream shape[, layout])."""
        table: dict[str, tuple] = {}

        def bn(prefix: str, c: int, affine: bool = True) -> None:
            names = (
                ("weight", "bias", "running_mean", "running_var")
                if affine
                else ("running_mean", "running_var")
            )
            for name in names:
                table[f"{prefix}.{name}"] = (f"{prefix}.{name}", (c,))
            table[f"{prefix}.num_batches_tracked"] = (None, ())  # int64 training counter

        def conv(prefix: str, shape: tuple[int, ...], bias: bool = False) -> None:
            table[f"{prefix}.weight"] = (f"{prefix}.weight", shape, "conv2d" if len(shape) == 4 else "conv1d")
            if bias:
                table[f"{prefix}.bias"] = (f"{prefix}.bias", (shape[0],))

        m = cfg.head_channels
        conv("head.conv1", (m, 1, 3, 3))
        bn("head.bn1", m)
        for layer in ("layer1", "layer2"):
            for j in range(cfg.head_blocks):
                p = f"head.{layer}.{j}"
                conv(f"{p}.conv1", (m, m, 3, 3))
                bn(f"{p}.bn1", m)
                conv(f"{p}.conv2", (m, m, 3, 3))
                bn(f"{p}.bn2", m)
                if j == 0:  # the strided block has the conv shortcut
                    conv(f"{p}.shortcut.0", (m, m, 1, 1))
                    bn(f"{p}.shortcut.1", m)
        conv("head.conv2", (m, m, 3, 3))
        bn("head.bn2", m)

        conv("xvector.tdnn.linear", (cfg.init_channels, cfg.head_out_channels, cfg.tdnn_kernel))
        bn("xvector.tdnn.nonlinear.batchnorm", cfg.init_channels)
        g, bnc = cfg.growth_rate, cfg.bn_size * cfg.growth_rate
        red = bnc // cfg.cam_reduction
        specs = zip(cfg.block_layers, cfg.block_kernels, cfg.block_channels)
        for i, (n, k, (c_in, c_out)) in enumerate(specs):
            for j in range(n):
                p = f"xvector.block{i + 1}.tdnnd{j + 1}"
                c = c_in + j * g
                bn(f"{p}.nonlinear1.batchnorm", c)
                conv(f"{p}.linear1", (bnc, c, 1))
                bn(f"{p}.nonlinear2.batchnorm", bnc)
                conv(f"{p}.cam_layer.linear_local", (g, bnc, k))
                conv(f"{p}.cam_layer.linear1", (red, bnc, 1), bias=True)
                conv(f"{p}.cam_layer.linear2", (g, red, 1), bias=True)
            bn(f"xvector.transit{i + 1}.nonlinear.batchnorm", c_out)
            conv(f"xvector.transit{i + 1}.linear", (c_out // 2, c_out, 1))
        bn("xvector.out_nonlinear.batchnorm", cfg.out_channels)
        conv("xvector.dense.linear", (cfg.embedding_size, 2 * cfg.out_channels, 1))
        bn("xvector.dense.nonlinear.batchnorm", cfg.embedding_size, affine=False)
        return table
