"""``robustir serve`` under hostile and heavy clients: one request never breaks another's, work per request is bounded,
overload is refused with 429, every error is OpenAI-shaped JSON; and what operators expect (/metrics, /info, request
ids, timing headers, CORS, --default-input-type, start-up checks).

Servers run on 127.0.0.1 with a free port, in a thread, started and stopped inside the tests.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from helpers import httpx  # noqa: E402  (tests/ is on sys.path)
from test_serving_index import write_beir  # noqa: E402  (tests/ is on sys.path)
from robustir.cli.main import main
from robustir.errors import ConfigError
from robustir.index.store import IndexConfig, SearchIndex
from robustir.serving import ServeConfig, create_app, running_server

pytestmark = pytest.mark.usefixtures("single_torch_thread")

KEY = "hardening-key"
INSTRUCTION = "query: "


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("hardening")
    SearchIndex.build(root / "idx", tiny_model_dir, write_beir(root / "beir"), config=IndexConfig(show_progress=False),
                      encoder_options={"query_instruction": INSTRUCTION, "pooling": "mean"})[0].close()
    return root / "idx"


@pytest.fixture(scope="module")
def server(index_dir):
    config = ServeConfig(api_key=KEY, max_inputs_per_request=64, max_chars_per_input=2000, max_body_bytes=1 << 20,
                         max_top_k=50, max_hits_per_request=100, max_response_bytes=4000, max_queued_texts=64,
                         cors_allow_origin=["http://localhost:3000"])
    app = create_app(None, index_dir, config)
    with running_server(app) as url:
        yield url, app


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server[0], headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        yield client


def assert_openai_error(reply, status: int, code: str | None = None) -> dict:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


# ------------------------------------------------------------------------------------------------ isolation

def test_a_poison_request_fails_alone_among_concurrent_good_ones(server):
    url, app = server
    encoder = app.state.server.encoder
    texts = [f"good request {i} about sleep" for i in range(12)]
    poison = b'{"input": ["fine", "a\\ud800b"]}'  # a lone surrogate: valid JSON, not valid Unicode

    async def everyone():
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            good = [c.post("/v1/embeddings", json={"input": t}) for t in texts]
            bad = [c.post("/v1/embeddings", content=poison, headers={"Content-Type": "application/json"})
                   for _ in range(4)]
            return await asyncio.gather(*good, *bad)

    replies = asyncio.run(everyone())
    for text, reply in zip(texts, replies):
        assert reply.status_code == 200, reply.text
        np.testing.assert_allclose(reply.json()["data"][0]["embedding"], encoder.encode([text], "passage")[0],
                                   atol=1e-5)
    for reply in replies[len(texts):]:
        error = assert_openai_error(reply, 400, "invalid_unicode")
        assert error["param"] == "input[1]" and "lone surrogate" in error["message"]


def test_a_request_that_breaks_the_model_fails_alone_over_http(server, monkeypatch):
    """A text that passes every check but breaks the forward pass: its shared batch is re-run request by request."""
    url, app = server
    batcher = app.state.server.batcher
    real = batcher.encode
    poison_ids = app.state.server.encoder.token_ids(["zebra"], "passage")[0]

    def fragile(rows):
        if any(row == poison_ids for row in rows):
            raise RuntimeError("the model cannot read this")
        return real(rows)

    monkeypatch.setattr(batcher, "encode", fragile)

    async def everyone():
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            return await asyncio.gather(*[c.post("/v1/embeddings", json={"input": t})
                                          for t in ["one", "zebra", "two", "three"]])

    replies = asyncio.run(everyone())
    assert [r.status_code for r in replies] == [200, 500, 200, 200]
    error = assert_openai_error(replies[1], 500, "internal_error")
    assert "the model failed on this request" in error["message"]


# ------------------------------------------------------------------------------------------------ bounds

def test_amplification_is_refused_before_any_work(client, server):
    batcher = server[1].state.server.batcher
    before = batcher.stats.texts
    reply = client.post("/search", json={"query": [f"q{i}" for i in range(64)], "top_k": 50})
    error = assert_openai_error(reply, 413, "too_many_hits")
    assert "64 queries x top_k 50 = 3200 hits; at most 100" in error["message"] and error["param"] == "top_k"
    assert batcher.stats.texts == before  # the model never ran
    reply = client.post("/search", json={"query": [f"q{i}" for i in range(2)], "top_k": 5, "mode": "hybrid"})
    error = assert_openai_error(reply, 413, "too_many_hits")  # 2 x the default 100 candidates per list
    assert "2 queries x fusion.candidates 100" in error["message"]
    # within the hit limit, but the answer (6 documents' text per query) is over --max-response-bytes
    reply = client.post("/search", json={"query": [f"q{i}" for i in range(16)], "top_k": 6})
    error = assert_openai_error(reply, 413, "response_too_large")
    assert "over 4000 bytes" in error["message"]
    assert client.post("/search", json={"query": "sleep", "top_k": 2}).status_code == 200


def test_a_full_queue_answers_429_with_retry_after(server, monkeypatch):
    url, app = server
    batcher = app.state.server.batcher
    gate = threading.Event()
    real = batcher.encode

    def held(rows):
        assert gate.wait(60)
        return real(rows)

    monkeypatch.setattr(batcher, "encode", held)
    monkeypatch.setattr(batcher, "max_queued", 4)

    async def scenario():
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            running = asyncio.ensure_future(c.post("/v1/embeddings", json={"input": "held by the gate"}))
            while not batcher._running:  # the worker holds it
                await asyncio.sleep(0)
            waiting = asyncio.ensure_future(c.post("/v1/embeddings", json={"input": ["a", "b", "c"]}))
            while batcher.queued != 3:
                await asyncio.sleep(0)
            refused = await c.post("/v1/embeddings", json={"input": ["d", "e"]})  # 3 + 2 > 4 queued texts
            gate.set()
            return refused, await running, await waiting

    try:
        refused, running, waiting = asyncio.run(scenario())
    finally:
        gate.set()
    error = assert_openai_error(refused, 429, "overloaded")
    assert int(refused.headers["retry-after"]) >= 1 and "at most 4" in error["message"]
    assert error["type"] == "rate_limit_error"
    assert running.status_code == 200 and waiting.status_code == 200


NESTED = b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}"
HUGE_INT = b'{"input": "x", "dimensions": ' + b"9" * 5000 + b"}"


@pytest.mark.parametrize("path, content, status", [
    ("/v1/embeddings", NESTED, 400),
    ("/v1/embeddings", HUGE_INT, 400),
    ("/v1/embeddings", b'{"input": "x", "dimensions": 1e999}', 400),
    ("/v1/embeddings", b'{"input": "x", "dimensions": 99999999999999999999999}', 400),
    ("/v1/embeddings", b'{"input": "x", "encoding_format": null, "input_type": 3}', 400),
    ("/v1/embeddings", b'{"input": "\xff\xfe"}', 400),
    ("/v1/embeddings", b'\x00\x01\x02', 400),
    ("/v1/embeddings", b'', 400),
    ("/v1/embeddings", b'null', 400),
    ("/v1/embeddings", b'"just a string"', 400),
    ("/v1/embeddings", b'{"input": {"nested": {"deeper": [1, 2, {"x": null}]}}}', 400),
    ("/v1/embeddings", b'{"input": true}', 400),
    ("/v1/embeddings", b'{"input": "x", "input": "y", "model": ["m"]}', 400),
    ("/search", b'{"query": "x", "filter": {"lang": ' + b"9" * 4000 + b"}}", 400),
    ("/search", b'{"query": "x", "filter": {"lang": 1e400}}', 400),
    ("/search", b'{"query": "x", "filter": ' + b'{"$and": [' * 200 + b'{"lang": "en"}' + b"]}" * 200 + b"}", 400),
    ("/search", b'{"query": "x", "top_k": 1e3}', 400),
    ("/search", b'{"query": "x", "mode": "hybrid", "fusion": {"rrf_k": 1e30}}', 400),
    ("/search", b'{"query": "", "top_k": 1}', 400),
    ("/search", b'{"query": "x" , "top_k": -1}', 400),
    ("/search", b'{"query": [], "top_k": 1}', 400),
])
def test_every_hostile_body_gets_a_json_error(client, path, content, status):
    reply = client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert_openai_error(reply, status)
    assert client.post("/v1/embeddings", json={"input": "still fine"}).status_code == 200


def test_every_documented_error_is_json(server, client):
    url = server[0]
    assert_openai_error(httpx.post(f"{url}/v1/embeddings", json={"input": "x"}), 401, "invalid_api_key")
    assert_openai_error(client.post("/v1/chat/completions", json={}), 404, "route_not_found")
    assert_openai_error(client.get("/v1/embeddings"), 405)
    assert_openai_error(client.post("/v1/embeddings", json={"input": "x", "model": "gpt"}), 404, "model_not_found")
    big = b'{"input": "' + b"x" * (1 << 20) + b'"}'
    assert_openai_error(client.post("/v1/embeddings", content=big, headers={"Content-Type": "application/json"}),
                        413, "request_too_large")

    def chunks():  # no Content-Length: the limit is found while reading
        yield b'{"input": "'
        for _ in range(300):
            yield b"y" * 4096
        yield b'"}'

    reply = client.post("/v1/embeddings", content=chunks(), headers={"Content-Type": "application/json"})
    assert_openai_error(reply, 413, "request_too_large")


def test_a_server_bug_is_a_json_500_with_the_request_id(client, server, monkeypatch):
    index = server[1].state.server.index

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(index, "search_encoded", broken)
    reply = client.post("/search", json={"query": "x"}, headers={"X-Request-ID": "trace-42"})
    error = assert_openai_error(reply, 500, "internal_error")
    assert "request id trace-42" in error["message"] and reply.headers["x-request-id"] == "trace-42"


class HeldModel:
    """Replaces an app's model call by one that waits at a gate: ``entered`` is set when a batch reaches the model,
    which then holds it until ``release()`` -- the test decides when the model finishes, no clock involved."""

    def __init__(self, app) -> None:
        self.gate, self.entered = threading.Event(), threading.Event()
        self.app, self.real = app, app.state.server.batcher.encode
        app.state.server.batcher.encode = self

    def __call__(self, rows):
        self.entered.set()
        assert self.gate.wait(60)
        return self.real(rows)

    def release(self) -> None:
        self.gate.set()

    def restore(self) -> None:
        self.gate.set()
        self.app.state.server.batcher.encode = self.real


def test_a_request_that_waits_too_long_gets_503(tiny_model_dir):
    """Issue 36: the timeout counts waiting for a model worker, not encoding. While the model holds one request
    (encoding "forever" here), that request is not cut off; one queued behind it for longer than the timeout gets a
    503 saying what happened; the held one then gets its 200."""
    import concurrent.futures

    app = create_app(tiny_model_dir, None, ServeConfig(request_timeout_s=0.001, workers=1))
    model = HeldModel(app)
    try:
        with running_server(app) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, f"{url}/v1/embeddings", json={"input": "held"}, timeout=60)
            assert model.entered.wait(60)  # the model holds the first request
            reply = httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, timeout=60)
            error = assert_openai_error(reply, 503, "timeout")
            assert int(reply.headers["retry-after"]) >= 1 and "--request-timeout-s" in error["message"]
            assert "in the queue" in error["message"] and "encoding does not count" in error["message"]
            model.release()
            assert first.result().status_code == 200  # held far past the timeout while encoding: still answered
            model.restore()
            app.state.server.config.request_timeout_s = 60.0
            assert httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, timeout=60).status_code == 200
    finally:
        model.restore()


# ------------------------------------------------------------------------------------------------ operations

def test_request_ids_timing_headers_and_cors(client):
    reply = client.post("/v1/embeddings", json={"input": "x"}, headers={"X-Request-ID": "abc-123"})
    assert reply.headers["x-request-id"] == "abc-123"
    for header in ("x-total-time", "x-queue-time", "x-inference-time"):
        assert float(reply.headers[header]) >= 0
    made = client.post("/v1/embeddings", json={"input": "x"}, headers={"X-Request-ID": "bad id\twith junk"})
    assert made.headers["x-request-id"] != "bad id\twith junk" and len(made.headers["x-request-id"]) == 32
    assert client.post("/v1/embeddings", json={"input": "x"}).headers["x-request-id"] != made.headers["x-request-id"]
    preflight = client.options("/v1/embeddings", headers={"Origin": "http://localhost:3000",
                                                         "Access-Control-Request-Method": "POST"})
    assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
    other = client.post("/v1/embeddings", json={"input": "x"}, headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_a_cors_preflight_for_every_method_of_the_api_is_answered(client):
    # a browser page asks before DELETE /documents (issue 51: the preflight was refused, 400, for DELETE)
    for method, path in (("DELETE", "/documents"), ("POST", "/documents"), ("GET", "/documents/d0"),
                         ("POST", "/search")):
        preflight = client.options(path, headers={"Origin": "http://localhost:3000",
                                                  "Access-Control-Request-Method": method})
        assert preflight.status_code == 200, (method, path, preflight.text)
        assert method in preflight.headers["access-control-allow-methods"]
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_metrics_count_requests_batches_and_refusals(client, server):
    client.post("/v1/embeddings", json={"input": ["one", "two"], "input_type": "query"})
    client.post("/v1/embeddings", json={"input": ""})
    text = httpx.get(f"{server[0]}/metrics").text  # no key needed, like /health
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values['robustir_embedded_texts_total{input_type="query"}'] >= 2
    assert values['robustir_rejected_requests_total{reason="invalid"}'] >= 1
    assert values["robustir_batch_texts_count"] >= 1 and values["robustir_embedded_tokens_total"] > 0
    assert "robustir_queued_texts" in values and values["robustir_model_workers"] >= 1
    assert any(name.startswith("http_requests_total{") and 'handler="/v1/embeddings"' in name for name in values)


def test_info_and_the_openapi_schema_show_the_limits(client, server):
    info = client.get("/info").json()
    assert info["dimension"] == 32 and info["default_input_type"] == "document"
    assert info["instructions"]["query"] == INSTRUCTION and info["limits"]["max_top_k"] == 50
    assert info["max_tokens"]["query"] == 128  # the tiny model's own limit, not a 64-token default
    assert httpx.get(f"{server[0]}/info").status_code == 401
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    embedding = schema["EmbeddingRequest"]["properties"]
    assert embedding["input"]["anyOf"][1]["maxItems"] == 64 and embedding["input"]["anyOf"][0]["maxLength"] == 2000
    assert schema["SearchRequest"]["properties"]["top_k"]["maximum"] == 50


def test_default_input_type_query_serves_clients_that_send_none(tiny_model_dir):
    from robustir.models.encoder import Encoder

    encoder = Encoder.from_pretrained(tiny_model_dir, query_instruction=INSTRUCTION, pooling="mean")
    app = create_app(encoder, None, ServeConfig(default_input_type="query"))
    with running_server(app) as url:
        plain = httpx.post(f"{url}/v1/embeddings", json={"input": "sleep"}).json()["data"][0]["embedding"]
        document = httpx.post(f"{url}/v1/embeddings", json={"input": "sleep", "input_type": "document"}).json()
    np.testing.assert_allclose(plain, encoder.encode(["sleep"], "query")[0], atol=1e-5)
    np.testing.assert_allclose(document["data"][0]["embedding"], encoder.encode(["sleep"], "passage")[0], atol=1e-5)
    assert not np.allclose(plain, document["data"][0]["embedding"], atol=1e-3)


def test_two_apps_in_one_process_enforce_and_document_their_own_limits(tiny_model_dir):
    """Issue 51: the routes are built once, at module level; each app still checks its own limits (pydantic, the
    same 400 naming the field) and shows them in its /openapi.json."""
    from robustir.models.encoder import Encoder

    encoder = Encoder.from_pretrained(tiny_model_dir)
    small = create_app(encoder, None, ServeConfig(max_inputs_per_request=2, max_chars_per_input=10))
    large = create_app(encoder, None, ServeConfig(max_inputs_per_request=3, max_chars_per_input=100))
    with running_server(small) as one, running_server(large) as other:
        refused = httpx.post(f"{one}/v1/embeddings", json={"input": ["a", "b", "c"]})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "too_many_inputs"
        assert "at most 2 per request" in refused.json()["error"]["message"]
        assert httpx.post(f"{other}/v1/embeddings", json={"input": ["a", "b", "c"]}).status_code == 200
        long = httpx.post(f"{one}/v1/embeddings", json={"input": "x" * 11}).json()["error"]
        assert long["code"] == "input_too_long" and long["param"] == "input"
        extra = httpx.post(f"{other}/v1/embeddings", json={"input": "x", "nope": 1}).json()["error"]["message"]
        assert "unrecognized request argument 'nope'; this endpoint takes model, input," in extra
        shown = [httpx.get(f"{url}/openapi.json").json()["components"]["schemas"]["EmbeddingRequest"]["properties"]
                 ["input"]["anyOf"][1] for url in (one, other)]
    assert [s["maxItems"] for s in shown] == [2, 3] and [s["items"]["maxLength"] for s in shown] == [10, 100]


def test_long_queries_are_cut_at_the_models_own_length(minilm_path, single_torch_thread):
    """The bundled model says 256 tokens; a 150-word query must not be cut at 64 (cosine to sentence-transformers)."""
    from sentence_transformers import SentenceTransformer

    query = " ".join(["aspirin lowers the risk of heart attack in adults with diabetes"] * 25)  # ~250 words
    app = create_app(minilm_path, None, ServeConfig())
    with running_server(app) as url:
        got = httpx.post(f"{url}/v1/embeddings", json={"input": query, "input_type": "query"}, timeout=120).json()
    expected = SentenceTransformer(minilm_path, device="cpu").encode([query], normalize_embeddings=True)[0]
    assert float(np.dot(got["data"][0]["embedding"], expected)) >= 0.9999
    assert got["usage"]["prompt_tokens"] == 256


def test_an_empty_api_key_is_refused_at_start_up(tiny_model_dir, monkeypatch, capsys):
    with pytest.raises(ConfigError, match="api_key is empty"):
        create_app(tiny_model_dir, None, ServeConfig(api_key=""))
    assert main(["serve", "--model", tiny_model_dir, "--api-key", ""]) != 0
    assert "api_key is empty" in capsys.readouterr().err
    monkeypatch.setenv("ROBUSTIR_API_KEY", "  ")
    with pytest.raises(ConfigError, match="ROBUSTIR_API_KEY is set but empty"):
        create_app(tiny_model_dir, None, ServeConfig())
    with pytest.raises(ConfigError, match="not an origin"):
        ServeConfig(cors_allow_origin=["localhost:3000"]).validate()
    # origins a browser never sends (issue 35): a trailing slash, a path, a wildcard host
    for never in ("http://good.example/", "http://*.example.com", "https://a.example/app", "http://a.example:99999x"):
        with pytest.raises(ConfigError, match="would never match"):
            ServeConfig(cors_allow_origin=[never]).validate()
    for fine in ("http://localhost:3000", "https://app.example.com", "http://127.0.0.1:8080", "http://[::1]:3000", "*"):
        ServeConfig(cors_allow_origin=[fine]).validate()


def test_tokenized_once_and_counted_from_the_same_ids(client, server, monkeypatch):
    encoder = server[1].state.server.encoder
    calls = []
    tokenizer = server[1].state.server._loop_tokenizer
    real = tokenizer.__call__

    class Counting:
        def __call__(self, *args, **kwargs):
            calls.append(args[0])
            return real(*args, **kwargs)

    monkeypatch.setattr(server[1].state.server, "_loop_tokenizer", Counting())
    texts = ["aspirin and the heart", "sleep in children"]
    reply = client.post("/v1/embeddings", json={"input": texts}).json()
    assert calls == [texts]  # one tokenizer call for the whole request, none in the batch
    tokens = sum(len(ids) for ids in encoder.tokenizer(texts)["input_ids"])
    assert reply["usage"]["prompt_tokens"] == tokens
    long_text = ["word " * 380] * 10  # 19,000 characters, over INLINE_TOKENIZE_CHARS: the tokenizer thread's
    assert client.post("/v1/embeddings", json={"input": long_text}).status_code == 200
    assert len(calls) == 1


def test_connections_get_tcp_nodelay():
    """asyncio sets TCP_NODELAY only on sockets whose proto is TCP; accepted connections inherit the listener's, and
    without it each answer waited ~40 ms for the client's delayed ACK (docs/benchmarks.md, issue 24)."""
    import socket

    from robustir.serving.server import _bind

    listener = _bind("127.0.0.1", 0)
    try:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        assert accepted.proto == socket.IPPROTO_TCP
        accepted.close()
        client.close()
    finally:
        listener.close()


def test_a_lexical_search_does_not_wait_behind_embedding_work(tmp_path, tiny_model_dir):
    """Issue 36: index searches ran on the model's worker thread, so a lexical search (no model) waited behind a
    held embedding batch. Now searches have their own threads: with the model's only worker held, a lexical search
    and a document lookup are answered; the held embedding request then gets its 200."""
    import concurrent.futures
    import json as jsonlib

    from robustir.index.store import IndexConfig, SearchIndex

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(jsonlib.dumps({"_id": f"d{i}", "text": f"document {i} about topic{i}"}) + "\n"
                              for i in range(8)), encoding="utf-8")
    SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=IndexConfig(show_progress=False))[0].close()
    app = create_app(None, tmp_path / "idx", ServeConfig(workers=1))
    model = HeldModel(app)
    try:
        with running_server(app) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
            blocked = pool.submit(httpx.post, f"{url}/v1/embeddings", json={"input": "held"}, timeout=60)
            assert model.entered.wait(60)  # the model's only worker is busy
            lexical = httpx.post(f"{url}/search", json={"query": "topic3", "mode": "lexical", "top_k": 1}, timeout=60)
            assert lexical.status_code == 200 and lexical.json()["hits"][0]["id"] == "d3"
            assert httpx.get(f"{url}/documents/d5", timeout=60).json()["text"] == "document 5 about topic5"
            assert not blocked.done()  # still held: the search did not wait for it
            model.release()
            assert blocked.result().status_code == 200
    finally:
        model.restore()
