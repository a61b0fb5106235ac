"""``robustir audit``: how noisy is a training set, which records are suspect, and which recipe fits it.

One streaming pass reads every record (a training JSONL file or folder, or a BEIR folder's split): it validates
it (a bad line is an error naming file, line and field), runs the text checks (:mod:`robustir.audit.checks`) and
keeps a seeded reservoir sample of at most ``max_records`` records for the teacher, and random passages. The
teacher (an embedding model; default the bundled all-MiniLM-L6-v2) then scores the sample:

* every (query, positive) pair: its cosine, its *random p-value* ``u`` against ``random_passages`` random
  passages, its *gap* to the best other passage of the search pool (``corpus``: a BEIR folder or corpus file;
  else the audited records' own passages) and how many of its own negatives outscore it;
* planted nulls, built from the same records: a random passage standing in as the positive (random null) and the
  record's first negative standing in (hard null; records without negatives give none, and without any the
  hard-like rate is not estimated: mine negatives first);
* the trusted pairs of ``eval_data`` (its qrels), as the clean reference of how often the teacher misranks a true
  positive.

:func:`robustir.audit.estimate.estimate_rates` turns these into the false-positive rate with an interval. Each
pair is also flagged on its own (``random_like``: half the random passages outscore it; ``outranked``: a passage of
the pool scores above it by more than the hard nulls' median gap), each negative of an unflagged pair
(``above_positive_margin``: within 5 % of the positive's score, NV-Retriever's rule; ``near_duplicate_of_positive``:
passage cosine >= 0.95), and leakage into ``eval_data`` (same normalised query or positive; a query with cosine
>= 0.95 to an evaluation query).

Output folder: ``report.json``, ``report.md``, ``audit.png`` (score distributions, flagged share per reason),
``flagged.jsonl`` (one line per flag, most suspicious first) and ``run.json`` (its record: a re-run with the same
settings and inputs does nothing, with other ones it redoes the audit).

Each job has its module: :mod:`~robustir.audit.sample` (pass 1: read, check, sample),
:mod:`~robustir.audit.pool` (the teacher's embeddings, the search pool), :mod:`~robustir.audit.score` (pass 2:
the statistics), :mod:`~robustir.audit.flags` (leakage, duplicates, false negatives, suspected positives),
:mod:`~robustir.audit.estimate`, :mod:`~robustir.audit.recommend` and :mod:`~robustir.audit.report`; this one holds
the config, the result and the run that puts them together.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import numpy as np

from ..errors import ConfigError, DataError
from ..io import atomic_write, write_json
from ..precision import Precision
from ..runs import Artifact, fingerprint, operational
from ..validation import Because, config_dataclass, ModelName, NonNegativeInt, OpenFraction, PositiveInt, Range, Seed
from .estimate import estimate_rates, near_miss_reading
from .flags import Flagging
from .pool import Pooling, _load_teacher
from .sample import Reading, Record, _is_beir, iter_records
from .score import Scoring, _distributions

logger = logging.getLogger(__name__)

__all__ = ["AuditConfig", "AuditResult", "Record", "audit", "iter_records", "REPORT", "FLAGGED"]

#: fewest bootstrap resamples: with n resamples each 2.5 % tail of a 95 % percentile interval holds 0.025 n of them
MIN_BOOTSTRAP = 40

REPORT, FLAGGED, MARKDOWN, PLOT = "report.json", "flagged.jsonl", "report.md", "audit.png"


@config_dataclass
class AuditConfig:
    """Options of ``robustir audit``."""

    data: str = ""
    """Training JSONL file or folder (query/pos[/neg] per line), or a BEIR folder (its ``split``)."""
    output: str = ""
    """Folder for report.json, report.md, audit.png and flagged.jsonl."""
    split: str = "train"
    """The qrels split read when ``data`` is a BEIR folder."""
    model: ModelName | None = None
    """Teacher: an embedding model folder or hub id (None = the bundled all-MiniLM-L6-v2)."""
    corpus: str | None = None
    """Passages searched for better matches than each positive: a BEIR folder or a corpus JSONL (None: ``data``'s
    corpus when it is a BEIR folder, else the audited records' own passages)."""
    eval_data: str | None = None
    """BEIR folder of the evaluation split: checked for leakage, and its qrels calibrate the teacher (a trusted
    reference: without one the hard-like rate is an upper bound)."""
    eval_split: str = "test"
    """The evaluation split of ``eval_data``."""
    reference: bool = True
    """Use ``eval_data``'s qrels as the clean reference (false: leakage check only)."""
    max_records: PositiveInt = 20000
    """Records the teacher scores: a seeded uniform sample when the data holds more (the text checks read all)."""
    random_passages: Annotated[int, Range(ge=20)] = 200
    """Random passages each positive is ranked against (the random p-value's resolution is 1/(this+1))."""
    relative_margin: OpenFraction = 0.05
    """A negative scoring above the positive's score times (1 - this) is a suspected false negative."""
    duplicate_cosine: Annotated[float, Range(gt=0, le=1)] = 0.95
    """Passage cosine at which a negative is a near-duplicate of its positive, and a query of an evaluation query."""
    max_positive_reuse: PositiveInt = 20
    """Flag the records of a passage that is the positive of more than this many records."""
    min_query_words: NonNegativeInt = 2
    """Shorter queries are flagged ``short_query``."""
    min_passage_words: NonNegativeInt = 5
    """Shorter positives are flagged ``short_positive``."""
    seed: Seed = 0
    """Seed of the samples and the bootstrap."""
    bootstrap: Annotated[int, Range(ge=MIN_BOOTSTRAP), Because(
        f"a 95 % percentile interval needs at least {MIN_BOOTSTRAP} resamples for each 2.5 % tail to hold one; with "
        "fewer (0 included) the report would show a rate with a made-up interval such as ± 0")] = 1000
    """Bootstrap resamples of the rate's 95 % interval (at least 40; 1,000 is the usual choice)."""
    max_length: PositiveInt | None = None
    """Teacher token limit (None = the model's own)."""
    batch_size: PositiveInt = operational(64)
    """Encoding batch size."""
    precision: Precision = "auto"
    """Encoding precision: auto (bf16 where native: GPU, AMX/AVX512-BF16 CPU; else fp32), fp32, bf16 or fp16."""
    device: str = operational("auto")
    """Where the teacher runs: auto (the first GPU if there is one, else the CPU), cpu, cuda or cuda:N."""
    cache_dir: str | None = operational(None)
    """Reuse corpus embeddings saved here (the same cache as dense mining)."""
    overwrite: bool = operational(False)
    """Redo a complete audit."""
    progress: bool = operational(True)
    """Show progress bars."""

    def validate(self) -> None:
        if not str(self.data).strip():
            raise ConfigError("audit: data is required: a training JSONL file or folder, or a BEIR folder")
        if not str(self.output).strip():
            raise ConfigError("audit: output is required: the folder for the report")
        if self.model is not None and not self.model.strip():
            raise ConfigError("audit: model is empty; name a model folder, or leave it out for the bundled "
                              "all-MiniLM-L6-v2")


@dataclass
class AuditResult:
    """What :func:`audit` found (``report`` is report.json's content)."""

    output: Path
    report: dict
    already_complete: bool = False

    @property
    def estimate(self) -> dict:
        return self.report["false_positives"]["estimate"]

    @property
    def recommendation(self) -> dict:
        return self.report["recommendation"]


# ------------------------------------------------------------------------------------------------- the audit

def _settings(config: AuditConfig):
    from ..resources import default_model_path

    inputs = {"data": config.data, "corpus": config.corpus, "eval_data": config.eval_data,
              "model": config.model or default_model_path()}
    return fingerprint("audit", config, {k: v for k, v in inputs.items() if v})


def audit(config: AuditConfig, *, encoder=None) -> AuditResult:
    """Audit ``config.data``; writes the report folder (see the module docstring). ``encoder``: a loaded teacher
    (:class:`~robustir.models.encoder.Encoder`), else ``config.model`` is loaded."""
    config.validate()
    data = Path(config.data)
    if not data.exists():
        raise DataError(data, "not found", fix="give a training JSONL file or folder, or a BEIR folder")
    out = Path(config.output)
    from ..outputs import refuse_overwriting_inputs

    refuse_overwriting_inputs(out / FLAGGED, config.data, stage="audit")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"audit: the output {out} is a file; name a folder for the report")
    artifact = Artifact(out, what="audit", inside=True)
    made = _settings(config)
    if artifact.begin(made, overwrite=config.overwrite):
        return AuditResult(out, json.loads((out / REPORT).read_text(encoding="utf-8")), already_complete=True)
    started = time.monotonic()
    teacher = encoder if encoder is not None else _load_teacher(config)
    report = _Audit(config, teacher).run()
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    write_json(out / REPORT, report)
    from .report import write_markdown, write_plot

    write_markdown(report, out / MARKDOWN)
    write_plot(report, out / PLOT)
    artifact.finish({"rate": report["false_positives"]["estimate"]["rate"],
                     "recommendation": report["recommendation"]["loss"]},
                   files=[REPORT, FLAGGED, MARKDOWN] + ([PLOT] if (out / PLOT).exists() else []))
    return AuditResult(out, report)


class _Audit(Reading, Pooling, Scoring, Flagging):
    """One audit: its jobs are mixed in from the modules that own them (sample, pool, score, flags)."""

    block = 512  # sampled records scored together

    def __init__(self, config: AuditConfig, encoder) -> None:
        self.config = config
        self.encoder = encoder
        self.out = Path(config.output)
        self.rng = random.Random(f"audit:{config.seed}")
    def run(self) -> dict:
        config = self.config
        self.out.mkdir(parents=True, exist_ok=True)
        self.counts: dict[str, dict[str, int]] = {}
        other_path = self.out / (FLAGGED + ".other")
        with open(other_path, "w", encoding="utf-8") as self.other:
            self.read()
            self.duplicates()
            self.pool()
            scored = self.score()
            self.leakage()
        pairs = scored["pairs"]
        ref, ref_info = self.reference()
        u = np.array([p["u"] for p in pairs])
        gap = np.array([p["gap"] for p in pairs])
        estimate = estimate_rates(u, gap, k=scored["k"], hard_null=scored["hard_null"],
                                  random_null_gap=scored["random_null_gap"], random_null_u=scored["random_null_u"],
                                  reference=ref, bootstrap=config.bootstrap, seed=config.seed)
        near = estimate_rates(u, gap, k=scored["k"], hard_null=scored["near_null"],
                              random_null_gap=scored["random_null_gap"], reference=ref,
                              bootstrap=config.bootstrap, seed=config.seed)
        reading = near_miss_reading(near)
        threshold = estimate.parts.get("threshold", float("inf"))
        fp_flags, suspects = self.suspected_positives(pairs, scored["k"], threshold)
        fn_flags, fn_info = self.false_negatives(pairs, suspects)
        with atomic_write(self.out / FLAGGED) as handle:
            for item in fp_flags + fn_flags:
                handle.write(json.dumps(item, ensure_ascii=False) + "\n")
                self.counts.setdefault(item["kind"], {}).setdefault(item["reason"], 0)
                self.counts[item["kind"]][item["reason"]] += 1
            with open(other_path, encoding="utf-8") as other:
                for line in other:
                    handle.write(line)
        other_path.unlink()
        counts = self.counts
        denominators = {"false_positive": len(pairs), "false_negative": max(1, fn_info["negatives_checked"])}
        shares = {f"{kind}:{reason}": n / max(1, denominators.get(kind, self.records))
                  for kind, reasons in counts.items() for reason, n in reasons.items()}
        from .recommend import recommend

        report = {
            "data": str(config.data), "split": config.split if _is_beir(Path(config.data)) else None,
            "records": self.records, "pairs": self.pairs, "negatives": self.negatives,
            "scored_records": len(self.sample), "scored_pairs": len(pairs),
            "sampled": len(self.sample) < self.records,
            "teacher": str(config.model or "bundled all-MiniLM-L6-v2"),
            "search_pool": {"source": self.pool_source, "corpus": self.corpus_path, "passages": len(self.pool_.texts)},
            "false_positives": {"estimate": estimate.to_json(), "text": estimate.text() + (f"; {reading['why']}" if not reading["readable"] else ""),
                                "near_miss": reading,
                                "flagged": counts.get("false_positive", {})},
            "false_negatives": {**fn_info,
                                "share_of_records": round(fn_info["records_with_a_flag"] / max(1, len(self.sample)), 6),
                                "flagged_by_reason": counts.get("false_negative", {})},
            "degenerate": counts.get("degenerate", {}), "duplicates": counts.get("duplicate", {}),
            "leakage": counts.get("leakage", {}), "reference": ref_info,
            "flagged_share": {k: round(v, 6) for k, v in sorted(shares.items())},
            "distributions": _distributions(gap, u, scored, ref),
            "config": asdict(config),
        }
        report["recommendation"] = recommend(report)
        return report

