"""The server's voices: the model's built-in one, named "default", and ``<name>.safetensors`` files in a folder
(``Voice.save``), loaded on first use and kept."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import mlx.core as mx

from ..generation.voice import Voice

BUILTIN = "default"
SUFFIX = ".safetensors"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def default_voices_dir() -> Path:
    """``$XDG_CACHE_HOME/mlx-chatterbox/voices``, else ``~/.cache/mlx-chatterbox/voices``."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "mlx-chatterbox" / "voices"


class UnknownVoice(KeyError):
    """A voice name that is neither built in nor stored; the message lists the names there are."""

    def __str__(self) -> str:
        return str(self.args[0])


class VoiceExists(ValueError):
    """A stored voice of that name exists already (and overwriting was not asked for)."""


def check_name(name: str) -> None:
    """ValueError unless ``name`` can name a stored voice (1-64 of A-Z a-z 0-9 _ -, starting alphanumeric)."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"voice name {name!r} is not allowed: use 1-64 letters, digits, '_' or '-', starting with a letter "
            "or digit"
        )
    if name == BUILTIN:
        raise ValueError(
            f"the voice name {BUILTIN!r} is reserved for the model's built-in voice; choose another"
        )


class VoiceStore:
    """Voices by name. Thread-safe; files are read once (a file changed behind the server's back is not re-read)."""

    def __init__(self, directory: str | os.PathLike, builtin: Voice | None = None):
        self.directory = Path(directory)
        self.builtin = None if builtin is None else _materialize(builtin)
        self._cache: dict[str, Voice] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """The built-in voice (if the model has one) first, then the stored ones, sorted."""
        stored = []
        if self.directory.is_dir():
            stored = sorted(p.stem for p in self.directory.glob(f"*{SUFFIX}") if _NAME.fullmatch(p.stem))
        return ([BUILTIN] if self.builtin is not None else []) + [n for n in stored if n != BUILTIN]

    def cached(self, name: str) -> Voice | None:
        """The voice ``name`` if it is built in or was loaded before (no file is read), else None."""
        if name == BUILTIN and self.builtin is not None:
            return self.builtin
        with self._lock:
            return self._cache.get(name)

    def get(self, name: str) -> Voice:
        """The voice called ``name``, read on first use (MLX work: the server calls this on its worker thread);
        UnknownVoice (listing the names) if there is none."""
        if name == BUILTIN and self.builtin is not None:
            return self.builtin
        with self._lock:
            if name in self._cache:
                return self._cache[name]
            path = self._path(name)
            if path is None or not path.is_file():
                raise UnknownVoice(
                    f"unknown voice {name!r}; the voices are: {', '.join(self.names()) or 'none'}"
                )
            voice = self._cache[name] = _materialize(Voice.load(path))
            return voice

    def add(self, name: str, voice: Voice, overwrite: bool = False) -> Path:
        """Store ``voice`` as ``<dir>/<name>.safetensors`` (atomically); VoiceExists unless ``overwrite``."""
        check_name(name)
        with self._lock:
            path = self.directory / f"{name}{SUFFIX}"
            if path.exists() and not overwrite:
                raise VoiceExists(f"voice {name!r} exists already; delete it first or pass overwrite=true")
            self.directory.mkdir(parents=True, exist_ok=True)
            voice = _materialize(voice)
            voice.save(path)
            self._cache[name] = voice
            return path

    def delete(self, name: str) -> None:
        """Remove the stored voice ``name``; UnknownVoice if there is none, ValueError for the built-in one."""
        if name == BUILTIN:
            raise ValueError(f"{BUILTIN!r} is the model's built-in voice; it cannot be deleted")
        with self._lock:
            path = self._path(name)
            if path is None or not path.is_file():
                raise UnknownVoice(
                    f"unknown voice {name!r}; the voices are: {', '.join(self.names()) or 'none'}"
                )
            path.unlink()
            self._cache.pop(name, None)

    def _path(self, name: str) -> Path | None:
        """Where a stored voice ``name`` lives; None for a name no stored voice can have (e.g. '../x')."""
        return self.directory / f"{name}{SUFFIX}" if _NAME.fullmatch(name) else None


def _materialize(voice: Voice) -> Voice:
    """The voice with its arrays computed here: MLX runs a lazy array only on the thread that made it (a loaded
    file is lazy), and the worker thread must be able to use every voice."""
    mx.eval(
        voice.speaker_emb,
        voice.t3_prompt_tokens,
        voice.s3gen_prompt_tokens,
        voice.s3gen_prompt_mel,
        voice.xvector,
    )
    return voice
