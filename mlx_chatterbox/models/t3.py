"""T3: Chatterbox's text-to-speech-token model (Llama-520M backbone, Perceiver conditioning, speech head).

Mirrors upstream ``chatterbox/models/t3`` (0.1.7) with our own Llama; architecture notes §3. Attribute paths
follow the checkpoint keys so that ``sanitize`` is a visible table of renames and drops.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from . import memory
from .cache import KVCache
from .layers import BufferState, LayerParts, Linear, WindowState, decode_layer, left_pad_mask, project


@dataclass(frozen=True)
class T3Config:
    """Sizes and special ids of T3; the defaults are the English Chatterbox model (upstream ``T3Config`` +
    ``LLAMA_520M_CONFIG_DICT``)."""

    hidden_size: int = 1024
    num_layers: int = 30
    num_heads: int = 16
    head_dim: int = 64
    intermediate_size: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # llama3 RoPE scaling, applied at every sequence length (architecture §3.2)
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    llama_vocab_size: int = 8  # the unused ``tfmr.embed_tokens`` placeholder in the checkpoint
    text_vocab_size: int = 704
    speech_vocab_size: int = 8194
    max_text_tokens: int = 2048
    max_speech_tokens: int = 4096
    start_text_token: int = 255
    stop_text_token: int = 0
    start_speech_token: int = 6561
    stop_speech_token: int = 6562
    speaker_embed_size: int = 256
    speech_cond_prompt_len: int = 150
    perceiver_queries: int = 32
    perceiver_heads: int = 4

    @property
    def text_positions(self) -> int:
        return self.max_text_tokens + 2  # upstream: text_pos_emb covers SOT + text + EOT

    @property
    def speech_positions(self) -> int:
        return self.max_speech_tokens + 4

    @property
    def most_new_tokens(self) -> int:
        """The largest ``max_new_tokens`` this T3 takes (upstream asserts it against max_speech_tokens)."""
        return self.max_speech_tokens


@dataclass
class T3Cond:
    """Conditioning of one voice for T3.

    speaker_emb: (B, speaker_embed_size) voice-encoder embedding.
    prompt_tokens: (B, P) int speech tokens of the reference (P <= speech_cond_prompt_len), or None.
    exaggeration: emotion/exaggeration scalar, a float or a (B,) array (upstream default 0.5).
    """

    speaker_emb: mx.array
    prompt_tokens: mx.array | None
    exaggeration: float | mx.array = 0.5


def llama3_inv_freq(cfg: T3Config) -> mx.array:
    """RoPE inverse frequencies (head_dim / 2,) with llama3 scaling, in fp32 step by step as transformers."""
    exponents = mx.arange(0, cfg.head_dim, 2).astype(mx.float32) / cfg.head_dim
    inv_freq = 1.0 / mx.power(mx.array(cfg.rope_theta, mx.float32), exponents)
    low_wavelen = cfg.rope_original_max_positions / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_max_positions / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = mx.where(wavelen > low_wavelen, inv_freq / cfg.rope_factor, inv_freq)
    smooth = (cfg.rope_original_max_positions / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return mx.where(medium, smoothed, scaled)


class AttentionTaps:
    """Post-softmax attention probabilities of batch row 0 for some (layer, head) pairs, filled in by a pass
    (``T3.prefill`` or ``T3.decode`` given ``taps``) for the multilingual v2 alignment analyzer
    (generation/alignment.py). The fused attention kernel does not expose its probabilities, so only these
    heads' q·k softmax is computed again beside it, as transformers' eager attention does (fp32 softmax).

    pairs: (layer, head) pairs. first_row: a prefill keeps the query rows from this one on; a decode step has
    its one row (first_row 0). After the pass, ``maps`` holds one (rows, keys) array per pair in the order
    of ``pairs``; a decode step's keys are the whole cache buffer (capacity), probability 0 past the token.
    """

    def __init__(self, pairs: Sequence[tuple[int, int]], first_row: int = 0):
        self.pairs, self.first_row = tuple(pairs), first_row
        self._found: dict[tuple[int, int], mx.array] = {}

    @property
    def maps(self) -> list[mx.array]:
        return [self._found[pair] for pair in self.pairs]

    def at(self, layer: int) -> Callable | None:
        """What layer ``layer``'s attention calls with its (B, H, Nq, hd) queries, (B, H, Nk, hd) keys, its
        mask and scale; None where no pair is in that layer, which leaves the layer's pass as it is."""
        heads = [h for l, h in self.pairs if l == layer]
        return partial(self._record, layer, heads) if heads else None

    def _record(
        self,
        layer: int,
        heads: list[int],
        q: mx.array,
        k: mx.array,
        mask: str | mx.array | None,
        scale: float,
    ) -> None:
        index = mx.array(heads)
        scores = (q[0, index, self.first_row :] @ k[0, index].swapaxes(1, 2)) * scale  # (h, R, Nk)
        scores = scores.astype(mx.float32)
        if isinstance(mask, str):  # "causal" over a prefill from position 0
            n = k.shape[2]
            mask = mx.arange(n)[None] <= mx.arange(self.first_row, n)[:, None]
        elif mask is not None and mask.ndim == 4:  # one mask per batch row, (B, 1, Nq, Nk)
            mask = mask[0, :, self.first_row :]
        if mask is not None:
            scores = mx.where(mask, scores, -mx.inf)
        probs = mx.softmax(scores, axis=-1)
        for head, p in zip(heads, probs):
            self._found[(layer, head)] = p


class Attention(nn.Module):
    def __init__(self, cfg: T3Config, rope_periods: mx.array):
        super().__init__()
        d, h, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.num_heads, self.head_dim = h, hd
        # q, k and v as one product: one weight read and one kernel per step instead of three (fused at conversion).
        self.qkv_proj = Linear(d, 3 * h * hd, bias=False)
        self.o_proj = Linear(h * hd, d, bias=False)
        self._rope_periods = rope_periods

    def _rope(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return mx.fast.rope(
            x, self.head_dim, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._rope_periods
        )

    def _qkv(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(B, N, D) -> q, k, v as (B, H, N, hd), q and k rotated for positions offset .. offset + N - 1."""
        b, n, _ = x.shape
        qkv = self.qkv_proj(x).reshape(b, n, 3, self.num_heads, self.head_dim).transpose(0, 2, 3, 1, 4)
        # q and k in one call: one kernel per layer instead of two; a (B,) offset is one per row (axis 0).
        qk = self._rope(qkv[:, :2], offset)
        return qk[:, 0], qk[:, 1], qkv[:, 2]

    def _out(self, out: mx.array) -> mx.array:
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))

    def __call__(
        self,
        x: mx.array,
        kv: list[mx.array] | None = None,
        offset: int | mx.array = 0,
        mask: str | mx.array | None = "causal",
        tap: Callable | None = None,
    ) -> mx.array:
        """Teacher-forced pass or prefill from position 0, causal over the whole input, conditioning included
        (architecture §9.1). The rotated keys and the values are appended to ``kv`` when it is given.
        offset, mask: left-padded rows (``Llama.__call__``): (B,) offsets -pad and a (B, 1, N, N) mask.
        tap: ``AttentionTaps.at``'s recorder for this layer."""
        q, k, v = self._qkv(x, offset)
        if kv is not None:
            kv += [k, v]
        if tap is not None:
            tap(q, k, mask, self.head_dim**-0.5)
        out = mx.fast.scaled_dot_product_attention(
            q, k, v, scale=self.head_dim**-0.5, mask=mask if x.shape[1] > 1 else None
        )
        return self._out(out)


class MLP(nn.Module):
    def __init__(self, cfg: T3Config):
        super().__init__()
        # gate and up as one product (fused at conversion), split after.
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        """down(silu(gate) * up) of x."""
        return self.down_proj(project(self.gate_up_proj, x, act="swiglu"))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: T3Config, rope_periods: mx.array):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope_periods)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def __call__(
        self,
        x: mx.array,
        kv: list[mx.array] | None = None,
        offset: int | mx.array = 0,
        mask: str | mx.array | None = "causal",
        tap: Callable | None = None,
    ) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), kv, offset, mask, tap)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(
        self, x: mx.array, state: BufferState | WindowState
    ) -> tuple[mx.array, BufferState | WindowState]:
        """One token x (B, 1, D) with ``state`` this layer's keys and values (``layers.decode_layer``: on CUDA
        five primitives, or one kernel: ``FUSED_LAYERS``). A left-padded row b's token sits at sequence
        position (buffer index - pad[b]) and sees nothing before pad[b]. Nothing depends on the values of
        positions or pad, so a compiled step is traced once per shape."""
        attn, mlp = self.self_attn, self.mlp
        parts = LayerParts(
            attn.qkv_proj, self.input_layernorm, attn.o_proj, self.post_attention_layernorm, mlp.gate_up_proj,
            mlp.down_proj, "swiglu", attn.num_heads, attn._rope_periods,
        )  # fmt: skip
        return decode_layer(x, state, parts)


class Llama(nn.Module):
    """The Llama decoder stack on input embeddings; returns the post-final-norm hidden states, which is what
    upstream reads as ``hidden_states[-1]`` under transformers 5 (architecture §3.2)."""

    def __init__(self, cfg: T3Config):
        super().__init__()
        # One table for every layer; mx.fast.rope takes periods (1 / inv_freq), not inverse frequencies.
        rope_periods = 1.0 / llama3_inv_freq(cfg)
        # Evaluated now: a compiled decode step closing over the lazy table recomputed it every step (an arange
        # and a fused kernel: two primitives of host time per token on a GPU).
        mx.eval(rope_periods)
        self.layers = [DecoderLayer(cfg, rope_periods) for _ in range(cfg.num_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(
        self,
        x: mx.array,
        kv: list[mx.array] | None = None,
        pad: mx.array | None = None,
        taps: AttentionTaps | None = None,
    ) -> mx.array:
        """(B, N, D) from position 0 -> (B, N, D); every layer's keys and values are appended to ``kv`` when
        it is given.
        pad: (B,) int32 for rows left-padded to a common length N (generation/batch.py): row b's sequence
        starts at index pad[b], so index i is its position i - pad[b] (``layers.left_pad_mask``).
        taps: attention maps to fill in on the way (``AttentionTaps``)."""
        offset, mask = 0, "causal"
        if pad is not None:
            offset, mask = -pad, left_pad_mask(x.shape[1], pad)
        for i, layer in enumerate(self.layers):
            x = layer(x, kv, offset, mask, None if taps is None else taps.at(i))
        return self.norm(x)

    def decode(
        self, x: mx.array, states: list[BufferState] | list[WindowState]
    ) -> tuple[mx.array, list[mx.array]]:
        """One token through every layer, each with its state (``layers.BufferState`` or
        ``layers.WindowState``). Returns the last layer's output before the final norm (``T3`` fuses that into
        the head) and what the states wrote, in the cache's layout."""
        written = []
        for layer, state in zip(self.layers, states):
            x, state = layer.decode(x, state)
            written += state.written
        return x, written


class AttentionBlock(nn.Module):
    """Upstream ``AttentionBlock2``: one LayerNorm for both inputs, separate q/k/v/out projections, no mask."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim, eps=1e-5)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.proj_out = nn.Linear(dim, dim)

    def __call__(self, x1: mx.array, x2: mx.array) -> mx.array:
        b, n1, d = x1.shape
        n2 = x2.shape[1]
        hd = d // self.heads
        x1n, x2n = self.norm(x1), self.norm(x2)
        q = self.to_q(x1n).reshape(b, n1, self.heads, hd).transpose(0, 2, 1, 3)
        k = self.to_k(x2n).reshape(b, n2, self.heads, hd).transpose(0, 2, 1, 3)
        v = self.to_v(x2n).reshape(b, n2, self.heads, hd).transpose(0, 2, 1, 3)
        h = mx.fast.scaled_dot_product_attention(q, k, v, scale=hd**-0.5)
        return x1 + self.proj_out(h.transpose(0, 2, 1, 3).reshape(b, n1, d))


class Perceiver(nn.Module):
    """Resamples the prompt embeddings to ``perceiver_queries`` vectors: cross-attention from a learned query,
    then self-attention, with the same block both times (architecture §3.4)."""

    def __init__(self, cfg: T3Config):
        super().__init__()
        self.pre_attention_query = mx.zeros((1, cfg.perceiver_queries, cfg.hidden_size))
        self.attn = AttentionBlock(cfg.hidden_size, cfg.perceiver_heads)

    def __call__(self, h: mx.array) -> mx.array:
        q = mx.broadcast_to(self.pre_attention_query, (h.shape[0],) + self.pre_attention_query.shape[1:])
        a = self.attn(q, h)
        return self.attn(a, a)


class CondEncoder(nn.Module):
    def __init__(self, cfg: T3Config):
        super().__init__()
        self.spkr_enc = nn.Linear(cfg.speaker_embed_size, cfg.hidden_size)
        self.emotion_adv_fc = nn.Linear(1, cfg.hidden_size, bias=False)
        self.perceiver = Perceiver(cfg)

    def __call__(
        self, speaker_emb: mx.array, prompt_emb: mx.array | None, exaggeration: mx.array
    ) -> mx.array:
        parts = [self.spkr_enc(speaker_emb)[:, None]]  # (B, 1, D)
        if prompt_emb is not None:
            parts.append(self.perceiver(prompt_emb))  # (B, 32, D)
        parts.append(self.emotion_adv_fc(exaggeration.reshape(-1, 1, 1)))  # (B, 1, D)
        return mx.concatenate(parts, axis=1)


class T3(nn.Module):
    def __init__(self, cfg: T3Config):
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.tfmr = Llama(cfg)
        self.cond_enc = CondEncoder(cfg)
        self.text_emb = nn.Embedding(cfg.text_vocab_size, d)
        self.speech_emb = nn.Embedding(cfg.speech_vocab_size, d)
        self.text_pos_emb = nn.Embedding(cfg.text_positions, d)
        self.speech_pos_emb = nn.Embedding(cfg.speech_positions, d)
        self.speech_head = Linear(d, cfg.speech_vocab_size, bias=False)
        # Compiled decode steps by sampling set-up (generation/speech_tokens.py). Set past nn.Module's
        # __setattr__, which would store a dict as a child module and list it among the parameters.
        object.__setattr__(self, "compiled_steps", {})

    # A compiled step holds the weights it was traced with; every way of changing them on this model (load_weights,
    # set_dtype, nn.quantize, update) goes through these two, which drop the compiled steps first. (Changing a
    # submodule's weights directly needs ``compiled_steps.clear()``.)
    def update(self, parameters: dict, strict: bool = True) -> T3:
        self.compiled_steps.clear()
        return super().update(parameters, strict)

    def update_modules(self, modules: dict, strict: bool = True) -> T3:
        self.compiled_steps.clear()
        return super().update_modules(modules, strict)

    # --- embeddings (architecture §3.3) ---

    def embed_cond(self, cond: T3Cond) -> mx.array:
        """(B, 1 + 32 + 1, D), or (B, 2, D) without prompt tokens."""
        prompt = None
        if cond.prompt_tokens is not None:
            prompt = self.embed_speech(cond.prompt_tokens, start=0)
        exaggeration = mx.array(cond.exaggeration, dtype=cond.speaker_emb.dtype)
        return self.cond_enc(cond.speaker_emb, prompt, exaggeration)

    def embed_text(self, tokens: mx.array, cfg_uncond_row: bool = False) -> mx.array:
        """Token + position embeddings of (B, L) text ids that include SOT and EOT. With ``cfg_uncond_row``
        (B == 2), row 1's *token* embeddings are zeroed before its positions are added (upstream CFG)."""
        x = self.text_emb(tokens)
        if cfg_uncond_row:
            x = x * mx.array([1.0, 0.0], dtype=x.dtype)[:, None, None]
        return x + self.text_pos_emb.weight[: tokens.shape[1]]

    def embed_speech(self, tokens: mx.array, start: int) -> mx.array:
        """(B, S) speech ids placed at speech positions start .. start + S - 1."""
        return self.speech_emb(tokens) + self.speech_pos_emb.weight[start : start + tokens.shape[1]]

    # --- network ---

    def prefill(
        self,
        embeds: mx.array,
        cache_step: int = 256,
        pad: mx.array | None = None,
        taps: AttentionTaps | None = None,
    ) -> tuple[mx.array, KVCache]:
        """Run (B, N, D) input embeddings from position 0; the speech logits of the last position (B, V) and
        the cache for ``decode``. pad: (B,) for left-padded rows (``Llama.__call__``). taps: attention maps
        to fill in as well (``AttentionTaps``)."""
        kv: list[mx.array] = []
        with memory.prefill_bound(embeds.shape[0]):  # text -> wav's peak without it (memory.py)
            h = self.tfmr(embeds, kv, pad, taps)
            logits, cache = self.speech_head(h[:, -1]), KVCache.from_prefill(kv, cache_step)
            mx.async_eval(logits, *cache.kv)  # queued under the bound
        return logits, cache

    def decode(
        self,
        token: mx.array,
        speech_position: mx.array,
        position: mx.array,
        kv: list[mx.array],
        pad: mx.array | None = None,
        taps: AttentionTaps | None = None,
    ) -> tuple[mx.array, list[mx.array]]:
        """One speech token (B,) at ``speech_position`` of the speech position table (an int32 scalar, or (B,)
        for rows at different points of their speech) and at buffer index ``position`` (an int32 scalar) -> its
        logits (B, V) and the key/value buffers with it written in. ``pad``: rows left-padded to a common length
        (``layers.decode_layer``; generation/batch.py). ``taps``: attention maps to fill in as well
        (``AttentionTaps``, first_row 0). Pure in its arrays, so that it can be compiled
        (generation/speech_tokens.py, generation/aligned.py)."""
        if taps is not None and taps.first_row:
            raise ValueError(f"a decode step has one query row; got taps with first_row={taps.first_row}")
        states = BufferState.per_layer(kv, position, pad, "llama")
        if taps is not None:
            states = [state._replace(tap=taps.at(i)) for i, state in enumerate(states)]
        return self._step(token, speech_position, states)

    def decode_window(
        self,
        token: mx.array,
        speech_position: mx.array,
        at: mx.array,
        pad: mx.array,
        kv: list[mx.array],
        window: list[mx.array],
    ) -> tuple[mx.array, list[mx.array]]:
        """``decode`` for a batch in a ``BatchKVCache`` (generation/batch.py): ``at`` is [buffer index of
        this token, the window's base] (int32 (2,)), ``pad`` (B,) the rows' left padding; ``kv`` the cache's big
        buffers (read only), ``window`` its windows. Returns the logits (B, V) and the windows with the token
        written in."""
        return self._step(token, speech_position, WindowState.per_layer(kv, window, at, pad))

    def _step(
        self, token: mx.array, speech_position: mx.array, states: list[BufferState] | list[WindowState]
    ) -> tuple[mx.array, list[mx.array]]:
        """A decode step: token (B,) -> logits (B, V); the final norm and the speech head are one primitive on
        CUDA."""
        x = (self.speech_emb(token) + self.speech_pos_emb.weight[speech_position])[:, None]
        h, written = self.tfmr.decode(x, states)
        return project(self.speech_head, h, norm=self.tfmr.norm)[:, 0], written

    def __call__(self, cond: T3Cond, text_tokens: mx.array, speech_tokens: mx.array) -> mx.array:
        """Teacher-forced pass (upstream ``T3.forward``): [cond | text | speech] in one causal pass.

        text_tokens: (B, L) ids including SOT and EOT; speech_tokens: (B, S) ids, usually starting with the
        start-of-speech id, at speech positions 0 .. S - 1. Returns the speech logits (B, S, speech_vocab),
        where position s predicts speech token s + 1.
        """
        cond_emb = self.embed_cond(cond)
        b = text_tokens.shape[0]
        cond_emb = mx.broadcast_to(cond_emb, (b,) + cond_emb.shape[1:])
        x = mx.concatenate(
            [cond_emb, self.embed_text(text_tokens), self.embed_speech(speech_tokens, 0)], axis=1
        )
        h = self.tfmr(x)
        return self.speech_head(h[:, -speech_tokens.shape[1] :])

    # --- checkpoint ---

    @staticmethod
    def checkpoint_table(cfg: T3Config) -> dict[str, tuple[str | None, tuple[int, ...]]]:
        """Upstream ``t3_cfg.safetensors`` key -> (our key or None to drop, expected shape)."""
        d, f, a = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
        table: dict[str, tuple[str | None, tuple[int, ...]]] = {
            # Unused at inference: the Llama token table (custom embeddings feed the backbone) and the text head.
            "tfmr.embed_tokens.weight": (None, (cfg.llama_vocab_size, d)),
            "text_head.weight": (None, (cfg.text_vocab_size, d)),
            "tfmr.norm.weight": ("tfmr.norm.weight", (d,)),
            "text_emb.weight": ("text_emb.weight", (cfg.text_vocab_size, d)),
            "speech_emb.weight": ("speech_emb.weight", (cfg.speech_vocab_size, d)),
            "text_pos_emb.emb.weight": ("text_pos_emb.weight", (cfg.text_positions, d)),
            "speech_pos_emb.emb.weight": ("speech_pos_emb.weight", (cfg.speech_positions, d)),
            "speech_head.weight": ("speech_head.weight", (cfg.speech_vocab_size, d)),
            "cond_enc.spkr_enc.weight": ("cond_enc.spkr_enc.weight", (d, cfg.speaker_embed_size)),
            "cond_enc.spkr_enc.bias": ("cond_enc.spkr_enc.bias", (d,)),
            "cond_enc.emotion_adv_fc.weight": ("cond_enc.emotion_adv_fc.weight", (d, 1)),
            "cond_enc.perceiver.pre_attention_query": (
                "cond_enc.perceiver.pre_attention_query",
                (1, cfg.perceiver_queries, d),
            ),
        }
        perceiver = {"norm.weight": (d,), "norm.bias": (d,)}
        for proj in ("to_q", "to_k", "to_v", "proj_out"):
            perceiver[f"{proj}.weight"] = (d, d)
            perceiver[f"{proj}.bias"] = (d,)
        for name, shape in perceiver.items():
            key = f"cond_enc.perceiver.attn.{name}"
            table[key] = (key, shape)
        # q/k/v and gate/up are stacked along the output dim in this order into one fused weight each.
        layer = {
            "input_layernorm.weight": ("input_layernorm.weight", (d,)),
            "post_attention_layernorm.weight": ("post_attention_layernorm.weight", (d,)),
            "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", (a, d), "stack"),
            "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", (a, d), "stack"),
            "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", (a, d), "stack"),
            "self_attn.o_proj.weight": ("self_attn.o_proj.weight", (d, a)),
            "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", (f, d), "stack"),
            "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", (f, d), "stack"),
            "mlp.down_proj.weight": ("mlp.down_proj.weight", (d, f)),
        }
        for i in range(cfg.num_layers):
            for name, (target, *rule) in layer.items():
                table[f"tfmr.layers.{i}.{name}"] = (f"tfmr.layers.{i}.{target}", *rule)
        return table
