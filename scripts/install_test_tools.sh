#!/usr/bin/env bash
# The programs the voice-cloning tests use to make speech-like test clips: espeak-ng (speech) and sox
# (resampling, channels, bit depths). Debian/Ubuntu as root installs them; elsewhere install them yourself.
set -euo pipefail
command -v espeak-ng >/dev/null && command -v sox >/dev/null && exit 0
if [ "$(uname)" = Linux ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq espeak-ng sox >/dev/null
else
    echo "error: the tests need espeak-ng and sox (macOS: brew install espeak-ng sox)" >&2
    exit 1
fi
