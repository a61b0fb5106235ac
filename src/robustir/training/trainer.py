"""Contrastive fine-tuning: data → batch engine → AdamW, on one process or many (``torchrun``).

This module is the stage-specific part: training examples (with mined hard negatives when the data has none),
the encoder, the loss, the group sampler, the similarity probe, evaluation and the saved model with its card.
The loop itself -- :mod:`accelerate` set-up, AdamW and schedule, checkpoints and resume, logging -- is the one
:class:`~robustir.training.loop.TrainingLoop` that pre-training uses too; a fine-tuning step is one call of the
:class:`~robustir.training.batch_engine.BatchEngine`, which does the interesting part: global in-batch
negatives, GradCache and one loss call per optimizer step. ``eval_steps`` evaluates through the loop's
``after_step`` hook.

Output folder::

    model/                 final sentence-transformers model (+ model card README.md)
    run.json               the settings and input digests of the run the folder holds (resume and reuse check)
    checkpoints/step-N/    model, optimizer, scheduler, loss state such as PEG's t, RNG states (safetensors +
                           JSON, robustir.training.checkpoints) + trainer_state.json
    train_log.jsonl        one line per logged step: step, epoch, lr, grad_norm, pairs_per_s, data_wait_seconds and
                           data_wait_share (time blocked waiting for the batch), loss components
                           (and eval_* lines with eval_steps)
    similarities.json      cosine similarities of a fixed probe set at start and end
    report.png/.html       loss curves, PEG/CCR statistics, similarity distributions
    report.json            with a mixture of sources: per_source {name: {steps, mean_loss}}
    eval_metrics.json      metrics on eval_data (base model too with eval_base)
    data-cache/            the training data converted to Arrow (robustir.data.arrow_store), by content; kept
                           when a run starts over (``data_cache`` puts it elsewhere)
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import to_dict
from ..data.arrow_store import convert_examples, convert_training_files
from ..data.training_data import TrainingExample, examples_from_beir, training_files
from ..errors import ConfigError
from ..runs import Artifact, fingerprint, register
from ..io import atomic_write, write_json
from ..losses import get_loss
from ..models.encoder import Encoder, length_options, max_positions
from ..outputs import refuse_run_over_inputs
from ..resources import default_model_path
from .arguments import TrainConfig, TrainSource
from .batch_engine import BatchEngine
from .checkpoints import input_digest
from .data import Collator, GroupSampler, SamplerSource, StepBatches, fit_batch_size, source_items
from .input_pipeline import InputPipeline
from .loop import TrainingLoop, loop_step, steps_for_epochs

logger = logging.getLogger(__name__)

#: what fine-tuning writes into its output folder besides the loop's files (deleted when a run starts over)
OUTPUTS = ("model", "mined-*.jsonl", "mined-*.jsonl.run.json", "filtered*.jsonl", "filtered*.jsonl.*",
           "unfiltered*.jsonl", "similarities.json", "base_metrics.json",
           "eval_metrics.json", "report.png", "report.html", "report.json")


@dataclass
class TrainResult:
    model_path: Path
    steps: int
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    base_metrics: dict[str, float] = field(default_factory=dict)
    already_complete: bool = False  # the output folder held this finished run already: nothing trained or written
    data_wait_seconds: float = 0.0  # time the steps of this call waited for their batch (this process)
    data_wait_share: float = 0.0  # of the steps' wall time


# ---------------------------------------------------------------------------- data preparation

def _require_train_data(config: TrainConfig) -> None:
    if not config.train_data:
        raise ConfigError("train_data is required: a training JSONL file/folder or a BEIR folder with a "
                          f"'{config.train_split}' qrels split")


def train_inputs(config: TrainConfig) -> dict[str, dict]:
    """Digests of what a fine-tuning run reads, for its run fingerprint: the starting model's folder and the
    training data (the JSONL files, or a BEIR folder's corpus, queries and qrels split). The evaluation data is
    not digested (it is read anew at the end; its path and split are settings)."""
    from ..models.encoder import resolve_model_path

    _require_train_data(config)
    inputs = {"model": input_digest(resolve_model_path(config.model or default_model_path()), model=True)}
    for source in config.sources:
        inputs[_input_name(config, source)] = input_digest(_source_files(Path(source.path), config.train_split))
    return inputs


def _is_beir(path: Path) -> bool:
    from ..data.beir import is_beir_folder

    return is_beir_folder(path)


def _source_files(path: Path, split: str) -> list[Path]:
    """The files a training source reads: its JSONL files, or a BEIR folder's corpus, queries and qrels split."""
    if _is_beir(path):
        from ..data.beir import corpus_file

        queries = next((path / n for n in ("queries.jsonl", "queries.jsonl.gz") if (path / n).exists()),
                       path / "queries.jsonl")
        files = [corpus_file(path), queries]
        return [*files, path / "qrels" / f"{split}.tsv"]
    return training_files(path)


def _input_name(config: TrainConfig, source: TrainSource) -> str:
    """The source's name among the run fingerprint's inputs: ``train_data`` (one path), ``train_data/<name>``."""
    return f"train_data/{source.label}" if isinstance(config.train_data, list) else "train_data"


def data_cache(config: TrainConfig) -> Path:
    """Where the training data's Arrow conversions are cached (``data_cache``, default ``<output>/data-cache``)."""
    return Path(config.data_cache) if config.data_cache else Path(config.output) / "data-cache"


def prepare_examples(config: TrainConfig, encoder: Encoder, is_main: bool, wait,
                     inputs: dict[str, dict] | None = None) -> list[SamplerSource]:
    """The training sources as memory-mapped Arrow rows (:class:`~robustir.data.arrow_store.TrainingRows`),
    converted once and cached by content (:func:`data_cache`); hard negatives mined for a source that comes
    without any (cached in the output folder as ``mined-<method>[-<source>].jsonl``, then converted the same way).

    The main process converts and mines, the others open what it wrote. ``inputs``: the run fingerprint's digests
    (:func:`train_inputs`), so the files are not hashed twice."""
    _require_train_data(config)
    cache, mixture = data_cache(config), isinstance(config.train_data, list)
    prepared, mined_any = [], False
    for spec in config.sources:
        path = Path(spec.path)
        digest = (inputs or {}).get(_input_name(config, spec))
        if _is_beir(path):
            digest = digest or input_digest(_source_files(path, config.train_split))
            rows = _on_main(is_main, wait, lambda convert: convert_examples(
                lambda: examples_from_beir(path, config.train_split), cache, digest=digest, kind="beir",
                key_extra={"split": config.train_split}, describe=f"{path} ({config.train_split} split)",
                convert=convert))
        else:
            rows = _on_main(is_main, wait, lambda convert: convert_training_files(
                path, cache, digest=digest, convert=convert, skip_empty_positives=config.skip_empty_positives))
        where = f"{spec.label}: " if mixture else ""
        if rows.stats.get("skipped_empty_positives"):
            logger.warning("%sskipped %d training record(s) with an empty positive list (skip_empty_positives)",
                           where, rows.stats["skipped_empty_positives"])
        others = rows.stats.get("skipped_empty", 0) - rows.stats.get("skipped_empty_positives", 0)
        if others:
            logger.warning("%sskipped %d training record(s) with an empty query or positive, or whose positives a "
                           "filter removed", where, others)
        mined_here = config.num_negatives > 0 and config.mine != "none" and not rows.num_negatives
        if mined_here:
            mined_any = True
            mined = Path(config.output) / (f"mined-{config.mine}-{spec.label}.jsonl" if mixture
                                           else f"mined-{config.mine}.jsonl")
            if is_main:
                from ..device import device_string
                from ..negatives.mining import MiningConfig, mine_training_examples

                mining = MiningConfig(method=config.mine, num_negatives=config.mine_negatives,
                                      range_min=config.mine_range_min, precision=config.eval_precision,
                                      device=device_string(encoder.device))  # the training device
                mine_training_examples(rows, mined, mining, encoder=encoder, model=config.model,
                                       beir_root=path if _is_beir(path) else None, split=config.train_split,
                                       source=digest or input_digest(training_files(path)))
            wait()
            rows = _on_main(is_main, wait, lambda convert: convert_training_files(mined, cache, convert=convert))
        budget_items = None
        if config.filter_positives:  # the step budget stays the unfiltered data's (docs/robustness.md)
            budget_items = source_items(SamplerSource(rows, task=spec.task), config.epoch_unit)
            rows = filter_for_training(rows, config, encoder, is_main, wait, mined if mined_here else path,
                                       spec.label if mixture else None, cache)
        prepared.append(SamplerSource(rows, name=spec.label, weight=spec.weight, task=spec.task,
                                      query_instruction=spec.query_instruction,
                                      passage_instruction=spec.passage_instruction,
                                      in_batch_negatives=spec.in_batch_negatives, budget_items=budget_items))
    if not mined_any:
        config.mine = "none"  # recorded in the model card: negatives came with the data (or in-batch only)
    return prepared


def filter_for_training(rows, config: TrainConfig, encoder: Encoder, is_main: bool, wait, source: Path,
                        label: str | None, cache: Path):
    """``filter_positives``: the starting model, as teacher, drops random-like positives
    (:data:`~robustir.filtering.teacher.ROBUST_FILTER`) from one source; returns the filtered rows.

    The filtered copy ``<output>/filtered[-<source>].jsonl`` is reused while the source's content, the model and
    the filter's settings are the same (``robustir.runs``). A BEIR folder or a folder of files is first written out
    as one training JSONL beside it (``unfiltered[-<source>].jsonl``), which the filter reads.
    """
    from ..filtering.teacher import ROBUST_FILTER, EmbeddingTeacher, TeacherFilterConfig, teacher_filter

    suffix = f"-{label}" if label else ""
    filtered = Path(config.output) / f"filtered{suffix}.jsonl"
    if is_main:
        if source.is_dir():
            plain = Path(config.output) / f"unfiltered{suffix}.jsonl"
            plain.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(plain) as handle:
                for example in rows:
                    handle.write(json.dumps(example.to_json(), ensure_ascii=False) + "\n")
            source = plain
        step = Artifact(filtered, what="teacher-filtered training data")
        made = fingerprint("train-filter", {"filter": ROBUST_FILTER, "precision": config.eval_precision},
                           {"data": source, "model": config.model})
        if not step.begin(made, resume=False):
            options = TeacherFilterConfig(**ROBUST_FILTER, precision=config.eval_precision, overwrite=True,
                                          progress=is_main)
            report = teacher_filter(source, filtered, options,
                                    teacher=EmbeddingTeacher(encoder, batch_size=config.eval_batch_size,
                                                             precision=config.eval_precision))
            logger.info("filter_positives: %d positives dropped (random-like to the starting model), %d of %d "
                        "records left without one", report.positives_removed, report.records_without_positives,
                        report.records)
            step.finish()
    wait()
    return _on_main(is_main, wait, lambda convert: convert_training_files(filtered, cache, convert=convert,
                                                                         skip_empty_positives=True))


def budget_scale(sources: list[SamplerSource], epoch_unit: str) -> float:
    """How many times its own epochs the data trains for: 1, or -- after ``filter_positives`` dropped suspect pairs --
    unfiltered items / kept items, so that ``epochs`` still buys the steps of the data as given.

    Measured on the GPU preset (docs/robustness.md): with 40 % random false positives, dropping them and training
    the same epochs on the 60 % left loses 2.9-3.0 NDCG@10 even for a perfect filter; keeping the step budget loses
    about 1."""
    kept = sum(source_items(s, epoch_unit) for s in sources)
    budget = sum(s.budget_items if s.budget_items is not None else source_items(s, epoch_unit) for s in sources)
    return budget / kept if kept else 1.0


def _on_main(is_main: bool, wait, make):
    """``make(convert=True)`` on the main process, then ``make(convert=False)`` (open what it wrote) on the others."""
    rows = make(True) if is_main else None
    wait()
    return rows if rows is not None else make(False)


class _AllRows(Sequence):
    """The rows of every source, one after the other (for the similarity probe's sample)."""

    def __init__(self, sources: list[SamplerSource]) -> None:
        self.parts = [s.rows for s in sources]
        self.starts = np.cumsum([0] + [len(r) for r in self.parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> TrainingExample:  # type: ignore[override]
        part = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self.parts[part][index - int(self.starts[part])]


# ---------------------------------------------------------------------------- probe for the report

def similarity_probe(encoder: Encoder, examples: Sequence[TrainingExample], size: int, seed: int,
                     precision: str = "auto") -> dict[str, list[float]]:
    """Cosine similarities of a fixed sample: positives, hard negatives, in-batch (other queries') positives."""
    rng = random.Random(seed)
    sample = rng.sample(examples, min(size, len(examples)))
    queries = encoder.encode([e.query for e in sample], "query", precision=precision)
    positives = encoder.encode([e.pos[0] for e in sample], "passage", precision=precision)
    with_neg = [i for i, e in enumerate(sample) if e.neg]
    negatives = encoder.encode([sample[i].neg[0] for i in with_neg], "passage", precision=precision)
    sims = queries @ positives.T
    off_diagonal = sims[~np.eye(len(sample), dtype=bool)]
    return {"positive": np.diag(sims).tolist(),
            "hard_negative": [float(queries[i] @ negatives[j]) for j, i in enumerate(with_neg)],
            "in_batch_negative": off_diagonal[: 20 * len(sample)].tolist()}


# ---------------------------------------------------------------------------- model card

def _describe_data(config: TrainConfig) -> str:
    if not isinstance(config.train_data, list):
        return f"`{config.train_data}`"
    parts = []
    for s in config.sources:
        options = [f"weight {s.weight:g}" if s.weight is not None else None, s.task if s.task != "retrieval" else None,
                   "no in-batch negatives" if not s.in_batch_negatives else None]
        shown = ", ".join(o for o in options if o)
        parts.append(f"`{s.label}` (`{s.path}`{', ' + shown if shown else ''})")
    return "a mixture of " + ", ".join(parts)


def _model_card(config: TrainConfig, encoder: Encoder, loss_config: dict, steps: int, examples: int,
                metrics: dict, base_metrics: dict, *, requested_batch_size: int | None = None,
                sources: list[SamplerSource] | None = None) -> str:
    capped = (f" (batch_size {requested_batch_size} capped at the size of the training data)"
              if requested_batch_size is not None and requested_batch_size != config.batch_size else "")
    skipped = sum(s.rows.stats.get("skipped_empty_positives", 0) for s in sources or [])
    examples_text = f"{examples} examples" + (f" ({skipped} record(s) with an empty positive list skipped: "
                                              "skip_empty_positives)" if skipped else "")
    rows = ""
    if metrics:
        keys = [k for k in ("ndcg@10", "mrr@10", "recall@10", "recall@100", "map@100") if k in metrics]
        rows = "| model | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys) + "\n"
        if base_metrics:
            rows += "| base | " + " | ".join(f"{100 * base_metrics[k]:.2f}" for k in keys) + " |\n"
        rows += "| this model | " + " | ".join(f"{100 * metrics[k]:.2f}" for k in keys) + " |\n"
    return f"""---
library_name: sentence-transformers
tags: [sentence-transformers, feature-extraction, sentence-similarity, robustir]
pipeline_tag: sentence-similarity
---

# Retrieval embedding model trained with robustir

- **Base model:** `{config.model or 'all-MiniLM-L6-v2 (bundled)'}`
- **Training data:** {_describe_data(config)} (split `{config.train_split}` for BEIR folders), {examples_text};
  hard negatives: {'as given in the data (or in-batch only)' if config.mine == 'none' else f'mined with {config.mine} ({config.mine_negatives} per query, skipping the top {config.mine_range_min})'};
  {config.num_negatives} hard negative(s) per query per step.
- **Loss:** `{loss_config.get('name', config.loss)}` with {json.dumps({k: v for k, v in loss_config.items() if k != 'name'})}
- **Steps:** {steps}; batch {config.batch_size} queries per process{capped}{f', GradCache chunks of {config.chunk_size} rows' if config.chunk_size else ''}{f', a cross-batch memory of {config.memory_size} passages' if config.memory_size else ''};
  lr {config.lr} (linear warm-up {config.warmup_ratio:.0%} then decay), weight decay {config.weight_decay}, seed {config.seed}, precision {_trained_precision(config, encoder)}.
{f'- **Weights:** WiSE-FT, {1 - config.base_weight:g} x fine-tuned + {config.base_weight:g} x the base model (base_weight).' + chr(10) if config.base_weight else ''}- **Encoding:** {encoder.config.pooling} pooling, {'L2-normalised (cosine)' if encoder.config.normalize else 'unnormalised (dot product)'},
  query max length {encoder.config.query_max_length}, passage max length {encoder.config.passage_max_length}
  (training truncated passages at {config.train_passage_max_length or encoder.config.passage_max_length}),
  query instruction {encoder.config.query_instruction!r}.

{('## Evaluation on `' + str(config.eval_data) + '` (' + config.eval_split + ')' + chr(10) + chr(10) + rows) if rows else ''}
## Usage

```python
from sentence_transformers import SentenceTransformer
model = SentenceTransformer("path/to/this/folder")
q = model.encode(["a question"], prompt_name="query" if model.prompts.get("query") else None)
p = model.encode(["a passage"])
```

Full configuration: see `training_config.json`.
"""


# ---------------------------------------------------------------------------- the stage

def resolve_recipe(config: TrainConfig) -> TrainConfig:
    """The train step's first act: with ``audit``, check it audited this training data (the same content) and,
    with ``loss: auto``, take its recommended loss, loss options (the config's own win) and ``filter_positives``.
    Returns the config to train with (``config`` itself when there is no audit); resolving twice is harmless."""
    if not config.audit:
        return config
    import dataclasses

    from ..audit.recommend import loss_from_audit

    chosen, options, recipe = loss_from_audit(config.audit, config.loss, config.train_data)
    if config.loss != "auto":
        return config
    return dataclasses.replace(config, loss=chosen, loss_options={**options, **config.loss_options},
                               filter_positives=config.filter_positives or bool(recipe.get("filter_positives")))


def train(config: TrainConfig, stop_after: int | None = None) -> TrainResult:
    """Fine-tune ``config.model`` on ``config.train_data``; resumes from the latest checkpoint in ``output``.

    The stage-specific part (data, model, loss, probe, evaluation, what to save) on top of the shared
    :class:`~robustir.training.loop.TrainingLoop`. ``stop_after``: leave after this many optimizer steps (with a
    checkpoint), as if the job had been interrupted; a later call resumes. Used by tests and by time-boxed jobs.

    The output folder holds one run (:meth:`~robustir.training.loop.TrainingLoop.open_output`): resuming or
    reusing it with other settings or inputs raises :class:`~robustir.errors.ConfigError`; ``resume=false`` starts
    over; a finished run re-run with the same settings and inputs returns its result without training
    (``already_complete``).
    """
    config = resolve_recipe(config)  # loss auto: the audit's choice, recorded in the run's fingerprint
    refuse_run_over_inputs(config.output, models={"model": config.model},
                           data={f"training data {s.label}": s.path for s in config.sources},
                           stage="train")  # before the loop makes the folder
    loop = TrainingLoop(config, config_file="training_config.json")
    accelerator, is_main, out = loop.accelerator, loop.is_main, loop.out
    # before the data is prepared: mining caches its negatives in the folder
    inputs = train_inputs(config)
    state = loop.open_output(inputs, outputs=OUTPUTS, finished=("model",))
    if state == "complete":
        return _finished_result(loop)

    encoder = Encoder.from_pretrained(config.model or default_model_path(), pooling=config.pooling,
                                      **length_options(config.query_max_length, config.passage_max_length),
                                      query_instruction=config.query_instruction,
                                      passage_instruction=config.passage_instruction)
    limit = max_positions(encoder.transformer.config, encoder.tokenizer)
    if config.train_passage_max_length and limit and config.train_passage_max_length > limit:
        raise ConfigError(f"train_passage_max_length = {config.train_passage_max_length} is above what model "
                          f"{config.model or default_model_path()} takes ({limit} tokens); use at most {limit}")
    if config.gradient_checkpointing:
        encoder.transformer.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    encoder.to(loop.device)  # before dense mining, which encodes the corpus with it (prepare keeps it there)
    sources = prepare_examples(config, encoder, is_main, accelerator.wait_for_everyone, inputs)
    examples = sources[0].rows if len(sources) == 1 else _AllRows(sources)  # memory-mapped rows, read by index
    loss = get_loss(config.loss, **config.loss_options)
    # a data set smaller than one batch trains with a batch capped at its size; config.batch_size is the batch
    # the loop, the checkpoints, training_config.json and the model card state (the fingerprint keeps the request)
    requested_batch_size = config.batch_size
    config.batch_size = fit_batch_size(sources, config.batch_size, accelerator.num_processes, config.epoch_unit,
                                       log=is_main)
    sampler = GroupSampler(sources, config.num_negatives, config.batch_size, accelerator.num_processes, config.seed,
                           epoch_unit=config.epoch_unit)
    total_steps = config.max_steps or steps_for_epochs(config.epochs, sampler.steps_per_epoch
                                                       * budget_scale(sources, config.epoch_unit))

    eval_dataset = None
    base_metrics: dict[str, float] = {}
    if config.eval_data:
        from ..data.beir import load_beir

        eval_dataset = load_beir(config.eval_data, config.eval_split)

    loss.to(accelerator.device)
    memory = None
    if config.memory_size:
        from .memory import PassageMemory

        memory = PassageMemory(config.memory_size, encoder.dim).to(accelerator.device)
    # the loss's state (PEG's t) and the memory's passages are checkpointed too: a resumed run sees what an
    # uninterrupted one would
    start_step = loop.prepare(encoder, total_steps, checkpointed=(loss,) if memory is None else (loss, memory))
    model = loop.model
    engine = BatchEngine(loss, chunk_size=config.chunk_size, block_rows=config.loss_block_rows, memory=memory)

    unwrapped: Encoder = loop.unwrapped
    if start_step == 0 and is_main:
        if config.report:
            write_json(out / "similarities.json", {"start": similarity_probe(
                unwrapped, examples, config.probe_size, config.seed, config.eval_precision)})
        if eval_dataset is not None and config.eval_base:
            base_metrics = _evaluate(unwrapped, eval_dataset, config)
            write_json(out / "base_metrics.json", base_metrics)
    if (out / "base_metrics.json").exists():
        base_metrics = json.loads((out / "base_metrics.json").read_text())

    # sampling and tokenisation of the coming steps run in the background (input_pipeline); the batch of a step
    # depends on (seed, epoch, step, rank) only
    on_gpu = accelerator.device.type == "cuda"
    collator = Collator.for_encoder(unwrapped, unwrapped.config.query_max_length,
                                    config.train_passage_max_length or unwrapped.config.passage_max_length,
                                    pad_to_multiple_of=config.pad_to_multiple_of or (8 if on_gpu else None))
    batches = InputPipeline(StepBatches(sampler, collator, accelerator.process_index),
                            prefetch=config.prefetch_batches, workers=config.dataloader_workers, pin_memory=on_gpu)

    def step(index: int, batch) -> dict:
        q, p, ids, positive_ids = batch
        # on the model's device before the engine sees them: GradCache's RNG snapshot (RandContext) records
        # the generator of the devices its input tensors live on, so CPU inputs would replay GPU dropout
        # with other masks
        q = {k: v.to(accelerator.device, non_blocking=True) for k, v in q.items()}
        p = {k: v.to(accelerator.device, non_blocking=True) for k, v in p.items()}
        source = sampler.source_of(index)  # every global batch comes from one source
        output = engine.step(model, q, p, config.num_negatives, passage_ids=ids, positive_ids=positive_ids,
                             in_batch_negatives=source.in_batch_negatives)
        values = {"loss": output.loss, **output.components}
        if sampler.mixture:
            values["source"] = source.name  # per-source loss in the log and the report
        return values

    def evaluate_now(done: int) -> None:
        if not (config.eval_steps and done % config.eval_steps == 0 and done < total_steps):
            return
        if is_main:
            metrics = _evaluate(unwrapped, eval_dataset, config)
            loop.log({"step": done, **{f"eval_{k}": v for k, v in metrics.items()}})
            logger.info("step %d: eval ndcg@10 %.4f", done, metrics["ndcg@10"])
            model.train()
        accelerator.wait_for_everyone()

    loss.train()
    run = loop.run(step, save_steps=config.save_steps or sampler.steps_per_epoch, desc=f"train ({config.loss})",
                   throughput_key="pairs_per_s", epoch=lambda done: (done - 1) / sampler.steps_per_epoch,
                   stop_after=stop_after, after_step=evaluate_now if eval_dataset is not None else None,
                   batches=batches)
    waiting = {"data_wait_seconds": run.data_wait_seconds, "data_wait_share": run.data_wait_share}
    if run.interrupted:
        return TrainResult(out / "model", run.steps, loop.seconds, {}, base_metrics, **waiting)

    metrics: dict[str, float] = {}
    model_path = out / "model"
    if is_main:
        if config.base_weight:  # WiSE-FT: back toward the starting model before the evaluation and the save
            from ..models.interpolate import interpolate_weights

            interpolate_weights(unwrapped, Encoder.from_pretrained(config.model or default_model_path()),
                                config.base_weight)
        if eval_dataset is not None:
            metrics = _evaluate(unwrapped, eval_dataset, config)
            write_json(out / "eval_metrics.json", {"model": metrics, "base": base_metrics})
        card = _model_card(config, unwrapped, loss.config(), total_steps, len(examples), metrics, base_metrics,
                           requested_batch_size=requested_batch_size, sources=sources)
        unwrapped.save(model_path, model_card=card)
        write_json(model_path / "training_config.json", to_dict(config))
        if config.report:
            sims = json.loads((out / "similarities.json").read_text()) if (out / "similarities.json").exists() else {}
            sims["end"] = similarity_probe(unwrapped, examples, config.probe_size, config.seed, config.eval_precision)
            write_json(out / "similarities.json", sims)
            from .report import write_training_report

            write_training_report(out)
    loop.finish()
    return TrainResult(model_path, total_steps, loop.seconds, metrics, base_metrics, **waiting)


def _finished_result(loop: TrainingLoop) -> TrainResult:
    """The result of the finished run the output folder holds (the same settings and inputs), read back."""
    out = loop.out
    metrics: dict[str, float] = {}
    base_metrics: dict[str, float] = {}
    if (out / "eval_metrics.json").exists():
        saved = json.loads((out / "eval_metrics.json").read_text(encoding="utf-8"))
        metrics, base_metrics = saved.get("model", {}), saved.get("base", {})
    elif (out / "base_metrics.json").exists():
        base_metrics = json.loads((out / "base_metrics.json").read_text(encoding="utf-8"))
    loop.finish()
    return TrainResult(out / "model", int(loop.completed_steps or 0), loop.seconds, metrics, base_metrics,
                       already_complete=True)


def _evaluate(encoder: Encoder, dataset, config: TrainConfig) -> dict[str, float]:
    from ..device import device_string
    from ..evaluation.retrieval import EvalConfig, evaluate

    was_training = encoder.training
    result = evaluate(encoder, dataset, config=EvalConfig(batch_size=config.eval_batch_size,
                                                          precision=config.eval_precision,
                                                          device=device_string(encoder.device)))  # where it trains
    encoder.train(was_training)
    return result.metrics


def _trained_precision(config: TrainConfig, encoder: Encoder) -> str:
    """The precision the forward passes ran in (``auto`` resolved on the training device), as the card states it."""
    from ..precision import resolve_precision

    resolved = resolve_precision(config.precision, encoder.device)
    return resolved if config.precision == resolved else f"{resolved} ({config.precision})"


#: ``robustir train`` as a :class:`~robustir.runs.Step` (run by :func:`robustir.runs.execute`)
TRAIN = register(loop_step("train", TrainConfig, train))
