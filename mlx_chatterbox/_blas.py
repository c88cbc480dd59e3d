"""Optimised BLAS for MLX's Linux CPU backend.

The ``mlx[cpu]`` wheel for Linux bundles the reference netlib BLAS, about 30x slower on fp32 matmuls than
OpenBLAS. Loading OpenBLAS with global symbol scope *before* ``mlx.core`` is first imported makes MLX's
``cblas_*`` calls resolve to it. ``MLX_CHATTERBOX_BLAS`` chooses: ``auto`` (default: OpenBLAS when the
system has it), ``off`` (keep the bundled BLAS), or a path to a shared library. The outcome is logged and
kept in ``STATUS``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

ENV_VAR = "MLX_CHATTERBOX_BLAS"
STATUS = "not applied yet"

logger = logging.getLogger("mlx_chatterbox")


def preload() -> str:
    """Load the chosen BLAS into the global symbol scope; returns (and logs) what was done."""
    global STATUS
    choice = os.environ.get(ENV_VAR, "auto").strip() or "auto"
    if sys.platform != "linux":
        STATUS = "MLX's own BLAS (only Linux needs a preload)"
    elif choice == "off":
        STATUS = f"MLX's bundled reference BLAS ({ENV_VAR}=off)"
    elif "mlx.core" in sys.modules:
        STATUS = (
            "MLX's bundled reference BLAS: mlx.core was imported before mlx_chatterbox, too late to preload "
            "OpenBLAS (import mlx_chatterbox first, or set LD_PRELOAD=libopenblas.so.0)"
        )
    elif choice == "auto":
        path = ctypes.util.find_library("openblas")
        if path is None:
            STATUS = (
                "MLX's bundled reference BLAS: no OpenBLAS found "
                "(on Debian/Ubuntu: apt-get install libopenblas0-pthread)"
            )
        else:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            STATUS = f"OpenBLAS ({path})"
    else:
        try:
            ctypes.CDLL(choice, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise OSError(f"{ENV_VAR}={choice!r} could not be loaded ({e}); unset it or set it to 'auto' or 'off'")
        STATUS = f"{choice} ({ENV_VAR})"
    logger.info("CPU BLAS: %s", STATUS)
    return STATUS
