#!/usr/bin/env bash
# Install the upstream oracle, chatterbox-tts 0.1.7 (resemble-ai/chatterbox @5de7a54), into the active Python.
# Tests only: the mlx_chatterbox package never imports torch. See docs/adr/0001-port-boundary.md.
set -euo pipefail
py=${PYTHON:-python}
# After each install pip reports chatterbox-tts's own pins (torch 2.6, numpy<2, gradio, ...) as conflicts. They
# are known and deliberately not met (below), so that report is dropped; any other line still shows.
known_conflicts() {
    grep -v -e "^ERROR: pip's dependency resolver does not currently take into account" \
        -e "^chatterbox-tts 0\.1\.7 requires " -e "^s3tokenizer 0\.3\.0 requires " >&2 || true
}

# CPU torch first (the image keeps a torch 2.13 CPU wheel on disk; never pull a CUDA build for tests).
"$py" -m pip install -q torch==2.13.0
# Upstream pins (torch 2.6, numpy<2, ...) cannot be met here and are not needed: install without them.
"$py" -m pip install -q --no-deps chatterbox-tts==0.1.7 s3tokenizer==0.3.0 torchaudio==2.11.1 2>&1 | known_conflicts
"$py" -m pip install -q transformers==5.2.0 diffusers==0.29.0 librosa==0.11.0 conformer==0.3.2 \
    resemble-perth==1.0.1 omegaconf==2.4.0 einops==0.8.2 pyloudnorm==0.2.0 safetensors==0.8.0 onnx==1.23.2 \
    scipy==1.17.1 soundfile==0.14.0 soxr==1.1.0 'setuptools<81' 2>&1 | known_conflicts
# PyPI's torchaudio is a CUDA build whose compiled extension cannot load beside CPU torch; upstream only uses
# its pure-Python parts (kaldi fbank, Resample), so move the extension out of the way.
ta=$("$py" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("torchaudio").origin))')
for so in "$ta"/lib/*.so; do
    [ -e "$so" ] && mv "$so" "$so.disabled"
done
"$py" -c 'import chatterbox.models.t3, chatterbox.models.s3gen, torch; print("oracle ready: chatterbox-tts 0.1.7, torch", torch.__version__)' \
    2> >(grep -v pkg_resources >&2)
