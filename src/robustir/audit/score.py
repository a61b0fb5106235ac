"""The audit's second pass: the teacher scores the sampled pairs, the planted nulls and the trusted reference
pairs (:class:`Scoring`, mixed into :class:`robustir.audit.run._Audit`); the statistics become rates in
:mod:`robustir.audit.estimate`."""

from __future__ import annotations

import numpy as np

from pathlib import Path

from .checks import normalize, text_hash
from .pool import _Pool, _unit
from .sample import Record, _corpus_path


class Scoring:
    """Pass 2 of an audit: cosine, random p-value and gap of every sampled pair, its nulls and the reference."""

    # -- pass 2: the teacher on the sample
    def _null_excluded(self, record: Record, pseudo: str) -> set[int]:
        """Passages a planted null is not compared with: itself and, when the pool is the audited passages (where a
        real false positive's true positive is missing), the record's own positives."""
        banned = {text_hash(pseudo)}
        return banned if self.corpus_path else banned | {text_hash(p) for p in record.pos}

    def _measure(self, items: list[tuple[str, Record, str, int]], excluded: list[set[int]]) -> list[dict]:
        """Cosine, random p-value and gap of each ``(kind, record, passage, positive index)``."""
        from ..filtering.teacher import random_p_value

        q = self.queries.of([record.query for _, record, _, _ in items])
        p = self.passages.of([text for _, _, text, _ in items])
        inside = [[normalize(t) for t in (record.pos if kind == "pair" else [text])]
                  for kind, record, text, _ in items]
        best, best_rows = self.pool_.best(q, excluded, inside)
        # scores the decisions compare are taken in float64, row by row: the same whatever the block size (a float32
        # matrix product rounds differently with the shapes, and a tie may flip)
        q64, p64 = q.astype(np.float64), p.astype(np.float64)
        scores = np.einsum("nd,nd->n", q64, p64)
        rand = np.einsum("nd,kd->nk", q64, self.random_matrix.astype(np.float64))
        for n, row in enumerate(best_rows):
            if row >= 0:
                best[n] = float(q64[n] @ self.pool_.vectors[row].astype(np.float64))
        out = []
        for n, (kind, record, text, j) in enumerate(items):
            s = float(scores[n])
            u = random_p_value(s, rand[n], self.random_hashes == text_hash(text))
            top = best[n]
            out.append({"kind": kind, "record": record, "positive": j, "score": s, "u": u,
                        "gap": float(top - s) if np.isfinite(top) else -np.inf,
                        "competitor": self.pool_.texts[best_rows[n]] if best_rows[n] >= 0 else None})
        return out

    def _near_nulls(self, measured: list[dict]) -> list[dict]:
        """Near-miss nulls: each record's best other passage of the search pool -- the teacher's own nearest
        non-positive, the passage a dense near-miss false positive would be -- standing in as its positive.

        Why a second family beside the first-negative nulls: a wrong positive's gap is at least the gap of the
        teacher's top non-positive for the same query (anything above the top non-positive is a positive, and the
        top non-positive scores at least as high as any other), so these nulls have the smallest gaps any near-miss
        can have. Calibrated on them the hard-like share cannot miss near-miss noise the way first-negative nulls
        do when the wrong positives are nearer to the query than the mined negatives (dense near-misses under
        BM25 pools)."""
        items, excluded, seen = [], [], set()
        for item in measured:
            record = item["record"]
            if item["kind"] != "pair" or record.index in seen or not item["competitor"]:
                continue
            seen.add(record.index)
            items.append(("near", record, item["competitor"], -1))
            excluded.append(self._null_excluded(record, item["competitor"]))
        return self._measure(items, excluded) if items else []

    def score(self) -> dict:
        config = self.config
        self.random_hashes = np.fromiter((text_hash(t) for t in self.random_texts), dtype=np.int64,
                                         count=len(self.random_texts))
        pairs: list[dict] = []
        hard_null, near_null, random_null_gap, random_null_u = [], [], [], []
        neg_scores: dict[int, np.ndarray] = {}
        from tqdm.auto import tqdm

        bar = tqdm(total=len(self.sample), desc="audit: score", unit="record", disable=not config.progress)
        for start in range(0, len(self.sample), self.block):
            block = self.sample[start:start + self.block]
            items, excluded = [], []
            for record in block:
                positives = {text_hash(p) for p in record.pos}
                for j, text in enumerate(record.pos):
                    items.append(("pair", record, text, j))
                    excluded.append(positives)
                if record.neg:  # hard null: the record's first (hardest-mined) negative stands in as its positive
                    items.append(("hard", record, record.neg[0], -1))
                    excluded.append(self._null_excluded(record, record.neg[0]))
                null_text = self.null_texts[(record.index * 7919 + config.seed) % len(self.null_texts)]
                items.append(("random", record, null_text, -1))
                excluded.append(self._null_excluded(record, null_text))
            measured = self._measure(items, excluded)
            measured += self._near_nulls(measured)
            for item in measured:
                if item["kind"] == "random":
                    random_null_gap.append((item["gap"], item["u"]))
                    random_null_u.append(item["u"])
                elif item["kind"] == "hard":
                    hard_null.append((item["gap"], item["u"]))
                elif item["kind"] == "near":
                    near_null.append((item["gap"], item["u"]))
                else:
                    record = item["record"]
                    if record.index not in neg_scores:  # once per record, however many positives it has
                        neg_scores[record.index] = (self.passages.of(record.neg) @ self.queries.of([record.query])[0]) \
                            if record.neg else np.zeros(0, dtype=np.float32)
                    item["neg_scores"] = neg_scores[record.index]
                    item["beaten_by_negatives"] = int((item["neg_scores"] > item["score"]).sum())
                    item["negatives"] = len(record.neg)
                    pairs.append(item)
            bar.update(len(block))
        bar.close()
        return {"pairs": pairs, "hard_null": np.array(hard_null, dtype=np.float64).reshape(-1, 2),
                "near_null": np.array(near_null, dtype=np.float64).reshape(-1, 2),
                "random_null_gap": np.array(random_null_gap, dtype=np.float64).reshape(-1, 2),
                "random_null_u": np.array(random_null_u, dtype=np.float64), "k": len(self.random_texts)}

    def reference(self) -> tuple[np.ndarray | None, dict]:
        """``gap`` of the evaluation split's trusted pairs, against its own corpus."""
        config = self.config
        if not config.eval_data or not config.reference:
            return None, {}
        dataset = self.eval_dataset()
        texts = dataset.corpus.texts_for_encoding()
        same = self.corpus_path is not None and Path(self.corpus_path).resolve() == \
            _corpus_path(Path(config.eval_data)).resolve()
        if same:
            pool = self.pool_
        else:
            vectors = self.encoder.encode_corpus(texts, cache_dir=config.cache_dir, batch_size=config.batch_size,
                                                 precision=config.precision, show_progress=config.progress,
                                                 desc="audit: encode evaluation corpus")
            self.passages.preload(texts, vectors)
            pool = _Pool(texts, _unit(vectors), self.encoder.device)
        by_id = dict(zip(dataset.corpus.ids, texts))
        qids = list(dataset.qrels)
        self.queries.add([dataset.queries[q] for q in qids], "audit: encode evaluation queries")
        query_texts, excluded, positives = [], [], []
        for qid in qids:
            relevant = [by_id[d] for d, g in dataset.qrels[qid].items() if g > 0]
            hashes = {text_hash(t) for t in relevant}
            for text in relevant:
                query_texts.append(dataset.queries[qid])
                excluded.append(hashes)
                positives.append(text)
        self.passages.add(positives, "audit: encode evaluation positives")
        qv = self.queries.of(query_texts)
        best, _ = pool.best(qv, excluded)
        scores = np.einsum("nd,nd->n", qv, self.passages.of(positives))
        gaps = best - scores
        u = (1 + ((qv @ self.random_matrix.T) >= scores[:, None]).sum(axis=1)) / (len(self.random_texts) + 1)
        keep = np.isfinite(gaps)
        return np.stack([gaps[keep], u[keep]], axis=1), {"data": str(config.eval_data), "split": config.eval_split,
                                         "pairs": int(len(positives)), "queries": len(qids),
                                         "same_corpus_as_search_pool": bool(same)}

    def eval_dataset(self):
        if getattr(self, "_eval", None) is None:
            from ..data.beir import load_beir

            self._eval = load_beir(self.config.eval_data, self.config.eval_split)
        return self._eval


def _distributions(gap: np.ndarray, u: np.ndarray, scored: dict, ref: np.ndarray | None) -> dict:
    """Histograms for the plot: the pairs' gaps against the nulls' and the reference's, and the p-values."""
    scored = {**scored, "hard_null": scored["hard_null"][:, 0], "random_null_gap": scored["random_null_gap"][:, 0]}
    ref = None if ref is None else ref[:, 0]
    finite = [x for x in (gap, scored["hard_null"], scored["random_null_gap"], ref) if x is not None and len(x)]
    values = np.concatenate([x[np.isfinite(x)] for x in finite]) if finite else np.zeros(1)
    edges = np.linspace(float(np.min(values)), float(np.max(values)) + 1e-9, 41)

    def hist(x: np.ndarray | None) -> list[float] | None:
        if x is None or not len(x):
            return None
        x = x[np.isfinite(x)]
        counts, _ = np.histogram(x, bins=edges)
        return (counts / max(1, x.size)).round(6).tolist()

    u_edges = np.linspace(0, 1, 21)
    return {"gap_edges": edges.round(6).tolist(), "gap": {"pairs": hist(gap), "hard_nulls": hist(scored["hard_null"]),
                                                         "random_nulls": hist(scored["random_null_gap"]),
                                                         "reference": hist(ref)},
            "u_edges": u_edges.tolist(),
            "u": {"pairs": (np.histogram(u, bins=u_edges)[0] / max(1, u.size)).round(6).tolist(),
                  "random_nulls": (np.histogram(scored["random_null_u"], bins=u_edges)[0]
                                   / max(1, len(scored["random_null_u"]))).round(6).tolist()}}

