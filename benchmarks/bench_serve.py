"""Load on the real HTTP server (``mlx-chatterbox serve``), in the metrics serving benchmarks report (vllm
bench serve --omni style): time to first audio (first pcm byte), end-to-end latency, audio RTF (wall / seconds
of audio), aggregate audio seconds per wall second, and audio underruns.

- closed loop: ``--concurrency N`` clients, each sending its next request when its last one ends;
- open loop: Poisson arrivals at ``--rate R`` requests/s (seeded);
- ``--formats streamed,whole``: streamed pcm (``stream_format: audio``) or the whole body (``stream: false``);
- ``--soak S``: a closed loop for S seconds that samples the server's RSS and MLX memory
  (``/health?memory=true``) every ``--sample-every`` seconds and says whether either grew after
  ``--soak-warmup`` seconds.

Where the server's worker spent each scenario: ``/metrics`` is read before and after it, and the deltas of its
phase counters are reported (``worker``: seconds and share of the scenario's wall time per thread and phase,
the worker thread's time in no phase as ``other``, mean requests per T3 step, mean rows per S3Gen call, jobs
ended by outcome).

Underruns: a listener starts playing a streamed response at its first chunk; replaying the arrival times of
its bytes against real-time playback, a stall is a chunk that arrives after the audio before it has played
out, and the listener waits the difference. Every request speaks the same text with a fixed
``max_new_tokens`` (random weights never stop: 250 tokens = 10 s of audio) and its own seed. Clients are
stdlib ``http.client``, a thread each. The server is started here (``--model DIR``, or ``--random tiny|full``
writes a random-weight folder with the tests' checkpoint helpers) on a free local port, or is a running one
(``--url``).

    python benchmarks/bench_serve.py --random full --variant english --concurrency 64,128 --out serve.jsonl
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import argparse
import dataclasses
import http.client
import json
import multiprocessing
import os
import random
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from common import REPO, machine_info, request_budget, write_line

TEXT = "Speech synthesis turns written text into spoken words, and this voice was cloned a moment ago."
BYTES_PER_SAMPLE = 2  # response_format pcm: 16-bit mono


@dataclass
class Result:
    """One request: when it was sent, its status, and the arrival times and sizes of its body's reads."""

    sent: float
    status: int | None = None  # None: no response (connection refused or reset before the headers)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (seconds since sent, bytes)
    end: float | None = None  # seconds since sent
    incomplete: bool = False  # the body broke off, was empty, or held half a sample
    timing: dict[str, float] = field(default_factory=dict)  # the server's Server-Timing: ms since it got it

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.incomplete and self.end is not None


def request(url: str, body: dict, timeout: float) -> Result:
    """POST ``body`` to ``url``/v1/audio/speech and read the response as it arrives."""
    parts = urllib.parse.urlsplit(url)
    data = json.dumps(body).encode()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    r = Result(sent=time.perf_counter())
    try:
        conn.request("POST", "/v1/audio/speech", data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        r.status = resp.status
        for entry in filter(None, (resp.getheader("Server-Timing") or "").split(",")):
            name, ms = entry.strip().split(";dur=")
            r.timing[name] = float(ms)
        if resp.status != 200:
            resp.read()
            r.end = time.perf_counter() - r.sent
            return r
        while chunk := resp.read1(1 << 16):
            r.arrivals.append((time.perf_counter() - r.sent, len(chunk)))
        r.end = time.perf_counter() - r.sent
        total = sum(n for _, n in r.arrivals)
        r.incomplete = total == 0 or total % BYTES_PER_SAMPLE != 0
    except (OSError, http.client.HTTPException):
        r.incomplete = r.status == 200
    finally:
        conn.close()
    return r


def underruns(arrivals: list[tuple[float, int]], sample_rate: int) -> tuple[int, float]:
    """(stalls, seconds waited) of a listener who starts playing at the first read and plays in real time."""
    bytes_per_s = sample_rate * BYTES_PER_SAMPLE
    stalls, waited = 0, 0.0
    played_out = None  # when the audio received so far has played
    for t, n in arrivals:
        if played_out is not None and t > played_out:
            stalls += 1
            waited += t - played_out
        played_out = (t if played_out is None else max(played_out, t)) + n / bytes_per_s
    return stalls, waited


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks; None for no values."""
    if not values:
        return None
    v = sorted(values)
    x = (len(v) - 1) * q / 100
    lo = int(x)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (x - lo)


def spread(values: list[float], qs: tuple[int, ...]) -> dict:
    return {f"p{q}": percentile(values, q) for q in qs}


def summarize(results: list[Result], wall: float, sample_rate: int, streamed: bool) -> dict:
    ok = [r for r in results if r.ok]
    audio = [sum(n for _, n in r.arrivals) / (sample_rate * BYTES_PER_SAMPLE) for r in ok]
    errors: dict[str, int] = {}
    for r in results:
        if r.status != 200:
            key = str(r.status) if r.status is not None else "no_response"
            errors[key] = errors.get(key, 0) + 1
    row = dict(
        requests=len(results),
        ok=len(ok),
        errors=errors,
        incomplete=sum(r.incomplete for r in results),
        wall_s=wall,
        audio_s=sum(audio),
        audio_per_wall=sum(audio) / wall if wall > 0 else None,
        audio_s_per_request={"min": min(audio, default=None), "max": max(audio, default=None)},
        ttfa_s=spread([r.arrivals[0][0] for r in ok], (50, 95, 99)),
        e2e_s=spread([r.end for r in ok], (50, 95, 99)),
        rtf=spread([r.end / a for r, a in zip(ok, audio)], (50, 95)),
        # The server's own account of the first audio (app.server_timing), ms after it got the request.
        server_timing_ms={
            name: spread([r.timing[name] for r in ok if name in r.timing], (50, 95))
            for name in dict.fromkeys(name for r in ok for name in r.timing)
        },
    )
    if streamed:
        stalls = [underruns(r.arrivals, sample_rate) for r in ok]
        waits = [w for _, w in stalls]
        row["underruns"] = dict(
            streams_stalled=sum(n > 0 for n, _ in stalls),
            stalls=sum(n for n, _ in stalls),
            wait_s=sum(waits),
            wait_s_per_stream={**spread(waits, (50, 95)), "max": max(waits, default=None)},
        )
    return row


def closed_loop(
    send: Callable[[int], Result], clients: int, requests: int | None, duration: float | None
) -> tuple[list[Result], float]:
    """``clients`` threads, each sending its next request when its last ends, until ``requests`` are sent or
    ``duration`` seconds have passed."""
    results: list[Result] = []
    lock = threading.Lock()
    start = time.perf_counter()
    counter = iter(range(requests if requests is not None else 1 << 62))

    def client() -> None:
        while duration is None or time.perf_counter() - start < duration:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            r = send(i)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def open_loop(
    send: Callable[[int], Result], rate: float, requests: int | None, duration: float | None, seed: int
) -> tuple[list[Result], float]:
    """Poisson arrivals at ``rate`` requests/s (seeded), each request on its own thread, until ``requests``
    are sent or ``duration`` seconds have passed; then every request is waited for."""
    rng = random.Random(seed)
    results: list[Result] = []
    lock = threading.Lock()
    threads = []

    def one(i: int) -> None:
        r = send(i)
        with lock:
            results.append(r)

    start = time.perf_counter()
    at = 0.0
    for i in range(requests if requests is not None else 1 << 62):
        at += rng.expovariate(rate)
        if duration is not None and at >= duration:
            break
        time.sleep(max(0.0, start + at - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(i,), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def get_json(url: str, path: str, timeout: float = 30) -> dict:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {resp.status}: {body[:200]!r}")
        return json.loads(body)
    finally:
        conn.close()


# A sample line of Prometheus' text format: name, optional {labels}, value.
SAMPLE = re.compile(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)")
LABEL = re.compile(r'(\w+)="([^"]*)"')
PHASE_METRICS = {"seconds": "seconds_total", "calls": "calls_total", "rows": "rows_total"}


def scrape(url: str, timeout: float = 30) -> dict[tuple[str, tuple], float]:
    """The server's ``/metrics``: {(name, ((label, value), ...)): value}."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read().decode()
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"GET /metrics: HTTP {resp.status}: {body[:200]!r}")
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, labels, value = SAMPLE.fullmatch(line).groups()
            samples[name, tuple(LABEL.findall(labels or ""))] = float(value)
    return samples


def worker_breakdown(before: dict, after: dict) -> dict:
    """The deltas of the worker's counters between two reads of /metrics around a scenario: the span between
    them by the server's clock (the scenario's wall time and a read), per thread and phase its seconds, share
    of the span, calls and rows; the worker thread's seconds in no phase (``other``: routing tokens, receiving
    jobs); mean requests per T3 step and rows per S3Gen call; T3's step traces; jobs ended by outcome."""

    def delta(key: tuple) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    span = delta(("mlx_chatterbox_worker_uptime_seconds", ()))

    phases: dict[str, dict[str, dict]] = {}
    for name, labels in after:
        if name == "mlx_chatterbox_worker_seconds_total":
            thread, phase = dict(labels)["thread"], dict(labels)["phase"]
            # A kind's seconds are summed over its threads (several marking threads): its share is of them all.
            threads = after.get(("mlx_chatterbox_worker_threads", (("thread", thread),)), 1.0)
            tally = {k: delta((f"mlx_chatterbox_worker_{m}", labels)) for k, m in PHASE_METRICS.items()}
            share = tally["seconds"] / (span * threads)
            tally.update(calls=int(tally["calls"]), rows=int(tally["rows"]), share=share)
            phases.setdefault(thread, {})[phase] = tally

    def per_call(phase: str) -> float | None:
        calls = sum(p[phase]["calls"] for p in phases.values() if phase in p)
        return sum(p[phase]["rows"] for p in phases.values() if phase in p) / calls if calls else None

    other = span - sum(p["seconds"] for p in phases["worker"].values())
    requests = {
        dict(labels)["outcome"]: int(delta((name, labels)))
        for name, labels in after
        if name == "mlx_chatterbox_requests_total"
    }
    return dict(
        span_s=span,
        phases=phases,
        other_s=other,
        other_share=other / span,
        t3_rows_per_step=per_call("t3_step"),
        vocode_rows_per_call=per_call("vocode"),
        stream_decode_rows_per_call=per_call("stream_decode"),
        t3_traces=int(delta(("mlx_chatterbox_t3_traces_total", ()))),
        requests=requests,
    )


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def grew(curve: list[tuple[float, int | None]], warmup: float, tolerance: float) -> dict | None:
    """Did the last sample exceed the first one at or after ``warmup`` seconds by more than ``tolerance``
    (a fraction)? None when no sample was taken after the warm-up."""
    after = [v for t, v in curve if t >= warmup and v is not None]
    if len(after) < 2:
        return None
    grown = after[-1] > after[0] * (1 + tolerance)
    return {"from": after[0], "to": after[-1], "max": max(after), "grew": grown}


def soak(send: Callable[[int], Result], args: argparse.Namespace, url: str, pid: int | None) -> dict:
    """A closed loop of ``--soak`` seconds with the server's memory sampled beside it."""
    samples: list[dict] = []
    stop = threading.Event()
    start = time.perf_counter()

    def sample() -> None:
        while True:
            s = {"t": time.perf_counter() - start, "rss": rss_bytes(pid) if pid else None}
            try:
                s["mlx"] = get_json(url, "/health?memory=true", timeout=args.sample_every * 4).get("memory")
            except (OSError, RuntimeError, http.client.HTTPException):
                s["mlx"] = None
            samples.append(s)
            if stop.wait(args.sample_every):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    results, wall = closed_loop(send, args.concurrency[0], None, args.soak)
    stop.set()
    sampler.join()
    curves = {
        "t": [s["t"] for s in samples],
        "rss": [s["rss"] for s in samples],
        **{f"mlx_{k}": [(s["mlx"] or {}).get(k) for s in samples] for k in ("active", "peak", "cache")},
    }
    growth = {
        name: grew(list(zip(curves["t"], curves[name])), args.soak_warmup, args.soak_tolerance)
        for name in ("rss", "mlx_active")
    }
    return dict(results=results, wall=wall, memory=curves, growth=growth)


def write_random_model(kind: str, variant: str, dst: Path) -> None:
    """A converted random-weight model folder ``dst/mlx`` and a random voice ``dst/voice.safetensors`` for it,
    by the tests' helpers (no torch)."""
    sys.path.insert(0, str(REPO))
    from mlx_chatterbox.convert import convert
    from mlx_chatterbox.variants import ENGLISH, TURBO
    from tests.conftest import TINY_MODEL, TINY_TURBO, random_voice, write_upstream_checkpoint
    from tests.toy_gpt2_tokenizer import VOCAB_SIZE

    # Full-size Turbo speaks through the toy GPT-2 tokenizer, so its text vocabulary is the toy's (720 rows of
    # the text embedding instead of 50,276: a lookup table, the same cost per step).
    full_turbo = dataclasses.replace(TURBO, t3=dataclasses.replace(TURBO.t3, text_vocab_size=VOCAB_SIZE))
    configs = {"english": (TINY_MODEL, ENGLISH), "turbo": (TINY_TURBO, full_turbo)}
    cfg = configs[variant][kind == "full"]
    # full: upstream's prompt sizes, a 6 s T3 prompt (Turbo: 15 s) and a 10 s S3Gen prompt; tiny: the tests'.
    sizes = dict(prompt_len=375 if variant == "turbo" else 150, gen_tokens=250) if kind == "full" else {}
    random_voice(seed=7, **sizes).save(dst / "voice.safetensors")
    convert(write_upstream_checkpoint(dst / "upstream", cfg), dst / "mlx", config=cfg)
    shutil.rmtree(dst / "upstream")


def start_server(args: argparse.Namespace, work: Path) -> tuple[subprocess.Popen, str]:
    """``serve`` on a free local port, its log in ``work``; returns once ``/health`` answers."""
    if args.random:
        # In a process of its own, so that the arrays it made (GBs at full size, on the GPU too) are freed
        # before the server starts beside us.
        writer = multiprocessing.get_context("spawn").Process(
            target=write_random_model, args=(args.random, args.variant, work)
        )
        writer.start()
        writer.join()
        if writer.exitcode != 0:
            raise SystemExit(f"writing the random model failed (exit code {writer.exitcode})")
        model, voice = work / "mlx", work / "voice.safetensors"
        extra = ["--voice", str(voice)]
    else:
        model, extra = args.model, []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "mlx_chatterbox", "serve", "--model", str(model), "--port", str(port)]
    argv += ["--voices", str(work / "voices"), *extra, *shlex.split(args.serve_args)]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    log = open(work / "serve.log", "w")
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while True:
        # The log's tail in the message: ``work`` is a temporary folder, gone once we exit.
        if proc.poll() is not None:
            log_tail = (work / "serve.log").read_text()[-4000:]
            raise SystemExit(f"serve exited with {proc.returncode}:\n{log_tail}")
        if time.monotonic() > deadline:
            proc.kill()
            log_tail = (work / "serve.log").read_text()[-4000:]
            raise SystemExit(f"serve did not answer /health in {args.start_timeout:g} s:\n{log_tail}")
        try:
            get_json(url, "/health", timeout=1)
            return proc, url
        except (OSError, RuntimeError, http.client.HTTPException):
            time.sleep(0.3)


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def errors_cell(row: dict) -> str:
    cells = [f"{status}: {n}" for status, n in row["errors"].items()]
    cells += [f"incomplete: {row['incomplete']}"] if row["incomplete"] else []
    return ", ".join(cells) or "0"


def markdown(rows: list[dict]) -> str:
    lines = [
        "| scenario | ok / sent | errors | audio/wall | TTFA p50 / p95 / p99 s | E2E p50 / p95 / p99 s "
        "| RTF p50 / p95 | stalled streams, wait s | MLX peak GB since start |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        under = r.get("underruns")
        cells = [
            r["scenario"],
            f"{r['ok']} / {r['requests']}",
            errors_cell(r),
            fmt(r["audio_per_wall"], ".1f") + "x",
            " / ".join(fmt(r["ttfa_s"][f"p{q}"]) for q in (50, 95, 99)),
            " / ".join(fmt(r["e2e_s"][f"p{q}"]) for q in (50, 95, 99)),
            " / ".join(fmt(r["rtf"][f"p{q}"], ".3f") for q in (50, 95)),
            f"{under['streams_stalled']}, {under['wait_s']:.2f}" if under else "-",
            fmt(r["mlx_memory"]["peak"] / 1e9, ".1f") if r.get("mlx_memory") else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def timing_markdown(rows: list[dict]) -> str:
    """The server's Server-Timing per scenario: p50 ms after it got the request, of each step towards the
    first audio, beside the client's TTFA."""
    names = list(dict.fromkeys(name for r in rows for name in r["server_timing_ms"]))
    lines = ["| scenario | TTFA p50 ms | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for r in rows:
        ttfa = r["ttfa_s"]["p50"]
        cells = [r["scenario"], fmt(None if ttfa is None else 1000 * ttfa, ".1f")]
        cells += [fmt(r["server_timing_ms"].get(name, {}).get("p50"), ".1f") for name in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def worker_markdown(rows: list[dict]) -> str:
    """Where the worker's time went per scenario: seconds and share of the span per phase (the vocoding
    thread's apart), then mean rows per T3 step and per S3Gen call, and T3's step traces."""
    columns = list(dict.fromkeys((t, p) for r in rows for t, ps in r["worker"]["phases"].items() for p in ps))
    names = [p if t == "worker" else f"{t} {p}" for t, p in columns]
    names += ["other", "T3 rows/step", "vocode rows/call", "stream rows/call", "T3 traces"]
    lines = ["| scenario | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in rows:
        w = r["worker"]
        cells = [r["scenario"]]
        for t, p in columns:
            tally = w["phases"].get(t, {}).get(p)
            cells.append("-" if tally is None else f"{tally['seconds']:.2f} s {100 * tally['share']:.0f}%")
        cells.append(f"{w['other_s']:.2f} s {100 * w['other_share']:.0f}%")
        cells += [fmt(w[k], ".1f") for k in ("t3_rows_per_step", "vocode_rows_per_call")]
        cells += [fmt(w["stream_decode_rows_per_call"], ".1f"), str(w["t3_traces"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def positive(kind: type) -> Callable[[str], float]:
    """An argparse type: a number above 0."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value <= 0:
            name = "whole number" if kind is int else "number"
            raise argparse.ArgumentTypeError(f"{text!r}: a {name} above 0")
        return value

    return parse


def csv(kind: type) -> Callable[[str], list]:
    """An argparse type: comma-separated numbers above 0."""

    def parse(text: str) -> list:
        return [positive(kind)(v) for v in text.split(",") if v.strip()] or positive(kind)("")

    return parse


def formats(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("streamed", "whole") for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: streamed, whole or both (comma-separated)")
    return values


# Flags that only apply to some runs: given elsewhere they would be ignored, so they are refused.
SOAK_FLAGS = {"sample_every": 10.0, "soak_warmup": 60.0, "soak_tolerance": 0.02}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    server = p.add_mutually_exclusive_group(required=True)
    server.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    server.add_argument("--model", type=Path, help="a converted model folder to start `serve` on")
    server.add_argument("--random", choices=("tiny", "full"), help="write a random-weight model and serve it")
    p.add_argument("--variant", choices=("english", "turbo"), help="with --random (default: english)")
    p.add_argument("--serve-args", help="more `serve` flags, one string, e.g. '--max-batch 128'")
    p.add_argument("--start-timeout", type=positive(float), help="seconds `serve` may take to start (600)")
    p.add_argument("--concurrency", type=csv(int), default=[], help="closed loop: clients, comma-separated")
    p.add_argument("--rate", type=csv(float), default=[], help="open loop: requests/s, comma-separated")
    p.add_argument("--formats", type=formats, default=["streamed", "whole"], help="streamed,whole (default)")
    p.add_argument("--requests", type=positive(int), help="per scenario (default: 4 x clients, or 4 x rate)")
    p.add_argument("--duration", type=positive(float), help="seconds per scenario instead of --requests")
    p.add_argument("--tokens", type=positive(int), default=250, help="max_new_tokens of a request (25 = 1 s)")
    p.add_argument(
        "--tokens-spread",
        type=int,
        default=0,
        metavar="N",
        help="request i's max_new_tokens drawn from --tokens ± N (seeded by --seed + i): random weights never "
        "stop early, so without it every request has one length, and a GPU's per-shape plans stay cached as they "
        "would not for real text",
    )
    p.add_argument(
        "--warm-up-tokens",
        type=positive(int),
        help="before each scenario, a closed loop of requests of this many tokens at its concurrency (an open loop's "
        "rate rounded), unrecorded: a server's first burst is slower than the next (RESULTS.md runs K-M)",
    )
    p.add_argument("--text", default=TEXT)
    p.add_argument("--seed", type=int, default=0, help="request i: seed + i; Poisson arrivals")
    p.add_argument("--timeout", type=positive(float), default=600, help="seconds a request may take")
    p.add_argument("--soak", type=positive(float), metavar="S", help="a closed loop of S seconds")
    p.add_argument("--sample-every", type=positive(float), help="soak: seconds between memory samples (10)")
    p.add_argument("--soak-warmup", type=float, help="soak: growth is judged after this many seconds (60)")
    p.add_argument("--soak-tolerance", type=float, help="soak: growth above this fraction (0.02)")
    p.add_argument("--pid", type=int, help="with --url and --soak: the server's process id, for its RSS")
    p.add_argument("--out", help="append the JSON lines here")
    args = p.parse_args(argv)
    if args.variant and not args.random:
        p.error("--variant is for --random; a --model folder or a --url server has its own")
    args.variant = args.variant or "english"
    if args.url and (args.serve_args or args.start_timeout):
        p.error("--serve-args and --start-timeout are for a server started here (--model, --random)")
    args.serve_args, args.start_timeout = args.serve_args or "", args.start_timeout or 600
    if args.pid and not (args.url and args.soak):
        p.error("--pid is for --url with --soak; a server started here is sampled by its own pid")
    if args.requests is not None and args.duration is not None:
        p.error("give --requests or --duration, not both")
    if not 0 <= args.tokens_spread < args.tokens:
        p.error(
            f"--tokens-spread {args.tokens_spread}: it must lie in [0, --tokens) so that every budget is >= 1"
        )
    if args.soak is None:
        if any(getattr(args, k) is not None for k in SOAK_FLAGS):
            p.error("--sample-every, --soak-warmup and --soak-tolerance are for --soak")
        if not args.concurrency and not args.rate:
            p.error("give --concurrency (closed loop), --rate (open loop) or --soak")
    else:
        if args.warm_up_tokens is not None:
            p.error("--warm-up-tokens is for closed and open loops; a soak judges growth after --soak-warmup")
        if len(args.concurrency) != 1 or len(args.formats) != 1 or args.rate:
            p.error("--soak needs one --concurrency value and one --formats value, and no --rate")
        if args.requests is not None or args.duration is not None:
            p.error("--soak S lasts S seconds: no --requests or --duration")
        for k, default in SOAK_FLAGS.items():
            setattr(args, k, default if getattr(args, k) is None else getattr(args, k))

    with tempfile.TemporaryDirectory(prefix="bench_serve-") as tmp:
        proc = None
        url, pid = args.url, args.pid
        if url is None:
            proc, url = start_server(args, Path(tmp))
            pid = proc.pid
        try:
            rows = run(args, url, pid)
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print()
    print(markdown(rows))
    print()
    print(timing_markdown(rows))
    print()
    print(worker_markdown(rows))


def run(args: argparse.Namespace, url: str, pid: int | None) -> list[dict]:
    """Every scenario against the server at ``url``: one JSON line each; the rows."""
    health = get_json(url, "/health")
    sample_rate = health["sample_rate"]
    info = machine_info()
    keys = ("model", "variant", "max_batch", "max_queue", "vocode_batch", "vocode_thread", "cfm_steps")
    # the flags that change the server's speed
    keys += ("cfm_dtype", "stream_context", "first_chunk", "stream_catch_up", "mark_threads", "vocode_memory")
    keys += ("vocoding",)
    server = {k: health.get(k) for k in keys}
    rows = []

    def sender(fmt_: str, tokens: int = args.tokens, vary: int = args.tokens_spread):
        extra = {"stream": True, "stream_format": "audio"} if fmt_ == "streamed" else {"stream": False}

        def send(i: int) -> Result:
            body = dict(model=health["model"], input=args.text, response_format="pcm", seed=args.seed + i)
            budget = request_budget(tokens, vary, args.seed + i)
            return request(url, {**body, "max_new_tokens": budget, **extra}, args.timeout)

        return send

    def warm_up(fmt_: str, clients: int) -> dict | None:
        """The unrecorded round before a scenario (``--warm-up-tokens``): its size and how many came back whole."""
        if args.warm_up_tokens is None:
            return None
        results, _ = closed_loop(sender(fmt_, args.warm_up_tokens, 0), clients, clients, None)
        return dict(tokens=args.warm_up_tokens, requests=clients, ok=sum(r.ok for r in results))

    def emit(scenario: str, fmt_: str, results: list[Result], wall: float, before: dict, **extra) -> None:
        """One scenario's row, ``before``: the server's /metrics as it began."""
        row = dict(bench="serve", scenario=scenario, format=fmt_, tokens=args.tokens, server=server, **extra)
        row.update(tokens_spread=args.tokens_spread, seed=args.seed)
        row.update(summarize(results, wall, sample_rate, fmt_ == "streamed"))
        row.update(worker=worker_breakdown(before, scrape(url)))
        # MLX's active, peak (since the server started) and cached bytes once the scenario is over: how much
        # memory its settings (--vocode-memory, --vocode-batch) took.
        row.update(mlx_memory=get_json(url, "/health?memory=true").get("memory"))
        row.update(machine_info=info)
        write_line(row, args.out)
        rows.append(row)

    if args.soak is not None:
        fmt_ = args.formats[0]
        before = scrape(url)
        s = soak(sender(fmt_), args, url, pid)
        name = f"soak {args.concurrency[0]} {fmt_} {args.soak:g}s"
        extra = dict(loop="soak", concurrency=args.concurrency[0], memory=s["memory"], growth=s["growth"])
        emit(name, fmt_, s["results"], s["wall"], before, **extra)
        return rows
    for fmt_ in args.formats:
        for c in args.concurrency:
            n = args.requests if args.requests is not None or args.duration else 4 * c
            warmed = dict(warm_up=warm_up(fmt_, c))
            before = scrape(url)
            results, wall = closed_loop(sender(fmt_), c, n, args.duration)
            emit(f"closed {c} {fmt_}", fmt_, results, wall, before, loop="closed", concurrency=c, **warmed)
        for rate in args.rate:
            n = args.requests if args.requests is not None or args.duration else max(1, round(4 * rate))
            warmed = dict(warm_up=warm_up(fmt_, max(1, round(rate))))
            before = scrape(url)
            results, wall = open_loop(sender(fmt_), rate, n, args.duration, args.seed)
            emit(f"open {rate:g}/s {fmt_}", fmt_, results, wall, before, loop="open", rate=rate, **warmed)
    return rows


if __name__ == "__main__":
    main()
