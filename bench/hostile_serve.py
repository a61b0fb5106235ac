"""Issue 55's cases for the hostile campaign (bench/hostile_campaign.py): the server surfaces issue 55 added --
bring-your-own vectors on ``POST /documents``, ``/search`` by vector, scoped keys (``--read-api-key``), rerank by name
and its pair budget, the typed-column warning, ``/v1/models`` -- and the micro-batched upsert under a real
``robustir serve`` process: ``kill -9`` mid-upsert then a restart, a client that leaves mid-upsert, 429s while an
upsert's micro-batches queue, a read key racing a write, two upserts of the same ids at once.

    python bench/hostile_campaign.py --only '^s55-'      # these cases only

Most cases use bench/hostile_writes.py's in-process ``http`` driver (``--config`` for the server's settings). The
``serve SCENARIO INDEX`` driver (:func:`scenario`) starts ``robustir serve`` on 127.0.0.1 as a child process, runs
the scenario against it with httpx and prints ``PROBLEM: ...`` for each harm it sees (lost, duplicated or
half-written documents, a 5xx, a refusal without its reason); the case's check turns those into the campaign's
outcome.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

W, R = "campaign-write-key-0123", "campaign-read-key-0123"  # the scoped keys of the key cases
DIM = 32  # the campaign's tiny model's dimension


def cases(hc) -> list:
    """The cases, built with the campaign module ``hc``."""
    c: list = []
    add = c.append
    n = "serve55"
    idx = "{out}/idx"
    made = [["@copytree", "{idx55}", idx]]  # the campaign's index (hc.IDX), built once with the fixtures

    def http(*steps: dict, config: dict | None = None) -> list[str]:
        return ["http", *(["--config", json.dumps(config)] if config else []), idx, *(json.dumps(s) for s in steps)]

    def D(id, argv, msg=None, **kw):  # bad input: a clear error
        return hc.Case(id, n, argv, "error", msg, program="driver", **{"setup": made, **kw})

    def DOK(id, argv, check=None, **kw):  # valid input, or a harm the check looks for
        return hc.Case(id, n, argv, "ok", check=check, program="driver", **{"setup": made, "protect_setup": False,
                                                                          **kw})

    def says(*words: str):
        def check(out: Path, text: str) -> str | None:
            missing = [w for w in words if w not in text]
            return f"the output lacks {missing}" if missing else None
        return check

    def manifest(out: Path) -> dict:
        return json.loads((Path(out) / "idx" / "manifest.json").read_text())

    def unchanged(out: Path, text: str) -> str | None:  # nothing of a refused request was written
        m = manifest(out)
        return None if m["job"] is None and '"documents":6' in text.replace(" ", "") else \
            f"the refused request changed the index (job {m['job']}, {text[-300:]})"

    post = lambda docs, **kw: {"method": "POST", "path": "/documents", "json": {"documents": docs}, **kw}  # noqa: E731
    search = lambda body, **kw: {"method": "POST", "path": "/search", "json": body, **kw}  # noqa: E731
    info = {"method": "GET", "path": "/info"}
    vec = [0.1] * DIM
    nan_row = "[NaN" + ", 0.1" * (DIM - 1) + "]"

    # ---- bring-your-own vectors on POST /documents: each bad one a 400 naming documents[i].vector
    for name, vector, msg in (
            ("wrong-dimension", [0.1] * (DIM - 1), f"has {DIM - 1} numbers; this index's vectors have {DIM}"),
            ("past-float32", [1e39] + [0.1] * (DIM - 1), "past float32's range"),
            ("too-long-for-float32-scores", [3e37] * DIM, "length (L2 norm)"),
            ("a-string", "0.1 0.2", "non-empty list of numbers, got str"),
            ("strings", ["0.1"] * DIM, "not a finite number"),
            ("booleans", [True] * DIM, "not a finite number"),
            ("nested-list", [vec], "not a finite number"),
            ("empty", [], "non-empty list"),
            ("object", {"0": 0.1}, "non-empty list of numbers, got dict")):
        add(D(f"s55-http-vector-{name}", http(post([{"_id": "v", "text": "t", "vector": vector}])), msg))
    for name, raw in (("nan", nan_row), ("infinity", "[Infinity" + ", 0.1" * (DIM - 1) + "]")):
        add(D(f"s55-http-vector-{name}", http({"method": "POST", "path": "/documents", "raw":
                                               '{"documents": [{"_id": "v", "text": "t", "vector": %s}]}' % raw}),
              "not a finite number"))
    add(D("s55-http-vector-without-text", http(post([{"_id": "v", "vector": vec}])), "neither text nor title"))
    add(DOK("s55-http-vector-null-is-encoded", http(post([{"_id": "v", "text": "t", "vector": None}], expect=200),
                                                    {"method": "GET", "path": "/documents/v"}),
            says('"id":"v"')))
    good5 = [{"_id": f"g{i}", "text": f"good document {i}"} for i in range(5)]
    for name, docs in (("bad-vector-after-good-documents", [*good5, {"_id": "b", "text": "t", "vector": [0.1] * 3}]),
                       ("bad-vector-before-good-documents", [{"_id": "b", "text": "t", "vector": [1e39] * DIM},
                                                             *good5]),
                       ("nan-vector-among-good-vectors", None)):
        if docs is None:
            step = {"method": "POST", "path": "/documents", "expect": 400, "raw": json.dumps(
                {"documents": [{"_id": f"g{i}", "text": "t", "vector": vec} for i in range(5)]})[:-2]
                + ', {"_id": "b", "text": "t", "vector": %s}]}' % nan_row}
        else:
            step = post(docs, expect=400)
        add(DOK(f"s55-http-{name}-writes-none", http(step, {"method": "GET", "path": "/documents/g0", "expect": 404},
                                                    info), unchanged))
    thousand = "{'documents': [{'_id': f'm{i}', 'text': f'document {i}'} for i in range(1000)] + " \
               "[{'_id': 'bad', 'text': 't', 'vector': [0.5] * 7}]}"
    add(DOK("s55-http-bad-vector-after-1000-good-documents-writes-none",
            http({"method": "POST", "path": "/documents", "gen": thousand, "expect": 400},
                 {"method": "GET", "path": "/documents/m0", "expect": 404}, info), unchanged))
    add(DOK("s55-http-own-vector-is-found-and-not-a-field",
            http(post([{"_id": "own", "text": "a client-made vector", "vector": [0.0] * 3 + [1.0] + [0.0] * (DIM - 4),
                        "lang": "en"}], expect=200),
                 search({"vector": [0.0] * 3 + [1.0] + [0.0] * (DIM - 4), "top_k": 1})),
            lambda out, text: None if '"hits":[{"id":"own"' in text and '"fields":{"lang":"en"}' in text
            else "the document's own vector was not the one searched, or 'vector' was kept as a field"))

    # ---- /search by vector
    for name, body, msg in (
            ("wrong-dimension", {"vector": [0.1] * 3}, "has 3 numbers; this index's vectors have"),
            ("past-float32", {"vector": [1e39] + [0.1] * (DIM - 1)}, "past float32's range"),
            ("too-long-for-float32-scores", {"vector": [3e37] * DIM}, "length (L2 norm)"),
            ("and-a-query", {"vector": vec, "query": "aspirin"}, "exactly one of 'query'"),
            ("lexical", {"vector": vec, "mode": "lexical"}, "dense only"),
            ("hybrid", {"vector": vec, "mode": "hybrid"}, "dense only"),
            ("with-rerank", {"vector": vec, "rerank": True}, "dense only"),
            ("ragged-rows", {"vector": [vec, [0.1] * 5]}, "'vector[1]' has 5 numbers"),
            ("empty", {"vector": []}, "'vector'"),
            ("strings", {"vector": ["0.1"] * DIM}, "'vector[0]'"),
            ("booleans", {"vector": [True] * DIM}, "'vector[0]'"),
            ("an-object", {"vector": {"x": 1}}, "'vector'")):
        add(D(f"s55-http-search-vector-{name}", http(search(body)), msg))
    add(D("s55-http-search-vector-nan", http({"method": "POST", "path": "/search", "raw": '{"vector": %s}' % nan_row}),
          "finite number"))
    add(D("s55-http-search-vector-too-many-rows", http({"method": "POST", "path": "/search",
                                                        "gen": "{'vector': [[0.1] * 32] * 2049}"}), "2048"))
    add(D("s55-http-search-vector-huge-body", http({"method": "POST", "path": "/search",
                                                    "gen": "{'vector': [0.123456789] * 3000000}"}), "bytes"))
    add(DOK("s55-http-search-vector-with-a-filter", http(search({"vector": vec, "top_k": 5,
                                                                  "filter": {"$not": {"title": "Coffee"}}}, show="hits")),
            lambda out, text: None if text.count('"id":"d') >= 5 and '"id":"d5"' not in text else
            "the filter was not applied"))

    # ---- scoped keys: the read key on every write route, a write key searching
    keys = {"api_key": W, "read_api_key": R}
    rk, wk = {"Authorization": f"Bearer {R}"}, {"Authorization": f"Bearer {W}"}
    for name, step in (("post-documents", post([{"_id": "r", "text": "t"}], headers=rk)),
                       ("delete-by-ids", {"method": "DELETE", "path": "/documents", "json": {"ids": ["d1"]},
                                          "headers": rk}),
                       ("delete-by-filter", {"method": "DELETE", "path": "/documents", "json": {"filter": {"x": 1}},
                                             "headers": rk}),
                       ("post-bad-documents", post([{"_id": "r", "vector": "x"}], headers=rk))):
        add(D(f"s55-http-read-key-{name}", http(step, config=keys), "insufficient_scope"))
    add(DOK("s55-http-read-key-refused-then-nothing-written",
            http(post([{"_id": "r", "text": "t"}], headers=rk, expect=403),
                 {"method": "DELETE", "path": "/documents", "json": {"ids": ["d1"]}, "headers": rk, "expect": 403},
                 {"method": "GET", "path": "/documents/d1", "headers": rk, "expect": 200},
                 {"method": "GET", "path": "/info", "headers": rk}, config=keys), unchanged))
    add(DOK("s55-http-read-key-reads-everything",
            http(search({"query": "aspirin"}, headers=rk, expect=200), search({"vector": vec}, headers=rk, expect=200),
                 {"method": "POST", "path": "/v1/embeddings", "json": {"input": "x"}, "headers": rk, "expect": 200},
                 {"method": "POST", "path": "/v1/rerank", "json": {"query": "q", "documents": ["a", "b"]},
                  "headers": rk, "expect": 200},
                 {"method": "GET", "path": "/v1/models", "headers": rk, "expect": 200},
                 {"method": "GET", "path": "/documents/d1", "headers": rk}, config=keys)))
    add(DOK("s55-http-write-key-searches-and-writes",
            http(search({"query": "aspirin"}, headers=wk, expect=200), post([{"_id": "w", "text": "t"}], headers=wk),
                 config=keys)))
    add(D("s55-http-read-key-only-server-takes-no-writes",
          http(post([{"_id": "r", "text": "t"}], headers=rk), config={"read_api_key": R}), "insufficient_scope"))
    add(D("s55-http-no-key-on-a-write", http(post([{"_id": "r", "text": "t"}]), config=keys), "missing API key"))
    add(D("s55-http-wrong-key-on-a-write", http(post([{"_id": "r", "text": "t"}], headers={
        "Authorization": "Bearer nope"}), config=keys), "incorrect API key"))
    add(D("s55-http-read-key-equals-write-key", http(info, config={"api_key": W, "read_api_key": W}),
          "same as api_key"))

    # ---- rerank by name, the pair budget
    rr = {"rerank_model": "{tiny_ce}", "rerank_candidates": 10, "max_rerank_pairs": 50}
    add(DOK("s55-http-models-list-the-reranker", http({"method": "GET", "path": "/v1/models"}, config=rr),
            says('"id":"tiny-ce"', '"id":"tiny"')))
    add(DOK("s55-http-model-card-of-the-reranker", http({"method": "GET", "path": "/v1/models/tiny-ce"}, config=rr)))
    add(DOK("s55-http-rerank-by-its-name",
            http({"method": "POST", "path": "/v1/rerank", "json": {"query": "q", "documents": ["a", "b"],
                                                                    "model": "tiny-ce"}}, config=rr),
            says('"model":"tiny-ce"')))
    add(D("s55-http-rerank-unknown-model", http({"method": "POST", "path": "/v1/rerank", "json": {
        "query": "q", "documents": ["a"], "model": "no-such-reranker"}}, config=rr), "the reranker 'tiny-ce'"))
    add(D("s55-http-rerank-by-the-embedders-name-of-another", http({"method": "GET", "path": "/v1/models/tiny-cee"},
                                                                  config=rr), "does not exist"))
    add(D("s55-http-rerank-over-the-pair-budget", http({"method": "POST", "path": "/v1/rerank", "json": {
        "query": "q", "documents": ["d"] * 51}}, config=rr), "--max-rerank-pairs"))
    add(D("s55-http-search-rerank-over-the-pair-budget", http(search({"query": ["q"] * 6, "rerank": True}),
                                                              config=rr), "--max-rerank-pairs"))
    add(D("s55-http-search-rerank-top-k-past-the-pair-budget", http(search({"query": ["q"] * 2, "rerank": True,
                                                                            "top_k": 30}), config=rr),
          "--max-rerank-pairs"))
    add(DOK("s55-http-search-rerank-within-the-budget", http(search({"query": ["q"] * 5, "rerank": True, "top_k": 2}),
                                                            config=rr), says('"rerank_score"')))
    add(D("s55-http-rerank-candidates-over-the-pair-budget", http(info, config={**rr, "rerank_candidates": 5000}),
          "rerank_candidates 5000 is over max_rerank_pairs 50"))
    add(D("s55-http-rerank-huge-candidates-list", http({"method": "POST", "path": "/v1/rerank", "gen":
                                                        "{'query': 'q', 'documents': ['d'] * 100000}"}, config=rr),
          "--max-rerank-pairs"))
    add(D("s55-http-rerank-huge-top-n", http({"method": "POST", "path": "/v1/rerank", "json": {
        "query": "q", "documents": ["a"], "top_n": -1}}, config=rr), "top_n"))
    add(hc.E("s55-serve-max-rerank-pairs-zero", n, ["serve", "--index", idx, "--port", "0", "--max-rerank-pairs",
                                                    "0"], "max_rerank_pairs", setup=made))

    # ---- the typed-column warning
    years = "".join(json.dumps({"_id": f"y{i}", "text": f"paper {i}", "year": 2000 + i}) + "\n" for i in range(6))
    typed_idx = [["@write", "{out}/years.jsonl", years],
                 ["index", "--model", "{tiny}", "--corpus", "{out}/years.jsonl", "--output", idx, "--batch-size", "2"]]
    add(hc.Case("s55-http-typed-column-lost-warns", n, http(post([{"_id": "s", "text": "t", "year": "2021"}],
                                                                 expect=200),
                                                            {"method": "GET", "path": "/metrics",
                                                             "show": "robustir_index_untyped_fields{"}),
                "ok", check=says("lost its typed", 'robustir_index_untyped_fields{field="year"'), program="driver",
                setup=typed_idx, protect_setup=False))
    add(DOK("s55-http-typed-column-kept-by-a-same-kind-upsert",
            http(post([{"_id": "s", "text": "t", "year": 2021}], expect=200),
                 {"method": "GET", "path": "/metrics", "show": "robustir_index_untyped_fields"}),
            lambda out, text: "a warning for a value of the same kind" if "lost its typed" in text or
            'untyped_fields{' in text else None, setup=typed_idx))

    # ---- the micro-batched upsert, under a real server process
    add(D("s55-http-upsert-2049-documents", http({"method": "POST", "path": "/documents", "gen":
                                                  "{'documents': [{'_id': f'x{i}', 'text': 't'} for i in range(2049)]}"}),
          "--max-inputs-per-request"))
    for name in ("killed-mid-upsert-then-restarted", "client-leaves-mid-upsert", "searches-429-while-upsert-queues",
                 "read-key-races-a-write", "two-upserts-of-the-same-ids-at-once"):
        add(hc.Case(f"s55-serve-{name}", n, ["serve", name, idx], "ok", program="driver", setup=made,
                    protect_setup=False, timeout=600.0, check=_no_problem))
    return c


def _no_problem(out: Path, text: str) -> str | None:
    problems = [line for line in text.splitlines() if line.startswith("PROBLEM:")]
    return "; ".join(problems)[:600] if problems else None


# ---------------------------------------------------------------------------------------------- a real server

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Served:
    """``robustir serve --index INDEX`` as a child process on 127.0.0.1 (its log in ``INDEX/../serve-N.log``)."""

    count = 0

    def __init__(self, index: str, *args: str) -> None:
        _Served.count += 1
        self.port, self.index = _free_port(), index
        self.log = Path(index).parent / f"serve-{_Served.count}.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "robustir.cli.main", "serve", "--index", index, "--port", str(self.port), *args],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self, client, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited {self.process.returncode}:\n{self.log.read_text()[-2000:]}")
            try:
                if client.get(f"{self.url}/health").status_code == 200:
                    return
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not answer in {timeout:.0f} s:\n{self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


def _job(index: str) -> dict | None:
    return json.loads((Path(index) / "manifest.json").read_text()).get("job")


#: words that make a document ~120 tokens (the tiny model's 128 at most), so an upsert takes long enough to be cut
PAD = " and more words about it" * 20


def _documents(n: int, prefix: str = "u", text: str = "uploaded document", pad: str = PAD) -> list[dict]:
    return [{"_id": f"{prefix}{i}", "text": f"{text} {i} about topic {i % 17}{pad}"} for i in range(n)]


def _index_state(index: str, ids: list[str]) -> tuple[int, int, list[str]]:
    """(documents in the index, how many of ``ids`` are in it, ids held more than once), read with the library."""
    from collections import Counter

    from robustir.index.store import SearchIndex

    with SearchIndex.open(index) as opened:
        count = opened.count
        found = [hit.id for hit in opened.get(ids)]
        rows = opened._table.to_arrow().column("id").to_pylist()
    twice = [i for i, k in Counter(rows).items() if k > 1]
    return count, len(set(found)), twice


def _in_background(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result["reply"] = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - what the client saw
            result["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _wait_for_job(index: str, present: bool, timeout: float = 300.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (_job(index) is not None) == present:
            return True
        time.sleep(0.05)
    return False


def scenario(name: str, index: str, extra: list[str]) -> int:
    """Run scenario ``name`` against a ``robustir serve`` child process on ``index``; prints what it saw and
    ``PROBLEM: ...`` for every harm; exits 0 when it ran to its end (the case's check reads the problems)."""
    import httpx

    problems: list[str] = []
    say = problems.append
    started = time.monotonic()
    base = _index_state(index, [])[0]
    servers: list[_Served] = []
    try:
        with httpx.Client(timeout=600) as client:
            if name == "killed-mid-upsert-then-restarted":
                _killed_mid_upsert(index, client, servers, base, say)
            elif name == "client-leaves-mid-upsert":
                _client_leaves(index, client, servers, base, say)
            elif name == "searches-429-while-upsert-queues":
                _queue_429(index, client, servers, base, say)
            elif name == "read-key-races-a-write":
                _read_key_race(index, client, servers, base, say)
            elif name == "two-upserts-of-the-same-ids-at-once":
                _two_upserts(index, client, servers, base, say)
            else:
                print(f"unknown scenario {name!r}")
                return 3
    finally:
        for server in servers:
            server.stop()
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print(f"scenario {name}: {len(problems)} problem(s) in {time.monotonic() - started:.1f} s")
    return 0


def _check_all_there(index: str, ids: list[str], base: int, say, what: str) -> None:
    count, found, twice = _index_state(index, ids)
    print(f"{what}: {count} documents (expected {base + len(ids)}), {found}/{len(ids)} of the upsert's ids found, "
          f"{len(twice)} ids held twice, job {_job(index)}")
    if found != len(ids):
        say(f"{what}: {len(ids) - found} of the upsert's {len(ids)} documents are lost")
    if twice:
        say(f"{what}: {len(twice)} ids are held twice, e.g. {twice[:3]}")
    if count != base + len(ids):
        say(f"{what}: {count} documents, expected {base + len(ids)}")
    if _job(index) is not None:
        say(f"{what}: an unfinished job is left: {_job(index)}")
    leftovers = list((Path(index) / "incoming").glob("*.jsonl")) if (Path(index) / "incoming").is_dir() else []
    if leftovers:
        say(f"{what}: incoming files left: {[p.name for p in leftovers]}")


def _killed_mid_upsert(index, client, servers, base, say) -> None:
    """kill -9 of the server while a 1,000-document upsert's micro-batches are being encoded; a restart finishes the
    job before serving: every document once, none lost, none twice."""
    docs = _documents(1000)
    server = _Served(index, "--ingest-batch-size", "1")
    servers.append(server)
    server.ready(client)
    thread, result = _in_background(client.post, f"{server.url}/documents", json={"documents": docs})
    if not _wait_for_job(index, True, 120):
        say("the upsert's job never started")
        return
    time.sleep(0.3)  # some micro-batches encoded, the job not committed yet
    server.kill()
    thread.join(60)
    job = _job(index)
    print(f"killed the server 0.3 s into the job; the client got "
          f"{result.get('reply').status_code if 'reply' in result else type(result.get('error')).__name__}; "
          f"job at kill: {job}")
    if job is None:
        say("the upsert finished before the kill: the case did not test a kill mid-upsert (slow it down)")
        return
    if "reply" in result and result["reply"].status_code == 200:
        say("the client got 200 for an upsert the kill stopped")
    again = _Served(index)
    servers.append(again)
    again.ready(client)
    log = again.log.read_text()
    if "finishing the HTTP upsert" not in log:
        say("the restart did not say it finished the stopped upsert")
    _check_all_there(index, [d["_id"] for d in docs], base, say, "after the restart")
    hits = client.post(f"{again.url}/search", json={"query": "uploaded document 999", "top_k": 3})
    if hits.status_code != 200:
        say(f"a search after the restart answered {hits.status_code}: {hits.text[:200]}")


def _client_leaves(index, client, servers, base, say) -> None:
    """A client that gives up (its connection closed) half-way through a 1,000-document upsert: the job is not left
    half-done -- it is finished (all documents once) or not written at all -- and the server keeps answering:
    a search during and after, the same upsert sent again."""
    import httpx

    docs = _documents(1000)
    server = _Served(index, "--ingest-batch-size", "1")
    servers.append(server)
    server.ready(client)
    try:
        httpx.post(f"{server.url}/documents", json={"documents": docs}, timeout=0.5)
        say("the 1,000-document upsert answered within the client's 0.5 s: nothing left mid-upsert (slow it down)")
    except httpx.TimeoutException:
        print(f"the client left 0.5 s into the upsert (job {'running' if _job(index) else 'not running'})")
    during = client.post(f"{server.url}/search", json={"query": "topic 3", "top_k": 3})
    print(f"a search from another client during the job: {during.status_code}")
    if during.status_code != 200:
        say(f"a search from another client answered {during.status_code}: {during.text[:200]}")
    if not _wait_for_job(index, False, 300):
        say("the left upsert's job never ended")
        return
    count, found, twice = _index_state(index, [d["_id"] for d in docs])
    print(f"after the job: {count} documents, {found}/1000 of the upsert's ids")
    if found not in (0, 1000) or twice:
        say(f"the left upsert is half-written: {found}/1000 documents, {len(twice)} twice")
    again = client.post(f"{server.url}/documents", json={"documents": docs})
    if again.status_code != 200:
        say(f"the same upsert sent again answered {again.status_code}: {again.text[:200]}")
    _check_all_there(index, [d["_id"] for d in docs], base, say, "after sending it again")


def _queue_429(index, client, servers, base, say) -> None:
    """A small queue (--max-queued-texts 8) and a 1,000-document upsert queueing its micro-batches: searches that
    would overfill the queue get 429 with Retry-After, naming the limit; one-query searches are served between the
    upsert's micro-batches; nothing gets a 5xx; the upsert is complete."""
    import concurrent.futures

    docs = _documents(1000)
    server = _Served(index, "--ingest-batch-size", "4", "--max-queued-texts", "8")
    servers.append(server)
    server.ready(client)
    thread, result = _in_background(client.post, f"{server.url}/documents", json={"documents": docs})
    _wait_for_job(index, True, 120)
    statuses: dict[str, list[int]] = {"one query": [], "8 queries": [], "second upsert": []}
    messages: list[str] = []

    def one(kind: str) -> None:
        body = ({"query": "topic 5", "top_k": 2} if kind == "one query" else
                {"query": [f"topic {i}" for i in range(8)], "top_k": 2})
        reply = client.post(f"{server.url}/search", json=body)
        statuses[kind].append(reply.status_code)
        if reply.status_code == 429:
            if "Retry-After" not in reply.headers:
                say("a 429 without Retry-After")
            messages.append(reply.json()["error"]["message"])
        elif reply.status_code != 200:
            say(f"a search ({kind}) answered {reply.status_code}: {reply.text[:200]}")

    second = _documents(50, "s", "second upsert")
    extra, extra_result = _in_background(client.post, f"{server.url}/documents", json={"documents": second})
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        while thread.is_alive():
            list(pool.map(one, ["one query", "8 queries", "one query", "8 queries"]))
    thread.join()
    extra.join(300)
    for label, res in (("the upsert", result), ("the second upsert", extra_result)):
        reply = res.get("reply")
        if reply is None or reply.status_code != 200:
            say(f"{label} answered {reply.status_code if reply is not None else res.get('error')}: "
                f"{reply.text[:200] if reply is not None else ''}")
    print({k: {s: v.count(s) for s in sorted(set(v))} for k, v in statuses.items()})
    if not any(s == 200 for s in statuses["one query"]):
        say("no one-query search was served during the upsert")
    if messages and not all("--max-queued-texts" in m for m in messages):
        say(f"a 429 that does not name its limit: {messages[0]}")
    print(f"429s: {len(messages)}; e.g. {messages[:1]}")
    _check_all_there(index, [d["_id"] for d in docs + second], base, say, "after both upserts")


def _read_key_race(index, client, servers, base, say) -> None:
    """A read-only key's writes while the read-write key's 300-document upsert runs: each 403 at once (not held
    behind the upsert's lock), searches with the read key served; the upsert complete, nothing of the read key's."""
    docs = _documents(300)
    server = _Served(index, "--api-key", W, "--read-api-key", R, "--ingest-batch-size", "4")
    servers.append(server)
    server.ready(client)
    rk, wk = {"Authorization": f"Bearer {R}"}, {"Authorization": f"Bearer {W}"}
    thread, result = _in_background(client.post, f"{server.url}/documents", json={"documents": docs}, headers=wk)
    _wait_for_job(index, True, 120)
    answered_during = 0
    for attempt in range(5):
        for method, body in (("POST", {"documents": [{"_id": f"r{attempt}", "text": "read key's"}]}),
                             ("DELETE", {"ids": ["d1"]}), ("DELETE", {"filter": {"$not": {"x": 1}}})):
            reply = client.request(method, f"{server.url}/documents", json=body, headers=rk)
            if reply.status_code != 403 or reply.json()["error"]["code"] != "insufficient_scope":
                say(f"the read key's {method} answered {reply.status_code}: {reply.text[:200]}")
            answered_during += _job(index) is not None
        found = client.post(f"{server.url}/search", json={"query": "topic 4"}, headers=rk)
        if found.status_code != 200:
            say(f"the read key's search answered {found.status_code}")
    thread.join(300)
    reply = result.get("reply")
    if reply is None or reply.status_code != 200:
        say(f"the write key's upsert answered {reply.status_code if reply is not None else result.get('error')}")
    print(f"{answered_during} of the read key's 15 writes were refused while the upsert's job ran")
    if answered_during == 0:
        say("no read-key write was refused while the upsert ran (were they held behind it?)")
    _check_all_there(index, [d["_id"] for d in docs], base, say, "after the upsert")
    count, found, _ = _index_state(index, [f"r{i}" for i in range(5)] + ["d1"])
    if found != 1:
        say(f"the read key's writes changed the index: {found} of its ids / d1 found (expected d1 only)")


def _two_upserts(index, client, servers, base, say) -> None:
    """Two upserts at once whose ids overlap (100 of 200 each): both answered 200, every id once, each shared id
    holding one of the two versions whole."""
    first = _documents(200, "p", "first version", "")
    second = _documents(100, "q", "second version", "") + [{"_id": f"p{i}", "text": f"second version {i}"}
                                                       for i in range(100, 200)]
    server = _Served(index, "--ingest-batch-size", "4")
    servers.append(server)
    server.ready(client)
    a, ra = _in_background(client.post, f"{server.url}/documents", json={"documents": first})
    b, rb = _in_background(client.post, f"{server.url}/documents", json={"documents": second})
    a.join(600)
    b.join(600)
    for label, res in (("the first upsert", ra), ("the second upsert", rb)):
        reply = res.get("reply")
        if reply is None or reply.status_code != 200:
            say(f"{label} answered {reply.status_code if reply is not None else res.get('error')}")
    ids = sorted({d["_id"] for d in first + second})
    _check_all_there(index, ids, base, say, "after both")
    for i in (100, 150, 199):
        text = client.get(f"{server.url}/documents/p{i}").json().get("text", "")
        if text not in (f"first version {i} about topic {i % 17}", f"second version {i}"):
            say(f"p{i} holds neither version whole: {text!r}")
