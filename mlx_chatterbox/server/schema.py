"""The request bodies of the server and OpenAI's error shape.

``SpeechRequest`` is OpenAI's ``POST /v1/audio/speech`` body (developers.openai.com, audio/speech/create) plus
Chatterbox's knobs; fields it does not know are refused (a misspelt knob must not be silently ignored).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt

from ..sampling import SamplingParams, TurboParams
from .encode import FORMATS

MAX_INPUT = 4096  # characters, OpenAI's limit
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")  # accepted as names of the loaded model
KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "cfg_weight", "exaggeration")


class VoiceId(BaseModel):
    """OpenAI's custom-voice form of ``voice``: ``{"id": name}``."""

    model_config = ConfigDict(extra="forbid")
    id: str


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str = Field(max_length=MAX_INPUT)
    voice: str | VoiceId = "default"
    response_format: Literal[FORMATS] = "mp3"  # type: ignore[valid-type]  # OpenAI's default
    speed: StrictFloat = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None  # refused: Chatterbox takes no style prompt (use exaggeration)
    # Ours. None: stream when the request allows it (speed 1); False: the whole audio in one pass, exactly what
    # TTS.generate gives; True: stream (refused with speed != 1: a time-stretch needs the whole audio).
    stream: bool | None = None
    # Ours: a streamed response's decode window in speech tokens (generation/stream.py CONTEXT), or "whole"
    # (every token so far: closer to the whole audio, each chunk dearer as the text goes on). None: the
    # server's (serve --stream-context). Refused for a response that is not streamed.
    stream_context: Annotated[StrictInt, Field(ge=0)] | Literal["whole"] | None = None
    # Ours: the text's language, for a multilingual model (required there; refused by the English-only models).
    language: str | None = None
    # Chatterbox's knobs: None = the model's default (sampling.SamplingParams, or TurboParams for Turbo/Nano,
    # which check the ranges; a knob the model lacks is refused). Strict types (an int is a float too): "0.5"
    # or true is a mistake to report, not to convert.
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    cfg_weight: StrictFloat | None = None
    exaggeration: StrictFloat | None = None
    max_new_tokens: StrictInt | None = None
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    cfm_steps: StrictInt | None = Field(None, ge=1, le=100)

    @property
    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceId) else self.voice

    def sampling_params(
        self, kind: type[SamplingParams | TurboParams] = SamplingParams, variant: str = "english"
    ) -> SamplingParams | TurboParams:
        """The knobs given, over the model's defaults (``kind``); ValueError naming the knob for one out of
        range, or one the ``variant`` model does not have."""
        given = {k: getattr(self, k) for k in (*KNOBS, "max_new_tokens") if getattr(self, k) is not None}
        unknown = sorted(set(given) - set(kind.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{unknown[0]} is not a knob of the {variant} model served here; leave it out")
        return kind(**given)


def error_body(
    message: str, param: str | None = None, code: str | None = None, kind: str | None = None
) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {"message": message, "type": kind or "invalid_request_error", "param": param, "code": code}
    }
