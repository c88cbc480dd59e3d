"""Where the host's time goes while MLX drives a GPU (issue 25): a workload run in a loop under py-spy's native
sampler, and the samples summed by Python function, by native function and by library. S3Gen and English's T3
step are bound by their host on the H200 (RESULTS runs AE); this says which part of the host's work to cut.

    py-spy record --native -r 250 -f raw -o spy.txt -- python benchmarks/probe_host.py --workload s3gen
    python benchmarks/probe_host.py --summarize spy.txt

Workloads (random full-size weights, one request, warm: ``--warm`` untimed runs first):
- s3gen: ``S3Gen.batch`` of ``--tokens`` speech tokens (250: 10 s) after a 10 s prompt, bf16 estimator, as
  ``probe_kernels --part s3gen`` runs it (15 tokens: a stream's first decode).
- mark: the Perth watermark of 10 s of audio at 24 kHz (``Watermarker.apply``; the shipped weights).
- t3: English's decode loop (``generate_speech_tokens``, CFG, upstream's knobs, bf16) of ``--tokens`` tokens
  after its prefill, as ``bench_t3`` runs it: a step bound by its host (212 primitives, 151 of them our kernels).

Only the samples inside ``profiled`` (the timed loop) are summed, or with ``--within ''`` every sample (a
server run under ``py-spy record --subprocesses --threads``: the roots are then its processes and threads). A sample whose innermost frame waits in the
kernel (futex, poll, a condition variable) is the host waiting, for the GPU or for a lock; every other one is
work. ``--summarize`` needs neither MLX nor a GPU.
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import argparse
import collections
import json
import re
import time

MARKER = "profiled"
# Innermost native frames that mean the thread is blocked rather than working.
WAITING = re.compile(
    r"futex|pthread_cond|__poll|epoll|nanosleep|sched_yield|syscall \(|__GI___clock_nanosleep"
)
PY_FRAME = re.compile(r"^(?P<fn>[^ ]+) \((?P<file>[^()]*):\d+\)$")  # "function (file.py:line)"
NATIVE_FRAME = re.compile(r"^(?P<fn>.+) \((?P<lib>[^():]+)\)$")  # "function (library.so)"
# py-spy --subprocesses --threads puts the process and the thread first: 'process 12:"python -m ..."',
# 'thread (12): mlx-chatterbox-worker'.
# A command may hold a ";" (py-spy does not escape it), so these are matched on the stack's text.
ROOT_FRAME = re.compile(r'(process \d+:"(?P<cmd>[^"]*)"|thread \(\d+\): (?P<thread>[^;]*));?')


def run(workload: str, tokens: int, seconds: float, warm: int) -> dict:
    import mlx.core as mx
    import numpy as np

    if workload == "s3gen":
        from probe_s3gen import lone_request

        once = lone_request(tokens)

    elif workload == "mark":
        from mlx_chatterbox.generation.watermark import Watermarker

        marker = Watermarker.load()
        wav = (0.1 * np.random.default_rng(0).standard_normal(10 * 24_000)).astype(np.float32)

        def once() -> None:
            marker.apply(wav, 24_000)

    elif workload == "t3":
        from bench_t3 import CFG, fixed_inputs, t3_voice

        from mlx_chatterbox.generation.speech_tokens import generate_speech_tokens
        from mlx_chatterbox.models.t3 import T3
        from mlx_chatterbox.sampling import SamplingParams

        model = T3(CFG)
        model.set_dtype(mx.bfloat16)
        mx.eval(model.parameters())
        text, t3v = fixed_inputs()[0], t3_voice(mx.bfloat16)
        params = SamplingParams(max_new_tokens=tokens)

        def once() -> None:
            for _ in generate_speech_tokens(
                model, t3v, text, params, key=mx.random.key(0), stop_on_eos=False
            ):
                pass

    else:
        raise SystemExit(f"--workload {workload}: s3gen, mark or t3")
    for _ in range(warm):
        once()
    calls, elapsed = profiled(once, seconds)
    return dict(workload=workload, tokens=tokens, calls=calls, ms_per_call=1e3 * elapsed / calls)


def profiled(once, seconds: float) -> tuple[int, float]:
    """``once`` in a loop for about ``seconds``: (calls, seconds). The summary keeps only samples under here."""
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        once()
        calls += 1
    return calls, time.perf_counter() - t0


def summarize(path: str, top: int, within: str = MARKER) -> dict:
    """py-spy's raw (folded) samples -> shares of the samples under the frame named ``within`` (every sample
    when it is empty)."""
    total = waiting = 0
    py_self, native_self, native_incl, libs, roots = (collections.Counter() for _ in range(5))
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        heads, at = [], 0
        while m := ROOT_FRAME.match(stack, at):
            heads.append(m)
            at = m.end()
        frames = stack[at:].split(";")
        # A thread by its name, a process by its command's first words: both can be ``within``.
        labels = [m["thread"] or " ".join(m["cmd"].split()[:4]) for m in heads]
        names = [f.split(" (")[0] for f in frames]
        if within and within not in names and within not in labels:
            continue
        n = int(count)
        total += n
        roots[" / ".join(labels) or "-"] += n
        frames = frames[names.index(within) + 1 :] if within in names else frames
        leaf = frames[-1] if frames else within
        if WAITING.search(leaf):
            waiting += n
            continue
        py = [m for m in map(PY_FRAME.match, frames) if m]
        py_self[f"{py[-1]['fn']} ({py[-1]['file']})" if py else within] += n
        native = [m for m in map(NATIVE_FRAME.match, frames) if m and not PY_FRAME.match(m.group(0))]
        if native:
            native_self[_short(native[-1]["fn"])] += n
            libs[native[-1]["lib"]] += n
        for fn in {_short(m["fn"]) for m in native}:
            native_incl[fn] += n
    if not total:
        raise SystemExit(f"{path}: no sample under {within!r} (was the workload run under py-spy --native?)")

    def shares(counter: collections.Counter) -> list[tuple[str, float]]:
        return [(k, round(100 * v / total, 1)) for k, v in counter.most_common(top)]

    return dict(
        samples=total,
        waiting_pct=round(100 * waiting / total, 1),
        python_innermost=shares(py_self),
        native_self=shares(native_self),
        native_inclusive=shares(native_incl),
        library_self=shares(libs),
        roots=shares(roots),
    )


def _short(fn: str) -> str:
    """A C++ name without its template and argument lists (``std::vector<...>::push_back`` -> ``std::vector::push_back``)."""
    out, depth = [], 0
    for ch in fn:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">" and depth > 0
    return "".join(out).split("(")[0][:120]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="s3gen", help="s3gen, mark or t3")
    p.add_argument("--tokens", type=int, default=250, help="s3gen: speech tokens after the prompt; t3: drawn")
    p.add_argument("--seconds", type=float, default=8.0, help="how long the profiled loop runs")
    p.add_argument("--warm", type=int, default=3, help="untimed runs before the loop")
    p.add_argument("--summarize", metavar="RAW", help="summarize py-spy's raw output instead of running")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--within", default=MARKER, help="summarize: only samples under this frame ('': all)")
    p.add_argument("--label", default="", help="a name for the summary's JSON line")
    p.add_argument("--out", help="append the JSON line here")
    args = p.parse_args()
    if args.summarize:
        row = dict(
            part="summary",
            label=args.label,
            raw=args.summarize,
            **summarize(args.summarize, args.top, args.within),
        )
        print(f"\n{args.label or args.summarize}: {row['samples']} samples, {row['waiting_pct']}% waiting")
        for key in ("roots", "python_innermost", "native_self", "native_inclusive", "library_self"):
            print(f"\n| {key} | % of samples |\n|---|---|")
            for name, pct in row[key]:
                print(f"| `{name}` | {pct} |")
    else:
        row = dict(part="run", **run(args.workload, args.tokens, args.seconds, args.warm))
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
