"""``mlx-chatterbox say``: a text (or speech tokens) -> an audio file, standard output or the speakers."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import numpy as np

from .. import bulk
from ..bulk import AUDIO_FORMATS
from . import common
from .common import KNOBS, UsageError
from .progress import stages

APLAY = "aplay -f S16_LE -r 24000 -c 1"  # a player for --stream's output


def add_parser(sub) -> None:
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
    common.model_arguments(p)
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
    common.stream_context_argument(p, "--stream and --play")
    common.no_watermark_argument(p)
    p.add_argument(
        "--s3gen",
        choices=("mlx", "torch"),
        default="mlx",
        help="vocoder: ours (mlx) or, in hybrid mode, upstream's PyTorch S3Gen (needs mlx-chatterbox[hybrid])",
    )
    p.add_argument(
        "--cfm-steps",
        type=common.at_least_1,
        help="Euler steps of the flow-matching decoder; fewer is faster and rougher (default: the model's, 10; Turbo/Nano 2)",
    )
    common.cfm_dtype_argument(p)
    common.language_argument(p)
    common.knob_arguments(p)


def run(args: argparse.Namespace) -> None:
    if args.output is None and not (args.stream or args.play):
        raise UsageError("the following arguments are required: -o/--output (or --stream, --play)")
    # Every argument is checked before the model loads: generation can take minutes on a CPU.
    if [args.text, args.file, args.tokens].count(None) != 2:
        raise ValueError("give one of: a TEXT to speak, --file FILE, --tokens FILE")
    live = args.stream or args.play
    if args.stream_context is not None and not live:
        raise ValueError(
            "--stream-context sets how --stream and --play decode; add one of them, or leave it out"
        )
    sd = _check_live(args) if live else None
    if not live:
        if str(args.output) == "-":
            raise ValueError("-o - writes raw PCM to standard output: add --stream")
        common.check_output(args.output, tuple(AUDIO_FORMATS))
    given_voice = common.read_voice(args.voice)
    if args.tokens is not None:
        given = [n for n in (*KNOBS, "language") if getattr(args, n) is not None]
        if given:
            raise ValueError(
                f"--{given[0].replace('_', '-')} shapes speech tokens; it has no effect with --tokens"
            )
        tokens = _read_tokens(args.tokens)
    else:
        text, knobs, language = common.text(args), common.knobs(args), common.language(args)
    vocoding = {"cfm_steps": args.cfm_steps, "seed": args.seed, "watermark": not args.no_watermark}
    with stages() as line:
        start = time.perf_counter()
        tts = common.load(line, args, s3gen=args.s3gen, cfm_dtype=args.cfm_dtype)
        loaded = time.perf_counter()
        voice = common.voice(tts, given_voice, line)
        if args.tokens is not None:
            line.stage(f"vocoding {len(tokens)} speech tokens")
            wav = tts.vocode(tokens, voice, **vocoding)
        elif live:
            line.stage("speaking")
            context = {} if args.stream_context is None else {"context": args.stream_context}
            chunks = tts.stream(text, voice, language=language, **context, **vocoding, **knobs)
            if args.stream:
                seconds = _write_pcm(chunks, sys.stdout.buffer, tts.sample_rate)
            else:
                seconds = _play(sd, chunks, tts.sample_rate)
        else:
            wav = tts.generate(text, voice, language=language, progress=line, **vocoding, **knobs)
        if not live:
            seconds = len(wav) / tts.sample_rate
    done = time.perf_counter()
    if not live:
        bulk.write_audio(args.output, wav, tts.sample_rate)
    if args.verbose:
        print(
            f"load {loaded - start:.2f} s, speech {done - loaded:.2f} s for {seconds:.2f} s of audio "
            f"(real-time factor {(done - loaded) / max(seconds, 1e-9):.2f})\n" + common.backend_lines(),
            file=sys.stderr,
        )


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
