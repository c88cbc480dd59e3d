"""Where the layer kernel's GPU time goes (issue 25, ADR 15): one Turbo- or English-sized layer kernel with
timestamps (the GPU's global timer) taken when its first item is claimed, when each phase's last item is
reported and when the last block leaves; medians of repeated single calls. A one-off probe for the H200 (CUDA
only).

    python benchmarks/probe_layer.py --models turbo,english --dtypes float32,bfloat16 --position 600
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx_chatterbox  # noqa: F401  isort: skip

import argparse
import json
import re
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

from mlx_chatterbox.models import layers

# Reads the GPU's global timer (ns, the same clock on every SM) into t.
TIMER = 'unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); '
PHASES = ("q/k/v", "attention", "merge", "output", "up", "down")
CUDA_KERNEL = mx.fast.cuda_kernel


def stamped(source: str) -> str:
    """The kernel's source with the timer read into stamps[0] when the first item of the first phase is claimed,
    stamps[1 + p] by the block whose report completes phase p, and stamps[6] by the last block out."""
    first = "if (threadIdx.x == 0) claimed = atomicAdd(counters + 0, 1);"
    assert first in source
    source = source.replace(
        first,
        "if (threadIdx.x == 0) { claimed = atomicAdd(counters + 0, 1); if (claimed == 0) { "
        + TIMER
        + "stamps[0] = t; } }",
        1,
    )
    source, n = re.subn(
        r"atomicAdd\(counters \+ (\d+), done\);",
        # phase p's "done" counter sits at line _PHASES + p (``layers._SYNC_LINE``)
        lambda m: f"if (done > 0 && atomicAdd(counters + {m.group(1)}, done) + done == ITEMS) {{ "
        + TIMER
        + f"stamps[{int(m.group(1)) // layers._SYNC_LINE - layers._PHASES + 1}] = t; }}",
        source,
    )
    assert n == len(PHASES) - 1
    return source.replace(
        "== gridDim.x - 1) {", "== gridDim.x - 1) { " + TIMER + f"stamps[{len(PHASES)}] = t;"
    )


class Stamped:
    """Stands in for the layer kernel: the same inputs, plus a stamps output it keeps."""

    def __init__(self, name, names, outputs, source, header=""):
        self.kernel = CUDA_KERNEL(name + "_stamped", names, outputs + ["stamps"], stamped(source), header)
        self.stamps = None

    def __call__(self, **kw):
        kw["output_shapes"] = list(kw["output_shapes"]) + [(8,)]
        kw["output_dtypes"] = list(kw["output_dtypes"]) + [mx.uint64]
        out = self.kernel(**kw)
        self.stamps = out[-1]
        return out[:-1]


def parts(model: str, dtype: mx.Dtype) -> tuple[layers.LayerParts, int]:
    d, h, f = 1024, 16, 4096
    if model == "turbo":
        p = layers.LayerParts(
            layers.Linear(d, 3 * d), nn.LayerNorm(d), layers.Linear(d, d), nn.LayerNorm(d),
            layers.Linear(d, f), layers.Linear(f, d), "gelu", h,
        )  # fmt: skip
        rows = 1
    else:
        p = layers.LayerParts(
            layers.Linear(d, 3 * d, bias=False), nn.RMSNorm(d), layers.Linear(d, d, bias=False), nn.RMSNorm(d),
            layers.Linear(d, 2 * f, bias=False), layers.Linear(f, d, bias=False), "swiglu", h,
            mx.array(10000 ** (mx.arange(32) / 32).astype(mx.float32)),
        )  # fmt: skip
        rows = 2
    for m in p[:6]:
        m.set_dtype(dtype)
        mx.eval(m.parameters())
    return p, rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="turbo,english")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--position", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument(
        "--blocks",
        default="sm",
        help="comma-separated LAYER_BLOCKS values; sm: the GPU's SM count (the default)",
    )
    parser.add_argument("--gemv-loads", type=int, default=layers.GEMV_LOADS, help="layers.GEMV_LOADS")
    parser.add_argument(
        "--decode-unroll", type=int, default=layers.DECODE_UNROLL, help="layers.DECODE_UNROLL"
    )
    parser.add_argument(
        "--scalars",
        default="both",
        help="comma-separated, each a configuration of its own: host (the 4-byte arrays the host makes), "
        "eps (the norms' epsilon in the source), position (the position copied into device memory), both "
        "(the default: what layers.DEVICE_SCALARS does)",
    )
    parser.add_argument("--out", help="append JSON lines here")
    args = parser.parse_args()
    layers.GEMV_LOADS, layers.DECODE_UNROLL = args.gemv_loads, args.decode_unroll
    scalars = args.scalars.split(",")
    if set(scalars) - {"host", "eps", "position", "both"}:
        parser.error(f"--scalars takes host, eps, position and both, got {args.scalars}")
    sms = layers._sm_count()  # read now: the kernel factory is swapped while the layer kernel is made
    print(
        "\n| model | dtype | blocks | scalars | "
        + " | ".join(f"{p} us" for p in PHASES)
        + " | all us | wall us |"
    )
    print("|---|---|---|---|" + "---|" * (len(PHASES) + 2))
    for model in args.models.split(","):
        for dn in args.dtypes.split(","):
            dtype = getattr(mx, dn)
            p, rows = parts(model, dtype)
            keys = mx.zeros((rows, 16, 768, 64), dtype)
            values = mx.zeros((rows, 16, 768, 64), dtype)
            x = mx.random.normal((rows, 1, 1024)).astype(dtype)
            mx.eval(keys, values, x)
            for blocks, where in (
                (None if b == "sm" else int(b), w) for b in args.blocks.split(",") for w in scalars
            ):
                layers.LAYER_BLOCKS = blocks
                layers.DEVICE_SCALARS = where in ("eps", "both")
                layers._layer_kernels.clear()
                made = []

                def make(*a, **kw):
                    made.append(Stamped(*a, **kw))
                    return made[-1]

                mx.fast.cuda_kernel = make
                try:
                    rows_us, walls = [], []
                    for i in range(args.repeats + 3):
                        sync = mx.zeros((layers._SYNC_INTS,), mx.int32)
                        position = mx.array(args.position, mx.int32)  # in managed memory, as a loop's
                        if where in ("position", "both"):
                            position = layers._in_device_memory(position)
                        state = layers.BufferState(keys, values, position, sync=sync)
                        t0 = time.perf_counter()
                        out, state = layers._fused_layer(x, state, p)
                        mx.eval(out, made[0].stamps)
                        walls.append((time.perf_counter() - t0) * 1e6)
                        s = [int(v) for v in made[0].stamps.tolist()]
                        n = len(PHASES)
                        rows_us.append([(s[k + 1] - s[k]) / 1e3 for k in range(n)] + [(s[n] - s[0]) / 1e3])
                finally:
                    mx.fast.cuda_kernel = CUDA_KERNEL
                med = [statistics.median(r[k] for r in rows_us[3:]) for k in range(len(PHASES) + 1)]
                wall = statistics.median(walls[3:])
                print(
                    f"| {model} | {dn} | {blocks or sms} | {where} | "
                    + " | ".join(f"{v:.1f}" for v in med)
                    + f" | {wall:.0f} |"
                )
                if args.out:
                    with open(args.out, "a") as f:
                        row = dict(
                            model=model,
                            dtype=dn,
                            blocks=blocks or sms,
                            position=args.position,
                            gemv_loads=layers.GEMV_LOADS,
                            decode_unroll=layers.DECODE_UNROLL,
                            scalars=where,
                            phases_us=dict(zip(PHASES, med[:-1])),
                            all_us=med[-1],
                            wall_us=wall,
                        )
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
