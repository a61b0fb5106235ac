"""Clients of ``robustir serve`` for RAG frameworks (optional extras): a LangChain retriever and vector store
(:mod:`robustir.integrations.langchain`, ``pip install robustir[langchain]``) and a LlamaIndex retriever and vector
store (:mod:`robustir.integrations.llamaindex`, ``pip install robustir[llamaindex]``), over the server's ``/search``,
``/documents`` and ``/v1/embeddings`` routes. :mod:`robustir.integrations.http` holds the HTTP calls they share
(writes split under the server's limits, relevance scores, MMR's candidates)."""

from .http import Connection, RobustirServerError, search

__all__ = ["Connection", "RobustirServerError", "search"]
