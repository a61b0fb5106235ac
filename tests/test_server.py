"""robustir.serving.app (``robustir serve``): OpenAI-compatible embeddings, /search, errors, batching, real clients.

Servers run on 127.0.0.1 with a free port, in a thread (:func:`robustir.serving.running_server`), started and stopped
inside the tests.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import numpy as np
import openai
import pytest

from helpers import QUERIES, httpx  # noqa: E402  (tests/ is on sys.path)
from test_serving_index import write_beir  # noqa: E402
from robustir.cli.main import main
from robustir.errors import ConfigError
from robustir.index.store import IndexConfig, SearchIndex
from robustir.serving import MicroBatcher, ServeConfig, create_app, running_server

pytestmark = pytest.mark.usefixtures("single_torch_thread")

KEY = "test-key"
INSTRUCTION = "query: "


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory, tiny_model_dir) -> Path:
    root = tmp_path_factory.mktemp("serve")
    beir = write_beir(root / "beir")
    SearchIndex.build(root / "idx", tiny_model_dir, beir, config=IndexConfig(show_progress=False),
                      encoder_options={"query_instruction": INSTRUCTION})[0].close()
    return root / "idx"


@pytest.fixture(scope="module")
def tiny_server(tiny_index):
    config = ServeConfig(api_key=KEY, max_inputs_per_request=8, max_chars_per_input=500, max_body_bytes=4096,
                         max_top_k=20, matryoshka_dims=[16])
    app = create_app(None, tiny_index, config)
    with running_server(app) as url:
        yield url, app


@pytest.fixture()
def client(tiny_server):
    url, _ = tiny_server
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        yield client


def embed(client, **body) -> httpx.Response:
    return client.post("/v1/embeddings", json=body)


# ------------------------------------------------------------------------------------------------ embeddings

def test_health_and_models(client, tiny_server):
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["dimension"] == 32 and health["index"]["documents"] == 6
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-bert0" == health["model"]
    assert client.get("/v1/models/tiny-bert0").json()["id"] == "tiny-bert0"


def test_embeddings_float_base64_usage_and_input_type(client, tiny_server):
    encoder = tiny_server[1].state.server.encoder
    texts = ["aspirin and the heart", "sleep in children"]
    reply = embed(client, input=texts, model="tiny-bert0").json()
    assert reply["object"] == "list" and reply["model"] == "tiny-bert0"
    assert [d["index"] for d in reply["data"]] == [0, 1] and reply["data"][0]["object"] == "embedding"
    vectors = np.array([d["embedding"] for d in reply["data"]], dtype=np.float32)
    np.testing.assert_allclose(vectors, encoder.encode(texts, "passage"), atol=1e-5)
    tokens = sum(len(ids) for ids in encoder.tokenizer(texts)["input_ids"])
    assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    packed = embed(client, input=texts, encoding_format="base64").json()
    decoded = np.vstack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed["data"]])
    np.testing.assert_array_equal(decoded, vectors)
    query = embed(client, input=texts[0], input_type="query").json()
    np.testing.assert_allclose(query["data"][0]["embedding"], encoder.encode([texts[0]], "query")[0], atol=1e-5)
    np.testing.assert_allclose(query["data"][0]["embedding"],
                               encoder.encode([INSTRUCTION + texts[0]], "passage", instruction="")[0], atol=1e-5)
    assert query["usage"]["prompt_tokens"] == len(encoder.tokenizer(INSTRUCTION + texts[0])["input_ids"])
    cut = np.array(embed(client, input=texts[0], dimensions=16).json()["data"][0]["embedding"])
    full = vectors[0]
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-5)


@pytest.mark.parametrize("body, status, param, code, message", [
    ({"input": [[101, 2023]]}, 400, "input[0]", "token_ids_not_supported", "token-id array"),
    ({"input": [101, 2023]}, 400, "input[0]", "token_ids_not_supported", "token-id array"),
    ({"input": []}, 400, "input", None, "empty list"),
    ({"input": ["ok", ""]}, 400, "input[1]", "empty_text", "is empty"),
    ({"input": ["ok", " \n\t"]}, 400, "input[1]", "empty_text", "is empty"),
    ({"input": ["ok", {"text": "x"}]}, 400, "input[1]", None, "must be a valid string, got an object"),
    ({"input": ["x"] * 9}, 400, "input", "too_many_inputs", "holds 9 items; at most 8"),
    ({"input": "y" * 501}, 400, "input", "input_too_long", "501 characters; at most 500"),
    ({"model": "tiny-bert0"}, 400, "input", None, "'input' is required"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format", None, "'float' or 'base64'"),
    ({"input": "x", "dimensions": 8}, 400, "dimensions", None, "this model supports 16, 32"),
    ({"input": "x", "dimensions": "16"}, 400, "dimensions", None, "must be a valid integer, got \"16\""),
    ({"input": "x", "dimensions": True}, 400, "dimensions", None, "must be a valid integer"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions", None, "greater than or equal to 1"),
    ({"input": "x", "input_type": "passage"}, 400, "input_type", None, "'query' or 'document'"),
    ({"input": "x", "temperature": 0}, 400, "temperature", None, "unrecognized request argument"),
    ({"input": "x", "model": "text-embedding-3-small"}, 404, "model", "model_not_found", "does not exist"),
    ({"input": "z" * 5000}, 413, None, "request_too_large", "over 4096 bytes"),
    ({"input": "x", "user": 5}, 400, "user", None, "must be a valid string"),
])
def test_bad_embedding_requests_get_openai_shaped_errors(client, body, status, param, code, message):
    reply = embed(client, **body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code and message in error["message"]


def test_malformed_bodies_auth_and_unknown_routes(client, tiny_server):
    url = tiny_server[0]
    reply = client.post("/v1/embeddings", content=b"{not json", headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
    reply = client.post("/v1/embeddings", json=["a list"])
    assert reply.status_code == 400 and "must be a JSON object" in reply.json()["error"]["message"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        reply = httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, headers=headers)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200  # health needs no key and shows no data
    reply = client.get("/v2/whatever")
    assert reply.status_code == 404 and "routes: POST /v1/embeddings" in reply.json()["error"]["message"]
    assert client.get("/v1/embeddings").status_code == 405


def test_the_openai_client_gets_errors_it_understands(tiny_server):
    url = tiny_server[0]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).embeddings.create(model="tiny-bert0",
                                                                                            input="x")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="the model 'gpt' does not exist") as exc:
        client.embeddings.create(model="gpt", input="x")
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="token-id array") as exc:
        client.embeddings.create(model="tiny-bert0", input=[[1, 2, 3]])
    assert exc.value.code == "token_ids_not_supported" and exc.value.param == "input[0]"
    reply = client.embeddings.create(model="tiny-bert0", input=["a", "b"], extra_body={"input_type": "query"})
    assert len(reply.data) == 2 and len(reply.data[0].embedding) == 32


# ------------------------------------------------------------------------------------------------ search

def test_search_returns_what_the_index_returns(client, tiny_index, tiny_server):
    queries = [q for _, q in QUERIES]
    index = tiny_server[1].state.server.index
    expected = index.search(queries, top_k=3)
    reply = client.post("/search", json={"query": queries, "top_k": 3}).json()
    assert [[h["id"] for h in row] for row in reply["hits"]] == [[h.id for h in row] for row in expected]
    np.testing.assert_allclose([[h["score"] for h in row] for row in reply["hits"]],
                               [[h.score for h in row] for row in expected], atol=1e-5)
    single = client.post("/search", json={"query": queries[0], "top_k": 2}).json()["hits"]
    assert [h["id"] for h in single] == [h.id for h in expected[0][:2]]
    assert set(single[0]) == {"id", "score", "title", "text", "fields"}
    filtered = client.post("/search", json={"query": queries[0], "top_k": 5, "filter": {"lang": "de"}}).json()["hits"]
    assert {h["id"] for h in filtered} == {"d3", "d6"} and all(h["fields"]["lang"] == "de" for h in filtered)


@pytest.mark.parametrize("body, param, message", [
    ({"top_k": 3}, "query", "'query' is required"),
    ({"query": "x", "top_k": 0}, "top_k", "must be greater than or equal to 1, got 0"),
    ({"query": "x", "top_k": 21}, "top_k", "must be less than or equal to 20, got 21"),
    ({"query": "x", "top_k": 2.5}, "top_k", "must be a valid integer"),
    ({"query": "x", "filter": ["lang"]}, "filter", "must be a JSON object"),
    ({"query": "x", "filter": {"lang": 10 ** 30}}, "filter", "beyond 64 bits"),
    ({"query": ["x", 7]}, "query[1]", "token-id array"),
    ({"query": "x", "filter": {"colour": "red"}}, "filter", "'colour' is in no document"),
    ({"query": "x", "k": 3}, "k", "unrecognized request argument"),
])
def test_bad_search_requests(client, body, param, message):
    reply = client.post("/search", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_search_without_an_index_is_404_and_models_are_checked_against_the_index(tiny_model_dir, tiny_index,
                                                                                  minilm_path):
    app = create_app(tiny_model_dir, None, ServeConfig(max_wait_ms=0))
    with running_server(app) as url:
        reply = httpx.post(f"{url}/search", json={"query": "x"})
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "no_index"
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "x"}).status_code == 200  # no key set: open
    with pytest.raises(ConfigError, match="is not the model index .* was built with .*its files differ"):
        create_app(minilm_path, tiny_index)
    with pytest.raises(ConfigError, match="come from the index's manifest"):
        create_app(None, tiny_index, encoder_options={"pooling": "mean"})


# ------------------------------------------------------------------------------------------------ batching

class FakeEncoder:
    """encode(rows) -> one row of vectors per row (its length, repeated), recording each call; a row "poison" breaks
    the model, and ``gate`` (a threading.Event), when given, holds every call until it is set."""

    def __init__(self, gate=None) -> None:
        self.calls: list[list[str]] = []
        self.gate = gate

    def __call__(self, rows: list[str]):
        if self.gate is not None:
            assert self.gate.wait(60)
        self.calls.append(list(rows))
        if "poison" in rows:
            raise RuntimeError("model exploded")
        return np.array([[len(t)] * 2 for t in rows], dtype=np.float32)


def run_batcher(fake, requests: list[list[str]], **options):
    async def scenario():
        batcher = MicroBatcher(fake, **options)
        await batcher.start()
        try:
            return await asyncio.gather(*(batcher.embed(rows) for rows in requests), return_exceptions=True), batcher
        finally:
            await batcher.stop()

    return asyncio.run(scenario())


def test_concurrent_requests_are_encoded_together():
    fake = FakeEncoder()
    # a full batch goes at once: the very long max_wait is never waited for
    results, batcher = run_batcher(fake, [["a"], ["bb", "ccc"], ["dddd"]], max_batch_size=4, max_wait_ms=600_000)
    assert fake.calls == [["a", "bb", "ccc", "dddd"]]
    assert [r.vectors[:, 0].tolist() for r in results] == [[1.0], [2.0, 3.0], [4.0]]
    assert batcher.stats.to_dict()["mean_batch"] == 4.0


def test_batches_never_split_a_request():
    fake = FakeEncoder()
    results, _ = run_batcher(fake, [["a", "b"], ["c", "d"], ["q"], ["e"]], max_batch_size=3)
    assert fake.calls[0] == ["a", "b"]  # c, d would overflow the batch: they lead the next one
    assert all(len(rows) <= 3 for rows in fake.calls)
    assert sorted(t for rows in fake.calls for t in rows) == ["a", "b", "c", "d", "e", "q"]
    assert [r.vectors.shape[0] for r in results] == [2, 2, 1, 1]


def test_a_request_that_breaks_the_model_fails_alone():
    from robustir.serving.batcher import EncodeFailed

    fake = FakeEncoder()
    requests = [["good one"], ["bad", "poison"], ["good two", "and three"]]
    # the batch is full at 5 texts: the very long max_wait is never waited for
    results, batcher = run_batcher(fake, requests, max_batch_size=5, max_wait_ms=600_000)
    assert fake.calls[0] == ["good one", "bad", "poison", "good two", "and three"]  # one shared batch failed ...
    assert results[0].vectors[:, 0].tolist() == [8.0]  # ... and was re-run request by request
    assert results[2].vectors[:, 0].tolist() == [8.0, 9.0]
    assert isinstance(results[1], EncodeFailed)
    assert batcher.stats.retried_batches == 1 and batcher.stats.failed == 1


async def _until(condition) -> None:
    """Yield to the event loop until ``condition()`` holds (no clock involved)."""
    for _ in range(100_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def test_a_full_queue_refuses_at_once_and_a_timed_out_request_is_dropped():
    import threading

    from robustir.serving.batcher import Overloaded

    gate = threading.Event()
    fake = FakeEncoder(gate)

    async def scenario():
        batcher = MicroBatcher(fake, max_batch_size=2, max_queued=3)
        await batcher.start()
        try:
            first = asyncio.ensure_future(batcher.embed(["running"]))
            await _until(lambda: batcher.queued == 0 and batcher._running)  # the worker holds it
            waiting = asyncio.ensure_future(batcher.embed(["w1", "w2"]))
            await _until(lambda: batcher.queued == 2)
            busy = "2 texts .or rerank pairs. are waiting for the models .at most 3."
            with pytest.raises(Overloaded, match=busy) as refused:
                await batcher.embed(["two", "too many"])
            assert refused.value.retry_after >= 1
            with pytest.raises(asyncio.TimeoutError):  # the gate is shut: this one cannot be served in time
                await batcher.embed(["late"], timeout=0.001)
            gate.set()
            return await first, await waiting, batcher.stats
        finally:
            gate.set()
            await batcher.stop()

    first, waiting, stats = asyncio.run(scenario())
    assert first.vectors.shape == (1, 2) and waiting.vectors.shape == (2, 2)
    assert stats.overloaded == 1 and stats.timed_out == 1
    assert ["late"] not in fake.calls  # dropped from the queue, never encoded


class SteppedEncoder:
    """encode(rows) that waits for the test to let each call through (``step()``), recording the rows of every call
    as it starts: the test decides when each micro-batch finishes, no clock involved."""

    def __init__(self) -> None:
        import threading

        self.started: list[list[str]] = []
        self._go = threading.Semaphore(0)

    def step(self) -> None:
        self._go.release()

    def __call__(self, rows: list[str]):
        self.started.append(list(rows))
        assert self._go.acquire(timeout=60)
        return np.array([[len(t)] * 2 for t in rows], dtype=np.float32)


def test_a_large_request_is_cut_into_micro_batches_and_others_are_served_between_them():
    """Issue 36: a 10-text request with max_batch_size 3 runs as 4 micro-batches, the next queued only when one is
    done, so a request that arrives meanwhile is served after the first, not after all four."""
    model = SteppedEncoder()
    big = [f"text {i}" for i in range(10)]

    async def scenario():
        batcher = MicroBatcher(model, max_batch_size=3, workers=1)
        await batcher.start()
        try:
            large = asyncio.ensure_future(batcher.embed(big))
            await _until(lambda: len(model.started) == 1)  # its first micro-batch runs
            small = asyncio.ensure_future(batcher.embed(["small"]))
            await _until(lambda: batcher.queued == 1)
            for _ in range(5):
                model.step()
            return await large, await small
        finally:
            for _ in range(10):
                model.step()
            await batcher.stop()

    large, small = asyncio.run(scenario())
    assert model.started == [big[:3], ["small"], big[3:6], big[6:9], big[9:]]  # served between, in order
    assert large.vectors[:, 0].tolist() == [float(len(t)) for t in big] and small.vectors.shape == (1, 2)


def test_the_timeout_counts_waiting_for_a_worker_not_encoding():
    """A micro-batch being encoded is never cut off, however long the model takes; one that waits in the queue for
    longer than the timeout is dropped. The loop's own clock is run past the timeout while the model holds the
    batch (no sleep): the request still gets its vectors."""
    model = SteppedEncoder()

    async def scenario():
        loop = asyncio.get_running_loop()
        batcher = MicroBatcher(model, max_batch_size=2, workers=1)
        await batcher.start()
        try:
            timeout = 0.002
            running = asyncio.ensure_future(batcher.embed(["a", "b", "c"], timeout=timeout))
            await _until(lambda: len(model.started) == 1)
            deadline = loop.time() + 5 * timeout
            while loop.time() < deadline:  # the model holds the first micro-batch past the timeout
                await asyncio.sleep(0)
            waiting = asyncio.ensure_future(batcher.embed(["queued"], timeout=timeout))
            with pytest.raises(asyncio.TimeoutError):  # it waits behind the held batch longer than the timeout
                await waiting
            model.step()
            await _until(lambda: len(model.started) == 2)  # the request's second micro-batch, straight after
            model.step()
            return await running, batcher.stats
        finally:
            for _ in range(4):
                model.step()
            await batcher.stop()

    result, stats = asyncio.run(scenario())
    assert result.vectors.shape == (3, 2) and stats.timed_out == 1
    assert ["queued"] not in model.started  # dropped from the queue, never encoded


def test_a_cancelled_request_frees_the_model_within_one_micro_batch():
    """A client that goes away (its request task cancelled) while its first micro-batch runs: the rest of its 30
    texts are never encoded, and the next request is served as soon as that micro-batch ends."""
    model = SteppedEncoder()

    async def scenario():
        batcher = MicroBatcher(model, max_batch_size=3, workers=1)
        await batcher.start()
        try:
            gone = asyncio.ensure_future(batcher.embed([f"t{i}" for i in range(30)]))
            await _until(lambda: len(model.started) == 1)
            gone.cancel()
            nxt = asyncio.ensure_future(batcher.embed(["next"]))
            await _until(lambda: batcher.queued == 1)
            model.step()
            await _until(lambda: len(model.started) == 2)
            model.step()
            return await nxt
        finally:
            for _ in range(4):
                model.step()
            await batcher.stop()

    nxt = asyncio.run(scenario())
    assert model.started == [["t0", "t1", "t2"], ["next"]] and nxt.vectors.shape == (1, 2)


def test_a_client_that_disconnects_cancels_its_work():
    """The route's guard: the ASGI server's http.disconnect cancels the model's part of the request (no polling)."""
    from robustir.serving.service import ClientGone, _unless_client_leaves

    class Request:  # receive() as an ASGI server gives it once the body is read: waits for the disconnect
        def __init__(self) -> None:
            self.gone = asyncio.Event()

        async def receive(self) -> dict:
            await self.gone.wait()
            return {"type": "http.disconnect"}

    async def scenario():
        request, cancelled = Request(), asyncio.Event()

        async def work():
            try:
                await asyncio.Event().wait()  # the model's part: never finishes by itself
            except asyncio.CancelledError:
                cancelled.set()
                raise

        guarded = asyncio.ensure_future(_unless_client_leaves(request, work()))
        await asyncio.sleep(0)
        request.gone.set()
        with pytest.raises(ClientGone):
            await guarded
        assert cancelled.is_set()
        done = Request()
        return await _unless_client_leaves(done, asyncio.sleep(0, result="vectors"))  # finished first: its result

    assert asyncio.run(scenario()) == "vectors"


def test_workers_encode_batches_side_by_side():
    import threading

    both_inside = threading.Barrier(2, timeout=60)  # passes only when two batches run at the same time

    def encode(rows):
        both_inside.wait()
        return np.zeros((len(rows), 2), dtype=np.float32)

    results, batcher = run_batcher(encode, [["a"], ["b"]], max_batch_size=1, workers=2)
    assert [r.vectors.shape for r in results] == [(1, 2), (1, 2)] and batcher.stats.batches == 2


def test_many_concurrent_clients_get_their_own_vectors(tiny_server):
    url, app = tiny_server
    encoder = app.state.server.encoder
    texts = [f"text number {i} about {word}" for i, word in enumerate(["sleep", "coffee", "bones", "heart"] * 4)]

    async def one(client, text):
        reply = await client.post("/v1/embeddings", json={"input": [text, text + " again"]})
        return np.array([d["embedding"] for d in reply.json()["data"]], dtype=np.float32)

    async def everyone():
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
            return await asyncio.gather(*(one(client, t) for t in texts))

    before = app.state.server.batcher.stats.requests
    results = asyncio.run(everyone())
    for text, got in zip(texts, results):
        np.testing.assert_allclose(got, encoder.encode([text, text + " again"], "passage"), atol=1e-5)
    assert app.state.server.batcher.stats.requests - before == len(texts)


# ------------------------------------------------------------------------------------------------ the real model

@pytest.mark.slow
def test_real_model_openai_client_matches_sentence_transformers_and_search_matches_eval(tmp_path, minilm_path,
                                                                                        single_torch_thread):
    from sentence_transformers import SentenceTransformer

    from robustir.data.trec import read_trec_run

    beir = write_beir(tmp_path / "beir")
    assert main(["eval", "--model", minilm_path, "--data", str(beir), "--top-k", "6", "--output",
                 str(tmp_path / "eval")]) == 0
    run = read_trec_run(tmp_path / "eval" / "run.trec")
    SearchIndex.build(tmp_path / "idx", minilm_path, beir, config=IndexConfig(show_progress=False))[0].close()
    texts = ["Aspirin reduces the risk of heart attacks.", "How does sleep affect obesity in children?",
             "naïve café — ünïcödé text"]
    reference = SentenceTransformer(minilm_path, device="cpu").encode(texts, normalize_embeddings=True)
    app = create_app(minilm_path, tmp_path / "idx", ServeConfig(api_key=KEY))
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert client.models.list().data[0].id == "all-MiniLM-L6-v2"
        as_base64 = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # the client's default: base64
        as_float = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float")
        for reply in (as_base64, as_float):
            got = np.array([d.embedding for d in reply.data], dtype=np.float32)
            cosine = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
            assert cosine.min() >= 0.9999, cosine
        assert as_base64.usage.prompt_tokens == sum(
            len(ids) for ids in app.state.server.encoder.tokenizer(texts, truncation=True, max_length=256)["input_ids"])
        qids = [q for q, _ in QUERIES]
        hits = httpx.post(f"{url}/search", json={"query": [t for _, t in QUERIES], "top_k": 6},
                          headers={"Authorization": f"Bearer {KEY}"}).json()["hits"]
    for qid, row in zip(qids, hits):
        expected = sorted(run[qid].items(), key=lambda item: -item[1])
        assert [h["id"] for h in row] == [d for d, _ in expected]
        # bf16 where native: the server pads each pass to a multiple of 16 tokens, eval to its batch's longest
        # text, and bf16 sums the same numbers in other blocks -- scores agree to bf16's precision, not fp32's
        np.testing.assert_allclose([h["score"] for h in row], [s for _, s in expected], atol=1e-3)


# ------------------------------------------------------------------------------------------------ CLI

def test_cli_serve_wires_model_index_and_options(tiny_index, monkeypatch, capsys):
    started = {}
    monkeypatch.setattr("robustir.serving.server.serve", lambda app, host, port: started.update(app=app, host=host,
                                                                                             port=port))
    assert main(["serve", "--index", str(tiny_index), "--port", "8123", "--api-key", "k", "--max-batch-size", "8",
                 "--matryoshka-dims", "16", "--device", "cpu"]) == 0
    assert started["host"] == "127.0.0.1" and started["port"] == 8123
    assert started["app"].state.server.batcher.max_batch_size == 8 and started["app"].state.server.index.count == 6
    out = capsys.readouterr().out
    assert "robustir serve: model tiny-bert0" in out and "(6 documents)" in out and "API key required" in out
    server = started["app"].state.server  # issue 55: the real workers and precision (it said "2 workers (bf16)")
    import torch

    threads = torch.get_num_threads()
    assert (f"{server.workers} model worker{'s' if server.workers > 1 else ''} x {threads} torch thread"
            f"{'s' if threads > 1 else ''}, {server.precision} on cpu, http://") in out


def test_the_start_up_line_says_the_workers_and_precision_the_index_is_served_in(tiny_index, monkeypatch, capsys):
    """Issue 55, item 6: asked for bf16 with two workers' worth of CPUs, a server over an fp32 index encodes queries
    in the index's fp32 with one worker -- and says so (it logged "2 workers (bf16)")."""
    monkeypatch.setattr("robustir.hardware.available_cpus", lambda: 2)
    monkeypatch.setattr("robustir.precision._cpu_native_bf16", lambda: True)
    monkeypatch.setattr("robustir.serving.server.serve", lambda app, host, port: None)
    import torch

    threads = torch.get_num_threads()
    try:
        assert main(["serve", "--index", str(tiny_index), "--device", "cpu"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "1 model worker x 2 torch threads, fp32 on cpu" in out, out


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "port = 70000 is out of range"),
    (["--index", "nowhere"], "nowhere: no index here"),
    (["--index", "IDX", "--pooling", "mean"], "come from the index's manifest"),
    (["--max-batch-size", "0"], "max_batch_size = 0 is out of range"),
    (["--device", "tpu"], "device 'tpu' is not a device"),
])
def test_cli_serve_errors_are_one_message(tiny_index, capsys, argv, message):
    argv = [str(tiny_index) if a == "IDX" else a for a in argv]
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("robustir serve: error: ") and message in err and "Traceback" not in err


def test_cli_serve_help_and_bad_flags(capsys):
    assert main(["serve", "--help"]) == 0 and "--max-wait-ms" in capsys.readouterr().out
    assert main(["serve", "--port", "eighty"]) == 2
    assert "port: expected an integer, got 'eighty'" in capsys.readouterr().err


def test_port_in_use_is_a_one_line_error(tiny_model_dir):
    from robustir.serving.server import _bind

    taken = _bind("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match=r"cannot listen on 127.0.0.1:\d+ .*choose another --port"):
            _bind("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()


# ------------------------------------------------------------------------------------------------ modes, live changes

def test_search_modes_equal_robustir_eval_through_the_same_index(client, tiny_index, tiny_server):
    from robustir.evaluation.retrieval import EvalConfig, evaluate

    beir = tiny_index.parent / "beir"
    qids, texts = [q for q, _ in QUERIES], [t for _, t in QUERIES]
    for mode in ("dense", "lexical", "hybrid"):
        run = evaluate(None, beir, "test", EvalConfig(search_index=str(tiny_index), mode=mode, top_k=4,
                                                      fusion={"candidates": 20}, show_progress=False)).run
        body = {"query": texts, "top_k": 4, "mode": mode}
        if mode == "hybrid":
            body["fusion"] = {"candidates": 20}  # the server's max_top_k
        reply = client.post("/search", json=body)
        assert reply.status_code == 200, reply.text
        for qid, row in zip(qids, reply.json()["hits"]):
            if qid not in run:
                continue  # a query without qrels is not evaluated
            expected = sorted(run[qid].items(), key=lambda item: -item[1])
            assert [h["id"] for h in row] == [d for d, _ in expected], mode
            np.testing.assert_allclose([h["score"] for h in row], [s for _, s in expected], atol=1e-5)
    lexical = client.post("/search", json={"query": "coffee", "top_k": 6, "mode": "lexical"}).json()["hits"]
    assert [h["id"] for h in lexical] == ["d5"]  # only the coffee document has the word: fewer than top_k
    dense = client.post("/search", json={"query": "coffee", "top_k": 6}).json()["hits"]
    assert len(dense) == 6


@pytest.mark.parametrize("body, param, message", [
    ({"query": "x", "mode": "sparse"}, "mode", "'dense', 'lexical' or 'hybrid'"),
    ({"query": "x", "fusion": {"rrf_k": 10}}, "fusion", "goes with mode 'hybrid'"),
    ({"query": "x", "mode": "hybrid", "fusion": {"rrf_k": 0}}, "fusion.rrf_k", "greater than or equal to 1, got 0"),
    ({"query": "x", "mode": "hybrid", "fusion": {"k": 1}}, "fusion.k", "unrecognized request argument 'fusion.k'"),
    ({"query": "x", "mode": "hybrid", "fusion": [60]}, "fusion", "must be a JSON object"),
    ({"query": "x", "mode": "hybrid", "fusion": {"candidates": 10 ** 9}}, "fusion.candidates", "at most 20"),
    ({"query": "x", "mode": "hybrid", "fusion": {"dense_weight": float("nan")}}, "fusion.dense_weight",
     "must be a finite number"),
])
def test_bad_mode_and_fusion_requests(client, body, param, message):
    try:
        reply = client.post("/search", json=body)
    except ValueError:  # the client refuses to send NaN as JSON; send it by hand
        reply = client.post("/search", content=b'{"query": "x", "mode": "hybrid", "fusion": {"dense_weight": NaN}}',
                            headers={"Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_a_running_server_follows_add_delete_and_upsert(tmp_path, tiny_model_dir):
    """Under a running server: each committed change shows on the next query -- found, filtered, exactly top_k while
    enough documents match -- and no request fails while the writer works."""
    import threading

    from test_serving_index import write_corpus

    corpus = write_corpus(tmp_path / "corpus.jsonl")  # 24 documents, 8 topics, lang en/de/fr, meta.year
    SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=IndexConfig(show_progress=False))[0].close()
    app = create_app(None, tmp_path / "idx", ServeConfig(max_wait_ms=0))
    failures: list = []
    stop = threading.Event()
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        def hammer() -> None:  # other clients, all the while
            bodies = [{"query": "health study", "top_k": 5}, {"query": "study", "top_k": 5, "mode": "lexical"},
                      {"query": "health", "top_k": 5, "mode": "hybrid", "filter": {"lang": "de"}},
                      {"query": "health", "top_k": 5, "filter": {"meta.year": {"$gte": 2004}}}]
            while not stop.is_set():
                for body in bodies:
                    reply = client.post("/search", json=body)
                    if reply.status_code != 200 or len(reply.json()["hits"]) != 5:
                        failures.append((body, reply.status_code, reply.text[:300]))

        def search(**body) -> list[dict]:
            reply = client.post("/search", json=body)
            assert reply.status_code == 200, reply.text
            return reply.json()["hits"]

        thread = threading.Thread(target=hammer)
        thread.start()
        try:
            writer = SearchIndex.open(tmp_path / "idx", writable=True)
            more = tmp_path / "more.jsonl"
            more.write_text("".join(json.dumps({"_id": f"n{i}", "title": "Zebra", "text": f"zebra crossing {i}",
                                                "lang": "de", "colour": ["red", "blue"][i % 2]}) + "\n"
                                    for i in range(6)))
            writer.add(more, config=IndexConfig(show_progress=False, chunk_size=2))
            assert client.get("/health").json()["index"]["documents"] == 30
            assert {h["id"] for h in search(query="zebra", top_k=10, mode="lexical")} == {f"n{i}" for i in range(6)}
            red = search(query="zebra crossing", top_k=3, filter={"colour": "red"})  # a field new since the start
            assert len(red) == 3 and all(h["fields"]["colour"] == "red" for h in red)
            writer.delete(["n0", "n2", "d1"])
            assert client.get("/health").json()["index"]["documents"] == 27
            assert {h["id"] for h in search(query="zebra", top_k=10, mode="lexical")} == {"n1", "n3", "n4", "n5"}
            assert len(search(query="zebra crossing", top_k=10, filter={"lang": "de"})) == 10  # 8 + 4 - 0 de left
            update = tmp_path / "update.jsonl"
            update.write_text(json.dumps({"_id": "n1", "title": "Okapi", "text": "okapi sightings", "lang": "fr"})
                              + "\n")
            writer.upsert(update, config=IndexConfig(show_progress=False))
            okapi = search(query="okapi", top_k=5, mode="lexical")
            assert [(h["id"], h["title"], h["fields"]) for h in okapi] == [("n1", "Okapi", {"lang": "fr"})]
            assert "n1" not in {h["id"] for h in search(query="zebra", top_k=10, mode="lexical")}
            writer.close()
            # issue 35: a rebuild (--overwrite) under the server: the old index answers until the new one is whole
            seen = []
            rebuilt, _ = SearchIndex.build(tmp_path / "idx", tiny_model_dir,
                                           write_corpus(tmp_path / "new.jsonl", n=30, start=300, prefix="r"),
                                           config=IndexConfig(show_progress=False, chunk_size=7), overwrite=True,
                                           on_chunk=lambda _: seen.append(client.get("/health").json()["index"]))
            assert seen and all(s["documents"] == 27 for s in seen), seen
            assert client.get("/health").json()["index"]["documents"] == 30
            assert all(h["id"].startswith("r") for h in search(query="study", top_k=10, mode="lexical"))
            rebuilt.close()
        finally:
            stop.set()
            thread.join(timeout=120)
    assert not failures, failures[:3]


# ------------------------------------------------------------------------------------------------ rerank (issue 36)

@pytest.fixture(scope="module")
def tiny_cross_encoder(tmp_path_factory, tiny_model_dir) -> str:
    """A 2-layer random BERT with a one-label sequence-classification head and MiniLM's tokenizer: a cross-encoder
    folder (as sentence-transformers' CrossEncoder loads one)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    out = tmp_path_factory.mktemp("tiny-cross")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, num_labels=1)
    torch.manual_seed(1)
    BertForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def test_rerank_with_the_served_model_orders_by_cosine(client, tiny_server):
    _, app = tiny_server
    encoder = app.state.server.encoder
    documents = ["coffee is a drink", "bones need calcium", "the heart pumps blood", "sleep helps memory"]
    reply = client.post("/v1/rerank", json={"query": "what does the heart do", "documents": documents,
                                             "return_documents": True, "top_n": 3})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    q = encoder.encode(["what does the heart do"], "query", precision=app.state.server.precision)[0]
    d = encoder.encode(documents, "passage", precision=app.state.server.precision)
    cos = (d / np.linalg.norm(d, axis=1, keepdims=True)) @ (q / np.linalg.norm(q))
    expected = sorted(range(4), key=lambda i: -cos[i])[:3]
    assert [r["index"] for r in body["results"]] == expected and len(body["results"]) == 3
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([float(cos[i]) for i in expected],
                                                                           abs=2e-2)
    assert [r["document"] for r in body["results"]] == [documents[i] for i in expected]
    assert body["object"] == "rerank" and body["model"] == app.state.server.name
    for bad, field in (({"query": "q", "documents": []}, "documents"), ({"query": " ", "documents": ["a"]}, "query"),
                       ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
                       ({"documents": ["a"]}, "query")):
        error = client.post("/v1/rerank", json=bad)
        assert error.status_code == 400 and error.json()["error"]["param"] == field, error.text


def test_rerank_with_a_cross_encoder_and_search_as_a_second_stage(tiny_index, tiny_cross_encoder, tiny_model_dir):
    """``--rerank-model`` (a cross-encoder folder): /v1/rerank returns its scores, highest first; /search with
    rerank: true re-scores each query's candidates with it and returns the top_k of that order, the first stage's
    score kept beside it. A folder that is not a cross-encoder is refused when the server starts."""
    from sentence_transformers import CrossEncoder

    app = create_app(None, tiny_index, ServeConfig(rerank_model=tiny_cross_encoder, precision="fp32",
                                                   rerank_candidates=6))
    model = CrossEncoder(tiny_cross_encoder, device="cpu")
    documents = ["coffee is a drink", "bones need calcium", "the heart pumps blood"]
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        reply = client.post("/v1/rerank", json={"query": "heart", "documents": documents})
        assert reply.status_code == 200, reply.text
        expected = model.predict([("heart", d) for d in documents])
        results = reply.json()["results"]
        assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -expected[i])
        assert [r["relevance_score"] for r in results] == pytest.approx(sorted(expected, reverse=True), abs=1e-5)
        plain = client.post("/search", json={"query": "coffee", "top_k": 6}).json()["hits"]
        reranked = client.post("/search", json={"query": "coffee", "top_k": 3, "rerank": True}).json()["hits"]
        pairs = [("coffee", f"{h['title']} {h['text']}".strip() if h["title"] else h["text"]) for h in plain]
        scores = model.predict(pairs)
        best = sorted(range(len(plain)), key=lambda i: -scores[i])[:3]
        assert [h["id"] for h in reranked] == [plain[i]["id"] for i in best]
        assert [h["rerank_score"] for h in reranked] == pytest.approx([float(scores[i]) for i in best], abs=1e-5)
        assert [h["score"] for h in reranked] == [plain[i]["score"] for i in best]  # the first stage's score, kept
    with pytest.raises(ConfigError, match="is not a cross-encoder"):
        create_app(None, tiny_index, ServeConfig(rerank_model=tiny_model_dir))


# ------------------------------------------------------------------------------------------------ every model queued (issue 52)

def test_rerank_work_takes_turns_with_embeddings_in_the_same_queue():
    """Issue 52, item 3: a 12-pair rerank (micro-batches of 2 pairs) and two 1-text embeddings that arrive while it
    runs: each embedding runs right after the rerank's micro-batch that is running, not after the whole rerank,
    and its pairs count among the queued rows."""
    model = SteppedEncoder()
    pairs = [f"pair {i}" for i in range(12)]

    async def scenario():
        batcher = MicroBatcher(model, max_batch_size=4, workers=1)
        batcher.add_model("rerank", model, batch_size=2, unit="pair")
        await batcher.start()
        try:
            rerank = asyncio.ensure_future(batcher.submit("rerank", pairs))
            await _until(lambda: len(model.started) == 1)  # its first micro-batch runs
            first = asyncio.ensure_future(batcher.embed(["one"]))
            await _until(lambda: batcher.queued == 1)
            model.step()
            await _until(lambda: len(model.started) == 2)
            queued_with_rerank = batcher.queued  # the rerank's next micro-batch waits: 2 pairs
            second = asyncio.ensure_future(batcher.embed(["two"]))
            await _until(lambda: batcher.queued == queued_with_rerank + 1)
            for _ in range(8):
                model.step()
            return await rerank, await first, await second, queued_with_rerank
        finally:
            for _ in range(10):
                model.step()
            await batcher.stop()

    rerank, first, second, queued = asyncio.run(scenario())
    assert model.started == [pairs[:2], ["one"], pairs[2:4], ["two"], pairs[4:6], pairs[6:8], pairs[8:10],
                             pairs[10:]]
    assert queued == 2 and rerank.vectors.shape == (12, 2) and first.vectors.shape == (1, 2)


def test_a_cancelled_request_leaves_the_queue_at_once():
    """The rows of a request whose client went away stop counting against --max-queued-texts when it is cancelled,
    not when a worker would have reached them: the next request is not refused for them."""
    model = SteppedEncoder()

    async def scenario():
        batcher = MicroBatcher(model, max_batch_size=4, workers=1, max_queued=5)
        batcher.add_model("rerank", model, batch_size=4, unit="pair")
        await batcher.start()
        try:
            running = asyncio.ensure_future(batcher.embed(["held"]))
            await _until(lambda: len(model.started) == 1)
            gone = asyncio.ensure_future(batcher.submit("rerank", ["p1", "p2", "p3", "p4"]))
            await _until(lambda: batcher.queued == 4)
            gone.cancel()
            await _until(lambda: gone.done())
            after_cancel = batcher.queued
            later = asyncio.ensure_future(batcher.embed(["a", "b", "c"]))  # 4 + 3 > 5 had the pairs stayed
            await _until(lambda: batcher.queued == 3)
            model.step()
            model.step()
            return after_cancel, await running, await later
        finally:
            for _ in range(4):
                model.step()
            await batcher.stop()

    after_cancel, running, later = asyncio.run(scenario())
    assert after_cancel == 0 and later.vectors.shape == (3, 2)
    assert model.started == [["held"], ["a", "b", "c"]]  # the cancelled pairs never ran


def test_a_rerank_waits_in_the_queue_and_is_refused_when_it_is_full(tiny_index, tiny_cross_encoder):
    """A cross-encoder rerank is queued like an embedding: /health counts its pairs in queued_texts, one that would
    overflow --max-queued-texts gets 429 with Retry-After, and a held model lets both finish afterwards."""
    import threading

    app = create_app(None, tiny_index, ServeConfig(rerank_model=tiny_cross_encoder, precision="fp32",
                                                   max_queued_texts=6, encode_batch_size=4))
    batcher = app.state.server.batcher
    gate = threading.Event()
    real = batcher.encode

    def held(rows):
        assert gate.wait(60)
        return real(rows)

    batcher.encode = held
    documents = [f"document number {i}" for i in range(6)]
    try:
        with running_server(app) as url:
            async def scenario():
                async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                    running = asyncio.ensure_future(c.post("/v1/embeddings", json={"input": "held by the gate"}))
                    await _until(lambda: batcher._running)
                    waiting = asyncio.ensure_future(c.post("/v1/rerank", json={"query": "q", "documents": documents}))
                    # one micro-batch (4 pairs) per worker waits; the rest follows it
                    await _until(lambda: batcher.queued == 4)
                    health = (await c.get("/health")).json()
                    refused = await c.post("/v1/rerank", json={"query": "q", "documents": documents})
                    gate.set()
                    return health, refused, await running, await waiting

            health, refused, running, waiting = asyncio.run(scenario())
    finally:
        gate.set()
    assert health["queued_texts"] == 4
    error = refused.json()["error"]
    assert refused.status_code == 429 and error["code"] == "overloaded" and int(refused.headers["retry-after"]) >= 1
    assert "rerank pairs" in error["message"]
    assert running.status_code == 200 and waiting.status_code == 200, waiting.text
    assert sorted(r["index"] for r in waiting.json()["results"]) == list(range(6))


def test_a_rerank_whose_client_disconnects_is_dropped_with_499(tiny_index, tiny_cross_encoder):
    """A rerank whose client goes away while its first micro-batch runs: 499, and its other micro-batches never
    reach the cross-encoder (as an embedding's do not)."""
    import threading

    from robustir.serving.errors import ApiError

    app = create_app(None, tiny_index, ServeConfig(rerank_model=tiny_cross_encoder, precision="fp32",
                                                   encode_batch_size=2))
    server = app.state.server
    gate, calls = threading.Event(), []
    real = server.reranker.score

    def held(queries, documents):
        calls.append(list(documents))
        assert gate.wait(60)
        return real(queries, documents)

    server.reranker.score = held

    class Request:  # what the ASGI server gives once the body is read: receive() waits for the disconnect
        def __init__(self) -> None:
            self.gone = asyncio.Event()

        async def receive(self) -> dict:
            await self.gone.wait()
            return {"type": "http.disconnect"}

    async def scenario():
        await server.batcher.start()
        try:
            request = Request()
            work = asyncio.ensure_future(server.rerank_scores("q", [f"d{i}" for i in range(8)], request))
            await _until(lambda: len(calls) == 1)
            request.gone.set()
            with pytest.raises(ApiError) as gone:
                await work
            gate.set()
            return gone.value
        finally:
            gate.set()
            await server.batcher.stop()

    try:
        error = asyncio.run(scenario())
    finally:
        server.close()
    assert error.status == 499 and error.code == "client_closed_request"
    assert calls == [["d0", "d1"]]  # the other three micro-batches were dropped


def test_a_classifier_with_several_labels_is_refused_as_a_reranker(tmp_path, tiny_index, tiny_model_dir):
    """Issue 52, item 8: a 3-label classifier (an NLI model) as --rerank-model ranked by its first logit, without a
    word. It is refused when the server starts -- and as a teacher (the same cross-encoder scorer) -- naming its
    labels and what a reranker needs."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from robustir.filtering.teacher import load_teacher

    folder = tmp_path / "nli"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, num_labels=3,
                        id2label={0: "contradiction", 1: "entailment", 2: "neutral"},
                        label2id={"contradiction": 0, "entailment": 1, "neutral": 2})
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    expected = r"is a classifier with 3 labels \(contradiction, entailment, neutral\), not a relevance cross-encoder"
    with pytest.raises(ConfigError, match=expected):
        create_app(None, tiny_index, ServeConfig(rerank_model=str(folder), precision="fp32"))
    with pytest.raises(ConfigError, match="num_labels 1"):
        load_teacher(str(folder), "cross-encoder", precision="fp32", device="cpu")


# ------------------------------------------------------------------------------------------------ issue 55: upserts

def test_background_work_runs_on_one_worker_fewer():
    """Issue 55, item 1: an HTTP upsert's micro-batches are background work -- with two workers only one of them
    runs at a time, so an embedding that arrives meanwhile starts at once on the other worker instead of waiting
    behind the upsert; the background rows are still all encoded, in order."""
    model = SteppedEncoder()
    rows = [f"doc {i}" for i in range(6)]

    async def scenario():
        batcher = MicroBatcher(model, max_batch_size=4, workers=2)
        batcher.add_model("ingest", model, batch_size=2, unit="document", background=True)
        await batcher.start()
        try:
            upsert = asyncio.ensure_future(batcher.submit("ingest", rows))
            await _until(lambda: len(model.started) == 1)  # its first micro-batch runs; one worker stays free
            query = asyncio.ensure_future(batcher.embed(["query"]))
            await _until(lambda: len(model.started) == 2)
            second_call = list(model.started[1])
            for _ in range(4):
                model.step()
            return second_call, await upsert, await query
        finally:
            for _ in range(6):
                model.step()
            await batcher.stop()

    second_call, upsert, query = asyncio.run(scenario())
    assert second_call == ["query"]  # not the upsert's second micro-batch
    assert [call for call in model.started if call != ["query"]] == [rows[:2], rows[2:4], rows[4:]]
    assert upsert.vectors.shape == (6, 2) and query.vectors.shape == (1, 2)


def test_background_work_is_admitted_by_the_queue_limit_once_and_takes_turns():
    """An upsert is refused (429 at the route) like any request when the queue is full, and a job's later chunks,
    submitted with admitted=True, are not; its micro-batches take turns with the embeddings' batches (a strict
    priority for the embeddings starved the upsert under steady searching), so neither waits for more than one of
    the other's."""
    from robustir.serving.batcher import Overloaded

    model = SteppedEncoder()

    async def scenario():
        batcher = MicroBatcher(model, max_batch_size=4, workers=1, max_queued=4)
        batcher.add_model("ingest", model, batch_size=2, unit="document", background=True)
        await batcher.start()
        try:
            held = asyncio.ensure_future(batcher.embed(["held"]))
            await _until(lambda: len(model.started) == 1)
            waiting = asyncio.ensure_future(batcher.embed(["a", "b", "c"]))
            await _until(lambda: batcher.queued == 3)
            with pytest.raises(Overloaded):
                batcher.admit("ingest", 10)
            later = asyncio.ensure_future(batcher.submit("ingest", ["d1", "d2", "d3"], admitted=True))
            await _until(lambda: batcher.queued == 5)
            for _ in range(4):
                model.step()
            return await held, await waiting, await later
        finally:
            for _ in range(4):
                model.step()
            await batcher.stop()

    held, waiting, later = asyncio.run(scenario())
    assert later.vectors.shape == (3, 2)
    assert model.started == [["held"], ["d1", "d2"], ["a", "b", "c"], ["d3"]]  # turns: embed, ingest, embed, ingest


def test_with_a_background_lane_a_search_never_waits_for_the_upsert_and_the_lanes_share_the_threads():
    """Issue 55, item 1 (fp32 on a CPU: one model worker): with background_lane the upsert's micro-batches run on a
    thread of their own, so an embedding that arrives while one is under way starts at once instead of waiting for it;
    each batch is told its intra-op threads first (set_threads): while both lanes have work, 1 for the upsert's and
    one fewer than ``threads`` for the others (the two lanes share the CPUs), else all of ``threads``."""
    model = SteppedEncoder()
    told: list[int] = []
    rows = [f"doc {i}" for i in range(4)]

    def set_threads(n: int) -> None:
        told.append(n)

    async def scenario():
        batcher = MicroBatcher(model, max_batch_size=4, workers=1, background_lane=True, set_threads=set_threads,
                               threads=2, clock=lambda: 0.0)  # a request at "0" is within busy_window_s of it
        batcher.add_model("ingest", model, batch_size=2, unit="document", background=True)
        await batcher.start()
        try:
            upsert = asyncio.ensure_future(batcher.submit("ingest", rows))
            await _until(lambda: len(model.started) == 1)  # the upsert's first micro-batch is under way
            query = asyncio.ensure_future(batcher.embed(["query"]))
            await _until(lambda: len(model.started) == 2)  # started beside it, not after it
            during = model.started[1]
            for _ in range(3):
                model.step()
            done = await upsert, await query
            model.step()
            after = await batcher.embed(["later"])
            return during, done, after
        finally:
            for _ in range(4):
                model.step()
            await batcher.stop()

    during, (upsert, query), after = asyncio.run(scenario())
    assert during == ["query"]
    assert upsert.vectors.shape == (4, 2) and query.vectors.shape == (1, 2) and after.vectors.shape == (1, 2)
    # the upsert alone: 2; the query beside it: 1; the upsert with a query just come: 1; later, nothing else about: 2
    assert told == [2, 1, 1, 2]


# ------------------------------------------------------------------------------------------------ issue 55: operations

def test_the_openapi_spec_describes_every_answer_and_real_answers_fit_it(client):
    """Issue 55, item 5: every route's 200 answer has a schema in /openapi.json (a component with properties, not
    the empty {} of before), and the answers the server really gives validate against those models."""
    from robustir.serving.responses import ROUTE_MODELS, HealthAnswer, InfoAnswer, ModelCard, ModelList, \
        RerankAnswer, SearchAnswer, EmbeddingList

    spec = client.get("/openapi.json").json()
    for route, model in ROUTE_MODELS.items():
        method, path = route.split(" ", 1)
        schema = spec["paths"][path][method.lower()]["responses"]["200"]["content"]["application/json"]["schema"]
        name = schema["$ref"].rsplit("/", 1)[-1]
        assert name == model.__name__ and spec["components"]["schemas"][name]["properties"], route
    SearchAnswer.model_validate(client.post("/search", json={"query": "heart", "top_k": 2}).json())
    SearchAnswer.model_validate(client.post("/search", json={"query": ["heart", "bone"], "top_k": 2}).json())
    EmbeddingList.model_validate(embed(client, input=["a", "b"]).json())
    EmbeddingList.model_validate(embed(client, input="a", encoding_format="base64").json())
    RerankAnswer.model_validate(client.post("/v1/rerank", json={"query": "heart", "documents": ["a", "b"],
                                                                "return_documents": True}).json())
    ModelList.model_validate(client.get("/v1/models").json())
    ModelCard.model_validate(client.get("/v1/models/tiny-bert0").json())
    InfoAnswer.model_validate(client.get("/info").json())
    HealthAnswer.model_validate(client.get("/health").json())


def test_search_and_rerank_have_metrics_of_their_own(client):
    """Issue 55, item 5: /metrics counts the queries /search searched (by mode, by text or vector) with their time,
    and the pairs reranked, not only HTTP requests."""
    import re

    def value(text: str, pattern: str) -> float:
        found = re.search(pattern + r" ([0-9.e+]+)", text)
        return float(found.group(1)) if found else 0.0

    before = client.get("/metrics").text
    assert client.post("/search", json={"query": ["heart", "bone", "sleep"], "mode": "lexical"}).status_code == 200
    assert client.post("/v1/rerank", json={"query": "heart", "documents": ["a", "b", "c", "d"]}).status_code == 200
    after = client.get("/metrics").text
    queries = r'robustir_search_queries_total\{by="text",mode="lexical"\}'
    assert value(after, queries) - value(before, queries) == 3
    seconds = r'robustir_search_seconds_count\{mode="lexical"\}'
    assert value(after, seconds) - value(before, seconds) == 1
    assert value(after, "robustir_rerank_pairs_total") - value(before, "robustir_rerank_pairs_total") == 4


def test_no_route_runs_a_dependency_on_the_thread_pool() -> None:
    """FastAPI runs a plain ``def`` dependency on its thread pool: a thread hop per request (issue 55: 30-41 threads
    at 32 clients). Every dependency of every route is ``async`` (or a class with an async ``__call__``)."""
    import inspect

    from robustir.serving.routes import router

    def calls(dependant):
        for sub in dependant.dependencies:
            yield sub.call
            yield from calls(sub)

    sync = set()
    for route in router.routes:
        for call in calls(route.dependant):
            target = call if inspect.isfunction(call) else getattr(call, "__call__", call)
            if not inspect.iscoroutinefunction(target):
                sync.add(f"{route.path}: {getattr(call, '__name__', call)}")
    assert not sync, sorted(sync)
