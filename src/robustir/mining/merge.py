"""Merge the shard files of a stage into one output, after checking every shard is complete.

Shard files are named by :func:`robustir.data.documents.sharded_path`: ``out.jsonl`` ->
``out.shard-00002-of-00008.jsonl``. How each stage marks completion (and what this module checks):

=================  ===========================================================================================
stage              shard ``S`` is complete when
=================  ===========================================================================================
chunk, pairs       ``S`` exists, and neither ``S.partial`` nor ``S.done`` (the per-document progress file,
                   removed on finish) does
generate           ``S`` exists, no ``S.partial``, ``S.report.json`` exists, and no ``S.failed.jsonl`` (passages
                   still to retry; ``allow_failures`` accepts them)
mine, filter       ``S`` exists, no ``S.partial``, and ``S.report.json`` exists (written after the rename)
=================  ===========================================================================================

The stage is not recorded in the files, so the rule is: final file present, no ``.partial`` / ``.done``, no
``.failed.jsonl``, and -- when *any* shard has a ``.report.json`` -- every shard has one.

Lines are concatenated in shard order (shard 1's records, then shard 2's, ...); with round-robin sharding this
is not the input order. The merged file is written atomically, and the shard reports are combined into
``<output>.report.json`` (numbers summed where every shard has them, plus the list of shard reports).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, DataError
from ..io import atomic_write, write_json

__all__ = ["ShardStatus", "MergeResult", "find_shards", "shard_status", "output_complete", "merge_shards"]


@dataclass
class ShardStatus:
    index: int  # 1-based
    count: int
    path: Path
    problems: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.problems


@dataclass
class MergeResult:
    output: Path
    shards: int
    lines: int
    report: Path | None


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def output_complete(path: str | Path, need_report: bool = False) -> bool:
    """Is the (unsharded) output of a stage complete? See the table in the module doc."""
    path = Path(path)
    if not path.exists() or _sibling(path, ".partial").exists() or _sibling(path, ".done").exists():
        return False
    if _sibling(path, ".failed.jsonl").exists():
        return False
    return not need_report or _sibling(path, ".report.json").exists()


def find_shards(output: str | Path) -> dict[int, list[Path]]:
    """Shard files of ``output`` (finished or not) grouped by their shard count ``n``."""
    output = Path(output)
    pattern = re.compile(re.escape(output.stem) + r"\.shard-(\d{5})-of-(\d{5})" + re.escape(output.suffix)
                         + r"(\.partial|\.done)?$")
    found: dict[int, set[Path]] = {}
    if not output.parent.exists():
        return {}
    for candidate in output.parent.iterdir():
        match = pattern.match(candidate.name)
        if match:
            final = candidate.with_name(candidate.name[: len(candidate.name) - len(match.group(3) or "")])
            found.setdefault(int(match.group(2)), set()).add(final)
    return {n: sorted(paths) for n, paths in found.items()}


def shard_status(output: str | Path, count: int, allow_failures: bool = False) -> list[ShardStatus]:
    """The completion status of shards 1..``count`` of ``output``."""
    from ..data.documents import sharded_path
    from ..io import Shard

    statuses = [ShardStatus(i + 1, count, sharded_path(output, Shard(i, count))) for i in range(count)]
    for status in statuses:
        path = status.path
        if not path.exists():
            status.problems.append("missing" if not _sibling(path, ".partial").exists() else
                                   "unfinished (only a .partial file: the stage is running or was interrupted)")
            continue
        if _sibling(path, ".partial").exists():
            status.problems.append("being redone (a .partial file exists next to it)")
        if _sibling(path, ".done").exists():
            status.problems.append("unfinished (its .done progress file still exists)")
        if _sibling(path, ".failed.jsonl").exists() and not allow_failures:
            status.problems.append(f"has failed items to retry ({_sibling(path, '.failed.jsonl').name}; "
                                   "re-run that shard, or merge with --allow-failures)")
    if any(_sibling(s.path, ".report.json").exists() for s in statuses):
        for status in statuses:
            if status.path.exists() and not _sibling(status.path, ".report.json").exists():
                status.problems.append("no .report.json (other shards have one: the stage did not finish)")
    return statuses


def merge_shards(output: str | Path, count: int | None = None, allow_failures: bool = False) -> MergeResult:
    """Concatenate the ``n`` complete shards of ``output`` into ``output`` (atomically) and merge their reports.

    ``count`` (n) is found from the file names when not given. Raises :class:`ConfigError` listing every
    missing or incomplete shard, so nothing is merged from a partial set.
    """
    output = Path(output)
    groups = find_shards(output)
    if count is None:
        if not groups:
            raise ConfigError(f"no shard files of {output} (expected names like "
                              f"{output.stem}.shard-00001-of-00004{output.suffix} next to it)")
        if len(groups) > 1:
            raise ConfigError(f"shard files of {output} from several shard counts ({sorted(groups)}); "
                              "pass --shards N to choose, and delete the stale ones")
        count = next(iter(groups))
    statuses = shard_status(output, count, allow_failures)
    bad = [s for s in statuses if not s.complete]
    if bad:
        lines = "\n".join(f"  shard {s.index}/{s.count} {s.path.name}: {'; '.join(s.problems)}" for s in bad)
        raise ConfigError(f"cannot merge {output}: {len(bad)} of {count} shards are missing or incomplete:\n{lines}\n"
                          f"  Fix: run (or finish) those shards with --shard I/{count}, then merge again")
    total = 0
    with atomic_write(output, "wb", encoding=None) as handle:
        for status in statuses:
            with open(status.path, "rb") as shard_file:
                for raw in shard_file:
                    if raw.strip():
                        handle.write(raw if raw.endswith(b"\n") else raw + b"\n")
                        total += 1
    report = _merge_reports(output, statuses)
    for suffix in (".failed.jsonl",):  # carry failure lists over when they were accepted
        failed = [_sibling(s.path, suffix) for s in statuses if _sibling(s.path, suffix).exists()]
        if failed:
            with atomic_write(_sibling(output, suffix), "wb", encoding=None) as handle:
                for path in failed:
                    with open(path, "rb") as src:
                        shutil.copyfileobj(src, handle)
    return MergeResult(output, count, total, report)


_STATS = {"mean", "min", "max", "median", "p25", "p75"}  # per-shard statistics do not add up: kept per shard


def _merge_reports(output: Path, statuses: list[ShardStatus]) -> Path | None:
    paths = [_sibling(s.path, ".report.json") for s in statuses]
    if not all(p.exists() for p in paths):
        return None
    reports = []
    for path in paths:
        try:
            reports.append(json.loads(path.read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            raise DataError(path, f"invalid JSON ({exc.msg})", fix="re-run that shard to rewrite its report") from None
    merged: dict = {"merged_from": [str(s.path) for s in statuses]}
    for key, value in reports[0].items():
        values = [r.get(key) for r in reports]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            merged[key] = sum(values)  # counts add up; so do elapsed seconds (total work)
        elif all(isinstance(v, dict) and not _STATS.intersection(v) for v in values) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for v in values for x in v.values()):
            keys = dict.fromkeys(k for v in values for k in v)
            merged[key] = {k: sum(v.get(k, 0) for v in values) for k in keys}
    merged["shard_reports"] = reports
    report = _sibling(output, ".report.json")
    write_json(report, merged)
    return report
