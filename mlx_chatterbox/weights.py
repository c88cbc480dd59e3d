"""Read a converted MLX model folder (see ``convert``): config, strict weight loads, tokenizer, built-in voice."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .convert import DTYPES, FORMAT, FORMAT_VERSION, S3GEN_PARTS
from .generation.multilingual import MultilingualSpeech
from .generation.speech_tokens import EnglishSpeech
from .generation.turbo import TurboSpeech
from .generation.vocode import S3Gen
from .generation.voice import Voice
from .models.gpt2 import T3Turbo
from .models.t3 import T3, T3Config
from .models.voice_encoder import VoiceEncoder
from .quantize import quantize_t3, read_quantization_record
from .text import EnTokenizer, GPT2Tokenizer, MtlTokenizer
from .variants import CHECKPOINTS, MULTILINGUAL, PACK_LANGUAGES, T3_CONFIGS, ModelConfig

NETWORKS = {"voice_encoder": VoiceEncoder, **{name: network for _, name, network in S3GEN_PARTS}}
T3_NETWORKS = {variant: T3 if config is T3Config else T3Turbo for variant, config in T3_CONFIGS.items()}


@dataclass
class ModelFolder:
    path: Path
    config: dict
    networks: ModelConfig
    t3: T3 | T3Turbo
    s3gen: S3Gen
    tokenizer: EnTokenizer | GPT2Tokenizer | MtlTokenizer
    voice: Voice | None
    speech: EnglishSpeech | TurboSpeech | MultilingualSpeech  # the variant's text -> speech tokens

    def load(self, name: str) -> nn.Module:
        """Build network ``name`` (a ``ModelConfig`` field, e.g. the voice-cloning ``s3tokenizer``) and load
        its weights strictly."""
        return _load_network(self.path, self.config["files"], self.networks, name)


def _load_network(
    folder: Path, files: dict, networks: ModelConfig, name: str, quantization: tuple[int, int] | None = None
) -> nn.Module:
    path = folder / files[name]
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} not found in {folder}; convert the checkpoint again")
    model = (T3_NETWORKS[networks.variant] if name == "t3" else NETWORKS[name])(getattr(networks, name))
    if quantization is not None:
        # The quantized layers' parameters (weight, scales, biases) must exist before the strict load.
        quantize_t3(model, *quantization)
    model.load_weights(str(path), strict=True)
    # Every array the network holds, its derived tables (e.g. rope periods) too: a lazy array can only be
    # evaluated on the thread that made it, and a server runs the model on a thread of its own.
    mx.eval([a for _, a in tree_flatten(model)])
    return model


def load_folder(path: str | Path) -> ModelFolder:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} not found")
    config_path = path / "config.json"
    if not config_path.is_file():
        if any((path / c.t3).is_file() for c in CHECKPOINTS.values()):
            raise ValueError(
                f"{path} holds an upstream checkpoint; convert it first: mlx-chatterbox convert {path} DST"
            )
        raise FileNotFoundError(
            f"config.json not found in {path}; make the folder with: mlx-chatterbox convert ResembleAI/chatterbox {path}"
        )
    config = _read_config(path, config_path)
    files = config["files"]
    networks = ModelConfig.from_dict(config["networks"])
    quantization = t3_quantization(config, config_path)

    def load(name: str) -> nn.Module:
        return _load_network(path, files, networks, name)

    t3 = _load_network(path, files, networks, "t3", quantization)
    if networks.variant == "english":
        tokenizer = EnTokenizer.from_file(path / files["tokenizer"])
        speech = EnglishSpeech(t3, tokenizer)
    elif networks.variant in MULTILINGUAL:
        tokenizer = MtlTokenizer.from_folder(path / files["tokenizer"])
        speech = MultilingualSpeech(t3, tokenizer, networks.variant, PACK_LANGUAGES.get(networks.variant))
    else:
        tokenizer = GPT2Tokenizer.from_folder(path / files["tokenizer"])
        speech = TurboSpeech(t3, tokenizer, networks.variant)
    return ModelFolder(
        path,
        config,
        networks,
        t3=t3,
        s3gen=S3Gen(load("flow"), load("cfm"), load("hift")),
        tokenizer=tokenizer,
        voice=Voice.load(path / files["voice"]) if "voice" in files else None,
        speech=speech,
    )


def load_s3gen(path: str | Path, cfm_dtype: mx.Dtype = mx.float32) -> S3Gen:
    """The folder's S3Gen alone (the server's vocoding process), its estimator in ``cfm_dtype``."""
    path = Path(path).expanduser()
    config = _read_config(path, path / "config.json")
    networks = ModelConfig.from_dict(config["networks"])
    flow, cfm, hift = (
        _load_network(path, config["files"], networks, name) for name in ("flow", "cfm", "hift")
    )
    if cfm_dtype != mx.float32:
        cfm.set_dtype(cfm_dtype)
        mx.eval(cfm.parameters())
    return S3Gen(flow, cfm, hift)


def _read_config(path: Path, config_path: Path) -> dict:
    """The folder's config.json, checked to be ours and of this format version."""
    config = json.loads(config_path.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{config_path} is not an mlx-chatterbox config (format {config.get('format')!r})")
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} was converted with format version {config.get('format_version')!r}; this mlx-chatterbox "
            f"reads version {FORMAT_VERSION}. Convert the checkpoint again."
        )
    return config


def t3_quantization(config: dict, config_path: Path) -> tuple[int, int] | None:
    """(bits, group size) of a quantized T3 from ``config.json``'s ``t3_precision`` record, else None. Folders
    written before the record existed hold an unquantized T3."""
    if "t3_precision" not in config:
        return None
    precision = config["t3_precision"]
    if (
        not isinstance(precision, dict)
        or set(precision) != {"dtype", "quantization"}
        or precision["dtype"] not in DTYPES
    ):
        raise ValueError(
            f"{config_path}: t3_precision must be {{'dtype': one of {', '.join(DTYPES)}, 'quantization': ...}}, "
            f"found {precision!r}; convert the checkpoint again"
        )
    return read_quantization_record(precision["quantization"], str(config_path))
