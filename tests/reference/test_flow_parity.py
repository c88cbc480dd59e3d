"""S3Gen flow-front parity with upstream chatterbox-tts 0.1.7 (``s3gen/flow.py`` up to the decoder,
``transformer/upsample_encoder.py``) on random weights, fp32.

The upstream state dict goes through *our* ``sanitize`` with ``Flow.checkpoint_table`` and loads strictly into
our model. Error measure: relative L2, ||ours - ref|| / ||ref||, over all frames (padded ones included: ours
computes there exactly what upstream computes).

The reference path is the first half of ``CausalMaskedDiffWithXvec.inference`` (prompt tokens already
concatenated): length-masked ``input_embedding``, ``encoder``, ``encoder_proj``.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chatterbox.models.s3gen.flow import CausalMaskedDiffWithXvec
from chatterbox.models.s3gen.transformer.attention import RelPositionMultiHeadedAttention
from chatterbox.models.s3gen.transformer.embedding import EspnetRelPositionalEncoding
from chatterbox.models.s3gen.transformer.upsample_encoder import (
    PreLookaheadLayer,
    Upsample1D,
    UpsampleConformerEncoder,
)
from chatterbox.models.s3gen.utils.mask import make_pad_mask

from mlx_chatterbox.models.flow import Flow, FlowConfig, rel_position_encoding, rel_shift

from .oracle import ours_from, randomize_flow_, rel_l2

pytestmark = pytest.mark.reference

TINY_TOL = 1e-5
FULL_TOL = 1e-4
FULL = FlowConfig()
TINY = FlowConfig(
    vocab_size=300, hidden_size=64, num_heads=2, linear_units=128, num_blocks=2, num_up_blocks=2
)
# Upstream hard-wires the pre-lookahead and upsample layers at 512 channels, lookahead 3, stride 2, and builds
# exactly 4 up blocks; a smaller config replaces/truncates them (below), so only these may differ.
CONSTRUCTOR = (
    "vocab_size",
    "hidden_size",
    "num_heads",
    "linear_units",
    "num_blocks",
    "spk_embed_dim",
    "mel_dim",
)


def upstream_flow(cfg: FlowConfig, seed: int) -> CausalMaskedDiffWithXvec:
    """An upstream ``CausalMaskedDiffWithXvec`` (no decoder) with the encoder ``S3Token2Mel`` builds, at
    ``cfg``'s sizes, randomised, in eval mode."""
    fixed = [k for k in FlowConfig.__dataclass_fields__ if k not in CONSTRUCTOR]
    torch.manual_seed(seed)
    d = cfg.hidden_size
    encoder = UpsampleConformerEncoder(  # the arguments of s3gen.py: S3Token2Mel.__init__
        output_size=d,
        attention_heads=cfg.num_heads,
        linear_units=cfg.linear_units,
        num_blocks=cfg.num_blocks,
        dropout_rate=0.1,
        positional_dropout_rate=0.1,
        attention_dropout_rate=0.1,
        normalize_before=True,
        input_layer="linear",
        pos_enc_layer_type="rel_pos_espnet",
        selfattention_layer_type="rel_selfattn",
        input_size=d,
        use_cnn_module=False,
        macaron_style=False,
    )
    if any(getattr(cfg, k) != getattr(FULL, k) for k in fixed) or d != FULL.hidden_size:
        encoder.pre_lookahead_layer = PreLookaheadLayer(d, cfg.pre_lookahead_len)
        encoder.up_layer = Upsample1D(d, d, cfg.upsample_stride)
        if cfg.num_up_blocks > len(encoder.up_encoders):
            raise ValueError(f"upstream builds {len(encoder.up_encoders)} up blocks at most")
        encoder.up_encoders = encoder.up_encoders[: cfg.num_up_blocks]
    flow = CausalMaskedDiffWithXvec(
        input_size=d,
        output_size=cfg.mel_dim,
        spk_embed_dim=cfg.spk_embed_dim,
        vocab_size=cfg.vocab_size,
        token_mel_ratio=cfg.upsample_stride,
        pre_lookahead_len=cfg.pre_lookahead_len,
        encoder=encoder,
        decoder=None,
    )
    randomize_flow_(flow, seed)
    return flow.eval()


@torch.inference_mode()
def upstream_encode(flow: CausalMaskedDiffWithXvec, tokens: np.ndarray, lengths: np.ndarray):
    """h (after after_norm), mu (after encoder_proj) and the (B, 2N) mask, as ``inference`` computes them."""
    token, token_len = torch.from_numpy(tokens).long(), torch.from_numpy(lengths)
    mask = (~make_pad_mask(token_len)).unsqueeze(-1).float()
    h, h_masks = flow.encoder(flow.input_embedding(token) * mask, token_len)
    return h.numpy(), flow.encoder_proj(h).numpy(), h_masks[:, 0].numpy()


def batch(cfg: FlowConfig, lengths: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random ids padded to the longest row (upstream requires N = max(lengths)); pads hold random ids too."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (len(lengths), max(lengths))).astype(np.int32)
    return tokens, np.array(lengths, np.int32)


@pytest.fixture(scope="module")
def tiny():
    upstream = upstream_flow(TINY, seed=1)
    return upstream, ours_from(upstream, Flow, TINY)


@pytest.mark.parametrize("dim", [64, 512])
@pytest.mark.parametrize("length", [1, 2, 25, 333, 5003])
def test_rel_position_table(dim, length):
    # forward, not position_encoding: only forward extends the 5000-position table for T > 5000.
    _, ref = EspnetRelPositionalEncoding(dim, 0.0).eval()(torch.zeros(1, length, dim))
    ref = ref[0].numpy()
    ours = np.asarray(rel_position_encoding(length, dim))
    assert ours.shape == ref.shape == (2 * length - 1, dim)
    err = float(np.abs(ours - ref).max())
    # Same fp32 angles but for a frequency or two that torch rounds 1 ulp away (test below); that ulp
    # (<= 6e-8) is multiplied by the position |r| <= T - 1.
    bound = 2e-7 + 6e-8 * (length - 1)
    print(f"rel-pos table T={length} d={dim}: max abs err {err:.1e} (bound {bound:.1e})")
    assert err <= bound, f"max abs err {err:.2e} > {bound:.2e}"


@pytest.mark.parametrize("dim", [64, 512])
def test_rel_position_frequencies_within_one_ulp_of_torch(dim):
    """Ours are exp(fp32 exponent) correctly rounded; torch's CPU exp (SLEEF, 1-ulp accuracy) rounds a few
    near-ties the other way, which is the only source of table differences. How many depends on torch's SIMD
    path: d 512: 2 of 256 with AVX2, 5 of 256 with AVX-512; d 64: 1 of 32 with both.
    """
    from mlx_chatterbox.models.flow import _inverse_timescales

    exponents = torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(10000.0) / dim)
    ref = torch.exp(exponents).numpy()
    ours = np.asarray(_inverse_timescales(dim))
    assert np.array_equal(ours, np.exp(exponents.numpy().astype(np.float64)).astype(np.float32))
    ulps = np.abs(ours.view(np.int32) - ref.view(np.int32))
    print(
        f"inverse timescales d={dim}: {int((ulps > 0).sum())} of {ref.size} differ from torch, max {ulps.max()} ulp"
    )
    assert ulps.max() <= 1


@pytest.mark.parametrize("length", [1, 2, 9])
def test_rel_shift_matches_upstream(length):
    x = np.random.default_rng(length).standard_normal((2, 3, length, 2 * length - 1)).astype(np.float32)
    ref = RelPositionMultiHeadedAttention(1, 4, 0.0).rel_shift(torch.from_numpy(x)).numpy()
    assert np.array_equal(np.asarray(rel_shift(mx.array(x))), ref)


def test_embed_speaker(tiny):
    upstream, ours = tiny
    xv = np.random.default_rng(0).standard_normal((3, TINY.spk_embed_dim)).astype(np.float32) * 7
    with torch.inference_mode():
        ref = upstream.spk_embed_affine_layer(F.normalize(torch.from_numpy(xv), dim=1)).numpy()
    out = ours.embed_speaker(mx.array(xv))
    assert out.shape == ref.shape == (3, TINY.mel_dim)
    err = rel_l2(out, ref)
    print(f"embed_speaker: rel L2 {err:.1e}")
    assert err < TINY_TOL, f"embed_speaker rel L2 {err:.2e}"


@pytest.mark.parametrize("lengths", [(13,), (17, 9), (11, 16, 1)])
def test_encoder_tiny(tiny, lengths):
    upstream, ours = tiny
    tokens, lens = batch(TINY, lengths, seed=sum(lengths))
    ref_h, ref_mu, ref_mask = upstream_encode(upstream, tokens, lens)
    x = ours.embed_tokens(mx.array(tokens), mx.array(lens))
    h, mask = ours.encoder(x, mx.array(lens))
    mu, mask2 = ours.encode(mx.array(tokens), mx.array(lens))
    assert h.shape == ref_h.shape and mu.shape == ref_mu.shape == (
        len(lengths),
        2 * max(lengths),
        TINY.mel_dim,
    )
    assert np.array_equal(np.asarray(mask), ref_mask) and np.array_equal(np.asarray(mask2), ref_mask)
    err_h, err_mu = rel_l2(h, ref_h), rel_l2(mu, ref_mu)
    # Valid frames alone, per row: padding must not hide an error in a short row.
    valid_errs = [rel_l2(np.asarray(mu)[b, : 2 * n], ref_mu[b, : 2 * n]) for b, n in enumerate(lengths)]
    print(f"tiny encoder {lengths}: h rel L2 {err_h:.1e}, mu rel L2 {err_mu:.1e}, valid rows {valid_errs}")
    assert err_h < TINY_TOL, f"h rel L2 {err_h:.2e}"
    assert err_mu < TINY_TOL, f"mu rel L2 {err_mu:.2e}"
    assert max(valid_errs) < TINY_TOL, f"valid-frame rel L2 per row {valid_errs}"


def test_padded_row_matches_upstream_quirk_not_batch_of_one(tiny):
    """Upstream's pre-lookahead conv reads the padded frames (LN(bias)·√d, not zeros) after a short row, so the
    row's result in a padded batch differs from its batch-1 result; ours reproduces the padded-batch value."""
    upstream, ours = tiny
    tokens, lens = batch(TINY, (15, 8), seed=3)
    _, ref_pad, _ = upstream_encode(upstream, tokens, lens)
    _, ref_one, _ = upstream_encode(upstream, tokens[1:, :8], lens[1:])
    mu, _ = ours.encode(mx.array(tokens), mx.array(lens))
    short = np.asarray(mu)[1, :16]
    assert rel_l2(short, ref_pad[1, :16]) < TINY_TOL
    assert rel_l2(ref_pad[1, :16], ref_one[0]) > 1e-3  # the quirk is real (not a property of ours)


@pytest.mark.slow
def test_table_covers_the_real_flow_state_dict():
    from chatterbox.models.s3gen.s3gen import S3Token2Mel

    sd = S3Token2Mel().flow.state_dict()
    upstream = {k: tuple(v.shape) for k, v in sd.items() if not k.startswith("decoder.")}
    table = {k: rule[1] for k, rule in Flow.checkpoint_table(FULL).items()}
    assert table == upstream
    assert all(k.startswith("decoder.estimator.") for k in sd if k.startswith("decoder."))


@pytest.mark.slow
def test_encoder_full_size():
    upstream = upstream_flow(FULL, seed=2)
    ours = ours_from(upstream, Flow, FULL)
    tokens, lens = batch(FULL, (25, 18), seed=4)
    ref_h, ref_mu, ref_mask = upstream_encode(upstream, tokens, lens)
    mu, mask = ours.encode(mx.array(tokens), mx.array(lens))
    h, _ = ours.encoder(ours.embed_tokens(mx.array(tokens), mx.array(lens)), mx.array(lens))
    assert np.array_equal(np.asarray(mask), ref_mask)
    err_h, err_mu = rel_l2(h, ref_h), rel_l2(mu, ref_mu)
    xv = np.random.default_rng(5).standard_normal((2, FULL.spk_embed_dim)).astype(np.float32)
    with torch.inference_mode():
        ref_spk = upstream.spk_embed_affine_layer(F.normalize(torch.from_numpy(xv), dim=1)).numpy()
    err_spk = rel_l2(ours.embed_speaker(mx.array(xv)), ref_spk)
    print(f"full encoder (25, 18): h rel L2 {err_h:.1e}, mu rel L2 {err_mu:.1e}, spk rel L2 {err_spk:.1e}")
    assert err_h < FULL_TOL, f"h rel L2 {err_h:.2e}"
    assert err_mu < FULL_TOL, f"mu rel L2 {err_mu:.2e}"
    assert err_spk < FULL_TOL, f"spk rel L2 {err_spk:.2e}"
