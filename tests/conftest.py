"""Tiny random configs and checkpoints that need neither torch nor the network."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx_chatterbox  # noqa: F401  isort: skip  (first: it configures MLX before mlx.core loads)
import mlx.core as mx  # isort: skip
import numpy as np
import pytest

from mlx_chatterbox.convert import S3GEN_PARTS, sanitize
from mlx_chatterbox.generation.voice import Voice
from mlx_chatterbox.models.campplus import CAMPPlusConfig
from mlx_chatterbox.models.cfm import CFMConfig
from mlx_chatterbox.models.flow import FlowConfig
from mlx_chatterbox.models.gpt2 import T3Turbo, T3TurboConfig
from mlx_chatterbox.models.hift import HiFTConfig
from mlx_chatterbox.models.s3tokenizer import S3TokenizerConfig
from mlx_chatterbox.models.t3 import T3, T3Config
from mlx_chatterbox.models.voice_encoder import VoiceEncoder, VoiceEncoderConfig
from mlx_chatterbox.variants import CHECKPOINTS, ModelConfig
from tests.toy_gpt2_tokenizer import VOCAB_SIZE as TOY_GPT2_VOCAB_SIZE
from tests.toy_gpt2_tokenizer import write_toy_gpt2_tokenizer
from tests.toy_mtl_tokenizer import write_toy_cangjie, write_toy_mtl_tokenizer
from tests.toy_tokenizer import write_toy_tokenizer

TINY = T3Config(hidden_size=64, num_layers=2, num_heads=4, head_dim=16, intermediate_size=128)
# Every network small; the interfaces between them (192-d x-vector, 80 mel bins, 6561 tokens) stay real.
TINY_MODEL = ModelConfig(
    t3=TINY,
    flow=FlowConfig(hidden_size=64, num_heads=2, linear_units=128, num_blocks=2, num_up_blocks=1),
    cfm=CFMConfig(channels=32, n_blocks=1, num_mid_blocks=1, num_heads=2, head_dim=16),
    hift=HiFTConfig(base_channels=32, f0_cond_channels=32),
    s3tokenizer=S3TokenizerConfig(n_state=64, n_heads=2, n_layers=1),
    campplus=CAMPPlusConfig(growth_rate=8, bn_size=2, init_channels=32),
    voice_encoder=VoiceEncoderConfig(hidden_size=32),
)


# Turbo at tiny sizes: a GPT-2 T3 over the toy GPT-2 tokenizer, the meanflow decoder (variants.md §2-3).
TINY_TURBO = dataclasses.replace(
    TINY_MODEL,
    variant="turbo",
    t3=T3TurboConfig(hidden_size=64, num_layers=2, num_heads=4, text_vocab_size=TOY_GPT2_VOCAB_SIZE),
    cfm=dataclasses.replace(TINY_MODEL.cfm, meanflow=True, cfg_rate=None),
)


# Multilingual (v2) at tiny sizes: the English T3's layout with the 2454-id text vocabulary, deep and wide enough
# for the alignment analyzer's (layer, head) pairs (9, 2), (12, 15), (13, 11).
TINY_MTL = dataclasses.replace(
    TINY_MODEL,
    variant="multilingual",
    t3=T3Config(
        hidden_size=64, num_layers=14, num_heads=16, head_dim=4, intermediate_size=128, text_vocab_size=2454
    ),
)
TINY_MTL_V3 = dataclasses.replace(TINY_MTL, variant="multilingual-v3")


def random_voice(seed: int = 0, prompt_len: int = 150, gen_tokens: int = 40) -> Voice:
    rng = np.random.default_rng(seed)
    return Voice(
        speaker_emb=mx.array(rng.standard_normal((1, 256)).astype(np.float32)),
        t3_prompt_tokens=mx.array(rng.integers(0, 6561, (1, prompt_len)).astype(np.int32)),
        s3gen_prompt_tokens=mx.array(rng.integers(0, 6561, (1, gen_tokens)).astype(np.int32)),
        s3gen_prompt_mel=mx.array(rng.standard_normal((1, 2 * gen_tokens, 80)).astype(np.float32)),
        xvector=mx.array(rng.standard_normal((1, 192)).astype(np.float32)),
    )


def assert_same_ids_kept(ours: np.ndarray, ref: np.ndarray, math: str) -> None:
    """Our probabilities are > 0 exactly where upstream's are (the same ids filtered out). With MLX's exp
    (``math`` "mlx", ``sampling.mlx_math``), which may flush to zero, ids whose upstream probability is
    subnormal (below float32's smallest normal number, never drawn) may come out 0."""
    decided = (ref == 0) | (ref >= np.finfo(np.float32).tiny) if math == "mlx" else np.ones(ref.shape, bool)
    np.testing.assert_array_equal((ours > 0)[decided], (ref > 0)[decided])


def upstream_t3_weights(cfg: T3Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under upstream's key names and shapes (what ``t3_cfg.safetensors`` holds)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for key, (_, shape, *_) in T3.checkpoint_table(cfg).items():
        w = 0.05 * rng.standard_normal(shape)
        weights[key] = (1 + 2 * w if key.endswith("norm.weight") else w).astype(np.float32)
    return weights


def upstream_s3gen_weights(cfg: ModelConfig = TINY_MODEL, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under upstream's ``s3gen.safetensors`` key names and shapes, from our tables; layers that
    upstream weight-norms are written as plain weights, which conversion accepts as well."""
    rng = np.random.default_rng(seed)
    weights = {}
    for prefix, name, network in S3GEN_PARTS:
        weights.update(random_weights(network.checkpoint_table(getattr(cfg, name)), rng, prefix))
    return weights


def random_weights(table: dict, rng: np.random.Generator, prefix: str = "") -> dict[str, np.ndarray]:
    """Random arrays for a key table: norm weights near 1, variances in [0.5, 1.5], other weights small."""
    weights = {}
    for key, (_, shape, *_) in table.items():
        if key.endswith("num_batches_tracked"):
            w = np.zeros(shape, np.int64)
        elif key.endswith(("running_var", "alpha")):
            w = rng.uniform(0.5, 1.5, shape)
        elif (len(shape) == 1 and "norm" in key or "_ln." in key) and key.endswith("weight"):
            w = 1 + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1 and "norm" in key or "_ln." in key:
            w = 0.1 * rng.standard_normal(shape)
        else:
            w = 0.05 * rng.standard_normal(shape)
        weights[prefix + key] = w if w.dtype == np.int64 else w.astype(np.float32)
    return weights


def write_upstream_checkpoint(folder: Path, cfg: ModelConfig = TINY_MODEL, seed: int = 0) -> Path:
    """An upstream-layout folder of ``cfg``'s variant (English: t3_cfg.safetensors, s3gen.safetensors,
    ve.safetensors, tokenizer.json; Turbo/Nano: t3_turbo_v1 / t3_nano_v1.safetensors,
    s3gen_meanflow.safetensors, ve.safetensors and the five GPT-2 tokenizer files; Multilingual:
    t3_mtl23ls_v2 / v3.safetensors, s3gen.pt, ve.pt, the grapheme tokenizer and the Cangjie map; a language
    pack: its t3_<lang>.safetensors and s3gen_v3.pt instead, the companions beside; no conds.pt), written
    without torch except the multilingual ``.pt`` state dicts (``torch.save``, as upstream's)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = CHECKPOINTS[cfg.variant]
    if cfg.variant == "english":
        weights = upstream_t3_weights(cfg.t3, seed)
        write_toy_tokenizer(folder / "tokenizer.json")
    elif isinstance(cfg.t3, T3Config):  # multilingual
        weights = upstream_t3_weights(cfg.t3, seed)
        write_toy_mtl_tokenizer(folder / names.tokenizer[0])
        write_toy_cangjie(folder / names.tokenizer[1])
    else:
        weights = random_weights(T3Turbo.checkpoint_table(cfg.t3), np.random.default_rng(seed))
        write_toy_gpt2_tokenizer(folder)
    mx.save_safetensors(str(folder / names.t3), {k: mx.array(v) for k, v in weights.items()})
    write_s3gen_and_ve(folder, cfg, seed)
    return folder


def write_s3gen_and_ve(folder: Path, cfg: ModelConfig = TINY_MODEL, seed: int = 0) -> None:
    """The checkpoint's files besides T3's and the tokenizer's, in upstream layout, with random weights."""
    folder.mkdir(parents=True, exist_ok=True)
    names = CHECKPOINTS[cfg.variant]
    s3gen = upstream_s3gen_weights(cfg, seed)
    ve = random_weights(VoiceEncoder.checkpoint_table(cfg.voice_encoder), np.random.default_rng(seed))
    for name, weights in ((names.s3gen, s3gen), (names.voice_encoder, ve)):
        if name.endswith(".pt"):
            import torch  # the tests' oracle; only the multilingual checkpoints need it

            torch.save({k: torch.from_numpy(np.array(v)) for k, v in weights.items()}, folder / name)
        else:
            mx.save_safetensors(str(folder / name), {k: mx.array(v) for k, v in weights.items()})


@pytest.fixture
def tiny_t3() -> T3:
    model = T3(TINY)
    weights = {k: mx.array(v) for k, v in upstream_t3_weights(TINY).items()}
    model.load_weights(list(sanitize(weights, T3.checkpoint_table(TINY), "test").items()), strict=True)
    return model


@pytest.fixture
def voice() -> Voice:
    return random_voice()


@pytest.fixture
def emulated(monkeypatch):
    """Our CUDA kernels' sources run on the CPU (tests/emulated_cuda.py), the CUDA paths taken where
    ``layers.CUDA_DECODE`` says (tests switch it off for their composed references), an H200's 132 SMs, and
    every kernel cache empty (a kernel is the emulation's only for the test)."""
    from mlx_chatterbox.generation import fused_sampling
    from mlx_chatterbox.models import cfm, layers
    from tests import emulated_cuda

    monkeypatch.setattr(mx.fast, "cuda_kernel", emulated_cuda.cuda_kernel, raising=False)
    monkeypatch.setattr(layers, "_use_cuda_paths", lambda: layers.CUDA_DECODE)
    monkeypatch.setattr(layers, "_sm_count", lambda: 132)
    for module, cache in ((layers, "_gemv_kernels"), (layers, "_decode_attention_kernels"),
                          (fused_sampling, "_kernels"), (cfm, "_tiled_kernels"),
                          (cfm, "_tiled_launches"), (layers, "_conv_kernels")):  # fmt: skip
        monkeypatch.setattr(module, cache, {})
