"""The OpenAI-compatible HTTP routes: ``POST /v1/audio/speech`` (whole, streamed or server-sent events), the voice
library under ``/v1/audio/voices``, ``/v1/models``, ``/health``, ``/metrics`` (Prometheus: where the worker's time
goes) and the playground page at ``/``. All model work goes through the ``Worker``; every request passes the
``Gate`` first (API keys, shutdown).

Every error is OpenAI's JSON shape (``schema.error_body``); FastAPI's 422 for a bad body becomes a 400 naming
the field.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from importlib import resources
from typing import Literal

import numpy as np
import soundfile as sf
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..audio.stretch import time_stretch
from ..generation.stream import CHUNK
from ..generation.stream import CONTEXT as STREAM_CONTEXT
from ..generation.stream import FIRST_CHUNK, check_chunks, check_context
from .encode import StreamEncoder, check_format, content_type, encode
from .gate import Gate
from .metrics import CONTENT_TYPE, prometheus
from .schema import KNOBS, OPENAI_MODELS, SpeechRequest, error_body
from .voices import BUILTIN, UnknownVoice, VoiceExists, VoiceStore, check_name
from .worker import QueueFull, SpeechJob, Ticket, Worker

logger = logging.getLogger(__name__)
PLAYGROUND = resources.files(__package__) / "playground.html"
SHUT_DOWN = "the server shut down before this speech was finished (its --shutdown-timeout passed)"
MAX_UPLOAD = 50 * 2**20  # bytes of a voice recording; only its first 10 s are used


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def create_app(
    worker: Worker,
    voices: VoiceStore,
    *,
    model_name: str,
    cfm_steps: int | None = None,
    stream_context: int | Literal["whole"] = STREAM_CONTEXT,
    first_chunk: int = FIRST_CHUNK,
    max_upload: int = MAX_UPLOAD,
    api_keys: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
    ui: bool = True,
) -> FastAPI:
    """The server's app over a started ``worker`` (it is not started or closed here).

    model_name: the id ``/v1/models`` lists; a speech request's ``model`` must be it, "chatterbox", or one of
        OpenAI's tts-1, tts-1-hd, gpt-4o-mini-tts (so that clients written for OpenAI work unchanged).
    cfm_steps: the flow-matching steps of requests that give none (None: the model's, upstream's 10 or Turbo's 2).
    stream_context: the decode window of streamed requests that give none (``TTS.stream``'s ``context``).
    first_chunk: the speech tokens of a streamed request before its first decode (``TTS.stream``'s).
    max_upload: the largest voice recording accepted, in bytes.
    api_keys: when given, every path but ``/health`` and ``/`` (``/metrics`` too) needs ``Authorization: Bearer
        <one of them>``.
    allowed_origins: the web origins whose pages may call the server (CORS; ``*``: any); none: same origin only.
    ui: serve the playground page at ``/``.
    """
    check_context(stream_context)
    check_chunks(first_chunk, CHUNK, worker.tts.s3gen.flow.config.pre_lookahead_len)
    app = FastAPI(title="mlx-chatterbox", version=__version__)
    models = list(dict.fromkeys([model_name, "chatterbox", *OPENAI_MODELS]))
    speech_kind = worker.tts.speech
    defaults = dataclasses.asdict(speech_kind.params_type())
    # The steps in effect for a request that gives none: --cfm-steps, else the decoder's (10; meanflow 2).
    cfm_steps_used = cfm_steps if cfm_steps is not None else worker.tts.s3gen.estimator.config.n_timesteps
    # The CFM estimator's dtype (--cfm-dtype), None in hybrid mode, where upstream's S3Gen runs.
    cfm_dtype = (
        None if worker.tts.torch_s3gen is not None else str(worker.tts.s3gen.estimator.dtype).split(".")[-1]
    )
    # S3Gen's memory budget a call (--vocode-memory): "auto", "none" or GB; None in hybrid mode, as cfm_dtype.
    vocode_memory = None
    if cfm_dtype is not None:
        budget = worker.tts.s3gen.memory_budget
        vocode_memory = "none" if budget is None else budget if budget == "auto" else budget / 2**30
    gate = app.state.gate = Gate(api_keys)
    _install_error_handlers(app)
    app.add_middleware(_Gated, gate=gate)
    if allowed_origins:  # added last: the outermost, so that it answers preflights and marks 401s too
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type"],
            expose_headers=["Server-Timing"],  # a page's fetch() may read it
        )

    if ui:

        @app.get("/", include_in_schema=False)
        async def playground() -> HTMLResponse:
            return HTMLResponse(PLAYGROUND.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health(memory: bool = False) -> JSONResponse:
        # memory: asked for, not always, since it waits for the worker's current step (or vocoding) to end.
        extra = {"memory": await asyncio.wrap_future(worker.memory())} if memory else {}
        # 503 while S3Gen's side is down (its process died, a new one not yet running): a balancer steps aside
        down = worker.vocoder_error
        if down is not None:
            extra["error"] = down
        body = {
            "status": "ok" if down is None else "degraded",
            "model": model_name,
            "queue": worker.jobs,
            "max_queue": worker.max_queue,
            "max_batch": worker.max_batch,
            "vocode_batch": worker.vocode_batch,
            "vocode_thread": worker.vocode_thread,
            "vocoding": worker.vocoding if worker.vocode_thread else None,
            "stream_catch_up": worker.vocode_thread and worker.stream_catch_up,
            "mark_threads": worker.mark_threads,
            "cfm_steps": cfm_steps_used,
            "cfm_dtype": cfm_dtype,
            "vocode_memory": vocode_memory,
            "stream_context": stream_context,
            "first_chunk": first_chunk,
            "sample_rate": worker.sample_rate,
            "variant": speech_kind.variant,
            "defaults": defaults,
            "auth": bool(gate.api_keys),
            **extra,
        }
        return JSONResponse(body, status_code=200 if down is None else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        # Behind the API keys, unlike /health: it tells the server's traffic, and Prometheus can send a key.
        return PlainTextResponse(prometheus(worker.metrics()), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "mlx-chatterbox"} for m in models
            ],
        }

    @app.post("/v1/audio/speech")
    @app.post("/audio/speech", include_in_schema=False)
    async def speech(body: SpeechRequest, request: Request) -> Response:
        received = time.perf_counter()
        job, stream = await _job(body, worker, voices, models, cfm_steps, stream_context, first_chunk)
        try:
            ticket = gate.track(worker.submit(job))
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}; retry later", code="queue_full") from None
        except ValueError as e:
            raise ApiError(400, str(e), _param_of(str(e), "input")) from None
        watch = _watch_disconnect(request, ticket)
        try:
            if not stream:
                wav = await _whole(ticket, gate)
                if body.speed != 1:
                    wav = await run_in_threadpool(time_stretch, wav, body.speed, ticket.sample_rate)
                if body.stream_format == "sse":
                    chunks = _once(wav)
                else:
                    data = await run_in_threadpool(encode, wav, ticket.sample_rate, body.response_format)
                    watch.cancel()
                    return Response(
                        data,
                        media_type=content_type(body.response_format, ticket.sample_rate),
                        headers={"Server-Timing": server_timing(ticket.times, received)},
                    )
            else:
                chunks = ticket.__aiter__()
                first = await _first(chunks)  # errors before any audio get a proper status
                chunks = _prepend(first, chunks)
        except BaseException:
            watch.cancel()
            ticket.cancel()
            raise
        timing = {"Server-Timing": server_timing(ticket.times, received)}
        if body.stream_format == "sse":
            content = _sse(chunks, body.response_format, ticket, watch, gate)
            return StreamingResponse(
                content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **timing}
            )
        content = _audio(chunks, body.response_format, ticket, watch)
        return StreamingResponse(
            content, media_type=content_type(body.response_format, ticket.sample_rate), headers=timing
        )

    @app.get("/v1/audio/voices")
    async def list_voices() -> dict:
        names = await run_in_threadpool(voices.names)
        return {
            "voices": [
                {"id": n, "name": n, "builtin": n == BUILTIN and voices.builtin is not None} for n in names
            ]
        }

    @app.post("/v1/audio/voices", status_code=201)
    async def add_voice(
        name: str = Form(...), file: UploadFile = File(...), overwrite: bool = Form(False)
    ) -> dict:
        try:
            check_name(name)
        except ValueError as e:
            raise ApiError(400, str(e), "name") from None
        if not overwrite and name in await run_in_threadpool(voices.names):
            raise ApiError(
                409, f"voice {name!r} exists already; delete it first or send overwrite=true", "name"
            )
        data = await file.read(max_upload + 1)
        if len(data) > max_upload:
            raise ApiError(413, f"the recording is over {max_upload} bytes; send 5-10 s of speech", "file")
        samples, rate = await run_in_threadpool(_decode_upload, data, file.filename or "file")
        try:
            await asyncio.wrap_future(worker.run(_clone, worker.tts, samples, rate, voices, name, overwrite))
        except VoiceExists as e:
            raise ApiError(409, str(e), "name") from None
        except ValueError as e:
            raise ApiError(400, f"cannot clone a voice from {file.filename}: {e}", "file") from None
        return {"id": name, "name": name, "builtin": False}

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str) -> dict:
        try:
            # On the worker thread: dropping the cached voice frees MLX arrays (Worker.start says why there).
            await asyncio.wrap_future(worker.run(voices.delete, name))
        except UnknownVoice as e:
            raise ApiError(404, str(e), "name") from None
        except ValueError as e:
            raise ApiError(400, str(e), "name") from None
        return {"id": name, "deleted": True}

    return app


async def _job(
    body: SpeechRequest,
    worker: Worker,
    voices: VoiceStore,
    models: list[str],
    cfm_steps: int | None,
    stream_context: int | Literal["whole"],
    first_chunk: int,
) -> tuple[SpeechJob, bool]:
    """The worker job of a speech request, and whether its audio streams; ApiError for what cannot be done."""
    if body.model not in models:
        raise ApiError(
            400, f"model {body.model!r} is not served here; use one of: {', '.join(models)}", "model"
        )
    if not body.input.strip():
        raise ApiError(400, "input is empty; give some words to speak", "input")
    if body.instructions:
        raise ApiError(
            400,
            "instructions are not supported: Chatterbox takes no style prompt; leave them out, and set "
            "exaggeration (emotion intensity, default 0.5) instead",
            "instructions",
        )
    try:
        check_format(body.response_format)
    except ValueError as e:
        raise ApiError(400, str(e), "response_format") from None
    try:
        speech = worker.tts.speech
        params = body.sampling_params(speech.params_type, speech.variant)
    except ValueError as e:
        raise ApiError(400, str(e), _param_of(str(e))) from None
    try:  # a voice file is read on the worker thread: its arrays are MLX work
        voice = voices.cached(body.voice_name) or await asyncio.wrap_future(
            worker.run(voices.get, body.voice_name)
        )
    except UnknownVoice as e:
        hint = ""
        if body.voice_name == BUILTIN:
            hint = " (this model has no built-in voice: start the server with --voice, or upload one)"
        raise ApiError(400, f"{e}{hint}", "voice") from None
    # A time-stretch needs the whole audio; a streamed request's speed could only be honoured at its end.
    stream = body.stream if body.stream is not None else body.speed == 1
    if stream and body.speed != 1:
        raise ApiError(
            400,
            f"speed={body.speed} needs the whole audio before it is sent (a time-stretch); leave out stream, "
            "or send stream=false (or speed 1 to stream)",
            "speed",
        )
    if body.stream_context is not None and not stream:
        raise ApiError(
            400,
            "stream_context sets how a streamed response is decoded, and this one is answered whole "
            f"({'stream=false' if body.stream is False else f'speed={body.speed}'}); leave it out, or stream",
            "stream_context",
        )
    steps = body.cfm_steps if body.cfm_steps is not None else cfm_steps
    context = body.stream_context if body.stream_context is not None else stream_context
    job = SpeechJob(
        body.input,
        voice,
        params,
        cfm_steps=steps,
        seed=body.seed,
        stream=stream,
        stream_context=context,
        first_chunk=first_chunk,
        language=body.language,
    )
    return job, stream


# A speech response's steps towards its first audio (worker.Ticket.times), named in Server-Timing with hyphens.
SERVER_TIMING = ("admitted", "first_token", "first_chunk", "first_audio", "first_ready")


def server_timing(times: Mapping[str, float], received: float) -> str:
    """A speech response's Server-Timing header: for each step of ``times`` that happened and for "response"
    (the headers, now), the milliseconds since the request was ``received`` (perf_counter), in the order they
    happened, e.g. ``admitted;dur=2.1, first-token;dur=24.0, ..., response;dur=181.3``. (A leading pause's
    silence is a stream's first audio, before its first token.)"""
    marks = sorted((times[name], name.replace("_", "-")) for name in SERVER_TIMING if name in times)
    marks.append((time.perf_counter(), "response"))
    return ", ".join(f"{name};dur={1000 * (t - received):.1f}" for t, name in marks)


def _param_of(message: str, default: str | None = None) -> str | None:
    """The request field an error message is about (our messages start with ``field=`` or name it)."""
    head = message.split("=", 1)[0].split(" ", 1)[0]
    fields = (*KNOBS, "max_new_tokens", "cfm_steps", "seed", "input", "voice", "speed", "language")
    if head in fields:
        return head
    return next((f for f in fields if f in message), default)


def _watch_disconnect(request: Request, ticket: Ticket) -> asyncio.Task:
    """A task that cancels the job when the client goes away (it waits for ASGI's http.disconnect)."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                if not ticket.cancelled:
                    logger.info("client gone: cancelling its job")
                ticket.cancel()
                return

    return asyncio.create_task(watch())


async def _whole(ticket: Ticket, gate: Gate) -> np.ndarray:
    try:
        chunks = [c async for c in ticket]
    except Exception as e:
        raise ApiError(500, f"speech generation failed: {e}", code="generation_failed") from None
    if ticket.cancelled and gate.cut:
        raise ApiError(503, SHUT_DOWN, code="shutting_down")
    if ticket.cancelled:
        raise ApiError(499, "the client went away")
    return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


async def _first(chunks: AsyncIterator[np.ndarray]) -> np.ndarray | None:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None
    except Exception as e:
        raise ApiError(500, f"speech generation failed: {e}", code="generation_failed") from None


async def _prepend(first: np.ndarray | None, rest: AsyncIterator[np.ndarray]) -> AsyncIterator[np.ndarray]:
    if first is None:
        return
    yield first
    async for chunk in rest:
        yield chunk


async def _once(wav: np.ndarray) -> AsyncIterator[np.ndarray]:
    yield wav


async def _encoded(chunks: AsyncIterator[np.ndarray], fmt: str, sample_rate: int) -> AsyncIterator[bytes]:
    """The chunks encoded in ``fmt`` as they come, then the encoder's last bytes: joined, one file."""
    encoder = StreamEncoder(fmt, sample_rate)
    async for chunk in chunks:
        data = encoder.write(chunk)
        if data:
            yield data
    data = encoder.close()
    if data:
        yield data


async def _audio(
    chunks: AsyncIterator[np.ndarray], fmt: str, ticket: Ticket, watch: asyncio.Task
) -> AsyncIterator[bytes]:
    """The encoded bytes of a streamed response, as the chunks come."""
    finished = False
    try:
        async for data in _encoded(chunks, fmt, ticket.sample_rate):
            yield data
        finished = True
    finally:  # an error raised here ends the body early (the status line has gone out); uvicorn logs it
        watch.cancel()
        if not finished:
            ticket.cancel()


async def _sse(
    chunks: AsyncIterator[np.ndarray], fmt: str, ticket: Ticket, watch: asyncio.Task, gate: Gate
) -> AsyncIterator[str]:
    """Server-sent events: ``speech.audio.delta`` with base64 audio in ``fmt`` (the deltas' bytes joined are one
    file), then ``speech.audio.done`` with the token usage; a failure ends with an ``error`` event."""

    def event(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    finished = False
    try:
        async for data in _encoded(chunks, fmt, ticket.sample_rate):
            yield event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
        finished = True
        if ticket.cancelled and gate.cut:
            yield event({"type": "error", **error_body(SHUT_DOWN, None, "shutting_down", "server_error")})
            return
        usage = {
            "input_tokens": ticket.text_tokens,
            "output_tokens": ticket.speech_tokens,
            "total_tokens": ticket.text_tokens + ticket.speech_tokens,
        }
        yield event({"type": "speech.audio.done", "usage": usage})
    except Exception as e:
        logger.exception("speech generation failed mid-stream")
        finished = True
        yield event({"type": "error", **error_body(f"speech generation failed: {e}", kind="server_error")})
    finally:
        watch.cancel()
        if not finished:
            ticket.cancel()


def _clone(tts, samples: np.ndarray, rate: int, voices: VoiceStore, name: str, overwrite: bool) -> None:
    """On the worker thread, which the cloned voice's lazy arrays belong to: clone, then store."""
    voices.add(name, tts.voice(samples, rate), overwrite)


def _decode_upload(data: bytes, filename: str) -> tuple[np.ndarray, int]:
    """An uploaded recording -> (T,) float32 mono samples and their rate; ApiError naming what is wrong."""
    try:
        samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        # libsndfile's message names the file object ("Error opening <_io.BytesIO object at 0x...>: ..."):
        # only its reason says anything to the client.
        reason = getattr(e, "error_string", None) or str(e)
        raise ApiError(
            400,
            f"{filename} ({len(data)} bytes) is not audio this server can read ({reason.rstrip('.')}); send "
            "WAV, FLAC, OGG or MP3",
            "file",
        ) from None
    if samples.shape[0] == 0:
        raise ApiError(400, f"{filename} holds no samples", "file")
    if not np.isfinite(samples).all():
        raise ApiError(400, f"{filename} holds NaN or infinite samples", "file")
    return samples.mean(axis=1).astype(np.float32), int(rate)


class _Gated:
    """The ``Gate`` as Starlette middleware (``app.add_middleware``)."""

    def __init__(self, app, gate: Gate):
        self.app = gate.middleware(app)

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    def answer(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse(error_body(message, param, code, kind), status_code=status)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return answer(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        kind = err.get("type", "")
        param = loc[1] if len(loc) > 1 and loc[0] in ("body", "query", "path") else None
        if kind == "json_invalid":
            return answer(
                400, f"the body is not valid JSON ({err.get('msg')}); send a JSON object", None, kind
            )
        if kind == "extra_forbidden":
            fields = ", ".join(SpeechRequest.model_fields)
            message = f"unknown field {param!r}; the fields are: {fields}"
        elif kind == "string_too_long" and param == "input":
            n = len(err.get("input") or "")
            message = f"input is {n} characters; the limit is {err['ctx']['max_length']}: split the text"
        elif param is None:
            message = f"the request body is missing or not a JSON object ({err.get('msg')})"
        else:
            message = f"{param}: {err.get('msg')}"
            if err.get("input") is not None and kind != "missing":
                message += f" (got {err['input']!r})"
        return answer(400, message, param, kind)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return answer(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return answer(500, f"internal error: {exc}")
