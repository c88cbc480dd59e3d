"""Read a converted MLX model folder (see ``convert``): config, strict weight load, tokenizer, built-in voice."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .convert import FORMAT, FORMAT_VERSION, T3_FILE
from .generation.voice import Voice
from .models.t3 import T3, T3Config
from .text import EnTokenizer


@dataclass
class ModelFolder:
    path: Path
    config: dict
    t3: T3
    tokenizer: EnTokenizer
    voice: Voice | None


def load_folder(path: str | Path) -> ModelFolder:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} not found")
    config_path = path / "config.json"
    if not config_path.is_file():
        if (path / T3_FILE).is_file():
            raise ValueError(
                f"{path} holds an upstream checkpoint; convert it first: mlx-chatterbox convert {path} DST"
            )
        raise FileNotFoundError(
            f"config.json not found in {path}; make the folder with: mlx-chatterbox convert ResembleAI/chatterbox {path}"
        )
    config = json.loads(config_path.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{config_path} is not an mlx-chatterbox config (format {config.get('format')!r})")
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} was converted with format version {config.get('format_version')!r}; this mlx-chatterbox "
            f"reads version {FORMAT_VERSION}. Convert the checkpoint again."
        )
    files = config["files"]

    def need(name: str) -> Path:
        p = path / files[name]
        if not p.is_file():
            raise FileNotFoundError(f"{p.name} not found in {path}; convert the checkpoint again")
        return p

    t3 = T3(T3Config.from_dict(config["t3"]))
    t3.load_weights(str(need("t3")), strict=True)
    mx.eval(t3.parameters())
    tokenizer = EnTokenizer.from_file(need("tokenizer"))
    voice = Voice.load(need("voice")) if "voice" in files else None
    return ModelFolder(path, config, t3, tokenizer, voice)
