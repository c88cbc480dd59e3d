#!/usr/bin/env bash
# Install everything the tests need into .venv (the package, pytest, the upstream oracle, OpenBLAS) and run them;
# what is installed already is not installed again.
# Usage: scripts/test.sh [pytest args]     (.ci/run runs exactly this with CI=true)
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install_openblas.sh
scripts/install_test_tools.sh
[ -x .venv/bin/python ] || python3 -m venv .venv
export PYTHON=.venv/bin/python
source scripts/common.sh
extra=test
[ "$(uname)" = Linux ] && extra="cpu,test"
install_package "$extra"  # nothing to do when pyproject.toml is unchanged since the last install
scripts/install_oracle.sh  # nothing to do when every pin is met
exec $PYTHON -m pytest -q "$@"
