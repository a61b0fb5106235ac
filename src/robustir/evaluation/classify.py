"""Zero-shot and few-shot text classification with an embedding model (GUR paper §III-C, Fig. 3, Fig. 8).

GUR's test-time use besides retrieval: "the learned text encoder synthesizes a zero-shot classifier by embedding the
names of the target dataset's classes"; "the models encode both the samples and the labels into vectors,
subsequently searching for the nearest label for each sample"
(docs/methods.md#zero-shot-classification-with-the-encoder).

* **zero-shot**: each class is the embedding of its name, or of ``"name: description"`` when a description is
  given (``--descriptions``); a sample gets the class of highest cosine similarity;
* **few-shot** (``shots = k``): each class is the prototype of ``k`` labelled examples drawn from a training file
  with a generator seeded by ``seed`` (the normalised mean of their normalised embeddings); nearest prototype;
* samples are embedded as queries (the model's query instruction, or ``prompt``), class texts as passages (the
  model's passage instruction, or ``label_prompt``); both truncated to ``max_length`` tokens (default: the model's
  passage length).

Inputs: a JSONL file of ``{"text": ..., "label": ...}`` (optional ``"id"``) and a label list - a text file with one
label per line (``label<TAB>description`` allowed) or JSON (a list of names, or an object ``{name: description}``).
Works with any model :class:`robustir.models.encoder.Encoder` loads (robustir, sentence-transformers, HF folders,
the T5 encoder a GUR pre-training run saves).

Metrics (:func:`classification_metrics`, exact and dependency-free; equal to scikit-learn's ``accuracy_score`` and
``f1_score(average="macro")``, tested): accuracy, macro-F1 over the classes that occur in the gold labels or the
predictions (scikit-learn's default; a class neither present nor predicted does not count), per-class precision,
recall, F1 and support, and the confusion matrix (rows: gold, columns: predicted). Outputs (``output`` folder):
``report.json``, ``report.md`` (summary, per-class table, confusion table) and ``predictions.jsonl``.
"""

from __future__ import annotations

import difflib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, DataError
from ..io import atomic_write, read_jsonl, write_json
from ..precision import Precision
from ..validation import config_dataclass, NonNegativeInt, PositiveInt, Seed

logger = logging.getLogger(__name__)

__all__ = ["ClassifyConfig", "ClassifyResult", "LabelSet", "classification_metrics", "classify", "confusion_markdown",
           "read_label_descriptions", "read_labelled", "read_labels"]


@config_dataclass
class ClassifyConfig:
    """How ``robustir classify`` classifies (the inputs are arguments of :func:`classify`)."""

    shots: NonNegativeInt = 0
    """Labelled examples per class (from train) averaged into a prototype; 0 = zero-shot."""
    seed: Seed = 0
    """Which examples the few-shot prototypes use."""
    prompt: str | None = None
    """Prefix of every sample text; None = the model's query instruction."""
    label_prompt: str | None = None
    """Prefix of every class text; None = the model's passage instruction."""
    max_length: PositiveInt | None = None
    """Tokens per text; None = the model's passage length."""
    batch_size: PositiveInt = 64
    """Encoding batch size."""
    precision: Precision = "auto"
    """Auto: bf16 where native (GPU, AMX/AVX512-BF16 CPU), else fp32."""
    device: str = "auto"
    """Where the model runs: auto (first GPU if any, else CPU), cpu, cuda, cuda:N."""


@dataclass
class LabelSet:
    """The classes in their file order, with optional descriptions."""

    names: list[str]
    descriptions: dict[str, str] = field(default_factory=dict)

    def texts(self) -> list[str]:
        """What is embedded for each class in zero-shot mode: the name, or ``"name: description"``."""
        return [f"{name}: {self.descriptions[name]}" if self.descriptions.get(name) else name for name in self.names]


@dataclass
class ClassifyResult:
    report: dict[str, Any]
    predictions: list[dict[str, Any]]
    seconds: float
    output: Path | None = None

    @property
    def accuracy(self) -> float:
        return float(self.report["accuracy"])

    @property
    def macro_f1(self) -> float:
        return float(self.report["macro_f1"])


# ---------------------------------------------------------------------------- inputs

def _label_value(value: Any, path: Path, line: int | None, field_name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DataError(path, f"a label must be a string (or an integer), got {type(value).__name__} {value!r}",
                        line=line, field=field_name, fix='write the class name as a string, e.g. "sports"')
    text = str(value).strip()
    if not text:
        raise DataError(path, "empty label", line=line, field=field_name, fix="give every class a name")
    return text


def _read_text(path: Path, what: str) -> str:
    if not path.exists():
        raise DataError(path, f"{what} file not found", fix="check the path")
    if path.is_dir():
        raise DataError(path, f"is a folder; the {what} are a file", fix="pass the file itself")
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(path, f"not valid UTF-8 at byte {exc.start}", fix="save the file as UTF-8") from None


def _read_pairs_file(path: Path, what: str) -> list[tuple[str, str | None, int | None]]:
    """``(name, description or None, line)`` from a JSON list / object or a text file (``name[<TAB>description]``)."""
    text = _read_text(path, what)
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(path, f"invalid JSON ({exc.msg})", line=exc.lineno,
                            fix='write a list ["name", ...] or an object {"name": "description", ...}') from None
        if isinstance(data, list):
            return [(_label_value(item, path, None, f"[{i}]"), None, None) for i, item in enumerate(data)]
        if isinstance(data, dict):
            entries = []
            for key, description in data.items():
                if description is not None and not isinstance(description, str):
                    raise DataError(path, f"the description must be a string or null, got "
                                    f"{type(description).__name__}", field=key,
                                    fix='write {"name": "a short description", ...}')
                entries.append((_label_value(key, path, None, key), (description or "").strip() or None, None))
            return entries
        raise DataError(path, f"expected a JSON list or object, got {type(data).__name__}",
                        fix='write a list ["name", ...] or an object {"name": "description", ...}')
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        name, _, description = raw.partition("\t")
        entries.append((_label_value(name, path, number, "label"), description.strip() or None, number))
    return entries


def read_labels(path: str | Path) -> LabelSet:
    """The label list: a text file (one class per line, ``name<TAB>description`` allowed, ``#`` comments) or JSON (a
    list of names, or an object ``{name: description or null}``). At least two distinct classes."""
    path = Path(path)
    entries = _read_pairs_file(path, "labels")
    names: list[str] = []
    descriptions: dict[str, str] = {}
    first_seen: dict[str, int | None] = {}
    for name, description, line in entries:
        if name in first_seen:
            where = f" (first on line {first_seen[name]})" if first_seen[name] is not None else ""
            raise DataError(path, f"label {name!r} is listed twice{where}", line=line,
                            fix="list every class once")
        first_seen[name] = line
        names.append(name)
        if description:
            descriptions[name] = description
    if len(names) < 2:
        raise DataError(path, f"{len(names)} label(s); classification needs at least two classes",
                        fix="list one class per line (or a JSON list of names)")
    return LabelSet(names, descriptions)


def read_label_descriptions(path: str | Path, labels: LabelSet) -> LabelSet:
    """Add descriptions from a file (JSON object ``{name: description}`` or ``name<TAB>description`` lines) to
    ``labels``; every name must be a listed class (classes left out keep their name alone)."""
    path = Path(path)
    descriptions = dict(labels.descriptions)
    for name, description, line in _read_pairs_file(path, "descriptions"):
        if name not in labels.names:
            raise DataError(path, f"description for {name!r}, which is not in the label list", line=line,
                            field="label", fix=_closest(name, labels.names))
        if not description:
            raise DataError(path, f"no description for {name!r}", line=line,
                            fix="write name<TAB>description (text) or {\"name\": \"description\"} (JSON)")
        descriptions[name] = description
    return LabelSet(list(labels.names), descriptions)


def _closest(name: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    return (f"did you mean {close[0]!r}? " if close else "") + f"the classes are: {', '.join(names[:20])}" + \
        (" ..." if len(names) > 20 else "")


def read_labelled(path: str | Path, labels: LabelSet) -> list[dict[str, Any]]:
    """``[{"line", "text", "label", "id"?}, ...]`` from a JSONL file of ``{"text": ..., "label": ...}``; every label
    must be in ``labels``."""
    path = Path(path)
    known = set(labels.names)
    records = []
    for line, obj in read_jsonl(path):
        text = obj.get("text")
        if not isinstance(text, str) or not text.strip():
            problem = "missing" if "text" not in obj else f"expected a non-empty string, got {text!r}"[:120]
            raise DataError(path, f"text {problem}", line=line, field="text",
                            fix='each line needs {"text": "...", "label": "..."}')
        if "label" not in obj:
            raise DataError(path, "label missing", line=line, field="label",
                            fix='each line needs {"text": "...", "label": "..."} with a label from the label list')
        label = _label_value(obj["label"], path, line, "label")
        if label not in known:
            raise DataError(path, f"label {label!r} is not in the label list", line=line, field="label",
                            fix=_closest(label, labels.names))
        record = {"line": line, "text": text, "label": label}
        if "id" in obj:
            record["id"] = obj["id"]
        records.append(record)
    if not records:
        raise DataError(path, "no examples", fix='write one {"text": "...", "label": "..."} object per line')
    return records


# ---------------------------------------------------------------------------- metrics

def classification_metrics(gold: Sequence[int], predicted: Sequence[int], labels: Sequence[str]) -> dict[str, Any]:
    """Accuracy, macro-F1, per-class precision / recall / F1 / support and the confusion matrix.

    ``gold`` and ``predicted`` are class indices into ``labels``. A ratio with a zero denominator is 0 (as
    scikit-learn with ``zero_division=0``); macro-F1 averages over the classes present in ``gold`` or ``predicted``
    (scikit-learn's default label set).
    """
    n = len(labels)
    gold_a, pred_a = np.asarray(gold, dtype=np.int64), np.asarray(predicted, dtype=np.int64)
    if gold_a.shape != pred_a.shape:
        raise ValueError(f"{len(gold_a)} gold labels for {len(pred_a)} predictions")
    if len(gold_a) and (min(gold_a.min(), pred_a.min()) < 0 or max(gold_a.max(), pred_a.max()) >= n):
        raise ValueError("class indices out of range")
    confusion = np.zeros((n, n), dtype=np.int64)
    np.add.at(confusion, (gold_a, pred_a), 1)
    true_positive = np.diag(confusion).astype(np.float64)
    support = confusion.sum(axis=1)
    predicted_count = confusion.sum(axis=0)

    def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
        return np.divide(num, den, out=np.zeros_like(num, dtype=np.float64), where=den > 0)

    precision = ratio(true_positive, predicted_count.astype(np.float64))
    recall = ratio(true_positive, support.astype(np.float64))
    f1 = ratio(2 * true_positive, (support + predicted_count).astype(np.float64))  # = 2PR / (P + R)
    present = (support + predicted_count) > 0
    total = int(confusion.sum())
    return {
        "accuracy": float(true_positive.sum() / total) if total else 0.0,
        "macro_f1": float(f1[present].mean()) if present.any() else 0.0,
        "num_examples": total,
        "per_class": {name: {"precision": float(precision[i]), "recall": float(recall[i]), "f1": float(f1[i]),
                             "support": int(support[i]), "predicted": int(predicted_count[i])}
                      for i, name in enumerate(labels)},
        "confusion": {"labels": list(labels), "matrix": confusion.tolist()},
    }


def confusion_markdown(confusion: dict[str, Any]) -> str:
    """The confusion matrix as a markdown table: one row per gold class, one column per predicted class."""
    labels, matrix = confusion["labels"], confusion["matrix"]
    escape = [str(x).replace("|", "\\|") for x in labels]
    lines = ["| gold \\ predicted | " + " | ".join(escape) + " |", "|---|" + "---:|" * len(labels)]
    lines += [f"| {escape[i]} | " + " | ".join(str(v) for v in row) + " |" for i, row in enumerate(matrix)]
    return "\n".join(lines)


def report_markdown(report: dict[str, Any]) -> str:
    mode = "few-shot" if report["shots"] else "zero-shot"
    lines = [f"# Classification: {report['data']}", "",
             f"- model: `{report['model']}`",
             f"- mode: {mode}" + (f" ({report['shots']} examples per class from `{report['train']}`, seed "
                                  f"{report['seed']})" if report["shots"] else
                                  " (nearest class name" + (" + description" if report["descriptions"] else "") + ")"),
             f"- examples: {report['num_examples']}, classes: {len(report['labels'])}",
             f"- **accuracy {100 * report['accuracy']:.2f}**, **macro-F1 {100 * report['macro_f1']:.2f}**", "",
             "| class | precision | recall | F1 | support | predicted |", "|---|---:|---:|---:|---:|---:|"]
    for name, row in report["per_class"].items():
        cell = name.replace("|", "\\|")
        lines.append(f"| {cell} | {100 * row['precision']:.1f} | {100 * row['recall']:.1f} | "
                     f"{100 * row['f1']:.1f} | {row['support']} | {row['predicted']} |")
    lines += ["", "Confusion (rows: gold, columns: predicted):", "", confusion_markdown(report["confusion"]), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the stage

def _normalise(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


def choose_shots(records: Sequence[dict[str, Any]], labels: LabelSet, shots: int, seed: int,
                 path: str | Path) -> dict[str, list[int]]:
    """Indices into ``records`` of up to ``shots`` examples per class, drawn without replacement by a generator
    seeded by ``seed`` (class by class, in label order). A class without any example is a :class:`DataError`."""
    rng = np.random.default_rng(seed)
    by_class: dict[str, list[int]] = {name: [] for name in labels.names}
    for index, record in enumerate(records):
        by_class[record["label"]].append(index)
    chosen: dict[str, list[int]] = {}
    for name in labels.names:
        pool = by_class[name]
        if not pool:
            raise DataError(path, f"no example of class {name!r}; few-shot prototypes need at least one per class",
                            fix=f"add labelled examples of {name!r}, or drop the class from the label list")
        if len(pool) < shots:
            logger.warning("class %r has %d example(s) in %s, fewer than shots=%d: its prototype uses them all",
                           name, len(pool), path, shots)
        take = min(shots, len(pool))
        chosen[name] = sorted(int(i) for i in rng.choice(pool, size=take, replace=False))
    return chosen


def classify(model: Any, data: str | Path, labels: str | Path | LabelSet, config: ClassifyConfig | None = None, *,
             descriptions: str | Path | None = None, train: str | Path | None = None,
             output: str | Path | None = None) -> ClassifyResult:
    """Classify the examples of ``data`` into the classes of ``labels`` with an embedding ``model`` (an
    :class:`~robustir.models.encoder.Encoder` or anything :meth:`Encoder.from_pretrained` loads).

    Zero-shot (``config.shots == 0``): nearest class text (name, or ``"name: description"``). Few-shot: nearest
    prototype of ``config.shots`` examples per class from ``train``. Writes ``report.json``, ``report.md`` and
    ``predictions.jsonl`` into ``output`` when given.
    """
    from ..models.encoder import Encoder
    from ..outputs import refuse_overwriting_inputs

    config = config or ClassifyConfig()
    if config.shots and train is None:
        raise ConfigError(f"shots = {config.shots} needs a training file (--train FILE) with labelled examples to "
                          "build the class prototypes from")
    if not config.shots and train is not None:
        raise ConfigError("a training file is only read for few-shot prototypes: give --shots k (k > 0), or leave "
                          "--train out for zero-shot")
    label_set = labels if isinstance(labels, LabelSet) else read_labels(labels)
    if descriptions is not None:
        label_set = read_label_descriptions(descriptions, label_set)
    records = read_labelled(data, label_set)
    train_records = read_labelled(train, label_set) if train is not None else []
    shot_indices = choose_shots(train_records, label_set, config.shots, config.seed, train) if config.shots else {}
    out = Path(output) if output is not None else None
    if out is not None:
        inputs = [data, train, descriptions] + ([] if isinstance(labels, LabelSet) else [labels])
        for name in ("report.json", "report.md", "predictions.jsonl"):
            refuse_overwriting_inputs(out / name, *inputs, stage="classify")

    start = time.perf_counter()
    if isinstance(model, Encoder):
        encoder = model
        model_name = model.source or type(model).__name__
        if config.device != "auto":
            from ..device import resolve_device

            encoder = encoder.to(resolve_device(config.device))
    else:
        encoder = Encoder.from_pretrained(model, device=config.device)
        model_name = str(model)
    length = config.max_length or encoder.config.passage_max_length
    options = {"batch_size": config.batch_size, "precision": config.precision, "max_length": length}
    samples = _normalise(encoder.encode([r["text"] for r in records], "query", instruction=config.prompt, **options))
    if config.shots:
        order = [i for name in label_set.names for i in shot_indices[name]]
        shot_vectors = _normalise(encoder.encode([train_records[i]["text"] for i in order], "query",
                                                 instruction=config.prompt, **options))
        rows, prototypes = 0, []
        for name in label_set.names:
            count = len(shot_indices[name])
            prototypes.append(shot_vectors[rows:rows + count].mean(axis=0))
            rows += count
        classes = _normalise(np.stack(prototypes))
    else:
        classes = _normalise(encoder.encode(label_set.texts(), "passage", instruction=config.label_prompt, **options))
    scores = samples @ classes.T
    predicted = scores.argmax(axis=1)
    seconds = time.perf_counter() - start

    index = {name: i for i, name in enumerate(label_set.names)}
    gold = [index[r["label"]] for r in records]
    metrics = classification_metrics(gold, predicted.tolist(), label_set.names)
    report = {
        "model": model_name,
        "data": str(data),
        "mode": "few-shot" if config.shots else "zero-shot",
        "labels": list(label_set.names),
        "descriptions": dict(label_set.descriptions),
        "train": None if train is None else str(train),
        "shots_per_class": {name: len(ix) for name, ix in shot_indices.items()},
        **asdict(config),
        **metrics,
        "seconds": seconds,
    }
    predictions = []
    for row, record in enumerate(records):
        item = {"line": record["line"]}
        if "id" in record:
            item["id"] = record["id"]
        item.update(label=record["label"], prediction=label_set.names[int(predicted[row])],
                    score=float(scores[row, predicted[row]]), correct=bool(gold[row] == int(predicted[row])))
        predictions.append(item)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "report.json", report)
        with atomic_write(out / "report.md") as handle:
            handle.write(report_markdown(report))
        with atomic_write(out / "predictions.jsonl") as handle:
            for item in predictions:
                handle.write(json.dumps(item, ensure_ascii=False) + "\n")
    return ClassifyResult(report, predictions, seconds, out)
