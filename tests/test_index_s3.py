"""Issue 37: the search index on object storage (``s3://``; :mod:`robustir.index.store.storage`), against a local S3
endpoint -- moto's server on 127.0.0.1 -- so nothing leaves the machine: the same hits as a local index, one writer
at a time through a conditional-put lease (two writers racing, a killed writer's lease taken over once it expired,
a writer that lost its lease stopping before its next commit), readers that follow writers, ``robustir serve`` and
``eval --search-index`` on ``s3://``, and the errors a user meets. Skipped without moto's server and boto3
(``robustir[dev]`` brings both); the fragment count needs pylance (``robustir[scale]``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from extras import needs, require  # noqa: E402  (tests/ is on sys.path)

require("boto3", "moto.server", extra="dev")  # moto[server] brings boto3

from robustir.errors import ConfigError, DataError  # noqa: E402
from robustir.index.store import IndexConfig, SearchIndex  # noqa: E402
from robustir.index.store.s3 import LEASE_TTL_S, S3Store  # noqa: E402
from robustir.index.store.storage import parse_storage_options  # noqa: E402
from robustir.index.store.stores import open_store  # noqa: E402
from test_serving_index import TOPICS, write_corpus  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.usefixtures("single_torch_thread")

BUCKET = "robustir-test"


@pytest.fixture(scope="module")
def endpoint():
    """moto's S3 server in a thread on 127.0.0.1 (a free port), with one bucket."""
    from helpers import moto_s3

    with moto_s3(BUCKET) as url:
        yield url


@pytest.fixture()
def options(endpoint) -> dict:
    return {"aws_endpoint": endpoint, "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
            "aws_region": "us-east-1"}


@pytest.fixture()
def location(request) -> str:
    return f"s3://{BUCKET}/{request.node.name[:60]}"


def quiet(**kwargs) -> IndexConfig:
    return IndexConfig(show_progress=False, **kwargs)


def build(location: str, model: str, corpus: Path, options: dict) -> None:
    """A finished index of ``corpus`` at ``location`` (the writer closed)."""
    SearchIndex.build(location, model, corpus, config=quiet(), storage_options=options)[0].close()


def hits(index: SearchIndex, queries: list[str], **kwargs) -> list[list[tuple[str, float]]]:
    return [[(h.id, round(h.score, 5)) for h in found] for found in index.search(queries, **kwargs)]


class Clock:
    """An injected clock for leases (seconds)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def store(location: str, options: dict, clock: Clock, **kwargs) -> S3Store:
    return S3Store(location, options, clock=clock, heartbeat=False, **kwargs)


# ------------------------------------------------------------------------------------------------ same as local

@needs("lance", extra="scale")  # counts the table's fragments through pylance (LanceDB alone has no such call)
def test_an_index_on_s3_searches_as_the_same_index_in_a_folder(tmp_path, tiny_model_dir, options, location):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    remote, report = SearchIndex.build(location, tiny_model_dir, corpus, config=quiet(chunk_size=10),
                                       storage_options=options)
    remote.close()
    local, _ = SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=quiet(chunk_size=10))
    local.close()
    assert report.added == 24
    queries = ["coffee and health", "sleep study 3", "vitamin"]
    with SearchIndex.open(location, storage_options=options) as on_s3, SearchIndex.open(tmp_path / "idx") as here:
        for mode in ("dense", "lexical", "hybrid"):
            assert hits(on_s3, queries, top_k=5, mode=mode) == hits(here, queries, top_k=5, mode=mode)
        assert hits(on_s3, queries, top_k=4, filter={"lang": "de"}) == hits(here, queries, top_k=4,
                                                                           filter={"lang": "de"})
        assert on_s3.count == 24 and str(on_s3.path) == location
        # a build on S3 ends with its chunks' fragments merged (a search costs requests per fragment there)
        assert len(on_s3._table.to_lance().get_fragments()) == 1 < len(here._table.to_lance().get_fragments())
        files = on_s3.manifest["files"]
        assert files and all("etag" in meta and "sha256" not in meta for meta in files.values())
        assert "24 documents" in on_s3.check()
    # the same build again: nothing to do; another corpus: refused naming it (the one "done?" rule)
    again, report = SearchIndex.build(location, tiny_model_dir, corpus, config=quiet(), storage_options=options)
    again.close()
    assert report.nothing_to_do
    with pytest.raises(ConfigError, match="other settings or inputs"):
        SearchIndex.build(location, tiny_model_dir, write_corpus(tmp_path / "other.jsonl", n=5), config=quiet(),
                          storage_options=options)


def test_credentials_and_endpoint_from_the_environment_alone(tmp_path, tiny_model_dir, endpoint, location,
                                                             monkeypatch):
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(key, value)
    index, report = SearchIndex.build(location, tiny_model_dir, write_corpus(tmp_path / "c.jsonl", n=6),
                                      config=quiet())
    index.close()
    with SearchIndex.open(location) as reader:
        assert reader.count == 6 and reader.search("coffee", top_k=1, mode="lexical")[0][0].id == "d1"


# ------------------------------------------------------------------------------------------------ writers and readers

def test_two_writers_racing_one_wins_the_lease_and_a_reader_follows_both(tmp_path, tiny_model_dir, options,
                                                                        location):
    build(location, tiny_model_dir, write_corpus(tmp_path / "base.jsonl", n=8), options)
    reader = SearchIndex.open(location, storage_options=options)
    assert reader.count == 8
    for round_ in range(3):  # two writers (each its own client, as on two machines) ask at the same instant
        gate, outcome = threading.Barrier(2), {}

        def writer(name: str) -> None:
            gate.wait()
            try:
                outcome[name] = SearchIndex.open(location, writable=True, storage_options=options)
            except ConfigError as exc:
                outcome[name] = exc

        threads = [threading.Thread(target=writer, args=(name,)) for name in "ab"]
        [t.start() for t in threads]
        [t.join() for t in threads]
        winners = [name for name, got in outcome.items() if isinstance(got, SearchIndex)]
        assert len(winners) == 1, outcome
        loser = "b" if winners[0] == "a" else "a"
        assert "being changed by another process" in str(outcome[loser])
        first = outcome[winners[0]]
        first.add(write_corpus(tmp_path / f"w{round_}.jsonl", n=3, start=100 + 10 * round_, prefix="w"),
                  config=quiet())
        assert reader.count == 8 + 3 * round_ + 3  # the reader follows without reopening
        first.close()
        second = SearchIndex.open(location, writable=True, storage_options=options)  # free again
        second.upsert(write_corpus(tmp_path / f"u{round_}.jsonl", n=1, start=round_), config=quiet())  # d<round>
        second.close()
    assert reader.count == 8 + 9
    assert reader.get(["w100", "w121"])[1].id == "w121"
    assert reader.search("sleep", top_k=1, mode="lexical", filter={"lang": "en"})[0][0].id in ("d0", "d24")
    reader.close()
    assert "17 documents" in SearchIndex.open(location, storage_options=options).check()


def test_a_dead_writers_lease_is_taken_over_once_it_expired_and_the_first_writer_stops(tmp_path, tiny_model_dir,
                                                                                        options, location):
    build(location, tiny_model_dir, write_corpus(tmp_path / "base.jsonl", n=4), options)
    clock = Clock()
    frozen = SearchIndex.open(store(location, options, clock), writable=True)  # then "freezes": never renews
    reader_store = store(location, options, clock)
    assert reader_store.writer_running()
    with pytest.raises(ConfigError, match=r"its lease runs 60 s more"):
        SearchIndex.open(store(location, options, clock), writable=True)
    clock.now += LEASE_TTL_S + 1  # its lease expired: a reader no longer counts it, a writer takes over
    assert not reader_store.writer_running()
    taker = SearchIndex.open(store(location, options, clock), writable=True)
    taker.add(write_corpus(tmp_path / "new.jsonl", n=2, start=50), config=quiet())
    # the frozen writer wakes up: it finds its lease lost before it commits anything
    with pytest.raises(ConfigError, match="lost its writer lease"):
        frozen.add(write_corpus(tmp_path / "late.jsonl", n=2, start=70), config=quiet())
    frozen.close()  # does not delete the taker's lease (If-Match on its own ETag)
    assert reader_store.writer_running()
    taker.close()
    assert not reader_store.writer_running()
    with SearchIndex.open(location, storage_options=options) as reader:
        assert reader.count == 6 and not reader.get(["d70", "d71"])


def test_a_writer_renewing_keeps_its_lease_and_one_that_cannot_loses_it(options, location):
    clock = Clock()
    holder = store(location, options, clock, lease_ttl=30)
    lease = holder.lock()
    clock.now += 25
    assert lease.renew()
    clock.now += 25  # 50 s after it was taken, 25 after the renewal: still held
    lease.check()
    with pytest.raises(ConfigError, match="another process"):
        store(location, options, clock, lease_ttl=30).lock()
    clock.now += 10  # past the renewed expiry without renewing: lost, even though nobody took it
    with pytest.raises(ConfigError, match="expired before it could be renewed"):
        lease.check()
    lease.release()
    store(location, options, clock).lock().release()


def test_a_build_killed_mid_job_is_refused_then_resumed_after_the_lease_expired(tmp_path, tiny_model_dir, options,
                                                                                location):
    """kill -9 of a writer process on another 'machine' (a subprocess with its own client) after its first chunk."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", n=30)
    script = tmp_path / "writer.py"
    script.write_text(
        "import os, signal, sys\n"
        "from robustir.index.store import IndexConfig, SearchIndex\n"
        "def chunk(position):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        f"SearchIndex.build({location!r}, {tiny_model_dir!r}, {str(corpus)!r}, "
        f"config=IndexConfig(show_progress=False, chunk_size=10), on_chunk=chunk, storage_options={options!r})\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    clock = Clock(now=__import__("time").time())  # the killed writer's lease was written with the real clock
    with pytest.raises(ConfigError, match="being changed by another process"):  # its lease still runs
        SearchIndex.build(store(location, options, clock), tiny_model_dir, corpus, config=quiet(chunk_size=10))
    reader_store = store(location, options, clock)
    with SearchIndex.open(reader_store) as reader:  # a live writer's first build: nothing served until complete
        assert reader.count == 0  # (issue 53, item 7: it served the 10 committed rows)
    clock.now += LEASE_TTL_S + 1
    with pytest.raises(DataError, match="no process is working on it"):
        SearchIndex.open(reader_store)
    index, report = SearchIndex.build(store(location, options, clock), tiny_model_dir, corpus,
                                      config=quiet(chunk_size=10))
    index.close()
    assert report.resumed_from == 10 and report.documents == 30
    with SearchIndex.open(location, storage_options=options) as reader:
        ids = reader._table.search().select(["id"]).limit(100).to_arrow().column("id").to_pylist()
        assert sorted(ids) == sorted(f"d{i}" for i in range(30))  # every document exactly once
        assert "30 documents" in reader.check()


def test_a_first_build_on_s3_is_served_only_once_complete(tmp_path, tiny_model_dir, options, location):
    """Issue 53, item 7: while the first build runs, a reader (another replica's client) sees no document -- never
    10 of 30 -- and it follows the build's end to all 30."""
    seen, readers = [], []

    def during(position):
        if position == 10:
            readers.append(SearchIndex.open(location, storage_options=options))
            seen.append((readers[0].count, readers[0].search_vectors(np.ones(32, np.float32), top_k=3)[0]))

    SearchIndex.build(location, tiny_model_dir, write_corpus(tmp_path / "corpus.jsonl", n=30),
                      config=quiet(chunk_size=10), on_chunk=during, storage_options=options)[0].close()
    assert seen == [(0, [])]
    assert readers[0].count == 30
    readers[0].close()


def test_a_replica_starts_on_the_last_complete_state_while_a_dead_writers_add_waits(tmp_path, tiny_model_dir,
                                                                                   options, location):
    """Issue 53, item 7: a writer dies after the first committed chunk of an add; once its lease expired a new replica
    starts (it was refused: "no process is working on it") and serves the index as it was before the add, while the
    add waits; resumed by the next writer, the replica follows it to the whole add."""
    build(location, tiny_model_dir, write_corpus(tmp_path / "base.jsonl", n=6), options)
    clock = Clock()
    more = write_corpus(tmp_path / "more.jsonl", n=8, start=100, prefix="n")
    dying = SearchIndex.open(store(location, options, clock), writable=True)

    def die(position):
        if position == 5:
            raise KeyboardInterrupt  # the process is gone: its lease stays until it expires

    with pytest.raises(KeyboardInterrupt):
        dying.add(more, config=quiet(chunk_size=5), on_chunk=die)
    clock.now += LEASE_TTL_S + 1
    assert not store(location, options, clock).writer_running()
    with SearchIndex.open(store(location, options, clock)) as replica:
        assert replica.count == 6 and not replica.get(["n100"])
        assert replica.manifest["job"]["position"] == 5  # the add waits, its record kept
        with SearchIndex.open(store(location, options, clock), writable=True) as writer:
            assert writer.add(more, config=quiet(chunk_size=5)).resumed_from == 5
        assert replica.count == 14 and replica.get(["n107"])[0].id == "n107"


def test_a_rebuild_on_s3_is_swapped_in_while_a_reader_serves_the_old_index(tmp_path, tiny_model_dir, options,
                                                                           location):
    build(location, tiny_model_dir, write_corpus(tmp_path / "a.jsonl", n=5), options)
    reader = SearchIndex.open(location, storage_options=options)
    assert reader.count == 5
    index, report = SearchIndex.build(location, tiny_model_dir, write_corpus(tmp_path / "b.jsonl", n=7, prefix="b"),
                                      config=quiet(), overwrite=True, storage_options=options)
    index.close()
    assert reader.count == 7 and reader.get(["b3"])[0].id == "b3"
    assert reader.manifest["data"] == "lance.1"
    assert not S3Store(location, options).exists("building.json")
    reader.close()


# ------------------------------------------------------------------------------------------------ damage and errors

def test_a_rewritten_data_object_is_refused_by_its_etag(tmp_path, tiny_model_dir, options, location):
    import boto3

    build(location, tiny_model_dir, write_corpus(tmp_path / "c.jsonl", n=6), options)
    s3 = S3Store(location, options)
    name = next(n for n in s3.listing("lance") if "/data/" in n)
    client = boto3.client("s3", endpoint_url=options["aws_endpoint"], aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    key = s3.key(name)
    body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    client.put_object(Bucket=BUCKET, Key=key, Body=body[:-1] + bytes([body[-1] ^ 1]))  # same size, one bit
    with pytest.raises(DataError, match="ETag differs"):
        SearchIndex.open(location, storage_options=options)
    client.delete_object(Bucket=BUCKET, Key=key)
    with pytest.raises(DataError, match="is missing"):
        SearchIndex.open(location, storage_options=options)


def test_bad_locations_and_options_get_clear_errors(tmp_path, tiny_model_dir, options, endpoint):
    with pytest.raises(ConfigError, match="s3://BUCKET/PREFIX"):
        open_store(f"s3://{BUCKET}", options)
    with pytest.raises(ConfigError, match="'..' part"):
        open_store(f"s3://{BUCKET}/a/../b", options)
    with pytest.raises(ConfigError, match="gs:// is not supported"):
        open_store("gs://bucket/idx")
    with pytest.raises(ConfigError, match="goes with an object-store index"):
        open_store(tmp_path / "idx", {"aws_region": "x"})
    with pytest.raises(ConfigError, match="'aws_regoin' is not an S3 object-store option"):
        open_store(f"s3://{BUCKET}/x", {**options, "aws_regoin": "eu"})
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_storage_options(["aws_region"])
    assert parse_storage_options(["allow_http=true", "aws_region=eu-west-1"]) == {"allow_http": "true",
                                                                                   "aws_region": "eu-west-1"}
    with pytest.raises(ConfigError, match="create the bucket no-such-bucket"):
        SearchIndex.open("s3://no-such-bucket/idx", storage_options=options)
    with pytest.raises(DataError, match="no index here"):
        SearchIndex.open(f"s3://{BUCKET}/nothing-here", storage_options=options)
    wrong = {**options, "aws_access_key_id": "nobody", "aws_secret_access_key": "wrong"}
    # moto accepts any key unless IAM is on; a real store answers InvalidAccessKeyId, turned into a ConfigError
    # by the same path as NoSuchBucket above
    with pytest.raises(DataError, match="no index here"):
        SearchIndex.open(f"s3://{BUCKET}/nothing-here", storage_options=wrong)


# ------------------------------------------------------------------------------------------------ serve, eval, CLI

def test_serve_on_s3_answers_search_as_on_a_local_copy_and_takes_http_upserts(tmp_path, tiny_model_dir, options,
                                                                            location, monkeypatch):
    import httpx

    from robustir.serving import ServeConfig, create_app, running_server

    monkeypatch.setenv("ROBUSTIR_CACHE", str(tmp_path / "cache"))  # where HTTP upserts of an S3 index are spooled
    corpus = write_corpus(tmp_path / "corpus.jsonl", n=16)
    SearchIndex.build(location, tiny_model_dir, corpus, config=quiet(), storage_options=options)[0].close()
    SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=quiet())[0].close()
    body = {"query": ["coffee and health", "memory"], "top_k": 5, "mode": "hybrid"}
    answers = []
    for index, storage in ((location, options), (tmp_path / "idx", None)):
        app = create_app(None, index, ServeConfig(), storage_options=storage)
        with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
            reply = client.post("/search", json=body)
            assert reply.status_code == 200, reply.text
            answers.append(reply.json())
            if storage is not None:  # a replica: a second server on the same table sees the first one's upsert
                other = create_app(None, location, ServeConfig(), storage_options=storage)
                with running_server(other) as url2, httpx.Client(base_url=url2, timeout=60) as client2:
                    added = client.post("/documents", json={"documents": [{"_id": "new", "text": "kombucha"}]})
                    assert added.status_code == 200, added.text
                    assert client2.get("/documents/new").json()["id"] == "new"
                    assert client2.post("/search", json={"query": "kombucha", "top_k": 1, "mode": "lexical"}
                                        ).json()["hits"][0]["id"] == "new"
    ranked = [[[(h["id"], round(h["score"], 5)) for h in row] for row in answer["hits"]] for answer in answers]
    assert ranked[0] == ranked[1] and len(ranked[0][0]) == 5
    assert not list((tmp_path / "cache").rglob("*.jsonl"))  # the spooled upsert is gone once committed


def test_cli_index_check_and_eval_on_s3(tmp_path, tiny_model_dir, options, location, capsys):
    from robustir.cli.main import main

    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    write_corpus(beir / "corpus.jsonl", n=8)
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": f"{TOPICS[i]} and health"})
                                                + "\n" for i in range(4)), encoding="utf-8")
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n"
                                                                                     for i in range(4)))
    flags = [x for key, value in options.items() for x in ("--storage-option", f"{key}={value}")]
    assert main(["index", "--corpus", str(beir), "--output", location, "--model", tiny_model_dir,
                 "--no-show-progress", *flags]) == 0
    assert main(["index", "--check", "--output", location, *flags]) == 0
    assert "8 documents, " in capsys.readouterr().out
    assert main(["eval", "--data", str(beir), "--search-index", location, *flags]) == 0
    assert "ndcg" in capsys.readouterr().out.lower()
    assert main(["index", "--check", "--output", location, "--storage-option", "aws_regoin=x"]) == 2
    assert "aws_regoin" in capsys.readouterr().err


def test_a_reader_with_refresh_s_checks_for_commits_at_most_that_often(tmp_path, tiny_model_dir, options, location):
    build(location, tiny_model_dir, write_corpus(tmp_path / "a.jsonl", n=4), options)
    lazy = SearchIndex.open(location, storage_options=options, refresh_s=3600)
    eager = SearchIndex.open(location, storage_options=options)
    assert lazy.count == eager.count == 4
    with SearchIndex.open(location, writable=True, storage_options=options) as writer:
        writer.add(write_corpus(tmp_path / "b.jsonl", n=2, start=10), config=quiet())
    assert eager.count == 6
    assert lazy.count == 4  # its last check was less than an hour ago
    lazy.close()
    eager.close()
    with pytest.raises(ConfigError, match="refresh_s"):
        SearchIndex.open(location, storage_options=options, refresh_s=-1)


def test_a_damaged_manifest_or_lease_object_is_refused_or_taken_over(tmp_path, tiny_model_dir, options, location):
    build(location, tiny_model_dir, write_corpus(tmp_path / "a.jsonl", n=3), options)
    s3 = S3Store(location, options)
    good = s3.read_text("manifest.json")
    s3.write_text("writer.lock", "not json")  # an unreadable lease counts as expired: taken over, with a warning
    with SearchIndex.open(location, writable=True, storage_options=options) as writer:
        assert json.loads(s3.read_text("writer.lock"))["owner"] == writer._lock.owner
    assert not s3.exists("writer.lock")
    s3.client.put_object(Bucket=BUCKET, Key=s3.key("manifest.json"), Body=b"\xff\xfe{")
    with pytest.raises(DataError, match="manifest.json.*not UTF-8|manifest.json.*cannot be read"):
        SearchIndex.open(location, storage_options=options)
    s3.write_text("manifest.json", good.replace('"documents": 3', '"documents": 4'))
    with pytest.raises(DataError, match="was edited after robustir wrote it"):
        SearchIndex.open(location, storage_options=options)
    s3.write_text("manifest.json", good)
    with SearchIndex.open(location, storage_options=options) as reader:
        assert reader.count == 3


def test_delete_and_compact_on_s3_keep_the_index_verifiable(tmp_path, tiny_model_dir, options, location, capsys):
    from robustir.cli.main import main

    build(location, tiny_model_dir, write_corpus(tmp_path / "a.jsonl", n=10), options)
    flags = [x for key, value in options.items() for x in ("--storage-option", f"{key}={value}")]
    assert main(["index", "--delete-id", "d3", "--delete-id", "d4", "--output", location, *flags]) == 0
    assert main(["index", "--compact", "--output", location, *flags]) == 0
    assert "compact: 8 documents" in capsys.readouterr().out
    with SearchIndex.open(location, storage_options=options) as reader:
        assert reader.count == 8 and not reader.get(["d3", "d4"]) and "8 documents" in reader.check()
        assert reader.search("coffee", top_k=1, mode="lexical")[0][0].id in ("d1", "d9")


def test_a_bucket_deleted_during_a_build_is_a_clear_error(tmp_path, tiny_model_dir, endpoint, options, capsys):
    """Issue 52 item 7: the bucket goes away while a build writes to it. Lance's ``RuntimeError: Not found:
    .../_versions`` is raised as the error it is -- not found, naming the index and what probably happened -- and
    the CLI answers it in one line, never a traceback."""
    import boto3

    bucket = boto3.resource("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1").Bucket("robustir-gone")
    corpus = write_corpus(tmp_path / "corpus.jsonl")

    def delete_the_bucket(position: int) -> None:
        bucket.objects.all().delete()
        bucket.delete()

    bucket.create()
    location = "s3://robustir-gone/idx"
    if True:
        with pytest.raises((OSError, DataError, ConfigError)) as info:
            SearchIndex.build(location, tiny_model_dir, corpus, config=quiet(chunk_size=10), storage_options=options,
                              on_chunk=delete_the_bucket)
        assert not isinstance(info.value, RuntimeError)
        assert "robustir-gone" in str(info.value) and "deleted" in str(info.value), str(info.value)
