"""Model variants as data: the sizes of every network of one Chatterbox model.

Only the original English model exists so far; multilingual, Turbo and Nano will be more instances of
``ModelConfig``. Tests build tiny ones.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from .models.campplus import CAMPPlusConfig
from .models.cfm import CFMConfig
from .models.flow import FlowConfig
from .models.hift import HiFTConfig
from .models.s3tokenizer import S3TokenizerConfig
from .models.t3 import T3Config
from .models.voice_encoder import VoiceEncoderConfig


@dataclass(frozen=True)
class ModelConfig:
    """One config per network; the field names are the network names used in ``config.json`` and as the
    converted file names (``<name>.safetensors``)."""

    t3: T3Config = field(default_factory=T3Config)
    flow: FlowConfig = field(default_factory=FlowConfig)
    cfm: CFMConfig = field(default_factory=CFMConfig)
    hift: HiFTConfig = field(default_factory=HiFTConfig)
    s3tokenizer: S3TokenizerConfig = field(default_factory=S3TokenizerConfig)
    campplus: CAMPPlusConfig = field(default_factory=CAMPPlusConfig)
    voice_encoder: VoiceEncoderConfig = field(default_factory=VoiceEncoderConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Inverse of ``to_dict`` (JSON turns tuples into lists; they are turned back). Unknown or missing
        networks and fields are errors."""
        hints = typing.get_type_hints(cls)
        if set(d) != set(hints):
            raise ValueError(f"model config networks {sorted(d)} differ from {sorted(hints)}")
        return cls(**{name: config_from_dict(hints[name], value) for name, value in d.items()})


ENGLISH = ModelConfig()


def config_from_dict(cls: type, d: dict) -> object:
    """A network config from its ``asdict`` form; unknown fields are errors, missing ones take defaults."""
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {sorted(unknown)}")
    return cls(**{k: _tuples(v) for k, v in d.items()})


def _tuples(value: object) -> object:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
