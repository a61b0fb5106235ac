"""Turning training examples into per-step batches: deterministic by (seed, epoch, step, rank).

A step takes ``batch_size × world_size`` items from the epoch's permutation; each process takes
its slice. An item is an example (``epoch_unit="queries"``: one positive sampled per epoch) or one
(query, positive) pair (``"pairs"``, sentence-transformers' epoch: every labelled pair once per epoch).
Each item contributes its query, its positive and ``k`` hard negatives
(sampled without replacement when it has enough, with replacement when it has a few, and from other
examples' passages when it has none) — FlagEmbedding's group layout.

The examples are :class:`~robustir.data.arrow_store.TrainingRows` (memory-mapped Arrow, read row by row by index;
a list of examples is turned into the same columns in memory): the sampler holds no list of the examples or of
their passages, and "other examples' passages" are drawn by index into the flattened ``pos``/``neg`` columns, the
same draws the list-based sampler made. Several :class:`SamplerSource` make a mixture: every global batch comes from
one source, chosen by a seeded function of (seed, step) that follows the weights (:meth:`GroupSampler.assign`);
each source has its task (``retrieval``, ``symmetric``: both directions, ``title``), instructions and
``in_batch_negatives`` flag (docs/methods.md, "Training data at scale and mixtures").

:class:`GroupSampler` checks at construction what would otherwise fail (or hang) mid-run: fewer items than one
global batch, and an example without negatives whose every candidate in the pool is one of its own positives
(both a :class:`~robustir.errors.ConfigError` saying how to fix the data or the settings).

Tokenisation: :func:`collate` is the reference (the ``transformers`` tokenizer's ``__call__``, padding to the longest
in the batch). :class:`Collator` makes the same tensors faster and off the main thread: it owns copies of the fast
tokenizer's backend (one set up for queries, one for passages, so neither the evaluation's tokenizer calls nor another
thread change its truncation), calls ``encode_batch_fast`` once for all queries and once for all passages (Rust,
without the GIL) and writes the ids straight into padded numpy arrays (no per-row Python lists of the attention
mask or token types, no nested-list -> tensor conversion). It checks at construction, on a probe set, that it gives
the reference's tensors; a tokenizer it cannot mirror (slow, left padding, ...) goes through the reference call
on a private copy. :class:`StepBatches` is ``step -> Collator(sampler.batch(step, rank))``, picklable, for
:class:`~robustir.training.input_pipeline.InputPipeline`'s background thread or DataLoader workers.
"""

from __future__ import annotations

import copy
import itertools
import logging
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..data.arrow_store import TrainingRows, passage_hash
from ..data.training_data import TrainingExample
from ..errors import ConfigError
from ..models.encoder import EncoderConfig

logger = logging.getLogger(__name__)

_REJECTION_TRIES = 64  # draws from the whole pool before sampling from the pool minus the example's positives


def text_id(text: str) -> int:
    """A stable 63-bit id of a passage text (duplicate passages in a batch share it)."""
    from ..io import text_digest

    return int.from_bytes(text_digest(text), "big") >> 1


@dataclass
class Group:
    query: str
    prompt: str | None
    passages: list[str]  # [positive, negative_1..negative_k]
    positives: tuple[str, ...] = ()  # every known positive of the query (masked as in-batch negatives)
    passage_prompt: str | None = None  # prefix of the passages; None = the encoder's passage instruction


#: what a training source's pairs are (``TrainSource.task``)
TASKS = ("retrieval", "symmetric", "title")


@dataclass
class SamplerSource:
    """One source of the training data as the sampler sees it: its rows and how its groups are made.

    ``task``: ``retrieval`` (query -> passage), ``symmetric`` (both directions of every pair: the positive also
    asks for the query) or ``title`` (title -> passage). ``query_instruction`` / ``passage_instruction``: this
    source's prefixes; None = the encoder's for ``retrieval``, none for ``symmetric`` and ``title`` (BGE adds its
    retrieval instruction to retrieval queries only). A record's own ``prompt`` wins over both.
    ``in_batch_negatives``: False = a row's loss sees only its own hard negatives (applied by the batch engine).
    ``weight``: share of the steps (None for every source = proportional to the source's items).
    ``budget_items``: the items the step budget counts, when they differ from the rows' own: a source whose
    suspect positives ``filter_positives`` dropped trains as many steps as the unfiltered data would.
    """

    rows: TrainingRows
    name: str = "train"
    weight: float | None = None
    task: str = "retrieval"
    query_instruction: str | None = None
    passage_instruction: str | None = None
    in_batch_negatives: bool = True
    budget_items: int | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"training source {self.name!r}: task must be one of {', '.join(TASKS)}, "
                              f"got {self.task!r}")


def source_items(source: SamplerSource, epoch_unit: str) -> int:
    """What one epoch passes over in ``source``: its queries or its (query, positive) pairs, both directions of
    each for a ``symmetric`` source."""
    rows = source.rows
    items = rows.num_pairs if epoch_unit == "pairs" else len(rows)
    return 2 * items if source.task == "symmetric" else items


def fit_batch_size(sources: list[SamplerSource], batch_size: int, world_size: int, epoch_unit: str, *,
                   log: bool = True) -> int:
    """The per-process batch size to train ``sources`` with: ``batch_size``, or, for training data (one source)
    smaller than one global batch, ``items // world_size``, with one warning naming both numbers (``log``: on
    the main process only).

    A data set smaller than a batch then trains, as it does with sentence-transformers (whose only batch is
    short), instead of failing. Not for a mixture, where one small source would shrink every source's batches
    (:class:`GroupSampler` names the source instead), nor below one item per process."""
    if len(sources) != 1:
        return batch_size
    items = source_items(sources[0], epoch_unit)
    if items >= batch_size * world_size or items < world_size:
        return batch_size
    capped = items // world_size
    if log:
        unit = "(query, positive) pairs" if epoch_unit == "pairs" else "queries"
        per = f" over {world_size} processes" if world_size > 1 else ""
        logger.warning("the training data has %d %s (epoch_unit %s), fewer than one batch of %d%s: batch_size capped "
                       "at %d", items, unit, epoch_unit, batch_size * world_size, per, capped)
    return capped


class _Pool(Sequence):
    """The passages examples without negatives draw from, read by index (``rng.choice`` takes one)."""

    def __init__(self, rows: TrainingRows) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows.pool_size

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        return self.rows.pool_passage(index)


_MIXTURE_BLOCK = 1024  # steps whose sources are drawn together (one generator call)
_MIXTURE_SALT = 0x6D6978  # "mix": keeps the source draws apart from the permutations' streams


class GroupSampler:
    """Per-step groups of one or several training sources (see the module docstring).

    ``data``: a list of :class:`TrainingExample`, a :class:`~robustir.data.arrow_store.TrainingRows` (memory-mapped
    Arrow, read row by row) or a list of :class:`SamplerSource` (a mixture). One source gives the batches robustir
    has always given for a seed; with several, every global batch comes from one source (BGE's homogeneous
    batches), chosen by :meth:`assign`, a seeded function of (seed, step) following the weights.
    """

    def __init__(self, data: "list[TrainingExample] | TrainingRows | list[SamplerSource]", num_negatives: int,
                 batch_size: int, world_size: int, seed: int, epoch_unit: str = "queries") -> None:
        if epoch_unit not in ("queries", "pairs"):
            raise ConfigError(f"epoch_unit must be 'queries' or 'pairs', got {epoch_unit!r}")
        self.sources = _as_sources(data)
        self.mixture = len(self.sources) > 1
        self.epoch_unit = epoch_unit
        self.k = num_negatives
        self.batch_size = batch_size
        self.world_size = world_size
        self.seed = seed
        self.global_batch = batch_size * world_size
        self.source_items = [self._items(s) for s in self.sources]  # items (queries or pairs) per source
        self.source_steps = []  # steps per pass over each source
        for source, items in zip(self.sources, self.source_items):
            if items < self.global_batch:
                unit = "(query, positive) pairs" if epoch_unit == "pairs" else "queries"
                fix = (f"lower batch_size to {items // world_size} or less" if items >= world_size
                       else "use fewer processes")
                what = f"training source {source.name!r}" if self.mixture else "the training data"
                raise ConfigError(f"{what} has {items} {unit} (epoch_unit {epoch_unit}), fewer than one global "
                                  f"batch: batch_size {batch_size} x {world_size} process(es) = {self.global_batch}. "
                                  f"Fix: {fix}, or add training data" + (" to that source, or leave it out of "
                                                                        "train_data" if self.mixture else ""))
            self.source_steps.append(items // self.global_batch)
        #: steps of one epoch: one pass over every source (with weights, a source is passed over more or less often)
        self.steps_per_epoch = sum(self.source_steps)
        weights = [s.weight for s in self.sources]
        if self.mixture and any(w is None for w in weights) and not all(w is None for w in weights):
            missing = [s.name for s in self.sources if s.weight is None]
            raise ConfigError(f"training sources {missing} have no weight while others have one. Fix: give every "
                              "source a weight, or none (then each source's share of the steps follows its size)")
        shares = np.array([float(w) if w is not None else float(n) for w, n in zip(weights, self.source_items)])
        if not np.all(np.isfinite(shares)) or np.any(shares <= 0):
            raise ConfigError(f"training source weights must be > 0, got {[s.weight for s in self.sources]}")
        self.shares = shares / shares.sum()
        self._cumulative = np.cumsum(self.shares)
        self._blocks: list[np.ndarray] = []  # source of each step, per block of _MIXTURE_BLOCK steps
        self._before: list[np.ndarray] = []  # steps of each source before each block
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, that epoch's permutation)
        self._lock = threading.Lock()  # the input pipeline's thread and the step both ask for sources
        if self.k:
            for index in range(len(self.sources)):
                self._check_pool(index)

    def _items(self, source: SamplerSource) -> int:
        return source_items(source, self.epoch_unit)

    def _check_pool(self, index: int) -> None:
        """Every example without negatives must find one in its source's pool that is not one of its own
        positives. From the conversion's statistics: with more distinct pool passages than any row has positives
        nothing can fail; otherwise only the rows without negatives are read (and the pool scanned for a row
        whose own passages cover its sample of distinct passages)."""
        source = self.sources[index]
        rows, stats = source.rows, source.rows.stats
        if not stats["rows_without_neg"]:
            return
        symmetric = source.task == "symmetric"  # the query is excluded from its own negatives too
        sample = set(stats["pool_sample"])
        if len(sample) > stats["max_pos"] + symmetric:
            return
        for row in rows.rows_without_negatives():
            query, pos, _, _ = rows.row(row)
            own = set(pos) | ({query} if symmetric else set())
            if not sample <= {passage_hash(p) for p in own}:
                continue
            if not stats["pool_sample_complete"] and not rows.pool_within(own):
                continue
            shown = query if len(query) <= 80 else query[:77] + "..."
            where = f"training source {source.name!r}: " if self.mixture else ""
            raise ConfigError(
                f"{where}training example {row + 1} (query {shown!r}) has no hard negatives, and every passage in the "
                f"training data is one of its own positives, so no negative can be drawn for it (num_negatives "
                f"{self.k}). Fix: give the records \"neg\" passages, mine some (robustir mine, or mine: bm25 in the "
                "train config), or set num_negatives 0 (in-batch negatives only)")

    def __getstate__(self) -> dict:
        # for DataLoader workers: the rows pickle as their folder; caches and the lock are rebuilt there
        state = dict(self.__dict__)
        state.update(_lock=None, _orders={}, _blocks=[], _before=[])
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------ step -> source, items

    def assign(self, step: int) -> tuple[int, int]:
        """``(source, position)`` of a step: the source its global batch comes from, and how many of that source's
        batches came before it. Drawn per block of steps from ``(seed, block)`` with the sources' shares, so the
        same seed gives the same sources at every step, on every process, resumed or not."""
        if not self.mixture:
            return 0, step
        block, offset = divmod(step, _MIXTURE_BLOCK)
        with self._lock:
            self._draw_blocks(block)
        sources = self._blocks[block]
        source = int(sources[offset])
        return source, int(self._before[block][source]) + int(np.count_nonzero(sources[:offset] == source))

    def _draw_blocks(self, block: int) -> None:
        while len(self._blocks) <= block:
            b = len(self._blocks)
            draws = np.random.default_rng([self.seed, _MIXTURE_SALT, b]).random(_MIXTURE_BLOCK)
            sources = np.minimum(np.searchsorted(self._cumulative, draws, side="right"), len(self.sources) - 1)
            before = (self._before[-1] + np.bincount(self._blocks[-1], minlength=len(self.sources))
                      if self._blocks else np.zeros(len(self.sources), dtype=np.int64))
            self._before.append(before)
            self._blocks.append(sources.astype(np.int16))

    def source_of(self, step: int) -> SamplerSource:
        """The source the global batch of ``step`` comes from."""
        return self.sources[self.assign(step)[0]]

    def permutation(self, epoch: int, source: int = 0) -> np.ndarray:
        """The order of a source's items in an epoch (of that source). One source: ``default_rng([seed, epoch])``,
        as robustir always drew it; int32 when it fits (half the memory; the same permutation)."""
        cached = self._orders.get(source)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        n = self.source_items[source]
        order = np.arange(n, dtype=np.int32 if n < 2 ** 31 else np.int64)
        key = [self.seed, epoch] if not self.mixture else [self.seed, epoch, source]
        np.random.default_rng(key).shuffle(order)  # the same permutation as default_rng(key).permutation(n)
        self._orders[source] = (epoch, order)
        return order

    def indices(self, step: int, rank: int) -> tuple[int, int, np.ndarray]:
        """``(source, epoch of that source, items)`` of this process's part of the global batch of ``step``."""
        source, position = self.assign(step)
        epoch, within = divmod(position, self.source_steps[source])
        start = within * self.global_batch + rank * self.batch_size
        return source, epoch, self.permutation(epoch, source)[start:start + self.batch_size]

    def batch(self, step: int, rank: int) -> list[Group]:
        source, epoch, items = self.indices(step, rank)
        return [self.group(int(i), epoch, source) for i in items]

    # ------------------------------------------------------------------------ one group

    def group(self, item: int, epoch: int, source: int = 0) -> Group:
        spec = self.sources[source]
        rows = spec.rows
        forward_items = rows.num_pairs if self.epoch_unit == "pairs" else len(rows)
        reverse = item >= forward_items  # symmetric sources: the second half of the items are the other direction
        unit = item - forward_items if reverse else item
        index, which = rows.pair(unit) if self.epoch_unit == "pairs" else (unit, -1)
        query, pos, neg, prompt = rows.row(index)
        tag = f"{self.seed}:{epoch}:{index}" if which < 0 else f"{self.seed}:{epoch}:{index}:{which}"
        if self.mixture:
            tag = f"{spec.name}:{tag}"
        rng = random.Random(tag + ":reverse" if reverse else tag)
        positive = rng.choice(pos) if which < 0 else pos[which]
        symmetric = spec.task == "symmetric"
        known = tuple(dict.fromkeys([query, *pos])) if symmetric else tuple(pos)
        negatives: list[str] = []
        if self.k:
            if len(neg) >= self.k:
                negatives = rng.sample(neg, self.k)
            elif neg:
                negatives = list(neg) + [rng.choice(neg) for _ in range(self.k - len(neg))]
            else:  # other examples' passages: some draws from the whole pool, then from the pool minus own
                own = set(known)  # positives (never empty: checked at construction), so this always ends
                pool = _Pool(rows)
                candidates: Sequence[str] | None = None
                tries = 0
                while len(negatives) < self.k:
                    if tries < _REJECTION_TRIES:
                        tries += 1
                        candidate = rng.choice(pool)
                        if candidate not in own:
                            negatives.append(candidate)
                        continue
                    if candidates is None:
                        candidates = rows.pool_outside(own)
                    negatives.append(rng.choice(candidates))
        if reverse:  # the positive asks for the query
            query, positive = positive, query
        default_prompt = spec.query_instruction if spec.query_instruction is not None else (
            None if spec.task == "retrieval" else "")
        passage_prompt = spec.passage_instruction if spec.passage_instruction is not None else (
            None if spec.task == "retrieval" else "")
        return Group(query, prompt if prompt is not None else default_prompt, [positive, *negatives], known,
                     passage_prompt)


def _as_sources(data: "list[TrainingExample] | TrainingRows | list[SamplerSource]") -> list[SamplerSource]:
    if isinstance(data, TrainingRows):
        return [SamplerSource(data)]
    data = list(data)
    if data and all(isinstance(d, SamplerSource) for d in data):
        names = [s.name for s in data]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"training sources need distinct names; {duplicates} is given more than once. Fix: "
                              "give each source its own name")
        return data
    if all(isinstance(d, TrainingExample) for d in data):
        return [SamplerSource(TrainingRows.from_examples(data))]
    raise TypeError("GroupSampler takes a list of TrainingExample, a TrainingRows or a list of SamplerSource")


Features = dict[str, torch.Tensor]
CollatedBatch = tuple[Features, Features, torch.Tensor, torch.Tensor]


def _batch_texts(groups: list[Group], instructions: EncoderConfig) -> tuple[list[str], list[str], list[str]]:
    """(queries with their instruction, passages as stored, passages with their instruction): a group's own
    ``prompt`` / ``passage_prompt`` (a record's, a training source's) when it has one, else the encoder's."""
    queries = [q for g in groups for q in instructions.with_instruction([g.query], "query", g.prompt)]
    passages = [p for g in groups for p in g.passages]
    prefixed = [x for g in groups for x in instructions.with_instruction(g.passages, "passage", g.passage_prompt)]
    return queries, passages, prefixed


def _passage_ids(groups: list[Group], passages: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids of the passages, ``(b, P)`` ids of each query's known positives, -1 padded).

    A query's known positives are those of every group of the batch with the same query and prompt: data with one
    positive per line (FlagEmbedding rows, ``--train-data`` records of a query split over lines, the side-by-side
    rows) otherwise meets another positive of the same query in the batch as a negative. sentence-transformers'
    ``NO_DUPLICATES`` sampler keeps such rows out of one batch; here they stay and the column is masked."""
    ids = torch.tensor([text_id(x) for x in passages], dtype=torch.long)
    shared: dict[tuple[str, str | None], dict[str, None]] = {}
    for group in groups:
        shared.setdefault((group.query, group.prompt), {}).update(dict.fromkeys(group.positives))
    known = [tuple(shared[(group.query, group.prompt)]) for group in groups]
    width = max(1, max(len(k) for k in known))
    positive_ids = torch.full((len(groups), width), -1, dtype=torch.long)
    for row, texts in enumerate(known):
        for col, text in enumerate(texts):
            positive_ids[row, col] = text_id(text)
    return ids, positive_ids


def collate(groups: list[Group], encoder, query_max_length: int,
            passage_max_length: int) -> CollatedBatch:
    """Tokenise a batch of groups → (query features, passage features, passage ids, ``(b, P)`` positive ids).

    The reference: the ``transformers`` tokenizer's ``__call__`` on ``encoder.tokenizer``, on the calling thread.
    Training uses :class:`Collator`, which gives the same tensors."""
    from ..models.tokens import head_texts

    queries, passages, prefixed = _batch_texts(groups, encoder.config)
    q = encoder.tokenizer(head_texts(encoder.tokenizer, queries, query_max_length), padding=True, truncation=True,
                          max_length=query_max_length, return_tensors="pt")
    p = encoder.tokenizer(head_texts(encoder.tokenizer, prefixed, passage_max_length), padding=True,
                          truncation=True, max_length=passage_max_length, return_tensors="pt")
    return (dict(q), dict(p), *_passage_ids(groups, passages))


#: texts the fast path is checked on at construction: empty, special-token strings, accents and CJK, a text far
#: longer than any max length (truncation), whitespace runs, emoji
_PROBE_TEXTS = ("", "a", "Hello, World!", "[SEP] [CLS] [PAD] [MASK] <s> </s> <pad>", "naïve café déjà vu",
                "東京は日本の首都です", "   spaced   out\t\ttext\n", "emoji 😀 and symbols ∑ ≤ →",
                " ".join(f"word{i} ##piece-{i}" for i in range(400)))


class _FastTokenizer:
    """One max length's worth of ``tokenizer(texts, padding=True, truncation=True, max_length=...,
    pad_to_multiple_of=..., return_tensors="pt")``, on a private copy of the backend.

    ``encode_batch_fast`` encodes without padding (and without offsets); the ids are written into a
    ``(rows, longest)`` array through a boolean mask in one numpy call, the attention mask is that mask, the token
    types the single-sequence template's constant type (checked uniform here)."""

    def __init__(self, tokenizer, max_length: int, pad_to_multiple_of: int | None) -> None:
        from ..models.batching import private_backend

        self.backend = private_backend(tokenizer, max_length)
        self.pad_id = int(tokenizer.pad_token_id)
        self.pad_type_id = int(getattr(tokenizer, "pad_token_type_id", 0) or 0)
        self.multiple = pad_to_multiple_of
        names = tuple(getattr(tokenizer, "model_input_names", ("input_ids", "token_type_ids", "attention_mask")))
        self.keys = ("input_ids",) + tuple(k for k in ("token_type_ids", "attention_mask") if k in names)
        types = set(self._encode(["a", "a longer probe text"])[1].type_ids)
        self.type_id = types.pop() if len(types) == 1 else None  # None: read each row's types

    def _encode(self, texts: list[str]) -> list:
        encode = getattr(self.backend, "encode_batch_fast", None) or self.backend.encode_batch
        return encode(texts, add_special_tokens=True)

    def __call__(self, texts: list[str]) -> Features:
        encodings = self._encode(texts)
        rows = len(encodings)
        lengths = np.fromiter((len(e) for e in encodings), dtype=np.int64, count=rows)
        width = int(lengths.max()) if rows else 0
        if self.multiple and width % self.multiple:
            width += self.multiple - width % self.multiple
        mask = np.arange(width) < lengths[:, None]
        total = int(lengths.sum())
        input_ids = np.full((rows, width), self.pad_id, dtype=np.int64)
        input_ids[mask] = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int64,
                                      count=total)
        out = {"input_ids": torch.from_numpy(input_ids)}
        if "token_type_ids" in self.keys:
            types = np.full((rows, width), self.pad_type_id, dtype=np.int64)
            if self.type_id is not None:
                types[mask] = self.type_id
            else:
                types[mask] = np.fromiter(itertools.chain.from_iterable(e.type_ids for e in encodings),
                                          dtype=np.int64, count=total)
            out["token_type_ids"] = torch.from_numpy(types)
        if "attention_mask" in self.keys:
            out["attention_mask"] = torch.from_numpy(mask.astype(np.int64))
        return out


class Collator:
    """:func:`collate`'s tensors, made fast and safe to call from a background thread or a DataLoader worker.

    ``tokenizer``: the encoder's (copied, never called: the evaluation may use the original meanwhile);
    ``query_instruction`` / ``passage_instruction``: the encoder config's prefixes; ``pad_to_multiple_of``: round the
    padded length up (8 suits GPU tensor cores; None pads to the longest in the batch). ``fast`` false (or a
    tokenizer the fast path does not reproduce on the probe texts) uses the reference ``__call__`` on the copy.
    """

    def __init__(self, tokenizer, query_max_length: int, passage_max_length: int, *,
                 query_instruction: str | None = "", passage_instruction: str | None = "",
                 pad_to_multiple_of: int | None = None, fast: bool = True) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)
        self.query_max_length, self.passage_max_length = query_max_length, passage_max_length
        self.instructions = EncoderConfig(query_instruction=query_instruction or "",
                                          passage_instruction=passage_instruction or "")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.fast: tuple[_FastTokenizer, _FastTokenizer] | None = None
        if fast:
            self.fast = self._fast_tokenizers()

    @classmethod
    def for_encoder(cls, encoder, query_max_length: int, passage_max_length: int, **options) -> "Collator":
        return cls(encoder.tokenizer, query_max_length, passage_max_length,
                   query_instruction=encoder.config.query_instruction,
                   passage_instruction=encoder.config.passage_instruction, **options)

    def _fast_tokenizers(self) -> tuple[_FastTokenizer, _FastTokenizer] | None:
        tokenizer = self.tokenizer
        why = None
        if not getattr(tokenizer, "is_fast", False):
            why = "not a fast (Rust) tokenizer"
        elif getattr(tokenizer, "padding_side", "right") != "right":
            why = f"padding side {tokenizer.padding_side}"
        elif tokenizer.pad_token_id is None:
            why = "no padding token"
        if why is None:
            fast = (_FastTokenizer(tokenizer, self.query_max_length, self.pad_to_multiple_of),
                    _FastTokenizer(tokenizer, self.passage_max_length, self.pad_to_multiple_of))
            probe = list(_PROBE_TEXTS)
            for tokens, length in zip(fast, (self.query_max_length, self.passage_max_length)):
                if not _equal_features(tokens(probe), self._reference(probe, length)):
                    why = "its tensors differ from the tokenizer's own call on the probe texts"
                    break
            else:
                return fast
        logger.info("training tokenisation through the transformers tokenizer call (%s)", why)
        return None

    def _reference(self, texts: list[str], max_length: int) -> Features:
        return dict(self.tokenizer(texts, padding=True, truncation=True, max_length=max_length,
                                   pad_to_multiple_of=self.pad_to_multiple_of, return_tensors="pt"))

    def features(self, texts: list[str], kind: str) -> Features:
        """Token features of ``texts`` (already prefixed), truncated at the ``kind`` ("query"/"passage") length; a
        long text is cut before it is tokenized (:func:`robustir.models.tokens.head_texts`: same ids, bounded
        memory)."""
        from ..models.tokens import head_texts

        length = self.query_max_length if kind == "query" else self.passage_max_length
        texts = head_texts(self.tokenizer, texts, length)
        if self.fast is not None:
            return self.fast[0 if kind == "query" else 1](texts)
        return self._reference(texts, length)

    def __call__(self, groups: list[Group]) -> CollatedBatch:
        queries, passages, prefixed = _batch_texts(groups, self.instructions)
        return (self.features(queries, "query"), self.features(prefixed, "passage"), *_passage_ids(groups, passages))


def _equal_features(a: Features, b: Features) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


class StepBatches:
    """``step -> collated batch`` of this process (``rank``): a function of (seed, epoch, step, rank) only, so the
    batch of a step is the same whichever thread or worker makes it, and whenever."""

    def __init__(self, sampler: GroupSampler, collator: Collator, rank: int) -> None:
        self.sampler, self.collator, self.rank = sampler, collator, rank

    def __call__(self, step: int) -> CollatedBatch:
        return self.collator(self.sampler.batch(step, self.rank))
