"""PEG false-negative removal: ask an LLM whether each hard negative is relevant to its query; drop those it is.

PEG (§Data construction): "we further employ a LLM to determine the relevance between the query and each hard
negative. If any negative sample is related to the query, it will be removed to avoid false negatives."

input  — training JSONL with ``query``, ``pos`` and ``neg`` (FlagEmbedding format, e.g. the output of
``robustir mine``); other fields are kept, and list fields named ``neg_*`` as long as ``neg`` (e.g. ``neg_scores``)
are filtered along with it.
output — a NEW JSONL (the input is never overwritten) with the kept negatives and, optionally, a ``removed`` list
``[{"text": ..., "reason": "llm_judge"}]``; plus ``OUT.report.json``.

One yes/no request per (query, negative), through the shared client, cache and resumable writer. A judgement
*fails* when its request failed (``on_failure: skip``) or the reply is neither yes nor no (reason ``unparseable
reply``: "Maybe", an essay without a verdict; never guessed, and its cached reply is dropped). The negative is
then kept for now, the record is listed in ``OUT.failed.jsonl`` and the next run judges it again: a re-run over a
finished ``OUT`` copies the other records from it into ``OUT.partial`` and replaces ``OUT`` atomically only when
it finishes, so a failing re-run leaves ``OUT`` as it was. When more than ``max_failure_rate`` of the judgements
failed the stage raises instead of finishing. A negative identical to one of the record's positives is removed
without asking (reason ``equals_positive``): it is a false negative by construction.

**Positives too** (``positives: true``, ``--judge-positives``; issue 50): PEG's judge asks only about negatives, but
generated and mined data also has *false positives* -- a too-generic generated query, a near-miss passage given as
the answer. With this option every positive is asked the same question; one judged not relevant leaves ``pos``
(listed in ``removed`` with ``"positive": true``, reason ``llm_judge_positive``). When a record loses every positive
and some of its negatives were judged relevant, those negatives become its positives (``promote``, reason
``promoted``: the label is corrected, not dropped -- removal alone cannot beat a perfect filter's loss of training
signal); otherwise the record is kept as ``"pos": []``, which training skips and later filters pass on.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterator

from tqdm.auto import tqdm

from ..errors import ConfigError, DataError
from ..io import ResumableJsonlWriter, Shard, read_jsonl, write_json
from ..outputs import StageOutput
from ..data.cjk import cjk_share
from ..data.training_data import check_record
from ..validation import cli, NonNegativeInt, Range, config_dataclass
from ..llm import (FailureTally, LLMBackend, LLMConfig, LLMStageConfig, endpoint_of, llm_step, run_llm_step,
                   render_template, stage_backend, strip_reasoning, write_failed_items)

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
FAILED_REQUEST = "request failed"
FAILED_UNPARSEABLE = "unparseable reply"

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
_UNSURE = re.compile(r"\b(?:not sure|unsure|uncertain|cannot tell|can't tell|hard to say|unclear|maybe|perhaps|"
                     r"possibly|probably|partially|partly|somewhat|depends)\b|不确定|无法判断|难以判断|可能|也许|部分",
                     re.I)
# a reply longer than this (words) is an essay: only an explicit verdict at its end counts
_ESSAY_WORDS = 20
_VERDICT_AT_END = re.compile(r"(?:final\s+answer|answer|verdict|judge?ment|conclusion|relevance|relevant\?|最终答案|答案|"
                             r"结论|判断)\s*(?:is\s*)?[:：]?\s*[*\"'“”]*\s*(yes|no|是|否|relevant|not\s+relevant|"
                             r"irrelevant|相关|不相关)[*\"'“”.。!！\s]*$", re.I)
_POS_ANYWHERE = re.compile(r"\b(?:yes|relevant|related|true)\b|相关", re.I)


def parse_yes_no(reply: str | None) -> bool | None:
    """``True`` for yes/relevant (是/相关), ``False`` for no/not relevant (否/不相关), ``None`` when undecidable.

    The first word decides when it is a yes/no word (after quotes, markdown and labels such as "Answer:");
    otherwise a short reply (up to 20 words) counts only if it contains words of exactly one polarity and no
    hedge ("maybe", "probably", "not sure", 可能); a longer one (an essay) only with an explicit verdict at its end
    ("... Answer: yes"). Anything else is ``None``: the judge counts it as a failed judgement (``unparseable
    reply``), never as a guess.
    """
    if not reply:
        return None
    text = strip_reasoning(reply)
    text = _LEAD.sub("", text)
    text = _LABEL.sub("", text)
    text = _LEAD.sub("", text).casefold()
    if not text:
        return None
    if len(text.split()) > _ESSAY_WORDS or len(text) > 12 * _ESSAY_WORDS:
        first = re.match(r"(yes|no)\s*(?:[,.!:;\n]|$)", text)
        if first:
            return first.group(1) == "yes"  # "No, because <explanation>"
        verdict = _VERDICT_AT_END.search(text)
        if verdict is None:
            return None
        word = verdict.group(1)
        return word in ("yes", "是", "relevant", "相关")
    if text.startswith(_ZH_NO_PREFIX):
        return False
    if text.startswith(_ZH_YES_PREFIX):
        return True
    if _UNSURE.match(text):  # "Not sure", "Maybe yes": a hedge is no verdict
        return None
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


@config_dataclass
class JudgeLLMConfig(LLMConfig):
    """The judge's endpoint: a yes/no judge by default (temperature 0, 16 reply tokens)."""

    temperature: Annotated[float, Range(ge=0, le=2)] = 0.0
    """Sampling temperature (0: greedy, the same verdict on every run)."""
    max_tokens: NonNegativeInt = 16
    """Reply length limit (a verdict is a word or two); 0 sends none."""


@config_dataclass
class JudgeConfig(LLMStageConfig):
    """Arguments of the LLM judge (``robustir filter --method llm``, the runner's ``filter.llm``): the common
    LLM-stage options (input training JSONL; templates with ``{query}``, ``{passage}``, optional
    ``{positive}``) plus these."""

    keep_removed: Annotated[bool, cli("removed")] = True
    """Keep what was removed in the record's ``removed`` list (with the reason)."""
    positives: Annotated[bool, cli("judge-positives")] = False
    """Also ask whether each positive answers its query; one judged not relevant is removed (false positive)."""
    promote: bool = True
    """With ``positives``: a record whose every positive was judged not relevant takes its negatives judged relevant
    as positives (label correction) instead of being left without a positive."""
    llm: Annotated[JudgeLLMConfig, cli(flatten=True)] = field(default_factory=JudgeLLMConfig)
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
    positives_judged: int = 0
    positives_removed: int = 0
    """Positives judged not relevant (``positives``)."""
    records_corrected: int = 0
    """Records whose positives were all removed and that took their negatives judged relevant instead (``promote``)."""
    records_without_positives: int = 0
    """Records left with ``"pos": []`` (every positive judged not relevant, no negative judged relevant)."""
    kept: int = 0
    undecidable: int = 0
    """Negatives kept without a verdict (their judgement failed; retried on the next run)."""
    failed: int = 0
    """Failed judgements: a failed request or an unparseable reply."""
    failed_reasons: dict = field(default_factory=dict)
    """``failed`` by kind: ``request failed`` / ``unparseable reply``."""
    failed_records: int = 0
    """Records with a failed judgement, listed in ``failed_path`` for the next run."""
    queries_with_removals: int = 0
    removed_per_query: dict = field(default_factory=dict)
    """Histogram: number of negatives removed from a query -> number of queries."""
    llm: dict = field(default_factory=dict)
    elapsed_s: float = 0.0
    failed_path: str | None = None

    def summary(self) -> str:
        reasons = sorted(self.failed_reasons.items(), key=lambda kv: (-kv[1], kv[0]))
        why = f": {', '.join(f'{n} {reason}' for reason, n in reasons)}" if reasons else ""
        positives = (f"{self.positives_judged} positives judged, {self.positives_removed} removed "
                     f"({self.records_corrected} records corrected, {self.records_without_positives} left without a "
                     "positive), ") if self.positives_judged else ""
        return (f"{self.records_judged} records ({self.resumed} earlier), {self.negatives_judged} negatives "
                f"judged, {self.removed} removed by the LLM, {self.removed_equal_positive} equal to a positive, "
                f"{positives}"
                f"{self.failed} failed judgements{why} (negatives kept, {self.failed_records} records to retry), "
                f"{self.llm.get('cache_hits', 0)} cache hits -> {self.output}")


@dataclass
class _Pending:
    record: dict
    negatives: list[str]
    verdicts: list[bool | str | None]  # True/False/UNDECIDABLE from the LLM, a rule's reason, None = not yet
    waiting: int  # requests still in flight for this record
    ordinal: int = 0  # position among the shard's records (= line of the output)
    line: int = 0  # line in the input
    copy: dict | None = None  # the record as an earlier run finished it: written as it is
    failures: list[dict] = field(default_factory=list)  # failed judgements: index, reason, error, reply
    pos_verdicts: list[bool | str | None] = field(default_factory=list)  # the positives', when they are judged


def judge_negatives(input_path: str | Path, output_path: str | Path, client: LLMBackend, *,
                    template: str | None = None, template_zh: str | None = None, language: str = "auto",
                    cjk_threshold: float = 0.3, max_passage_chars: int = 4000, keep_removed: bool = True,
                    max_failure_rate: float = 0.5, shard: Shard = Shard(), overwrite: bool = False,
                    progress: bool = True, report_path: str | Path | None = None, positives: bool = False,
                    promote: bool = True) -> JudgeReport:
    """Remove the negatives ``client`` judges relevant to their query; write ``output_path`` and a report JSON.

    ``positives``: also remove the positives it judges not relevant (``promote``: a record left without one takes
    its negatives judged relevant as positives); see the module docstring.

    Resuming: records are written in input order, so a re-run skips as many (owned) records as the partial
    output already holds -- re-run with the same input and shard. Records with failed judgements are listed in
    ``OUT.failed.jsonl``; a re-run over the finished output judges them again and copies the others from it.
    ``overwrite`` starts afresh. Raises :class:`~robustir.errors.EndpointError` when more than
    ``max_failure_rate`` of the judgements failed (the output is then not finished).
    """
    input_path, output = Path(input_path), Path(output_path)
    if not input_path.exists():
        raise DataError(input_path, "file not found", fix="give a training JSONL with query/pos/neg")
    if output.resolve() == input_path.resolve():
        raise ConfigError(f"output {output} is the input file; the judge never overwrites its input, choose a new file")
    if language not in ("auto", "en", "zh"):
        raise ConfigError(f"language must be auto, en or zh, got {language!r}")
    tally = FailureTally("llm judge", "judgements", max_failure_rate, endpoint=endpoint_of(client))
    started = time.monotonic()
    stage = StageOutput(output)
    if overwrite:
        stage.clear()
    # Records of an earlier run still to retry (ordinal -> entry); the others of a finished OUT are copied from it.
    retry = _read_failed(stage.failed) if (output.exists() or stage.partial.exists()) else {}
    fresh_partial = not stage.partial.exists()
    report = JudgeReport(output=str(output))
    writer = ResumableJsonlWriter(output, key_field=None)
    already = writer.count
    finished_lines = _lines(output) if output.exists() else iter(())  # OUT stays untouched until the end
    changed = False  # a record was judged (not only copied) in this run
    new_failed: dict[int, dict] = {}
    failed_reasons: Counter[str] = Counter()
    histogram: Counter[int] = Counter()
    pending: deque[_Pending] = deque()  # records in input order, waiting for their verdicts
    slots: deque[tuple[_Pending, int, str]] = deque()  # (record, negative index, prompt) of each request
    bar = tqdm(desc="judge", unit="record", disable=not progress, dynamic_ncols=True, mininterval=1.0)

    def pick_template(query: str, negative: str) -> str:
        if template is not None:
            return template
        zh = language == "zh" or (language == "auto" and cjk_share(query + negative) >= cjk_threshold)
        return (template_zh or DEFAULT_JUDGE_TEMPLATE_ZH) if zh else DEFAULT_JUDGE_TEMPLATE_EN

    def flush_ready() -> None:
        nonlocal changed
        while pending and pending[0].waiting == 0:
            item = pending.popleft()
            if item.copy is not None:
                writer.write(item.copy)
            else:
                writer.write(_finish_record(item, keep_removed, report, histogram, promote))
                changed = True
                if item.failures:
                    new_failed[item.ordinal] = _failed_entry(item)
            bar.update(1)

    def prompts() -> Iterator[str]:
        # Pulled lazily by the backend's stream: only a window of records is held in memory.
        ordinal = -1
        for line, record in shard.select(read_jsonl(input_path)):
            report.records += 1
            ordinal += 1
            earlier = next(finished_lines, None)  # this record's line in the finished OUT, if any
            if ordinal < already:
                report.resumed += 1
                tally.earlier += _count_negatives(record)
                continue
            if earlier is not None and ordinal not in retry:
                report.resumed += 1
                tally.earlier += _count_negatives(record)
                pending.append(_Pending(record, [], [], 0, ordinal, line, copy=json.loads(earlier)))
                flush_ready()
                continue
            query, pos, neg = check_record(record, input_path, line)
            listed = retry.get(ordinal)
            if listed is not None and listed.get("query") not in (None, query[:200]):
                raise ConfigError(f"{stage.failed}: record {ordinal} (input line {line}) to retry had the query "
                                  f"{listed.get('query')!r}, the input now has {query[:200]!r}: the input changed "
                                  f"since the last run. Fix: re-run with the input of the last run, or --overwrite")
            positive_texts = {p.strip() for p in pos}
            item = _Pending(record, neg, [None] * len(neg), 0, ordinal, line,
                            pos_verdicts=[None] * len(pos) if positives else [])
            jobs = []
            for i, negative in enumerate(neg):
                if negative.strip() in positive_texts:
                    item.verdicts[i] = REASON_EQUALS_POSITIVE
                    continue
                jobs.append((i, render_template(pick_template(query, negative), {
                    "query": query.strip(), "passage": negative.strip()[:max_passage_chars],
                    "positive": (pos[0].strip()[:max_passage_chars] if pos else "")})))
            for j, positive in enumerate(pos if positives else []):  # index -1 - j: the j-th positive
                jobs.append((-1 - j, render_template(pick_template(query, positive), {
                    "query": query.strip(), "passage": positive.strip()[:max_passage_chars],
                    "positive": positive.strip()[:max_passage_chars]})))
            item.waiting = len(jobs)
            pending.append(item)
            flush_ready()  # a record with nothing to ask is written as soon as it reaches the head
            for i, prompt in jobs:
                slots.append((item, i, prompt))
                yield prompt

    finished = False
    try:
        for completion in client.stream(prompts()):
            item, index, prompt = slots.popleft()
            verdict = parse_yes_no(completion.text) if completion.ok else None
            if verdict is None:
                if completion.ok:
                    client.forget(prompt)  # so the retry asks again instead of reusing this reply
                    kind, error = FAILED_UNPARSEABLE, "unparseable reply (neither yes nor no)"
                else:
                    kind, error = FAILED_REQUEST, completion.error or FAILED_REQUEST
                item.failures.append({("negative" if index >= 0 else "positive"): index if index >= 0 else -1 - index,
                                      "reason": kind, "error": error, "reply": (completion.text or "")[:300]})
                failed_reasons[kind] += 1
                report.failed += 1
                tally.failure(kind, error)
            else:
                tally.success()
            if index >= 0:
                item.verdicts[index] = UNDECIDABLE if verdict is None else verdict
                report.negatives_judged += 1
            else:
                item.pos_verdicts[-1 - index] = UNDECIDABLE if verdict is None else verdict
                report.positives_judged += 1
            item.waiting -= 1
            flush_ready()
            tally.check(final=False, failed_path=stage.failed)
        flush_ready()
        if report.records == 0 and shard.count == 1:  # an empty file is no training data (a shard may get nothing)
            raise DataError(input_path, "no records", fix='give a training JSONL with one {"query", "pos", "neg"} '
                                                          "object per line")
        tally.check(final=True, failed_path=stage.failed)
        finished = True
    finally:
        bar.close()
        done = writer.count  # ordinals [already, done) were (re)written in this run
        if finished:
            writer.finish()
        else:
            writer.close()
            if fresh_partial and not changed and output.exists():
                stage.partial.unlink(missing_ok=True)  # only copies of OUT: OUT says it all
        close = getattr(finished_lines, "close", None)
        if close is not None:
            close()
        kept = {k: v for k, v in retry.items() if not already <= k < done and (not finished or k < done)}
        entries = {**kept, **new_failed}
        report.failed_reasons = dict(failed_reasons)
        report.failed_records = len(new_failed)
        report.removed_per_query = {str(k): histogram[k] for k in sorted(histogram)}
        report.llm = client.stats.as_dict()
        report.elapsed_s = round(time.monotonic() - started, 3)
        report.failed_path = write_failed_items(stage.failed, [entries[k] for k in sorted(entries)],
                                                "record(s) with failed judgements")
        if finished:
            write_json(report_path or stage.report, asdict(report))
    logger.info("llm judge: %s", report.summary())
    return report


def _count_negatives(record: dict) -> int:
    neg = record.get("neg") if isinstance(record, dict) else None
    return len(neg) if isinstance(neg, list) else 0


def _lines(path: Path) -> Iterator[str]:
    """The non-empty lines of a finished output, one at a time."""
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield line


def _read_failed(path: Path) -> dict[int, dict]:
    """The records an earlier run listed as failed (``OUT.failed.jsonl``), by ordinal."""
    if not path.exists():
        return {}
    entries: dict[int, dict] = {}
    for line, entry in read_jsonl(path):
        ordinal = entry.get("record") if isinstance(entry, dict) else None
        if not isinstance(ordinal, int) or isinstance(ordinal, bool) or ordinal < 0:
            raise DataError(path, "not a list of failed records (no 'record' number)", line=line,
                            fix="delete it and re-run with --overwrite to judge every record again")
        entries[ordinal] = entry
    return entries


def _failed_entry(item: _Pending) -> dict:
    first = item.failures[0]
    return {"record": item.ordinal, "line": item.line, "query": str(item.record.get("query", ""))[:200],
            "error": first["error"], "negatives": item.failures}


def run_judge(config: JudgeConfig, input_path: str | Path | None = None,
              output_path: str | Path | None = None, *, say: Any = None) -> JudgeReport:
    """The LLM-judge stage from its config: ``(config, input, output) -> report``, run as the step
    :data:`JUDGE` (:func:`robustir.runs.execute`).

    ``input_path`` / ``output_path`` override ``config.input`` / ``config.output``; the output gets the shard
    suffix of ``config.shard``. Templates (``{query}``, ``{passage}``) are loaded and checked, the backend is
    built with its reply cache and, for an HTTP endpoint with ``preflight``, checked before the first request.
    ``robustir filter --method llm`` and ``robustir run`` both call this.
    """
    if not config.llm.model:
        raise ConfigError("llm judge: llm.model is empty; give the model name the server serves (and llm.base_url)")
    return run_llm_step(JUDGE, config, input_path, output_path, JudgeReport, say=say)


def _judge_step(config: JudgeConfig, job: Any) -> JudgeReport:
    stage = StageOutput(job.output, job.shard, reports=True)
    template, template_zh = config.templates(("query", "passage"))
    with stage_backend(config, stage.path) as backend:
        return judge_negatives(job.inputs["input"], stage.path, backend, template=template, template_zh=template_zh,
                               language=config.language, cjk_threshold=config.cjk_threshold,
                               max_passage_chars=config.max_passage_chars, keep_removed=config.keep_removed,
                               max_failure_rate=config.max_failure_rate, shard=stage.shard, overwrite=False,
                               progress=config.progress, positives=config.positives, promote=config.promote)


JUDGE = llm_step("filter llm", JudgeConfig, _judge_step)
"""PEG's LLM removal of false negatives as a :class:`~robustir.runs.Step`."""


def _finish_record(item: _Pending, keep_removed: bool, report: JudgeReport, histogram: Counter,
                   promote: bool = True) -> dict:
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
    removed += _judge_positives(item, record, report, promote)
    if keep_removed or any(entry.get("positive") for entry in removed):  # training reads why "pos" is empty
        earlier = item.record.get("removed")  # a previous filter pass may have listed removals already
        record["removed"] = (earlier if isinstance(earlier, list) else []) + removed
    histogram[len(removed)] += 1
    report.records_judged += 1
    if removed:
        report.queries_with_removals += 1
    return record


REASON_LLM_POSITIVE = "llm_judge_positive"
REASON_PROMOTED = "promoted"


def _judge_positives(item: _Pending, record: dict, report: JudgeReport, promote: bool) -> list[dict]:
    """Apply the positives' verdicts to ``record`` (``pos`` and the ``pos_*`` lists aligned with it): the ones judged
    not relevant go; a record left without one takes its negatives judged relevant (``promote``). Returns the
    ``removed`` entries (``"positive": true`` for removed positives)."""
    if not item.pos_verdicts:
        return []
    pos = list(item.record.get("pos") or [])
    keep = [verdict is not False for verdict in item.pos_verdicts]  # a failed judgement keeps the positive
    removed = [{"text": text, "reason": REASON_LLM_POSITIVE, "positive": True}
               for text, k in zip(pos, keep) if not k]
    if not removed:
        return []
    report.positives_removed += len(removed)
    for key, value in item.record.items():  # pos, pos_scores, pos_ids, ... stay aligned
        if (key == "pos" or key.startswith("pos_")) and isinstance(value, list) and len(value) == len(pos):
            record[key] = [v for v, k in zip(value, keep) if k]
    if any(keep):
        return removed
    relevant = [negative for negative, verdict in zip(item.negatives, item.verdicts) if verdict is True]
    if promote and relevant:
        for key in [k for k in record if k.startswith("pos_")]:  # scores and ids of other passages: no longer aligned
            del record[key]
        record["pos"] = relevant
        report.records_corrected += 1
        return removed + [{"text": text, "reason": REASON_PROMOTED} for text in relevant]
    record["pos"] = []
    report.records_without_positives += 1
    return removed
