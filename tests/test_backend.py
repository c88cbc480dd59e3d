"""Process-wide settings (_backend.py): the allocator switch; the warning when MLX was imported too early to
get OpenBLAS."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mlx_chatterbox import _backend
from mlx_chatterbox.convert import convert
from tests.conftest import TINY_MODEL, random_voice, write_upstream_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SLOW_BLAS = "MLX is running its bundled reference BLAS"
needs_openblas = pytest.mark.skipif(
    sys.platform != "linux" or ctypes.util.find_library("openblas") is None,
    reason="the preload is for Linux with OpenBLAS installed",
)


def test_malloc_setting_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(_backend.MALLOC_VAR, "yes")
    with pytest.raises(ValueError, match="MLX_CHATTERBOX_MALLOC='yes': use 'auto' or 'off'"):
        _backend._malloc()


def test_malloc_setting_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(_backend.MALLOC_VAR, "off")
    want = (
        "glibc's defaults (MLX_CHATTERBOX_MALLOC=off)" if sys.platform == "linux" else "the system's malloc"
    )
    assert _backend._malloc().startswith(want)


@pytest.mark.skipif(sys.platform != "linux", reason="mallopt is glibc's")
def test_malloc_setting_is_applied_and_reported_on_linux(monkeypatch):
    monkeypatch.delenv(_backend.MALLOC_VAR, raising=False)
    assert _backend._malloc().startswith("large arrays from the heap")
    assert _backend.STATUS["malloc"].startswith("large arrays from the heap")  # what import did


@pytest.mark.parametrize(
    "var, key, ours, status",
    [
        # MLX-CUDA's caches raise once they have missed twice their size in a process's life: off.
        ("MLX_ENABLE_CACHE_THRASHING_CHECK", "mlx_caches", "0", "MLX-CUDA's caches evict"),
        # 128 cuDNN convolution graphs a thread are 3-4 of a server's S3Gen decodes: 1,024.
        ("MLX_CUDA_CONV_CACHE_SIZE", "conv_graphs", "1024", "MLX-CUDA keeps that many convolution graphs"),
        # A CUDA graph of 100 kernels holds their inputs past any memory bound: 20 (Linux; Metal has its own).
        pytest.param(
            "MLX_MAX_OPS_PER_BUFFER",
            "cuda_graphs",
            "20",
            "MLX-CUDA's CUDA graphs of at most 20 kernels",
            marks=pytest.mark.skipif(sys.platform != "linux", reason="set for MLX-CUDA, on Linux only"),
        ),
    ],
)
def test_mlx_cuda_settings_are_ours_unless_the_user_set_them(monkeypatch, var, key, ours, status):
    """The package sets MLX-CUDA's cache variables when it is imported, unless the user chose, and reports
    which."""
    setting = {
        "mlx_caches": _backend._cache_check,
        "conv_graphs": _backend._conv_cache,
        "cuda_graphs": _backend._graph_ops,
    }[key]
    monkeypatch.delenv(var, raising=False)
    done = run_python(
        f"import os, mlx_chatterbox; from mlx_chatterbox import _backend; "
        f"print(os.environ['{var}'], _backend.STATUS['{key}'])"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{ours} {var}={ours}: {status}"), done.stdout
    assert setting().startswith(f"{var}={ours}: {status}")
    assert os.environ[var] == ours
    monkeypatch.setenv(var, "7")
    assert setting() == f"{var}=7 (set by the user)"
    assert os.environ[var] == "7"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("blas")
    random_voice(seed=5).save(tmp / "voice.safetensors")
    model = convert(write_upstream_checkpoint(tmp / "up"), tmp / "mlx", config=TINY_MODEL)
    return model, tmp / "voice.safetensors"


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that imports this tree's package; no BLAS settings but ``env``."""
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", _backend.BLAS_VAR)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@needs_openblas
@pytest.mark.parametrize(
    "first, env, status, warned",
    [
        # The trap: MLX binds its bundled BLAS when it loads, before we can preload.
        ("import mlx.core", {}, "bundled reference BLAS: mlx.core was imported before", True),
        ("", {}, "OpenBLAS (libopenblas.so.0)", False),
        # OpenBLAS was in the global scope before MLX loaded.
        ("import mlx.core", {"LD_PRELOAD": "libopenblas.so.0"}, "libopenblas.so.0 (in the global", False),
        ("import mlx.core", {_backend.BLAS_VAR: "off"}, "MLX_CHATTERBOX_BLAS=off", False),  # user's choice
    ],
)
def test_tts_load_warns_when_mlx_came_first_and_kept_its_reference_blas(tiny, first, env, status, warned):
    run = run_python(
        f"""
        {first}
        from mlx_chatterbox import TTS, _backend
        TTS.load({str(tiny[0])!r})
        print(_backend.STATUS["blas"])
        """,
        **env,
    )
    assert run.returncode == 0, run.stderr
    assert status in run.stdout
    assert (SLOW_BLAS in run.stderr) == warned, run.stderr
    if warned:
        assert "Import mlx_chatterbox before mlx.core" in run.stderr
        assert "LD_PRELOAD=libopenblas.so.0" in run.stderr and "MLX_CHATTERBOX_BLAS=off" in run.stderr


@needs_openblas
def test_bench_warns_when_mlx_came_first(tiny):
    model, voice = tiny
    args = ["bench", "--model", str(model), "--voice", str(voice), "--repeats", "1", "--max-new-tokens", "2"]
    run = run_python(f"""
        import sys
        import mlx.core
        from mlx_chatterbox.cli import main
        sys.exit(main({args!r}))
        """)
    assert run.returncode == 0, run.stderr
    assert SLOW_BLAS in run.stderr and "too late to preload libopenblas.so.0" in run.stderr
