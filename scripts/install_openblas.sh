#!/usr/bin/env bash
# On Linux, make sure OpenBLAS is installed: mlx_chatterbox loads it so that MLX's CPU matmuls run ~30x faster
# than with the reference BLAS in the mlx[cpu] wheel (mlx_chatterbox/_backend.py). Nothing to do elsewhere.
set -euo pipefail
[ "$(uname)" = Linux ] || exit 0
ldconfig -p | grep -q libopenblas.so.0 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq libopenblas0-pthread >/dev/null
else
    echo "note: OpenBLAS is not installed (Debian/Ubuntu: sudo apt-get install libopenblas0-pthread);" \
        "MLX's CPU backend will be slow" >&2
fi
