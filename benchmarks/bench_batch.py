"""Continuous batching over T3 (generation/batch.py): aggregate speech tokens/s and the time of one decode step at
several numbers of concurrent requests, against the single-request loop on the same model.

Full-size English T3 with random weights (as bench_t3.py), every request with CFG (2 rows), its own seed and the
same 40-token text, EOS disabled so that every request decodes exactly ``--tokens`` tokens; all requests join at
once. One warm-up run per concurrency (it traces the compiled step for each batch shape) is excluded; the median of
``--repeats`` runs is reported.

    python benchmarks/bench_batch.py --concurrency 1,8,32,64 --tokens 100 --device gpu --out benchmarks/out/batch.jsonl
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import mlx_chatterbox  # noqa: F401  isort: skip  (before mlx.core: see _backend.py)
from mlx_chatterbox import _backend  # isort: skip

import argparse
import statistics
import time

import mlx.core as mx
from bench_t3 import EXAGGERATION, KNOBS, fixed_inputs
from common import machine_info, write_line

from mlx_chatterbox.generation.batch import BatchRequest, SpeechTokenBatch
from mlx_chatterbox.generation.speech_tokens import generate_speech_tokens
from mlx_chatterbox.generation.voice import Voice
from mlx_chatterbox.models.t3 import T3, T3Config
from mlx_chatterbox.sampling import SamplingParams

TINY = T3Config(
    hidden_size=64, num_layers=2, num_heads=4, head_dim=16, intermediate_size=128
)  # --tiny: a smoke run


def build(cfg: T3Config) -> tuple[T3, Voice, list[int], SamplingParams]:
    mx.random.seed(0)
    model = T3(cfg)
    mx.eval(model.parameters())
    text, prompt = fixed_inputs()
    voice = Voice(
        speaker_emb=mx.random.normal((1, cfg.speaker_embed_size)),
        t3_prompt_tokens=mx.array([prompt], dtype=mx.int32),
        s3gen_prompt_tokens=mx.zeros((1, 4), dtype=mx.int32),  # S3Gen parts: unused by T3
        s3gen_prompt_mel=mx.zeros((1, 8, 80)),
        xvector=mx.zeros((1, 192)),
    )
    return model, voice, text, SamplingParams(exaggeration=EXAGGERATION, **KNOBS)


def run_batch(
    model: T3, voice: Voice, text: list[int], params: SamplingParams, n: int
) -> tuple[float, float]:
    """n requests at once: (seconds from the first step to the last token, median seconds per decode step)."""
    batch = SpeechTokenBatch(model, stop_on_eos=False)
    for seed in range(n):
        batch.add(BatchRequest(text, voice, params, key=mx.random.key(seed)))
    stamps = [time.perf_counter()]
    while len(batch):
        batch.step()
        stamps.append(time.perf_counter())
    steps = [b - a for a, b in zip(stamps[1:-1], stamps[2:])]  # the first step holds the n prefills
    return stamps[-1] - stamps[0], statistics.median(steps)


def run_single(model: T3, voice: Voice, text: list[int], params: SamplingParams) -> float:
    start = time.perf_counter()
    tokens = list(generate_speech_tokens(model, voice, text, params, key=mx.random.key(0), stop_on_eos=False))
    assert len(tokens) == params.max_new_tokens
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated request counts")
    parser.add_argument("--tokens", type=int, default=100, help="speech tokens per request")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny T3 instead of the full size (a smoke run)"
    )
    parser.add_argument("--out", help="append JSON lines here")
    args = parser.parse_args(argv)
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    model, voice, text, params = build(TINY if args.tiny else T3Config())
    params = SamplingParams(**{**params.__dict__, "max_new_tokens": args.tokens})
    info = machine_info()
    run_single(model, voice, text, params)  # warm-up
    single = statistics.median(run_single(model, voice, text, params) for _ in range(args.repeats))
    rows = [
        dict(
            system="single loop", requests=1, tok_s=args.tokens / single, step_ms=1000 * single / args.tokens
        )
    ]
    for n in (int(c) for c in args.concurrency.split(",")):
        run_batch(model, voice, text, params, n)  # warm-up: traces the step for this batch's shapes
        mx.reset_peak_memory()
        runs = [run_batch(model, voice, text, params, n) for _ in range(args.repeats)]
        total = statistics.median(r[0] for r in runs)
        step = statistics.median(r[1] for r in runs)
        rows.append(
            dict(
                system="batch",
                requests=n,
                tok_s=n * args.tokens / total,
                step_ms=1000 * step,
                peak_mem_bytes=mx.get_peak_memory(),
            )
        )
    for row in rows:
        write_line(
            dict(
                bench="batch",
                tokens=args.tokens,
                tiny=args.tiny,
                **row,
                machine=info,
                backend=_backend.STATUS,
            ),
            args.out,
        )
    print(f"\n| system | requests | aggregate tok/s | ms per step |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['system']} | {row['requests']} | {row['tok_s']:.1f} | {row['step_ms']:.2f} |")


if __name__ == "__main__":
    main()
