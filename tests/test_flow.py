"""Flow front (S3Gen token encoder) on a tiny random config: shapes, masks, padding invariances, the position
table and rel-shift identities, conversion. No torch; upstream parity is in reference/test_flow_parity.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_chatterbox.convert import ConversionError, sanitize
from mlx_chatterbox.models.flow import (
    Flow,
    FlowConfig,
    key_padding_mask,
    length_mask,
    rel_position_encoding,
    rel_shift,
)

TINY = FlowConfig(
    vocab_size=300, hidden_size=64, num_heads=2, linear_units=128, num_blocks=2, num_up_blocks=2
)


def upstream_weights(cfg: FlowConfig, seed: int = 0) -> dict[str, mx.array]:
    """Random weights under upstream's ``flow.`` key names (prefix removed) and PyTorch shapes."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, (_, shape, *_) in Flow.checkpoint_table(cfg).items():
        w = rng.standard_normal(shape) * (0.1 if len(shape) > 1 else 0.05)
        if "norm" in key and key.endswith("weight") or key.endswith("out.1.weight"):
            w = 1 + w
        out[key] = mx.array(w.astype(np.float32))
    return out


@pytest.fixture(scope="module")
def flow() -> Flow:
    model = Flow(TINY)
    model.load_weights(
        list(sanitize(upstream_weights(TINY), Flow.checkpoint_table(TINY), "test").items()), strict=True
    )
    return model


def tokens_for(
    lengths: tuple[int, ...], total: int | None = None, seed: int = 0
) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, TINY.vocab_size, (len(lengths), total or max(lengths)))
    return mx.array(tokens.astype(np.int32)), mx.array(np.array(lengths, np.int32))


def test_config_defaults_and_json_round_trip():
    cfg = FlowConfig()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.linear_units) == (6561, 512, 8, 2048)
    assert (cfg.num_blocks, cfg.num_up_blocks, cfg.pre_lookahead_len, cfg.upsample_stride) == (6, 4, 3, 2)
    assert (cfg.spk_embed_dim, cfg.mel_dim) == (192, 80)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        FlowConfig(hidden_size=66, num_heads=4)


def test_full_size_table_has_every_upstream_flow_key():
    table = Flow.checkpoint_table(FlowConfig())
    assert len(table) == 211  # upstream flow.state_dict() without decoder.*
    assert table["encoder.encoders.5.self_attn.pos_bias_u"] == (
        "encoder.encoders.5.self_attn.pos_bias_u",
        (8, 64),
    )
    assert table["encoder.up_layer.conv.weight"] == ("encoder.up_layer.conv.weight", (512, 512, 5), "conv1d")
    assert "encoder.up_encoders.3.norm_ff.bias" in table and "encoder.up_encoders.4.norm_ff.bias" not in table
    assert not any(k.startswith("decoder.") for k in table)


def test_sanitize_applies_conv_layout_and_refuses_wrong_shapes():
    weights = upstream_weights(TINY)
    out = sanitize(weights, Flow.checkpoint_table(TINY), "test")
    w = np.asarray(weights["encoder.pre_lookahead_layer.conv1.weight"])  # (out, in, k)
    assert np.array_equal(np.asarray(out["encoder.pre_lookahead_layer.conv1.weight"]), w.transpose(0, 2, 1))
    weights["encoder_proj.weight"] = mx.zeros((80, 63))
    with pytest.raises(ConversionError, match="encoder_proj.weight"):
        sanitize(weights, Flow.checkpoint_table(TINY), "test")


def test_masks():
    lengths = mx.array([3, 0, 5])
    assert np.asarray(length_mask(lengths, 5)).sum(axis=1).tolist() == [3, 0, 5]
    # a length-0 row attends to every key, as upstream forces it
    assert np.asarray(key_padding_mask(lengths, 5)).sum(axis=1).tolist() == [3, 5, 5]


@pytest.mark.parametrize("length", [1, 2, 7])
def test_rel_position_table_identities(length):
    pe = np.asarray(rel_position_encoding(length, 16))
    assert pe.shape == (2 * length - 1, 16)
    centre = pe[length - 1]  # relative position 0
    assert np.array_equal(centre[0::2], np.zeros(8)) and np.array_equal(centre[1::2], np.ones(8))
    mirrored = pe[::-1]  # row n <-> position -r
    assert np.array_equal(mirrored[:, 0::2], -pe[:, 0::2]) and np.array_equal(mirrored[:, 1::2], pe[:, 1::2])


@pytest.mark.parametrize("length", [1, 2, 6])
def test_rel_shift_picks_relative_position_i_minus_j(length):
    x = np.random.default_rng(0).standard_normal((2, 3, length, 2 * length - 1)).astype(np.float32)
    out = np.asarray(rel_shift(mx.array(x)))
    i, j = np.meshgrid(np.arange(length), np.arange(length), indexing="ij")
    assert np.array_equal(out, x[:, :, i, length - 1 - i + j])


@pytest.mark.parametrize("lengths", [(1,), (7,), (9, 4), (2, 11, 5)])
def test_encode_shapes_and_mask(flow, lengths):
    tokens, lens = tokens_for(lengths)
    mu, mask = flow.encode(tokens, lens)
    assert mu.shape == (len(lengths), 2 * max(lengths), TINY.mel_dim) and mu.dtype == mx.float32
    assert mask.dtype == mx.bool_ and np.asarray(mask).sum(axis=1).tolist() == [2 * n for n in lengths]
    assert np.isfinite(np.asarray(mu)).all()


def test_padded_token_ids_are_ignored(flow):
    tokens, lens = tokens_for((10, 6))
    other = np.asarray(tokens).copy()
    other[1, 6:] = [0, 299, 7, 1]
    a, _ = flow.encode(tokens, lens)
    b, _ = flow.encode(mx.array(other), lens)
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_longest_row_equals_its_batch_of_one(flow):
    tokens, lens = tokens_for((13, 8), seed=1)
    both, _ = flow.encode(tokens, lens)
    one, _ = flow.encode(tokens[:1], lens[:1])
    np.testing.assert_allclose(np.asarray(both[0]), np.asarray(one[0]), rtol=1e-5, atol=1e-5)


def test_extra_padding_beyond_the_lookahead_leaves_valid_frames_unchanged(flow):
    # A short row's last frames see lookahead-many padded frames (upstream behaviour); beyond that, more padding
    # is masked out of attention and must not matter.
    tokens, lens = tokens_for((9, 5), total=9, seed=2)
    wider = mx.concatenate([tokens, mx.zeros((2, 6), mx.int32)], axis=1)
    a, _ = flow.encode(tokens, lens)
    b, _ = flow.encode(wider, lens)
    np.testing.assert_allclose(np.asarray(b[1, :10]), np.asarray(a[1, :10]), rtol=1e-5, atol=1e-5)
    # Row 0 had no padding, so its lookahead saw zeros and now sees padded frames: it changes, as upstream's.
    assert not np.allclose(np.asarray(b[0, :18]), np.asarray(a[0, :18]), rtol=1e-3, atol=1e-3)


def test_length_zero_row_stays_finite(flow):
    tokens, _ = tokens_for((4, 4))
    mu, mask = flow.encode(tokens, mx.array([4, 0]))
    assert np.isfinite(np.asarray(mu)).all()
    assert np.asarray(mask).sum(axis=1).tolist() == [8, 8]  # upstream's forced-on mask


def test_embed_speaker_is_scale_invariant(flow):
    xv = mx.array(np.random.default_rng(0).standard_normal((2, TINY.spk_embed_dim)).astype(np.float32))
    a = flow.embed_speaker(xv)
    assert a.shape == (2, TINY.mel_dim)
    np.testing.assert_allclose(np.asarray(flow.embed_speaker(xv * 40)), np.asarray(a), rtol=1e-5, atol=1e-6)
    zero = flow.embed_speaker(mx.zeros((1, TINY.spk_embed_dim)))
    np.testing.assert_array_equal(np.asarray(zero[0]), np.asarray(flow.spk_embed_affine_layer.bias))


def test_bfloat16_weights_give_bfloat16_outputs(flow):
    model = Flow(TINY)
    model.update(flow.parameters())
    model.set_dtype(mx.bfloat16)
    tokens, lens = tokens_for((6, 3))
    mu, _ = model.encode(tokens, lens)
    ref, _ = flow.encode(tokens, lens)
    assert mu.dtype == mx.bfloat16
    err = np.linalg.norm(np.asarray(mu.astype(mx.float32)) - np.asarray(ref)) / np.linalg.norm(
        np.asarray(ref)
    )
    assert err < 5e-2, f"bf16 rel L2 {err:.2e}"
