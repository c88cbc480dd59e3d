"""A voice: the conditioning that makes T3 and S3Gen speak like one speaker, saved as one safetensors file, and
built from a recording by ``VoiceCloner`` (upstream ``ChatterboxTTS.prepare_conditionals``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..audio.fbank import campplus_features
from ..audio.mel import s3gen_mel, s3tokenizer_log_mel, voice_encoder_mel
from ..audio.resample import resample_sinc_hann, resample_soxr_hq
from ..audio.trim import trim_silence
from ..models.campplus import CAMPPlus
from ..models.s3tokenizer import S3Tokenizer
from ..models.voice_encoder import VoiceEncoder

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


S3GEN_SR = 24000  # the reference is read at S3Gen's rate
S3_SR = 16000  # the S3 tokenizer's, CAM++'s and the voice encoder's rate
T3_PROMPT_SAMPLES = 6 * S3_SR  # tts.py ENC_COND_LEN: T3's prompt tokens come from the first 6 s
S3GEN_PROMPT_SAMPLES = 10 * S3GEN_SR  # tts.py DEC_COND_LEN: S3Gen's prompt is the first 10 s
MIN_SECONDS = 0.5
TRIM_TOP_DB = 20  # voice_encoder.py embeds_from_wavs


@dataclass
class VoiceCloner:
    """The three networks that turn a recording into a ``Voice``."""

    voice_encoder: VoiceEncoder
    s3tokenizer: S3Tokenizer
    campplus: CAMPPlus
    t3_prompt_len: int = 150  # T3Config.speech_cond_prompt_len

    def __call__(self, wav_24k: np.ndarray) -> Voice:
        """A mono float32 recording at 24 kHz (as ``librosa.load(path, sr=24000)`` gives) -> Voice.

        Upstream's two resamplings are kept apart (architecture §4.1, §9.15): soxr_hq of the whole reference to
        16 kHz for T3's prompt tokens (first 6 s) and the voice encoder, and torchaudio's sinc-Hann of the first
        10 s for CAM++ and S3Gen's prompt tokens.
        """
        wav = np.asarray(wav_24k, dtype=np.float32)
        if wav.ndim != 1:
            raise ValueError(f"the reference must be mono (L,) samples, got shape {wav.shape}")
        if wav.shape[0] < MIN_SECONDS * S3GEN_SR:
            raise ValueError(
                f"the reference is {wav.shape[0] / S3GEN_SR:.2f} s long; give at least {MIN_SECONDS} s of speech "
                "(5 to 10 s works best)"
            )
        if not np.isfinite(wav).all():
            raise ValueError("the reference holds NaN or infinite samples")
        if np.abs(wav).max() == 0:
            raise ValueError("the reference is silent (all samples are zero)")
        ref_16k = resample_soxr_hq(wav, S3GEN_SR, S3_SR)

        # S3Gen's prompt (s3gen.py embed_ref) from the first 10 s.
        clip = wav[:S3GEN_PROMPT_SAMPLES]
        prompt_mel = s3gen_mel(clip)  # (T, 80), T = L // 480
        clip_16k = resample_sinc_hann(clip, S3GEN_SR, S3_SR)
        xvector = self.campplus(mx.array(campplus_features(clip_16k))[None])
        prompt_tokens = self._tokens(clip_16k, None)
        # Upstream cuts the tokens (never the mel) when the lengths disagree: 2 mel frames per token.
        prompt_tokens = prompt_tokens[:, : prompt_mel.shape[0] // 2]

        # T3's prompt tokens and speaker embedding (tts.py prepare_conditionals).
        t3_tokens = self._tokens(ref_16k[:T3_PROMPT_SAMPLES], self.t3_prompt_len)
        start, end = trim_silence(ref_16k, top_db=TRIM_TOP_DB)
        speaker = self.voice_encoder(mx.array(voice_encoder_mel(ref_16k[start:end])))
        return Voice(
            speaker_emb=speaker[None],
            t3_prompt_tokens=t3_tokens,
            s3gen_prompt_tokens=prompt_tokens,
            s3gen_prompt_mel=mx.array(prompt_mel)[None],
            xvector=xvector,
        )

    def _tokens(self, wav_16k: np.ndarray, max_len: int | None) -> mx.array:
        mel = s3tokenizer_log_mel(wav_16k, max_len=max_len)
        codes, _ = self.s3tokenizer(mx.array(mel)[None], mx.array([mel.shape[0]], dtype=mx.int32))
        return codes.astype(mx.int32)
