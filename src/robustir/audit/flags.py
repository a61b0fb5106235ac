"""The audit's flags beyond the rate: leakage into the evaluation split, duplicates, false negatives above the
positive and suspected positives (:class:`Flagging`, mixed into :class:`robustir.audit.run._Audit`)."""

from __future__ import annotations

import numpy as np

from .checks import normalize, text_hash
from .estimate import MU


class Flagging:
    """What an audit flags record by record, written to ``flagged.jsonl``."""

    # -- leakage into the evaluation split
    def leakage(self) -> None:
        config = self.config
        if not config.eval_data:
            return
        dataset = self.eval_dataset()
        texts = dict(zip(dataset.corpus.ids, dataset.corpus.texts_for_encoding()))
        eval_queries = {text_hash(t): (qid, t) for qid, t in dataset.queries.items()}
        eval_positives = {text_hash(texts[d]): (d, texts[d]) for judged in dataset.qrels.values()
                          for d, g in judged.items() if g > 0}
        exact = set()
        for index, h in sorted(self.checks.in_set(set(eval_queries), "query").items()):
            file, line = self.where[index]
            qid, text = eval_queries[h]
            exact.add(index)
            self.flag_other({"kind": "leakage", "reason": "query_in_eval", "file": file, "line": line,
                             "text": text, "eval_query_id": qid})
        # paraphrases among the sampled records: cosine to an evaluation query
        eval_ids = list(dataset.queries)
        self.queries.add([dataset.queries[q] for q in eval_ids], "audit: encode evaluation queries")
        ev = self.queries.of([dataset.queries[q] for q in eval_ids])
        sv = self.queries.of([r.query for r in self.sample])
        for start in range(0, len(self.sample), 1024):
            sims = sv[start:start + 1024] @ ev.T
            best = sims.argmax(axis=1)
            for i, j in enumerate(best.tolist()):
                record = self.sample[start + i]
                if sims[i, j] >= config.duplicate_cosine and record.index not in exact:
                    self.flag_other({"kind": "leakage", "reason": "near_query_in_eval", "file": record.file,
                                     "line": record.line, "query": record.query,
                                     "text": dataset.queries[eval_ids[j]], "eval_query_id": eval_ids[j],
                                     "score": round(float(sims[i, j]), 4)})
        for index, h in sorted(self.checks.in_set(set(eval_positives), "positive").items()):
            file, line = self.where[index]
            doc, text = eval_positives[h]
            self.flag_other({"kind": "leakage", "reason": "positive_in_eval", "file": file, "line": line,
                             "text": text[:300], "eval_doc_id": doc})

    def duplicates(self) -> None:
        same_record, same_query = self.checks.duplicates()
        for reason, found in (("duplicate_record", same_record), ("duplicate_query", same_query)):
            for index, first in sorted(found.items()):
                file, line = self.where[index]
                first_file, first_line = self.where[first]
                self.flag_other({"kind": "duplicate", "reason": reason, "file": file, "line": line,
                                 "first": {"file": first_file, "line": first_line}})
        for index, count in sorted(self.checks.reused_positives(self.config.max_positive_reuse).items()):
            file, line = self.where[index]
            self.flag_other({"kind": "duplicate", "reason": "positive_reused", "file": file, "line": line,
                             "records_sharing_it": count})

    def false_negatives(self, pairs: list[dict], suspects: set[int]) -> tuple[list[dict], dict]:
        """Negatives of records whose positive is not random-like: above the positive's margin, or near-duplicates
        of it."""
        from ..negatives.margins import margin_reason

        config = self.config
        flags = []
        checked = records_flagged = 0
        by_record: dict[int, list[dict]] = {}
        for pair in pairs:
            by_record.setdefault(pair["record"].index, []).append(pair)
        for index, items in by_record.items():
            record = items[0]["record"]
            if index in suspects or not record.neg:
                continue
            negs = self.passages.of(record.neg)
            scores = items[0]["neg_scores"]  # the query's cosine to each negative, taken in score()
            lowest = min(items, key=lambda p: p["score"])
            closeness = (negs @ self.passages.of(record.pos).T).max(axis=1)
            positives = {normalize(p) for p in record.pos}
            found = False
            for text, score, close in zip(record.neg, scores.tolist(), closeness.tolist()):
                if normalize(text) in positives:
                    continue  # degenerate (negative_equals_positive), reported there
                checked += 1
                reason = None
                if close >= config.duplicate_cosine:
                    reason = "near_duplicate_of_positive"
                elif margin_reason(score, lowest["score"], None, config.relative_margin):
                    reason = "above_positive_margin"
                if reason:
                    found = True
                    flags.append({"kind": "false_negative", "reason": reason, "file": record.file,
                                  "line": record.line, "query": record.query,
                                  "positive": record.pos[lowest["positive"]], "text": text, "score": round(score, 4),
                                  "positive_score": round(lowest["score"], 4), "positive_cosine": round(close, 4)})
            records_flagged += found
        flags.sort(key=lambda f: f["score"] - f["positive_score"], reverse=True)
        return flags, {"negatives_checked": checked, "flagged": len(flags), "records_with_a_flag": records_flagged}

    def suspected_positives(self, pairs: list[dict], k: int, threshold: float) -> tuple[list[dict], set[int]]:
        flags, suspects = [], set()
        for pair in pairs:
            record = pair["record"]
            if pair["u"] > MU:  # a true positive outscores 90 % of random passages (on clean SciFact: all but 1 %)
                reason = "random_like"
                why = (f"{100 * pair['u']:.0f} % of {k} random passages score at least as high "
                       f"(cosine {pair['score']:.3f})")
            elif np.isfinite(threshold) and pair["gap"] > threshold:
                reason = "outranked"
                why = (f"a passage of the {self.pool_source} scores {pair['gap']:.3f} higher (more than the hard nulls' "
                       f"median gap, {threshold:.3f}); {pair['beaten_by_negatives']} of its {pair['negatives']} "
                       "negatives outscore it")
            else:
                continue
            if reason == "random_like":  # only a confident suspect makes its negatives' comparison meaningless
                suspects.add(record.index)
            flags.append({"kind": "false_positive", "reason": reason, "file": record.file, "line": record.line,
                          "query": record.query, "text": record.pos[pair["positive"]],
                          "score": round(pair["u"] if reason == "random_like" else pair["gap"], 4),
                          "cosine": round(pair["score"], 4), "random_p": round(pair["u"], 4),
                          "gap": round(pair["gap"], 4), "why": why,
                          "best_other_passage": (pair["competitor"] or "")[:300]})
        flags.sort(key=lambda f: (f["reason"] != "random_like", -f["score"]))
        return flags, suspects

