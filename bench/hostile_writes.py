"""Issue 52's cases for the hostile campaign (bench/hostile_campaign.py): writes that fail or are interrupted -- a
killed job beside another writer, a restart from another working folder, a file-size limit mid-write, absurd numbers
of field names, lone surrogates, odd document ids and filters over HTTP -- and the driver those cases run.

    python bench/hostile_campaign.py --only '^w52-'      # these cases only

The driver (this file run as a script) does what the robustir CLI cannot:

* ``killed KIND INDEX CORPUS [--http] [--cwd DIR]``: run an ``add`` / ``upsert`` of CORPUS (``--http``: as an HTTP
  upsert, through the index's ``incoming/`` spool) in a child process that dies with ``os._exit`` right after its
  first commit of 2 records -- what ``kill -9`` leaves -- and exit 0 when it did;
* ``http [--cwd DIR] [--config JSON] INDEX STEP...``: start the app on INDEX in-process (FastAPI's test client;
  ``--config``: :class:`~robustir.serving.ServeConfig` fields) and send each STEP, a JSON object ``{"method",
  "path", "json" | "raw" | "gen" (a Python expression for a body too big for a command line), "headers",
  "expect": status or [statuses], "fsize": bytes, "fail_commit": n, "killed": [KIND, CORPUS], "show": text (print
  every line of the answer holding it)}``. Every answer is printed. The last step decides the exit, as the
  campaign reads a CLI's: 2xx -> 0; a 4xx/5xx with a message -> ``robustir serve: error: HTTP 400 (code): ...`` on
  stderr and 2; a 500 ``internal_error`` (an exception the server did not expect) prints ``Traceback`` (a crash);
  an earlier step whose status is not its ``expect`` exits 3 (unclear).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()


# ---------------------------------------------------------------------------------------------- the cases

def cases(hc) -> list:
    """The cases, built with the campaign module ``hc`` (its Case, E, OK and command lists)."""
    c: list = []
    add = c.append
    n = "index-writes"
    idx, more, corpus = "{out}/idx", "{out}/more.jsonl", "{out}/wide.jsonl"
    made = [hc.IDX]
    write_more = ["@write", more, "".join(json.dumps({"_id": f"n{i}", "text": f"new document {i}"}) + "\n"
                                          for i in range(6))]
    replace = ["@write", more, "".join(json.dumps({"_id": f"d{i}", "text": f"replaced {i}"}) + "\n"
                                       for i in range(1, 5))]
    killed_add = [*made, write_more, ["@driver", "killed", "add", idx, more]]

    def http(*steps: dict, cwd: str | None = None, index: str = idx) -> list[str]:
        return ["http", *(["--cwd", cwd] if cwd else []), index, *(json.dumps(s) for s in steps)]

    def manifest(out: Path) -> dict:
        return json.loads((Path(out) / "idx" / "manifest.json").read_text())

    def D(id, cls, argv, msg=None, **kw):
        return hc.Case(id, cls, argv, "error", msg, program="driver", **kw)

    def DOK(id, argv, check=None, **kw):
        return hc.Case(id, "valid", argv, "ok", check=check, program="driver", **kw)

    # item 1: a job's record survives every other writer
    for action, argv in (("delete", ["--delete-id", "d1"]), ("compact", ["--compact"]),
                         ("upsert", ["--upsert", "{data}/corpus.jsonl"])):
        add(hc.E(f"w52-index-{action}-beside-a-killed-add", n, ["index", *argv, "--output", idx],
                 "unfinished add of {out}/more.jsonl", setup=killed_add))
    add(hc.OK("w52-index-add-resumes-a-killed-add", ["index", "--add", more, "--output", idx],
              lambda out, text: None if "resumed after 2" in text and "12 documents" in text else "not resumed",
              setup=killed_add, protect_setup=False))
    add(hc.OK("w52-index-discard-a-killed-add-then-delete", ["index", "--delete-id", "d1", "--output", idx],
              lambda out, text: None if "5 documents" in text and manifest(out)["job"] is None else "wrong count",
              setup=[*killed_add, ["index", "--discard-unfinished", "--output", idx]], protect_setup=False))

    def replaced_back(out: Path, text: str) -> str | None:
        from robustir.index.store import SearchIndex

        with SearchIndex.open(Path(out) / "idx") as index:
            got = {h.id: h.text for h in index.get(["d1", "d2"])}
        return None if not any(t.startswith("replaced") for t in got.values()) and "are back" in text \
            else f"the upsert's replacements stayed: {got}"

    add(hc.OK("w52-index-discard-a-killed-upsert-restores-what-it-replaced",
              ["index", "--discard-unfinished", "--output", idx], replaced_back,
              setup=[*made, replace, ["@driver", "killed", "upsert", idx, more]], protect_setup=False))
    docs5 = {"documents": [{"_id": f"h{i}", "text": f"http document {i}"} for i in range(5)]}
    add(DOK("w52-http-upsert-fails-mid-job-then-a-delete-finishes-it",
            http({"method": "POST", "path": "/documents", "json": docs5, "fail_commit": 2, "expect": 507},
                 {"method": "DELETE", "path": "/documents", "json": {"ids": ["d1"]}, "expect": 200},
                 {"method": "GET", "path": "/documents/h4"}),
            lambda out, text: None if '"documents":10' in text.replace(" ", "") and manifest(out)["job"] is None
            else "the half-done upsert was not finished", setup=made, protect_setup=False))
    for method, body in (("DELETE", {"ids": ["d1"]}), ("POST", {"documents": [{"_id": "z", "text": "zz"}]})):
        add(D(f"w52-http-{method.lower()}-beside-a-cli-add-killed-while-serving", n,
              http({"killed": ["add", more]}, {"method": method, "path": "/documents", "json": body}),
              "unfinished add of", setup=[*made, write_more], protect_setup=False))
    # item 4: absolute paths in a job record
    add(DOK("w52-http-restart-from-another-folder-after-a-killed-http-upsert",
            http({"method": "GET", "path": "/documents/k4"}, cwd="{out}/elsewhere", index="../idx"),
            setup=[*made, ["@write", "{out}/elsewhere/.keep", ""],
                   ["@write", "{out}/k.jsonl", "".join(json.dumps({"_id": f"k{i}", "text": f"killed {i}"}) + "\n"
                                                       for i in range(5))],
                   ["@driver", "killed", "upsert", "idx", "k.jsonl", "--http", "--cwd", "{out}"]],
            protect_setup=False))
    add(hc.OK("w52-index-discard-a-killed-http-upsert", ["index", "--discard-unfinished", "--output", idx],
              lambda out, text: None if "discarded the unfinished upsert" in text and manifest(out)["job"] is None
              else "the job was not found", protect_setup=False,
              setup=[*made, ["@write", "{out}/k.jsonl", '{"_id": "k0", "text": "k"}\n{"_id": "k1", "text": "k"}\n'
                             '{"_id": "k2", "text": "k"}\n'],
                     ["@driver", "killed", "upsert", "idx", "k.jsonl", "--http", "--cwd", "{out}"]]))
    add(hc.OK("w52-index-resume-a-relative-add-from-another-folder", ["index", "--add", more, "--output", idx],
              lambda out, text: None if "resumed after 2" in text else "not resumed", protect_setup=False,
              setup=[*made, write_more, ["@driver", "killed", "add", "idx", "more.jsonl", "--cwd", "{out}"]]))
    # item 5: a full disk (a file-size limit) mid-write
    big = {"documents": [{"_id": f"f{i}", "text": "a document past the file-size limit " * 20} for i in range(16)]}
    add(DOK("w52-http-upsert-past-the-file-size-limit-then-again",
            http({"method": "POST", "path": "/documents", "json": big, "fsize": 4096, "expect": 507},
                 {"method": "POST", "path": "/documents", "json": big}),
            lambda out, text: None if "File too large" in text else "the cause was not named", setup=made,
            protect_setup=False))
    add(DOK("w52-http-delete-past-the-file-size-limit-then-again",
            http({"method": "DELETE", "path": "/documents", "json": {"ids": ["d1"]}, "fsize": 1, "expect": [200, 507]},
                 {"method": "DELETE", "path": "/documents", "json": {"ids": ["d2"]}}),
            setup=made, protect_setup=False))
    add(hc.Case("w52-index-add-past-the-file-size-limit", n, ["index", "--add", more, "--output", idx], "error",
                "File too large", fsize=4096, setup=[*made, ["@write", more, "".join(
                    json.dumps({"_id": f"b{i}", "text": "a long document " * 40}) + "\n" for i in range(40))]],
                protect_setup=False))
    # item 2: field names bounded, and dropped when their documents go
    wide = {"documents": [{"_id": "w", "text": "wide", **{f"k{j}": j for j in range(1025)}}]}
    add(D("w52-http-too-many-field-names", n, http({"method": "POST", "path": "/documents", "json": wide}),
          "too_many_fields", setup=made))
    tenfold = {"documents": [{"_id": f"w{i}", "text": f"wide {i}", **{f"k{i}_{j}": j for j in range(100)}}
                             for i in range(10)]}
    add(DOK("w52-http-wide-documents-deleted-leave-no-field-names",
            http({"method": "POST", "path": "/documents", "json": tenfold, "expect": 200},
                 {"method": "DELETE", "path": "/documents", "json": {"ids": [f"w{i}" for i in range(10)]}}),
            lambda out, text: None if manifest(out)["fields"] == [] else
            f"{len(manifest(out)['fields'])} field names stayed", setup=made, protect_setup=False))
    add(D("w52-http-filter-on-a-field-whose-documents-went", n,
          http({"method": "POST", "path": "/documents", "json": tenfold, "expect": 200},
               {"method": "DELETE", "path": "/documents", "json": {"ids": [f"w{i}" for i in range(10)]}, "expect": 200},
               {"method": "POST", "path": "/search", "json": {"query": "wide", "filter": {"k3_7": 7}}}),
          "k3_7", setup=made, protect_setup=False))
    write_wide = ["@write", corpus, "".join(json.dumps({"_id": f"w{i}", "text": "t", **{f"f{i}_{j}": 1
                                                                                        for j in range(300)}}) + "\n"
                                            for i in range(4))]
    add(hc.E("w52-index-add-too-many-field-names", n, ["index", "--add", corpus, "--output", idx],
             "more than the 1024 an index keeps", setup=[*made, write_wide]))
    write_few = ["@write", corpus, "".join(json.dumps({"_id": f"w{i}", "text": "t", f"only{i}": i}) + "\n"
                                           for i in range(3))]
    add(hc.OK("w52-index-delete-drops-field-names", ["index", "--delete-id", "w0", "--delete-id", "w1", "--output",
                                                     idx],
              lambda out, text: None if manifest(out)["fields"] == ["only2"] else f"{manifest(out)['fields']}",
              setup=[*made, write_few, ["index", "--add", corpus, "--output", idx]], protect_setup=False))
    # item 6: a lone surrogate anywhere in a document
    for where, raw in (("text", '{"_id": "a", "text": "bad \\ud800 text"}'),
                       ("id", '{"_id": "bad\\udc00id", "text": "t"}'),
                       ("field-name", '{"_id": "a", "text": "t", "f\\ud83d": 1}'),
                       ("field-value", '{"_id": "a", "text": "t", "tag": "\\udfff"}'),
                       ("nested-value", '{"_id": "a", "text": "t", "meta": {"tags": ["ok", "\\udfff"]}}')):
        add(D(f"w52-http-surrogate-in-the-{where}", n,
              http({"method": "POST", "path": "/documents", "raw": '{"documents": [' + raw + "]}"}),
              "lone surrogate", setup=made))
    add(DOK("w52-http-astral-pair-accepted",
            http({"method": "POST", "path": "/documents", "raw": '{"documents": [{"_id": "e", "text": "smile '
                  '\\ud83d\\ude00"}]}', "expect": 200}, {"method": "GET", "path": "/documents/e"}),
            setup=made, protect_setup=False))
    # item 9 (HTTP): ids with "/", a NUL id, filters under $not
    slash = {"method": "POST", "path": "/documents", "json": {"documents": [{"_id": "a/b", "text": "slashed"}]},
             "expect": 200}
    add(DOK("w52-http-get-an-id-with-a-slash", http(slash, {"method": "GET", "path": "/documents/a/b"}),
            setup=made, protect_setup=False))
    add(DOK("w52-http-get-an-id-with-an-encoded-slash", http(slash, {"method": "GET", "path": "/documents/a%2Fb"}),
            setup=made, protect_setup=False))
    add(D("w52-http-get-a-prefix-of-an-id-with-a-slash", n, http(slash, {"method": "GET", "path": "/documents/a"}),
          "no document with id 'a'", setup=made, protect_setup=False))
    add(D("w52-http-get-a-nul-id", n, http({"method": "GET", "path": "/documents/%00"}), "NUL", setup=made))
    typed = {"method": "POST", "path": "/documents", "expect": 200, "json": {"documents": [
        {"_id": "x1", "text": "t", "lang": "en"}, {"_id": "x2", "text": "t", "lang": None}]}}
    for name, flt in (("not-of-another-kind", {"$not": {"lang": 5}}),
                      ("not-of-an-or-of-other-kinds", {"$not": {"$or": [{"lang": 5}, {"lang": True}]}})):
        add(DOK(f"w52-http-filter-{name}",
                http(typed, {"method": "POST", "path": "/search", "json": {"query": "t", "filter": flt}}),
                setup=made, protect_setup=False))
    add(D("w52-http-filter-of-another-kind-beside-nulls", n,
          http(typed, {"method": "POST", "path": "/search", "json": {"query": "t", "filter": {"lang": 5}}}),
          "compare it with a string value", setup=made, protect_setup=False))
    return c


# ---------------------------------------------------------------------------------------------- the driver

def killed(kind: str, index: str, corpus: str, via_http: bool) -> int:
    """A child that dies (``os._exit``, as ``kill -9``) right after the first commit of its job."""
    from robustir.index.store import IndexConfig, SearchIndex

    writer = SearchIndex.open(index, writable=True)
    writer.use_model(writer.model_path)
    if via_http:
        from robustir.index.store.spool import write_incoming

        rows = [json.loads(line) for line in Path(corpus).read_text().splitlines() if line.strip()]
        corpus = str(write_incoming(index, rows))
    getattr(writer, kind)(corpus, config=IndexConfig(show_progress=False, chunk_size=2),
                          on_chunk=lambda position: os._exit(137))
    return 1  # not reached: the job has more than one chunk


def run_killed(args: list[str], cwd: str | None) -> int:
    done = subprocess.run([sys.executable, str(HERE), "_killed", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 137:
        print(f"the killed job exited {done.returncode}, not 137:\n{done.stdout}{done.stderr}")
        return 1
    return 0


def http(index: str, steps: list[dict], config: dict | None = None) -> int:
    import resource

    from fastapi.testclient import TestClient

    from robustir.index.store import IndexConfig, SearchIndex
    from robustir.index.store import spool as ingest
    from robustir.serving import ServeConfig, create_app

    try:
        app = create_app(None, index, ServeConfig(**(config or {})))
    except Exception as exc:  # what `robustir serve` would print
        print(f"robustir serve: error: {exc}", file=sys.stderr)
        return 2
    with TestClient(app, raise_server_exceptions=False) as client:
        for number, step in enumerate(steps, 1):
            last = number == len(steps)
            if "killed" in step:
                kind, corpus = step["killed"]
                if run_killed([kind, index, corpus], None):  # in this working folder
                    return 3
                continue
            original, calls, chunking = SearchIndex._commit, [], ingest._quiet
            if step.get("fail_commit"):  # Lance's own words when a write hits the file-size limit
                def failing(self, *args, **kwargs):
                    calls.append(1)
                    if len(calls) == step["fail_commit"]:
                        raise RuntimeError("lance error: LanceError(IO): File too large (os error 27), writer.rs:258")
                    return original(self, *args, **kwargs)
                SearchIndex._commit = failing
                ingest._quiet = lambda: IndexConfig(show_progress=False, chunk_size=2)  # several commits a request
            limits = resource.getrlimit(resource.RLIMIT_FSIZE)
            if step.get("fsize"):  # Python ignores SIGXFSZ: a write past the limit fails with EFBIG
                resource.setrlimit(resource.RLIMIT_FSIZE, (step["fsize"], limits[1]))
            try:
                kwargs = ({"json": step["json"]} if "json" in step else
                          {"json": eval(step["gen"], {"__builtins__": {"range": range}})} if "gen" in step else
                          {"content": step["raw"], "headers": {"Content-Type": "application/json"}}
                          if "raw" in step else {})
                kwargs["headers"] = {**kwargs.get("headers", {}), **step.get("headers", {})}
                reply = client.request(step["method"], step["path"], **kwargs)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, limits)
                SearchIndex._commit, ingest._quiet = original, chunking
            text = reply.text
            print(f"step {number}: {step['method']} {step['path']} -> {reply.status_code}: {text[:400]}")
            if step.get("show"):
                print("\n".join(line for line in text.splitlines() if step["show"] in line))
            error = reply.json().get("error", {}) if reply.headers.get("content-type", "").startswith(
                "application/json") and reply.status_code >= 400 else {}
            if error.get("code") == "internal_error":
                print(f"Traceback: the server answered 500 internal_error at step {number}: {error.get('message')}")
                return 1
            expect = step.get("expect")
            if not last and expect is not None and reply.status_code not in (
                    expect if isinstance(expect, list) else [expect]):
                print(f"step {number} answered {reply.status_code}, expected {expect}")
                return 3
            if last:
                if reply.status_code < 400:
                    return 0
                print(f"robustir serve: error: HTTP {reply.status_code} ({error.get('code')}): "
                      f"{error.get('message', text)[:600]}", file=sys.stderr)
                return 2
    return 0


def main(argv: list[str]) -> int:
    cwd = None
    if "--cwd" in argv:
        at = argv.index("--cwd")
        cwd = argv[at + 1]
        argv = argv[:at] + argv[at + 2:]
    if argv[0] == "_killed":
        return killed(argv[1], argv[2], argv[3], "--http" in argv)
    if cwd:
        Path(cwd).mkdir(parents=True, exist_ok=True)
        os.chdir(cwd)
    if argv[0] == "killed":
        return run_killed(argv[1:], None)
    config = None
    if "--config" in argv:
        at = argv.index("--config")
        config = json.loads(argv[at + 1])
        argv = argv[:at] + argv[at + 2:]
    if argv[0] == "http":
        return http(argv[1], [json.loads(step) for step in argv[2:]], config)
    if argv[0] == "serve":  # issue 55: a real `robustir serve` process (bench/hostile_serve.py)
        import hostile_serve

        return hostile_serve.scenario(argv[1], argv[2], argv[3:])
    print(f"unknown driver command {argv[0]!r}")
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
