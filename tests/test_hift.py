"""HiFT unit tests on a tiny random model (no torch): lengths, randomness arguments, the clamp, the STFT pair,
the exactness of the sine phase."""

from __future__ import annotations

import dataclasses
import json
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_chatterbox.convert import LAYOUTS, sanitize
from mlx_chatterbox.models import hift as hift_module
from mlx_chatterbox.models.hift import HiFT, HiFTConfig, istft, sine_phase, stft
from tests import compiled_cuda

TINY = HiFTConfig(base_channels=32, f0_cond_channels=16)


def upstream_hift_weights(cfg: HiFTConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under upstream's names and PyTorch shapes (weight norm already folded)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for key, (_, shape, *_) in HiFT.checkpoint_table(cfg).items():
        if key.endswith(".alpha"):
            w = rng.uniform(0.5, 1.5, shape)
        elif key.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / math.sqrt(math.prod(shape[1:]))
        weights[key] = w.astype(np.float32)
    weights["f0_predictor.classifier.weight"] *= 300.0  # f0 of tens to hundreds of Hz
    return weights


@pytest.fixture(scope="module")
def model() -> HiFT:
    hift = HiFT(TINY)
    weights = {k: mx.array(v) for k, v in upstream_hift_weights(TINY).items()}
    hift.load_weights(list(sanitize(weights, HiFT.checkpoint_table(TINY), "test").items()), strict=True)
    return hift


def random_mel(batch: int, frames: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((batch, frames, 80)).astype(np.float32))


def test_checkpoint_table_targets_are_exactly_our_parameters():
    ours = dict(tree_flatten(HiFT(TINY).parameters()))
    table = HiFT.checkpoint_table(TINY)
    assert {target for target, *_ in table.values()} == set(ours)
    for target, shape, *layout in table.values():
        expected = tuple(shape[i] for i in LAYOUTS[layout[0]]) if layout else shape
        assert ours[target].shape == expected, target


def test_full_size_table_has_upstream_shapes():
    table = HiFT.checkpoint_table(HiFTConfig())
    assert table["ups.0.weight"] == ("ups.0.weight", (512, 256, 16), "conv_transpose1d")
    assert table["source_downs.0.weight"][1] == (256, 18, 30)
    assert table["source_downs.2.weight"][1] == (64, 18, 1)
    assert table["resblocks.8.convs1.2.weight"][1] == (64, 64, 11)
    assert table["conv_post.weight"][1] == (18, 64, 7)
    assert table["f0_predictor.condnet.8.weight"][1] == (512, 512, 3)
    assert len(table) == 246  # upstream's mel2wav has 328 keys, 82 of them weight-norm pairs folded into one


@pytest.mark.parametrize("frames", [1, 3, 7])
def test_lengths_are_480_samples_per_frame(model, frames):
    mel = random_mel(2, frames)
    f0 = model.predict_f0(mel)
    assert f0.shape == (2, frames) and bool(mx.all(f0 >= 0))
    source = model.source(f0, key=mx.random.key(0))
    assert source.shape == (2, 480 * frames, 1)
    wav = model.decode(mel, source)
    assert wav.shape == (2, 480 * frames) and wav.dtype == mx.float32
    assert model(mel, key=mx.random.key(0)).shape == (2, 480 * frames)


def test_same_key_same_audio_other_key_other_audio(model):
    mel = random_mel(1, 5)
    a = model(mel, key=mx.random.key(1))
    b = model(mel, key=mx.random.key(1))
    c = model(mel, key=mx.random.key(2))
    assert mx.array_equal(a, b)
    assert not mx.allclose(a, c)


def test_key_draws_are_draw_source(model):
    f0 = model.predict_f0(random_mel(2, 3))
    key = mx.random.key(3)
    phases, noise = model.draw_source(2, 3, key)
    assert phases.shape == (2, 9) and noise.shape == (2, 1440, 9)
    assert bool(mx.all(phases[:, 0] == 0)) and bool(mx.all(mx.abs(phases) <= math.pi))
    assert mx.array_equal(model.source(f0, key=key), model.source(f0, phases=phases, noise=noise))


def test_randomness_is_given_one_way(model):
    f0 = mx.full((1, 2), 100.0)
    phases, noise = model.draw_source(1, 2, mx.random.key(0))
    with pytest.raises(ValueError, match="both phases and noise"):
        model.source(f0, phases=phases)
    with pytest.raises(ValueError, match="not both"):
        model.source(f0, phases=phases, noise=noise, key=mx.random.key(0))
    with pytest.raises(ValueError, match="must be"):
        model.source(f0, phases=phases, noise=noise[:, :-1])
    with pytest.raises(ValueError, match="source has shape"):
        model.decode(random_mel(1, 2), mx.zeros((1, 959, 1)))


def test_batch_rows_are_independent(model):
    mel = random_mel(2, 4, seed=5)
    phases, noise = model.draw_source(2, 4, mx.random.key(4))
    both = model(mel, phases=phases, noise=noise)
    for i in range(2):
        one = model(mel[i : i + 1], phases=phases[i : i + 1], noise=noise[i : i + 1])
        # fp32 rounding differs with the batch size (and the phase integrates f0's); cross-talk would be O(1)
        assert float(mx.abs(one[0] - both[i]).max()) < 1e-4


def test_rows_of_different_lengths_share_a_call(model):
    """Padded rows with their lengths: each row's samples are those of the row alone (every conv, the STFT's
    reflect padding and the iSTFT's overlap see only the row's frames), whatever the padding holds; rows as
    short as one frame, and odd lengths at every upsampling stage."""
    lengths = [7, 1, 4, 7, 3]
    width = max(lengths)
    rng = np.random.default_rng(9)
    mels, draws, alone = [], [], []
    for i, n in enumerate(lengths):
        mel = random_mel(1, n, seed=20 + i)
        mels.append(mel)
        draws.append(model.draw_source(1, n, mx.random.key(i)))
        alone.append(np.array(model(mel, phases=draws[-1][0], noise=draws[-1][1]))[0])

    def padded_call(fill: float) -> np.ndarray:
        """The rows in one call, padded with random mel frames and noise of ``fill`` (never zeros)."""
        junk = [rng.standard_normal((1, width - n, 80)).astype(np.float32) * fill for n in lengths]
        out = model(
            mx.concatenate([mx.concatenate([m, mx.array(j)], axis=1) for m, j in zip(mels, junk)]),
            phases=mx.concatenate([p for p, _ in draws]),
            noise=mx.concatenate(
                [
                    mx.pad(z, [(0, 0), (0, (width - n) * 480), (0, 0)], constant_values=fill)
                    for (_, z), n in zip(draws, lengths)
                ]
            ),
            lengths=mx.array(lengths, dtype=mx.int32),
        )
        assert out.shape == (len(lengths), width * 480) and np.isfinite(np.array(out)).all()
        return np.array(out)

    out, other = padded_call(3.0), padded_call(-5.0)
    for i, n in enumerate(lengths):
        # The same shapes: the padding cannot show in a row's samples, to the bit.
        assert np.array_equal(out[i, : n * 480], other[i, : n * 480]), f"row {i}: the padding leaks"
        # The row alone is another product shape, whose fp32 rounding BLAS may differ in, and the source's phase
        # integrates f0's: up to 2.6e-3 with OpenBLAS on an AMD Zen 5 (under 1e-4 on earlier hosts); a leak
        # would be O(0.1).
        np.testing.assert_allclose(out[i, : n * 480], alone[i], rtol=0, atol=1e-2)


def test_padded_stft_reflects_each_row_at_its_own_end():
    rng = np.random.default_rng(3)
    rows = [rng.standard_normal(n).astype(np.float32) for n in (40, 23, 9)]
    lengths = mx.array([len(r) for r in rows], dtype=mx.int32)
    calls = [
        stft(
            mx.array(np.stack([np.pad(r, (0, 40 - len(r)), constant_values=fill) for r in rows])),
            16,
            4,
            lengths,
        )
        for fill in (7.0, -3.0)
    ]
    for i, r in enumerate(rows):
        frames = 1 + len(r) // 4
        (re, im), (other_re, other_im) = ((a[i, :frames], b[i, :frames]) for a, b in calls)
        assert mx.array_equal(re, other_re) and mx.array_equal(im, other_im)  # either padding, to the bit
        # The row alone: another product shape, whose fp32 rounding BLAS may differ in (4.8e-7 with OpenBLAS on an
        # AMD Zen 5, 0 elsewhere); reflecting the padding instead would be O(1).
        one_re, one_im = stft(mx.array(r)[None], 16, 4)
        np.testing.assert_allclose(np.array(re), np.array(one_re[0]), rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.array(im), np.array(one_im[0]), rtol=0, atol=1e-5)


def test_source_is_the_harmonic_sum_in_voiced_and_scaled_noise_in_unvoiced_frames(model):
    """Frame 0 voiced at 200 Hz without noise: tanh(b + Σ_h w_h·0.1·sin(2π·h·200·(n+1)/24000 + φ_h)), where
    the phase counts the current sample (upstream's cumsum). Frame 1 unvoiced (5 Hz): noise·0.1/3 only."""
    f0 = mx.array([[200.0, 5.0]])
    rng = np.random.default_rng(0)
    phases = np.concatenate([[0.0], rng.uniform(-np.pi, np.pi, 8)])[None].astype(np.float32)
    noise = np.zeros((1, 960, 9), np.float32)
    noise[0, 480:] = rng.standard_normal((480, 9))
    got = np.array(model.source(f0, phases=mx.array(phases), noise=mx.array(noise)))[0, :, 0]
    w = np.array(model.m_source.l_linear.weight, np.float64)[0]
    b = float(np.array(model.m_source.l_linear.bias)[0])
    n = np.arange(1, 481)[:, None]
    h = np.arange(1, 10)[None]
    voiced = np.tanh(b + (0.1 * np.sin(2 * np.pi * h * 200.0 * n / 24000 + phases)) @ w)
    unvoiced = np.tanh(b + (0.1 / 3 * noise[0, 480:].astype(np.float64)) @ w)
    np.testing.assert_allclose(got[:480], voiced, atol=2e-6)
    np.testing.assert_allclose(got[480:], unvoiced, atol=2e-6)


def test_sine_phase_equals_fp32_rounded_exact_cumsum():
    """Upstream's torch.cumsum on the CPU rounds each float64 prefix sum to fp32; ours is bit-identical, here
    over 300 frames (6 s) where the 9th harmonic passes 10^4 cycles."""
    rng = np.random.default_rng(0)
    f0 = (150 + 100 * rng.random((2, 300))).astype(np.float32)
    f0[:, 100:110] = 0.0
    freq = mx.array(f0)[..., None] * mx.arange(1, 10, dtype=mx.float32) / 24000
    ours = np.array(sine_phase(freq, 480)).reshape(2, -1, 9)
    samples = np.repeat(np.array(freq), 480, axis=1).astype(np.float64)
    ref = np.cumsum(samples, axis=1).astype(np.float32) % 1
    assert np.array_equal(ours, ref)


def test_output_is_clamped_to_audio_limit():
    hift = HiFT(TINY)
    weights = {k: mx.array(v) for k, v in upstream_hift_weights(TINY, seed=1).items()}
    hift.load_weights(list(sanitize(weights, HiFT.checkpoint_table(TINY), "test").items()), strict=True)
    hift.conv_post.bias = hift.conv_post.bias + 6.0  # magnitudes exp(6) > 100: clipped, then loud
    wav = hift(random_mel(1, 4), key=mx.random.key(0))
    assert float(mx.abs(wav).max()) == pytest.approx(TINY.audio_limit)
    assert float(mx.mean(mx.abs(wav) == TINY.audio_limit)) > 0.01


@pytest.mark.parametrize("length", [1920, 1000])
def test_istft_inverts_stft(length):
    x = mx.array(np.random.default_rng(length).standard_normal((2, length)).astype(np.float32))
    re, im = stft(x, 16, 4)
    assert re.shape == (2, 1 + length // 4, 9)
    y = istft(re, im, 16, 4)
    assert y.shape == (2, length)
    assert float(mx.abs(y - x).max()) < 1e-5


def test_stft_of_a_tone_peaks_in_its_bin():
    n = mx.arange(800, dtype=mx.float32)
    re, im = stft(mx.cos(2 * math.pi * 3 * n / 16)[None], 16, 4)  # bin 3 of 16
    power = np.array(re**2 + im**2)[0, 4:-4]  # away from the reflect-padded edges
    assert (power.argmax(axis=-1) == 3).all()


def test_config_round_trips_through_json_and_rejects_bad_sizes():
    cfg = HiFTConfig()
    assert cfg.samples_per_frame == 480 and cfg.source_down_rates == (15, 3, 1) and cfg.num_harmonics == 9

    def tuples(v):
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v

    back = HiFTConfig(**{k: tuples(v) for k, v in json.loads(json.dumps(dataclasses.asdict(cfg))).items()})
    assert back == cfg
    with pytest.raises(ValueError):
        HiFTConfig(upsample_rates=(8, 5))
    with pytest.raises(ValueError):
        HiFTConfig(istft_n_fft=18)
    with pytest.raises(ValueError):
        HiFTConfig(base_channels=100)


def test_fused_snake_equals_the_composed_snake():
    """Snake's GPU path (one compiled kernel, ``_snake_fused``) computes the composed formula: on the CPU, where
    both run, within float32 rounding (fused kernels may contract a·b + c)."""
    x = 3 * mx.random.normal((2, 50, 16), key=mx.random.key(0))
    alpha = mx.random.uniform(0.2, 2.0, (16,), key=mx.random.key(1))
    fused, composed = hift_module._snake_fused(x, alpha), hift_module._snake(x, alpha)
    err = mx.abs(fused - composed).max().item()
    assert err <= 1e-6 * mx.abs(composed).max().item(), err


@pytest.mark.parametrize("lengths", [None, [7, 4]])
def test_kernel_convolutions_give_the_composed_f0_and_samples(model, emulated, monkeypatch, lengths):
    """``layers.KERNEL_CONVS``: every convolution of 16 or more input channels (the tiny model's first stages,
    the F0 predictor's, the upsamplings) as our CUDA kernel's source (emulated on the CPU), taking the padded
    frames' mask and the resblocks' residual sums; the rest composed as before. f0, and the samples of one
    source (the source's phase integrates f0's: a whole call's samples move by more, O(0.1) where f0 differs
    by float error)."""
    from mlx_chatterbox.models import layers

    mel = random_mel(2, 7, seed=5)
    phases, noise = model.draw_source(2, 7, mx.random.key(4))
    rows = None if lengths is None else mx.array(lengths, dtype=mx.int32)
    monkeypatch.setattr(layers, "KERNEL_CONVS", False)  # the composed reference (the kernel is the default)
    f0 = model.predict_f0(mel, rows)
    source = model.source(f0, phases=phases, noise=noise)
    want = np.array(model.decode(mel, source, rows))
    monkeypatch.setattr(layers, "KERNEL_CONVS", True)
    got_f0 = np.array(model.predict_f0(mel, rows))
    got = np.array(model.decode(mel, source, rows))
    # The kernel at both tile heights (compiled together at the first call), whatever the sizes, and no other.
    assert set(layers._conv_kernels) == {64, 128}
    # fp32 sums in another order; the decode's exp of its log-magnitudes (up to 100) scales their error.
    for i, n in enumerate(lengths or [7, 7]):
        np.testing.assert_allclose(got_f0[i, :n], np.array(f0)[i, :n], rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(got[i, : n * 480], want[i, : n * 480], rtol=0, atol=5e-4)


@pytest.mark.skipif(compiled_cuda.NVCC is None, reason="needs nvcc (CUDA's toolkit; no GPU)")
def test_every_kernel_convolution_of_the_full_model_builds_for_hopper_without_spills(monkeypatch):
    """Each convolution kernel a full-size HiFT launches (two rows of 20 frames, the second shorter; both tile
    heights at its first convolution), built by nvcc for sm_90a (tests/compiled_cuda.py): no spills, static
    shared memory within 48 KB. (Registers when written, a thread: 67 with 64-row tiles, 95 with 128.)"""
    from mlx_chatterbox.models import layers

    programs = compiled_cuda.record(monkeypatch)
    monkeypatch.setattr(layers, "KERNEL_CONVS", True)
    monkeypatch.setattr(layers, "_use_cuda_paths", lambda: True)
    monkeypatch.setattr(layers, "_conv_kernels", {})
    monkeypatch.setattr(layers, "_sm_count", lambda: 132)
    hift = HiFT(HiFTConfig())
    mx.eval(hift(random_mel(2, 20), key=mx.random.key(0), lengths=mx.array([20, 13], dtype=mx.int32)))
    convs = [p for p in programs if p.name == "conv"]
    # One kernel per tile height, both at the first call: the sizes, and whether a bias, mask or sum is read,
    # come at run time (a version that took them as constants compiled ~60 kernels in a served process, 0.6 s
    # each, run AQ).
    assert {dict(p.template)["BM"] for p in convs} == {64, 128} and len(convs) == 2
    for program in convs:
        used = compiled_cuda.resources(program)
        assert used.spill_bytes == 0 and used.shared_bytes <= compiled_cuda.STATIC_SHARED_LIMIT, (
            program,
            used,
        )
