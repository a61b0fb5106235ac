"""Planted training-data noise: each kind imitates one real-world source of label noise.

Every function takes *clean* mined training examples (``TrainingExample`` with ``extra`` holding
``query_id``, ``pos_ids`` and ``neg_ids``, as ``robustir mine`` writes them), a rate (share of the
training queries that get noise), a seed and what it needs from the corpus, and returns a
:class:`NoisyData`: new examples (the input is never modified) plus one :class:`Plant` per changed
query that says exactly what was planted, so filters can be scored on it (precision / recall).

Kinds (``NOISE_KINDS``):

``chunk-fn``   *false negatives from chunking.* PEG builds training data from a chunked corpus: a query
               is generated from one passage, and the other passages of the same document -- often just as
               relevant -- come back from mining as "hard negatives". Here the query's relevant document is
               split into sentence passages and up to ``per_query`` of them are put at the top of its
               negatives (where a miner ranks them). The positive stays the whole document.
``label-fn``   *false negatives from incomplete labels* (CCR §4.1): for a query with several positives,
               positives are moved into its negatives (at least one stays a positive). When the selected
               share exceeds the multi-positive queries, the rest get the milder ``dup-fn`` noise; the
               summary counts both.
``dup-fn``     *near-duplicates of the positive* among the negatives (lightly edited copies: a word dropped
               every ~12 words, two neighbours swapped), what a web crawl's mirrored pages give a miner.
``fp-random``  *false positives, random*: the positive is replaced by a random corpus passage (mislabelled
               pairs, failed LLM generations).
``fp-hard``    *false positives, hard*: the positive is replaced by the query's top-ranked mined negative,
               a lexical neighbour that is not relevant (what an LLM query that is too generic, or a wrong
               click, produces). This is what PEG's w_q is meant to catch.
``fp-swap``    *a near miss as mined after the mistake* (issue 50): as ``fp-hard``, and the replaced positive is put
               at the top of the negatives -- where a miner run on the wrong label ranks the right passage (it
               excludes only the labelled one). Both halves of a real near-miss label: a false positive and the
               true answer as a false negative, so a method can *correct* the label, not only drop it.

Planted passages get ids ``planted:<kind>:<source id>[:n]`` in ``neg_ids`` / ``pos_ids``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Sequence

from ..data.training_data import TrainingExample
from ..errors import ConfigError

__all__ = ["Plant", "NoisyData", "NOISE_KINDS", "plant_noise", "near_duplicate", "split_into_passages",
           "is_false_negative_kind"]


@dataclass
class Plant:
    """What was planted for one query."""

    query_id: str
    kind: str  # the kind actually applied (label-fn may fall back to dup-fn)
    false_negatives: list[str] = field(default_factory=list)  # texts planted among the negatives
    replaced_positives: list[str] = field(default_factory=list)  # original positives that were removed
    false_positives: list[str] = field(default_factory=list)  # texts that now stand as positives

    def to_json(self) -> dict:
        return {"query_id": self.query_id, "kind": self.kind, "false_negatives": self.false_negatives,
                "replaced_positives": self.replaced_positives, "false_positives": self.false_positives}


@dataclass
class NoisyData:
    examples: list[TrainingExample]
    plants: list[Plant]
    kind: str
    rate: float
    seed: int

    def summary(self) -> dict:
        by_kind: dict[str, int] = {}
        for plant in self.plants:
            by_kind[plant.kind] = by_kind.get(plant.kind, 0) + 1
        return {"kind": self.kind, "rate": self.rate, "seed": self.seed, "queries": len(self.examples),
                "noisy_queries": len(self.plants), "noisy_queries_by_kind": by_kind,
                "planted_false_negatives": sum(len(p.false_negatives) for p in self.plants),
                "planted_false_positives": sum(len(p.false_positives) for p in self.plants)}


def _query_id(example: TrainingExample, index: int) -> str:
    return str(example.extra.get("query_id", index))


def _ids(example: TrainingExample, key: str, n: int) -> list[str]:
    ids = example.extra.get(key)
    return [str(x) for x in ids] if isinstance(ids, list) and len(ids) == n else [f"?{i}" for i in range(n)]


def _with_negatives(example: TrainingExample, planted: list[str], planted_ids: list[str]) -> TrainingExample:
    """Put ``planted`` at the top of the negatives; the pool keeps its size (the lowest-ranked ones go)."""
    size = max(len(example.neg), len(planted))
    keep = [i for i, text in enumerate(example.neg) if text not in planted][: size - len(planted)]
    neg_ids = _ids(example, "neg_ids", len(example.neg))
    extra = dict(example.extra)
    extra["neg_ids"] = planted_ids + [neg_ids[i] for i in keep]
    extra["planted_neg"] = planted_ids
    # the miner never scored the planted passages: the record's negative scores are dropped rather than faked
    return replace(example, neg=planted + [example.neg[i] for i in keep], neg_scores=None, extra=extra)


def split_into_passages(text: str, max_words: int = 48) -> list[str]:
    """Sentence passages of at most ``max_words`` words (robustir's chunker, no overlap)."""
    from ..data.chunking import chunk_document

    return [p.text for p in chunk_document("d", "", text, None, max_tokens=max_words, overlap_sentences=0,
                                           min_tokens=8)]


def near_duplicate(text: str, rng: random.Random) -> str:
    """A lightly edited copy: one word in ~12 dropped, one pair of neighbouring words swapped."""
    words = text.split()
    if len(words) < 4:
        return text + " ."
    kept = [w for w in words if rng.random() >= 1 / 12] or words[:]
    if len(kept) >= 2:
        i = rng.randrange(len(kept) - 1)
        kept[i], kept[i + 1] = kept[i + 1], kept[i]
    out = " ".join(kept)
    return out if out != text else out + " ."


def _chunk_fn(example, qid, rng, context) -> tuple[TrainingExample, Plant] | None:
    per_query = context["per_query"]
    pos_ids = _ids(example, "pos_ids", len(example.pos))
    chunks: list[tuple[str, str]] = []
    for pid, text in zip(pos_ids, example.pos):
        pieces = split_into_passages(text, context["chunk_words"])
        if len(pieces) >= 2:  # a one-passage document yields no *other* passage
            chunks += [(f"planted:chunk-fn:{pid}:{n}", piece) for n, piece in enumerate(pieces)]
    if not chunks:
        return None
    chosen = rng.sample(chunks, min(per_query, len(chunks)))
    texts = [t for _, t in chosen]
    return _with_negatives(example, texts, [i for i, _ in chosen]), Plant(qid, "chunk-fn", false_negatives=texts)


def _dup_fn(example, qid, rng, context) -> tuple[TrainingExample, Plant] | None:
    pos_ids = _ids(example, "pos_ids", len(example.pos))
    texts, ids = [], []
    for n in range(context["per_query"]):
        j = n % len(example.pos)
        texts.append(near_duplicate(example.pos[j], rng))
        ids.append(f"planted:dup-fn:{pos_ids[j]}:{n}")
    return _with_negatives(example, texts, ids), Plant(qid, "dup-fn", false_negatives=texts)


def _label_fn(example, qid, rng, context) -> tuple[TrainingExample, Plant] | None:
    if len(example.pos) < 2:
        return _dup_fn(example, qid, rng, context)
    pos_ids = _ids(example, "pos_ids", len(example.pos))
    order = list(range(len(example.pos)))
    rng.shuffle(order)
    moved = sorted(order[: max(1, min(context["per_query"], len(order) // 2 if len(order) > 2 else 1))])
    stay = [i for i in range(len(example.pos)) if i not in moved]
    texts = [example.pos[i] for i in moved]
    moved_example = _with_negatives(example, texts, [f"planted:label-fn:{pos_ids[i]}" for i in moved])
    extra = dict(moved_example.extra)
    extra["pos_ids"] = [pos_ids[i] for i in stay]
    scores = None if example.pos_scores is None else [example.pos_scores[i] for i in stay]
    moved_example = replace(moved_example, pos=[example.pos[i] for i in stay], pos_scores=scores, extra=extra)
    return moved_example, Plant(qid, "label-fn", false_negatives=texts)


def _swap(example, qid, rng, context) -> tuple[TrainingExample, Plant] | None:
    """``fp-hard``, then the replaced positive(s) at the top of the negatives (the pool keeps its size)."""
    result = _false_positive(example, qid, rng, context, kind="fp-swap")
    if result is None:
        return None
    noisy, plant = result
    pos_ids = _ids(example, "pos_ids", len(example.pos))
    swapped = _with_negatives(noisy, list(example.pos), [f"planted:fp-swap:{pid}" for pid in pos_ids])
    return swapped, replace(plant, false_negatives=list(example.pos))


def _false_positive(example, qid, rng, context, kind: str) -> tuple[TrainingExample, Plant] | None:
    """``fp-random`` (a random corpus passage) or a hard kind (the top non-positive negative) as the positive; the
    planted ids and the plant carry ``kind``."""
    own = set(example.pos) | set(context["positives_of"].get(qid, ()))
    neg_ids = _ids(example, "neg_ids", len(example.neg))
    extra = dict(example.extra)
    if kind != "fp-random":
        choice = next((i for i, text in enumerate(example.neg) if text not in own), None)
        if choice is None:
            return None
        text, source = example.neg[choice], neg_ids[choice]
        neg = [t for i, t in enumerate(example.neg) if i != choice]
        extra["neg_ids"] = [x for i, x in enumerate(neg_ids) if i != choice]
        neg_scores = None if example.neg_scores is None else [s for i, s in enumerate(example.neg_scores) if i != choice]
    else:
        corpus_ids, corpus_texts = context["corpus"]
        negatives = set(example.neg)
        while True:
            row = rng.randrange(len(corpus_texts))
            if corpus_texts[row] not in own and corpus_texts[row] not in negatives:
                break
        text, source, neg, neg_scores = corpus_texts[row], corpus_ids[row], example.neg, example.neg_scores
    extra["pos_ids"] = [f"planted:{kind}:{source}"]
    extra["planted_pos"] = extra["pos_ids"]
    new = replace(example, pos=[text], pos_scores=None, neg=list(neg), neg_scores=neg_scores, extra=extra)
    return new, Plant(qid, kind, replaced_positives=list(example.pos), false_positives=[text])


NOISE_KINDS: dict[str, Callable] = {
    "chunk-fn": _chunk_fn,
    "label-fn": _label_fn,
    "dup-fn": _dup_fn,
    "fp-random": lambda e, q, r, c: _false_positive(e, q, r, c, kind="fp-random"),
    "fp-hard": lambda e, q, r, c: _false_positive(e, q, r, c, kind="fp-hard"),
    "fp-swap": _swap,
}
NoiseKind = Literal[tuple(NOISE_KINDS)]  # type: ignore[valid-type]


def is_false_negative_kind(kind: str) -> bool:
    return kind.endswith("-fn")


def plant_noise(examples: Sequence[TrainingExample], kind: str, rate: float, seed: int, *,
                corpus: tuple[Sequence[str], Sequence[str]] | None = None, per_query: int = 3,
                chunk_words: int = 48) -> NoisyData:
    """Plant ``kind`` noise into ``round(rate * len(examples))`` randomly chosen queries (seeded).

    Args:
        examples: clean examples (with ``extra`` ids from mining); not modified.
        kind: one of :data:`NOISE_KINDS`.
        rate: share of the training queries to make noisy, in [0, 1].
        corpus: ``(ids, texts)`` of the corpus, needed by ``fp-random``.
        per_query: false negatives planted per noisy query (``chunk-fn``, ``dup-fn``, ``label-fn``'s cap).
        chunk_words: passage size for ``chunk-fn``.

    Queries whose example cannot take the kind (a one-sentence document for ``chunk-fn``, no
    non-positive negative for ``fp-hard`` / ``fp-swap``) are skipped and the next candidate is taken, so the count is
    exact unless too few queries qualify (then all that qualify are noisy; the summary says how many).
    """
    if kind not in NOISE_KINDS:
        raise ConfigError(f"unknown noise kind {kind!r}; valid: {', '.join(NOISE_KINDS)}")
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"noise rate must be in [0, 1], got {rate}")
    if per_query < 1:
        raise ConfigError(f"per_query must be >= 1, got {per_query}")
    if kind == "fp-random" and not corpus:
        raise ConfigError("fp-random needs the corpus (ids, texts) to draw wrong positives from")
    rng = random.Random(f"{seed}:{kind}:{rate}")
    out = list(examples)
    wanted = round(rate * len(out))
    context = {"per_query": per_query, "chunk_words": chunk_words, "corpus": corpus,
               "positives_of": {_query_id(e, i): e.pos for i, e in enumerate(examples)}}
    order = list(range(len(out)))
    rng.shuffle(order)
    if kind == "label-fn":  # multi-positive queries first: they carry the paper's protocol
        order.sort(key=lambda i: len(out[i].pos) < 2)
    plants: list[Plant] = []
    for index in order:
        if len(plants) >= wanted:
            break
        qid = _query_id(out[index], index)
        result = NOISE_KINDS[kind](out[index], qid, rng, context)
        if result is None:
            continue
        out[index], plant = result
        plants.append(plant)
    return NoisyData(out, plants, kind, rate, seed)
