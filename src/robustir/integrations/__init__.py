"""Clients of ``robustir serve`` for RAG frameworks (optional extras): a LangChain retriever and vector store
(:mod:`robustir.integrations.langchain`, ``pip install robustir[langchain]``) and a LlamaIndex retriever
(:mod:`robustir.integrations.llamaindex`, ``pip install robustir[llamaindex]``), over the server's ``/search`` and
``/documents`` routes. :func:`search` is the one HTTP call they share."""

from .http import Connection, RobustirServerError, search

__all__ = ["Connection", "RobustirServerError", "search"]
