"""HiFT's convolutions on a GPU, way by way (issue 25): MLX's (cuDNN, a graph planned per new shape) and our
kernel (``layers.KERNEL_CONVS``, the default). (Run AQ's "taps", our products off the CPU, went with
``layers.PRODUCT_CONVS_OFF_CPU``, and its "rungs", MLX's at lengths rounded up so that they recur, with
``hift.LENGTH_RUNGS``.) Full-size HiFT, random weights, ``decode`` of a source made once. Per way: one row of
500 frames (10 s) warm, the first call at each of 6 lengths that way has not met (what a served request of a
new length pays), 4 rows of different lengths in one call (a vocoding batch), and the primitives of a 10 s
call. Prints a short table; ``--out`` appends a JSON line per way. (``--frames`` and ``--base-channels``
shrink it for the tests' smoke run on a CPU.)

    python benchmarks/probe_hift.py --ways cudnn,kernel --out hift.jsonl
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
from probe_step import primitives

from mlx_chatterbox.models import layers
from mlx_chatterbox.models.hift import HiFT, HiFTConfig

WAYS = ("cudnn", "kernel")  # layers.KERNEL_CONVS off and on


def timed(model: HiFT, mel: mx.array, source: mx.array, lengths: mx.array | None = None) -> float:
    """Milliseconds of one decode, evaluated."""
    mx.synchronize()
    start = time.perf_counter()
    mx.eval(model.decode(mel, source, lengths))
    mx.synchronize()
    return 1e3 * (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--frames", type=int, default=500, help="mel frames of the warm call (500: 10 s)")
    p.add_argument("--base-channels", type=int, default=HiFTConfig().base_channels)
    p.add_argument("--out", help="append JSON lines here")
    args = p.parse_args()
    if set(args.ways.split(",")) - set(WAYS):
        p.error(f"--ways takes {' and '.join(WAYS)}, not {args.ways!r}")
    model = HiFT(HiFTConfig(base_channels=args.base_channels))
    mx.eval(model.parameters())
    spf = model.config.samples_per_frame

    def inputs(rows: int, frames: int, seed: int) -> tuple[mx.array, mx.array]:
        key = mx.random.key(seed)
        mel = mx.random.normal((rows, frames, 80), key=key)
        return mel, mx.tanh(mx.random.normal((rows, frames * spf, 1), key=mx.random.split(key)[0]))

    n = args.frames
    print(f"{'way':8} {f'{n} frames ms':>13} {'new length ms':>14} {'4 rows ms':>10} {'primitives':>11}")
    for i, way in enumerate(args.ways.split(",")):
        layers.KERNEL_CONVS = way == "kernel"
        mel, source = inputs(1, n, 0)
        timed(model, mel, source)  # compiles and plans what this length needs
        warm = statistics.median(timed(model, mel, source) for _ in range(args.repeats))
        # Lengths no earlier way met; at 500 frames 157-476 and up.
        new = [timed(model, *inputs(1, (157 + 61 * j + 7 * i) * n // 500, j)) for j in range(6)]
        lengths = [n * f // 500 for f in (480, 411, 303, 250)]
        mel4, source4 = inputs(4, max(lengths), 1)
        rows = mx.array(lengths, dtype=mx.int32)
        timed(model, mel4, source4, rows)
        four = statistics.median(timed(model, mel4, source4, rows) for _ in range(args.repeats))
        count = sum(primitives(model.decode(mel, source)).values())
        line = dict(way=way, frames=n, warm_ms=warm, new_length_ms=new, four_rows_ms=four, primitives=count,
                    peak_mib=mx.get_peak_memory() / 2**20)  # fmt: skip
        print(f"{way:8} {warm:13.1f} {statistics.mean(new):14.1f} {four:10.1f} {count:11d}")
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
