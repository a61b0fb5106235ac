"""Issue 52, item 2: what one request with absurd numbers of field names leaves behind -- the manifest's size and the
latency of a filtered search -- after its documents are deleted.

    PYTHONPATH=src python bench/field_names.py                     # this tree
    PYTHONPATH=/tmp/old/src python bench/field_names.py            # the code before (git archive d3f3afd src)

An index of ``--docs`` documents (a tiny random 2-layer BERT: the model is not what is measured) is served by the
app in-process (FastAPI's test client, the code ``robustir serve`` runs); then

1. ``POST /documents`` of 2,000 documents x 100 keys of their own (200,000 field names), then ``DELETE`` of them;
2. ``POST /documents`` of 10 documents x 100 keys (1,000 names: within the bound), then ``DELETE`` of them.

At each point: the manifest's size and the median over ``--rounds`` of a filtered dense search
(:meth:`SearchIndex.search_vectors` with ``{"lang": "en"}``, one query vector, top 10) on the server's reader.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def tiny_model(out: Path) -> Path:
    """The hostile campaign's tiny 2-layer BERT (the bundled MiniLM tokenizer), in ``out``."""
    sys.path.insert(0, str(REPO / "bench"))
    from hostile_campaign import tiny_model as make

    make(out)
    return out


def filtered_ms(index, rounds: int) -> float:
    import numpy as np

    vector = np.random.default_rng(0).standard_normal(index.dim).astype(np.float32)
    index.search_vectors(vector, 10, filter={"lang": "en"})  # warm
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        hits = index.search_vectors(vector, 10, filter={"lang": "en"})
        times.append(time.perf_counter() - started)
        assert len(hits[0]) == 10
    return statistics.median(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    from fastapi.testclient import TestClient

    import robustir
    from robustir.index.store import IndexConfig, SearchIndex
    from robustir.serving import ServeConfig, create_app

    print(f"robustir from {Path(robustir.__file__).parent}")
    work = Path(tempfile.mkdtemp(prefix="field-names-"))
    model = tiny_model(work / "model")
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "text": f"document {i} about topic {i % 50}",
                                          "lang": ["en", "de", "fr"][i % 3], "year": 2000 + i % 25}) + "\n"
                              for i in range(args.docs)))
    SearchIndex.build(work / "idx", str(model), corpus, config=IndexConfig(show_progress=False))[0].close()
    manifest = work / "idx" / "manifest.json"
    app = create_app(None, work / "idx", ServeConfig(max_inputs_per_request=2048, max_body_bytes=64 << 20))
    rows = []

    def point(label: str) -> None:
        index = app.state.server.index
        data = json.loads(manifest.read_text())
        rows.append((label, manifest.stat().st_size, len(data["fields"]), filtered_ms(index, args.rounds)))
        print(f"{label:58} manifest {rows[-1][1]:>10,} B  {rows[-1][2]:>7,} field names  "
              f"filtered search {rows[-1][3]:7.2f} ms", flush=True)

    with TestClient(app) as client:
        point("built")
        for docs, keys in ((2000, 100), (10, 100)):
            body = {"documents": [{"_id": f"w{i}", "text": f"wide {i}", **{f"k{i}_{j}": j for j in range(keys)}}
                                  for i in range(docs)]}
            started = time.perf_counter()
            reply = client.post("/documents", json=body)
            took = time.perf_counter() - started
            print(f"POST {docs} x {keys} keys -> {reply.status_code} in {took:.1f} s: {reply.text[:160]}", flush=True)
            point(f"after POST {docs} x {keys} keys ({reply.status_code})")
            if reply.status_code == 200:
                reply = client.request("DELETE", "/documents", json={"ids": [f"w{i}" for i in range(docs)]})
                print(f"DELETE {docs} -> {reply.status_code}: {reply.text[:160]}", flush=True)
                point(f"after DELETE of those {docs}")
    print(json.dumps(rows))
    try:  # the scan a delete pays when a removed document held a name the job did not write again (issue 52)
        from robustir.index.store.known_fields import vanished
    except ImportError:
        return 0
    index = app.state.server.index
    times = []
    for _ in range(5):
        started = time.perf_counter()
        assert vanished(index._table, {"no-such-field"}) == {"no-such-field"}
        times.append(time.perf_counter() - started)
    print(f"scan of {index.count:,} documents for a name none holds: {statistics.median(times) * 1000:.0f} ms "
          "(median of 5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
