"""Tiny random configs and checkpoints that need neither torch nor the network."""

from __future__ import annotations

from pathlib import Path

import mlx_chatterbox  # noqa: F401  isort: skip  (first: it configures MLX before mlx.core loads)
import mlx.core as mx  # isort: skip
import numpy as np
import pytest

from mlx_chatterbox.convert import sanitize
from mlx_chatterbox.generation.voice import Voice
from mlx_chatterbox.models.t3 import T3, T3Config
from tests.toy_tokenizer import write_toy_tokenizer

TINY = T3Config(hidden_size=64, num_layers=2, num_heads=4, head_dim=16, intermediate_size=128)


def random_voice(seed: int = 0, prompt_len: int = 150, gen_tokens: int = 40) -> Voice:
    rng = np.random.default_rng(seed)
    return Voice(
        speaker_emb=mx.array(rng.standard_normal((1, 256)).astype(np.float32)),
        t3_prompt_tokens=mx.array(rng.integers(0, 6561, (1, prompt_len)).astype(np.int32)),
        s3gen_prompt_tokens=mx.array(rng.integers(0, 6561, (1, gen_tokens)).astype(np.int32)),
        s3gen_prompt_mel=mx.array(rng.standard_normal((1, 2 * gen_tokens, 80)).astype(np.float32)),
        xvector=mx.array(rng.standard_normal((1, 192)).astype(np.float32)),
    )


def upstream_t3_weights(cfg: T3Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under upstream's key names and shapes (what ``t3_cfg.safetensors`` holds)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for key, (_, shape) in T3.checkpoint_table(cfg).items():
        w = 0.05 * rng.standard_normal(shape)
        weights[key] = (1 + 2 * w if key.endswith("norm.weight") else w).astype(np.float32)
    return weights


def write_upstream_checkpoint(folder: Path, cfg: T3Config = TINY, seed: int = 0) -> Path:
    """An upstream-layout folder (t3_cfg.safetensors + tokenizer.json, no conds.pt) written without torch."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: mx.array(v) for k, v in upstream_t3_weights(cfg, seed).items()}
    mx.save_safetensors(str(folder / "t3_cfg.safetensors"), weights)
    write_toy_tokenizer(folder / "tokenizer.json")
    return folder


@pytest.fixture
def tiny_t3() -> T3:
    model = T3(TINY)
    weights = {k: mx.array(v) for k, v in upstream_t3_weights(TINY).items()}
    model.load_weights(list(sanitize(weights, T3.checkpoint_table(TINY), "test").items()), strict=True)
    return model


@pytest.fixture
def voice() -> Voice:
    return random_voice()
