"""The audit's teacher and its search pool: embeddings cached per text, the pool each pair's best other passage
is found in, and the random passages (:class:`Pooling`, mixed into :class:`robustir.audit.run._Audit`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ConfigError, DataError
from .checks import normalize, text_hash
from .sample import _corpus_path, _is_beir


class _Embeddings:
    """Distinct texts and their unit embeddings, encoded on demand (each text once)."""

    def __init__(self, encoder, kind: str, config) -> None:
        self.encoder, self.kind, self.config = encoder, kind, config
        self.row: dict[str, int] = {}
        self.blocks: list[np.ndarray] = []
        self._matrix: np.ndarray | None = None

    def preload(self, texts: list[str], vectors: np.ndarray) -> None:
        for text, vector in zip(texts, _unit(vectors)):
            if text not in self.row:
                self.row[text] = len(self.row)
                self.blocks.append(vector[None])
        self._matrix = None

    def add(self, texts: list[str], desc: str) -> None:
        new = list(dict.fromkeys(t for t in texts if t not in self.row))
        if not new:
            return
        vectors = self.encoder.encode(new, self.kind, batch_size=self.config.batch_size,
                                      precision=self.config.precision, show_progress=self.config.progress, desc=desc)
        self.preload(new, vectors)

    @property
    def matrix(self) -> np.ndarray:
        if self._matrix is None:
            self._matrix = np.concatenate(self.blocks) if self.blocks else np.zeros((0, 1), dtype=np.float32)
            self.blocks = [self._matrix]
        return self._matrix

    def of(self, texts: list[str]) -> np.ndarray:
        return self.matrix[[self.row[t] for t in texts]]


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


class _Pool:
    """The search pool: the best-scoring passages for a query, leaving out given texts."""

    chunk = 1024  # queries scored against the whole pool at a time
    depth = 16  # top passages looked at before the excluded ones force a full-row search

    def __init__(self, texts: list[str], vectors: np.ndarray, device) -> None:
        import torch

        self.texts = texts
        self.hashes = np.fromiter((text_hash(t) for t in texts), dtype=np.int64, count=len(texts))
        self.device = device
        self.vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        self.matrix = torch.from_numpy(self.vectors).to(device)
        self._normalized: dict[int, str] = {}

    def best(self, queries: np.ndarray, excluded: list[set[int]],
             inside: list[list[str]] | None = None) -> tuple[np.ndarray, list[int]]:
        """Per query: the best score among pool passages whose normalised-text hash is not in its ``excluded`` set
        (and, given ``inside``, whose normalised text is not part of one of those texts: a sentence cut from the
        positive is the positive, not a competitor), and that passage's row (-1 and -inf when none is left)."""
        import torch

        scores_out = np.full(len(queries), -np.inf, dtype=np.float64)
        rows_out = [-1] * len(queries)
        for start in range(0, len(queries), self.chunk):
            block = torch.from_numpy(np.ascontiguousarray(queries[start:start + self.chunk],
                                                          dtype=np.float32)).to(self.device)
            sims = block @ self.matrix.T
            k = min(self.depth, sims.shape[1])
            top = torch.topk(sims, k, dim=1)
            top_scores, top_rows = top.values.float().cpu().numpy(), top.indices.cpu().numpy()
            for i in range(block.shape[0]):
                banned = excluded[start + i]
                containers = inside[start + i] if inside else ()

                def allowed(row: int) -> bool:
                    if int(self.hashes[row]) in banned:
                        return False
                    return not containers or not any(self.normalized(row) in c for c in containers)

                found = next((j for j in range(k) if allowed(int(top_rows[i, j]))), None)
                if found is None and k < sims.shape[1]:  # more excluded passages than the depth: the whole row
                    row = sims[i].float().cpu().numpy()
                    for candidate in np.argsort(-row):
                        if allowed(int(candidate)):
                            scores_out[start + i], rows_out[start + i] = float(row[candidate]), int(candidate)
                            break
                    continue
                if found is not None:
                    scores_out[start + i] = float(top_scores[i, found])
                    rows_out[start + i] = int(top_rows[i, found])
        return scores_out, rows_out

    def normalized(self, row: int) -> str:
        if row not in self._normalized:
            self._normalized[row] = normalize(self.texts[row])
        return self._normalized[row]


def _load_teacher(config):
    from ..models.cross_encoder import is_cross_encoder
    from ..models.encoder import Encoder, resolve_model_path
    from ..resources import default_model_path

    path = resolve_model_path(config.model or default_model_path(), "teacher")
    if is_cross_encoder(path):
        raise ConfigError(f"audit: {config.model} is a cross-encoder; the audit ranks each positive against random "
                          "and corpus passages, which needs an embedding model: give one as --model")
    overrides = {"query_max_length": config.max_length, "passage_max_length": config.max_length} \
        if config.max_length else {}
    return Encoder.from_pretrained(path, device=config.device, **overrides)



class Pooling:
    """The search pool of an audit (the corpus, else the audited records' own passages) and the random passages."""

    # -- the search pool and the random passages
    def pool(self) -> None:
        config = self.config
        corpus = config.corpus or (config.data if _is_beir(Path(config.data)) else None)
        self.queries = _Embeddings(self.encoder, "query", config)
        self.passages = _Embeddings(self.encoder, "passage", config)
        self.pool_source = "corpus" if corpus else "audited passages"
        if corpus:
            from ..data.beir import load_corpus

            self.corpus_path = str(_corpus_path(Path(corpus)))
            loaded, _ = load_corpus(self.corpus_path)
            texts = loaded.texts_for_encoding()
            vectors = self.encoder.encode_corpus(texts, cache_dir=config.cache_dir, batch_size=config.batch_size,
                                                 precision=config.precision, show_progress=config.progress,
                                                 desc="audit: encode corpus")
            self.passages.preload(texts, vectors)
            distinct = list(dict.fromkeys(texts))
            order = list(range(len(distinct)))
            self.rng.shuffle(order)
            random_texts = [distinct[i] for i in order[: config.random_passages + min(len(self.sample), 2000)]]
        else:
            self.corpus_path = None
            random_texts = list(dict.fromkeys(self.passage_sample))
            self.rng.shuffle(random_texts)
        texts = [t for r in self.sample for t in r.pos + r.neg]
        self.passages.add(texts + random_texts, "audit: encode passages")
        self.queries.add([r.query for r in self.sample], "audit: encode queries")
        # the pool: the corpus (with the audited passages, which may not be in it), else the audited passages and
        # the random ones
        pool_texts = list(self.passages.row) if corpus else list(dict.fromkeys(texts + random_texts))
        self.pool_ = _Pool(pool_texts, self.passages.of(pool_texts), self.encoder.device)
        k = min(config.random_passages, max(20, len(random_texts) // 2))
        self.random_texts = random_texts[:k]
        self.null_texts = random_texts[k:] or random_texts  # a null that is also in R is left out of its own rank
        if len(self.random_texts) < 20:
            raise DataError(config.data, f"only {len(random_texts)} distinct passages to draw random ones from",
                            fix="give a larger training file, or a corpus (--corpus) to draw random passages from")
        self.random_matrix = self.passages.of(self.random_texts)

