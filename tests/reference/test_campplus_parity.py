"""CAM++ parity with upstream chatterbox-tts 0.1.7 (``s3gen/xvector.py``) on random weights, fp32.

The upstream state dict goes through *our* ``sanitize`` with ``CAMPPlus.checkpoint_table`` and loads strictly
into our model. Error measure: relative L2, ||ours - ref|| / ||ref||.

Batching: upstream ``extract_feature`` zero-pads the rows of a batch to the longest and ``forward`` masks
nothing, so a padded row's embedding depends on its padding. Ours does the same computation, which the
padded-batch test checks; S3Gen itself embeds one reference at a time.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chatterbox.models.s3gen.xvector import CAMLayer as UpstreamCAMLayer
from chatterbox.models.s3gen.xvector import CAMPPlus as UpstreamCAMPPlus

from mlx_chatterbox.convert import sanitize
from mlx_chatterbox.models.campplus import CAMLayer, CAMPPlus, CAMPPlusConfig, segment_means

from .oracle import ours_from, randomize_campplus_, rel_l2

pytestmark = pytest.mark.reference

TOL = 1e-5
FULL = CAMPPlusConfig()
# Upstream only exposes the widths; the depth (12, 24, 16 layers) and the head stay full size.
NARROW = CAMPPlusConfig(feat_dim=16, embedding_size=24, growth_rate=8, bn_size=2, init_channels=32)
# Feature lengths: 97 -> 49 TDNN frames (one partial segment), 200 -> 100 (one full segment),
# 202 -> 101 (a 1-frame last segment), 301 -> 151 (a 51-frame last segment).
LENGTHS = (97, 200, 202, 301)
CONSTRUCTOR = ("feat_dim", "embedding_size", "growth_rate", "bn_size", "init_channels")


def upstream_campplus(cfg: CAMPPlusConfig, seed: int) -> UpstreamCAMPPlus:
    """An upstream ``CAMPPlus(memory_efficient=False)`` of ``cfg``'s widths, randomised, in eval mode."""
    fixed = {f.name for f in dataclasses.fields(cfg)} - set(CONSTRUCTOR)
    differ = sorted(k for k in fixed if getattr(cfg, k) != getattr(FULL, k))
    if differ:
        raise ValueError(f"upstream CAMPPlus hard-wires {differ}; only {CONSTRUCTOR} can differ")
    torch.manual_seed(seed)
    model = UpstreamCAMPPlus(**{k: getattr(cfg, k) for k in CONSTRUCTOR}, memory_efficient=False)
    randomize_campplus_(model, seed)
    return model.eval()


def features(batch: int, frames: int, feat_dim: int, seed: int) -> np.ndarray:
    """Log-mel-like features after upstream's CMN (per-utterance mean over time removed)."""
    x = 3.0 * np.random.default_rng(seed).standard_normal((batch, frames, feat_dim)).astype(np.float32)
    return x - x.mean(axis=1, keepdims=True)


@torch.inference_mode()
def reference(upstream: UpstreamCAMPPlus, feats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(head output (B, T, C·F/8), embedding (B, E)) of upstream's ``forward``."""
    x = torch.from_numpy(feats)
    head = upstream.head(x.permute(0, 2, 1)).permute(0, 2, 1)
    return head.numpy(), upstream(x).numpy()


@pytest.fixture(scope="module")
def full():
    upstream = upstream_campplus(FULL, seed=0)
    return upstream, ours_from(upstream, CAMPPlus, FULL)


@pytest.fixture(scope="module")
def narrow():
    upstream = upstream_campplus(NARROW, seed=1)
    return upstream, ours_from(upstream, CAMPPlus, NARROW)


def check(upstream, ours, feats, what: str) -> None:
    ref_head, ref_emb = reference(upstream, feats)
    x = mx.array(feats)
    head, emb = ours.head_features(x), ours(x)
    assert head.shape == ref_head.shape and emb.shape == ref_emb.shape
    e_head, e_emb = rel_l2(head, ref_head), rel_l2(emb, ref_emb)
    print(f"{what}: head rel L2 {e_head:.1e}, embedding rel L2 {e_emb:.1e}")
    assert e_head < TOL, f"{what}: head rel L2 {e_head:.2e}"
    assert e_emb < TOL, f"{what}: embedding rel L2 {e_emb:.2e}"


@pytest.mark.parametrize("frames", LENGTHS)
def test_full_size_batch_1(full, frames):
    check(*full, features(1, frames, FULL.feat_dim, seed=frames), f"full size, B=1, T={frames}")


@pytest.mark.parametrize("frames", (97, 301))
def test_full_size_batch_2(full, frames):
    check(*full, features(2, frames, FULL.feat_dim, seed=frames + 1), f"full size, B=2, T={frames}")


def test_full_size_zero_padded_batch_matches_upstream(full):
    feats = features(2, 301, FULL.feat_dim, seed=7)
    feats[1, 180:] = 0.0  # upstream extract_feature pads a shorter row with zeros
    check(*full, feats, "full size, zero-padded batch")


@pytest.mark.parametrize("frames", (97, 202))
def test_narrow(narrow, frames):
    check(*narrow, features(2, frames, NARROW.feat_dim, seed=frames + 2), f"narrow, B=2, T={frames}")


@pytest.mark.parametrize("frames", (1, 37, 99, 100, 101, 199, 250))
def test_segment_means_match_avg_pool1d_ceil_mode(frames):
    x = np.random.default_rng(frames).standard_normal((2, 5, frames)).astype(np.float32)  # (B, C, T)
    ref = F.avg_pool1d(torch.from_numpy(x), kernel_size=100, stride=100, ceil_mode=True).numpy()
    ours = segment_means(mx.array(x.transpose(0, 2, 1)), 100).transpose(0, 2, 1)
    assert ours.shape == ref.shape
    err = rel_l2(ours, ref)
    assert err < 1e-6, f"T={frames}: rel L2 {err:.2e}"


@pytest.mark.parametrize("frames", (50, 100, 101, 250))
def test_cam_layer(frames):
    cfg = CAMPPlusConfig(growth_rate=8, bn_size=4)
    upstream = UpstreamCAMLayer(32, 8, 3, stride=1, padding=2, dilation=2, bias=False)
    randomize_campplus_(upstream, seed=frames)
    prefix = "xvector.block2.tdnnd1.cam_layer."
    n = len(prefix)
    table = {
        k[n:]: (t[n:], *rest)
        for k, (t, *rest) in CAMPPlus.checkpoint_table(cfg).items()
        if k.startswith(prefix)
    }
    weights = {k: mx.array(v.numpy()) for k, v in upstream.state_dict().items()}
    ours = CAMLayer(cfg, kernel=3, dilation=2)
    ours.load_weights(list(sanitize(weights, table, "test").items()), strict=True)
    x = np.random.default_rng(frames).standard_normal((2, frames, 32)).astype(np.float32)
    with torch.inference_mode():
        ref = upstream(torch.from_numpy(x).permute(0, 2, 1)).permute(0, 2, 1).numpy()
    err = rel_l2(ours(mx.array(x)), ref)
    assert err < TOL, f"CAM layer, T={frames}: rel L2 {err:.2e}"
