"""Everything ``robustir train`` accepts, as one dataclass (YAML/JSON config + flags + key=value overrides)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from ..validation import NonNegativeInt, PositiveInt
from .loop import LoopConfig


@dataclass
class TrainConfig(LoopConfig):
    """The fine-tuning stage's fields; the training loop's (``batch_size``, ``epochs``, ``max_steps``, ``lr``,
    ``warmup_ratio``, ``weight_decay``, ``max_grad_norm``, ``seed``, ``bf16``, ``gradient_checkpointing``,
    ``output``, ``save_steps``, ``save_total_limit``, ``logging_steps``, ``resume``, ``report``) come from
    :class:`~robustir.training.loop.LoopConfig`, with its defaults."""

    # model
    model: str | None = None  # folder or hub id; None = the bundled all-MiniLM-L6-v2
    pooling: Literal["cls", "mean"] | None = None  # None = read from the model folder
    query_max_length: PositiveInt | None = None  # query tokens (None: 64, or the model's limit if lower); saved
    passage_max_length: PositiveInt | None = None  # None: 256, or the model's limit if lower; saved; for evaluation
    train_passage_max_length: PositiveInt | None = None  # shorter truncation while training (cheaper); None = same
    query_instruction: str | None = None
    passage_instruction: str | None = None
    # data
    train_data: str = ""  # training JSONL (file or folder) or a BEIR folder with a train split
    train_split: str = "train"
    mine: Literal["bm25", "dense", "none"] = "bm25"  # mine negatives for examples without any; none = in-batch only
    mine_negatives: PositiveInt = 20  # negatives kept per query by mining (training samples from these)
    mine_range_min: NonNegativeInt = 0  # skip this many top-ranked non-positives (likely false negatives)
    num_negatives: NonNegativeInt = 1  # hard negatives per query in each training group
    # loss
    loss: Literal["infonce", "peg", "ccr"] = "infonce"  # contrastive loss; its options go in loss_options
    loss_options: dict = field(default_factory=dict)  # e.g. {temperature: 0.02, beta: 0.2}
    # optimisation (batch_size: queries per process per step; the rest: LoopConfig)
    chunk_size: PositiveInt | None = None  # GradCache: rows per forward chunk (None = no caching)
    loss_block_rows: PositiveInt | None = None
    """Query rows per block of the loss's score matrix (exact; bounds memory at huge batches). None = whole batch
    while it holds at most 2**25 scores, else blocks of that size."""
    epoch_unit: Literal["pairs", "queries"] = "pairs"
    # what one epoch passes over: every labelled (query, positive) pair once ("pairs", as sentence-transformers
    # counts; SciFact train: 919) or every query once with one of its positives drawn ("queries": 809)
    # report
    probe_size: NonNegativeInt = 256  # examples used for the similarity-distribution figure
    # evaluation
    eval_data: str | None = None  # BEIR folder evaluated after training (eval_split)
    eval_split: str = "test"
    eval_steps: PositiveInt | None = None  # also evaluate every N steps (costly on CPU)
    eval_base: bool = False  # evaluate the starting model too, for the comparison table
    eval_batch_size: PositiveInt = 64
    eval_bf16: bool = True

    def validate(self) -> None:
        if self.batch_size < 1 or self.num_negatives < 0:
            raise ConfigError("batch_size must be >= 1 and num_negatives >= 0")
        if self.model is not None and not self.model.strip():
            raise ConfigError("model is empty; name a model folder or hub id, or leave it out (null) for the bundled "
                              "all-MiniLM-L6-v2")
        if self.epoch_unit not in ("pairs", "queries"):
            raise ConfigError(f"epoch_unit must be 'pairs' or 'queries', got {self.epoch_unit!r}")
        super().validate()
