"""A voice: the conditioning that makes T3 and S3Gen speak like one speaker, saved as one safetensors file."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

FORMAT = "mlx-chatterbox-voice"
FORMAT_VERSION = "1"
_FIELDS = ("speaker_emb", "t3_prompt_tokens", "s3gen_prompt_tokens", "s3gen_prompt_mel", "xvector")


@dataclass(frozen=True)
class Voice:
    """speaker_emb: (1, 256) float voice-encoder embedding (T3).
    t3_prompt_tokens: (1, P) int32 S3 speech tokens of the reference's first 6 s (T3; upstream P = 150).
    s3gen_prompt_tokens: (1, N) int32 S3 tokens of the reference's first 10 s (S3Gen); N may be 0 (no prompt).
    s3gen_prompt_mel: (1, T, 80) float 24 kHz log-mel of the same audio, T = 2N or 2N + 1 (S3Gen).
    xvector: (1, 192) float CAM++ speaker embedding (S3Gen).
    """

    speaker_emb: mx.array
    t3_prompt_tokens: mx.array
    s3gen_prompt_tokens: mx.array
    s3gen_prompt_mel: mx.array
    xvector: mx.array

    def __post_init__(self) -> None:
        def fail(what: str) -> None:
            raise ValueError(f"invalid voice: {what}")

        s, t, g, m, x = (getattr(self, f) for f in _FIELDS)
        if s.ndim != 2 or s.shape[0] != 1 or not mx.issubdtype(s.dtype, mx.floating):
            fail(f"speaker_emb must be a float (1, D) array, got {s.dtype} {s.shape}")
        # T3 needs a prompt; S3Gen can do without (then only the x-vector sets the timbre).
        for name, tok, least in (("t3_prompt_tokens", t, 1), ("s3gen_prompt_tokens", g, 0)):
            if tok.ndim != 2 or tok.shape[0] != 1 or tok.shape[1] < least or tok.dtype != mx.int32:
                fail(f"{name} must be an int32 (1, N >= {least}) array, got {tok.dtype} {tok.shape}")
        if m.ndim != 3 or m.shape[0] != 1 or m.shape[2] != 80 or m.shape[1] // 2 != g.shape[1]:
            fail(
                f"s3gen_prompt_mel must be (1, 2N or 2N + 1, 80) with N = {g.shape[1]} prompt tokens, got {m.shape}"
            )
        if x.ndim != 2 or x.shape[0] != 1 or not mx.issubdtype(x.dtype, mx.floating):
            fail(f"xvector must be a float (1, D) array, got {x.dtype} {x.shape}")

    def save(self, path: str | os.PathLike) -> Path:
        """Write the voice to a safetensors file (atomically: a failed write leaves no file behind)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.safetensors")
        try:
            mx.save_safetensors(
                str(tmp),
                {f: getattr(self, f) for f in _FIELDS},
                metadata={"format": FORMAT, "format_version": FORMAT_VERSION},
            )
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Voice":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"voice file {path} not found")
        try:
            arrays, metadata = mx.load(str(path), return_metadata=True)
        except Exception as e:  # MLX raises bare RuntimeErrors for unreadable files
            raise ValueError(f"{path} is not a readable safetensors voice file ({e})") from None
        if metadata.get("format") != FORMAT:
            raise ValueError(
                f"{path} is not an mlx-chatterbox voice file (format {metadata.get('format')!r})"
            )
        if metadata.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path} has voice format version {metadata.get('format_version')!r}; "
                f"this mlx-chatterbox reads version {FORMAT_VERSION}"
            )
        if set(arrays) != set(_FIELDS):
            raise ValueError(f"{path}: expected arrays {sorted(_FIELDS)}, found {sorted(arrays)}")
        return cls(**arrays)
