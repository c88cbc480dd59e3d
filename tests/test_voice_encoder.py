"""Voice encoder on tiny random configs, without torch: partial windows, coverage edges, the LSTM against a
float64 numpy LSTM, short mels, determinism, the key table."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_chatterbox.convert import sanitize
from mlx_chatterbox.models.voice_encoder import VoiceEncoder, VoiceEncoderConfig, num_partials

FULL = VoiceEncoderConfig()
# Tiny widths; the window geometry (160 frames, step 77) stays upstream's, so the coverage edges are real.
TINY = VoiceEncoderConfig(n_mels=8, hidden_size=16, num_layers=2, embedding_size=12)


def upstream_weights(cfg: VoiceEncoderConfig, seed: int = 0) -> dict[str, mx.array]:
    rng = np.random.default_rng(seed)
    scale = 1 / np.sqrt(cfg.hidden_size)  # PyTorch's LSTM init range
    return {
        key: mx.array(rng.uniform(-scale, scale, shape).astype(np.float32))
        for key, (_, shape) in VoiceEncoder.checkpoint_table(cfg).items()
    }


def model(cfg: VoiceEncoderConfig = TINY, seed: int = 0) -> VoiceEncoder:
    m = VoiceEncoder(cfg)
    table = VoiceEncoder.checkpoint_table(cfg)
    m.load_weights(list(sanitize(upstream_weights(cfg, seed), table, "ve.safetensors").items()), strict=True)
    return m


def mel(frames: int, cfg: VoiceEncoderConfig = TINY, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).gamma(0.5, 1.0, (frames, cfg.n_mels)).astype(np.float32)


def brute_force_windows(n_frames: int, win: int = 160, step: int = 77, coverage: int = 128) -> int:
    """Window k starts at k·step; the first is always kept, a later one iff real frames fill >= 0.8 of it."""
    return sum(1 for k in range(n_frames // step + 2) if k == 0 or n_frames - k * step >= coverage)


def test_frame_step_is_upstreams():
    assert FULL.frame_step == 77  # round(16000 / 1.3 / 160)
    assert VoiceEncoderConfig(rate=2.0).frame_step == 50


@pytest.mark.parametrize(
    "frames, expected",
    [
        (1, (1, 160)),
        (159, (1, 160)),
        (160, (1, 160)),
        (204, (1, 160)),  # 127 frames of a second window: below 0.8 coverage, dropped (44 frames ignored)
        (205, (2, 237)),  # 128/160 = 0.8 exactly: kept, 32 frames of padding
        (237, (2, 237)),
        (281, (2, 237)),
        (282, (3, 314)),
        (1000, (12, 1007)),
    ],
)
def test_num_partials_edges(frames, expected):
    assert num_partials(frames, FULL) == expected


def test_num_partials_matches_the_coverage_rule():
    for frames in range(1, 2000):
        n, target = num_partials(frames, FULL)
        assert n == brute_force_windows(frames), frames
        assert target == 160 + 77 * (n - 1)


@pytest.mark.parametrize("frames", [1, 37, 160, 204, 205, 400])
def test_partials_are_zero_padded_windows(frames):
    x = mel(frames)
    n, target = num_partials(frames, TINY)
    padded = np.concatenate([x, np.zeros((max(target - frames, 0), TINY.n_mels), np.float32)])
    ours = np.array(model().partials(mx.array(x)))
    assert ours.shape == (n, 160, TINY.n_mels)
    for i in range(n):
        np.testing.assert_array_equal(ours[i], padded[77 * i : 77 * i + 160])


def test_frames_past_the_last_window_are_ignored():
    m, x = model(), mel(204)  # one window; frames 160..203 fall outside it
    y = x.copy()
    y[160:] = 100.0
    np.testing.assert_array_equal(np.array(m(mx.array(x))), np.array(m(mx.array(y))))


def numpy_lstm(x: np.ndarray, weights: dict[str, np.ndarray], layers: int) -> np.ndarray:
    """Final hidden state of the last layer, float64, PyTorch's equations."""
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    x = x.astype(np.float64)
    for k in range(layers):
        w_ih, w_hh = weights[f"lstm.weight_ih_l{k}"], weights[f"lstm.weight_hh_l{k}"]
        b = weights[f"lstm.bias_ih_l{k}"] + weights[f"lstm.bias_hh_l{k}"]
        h = np.zeros((x.shape[0], w_hh.shape[1]))
        c = np.zeros_like(h)
        out = []
        for t in range(x.shape[1]):
            i, f, g, o = np.split(x[:, t] @ w_ih.T + h @ w_hh.T + b, 4, axis=-1)
            c = sig(f) * c + sig(i) * np.tanh(g)
            h = sig(o) * np.tanh(c)
            out.append(h)
        x = np.stack(out, axis=1)
    return x[:, -1]


def test_lstm_and_embedding_against_numpy():
    weights = {k: np.array(v, np.float64) for k, v in upstream_weights(TINY, seed=3).items()}
    m = model(seed=3)
    partials = m.partials(mx.array(mel(300, seed=1)))  # 2 windows
    ref_h = numpy_lstm(np.array(partials), weights, TINY.num_layers)
    h = np.array(m.hidden(partials))
    assert np.abs(h - ref_h).max() < 1e-5
    raw = np.maximum(ref_h @ weights["proj.weight"].T + weights["proj.bias"], 0)
    ref_parts = raw / np.linalg.norm(raw, axis=-1, keepdims=True)
    assert np.abs(np.array(m.embed_partials(partials)) - ref_parts).max() < 1e-5
    ref = ref_parts.mean(axis=0)
    assert np.abs(np.array(m(mx.array(mel(300, seed=1)))) - ref / np.linalg.norm(ref)).max() < 1e-5


def test_windows_are_independent_in_the_batch():
    m = model()
    partials = m.partials(mx.array(mel(700)))
    batched = np.array(m.embed_partials(partials))
    for i in (0, partials.shape[0] - 1):
        np.testing.assert_allclose(np.array(m.embed_partials(partials[i : i + 1]))[0], batched[i], atol=1e-6)


@pytest.mark.parametrize("frames", [1, 5, 159, 160, 205, 1000])
def test_embedding_shape_and_norm(frames):
    out = model()(mx.array(mel(frames)))
    assert out.shape == (TINY.embedding_size,) and out.dtype == mx.float32
    assert abs(float(mx.linalg.norm(out)) - 1) < 1e-5
    assert float(out.min()) >= 0  # a mean of ReLU outputs


def test_short_mel_is_padded_not_rejected():
    # Upstream pads any mel shorter than a window with zeros; a 1-frame mel is one window of 159 zero frames.
    m, x = model(), mel(1)
    padded = np.concatenate([x, np.zeros((159, TINY.n_mels), np.float32)])
    np.testing.assert_array_equal(np.array(m(mx.array(x))), np.array(m(mx.array(padded))))


def test_rejects_empty_and_misshaped_mels():
    m = model()
    with pytest.raises(ValueError, match="at least one frame"):
        m(mx.zeros((0, TINY.n_mels)))
    with pytest.raises(ValueError, match=r"\(T, 8\)"):
        m(mx.zeros((1, 50, TINY.n_mels)))
    with pytest.raises(ValueError, match=r"\(T, 8\)"):
        m(mx.zeros((50, TINY.n_mels + 1)))


def test_deterministic():
    x = mx.array(mel(500))
    a, b = model(seed=5), model(seed=5)
    np.testing.assert_array_equal(np.array(a(x)), np.array(a(x)))
    np.testing.assert_array_equal(np.array(a(x)), np.array(b(x)))
    assert not np.array_equal(np.array(a(x)), np.array(model(seed=6)(x)))


def test_config_validation():
    with pytest.raises(ValueError, match="window step"):
        VoiceEncoderConfig(rate=0.5)  # step 200 > 160 frames
    with pytest.raises(ValueError, match="min_coverage"):
        VoiceEncoderConfig(min_coverage=0.0)


def test_checkpoint_table_covers_upstream_keys():
    table = VoiceEncoder.checkpoint_table(FULL)
    assert table["lstm.weight_ih_l0"] == ("lstm.0.weight_ih", (1024, 40))
    assert table["lstm.weight_hh_l2"] == ("lstm.2.weight_hh", (1024, 256))
    assert table["similarity_weight"][0] is None and table["similarity_bias"][0] is None
    assert len(table) == 4 * 3 + 4
    # every parameter of ours is filled by exactly one upstream key
    ours = {k for k, _ in tree_flatten(VoiceEncoder(FULL).parameters())}
    assert ours == {v[0] for v in table.values() if v[0] is not None}
