"""Hybrid mode: our MLX speech tokens, vocoded by upstream's own PyTorch S3Gen (``pip install
mlx-chatterbox[hybrid]``), for users who want upstream's decoder byte for byte.

The only run-time module that touches torch and upstream ``chatterbox``, and only when it is used: both are
imported inside ``TorchS3Gen.load``. Upstream's weights come from the checkpoint the model folder was converted
from (its ``config.json`` records the folder, or the Hub repo and revision).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from .generation.voice import Voice

INSTALL_HINT = (
    "hybrid mode (s3gen='torch') needs PyTorch and upstream chatterbox-tts: "
    "pip install 'mlx-chatterbox[hybrid]' (then chatterbox-tts==0.1.7 --no-deps, as scripts/install_oracle.sh does)"
)
S3GEN_FILE = "s3gen.safetensors"


class TorchS3Gen:
    """Upstream ``S3Token2Wav`` (PyTorch, CPU or CUDA) with the checkpoint's weights."""

    def __init__(self, model: object, torch: object):
        self.model = model
        self.torch = torch

    @classmethod
    def load(cls, source: dict, device: str | None = None) -> "TorchS3Gen":
        """source: the ``source`` entry of a converted folder's config.json."""
        missing = [m for m in ("torch", "chatterbox") if importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(f"{INSTALL_HINT} ({', '.join(missing)} not installed)")
        import torch
        from chatterbox.models.s3gen import S3Gen
        from safetensors.torch import load_file

        path = _upstream_file(source)
        model = S3Gen()
        # Upstream loads this file non-strictly, for the tokenizer's front-end buffers only (tts.py from_local).
        model.load_state_dict(load_file(str(path)), strict=False)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(model.to(device).eval(), torch)

    def __call__(
        self, tokens: np.ndarray, voice: Voice, cfm_steps: int | None, seed: int | None
    ) -> np.ndarray:
        """Upstream ``S3Token2Wav.inference`` on our tokens and voice: float32 (samples,) at 24 kHz, faded in,
        not watermarked. The draws come from torch's generator (seeded when ``seed`` is given)."""
        torch = self.torch
        device = next(self.model.parameters()).device
        ref = {
            "prompt_token": torch.from_numpy(np.array(voice.s3gen_prompt_tokens).astype(np.int64)),
            "prompt_token_len": torch.tensor([voice.s3gen_prompt_tokens.shape[1]]),
            "prompt_feat": torch.from_numpy(np.array(voice.s3gen_prompt_mel, dtype=np.float32)),
            "prompt_feat_len": None,
            "embedding": torch.from_numpy(np.array(voice.xvector, dtype=np.float32)),
        }
        if seed is not None:
            torch.manual_seed(seed)
        speech = torch.from_numpy(np.asarray(tokens, dtype=np.int64))[None].to(device)
        wav, _ = self.model.inference(speech_tokens=speech, ref_dict=ref, n_cfm_timesteps=cfm_steps)
        return wav[0].detach().cpu().numpy().astype(np.float32)


def _upstream_file(source: dict) -> Path:
    if "path" in source:
        path = Path(source["path"]) / S3GEN_FILE
    else:
        from huggingface_hub import hf_hub_download

        try:
            path = Path(hf_hub_download(source["repo"], S3GEN_FILE, revision=source["revision"]))
        except Exception as e:  # offline, missing cache, auth: one message
            raise FileNotFoundError(
                f"hybrid mode needs upstream's {S3GEN_FILE} from {source['repo']}@{source['revision']} "
                f"and could not get it ({type(e).__name__}); convert from a local folder instead"
            ) from None
    if not path.is_file():
        raise FileNotFoundError(
            f"hybrid mode needs upstream's {S3GEN_FILE}, and {path} is gone; it was the conversion source"
        )
    return path
