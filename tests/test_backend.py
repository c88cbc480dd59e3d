"""Process-wide settings (_backend.py): the allocator switch."""

from __future__ import annotations

import sys

import pytest

from mlx_chatterbox import _backend


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
