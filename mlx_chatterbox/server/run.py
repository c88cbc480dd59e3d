"""Running the app under uvicorn with a bounded shutdown.

uvicorn alone, on SIGTERM/SIGINT, stops listening and waits for every open response to end: a long stream kept
the process alive for minutes, past any supervisor's stop timeout (Docker's is 10 s). Here the first signal
closes the gate (new requests are answered 503, the listener stays open to say so), the requests in flight
get ``shutdown_timeout`` seconds to finish, then their speech jobs are cancelled (streams end where they are,
whole requests are answered 503) and the process exits 0. A second signal exits at once (128 + its number).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from .gate import Gate

logger = logging.getLogger(__name__)
CUT_GRACE_S = 3  # after the cancel: time for the cut responses to send their ends before uvicorn drops them
SIGNALS = (signal.SIGINT, signal.SIGTERM)
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def serve(
    app: FastAPI, *, host: str, port: int, shutdown_timeout: float = 10.0, log_level: str = "warning"
) -> None:
    """Serve ``app`` (``create_app``'s) until SIGTERM or SIGINT, then shut down as the module says."""
    check_shutdown_timeout(shutdown_timeout)
    gate: Gate = app.state.gate
    if host not in LOCAL_HOSTS and not gate.api_keys:
        logger.warning(
            "listening on %s without an API key: anyone who can reach this address can use the server; give "
            "--api-key or set MLX_CHATTERBOX_API_KEY",
            host,
        )
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=CUT_GRACE_S
    )
    # The handlers stay until uvicorn has shut down (capture_signals installs them), so that a second signal
    # during its shutdown exits at once as well.
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    try:
        _Server(config, gate, shutdown_timeout).run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def check_shutdown_timeout(seconds: float, name: str = "shutdown_timeout") -> None:
    if not seconds >= 0:  # NaN too
        raise ValueError(f"{name} {seconds}: give a number of seconds >= 0")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gate: Gate, shutdown_timeout: float):
        super().__init__(config)
        self.gate, self.shutdown_timeout = gate, shutdown_timeout
        self._deadline = self._cut_at = 0.0

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own handlers would wait for every response and then re-raise the signal (exit code 143 or 130).
        if threading.current_thread() is threading.main_thread():  # (only the main thread may set them)
            for s in SIGNALS:
                signal.signal(s, self._signalled)
        yield

    def _signalled(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.gate.closing:
            logger.warning("%s again: exiting now", name)
            os._exit(128 + signum)
        self.gate.closing = True
        self._deadline = time.monotonic() + self.shutdown_timeout
        logger.warning(
            "%s: shutting down; new requests are refused, %d in flight get up to %g s (--shutdown-timeout) to "
            "finish; send it again to exit at once",
            name,
            self.gate.active,
            self.shutdown_timeout,
        )

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        gate = self.gate
        if not gate.closing:
            return False
        if gate.active == 0:
            return True
        now = time.monotonic()
        if not gate.cut and now >= self._deadline:
            n = gate.cancel()
            logger.warning("shutdown timeout reached: cancelled %d speech request(s) still running", n)
            self._cut_at = now
        return gate.cut and now >= self._cut_at + CUT_GRACE_S
