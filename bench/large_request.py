"""One large embeddings request to an idle ``robustir serve`` in its default settings, and LangChain's default
ingestion (``embed_documents``, ``chunk_size=1000``), as a RAG team sends them (issue 36).

    python bench/large_request.py --data ../shared/data/scifact --texts 1500

Before micro-batching, the 60 s ``--request-timeout-s`` counted encoding: 1,500 SciFact abstracts got a 503 after
61 s on the 2-core CPU while the server went on encoding them. Prints the status, seconds and texts/s of each, and
appends one JSON line each to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a checkout without installing

import httpx  # noqa: E402

from robustir.data.beir import corpus_file, load_corpus  # noqa: E402
from robustir.serving import ServeConfig, create_app, running_server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="BEIR folder: the texts are its first corpus documents")
    parser.add_argument("--texts", type=int, default=1500)
    parser.add_argument("--request-timeout-s", type=float, default=None, help="default: the server's (60)")
    parser.add_argument("--no-langchain", action="store_true")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    corpus, _ = load_corpus(corpus_file(Path(args.data)))
    texts = corpus.texts_for_encoding()[:args.texts]
    options = {"request_timeout_s": args.request_timeout_s} if args.request_timeout_s else {}
    app = create_app(None, None, ServeConfig(**options))  # the defaults: the bundled MiniLM, the CPU's precision
    server = app.state.server
    rows = []
    with running_server(app) as url:
        tick = time.perf_counter()
        reply = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=3600)
        seconds = time.perf_counter() - tick
        rows.append({"client": "httpx, one request", "texts": len(texts), "status": reply.status_code,
                     "seconds": round(seconds, 1), "texts_per_s": round(len(texts) / seconds, 1)})
        print(json.dumps(rows[-1]), flush=True)
        try:
            if args.no_langchain:
                raise ImportError
            from langchain_openai import OpenAIEmbeddings
        except ImportError:
            print("LangChain skipped (--no-langchain, or langchain_openai not installed)", flush=True)
        else:
            client = OpenAIEmbeddings(model=server.name, base_url=f"{url}/v1", api_key="none",
                                      check_embedding_ctx_length=False)  # chunk_size: its default, 1000
            tick = time.perf_counter()
            try:
                vectors = client.embed_documents(texts)
                status = f"ok, {len(vectors)} vectors"
            except Exception as exc:  # noqa: BLE001 - what the client raised is the result
                status = f"{type(exc).__name__}: {str(exc)[:120]}"
            seconds = time.perf_counter() - tick
            rows.append({"client": "LangChain OpenAIEmbeddings.embed_documents (chunk_size 1000)", "texts": len(texts),
                         "status": status, "seconds": round(seconds, 1), "texts_per_s": round(len(texts) / seconds, 1)})
            print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        row.update({"precision": server.precision, "workers": server.workers, "max_batch_size":
                    server.config.max_batch_size, "request_timeout_s": server.config.request_timeout_s,
                    "machine": platform.processor() or platform.machine()})
    if args.output:
        with open(args.output, "a", encoding="utf-8") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
