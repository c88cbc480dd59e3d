"""mlx-chatterbox batch (bulk.py) on a tiny random model: every item's file equals ``TTS.generate`` of the same
item, bad lines are failed items, resume, the manifest, the progress line, and a run over a local Ray instance
(no torch)."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from mlx_chatterbox import TTS
from mlx_chatterbox.bulk import Settings, read_jobs
from mlx_chatterbox.cli import main
from mlx_chatterbox.convert import convert
from mlx_chatterbox.generation.speech_tokens import EnglishSpeech
from tests.conftest import TINY_MODEL, random_voice, write_upstream_checkpoint

LONG = "First sentence of a text long enough for two pieces. " * 7  # 378 characters: two pieces
# One PCM-16 step: items whose pieces T3 finishes in the same step are vocoded together, equal to their
# one-by-one audio up to float error (~4e-7), which may move a sample across a rounding boundary.
PCM_STEP = 1 / 32768


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("bulk")
    convert(write_upstream_checkpoint(tmp / "up"), tmp / "mlx", config=TINY_MODEL)
    for seed in (5, 6):
        random_voice(seed=seed).save(tmp / f"v{seed}.safetensors")
    return tmp


@pytest.fixture(scope="module")
def tts(folder) -> TTS:
    return TTS.load(folder / "mlx")


def write_jobs(path: Path, lines: list[object]) -> Path:
    """Objects as JSON lines; strings as they are (bad lines, blank lines)."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def batch(folder: Path, jobs: Path, out: Path, *extra: str) -> int:
    model = ["--model", str(folder / "mlx"), "--voice", str(folder / "v5.safetensors")]
    return main(["batch", str(jobs), "--out-dir", str(out), *model, *extra])


TORN = '{"line": 1, "output": "0000'  # a manifest line cut short by a killed run


def manifest(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines() if line != TORN]


def latest(out: Path) -> dict[int, dict]:
    """The last manifest entry of each line number."""
    return {e["line"]: e for e in manifest(out)}


def expected(tts: TTS, folder: Path, job: dict, watermark: bool, suffix: str = ".wav") -> np.ndarray:
    """``TTS.generate`` of the job, through the same file format as the output (PCM-16 for WAV and FLAC)."""
    knobs = {
        k: v for k, v in job.items() if k not in ("text", "file", "voice", "seed", "cfm_steps", "output")
    }
    voice = folder / job.get("voice", "v5.safetensors")
    wav = tts.generate(
        job["text"], voice, seed=job["seed"], cfm_steps=job["cfm_steps"], watermark=watermark, **knobs
    )
    buffer = io.BytesIO()
    sf.write(buffer, wav, tts.sample_rate, format={".wav": "WAV", ".flac": "FLAC"}[suffix])
    buffer.seek(0)
    return sf.read(buffer, dtype="float32")[0]


# Random weights never stop, so max_new_tokens sets each item's length.
GOOD = [
    {"text": "Hello there.", "seed": 1, "max_new_tokens": 8, "cfm_steps": 2},
    {"text": "Another voice, greedy.", "voice": "v6.safetensors", "seed": 2, "max_new_tokens": 11, "cfm_steps": 2,
     "temperature": 0, "output": "sub/two.flac"},
    {"text": LONG, "seed": 3, "max_new_tokens": 6, "cfm_steps": 1, "cfg_weight": 0, "output": "long.wav"},
]  # fmt: skip


def test_batch_writes_each_item_and_records_bad_lines_as_failed(folder, tts, tmp_path, capsys):
    (tmp_path / "v6.safetensors").write_bytes(
        (folder / "v6.safetensors").read_bytes()
    )  # relative to the jobs
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "one.txt").write_text(GOOD[0]["text"], encoding="utf-8")
    from_file = {**GOOD[0], "file": "texts/one.txt"}
    del from_file["text"]
    lines = [
        from_file,
        GOOD[1],
        "",
        {"text": "A Turbo knob.", "top_k": 5, "max_new_tokens": 4},  # refused by the English model
        {"text": "No such voice.", "voice": "nope.safetensors"},
        GOOD[2],
        {"text": "Out of range.", "top_p": 2},
        {"text": "Bonjour.", "language": "fr"},  # a known language, but this model speaks English only
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    out = tmp_path / "out"
    assert batch(folder, jobs, out, "--no-watermark") == 1  # some items failed
    err = capsys.readouterr().err
    assert f"{jobs}:4 (000004.wav): unknown knob 'top_k' for the english model" in err
    assert f"{jobs}:5 (000005.wav): voice nope.safetensors: no such file" in err
    assert f"{jobs}:7 (000007.wav): top_p=2 is out of range" in err
    assert f"{jobs}:8 (000008.wav): language='fr': the english model speaks English only" in err
    assert "3 done, 4 failed, 0 skipped (done before) of 7 items" in err
    entries = latest(out)
    assert sorted(entries) == [1, 2, 4, 5, 6, 7, 8]  # line 3 is blank
    assert {n: e["status"] for n, e in entries.items()} == {
        1: "done", 2: "done", 4: "failed", 5: "failed", 6: "done", 7: "failed", 8: "failed"
    }  # fmt: skip
    assert [entries[n]["output"] for n in (1, 2, 6)] == ["000001.wav", "sub/two.flac", "long.wav"]
    for n, job in zip((1, 2, 6), GOOD):
        entry = entries[n]
        path = out / entry["output"]
        got, rate = sf.read(path, dtype="float32")
        want = expected(tts, folder, job, watermark=False, suffix=path.suffix)
        assert rate == tts.sample_rate and got.shape == want.shape
        assert np.abs(got - want).max() <= PCM_STEP
        assert entry["error"] is None and entry["seconds"] > 0
        assert entry["audio_seconds"] == round(len(got) / rate, 3)
    assert entries[4]["audio_seconds"] == 0 and entries[4]["seconds"] == 0
    assert sorted(p.name for p in out.iterdir()) == ["000001.wav", "long.wav", "manifest.jsonl", "sub"]


def test_batch_pause_tags_are_exact_silence_and_bad_tags_fail_their_item(folder, tts, tmp_path, capsys):
    job = {"text": "Hello there. [pause:250ms] How are you?", "seed": 1, "max_new_tokens": 6, "cfm_steps": 1}
    lines = [job, {"text": "[pause:1s]"}, {"text": "Too long [pause:10.5s] a pause."}]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    out = tmp_path / "out"
    assert batch(folder, jobs, out, "--no-watermark") == 1
    assert "jobs.jsonl:3 (000003.wav): pause tag '[pause:10.5s]' is 10.5 s long" in capsys.readouterr().err
    assert {n: e["status"] for n, e in latest(out).items()} == {1: "done", 2: "done", 3: "failed"}
    got = sf.read(out / "000001.wav", dtype="float32")[0]
    a, b = (
        expected(tts, folder, {**job, "text": t, "seed": s}, False)
        for t, s in (("Hello there.", 1), ("How are you?", 2))
    )
    assert len(got) == len(a) + 6000 + len(b)
    assert not got[len(a) : len(a) + 6000].any()
    assert np.abs(got - np.concatenate([a, np.zeros(6000), b])).max() <= PCM_STEP
    np.testing.assert_array_equal(sf.read(out / "000002.wav", dtype="float32")[0], np.zeros(24000))


def test_resume_skips_what_is_done_and_redoes_what_changed(folder, tmp_path, capsys):
    lines = [GOOD[0], GOOD[2], {"text": "Bad.", "top_k": 3}]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    out = tmp_path / "out"
    assert batch(folder, jobs, out, "--no-watermark") == 1
    first = latest(out)
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*.wav")}
    with (out / "manifest.jsonl").open("a") as f:
        f.write(TORN)
    capsys.readouterr()
    # Again: the done items are skipped (their files untouched), the bad line fails again.
    assert batch(folder, jobs, out, "--no-watermark") == 1
    assert "0 done, 1 failed, 2 skipped (done before) of 3 items" in capsys.readouterr().err
    second = latest(out)
    assert TORN + "\n" in (out / "manifest.jsonl").read_text()  # ended, so that the next line stays whole
    assert [second[n]["status"] for n in (1, 2, 3)] == ["skipped", "skipped", "failed"]
    assert (
        second[1]["audio_seconds"] == first[1]["audio_seconds"] and second[1]["inputs"] == first[1]["inputs"]
    )
    assert {p: p.stat().st_mtime_ns for p in out.glob("*.wav")} == stamps
    # A deleted output is made again; so is an item whose inputs changed (a knob), or the whole run's (watermark).
    (out / "long.wav").unlink()
    assert batch(folder, jobs, out, "--no-watermark") == 1
    assert [latest(out)[n]["status"] for n in (1, 2)] == ["skipped", "done"]
    write_jobs(jobs, [{**GOOD[0], "temperature": 0.5}, GOOD[2]])
    assert batch(folder, jobs, out, "--no-watermark") == 0  # nothing failed
    assert [latest(out)[n]["status"] for n in (1, 2)] == ["done", "skipped"]
    assert batch(folder, jobs, out) == 0
    assert [latest(out)[n]["status"] for n in (1, 2)] == ["done", "done"]


def test_one_by_one_when_the_model_cannot_batch(folder, tts, tmp_path, monkeypatch):
    # Multilingual v2 takes this path (its alignment analyzer reads one request at a time); here with the
    # watermark on, as by default.
    monkeypatch.setattr(EnglishSpeech, "batchable", False)
    jobs = write_jobs(tmp_path / "jobs.jsonl", [GOOD[0], {"text": "Bad.", "min_p": 0.5, "top_k": 3}])
    out = tmp_path / "out"
    assert batch(folder, jobs, out) == 1
    assert [latest(out)[n]["status"] for n in (1, 2)] == ["done", "failed"]
    got = sf.read(out / "000001.wav", dtype="float32")[0]
    assert np.array_equal(got, expected(tts, folder, GOOD[0], watermark=True))


@pytest.mark.parametrize(
    "line, message",
    [
        ({"text": "Hi.", "tempreature": 0.5}, "unknown field 'tempreature' (did you mean 'temperature'?)"),
        ({"text": "Hi.", "file": "a.txt"}, "give one of text (the words) and file"),
        ({"voice": "v.safetensors"}, "give one of text (the words) and file"),
        ({"text": 3}, "text must be a string, got number"),
        ({"text": "  \n"}, "the text is empty"),
        ({"file": "missing.txt"}, "file missing.txt: no such file"),
        ({"file": "latin1.txt"}, "file latin1.txt is not UTF-8 text"),
        ({"text": "Hi.", "output": "../up.wav"}, "must stay inside the output folder"),
        ({"text": "Hi.", "output": "/tmp/abs.wav"}, "must stay inside the output folder"),
        ({"text": "Hi.", "output": "a/../../up.wav"}, "must stay inside the output folder"),
        ({"text": "Hi.", "output": "x.mp3"}, "output 'x.mp3' must end in .wav, .flac, .ogg"),
        ({"text": "Hi.", "output": 7}, "output must be a file name (a string), got number"),
        ({"text": "Hi.", "voice": "nope.wav"}, "voice nope.wav: no such file"),
        ({"text": "Hi.", "seed": -1}, "seed=-1 must be an integer in [0, 2**63)"),
        ({"text": "Hi.", "seed": True}, "seed=True must be an integer"),
        ({"text": "Hi.", "max_new_tokens": 1.5}, "max_new_tokens must be an integer, got number 1.5"),
        ({"text": "Hi.", "temperature": "hot"}, 'temperature must be a number, got string "hot"'),
        ({"text": "Hi.", "temperature": -1}, "temperature=-1 is out of range"),
        ({"text": "Hi.", "cfm_steps": 0}, "cfm_steps=0 must be an integer >= 1"),
        ({"text": "Hi.", "language": "xx"}, "unsupported language 'xx'"),
        ("[1, 2]", "a JSON array, not an object"),
        ('{"text": "Hi."', "not JSON"),
    ],
)
def test_bad_lines_say_why(tmp_path, line, message):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    jobs = write_jobs(tmp_path / "jobs.jsonl", [{"text": "Fine."}, line])
    good, bad = read_jobs(jobs, Settings(model="m"))
    assert good.error is None and good.output == "000001.wav" and good.inputs
    assert bad.line == 2 and message in bad.error and bad.inputs is None


def test_every_problem_of_a_line_and_duplicate_outputs(tmp_path):
    jobs = write_jobs(
        tmp_path / "jobs.jsonl",
        [
            {"text": "One.", "output": "Same.wav"},
            {"text": "Two.", "output": "./same.WAV"},  # the same file on a case-insensitive file system
            {"text": "Three."},
            {"text": "Four.", "output": "000003.wav"},  # line 3's default name
            {"text": 1, "top_p": 2, "colour": "red"},
        ],
    )
    items = read_jobs(jobs, Settings(model="m"))
    assert [i.error for i in items[:4]] == [
        None, "output same.WAV is also line 1's", None, "output 000003.wav is also line 3's"
    ]  # fmt: skip
    assert items[4].error.count(";") == 2 and "colour" in items[4].error and "top_p=2" in items[4].error


def test_inputs_change_with_what_shapes_the_audio(tmp_path, folder):
    def inputs(job: dict, **settings) -> str:
        jobs = write_jobs(tmp_path / "jobs.jsonl", [job])
        return read_jobs(jobs, Settings(**{"model": "m", **settings}))[0].inputs

    (tmp_path / "v.safetensors").write_bytes((folder / "v5.safetensors").read_bytes())
    base = {"text": "Hi.", "voice": "v.safetensors", "seed": 1}
    same = inputs(base)
    assert inputs({**base, "output": "x.wav"}) == same  # the name is where, not what
    changed = [
        inputs({**base, "text": "Ho."}),
        inputs({**base, "seed": 2}),
        inputs({**base, "temperature": 0.1}),
        inputs(base, watermark=False),
        inputs(base, model="other"),
    ]
    assert same not in changed and len(set(changed)) == len(changed)
    (tmp_path / "v.safetensors").write_bytes((folder / "v6.safetensors").read_bytes())  # same name, new voice
    assert inputs(base) != same


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "jobs.jsonl: no such file"),
        ("", "jobs.jsonl holds no jobs"),
        ('[{"text": "Hi."}, {"text": "Ho."}]\n', "is not JSON lines: line 1 is a JSON array"),
        ('{\n  "text": "Hi."\n}\n', "is not JSON lines: line 1 is not JSON"),
        ("text,output\nHi.,a.wav\n", "is not JSON lines: line 1 is not JSON"),
        (b"\xff\xfe{}", "is not UTF-8 text"),
    ],
)
def test_a_jobs_file_that_is_not_json_lines_is_an_error(tmp_path, capsys, content, message):
    jobs = tmp_path / "jobs.jsonl"
    if isinstance(content, bytes):
        jobs.write_bytes(content)
    elif content is not None:
        jobs.write_text(content)
    argv = ["batch", str(jobs), "--out-dir", str(tmp_path / "out"), "--model", str(tmp_path / "nothing")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("mlx-chatterbox: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--actors", "2"], "--actors is for runs on Ray; add --ray [ADDRESS]"),
        (["--actor-gpus", "1"], "--actor-gpus is for runs on Ray"),
        (["--ray", "--actor-gpus", "-1"], "--actor-gpus -1.0: give a number of GPUs >= 0"),
        (["--voice", "missing.safetensors"], "--voice missing.safetensors: no such file"),
    ],
)
def test_argument_errors_come_first(tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    assert main(["batch", "jobs.jsonl", "--out-dir", "out", *extra]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_model_that_cannot_load_writes_nothing(folder, tmp_path, capsys, monkeypatch):
    """The model loads before the manifest is written: a bad model leaves no folder, and a resumed run's
    folder as it was."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", [{"text": "Hi."}, {"text": 3}])
    for out in (tmp_path / "new", tmp_path / "old"):
        if out.name == "old":
            out.mkdir()
            (out / "manifest.jsonl").write_text("")
        argv = ["batch", str(jobs), "--out-dir", str(out), "--model", str(tmp_path / "nonexistent")]
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "is neither a folder nor a Hugging Face repo id" in err and err.count("\n") == 1
    assert not (tmp_path / "new").exists() and (tmp_path / "old" / "manifest.jsonl").read_text() == ""
    # An output folder that cannot be made is refused before the model loads, too.
    monkeypatch.setattr(TTS, "load", lambda *a, **k: pytest.fail("the model loaded"))
    (tmp_path / "file.txt").write_text("")
    assert batch(folder, jobs, tmp_path / "file.txt" / "out") == 1
    assert "out cannot be made: " in capsys.readouterr().err


def test_ray_missing_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: importing it raises ImportError
    write_jobs(tmp_path / "jobs.jsonl", [{"text": "Hi."}])
    argv = ["batch", str(tmp_path / "jobs.jsonl"), "--out-dir", str(tmp_path / "out"), "--ray"]
    assert main(argv) == 1
    assert (
        "--ray needs Ray Data, which is not installed: pip install 'mlx-chatterbox[ray]'"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()


def test_nothing_imports_ray_without_the_flag(tmp_path):
    write_jobs(tmp_path / "jobs.jsonl", [{"text": "Hi.", "seed": -1}])  # fails before the model is needed
    argv = ["batch", str(tmp_path / "jobs.jsonl"), "--out-dir", str(tmp_path / "out")]
    code = f"import sys; from mlx_chatterbox.cli import main; main({argv!r}); assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    assert latest(tmp_path / "out")[1]["status"] == "failed"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_on_a_terminal(folder, tmp_path, monkeypatch):
    jobs = write_jobs(tmp_path / "jobs.jsonl", [{"text": "Bad.", "colour": 1}, GOOD[0], GOOD[2]])
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert batch(folder, jobs, tmp_path / "out", "--no-watermark") == 1
    text = terminal.getvalue()
    assert text.startswith(f"{jobs}:1 (000001.wav): unknown field 'colour'")  # a line of its own
    bars = [s.split("\x1b[K")[0] for s in text.split("\r") if s.startswith("[")]
    assert bars[0] == f"[{'#' * 8}{'-' * 16}] 1/3 items, 1 failed [0:00<?]"  # no estimate before an item is made
    assert re.fullmatch(rf"\[{'#' * 16}{'-' * 8}\] 2/3 items, 1 failed \[0:\d\d<0:\d\d\]", bars[1])
    assert re.fullmatch(rf"\[{'#' * 24}\] 3/3 items, 1 failed \[0:\d\d<0:00\]", bars[2])
    assert text.endswith("\n") and "2 done, 1 failed, 0 skipped" in text.splitlines()[-1]
    # Not a terminal: the failed line, a line per item finished, and the summary.
    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert batch(folder, jobs, tmp_path / "out2", "--no-watermark") == 1
    lines = quiet.getvalue().splitlines()
    assert lines[0].startswith(f"{jobs}:1 (000001.wav): unknown field 'colour'") and len(lines) == 5
    assert [line.split(" [")[0] for line in lines[1:4]] == [
        "1/3 items, 1 failed",
        "2/3 items, 1 failed",
        "3/3 items, 1 failed",
    ]


def test_a_piece_cut_at_its_budget_is_reported_with_its_item(folder, tmp_path, caplog):
    """The engine's warning names the jobs line and the output, and comes from bulk synthesis."""
    job = {"text": "Hello there.", "max_new_tokens": 2, "seed": 2, "output": "a.wav"}  # seeded: it must reach 2
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job])
    with caplog.at_level(logging.WARNING):
        assert batch(folder, jobs, tmp_path / "out", "--no-watermark") == 0
    cuts = [(r.name, r.getMessage()) for r in caplog.records if "budget" in r.getMessage()]
    assert cuts == [
        (
            "mlx_chatterbox.bulk",
            "line 1 (a.wav): piece 1 of 1 stopped at its budget of 2 speech tokens (0.1 s) without the stop "
            "token: its end may be cut off (raise max_new_tokens)",
        )
    ]


def test_ray_spreads_the_items_over_actors(folder, tts, tmp_path, capsys):
    ray = pytest.importorskip("ray")
    lines = [
        GOOD[0],
        {"text": "A Turbo knob.", "top_k": 5},  # fails in its actor, against the loaded model
        {**GOOD[1], "voice": str(folder / "v6.safetensors")},
        {"text": "No such voice.", "voice": "nope.safetensors"},  # fails before Ray starts
        GOOD[2],
        {**GOOD[0], "seed": 9, "output": "nine.wav"},
    ]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    out = tmp_path / "out"
    ray.init(num_cpus=2, include_dashboard=False)  # the command uses it as it is
    try:
        assert batch(folder, jobs, out, "--no-watermark", "--ray", "--actors", "2", "--max-batch", "2") == 1
    finally:
        ray.shutdown()
    err = capsys.readouterr().err
    assert f"{jobs}:2 (000002.wav): unknown knob 'top_k' for the english model" in err
    assert "4 done, 2 failed, 0 skipped (done before) of 6 items" in err
    entries = latest(out)
    assert [entries[n]["status"] for n in range(1, 7)] == ["done", "failed", "done", "failed", "done", "done"]
    for n, job in ((1, GOOD[0]), (3, GOOD[1]), (5, GOOD[2]), (6, {**GOOD[0], "seed": 9})):
        path = out / entries[n]["output"]
        want = expected(tts, folder, job, watermark=False, suffix=path.suffix)
        assert np.abs(sf.read(path, dtype="float32")[0] - want).max() <= PCM_STEP
    # The local engine resumes a Ray run: the same inputs, so nothing is made again.
    assert batch(folder, jobs, out, "--no-watermark") == 1
    assert [latest(out)[n]["status"] for n in (1, 3, 5, 6)] == ["skipped"] * 4
