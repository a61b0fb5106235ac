"""Split raw documents into passages of whole sentences that fit a token budget.

Each :class:`Passage` records exact character offsets into its document's text, so
``passage.text == text[passage.start:passage.end]`` always holds, and every non-whitespace character of the
text lies in at least one passage (a sentence longer than the budget is cut at token boundaries instead of
being dropped or truncated).

Output records ``{"_id", "doc_id", "title", "text", "start", "end"}`` form a valid BEIR ``corpus.jsonl``.
"""

from __future__ import annotations

import copy
import re
import weakref
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

from .documents import Document, DocumentOutput, document_step, read_documents
from .cjk import CJK_CHAR_CLASS
from .sentences import split_sentences
from ..errors import ConfigError
from ..io import Shard
from ..outputs import refuse_overwriting_inputs
from ..validation import config_dataclass, NonNegativeInt, PositiveInt

__all__ = ["ChunkConfig", "Passage", "TokenCounter", "WordCounter", "HFTokenCounter", "make_counter",
           "chunk_document", "chunk_corpus", "ChunkStats"]


@config_dataclass
class ChunkConfig:
    """How documents become passages: the flags of ``robustir chunk`` and the ``chunk:`` section of ``robustir run``
    (:func:`chunk_corpus` takes it)."""

    max_tokens: PositiveInt = 256
    """Passage length in words / CJK characters (or tokens of ``tokenizer``)."""
    overlap: NonNegativeInt = 1
    """Sentences repeated from the previous passage."""
    min_tokens: NonNegativeInt = 32
    """A shorter last passage borrows earlier sentences (within the budget: above max_tokens it acts as max_tokens)."""
    tokenizer: str | None = None
    """HF tokenizer name or path for exact token counts (None: words / CJK characters)."""

    def __post_init__(self) -> None:
        if self.overlap >= self.max_tokens:
            raise ConfigError(f"overlap ({self.overlap} sentences) must be smaller than max_tokens "
                              f"({self.max_tokens}): each overlapping sentence takes at least one token of the passage")


@dataclass(frozen=True)
class Passage:
    """A passage of a document: ``text == document_text[start:end]``."""

    id: str
    doc_id: str
    title: str
    text: str
    start: int
    end: int

    def to_record(self) -> dict[str, Any]:
        """BEIR corpus record (``_id`` plus provenance fields)."""
        return {"_id": self.id, "doc_id": self.doc_id, "title": self.title, "text": self.text,
                "start": self.start, "end": self.end}


class TokenCounter(Protocol):
    """Anything that gives the character spans of the tokens of a text (in order, non-overlapping)."""

    def token_spans(self, text: str) -> list[tuple[int, int]]: ...


class WordCounter:
    """Cheap default counter: one token per whitespace-separated non-CJK word and per CJK character.

    Close to what a multilingual WordPiece tokenizer gives for Chinese, and an under-count for English
    sub-words (use a real tokenizer via :class:`HFTokenCounter` when the budget must be exact).
    """

    _TOKEN_RE = re.compile(f"[{CJK_CHAR_CLASS}]|[^\\s{CJK_CHAR_CLASS}]+")

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        return [m.span() for m in self._TOKEN_RE.finditer(text)]


class HFTokenCounter:
    """Token spans from a Hugging Face *fast* tokenizer (character offsets, no special tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None and not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"{type(tokenizer).__name__} is not a fast tokenizer; character offsets are needed "
                              "(load it with AutoTokenizer.from_pretrained(..., use_fast=True))")
        # The raw `tokenizers` backend skips the model-max-length warning for long documents and is faster;
        # a private copy, because a saved tokenizer may carry truncation/padding settings that would cut
        # whole documents short (and silently break the token count).
        if backend is not None:
            backend = copy.deepcopy(backend)
            backend.no_truncation()
            backend.no_padding()
        self._backend = backend
        self._tokenizer = tokenizer

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        if self._backend is not None:
            offsets = self._backend.encode(text, add_special_tokens=False).offsets
        else:
            offsets = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                                      truncation=False)["offset_mapping"]
        return [(s, e) for s, e in offsets if e > s]


_WORD_COUNTER = WordCounter()
# Counters already made for a tokenizer object or name: chunk_document may be called once per document.
_COUNTERS_BY_OBJECT: "weakref.WeakKeyDictionary[Any, HFTokenCounter]" = weakref.WeakKeyDictionary()
_COUNTERS_BY_NAME: dict[str, HFTokenCounter] = {}


def make_counter(tokenizer: Any = None) -> TokenCounter:
    """A counter from ``None`` (:class:`WordCounter`), a tokenizer name/path, a HF tokenizer, or a counter."""
    if tokenizer is None:
        return _WORD_COUNTER
    if hasattr(tokenizer, "token_spans"):
        return tokenizer
    if isinstance(tokenizer, (str, Path)):
        name = str(tokenizer)
        if name not in _COUNTERS_BY_NAME:
            from transformers import AutoTokenizer  # heavy import only when asked for

            try:
                loaded = AutoTokenizer.from_pretrained(name, use_fast=True)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"--tokenizer {name}: cannot load a tokenizer ({exc})") from None
            _COUNTERS_BY_NAME[name] = HFTokenCounter(loaded)
        return _COUNTERS_BY_NAME[name]
    try:
        counter = _COUNTERS_BY_OBJECT.get(tokenizer)
    except TypeError:  # not weak-referenceable
        return HFTokenCounter(tokenizer)
    if counter is None:
        counter = _COUNTERS_BY_OBJECT[tokenizer] = HFTokenCounter(tokenizer)
    return counter


def _sentence_units(text: str, token_starts: list[int], token_spans: list[tuple[int, int]],
                    max_tokens: int) -> list[tuple[int, int, int]]:
    """Sentences as ``(start, end, n_tokens)``; sentences over budget are cut into token windows.

    Tokens belong to the sentence that holds their start offset. Cut pieces run from their first token to the
    next piece's first token (trailing whitespace trimmed), so no character between tokens is lost even when
    the tokenizer skips some (control characters, unknown symbols).
    """
    units: list[tuple[int, int, int]] = []
    for s_start, s_end in split_sentences(text):
        lo = bisect_left(token_starts, s_start)
        hi = bisect_left(token_starts, s_end)
        n = hi - lo
        if n <= max_tokens:
            units.append((s_start, s_end, n))
            continue
        piece_start = s_start
        for k in range(lo + max_tokens, hi, max_tokens):
            cut = token_spans[k][0]
            end = cut
            while end > piece_start and text[end - 1].isspace():
                end -= 1
            units.append((piece_start, end, max_tokens))
            piece_start = cut
        units.append((piece_start, s_end, hi - (lo + ((hi - lo - 1) // max_tokens) * max_tokens)))
    return units


def chunk_document(doc_id: str, title: str, text: str, tokenizer_or_counter: Any = None, max_tokens: int = 256,
                   overlap_sentences: int = 1, min_tokens: int = 32) -> list[Passage]:
    """Pack the sentences of ``text`` into passages of at most ``max_tokens`` tokens.

    Args:
        doc_id: document id; passages are ``f"{doc_id}#{n}"`` for ``n = 0, 1, ...``.
        title: copied to every passage (it does not count against the budget).
        text: the document body; offsets refer to it.
        tokenizer_or_counter: ``None`` (whitespace words / CJK characters), a HF fast tokenizer, a tokenizer
            name or path, or a :class:`TokenCounter`. Special tokens are not counted.
        max_tokens: token budget of a passage.
        overlap_sentences: sentences repeated at the start of the next passage (for context); reduced
            automatically when they would leave no room for new text.
        min_tokens: a last passage shorter than this is extended backwards with earlier sentences (still
            within ``max_tokens``); a document shorter than this is still one passage.

    Returns:
        Passages in document order; none for a whitespace-only text.
    """
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
    if overlap_sentences < 0:
        raise ConfigError(f"overlap_sentences must be >= 0, got {overlap_sentences}")
    counter = make_counter(tokenizer_or_counter)
    spans = counter.token_spans(text)
    units = _sentence_units(text, [s for s, _ in spans], spans, max_tokens)
    groups: list[tuple[int, int]] = []  # [first_unit, last_unit] inclusive
    i = 0
    n_units = len(units)
    while i < n_units:
        total = units[i][2]
        j = i
        while j + 1 < n_units and total + units[j + 1][2] <= max_tokens:
            j += 1
            total += units[j][2]
        groups.append((i, j))
        if j + 1 >= n_units:
            break
        # Next passage starts with up to `overlap_sentences` units of this one, as long as the next new unit
        # still fits and we make progress (start strictly after i).
        nxt = j + 1
        start = nxt
        room = max_tokens - units[nxt][2]
        while start - 1 > i and nxt - (start - 1) <= overlap_sentences and units[start - 1][2] <= room:
            start -= 1
            room -= units[start][2]
        i = start
    if len(groups) > 1 and min_tokens > 0:
        first, last = groups[-1]
        total = sum(u[2] for u in units[first:last + 1])
        while first > 0 and total < min_tokens and total + units[first - 1][2] <= max_tokens:
            first -= 1
            total += units[first][2]
        groups[-1] = (first, last)
        if groups[-2][0] >= first:  # the extended tail now contains the previous passage: drop it
            groups.pop(-2)
    passages = []
    for n, (first, last) in enumerate(groups):
        start, end = units[first][0], units[last][1]
        passages.append(Passage(f"{doc_id}#{n}", doc_id, title, text[start:end], start, end))
    return passages


@dataclass
class ChunkStats:
    """Counts reported at the end of :func:`chunk_corpus`."""

    documents: int = 0
    skipped_done: int = 0
    empty_documents: int = 0
    passages: int = 0

    def summary(self) -> str:
        """One line, like every stage's report."""
        return (f"{self.documents} documents -> {self.passages} passages ({self.empty_documents} empty, "
                f"{self.skipped_done} already done)")


def chunk_corpus(input_path: str | Path, output_path: str | Path, config: ChunkConfig | None = None, *,
                 fmt: str = "auto", text_unit: str = "block", shard: Shard | None = None,
                 progress: Callable[[Iterable[Document]], Iterable[Document]] | None = None) -> ChunkStats:
    """The chunking stage: every document of ``input_path`` (streamed) into ``output_path`` (BEIR corpus JSONL),
    split as ``config`` says.

    Resumable: documents already finished by an interrupted run (see :class:`DocumentOutput`) are skipped, so
    a re-run produces the same file as an uninterrupted run. ``shard`` processes every n-th document only.
    """
    config = config or ChunkConfig()
    refuse_overwriting_inputs(output_path, input_path, stage="chunk")
    max_tokens, overlap_sentences, min_tokens = config.max_tokens, config.overlap, config.min_tokens
    counter = make_counter(config.tokenizer)
    stats = ChunkStats()
    docs: Iterable[Document] = read_documents(input_path, fmt, text_unit=text_unit,  # type: ignore[arg-type]
                                              shard=shard)
    if progress is not None:
        docs = progress(docs)
    with DocumentOutput(output_path) as out:
        for doc in docs:
            if doc.id in out.done:
                stats.skipped_done += 1
                continue
            passages = chunk_document(doc.id, doc.title, doc.text, counter, max_tokens, overlap_sentences,
                                      min_tokens)
            for passage in passages:
                out.write(passage.to_record())
            out.mark_done(doc.id)
            stats.documents += 1
            stats.passages += len(passages)
            stats.empty_documents += not passages
        out.finish()
    return stats


def iter_passages(documents: Iterable[Document], **kwargs: Any) -> Iterator[Passage]:
    """Passages of each document in turn (``kwargs`` as for :func:`chunk_document`)."""
    for doc in documents:
        yield from chunk_document(doc.id, doc.title, doc.text, **kwargs)


CHUNK = document_step("chunk", ChunkConfig, chunk_corpus)
"""Documents -> passages as a :class:`~robustir.runs.Step` (job settings ``format``, ``text_unit``)."""
