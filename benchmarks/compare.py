"""The whole comparison in one command: T3 (ours at every precision bench_t3.py supports, upstream fp32 and bf16,
mlx-audio), S3Gen (ours, upstream, mlx-audio) and end to end (ours, upstream). Each benchmark runs in its own
subprocess and writes JSON lines; this script collects them into ``--out`` and prints one markdown table, then
a second one: the memory-bandwidth bound on Apple chips (an estimate, not a measurement).

    python benchmarks/compare.py --preset gpu --out benchmarks/out/compare.jsonl   # H200: about 8 minutes
    python benchmarks/compare.py --preset cpu                                      # a small CPU: T3 N = 30, ...

Upstream always runs in a process without our OpenBLAS preload (MLX_CHATTERBOX_BLAS=off), which on a CPU would
slow it down (see RESULTS.md), and with glibc's default allocator (MLX_CHATTERBOX_MALLOC=off). This script
imports neither MLX nor torch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import machine_info

HERE = Path(__file__).resolve().parent
PRESETS = {
    # The sizes: 300 decoded tokens; a 10 s prompt and 10 s of output for S3Gen and end to end.
    "gpu": dict(
        device=["--device", "gpu", "--torch-device", "cuda"],
        t3_tokens=300,
        t3_repeats=3,
        t3_ours=None,  # every dtype bench_t3.py lists for ours
        t3_upstream="float32,bfloat16",
        t3_peer="float32",
        s3gen_prompt=250,
        s3gen_tokens=250,
        s3gen_repeats=3,
        s3gen_variants="default,bf16-cfm",
        e2e_tokens=250,
        e2e_clip=10.0,
        e2e_repeats=3,
    ),
    # Small enough for 2 CPU cores in about 10 minutes; MLX's bf16 CPU matmuls are unoptimised: fp32 only.
    "cpu": dict(
        device=["--device", "cpu", "--torch-device", "cpu"],
        t3_tokens=30,
        t3_repeats=1,
        t3_ours="float32",
        t3_upstream="float32",
        t3_peer="float32",
        s3gen_prompt=40,
        s3gen_tokens=40,
        s3gen_repeats=1,
        s3gen_variants="default",
        e2e_tokens=30,
        e2e_clip=3.0,
        e2e_repeats=1,
    ),
}
NAMES = {"ours": "mlx-chatterbox", "upstream": "upstream (PyTorch)", "mlx-audio": "mlx-audio"}
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

# --- the bandwidth bound (full-size English T3: Llama-520M, CFG batch 2) ---
HIDDEN, LAYERS, HEADS, HEAD_DIM, INTERMEDIATE, SPEECH_VOCAB = 1024, 30, 16, 64, 4096, 8194
PREFILL_LEN = 78  # bench_t3.PREFILL_LEN: 34 conditioning + 42 text + 2 start-of-speech positions
BATCH = 2
# GB/s of unified memory, from Apple's specifications.
APPLE = {
    "M1": 68,
    "M1 Pro": 200,
    "M1 Max": 400,
    "M2 Ultra": 800,
    "M3 Max": 400,
    "M4": 120,
    "M4 Pro": 273,
    "M4 Max": 546,
}
# bytes per matrix weight, and the dtype of everything else (norms, embeddings, KV cache). Quantized: MLX's
# affine quantization, a float scale and bias per group of 64 weights.
PRECISIONS = {"fp32": (4.0, 4), "bf16": (2.0, 2), "q8": (1 + 4 / 64, 2), "q4": (0.5 + 4 / 64, 2)}


def decode_bytes(precision: str, tokens: int) -> float:
    """Bytes one decode step reads: every matrix of the 30 layers and the speech head, the norms, two embedding
    rows, and the KV cache at the average context of a ``tokens``-token utterance (as bench_t3 counts them).
    """
    per_weight, item = PRECISIONS[precision]
    matrices = LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE) + SPEECH_VOCAB * HIDDEN
    vectors = (2 * LAYERS + 1) * HIDDEN + 2 * HIDDEN
    kv = LAYERS * 2 * BATCH * HEADS * (PREFILL_LEN + tokens / 2) * HEAD_DIM * item
    return matrices * per_weight + vectors * item + kv


def bandwidth_table(rows: list[dict], tokens: int) -> str:
    measured = {
        SHORT.get(r["dtype"], r["dtype"]): r["bytes_per_step"]
        for r in rows
        if r.get("bench") == "t3" and r["system"] == "ours"
    }
    head = ["precision", "GB / step", "bench_t3 GB / step (at its N)", "GB / audio s"] + [
        f"{m} ({bw} GB/s)" for m, bw in APPLE.items()
    ]
    lines = [
        f"Bandwidth-bound estimate, not a measurement: decode tok/s <= memory bandwidth / bytes read per step "
        f"(T3 weights + KV cache at the average context of a {tokens}-token (10 s) utterance, CFG batch 2). "
        "Real-time speech needs 25 tok/s; per-step overheads keep measured speeds below these bounds.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for precision in PRECISIONS:
        b = decode_bytes(precision, tokens)
        got = measured.get(precision)
        cells = [
            precision,
            f"{b / 1e9:.3f}",
            "-" if got is None else f"{got / 1e9:.3f}",
            f"{25 * b / 1e9:.1f}",
        ]
        cells += [f"{bw * 1e9 / b:.0f}" for bw in APPLE.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- running the benchmarks ---


def run(label: str, args: list[str], upstream: bool, timeout: int, log: list[dict]) -> list[dict]:
    """One benchmark in its own process; its JSON lines (stdout), each tagged with ``bench``. Its stderr passes
    through. A failure is recorded and the run goes on (unattended)."""
    env = dict(os.environ)
    if upstream:  # upstream as its users run it: none of our process-wide settings (_backend.py)
        env.update(MLX_CHATTERBOX_BLAS="off", MLX_CHATTERBOX_MALLOC="off")
    cmd = [sys.executable, str(HERE / args[0]), *args[1:]]
    print(f"\n## {label}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=timeout)
        out, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    bench = label.split()[0]
    for r in rows:
        r["bench"] = bench
    log.append(dict(job=label, rc=rc, wall_s=round(wall, 1), rows=len(rows)))
    print(f"## {label}: rc={rc}, {wall:.0f} s, {len(rows)} rows", file=sys.stderr, flush=True)
    return rows


def our_dtypes() -> str:
    """The --dtype names bench_t3.py supports for ours (float and, once added, quantized)."""
    out = subprocess.run(
        [sys.executable, str(HERE / "bench_t3.py"), "--list-dtypes"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def has_perth() -> bool:
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('perth') is None)"
    return subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- the table ---


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def mib(row: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("peak_mem_bytes") is not None:
        return f"{row['peak_mem_bytes'] / 2**20:.0f}"
    return f"{row['rss_peak_mib']:.0f} (RSS)" if row.get("rss_peak_mib") is not None else "-"


def main_table(rows: list[dict]) -> str:
    t3 = [r for r in rows if r["bench"] == "t3"]
    # ours' default variant (the others are in s3gen_table)
    s3gen = {
        r["system"]: r
        for r in rows
        if r["bench"] == "s3gen" and r["system"] in NAMES and r.get("variant", "default") in ("default", "-")
    }
    e2e = {r["system"]: r for r in rows if r["bench"] == "e2e"}

    def tok_s(system: str, dtype: str = "float32") -> float | None:
        return next((r["decode_tok_s"] for r in t3 if r["system"] == system and r["dtype"] == dtype), None)

    up, peer = tok_s("upstream"), tok_s("mlx-audio")
    head = [
        "system",
        "precision",
        "T3 prefill ms",
        "decode tok/s",
        "x vs upstream",
        "x vs mlx-audio",
        "S3Gen RTF",
        "E2E s",
        "voice s",
        "T3 peak MiB",
        "S3Gen peak MiB",
        "E2E peak MiB",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {"ours": 0, "upstream": 1, "mlx-audio": 2}
    seen = set()
    for r in sorted(t3, key=lambda r: order[r["system"]]):
        # S3Gen and E2E run in fp32: their numbers sit on each system's fp32 row.
        fp32 = r["dtype"] == "float32"
        seen.update([r["system"]] if fp32 else [])
        s, e = (s3gen.get(r["system"]), e2e.get(r["system"])) if fp32 else (None, None)
        cells = [
            NAMES[r["system"]],
            SHORT.get(r["dtype"], r["dtype"]),
            fmt(r["prefill_ms"], ".1f"),
            fmt(r["decode_tok_s"], ".1f"),
            "-" if not up else f"{r['decode_tok_s'] / up:.2f}x",
            "-" if not peer else f"{r['decode_tok_s'] / peer:.2f}x",
            fmt(s and s["rtf"], ".4f"),
            fmt(e and e["total_s"], ".3f"),
            fmt(e and e["voice_s"], ".3f"),
            mib(r),
            mib(s),
            mib(e),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for system in sorted((set(s3gen) | set(e2e)) - seen, key=order.get):  # no fp32 T3 row (failed or skipped)
        s, e = s3gen.get(system), e2e.get(system)
        cells = [NAMES[system], "fp32"] + ["-"] * 4
        cells += [fmt(s and s["rtf"], ".4f"), fmt(e and e["total_s"], ".3f"), fmt(e and e["voice_s"], ".3f")]
        cells += ["-", mib(s), mib(e)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def s3gen_table(rows: list[dict]) -> str:
    """Every S3Gen row, ours' variants included, with the stage times."""
    head = ["system", "variant", "total ms", "RTF", "encoder ms", "CFM ms/step", "HiFT ms", "peak MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in (r for r in rows if r["bench"] == "s3gen" and r["system"] in NAMES):
        cells = [
            NAMES[r["system"]],
            r.get("variant", "-"),
            fmt(r.get("total_ms"), ".1f"),
            fmt(r.get("rtf"), ".4f"),
        ]
        cells += [fmt(r.get(k), ".1f") for k in ("encoder_ms", "cfm_step_ms", "hift_ms")] + [mib(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(rows: list[dict], preset: dict, info: dict, log: list[dict], watermark: bool) -> str:
    e2e_up = next((r for r in rows if r["bench"] == "e2e" and r["system"] == "upstream"), None)
    device = info["gpu"] or info["cpu"]
    notes = [
        f"Machine: {device} ({info['platform']}); versions {info['versions']}; commit {info['commit']}; "
        f"{info['date']}.",
        f"T3: full-size English T3, random weights, CFG batch 2, upstream's default knobs, EOS disabled, "
        f"N = {preset['t3_tokens']} tokens, median of {preset['t3_repeats']} after a warm-up. "
        "x vs upstream / mlx-audio: decode tok/s over theirs at fp32 (their default).",
        f"S3Gen: prompt {preset['s3gen_prompt']} + {preset['s3gen_tokens']} new tokens "
        f"({preset['s3gen_tokens'] * 0.04:g} s of audio), 10 CFM steps; RTF = time / audio.",
        f"E2E: text -> wav with a voice cloned from a {preset['e2e_clip']:g} s clip, {preset['e2e_tokens']} tokens "
        f"({preset['e2e_tokens'] * 0.04:g} s of audio), watermark {'on' if watermark else 'off on both'}; "
        "'E2E s' per request, 'voice s' to clone the voice (once per voice).",
        "Peak MiB: MLX peak memory or torch.cuda.max_memory_allocated, weights included; '(RSS)' where a CPU "
        "run has only its process's peak resident memory.",
    ]
    if e2e_up is not None and e2e_up.get("perth_stub"):
        notes.append("Upstream E2E ran without perth installed: its watermark was an identity stand-in.")
    failed = [j for j in log if j["rc"] != 0]
    if failed:
        notes.append(
            "Failed jobs (see stderr above): " + "; ".join(f"{j['job']} (rc {j['rc']})" for j in failed)
        )
    return "\n".join(f"- {n}" for n in notes)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), required=True, help="sizes and devices")
    p.add_argument("--skip", default="", help="comma list of benchmarks to leave out: t3, s3gen, e2e")
    p.add_argument("--upstream-src", help="folder that holds upstream's 'chatterbox' package folder")
    p.add_argument("--checkpoint", help="E2E random checkpoint folder (bench_e2e.py's default if not given)")
    p.add_argument("--job-timeout", type=int, default=900, help="seconds one benchmark process may take")
    p.add_argument(
        "--out", help="JSON lines of every benchmark (default benchmarks/out/compare_<preset>_<date>.jsonl)"
    )
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    skip = set(filter(None, args.skip.split(",")))
    stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H%M")
    out = Path(args.out or HERE / "out" / f"compare_{args.preset}_{stamp}.jsonl")
    dev = preset["device"]
    src = ["--upstream-src", args.upstream_src] if args.upstream_src else []
    ckpt = ["--checkpoint", args.checkpoint] if args.checkpoint else []
    t0 = time.perf_counter()
    rows, log = [], []

    out.parent.mkdir(parents=True, exist_ok=True)

    def job(label: str, cmd: list[str], upstream: bool = False) -> None:
        new = run(label, cmd, upstream, args.job_timeout, log)
        rows.extend(new)
        with open(out, "a") as f:  # as each job ends, so that a run cut short keeps what it measured
            f.writelines(json.dumps(r) + "\n" for r in new)

    if "t3" not in skip:
        n = ["--tokens", str(preset["t3_tokens"]), "--repeats", str(preset["t3_repeats"])]
        ours = preset["t3_ours"] or our_dtypes()
        for dtype in ours.split(","):  # one process each: a slow or failing precision costs only itself
            job(f"t3 ours {dtype}", ["bench_t3.py", "--systems", "ours", "--dtype", dtype, *n, *dev])
        job(
            "t3 upstream",
            ["bench_t3.py", "--systems", "upstream", "--dtype", preset["t3_upstream"], *n, *dev, *src],
            True,
        )
        job("t3 mlx-audio", ["bench_t3.py", "--systems", "mlx-audio", "--dtype", preset["t3_peer"], *n, *dev])
    if "s3gen" not in skip:
        n = ["--prompt-tokens", str(preset["s3gen_prompt"]), "--tokens", str(preset["s3gen_tokens"])]
        n += ["--repeats", str(preset["s3gen_repeats"])]
        variants = ["--variants", preset["s3gen_variants"]]
        job("s3gen ours", ["bench_s3gen.py", "--systems", "ours", *variants, *n, *dev, *src])
        job("s3gen upstream", ["bench_s3gen.py", "--systems", "upstream", *n, *dev, *src], True)
        job("s3gen mlx-audio", ["peer_mlx_audio.py", *n, *dev[:2]])
    watermark = has_perth()
    if "e2e" not in skip:
        n = ["--tokens", str(preset["e2e_tokens"]), "--repeats", str(preset["e2e_repeats"])]
        n += ["--clip-seconds", str(preset["e2e_clip"])] + ([] if watermark else ["--no-watermark"])
        job("e2e checkpoint", ["bench_e2e.py", "--write-checkpoint", "--systems", "", *ckpt, *src], True)
        job("e2e upstream", ["bench_e2e.py", "--systems", "upstream", *n, *ckpt, *dev, *src], True)
        job("e2e ours", ["bench_e2e.py", "--systems", "ours", *n, *ckpt, *dev])
    info = next((r for r in rows if "commit" in r), None) or machine_info()
    print(f"\n## done in {time.perf_counter() - t0:.0f} s; JSON lines in {out}", file=sys.stderr)
    print(f"### mlx-chatterbox vs upstream vs mlx-audio ({args.preset} preset)\n")
    print(main_table(rows))
    print("\n### S3Gen stages\n")
    print(s3gen_table(rows))
    print()
    print(describe(rows, preset, info, log, watermark))
    print("\n### T3 decode: memory-bandwidth bound on Apple silicon\n")
    print(bandwidth_table(rows, 250))
    print(
        "\n"
        + "\n".join(f"<!-- job {j['job']}: rc {j['rc']}, {j['wall_s']} s, {j['rows']} rows -->" for j in log)
    )


if __name__ == "__main__":
    main()
