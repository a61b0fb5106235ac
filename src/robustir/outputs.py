"""The stage-output protocol: one object owns an output's sidecar files, its completion rule, its shards and
their merge.

Every data stage (chunk, pairs, generate, mine, filter) writes one JSONL output ``OUT`` -- or, as shard ``i`` of
``n`` (``--shard i/n``), ``OUT.shard-0000i-of-0000n.jsonl`` -- and these sidecars next to it:

==========================  =====================================================================================
``OUT.partial``             records written so far (:class:`~robustir.io.ResumableJsonlWriter`); renamed to
                            ``OUT`` when the stage finishes, so ``OUT`` never holds a half-written file. A re-run
                            over a finished ``OUT`` (to retry failures) writes here too: ``OUT`` stays in place,
                            unchanged, until the new file replaces it atomically
``OUT.done``                per-document progress of document stages (:class:`~robustir.data.documents.DocumentOutput`),
                            removed on finish
``OUT.report.json``         the stage's report, written after the rename (stages that report)
``OUT.failed.jsonl``        items still to retry (query generation, LLM judge); a re-run retries them
``OUT.llm-cache.sqlite``    the LLM reply cache of LLM stages (kept by ``clear``: those replies are paid for)
``OUT.run.json``            the record (:class:`robustir.runs.Artifact`) of the fingerprint every data stage (a
                            :class:`robustir.runs.Step` run by :func:`robustir.runs.execute`: chunk, pairs,
                            generate, mine, filter) made ``OUT`` with: a re-run with other settings or inputs is
                            refused (or, in ``robustir run``, redone), not reused or resumed
==========================  =====================================================================================

**Complete** means: ``OUT`` exists, neither ``.partial`` nor ``.done`` does, no ``.failed.jsonl`` (unless failures
are accepted) and, for a stage that reports, ``.report.json`` exists. :meth:`StageOutput.problems` says what is
missing in words; the output's record (:attr:`StageOutput.record`) folds it into the one "done?" rule
(:meth:`robustir.runs.Artifact.decide`), and ``robustir merge`` uses it for the shards.

Merging (:meth:`StageOutput.merge`) concatenates the ``n`` shards in shard order (with round-robin sharding
this is not the input order) after checking every one is complete -- when *any* shard has a report, every shard
needs one, since the stage is not recorded in the files -- writes ``OUT`` atomically, and combines the shard
reports into ``OUT.report.json`` (numbers summed where every shard has them, the shard reports kept as a list).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, DataError
from .io import Shard, atomic_write, write_json
from .runs import RECORD, Artifact, Check, Fingerprint

logger = logging.getLogger(__name__)

__all__ = ["StageOutput", "MergeResult", "check_output_file", "refuse_overwriting_inputs", "refuse_run_over_inputs",
           "stage_step"]

PARTIAL, DONE, REPORT, FAILED, LLM_CACHE = ".partial", ".done", ".report.json", ".failed.jsonl", ".llm-cache.sqlite"
_STATS = {"mean", "min", "max", "median", "p25", "p75"}  # per-shard statistics do not add up: kept per shard


def refuse_overwriting_inputs(output: str | Path, *inputs: str | Path | None, stage: str = "this stage") -> None:
    """Raise :class:`ConfigError` when writing ``output`` (or its ``.partial``) would replace or corrupt an input.

    Paths are compared after resolving symlinks. An input folder is protected where its reader looks: a BEIR folder
    (one with ``corpus.jsonl``) in ``corpus.jsonl(.gz)``, ``queries.jsonl`` and ``qrels/``; any other folder (read as
    its ``*.jsonl`` / ``*.jsonl.gz`` files) at its top level.
    """
    out = Path(output).expanduser().resolve()
    written = {out, out.with_name(out.name + PARTIAL)}
    for item in inputs:
        if item is None:
            continue
        source = Path(item).expanduser().resolve()
        if source in written:
            raise ConfigError(f"{stage}: the output {output} is the input {item}; stages never overwrite their "
                              "input: write to a new file")
        if not source.is_dir() or source not in out.parents:
            continue
        # a BEIR folder's files (data.beir.is_beir_folder's rule, written here: outputs sits below data/)
        if (source / "corpus.jsonl").exists() or (source / "corpus.jsonl.gz").exists() or (source / "qrels").is_dir():
            relative = out.relative_to(source)
            read = (relative.parts[0] == "qrels" or str(relative) in ("corpus.jsonl", "corpus.jsonl.gz", "queries.jsonl"))
        else:
            read = out.parent == source and (out.name.endswith(".jsonl") or out.name.endswith(".jsonl.gz"))
        if read:
            raise ConfigError(f"{stage}: the output {output} lies where the input folder {item} is read from; a "
                              "re-run would read it as input. Write it outside that folder")


def refuse_run_over_inputs(output: str | Path, *, models: dict[str, str | Path | None] | None = None,
                           data: dict[str, str | Path | None] | None = None,
                           rewritten: tuple[str, ...] = ("model", "checkpoints"), stage: str = "this stage") -> None:
    """Raise :class:`ConfigError` when a run folder (train, pretrain) would write into what the run reads.

    ``models`` (name -> folder, e.g. the starting model, digested whole for the run fingerprint): the output is not
    the folder nor inside it, and the folder does not lie where a new run deletes and rewrites (``OUT`` itself is
    fine to hold it, ``OUT/model`` and ``OUT/checkpoints`` are not). ``data`` (name -> file or folder): the output is
    not it (the run's own ``*.jsonl`` files would be read as data the next time). Names that are not local paths
    (hub ids) are skipped.
    """
    out = Path(output).expanduser().resolve()
    for name, item in (models or {}).items():
        if not item or not Path(item).expanduser().exists():
            continue
        source = Path(item).expanduser().resolve()
        if source == out or source in out.parents:
            raise ConfigError(f"{stage}: the output folder {output} is {'' if source == out else 'inside '}the {name} "
                              f"folder {item}; the run would write into what it reads: choose another output folder")
        for part in rewritten:
            if source == out / part or (out / part) in source.parents:
                raise ConfigError(f"{stage}: the {name} {item} lies in {out / part}, which a run in {output} deletes "
                                  "and rewrites: copy it elsewhere first, or choose another output folder")
    for name, item in (data or {}).items():
        if item and Path(item).expanduser().exists() and Path(item).expanduser().resolve() == out:
            raise ConfigError(f"{stage}: the output folder {output} is the {name} {item}; the run's own files would "
                              "be read as data: choose another output folder")


def stage_step(name: str, config: type, run: Any, *, reports: bool = False, inputs: Any = None,
               settings: Any = None, check: Any = None) -> Any:
    """A data stage's :class:`~robustir.runs.Step` (registered): its output is the JSONL file ``job.output`` (the
    shard's file of it) as a :class:`StageOutput` (``reports``: it writes ``OUT.report.json`` last); before it runs,
    an output over one of ``job.inputs`` is refused (:func:`refuse_overwriting_inputs`) and ``check`` runs."""
    from .runs import Step, register

    def output(options: Any, job: Any) -> Artifact:
        return StageOutput(job.output, job.shard, reports=reports).record

    def refuse(options: Any, job: Any) -> None:
        target = StageOutput(job.output, job.shard, reports=reports).path
        refuse_overwriting_inputs(target, *[path for key, path in job.inputs.items() if not key.endswith("model")],
                                  stage=name)
        if check is not None:
            check(options, job)

    extra = {key: value for key, value in (("inputs", inputs), ("settings", settings)) if value is not None}
    return register(Step(name, config, output=output, run=run, check=refuse, **extra))


def check_output_file(output: str | Path, what: str = "output") -> None:
    """Raise :class:`ConfigError` when ``output`` cannot name the file a stage writes: empty (or ``.``), an existing
    folder, or a ``.gz`` name (outputs are written uncompressed, so the name would lie to every later reader)."""
    path = Path(output)
    if not str(output).strip() or path.name in ("", ".", ".."):
        raise ConfigError(f"{what} {str(output)!r} names no file; give a file name such as out.jsonl")
    if path.is_dir():
        raise ConfigError(f"{what} {output} is a folder; a stage writes one file: name it, e.g. {path / 'out.jsonl'}")
    if path.suffix == ".gz":
        raise ConfigError(f"{what} {output}: outputs are written uncompressed, so a .gz name would hold plain text; "
                          f"name it {path.with_suffix('')} (and compress it afterwards if you like)")


@dataclass
class MergeResult:
    output: Path
    shards: int
    lines: int
    report: Path | None


@dataclass(frozen=True)
class StageOutput:
    """The output ``base`` of a stage, as written by ``shard`` (the whole output when not sharded).

    ``reports``: the stage writes ``.report.json`` last, so the output is complete only with it.
    """

    base: Path
    shard: Shard = field(default_factory=Shard)
    reports: bool = False

    def __init__(self, base: str | Path, shard: Shard | str | None = None, *, reports: bool = False) -> None:
        check_output_file(base)
        object.__setattr__(self, "base", Path(base))
        object.__setattr__(self, "shard", shard if isinstance(shard, Shard) else Shard.parse(shard))
        object.__setattr__(self, "reports", reports)

    # ------------------------------------------------------------------ names
    @property
    def path(self) -> Path:
        """The file this shard writes: ``out.jsonl`` -> ``out.shard-00002-of-00008.jsonl`` for shard 2/8."""
        if self.shard.count == 1:
            return self.base
        return self.base.with_name(self.base.stem + self.shard.suffix() + self.base.suffix)

    def sidecar(self, suffix: str) -> Path:
        return self.path.with_name(self.path.name + suffix)

    @property
    def partial(self) -> Path:
        return self.sidecar(PARTIAL)

    @property
    def done(self) -> Path:
        return self.sidecar(DONE)

    @property
    def report(self) -> Path:
        return self.sidecar(REPORT)

    @property
    def failed(self) -> Path:
        return self.sidecar(FAILED)

    @property
    def llm_cache(self) -> Path:
        return self.sidecar(LLM_CACHE)

    # ------------------------------------------------------------------ state
    def problems(self, *, allow_failures: bool = False, need_report: bool | None = None) -> list[str]:
        """Why this output is not complete, in words (empty when it is)."""
        need_report = self.reports if need_report is None else need_report
        if not self.path.exists():
            return ["missing" if not self.partial.exists() else
                    "unfinished (only a .partial file: the stage is running or was interrupted)"]
        problems = []
        if self.partial.exists():
            problems.append("being redone (a .partial file exists next to it)")
        if self.done.exists():
            problems.append("unfinished (its .done progress file still exists)")
        if self.failed.exists() and not allow_failures:
            problems.append(f"has failed items to retry ({self.failed.name}; re-run the stage, or merge with "
                            "--allow-failures)")
        if need_report and not self.report.exists():
            problems.append("no .report.json (the stage did not finish)")
        return problems

    def complete(self, *, allow_failures: bool = False) -> bool:
        return not self.problems(allow_failures=allow_failures)

    @property
    def record(self) -> Artifact:
        """The output's record (:class:`robustir.runs.Artifact`, ``OUT.run.json``): the fingerprint it is made with;
        it is complete only when the record says so *and* no ``.partial`` / ``.done`` / ``.failed.jsonl`` /
        missing report says otherwise, and clearing it clears every sidecar but the LLM reply cache."""
        return _StageRecord(self)

    def clear(self) -> None:
        """Remove the output, its resume files, report and record (``--overwrite``); the LLM reply cache stays."""
        for path in (self.path, self.partial, self.done, self.report, self.failed,
                     self.path.with_name(self.path.name + RECORD)):
            path.unlink(missing_ok=True)

    def continue_finished(self) -> bool:
        """Continue a finished output (a re-run that retries failures): copy it to ``.partial`` (atomically).

        ``OUT`` itself is never removed or renamed: it stays as it is until the stage finishes and its new
        ``.partial`` replaces it atomically, so a re-run that fails leaves the finished output in place. Returns
        True when the copy was made (False: no finished output, or a ``.partial`` to resume exists already).
        """
        if not self.path.exists() or self.partial.exists():
            return False
        with atomic_write(self.partial, "wb", encoding=None) as handle, open(self.path, "rb") as source:
            shutil.copyfileobj(source, handle)
        return True

    def write_report(self, report: dict) -> Path:
        write_json(self.report, report)
        return self.report

    # ------------------------------------------------------------------ shards
    def shards(self, count: int) -> list["StageOutput"]:
        return [StageOutput(self.base, Shard(i, count), reports=self.reports) for i in range(count)]

    def shard_counts(self) -> dict[int, list[Path]]:
        """Shard files of this output (finished or not) grouped by their shard count ``n``."""
        base = self.base
        pattern = re.compile(re.escape(base.stem) + r"\.shard-(\d{5})-of-(\d{5})" + re.escape(base.suffix)
                             + r"(\.partial|\.done)?$")
        found: dict[int, set[Path]] = {}
        if not base.parent.exists():
            return {}
        for candidate in base.parent.iterdir():
            match = pattern.match(candidate.name)
            if match:
                final = candidate.with_name(candidate.name[: len(candidate.name) - len(match.group(3) or "")])
                found.setdefault(int(match.group(2)), set()).add(final)
        return {n: sorted(paths) for n, paths in found.items()}

    def merge(self, count: int | None = None, allow_failures: bool = False) -> MergeResult:
        """Concatenate the ``count`` complete shards into :attr:`base` (atomically) and merge their reports.

        ``count`` is found from the file names when not given. Raises :class:`ConfigError` listing every missing
        or incomplete shard, so nothing is merged from a partial set.
        """
        output = self.base
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ConfigError(f"shards = {count!r} is out of range: it must be >= 1 (the N of --shard I/N)")
        if count is None:
            groups = self.shard_counts()
            if not groups:
                raise ConfigError(f"no shard files of {output} (expected names like "
                                  f"{output.stem}.shard-00001-of-00004{output.suffix} next to it)")
            if len(groups) > 1:
                raise ConfigError(f"shard files of {output} from several shard counts ({sorted(groups)}); "
                                  "pass --shards N to choose, and delete the stale ones")
            count = next(iter(groups))
        shards = self.shards(count)
        any_report = self.reports or any(s.report.exists() for s in shards)
        bad = [(s, problems) for s in shards
               if (problems := s.problems(allow_failures=allow_failures, need_report=any_report))]
        if bad:
            lines = "\n".join(f"  shard {s.shard} {s.path.name}: {'; '.join(p)}" for s, p in bad)
            raise ConfigError(f"cannot merge {output}: {len(bad)} of {count} shards are missing or incomplete:\n"
                              f"{lines}\n  Fix: run (or finish) those shards with --shard I/{count}, then merge again")
        total = 0
        with atomic_write(output, "wb", encoding=None) as handle:
            for shard in shards:
                with open(shard.path, "rb") as shard_file:
                    for raw in shard_file:
                        if raw.strip():
                            handle.write(raw if raw.endswith(b"\n") else raw + b"\n")
                            total += 1
        merged = StageOutput(output)
        report = _merge_reports(merged, shards) if any_report else None
        failed = [s.failed for s in shards if s.failed.exists()]  # carried over when they were accepted
        if failed:
            with atomic_write(merged.failed, "wb", encoding=None) as handle:
                for path in failed:
                    with open(path, "rb") as src:
                        shutil.copyfileobj(src, handle)
        return MergeResult(output, count, total, report)


def _merge_reports(output: StageOutput, shards: list[StageOutput]) -> Path:
    reports = []
    for shard in shards:
        try:
            reports.append(json.loads(shard.report.read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            raise DataError(shard.report, f"invalid JSON ({exc.msg})", fix="re-run that shard to rewrite its report") from None
    merged: dict = {"merged_from": [str(s.path) for s in shards]}
    for key, value in reports[0].items():
        values = [r.get(key) for r in reports]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            merged[key] = sum(values)  # counts add up; so do elapsed seconds (total work)
        elif all(isinstance(v, dict) and not _STATS.intersection(v) for v in values) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for v in values for x in v.values()):
            keys = dict.fromkeys(k for v in values for k in v)
            merged[key] = {k: sum(v.get(k, 0) for v in values) for k in keys}
    merged["shard_reports"] = reports
    return output.write_report(merged)


class _StageRecord(Artifact):
    """A :class:`StageOutput`'s record: :class:`~robustir.runs.Artifact` with the stage file's own sidecars folded
    into "complete" (a recorded-complete output with a ``.partial`` or failures to retry is *started*) and into
    :meth:`clear`."""

    def __init__(self, stage: StageOutput) -> None:
        super().__init__(stage.path, what="stage output")
        self.stage = stage

    def check(self, fp: Fingerprint | None = None) -> Check:
        check = super().check(fp)
        if check.state == "missing" and self.stage.partial.exists() and check.recorded:
            return Check("started", check.differences)
        if check.state == "complete" and self.stage.problems():
            return Check("started", check.differences, recorded=check.recorded)
        return check

    def clear(self) -> None:
        self.stage.clear()

    def started_where(self) -> str:
        return " (a .partial file)" if self.stage.partial.exists() else ""

    def finish(self, report: dict | None = None, **kwargs: Any) -> None:
        """Recorded complete only when the stage file is (no failures left to retry, its report written); the
        record's report is the stage's ``OUT.report.json`` when it wrote one."""
        if not self.stage.complete():
            return
        if self.stage.report.exists():
            report = json.loads(self.stage.report.read_text(encoding="utf-8"))
        super().finish(report, **kwargs)
