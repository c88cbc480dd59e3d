"""The mlx-chatterbox command on tiny checkpoints (no torch)."""

from __future__ import annotations

import functools
import importlib
import io
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from mlx_chatterbox.api import TTS
from mlx_chatterbox.bulk import write_atomic
from mlx_chatterbox.cli import convert as convert_command
from mlx_chatterbox.cli import main
from mlx_chatterbox.cli.common import flags
from mlx_chatterbox.cli.progress import log_format
from mlx_chatterbox.convert import ConversionError, convert, source_config
from mlx_chatterbox.generation.speech_tokens import refuse_language
from mlx_chatterbox.generation.stream import FIRST_CHUNK
from mlx_chatterbox.hybrid import INSTALL_HINT
from mlx_chatterbox.variants import PRESETS
from tests.conftest import TINY_MODEL, TINY_TURBO, random_voice, write_upstream_checkpoint


@pytest.fixture
def model(tmp_path):
    dst = convert(write_upstream_checkpoint(tmp_path / "up"), tmp_path / "mlx", config=TINY_MODEL)
    random_voice(seed=5).save(tmp_path / "voice.safetensors")
    return dst


def tokens(capsys, *args):
    assert main(["tokens", *args]) == 0
    return [int(t) for t in capsys.readouterr().out.split()]


def test_tokens_are_reproducible_with_a_seed(model, capsys, tmp_path):
    args = ["Hello there.", "--model", str(model), "--voice", str(tmp_path / "voice.safetensors")]
    a = tokens(capsys, *args, "--seed", "7", "--max-new-tokens", "15", "--min-p", "0")
    assert a == tokens(capsys, *args, "--seed", "7", "--max-new-tokens", "15", "--min-p", "0")
    assert 0 < len(a) <= 15 and all(0 <= t < 6561 for t in a)
    greedy = tokens(capsys, *args, "--temperature", "0", "--max-new-tokens", "15", "--cfg-weight", "0")
    out = tmp_path / "tokens.txt"
    assert (
        main(
            [
                "tokens",
                *args,
                "--temperature",
                "0",
                "--max-new-tokens",
                "15",
                "--cfg-weight",
                "0",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    assert [int(t) for t in out.read_text().split()] == greedy


def test_text_from_stdin(model, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there."))
    args = ["--model", str(model), "--voice", str(tmp_path / "voice.safetensors"), "--temperature", "0"]
    args += ["--max-new-tokens", "8"]
    assert tokens(capsys, "-", *args) == tokens(capsys, "Hello there.", *args)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--top-p", "1.5"], "--top-p 1.5 is out of range: it must be in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0 is out of range"),
        (["--voice", "missing.safetensors"], "--voice missing.safetensors: no such file"),
        ([], "has no built-in voice"),
    ],
)
def test_errors_are_one_line_with_exit_code_1(model, capsys, extra, message):
    assert main(["tokens", "Hi.", "--model", str(model), *extra]) == 1
    # An error found once the model has loaded follows the progress line of the loading (not on a terminal).
    *progress, error = capsys.readouterr().err.splitlines()
    assert error.startswith("mlx-chatterbox: error: ") and message in error
    assert progress in ([], [f"loading the model {model} [0:00<?]"])


def test_empty_text_and_missing_model(model, capsys, tmp_path):
    assert main(["tokens", "  ", "--model", str(model)]) == 1
    assert "the text is empty" in capsys.readouterr().err
    assert main(["tokens", "Hi.", "--model", str(tmp_path / "nope")]) == 1
    assert "is neither a folder nor a Hugging Face repo id" in capsys.readouterr().err


def test_convert_command(tmp_path, capsys, monkeypatch):
    # The command converts default-size models; give it tiny ones.
    monkeypatch.setattr(convert_command, "convert", functools.partial(convert, config=TINY_MODEL))
    src = write_upstream_checkpoint(tmp_path / "up")
    assert main(["convert", str(src), str(tmp_path / "mlx"), "--dtype", "bfloat16"]) == 0
    assert (tmp_path / "mlx" / "config.json").is_file()
    assert main(["convert", str(src), str(tmp_path / "mlx")]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 1


# The console script sits beside the interpreter of the environment the package is installed in.
@pytest.mark.parametrize(
    "argv", [[sys.executable, "-m", "mlx_chatterbox"], [str(Path(sys.executable).parent / "mlx-chatterbox")]]
)
def test_entry_points_show_help(argv):
    out = subprocess.run([*argv, "tokens", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in [
        "--temperature",
        "--top-p",
        "--min-p",
        "--repetition-penalty",
        "--cfg-weight",
        "--exaggeration",
        "--max-new-tokens",
        "--seed",
        "--voice",
        "--output",
    ]:
        assert flag in out


def test_say_writes_audio_from_text_and_from_tokens(model, capsys, tmp_path):
    import soundfile as sf

    voice = ["--voice", str(tmp_path / "voice.safetensors")]
    out = tmp_path / "hello.wav"
    args = ["say", "Hello there.", "--model", str(model), *voice, "--seed", "3", "--max-new-tokens", "8"]
    assert main([*args, "--cfm-steps", "2", "-o", str(out)]) == 0
    wav, rate = sf.read(out, dtype="float32")
    assert rate == 24000 and wav.ndim == 1 and 0 < len(wav) <= 8 * 960 and len(wav) % 960 == 0
    # The same tokens through --tokens give the same audio (same seed, same steps).
    ids = tokens(
        capsys, "Hello there.", "--model", str(model), *voice, "--seed", "3", "--max-new-tokens", "8"
    )
    (tmp_path / "ids.txt").write_text(" ".join(map(str, ids)))
    flac = tmp_path / "again.flac"
    assert (
        main(
            ["say", "--tokens", str(tmp_path / "ids.txt"), "--model", str(model), *voice]
            + ["--seed", "3", "--cfm-steps", "2", "-o", str(flac)]
        )
        == 0
    )
    again, _ = sf.read(flac, dtype="float32")
    np.testing.assert_allclose(again, wav, atol=1 / 2**15)  # 16-bit PCM in both files


@pytest.mark.parametrize(
    "extra, message",
    [
        (["Hi.", "--tokens", "ids.txt"], "give one of: a TEXT to speak, --file FILE, --tokens FILE"),
        ([], "give one of: a TEXT to speak"),
        (["--tokens", "ids.txt", "--temperature", "0.5"], "--temperature shapes speech tokens"),
        (["--tokens", "bad.txt"], "must hold speech token ids separated by spaces"),
        (["Hi.", "-o", "out.mp3"], "choose an output ending in .wav, .flac, .ogg"),
    ],
)
def test_say_errors_are_one_line_and_write_nothing(model, capsys, tmp_path, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ids.txt").write_text("1 2 3")
    (tmp_path / "bad.txt").write_text("1 two 3")
    if "-o" not in extra:
        extra = [*extra, "-o", "out.wav"]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["say", *extra, "--model", str(model), "--voice", "voice.safetensors"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mlx-chatterbox: error: ") and message in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_say_pause_tags_are_exact_silence(model, capsys, tmp_path, monkeypatch):
    import soundfile as sf

    base = ["--model", str(model), "--voice", str(tmp_path / "voice.safetensors"), "--max-new-tokens", "6"]
    args = [*base, "--cfm-steps", "1", "--no-watermark"]

    def say(text: str, seed: int) -> np.ndarray:
        out = tmp_path / f"{seed}-{len(text)}.wav"
        assert main(["say", text, *args, "--seed", str(seed), "-o", str(out)]) == 0
        return sf.read(out, dtype="int16")[0]

    wav = say('Hello there. [pause:250ms] How are you? <break time="1.5s"/>', 3)
    a, b = say("Hello there.", 3), say("How are you?", 4)  # seed s + i for spoken piece i
    # 250 ms and 1.5 s at 24 kHz: 6000 and 36000 samples of exact zeros between and after the pieces' audio.
    np.testing.assert_array_equal(
        wav, np.concatenate([a, np.zeros(6000, np.int16), b, np.zeros(36000, np.int16)])
    )
    capsys.readouterr()

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the text was checked")

    monkeypatch.setattr(TTS, "load", no_load)
    for command in ("say", "tokens"):
        assert main([command, "Hi. [pause:12s] There.", *base, "-o", str(tmp_path / "no.wav")]) == 1
        err = capsys.readouterr().err
        assert "pause tag '[pause:12s]' is 12 s long; a pause is at most 10 s" in err and err.count("\n") == 1
    assert not (tmp_path / "no.wav").exists()


def test_say_reads_text_from_a_file(model, tmp_path):
    (tmp_path / "text.txt").write_text("Hello there.\n", encoding="utf-8")
    args = ["--model", str(model), "--voice", str(tmp_path / "voice.safetensors"), "--seed", "2"]
    args += ["--max-new-tokens", "4", "--cfm-steps", "1"]
    assert main(["say", "--file", str(tmp_path / "text.txt"), *args, "-o", str(tmp_path / "a.wav")]) == 0
    assert main(["say", "Hello there.\n", *args, "-o", str(tmp_path / "b.wav")]) == 0
    import soundfile as sf

    np.testing.assert_array_equal(sf.read(tmp_path / "a.wav")[0], sf.read(tmp_path / "b.wav")[0])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert main(["say", "--file", str(tmp_path / "latin1.txt"), *args, "-o", str(tmp_path / "c.wav")]) == 1


def test_say_with_a_bf16_estimator(model, tmp_path):
    import soundfile as sf

    args = [
        "Hello there.",
        "--model",
        str(model),
        "--voice",
        str(tmp_path / "voice.safetensors"),
        "--seed",
        "2",
    ]
    args += ["--max-new-tokens", "4", "--cfm-steps", "2"]
    assert main(["say", *args, "-o", str(tmp_path / "a.wav")]) == 0
    assert main(["say", *args, "--cfm-dtype", "bfloat16", "-o", str(tmp_path / "b.wav")]) == 0
    exact, low = sf.read(tmp_path / "a.wav")[0], sf.read(tmp_path / "b.wav")[0]
    assert exact.shape == low.shape and not np.array_equal(exact, low)
    with pytest.raises(SystemExit):
        main(["say", *args, "--cfm-dtype", "float16", "-o", str(tmp_path / "c.wav")])


def test_bench_prints_a_table(model, capsys, tmp_path):
    voice = ["--voice", str(tmp_path / "voice.safetensors")]  # the tiny model has no built-in voice
    assert main(["bench", "--model", str(model), *voice, "--repeats", "2", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == "run steps tokens T3 s steps/s S3Gen s audio s RTF".split()
    assert len(out) == 3
    for row in out[1:]:
        steps, kept, t3_seconds, rate = row.split()[1:5]
        # Random weights do not stop: 5 decode steps; ids that are not speech are dropped from the kept tokens.
        assert int(steps) == 5 and 0 < int(kept) <= 5
        # steps/s is steps over T3's time (printed to 0.01 s; the rate to 0.1).
        t3 = float(t3_seconds)
        assert 5 / (t3 + 0.005) - 0.05 <= float(rate) <= 5 / max(t3 - 0.005, 1e-9) + 0.05


def test_bench_uses_the_voice_it_is_given(model, capsys, tmp_path, monkeypatch):
    used = []
    speech_tokens = TTS.speech_tokens

    def spy(self, text, voice=None, *args, **kwargs):
        used.append(voice)
        return speech_tokens(self, text, voice, *args, **kwargs)

    monkeypatch.setattr(TTS, "speech_tokens", spy)
    args = ["bench", "--model", str(model), "--repeats", "1", "--max-new-tokens", "3"]
    assert main([*args, "--voice", str(tmp_path / "voice.safetensors")]) == 0
    expected = random_voice(seed=5)
    assert len(used) == 2 and all(np.array_equal(v.xvector, expected.xvector) for v in used)
    assert main(args) == 1  # without --voice, the built-in voice, which the tiny model lacks
    assert "has no built-in voice" in capsys.readouterr().err


def test_version():
    from mlx_chatterbox import __version__

    result = subprocess.run(
        [sys.executable, "-m", "mlx_chatterbox", "--version"], capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout == f"mlx-chatterbox {__version__}\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["say", "Hi.", "-o", "a.wav", "--temperature", "abc"],
            "argument --temperature: invalid float value: 'abc'",
        ),
        (["say", "Hi.", "-o", "a.wav", "--cfm-steps", "0"], "argument --cfm-steps: 0 is out of range"),
        (
            ["say", "Hi.", "--stream", "--stream-context", "-1"],
            "argument --stream-context: -1 is out of range: it must be an integer >= 0 (or 'whole')",
        ),
        (
            ["say", "Hi.", "--stream", "--stream-context", "all"],
            "argument --stream-context: 'all' is not a number of speech tokens >= 0 nor 'whole'",
        ),
        (
            ["say", "Hi.", "-o", "a.wav", "--cfm-steps", "two"],
            "argument --cfm-steps: invalid integer value: 'two'",
        ),
        (["bench", "--repeats", "0"], "argument --repeats: 0 is out of range: it must be an integer >= 1"),
        (["say", "Hi."], "the following arguments are required: -o/--output"),
        (["speak", "Hi."], "argument COMMAND: invalid choice: 'speak'"),
    ],
)
def test_usage_errors_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1
    assert err.rstrip().endswith("--help)")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["say", "Hi.", "-o", "missing/out.wav"], "missing/out.wav: the folder missing does not exist"),
        (["say", "Hi.", "-o", "."], "choose an output ending in .wav"),
        (["say", "Hi.", "-o", "folder.wav"], "folder.wav is a folder"),
        (["say", "--file", "missing.txt", "-o", "out.wav"], "--file missing.txt: no such file"),
        (["say", " \n", "-o", "out.wav"], "the text is empty"),
        (["say", "Hi.", "--voice", "missing.wav", "-o", "out.wav"], "--voice missing.wav: no such file"),
        (["say", "Hi.", "--top-p", "0", "-o", "out.wav"], "--top-p 0.0 is out of range"),
        (["say", "--tokens", "missing.txt", "-o", "out.wav"], "--tokens missing.txt: no such file"),
        (["voice", "ref.wav", "-o", "missing/v.safetensors"], "the folder missing does not exist"),
        (["voice", "missing.wav", "-o", "v.safetensors"], "missing.wav: no such file"),
        (["voice", "ref.wav", "-o", "v.npz"], "choose an output ending in .safetensors"),
        (["tokens", "Hi.", "-o", "missing/t.txt"], "the folder missing does not exist"),
        (["tokens", "", "-o", "t.txt"], "the text is empty"),
        (["bench", "--voice", "missing.safetensors"], "--voice missing.safetensors: no such file"),
        # Knob ranges the model sets, from its variant's sizes (the default model is English: 4096 tokens).
        (
            ["say", "Hi.", "-o", "out.wav", "--max-new-tokens", "5000"],
            "--max-new-tokens 5000 is out of range: at most 4096",
        ),
        (["say", "Hi.", "-o", "o.wav", "--max-new-tokens", "0"], "--max-new-tokens 0 is out of range"),
        (
            ["tokens", "Hi.", "--variant", "turbo", "--max-new-tokens", "9000"],
            "--max-new-tokens 9000 is out of range: at most 8193",
        ),
        # Recordings and voice files are read and checked before the model loads.
        (
            ["say", "Hi.", "--voice", "ref.wav", "-o", "out.wav"],
            "ref.wav: not an audio file libsndfile can read",
        ),
        (["say", "Hi.", "--voice", "silent.wav", "-o", "out.wav"], "the reference is silent"),
        (
            ["say", "Hi.", "--voice", "bad.safetensors", "-o", "o.wav"],
            "is not a readable safetensors voice file",
        ),
        (["voice", "ref.wav", "-o", "v.safetensors"], "ref.wav: not an audio file libsndfile can read"),
        (["voice", "silent.wav", "-o", "v.safetensors"], "the reference is silent"),
        (["vc", "silent.wav", "-o", "out.wav"], "the source is silent"),
        (["vc", "ref.wav", "-o", "out.wav"], "ref.wav: not an audio file libsndfile can read"),
        (["vc", "short.wav", "-o", "out.wav", "--voice", "ref.wav"], "the source is 0.10 s long"),
        (["vc", "silent.wav", "-o", "out.wav", "--voice", "short.wav"], "the source is silent"),
        (["batch", "jobs.jsonl", "--out-dir", "d", "--voice", "silent.wav"], "the reference is silent"),
    ],
)
def test_bad_arguments_fail_before_the_model_loads(tmp_path, capsys, monkeypatch, argv, message):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(TTS, "load", load)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ref.wav").write_bytes(b"")
    (tmp_path / "folder.wav").mkdir()
    sf.write(tmp_path / "silent.wav", np.zeros(24000, np.float32), 24000)
    sf.write(tmp_path / "short.wav", np.full(1600, 0.1, np.float32), 16000)
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    (tmp_path / "jobs.jsonl").write_text('{"text": "Hi."}\n')
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("mlx-chatterbox: error: ") and message in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_failed_write_names_the_output_not_the_temporary_file(tmp_path):
    def fail(tmp):
        tmp.write_text("partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match=f"cannot write {tmp_path / 'out.txt'}: No space left on device"):
        write_atomic(tmp_path / "out.txt", fail)
    assert list(tmp_path.iterdir()) == []


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_say_shows_progress_over_pieces_on_a_terminal(model, tmp_path, monkeypatch):
    from mlx_chatterbox.generation import pieces

    monkeypatch.setattr(pieces, "PIECE_LENGTH", 20)  # two pieces from two short sentences
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    args = [
        "say",
        "Hello there. How are you?",
        "--model",
        str(model),
        "--voice",
        str(tmp_path / "voice.safetensors"),
        "--seed",  # unseeded, about 1 draw in 100 makes the tiny model stop before its first speech token
        "2",
    ]
    assert main([*args, "--max-new-tokens", "3", "--cfm-steps", "1", "-o", str(tmp_path / "a.wav")]) == 0
    screens = [line.split("\x1b[K")[0] for line in terminal.getvalue().split("\r") if line]
    # Each screen ends in tqdm's [elapsed<left]; left is ? until a piece has begun.
    assert all(re.search(r" \[\d+:\d\d<(\?|\d+:\d\d)\]$", screen) for screen in screens)
    screens = [screen.rsplit(" [", 1)[0] for screen in screens]
    assert screens[0] == f"loading the model {model}"
    # The bar: a piece's speech tokens are the first half of its share, its vocoding the second.
    assert screens[1] == f"[##{'-' * 22}] piece 1/2: speech tokens 1/3 (0.0 s)"
    assert f"[{'#' * 6}{'-' * 18}] piece 1/2: speech tokens 3/3 (0.1 s)" in screens
    assert f"[{'#' * 6}{'-' * 18}] piece 1/2: vocoding" in screens
    assert f"[{'#' * 16}{'-' * 8}] piece 2/2: speech tokens 2/3 (0.1 s)" in screens
    assert screens[-1] == f"[{'#' * 24}] done"
    assert terminal.getvalue().endswith("\n")
    # A warning in the middle (a piece cut at its budget) first erases the progress line it interrupts.
    assert log_format(terminal).startswith("\r\x1b[K") and log_format(io.StringIO())[0] == "%"
    # Not a terminal (a pipe, a log file): a line per stage, with the piece's budget.
    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main([*args, "--max-new-tokens", "3", "--cfm-steps", "1", "-o", str(tmp_path / "b.wav")]) == 0
    lines = [line.rsplit(" [", 1)[0] for line in quiet.getvalue().splitlines() if "budget" not in line]
    assert lines == [
        f"loading the model {model}",
        "piece 1/2: speech tokens (at most 3)",
        "piece 1/2: vocoding",
        "piece 2/2: speech tokens (at most 3)",
        "piece 2/2: vocoding",
        "done",
    ]
    # An error before any progress: the error line alone.
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main([*args, "--max-new-tokens", "5000", "-o", str(tmp_path / "c.wav")]) == 1
    assert (
        terminal.getvalue().count("\n") == 1
        and "--max-new-tokens 5000 is out of range" in terminal.getvalue()
    )


# --- say --stream / --play ---


def _streamed(model, tmp_path, **kwargs) -> np.ndarray:
    """What TTS.stream gives for the arguments of _live_args, as one float32 array."""
    from mlx_chatterbox.api import TTS, Voice

    tts = TTS.load(model)
    voice = Voice.load(tmp_path / "voice.safetensors")
    kwargs = {"max_new_tokens": 20, **kwargs}
    chunks = tts.stream("Hello there.", voice, seed=3, cfm_steps=1, **kwargs)
    return np.concatenate(list(chunks))


def _live_args(model, tmp_path) -> list[str]:
    voice = ["--voice", str(tmp_path / "voice.safetensors")]
    knobs = ["--seed", "3", "--max-new-tokens", "20", "--cfm-steps", "1"]
    return ["say", "Hello there.", "--model", str(model), *voice, *knobs]


@pytest.mark.parametrize("output", [[], ["-o", "-"]])
def test_say_stream_writes_raw_pcm_to_stdout(model, capsysbinary, tmp_path, output):
    assert main([*_live_args(model, tmp_path), "--stream", "--no-watermark", *output]) == 0
    pcm = np.frombuffer(capsysbinary.readouterr().out, dtype="<i2")
    wav = _streamed(model, tmp_path, watermark=False)
    # 20 speech tokens at most (random weights never stop), 960 samples each, two bytes a sample.
    assert 0 < len(pcm) == len(wav) <= 20 * 960
    np.testing.assert_array_equal(pcm, np.round(np.clip(wav, -1, 1) * 32767).astype(np.int16))


@pytest.mark.parametrize("context", ["0", "whole"])
def test_say_stream_context(model, capsysbinary, tmp_path, context):
    """--stream-context reaches TTS.stream: 60 tokens at most, whose last decode a window of 0 cuts (and the
    default 50 does not)."""
    args = [*_live_args(model, tmp_path), "--stream", "--no-watermark", "--max-new-tokens", "60"]
    assert main([*args, "--stream-context", context]) == 0
    pcm = np.frombuffer(capsysbinary.readouterr().out, dtype="<i2")
    given = 0 if context == "0" else context

    def expected(context):
        wav = _streamed(model, tmp_path, watermark=False, max_new_tokens=60, context=context)
        return np.round(np.clip(wav, -1, 1) * 32767).astype(np.int16)

    np.testing.assert_array_equal(pcm, expected(given))
    assert not np.array_equal(pcm, expected(0 if context == "whole" else "whole"))


class _FakeSoundDevice(types.ModuleType):
    """A stand-in for the sounddevice module: one output device; what is written is kept."""

    def __init__(self, device_error: Exception | None = None):
        super().__init__("sounddevice")
        self.device_error = device_error
        self.streams: list[dict] = []

    def query_devices(self, kind=None):
        if self.device_error is not None:
            raise self.device_error
        return {"name": "fake", "max_output_channels": 2}

    def OutputStream(self, **settings):  # noqa: N802 (sounddevice's name)
        stream = {"settings": settings, "written": [], "closed": False}
        self.streams.append(stream)

        class Stream:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                stream["closed"] = True

            def write(self, data):
                assert not stream["closed"]
                stream["written"].append(np.array(data))

        return Stream()


def test_say_play_plays_the_stream(model, tmp_path, monkeypatch):
    fake = _FakeSoundDevice()
    monkeypatch.setitem(sys.modules, "sounddevice", fake)
    assert main([*_live_args(model, tmp_path), "--play"]) == 0
    [stream] = fake.streams
    assert stream["settings"] == {"samplerate": 24000, "channels": 1, "dtype": "float32"}
    assert stream["closed"] and len(stream["written"]) >= 2  # chunk by chunk
    assert all(c.dtype == np.float32 and c.ndim == 2 and c.shape[1] == 1 for c in stream["written"])
    played = np.concatenate(stream["written"])[:, 0]
    np.testing.assert_array_equal(played, _streamed(model, tmp_path))  # watermarked chunk by chunk


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--stream", "-o", "out.wav"], "--stream writes to standard output; leave out -o (or give -o -)"),
        (["--stream", "--play"], "choose one of --stream and --play"),
        (["--play", "-o", "out.wav"], "--play plays the audio; leave out -o"),
        (["-o", "-"], "-o - writes raw PCM to standard output: add --stream"),
        (["-o", "a.wav", "--stream-context", "5"], "--stream-context sets how --stream and --play decode"),
    ],
)
def test_stream_and_play_errors_come_before_the_model_loads(tmp_path, capsys, monkeypatch, extra, message):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(TTS, "load", load)
    monkeypatch.setitem(sys.modules, "sounddevice", _FakeSoundDevice())
    monkeypatch.chdir(tmp_path)
    assert main(["say", "Hi.", *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mlx-chatterbox: error: ") and message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "ids.txt").write_text("1 2 3")
    assert main(["say", "--tokens", "ids.txt", "--stream"]) == 1
    assert (
        "--stream speaks a text; vocode --tokens into an audio file with -o instead"
        in capsys.readouterr().err
    )


def test_stream_refuses_a_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(TTS, "load", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setattr(sys, "stdout", _Terminal())
    assert main(["say", "Hi.", "--stream"]) == 1
    err = capsys.readouterr().err
    assert (
        "standard output, which is a terminal; pipe it to a player" in err
        and "aplay -f S16_LE -r 24000 -c 1" in err
    )
    assert err.count("\n") == 1


def test_say_needs_an_output_a_stream_or_play(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["say", "Hi."])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "the following arguments are required: -o/--output (or --stream, --play)" in err


@pytest.mark.parametrize(
    "module, message",
    [
        (None, "--play needs sounddevice: pip install 'mlx-chatterbox[play]'"),
        (
            OSError("PortAudio library not found"),
            "--play needs the PortAudio library (PortAudio library not found)",
        ),
        (
            _FakeSoundDevice(ValueError("No output device found")),
            "--play found no default audio output device",
        ),
    ],
)
def test_play_without_sounddevice_portaudio_or_a_device(capsys, monkeypatch, module, message):
    monkeypatch.setattr(TTS, "load", lambda *a, **k: pytest.fail("the model loaded"))
    if isinstance(module, OSError):  # what importing sounddevice raises when PortAudio is missing

        def import_module(name, *args):
            raise module

        monkeypatch.setattr(importlib, "import_module", import_module)
    else:
        monkeypatch.setitem(sys.modules, "sounddevice", module)  # None: import raises ImportError
    assert main(["say", "Hi.", "--play"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mlx-chatterbox: error: ") and message in err and err.count("\n") == 1


def test_a_models_sizes_are_told_without_loading_it(model, tmp_path):
    """What the knob checks before loading read: a converted folder's sizes, else its variant's upstream ones."""
    assert source_config(model) == TINY_MODEL
    assert source_config("ResembleAI/chatterbox-turbo") == PRESETS["turbo"]
    assert source_config("ResembleAI/chatterbox", "multilingual") == PRESETS["multilingual"]
    assert source_config(tmp_path / "nothing") is None


def test_cli_messages_name_flags_api_messages_arguments(tmp_path, capsys):
    src = write_upstream_checkpoint(tmp_path / "up")
    write_upstream_checkpoint(src, TINY_TURBO)  # two T3 files: which one is meant?
    with pytest.raises(ConversionError, match=r"\(pass variant= to choose\)$"):
        convert(src, tmp_path / "x")
    assert main(["convert", str(src), str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert err.endswith("(pass --variant to choose)\n") and "variant=" not in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("")
    with pytest.raises(ConversionError, match="pass overwrite=True$"):
        convert(src, tmp_path / "full")
    assert main(["convert", str(src), str(tmp_path / "full")]) == 1
    assert capsys.readouterr().err.endswith("choose a new folder or pass --overwrite\n")
    # The other arguments the library's messages name, as it words them.
    assert flags("the multilingual model needs a language (language=): one of ar, da") == (
        "the multilingual model needs a language (--language): one of ar, da"
    )
    with pytest.raises(ValueError) as refused:
        refuse_language("english", "fr")
    assert flags(str(refused.value)) == (
        "--language fr: the english model speaks English only; the multilingual models (--variant multilingual "
        "or multilingual-v3 of ResembleAI/chatterbox) take a language"
    )
    assert INSTALL_HINT.startswith("hybrid mode (s3gen='torch') needs")
    assert flags(INSTALL_HINT).startswith("hybrid mode (--s3gen torch) needs")


def test_serve_warms_the_worker_up_before_it_listens(model, tmp_path, monkeypatch):
    from mlx_chatterbox.server import run
    from mlx_chatterbox.server.worker import Worker

    calls = []
    monkeypatch.setattr(
        Worker, "warm_up", lambda self, voice, language, first_chunk: calls.append(("warm_up", first_chunk))
    )
    monkeypatch.setattr(run, "serve", lambda app, **kwargs: calls.append(("serve", kwargs["port"])))
    voice = str(tmp_path / "voice.safetensors")
    argv = [
        "serve",
        "--model",
        str(model),
        "--voice",
        voice,
        "--voices",
        str(tmp_path / "v"),
        "--port",
        "8123",
    ]
    assert main(argv) == 0
    assert main([*argv, "--first-chunk", "12"]) == 0
    # The streams' first chunk: with MLX-CUDA their first decode's convolution graphs are built then.
    assert calls == [("warm_up", FIRST_CHUNK), ("serve", 8123), ("warm_up", 12), ("serve", 8123)]
