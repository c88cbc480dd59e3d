"""1-d convolutions at HiFT's and the CFM's shapes: MLX's own kernels against ours as one matrix product
(``models/layers.py``), on the default MLX device. Prints ms per call (median of 20) and the max abs difference.

    python benchmarks/bench_conv.py [--device cpu|gpu]
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx_chatterbox  # noqa: F401  isort: skip

import argparse
import statistics
import time

import mlx.core as mx

from mlx_chatterbox.models.layers import conv1d, conv_transpose1d

# (name, frames, channels in, channels out, kernel, dilation): 10 s of audio = 500 mel frames.
CONVS = [
    ("hift stage 0 resblock k11 d5", 4000, 256, 256, 11, 5),
    ("hift stage 2 resblock k7 d3", 60001, 64, 64, 7, 3),
    ("cfm causal k3 (batch 2)", 1000, 256, 256, 3, 1),
]
TRANSPOSED = [("hift ups 0", 500, 512, 256, 16, 8, 4), ("hift ups 2", 4000, 128, 64, 7, 3, 2)]


def timed(f) -> float:
    mx.eval(f())
    runs = []
    for _ in range(20):
        t = time.perf_counter()
        mx.eval(f())
        runs.append(1e3 * (time.perf_counter() - t))
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "gpu"))
    args = p.parse_args()
    if args.device:
        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    print(f"device {mx.default_device()}")
    for name, t, c_in, c_out, k, d in CONVS:
        b = 2 if "batch 2" in name else 1
        x, w = mx.random.normal((b, t, c_in)), 0.05 * mx.random.normal((c_out, k, c_in))
        pad = d * (k - 1) // 2
        ours = timed(lambda: conv1d(x, w, pad, d))
        native = timed(lambda: mx.conv1d(x, w, padding=pad, dilation=d))
        diff = mx.abs(conv1d(x, w, pad, d) - mx.conv1d(x, w, padding=pad, dilation=d)).max().item()
        print(f"{name:32} matmul {ours:8.3f} ms  mx.conv1d {native:8.3f} ms  max diff {diff:.1e}")
    for name, t, c_in, c_out, k, s, pad in TRANSPOSED:
        x, w = mx.random.normal((1, t, c_in)), 0.05 * mx.random.normal((c_out, k, c_in))
        ours = timed(lambda: conv_transpose1d(x, w, s, pad))
        native = timed(lambda: mx.conv_transpose1d(x, w, stride=s, padding=pad))
        diff = (
            mx.abs(conv_transpose1d(x, w, s, pad) - mx.conv_transpose1d(x, w, stride=s, padding=pad))
            .max()
            .item()
        )
        print(f"{name:32} matmul {ours:8.3f} ms  mx.conv_transpose1d {native:8.3f} ms  max diff {diff:.1e}")


if __name__ == "__main__":
    main()
