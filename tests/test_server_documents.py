"""Issue 36: documents in and out of a served index over HTTP -- POST /documents (upsert), DELETE /documents (ids or a
filter), GET /documents/{id} -- through the same writer, lock and jobs as ``robustir index``."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_serving_index import write_corpus  # noqa: E402

from robustir.index.store import IndexConfig, SearchIndex  # noqa: E402
from robustir.serving import ServeConfig, create_app, running_server  # noqa: E402

KEY = "doc-key"


@pytest.fixture()
def index_path(tmp_path, tiny_model_dir) -> Path:
    corpus = write_corpus(tmp_path / "corpus.jsonl", n=12)
    SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=IndexConfig(show_progress=False))[0].close()
    return tmp_path / "idx"


@pytest.fixture()
def served(index_path):
    app = create_app(None, index_path, ServeConfig(api_key=KEY, max_inputs_per_request=16))
    with running_server(app) as url, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                                  timeout=120) as client:
        yield client, app


def test_upsert_get_and_delete_over_http_are_seen_by_search_at_once(served, index_path):
    client, app = served
    new = [{"_id": "n1", "title": "Zebras", "text": "zebras have stripes", "lang": "en", "year": 2024},
           {"_id": "d0", "title": "Replaced", "text": "a replaced document about penguins", "lang": "de"}]
    reply = client.post("/documents", json={"documents": new})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"object": "documents", "upserted": 2, "documents": 13}
    hits = client.post("/search", json={"query": "zebras have stripes", "top_k": 13}).json()["hits"]
    assert len(hits) == 13 and "n1" in [h["id"] for h in hits]  # exactly top_k, the new one among them
    assert client.post("/search", json={"query": "stripes", "filter": {"year": 2024}}).json()["hits"][0]["id"] == "n1"
    got = client.get("/documents/d0").json()
    assert got["text"] == "a replaced document about penguins" and got["fields"]["lang"] == "de"
    lexical = client.post("/search", json={"query": "penguins", "mode": "lexical", "top_k": 1}).json()["hits"]
    assert lexical[0]["id"] == "d0"
    assert client.request("DELETE", "/documents", json={"ids": ["n1"]}).json()["deleted"] == 1
    assert client.get("/documents/n1").status_code == 404
    deleted = client.request("DELETE", "/documents", json={"filter": {"lang": "de"}}).json()
    assert deleted["deleted"] >= 1 and client.get("/documents/d0").status_code == 404
    reopened = SearchIndex.open(index_path)  # the CLI's view: the same index, the jobs recorded
    assert reopened.count == deleted["documents"] and not (index_path / "incoming").exists() or \
        not list((index_path / "incoming").iterdir())
    reopened.close()


def test_bad_documents_and_deletes_are_refused_naming_them(served):
    client, _ = served
    cases = [({"documents": [{"title": "no id", "text": "x"}]}, 400, "documents[0]"),
             ({"documents": [{"_id": "a", "text": "ok"}, {"_id": "b", "text": 3}]}, 400, "documents[1].text"),
             ({"documents": [{"_id": "a", "text": " "}]}, 400, "documents[0]"),
             ({"documents": []}, 400, "documents"),
             ({"documents": [{"_id": f"x{i}", "text": "t"} for i in range(17)]}, 400, "documents")]
    for body, status, param in cases:
        reply = client.post("/documents", json=body)
        assert reply.status_code == status and reply.json()["error"]["param"] == param, (body, reply.text)
    for document, param in (({"_id": "n", "text": "t", "score": float("nan")}, "documents[0].score"),  # the index's
                            ({"_id": "bad\u0000id", "text": "t"}, "documents[0]._id")):  # checks, naming the key
        raw = json.dumps({"documents": [document]})  # NaN as Python's JSON writes it (a client may send it)
        reply = client.post("/documents", content=raw, headers={"Content-Type": "application/json"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    twice = client.post("/documents", json={"documents": [{"_id": "a", "text": "one"}, {"_id": "a", "text": "two"}]})
    assert twice.status_code == 400 and "documents[1]" in twice.json()["error"]["param"], twice.text
    missing = client.request("DELETE", "/documents", json={"ids": ["d1", "nope"]})
    assert missing.status_code == 404 and "'nope'" in missing.json()["error"]["message"]
    assert client.get("/documents/d1").status_code == 200  # nothing was deleted
    both = client.request("DELETE", "/documents", json={"ids": ["d1"], "filter": {"lang": "en"}})
    assert both.status_code == 400 and "exactly one of 'ids'" in both.json()["error"]["message"]
    bad_filter = client.request("DELETE", "/documents", json={"filter": {"colour": "red"}})
    assert bad_filter.status_code == 400 and bad_filter.json()["error"]["param"] == "filter"
    assert httpx.post(f"{client.base_url}/documents", json={"documents": [{"_id": "k", "text": "t"}]}).status_code == 401


def test_a_cli_writer_holding_the_lock_makes_http_writes_answer_409(served, index_path):
    from robustir.index.store.storage import LocalStore

    client, _ = served
    held = LocalStore(index_path).lock()  # what a running `robustir index --upsert` holds
    try:
        reply = client.post("/documents", json={"documents": [{"_id": "z", "text": "zz"}]})
        assert reply.status_code == 409 and "another process" in reply.json()["error"]["message"]
    finally:
        held.release()
    assert client.post("/documents", json={"documents": [{"_id": "z", "text": "zz"}]}).status_code == 200


def test_an_upsert_killed_mid_job_is_finished_before_the_server_serves(index_path, tiny_model_dir):
    """A server killed during an HTTP upsert leaves an unfinished --upsert job of its incoming file: the next start
    finishes it (nothing acknowledged is lost; what was not acknowledged is completed, not half-applied); an
    incoming file no job reads (killed while writing it, never acknowledged) is removed."""
    from robustir.index.store.spool import write_incoming

    class Killed(Exception):
        pass

    def kill(position):
        raise Killed

    writer = SearchIndex.open(index_path, writable=True, model=tiny_model_dir)
    pending = write_incoming(index_path, [{"_id": f"k{i}", "text": f"killed upsert {i}"} for i in range(5)])
    with pytest.raises(Killed):
        writer.upsert(pending, config=IndexConfig(show_progress=False, chunk_size=2), on_chunk=kill)
    writer.close()
    stray = write_incoming(index_path, [{"_id": "never", "text": "never acknowledged"}])
    assert json.loads((index_path / "manifest.json").read_text())["job"]["input"] == str(pending)
    app = create_app(None, index_path, ServeConfig())
    index = app.state.server.index
    assert index.count == 17 and index.manifest["job"] is None
    assert [h.id for h in index.get(["k0", "k4", "never"])] == ["k0", "k4"]
    assert not pending.exists() and not stray.exists()


def test_http_upserts_under_concurrent_search_load_keep_every_answer_exact(served):
    """Searches running while documents are upserted each get exactly top_k hits; a document is found by the first
    search sent after its upsert was answered."""
    client, _ = served
    url = str(client.base_url)

    async def scenario():
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
            async def search():
                reply = await c.post("/search", json={"query": "a document", "top_k": 10})
                return len(reply.json()["hits"])

            async def upsert(i):
                reply = await c.post("/documents", json={"documents": [{"_id": f"live{i}", "text": f"unique{i} x"}]})
                assert reply.status_code == 200, reply.text
                found = (await c.post("/search", json={"query": f"unique{i}", "mode": "lexical", "top_k": 1})).json()
                return found["hits"][0]["id"]

            results = await asyncio.gather(*[search() for _ in range(12)], *[upsert(i) for i in range(3)])
            return results[:12], results[12:]

    counts, found = asyncio.run(scenario())
    assert counts == [10] * 12 and found == ["live0", "live1", "live2"]


# A real server process killed with SIGKILL in the middle of an HTTP upsert: the driver runs `create_app` +
# `running_server` (the code `robustir serve` runs) and only adds a pause point after the job's first commit, where it
# prints CHUNK and waits on stdin -- the test kills it there, so the kill lands mid-job every time (no timing).
KILL_DRIVER = """
import sys
from dataclasses import replace
from robustir.serving import ServeConfig, create_app, running_server
from robustir.index.store import SearchIndex

original = SearchIndex.upsert

def upsert(self, corpus, *, config=None, on_chunk=None, **more):
    def paused(position):
        print("CHUNK", position, flush=True)
        sys.stdin.readline()  # held here until the test kills this process
    return original(self, corpus, config=replace(config, chunk_size=2), on_chunk=paused, **more)

SearchIndex.upsert = upsert
app = create_app(None, sys.argv[1], ServeConfig(api_key="k"))
with running_server(app) as url:
    print("URL", url, flush=True)
    sys.stdin.readline()
"""


def test_a_server_process_killed_by_sigkill_mid_upsert_loses_nothing_and_half_applies_nothing(index_path, caplog):
    import queue
    import subprocess
    import threading

    proc = subprocess.Popen([sys.executable, "-c", KILL_DRIVER, str(index_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()

    def next_line(prefix: str) -> str:
        while True:
            line = lines.get(timeout=300)  # a hang guard only: the lines come as the server reaches them
            if line.startswith(prefix):
                return line.split()[1]

    reply: list = []
    try:
        url = next_line("URL")
        documents = [{"_id": f"k{i}", "text": f"an upsert killed by signal nine, record {i}"} for i in range(7)]

        def post() -> None:
            try:
                reply.append(httpx.post(f"{url}/documents", json={"documents": documents},
                                        headers={"Authorization": "Bearer k"}, timeout=300))
            except httpx.HTTPError as exc:  # the connection dies with the server: never acknowledged
                reply.append(exc)

        sender = threading.Thread(target=post)
        sender.start()
        assert next_line("CHUNK") == "2"  # the first 2 records are committed, 5 are not
        proc.kill()
        proc.wait(timeout=60)
        sender.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -9
    assert len(reply) == 1 and isinstance(reply[0], httpx.HTTPError)  # no answer: nothing was acknowledged
    manifest = json.loads((index_path / "manifest.json").read_text())
    pending = Path(manifest["job"]["input"])
    assert manifest["job"]["kind"] == "upsert" and pending.parent.name == "incoming" and pending.exists()
    import re

    with caplog.at_level("WARNING"), SearchIndex.open(index_path) as reader:  # served as it was before it, and
        assert reader.count == 12 and not reader.get(["k0"])  # told what is unfinished and how to finish it
    assert re.search("(?s)did not finish .after 2 input records.*start robustir serve on it", caplog.text)

    app = create_app(None, index_path, ServeConfig())  # the next start finishes the job before it serves
    index = app.state.server.index
    assert index.count == 19 and index.manifest["job"] is None
    assert [h.id for h in index.get([f"k{i}" for i in range(7)])] == [f"k{i}" for i in range(7)]
    assert not pending.exists() and not list((index_path / "incoming").glob("*.jsonl"))


# ------------------------------------------------------------------------------------------------ issue 51: costs

def test_a_search_compiles_its_filter_once_and_looks_at_the_manifest_once(served, monkeypatch):
    from robustir.index.store import lance_sql, storage

    client, _ = served
    compiles, looks = [], []
    to_sql, token = lance_sql.to_lance_sql, storage.LocalStore.token
    monkeypatch.setattr(lance_sql, "to_lance_sql", lambda *a, **k: compiles.append(1) or to_sql(*a, **k))
    monkeypatch.setattr(storage.LocalStore, "token",
                        lambda self, name: looks.append(name) or token(self, name))
    for mode in ("dense", "lexical", "hybrid"):
        compiles.clear(), looks.clear()
        reply = client.post("/search", json={"query": "stripes", "filter": {"lang": "en"}, "mode": mode})
        assert reply.status_code == 200, reply.text
        assert (len(compiles), looks) == (1, ["manifest.json"]), mode
    looks.clear()
    assert client.post("/search", json={"query": "stripes"}).status_code == 200
    assert looks == ["manifest.json"]


def test_an_http_write_hashes_only_the_files_it_wrote_and_parses_its_documents_once(served, index_path, monkeypatch):
    from robustir.index.store import records, runner, storage

    client, _ = served
    hashed, parsed = [], []
    sha256, read = storage.LocalStore.sha256, records._read_records
    monkeypatch.setattr(storage.LocalStore, "sha256", lambda self, name: hashed.append(name) or sha256(self, name))
    for module in (records, runner):  # the check before the job, and the job's own reading
        monkeypatch.setattr(module, "_read_records", lambda *a: parsed.append(a) or read(*a))
    before = set(json.loads((index_path / "manifest.json").read_text())["files"])
    reply = client.post("/documents", json={"documents": [{"_id": "n1", "text": "zebras have stripes"}]})
    assert reply.status_code == 200, reply.text
    assert hashed and not set(hashed) & before  # the job's own files only, none of the index's others
    assert len(parsed) == 1  # the spooled request read once (checked and kept), not again for the job
    hashed.clear()
    assert client.request("DELETE", "/documents", json={"ids": ["n1"]}).status_code == 200
    assert not set(hashed) & before


def test_an_http_write_reads_the_manifest_once_and_keeps_no_spool_file(served, index_path, monkeypatch):
    """Issue 51: the writer reads the manifest when it opens and reports whether its job is unfinished, so an HTTP
    upsert reads it no more (on S3 each read is a GET); a finished upsert leaves no file in incoming/."""
    from robustir.index.store import index as index_module, manifest, spool

    client, _ = served
    reads = []
    read = manifest._read_manifest
    for module in (manifest, index_module):
        monkeypatch.setattr(module, "_read_manifest", lambda store, *a: reads.append(a) or read(store, *a))
    reply = client.post("/documents", json={"documents": [{"_id": "m1", "text": "okapis have stripes too"}]})
    assert reply.status_code == 200, reply.text
    assert len(reads) == 1  # the writer's open; not again to finish a pending upsert, nor after the job
    assert not list((index_path / spool.INCOMING).glob("*.jsonl"))


# ------------------------------------------------------------------------------------------------ issue 55: upserts

def test_a_search_is_served_between_two_micro_batches_of_an_upsert(index_path):
    """Issue 55, item 1: an HTTP upsert encodes through the batcher in micro-batches (--ingest-batch-size), so a
    dense search that arrives while the upsert's first micro-batch is on the (only) model worker is encoded right
    after it, before the upsert's next one -- it used to wait for the whole job. The model is the real tiny one,
    held at the upsert's first micro-batch until the search's query is on the queue (events, no clock)."""
    import threading

    app = create_app(None, index_path, ServeConfig(workers=1, ingest_batch_size=2))
    server = app.state.server
    encoder, batcher = server.encoder, server.batcher
    calls: list[str] = []
    upserting, query_queued = threading.Event(), threading.Event()
    encode_ids, put = encoder.encode_ids, batcher._put

    def watched_encode(ids, **kwargs):  # the worker's model call: 1 row = the search's query, 2 = upsert documents
        calls.append("query" if len(ids) == 1 else "upsert")
        if calls.count("upsert") == 1 and len(ids) == 2:
            upserting.set()
            assert query_queued.wait(timeout=120)  # a hang guard only: released as soon as the search is queued
        return encode_ids(ids, **kwargs)

    def watched_put(kind, rows):
        item = put(kind, rows)
        if kind == batcher.EMBED:
            query_queued.set()
        return item

    encoder.encode_ids, batcher._put = watched_encode, watched_put
    documents = [{"_id": f"u{i}", "text": f"an upserted document about glaciers, number {i}"} for i in range(6)]
    replies: dict = {}
    with running_server(app) as url, httpx.Client(base_url=url, timeout=300) as client:
        writer = threading.Thread(target=lambda: replies.update(upsert=client.post(
            "/documents", json={"documents": documents})))
        writer.start()
        assert upserting.wait(timeout=120)
        replies["search"] = client.post("/search", json={"query": "glaciers", "top_k": 3})
        writer.join(timeout=300)
    assert replies["upsert"].status_code == 200 and replies["upsert"].json()["upserted"] == 6
    assert replies["search"].status_code == 200 and len(replies["search"].json()["hits"]) == 3
    assert calls == ["upsert", "query", "upsert", "upsert"]  # served between the upsert's micro-batches


def test_documents_bring_their_own_vectors_and_search_by_vector(served, index_path):
    """Issue 55, item 2: a document's "vector" is stored as its vector (not encoded, not a metadata field returned in
    hits); /search takes "vector" instead of "query" (dense only); dimensions and numbers are checked with a 400
    naming the document and field."""
    client, app = served
    dim = app.state.server.dim
    own = np.zeros(dim, dtype=np.float32)
    own[3] = 1.0  # a direction no encoded document points in exactly
    reply = client.post("/documents", json={"documents": [
        {"_id": "v1", "text": "a document whose vector the client made", "vector": own.tolist(), "lang": "en"},
        {"_id": "v2", "text": "an ordinary encoded document"}]})
    assert reply.status_code == 200, reply.text
    hits = client.post("/search", json={"vector": own.tolist(), "top_k": 3}).json()["hits"]
    assert hits[0]["id"] == "v1" and hits[0]["score"] == pytest.approx(1.0, abs=1e-5)
    assert hits[0]["fields"] == {"lang": "en"} and all("vector" not in h["fields"] for h in hits)
    assert client.get("/documents/v1").json()["fields"] == {"lang": "en"}
    text_hits = client.post("/search", json={"query": "an ordinary encoded document", "top_k": 1}).json()["hits"]
    by_vector = client.post("/search", json={"vector": [own.tolist(), own.tolist()], "top_k": 1}).json()["hits"]
    assert text_hits[0]["id"] == "v2" and [row[0]["id"] for row in by_vector] == ["v1", "v1"]
    filtered = client.post("/search", json={"vector": own.tolist(), "top_k": 5, "filter": {"lang": "en"}}).json()
    assert [h["id"] for h in filtered["hits"]][:1] == ["v1"]

    bad_documents = [({"_id": "w", "text": "t", "vector": own.tolist()[:-1]}, f"has {dim - 1} numbers"),
                     ({"_id": "w", "text": "t", "vector": [1.0] * (dim - 1) + ["x"]}, "not a finite number"),
                     ({"_id": "w", "text": "t", "vector": "0.1 0.2"}, "must be a non-empty list")]
    for document, words in bad_documents:
        reply = client.post("/documents", json={"documents": [{"_id": "ok", "text": "fine"}, document]})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "documents[1].vector", reply.text
        assert "'documents[1].vector'" in error["message"] and words in error["message"], error
    raw = '{"documents": [{"_id": "w", "text": "t", "vector": [NaN%s]}]}' % (", 0.0" * (dim - 1))
    reply = client.post("/documents", content=raw, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and "documents[0].vector" in reply.json()["error"]["message"], reply.text
    assert client.get("/documents/w").status_code == 404 and client.get("/documents/ok").status_code == 404

    bad_searches = [({"vector": own.tolist()[:5]}, "vector", "has 5 numbers"),
                    ({"vector": [own.tolist(), [1.0, 2.0]]}, "vector[1]", "has 2 numbers"),
                    ({"vector": own.tolist(), "mode": "hybrid"}, "mode", "dense only"),
                    ({"vector": own.tolist(), "rerank": True}, "rerank", "dense only"),
                    ({"vector": own.tolist(), "query": "both"}, None, "exactly one of 'query'"),
                    ({"top_k": 3}, "query", "'query' is required (or 'vector'"),
                    ({"vector": [True] * dim}, "vector[0]", "number")]
    for body, param, words in bad_searches:
        reply = client.post("/search", json=body)
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == param and words in error["message"], (body, reply.text)


def test_a_field_losing_its_typed_column_is_warned_about_in_the_log_and_the_metrics(served, caplog):
    """Issue 55, item 3: one document with a number in the string field ``lang`` moves every ``lang`` filter to the
    JSON column (slower); the index logs a warning naming the field, the document and the fix, and /metrics has
    robustir_index_untyped_fields{field="lang"} (absent before)."""
    import logging

    client, app = served
    assert "lang" in app.state.server.index.typed_columns
    assert 'robustir_index_untyped_fields{field="lang"' not in client.get("/metrics").text
    with caplog.at_level(logging.WARNING, logger="robustir.index.store"):
        reply = client.post("/documents", json={"documents": [{"_id": "odd", "text": "a number as lang", "lang": 7}]})
    assert reply.status_code == 200, reply.text
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "lost its typed" in
              r.getMessage()]
    assert len(warned) == 1 and "'lang'" in warned[0] and "'odd'" in warned[0] and "--overwrite" in warned[0]
    metrics = client.get("/metrics").text
    assert 'robustir_index_untyped_fields{field="lang",kind="string"} 1.0' in metrics
    assert 'robustir_ingest_documents_total{action="upsert"} 1.0' in metrics  # item 5: the write's own metrics
    assert 'robustir_ingest_seconds_count{action="upsert"} 1.0' in metrics
    assert "lang" not in app.state.server.index.typed_columns
    hits = client.post("/search", json={"query": "number", "filter": {"lang": 7}, "top_k": 3}).json()["hits"]
    assert [h["id"] for h in hits] == ["odd"]  # still exact, from the JSON column


def test_a_read_only_key_searches_but_may_not_write(index_path):
    """Issue 55, item 4: --read-api-key may search, embed and read documents; POST and DELETE /documents answer it
    403 naming the scope; the read-write key does both; no key or a wrong one is 401; a read key equal to the write
    key, or empty, is refused at start-up."""
    from robustir.errors import ConfigError

    app = create_app(None, index_path, ServeConfig(api_key="rw-key", read_api_key="ro-key"))
    with running_server(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        ro, rw = {"Authorization": "Bearer ro-key"}, {"Authorization": "Bearer rw-key"}
        assert client.post("/search", json={"query": "health"}, headers=ro).status_code == 200
        assert client.post("/v1/embeddings", json={"input": "health"}, headers=ro).status_code == 200
        assert client.get("/documents/d1", headers=ro).status_code == 200
        upsert = {"documents": [{"_id": "s1", "text": "scoped"}]}
        for method, body in (("POST", upsert), ("DELETE", {"ids": ["d1"]})):
            reply = client.request(method, "/documents", json=body, headers=ro)
            error = reply.json()["error"]
            assert reply.status_code == 403 and error["code"] == "insufficient_scope", reply.text
            assert "'write' scope" in error["message"] and "--api-key" in error["message"]
        assert client.get("/documents/s1", headers=rw).status_code == 404 and \
            client.get("/documents/d1", headers=rw).status_code == 200  # nothing was written
        assert client.post("/documents", json=upsert, headers=rw).status_code == 200
        assert client.request("DELETE", "/documents", json={"ids": ["s1"]}, headers=rw).status_code == 200
        assert client.post("/search", json={"query": "health"}).status_code == 401
        assert client.post("/documents", json=upsert, headers={"Authorization": "Bearer nope"}).status_code == 401
    for config, words in ((ServeConfig(api_key="same", read_api_key="same"), "same as api_key"),
                          (ServeConfig(read_api_key=" "), "read_api_key is empty")):
        with pytest.raises(ConfigError, match=words):
            config.validate()
    with pytest.raises(ConfigError, match="ROBUSTIR_READ_API_KEY is set but empty"):
        ServeConfig().resolved_read_api_key({"ROBUSTIR_READ_API_KEY": ""})


def test_vectors_too_long_for_float32_scores_are_refused_not_stored_as_infinity(served):
    """A vector is stored and searched in float32: a number past float32's range (1e39) became inf, and a vector of
    finite float32 numbers whose length is past 1e18 gives inner products that overflow. Both were accepted: the
    document was stored with an infinite vector, and every later search answered "score": Infinity, which is not JSON
    (any strict client failed on every search). Now a 400 names the document's field, or the query's vector."""
    client, app = served
    dim = app.state.server.dim

    def strict(reply):  # what a strict JSON client reads: Infinity and NaN are not JSON
        return json.loads(reply.text, parse_constant=lambda name: pytest.fail(f"{name} in the answer: {reply.text}"))

    for vector, words in (([1e39] + [0.0] * (dim - 1), "float32"), ([3e37] * dim, "length")):
        reply = client.post("/documents", json={"documents": [{"_id": "ok", "text": "fine"},
                                                               {"_id": "big", "text": "t", "vector": vector}]})
        error = strict(reply)["error"]
        assert reply.status_code == 400 and error["param"] == "documents[1].vector" and words in error["message"], \
            reply.text
        assert client.get("/documents/big").status_code == 404 and client.get("/documents/ok").status_code == 404
        reply = client.post("/search", json={"vector": vector, "top_k": 3})
        error = strict(reply)["error"]
        assert reply.status_code == 400 and error["param"] == "vector" and words in error["message"], reply.text
    reply = client.post("/search", json={"vector": [1e17] * dim, "top_k": 3})  # long, but its scores stay finite
    assert reply.status_code == 200 and len(strict(reply)["hits"]) == 3, reply.text
