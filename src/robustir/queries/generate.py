"""Query generation: ask an LLM for questions each passage answers (PEG §Data construction, fine-tuning data).

PEG splits raw texts into short passages and "make[s] full use of an off-the-shelf LLM to generate questions
based on these short passages. Each question is treated as one query positively associated to the passage".
This module does exactly that, for any :class:`~robustir.llm.LLMBackend`:

input  — passages JSONL (a BEIR ``corpus.jsonl`` or the output of ``robustir chunk``): ``_id``, ``title``, ``text``
output — FlagEmbedding training JSONL, one line per generated query::

    {"query": q, "pos": [passage text], "neg": [], "pos_id": passage id, "doc_id": source doc id, "qid": "<id>-q0"}

The run is streamed and resumable: lines go to ``OUT.partial`` and each passage's queries are written together;
a re-run skips passages already there. Passages whose generation failed (``on_failure: skip``, or a reply with no
usable question) are listed in ``OUT.failed.jsonl`` and asked again on the next run. ``OUT.report.json`` holds the
summary. The prompt is a replaceable template with ``{title}``, ``{text}`` and ``{n}`` placeholders.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from tqdm.auto import tqdm

from ..errors import ConfigError, DataError
from ..data.cjk import cjk_share
from ..data.documents import checked_fields
from ..io import ResumableJsonlWriter, Shard, atomic_write, read_jsonl
from ..outputs import StageOutput
from ..llm import LLMBackend, LLMStageConfig, render_template, stage_backend, strip_reasoning

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE_EN = """\
Below is a passage. Write {n} different questions that a person might type into a search engine and that \
this passage answers.

Rules:
- Each question must be answerable from the passage.
- Each question must be self-contained: understandable without seeing the passage (do not write "this passage", \
"the author", "it").
- Vary the wording and the facts asked about; do not copy whole sentences from the passage.
- Output one question per line, numbered 1., 2., ..., and nothing else.

Title: {title}
Passage: {text}
"""

DEFAULT_TEMPLATE_ZH = """\
下面是一段文本。请写出{n}个不同的问题，这些问题是用户可能在搜索引擎中输入的，并且可以由这段文本回答。

要求：
- 每个问题都必须能根据这段文本回答。
- 每个问题都要表述完整，不看文本也能理解（不要使用“这段文本”“作者”“它”等指代）。
- 问题的措辞和所问的内容要有变化，不要照抄原文句子。
- 每行输出一个问题，用 1. 2. …… 编号，不要输出其他内容。

标题：{title}
文本：{text}
"""



# "1." "1)" "(1)" "1、" "１．" "一、" "Q1:" "问题1：" and bullets.
_MARKER = re.compile(
    r"""^\s*(?:
        [-*•·●▪◦‣+]\s+
      | [(（\[]?\s*(?:\d{1,3}|[一二三四五六七八九十]{1,3})\s*[.)）\]、:：．]\s*
      | (?:q|question|query|问题|问)\s*\d{0,3}\s*[.:：)）]\s*
    )""", re.X | re.I)
_QUOTES = "\"'“”‘’「」『』`"


def parse_questions(reply: str, *, max_queries: int | None = None, max_chars: int = 300,
                    min_chars: int = 4) -> list[str]:
    """Questions from an LLM reply: a JSON list (or ``{"questions": [...]}``), a numbered/bulleted list, or lines.

    Preamble such as "Here are three questions:" is dropped (when list markers are present, only marked lines
    count; otherwise lines ending in a colon are dropped), as are empty, duplicate (case/space-insensitive),
    too short and over-long entries. At most ``max_queries`` are returned, in the reply's order.
    """
    text = strip_reasoning(reply or "")
    items = _json_items(text)
    if items is None:
        items = _line_items(text)
    out: list[str] = []
    seen: set[str] = set()
    for item in items:
        question = _clean(item)
        norm = " ".join(question.casefold().split()).rstrip("?？.。 ")
        if len(question) < min_chars or len(question) > max_chars or not norm or norm in seen:
            continue
        seen.add(norm)
        out.append(question)
        if max_queries is not None and len(out) >= max_queries:
            break
    return out


def _json_items(text: str) -> list[str] | None:
    body = re.sub(r"^```[\w-]*\s*|\s*```$", "", text.strip())
    candidates = [body]
    for open_, close in (("[", "]"), ("{", "}")):
        start, end = body.find(open_), body.rfind(close)
        if 0 <= start < end:
            candidates.append(body[start:end + 1])
    for candidate in candidates:
        try:
            data = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict):  # {"questions": [...]}: take the first list value
            data = next((v for v in data.values() if isinstance(v, list)), None)
        if isinstance(data, list):
            items = []
            for entry in data:
                if isinstance(entry, str):
                    items.append(entry)
                elif isinstance(entry, dict):
                    value = next((entry[k] for k in ("question", "query", "q", "text") if k in entry), None)
                    if isinstance(value, str):
                        items.append(value)
            return items
    return None


def _line_items(text: str) -> list[str]:
    lines = [line.replace("**", "").strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("```")]
    marked = [_MARKER.sub("", line, count=1) for line in lines if _MARKER.match(line)]
    if marked:
        return marked
    return [line for line in lines if not line.endswith((":", "："))]


def _clean(item: str) -> str:
    item = " ".join(str(item).split())
    while len(item) >= 2 and item[0] in _QUOTES and item[-1] in _QUOTES:
        item = item[1:-1].strip()
    return item


@dataclass
class GenerateConfig(LLMStageConfig):
    """Arguments of ``robustir generate`` (YAML/JSON file, flags, ``key=value`` overrides): the common LLM-stage
    options (input passages JSONL with ``_id``, ``title``, ``text``; templates with ``{title}``, ``{text}``,
    ``{n}``) plus these."""

    num_queries: int = 3
    """Questions asked for per passage."""
    max_query_chars: int = 300
    """Longer questions in a reply are dropped."""
    beir_dir: str | None = None
    """Also write a BEIR view of the generated queries: ``queries.jsonl`` and ``qrels/train.tsv``."""


@dataclass
class GenerateReport:
    """Summary of one generation run (counts are for this run; ``resumed`` were done by earlier runs)."""

    output: str
    passages: int = 0
    resumed: int = 0
    generated: int = 0
    queries_written: int = 0
    failed: int = 0
    skipped_empty: int = 0
    duplicate_ids: int = 0
    llm: dict = field(default_factory=dict)
    elapsed_s: float = 0.0
    failed_path: str | None = None

    def summary(self) -> str:
        llm = self.llm
        tokens = ""
        if llm.get("prompt_tokens") or llm.get("completion_tokens"):
            tokens = f", tokens {llm.get('prompt_tokens', 0)} in / {llm.get('completion_tokens', 0)} out"
        return (f"{self.generated} passages done now ({self.resumed} earlier), {self.queries_written} queries "
                f"written, {self.failed} failed, {llm.get('cache_hits', 0)} cache hits, "
                f"{llm.get('requests', 0)} requests{tokens}, {self.elapsed_s:.1f}s -> {self.output}")


class GroupedJsonlWriter(ResumableJsonlWriter):
    """A :class:`ResumableJsonlWriter` whose records come in groups sharing ``key_field`` (a passage's queries).

    A group is written in one flushed write; on recovery the last group is dropped and redone, because a kill
    during that write could have left it incomplete (redoing costs nothing: its reply is in the cache).
    """

    def write_group(self, records: list[dict]) -> None:
        if not records:
            return
        self._handle.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        self._handle.flush()
        self.count += len(records)
        if self.key_field is not None:
            for record in records:
                self.done_keys.add(record.get(self.key_field))

    def _recover(self) -> None:
        super()._recover()
        if self.key_field is None or self.count == 0:
            return
        with open(self.partial, encoding="utf-8") as handle:
            lines = handle.readlines()
        last = json.loads(lines[-1]).get(self.key_field)
        keep = len(lines)
        while keep and json.loads(lines[keep - 1]).get(self.key_field) == last:
            keep -= 1
        with atomic_write(self.partial) as handle:
            handle.writelines(lines[:keep])
        self.count = keep
        self.done_keys = {json.loads(line).get(self.key_field) for line in lines[:keep]}


def read_passages(path: str | Path) -> Iterator[tuple[int, dict]]:
    """``(line, passage)`` with ``_id`` as str, ``title`` and ``text`` (extra fields kept); malformed lines raise DataError."""
    for line, obj in read_jsonl(path):
        pid, title, text = checked_fields(path, line, obj, "passage")
        yield line, {**obj, "_id": pid, "title": title, "text": text}


def _count_lines(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(1 for raw in handle if raw.strip())


def generate_queries(input_path: str | Path, output_path: str | Path, backend: LLMBackend, *,
                     num_queries: int = 3, template: str | None = None, template_zh: str | None = None,
                     language: str = "auto", cjk_threshold: float = 0.3, max_passage_chars: int = 4000,
                     max_query_chars: int = 300, shard: Shard = Shard(), beir_dir: str | Path | None = None,
                     overwrite: bool = False, progress: bool = True) -> GenerateReport:
    """Generate up to ``num_queries`` queries per passage of ``input_path`` into ``output_path`` (resumable).

    ``template`` (text with ``{title}``, ``{text}``, ``{n}``) replaces the default prompt for all passages;
    otherwise ``language`` picks English/Chinese (``auto``: by CJK share, with ``template_zh`` for Chinese).
    """
    if num_queries < 1:
        raise ConfigError(f"num_queries must be >= 1, got {num_queries}")
    if language not in ("auto", "en", "zh"):
        raise ConfigError(f"language must be auto, en or zh, got {language!r}")
    input_path, output = Path(input_path), Path(output_path)
    if output.resolve() == input_path.resolve():
        raise ConfigError(f"--output {output} is the input file; choose a new file")
    if not input_path.exists():
        raise DataError(input_path, "file not found",
                        fix="give a passages JSONL (BEIR corpus.jsonl or robustir chunk output)")
    started = time.monotonic()
    if overwrite:
        StageOutput(output).clear()
    else:
        StageOutput(output).reopen()  # a finished output is continued (failures retried, new records appended)
    report = GenerateReport(output=str(output))
    total_lines = _count_lines(input_path)
    report.passages = len(range(shard.index, total_lines, shard.count))
    failures: list[dict] = []
    queued: deque[tuple[dict, str]] = deque()

    def pick_template(passage: dict) -> str:
        if template is not None:
            return template
        zh = language == "zh" or (language == "auto"
                                  and cjk_share(passage["title"] + passage["text"]) >= cjk_threshold)
        return (template_zh or DEFAULT_TEMPLATE_ZH) if zh else DEFAULT_TEMPLATE_EN

    writer = GroupedJsonlWriter(output, key_field="pos_id")
    bar = tqdm(total=report.passages, desc="generate", unit="passage", disable=not progress, dynamic_ncols=True,
               mininterval=1.0)
    seen_this_run: set[str] = set()

    def prompts() -> Iterator[str]:
        # Lazily pulled by the backend's stream, so only a window of passages is in memory at a time.
        for _, passage in shard.select(read_passages(input_path)):
            pid = passage["_id"]
            if pid in writer.done_keys:
                report.resumed += 1
                bar.update(1)
                continue
            if pid in seen_this_run:
                report.duplicate_ids += 1
                logger.warning("passage id %r appears more than once in %s; later copies are skipped", pid, input_path)
                bar.update(1)
                continue
            seen_this_run.add(pid)
            if not passage["text"].strip():
                report.skipped_empty += 1
                bar.update(1)
                continue
            prompt = render_template(pick_template(passage), {
                "title": passage["title"].strip(), "text": passage["text"].strip()[:max_passage_chars],
                "n": num_queries})
            queued.append((passage, prompt))
            yield prompt

    finished = False
    try:
        for completion in backend.stream(prompts()):
            passage, prompt = queued.popleft()
            pid = passage["_id"]
            questions = parse_questions(completion.text, max_queries=num_queries,
                                        max_chars=max_query_chars) if completion.ok else []
            if not questions:
                error = completion.error or "no usable question in the reply"
                if completion.ok:
                    backend.forget(prompt)  # so the next run asks again instead of reusing this reply
                failures.append({"_id": pid, "error": error, "reply": (completion.text or "")[:500]})
                report.failed += 1
            else:
                doc_id = passage.get("doc_id", pid)
                writer.write_group([
                    {"query": q, "pos": [passage["text"]], "neg": [], "pos_id": pid, "doc_id": doc_id,
                     "qid": f"{pid}-q{i}"} for i, q in enumerate(questions)])
                report.generated += 1
                report.queries_written += len(questions)
            bar.update(1)
        finished = True
    finally:
        bar.close()
        if finished:
            writer.finish()
        else:
            writer.close()
        report.llm = backend.stats.as_dict()
        report.elapsed_s = round(time.monotonic() - started, 3)
        report.failed_path = _write_failures(output, failures)
        if finished:
            StageOutput(output).write_report(asdict(report))
    if beir_dir is not None:
        export_beir_queries(output, beir_dir)
    logger.info("generate: %s", report.summary())
    return report


def run_generate(config: GenerateConfig, input_path: str | Path | None = None,
                 output_path: str | Path | None = None) -> GenerateReport:
    """The generation stage from its config: ``(config, input, output) -> report``.

    ``input_path`` / ``output_path`` override ``config.input`` / ``config.output`` (the pipeline runner sets
    them); the output gets the shard suffix of ``config.shard``. Templates are loaded and checked, the
    backend is built with its reply cache (``OUT.llm-cache.sqlite`` unless ``llm.cache_path`` says otherwise)
    and, for an HTTP endpoint with ``preflight``, checked before the first passage. The CLI (``robustir
    generate``) and the runner (``robustir run``) both call this, so they cannot drift apart.
    """
    source = input_path if input_path is not None else config.input
    target = output_path if output_path is not None else config.output
    if not source or not target:
        raise ConfigError("generate: give the input passages and the output file (input: / output:)")
    stage = StageOutput(target, config.shard, reports=True)
    shard, output = stage.shard, stage.path
    template, template_zh = config.templates(("text",))
    with stage_backend(config, output) as backend:
        return generate_queries(
            source, output, backend, num_queries=config.num_queries, template=template, template_zh=template_zh,
            language=config.language, cjk_threshold=config.cjk_threshold, max_passage_chars=config.max_passage_chars,
            max_query_chars=config.max_query_chars, shard=shard, beir_dir=config.beir_dir,
            overwrite=config.overwrite, progress=config.progress)


def _write_failures(output: Path, failures: list[dict]) -> str | None:
    path = StageOutput(output).failed
    if not failures:
        if path.exists():
            path.unlink()  # failures of an earlier run were retried successfully
        return None
    with atomic_write(path) as handle:
        for failure in failures:
            handle.write(json.dumps(failure, ensure_ascii=False) + "\n")
    logger.warning("%d passage(s) failed; listed in %s and retried on the next run", len(failures), path)
    return str(path)


def export_beir_queries(train_jsonl: str | Path, beir_dir: str | Path) -> None:
    """Write ``queries.jsonl`` and ``qrels/train.tsv`` (BEIR layout) for the queries of a generated file."""
    beir_dir = Path(beir_dir)
    with atomic_write(beir_dir / "queries.jsonl") as queries, atomic_write(beir_dir / "qrels" / "train.tsv") as qrels:
        qrels.write("query-id\tcorpus-id\tscore\n")
        for _, record in read_jsonl(train_jsonl):
            queries.write(json.dumps({"_id": record["qid"], "text": record["query"]}, ensure_ascii=False) + "\n")
            qrels.write(f"{record['qid']}\t{record['pos_id']}\t1\n")
