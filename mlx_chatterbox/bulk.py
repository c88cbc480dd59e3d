"""Bulk synthesis: a jobs file (JSON lines, one item per line) -> audio files in a folder, for audiobooks and
data sets (``mlx-chatterbox batch``).

Every line is checked before any synthesis: a bad line becomes a failed item in the manifest (with its line
number and why), the others still run; a file that is not JSON lines at all is an error. Outputs are written
atomically (a temporary file, then a rename) and each item's outcome is appended to ``DIR/manifest.jsonl`` as it
finishes, so a killed run keeps what it did; run it again and the items whose output exists and whose latest
manifest entry is done with the same inputs (``Item.inputs``) are skipped. Locally, a batchable model runs the
server's engine (``server.worker.Worker``: T3 batched over many items, whole pieces vocoded together), any other
model ``TTS.generate`` item by item; with ``ray``, a Ray Data actor pool runs the same code, one model per actor.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import soundfile as sf

from .api import TOKENS_PER_SECOND, TTS, MultilingualParams, Voice, check_language
from .generation.vocode import check_cfm_steps
from .sampling import SEED_LIMIT, SamplingParams, TurboParams
from .server.worker import SpeechJob, Worker

logger = logging.getLogger(__name__)
MANIFEST = "manifest.jsonl"
AUDIO_FORMATS = {".wav": "WAV", ".flac": "FLAC", ".ogg": "OGG"}  # output suffix -> soundfile format
PARAMS_TYPES = (SamplingParams, MultilingualParams, TurboParams)
# Every model kind's knobs; which of them a model takes is checked once it is loaded (``TTS._params``).
KNOBS = tuple(dict.fromkeys(f.name for t in PARAMS_TYPES for f in dataclasses.fields(t)))
FIELDS = ("text", "file", "voice", "language", "seed", "cfm_steps", "output", *KNOBS)
INT_KNOBS = {"max_new_tokens", "top_k"}
RAY_EXTRA = "pip install 'mlx-chatterbox[ray]'"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a whole run shares: the model, the voice of items that name none (None: the model's built-in), the
    watermark, and the engine's batch sizes (``Worker``'s ``max_batch`` and ``vocode_batch``)."""

    model: str
    variant: str | None = None
    voice: str | None = None
    watermark: bool = True
    cfm_dtype: str = "float32"
    max_batch: int = 16
    vocode_batch: int = 8


@dataclasses.dataclass(frozen=True)
class Item:
    """One line of the jobs file, read and checked (``read_jobs``). ``error`` says why a bad line is not
    synthesised; ``output`` is its file name under the output folder (None if the line could not be read);
    ``voice`` an absolute path, or None for ``Settings.voice``; ``inputs`` the hash of everything that shapes its
    audio (text, voice file contents, knobs, language, seed, cfm_steps, model, variant, cfm_dtype, watermark).
    """

    line: int
    output: str | None
    text: str = ""
    voice: str | None = None
    knobs: dict[str, int | float] = dataclasses.field(default_factory=dict)
    language: str | None = None
    seed: int | None = None
    cfm_steps: int | None = None
    inputs: str | None = None
    error: str | None = None

    def result(
        self, status: str, error: str | None = None, seconds: float = 0.0, audio: float = 0.0
    ) -> Result:
        return Result(self.line, self.output, status, error, round(seconds, 3), round(audio, 3), self.inputs)


@dataclasses.dataclass(frozen=True)
class Result:
    """One manifest line: an item's outcome. status: "done", "failed" or "skipped" (done by an earlier run).
    seconds: wall time from when the item went to the engine until its file was written (batched items run
    together, so theirs overlap); audio_seconds: the output's length."""

    line: int
    output: str | None
    status: str
    error: str | None
    seconds: float
    audio_seconds: float
    inputs: str | None


@dataclasses.dataclass(frozen=True)
class BulkProgress:
    """Where a run is, after each item: counts so far of ``total``; ``eta``: estimated seconds left (None until
    an item has been synthesised in this run)."""

    done: int
    failed: int
    skipped: int
    total: int
    elapsed: float
    eta: float | None


class RayError(RuntimeError):
    """The Ray run itself failed (not one item): the cluster, or an actor that could not load the model."""


def read_jobs(path: Path, settings: Settings) -> list[Item]:
    """Every non-blank line of the jobs file as an ``Item``; bad lines carry their ``error``. Raises ValueError
    when the file cannot be read, holds no jobs, or none of its lines is a JSON object (it is not JSON lines).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a folder; give a jobs file (JSON lines)") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f'{path} holds no jobs: give one JSON object per line, e.g. {{"text": "Hello."}}')
    objects = []
    for n, line in lines:
        try:
            objects.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            objects.append((n, e))
    if not any(isinstance(obj, dict) for _, obj in objects):
        n, obj = objects[0]
        why = f"not JSON ({obj.msg})" if isinstance(obj, json.JSONDecodeError) else f"a JSON {_kind(obj)}"
        raise ValueError(
            f"{path} is not JSON lines: line {n} is {why}; give one JSON object per line, "
            'e.g. {"text": "Hello.", "output": "hello.wav"}'
        )
    context = _Context(path.parent, settings)
    items = [_item(n, obj, context) for n, obj in objects]
    return _refuse_duplicates(items)


def run(
    jobs: Path,
    out_dir: Path,
    settings: Settings,
    *,
    ray_address: str | None = None,
    actors: int = 1,
    actor_gpus: float = 0.0,
    report: Callable[[Result, BulkProgress], None] | None = None,
) -> BulkProgress:
    """Synthesise the jobs file into ``out_dir``; returns the final counts. ``report`` is called after each
    item's manifest line is written (bad lines and skipped items first). Nothing is written until the jobs file
    is read, ``out_dir`` is found writable (or can be made) and, locally, the model has loaded. ``ray_address``
    ("" starts a local Ray instance, "auto" or "ray://host:10001" joins a cluster) spreads the items over
    ``actors`` Ray actors, each with ``actor_gpus`` GPUs; None runs here."""
    if actors < 1:
        raise ValueError(f"actors={actors} must be at least 1")
    if not actor_gpus >= 0:
        raise ValueError(f"actor_gpus={actor_gpus} must be >= 0")
    if ray_address is not None:
        _import_ray()  # a missing extra fails before any work
    items = read_jobs(jobs, settings)
    _check_out_dir(out_dir)
    previous = read_manifest(out_dir / MANIFEST)
    known, todo = [], []  # known: the bad lines' and the skipped items' results, in line order
    for item in items:
        entry = previous.get(item.output)
        if item.error is not None:
            known.append(item.result("failed", item.error))
        elif (
            entry is not None
            and entry.get("status") in ("done", "skipped")
            and entry.get("inputs") == item.inputs
            and (out_dir / item.output).is_file()
        ):
            known.append(item.result("skipped", audio=entry.get("audio_seconds") or 0.0))
        else:
            todo.append(item)
    # The model loads before anything is written: a model that cannot load leaves no folder and no manifest.
    tts = _load(settings) if todo and ray_address is None else None
    out_dir.mkdir(parents=True, exist_ok=True)
    with _Recorder(out_dir / MANIFEST, len(items), report) as recorder:
        for result in known:
            recorder(result)
        recorder.start()
        if tts is not None:
            synthesize(tts, todo, out_dir, settings, {}, recorder)
        elif todo:
            _run_ray(todo, out_dir, settings, ray_address, actors, actor_gpus, recorder)
        return recorder.progress()


def _check_out_dir(out_dir: Path) -> None:
    """``out_dir`` is a writable folder, or can be made: the nearest folder above it that exists is writable."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is not a folder; give a folder for the audio and the manifest")
    existing = next(p for p in (out_dir.absolute(), *out_dir.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{out_dir} cannot be made: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == out_dir.absolute() else f" cannot be made: {existing}"
        raise ValueError(f"{out_dir}{where} is not writable")


def read_manifest(path: Path) -> dict[str, dict[str, Any]]:
    """The latest manifest entry of each output that a good line made (a run appends; a line torn by a killed
    run is passed over)."""
    latest: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return latest
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        # Lines that were never items (bad ones) say nothing about an output, even one they named.
        if isinstance(entry, dict) and isinstance(entry.get("output"), str) and entry.get("inputs"):
            latest[entry["output"]] = entry
    return latest


def synthesize(
    tts: TTS,
    items: Sequence[Item],
    out_dir: Path,
    settings: Settings,
    voices: dict[str | None, Voice | Exception],
    record: Callable[[Result], None],
) -> None:
    """Synthesise good ``items`` into ``out_dir`` and ``record`` each outcome. Each item is first checked
    against the model (its knobs, language, text, voice), before any synthesis; ``voices`` caches the voices
    loaded (by path; None = the default), across calls. One item's failure is recorded, never raised."""
    ready = []
    for item in items:
        try:
            ready.append((item, _job(tts, item, settings, voices)))
        except Exception as e:
            record(item.result("failed", _message(e)))
    if not ready:
        return
    if tts.speech.batchable:
        _batched(tts, ready, out_dir, settings, record)
        return
    for item, job in ready:  # Multilingual v2: its alignment analyzer reads one request at a time
        start = time.perf_counter()
        try:
            wav = tts.generate(
                job.text,
                job.voice,
                job.params,
                language=job.language,
                cfm_steps=job.cfm_steps,
                seed=job.seed,
                watermark=job.watermark,
            )
            audio = write_audio(out_dir / item.output, wav, tts.sample_rate)
        except Exception as e:
            record(item.result("failed", _message(e), time.perf_counter() - start))
        else:
            record(item.result("done", None, time.perf_counter() - start, audio))


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """``write`` a temporary file beside ``path`` (same suffix), then rename it, so that a file under its final
    name is always whole and a failure leaves nothing. The temporary name is unique per call: Ray actors on
    several hosts may write into one shared folder."""
    tmp = path.with_name(f".{path.stem}.tmp-{uuid.uuid4().hex[:12]}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:  # name the user's file, not the temporary one
        raise OSError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def write_audio(path: Path, wav: np.ndarray, sample_rate: int) -> float:
    """Write ``wav`` to ``path`` (format from the suffix) atomically (``write_atomic``); returns its seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: sf.write(tmp, wav, sample_rate, format=AUDIO_FORMATS[path.suffix.lower()]))
    return len(wav) / sample_rate


# Reading the jobs file.


@dataclasses.dataclass
class _Context:
    """What checking a line needs besides the line: the jobs file's folder (relative paths) and the run's
    settings, and the hashes of the voice files read so far."""

    folder: Path
    settings: Settings
    hashes: dict[str | None, str] = dataclasses.field(default_factory=dict)

    def voice_hash(self, path: str | None) -> str:
        """The voice file's content hash (an edited voice redoes its items), or "builtin"."""
        if path not in self.hashes:
            self.hashes[path] = (
                "builtin" if path is None else hashlib.sha256(Path(path).read_bytes()).hexdigest()
            )
        return self.hashes[path]


def _kind(value: object) -> str:
    """The JSON name of a parsed value's type, for messages."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )


def _item(n: int, obj: object, context: _Context) -> Item:
    """Line ``n`` checked: every problem of the line in one error."""
    default = f"{n:06d}.wav"
    if isinstance(obj, json.JSONDecodeError):
        return Item(n, None, error=f"not JSON ({obj.msg} at column {obj.colno})")
    if not isinstance(obj, dict):
        return Item(n, None, error=f"a JSON {_kind(obj)}, not an object")
    problems = []
    for name in obj:
        if name not in FIELDS:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (the fields are {', '.join(FIELDS)})"
            problems.append(f"unknown field {name!r}{hint}")
    output = obj.get("output", default)
    if "output" in obj:
        output, problem = _output(obj["output"])
        if problem:
            problems.append(problem)
    text, problem = _text(obj, context.folder)
    if problem:
        problems.append(problem)
    voice = None
    if "voice" in obj:
        if not isinstance(obj["voice"], str) or not obj["voice"]:
            problems.append(f"voice must be a file name (a string), got {_kind(obj['voice'])}")
        else:
            path = context.folder / obj["voice"]
            if path.is_file():
                voice = str(path.resolve())
            else:
                problems.append(f"voice {obj['voice']}: no such file ({path})")
    knobs = {name: obj[name] for name in KNOBS if name in obj}
    problems += _knob_problems(knobs)
    language = obj.get("language")
    if language is not None:
        try:
            language = check_language(language)
        except (TypeError, ValueError) as e:
            problems.append(str(e))
    seed = obj.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT
    ):
        problems.append(f"seed={seed!r} must be an integer in [0, 2**63)")
    cfm_steps = obj.get("cfm_steps")
    try:
        check_cfm_steps(cfm_steps)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        return Item(n, output, error="; ".join(problems))
    shared = context.settings
    inputs = {
        "text": text,
        "voice": context.voice_hash(voice if voice is not None else shared.voice),
        "knobs": knobs,
        "language": language,
        "seed": seed,
        "cfm_steps": cfm_steps,
        "model": shared.model,
        "variant": shared.variant,
        "cfm_dtype": shared.cfm_dtype,
        "watermark": shared.watermark,
    }
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return Item(n, output, text, voice, knobs, language, seed, cfm_steps, digest)


def _output(value: object) -> tuple[str | None, str | None]:
    """The output's normalised name under the output folder, or the problem with it."""
    if not isinstance(value, str) or not value.strip():
        return None, f"output must be a file name (a string), got {_kind(value)}"
    name = os.path.normpath(value).replace(os.sep, "/")
    if os.path.isabs(value) or name == ".." or name.startswith("../"):
        return None, f"output {value!r} must stay inside the output folder (a relative name without '..')"
    suffix = os.path.splitext(name)[1].lower()
    if suffix not in AUDIO_FORMATS:
        return None, f"output {value!r} must end in {', '.join(AUDIO_FORMATS)}"
    return name, None


def _text(obj: dict, folder: Path) -> tuple[str, str | None]:
    """The text to speak (given, or read from ``file``), or the problem with it."""
    if ("text" in obj) == ("file" in obj):
        return "", "give one of text (the words) and file (a UTF-8 text file)"
    if "text" in obj:
        text = obj["text"]
        if not isinstance(text, str):
            return "", f"text must be a string, got {_kind(text)}"
    else:
        if not isinstance(obj["file"], str) or not obj["file"]:
            return "", f"file must be a file name (a string), got {_kind(obj['file'])}"
        path = folder / obj["file"]
        try:
            text = path.read_text(encoding="utf-8")
        except (FileNotFoundError, IsADirectoryError):
            return "", f"file {obj['file']}: no such file ({path})"
        except UnicodeDecodeError:
            return "", f"file {obj['file']} is not UTF-8 text"
    if not text.strip():
        return "", "the text is empty"
    return text, None


def _knob_problems(knobs: dict[str, object]) -> list[str]:
    """Each knob's type, and its range by every model kind that has it (which knobs the model takes is checked
    once it is loaded)."""
    problems = []
    for name, value in knobs.items():
        number = isinstance(value, int) or (isinstance(value, float) and name not in INT_KNOBS)
        if isinstance(value, bool) or not number:
            kind = "an integer" if name in INT_KNOBS else "a number"
            problems.append(f"{name} must be {kind}, got {_kind(value)} {json.dumps(value)}")
            continue
        errors = []
        kinds = [t for t in PARAMS_TYPES if name in t.__dataclass_fields__]
        for params_type in kinds:
            try:
                params_type(**{name: value})
            except ValueError as e:
                errors.append(str(e))
        if len(errors) == len(kinds):
            problems.append(errors[0])
    return problems


def _refuse_duplicates(items: list[Item]) -> list[Item]:
    """A later line with the output of an earlier one fails (case-insensitively: macOS file systems are)."""
    first: dict[str, int] = {}
    checked = []
    for item in items:
        if item.output is not None:
            key = item.output.casefold()
            if key in first:
                why = f"output {item.output} is also line {first[key]}'s"
                error = why if item.error is None else f"{item.error}; {why}"
                item = dataclasses.replace(item, error=error, inputs=None)
            else:
                first[key] = item.line
        checked.append(item)
    return checked


# Synthesis.


def _load(settings: Settings) -> TTS:
    return TTS.load(settings.model, variant=settings.variant, cfm_dtype=settings.cfm_dtype)


def _message(error: BaseException) -> str:
    return str(error) or type(error).__name__


def _job(tts: TTS, item: Item, settings: Settings, voices: dict[str | None, Voice | Exception]) -> SpeechJob:
    """The item as the engine's job, checked against the model as ``Worker.submit`` and ``TTS.generate`` check
    (ValueError or TypeError naming the problem)."""
    params = tts._params(None, dict(item.knobs))
    tts.speech.check(params)
    tts._plan(item.text, item.language)  # the language, pause tags, and that T3 takes the text
    path = item.voice if item.voice is not None else settings.voice
    if path not in voices:
        try:
            voice = tts._voice(path)
            # Read and evaluated here, before the engine starts: its thread cannot evaluate arrays made on this
            # one while it runs (Worker.start).
            mx.eval([getattr(voice, f.name) for f in dataclasses.fields(voice)])
            voices[path] = voice
        except Exception as e:
            voices[path] = e
    voice = voices[path]
    if isinstance(voice, Exception):
        raise voice
    return SpeechJob(
        item.text,
        voice,
        params,
        cfm_steps=item.cfm_steps,
        seed=item.seed,
        watermark=settings.watermark,
        language=item.language,
        on_cut=functools.partial(_warn_cut, item, params.max_new_tokens),
    )


def _warn_cut(item: Item, max_new_tokens: int, piece: int, pieces: int, budget: int) -> None:
    """The engine's warning for a piece cut at its budget, naming the item."""
    fix = "raise max_new_tokens" if budget == max_new_tokens else "try another seed"
    logger.warning(
        "line %d (%s): piece %d of %d stopped at its budget of %d speech tokens (%.1f s) without the stop "
        "token: its end may be cut off (%s)",
        item.line,
        item.output,
        piece,
        pieces,
        budget,
        budget / TOKENS_PER_SECOND,
        fix,
    )


def _batched(
    tts: TTS,
    ready: list[tuple[Item, SpeechJob]],
    out_dir: Path,
    settings: Settings,
    record: Callable[[Result], None],
) -> None:
    """The items through the server's engine: ``max_batch`` reader threads keep as many jobs in it, so that T3
    always decodes a full batch, and each writes its item's file when the audio is out."""
    stopping = threading.Event()

    def one(item: Item, job: SpeechJob) -> None:
        start = time.perf_counter()
        try:
            wav = np.concatenate(list(worker.submit(job)))
            audio = write_audio(out_dir / item.output, wav, tts.sample_rate)
        except Exception as e:
            if not stopping.is_set():  # an interrupted run's items are not failures; they run next time
                record(item.result("failed", _message(e), time.perf_counter() - start))
            return
        record(item.result("done", None, time.perf_counter() - start, audio))

    # Readers beyond max_batch would only queue jobs; the queue has room for each reader's next job while the
    # engine is still counting its last one.
    worker = Worker(
        tts,
        max_batch=settings.max_batch,
        max_queue=2 * settings.max_batch,
        vocode_batch=settings.vocode_batch,
    )
    worker.start()
    pool = ThreadPoolExecutor(max_workers=settings.max_batch, thread_name_prefix="mlx-chatterbox-bulk")
    try:
        for future in [pool.submit(one, item, job) for item, job in ready]:
            future.result()  # a reader's own error (the manifest cannot be written) ends the run
    finally:
        stopping.set()
        pool.shutdown(wait=False, cancel_futures=True)
        worker.close()  # fails the jobs still in the engine, which frees their readers
        pool.shutdown(wait=True)


class _Recorder:
    """Appends each result to the manifest as it comes (from any thread), keeps the counts, and reports."""

    def __init__(self, path: Path, total: int, report: Callable[[Result, BulkProgress], None] | None):
        self.path, self.total, self.report = path, total, report
        self.counts = {"done": 0, "failed": 0, "skipped": 0}
        self.lock = threading.Lock()
        self.began = time.perf_counter()
        self.started: float | None = None  # when synthesis began
        self.synthesised = 0  # items synthesised since then

    def __enter__(self) -> _Recorder:
        torn = False
        if self.path.is_file() and self.path.stat().st_size:
            with self.path.open("rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        self.file = self.path.open("a", encoding="utf-8")
        if torn:  # a killed run's half line: end it, so that the next entry stays whole
            self.file.write("\n")
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def start(self) -> None:
        self.started = time.perf_counter()

    def __call__(self, result: Result) -> None:
        with self.lock:
            self.file.write(json.dumps(dataclasses.asdict(result)) + "\n")
            self.file.flush()  # a killed run keeps every finished item's line
            self.counts[result.status] += 1
            if self.started is not None and (result.status == "done" or result.seconds):
                self.synthesised += 1  # the rate counts items that took time, not those refused on sight
            progress = self.progress()
            if self.report is not None:
                self.report(result, progress)

    def progress(self) -> BulkProgress:
        now = time.perf_counter()
        finished = sum(self.counts.values())
        eta = None
        if self.started is not None and self.synthesised:
            eta = (now - self.started) / self.synthesised * (self.total - finished)
        return BulkProgress(*self.counts.values(), self.total, now - self.began, eta)


# Ray.


class _RaySynthesizer:
    """A Ray Data actor: loads the model once, then synthesises each batch of items handed to it, writing their
    files itself (into a folder every actor can reach), and returns their results."""

    def __init__(self, settings: str, out_dir: str):
        self.settings = Settings(**json.loads(settings))
        self.out_dir = Path(out_dir)
        self.tts = _load(self.settings)
        self.voices: dict[str | None, Voice | Exception] = {}

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        items = [Item(**json.loads(job)) for job in batch["job"]]
        results: list[Result] = []
        synthesize(self.tts, items, self.out_dir, self.settings, self.voices, results.append)
        # Some outcome for every item, even one the engine lost without a result.
        seen = {r.line for r in results}
        results += [i.result("failed", "no result from the engine") for i in items if i.line not in seen]
        return {"result": np.array([json.dumps(dataclasses.asdict(r)) for r in results], dtype=object)}


def _import_ray():
    try:
        import ray
        import ray.data
    except ImportError:
        raise ImportError(f"--ray needs Ray Data, which is not installed: {RAY_EXTRA}") from None
    return ray


def _run_ray(
    todo: list[Item],
    out_dir: Path,
    settings: Settings,
    address: str,
    actors: int,
    actor_gpus: float,
    record: Callable[[Result], None],
) -> None:
    """The items over a pool of ``actors`` Ray actors, in batches of up to ``max_batch`` (fewer when there are
    few items, so that every actor gets some); results are recorded here as the batches finish. A Ray that the
    caller has already initialised (``ray.init``) is used as it is, and left running."""
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(address=address or None, logging_level=logger.getEffectiveLevel())
    # Ray Data logs each run's plan at INFO and draws its own progress bars: ours instead, unless verbose (and
    # without its warning that its bars are off).
    quiet = logger.getEffectiveLevel() > logging.INFO
    logging.getLogger("ray.data").setLevel(logging.WARNING if quiet else logging.NOTSET)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR if quiet else logging.NOTSET)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        batch = max(1, min(settings.max_batch, math.ceil(len(todo) / actors)))
        rows = [{"job": json.dumps(dataclasses.asdict(item))} for item in todo]
        out = ray.data.from_items(rows, override_num_blocks=math.ceil(len(rows) / batch)).map_batches(
            _RaySynthesizer,
            fn_constructor_kwargs={
                "settings": json.dumps(dataclasses.asdict(settings)),
                "out_dir": str(out_dir.resolve()),
            },
            batch_size=batch,
            batch_format="numpy",
            # A batch takes seconds to minutes: one queued on a busy actor would only keep an idle one waiting.
            compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1),
            num_cpus=1,
            **({"num_gpus": actor_gpus} if actor_gpus else {}),
        )
        rows_out = iter(out.iter_rows())
        while True:
            try:
                row = next(rows_out)
            except StopIteration:
                break
            except Exception as e:  # Ray's own errors: a lost cluster, an actor that could not load the model
                raise RayError(f"the Ray run failed: {_message(e).strip().splitlines()[-1]}") from e
            record(Result(**json.loads(row["result"])))  # its errors (the manifest) are not Ray's
    finally:
        if started:
            ray.shutdown()
