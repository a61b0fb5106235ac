"""No client can hold the server by opening connections and sending nothing (issue 35's hang).

The receive deadline is driven by a fake event-loop clock (no waiting); the connection cap and the bounded log run
against a real server on 127.0.0.1.
"""

from __future__ import annotations

import socket

import pytest

from robustir.serving.connections import LOG_BURST, GuardedH11Protocol, _BoundedLog, guarded_config


class FakeLoop:
    """``call_later`` / ``time`` of an event loop, advanced by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay, callback, *args):
        loop = self

        class Handle:
            cancelled = False

            def cancel(self) -> None:
                self.cancelled = True

        handle = Handle()
        self.timers.append((self.now + delay, handle, callback, args))
        return handle

    def call_soon(self, callback, *args):
        return self.call_later(0, callback, *args)

    def create_task(self, coroutine):
        coroutine.close()  # the app is not run here: the request stays in flight

        class Task:
            def add_done_callback(self, callback) -> None:
                pass

        return Task()

    def advance(self, seconds: float) -> None:
        self.now += seconds
        due = [t for t in self.timers if t[0] <= self.now and not t[1].cancelled]
        self.timers = [t for t in self.timers if t not in due]
        for _, _, callback, args in due:
            callback(*args)


class FakeTransport:
    def __init__(self) -> None:
        self.closed = False
        self.written = b""

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", 5555)}.get(name, default)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def write(self, data: bytes) -> None:
        self.written += data

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_protocol(self, protocol) -> None:
        pass


def _protocol(loop: FakeLoop, state, timeout: float = 10.0, cap: int = 100) -> tuple[GuardedH11Protocol, FakeTransport]:
    import uvicorn

    async def app(scope, receive, send):  # never called: the fake loop does not run tasks
        raise AssertionError

    config = guarded_config(app, receive_timeout_s=timeout, max_connections=cap, lifespan="off", log_level="error")
    config.load()
    protocol = config.http_protocol_class(config=config, server_state=state, app_state={}, _loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    return protocol, transport


@pytest.fixture
def state():
    from uvicorn.server import ServerState

    return ServerState()


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline(state):
    loop = FakeLoop()
    protocol, transport = _protocol(loop, state, timeout=10.0)
    loop.advance(9.9)
    assert not transport.closed
    loop.advance(0.2)
    assert transport.closed


def test_slow_headers_and_a_slow_body_are_closed_and_a_whole_request_is_not(state):
    loop = FakeLoop()
    protocol, transport = _protocol(loop, state, timeout=10.0)
    protocol.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers not finished
    loop.advance(10.5)
    assert transport.closed  # the deadline counts from the connection's start, however it trickles

    loop = FakeLoop()
    protocol, transport = _protocol(loop, state, timeout=10.0)
    protocol.data_received(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"in")
    loop.advance(10.5)
    assert transport.closed  # 4 of 100 body bytes in 10 s

    loop = FakeLoop()
    protocol, transport = _protocol(loop, state, timeout=10.0)
    protocol.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # a whole request: the app's time is its own
    loop.advance(60.0)
    assert not transport.closed


def test_over_the_cap_the_longest_idle_connection_goes_first(state):
    loop = FakeLoop()
    first, first_t = _protocol(loop, state, cap=2)
    loop.advance(1)
    busy, busy_t = _protocol(loop, state, cap=2)
    busy.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # a request in flight: not idle
    loop.advance(1)
    third, third_t = _protocol(loop, state, cap=2)
    assert first_t.closed and not busy_t.closed and not third_t.closed
    # a closed connection leaves the set only when its loss is reported: until then it is not counted twice
    extra, extra_t = _protocol(loop, state, cap=3)
    assert not third_t.closed and not extra_t.closed and not busy_t.closed
    extra.connection_lost(None)
    first.connection_lost(None)
    fourth, fourth_t = _protocol(loop, state, cap=2)  # the oldest idle one now is the third
    assert third_t.closed and not fourth_t.closed and not busy_t.closed


def test_the_event_loop_error_log_is_bounded():
    now = [0.0]
    reported = []
    handler = _BoundedLog(reported.append, clock=lambda: now[0])
    for _ in range(10_000):
        handler(None, {"message": "socket.accept() out of system resource"})
    assert len(reported) == LOG_BURST and handler.suppressed == 10_000 - LOG_BURST
    now[0] = 61.0
    handler(None, {"message": "again"})
    assert len(reported) == LOG_BURST + 1 and handler.suppressed == 0


def test_idle_sockets_over_the_cap_do_not_stop_a_real_server(tiny_model_dir):
    """8 idle connections to a server capped at 4: the oldest idle ones are closed and a real request is answered."""
    import httpx

    from robustir.serving import ServeConfig, create_app, running_server

    app = create_app(tiny_model_dir, None, ServeConfig(max_connections=4, receive_timeout_s=3600))  # the cap alone
    with running_server(app) as url:
        port = int(url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(8)]
        try:
            answer = httpx.post(f"{url}/v1/embeddings", json={"input": ["a text"]}, timeout=60)
            assert answer.status_code == 200
            # the first idle sockets were closed by the server: a read sees the end of the stream
            assert idle[0].recv(1) == b""
        finally:
            for sock in idle:
                sock.close()
