"""S3 tokenizer v2 parity with upstream (``s3tokenizer`` 0.3.0 as chatterbox-tts 0.1.7 uses it), random weights,
fp32.

The upstream state dict goes through *our* ``sanitize`` with ``S3Tokenizer.checkpoint_table`` and loads strictly
into *our* model. Both sides get the same (B, T, 128) log-mel and lengths. Hidden states before FSQ are compared
by relative L2 error; codes must be equal except where a pre-rounding value lies within 1e-4 of a rounding
boundary (counted and reported).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from chatterbox.models.s3tokenizer.s3tokenizer import S3Tokenizer as ChatterboxS3Tokenizer
from s3tokenizer.model_v2 import ModelConfig, S3TokenizerV2

from mlx_chatterbox.models.s3tokenizer import S3Tokenizer, S3TokenizerConfig

from .oracle import ours_from, randomize_s3tokenizer_, rel_l2

pytestmark = pytest.mark.reference

# Upstream hard-wires RoPE to 64 dims (``precompute_freqs_cis(64, ...)``), so the tiny model keeps heads of 64.
TINY = S3TokenizerConfig(n_state=128, n_heads=2, n_layers=2)
FULL = S3TokenizerConfig()
TOL_TINY, TOL_FULL = 1e-5, 1e-4
BOUNDARY = 1e-4  # a digit this close to a rounding boundary may round either way in fp32
# Buffers of Chatterbox's subclass (its log-mel front-end), recomputed by ours; the converter drops them.
FRONT_END_BUFFERS = ("_mel_filters", "window")


def upstream_s3tokenizer(cfg: S3TokenizerConfig, seed: int) -> torch.nn.Module:
    """An upstream tokenizer of ``cfg``'s sizes, randomised, eval mode, fp32: Chatterbox's own subclass at full
    size (it ignores a config), the base ``S3TokenizerV2`` otherwise."""
    fixed = S3TokenizerConfig(
        n_mels=cfg.n_mels, n_state=cfg.n_state, n_heads=cfg.n_heads, n_layers=cfg.n_layers
    )
    if cfg != fixed or cfg.head_dim != 64:
        raise ValueError(
            f"upstream fixes every size but n_mels/n_state/n_heads/n_layers, and heads of 64: {cfg}"
        )
    torch.manual_seed(seed)
    if cfg == FULL:
        model = ChatterboxS3Tokenizer("speech_tokenizer_v2_25hz")
    else:
        config = ModelConfig(
            n_mels=cfg.n_mels, n_audio_state=cfg.n_state, n_audio_head=cfg.n_heads, n_audio_layer=cfg.n_layers
        )
        model = S3TokenizerV2("speech_tokenizer_v2_25hz", config)
    randomize_s3tokenizer_(model, seed)
    return model.eval()


def log_mel_like(rng: np.random.Generator, lengths: list[int], n_mels: int = 128) -> np.ndarray:
    """(B, max(lengths), n_mels) values in the range of upstream's log-mel ((log10 + 4) / 4, within 2 of its
    max), smooth along time; zero past each length, as upstream's ``padding`` leaves them."""
    t = max(lengths)
    x = rng.standard_normal((len(lengths), t + 4, n_mels)).astype(np.float32)
    x = 0.5 * (x[:, :-4] + x[:, 1:-3] + x[:, 2:-2] + x[:, 3:-1] + x[:, 4:]) / 5**0.5
    mel = np.clip(0.4 * x + 0.3, -1.0, 1.0)
    for i, n in enumerate(lengths):
        mel[i, n:] = 0.0
    return mel.astype(np.float32)


@torch.inference_mode()
def calibrate_project_down_(model: torch.nn.Module, mel: np.ndarray, lengths: np.ndarray, seed: int) -> None:
    """Redraw ``project_down`` so that, on this input, each pre-tanh value is about N(0, 1) over the valid
    positions: the hidden states carry large per-channel offsets that would otherwise pin most FSQ digits to one
    level, and exact code equality would then test little."""
    x, n = torch.from_numpy(mel).transpose(1, 2).contiguous(), torch.from_numpy(lengths)
    hidden, hidden_len = model.encoder(x, n)
    valid = torch.arange(hidden.shape[1])[None] < hidden_len[:, None]
    h = hidden[valid].double()  # (N, n_state)
    proj = model.quantizer._codebook.project_down
    w = torch.randn(proj.weight.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    p = h @ w.T
    w = w / p.std(dim=0)[:, None]
    proj.weight.copy_(w.float())
    proj.bias.copy_((-(h @ w.T).mean(dim=0)).float())


@torch.inference_mode()
def run_upstream(model: torch.nn.Module, mel: np.ndarray, lengths: np.ndarray):
    """Upstream ``quantize`` (the path ``S3Tokenizer.forward`` takes), with the encoder output caught on the way,
    plus the pre-rounding FSQ values tanh(project_down(h))·0.999."""
    x, n = torch.from_numpy(mel).transpose(1, 2).contiguous(), torch.from_numpy(lengths)  # (B, 128, T)
    caught = []
    hook = model.encoder.register_forward_hook(lambda module, inputs, output: caught.append(output))
    try:
        codes, code_len = model.quantize(x, n)
    finally:
        hook.remove()
    ((hidden, hidden_len),) = caught
    h = model.quantizer._codebook.project_down(hidden).float().tanh() * 0.9990000128746033
    return hidden.numpy(), hidden_len.numpy(), codes.numpy(), code_len.numpy(), h.numpy()


def build(cfg: S3TokenizerConfig, seed: int) -> tuple[torch.nn.Module, S3Tokenizer]:
    upstream = upstream_s3tokenizer(cfg, seed)
    calibration = [200, 120]
    mel = log_mel_like(np.random.default_rng(seed + 100), calibration, cfg.n_mels)
    calibrate_project_down_(upstream, mel, np.array(calibration, np.int32), seed)
    return upstream, ours_from(upstream, S3Tokenizer, cfg, drop=FRONT_END_BUFFERS)


@pytest.fixture(scope="module")
def tiny():
    return build(TINY, seed=1)


@pytest.fixture(scope="module")
def full():
    return build(FULL, seed=2)


def check(upstream: torch.nn.Module, ours: S3Tokenizer, lengths: list[int], tol: float, seed: int) -> None:
    cfg = ours.config
    mel = log_mel_like(np.random.default_rng(seed), lengths, cfg.n_mels)
    n = np.array(lengths, np.int32)
    ref_h, ref_hl, ref_codes, ref_cl, digits = run_upstream(upstream, mel, n)

    h, hl = ours.encode(mx.array(mel), mx.array(n))
    codes, cl = ours(mx.array(mel), mx.array(n))
    assert h.shape == ref_h.shape and codes.shape == ref_codes.shape and codes.dtype == mx.int32
    assert np.array_equal(np.array(hl), ref_hl) and np.array_equal(np.array(cl), ref_cl)
    # Padded positions are computed as upstream computes them, so the whole tensor is compared.
    err = rel_l2(h, ref_h)
    valid = np.arange(ref_h.shape[1])[None] < ref_hl[:, None]
    err_valid = rel_l2(np.array(h)[valid], ref_h[valid])
    print(
        f"hidden {cfg.n_state}x{cfg.n_layers} lengths {lengths}: rel L2 {err:.2e} (valid rows {err_valid:.2e})"
    )
    assert err < tol, f"hidden rel L2 {err:.2e} >= {tol:.0e} (valid rows {err_valid:.2e})"

    # The test means something only if the digits cover all three levels and the codes are varied.
    d = np.round(digits[valid]) + 1
    assert all(len(np.unique(d[:, i])) == cfg.fsq_levels for i in range(cfg.fsq_dim)), "FSQ digits not spread"
    assert len(np.unique(ref_codes[valid])) > 0.8 * valid.sum(), "codes not varied enough to be a test"
    near = (np.abs(np.abs(digits) - 0.5) < BOUNDARY).any(axis=-1)
    mismatch = np.array(codes) != ref_codes
    print(
        f"codes: {mismatch.sum()} of {mismatch.size} differ; {near.sum()} positions within {BOUNDARY:.0e} of a "
        f"rounding boundary; {len(np.unique(ref_codes[valid]))} distinct codes in {valid.sum()} valid positions"
    )
    assert not (
        mismatch & ~near
    ).any(), f"{(mismatch & ~near).sum()} codes differ away from a rounding boundary"


@pytest.mark.parametrize("lengths", [[203, 157], [97]], ids=["padded-batch-2", "batch-1"])
def test_tiny(tiny, lengths):
    check(*tiny, lengths=lengths, tol=TOL_TINY, seed=3)


@pytest.mark.slow
@pytest.mark.parametrize("lengths", [[199, 141], [201]], ids=["padded-batch-2", "batch-1"])
def test_full_size(full, lengths):
    check(*full, lengths=lengths, tol=TOL_FULL, seed=4)


def test_chatterbox_state_dict_holds_front_end_buffers():
    """Chatterbox's subclass registers its mel filters and window as persistent buffers, so its state_dict()
    has them under ``tokenizer.`` (the real ``s3gen.safetensors`` may not): the converter must drop them and our
    table does not list them."""
    model = ChatterboxS3Tokenizer("speech_tokenizer_v2_25hz")
    keys = set(model.state_dict())
    assert {"_mel_filters", "window"} <= keys
    table = S3Tokenizer.checkpoint_table(FULL)
    assert keys - set(table) == set(FRONT_END_BUFFERS) and set(table) <= keys
    assert tuple(model.state_dict()["_mel_filters"].shape) == (128, 201)
