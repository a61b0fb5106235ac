"""The one runner: raw corpus -> passages -> training pairs -> pre-training -> mining -> filtering ->
fine-tuning -> evaluation, from one config (``robustir run pipeline.yaml``; ``--until filter`` stops after
the training data is built).

Stages and the files they hand on (all under ``work_dir``)::

    corpus/corpus.jsonl      the raw documents as BEIR-style JSONL (_id, title, text), streamed from the source
                             (the first ``max_documents`` only, when set)
    chunk/passages.jsonl     the documents split into passages (absent with chunk: null: documents are passages)
    queries/train.jsonl      training pairs: LCS sentence pairs (GUR), LLM-generated queries (PEG), or a BEIR
                             train split
    pretrain/model           retromae | gur pre-trained encoder (stage absent with pretrain: null)
    mine/train.jsonl         the pairs with hard negatives (BM25 or dense)
    filter/train.jsonl       false negatives removed: teacher margin, passage sieve or LLM judge (absent with
                             filter: null)
    train/model              the fine-tuned model (robustir.training.trainer.train)
    eval/<system>.json       metrics on the evaluation split: base, pretrained (if any), finetuned
    results.md / .json       the comparison table

Every section is the stage's own config dataclass (``GenerateConfig``, ``PairMiningConfig``, ``PretrainConfig``,
``MiningConfig``, ``TeacherFilterConfig`` / ``SieveConfig`` / ``JudgeConfig``, ``TrainConfig``), so an unknown key
or a wrong type fails when the config loads, naming its key path (``filter.teacher.relative_margn``). PEG's whole
recipe against an OpenAI-compatible endpoint: ``configs/peg-recipe.yaml``.

Caching: every stage folder is a :class:`robustir.runs.Artifact` with its record ``work_dir/<stage>.run.json``:
a fingerprint of the stage's settings (fields marked operational -- batch sizes for encoding, prefetching,
devices, progress -- left out), of the *content* of what it reads from outside the work folder (the corpus file,
the base model, the evaluation data) and of the finished run of the stage before it. A re-run skips a stage
whose fingerprint is unchanged; a stage whose settings, inputs (a corpus file edited in place included) or
upstream run changed is redone from scratch, and so is everything after it. An interrupted stage resumes where
the stage itself can (pair mining, negative mining, training and pre-training all resume), unless its
fingerprint changed meanwhile, in which case its folder is cleared first.
``run_pipeline(config, force=["train"])`` (``robustir run CFG --force train``) redoes a stage regardless.

Device: the top-level ``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``; ``robustir run CFG --device cpu``) is
every stage's -- pre-training, dense mining, the teacher / sieve filter, fine-tuning, evaluation, and a local
(``backend: hf``) LLM whose ``llm.device`` is unset; a stage section's own ``device`` wins when it is not ``auto``.
Every device is checked when the config loads. Devices are not part of the fingerprints: a work folder moved to
another machine (or device) skips its finished stages and resumes the interrupted one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from .config import load_config
from .data.chunking import ChunkConfig
from .errors import ConfigError
from .io import atomic_write, try_lock, write_json
from .precision import Precision
from .runs import Artifact, Fingerprint, Job, Step, execute, fingerprint, operational, settings_of
from .queries.generate import GenerateConfig
from .filtering.llm_judge import JudgeConfig
from .negatives.mining import MiningConfig
from .queries.pairs import PairMiningConfig
from .filtering.sieve import SieveConfig
from .filtering.teacher import TeacherFilterConfig
from .training.arguments import TrainConfig
from .pretraining.pretrain import PretrainConfig, resolve_data_path
from .validation import config_dataclass, ModelName, PositiveInt, Seed

logger = logging.getLogger(__name__)

__all__ = ["ChunkStage", "EvalStage", "FilterStage", "PipelineConfig", "PipelineResult", "QueriesStage",
           "load_pipeline_config", "run_pipeline", "STAGES"]

STAGES = ("corpus", "chunk", "queries", "pretrain", "mine", "filter", "train", "eval")


ChunkStage = ChunkConfig
"""Documents -> passages (:func:`robustir.data.chunking.chunk_corpus`): what a chunked corpus hands to query
generation and mining (the same options as ``robustir chunk``)."""


@config_dataclass
class QueriesStage:
    """Where the (query, positive) training pairs come from."""

    source: Literal["pairs", "generate", "beir"] = "pairs"
    pairs: PairMiningConfig = field(default_factory=PairMiningConfig)
    """Source pairs: GUR LCS pair mining."""
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    """source generate: LLM-written queries (PEG); ``input``/``output`` are set by the runner."""
    split: str = "train"
    """Source beir: qrels split of the corpus folder."""
    max_examples: PositiveInt | None = None
    """Keep a seeded random sample of at most this many pairs."""
    seed: Seed = 0


@config_dataclass
class FilterStage:
    """False-negative removal after mining: the section of the chosen method is used."""

    method: Literal["teacher", "sieve", "llm"] = "teacher"
    teacher: TeacherFilterConfig = field(default_factory=TeacherFilterConfig)
    sieve: SieveConfig = field(default_factory=SieveConfig)
    llm: JudgeConfig = field(default_factory=JudgeConfig)
    """The LLM judge (PEG's false-negative removal); ``input``/``output`` are set by the runner."""


@config_dataclass
class EvalStage:
    data: str | None = None
    """BEIR folder (``bundled:scifact`` works); None = the corpus when it is a BEIR folder."""
    split: str = "test"
    base: bool = True
    """Evaluate the base model too."""
    pretrained: bool = True
    """And the pre-trained-only model, when there is one."""
    batch_size: PositiveInt = operational(64)
    precision: Precision = "auto"
    """Auto: bf16 where native (GPU, AMX/AVX512-BF16 CPU), else fp32."""
    query_max_length: PositiveInt | None = None
    """None = the model's own settings."""
    passage_max_length: PositiveInt | None = None


@config_dataclass
class PipelineConfig:
    work_dir: str = operational("runs/pipeline")
    model: ModelName | None = None
    """Base model; None = the bundled all-MiniLM-L6-v2."""
    corpus: str = "bundled:scifact"
    """Raw documents: BEIR folder, JSONL (_id/id, title, text) or plain text."""
    corpus_format: Literal["auto", "jsonl", "text", "beir"] = "auto"
    text_unit: Literal["block", "line"] = "line"
    """Plain text: one document per line or per blank-line block."""
    max_documents: PositiveInt | None = None
    """Only the first N documents (quick runs)"""
    chunk: ChunkStage | None = None
    """None = the documents are the passages."""
    queries: QueriesStage = field(default_factory=QueriesStage)
    pretrain: PretrainConfig | None = None
    """None = no pre-training; else mode retromae | gur (+ options)"""
    mine: MiningConfig | None = field(default_factory=MiningConfig)
    """None = in-batch negatives only."""
    mine_pool: Literal["auto", "corpus", "file"] = "auto"
    """Candidates: corpus documents or the file's texts."""
    filter: FilterStage | None = None
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalStage = field(default_factory=EvalStage)
    device: str = operational("auto")
    """Where every stage runs its models: auto (the first GPU if there is one, else the CPU), cpu, cuda or cuda:N; a
    stage section's own ``device`` wins when it is not auto."""

    def stage_device(self, own: str = "auto") -> str:
        """The device of a stage whose section says ``own``: its own unless ``auto``, else the pipeline's."""
        return own if str(own).strip().lower() != "auto" else self.device


@dataclass
class PipelineResult:
    stages: dict[str, str]  # stage -> "ran" | "skipped" | "off"
    metrics: dict[str, dict[str, float]]  # system -> metrics
    table: str
    model_path: Path
    seconds: float


def load_pipeline_config(path: str | Path | None, overrides: list[str] | None = None) -> PipelineConfig:
    config = load_config(PipelineConfig, path, overrides)
    runner_owned = (("queries.generate", config.queries.generate), ("filter.llm", config.filter and config.filter.llm))
    for where, section in runner_owned:
        if section and (section.input or section.output):
            raise ConfigError(f"{where}.input / {where}.output are set by the runner (they are the stage's files "
                              "under work_dir); remove them")
    if config.max_documents is not None and config.max_documents < 1:
        raise ConfigError(f"max_documents must be >= 1 (or null for all), got {config.max_documents}")
    check_devices(config)
    return config


def check_devices(config: PipelineConfig) -> None:
    """Resolve every device the config names (top level and stage sections), naming the key of a bad one."""
    from .device import resolve_device

    sections = {"device": config.device, "pretrain.device": config.pretrain and config.pretrain.device,
                "mine.device": config.mine and config.mine.device, "train.device": config.train.device,
                "filter.teacher.device": config.filter and config.filter.teacher.device,
                "filter.sieve.device": config.filter and config.filter.sieve.device}
    for key, spec in sections.items():
        if spec and (key == "device" or str(spec).strip().lower() != "auto"):  # a section's auto: the pipeline's
            try:
                resolve_device(spec)
            except ConfigError as exc:
                raise ConfigError(f"{key}: {exc}") from None


def _llm_on_device(config: PipelineConfig, llm: Any) -> Any:
    """A local (``hf``) LLM section without a device of its own runs on the pipeline's device (when not auto)."""
    from dataclasses import replace

    from .device import device_string, resolve_device

    if getattr(llm, "backend", None) != "hf" or llm.device or config.device.strip().lower() == "auto":
        return llm
    return replace(llm, device=device_string(resolve_device(config.device)))


# ---------------------------------------------------------------------------- stage bookkeeping

class _Runner:
    """Runs the stages in order; each stage folder is an :class:`~robustir.runs.Artifact` whose fingerprint holds
    the stage's settings (operational fields left out), the content of the files it reads from outside the work
    folder, and the finished run of the stage before it."""

    def __init__(self, work: Path, force: set[str]) -> None:
        self.work = work
        self.force = force
        self.upstream = ""  # the previous stage's finished run: redone upstream means redone here
        self.status: dict[str, str] = {}
        self.digests: dict = {}  # the inputs from outside work_dir (corpus, models, eval data): read once a run

    def stage(self, name: str, settings: Any, body: Callable[[Path], dict],
              inputs: dict[str, Any] | None = None) -> dict:
        folder = self.work / name
        made = fingerprint(name, settings, inputs, {"previous stage": self.upstream} if self.upstream else None,
                           cache=self.digests)
        # files over 256 MiB are checked by size only when a run looks again (hashing them would cost more than
        # re-running small stages); every file's SHA-256 is still recorded
        artifact = Artifact(folder, what=f"stage {name}", checksum_limit=256 << 20)
        if name in self.force:
            artifact.clear()
        if artifact.begin(made, on_change="redo"):  # an interrupted stage with the same fingerprint resumes
            logger.info("stage %s: complete, skipped (%s)", name, folder)
            self.status[name] = "skipped"
            report = artifact.report
            self.upstream = _finished(made, report["finished"])
            return report["outputs"]
        folder.mkdir(parents=True, exist_ok=True)
        logger.info("stage %s: running (%s)", name, folder)
        tick = time.perf_counter()
        outputs = body(folder)
        finished = time.time()
        # every file the stage left, with its size and SHA-256: a truncated or edited output (a cut train.jsonl, a
        # damaged model) makes the stage run again instead of feeding the next one (issue 35)
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        artifact.finish({"outputs": outputs, "finished": finished, "seconds": round(time.perf_counter() - tick, 2)},
                        files=files, checksums=True)
        self.status[name] = "ran"
        self.upstream = _finished(made, finished)
        return outputs


def _finished(made: Fingerprint, finished: float) -> str:
    """One finished run of a stage: its fingerprint and when it finished (a stage redone changes what follows)."""
    return hashlib.sha256(json.dumps([made.digest, finished]).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------- stages

def _step(step: Step, options: Any, job: Job) -> Any:
    """Run a stage's :class:`~robustir.runs.Step` inside its stage folder: the folder's record decides whether the
    stage runs at all; the step's own record (next to its file) makes an interrupted stage resume, and only with
    the same settings. Returns the report of the step's run (a file found complete while its folder is not
    recorded is made again, so the report is always the step's own object)."""
    result = execute(step, options, job, on_change="redo", say=None)
    if result.skipped:  # killed between the step's record and the folder's (written last): made again, once
        logger.info("stage file %s is complete but its stage folder was not recorded: making it again",
                    result.artifact.path)
        result = execute(step, options, job, overwrite=True, say=None)
    return result.report


def _corpus_stage(config: PipelineConfig, folder: Path) -> dict:
    """Stream the raw documents (the first ``max_documents``) into a BEIR-style ``corpus.jsonl`` (ids kept, or
    line/block numbers for text)."""
    from .data.documents import read_documents

    source = resolve_data_path(config.corpus)
    target = folder / "corpus.jsonl"
    count = 0
    with atomic_write(target) as handle:
        for doc in read_documents(source, config.corpus_format, text_unit=config.text_unit):
            if config.max_documents is not None and count >= config.max_documents:
                break
            handle.write(json.dumps({"_id": doc.id, "title": doc.title, "text": doc.text}, ensure_ascii=False) + "\n")
            count += 1
    return {"corpus": str(target), "documents": count}


def _chunk_stage(config: PipelineConfig, corpus: dict, folder: Path) -> dict:
    """Split the documents into passages (``doc_id`` names the document each came from)."""
    from .data.chunking import CHUNK

    assert config.chunk is not None
    target = folder / "passages.jsonl"
    stats = _step(CHUNK, config.chunk, Job(str(target), {"input": corpus["corpus"]}, None, {"format": "jsonl"}))
    logger.info("chunk: %d documents -> %d passages", stats.documents, stats.passages)
    return {"corpus": str(target), "documents": stats.documents, "passages": stats.passages}


def _queries_stage(config: PipelineConfig, corpus: dict, folder: Path) -> dict:
    stage = config.queries
    target = folder / "train.jsonl"
    if stage.source == "pairs":
        from .queries.pairs import PAIRS

        raw = folder / "pairs.jsonl"
        stats = _step(PAIRS, stage.pairs, Job(str(raw), {"input": corpus["corpus"]}))
        logger.info("pairs: %d from %d documents", stats.pairs, stats.documents)
    elif stage.source == "generate":
        from dataclasses import replace

        from .queries.generate import run_generate

        raw = folder / "generated.jsonl"
        generate = replace(stage.generate, llm=_llm_on_device(config, stage.generate.llm))
        report = run_generate(generate, corpus["corpus"], raw)
        if report.failed:
            raise ConfigError(f"query generation: {report.failed} passage(s) failed (listed in {report.failed_path}); "
                              "re-run to retry them")
        logger.info("generated queries: %s", report.summary())
    else:
        from .data.training_data import examples_from_beir

        source = resolve_data_path(config.corpus)
        if not (source.is_dir() and (source / "qrels").is_dir()):
            raise ConfigError(f"queries.source beir needs a BEIR folder as corpus, got {config.corpus!r}")
        raw = folder / "beir-train.jsonl"
        with atomic_write(raw) as handle:
            for e in examples_from_beir(source, stage.split):
                handle.write(json.dumps({"query": e.query, "pos": e.pos, "neg": [], **e.extra}, ensure_ascii=False)
                             + "\n")
    total, kept = _sample_records(raw, target, stage.max_examples, stage.seed)
    return {"train": str(target), "examples": kept, "available": total}


def _sample_records(source: Path, target: Path, limit: int | None, seed: int) -> tuple[int, int]:
    """Copy ``source`` to ``target``, or a seeded uniform sample of ``limit`` lines (reservoir, file order kept)."""
    if limit is None:
        with open(source, encoding="utf-8") as handle:
            total = sum(1 for line in handle if line.strip())
        shutil.copyfile(source, target)
        return total, total
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    total = 0
    with open(source, encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            if len(reservoir) < limit:
                reservoir.append((total, line))
            else:
                j = rng.randrange(total + 1)
                if j < limit:
                    reservoir[j] = (total, line)
            total += 1
    with atomic_write(target) as handle:
        handle.writelines(line for _, line in sorted(reservoir))
    return total, len(reservoir)


def _pretrain_stage(config: PipelineConfig, corpus: dict, queries: dict, folder: Path) -> dict:
    from .pretraining.pretrain import PRETRAIN

    settings = _pretrain_settings(config, corpus, queries, folder)
    result = execute(PRETRAIN, settings, Job(str(folder)), say=None).report
    return {"model": str(result.model_path), "heads": str(result.heads_path), "steps": result.steps,
            "last_losses": result.last_losses}


def _pretrain_settings(config: PipelineConfig, corpus: dict, queries: dict, folder: Path) -> PretrainConfig:
    settings = PretrainConfig(**asdict(config.pretrain))
    if not settings.data:  # retromae: the raw documents; gur: the mined LCS pairs
        settings.data = corpus["corpus"] if settings.mode == "retromae" else _gur_pairs(config, queries)
    settings.model = settings.model or config.model
    settings.output = str(folder)
    settings.device = config.stage_device(settings.device)
    return settings


def _gur_pairs(config: PipelineConfig, queries: dict) -> str:
    if config.queries.source == "pairs":  # every mined pair, not only the fine-tuning sample
        return str(Path(queries["train"]).with_name("pairs.jsonl"))
    return queries["train"]


def _mine_stage(config: PipelineConfig, corpus: dict, queries: dict, folder: Path) -> dict:
    from dataclasses import replace

    from .negatives.mining import MINE

    assert config.mine is not None
    mining = replace(config.mine, device=config.stage_device(config.mine.device))
    pool = config.mine_pool
    if pool == "auto":  # sentence pairs compete with sentences; queries for documents with documents
        pool = "file" if config.queries.source == "pairs" else "corpus"
    inputs = {"input": queries["train"], "corpus": corpus["corpus"] if pool == "corpus" else None}
    if mining.method == "dense":
        from .resources import default_model_path

        inputs["model"] = config.model or default_model_path()
    target = folder / "train.jsonl"
    report = _step(MINE, mining, Job(str(target), inputs))
    logger.info("mining done:\n%s", report.format())
    return {"train": str(target), "pool": pool}


def _filter_stage(config: PipelineConfig, mined: dict, folder: Path) -> dict:
    from dataclasses import replace

    assert config.filter is not None
    target = folder / "train.jsonl"
    method = config.filter.method
    if method == "teacher":
        from .filtering.teacher import TEACHER

        teacher = replace(config.filter.teacher, device=config.stage_device(config.filter.teacher.device))
        report = _step(TEACHER, teacher, Job(str(target), {"input": mined["train"]}))  # model None: bundled MiniLM
    elif method == "sieve":
        from .training.sieve import SIEVE

        options = replace(config.filter.sieve, model=config.filter.sieve.model or config.model,
                          work_dir=config.filter.sieve.work_dir or str(folder / "sieve-work"),
                          device=config.stage_device(config.filter.sieve.device))
        report = _step(SIEVE, options, Job(str(target), {"input": mined["train"]}))
    else:
        from .filtering.llm_judge import run_judge

        report = run_judge(replace(config.filter.llm, llm=_llm_on_device(config, config.filter.llm.llm)),
                           mined["train"], target)
        if report.failed_records:  # not done: the next run retries them (as a re-run of the stage does)
            raise ConfigError(f"LLM judge: {report.failed_records} record(s) with failed judgements (listed in "
                              f"{report.failed_path}); re-run to retry them")
    return {"train": str(target), "report": report.summary()}


def _train_settings(config: PipelineConfig, train_data: str, start_model: str | None, folder: Path) -> TrainConfig:
    settings = TrainConfig(**asdict(config.train))
    settings.model = start_model
    settings.train_data = train_data
    settings.output = str(folder)
    if config.mine is not None:
        settings.mine = "none"  # the pipeline mined already
    settings.eval_data = None  # the eval stage evaluates every system the same way
    settings.device = config.stage_device(settings.device)
    return settings


def _evaluate(model_path: str, config: PipelineConfig, data: Path, target: Path) -> dict[str, float]:
    from .evaluation.retrieval import EvalConfig, evaluate

    options = {"query_max_length": config.eval.query_max_length, "passage_max_length": config.eval.passage_max_length}
    result = evaluate(model_path, data, config.eval.split,
                      EvalConfig(batch_size=config.eval.batch_size, precision=config.eval.precision,
                                 device=config.device),
                      **options)
    write_json(target, result.metrics)
    return result.metrics


# ---------------------------------------------------------------------------- driver

def _refuse_inputs_in_stage_folders(config: PipelineConfig) -> None:
    """The runner deletes and rewrites its stage folders (``work_dir/<stage>``): an input kept there would be lost
    or overwritten (a corpus at ``work_dir/corpus/corpus.jsonl`` is the corpus stage's own output)."""
    work = Path(config.work_dir).expanduser().resolve()
    for key, value in (("corpus", config.corpus), ("model", config.model), ("eval.data", config.eval.data)):
        if not value or not Path(value).expanduser().exists():
            continue
        path = Path(value).expanduser().resolve()
        folder = next((work / s for s in STAGES if path == work / s or work / s in path.parents), None)
        if folder is not None:
            raise ConfigError(f"{key} {value} lies in the stage folder {folder}, which the runner deletes and "
                              "rewrites: move it out of work_dir (or choose another work_dir)")


def run_pipeline(config: PipelineConfig, force: list[str] | None = None, until: str | None = None) -> PipelineResult:
    """Run every stage of ``config`` not yet complete in ``config.work_dir``; return the comparison table.

    ``force``: stage names to redo even when complete (later stages follow, their inputs having changed).
    ``until``: the last stage to run (``"filter"``: build the training data and stop); the result then has no
    metrics and ``model_path`` is the last stage's main output.
    """
    unknown = set(force or ()) - set(STAGES)
    if unknown:
        raise ConfigError(f"--force: unknown stage(s) {sorted(unknown)}; stages: {', '.join(STAGES)}")
    if until is not None and until not in STAGES:
        raise ConfigError(f"--until {until!r}: unknown stage; stages: {', '.join(STAGES)}")
    started = time.perf_counter()
    work = Path(config.work_dir)
    _refuse_inputs_in_stage_folders(config)
    work.mkdir(parents=True, exist_ok=True)
    lock = try_lock(work / "run.lock")  # two runs on one work dir would write the same stage folders
    if lock is None:
        raise ConfigError(f"{work} is being used by another robustir run: wait for it to finish, or give this run "
                          "another work_dir")
    try:
        return _run_locked(config, work, force, until, started)
    finally:
        os.close(lock)


def _run_locked(config: PipelineConfig, work: Path, force: list[str] | None, until: str | None,
                started: float) -> PipelineResult:
    from .evaluation.metrics import format_table
    from .resources import default_model_path

    write_json(work / "pipeline_config.json", settings_of(asdict(config)))
    base_model = config.model or default_model_path()
    runner = _Runner(work, set(force or ()))

    def stop_after(name: str, output: str) -> PipelineResult | None:
        if until != name:
            return None
        for later in STAGES[STAGES.index(name) + 1:]:
            runner.status[later] = "not run (--until)"
        write_json(work / "results.json", {"stages": runner.status, "until": until, "output": output})
        return PipelineResult(runner.status, {}, "", Path(output), time.perf_counter() - started)

    corpus = runner.stage("corpus", {"format": config.corpus_format, "text_unit": config.text_unit,
                                     "max_documents": config.max_documents},
                          lambda f: _corpus_stage(config, f), inputs={"corpus": resolve_data_path(config.corpus)})
    if (done := stop_after("corpus", corpus["corpus"])) is not None:
        return done
    passages = corpus
    if config.chunk is not None:
        passages = runner.stage("chunk", config.chunk, lambda f: _chunk_stage(config, corpus, f))
    else:
        runner.status["chunk"] = "off"
    if (done := stop_after("chunk", passages["corpus"])) is not None:
        return done
    queries = runner.stage("queries", config.queries, lambda f: _queries_stage(config, passages, f),
                           inputs={"beir corpus": resolve_data_path(config.corpus)}
                           if config.queries.source == "beir" else None)
    if (done := stop_after("queries", queries["train"])) is not None:
        return done

    pretrained_model: str | None = None
    if config.pretrain is not None:
        settings = _pretrain_settings(config, passages, queries, work / "pretrain")
        pretrained = runner.stage("pretrain", settings, lambda f: _pretrain_stage(config, passages, queries, f),
                                  inputs={"model": settings.model or default_model_path()})
        pretrained_model = pretrained["model"]
    else:
        runner.status["pretrain"] = "off"
    if (done := stop_after("pretrain", pretrained_model or queries["train"])) is not None:
        return done

    train_data = queries["train"]
    if config.mine is not None:
        mined = runner.stage("mine", {"mining": config.mine, "pool": config.mine_pool},
                             lambda f: _mine_stage(config, passages, queries, f),
                             inputs={"model": base_model} if config.mine.method == "dense" else None)
        train_data = mined["train"]
    else:
        runner.status["mine"] = "off"
    if (done := stop_after("mine", train_data)) is not None:
        return done
    if config.filter is not None:
        source = {"train": train_data}
        chosen = {"method": config.filter.method, config.filter.method: getattr(config.filter, config.filter.method)}
        filtered = runner.stage("filter", chosen, lambda f: _filter_stage(config, source, f))
        train_data = filtered["train"]
    else:
        runner.status["filter"] = "off"
    if (done := stop_after("filter", train_data)) is not None:
        return done

    start_model = pretrained_model or config.model
    train_settings = _train_settings(config, train_data, start_model, work / "train")

    def train_body(folder: Path) -> dict:
        from .training.trainer import TRAIN

        result = execute(TRAIN, _train_settings(config, train_data, start_model, folder), Job(str(folder)),
                         say=None).report
        return {"model": str(result.model_path), "steps": result.steps}

    trained = runner.stage("train", train_settings, train_body,
                           inputs={"model": None if pretrained_model else (start_model or base_model),
                                   "audit": train_settings.audit})
    if (done := stop_after("train", trained["model"])) is not None:
        return done

    eval_data = resolve_data_path(config.eval.data) if config.eval.data else resolve_data_path(config.corpus)
    if not (eval_data.is_dir() and (eval_data / "qrels").is_dir()):
        raise ConfigError(f"eval.data: {eval_data} is not a BEIR folder; set eval.data (e.g. bundled:scifact)")
    systems = {"finetuned": trained["model"]}
    if config.eval.base:
        systems = {"base": base_model, **systems}
    if pretrained_model and config.eval.pretrained:
        systems = {**{k: v for k, v in systems.items() if k == "base"}, "pretrained": pretrained_model,
                   "finetuned": trained["model"]}

    def eval_body(folder: Path) -> dict:
        metrics = {}
        for name, path in systems.items():
            cached = folder / f"{name}.json"  # an interrupted eval keeps the systems already done
            metrics[name] = json.loads(cached.read_text()) if cached.exists() else \
                _evaluate(path, config, eval_data, cached)
        return {"metrics": metrics}

    evaluated = runner.stage("eval", {"eval": config.eval, "systems": systems}, eval_body,
                             inputs={"eval data": eval_data, "base model": base_model if config.eval.base else None})
    metrics = evaluated["metrics"]
    table = format_table(metrics, title=f"{eval_data.name} / {config.eval.split}")
    (work / "results.md").write_text("```\n" + table + "\n```\n", encoding="utf-8")
    write_json(work / "results.json", {"metrics": metrics, "stages": runner.status,
                                       "model": trained["model"]})
    return PipelineResult(runner.status, metrics, table, Path(trained["model"]), time.perf_counter() - started)
