#!/usr/bin/env bash
# Here, once per checkout: the wheels a fresh device machine needs, in .whl/ (ignored by git), in pieces that fit
# the device tool's 64 MiB per call beside the tree: .whl/a, .whl/b (two 30 MB parts of mlx-cuda-13),
# .whl/c (the last part and mlx), .whl/d (what serve and the tests import that the machine lacks).
# `wheels.sh upstream` adds what upstream's side of compare.py needs (its checkpoint and text -> wav), each a
# call's carry (with the tree's 28 MiB, under the 64 MiB a call takes): .whl/e (chatterbox-tts and its pure-Python
# needs, 5 MiB), .whl/h (resemble-perth, 33 MiB), .whl/f (numba and llvmlite, 61 MiB: too big beside the tree
# today), .whl/g (scipy) and .whl/x (scikit-learn, Pillow); install.sh a says which the machine lacks (run AO's
# image lacked only those of e and h).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
get() { python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "$@" 2>&1 | grep -v WARNING || true; }
if [ "${1:-}" = upstream ]; then
  rm -rf .whl/e .whl/f .whl/g .whl/h .whl/x && mkdir -p .whl/e .whl/f .whl/g .whl/h .whl/x
  platforms=(--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
             --platform manylinux2014_x86_64 --platform any)
  # omegaconf 2.4.0: 2.3 needs antlr4-python3-runtime 4.9, which PyPI has as a source archive only.
  get --no-deps "${platforms[@]}" -d .whl/e chatterbox-tts==0.1.7 s3tokenizer==0.3.0 diffusers==0.29.0 \
      conformer==0.3.2 omegaconf==2.4.0 librosa==0.11.0 resemble-perth==1.0.1 pyloudnorm==0.2.0 'setuptools<81' \
      audioread lazy_loader pooch platformdirs msgpack decorator einops joblib threadpoolctl scikit-learn pillow \
      importlib_metadata zipp
  mv .whl/e/resemble_perth-* .whl/h/ && mv .whl/e/scikit_learn-* .whl/e/pillow-* .whl/x/
  get --no-deps "${platforms[@]}" -d .whl/f numba llvmlite
  get --no-deps "${platforms[@]}" -d .whl/g scipy
  du -sh .whl/e .whl/f .whl/g .whl/h .whl/x
  exit 0
fi
rm -rf .whl && mkdir -p .whl/a .whl/b .whl/c .whl/d
w=$(mktemp -d)
get --no-deps --platform manylinux_2_35_x86_64 -d "$w" mlx==0.32.4 mlx-cuda-13==0.32.4
split -b 30m "$w"/mlx_cuda_13-*.whl .whl/part
mv .whl/partaa .whl/a/ && mv .whl/partab .whl/b/ && mv .whl/partac .whl/c/ && cp "$w"/mlx-0.32.4-*.whl .whl/c/
# soundfile's manylinux wheel bundles libsndfile (its any-platform wheel does not, and the machine has none).
get --no-deps --platform manylinux_2_28_x86_64 -d .whl/d "soundfile==0.13.1"
get --platform manylinux_2_35_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl/d soxr cffi fastapi uvicorn python-multipart pytest
# The machine has these (torch's image); their wheels would only crowd the call.
rm -f .whl/d/numpy-* .whl/d/soundfile-0.1[4-9]* .whl/d/packaging-* .whl/d/idna-*
du -sh .whl/*
