"""HiFT: S3Gen's vocoder (HiFTNet: a neural source filter + an iSTFT head), 80-bin log-mel at 50 frames/s ->
24 kHz waveform, 480 samples per frame.

Mirrors upstream ``chatterbox/models/s3gen/hifigan.py`` (``HiFTGenerator``, ``SineGen``,
``SourceModuleHnNSF``, ``ResBlock``, ``Snake``) and ``f0_predictor.py`` (``ConvRNNF0Predictor``) of 0.1.7,
architecture notes §4.6.
Channels-last (B, T, C) throughout; attribute paths follow the checkpoint keys under ``mel2wav.``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .layers import Conv1d, ConvTranspose1d, cos, exp, sin

# The sine phase is summed in fixed point with this many fractional bits (see ``sine_phase``).
PHASE_FRACTION_BITS = 40


@dataclass(frozen=True)
class HiFTConfig:
    """Sizes of HiFT; the defaults are Chatterbox's (``S3Token2Wav.__init__`` arguments over
    ``HiFTGenerator``'s defaults, and ``ConvRNNF0Predictor()``)."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8  # overtones above f0: the sine source has nb_harmonics + 1 channels
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1  # sine amplitude
    nsf_sigma: float = 0.003  # noise std in voiced frames (unvoiced: nsf_alpha / 3)
    nsf_voiced_threshold: float = 10.0  # Hz; f0 above it is voiced
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1  # inside the upsampling loop; the last leaky ReLU uses 0.01
    audio_limit: float = 0.99
    f0_cond_channels: int = 512

    def __post_init__(self):
        n = len(self.upsample_rates)
        if not (len(self.upsample_kernel_sizes) == len(self.source_resblock_kernel_sizes) == n):
            raise ValueError(
                "upsample_rates, upsample_kernel_sizes and source_resblock_kernel_sizes differ in length"
            )
        if len(self.source_resblock_dilation_sizes) != n:
            raise ValueError("source_resblock_dilation_sizes needs one entry per upsampling stage")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ValueError("resblock_kernel_sizes and resblock_dilation_sizes differ in length")
        if any((k - u) % 2 for k, u in zip(self.upsample_kernel_sizes, self.upsample_rates)):
            raise ValueError(
                "each upsample kernel minus its rate must be even, or the lengths do not line up"
            )
        if self.base_channels % 2**n:
            raise ValueError(f"base_channels={self.base_channels} must be divisible by 2**{n}")
        if self.istft_n_fft % self.istft_hop or self.istft_n_fft % 2:
            raise ValueError("istft_n_fft must be even and a multiple of istft_hop")

    @property
    def num_harmonics(self) -> int:
        return self.nb_harmonics + 1

    @property
    def samples_per_frame(self) -> int:
        """Output samples per mel frame: prod(upsample_rates) * istft_hop (480)."""
        return math.prod(self.upsample_rates) * self.istft_hop

    @property
    def source_down_rates(self) -> tuple[int, ...]:
        """Stride of each stage's source_downs conv: spectrogram frames per stage frame, (15, 3, 1)."""
        return tuple(math.prod(self.upsample_rates[i + 1 :]) for i in range(len(self.upsample_rates)))


# --- spectral transforms (torch.stft / torch.istft conventions, architecture §9.9) ---


@functools.lru_cache(maxsize=None)
def _fourier_tables(n_fft: int) -> tuple[mx.array, mx.array, mx.array]:
    """Periodic Hann window (n_fft,), forward DFT (n_fft, 2 bins) = [cos | -sin], and inverse real DFT
    (2 bins, n_fft) for [re | im] inputs, with torch's 1/n_fft and doubled interior bins."""

    def cos_sin(k: int, n: int) -> tuple[float, float]:
        a = (k * n) % n_fft  # reduce first; the quarter turns are exact so that sin(pi) is 0, not 1e-16
        exact = {0: (1.0, 0.0), n_fft // 2: (-1.0, 0.0)}
        if n_fft % 4 == 0:
            exact.update({n_fft // 4: (0.0, 1.0), 3 * n_fft // 4: (0.0, -1.0)})
        return exact.get(a) or (math.cos(2 * math.pi * a / n_fft), math.sin(2 * math.pi * a / n_fft))

    bins = n_fft // 2 + 1
    window = [0.5 - 0.5 * math.cos(2 * math.pi * n / n_fft) for n in range(n_fft)]  # scipy hann, fftbins=True
    forward = [
        [cos_sin(k, n)[0] for k in range(bins)] + [-cos_sin(k, n)[1] for k in range(bins)]
        for n in range(n_fft)
    ]
    # irfft: x_n = (1/N) sum_k c_k (re_k cos - im_k sin); c = 1 at DC and Nyquist, whose imaginary parts
    # drop out (their sines are exactly 0), as in the C2R transform behind torch.istft.
    weight = [(1.0 if k in (0, n_fft // 2) else 2.0) / n_fft for k in range(bins)]
    inverse = [[weight[k] * cos_sin(k, n)[0] for n in range(n_fft)] for k in range(bins)]
    inverse += [[-weight[k] * cos_sin(k, n)[1] for n in range(n_fft)] for k in range(bins)]
    return mx.array(window, mx.float32), mx.array(forward, mx.float32), mx.array(inverse, mx.float32)


def stft(x: mx.array, n_fft: int, hop: int, lengths: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """``torch.stft(x, n_fft, hop, n_fft, periodic Hann, center=True, pad_mode='reflect', onesided=True)``.

    x: (B, L) float32 samples, L > n_fft // 2. Returns (re, im), each (B, 1 + L // hop, n_fft // 2 + 1),
    channels-last (frames, bins). ``lengths`` (B,) int32: row b holds lengths[b] samples, right-padded
    (with anything); its first 1 + lengths[b] // hop frames are those of the row alone, the rest are not.
    """
    pad = n_fft // 2
    if x.shape[1] <= pad:
        raise ValueError(f"stft needs more than {pad} samples for its reflect padding, got {x.shape[1]}")
    if lengths is None:
        # reflect padding excludes the edge sample: x[pad], ..., x[1] | x | x[L-2], ..., x[L-1-pad]
        x = mx.concatenate([x[:, pad:0:-1], x, x[:, -2 : -pad - 2 : -1]], axis=1)
    else:
        # Each row reflected at its own end: padded sample p is x[|q|] (q = p - pad) up to the row's length
        # n, x[2(n - 1) - q] after it; clipped into the array where only masked frames read.
        q = mx.arange(x.shape[1] + 2 * pad)[None] - pad
        index = mx.where(q < lengths[:, None], mx.abs(q), 2 * (lengths[:, None] - 1) - q)
        x = mx.take_along_axis(x, mx.clip(index, 0, x.shape[1] - 1), axis=1)
    frames = 1 + (x.shape[1] - n_fft) // hop
    index = mx.arange(frames)[:, None] * hop + mx.arange(n_fft)[None]
    window, forward, _ = _fourier_tables(n_fft)
    spec = (x[:, index] * window) @ forward  # (B, frames, 2 * bins)
    bins = n_fft // 2 + 1
    return spec[..., :bins], spec[..., bins:]


def istft(re: mx.array, im: mx.array, n_fft: int, hop: int, frames: mx.array | None = None) -> mx.array:
    """``torch.istft(re + i·im, n_fft, hop, n_fft, periodic Hann, center=True, onesided)``.

    re, im: (B, F, n_fft // 2 + 1) with n_fft a multiple of hop. Returns (B, hop * (F - 1)) samples: the
    windowed inverse frames overlap-added, divided by the summed squared window, n_fft // 2 trimmed at each
    end. ``frames`` (B,) int32: row b has that many frames, right-padded; its first hop * (frames[b] - 1)
    samples are those of the row alone.
    """
    window, _, inverse = _fourier_tables(n_fft)
    square = mx.broadcast_to(mx.square(window), (1, re.shape[1], n_fft))
    spectra = mx.concatenate([re, im], axis=-1)
    if frames is not None:  # padded frames would overlap the last real ones: none may add to them
        valid = (mx.arange(re.shape[1])[None] < frames[:, None])[..., None]
        spectra, square = spectra * valid, square * valid
    y = overlap_add((spectra @ inverse) * window, hop)  # (B, F, n_fft) frames overlap-added
    # Beyond a padded row's end the envelope is 0; the floor (torch's NOLA bound) keeps those samples finite.
    envelope = overlap_add(square, hop)
    if frames is not None:
        envelope = mx.maximum(envelope, 1e-11)
    pad = n_fft // 2
    return y[:, pad:-pad] / envelope[:, pad:-pad]


def overlap_add(frames: mx.array, hop: int) -> mx.array:
    """(B, F, n_fft) frames placed hop apart and summed -> (B, hop * (F - 1) + n_fft)."""
    b, f, n = frames.shape
    r = n // hop
    chunks = frames.reshape(b, f, r, hop)
    # Chunk c of frame t lands on hop-block t + c.
    out = sum(mx.pad(chunks[:, :, c], [(0, 0), (c, r - 1 - c), (0, 0)]) for c in range(r))
    return out.reshape(b, (f + r - 1) * hop)


def sine_phase(freq: mx.array, samples_per_frame: int) -> mx.array:
    """SineGen's phase in cycles, ``cumsum(F) % 1`` over samples, for a frequency F held over each frame.

    freq: (B, T, H) cycles per sample. Returns (B, T, samples_per_frame, H) in [0, 1).

    Upstream runs ``torch.cumsum`` over 480 T fp32 samples. On the CPU torch accumulates in float64 and rounds
    each prefix sum to fp32 once; a fp32 scan (MLX's) is off by 1/100 cycle within half a second and loses the
    phase within seconds (§9.17). We sum exactly in int64 fixed point (2^-40 cycle steps; every F above
    2^-17 is exact) using the frame structure, prefix(t, j) = spf·sum_{s<t} F_s + (j + 1)·F_t, then round to
    fp32 once, as upstream's CPU path: bit-identical phases. That single rounding coarsens as the sum grows
    (2^-10 cycle at 10^4 cycles); it is upstream's precision and is kept. Exact up to 2^23 cycles (about 50
    minutes of a 300 Hz ninth harmonic), where fp32 holds no fraction at all.
    """
    scale = float(2**PHASE_FRACTION_BITS)
    q = mx.round(freq.astype(mx.float32) * scale).astype(mx.int64)  # (B, T, H)
    before = mx.cumsum(q, axis=1) - q  # exclusive prefix over frames
    steps = mx.arange(1, samples_per_frame + 1, dtype=mx.int64)[:, None]  # (spf, 1)
    total = samples_per_frame * before[:, :, None] + steps * q[:, :, None]  # (B, T, spf, H)
    cycles = total.astype(mx.float32) * (1.0 / scale)  # int64 -> fp32 rounds to nearest, the scale is exact
    return cycles - mx.floor(cycles)


# --- blocks ---


def _snake(x: mx.array, alpha: mx.array) -> mx.array:
    return x + (1.0 / (alpha + 1e-9)) * mx.square(mx.sin(x * alpha))


# On GPUs one fused kernel instead of six (72 Snakes a HiFT call); on the CPU, sin is our polynomial (layers.sin).
_snake_fused = mx.compile(_snake, shapeless=True)


class Snake(nn.Module):
    """x + sin²(αx)/(α + 1e-9), per-channel α on a linear scale (upstream ``Snake``, alpha_logscale=False)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = mx.ones((channels,))

    def __call__(self, x: mx.array) -> mx.array:
        if mx.default_device() != mx.cpu:
            return _snake_fused(x, self.alpha)
        return x + (1.0 / (self.alpha + 1e-9)) * mx.square(sin(x * self.alpha))


def _masked(x: mx.array, mask: mx.array | None) -> mx.array:
    """x with the frames beyond each row's length zeroed (mask (B, T, 1) bool), as a conv over the row alone
    sees them: the padding of a batch of rows of different lengths then changes none of their frames."""
    return x if mask is None else x * mask  # bool promotes to x's dtype


def _frame_mask(lengths: mx.array | None, width: int, scale: int = 1, extra: int = 0) -> mx.array | None:
    """(B, width, 1) bool, true on row b's first scale·lengths[b] + extra frames; None without lengths."""
    if lengths is None:
        return None
    return (mx.arange(width)[None] < lengths[:, None] * scale + extra)[..., None]


class ELU(nn.Module):
    """ELU(alpha=1) with expm1 as torch; a parameterless entry that keeps ``condnet``'s indices."""

    def __call__(self, x: mx.array) -> mx.array:
        return mx.where(x > 0, x, mx.expm1(mx.minimum(x, 0.0)))


class ResBlock(nn.Module):
    """Per dilation d: x += conv2(snake2(conv1_d(snake1(x)))), 'same' padding, conv2 undilated."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = [
            Conv1d(channels, channels, kernel_size, dilation=d, padding=d * (kernel_size - 1) // 2)
            for d in dilations
        ]
        self.convs2 = [
            Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2) for _ in dilations
        ]
        self.activations1 = [Snake(channels) for _ in dilations]
        self.activations2 = [Snake(channels) for _ in dilations]

    def __call__(self, x: mx.array, mask: mx.array | None = None) -> mx.array:
        # The convolutions take the mask and the residual sum themselves (one launch with layers.KERNEL_CONVS).
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = conv2(act2(conv1(act1(x), mask)), mask, add=x)
        return x


class F0Predictor(nn.Module):
    """Upstream ``ConvRNNF0Predictor``: 5 × (Conv1d k3 + ELU), a Linear to one value, absolute value."""

    def __init__(self, in_channels: int, channels: int):
        super().__init__()
        self.condnet = []
        for i in range(5):
            self.condnet += [Conv1d(in_channels if i == 0 else channels, channels, 3, padding=1), ELU()]
        self.classifier = nn.Linear(channels, 1)

    def __call__(self, mel: mx.array, mask: mx.array | None = None) -> mx.array:
        x = mel
        for layer in self.condnet:
            x = layer(x, mask) if isinstance(layer, Conv1d) else layer(x)
        return mx.abs(self.classifier(x)[..., 0])


class SourceModule(nn.Module):
    """The harmonic branch of ``SourceModuleHnNSF``: merges the sine harmonics into one excitation. (Its
    second, noise output is unused by HiFT and not computed.)"""

    def __init__(self, num_harmonics: int):
        super().__init__()
        self.l_linear = nn.Linear(num_harmonics, 1)

    def __call__(self, harmonics: mx.array) -> mx.array:
        return mx.tanh(self.l_linear(harmonics))


# --- the vocoder ---


class HiFT(nn.Module):
    def __init__(self, cfg: HiFTConfig):
        super().__init__()
        self.config = cfg
        base, n_fft = cfg.base_channels, cfg.istft_n_fft
        self.m_source = SourceModule(cfg.num_harmonics)
        self.f0_predictor = F0Predictor(cfg.in_channels, cfg.f0_cond_channels)
        self.conv_pre = Conv1d(cfg.in_channels, base, 7, padding=3)
        self.ups = [
            ConvTranspose1d(base // 2**i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes))
        ]
        self.source_downs = []
        self.source_resblocks = []
        for i, (u, k, d) in enumerate(
            zip(cfg.source_down_rates, cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes)
        ):
            ch = base // 2 ** (i + 1)
            self.source_downs.append(Conv1d(n_fft + 2, ch, 1 if u == 1 else 2 * u, padding=u // 2, stride=u))
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.resblocks = [
            ResBlock(base // 2 ** (i + 1), k, d)
            for i in range(len(self.ups))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
        ]
        self.conv_post = Conv1d(base // 2 ** len(self.ups), n_fft + 2, 7, padding=3)

    def predict_f0(self, mel: mx.array, lengths: mx.array | None = None) -> mx.array:
        """mel: (B, T, 80) log-mel. Returns f0 (B, T) in Hz (not negative). ``lengths`` (B,) int32: row b's
        frames, the rest padding; its first lengths[b] values are those of the row alone."""
        return self.f0_predictor(mel, _frame_mask(lengths, mel.shape[1]))

    def draw_source(self, batch: int, frames: int, key: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """The random inputs of ``source`` for (batch, frames) mel frames, from ``key`` (or MLX's global
        generator when None): phases (B, H) ~ U(-pi, pi) with the fundamental's set to 0, and noise
        (B, 480 T, H) ~ N(0, 1), H = nb_harmonics + 1. Upstream draws the same shapes (channels-first)."""
        h = self.config.num_harmonics
        k_phase, k_noise = (None, None) if key is None else mx.random.split(key)
        phases = mx.random.uniform(-math.pi, math.pi, (batch, h), key=k_phase)
        phases = mx.concatenate([mx.zeros((batch, 1)), phases[:, 1:]], axis=1)
        noise = mx.random.normal((batch, frames * self.config.samples_per_frame, h), key=k_noise)
        return phases, noise

    def source(
        self,
        f0: mx.array,
        *,
        phases: mx.array | None = None,
        noise: mx.array | None = None,
        key: mx.array | None = None,
    ) -> mx.array:
        """The neural-source-filter excitation: f0 held over each frame's 480 samples, 9 sines at h·f0 plus
        noise (silenced sines where f0 <= 10 Hz), merged by a Linear 9 -> 1 and tanh.

        f0: (B, T) Hz. Randomness: pass both ``phases`` (B, 9) radians (used as given; upstream's fundamental
        phase is 0) and ``noise`` (B, 480 T, 9), or neither and they are drawn from ``key`` (or MLX's global
        generator) by ``draw_source``. Returns (B, 480 T, 1).
        """
        cfg = self.config
        b, t = f0.shape
        spf, h = cfg.samples_per_frame, cfg.num_harmonics
        if (phases is None) != (noise is None):
            raise ValueError("pass both phases and noise, or neither (then they are drawn from key)")
        if phases is None:
            phases, noise = self.draw_source(b, t, key)
        elif key is not None:
            raise ValueError("pass either key or the phases and noise arrays, not both")
        if phases.shape != (b, h) or noise.shape != (b, t * spf, h):
            raise ValueError(
                f"phases {phases.shape} and noise {noise.shape} must be {(b, h)} and {(b, t * spf, h)} "
                f"for f0 {f0.shape}"
            )
        f0 = f0.astype(mx.float32)
        # Cycles per sample of each harmonic, with upstream's fp32 ops in its order (SineGen.forward).
        freq = f0[..., None] * mx.arange(1, h + 1, dtype=mx.float32) / cfg.sampling_rate  # (B, T, H)
        theta = mx.array(2 * math.pi, mx.float32) * sine_phase(freq, spf)  # (B, T, spf, H)
        sines = cfg.nsf_alpha * sin(theta + phases[:, None, None, :])
        voiced = (f0 > cfg.nsf_voiced_threshold).astype(mx.float32)[:, :, None, None]
        noise_amp = voiced * cfg.nsf_sigma + (1 - voiced) * (cfg.nsf_alpha / 3)
        harmonics = sines * voiced + noise_amp * noise.reshape(b, t, spf, h)
        return self.m_source(harmonics.reshape(b, t * spf, h).astype(self.m_source.l_linear.weight.dtype))

    def decode(self, mel: mx.array, source: mx.array, lengths: mx.array | None = None) -> mx.array:
        """mel: (B, T, 80), source: (B, 480 T, 1) excitation. Returns the waveform (B, 480 T) in
        ±audio_limit. ``lengths`` (B,) int32: row b's mel frames, the rest of it (and of its source) padding;
        its first 480 lengths[b] samples are those of the row alone, up to float error."""
        cfg = self.config
        b, t, _ = mel.shape
        n_fft, hop = cfg.istft_n_fft, cfg.istft_hop
        if source.shape != (b, t * cfg.samples_per_frame, 1):
            raise ValueError(f"source has shape {source.shape}, expected {(b, t * cfg.samples_per_frame, 1)}")
        spectral = cfg.samples_per_frame // hop  # spectrogram frames per mel frame (120)
        samples = None if lengths is None else lengths * cfg.samples_per_frame
        re, im = stft(source[..., 0].astype(mx.float32), n_fft, hop, samples)
        s = mx.concatenate([re, im], axis=-1).astype(mel.dtype)  # (B, 120 T + 1, n_fft + 2)
        s = _masked(s, _frame_mask(lengths, s.shape[1], spectral, 1))

        # Without lengths every mask is None; with them each conv's input is zero beyond its row's frames.
        mask = _frame_mask(lengths, t)
        x = self.conv_pre(mel, mask)
        nk, scale = len(cfg.resblock_kernel_sizes), 1
        for i, up in enumerate(self.ups):
            x = up(nn.leaky_relu(x, cfg.lrelu_slope), mask)
            scale *= cfg.upsample_rates[i]
            extra = int(i == len(self.ups) - 1)
            if extra:
                x = mx.concatenate([x[:, 1:2], x], axis=1)  # ReflectionPad1d((1, 0)): 120 T + 1 frames
            mask = _frame_mask(lengths, x.shape[1], scale, extra)
            x = x + self.source_resblocks[i](self.source_downs[i](s), mask)
            xs = self.resblocks[i * nk](x, mask)
            for j in range(1, nk):
                xs = xs + self.resblocks[i * nk + j](x, mask)
            x = xs / nk
        # The last slope is F.leaky_relu's default 0.01, not lrelu_slope (architecture §9.12).
        x = self.conv_post(nn.leaky_relu(x, 0.01), mask).astype(mx.float32)
        bins = n_fft // 2 + 1
        magnitude = mx.minimum(exp(x[..., :bins]), 100.0)
        phase = sin(x[..., bins:])  # upstream applies sin here too ("actually, sin is redundancy")
        frames = None if lengths is None else lengths * spectral + 1
        wav = istft(magnitude * cos(phase), magnitude * sin(phase), n_fft, hop, frames)
        return mx.clip(wav, -cfg.audio_limit, cfg.audio_limit)

    def __call__(
        self,
        mel: mx.array,
        *,
        key: mx.array | None = None,
        phases: mx.array | None = None,
        noise: mx.array | None = None,
        lengths: mx.array | None = None,
    ) -> mx.array:
        """mel: (B, T, 80) log-mel -> waveform (B, 480 T) at 24 kHz (upstream ``HiFTGenerator.inference``
        without the source cache; the fade-in is the caller's). Randomness as in ``source``; ``lengths`` as
        in ``decode`` (rows of different lengths in one call)."""
        f0 = self.predict_f0(mel, lengths)
        return self.decode(mel, self.source(f0, phases=phases, noise=noise, key=key), lengths)

    # --- checkpoint ---

    @staticmethod
    def checkpoint_table(cfg: HiFTConfig) -> dict[str, tuple]:
        """Upstream key under ``mel2wav.`` -> (our key, PyTorch shape[, layout]). Weight-normed convs appear
        as their folded ``.weight`` (v's shape). HiFTGenerator has no buffers in its state dict: its STFT
        window is a plain attribute, recomputed here."""
        table: dict[str, tuple] = {}

        def conv(name: str, c_out: int, c_in: int, k: int) -> None:
            table[f"{name}.weight"] = (f"{name}.weight", (c_out, c_in, k), "conv1d")
            table[f"{name}.bias"] = (f"{name}.bias", (c_out,))

        def resblock(name: str, ch: int, k: int, dilations: tuple[int, ...]) -> None:
            for j in range(len(dilations)):
                conv(f"{name}.convs1.{j}", ch, ch, k)
                conv(f"{name}.convs2.{j}", ch, ch, k)
                for act in ("activations1", "activations2"):
                    table[f"{name}.{act}.{j}.alpha"] = (f"{name}.{act}.{j}.alpha", (ch,))

        base, spec = cfg.base_channels, cfg.istft_n_fft + 2
        conv("conv_pre", base, cfg.in_channels, 7)
        for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)):
            c_in, c_out = base // 2**i, base // 2 ** (i + 1)
            table[f"ups.{i}.weight"] = (f"ups.{i}.weight", (c_in, c_out, k), "conv_transpose1d")
            table[f"ups.{i}.bias"] = (f"ups.{i}.bias", (c_out,))
        for i, (u, k, d) in enumerate(
            zip(cfg.source_down_rates, cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes)
        ):
            ch = base // 2 ** (i + 1)
            conv(f"source_downs.{i}", ch, spec, 1 if u == 1 else 2 * u)
            resblock(f"source_resblocks.{i}", ch, k, d)
        nk = len(cfg.resblock_kernel_sizes)
        for i in range(len(cfg.upsample_rates)):
            for j, (k, d) in enumerate(zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)):
                resblock(f"resblocks.{i * nk + j}", base // 2 ** (i + 1), k, d)
        conv("conv_post", spec, base // 2 ** len(cfg.upsample_rates), 7)
        h = cfg.num_harmonics
        table["m_source.l_linear.weight"] = ("m_source.l_linear.weight", (1, h))
        table["m_source.l_linear.bias"] = ("m_source.l_linear.bias", (1,))
        c = cfg.f0_cond_channels
        for i in range(5):
            conv(f"f0_predictor.condnet.{2 * i}", c, cfg.in_channels if i == 0 else c, 3)
        table["f0_predictor.classifier.weight"] = ("f0_predictor.classifier.weight", (1, c))
        table["f0_predictor.classifier.bias"] = ("f0_predictor.classifier.bias", (1,))
        return table
