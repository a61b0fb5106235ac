"""What the LLM stages (query generation, the LLM judge) share: prompt templates, :class:`LLMStageConfig`, the
backend opener (:func:`build_backend`, :func:`stage_backend`) and the failed-items rule (:class:`FailureTally`)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterable, Iterator, Literal

from ..errors import ConfigError, EndpointError
from ..validation import cli, config_dataclass, Fraction, PositiveInt
from .base import LLMBackend
from .cache import LLMCache
from .client import LLMClient
from .config import LLMConfig
from .hf import HFGenerator
from ..runs import operational

logger = logging.getLogger(__package__)


def build_backend(config: LLMConfig, *, cache_path: str | Path | None = None) -> LLMBackend:
    """The backend ``config.backend`` names, with the cache at ``config.cache_path`` (else ``cache_path``)."""
    path = config.cache_path or cache_path
    cache = LLMCache(path) if path and str(path).lower() not in ("none", "off", "false") else None
    if config.backend == "hf":
        if not config.model:
            raise ConfigError("llm.model is empty: for backend hf give a local model folder or Hub id")
        return HFGenerator(config.model, max_new_tokens=config.max_tokens, temperature=config.temperature,
                           top_p=config.top_p if config.top_p is not None else 1.0, batch_size=config.batch_size,
                           device=config.device, dtype=config.dtype, seed=config.seed, cache=cache,
                           on_failure=config.on_failure, system_prompt=config.system_prompt,
                           trust_remote_code=config.trust_remote_code)
    return LLMClient(config, cache=cache)



# ----------------------------------------------------------------------------------------------- prompts

def render_template(template: str, values: dict[str, object]) -> str:
    """Replace ``{name}`` placeholders literally (other braces, e.g. JSON examples, are left alone).

    A line whose only variable content is an empty value (e.g. ``Title: {title}`` for a passage without a
    title) is left out, so prompts never show dangling labels.
    """
    lines = []
    for line in template.splitlines(keepends=True):
        names = [name for name in values if "{" + name + "}" in line]
        if names and all(str(values[name]).strip() == "" for name in names):
            continue
        for name in names:
            line = line.replace("{" + name + "}", str(values[name]))
        lines.append(line)
    return "".join(lines)


def load_template(path: str | Path, required: tuple[str, ...]) -> str:
    """Read a prompt template file and check it has the ``required`` placeholders."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"prompt template {path} not found")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"prompt template {path} is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as "
                          "UTF-8") from None
    missing = [name for name in required if "{" + name + "}" not in text]
    if missing:
        raise ConfigError(f"prompt template {path}: missing placeholder(s) "
                          f"{', '.join('{' + m + '}' for m in missing)}; the passage would never reach the LLM")
    return text


# ------------------------------------------------------------------------------------------- LLM stages

@config_dataclass
class LLMStageConfig:
    """What every LLM stage takes (query generation, the judge): files, prompts and their language, sharding,
    the endpoint. The stages' configs extend it (:class:`robustir.queries.generate.GenerateConfig`,
    :class:`robustir.filtering.llm_judge.JudgeConfig`)."""

    input: str = ""
    """Input JSONL (passages for generation, training records for the judge)."""
    output: str = ""
    """JSONL to write (training records)."""
    prompt_template: str | None = None
    """Template file used for every item (its placeholders: see the stage); default: built-in English/Chinese."""
    prompt_template_zh: str | None = None
    """Template file for Chinese items when the language is chosen automatically."""
    language: Literal["auto", "en", "zh"] = "auto"
    """Prompt language; ``auto`` chooses per item by its share of CJK letters."""
    cjk_threshold: Fraction = 0.3
    """``auto``: items whose letters are at least this share CJK get the Chinese prompt."""
    max_passage_chars: PositiveInt = 4000
    """Passage text is cut to this many characters inside the prompt (the records keep the full text)."""
    shard: str | None = operational(None)
    """``I/N``: process shard I of N of the items (the output gets a ``.shard-I-of-N`` suffix)."""
    overwrite: bool = operational(False)
    """Start afresh instead of resuming."""
    progress: bool = operational(True)
    """Show a progress bar."""
    preflight: bool = operational(True)
    """Check the endpoint (its model list) before starting, for a fast clear error when it is unreachable."""
    max_failure_rate: Fraction = operational(0.5)
    """The stage fails (and its output is not finished) when more than this share of its items failed: after the
    run, or as soon as 20 items were tried in this run (``MIN_ITEMS_FOR_RATE``). Items finished by earlier runs count in
    the share. 0 = any failure fails the stage; 1 = never."""
    llm: Annotated[LLMConfig, cli(flatten=True)] = field(default_factory=LLMConfig)
    """The endpoint; the reply cache defaults to ``OUT.llm-cache.sqlite`` (``llm.cache_path=none`` disables it)."""

    def templates(self, required: tuple[str, ...]) -> tuple[str | None, str | None]:
        """The prompt templates given as files, loaded and checked for the ``required`` placeholders."""
        return (load_template(self.prompt_template, required) if self.prompt_template else None,
                load_template(self.prompt_template_zh, required) if self.prompt_template_zh else None)


def llm_step(name: str, config: type, run: Any) -> Any:
    """An LLM stage's :class:`~robustir.runs.Step` (``generate``, ``filter llm``): its fingerprint is the stage's
    settings without the operational ones (concurrency, timeouts, retries, the key) and without where its files
    are, the content of its input and of its template files; so another model, temperature, prompt template (by
    content), input, judge or stage option redoes the work (it used to be kept silently: "0 passages done now"),
    while identical requests are still answered from the reply cache. ``run(config, job)`` writes the output."""
    import dataclasses

    from ..outputs import stage_step
    from ..runs import settings_of

    return stage_step(name, config, run, reports=True,
                      settings=lambda options, job: settings_of(dataclasses.replace(options, input="", output="")),
                      inputs=lambda options, job: {"prompt_template": options.prompt_template,
                                                   "prompt_template_zh": options.prompt_template_zh})


def run_llm_step(step: Any, config: LLMStageConfig, input_path: str | Path | None, output_path: str | Path | None,
                 report_type: type, *, say: Any = None) -> Any:
    """Run an LLM step (:func:`robustir.runs.execute`) on ``input_path`` -> ``output_path`` (default: the
    config's ``input`` / ``output``); ``overwrite`` redoes a complete output. Returns the stage's report (a
    complete output's recorded one, as ``report_type``, when there was nothing to do)."""
    import dataclasses

    from ..runs import Job, execute

    source = input_path if input_path is not None else config.input
    target = output_path if output_path is not None else config.output
    if not source or not target:
        raise ConfigError(f"{step.name}: give the input and the output file (input: / output:)")
    config = dataclasses.replace(config, input=str(source), output=str(target))
    result = execute(step, config, Job(str(target), {"input": source}, config.shard), overwrite=config.overwrite,
                     say=say)
    if not result.skipped:
        return result.report
    known = {f.name for f in dataclasses.fields(report_type)}
    return report_type(**{key: value for key, value in result.report.items() if key in known})


@contextmanager
def stage_backend(config: LLMStageConfig, output: str | Path) -> Iterator[LLMBackend]:
    """The stage's backend, with its reply cache next to ``output`` and, for an HTTP endpoint with
    ``preflight``, the endpoint and model checked before the first request; closed on exit."""
    from ..outputs import StageOutput

    backend = build_backend(config.llm, cache_path=StageOutput(output).llm_cache)
    with backend:
        if config.preflight and isinstance(backend, LLMClient):
            backend.preflight()
        yield backend


# ------------------------------------------------------------------------------------ failed items of a stage

MIN_ITEMS_FOR_RATE = 20
"""Items a run must have tried before ``max_failure_rate`` can stop it early (at the end it always applies)."""


def check_failure_rate(rate: float) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise ConfigError(f"max_failure_rate must be a share between 0 and 1 (0.5 = half the items may fail), "
                          f"got {rate!r}")
    return float(rate)


@dataclass
class FailureTally:
    """Tried and failed items of one LLM-stage run, and the ``max_failure_rate`` rule that stops it.

    ``earlier`` counts items finished by earlier runs (resumed): they are part of the output, so they count in the
    share. ``reasons`` counts failures by kind (for the report); ``errors`` by message (for the error text).
    """

    stage: str
    unit: str
    max_rate: float
    endpoint: str = ""
    earlier: int = 0
    tried: int = 0
    failed: int = 0
    reasons: "Counter[str]" = field(default_factory=lambda: Counter())
    errors: "Counter[str]" = field(default_factory=lambda: Counter())

    def __post_init__(self) -> None:
        self.max_rate = check_failure_rate(self.max_rate)

    def success(self) -> None:
        self.tried += 1

    def failure(self, reason: str, error: str | None = None) -> None:
        self.tried += 1
        self.failed += 1
        self.reasons[reason] += 1
        self.errors[(error or reason).splitlines()[0] if (error or reason) else reason] += 1

    @property
    def rate(self) -> float:
        total = self.tried + self.earlier
        return self.failed / total if total else 0.0

    def check(self, *, final: bool, failed_path: str | Path | None = None) -> None:
        """Raise :class:`EndpointError` when the failed share is above ``max_rate`` (during the run only once
        :data:`MIN_ITEMS_FOR_RATE` items were tried)."""
        if not self.failed or (not final and self.tried < MIN_ITEMS_FOR_RATE) or self.rate <= self.max_rate:
            return
        total = self.tried + self.earlier
        error, count = self.errors.most_common(1)[0]
        when = "" if final else f", stopped after {self.tried} tried in this run"
        where = f" (llm.base_url/llm.model: {self.endpoint})" if self.endpoint else ""
        listed = f" and the failures listed in {failed_path}" if failed_path else ""
        raise EndpointError(
            f"{self.stage}: {self.failed} of {total} {self.unit} failed ({self.rate:.0%}, more than "
            f"max_failure_rate={self.max_rate:g}{when}); commonest error ({count}x): {error}. The output is not "
            f"finished; what did finish is kept for the next run.\n"
            f"  Fix: check the endpoint and model{where}{listed}, then re-run (failed {self.unit} are retried); "
            f"or raise max_failure_rate to accept more failures")

    def summary(self) -> str:
        """"3 failed (2 request failed, 1 unparseable reply)" style counts, or "" when none failed."""
        return ", ".join(f"{n} {reason}" for reason, n in self.reasons.most_common())


def endpoint_of(backend: Any) -> str:
    """``base_url`` and model of a backend, for error messages."""
    url = getattr(backend, "base_url", None)
    model = getattr(backend, "model", "")
    return f"{url} {model!r}" if url else repr(model)


def write_failed_items(path: str | Path, items: Iterable[dict], what: str) -> str | None:
    """Write the failed items of a stage to ``path`` (``OUT.failed.jsonl``) atomically, or remove it when there
    are none (the earlier failures were retried successfully). ``what`` names them in the warning ("passage(s)
    failed"). Returns the path when written."""
    from ..io import atomic_write

    path = Path(path)
    items = list(items)
    if not items:
        path.unlink(missing_ok=True)
        return None
    with atomic_write(path) as handle:
        for item in items:
            handle.write(json.dumps(item, ensure_ascii=False) + "\n")
    logger.warning("%d %s; listed in %s and retried on the next run", len(items), what, path)
    return str(path)
