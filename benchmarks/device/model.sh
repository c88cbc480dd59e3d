#!/usr/bin/env bash
# A random full-size VARIANT (english or turbo) model in /tmp/serve-VARIANT/mlx and a random voice for it in
# /tmp/serve-VARIANT/voice.safetensors (bench_serve.write_random_model; nothing is done when they exist):
#   bash benchmarks/device/model.sh english
set -euo pipefail
dir=/tmp/serve-$1
[ -d "$dir/mlx" ] || PYTHONPATH=/tmp/site:. python3 -c "
import sys; sys.path[:0] = ['benchmarks', '.']
from pathlib import Path; import bench_serve
d = Path('$dir'); d.mkdir(exist_ok=True); bench_serve.write_random_model('full', '$1', d)"
