#!/usr/bin/env bash
# Install everything the tests need into .venv (the package, pytest, the upstream oracle, OpenBLAS) and run them.
# Usage: scripts/test.sh [pytest args]     (.ci/run runs exactly this with CI=true)
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install_openblas.sh
scripts/install_test_tools.sh
[ -x .venv/bin/python ] || python3 -m venv .venv
export PYTHON=.venv/bin/python
$PYTHON -m pip install -q --upgrade pip
extra=test
[ "$(uname)" = Linux ] && extra="cpu,test"
$PYTHON -m pip install -q -e ".[$extra]"
scripts/install_oracle.sh
exec $PYTHON -m pytest -q "$@"
