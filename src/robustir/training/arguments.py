"""Everything ``robustir train`` accepts, as one dataclass (YAML/JSON config + flags + key=value overrides)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class TrainConfig:
    # model
    model: str | None = None  # folder or hub id; None = the bundled all-MiniLM-L6-v2
    pooling: Literal["cls", "mean"] | None = None  # None = read from the model folder
    query_max_length: int = 64  # query tokens; saved with the model
    passage_max_length: int = 256  # saved with the model; used for evaluation
    train_passage_max_length: int | None = None  # shorter truncation while training (cheaper); None = same
    query_instruction: str | None = None
    passage_instruction: str | None = None
    # data
    train_data: str = ""  # training JSONL (file or folder) or a BEIR folder with a train split
    train_split: str = "train"
    mine: Literal["bm25", "dense", "none"] = "bm25"  # mine negatives for examples without any; none = in-batch only
    mine_negatives: int = 20  # negatives kept per query by mining (training samples from these)
    mine_range_min: int = 0  # skip this many top-ranked non-positives (likely false negatives)
    num_negatives: int = 1  # hard negatives per query in each training group
    # loss
    loss: Literal["infonce", "peg", "ccr"] = "infonce"  # contrastive loss; its options go in loss_options
    loss_options: dict = field(default_factory=dict)  # e.g. {temperature: 0.02, beta: 0.2}
    # optimisation
    batch_size: int = 32  # queries per process per step
    chunk_size: int | None = None  # GradCache: rows per forward chunk (None = no caching)
    epochs: float = 1.0
    epoch_unit: Literal["pairs", "queries"] = "pairs"
    # what one epoch passes over: every labelled (query, positive) pair once ("pairs", as sentence-transformers
    # counts; SciFact train: 919) or every query once with one of its positives drawn ("queries": 809)
    max_steps: int | None = None  # total optimizer steps; overrides epochs
    lr: float = 2e-5
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    seed: int = 42
    bf16: bool = False  # bf16 autocast for training
    gradient_checkpointing: bool = False
    # output, checkpoints, logging
    output: str = "runs/train"  # run folder: model/, checkpoints, train_log.jsonl, report
    save_steps: int | None = None  # None = at the end of every epoch
    save_total_limit: int = 2
    logging_steps: int = 1
    resume: bool = True
    report: bool = True
    probe_size: int = 256  # examples used for the similarity-distribution figure
    # evaluation
    eval_data: str | None = None  # BEIR folder evaluated after training (eval_split)
    eval_split: str = "test"
    eval_steps: int | None = None  # also evaluate every N steps (costly on CPU)
    eval_base: bool = False  # evaluate the starting model too, for the comparison table
    eval_batch_size: int = 64
    eval_bf16: bool = True
