"""Where a T3 decode step's time goes on a GPU (issue 25): what each kind of primitive costs, and whole steps
with their projections computed three ways. A one-off probe for the H200; prints a short table per part.

    python benchmarks/probe_step.py --part micro,step --tokens 200

- micro: chains of one primitive kind, built lazily and then evaluated (so the time is MLX's encoding plus the
  device, not Python): microseconds per primitive.
- step: English T3 (CFG, 2 rows) and Turbo/Nano (1 row) decode speed and primitives per step: our step with
  MLX's own ops (``layers.CUDA_DECODE = False``: the code before ADR 12), ours, ours with the sampling chain's
  softmax as before 2026-12-04 ("ours-old-softmax": our exp and tree sum, ``sampling.mlx_math`` off), ours
  with the cache written by two ``slice_update``s a layer as before 2026-12-04 ("ours-slice-update":
  ``layers.KV_IN_PLACE`` off, ADR 13), ours without the ``mx.depends`` that hand the written buffers back
  ("ours-no-depends": an experiment, sound only because each step is evaluated on its own), ours with each
  layer one kernel ("ours-layer-kernel": ``layers.FUSED_LAYERS`` on for every architecture, ADR 15), ours with
  five kernels a layer ("ours-five-kernels": off for every one; "ours" has GPT-2's on), ours with Turbo's
  sampling chain composed of MLX's ops ("ours-composed-sampling": ``fused_sampling.SAMPLING_KERNEL`` off),
  ours with English's chain one kernel too ("ours-english-sampling": ``fused_sampling.ENGLISH_SAMPLING_KERNEL``
  on, off by default until its tests have run on a GPU),
  ours with the norms' epsilon and the position in 4-byte arrays the host makes, as before 2026-12-04 runs AE
  ("ours-host-scalars": ``layers.DEVICE_SCALARS`` off), ours with the weights read back from a safetensors
  file as a checkpoint's are ("ours-loaded-weights": in MLX's managed memory on CUDA, where the random ones
  made on the GPU are in device memory; the host-split, device and kernel parts only), the same then copied
  on the GPU ("ours-loaded-copied"), and upstream on PyTorch CUDA.
- split: where the host's time of a step goes (building, queueing, waiting for the token).
- device: the GPU's own time for a decode step, queued behind a wait that keeps the GPU busy (run with
  MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=1000000); with split, whether a step is bound by the host
  or by the GPU.
- gemv: the GPU's time for one projection in a dependent chain of MLPs (our kernels and MLX's ops) and the
  bandwidth it reaches (same settings as device).
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx_chatterbox  # noqa: F401  isort: skip

import argparse
import collections
import gc
import io
import json
import os
import re
import statistics
import tempfile
import time
from functools import partial

import mlx.core as mx
from common import write_line

from mlx_chatterbox import sampling
from mlx_chatterbox.generation import fused_sampling
from mlx_chatterbox.models import cfm, layers

MLX_MATH = sampling.mlx_math
OURS = (
    "ours",
    "ours-old-softmax",
    "ours-slice-update",
    "ours-no-depends",
    "ours-layer-kernel",
    "ours-five-kernels",
    "ours-composed-sampling",
    "ours-english-sampling",
    "ours-host-scalars",
    "ours-loaded-weights",
    "ours-loaded-copied",
    "ours-plain-products",
    "ours-tiles-32",
    "ours-narrow-normed",
)  # with our CUDA decode kernels
DEPENDS = mx.depends
FUSED = dict(layers.FUSED_LAYERS)  # the default: by architecture


def kernel_gemv(x: mx.array, w: mx.array) -> mx.array:
    """x (M, K) @ w (N, K).T through our matrix-vector kernel (models/layers.py)."""
    linear = layers.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight = w
    return layers._gemv(x, linear, None, None, "none")


def primitives(*outputs: mx.array) -> collections.Counter:
    f = io.StringIO()
    mx.export_to_dot(f, *outputs)
    return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', f.getvalue()))


# --- micro ---


def chain_time(build, n: int, repeats: int = 5) -> float:
    """Microseconds per primitive of a lazily built chain of n, evaluated alone (median of repeats)."""
    out = build()
    mx.eval(out)  # warm-up: kernels compiled, graph cached
    times = []
    for _ in range(repeats):
        out = build()
        t0 = time.perf_counter()
        mx.eval(out)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times) / n


def micro(dtype: mx.Dtype) -> list[tuple[str, float]]:
    n, d = 120, 1024
    ws = [(0.02 * mx.random.normal((d, d))).astype(dtype) for _ in range(n)]
    mx.eval(ws)
    rows = {m: mx.random.normal((m, d)).astype(dtype) for m in (1, 2, 8, 64)}
    bias = mx.zeros((d,), dtype)
    out = []

    def chain(f, x):
        def build():
            y = x
            for w in ws:
                y = f(y, w)
            return y

        return build

    for m, x in rows.items():
        out.append((f"matmul x @ W.T, {m} rows", chain_time(chain(lambda y, w: y @ w.T, x), n)))
    out.append(
        (
            "addmm (Linear with bias), 1 row",
            chain_time(chain(lambda y, w: mx.addmm(bias, y, w.T), rows[1]), n),
        )
    )
    out.append(("matmul + add, 1 row", chain_time(chain(lambda y, w: y @ w.T + bias, rows[1]), 2 * n)))
    for m in (2, 8):
        x = rows[m]
        out.append(
            (
                f"batched gemv W @ x[...,None], {m} rows",
                chain_time(chain(lambda y, w: (w @ y[..., None])[..., 0], x), n),
            )
        )
        out.append((f"our kernel gemv, {m} rows", chain_time(chain(lambda y, w: kernel_gemv(y, w), x), n)))
    q = [mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=8) for w in ws[:n]]
    mx.eval(q)

    def qchain():
        y = rows[2].astype(mx.bfloat16)
        for wq, s, b in q:
            y = mx.quantized_matmul(y, wq, s, b, transpose=True, group_size=64, bits=8)
        return y

    out.append(("quantized_matmul q8, 2 rows", chain_time(qchain, n)))
    tiny = mx.ones((2, d), dtype)
    out.append(("add (2 x 1024)", chain_time(chain(lambda y, w: y + 1, tiny), n)))
    g = mx.ones((d,), dtype)
    out.append(("rms_norm (2 x 1024)", chain_time(chain(lambda y, w: mx.fast.rms_norm(y, g, 1e-5), tiny), n)))
    cap = 256
    kk = mx.random.normal((2, 16, cap, 64)).astype(dtype)
    vv = mx.random.normal((2, 16, cap, 64)).astype(dtype)
    q1 = mx.random.normal((2, 16, 1, 64)).astype(dtype)
    mask = mx.arange(cap) <= 100
    out.append(
        (
            "sdpa 1 query over 256, bool mask",
            chain_time(
                chain(
                    lambda y, w: mx.fast.scaled_dot_product_attention(y, kk, vv, scale=0.125, mask=mask), q1
                ),
                n,
            ),
        )
    )
    pos = mx.array(100, dtype=mx.int32)
    out.append(
        (
            "slice_update of one position",
            chain_time(chain(lambda y, w: mx.slice_update(y, q1, pos[None], axes=(2,)), kk), n),
        )
    )
    return out


def check_kernel(dtype: mx.Dtype) -> float:
    x = mx.random.normal((2, 1024)).astype(dtype)
    w = mx.random.normal((3072, 1024)).astype(dtype)
    ref = x.astype(mx.float32) @ w.astype(mx.float32).T
    got = kernel_gemv(x, w).astype(mx.float32)
    return (mx.linalg.norm(got - ref) / mx.linalg.norm(ref)).item()


# --- whole steps ---


def use(system: str) -> None:
    """The switches of ``system`` (default: ours)."""
    layers.CUDA_DECODE = system in OURS
    layers.KV_IN_PLACE = system != "ours-slice-update"
    layers.FUSED_LAYERS = (
        dict.fromkeys(FUSED, system == "ours-layer-kernel")
        if system in ("ours-layer-kernel", "ours-five-kernels")
        else FUSED
    )
    sampling.mlx_math = (lambda: False) if system == "ours-old-softmax" else MLX_MATH
    mx.depends = (lambda inputs, dependencies: inputs) if system == "ours-no-depends" else DEPENDS
    fused_sampling.SAMPLING_KERNEL = system != "ours-composed-sampling"
    fused_sampling.ENGLISH_SAMPLING_KERNEL = system == "ours-english-sampling"
    layers.DEVICE_SCALARS = system != "ours-host-scalars"
    cfm.TILED_PRODUCTS = system != "ours-plain-products"  # S3Gen's estimator (probe_kernels --part s3gen)
    cfm.TILED_TILE_ROWS = 32 if system == "ours-tiles-32" else None
    cfm.TILED_WIDE_NORMED = system != "ours-narrow-normed"
    global WEIGHTS
    WEIGHTS = {"ours-loaded-weights": "loaded", "ours-loaded-copied": "copied"}.get(system, "made")


WEIGHTS = (
    "made"  # where the loops' weights are: made on the device, "loaded" from a file, or loaded and "copied"
)


def placed(model):
    """``model`` with its weights where ``WEIGHTS`` says: as made, or written to a safetensors file and read
    back (MLX puts a file's arrays in managed memory on CUDA), then with "copied" each copied on the GPU."""
    if WEIGHTS == "made":
        return model
    from mlx.utils import tree_map

    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/weights.safetensors"
        model.save_weights(path)
        model.load_weights(path, strict=True)
    if WEIGHTS == "copied":
        model.update(tree_map(mx.array, model.parameters()))
    mx.eval(model.parameters())
    return model


def step_row(model: str, dtype_name: str, system: str, tokens: int, repeats: int, src: str | None) -> dict:
    """One decode-speed measurement: ``system`` is "mlx-ops" (our step with MLX's own ops on CUDA: the code
    before ADR 12), "ours" (with layers.CUDA_DECODE), "ours-old-softmax", "ours-slice-update", "ours-no-depends",
    "ours-layer-kernel", "ours-five-kernels", "ours-composed-sampling", "ours-english-sampling",
    "ours-host-scalars" or "upstream"
    (PyTorch CUDA, same inputs)."""
    import bench_t3
    import bench_turbo

    from mlx_chatterbox.models.gpt2 import NANO, TURBO

    use(system)
    if model == "english":
        if system == "upstream":
            return bench_t3.bench_upstream(dtype_name, "cuda", tokens, repeats, src)
        return bench_t3.bench_ours(dtype_name, "gpu", tokens, repeats)
    cfg = NANO if model == "nano" else TURBO
    if system == "upstream":
        return bench_turbo.bench_t3_upstream(cfg, dtype_name, "cuda", tokens, repeats, src)
    return bench_turbo.bench_t3_ours(cfg, dtype_name, tokens, repeats)


VIEWS = {
    "Reshape",
    "Slice",
    "Squeeze",
    "ExpandDims",
    "Broadcast",
    "Flatten",
    "Unflatten",
    "AsStrided",
    "Transpose",
}


def step_primitives(model_name: str, dtype: mx.Dtype) -> tuple[int, int, dict]:
    """Primitives in one compiled decode step (English: CFG, default knobs; Turbo/Nano: default knobs), as MLX
    will evaluate them: (all, those that are views, the count by kind). The weights are evaluated first, so that
    their random initialisation is not counted (the counts of 2026-12-02a/b included it)."""
    from mlx_chatterbox.generation import speech_tokens as st
    from mlx_chatterbox.generation import turbo
    from mlx_chatterbox.models.gpt2 import NANO, TURBO, T3Turbo
    from mlx_chatterbox.models.t3 import T3, T3Config
    from mlx_chatterbox.sampling import SamplingParams, TurboParams

    if model_name == "english":
        model, rows = T3(T3Config()), 2
        step = st.decode_step(model, SamplingParams(), False)
    else:
        model, rows = T3Turbo(NANO if model_name == "nano" else TURBO), 1
        step = turbo.decode_step(model, TurboParams(), False)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    cfg = model.config
    heads, hd = cfg.num_heads, cfg.hidden_size // cfg.num_heads
    kv = [mx.zeros((rows, heads, 256, hd), dtype) for _ in range(2 * cfg.num_layers)]
    seen = mx.zeros((1, cfg.speech_vocab_size), dtype=mx.bool_)
    token, key = mx.array([5]), mx.random.key(1)
    position = mx.array([1, 80], dtype=mx.int32) if model_name == "english" else mx.array(80, dtype=mx.int32)
    mx.eval(kv, seen, token, position, key)
    out = step(token, position, seen, key, kv)
    counts = primitives(out[0], out[1], *out[2])
    return sum(counts.values()), sum(v for k, v in counts.items() if k in VIEWS), dict(counts.most_common())


def host_split(model_name: str, dtype_name: str, tokens: int) -> dict:
    """A decode loop as generate_speech_tokens (English) or generate_turbo_tokens (Turbo, Nano) runs it, with the
    host's time per step in building the compiled step (its arguments: the position array, the draw's slice; then
    the compiled call, MLX's replay of the traced graph), in queueing it (mx.async_eval) and in waiting for the
    token one step behind (.item()): a wait near 0 means the host is the bound, a long wait the device."""
    start, arguments, step = (_english_loop if model_name == "english" else _turbo_loop)(
        model_name, dtype_name, tokens
    )
    result = {}
    for run in range(2):  # the first traces every capacity
        mx.reset_peak_memory()
        token, seen, cache = start()
        mx.async_eval(token)
        args = call = queue = wait = 0.0
        t_start = time.perf_counter()
        for i in range(tokens - 1):
            t0 = time.perf_counter()
            a = arguments(i, token, seen, cache)
            ta = time.perf_counter()
            nxt, seen, cache.kv = step(*a)
            t1 = time.perf_counter()
            mx.async_eval(nxt)
            t2 = time.perf_counter()
            token.item()
            t3 = time.perf_counter()
            args, call, queue, wait = args + ta - t0, call + t1 - ta, queue + t2 - t1, wait + t3 - t2
            token = nxt
        n = tokens - 1
        result = dict(
            ms_step=1000 * (time.perf_counter() - t_start) / n,
            build_ms=1000 * (args + call) / n,
            args_ms=1000 * args / n,
            call_ms=1000 * call / n,
            queue_ms=1000 * queue / n,
            wait_ms=1000 * wait / n,
            peak_mb=mx.get_peak_memory() / 2**20,
        )
    return result


# --- the GPU's own time ---


_SPIN = """
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < 1000ull * us[0]);
    out[0] = 1;
"""


def busy(ms: float) -> mx.array:
    """Keeps the GPU's stream busy for ``ms``: on CUDA one thread spinning on the GPU's global timer (as long
    whatever the clocks do: runs AC1's chain of 8192-wide products spread by milliseconds from round to round);
    elsewhere (a smoke run) a chain of small products."""
    if mx.default_device() == mx.gpu and layers._CUDA:
        kernel = mx.fast.cuda_kernel("spin", ["us"], ["out"], _SPIN)
        us = mx.array([int(1000 * ms)], dtype=mx.uint32)
        return kernel(
            inputs=[us], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.int32]
        )[0]
    y = a = mx.random.normal((256, 256)) * 256**-0.5
    for _ in range(int(ms)):
        y = y @ a
    return y


def behind_a_chain(queue, items: int, rounds: int = 5, busy_ms: float = 50.0) -> dict:
    """The GPU's time per item of what ``queue()`` puts on the stream, apart from the host's: ``queue`` runs
    while ``busy`` keeps the GPU's stream busy for ``busy_ms``, so the wall time past that is the GPU's work.
    Each ``mx.async_eval`` must be one CUDA graph (run with MLX_MAX_OPS_PER_BUFFER=1000000
    MLX_MAX_MB_PER_BUFFER=1000000: MLX holds the host back at 10 graphs in flight). ``queue(prepare=True)``
    makes its inputs before the wait starts. Median of ``rounds`` after a warm-up; valid when the host finished
    queueing before the wait did."""
    chains, totals, queued = [], [], []
    for _ in range(rounds + 1):
        queue(prepare=True)
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(busy(busy_ms))
        chains.append(time.perf_counter() - t0)
        queue(prepare=True)
        mx.synchronize()
        t0 = time.perf_counter()
        mx.async_eval(busy(busy_ms))
        queue(prepare=False)
        queued.append(time.perf_counter() - t0)
        mx.synchronize()
        totals.append(time.perf_counter() - t0)
    per_item = [1e3 * (total - c) / items for total, c in zip(totals[1:], chains[1:])]
    return dict(
        gpu_ms=statistics.median(per_item),
        gpu_ms_rounds=[round(v, 3) for v in per_item],
        busy_ms=1e3 * statistics.median(chains[1:]),
        queued_ms=1e3 * max(queued[1:]),
        valid=max(queued[1:]) < min(chains[1:]),
    )


def gpu_row(cells: list[str], r: dict, unit: float, digits: int, *more: str) -> str:
    """A table row of ``behind_a_chain``'s result: the cells, the GPU's time (times ``unit``) with its rounds,
    ``more`` cells, whether it is valid."""
    rounds = ", ".join(f"{unit * v:.{digits}f}" for v in r["gpu_ms_rounds"])
    timing = f"{unit * r['gpu_ms']:.{digits}f} ({rounds})"
    return "| " + " | ".join([*cells, timing, *more, str(r["valid"])]) + " |"


def device_split(model_name: str, dtype_name: str, steps: int = 8) -> dict:
    """The GPU's time for one decode step (``behind_a_chain``): from a fresh prefill each round, ``steps``
    steps queued as the decode loop queues them (each fed the lazy token of the one before, no wait)."""
    start, arguments, step = (_english_loop if model_name == "english" else _turbo_loop)(
        model_name, dtype_name, steps + 2
    )
    state = {}

    def queue(prepare: bool) -> None:
        if prepare:
            token, seen, cache = start()
            mx.eval(token, seen, cache.kv)
            state.update(token=token, seen=seen, cache=cache)
            return
        token, seen, cache = state["token"], state["seen"], state["cache"]
        for i in range(steps):
            token, seen, cache.kv = step(*arguments(i, token, seen, cache))
            mx.async_eval(token, seen)

    return behind_a_chain(queue, steps)


def gemv_chain(dtype: mx.Dtype, shape: str, layers_count: int = 24, passes: int = 10) -> dict:
    """The GPU's time a projection in a dependent chain of MLPs as a decode step runs them (``project``: the
    norm with the up projection and its activation, then the down projection with the residual), distinct
    weights a layer (read from memory, not L2), ``passes`` times through the layers in one graph, one row: Turbo's GPT-2 MLP (LayerNorm, 1024 -> 4096 GELU ->
    1024, biases) or English's Llama MLP (RMSNorm, 1024 -> 2 x 4096 SwiGLU -> 1024)."""
    import mlx.nn as nn

    d, f = 1024, 4096
    turbo = shape == "turbo"
    mlps = []
    for _ in range(layers_count):
        up = layers.Linear(d, f if turbo else 2 * f, bias=turbo)
        down = layers.Linear(f, d, bias=turbo)
        norm = nn.LayerNorm(d) if turbo else nn.RMSNorm(d)
        for m in (up, down, norm):
            m.set_dtype(dtype)
        mlps.append((norm, up, down))
    x = mx.random.normal((1, 1, d)).astype(dtype)
    mx.eval(x, [[m.parameters() for m in mlp] for mlp in mlps])
    weight_bytes = sum(up.weight.nbytes + down.weight.nbytes for _, up, down in mlps)

    def queue(prepare: bool) -> None:
        if prepare:
            return
        h = x
        for norm, up, down in mlps * passes:
            h = layers.project(
                down, layers.project(up, h, norm=norm, act="gelu" if turbo else "swiglu"), residual=h
            )
        mx.async_eval(h)

    r = behind_a_chain(queue, 2 * layers_count * passes)
    r.update(gb_s=weight_bytes / (2 * layers_count) / (r["gpu_ms"] * 1e-3) / 1e9)
    return r


def _english_loop(model_name: str, dtype_name: str, tokens: int) -> tuple:
    """``host_split``'s start (prefill, first token) and one step for English T3 (CFG, default knobs)."""
    import bench_t3

    from mlx_chatterbox.generation import speech_tokens as st
    from mlx_chatterbox.models.t3 import T3
    from mlx_chatterbox.sampling import SamplingParams

    dtype = getattr(mx, dtype_name)
    model = T3(bench_t3.CFG)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    model = placed(model)
    text, voice = bench_t3.fixed_inputs()[0], bench_t3.t3_voice(dtype)
    params = SamplingParams(max_new_tokens=tokens)
    draws = st.make_draws(params, mx.random.key(0), None)
    step = st.decode_step(model, params, False)

    def start() -> tuple:
        return st.start(model, voice, text, params, draws, False)

    def arguments(i: int, token: mx.array, seen: mx.array, cache) -> tuple:
        position = mx.array([i + 1, cache.claim()], dtype=mx.int32)
        return token, position, seen, draws[i + 1], cache.kv

    return start, arguments, step


def _turbo_loop(model_name: str, dtype_name: str, tokens: int) -> tuple:
    """``host_split``'s start and one step for Turbo or Nano (1 row, Turbo's sampling chain)."""
    import bench_turbo

    from mlx_chatterbox.generation import turbo
    from mlx_chatterbox.models.gpt2 import NANO, TURBO
    from mlx_chatterbox.sampling import TurboParams

    dtype = getattr(mx, dtype_name)
    cfg = NANO if model_name == "nano" else TURBO
    model = placed(bench_turbo.random_t3(cfg, dtype))
    text, prompt = bench_turbo.fixed_t3_inputs()
    speaker = mx.random.normal((1, cfg.speaker_embed_size)).astype(dtype)
    embeds = model.prepare_input_embeds(
        speaker, mx.array([prompt], dtype=mx.int32), mx.array([text], mx.int32)
    )
    params = TurboParams(max_new_tokens=tokens)
    draws = turbo.make_draws(tokens, mx.random.key(0), None)
    step = turbo.decode_step(model, params, False)

    def start() -> tuple:
        logits, cache = model.prefill(embeds)
        seen = mx.zeros((1, cfg.speech_vocab_size), dtype=mx.bool_)
        return mx.argmax(logits, axis=-1).astype(mx.int32), seen, cache

    def arguments(i: int, token: mx.array, seen: mx.array, cache) -> tuple:
        position = mx.array(cache.claim(), dtype=mx.int32)
        return mx.maximum(token, 0), position, seen, draws[i + 1], cache.kv

    return start, arguments, step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", default="micro,step")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--rounds", type=int, default=1, help="step: every row this many times, one round after another"
    )
    parser.add_argument("--systems", default="mlx-ops,ours,upstream")
    parser.add_argument("--upstream-src", help="folder holding upstream's chatterbox/ (bench_t3.py)")
    parser.add_argument("--out", help="append JSON lines here")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--models", default="english,turbo,nano")
    parser.add_argument("--device", default="gpu", help="cpu: a smoke test of the script")
    parser.add_argument(
        "--old-attention",
        action="store_true",
        help="the decode attention kernel as before 2026-12-02: one key per warp at a time, 4 warps a block",
    )
    parser.add_argument("--steps", type=int, default=8, help="device: decode steps queued behind the wait")
    parser.add_argument(
        "--gemv-loads", type=int, default=layers.GEMV_LOADS, help="loads a matrix-vector lane has in flight"
    )
    parser.add_argument(
        "--decode-unroll",
        type=int,
        default=layers.DECODE_UNROLL,
        help="keys a decode attention warp loads at once",
    )
    parser.add_argument(
        "--layer-blocks", type=int, help="thread blocks of the layer kernel (default: the GPU's SM count)"
    )
    args = parser.parse_args()
    known = ("mlx-ops", *OURS, "upstream")
    unknown = set(args.systems.split(",")) - set(known)
    if unknown:
        parser.error(f"unknown --systems {sorted(unknown)}: {', '.join(known)}")
    layers.GEMV_LOADS, layers.DECODE_UNROLL = args.gemv_loads, args.decode_unroll
    if args.old_attention:
        layers.DECODE_UNROLL, layers.DECODE_WIDE_BLOCKS = 1, 0
    layers.LAYER_BLOCKS = args.layer_blocks
    mx.set_default_device(getattr(mx, args.device))
    parts = args.part.split(",")
    dtypes = args.dtypes.split(",")
    if "micro" in parts:
        for dn in dtypes:
            dtype = getattr(mx, dn)
            print(f"kernel gemv rel. error {dn}: {check_kernel(dtype):.2e}", flush=True)
            print(f"\n| {dn}: primitive | us each |\n|---|---|")
            for name, us in micro(dtype):
                print(f"| {name} | {us:.1f} |", flush=True)
    if ("device" in parts or "gemv" in parts) and int(
        os.environ.get("MLX_MAX_OPS_PER_BUFFER", "0")
    ) < 100_000:
        parser.error(
            "--part device and gemv need MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=1000000"
        )

    def each_system(part: str, measure, **extra):
        """(model, dtype, system, result) for each of --models x --dtypes x --systems but upstream: measured
        by ``measure(model, dtype)`` under the system's switches, written out as a row."""
        for model, dn in [(m, d) for m in args.models.split(",") for d in dtypes]:
            for system in args.systems.replace(",upstream", "").replace("upstream", "").split(","):
                use(system)
                r = measure(model, dn)
                gc.collect()
                mx.clear_cache()
                use("ours")
                knobs = dict(gemv_loads=layers.GEMV_LOADS, decode_unroll=layers.DECODE_UNROLL)
                row = dict(part=part, model=model, dtype=dn, system=system, **knobs, **extra, **r)
                write_line(row, args.out)
                yield model, dn, system, r

    if "gemv" in parts:
        print(
            "\n| MLP | dtype | system | GPU us a projection (rounds) | GB/s | valid |\n|---|---|---|---|---|---|"
        )
        for shape, dn in [(s, d) for s in ("turbo", "english") for d in dtypes]:
            for system in ("ours", "mlx-ops"):
                use(system)
                r = gemv_chain(getattr(mx, dn), shape)
                use("ours")
                write_line(dict(part="gemv", mlp=shape, dtype=dn, system=system, **r), args.out)
                print(gpu_row([shape, dn, system], r, 1e3, 1, f"{r['gb_s']:.0f}"), flush=True)
    if "device" in parts:
        print(
            "\n| model | dtype | system | GPU ms a step (rounds) | busy ms | queued ms | valid |\n|---|---|---|---|---|---|---|"
        )
        measure = partial(device_split, steps=args.steps)
        for model, dn, system, r in each_system("device", measure, steps=args.steps):
            more = f"{r['busy_ms']:.0f}", f"{r['queued_ms']:.1f}"
            print(gpu_row([model, dn, system], r, 1, 3, *more), flush=True)
    if "split" in parts:
        print(
            "\n| model | dtype | system | ms/step | build ms (arguments + call) | queue ms | wait ms | peak MiB |"
            "\n|---|---|---|---|---|---|---|---|"
        )
        measure = partial(host_split, tokens=args.tokens)
        for model, dn, system, r in each_system("split", measure, tokens=args.tokens):
            print(
                f"| {model} | {dn} | {system} | {r['ms_step']:.2f} | {r['build_ms']:.2f} ({r['args_ms']:.2f} + "
                f"{r['call_ms']:.2f}) | {r['queue_ms']:.2f} | {r['wait_ms']:.2f} | {r['peak_mb']:.0f} |",
                flush=True,
            )
    if "step" in parts:
        if {"ours-loaded-weights", "ours-loaded-copied"} & set(args.systems.split(",")):
            parser.error(
                "--part step builds its models in bench_t3 and bench_turbo: ours-loaded-weights and "
                "ours-loaded-copied apply to the split and device parts (and probe_kernels.py)"
            )
        rows = []
        combos = [
            (m, d, s)
            for _ in range(args.rounds)
            for m in args.models.split(",")
            for d in dtypes
            for s in args.systems.split(",")
        ]
        for model, dn, system in combos:
            if system == "upstream" and model == "nano" and dn != "float32":
                continue
            r = step_row(model, dn, system, args.tokens, args.repeats, args.upstream_src)
            prims = views = kinds = None
            if system != "upstream":
                prims, views, kinds = step_primitives(model, getattr(mx, dn))
            in_place = layers.CUDA_DECODE and layers.KV_IN_PLACE  # as use(system) set them
            fused = (
                in_place and layers.FUSED_LAYERS["llama" if model == "english" else "gpt2"] and layers._CUDA
            )
            use("ours")
            row = dict(model=model, dtype=dn, system=system, primitives_per_step=prims, views_per_step=views)
            row |= dict(
                **r,
                primitive_kinds=kinds,
                kv_in_place=in_place,
                decode_attention="old" if args.old_attention else "new",
                gemv_loads=layers.GEMV_LOADS,
                decode_unroll=layers.DECODE_UNROLL,
                layer_kernel_blocks=(layers.LAYER_BLOCKS or layers._sm_count()) if fused else None,
            )
            rows.append(row)
            write_line(row, args.out)
            gc.collect()  # a model's compiled steps hold it in a cycle: free it before the next row
            mx.clear_cache()
        print(
            "\n| model | dtype | system | prefill ms | tok/s | ms/step | primitives/step (views) |"
            "\n|---|---|---|---|---|---|---|"
        )
        for r in rows:
            prims = f"{r['primitives_per_step']} ({r['views_per_step']})" if r["primitives_per_step"] else "-"
            print(
                f"| {r['model']} | {r['dtype']} | {r['system']} | {r['prefill_ms']:.1f} | {r['decode_tok_s']:.1f} | "
                f"{r['ms_per_step']:.2f} | {prims} |"
            )


if __name__ == "__main__":
    main()
