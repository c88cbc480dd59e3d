"""End to end: text -> 24 kHz waveform with a cloned voice, ours (MLX) against upstream ``ChatterboxTTS`` (PyTorch).

Both load the same random-weight checkpoint in upstream's file layout (written here by upstream's own modules,
``--write-checkpoint``), clone a voice from the same synthetic 10 s recording, then turn a fixed sentence into
``--tokens`` speech tokens (EOS disabled) and those into audio (``--tokens`` x 40 ms), watermark included.
Voice preparation (once per voice) and text -> wav (per request) are timed apart. See benchmarks/README.md.

    python benchmarks/bench_e2e.py --write-checkpoint          # once; needs torch + upstream chatterbox
    python benchmarks/bench_e2e.py --systems ours --tokens 250 --repeats 3 --out benchmarks/out/e2e.jsonl
    python benchmarks/bench_e2e.py --built full --cfm-dtype bfloat16   # ours on a model built here: no torch
    MLX_CHATTERBOX_BLAS=off MLX_CHATTERBOX_MALLOC=off python benchmarks/bench_e2e.py --systems upstream ...  # CPU: own process
"""

from __future__ import annotations

import sys  # isort: skip
from pathlib import Path  # isort: skip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
# Import our package before mlx.core: it preloads OpenBLAS and keeps fp32 matmuls in fp32 (see _backend.py).
import mlx_chatterbox  # noqa: F401  isort: skip
from mlx_chatterbox import _backend  # isort: skip

import argparse
import dataclasses
import gc
import importlib.util
import resource
import statistics
import time
import types
import wave
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from common import (
    bare_upstream,
    machine_info,
    memory_budget,
    refuse_torch_cpu_beside_preload,
    request_budget,
    write_line,
)

from mlx_chatterbox.generation import watermark as watermark_module
from mlx_chatterbox.models import cfm, memory

SAMPLE_RATE = 24000
TOKEN_SECONDS = 0.04
SPEECH_CODES = 6561  # valid S3 speech token ids are 0..6560
TEXT = (
    "Speech synthesis turns written text into spoken words, and this voice was cloned from a short recording "
    "made a moment ago."
)
KNOBS = dict(temperature=0.8, min_p=0.05, top_p=1.0, repetition_penalty=1.2, cfg_weight=0.5)
EXAGGERATION = 0.5
DEFAULT_CHECKPOINT = "/tmp/mlx_chatterbox_e2e/checkpoint"
CHECKPOINT_FILES = ("t3_cfg.safetensors", "s3gen.safetensors", "ve.safetensors", "tokenizer.json")


def side_paths(checkpoint: Path) -> tuple[Path, Path]:
    """Our conversion cache and the clip folder, beside the checkpoint: inside it they would change the folder
    that ``convert.prepare`` fingerprints, and force a new conversion every run."""
    return checkpoint.with_name(checkpoint.name + "-mlx"), checkpoint.with_name(checkpoint.name + "-clips")


# --- inputs ---


def synthetic_voice(seconds: float, seed: int = 0) -> np.ndarray:
    """A deterministic speech-like mono clip at 24 kHz: a gliding 100-150 Hz harmonic source shaped by two
    formants that change every syllable (0.22 s), syllable envelopes and pauses. No espeak on the GPU machine,
    so both machines synthesise the same clip here."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    f0 = 125 + 20 * np.sin(2 * np.pi * 0.3 * t) + 8 * np.sin(2 * np.pi * 2.1 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    syllable = (t // 0.22).astype(int)
    n_syll = syllable[-1] + 1
    f1 = rng.uniform(300, 800, n_syll)[syllable]
    f2 = rng.uniform(900, 2300, n_syll)[syllable]
    voiced = rng.random(n_syll) > 0.2  # about one syllable in five is a pause
    wav = np.zeros_like(t)
    for h in range(1, 31):
        fh = h * f0
        gain = np.exp(-(((fh - f1) / 150) ** 2)) + 0.6 * np.exp(-(((fh - f2) / 250) ** 2)) + 0.03
        wav += gain * np.cos(h * phase) * (fh < 8000)
    within = (t % 0.22) / 0.22
    wav *= np.sin(np.pi * within) ** 2 * voiced[syllable]
    wav += 0.003 * rng.standard_normal(t.shape)
    return (0.5 * wav / np.abs(wav).max()).astype(np.float32)


def write_clip(path: Path, seconds: float) -> Path:
    """``synthetic_voice`` as a 16-bit wav file (both systems clone from a file, as a user would)."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    pcm = np.round(synthetic_voice(seconds) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(SAMPLE_RATE)
        f.writeframes(pcm.tobytes())
    return path


def fold(ids: np.ndarray) -> np.ndarray:
    """Random weights sample ids outside the 6561 speech codes (start/stop/unused head outputs, about 1 in 5),
    which generate would drop; a trained model does not. Folding them into range keeps exactly ``--tokens``
    tokens (``--tokens`` x 40 ms of audio) for S3Gen on both systems."""
    return np.asarray(ids) % SPEECH_CODES


def rss_peak_mib() -> float:
    """Peak resident memory of this process (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


# --- the checkpoint (upstream's modules) ---


def write_checkpoint(folder: Path, src: str | None) -> None:
    """A full-size random checkpoint in upstream's layout, made by upstream's modules and randomised as the
    parity tests do (tests/reference/oracle.py: norms, biases, weight-norm g, BN statistics moved off their
    identities). No conds.pt: both systems use the cloned voice."""
    if all((folder / name).is_file() for name in CHECKPOINT_FILES):
        print(f"# checkpoint {folder}: present", file=sys.stderr)
        return
    bare_upstream(src, whole_tts=True)
    from tests.reference import oracle
    from tests.toy_tokenizer import write_toy_tokenizer

    t0 = time.perf_counter()
    tmp = folder.with_name(folder.name + ".partial")
    oracle.write_t3_checkpoint(oracle.upstream_t3(oracle.FULL, seed=0), tmp)
    oracle.write_s3gen_checkpoint(oracle.upstream_s3gen(seed=0), tmp)
    oracle.write_ve_checkpoint(tmp, seed=0)
    write_toy_tokenizer(tmp / "tokenizer.json")
    tmp.rename(folder)  # complete or absent
    print(f"# wrote a random checkpoint to {folder} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


# --- ours (MLX) ---


def bench_ours(
    checkpoint: Path,
    clip: Path | None,
    tokens: int,
    repeats: int,
    watermark: bool,
    device: str,
    built: str | None = None,
    cfm_dtype: str = "float32",
    s3gen_budget: int | str | None = "auto",
    spread: int = 0,
) -> dict:
    """``built`` ("tiny" or "full"): a model built here with random weights (bench_stream.build: no checkpoint,
    no torch, its random voice and a toy tokenizer) instead of the checkpoint and a cloned voice; no voice is
    prepared then. ``cfm_dtype``: the estimator's dtype (``TTS.load(cfm_dtype=)``); ``s3gen_budget``:
    ``S3Gen.memory_budget``; ``spread``: run ``seed`` makes ``request_budget(tokens, spread, seed)`` tokens.
    """
    from mlx_chatterbox import TTS, SamplingParams
    from mlx_chatterbox.convert import prepare
    from mlx_chatterbox.generation.speech_tokens import generate_speech_tokens

    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    t0 = t1 = time.perf_counter()
    if built is None:
        cache, _ = side_paths(checkpoint)
        prepare(checkpoint, cache_dir=cache)  # converts on the first run only
        t1 = time.perf_counter()
        tts = TTS.load(checkpoint, cache_dir=cache, cfm_dtype=cfm_dtype)
    else:
        from bench_stream import build

        tts = build(built == "tiny")
        tts.s3gen.estimator.set_dtype(getattr(mx, cfm_dtype))
    s3gen = tts.s3gen
    s3gen.memory_budget = s3gen_budget
    mx.eval(tts.t3.parameters(), [n.parameters() for n in (s3gen.flow, s3gen.estimator, s3gen.hift)])
    load_s = time.perf_counter() - t1

    def clone() -> tuple[object, float]:
        t = time.perf_counter()
        voice = tts.voice(clip)
        mx.eval([getattr(voice, f.name) for f in dataclasses.fields(voice)])
        return voice, time.perf_counter() - t

    if built is None:
        voice, voice_first = clone()
        voices = [clone()[1] for _ in range(repeats)]
    else:
        voice, voice_first, voices = tts.builtin_voice, None, None
    # The public API stops at EOS; generate_speech_tokens(stop_on_eos=False) is what TTS.speech_tokens runs.
    cfg = tts.t3.config
    # MLX's peak in each stage, over the runs; T3's prefill (to its first token) apart from its decode steps
    stage_peaks = dict.fromkeys(("t3_prefill", "t3", "s3gen", "watermark"), 0)
    first: list[float] = []  # seconds from the text to T3's first token, a run each

    def peak(stage: str) -> None:
        """Note the stage's peak (every stage ends synchronised: tokens, then numpy samples) and start anew."""
        stage_peaks[stage] = max(stage_peaks[stage], mx.get_peak_memory())
        mx.reset_peak_memory()

    def once(seed: int) -> dict:
        n = request_budget(tokens, spread, seed)
        params = SamplingParams(max_new_tokens=n, exaggeration=EXAGGERATION, **KNOBS)
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        ids = tts.text_ids(TEXT)
        speech = generate_speech_tokens(
            tts.t3, voice, ids, params, key=mx.random.key(seed), stop_on_eos=False
        )
        raw = [next(speech)]
        first.append(time.perf_counter() - t0)
        peak("t3_prefill")
        raw += speech
        t1 = time.perf_counter()
        peak("t3")
        wav = tts.vocode(fold(raw).astype(np.int32), voice, seed=seed, watermark=False)
        t2 = time.perf_counter()
        peak("s3gen")
        if watermark:
            wav = tts.watermarker().apply(wav, tts.sample_rate)
        t3 = time.perf_counter()
        peak("watermark")
        assert len(raw) == n, f"expected {n} tokens, got {len(raw)}"
        return run_row(t0, t1, t2, t3, wav.shape[-1], n)

    once(0)  # warm-up (also loads the watermarker)
    stage_peaks.update(dict.fromkeys(stage_peaks, 0))
    first.clear()
    result = summarize([once(1 + i) for i in range(repeats)])
    result.update(
        model=(
            "checkpoint" if built is None else f"built {built} (random weights, toy tokenizer, random voice)"
        ),
        cfm_dtype=cfm_dtype,
        convert_s=round(t1 - t0, 2),
        load_s=round(load_s, 2),
        voice_first_s=None if voices is None else round(voice_first, 3),
        voice_s=None if voices is None else round(statistics.median(voices), 3),
        prompt_tokens=int(voice.s3gen_prompt_tokens.shape[1]),
        peak_mem_bytes=max(stage_peaks.values()),
        peak_mem_kind="mx.get_peak_memory over the text -> wav runs, weights included",
        stage_peak_mib={stage: round(b / 2**20) for stage, b in stage_peaks.items()},
        first_token_ms=round(statistics.median(first) * 1e3, 1),
        resident_mib=round(mx.get_active_memory() / 2**20),
        backend=_backend.STATUS,
        text_ids=len(tts.text_ids(TEXT)),
        eos="generate_speech_tokens(stop_on_eos=False)",
        stop_id=cfg.stop_speech_token,
    )
    return result


# --- upstream (PyTorch) ---


def stub_perth() -> None:
    """Upstream's ``ChatterboxTTS`` builds perth's watermarker in its constructor; with ``--no-watermark`` and no
    perth installed (its wheel is 34 MB of weights), a stand-in whose watermark is the identity."""

    class Identity:
        def apply_watermark(self, wav: np.ndarray, sample_rate: int) -> np.ndarray:
            return wav

    module = types.ModuleType("perth")
    module.PerthImplicitWatermarker = Identity
    sys.modules["perth"] = module


def bench_upstream(
    checkpoint: Path,
    clip: Path,
    tokens: int,
    repeats: int,
    watermark: bool,
    device: str | None,
    src: str | None,
    spread: int = 0,
) -> dict:
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    refuse_torch_cpu_beside_preload(dev.type)
    if importlib.util.find_spec("perth") is None:
        if watermark:
            raise SystemExit(
                "upstream needs perth for its watermark: pip install resemble-perth, or --no-watermark"
            )
        stub_perth()
    bare_upstream(src, whole_tts=True)
    import chatterbox.models.t3.t3 as t3_module
    from chatterbox.tts import ChatterboxTTS, punc_norm

    t3_module.tqdm = lambda iterable, **_: iterable  # its per-token progress bar
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # upstream fp32 numerics (PyTorch's default)
        torch.backends.cudnn.allow_tf32 = False
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    tts = ChatterboxTTS.from_local(checkpoint, str(dev))
    sync()
    load_s = time.perf_counter() - t0
    tts.t3.hp.stop_speech_token = -1  # an id never sampled: EOS disabled

    def clone() -> float:
        sync()
        t = time.perf_counter()
        tts.prepare_conditionals(str(clip), exaggeration=EXAGGERATION)
        sync()
        return time.perf_counter() - t

    voice_first = clone()
    voices = [clone() for _ in range(repeats)]

    def once(seed: int) -> dict:
        # ChatterboxTTS.generate's steps, with max_new_tokens = tokens (generate fixes it at 1000) and the
        # out-of-range ids folded instead of dropped (see fold).
        n = request_budget(tokens, spread, seed)
        torch.manual_seed(seed)
        sync()
        t0 = time.perf_counter()
        text = tts.tokenizer.text_to_tokens(punc_norm(TEXT)).to(dev)
        text = torch.cat([text, text], dim=0)  # CFG rows
        text = torch.nn.functional.pad(text, (1, 0), value=tts.t3.hp.start_text_token)
        text = torch.nn.functional.pad(text, (0, 1), value=tts.t3.hp.stop_text_token)
        with torch.inference_mode():
            ids = tts.t3.inference(t3_cond=tts.conds.t3, text_tokens=text, max_new_tokens=n, **KNOBS)[0]
            sync()
            t1 = time.perf_counter()
            wav, _ = tts.s3gen.inference(speech_tokens=ids % SPEECH_CODES, ref_dict=tts.conds.gen)
            wav = wav.squeeze(0).detach().cpu().numpy()
        t2 = time.perf_counter()
        if watermark:
            wav = tts.watermarker.apply_watermark(wav, sample_rate=tts.sr)
        t3 = time.perf_counter()
        assert ids.shape[-1] == n, f"expected {n} tokens, got {ids.shape[-1]}"
        return run_row(t0, t1, t2, t3, wav.shape[-1], n)

    once(0)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    result = summarize([once(1 + i) for i in range(repeats)])
    result.update(
        torch_device=str(dev),
        load_s=round(load_s, 2),
        voice_first_s=round(voice_first, 3),
        voice_s=round(statistics.median(voices), 3),
        prompt_tokens=int(tts.conds.gen["prompt_token"].shape[1]),
        peak_mem_bytes=torch.cuda.max_memory_allocated(dev) if cuda else None,
        peak_mem_kind=(
            "torch.cuda.max_memory_allocated (weights included)" if cuda else "not measured (see rss)"
        ),
        tf32=bool(torch.backends.cuda.matmul.allow_tf32) if cuda else None,
        torch_threads=torch.get_num_threads(),
        eos="t3.hp.stop_speech_token = -1",
        perth_stub=sys.modules["perth"].__spec__ is None,
    )
    return result


def run_row(t0: float, t1: float, t2: float, t3: float, samples: int, tokens: int) -> dict:
    """One run: its stage times from four clock readings (start, T3 done, S3Gen done, marked), samples, tokens."""
    return dict(
        total_s=t3 - t0, t3_s=t1 - t0, s3gen_s=t2 - t1, watermark_s=t3 - t2, samples=samples, tokens=tokens
    )


def summarize(runs: list[dict]) -> dict:
    """Medians of the per-run stage times; the RTF is each run's time over the audio it made, and T3's speed
    its tokens over its time (runs differ in length with --tokens-spread)."""
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return dict(
        total_s=round(med["total_s"], 4),
        t3_s=round(med["t3_s"], 4),
        s3gen_s=round(med["s3gen_s"], 4),
        watermark_s=round(med["watermark_s"], 4),
        audio_s=round(med["samples"] / SAMPLE_RATE, 3),
        rtf=round(statistics.median(r["total_s"] * SAMPLE_RATE / r["samples"] for r in runs), 4),
        t3_tok_s=round(statistics.median(r["tokens"] / r["t3_s"] for r in runs), 2),
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="ours", help="comma list of: ours, upstream")
    p.add_argument(
        "--checkpoint", default=DEFAULT_CHECKPOINT, help="random upstream-layout checkpoint folder"
    )
    p.add_argument(
        "--write-checkpoint", action="store_true", help="write --checkpoint if absent (torch + upstream)"
    )
    p.add_argument(
        "--clip-seconds", type=float, default=10.0, help="length of the recording the voice is cloned from"
    )
    p.add_argument(
        "--tokens", type=int, default=250, help="speech tokens per request (25 per second of audio)"
    )
    p.add_argument(
        "--tokens-spread",
        type=int,
        default=0,
        metavar="N",
        help="run i makes a number of tokens drawn from --tokens ± N (seeded by i, the same for both systems): "
        "every length new, as real text meets the GPU's per-shape plans",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up; medians are reported")
    p.add_argument("--no-watermark", action="store_true", help="leave out perth's watermark on both systems")
    p.add_argument("--device", choices=("cpu", "gpu"), help="MLX device (default: gpu when MLX has one)")
    p.add_argument("--torch-device", choices=("cpu", "cuda"), help="upstream device (default: cuda if any)")
    p.add_argument("--upstream-src", help="folder that holds upstream's 'chatterbox' package folder")
    p.add_argument(
        "--built",
        choices=("tiny", "full"),
        help="ours only: a model built with random weights instead of --checkpoint (no torch, no voice cloning; "
        "the device machine's way)",
    )
    p.add_argument("--cfm-dtype", default="float32", help="ours: the estimator's dtype (float32, bfloat16)")
    p.add_argument(
        "--plain-products",
        action="store_true",
        help="ours: the estimator's products as MLX's ops, not our tensor-core kernel (cfm.TILED_PRODUCTS off; "
        "the kernel runs on CUDA with a half-precision estimator)",
    )
    p.add_argument(
        "--mark-spectra",
        choices=("auto", "device", "host"),
        default="auto",
        help="ours: where the watermark finds its STFTs and iSTFT: in MLX on the device, in numpy on the host, or "
        "auto: the library's default, the device with MLX-CUDA and the host elsewhere (watermark.SPECTRA_ON_DEVICE)",
    )
    p.add_argument(
        "--memory-budget",
        default="auto",
        type=memory_budget,
        help="ours: S3Gen.memory_budget (auto, none, or MiB): the bytes a vocoding call may hold above the weights",
    )
    p.add_argument(
        "--prefill-budget",
        default="auto",
        type=memory_budget,
        help="ours: memory.PREFILL_BUDGET_PER_ROW (auto: the library's, none, or MiB): the bytes T3's prefill may "
        "hold above the memory in use, a row",
    )
    p.add_argument("--out", help="append the JSON lines to this file")
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if not set(systems) <= {"ours", "upstream"}:
        p.error("unknown system")
    if args.tokens < 1 or args.repeats < 1:
        p.error("--tokens and --repeats must be >= 1")
    if not 0 <= args.tokens_spread < args.tokens:
        p.error(
            f"--tokens-spread {args.tokens_spread}: it must lie in [0, --tokens) so that every run makes a token"
        )
    if args.built and set(systems) != {"ours"}:
        p.error("--built runs ours alone (--systems ours)")
    if args.cfm_dtype not in ("float32", "bfloat16", "float16"):
        p.error(f"--cfm-dtype {args.cfm_dtype}: float32, bfloat16 or float16")
    if args.plain_products and (set(systems) != {"ours"} or args.cfm_dtype == "float32"):
        p.error("--plain-products applies to ours (--systems ours) with a half-precision --cfm-dtype")
    if args.plain_products and (args.device == "cpu" or not mx.cuda.is_available()):
        p.error("--plain-products turns off a CUDA kernel: it needs MLX's CUDA backend and the GPU")
    cfm.TILED_PRODUCTS = not args.plain_products
    if args.mark_spectra != "auto" and (args.no_watermark or set(systems) != {"ours"}):
        p.error("--mark-spectra applies to ours (--systems ours) with the watermark on")
    watermark_module.SPECTRA_ON_DEVICE = {"auto": None, "device": True, "host": False}[args.mark_spectra]
    if args.prefill_budget != "auto":
        if set(systems) != {"ours"}:
            p.error("--prefill-budget applies to ours (--systems ours)")
        memory.PREFILL_BUDGET_PER_ROW = args.prefill_budget
    checkpoint = Path(args.checkpoint)
    if args.write_checkpoint:
        write_checkpoint(checkpoint, args.upstream_src)
    missing = [name for name in CHECKPOINT_FILES if not (checkpoint / name).is_file()]
    if systems and missing and not args.built:
        raise SystemExit(
            f"{checkpoint} lacks {', '.join(missing)}: run this script with --write-checkpoint first"
        )
    clip = None
    if not args.built:
        clip = write_clip(side_paths(checkpoint)[1] / f"voice_{args.clip_seconds:g}s.wav", args.clip_seconds)
    mlx_device = args.device or ("gpu" if mx.is_available(mx.gpu) else "cpu")
    info = machine_info()
    watermark = not args.no_watermark
    rows = []
    for system in systems:
        print(f"# e2e {system} ...", file=sys.stderr)
        # A system run before may still hold its model in reference cycles: collected here, or its weights count
        # in this one's peak (run Y: 3.6, 5.7, 7.7 and 3.6 GB for four runs in one process).
        gc.collect()
        mx.clear_cache()
        if system == "ours":
            res, dev = (
                bench_ours(
                    checkpoint,
                    clip,
                    args.tokens,
                    args.repeats,
                    watermark,
                    mlx_device,
                    args.built,
                    args.cfm_dtype,
                    args.memory_budget,
                    args.tokens_spread,
                ),
                mlx_device,
            )
        else:
            res = bench_upstream(
                checkpoint,
                clip,
                args.tokens,
                args.repeats,
                watermark,
                args.torch_device,
                args.upstream_src,
                args.tokens_spread,
            )
            dev = res.pop("torch_device")
        row = dict(
            system=system,
            device=dev,
            tokens=args.tokens,
            tokens_spread=args.tokens_spread,
            repeats=args.repeats,
            clip_s=None if args.built else args.clip_seconds,
        )
        row.update(watermark=watermark, text=TEXT, **res, rss_peak_mib=rss_peak_mib(), **info)
        if system == "ours":
            row.update(
                tiled_products=not args.plain_products,
                mark_on_device=watermark_module.spectra_on_device(),
                memory_budget=args.memory_budget,
                prefill_budget=memory.PREFILL_BUDGET_PER_ROW,
            )
        write_line(row, args.out)
        rows.append(row)
    if rows:
        print(
            f"{'system':9} {'device':7} {'voice s':>8} {'total s':>8} {'T3 s':>7} {'S3Gen s':>8} {'wm s':>6} "
            f"{'RTF':>7} {'peak MiB':>9}",
            file=sys.stderr,
        )
    for r in rows:
        print(
            f"{r['system']:9} {r['device']:7} {r['voice_s'] or float('nan'):>8.3f} {r['total_s']:>8.3f} "
            f"{r['t3_s']:>7.3f} {r['s3gen_s']:>8.3f} {r['watermark_s']:>6.3f} {r['rtf']:>7.4f} "
            f"{(r['peak_mem_bytes'] or float('nan')) / 2**20:>9.0f}",
            file=sys.stderr,
        )
        if "stage_peak_mib" in r:
            stages = ", ".join(f"{stage} {mib}" for stage, mib in r["stage_peak_mib"].items())
            print(
                f"  {r['system']}: peak MiB by stage {stages}; {r['resident_mib']} after; first token "
                f"{r['first_token_ms']} ms",
                file=sys.stderr,
            )


if __name__ == "__main__":
    main()
