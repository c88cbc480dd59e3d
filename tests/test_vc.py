"""Voice conversion (``TTS.convert_voice``, ``mlx-chatterbox vc``) on tiny random models, no torch: the long-source
windowing and pieces, bad sources, refused variants, and every CLI flag. Parity with upstream ``ChatterboxVC`` is
tests/reference/test_vc_parity.py."""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import numpy as np
import pytest
import soundfile as sf

from mlx_chatterbox import TTS
from mlx_chatterbox.audio.resample import resample_soxr_hq
from mlx_chatterbox.cli import main
from mlx_chatterbox.convert import convert
from mlx_chatterbox.generation import vc
from mlx_chatterbox.generation.voice import S3_SR
from mlx_chatterbox.models.s3tokenizer import S3TokenizerConfig
from mlx_chatterbox.variants import PRESETS
from tests.conftest import TINY_MODEL, TINY_TURBO, random_voice, write_upstream_checkpoint
from tests.test_cloning import speechlike, write


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vc")
    folder = convert(write_upstream_checkpoint(tmp / "up"), tmp / "mlx", config=TINY_MODEL)
    # A built-in voice, as conversion writes one from conds.pt (which takes torch to make).
    random_voice(seed=8, gen_tokens=10).save(folder / "voice.safetensors")
    manifest = json.loads((folder / "config.json").read_text())
    manifest["files"]["voice"] = "voice.safetensors"
    (folder / "config.json").write_text(json.dumps(manifest))
    return TTS.load(folder)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("vc_files")
    sf.write(d / "source.wav", speechlike(2.0, 22050, seed=3), 22050)
    sf.write(d / "target.wav", speechlike(3.0, 24000, seed=4), 24000)
    random_voice(seed=5, gen_tokens=12).save(d / "target.safetensors")
    return d


# --- the pieces of the algorithm ---


@pytest.mark.parametrize("n", [1, 999, 1000, 1001, 1950, 1951, 5000, 12345])
def test_pieces_cover_the_tokens_with_overlaps(n):
    spans = vc.pieces(n)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(0 < stop - start <= vc.PASS_TOKENS for start, stop in spans)
    for (_, stop), (start, _) in zip(spans, spans[1:]):
        assert stop - start == vc.OVERLAP_TOKENS
    assert len(spans) == (1 if n <= vc.PASS_TOKENS else -(-(n - 50) // 950))


@pytest.mark.parametrize("late", [0, 480])  # an odd prompt mel: S3Gen's output starts half a token late
def test_join_puts_every_piece_back_in_its_place(late):
    n = 2300
    content = np.random.default_rng(0).standard_normal(960 * n).astype(np.float32)
    spans = vc.pieces(n)
    assert len(spans) == 3
    wavs = [content[960 * start + late : 960 * stop] for start, stop in spans]
    joined = vc.join(wavs, spans)
    # Two copies of the same samples crossfade to themselves.
    np.testing.assert_allclose(joined, content[late:], atol=1e-6)


def test_long_sources_are_windowed_as_upstream(monkeypatch):
    """A mel whose first bin counts frames, and a tokenizer whose code is the frame index // 4 of each stride-4
    step: the merged windows must give every token once, in order (upstream keeps half of each 4 s overlap).
    """

    class Counting:
        config = S3TokenizerConfig(n_state=64, n_heads=2, n_layers=1)

        def __call__(self, mel, lengths):
            assert mel.shape[1] <= vc.WINDOW_FRAMES and int(lengths[0]) == mel.shape[1]
            return (mel[:, ::4, 0] // 4).astype(mx.int32), None

    for frames in (2999, 3000, 3001, 5200, 5201, 5700, 9000):
        mel = np.zeros((frames, 128), np.float32)
        mel[:, 0] = np.arange(frames)
        monkeypatch.setattr(vc, "s3tokenizer_log_mel", lambda wav, mel=mel: mel)
        tokens = vc.source_tokens(Counting(), np.zeros(160 * frames, np.float32))
        np.testing.assert_array_equal(tokens, np.arange(S3TokenizerConfig.code_length(frames)), f"{frames}")


def test_turbo_and_nano_are_refused_multilingual_is_not(tmp_path):
    for variant in ("english", "multilingual", "multilingual-v3"):
        vc.check_decoder(variant, PRESETS[variant].cfm.meanflow)
    for variant in ("turbo", "nano"):
        with pytest.raises(
            ValueError, match=f"the {variant} model's meanflow decoder has no voice conversion"
        ):
            vc.check_decoder(variant, PRESETS[variant].cfm.meanflow)
    turbo = TTS.load(
        convert(write_upstream_checkpoint(tmp_path / "up", TINY_TURBO), tmp_path / "mlx", config=TINY_TURBO)
    )
    with pytest.raises(ValueError, match="the turbo model's meanflow decoder"):
        turbo.convert_voice(speechlike(1.0, 16000), random_voice(), sample_rate=16000)


# --- the API ---


def test_conversion_is_the_vocoded_source_tokens(tts, files):
    voice = random_voice(seed=1, gen_tokens=9)
    wav = tts.convert_voice(files / "source.wav", voice, seed=3, watermark=False)
    source = sf.read(files / "source.wav", dtype="float32")[0]
    tokens = vc.source_tokens(tts._voice_cloner().s3tokenizer, resample_soxr_hq(source, 22050, S3_SR))
    assert len(tokens) == 50 and tokens.dtype == np.int32  # 2 s at 25 Hz
    np.testing.assert_array_equal(wav, tts.vocode(tokens, voice, seed=3, watermark=False))
    assert wav.shape == (960 * len(tokens),)
    # Samples equal a file; a seed repeats; cfm_steps is honoured; the watermark is on by default.
    same = tts.convert_voice(source, voice, sample_rate=22050, seed=3, watermark=False)
    np.testing.assert_array_equal(same, wav)
    assert not np.array_equal(
        tts.convert_voice(source, voice, sample_rate=22050, seed=4, watermark=False), wav
    )
    fewer = tts.convert_voice(source, voice, sample_rate=22050, seed=3, cfm_steps=2, watermark=False)
    np.testing.assert_array_equal(fewer, tts.vocode(tokens, voice, seed=3, cfm_steps=2, watermark=False))
    marked = tts.convert_voice(source, voice, sample_rate=22050, seed=3)
    np.testing.assert_array_equal(marked, tts.watermarker().apply(wav, tts.sample_rate))


def test_the_target_voice_as_elsewhere(tts, files):
    kwargs = dict(seed=0, cfm_steps=1, watermark=False)
    builtin = tts.convert_voice(files / "source.wav", None, **kwargs)
    np.testing.assert_array_equal(
        builtin, tts.convert_voice(files / "source.wav", tts.builtin_voice, **kwargs)
    )
    saved = tts.convert_voice(files / "source.wav", files / "target.safetensors", **kwargs)
    assert not np.array_equal(saved, builtin)
    cloned = tts.convert_voice(files / "source.wav", files / "target.wav", **kwargs)
    np.testing.assert_array_equal(
        cloned, tts.convert_voice(files / "source.wav", tts.voice(files / "target.wav"), **kwargs)
    )


@pytest.mark.parametrize("odd", [False, True])  # an odd prompt mel: S3Gen's output starts half a token late
def test_a_long_source_is_vocoded_in_pieces(tts, monkeypatch, odd):
    monkeypatch.setattr(vc, "PASS_TOKENS", 120)  # pieces of at most 4.8 s instead of 40 s, to save time
    source = speechlike(8.0, S3_SR, seed=6)  # 200 tokens: three pieces
    voice = random_voice(seed=2, gen_tokens=7)
    if odd:
        mel = voice.s3gen_prompt_mel
        voice = dataclasses.replace(voice, s3gen_prompt_mel=mx.concatenate([mel, mel[:, :1]], axis=1))
    wav = tts.convert_voice(source, voice, sample_rate=S3_SR, seed=5, cfm_steps=1, watermark=False)
    tokens = vc.source_tokens(tts._voice_cloner().s3tokenizer, source)
    spans = vc.pieces(len(tokens))
    late = 480 * odd
    assert len(tokens) == 200 and len(spans) == 3 and wav.shape == (960 * 200 - late,)
    pieces = [
        tts.vocode(tokens[a:b], voice, seed=5 + i, cfm_steps=1, watermark=False)
        for i, (a, b) in enumerate(spans)
    ]
    np.testing.assert_array_equal(wav, vc.join(pieces, spans))
    # Between the seams' crossfades, each piece's samples are kept as they are, in their place.
    seams = [960 * (start + vc.OVERLAP_TOKENS // 2) - late for start, _ in spans[1:]]
    edges = [0, *seams, len(wav)]
    for i, (start, _) in enumerate(spans):
        lo, hi = edges[i] + 480 * (i > 0), edges[i + 1] - 480 * (i < len(spans) - 1)
        np.testing.assert_array_equal(wav[lo:hi], pieces[i][lo - 960 * start : hi - 960 * start])


@pytest.mark.parametrize(
    "source, kwargs, message",
    [
        (np.zeros(32000, np.float32), {"sample_rate": 16000}, "the source is silent"),
        (speechlike(0.3, 16000), {"sample_rate": 16000}, r"the source is 0.30 s long; give at least 0.5 s"),
        (np.full(16000, np.nan, np.float32), {"sample_rate": 16000}, "the source holds NaN"),
        (np.zeros((2, 16000), np.float32), {"sample_rate": 16000}, "mono"),
        (speechlike(1.0, 16000), {}, "give the sample_rate"),
        (
            speechlike(1.0, 16000),
            {"sample_rate": 16000, "cfm_steps": 0},
            "cfm_steps=0 must be an integer >= 1",
        ),
    ],
)
def test_bad_sources_and_arguments(tts, source, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tts.convert_voice(source, random_voice(), **kwargs)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: write(d / "empty.wav", np.zeros(0, np.float32), 24000), "contains no samples"),
        (lambda d: write(d / "silent.wav", np.zeros(48000, np.float32), 24000), "the source is silent"),
        (lambda d: write(d / "short.wav", speechlike(0.2, 24000), 24000), "give at least 0.5 s"),
        (lambda d: d / "missing.wav", "no such file"),
        (lambda d: (d / "notes.wav").write_text("not audio") and d / "notes.wav", "not an audio file"),
    ],
    ids=["empty", "silent", "too-short", "missing", "not-audio"],
)
def test_bad_source_files(tts, tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        tts.convert_voice(make(tmp_path), random_voice())
    with pytest.raises(ValueError, match="an audio file carries its own rate"):
        tts.convert_voice(tmp_path / "x.wav", random_voice(), sample_rate=16000)


# --- the command line ---


def vc_cli(tts, files, out, *extra):
    return main(["vc", str(files / "source.wav"), "--model", str(tts.path), "-o", str(out), *extra])


def test_cli_writes_the_conversion(tts, files, tmp_path, capsys):
    voice = files / "target.safetensors"
    args = ["--voice", str(voice), "--seed", "2", "--cfm-steps", "3"]
    assert vc_cli(tts, files, tmp_path / "a.wav", *args, "--no-watermark") == 0
    wav, rate = sf.read(tmp_path / "a.wav", dtype="float32")
    ref = tts.convert_voice(files / "source.wav", voice, seed=2, cfm_steps=3, watermark=False)
    assert rate == 24000 and wav.shape == ref.shape
    np.testing.assert_allclose(wav, ref, atol=1 / 32767)  # 16-bit PCM
    # The watermark is on without --no-watermark; FLAC and a recording as the target; -v prints timings.
    assert vc_cli(tts, files, tmp_path / "m.flac", *args, "-v", "--variant", "english") == 0
    err = capsys.readouterr().err
    assert "conversion" in err and "real-time factor" in err
    marked = tts.convert_voice(files / "source.wav", voice, seed=2, cfm_steps=3)
    np.testing.assert_allclose(sf.read(tmp_path / "m.flac", dtype="float32")[0], marked, atol=1 / 32767)
    assert vc_cli(tts, files, tmp_path / "c.wav", "--voice", str(files / "target.wav"), "--seed", "1") == 0
    ref = tts.convert_voice(files / "source.wav", files / "target.wav", seed=1)
    np.testing.assert_allclose(sf.read(tmp_path / "c.wav", dtype="float32")[0], ref, atol=1 / 32767)
    # No --voice: the built-in voice; a seed makes it repeat.
    for name in ("b1.wav", "b2.wav"):
        assert vc_cli(tts, files, tmp_path / name, "--seed", "7", "--cfm-steps", "1") == 0
    np.testing.assert_array_equal(sf.read(tmp_path / "b1.wav")[0], sf.read(tmp_path / "b2.wav")[0])


def test_cli_reports_its_stages(tts, files, tmp_path, capsys, monkeypatch):
    # Pieces of at most 1.2 s overlapping by 0.4 s: the 2 s source in two.
    monkeypatch.setattr(vc, "PASS_TOKENS", 30)
    monkeypatch.setattr(vc, "OVERLAP_TOKENS", 10)
    target = ["--voice", str(files / "target.wav"), "--cfm-steps", "1"]
    assert vc_cli(tts, files, tmp_path / "a.wav", *target) == 0
    stages = [line.rsplit(" [", 1)[0] for line in capsys.readouterr().err.splitlines()]  # not a terminal
    assert stages[:3] == [f"loading the model {tts.path}", "cloning the voice", "speech tokens of the source"]
    assert stages[3:] == ["piece 1/2: vocoding", "piece 2/2: vocoding", "done"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-o", "{tmp}/out.mp3"], "choose an output ending in .wav, .flac, .ogg"),
        (["-o", "{tmp}/nowhere/out.wav"], "the folder {tmp}/nowhere does not exist"),
        (
            ["-o", "{tmp}/out.wav", "--voice", "{tmp}/missing.safetensors"],
            "missing.safetensors: no such file",
        ),
        (["-o", "{tmp}/out.wav", "--variant", "turbo"], "the turbo model's meanflow decoder"),
        (["-o", "{tmp}/out.wav", "--variant", "nano"], "the nano model's meanflow decoder"),
    ],
)
def test_cli_errors_come_before_the_model_loads(tmp_path, files, capsys, monkeypatch, argv, message):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(TTS, "load", no_load)
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["vc", str(files / "source.wav"), *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mlx-chatterbox: error: ") and message.format(tmp=tmp_path) in err
    assert err.count("\n") == 1
    assert main(["vc", str(tmp_path / "none.wav"), "-o", str(tmp_path / "out.wav")]) == 1
    assert "none.wav: no such file" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.wav"))


def test_cli_bad_source_and_usage_errors(tts, files, tmp_path, capsys):
    (tmp_path / "notes.wav").write_text("not audio")
    assert (
        main(["vc", str(tmp_path / "notes.wav"), "--model", str(tts.path), "-o", str(tmp_path / "o.wav")])
        == 1
    )
    err = capsys.readouterr().err
    assert "not an audio file" in err and err.count("\n") == 1 and not (tmp_path / "o.wav").exists()
    for argv, message in (
        (["--cfm-steps", "0"], "0 is out of range"),
        (["--seed", "x"], "invalid integer value"),
        (["--seed", "-1"], "argument --seed: -1 is out of range: it must be an integer in [0, 2**63)"),
        ([], "required: -o/--output"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["vc", str(files / "source.wav"), *argv] + (["-o", str(tmp_path / "o.wav")] if argv else []))
        assert e.value.code == 2 and message in capsys.readouterr().err
