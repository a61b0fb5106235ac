"""``robustir index --corpus`` (a build) as a :class:`~robustir.runs.Step` (:data:`INDEX`): its run, its check and
its record, the manifest. Its own module, beside :mod:`.build`, because it runs :class:`~.index.SearchIndex` (which
builds on :class:`~.build.Builder`): kept in ``build``, the two imported each other."""

from __future__ import annotations

from ...errors import ConfigError
from ...runs import Job, Step, register
from .config import IndexConfig, IndexReport
from .index import SearchIndex
from .manifest import _IndexRecord, _usable_manifest
from .storage import IndexStore
from .stores import open_store

__all__ = ["INDEX"]


def _run_index_step(config: IndexConfig, job: Job, *, on_change: str | None = None,
                    overwrite: bool = False) -> IndexReport:
    index, report = SearchIndex.build(_job_store(job), job.inputs["model"], job.inputs["corpus"], config=config,
                                      encoder_options=dict(job.settings.get("encoder") or {}), overwrite=overwrite,
                                      on_change=on_change or "refuse", encoder_pool=job.runtime.get("encoder_pool"))
    with index:
        report.summary = index.summary()
    return report


def _check_index_job(config: IndexConfig, job: Job) -> None:
    missing = [name for name in ("corpus", "model") if not job.inputs.get(name)]
    if missing:
        raise ConfigError(f"the index step needs inputs {missing} (the corpus to encode and the model)")


def _job_store(job: Job) -> IndexStore:
    """Where the index step's job writes: ``job.output`` with the ``storage_options`` of ``job.runtime``."""
    return open_store(job.output, job.runtime.get("storage_options"))


def _index_record(config: IndexConfig, job: Job) -> "_IndexRecord":
    store = _job_store(job)
    return _IndexRecord(store, _usable_manifest(store) or {})


#: ``robustir index --corpus`` (a build) as a :class:`~robustir.runs.Step`: ``Job(output=INDEX_FOLDER or s3://...,
#: inputs={"corpus": ..., "model": ...}, settings={"encoder": {...}}, runtime={"storage_options": {...}})``; the
#: manifest is its record
INDEX = register(Step("index", IndexConfig, run=_run_index_step, check=_check_index_job, output=_index_record,
                      decides=lambda report: report.nothing_to_do))
