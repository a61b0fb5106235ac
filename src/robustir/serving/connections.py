"""Connection limits for the HTTP server: no client can hold the server by opening connections and sending nothing.

uvicorn (0.54, h11) times a connection out only *between* requests (``timeout_keep_alive``): a connection that
never sends a byte, or sends headers or a body a byte at a time, is kept for ever, and once the process's open-file
limit is reached ``accept()`` fails in a loop -- measured here with a 256-file limit and 300 idle sockets: every
request hung, and asyncio logged 98,216 tracebacks (40 MB) in 8 s. uvicorn has no option for either, so this module
adds the two missing pieces to its own h11 protocol (:class:`GuardedH11Protocol`) and to its server
(:class:`GuardedServer`); everything else stays uvicorn's:

* **receive deadline**: a connection must send a whole request (headers and body) within ``receive_timeout_s`` of
  opening or of starting that request, else it is closed;
* **connection cap**: above ``max_connections`` open connections the longest-idle ones (no request in flight) are
  closed, or the new one when none is idle -- set below the open-file limit, so ``accept()`` never runs out;
* the soft open-file limit is raised to the hard one at start, and the event loop's error log is bounded (at most
  ``LOG_BURST`` reports a minute; the rest are counted and summarised).

The clock is the event loop's (``loop.call_later`` / ``loop.time``), so tests drive it without waiting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

__all__ = ["GuardedH11Protocol", "GuardedServer", "guarded_config", "open_file_limit", "LOG_BURST"]

#: open files kept spare for everything but client connections (model files, index, logs, threads' pipes); a
#: quarter of the limit where that is less
SPARE_FILES = 256
#: loop error reports logged per minute at most; more are counted
LOG_BURST = 20


def open_file_limit(raise_soft: bool = True) -> int:
    """The process's open-file limit, after raising the soft limit to the hard one (as nginx/uvloop deployments do)."""
    try:
        import resource
    except ImportError:  # not on a POSIX system
        return 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if raise_soft and hard != soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a receive deadline and a cap on open connections (module docstring).

    Set ``receive_timeout`` and ``max_connections`` on a subclass (:func:`guarded_config` does).
    """

    receive_timeout: float = 30.0
    max_connections: int = 10_000

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._idle_since = self.loop.time()
        self._arm()
        if len(self.connections) > self.max_connections:
            self._shed()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._receiving():
            if self._deadline is None:  # the first bytes of a request after a finished one
                self._arm()
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._idle_since = self.loop.time()

    # -- the deadline
    def _receiving(self) -> bool:
        """True while the connection owes the server (the rest of) a request: none sent yet, the first bytes of a
        next one buffered, or a body still coming. Idle between requests is uvicorn's keep-alive timeout's."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            return True
        if state is h11.IDLE:
            return self.cycle is None or bool(self.conn.trailing_data[0])
        return False

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.receive_timeout, self._expire)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self._receiving() and not self.transport.is_closing():
            logger.debug("closing a connection that sent no complete request in %.0f s", self.receive_timeout)
            GuardedServer.closed_slow += 1
            self.transport.close()

    # -- the cap
    def _idle(self) -> bool:
        cycle = self.cycle
        return (cycle is None or cycle.response_complete) and not self.transport.is_closing()

    def _shed(self) -> None:
        """Close the longest-idle connections until the cap holds; the newest when none is idle."""
        closing = sum(1 for c in self.connections if isinstance(c, GuardedH11Protocol) and c.transport.is_closing())
        excess = len(self.connections) - closing - self.max_connections  # closed ones leave the set a moment later
        if excess <= 0:
            return
        idle = sorted((c for c in self.connections if isinstance(c, GuardedH11Protocol) and c is not self and c._idle()),
                      key=lambda c: c._idle_since)
        victims = idle[:excess] or [self]
        for victim in victims:
            GuardedServer.closed_over_cap += 1
            victim.transport.close()
        now = self.loop.time()
        if now - GuardedServer.warned_at >= 10.0:  # one line per 10 s however hard the server is hit
            GuardedServer.warned_at = now
            logger.warning("more than %d open connections: closing the longest-idle ones (%d so far; %d closed for "
                           "sending no complete request in %.0f s)", self.max_connections,
                           GuardedServer.closed_over_cap, GuardedServer.closed_slow, self.receive_timeout)


class GuardedServer(uvicorn.Server):
    """uvicorn's server with the loop's error log bounded (module docstring); counts what the guard closed."""

    closed_slow = 0
    closed_over_cap = 0
    warned_at = float("-inf")

    async def startup(self, sockets: Any = None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_BoundedLog(loop.default_exception_handler))
        await super().startup(sockets=sockets)


class _BoundedLog:
    """An event-loop exception handler that reports at most ``LOG_BURST`` errors a minute and counts the rest."""

    def __init__(self, report, clock=time.monotonic) -> None:
        self.report = report
        self.clock = clock
        self.window = -1.0
        self.logged = 0
        self.suppressed = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        now = self.clock()
        if now - self.window >= 60.0:
            if self.suppressed:
                logger.error("%d more event-loop errors in the last minute were not logged (the first %d were)",
                             self.suppressed, self.logged)
            self.window, self.logged, self.suppressed = now, 0, 0
        if self.logged < LOG_BURST:
            self.logged += 1
            self.report(context)
        else:
            self.suppressed += 1


def guarded_config(app: Any, *, receive_timeout_s: float = 30.0, max_connections: int | None = None,
                   **options: Any) -> uvicorn.Config:
    """A ``uvicorn.Config`` whose connections are :class:`GuardedH11Protocol` with these limits."""
    limit = open_file_limit()
    cap = max_connections if max_connections is not None else max(16, limit - min(SPARE_FILES, limit // 4))
    protocol = type("RobustirH11Protocol", (GuardedH11Protocol,),
                    {"receive_timeout": float(receive_timeout_s), "max_connections": int(cap)})
    return uvicorn.Config(app, http=protocol, **options)
