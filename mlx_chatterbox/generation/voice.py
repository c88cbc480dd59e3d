"""A voice: the conditioning that makes T3 and S3Gen speak like one speaker, saved as one safetensors file,
and built from a recording by ``VoiceCloner`` (upstream ``ChatterboxTTS.prepare_conditionals``, and with
``VoiceCloner.turbo`` ``ChatterboxTurboTTS.prepare_conditionals``)."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..audio.fbank import campplus_features
from ..audio.io import load_audio
from ..audio.loudness import loudness_gain
from ..audio.mel import s3gen_mel, s3tokenizer_log_mel, voice_encoder_mel
from ..audio.resample import resample_sinc_hann, resample_soxr_hq
from ..audio.trim import trim_silence
from ..models.campplus import CAMPPlus
from ..models.s3tokenizer import S3Tokenizer
from ..models.voice_encoder import VoiceEncoder

logger = logging.getLogger(__name__)

FORMAT = "mlx-chatterbox-voice"
FORMAT_VERSION = "1"
_FIELDS = ("speaker_emb", "t3_prompt_tokens", "s3gen_prompt_tokens", "s3gen_prompt_mel", "xvector")


@dataclass(frozen=True)
class Voice:
    """speaker_emb: (1, 256) float voice-encoder embedding (T3).
    t3_prompt_tokens: (1, P) int32 S3 speech tokens of the reference's start (T3; English: 6 s, P <= 150;
        Turbo: 15 s, P <= 375).
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
REFERENCE_HINT = " (5 to 10 s works best)"  # ends the message for a reference too short
T3_PROMPT_SAMPLES = 6 * S3_SR  # tts.py ENC_COND_LEN: English T3's prompt tokens come from the first 6 s
S3GEN_PROMPT_SAMPLES = 10 * S3GEN_SR  # tts.py DEC_COND_LEN: S3Gen's prompt is the first 10 s
MIN_SECONDS = 0.5
TRIM_TOP_DB = 20  # voice_encoder.py embeds_from_wavs
# tts_turbo.py (Turbo and Nano): the prompt is 375 tokens from the first 15 s, the reference is brought to
# -27 LUFS first, and it must be longer than 5 s.
TURBO_T3_PROMPT_LEN = 375
TURBO_T3_PROMPT_SECONDS = 15.0
TURBO_TARGET_LUFS = -27.0
TURBO_LONGER_THAN_SECONDS = 5.0


def read_recording(audio: str | os.PathLike | np.ndarray, sample_rate: int | None, rate: int) -> np.ndarray:
    """A recording as upstream reads it (``librosa.load(path, sr=rate)``): an audio file (``load_audio``:
    channels averaged, soxr_hq to ``rate``), or mono float samples with their ``sample_rate`` (soxr_hq too).
    Returns (L,) float32 at ``rate``; whether it is usable is ``check_recording``'s to say."""
    if isinstance(audio, (str, os.PathLike)):
        if sample_rate is not None:
            raise ValueError("sample_rate is for sample arrays; an audio file carries its own rate")
        return load_audio(audio, rate)
    if sample_rate is None:
        raise ValueError("give the sample_rate of the audio samples")
    wav = np.asarray(audio, dtype=np.float32)
    if wav.ndim != 1:
        raise ValueError(f"audio samples must be mono (L,), got shape {wav.shape}; average the channels")
    return wav if sample_rate == rate else resample_soxr_hq(wav, sample_rate, rate)


def check_recording(wav: np.ndarray, rate: int, what: str, hint: str = "") -> None:
    """Refuse a recording (``what``: "the reference", "the source") too short for the S3 tokenizer and the
    speaker networks to say anything, with NaN/inf samples, or silent; ``hint`` ends the too-short message."""
    if wav.shape[0] < MIN_SECONDS * rate:
        raise ValueError(
            f"{what} is {wav.shape[0] / rate:.2f} s long; give at least {MIN_SECONDS} s of speech{hint}"
        )
    if not np.isfinite(wav).all():
        raise ValueError(f"{what} holds NaN or infinite samples")
    if np.abs(wav).max() == 0:
        raise ValueError(f"{what} is silent (all samples are zero)")


@dataclass
class VoiceCloner:
    """The three networks that turn a recording into a ``Voice``, and how the variant uses the recording.

    The defaults are English's (``ChatterboxTTS.prepare_conditionals``); `VoiceCloner.turbo` gives Turbo's and
    Nano's (``ChatterboxTurboTTS.prepare_conditionals``).
    """

    voice_encoder: VoiceEncoder
    s3tokenizer: S3Tokenizer
    campplus: CAMPPlus
    t3_prompt_len: int = 150  # T3Config.speech_cond_prompt_len: the most T3 prompt tokens
    t3_prompt_seconds: float = 6.0  # ENC_COND_LEN / 16 kHz: T3's prompt tokens come from this much audio
    target_lufs: float | None = None  # bring the reference to this integrated loudness first (None: as is)
    longer_than_seconds: float | None = (
        None  # refuse a reference of at most this many seconds (None: no rule)
    )

    def __post_init__(self) -> None:
        if int(self.t3_prompt_len) != self.t3_prompt_len or self.t3_prompt_len < 1:
            raise ValueError(f"t3_prompt_len must be a positive number of tokens, got {self.t3_prompt_len!r}")
        samples = self.t3_prompt_seconds * S3_SR
        if not samples >= 1 or samples != int(samples):
            raise ValueError(
                "t3_prompt_seconds must be positive and a whole number of 16 kHz samples, "
                f"got {self.t3_prompt_seconds!r}"
            )
        if self.target_lufs is not None and not math.isfinite(self.target_lufs):
            raise ValueError(
                f"target_lufs must be a finite loudness in LUFS or None, got {self.target_lufs!r}"
            )
        if self.longer_than_seconds is not None and not self.longer_than_seconds >= 0:
            raise ValueError(f"longer_than_seconds must be >= 0 or None, got {self.longer_than_seconds!r}")

    @classmethod
    def turbo(
        cls,
        voice_encoder: VoiceEncoder,
        s3tokenizer: S3Tokenizer,
        campplus: CAMPPlus,
        t3_prompt_len: int = TURBO_T3_PROMPT_LEN,
    ) -> VoiceCloner:
        """Turbo's and Nano's cloning (variants.md §2.6): -27 LUFS, more than 5 s, a 375-token prompt from
        15 s."""
        return cls(
            voice_encoder,
            s3tokenizer,
            campplus,
            t3_prompt_len,
            t3_prompt_seconds=TURBO_T3_PROMPT_SECONDS,
            target_lufs=TURBO_TARGET_LUFS,
            longer_than_seconds=TURBO_LONGER_THAN_SECONDS,
        )

    def __call__(self, wav_24k: np.ndarray) -> Voice:
        """A mono float32 recording at 24 kHz (as ``librosa.load(path, sr=24000)`` gives) -> Voice.

        Upstream's two resamplings are kept apart (architecture §4.1, §9.15): soxr_hq of the whole reference
        to 16 kHz for T3's prompt tokens (first ``t3_prompt_seconds``) and the voice encoder, and torchaudio's
        sinc-Hann of the first 10 s for CAM++ and S3Gen's prompt tokens. With ``target_lufs`` the reference is
        first scaled to that loudness (pyloudnorm's BS.1770 meter); a clip too quiet to measure (below the
        -70 LUFS gate) stays as it is, as upstream leaves it, with a warning.
        """
        wav = np.asarray(wav_24k, dtype=np.float32)
        if wav.ndim != 1:
            raise ValueError(f"the reference must be mono (L,) samples, got shape {wav.shape}")
        # Upstream Turbo asserts len / sr > 5.0: exactly 5 s is refused too.
        if self.longer_than_seconds is not None and not wav.shape[0] / S3GEN_SR > self.longer_than_seconds:
            raise ValueError(
                f"the reference is {wav.shape[0] / S3GEN_SR:.2f} s long; this model needs a recording longer "
                f"than {self.longer_than_seconds:g} s (it uses up to {self.t3_prompt_seconds:g} s)"
            )
        check_recording(wav, S3GEN_SR, "the reference", REFERENCE_HINT)
        if self.target_lufs is not None:
            gain = loudness_gain(wav, S3GEN_SR, self.target_lufs)
            if gain is None:
                logger.warning(
                    "the reference is too quiet to measure its loudness (below -70 LUFS); it is used unscaled"
                )
            else:
                # A Python float keeps the clip float32, as upstream's numpy (pinned < 2) does with its gain.
                wav = wav * gain
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
        t3_tokens = self._tokens(ref_16k[: int(self.t3_prompt_seconds * S3_SR)], self.t3_prompt_len)
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
