"""Process-wide MLX settings that must be in place before ``mlx.core`` is first imported.

1. Optimised BLAS on Linux CPUs. The ``mlx[cpu]`` wheel bundles the reference netlib BLAS, about 30x slower on
   fp32 matmuls than OpenBLAS. Loading OpenBLAS with global symbol scope before ``mlx.core`` makes MLX's
   ``cblas_*`` calls resolve to it. ``MLX_CHATTERBOX_BLAS`` chooses: ``auto`` (default: OpenBLAS when the system
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
MALLOC_VAR = "MLX_CHATTERBOX_MALLOC"
# glibc mallopt parameters (malloc.h) and the freed heap memory kept before trimming.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_KEEP_FREED = 1 << 30
STATUS: dict[str, str] = {}
# True once a BLAS library was loaded process-wide. It also serves every other library in the process: PyTorch's
# CPU kernels ran ~20x slower beside it here (benchmarks/README.md), so keep torch CPU work in another process.
BLAS_PRELOADED = False
MALLOC_TUNED = False  # True once glibc was told to serve large arrays from the heap

logger = logging.getLogger("mlx_chatterbox")


def _blas() -> str:
    choice = os.environ.get(BLAS_VAR, "auto").strip() or "auto"
    if sys.platform != "linux":
        return "MLX's own BLAS (only Linux needs a preload)"
    if choice == "off":
        return f"MLX's bundled reference BLAS ({BLAS_VAR}=off)"
    if "mlx.core" in sys.modules:
        return (
            "MLX's bundled reference BLAS: mlx.core was imported before mlx_chatterbox, too late to preload "
            "OpenBLAS (import mlx_chatterbox first, or set LD_PRELOAD=libopenblas.so.0)"
        )
    if choice == "auto":
        path = ctypes.util.find_library("openblas")
        if path is None:
            return "MLX's bundled reference BLAS: no OpenBLAS found (on Debian/Ubuntu: apt-get install libopenblas0-pthread)"
        _preload(path)
        return f"OpenBLAS ({path})"
    try:
        _preload(choice)
    except OSError as e:
        raise OSError(
            f"{BLAS_VAR}={choice!r} could not be loaded ({e}); unset it or set it to 'auto' or 'off'"
        )
    return f"{choice} ({BLAS_VAR})"


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
        STATUS.update(blas=_blas(), fp32_matmul=_tf32(), malloc=_malloc())
        for key, value in STATUS.items():
            logger.info("%s: %s", key, value)
    return STATUS
