"""S3 tokenizer v2 on a tiny random config, without torch: shapes, lengths, masks, FSQ codes, RoPE, the key table."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_chatterbox.convert import LAYOUTS, sanitize
from mlx_chatterbox.models.s3tokenizer import S3Tokenizer, S3TokenizerConfig, apply_rope, rope_table

TINY = S3TokenizerConfig(n_mels=16, n_state=64, n_heads=2, n_layers=2, fsmn_kernel=7)


def upstream_weights(cfg: S3TokenizerConfig, seed: int = 0) -> dict[str, mx.array]:
    """Random weights under upstream's key names and PyTorch shapes (what ``tokenizer.*`` holds)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for key, (_, shape, *_) in S3Tokenizer.checkpoint_table(cfg).items():
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        w = rng.standard_normal(shape) / np.sqrt(fan_in)
        if key.endswith("_ln.weight"):
            w = 1 + 0.1 * rng.standard_normal(shape)
        elif key.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        weights[key] = mx.array(w.astype(np.float32))
    return weights


@pytest.fixture(scope="module")
def model() -> S3Tokenizer:
    m = S3Tokenizer(TINY)
    m.load_weights(list(sanitize(upstream_weights(TINY), S3Tokenizer.checkpoint_table(TINY), "test").items()))
    mx.eval(m.parameters())
    return m


def random_mel(lengths: list[int], seed: int = 0) -> mx.array:
    """(B, max(lengths), n_mels), zero past each length."""
    rng = np.random.default_rng(seed)
    mel = rng.standard_normal((len(lengths), max(lengths), TINY.n_mels)).astype(np.float32)
    for i, n in enumerate(lengths):
        mel[i, n:] = 0.0
    return mx.array(mel)


def test_table_covers_every_parameter_with_its_shape():
    ours = dict(tree_flatten(S3Tokenizer(TINY).parameters()))
    table = S3Tokenizer.checkpoint_table(TINY)
    assert {rule[0] for rule in table.values()} == set(ours)
    for key, (target, shape, *layout) in table.items():
        mlx_shape = tuple(shape[i] for i in LAYOUTS[layout[0]]) if layout else shape
        assert ours[target].shape == mlx_shape, key
    # The depthwise FSMN kernel (d, 1, k) becomes (d, k, 1), used with groups = d.
    rule = table["encoder.blocks.1.attn.fsmn_block.weight"]
    assert rule == ("encoder.blocks.1.attn.fsmn_block.weight", (64, 1, 7), "conv1d")
    assert (
        "quantizer._codebook.project_down.weight" in table and "encoder.blocks.0.attn.key.bias" not in table
    )


def test_strict_load_of_converted_weights():
    m = S3Tokenizer(TINY)
    m.load_weights(
        list(sanitize(upstream_weights(TINY), S3Tokenizer.checkpoint_table(TINY), "test").items()),
        strict=True,
    )


@pytest.mark.parametrize("frames", [1, 2, 3, 4, 5, 7, 8, 9, 200, 203, 3000])
def test_code_length_formula(frames):
    expected = (((frames - 1) // 2 + 1) - 1) // 2 + 1
    assert S3TokenizerConfig.code_length(frames) == expected
    assert S3TokenizerConfig.code_length(frames) == -(-frames // 4)  # ceil(frames / 4): 100 Hz -> 25 Hz


def test_shapes_and_lengths_of_a_padded_batch_with_odd_lengths(model):
    lengths = [203, 157, 1]
    codes, code_lengths = model(random_mel(lengths), mx.array(lengths))
    assert codes.shape == (3, 51) and codes.dtype == mx.int32
    assert code_lengths.dtype == mx.int32
    assert code_lengths.tolist() == [TINY.code_length(n) for n in lengths] == [51, 40, 1]
    assert 0 <= codes.min().item() and codes.max().item() < TINY.codebook_size
    hidden, hidden_lengths = model.encode(random_mel(lengths), mx.array(lengths))
    assert hidden.shape == (3, 51, TINY.n_state) and hidden_lengths.tolist() == [51, 40, 1]


def test_rows_of_a_padded_batch_equal_the_rows_alone_whatever_the_padding(model):
    lengths = [203, 157, 6]
    batch = random_mel(lengths)
    # Longer padding holding large values: all of it is masked.
    garbage = np.full((3, 211, TINY.n_mels), 37.0, np.float32)
    for i, length in enumerate(lengths):
        garbage[i, :length] = np.array(batch[i, :length])
    garbage = mx.array(garbage)
    h0, n = model.encode(batch, mx.array(lengths))
    h1, _ = model.encode(garbage, mx.array(lengths))
    c0, _ = model(batch, mx.array(lengths))
    for i, length in enumerate(lengths):
        k = n[i].item()
        alone, _ = model.encode(batch[i : i + 1, :length], mx.array([length]))
        codes_alone, _ = model(batch[i : i + 1, :length], mx.array([length]))
        scale = np.abs(np.array(alone)).max()
        assert np.abs(np.array(h0[i, :k]) - np.array(alone[0])).max() < 1e-5 * scale
        assert np.abs(np.array(h1[i, :k]) - np.array(alone[0])).max() < 1e-5 * scale
        assert np.array_equal(np.array(c0[i, :k]), np.array(codes_alone[0]))


def test_fsq_digits_round_half_to_even_and_code_in_base_3():
    cfg = TINY
    fsq = S3Tokenizer(cfg).quantizer
    # project_down reads the first 8 hidden channels, scaled by 20: tanh saturates to ±0.999 -> ±1, 0 -> 0.
    w = np.zeros((cfg.fsq_dim, cfg.n_state), np.float32)
    w[np.arange(cfg.fsq_dim), np.arange(cfg.fsq_dim)] = 20.0
    fsq.project_down.weight = mx.array(w)
    fsq.project_down.bias = mx.zeros((cfg.fsq_dim,))
    signs = np.array([[1, 1, 1, 1, 1, 1, 1, 1], [-1] * 8, [0] * 8, [1, 0, -1, 0, 1, -1, -1, 1]], np.float32)
    hidden = np.zeros((1, 4, cfg.n_state), np.float32)
    hidden[0, :, : cfg.fsq_dim] = signs
    codes = fsq(mx.array(hidden))
    expected = [int(sum((s + 1) * 3**i for i, s in enumerate(row))) for row in signs]
    assert codes.tolist() == [expected] and expected[:3] == [6560, 0, 3280]
    # Round half to even, as torch.round: a digit of exactly ±0.5 is 0 (the middle level).
    assert mx.round(mx.array([0.5, -0.5, 1.5, 0.49999997])).tolist() == [0.0, 0.0, 2.0, 0.0]


def test_rope_is_identity_at_position_0_and_relative():
    cos, sin = rope_table(TINY)
    assert cos.shape == sin.shape == (TINY.rope_positions, TINY.head_dim)
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((1, 1, 1, TINY.head_dim)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 1, 1, TINY.head_dim)).astype(np.float32))
    assert np.allclose(np.array(apply_rope(q, cos[:1], sin[:1])), np.array(q))

    def score(m: int, n: int) -> float:
        return (
            apply_rope(q, cos[m : m + 1], sin[m : m + 1]) * apply_rope(k, cos[n : n + 1], sin[n : n + 1])
        ).sum()

    assert abs(score(5, 2).item() - score(103, 100).item()) < 1e-4


def test_input_checks(model):
    with pytest.raises(ValueError, match="3000-frame"):
        model(mx.zeros((1, 3001, TINY.n_mels)), mx.array([3001]))
    with pytest.raises(ValueError, match=r"\(B, T, 16\)"):
        model(mx.zeros((1, 40, 80)), mx.array([40]))
    with pytest.raises(ValueError, match="lengths must lie"):
        model(mx.zeros((2, 40, TINY.n_mels)), mx.array([41, 3]))
    with pytest.raises(ValueError, match="lengths must be"):
        model(mx.zeros((2, 40, TINY.n_mels)), mx.array([40]))


def test_bfloat16_weights_keep_int32_codes(model):
    m = S3Tokenizer(TINY)
    m.load_weights(list(tree_flatten(model.parameters())))
    m.set_dtype(mx.bfloat16)
    lengths = [41, 29]
    hidden, _ = m.encode(random_mel(lengths).astype(mx.bfloat16), mx.array(lengths))
    codes, _ = m(random_mel(lengths).astype(mx.bfloat16), mx.array(lengths))
    ref, _ = model.encode(random_mel(lengths), mx.array(lengths))
    assert hidden.dtype == mx.bfloat16 and codes.dtype == mx.int32
    err = np.linalg.norm(np.array(hidden.astype(mx.float32) - ref)) / np.linalg.norm(np.array(ref))
    assert err < 3e-2, f"bf16 rel L2 {err:.1e}"


def test_config_round_trips_through_json_and_rejects_bad_sizes():
    cfg = S3TokenizerConfig()
    assert cfg.head_dim == 64 and cfg.codebook_size == 6561 and cfg.code_length(cfg.max_frames) == 750
    with pytest.raises(ValueError, match="heads"):
        S3TokenizerConfig(n_state=66, n_heads=4)
    with pytest.raises(ValueError, match="RoPE"):
        S3TokenizerConfig(max_frames=10000)


def test_mlp_gelu_is_exact(model):
    # Upstream uses torch's erf GELU, not the tanh approximation (architecture §9.12).
    x = mx.linspace(-4, 4, 101)
    exact = 0.5 * np.array(x) * (1 + np.vectorize(math.erf)(np.array(x) / math.sqrt(2)))
    assert np.abs(np.array(model.encoder.blocks[0].mlp[1](x)) - exact).max() < 1e-6
