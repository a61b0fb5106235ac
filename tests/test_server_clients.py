"""LangChain's and LlamaIndex's OpenAI embedding classes against ``robustir serve`` (robustir.serving.app).

Both go through the ``openai`` SDK and send ``{"model", "input": [...], "encoding_format": "base64"}`` (plus
``dimensions`` when set) to ``POST /v1/embeddings``; neither sends ``input_type``, so their *query* methods
(``embed_query``, ``get_query_embedding``) get document vectors too. The served model here has a query
instruction, so a query vector differs from a document vector and the tests can tell which one a client got.

The server runs on 127.0.0.1 with a free port, in a thread (:func:`robustir.serving.running_server`).
"""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest

from extras import require  # noqa: E402  (tests/ is on sys.path)

require("langchain_openai", "llama_index.embeddings.openai", extra="dev")
import langchain_openai  # noqa: E402
import llama_index.embeddings.openai as llama_openai  # noqa: E402

from robustir.models.encoder import Encoder  # noqa: E402
from robustir.serving import ServeConfig, create_app, running_server  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")

KEY = "client-key"
MODEL = "my-retriever"  # a served name that is not the folder's name, nor an OpenAI model name
INSTRUCTION = "query: "
QUERY = "does aspirin protect the heart?"
DOCS = ["Aspirin lowers the risk of a second heart attack.", "Children need more sleep than adults.",
        "line one\nline two"]  # LlamaIndex sends "line one line two": the same WordPiece tokens


@pytest.fixture(scope="module")
def asymmetric_model_dir(tmp_path_factory, tiny_model_dir) -> str:
    """The tiny BERT saved with a query instruction (a sentence-transformers "query" prompt), so that a query and a
    document embed differently. Mean pooling: the random model's CLS vector hardly moves with the text (a query and
    its document vector differ by ~1e-3 with CLS pooling, ~0.08 with mean pooling)."""
    path = tmp_path_factory.mktemp("tiny-asym")
    Encoder.from_pretrained(tiny_model_dir, query_instruction=INSTRUCTION, pooling="mean").save(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(asymmetric_model_dir) -> Encoder:
    encoder = Encoder.from_pretrained(asymmetric_model_dir)
    encoder.eval()
    assert encoder.config.query_instruction == INSTRUCTION and encoder.config.pooling == "mean"
    return encoder


@pytest.fixture(scope="module")
def base_url(asymmetric_model_dir):
    # ServeConfig.default_input_type ("--default-input-type query|document", coming) is left at its default here:
    # a future test could start a second server with default_input_type="query" and check that a client which
    # sends no input_type then gets query vectors from embed_query / get_query_embedding (and from
    # embed_documents too: these clients cannot tell the server which is which).
    app = create_app(asymmetric_model_dir, None, ServeConfig(api_key=KEY, served_model_name=MODEL, max_wait_ms=0))
    with running_server(app) as url:
        yield f"{url}/v1"


def check(vectors, expected: np.ndarray) -> None:
    got = np.asarray(vectors, dtype=np.float32)
    assert got.shape == expected.shape  # one vector per text, of the model's dimension (32)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_the_reference_tells_queries_from_documents(reference):
    """Guards the tests below: were query and document vectors equal, they could not see which one a client got."""
    assert reference.dim == 32
    query, document = reference.encode([QUERY], "query")[0], reference.encode([QUERY], "passage")[0]
    assert np.abs(query - document).max() > 1e-2  # 1000x the tolerance of the comparisons


# ------------------------------------------------------------------------------------------------ LangChain

def langchain(base_url: str, **kwargs):
    # check_embedding_ctx_length=False: send the texts themselves. With the default (True) LangChain tokenises
    # with tiktoken -- which downloads cl100k_base on first use (offline: requests.ConnectionError before any
    # request) -- and then sends token-id arrays, which the server refuses (400 token_ids_not_supported).
    return langchain_openai.OpenAIEmbeddings(model=MODEL, base_url=base_url, api_key=kwargs.pop("api_key", KEY),
                                             check_embedding_ctx_length=False, max_retries=0, timeout=60, **kwargs)


def test_langchain_embeds_queries_and_documents_as_documents(base_url, reference):
    embeddings = langchain(base_url)
    query = embeddings.embed_query(QUERY)
    assert isinstance(query, list) and len(query) == reference.dim
    check([query], reference.encode([QUERY], "passage"))
    documents = embeddings.embed_documents(DOCS)
    assert len(documents) == len(DOCS)
    check(documents, reference.encode(DOCS, "passage"))
    # chunk_size: texts per request (default 1000; keep it <= the server's max_inputs_per_request, 2048)
    check(langchain(base_url, chunk_size=2).embed_documents(DOCS), reference.encode(DOCS, "passage"))
    check(asyncio.run(langchain(base_url).aembed_documents(DOCS)), reference.encode(DOCS, "passage"))


def test_langchain_query_vectors_with_input_type_in_extra_body(base_url, reference):
    queries = langchain(base_url, model_kwargs={"extra_body": {"input_type": "query"}})
    check([queries.embed_query(QUERY)], reference.encode([QUERY], "query"))


def test_langchain_wrong_key_is_refused(base_url):
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        langchain(base_url, api_key="wrong").embed_query(QUERY)


# ------------------------------------------------------------------------------------------------ LlamaIndex

def llamaindex(base_url: str, **kwargs):
    # model_name=..., not model=...: ``model`` must be one of OpenAI's names (ValueError otherwise), while
    # ``model_name`` is sent as it is.
    return llama_openai.OpenAIEmbedding(model_name=MODEL, api_base=base_url, api_key=kwargs.pop("api_key", KEY),
                                        max_retries=0, timeout=60, **kwargs)


def test_llamaindex_embeds_queries_and_documents_as_documents(base_url, reference):
    embeddings = llamaindex(base_url)
    query = embeddings.get_query_embedding(QUERY)
    assert isinstance(query, list) and len(query) == reference.dim
    check([query], reference.encode([QUERY], "passage"))
    check([embeddings.get_text_embedding(DOCS[0])], reference.encode(DOCS[:1], "passage"))
    documents = embeddings.get_text_embedding_batch(DOCS)
    assert len(documents) == len(DOCS)
    check(documents, reference.encode(DOCS, "passage"))
    # embed_batch_size: texts per request (default 100)
    check(llamaindex(base_url, embed_batch_size=2).get_text_embedding_batch(DOCS), reference.encode(DOCS, "passage"))
    check(asyncio.run(llamaindex(base_url).aget_text_embedding_batch(DOCS)), reference.encode(DOCS, "passage"))


def test_llamaindex_query_vectors_with_input_type_in_extra_body(base_url, reference):
    queries = llamaindex(base_url, additional_kwargs={"extra_body": {"input_type": "query"}})
    check([queries.get_query_embedding(QUERY)], reference.encode([QUERY], "query"))


def test_llamaindex_wrong_key_is_refused_and_openai_model_names_are_required_for_model(base_url):
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        llamaindex(base_url, api_key="wrong").get_query_embedding(QUERY)
    with pytest.raises(ValueError, match="not a valid OpenAIEmbeddingModelType"):
        llama_openai.OpenAIEmbedding(model=MODEL, api_base=base_url, api_key=KEY)
