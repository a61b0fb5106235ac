"""Everything ``robustir train`` accepts, as one dataclass (YAML/JSON config + flags + key=value overrides)."""

from __future__ import annotations

from dataclasses import field
from pathlib import Path
from typing import Annotated, Literal

from ..runs import added, operational
from ..errors import ConfigError
from ..precision import Precision
from ..validation import config_dataclass, ModelName, NonNegativeInt, PositiveFloat, PositiveInt, Range
from .loop import LoopConfig


@config_dataclass
class TrainSource:
    """One source of a training mixture: ``train_data`` given as a list of these (YAML: a list of mappings).

    Every global batch comes from one source; which one is a seeded function of (seed, step) following the weights
    (docs/methods.md, "Training data at scale and mixtures")."""

    path: str = ""
    """Training JSONL file or folder, or a BEIR folder (its train_split)"""
    name: str | None = None
    """Shown in the log and the report; None = the file or folder name without .jsonl/.gz."""
    weight: PositiveFloat | None = None
    """Share of the steps; None on every source = proportional to their sizes."""
    query_instruction: str | None = None
    """None: the model's for task retrieval, none for symmetric and title."""
    passage_instruction: str | None = None
    """None: the model's for task retrieval, none for symmetric and title."""
    task: Literal["retrieval", "symmetric", "title"] = "retrieval"
    # retrieval: query -> passage; symmetric: both directions of every pair (e.g. paraphrases); title: title -> passage
    in_batch_negatives: bool = True
    """False: a row's loss sees its own hard negatives only (needs num_negatives >= 1)"""

    @property
    def label(self) -> str:
        """The source's name: ``name``, else its file or folder name without ``.jsonl`` / ``.gz``."""
        if self.name:
            return self.name
        base = Path(self.path.rstrip("/\\")).name
        for suffix in (".gz", ".jsonl", ".json"):
            base = base.removesuffix(suffix)
        return base or "train"


@config_dataclass
class TrainConfig(LoopConfig):
    """The fine-tuning stage's fields; the training loop's (``batch_size``, ``epochs``, ``max_steps``, ``lr``,
    ``warmup_ratio``, ``weight_decay``, ``max_grad_norm``, ``seed``, ``precision``, ``gradient_checkpointing``,
    ``output``, ``save_steps``, ``save_total_limit``, ``logging_steps``, ``resume``, ``report``) come from
    :class:`~robustir.training.loop.LoopConfig`, with its defaults."""

    # model
    model: ModelName | None = None
    """Folder or hub id; None = the bundled all-MiniLM-L6-v2."""
    pooling: Literal["cls", "mean"] | None = None
    """None = read from the model folder."""
    query_max_length: PositiveInt | None = None
    """Query tokens (None: 64, or the model's limit if lower); saved."""
    passage_max_length: PositiveInt | None = None
    """None: 256, or the model's limit if lower; saved; for evaluation."""
    train_passage_max_length: PositiveInt | None = None
    """Shorter truncation while training (cheaper); None = same."""
    query_instruction: str | None = None
    """Prefix added to every query (BGE style); None = the model folder's."""
    passage_instruction: str | None = None
    """Prefix added to every passage; None = the model folder's."""
    # data
    train_data: str | list[TrainSource] = ""
    """Training JSONL (file or folder) or a BEIR folder with a train split; or, in a config file, a list of sources
    (a mixture): [{path, weight, name, task, query_instruction, passage_instruction, in_batch_negatives}, ...]."""
    data_cache: str | None = operational(None)
    """Folder of the training data converted to Arrow (memory-mapped, reused while the files are unchanged);
    None = <output>/data-cache."""
    train_split: str = "train"
    """Qrels split of a BEIR train_data folder."""
    skip_empty_positives: bool = False
    """A training record with an empty ``pos`` list is an error naming its file and line (a query without a positive
    cannot be trained on); true skips such records and counts them in the log and the model card."""
    mine: Literal["bm25", "dense", "none"] = "bm25"
    """Mine negatives for examples without any; none = in-batch only."""
    mine_negatives: PositiveInt = 20
    """Negatives kept per query by mining (training samples from these)"""
    mine_range_min: NonNegativeInt = 0
    """Skip this many top-ranked non-positives (likely false negatives)"""
    num_negatives: NonNegativeInt = 1
    """Hard negatives per query in each training group."""
    # loss
    loss: Literal["infonce", "peg", "ccr", "auto"] = "infonce"
    """Contrastive loss; its options go in loss_options. auto: the loss a robustir audit recommends (needs audit)."""
    audit: str | None = None
    """Folder of a robustir audit of train_data (its report.json); with loss auto it picks the loss."""
    filter_positives: bool = False
    """Before training, the starting model judges the training pairs (robustir's recipe for noisy data, with loss
    peg): a positive that at least 10 % of 200 random passages of the data score as high as is dropped (it looks
    like a mislabelled pair) -- the teacher filter with filtering.teacher.ROBUST_FILTER; the filtered copy is
    <output>/filtered.jsonl with its report. Training then takes the steps the unfiltered data would (epochs
    scaled by pairs given / pairs kept). loss auto turns it on when the audit finds false positives
    (docs/robustness.md)."""
    loss_options: dict = field(default_factory=dict)
    """The chosen loss's options, e.g. {temperature: 0.02, beta: 0.2}; checked against that loss's typed section
    (robustir.losses.options) when the config loads."""
    # optimisation (batch_size: queries per process per step; the rest: LoopConfig)
    chunk_size: PositiveInt | None = None
    """GradCache: rows per forward chunk (None = no caching)"""
    memory_size: Annotated[int, Range(ge=0, le=262144)] = added(0)
    """Cross-batch memory (XBM): the passages of the last steps, this many, join every step's in-batch negatives as
    constants, minus any that is a known positive of the row's query (robustir.training.memory); 0 = off. Costs no
    encoding, memory_size x the embedding width floats (at most 2**18: 400 MB at width 384). Off by default: in a short
    fine-tuning the stored passages are stale and the space contracts (SciFact dev, 43 steps: -1.0 NDCG@10 with 128,
    -2.4 with 1024; docs/benchmarks.md, issue 38)."""
    loss_block_rows: PositiveInt | None = operational(None)
    """Query rows per block of the loss's score matrix (exact; bounds memory at huge batches). None = whole batch
    while it holds at most 2**25 scores, else blocks of that size."""
    epoch_unit: Literal["pairs", "queries"] = "pairs"
    """What one epoch covers: every (query, positive) pair, or every query once."""
    # what one epoch passes over: every labelled (query, positive) pair once ("pairs", as sentence-transformers
    # counts; SciFact train: 919) or every query once with one of its positives drawn ("queries": 809)
    # input pipeline (robustir.training.input_pipeline): the batches, hence the result, are the same in every setting
    # (operational: not part of the run fingerprint; nor are data_cache -- the conversion is cached by content --,
    # loss_block_rows and pad_to_multiple_of -- the same values up to float summation order -- and evaluating more
    # or less often, in eval mode, with its own batch size)
    prefetch_batches: Annotated[int, Range(ge=0, le=64)] = operational(2)
    """Batches sampled and tokenised ahead of the step that uses them, in the background; 0 = on the main thread
    when the step needs them (the step waits for the CPU)."""
    dataloader_workers: Annotated[int, Range(ge=0, le=64)] = operational(0)
    """Processes that make the batches (torch DataLoader workers); 0 = one background thread (the tokenizer runs
    without the GIL). Needs prefetch_batches >= 1."""
    pad_to_multiple_of: Annotated[int, Range(ge=1, le=128)] | None = operational(None)
    """Pad each batch's token length up to a multiple of this; None = 8 on a GPU (tensor cores), 1 (the longest
    text in the batch) on the CPU. The same values up to float summation order."""
    base_weight: Annotated[float, Range(ge=0.0, lt=1.0)] = added(0.0)
    """WiSE-FT: the saved model's weights are (1 - base_weight) x the fine-tuned ones + base_weight x the starting
    model's (robustir.models.interpolate); 0 = the fine-tuned weights. Keeps more of the base model on other
    domains; measured in docs/benchmarks.md (issue 38)."""
    # report
    probe_size: NonNegativeInt = 256
    """Examples used for the similarity-distribution figure."""
    # evaluation
    eval_data: str | None = None
    """BEIR folder evaluated after training (eval_split)"""
    eval_split: str = "test"
    """Qrels split of eval_data scored after training."""
    eval_steps: PositiveInt | None = operational(None)
    """Also evaluate every N steps (costly on CPU)"""
    eval_base: bool = False
    """Evaluate the starting model too, for the comparison table."""
    eval_batch_size: PositiveInt = operational(64)
    """Encoding batch size of the evaluation."""
    eval_precision: Precision = "auto"
    """Precision of the evaluation (and similarity probe) encodes."""

    def validate(self) -> None:
        if self.batch_size < 1 or self.num_negatives < 0:
            raise ConfigError("batch_size must be >= 1 and num_negatives >= 0")
        if self.epoch_unit not in ("pairs", "queries"):
            raise ConfigError(f"epoch_unit must be 'pairs' or 'queries', got {self.epoch_unit!r}")
        if isinstance(self.train_data, list):
            self._validate_sources()
        if self.dataloader_workers and not self.prefetch_batches:
            raise ConfigError(f"dataloader_workers = {self.dataloader_workers} needs prefetch_batches >= 1 (workers "
                              "make batches ahead); set prefetch_batches, or dataloader_workers 0")
        super().validate()

    def __post_init__(self) -> None:
        from ..losses.options import check_loss_options

        if self.loss == "auto" and not self.audit:  # the audit itself is read by the train step (resolve_recipe)
            raise ConfigError("loss: auto needs audit: the folder of a robustir audit of the training data (robustir "
                              "audit --data TRAIN --output FOLDER), or name the loss (infonce, peg, ccr)")
        # typed per loss: a typo (loss_options.bta) fails when the config loads, not after mining (with loss auto,
        # when the train step has read the audit's choice: resolve_recipe)
        if self.loss != "auto":
            self.loss_options = check_loss_options(self.loss, self.loss_options, "loss_options")
        if isinstance(self.train_data, (list, tuple)):  # the Python API may pass mappings
            from ..config import from_dict

            self.train_data = [from_dict(TrainSource, s, where=f"train_data[{i}]") if isinstance(s, dict) else s
                               for i, s in enumerate(self.train_data)]
            self._validate_sources()  # a bad mixture fails when the config loads, not when training starts

    @property
    def sources(self) -> list[TrainSource]:
        """``train_data`` as a list of sources (a plain path is one retrieval source)."""
        if isinstance(self.train_data, list):
            return list(self.train_data)
        return [TrainSource(path=self.train_data)] if self.train_data else []

    def _validate_sources(self) -> None:
        sources = self.train_data
        if not sources:
            raise ConfigError("train_data is an empty list; name a training file or folder, or list sources as "
                              "[{path: ..., weight: ...}, ...]")
        for i, source in enumerate(sources):
            if not isinstance(source, TrainSource):
                raise ConfigError(f"train_data[{i}]: expected a source mapping such as {{path: data.jsonl}}, got "
                                  f"{source!r}")
            if not str(source.path).strip():
                raise ConfigError(f"train_data[{i}]: path is required (a training JSONL file or folder, or a BEIR "
                                  "folder)")
        labels = [s.label for s in sources]
        twice = sorted({n for n in labels if labels.count(n) > 1})
        if twice:
            raise ConfigError(f"train_data: the sources need distinct names, and {', '.join(map(repr, twice))} is "
                              "used more than once. Fix: give each source its own name: ...")
        weighted = [s.weight is not None for s in sources]
        if any(weighted) and not all(weighted):
            missing = [s.label for s in sources if s.weight is None]
            raise ConfigError(f"train_data: source(s) {', '.join(map(repr, missing))} have no weight while others "
                              "have one. Fix: give every source a weight, or none (shares proportional to size)")
        strict = [s.label for s in sources if not s.in_batch_negatives]
        if strict and self.num_negatives == 0:
            raise ConfigError(f"train_data: source(s) {', '.join(map(repr, strict))} have in_batch_negatives false "
                              "and num_negatives is 0, so their rows would have no negative at all. Fix: set "
                              "num_negatives >= 1, or in_batch_negatives true")
        if strict and self.loss_options.get("symmetric"):
            raise ConfigError(f"train_data: source(s) {', '.join(map(repr, strict))} have in_batch_negatives false, "
                              "but loss_options.symmetric needs in-batch negatives (the passage->query term has no "
                              "other negatives). Fix: drop symmetric, or set in_batch_negatives true on those sources")
