"""``mlx-chatterbox vc``: a recording -> the same speech in another voice (voice conversion)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .. import bulk
from ..api import check_vc_decoder, read_source
from ..bulk import AUDIO_FORMATS
from ..convert import source_variant
from ..variants import PRESETS
from . import common
from .progress import stages


def add_parser(sub) -> None:
    p = sub.add_parser(
        "vc",
        help="re-speak a recording in another voice (voice conversion)",
        description="Voice conversion, as upstream ChatterboxVC: the speech of SOURCE (an audio file) turned "
        "into speech tokens and spoken again by S3Gen in the voice --voice (default: the built-in voice), "
        "written as 24 kHz mono audio to OUTPUT (.wav, .flac or .ogg, from the extension). English and "
        "multilingual models (Turbo and Nano have no voice conversion upstream).",
    )
    p.add_argument("source", type=Path, help="audio file of the speech to convert (wav, flac, ogg, mp3, ...)")
    common.model_arguments(p)
    p.add_argument(
        "-o", "--output", required=True, type=Path, help="audio file to write (.wav, .flac or .ogg)"
    )
    p.add_argument(
        "--cfm-steps",
        type=common.at_least_1,
        help="Euler steps of the flow-matching decoder; fewer is faster and rougher (default: the model's, 10)",
    )
    p.add_argument(
        "--seed", type=common.seed, help="seed for reproducible output, in [0, 2**63) (default: random)"
    )
    common.no_watermark_argument(p)


def run(args: argparse.Namespace) -> None:
    # Every argument is checked before the model loads.
    common.check_output(args.output, tuple(AUDIO_FORMATS))
    variant = args.variant or source_variant(args.model)
    if variant is not None:
        check_vc_decoder(variant, PRESETS[variant].cfm.meanflow)
    source, rate = read_source(args.source)
    given_voice = common.read_voice(args.voice)
    with stages(vocode_share=1.0) as line:  # the source's speech tokens take little time
        start = time.perf_counter()
        tts = common.load(line, args)
        loaded = time.perf_counter()
        voice = common.voice(tts, given_voice, line)
        line.stage("speech tokens of the source")
        wav = tts.convert_voice(
            source,
            voice,
            sample_rate=rate,
            cfm_steps=args.cfm_steps,
            seed=args.seed,
            watermark=not args.no_watermark,
            progress=line,
        )
    done = time.perf_counter()
    bulk.write_audio(args.output, wav, tts.sample_rate)
    if args.verbose:
        seconds = len(wav) / tts.sample_rate
        print(
            f"load {loaded - start:.2f} s, conversion {done - loaded:.2f} s for {seconds:.2f} s of audio "
            f"(real-time factor {(done - loaded) / max(seconds, 1e-9):.2f})\n" + common.backend_lines(),
            file=sys.stderr,
        )
