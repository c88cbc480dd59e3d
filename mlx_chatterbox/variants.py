"""Model variants as data: which upstream checkpoint files make each Chatterbox model, and the sizes of its
networks.

- english: ``ResembleAI/chatterbox`` (Llama-520M T3 with CFG, S3Gen with a 10-step CFM decoder).
- turbo: ``ResembleAI/chatterbox-turbo`` (GPT-2 medium T3 without CFG, a 2-step meanflow decoder;
  variants.md §2-3).
- nano: ``ResembleAI/chatterbox-nano``, Turbo with a GPT-2 small T3 (variants.md §4).
- multilingual, multilingual-v3: the 23-language T3s of ``ResembleAI/chatterbox`` (v2 and v3 weights; the
  English T3 with a 2454-id text vocabulary), English's S3Gen and voice encoder as torch pickles (§5).
- multilingual-v3-<pack>: upstream's Single Language Pack (``PACKS``; docs/language-packs.md): v3 finetunes
  for one language each, in repos of their own that hold the T3, a v3 S3Gen and the grapheme tokenizer; the
  voice encoder, the built-in voice and the Cangjie map come from ``ResembleAI/chatterbox``.

Tests build tiny ones.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from .models.campplus import CAMPPlusConfig
from .models.cfm import CFMConfig
from .models.flow import FlowConfig
from .models.gpt2 import NANO as NANO_T3
from .models.gpt2 import T3TurboConfig
from .models.hift import HiFTConfig
from .models.s3tokenizer import S3TokenizerConfig
from .models.t3 import T3Config
from .models.voice_encoder import VoiceEncoderConfig


@dataclass(frozen=True)
class Checkpoint:
    """The files of an upstream checkpoint folder (or Hub repo) that conversion reads."""

    t3: str
    s3gen: str
    tokenizer: tuple[str, ...]  # the text tokenizer's files, all required and copied as they are
    voice_encoder: str = "ve.safetensors"
    conds: str = "conds.pt"  # the built-in voice, optional
    # Files the variant's repo lacks, downloaded from ``COMPANION_REPO`` (a local folder holds them all).
    companions: tuple[str, ...] = ()

    @property
    def torch_pickles(self) -> bool:
        """Whether S3Gen and the voice encoder come as ``torch.save`` state dicts (``.pt``), read with
        ``torchfile.load_torch_file``, instead of safetensors."""
        return self.s3gen.endswith(".pt")

    @property
    def files(self) -> tuple[str, ...]:
        return (self.t3, self.s3gen, self.voice_encoder, *self.tokenizer, self.conds)


# Turbo's tokenizer is transformers' GPT-2 tokenizer on these files (tts_turbo.py: AutoTokenizer).
GPT2_TOKENIZER_FILES = (
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "tokenizer_config.json",
)
# The multilingual grapheme BPE and Chinese's Cangjie map (text/multilingual.py reads the two by these names).
MTL_TOKENIZER_FILES = ("grapheme_mtl_merged_expanded_v1.json", "Cangjie5_TC.json")
# The Single Language Pack (upstream README, 65b1843, 2026-06-10): variant -> (Hub repo, T3 file, language).
# Each repo holds its T3 (T3Config.multilingual()'s layout), s3gen_v3.pt (S3Gen's, without the two s3tokenizer
# buffers upstream computes at init) and the grapheme tokenizer; upstream loads them with HEAD's
# ChatterboxMultilingualTTS.from_local (t3_model= the T3 file), the v3 code path.
PACKS = {
    "multilingual-v3-zh-cmn": ("ResembleAI/Chatterbox-Multilingual-zh-cmn", "t3_zh_cmn.safetensors", "zh"),
    "multilingual-v3-es-mx-latam": (
        "ResembleAI/Chatterbox-Multilingual-es-mx-latam",
        "t3_es_mx_latam.safetensors",
        "es",
    ),
    "multilingual-v3-pt-br": ("ResembleAI/Chatterbox-Multilingual-pt-br", "t3_pt_br.safetensors", "pt"),
    "multilingual-v3-es-es": ("ResembleAI/Chatterbox-Multilingual-es-es", "t3_es_es.safetensors", "es"),
    "multilingual-v3-pt-pt": ("ResembleAI/Chatterbox-Multilingual-pt-pt", "t3_pt_pt.safetensors", "pt"),
    "multilingual-v3-hi": ("ResembleAI/Chatterbox-Multilingual-hi", "t3_hi.safetensors", "hi"),
}
COMPANION_REPO = "ResembleAI/chatterbox"  # upstream's REPO_ID: ve.pt, conds.pt, and Cangjie5_TC.json always
PACK_LANGUAGES = {variant: language for variant, (_, _, language) in PACKS.items()}
CHECKPOINTS = {
    "english": Checkpoint("t3_cfg.safetensors", "s3gen.safetensors", ("tokenizer.json",)),
    "turbo": Checkpoint("t3_turbo_v1.safetensors", "s3gen_meanflow.safetensors", GPT2_TOKENIZER_FILES),
    "nano": Checkpoint("t3_nano_v1.safetensors", "s3gen_meanflow.safetensors", GPT2_TOKENIZER_FILES),
    # mtl_tts.py; v3 at upstream HEAD 3f35dfc. The Cangjie map is for Chinese (upstream downloads it always).
    "multilingual": Checkpoint("t3_mtl23ls_v2.safetensors", "s3gen.pt", MTL_TOKENIZER_FILES, "ve.pt"),
    "multilingual-v3": Checkpoint("t3_mtl23ls_v3.safetensors", "s3gen.pt", MTL_TOKENIZER_FILES, "ve.pt"),
    **{
        variant: Checkpoint(
            t3,
            "s3gen_v3.pt",
            MTL_TOKENIZER_FILES,
            "ve.pt",
            companions=("ve.pt", "conds.pt", MTL_TOKENIZER_FILES[1]),
        )
        for variant, (_, t3, _) in PACKS.items()
    },
}
REPOS = {
    "english": "ResembleAI/chatterbox",
    "turbo": "ResembleAI/chatterbox-turbo",
    "nano": "ResembleAI/chatterbox-nano",
    "multilingual": "ResembleAI/chatterbox",  # the English model's repo: a repo id alone means English
    "multilingual-v3": "ResembleAI/chatterbox",
    **{variant: repo for variant, (repo, _, _) in PACKS.items()},
}
T3_CONFIGS = {
    "english": T3Config,
    "turbo": T3TurboConfig,
    "nano": T3TurboConfig,
    "multilingual": T3Config,
    "multilingual-v3": T3Config,
    **{variant: T3Config for variant in PACKS},
}
MULTILINGUAL = ("multilingual", "multilingual-v3", *PACKS)


@dataclass(frozen=True)
class ModelConfig:
    """The variant and one config per network; the network field names are the network names used in
    ``config.json`` and as the converted file names (``<name>.safetensors``)."""

    variant: str = "english"
    t3: T3Config | T3TurboConfig = field(default_factory=T3Config)
    flow: FlowConfig = field(default_factory=FlowConfig)
    cfm: CFMConfig = field(default_factory=CFMConfig)
    hift: HiFTConfig = field(default_factory=HiFTConfig)
    s3tokenizer: S3TokenizerConfig = field(default_factory=S3TokenizerConfig)
    campplus: CAMPPlusConfig = field(default_factory=CAMPPlusConfig)
    voice_encoder: VoiceEncoderConfig = field(default_factory=VoiceEncoderConfig)

    def __post_init__(self) -> None:
        if self.variant not in CHECKPOINTS:
            raise ValueError(f"unknown variant {self.variant!r}; the variants are {', '.join(CHECKPOINTS)}")
        if not isinstance(self.t3, T3_CONFIGS[self.variant]):
            raise ValueError(f"the {self.variant} variant's T3 takes a {T3_CONFIGS[self.variant].__name__}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Inverse of ``to_dict`` (JSON turns tuples into lists; they are turned back). Unknown or missing
        networks and fields are errors."""
        hints = typing.get_type_hints(cls)
        if set(d) != set(hints):
            raise ValueError(f"model config networks {sorted(d)} differ from {sorted(hints)}")
        variant = d["variant"]
        if variant not in T3_CONFIGS:
            raise ValueError(f"unknown variant {variant!r}; the variants are {', '.join(T3_CONFIGS)}")
        types = {**hints, "t3": T3_CONFIGS[variant]}
        return cls(variant, **{k: config_from_dict(types[k], v) for k, v in d.items() if k != "variant"})


ENGLISH = ModelConfig()
TURBO = ModelConfig("turbo", T3TurboConfig(), cfm=CFMConfig(meanflow=True))
NANO = ModelConfig("nano", NANO_T3, cfm=CFMConfig(meanflow=True))
# upstream T3Config.multilingual(): English's but for the text vocabulary; v2 and v3 share it.
MTL_T3 = T3Config(text_vocab_size=2454)
PRESETS = {
    "english": ENGLISH,
    "turbo": TURBO,
    "nano": NANO,
    "multilingual": ModelConfig("multilingual", MTL_T3),
    "multilingual-v3": ModelConfig("multilingual-v3", MTL_T3),
    **{variant: ModelConfig(variant, MTL_T3) for variant in PACKS},
}


def config_from_dict(cls: type, d: dict) -> object:
    """A network config from its ``asdict`` form; unknown fields are errors, missing ones take defaults."""
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {sorted(unknown)}")
    return cls(**{k: _tuples(v) for k, v in d.items()})


def _tuples(value: object) -> object:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
