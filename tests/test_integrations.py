"""Issue 36: the LangChain retriever and vector store and the LlamaIndex retriever for robustir serve's /search and
/documents, against a real server on 127.0.0.1 (tiny model and index)."""

from __future__ import annotations

import asyncio
import json

import pytest

from robustir.index.store import IndexConfig, SearchIndex
from robustir.serving import ServeConfig, create_app, running_server

from extras import require  # noqa: E402  (tests/ is on sys.path)

require("langchain_core", extra="langchain")
require("llama_index.core", extra="llamaindex")

KEY = "int-key"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("integrations")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "title": f"Title {i}", "text": f"document {i} about topic{i}",
                                          "source": "a" if i % 2 else "b"}) + "\n" for i in range(10)),
                      encoding="utf-8")
    SearchIndex.build(root / "idx", tiny_model_dir, corpus, config=IndexConfig(show_progress=False))[0].close()
    app = create_app(None, root / "idx", ServeConfig(api_key=KEY))
    with running_server(app) as url:
        yield url


def test_langchain_retriever_returns_the_hits_as_documents(served):
    from robustir.integrations import RobustirServerError
    from robustir.integrations.langchain import RobustirRetriever

    retriever = RobustirRetriever(base_url=served + "/v1", api_key=KEY, top_k=3, mode="lexical")
    docs = retriever.invoke("document topic7")
    assert len(docs) == 3 and docs[0].id == "d7" and docs[0].page_content == "document 7 about topic7"
    assert docs[0].metadata["title"] == "Title 7" and docs[0].metadata["source"] == "a"
    filtered = RobustirRetriever(base_url=served, api_key=KEY, top_k=10, filter={"source": "b"}).invoke("document")
    assert len(filtered) == 5 and {d.metadata["source"] for d in filtered} == {"b"}
    assert [d.id for d in asyncio.run(retriever.ainvoke("topic4"))][0] == "d4"
    with pytest.raises(RobustirServerError, match="filter.colour: 'colour' is in no document") as refused:
        RobustirRetriever(base_url=served, api_key=KEY, filter={"colour": "red"}).invoke("x")
    assert refused.value.status == 400 and refused.value.error["param"] == "filter"
    with pytest.raises(RobustirServerError, match="401"):
        RobustirRetriever(base_url=served).invoke("x")


def test_langchain_vector_store_adds_searches_and_deletes_through_the_server(served):
    from robustir.integrations.langchain import RobustirVectorStore

    store = RobustirVectorStore(base_url=served, api_key=KEY, mode="lexical")
    ids = store.add_texts(["zebras have stripes", "penguins live in the cold"], metadatas=[{"source": "z"}, {}],
                          ids=["z1", "p1"])
    assert ids == ["z1", "p1"]
    found = store.similarity_search_with_score("zebras stripes", k=1)
    assert found[0][0].id == "z1" and found[0][0].metadata["source"] == "z" and found[0][1] > 0
    assert [d.id for d in store.similarity_search("cold penguins", k=1, filter={"source": {"$exists": False}})] == \
        ["p1"]
    assert store.delete(["z1", "p1"]) is True
    assert "z1" not in [d.id for d in store.similarity_search("zebras stripes", k=12)]
    fresh = RobustirVectorStore.from_texts(["a from_texts passage"], None, ids=["f1"], base_url=served, api_key=KEY)
    assert fresh.similarity_search("from_texts passage", k=1, mode="lexical")[0].id == "f1"
    fresh.delete(["f1"])


def test_llamaindex_retriever_returns_nodes_with_scores(served):
    from llama_index.core.schema import QueryBundle

    from robustir.integrations.llamaindex import RobustirLlamaRetriever

    retriever = RobustirLlamaRetriever(base_url=served, api_key=KEY, top_k=2, mode="lexical")
    nodes = retriever.retrieve("document topic3")
    assert [n.node.node_id for n in nodes][0] == "d3" and len(nodes) == 2
    assert nodes[0].node.get_content() == "document 3 about topic3" and nodes[0].node.metadata["title"] == "Title 3"
    assert nodes[0].score >= nodes[1].score
    reranked = RobustirLlamaRetriever(base_url=served, api_key=KEY, top_k=2, mode="lexical", rerank=True)
    again = asyncio.run(reranked.aretrieve(QueryBundle("document topic3")))
    assert len(again) == 2 and all(isinstance(n.score, float) for n in again)
