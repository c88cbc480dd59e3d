"""Perth implicit watermark networks (resemble-perth 1.0.1, MIT licence, see NOTICE): the embedder adds a learned
residual to the low band of a normalised dB magnitude spectrogram; the detector reads one confidence per clip back.

Mirrors ``perth/perth_net/perth_net_implicit/model/{__init__,encoder,decoder,perth_net}.py``; architecture §7.
Upstream names them encoder and decoder, and so do the checkpoint keys; we keep those names. The signal path
around them (resampling, STFT, dB normalisation, iSTFT) lives in ``generation/watermark.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .layers import Conv1d


@dataclass(frozen=True)
class PerthConfig:
    """Signal and network sizes; the defaults are the shipped model's ``hparams.yaml`` (run "implicit")."""

    sample_rate: int = 32000  # Hz; the networks only ever see spectrograms of 32 kHz audio
    n_fft: int = 2048
    hop_size: int = 320  # samples (10 ms)
    window_size: int = 2048  # periodic Hann
    hidden_size: int = 256
    max_wmark_freq: float = 2000.0  # Hz; the watermark lives in the bins below this
    stft_magnitude_min: float = 1e-9  # magnitude floor before the dB conversion (-180 dB)
    headroom_db: float = 15.0  # utils.normalize: dB in [-180, 15] maps to [0, 1]
    num_blocks: int = 5  # k-wide convs between the two 1x1 convs of every stack
    kernel_size: int = 7
    mask_ratio: float = (
        0.05  # a frame carries the mark if its summed magnitude exceeds this fraction of the max
    )

    def __post_init__(self) -> None:
        if self.kernel_size % 2 != 1:
            raise ValueError(f"kernel_size must be odd (perth's Conv asserts it), got {self.kernel_size}")
        if not 1 <= self.window_size <= self.n_fft:
            raise ValueError(f"window_size must lie in [1, n_fft={self.n_fft}], got {self.window_size}")
        if not 1 <= self.subband <= self.n_freq:
            raise ValueError(
                f"max_wmark_freq {self.max_wmark_freq} Hz gives {self.subband} bins; it must give 1..{self.n_freq}"
            )

    @property
    def n_freq(self) -> int:
        """Bins of the one-sided spectrum."""
        return self.n_fft // 2 + 1

    @property
    def subband(self) -> int:
        """Bins the watermark occupies, as perth's ``compute_subband_freq`` (128 with the defaults)."""
        return int(round(self.n_freq * self.max_wmark_freq / (self.sample_rate / 2)))


class ConvLayer(nn.Module):
    """perth ``model.Conv``: a same-padded Conv1d, then LeakyReLU (PyTorch's default slope 0.01) unless ``act`` is
    False."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, act: bool = True):
        super().__init__()
        self.conv = Conv1d(in_channels, out_channels, kernel_size, padding=(kernel_size - 1) // 2)
        self.act = act

    def __call__(self, x: mx.array) -> mx.array:
        x = self.conv(x)
        return nn.leaky_relu(x, 0.01) if self.act else x


def conv_stack(cfg: PerthConfig, out_channels: int) -> list[ConvLayer]:
    """1x1 conv (subband -> hidden), ``num_blocks`` k-wide convs, 1x1 conv (hidden -> out) without activation."""
    return [
        ConvLayer(cfg.subband, cfg.hidden_size, 1),
        *[ConvLayer(cfg.hidden_size, cfg.hidden_size, cfg.kernel_size) for _ in range(cfg.num_blocks)],
        ConvLayer(cfg.hidden_size, out_channels, 1, act=False),
    ]


def _run(layers: list[ConvLayer], x: mx.array) -> mx.array:
    for layer in layers:
        x = layer(x)
    return x


def frame_mask(magspec: mx.array, ratio: float) -> mx.array:
    """perth ``magmask``: 1.0 for frames whose summed (normalised dB) magnitude over all bins exceeds ``ratio`` of
    the clip's largest such sum, else 0.0. (B, T, F) -> (B, T, 1). Digital silence gives an all-zero mask."""
    s = magspec.sum(axis=-1)  # (B, T)
    thresh = s.max(axis=1, keepdims=True) * ratio
    return (s > thresh).astype(magspec.dtype)[..., None]


def lerp_time(x: mx.array, size: int) -> mx.array:
    """``F.interpolate(mode='linear', align_corners=True)`` along time: (B, T, C) -> (B, size, C).

    Positions are computed in float32 as PyTorch's CPU kernel does: scale = (T - 1) / (size - 1), index i reads
    x at i·scale."""
    t = x.shape[1]
    if size == t:
        return x
    if size > 1:
        scale = mx.array(t - 1, mx.float32) / mx.array(size - 1, mx.float32)
    else:
        scale = mx.array(0.0, mx.float32)
    pos = mx.arange(size, dtype=mx.float32) * scale
    i0 = mx.minimum(mx.floor(pos).astype(mx.int32), t - 1)
    i1 = mx.minimum(i0 + 1, t - 1)
    w1 = mx.clip(pos - i0.astype(mx.float32), 0.0, 1.0)[None, :, None]
    return x[:, i0] * (1.0 - w1) + x[:, i1] * w1


def nearest_time(x: mx.array, size: int) -> mx.array:
    """``F.interpolate(mode='nearest')`` along time: (B, T, C) -> (B, size, C); index i reads
    floor(float32(i) · float32(T / size)), PyTorch's float32 source index, so the masks match exactly."""
    t = x.shape[1]
    if size == t:
        return x
    scale = mx.array(t, mx.float32) / mx.array(size, mx.float32)
    src = mx.minimum(mx.floor(mx.arange(size, dtype=mx.float32) * scale).astype(mx.int32), t - 1)
    return x[:, src]


def masked_mean(x: mx.array, mask: mx.array) -> mx.array:
    """Mean over time of the masked frames: (B, T, C), (B, T, 1) -> (B, C). An all-zero mask gives NaN, as perth."""
    return (x * mask).sum(axis=1) / mask.sum(axis=1)


class PerthEncoder(nn.Module):
    """The embedder (perth ``Encoder``): adds a residual to the lowest ``subband`` bins of the gated frames."""

    def __init__(self, cfg: PerthConfig):
        super().__init__()
        self.config = cfg
        self.layers = conv_stack(cfg, cfg.subband)

    def __call__(self, magspec: mx.array) -> tuple[mx.array, mx.array]:
        """Watermark a normalised dB magnitude spectrogram.

        Args:
            magspec: (B, T, n_freq) float32, (dB + 180) / 195 of a 32 kHz STFT magnitude.
        Returns:
            (watermarked magspec (B, T, n_freq), frame mask (B, T, 1) of 0.0/1.0).
        """
        sub = self.config.subband
        mask = frame_mask(magspec, self.config.mask_ratio)
        low = magspec[..., :sub]
        residual = _run(self.layers, low) * mask
        return mx.concatenate([low + residual, magspec[..., sub:]], axis=-1), mask


class PerthDecoder(nn.Module):
    """The detector (perth ``Decoder``): three conv stacks read the low band at 1.25x, 1x and 0.75x the frame rate;
    each gives an attention logit and a watermark value per frame, averaged over the gated frames; a softmax over the
    three logits weighs the three values."""

    # (stack name in the checkpoint, time scale) in upstream's order
    BRANCHES = (("slow_layers", 1.25), ("normal_layers", 1.0), ("fast_layers", 0.75))

    def __init__(self, cfg: PerthConfig):
        super().__init__()
        self.config = cfg
        self.slow_layers = conv_stack(cfg, 2)
        self.normal_layers = conv_stack(cfg, 2)
        self.fast_layers = conv_stack(cfg, 2)

    def __call__(self, magspec: mx.array) -> mx.array:
        """Watermark confidence (B,) of a normalised dB magnitude spectrogram (B, T, n_freq), T >= 2; about 1 when
        marked and 0 when not (perth clips it to [0, 1] and rounds). NaN when the frame mask is empty (silence).
        """
        t = magspec.shape[1]
        if t < 2:
            raise ValueError(f"the detector needs at least 2 frames (its 0.75x branch), got {t}")
        mask = frame_mask(magspec, self.config.mask_ratio)
        low = magspec[..., : self.config.subband]
        attn, marks = [], []
        for name, scale in self.BRANCHES:
            # int(T * scale) is upstream's size rule (Python float product, truncated).
            out = _run(getattr(self, name), lerp_time(low, int(t * scale)))  # (B, T', 2)
            m = nearest_time(mask, out.shape[1])
            attn.append(masked_mean(out[..., :1], m))
            marks.append(masked_mean(out[..., 1:], m))
        weights = mx.softmax(mx.concatenate(attn, axis=-1), axis=-1)  # (B, 3)
        return (mx.concatenate(marks, axis=-1) * weights).sum(axis=-1)


class PerthNet(nn.Module):
    """Embedder and detector together, under the checkpoint's names (``encoder.*``, ``decoder.*``)."""

    def __init__(self, cfg: PerthConfig = PerthConfig()):
        super().__init__()
        self.config = cfg
        self.encoder = PerthEncoder(cfg)
        self.decoder = PerthDecoder(cfg)

    @staticmethod
    def checkpoint_table(cfg: PerthConfig) -> dict[str, tuple]:
        """Key of the checkpoint's ``model`` state dict -> (our key or None, upstream shape[, layout])."""
        sub, h, k = cfg.subband, cfg.hidden_size, cfg.kernel_size
        table: dict[str, tuple] = {
            # AudioProcessor buffers: the Hann windows are rebuilt by the signal path, and TimeStretch's phase
            # advance belongs to a training-time attack that inference never runs.
            "ap.spectrogram.window": (None, (cfg.window_size,)),
            "ap.inv_spectrogram.window": (None, (cfg.window_size,)),
            "ap.stretch.phase_advance": (None, (cfg.n_freq, 1)),
        }

        def stack(prefix: str, out_channels: int) -> None:
            sizes = [(sub, h, 1)] + [(h, h, k)] * cfg.num_blocks + [(h, out_channels, 1)]
            for i, (c_in, c_out, width) in enumerate(sizes):
                key = f"{prefix}.{i}.conv"
                table[f"{key}.weight"] = (f"{key}.weight", (c_out, c_in, width), "conv1d")
                table[f"{key}.bias"] = (f"{key}.bias", (c_out,))

        stack("encoder.layers", sub)
        for name, _ in PerthDecoder.BRANCHES:
            stack(f"decoder.{name}", 2)
        return table
