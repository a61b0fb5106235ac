"""``robustir audit``: how noisy is a training set, which records are suspect, and which recipe fits it.

One streaming pass reads every record (a training JSONL file or folder, or a BEIR folder's split): it validates
it (a bad line is an error naming file, line and field), runs the text checks (:mod:`robustir.audit.checks`) and
keeps a seeded reservoir sample of at most ``max_records`` records for the teacher, and random passages. The
teacher (an embedding model; default the bundled all-MiniLM-L6-v2) then scores the sample:

* every (query, positive) pair: its cosine, its *random p-value* ``u`` against ``random_passages`` random
  passages, its *gap* to the best other passage of the search pool (``corpus``: a BEIR folder or corpus file;
  else the audited records' own passages) and how many of its own negatives outscore it;
* planted nulls, built from the same records: a random passage standing in as the positive (random null) and the
  record's first negative standing in (hard null; records without negatives give none, and without any the
  hard-like rate is not estimated: mine negatives first);
* the trusted pairs of ``eval_data`` (its qrels), as the clean reference of how often the teacher misranks a true
  positive.

:func:`robustir.audit.estimate.estimate_rates` turns these into the false-positive rate with an interval. Each
pair is also flagged on its own (``random_like``: half the random passages outscore it; ``outranked``: a passage of
the pool scores above it by more than the hard nulls' median gap), each negative of an unflagged pair
(``above_positive_margin``: within 5 % of the positive's score, NV-Retriever's rule; ``near_duplicate_of_positive``:
passage cosine >= 0.95), and leakage into ``eval_data`` (same normalised query or positive; a query with cosine
>= 0.95 to an evaluation query).

Output folder: ``report.json``, ``report.md``, ``audit.png`` (score distributions, flagged share per reason),
``flagged.jsonl`` (one line per flag, most suspicious first) and ``run.json`` (its record: a re-run with the same
settings and inputs does nothing, with other ones it redoes the audit).
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Iterator

import numpy as np

from ..errors import ConfigError, DataError
from ..io import atomic_write, read_jsonl, write_json
from ..precision import Precision
from ..runs import Artifact, fingerprint, operational
from ..validation import NonNegativeInt, OpenFraction, PositiveInt, Range, config_dataclass
from .checks import TextChecks, degenerate_reasons, normalize, text_hash
from .estimate import MU, estimate_rates

logger = logging.getLogger(__name__)

__all__ = ["AuditConfig", "AuditResult", "audit", "iter_records", "REPORT", "FLAGGED"]

REPORT, FLAGGED, MARKDOWN, PLOT = "report.json", "flagged.jsonl", "report.md", "audit.png"


@config_dataclass
class AuditConfig:
    """Options of ``robustir audit``."""

    data: str = ""
    """Training JSONL file or folder (query/pos[/neg] per line), or a BEIR folder (its ``split``)."""
    output: str = ""
    """Folder for report.json, report.md, audit.png and flagged.jsonl."""
    split: str = "train"
    """The qrels split read when ``data`` is a BEIR folder."""
    model: str | None = None
    """Teacher: an embedding model folder or hub id (None = the bundled all-MiniLM-L6-v2)."""
    corpus: str | None = None
    """Passages searched for better matches than each positive: a BEIR folder or a corpus JSONL (None: ``data``'s
    corpus when it is a BEIR folder, else the audited records' own passages)."""
    eval_data: str | None = None
    """BEIR folder of the evaluation split: checked for leakage, and its qrels calibrate the teacher (a trusted
    reference: without one the hard-like rate is an upper bound)."""
    eval_split: str = "test"
    """The evaluation split of ``eval_data``."""
    reference: bool = True
    """Use ``eval_data``'s qrels as the clean reference (false: leakage check only)."""
    max_records: PositiveInt = 20000
    """Records the teacher scores: a seeded uniform sample when the data holds more (the text checks read all)."""
    random_passages: Annotated[int, Range(ge=20)] = 200
    """Random passages each positive is ranked against (the random p-value's resolution is 1/(this+1))."""
    relative_margin: OpenFraction = 0.05
    """A negative scoring above the positive's score times (1 - this) is a suspected false negative."""
    duplicate_cosine: Annotated[float, Range(gt=0, le=1)] = 0.95
    """Passage cosine at which a negative is a near-duplicate of its positive, and a query of an evaluation query."""
    max_positive_reuse: PositiveInt = 20
    """Flag the records of a passage that is the positive of more than this many records."""
    min_query_words: NonNegativeInt = 2
    """Shorter queries are flagged ``short_query``."""
    min_passage_words: NonNegativeInt = 5
    """Shorter positives are flagged ``short_positive``."""
    seed: int = 0
    """Seed of the samples and the bootstrap."""
    bootstrap: NonNegativeInt = 1000
    """Bootstrap resamples of the rate's interval."""
    max_length: PositiveInt | None = None
    """Teacher token limit (None = the model's own)."""
    batch_size: PositiveInt = operational(64)
    """Encoding batch size."""
    precision: Precision = "auto"
    """Encoding precision: auto (bf16 where native: GPU, AMX/AVX512-BF16 CPU; else fp32), fp32, bf16 or fp16."""
    device: str = operational("auto")
    """Where the teacher runs: auto (the first GPU if there is one, else the CPU), cpu, cuda or cuda:N."""
    cache_dir: str | None = operational(None)
    """Reuse corpus embeddings saved here (the same cache as dense mining)."""
    overwrite: bool = operational(False)
    """Redo a complete audit."""
    progress: bool = operational(True)
    """Show progress bars."""

    def validate(self) -> None:
        if not str(self.data).strip():
            raise ConfigError("audit: data is required: a training JSONL file or folder, or a BEIR folder")
        if not str(self.output).strip():
            raise ConfigError("audit: output is required: the folder for the report")
        if self.model is not None and not self.model.strip():
            raise ConfigError("audit: model is empty; name a model folder, or leave it out for the bundled "
                              "all-MiniLM-L6-v2")


@dataclass
class Record:
    """One validated training record (``file``: its path, ``line``: 1-based line; for a BEIR split the qrels file
    and the query id)."""

    index: int
    file: str
    line: int | str
    query: str
    pos: list[str]
    neg: list[str]


class _Where:
    """Record index -> (file, line), in arrays (a few bytes a record, not a tuple each)."""

    def __init__(self) -> None:
        from array import array

        self.files: list[str] = []
        self.file_of = array("i")
        self.lines = array("q")
        self.labels: list[str] = []  # BEIR records are named by query id, not by line

    def add(self, file: str, line: int | str) -> None:
        if not self.files or self.files[-1] != file:
            self.files.append(file)
        self.file_of.append(len(self.files) - 1)
        if isinstance(line, str):
            self.labels.append(line)
            self.lines.append(len(self.labels) - 1)
        else:
            self.lines.append(line)

    def __getitem__(self, index: int) -> tuple[str, int | str]:
        line = self.lines[index]
        return self.files[self.file_of[index]], (self.labels[line] if self.labels else line)


@dataclass
class AuditResult:
    """What :func:`audit` found (``report`` is report.json's content)."""

    output: Path
    report: dict
    already_complete: bool = False

    @property
    def estimate(self) -> dict:
        return self.report["false_positives"]["estimate"]

    @property
    def recommendation(self) -> dict:
        return self.report["recommendation"]


# ------------------------------------------------------------------------------------------------- reading

def _is_beir(path: Path) -> bool:
    from ..data.beir import is_beir_folder

    return is_beir_folder(path)


def iter_records(data: str | Path, split: str = "train") -> Iterator[Record]:
    """Stream the validated records of a training JSONL file or folder, or of a BEIR folder's split (one record per
    judged query, every relevant document a positive)."""
    from ..data.training_data import check_record, training_files

    path = Path(data)
    if _is_beir(path):
        from ..data.beir import load_beir

        dataset = load_beir(path, split)
        texts = dict(zip(dataset.corpus.ids, dataset.corpus.texts_for_encoding()))
        qrels = path / "qrels" / f"{split}.tsv"
        for index, (qid, judged) in enumerate(dataset.qrels.items()):
            yield Record(index, str(qrels), f"query {qid}", dataset.queries[qid],
                         [texts[d] for d, grade in judged.items() if grade > 0], [])
        return
    index = 0
    for file in training_files(path):
        for line, obj in read_jsonl(file):
            query, pos, neg = check_record(obj, file, line)
            if not pos:
                raise DataError(file, "empty positive list: there is no pair to audit", line=line, field="pos",
                                fix="add the query's positive(s) or remove the line")
            yield Record(index, str(file), line, query, pos, neg)
            index += 1


def _corpus_path(path: Path) -> Path:
    if path.is_dir():
        from ..data.beir import corpus_file

        return corpus_file(path)
    return path


# ------------------------------------------------------------------------------------------------- the teacher

class _Embeddings:
    """Distinct texts and their unit embeddings, encoded on demand (each text once)."""

    def __init__(self, encoder, kind: str, config: AuditConfig) -> None:
        self.encoder, self.kind, self.config = encoder, kind, config
        self.row: dict[str, int] = {}
        self.blocks: list[np.ndarray] = []
        self._matrix: np.ndarray | None = None

    def preload(self, texts: list[str], vectors: np.ndarray) -> None:
        for text, vector in zip(texts, _unit(vectors)):
            if text not in self.row:
                self.row[text] = len(self.row)
                self.blocks.append(vector[None])
        self._matrix = None

    def add(self, texts: list[str], desc: str) -> None:
        new = list(dict.fromkeys(t for t in texts if t not in self.row))
        if not new:
            return
        vectors = self.encoder.encode(new, self.kind, batch_size=self.config.batch_size,
                                      precision=self.config.precision, show_progress=self.config.progress, desc=desc)
        self.preload(new, vectors)

    @property
    def matrix(self) -> np.ndarray:
        if self._matrix is None:
            self._matrix = np.concatenate(self.blocks) if self.blocks else np.zeros((0, 1), dtype=np.float32)
            self.blocks = [self._matrix]
        return self._matrix

    def of(self, texts: list[str]) -> np.ndarray:
        return self.matrix[[self.row[t] for t in texts]]


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


class _Pool:
    """The search pool: the best-scoring passages for a query, leaving out given texts."""

    chunk = 1024  # queries scored against the whole pool at a time
    depth = 16  # top passages looked at before the excluded ones force a full-row search

    def __init__(self, texts: list[str], vectors: np.ndarray, device) -> None:
        import torch

        self.texts = texts
        self.hashes = np.fromiter((text_hash(t) for t in texts), dtype=np.int64, count=len(texts))
        self.device = device
        self.vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        self.matrix = torch.from_numpy(self.vectors).to(device)
        self._normalized: dict[int, str] = {}

    def best(self, queries: np.ndarray, excluded: list[set[int]],
             inside: list[list[str]] | None = None) -> tuple[np.ndarray, list[int]]:
        """Per query: the best score among pool passages whose normalised-text hash is not in its ``excluded`` set
        (and, given ``inside``, whose normalised text is not part of one of those texts: a sentence cut from the
        positive is the positive, not a competitor), and that passage's row (-1 and -inf when none is left)."""
        import torch

        scores_out = np.full(len(queries), -np.inf, dtype=np.float64)
        rows_out = [-1] * len(queries)
        for start in range(0, len(queries), self.chunk):
            block = torch.from_numpy(np.ascontiguousarray(queries[start:start + self.chunk],
                                                          dtype=np.float32)).to(self.device)
            sims = block @ self.matrix.T
            k = min(self.depth, sims.shape[1])
            top = torch.topk(sims, k, dim=1)
            top_scores, top_rows = top.values.float().cpu().numpy(), top.indices.cpu().numpy()
            for i in range(block.shape[0]):
                banned = excluded[start + i]
                containers = inside[start + i] if inside else ()

                def allowed(row: int) -> bool:
                    if int(self.hashes[row]) in banned:
                        return False
                    return not containers or not any(self.normalized(row) in c for c in containers)

                found = next((j for j in range(k) if allowed(int(top_rows[i, j]))), None)
                if found is None and k < sims.shape[1]:  # more excluded passages than the depth: the whole row
                    row = sims[i].float().cpu().numpy()
                    for candidate in np.argsort(-row):
                        if allowed(int(candidate)):
                            scores_out[start + i], rows_out[start + i] = float(row[candidate]), int(candidate)
                            break
                    continue
                if found is not None:
                    scores_out[start + i] = float(top_scores[i, found])
                    rows_out[start + i] = int(top_rows[i, found])
        return scores_out, rows_out

    def normalized(self, row: int) -> str:
        if row not in self._normalized:
            self._normalized[row] = normalize(self.texts[row])
        return self._normalized[row]


def _load_teacher(config: AuditConfig):
    from ..models.encoder import is_cross_encoder
    from ..models.encoder import Encoder, resolve_model_path
    from ..resources import default_model_path

    path = resolve_model_path(config.model or default_model_path(), "teacher")
    if is_cross_encoder(path):
        raise ConfigError(f"audit: {config.model} is a cross-encoder; the audit ranks each positive against random "
                          "and corpus passages, which needs an embedding model: give one as --model")
    overrides = {"query_max_length": config.max_length, "passage_max_length": config.max_length} \
        if config.max_length else {}
    return Encoder.from_pretrained(path, device=config.device, **overrides)


# ------------------------------------------------------------------------------------------------- the audit

def _settings(config: AuditConfig):
    from ..resources import default_model_path

    inputs = {"data": config.data, "corpus": config.corpus, "eval_data": config.eval_data,
              "model": config.model or default_model_path()}
    return fingerprint("audit", config, {k: v for k, v in inputs.items() if v})


def audit(config: AuditConfig, *, encoder=None) -> AuditResult:
    """Audit ``config.data``; writes the report folder (see the module docstring). ``encoder``: a loaded teacher
    (:class:`~robustir.models.encoder.Encoder`), else ``config.model`` is loaded."""
    config.validate()
    data = Path(config.data)
    if not data.exists():
        raise DataError(data, "not found", fix="give a training JSONL file or folder, or a BEIR folder")
    out = Path(config.output)
    from ..outputs import refuse_overwriting_inputs

    refuse_overwriting_inputs(out / FLAGGED, config.data, stage="audit")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"audit: the output {out} is a file; name a folder for the report")
    artifact = Artifact(out, what="audit", inside=True)
    made = _settings(config)
    if artifact.begin(made, overwrite=config.overwrite):
        return AuditResult(out, json.loads((out / REPORT).read_text(encoding="utf-8")), already_complete=True)
    started = time.monotonic()
    teacher = encoder if encoder is not None else _load_teacher(config)
    report = _Audit(config, teacher).run()
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    write_json(out / REPORT, report)
    from .report import write_markdown, write_plot

    write_markdown(report, out / MARKDOWN)
    write_plot(report, out / PLOT)
    artifact.finish({"rate": report["false_positives"]["estimate"]["rate"],
                     "recommendation": report["recommendation"]["loss"]},
                   files=[REPORT, FLAGGED, MARKDOWN] + ([PLOT] if (out / PLOT).exists() else []))
    return AuditResult(out, report)


class _Audit:
    block = 512  # sampled records scored together

    def __init__(self, config: AuditConfig, encoder) -> None:
        self.config = config
        self.encoder = encoder
        self.out = Path(config.output)
        self.rng = random.Random(f"audit:{config.seed}")

    def flag_other(self, item: dict) -> None:
        """Flags found over the whole file go to disk as they are found (memory stays bounded)."""
        self.other.write(json.dumps(item, ensure_ascii=False) + "\n")
        self.counts.setdefault(item["kind"], {}).setdefault(item["reason"], 0)
        self.counts[item["kind"]][item["reason"]] += 1

    # -- pass 1: every record
    def read(self) -> None:
        config = self.config
        from tqdm.auto import tqdm

        self.checks = TextChecks()
        self.sample: list[Record] = []
        self.passage_sample: list[str] = []
        passages_wanted = config.random_passages + max(config.random_passages, min(config.max_records, 2000))
        self.records = self.pairs = self.negatives = 0
        self.where = _Where()  # record index -> (file, line), for the flags found at the end
        seen_passages = 0
        bar = tqdm(desc="audit: read", unit="record", disable=not config.progress)
        for record in iter_records(config.data, config.split):
            self.records += 1
            self.pairs += len(record.pos)
            self.negatives += len(record.neg)
            self.where.add(record.file, record.line)
            self.checks.add(record.index, record.query, record.pos)
            for reason, text in degenerate_reasons(record.query, record.pos, record.neg,
                                                   min_query_words=config.min_query_words,
                                                   min_passage_words=config.min_passage_words):
                self.flag_other({"kind": "degenerate", "reason": reason, "file": record.file, "line": record.line,
                                 "query": record.query, "text": text})
            # reservoir samples (Algorithm R): records for the teacher, passages for the random null
            if len(self.sample) < config.max_records:
                self.sample.append(record)
            else:
                j = self.rng.randrange(self.records)
                if j < config.max_records:
                    self.sample[j] = record
            for text in record.pos + record.neg:
                seen_passages += 1
                if len(self.passage_sample) < passages_wanted:
                    self.passage_sample.append(text)
                else:
                    j = self.rng.randrange(seen_passages)
                    if j < passages_wanted:
                        self.passage_sample[j] = text
            bar.update(1)
        bar.close()
        if not self.records:
            raise DataError(config.data, "no records", fix='give a training JSONL with one {"query", "pos"} object '
                                                            "per line")
        self.sample.sort(key=lambda r: r.index)

    # -- the search pool and the random passages
    def pool(self) -> None:
        config = self.config
        corpus = config.corpus or (config.data if _is_beir(Path(config.data)) else None)
        self.queries = _Embeddings(self.encoder, "query", config)
        self.passages = _Embeddings(self.encoder, "passage", config)
        self.pool_source = "corpus" if corpus else "audited passages"
        if corpus:
            from ..data.beir import load_corpus

            self.corpus_path = str(_corpus_path(Path(corpus)))
            loaded, _ = load_corpus(self.corpus_path)
            texts = loaded.texts_for_encoding()
            vectors = self.encoder.encode_corpus(texts, cache_dir=config.cache_dir, batch_size=config.batch_size,
                                                 precision=config.precision, show_progress=config.progress,
                                                 desc="audit: encode corpus")
            self.passages.preload(texts, vectors)
            distinct = list(dict.fromkeys(texts))
            order = list(range(len(distinct)))
            self.rng.shuffle(order)
            random_texts = [distinct[i] for i in order[: config.random_passages + min(len(self.sample), 2000)]]
        else:
            self.corpus_path = None
            random_texts = list(dict.fromkeys(self.passage_sample))
            self.rng.shuffle(random_texts)
        texts = [t for r in self.sample for t in r.pos + r.neg]
        self.passages.add(texts + random_texts, "audit: encode passages")
        self.queries.add([r.query for r in self.sample], "audit: encode queries")
        # the pool: the corpus (with the audited passages, which may not be in it), else the audited passages and
        # the random ones
        pool_texts = list(self.passages.row) if corpus else list(dict.fromkeys(texts + random_texts))
        self.pool_ = _Pool(pool_texts, self.passages.of(pool_texts), self.encoder.device)
        k = min(config.random_passages, max(20, len(random_texts) // 2))
        self.random_texts = random_texts[:k]
        self.null_texts = random_texts[k:] or random_texts  # a null that is also in R is left out of its own rank
        if len(self.random_texts) < 20:
            raise DataError(config.data, f"only {len(random_texts)} distinct passages to draw random ones from",
                            fix="give a larger training file, or a corpus (--corpus) to draw random passages from")
        self.random_matrix = self.passages.of(self.random_texts)

    # -- pass 2: the teacher on the sample
    def _null_excluded(self, record: Record, pseudo: str) -> set[int]:
        """Passages a planted null is not compared with: itself and, when the pool is the audited passages (where a
        real false positive's true positive is missing), the record's own positives."""
        banned = {text_hash(pseudo)}
        return banned if self.corpus_path else banned | {text_hash(p) for p in record.pos}

    def _measure(self, items: list[tuple[str, Record, str, int]], excluded: list[set[int]]) -> list[dict]:
        """Cosine, random p-value and gap of each ``(kind, record, passage, positive index)``."""
        from ..filtering.teacher import random_p_value

        q = self.queries.of([record.query for _, record, _, _ in items])
        p = self.passages.of([text for _, _, text, _ in items])
        inside = [[normalize(t) for t in (record.pos if kind == "pair" else [text])]
                  for kind, record, text, _ in items]
        best, best_rows = self.pool_.best(q, excluded, inside)
        # scores the decisions compare are taken in float64, row by row: the same whatever the block size (a float32
        # matrix product rounds differently with the shapes, and a tie may flip)
        q64, p64 = q.astype(np.float64), p.astype(np.float64)
        scores = np.einsum("nd,nd->n", q64, p64)
        rand = np.einsum("nd,kd->nk", q64, self.random_matrix.astype(np.float64))
        for n, row in enumerate(best_rows):
            if row >= 0:
                best[n] = float(q64[n] @ self.pool_.vectors[row].astype(np.float64))
        out = []
        for n, (kind, record, text, j) in enumerate(items):
            s = float(scores[n])
            u = random_p_value(s, rand[n], self.random_hashes == text_hash(text))
            top = best[n]
            out.append({"kind": kind, "record": record, "positive": j, "score": s, "u": u,
                        "gap": float(top - s) if np.isfinite(top) else -np.inf,
                        "competitor": self.pool_.texts[best_rows[n]] if best_rows[n] >= 0 else None})
        return out

    def score(self) -> dict:
        config = self.config
        self.random_hashes = np.fromiter((text_hash(t) for t in self.random_texts), dtype=np.int64,
                                         count=len(self.random_texts))
        pairs: list[dict] = []
        hard_null, random_null_gap, random_null_u = [], [], []
        neg_scores: dict[int, np.ndarray] = {}
        from tqdm.auto import tqdm

        bar = tqdm(total=len(self.sample), desc="audit: score", unit="record", disable=not config.progress)
        for start in range(0, len(self.sample), self.block):
            block = self.sample[start:start + self.block]
            items, excluded = [], []
            for record in block:
                positives = {text_hash(p) for p in record.pos}
                for j, text in enumerate(record.pos):
                    items.append(("pair", record, text, j))
                    excluded.append(positives)
                if record.neg:  # hard null: the record's first (hardest-mined) negative stands in as its positive
                    items.append(("hard", record, record.neg[0], -1))
                    excluded.append(self._null_excluded(record, record.neg[0]))
                null_text = self.null_texts[(record.index * 7919 + config.seed) % len(self.null_texts)]
                items.append(("random", record, null_text, -1))
                excluded.append(self._null_excluded(record, null_text))
            measured = self._measure(items, excluded)
            for item in measured:
                if item["kind"] == "random":
                    random_null_gap.append((item["gap"], item["u"]))
                    random_null_u.append(item["u"])
                elif item["kind"] == "hard":
                    hard_null.append((item["gap"], item["u"]))
                else:
                    record = item["record"]
                    if record.index not in neg_scores:  # once per record, however many positives it has
                        neg_scores[record.index] = (self.passages.of(record.neg) @ self.queries.of([record.query])[0]) \
                            if record.neg else np.zeros(0, dtype=np.float32)
                    item["neg_scores"] = neg_scores[record.index]
                    item["beaten_by_negatives"] = int((item["neg_scores"] > item["score"]).sum())
                    item["negatives"] = len(record.neg)
                    pairs.append(item)
            bar.update(len(block))
        bar.close()
        return {"pairs": pairs, "hard_null": np.array(hard_null, dtype=np.float64).reshape(-1, 2),
                "random_null_gap": np.array(random_null_gap, dtype=np.float64).reshape(-1, 2),
                "random_null_u": np.array(random_null_u, dtype=np.float64), "k": len(self.random_texts)}

    def reference(self) -> tuple[np.ndarray | None, dict]:
        """``gap`` of the evaluation split's trusted pairs, against its own corpus."""
        config = self.config
        if not config.eval_data or not config.reference:
            return None, {}
        dataset = self.eval_dataset()
        texts = dataset.corpus.texts_for_encoding()
        same = self.corpus_path is not None and Path(self.corpus_path).resolve() == \
            _corpus_path(Path(config.eval_data)).resolve()
        if same:
            pool = self.pool_
        else:
            vectors = self.encoder.encode_corpus(texts, cache_dir=config.cache_dir, batch_size=config.batch_size,
                                                 precision=config.precision, show_progress=config.progress,
                                                 desc="audit: encode evaluation corpus")
            self.passages.preload(texts, vectors)
            pool = _Pool(texts, _unit(vectors), self.encoder.device)
        by_id = dict(zip(dataset.corpus.ids, texts))
        qids = list(dataset.qrels)
        self.queries.add([dataset.queries[q] for q in qids], "audit: encode evaluation queries")
        query_texts, excluded, positives = [], [], []
        for qid in qids:
            relevant = [by_id[d] for d, g in dataset.qrels[qid].items() if g > 0]
            hashes = {text_hash(t) for t in relevant}
            for text in relevant:
                query_texts.append(dataset.queries[qid])
                excluded.append(hashes)
                positives.append(text)
        self.passages.add(positives, "audit: encode evaluation positives")
        qv = self.queries.of(query_texts)
        best, _ = pool.best(qv, excluded)
        scores = np.einsum("nd,nd->n", qv, self.passages.of(positives))
        gaps = best - scores
        u = (1 + ((qv @ self.random_matrix.T) >= scores[:, None]).sum(axis=1)) / (len(self.random_texts) + 1)
        keep = np.isfinite(gaps)
        return np.stack([gaps[keep], u[keep]], axis=1), {"data": str(config.eval_data), "split": config.eval_split,
                                         "pairs": int(len(positives)), "queries": len(qids),
                                         "same_corpus_as_search_pool": bool(same)}

    def eval_dataset(self):
        if getattr(self, "_eval", None) is None:
            from ..data.beir import load_beir

            self._eval = load_beir(self.config.eval_data, self.config.eval_split)
        return self._eval

    # -- leakage into the evaluation split
    def leakage(self) -> None:
        config = self.config
        if not config.eval_data:
            return
        dataset = self.eval_dataset()
        texts = dict(zip(dataset.corpus.ids, dataset.corpus.texts_for_encoding()))
        eval_queries = {text_hash(t): (qid, t) for qid, t in dataset.queries.items()}
        eval_positives = {text_hash(texts[d]): (d, texts[d]) for judged in dataset.qrels.values()
                          for d, g in judged.items() if g > 0}
        exact = set()
        for index, h in sorted(self.checks.in_set(set(eval_queries), "query").items()):
            file, line = self.where[index]
            qid, text = eval_queries[h]
            exact.add(index)
            self.flag_other({"kind": "leakage", "reason": "query_in_eval", "file": file, "line": line,
                             "text": text, "eval_query_id": qid})
        # paraphrases among the sampled records: cosine to an evaluation query
        eval_ids = list(dataset.queries)
        self.queries.add([dataset.queries[q] for q in eval_ids], "audit: encode evaluation queries")
        ev = self.queries.of([dataset.queries[q] for q in eval_ids])
        sv = self.queries.of([r.query for r in self.sample])
        for start in range(0, len(self.sample), 1024):
            sims = sv[start:start + 1024] @ ev.T
            best = sims.argmax(axis=1)
            for i, j in enumerate(best.tolist()):
                record = self.sample[start + i]
                if sims[i, j] >= config.duplicate_cosine and record.index not in exact:
                    self.flag_other({"kind": "leakage", "reason": "near_query_in_eval", "file": record.file,
                                     "line": record.line, "query": record.query,
                                     "text": dataset.queries[eval_ids[j]], "eval_query_id": eval_ids[j],
                                     "score": round(float(sims[i, j]), 4)})
        for index, h in sorted(self.checks.in_set(set(eval_positives), "positive").items()):
            file, line = self.where[index]
            doc, text = eval_positives[h]
            self.flag_other({"kind": "leakage", "reason": "positive_in_eval", "file": file, "line": line,
                             "text": text[:300], "eval_doc_id": doc})

    def duplicates(self) -> None:
        same_record, same_query = self.checks.duplicates()
        for reason, found in (("duplicate_record", same_record), ("duplicate_query", same_query)):
            for index, first in sorted(found.items()):
                file, line = self.where[index]
                first_file, first_line = self.where[first]
                self.flag_other({"kind": "duplicate", "reason": reason, "file": file, "line": line,
                                 "first": {"file": first_file, "line": first_line}})
        for index, count in sorted(self.checks.reused_positives(self.config.max_positive_reuse).items()):
            file, line = self.where[index]
            self.flag_other({"kind": "duplicate", "reason": "positive_reused", "file": file, "line": line,
                             "records_sharing_it": count})

    def false_negatives(self, pairs: list[dict], suspects: set[int]) -> tuple[list[dict], dict]:
        """Negatives of records whose positive is not random-like: above the positive's margin, or near-duplicates
        of it."""
        from ..negatives.margins import margin_reason

        config = self.config
        flags = []
        checked = records_flagged = 0
        by_record: dict[int, list[dict]] = {}
        for pair in pairs:
            by_record.setdefault(pair["record"].index, []).append(pair)
        for index, items in by_record.items():
            record = items[0]["record"]
            if index in suspects or not record.neg:
                continue
            negs = self.passages.of(record.neg)
            scores = items[0]["neg_scores"]  # the query's cosine to each negative, taken in score()
            lowest = min(items, key=lambda p: p["score"])
            closeness = (negs @ self.passages.of(record.pos).T).max(axis=1)
            positives = {normalize(p) for p in record.pos}
            found = False
            for text, score, close in zip(record.neg, scores.tolist(), closeness.tolist()):
                if normalize(text) in positives:
                    continue  # degenerate (negative_equals_positive), reported there
                checked += 1
                reason = None
                if close >= config.duplicate_cosine:
                    reason = "near_duplicate_of_positive"
                elif margin_reason(score, lowest["score"], None, config.relative_margin):
                    reason = "above_positive_margin"
                if reason:
                    found = True
                    flags.append({"kind": "false_negative", "reason": reason, "file": record.file,
                                  "line": record.line, "query": record.query,
                                  "positive": record.pos[lowest["positive"]], "text": text, "score": round(score, 4),
                                  "positive_score": round(lowest["score"], 4), "positive_cosine": round(close, 4)})
            records_flagged += found
        flags.sort(key=lambda f: f["score"] - f["positive_score"], reverse=True)
        return flags, {"negatives_checked": checked, "flagged": len(flags), "records_with_a_flag": records_flagged}

    def suspected_positives(self, pairs: list[dict], k: int, threshold: float) -> tuple[list[dict], set[int]]:
        flags, suspects = [], set()
        for pair in pairs:
            record = pair["record"]
            if pair["u"] > MU:  # a true positive outscores 90 % of random passages (on clean SciFact: all but 1 %)
                reason = "random_like"
                why = (f"{100 * pair['u']:.0f} % of {k} random passages score at least as high "
                       f"(cosine {pair['score']:.3f})")
            elif np.isfinite(threshold) and pair["gap"] > threshold:
                reason = "outranked"
                why = (f"a passage of the {self.pool_source} scores {pair['gap']:.3f} higher (more than the hard nulls' "
                       f"median gap, {threshold:.3f}); {pair['beaten_by_negatives']} of its {pair['negatives']} "
                       "negatives outscore it")
            else:
                continue
            if reason == "random_like":  # only a confident suspect makes its negatives' comparison meaningless
                suspects.add(record.index)
            flags.append({"kind": "false_positive", "reason": reason, "file": record.file, "line": record.line,
                          "query": record.query, "text": record.pos[pair["positive"]],
                          "score": round(pair["u"] if reason == "random_like" else pair["gap"], 4),
                          "cosine": round(pair["score"], 4), "random_p": round(pair["u"], 4),
                          "gap": round(pair["gap"], 4), "why": why,
                          "best_other_passage": (pair["competitor"] or "")[:300]})
        flags.sort(key=lambda f: (f["reason"] != "random_like", -f["score"]))
        return flags, suspects

    def run(self) -> dict:
        config = self.config
        self.out.mkdir(parents=True, exist_ok=True)
        self.counts: dict[str, dict[str, int]] = {}
        other_path = self.out / (FLAGGED + ".other")
        with open(other_path, "w", encoding="utf-8") as self.other:
            self.read()
            self.duplicates()
            self.pool()
            scored = self.score()
            self.leakage()
        pairs = scored["pairs"]
        ref, ref_info = self.reference()
        u = np.array([p["u"] for p in pairs])
        gap = np.array([p["gap"] for p in pairs])
        estimate = estimate_rates(u, gap, k=scored["k"], hard_null=scored["hard_null"],
                                  random_null_gap=scored["random_null_gap"], random_null_u=scored["random_null_u"],
                                  reference=ref, bootstrap=config.bootstrap, seed=config.seed)
        threshold = estimate.parts.get("threshold", float("inf"))
        fp_flags, suspects = self.suspected_positives(pairs, scored["k"], threshold)
        fn_flags, fn_info = self.false_negatives(pairs, suspects)
        with atomic_write(self.out / FLAGGED) as handle:
            for item in fp_flags + fn_flags:
                handle.write(json.dumps(item, ensure_ascii=False) + "\n")
                self.counts.setdefault(item["kind"], {}).setdefault(item["reason"], 0)
                self.counts[item["kind"]][item["reason"]] += 1
            with open(other_path, encoding="utf-8") as other:
                for line in other:
                    handle.write(line)
        other_path.unlink()
        counts = self.counts
        denominators = {"false_positive": len(pairs), "false_negative": max(1, fn_info["negatives_checked"])}
        shares = {f"{kind}:{reason}": n / max(1, denominators.get(kind, self.records))
                  for kind, reasons in counts.items() for reason, n in reasons.items()}
        from .recommend import recommend

        report = {
            "data": str(config.data), "split": config.split if _is_beir(Path(config.data)) else None,
            "records": self.records, "pairs": self.pairs, "negatives": self.negatives,
            "scored_records": len(self.sample), "scored_pairs": len(pairs),
            "sampled": len(self.sample) < self.records,
            "teacher": str(config.model or "bundled all-MiniLM-L6-v2"),
            "search_pool": {"source": self.pool_source, "corpus": self.corpus_path, "passages": len(self.pool_.texts)},
            "false_positives": {"estimate": estimate.to_json(), "text": estimate.text(),
                                "flagged": counts.get("false_positive", {})},
            "false_negatives": {**fn_info,
                                "share_of_records": round(fn_info["records_with_a_flag"] / max(1, len(self.sample)), 6),
                                "flagged_by_reason": counts.get("false_negative", {})},
            "degenerate": counts.get("degenerate", {}), "duplicates": counts.get("duplicate", {}),
            "leakage": counts.get("leakage", {}), "reference": ref_info,
            "flagged_share": {k: round(v, 6) for k, v in sorted(shares.items())},
            "distributions": _distributions(gap, u, scored, ref),
            "config": asdict(config),
        }
        report["recommendation"] = recommend(report)
        return report


def _distributions(gap: np.ndarray, u: np.ndarray, scored: dict, ref: np.ndarray | None) -> dict:
    """Histograms for the plot: the pairs' gaps against the nulls' and the reference's, and the p-values."""
    scored = {**scored, "hard_null": scored["hard_null"][:, 0], "random_null_gap": scored["random_null_gap"][:, 0]}
    ref = None if ref is None else ref[:, 0]
    finite = [x for x in (gap, scored["hard_null"], scored["random_null_gap"], ref) if x is not None and len(x)]
    values = np.concatenate([x[np.isfinite(x)] for x in finite]) if finite else np.zeros(1)
    edges = np.linspace(float(np.min(values)), float(np.max(values)) + 1e-9, 41)

    def hist(x: np.ndarray | None) -> list[float] | None:
        if x is None or not len(x):
            return None
        x = x[np.isfinite(x)]
        counts, _ = np.histogram(x, bins=edges)
        return (counts / max(1, x.size)).round(6).tolist()

    u_edges = np.linspace(0, 1, 21)
    return {"gap_edges": edges.round(6).tolist(), "gap": {"pairs": hist(gap), "hard_nulls": hist(scored["hard_null"]),
                                                         "random_nulls": hist(scored["random_null_gap"]),
                                                         "reference": hist(ref)},
            "u_edges": u_edges.tolist(),
            "u": {"pairs": (np.histogram(u, bins=u_edges)[0] / max(1, u.size)).round(6).tolist(),
                  "random_nulls": (np.histogram(scored["random_null_u"], bins=u_edges)[0]
                                   / max(1, len(scored["random_null_u"]))).round(6).tolist()}}
