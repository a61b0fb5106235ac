"""PEG false-negative removal: ask an LLM whether each hard negative is relevant to its query; drop those it is.

PEG (§Data construction): "we further employ a LLM to determine the relevance between the query and each hard
negative. If any negative sample is related to the query, it will be removed to avoid false negatives."

input  — training JSONL with ``query``, ``pos`` and ``neg`` (FlagEmbedding format, e.g. the output of
``robustir mine``); other fields are kept, and list fields named ``neg_*`` as long as ``neg`` (e.g. ``neg_scores``)
are filtered along with it.
output — a NEW JSONL (the input is never overwritten) with the kept negatives and, optionally, a ``removed`` list
``[{"text": ..., "reason": "llm_judge"}]``; plus ``OUT.report.json``.

One yes/no request per (query, negative), through the shared client, cache and resumable writer. Replies that
are neither yes nor no (or failed requests under ``on_failure: skip``) are *undecidable*: the negative is kept
and counted. A negative identical to one of the record's positives is removed without asking (reason
``equals_positive``): it is a false negative by construction.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from tqdm.auto import tqdm

from ..errors import ConfigError, DataError
from ..io import ResumableJsonlWriter, Shard, read_jsonl, write_json
from ..outputs import StageOutput
from ..data.cjk import cjk_share
from ..data.training_data import check_record
from ..llm import LLMBackend, LLMConfig, LLMStageConfig, render_template, stage_backend, strip_reasoning

logger = logging.getLogger(__name__)

DEFAULT_JUDGE_TEMPLATE_EN = """\
Decide whether the passage answers the search query or contains information relevant to it.

Query: {query}
Passage: {passage}

Is the passage relevant to the query? Answer with one word: yes or no.
"""

DEFAULT_JUDGE_TEMPLATE_ZH = """\
判断下面的文本是否能回答查询，或包含与查询相关的信息。

查询：{query}
文本：{passage}

该文本与查询相关吗？只回答一个字：是 或 否。
"""

REASON_LLM = "llm_judge"
REASON_EQUALS_POSITIVE = "equals_positive"
UNDECIDABLE = "undecidable"

_LEAD = re.compile(r"^[\s\"'“”‘’*`#>\[\](（）【】:：-]+")
_LABEL = re.compile(r"^(?:final answer|answer|judgement|judgment|verdict|relevance|relevant\?|response|output|"
                    r"最终答案|答案|回答|结论|判断|判定)\s*[:：]?\s*", re.I)
_YES_WORDS = {"yes", "y", "true", "relevant", "related", "correct"}
_NO_WORDS = {"no", "n", "false", "irrelevant", "unrelated", "not", "none", "incorrect"}
_ZH_NO_PREFIX = ("不是", "不相关", "无关", "不能", "不可以", "没有", "否", "不")
_ZH_YES_PREFIX = ("是", "相关", "有关", "能", "可以", "对")
_NEG_ANYWHERE = re.compile(
    r"\b(?:not|never|isn't|doesn't|cannot|can't)\s+(?:\w+\s+){0,3}?(?:relevant|related)\b"  # "not relevant"
    r"|\b(?:no|not|irrelevant|unrelated|false)\b|不相关|无关|不能回答|不是|否", re.I)
_UNSURE = re.compile(r"\b(?:not sure|unsure|uncertain|cannot tell|can't tell|hard to say|unclear)\b|不确定|无法判断|难以判断",
                     re.I)
_POS_ANYWHERE = re.compile(r"\b(?:yes|relevant|related|true)\b|相关", re.I)


def parse_yes_no(reply: str | None) -> bool | None:
    """``True`` for yes/relevant (是/相关), ``False`` for no/not relevant (否/不相关), ``None`` when undecidable.

    The first word decides when it is a yes/no word (after quotes, markdown and labels such as "Answer:");
    otherwise the reply counts only if it contains words of exactly one polarity.
    """
    if not reply:
        return None
    text = strip_reasoning(reply)
    text = _LEAD.sub("", text)
    text = _LABEL.sub("", text)
    text = _LEAD.sub("", text).casefold()
    if not text:
        return None
    if text.startswith(_ZH_NO_PREFIX):
        return False
    if text.startswith(_ZH_YES_PREFIX):
        return True
    first = re.match(r"[a-z']+", text)
    if first:
        if first.group() in _YES_WORDS:
            return True
        if first.group() in _NO_WORDS:
            return False
    if _UNSURE.search(text):
        return None
    has_no = _NEG_ANYWHERE.search(text) is not None
    has_yes = _POS_ANYWHERE.search(_NEG_ANYWHERE.sub(" ", text)) is not None  # "not relevant" is not a yes
    if has_yes != has_no:
        return has_yes
    return None


@dataclass
class JudgeConfig(LLMStageConfig):
    """Arguments of the LLM judge (``robustir filter --method llm``, the runner's ``filter.llm``): the common
    LLM-stage options (input training JSONL; templates with ``{query}``, ``{passage}``, optional
    ``{positive}``) plus these."""

    keep_removed: bool = True
    """Keep what was removed in the record's ``removed`` list (with the reason)."""
    llm: LLMConfig = field(default_factory=lambda: LLMConfig(temperature=0.0, max_tokens=16))
    """The endpoint; a yes/no judge by default (temperature 0, 16 tokens)."""


@dataclass
class JudgeReport:
    """Counts of one judge run (``resumed`` records were written by an earlier run and are not counted again)."""

    output: str
    records: int = 0
    resumed: int = 0
    records_judged: int = 0
    negatives_judged: int = 0
    removed: int = 0
    removed_equal_positive: int = 0
    kept: int = 0
    undecidable: int = 0
    failed: int = 0
    queries_with_removals: int = 0
    removed_per_query: dict = field(default_factory=dict)
    """Histogram: number of negatives removed from a query -> number of queries."""
    llm: dict = field(default_factory=dict)
    elapsed_s: float = 0.0

    def summary(self) -> str:
        return (f"{self.records_judged} records ({self.resumed} earlier), {self.negatives_judged} negatives "
                f"judged, {self.removed} removed by the LLM, {self.removed_equal_positive} equal to a positive, "
                f"{self.undecidable} undecidable (kept; {self.failed} failed requests), "
                f"{self.llm.get('cache_hits', 0)} cache hits -> {self.output}")


@dataclass
class _Pending:
    record: dict
    negatives: list[str]
    verdicts: list[bool | str | None]  # True/False/UNDECIDABLE from the LLM, a rule's reason, None = not yet
    waiting: int  # requests still in flight for this record


def judge_negatives(input_path: str | Path, output_path: str | Path, client: LLMBackend, *,
                    template: str | None = None, template_zh: str | None = None, language: str = "auto",
                    cjk_threshold: float = 0.3, max_passage_chars: int = 4000, keep_removed: bool = True,
                    shard: Shard = Shard(), overwrite: bool = False, progress: bool = True,
                    report_path: str | Path | None = None) -> JudgeReport:
    """Remove the negatives ``client`` judges relevant to their query; write ``output_path`` and a report JSON.

    Resuming: records are written in input order, so a re-run skips as many (owned) records as the partial
    output already holds — re-run with the same input and shard. ``overwrite`` starts afresh.
    """
    input_path, output = Path(input_path), Path(output_path)
    if not input_path.exists():
        raise DataError(input_path, "file not found", fix="give a training JSONL with query/pos/neg")
    if output.resolve() == input_path.resolve():
        raise ConfigError(f"output {output} is the input file; the judge never overwrites its input, choose a new file")
    if language not in ("auto", "en", "zh"):
        raise ConfigError(f"language must be auto, en or zh, got {language!r}")
    started = time.monotonic()
    if overwrite:
        StageOutput(output).clear()
    else:
        StageOutput(output).reopen()  # a finished output is continued (failures retried, new records appended)
    report = JudgeReport(output=str(output))
    writer = ResumableJsonlWriter(output, key_field=None)
    already = writer.count
    histogram: Counter[int] = Counter()
    pending: deque[_Pending] = deque()  # records in input order, waiting for their verdicts
    slots: deque[tuple[_Pending, int]] = deque()  # (record, negative index) of each request, in stream order
    bar = tqdm(desc="judge", unit="record", disable=not progress, dynamic_ncols=True, mininterval=1.0)

    def pick_template(query: str, negative: str) -> str:
        if template is not None:
            return template
        zh = language == "zh" or (language == "auto" and cjk_share(query + negative) >= cjk_threshold)
        return (template_zh or DEFAULT_JUDGE_TEMPLATE_ZH) if zh else DEFAULT_JUDGE_TEMPLATE_EN

    def flush_ready() -> None:
        while pending and pending[0].waiting == 0:
            item = pending.popleft()
            writer.write(_finish_record(item, keep_removed, report, histogram))
            bar.update(1)

    def prompts() -> Iterator[str]:
        # Pulled lazily by the backend's stream: only a window of records is held in memory.
        owned = 0
        for line, record in shard.select(read_jsonl(input_path)):
            report.records += 1
            owned += 1
            if owned <= already:
                report.resumed += 1
                continue
            query, pos, neg = check_record(record, input_path, line)
            positives = {p.strip() for p in pos}
            item = _Pending(record, neg, [None] * len(neg), 0)
            jobs = []
            for i, negative in enumerate(neg):
                if negative.strip() in positives:
                    item.verdicts[i] = REASON_EQUALS_POSITIVE
                    continue
                jobs.append((i, render_template(pick_template(query, negative), {
                    "query": query.strip(), "passage": negative.strip()[:max_passage_chars],
                    "positive": (pos[0].strip()[:max_passage_chars] if pos else "")})))
            item.waiting = len(jobs)
            pending.append(item)
            flush_ready()  # a record with nothing to ask is written as soon as it reaches the head
            for i, prompt in jobs:
                slots.append((item, i))
                yield prompt

    finished = False
    try:
        for completion in client.stream(prompts()):
            item, index = slots.popleft()
            verdict = parse_yes_no(completion.text) if completion.ok else None
            item.verdicts[index] = UNDECIDABLE if verdict is None else verdict
            report.negatives_judged += 1
            if not completion.ok:
                report.failed += 1
            item.waiting -= 1
            flush_ready()
        flush_ready()
        finished = True
    finally:
        bar.close()
        if finished:
            writer.finish()
        else:
            writer.close()
        report.removed_per_query = {str(k): histogram[k] for k in sorted(histogram)}
        report.llm = client.stats.as_dict()
        report.elapsed_s = round(time.monotonic() - started, 3)
        if finished:
            write_json(report_path or StageOutput(output).report, asdict(report))
    logger.info("llm judge: %s", report.summary())
    return report


def run_judge(config: JudgeConfig, input_path: str | Path | None = None,
              output_path: str | Path | None = None) -> JudgeReport:
    """The LLM-judge stage from its config: ``(config, input, output) -> report``.

    ``input_path`` / ``output_path`` override ``config.input`` / ``config.output``; the output gets the shard
    suffix of ``config.shard``. Templates (``{query}``, ``{passage}``) are loaded and checked, the backend is
    built with its reply cache and, for an HTTP endpoint with ``preflight``, checked before the first request.
    ``robustir filter --method llm`` and ``robustir run`` both call this.
    """
    source = input_path if input_path is not None else config.input
    target = output_path if output_path is not None else config.output
    if not source or not target:
        raise ConfigError("llm judge: give the input training JSONL and the output file (input: / output:)")
    if not config.llm.model:
        raise ConfigError("llm judge: llm.model is empty; give the model name the server serves (and llm.base_url)")
    stage = StageOutput(target, config.shard, reports=True)
    shard, output = stage.shard, stage.path
    template, template_zh = config.templates(("query", "passage"))
    with stage_backend(config, output) as backend:
        return judge_negatives(source, output, backend, template=template, template_zh=template_zh,
                               language=config.language, cjk_threshold=config.cjk_threshold,
                               max_passage_chars=config.max_passage_chars, keep_removed=config.keep_removed,
                               shard=shard, overwrite=config.overwrite, progress=config.progress)


def _finish_record(item: _Pending, keep_removed: bool, report: JudgeReport, histogram: Counter) -> dict:
    record = dict(item.record)
    keep_mask: list[bool] = []
    removed: list[dict] = []
    for negative, verdict in zip(item.negatives, item.verdicts):
        if verdict is True:
            removed.append({"text": negative, "reason": REASON_LLM})
            report.removed += 1
            keep_mask.append(False)
        elif verdict == REASON_EQUALS_POSITIVE:
            removed.append({"text": negative, "reason": REASON_EQUALS_POSITIVE})
            report.removed_equal_positive += 1
            keep_mask.append(False)
        else:
            if verdict == UNDECIDABLE:
                report.undecidable += 1
            keep_mask.append(True)
            report.kept += 1
    n = len(item.negatives)
    record["neg"] = [neg for neg, keep in zip(item.negatives, keep_mask) if keep]
    for key, value in item.record.items():  # keep aligned per-negative fields (neg_scores, neg_ids, ...) aligned
        if key.startswith("neg_") and isinstance(value, list) and len(value) == n:
            record[key] = [v for v, keep in zip(value, keep_mask) if keep]
    if keep_removed:
        earlier = item.record.get("removed")  # a previous filter pass may have listed removals already
        record["removed"] = (earlier if isinstance(earlier, list) else []) + removed
    histogram[len(removed)] += 1
    report.records_judged += 1
    if removed:
        report.queries_with_removals += 1
    return record
