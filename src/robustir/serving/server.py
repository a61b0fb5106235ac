"""Running the app: :func:`serve` (``robustir serve``, in the foreground) and :func:`running_server` (in a thread, on
127.0.0.1 and a free port: tests, notebooks, benchmarks)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import Any, Iterator

logger = logging.getLogger(__name__)

__all__ = ["serve", "running_server"]


def _limits(app: Any) -> dict:
    """The connection limits of the app's ServeConfig (defaults for another app)."""
    config = getattr(getattr(getattr(app, "state", None), "server", None), "config", None)
    if config is None:
        return {}
    return {"receive_timeout_s": config.receive_timeout_s, "max_connections": config.max_connections}


def serve(app: Any, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn until interrupted (one process: one copy of the model), behind the connection
    limits of :mod:`robustir.serving.connections`."""
    from .connections import GuardedServer, guarded_config

    config = guarded_config(app, host=host, port=port, log_level=log_level, lifespan="on", access_log=False,
                            **_limits(app))
    server = GuardedServer(config)
    sock = _bind(host, port)
    logger.info("robustir serve: listening on http://%s:%d (OpenAI base_url http://%s:%d/v1)", host,
                sock.getsockname()[1], host, sock.getsockname()[1])
    server.run(sockets=[sock])


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one); a port in use is a one-line error."""
    from ..errors import ConfigError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: accepted connections inherit it, and asyncio sets TCP_NODELAY only on sockets whose
    # proto says TCP. Without it an answer written as headers + body waits for the client's delayed ACK: +40 ms per
    # request at 1 client (68 ms against 24 ms in the server; docs/benchmarks.md, "Serving latency")
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): choose another --port, or stop "
                          "what uses it") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@contextlib.contextmanager
def running_server(app: Any, host: str = "127.0.0.1", port: int = 0, *,
                   startup_timeout: float = 120.0) -> Iterator[str]:
    """Run ``app`` with uvicorn in a background thread; yields its base URL (``http://127.0.0.1:PORT``).

    The socket is bound and listening before the thread starts, and the call returns once the app's startup (the
    batcher) has run, so requests can be sent at once. Leaving the block stops the server (``should_exit``) and
    waits for its thread.
    """
    from .connections import GuardedServer, guarded_config

    sock = _bind(host, port)
    ready = threading.Event()
    failure: list[BaseException] = []

    class _Server(GuardedServer):
        async def startup(self, sockets=None) -> None:
            try:
                await super().startup(sockets=sockets)
            finally:
                ready.set()

    config = guarded_config(app, log_level="warning", lifespan="on", access_log=False, **_limits(app))
    server = _Server(config)

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # surfaced to the caller below
            failure.append(exc)
        finally:
            ready.set()

    thread = threading.Thread(target=run, name="robustir-uvicorn", daemon=True)
    thread.start()
    try:
        if not ready.wait(startup_timeout) or failure or not server.started:
            raise RuntimeError(f"the server did not start: {failure[0] if failure else 'startup failed or timed out'}")
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()
