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


# ------------------------------------------------------------------------------------------------ issue 55: complete
# A server with small limits (8 texts, 4 KiB a request), so batching shows with a few documents; fp32, so the
# vectors MMR re-embeds through /v1/embeddings are the index's own.

LIMITED = 8


@pytest.fixture(scope="module")
def limited(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("integrations-limited")
    corpus = root / "corpus.jsonl"
    rows = [{"_id": "zebra-1", "text": "zebras have stripes", "kind": "zebra"},
            {"_id": "zebra-2", "text": "zebras have stripes", "kind": "zebra"},
            {"_id": "zebra-3", "text": "zebras have stripes", "kind": "zebra"},
            {"_id": "penguin", "text": "penguins live where it is cold", "kind": "bird"},
            {"_id": "a/b", "title": "Slashed", "text": "an id with a slash", "kind": "odd"}]
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    SearchIndex.build(root / "idx", tiny_model_dir, corpus, config=IndexConfig(show_progress=False))[0].close()
    app = create_app(None, root / "idx", ServeConfig(api_key=KEY, max_inputs_per_request=LIMITED,
                                                     max_body_bytes=4096, precision="fp32"))
    with running_server(app) as url:
        yield url


def _store(url, **kwargs):
    from robustir.integrations.langchain import RobustirVectorStore

    return RobustirVectorStore(base_url=url, api_key=KEY, **kwargs)


def test_langchain_writes_are_split_under_the_servers_limits(limited):
    """Issue 55: add_texts over the server's texts per request was one request, refused with 400. Split by count
    (8) and by body size (4 KiB): 20 short texts and 6 long ones go in, each findable."""
    import httpx

    from robustir.integrations import RobustirServerError

    one_request = {"documents": [{"_id": f"x{i}", "text": "t"} for i in range(LIMITED + 1)]}
    refused = httpx.post(limited + "/documents", json=one_request, headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 400  # the limit the store has to stay under
    store = _store(limited)
    ids = store.add_texts([f"batch text {i}" for i in range(20)], metadatas=[{"batch": "count"}] * 20,
                          ids=[f"count-{i}" for i in range(20)])
    assert [d.id for d in store.get_by_ids(ids)] == ids
    long = ["long text " + "word " * 180 + str(i) for i in range(6)]  # ~920 bytes each: 4 per 4 KiB request at most
    assert store.add_texts(long, ids=[f"long-{i}" for i in range(6)]) == [f"long-{i}" for i in range(6)]
    assert [d.page_content for d in store.get_by_ids([f"long-{i}" for i in range(6)])] == long
    store.delete(ids + [f"long-{i}" for i in range(6)])  # deletes are split too
    assert store.get_by_ids(ids) == []
    # an error in a later request names the document by its place in the whole call, and what went in before it
    texts = [f"error text {i}" for i in range(12)]
    texts[10] = "   "
    with pytest.raises(RobustirServerError) as failed:
        store.add_texts(texts, ids=[f"err-{i}" for i in range(12)])
    assert failed.value.error["param"] == "documents[10]" and "8 documents were upserted before" in str(failed.value)
    store.delete([f"err-{i}" for i in range(8)])


def test_langchain_ids_on_only_some_documents(limited):
    """Issue 55: add_documents with ids on only some documents was a 400 for the batch; the others get uuid4s."""
    import uuid

    from langchain_core.documents import Document

    store = _store(limited)
    docs = [Document(page_content="first of some", id="some-1", metadata={"kind": "some"}),
            Document(page_content="second of some", metadata={"kind": "some"}),
            Document(page_content="third of some", id="some-3", metadata={"kind": "some", "title": "Third"})]
    ids = store.add_documents(docs)
    assert ids[0] == "some-1" and ids[2] == "some-3" and uuid.UUID(ids[1]).version == 4
    got = {d.id: d for d in store.get_by_ids(ids + ["no-such-id"])}  # a missing id is left out, not an error
    assert set(got) == set(ids) and got[ids[1]].page_content == "second of some"
    assert got["some-3"].metadata["title"] == "Third" and got["some-3"].metadata["kind"] == "some"
    assert [d.id for d in store.get_by_ids(["a/b"])] == ["a/b"]  # an id with a slash
    store.delete(ids)


def test_langchain_relevance_scores_and_thresholds(limited):
    store = _store(limited)
    raw = store.similarity_search_with_score("zebras have stripes", k=5)
    relevance = store.similarity_search_with_relevance_scores("zebras have stripes", k=5)
    assert [d.id for d, _ in relevance] == [d.id for d, _ in raw]
    assert [r for _, r in relevance] == pytest.approx([min(1.0, max(0.0, s)) for _, s in raw])
    assert all(0.0 <= r <= 1.0 for _, r in relevance)
    cut = sorted(r for _, r in relevance)[2]  # between the scores: some kept, some not
    kept = store.similarity_search_with_relevance_scores("zebras have stripes", k=5, score_threshold=cut)
    assert [d.id for d, _ in kept] == [d.id for d, r in relevance if r >= cut] and 0 < len(kept) < 5
    retriever = store.as_retriever(search_type="similarity_score_threshold",
                                   search_kwargs={"k": 5, "score_threshold": cut})
    assert [d.id for d in retriever.invoke("zebras have stripes")] == [d.id for d, _ in kept]
    hybrid = store.similarity_search_with_relevance_scores("zebras have stripes", k=3, mode="hybrid")
    hybrid_raw = store.similarity_search_with_score("zebras have stripes", k=3, mode="hybrid")
    assert [r for _, r in hybrid] == pytest.approx([s * 61 / 2 for _, s in hybrid_raw])  # RRF over its best
    assert 0.95 < hybrid[0][1] <= 1.0  # near first in both lists (three equal copies may tie in either order)
    with pytest.raises(ValueError, match="lexical"):
        store.similarity_search_with_relevance_scores("zebras", k=3, mode="lexical")
    from robustir.integrations.langchain import RobustirRetriever

    thresholded = RobustirRetriever(base_url=limited, api_key=KEY, top_k=5, score_threshold=cut)
    assert [d.id for d in thresholded.invoke("zebras have stripes")] == [d.id for d, _ in kept]
    with pytest.raises(TypeError, match="unknown search option"):
        store.similarity_search("zebras", k=2, filtr={"kind": "zebra"})


def test_langchain_maximal_marginal_relevance(limited):
    """Three copies of one text: a plain search returns copies; MMR (the server returns no vectors: re-embedded
    through /v1/embeddings) takes one copy, then the most different document."""
    store = _store(limited)
    plain = [d.id for d in store.similarity_search("zebras have stripes", k=2)]
    assert all(i.startswith("zebra-") for i in plain)
    diverse = store.max_marginal_relevance_search("zebras have stripes", k=2, fetch_k=5, lambda_mult=0.25)
    assert diverse[0].id.startswith("zebra-") and not diverse[1].id.startswith("zebra-")
    same = store.max_marginal_relevance_search("zebras have stripes", k=2, fetch_k=5, lambda_mult=1.0)
    assert all(d.id.startswith("zebra-") for d in same)  # lambda 1: relevance alone
    filtered = store.max_marginal_relevance_search("zebras", k=2, fetch_k=5, filter={"kind": {"$ne": "zebra"}})
    assert {d.metadata["kind"] for d in filtered} <= {"bird", "odd"}
    retriever = store.as_retriever(search_type="mmr", search_kwargs={"k": 2, "fetch_k": 5, "lambda_mult": 0.25})
    assert [d.id for d in retriever.invoke("zebras have stripes")] == [d.id for d in diverse]
    # score_threshold= drops the candidates below it before MMR picks: over the copies' relevance, only copies remain
    relevance = store.similarity_search_with_relevance_scores("zebras have stripes", k=5)
    copies = min(r for d, r in relevance if d.id.startswith("zebra-"))
    others = max(r for d, r in relevance if not d.id.startswith("zebra-"))
    assert copies > others
    kept = store.max_marginal_relevance_search("zebras have stripes", k=2, fetch_k=5, lambda_mult=0.25,
                                               score_threshold=(copies + others) / 2)
    assert len(kept) == 2 and all(d.id.startswith("zebra-") for d in kept)
    # issue 55: by vector, through /search's "vector" -- the query's own vector finds what the text search finds
    from robustir.integrations.http import embed

    vector = embed(store.connection, ["zebras have stripes"], "query")[0].tolist()
    assert [d.id for d in store.similarity_search_by_vector(vector, k=2)] == plain
    assert [d.id for d in store.max_marginal_relevance_search_by_vector(vector, k=2, fetch_k=5, lambda_mult=0.25)] \
        == [d.id for d in diverse]
    bird = store.similarity_search_by_vector(vector, k=1, filter={"kind": "bird"})
    assert [d.id for d in bird] == ["penguin"]
    with pytest.raises(TypeError, match="filter= only"):
        store.similarity_search_by_vector(vector, k=2, mode="hybrid")


def test_llamaindex_filters_map_to_the_servers_language():
    from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters

    from robustir.integrations.llamaindex import server_filter

    filters = MetadataFilters(filters=[
        MetadataFilter(key="year", value=2020, operator=FilterOperator.GTE),
        MetadataFilters(filters=[MetadataFilter(key="lang", value=["en", "de"], operator=FilterOperator.IN),
                                 MetadataFilter(key="url", value=None, operator=FilterOperator.IS_EMPTY)],
                        condition=FilterCondition.OR),
        MetadataFilters(filters=[MetadataFilter(key="kind", value="ad")], condition=FilterCondition.NOT)])
    assert server_filter(filters) == {"$and": [
        {"year": {"$gte": 2020}},
        {"$or": [{"lang": {"$in": ["en", "de"]}}, {"$or": [{"url": None}, {"url": ""}]}]},
        {"$not": {"$or": [{"kind": {"$eq": "ad"}}]}}]}
    with pytest.raises(ValueError, match="no 'contains' operator"):
        server_filter(MetadataFilters(filters=[MetadataFilter(key="tags", value="x",
                                                              operator=FilterOperator.CONTAINS)]))


def test_llamaindex_vector_store_adds_queries_and_deletes(limited):
    from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode
    from llama_index.core.vector_stores.types import (FilterCondition, FilterOperator, MetadataFilter,
                                                      MetadataFilters, VectorStoreQuery, VectorStoreQueryMode)

    from robustir.integrations.llamaindex import RobustirLlamaVectorStore

    store = RobustirLlamaVectorStore(base_url=limited, api_key=KEY)
    nodes = [TextNode(id_=f"node-{i}", text=f"llama node {i} about {'cats' if i % 2 else 'dogs'}",
                      metadata={"animal": "cat" if i % 2 else "dog", "rank": i},
                      relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=f"doc-{i // 5}")})
             for i in range(10)]  # 10 nodes: two requests under the server's 8
    assert store.add(nodes) == [n.node_id for n in nodes]

    def ids(**query) -> set[str]:
        return set(store.query(VectorStoreQuery(query_str="llama node", similarity_top_k=20, **query)).ids)

    llama = {f"node-{i}" for i in range(10)}
    assert ids() >= llama
    cats = MetadataFilters(filters=[MetadataFilter(key="animal", value="cat")])
    assert ids(filters=cats) == {f"node-{i}" for i in range(1, 10, 2)}
    ranked = MetadataFilters(filters=[MetadataFilter(key="rank", value=7, operator=FilterOperator.GTE),
                                      MetadataFilter(key="rank", value=[0, 2], operator=FilterOperator.IN)],
                             condition=FilterCondition.OR)
    assert ids(filters=ranked) == {"node-0", "node-2", "node-7", "node-8", "node-9"}
    not_dogs = MetadataFilters(filters=[MetadataFilter(key="animal", value="dog")], condition=FilterCondition.NOT)
    assert ids(filters=not_dogs) & llama == {f"node-{i}" for i in range(1, 10, 2)}
    assert ids(doc_ids=["doc-1"]) == {f"node-{i}" for i in range(5, 10)}
    assert ids(node_ids=["node-3", "node-4"], filters=cats) == {"node-3"}
    result = store.query(VectorStoreQuery(query_str="llama node 3 about cats", similarity_top_k=3, filters=cats))
    assert len(result.nodes) == 3 and result.similarities == sorted(result.similarities, reverse=True)
    top = result.nodes[0]
    assert top.metadata["animal"] == "cat" and top.ref_doc_id in ("doc-0", "doc-1")
    for mode in (VectorStoreQueryMode.HYBRID, VectorStoreQueryMode.TEXT_SEARCH, VectorStoreQueryMode.MMR):
        found = store.query(VectorStoreQuery(query_str="llama node cats", similarity_top_k=2, mode=mode, alpha=0.7,
                                             filters=cats))
        assert len(found.ids) == 2 and set(found.ids) <= {f"node-{i}" for i in range(1, 10, 2)}, mode
    got = store.get_nodes(node_ids=["node-1", "node-2", "nope"])
    assert [n.node_id for n in got] == ["node-1", "node-2"] and got[0].get_content() == "llama node 1 about cats"
    assert [n.node_id for n in store.get_nodes(node_ids=["node-1", "node-2"], filters=cats)] == ["node-1"]
    store.delete("doc-0")  # the nodes cut from doc-0
    assert ids() & llama == {f"node-{i}" for i in range(5, 10)}
    store.delete_nodes(node_ids=["node-5", "node-6", "never-added"], filters=cats)
    assert ids() & llama == {"node-6", "node-7", "node-8", "node-9"}
    store.delete_nodes(filters=MetadataFilters(filters=[MetadataFilter(key="animal", value="dog")]))
    assert ids() & llama == {"node-7", "node-9"}
    store.delete_nodes(node_ids=["node-7", "node-9"])
    assert not ids() & llama
    store.delete("doc-never")  # nothing to delete: not an error
    with pytest.raises(ValueError, match="give query_str"):
        store.query(VectorStoreQuery(similarity_top_k=2))
    # issue 55: by query_embedding alone, through /search's vector -- the text query's vector finds what it finds
    from robustir.integrations.http import embed, search

    vector = embed(store._connection, ["zebras have stripes"], "query")[0].tolist()
    by_text = [h["id"] for h in search(store._connection, "zebras have stripes", top_k=3)]
    assert store.query(VectorStoreQuery(query_embedding=vector, similarity_top_k=3)).ids == by_text
    with pytest.raises(ValueError, match="needs query_str"):
        store.query(VectorStoreQuery(query_embedding=vector, similarity_top_k=2, mode=VectorStoreQueryMode.HYBRID))
    with pytest.raises(ValueError, match="no counterpart"):
        store.query(VectorStoreQuery(query_str="x", mode=VectorStoreQueryMode.SVM))


def test_llamaindex_vector_store_under_a_vector_store_index(limited):
    """The store as LlamaIndex uses it: VectorStoreIndex.from_vector_store; queries go as text (the server embeds)."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.schema import TextNode

    from robustir.integrations.llamaindex import RobustirLlamaVectorStore

    store = RobustirLlamaVectorStore(base_url=limited, api_key=KEY)
    index = VectorStoreIndex.from_vector_store(store, embed_model=MockEmbedding(embed_dim=8))
    index.insert_nodes([TextNode(id_="vsi-1", text="giraffes have long necks", metadata={"kind": "vsi"})])
    hits = index.as_retriever(similarity_top_k=1).retrieve("giraffes have long necks")
    assert hits[0].node.node_id == "vsi-1" and hits[0].node.metadata["kind"] == "vsi"
    store.delete_nodes(node_ids=["vsi-1"])


def test_llamaindex_mmr_by_query_embedding_alone(limited):
    """Issue 55: MMR with no query text -- the query's own vector searches (/search by vector) and LlamaIndex's MMR
    picks among the candidates, re-embedded: the same nodes as MMR by the text whose vector it is."""
    from llama_index.core.vector_stores.types import VectorStoreQuery, VectorStoreQueryMode

    from robustir.integrations.http import embed
    from robustir.integrations.llamaindex import RobustirLlamaVectorStore

    store = RobustirLlamaVectorStore(base_url=limited, api_key=KEY)
    vector = embed(store._connection, ["zebras have stripes"], "query")[0].tolist()

    def mmr(threshold: float, **query) -> list[str]:
        return store.query(VectorStoreQuery(similarity_top_k=2, mode=VectorStoreQueryMode.MMR,
                                            mmr_threshold=threshold, **query), mmr_prefetch_k=5).ids

    diverse = mmr(0.25, query_embedding=vector)
    assert diverse[0].startswith("zebra-") and not diverse[1].startswith("zebra-"), diverse
    assert diverse == mmr(0.25, query_str="zebras have stripes")
    assert all(i.startswith("zebra-") for i in mmr(1.0, query_embedding=vector))  # relevance alone: the copies
    with pytest.raises(ValueError, match="needs query_str"):
        store.query(VectorStoreQuery(query_embedding=vector, mode=VectorStoreQueryMode.SPARSE))


@pytest.fixture()
def small(tmp_path, tiny_model_dir):
    """A server of its own (the tests above share theirs): 20 documents, 8 per request."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"c{i}", "text": f"clearable document {i}"}) + "\n"
                              for i in range(20)), encoding="utf-8")
    SearchIndex.build(tmp_path / "idx", tiny_model_dir, corpus, config=IndexConfig(show_progress=False))[0].close()
    app = create_app(None, tmp_path / "idx", ServeConfig(api_key=KEY, max_inputs_per_request=8, precision="fp32"))
    with running_server(app) as url:
        yield url


def test_llamaindex_clear_deletes_every_document_in_rounds_under_the_limits(small):
    """clear(): the server lists no documents and a filter deletes at most 8 here, so 20 documents take three rounds
    of "ids from a zero-vector search, then delete them"; the index is empty after, and a cleared store takes new
    nodes (aclear too)."""
    import httpx
    from llama_index.core.schema import TextNode
    from llama_index.core.vector_stores.types import VectorStoreQuery

    from robustir.integrations.llamaindex import RobustirLlamaVectorStore

    store = RobustirLlamaVectorStore(base_url=small, api_key=KEY)

    def count() -> int:
        return httpx.get(f"{small}/info", headers={"Authorization": f"Bearer {KEY}"}).json()["index"]["documents"]

    assert count() == 20
    store.clear()
    assert count() == 0
    assert store.query(VectorStoreQuery(query_str="clearable document", similarity_top_k=5)).ids == []
    store.add([TextNode(id_="fresh", text="a node after the clear")])
    assert store.query(VectorStoreQuery(query_str="a node after the clear", similarity_top_k=5)).ids == ["fresh"]
    asyncio.run(store.aclear())
    assert count() == 0
    store.clear()  # an empty index: nothing to do
