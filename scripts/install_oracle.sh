#!/usr/bin/env bash
# Install the upstream oracle, chatterbox-tts 0.1.7 (resemble-ai/chatterbox @5de7a54), into the active Python;
# nothing to do (and nothing printed) when every pinned version below is installed already.
# Tests only: the mlx_chatterbox package never imports torch. See docs/adr/0001-port-boundary.md.
set -euo pipefail
PYTHON=${PYTHON:-python}
source "$(dirname "$0")/common.sh"

# CPU torch first (the image keeps a torch 2.13 CPU wheel on disk; never pull a CUDA build for tests).
torch=(torch==2.13.0)
# Upstream pins (torch 2.6, numpy<2, ...) cannot be met here and are not needed: these go in without them.
no_deps=(chatterbox-tts==0.1.7 s3tokenizer==0.3.0 torchaudio==2.11.1)
rest=(transformers==5.2.0 diffusers==0.29.0 librosa==0.11.0 conformer==0.3.2 resemble-perth==1.0.1
    omegaconf==2.4.0 einops==0.8.2 pyloudnorm==0.2.0 safetensors==0.8.0 onnx==1.23.2 scipy==1.17.1
    soundfile==0.14.0 soxr==1.1.0 'setuptools<81')

# PyPI's torchaudio is a CUDA build whose compiled extension cannot load beside CPU torch; upstream only uses
# its pure-Python parts (kaldi fbank, Resample), so the extension is moved out of the way.
disable_torchaudio_extension() {
    local ta so
    ta=$("$PYTHON" -c 'import importlib.util as u, os
print(os.path.dirname(u.find_spec("torchaudio").origin))')
    for so in "$ta"/lib/*.so; do
        [ -e "$so" ] && mv "$so" "$so.disabled"
    done
    return 0
}

# Every pin met (== as pip reads it: a local label such as +cpu aside; < by release numbers) and torchaudio's
# extension already out of the way?
if "$PYTHON" - "${torch[@]}" "${no_deps[@]}" "${rest[@]}" <<'PY'; then
import glob, importlib.metadata as md, importlib.util, os, re, sys

def release(v):
    return tuple(int(x) for x in re.match(r"\d+(\.\d+)*", v).group().split("."))

for pin in sys.argv[1:]:
    name, op, want = re.match(r"([\w.-]+)(==|<)(.+)", pin).groups()
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        sys.exit(1)
    if (op == "==" and have.split("+")[0] != want) or (op == "<" and release(have) >= release(want)):
        sys.exit(1)
ta = importlib.util.find_spec("torchaudio")
sys.exit(1 if glob.glob(os.path.join(os.path.dirname(ta.origin), "lib", "*.so")) else 0)
PY
    exit 0
fi

"$PYTHON" -m pip install -q "${torch[@]}" 2>&1 | known_conflicts
"$PYTHON" -m pip install -q --no-deps "${no_deps[@]}" 2>&1 | known_conflicts
"$PYTHON" -m pip install -q "${rest[@]}" 2>&1 | known_conflicts
disable_torchaudio_extension
"$PYTHON" -c 'import chatterbox.models.t3, chatterbox.models.s3gen, torch
print("oracle ready: chatterbox-tts 0.1.7, torch", torch.__version__)' 2> >(grep -v pkg_resources >&2)
