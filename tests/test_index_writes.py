"""Issue 52: writes that fail or are interrupted lose nothing -- a job's record survives every other writer, paths in
it are absolute, a full disk answers with its cause and leaves the next write possible, what the index remembers of
its fields shrinks when documents go and is bounded per request, and HTTP documents with odd ids or text are answered
clearly."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_serving_index import write_corpus  # noqa: E402

from robustir.errors import ConfigError, DataError  # noqa: E402
from robustir.index.store import IndexConfig, SearchIndex  # noqa: E402
from robustir.serving import ServeConfig, create_app, running_server  # noqa: E402

KEY = "doc-key"
QUIET = IndexConfig(show_progress=False)


class Killed(Exception):
    """What a ``kill -9`` after a commit leaves, without a process: the job stops between two chunks."""


def kill_after_first_chunk(position):
    raise Killed


@pytest.fixture()
def index_path(tmp_path, tiny_model_dir) -> Path:
    corpus = write_corpus(tmp_path / "corpus.jsonl", n=12)
    SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=QUIET)[0].close()
    return tmp_path / "idx"


def manifest(index_path: Path) -> dict:
    return json.loads((index_path / "manifest.json").read_text())


def killed_job(index_path: Path, model: str, kind: str, records: list[dict], name: str = "more.jsonl") -> Path:
    corpus = index_path.parent / name
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    with SearchIndex.open(index_path, writable=True, model=model) as writer, pytest.raises(Killed):
        getattr(writer, kind)(corpus, config=IndexConfig(show_progress=False, chunk_size=2),
                              on_chunk=kill_after_first_chunk)
    return corpus


# ------------------------------------------------------------------------------------------------ item 1

def test_a_delete_or_compact_beside_an_unfinished_add_is_refused_and_the_job_survives(index_path, tiny_model_dir):
    """Before: the delete wrote its own job over the add's record and cleared it; the add's 2 committed documents
    stayed for good (a re-run said "duplicate id", --discard-unfinished found nothing)."""
    corpus = killed_job(index_path, tiny_model_dir, "add", [{"_id": f"n{i}", "text": f"new {i}"} for i in range(6)])
    job = manifest(index_path)["job"]
    assert job["kind"] == "add" and job["position"] == 2
    with SearchIndex.open(index_path, writable=True) as writer:
        for action in (lambda: writer.delete(["d0"]), writer.compact):
            with pytest.raises(ConfigError) as refused:
                action()
            message = str(refused.value)
            assert type(refused.value).__name__ == "UnfinishedJob"
            assert "unfinished add of " + str(corpus) in message and "--discard-unfinished" in message
            assert "Nothing was changed" in message
        assert writer.count == 14 and [h.id for h in writer.get(["d0"])] == ["d0"]
    assert manifest(index_path)["job"] == job  # the record is intact
    with SearchIndex.open(index_path, writable=True, model=tiny_model_dir) as writer:
        other = index_path.parent / "other.jsonl"
        other.write_text('{"_id": "o1", "text": "other"}\n')
        with pytest.raises(ConfigError, match="unfinished add of"):
            writer.upsert(other, config=QUIET)  # another job refuses beside it too
        assert writer.add(corpus, config=QUIET).added == 4  # the same command finishes it
        assert writer.delete(["n0"]).documents == 17


def test_discarding_an_unfinished_upsert_brings_back_what_it_replaced(index_path, tiny_model_dir):
    """Before: --discard-unfinished of an upsert only forgot the record ("no unfinished job") and half the upsert
    stayed; now Lance's version from before the job is restored."""
    with SearchIndex.open(index_path) as index:
        original = index.get(["d0", "d1"])
    killed_job(index_path, tiny_model_dir, "upsert",
               [{"_id": "d0", "text": "replaced zero"}, {"_id": "d1", "text": "replaced one"},
                {"_id": "u2", "text": "new two"}, {"_id": "u3", "text": "new three"}])
    with SearchIndex.open(index_path, writable=True) as writer:
        assert writer.get(["d0"])[0].text == "replaced zero"
        writer.discard_unfinished()
        assert [(h.id, h.text) for h in writer.get(["d0", "d1", "u2"])] == [(h.id, h.text) for h in original]
        assert writer.count == 12 and writer.manifest["job"] is None
    SearchIndex.open(index_path).check()


def test_an_http_delete_finishes_the_servers_own_unfinished_upsert_instead_of_erasing_it(index_path, monkeypatch):
    """Before: an upsert that answered 500 after its first commit left its job; any DELETE then erased the record
    and the half-written upsert stayed with no record. Now the next write finishes the upsert first."""
    from robustir.index.store import spool as ingest
    from robustir.index.store import SearchIndex as Index

    monkeypatch.setattr(ingest, "_quiet", lambda: IndexConfig(show_progress=False, chunk_size=2))
    original, calls = Index._commit, []

    def failing(self, job, records, *args, **kwargs):
        calls.append(job.kind)
        if len(calls) == 2:  # Lance's own words when a write hits the file-size limit (measured with ulimit -f)
            raise RuntimeError("lance error: LanceError(IO): File too large (os error 27), structural.rs:258:9")
        return original(self, job, records, *args, **kwargs)

    monkeypatch.setattr(Index, "_commit", failing)
    app = create_app(None, index_path, ServeConfig(api_key=KEY))
    with running_server(app) as url, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                                  timeout=120) as client:
        documents = [{"_id": f"h{i}", "text": f"http document {i}"} for i in range(5)]
        reply = client.post("/documents", json={"documents": documents})
        assert reply.status_code == 507, reply.text
        error = reply.json()["error"]
        assert "File too large" in error["message"] and error["code"] == "insufficient_storage"
        assert manifest(index_path)["job"]["kind"] == "upsert"  # kept: the next write finishes it
        assert client.post("/search", json={"query": "http document", "top_k": 3}).status_code == 200  # servable
        deleted = client.request("DELETE", "/documents", json={"ids": ["d0"]})
        assert deleted.status_code == 200, deleted.text
        assert deleted.json()["documents"] == 16  # 12 + the 5 of the finished upsert - d0
        assert [h["id"] for h in (client.get(f"/documents/h{i}").json() for i in range(5))] == \
            [f"h{i}" for i in range(5)]
        again = client.post("/documents", json={"documents": [{"_id": "z", "text": "one more"}]})
        assert again.status_code == 200, again.text  # before: 409 index_busy until a restart
    assert manifest(index_path)["job"] is None and not list((index_path / "incoming").glob("*.jsonl"))


def test_http_writes_beside_a_killed_cli_job_answer_409_naming_it(index_path, tiny_model_dir):
    app = create_app(None, index_path, ServeConfig(api_key=KEY))
    with running_server(app) as url, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                                  timeout=120) as client:
        corpus = killed_job(index_path, tiny_model_dir, "add", [{"_id": f"n{i}", "text": f"new {i}"} for i in range(6)])
        for reply in (client.request("DELETE", "/documents", json={"ids": ["d0"]}),
                      client.post("/documents", json={"documents": [{"_id": "z", "text": "zz"}]})):
            assert reply.status_code == 409 and reply.json()["error"]["code"] == "unfinished_job", reply.text
            assert str(corpus) in reply.json()["error"]["message"]
    assert manifest(index_path)["job"]["kind"] == "add"


# ------------------------------------------------------------------------------------------------ item 4

def test_job_inputs_are_absolute_so_a_restart_from_another_folder_finishes_a_killed_http_upsert(
        index_path, tiny_model_dir, monkeypatch, tmp_path):
    """Before: a server started with a relative --index recorded its spool file relatively; a restart from another
    working folder could not find it, deleted it as a stray, and then refused to start naming the file it deleted."""
    from robustir.index.store.spool import write_incoming

    monkeypatch.chdir(tmp_path)
    relative = Path("idx")
    pending = write_incoming(relative, [{"_id": f"k{i}", "text": f"killed upsert {i}"} for i in range(5)])
    with SearchIndex.open(relative, writable=True, model=tiny_model_dir) as writer, pytest.raises(Killed):
        writer.upsert(pending, config=IndexConfig(show_progress=False, chunk_size=2), on_chunk=kill_after_first_chunk)
    assert Path(manifest(index_path)["job"]["input"]).is_absolute()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    app = create_app(None, Path("..") / "idx", ServeConfig())
    index = app.state.server.index
    assert index.count == 17 and index.manifest["job"] is None
    assert [h.id for h in index.get([f"k{i}" for i in range(5)])] == [f"k{i}" for i in range(5)]


def test_a_cli_job_records_its_input_absolute_and_resumes_from_another_folder(index_path, tiny_model_dir,
                                                                             monkeypatch, tmp_path, caplog):
    monkeypatch.chdir(tmp_path)
    killed_job(Path("idx"), tiny_model_dir, "add", [{"_id": f"n{i}", "text": f"new {i}"} for i in range(6)])
    recorded = manifest(index_path)["job"]["input"]
    assert recorded == str(tmp_path / "more.jsonl")
    monkeypatch.chdir(tmp_path / "idx")
    with caplog.at_level("WARNING"), SearchIndex.open(".") as reader:  # served as it was before the add
        assert reader.count == 12
    assert "did not finish" in caplog.text and recorded in caplog.text  # the fix names a path that works from here
    with SearchIndex.open(".", writable=True, model=tiny_model_dir) as writer:
        assert writer.add(recorded, config=QUIET).added == 4 and writer.count == 18


# ------------------------------------------------------------------------------------------------ item 2

@pytest.fixture()
def served(index_path):
    app = create_app(None, index_path, ServeConfig(api_key=KEY, max_inputs_per_request=16))
    with running_server(app) as url, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                                  timeout=120) as client:
        yield client


def test_field_names_shrink_when_their_documents_go(served, index_path):
    """Before: 10 documents x 100 fresh keys left 1,000 field names (and their kinds) in the manifest for good."""
    client = served
    before = manifest(index_path)
    documents = [{"_id": f"w{i}", "text": f"wide {i}", **{f"k{i}_{j}": j for j in range(100)}} for i in range(10)]
    assert client.post("/documents", json={"documents": documents}).status_code == 200
    assert len(manifest(index_path)["fields"]) == len(before["fields"]) + 1000
    assert client.post("/search", json={"query": "wide", "filter": {"k3_7": 7}}).json()["hits"][0]["id"] == "w3"
    assert client.request("DELETE", "/documents", json={"ids": [f"w{i}" for i in range(10)]}).status_code == 200
    after = manifest(index_path)
    assert after["fields"] == before["fields"] and after["field_kinds"] == before["field_kinds"]
    # an upsert that replaces the only document holding a field drops it too; a field others hold stays
    assert client.post("/documents", json={"documents": [{"_id": "d0", "text": "x", "rare": 1}]}).status_code == 200
    assert "rare" in manifest(index_path)["fields"]
    assert client.post("/documents", json={"documents": [{"_id": "d0", "text": "y"}]}).status_code == 200
    assert "rare" not in manifest(index_path)["fields"] and "lang" in manifest(index_path)["fields"]
    reply = client.post("/search", json={"query": "x", "filter": {"rare": 1}})
    assert reply.status_code == 400 and "rare" in reply.json()["error"]["message"]


def test_an_upsert_holding_every_known_field_does_not_look_up_the_replaced_documents(served, index_path,
                                                                                      monkeypatch):
    """Issue 51: the lookup of the replaced documents' field names scans the id column; it is needed only when the
    upsert's documents lack a field the index knows (then that field may lose its last document)."""
    from robustir.index.store.writer import Writer

    looked = []
    real = Writer._names_of
    monkeypatch.setattr(Writer, "_names_of", lambda self, ids: looked.append(list(ids)) or real(self, ids))
    known, count = manifest(index_path)["fields"], manifest(index_path)["documents"]
    full = {"_id": "d0", "text": "every field", **{name: "x" for name in known}}
    assert served.post("/documents", json={"documents": [full]}).status_code == 200
    assert looked == [] and manifest(index_path)["fields"] == known
    assert manifest(index_path)["documents"] == count  # d0 replaced, not added twice
    assert served.post("/documents", json={"documents": [{"_id": "d1", "text": "no fields"}]}).status_code == 200
    assert looked == [["d1"]]


def test_a_request_or_a_job_with_absurd_numbers_of_field_names_is_refused_before_any_change(served, index_path,
                                                                                            tiny_model_dir):
    from robustir.index.store.known_fields import MAX_FIELDS

    client = served
    wide = {"_id": "w", "text": "wide", **{f"k{j}": j for j in range(MAX_FIELDS + 1)}}
    reply = client.post("/documents", json={"documents": [wide]})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "too_many_fields", reply.text
    assert str(MAX_FIELDS) in reply.json()["error"]["message"]
    corpus = index_path.parent / "wide.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"w{i}", "text": "t", **{f"f{i}_{j}": 1 for j in range(300)}}) + "\n"
                              for i in range(4)))
    with SearchIndex.open(index_path, writable=True, model=tiny_model_dir) as writer:
        with pytest.raises(DataError, match="more than the 1024 an index keeps"):
            writer.add(corpus, config=QUIET)
        assert writer.count == 12 and writer.manifest["job"] is None
    assert client.get("/documents/d0").status_code == 200


# ------------------------------------------------------------------------------------------------ item 5

def test_a_full_disk_while_spooling_answers_its_cause_and_the_next_write_goes_ahead(served, index_path,
                                                                                    monkeypatch):
    from robustir.index.store import spool as ingest

    real, failed = ingest.write_incoming, []

    def full(index, documents):
        if not failed:
            failed.append(1)
            raise OSError(errno.ENOSPC, "No space left on device", str(index_path / "incoming" / "x.jsonl"))
        return real(index, documents)

    monkeypatch.setattr(ingest, "write_incoming", full)
    reply = served.post("/documents", json={"documents": [{"_id": "s", "text": "spooled"}]})
    assert reply.status_code == 507 and "No space left on device" in reply.json()["error"]["message"], reply.text
    again = served.post("/documents", json={"documents": [{"_id": "s", "text": "spooled"}]})
    assert again.status_code == 200 and again.json()["documents"] == 13, again.text


def test_a_real_file_size_limit_in_a_subprocess_is_answered_with_its_cause(index_path, tmp_path):
    """``ulimit -f`` (RLIMIT_FSIZE) in a child process: Lance's write fails with EFBIG; the answer names it and the
    same process's next write (the limit lifted) goes ahead."""
    import subprocess

    driver = tmp_path / "driver.py"
    driver.write_text(FSIZE_DRIVER)
    done = subprocess.run([sys.executable, str(driver), str(index_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    first, second = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert first["status"] == 507 and "File too large" in first["message"], first
    assert second["status"] == 200, second


FSIZE_DRIVER = """
import json, resource, sys
from fastapi.testclient import TestClient
from robustir.serving import ServeConfig, create_app

app = create_app(None, sys.argv[1], ServeConfig())
documents = [{"_id": f"f{i}", "text": "a document written past the file-size limit " * 20} for i in range(16)]
with TestClient(app) as client:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # Python ignores SIGXFSZ: writes fail with EFBIG
    reply = client.post("/documents", json={"documents": documents})
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    print(json.dumps({"status": reply.status_code, "message": reply.json().get("error", {}).get("message", "")}))
    reply = client.post("/documents", json={"documents": documents})
    print(json.dumps({"status": reply.status_code, "message": reply.text[:300]}))
"""


# ------------------------------------------------------------------------------------------------ items 6 and 9

@pytest.mark.parametrize("document, param", [
    ('{"_id": "a", "text": "bad \\ud800 text"}', "documents[0].text"),
    ('{"_id": "bad\\udc00id", "text": "t"}', "documents[0]._id"),
    ('{"_id": "a", "text": "t", "f\\ud83d": 1}', "documents[0] (a field name)"),
    ('{"_id": "a", "text": "t", "meta": {"tags": ["ok", "\\udfff"]}}', "documents[0].meta.tags[1]"),
])
def test_a_lone_surrogate_anywhere_in_a_document_is_a_clear_400(served, document, param):
    reply = served.post("/documents", content='{"documents": [' + document + ']}',
                        headers={"Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text  # before: 500 (UnicodeEncodeError writing the spool file)
    error = reply.json()["error"]
    assert error["code"] == "invalid_unicode" and error["param"] == param and "surrogate" in error["message"]


def test_ids_with_a_slash_are_read_back_and_a_nul_id_is_a_clear_400(served):
    assert served.post("/documents", json={"documents": [{"_id": "a/b/c", "text": "slashed"}]}).status_code == 200
    got = served.get("/documents/a/b/c")
    assert got.status_code == 200 and got.json()["id"] == "a/b/c", got.text  # before: 404 "no such route"
    assert served.get("/documents/a%2Fb%2Fc").json()["id"] == "a/b/c"
    assert served.get("/documents/a/b").status_code == 404
    nul = served.get("/documents/%00")
    assert nul.status_code == 400 and nul.json()["error"]["param"] == "document_id", nul.text  # before: 500
    assert served.request("DELETE", "/documents", json={"ids": ["a/b/c"]}).json()["deleted"] == 1


def test_the_field_kind_check_accepts_tests_under_not_and_never_suggests_null(served, index_path):
    negated = served.post("/search", json={"query": "a study", "top_k": 12, "filter": {"$not": {"lang": 5}}})
    assert negated.status_code == 200 and len(negated.json()["hits"]) == 12, negated.text  # before: 400
    assert served.post("/documents", json={"documents": [{"_id": "n", "text": "t", "lang": None}]}).status_code == 200
    wrong = served.post("/search", json={"query": "a study", "filter": {"lang": 5}})
    message = wrong.json()["error"]["message"]
    assert wrong.status_code == 400 and "compare it with a string value" in message, message  # before: "a null"
    from robustir.index.store.filters import parse_filter
    from robustir.index.store.lance_sql import check_kinds

    only_null = parse_filter({"gone": "x"}, ["gone"])
    with pytest.raises(ConfigError, match="holds only null values .*\\$exists"):
        check_kinds(only_null, {"gone": ["null"]})


def test_the_cli_past_a_file_size_limit_names_the_cause_and_resumes_when_run_again(index_path, tmp_path):
    """``ulimit -f`` on ``robustir index --add``: before, Lance's ``RuntimeError`` was a traceback; now the command
    ends with exit 2 naming "File too large", and the same command without the limit finishes the job."""
    import os
    import resource
    import subprocess

    corpus = tmp_path / "big.jsonl"
    words = [f"w{(i * 7919 + j * 104729) % 100003:x}" for i in range(40) for j in range(80)]  # not compressible
    corpus.write_text("".join(json.dumps({"_id": f"b{i}", "text": " ".join(words[i * 80:(i + 1) * 80])}) + "\n"
                              for i in range(40)))
    command = [sys.executable, "-m", "robustir.cli.main", "index", "--add", str(corpus), "--output", str(index_path),
               "--chunk-size", "16"]
    env = {**os.environ, "TQDM_DISABLE": "1"}

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    done = subprocess.run(command, capture_output=True, text=True, env=env, preexec_fn=limit, timeout=600)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "File too large" in done.stderr and "robustir index: error:" in done.stderr, done.stderr[-2000:]
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0 and "52 documents" in again.stdout, again.stdout + again.stderr[-2000:]
