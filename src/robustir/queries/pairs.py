"""GUR pair mining: (sentence, sentence) pairs of one document that share a long common substring.

GUR (Generate to Understand for Representation, Lin et al. 2023, §III-A and Fig. 2) builds unsupervised
contrastive pairs from raw documents: split each document into sentences, enumerate pairs of sentences (and
title–sentence pairs), and keep a pair when the *longest common substring* (LCS) of the two normalised
sentences is long enough. Length is a **weighted** length (authors' ``weight``): a letter with code point
> 10000 (CJK) counts 1.0, any other letter 0.3, anything else 0.1. A pair is kept iff

    wc >= 3                                   (about 3 Hanzi or 10 Latin letters), or
    wc >= 2 and min(weight(a), weight(b)) <= 15   (short sentences need only about 2 Hanzi),

where ``wc`` is the weight of the heaviest common substring. The authors' code and the paper are compared in
docs/methods.md#gur-pair-mining; this module follows the code with these **deliberate deviations**:

* Weights are kept as integers in tenths (10 / 3 / 1), so "10 Latin letters = 3.0" is exact; the
  authors' float sum makes 10 × 0.3 = 2.9999999999999996 < 3 and rejects such pairs.
* ``wc`` is the exact maximum weight over *all* common substrings (computed in one pass of a suffix
  automaton, see :func:`heaviest_common_substring`); the authors' ``lcs1(min_len=1)`` merges candidates
  that share a start and may in rare cases miss the heaviest one.
* All sentences of a document are used: the authors' wiki reader kept only the last line of a document
  and dropped its last sentence (``sents[:-1]``) — bugs, not design.
* "CJK" is robustir's one definition (:mod:`robustir.data.cjk`: ideographs, kana, Hangul, fullwidth
  forms), not the authors' "code point > 10000", which also gives Glagolitic, Coptic, Latin Extended-D/E or
  Cherokee letters the weight of a Hanzi and Hangul Jamo the weight of a Latin letter.
* English is split into sentences too (the authors split on CJK punctuation only).
* The title is a candidate partner of *every* sentence (paper, §IV-A: "we enumerate every content sentence
  in relation to the title"); the authors' code only LCS-tested it against the first 100 rows. The length
  filter does not demote a sentence to "title" when the real title is filtered out.
* Candidates are sampled *without* replacement (``random.sample``; the authors used ``random.choices``,
  which wastes draws on repeats), with a per-document RNG seeded by ``(seed, doc_id)`` so the pairs of a
  document do not depend on sharding, order, or resume.
* Identical sentences are never paired, and pairs are de-duplicated (unordered, exact text) in process
  (per document, or across the whole output with ``dedup="global"``) instead of an external ``sort -u``.

Why a hand-written suffix automaton: the authors' PyPI package ``suffixautomaton`` (0.1.6) reconfigures the
*root* logger at import (clears its handlers), evaluates debug f-strings on every insert, deep-copies
transition dicts, and is a flat top-level module named ``SuffixAutomaton``; no other PyPI package computes a
*weighted* LCS. A compact automaton over flat lists is ~60 lines, exact, and ~15x faster than that package
on the same sentence pairs (``python bench/pairs.py --compare-library``, which also shows the package's
weight falling short of the true maximum on ~0.2-2% of pairs). Before the automaton runs, an exact k-gram
pre-filter (C-speed set operations) discards pairs that cannot reach the threshold: a common substring of
weight >= w has at least ceil(w / heaviest shared character weight) characters.
"""

from __future__ import annotations

import hashlib
import json
import random
import unicodedata
from itertools import accumulate
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Literal

from ..data.cjk import is_cjk
from ..data.documents import Document, DocumentOutput, document_step, read_documents
from ..data.sentences import split_sentences
from ..errors import ConfigError
from ..io import Shard
from ..outputs import refuse_overwriting_inputs
from ..validation import (cli, config_dataclass, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Range,
                          Seed)

__all__ = ["PairMiningConfig", "Pair", "char_weight", "text_weight", "SuffixAutomaton",
           "heaviest_common_substring", "is_match", "document_rows", "mine_document_pairs", "mine_pairs",
           "PairStats"]

# ----------------------------------------------------------------------------------------------- weights

class _WeightTable(dict):
    """Character -> weight in tenths, filled on first use (a dict lookup from C is the fast path)."""

    def __missing__(self, ch: str) -> int:
        if unicodedata.category(ch)[0] == "L":
            w = 10 if is_cjk(ch) else 3
        else:
            w = 1
        self[ch] = w
        return w


_WEIGHTS = _WeightTable()
_tenths = _WEIGHTS.__getitem__  # weight of one character in tenths: 10 CJK letter, 3 other letter, 1 else


def char_weight(ch: str) -> float:
    """GUR weight of one character: 1.0 CJK letter (:func:`robustir.data.cjk.is_cjk`), 0.3 other letter, 0.1
    otherwise."""
    return _tenths(ch) / 10


def text_weight(text: str) -> float:
    """Sum of :func:`char_weight` over ``text`` (computed exactly in tenths)."""
    return sum(map(_tenths, text)) / 10


def _prefix_tenths(text: str) -> list[int]:
    """``out[k]`` = weight (tenths) of ``text[:k]``; a substring's weight is a difference of two entries."""
    return list(accumulate(map(_tenths, text), initial=0))


# ------------------------------------------------------------------------------------- suffix automaton

class SuffixAutomaton:
    """Suffix automaton of a string (Blumer et al. 1985), as flat lists for speed.

    ``trans[v]`` maps a character to the next state, ``link[v]`` is the suffix link, ``length[v]`` the length
    of the longest string in state ``v``. Built in O(len(text)) amortised time.
    """

    __slots__ = ("text", "trans", "link", "length")

    def __init__(self, text: str) -> None:
        self.text = text
        trans: list[dict[str, int]] = [{}]
        link = [-1]
        length = [0]
        last = 0
        for ch in text:
            cur = len(length)
            trans.append({})
            length.append(length[last] + 1)
            link.append(0)
            p = last
            while p != -1 and ch not in trans[p]:
                trans[p][ch] = cur
                p = link[p]
            if p != -1:
                q = trans[p][ch]
                if length[p] + 1 == length[q]:
                    link[cur] = q
                else:
                    clone = len(length)
                    trans.append(trans[q].copy())
                    length.append(length[p] + 1)
                    link.append(link[q])
                    while p != -1 and trans[p].get(ch) == q:
                        trans[p][ch] = clone
                        p = link[p]
                    link[q] = link[cur] = clone
            last = cur
        self.trans, self.link, self.length = trans, link, length

    def heaviest_match(self, other: str, prefix: list[int] | None = None) -> tuple[int, int, int]:
        """Heaviest substring of ``other`` that also occurs in ``self.text``.

        Returns ``(weight_in_tenths, start, end)`` with ``other[start:end]`` the substring (``(0, 0, 0)`` when
        nothing is shared). For every end position the automaton gives the *longest* common suffix, which is
        also the heaviest (weights are positive), so the maximum over end positions is exact.
        ``prefix`` is ``_prefix_tenths(other)`` when the caller has it cached.
        """
        if prefix is None:
            prefix = _prefix_tenths(other)
        trans, link, length = self.trans, self.link, self.length
        p = 0
        run = 0
        best = best_start = best_end = 0
        for i, ch in enumerate(other):
            nxt = trans[p].get(ch)
            if nxt is not None:
                p = nxt
                run += 1
            else:
                while p != -1 and ch not in trans[p]:
                    p = link[p]
                if p == -1:
                    p = run = 0
                    continue
                run = length[p] + 1
                p = trans[p][ch]
            w = prefix[i + 1] - prefix[i + 1 - run]
            if w > best:
                best, best_start, best_end = w, i + 1 - run, i + 1
        return best, best_start, best_end


def heaviest_common_substring(a: str, b: str) -> tuple[str, float]:
    """The common substring of ``a`` and ``b`` with the largest GUR weight, and that weight.

    Ties go to the first one in ``b``. ``("", 0.0)`` when the strings share no character.
    """
    w, start, end = SuffixAutomaton(a).heaviest_match(b)
    return b[start:end], w / 10


# ------------------------------------------------------------------------------------------ the config

@config_dataclass
class PairMiningConfig:
    """Options of GUR pair mining (defaults follow the authors' released ``repeat2`` data, §3.1)."""

    seed: Seed = 0
    """Sampling seed."""
    repeat: PositiveInt = 2
    """Max pairs a sentence may take part in."""
    title_extra: NonNegativeInt = 1
    """Extra uses for the title (authors' --title, default 1)"""
    use_title: Annotated[bool, cli("title")] = True
    """Pair the title with sentences."""
    window: Annotated[int, Range(ge=2)] = 100
    """Sentence pairs (i, j) need j - i < window."""
    min_weight: NonNegativeFloat = 3.0
    """Keep if the weighted LCS wc >= this (3 Hanzi / 10 Latin letters) ..."""
    short_min_weight: NonNegativeFloat = 2.0
    """... or wc >= short_min_weight and a sentence is short:"""
    short_text_weight: NonNegativeFloat = 15.0
    """Weight(a) <= this or weight(b) <= this."""
    min_chars: PositiveInt = 2
    """Sentences outside [min_chars, max_chars] are not used."""
    max_chars: PositiveInt = 128
    """Longer texts are cut to this many characters before matching."""
    match_chars: PositiveInt = 128
    """Normalisation: lower() and truncate to this many characters."""
    max_candidates: PositiveInt = 100_000
    """Candidate pairs sampled per document."""
    max_pairs_factor: PositiveFloat = 2.0
    """Stop a document at this many pairs per row (authors: 2)"""
    require_lcs: Annotated[bool, cli("lcs")] = True
    """Test the weighted LCS (False = accept every candidate: GUR-LCS ablation)"""
    dedup: Literal["document", "global"] = "global"
    """Drop a repeated pair within each document, or across the whole corpus."""

    def __post_init__(self) -> None:
        if self.max_chars < self.min_chars:
            raise ConfigError(f"need 1 <= min_chars <= max_chars, got {self.min_chars}, {self.max_chars}")
        if self.dedup not in ("document", "global"):
            raise ConfigError(f"dedup must be 'document' or 'global', got {self.dedup!r}")


def is_match(wc: float, weight_a: float, weight_b: float, config: PairMiningConfig | None = None) -> bool:
    """GUR's acceptance rule for a pair with heaviest-common-substring weight ``wc`` (weights as floats)."""
    cfg = config or PairMiningConfig()
    return _is_match_tenths(round(wc * 10), round(weight_a * 10), round(weight_b * 10), cfg)


def _is_match_tenths(wc: int, wa: int, wb: int, cfg: PairMiningConfig) -> bool:
    if wc >= round(cfg.min_weight * 10):
        return True
    short = round(cfg.short_text_weight * 10)
    return wc >= round(cfg.short_min_weight * 10) and (wa <= short or wb <= short)


# ------------------------------------------------------------------------------------------ the mining

@dataclass(frozen=True)
class Pair:
    """A mined pair: ``query`` comes first in the document (the title, when it takes part)."""

    query: str
    pos: str
    doc_id: str
    lcs: str
    lcs_weight: float

    def to_record(self) -> dict[str, Any]:
        """FlagEmbedding training record (``query``/``pos``/``neg``) plus provenance."""
        return {"query": self.query, "pos": [self.pos], "neg": [], "doc_id": self.doc_id, "lcs": self.lcs,
                "lcs_weight": self.lcs_weight}


def document_rows(title: str, text: str, config: PairMiningConfig) -> tuple[list[str], bool]:
    """Rows to pair: ``[title] + sentences`` filtered by length; also whether row 0 is the title."""
    rows: list[str] = []
    has_title = False
    title = title.strip()
    if config.use_title and config.min_chars <= len(title) <= config.max_chars:
        rows.append(title)
        has_title = True
    for start, end in split_sentences(text):
        if config.min_chars <= end - start <= config.max_chars:
            rows.append(text[start:end])
    return rows, has_title


@dataclass
class _DocCounters:
    comparisons: int = 0   # candidate pairs whose LCS was decided (by the k-gram filter or the automaton)
    lcs_runs: int = 0      # of those, decided by running the suffix automaton
    candidates: int = 0    # candidate pairs drawn


def mine_document_pairs(doc_id: str, title: str, text: str, config: PairMiningConfig | None = None,
                        seen: set[int] | None = None, counters: _DocCounters | None = None) -> list[Pair]:
    """Mine the GUR pairs of one document (deterministic for a given ``config.seed`` and ``doc_id``).

    ``seen`` holds hashes of pairs already emitted (for cross-document de-duplication); pairs found here are
    added to it. Without it, de-duplication is per document.
    """
    cfg = config or PairMiningConfig()
    rows, has_title = document_rows(title, text, cfg)
    n = len(rows)
    if n < 2:
        return []
    # Candidates as flat ints i * n + j: compact even for long documents.
    cands: list[int] = []
    window = cfg.window
    for i in range(n - 1):
        hi = n if (has_title and i == 0) else min(n, i + window)
        base = i * n
        cands.extend(range(base + i + 1, base + hi))
    rng = random.Random(f"{cfg.seed}\x00{doc_id}")  # str seeds hash with SHA-512: stable across runs
    if len(cands) > cfg.max_candidates:
        cands = rng.sample(cands, cfg.max_candidates)
    else:
        rng.shuffle(cands)

    norm = [r[: cfg.match_chars].lower() for r in rows]
    prefixes = [_prefix_tenths(t) for t in norm]
    totals = [p[-1] for p in prefixes]
    heaviest_char = [max(map(_tenths, set(t))) for t in norm]
    grams: list[dict[int, set[str]]] = [{} for _ in range(n)]
    automata: list[SuffixAutomaton | None] = [None] * n
    need_long, need_short = round(cfg.min_weight * 10), round(cfg.short_min_weight * 10)
    short = round(cfg.short_text_weight * 10)
    limit = [cfg.repeat] * n
    if has_title:
        limit[0] += cfg.title_extra
    used = [0] * n
    seen = set() if seen is None else seen
    local: set[int] = set()
    pairs: list[Pair] = []
    max_pairs = cfg.max_pairs_factor * n
    comparisons = lcs_runs = 0
    for c in cands:
        if len(pairs) >= max_pairs:
            break
        i, j = divmod(c, n)
        if used[i] >= limit[i] or used[j] >= limit[j]:
            continue
        a, b = rows[i], rows[j]
        if norm[i] == norm[j]:
            continue  # a sentence repeated in the document is not a positive pair
        key = _pair_key(a, b)
        if key in local or key in seen:
            continue
        if cfg.require_lcs:
            comparisons += 1
            need = min(need_long, need_short) if (totals[i] <= short or totals[j] <= short) else need_long
            # Cheap exact pre-filter: a common substring of weight >= need has at least k characters, k set
            # by the heaviest character the two sentences share at best; no common k-gram, no match.
            k = -(-need // min(heaviest_char[i], heaviest_char[j]))
            if k >= 2 and _grams(norm[i], k, grams[i]).isdisjoint(_grams(norm[j], k, grams[j])):
                continue
            sam = automata[i]
            if sam is None:
                sam = automata[i] = SuffixAutomaton(norm[i])
            lcs_runs += 1
            wc, start, end = sam.heaviest_match(norm[j], prefixes[j])
            if not _is_match_tenths(wc, totals[i], totals[j], cfg):
                continue
            lcs = norm[j][start:end]
        else:
            wc, lcs = 0, ""
        used[i] += 1
        used[j] += 1
        local.add(key)
        pairs.append(Pair(a, b, doc_id, lcs, wc / 10))
    seen.update(local)
    if counters is not None:
        counters.comparisons += comparisons
        counters.lcs_runs += lcs_runs
        counters.candidates += len(cands)
    return pairs


def _grams(text: str, k: int, cache: dict[int, set[str]]) -> set[str]:
    """Set of the length-``k`` substrings of ``text`` (cached per ``k``)."""
    found = cache.get(k)
    if found is None:
        found = cache[k] = {text[x:x + k] for x in range(len(text) - k + 1)}
    return found


def _pair_key(a: str, b: str) -> int:
    """64-bit hash of the unordered pair (exact text): small enough to keep for every pair of a corpus."""
    lo, hi = (a, b) if a <= b else (b, a)
    digest = hashlib.blake2b(f"{lo}\x00{hi}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass
class PairStats:
    """Counts reported by :func:`mine_pairs`."""

    documents: int = 0
    skipped_done: int = 0
    documents_without_pairs: int = 0
    pairs: int = 0
    comparisons: int = 0
    lcs_runs: int = 0
    candidates: int = 0
    resumed_pairs: int = 0

    def summary(self) -> str:
        """One line, like every stage's report."""
        return (f"{self.documents} documents ({self.skipped_done} already done, {self.documents_without_pairs} "
                f"without pairs), {self.comparisons} candidate comparisons ({self.lcs_runs} by automaton), "
                f"{self.pairs} new pairs (+{self.resumed_pairs} from an earlier run)")


def mine_pairs(input_path: str | Path, output_path: str | Path, config: PairMiningConfig | None = None, *,
               fmt: str = "auto", text_unit: str = "block", shard: Shard | None = None,
               progress: Callable[[Iterable[Document]], Iterable[Document]] | None = None) -> PairStats:
    """Mine GUR pairs from every document of ``input_path`` (streamed) into FlagEmbedding JSONL.

    Resumable per document (a document with no pair is recorded as done too, see
    :class:`~robustir.data.documents.DocumentOutput`); an interrupted run continued to the end gives the same
    file as an uninterrupted one. With ``dedup="global"`` the hashes of pairs already in a partial output are
    re-read on resume.
    """
    cfg = config or PairMiningConfig()
    refuse_overwriting_inputs(output_path, input_path, stage="pairs")
    stats = PairStats()
    counters = _DocCounters()
    docs: Iterable[Document] = read_documents(input_path, fmt, text_unit=text_unit,  # type: ignore[arg-type]
                                              shard=shard)
    if progress is not None:
        docs = progress(docs)
    with DocumentOutput(output_path) as out:
        stats.resumed_pairs = out.count
        seen: set[int] | None = None
        if cfg.dedup == "global":
            seen = set()
            if out.count:
                with open(out.writer.partial, encoding="utf-8") as handle:
                    for line in handle:
                        rec = json.loads(line)
                        seen.add(_pair_key(rec["query"], rec["pos"][0]))
        for doc in docs:
            if doc.id in out.done:
                stats.skipped_done += 1
                continue
            pairs = mine_document_pairs(doc.id, doc.title, doc.text, cfg, seen, counters)
            for pair in pairs:
                out.write(pair.to_record())
            out.mark_done(doc.id)
            stats.documents += 1
            stats.pairs += len(pairs)
            stats.documents_without_pairs += not pairs
        out.finish()
    stats.comparisons = counters.comparisons
    stats.lcs_runs = counters.lcs_runs
    stats.candidates = counters.candidates
    return stats


PAIRS = document_step("pairs", PairMiningConfig, mine_pairs)
"""GUR's LCS pair mining as a :class:`~robustir.runs.Step` (job settings ``format``, ``text_unit``)."""
