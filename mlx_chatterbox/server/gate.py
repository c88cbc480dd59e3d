"""What every HTTP request passes before a route: the shutdown's 503, the API keys' 401, and the speech body read
as JSON whatever its Content-Type says. One ``Gate`` per app (``app.state.gate``); ``server.run`` closes it on
the first SIGTERM/SIGINT and cancels the speech still running when ``--shutdown-timeout`` has passed."""

from __future__ import annotations

import hmac
import os
import re
import weakref
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .schema import error_body
from .worker import Ticket

API_KEY_ENV = "MLX_CHATTERBOX_API_KEY"
OPEN_PATHS = ("/", "/health")  # answered without a key: the playground page (it holds no data) and the probe
SPEECH_PATHS = ("/v1/audio/speech", "/audio/speech")
_KEY = re.compile(r"[\x21-\x7e]+")  # printable ASCII without spaces: a key travels in an HTTP header


class Gate:
    """The server's admission state: its API keys (none: open), whether it is shutting down, the requests in
    flight and the speech jobs they run (``cancel`` ends them)."""

    def __init__(self, api_keys: Iterable[str] = ()):
        self.api_keys = tuple(check_api_key(k) for k in api_keys)
        self.closing = False  # set on the first signal: new requests are answered 503
        self.cut = False  # set when the jobs still running at the shutdown deadline were cancelled
        self.active = 0  # requests in flight (a streamed one until its body has been sent)
        self._tickets: weakref.WeakSet[Ticket] = weakref.WeakSet()  # a finished one goes with its response

    def track(self, ticket: Ticket) -> Ticket:
        self._tickets.add(ticket)
        return ticket

    def cancel(self) -> int:
        """Cancel every speech job still running (their streams end, their queue places are freed); how many."""
        self.cut = True
        tickets = [t for t in self._tickets if not t.cancelled]
        for t in tickets:
            t.cancel()
        return len(tickets)

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """``app`` behind this gate (a plain ASGI wrapper: a streamed body passes through untouched)."""

        async def gated(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                return await app(scope, receive, send)
            refusal = self._refusal(scope)
            if refusal is not None:
                return await refusal(scope, receive, send)
            if scope["method"] == "POST" and scope["path"] in SPEECH_PATHS:
                scope = _as_json(scope)
            self.active += 1
            try:
                await app(scope, receive, send)
            finally:
                self.active -= 1

        return gated

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        if self.closing:
            return _error(503, "the server is shutting down; retry later", "shutting_down", "server_error")
        if not self.api_keys or scope["path"] in OPEN_PATHS:
            return None
        given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return _error(
                401,
                "this server needs an API key: send the header 'Authorization: Bearer <key>' (the openai "
                "client's api_key)",
                "missing_api_key",
            )
        # Every key is compared, in constant time, so that the time taken does not tell which one is near.
        if not any([hmac.compare_digest(key.strip().encode(), k.encode()) for k in self.api_keys]):
            return _error(401, "the API key is not valid for this server", "invalid_api_key")
        return None


def api_keys(flags: Iterable[str] | None) -> list[str]:
    """The keys of ``--api-key`` flags together with those in $MLX_CHATTERBOX_API_KEY (comma-separated);
    ValueError for a malformed one."""
    keys = [check_api_key(k, "--api-key") for k in flags or ()]
    value = os.environ.get(API_KEY_ENV)
    if value is not None:
        found = [k.strip() for k in value.split(",") if k.strip()]
        if not found:
            raise ValueError(
                f"{API_KEY_ENV} is set but holds no key; give keys separated by commas, or unset it"
            )
        keys += [check_api_key(k, API_KEY_ENV) for k in found]
    return list(dict.fromkeys(keys))


def check_api_key(key: str, where: str = "api key") -> str:
    """``key``, if it can travel in an Authorization header and in a comma-separated list; else ValueError."""
    if not _KEY.fullmatch(key):
        raise ValueError(
            f"{where}: an API key is printable ASCII without spaces or commas (it travels in an HTTP header); "
            f"got {len(key)} characters that are not"
        )
    if "," in key:
        raise ValueError(
            f"{where}: an API key cannot hold a comma ({API_KEY_ENV} separates keys with commas)"
        )
    return key


def allowed_origins(values: Iterable[str] | None) -> list[str]:
    """The origins of ``--allowed-origins`` (each value comma-separated): ``*`` or ``scheme://host[:port]``;
    ValueError naming a malformed one."""
    origins = [o.strip() for v in values or () for o in v.split(",") if o.strip()]
    for origin in origins:
        parts = urlsplit(origin)
        if origin != "*" and not (
            parts.scheme in ("http", "https")
            and parts.netloc
            and origin == f"{parts.scheme}://{parts.netloc}"
        ):
            raise ValueError(
                f"--allowed-origins {origin!r}: an origin is scheme://host[:port] with no path or trailing "
                "slash (e.g. https://app.example.com), or * for any"
            )
    return origins


def _as_json(scope: Scope) -> Scope:
    """The scope with ``Content-Type: application/json``: the speech body is JSON whatever the client said, as
    OpenAI's API reads it (curl -d sends application/x-www-form-urlencoded); a body that is not JSON is then
    reported as such."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def _error(status: int, message: str, code: str, kind: str = "invalid_request_error") -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {"Connection": "close"}
    return JSONResponse(error_body(message, None, code, kind), status_code=status, headers=headers)
