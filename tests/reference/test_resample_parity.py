"""Audio reading and the two resamplers against upstream's libraries (architecture §4.1, §9.15): ``load_audio`` vs
``librosa.load`` (librosa 0.11), ``resample_soxr_hq`` vs ``librosa.resample`` (res_type 'soxr_hq'), both bit-exact,
and ``resample_sinc_hann`` vs ``torchaudio.transforms.Resample`` (defaults, as s3gen.py get_resampler builds it),
within 1e-6 absolute.

Clips are made in a temporary folder: espeak-ng speech (22.05 kHz, 16-bit) converted with sox to other rates,
depths, encodings and two channels, plus white noise, a chirp and speech with silent edges, at lengths that are
not multiples of the rate ratios.
"""

from __future__ import annotations

import functools
import math
import shutil
import subprocess
import warnings

import librosa
import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio

from mlx_chatterbox.audio.io import load_audio
from mlx_chatterbox.audio.resample import resample_sinc_hann, resample_soxr_hq

pytestmark = [
    pytest.mark.reference,
    # Raised by audioread (librosa imports it on first load), not by us.
    pytest.mark.filterwarnings("ignore:'(aifc|audioop|sunau)' is deprecated:DeprecationWarning"),
]

SINC_ATOL = 1e-6  # torch's float32 conv1d rounding; our sum is float64 rounded once
S3GEN_SR, S3_SR = 24000, 16000
DEC_COND_LEN = 10 * S3GEN_SR  # tts.py: the 10 s clip that embed_ref resamples with torchaudio

TEXT = (
    "The quick brown fox jumps over the lazy dog. Then, quite unexpectedly, it sat down and read "
    "a long book about resampling filters, zero crossings and the Nyquist frequency."
)

# name -> "sox output options | effects" applied to the espeak-ng clip
CONVERTED = {
    "speech_8k.wav": "-r 8000",
    "speech_16k.wav": "-r 16000",
    "speech_24k.wav": "-r 24000",
    "speech_44k_s24.wav": "-b 24 -r 44100",
    "speech_48k_float.wav": "-e floating-point -b 32 -r 48000",
    "speech_22k_u8.wav": "-b 8",
    "speech_22k_s32.wav": "-e signed-integer -b 32",
    "speech_44k_s24.flac": "-b 24 -r 44100",
    "speech_22k.ogg": "",
    "speech_24k_edges.wav": "-r 24000 | pad 0.3701 0.4113",
}
# name -> "sox output options | synth effect", from nothing
SYNTHESISED = {
    "noise_44k.wav": "-r 44100 -b 16 | synth 1.2345 whitenoise vol 0.5",
    "chirp_48k.wav": "-r 48000 -b 16 | synth 2.0001 sine 50-23000 vol 0.8",
    "chirp_22k_float.wav": "-r 22050 -e floating-point | synth 1.1111 sine 20-11000",
}
# One clip per kind of signal, for the slower sweeps.
SUBSET = (
    "speech_22k.wav",
    "speech_noise_48k_stereo.wav",
    "speech_24k_edges.wav",
    "noise_44k.wav",
    "chirp_48k.wav",
)


def _sox(source: str, spec: str, out) -> str:
    opts, _, effects = spec.partition("|")
    subprocess.run(
        ["sox", source, *opts.split(), str(out), *effects.split()], check=True, capture_output=True
    )
    return str(out)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, str]:
    """name -> path of every test clip."""
    # No skip: CI installs both (scripts/install_test_tools.sh), and a skipped parity test would pass silently.
    assert shutil.which("espeak-ng") and shutil.which("sox"), "the test clips need espeak-ng and sox"
    d = tmp_path_factory.mktemp("clips")
    base = d / "speech_22k.wav"
    subprocess.run(["espeak-ng", "-w", str(base), TEXT], check=True, capture_output=True)
    out = {base.name: str(base)}
    out.update({name: _sox(str(base), spec, d / name) for name, spec in CONVERTED.items()})
    out.update({name: _sox("-n", spec, d / name) for name, spec in SYNTHESISED.items()})
    # Two different channels (speech left, noise right), so that averaging is exercised.
    info = sf.info(str(base))
    noise = _sox(
        "-n", f"-r 22050 -b 16 | synth {info.frames / info.samplerate:.6f} whitenoise vol 0.2", d / "n.wav"
    )
    stereo = d / "speech_noise_48k_stereo.wav"
    subprocess.run(
        ["sox", "-M", str(base), noise, "-r", "48000", str(stereo)], check=True, capture_output=True
    )
    out[stereo.name] = str(stereo)
    if "MP3" in sf.available_formats():  # sox here has no MP3 writer; libsndfile has one
        y, sr = sf.read(str(base), dtype="float32")
        sf.write(str(d / "speech_22k.mp3"), y, sr, format="MP3")
        out["speech_22k.mp3"] = str(d / "speech_22k.mp3")
    return out


@functools.lru_cache(maxsize=None)
def _librosa_load(path: str, sr: int) -> np.ndarray:
    with warnings.catch_warnings():
        # No audioread fallback: soundfile must read every clip, as ours does.
        warnings.filterwarnings("error", message="PySoundFile failed")
        y, got = librosa.load(path, sr=sr)
    assert got == sr
    y.flags.writeable = False  # shared through the cache
    return y


def _torchaudio(wav: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    return torchaudio.transforms.Resample(sr_in, sr_out)(torch.from_numpy(np.array(wav))).numpy()


# ---------------------------------------------------------------- load_audio


@pytest.mark.parametrize("sr", [S3GEN_SR, S3_SR])
def test_load_audio_matches_librosa(clips, sr):
    for name, path in clips.items():
        ref = _librosa_load(path, sr)
        ours = load_audio(path, sr)
        assert ours.dtype == ref.dtype == np.float32, name
        assert ours.shape == ref.shape, f"{name}: {ours.shape} vs {ref.shape}"
        diff = float(np.abs(ours - ref).max())
        assert np.array_equal(ours, ref), f"{name} at {sr} Hz: max |diff| {diff:.3g}"


def test_clips_cover_the_formats(clips):
    kinds = {(i.format, i.subtype, i.channels, i.samplerate) for i in map(sf.info, clips.values())}
    assert {k[0] for k in kinds} >= {"WAV", "FLAC", "OGG"}
    assert {k[1] for k in kinds} >= {"PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT", "VORBIS"}
    assert {k[2] for k in kinds} == {1, 2}
    assert {k[3] for k in kinds} >= {8000, 16000, 22050, 24000, 44100, 48000}


# ---------------------------------------------------------------- soxr_hq (librosa.resample)


@pytest.mark.parametrize("sr_out", [S3_SR, 22050, 44100])
def test_soxr_hq_matches_librosa(clips, sr_out):
    for name, path in clips.items():
        y24 = _librosa_load(path, S3GEN_SR)
        for trim in (0, 1, 2, 7):  # lengths that are not multiples of the rate ratio
            y = y24[: len(y24) - trim]
            ref = librosa.resample(y, orig_sr=S3GEN_SR, target_sr=sr_out)
            ours = resample_soxr_hq(y, S3GEN_SR, sr_out)
            assert ours.dtype == ref.dtype == np.float32
            assert ours.shape == ref.shape, f"{name}[-{trim}] -> {sr_out}: {ours.shape} vs {ref.shape}"
            assert np.array_equal(
                ours, ref
            ), f"{name}[-{trim}] -> {sr_out}: max {np.abs(ours - ref).max():.3g}"


def test_soxr_hq_native_rates_match_librosa(clips):
    for name, path in clips.items():
        y, sr = sf.read(path, dtype="float32")
        y = y.mean(axis=1, dtype=np.float32) if y.ndim == 2 else y
        for sr_out in (S3GEN_SR, S3_SR):
            ref = librosa.resample(y, orig_sr=sr, target_sr=sr_out)
            ours = resample_soxr_hq(y, sr, sr_out)
            assert np.array_equal(ours, ref), f"{name} {sr}->{sr_out}: max {np.abs(ours - ref).max():.3g}"


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 17, 100])
def test_soxr_hq_short_inputs_match_librosa(n):
    y = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 0.3
    for sr_in, sr_out in [(24000, 16000), (16000, 24000), (22050, 24000), (44100, 16000)]:
        ref = librosa.resample(y, orig_sr=sr_in, target_sr=sr_out)
        ours = resample_soxr_hq(y, sr_in, sr_out)
        assert ours.shape == ref.shape and np.array_equal(ours, ref), f"n={n} {sr_in}->{sr_out}"


def test_soxr_hq_equal_rates_identity():
    y = np.random.default_rng(0).standard_normal(1001).astype(np.float32)
    np.testing.assert_array_equal(
        resample_soxr_hq(y, 24000, 24000), librosa.resample(y, orig_sr=24000, target_sr=24000)
    )


# ---------------------------------------------------------------- sinc-Hann (torchaudio.transforms.Resample)


def test_sinc_hann_matches_torchaudio_on_the_embed_ref_path(clips):
    errs = {}
    for name, path in clips.items():
        y24 = _librosa_load(path, S3GEN_SR)[:DEC_COND_LEN]
        for trim in (0, 1, 2) if name in SUBSET else (0,):
            y = y24[: len(y24) - trim]
            ref = _torchaudio(y, S3GEN_SR, S3_SR)
            ours = resample_sinc_hann(y, S3GEN_SR, S3_SR)
            assert ours.dtype == ref.dtype == np.float32
            assert ours.shape == ref.shape, f"{name}[-{trim}]: {ours.shape} vs {ref.shape}"
            errs[f"{name}[-{trim}]"] = float(np.abs(ours - ref).max())
    worst = max(errs, key=errs.get)
    assert errs[worst] < SINC_ATOL, f"max |diff| {errs[worst]:.3g} on {worst}"


@pytest.mark.parametrize(
    "sr_in,sr_out",
    [
        (8000, 16000),
        (16000, 24000),
        (22050, 16000),
        (22050, 24000),
        (44100, 16000),
        (44100, 24000),
        (48000, 16000),
    ],
)
def test_sinc_hann_matches_torchaudio_other_rates(clips, sr_in, sr_out):
    errs = {}
    for name in SUBSET:
        y = _librosa_load(clips[name], sr_in)[: 3 * sr_in]  # 3 s: the long clips add time, not coverage
        for trim in (0, 1, 3):
            ref = _torchaudio(y[: len(y) - trim], sr_in, sr_out)
            ours = resample_sinc_hann(y[: len(y) - trim], sr_in, sr_out)
            assert ours.shape == ref.shape, f"{name}[-{trim}] {sr_in}->{sr_out}"
            errs[f"{name}[-{trim}]"] = float(np.abs(ours - ref).max())
    worst = max(errs, key=errs.get)
    assert errs[worst] < SINC_ATOL, f"{sr_in}->{sr_out}: max |diff| {errs[worst]:.3g} on {worst}"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 100])
def test_sinc_hann_short_inputs_match_torchaudio(n):
    y = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 0.3
    for sr_in, sr_out in [(24000, 16000), (16000, 24000), (22050, 24000), (44100, 16000)]:
        ref = _torchaudio(y, sr_in, sr_out)
        ours = resample_sinc_hann(y, sr_in, sr_out)
        assert ours.shape == ref.shape, f"n={n} {sr_in}->{sr_out}"
        err = float(np.abs(ours - ref).max())
        assert err < SINC_ATOL, f"n={n} {sr_in}->{sr_out}: max |diff| {err:.3g}"


def test_sinc_hann_kernel_is_torchaudios():
    from torchaudio.functional.functional import _get_sinc_resample_kernel

    from mlx_chatterbox.audio.resample import _sinc_hann_kernel

    for sr_in, sr_out in [(24000, 16000), (44100, 24000), (22050, 16000), (8000, 24000)]:
        g = math.gcd(sr_in, sr_out)
        ref, width = _get_sinc_resample_kernel(sr_in, sr_out, g)
        ours, our_width = _sinc_hann_kernel(sr_in // g, sr_out // g)
        assert our_width == width
        assert ref.dtype == torch.float32 and ours.dtype == np.float32
        diff = float(np.abs(ours - ref.numpy()[:, 0, :]).max())
        assert np.array_equal(ours, ref.numpy()[:, 0, :]), f"{sr_in}->{sr_out}: kernel max |diff| {diff:.3g}"


def test_sinc_hann_equal_rates_identity():
    y = np.random.default_rng(0).standard_normal(1001).astype(np.float32)
    np.testing.assert_array_equal(resample_sinc_hann(y, 16000, 16000), _torchaudio(y, 16000, 16000))


def test_upstream_reference_path(clips):
    """tts.py prepare_conditionals + s3gen.py embed_ref on one speech file: the 24 kHz ref, its soxr 16 kHz copy
    (T3 tokens, VE) and the torchaudio 16 kHz copy of the first 10 s (CAM++, S3Gen prompt tokens)."""
    path = clips["speech_44k_s24.wav"]
    ref24 = _librosa_load(path, S3GEN_SR)
    ref16 = librosa.resample(ref24, orig_sr=S3GEN_SR, target_sr=S3_SR)
    ref16_ta = _torchaudio(ref24[:DEC_COND_LEN], S3GEN_SR, S3_SR)
    ours24 = load_audio(path, S3GEN_SR)
    assert np.array_equal(ours24, ref24)
    assert np.array_equal(resample_soxr_hq(ours24, S3GEN_SR, S3_SR), ref16)
    err = float(np.abs(resample_sinc_hann(ours24[:DEC_COND_LEN], S3GEN_SR, S3_SR) - ref16_ta).max())
    assert err < SINC_ATOL, f"max |diff| {err:.3g}"
    # The two resamplers really differ (§9.15): using one for both would shift tokens and the x-vector.
    n = min(len(ref16), len(ref16_ta))
    assert np.abs(ref16[:n] - ref16_ta[:n]).max() > 1e-3
