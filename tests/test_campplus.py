"""CAM++ x-vector on tiny random configs, without torch: shapes, lengths, segment pooling, the key table."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_chatterbox.convert import LAYOUTS, sanitize
from mlx_chatterbox.models.campplus import CAMLayer, CAMPPlus, CAMPPlusConfig, segment_means

TINY = CAMPPlusConfig(
    feat_dim=16,
    embedding_size=8,
    growth_rate=4,
    bn_size=2,
    init_channels=8,
    head_channels=4,
    block_layers=(2, 1),
    block_kernels=(3, 3),
    block_dilations=(1, 2),
    segment_length=10,
)


def upstream_weights(cfg: CAMPPlusConfig, seed: int = 0) -> dict[str, mx.array]:
    """Random weights under upstream's names and shapes, BatchNorm statistics away from the identity."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, (_, shape, *_) in CAMPPlus.checkpoint_table(cfg).items():
        if key.endswith("num_batches_tracked"):
            out[key] = mx.array(np.int64(7))
            continue
        if key.endswith("running_var"):
            w = rng.uniform(0.5, 1.5, shape)
        elif key.endswith("weight") and len(shape) == 1:  # BatchNorm affine weight
            w = 1 + 0.1 * rng.standard_normal(shape)
        elif key.endswith("weight"):
            w = rng.standard_normal(shape) * math.sqrt(2 / math.prod(shape[1:]))
        else:
            w = 0.1 * rng.standard_normal(shape)
        out[key] = mx.array(w.astype(np.float32))
    return out


def tiny_model(cfg: CAMPPlusConfig = TINY, seed: int = 0) -> CAMPPlus:
    model = CAMPPlus(cfg)
    table = CAMPPlus.checkpoint_table(cfg)
    model.load_weights(list(sanitize(upstream_weights(cfg, seed), table, "test").items()), strict=True)
    return model


def feats(batch: int, frames: int, cfg: CAMPPlusConfig = TINY, seed: int = 0) -> mx.array:
    x = np.random.default_rng(seed).standard_normal((batch, frames, cfg.feat_dim)).astype(np.float32)
    return mx.array(x - x.mean(axis=1, keepdims=True))


@pytest.fixture(scope="module")
def model() -> CAMPPlus:
    return tiny_model()


@pytest.mark.parametrize("frames", [3, 4, 7, 19, 20, 21, 41])
def test_shapes_at_odd_lengths(model, frames):
    x = feats(2, frames, seed=frames)
    head = model.head_features(x)
    emb = model(x)
    assert head.shape == (2, frames, TINY.head_out_channels)
    assert emb.shape == (2, TINY.embedding_size)
    assert bool(mx.all(mx.isfinite(emb)))


def test_rows_are_independent(model):
    # inference BatchNorm uses running statistics, so a row's embedding does not depend on its batch
    x = feats(2, 33, seed=1)
    both = model(x)
    for i in range(2):
        alone = model(x[i : i + 1])
        assert np.allclose(np.array(both[i]), np.array(alone[0]), rtol=1e-5, atol=1e-6)


def test_train_mode_does_not_change_batchnorm(model):
    x = feats(2, 25, seed=2)
    before = np.array(model(x))
    model.train()
    try:
        after = np.array(model(x))
    finally:
        model.eval()
    assert np.array_equal(before, after)


@pytest.mark.parametrize("frames", [37, 99, 100, 101, 199, 200, 250])
def test_segment_means_average_the_last_window_over_its_real_length(frames):
    x = np.random.default_rng(frames).standard_normal((2, frames, 3)).astype(np.float32)
    ref = np.stack([x[:, s : s + 100].mean(axis=1) for s in range(0, frames, 100)], axis=1)
    ours = np.array(segment_means(mx.array(x), 100))
    assert ours.shape == (2, math.ceil(frames / 100), 3)
    assert np.allclose(ours, ref, rtol=1e-5, atol=1e-6)
    if frames == 101:
        assert np.allclose(ours[:, 1], x[:, 100], atol=1e-6)  # a one-frame window is that frame


@pytest.mark.parametrize("frames", [7, 10, 11, 25, 30])
def test_cam_gate_per_segment_equals_per_frame_context(frames):
    # upstream broadcasts the segment means to frames and gates every frame; ours gates each segment once
    cam = CAMLayer(TINY, kernel=3, dilation=2)
    rng = np.random.default_rng(frames)
    params = tree_flatten(cam.parameters())
    cam.update(
        tree_unflatten([(k, mx.array(0.3 * rng.standard_normal(v.shape), mx.float32)) for k, v in params])
    )
    x = mx.array(rng.standard_normal((2, frames, TINY.bn_size * TINY.growth_rate)).astype(np.float32))
    seg = mx.repeat(segment_means(x, TINY.segment_length), TINY.segment_length, axis=1)[:, :frames]
    context = x.mean(axis=1, keepdims=True) + seg
    gate = mx.sigmoid(cam.linear2(mx.maximum(cam.linear1(context), 0)))
    ref = cam.linear_local(x) * gate
    assert np.allclose(np.array(cam(x)), np.array(ref), rtol=1e-5, atol=1e-6)


def test_stats_pooling_uses_unbiased_std():
    model = tiny_model()
    x = feats(1, 30, seed=3)
    frames = model.xvector.frames(model.head_features(x))[0]
    n = frames.shape[0]
    std = np.array(frames).std(axis=0, ddof=1)
    stats = np.concatenate([np.array(frames).mean(axis=0), std])[None]
    ref = model.xvector.dense(mx.array(stats.astype(np.float32)))
    assert n == 15
    assert np.allclose(np.array(model(x)), np.array(ref), rtol=1e-4, atol=1e-5)


def test_full_size_channels():
    cfg = CAMPPlusConfig()
    assert cfg.head_out_channels == 320
    assert cfg.block_channels == [(128, 512), (256, 1024), (512, 1024)]
    assert cfg.out_channels == 512


@pytest.mark.parametrize("cfg", [TINY, CAMPPlusConfig()], ids=["tiny", "full"])
def test_checkpoint_table_covers_the_model_exactly(cfg):
    params = dict(tree_flatten(CAMPPlus(cfg).parameters()))
    kept = {}
    for key, (target, shape, *layout) in CAMPPlus.checkpoint_table(cfg).items():
        if target is None:
            assert key.endswith("num_batches_tracked") and shape == ()
            continue
        kept[target] = tuple(shape[i] for i in LAYOUTS[layout[0]]) if layout else shape
    assert set(kept) == set(params)
    assert all(tuple(params[k].shape) == s for k, s in kept.items())


def test_full_size_parameter_count():
    # architecture §1: CAMPPlus 6.9 M floats in s3gen.safetensors (running statistics included)
    params = dict(tree_flatten(CAMPPlus().parameters()))
    assert sum(v.size for v in params.values()) == 6_930_720
    assert sum(v.size for k, v in params.items() if "running_" not in k) == 6_848_544


def test_sanitize_rejects_a_missing_key():
    weights = upstream_weights(TINY)
    del weights["xvector.block2.tdnnd1.cam_layer.linear2.bias"]
    with pytest.raises(ValueError, match="linear2.bias"):
        sanitize(weights, CAMPPlus.checkpoint_table(TINY), "s3gen.safetensors")


@pytest.mark.parametrize(
    "kwargs",
    [dict(feat_dim=20), dict(block_layers=(1, 2)), dict(tdnn_kernel=4), dict(block_kernels=(2, 3, 3))],
)
def test_config_rejects_impossible_sizes(kwargs):
    with pytest.raises(ValueError):
        CAMPPlusConfig(**kwargs)


def test_input_validation(model):
    with pytest.raises(ValueError, match="expected features"):
        model(mx.zeros((2, 30, TINY.feat_dim + 1)))
    with pytest.raises(ValueError, match="expected features"):
        model(mx.zeros((30, TINY.feat_dim)))
    with pytest.raises(ValueError, match="at least 3"):
        model(feats(1, 2))
    assert model(feats(1, 3)).shape == (1, TINY.embedding_size)
