"""Query generation: ask an LLM for questions each passage answers (PEG §Data construction, fine-tuning data).

PEG splits raw texts into short passages and "make[s] full use of an off-the-shelf LLM to generate questions
based on these short passages. Each question is treated as one query positively associated to the passage".
This module does exactly that, for any :class:`~robustir.llm.LLMBackend`:

input  — passages JSONL (a BEIR ``corpus.jsonl`` or the output of ``robustir chunk``): ``_id``, ``title``, ``text``
output — FlagEmbedding training JSONL, one line per generated query::

    {"query": q, "pos": [passage text], "neg": [], "pos_id": passage id, "doc_id": source doc id, "qid": "<id>-q0"}

The run is streamed and resumable: lines go to ``OUT.partial`` and each passage's queries are written together;
a re-run skips passages already there. Every query of a reply is checked by :func:`check_query` (refusals,
"Here are..." boilerplate, answers instead of queries, echoes of the passage or the prompt, too short or too
long); rejected ones are counted per reason in the report. Passages whose generation failed (a failed request
under ``on_failure: skip``, or a reply with no acceptable query) are listed in ``OUT.failed.jsonl`` and asked
again on the next run; a re-run over a finished ``OUT`` works on a copy in ``OUT.partial`` and replaces ``OUT``
atomically only when it finishes, so a failing re-run leaves ``OUT`` as it was. When more than
``max_failure_rate`` of the passages failed the stage raises instead of finishing. ``OUT.report.json`` holds
the summary. The prompt is a replaceable template with ``{title}``, ``{text}`` and ``{n}`` placeholders.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from tqdm.auto import tqdm

from ..errors import ConfigError, DataError
from ..data.cjk import CJK_CHAR_CLASS, cjk_share
from ..data.documents import checked_fields
from ..io import ResumableJsonlWriter, Shard, atomic_write, read_jsonl
from ..outputs import StageOutput
from ..validation import PositiveInt, config_dataclass
from ..llm import (FailureTally, LLMBackend, LLMStageConfig, endpoint_of, llm_step, run_llm_step, render_template,
                   stage_backend, strip_reasoning, write_failed_items)

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


def parse_questions(reply: str, *, max_queries: int | None = None, max_chars: int | None = 300,
                    min_chars: int = 4) -> list[str]:
    """Questions from an LLM reply: a JSON list (or ``{"questions": [...]}``), a numbered/bulleted list, or lines.

    Preamble such as "Here are three questions:" is dropped (when list markers are present, only marked lines
    count; otherwise lines ending in a colon are dropped), as are empty, duplicate (case/space-insensitive),
    too short and over-long entries (``max_chars=None``: no limit). At most ``max_queries`` are returned, in the
    reply's order. Whether an entry is a usable query is :func:`check_query`'s business.
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
        if len(question) < min_chars or (max_chars is not None and len(question) > max_chars) or not norm \
                or norm in seen:
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


_LABEL = re.compile(r"^(?:search\s+query|query|question|q|搜索词|查询|问题)\s*\d{0,3}\s*[:：]\s*", re.I)


def _clean(item: str) -> str:
    item = " ".join(str(item).split())
    while True:
        before = item
        while len(item) >= 2 and item[0] in _QUOTES and item[-1] in _QUOTES:
            item = item[1:-1].strip()
        item = _LABEL.sub("", item, count=1).strip()
        if item == before:
            return item


def clean_query(text: str) -> str:
    """A query as written to the output: one line, without surrounding quotes, a "Query:"/"问题：" label or a
    list marker ("1.", "-", "Q2:")."""
    return _clean(_MARKER.sub("", " ".join(str(text or "").split()), count=1))


# ------------------------------------------------------------------------------------------ query checks

REJECT_EMPTY = "empty"
REJECT_REFUSAL = "refusal"
REJECT_BOILERPLATE = "answer boilerplate"
REJECT_TOO_SHORT = "too short"
REJECT_TOO_LONG = "too long"
REJECT_MULTI_SENTENCE = "multi-sentence answer"
REJECT_ECHO_PASSAGE = "echoes the passage"
REJECT_ECHO_PROMPT = "echoes the prompt"

_CAN_NOT = (r"(?:can\s*not|can't|am\s+unable\s+to|'m\s+unable\s+to|am\s+not\s+able\s+to|'m\s+not\s+able\s+to|"
            r"'re\s+unable\s+to|are\s+unable\s+to|won't|will\s+not|must\s+decline\s+to|have\s+to\s+decline\s+to|"
            r"am\s+not\s+allowed\s+to)")
_REFUSAL = re.compile("|".join([
    # "Sorry, ...", "I'm sorry", "I am so sorry, but" (not "sorry seems to be the hardest word")
    r"^(?:(?:i'm|i\s+am|we're|we\s+are)\s+)?(?:so\s+|very\s+|really\s+|truly\s+|terribly\s+)?sorry"
    r"(?:\s*[,.!:;]|\s+(?:but|i|we|for|about|that|to)\b|\s*$)",
    r"^(?:my\s+)?apolog(?:y|ies)\b", r"^(?:i|we)\s+(?:must\s+|do\s+)?apologi[sz]e\b",
    r"^unfortunately\b",
    r"\bas\s+an?\s+(?:ai|a\.i\.|artificial\s+intelligence|(?:large\s+)?language\s+model|llm|"
    r"ai\s+(?:language\s+)?model|ai\s+assistant)\b",
    # "I cannot help with that", "I can't generate questions", ", I am unable to provide ..." -- but not a user's
    # own query such as "I can't log in to my account"
    r"(?:^|[,;:.!]\s*)(?:i|we)\s*(?:really\s+|simply\s+|just\s+|unfortunately\s+)?" + _CAN_NOT +
    r"\s+(?:help(?:\s+you)?(?:\s+with\b|\s+on\b|\s*[.!,]|\s*$)|assist\b|provide\b|generate\b|create\b|write\b|"
    r"produce\b|formulate\b|come\s+up\s+with\b|comply\b|fulfil|(?:do|answer|complete)\s+(?:that|this|it|so|"
    r"your|the\s+(?:request|task))\b)",
    r"^(?:i|we)\s+(?:can\s*not|can't|won't|will\s+not)\s*[.!]*\s*$",  # "I can't."
    r"^(?:i|we)\s+(?:do\s+not|don't)\s+have\s+(?:enough|sufficient|access|the\s+ability)\b",
    r"\b(?:passage|text|context)\s+(?:does\s+not|doesn't)\s+(?:contain|provide|have|include)\s+(?:enough|"
    r"sufficient)\b",
    r"\bno\s+(?:questions?|queries)\s+(?:can|could)\s+be\b",
    # Chinese
    r"^(?:很|非常|十分)?(?:抱歉|对不起|不好意思)",
    r"作为(?:一个|一名)?(?:ai|人工智能|语言模型|大语言模型|大型语言模型|ai助手|人工智能助手)",
    r"(?:我|我们)(?:无法|不能|没法|不可以|不会)(?:为你|为您|帮你|帮您|给你|给您)?(?:提供|生成|回答|帮助|协助|完成|"
    r"创建|编写|满足|提出)",
]), re.I)
_BOILERPLATE = re.compile("|".join([
    r"^(?:here\s+(?:is|are)|here's)\b",
    r"^(?:sure|certainly|of\s+course|absolutely|okay|ok|alright|great|no\s+problem)\s*[,!.:]",
    r"^sure\s+(?:thing|here|,)", r"^(?:great|good|excellent)\s+question\b",
    r"^(?:based\s+on|according\s+to|from)\s+the\s+(?:passage|text|above|given|provided)\b",
    r"^(?:the|this)\s+(?:passage|text)\s+(?:discusses|describes|is\s+about|talks\s+about|mentions|explains|"
    r"states|says|does)\b",
    r"^(?:i\s+)?hope\s+(?:this|these|that)\s+help", r"^let\s+me\s+know\b",
    r"^(?:in\s+summary|to\s+summari[sz]e|the\s+answer\s+is)\b",
    r"^(?:以下是|下面是|好的[，,。!！：:]|当然[，,。!！：:]|没问题[，,。!！]|根据(?:这段|上述|以上|所给|给定)?(?:文本|段落|文章|内容))",
    r"^这段(?:文本|文字|话|内容)(?:主要)?(?:讲|介绍|描述|说明|讨论|提到)",
]), re.I)
_TOKEN = re.compile(f"[{CJK_CHAR_CLASS}]|[^\\W_{CJK_CHAR_CLASS}]+")
# a sentence end: [.!?] after two lower-case letters/digits (not "U.S." or "Dr.") before a capital, or a CJK stop
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\]\"'”’]{2}[.!?])\s+(?=[A-Z\"“'‘(])|(?<=[。！？])(?=.)")


def _tokens(text: str) -> list[str]:
    """Word tokens: runs of letters/digits, and every CJK letter on its own (Chinese has no spaces)."""
    return [t for t in _TOKEN.findall(text) if t[0].isalnum()]


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w]+", " ", text.casefold()).split())


def check_query(query: str, *, passage: str = "", instruction: str = "", min_words: int = 2, max_words: int = 64,
                max_chars: int = 300) -> str | None:
    """Why ``query`` (one entry of a generation reply) is not a usable search query, or ``None`` when it is.

    The one place the rules live; the reason strings are the ``REJECT_*`` constants, counted in the report.
    The text is first cleaned as written (:func:`clean_query`: quotes, "Query:" label, list marker). In order:

    * ``empty`` -- nothing left.
    * ``refusal`` -- an apology or refusal: starts with "Sorry,", "I'm sorry", "I apologize", "Unfortunately"; or
      "As an AI / a language model" anywhere; or "I can't / I cannot / I'm unable to / I won't" followed by a
      task verb ("help with", "assist", "provide", "generate", "create", "write", "answer that", ...), or a bare
      "I can't."; "I don't have enough ...", "the passage does not contain enough ...", "no questions can be
      ..."; Chinese 抱歉/对不起, 作为AI/语言模型, 我无法/我不能 + 提供/生成/回答/帮助. A user's own query that
      merely starts with "I can't" ("I can't log in to my account") is kept.
    * ``answer boilerplate`` -- starts like a chat answer, not a query: "Here is/are", "Sure,", "Certainly!",
      "Of course,", "Okay,", "Great question", "Based on / According to the passage", "The passage discusses",
      "Hope this helps", "The answer is"; Chinese 以下是, 好的，, 当然，, 根据文本, 这段文本讲.
    * ``too short`` -- fewer than ``min_words`` word tokens (a CJK character counts as one: "北京" is two).
    * ``too long`` -- more than ``max_words`` word tokens or ``max_chars`` characters.
    * ``multi-sentence answer`` -- three or more sentences, or two where neither is a question and the first
      has four or more words (an answer or an explanation, not a query). A single sentence without "?" is fine:
      search queries are often keyword phrases.
    * ``echoes the passage`` -- the passage itself, or a verbatim piece of it covering at least half of it.
    * ``echoes the prompt`` -- a verbatim piece (20+ characters, 10+ for Chinese) of the prompt's instructions
      ``instruction`` (the template rendered without the passage).

    Queries in any language pass unless a rule above applies; a question mark is never required.
    """
    text = clean_query(query)
    if not text or not _tokens(text):
        return REJECT_EMPTY
    folded = text.casefold().replace("’", "'").replace("‘", "'")
    if _REFUSAL.search(folded):
        return REJECT_REFUSAL
    if _BOILERPLATE.search(folded):
        return REJECT_BOILERPLATE
    tokens = _tokens(text)
    if len(tokens) < min_words:
        return REJECT_TOO_SHORT
    if len(tokens) > max_words or len(text) > max_chars:
        return REJECT_TOO_LONG
    sentences = [x for x in _SENTENCE_END.split(text) if x.strip()]
    if len(sentences) >= 3 or (len(sentences) == 2 and not any(x.rstrip().endswith(("?", "？")) for x in sentences)
                               and len(_tokens(sentences[0])) >= 4):
        return REJECT_MULTI_SENTENCE
    norm = _norm(text)
    if passage:
        body = _norm(passage)
        if norm and norm in body and len(norm) >= 0.5 * len(body):
            return REJECT_ECHO_PASSAGE
    if instruction and len(tokens) >= 3:
        long_enough = len(norm) >= (10 if cjk_share(text) >= 0.5 else 20)
        if long_enough and norm in _norm(instruction):
            return REJECT_ECHO_PROMPT
    return None


def select_queries(reply: str, *, passage: str = "", instruction: str = "", num_queries: int = 3,
                   min_words: int = 2, max_words: int = 64, max_chars: int = 300) -> tuple[list[str], list[str]]:
    """``(accepted queries, reasons of the rejected ones)`` of one reply: :func:`parse_questions` splits it,
    :func:`check_query` judges each entry; at most ``num_queries`` are accepted. A reply without any entry is one
    rejection (``refusal`` when it reads as one, else ``empty``)."""
    accepted: list[str] = []
    rejected: list[str] = []
    candidates = parse_questions(reply, max_chars=None, min_chars=1)
    if not candidates:
        text = strip_reasoning(reply or "").casefold().replace("’", "'")
        return [], [REJECT_REFUSAL if _REFUSAL.search(" ".join(text.split())) else REJECT_EMPTY]
    for candidate in candidates:
        reason = check_query(candidate, passage=passage, instruction=instruction, min_words=min_words,
                             max_words=max_words, max_chars=max_chars)
        if reason is not None:
            rejected.append(reason)
        elif len(accepted) < num_queries:
            accepted.append(clean_query(candidate))
    return accepted, rejected


@config_dataclass
class GenerateConfig(LLMStageConfig):
    """Arguments of ``robustir generate`` (YAML/JSON file, flags, ``key=value`` overrides): the common LLM-stage
    options (input passages JSONL with ``_id``, ``title``, ``text``; templates with ``{title}``, ``{text}``,
    ``{n}``) plus these."""

    num_queries: PositiveInt = 3
    """Questions asked for per passage."""
    max_query_chars: PositiveInt = 300
    """Longer questions in a reply are rejected (``too long``)."""
    max_query_words: PositiveInt = 64
    """Questions of more word tokens (a CJK character counts as one) are rejected (``too long``)."""
    min_query_words: PositiveInt = 2
    """Questions of fewer word tokens are rejected (``too short``)."""
    beir_dir: str | None = None
    """Also write a BEIR view of the generated queries: ``queries.jsonl`` and ``qrels/train.tsv``."""

    def __post_init__(self) -> None:
        _check_limits(self.num_queries, self.min_query_words, self.max_query_words, self.max_query_chars)


@dataclass
class GenerateReport:
    """Summary of one generation run (counts are for this run; ``resumed`` were done by earlier runs)."""

    output: str
    passages: int = 0
    resumed: int = 0
    generated: int = 0
    queries_written: int = 0
    failed: int = 0
    """Passages without a query this run: their request failed, or every query of the reply was rejected."""
    failed_reasons: dict = field(default_factory=dict)
    """``failed`` by kind: ``request failed`` / ``no usable query``."""
    rejected: int = 0
    """Queries of replies that :func:`check_query` rejected (a passage may still have others accepted)."""
    rejected_reasons: dict = field(default_factory=dict)
    """``rejected`` by reason (``refusal``, ``too long``, ...)."""
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
                f"written, {self.failed} failed{_counts(self.failed_reasons)}, {self.rejected} queries rejected"
                f"{_counts(self.rejected_reasons)}, {llm.get('cache_hits', 0)} cache hits, "
                f"{llm.get('requests', 0)} requests{tokens}, {self.elapsed_s:.1f}s -> {self.output}")


def _counts(counts: dict) -> str:
    """" (3 refusal, 1 too long)" or ""."""
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return f" ({', '.join(f'{n} {reason}' for reason, n in ordered)})" if ordered else ""


def _check_limits(num_queries: int, min_words: int, max_words: int, max_chars: int) -> None:
    if num_queries < 1:
        raise ConfigError(f"num_queries must be >= 1, got {num_queries}")
    if min_words < 1:
        raise ConfigError(f"min_query_words must be >= 1, got {min_words}")
    if max_words < min_words:
        raise ConfigError(f"max_query_words ({max_words}) must be >= min_query_words ({min_words})")
    if max_chars < 1:
        raise ConfigError(f"max_query_chars must be >= 1, got {max_chars}")


class GroupedJsonlWriter(ResumableJsonlWriter):
    """A :class:`ResumableJsonlWriter` whose records come in groups sharing ``key_field`` (a passage's queries).

    A group is written in one flushed write; on recovery the last group is dropped and redone, because a kill
    during that write could have left it incomplete (redoing costs nothing: its reply is in the cache) -- unless
    ``whole``: the ``.partial`` was just copied from a finished output, so its last group is complete.
    """

    def __init__(self, path: str | Path, key_field: str | None = None, *, whole: bool = False) -> None:
        self.whole = whole  # read by _recover, which the base class calls
        super().__init__(path, key_field)

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
        if self.key_field is None or self.count == 0 or self.whole:
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
                     max_query_chars: int = 300, max_query_words: int = 64, min_query_words: int = 2,
                     max_failure_rate: float = 0.5, shard: Shard = Shard(), beir_dir: str | Path | None = None,
                     overwrite: bool = False, progress: bool = True) -> GenerateReport:
    """Generate up to ``num_queries`` queries per passage of ``input_path`` into ``output_path`` (resumable).

    ``template`` (text with ``{title}``, ``{text}``, ``{n}``) replaces the default prompt for all passages;
    otherwise ``language`` picks English/Chinese (``auto``: by CJK share, with ``template_zh`` for Chinese).
    Each query is checked by :func:`check_query` (``min_query_words``, ``max_query_words``, ``max_query_chars``).
    Raises :class:`~robustir.errors.EndpointError` when more than ``max_failure_rate`` of the passages failed
    (the output is then left unfinished: ``OUT.partial`` keeps what was done; a finished ``OUT`` is untouched).
    """
    _check_limits(num_queries, min_query_words, max_query_words, max_query_chars)
    if language not in ("auto", "en", "zh"):
        raise ConfigError(f"language must be auto, en or zh, got {language!r}")
    input_path, output = Path(input_path), Path(output_path)
    if output.resolve() == input_path.resolve():
        raise ConfigError(f"--output {output} is the input file; choose a new file")
    if not input_path.exists():
        raise DataError(input_path, "file not found",
                        fix="give a passages JSONL (BEIR corpus.jsonl or robustir chunk output)")
    if shard.count == 1 and input_path.is_file() and _count_lines(input_path) == 0:  # a shard may well get nothing
        raise DataError(input_path, "no passages", fix='give a passages JSONL with one {"_id", "title", "text"} '
                                                       "object per line (BEIR corpus.jsonl or robustir chunk output)")
    tally = FailureTally("generate", "passages", max_failure_rate, endpoint=endpoint_of(backend))
    started = time.monotonic()
    stage = StageOutput(output)
    if overwrite:
        stage.clear()
    # A finished output is continued on a copy (failures retried, new passages appended): OUT stays as it is
    # until the copy replaces it at the end, so a failing re-run never loses it.
    copied = stage.continue_finished()
    earlier_failures = _read_failures(stage.failed) if stage.partial.exists() else []
    report = GenerateReport(output=str(output))
    total_lines = _count_lines(input_path)
    report.passages = len(range(shard.index, total_lines, shard.count))
    failures: list[dict] = []
    handled: set[str] = set()  # passages whose reply (or failure) was dealt with in this run
    failed_reasons: Counter[str] = Counter()
    rejected_reasons: Counter[str] = Counter()
    queued: deque[tuple[dict, str, str]] = deque()

    def pick_template(passage: dict) -> str:
        if template is not None:
            return template
        zh = language == "zh" or (language == "auto"
                                  and cjk_share(passage["title"] + passage["text"]) >= cjk_threshold)
        return (template_zh or DEFAULT_TEMPLATE_ZH) if zh else DEFAULT_TEMPLATE_EN

    writer = GroupedJsonlWriter(output, key_field="pos_id", whole=copied)
    written_before = writer.count
    bar = tqdm(total=report.passages, desc="generate", unit="passage", disable=not progress, dynamic_ncols=True,
               mininterval=1.0)
    seen_this_run: set[str] = set()

    def prompts() -> Iterator[str]:
        # Lazily pulled by the backend's stream, so only a window of passages is in memory at a time.
        for _, passage in shard.select(read_passages(input_path)):
            pid = passage["_id"]
            if pid in writer.done_keys:
                report.resumed += 1
                tally.earlier += 1
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
            chosen = pick_template(passage)
            prompt = render_template(chosen, {
                "title": passage["title"].strip(), "text": passage["text"].strip()[:max_passage_chars],
                "n": num_queries})
            instruction = render_template(chosen, {"title": "", "text": "", "n": num_queries})
            queued.append((passage, prompt, instruction))
            yield prompt

    finished = False
    try:
        for completion in backend.stream(prompts()):
            passage, prompt, instruction = queued.popleft()
            pid = passage["_id"]
            handled.add(pid)
            questions: list[str] = []
            if completion.ok:
                questions, rejected = select_queries(
                    completion.text or "", passage=passage["text"], instruction=instruction, num_queries=num_queries,
                    min_words=min_query_words, max_words=max_query_words, max_chars=max_query_chars)
                rejected_reasons.update(rejected)
                report.rejected += len(rejected)
            if not questions:
                if completion.ok:
                    backend.forget(prompt)  # so the next run asks again instead of reusing this reply
                    kind = "no usable query"
                    error = f"no usable query in the reply ({', '.join(sorted(set(rejected)))})"
                else:
                    kind, error = "request failed", completion.error or "request failed"
                failures.append({"_id": pid, "error": error, "reply": (completion.text or "")[:500]})
                failed_reasons[kind] += 1
                tally.failure(kind, error)
                report.failed += 1
            else:
                doc_id = passage.get("doc_id", pid)
                writer.write_group([
                    {"query": q, "pos": [passage["text"]], "neg": [], "pos_id": pid, "doc_id": doc_id,
                     "qid": f"{pid}-q{i}"} for i, q in enumerate(questions)])
                report.generated += 1
                report.queries_written += len(questions)
                tally.success()
            bar.update(1)
            tally.check(final=False, failed_path=stage.failed)
        tally.check(final=True, failed_path=stage.failed)
        finished = True
    finally:
        bar.close()
        if finished:
            writer.finish()
        else:
            writer.close()
            if copied and writer.count == written_before:
                stage.partial.unlink(missing_ok=True)  # a copy of OUT with nothing new: OUT says it all
        report.failed_reasons = dict(failed_reasons)
        report.rejected_reasons = dict(rejected_reasons)
        report.llm = backend.stats.as_dict()
        report.elapsed_s = round(time.monotonic() - started, 3)
        if not finished:  # failures of earlier runs this one did not get to are still failures
            failures = [f for f in earlier_failures if f.get("_id") not in handled] + failures
        report.failed_path = write_failed_items(stage.failed, failures, "passage(s) failed")
        if finished:
            stage.write_report(asdict(report))
    if beir_dir is not None:
        export_beir_queries(output, beir_dir)
    logger.info("generate: %s", report.summary())
    return report


def run_generate(config: GenerateConfig, input_path: str | Path | None = None,
                 output_path: str | Path | None = None, *, say: Any = None) -> GenerateReport:
    """The generation stage from its config: ``(config, input, output) -> report``, run as the step
    :data:`GENERATE` (:func:`robustir.runs.execute`: an output complete with the same settings and inputs is not
    redone; one made with others is refused, ``overwrite`` redoes it).

    ``input_path`` / ``output_path`` override ``config.input`` / ``config.output`` (the pipeline runner sets
    them); the output gets the shard suffix of ``config.shard``. Templates are loaded and checked, the
    backend is built with its reply cache (``OUT.llm-cache.sqlite`` unless ``llm.cache_path`` says otherwise)
    and, for an HTTP endpoint with ``preflight``, checked before the first passage. The CLI (``robustir
    generate``) and the runner (``robustir run``) both call this, so they cannot drift apart.
    """
    return run_llm_step(GENERATE, config, input_path, output_path, GenerateReport, say=say)


def _generate_step(config: GenerateConfig, job: Any) -> GenerateReport:
    stage = StageOutput(job.output, job.shard, reports=True)
    template, template_zh = config.templates(("text",))
    with stage_backend(config, stage.path) as backend:
        return generate_queries(
            job.inputs["input"], stage.path, backend, num_queries=config.num_queries, template=template,
            template_zh=template_zh, language=config.language, cjk_threshold=config.cjk_threshold,
            max_passage_chars=config.max_passage_chars, max_query_chars=config.max_query_chars,
            max_query_words=config.max_query_words, min_query_words=config.min_query_words,
            max_failure_rate=config.max_failure_rate, shard=stage.shard, beir_dir=config.beir_dir, overwrite=False,
            progress=config.progress)


GENERATE = llm_step("generate", GenerateConfig, _generate_step)
"""PEG's query generation as a :class:`~robustir.runs.Step`."""


def _read_failures(path: Path) -> list[dict]:
    """The passages an earlier run listed in ``OUT.failed.jsonl`` (an unreadable list counts as empty: it is only
    a record, the passages missing from the output are what a re-run retries)."""
    if not path.exists():
        return []
    try:
        return [entry for _, entry in read_jsonl(path) if isinstance(entry, dict)]
    except DataError:
        return []


def export_beir_queries(train_jsonl: str | Path, beir_dir: str | Path) -> None:
    """Write ``queries.jsonl`` and ``qrels/train.tsv`` (BEIR layout) for the queries of a generated file."""
    beir_dir = Path(beir_dir)
    with atomic_write(beir_dir / "queries.jsonl") as queries, atomic_write(beir_dir / "qrels" / "train.tsv") as qrels:
        qrels.write("query-id\tcorpus-id\tscore\n")
        for _, record in read_jsonl(train_jsonl):
            queries.write(json.dumps({"_id": record["qid"], "text": record["query"]}, ensure_ascii=False) + "\n")
            qrels.write(f"{record['qid']}\t{record['pos_id']}\t1\n")
