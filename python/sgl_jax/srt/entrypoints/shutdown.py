"""Graceful shutdown of the HTTP server: drain on the first SIGTERM/SIGINT, exit at once on the second.

First signal: the TokenizerManager stops admitting (new requests and /health answer 503 with Retry-After),
running requests go on for up to --graceful-shutdown-timeout seconds; those still running then are aborted,
so each ends with a final event carrying ``finish_reason: abort`` (a stream) or a response with it (not
streaming); then uvicorn closes its connections and the caller stops the engine processes and exits 0.
A second signal exits at once: requests still running are aborted without waiting for their last events,
and connections are closed.

The same contract as Kubernetes' pod termination (SIGTERM, grace period, SIGKILL) and SGLang's
``--graceful-shutdown-timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from sgl_jax.srt.errors import RequestError

logger = logging.getLogger(__name__)

ABORT_MESSAGE = "Aborted: the server is shutting down"
ABORTED_FLUSH_S = 5.0  # at most this long for aborted requests' final events to reach their clients


def live_requests(tm) -> int:
    """Requests of `tm` whose clients still wait for them (aborted ones the scheduler is releasing are not)."""
    return sum(1 for st in tm.rid_to_state.values() if st.orphaned_at is None) + tm.score_client.num_live()


class DrainingServer(uvicorn.Server):
    """A uvicorn.Server that drains `tm` before it stops (module docstring).

    Args:
        config: uvicorn's Config.
        tm: the TokenizerManager serving the app.
        timeout_s: --graceful-shutdown-timeout in seconds (0: abort running requests at once).
    """

    def __init__(self, config: uvicorn.Config, tm, timeout_s: float):
        super().__init__(config)
        self.tm = tm
        self.timeout_s = timeout_s
        self.signals_seen = 0
        self._drain_task = None
        self._skip_wait = False

    def handle_exit(self, sig: int, frame) -> None:  # runs in the main thread, which runs the event loop
        self.signals_seen += 1
        name = signal.Signals(sig).name
        loop = self.tm.loop
        if self.signals_seen == 1 and self.started and loop is not None:
            logger.info("%s received: draining -- new requests get 503; %d running requests have up to %g s "
                        "(--graceful-shutdown-timeout)", name, live_requests(self.tm), self.timeout_s)
            self.tm.draining = f"{name} received"
            loop.call_soon_threadsafe(self._start_drain)
            return
        if self._drain_task is not None:
            logger.info("Second signal (%s): exiting now; aborting %d running requests", name, live_requests(self.tm))
            self._skip_wait = True
            if self.tm.loop is not None:
                self.tm.loop.call_soon_threadsafe(self.tm.abort_all, ABORT_MESSAGE)
        self.should_exit = True
        self.force_exit = self.signals_seen > 1  # (uvicorn then waits for no connection)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        tm = self.tm
        deadline = time.monotonic() + self.timeout_s
        while live_requests(tm) and time.monotonic() < deadline and not self._skip_wait:
            await asyncio.sleep(0.05)
        left = live_requests(tm)
        if left:
            logger.info("Aborting %d requests still running (%s)", left,
                        "second signal" if self._skip_wait else f"after {self.timeout_s:g} s")
            tm.abort_all(ABORT_MESSAGE)
            tm.score_client.fail_all(RequestError(ABORT_MESSAGE, 503))
            flush_deadline = time.monotonic() + ABORTED_FLUSH_S
            while live_requests(tm) and time.monotonic() < flush_deadline and not self._skip_wait:
                await asyncio.sleep(0.05)
        else:
            logger.info("No request running: stopping")
        await asyncio.sleep(0.1)  # let the last responses' bytes leave
        self.should_exit = True
