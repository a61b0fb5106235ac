"""Fair side-by-side training: robustir and sentence-transformers on the *same rows* and the same budget.

A :class:`Budget` holds everything both sides share (batch, hard negatives per row, epochs, lr schedule,
weight decay, lengths, precision). :func:`materialize_rows` turns mined examples into training rows --
one ``(query, positive, k negatives)`` row per (query, positive) pair and epoch, negatives drawn from the
query's pool with a seed -- and both trainers read exactly those rows: robustir as a training JSONL
(one positive and exactly ``k`` negatives per line, so its sampler has nothing left to choose),
sentence-transformers as a ``datasets.Dataset`` with columns ``anchor, positive, negative_1..k`` for
``MultipleNegativesRankingLoss`` behind its ``NO_DUPLICATES`` batch sampler. Both run
``len(rows) // batch_size`` optimizer steps and are evaluated by the same code
(:func:`evaluate_model`, robustir's trec_eval metrics on the same BEIR split and lengths).

Used by ``bench/vs_st.py`` and by the planted-noise benchmark (:mod:`robustir.robustness.bench`).
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Sequence

from ..data.training_data import TrainingExample
from ..errors import ConfigError
from ..runs import Artifact, fingerprint
from ..io import atomic_write
from ..precision import Precision, resolve_precision
from ..validation import (config_dataclass, NonNegativeFloat, NonNegativeInt, OpenFraction, PositiveFloat, PositiveInt,
                          Range)

logger = logging.getLogger(__name__)

__all__ = ["Budget", "PRESETS", "dev_split", "materialize_rows", "write_rows", "train_robustir", "train_sentence_transformers",
           "evaluate_model", "RunOutcome"]


@config_dataclass
class Budget:
    """Settings shared by every side of a comparison."""

    batch_size: Annotated[int, Range(ge=2)] = 32
    num_negatives: NonNegativeInt = 3
    """Hard negatives per training row."""
    pool: PositiveInt = 10
    """Mined negatives per query that rows draw from."""
    epochs: PositiveFloat = 2.0
    """Passes over the (query, positive) pairs."""
    lr: PositiveFloat = 2e-5
    warmup_ratio: OpenFraction = 0.1
    """Linear warm-up, then linear decay to 0."""
    weight_decay: NonNegativeFloat = 0.0
    max_grad_norm: PositiveFloat = 1.0
    query_max_length: PositiveInt = 64
    train_passage_max_length: PositiveInt = 128
    passage_max_length: PositiveInt = 256
    """Evaluation."""
    precision: Precision = "auto"
    """Training and evaluation, both sides: auto = bf16 where native, else fp32."""
    train_queries: NonNegativeInt = 0
    """Train on a seeded subset of this many training queries (the same subset for every method and seed; the
    noise benchmark's ``cpu-long`` proxy); 0 = all of them."""

    def validate(self) -> None:
        if self.batch_size < 2 or self.num_negatives < 0 or self.pool < self.num_negatives or self.epochs <= 0:
            raise ConfigError("budget: need batch_size >= 2, 0 <= num_negatives <= pool and epochs > 0, got "
                              f"batch_size={self.batch_size}, num_negatives={self.num_negatives}, pool={self.pool}, "
                              f"epochs={self.epochs}")


#: ``cpu``: about 5 minutes a run on 2 cores (57 steps on SciFact); ``gpu``: the H100 settings of issue 9.
PRESETS: dict[str, Budget] = {
    "cpu": Budget(),
    "gpu": Budget(batch_size=64, epochs=5.0, train_passage_max_length=256),
}


def materialize_rows(examples: Sequence[TrainingExample], num_negatives: int, epochs: float, seed: int,
                     filler: Sequence[str] = ()) -> list[dict]:
    """Training rows ``{"query", "pos": [p], "neg": [k texts]}`` for ``epochs`` passes over every (query, positive).

    Negatives of a row are ``k`` distinct draws from the query's ``neg`` pool (seeded by seed, epoch and
    pair); a pool smaller than ``k`` is completed with random ``filler`` passages that are not among the
    query's positives (what robustir's sampler does for a query without negatives). A fractional last
    epoch takes the first part of a seeded permutation of the pairs.
    """
    pairs = [(i, j) for i, e in enumerate(examples) for j in range(len(e.pos))]
    if not pairs:
        raise ConfigError("no (query, positive) pairs to train on")
    filler = list(filler) or [p for e in examples for p in e.pos]
    rows: list[dict] = []
    full, part = int(epochs), epochs - int(epochs)
    for epoch in range(full + (1 if part > 1e-9 else 0)):
        order = list(range(len(pairs)))
        random.Random(f"{seed}:order:{epoch}").shuffle(order)
        if epoch == full:
            order = sorted(order[: round(part * len(pairs))])
        for n in sorted(order) if epoch < full else order:
            i, j = pairs[n]
            example = examples[i]
            rng = random.Random(f"{seed}:{epoch}:{i}:{j}")
            own = set(example.pos)
            pool = [t for t in dict.fromkeys(example.neg) if t not in own]
            negatives = rng.sample(pool, min(num_negatives, len(pool)))
            tries = 0
            while len(negatives) < num_negatives and tries < 1000:
                tries += 1
                candidate = rng.choice(filler)
                if candidate not in own and candidate not in negatives:
                    negatives.append(candidate)
            if len(negatives) < num_negatives:
                raise ConfigError("not enough distinct passages to fill the hard negatives of a row; "
                                  "lower num_negatives")
            row = {"query": example.query, "pos": [example.pos[j]], "neg": negatives}
            if example.prompt is not None:
                row["prompt"] = example.prompt
            rows.append(row)
    return rows


def write_rows(rows: Sequence[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


@dataclass
class RunOutcome:
    model_path: Path
    steps: int
    seconds: float


def _steps(rows_path: Path, budget: Budget) -> int:
    with open(rows_path, encoding="utf-8") as handle:
        count = sum(1 for line in handle if line.strip())
    if count < budget.batch_size:
        raise ConfigError(f"{rows_path}: {count} rows are fewer than one batch of {budget.batch_size}")
    return count // budget.batch_size


def train_robustir(rows_path: str | Path, output: str | Path, budget: Budget, seed: int, *, model: str | None = None,
                   loss: str = "infonce", loss_options: dict | None = None,
                   chunk_size: int | None = None, memory_size: int = 0) -> RunOutcome:
    """robustir's trainer on the rows; loss options left empty = the library defaults; ``chunk_size``: GradCache
    rows per forward chunk (None: the whole batch at once); ``memory_size``: the cross-batch memory (0: none)."""
    from ..runs import Job, execute
    from ..training.arguments import TrainConfig
    from ..training.trainer import TRAIN

    rows_path = Path(rows_path)
    config = TrainConfig(
        model=model, train_data=str(rows_path), mine="none", num_negatives=budget.num_negatives, loss=loss,
        loss_options=dict(loss_options or {}), batch_size=budget.batch_size, chunk_size=chunk_size, epochs=1.0,
        max_steps=_steps(rows_path, budget), lr=budget.lr, warmup_ratio=budget.warmup_ratio,
        weight_decay=budget.weight_decay, max_grad_norm=budget.max_grad_norm, seed=seed, precision=budget.precision,
        query_max_length=budget.query_max_length, passage_max_length=budget.passage_max_length,
        train_passage_max_length=budget.train_passage_max_length, output=str(output), report=False,
        save_total_limit=1, memory_size=memory_size)
    result = execute(TRAIN, config, Job(str(output)), say=None).report
    return RunOutcome(result.model_path, result.steps, result.seconds)


def _st_dataset(rows_path: Path, k: int):
    from datasets import Dataset

    from ..models.encoder import EncoderConfig

    plain = EncoderConfig()  # a row's own prompt, no model instruction
    columns: dict[str, list[str]] = {"anchor": [], "positive": [], **{f"negative_{n + 1}": [] for n in range(k)}}
    with open(rows_path, encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            row = json.loads(line)
            columns["anchor"].append(plain.with_instruction([row["query"]], "query", row.get("prompt"))[0])
            columns["positive"].append(row["pos"][0])
            for n in range(k):
                columns[f"negative_{n + 1}"].append(row["neg"][n])
    return Dataset.from_dict(columns)


def train_sentence_transformers(rows_path: str | Path, output: str | Path, budget: Budget, seed: int, *,
                                model: str | None = None) -> RunOutcome:
    """sentence-transformers' own trainer: MultipleNegativesRankingLoss (scale 20 = tau 0.05), NO_DUPLICATES."""
    import torch
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers

    from ..resources import default_model_path

    rows_path, output = Path(rows_path), Path(output)
    final = output / "model"
    steps = _steps(rows_path, budget)
    run = Artifact(output, what="sentence-transformers run")
    made = fingerprint("st-train", {"budget": budget, "seed": seed, "steps": steps},
                       {"rows": rows_path, "model": model or default_model_path()})
    if run.begin(made, on_change="redo", resume=False):
        info = run.report
        return RunOutcome(final, info["steps"], info["seconds"])
    started = time.perf_counter()
    st_device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = resolve_precision(budget.precision, st_device)  # the same rule as robustir's side
    st_model = SentenceTransformer(model or default_model_path(), device=st_device)
    st_model.max_seq_length = budget.train_passage_max_length
    args = SentenceTransformerTrainingArguments(
        output_dir=str(output / "trainer"), max_steps=steps, per_device_train_batch_size=budget.batch_size,
        learning_rate=budget.lr, warmup_steps=int(budget.warmup_ratio * steps), lr_scheduler_type="linear",
        weight_decay=budget.weight_decay, max_grad_norm=budget.max_grad_norm, bf16=precision == "bf16",
        fp16=precision == "fp16", seed=seed, data_seed=seed, batch_sampler=BatchSamplers.NO_DUPLICATES,
        save_strategy="no", report_to="none",
        logging_steps=max(1, steps // 10), use_cpu=not torch.cuda.is_available(), dataloader_drop_last=True)
    trainer = SentenceTransformerTrainer(model=st_model, args=args,
                                         train_dataset=_st_dataset(rows_path, budget.num_negatives),
                                         loss=MultipleNegativesRankingLoss(st_model))
    trainer.train()
    st_model.save(str(final))
    seconds = time.perf_counter() - started
    run.finish({"steps": steps, "seconds": seconds}, files=["model/config.json"])
    return RunOutcome(final, steps, seconds)


def dev_split(data: str | Path, split: str, size: int, seed: int = 0):
    """Carve ``size`` queries (seeded) out of a BEIR split: ``(dev BeirDataset over the full corpus, dev ids)``.

    Defaults and thresholds are chosen on such a split, never on the test split; train on the rest.
    """
    from ..data.beir import BeirDataset, load_beir

    full = load_beir(data, split)
    ids = sorted(full.qrels)
    if not 0 < size < len(ids):
        raise ConfigError(f"dev split: size must be in 1..{len(ids) - 1}, got {size}")
    dev = set(random.Random(f"dev:{seed}").sample(ids, size))
    dataset = BeirDataset(full.corpus, {q: t for q, t in full.queries.items() if q in dev},
                          {q: r for q, r in full.qrels.items() if q in dev}, full.path, f"{split}-dev{size}")
    return dataset, dev


def evaluate_model(model_path: str | Path, data, split: str, budget: Budget,
                   cache: dict | None = None) -> dict[str, float]:
    """robustir's evaluation with the budget's lengths and precision, for whichever side trained the model.

    ``data``: a BEIR folder (its ``split`` is loaded, cached in ``cache``) or a loaded ``BeirDataset``.
    """
    from ..data.beir import BeirDataset, load_beir
    from ..evaluation.retrieval import EvalConfig, evaluate
    from ..models.encoder import Encoder

    key = (str(data), split)
    dataset = data if isinstance(data, BeirDataset) else (cache.get(key) if cache is not None else None)
    if dataset is None:
        dataset = load_beir(data, split)
        if cache is not None:
            cache[key] = dataset
    encoder = Encoder.from_pretrained(str(model_path), query_max_length=budget.query_max_length,
                                      passage_max_length=budget.passage_max_length)
    import torch

    if torch.cuda.is_available():
        encoder.to("cuda")
    return evaluate(encoder, dataset, config=EvalConfig(precision=budget.precision, show_progress=False)).metrics
