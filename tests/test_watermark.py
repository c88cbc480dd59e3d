"""The Perth watermark without torch: the networks and the signal path on a tiny random model, then the real trained
weights (the packaged file, or converted on the fly from an installed resemble-perth, torch-free) on synthetic
voiced audio at several rates."""

from __future__ import annotations

import concurrent.futures
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_chatterbox.audio.resample import resample_polyphase
from mlx_chatterbox.audio.spectral import istft, stft
from mlx_chatterbox.convert import LAYOUTS
from mlx_chatterbox.generation import watermark
from mlx_chatterbox.generation.watermark import ASSET, Watermarker
from mlx_chatterbox.models.perth import PerthConfig, PerthNet, frame_mask, lerp_time, nearest_time

ROOT = Path(__file__).resolve().parents[1]
# 8 kHz "network rate", 64-point FFT, 4-bin watermark band: the whole signal path in milliseconds.
TINY = PerthConfig(
    sample_rate=8000, n_fft=64, hop_size=16, window_size=64, hidden_size=16, max_wmark_freq=500
)


def tiny_net(seed: int = 0, cfg: PerthConfig = TINY) -> PerthNet:
    rng = np.random.default_rng(seed)
    net = PerthNet(cfg)
    params = [
        (k, mx.array((0.3 * rng.standard_normal(v.shape)).astype(np.float32)))
        for k, v in tree_flatten(net.parameters())
    ]
    net.load_weights(params, strict=True)
    return net


def voiced(sr: int, seconds: float, seed: int = 0) -> np.ndarray:
    """A gliding 120 Hz harmonic tone, syllable-like envelope, light noise: speech-like for the detector."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(sr * seconds)) / sr
    phase = 2 * np.pi * np.cumsum(120 + 30 * np.sin(2 * np.pi * 0.7 * t)) / sr
    x = sum(np.sin(k * phase) / k for k in range(1, 30))
    env = np.clip(np.sin(2 * np.pi * 1.5 * t), 0, None) ** 0.5
    return (0.2 * x * env / np.abs(x).max() + 0.003 * rng.standard_normal(t.size)).astype(np.float32)


def expected_length(n: int, sr: int, cfg: PerthConfig) -> int:
    """perth's output length: the iSTFT keeps hop·(frames - 1) samples at the network rate, resampled with
    librosa's ceil rule both ways."""
    n_net = n if sr == cfg.sample_rate else math.ceil(n * (cfg.sample_rate / sr))
    kept = cfg.hop_size * (n_net // cfg.hop_size)
    return kept if sr == cfg.sample_rate else math.ceil(kept * (sr / cfg.sample_rate))


# --- the networks ---


def test_config_defaults_are_perths():
    cfg = PerthConfig()
    assert (cfg.n_freq, cfg.subband) == (1025, 128)
    assert TINY.subband == 4
    with pytest.raises(ValueError, match="odd"):
        PerthConfig(kernel_size=6)


def test_checkpoint_table_covers_every_parameter():
    for cfg in (TINY, PerthConfig()):
        table = PerthNet.checkpoint_table(cfg)
        ours = dict(tree_flatten(PerthNet(cfg).parameters()))
        targets = {rule[0]: rule for rule in table.values() if rule[0] is not None}
        assert set(targets) == set(ours)
        for key, (_, shape, *layout) in targets.items():
            moved = tuple(shape[i] for i in LAYOUTS[layout[0]]) if layout else shape
            assert moved == tuple(ours[key].shape), key
    n_params = sum(v.size for _, v in tree_flatten(PerthNet(PerthConfig()).parameters()))
    assert n_params == 9_346_694  # the checkpoint's 9,351,815 minus the dropped AudioProcessor buffers


def test_frame_mask_gates_relative_to_loudest_frame():
    mag = mx.array(
        np.array([[[1.0, 1.0], [0.04, 0.05], [0.06, 0.05], [0.0, 0.0]]], np.float32)
    )  # sums 2, .09, .11, 0
    assert np.array(frame_mask(mag, 0.05)[0, :, 0]).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert np.array(frame_mask(mx.zeros((1, 5, 3)), 0.05)).sum() == 0  # silence: nothing passes 0 > 0


def test_interpolations():
    x = mx.arange(5, dtype=mx.float32)[None, :, None]
    np.testing.assert_allclose(np.array(lerp_time(x, 9))[0, :, 0], np.arange(9) / 2, atol=1e-6)
    np.testing.assert_allclose(np.array(lerp_time(x, 3))[0, :, 0], [0, 2, 4], atol=1e-6)
    assert np.array(nearest_time(x, 3))[0, :, 0].tolist() == [0, 1, 3]  # floor(i * 5/3)
    assert np.array(nearest_time(x, 6))[0, :, 0].tolist() == [0, 0, 1, 2, 3, 4]
    assert np.array(lerp_time(x, 5)).tolist() == np.array(x).tolist()


def test_encoder_changes_only_the_band_of_gated_frames():
    net = tiny_net()
    rng = np.random.default_rng(1)
    mag = rng.uniform(0.3, 0.7, (2, 20, TINY.n_freq)).astype(np.float32)
    mag[0, 5:9] = 0.001  # quiet frames: below 5% of the loudest, never marked
    marked, mask = net.encoder(mx.array(mag))
    marked, mask = np.array(marked), np.array(mask)
    assert marked.shape == mag.shape and mask.shape == (2, 20, 1)
    assert mask[0, 5:9].sum() == 0 and mask[1].all()
    np.testing.assert_array_equal(marked[..., TINY.subband :], mag[..., TINY.subband :])
    np.testing.assert_array_equal(marked[0, 5:9], mag[0, 5:9])
    assert np.abs(marked[..., : TINY.subband] - mag[..., : TINY.subband]).max() > 1e-3


def test_decoder_batch_matches_single_and_needs_two_frames():
    net = tiny_net()
    mag = np.random.default_rng(2).uniform(0, 1, (3, 17, TINY.n_freq)).astype(np.float32)
    batch = np.array(net.decoder(mx.array(mag)))
    single = [float(net.decoder(mx.array(mag[i : i + 1]))[0]) for i in range(3)]
    np.testing.assert_allclose(batch, single, rtol=1e-6)
    with pytest.raises(ValueError, match="2 frames"):
        net.decoder(mx.zeros((1, 1, TINY.n_freq)))


# --- generic DSP added for the watermark ---


@pytest.mark.parametrize("precision", [np.float64, np.float32])
@pytest.mark.parametrize("n", [100, 257, 1000])
def test_istft_inverts_stft(n, precision):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    spec = stft(x, 64, 16, dtype=np.complex128)
    y = istft(spec, 64, 16, precision=precision)
    assert y.dtype == np.float32 and y.shape == (16 * (n // 16),)
    np.testing.assert_allclose(y, x[: y.shape[0]], atol=1e-5)
    np.testing.assert_allclose(istft(spec, 64, 16, length=n, precision=precision), x, atol=1e-5)
    available = 64 // 2 + 16 * (spec.shape[0] - 1)  # samples the frames reach past the centre padding
    assert (
        istft(spec, 64, 16, length=available + 20, precision=precision)[available:].tolist() == [0.0] * 20
    )  # zero-padded, as torch


def overlap_add_istft(spec: np.ndarray, n_fft: int, hop: int, win: int, length: int | None) -> np.ndarray:
    """A frame-by-frame centered iSTFT in float64: the definition ``istft`` computes block-wise."""
    window = np.zeros(n_fft)
    window[(n_fft - win) // 2 :][:win] = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(win) / win)
    frames = np.fft.irfft(spec, n=n_fft, axis=-1) * window
    y, envelope = np.zeros(n_fft + hop * (len(frames) - 1)), np.zeros(n_fft + hop * (len(frames) - 1))
    for t, f in enumerate(frames):
        y[t * hop : t * hop + n_fft] += f
        envelope[t * hop : t * hop + n_fft] += window**2
    end = y.shape[0] - n_fft // 2 if length is None else n_fft // 2 + length
    y = y[n_fft // 2 : end] / envelope[n_fft // 2 : end]
    return np.concatenate([y, np.zeros(max(0, end - n_fft // 2 - y.shape[0]))])


@pytest.mark.parametrize("win", [20, 30])
@pytest.mark.parametrize("frames", [1, 2, 3, 4, 5, 6, 9])
def test_istft_is_overlap_add(frames, win):
    """``istft`` builds the envelope from cached edge rows once there are n_fft / hop frames (5 here, the hop
    not dividing n_fft) and by its loop below that: both are the plain overlap-add."""
    rng = np.random.default_rng(frames)
    spec = rng.standard_normal((frames, 16)) + 1j * rng.standard_normal((frames, 16))
    spec[:, [0, -1]] = spec[:, [0, -1]].real  # a real signal's DC and Nyquist bins
    lengths = [None, 7 * frames - 3]
    if win == 30:  # a shorter window leaves zeros at the frames' ends, where a longer output is refused
        lengths.append(15 + 7 * (frames - 1) + 9)
    for length in lengths:
        want = overlap_add_istft(spec, 30, 7, win, length)
        got = istft(spec, 30, 7, win, length=length, dtype=np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        fast = istft(spec.astype(np.complex64), 30, 7, win, length=length, precision=np.float32)
        np.testing.assert_allclose(fast, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="precision"):
        istft(spec, 30, 7, win, precision=np.float16)


def test_resample_polyphase_lengths_and_gain():
    for sr_in, sr_out, n in [(24000, 32000, 1001), (44100, 32000, 999), (32000, 16000, 7), (16000, 16000, 5)]:
        x = np.full(n, 0.5, np.float32)
        y = resample_polyphase(x, sr_in, sr_out)
        assert y.dtype == np.float32 and y.shape == (math.ceil(n * sr_out / sr_in),)
        if n > 500:  # unit DC gain away from the zero-padded edges
            np.testing.assert_allclose(y[y.size // 3 : 2 * y.size // 3], 0.5, atol=2e-3)
    with pytest.raises(ValueError, match="1-d"):
        resample_polyphase(np.zeros((2, 10), np.float32), 24000, 32000)


# --- the watermarker on the tiny model ---


@pytest.mark.parametrize("sr", [8000, 16000, 24000, 44100])
@pytest.mark.parametrize("n", [33, 1001, 4000])
def test_apply_lengths_and_dtype(sr, n):
    wm = Watermarker(tiny_net())
    n = n * sr // 8000
    y = wm.apply(voiced(sr, n / sr), sr)
    assert y.dtype == np.float32 and y.ndim == 1
    assert y.shape[0] == expected_length(n, sr, TINY)
    assert math.isfinite(wm.detect(y, sr)) and 0.0 <= wm.detect(y, sr) <= 1.0


def test_apply_and_detect_are_deterministic():
    wm = Watermarker(tiny_net())
    x = voiced(16000, 0.5)
    np.testing.assert_array_equal(wm.apply(x, 16000), wm.apply(x, 16000))
    assert wm.confidence(x, 16000) == wm.confidence(
        x.astype(np.float64), 16000
    )  # float64 is rounded to float32


def test_silence_and_short_clips():
    wm = Watermarker(tiny_net())
    silence = np.zeros(3000, np.float32)
    assert np.abs(wm.apply(silence, 8000)).max() < 1e-6
    magspec, phasor = wm.magphase(silence)  # |spec| == 0: the floor, and exp(i·angle) of the signed zeros
    assert not magspec.any()
    np.testing.assert_array_equal(phasor, np.exp(1j * np.angle(stft(silence, 64, 16))))
    subnormal = silence.copy()
    subnormal[::7] = 1e-41  # |spec| below float32's smallest normal: 1 / |spec| overflows
    _, phasor = wm.magphase(subnormal)
    np.testing.assert_allclose(np.abs(phasor), 1.0, rtol=1e-6)
    assert np.isfinite(wm.apply(subnormal, 8000)).all()
    assert math.isnan(wm.confidence(silence, 8000)) and wm.detect(silence, 8000) == 0.0
    assert not wm.is_watermarked(silence, 8000)
    short = voiced(8000, 32 / 8000)  # n_fft // 2 samples: perth's reflect padding cannot take it
    np.testing.assert_array_equal(wm.apply(short, 8000), short)
    assert wm.detect(short, 8000) == 0.0
    assert wm.apply(np.zeros(0, np.float32), 24000).shape == (0,)


@pytest.mark.parametrize(
    "cfg",
    [
        TINY,
        PerthConfig(
            sample_rate=8000, n_fft=64, hop_size=24, window_size=48, hidden_size=16, max_wmark_freq=500
        ),
    ],
    ids=["tiny", "short-window"],
)
@pytest.mark.parametrize("fft_rows", [watermark.FFT_ROWS, 16])
def test_spectra_on_the_device_match_the_host_path(monkeypatch, cfg, fft_rows):
    """``SPECTRA_ON_DEVICE``: the same steps in MLX (float32 FFTs) give the host path's audio to float32
    rounding, silence and subnormal samples included; a hop the window cannot cover is refused by both. With
    16 rows a block, the clips' frames span several blocks, the last one padded."""
    monkeypatch.setattr(watermark, "FFT_ROWS", fft_rows)
    wm = Watermarker(tiny_net(cfg=cfg))
    subnormal = np.zeros(3000, np.float32)
    subnormal[::7] = 1e-41
    clips = [(voiced(sr, seconds), sr) for sr, seconds in ((8000, 1.0), (24000, 0.37), (44100, 0.2))]
    clips += [(np.zeros(3000, np.float32), 8000), (subnormal, 8000)]
    monkeypatch.setattr(watermark, "SPECTRA_ON_DEVICE", False)
    host = [wm.apply(x, sr) for x, sr in clips]
    monkeypatch.setattr(watermark, "SPECTRA_ON_DEVICE", True)
    for (x, sr), want in zip(clips, host):
        got = wm.apply(x, sr)
        assert got.dtype == np.float32 and got.shape == want.shape
        if np.abs(want).max() < 1e-6:  # near silence: the floor's 1e-9 magnitudes and the phases of tiny bins
            assert np.abs(got - want).max() < 1e-10
        else:  # the random net's marks reach 1e8: float32 rounding, amplified by 10 ** (dB / 20)
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert err < 1e-5, f"rel err {err:.2e}"
    gaps = Watermarker(tiny_net(cfg=PerthConfig(**{**asdict(cfg), "hop_size": 64, "window_size": 64})))
    for on_device in (True, False):
        monkeypatch.setattr(watermark, "SPECTRA_ON_DEVICE", on_device)
        with pytest.raises(ValueError, match="overlap-add falls below 1e-11"):
            gaps.apply(voiced(8000, 0.5), 8000)


def test_the_devices_ffts_have_one_shape_and_run_one_thread_at_a_time(monkeypatch):
    """The device's FFTs see blocks of ``FFT_ROWS`` frames whatever the clip's length (MLX-CUDA makes a cuFFT
    plan per shape, and raises once it has made 256 in a process), and run under the lock that keeps marking
    threads from sharing MLX-CUDA's plans at once; several threads marking at once get what one thread gets.
    """
    monkeypatch.setattr(watermark, "SPECTRA_ON_DEVICE", True)
    wm = Watermarker(tiny_net())
    n = TINY.n_fft
    shapes = set()

    def recorded(fft):
        def run(x, *args, **kwargs):
            shapes.add((fft.__name__, x.shape, x.dtype))
            return fft(x, *args, **kwargs)

        return run

    monkeypatch.setattr(mx.fft, "rfft", recorded(mx.fft.rfft))
    monkeypatch.setattr(mx.fft, "irfft", recorded(mx.fft.irfft))
    clips = [voiced(8000, seconds, seed=i) for i, seconds in enumerate((0.05, 0.3, 0.71, 1.9))]
    alone = [wm.apply(x, 8000) for x in clips]
    rows = watermark.FFT_ROWS
    assert shapes == {("rfft", (rows, n), mx.float32), ("irfft", (rows, n // 2 + 1), mx.complex64)}

    # The lock is taken where the graph is evaluated: the FFTs run then, not when they are built.
    evaluated = []
    real_eval = mx.eval

    def watched(*args):
        evaluated.append(watermark._DEVICE_MARKING.locked())
        return real_eval(*args)

    monkeypatch.setattr(mx, "eval", watched)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda x: wm.apply(x, 8000), clips * 2))
    assert evaluated and all(evaluated)
    for got, want in zip(together, alone * 2):
        np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend (an NVIDIA GPU)")
def test_marking_clips_of_300_lengths_on_the_gpu():
    """On the GPU, in a fresh process with MLX's cache check on (``MLX_ENABLE_CACHE_THRASHING_CHECK=1``; the
    package turns it off by default): 300 clips of as many frame counts marked with the spectra on the device.
    With an FFT plan per frame count, MLX-CUDA 0.32.4 raised "Cache thrashing is happening" after 128 of them.
    """
    code = """
import numpy as np
from mlx_chatterbox.generation import watermark
from tests.test_watermark import TINY, Watermarker, tiny_net, voiced
watermark.SPECTRA_ON_DEVICE = True
wm = Watermarker(tiny_net())
for i in range(300):
    assert np.isfinite(wm.apply(voiced(8000, (TINY.n_fft + TINY.hop_size * i) / 8000), 8000)).all()
print("marked 300")
"""
    env = {**os.environ, "MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "marked 300" in done.stdout, done.stderr[-3000:]


def test_spectra_on_the_device_by_default_only_with_mlx_cuda(monkeypatch):
    """``SPECTRA_ON_DEVICE`` None (the default): the device where MLX runs on CUDA, the host elsewhere (the CPU
    here, and the CPU device of a CUDA build); True and False hold everywhere."""
    assert watermark.SPECTRA_ON_DEVICE is None
    cuda = hasattr(mx, "cuda") and mx.cuda.is_available()
    assert watermark.spectra_on_device() == (cuda and mx.default_device() == mx.gpu)
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)
    assert watermark.spectra_on_device() is False
    for setting in (True, False):
        monkeypatch.setattr(watermark, "SPECTRA_ON_DEVICE", setting)
        assert watermark.spectra_on_device() is setting


def test_bad_inputs_are_refused():
    wm = Watermarker(tiny_net())
    with pytest.raises(TypeError, match="int16"):
        wm.apply(np.zeros(100, np.int16), 8000)
    with pytest.raises(ValueError, match="1-D"):
        wm.apply(np.zeros((2, 100), np.float32), 8000)
    with pytest.raises(ValueError, match="NaN"):
        wm.detect(np.full(100, np.nan, np.float32), 8000)
    with pytest.raises(ValueError, match="sample_rate"):
        wm.apply(np.zeros(100, np.float32), 0)
    magspec, phasor = wm.magphase(voiced(8000, 0.1))
    with pytest.raises(TypeError, match="np.exp"):  # a phase in radians is not the phasor signal takes
        wm.signal(magspec, np.angle(phasor))
    with pytest.raises(ValueError, match="one shape"):
        wm.signal(magspec, phasor[:1])


def test_load_round_trip_and_errors(tmp_path):
    net = tiny_net(3)
    path = tmp_path / "tiny.safetensors"
    mx.save_safetensors(str(path), dict(tree_flatten(net.parameters())), metadata=Watermarker.metadata(TINY))
    wm = Watermarker.load(path)
    assert wm.config == TINY
    x = voiced(8000, 0.4)
    np.testing.assert_array_equal(wm.apply(x, 8000), Watermarker(net).apply(x, 8000))
    with pytest.raises(FileNotFoundError, match="convert_perth.py"):
        Watermarker.load(tmp_path / "missing.safetensors")
    mx.save_safetensors(str(tmp_path / "other.safetensors"), {"a": mx.zeros(1)})
    with pytest.raises(ValueError, match="not a converted Perth"):
        Watermarker.load(tmp_path / "other.safetensors")


# --- the real trained weights, torch-free ---


@pytest.fixture(scope="module")
def real_weights(tmp_path_factory) -> Path:
    """The packaged weights, else resemble-perth's checkpoint converted by scripts/convert_perth.py in a
    subprocess where importing torch fails (the reader needs neither torch nor perth)."""
    if ASSET.is_file():
        return ASSET
    import importlib.metadata

    try:
        importlib.metadata.distribution("resemble-perth")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("no packaged perth weights and resemble-perth is not installed to convert them from")
    out = tmp_path_factory.mktemp("perth") / "perth_implicit.safetensors"
    code = (
        "import sys, runpy; sys.modules['torch'] = None; sys.modules['perth'] = None; "
        f"sys.argv = ['convert_perth.py', '--out', {str(out)!r}]; "
        f"runpy.run_path({str(ROOT / 'scripts' / 'convert_perth.py')!r}, run_name='__main__')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)
    return out


@pytest.fixture(scope="module")
def real(real_weights) -> Watermarker:
    return Watermarker.load(real_weights)


@pytest.mark.parametrize("sr", [24000, 16000, 44100])
def test_real_weights_mark_and_detect(real, sr):
    x = voiced(sr, 1.7, seed=sr)
    y = real.apply(x, sr)
    assert y.shape[0] == expected_length(x.shape[0], sr, real.config)
    n = min(x.shape[0], y.shape[0])
    snr = 10 * np.log10(np.sum(x[:n] ** 2) / np.sum((x[:n] - y[:n]) ** 2))
    assert snr > 10, f"the mark should sit well below the signal, SNR {snr:.1f} dB"
    marked, unmarked = real.detect(y, sr), real.detect(x, sr)
    assert real.is_watermarked(y, sr) and marked > 0.95, f"marked clip scored {marked:.4f}"
    assert not real.is_watermarked(x, sr) and unmarked < 0.05, f"unmarked clip scored {unmarked:.4f}"
