#!/usr/bin/env bash
# Here, once per checkout: the wheels a fresh device machine needs, in .whl/ (ignored by git), in pieces that fit
# the device tool's 64 MiB per call beside the tree: .whl/a, .whl/b (two 30 MB parts of mlx-cuda-13),
# .whl/c (the last part and mlx), .whl/d (what serve and the tests import that the machine lacks).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl/a .whl/b .whl/c .whl/d
w=$(mktemp -d)
get() { python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "$@" 2>&1 | grep -v WARNING || true; }
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
