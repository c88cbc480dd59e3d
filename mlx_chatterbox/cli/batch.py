"""``mlx-chatterbox batch``: a jobs file (JSON lines) -> a folder of audio files (``bulk``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import bulk
from . import common
from .common import PROG
from .progress import ItemsLine, clock


def add_parser(sub) -> None:
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
    common.model_arguments(p)  # here --voice is the voice of the lines that name none
    common.no_watermark_argument(p)
    common.cfm_dtype_argument(p)
    p.add_argument(
        "--max-batch",
        type=common.at_least_1,
        default=16,
        help="items whose speech tokens are drawn together, at most (default: 16; per actor with --ray)",
    )
    p.add_argument(
        "--vocode-batch",
        type=common.at_least_1,
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
    p.add_argument(
        "--actors", type=common.at_least_1, help="Ray actors, each with its own model (default: 1)"
    )
    p.add_argument("--actor-gpus", type=float, metavar="G", help="GPUs per Ray actor, e.g. 0.5 (default: 0)")


def run(args: argparse.Namespace) -> int:
    # Everything that can be checked before the jobs file is read and the model loads.
    if args.ray is None:
        given = [
            f for f, v in (("--actors", args.actors), ("--actor-gpus", args.actor_gpus)) if v is not None
        ]
        if given:
            raise ValueError(f"{given[0]} is for runs on Ray; add --ray [ADDRESS]")
    if args.actor_gpus is not None and not args.actor_gpus >= 0:
        raise ValueError(f"--actor-gpus {args.actor_gpus}: give a number of GPUs >= 0")
    common.read_voice(args.voice)  # refused now, not by every line that names no voice
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
    line = ItemsLine(args.jobs, sys.stderr)
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
        f"{clock(p.elapsed)}; manifest: {args.out_dir / bulk.MANIFEST}",
        file=sys.stderr,
    )
    return 1 if p.failed else 0
