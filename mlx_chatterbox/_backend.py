"""Process-wide MLX settings that must be in place before ``mlx.core`` is first imported.

1. Optimised BLAS on Linux CPUs. The ``mlx[cpu]`` wheel bundles the reference netlib BLAS, about 30x slower on
   fp32 matmuls than OpenBLAS. Loading OpenBLAS with global symbol scope before ``mlx.core`` makes MLX's
   ``cblas_*`` calls resolve to it; after ``mlx.core`` it is too late (``_blas_after_mlx``), and ``TTS.load``
   warns (``reference_blas_warning``). ``MLX_CHATTERBOX_BLAS`` chooses: ``auto`` (default: OpenBLAS when the system
   has it), ``off`` (keep the bundled BLAS), or a path to a shared library.
2. Full fp32 matmuls. MLX runs fp32 matmuls as TF32 on CUDA and on M5-class Apple GPUs unless
   ``MLX_ENABLE_TF32=0`` (measured on an H200: 3e-4 relative error per product). Upstream Chatterbox runs true
   fp32 (PyTorch's default), so we set ``MLX_ENABLE_TF32=0`` unless the user has set it. bf16/fp16 models are
   unaffected.
3. Large arrays from the heap on Linux (glibc). MLX's CPU backend takes each array from ``malloc``, and glibc
   serves every block over 32 MB with a fresh ``mmap``, whose pages fault in one by one on first touch and go back
   to the system on free. At 10 s of audio many S3Gen arrays are that large (attention scores, im2col columns):
   serving them from the heap made HiFT 1.6x and a CFM step 1.2x faster on 2 EPYC cores. The cost: up to 1 GiB of
   freed memory stays in the process for reuse. ``MLX_CHATTERBOX_MALLOC``: ``auto`` (default) or ``off``.
4. MLX-CUDA's caches never fail a call. MLX-CUDA (0.32.4) keeps cuFFT plans, cuDNN convolution and attention
   graphs and each stream's CUDA graphs in LRU caches of 64-400 entries, keyed by shape or by the graph's
   topology, and raises "Cache thrashing is happening" once a cache has missed twice its capacity in the
   process's life. A long-lived process that meets text of every length (the server, bulk jobs) would then fail
   requests where building the plan again costs a little time. So we set ``MLX_ENABLE_CACHE_THRASHING_CHECK=0``
   unless the user has set it: MLX then evicts and rebuilds. MLX reads it when each cache is first used.
5. Room for every convolution shape. MLX-CUDA builds a cuDNN graph for each convolution shape on first use and
   keeps 128 per thread (``MLX_CUDA_CONV_CACHE_SIZE``). One S3Gen decode runs about 41 shapes (HiFT 37), so a
   server's stream, whose decodes each meet a new length, evicted the first chunk's graphs within 3-4 decodes,
   and every first decode paid ~100 ms of planning again. We set ``MLX_CUDA_CONV_CACHE_SIZE=1024`` unless the
   user has set it (run AP, H100: a lone served Turbo stream's first audio 115 ms against 217, English 235
   against 327). MLX reads it when a thread first runs a convolution. Since 2026-12-06 our kernel
   takes the float32 convolutions on CUDA (``layers.KERNEL_CONVS``: HiFT's, the flow's, the watermark's), and
   plans nothing; the cache serves the rest, and every convolution with the kernel turned off.
6. Small CUDA graphs. MLX-CUDA records a stream's kernels as CUDA graphs of up to 100 kernels on Hopper
   (``MLX_MAX_OPS_PER_BUFFER``), and a kernel's inputs and each cuBLAS/cuDNN workspace stay allocated until
   its whole graph has run. A memory bound (``models/memory.py``) can wait only for graphs already closed, so
   an open graph's kernels rose above any bound: S3Gen held 714-857 MiB above the memory in use at a budget of
   0 or 256 MiB, against 219-355 MiB with graphs of 20 (H100, benchmarks/RESULTS.md run BA). With 20 and
   S3Gen's budget of 256 MiB, text -> wav of 10 s peaked at 3,042-3,096 MiB against 3,521-3,897 (T3's prefill
   306-399 MiB above the weights against 590-877) in 0.81-0.91 s against 0.78-0.82 with MLX's graphs at 1 GiB,
   and a lone stream's first audio came as soon. We set ``MLX_MAX_OPS_PER_BUFFER=20`` on Linux unless the user
   has set it; MLX reads it once a process, at its first GPU work. MLX's CPU backend does not read it; Metal
   tunes it per chip, so macOS is left alone.

What was done is logged and kept in ``STATUS``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

BLAS_VAR = "MLX_CHATTERBOX_BLAS"
TF32_VAR = "MLX_ENABLE_TF32"
CACHE_CHECK_VAR = "MLX_ENABLE_CACHE_THRASHING_CHECK"
CONV_CACHE_VAR = "MLX_CUDA_CONV_CACHE_SIZE"
CONV_CACHE_SIZE = "1024"
GRAPH_OPS_VAR = "MLX_MAX_OPS_PER_BUFFER"
GRAPH_OPS = "20"
MALLOC_VAR = "MLX_CHATTERBOX_MALLOC"
# glibc mallopt parameters (malloc.h) and the freed heap memory kept before trimming.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_KEEP_FREED = 1 << 30
STATUS: dict[str, str] = {}
# True once a BLAS library was loaded process-wide. It also serves every other library in the process: PyTorch's
# CPU kernels ran ~20x slower beside it here (benchmarks/README.md), so keep torch CPU work in another process.
BLAS_PRELOADED = False
# The BLAS library that would have been preloaded, when mlx.core came first and MLX kept its reference BLAS.
MISSED_BLAS: str | None = None
_NO_OPENBLAS = (
    "MLX's bundled reference BLAS: no OpenBLAS found (on Debian/Ubuntu: apt-get install libopenblas0-pthread)"
)
MALLOC_TUNED = False  # True once glibc was told to serve large arrays from the heap

logger = logging.getLogger("mlx_chatterbox")


def _blas() -> str:
    choice = os.environ.get(BLAS_VAR, "auto").strip() or "auto"
    if sys.platform != "linux":
        return "MLX's own BLAS (only Linux needs a preload)"
    if choice == "off":
        return f"MLX's bundled reference BLAS ({BLAS_VAR}=off)"
    if "mlx.core" in sys.modules:
        return _blas_after_mlx(choice)
    if choice == "auto":
        path = ctypes.util.find_library("openblas")
        if path is None:
            return _NO_OPENBLAS
        _preload(path)
        return f"OpenBLAS ({path})"
    try:
        _preload(choice)
    except OSError as e:
        raise OSError(
            f"{BLAS_VAR}={choice!r} could not be loaded ({e}); unset it or set it to 'auto' or 'off'"
        )
    return f"{choice} ({BLAS_VAR})"


def _blas_after_mlx(choice: str) -> str:
    """What MLX runs when ``mlx.core`` came first. Python loads extensions with RTLD_NOW, so MLX's ``cblas_*``
    calls were bound when it was imported: to a BLAS already in the global symbol scope (LD_PRELOAD), else to the
    bundled one for good. A library loaded now no longer changes them (a 1024x1024 fp32 matmul took 1.2 s with
    OpenBLAS loaded RTLD_GLOBAL after mlx.core, 0.13 s with it loaded before)."""
    global MISSED_BLAS
    found = _global_cblas()
    if found is not None:
        return f"{found} (in the global symbol scope before mlx.core was imported, e.g. by LD_PRELOAD)"
    MISSED_BLAS = ctypes.util.find_library("openblas") if choice == "auto" else choice
    if MISSED_BLAS is None:
        return _NO_OPENBLAS
    return (
        f"MLX's bundled reference BLAS: mlx.core was imported before mlx_chatterbox, too late to preload "
        f"{MISSED_BLAS} (import mlx_chatterbox first, or set LD_PRELOAD={MISSED_BLAS})"
    )


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _global_cblas() -> str | None:
    """The file of the ``cblas_sgemm`` in the process's global symbol scope (where MLX's lookups start), if any."""
    process = ctypes.CDLL(None)  # dlopen(NULL): lookups search the global scope
    try:
        sgemm = process.cblas_sgemm
    except AttributeError:
        return None
    info = _DlInfo()
    if not process.dladdr(ctypes.cast(sgemm, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return "a BLAS library"
    return info.dli_fname.decode(errors="replace")


def reference_blas_warning() -> str | None:
    """Why MLX runs its reference BLAS on this Linux CPU although a faster one was there to preload, and how to
    fix it; None when that is not the case."""
    if MISSED_BLAS is None:
        return None
    import mlx.core as mx  # imported long before (that is the problem this reports)

    if mx.default_device().type != mx.DeviceType.cpu:
        return None
    return (
        f"MLX is running its bundled reference BLAS, 10-30x slower on a CPU than {MISSED_BLAS}, which was "
        "there to preload: mlx.core was imported before mlx_chatterbox, and once MLX is loaded its BLAS cannot "
        "be swapped. Import mlx_chatterbox before mlx.core (and before anything that imports it), or start "
        f"Python with LD_PRELOAD={MISSED_BLAS}; {BLAS_VAR}=off keeps the reference BLAS without this warning."
    )


def _preload(path: str) -> None:
    global BLAS_PRELOADED
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    BLAS_PRELOADED = True


def _tf32() -> str:
    if TF32_VAR in os.environ:
        return f"{TF32_VAR}={os.environ[TF32_VAR]} (set by the user)"
    if "mlx.core" in sys.modules:
        return "MLX's default (TF32 where supported): mlx.core was imported before mlx_chatterbox"
    os.environ[TF32_VAR] = "0"
    return f"{TF32_VAR}=0: fp32 matmuls in full fp32, as upstream (set {TF32_VAR}=1 to allow TF32)"


def _cache_check() -> str:
    if CACHE_CHECK_VAR in os.environ:
        return f"{CACHE_CHECK_VAR}={os.environ[CACHE_CHECK_VAR]} (set by the user)"
    os.environ[CACHE_CHECK_VAR] = "0"
    return (
        f"{CACHE_CHECK_VAR}=0: MLX-CUDA's caches evict and rebuild rather than raise once they have missed twice "
        f"their size (set {CACHE_CHECK_VAR}=1 for MLX's error)"
    )


def _conv_cache() -> str:
    if CONV_CACHE_VAR in os.environ:
        return f"{CONV_CACHE_VAR}={os.environ[CONV_CACHE_VAR]} (set by the user)"
    os.environ[CONV_CACHE_VAR] = CONV_CACHE_SIZE
    return (
        f"{CONV_CACHE_VAR}={CONV_CACHE_SIZE}: MLX-CUDA keeps that many convolution graphs a thread, not 128 "
        f"(set {CONV_CACHE_VAR} to choose)"
    )


def _graph_ops() -> str:
    if GRAPH_OPS_VAR in os.environ:
        return f"{GRAPH_OPS_VAR}={os.environ[GRAPH_OPS_VAR]} (set by the user)"
    if sys.platform != "linux":
        return "MLX's own (the setting is for MLX-CUDA; Metal tunes it per chip)"
    os.environ[GRAPH_OPS_VAR] = GRAPH_OPS
    return (
        f"{GRAPH_OPS_VAR}={GRAPH_OPS}: MLX-CUDA's CUDA graphs of at most {GRAPH_OPS} kernels, which hold "
        f"their inputs until they have run, not 100 (set {GRAPH_OPS_VAR} to choose)"
    )


def _malloc() -> str:
    choice = os.environ.get(MALLOC_VAR, "auto").strip() or "auto"
    if choice not in ("auto", "off"):
        raise ValueError(f"{MALLOC_VAR}={choice!r}: use 'auto' or 'off'")
    if sys.platform != "linux":
        return "the system's malloc (the setting is for glibc)"
    if choice == "off":
        return f"glibc's defaults ({MALLOC_VAR}=off)"
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return "the C library's defaults: it has no mallopt (not glibc)"
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED)):
        return "glibc's defaults: mallopt refused the settings"
    global MALLOC_TUNED
    MALLOC_TUNED = True
    return (
        f"large arrays from the heap, not one mmap each; up to 1 GiB freed kept for reuse ({MALLOC_VAR}=off "
        "restores glibc's defaults)"
    )


def configure() -> dict[str, str]:
    """Apply the settings once; returns (and logs) what was done."""
    if not STATUS:
        STATUS.update(
            blas=_blas(),
            fp32_matmul=_tf32(),
            malloc=_malloc(),
            mlx_caches=_cache_check(),
            conv_graphs=_conv_cache(),
            cuda_graphs=_graph_ops(),
        )
        for key, value in STATUS.items():
            logger.info("%s: %s", key, value)
    return STATUS
