"""Where S3Gen's time goes on a GPU (issues 24 and 25): what each kind of operation of the CFM estimator costs at
its real shapes, one estimator call's primitives with its host and device time, and batched vocoding by stage
and memory budget. A probe for the H200 (random full-size weights, no torch); prints a short table per part.

    python benchmarks/probe_s3gen.py --part ops,call,batch --rows 1,8,32 --out s3gen_probe.jsonl

- ops: each operation kind of the estimator (its products, convolutions, norms, activations, attention with and
  without the padding bias) at 2 rows (one request with CFG) and 16 (eight), 1000 frames (10 s prompt + 10 s):
  microseconds each, n of them built lazily and evaluated together (MLX's encoding plus the device).
- call: one estimator call at 2·N rows: primitives by kind, the host's time to build the graph, and the time to
  evaluate it.
- solve: one CFM solve (10 steps with CFG) at 2·N rows of ``--frames`` frames, the estimator as it runs or, with
  ``--estimator compiled``, compiled afresh for the solve (its trace counted): what a per-utterance compile gives;
  ``--estimator tiled`` (call, solve, device): the estimator's products as our tensor-core kernel (cfm.tiled_product).
- device: the GPU's time for one estimator call at 2·N rows, apart from the host's (the calls queued behind a
  second-long chain of products; run with MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=1000000).
- batch: ``S3Gen.batch`` of N requests of 10 s (the 10 s voice prompt each) by stage (encoder, CFM, HiFT), under
  the default memory budget ("auto") and none: wall time, RTF of the audio made, MLX's peak above the weights
  (the whole call's, and each stage's evaluated alone under the same budget).
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx_chatterbox  # noqa: F401  isort: skip

import argparse
import collections
import contextlib
import io
import itertools
import json
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from probe_step import VIEWS, chain_time, primitives

from mlx_chatterbox.convert import S3GEN_PARTS, sanitize_s3gen_part, split_s3gen
from mlx_chatterbox.generation import vocode
from mlx_chatterbox.generation.vocode import S3Gen, resolve_memory_budget
from mlx_chatterbox.generation.voice import Voice
from mlx_chatterbox.models import cfm
from mlx_chatterbox.variants import ENGLISH

FRAMES = 1000  # mel frames of a 10 s prompt + 10 s of speech
TOKENS = 250


def random_s3gen() -> S3Gen:
    """Full-size English S3Gen with the tests' random weights, through our conversion."""
    from tests.conftest import upstream_s3gen_weights

    weights = {k: mx.array(v) for k, v in upstream_s3gen_weights(ENGLISH).items()}
    parts = split_s3gen(weights)
    nets = {}
    for _, name, network in S3GEN_PARTS:
        if name in ("flow", "cfm", "hift"):
            nets[name] = network(getattr(ENGLISH, name))
            nets[name].load_weights(
                list(sanitize_s3gen_part(parts[name], name, ENGLISH).items()), strict=True
            )
    mx.eval([n.parameters() for n in nets.values()])
    return S3Gen(nets["flow"], nets["cfm"], nets["hift"])


def voice() -> Voice:
    rng = np.random.default_rng(0)
    return Voice(
        speaker_emb=mx.zeros((1, 256)),
        t3_prompt_tokens=mx.zeros((1, 1), dtype=mx.int32),
        s3gen_prompt_tokens=mx.array(rng.integers(0, 6561, (1, TOKENS)).astype(np.int32)),
        s3gen_prompt_mel=mx.array(rng.standard_normal((1, 2 * TOKENS, 80)).astype(np.float32) - 5),
        xvector=mx.array(rng.standard_normal((1, 192)).astype(np.float32)),
    )


def lone_request(tokens: int = TOKENS) -> Callable[[], None]:
    """One ``S3Gen.batch`` of a request of ``tokens`` speech tokens after a 10 s prompt, evaluated, on the random
    full-size S3Gen with a bf16 estimator (``serve --cfm-dtype bfloat16``): the call probe_kernels and
    probe_host profile."""
    s3gen = random_s3gen()
    s3gen.estimator.set_dtype(mx.bfloat16)
    mx.eval(s3gen.estimator.parameters())
    v = voice()
    ids = [mx.array(np.random.default_rng(1).integers(0, 6561, (1, tokens)).astype(np.int32))]

    def run() -> None:
        mx.eval(s3gen.batch(ids, [v], keys=[mx.random.key(0)]))

    return run


# --- ops ---


def ops(dtype: mx.Dtype, rows: int, n: int, frames: int) -> list[tuple[str, float]]:
    """Microseconds per operation of the estimator's kinds at (rows, frames, channels)."""
    c, inner, ff = 256, 512, 1024

    def rand(*shape):
        return (0.05 * mx.random.normal(shape)).astype(dtype)

    x, x_wide, x_ff = rand(rows, frames, c), rand(rows, frames, inner), rand(rows, frames, ff)
    m = mx.ones((rows, frames, 1), dtype)
    q = rand(rows, 8, frames, 64)
    bias = mx.zeros((rows, 1, 1, frames), dtype)
    gamma, beta = mx.ones((c,), dtype), mx.zeros((c,), dtype)
    mx.eval(x, x_wide, x_ff, m, q, bias)

    def many(f, inp):
        """n independent calls on one input (for operations that change the shape)."""
        return lambda: [f(inp, i) for i in range(n)]

    def chain(f, inp):
        def build():
            y = inp
            for i in range(n):
                y = f(y, i)
            return y

        return build

    def weights(cout, cin, k=None):
        shape = (cout, cin) if k is None else (cout, k, cin)
        ws = [rand(*shape) for _ in range(n)]
        mx.eval(ws)
        return ws

    w_q, w_out, w_ff1, w_ff2 = weights(inner, c), weights(c, inner), weights(ff, c), weights(c, ff)
    w_qkv, w_c3, w_in3 = weights(3 * inner, c), weights(c, c, 3), weights(c, 320, 3)
    b_c, b_ff = rand(c), rand(ff)
    x_in = rand(rows, frames, 320)
    mx.eval(b_c, b_ff, x_in)
    pad = [(0, 0), (2, 0), (0, 0)]
    table = [
        ("linear 256->512 (to_q/k/v)", many(lambda y, i: y @ w_q[i].T, x)),
        ("linear 256->1536 (q, k, v as one)", many(lambda y, i: y @ w_qkv[i].T, x)),
        ("linear 512->256 + bias (to_out)", many(lambda y, i: mx.addmm(b_c, y, w_out[i].T), x_wide)),
        ("linear 256->1024 + bias (ff in)", many(lambda y, i: mx.addmm(b_ff, y, w_ff1[i].T), x)),
        ("linear 1024->256 + bias (ff out)", many(lambda y, i: mx.addmm(b_c, y, w_ff2[i].T), x_ff)),
        ("conv1d k3 256->256 (causal pad + conv)", many(lambda y, i: mx.conv1d(mx.pad(y, pad), w_c3[i]), x)),
        ("conv1d k3 320->256 (first block)", many(lambda y, i: mx.conv1d(mx.pad(y, pad), w_in3[i]), x_in)),
        ("pad alone", many(lambda y, i: mx.pad(y, pad), x)),
        ("layer_norm 256", chain(lambda y, i: mx.fast.layer_norm(y, gamma, beta, 1e-5), x)),
        ("mish", chain(lambda y, i: nn.mish(y), x)),
        ("gelu (erf) on 1024", chain(lambda y, i: nn.gelu(y), x_ff)),
        ("multiply by the frame mask", chain(lambda y, i: y * m, x)),
        ("add", chain(lambda y, i: y + x, x)),
        (
            "heads split: reshape + transpose + copy",
            many(
                lambda y, i: mx.contiguous((y + i).reshape(rows, frames, 8, 64).transpose(0, 2, 1, 3)), x_wide
            ),
        ),
        (
            "sdpa 8 heads x 64, no mask",
            chain(lambda y, i: mx.fast.scaled_dot_product_attention(y, q, q, scale=0.125), q),
        ),
        (
            "sdpa 8 heads x 64, padding bias",
            chain(lambda y, i: mx.fast.scaled_dot_product_attention(y, q, q, scale=0.125, mask=bias), q),
        ),
        (
            # The same attention as two products and a precise softmax (3 primitives, the scores in memory):
            # whether MLX's products beat its fp32 attention kernel at these sizes.
            "attention as products (q k^T, softmax, @ v)",
            chain(lambda y, i: mx.softmax((y * 0.125) @ q.swapaxes(-1, -2), axis=-1, precise=True) @ q, q),
        ),
        (
            # fp32 attention through the half-precision kernel: its inputs cast down and its output back up
            # (the products' precision is then TF32's, which fp32 products get on this GPU by default).
            "sdpa in float16 (casts in and out)",
            chain(
                lambda y, i: mx.fast.scaled_dot_product_attention(
                    y.astype(mx.float16), q.astype(mx.float16), q.astype(mx.float16), scale=0.125
                ).astype(y.dtype),
                q,
            ),
        ),
    ]
    return [(name, chain_time(build, n)) for name, build in table]


# --- call ---


def astype_context(*outputs: mx.array) -> collections.Counter:
    """Where the graph converts dtypes: (the producer of an AsType's input, the consumer of its output) kinds."""
    f = io.StringIO()
    mx.export_to_dot(f, *outputs)
    labels = dict(re.findall(r'\{ (\d+) \[label ="([^"]+)", shape=rectangle\]', f.getvalue()))
    edges = re.findall(r'^"?(\w+)"? -> "?(\w+)"?$', f.getvalue(), re.M)
    producer = {dst: src for src, dst in edges if src in labels}  # array -> the primitive that made it
    consumers = collections.defaultdict(list)  # array -> the primitives that read it
    for src, dst in edges:
        if dst in labels:
            consumers[src].append(dst)
    out = collections.Counter()
    for node, label in labels.items():
        if label != "AsType":
            continue
        (x,) = [src for src, dst in edges if dst == node]
        (y,) = [dst for src, dst in edges if src == node]
        for reader in consumers[y] or [None]:
            out[f"{labels.get(producer.get(x), 'input')} -> {labels.get(reader, 'output')}"] += 1
    return out


@contextlib.contextmanager
def products(way: str) -> Iterator[None]:
    """The estimator's products as our kernel (cfm.tiled_product) for the "tiled" way, at any number of rows
    (batches included, past the library's ``TILED_MAX_ROWS``), MLX's otherwise."""
    switch, most = cfm.TILED_PRODUCTS, cfm.TILED_MAX_ROWS
    cfm.TILED_PRODUCTS, cfm.TILED_MAX_ROWS = way == "tiled", sys.maxsize
    try:
        yield
    finally:
        cfm.TILED_PRODUCTS, cfm.TILED_MAX_ROWS = switch, most


def call(s3gen: S3Gen, dtype: mx.Dtype, requests: int, repeats: int, frames: int, way: str = "plain") -> dict:
    """One estimator call at 2·requests rows (CFG); with a padding mask when requests > 1, as batches run.
    way "compiled": through ``mx.compile`` (traced for this shape on its first call; its element-wise chains
    fused); "tiled": its products as our kernel."""
    with products(way):
        return _call(s3gen, dtype, requests, repeats, frames, way == "compiled") | dict(estimator=way)


def _call(s3gen: S3Gen, dtype: mx.Dtype, requests: int, repeats: int, frames: int, compiled: bool) -> dict:
    est = s3gen.estimator
    est.set_dtype(dtype)
    mx.eval(est.parameters())  # else every graph below would start with the weights' casts
    b = 2 * requests
    x, mu, cond = (mx.random.normal((b, frames, 80)).astype(dtype) for _ in range(3))
    spks, t = mx.random.normal((b, 80)).astype(dtype), mx.full((b,), 0.3)
    mask = None if requests == 1 else mx.ones((b, frames), dtype=mx.bool_)
    mx.eval(x, mu, cond, spks, t, mask if mask is not None else x)
    run = mx.compile(lambda *a: est(a[0], mask, *a[1:])) if compiled else lambda *a: est(a[0], mask, *a[1:])
    counts = primitives(run(x, mu, t, spks, cond))
    casts = astype_context(run(x, mu, t, spks, cond))
    builds, evals = [], []
    for _ in range(repeats + 1):
        mx.synchronize()
        t0 = time.perf_counter()
        out = run(x, mu, t, spks, cond)
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        builds.append(t1 - t0)
        evals.append(t2 - t1)
    est.set_dtype(mx.float32)
    return dict(
        dtype=str(dtype).split(".")[-1],
        rows=b,
        primitives=sum(counts.values()),
        views=sum(v for k, v in counts.items() if k in VIEWS),
        build_ms=1e3 * statistics.median(builds[1:]),
        eval_ms=1e3 * statistics.median(evals[1:]),
        kinds=dict(counts.most_common(12)),
        casts=dict(casts.most_common(8)),
    )


def device_time(s3gen: S3Gen, dtype: mx.Dtype, requests: int, frames: int, way: str = "plain") -> dict:
    with products(way):
        return _device_time(s3gen, dtype, requests, frames) | dict(estimator=way)


def _device_time(s3gen: S3Gen, dtype: mx.Dtype, requests: int, frames: int, calls: int = 6) -> dict:
    """The GPU's time for one estimator call at 2·requests rows, apart from the host's: a chain of large
    products keeps the GPU busy for about a second while the host queues ``calls`` calls behind it (each one CUDA
    graph, MLX_MAX_OPS_PER_BUFFER being set high: MLX holds the host back at 10 graphs in flight), so the wall
    time past the chain's own is the GPU's work for the calls. Three rounds after a warm-up; valid when the host
    finished queuing before the chain did. The host's own time is not what it is in use (a graph of ~1,000
    nodes a call is slow to build): that is ``call``'s."""
    est = s3gen.estimator
    est.set_dtype(dtype)
    mx.eval(est.parameters())
    b = 2 * requests
    x, mu, cond = (mx.random.normal((b, frames, 80)).astype(dtype) for _ in range(3))
    spks, t = mx.random.normal((b, 80)).astype(dtype), mx.full((b,), 0.3)
    mask = None if requests == 1 else mx.ones((b, frames), dtype=mx.bool_)
    a = (mx.random.normal((8192, 8192)) * 8192**-0.5).astype(mx.bfloat16)  # keeps the chain's scale
    mx.eval(x, mu, cond, spks, t, a)

    def chain() -> mx.array:
        y = a
        for _ in range(600):  # about 1 s on an H200
            y = y @ a
        return y

    chains, totals, queued = [], [], []
    for _ in range(4):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(chain())
        chains.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mx.async_eval(chain())
        for _ in range(calls):
            mx.async_eval(est(x, mask, mu, t, spks, cond))
        queued.append(time.perf_counter() - t0)
        mx.synchronize()
        totals.append(time.perf_counter() - t0)
    est.set_dtype(mx.float32)
    per_call = [1e3 * (total - chain_s) / calls for total, chain_s in zip(totals[1:], chains[1:])]
    return dict(
        dtype=str(dtype).split(".")[-1],
        rows=b,
        device_ms=statistics.median(per_call),
        device_ms_rounds=[round(v, 2) for v in per_call],
        chain_ms=1e3 * statistics.median(chains[1:]),
        queued_ms=1e3 * max(queued[1:]),
        valid=max(queued[1:]) < min(chains[1:]),
    )


class _CompiledEstimator:
    """An estimator through ``mx.compile``, compiled afresh for each solve (as a per-utterance compile would run:
    its trace is part of the solve's time): ``cfm.solve`` reads ``config`` and ``dtype`` from it."""

    def __init__(self, est: cfm.Estimator):
        self.config, self.dtype = est.config, est.dtype
        self._call = mx.compile(est.__call__)

    def __call__(self, *args):
        return self._call(*args)


def solve_time(s3gen: S3Gen, dtype: mx.Dtype, requests: int, frames: int, way: str, repeats: int) -> dict:
    """One CFM solve (10 Euler steps with CFG, 2·requests rows of ``frames`` frames, masked when requests > 1)
    as the estimator runs (plain) or compiled once per solve (compiled: the trace, then 9 steps that reuse it).
    """
    est = s3gen.estimator
    est.set_dtype(dtype)
    mx.eval(est.parameters())
    mu, cond, noise = (mx.random.normal((requests, frames, 80)) for _ in range(3))
    spks = mx.random.normal((requests, 80))
    mask = None if requests == 1 else mx.ones((requests, frames), dtype=mx.bool_)
    mx.eval(mu, cond, noise, spks, mask if mask is not None else mu)
    times = []
    for _ in range(repeats + 1):
        mx.synchronize()
        t0 = time.perf_counter()
        estimator = _CompiledEstimator(est) if way == "compiled" else est
        with products(way):
            mx.eval(cfm.solve(estimator, mu, mask, spks, cond, noise, 10, 0.7))
        times.append(time.perf_counter() - t0)
    est.set_dtype(mx.float32)
    return dict(
        dtype=str(dtype).split(".")[-1],
        rows=2 * requests,
        frames=frames,
        estimator=way,
        solve_ms=1e3 * statistics.median(times[1:]),
        first_ms=1e3 * times[0],
    )


# --- batch ---


def batch(
    s3gen: S3Gen, requests: int, budget, repeats: int, dtype: mx.Dtype, spread: int, tokens: int = TOKENS
) -> dict:
    """``S3Gen.batch`` of ``requests`` x ``tokens`` speech tokens (10 s; 15: a stream's first decode) after the
    10 s prompt, with the estimator in ``dtype`` (``serve --cfm-dtype``), and its stages evaluated one by one.
    ``spread``: the call's requests lose up to this many tokens each, at random, as served ones differ; the
    stages are timed at ``tokens`` each."""
    s3gen.estimator.set_dtype(dtype)
    mx.eval(s3gen.estimator.parameters())
    v = voice()
    rng = np.random.default_rng(1)
    ids = [mx.array(rng.integers(0, 6561, (1, tokens)).astype(np.int32)) for _ in range(requests)]
    cut = [row[:, : tokens - int(rng.integers(0, spread + 1))] for row in ids]
    keys = [mx.random.key(i) for i in range(requests)]
    s3gen.memory_budget = budget
    lengths = mx.array([TOKENS + tokens] * requests, dtype=mx.int32)  # the prompt's 250 and the request's
    everything = mx.concatenate([mx.concatenate([v.s3gen_prompt_tokens, t], axis=1) for t in ids])
    runs = []
    for _ in range(repeats + 1):
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        mx.eval(s3gen.batch(cut, [v] * requests, keys=keys, bucket=25))
        t1 = time.perf_counter()
        peak = mx.get_peak_memory() - before
        # The stages apart, each evaluated alone under the same budget, each one's peak above what was in use
        # before the call (what MLX holds for its queued kernels, on a GPU their workspaces too).
        limit = resolve_memory_budget(budget, requests)
        old = mx.set_memory_limit(mx.get_active_memory() + limit) if limit is not None else None
        peaks = []

        def stage_peak() -> None:
            peaks.append((mx.get_peak_memory() - before) / 2**20)
            mx.reset_peak_memory()

        mx.reset_peak_memory()
        mu, mask = s3gen.flow.encode(everything, lengths, isolate_rows=requests > 1)
        mx.eval(mu, mask)
        t2 = time.perf_counter()
        stage_peak()
        spks = s3gen.flow.embed_speaker(mx.concatenate([v.xvector] * requests))
        mel = cfm.solve(
            s3gen.estimator,
            mu,
            mask if requests > 1 else None,
            spks,
            mx.zeros(mu.shape),
            mx.random.normal(mu.shape),
            10,
            0.7,
        )
        mx.eval(mel)
        t3 = time.perf_counter()
        stage_peak()
        mx.eval(s3gen.hift(mel[:, 2 * TOKENS :]))
        t4 = time.perf_counter()
        stage_peak()
        if old is not None:
            mx.set_memory_limit(old)
        runs.append(
            dict(
                total_ms=1e3 * (t1 - t0),
                encoder_ms=1e3 * (t2 - t1),
                cfm_ms=1e3 * (t3 - t2),
                hift_ms=1e3 * (t4 - t3),
                peak_mib=peak / 2**20,
                encoder_peak_mib=peaks[0],
                cfm_peak_mib=peaks[1],
                hift_peak_mib=peaks[2],
            )
        )
    s3gen.estimator.set_dtype(mx.float32)
    out = {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}
    audio_s = sum(row.shape[1] for row in cut) * 0.04
    return dict(
        dtype=str(dtype).split(".")[-1],
        requests=requests,
        spread=spread,
        memory_budget=str(budget),
        audio_s=audio_s,
        rtf=out["total_ms"] / 1e3 / audio_s,
        **out,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default="ops,call,batch")
    p.add_argument(
        "--dtypes", default="float32,bfloat16", help="estimator dtypes (batch: serve's --cfm-dtype)"
    )
    p.add_argument(
        "--rows", default="1,8,32", help="requests per call (call, batch; ops takes the first two)"
    )
    p.add_argument(
        "--budgets", default="auto,none", help="batch: S3Gen.memory_budget values (MiB or auto/none)"
    )
    p.add_argument("--spread", type=int, default=0, help="batch: requests up to this many tokens shorter")
    p.add_argument(
        "--tokens",
        type=int,
        default=TOKENS,
        help="batch: speech tokens a request (15: a stream's first decode)",
    )
    p.add_argument(
        "--hift",
        default="one",
        help="batch: HiFT over the call's rows in one masked call (one), or once per distinct length (per-length, "
        "as before 2026-12-03); a comma-separated list runs each",
    )
    p.add_argument(
        "--estimator",
        default="plain",
        help="call, solve, device: the estimator as it runs (plain), through mx.compile (compiled: element-wise "
        "chains fused; solve compiles once per solve; not with device), or with its products as our tensor-core kernel "
        "(tiled: cfm.tiled_product, bf16 and fp16); a comma-separated list runs each, back to back",
    )
    p.add_argument("--frames", type=int, default=FRAMES, help="ops, call, solve, device: mel frames a row")
    p.add_argument("--n", type=int, default=40, help="ops: operations per timed graph")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="gpu", help="cpu: a smoke test of the script")
    p.add_argument("--out", help="append JSON lines here")
    args = p.parse_args()
    if not 0 <= args.spread < args.tokens:
        p.error(f"--tokens {args.tokens} and --spread {args.spread}: a request keeps at least one token")
    mx.set_default_device(getattr(mx, args.device))
    parts, dtypes = args.part.split(","), [getattr(mx, d) for d in args.dtypes.split(",")]
    requests = [int(r) for r in args.rows.split(",")]
    ways = args.estimator.split(",")
    if set(ways) - {"plain", "compiled", "tiled"}:
        p.error(f"--estimator {args.estimator}: of plain, compiled, tiled")
    if "tiled" in ways and (args.device == "cpu" or not mx.cuda.is_available()):
        p.error("--estimator tiled is a CUDA kernel: it needs MLX's CUDA backend and the GPU")
    if "device" in parts and "compiled" in ways:
        p.error("--part device times the estimator plain or tiled, not compiled: run it apart")
    if "device" in parts and int(os.environ.get("MLX_MAX_OPS_PER_BUFFER", "0")) < 100_000:
        p.error(
            "--part device needs MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=1000000 (a graph a call)"
        )

    def emit(row: dict) -> None:
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    if "ops" in parts:
        rows = [2 * r for r in requests[:2]]
        results = {(d, r): dict(ops(d, r, args.n, args.frames)) for d in dtypes for r in rows}
        cols = [(d, r) for d in dtypes for r in rows]
        print(
            f"\n| op, {args.frames} frames | "
            + " | ".join(f"{str(d).split('.')[-1]} {r} rows µs" for d, r in cols)
            + " |\n|---|"
            + "---|" * len(cols)
        )
        for name in results[cols[0]]:
            print(f"| {name} | " + " | ".join(f"{results[c][name]:.1f}" for c in cols) + " |", flush=True)
        emit(
            dict(
                part="ops",
                n=args.n,
                tf32=os.environ.get("MLX_ENABLE_TF32", "default"),
                results={f"{str(d).split('.')[-1]}-{r}": v for (d, r), v in results.items()},
            )
        )
    s3gen = random_s3gen() if {"call", "solve", "device", "batch"} & set(parts) else None

    def table(part: str, header: str, rows, line) -> None:
        """Print a part's markdown header, then each row as it comes (``line``), each also emitted."""
        print(header)
        for row in rows:
            emit(dict(part=part, **row))
            print(line(row), flush=True)

    if "call" in parts:
        table(
            "call",
            "\n| dtype | estimator | rows | primitives (views) | build ms | eval ms | top kinds | casts (made by -> "
            "read by) |\n|---|---|---|---|---|---|---|---|",
            (
                call(s3gen, d, r, args.repeats, args.frames, way)
                for d, r, way in itertools.product(dtypes, requests, ways)
            ),
            lambda row: f"| {row['dtype']} | {row['estimator']} | {row['rows']} | "
            f"{row['primitives']} ({row['views']}) | {row['build_ms']:.1f} | {row['eval_ms']:.1f} | "
            + ", ".join(f"{k} {v}" for k, v in list(row["kinds"].items())[:6])
            + " | "
            + ", ".join(f"{k} {v}" for k, v in list(row["casts"].items())[:4])
            + " |",
        )
    if "solve" in parts:
        table(
            "solve",
            "\n| dtype | rows | frames | estimator | solve ms (10 steps) | first solve ms |\n|---|---|---|---|---|---|",
            (
                solve_time(s3gen, d, r, args.frames, way, args.repeats)
                for d, r, way in itertools.product(dtypes, requests, ways)
            ),
            lambda row: f"| {row['dtype']} | {row['rows']} | {row['frames']} | {row['estimator']} | "
            f"{row['solve_ms']:.1f} | {row['first_ms']:.0f} |",
        )
    if "device" in parts:
        table(
            "device",
            "\n| dtype | estimator | rows | GPU ms a call (rounds) | chain ms | valid |\n|---|---|---|---|---|---|",
            (
                device_time(s3gen, d, r, args.frames, way)
                for d, r, way in itertools.product(dtypes, requests, ways)
            ),
            lambda row: f"| {row['dtype']} | {row['estimator']} | {row['rows']} | {row['device_ms']:.1f} "
            f"({row['device_ms_rounds']}) | "
            f"{row['chain_ms']:.0f} | {row['valid']} |",
        )
    if "batch" in parts:
        print(
            "\n| CFM | HiFT | requests (spread) | budget | total ms | RTF | encoder ms | CFM ms | HiFT ms | peak MiB "
            "| alone: encoder / CFM / HiFT peak MiB |\n|---|---|---|---|---|---|---|---|---|---|---|"
        )
        one = vocode.vocode_rows
        # HiFT's ways innermost: each pair is timed back to back, alike in whatever else the machine is doing.
        for d, budget, r, hift in itertools.product(
            dtypes, args.budgets.split(","), requests, args.hift.split(",")
        ):
            vocode.vocode_rows = {"one": one, "per-length": _per_length(one)}[hift]
            value = budget if budget == "auto" else None if budget == "none" else int(budget) * 2**20
            row = batch(s3gen, r, value, args.repeats, d, args.spread, args.tokens)
            emit(dict(part="batch", hift=hift, tokens=args.tokens, **row))
            print(
                f"| {row['dtype']} | {hift} | {r} ({args.spread}) | {budget} | {row['total_ms']:.0f} | {row['rtf']:.4f} | {row['encoder_ms']:.0f} | "
                f"{row['cfm_ms']:.0f} | {row['hift_ms']:.0f} | {row['peak_mib']:.0f} | "
                f"{row['encoder_peak_mib']:.0f} / {row['cfm_peak_mib']:.0f} / {row['hift_peak_mib']:.0f} |",
                flush=True,
            )


def _per_length(vocode_rows):
    """``vocode_rows`` once per distinct mel length (no masks), as S3Gen.batch ran HiFT before 2026-12-03."""

    def per_length(hift, mels, keys):
        groups: dict[int, list[int]] = {}
        for i, mel in enumerate(mels):
            groups.setdefault(mel.shape[1], []).append(i)
        out = [None] * len(mels)
        for rows in groups.values():
            for i, wav in zip(rows, vocode_rows(hift, [mels[i] for i in rows], [keys[i] for i in rows])):
                out[i] = wav
        return out

    return per_length


if __name__ == "__main__":
    main()
