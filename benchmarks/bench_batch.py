"""Continuous batching over T3 (generation/batch.py): aggregate speech tokens/s and the time of one decode step at
several numbers of concurrent requests, against the single-request loop on the same model.

Full-size English T3 with random weights (as bench_t3.py), every request with CFG (2 rows), its own seed and the
same 40-token text, EOS disabled so that every request decodes exactly ``--tokens`` tokens; all requests join at
once. One warm-up run per concurrency (it traces the compiled step for each batch shape) is excluded; the median of
``--repeats`` runs is reported.

    python benchmarks/bench_batch.py --concurrency 1,8,32,64 --tokens 100 --device gpu --out benchmarks/out/batch.jsonl

--profile splits one step at each concurrency into its parts, each compiled alone on the batch's real state and
timed both waited for (host + device: a step's latency) and queued back to back (whichever of host and device is
slower): T3's decode of all rows, and the logits chain with the draws.
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import mlx_chatterbox  # noqa: F401  isort: skip  (before mlx.core: see _backend.py)
from mlx_chatterbox import _backend  # isort: skip

import argparse
import dataclasses
import functools
import random
import statistics
import threading
import time

import mlx.core as mx
from bench_t3 import EXAGGERATION, KNOBS, OUR_DTYPES, fixed_inputs
from common import cache_step, machine_info, set_cache_step, write_line

from mlx_chatterbox.generation.batch import BatchRequest, SpeechTokenBatch
from mlx_chatterbox.generation.speech_tokens import generate_speech_tokens
from mlx_chatterbox.generation.voice import Voice
from mlx_chatterbox.models import layers
from mlx_chatterbox.models.t3 import T3, T3Config
from mlx_chatterbox.sampling import SamplingParams, draw_rows, process_rows

TINY = T3Config(
    hidden_size=64, num_layers=2, num_heads=4, head_dim=16, intermediate_size=128
)  # --tiny: a smoke run


def build(cfg: T3Config, dtype_name: str) -> tuple[T3, Voice, list[int], SamplingParams]:
    mx.random.seed(0)
    model = T3(cfg)
    float_name, transform = OUR_DTYPES[dtype_name]
    dtype = getattr(mx, float_name)
    model.set_dtype(dtype)
    if transform is not None:
        transform(model)
    mx.eval(model.parameters())
    text, prompt = fixed_inputs()
    voice = Voice(
        speaker_emb=mx.random.normal((1, cfg.speaker_embed_size)).astype(dtype),  # the KV cache's dtype
        t3_prompt_tokens=mx.array([prompt], dtype=mx.int32),
        s3gen_prompt_tokens=mx.zeros((1, 4), dtype=mx.int32),  # S3Gen parts: unused by T3
        s3gen_prompt_mel=mx.zeros((1, 8, 80)),
        xvector=mx.zeros((1, 192)),
    )
    return model, voice, text, SamplingParams(exaggeration=EXAGGERATION, **KNOBS)


def run_batch(
    model: T3, voice: Voice, text: list[int], params: SamplingParams, n: int
) -> tuple[float, float, float]:
    """n requests at once: (seconds from the first step to the last token, median seconds per decode step,
    seconds of the first step, which prefills the n requests together)."""
    batch = SpeechTokenBatch(model, stop_on_eos=False)
    for seed in range(n):
        batch.add(BatchRequest(text, voice, params, key=mx.random.key(seed)))
    stamps = [time.perf_counter()]
    while len(batch):
        batch.step()
        stamps.append(time.perf_counter())
    steps = [b - a for a, b in zip(stamps[1:-1], stamps[2:])]  # the first step holds the n prefills
    return stamps[-1] - stamps[0], statistics.median(steps), stamps[1] - stamps[0]


def run_closed_loop(
    model: T3,
    voice: Voice,
    text: list[int],
    params: SamplingParams,
    n: int,
    total: int,
    traces: list,
    seed: int,
) -> dict:
    """``n`` requests at a time until ``total`` have run, each finished one replaced before the next step, as
    in a server's full batch: budgets uniform in tokens/2 .. 3·tokens/2 and texts of 10 .. 40 tokens (drawn
    from ``seed``), EOS disabled. ``traces`` grows by one for each trace of the step (``counting_traces``)."""
    rng = random.Random(seed)
    batch = SpeechTokenBatch(model, stop_on_eos=False)
    sent, tokens, joins, steady = 0, 0, [], []
    traced = len(traces)

    def add() -> None:
        nonlocal sent
        budget = rng.randint(params.max_new_tokens // 2, 3 * params.max_new_tokens // 2)
        request_params = SamplingParams(**{**params.__dict__, "max_new_tokens": budget})
        batch.add(BatchRequest(text[: rng.randint(10, 40)], voice, request_params, key=mx.random.key(sent)))
        sent += 1

    for _ in range(n):
        add()
    start = time.perf_counter()
    while len(batch):
        joining = bool(batch._pending)
        t = time.perf_counter()
        out = batch.step()
        (joins if joining else steady).append(time.perf_counter() - t)
        tokens += len(out)
        for _ in range(sum(finished for _, _, finished in out)):
            if sent < total:
                add()
    wall = time.perf_counter() - start
    return dict(
        tok_s=tokens / wall,
        steps=len(joins) + len(steady),
        traces=len(traces) - traced,
        step_ms=1000 * statistics.median(steady),
        join_step_ms=1000 * statistics.median(joins[1:]) if len(joins) > 1 else None,  # the first prefills n
        join_steps=len(joins),
    )


def counting_traces(model: T3) -> list:
    """A list that grows by one each time ``model``'s batched decode is traced (the wrapper runs only then)."""
    traces, decode_window = [], model.decode_window

    def counted(*args):
        traces.append(args[4][0].shape)
        return decode_window(*args)

    model.decode_window = counted
    return traces


def on_a_thread(fn, *args):
    """``fn(*args)`` on a new thread whose default stream is a new MLX stream (``Worker._loop``'s set-up)."""
    out = []

    def target():
        mx.set_default_stream(mx.new_stream(mx.default_device()))
        try:
            out.append(fn(*args))
        finally:
            mx.synchronize()
            mx.clear_streams()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return out[0]


def run_single(model: T3, voice: Voice, text: list[int], params: SamplingParams) -> float:
    start = time.perf_counter()
    tokens = list(generate_speech_tokens(model, voice, text, params, key=mx.random.key(0), stop_on_eos=False))
    assert len(tokens) == params.max_new_tokens
    return time.perf_counter() - start


def profile(
    model: T3, voice: Voice, text: list[int], params: SamplingParams, n: int, iters: int = 20
) -> dict:
    """ms per call of a step's parts at n requests, after ``params.max_new_tokens // 2`` real steps."""
    batch = SpeechTokenBatch(model, stop_on_eos=False)
    for seed in range(n):
        batch.add(BatchRequest(text, voice, params, key=mx.random.key(seed)))
    for _ in range(params.max_new_tokens // 2):
        batch.step()
    layout, cache = batch._layout, batch._cache
    rows = layout["row_request"]
    tokens, drawn = batch._tokens[rows], batch._drawn[rows]
    # Rewrites the last position: same work, same shapes. The big buffers are read only (BatchKVCache's window).
    at = mx.array([cache.offset - 1, cache.base], dtype=mx.int32)
    decode = mx.compile(lambda w: model.decode_window(tokens, drawn, at, layout["pad"], cache.kv, w))
    logits = decode(cache.window)[0]
    knobs = layout["knobs"]
    keys = layout["keys"][:, 0]

    def chain(x: mx.array) -> mx.array:
        uses = batch._uses
        x = process_rows(
            x, layout["cond"], layout["uncond"], batch._seen, knobs, min_p=uses[0], top_p=uses[1]
        )
        return draw_rows(
            x, knobs["greedy"], keys, layout["uniforms"][:, 0], layout["by_uniform"], kinds=uses[2:]
        )

    sample = mx.compile(chain)
    mx.eval(logits, sample(logits))

    def timed(fn, state, waited: bool) -> float:
        start = time.perf_counter()
        for _ in range(iters):
            state = fn(state)
            (mx.eval if waited else mx.async_eval)(state)
        mx.eval(state)
        return 1000 * (time.perf_counter() - start) / iters

    out = {}
    for waited in (True, False):
        tag = "waited" if waited else "queued"
        out[f"decode_ms_{tag}"] = timed(lambda w: decode(w)[1], cache.window, waited)
        # The next call's logits depend on this call's draw, so that queued calls run one after the other.
        out[f"sample_ms_{tag}"] = timed(lambda x: x + sample(x)[:1, None].astype(x.dtype) * 0, logits, waited)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated request counts")
    parser.add_argument("--tokens", type=int, default=100, help="speech tokens per request")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument(
        "--dtype", choices=sorted(OUR_DTYPES), default="float32", help="T3's weights and cache"
    )
    parser.add_argument("--profile", action="store_true", help="also time a step's parts (see above)")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny T3 instead of the full size (a smoke run)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        help="T3's layers (default: 30, or 2 with --tiny): e.g. --tiny --layers 30 traces a step as long as the "
        "real one's on a CPU",
    )
    parser.add_argument(
        "--mlx-ops",
        action="store_true",
        help="MLX's own ops on CUDA (models/layers.py CUDA_DECODE off: before ADR 12)",
    )
    parser.add_argument(
        "--decode-attention",
        choices=("new", "old"),
        default="new",
        help="the CUDA decode attention kernel: old = one key per warp at a time, 4 warps a block (before "
        "2026-12-02's unrolled, 16-warp form)",
    )
    parser.add_argument(
        "--slice-update",
        action="store_true",
        help="write each step's keys and values with two slice_updates a layer (layers.KV_IN_PLACE off: before "
        "2026-12-04, when our kernels began writing them in place on CUDA)",
    )
    parser.add_argument(
        "--thread",
        action="store_true",
        help="run the batches on a thread of their own with its own MLX stream, as the server's worker does",
    )
    parser.add_argument(
        "--closed-loop",
        type=int,
        metavar="TOTAL",
        help="instead of requests that join at once: each concurrency as a closed loop of TOTAL requests of "
        "budgets tokens/2 .. 3*tokens/2 and texts of 10 .. 40 tokens, as a server's batch runs; run twice, "
        "cold and then warm (other draws: the shapes met before are traced already)",
    )
    parser.add_argument(
        "--cache-step",
        type=cache_step,
        default=256,
        help="T3's KV capacity grows this many positions at a time (default 256, the library's)",
    )
    parser.add_argument("--out", help="append JSON lines here")
    args = parser.parse_args(argv)
    set_cache_step(args.cache_step)
    layers.CUDA_DECODE = not args.mlx_ops
    layers.KV_IN_PLACE = not args.slice_update
    if args.decode_attention == "old":
        layers.DECODE_UNROLL, layers.DECODE_WIDE_BLOCKS = 1, 0
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    cfg = TINY if args.tiny else T3Config()
    if args.layers is not None:
        if args.layers < 1:
            parser.error(f"--layers {args.layers}: at least 1")
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    model, voice, text, params = build(cfg, args.dtype)
    params = SamplingParams(**{**params.__dict__, "max_new_tokens": args.tokens})
    info = machine_info()

    def record(row: dict) -> None:
        # Each row is written as soon as it is measured, so that a run cut short keeps what it measured.
        rows.append(row)
        line = dict(
            bench="batch",
            tokens=args.tokens,
            dtype=args.dtype,
            tiny=args.tiny,
            layers=cfg.num_layers,
            mlx_ops=args.mlx_ops,
            decode_attention=args.decode_attention,
            kv_in_place=not args.slice_update,
            thread=args.thread,
            cache_step=args.cache_step,
            **row,
        )
        write_line(dict(**line, machine=info, backend=_backend.STATUS), args.out)

    rows: list[dict] = []
    run_single(model, voice, text, params)  # warm-up
    single = statistics.median(run_single(model, voice, text, params) for _ in range(args.repeats))
    record(
        dict(
            system="single loop", requests=1, tok_s=args.tokens / single, step_ms=1000 * single / args.tokens
        )
    )
    if args.closed_loop:
        traces = counting_traces(model)
        for n in (int(c) for c in args.concurrency.split(",")):
            loop = functools.partial(run_closed_loop, model, voice, text, params, n, args.closed_loop, traces)
            for seed, run in enumerate(("cold", "warm")):
                row = on_a_thread(loop, seed) if args.thread else loop(seed)
                record(dict(system=f"closed loop, {run}", requests=n, total=args.closed_loop, **row))
        print(
            "\n| closed loop | requests | tok/s | steps | traces | ms per step | with a join | join steps |"
        )
        print("|---" * 8 + "|")
        for row in rows[1:]:
            cells = [f"{row['tok_s']:.1f}", row["steps"], row["traces"], f"{row['step_ms']:.2f}"]
            cells += [f"{row['join_step_ms']:.2f}" if row["join_step_ms"] else "", row["join_steps"]]
            print(f"| {row['system']} | {row['requests']} | {' | '.join(map(str, cells))} |")
        return
    for n in (int(c) for c in args.concurrency.split(",")):
        run = run_batch if not args.thread else functools.partial(on_a_thread, run_batch)
        run(model, voice, text, params, n)  # warm-up: traces the step for this batch's shapes
        mx.reset_peak_memory()
        runs = [run(model, voice, text, params, n) for _ in range(args.repeats)]
        total = statistics.median(r[0] for r in runs)
        record(
            dict(
                system="batch",
                requests=n,
                tok_s=n * args.tokens / total,
                step_ms=1000 * statistics.median(r[1] for r in runs),
                prefill_ms=1000 * statistics.median(r[2] for r in runs),
                peak_mem_bytes=mx.get_peak_memory(),
                **(profile(model, voice, text, params, n) if args.profile else {}),
            )
        )
    parts = ["prefill_ms"] + [k for k in rows[-1] if k.endswith(("_waited", "_queued"))]
    print(f"\n| system | requests | aggregate tok/s | ms per step | {' | '.join(parts)} |")
    print("|---" * (4 + len(parts)) + "|")
    for row in rows:
        cells = [f"{row[k]:.2f}" if k in row else "" for k in parts]
        print(
            f"| {row['system']} | {row['requests']} | {row['tok_s']:.1f} | {row['step_ms']:.2f} | {' | '.join(cells)} |"
        )


if __name__ == "__main__":
    main()
