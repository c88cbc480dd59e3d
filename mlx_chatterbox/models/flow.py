"""The S3Gen flow front: speech tokens -> mel-space ``mu`` for the CFM, and the x-vector -> speaker vector.

Mirrors the parts of upstream ``chatterbox/models/s3gen/flow.py: CausalMaskedDiffWithXvec`` (0.1.7) that come
before the decoder: the token embedding, the ``UpsampleConformerEncoder`` (``transformer/upsample_encoder.py``,
ESPnet relative-position attention), ``encoder_proj`` and ``spk_embed_affine_layer``; architecture §4.2, §4.3.
Attribute paths follow the ``flow.*`` checkpoint keys (without the ``flow.`` prefix and the ``decoder.*`` CFM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from .layers import Conv1d


@dataclass(frozen=True)
class FlowConfig:
    """Sizes of the flow front; the defaults are upstream's (``S3Token2Mel.__init__`` and
    ``CausalMaskedDiffWithXvec`` defaults). The LayerNorm epsilons are fixed facts of the architecture."""

    vocab_size: int = 6561
    # token embedding = encoder input = attention width (upstream's input_size and encoder output_size)
    hidden_size: int = 512
    num_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    pre_lookahead_len: int = 3
    upsample_stride: int = 2  # also upstream's token_mel_ratio: two mel frames per token
    spk_embed_dim: int = 192
    mel_dim: int = 80

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        if self.hidden_size % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must be even (sin/cos position pairs)")


# --- masks and positions ---


def length_mask(lengths: mx.array, length: int) -> mx.array:
    """(B, T) bool, True on the first ``lengths[b]`` frames of each row."""
    return mx.arange(length, dtype=mx.int32)[None, :] < lengths.astype(mx.int32)[:, None]


def key_padding_mask(lengths: mx.array, length: int) -> mx.array:
    """The encoder's (B, T) mask: ``length_mask``, except that a row of length 0 is all True. Upstream's
    ``add_optional_chunk_mask`` forces such rows on in place, and the mask it returns aliases that tensor."""
    return length_mask(lengths, length) | (lengths.astype(mx.int32)[:, None] == 0)


@lru_cache(maxsize=8)
def _inverse_timescales(dim: int) -> mx.array:
    # The exponent is the fp32 product, as in torch (``embedding.py: extend_pe``); exp is taken in float64 and
    # rounded once: MLX's fp32 exp is 1 ulp off in most entries (torch's in a few), and the ulp is multiplied
    # by the position in the table.
    exponents = (mx.arange(0, dim, 2, dtype=mx.float32) * -(math.log(10000.0) / dim)).tolist()
    return mx.array([math.exp(e) for e in exponents], dtype=mx.float32)


def rel_position_encoding(length: int, dim: int) -> mx.array:
    """ESPnet relative position table (2T - 1, dim), fp32: row n encodes relative position r = T - 1 - n as
    [sin(r·w_0), cos(r·w_0), sin(r·w_1), ...], w_k = 10000^(-2k/dim). The rows that upstream's
    ``EspnetRelPositionalEncoding`` slices from its 5000-position table, up to the rounding of a few w_k."""
    positions = mx.arange(length - 1, -length, -1, dtype=mx.int32).astype(mx.float32)
    angles = positions[:, None] * _inverse_timescales(dim)[None, :]  # (2T-1, dim/2)
    return mx.stack([mx.sin(angles), mx.cos(angles)], axis=-1).reshape(2 * length - 1, dim)


def rel_shift(x: mx.array) -> mx.array:
    """(B, H, T, 2T - 1) scores against relative positions T-1 .. -(T-1) -> (B, H, T, T) with
    out[i, j] = x[i, T - 1 - i + j], i.e. query i against key j at relative position i - j. Same pad-and-reshape
    as upstream ``RelPositionMultiHeadedAttention.rel_shift``, so the result is exact."""
    b, h, t, n = x.shape
    x = mx.pad(x, [(0, 0), (0, 0), (0, 0), (1, 0)])  # (B, H, T, 2T)
    x = x.reshape(b, h, n + 1, t)[:, :, 1:]  # (B, H, 2T-1, T)
    return x.reshape(b, h, t, n)[..., :t]


# --- blocks ---


class LinearEmbed(nn.Module):
    """Upstream ``LinearNoSubsampling`` with ``EspnetRelPositionalEncoding``: Linear -> LayerNorm(1e-5) -> ·√d.
    The positions do not enter x; the encoder builds them separately."""

    def __init__(self, dim: int):
        super().__init__()
        self.out = [nn.Linear(dim, dim), nn.LayerNorm(dim, eps=1e-5)]  # out.2 is a parameterless Dropout
        self.scale = math.sqrt(dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.out[1](self.out[0](x)) * self.scale


class PreLookaheadLayer(nn.Module):
    """x + conv2(leaky_relu(conv1(x right-padded by L zeros), 0.01) left-padded by 2 zeros). Not masked: in a
    padded batch, a short row's last L frames look at the padded frames, exactly as upstream does."""

    def __init__(self, dim: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = Conv1d(dim, dim, kernel_size=lookahead + 1)
        self.conv2 = Conv1d(dim, dim, kernel_size=3)

    def __call__(self, x: mx.array) -> mx.array:
        y = nn.leaky_relu(self.conv1.padded(x, 0, self.lookahead), negative_slope=0.01)
        return x + self.conv2.padded(y, 2, 0)


class Upsample1D(nn.Module):
    """Nearest-neighbour ×stride in time, left-pad 2·stride zeros, Conv1d(k = 2·stride + 1): causal, so valid
    frames never see padded ones."""

    def __init__(self, dim: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = Conv1d(dim, dim, kernel_size=2 * stride + 1)

    def __call__(self, x: mx.array) -> mx.array:
        return self.conv.padded(mx.repeat(x, self.stride, axis=1), 2 * self.stride, 0)


class RelPositionAttention(nn.Module):
    """Upstream ``RelPositionMultiHeadedAttention`` (Transformer-XL scores with ESPnet positions):
    softmax(((q + u)·kᵀ + rel_shift((q + v)·pᵀ)) / √d_k + key padding)·v."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = mx.zeros((heads, self.head_dim))
        self.pos_bias_v = mx.zeros((heads, self.head_dim))

    def __call__(self, x: mx.array, pos_emb: mx.array, key_bias: mx.array) -> mx.array:
        """x: (B, T, D); pos_emb: (2T - 1, D); key_bias: (B, 1, 1, T) additive, 0 or -inf."""
        b, t, d = x.shape
        h, hd = self.heads, self.head_dim
        q = self.linear_q(x).reshape(b, t, h, hd)
        k = self.linear_k(x).reshape(b, t, h, hd).transpose(0, 2, 1, 3)  # (B, H, T, hd)
        v = self.linear_v(x).reshape(b, t, h, hd).transpose(0, 2, 1, 3)
        p = self.linear_pos(pos_emb).reshape(1, -1, h, hd).transpose(0, 2, 3, 1)  # (1, H, hd, 2T-1)
        q_u = (q + self.pos_bias_u).transpose(0, 2, 1, 3)  # (B, H, T, hd)
        q_v = (q + self.pos_bias_v).transpose(0, 2, 1, 3)
        scale = hd**-0.5
        # The position term rides in the additive mask; -inf keys get probability exactly 0, as upstream's
        # masked_fill before and after the softmax.
        bias = rel_shift(q_v @ p) * scale + key_bias  # (B, H, T, T)
        out = mx.fast.scaled_dot_product_attention(q_u, k, v, scale=scale, mask=bias)
        return self.linear_out(out.transpose(0, 2, 1, 3).reshape(b, t, d))


class PositionwiseFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w_2(nn.silu(self.w_1(x)))


class ConformerEncoderLayer(nn.Module):
    """Pre-norm block without macaron FF or conv module (upstream ``ConformerEncoderLayer`` as S3Gen builds it);
    both LayerNorms use eps 1e-12 (architecture §9.11)."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = RelPositionAttention(d, cfg.num_heads)
        self.feed_forward = PositionwiseFeedForward(d, cfg.linear_units)
        self.norm_mha = nn.LayerNorm(d, eps=1e-12)
        self.norm_ff = nn.LayerNorm(d, eps=1e-12)

    def __call__(self, x: mx.array, pos_emb: mx.array, key_bias: mx.array) -> mx.array:
        x = x + self.self_attn(self.norm_mha(x), pos_emb, key_bias)
        return x + self.feed_forward(self.norm_ff(x))


class UpsampleConformerEncoder(nn.Module):
    """embed -> pre-lookahead -> blocks -> ×stride upsample -> up_embed -> up blocks -> after_norm. Attention is
    full (static_chunk_size 0) apart from key padding (architecture §4.3, §9.1)."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        d = cfg.hidden_size
        self.embed = LinearEmbed(d)
        self.pre_lookahead_layer = PreLookaheadLayer(d, cfg.pre_lookahead_len)
        self.encoders = [ConformerEncoderLayer(cfg) for _ in range(cfg.num_blocks)]
        self.up_layer = Upsample1D(d, cfg.upsample_stride)
        self.up_embed = LinearEmbed(d)
        self.up_encoders = [ConformerEncoderLayer(cfg) for _ in range(cfg.num_up_blocks)]
        self.after_norm = nn.LayerNorm(d, eps=1e-5)

    @staticmethod
    def _stack(blocks: list, x: mx.array, valid: mx.array) -> mx.array:
        pos_emb = rel_position_encoding(x.shape[1], x.shape[2]).astype(x.dtype)
        key_bias = mx.where(valid, 0.0, -mx.inf).astype(x.dtype)[:, None, None, :]  # (B, 1, 1, T)
        for block in blocks:
            x = block(x, pos_emb, key_bias)
        return x

    def __call__(
        self, x: mx.array, lengths: mx.array, *, isolate_rows: bool = False
    ) -> tuple[mx.array, mx.array]:
        """x: (B, N, D) masked token embeddings; lengths: (B,) valid tokens per row.
        Returns h (B, stride·N, D) after after_norm, and its (B, stride·N) bool mask (True = valid).
        ``isolate_rows``: zero the padded frames before the pre-lookahead conv, so that each row's valid
        frames equal its batch-of-one result (upstream's padded batch lets them read LN(bias)·√d there)."""
        stride = self.up_layer.stride
        x = self.embed(x)
        if isolate_rows:
            x = x * length_mask(lengths, x.shape[1])[..., None].astype(x.dtype)
        x = self.pre_lookahead_layer(x)
        x = self._stack(self.encoders, x, key_padding_mask(lengths, x.shape[1]))
        x = self.up_embed(self.up_layer(x))
        valid = key_padding_mask(lengths * stride, x.shape[1])
        x = self._stack(self.up_encoders, x, valid)
        return self.after_norm(x), valid


# --- the model ---


class Flow(nn.Module):
    """The flow front of S3Gen; the CFM decoder (``flow.decoder.*``) is ``models/cfm.py``."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        self.config = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.mel_dim)
        self.encoder = UpsampleConformerEncoder(cfg)
        self.encoder_proj = nn.Linear(cfg.hidden_size, cfg.mel_dim)

    def embed_speaker(self, xvector: mx.array) -> mx.array:
        """CAMPPlus x-vector (B, spk_embed_dim) -> speaker vector (B, mel_dim): L2-normalised (F.normalize,
        eps 1e-12), then the affine layer."""
        norm = mx.sqrt(mx.sum(xvector * xvector, axis=-1, keepdims=True))
        return self.spk_embed_affine_layer(xvector / mx.maximum(norm, 1e-12))

    def embed_tokens(self, tokens: mx.array, lengths: mx.array) -> mx.array:
        """(B, N) speech token ids (< vocab_size on valid frames) -> (B, N, D) embeddings, zero on padded
        frames. Padded ids are replaced by 0 before the lookup, so any value there is harmless."""
        valid = length_mask(lengths, tokens.shape[1])
        x = self.input_embedding(mx.where(valid, tokens, 0))
        return x * valid[..., None].astype(x.dtype)

    def encode(
        self, tokens: mx.array, lengths: mx.array, *, isolate_rows: bool = False
    ) -> tuple[mx.array, mx.array]:
        """(B, N) int speech tokens (prompt and generated already concatenated by the caller), (B,) lengths ->
        mu (B, 2N, mel_dim) in mel space (``encoder_proj`` output, channels last) and its (B, 2N) bool mask.
        Frames past 2·length are padding; what they hold is what upstream computes there. With
        ``isolate_rows`` each row's valid frames are its batch-of-one result instead of upstream's
        padded-batch value (``UpsampleConformerEncoder``)."""
        h, valid = self.encoder(self.embed_tokens(tokens, lengths), lengths, isolate_rows=isolate_rows)
        return self.encoder_proj(h), valid

    # --- checkpoint ---

    @staticmethod
    def checkpoint_table(cfg: FlowConfig) -> dict[str, tuple]:
        """Upstream ``s3gen.safetensors`` key under ``flow.`` (prefix removed; ``decoder.*`` excluded) -> (our
        key, upstream shape[, layout]). ``flow.`` holds no buffers: the position table ``pe`` is a plain
        attribute upstream, not in the state dict."""
        d, f, h = cfg.hidden_size, cfg.linear_units, cfg.num_heads
        table: dict[str, tuple] = {}

        def put(key: str, shape: tuple[int, ...], layout: str | None = None) -> None:
            table[key] = (key, shape) if layout is None else (key, shape, layout)

        put("input_embedding.weight", (cfg.vocab_size, d))
        put("spk_embed_affine_layer.weight", (cfg.mel_dim, cfg.spk_embed_dim))
        put("spk_embed_affine_layer.bias", (cfg.mel_dim,))
        put("encoder_proj.weight", (cfg.mel_dim, d))
        put("encoder_proj.bias", (cfg.mel_dim,))
        for embed in ("embed", "up_embed"):  # out.0 Linear, out.1 LayerNorm
            put(f"encoder.{embed}.out.0.weight", (d, d))
            for name in ("out.0.bias", "out.1.weight", "out.1.bias"):
                put(f"encoder.{embed}.{name}", (d,))
        put("encoder.pre_lookahead_layer.conv1.weight", (d, d, cfg.pre_lookahead_len + 1), "conv1d")
        put("encoder.pre_lookahead_layer.conv1.bias", (d,))
        put("encoder.pre_lookahead_layer.conv2.weight", (d, d, 3), "conv1d")
        put("encoder.pre_lookahead_layer.conv2.bias", (d,))
        put("encoder.up_layer.conv.weight", (d, d, 2 * cfg.upsample_stride + 1), "conv1d")
        put("encoder.up_layer.conv.bias", (d,))
        put("encoder.after_norm.weight", (d,))
        put("encoder.after_norm.bias", (d,))
        for stack, n in (("encoders", cfg.num_blocks), ("up_encoders", cfg.num_up_blocks)):
            for i in range(n):
                p = f"encoder.{stack}.{i}."
                for proj in ("linear_q", "linear_k", "linear_v", "linear_out"):
                    put(f"{p}self_attn.{proj}.weight", (d, d))
                    put(f"{p}self_attn.{proj}.bias", (d,))
                put(f"{p}self_attn.linear_pos.weight", (d, d))
                put(f"{p}self_attn.pos_bias_u", (h, d // h))
                put(f"{p}self_attn.pos_bias_v", (h, d // h))
                put(f"{p}feed_forward.w_1.weight", (f, d))
                put(f"{p}feed_forward.w_1.bias", (f,))
                put(f"{p}feed_forward.w_2.weight", (d, f))
                put(f"{p}feed_forward.w_2.bias", (d,))
                for norm in ("norm_mha", "norm_ff"):
                    put(f"{p}{norm}.weight", (d,))
                    put(f"{p}{norm}.bias", (d,))
        return table
