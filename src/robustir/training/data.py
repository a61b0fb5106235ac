"""Turning training examples into per-step batches: deterministic by (seed, epoch, step, rank).

A step takes ``batch_size × world_size`` items from the epoch's permutation; each process takes
its slice. An item is an example (``epoch_unit="queries"``: one positive sampled per epoch) or one
(query, positive) pair (``"pairs"``, sentence-transformers' epoch: every labelled pair once per epoch).
Each item contributes its query, its positive and ``k`` hard negatives
(sampled without replacement when it has enough, with replacement when it has a few, and from other
examples' passages when it has none) — FlagEmbedding's group layout.

:class:`GroupSampler` checks at construction what would otherwise fail (or hang) mid-run: fewer items than one
global batch, and an example without negatives whose every candidate in the pool is one of its own positives
(both a :class:`~robustir.errors.ConfigError` saying how to fix the data or the settings).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import numpy as np
import torch

from ..data.training_data import TrainingExample
from ..errors import ConfigError

_REJECTION_TRIES = 64  # draws from the whole pool before sampling from the pool minus the example's positives


def text_id(text: str) -> int:
    """A stable 63-bit id of a passage text (duplicate passages in a batch share it)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big") >> 1


@dataclass
class Group:
    query: str
    prompt: str | None
    passages: list[str]  # [positive, negative_1..negative_k]
    positives: tuple[str, ...] = ()  # every known positive of the query (masked as in-batch negatives)


class GroupSampler:
    def __init__(self, examples: list[TrainingExample], num_negatives: int, batch_size: int, world_size: int,
                 seed: int, epoch_unit: str = "queries") -> None:
        if epoch_unit not in ("queries", "pairs"):
            raise ConfigError(f"epoch_unit must be 'queries' or 'pairs', got {epoch_unit!r}")
        self.examples = examples
        self.epoch_unit = epoch_unit
        # (example, positive) per item; positive -1 = sample one per epoch
        self.items = ([(i, j) for i, e in enumerate(examples) for j in range(len(e.pos))] if epoch_unit == "pairs"
                      else [(i, -1) for i in range(len(examples))])
        self.k = num_negatives
        self.batch_size = batch_size
        self.world_size = world_size
        self.seed = seed
        self.global_batch = batch_size * world_size
        if len(self.items) < self.global_batch:
            unit = "(query, positive) pairs" if epoch_unit == "pairs" else "queries"
            fix = (f"lower batch_size to {len(self.items) // world_size} or less" if len(self.items) >= world_size
                   else "use fewer processes")
            raise ConfigError(f"the training data has {len(self.items)} {unit} (epoch_unit {epoch_unit}), fewer than "
                              f"one global batch: batch_size {batch_size} x {world_size} process(es) = "
                              f"{self.global_batch}. Fix: {fix}, or add training data")
        self.steps_per_epoch = len(self.items) // self.global_batch
        # passages of other examples, used only when an example has no negatives at all
        self._pool = [p for e in examples for p in e.pos] + [n for e in examples for n in e.neg]
        if self.k:
            self._check_pool()

    def _check_pool(self) -> None:
        """Every example without negatives must find one in the pool that is not one of its own positives."""
        distinct = set(self._pool)
        for index, example in enumerate(self.examples):
            if example.neg:
                continue
            own = set(example.pos)
            if len(distinct) > len(own) or not distinct <= own:
                continue
            query = example.query if len(example.query) <= 80 else example.query[:77] + "..."
            raise ConfigError(
                f"training example {index + 1} (query {query!r}) has no hard negatives, and every passage in the "
                f"training data is one of its own positives, so no negative can be drawn for it (num_negatives "
                f"{self.k}). Fix: give the records \"neg\" passages, mine some (robustir mine, or mine: bm25 in the "
                "train config), or set num_negatives 0 (in-batch negatives only)")

    def permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.items))

    def group(self, item: int, epoch: int) -> Group:
        index, which = self.items[item]
        example = self.examples[index]
        rng = random.Random(f"{self.seed}:{epoch}:{index}" if which < 0 else f"{self.seed}:{epoch}:{index}:{which}")
        positive = rng.choice(example.pos) if which < 0 else example.pos[which]
        negatives: list[str] = []
        if self.k:
            if len(example.neg) >= self.k:
                negatives = rng.sample(example.neg, self.k)
            elif example.neg:
                negatives = list(example.neg) + [rng.choice(example.neg) for _ in range(self.k - len(example.neg))]
            else:  # other examples' passages: some draws from the whole pool, then from the pool minus own
                own = set(example.pos)  # positives (never empty: checked at construction), so this always ends
                candidates: list[str] | None = None
                tries = 0
                while len(negatives) < self.k:
                    if tries < _REJECTION_TRIES:
                        tries += 1
                        candidate = rng.choice(self._pool)
                        if candidate not in own:
                            negatives.append(candidate)
                        continue
                    if candidates is None:
                        candidates = [p for p in self._pool if p not in own]
                    negatives.append(rng.choice(candidates))
        return Group(example.query, example.prompt, [positive, *negatives], tuple(example.pos))

    def batch(self, step: int, rank: int) -> list[Group]:
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self.permutation(epoch)
        start = within * self.global_batch + rank * self.batch_size
        return [self.group(int(i), epoch) for i in order[start:start + self.batch_size]]


def collate(groups: list[Group], encoder, query_max_length: int,
            passage_max_length: int) -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    """Tokenise a batch of groups → (query features, passage features, passage ids, ``(b, P)`` positive ids)."""
    default = encoder.config.query_instruction
    queries = [(g.prompt if g.prompt is not None else default) + g.query for g in groups]
    passages = [p for g in groups for p in g.passages]
    prefix = encoder.config.passage_instruction
    q = encoder.tokenizer(queries, padding=True, truncation=True, max_length=query_max_length, return_tensors="pt")
    p = encoder.tokenizer([prefix + x for x in passages] if prefix else passages, padding=True, truncation=True,
                          max_length=passage_max_length, return_tensors="pt")
    ids = torch.tensor([text_id(x) for x in passages], dtype=torch.long)
    width = max(1, max(len(g.positives) for g in groups))
    positive_ids = torch.full((len(groups), width), -1, dtype=torch.long)
    for row, group in enumerate(groups):
        for col, text in enumerate(group.positives):
            positive_ids[row, col] = text_id(text)
    return dict(q), dict(p), ids, positive_ids
