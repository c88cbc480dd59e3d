#!/usr/bin/env bash
# Install mlx-chatterbox into .venv, convert a Chatterbox checkpoint, and generate speech tokens for a sentence.
# Usage: scripts/quickstart.sh [SRC]
#   SRC: a Hugging Face repo id (default: ResembleAI/chatterbox), an upstream checkpoint folder, or "random":
#        a random-weight checkpoint in upstream layout, written by upstream's own modules (installs torch),
#        for machines without Hub access.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:-ResembleAI/chatterbox}
max_tokens=1000

scripts/install_openblas.sh
[ -x .venv/bin/python ] || python3 -m venv .venv
export PYTHON=.venv/bin/python
extra=""
[ "$(uname)" = Linux ] && extra="[cpu]"
$PYTHON -m pip install -q -e ".$extra"

if [ "$src" = random ]; then
    scripts/install_oracle.sh
    [ -f models/random-upstream/t3_cfg.safetensors ] || $PYTHON scripts/random_checkpoint.py models/random-upstream
    src=models/random-upstream
    max_tokens=50  # random weights almost never say stop
fi
dst=models/$(basename "$src")-mlx
[ -f "$dst/config.json" ] || .venv/bin/mlx-chatterbox convert "$src" "$dst"
.venv/bin/mlx-chatterbox tokens "Hello from MLX. This is Chatterbox, running without PyTorch." \
    --model "$dst" --seed 0 --max-new-tokens "$max_tokens" --verbose
