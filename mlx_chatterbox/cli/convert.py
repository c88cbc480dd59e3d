"""``mlx-chatterbox convert``: an upstream checkpoint -> an MLX model folder."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..convert import DEFAULT_REPO, DTYPES, convert
from ..quantize import BITS, GROUP_SIZES
from ..variants import CHECKPOINTS


def add_parser(sub) -> None:
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


def run(args: argparse.Namespace) -> None:
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
