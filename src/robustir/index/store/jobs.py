"""The job record an index's manifest keeps while a job (``build``, ``add``, ``upsert``, ``delete``, ``compact``) runs,
and the rules every other writer follows beside it (issue 52).

A job's record is what makes its partial writes resumable: it names the input and how many of its records are in.
So no other writer ever erases it -- a ``delete`` or ``compact`` beside an unfinished ``add`` / ``upsert`` / ``build``
is refused with :class:`UnfinishedJob` (naming the job, and the two ways out: finish it or drop it), and another job
is refused the same way; an HTTP write finishes its own server's unfinished upsert first
(:func:`robustir.index.store.spool.finish_pending`). The input is recorded by its absolute path, so the job is found
and finished from any working folder (a restart from elsewhere after ``kill -9``).

Why a record in our manifest and not Lance's own versions: Lance knows the commits, not which input records they came
from; what it does give -- a version to go back to -- is recorded as ``base``, so dropping an unfinished upsert
(``--discard-unfinished``) restores the documents it had already replaced (:meth:`LanceTable.restore`).
"""

from __future__ import annotations

import errno
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ...errors import ConfigError, DataError

__all__ = ["Job", "ATOMIC", "UnfinishedJob", "job_input", "same_input", "unfinished", "storage_errors"]

#: jobs whose Lance commit leaves a consistent table (one commit each): a kill loses nothing, the next open records it
ATOMIC = ("delete", "compact")


@dataclass
class Job:
    """An unfinished job as the manifest records it."""

    id: int
    kind: Literal["build", "add", "upsert", "delete", "compact"]
    input: str  # the input file's absolute path (older indexes may hold the path as it was given)
    position: int = 0  # input records committed
    skipped: int = 0  # empty records skipped
    base: int | None = None  # the Lance version before the job's first commit (None: recorded before issue 52)

    @classmethod
    def from_json(cls, data: Any, where: Path) -> "Job":
        try:
            job = cls(**data)
            if job.kind not in ("build", "add", "upsert", *ATOMIC) or not isinstance(job.position, int) \
                    or not (job.base is None or isinstance(job.base, int)):
                raise TypeError
            return job
        except TypeError:
            raise DataError(where, f"its unfinished job is malformed: {json.dumps(data)[:120]}",
                            fix="rebuild the index (robustir index --corpus ... --overwrite)") from None


class UnfinishedJob(ConfigError):
    """A write refused because the index has an unfinished job that is not this one (``job``: its record)."""

    def __init__(self, message: str, job: Job) -> None:
        super().__init__(message)
        self.job = job


def job_input(corpus: str | os.PathLike) -> str:
    """How a job records its input: the absolute path (not resolved through links: the path the user chose)."""
    return os.path.abspath(os.fspath(corpus))


def same_input(recorded: str, corpus: str | os.PathLike) -> bool:
    """Whether ``corpus`` is the input a job recorded (absolute since issue 52; as given before)."""
    return recorded in (job_input(corpus), os.fspath(corpus))


def unfinished(index: Any, job: Job, action: str) -> UnfinishedJob:
    """The error for ``action`` (``delete``, ``compact``, an ``add of X``) beside the unfinished ``job`` of the index
    at ``index``: what is unfinished, and how to finish it or drop it (never erased silently)."""
    if job.kind == "build":
        ways = (f"finish it by re-running the build (robustir index --corpus {job.input} --output {index}), or start "
                "afresh with --overwrite")
    else:
        ways = (f"finish it (robustir index --{job.kind} {job.input} --output {index}"
                + ("; a server on the index finishes it before its next write" if Path(job.input).parent.name
                   == "incoming" else "")
                + f"), or drop it (robustir index --discard-unfinished --output {index}"
                + (": the documents it replaced come back" if job.kind == "upsert" else "") + ")")
    return UnfinishedJob(f"index {index} has an unfinished {job.kind} of {job.input} (stopped after {job.position} "
                         f"input records): the {action} would leave its partial writes with no record, so it waits "
                         f"until that job is finished or dropped; {ways}. Nothing was changed", job)


@contextmanager
def storage_errors(index: Any):
    """Lance reports a write the system refused as ``RuntimeError: lance error: LanceError(IO): File too large (os
    error 27), <rust source file>``: raised here as the :class:`OSError` it is (errno, its words, the index as the
    file), so the CLI and the server answer with the cause ("File too large", "No space left on device") instead of a
    traceback or a bare 500 (measured with ``ulimit -f`` in a child process: tests/test_index_writes.py)."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc)
        if _GONE.search(text):  # the bucket or folder went away under the job (issue 52: a raw Lance traceback)
            raise FileNotFoundError(errno.ENOENT, "the index's storage is gone (its bucket or folder was deleted while "
                                    "the job ran?); recreate it and run the job again", str(index)) from exc
        found = re.search(r"\(os error (\d+)\)", text)
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(index)) from exc


#: Lance's words for storage that is not there any more (an object store's missing bucket, a deleted folder)
_GONE = re.compile(r"NoSuchBucket|The specified bucket does not exist|LanceError\(IO\): Not found|"
                   r"Dataset at path .* was not found|Not found: .*_versions")
