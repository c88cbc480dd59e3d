"""S3 speech tokenizer v2 (``speech_tokenizer_v2_25hz``): 100 Hz log-mel -> 25 Hz FSQ speech codes.

Mirrors upstream ``s3tokenizer/model_v2.py`` (``S3TokenizerV2``: ``AudioEncoderV2`` with FSMN attention and the
FSQ codebook) as Chatterbox uses it for the prompt tokens; architecture notes §6. The log-mel front-end is not
here (``audio/mel.py``). Attribute paths follow the ``tokenizer.*`` keys of ``s3gen.safetensors``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class S3TokenizerConfig:
    """Sizes of the tokenizer; the defaults are upstream's ``ModelConfig`` for the v2 25 Hz model."""

    n_mels: int = 128
    n_state: int = 1280
    n_heads: int = 20
    n_layers: int = 6
    mlp_ratio: int = 4
    fsmn_kernel: int = 31
    ln_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_positions: int = 2048  # upstream's table length (``precompute_freqs_cis(64, 1024 * 2)``)
    fsq_dim: int = 8
    fsq_levels: int = 3
    # Upstream cuts longer inputs into 30 s windows with 4 s overlap (``_quantize_mixed_batch``): not here, in
    # generation/vc.py, the one caller with long inputs (voice conversion's source).
    max_frames: int = 3000

    def __post_init__(self) -> None:
        if self.n_state % self.n_heads or (self.n_state // self.n_heads) % 2:
            raise ValueError(f"n_state {self.n_state} must split into {self.n_heads} heads of even size")
        if self.code_length(self.max_frames) > self.rope_positions:
            raise ValueError(
                f"max_frames {self.max_frames} gives {self.code_length(self.max_frames)} codes, more than the "
                f"{self.rope_positions} RoPE positions"
            )

    @property
    def head_dim(self) -> int:
        return self.n_state // self.n_heads

    @property
    def codebook_size(self) -> int:
        return self.fsq_levels**self.fsq_dim  # 6561 for 8 ternary digits

    @staticmethod
    def code_length(frames: int) -> int:
        """Codes for ``frames`` mel frames: two stride-2 convs with k 3, p 1 (100 Hz -> 25 Hz)."""
        for _ in range(2):
            frames = (frames - 1) // 2 + 1
        return frames


def rope_table(cfg: S3TokenizerConfig) -> tuple[mx.array, mx.array]:
    """cos and sin, each (rope_positions, head_dim) with the half table repeated as rotate-half expects; in fp32
    step by step as upstream's ``precompute_freqs_cis`` (1 / theta^(2i/d), then position · frequency)."""
    d = cfg.head_dim
    inv_freq = 1.0 / mx.power(mx.array(cfg.rope_theta, mx.float32), mx.arange(0, d, 2).astype(mx.float32) / d)
    angles = mx.arange(cfg.rope_positions).astype(mx.float32)[:, None] * inv_freq[None]
    angles = mx.concatenate([angles, angles], axis=-1)
    return mx.cos(angles), mx.sin(angles)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate-half RoPE of x (B, H, T, D) with cos/sin (T, D)."""
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class LayerNorm(nn.LayerNorm):
    """Upstream ``s3tokenizer.model.LayerNorm``: normalises in fp32 whatever the activation dtype."""

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.fast.layer_norm(
            x.astype(mx.float32), self.weight.astype(mx.float32), self.bias.astype(mx.float32), self.eps
        )
        return y.astype(x.dtype)


class FSMNAttention(nn.Module):
    """Bidirectional multi-head attention with key padding, RoPE on q and k, plus the FSMN memory: a depthwise
    conv over the masked values added to them (upstream ``FSMNMultiHeadAttention``)."""

    def __init__(self, cfg: S3TokenizerConfig):
        super().__init__()
        d = cfg.n_state
        self.n_heads = cfg.n_heads
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.fsmn_block = nn.Conv1d(d, d, cfg.fsmn_kernel, groups=d, bias=False)
        left = (cfg.fsmn_kernel - 1) // 2
        self._fsmn_pad = (left, cfg.fsmn_kernel - 1 - left)

    def _fsmn(self, v: mx.array, pad_mask: mx.array) -> mx.array:
        v = v * pad_mask
        y = self.fsmn_block(mx.pad(v, [(0, 0), self._fsmn_pad, (0, 0)]))
        return (y + v) * pad_mask

    def __call__(
        self, x: mx.array, key_mask: mx.array, pad_mask: mx.array, cos: mx.array, sin: mx.array
    ) -> mx.array:
        b, t, d = x.shape
        hd = d // self.n_heads
        q = self.query(x).reshape(b, t, self.n_heads, hd).transpose(0, 2, 1, 3)  # (B, H, T, hd)
        k = self.key(x).reshape(b, t, self.n_heads, hd).transpose(0, 2, 1, 3)
        v = self.value(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Upstream scales q and k by hd^-0.25 each; one hd^-0.5 on the scores is the same product.
        h = mx.fast.scaled_dot_product_attention(
            q, k, v.reshape(b, t, self.n_heads, hd).transpose(0, 2, 1, 3), scale=hd**-0.5, mask=key_mask
        )
        return self.out(h.transpose(0, 2, 1, 3).reshape(b, t, d)) + self._fsmn(v, pad_mask)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, cfg: S3TokenizerConfig):
        super().__init__()
        d = cfg.n_state
        self.attn = FSMNAttention(cfg)
        self.attn_ln = LayerNorm(d, eps=cfg.ln_eps)
        # A list so that the keys stay ``mlp.0`` / ``mlp.2``; the GELU (exact, erf) holds ``mlp.1``.
        self.mlp = [nn.Linear(d, cfg.mlp_ratio * d), nn.GELU(), nn.Linear(cfg.mlp_ratio * d, d)]
        self.mlp_ln = LayerNorm(d, eps=cfg.ln_eps)

    def __call__(
        self, x: mx.array, key_mask: mx.array, pad_mask: mx.array, cos: mx.array, sin: mx.array
    ) -> mx.array:
        x = x + self.attn(self.attn_ln(x), key_mask, pad_mask, cos, sin)
        h = self.mlp_ln(x)
        for layer in self.mlp:
            h = layer(h)
        return x + h


class AudioEncoder(nn.Module):
    """Upstream ``AudioEncoderV2``: two stride-2 GELU convs on the masked input, then the blocks; no final norm."""

    def __init__(self, cfg: S3TokenizerConfig):
        super().__init__()
        self.conv1 = nn.Conv1d(cfg.n_mels, cfg.n_state, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(cfg.n_state, cfg.n_state, 3, stride=2, padding=1)
        self.blocks = [ResidualAttentionBlock(cfg) for _ in range(cfg.n_layers)]
        self._rope_cos, self._rope_sin = rope_table(cfg)

    def __call__(self, x: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
        for conv in (self.conv1, self.conv2):
            # Frames past a row's length are zeroed before each conv (upstream masks the conv inputs).
            x = x * (mx.arange(x.shape[1]) < lengths[:, None])[..., None].astype(x.dtype)
            x = nn.gelu(conv(x))
            lengths = (lengths - 1) // 2 + 1
        t = x.shape[1]
        valid = mx.arange(t) < lengths[:, None]  # (B, T')
        # Key padding only: the encoder is bidirectional (architecture §9.1). A boolean mask equals upstream's
        # additive (1 - m)·(-1e10) in fp32 (exp underflows to 0) and stays finite-safe in fp16. Padded query
        # rows are computed as upstream does; they never reach a valid row.
        key_mask = valid[:, None, None, :]  # (B, 1, 1, T')
        pad_mask = valid[..., None].astype(x.dtype)  # (B, T', 1)
        cos, sin = self._rope_cos[:t].astype(x.dtype), self._rope_sin[:t].astype(x.dtype)
        for block in self.blocks:
            x = block(x, key_mask, pad_mask, cos, sin)
        return x, lengths


class FSQ(nn.Module):
    """Upstream ``FSQCodebook.encode``: project to 8 dims, tanh, ×0.999, round, +1 -> one base-3 digit each."""

    def __init__(self, cfg: S3TokenizerConfig):
        super().__init__()
        self.project_down = nn.Linear(cfg.n_state, cfg.fsq_dim)
        self._powers = mx.array([cfg.fsq_levels**i for i in range(cfg.fsq_dim)], dtype=mx.int32)

    def digits(self, hidden: mx.array) -> mx.array:
        """(B, T, n_state) -> the pre-rounding values tanh(project_down(h))·0.999, (B, T, fsq_dim) fp32."""
        # 0.999 as upstream's literal 0.9990000128746033, i.e. the fp32 value of 0.999.
        return mx.tanh(self.project_down(hidden).astype(mx.float32)) * 0.999

    def __call__(self, hidden: mx.array) -> mx.array:
        """(B, T, n_state) -> codes (B, T) int32 in [0, levels^dim)."""
        # mx.round rounds half to even, as torch.round does.
        d = (mx.round(self.digits(hidden)) + 1).astype(mx.int32)
        return (d * self._powers).sum(axis=-1)


class S3Tokenizer(nn.Module):
    """Log-mel (B, T, n_mels) at 100 Hz -> speech codes (B, T') at 25 Hz, T' = ((T - 1)//2 + 1 - 1)//2 + 1."""

    def __init__(self, cfg: S3TokenizerConfig):
        super().__init__()
        self.config = cfg
        self.encoder = AudioEncoder(cfg)
        self.quantizer = FSQ(cfg)

    def _check(self, mel: mx.array, lengths: mx.array) -> mx.array:
        cfg = self.config
        if mel.ndim != 3 or mel.shape[2] != cfg.n_mels:
            raise ValueError(f"mel must be (B, T, {cfg.n_mels}), got shape {tuple(mel.shape)}")
        lengths = mx.array(lengths).astype(mx.int32)
        if lengths.shape != (mel.shape[0],):
            raise ValueError(f"lengths must be ({mel.shape[0]},), got shape {tuple(lengths.shape)}")
        lo, hi = (int(v) for v in mx.stack([lengths.min(), lengths.max()]).tolist())
        if lo < 1 or hi > mel.shape[1]:
            raise ValueError(f"lengths must lie in [1, {mel.shape[1]}] (the mel's frames), got {lo}..{hi}")
        if hi > cfg.max_frames:
            raise ValueError(
                f"input of {hi} mel frames is longer than the {cfg.max_frames}-frame (30 s) limit; upstream's "
                "30 s windowing with 4 s overlap is not ported: split the audio into segments of at most 30 s"
            )
        return lengths

    def encode(self, mel: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
        """Encoder hidden states before quantisation.

        mel: (B, T, n_mels) log-mel as upstream's ``log_mel_spectrogram`` makes it (transposed to frames-first),
        zero-padded past each row's length; lengths: (B,) int frames, at most ``max_frames``.
        Returns hidden (B, T', n_state) and lengths (B,) int32 in codes; positions past a row's length hold
        padding values (as upstream).
        """
        return self.encoder(mel, self._check(mel, lengths))

    def __call__(self, mel: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
        """Upstream ``quantize`` for inputs up to 30 s: codes (B, T') int32 in [0, 6561) and their lengths (B,)
        int32. Codes past a row's length are padding (upstream returns them too); slice with the lengths."""
        hidden, lengths = self.encode(mel, lengths)
        return self.quantizer(hidden), lengths

    @staticmethod
    def checkpoint_table(cfg: S3TokenizerConfig) -> dict[str, tuple]:
        """Upstream key (relative to ``tokenizer.``) -> (our key, upstream shape[, layout]).

        The recomputed buffers ``_mel_filters`` and ``window`` are not listed: the converter drops them before
        this table is applied (upstream loads them non-strictly)."""
        d, f, k = cfg.n_state, cfg.mlp_ratio * cfg.n_state, cfg.fsmn_kernel
        table: dict[str, tuple] = {
            "encoder.conv1.weight": ("encoder.conv1.weight", (d, cfg.n_mels, 3), "conv1d"),
            "encoder.conv1.bias": ("encoder.conv1.bias", (d,)),
            "encoder.conv2.weight": ("encoder.conv2.weight", (d, d, 3), "conv1d"),
            "encoder.conv2.bias": ("encoder.conv2.bias", (d,)),
            # MLX hides attributes that start with "_" from the parameters, so ``_codebook`` goes.
            "quantizer._codebook.project_down.weight": ("quantizer.project_down.weight", (cfg.fsq_dim, d)),
            "quantizer._codebook.project_down.bias": ("quantizer.project_down.bias", (cfg.fsq_dim,)),
        }
        block: dict[str, tuple] = {
            "attn.query.weight": ((d, d),),
            "attn.query.bias": ((d,),),
            "attn.key.weight": ((d, d),),
            "attn.value.weight": ((d, d),),
            "attn.value.bias": ((d,),),
            "attn.out.weight": ((d, d),),
            "attn.out.bias": ((d,),),
            # Depthwise (d, 1, k) -> (d, k, 1), used with groups = d.
            "attn.fsmn_block.weight": ((d, 1, k), "conv1d"),
            "attn_ln.weight": ((d,),),
            "attn_ln.bias": ((d,),),
            "mlp.0.weight": ((f, d),),
            "mlp.0.bias": ((f,),),
            "mlp.2.weight": ((d, f),),
            "mlp.2.bias": ((d,),),
            "mlp_ln.weight": ((d,),),
            "mlp_ln.bias": ((d,),),
        }
        for i in range(cfg.n_layers):
            for name, rule in block.items():
                key = f"encoder.blocks.{i}.{name}"
                table[key] = (key, *rule)
        return table
