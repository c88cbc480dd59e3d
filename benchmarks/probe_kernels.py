"""Which kernels a GPU spends its time in (issue 25): every kernel of the process as CUPTI records it, through
torch.profiler (the device image's CUDA build of torch; MLX's kernels are the process's), summed by name. A
probe for the H200; prints a short table per part.

    python benchmarks/probe_kernels.py --part scalars,t3,s3gen --models turbo,english --out kernels.jsonl

- t3: ``--steps`` decode steps of each of ``--models`` (English: CFG; Turbo, Nano: 1 row), queued as the loops
  queue them (the token read one step behind): GPU time a step by kernel, and the span from the first kernel's
  start to the last one's end (a span well over the kernels' sum: the GPU waits for the host).
- s3gen: one ``S3Gen.batch`` of a 10 s request after a 10 s prompt (English, bf16 estimator, 10 steps), for each
  of ``--systems`` ("ours-plain-products": the estimator's products as MLX's ops, not our kernel;
  "ours-tiles-32": our kernel with tiles of 32 rows everywhere; "ours-narrow-normed": tiles of 64 columns and 4
  warps for the products with a norm of x).
- scalars: a chain of multiplies on a 2 x 512 x 1,000 float32 array by a scalar made three ways: a Python
  float (a new 4-byte array from the host each op), one host-made array, and that array copied into device
  memory: what a kernel pays for reading a scalar that MLX keeps in managed memory.
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx_chatterbox  # noqa: F401  isort: skip

import argparse
import collections
import json
import tempfile

import mlx.core as mx
from common import write_line
from probe_step import OURS, _english_loop, _turbo_loop, use

from mlx_chatterbox.models import layers

TOP = 12  # kernels a table shows


def gpu_kernels(run) -> dict:
    """``run()`` under CUPTI: the kernels, copies and sets it puts on the GPU, summed by name (microseconds),
    and the span from the first one's start to the last one's end."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    mx.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        mx.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    work = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not work:
        raise SystemExit(f"CUPTI recorded no GPU work (torch {torch.__version__}): no table to make")
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in work:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]
    start = min(e["ts"] for e in work)
    end = max(e["ts"] + e["dur"] for e in work)
    return dict(
        span_us=end - start,
        busy_us=sum(e["dur"] for e in work),
        kernels=sorted(([n, c, us] for n, (c, us) in by_name.items()), key=lambda k: -k[2]),
    )


def t3_kernels(model_name: str, dtype_name: str, steps: int) -> dict:
    """``steps`` decode steps after 20 unprofiled ones, as ``probe_step``'s host split queues them."""
    start, arguments, step = (_english_loop if model_name == "english" else _turbo_loop)(
        model_name, dtype_name, steps + 22
    )
    token, seen, cache = start()
    state = dict(token=token, seen=seen, i=0)

    def steps_of(n: int) -> None:
        token, seen = state["token"], state["seen"]
        for _ in range(n):
            nxt, seen, cache.kv = step(*arguments(state["i"], token, seen, cache))
            mx.async_eval(nxt, seen)
            token.item()  # the loops' stop check, one step behind
            token, state["i"] = nxt, state["i"] + 1
        state.update(token=token, seen=seen)

    steps_of(20)
    mx.synchronize()
    return gpu_kernels(lambda: steps_of(steps)) | dict(per=steps)


def s3gen_kernels() -> dict:
    """One ``S3Gen.batch`` of a 10 s request (bf16 estimator) after two unprofiled ones."""
    from probe_s3gen import lone_request

    run = lone_request()
    for _ in range(2):  # kernels built, shapes met
        run()
    return gpu_kernels(run) | dict(per=1)


def scalar_kernels(n: int = 200) -> list[tuple[str, dict]]:
    """A chain of ``n`` multiplies by a scalar made each way, each chain profiled on its own."""
    x = mx.random.normal((2, 512, 1000))
    host = mx.array(0.999)
    device = layers._in_device_memory(host)
    mx.eval(x, host, device)
    ways = {
        "python float": lambda y: y * 0.999,
        "host array": lambda y: y * host,
        "device array": lambda y: y * device,
    }
    out = []
    for name, f in ways.items():

        def run(f=f) -> None:
            y = x
            for _ in range(n):
                y = f(y)
            mx.eval(y)

        run()
        out.append((name, gpu_kernels(run) | dict(per=n)))
    return out


def table(title: str, r: dict) -> str:
    """The span and busy time per step (or call) and the top kernels, microseconds each per step."""
    per = r["per"]
    lines = [
        f"\n{title}: span {r['span_us'] / per:.1f} us, kernels {r['busy_us'] / per:.1f} us a step",
        "| kernel | per step | us a step | us each |",
        "|---|---|---|---|",
    ]
    for name, count, us in r["kernels"][:TOP]:
        lines.append(f"| {name[:90]} | {count / per:.1f} | {us / per:.1f} | {us / count:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", default="scalars,t3,s3gen")
    parser.add_argument("--models", default="turbo,english")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--systems", default="ours", help=f"t3, s3gen: comma-separated, of {', '.join(OURS)}")
    parser.add_argument("--steps", type=int, default=50, help="t3: decode steps profiled")
    parser.add_argument("--out", help="append JSON lines here")
    args = parser.parse_args()
    systems = args.systems.split(",")
    if set(systems) - set(OURS):
        parser.error(f"--systems takes {', '.join(OURS)}, got {args.systems}")
    parts = args.part.split(",")
    if set(parts) - {"t3", "s3gen", "scalars"}:
        parser.error(f"--part takes t3, s3gen and scalars, got {args.part}")
    if "scalars" in parts:
        for name, r in scalar_kernels():
            write_line(dict(part="scalars", way=name, **r), args.out)
            print(table(f"multiply by a {name}, 2 x 512 x 1,000 (per op)", r), flush=True)

    if "t3" in parts:
        for model in args.models.split(","):
            for dn in args.dtypes.split(","):
                for system in systems:
                    use(system)
                    r = t3_kernels(model, dn, args.steps)
                    use("ours")
                    write_line(dict(part="t3", model=model, dtype=dn, system=system, **r), args.out)
                    print(table(f"{model} {dn} {system}", r), flush=True)
    if "s3gen" in parts:
        for system in systems:
            use(system)
            r = s3gen_kernels()
            use("ours")
            write_line(dict(part="s3gen", system=system, **r), args.out)
            print(table(f"S3Gen.batch, 10 s + 10 s, bf16 estimator, {system} (per call)", r), flush=True)


if __name__ == "__main__":
    main()
