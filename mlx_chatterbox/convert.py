"""Upstream Chatterbox checkpoint (a folder or a Hugging Face repo) -> an MLX model folder.

The variant (English, Turbo, Nano, Multilingual v2/v3: ``variants.CHECKPOINTS``) is found from the files.
Output folder:
  config.json        format, format version, variant, dtype, T3's precision record, source, the network
                     configs (``ModelConfig``)
  t3.safetensors     T3 weights under our names (``T3.checkpoint_table``, Turbo/Nano ``T3Turbo``'s), in the
                     chosen dtype; with ``quantize``, the backbone's linear layers as quantized weights, scales
                     and biases
  flow.safetensors, cfm.safetensors, hift.safetensors
                     S3Gen (tokens -> mel -> wav) from ``s3gen.safetensors`` (Turbo/Nano:
                     ``s3gen_meanflow.safetensors``; Multilingual: the ``s3gen.pt`` state dict), float32
  s3tokenizer.safetensors, campplus.safetensors
                     the voice-cloning networks that also live in ``s3gen.safetensors``, float32
  voice_encoder.safetensors
                     the voice encoder from ``ve.safetensors`` (Multilingual: ``ve.pt``), float32
  tokenizer.json     the upstream text tokenizer, checked and copied (Turbo/Nano: ``tokenizer/``, the five
                     GPT-2 tokenizer files; Multilingual: ``tokenizer/``, the grapheme BPE and the Cangjie map)
  voice.safetensors  the built-in voice from ``conds.pt``
The torch files (``conds.pt``, ``*.pt`` state dicts) are read without torch and without unpickling code
(``torchfile``).

Conversion is strict: every expected key must be present with its exact shape, and an unknown key is an
error. The folder is written under a temporary name and renamed at the end, so a failure leaves nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .generation.turbo import S3_CODEBOOK
from .generation.voice import Voice
from .models.campplus import CAMPPlus
from .models.cfm import Estimator
from .models.flow import Flow
from .models.gpt2 import T3Turbo
from .models.hift import HiFT
from .models.s3tokenizer import S3Tokenizer
from .models.t3 import T3, T3Config
from .models.voice_encoder import VoiceEncoder
from .quantize import quantization_record, quantize_t3
from .text import EnTokenizer, GPT2Tokenizer, MtlTokenizer
from .torchfile import TorchFileError, load_torch_file
from .variants import CHECKPOINTS, COMPANION_REPO, MULTILINGUAL, PRESETS, REPOS, ModelConfig

FORMAT = "mlx-chatterbox"
FORMAT_VERSION = 5  # 2: S3Gen, the S3 tokenizer and CAM++ converted too; 3: the voice encoder too;
# 4: T3's q/k/v and gate/up projections fused; 5: the variant recorded (English, Turbo, Nano, Multilingual)
DEFAULT_REPO = "ResembleAI/chatterbox"
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}

T3_FILE = CHECKPOINTS["english"].t3
S3GEN_FILE = CHECKPOINTS["english"].s3gen
# s3gen.safetensors holds five networks; each key goes to the first network whose prefix it starts with.
S3GEN_PARTS = (
    ("flow.decoder.estimator.", "cfm", Estimator),
    ("flow.", "flow", Flow),
    ("mel2wav.", "hift", HiFT),
    ("tokenizer.", "s3tokenizer", S3Tokenizer),
    ("speaker_encoder.", "campplus", CAMPPlus),
)
# Buffers that upstream recomputes and loads non-strictly (S3Token2Wav.ignore_state_dict_missing): a file
# may or may not hold them; ours recomputes them too.
S3GEN_OPTIONAL = {"tokenizer._mel_filters", "tokenizer.window"}


logger = logging.getLogger(__name__)
CACHE_VAR = "MLX_CHATTERBOX_CACHE"  # where upstream checkpoints are converted to on first use


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the file and the problem."""


def t3_precision(dtype: str | None, quantize: int | None, q_group_size: int) -> dict:
    """The ``t3_precision`` record of ``config.json`` for ``convert``'s arguments, checked: ``dtype`` (by
    default float32, or bfloat16 for quantized scales) and the quantization (``quantize.quantization_record``).
    """
    if dtype is None:
        dtype = "float32" if quantize is None else "bfloat16"
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    try:
        quantization = None if quantize is None else quantization_record(quantize, q_group_size)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    return {"dtype": dtype, "quantization": quantization}


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    variant: str | None = None,
    dtype: str | None = None,
    quantize: int | None = None,
    q_group_size: int = 64,
    revision: str | None = None,
    overwrite: bool = False,
    config: ModelConfig | None = None,
) -> Path:
    """Convert an upstream checkpoint to an MLX folder and return its path.

    src: a folder in upstream layout, or a Hugging Face repo id (e.g. ``ResembleAI/chatterbox``,
        ``ResembleAI/chatterbox-turbo``).
    dst: the folder to create; it must not exist (or be empty) unless ``overwrite``.
    variant: "english", "turbo", "nano", "multilingual" (v2), "multilingual-v3" or a language pack
        ("multilingual-v3-pt-br", ...: ``variants.PACKS``); None finds it from the files
        (``variants.CHECKPOINTS``), or for a repo id takes the repo's first model (``variants.REPOS``:
        ``ResembleAI/chatterbox`` is English).
    dtype: T3's weight precision: float32 (upstream's), bfloat16 or float16; None means float32, or bfloat16
        when quantizing (the dtype of the scales and of the layers left unquantized). S3Gen stays float32.
    quantize: 4 or 8 to quantize T3's backbone linear layers to that many bits (``quantize.quantize_t3``),
        in groups of ``q_group_size`` (32, 64 or 128) inputs; None keeps every weight in ``dtype``. The
        Llama T3s only (English, Multilingual), not Turbo's or Nano's GPT-2.
    revision: a Hub branch, tag or commit (repo ids only).
    config: the network sizes (the variant's upstream sizes unless a test says otherwise); its variant must
        be the checkpoint's.
    """
    precision = t3_precision(dtype, quantize, q_group_size)
    dtype = precision["dtype"]
    dst = Path(dst).expanduser()
    if dst.exists() and not (dst.is_dir() and not any(dst.iterdir())) and not overwrite:
        raise ConversionError(
            f"{dst} already exists; choose a new folder or pass overwrite=True"
        )
    src_dir, source = _resolve_source(src, revision, variant or (None if config is None else config.variant))
    variant = detect_variant(
        src_dir, variant or source.get("variant"), None if config is None else config.variant
    )
    if config is None:
        config = PRESETS[variant]
    elif config.variant != variant:
        raise ConversionError(
            f"{src_dir} holds a {variant} checkpoint; the config given is for {config.variant}"
        )
    cfg = config.t3
    network = T3 if isinstance(cfg, T3Config) else T3Turbo
    if quantize is not None and network is not T3:
        raise ConversionError(
            f"quantization is implemented for the Llama T3s (English, Multilingual), not {variant}"
        )
    files_in = CHECKPOINTS[variant]
    for name in files_in.companions:
        if name != files_in.conds and not (src_dir / name).is_file():
            raise ConversionError(
                f"{name} not found in {src_dir}; the {variant} model's repo does not hold it: copy it from "
                f"{COMPANION_REPO} (the repo id {REPOS[variant]} downloads both)"
            )

    tmp = dst.with_name(f".{dst.name}.converting-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        weights = _read_safetensors(src_dir / files_in.t3)
        t3 = sanitize(weights, network.checkpoint_table(cfg), files_in.t3)
        t3 = {k: v.astype(DTYPES[dtype]) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in t3.items()}
        if quantize is not None:
            model = network(cfg)
            model.load_weights(list(t3.items()), strict=True)
            try:
                quantize_t3(model, quantize, q_group_size)
            except ValueError as e:  # a group size that does not divide a layer's inputs
                raise ConversionError(f"{files_in.t3}: {e}") from None
            t3 = dict(tree_flatten(model.parameters()))
            del model
        mx.save_safetensors(str(tmp / "t3.safetensors"), t3, metadata={"format": FORMAT})
        del weights, t3
        files = {"t3": "t3.safetensors"}
        s3gen = _read_weights(src_dir / files_in.s3gen)
        for name, network in convert_s3gen(s3gen, config, files_in.s3gen).items():
            files[name] = f"{name}.safetensors"
            mx.save_safetensors(str(tmp / files[name]), network, metadata={"format": FORMAT})
        ve_file = files_in.voice_encoder
        ve = sanitize(
            _read_weights(src_dir / ve_file), VoiceEncoder.checkpoint_table(config.voice_encoder), ve_file
        )
        files["voice_encoder"] = "voice_encoder.safetensors"
        mx.save_safetensors(
            str(tmp / files["voice_encoder"]),
            {k: v.astype(mx.float32) for k, v in ve.items()},
            metadata={"format": FORMAT},
        )
        files["tokenizer"] = _copy_tokenizer(src_dir, tmp, variant, cfg)
        if (src_dir / files_in.conds).exists():
            voice_from_conds(src_dir / files_in.conds).save(tmp / "voice.safetensors")
            files["voice"] = "voice.safetensors"

        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "variant": variant,
            "dtype": dtype,
            "t3_precision": precision,
            "source": source,
            "files": files,
            "networks": config.to_dict(),
        }
        (tmp / "config.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def detect_variant(src_dir: Path, variant: str | None = None, expected: str | None = None) -> str:
    """The variant whose T3 file ``src_dir`` holds (``variant``, when given, is checked against the files);
    with no T3 file at all, the ``expected`` variant's is reported missing."""
    if variant is not None:
        if variant not in CHECKPOINTS:
            raise ConversionError(f"unknown variant {variant!r}; choose one of {', '.join(CHECKPOINTS)}")
        _require(src_dir / CHECKPOINTS[variant].t3)
        return variant
    found = [v for v, c in CHECKPOINTS.items() if (src_dir / c.t3).is_file()]
    if not found and expected is not None:
        _require(src_dir / CHECKPOINTS[expected].t3)
    if len(found) != 1:
        names = ", ".join(f"{c.t3} ({v})" for v, c in CHECKPOINTS.items())
        what = "none" if not found else " and ".join(CHECKPOINTS[v].t3 for v in found)
        raise ConversionError(
            f"{src_dir} holds {what} of the T3 files {names}; a Chatterbox checkpoint holds exactly one "
            "(pass variant= to choose)"
        )
    return found[0]


def source_variant(source: str | os.PathLike) -> str | None:
    """The variant of a model source without loading it: a converted folder's, an upstream folder's (from its
    files) or a known repo's (``variants.REPOS``); None when that cannot be told."""
    path = Path(source).expanduser()
    if (path / "config.json").is_file():
        variant = json.loads((path / "config.json").read_text()).get("variant")
        return variant if variant in CHECKPOINTS else None
    if path.is_dir():
        found = [v for v, c in CHECKPOINTS.items() if (path / c.t3).is_file()]
        return found[0] if len(found) == 1 else None
    return next((v for v, repo in REPOS.items() if repo == str(source)), None)


def source_config(source: str | os.PathLike, variant: str | None = None) -> ModelConfig | None:
    """The network sizes a model source loads with, without loading it: a converted folder's (its config.json),
    else the preset of its variant (``variant``, or ``source_variant``'s), as ``prepare`` converts it; None when
    that cannot be told (loading says why)."""
    path = Path(source).expanduser()
    if (path / "config.json").is_file():
        try:
            return ModelConfig.from_dict(json.loads((path / "config.json").read_text())["networks"])
        except (ValueError, KeyError, TypeError):
            return None
    variant = variant or source_variant(source)
    return None if variant is None else PRESETS.get(variant)


def _copy_tokenizer(src_dir: Path, tmp: Path, variant: str, cfg) -> str:
    """Check the text tokenizer's files against T3 and copy them; returns their name in the folder."""
    names = CHECKPOINTS[variant].tokenizer
    for name in names:
        _require(src_dir / name)
    # Checked in the source folder, so that an error names the files there, not the temporary copy.
    if variant == "english":
        tokenizer = EnTokenizer.from_file(src_dir / names[0])
        tokenizer.check_compatible(cfg.start_text_token, cfg.stop_text_token, cfg.text_vocab_size)
        shutil.copyfile(src_dir / names[0], tmp / "tokenizer.json")
        return "tokenizer.json"
    if variant in MULTILINGUAL:
        tokenizer = MtlTokenizer.from_folder(src_dir)
        tokenizer.check_compatible(cfg.start_text_token, cfg.stop_text_token, cfg.text_vocab_size)
    else:
        GPT2Tokenizer.from_folder(src_dir).check_compatible(cfg.text_vocab_size)
    (tmp / "tokenizer").mkdir()
    for name in names:
        shutil.copyfile(src_dir / name, tmp / "tokenizer" / name)
    return "tokenizer"


# A key table maps each upstream key to (our key or None to drop, its upstream shape[, layout]). The layout
# names how a PyTorch tensor moves to MLX's channels-last convolutions (architecture §9.7), or STACK; it is
# applied once, here, after the shape check.
Rule = tuple  # (str | None, tuple[int, ...]) or (str | None, tuple[int, ...], str)
LAYOUTS = {
    "conv1d": (0, 2, 1),  # (out, in, k) -> (out, k, in)
    "conv_transpose1d": (1, 2, 0),  # (in, out, k) -> (out, k, in)
    "conv2d": (0, 2, 3, 1),  # (out, in, kh, kw) -> (out, kh, kw, in)
    "gpt2_conv1d": (
        1,
        0,
    ),  # transformers' GPT-2 Conv1D stores a linear layer's weight as (in, out) -> (out, in)
}
# Several keys with one target and this layout are concatenated along dim 0 in table order (fused projections).
STACK = "stack"
WEIGHT_NORM_G = "parametrizations.weight.original0"
WEIGHT_NORM_V = "parametrizations.weight.original1"


def sanitize(weights: dict[str, mx.array], table: dict[str, Rule], filename: str) -> dict[str, mx.array]:
    """Rename upstream keys to ours with a network's key table: every key must be known and present, every
    shape exact; keys mapped to None are dropped, layouts are applied.

    Weight-normed layers (``P.parametrizations.weight.original0/1`` = g, v) are folded first into ``P.weight``
    = g·v/‖v‖, so tables list the folded ``P.weight``.
    """
    weights = fold_weight_norm(weights, filename)
    unknown = sorted(set(weights) - set(table))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise ConversionError(
            f"{filename}: unexpected key {unknown[0]!r}{more}; is this a Chatterbox checkpoint of the right "
            "variant and size?"
        )
    missing = sorted(set(table) - set(weights))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConversionError(f"{filename}: key {missing[0]!r}{more} is missing; the file is incomplete")
    out, stacks = {}, {}
    for key, (target, shape, *layout) in table.items():
        value = weights[key]
        if tuple(value.shape) != shape:
            raise ConversionError(f"{filename}: {key} has shape {tuple(value.shape)}, expected {shape}")
        if target is None:
            continue
        if layout == [STACK]:
            stacks.setdefault(target, []).append(value)
        else:
            out[target] = value.transpose(LAYOUTS[layout[0]]) if layout else value
    out.update({target: mx.concatenate(parts, axis=0) for target, parts in stacks.items()})
    return out


def fold_weight_norm(weights: dict[str, mx.array], filename: str) -> dict[str, mx.array]:
    """Replace each weight-norm pair (torch.nn.utils.parametrizations.weight_norm, dim 0) by its weight.

    The norm runs over every dim but 0 of the PyTorch layout, which is in_channels for a transposed conv
    (architecture §4.6), so this happens before any layout change. Computed in float64, rounded once."""
    out = {k: v for k, v in weights.items() if not k.endswith((WEIGHT_NORM_G, WEIGHT_NORM_V))}
    prefixes = {k[: -len(WEIGHT_NORM_G)] for k in weights if k.endswith((WEIGHT_NORM_G, WEIGHT_NORM_V))}
    for p in sorted(prefixes):
        g, v = weights.get(p + WEIGHT_NORM_G), weights.get(p + WEIGHT_NORM_V)
        if g is None or v is None:
            half = WEIGHT_NORM_G if g is None else WEIGHT_NORM_V
            raise ConversionError(f"{filename}: key {p + half!r} is missing; the file is incomplete")
        if p + "weight" in weights:
            raise ConversionError(f"{filename}: {p}weight and a weight-norm pair are both present")
        expected_g = (v.shape[0],) + (1,) * (v.ndim - 1)
        if tuple(g.shape) != expected_g:
            raise ConversionError(
                f"{filename}: {p + WEIGHT_NORM_G} has shape {tuple(g.shape)}, expected {expected_g}"
            )
        v64 = np.asarray(v.astype(mx.float32), dtype=np.float64)
        norm = np.sqrt((v64**2).sum(axis=tuple(range(1, v.ndim)), keepdims=True))
        folded = np.asarray(g.astype(mx.float32), dtype=np.float64) * v64 / norm
        out[p + "weight"] = mx.array(folded.astype(np.float32)).astype(v.dtype)
    return out


def prepare(
    source: str | os.PathLike = DEFAULT_REPO,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    variant: str | None = None,
    config: ModelConfig | None = None,
    dtype: str | None = None,
    quantize: int | None = None,
    q_group_size: int = 64,
) -> Path:
    """A converted folder for ``source``: ``source`` itself when it is one; otherwise the upstream checkpoint
    (a folder or a Hugging Face repo id) converted once into the cache and reused while it is current.

    The cache is ``cache_dir``, else $MLX_CHATTERBOX_CACHE, else ~/.cache/mlx-chatterbox; one folder per repo
    revision, or per local folder and the sizes and times of its files, and per T3 precision. ``config``: the
    network sizes to convert with (the checkpoint variant's by default); ``variant``, ``dtype``, ``quantize``,
    ``q_group_size``: the model and T3's precision, as for ``convert`` (a variant other than the repo's first
    gets a cache folder of its own).
    """
    path = Path(source).expanduser()
    if (path / "config.json").is_file():
        upstream_only = (revision, config, cache_dir, dtype, quantize)
        if any(a is not None for a in upstream_only) or q_group_size != 64:
            raise ConversionError(
                f"{path} is already converted: revision, cache_dir, config, dtype and quantization apply to "
                "upstream checkpoints only (convert again for another precision)"
            )
        found = source_variant(path)
        if variant is not None and variant != found:
            raise ConversionError(f"{path} holds the {found} model, not {variant}")
        return path
    precision = t3_precision(dtype, quantize, q_group_size)
    src_dir, described = _resolve_source(
        source, revision, variant or (None if config is None else config.variant)
    )
    variant = detect_variant(
        src_dir, variant or described.get("variant"), None if config is None else config.variant
    )
    if "repo" in described:
        key = f"{described['repo']}@{described['revision']}"
        if "companion" in described:  # a language pack: its companions' revision too
            key += f"+{described['companion']}"
    else:
        stats = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(src_dir.iterdir())]
        key = f"{described['path']}#{hashlib.sha256(' '.join(stats).encode()).hexdigest()[:16]}"
    if (
        variant != "english"
    ):  # one source may hold several models (ResembleAI/chatterbox: English, Multilingual)
        key += f"@{variant}"
    if precision != {"dtype": "float32", "quantization": None}:  # the default keeps its cache folder name
        key += f"@{precision['dtype']}" + ("" if quantize is None else f"-q{quantize}g{q_group_size}")
    cache = Path(cache_dir or os.environ.get(CACHE_VAR) or Path.home() / ".cache" / "mlx-chatterbox")
    dst = cache.expanduser() / re.sub(r"[^\w.-]+", "--", key).strip("-")
    manifest = dst / "config.json"
    if manifest.is_file():
        cached = json.loads(manifest.read_text())
        current = cached.get("format_version") == FORMAT_VERSION
        if current and cached.get("t3_precision", {"dtype": "float32", "quantization": None}) == precision:
            return dst
    logger.info("converting %s into %s (once)", source, dst)
    return convert(
        src_dir,
        dst,
        variant=variant,
        dtype=precision["dtype"],
        quantize=quantize,
        q_group_size=q_group_size,
        overwrite=True,
        config=config,
    )


def convert_s3gen(
    weights: dict[str, mx.array], config: ModelConfig, filename: str = S3GEN_FILE
) -> dict[str, dict[str, mx.array]]:
    """Split upstream ``s3gen.safetensors`` (Turbo: ``s3gen_meanflow.safetensors``) into its networks and
    sanitize each with its table (error messages keep the full upstream key; our keys drop the prefix, since
    each network is its own file)."""
    parts = split_s3gen(weights, filename)
    return {name: sanitize_s3gen_part(parts[name], name, config, filename) for _, name, _ in S3GEN_PARTS}


def split_s3gen(weights: dict[str, mx.array], filename: str = S3GEN_FILE) -> dict[str, dict[str, mx.array]]:
    """Upstream S3Gen keys grouped by network (``S3GEN_PARTS``), full names kept; an unknown prefix is an error."""
    parts: dict[str, dict[str, mx.array]] = {name: {} for _, name, _ in S3GEN_PARTS}
    for key, value in weights.items():
        if key in S3GEN_OPTIONAL:
            continue
        name = next((n for p, n, _ in S3GEN_PARTS if key.startswith(p)), None)
        if name is None:
            raise ConversionError(
                f"{filename}: unexpected key {key!r}; is this a Chatterbox checkpoint of the right variant?"
            )
        parts[name][key] = value
    return parts


def sanitize_s3gen_part(
    weights: dict[str, mx.array], name: str, config: ModelConfig, filename: str = S3GEN_FILE
) -> dict[str, mx.array]:
    """One network's keys (from ``split_s3gen``) -> our float32 weights for that network."""
    prefix, network = next((p, net) for p, n, net in S3GEN_PARTS if n == name)
    table = {prefix + k: rule for k, rule in network.checkpoint_table(getattr(config, name)).items()}
    return {k: v.astype(mx.float32) for k, v in sanitize(weights, table, filename).items()}


def voice_from_conds(path: Path) -> Voice:
    """Upstream ``conds.pt`` (``Conditionals.save``: {'t3': T3Cond fields, 'gen': S3Gen ref dict}) -> Voice."""
    name = path.name
    try:
        data = load_torch_file(path)
    except TorchFileError as e:
        raise ConversionError(str(e)) from None

    def need(d: object, where: str, keys: set[str]) -> dict:
        if not isinstance(d, dict) or set(d) != keys:
            found = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ConversionError(f"{name}: {where} must hold exactly {sorted(keys)}, found {found}")
        return d

    def array(d: dict, key: str, ndim: int, kind: str) -> np.ndarray:
        v = d[key]
        ok = isinstance(v, np.ndarray) and v.ndim == ndim and v.dtype.kind in kind
        if not ok:
            desc = f"{v.dtype} array of shape {v.shape}" if isinstance(v, np.ndarray) else type(v).__name__
            raise ConversionError(
                f"{name}: {key} must be a {ndim}-d {'float' if kind == 'f' else 'int'} array, found {desc}"
            )
        return v

    def whole(d: dict, key: str, ndim: int, high: int) -> np.ndarray:
        # Upstream's S3Gen casts the voice's token arrays to float32 in place (S3Token2Mel.forward), so a
        # conds.pt saved after any generate() holds floats; upstream loads those, so we take exact integers.
        v = array(d, key, ndim, "iuf")
        if v.dtype.kind == "f" and not np.array_equal(v, np.round(v)):
            raise ConversionError(f"{name}: {key} ({v.dtype}) holds values that are not whole numbers")
        if v.size and not 0 <= v.min() <= v.max() < high:
            raise ConversionError(f"{name}: {key} holds values outside [0, {high})")
        return v.astype(np.int64)

    top = need(data, "the file", {"t3", "gen"})
    t3 = need(
        top["t3"],
        "'t3'",
        {"speaker_emb", "clap_emb", "cond_prompt_speech_tokens", "cond_prompt_speech_emb", "emotion_adv"},
    )
    gen = need(
        top["gen"],
        "'gen'",
        {"prompt_token", "prompt_token_len", "prompt_feat", "prompt_feat_len", "embedding"},
    )
    if t3["clap_emb"] is not None or gen["prompt_feat_len"] is not None:
        raise ConversionError(f"{name}: clap_emb and prompt_feat_len must be None (upstream never sets them)")
    # cond_prompt_speech_emb is upstream's cache of embedded prompt tokens: derived data, recomputed by T3.
    # emotion_adv is replaced by generate()'s exaggeration argument on every upstream call, so it never takes
    # effect; ours is a generation knob (SamplingParams.exaggeration).
    prompt_len = whole(gen, "prompt_token_len", 1, np.iinfo(np.int32).max)
    tokens = whole(gen, "prompt_token", 2, S3_CODEBOOK)
    t3_tokens = whole(t3, "cond_prompt_speech_tokens", 2, S3_CODEBOOK)
    if prompt_len.tolist() != [tokens.shape[1]]:
        raise ConversionError(
            f"{name}: prompt_token_len {prompt_len.tolist()} != prompt_token length {tokens.shape[1]}"
        )
    try:
        return Voice(
            speaker_emb=mx.array(array(t3, "speaker_emb", 2, "f").astype(np.float32)),
            t3_prompt_tokens=mx.array(t3_tokens.astype(np.int32)),
            s3gen_prompt_tokens=mx.array(tokens.astype(np.int32)),
            s3gen_prompt_mel=mx.array(array(gen, "prompt_feat", 3, "f").astype(np.float32)),
            xvector=mx.array(array(gen, "embedding", 2, "f").astype(np.float32)),
        )
    except ValueError as e:
        raise ConversionError(f"{name}: {e}") from None


def _resolve_source(
    src: str | os.PathLike, revision: str | None, variant: str | None = None
) -> tuple[Path, dict]:
    """The local folder of ``src`` and a description of it for ``config.json``; a repo id is downloaded, only
    the files of ``variant`` (by default the repo's first model in ``variants.REPOS``), which the description
    records."""
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConversionError(
                f"{path} is a file; pass the folder that holds {T3_FILE}, ve.safetensors, ..."
            )
        if revision is not None:
            raise ConversionError("revision applies to Hugging Face repo ids, not to local folders")
        return path, {"path": str(path.resolve())}
    text = str(src)
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text):
        raise ConversionError(f"{text} is neither a folder nor a Hugging Face repo id such as {DEFAULT_REPO}")
    from huggingface_hub import snapshot_download

    if variant is None:
        variant = next((v for v, repo in REPOS.items() if repo == text), None)
    if variant is not None and variant not in CHECKPOINTS:
        raise ConversionError(f"unknown variant {variant!r}; choose one of {', '.join(CHECKPOINTS)}")
    # Exact names: a repo also holds files the variant does not read (ResembleAI/chatterbox holds the English
    # and the multilingual models; Turbo's repo an unused s3gen.safetensors). An unknown repo: every variant's.
    wanted = CHECKPOINTS[variant].files if variant else {f for c in CHECKPOINTS.values() for f in c.files}
    companions = CHECKPOINTS[variant].companions if variant else ()
    try:
        local = snapshot_download(
            text, revision=revision, allow_patterns=sorted(set(wanted) - set(companions))
        )
        # A language pack's repo lacks the voice encoder, the built-in voice and the Cangjie map: upstream's.
        shared = snapshot_download(COMPANION_REPO, allow_patterns=sorted(companions)) if companions else None
    except Exception as e:  # the hub client raises many types (offline, 404, auth); all end here
        reason = " ".join(str(e).split())  # hub messages span lines; ours is one
        raise ConversionError(
            f"{text} is not a local folder, and downloading it from the Hugging Face Hub failed "
            f"({type(e).__name__}: {reason}). Check the network, or download the checkpoint's files "
            f"({', '.join(CHECKPOINTS['english'].files)} for English) elsewhere and pass their folder."
        ) from None
    local = Path(local)
    described = {"repo": text, "revision": local.name}
    if shared is not None:
        described["companion"] = f"{COMPANION_REPO}@{Path(shared).name}"
        local = _merged_folder(local, Path(shared), companions)
    return local, described if variant is None else {**described, "variant": variant}


def _merged_folder(pack: Path, shared: Path, companions: tuple[str, ...]) -> Path:
    """A folder of links to a language pack's downloaded files and to its companions (the Hub's cache folders
    are left as they are), which conversion reads as one checkpoint folder: one per pair of download folders,
    in the system's temporary folder, made whole before it gets its name."""
    pair = hashlib.sha256(f"{pack.resolve()}\n{shared.resolve()}".encode()).hexdigest()[:16]
    merged = Path(tempfile.gettempdir()) / "mlx-chatterbox-packs" / pair
    if merged.is_dir() and all(p.exists() for p in merged.iterdir()):  # every link still leads to its file
        return merged
    shutil.rmtree(merged, ignore_errors=True)  # links to files that have gone
    merged.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=merged.parent))
    paths = [p for p in pack.iterdir() if p.is_file()] + [
        shared / n for n in companions if (shared / n).is_file()
    ]
    for path in paths:
        (tmp / path.name).symlink_to(path.resolve())
    try:
        os.replace(tmp, merged)
    except OSError:  # another process made it meanwhile
        shutil.rmtree(tmp)
    return merged


def _require(path: Path) -> Path:
    if not path.is_file():
        raise ConversionError(
            f"{path.name} not found in {path.parent}; an upstream Chatterbox checkpoint has it"
        )
    return path


def _read_weights(path: Path) -> dict[str, mx.array]:
    """A safetensors file, or a ``torch.save``'d state dict (``.pt``: Multilingual's ``s3gen.pt``, ``ve.pt``)."""
    if path.suffix != ".pt":
        return _read_safetensors(path)
    _require(path)
    try:
        state = load_torch_file(path)
    except TorchFileError as e:
        raise ConversionError(str(e)) from None
    bad = [k for k, v in state.items() if not isinstance(v, np.ndarray)] if isinstance(state, dict) else None
    if bad is None or bad:
        found = type(state).__name__ if bad is None else f"{bad[0]!r}, which is not a tensor"
        raise ConversionError(f"{path.name} must hold a state dict of tensors (torch.save), found {found}")
    return {k: mx.array(v) for k, v in state.items()}


def _read_safetensors(path: Path) -> dict[str, mx.array]:
    _require(path)
    try:
        return mx.load(str(path), format="safetensors")
    except Exception as e:  # MLX raises bare RuntimeError/ValueError for damaged files
        raise ConversionError(
            f"{path.name} cannot be read as safetensors ({e}); is the file truncated?"
        ) from None
