"""Process-wide MLX settings that must be in place before ``mlx.core`` is first imported.

1. Optimised BLAS on Linux CPUs. The ``mlx[cpu]`` wheel bundles the reference netlib BLAS, about 30x slower on
   fp32 matmuls than OpenBLAS. Loading OpenBLAS with global symbol scope before ``mlx.core`` makes MLX's
   ``cblas_*`` calls resolve to it. ``MLX_CHATTERBOX_BLAS`` chooses: ``auto`` (default: OpenBLAS when the system
   has it), ``off`` (keep the bundled BLAS), or a path to a shared library.
2. Full fp32 matmuls. MLX runs fp32 matmuls as TF32 on CUDA and on M5-class Apple GPUs unless
   ``MLX_ENABLE_TF32=0`` (measured on an H200: 3e-4 relative error per product). Upstream Chatterbox runs true
   fp32 (PyTorch's default), so we set ``MLX_ENABLE_TF32=0`` unless the user has set it. bf16/fp16 models are
   unaffected.

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
STATUS: dict[str, str] = {}
# True once a BLAS library was loaded process-wide. It also serves every other library in the process: PyTorch's
# CPU kernels ran ~20x slower beside it here (benchmarks/README.md), so keep torch CPU work in another process.
BLAS_PRELOADED = False

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


def configure() -> dict[str, str]:
    """Apply both settings once; returns (and logs) what was done."""
    if not STATUS:
        STATUS.update(blas=_blas(), fp32_matmul=_tf32())
        for key, value in STATUS.items():
            logger.info("%s: %s", key, value)
    return STATUS
