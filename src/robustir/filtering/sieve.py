"""Passage sieve (CCR, Wang et al. AAAI 2024, Algorithm 1): drop hard negatives a briefly trained model finds
too close to the query.

Steps (the paper and the authors' code compared in docs/methods.md#ccr-passage-sieve):

1. **Brief training** on the noisy data with the CCR loss (:class:`~robustir.losses.ccr.CCRLoss`) through
   :func:`robustir.training.sieve.train_sieve_model` (the step, in :mod:`robustir.training.sieve`, passes it to
   :func:`sieve_negatives` as ``trainer``) -- 1 epoch, ``mine="none"``, ``num_negatives=train_negatives``
   (the authors sample k = 5 hard negatives per query for NQ/TQ: group size 6), output in ``work_dir/train``
   (resumable: ``train`` resumes from its checkpoints; a finished run is reused). ``train=False``
   (``--no-train``) uses the model as it is.
2. **Candidate pool** per query: the first ``2 * num_negatives`` negatives of the record, in order (the paper: 30
   candidates for 15 downstream negatives). A shorter list is used as it is -- *not* repeated as the authors do,
   since repeats would only weigh duplicates twice in the mean. Negatives equal to a positive are removed first
   (``equals_positive``) and do not count towards the pool.
3. **Sieve**: with the briefly trained model, keep negative j iff
   ``cos(q, n_j) <= mean cosine over the pool + the positive`` (:func:`~robustir.losses.ccr.sieve_keep_mask`,
   the paper's ``l_NCE(n_j) >= mean l_NCE``; ties kept). ``strict`` removes ties, as the authors' code does.
   The positive is the record's first ``pos`` (the authors' datasets have one per query).
4. **Write-out**: the survivors in their original order, at most ``num_negatives`` (further survivors:
   ``over_limit``; negatives after the pool: ``beyond_pool`` -- the authors drop un-sampled negatives too). If
   the sieve removes every candidate, the single *lowest-scored* candidate is kept (the authors keep one at
   random; the lowest is the deterministic choice least likely to be a false negative).

Deliberate deviations from the authors' run (docs/methods.md#passage-sieve-choices): learning rate 1e-5 instead of
1e-7 (with a few hundred steps 1e-7 leaves the model practically unchanged), torch AdamW's default betas
(0.9, 0.999) instead of (0.8, 0.9), warm-up 20% as theirs. Defaults follow the authors' ``main`` branch:
``variant="authors_code"``, ``beta=0.1`` (effective weight ``(k+1) * beta`` = 0.6), ``temperature=1.0``.

Report (``OUT.report.json``): removed counts per reason, score statistics of positives / kept / removed, and
``details.similarities`` (cosine of the sieve model: ``positive``, ``kept``, ``removed``) for plotting; a PNG of
the three distributions is written next to it (``OUT.sieve.png``).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Callable, Literal

import numpy as np

from ..runs import operational
from ..errors import ConfigError
from ..io import Shard
from .teacher import REASON_EQUALS_POSITIVE, Decision, FilterRecord, FilterReport, check_paths, run_filter
from ..precision import Precision
from ..validation import (cli, config_dataclass, Epochs, ModelName, NonNegativeFloat, NonNegativeInt, OpenFraction,
                          PositiveFloat, PositiveInt, Range, Seed, Steps)


__all__ = ["SieveConfig", "SieveTrainer", "sieve_negatives", "sieve_decision", "plot_similarities"]

REASON_SIEVE = "sieve"
REASON_OVER_LIMIT = "over_limit"
REASON_BEYOND_POOL = "beyond_pool"


@config_dataclass
class SieveConfig:
    """Options of the passage sieve (``robustir filter --method sieve``)."""

    model: ModelName | None = None
    """Starting model (None = the bundled all-MiniLM-L6-v2)."""
    train: bool = True
    """Train briefly with the CCR loss first (False: sieve with ``model`` as it is)."""
    num_negatives: PositiveInt = 15
    """Negatives wanted per query after sieving; the candidate pool is twice this."""
    strict: bool = False
    """Remove ties with the mean too (authors' code) instead of keeping them (paper)."""
    variant: Literal["authors_code", "paper"] = "authors_code"
    """CCR loss variant of the brief training."""
    beta: NonNegativeFloat = 0.1
    """CCR loss beta."""
    temperature: PositiveFloat = 1.0
    """CCR loss temperature."""
    lr: PositiveFloat = 1e-5
    """Brief-training learning rate (the paper: 1e-7)."""
    epochs: Epochs = 1.0
    """Epochs of the brief CCR training."""
    max_steps: Steps | None = None
    """Cap on the brief training's steps (None = ``epochs``)."""
    train_batch_size: Annotated[int, Range(ge=2)] = 16
    """Queries per batch of the brief CCR training."""
    train_negatives: NonNegativeInt = 5
    """Hard negatives per query in the brief CCR training."""
    warmup_ratio: OpenFraction = 0.2
    """Warm-up share of the brief CCR training's steps."""
    query_max_length: PositiveInt | None = None
    """Query tokens (None: 64, or the model's limit if lower)."""
    passage_max_length: PositiveInt | None = None
    """Passage tokens (None: 256, or the model's limit if lower)."""
    train_precision: Precision = "auto"
    """Precision of the brief training: auto = bf16 where the device computes it natively, else fp32; fp32; bf16."""
    seed: Seed = 10086
    """Seed of the brief CCR training."""
    work_dir: str | None = operational(None)
    """Brief-training folder (default ``<output>.sieve-work``)."""
    batch_size: PositiveInt = operational(64)
    """Encoding batch size of the sieve pass."""
    precision: Precision = "auto"
    """Precision of the sieve pass's encoding (as train_precision, fp16 too)."""
    device: str = operational("auto")
    """Where the brief training and the sieve pass run: auto (the first GPU if there is one, else the CPU), cpu, cuda
    or cuda:N."""
    batch_records: PositiveInt = operational(256)
    """Records read and sieved together."""
    keep_removed: Annotated[bool, cli("removed")] = True
    """Add the removed list (text + reason) to each record."""
    plot: bool = operational(True)
    """Write a histogram of the sieve's similarities beside the report."""
    max_reported_similarities: NonNegativeInt = operational(50_000)
    """Per list; the statistics use every value."""
    shard: str | None = operational(None)
    """I/N: sieve shard I of N of the records (the output gets a shard suffix)."""
    overwrite: bool = operational(False)
    """Redo a complete output."""
    progress: bool = operational(True)
    """Show a progress bar."""

    def validate(self) -> None:
        if self.num_negatives < 1:
            raise ConfigError(f"sieve: num_negatives must be >= 1, got {self.num_negatives}")
        if self.model is not None and not self.model.strip():
            raise ConfigError("sieve: model is empty; name a model folder, or leave it out for the bundled "
                              "all-MiniLM-L6-v2")
        if self.variant not in ("authors_code", "paper"):
            raise ConfigError(f"sieve: variant must be authors_code or paper, got {self.variant!r}")
        if self.train and self.train_negatives < 1:
            raise ConfigError("sieve: train_negatives must be >= 1 (the CCR loss needs hard negatives)")


SieveTrainer = Callable[[Path, SieveConfig, Path], tuple[str, dict]]
"""``(input JSONL, config, work folder) -> (trained model folder, training summary)``."""


def sieve_decision(query_emb: np.ndarray, positive_emb: np.ndarray, candidate_emb: np.ndarray, wanted: int,
                   strict: bool = False) -> tuple[list[str | None], list[float], float]:
    """Sieve one query's pool: per candidate the reason it goes (None = kept), its cosine, and the positive's.

    ``candidate_emb`` is ``(m, d)`` in the record's order; at most ``wanted`` survivors are kept (first ones).
    """
    import torch

    from ..losses.ccr import sieve_keep_mask

    q = torch.as_tensor(query_emb, dtype=torch.float32)[None]
    p = torch.as_tensor(positive_emb, dtype=torch.float32)[None]
    c = torch.as_tensor(candidate_emb, dtype=torch.float32)[None]
    keep = sieve_keep_mask(q, p, c, strict=strict)[0].tolist()
    qn = q[0] / q[0].norm().clamp_min(1e-12)
    cos = (torch.nn.functional.normalize(c[0], dim=-1) @ qn).tolist()
    pos_cos = float(torch.nn.functional.normalize(p[0], dim=-1) @ qn)
    reasons: list[str | None] = [None if k else REASON_SIEVE for k in keep]
    survivors = [j for j, r in enumerate(reasons) if r is None]
    for j in survivors[wanted:]:
        reasons[j] = REASON_OVER_LIMIT
    if not survivors and reasons:  # keep one: the lowest-scored candidate (authors: a random one)
        reasons[int(np.argmin(cos))] = None
    return reasons, cos, pos_cos


def sieve_negatives(input_path: str | Path, output_path: str | Path, config: SieveConfig | None = None,
                    encoder=None, trainer: SieveTrainer | None = None) -> FilterReport:
    """Run the passage sieve on a training JSONL; write a new file, ``OUT.report.json`` and ``OUT.sieve.png``.

    ``encoder`` (an :class:`~robustir.models.encoder.Encoder`) replaces steps 1's model loading entirely (tests,
    or a model trained elsewhere); it is moved to ``config.device``. With ``config.train`` (the default) and no
    ``encoder``, ``trainer(input, config, work_dir) -> (model folder, summary)`` runs the brief CCR training:
    :func:`robustir.training.sieve.train_sieve_model`, which :func:`robustir.training.sieve.sieve_negatives` (the
    sieve with its training, what ``robustir filter --method sieve`` runs) passes. It is a parameter because the
    trainer sits above the filters: the training loop itself filters with :mod:`robustir.filtering.teacher`.
    """
    from ..device import resolve_device

    config = config or SieveConfig()
    config.validate()
    device = resolve_device(config.device)  # checked before anything loads or trains
    input_path, output = check_paths(input_path, output_path, config.overwrite)
    work_dir = Path(config.work_dir) if config.work_dir else output.with_name(output.name + ".sieve-work")
    training: dict = {}
    if encoder is None:
        from ..models.encoder import Encoder, length_options
        from ..resources import default_model_path

        model_path = config.model or default_model_path()
        if config.train:
            if trainer is None:
                raise ConfigError("sieve: train is on but no trainer was given: call "
                                  "robustir.training.sieve.sieve_negatives (the sieve with its brief CCR training), "
                                  "or set train: false to sieve with the model as it is")
            model_path, training = trainer(input_path, config, work_dir)
        encoder = Encoder.from_pretrained(model_path, **length_options(config.query_max_length,
                                                                       config.passage_max_length), device=device)
        training["sieve_model"] = str(model_path)
    elif hasattr(encoder, "to"):  # an Encoder (a duck-typed test double has no device)
        encoder = encoder.to(device)
    pool_size = 2 * config.num_negatives

    def decide(batch: list[FilterRecord]) -> list[Decision]:
        plans = []
        queries: list[str] = []
        passages: list[str] = []
        for record in batch:
            positives = {p.strip() for p in record.pos}
            reasons: list[str | None] = [None] * len(record.neg)
            pool: list[int] = []
            for j, text in enumerate(record.neg):
                if text.strip() in positives:
                    reasons[j] = REASON_EQUALS_POSITIVE
                elif len(pool) < pool_size:
                    pool.append(j)
                else:
                    reasons[j] = REASON_BEYOND_POOL
            plans.append((reasons, pool))
            queries.append(record.query)
            passages.append(record.pos[0])
            passages.extend(record.neg[j] for j in pool)
        q_emb = encoder.encode(list(dict.fromkeys(queries)), "query", batch_size=config.batch_size,
                               precision=config.precision)
        unique_passages = list(dict.fromkeys(passages))
        p_emb = encoder.encode(unique_passages, "passage", batch_size=config.batch_size, precision=config.precision)
        q_row = {t: i for i, t in enumerate(dict.fromkeys(queries))}
        p_row = {t: i for i, t in enumerate(unique_passages)}
        decisions = []
        for record, (reasons, pool) in zip(batch, plans):
            scores: list[float | None] = [None] * len(record.neg)
            pos_cos = None
            if pool:
                pool_reasons, cos, pos_cos = sieve_decision(
                    q_emb[q_row[record.query]], p_emb[p_row[record.pos[0]]],
                    p_emb[[p_row[record.neg[j]] for j in pool]], config.num_negatives, config.strict)
                for j, reason, score in zip(pool, pool_reasons, cos):
                    reasons[j] = reason
                    scores[j] = score
            decisions.append(Decision(reasons, scores, pos_cos))
        return decisions

    def on_finish(report: FilterReport, collected: dict) -> None:
        cap = config.max_reported_similarities
        similarities = {"positive": collected["positive"][:cap], "kept": collected["kept"][:cap],
                        "removed": collected.get(f"removed:{REASON_SIEVE}", [])[:cap]}
        report.details = {"training": training, "pool_size": pool_size,
                          "similarities": {k: [round(float(v), 5) for v in vals]
                                           for k, vals in similarities.items()}}
        kept, removed = similarities["kept"], similarities["removed"]
        if kept and removed:
            report.details["mean_similarity"] = {"kept": float(np.mean(kept)), "removed": float(np.mean(removed)),
                                                 "positive": float(np.mean(similarities["positive"]))}
        if config.plot and (kept or removed):
            png = output.with_name(output.name + ".sieve.png")
            plot_similarities(similarities, png, title=f"passage sieve: {report.records} queries")
            report.details["plot"] = str(png)

    return run_filter(input_path, output, decide, method="sieve", config=asdict(config),
                      batch_records=config.batch_records, keep_removed=config.keep_removed,
                      shard=Shard.parse(config.shard), overwrite=False, progress=config.progress,
                      on_finish=on_finish)


def plot_similarities(similarities: dict[str, list[float]], path: str | Path, title: str = "") -> Path:
    """Histogram PNG of the cosine similarities of positives, kept negatives and removed negatives."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    values = [v for vals in similarities.values() for v in vals]
    bins = np.linspace(min(values), max(values), 41) if values else 40
    colors = {"positive": "tab:green", "kept": "tab:blue", "removed": "tab:red"}
    labels = {"positive": "positives", "kept": "kept negatives", "removed": "removed negatives"}
    for name, vals in similarities.items():
        if vals:
            ax.hist(vals, bins=bins, alpha=0.5, density=True, color=colors.get(name),
                    label=f"{labels.get(name, name)} (n={len(vals)}, mean {np.mean(vals):.3f})")
    ax.set_xlabel("cosine similarity to the query (sieve model)")
    ax.set_ylabel("density")
    ax.set_title(title or "passage sieve")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
