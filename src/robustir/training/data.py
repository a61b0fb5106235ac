"""Turning training examples into per-step batches: deterministic by (seed, epoch, step, rank).

A step takes ``batch_size × world_size`` examples from the epoch's permutation; each process takes
its slice. Each example contributes its query, one positive (sampled) and ``k`` hard negatives
(sampled without replacement when it has enough, with replacement when it has a few, and from other
examples' passages when it has none) — FlagEmbedding's group layout.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import numpy as np
import torch

from ..data.training_data import TrainingExample


def text_id(text: str) -> int:
    """A stable 63-bit id of a passage text (duplicate passages in a batch share it)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big") >> 1


@dataclass
class Group:
    query: str
    prompt: str | None
    passages: list[str]  # [positive, negative_1..negative_k]


class GroupSampler:
    def __init__(self, examples: list[TrainingExample], num_negatives: int, batch_size: int, world_size: int,
                 seed: int) -> None:
        self.examples = examples
        self.k = num_negatives
        self.batch_size = batch_size
        self.world_size = world_size
        self.seed = seed
        self.global_batch = batch_size * world_size
        if len(examples) < self.global_batch:
            raise ValueError(f"{len(examples)} training examples are fewer than one global batch "
                             f"({batch_size} x {world_size} processes); lower batch_size")
        self.steps_per_epoch = len(examples) // self.global_batch
        # passages of other examples, used only when an example has no negatives at all
        self._pool = [p for e in examples for p in e.pos] + [n for e in examples for n in e.neg]

    def permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

    def group(self, index: int, epoch: int) -> Group:
        example = self.examples[index]
        rng = random.Random(f"{self.seed}:{epoch}:{index}")
        positive = rng.choice(example.pos)
        negatives: list[str] = []
        if self.k:
            if len(example.neg) >= self.k:
                negatives = rng.sample(example.neg, self.k)
            elif example.neg:
                negatives = list(example.neg) + [rng.choice(example.neg) for _ in range(self.k - len(example.neg))]
            else:
                own = set(example.pos)
                while len(negatives) < self.k:
                    candidate = rng.choice(self._pool)
                    if candidate not in own:
                        negatives.append(candidate)
        return Group(example.query, example.prompt, [positive, *negatives])

    def batch(self, step: int, rank: int) -> list[Group]:
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self.permutation(epoch)
        start = within * self.global_batch + rank * self.batch_size
        return [self.group(int(i), epoch) for i in order[start:start + self.batch_size]]


def collate(groups: list[Group], encoder, query_max_length: int, passage_max_length: int) -> tuple[dict, dict, torch.Tensor]:
    """Tokenise a batch of groups → (query features, passage features, passage ids)."""
    default = encoder.config.query_instruction
    queries = [(g.prompt if g.prompt is not None else default) + g.query for g in groups]
    passages = [p for g in groups for p in g.passages]
    prefix = encoder.config.passage_instruction
    q = encoder.tokenizer(queries, padding=True, truncation=True, max_length=query_max_length, return_tensors="pt")
    p = encoder.tokenizer([prefix + x for x in passages] if prefix else passages, padding=True, truncation=True,
                          max_length=passage_max_length, return_tensors="pt")
    ids = torch.tensor([text_id(x) for x in passages], dtype=torch.long)
    return dict(q), dict(p), ids
