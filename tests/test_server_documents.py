"""Issue 36: documents in and out of a served index over HTTP -- POST /documents (upsert), DELETE /documents (ids or a
filter), GET /documents/{id} -- through the same writer, lock and jobs as ``robustir index``."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

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
    for document, param in (({"_id": "n", "text": "t", "score": float("nan")}, "documents[0]"),  # the index's checks
                            ({"_id": "bad\u0000id", "text": "t"}, "documents[0]")):
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

def upsert(self, corpus, *, config=None, on_chunk=None):
    def paused(position):
        print("CHUNK", position, flush=True)
        sys.stdin.readline()  # held here until the test kills this process
    return original(self, corpus, config=replace(config, chunk_size=2), on_chunk=paused)

SearchIndex.upsert = upsert
app = create_app(None, sys.argv[1], ServeConfig(api_key="k"))
with running_server(app) as url:
    print("URL", url, flush=True)
    sys.stdin.readline()
"""


def test_a_server_process_killed_by_sigkill_mid_upsert_loses_nothing_and_half_applies_nothing(index_path):
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
    from robustir.errors import DataError

    with pytest.raises(DataError, match="(?s)did not finish .after 2 input records.*start robustir serve on it"):
        SearchIndex.open(index_path)  # a plain reader is told what is unfinished and how to finish it

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
