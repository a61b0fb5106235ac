"""Retrieval-oriented pre-training (RetroMAE or GUR) on streamed raw text, one process or many (``torchrun``).

The loop is fine-tuning's (:class:`~robustir.training.loop.TrainingLoop`, shared with
:mod:`robustir.training.trainer`): :mod:`accelerate` for device placement, DDP (``find_unused_parameters``) and
autocast in the :mod:`robustir.precision` rule; AdamW with linear warm-up and decay; gradient clipping; atomic
``checkpoints/step-N`` (:mod:`robustir.training.checkpoints`) and resume from the latest one; the log. This module
holds what is pre-training's own: the config, the data, the model and collator, one step's forward and
backward, the saved encoder and head. A pre-training corpus may be far larger than memory, so it is **streamed**
(:class:`StreamingExamples`: round-robin sharding per process, a seeded shuffle buffer, endless epochs, resume
by skipping the examples already consumed) and masks are drawn per step from a generator seeded by
``(seed, step, rank)``, so an interrupted run resumed from a checkpoint gives the same weights.

GUR steps run through the one batch engine (:class:`~robustir.training.batch_engine.BatchEngine`), as fine-tuning
does: the a-sentences of the step's pairs are the queries, their b-sentences the passages (no hard negatives); the
engine's loss is GUR's symmetric InfoNCE (:meth:`~robustir.pretraining.gur.GURModel.contrastive_loss`, weighted by
``alpha``) and the MLM loss comes back from the same forwards as the model's auxiliary loss (weighted by
``mlm_weight``). So under ``torchrun`` the sentence vectors of every process are in-batch negatives for every other
(the MLM loss stays each process's own mean), and ``chunk_size`` turns on GradCache (same loss and gradients). The
log's GUR keys: ``loss``, ``mlm_loss``, ``cl_loss``, ``cl_accuracy`` (a-sentences whose partner scores highest) and
the other contrastive components with a ``cl_`` prefix. RetroMAE steps call the model directly (no contrastive
term, no chunking).

Data (``data``):

* ``mode="retromae"``: raw text - a JSONL file with ``"text"`` (and optional ``"title"``, joined in front as
  BEIR does), a BEIR folder or its ``corpus.jsonl(.gz)``, or plain text with one document per line
  (``.gz`` allowed everywhere).
* ``mode="gur"``: sentence pairs - JSONL from ``robustir pairs`` (``{"query": a, "pos": [b, ...]}``, the
  first positive is the partner) or ``{"a": ..., "b": ...}``.

Models: RetroMAE and the encoder-only GUR (:class:`~robustir.pretraining.gur.GURModel`) take a BERT-family model;
GUR with a T5-family model (``config.is_encoder_decoder``: t5, mt5, umt5) is the paper's architecture
(:class:`~robustir.pretraining.t5_gur.T5GURModel`: T5 span corruption decoded by the decoder, the contrastive term
on the mean-pooled encoder through a 128-d projection head). Both GUR forms run through the same batch engine step.

Output folder::

    model/                   the encoder alone: HF + sentence-transformers folder (``robustir train --model``;
                             T5 GUR: the T5 encoder + mean pooling + normalisation)
    full/                    T5 GUR only: the whole T5ForConditionalGeneration (continue with ``model=output/full``
                             and ``heads=output``)
    decoder_head/            RetroMAE's enhanced decoder (continue with ``heads=output``)
    projection_head/         GUR's projection head config (+ weights when ``projection``)
    checkpoints/step-N/      model incl. head, optimizer, scheduler, RNG states (safetensors + JSON,
                             robustir.training.checkpoints) + trainer_state.json
    run.json                 the settings and input digests of the run the folder holds (resume and reuse check)
    train_log.jsonl          one line per logged step: step, epoch (unless max_steps), lr, grad_norm, examples_per_s,
                             every loss component
    pretrain_config.json     the configuration
    pretrain_report.png      loss components and learning rate over the steps
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch

from ..config import to_dict
from ..data.training_data import check_record
from ..runs import operational, register
from ..errors import ConfigError, DataError
from ..io import read_jsonl, write_json
from ..resources import default_model_path
from ..training.batch_engine import BatchEngine
from ..training.checkpoints import input_digest
from ..training.loop import LoopConfig, TrainingLoop, loop_step, steps_for_epochs
from ..validation import cli, config_dataclass, ModelName, NonNegativeFloat, PositiveFloat, PositiveInt, Range

logger = logging.getLogger(__name__)

__all__ = ["PretrainConfig", "PretrainResult", "StreamingExamples", "pretrain", "read_pairs", "read_texts",
           "write_pretrain_report"]

DEFAULT_LR = 1e-4  # both papers' code (RetroMAE README, bert-base; GUR train_files.py): docs/methods.md#retromae-choices
DEFAULT_MAX_LENGTH = {"retromae": 512, "gur": 128}  # RetroMAE recipe 512; GUR truncates sentences to 128
MaskRatio = Annotated[float, Range(gt=0, lt=1)]  # a share of the tokens masked: 0 < r < 1


@config_dataclass
class PretrainConfig(LoopConfig):
    """Everything ``robustir pretrain`` accepts (YAML/JSON config + flags + ``key=value`` overrides): the fields
    below and the training loop's (:class:`~robustir.training.loop.LoopConfig`: ``batch_size``, ``epochs``,
    ``max_steps``, ``lr``, ``warmup_ratio``, ``weight_decay``, ``max_grad_norm``, ``seed``, ``precision``,
    ``gradient_checkpointing``, ``output``, ``save_steps``, ``save_total_limit``, ``logging_steps``, ``resume``,
    ``report``)."""

    mode: Literal["retromae", "gur"] = "retromae"
    """Pre-training method: RetroMAE (masked auto-encoding) or GUR (joint MLM + contrastive)."""
    # model
    model: ModelName | None = None
    """Folder or hub id; None = the bundled all-MiniLM-L6-v2."""
    heads: Annotated[str | None, cli("resume-heads")] = None
    """Decoder_head / projection_head folder (or a pre-training output) to continue from."""
    pooling: Literal["cls", "mean"] | None = None
    """Sentence vector both methods train and the saved encoder uses: cls (both papers) or mean; None = the heads
    folder's when continuing, else cls for an encoder-only model and mean for a T5 model."""
    # data
    data: str = ""
    """RetroMAE: raw text (JSONL "text", BEIR, plain text); gur: pairs JSONL."""
    data_format: Literal["auto", "jsonl", "beir", "text", "pairs"] = "auto"
    """Input format (auto: folder -> beir, .jsonl -> jsonl or pairs, else text)."""
    max_length: PositiveInt | None = None
    """Tokens per text; None = 512 (retromae) / 128 (gur)."""
    shuffle_buffer: PositiveInt = 10_000
    """Examples held for shuffling a stream (per process)."""
    # RetroMAE (docs/methods.md#retromae-pre-training)
    encoder_mask_ratio: MaskRatio = 0.3
    """RetroMAE: share of the encoder input's tokens masked."""
    decoder_mask_ratio: MaskRatio = 0.5
    """RetroMAE: share of the decoder input's tokens masked."""
    encoder_loss_weight: NonNegativeFloat = 1.0
    """RetroMAE: weight of the encoder's MLM loss."""
    decoder_loss_weight: NonNegativeFloat = 1.0
    """RetroMAE: weight of the decoder's reconstruction loss."""
    # GUR (docs/methods.md#gur-joint-pre-training)
    mask_ratio: MaskRatio = 0.15
    """GUR: share of the tokens masked for its MLM loss (0.15 = the paper's)."""
    mask_ratio_range: list[float] | None = None
    """GUR: draw the mask ratio per sentence from this range; [0.10, 0.29] = the authors' code."""
    projection: bool | None = None
    """GUR: a non-linear projection head on the pooled vector; None = the heads folder's when continuing, else off
    for an encoder-only model and on for a T5 model (the paper's)."""
    projection_dim: PositiveInt | None = None
    """None: 128 for a T5 model (the paper's vector dim), else hidden size."""
    similarity: Literal["cosine", "dot"] = "cosine"
    """GUR: similarity of the contrastive loss."""
    temperature: PositiveFloat = 0.1
    """GUR: temperature of the contrastive loss."""
    alpha: NonNegativeFloat = 1.0
    """GUR: weight of the contrastive loss."""
    mlm_weight: NonNegativeFloat = 1.0
    """GUR: weight of the MLM loss beside the contrastive one."""
    # GradCache in the batch engine: None = one forward of all a-sentences and one of all b-sentences; same loss
    # and gradients either way, chunks need less activation memory for large batches
    chunk_size: PositiveInt | None = None
    """GUR: GradCache, sentences per forward chunk (None = off)."""
    # the training loop's fields (batch_size: texts for retromae, pairs for gur; save_steps None = at the end
    # only): LoopConfig; redeclared here where pre-training's default differs
    lr: PositiveFloat = DEFAULT_LR
    """Peak learning rate; 1e-4 = the RetroMAE and GUR code's."""
    output: str = operational("runs/pretrain")
    """Run folder: model/, the head folder, checkpoints, train_log.jsonl, report."""

    def resolved_max_length(self) -> int:
        return int(self.max_length or DEFAULT_MAX_LENGTH[self.mode])

    def validate(self) -> None:
        if self.mode not in ("retromae", "gur"):
            raise ConfigError(f"mode must be 'retromae' or 'gur', got {self.mode!r}")
        if not self.data:
            raise ConfigError("data is required: raw text for retromae (JSONL with 'text', BEIR folder, plain text), "
                              "a pairs JSONL from `robustir pairs` for gur")
        if self.batch_size < 1 or (self.mode == "gur" and self.batch_size < 2):
            raise ConfigError("batch_size must be >= 1 (>= 2 for gur: the contrastive loss needs in-batch negatives)")
        super().validate()  # max_steps, epochs, logging_steps
        if self.mask_ratio_range is not None and (len(self.mask_ratio_range) != 2
                                                  or not 0 < self.mask_ratio_range[0] <= self.mask_ratio_range[1] < 1):
            raise ConfigError(f"mask_ratio_range must be [low, high] with 0 < low <= high < 1, got "
                              f"{self.mask_ratio_range}")
        if self.chunk_size is not None:
            if self.mode != "gur":
                raise ConfigError("chunk_size (GradCache) applies to mode gur only: RetroMAE has no contrastive term")
            if self.chunk_size < 1:
                raise ConfigError(f"chunk_size must be >= 1 or null, got {self.chunk_size}")


@dataclass
class PretrainResult:
    model_path: Path  # the encoder (sentence-transformers folder)
    heads_path: Path  # decoder_head (retromae) or projection_head (gur)
    steps: int
    seconds: float
    last_losses: dict[str, float] = field(default_factory=dict)
    already_complete: bool = False  # the output folder held this finished run already: nothing trained or written


# ---------------------------------------------------------------------------- streaming data

def read_texts(path: str | Path, fmt: str = "auto") -> Iterator[str]:
    """Stream the texts of a raw-text source (``title text``, one per JSONL record or per line of a text file),
    through the one raw-document reader (:func:`robustir.data.documents.read_documents`). Empty texts are
    skipped."""
    from ..data.documents import read_documents

    for doc in read_documents(path, fmt, text_unit="line", need_ids=False):
        joined = f"{doc.title} {doc.text}".strip()
        if joined:
            yield joined


def read_pairs(path: str | Path) -> Iterator[tuple[str, str]]:
    """Stream ``(a, b)`` pairs from a pairs JSONL (``query``/``pos`` as written by ``robustir pairs``, or ``a``/``b``)."""
    path = Path(path)
    for line, obj in read_jsonl(path):
        if "a" in obj and "b" in obj:
            a, b = obj["a"], obj["b"]
        else:
            if "query" not in obj or "pos" not in obj:
                raise DataError(path, "expected a pair", line=line, field="pos",
                                fix='each line needs {"query": a, "pos": [b]} (robustir pairs) or {"a": ..., "b": ...}')
            a, pos, _ = check_record(obj, path, line)
            if not pos:
                raise DataError(path, "empty positive list", line=line, field="pos", fix='write "pos": ["text"]')
            b = pos[0]
        if not isinstance(a, str) or not isinstance(b, str):
            raise DataError(path, "pair members must be strings", line=line)
        if a.strip() and b.strip():
            yield a, b


class StreamingExamples:
    """One process's share of a streamed data set: round-robin sharding, a shuffle buffer, endless epochs.

    ``reader`` returns a fresh iterator over the whole source each call (the file is re-read per epoch, never
    held in memory). Example number ``i`` of the source belongs to rank ``i % world_size``; within a rank, a
    buffer of ``buffer_size`` examples is shuffled with a generator seeded by ``(seed, epoch, rank)``. So each
    epoch yields every example exactly once across the ranks, in an order fixed by the seed, and
    :meth:`stream` (``skip=n``) continues exactly where a run that had consumed ``n`` examples stopped.

    Every process takes ``batch_size`` examples per step from its own endless stream, so all processes run
    the same number of steps; when the shares differ by one example, a process's epoch boundary may fall one
    example earlier or later than its neighbour's (the log's ``epoch`` is global: steps x global batch / size).
    """

    def __init__(self, reader: Callable[[], Iterator[Any]], *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 buffer_size: int = 10_000) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {rank}, {world_size}")
        self.reader = reader
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.buffer_size = max(1, int(buffer_size))

    def count(self) -> int:
        """Examples in the whole source (all ranks): one pass over the data."""
        return sum(1 for _ in self.reader())

    def epoch(self, epoch: int) -> Iterator[Any]:
        """This rank's examples of one pass, shuffled through the buffer."""
        rng = random.Random(f"{self.seed}\x00{epoch}\x00{self.rank}")
        buffer: list[Any] = []
        for position, example in enumerate(self.reader()):
            if position % self.world_size != self.rank:
                continue
            if len(buffer) < self.buffer_size:
                buffer.append(example)
                continue
            j = rng.randrange(self.buffer_size)
            yield buffer[j]
            buffer[j] = example
        rng.shuffle(buffer)
        yield from buffer

    def stream(self, skip: int = 0) -> Iterator[Any]:
        """Epoch after epoch without end, leaving out the first ``skip`` examples (for resuming)."""
        epoch = 0
        while True:
            produced = 0
            for example in self.epoch(epoch):
                produced += 1
                if skip > 0:
                    skip -= 1
                    continue
                yield example
            if produced == 0:
                raise DataError(Path(str(getattr(self.reader, "source", "data"))),
                                f"no example for process {self.rank} of {self.world_size}",
                                fix="give more examples than processes (and check the file is not empty)")
            epoch += 1


def _reader(config: PretrainConfig) -> Callable[[], Iterator[Any]]:
    data = resolve_data_path(config.data)
    fmt = config.data_format
    if config.mode == "gur":
        if fmt not in ("auto", "pairs", "jsonl"):
            raise ConfigError(f"mode gur reads a pairs JSONL; data_format {fmt!r} does not apply")

        def read() -> Iterator[Any]:
            return read_pairs(data)
    else:
        if fmt == "pairs":
            raise ConfigError("data_format pairs is for mode gur; retromae reads raw text")

        def read() -> Iterator[Any]:
            return read_texts(data, fmt)
    read.source = data  # type: ignore[attr-defined]
    return read


def resolve_data_path(value: str | os.PathLike) -> Path:
    """``bundled:NAME`` -> the bundled data set folder (e.g. ``bundled:scifact``); anything else as a path."""
    text = str(value)
    if text.startswith("bundled:"):
        from ..resources import dataset_path

        return dataset_path(text.split(":", 1)[1])
    return Path(text)


# ---------------------------------------------------------------------------- model

def _heads_folder(path: str, mode: str) -> Path:
    """Accept the head folder itself or a pre-training output folder that contains it."""
    name = "decoder_head" if mode == "retromae" else "projection_head"
    folder = Path(path)
    if (folder / name).is_dir():
        folder = folder / name
    if not (folder / "config.json").exists():
        raise ConfigError(f"heads {path!r}: no {name} here (expected a folder written by a {mode} pre-training run)")
    return folder


def build_model(config: PretrainConfig, model_path: str) -> torch.nn.Module:
    """RetroMAE, the encoder-only GUR, or GUR on T5 (an encoder-decoder model folder, ``mode: gur``)."""
    from .t5_gur import is_seq2seq_model

    heads = _heads_folder(config.heads, config.mode) if config.heads else None
    seq2seq = is_seq2seq_model(model_path)
    if config.mode == "retromae":
        from .retromae import RetroMAEModel

        if seq2seq:
            raise ConfigError(f"model {model_path} is an encoder-decoder (T5 family); RetroMAE pre-trains an "
                              "encoder-only model (BERT, RoBERTa, MiniLM, ...): use one, or mode gur for T5")
        model = RetroMAEModel.from_pretrained(model_path, heads, encoder_loss_weight=config.encoder_loss_weight,
                                              decoder_loss_weight=config.decoder_loss_weight, pooling=config.pooling)
    else:
        # unset (None) settings: the heads folder's when continuing, else the architecture's defaults
        options = {key: value for key, value in (("pooling", config.pooling), ("projection", config.projection),
                                                 ("projection_dim", config.projection_dim)) if value is not None}
        options.update(similarity=config.similarity, temperature=config.temperature, alpha=config.alpha,
                       mlm_weight=config.mlm_weight)
        if seq2seq:
            from .t5_gur import T5GURModel

            model = T5GURModel.from_pretrained(model_path, heads, **options)
        else:
            from .gur import GURModel

            model = GURModel.from_pretrained(model_path, heads, **options)
    if model.tokenizer is None:
        raise ConfigError(f"{model_path}: no tokenizer in the model folder")
    return model


def checked_max_length(config: PretrainConfig, model: torch.nn.Module) -> int:
    """Tokens per text: ``max_length`` (an error when above what the model takes, instead of an index error in its
    position embeddings mid-run), or the mode's default capped at the model's limit."""
    from ..models.encoder import default_length_limit, max_positions

    wanted = config.resolved_max_length()
    limit = (max_positions(model.backbone.config) if config.max_length is not None  # None for T5 (relative positions)
             else default_length_limit(model.backbone.config, model.tokenizer))
    if limit is None or wanted <= limit:
        return wanted
    if config.max_length is not None:
        raise ConfigError(f"max_length = {wanted} is above what model {config.model or default_model_path()} takes "
                          f"({limit} tokens); use at most {limit}")
    logger.info("max_length %d (the %s default) capped at the model's limit of %d tokens", wanted, config.mode, limit)
    return limit


def build_collator(config: PretrainConfig, tokenizer: Any, max_length: int | None = None, *,
                   seq2seq: bool = False) -> Any:
    """The mode's collator; ``seq2seq``: GUR on T5 (sentinel span corruption, decoder targets)."""
    max_length = max_length or config.resolved_max_length()
    if config.mode == "retromae":
        from .retromae import RetroMAECollator

        return RetroMAECollator(tokenizer, max_length=max_length,
                                encoder_mlm_probability=config.encoder_mask_ratio,
                                decoder_mlm_probability=config.decoder_mask_ratio, seed=config.seed)
    from .masking import SpanMasker
    from .gur import GURCollator

    masker = SpanMasker(mask_ratio=config.mask_ratio,
                        mask_ratio_range=tuple(config.mask_ratio_range) if config.mask_ratio_range else None)
    if seq2seq:
        from .t5_gur import T5GURCollator

        return T5GURCollator(tokenizer, max_length=max_length, masker=masker, seed=config.seed)
    return GURCollator(tokenizer, max_length=max_length, masker=masker, seed=config.seed)


def _step_seed(seed: int, step: int, rank: int) -> int:
    """Mask generator seed of one step on one process: resuming at ``step`` redraws the same masks."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


# ---------------------------------------------------------------------------- the stage

def pretrain(config: PretrainConfig, stop_after: int | None = None) -> PretrainResult:
    """Pre-train ``config.model`` with RetroMAE or GUR on ``config.data``; resumes from the latest checkpoint.

    The pre-training part (streamed data, model, collator, one step, outputs) on top of the shared
    :class:`~robustir.training.loop.TrainingLoop`. ``stop_after``: leave after this many optimizer steps (with a
    checkpoint), as if the job had been interrupted; a later call resumes and ends with the same weights as an
    uninterrupted run.
    """
    from ..outputs import refuse_run_over_inputs

    refuse_run_over_inputs(config.output, models={"model": config.model, "heads": config.heads},
                           data={"data": config.data},
                           rewritten=("model", "checkpoints", "decoder_head", "projection_head", "full"),
                           stage="pretrain")  # before the loop makes the folder
    loop = TrainingLoop(config, config_file="pretrain_config.json")  # validates the config
    accelerator, out = loop.accelerator, loop.out
    rank, world = accelerator.process_index, accelerator.num_processes
    # the folder holds one run: resuming or reusing it with other settings or inputs is refused (ConfigError);
    # a finished run re-run with the same ones is returned as it is
    if loop.open_output(pretrain_inputs(config), outputs=OUTPUTS, finished=("model", _head_name(config.mode))) \
            == "complete":
        return _finished_result(loop, config)

    examples = StreamingExamples(_reader(config), rank=rank, world_size=world, seed=config.seed,
                                 buffer_size=config.shuffle_buffer)
    global_batch = config.batch_size * world
    num_examples = None
    if config.max_steps:
        total_steps = config.max_steps
    else:
        num_examples = examples.count()  # one streamed pass; max_steps avoids it
        if num_examples < global_batch:
            logger.warning("only %d examples for a global batch of %d: examples repeat within a step",
                           num_examples, global_batch)
        total_steps = steps_for_epochs(config.epochs, num_examples / global_batch)

    from ..models.encoder import resolve_model_path

    model_path = str(resolve_model_path(config.model or default_model_path()))  # checked: a model folder
    model = build_model(config, model_path)
    tokenizer = model.tokenizer
    from .t5_gur import T5GURModel

    collator = build_collator(config, tokenizer, checked_max_length(config, model),
                              seq2seq=isinstance(model, T5GURModel))
    if config.gradient_checkpointing:
        model.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    start_step = loop.prepare(model, total_steps)
    prepared, unwrapped = loop.model, loop.unwrapped
    engine = None
    if config.mode == "gur":
        # GUR's contrastive term is the batch engine's loss (global in-batch negatives under torchrun, GradCache
        # with chunk_size); the MLM loss comes back from the same forwards as the model's AuxLoss.
        engine = BatchEngine(unwrapped.contrastive_loss(), chunk_size=config.chunk_size, loss_weight=unwrapped.alpha)
    stream = examples.stream(skip=start_step * config.batch_size)

    def step(index: int) -> dict[str, Any]:
        collator.reseed(_step_seed(config.seed, index, rank))
        batch = collator([next(stream) for _ in range(config.batch_size)])
        # on the model's device before the engine sees them (its RNG snapshots follow the inputs' devices)
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        if engine is not None:
            return _gur_step(engine, prepared, batch)
        outputs = prepared(**batch)
        accelerator.backward(outputs["loss"])
        return outputs

    run = loop.run(step, save_steps=config.save_steps or total_steps, desc=f"pretrain ({config.mode})",
                   throughput_key="examples_per_s", stop_after=stop_after,
                   epoch=(lambda done: done * global_batch / num_examples) if num_examples else None)
    if run.interrupted:
        return PretrainResult(out / "model", out / _head_name(config.mode), run.steps, loop.seconds, run.last)

    if loop.is_main:
        save_outputs(unwrapped, config, model_path, out, total_steps)
        if config.report:
            write_pretrain_report(out)
    loop.finish()
    return PretrainResult(out / "model", out / _head_name(config.mode), total_steps, loop.seconds, run.last)


#: what pre-training writes into its output folder besides the loop's files (deleted when a run starts over)
OUTPUTS = ("model", "decoder_head", "projection_head", "full", ".final.tmp", "pretrain_report.png")


def pretrain_inputs(config: PretrainConfig) -> dict[str, dict]:
    """Digests of what a pre-training run reads, for its run fingerprint: the model folder, the heads folder
    (``heads``) and the data file it streams (a BEIR folder's corpus)."""
    from ..data.documents import resolve_format
    from ..models.encoder import resolve_model_path

    _reader(config)  # checks data_format against the mode
    data = resolve_data_path(config.data)
    files = data if config.mode == "gur" else resolve_format(data, config.data_format)[0]
    inputs = {"model": input_digest(resolve_model_path(config.model or default_model_path()), model=True),
              "data": input_digest(files)}
    if config.heads:
        inputs["heads"] = input_digest(_heads_folder(config.heads, config.mode), model=True)
    return inputs


def _finished_result(loop: TrainingLoop, config: PretrainConfig) -> PretrainResult:
    """The result of the finished run the output folder holds (the same settings and inputs), read back."""
    out = loop.out
    last: dict[str, float] = {}
    log = out / "train_log.jsonl"
    if log.exists():
        lines = [x for x in log.read_text(encoding="utf-8").splitlines() if x.strip()]
        if lines:
            skip = {"step", "epoch", "lr", "grad_norm", "examples_per_s"}
            last = {k: v for k, v in json.loads(lines[-1]).items() if k not in skip}
    loop.finish()
    return PretrainResult(out / "model", out / _head_name(config.mode), int(loop.completed_steps or 0), loop.seconds,
                          last, already_complete=True)


def _gur_step(engine: BatchEngine, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One GUR step through the batch engine (forward and backward): a-sentences as queries, their partners as
    passages, no hard negatives. Returns the log values: ``loss``, ``mlm_loss`` and the contrastive components
    prefixed ``cl_`` (``cl_loss``, ``cl_accuracy``, ``cl_loss_q2p``, ...)."""
    from .gur import MLM_LOSS_NAME

    a_rows = {k: v[0::2].contiguous() for k, v in batch.items()}  # the collator interleaves [a1, b1, a2, ...]
    b_rows = {k: v[1::2].contiguous() for k, v in batch.items()}
    out = engine.step(model, a_rows, b_rows, num_hard_negatives=0)
    rename = {"nce": "cl_loss", "nce_q2p": "cl_loss_q2p", "nce_p2q": "cl_loss_p2q", "accuracy": "cl_accuracy"}
    values: dict[str, Any] = {"loss": out.loss}
    for key, value in out.components.items():
        values[key if key == MLM_LOSS_NAME else rename.get(key, f"cl_{key}")] = value
    return values


def _head_name(mode: str) -> str:
    return "decoder_head" if mode == "retromae" else "projection_head"


def save_outputs(model: torch.nn.Module, config: PretrainConfig, base_model: str, out: Path, steps: int) -> None:
    """Write ``out/model`` (encoder as a sentence-transformers folder) and the head folder, replacing old ones;
    T5 GUR also ``out/full`` (the whole encoder-decoder).

    The encoder keeps its MLM head weights (continued MLM-style pre-training needs them; ``AutoModel`` and
    sentence-transformers ignore them). Pooling: the model's (the vector both methods trained);
    normalisation, instructions and lengths come from the base model's folder.
    """
    from ..models.encoder import config_from_folder, resolve_model_path

    tmp = out / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    encoder_config = config_from_folder(resolve_model_path(base_model))
    encoder_config.pooling = model.pooling
    positions = getattr(model.backbone.config, "max_position_embeddings", None)  # None: relative positions (T5)
    if isinstance(positions, int) and positions > 0:
        encoder_config.passage_max_length = min(encoder_config.passage_max_length, positions)
        encoder_config.query_max_length = min(encoder_config.query_max_length, positions)
    card = _model_card(config, base_model, steps, encoder_config.pooling, seq2seq=hasattr(model, "t5"))
    model.save_pretrained(tmp, encoder_config=encoder_config, model_card=card)  # tmp/encoder + tmp/<head>, once
    write_json(tmp / "encoder" / "pretrain_config.json", to_dict(config))
    head = _head_name(config.mode)
    folders = [("model", tmp / "encoder"), (head, tmp / head)] + ([("full", tmp / "full")]
                                                                   if (tmp / "full").is_dir() else [])
    for name, source in folders:
        shutil.rmtree(out / name, ignore_errors=True)
        os.replace(source, out / name)
    shutil.rmtree(tmp, ignore_errors=True)


def _model_card(config: PretrainConfig, base_model: str, steps: int, pooling: str, *, seq2seq: bool = False) -> str:
    method = {"retromae": "RetroMAE (Xiao et al., EMNLP 2022): masked auto-encoder with an enhanced decoder",
              "gur": "GUR (Xue et al.): span-masked LM + in-pair contrastive learning on LCS-mined pairs"}[config.mode]
    continue_with = f"`heads=` the sibling `{_head_name(config.mode)}` folder"
    if seq2seq:
        method = ("GUR (Xue et al.) on T5: span corruption reconstructed by the decoder + in-pair contrastive "
                  "learning on the encoder (the encoder alone is saved here)")
        continue_with = "`model=` the sibling `full` folder (encoder + decoder) and `heads=` the run folder"
    return f"""---
library_name: sentence-transformers
tags: [sentence-transformers, feature-extraction, robustir, pre-training, {config.mode}]
---

# Retrieval-oriented pre-trained encoder (robustir)

- **Method:** {method}
- **Base model:** `{config.model or 'all-MiniLM-L6-v2 (bundled)'}`
- **Data:** `{config.data}`; {steps} steps of {config.batch_size} {'texts' if config.mode == 'retromae' else 'pairs'} per process,
  max length {config.resolved_max_length()}, lr {config.lr}, seed {config.seed}.
- **Pooling:** {pooling}. This is a starting point for fine-tuning (`robustir train --model THIS_FOLDER`), not a
  finished retriever. Continue pre-training with {continue_with}.

Full configuration: `pretrain_config.json`.
"""


def write_pretrain_report(output: str | Path) -> Path | None:
    """``pretrain_report.png``: every logged loss component and the learning rate against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(output)
    log = out / "train_log.jsonl"
    records = [json.loads(x) for x in log.read_text(encoding="utf-8").splitlines() if x.strip()] if log.exists() else []
    if not records:
        return None
    steps = [r["step"] for r in records]
    skip = {"step", "epoch", "lr", "grad_norm", "examples_per_s"}
    components = [k for k in records[0] if k not in skip]
    losses = [k for k in components if "loss" in k]
    others = [k for k in components if k not in losses]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for key in losses:
        axes[0].plot(steps, [r.get(key) for r in records], label=key, lw=1.2 if key == "loss" else 1, alpha=0.9)
    axes[0].set(title="pre-training losses", xlabel="step")
    axes[0].legend(loc="upper right")
    axes[1].plot(steps, [r["lr"] for r in records], color="black", lw=1, label="lr")
    axes[1].set(title="learning rate" + (" and " + ", ".join(others) if others else ""), xlabel="step")
    if others:
        twin = axes[1].twinx()
        for key in others:
            twin.plot(steps, [r.get(key) for r in records], lw=1, label=key, color="tab:green")
        twin.legend(loc="lower right")
    axes[1].legend(loc="upper right")
    fig.tight_layout()
    png = out / "pretrain_report.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


#: ``robustir pretrain`` as a :class:`~robustir.runs.Step` (run by :func:`robustir.runs.execute`)
PRETRAIN = register(loop_step("pretrain", PretrainConfig, pretrain))
