"""Streams' batched decodes in one process, way by way (issue 25): HiFT's convolutions by MLX (cuDNN) or by our
kernel (``layers.KERNEL_CONVS``, the default). Run AR's served Turbo at 16 streams took 1.8 s a vocoding call
with the kernel against 0.45 s without, while one stream, a 10 s decode and 4 rows in one call were faster
with it; this replay found the kernel faster at 16 streams too (run AT), and the served loss a cold first
server's. This replays what that process does, alone: ``--streams`` StreamVocoders (full-size English S3Gen,
random weights, the estimator in ``--cfm-dtype``, ``--cfm-steps`` Euler steps: 2 stands in for Turbo's
meanflow) take ``--pace`` tokens a round each, up to 250 ± 100, and the due decodes of a round run together
(``decode_together_steps``, rows padded to the server's bucket), each part timed apart (S3Gen's parts, then
HiFT's with the samples settled). The ways alternate, ``--rounds`` times each, in one process. Prints a table;
``--out`` appends a JSON line per way and round.

    python benchmarks/probe_stream_decode.py --streams 16 --out stream_decode.jsonl
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx_chatterbox  # noqa: F401  isort: skip

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np
from bench_stream import build

from mlx_chatterbox.generation.stream import StreamVocoder, decode_together_steps
from mlx_chatterbox.models import layers
from mlx_chatterbox.server.worker import VOCODE_BUCKET


def replay(s3gen, voice, args: argparse.Namespace, seed: int) -> dict:
    """One replay: per call its rows, S3Gen's ms and HiFT's ms (each part evaluated before the next)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(150, 351, args.streams)
    vocoders = [
        StreamVocoder(
            s3gen, voice, cfm_steps=args.cfm_steps, key=mx.random.key(seed + i), first_chunk=args.first_chunk
        )
        for i in range(args.streams)
    ]
    given = [0] * args.streams
    calls = []
    start = time.perf_counter()
    while any(not v._finished or v.due for v in vocoders):
        for i, v in enumerate(vocoders):
            if v._finished or v.due:
                continue
            n = min(args.pace, lengths[i] - given[i])
            tokens = rng.integers(0, 6561, n).tolist()
            given[i] += n
            v.end(tokens) if given[i] == lengths[i] else v.take(tokens)
        due = [v for v in vocoders if v.due]
        if not due:
            continue
        parts, steps = [], decode_together_steps(due, bucket=args.bucket)
        while True:
            began = time.perf_counter()
            try:
                next(steps)
            except StopIteration:
                parts.append(time.perf_counter() - began)
                break
            mx.synchronize()
            parts.append(time.perf_counter() - began)
        # The last part reads HiFT's samples back (its work was queued by the part before, after S3Gen's last);
        # a lone due decode runs in one part (StreamVocoder's own), counted whole only.
        calls.append(
            (len(due), 1e3 * sum(parts), 1e3 * sum(parts[:-2]), 1e3 * sum(parts[-2:]), len(parts) > 2)
        )
    wall = time.perf_counter() - start
    split = [c for c in calls if c[4]]
    return dict(
        calls=len(calls),
        rows_per_call=statistics.mean(c[0] for c in calls),
        total_s=sum(c[1] for c in calls) / 1e3,
        split_calls=len(split),
        s3gen_ms=statistics.median(c[2] for c in split),
        hift_ms=statistics.median(c[3] for c in split),
        hift_ms_max=max(c[3] for c in split),
        hift_total_s=sum(c[3] for c in split) / 1e3,
        wall_s=wall,
        audio_s=float(lengths.sum()) / 25,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ways", default="cudnn,kernel")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--pace", type=int, default=10, help="tokens a stream takes a round")
    p.add_argument("--first-chunk", type=int, default=15)
    p.add_argument(
        "--bucket", type=int, default=VOCODE_BUCKET, help="rows padded to a multiple (tokens), as served"
    )
    p.add_argument("--cfm-dtype", default="bfloat16")
    p.add_argument("--cfm-steps", type=int, help="Euler steps (default: English's 10)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="the tests' tiny networks (a smoke run on a CPU)")
    p.add_argument("--out", help="append JSON lines here")
    args = p.parse_args()
    tts = build(tiny=args.tiny)
    s3gen, voice = tts.s3gen, tts.builtin_voice
    s3gen.estimator.set_dtype(getattr(mx, args.cfm_dtype))
    ways = args.ways.split(",")
    if set(ways) - {"cudnn", "kernel"}:
        p.error(f"--ways takes cudnn and kernel, not {args.ways!r}")
    print(
        "| way | round | calls (of several rows) | rows a call | decodes s | S3Gen ms a call | HiFT ms a call (max) "
        "| HiFT s | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        for way in ways:
            layers.KERNEL_CONVS = way == "kernel"
            row = replay(s3gen, voice, args, seed=r)
            print(
                f"| {way} | {r} | {row['calls']} ({row['split_calls']}) | {row['rows_per_call']:.1f} | "
                f"{row['total_s']:.2f} | {row['s3gen_ms']:.1f} | "
                f"{row['hift_ms']:.1f} ({row['hift_ms_max']:.0f}) | {row['hift_total_s']:.2f} | "
                f"{row['wall_s']:.2f} |",
                flush=True,
            )
            if args.out:
                line = dict(probe="stream_decode", **vars(args), way=way, round=r, **row)
                with open(args.out, "a") as f:
                    f.write(json.dumps(line, default=str) + "\n")


if __name__ == "__main__":
    main()
