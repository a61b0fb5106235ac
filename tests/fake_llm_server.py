"""A scriptable fake OpenAI-compatible chat-completions server for tests (stdlib only, 127.0.0.1, free port).

Usage::

    with FakeLLMServer(reply=lambda messages: "1. What?") as server:
        server.script({"status": 500}, {"status": 429, "headers": {"Retry-After": "1"}})  # next two requests
        client = LLMClient(LLMConfig(base_url=server.url, model="fake"))
        ...
        assert server.count == 3

Actions (scripted with :meth:`script`, or returned by the ``reply`` function instead of a string) are dicts:
``{"status": 500}``, ``{"status": 429, "headers": {"Retry-After": "1"}}``, ``{"delay": 2.0}`` (sleep, then
answer normally unless other keys say otherwise), ``{"body": "not json"}`` (raw 200 body),
``{"json": {"choices": []}}`` (200 with this JSON), ``{"content": ""}`` (a normal reply with this content).

Error statuses carry ``retry-after-ms: 1`` unless the action sets ``Retry-After``/``retry-after-ms`` itself
(``retry_after_ms=None`` turns that off): the openai client honours the header, so its retries in tests take
milliseconds instead of its default backoff of half a second and more. With ``check_model=True`` a request
for another model than ``model`` gets the 404 "model not found" that vLLM and OpenAI send.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

Reply = Callable[[list[dict]], "str | dict"]


def default_reply(messages: list[dict]) -> str:
    """Deterministic function of the prompt: three numbered questions tagged with a hash of the prompt."""
    tag = hashlib.sha1(messages[-1]["content"].encode("utf-8")).hexdigest()[:8]
    return f"1. What is {tag} about?\n2. Who wrote {tag}?\n3. When did {tag} happen?"


def last_user(messages: list[dict]) -> str:
    return next(m["content"] for m in reversed(messages) if m["role"] == "user")


class FakeLLMServer:
    """Fake ``/v1/chat/completions`` + ``/v1/models`` with scripted failures and request accounting."""

    def __init__(self, reply: Reply | None = None, *, delay: float = 0.0, model: str = "fake-model",
                 api_key: str | None = None, retry_after_ms: float | None = 1, check_model: bool = False) -> None:
        self.reply = reply or default_reply
        self.delay = delay
        self.model = model
        self.api_key = api_key
        self.retry_after_ms = retry_after_ms
        self.check_model = check_model
        self.actions: deque[dict] = deque()
        self.requests: list[dict] = []  # chat request bodies, in arrival order
        self.posts = 0  # every POST, including those to wrong routes or with a wrong key
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    # -- control ------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    @property
    def count(self) -> int:
        with self.lock:
            return len(self.requests)

    def prompts(self) -> list[str]:
        with self.lock:
            return [last_user(body["messages"]) for body in self.requests]

    def script(self, *actions: dict) -> None:
        """Behaviour of the next ``len(actions)`` chat requests, in arrival order."""
        with self.lock:
            self.actions.extend(actions)

    def start(self) -> "FakeLLMServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "FakeLLMServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- HTTP ---------------------------------------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def _send(self, status: int, body: str, headers: dict | None = None) -> None:
                data = body.encode("utf-8")
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    headers = dict(headers or {})
                    named = {key.lower() for key in headers}
                    if status >= 400 and server.retry_after_ms is not None and not named & {"retry-after",
                                                                                           "retry-after-ms"}:
                        headers["retry-after-ms"] = server.retry_after_ms
                    for key, value in headers.items():
                        self.send_header(key, str(value))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout test)

            def do_GET(self) -> None:
                if server.api_key and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                    self._send(401, json.dumps({"error": {"message": "Incorrect API key provided"}}))
                    return
                if self.path.rstrip("/").endswith("/v1/models"):
                    self._send(200, json.dumps({"object": "list", "data": [{"id": server.model}]}))
                else:
                    self._send(404, json.dumps({"error": {"message": f"no route {self.path}"}}))

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                with server.lock:
                    server.posts += 1
                if not self.path.rstrip("/").endswith("/v1/chat/completions"):
                    self._send(404, json.dumps({"error": {"message": f"no route {self.path}"}}))
                    return
                if server.api_key and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                    self._send(401, json.dumps({"error": {"message": "Incorrect API key provided"}}))
                    return
                body = json.loads(raw)
                if server.check_model and body.get("model") != server.model:
                    self._send(404, json.dumps({"error": {
                        "message": f"The model `{body.get('model')}` does not exist.", "code": "model_not_found"}}))
                    return
                with server.lock:
                    server.requests.append(body)
                    action = server.actions.popleft() if server.actions else None
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    self._answer(body, action)
                finally:
                    with server.lock:
                        server.in_flight -= 1

            def _answer(self, body: dict, action: dict | None) -> None:
                if server.delay:
                    time.sleep(server.delay)
                if action is None:
                    produced = server.reply(body["messages"])
                    action = produced if isinstance(produced, dict) else {"content": produced}
                if action.get("delay"):
                    time.sleep(action["delay"])
                if "status" in action and action["status"] != 200:
                    payload = json.dumps({"error": {"message": f"scripted {action['status']}"}})
                    self._send(action["status"], payload, action.get("headers"))
                    return
                if "body" in action:
                    self._send(200, action["body"], action.get("headers"))
                    return
                if "json" in action:
                    self._send(200, json.dumps(action["json"]), action.get("headers"))
                    return
                content = action["content"] if "content" in action else server.reply(body["messages"])
                words = sum(len(m["content"].split()) for m in body["messages"])
                self._send(200, json.dumps({
                    "id": "chatcmpl-fake", "object": "chat.completion", "model": body.get("model"),
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": content}}],
                    "usage": {"prompt_tokens": words, "completion_tokens": len(str(content).split()),
                              "total_tokens": words + len(str(content).split())}}))

        return Handler


# ------------------------------------------------------------------------ fixture files of the LLM-stage tests

def write_passages(path, n: int, *, chinese: int = 0, text: str = "Passage number {i} talks about topic {i} in some "
                   "detail.", title: str = "Title {i}"):
    """``n`` English passages (``p0``..) and ``chinese`` Chinese ones (``zh0``..) as a generation input JSONL."""
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(n):
            handle.write(json.dumps({"_id": f"p{i}", "title": title.format(i=i), "text": text.format(i=i)}) + "\n")
        for i in range(chinese):
            handle.write(json.dumps({"_id": f"zh{i}", "title": "", "text": f"这是第{i}段中文文本，介绍北京的历史。"},
                                    ensure_ascii=False) + "\n")
    return path


def read_lines(path) -> list[dict]:
    from pathlib import Path

    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
