"""What the benchmarks share: the run description (machine, versions, commit, date) and importing upstream
without its package ``__init__`` files, which pull the whole TTS (librosa, perth, s3tokenizer)."""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import random
import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bare_upstream(src: str | None, whole_tts: bool = False) -> None:
    """Make ``chatterbox`` and ``chatterbox.models.s3gen`` bare namespaces: their submodules resolve but their
    ``__init__.py`` never runs. T3 then needs only torch, transformers, tqdm and einops; the S3Gen networks
    need diffusers, conformer, omegaconf and scipy. ``src`` is a folder holding ``chatterbox/``, for
    machines where chatterbox-tts cannot be installed; None finds the installed package.

    whole_tts: only ``chatterbox`` is bare, so that ``chatterbox.tts`` (the whole TTS: librosa, perth,
    s3tokenizer, torchaudio) imports without the package ``__init__``, which also imports the multilingual and
    voice-conversion models and reads the installed version (absent from a copied folder)."""
    if "chatterbox" in sys.modules:
        return
    if src is not None:
        root = Path(src).resolve() / "chatterbox"
    else:
        # find_spec on a top-level name only locates the package; it executes nothing.
        spec = importlib.util.find_spec("chatterbox")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("chatterbox not found: install chatterbox-tts or pass --upstream-src")
        root = Path(list(spec.submodule_search_locations)[0])
    bare = [("chatterbox", root)] + (
        [] if whole_tts else [("chatterbox.models.s3gen", root / "models" / "s3gen")]
    )
    for name, folder in bare:
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package


def refuse_torch_cpu_beside_preload(torch_device: str) -> None:
    """Upstream on the CPU runs as its users run it: not beside our OpenBLAS preload, which slows PyTorch's CPU
    kernels ~20x here (one CFM estimator call: 0.33 s alone, 7.2 s beside it) and would flatter us, nor with our
    allocator setting, which would change its speed too."""
    from mlx_chatterbox import _backend

    if torch_device == "cpu" and (_backend.BLAS_PRELOADED or _backend.MALLOC_TUNED):
        raise SystemExit(
            "upstream on the CPU must run without mlx_chatterbox's process-wide settings; time it in its own "
            "process: MLX_CHATTERBOX_BLAS=off MLX_CHATTERBOX_MALLOC=off python benchmarks/... --systems upstream"
        )


def cache_step(value: str) -> int:
    """An argparse type for ``--cache-step``: T3's KV capacity step in positions (a multiple of 32, the batch's
    KV window)."""
    step = int(value)
    if step < 32 or step % 32:
        raise argparse.ArgumentTypeError(
            f"{step}: give a multiple of 32 (the batched cache's window), e.g. 64"
        )
    return step


def set_cache_step(step: int) -> None:
    """Every T3 prefill (single and batched) makes its KV cache grow ``step`` positions at a time instead of
    256. Run L timed a 128-row step at 9.1 ms at a capacity of 256 and 17.3 ms at 512, the same positions used;
    the attention kernel reads only those, but the window's flush copies whole buffers. A finer step means
    more capacities to trace."""
    from mlx_chatterbox.models.t3 import T3

    prefill = T3.__dict__["prefill"]
    prefill = getattr(prefill, "func", prefill)
    # The library's own step leaves T3 as it is: the benchmarks also run in tests' processes.
    default = inspect.signature(prefill).parameters["cache_step"].default
    T3.prefill = prefill if step == default else functools.partialmethod(prefill, cache_step=step)


def memory_budget(value: str) -> int | str | None:
    """``--memory-budget`` (``S3Gen.memory_budget``): auto, none, or a whole number of MiB (argparse type)."""
    if value in ("auto", "none"):
        return None if value == "none" else "auto"
    if value.isdigit():
        return int(value) * 2**20
    raise argparse.ArgumentTypeError(f"{value!r}: auto, none, or a whole number of MiB")


def request_budget(tokens: int, spread: int, seed: int) -> int:
    """A request's speech tokens: ``tokens``, or with ``--tokens-spread`` one drawn from tokens ± spread (random
    weights never stop early, so without a spread every request has one length and meets the GPU's per-shape
    plans warm, as real text would not)."""
    return tokens + random.Random(seed).randint(-spread, spread) if spread else tokens


def write_line(row: dict, out: str | None) -> None:
    """One JSON line on stdout, appended to ``out`` too."""
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(line + "\n")


def machine_info() -> dict:
    """Platform, CPU, GPU, versions, git commit, date and MLX_* environment of this run."""
    cpu = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        smi = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        gpu = subprocess.run(smi, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        gpu = None
    # A copy of the tree on another machine may carry no (or a stale) .git: BENCH_COMMIT names the commit then.
    commit = os.environ.get("BENCH_COMMIT")
    try:
        git = ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]
        commit = commit or subprocess.run(git, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return dict(
        platform=platform.platform(),
        python=platform.python_version(),
        cpu=cpu,
        gpu=gpu,
        versions={n: version(n) for n in ("mlx", "torch", "transformers")},
        commit=commit or "unknown",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # MLX's knobs set for the run (e.g. MLX_MAX_OPS_PER_BUFFER: ops per CUDA graph), and ours.
        env={k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")},
    )
