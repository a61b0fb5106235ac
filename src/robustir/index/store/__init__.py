"""The persistent search index (``robustir index``, ``robustir serve --index``) on LanceDB: one Lance table of
documents, metadata and vectors, with dense, BM25 and hybrid search, JSON filters, add / delete / upsert by id while
readers read, resumable builds and a model-identity manifest.

Why LanceDB and not the FAISS + sqlite store this module held before: that store (1,287 lines) could not let a running
server follow add / delete (500s, short result lists), had no upsert, no keyword search, filters on top-level fields
only, and its own job runner, generations and checksums. LanceDB gives versioned commits that readers follow,
prefiltered vector search, a BM25 full-text index and ``merge_insert``; what is kept here is what LanceDB does not do:
the model identity, resumable encoding jobs, the checks, the filter language.

A folder ``IDX`` -- or a prefix on S3, ``s3://bucket/prefix``: the same layout as objects, read and written through
:mod:`~robustir.index.store.storage` (an atomic put for the manifest, its ETag for "changed?", a conditional-put lease
for ``writer.lock``, data files checked by size + ETag) -- holds

===================  ==================================================================================================
``manifest.json``    what the index is: the model (absolute path, name, file digest) and its encoder settings, the
                     dimension, the data folder, the known metadata fields, the vector-index settings (``ann``), the
                     unfinished job (if any) and, after each finished job, the Lance version it left, the document
                     count and the size + SHA-256 (on S3: size + ETag) of every data file of that version; and its
                     own ``digest`` (SHA-256 of the rest): an edited manifest is refused, never trusted. Written
                     atomically; every part is type-checked when read.
``lance/docs.lance`` the LanceDB table: ``id``, ``title``, ``text``, ``content`` (title and text joined as they are
                     encoded: what BM25 indexes), ``fields`` (the record's other keys, a Lance JSON column, so filters
                     reach nested values), ``t0``, ``t1`` ... (a typed copy of each top-level field of one kind, with a
                     scalar index, which filters read instead of the JSON: the manifest's ``columns``), ``job`` and
                     ``line`` (which job and input line wrote the row: what makes a
                     killed job resumable), ``vector``. A rebuild (``--overwrite``) writes ``lance.1``, ``lance.2``
                     ...: the manifest names the one in use.
``building.json``    the manifest of a rebuild in progress beside the live index (gone when it is swapped in).
``writer.lock``      ``flock``-ed by the one process changing the index (released when it closes or dies); on S3 a
                     lease object with an expiry, renewed while the writer works (:mod:`robustir.index.store.storage`).
===================  ==================================================================================================

**Rebuilds.** ``build(overwrite=True)`` over a finished index builds the new one aside (its own data folder and
``building.json``) while readers keep the old one; when it is complete and checked, one atomic rename of the manifest
swaps it in, and each reader's next query re-reads the manifest and moves to it (a reader whose model differs from
the new index's refuses to search and says to restart). The old folder is removed by a later job once
:data:`RETIRED_KEEP` has passed. A killed rebuild is resumed by the same command.

**Jobs.** ``build``, ``add`` and ``upsert`` first read the whole input once without the model (JSON, ids unique in
the file and, for ``add``, new to the index, finite numbers): bad input fails with its file and line before anything
changes. Then they encode it in chunks. Each chunk is one Lance commit (``add``, or ``merge_insert`` by id for
upsert), then the manifest records how many input records are in. A kill between the two leaves rows of the chunk
that the manifest does not count; the re-run deletes the job's rows past the recorded line and goes on, so a killed
and resumed build holds exactly the rows of an uninterrupted one. No other writer erases an unfinished job's record
(:mod:`robustir.index.store.jobs`: a delete, compact or other job beside it is refused, naming it); what the index knows
of its fields is bounded and shrinks when documents go (:mod:`~robustir.index.store.known_fields`). When the job ends,
the full-text index is made (once; rows added later are searched beside it until ``compact``), the ANN index if asked
for, and the manifest records the version, the count and the files.

**Live reads.** A reader (the server, another process) opens the table with ``read_consistency_interval=0``: every
query sees the latest committed version, so an ``add`` / ``delete`` / ``upsert`` made by a writer is visible on the
next query, without a restart and without a 500; the manifest is re-read once per new version (new fields, an ANN
index), and a writer records a new field before the rows that have it. Vector and BM25 search with a filter use
LanceDB's *prefilter*: the filter selects the rows first, so ``top_k`` hits come back whenever that many documents
match. A reader may open while a writer's job runs (it serves the committed rows); a job left by a dead writer is
refused to readers with the command that finishes it.

**Checks.** :meth:`SearchIndex.open` (and :meth:`SearchIndex.check`, which prints the summary) refuses an index whose
manifest is missing, malformed or edited (its digest), whose unfinished job is not the next job, whose table is
missing or unreadable, whose dimension differs, whose recorded data files are missing, truncated or edited (size and
SHA-256), whose Lance version is older than the recorded one (version files lost) or newer with no robustir job at
work (changed outside robustir), or whose count differs from the manifest's; a model other than the one the index
was built with is refused. Nothing is ever repaired silently.

**Layout.** :mod:`~robustir.index.store.index` (:class:`SearchIndex`: open, search, the public API) is made of
:mod:`~robustir.index.store.build` (builds, the ``index`` step), :mod:`~robustir.index.store.writer` (add, upsert,
delete, compact), :mod:`~robustir.index.store.runner` (the chunked, resumable jobs),
:mod:`~robustir.index.store.manifest` (the manifest and the integrity check), :mod:`~robustir.index.store.table`
(Lance access), :mod:`~robustir.index.store.records` (input records), :mod:`~robustir.index.store.config`,
:mod:`~robustir.index.store.jobs` (the job record), :mod:`~robustir.index.store.storage` (a folder or S3),
:mod:`~robustir.index.store.filters` (the filter language) and :mod:`~robustir.index.store.spool` (HTTP writes).
"""

from __future__ import annotations

from .step import INDEX
from .config import FORMAT, AnnConfig, EncoderPool, EncoderPoolFactory, Hit, IndexConfig, IndexReport, SearchMode
from .index import SearchIndex
from .records import read_id_list

__all__ = ["SearchIndex", "IndexConfig", "AnnConfig", "Hit", "IndexReport", "SearchMode", "FORMAT", "read_id_list",
           "INDEX", "EncoderPool", "EncoderPoolFactory"]
