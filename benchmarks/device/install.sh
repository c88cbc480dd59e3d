#!/usr/bin/env bash
# On a fresh device machine, in three back-to-back `run` calls (it is taken back after 30 s idle):
#   1. carry [".whl/a"]: bash benchmarks/device/install.sh a
#   2. carry [".whl/b", ".ptx"]: bash benchmarks/device/install.sh b
#   3. carry [".whl/c", ".whl/d"]: bash benchmarks/device/install.sh c && <the work, e.g. start.sh>
# For upstream's side of compare.py, first carry [".whl/e"], [".whl/h"], ... with install.sh e, h, ..., those that
# install.sh a says the image lacks (wheels.sh upstream makes them: e and h for run AO's image).
# MLX-CUDA goes into the image's python3 (a venv does not see its torch); the rest into /tmp/site.
# .ptx/ptx.tgz (ignored by git), when there is one, is MLX's kernel cache of an earlier lease (wait.sh brings it
# back: cp /work/.device/N/ptx.tgz .ptx/): compiling our kernels took most of a fresh machine's 6 minutes of
# tests/test_decode_cuda.py. MLX names a cached kernel by a hash of its source, so a changed kernel is compiled
# anew.
set -euo pipefail
mkdir -p ~/stash ~/res ~/ptx
case "$1" in
  a)
    cp .whl/a/* ~/stash/
    # What upstream's side of compare.py imports that the image lacks (wheels.sh upstream; install.sh e, f, g).
    python3 -c "import importlib.util as u; print('upstream lacks:', *[m for m in ('scipy', 'sklearn', 'numba',
'llvmlite', 'librosa', 'diffusers', 'conformer', 'omegaconf', 'perth', 's3tokenizer', 'pyloudnorm', 'PIL',
'importlib_metadata', 'einops', 'huggingface_hub', 'soundfile') if u.find_spec(m) is None] or ['nothing'])"
    ;;
  b)
    cp .whl/b/* ~/stash/
    if [ -f .ptx/ptx.tgz ]; then tar xzf .ptx/ptx.tgz -C ~/ptx && echo "kernel cache: $(ls ~/ptx | wc -l) entries"; fi
    ;;
  c)
    cat ~/stash/partaa ~/stash/partab .whl/c/partac > ~/stash/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
    python3 -m pip install -q --no-index --no-deps ~/stash/mlx_cuda_13-*.whl .whl/c/mlx-0.32.4-*.whl
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/d/*.whl
    python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.cuda.is_available())"
    ;;
  e | f | g | h | x) python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/"$1"/*.whl ;;
  *) echo "usage: install.sh a|b|c|e|f|g|h|x" >&2; exit 2 ;;
esac
