"""Convert resemble-perth's trained implicit watermark (perth_net_250000.pth.tar, MIT licence) to our safetensors.

The checkpoint is read with our restricted torch-zip reader (``mlx_chatterbox.torchfile``: no pickle code runs, torch
is not needed) and passed through ``PerthNet.checkpoint_table`` (strict keys and shapes, conv layouts). The file
keeps the network config and the training step in its metadata; ``Watermarker.load`` reads it.

Usage:
  python scripts/convert_perth.py [SRC] [--out PATH] [--decoder-dtype float32|float16]
SRC defaults to the checkpoint inside an installed resemble-perth, found through importlib.metadata without
importing perth (which would import torch). --out defaults to mlx_chatterbox/assets/perth_implicit.safetensors.
--decoder-dtype float16 stores the detector in half precision (the embedder stays float32, so ``apply`` is
unchanged); ``Watermarker.load`` widens it to float32.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run from a checkout

import mlx_chatterbox  # noqa: E402, F401  isort: skip  (first: it configures MLX before mlx.core loads)
import mlx.core as mx  # noqa: E402  isort: skip

from mlx_chatterbox.convert import ConversionError, sanitize  # noqa: E402
from mlx_chatterbox.generation.watermark import ASSET, Watermarker  # noqa: E402
from mlx_chatterbox.models.perth import PerthConfig, PerthNet  # noqa: E402
from mlx_chatterbox.torchfile import TorchFileError, load_torch_file  # noqa: E402

DISTRIBUTION = "resemble-perth"
CHECKPOINT = "perth/perth_net/pretrained/implicit/perth_net_250000.pth.tar"
DTYPES = {"float32": mx.float32, "float16": mx.float16}
# hparams.yaml entries that PerthConfig mirrors (the rest are training settings: lr, batch size, wandb, loss).
HPARAMS = {
    "sample_rate": "sample_rate",
    "n_fft": "n_fft",
    "hop_size": "hop_size",
    "window_size": "window_size",
    "hidden_size": "hidden_size",
    "max_wmark_freq": "max_wmark_freq",
    "stft_magnitude_min": "stft_magnitude_min",
}


def installed_checkpoint() -> Path:
    """The checkpoint inside the installed resemble-perth distribution (not imported)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            f"{DISTRIBUTION} is not installed; pip install {DISTRIBUTION}==1.0.1, or pass the .pth.tar"
        )
    path = Path(dist.locate_file(CHECKPOINT))
    if not path.is_file():
        raise SystemExit(f"{path} not found in the installed {DISTRIBUTION}; pass the .pth.tar path")
    return path


def check_hparams(path: Path, cfg: PerthConfig) -> None:
    """Compare the checkpoint's ``hparams.yaml`` (flat ``key: value`` lines; read without yaml) with ``cfg``."""
    if not path.is_file():
        return
    values = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition(":")
        if sep:
            values[key.strip()] = value.strip()
    if values.get("window_fn", "hann") != "hann":
        raise ConversionError(f"{path}: window_fn {values['window_fn']!r}; only 'hann' is supported")
    for name, field in HPARAMS.items():
        if name in values and float(values[name]) != float(getattr(cfg, field)):
            raise ConversionError(
                f"{path}: {name} = {values[name]}, but PerthConfig has {getattr(cfg, field)}"
            )


def perth_weights(src: Path, cfg: PerthConfig = PerthConfig()) -> tuple[dict[str, mx.array], int]:
    """The checkpoint's model weights under our names (float32, MLX layouts) and its training step."""
    try:
        ckpt = load_torch_file(src)
    except TorchFileError as e:
        raise ConversionError(str(e)) from None
    # CheckpointManager.save_model writes exactly {"model": state_dict, "step": int}; no optimizer state.
    if not isinstance(ckpt, dict) or set(ckpt) != {"model", "step"}:
        found = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ConversionError(f"{src}: expected a dict with 'model' and 'step', found {found}")
    model = {k: mx.array(v) for k, v in ckpt["model"].items()}
    weights = sanitize(model, PerthNet.checkpoint_table(cfg), Path(src).name)
    return {k: v.astype(mx.float32) for k, v in weights.items()}, int(ckpt["step"])


def convert(src: Path, out: Path, decoder_dtype: str = "float32") -> Path:
    """Write ``src``'s weights to ``out`` as safetensors that ``Watermarker.load`` reads; returns ``out``."""
    cfg = PerthConfig()
    check_hparams(Path(src).parent / "hparams.yaml", cfg)
    weights, step = perth_weights(Path(src), cfg)
    weights = {
        k: v.astype(DTYPES[decoder_dtype]) if k.startswith("decoder.") else v for k, v in weights.items()
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = Watermarker.metadata(
        cfg, source=f"{DISTRIBUTION} 1.0.1 {CHECKPOINT}", step=str(step), decoder_dtype=decoder_dtype
    )
    mx.save_safetensors(str(out), weights, metadata=meta)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "src", type=Path, nargs="?", help="perth_net_250000.pth.tar (default: installed resemble-perth)"
    )
    parser.add_argument("--out", type=Path, default=ASSET, help=f"output file (default {ASSET})")
    parser.add_argument("--decoder-dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args()
    src = args.src if args.src is not None else installed_checkpoint()
    out = convert(src, args.out, args.decoder_dtype)
    size = out.stat().st_size / 1e6
    print(f"wrote {out} ({size:.1f} MB) from {src}")


if __name__ == "__main__":
    main()
