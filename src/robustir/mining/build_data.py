"""Training-data construction in one go: chunk -> generate (LLM) or pairs (LCS) -> mine -> filter.

Every stage writes into ``work_dir`` and is **skipped when its output is already complete** (the completion
rules of :mod:`robustir.mining.merge`), so re-running the same config resumes after the last finished stage --
and each stage itself resumes mid-way. Once a stage runs, every later stage is redone (its input changed). Files::

    work_dir/documents.jsonl        first ``max_documents`` documents (only when that is set)
    work_dir/passages.jsonl         chunk output (BEIR corpus: _id, title, text, doc_id)
    work_dir/queries.jsonl          generate or pairs output (query/pos, no negatives yet)
    work_dir/mined.jsonl            + hard negatives (+ .report.json)
    work_dir/filtered-<method>.jsonl  false negatives removed (+ .report.json); absent with filter.method none
    work_dir/build-data.json        the config used and, per stage, whether it ran or was skipped

A stage's settings are saved next to its output (``<output>.settings.json``); when a complete output was made
with different settings a warning says so and the output is still reused -- delete it (or use another
``work_dir``) to redo that stage and the ones after it.

Mining candidates (``mine.corpus: auto``): for generated queries the passages (negatives are other passages);
for GUR pairs the pool of all pair sentences in the file (negatives are sentences like the positives).

Example: ``configs/build-data-example.yaml``.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Literal

from ..errors import ConfigError
from ..io import atomic_write, write_json
from .llm import LLMConfig
from .llm_judge import JudgeConfig
from .merge import output_complete
from .pairs import PairMiningConfig
from .sieve import SieveConfig
from .teacher_filter import TeacherFilterConfig

logger = logging.getLogger(__name__)

__all__ = ["BuildDataConfig", "ChunkStage", "QueryStage", "MineStage", "FilterStage", "StageResult", "build_data"]


@dataclass
class ChunkStage:
    enabled: bool = True
    """False: the input is already passages (JSONL with _id, title, text)."""
    max_tokens: int = 256
    overlap: int = 1
    min_tokens: int = 32
    tokenizer: str | None = None


@dataclass
class QueryStage:
    method: Literal["pairs", "generate"] = "pairs"
    """``pairs``: GUR sentence pairs by weighted LCS (no LLM); ``generate``: LLM-written queries (PEG)."""
    pairs: PairMiningConfig = field(default_factory=PairMiningConfig)
    num_queries: int = 3
    """generate: questions per passage."""
    prompt_template: str | None = None
    llm: LLMConfig = field(default_factory=LLMConfig)


@dataclass
class MineStage:
    method: Literal["bm25", "dense"] = "bm25"
    corpus: Literal["auto", "passages", "pool"] = "auto"
    num_negatives: int = 15
    range_min: int = 0
    range_max: int = 100
    absolute_margin: float | None = None
    relative_margin: float | None = None
    sampling: Literal["top", "random"] = "top"
    seed: int = 42
    model: str | None = None
    """dense: the mining model (None = the bundled MiniLM)."""
    bf16: bool = False
    batch_size: int = 64
    cache_dir: str | None = None


@dataclass
class FilterStage:
    method: Literal["none", "llm", "teacher", "sieve"] = "teacher"
    teacher: TeacherFilterConfig = field(default_factory=TeacherFilterConfig)
    sieve: SieveConfig = field(default_factory=SieveConfig)
    llm: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class BuildDataConfig:
    """``robustir build-data --config FILE [key=value ...]``; see ``configs/build-data-example.yaml``."""

    input: str = ""
    """Raw documents: JSONL (_id, title, text), a BEIR folder (its corpus.jsonl) or plain text."""
    format: Literal["auto", "jsonl", "text", "beir"] = "auto"
    text_unit: Literal["block", "line"] = "block"
    max_documents: int | None = None
    """Use only the first N documents (quick runs)."""
    work_dir: str = "runs/build-data"
    output: str | None = None
    """Also copy the final training JSONL here."""
    chunk: ChunkStage = field(default_factory=ChunkStage)
    queries: QueryStage = field(default_factory=QueryStage)
    mine: MineStage = field(default_factory=MineStage)
    filter: FilterStage = field(default_factory=FilterStage)
    progress: bool = True


@dataclass
class StageResult:
    name: str
    output: str
    skipped: bool
    seconds: float = 0.0
    summary: str = ""


def _stage(name: str, output: Path, need_report: bool, settings: dict, work: Callable[[], str],
           results: list[StageResult]) -> Path:
    """Run ``work`` unless ``output`` is complete; record what happened.

    A stage after one that ran is redone even when complete: its input has just been rewritten.
    """
    settings_path = output.with_name(output.name + ".settings.json")
    if any(not r.skipped for r in results):
        for suffix in ("", ".partial", ".done", ".report.json", ".failed.jsonl"):
            output.with_name(output.name + suffix).unlink(missing_ok=True)
    if output_complete(output, need_report):
        if settings_path.exists() and json.loads(settings_path.read_text(encoding="utf-8")) != settings:
            logger.warning("%s: %s is complete but was made with other settings; reusing it (delete it to redo "
                           "this stage and the following ones)", name, output)
        logger.info("%s: %s is complete, skipped", name, output)
        results.append(StageResult(name, str(output), True))
        return output
    started = time.perf_counter()
    write_json(settings_path, settings)
    summary = work()
    results.append(StageResult(name, str(output), False, round(time.perf_counter() - started, 2), summary))
    logger.info("%s: %s", name, summary)
    return output


def build_data(config: BuildDataConfig) -> tuple[Path, list[StageResult]]:
    """Run the pipeline of ``config``; returns the final training JSONL and what each stage did."""
    if not config.input:
        raise ConfigError("build-data: 'input' is required (raw documents: JSONL, BEIR folder or text)")
    work = Path(config.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    results: list[StageResult] = []
    documents: Path | str = config.input
    fmt: str = config.format

    if config.max_documents is not None:
        documents = _stage("select", work / "documents.jsonl", False,
                           {"input": config.input, "max_documents": config.max_documents},
                           lambda: _first_documents(config, work / "documents.jsonl"), results)
        fmt = "jsonl"

    if config.chunk.enabled:
        from ..data.chunking import chunk_corpus

        passages = work / "passages.jsonl"

        def chunk() -> str:
            stats = chunk_corpus(documents, passages, fmt=fmt, text_unit=config.text_unit,
                                 tokenizer=config.chunk.tokenizer, max_tokens=config.chunk.max_tokens,
                                 overlap_sentences=config.chunk.overlap, min_tokens=config.chunk.min_tokens)
            return f"{stats.documents} documents -> {stats.passages} passages"

        _stage("chunk", passages, False, {"input": str(documents), **asdict(config.chunk)}, chunk, results)
    else:
        from ..data.documents import resolve_format

        passages, _ = resolve_format(documents, fmt)

    queries = work / "queries.jsonl"
    if config.queries.method == "pairs":
        from .pairs import mine_pairs

        def pairs() -> str:
            stats = mine_pairs(passages, queries, config.queries.pairs, fmt="jsonl")
            return f"{stats.documents} passages -> {stats.pairs} pairs"

        _stage("pairs", queries, False, {"input": str(passages), **asdict(config.queries.pairs)}, pairs, results)
    else:
        def generate() -> str:
            from .generate import generate_queries, load_template
            from .llm import LLMClient, build_backend

            template = (load_template(config.queries.prompt_template, ("text",))
                        if config.queries.prompt_template else None)
            backend = build_backend(config.queries.llm, cache_path=work / "queries.jsonl.llm-cache.sqlite")
            with backend:
                if isinstance(backend, LLMClient):
                    backend.preflight()
                report = generate_queries(passages, queries, backend, num_queries=config.queries.num_queries,
                                          template=template, progress=config.progress)
            if report.failed:
                raise ConfigError(f"generate: {report.failed} passage(s) failed (listed in {report.failed_path}); "
                                  "re-run build-data to retry them")
            return report.summary()

        _stage("generate", queries, True, {"input": str(passages), "num_queries": config.queries.num_queries,
                                           "template": config.queries.prompt_template,
                                           "llm": {"model": config.queries.llm.model,
                                                   "base_url": config.queries.llm.base_url}}, generate, results)

    mined = work / "mined.jsonl"
    m = config.mine
    use_passages = m.corpus == "passages" or (m.corpus == "auto" and config.queries.method == "generate")

    def mine() -> str:
        from .negatives import MiningConfig, mine_jsonl

        mining = MiningConfig(method=m.method, num_negatives=m.num_negatives, range_min=m.range_min,
                              range_max=m.range_max, absolute_margin=m.absolute_margin,
                              relative_margin=m.relative_margin, sampling=m.sampling, seed=m.seed,
                              encode_batch_size=m.batch_size, bf16=m.bf16, cache_dir=m.cache_dir)
        encoder = None
        if m.method == "dense":
            from ..models.encoder import Encoder
            from ..resources import default_model_path

            encoder = Encoder.from_pretrained(m.model or default_model_path())
        report = mine_jsonl(queries, mined, mining, encoder, corpus=passages if use_passages else None)
        return report.format().replace("\n", "; ")

    _stage("mine", mined, True, {"input": str(queries), "corpus": "passages" if use_passages else "pool",
                                 **asdict(m)}, mine, results)

    final = mined
    f = config.filter
    if f.method != "none":
        filtered = work / f"filtered-{f.method}.jsonl"
        options = {"teacher": f.teacher, "sieve": f.sieve, "llm": f.llm}[f.method]

        def run_filter() -> str:
            for stale in (filtered, filtered.with_name(filtered.name + ".report.json")):
                if stale.exists():  # an incomplete earlier run left a final file without report: redo
                    stale.unlink()
            if f.method == "teacher":
                from .teacher_filter import teacher_filter

                return teacher_filter(mined, filtered, f.teacher).summary()
            if f.method == "sieve":
                from .sieve import sieve_negatives

                if f.sieve.work_dir is None:
                    f.sieve.work_dir = str(work / "sieve-work")
                return sieve_negatives(mined, filtered, f.sieve).summary()
            from .llm import build_backend
            from .llm_judge import judge_negatives

            backend = build_backend(f.llm.llm, cache_path=filtered.with_name(filtered.name + ".llm-cache.sqlite"))
            with backend:
                return judge_negatives(mined, filtered, backend, keep_removed=f.llm.keep_removed,
                                       progress=config.progress).summary()

        final = _stage(f"filter ({f.method})", filtered, True, {"input": str(mined), **asdict(options)},
                       run_filter, results)

    if config.output:
        target = Path(config.output)
        with atomic_write(target, "wb", encoding=None) as handle, open(final, "rb") as src:
            shutil.copyfileobj(src, handle)
        final = target
    write_json(work / "build-data.json", {"config": asdict(config), "final": str(final),
                                          "stages": [asdict(r) for r in results]})
    return final, results


def _first_documents(config: BuildDataConfig, output: Path) -> str:
    from ..data.documents import read_documents

    count = 0
    with atomic_write(output) as handle:
        for doc in read_documents(config.input, config.format, text_unit=config.text_unit):
            if count >= (config.max_documents or 0):
                break
            handle.write(json.dumps({"_id": doc.id, "title": doc.title, "text": doc.text}, ensure_ascii=False) + "\n")
            count += 1
    return f"{count} documents"
