"""T3 of Chatterbox-Turbo and -Nano: a GPT-2 backbone (learned absolute positions, pre-LayerNorm blocks) on
custom input embeddings, a speaker projection and a speech head with bias.

Mirrors upstream ``T3`` (0.1.7, ``models/t3/t3.py``) built with ``llama_config_name="GPT2_medium"`` (Turbo)
or ``"GPT2_small"`` (Nano, git HEAD ``5de7a54``) and the Turbo hp of ``tts_turbo.py`` (variants.md §2.2, §2.3,
§4): no perceiver, no emotion slot, no learned text/speech position tables, no CFG. Attribute paths follow the
checkpoint keys, so that ``checkpoint_table`` is a table of identities, transposes and drops.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .cache import KVCache
from .layers import BufferState, LayerParts, Linear, WindowState, decode_layer, left_pad_mask, project


@dataclass(frozen=True)
class T3TurboConfig:
    """Sizes and special ids; the defaults are Turbo's (upstream ``GPT2_MEDIUM_CONFIG`` + the hp set in
    ``tts_turbo.py``)."""

    hidden_size: int = 1024  # GPT-2 n_embd
    num_layers: int = 24  # n_layer
    num_heads: int = 16  # n_head (head_dim = hidden_size / num_heads = 64)
    n_positions: int = 8196  # rows of the wpe table: prefill + generated tokens must fit (§2.7)
    layer_norm_eps: float = 1e-5
    text_vocab_size: int = 50276  # GPT-2 byte BPE + 19 tags; also the size of the unused wte
    speech_vocab_size: int = 6563  # 6561 S3 codes + start + stop
    speaker_embed_size: int = 256
    start_speech_token: int = 6561
    stop_speech_token: int = 6562
    speech_cond_prompt_len: int = 375  # 15 s of reference speech tokens at 25 Hz
    max_new_tokens: int = 1000  # upstream ``inference_turbo(max_gen_len=1000)``, the default of TurboParams

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def intermediate_size(self) -> int:
        return 4 * self.hidden_size  # GPT-2 with n_inner=None

    @property
    def most_new_tokens(self) -> int:
        """The largest ``max_new_tokens`` whatever the text: speaker + 1 text id + start, then one position
        per fed token."""
        return self.n_positions - 3


TURBO = T3TurboConfig()
NANO = T3TurboConfig(hidden_size=768, num_layers=12, num_heads=12)  # upstream HEAD ``GPT2_SMALL_CONFIG``


class Attention(nn.Module):
    def __init__(self, cfg: T3TurboConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        # GPT-2's fused projection: output columns are [q | k | v], each d wide (HF Conv1D, transposed at
        # conversion).
        self.c_attn = Linear(d, 3 * d)
        self.c_proj = Linear(d, d)

    def __call__(
        self, x: mx.array, kv: list[mx.array] | None = None, mask: str | mx.array = "causal"
    ) -> mx.array:
        """Causal self-attention over (B, N, D) from position 0; keys and values are appended to ``kv``.
        mask: (B, 1, N, N) for left-padded rows (``GPT2.__call__``)."""
        b, n, d = x.shape
        qkv = self.c_attn(x).reshape(b, n, 3, self.num_heads, self.head_dim).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (B, H, N, hd)
        if kv is not None:
            kv += [k, v]
        out = mx.fast.scaled_dot_product_attention(
            q, k, v, scale=self.head_dim**-0.5, mask=mask if n > 1 else None
        )
        return self.c_proj(out.transpose(0, 2, 1, 3).reshape(b, n, d))


class MLP(nn.Module):
    def __init__(self, cfg: T3TurboConfig):
        super().__init__()
        self.c_fc = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.c_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.c_proj(nn.gelu_approx(self.c_fc(x)))  # GPT-2's "gelu_new" is this tanh approximation


class Block(nn.Module):
    """Pre-LN GPT-2 block: x + attn(ln_1(x)), then + mlp(ln_2(.))."""

    def __init__(self, cfg: T3TurboConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def __call__(
        self, x: mx.array, kv: list[mx.array] | None = None, mask: str | mx.array = "causal"
    ) -> mx.array:
        x = x + self.attn(self.ln_1(x), kv, mask)
        return x + self.mlp(self.ln_2(x))

    def decode(
        self, x: mx.array, state: BufferState | WindowState
    ) -> tuple[mx.array, BufferState | WindowState]:
        """One token x (B, 1, D) with ``state`` this block's keys and values (``layers.decode_layer``: on CUDA
        five primitives, or one kernel: ``FUSED_LAYERS``). Nothing depends on the values of positions, so a
        compiled step is traced once per shape."""
        parts = LayerParts(
            self.attn.c_attn, self.ln_1, self.attn.c_proj, self.ln_2, self.mlp.c_fc, self.mlp.c_proj, "gelu",
            self.attn.num_heads,
        )  # fmt: skip
        return decode_layer(x, state, parts)


class GPT2(nn.Module):
    """transformers' ``GPT2Model`` on ``inputs_embeds``: adds ``wpe`` at absolute positions, runs the blocks
    and returns ``ln_f`` of the last block (what upstream reads as ``llm_outputs[0]``); ``wte`` is unused."""

    def __init__(self, cfg: T3TurboConfig):
        super().__init__()
        self.wpe = nn.Embedding(cfg.n_positions, cfg.hidden_size)
        self.h = [Block(cfg) for _ in range(cfg.num_layers)]
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def __call__(
        self, x: mx.array, kv: list[mx.array] | None = None, pad: mx.array | None = None
    ) -> mx.array:
        """(B, N, D) embeddings at positions 0 .. N - 1 -> (B, N, D); every block's keys and values are
        appended to ``kv`` when it is given.
        pad: (B,) int32 for rows left-padded to a common length N (generation/turbo_batch.py): row b's
        sequence starts at index pad[b], so index i gets wpe[i - pad[b]], and no index sees one before pad[b].
        A padding index sees itself alone (and wpe[0]), which keeps its keys and values finite."""
        mask: str | mx.array = "causal"
        if pad is None:
            x = x + self.wpe.weight[: x.shape[1]]
        else:
            index = mx.arange(x.shape[1])
            x = x + self.wpe.weight[mx.maximum(index - pad[:, None], 0)]  # (B, N, D)
            mask = left_pad_mask(x.shape[1], pad)
        for block in self.h:
            x = block(x, kv, mask)
        return self.ln_f(x)

    def decode(
        self, x: mx.array, positions: mx.array, states: list[BufferState] | list[WindowState]
    ) -> tuple[mx.array, list[mx.array]]:
        """One embedded token (B, 1, D) at wpe row ``positions`` (int32: a scalar, or (B,) one per row) through
        the blocks, each with its state (``layers.BufferState`` or ``layers.WindowState``). Returns the last
        block's output before ``ln_f`` (``T3Turbo`` fuses that into the head) and what the states wrote, in the
        cache's layout."""
        x = x + self.wpe.weight[positions].reshape(-1, 1, x.shape[-1])
        written = []
        for block, state in zip(self.h, states):
            x, state = block.decode(x, state)
            written += state.written
        return x, written


class CondEnc(nn.Module):
    """Upstream ``T3CondEnc`` with Turbo's hp: the speaker projection alone (no perceiver, no emotion)."""

    def __init__(self, cfg: T3TurboConfig):
        super().__init__()
        self.spkr_enc = nn.Linear(cfg.speaker_embed_size, cfg.hidden_size)


class T3Turbo(nn.Module):
    def __init__(self, cfg: T3TurboConfig = TURBO):
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.tfmr = GPT2(cfg)
        self.cond_enc = CondEnc(cfg)
        self.text_emb = nn.Embedding(cfg.text_vocab_size, d)
        self.speech_emb = nn.Embedding(cfg.speech_vocab_size, d)
        self.speech_head = Linear(d, cfg.speech_vocab_size)  # upstream: bias=is_gpt
        # Compiled decode steps by sampling set-up (generation/turbo.py). Set past nn.Module's __setattr__,
        # which would store a dict as a child module and list it among the parameters.
        object.__setattr__(self, "compiled_steps", {})

    # A compiled step holds the weights it was traced with; load_weights, set_dtype, nn.quantize and update
    # all go through these two, which drop the compiled steps first (as models/t3.py).
    def update(self, parameters: dict, strict: bool = True) -> T3Turbo:
        self.compiled_steps.clear()
        return super().update(parameters, strict)

    def update_modules(self, modules: dict, strict: bool = True) -> T3Turbo:
        self.compiled_steps.clear()
        return super().update_modules(modules, strict)

    # --- embeddings (variants.md §2.7) ---

    def prepare_input_embeds(
        self, speaker_emb: mx.array, prompt_tokens: mx.array | None, text_tokens: mx.array
    ) -> mx.array:
        """Upstream ``prepare_input_embeds`` with ``speech_tokens=[[start]]``:
        ``[spkr_enc(speaker) | speech_emb(prompt) | text_emb(text) | speech_emb(start)]``,
        (B, 1 + P + N + 1, D).

        speaker_emb: (B, speaker_embed_size); prompt_tokens: (B, P) speech ids or None; text_tokens: (B, N)
        ids as the tokenizer gives them (Turbo adds no start/stop text ids). No position table is added here:
        the only positional signal is GPT-2's wpe, added over the whole sequence by the backbone. A single
        BOS: Turbo does not append the second one that English ``T3.inference`` adds.
        """
        b = text_tokens.shape[0]
        parts = [self.cond_enc.spkr_enc(speaker_emb.reshape(-1, self.config.speaker_embed_size))[:, None]]
        if prompt_tokens is not None:
            parts.append(self.speech_emb(prompt_tokens))
        parts = [mx.broadcast_to(p, (b,) + p.shape[1:]) for p in parts]
        start = mx.full((b, 1), self.config.start_speech_token, dtype=mx.int32)
        parts += [self.text_emb(text_tokens), self.speech_emb(start)]
        return mx.concatenate(parts, axis=1)

    # --- network ---

    def prefill(
        self, embeds: mx.array, cache_step: int = 256, pad: mx.array | None = None
    ) -> tuple[mx.array, KVCache]:
        """Run (B, L, D) input embeddings from position 0; the speech logits of the last position (B, V) and
        the cache for ``decode``. pad: (B,) for left-padded rows (``GPT2.__call__``)."""
        if embeds.shape[1] > self.config.n_positions:
            raise ValueError(
                f"the prefill is {embeds.shape[1]} positions long; the model has {self.config.n_positions}"
            )
        kv: list[mx.array] = []
        h = self.tfmr(embeds, kv, pad)
        return self.speech_head(h[:, -1]), KVCache.from_prefill(kv, cache_step)

    def decode(
        self, token: mx.array, position: mx.array, kv: list[mx.array], pad: mx.array | None = None
    ) -> tuple[mx.array, list[mx.array]]:
        """One speech token (B,) at absolute position ``position`` (an int32 scalar array, which is also its
        buffer index) -> its logits (B, V) and the key/value buffers with it written in. Upstream embeds a fed
        token with ``speech_emb`` only; GPT-2 adds ``wpe[position]``. Pure in its arrays, so that it can be
        compiled (generation/turbo.py); the caller keeps ``position`` below ``n_positions``.
        pad: (B,) int32 for rows left-padded to a common length (generation/turbo_batch.py): row b's sequence
        starts at buffer index pad[b], so its absolute position is ``position - pad[b]``, and it sees nothing
        before pad[b]."""
        positions = position if pad is None else position - pad
        return self._step(token, positions, BufferState.per_layer(kv, position, pad, "gpt2"))

    def decode_window(
        self,
        token: mx.array,
        positions: mx.array,
        at: mx.array,
        pad: mx.array,
        kv: list[mx.array],
        window: list[mx.array],
    ) -> tuple[mx.array, list[mx.array]]:
        """``decode`` for a batch in a ``BatchKVCache`` (generation/turbo_batch.py): ``positions`` (B,) int32
        is each row's absolute position (its wpe row: ``at[0] - pad`` unless the caller clamps it), ``at``
        [buffer index of this token, the window's base] (int32 (2,)), ``pad`` (B,) the rows' left padding,
        ``kv`` the cache's big buffers (read only), ``window`` its windows. Returns the logits (B, V) and the
        windows with the token written in."""
        return self._step(token, positions, WindowState.per_layer(kv, window, at, pad))

    def _step(
        self, token: mx.array, positions: mx.array, states: list[BufferState] | list[WindowState]
    ) -> tuple[mx.array, list[mx.array]]:
        """A decode step: token (B,) -> logits (B, V); ``ln_f`` and the speech head are one primitive on CUDA."""
        h, written = self.tfmr.decode(self.speech_emb(token)[:, None], positions, states)
        return project(self.speech_head, h, norm=self.tfmr.ln_f)[:, 0], written

    def __call__(self, embeds: mx.array) -> mx.array:
        """Teacher-forced pass: (B, N, D) input embeddings from position 0 -> speech logits (B, N, V), where
        position i predicts the token after it."""
        return self.speech_head(self.tfmr(embeds))

    # --- checkpoint ---

    @staticmethod
    def checkpoint_table(cfg: T3TurboConfig) -> dict[str, tuple]:
        """Upstream ``t3_turbo_v1.safetensors`` / ``t3_nano_v1.safetensors`` key -> (our key or None to drop,
        upstream shape[, layout]). HF GPT-2's Conv1D stores weights as (in, out): layout "gpt2_conv1d"."""
        d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.speech_vocab_size
        table: dict[str, tuple] = {
            # Unused at inference: GPT-2's token table (upstream deletes it after loading) and the text head.
            "tfmr.wte.weight": (None, (cfg.text_vocab_size, d)),
            "text_head.weight": (None, (cfg.text_vocab_size, d)),
            "tfmr.wpe.weight": ("tfmr.wpe.weight", (cfg.n_positions, d)),
            "tfmr.ln_f.weight": ("tfmr.ln_f.weight", (d,)),
            "tfmr.ln_f.bias": ("tfmr.ln_f.bias", (d,)),
            "cond_enc.spkr_enc.weight": ("cond_enc.spkr_enc.weight", (d, cfg.speaker_embed_size)),
            "cond_enc.spkr_enc.bias": ("cond_enc.spkr_enc.bias", (d,)),
            "text_emb.weight": ("text_emb.weight", (cfg.text_vocab_size, d)),
            "speech_emb.weight": ("speech_emb.weight", (v, d)),
            "speech_head.weight": ("speech_head.weight", (v, d)),
            "speech_head.bias": ("speech_head.bias", (v,)),
        }
        block = {
            "ln_1.weight": ((d,),),
            "ln_1.bias": ((d,),),
            "attn.c_attn.weight": ((d, 3 * d), "gpt2_conv1d"),
            "attn.c_attn.bias": ((3 * d,),),
            "attn.c_proj.weight": ((d, d), "gpt2_conv1d"),
            "attn.c_proj.bias": ((d,),),
            "ln_2.weight": ((d,),),
            "ln_2.bias": ((d,),),
            "mlp.c_fc.weight": ((d, f), "gpt2_conv1d"),
            "mlp.c_fc.bias": ((f,),),
            "mlp.c_proj.weight": ((f, d), "gpt2_conv1d"),
            "mlp.c_proj.bias": ((d,),),
        }
        for i in range(cfg.num_layers):
            for name, rule in block.items():
                key = f"tfmr.h.{i}.{name}"
                table[key] = (key, *rule)
        return table
