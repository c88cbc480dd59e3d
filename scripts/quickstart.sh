#!/usr/bin/env bash
# Install mlx-chatterbox into .venv, convert a Chatterbox checkpoint into models/NAME-mlx, speak a sentence into
# out/quickstart.wav, then clone the voice of that recording (out/voice.safetensors) and speak with it into
# out/cloned.wav.
# Usage: scripts/quickstart.sh [SRC]
#   SRC: a Hugging Face repo id (default: ResembleAI/chatterbox), an upstream checkpoint folder, or "random":
#        a random-weight checkpoint in upstream layout, written by upstream's own modules (installs torch),
#        for machines without Hub access.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:-ResembleAI/chatterbox}
max_tokens=1000
step() { printf '\n==> %s\n' "$*"; }

step "1/4 Installing mlx-chatterbox into .venv"
scripts/install_openblas.sh
[ -x .venv/bin/python ] || python3 -m venv .venv
export PYTHON=.venv/bin/python
source scripts/common.sh
extra=""
[ "$(uname)" = Linux ] && extra="cpu"
if package_installed "$extra"; then
    echo "already installed (pyproject.toml unchanged since)"
else
    install_package "$extra"
fi

if [ "$src" = random ]; then
    src=models/random-upstream
    max_tokens=50  # random weights almost never say stop
    if [ ! -d "$src" ]; then  # random_checkpoint.py writes the folder whole or not at all
        step "    Writing a random-weight checkpoint in upstream layout ($src; installs torch)"
        scripts/install_oracle.sh
        $PYTHON scripts/random_checkpoint.py "$src"
    fi
fi
dst=models/$(basename "$src")-mlx
step "2/4 Converting $src into $dst"
# Convert once, and again when this version of mlx-chatterbox reads a newer format than the folder has.
current=$($PYTHON -c "import json, sys; from mlx_chatterbox.convert import FORMAT_VERSION as v
try: sys.exit(json.load(open('$dst/config.json'))['format_version'] != v)
except OSError: sys.exit(1)" && echo yes || echo no)
if [ "$current" = yes ]; then
    echo "$dst is already converted"
else
    .venv/bin/mlx-chatterbox convert "$src" "$dst" --overwrite
fi
mkdir -p out
step "3/4 Speaking a sentence with the built-in voice"
.venv/bin/mlx-chatterbox say "Hello from MLX. This is Chatterbox, running without PyTorch." \
    --model "$dst" --seed 0 --max-new-tokens "$max_tokens" -o out/quickstart.wav --verbose
echo "wrote out/quickstart.wav"
step "4/4 Cloning that voice and speaking with it"
.venv/bin/mlx-chatterbox voice out/quickstart.wav --model "$dst" -o out/voice.safetensors --verbose
.venv/bin/mlx-chatterbox say "And this is a cloned voice." --voice out/voice.safetensors \
    --model "$dst" --seed 0 --max-new-tokens "$max_tokens" -o out/cloned.wav --verbose
echo "wrote out/voice.safetensors and out/cloned.wav"
step "Done. To use the command yourself: source .venv/bin/activate && mlx-chatterbox --help"
