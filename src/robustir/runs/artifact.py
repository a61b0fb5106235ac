"""One answer to "is this output done, and made with these settings and inputs?".

An :class:`Artifact` is a path (a file or a folder) and its record ``<path>.run.json`` (``<folder>/run.json`` for
a folder that travels with its record, a training run)::

    {"fingerprint": {...}, "digest": "...", "complete": true, "report": {...},
     "files": {"data.arrow": {"size": 123, "sha256": "..."}}, "finished": 1732470000.0}

* :meth:`Artifact.decide` is the one rule for "done?", :meth:`Artifact.begin` the start every producer calls:
  ``True`` (nothing to do) when the output is complete, verified and made with the same fingerprint; otherwise it
  clears what cannot be reused (a different fingerprint: refused with the difference named, or redone, as the
  caller chooses; a damaged output: redone with one warning) and records the new fingerprint as *started*, so an interrupted run resumes only with the
  same settings.
* :meth:`Artifact.finish` records it complete, with the size (and, for caches, the SHA-256) of the files named,
  written atomically last: a crash before it leaves an output that is never taken as done.
* :meth:`Artifact.complete` / :meth:`Artifact.check` read the record back and verify the recorded files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..errors import ConfigError
from ..io import write_json
from .fingerprint import Fingerprint

__all__ = ["Artifact", "Check", "Decision", "INSIDE_RECORD", "RECORD", "file_sha256"]

logger = logging.getLogger(__name__)

RECORD = ".run.json"
INSIDE_RECORD = "run.json"


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Decision:
    """What :meth:`Artifact.decide` found: ``reuse`` (nothing to do), ``resume`` (same settings, unfinished: go on
    from what is there) or ``fresh`` (clear and make it again); why, when the settings differ or the output is
    damaged."""

    state: Literal["reuse", "resume", "fresh"]
    differences: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass
class Check:
    """What is on disk: ``state`` missing | started | complete; ``differences`` from the fingerprint asked
    about (empty = same); ``problems``: why a complete-looking output cannot be trusted (damaged files)."""

    state: Literal["missing", "started", "complete"]
    differences: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    recorded: bool = True  #: False: there is no (readable) record

    @property
    def reusable(self) -> bool:
        return self.state == "complete" and not self.differences and not self.problems


class Artifact:
    """The output at ``path`` (a file or a folder) with its record ``<path>.run.json``."""

    def __init__(self, path: str | Path, *, what: str = "output", checksum_limit: int | None = None,
                 inside: bool = False) -> None:
        """``checksum_limit``: recorded checksums of files larger than this many bytes are not re-computed on
        every check (sizes still are): for caches whose full read would cost more than it protects. ``inside``: a
        folder that travels with its record (a training run folder), kept as ``<folder>/run.json``."""
        self.path = Path(path)
        self.what = what
        self.checksum_limit = checksum_limit
        self.inside = inside

    @property
    def record_path(self) -> Path:
        return self.path / INSIDE_RECORD if self.inside else self.path.with_name(self.path.name + RECORD)

    # ------------------------------------------------------------------ reading
    def record(self) -> dict | None:
        """The record, or None when there is none or it cannot be read (a damaged record says nothing)."""
        try:
            data = json.loads(self.record_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None

    @property
    def fingerprint(self) -> Fingerprint | None:
        record = self.record()
        return Fingerprint.from_json(record.get("fingerprint")) if record else None

    @property
    def report(self) -> dict:
        record = self.record()
        return dict(record.get("report") or {}) if record else {}

    def verify(self, record: dict | None = None) -> list[str]:
        """Problems with the recorded files (missing, another size, another checksum); empty when all match."""
        record = self.record() if record is None else record
        if not self.path.exists():
            return [f"{self.path} is missing"]
        problems = []
        for name, expected in (record or {}).get("files", {}).items():
            target = self.path / name if self.path.is_dir() else self.path
            if not target.is_file():
                problems.append(f"{name} is missing")
                continue
            size = target.stat().st_size
            if size != expected.get("size"):
                problems.append(f"{name} has {size} bytes, {expected.get('size')} were written")
            elif expected.get("sha256") and (self.checksum_limit is None or size <= self.checksum_limit) \
                    and file_sha256(target) != expected["sha256"]:
                problems.append(f"{name} does not match the checksum recorded when it was written")
        return problems

    def check(self, fp: Fingerprint | None = None) -> Check:
        record = self.record()
        if record is None:  # an output from an older robustir (no record) is resumed as it is, never reused
            return Check("started" if self.path.exists() else "missing", recorded=False)
        saved = Fingerprint.from_json(record.get("fingerprint"))
        diffs = [] if fp is None else (fp.differences(saved) if saved is not None else ["no fingerprint recorded"])
        if not record.get("complete") or not self.path.exists():
            return Check("started", diffs)
        return Check("complete", diffs, self.verify(record))

    def complete(self, fp: Fingerprint | None = None) -> bool:
        """True when the output is complete, its files match their record and (given ``fp``) it was made with
        that fingerprint."""
        return self.check(fp).reusable

    # ------------------------------------------------------------------ writing
    def decide(self, fp: Fingerprint, *, on_change: Literal["refuse", "redo"] = "redo", overwrite: bool = False,
               resume: bool = True, work: list[str] | None = None, fix: str | None = None) -> Decision:
        """The one rule for "is this output done, with these settings and inputs?" (nothing is changed on disk).

        * ``overwrite``: ``fresh`` (clear it, make it again);
        * complete, its files as recorded, made with ``fp``: ``reuse`` (nothing to do);
        * complete with ``fp`` but damaged (a file cut short or edited): ``fresh``, with one warning;
        * made (complete or started) with another fingerprint: refused with a :class:`ConfigError` naming the
          differences (``on_change="refuse"``) or ``fresh`` (``"redo"``, one warning). ``work`` -- what a producer
          that keeps its output inside a folder found there (a training run's checkpoints) -- narrows this: with
          ``work`` empty nothing made with the other settings is left, so it is ``fresh`` either way;
        * started with ``fp``: ``resume`` (``resume=False``: ``fresh``);
        * no record but ``work`` found: refused -- nothing shows what that work was made with. An output without a
          record and without ``work`` to protect (a stage file from an older robustir) is resumed as it is.

        ``fix``: the refusal's last sentence (default: add --overwrite, or choose another output).
        """
        if overwrite:
            return Decision("fresh")
        check = self.check(fp)
        fix = fix or "Fix: add --overwrite to redo it with these, or choose another output"
        if check.reusable:
            return Decision("reuse")
        if check.state == "complete" and check.problems and not check.differences:
            logger.warning("%s: %s is damaged (%s): making it again", self.what, self.path, "; ".join(check.problems))
            return Decision("fresh", problems=check.problems)
        if not check.recorded and self.record_path.exists():  # cut or edited: nothing shows what the output holds
            logger.warning("%s: %s cannot be read as a run record: %s is treated as an output without one",
                           self.what, self.record_path, self.path)
        if not check.recorded and work:
            raise ConfigError(f"{self.path} holds {' and '.join(work)} but no {self.record_path.name}: it was written "
                              "by an older robustir (or by hand), so nothing shows what it was made with. " + fix)
        if not check.recorded and work is not None:
            return Decision("fresh")  # the producer found nothing of its own in the folder
        if check.state != "missing" and check.differences:
            if work is not None and not work:
                logger.info("%s: %s was started with other settings and left nothing: starting afresh", self.what,
                            self.path)
                return Decision("fresh", differences=check.differences)
            if on_change == "refuse":
                state = "is complete" if check.state == "complete" else f"was started{self.started_where()}"
                held = f" (it holds {' and '.join(work)})" if work else ""
                raise ConfigError(f"{self.path} {state} with other settings or inputs than this run{held}: "
                                  f"{'; '.join(check.differences)}. {fix}")
            logger.warning("%s: %s was made with other settings or inputs (%s): making it again", self.what,
                           self.path, "; ".join(check.differences[:5]))
            return Decision("fresh", differences=check.differences)
        if check.state == "started":
            return Decision("resume" if resume else "fresh")
        return Decision("fresh")

    def started_where(self) -> str:
        """Where an unfinished output's work lies, for messages (``" (a .partial file)"``); a subclass says."""
        return ""

    def begin(self, fp: Fingerprint, *, on_change: Literal["refuse", "redo"] = "redo", overwrite: bool = False,
              resume: bool = True) -> bool:
        """Start making this output with ``fp``; True when there is nothing to do (:meth:`decide` said ``reuse``).

        Otherwise what cannot be reused is cleared (``fresh``) or kept for the producer to resume (``resume``), and
        ``fp`` is recorded as started, so an interrupted run resumes only with the same settings.
        """
        decision = self.decide(fp, on_change=on_change, overwrite=overwrite, resume=resume)
        if decision.state == "reuse":
            return True
        if decision.state == "fresh":
            self.clear()
        self.start(fp)
        return False

    def start(self, fp: Fingerprint) -> None:
        """Record ``fp`` as the fingerprint of an output being made (not complete)."""
        self._write({"fingerprint": fp.to_json(), "digest": fp.digest, "complete": False, "started": time.time()})

    def finish(self, report: dict | None = None, *, files: list[str] | None = None, checksums: bool = False) -> None:
        """Record the output complete (last, atomically), with ``report`` and the size -- and with ``checksums``
        the SHA-256 -- of ``files`` (names inside a folder output; ``[""]`` or None for a file output)."""
        record = self.record() or {}
        entries: dict[str, dict] = {}
        for name in (files if files is not None else ([] if self.path.is_dir() else [self.path.name])):
            target = self.path / name if self.path.is_dir() else self.path
            entries[name] = {"size": target.stat().st_size, **({"sha256": file_sha256(target)} if checksums else {})}
        self._write({**record, "complete": True, "finished": time.time(), "report": report or {}, "files": entries})

    def note(self, **progress: object) -> None:
        """Record how far a started output got (a producer that resumes reads it back from :attr:`progress`)."""
        self._write({**(self.record() or {}), "progress": progress})

    @property
    def progress(self) -> dict:
        record = self.record()
        return dict(record.get("progress") or {}) if record and not record.get("complete") else {}

    def clear(self) -> None:
        """Remove the output and its record."""
        if self.path.is_dir():
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            self.path.unlink(missing_ok=True)
        self.record_path.unlink(missing_ok=True)

    def _write(self, record: dict) -> None:
        self.record_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.record_path, record)
