"""The install scripts skip work that is done already and drop pip's known conflict report (scripts/common.sh,
scripts/install_oracle.sh), run with a stand-in ``python`` whose ``-m pip`` only records its arguments."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFLICTS = """\
ERROR: pip's dependency resolver does not currently take into account all the packages that are installed. \
This behaviour is the source of the following dependency conflicts.
chatterbox-tts 0.1.7 requires numpy<1.26.0,>=1.24.0, but you have numpy 2.3.4 which is incompatible.
chatterbox-tts 0.1.7 requires torch==2.6.0, but you have torch 2.13.0+cpu which is incompatible.
some-other 1.0 requires thing>2, but you have thing 1.0 which is incompatible.
"""


def stand_in_python(tmp: Path, real: str) -> tuple[Path, Path]:
    """A ``python`` that runs ``real`` except for ``-m pip``, which appends its arguments to the returned log
    and prints pip's conflict report to stderr."""
    log = tmp / "pip.log"
    (tmp / "conflicts.txt").write_text(CONFLICTS)
    python = tmp / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1 $2" = "-m pip" ]; then\n'
        f'    shift 2; echo "$*" >>{log}; cat {tmp / "conflicts.txt"} >&2; exit 0\n'
        "fi\n"
        f'exec {real} "$@"\n'
    )
    python.chmod(0o755)
    return python, log


def bash(script: str, cwd: Path, python: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env={**os.environ, "PYTHON": str(python)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def pip_calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_the_package_is_installed_again_only_when_pyproject_changes(tmp_path):
    env = tmp_path / "env"
    venv.create(env, with_pip=False)  # the stamp lives in the environment (sys.prefix)
    python, log = stand_in_python(tmp_path, str(env / "bin" / "python"))
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "common.sh", repo / "scripts")
    shutil.copy(ROOT / "pyproject.toml", repo)
    install = 'source scripts/common.sh; install_package "cpu,test"'

    first = bash(install, repo, python)
    assert first.returncode == 0, first.stderr
    assert pip_calls(log) == ["install -q --upgrade pip", "install -q -e .[cpu,test]"]
    # pip's report of chatterbox-tts's pins is dropped; anything else it says still shows.
    other = "some-other 1.0 requires thing>2, but you have thing 1.0 which is incompatible.\n"
    assert first.stdout == "" and first.stderr == 2 * other

    again = bash(install, repo, python)
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")
    assert len(pip_calls(log)) == 2
    assert bash('source scripts/common.sh; package_installed "cpu,test"', repo, python).returncode == 0
    assert bash('source scripts/common.sh; package_installed "cpu"', repo, python).returncode == 1

    with open(repo / "pyproject.toml", "a") as f:
        f.write("\n# a changed dependency\n")
    assert bash(install, repo, python).returncode == 0
    assert pip_calls(log)[2:] == ["install -q --upgrade pip", "install -q -e .[cpu,test]"]
    assert bash('source scripts/common.sh; install_package ""', repo, python).returncode == 0
    assert pip_calls(log)[-1] == "install -q -e ."


@pytest.mark.skipif(importlib.util.find_spec("chatterbox") is None, reason="needs the oracle installed")
def test_the_oracle_is_not_installed_again(tmp_path):
    python, log = stand_in_python(tmp_path, sys.executable)
    run = bash(str(ROOT / "scripts" / "install_oracle.sh"), tmp_path, python)
    assert (run.returncode, run.stdout, run.stderr, pip_calls(log)) == (0, "", "", [])


def test_the_oracle_is_installed_where_a_pin_is_not_met(tmp_path):
    env = tmp_path / "env"
    venv.create(env, with_pip=False)  # nothing installed
    python, log = stand_in_python(tmp_path, str(env / "bin" / "python"))
    bash(str(ROOT / "scripts" / "install_oracle.sh"), tmp_path, python)  # stops later: nothing was installed
    assert [c.split()[:3] for c in pip_calls(log)] == [
        ["install", "-q", "torch==2.13.0"],
        ["install", "-q", "--no-deps"],
        ["install", "-q", "transformers==5.2.0"],
    ]
