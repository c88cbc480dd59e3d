"""What the commands share: the parser's error format and argument types, the arguments several commands take,
and the checks every command makes before its model loads."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path

import numpy as np

from .. import _backend
from ..api import (
    CFM_DTYPES,
    LANGUAGES,
    TTS,
    VOICE_SUFFIX,
    STREAM_CONTEXT,
    MultilingualParams,
    Voice,
    check_language,
    read_reference,
    split_pauses,
)
from ..convert import DEFAULT_REPO, source_config, source_variant
from ..sampling import SamplingParams, TurboParams, check_max_new_tokens, check_seed
from ..variants import CHECKPOINTS, MULTILINGUAL, PACK_LANGUAGES
from .progress import Stages

PROG = "mlx-chatterbox"
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


# The library's messages name its arguments (pass overwrite=True); a CLI user reads the flags instead.
FLAGS = {
    # A knob's value out of range (top_p=1.5 is out of range: ...).
    rf"^({'|'.join(KNOBS)}|seed)=": lambda m: f"--{m[1].replace('_', '-')} ",
    r"overwrite=True": "--overwrite",
    r"variant= ": "--variant ",
    r"variant='multilingual' or 'multilingual-v3'": "--variant multilingual or multilingual-v3",
    r"\(language=\)": "(--language)",
    r"^language='([^']*)'": r"--language \1",
    r"s3gen='torch'": "--s3gen torch",
}


def flags(message: str) -> str:
    """A library error message as a CLI user should read it: ``FLAGS``' flags for the arguments."""
    for pattern, flag in FLAGS.items():
        message = re.sub(pattern, flag, message)
    return message


class Parser(argparse.ArgumentParser):
    """Usage errors as one line that names the problem and where help is, not the whole usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class UsageError(Exception):
    """A usage error found after parsing (exit code 2, as argparse's own)."""


def at_least_1(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range: it must be an integer >= 1")
    return value


at_least_1.__name__ = "integer"  # argparse says "invalid <__name__> value: 'x'" when int() fails


def stream_context(text: str) -> int | str:
    """An argparse type: a streaming decode window, an integer >= 0 or "whole"."""
    if text == "whole":
        return text
    try:
        value = int(text)
    except ValueError:
        message = f"{text!r} is not a number of speech tokens >= 0 nor 'whole'"
        raise argparse.ArgumentTypeError(message) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is out of range: it must be an integer >= 0 (or 'whole')")
    return value


stream_context.__name__ = "window"


def stream_context_argument(p: argparse.ArgumentParser, which: str) -> None:
    """``--stream-context N|whole``: the decode window of ``which`` streams (``TTS.stream``'s context)."""
    p.add_argument(
        "--stream-context",
        type=stream_context,
        metavar="N|whole",
        help=f"{which}: each S3Gen decode re-reads the N speech tokens before its new ones (default: "
        f"{STREAM_CONTEXT}, 2 s; a chunk's cost stays bounded), or 'whole': every token so far (closer to "
        "the unstreamed audio, each chunk dearer as the text goes on)",
    )


def seed(text: str) -> int:
    """An argparse type: a seed MLX takes."""
    value = int(text)
    try:
        check_seed(value)
    except ValueError as e:  # argparse names the flag: "argument --seed: -1 is out of range: ..."
        raise argparse.ArgumentTypeError(str(e).replace(f"seed={value!r} ", f"{value} ")) from None
    return value


seed.__name__ = "integer"


# Arguments several commands take.


def model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_REPO,
        help="a converted folder, an upstream checkpoint folder or a Hugging Face repo id (converted once and "
        f"cached); default: {DEFAULT_REPO}",
    )
    variant_argument(p)
    p.add_argument(
        "--voice",
        type=Path,
        help="a voice file (.safetensors, from 'mlx-chatterbox voice') or a recording to clone; "
        "default: the built-in voice",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens and print timings")


def variant_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--variant",
        choices=tuple(CHECKPOINTS),
        help="which model of a source that holds several (ResembleAI/chatterbox: english, multilingual, "
        "multilingual-v3); default: the one the files hold, english for ResembleAI/chatterbox",
    )


def language_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--language",
        help="the text's language, for the multilingual models (required there): one of "
        + ", ".join(LANGUAGES),
    )


def cfm_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cfm-dtype",
        choices=tuple(CFM_DTYPES),
        default="float32",
        help="precision of the flow-matching estimator: float32 (upstream's numbers) or bfloat16 (faster on "
        "GPUs, mel within 2%% of float32)",
    )


def no_watermark_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-watermark",
        action="store_true",
        help="leave out Perth's implicit watermark (upstream always adds it; on by default)",
    )


def knob_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--seed", type=seed, help="seed for reproducible output, in [0, 2**63) (default: random)")


# Checks made before the model loads: generation can take minutes on a CPU.


def language(args: argparse.Namespace) -> str | None:
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


def knobs(args: argparse.Namespace) -> dict:
    """The knobs given, checked now, before the model loads: against the model's own knobs when its variant
    can be told from --model (``source_variant``), else each value by every model kind that has the knob; and
    --max-new-tokens against the model's limit when its sizes can be told (``source_config``: a converted
    folder's, else the variant's upstream sizes). The model checks the rest once loaded."""
    given = {n: getattr(args, n) for n in KNOBS if getattr(args, n) is not None}
    variant = args.variant or source_variant(args.model)
    if variant is not None:
        kind = VARIANT_KNOBS[variant]
        unknown = [n for n in given if not hasattr(KNOB_DEFAULTS[kind], n)]
        if unknown:
            raise ValueError(
                f"--{unknown[0].replace('_', '-')} is not a knob of the {variant} model {args.model}"
            )
        dataclasses.replace(KNOB_DEFAULTS[kind], **given)
    else:
        for name, value in given.items():
            errors = []
            for params in KNOB_DEFAULTS.values():
                if hasattr(params, name):
                    try:
                        dataclasses.replace(params, **{name: value})
                    except ValueError as e:
                        errors.append(e)
            if len(errors) == sum(hasattr(p, name) for p in KNOB_DEFAULTS.values()):
                raise errors[0]
    config = source_config(args.model, args.variant)
    if config is not None and "max_new_tokens" in given:
        check_max_new_tokens(given["max_new_tokens"], config.t3.most_new_tokens)
    return given


def text(args: argparse.Namespace) -> str:
    """TEXT (or standard input for '-'), or the --file's text; never empty."""
    if getattr(args, "file", None) is not None:
        try:
            words = args.file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{args.file} is not UTF-8 text") from None
        except FileNotFoundError:
            raise ValueError(f"--file {args.file}: no such file") from None
    else:
        words = sys.stdin.read() if args.text == "-" else args.text
    if not words.strip():
        raise ValueError("the text is empty; give some words to speak")
    split_pauses(words, TTS.sample_rate)  # a malformed or too long pause tag fails before the model loads
    return words


def check_output(path: Path, suffixes: tuple[str, ...] | None = None) -> None:
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


def read_voice(path: Path | None) -> Voice | tuple[np.ndarray, int] | None:
    """--voice read and checked before the model loads: a voice file as its Voice, a recording as its samples and
    their rate (``read_reference``; cloned once the model is loaded, by ``voice``), None for the built-in voice."""
    if path is None:
        return None
    if not path.is_file():
        raise ValueError(f"--voice {path}: no such file")
    return Voice.load(path) if path.suffix.lower() == VOICE_SUFFIX else read_reference(path)


def load(line: Stages, args: argparse.Namespace, **options) -> TTS:
    """--model (and --variant), loaded as a stage of the command's progress."""
    line.stage(f"loading the model {args.model}")
    return TTS.load(args.model, variant=args.variant, **options)


def voice(tts: TTS, read: Voice | tuple[np.ndarray, int] | None, line: Stages | None = None) -> Voice | None:
    """What ``read_voice`` read as a Voice: a recording cloned now, once (not per call)."""
    if not isinstance(read, tuple):
        return read
    if line is not None:
        line.stage("cloning the voice")
    return tts.voice(*read)


def english(tts: TTS) -> str | None:
    """``language=`` for an English text (bench's, the server's warm-up): "en" for the multilingual models,
    None for the English-only ones and the language packs, which speak their own language only."""
    return "en" if tts.speech.variant in MULTILINGUAL and tts.speech.language is None else None


def backend_lines() -> str:
    return "\n".join(f"{k}: {v}" for k, v in _backend.STATUS.items())
