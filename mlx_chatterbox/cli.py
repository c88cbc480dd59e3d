"""The ``mlx-chatterbox`` command: ``convert``, ``say`` (text or speech tokens -> audio file), ``voice`` (a recording
-> a voice file), ``vc`` (a recording -> the same speech in another voice), ``batch`` (a jobs file -> a folder of
audio files), ``bench`` and ``tokens``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from . import __version__, _backend, bulk
from .api import (
    CFM_DTYPES,
    LANGUAGES,
    TOKENS_PER_SECOND,
    TTS,
    VOICE_SUFFIX,
    MultilingualParams,
    Progress,
    Voice,
    check_language,
    check_vc_decoder,
    split_pauses,
)
from .bulk import AUDIO_FORMATS, write_atomic
from .convert import DEFAULT_REPO, DTYPES, convert, source_variant
from .quantize import BITS, GROUP_SIZES
from .sampling import SamplingParams, TurboParams, check_seed
from .variants import CHECKPOINTS, MULTILINGUAL, PACK_LANGUAGES, PRESETS

PROG = "mlx-chatterbox"
APLAY = "aplay -f S16_LE -r 24000 -c 1"  # a player for --stream's output
KNOBS = {  # SamplingParams / TurboParams field -> help
    "temperature": "sampling temperature, >= 0; 0 = greedy (Turbo: 0 = unscaled, as upstream)",
    "top_p": "nucleus probability mass kept, in (0, 1]",
    "top_k": "keep the k most likely tokens, >= 0 (0 = all)",
    "min_p": "drop tokens below min_p x the top probability, in [0, 1]",
    "repetition_penalty": "penalty on tokens already generated, > 0",
    "cfg_weight": "classifier-free guidance weight, >= 0",
    "exaggeration": "emotion exaggeration, >= 0",
    "max_new_tokens": "most speech tokens per T3 pass (per piece of a long text), 25 per second of audio",
}
# Each knob's upstream default by model; a knob a model has no use for is refused when given for it.
KNOB_DEFAULTS = {
    "English, Multilingual v3": SamplingParams(),
    "Multilingual v2": MultilingualParams(),
    "Turbo/Nano": TurboParams(),
}
VARIANT_KNOBS = {
    "english": "English, Multilingual v3",
    "multilingual-v3": "English, Multilingual v3",
    "multilingual": "Multilingual v2",
    "turbo": "Turbo/Nano",
    "nano": "Turbo/Nano",
    **{variant: "English, Multilingual v3" for variant in PACK_LANGUAGES},  # the language packs run v3's code
}


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line that names the problem and where help is, not the whole usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _at_least_1(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range: it must be an integer >= 1")
    return value


_at_least_1.__name__ = "integer"  # argparse says "invalid <__name__> value: 'x'" when int() fails


def _seed(text: str) -> int:
    """An argparse type: a seed MLX takes."""
    value = int(text)
    try:
        check_seed(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


_seed.__name__ = "integer"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Chatterbox text-to-speech on Apple's MLX.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "convert",
        help="convert an upstream checkpoint to an MLX model folder",
        description="Convert an upstream Chatterbox checkpoint (a local folder or a Hugging Face repo id) "
        "into an MLX model folder. Needs no torch.",
    )
    p.add_argument(
        "src", help=f"upstream checkpoint folder, or a Hugging Face repo id such as {DEFAULT_REPO}"
    )
    p.add_argument("dst", type=Path, help="MLX model folder to create")
    p.add_argument(
        "--variant",
        choices=list(CHECKPOINTS),
        help="english, multilingual or multilingual-v3 (ResembleAI/chatterbox), turbo "
        "(ResembleAI/chatterbox-turbo), nano (ResembleAI/chatterbox-nano) or a language pack "
        "(multilingual-v3-pt-br: ResembleAI/Chatterbox-Multilingual-pt-br, ...); default: found from the files "
        "(a repo id: its first, english for ResembleAI/chatterbox)",
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="T3 weight precision (default: float32; bfloat16 with --quantize, for the scales)",
    )
    p.add_argument(
        "--quantize",
        type=int,
        choices=BITS,
        metavar="BITS",
        help="quantize T3's backbone linear layers to 4 or 8 bits: a smaller model, faster where memory bounds "
        "decoding (Apple GPUs); slower on a CPU, whose quantized matmul is slower than float32",
    )
    p.add_argument(
        "--q-group-size",
        type=int,
        choices=GROUP_SIZES,
        help="inputs per quantization scale and bias: 32, 64 or 128 (default: 64)",
    )
    p.add_argument("--revision", help="Hub branch, tag or commit (repo ids only)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens")

    p = sub.add_parser(
        "say",
        help="speak a text (or vocode speech tokens) into an audio file",
        description="Speak TEXT with the model's built-in voice (or --voice) and write 24 kHz mono audio to "
        "OUTPUT (.wav, .flac or .ogg, from the extension). With --tokens, vocode saved speech tokens instead.",
    )
    p.add_argument("text", nargs="?", help="text to speak; '-' reads standard input")
    p.add_argument("--file", type=Path, metavar="FILE", help="speak the text in this file (UTF-8)")
    p.add_argument(
        "--tokens",
        type=Path,
        metavar="FILE",
        help="vocode these speech tokens (as 'mlx-chatterbox tokens' writes them) instead of a text",
    )
    _model_arguments(p)
    p.add_argument(
        "-o", "--output", type=Path, help="audio file to write (required unless --stream or --play)"
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="write raw PCM (s16le, mono, 24 kHz) to standard output as it is made, for a player: "
        f"... --stream | {APLAY}",
    )
    p.add_argument(
        "--play",
        action="store_true",
        help="play through the default audio device as it is made (needs mlx-chatterbox[play] and PortAudio)",
    )
    p.add_argument(
        "--no-watermark",
        action="store_true",
        help="leave out Perth's implicit watermark (upstream always adds it; on by default)",
    )
    p.add_argument(
        "--s3gen",
        choices=("mlx", "torch"),
        default="mlx",
        help="vocoder: ours (mlx) or, in hybrid mode, upstream's PyTorch S3Gen (needs mlx-chatterbox[hybrid])",
    )
    p.add_argument(
        "--cfm-steps",
        type=_at_least_1,
        help="Euler steps of the flow-matching decoder; fewer is faster and rougher (default: the model's, 10; Turbo/Nano 2)",
    )
    _cfm_dtype_argument(p)
    _language_argument(p)
    _knob_arguments(p)

    p = sub.add_parser(
        "voice",
        help="clone a voice from a recording into a voice file",
        description="Clone the voice in REFERENCE (an audio file of one speaker; 5-10 s of clean speech works "
        "best) into a voice file, to pass as --voice later.",
    )
    p.add_argument("reference", type=Path, help="audio file (wav, flac, ogg, mp3, ...)")
    p.add_argument("-o", "--output", required=True, type=Path, help="voice file to write (.safetensors)")
    p.add_argument(
        "--model",
        default=DEFAULT_REPO,
        help=f"a converted folder, an upstream checkpoint folder or a Hub repo id (default: {DEFAULT_REPO})",
    )
    _variant_argument(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens and print timings")

    p = sub.add_parser(
        "vc",
        help="re-speak a recording in another voice (voice conversion)",
        description="Voice conversion, as upstream ChatterboxVC: the speech of SOURCE (an audio file) turned "
        "into speech tokens and spoken again by S3Gen in the voice --voice (default: the built-in voice), "
        "written as 24 kHz mono audio to OUTPUT (.wav, .flac or .ogg, from the extension). English and "
        "multilingual models (Turbo and Nano have no voice conversion upstream).",
    )
    p.add_argument("source", type=Path, help="audio file of the speech to convert (wav, flac, ogg, mp3, ...)")
    _model_arguments(p)
    p.add_argument(
        "-o", "--output", required=True, type=Path, help="audio file to write (.wav, .flac or .ogg)"
    )
    p.add_argument(
        "--cfm-steps",
        type=_at_least_1,
        help="Euler steps of the flow-matching decoder; fewer is faster and rougher (default: the model's, 10)",
    )
    p.add_argument("--seed", type=_seed, help="seed for reproducible output, in [0, 2**63) (default: random)")
    p.add_argument(
        "--no-watermark",
        action="store_true",
        help="leave out Perth's implicit watermark (upstream always adds it; on by default)",
    )

    p = sub.add_parser(
        "bench",
        help="time text -> speech on this machine",
        description="Time speech-token generation (T3) and vocoding (S3Gen) of a fixed sentence with the model's "
        "built-in voice (or --voice): a warm-up, then --repeats runs; prints T3's decode steps per second and "
        "the real-time factor. (benchmarks/ in the repository compares with upstream.)",
    )
    _model_arguments(p)
    p.add_argument("--repeats", type=_at_least_1, default=3, help="timed runs after the warm-up (default: 3)")
    p.add_argument(
        "--max-new-tokens",
        type=_at_least_1,
        default=250,
        help="speech tokens per run, at most (default: 250 = 10 s)",
    )
    _cfm_dtype_argument(p)

    p = sub.add_parser(
        "tokens",
        help="generate speech tokens for a text",
        description="Generate Chatterbox speech tokens (25 per second of audio) for TEXT with T3, and print "
        "them space-separated (or write them to a file).",
    )
    p.add_argument("text", help="text to speak; '-' reads standard input")
    _model_arguments(p)
    _language_argument(p)
    p.add_argument("-o", "--output", type=Path, help="write the tokens to this file instead of stdout")
    _knob_arguments(p)

    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible speech server",
        description="Serve POST /v1/audio/speech (OpenAI's text-to-speech API, plus Chatterbox's knobs) and a "
        "voice library under /v1/audio/voices over HTTP, batching concurrent requests through one model "
        "(needs mlx-chatterbox[serve]; README: Server).",
    )
    _model_arguments(p)  # here --voice is the voice named "default" (instead of the built-in one)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (default: 8000)")
    p.add_argument(
        "--max-batch",
        type=_at_least_1,
        default=32,
        help="requests whose speech tokens are drawn together, at most (default: 32)",
    )
    p.add_argument(
        "--vocode-batch",
        type=_at_least_1,
        default=8,
        help="whole (not streamed) requests whose speech tokens are vocoded together when T3 finishes them "
        "in the same step, at most (default: 8; S3Gen's memory grows with it)",
    )
    p.add_argument(
        "--max-queue",
        type=_at_least_1,
        default=128,
        help="requests running or waiting, at most; more are answered 429 (default: 128)",
    )
    p.add_argument(
        "--voices",
        type=Path,
        metavar="DIR",
        help="folder of the stored voices (<name>.safetensors; uploads go there); default: "
        "$XDG_CACHE_HOME/mlx-chatterbox/voices or ~/.cache/mlx-chatterbox/voices",
    )
    p.add_argument(
        "--cfm-steps",
        type=_at_least_1,
        help="Euler steps of the flow-matching decoder for requests that give none (default: the model's, 10; Turbo/Nano 2)",
    )
    _cfm_dtype_argument(p)
    p.add_argument(
        "--memory-limit",
        type=float,
        metavar="GB",
        help="cap MLX's memory (mx.set_memory_limit) and its buffer cache at this many GB (default: no cap)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="on SIGTERM/SIGINT, seconds the requests in flight get to finish before they are cut "
        "(new ones are refused with 503; a second signal exits at once; default: 10)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every path but /health and / (repeatable; "
        "$MLX_CHATTERBOX_API_KEY adds comma-separated keys)",
    )
    p.add_argument(
        "--allowed-origins",
        action="append",
        metavar="ORIGINS",
        help="web origins whose pages may call the server (CORS), comma-separated, e.g. "
        "https://app.example.com, or * (default: none, same origin only)",
    )
    p.add_argument("--no-ui", action="store_true", help="do not serve the playground page at /")
    _batch_arguments(sub)
    return parser


def _model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_REPO,
        help="a converted folder, an upstream checkpoint folder or a Hugging Face repo id (converted once and "
        f"cached); default: {DEFAULT_REPO}",
    )
    _variant_argument(p)
    p.add_argument(
        "--voice",
        type=Path,
        help="a voice file (.safetensors, from 'mlx-chatterbox voice') or a recording to clone; "
        "default: the built-in voice",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens and print timings")


def _variant_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--variant",
        choices=tuple(CHECKPOINTS),
        help="which model of a source that holds several (ResembleAI/chatterbox: english, multilingual, "
        "multilingual-v3); default: the one the files hold, english for ResembleAI/chatterbox",
    )


def _language_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--language",
        help="the text's language, for the multilingual models (required there): one of "
        + ", ".join(LANGUAGES),
    )


def _language(args: argparse.Namespace) -> str | None:
    """--language, checked before the model loads: a known code, and given exactly when the model (when
    --variant or --model tells it) is multilingual."""
    if args.language is not None:
        check_language(args.language)
    variant = args.variant or source_variant(args.model)
    if variant in PACK_LANGUAGES:  # a language pack speaks its language, by default
        if args.language not in (None, PACK_LANGUAGES[variant]):
            raise ValueError(
                f"--language {args.language}: the {variant} model is a finetune for "
                f"{PACK_LANGUAGES[variant]!r} only; leave --language out, or use multilingual-v3"
            )
        return args.language
    if variant is not None and (args.language is not None) != (variant in MULTILINGUAL):
        if args.language is None:
            raise ValueError(f"the {variant} model needs --language: one of {', '.join(LANGUAGES)}")
        raise ValueError(
            f"--language is for the multilingual models; the {variant} model speaks English only"
        )
    return args.language


def _cfm_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cfm-dtype",
        choices=tuple(CFM_DTYPES),
        default="float32",
        help="precision of the flow-matching estimator: float32 (upstream's numbers) or bfloat16 (faster on "
        "GPUs, mel within 2%% of float32)",
    )


def _knob_arguments(p: argparse.ArgumentParser) -> None:
    knobs = p.add_argument_group("sampling (speech tokens)")
    for name, help_text in KNOBS.items():
        defaults = {m: getattr(p, name) for m, p in KNOB_DEFAULTS.items() if hasattr(p, name)}
        values = list(defaults.values())
        common = max(values, key=values.count)
        shown = "".join(f", {m} {d}" for m, d in defaults.items() if d != common)
        lacking = [m for m in KNOB_DEFAULTS if m not in defaults]
        only = f"; not a knob of {' or '.join(lacking)}" if lacking else ""
        only = f"; {' and '.join(defaults)} only" if len(defaults) == 1 else only
        # None = not given, so that a knob given where it has no effect (say --tokens) can be refused.
        knobs.add_argument(
            f"--{name.replace('_', '-')}",
            type=type(common),
            help=f"{help_text} (default: {common}{shown}{only})",
        )
    p.add_argument("--seed", type=_seed, help="seed for reproducible output, in [0, 2**63) (default: random)")


def _knobs(args: argparse.Namespace) -> dict:
    """The knobs given, checked now, before the model loads: against the model's own knobs when its variant
    can be told from --model (``source_variant``), else each value by every model kind that has the knob (the
    model checks the rest once loaded)."""
    knobs = {n: getattr(args, n) for n in KNOBS if getattr(args, n) is not None}
    variant = args.variant or source_variant(args.model)
    if variant is not None:
        kind = VARIANT_KNOBS[variant]
        unknown = [n for n in knobs if not hasattr(KNOB_DEFAULTS[kind], n)]
        if unknown:
            raise ValueError(
                f"--{unknown[0].replace('_', '-')} is not a knob of the {variant} model {args.model}"
            )
        dataclasses.replace(KNOB_DEFAULTS[kind], **knobs)
        return knobs
    for name, value in knobs.items():
        errors = []
        for params in KNOB_DEFAULTS.values():
            if hasattr(params, name):
                try:
                    dataclasses.replace(params, **{name: value})
                except ValueError as e:
                    errors.append(e)
        if len(errors) == sum(hasattr(p, name) for p in KNOB_DEFAULTS.values()):
            raise errors[0]
    return knobs


class _ProgressLine:
    """A progress bar over the pieces of a text on one line of a terminal, with where the current piece is."""

    WIDTH = 24

    def __init__(self, stream):
        self.stream = stream
        self.drawn = False

    def __call__(self, p: Progress) -> None:
        finished = p.piece - 1 + (p.stage == "vocode" and p.done == p.total)
        filled = round(self.WIDTH * finished / p.pieces)
        if p.stage == "tokens":
            where = f"speech tokens {p.done} ({p.done / TOKENS_PER_SECOND:.1f} s)"
        else:
            where = "vocoding" if p.done < p.total else "done"
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        # \r and "erase to the end of the line" redraw the line in place.
        self.stream.write(f"\r[{bar}] piece {p.piece}/{p.pieces}: {where}\x1b[K")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:  # end the line; nothing to end if an error came first
            self.stream.write("\n")


def _log_format(stream) -> str:
    """On a terminal a log line first erases the progress line it interrupts (which is redrawn below it)."""
    return ("\r\x1b[K" if stream.isatty() else "") + "%(name)s: %(message)s"


@contextlib.contextmanager
def _progress():
    """A ``_ProgressLine`` on stderr when it is a terminal (None otherwise), ended with a newline."""
    line = _ProgressLine(sys.stderr) if sys.stderr.isatty() else None
    try:
        yield line
    finally:
        if line is not None:
            line.close()


def _check_output(path: Path, suffixes: tuple[str, ...] | None = None) -> None:
    """Fail now, not after minutes of generation, if ``path`` cannot be written (or has none of ``suffixes``)."""
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise ValueError(f"{path}: choose an output ending in {', '.join(suffixes)}")
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"{path}: the folder {folder} does not exist; create it or write elsewhere")
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a file name")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{path}: the folder {folder} is not writable")


def _check_voice(path: Path | None) -> None:
    if path is not None and not path.is_file():
        raise ValueError(f"--voice {path}: no such file")


def _load_voice(tts: TTS, path: Path | None) -> Voice | None:
    """The voice file, or the clone of a recording, once (not per call); None for the built-in voice."""
    if path is None:
        return None
    return Voice.load(path) if path.suffix.lower() == VOICE_SUFFIX else tts.voice(path)


def _convert(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    if args.quantize is None and args.q_group_size is not None:
        raise ValueError("--q-group-size applies to quantized conversions; add --quantize 4 or 8")
    dst = convert(
        args.src,
        args.dst,
        variant=args.variant,
        dtype=args.dtype,
        quantize=args.quantize,
        q_group_size=args.q_group_size or 64,
        revision=args.revision,
        overwrite=args.overwrite,
    )
    manifest = json.loads((dst / "config.json").read_text())
    precision, q = manifest["t3_precision"], manifest["t3_precision"]["quantization"]
    what = manifest["variant"] + ", " + precision["dtype"]
    what += "" if q is None else f", {q['bits']}-bit groups of {q['group_size']}"
    print(f"converted {args.src} -> {dst} ({what}) in {time.perf_counter() - start:.1f} s", file=sys.stderr)


def _text(args: argparse.Namespace) -> str:
    if getattr(args, "file", None) is not None:
        try:
            text = args.file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{args.file} is not UTF-8 text") from None
        except FileNotFoundError:
            raise ValueError(f"--file {args.file}: no such file") from None
    else:
        text = sys.stdin.read() if args.text == "-" else args.text
    if not text.strip():
        raise ValueError("the text is empty; give some words to speak")
    split_pauses(text, TTS.sample_rate)  # a malformed or too long pause tag fails before the model loads
    return text


def _read_tokens(path: Path) -> np.ndarray:
    try:
        return np.array([int(t) for t in path.read_text().split()], dtype=np.int64)
    except ValueError:
        raise ValueError(f"{path} must hold speech token ids separated by spaces") from None
    except FileNotFoundError:
        raise ValueError(f"--tokens {path}: no such file") from None


def _check_live(args: argparse.Namespace):
    """Check --stream / --play against the other say arguments and the machine; the sounddevice module
    for --play (None otherwise)."""
    if args.stream and args.play:
        raise ValueError("choose one of --stream and --play")
    flag = "--stream" if args.stream else "--play"
    if args.tokens is not None:
        raise ValueError(f"{flag} speaks a text; vocode --tokens into an audio file with -o instead")
    if args.stream:
        if args.output is not None and str(args.output) != "-":
            raise ValueError("--stream writes to standard output; leave out -o (or give -o -)")
        if sys.stdout.isatty():
            raise ValueError(
                f"--stream writes raw PCM to standard output, which is a terminal; pipe it to a player: "
                f"... --stream | {APLAY} (or | ffplay -f s16le -ar 24000 -nodisp -)"
            )
        return None
    if args.output is not None:
        raise ValueError("--play plays the audio; leave out -o (or drop --play to write a file)")
    return _sounddevice()


def _sounddevice():
    """The sounddevice module, with PortAudio and a default output device, or a one-line error."""
    try:
        sd = importlib.import_module("sounddevice")
    except ImportError:
        raise ValueError("--play needs sounddevice: pip install 'mlx-chatterbox[play]'") from None
    except OSError as e:  # sounddevice raises OSError when it cannot load the PortAudio library
        raise ValueError(
            f"--play needs the PortAudio library ({e}): install it (apt install libportaudio2, "
            "brew install portaudio), or use --stream"
        ) from None
    try:
        sd.query_devices(kind="output")
    except Exception as e:  # PortAudioError or ValueError, depending on what is missing
        raise ValueError(f"--play found no default audio output device ({e}); use --stream or -o") from None
    return sd


def _write_pcm(chunks, out, rate: int) -> float:
    """Raw s16le samples of each chunk to the binary stream ``out`` as it comes; the seconds written."""
    samples = 0
    for chunk in chunks:
        out.write((np.clip(chunk, -1.0, 1.0) * 32767).round().astype("<i2").tobytes())
        out.flush()
        samples += len(chunk)
    return samples / rate


def _play(sd, chunks, rate: int) -> float:
    """Play each chunk through the default output as it comes; the seconds played."""
    samples = 0
    with sd.OutputStream(samplerate=rate, channels=1, dtype="float32") as out:
        for chunk in chunks:
            out.write(np.ascontiguousarray(chunk, dtype=np.float32).reshape(-1, 1))
            samples += len(chunk)
    return samples / rate


def _say(args: argparse.Namespace) -> None:
    # Every argument is checked before the model loads: generation can take minutes on a CPU.
    if [args.text, args.file, args.tokens].count(None) != 2:
        raise ValueError("give one of: a TEXT to speak, --file FILE, --tokens FILE")
    live = args.stream or args.play
    sd = _check_live(args) if live else None
    if not live:
        if str(args.output) == "-":
            raise ValueError("-o - writes raw PCM to standard output: add --stream")
        _check_output(args.output, tuple(AUDIO_FORMATS))
    _check_voice(args.voice)
    if args.tokens is not None:
        given = [n for n in (*KNOBS, "language") if getattr(args, n) is not None]
        if given:
            raise ValueError(
                f"--{given[0].replace('_', '-')} shapes speech tokens; it has no effect with --tokens"
            )
        tokens = _read_tokens(args.tokens)
    else:
        text, knobs, language = _text(args), _knobs(args), _language(args)
    start = time.perf_counter()
    tts = TTS.load(args.model, variant=args.variant, s3gen=args.s3gen, cfm_dtype=args.cfm_dtype)
    loaded = time.perf_counter()
    voice = _load_voice(tts, args.voice)
    watermark = not args.no_watermark
    if live:
        chunks = tts.stream(
            text,
            voice,
            language=language,
            cfm_steps=args.cfm_steps,
            seed=args.seed,
            watermark=watermark,
            **knobs,
        )
        if args.stream:
            seconds = _write_pcm(chunks, sys.stdout.buffer, tts.sample_rate)
        else:
            seconds = _play(sd, chunks, tts.sample_rate)
        if args.verbose:
            spent = time.perf_counter() - loaded
            print(
                f"load {loaded - start:.2f} s, speech {spent:.2f} s for {seconds:.2f} s of audio "
                f"(real-time factor {spent / max(seconds, 1e-9):.2f})\n" + _backend_lines(),
                file=sys.stderr,
            )
        return
    if args.tokens is not None:
        wav = tts.vocode(tokens, voice, cfm_steps=args.cfm_steps, seed=args.seed, watermark=watermark)
    else:
        with _progress() as progress:
            wav = tts.generate(
                text,
                voice,
                language=language,
                cfm_steps=args.cfm_steps,
                seed=args.seed,
                watermark=watermark,
                progress=progress,
                **knobs,
            )
    done = time.perf_counter()
    bulk.write_audio(args.output, wav, tts.sample_rate)
    if args.verbose:
        seconds = len(wav) / tts.sample_rate
        print(
            f"load {loaded - start:.2f} s, speech {done - loaded:.2f} s for {seconds:.2f} s of audio "
            f"(real-time factor {(done - loaded) / max(seconds, 1e-9):.2f})\n" + _backend_lines(),
            file=sys.stderr,
        )


def _voice(args: argparse.Namespace) -> None:
    _check_output(args.output, (VOICE_SUFFIX,))
    if not args.reference.is_file():
        raise ValueError(f"{args.reference}: no such file")
    start = time.perf_counter()
    tts = TTS.load(args.model, variant=args.variant)
    loaded = time.perf_counter()
    voice = tts.voice(args.reference)
    done = time.perf_counter()
    voice.save(args.output)  # atomic too
    if args.verbose:
        print(
            f"load {loaded - start:.2f} s, cloning {done - loaded:.2f} s\n" + _backend_lines(),
            file=sys.stderr,
        )


def _vc(args: argparse.Namespace) -> None:
    # Every argument is checked before the model loads.
    _check_output(args.output, tuple(AUDIO_FORMATS))
    if not args.source.is_file():
        raise ValueError(f"{args.source}: no such file")
    _check_voice(args.voice)
    variant = args.variant or source_variant(args.model)
    if variant is not None:
        check_vc_decoder(variant, PRESETS[variant].cfm.meanflow)
    start = time.perf_counter()
    tts = TTS.load(args.model, variant=args.variant)
    loaded = time.perf_counter()
    # The voice goes as a path: the source is read (and refused if unusable) before a recording is cloned.
    wav = tts.convert_voice(
        args.source, args.voice, cfm_steps=args.cfm_steps, seed=args.seed, watermark=not args.no_watermark
    )
    done = time.perf_counter()
    bulk.write_audio(args.output, wav, tts.sample_rate)
    if args.verbose:
        seconds = len(wav) / tts.sample_rate
        print(
            f"load {loaded - start:.2f} s, conversion {done - loaded:.2f} s for {seconds:.2f} s of audio "
            f"(real-time factor {(done - loaded) / max(seconds, 1e-9):.2f})\n" + _backend_lines(),
            file=sys.stderr,
        )


BENCH_TEXT = (
    "The quick brown fox jumps over the lazy dog, and then it runs back home again before the sun goes down."
)


def _bench(args: argparse.Namespace) -> None:
    _check_voice(args.voice)
    tts = TTS.load(args.model, variant=args.variant, cfm_dtype=args.cfm_dtype)
    voice = _load_voice(tts, args.voice)
    rows = []
    for run in range(args.repeats + 1):  # run 0 warms up
        steps = []  # T3 decode steps, the stop token and dropped ids included: what the time was spent on
        start = time.perf_counter()
        tokens = tts.speech_tokens(
            BENCH_TEXT,
            voice,
            # BENCH_TEXT is English; a language pack speaks its own language only.
            language="en" if tts.speech.variant in MULTILINGUAL and tts.speech.language is None else None,
            seed=run,
            progress=lambda p: steps.append(p.done),
            max_new_tokens=args.max_new_tokens,
        )
        middle = time.perf_counter()
        wav = tts.vocode(tokens, voice, seed=run)
        end = time.perf_counter()
        if run:
            rows.append((steps[-1], len(tokens), middle - start, end - middle, len(wav) / tts.sample_rate))
    print(
        f"{'run':>3} {'steps':>6} {'tokens':>6} {'T3 s':>7} {'steps/s':>7} {'S3Gen s':>8} {'audio s':>8} {'RTF':>6}"
    )
    for i, (n, kept, t3, s3, audio) in enumerate(rows, 1):
        print(
            f"{i:>3} {n:>6} {kept:>6} {t3:>7.2f} {n / t3:>7.1f} {s3:>8.2f} {audio:>8.2f} {(t3 + s3) / audio:>6.3f}"
        )
    print(_backend_lines(), file=sys.stderr)


def _tokens(args: argparse.Namespace) -> None:
    if args.output is not None:
        _check_output(args.output)
    _check_voice(args.voice)
    text, knobs, language = _text(args), _knobs(args), _language(args)
    start = time.perf_counter()
    tts = TTS.load(args.model, variant=args.variant)
    loaded = time.perf_counter()
    voice = _load_voice(tts, args.voice)
    with _progress() as progress:
        tokens = tts.speech_tokens(text, voice, language=language, seed=args.seed, progress=progress, **knobs)
    done = time.perf_counter()
    line = " ".join(map(str, tokens.tolist())) + "\n"
    if args.output is None:
        sys.stdout.write(line)
    else:
        write_atomic(args.output, lambda tmp: tmp.write_text(line))
    if args.verbose:
        print(
            f"load {loaded - start:.2f} s, generation {done - loaded:.2f} s, {len(tokens)} tokens "
            f"({len(tokens) / 25:.1f} s of audio)\n" + _backend_lines(),
            file=sys.stderr,
        )


def _port(text: str) -> int:
    """An argparse type: a TCP port, 1-65535."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is out of range: a port is in 1-65535")
    return value


_port.__name__ = "port"


def _serve(args: argparse.Namespace) -> None:
    import importlib.util

    # Fail before the model loads when the server's packages are missing.
    missing = [m for m in ("fastapi", "uvicorn", "python_multipart") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"the server needs {', '.join(missing)}, which is not installed: pip install 'mlx-chatterbox[serve]'"
        )
    import mlx.core as mx

    from .server import gate, run
    from .server.app import create_app
    from .server.voices import VoiceStore, default_voices_dir
    from .server.worker import Worker

    _check_voice(args.voice)
    if args.memory_limit is not None and not args.memory_limit > 0:
        raise ValueError(f"--memory-limit {args.memory_limit}: give a positive number of GB")
    run.check_shutdown_timeout(args.shutdown_timeout, "--shutdown-timeout")
    keys, origins = gate.api_keys(args.api_key), gate.allowed_origins(args.allowed_origins)
    folder = args.voices if args.voices is not None else default_voices_dir()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--voices {folder}: not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--voices {folder}: the folder is not writable (uploaded voices are saved there)")
    tts = TTS.load(args.model, variant=args.variant, cfm_dtype=args.cfm_dtype)
    if args.memory_limit is not None:
        limit = int(args.memory_limit * 2**30)
        mx.set_memory_limit(limit)
        mx.set_cache_limit(limit)
    voices = VoiceStore(folder, _load_voice(tts, args.voice) or tts.builtin_voice)
    model_name = Path(args.model).name or str(args.model)
    with Worker(
        tts, max_batch=args.max_batch, max_queue=args.max_queue, vocode_batch=args.vocode_batch
    ) as worker:
        app = create_app(
            worker,
            voices,
            model_name=model_name,
            cfm_steps=args.cfm_steps,
            api_keys=keys,
            allowed_origins=origins,
            ui=not args.no_ui,
        )
        log_level = "info" if args.verbose else "warning"
        print(f"serving {model_name} on http://{args.host}:{args.port} (voices: {folder})", file=sys.stderr)
        run.serve(
            app, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout, log_level=log_level
        )


def _batch_arguments(sub) -> None:
    p = sub.add_parser(
        "batch",
        help="speak the items of a jobs file into a folder of audio files (audiobooks, data sets)",
        description='Speak each line of JOBS (JSON lines: {"text": ...} or {"file": ...}, with optional voice, '
        "knobs, language, seed, cfm_steps, output) into --out-dir, recording each item in DIR/manifest.jsonl as it "
        "finishes. Run it again to resume: items already done with the same inputs are skipped. A bad line is "
        "a failed item; the exit code is 1 if any item failed (README: Bulk synthesis).",
    )
    p.add_argument("jobs", type=Path, help="the jobs file: one JSON object per line")
    p.add_argument(
        "--out-dir", required=True, type=Path, metavar="DIR", help="folder for the audio and the manifest"
    )
    _model_arguments(p)  # here --voice is the voice of the lines that name none
    p.add_argument(
        "--no-watermark",
        action="store_true",
        help="leave out Perth's implicit watermark (upstream always adds it; on by default)",
    )
    _cfm_dtype_argument(p)
    p.add_argument(
        "--max-batch",
        type=_at_least_1,
        default=16,
        help="items whose speech tokens are drawn together, at most (default: 16; per actor with --ray)",
    )
    p.add_argument(
        "--vocode-batch",
        type=_at_least_1,
        default=8,
        help="items vocoded together when T3 finishes them in the same step, at most (default: 8)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="spread the items over a Ray cluster (needs mlx-chatterbox[ray]): ADDRESS such as auto or "
        "ray://head:10001; none starts a local Ray instance. DIR, the voices and the model folder must be "
        "reachable at the same paths from every node",
    )
    p.add_argument("--actors", type=_at_least_1, help="Ray actors, each with its own model (default: 1)")
    p.add_argument("--actor-gpus", type=float, metavar="G", help="GPUs per Ray actor, e.g. 0.5 (default: 0)")


class _ItemsLine:
    """A progress bar over a jobs file's items on one line of stderr (a terminal only), with an estimate of the
    time left; failed items are reported on lines of their own (on any stderr)."""

    WIDTH = 24

    def __init__(self, jobs: Path, stream):
        self.jobs, self.stream = jobs, stream
        self.tty = stream.isatty()
        self.drawn = False

    def __call__(self, result, p) -> None:
        erase = "\r\x1b[K" if self.drawn else ""
        if result.status == "failed":
            name = f" ({result.output})" if result.output else ""
            self.stream.write(f"{erase}{self.jobs}:{result.line}{name}: {result.error}\n")
            self.drawn = False
        if self.tty:
            finished = p.done + p.failed + p.skipped
            filled = round(self.WIDTH * finished / p.total)
            left = "" if p.eta is None else f", {_clock(p.eta)} left"
            failed = f", {p.failed} failed" if p.failed else ""
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            self.stream.write(f"\r[{bar}] {finished}/{p.total} items{failed}{left}\x1b[K")
            self.drawn = True
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.drawn = False


def _clock(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}:{m:02d}:{s:02d}" if hours else f"{m}:{s:02d}"


def _batch(args: argparse.Namespace) -> int:

    # Everything that can be checked before the jobs file is read and the model loads.
    if args.ray is None:
        given = [
            f for f, v in (("--actors", args.actors), ("--actor-gpus", args.actor_gpus)) if v is not None
        ]
        if given:
            raise ValueError(f"{given[0]} is for runs on Ray; add --ray [ADDRESS]")
    if args.actor_gpus is not None and not args.actor_gpus >= 0:
        raise ValueError(f"--actor-gpus {args.actor_gpus}: give a number of GPUs >= 0")
    _check_voice(args.voice)
    if args.out_dir.exists() and not args.out_dir.is_dir():
        raise ValueError(f"--out-dir {args.out_dir} is not a folder")
    # Local paths made absolute: the manifest's inputs stay the same from any folder, and Ray actors find them.
    model = Path(args.model).expanduser()
    settings = bulk.Settings(
        model=str(model.resolve()) if model.exists() else args.model,
        variant=args.variant,
        voice=None if args.voice is None else str(args.voice.resolve()),
        watermark=not args.no_watermark,
        cfm_dtype=args.cfm_dtype,
        max_batch=args.max_batch,
        vocode_batch=args.vocode_batch,
    )
    line = _ItemsLine(args.jobs, sys.stderr)
    try:
        try:
            p = bulk.run(
                args.jobs,
                args.out_dir,
                settings,
                ray_address=args.ray,
                actors=args.actors or 1,
                actor_gpus=args.actor_gpus or 0.0,
                report=line,
            )
        finally:
            line.close()
    except bulk.RayError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    print(
        f"{p.done} done, {p.failed} failed, {p.skipped} skipped (done before) of {p.total} items in "
        f"{_clock(p.elapsed)}; manifest: {args.out_dir / bulk.MANIFEST}",
        file=sys.stderr,
    )
    return 1 if p.failed else 0


def _backend_lines() -> str:
    return "\n".join(f"{k}: {v}" for k, v in _backend.STATUS.items())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "say" and args.output is None and not (args.stream or args.play):
        parser.exit(
            2,
            f"{PROG} say: error: the following arguments are required: -o/--output (or --stream, --play) "
            f"(see {PROG} say --help)\n",
        )
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format=_log_format(sys.stderr)
    )
    try:
        commands = {"convert": _convert, "say": _say, "voice": _voice, "bench": _bench, "tokens": _tokens}
        commands["serve"] = _serve
        commands["vc"] = _vc
        commands["batch"] = _batch
        code = commands[args.command](args)  # batch's exit code says whether any item failed
    except (ValueError, OSError, ImportError) as e:  # our errors say what is wrong and how to fix it
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return code or 0
