#!/usr/bin/env bash
# The programs the tests use: espeak-ng (speech-like test clips) and sox (resampling, channels, bit depths) for the
# voice-cloning tests, a C++20 compiler (g++) that runs our CUDA kernels' sources on the CPU
# (tests/emulated_cuda.py), and on Linux Chromium with its WebDriver for the playground's browser test
# (tests/test_playground.py skips without them). Debian/Ubuntu as root installs them; elsewhere install them yourself.
# Not installed here: CUDA's nvcc ($CUDA_HOME, else /usr/local/cuda), with which tests/compiled_cuda.py builds our
# kernels for sm_90a where a machine has it (the development image does); without it that test is skipped.
set -euo pipefail
need=()
command -v espeak-ng >/dev/null || need+=(espeak-ng)
command -v sox >/dev/null || need+=(sox)
command -v g++ >/dev/null || need+=(g++)
browser=()
if [ "$(uname)" = Linux ]; then
    command -v chromium >/dev/null || command -v chromium-browser >/dev/null || browser+=(chromium)
    command -v chromedriver >/dev/null || browser+=(chromium-driver)
fi
[ ${#need[@]} -eq 0 ] && [ ${#browser[@]} -eq 0 ] && exit 0
if [ "$(uname)" = Linux ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    [ ${#need[@]} -eq 0 ] || apt-get install -y -qq "${need[@]}" >/dev/null
    if [ ${#browser[@]} -gt 0 ] &&
        ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${browser[@]}" >/dev/null; then
        echo "warning: could not install ${browser[*]}: the playground's browser test will be skipped" >&2
    fi
elif [ ${#need[@]} -gt 0 ]; then
    echo "error: the tests need ${need[*]} (macOS: brew install espeak-ng sox; xcode-select --install)" >&2
    exit 1
else
    echo "note: without ${browser[*]} the playground's browser test is skipped" >&2
fi
