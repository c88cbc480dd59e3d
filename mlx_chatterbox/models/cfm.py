"""S3Gen's conditional flow-matching decoder: the estimator (a causal 1-D U-Net with transformer blocks) and
its two solvers: English's Euler steps with classifier-free guidance, and Turbo/Nano's meanflow steps.

Mirrors upstream ``chatterbox/models/s3gen`` (0.1.7): ``decoder.py: ConditionalDecoder`` (causal), the matcha
blocks it builds on, diffusers' ``BasicTransformerBlock``, and ``flow_matching.py: CausalConditionalCFM``
(``solve_euler``; ``basic_euler`` for ``meanflow``); architecture notes §4.4 and §4.5, variants.md §3.
Channels-last (B, T, C) throughout; the transformer blocks take the frames as (B·T, C) rows. Attribute paths
follow the checkpoint keys under ``flow.decoder.estimator.``; ``None`` holds the place of parameter-free
Sequential members. The estimator is host-bound at one request on a GPU (thousands of small primitives a
call), so weights that a call would rearrange (transposes, the fused q/k/v) are kept, built once, and on CUDA
its products and convolutions can run as one kernel of ours with their sums (``tiled_product``, at the end).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import string
from collections.abc import Generator
from dataclasses import dataclass
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn

from . import layers
from .layers import Conv1d, Kept, attention, gelu_linear, kept, mish

FF_MULT = 4  # diffusers FeedForward's default, which BasicTransformerBlock keeps
TIME_SCALE = 1000.0  # SinusoidalPosEmb.forward(scale=1000): t in [0, 1] is stretched before the sinusoids
MASK_BIAS = -1.0e10  # decoder.py: mask_to_bias
T = TypeVar("T")
# A computation queued a part at a time: it yields once each part is queued (``mx.async_eval``), so that a caller
# can queue other work on the same stream in between (the server's T3 steps: ``Vocoding(sliced=True)``), and
# returns its value. ``drain`` runs one to its end.
Steps = Generator[None, None, T]


def drain(steps: Steps[T]) -> T:
    """Run a computation queued in parts (``Steps``) to its end: its value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


@dataclass(frozen=True)
class CFMConfig:
    """Sizes of the estimator and the solver's defaults; the defaults are upstream's (``S3Token2Mel`` builds
    ``ConditionalDecoder`` with these; ``configs.py: CFM_PARAMS`` holds the guidance rate).

    ``meanflow``: Turbo/Nano's distilled decoder (``S3Gen(meanflow=True)``, variants.md §3): the estimator
    also takes the step's end time r through ``time_embed_mixer``, and ``solve_meanflow`` integrates it.
    ``n_timesteps`` and ``cfg_rate`` left at None take upstream's values for the kind: 10 steps with guidance
    0.7, or 2 steps without guidance for meanflow (``S3Token2Wav.flow_inference``; the distilled model has
    guidance baked in). Build a meanflow config as ``CFMConfig(meanflow=True)``: ``dataclasses.replace`` of an
    English config would carry its 10 steps and its guidance over (the guidance is then refused).
    """

    in_channels: int = 320  # x, mu, spks and cond stacked: 4 x out_channels
    out_channels: int = 80  # mel bins
    channels: int = 256  # U-Net width (upstream ``channels=[256]``: one level, no down/up-sampling)
    n_blocks: int = 4  # transformer blocks per stage
    num_mid_blocks: int = 12
    num_heads: int = 8
    head_dim: int = 64
    n_timesteps: int | None = None  # Euler steps (flow.py inference); None: 10, or 2 for meanflow
    cfg_rate: float | None = None  # inference_cfg_rate; None: 0.7, or 0 for meanflow
    meanflow: bool = False

    def __post_init__(self) -> None:
        # The kind's defaults are filled in here (frozen: through object.__setattr__): after __init__ both are
        # numbers, and asdict / config.json record the ones in use.
        if self.n_timesteps is None:
            object.__setattr__(self, "n_timesteps", 2 if self.meanflow else 10)
        if self.cfg_rate is None:
            object.__setattr__(self, "cfg_rate", 0.0 if self.meanflow else 0.7)
        if self.meanflow and self.cfg_rate != 0:
            raise ValueError(
                f"cfg_rate={self.cfg_rate} with meanflow: the meanflow decoder runs without guidance "
                "(upstream's basic_euler); leave cfg_rate at None (or 0), e.g. CFMConfig(meanflow=True)"
            )
        if self.in_channels != 4 * self.out_channels:
            raise ValueError(
                f"in_channels={self.in_channels} must be 4 x out_channels={self.out_channels} "
                "(x, mu, speaker and cond are stacked)"
            )
        if self.in_channels % 2:
            raise ValueError(f"in_channels={self.in_channels} must be even (sinusoidal time embedding)")
        for name in ("channels", "n_blocks", "num_heads", "head_dim", "n_timesteps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.channels  # decoder.py: channels[0] * 4


def timestep_embedding(t: mx.array, dim: int) -> mx.array:
    """Sinusoidal embedding (matcha ``SinusoidalPosEmb``) of (B,) times in [0, 1] -> (B, dim) float32:
    [sin | cos] concatenated, not interleaved, with the fp32 operations in upstream's order."""
    half = dim // 2
    freqs = mx.exp(mx.arange(half, dtype=mx.float32) * -(math.log(10000) / (half - 1)))
    arg = (TIME_SCALE * t.astype(mx.float32))[:, None] * freqs[None]
    return mx.concatenate([mx.sin(arg), mx.cos(arg)], axis=-1)


def stacked(module: nn.Module, name: str, linears: list[nn.Module]) -> mx.array:
    """The ``linears``' weights stacked, (sum of their outputs, inputs), kept on ``module`` under ``name`` as
    ``kept`` keeps values. Each linear's weight is then a view of the stack (MLX's slices of whole rows share
    their array's memory), so the stack costs none beside them: 84 MiB of the fp32 estimator's q/k/v weights
    and 14 of its time projections were held twice before."""
    weights = tuple(lin["weight"] for lin in linears)
    cache = module.__dict__.get(name)
    if cache is None or not all(map(operator.is_, cache.sources, weights)):
        stack = mx.concatenate(weights)
        views = mx.split(stack, list(itertools.accumulate(w.shape[0] for w in weights[:-1])))
        mx.eval(stack, views)
        for lin, view in zip(linears, views):
            lin["weight"] = view
        cache = Kept(tuple(views), stack)
        object.__setattr__(module, name, cache)
    return cache.value


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and keys) that keeps its weight transposed: ``nn.Linear`` takes ``W.T``
    on every call, a view primitive each time (the estimator is host-bound: 184 of them a call). Takes
    x (..., in); for 2-D rows MLX's product adds no reshapes around it."""

    def weight_t(self) -> mx.array:
        """(in, out): the weight transposed, kept until it is replaced."""
        return kept(self, "_w_t", (self["weight"],), lambda w: w.T)

    def __call__(self, x: mx.array) -> mx.array:
        w_t = self.weight_t()
        return mx.addmm(self["bias"], x, w_t) if "bias" in self else x @ w_t


def linear(
    layer: Linear,
    x: mx.array,
    *,
    gelu: bool = False,
    add: mx.array | None = None,
    norm: nn.LayerNorm | None = None,
) -> mx.array:
    """``layer(norm(x))``, then the exact GELU, then plus ``add`` (the layer's shape), each optional: one kernel
    of ours where ``tiled_fits`` (CUDA, half precision), MLX's ops in this order elsewhere."""
    if tiled_fits(x, layer.weight):
        return tiled_product(x, layer.weight, layer.get("bias"), gelu=gelu, add=add, norm=norm)
    x = x if norm is None else norm(x)
    y = gelu_linear(x, layer.weight_t(), layer["bias"]) if gelu else layer(x)
    return y if add is None else y + add


class TimestepEmbedding(nn.Module):
    """matcha ``TimestepEmbedding``: Linear -> SiLU -> Linear."""

    def __init__(self, in_channels: int, time_embed_dim: int):
        super().__init__()
        self.linear_1 = Linear(in_channels, time_embed_dim)
        self.linear_2 = Linear(time_embed_dim, time_embed_dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_2(nn.silu(self.linear_1(x)))


def masked(x: mx.array, m: mx.array | None) -> mx.array:
    """x (B, T, C) with its padded frames zeroed by the (B, T, 1) frame mask m; x itself when no frame is padded."""
    return x if m is None else x * m


class CausalConv1d(Conv1d):
    """A stride-1 convolution that sees only the current and past frames: left-pads kernel - 1 zeros (our
    kernel with its bias where ``tiled_fits``: it reads the frames it needs, no padded copy)."""

    def __call__(self, x: mx.array) -> mx.array:
        if self.padding == 0 and self.dilation == 1 and tiled_fits(x, self.weight):
            return tiled_product(x, self.weight, self.get("bias"))
        return self.padded(x, self.weight.shape[1] - 1, 0)


def weight_rows(conv: Conv1d) -> mx.array:
    """A 1x1 convolution's weight as (C_out, C_in) rows, kept."""
    return kept(conv, "_w_rows", (conv["weight"],), lambda w: w.reshape(w.shape[0], -1))


def pointwise(conv: Conv1d, x: mx.array, c: mx.array) -> mx.array:
    """A 1x1 convolution of x (B, T, C_in) as one product plus ``c``: its bias (C_out,), or a (B, T, C_out)
    sum that holds the bias. One kernel (the bias or the sum is the product's C operand) where the
    convolution, its bias and a sum after it would be three; the weight's (C_in, C_out) view is kept."""
    rows = weight_rows(conv)
    b, n, _ = x.shape
    x, c = x.reshape(b * n, -1), c if c.ndim == 1 else c.reshape(b * n, -1)
    if tiled_fits(x, rows):
        y = tiled_product(x, rows, c) if c.ndim == 1 else tiled_product(x, rows, add=c)
    else:
        y = mx.addmm(c, x, kept(conv, "_w_t", (rows,), lambda r: r.T))
    return y.reshape(b, n, -1)


class CausalBlock1D(nn.Module):
    """Mish(LayerNorm(CausalConv1d_k3(x ⊙ m))) ⊙ m; ``block`` mirrors upstream's Sequential
    (conv, Transpose, LayerNorm, Transpose, Mish), whose parameters sit at 0 and 2."""

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.block = [CausalConv1d(dim, dim_out, 3), None, nn.LayerNorm(dim_out, eps=1e-5)]

    def __call__(self, x: mx.array, m: mx.array | None, add: mx.array | None = None) -> mx.array:
        """``add`` (broadcasting to the output) is added after the mask, in Mish's kernel off the CPU."""
        conv, _, norm = self.block
        return mish(norm(conv(masked(x, m))), m, add)


class CausalResnetBlock1D(nn.Module):
    """Two causal blocks with the time embedding added between them, plus a 1x1 residual conv; the output is
    not re-masked (matcha ``ResnetBlock1D``). The time embedding and the residual conv's bias are added in the
    blocks' Mish kernels, and the residual conv is one product onto the second block's output (``pointwise``):
    three kernels fewer than upstream's order of operations, the same sums up to rounding. Where the tiled
    kernel takes all three products, the blocks' LayerNorms and Mish go inside them too: the first block's into
    the second convolution's reads, the second's into the residual product's sum (three kernels, not seven).
    """

    def __init__(self, dim: int, dim_out: int, time_embed_dim: int):
        super().__init__()
        # Sequential(Mish, Linear), applied by Estimator.time_projections for all resnets at once.
        self.mlp = [None, nn.Linear(time_embed_dim, dim_out)]
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = Conv1d(dim, dim_out, 1)

    def __call__(self, x: mx.array, m: mx.array | None, t_proj: mx.array) -> mx.array:
        """t_proj: (dim_out, B) ``mlp`` of the time embedding, which the estimator computes for all its resnets
        in one product (``Estimator.time_projections``)."""
        (conv1, _, norm1), (conv2, _, norm2) = self.block1.block, self.block2.block
        # The kernel takes conv1 only if its dim_out and 3·dim are multiples of 64: then it takes conv2 and the
        # 1x1 convolution as well (3·dim_out and dim are).
        if tiled_fits(x, conv1.weight):
            b, n, _ = x.shape
            frames = None if m is None else m.reshape(-1)  # the kernel reads masked frames as zeros
            h = tiled_product(x, conv1.weight, conv1.bias, mask=frames)
            h = tiled_product(
                h, conv2.weight, conv2.bias, norm=norm1, norm_mish=True, shift=t_proj, mask=frames
            )
            h = tiled_product(
                x.reshape(b * n, -1),
                weight_rows(self.res_conv),
                self.res_conv.bias,
                add=h.reshape(b * n, -1),
                add_norm=norm2,
                mask=frames,
            )
            return h.reshape(b, n, -1)
        h = self.block1(x, m, t_proj.T[:, None, :])
        h = self.block2(h, m, self.res_conv["bias"])
        return pointwise(self.res_conv, masked(x, m), h)


class Attention(nn.Module):
    """diffusers ``Attention`` as BasicTransformerBlock builds it: self-attention, q/k/v without bias, inner
    width heads x head_dim (512 at full size, not the block's 256), output projection with bias.

    q, k and v are one product against the three weights side by side (kept, built from ``to_q``/``to_k``/
    ``to_v``, which stay the parameters and checkpoint keys): one matmul and one head split instead of three
    (on an H200 a 256 -> 1536 product costs about what one 256 -> 512 does). The fused weight is a copy:
    22M values at full size (44 MB in bf16) besides the parameters."""

    def __init__(self, dim: int, num_heads: int, head_dim: int):
        super().__init__()
        inner = num_heads * head_dim
        self.num_heads, self.head_dim = num_heads, head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = [Linear(inner, dim)]  # to_out.1 is dropout

    def qkv_weight(self) -> mx.array:
        """(3 x inner, dim): [W_q; W_k; W_v], ``stacked`` (the three weights become views of it)."""
        return stacked(self, "_qkv", [self.to_q, self.to_k, self.to_v])

    def __call__(
        self, x: mx.array, b: int, bias: mx.array | None, residual: mx.array, norm: nn.LayerNorm
    ) -> mx.array:
        """x: (B·T, dim) rows of b sequences -> attention over ``norm(x)``, its output projection plus
        ``residual``, (B·T, dim)."""
        n, w = x.shape[0] // b, self.qkv_weight()
        if tiled_fits(x, w):
            qkv = tiled_product(x, w, norm=norm)
        else:
            qkv = norm(x) @ kept(self, "_qkv_t", (w,), lambda w: w.T)
        qkv = qkv.reshape(b, n, 3 * self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        q, k, v = mx.split(qkv, 3, axis=1)  # each (B, H, T, hd)
        out = attention(q, k, v, self.head_dim**-0.5, bias)
        return linear(self.to_out[0], out.transpose(0, 2, 1, 3).reshape(b * n, -1), add=residual)


class GELUProjection(nn.Module):
    """diffusers ``GELU`` (exact erf form) with its input projection."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = Linear(dim, inner)

    def __call__(self, x: mx.array, norm: nn.LayerNorm) -> mx.array:
        return linear(self.proj, x, gelu=True, norm=norm)


class FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.net = [GELUProjection(dim, FF_MULT * dim), None, Linear(FF_MULT * dim, dim)]  # net.1: dropout

    def __call__(self, x: mx.array, residual: mx.array, norm: nn.LayerNorm) -> mx.array:
        """The feed-forward of ``norm(x)`` plus ``residual``."""
        return linear(self.net[2], self.net[0](x, norm), add=residual)


class BasicTransformerBlock(nn.Module):
    """Pre-norm self-attention and GELU feed-forward, no cross-attention (diffusers, as matcha configures it).
    Takes and returns (B·T, dim) rows of b sequences: every op but attention is per frame, and in 2-D the
    products need no reshapes around them."""

    def __init__(self, dim: int, num_heads: int, head_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.attn1 = Attention(dim, num_heads, head_dim)
        self.norm3 = nn.LayerNorm(dim, eps=1e-5)
        self.ff = FeedForward(dim)

    def __call__(self, x: mx.array, b: int, bias: mx.array | None) -> mx.array:
        # The norms are taken inside the products that follow them (the tiled kernel's prologue on CUDA).
        x = self.attn1(x, b, bias, residual=x, norm=self.norm1)
        return self.ff(x, residual=x, norm=self.norm3)


class Estimator(nn.Module):
    """The velocity field v(x, t | mu, spks, cond): upstream ``ConditionalDecoder`` with ``causal=True`` and one
    U-Net level (architecture §4.5). Only the convolutions are causal; attention sees every valid frame."""

    def __init__(self, cfg: CFMConfig):
        super().__init__()
        self.config = cfg
        c, temb = cfg.channels, cfg.time_embed_dim

        def transformers() -> list[BasicTransformerBlock]:
            return [BasicTransformerBlock(c, cfg.num_heads, cfg.head_dim) for _ in range(cfg.n_blocks)]

        self.time_mlp = TimestepEmbedding(cfg.in_channels, temb)
        # With one level the "downsample" and "upsample" are plain causal k3 convs, without stride.
        self.down_blocks = [
            [CausalResnetBlock1D(cfg.in_channels, c, temb), transformers(), CausalConv1d(c, c, 3)]
        ]
        self.mid_blocks = [
            [CausalResnetBlock1D(c, c, temb), transformers()] for _ in range(cfg.num_mid_blocks)
        ]
        self.up_blocks = [[CausalResnetBlock1D(2 * c, c, temb), transformers(), CausalConv1d(c, c, 3)]]
        self.final_block = CausalBlock1D(c, c)
        self.final_proj = Conv1d(c, cfg.out_channels, 1)
        if cfg.meanflow:
            # Mixes [t_emb | r_emb] back to one time embedding (decoder.py; utils/intmeanflow.py, no bias).
            self.time_embed_mixer = Linear(2 * temb, temb, bias=False)

    @property
    def dtype(self) -> mx.Dtype:
        """The weights' float type, which ``solve`` runs the estimator in (float32 unless set lower)."""
        return self.final_proj.weight.dtype

    def __call__(
        self,
        x: mx.array,
        mask: mx.array | None,
        mu: mx.array,
        t: mx.array,
        spks: mx.array,
        cond: mx.array,
        r: mx.array | None = None,
    ) -> mx.array:
        """Velocity at time t (the average velocity over [t, r] for a meanflow estimator).

        x, mu, cond: (B, T, out_channels) current sample, encoder output and prompt condition (mel frames).
        mask: (B, T) bool or 0/1 float, True/1 on valid frames; None when every frame is valid.
        t: (B,) times in [0, 1].
        spks: (B, out_channels) projected speaker embedding, broadcast over time.
        r: (B,) end times in [0, 1]; required by a meanflow estimator, refused by the others.
        Returns (B, T, out_channels), zero on padded frames.
        """
        if self.config.meanflow != (r is not None):
            raise ValueError(
                "a meanflow estimator needs r (the step's end time)"
                if self.config.meanflow
                else "r (the step's end time) applies to meanflow estimators only"
            )
        b, n, _ = x.shape
        if mask is None:
            # Every frame valid (one utterance): multiplying by ones and adding zero biases would change nothing,
            # so neither runs (76 kernels a call fewer), and attention without a mask is a fused kernel on GPUs.
            m, bias = None, None
        else:
            m = mask.astype(x.dtype)[:, :, None]  # (B, T, 1)
            # Key-padding bias (decoder.py: add_optional_chunk_mask + mask_to_bias), the same for every query.
            # Upstream unmasks a row without any valid frame; its output is zeroed either way.
            bias = ((1.0 - (mask != 0).astype(x.dtype)) * MASK_BIAS)[:, None, None, :]  # (B, 1, 1, T)
        if r is None:
            t_emb = self.time_mlp(timestep_embedding(t, self.config.in_channels).astype(x.dtype))
        else:
            # t and r share the time MLP (one call on both), then the mixer makes one embedding (decoder.py).
            both = mx.concatenate([mx.broadcast_to(t, (b,)), mx.broadcast_to(r, (b,))])
            emb = self.time_mlp(timestep_embedding(both, self.config.in_channels).astype(x.dtype))
            t_emb = self.time_embed_mixer(mx.concatenate([emb[:b], emb[b:]], axis=-1))
        t_projs = iter(self.time_projections(t_emb))  # one per stage, in order
        h = mx.concatenate([x, mu, mx.broadcast_to(spks[:, None, :], (b, n, spks.shape[-1])), cond], axis=-1)

        def stage(h: mx.array, resnet: CausalResnetBlock1D, blocks: list[BasicTransformerBlock]) -> mx.array:
            h = resnet(h, m, next(t_projs))
            rows = h.reshape(b * n, -1)  # the blocks work on frames as rows (BasicTransformerBlock)
            for block in blocks:
                rows = block(rows, b, bias)
            return rows.reshape(b, n, -1)

        resnet, blocks, down = self.down_blocks[0]
        skip = stage(h, resnet, blocks)
        h = down(masked(skip, m))
        for resnet, blocks in self.mid_blocks:
            h = stage(h, resnet, blocks)
        resnet, blocks, up = self.up_blocks[0]
        h = stage(mx.concatenate([h, skip], axis=-1), resnet, blocks)
        h = up(masked(h, m))
        h = self.final_block(h, m)
        return masked(pointwise(self.final_proj, masked(h, m), self.final_proj["bias"]), m)

    def time_projections(self, t_emb: mx.array) -> list[mx.array]:
        """Each resnet's ``mlp`` (Mish, Linear) of the (B, temb) time embedding, in call order, as (c, B):
        Mish once and one product of the resnets' weights stacked (kept) with it, instead of 14 products and
        their broadcasts. Channels first, so that each resnet's part is rows of the product (contiguous, as the
        tiled kernel reads it), not a strided slice of every row."""
        lins = [r.mlp[1] for r, *_ in self.down_blocks + self.mid_blocks + self.up_blocks]
        w = stacked(self, "_time_w", lins)
        bias = kept(
            self, "_time_bias", tuple(lin["bias"] for lin in lins), lambda *bs: mx.concatenate(bs)[:, None]
        )
        proj = mx.addmm(bias, w, mish(t_emb).T)  # (14·c, B)
        return mx.split(proj, len(lins), axis=0)

    @staticmethod
    def checkpoint_table(cfg: CFMConfig) -> dict[str, tuple]:
        """Upstream key under ``flow.decoder.estimator.`` -> (our key, expected shape[, layout]). Names are
        unchanged; convolution kernels move to MLX's layout. (``flow.decoder`` holds nothing else: the CFM
        wrapper has no parameters or buffers.)"""
        c, temb, inner, ff = (
            cfg.channels,
            cfg.time_embed_dim,
            cfg.num_heads * cfg.head_dim,
            FF_MULT * cfg.channels,
        )
        shapes: dict[str, tuple] = {
            "time_mlp.linear_1.weight": (temb, cfg.in_channels),
            "time_mlp.linear_1.bias": (temb,),
            "time_mlp.linear_2.weight": (temb, temb),
            "time_mlp.linear_2.bias": (temb,),
        }

        def conv(prefix: str, cin: int, cout: int, k: int) -> None:
            shapes[f"{prefix}.weight"] = (cout, cin, k)
            shapes[f"{prefix}.bias"] = (cout,)

        def causal_block(prefix: str, cin: int, cout: int) -> None:
            conv(f"{prefix}.block.0", cin, cout, 3)
            shapes[f"{prefix}.block.2.weight"] = (cout,)
            shapes[f"{prefix}.block.2.bias"] = (cout,)

        def resnet(prefix: str, cin: int) -> None:
            shapes[f"{prefix}.mlp.1.weight"] = (c, temb)
            shapes[f"{prefix}.mlp.1.bias"] = (c,)
            causal_block(f"{prefix}.block1", cin, c)
            causal_block(f"{prefix}.block2", c, c)
            conv(f"{prefix}.res_conv", cin, c, 1)

        def transformers(prefix: str) -> None:
            for i in range(cfg.n_blocks):
                p = f"{prefix}.{i}"
                for norm in ("norm1", "norm3"):
                    shapes[f"{p}.{norm}.weight"] = (c,)
                    shapes[f"{p}.{norm}.bias"] = (c,)
                for proj in ("to_q", "to_k", "to_v"):
                    shapes[f"{p}.attn1.{proj}.weight"] = (inner, c)
                shapes[f"{p}.attn1.to_out.0.weight"] = (c, inner)
                shapes[f"{p}.attn1.to_out.0.bias"] = (c,)
                shapes[f"{p}.ff.net.0.proj.weight"] = (ff, c)
                shapes[f"{p}.ff.net.0.proj.bias"] = (ff,)
                shapes[f"{p}.ff.net.2.weight"] = (c, ff)
                shapes[f"{p}.ff.net.2.bias"] = (c,)

        resnet("down_blocks.0.0", cfg.in_channels)
        transformers("down_blocks.0.1")
        conv("down_blocks.0.2", c, c, 3)
        for i in range(cfg.num_mid_blocks):
            resnet(f"mid_blocks.{i}.0", c)
            transformers(f"mid_blocks.{i}.1")
        resnet("up_blocks.0.0", 2 * c)
        transformers("up_blocks.0.1")
        conv("up_blocks.0.2", c, c, 3)
        causal_block("final_block", c, c)
        conv("final_proj", c, cfg.out_channels, 1)
        if cfg.meanflow:
            shapes["time_embed_mixer.weight"] = (temb, 2 * temb)
        return {
            key: (key, shape, "conv1d") if len(shape) == 3 else (key, shape) for key, shape in shapes.items()
        }


def _linspace(n_timesteps: int) -> mx.array:
    """(n + 1,) float32 as upstream's fp32 ``torch.linspace(0, 1, n + 1)``."""
    steps = n_timesteps + 1
    k = mx.arange(steps, dtype=mx.float32)
    step = mx.array(1.0, mx.float32) / n_timesteps
    # torch.linspace fills the first half forwards from 0 and the second half backwards from 1.
    return mx.where(k < steps // 2, step * k, 1.0 - step * (n_timesteps - k))


@functools.lru_cache(maxsize=64)
def _linear_times(n_timesteps: int) -> tuple[float, ...]:
    return tuple(_linspace(n_timesteps).tolist())


def linear_schedule(n_timesteps: int) -> mx.array:
    """(n + 1,) float32 times k/n as upstream's fp32 ``torch.linspace(0, 1, n + 1)``: meanflow's schedule
    (flow_matching.py skips the cosine warp when ``meanflow``). Exact at 1 and 2 steps ([0, 1], [0, .5, 1]).
    """
    return mx.array(_linear_times(n_timesteps), dtype=mx.float32)


@functools.lru_cache(maxsize=64)
def _cosine_times(n_timesteps: int) -> tuple[float, ...]:
    lin = _linspace(n_timesteps)
    angles = (lin * 0.5 * math.pi).tolist()
    # MLX's fp32 cos can be 1 ulp off where torch's is correctly rounded: take it in double, round once.
    cos = mx.array([math.cos(a) for a in angles], dtype=mx.float32)
    return tuple((1.0 - cos).tolist())


def cosine_schedule(n_timesteps: int) -> mx.array:
    """(n + 1,) float32 times t_k = 1 - cos(pi/2 · k/n) as upstream's fp32
    ``1 - cos(linspace(0, 1, n + 1) * 0.5 * pi)``, with a correctly rounded cosine: bit-exact with upstream at
    the default 10 steps; at some counts torch's SIMD linspace/cos land 1-2 ulp away."""
    return mx.array(_cosine_times(n_timesteps), dtype=mx.float32)


def solve(
    estimator: Estimator,
    mu: mx.array,
    mask: mx.array | None,
    spks: mx.array,
    cond: mx.array,
    noise: mx.array,
    n_timesteps: int = 10,
    cfg_rate: float = 0.7,
    in_flight: int | None = None,
) -> mx.array:
    """Integrate the flow from ``noise`` at t = 0 to a mel at t = 1 (upstream ``CausalConditionalCFM.forward``
    and ``solve_euler``): ``solve_steps`` run to its end."""
    return drain(solve_steps(estimator, mu, mask, spks, cond, noise, n_timesteps, cfg_rate, in_flight))


def solve_steps(
    estimator: Estimator,
    mu: mx.array,
    mask: mx.array | None,
    spks: mx.array,
    cond: mx.array,
    noise: mx.array,
    n_timesteps: int = 10,
    cfg_rate: float = 0.7,
    in_flight: int | None = None,
) -> Steps[mx.array]:
    """Integrate the flow from ``noise`` at t = 0 to a mel at t = 1 (upstream ``CausalConditionalCFM.forward``
    and ``solve_euler``): Euler steps on the cosine schedule with classifier-free guidance
    v = (1 + w)·v(mu, spks, cond) - w·v(0, 0, 0), both halves in one batch of 2B.

    mu, cond: (B, T, 80); mask: (B, T) bool or 0/1, or None when every frame is valid; spks: (B, 80); noise: (B, T, 80) the initial sample
    (upstream draws ``randn_like(mu)``: N(0, 1) over every frame, the prompt's included).
    Returns (B, T, 80). The result is not re-masked, as upstream. Each step is queued with ``mx.async_eval``:
    building step k + 1 overlaps running step k (20% faster on an H200 than one graph of all steps), with no
    host synchronisation. ``in_flight``: at most this many steps queued ahead of the one still running (step k
    is queued once step k - in_flight - 1 has finished): a bound on what queued steps hold that, unlike MLX's
    process-wide memory limit, holds no other thread back; None: no wait. The numbers do not change. Yields
    once each step is queued (``Steps``).
    """
    if n_timesteps < 1:
        raise ValueError(f"n_timesteps={n_timesteps} must be at least 1")
    if in_flight is not None and (
        isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1
    ):
        raise ValueError(f"in_flight={in_flight!r} must be a number of steps >= 1, or None")
    if estimator.config.meanflow:
        raise ValueError("a meanflow estimator is integrated by solve_meanflow (no guidance, linear times)")
    b = mu.shape[0]
    t_span = cosine_schedule(n_timesteps).astype(noise.dtype)  # solve_euler casts it to the model dtype
    # With cfg_rate 0 the unconditional half's weight is exactly 0: skip it (same result, half the work).
    guided = cfg_rate != 0
    if guided:
        mask = None if mask is None else mx.concatenate([mask, mask], axis=0)
        mu = mx.concatenate([mu, mx.zeros_like(mu)], axis=0)
        spks = mx.concatenate([spks, mx.zeros_like(spks)], axis=0)
        cond = mx.concatenate([cond, mx.zeros_like(cond)], axis=0)
    # A lower-precision estimator gets its inputs in its dtype; the sample x and the Euler sums stay float32.
    low = estimator.dtype
    mu, spks, cond = mu.astype(low), spks.astype(low), cond.astype(low)
    x, queued = noise, []
    for k in range(n_timesteps):
        t, r = t_span[k], t_span[k + 1]
        if in_flight is not None and len(queued) > in_flight:
            mx.eval(queued.pop(0))  # waits for that step: it was queued already
        x_in = (mx.concatenate([x, x], axis=0) if guided else x).astype(low)
        v = estimator(x_in, mask, mu, mx.broadcast_to(t, (x_in.shape[0],)), spks, cond).astype(x.dtype)
        if guided:
            v = (1.0 + cfg_rate) * v[:b] - cfg_rate * v[b:]
        x = x + (r - t) * v
        mx.async_eval(x)
        if in_flight is not None:  # else no reference is kept: x's buffer may be donated to the next step's
            queued.append(x)
        yield
    return x


def solve_meanflow(
    estimator: Estimator,
    mu: mx.array,
    mask: mx.array | None,
    spks: mx.array,
    cond: mx.array,
    noise: mx.array,
    n_timesteps: int = 2,
) -> mx.array:
    """Integrate a meanflow estimator from ``noise`` at t = 0 to a mel at t = 1: ``meanflow_steps`` run to its
    end."""
    return drain(meanflow_steps(estimator, mu, mask, spks, cond, noise, n_timesteps))


def meanflow_steps(
    estimator: Estimator,
    mu: mx.array,
    mask: mx.array | None,
    spks: mx.array,
    cond: mx.array,
    noise: mx.array,
    n_timesteps: int = 2,
) -> Steps[mx.array]:
    """Integrate a meanflow estimator from ``noise`` at t = 0 to a mel at t = 1 (upstream
    ``CausalConditionalCFM.forward(meanflow=True)`` and ``basic_euler``, variants.md §3.2): for each pair
    (t, r) of consecutive times on the linear schedule, x <- x + (r - t)·v(x, t, r); no guidance, one pass per
    step.

    Shapes as ``solve``. ``noise``: (B, T, 80) the whole initial sample. Upstream draws it twice:
    ``randn_like`` over every frame, then its last 2N frames (the new tokens') replaced by
    ``flow_inference``'s own draw; pass both joined along time. Upstream runs batch 1; rows here are
    independent, as in ``solve``. Yields once each step is queued (``Steps``).
    """
    if n_timesteps < 1:
        raise ValueError(f"n_timesteps={n_timesteps} must be at least 1")
    if not estimator.config.meanflow:
        raise ValueError("solve_meanflow needs a meanflow estimator (CFMConfig(meanflow=True)); use solve")
    b = mu.shape[0]
    t_span = linear_schedule(n_timesteps).astype(noise.dtype)
    # As in solve: the estimator runs in its dtype, the sample and the Euler sums stay float32.
    low = estimator.dtype
    mu, spks, cond = mu.astype(low), spks.astype(low), cond.astype(low)
    x = noise
    for k in range(n_timesteps):
        t, r = t_span[k], t_span[k + 1]
        v = estimator(
            x.astype(low), mask, mu, mx.broadcast_to(t, (b,)), spks, cond, r=mx.broadcast_to(r, (b,))
        ).astype(x.dtype)
        x = x + (r - t) * v
        mx.async_eval(x)
        yield
    return x


# --- The estimator's products as one CUDA kernel of ours (issue 25) ---
#
# Products of many rows in half precision, ``x @ weight.T`` or a causal convolution as that product over the
# frames it sees, with a LayerNorm (and Mish, and the time embedding) before and the bias, GELU and a sum (or
# the Mish of a LayerNorm of one) after inside the kernel. The estimator is bound by its host, and MLX hands
# every product to cuBLAS and every convolution to cuDNN: 15-20 µs of host time a call (a matmul descriptor
# and an algorithm query each time, and a stream capture under CUDA graphs; RESULTS, `probe_step --part
# micro`) against 7-10 µs for a kernel of ours. A bf16 call makes 242 products and 31 convolutions, and their
# biases' sums, GELUs, residual sums, the norms and the resnets' Mish around them are 367 kernels more.
#
# The kernel: tiles of 64 x 64 outputs (32 x 64 where 64 rows would leave SMs idle) in 4 warps (2 x 2), and
# for a norm of x 32 x 128 in 8 warps (2 x 4; ``TILED_WIDE_NORMED``; else 32 x 64), tensor cores through PTX's
# mma.sync (m16n8k16, float sums; no header), the next two 64-wide slices of x and the weight loading into
# registers while one is multiplied from shared memory (slices of 32 left the kernel waiting on its loads:
# 2-4x cuBLAS's GPU time, runs AF). Rows past x's end read zeros and write nothing, so any row count runs; the
# weight's rows (N) and columns (K) must be multiples of 64. A causal convolution of x (B, T, C) by a weight
# (N, taps, C) is the product of the weight's rows (N, taps·C) with rows the kernel reads from x as it goes:
# row (b, t) is frames t - taps + 1 .. t of sequence b side by side, zeros before its start (no padded copy of
# x). float32 stays with MLX: a tensor-core product in float32 would be TF32, and the fp32 estimator is
# upstream's numbers. Sums differ from MLX's ops in rounding only: the epilogue works on the float accumulator
# and rounds once, where the composed ops round after each op. Only on CUDA (``layers._use_cuda_paths``);
# every other backend runs the composed ops. Its source also runs on the CPU in the tests
# (tests/emulated_cuda.py), and nvcc builds it there for sm_90a (tests/compiled_cuda.py).

# On since its GPU tests passed on an H200 (51 of them, runs AG) and a lone request's solve ran faster: 2 x 530
# rows 67-84 ms against 132-182, 2 x 1,000 rows 83-100 against 91-145 (runs AF, AG). Without CUDA graphs it
# lost, so the server's vocoding process turns it off when started with MLX_USE_CUDA_GRAPHS=0
# (vocode.use_tiled_products). Benchmarks' "plain" ways turn it off for their A/B.
TILED_PRODUCTS = True

# Below this many rows a product stays with MLX (a matrix-vector product, or cuBLAS for a few rows); above the
# most, too: there the GPU, not the host, bounds a call, and cuBLAS's products took half our kernel's GPU time
# (2 x 1,000 rows, runs AF: where the solve broke even, 87-100 ms against 91-145).
TILED_MIN_ROWS, TILED_MAX_ROWS = 64, 2048

# A tile's rows, 32 or 64; None: by the rule in ``_tiled_launch``. For A/Bs (benchmarks' "ours-tiles-32": 32
# rows everywhere, which made the normed products' rule, run AH).
TILED_TILE_ROWS: int | None = None

# Tiles of 128 columns and 8 warps (not 64 and 4) for the products with a norm of x, where that still gives the
# GPU two blocks an SM: each block finds its rows' statistics and normalizes its x tiles once for twice the
# columns, which were two thirds of q/k/v's instructions (24 column blocks at 1,536 channels; 35 µs against
# cuBLAS's 6.5 plus a LayerNorm's 3.9, run AJ's Nsight Compute). On since its GPU tests passed on an H100 and
# S3Gen.batch's kernels took 3.6 ms a call less on an H200 (run AL) and 4.3-4.9 less on an H100 (run AN), with
# no loss in a stream's first audio or text -> wav. Off: the benchmarks' "ours-narrow-normed" A/B.
TILED_WIDE_NORMED = True

_TILE_N, _TILE_K = 64, 64

# T, N, K, TAPS (1: a product of x's rows), BM and BN (the tile's rows and columns: 64, or 32 by
# ``_tiled_launch``'s rule) come as template constants, x's rows and frames from its shape (2-D for a product,
# (B, T, C) for a convolution); the epilogue is put in by ``_tiled_kernel``.
_TILED_SOURCE = """
  constexpr int BK = 64;
  // Warps in 2 rows of WN; a warp's 16-row and 8-column fragments: its tile is BM / 2 x BN / WN.
  constexpr int THREADS = 64 * WN, FM = BM / 32, FN = BN / WN / 8;
  // A shared row of the x and weight tiles, in elements: 144 bytes, so that the 8 rows a fragment load reads
  // at once fall in distinct banks (word 36·g + tg for row g, pair tg: bank 4·g + tg).
  constexpr int LDS = BK + 8;
  constexpr int TILES = K / BK;
  // 16-byte pieces a tile's row holds, and a thread moves of x's tile and of the weight's.
  constexpr int SEGS = BK / 8, XP = BM * SEGS / THREADS, WP = BN * SEGS / THREADS;
  static_assert(XP * THREADS == BM * SEGS && WP * THREADS == BN * SEGS, "whole pieces a thread");
  // Two buffers of the x and weight tiles: 36,864 bytes at BM 64.
  __shared__ __align__(128) T xs[2 * BM * LDS];
  __shared__ __align__(128) T ws[2 * BN * LDS];

  constexpr int C = K / TAPS;  // x's channels
  const int M = TAPS == 1 ? x_shape[0] : x_shape[0] * x_shape[1];
  const int FRAMES = TAPS == 1 ? 1 : x_shape[1];
  const int tid = threadIdx.x;
  // Mish, y·tanh(log(1 + e^y)), as y·n / (n + 2) with n = e^y (e^y + 2): one exponential and a fast division
  // instead of tanhf, log1pf and expf, which were most of a resnet kernel's instructions (a frame goes through
  // its norm and Mish again for each of its taps and each 64 output channels). Past 15 the ratio is 1 in
  // float, and n would overflow past 44.
  auto mish = [](float y) {
    const float e = expf(y), n = e * (e + 2.0f);
    return y > 15.0f ? y : y * __fdividef(n, n + 2.0f);
  };
  const int warp_m = (tid >> 5) / WN, warp_n = (tid >> 5) % WN;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;

  // Each thread moves XP 16-byte pieces of x's tile and WP of the weight's: piece p is row p / SEGS, columns
  // (p % SEGS) * 8 on. Column k of row m is x's element (m, k), or for a convolution channel k % C of tap k / C:
  // frame m - TAPS + 1 + k / C, zero before its sequence's first (C is a multiple of 8: a piece is in one tap).
  // Two register sets take turns: the slice two ahead is loaded while this one is multiplied (2 in flight).
  uint4 xr0[XP], wr0[WP], xr1[XP], wr1[WP];
  // Whether row m reads the frame `back` frames before it (else zeros): one of its own sequence.
  auto reads = [&](int m, int back) { return m < M && (TAPS == 1 || m % FRAMES >= back)/* mask */; };
  auto fetch = [&](int k0, uint4 (&xr)[XP], uint4 (&wr)[WP]) {
    #pragma unroll
    for (int i = 0; i < XP; ++i) {
      const int p = tid + i * THREADS, r = p / SEGS, c = p % SEGS * 8;
      const int m = m0 + r, back = TAPS - 1 - (k0 + c) / C;
      xr[i] = reads(m, back) ? *reinterpret_cast<const uint4*>(x + (size_t)(m - back) * C + (k0 + c) % C)
                             : make_uint4(0, 0, 0, 0);
    }
    #pragma unroll
    for (int i = 0; i < WP; ++i) {
      const int p = tid + i * THREADS, r = p / SEGS, c = p % SEGS * 8;
      wr[i] = *reinterpret_cast<const uint4*>(w + (size_t)(n0 + r) * K + k0 + c);
    }
  };
  // statistics' arrays
  auto stash = [&](int buf, int k0, uint4 (&xr)[XP], uint4 (&wr)[WP]) {
    // slice
    #pragma unroll
    for (int i = 0; i < XP; ++i) {
      const int p = tid + i * THREADS, r = p / SEGS, c = p % SEGS * 8;
      // normalize
      *reinterpret_cast<uint4*>(xs + (buf * BM + r) * LDS + c) = xr[i];
    }
    #pragma unroll
    for (int i = 0; i < WP; ++i) {
      const int p = tid + i * THREADS, r = p / SEGS, c = p % SEGS * 8;
      *reinterpret_cast<uint4*>(ws + (buf * BN + r) * LDS + c) = wr[i];
    }
  };

  // mma.sync m16n8k16 (PTX ISA, "matrix fragments for mma.m16n8k16"): lane = 4·g + tg holds of x's 16 x 16
  // fragment the pairs at (g, 2tg), (g + 8, 2tg), (g, 2tg + 8), (g + 8, 2tg + 8), of the weight's 16 x 8 those
  // at (k = 2tg, n = g) and (2tg + 8, g), and of the 16 x 8 float sum (g, 2tg), (g, 2tg + 1), (g + 8, 2tg),
  // (g + 8, 2tg + 1). A pair of 16-bit values is one 32-bit word, its lower column in the low half.
  const int g = (tid & 31) >> 2, tg = tid & 3;
  float acc[FM][FN][4];
  #pragma unroll
  for (int i = 0; i < FM; ++i)
    #pragma unroll
    for (int j = 0; j < FN; ++j)
      #pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;
  auto pair = [](const T* p) { return *reinterpret_cast<const unsigned*>(p); };

  // x's slice in shared buffer buf times the weight's, into acc.
  auto multiply = [&](int buf) {
    #pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned a[FM][4], b[FN][2];
      #pragma unroll
      for (int i = 0; i < FM; ++i) {
        const T* row = xs + (buf * BM + warp_m * (BM / 2) + i * 16 + g) * LDS + kk + 2 * tg;
        a[i][0] = pair(row);
        a[i][1] = pair(row + 8 * LDS);
        a[i][2] = pair(row + 8);
        a[i][3] = pair(row + 8 * LDS + 8);
      }
      #pragma unroll
      for (int j = 0; j < FN; ++j) {
        const T* col = ws + (buf * BN + warp_n * (BN / WN) + j * 8 + g) * LDS + kk + 2 * tg;
        b[j][0] = pair(col);
        b[j][1] = pair(col + 8);
      }
      #pragma unroll
      for (int i = 0; i < FM; ++i)
        #pragma unroll
        for (int j = 0; j < FN; ++j) {
          float* d = acc[i][j];
          asm volatile(
              "mma.sync.aligned.m16n8k16.row.col.f32.MMA_TYPE.MMA_TYPE.f32 "
              "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"
              : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
              : "r"(a[i][0]), "r"(a[i][1]), "r"(a[i][2]), "r"(a[i][3]), "r"(b[j][0]), "r"(b[j][1]));
        }
    }
  };

  // Slice s is multiplied from buffer s % 2 and loaded into register set s % 2 two slices before. A buffer
  // is written (stash) only after the barrier that ends the slice which last read it.
  // The first two slices' loads are in flight while the row statistics (where asked) are found.
  fetch(0, xr0, wr0);
  if (TILES > 1) fetch(BK, xr1, wr1);
  // statistics
  stash(0, 0, xr0, wr0);
  __syncthreads();
  for (int s = 0; s < TILES; s += 2) {
    if (s + 2 < TILES) fetch((s + 2) * BK, xr0, wr0);
    multiply(0);
    if (s + 1 < TILES) stash(1, (s + 1) * BK, xr1, wr1);
    __syncthreads();
    if (s + 1 == TILES) break;
    if (s + 3 < TILES) fetch((s + 3) * BK, xr1, wr1);
    multiply(1);
    if (s + 2 < TILES) stash(0, (s + 2) * BK, xr0, wr0);
    __syncthreads();
  }

  // Each sum goes out from the lane that holds it, through the epilogue, rounded to T once.
  #pragma unroll
  for (int i = 0; i < FM; ++i)
    #pragma unroll
    for (int j = 0; j < FN; ++j)
      #pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int m = m0 + warp_m * (BM / 2) + i * 16 + g + (q >> 1) * 8;
        const int c = warp_n * (BN / WN) + j * 8 + 2 * tg + (q & 1);  // the column within the tile
        if (m < M) {
          const size_t at = (size_t)m * N + n0 + c;
          float y = acc[i][j][q];
          // epilogue
          out[at] = static_cast<T>(y);
        }
      }
"""

# LayerNorms inside the kernel, each row's mean and 1/std found first (rows outside x's never read): ``norm``'s
# of x's frames FIRST = m0 - TAPS + 1 on (a convolution reads TAPS - 1 frames before its tile's), and
# ``add_norm``'s of add's rows. A warp takes four rows at once, each lane 8 columns of each at a time (one
# 16-byte load), all their loads in flight together; two passes over the values held in registers. (A warp a
# row, lane j loading columns j, j + 32, ..., took about as long: the q/k/v product with norm1 at 2,000 rows
# 45 µs that way, 47 this, runs AF and AG, against 12 for a plain product of K 1,024: the normed products'
# time is not in these loads.) The epsilon is put in as a literal. The arrays are declared before ``stash``,
# which reads them; they are filled while the first two slices load.
_TILED_ROW_ARRAYS = string.Template("__shared__ float ${name}_mean[$rows], ${name}_rstd[$rows];")
_TILED_ROW_STATS = string.Template("""
  {
    constexpr int PIECES = ($width / 8 + 31) / 32;  // a lane's 8-column pieces of a row
    const int lane = tid & 31;
    for (int r0 = (tid >> 5) * 4; r0 < $rows; r0 += THREADS / 8) {
      float v[4][PIECES * 8];
      #pragma unroll
      for (int h = 0; h < 4; ++h) {
        const int row = $first + r0 + h;
        const bool inside = r0 + h < $rows && row >= 0 && row < M;
        #pragma unroll
        for (int j = 0; j < PIECES; ++j) {
          const int piece = lane + 32 * j;
          uint4 u = make_uint4(0, 0, 0, 0);
          if (inside && piece < $width / 8)
            u = *reinterpret_cast<const uint4*>(${name} + (size_t)row * $width + piece * 8);
          const T* e = reinterpret_cast<const T*>(&u);
          #pragma unroll
          for (int q = 0; q < 8; ++q) v[h][j * 8 + q] = static_cast<float>(e[q]);
        }
      }
      #pragma unroll
      for (int h = 0; h < 4; ++h) {
        float sum = 0.0f;
        #pragma unroll
        for (int q = 0; q < PIECES * 8; ++q) sum += v[h][q];
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        const float mean = sum / $width;
        float squares = 0.0f;
        #pragma unroll
        for (int j = 0; j < PIECES; ++j)
          #pragma unroll
          for (int q = 0; q < 8; ++q) {
            const float d = lane + 32 * j < $width / 8 ? v[h][j * 8 + q] - mean : 0.0f;
            squares += d * d;
          }
        for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, o);
        if (lane == 0 && r0 + h < $rows) {
          ${name}_mean[r0 + h] = mean;
          ${name}_rstd[r0 + h] = rsqrtf(squares / $width + $eps);
        }
      }
    }
  }""")
# A thread's pieces of a slice are all of the same 8 columns (THREADS, a multiple of the SEGS pieces of a row):
# their tap, channels, and the norm's gain and offset there (16 bytes each) once a slice, not once a value.
_TILED_NORM_SLICE = """static_assert(THREADS % SEGS == 0, "a thread's pieces share their columns");
    const int tap = (k0 + tid % SEGS * 8) / C, channel = (k0 + tid % SEGS * 8) % C;
    float gain[8], offset[8];
    {
      const uint4 gains = *reinterpret_cast<const uint4*>(norm_w + channel);
      const uint4 offsets = *reinterpret_cast<const uint4*>(norm_b + channel);
      #pragma unroll
      for (int q = 0; q < 8; ++q) {
        gain[q] = static_cast<float>(reinterpret_cast<const T*>(&gains)[q]);
        offset[q] = static_cast<float>(reinterpret_cast<const T*>(&offsets)[q]);
      }
    }"""
# Each piece of x that is read is normalized, scaled and shifted, and goes into shared memory rounded to T, as
# MLX's LayerNorm rounds its output; where Mish and the time embedding's row of the piece's sequence follow
# (`// then`), they start from that rounded value, and round again.
_TILED_NORM_PIECE = """{
        if (reads(m0 + r, TAPS - 1 - tap)) {
          T* e = reinterpret_cast<T*>(&xr[i]);
          const float mean = x_mean[r + tap], rstd = x_rstd[r + tap];
          #pragma unroll
          for (int q = 0; q < 8; ++q) {
            float y = (static_cast<float>(e[q]) - mean) * rstd * gain[q] + offset[q];
            // then
            e[q] = static_cast<T>(y);
          }
        }
      }"""
_TILED_NORM_THEN = {
    "mish": "y = mish(y);",
    "shift": "y += static_cast<float>(shift[(channel + q) * shift_shape[1] + (m0 + r) / FRAMES]);",
}

_TILED_EPILOGUE = {
    "bias": "y += static_cast<float>(bias[n0 + c]);",
    "gelu": "y = 0.5f * y * (1.0f + erff(y * 0.7071067811865476f));",
    "add": "y += static_cast<float>(add[at]);",
}
# The sum through ``add_norm`` (rounded to T, as MLX's LayerNorm rounds) and Mish; rows that ``mask`` leaves
# out take none of it (`/* kept */`).
_TILED_ADD_NORM = """if (true/* kept */) {
            const float gain = static_cast<float>(add_norm_w[n0 + c]);
            const float offset = static_cast<float>(add_norm_b[n0 + c]);
            const float a = (static_cast<float>(add[at]) - add_mean[m - m0]) * add_rstd[m - m0] * gain + offset;
            y += mish(static_cast<float>(static_cast<T>(a)));
          }"""

_tiled_kernels: dict[tuple, object] = {}
_tiled_launches: dict[tuple, tuple[object, dict]] = {}
_tiled_fitting: dict[tuple, bool] = {}


def tiled_fits(x: mx.array, weight: mx.array) -> bool:
    """Whether ``tiled_product`` runs x (M, K) against weight (N, K), or the causal convolution of x (B, T, C) by
    weight (N, taps, C), as our kernel here."""
    if not (TILED_PRODUCTS and layers._use_cuda_paths()):
        return False
    key = (x.shape, x.dtype, weight.shape, weight.dtype)
    fits = _tiled_fitting.get(key)
    if fits is None:
        n, c, k = weight.shape[0], weight.shape[-1], weight.size // weight.shape[0]
        fits = _tiled_fitting[key] = (
            x.dtype in (mx.bfloat16, mx.float16)
            and weight.dtype == x.dtype
            and x.ndim == weight.ndim in (2, 3)
            and x.shape[-1] == c
            and n % _TILE_N == 0
            and k % _TILE_K == 0
            and c % 8 == 0
        )
    return fits and TILED_MIN_ROWS <= x.size // x.shape[-1] <= TILED_MAX_ROWS


def tiled_product(
    x: mx.array,
    weight: mx.array,
    bias: mx.array | None = None,
    *,
    norm: nn.LayerNorm | None = None,
    norm_mish: bool = False,
    shift: mx.array | None = None,
    gelu: bool = False,
    add: mx.array | None = None,
    add_norm: nn.LayerNorm | None = None,
    mask: mx.array | None = None,
) -> mx.array:
    """``norm(x) @ weight.T`` (+ bias) (then the exact GELU) (+ add), as one kernel; the caller asks
    ``tiled_fits`` first. x (M, K) and weight (N, K) (a ``Linear``'s), or the causal convolution of x (B, T, C)
    by weight (N, taps, C) (a ``Conv1d``'s: stride 1, no dilation), then x's shape with N channels; bias (N,),
    add as the output.

    ``norm``: an affine LayerNorm over x's channels, applied to each frame as it is read;
    then Mish (``norm_mish``) and plus ``shift`` (C, B), the column of the frame's sequence (a resnet's time
    embedding). ``add_norm``: an affine LayerNorm over add's N channels, then Mish, before the sum. ``mask``
    (B·T,) 0/1 over x's frames (the output's rows; a resnet's padded frames): a frame at 0 is read as zeros, and
    ``add_norm``'s sum leaves its row out."""
    # Everything the kernel, its template and grid depend on: worked out and checked once for each (a call
    # builds 269 of these, and the estimator is bound by its host).
    signature = (
        x.shape,
        x.dtype,
        weight.shape,
        bias is not None,
        gelu,
        None if add is None else add.shape,
        None if norm is None else (norm.eps, "weight" in norm and "bias" in norm),
        norm_mish,
        None if shift is None else shift.shape,
        None if add_norm is None else (add_norm.eps, "weight" in add_norm and "bias" in add_norm),
        None if mask is None else mask.shape,
        TILED_TILE_ROWS,
        TILED_WIDE_NORMED,
    )
    launch = _tiled_launches.get(signature)
    if launch is None:
        launch = _tiled_launches[signature] = _tiled_launch(*signature)
    inputs = [x, weight]
    if norm is not None:
        inputs += [norm.weight, norm.bias]
    inputs += [a for a in (shift, bias, add) if a is not None]
    if add_norm is not None:
        inputs += [add_norm.weight, add_norm.bias]
    if mask is not None:
        inputs.append(mask)
    kernel, options = launch
    return kernel(inputs=inputs, **options)[0]


def _tiled_launch(
    x_shape,
    dtype,
    w_shape,
    bias,
    gelu,
    add_shape,
    norm,
    norm_mish,
    shift_shape,
    add_norm,
    mask_shape,
    tile_rows,
    wide,
):
    """The kernel and call options of ``tiled_product`` for a signature (norms as (eps, affine)), once its
    arguments are checked."""
    n, taps = w_shape[0], w_shape[1] if len(w_shape) == 3 else 1
    c, shape = x_shape[-1], (*x_shape[:-1], n)
    rows = math.prod(x_shape) // c
    if add_shape is not None and add_shape != shape:
        raise ValueError(f"add has shape {add_shape}: the product's is {shape}")
    for name, layer in (("norm", norm), ("add_norm", add_norm)):
        if layer is not None and not layer[1]:
            raise ValueError(f"{name}: an affine LayerNorm")
    if norm is None and (norm_mish or shift_shape is not None):
        raise ValueError("norm_mish and shift follow a norm of x")
    if shift_shape is not None and (taps == 1 or shift_shape != (c, x_shape[0])):
        raise ValueError(f"shift: (channels, sequences) = {(c, x_shape[0])} of a convolution's x")
    if add_norm is not None and add_shape is None:
        raise ValueError("add_norm takes add")
    if mask_shape is not None and mask_shape != (rows,):
        raise ValueError(f"mask has shape {mask_shape}: one value a frame of x, ({rows},)")
    if tile_rows not in (None, 32, 64):
        raise ValueError(f"TILED_TILE_ROWS = {tile_rows}: 32, 64 or None")
    options = (norm_mish, shift_shape is not None, mask_shape is not None)
    key = (dtype, bias, gelu, add_shape is not None, *options) + tuple(
        None if layer is None else layer[0] for layer in (norm, add_norm)
    )
    if key not in _tiled_kernels:
        _tiled_kernels[key] = _tiled_kernel(*key)
    # Tiles of 64 rows, or of 32 where those would give the GPU under two blocks an SM (the products onto 256
    # channels: one block of 4 warps an SM waits on each k-tile's loads), and for a norm of x: there 64 rows
    # took 168 registers a thread and so two blocks an SM, 32 rows 124-130 and four (q/k/v with norm1 at 2,000
    # rows 45 -> 37 µs, the feed-forward's first product 32 -> 25, run AH). Tiles of 32 columns where blocks
    # are few cost more than they won (run AL: the products onto 256 channels 3.1 ms slower a call in all).
    sms = layers._sm_count()
    few = -(-rows // 64) * (n // _TILE_N) < 2 * sms
    bm = tile_rows or (32 if norm is not None or few else 64)
    bn, wn = _TILE_N, 2
    # Wide tiles hold 46 KB of shared memory at 32 rows (the static limit is 48).
    if wide and norm is not None and bm == 32 and n % 128 == 0 and -(-rows // 32) * (n // 128) >= 2 * sms:
        bn, wn = 128, 4
    return _tiled_kernels[key], dict(
        template=[
            ("T", dtype),
            ("N", n),
            ("K", math.prod(w_shape) // n),
            ("TAPS", taps),
            ("BM", bm),
            ("BN", bn),
            ("WN", wn),
        ],
        grid=(n // bn * 64 * wn, -(-rows // bm), 1),
        threadgroup=(64 * wn, 1, 1),
        output_shapes=[shape],
        output_dtypes=[dtype],
    )


def _tiled_kernel(dtype, bias, gelu, add, norm_mish, shift, mask, norm_eps, add_norm_eps) -> object:
    """The kernel for ``_tiled_launch``'s key: its source put together from the pieces above, with inputs
    named (and ordered) as ``tiled_product`` passes them."""
    flags, norm, add_norm = (bias, gelu, add), norm_eps is not None, add_norm_eps is not None
    parts = [part for part, on in zip(_TILED_EPILOGUE, flags) if on]
    epilogue = [_TILED_EPILOGUE[part] for part in parts]
    if add_norm:
        epilogue[-1] = _TILED_ADD_NORM
    source = _TILED_SOURCE.replace("// epilogue", "\n          ".join(epilogue))
    source = source.replace("MMA_TYPE", "bf16" if dtype == mx.bfloat16 else "f16")
    stats = []
    if norm:
        then = [_TILED_NORM_THEN[part] for part, on in (("mish", norm_mish), ("shift", shift)) if on]
        then = ["y = static_cast<float>(static_cast<T>(y));"] * bool(then) + then
        piece = _TILED_NORM_PIECE.replace("// then", "\n            ".join(then))
        source = source.replace("// normalize", piece).replace("// slice", _TILED_NORM_SLICE)
        eps = layers._float_literal(norm_eps)
        stats.append(dict(name="x", rows="BM + TAPS - 1", first="m0 - TAPS + 1", width="C", eps=eps))
    if add_norm:
        eps = layers._float_literal(add_norm_eps)
        stats.append(dict(name="add", rows="BM", first="m0", width="N", eps=eps))
    if stats:
        arrays = "\n  ".join(_TILED_ROW_ARRAYS.substitute(part) for part in stats)
        source = source.replace("// statistics' arrays", arrays)
        found = "".join(_TILED_ROW_STATS.substitute(part) for part in stats)
        source = source.replace("// statistics", found + "\n  __syncthreads();")
    if mask:
        source = source.replace("/* mask */", " && static_cast<float>(mask[m - back]) != 0.0f")
        source = source.replace("true/* kept */", "static_cast<float>(mask[m]) != 0.0f")
    names = ["x", "w"] + ["norm_w", "norm_b"] * norm + ["shift"] * shift
    names += [p for p in parts if p != "gelu"] + ["add_norm_w", "add_norm_b"] * add_norm
    names += ["mask"] * mask
    label = ["tiled_product", "norm" * norm, "mish" * norm_mish, "shift" * shift]
    label += parts + ["norm" * add_norm, "mask" * mask]
    return layers.cuda_kernel("_".join(filter(None, label)), names, ["out"], source)
