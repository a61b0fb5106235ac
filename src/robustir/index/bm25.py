"""BM25 retrieval with bm25s, for English and for text without spaces (Chinese, Japanese).

Latin-script words use bm25s' default word pattern, English stop words and the Snowball stemmer
(the settings that reproduce the published BEIR BM25 figures). A run of CJK characters has no word
boundaries, so it becomes its character unigrams and bigrams: a segmenter-free analysis that works
well for Chinese retrieval and needs no dictionary.

BM25 never touches the GPU. bm25s (0.3.x) imports JAX when it is installed -- ``bm25s/__init__.py`` imports
``bm25s.selection``, which runs ``import jax.lax`` and a warm-up ``jax.lax.top_k`` at import time -- and JAX's first
use pre-allocates 75% of a GPU's memory, starving the encoder and the training that share the process. bm25s reads
no setting that turns this off, and every submodule import runs the package ``__init__`` first, so
:func:`import_bm25s` imports bm25s with ``jax`` blocked (``sys.modules`` entries of None make ``import jax`` raise
ImportError, which bm25s catches: its numpy top-k is used), then unblocks it, so other code can still import JAX.
Retrieval asks for the numpy backend explicitly (``BM25(backend="numpy")``, ``retrieve(backend_selection="numpy")``),
and ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` is set (unless already set) as a safety net for JAX imported by anyone.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from array import array
from typing import Iterable, Iterator, Sequence

import numpy as np

from ..data.cjk import CJK_RUN
from ..validation import config_dataclass, Fraction, NonNegativeFloat

logger = logging.getLogger(__name__)

_WORD = re.compile(r"(?u)\b\w\w+\b")
_TOKEN = re.compile(r"(?u)\w+")


def split_words(text: str) -> list[str]:
    """Words for BM25: ``\\w\\w+`` words outside CJK runs; CJK runs as character unigrams + bigrams."""
    if not CJK_RUN.search(text):
        return _WORD.findall(text)
    tokens: list[str] = []
    for piece in _TOKEN.findall(text):
        position = 0
        for match in CJK_RUN.finditer(piece):
            tokens.extend(w for w in _WORD.findall(piece[position:match.start()]))
            run = match.group()
            tokens.extend(run)
            tokens.extend(run[i:i + 2] for i in range(len(run) - 1))
            position = match.end()
        tokens.extend(_WORD.findall(piece[position:]))
    return tokens


_IMPORT_LOCK = threading.Lock()
_JAX_MODULES = ("jax", "jax.lax")


def import_bm25s():
    """``bm25s``, imported without importing JAX (see the module docstring); later calls return the module."""
    module = sys.modules.get("bm25s")
    if module is not None:
        return module
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import logging

    with _IMPORT_LOCK:
        # bm25s sets its own logger to DEBUG when imported: keep the level someone set before (the CLI sets WARNING)
        level = logging.getLogger("bm25s").level
        saved = {name: sys.modules[name] for name in _JAX_MODULES if name in sys.modules}
        for name in _JAX_MODULES:
            sys.modules[name] = None  # type: ignore[assignment]  # ``import jax`` -> ImportError
        try:
            import bm25s
            import bm25s.tokenization  # noqa: F401
        finally:
            for name in _JAX_MODULES:
                if name in saved:
                    sys.modules[name] = saved[name]
                else:
                    sys.modules.pop(name, None)
            logging.getLogger("bm25s").setLevel(level)
    return bm25s


@config_dataclass
class BM25Config:
    k1: NonNegativeFloat = 1.5
    b: Fraction = 0.75
    method: str = "lucene"
    stopwords: str | None = "english"
    stemmer: str | None = "english"


class BM25Index:
    """``index(texts)`` once, then ``search(queries, k)`` → (scores, row indices), both ``(nq, k)``."""

    def __init__(self, config: BM25Config | None = None) -> None:
        bm25s = import_bm25s()
        Tokenizer = bm25s.tokenization.Tokenizer

        self.config = config or BM25Config()
        stemmer = None
        if self.config.stemmer:
            import Stemmer

            stemmer = Stemmer.Stemmer(self.config.stemmer)
        self._tokenizer = Tokenizer(lower=True, splitter=split_words, stopwords=self.config.stopwords or [],
                                    stemmer=stemmer)
        self._retriever = bm25s.BM25(k1=self.config.k1, b=self.config.b, method=self.config.method,
                                     backend="numpy")
        self.size = 0

    def index(self, texts: Sequence[str], show_progress: bool = False) -> "BM25Index":
        ids = self._tokenizer.tokenize(list(texts), update_vocab=True, return_as="ids",
                                       show_progress=show_progress)
        vocab = self._tokenizer.get_vocab_dict()
        bm25s = import_bm25s()
        self._retriever.index(bm25s.tokenization.Tokenized(ids=ids, vocab=vocab), show_progress=show_progress)
        self.size = len(texts)
        return self

    def index_chunks(self, chunks: Iterable[Sequence[str]], show_progress: bool = False) -> "BM25Index":
        """:meth:`index` over texts that come a chunk at a time (read from a file, say): the same index (same
        vocabulary ids, statistics and scores -- bm25s's own builder runs on the same token ids), but the token ids
        wait in one int32 array (4 bytes a token) instead of a Python list per document (about 36 bytes a token),
        and no more than one chunk of texts is held at a time. The index itself is as large as with :meth:`index`
        (about 8 bytes per distinct term of each document, plus the vocabulary)."""
        ids = _TokenIds()
        for chunk in chunks:
            for doc in self._tokenizer.streaming_tokenize(list(chunk), update_vocab=True):
                ids.append(doc)
        bm25s = import_bm25s()
        self._retriever.index(bm25s.tokenization.Tokenized(ids=ids, vocab=self._tokenizer.get_vocab_dict()),
                              show_progress=show_progress)
        self.size = len(ids)
        return self

    def search(self, queries: Sequence[str], k: int = 100, show_progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
        if self.size == 0:
            raise RuntimeError("BM25Index.search called before index()")
        k = min(k, self.size)
        ids = self._tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids",
                                       show_progress=show_progress)
        bm25s = import_bm25s()
        tokenized = bm25s.tokenization.Tokenized(ids=ids, vocab=self._tokenizer.get_vocab_dict())
        indices, scores = self._retriever.retrieve(tokenized, k=k, show_progress=show_progress, n_threads=0,
                                                   backend_selection="numpy")
        return np.asarray(scores, dtype=np.float32), np.asarray(indices, dtype=np.int64)


class _TokenIds:
    """The token ids of every document in one int32 array, handed to bm25s's index builder, which iterates over the
    documents (three times) and asks for their number: each document is a fresh list when its turn comes."""

    def __init__(self) -> None:
        self._flat = array("i")
        self._ends = array("q")

    def append(self, doc: list[int]) -> None:
        self._flat.extend(doc)
        self._ends.append(len(self._flat))

    def __len__(self) -> int:
        return len(self._ends)

    def __iter__(self) -> Iterator[list[int]]:
        start = 0
        for end in self._ends:
            yield self._flat[start:end].tolist()
            start = end
