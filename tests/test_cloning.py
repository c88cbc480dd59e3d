"""Voice cloning through the API and the CLI on a tiny model (no torch): shapes, files, bad references."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from mlx_chatterbox import TTS
from mlx_chatterbox.cli import main
from mlx_chatterbox.convert import convert
from mlx_chatterbox.generation.voice import Voice
from tests.conftest import TINY_MODEL, write_upstream_checkpoint


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cloning")
    return TTS.load(convert(write_upstream_checkpoint(tmp / "up"), tmp / "mlx", config=TINY_MODEL))


def speechlike(seconds: float, sr: int, seed: int = 0) -> np.ndarray:
    """Harmonics with a wandering pitch and syllable-like bursts, between pauses."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    voiced = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = np.clip(np.sin(2 * np.pi * 2.5 * t), 0, None) * (t > 0.2) * (t < seconds - 0.3)
    return (0.3 * voiced * envelope + 0.003 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.mark.parametrize(
    "seconds", [1.3, 7.1, 12.4]
)  # shorter than T3's 6 s, between, longer than S3Gen's 10 s
def test_clone_from_a_file(tts, tmp_path, seconds):
    path = tmp_path / "ref.flac"
    sf.write(path, speechlike(seconds, 22050), 22050)
    voice = tts.voice(path)
    n24 = int(np.ceil(seconds * 22050 * 24000 / 22050))
    frames = min(n24, 240000) // 480
    assert voice.s3gen_prompt_mel.shape == (1, frames, 80)
    assert voice.s3gen_prompt_tokens.shape[1] <= frames // 2
    assert voice.t3_prompt_tokens.shape[1] <= 150 and voice.speaker_emb.shape == (1, 256)
    assert voice.xvector.shape == (1, 192)
    np.testing.assert_allclose(float(np.linalg.norm(np.array(voice.speaker_emb))), 1.0, rtol=1e-5)
    loaded = Voice.load(voice.save(tmp_path / "v.safetensors"))
    np.testing.assert_array_equal(np.array(loaded.s3gen_prompt_tokens), np.array(voice.s3gen_prompt_tokens))


def test_array_input_equals_file_input(tts, tmp_path):
    wav = speechlike(3.0, 24000, seed=1)
    sf.write(tmp_path / "ref.wav", wav, 24000, subtype="FLOAT")
    a, b = tts.voice(wav, sample_rate=24000), tts.voice(tmp_path / "ref.wav")
    for field in ("speaker_emb", "t3_prompt_tokens", "s3gen_prompt_tokens", "s3gen_prompt_mel", "xvector"):
        np.testing.assert_array_equal(np.array(getattr(a, field)), np.array(getattr(b, field)))
    with pytest.raises(ValueError, match="give the sample_rate"):
        tts.voice(wav)
    with pytest.raises(ValueError, match="an audio file carries its own rate"):
        tts.voice(tmp_path / "ref.wav", sample_rate=16000)


@pytest.mark.parametrize(
    "wav, message",
    [
        (np.zeros(24000 * 2, np.float32), "silent"),
        (speechlike(0.3, 24000), r"0.30 s long; give at least 0.5 s"),
        (np.full(24000, np.nan, np.float32), "NaN"),
        (np.zeros((2, 24000), np.float32), "mono"),
    ],
)
def test_bad_references(tts, wav, message):
    with pytest.raises(ValueError, match=message):
        tts.voice(wav, sample_rate=24000)


def test_cli_voice_then_say(tts, tmp_path, capsys):
    ref = tmp_path / "ref.wav"
    sf.write(ref, speechlike(4.0, 16000, seed=2), 16000)
    model = str(tts.path)
    assert main(["voice", str(ref), "--model", model, "-o", str(tmp_path / "me.safetensors")]) == 0
    stages = [line.rsplit(" [", 1)[0] for line in capsys.readouterr().err.splitlines()]  # not a terminal
    assert stages == [f"loading the model {model}", "cloning the voice"]
    args = ["say", "Hello.", "--model", model, "--seed", "1", "--max-new-tokens", "4", "--cfm-steps", "1"]
    assert main([*args, "--voice", str(tmp_path / "me.safetensors"), "-o", str(tmp_path / "a.wav")]) == 0
    assert main([*args, "--voice", str(ref), "-o", str(tmp_path / "b.wav")]) == 0  # cloned on the fly
    np.testing.assert_array_equal(sf.read(tmp_path / "a.wav")[0], sf.read(tmp_path / "b.wav")[0])
    assert (
        main(["voice", str(tmp_path / "none.wav"), "--model", model, "-o", str(tmp_path / "x.safetensors")])
        == 1
    )
    assert "no such file" in capsys.readouterr().err
    assert main(["voice", str(ref), "--model", model, "-o", str(tmp_path / "x.wav")]) == 1
    assert "choose an output ending in .safetensors" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "x.wav").exists()


def write(path, wav, sr, subtype=None):
    sf.write(path, wav, sr, subtype=subtype)
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: write(d / "empty.wav", np.zeros(0, np.float32), 24000), "contains no samples"),
        (lambda d: write(d / "silent.wav", np.zeros(48000, np.float32), 24000), "silent"),
        (lambda d: write(d / "short.wav", speechlike(0.2, 24000), 24000), "give at least 0.5 s"),
        (
            lambda d: write(
                d / "nan.wav", np.where(np.arange(48000) == 7, np.nan, speechlike(2, 24000)), 24000, "FLOAT"
            ),
            "NaN or inf",
        ),
        (lambda d: d / "missing.wav", "no such file"),
        (lambda d: (d / "notes.wav").write_text("not audio") and d / "notes.wav", "not an audio file"),
        (
            lambda d: (d / "header.wav").write_bytes(
                write(d / "w.wav", speechlike(1, 24000), 24000).read_bytes()[:30]
            )
            and d / "header.wav",
            "not an audio file",
        ),
    ],
    ids=["empty", "silent", "too-short", "nan", "missing", "not-audio", "header-only"],
)
def test_bad_reference_files(tts, tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        tts.voice(make(tmp_path))


@pytest.mark.parametrize(
    "make",
    [
        lambda d: write(d / "clipped.wav", np.clip(5 * speechlike(3, 24000), -1, 1), 24000),
        lambda d: write(
            d / "stereo.wav", np.stack([speechlike(3, 44100), speechlike(3, 44100, 1)], 1), 44100
        ),
        lambda d: write(d / "u8.wav", speechlike(3, 16000), 16000, "PCM_U8"),
        lambda d: write(d / "8k.wav", speechlike(3, 8000), 8000),
        lambda d: write(d / "192k.flac", speechlike(3, 192000), 192000),
        lambda d: write(d / "ogg.ogg", speechlike(3, 48000), 48000),
        # Cut in the middle of the data chunk: libsndfile (and so librosa) reads the samples that are there.
        lambda d: (d / "cut.wav").write_bytes(
            write(d / "w.wav", speechlike(4, 24000), 24000).read_bytes()[:100_000]
        )
        and d / "cut.wav",
    ],
    ids=["clipped", "stereo-44k", "8-bit", "8kHz", "192kHz-flac", "ogg", "truncated"],
)
def test_unusual_files_are_read_as_upstream_reads_them(tts, tmp_path, make):
    voice = tts.voice(make(tmp_path))
    assert voice.s3gen_prompt_mel.shape[1] >= 100 and np.isfinite(np.array(voice.speaker_emb)).all()
