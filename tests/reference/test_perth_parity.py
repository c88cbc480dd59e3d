"""Perth implicit watermark parity with resemble-perth 1.0.1 (``PerthImplicitWatermarker``), fp32.

Networks: perth's ``Encoder`` / ``Decoder`` vs ours, on random tiny models (state dict -> our ``sanitize`` with
``PerthNet.checkpoint_table`` -> strict load) and on the real trained weights as ``scripts/convert_perth.py`` converts
them (torch-free reader). Signal path: the STFT magnitude/phase, the iSTFT, the polyphase resampler. Whole
pipeline: our ``apply`` vs perth's ``apply_watermark`` on espeak-ng speech, and cross-detection: audio marked by
either side is detected by the other with perth's own rule (``get_watermark`` == 1.0) and unmarked audio is not.
Error measure: relative L2, ||ours - ref|| / ||ref||, unless stated.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import shutil
import subprocess
from pathlib import Path

import librosa
import mlx.core as mx
import numpy as np
import pytest
import soundfile as sf
import torch
from mlx.utils import tree_flatten
from perth import PerthImplicitWatermarker
from perth.perth_net.perth_net_implicit.config import PerthConfig as UpstreamPerthConfig
from perth.perth_net.perth_net_implicit.config import default_hp
from perth.perth_net.perth_net_implicit.model.perth_net import PerthNet as UpstreamPerthNet

from mlx_chatterbox.audio.resample import resample_polyphase
from mlx_chatterbox.audio.spectral import istft, stft
from mlx_chatterbox.generation import watermark
from mlx_chatterbox.generation.watermark import Watermarker
from mlx_chatterbox.models.perth import PerthConfig, PerthNet

from .oracle import ours_from, rel_l2

pytestmark = pytest.mark.reference

ROOT = Path(__file__).resolve().parents[2]
NET_TOL = 1e-5  # networks on identical spectrogram inputs
# The whole apply_watermark (STFT in float64 vs torch's float32, network, iSTFT, two soxr passes); measured <= 2e-6.
APPLY_TOL = 1e-4
# Raw detector outputs of the two pipelines on the same audio; measured <= 2e-6 on speech and noise.
CONFIDENCE_ATOL = 1e-4
TINY = PerthConfig(
    sample_rate=8000, n_fft=64, hop_size=16, window_size=64, hidden_size=16, max_wmark_freq=500
)
TEXT = "Hello there. This sentence carries a quiet watermark."
SHORT_TEXT = "Quick test."


def upstream_config(cfg: PerthConfig) -> UpstreamPerthConfig:
    """perth's hyper-parameter tuple at ``cfg``'s sizes (training-only fields from its defaults)."""
    if dataclasses.replace(cfg, num_blocks=5, kernel_size=7, mask_ratio=0.05, headroom_db=15.0) != cfg:
        raise ValueError("perth hard-wires 5 blocks of k7 convs, a 5% frame gate and 15 dB headroom")
    return default_hp._replace(
        sample_rate=cfg.sample_rate,
        n_fft=cfg.n_fft,
        hop_size=cfg.hop_size,
        window_size=cfg.window_size,
        hidden_size=cfg.hidden_size,
        max_wmark_freq=cfg.max_wmark_freq,
        stft_magnitude_min=cfg.stft_magnitude_min,
    )


def randomize_perth_(module: torch.nn.Module, seed: int) -> None:
    """Randomise every conv of a perth ``PerthNet`` (or its encoder/decoder) in place: weights N(0, 1) scaled by
    1/sqrt(fan-in) (so activations stay O(1) through the seven layers), biases 0.1·N."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("conv.weight"):
                fan_in = p.shape[1] * p.shape[2]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
            elif name.endswith("conv.bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def upstream_perth(cfg: PerthConfig, seed: int) -> UpstreamPerthNet:
    """perth's ``PerthNet`` at ``cfg``'s sizes, randomised, in eval mode."""
    torch.manual_seed(seed)
    model = UpstreamPerthNet(upstream_config(cfg))
    randomize_perth_(model, seed)
    return model.eval()


def _script():
    spec = importlib.util.spec_from_file_location("convert_perth", ROOT / "scripts" / "convert_perth.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def perth():
    """perth's own watermarker with its shipped weights."""
    return PerthImplicitWatermarker()


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Watermarker:
    """Ours, from resemble-perth's checkpoint as scripts/convert_perth.py converts it."""
    script = _script()
    out = script.convert(
        script.installed_checkpoint(), tmp_path_factory.mktemp("perth") / "perth.safetensors"
    )
    return Watermarker.load(out)


def _sox(args: list[str]) -> None:
    subprocess.run(["sox", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, tuple[np.ndarray, int]]:
    """name -> (float32 samples, rate): espeak-ng speech converted by sox, speech in noise, noise, a chirp."""
    assert shutil.which("espeak-ng") and shutil.which("sox"), "the test clips need espeak-ng and sox"
    d = tmp_path_factory.mktemp("clips")
    subprocess.run(["espeak-ng", "-w", str(d / "long.wav"), TEXT], check=True, capture_output=True)
    subprocess.run(["espeak-ng", "-w", str(d / "short.wav"), SHORT_TEXT], check=True, capture_output=True)
    specs = {
        "speech_24k": ("long.wav", ["-r", "24000"], []),
        "short_24k": ("short.wav", ["-r", "24000"], ["pad", "0.0123", "0.0457"]),  # odd length, silent edges
        "speech_16k": ("long.wav", ["-r", "16000"], []),
        "speech_44k": ("long.wav", ["-r", "44100"], []),
        "speech_32k": ("short.wav", ["-r", "32000"], []),
    }
    out = {}
    for name, (src, opts, effects) in specs.items():
        _sox([str(d / src), *opts, str(d / f"{name}.wav"), *effects])
        x, sr = sf.read(str(d / f"{name}.wav"), dtype="float32")
        out[name] = (x, sr)
    _sox(
        ["-n", "-r", "24000", "-b", "16", str(d / "noise.wav"), "synth", "1.3337", "whitenoise", "vol", "0.3"]
    )
    out["noise_24k"] = (sf.read(str(d / "noise.wav"), dtype="float32")[0], 24000)
    _sox(
        [
            "-n",
            "-r",
            "24000",
            "-b",
            "16",
            str(d / "chirp.wav"),
            "synth",
            "1.2001",
            "sine",
            "60-9000",
            "vol",
            "0.5",
        ]
    )
    out["chirp_24k"] = (sf.read(str(d / "chirp.wav"), dtype="float32")[0], 24000)
    speech, sr = out["speech_24k"]
    rng = np.random.default_rng(0)
    out["speech_noise_24k"] = ((speech + 0.02 * rng.standard_normal(speech.shape)).astype(np.float32), sr)
    return out


def _to_ours(x: torch.Tensor) -> mx.array:
    return mx.array(x.numpy().transpose(0, 2, 1))  # (B, F, T) -> (B, T, F)


def _conf_err(ours: mx.array, ref: torch.Tensor) -> float:
    """Confidence error on the decision's scale: |ours - ref| / max(|ref|, 1), since unmarked audio scores ~1e-4."""
    ours, ref = np.array(ours, np.float64), ref.numpy().astype(np.float64)
    return float(np.max(np.abs(ours - ref) / np.maximum(np.abs(ref), 1.0)))


def _compare_networks(upstream: UpstreamPerthNet, ours: PerthNet, magspec: np.ndarray) -> dict[str, float]:
    """Encoder (watermarked magspec, mask) and decoder (confidence) of both on magspec (B, F, T)."""
    x = torch.from_numpy(magspec)
    with torch.no_grad():
        ref_marked, ref_mask = upstream.encoder(x)
        ref_conf = upstream.decoder(x)
        ref_conf_marked = upstream.decoder(ref_marked)
    marked, mask = ours.encoder(_to_ours(x))
    conf = ours.decoder(_to_ours(x))
    conf_marked = ours.decoder(_to_ours(ref_marked))
    np.testing.assert_array_equal(np.array(mask)[..., 0], ref_mask[:, 0].numpy())
    residual = np.array(marked).transpose(0, 2, 1) - magspec
    return {
        "marked": rel_l2(np.array(marked).transpose(0, 2, 1), ref_marked.numpy()),
        "residual": rel_l2(residual, (ref_marked - x).numpy()),
        "confidence": _conf_err(conf, ref_conf),
        "confidence_marked": _conf_err(conf_marked, ref_conf_marked),
        "mask_frames": float(ref_mask.sum()),
    }


def test_tiny_random_networks():
    upstream = upstream_perth(TINY, seed=0)
    ours = ours_from(upstream, PerthNet, TINY)
    rng = np.random.default_rng(0)
    magspec = rng.uniform(0.2, 0.8, (2, TINY.n_freq, 29)).astype(np.float32)
    magspec[0, :, 3:7] = 0.001  # gated-out frames
    magspec[1, :, -5:] *= 0.2
    errs = _compare_networks(upstream, ours, magspec)
    assert 0 < errs["mask_frames"] < 58
    for name in ("marked", "residual", "confidence", "confidence_marked"):
        assert errs[name] < NET_TOL, f"{name}: rel err {errs[name]:.2e} ({errs})"


@pytest.mark.parametrize("frames", [2, 3, 4, 41])
def test_tiny_random_networks_frame_counts(frames):
    """Few frames exercise the interpolation edges (int(T·1.25) == T at T <= 3, int(2·0.75) == 1)."""
    upstream = upstream_perth(TINY, seed=frames)
    ours = ours_from(upstream, PerthNet, TINY)
    magspec = np.random.default_rng(frames).uniform(0.2, 0.8, (1, TINY.n_freq, frames)).astype(np.float32)
    errs = _compare_networks(upstream, ours, magspec)
    assert max(errs["marked"], errs["confidence"], errs["confidence_marked"]) < NET_TOL, errs


def test_conversion_is_exact(ours, perth):
    """Every trained tensor, through the torch-free reader and the conv layout, equals perth's loaded module."""
    ref = {k: v.numpy() for k, v in perth.perth_net.state_dict().items() if not k.startswith("ap.")}
    got = dict(tree_flatten(ours.net.parameters()))
    assert set(got) == set(ref)
    for k, v in ref.items():
        want = v.transpose(0, 2, 1) if v.ndim == 3 else v
        np.testing.assert_array_equal(np.array(got[k]), want, err_msg=k)


def test_real_networks(ours, perth, clips):
    """The trained networks on perth's own spectrogram of speech (at 32 kHz, as apply_watermark makes it)."""
    x, sr = clips["speech_24k"]
    x32 = librosa.resample(x, orig_sr=sr, target_sr=32000)
    mag, _ = perth.perth_net.ap.signal_to_magphase(torch.from_numpy(x32))
    errs = _compare_networks(perth.perth_net, ours.net, mag[None].numpy())
    for name in ("marked", "residual", "confidence", "confidence_marked"):
        assert errs[name] < NET_TOL, f"{name}: rel err {errs[name]:.2e} ({errs})"


def test_magphase_and_signal(ours, perth, clips):
    """Our STFT -> normalised dB / phase and back, vs perth's AudioProcessor on the same 32 kHz samples.

    The complex spectra agree to float32 rounding; normalised dB differ only where torch's float32 FFT noise (about
    1e-7 of a frame's peak) replaces magnitudes that are really smaller, so dB are compared above that floor.
    """
    x, _ = clips["speech_32k"]
    ref_spec = perth.perth_net.ap.spectrogram(torch.from_numpy(x)).numpy()  # (F, T)
    spec = stft(x, 2048, 320, 2048, dtype=np.complex128).T
    spec_err = float(np.linalg.norm(spec - ref_spec) / np.linalg.norm(ref_spec))
    assert spec_err < 1e-6, f"complex STFT rel err {spec_err:.2e}"

    ref_mag, ref_phase = perth.perth_net.ap.signal_to_magphase(torch.from_numpy(x))
    mag, phase = ours.magphase(x)
    above = np.abs(ref_spec) > 1e-4 * np.abs(ref_spec).max()
    db_err = rel_l2(mag.T[above], ref_mag.numpy()[above])
    all_err = rel_l2(mag.T, ref_mag.numpy())
    assert (
        db_err < 1e-6
    ), f"normalised dB rel err {db_err:.2e} above -80 dB re peak ({all_err:.2e} over all bins)"

    # From identical (magspec, phase), the reconstruction differs by float32 rounding only.
    ref_y = perth.perth_net.ap.magphase_to_signal(ref_mag, ref_phase).numpy()
    y = ours.signal(ref_mag.numpy().T, np.exp(1j * ref_phase.numpy().astype(np.float64).T))
    assert y.shape == ref_y.shape == (320 * (x.shape[0] // 320),)
    y_err = rel_l2(y, ref_y)
    assert y_err < 1e-5, f"magphase -> signal rel err {y_err:.2e}"


@pytest.mark.parametrize(
    "sr_in,sr_out", [(24000, 32000), (16000, 32000), (44100, 32000), (22050, 32000), (32000, 24000)]
)
@pytest.mark.parametrize("n", [1, 7, 1001, 24013])
def test_resample_polyphase_vs_librosa(sr_in, sr_out, n):
    """librosa.resample(res_type='polyphase') = scipy's resample_poly, float32 accumulation; ours sums in float64."""
    x = (0.5 * np.random.default_rng(n).standard_normal(n)).astype(np.float32)
    ref = librosa.resample(x, orig_sr=sr_in, target_sr=sr_out, res_type="polyphase")
    got = resample_polyphase(x, sr_in, sr_out)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    err = float(np.abs(got - ref).max())
    assert err < 1e-6, f"max abs err {err:.2e}"


@pytest.mark.filterwarnings("ignore:The length of signal is shorter:UserWarning")  # torch, on "longer"
@pytest.mark.parametrize("n_fft,hop,win", [(2048, 320, 2048), (64, 16, 48), (400, 100, 400)])
@pytest.mark.parametrize("length", [None, "same", "longer"])
@pytest.mark.parametrize("precision", [np.float64, np.float32])
def test_istft_vs_torch(n_fft, hop, win, length, precision):
    n = 5003
    x = np.random.default_rng(n_fft).standard_normal(n).astype(np.float32)
    window = torch.hann_window(win)
    spec = torch.stft(torch.from_numpy(x), n_fft, hop, win, window=window, return_complex=True)
    size = {None: None, "same": n, "longer": n_fft // 2 + hop * (spec.shape[1] - 1) + 37}[length]
    try:
        ref = torch.istft(spec, n_fft, hop, win, window=window, length=size).numpy()
    except RuntimeError:
        # torch checks the envelope up to the frames' reach, which the window's tail (2048: 5.5e-12 < 1e-11, or a
        # zero-padded corner) can fail; ours must refuse the same requests.
        with pytest.raises(ValueError, match="overlap-add"):
            istft(spec.numpy().T, n_fft, hop, win, length=size, precision=precision)
        return
    got = istft(spec.numpy().T, n_fft, hop, win, length=size, precision=precision)
    assert got.shape == ref.shape and got.dtype == np.float32
    err = rel_l2(got, ref)
    # Past the last full overlap the envelope falls towards 0 and the division magnifies float32 rounding.
    tol = 1e-4 if length == "longer" else 1e-6
    assert err < tol, f"rel err {err:.2e}"


APPLY_CLIPS = (
    "speech_24k",
    "short_24k",
    "speech_noise_24k",
    "noise_24k",
    "chirp_24k",
    "speech_16k",
    "speech_44k",
    "speech_32k",
)


@pytest.fixture(scope="module")
def marked(ours, perth, clips):
    """name -> (ours apply, perth apply_watermark), computed once per clip."""
    cache = {}

    def get(name: str) -> tuple[np.ndarray, np.ndarray]:
        if name not in cache:
            x, sr = clips[name]
            cache[name] = ours.apply(x, sr), perth.apply_watermark(x, sample_rate=sr)
        return cache[name]

    return get


@pytest.mark.parametrize("name", APPLY_CLIPS)
def test_apply_matches_perth(clips, marked, name):
    x, _ = clips[name]
    got, ref = marked(name)
    assert got.dtype == ref.dtype == np.float32
    assert got.shape == ref.shape, f"length {got.shape} vs perth {ref.shape} (input {x.shape})"
    err = rel_l2(got, ref)
    assert err < APPLY_TOL, f"{name}: apply rel err {err:.2e}"


@pytest.mark.parametrize("name", ["speech_24k", "short_24k", "noise_24k", "speech_44k"])
def test_apply_with_spectra_on_the_device_matches_perth(ours, clips, marked, name, monkeypatch):
    monkeypatch.setattr(watermark, "SPECTRA_ON_DEVICE", True)
    x, sr = clips[name]
    got, ref = ours.apply(x, sr), marked(name)[1]
    assert got.dtype == ref.dtype == np.float32 and got.shape == ref.shape
    err = rel_l2(got, ref)
    assert err < APPLY_TOL, f"{name}: apply rel err {err:.2e}"


def _perth_confidence(perth, wav: np.ndarray, sr: int) -> float:
    """perth's detector output before clipping and rounding, along get_watermark's own path (polyphase
    resampling, its AudioProcessor, its decoder)."""
    if sr != 32000:
        wav = librosa.resample(wav, orig_sr=sr, target_sr=32000, res_type="polyphase")
    mag, _ = perth.perth_net.ap.signal_to_magphase(torch.from_numpy(wav))
    with torch.no_grad():
        return float(perth.perth_net.decoder(mag[None])[0])


def _perth_rule(confidence: float) -> float:
    """get_watermark's decision from the raw confidence: clip to [0, 1], then round (half to even)."""
    return float(torch.tensor(confidence).clip(0.0, 1.0).round())


def test_perth_rule_helper_is_get_watermark(perth, clips, marked):
    """The raw-confidence helper reproduces perth's get_watermark, so the decisions below are perth's own."""
    x, sr = clips["short_24k"]
    _, perth_marked = marked("short_24k")
    for wav in (x, perth_marked):
        raw = _perth_confidence(perth, wav, sr)
        assert float(perth.get_watermark(wav, sr, round=False)) == min(max(raw, 0.0), 1.0)
        assert float(perth.get_watermark(wav, sr)) == _perth_rule(raw)


# Speech, speech in noise and noise; not the chirp: a pure tone's spectrum is mostly sidelobes at the level of
# torch's float32 FFT noise, so perth's own score on it sits near 0.5 and moves with FFT rounding.
DETECT_CLIPS = (
    "speech_24k",
    "short_24k",
    "speech_noise_24k",
    "noise_24k",
    "speech_16k",
    "speech_44k",
    "speech_32k",
)


@pytest.mark.parametrize("name", DETECT_CLIPS)
def test_cross_detection(ours, perth, clips, marked, name):
    """Ours-marked audio is marked for perth, perth-marked audio for us, unmarked audio for neither, by perth's rule
    (get_watermark == 1.0: round(clip(confidence, 0, 1))); the raw confidences of the two detectors agree."""
    x, sr = clips[name]
    ours_marked, perth_marked = marked(name)
    for label, wav, expected in (
        ("unmarked", x, 0.0),
        ("perth-marked", perth_marked, 1.0),
        ("ours-marked", ours_marked, 1.0),
    ):
        want = _perth_confidence(perth, wav, sr)
        got = ours.confidence(wav, sr)
        assert _perth_rule(want) == expected, f"{name} {label}: perth's confidence {want:.6f}"
        assert float(round(ours.detect(wav, sr))) == expected, f"{name} {label}: our confidence {got:.6f}"
        assert abs(got - want) < CONFIDENCE_ATOL, f"{name} {label}: confidence {got:.6f} vs perth {want:.6f}"
    assert ours.is_watermarked(perth_marked, sr) and not ours.is_watermarked(x, sr)


def test_say_marks_its_output_unless_told_not_to(perth, tmp_path):
    """``say TEXT`` writes audio that perth's own detector finds marked; with ``--no-watermark`` it finds it
    unmarked (the flag once reached only ``say --tokens``, and text was marked either way)."""
    from mlx_chatterbox.cli import main
    from mlx_chatterbox.convert import convert
    from tests.conftest import TINY_MODEL, random_voice, write_upstream_checkpoint

    model = convert(write_upstream_checkpoint(tmp_path / "up"), tmp_path / "mlx", config=TINY_MODEL)
    random_voice(seed=5).save(tmp_path / "voice.safetensors")
    args = ["say", "Hello there.", "--model", str(model), "--voice", str(tmp_path / "voice.safetensors")]
    args += ["--seed", "4", "--max-new-tokens", "40", "--cfm-steps", "1", "--min-p", "0"]
    assert main([*args, "-o", str(tmp_path / "marked.wav")]) == 0
    assert main([*args, "--no-watermark", "-o", str(tmp_path / "plain.wav")]) == 0
    marked, sr = sf.read(tmp_path / "marked.wav", dtype="float32")
    plain, _ = sf.read(tmp_path / "plain.wav", dtype="float32")
    assert perth.get_watermark(marked, sr) == 1.0
    assert perth.get_watermark(plain, sr) == 0.0
