"""A stage as one shape: a :class:`Step` -- its name, its options (a pydantic config), what it reads and how it
runs -- and :func:`execute`, the one way any caller (the CLI, ``robustir run``, the noise bench, the Python API)
runs a step: the output's :class:`~robustir.runs.Artifact` decides "done, with these settings and inputs?"
(:meth:`Artifact.begin`), the step runs only when it is not, and the artifact is recorded complete after it.

Where one run of a step reads and writes -- its input files, its output, its shard, the few settings that are not
options of the config (an input format, a BEIR split) -- is a :class:`Job`, so the options config stays what the
config files and flags describe and one step serves every caller. Each step is defined next to the stage it runs
and registered in :data:`STEPS` when its module is imported; :mod:`robustir.steps` imports them all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Literal, Mapping, TypeVar

from .artifact import Artifact
from .fingerprint import Fingerprint, fingerprint, settings_of

__all__ = ["Job", "Step", "StepResult", "STEPS", "execute", "register"]

logger = logging.getLogger(__name__)

C = TypeVar("C")


@dataclass(frozen=True)
class Job:
    """Where one run of a step reads and writes: ``inputs`` (name -> path or hub id; read by content, a name
    ending in ``model`` as a model), the ``output`` path, the ``shard`` (``"I/N"``) and ``settings`` that decide
    the result without being options of the step's config (``format``, ``split``, encoder overrides), and
    ``runtime``: what the run needs that decides nothing and is never recorded nor shown (an object store's
    credentials and endpoint: ``{"storage_options": {...}}``)."""

    output: str
    inputs: Mapping[str, Any] = field(default_factory=dict)
    shard: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    runtime: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Step(Generic[C]):
    """One stage: ``name``, its options ``config`` (a class), ``output(config, job) -> Artifact`` (where its
    result and record live), ``run(config, job) -> report`` (does the work; the report is recorded with the
    output) and ``check(config, job)`` (refusals before anything runs: an output over an input, a missing
    option). ``inputs(config, job)`` names what the step reads beyond ``job.inputs`` (a model or template file
    named by the config); ``settings(config, job)`` what of the config decides the result (default: every field
    not marked operational)."""

    name: str
    config: type
    output: Callable[[Any, Job], Artifact]
    run: Callable[[Any, Job], Any]
    check: Callable[[Any, Job], None] = lambda config, job: None
    inputs: Callable[[Any, Job], Mapping[str, Any]] = lambda config, job: {}
    settings: Callable[[Any, Job], Any] = lambda config, job: settings_of(config)
    decides: Callable[[Any], bool] | None = None
    """Set for a step whose output answers "done?" inside its own run, through the same rule
    (:meth:`Artifact.decide`) on its own record: training and pre-training (under ``torchrun`` every process
    must reach the same decision with barriers around it, and the run folder keeps checkpoints the rule weighs as
    work) and the search index (its manifest is the record readers follow, swapped atomically with a rebuild).
    :func:`execute` then calls ``run(config, job, on_change=..., overwrite=...)`` and ``decides(report)`` says
    whether the run found its output complete with these settings and inputs (nothing done)."""

    def fingerprint(self, config: C, job: Job, *, upstream: Mapping[str, Any] | None = None,
                    cache: dict | None = None) -> Fingerprint:
        """What this run's output depends on: the step's settings and the job's, the content of every input and
        model (:func:`robustir.runs.fingerprint`), the ``upstream`` outputs."""
        settings = self.settings(config, job)
        settings = {**(settings if isinstance(settings, dict) else {"options": settings}),
                    **settings_of(dict(job.settings))}
        return fingerprint(self.name, settings, {**job.inputs, **self.inputs(config, job)}, upstream, cache=cache)


@dataclass
class StepResult:
    """What :func:`execute` did: ``skipped`` (complete already, with these settings: ``report`` is the recorded
    one, a dict) or ran (``report`` is the step's own report object)."""

    step: str
    artifact: Artifact
    fingerprint: Fingerprint | None
    report: Any
    skipped: bool


STEPS: dict[str, Step] = {}


def register(step: Step) -> Step:
    if step.name in STEPS and STEPS[step.name] is not step:
        raise ValueError(f"a step named {step.name!r} is registered already")
    STEPS[step.name] = step
    return step


def execute(step: Step, config: Any, job: Job, *, overwrite: bool = False,
            on_change: Literal["refuse", "redo"] | None = None, upstream: Mapping[str, Any] | None = None,
            cache: dict | None = None, say: Callable[[str], None] | None = print) -> StepResult:
    """Run ``step`` with ``config`` on ``job`` unless its output is complete with the same fingerprint.

    An output made (or started) with other settings or inputs is refused naming what differs
    (``on_change="refuse"``, the CLI's rule and the default; ``overwrite`` redoes it) or made again (``"redo"``); a
    started one with the same fingerprint is resumed by the step. ``say`` prints the "nothing to do" line (None: log
    it). A step that :attr:`~Step.decides` itself gets ``on_change`` (None: its config's own) and ``overwrite``."""
    step.check(config, job)
    if step.decides is not None:
        report = step.run(config, job, on_change=on_change, overwrite=overwrite)
        artifact = step.output(config, job)
        skipped = bool(step.decides(report))
        if skipped:
            text = f"robustir {step.name}: {artifact.path} is complete; nothing to do"
            say(text) if say is not None else logger.info(text)
        return StepResult(step.name, artifact, artifact.fingerprint, report, skipped=skipped)
    artifact = step.output(config, job)
    made = step.fingerprint(config, job, upstream=upstream, cache=cache)
    if artifact.begin(made, on_change=on_change or "refuse", overwrite=overwrite):
        text = f"robustir {step.name}: {artifact.path} is complete; nothing to do (--overwrite to redo)"
        say(text) if say is not None else logger.info(text)
        return StepResult(step.name, artifact, made, artifact.report, skipped=True)
    report = step.run(config, job)
    artifact.finish(_as_record(report))
    return StepResult(step.name, artifact, made, report, skipped=False)


def _as_record(report: Any) -> dict:
    """A report as JSON-ready data for the output's record."""
    if report is None:
        return {}
    if isinstance(report, dict):
        return report
    for method in ("to_dict", "as_dict"):
        if callable(getattr(report, method, None)):
            return getattr(report, method)()
    import dataclasses

    return settings_of(dataclasses.asdict(report)) if dataclasses.is_dataclass(report) else {"report": str(report)}
