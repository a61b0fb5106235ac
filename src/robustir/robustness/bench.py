"""The planted-noise benchmark (``robustir noise-bench``): how much does each kind of noise cost each method?

For every (noise kind, rate, seed) the clean BM25-mined (or ``mining: dense``) training data of a BEIR train split gets planted
noise (:mod:`robustir.robustness.noise`); every method then trains the same model at the same budget
(:class:`~robustir.robustness.sidebyside.Budget`) on rows materialised from its own input, and the model is
evaluated on the test split. Rate 0 is run once per seed and shared by every kind.

Methods (``METHODS``):

``infonce`` / ``peg`` / ``ccr``   robustir's losses with their defaults, on the noisy data as it is
``sieve``                         CCR passage sieve over the pool, then InfoNCE
``teacher``                       teacher filter (bundled MiniLM: negatives within 5 % of the positive, and
                                  positives that more than half of the pool outscores), then InfoNCE
``llm``                           the PEG LLM judge over the negatives (needs ``llm.base_url``/``llm.model``),
                                  then InfoNCE
``llm-pos``                       the same judge asked about every positive too: false positives removed, a record
                                  left without one takes its negatives judged relevant (label correction)
``teacher-peg``                   the teacher filter on the negatives only (false negatives), then PEG
``robust``                        the recipe for noisy data (``robust`` options): the teacher filter drops positives
                                  that look random to the teacher, then PEG
``oracle``                        the planted false positives removed (plants.jsonl), then InfoNCE: what a perfect
                                  filter reaches with the data that is left -- the floor of any removal
``st``                            sentence-transformers MNRL through its own trainer (the anchor)

Output folder::

    data/mined.jsonl                       clean pool (BM25, from the train split)
    data/<kind>-<rate>-s<seed>/noisy.jsonl noisy data, plants.jsonl (what was planted), summary.json,
                                           teacher-<variant>.jsonl, sieve-..., llm-... (filtered copies;
                                           the variant fingerprints the filter's options)
    runs/<kind>-<rate>-s<seed>/<method>/   rows.jsonl and the training run
    results.jsonl                          one line per finished run, keyed by its cell fingerprint (method,
                                           options, model, budget, data content, splits, noise): a
                                           result is reused only for the same cell
    every data file and run folder         has its record <path>.run.json (robustir.runs): made again when
                                           what it depends on changes
    results.md, results.png                the table and one panel per kind
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Literal

from ..config import from_dict, to_dict
from ..data.training_data import TrainingExample, load_training_data
from ..errors import ConfigError
from ..io import atomic_write, write_json
from ..llm import LLMConfig
from ..outputs import StageOutput
from ..filtering.teacher import ROBUST_FILTER
from ..runs import Artifact, Fingerprint, fingerprint, operational
from .jobs import MemoryGate, peak_device_memory, reset_peak_device_memory, run_gated
from .noise import NOISE_KINDS, NoiseKind, plant_noise
from ..validation import config_dataclass, Items, ModelName, NonNegativeInt, PositiveInt, Seed
from .sidebyside import (PRESETS, Budget, evaluate_model, materialize_rows, train_robustir,
                         train_sentence_transformers, write_rows)

logger = logging.getLogger(__name__)

__all__ = ["NoiseBenchConfig", "run_noise_bench", "BenchMethod", "METHOD_TABLE", "METHODS", "BENCH_PRESETS", "filter_scores", "write_table",
           "plot_results"]

@dataclass(frozen=True)
class BenchMethod:
    """What a method of the benchmark is: the ``loss`` it trains with, through ``trainer`` (robustir's, or
    sentence-transformers' as the anchor), after the ``filter`` it runs over the noisy data first (teacher, sieve,
    llm, oracle; None: the data as it is), configured by the :class:`NoiseBenchConfig` field ``options``."""

    name: str
    loss: str = "infonce"
    filter: str | None = None
    options: str | None = None
    trainer: Literal["robustir", "st"] = "robustir"


#: the one place a method name is interpreted; every other use reads this table
METHOD_TABLE: dict[str, BenchMethod] = {m.name: m for m in (
    BenchMethod("infonce"), BenchMethod("peg", loss="peg"), BenchMethod("ccr", loss="ccr"),
    BenchMethod("sieve", filter="sieve", options="sieve"), BenchMethod("teacher", filter="teacher", options="teacher"),
    BenchMethod("llm", filter="llm", options="llm"), BenchMethod("llm-pos", filter="llm-pos", options="llm"),
    BenchMethod("teacher-peg", loss="peg", filter="teacher", options="teacher_peg"),
    BenchMethod("robust", loss="peg", filter="teacher", options="robust"), BenchMethod("oracle", filter="oracle"),
    BenchMethod("st", loss="mnrl", trainer="st"))}
METHODS = tuple(METHOD_TABLE)
#: the filters that ask an LLM judge: PEG's (negatives), and the same judge asked about the positives too (issue 50)
LLM_FILTERS = ("llm", "llm-pos")
#: methods that train on a filtered copy of the noisy data, and the filter each uses (from :data:`METHOD_TABLE`)
FILTERS = {m.name: m.filter for m in METHOD_TABLE.values() if m.filter}
Method = Literal[METHODS]  # type: ignore[valid-type]


#: the noise benchmark's budgets: ``cpu`` is one epoch (29 steps on SciFact, ~5 min a run on 2 cores) so the
#: default 1-kind x 2-rate x 4-method grid fits in an hour; ``gpu`` is the side-by-side's GPU budget.
#: ``cpu-long`` is the CPU proxy of the GPU budget's *trend* (several epochs over the same pairs, where a model
#: starts memorising the wrong ones): 5 epochs over a seeded subset of 300 training queries at 64 training tokens,
#: 55 steps, a few minutes a run on 2 cores (docs/robustness.md shows it reproduces the GPU preset's trend).
BENCH_PRESETS: dict[str, Budget] = {"cpu": replace(PRESETS["cpu"], epochs=1.0), "gpu": PRESETS["gpu"],
                                    "cpu-long": replace(PRESETS["cpu"], epochs=5.0, train_queries=300,
                                                        train_passage_max_length=64)}

#: the grid each preset runs when the config leaves it empty
DEFAULT_GRID = {
    "cpu": {"kinds": ["fp-random"], "rates": [0.0, 0.4], "methods": ["infonce", "peg", "robust", "st"], "seeds": [1]},
    "cpu-long": {"kinds": ["fp-random", "fp-hard"], "rates": [0.0, 0.4], "methods": ["infonce", "peg", "robust", "st"],
                 "seeds": [1]},
    "gpu": {"kinds": ["chunk-fn", "label-fn", "fp-random", "fp-hard"], "rates": [0.0, 0.2, 0.4],
            "methods": ["infonce", "peg", "ccr", "sieve", "teacher", "teacher-peg", "robust", "st"], "seeds": [1, 2, 3]},
}


@config_dataclass
class NoiseBenchConfig:
    data: str = ""
    """BEIR folder with a train split (noise goes here) and an evaluation split; default: bundled SciFact."""
    model: ModelName | None = None
    """Model folder or hub id; None = the bundled all-MiniLM-L6-v2."""
    preset: Literal["cpu", "cpu-long", "gpu"] = "cpu"
    """Budget and default grid (BENCH_PRESETS)."""
    kinds: Items[NoiseKind] = field(default_factory=list)
    """Noise kinds to plant (empty = the preset's grid)."""
    rates: Items[float] = field(default_factory=list)
    """Shares of noisy training queries, e.g. [0, 0.2, 0.4] (empty = the preset's grid)."""
    methods: Items[Method] = field(default_factory=list)
    """Training methods compared (empty = the preset's grid)."""
    seeds: Items[Seed] = field(default_factory=list)
    """Seeds of the noise and the training (empty = the preset's grid)."""
    output: str = "runs/noise-bench"
    """Result folder: results.jsonl, results.md, results.png."""
    train_split: str = "train"
    """Training split of data (noise is planted here)."""
    eval_split: str = "test"
    """Evaluation split of ``data``."""
    dev: NonNegativeInt = 0
    """Choose settings on a dev split: hold this many training queries out (seeded), plant noise in and train on
    the rest, and evaluate on the held-out queries (clean labels, full corpus) instead of ``eval_split``. 0 = off."""
    per_query: PositiveInt = 3
    """False negatives planted per noisy query."""
    mining: Literal["bm25", "dense"] = "bm25"
    """How the clean pools are mined: ``bm25``, or ``dense`` with the benchmark's model (PEG's setting). With
    ``dense``, ``fp-hard`` plants *dense near-miss* positives: the model's own top non-relevant passage."""
    budget: dict = field(default_factory=dict)
    """Overrides of the preset's budget fields, e.g. ``{epochs: 2}``."""
    teacher: dict = field(default_factory=lambda: {"relative_margin": 0.05, "suspect_positive_share": 0.5})
    """TeacherFilterConfig options of the ``teacher`` method (its only defence against false positives is
    dropping positives that more than half of their pool outscores)."""
    teacher_peg: dict = field(default_factory=lambda: {"relative_margin": 0.05})
    """TeacherFilterConfig options of the ``teacher-peg`` method's filter: false negatives only -- PEG's w_q
    handles false positives without discarding hard true pairs (docs/robustness.md)."""
    robust: dict = field(default_factory=lambda: dict(ROBUST_FILTER))
    """TeacherFilterConfig options of the ``robust`` method's filter (docs/robustness.md)."""
    sieve: dict = field(default_factory=dict)
    """SieveConfig options of the ``sieve`` method (default: keep half the pool)."""
    llm: dict = field(default_factory=dict)
    """LLMConfig fields of the ``llm`` method's endpoint, e.g.
    ``{base_url: http://localhost:8000/v1, model: Qwen2.5-7B-Instruct}``; the judge's defaults (temperature 0, 16
    reply tokens) apply unless given."""
    plots: bool = True
    """Write results.png."""
    keep_steps: bool = True
    """A method that trains on a filtered copy trains as many steps as the noisy data would: its epochs are scaled
    by (pairs given / pairs kept), as ``robustir train --filter-positives`` does. False: the same epochs over what
    is left (fewer steps)."""
    jobs: PositiveInt = operational(1)
    """Runs trained and evaluated at once, each in its own process (e.g. 9 on one H200: small models leave the
    GPU mostly idle); the data is prepared first, one file at a time. On a GPU a run starts only when the device has
    the memory runs were seen to need (each row records its peak; a fresh bench runs one alone first)."""

    def __post_init__(self) -> None:
        self.check_method_options()

    def check_method_options(self) -> None:
        """Each method's options are typed by the stage config they configure (TeacherFilterConfig,
        SieveConfig, LLMConfig, Budget): a typo or a bad value fails when the config loads, naming its key path."""
        from ..filtering.sieve import SieveConfig
        from ..filtering.teacher import TeacherFilterConfig

        for key, cls in (("teacher", TeacherFilterConfig), ("teacher_peg", TeacherFilterConfig),
                         ("robust", TeacherFilterConfig), ("sieve", SieveConfig)):
            options = getattr(self, key)
            if not isinstance(options, dict):
                raise ConfigError(f"noise-bench.{key}: expected a mapping of {cls.__name__} options, got {options!r}")
            from_dict(cls, options, where=f"noise-bench.{key}")
        if not isinstance(self.llm, dict) or not isinstance(self.budget, dict):
            raise ConfigError("noise-bench.llm and noise-bench.budget are mappings of options, e.g. {epochs: 2}")
        self.llm_config()
        if self.preset in BENCH_PRESETS:
            self.budget_obj()

    def resolved(self) -> "NoiseBenchConfig":
        if self.preset not in BENCH_PRESETS:
            raise ConfigError(f"noise-bench: unknown preset {self.preset!r}; valid: {', '.join(BENCH_PRESETS)}")
        grid = DEFAULT_GRID[self.preset]
        out = replace(self, kinds=list(self.kinds or grid["kinds"]), rates=list(self.rates or grid["rates"]),
                      methods=list(self.methods or grid["methods"]), seeds=list(self.seeds or grid["seeds"]))
        for kind in out.kinds:
            if kind not in NOISE_KINDS:
                raise ConfigError(f"noise-bench: unknown noise kind {kind!r} in kinds; valid: {', '.join(NOISE_KINDS)}")
        for method in out.methods:
            if method not in METHODS:
                raise ConfigError(f"noise-bench: unknown method {method!r} in methods; valid: {', '.join(METHODS)}")
        for seed in out.seeds:
            if seed < 0:
                raise ConfigError(f"noise-bench: seeds must be >= 0, got {seed}")
        for rate in out.rates:
            if not 0 <= rate <= 1:
                raise ConfigError(f"noise-bench: rates must be in [0, 1], got {rate}")
        llm = out.llm_config()
        for method in (m for m in out.methods if METHOD_TABLE[m].filter in LLM_FILTERS):
            if not llm.model:
                raise ConfigError(f"noise-bench: method {method!r} needs an endpoint: llm.base_url=... llm.model=...")
        self.budget_obj().validate()
        return out

    def llm_config(self) -> LLMConfig:
        return from_dict(LLMConfig, {"temperature": 0.0, "max_tokens": 16, **self.llm}, where="noise-bench.llm")

    def budget_obj(self) -> Budget:
        from ..config import precision_aliases

        base = BENCH_PRESETS[self.preset]
        budget = precision_aliases(dict(self.budget), {f.name: f for f in fields(Budget)}, "noise-bench.budget")
        unknown = set(budget) - set(asdict(base))
        if unknown:
            raise ConfigError(f"noise-bench: unknown budget field(s) {sorted(unknown)}; valid: {sorted(asdict(base))}")
        return from_dict(Budget, {**asdict(base), **budget}, where="noise-bench.budget")

    def method_options(self, method: str) -> dict:
        """The options that change what ``method`` trains on (its filter's settings); {} for plain losses."""
        spec = METHOD_TABLE[method]
        if spec.options is None:
            return {}
        options = dict(getattr(self, spec.options))
        if spec.filter in LLM_FILTERS:  # the key and the concurrency do not change the judgements
            options = {k: v for k, v in options.items() if k not in ("api_key", "api_key_env", "concurrency")}
        return options

    def variant(self, method: str) -> str:
        """A short name for the options of a filtering method ('' for the plain losses).

        Part of filtered files' and run folders' names (and of a result row, for the table): the same filter with
        the same options shares one filtered file. It is a name, not a "done?" answer -- each file and run is
        decided by its record's fingerprint (:func:`robustir.runs.fingerprint`, :meth:`Artifact.begin`); the
        hash is kept as it was so existing benchmark folders and recorded rows keep their names.
        """
        if method not in FILTERS:
            return ""
        name = FILTERS[method]  # same filter + options = same filtered file
        return hashlib.sha1(json.dumps([name, self.method_options(method)], sort_keys=True).encode()).hexdigest()[:8]


# ----------------------------------------------------------------------------------------------- helpers

def _rate_tag(rate: float) -> str:
    return f"{round(100 * rate):d}"


def _condition(kind: str, rate: float, seed: int) -> str:
    return f"clean-s{seed}" if rate == 0 else f"{kind}-{_rate_tag(rate)}-s{seed}"


def _write_examples(examples: list[TrainingExample], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as handle:
        for example in examples:
            handle.write(json.dumps(example.to_json(), ensure_ascii=False) + "\n")


def _remove_planted_positives(noisy: Path, target: Path, plants_path: Path) -> None:
    """The ``oracle`` method's copy: every planted false positive removed (a record left without a positive stays as
    a line with ``"pos": []`` and the removal in ``removed``, as the teacher filter leaves it)."""
    planted: dict[str, set[str]] = {}
    for line in plants_path.read_text(encoding="utf-8").splitlines() if plants_path.exists() else []:
        if line.strip():
            plant = json.loads(line)
            planted[str(plant["query_id"])] = set(plant.get("false_positives", []))
    with open(noisy, encoding="utf-8") as source, atomic_write(target) as handle:
        for line in source:
            record = json.loads(line)
            wrong = planted.get(str(record.get("query_id")), set())
            keep = [i for i, text in enumerate(record["pos"]) if text not in wrong]
            if len(keep) < len(record["pos"]):
                gone = [text for i, text in enumerate(record["pos"]) if i not in keep]
                for key, value in list(record.items()):  # pos, pos_ids, pos_scores, ... stay aligned
                    if (key == "pos" or key.startswith("pos_")) and isinstance(value, list) \
                            and len(value) == len(record["pos"]):
                        record[key] = [value[i] for i in keep]
                record["removed"] = list(record.get("removed") or []) + [
                    {"text": text, "reason": "planted", "positive": True} for text in gone]
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def filter_scores(noisy: Path, filtered: Path, plants_path: Path) -> dict:
    """Precision / recall of a filter on the planted items (false negatives removed, false positives dropped)."""
    plants = {}
    if plants_path.exists():
        for line in plants_path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                plant = json.loads(line)
                plants[plant["query_id"]] = plant
    removed_neg = removed_planted_neg = planted_neg = 0
    removed_pos = removed_planted_pos = planted_pos = 0
    with open(noisy, encoding="utf-8") as a, open(filtered, encoding="utf-8") as b:
        for before_line, after_line in zip(a, b):
            before, after = json.loads(before_line), json.loads(after_line)
            plant = plants.get(str(before.get("query_id")), {})
            fn, fp = set(plant.get("false_negatives", [])), set(plant.get("false_positives", []))
            gone_neg = set(before["neg"]) - set(after["neg"])
            gone_pos = set(before["pos"]) - set(after["pos"])
            removed_neg += len(gone_neg)
            removed_planted_neg += len(gone_neg & fn)
            planted_neg += len(fn & set(before["neg"]))
            removed_pos += len(gone_pos)
            removed_planted_pos += len(gone_pos & fp)
            planted_pos += len(fp & set(before["pos"]))

    def ratio(a: int, b: int) -> float | None:
        return round(a / b, 4) if b else None

    return {"removed_negatives": removed_neg, "planted_negatives": planted_neg,
            "fn_precision": ratio(removed_planted_neg, removed_neg), "fn_recall": ratio(removed_planted_neg, planted_neg),
            "removed_positives": removed_pos, "planted_positives": planted_pos,
            "fp_precision": ratio(removed_planted_pos, removed_pos), "fp_recall": ratio(removed_planted_pos, planted_pos)}


# ----------------------------------------------------------------------------------------------- the run

class _Bench:
    def __init__(self, config: NoiseBenchConfig) -> None:
        from ..resources import dataset_path

        self.config = config.resolved()
        self.budget = self.config.budget_obj()
        if self.config.model:
            from ..models.encoder import resolve_model_path

            resolve_model_path(self.config.model)  # a clear error now, not after the data is mined
        self.data = Path(self.config.data) if self.config.data else dataset_path("scifact")
        self.out = Path(self.config.output)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results_path = self.out / "results.jsonl"
        self.cache: dict = {}
        self.fingerprints: dict = {}  # "clean" and every written data file -> the fingerprint it was made with
        self.digests: dict = {}  # the data folder and the model, read once for the whole grid
        self._clean: list[TrainingExample] | None = None
        self._corpus = None

    # -- data
    def model_path(self) -> str:
        """The benchmark's starting model as a local folder (the bundled MiniLM unless ``model`` names another)."""
        from ..models.encoder import resolve_model_path
        from ..resources import default_model_path

        return str(resolve_model_path(self.config.model or default_model_path()))

    def clean(self) -> list[TrainingExample]:
        if self._clean is None:
            from ..negatives.mining import MiningConfig, mine_beir

            mined = self.out / "data" / "mined.jsonl"
            # a few spare negatives: fp-hard takes the top one away and planting pushes the lowest out
            dense = self.config.mining == "dense"
            mining = MiningConfig(method=self.config.mining, num_negatives=self.budget.pool + 2,
                                  cache_dir=str(self.out / "cache") if dense else None)
            model = self.model_path() if dense else None
            self.fingerprints["clean"] = made = fingerprint(
                "bench-mine", {"mining": mining, "split": self.config.train_split},
                {"data": self.data, **({"model": model} if model else {})}, cache=self.digests)
            artifact = Artifact(mined, what="noise-bench clean data")
            if not artifact.begin(made, resume=False):
                encoder = None
                if model:
                    from ..models.encoder import Encoder

                    encoder = Encoder.from_pretrained(model)
                mine_beir(self.data, self.config.train_split, mined, mining, encoder=encoder)
                artifact.finish()
            examples, _ = load_training_data(mined)
            self._clean = self.select(examples)
        return self._clean

    def select(self, examples: list[TrainingExample]) -> list[TrainingExample]:
        """The training queries: without the dev queries (``dev``), then the budget's seeded subset (``train_queries``)."""
        import random

        if self.config.dev:
            examples = [e for e in examples if str(e.extra.get("query_id")) not in self.dev_ids()]
        n = self.budget.train_queries
        if n and n < len(examples):
            keep = set(random.Random("train-queries:0").sample(range(len(examples)), n))
            examples = [e for i, e in enumerate(examples) if i in keep]
        return examples

    def dev_ids(self) -> set[str]:
        return self.dev_data()[1]

    def dev_data(self):
        """``(BeirDataset of the held-out training queries over the full corpus, their ids)``, made once."""
        if "dev" not in self.cache:
            from .sidebyside import dev_split

            dataset, ids = dev_split(self.data, self.config.train_split, self.config.dev)
            self.cache["dev"] = (dataset, {str(i) for i in ids})
        return self.cache["dev"]

    def evaluate(self, model_path: Path) -> dict[str, float]:
        """NDCG & co. of a trained model on the dev queries (``dev``) or on ``eval_split``."""
        if self.config.dev:
            return evaluate_model(model_path, self.dev_data()[0], "dev", self.budget)
        return evaluate_model(model_path, self.data, self.config.eval_split, self.budget, self.cache)

    def corpus(self):
        if self._corpus is None:
            from ..data.beir import load_beir

            dataset = load_beir(self.data, self.config.train_split)
            self._corpus = (dataset.corpus.ids, dataset.corpus.texts_for_encoding())
        return self._corpus

    def noisy(self, kind: str, rate: float, seed: int) -> Path:
        folder = self.out / "data" / _condition(kind, rate, seed)
        path = folder / "noisy.jsonl"
        self.clean()
        made = fingerprint("bench-noise", {"kind": kind if rate else "clean", "rate": rate, "seed": seed,
                                           "per_query": self.config.per_query, "pool": self.budget.pool,
                                           "dev": self.config.dev, "train_queries": self.budget.train_queries},
                           upstream={"clean data": self.fingerprints["clean"]})
        self.fingerprints[path] = made
        artifact = Artifact(path, what="noise-bench noisy data")
        if artifact.begin(made, resume=False):
            return path
        if rate == 0:
            from .noise import NoisyData

            noisy = NoisyData(list(self.clean()), [], "clean", 0.0, seed)
        else:
            noisy = plant_noise(self.clean(), kind, rate, seed, corpus=self.corpus() if kind == "fp-random" else None,
                                per_query=self.config.per_query)
        pool = self.budget.pool
        examples = []
        for example in noisy.examples:  # the pool keeps its size: planted items push the lowest-ranked out
            extra = dict(example.extra)
            if isinstance(extra.get("neg_ids"), list):
                extra["neg_ids"] = extra["neg_ids"][:pool]
            scores = example.neg_scores[:pool] if example.neg_scores is not None else None
            examples.append(replace(example, neg=example.neg[:pool], neg_scores=scores, extra=extra))
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_write(folder / "plants.jsonl") as handle:
            for plant in noisy.plants:
                handle.write(json.dumps(plant.to_json(), ensure_ascii=False) + "\n")
        write_json(folder / "summary.json", noisy.summary())
        _write_examples(examples, path)
        artifact.finish()  # last: the record marks the condition complete
        return path

    def filtered(self, method: str, noisy: Path) -> tuple[Path, dict]:
        """Filtered copy of ``noisy`` for the filtering methods, with precision/recall on the plants."""
        name = FILTERS[method]
        variant = self.config.variant(method)
        target = noisy.with_name(f"{name}-{variant}.jsonl")
        report = StageOutput(target).report
        used = {k: getattr(self.budget, k) for k in ("precision", "passage_max_length", "train_passage_max_length",
                                                     "num_negatives", "pool")}  # the budget fields filters read
        made = fingerprint(f"bench-filter-{name}", {"options": self.config.method_options(method),
                                                    "model": self.config.model, "budget": used},
                           {"model": self.config.model}, upstream={"noisy data": self.fingerprints[noisy]},
                           cache=self.digests)
        self.fingerprints[target] = made
        artifact = Artifact(target, what=f"noise-bench {name} filter")
        if not artifact.begin(made, resume=False):
            from ..config import from_dict

            report.unlink(missing_ok=True)
            if name == "teacher":
                from ..filtering.teacher import TeacherFilterConfig, teacher_filter

                options = {"precision": self.budget.precision, "progress": False, "model": self.config.model,
                           "max_length": self.budget.passage_max_length, **self.config.method_options(method)}
                teacher_filter(noisy, target, from_dict(TeacherFilterConfig, options, where="teacher"))
            elif name == "sieve":
                from ..filtering.sieve import SieveConfig
                from ..training.sieve import sieve_negatives

                options = {"num_negatives": max(self.budget.num_negatives, self.budget.pool // 2),
                           "precision": self.budget.precision, "train_precision": self.budget.precision,
                           "progress": False,
                           "model": self.config.model, "passage_max_length": self.budget.train_passage_max_length,
                           "plot": False, **self.config.sieve}
                sieve_negatives(noisy, target, from_dict(SieveConfig, options, where="sieve"))
            elif name == "oracle":
                _remove_planted_positives(noisy, target, noisy.with_name("plants.jsonl"))
            elif name in LLM_FILTERS:
                from ..llm import LLMClient, build_backend
                from ..filtering.llm_judge import judge_negatives

                backend = build_backend(self.config.llm_config(), cache_path=StageOutput(target).llm_cache)
                with backend:
                    if isinstance(backend, LLMClient):
                        backend.preflight()
                    judge_negatives(noisy, target, backend, progress=False, report_path=report,
                                    positives=name == "llm-pos")
            if not report.exists():
                write_json(report, {"method": name})
            artifact.finish()
        return target, filter_scores(noisy, target, noisy.with_name("plants.jsonl"))

    # -- one run
    def prepare(self, kind: str, rate: float, seed: int, method: str) -> tuple[Path, dict, Path, Artifact]:
        """The data of one run, made or reused: ``(noisy data, filter scores, run folder, its rows)``."""
        noisy = self.noisy(kind, rate, seed)
        source, filter_stats = noisy, {}
        if method in FILTERS:
            source, filter_stats = self.filtered(method, noisy)
        variant = self.config.variant(method)
        run_dir = self.out / "runs" / _condition(kind, rate, seed) / (f"{method}-{variant}" if variant else method)
        rows_path = run_dir / "rows.jsonl"
        rows = Artifact(rows_path, what="noise-bench training rows")
        settings = {"budget": self.budget, "seed": seed, **self.step_rule(method)}
        if not rows.begin(fingerprint("bench-rows", settings, upstream={"training data": self.fingerprints[source]}),
                          resume=False):
            examples, stats = load_training_data(source)
            epochs = self.budget.epochs
            if source != noisy and self.config.keep_steps:  # the steps of the data as given (docs/robustness.md)
                given = sum(len(e.pos) for e in load_training_data(noisy)[0])
                epochs *= given / max(1, sum(len(e.pos) for e in examples))
            write_rows(materialize_rows(examples, self.budget.num_negatives, epochs, seed,
                                        filler=self.corpus()[1]), rows_path)
            rows.finish()
        return noisy, filter_stats, run_dir, rows

    def run_one(self, kind: str, rate: float, seed: int, method: str) -> dict:
        started = time.perf_counter()
        reset_peak_device_memory()  # a worker process runs several cells: each row has its own peak
        noisy, filter_stats, run_dir, rows = self.prepare(kind, rate, seed, method)
        rows_path, variant = rows.path, self.config.variant(method)
        spec = METHOD_TABLE[method]
        if spec.trainer == "st":
            outcome = train_sentence_transformers(rows_path, run_dir / "train", self.budget, seed, model=self.config.model)
        else:
            loss = spec.loss
            train_run = Artifact(run_dir / "train", what="noise-bench training run")
            train_run.begin(fingerprint("bench-train", {"loss": loss, "budget": self.budget, "seed": seed,
                                                        "model": self.config.model},
                                        upstream={"rows": rows.fingerprint}))  # the same run resumes; another is redone
            outcome = train_robustir(rows_path, run_dir / "train", self.budget, seed, model=self.config.model, loss=loss)
            train_run.finish({"steps": outcome.steps}, files=[])
        metrics = self.evaluate(outcome.model_path)
        return {"kind": "clean" if rate == 0 else kind, "rate": rate, "method": method, "seed": seed,
                "variant": variant, "cell": self.cell(kind, rate, seed, method).digest,
                "options": self.config.method_options(method), "metrics": metrics,
                "steps": outcome.steps, "train_seconds": round(outcome.seconds, 1),
                "seconds": round(time.perf_counter() - started, 1), "filter": filter_stats,
                "rows": sum(1 for _ in open(rows_path, encoding="utf-8")), "budget": asdict(self.budget),
                "noise": json.loads((noisy.parent / "summary.json").read_text()),
                "peak_gpu_bytes": peak_device_memory()}

    def run_parallel(self, todo: list, record) -> None:
        """Train and evaluate ``todo``'s runs in ``jobs`` worker processes (one GPU can hold several small runs).

        The data every run needs (noise, filtered copies, rows) is made here first, one file at a time, so
        workers only read shared files; each worker gets an equal share of the CPU threads. A run starts only when
        the GPU has the memory runs of this budget were seen to need (:mod:`robustir.robustness.jobs`: their
        recorded peaks, earlier rows included; a fresh bench runs one alone first). A run that fails is logged and
        left for the serial pass after it, which raises its error where it happens.
        """
        import multiprocessing
        import os
        from concurrent.futures import ProcessPoolExecutor, as_completed

        threads = max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
                      // self.config.jobs)
        context = multiprocessing.get_context("spawn")  # no CUDA state is inherited by a fork
        with ProcessPoolExecutor(self.config.jobs, mp_context=context) as pool:
            # the noisy data here (no model), then each filtered copy once, in the workers (a teacher pass each)
            filtering: dict[tuple, tuple] = {}
            for cell, _ in todo:
                self.noisy(*cell[:3])
                if cell[3] in FILTERS:
                    filtering.setdefault((cell[:3], FILTERS[cell[3]], self.config.variant(cell[3])), cell)
            for future in as_completed([pool.submit(_filter_cell, self.config, cell, threads)
                                        for cell in filtering.values()]):
                future.result()
            for cell, _ in todo:  # every file a run reads, made or verified here: the workers only read them
                self.prepare(*cell)
            gate = self.memory_gate()
            for (cell, key), future in run_gated(todo, lambda item: pool.submit(_run_cell, self.config, item[0],
                                                                                threads), self.config.jobs, gate):
                try:
                    row = future.result()
                except Exception as exc:  # noqa: BLE001 - retried serially, where it raises
                    logger.warning("noise-bench: a parallel run failed (%s: %s); it is run again serially",
                                   type(exc).__name__, exc)
                    continue
                gate.observe(row.get("peak_gpu_bytes"))
                record(key, row)

    def memory_gate(self) -> MemoryGate:
        """The device-memory gate of :meth:`run_parallel`, knowing the largest peak of the earlier runs of this
        budget in results.jsonl (the largest: a cautious start)."""
        gate = MemoryGate()
        for row in self.finished().values():
            if row.get("budget") == asdict(self.budget):
                gate.observe(row.get("peak_gpu_bytes"))
        return gate

    def step_rule(self, method: str) -> dict:
        """``{"keep_steps": ...}`` for a method that trains on a filtered copy, {} for the rest (whose cells and rows
        do not depend on the rule)."""
        return {"keep_steps": self.config.keep_steps} if method in FILTERS else {}

    def cell(self, kind: str, rate: float, seed: int, method: str) -> Fingerprint:
        """What one result depends on: the method, its options, the model, the budget, the data (its content),
        both splits and the noise -- a result is reused only for the same cell fingerprint."""
        return fingerprint("bench-cell", {"kind": "clean" if rate == 0 else kind, "rate": rate, "seed": seed,
                                          "method": method, "options": self.config.method_options(method),
                                          "budget": self.budget, "per_query": self.config.per_query,
                                          "train_split": self.config.train_split, "eval_split": self.config.eval_split,
                                          "dev": self.config.dev, **self.step_rule(method),
                                          "model": self.config.model,
                                          # bm25 left out: the cells of benchmarks run before the option keep theirs
                                          **({"mining": self.config.mining} if self.config.mining != "bm25" else {})},
                           {"data": self.data, "model": self.config.model}, cache=self.digests)

    def finished(self) -> dict[str, dict]:
        """Rows of results.jsonl by their cell digest (rows from before cells were fingerprinted are not reused)."""
        done: dict[str, dict] = {}
        if self.results_path.exists():
            for line in self.results_path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    row = json.loads(line)
                    if row.get("cell"):
                        done[row["cell"]] = row
        return done

    def plan(self) -> list[tuple[str, float, int, str]]:
        todo, seen = [], set()
        for seed in self.config.seeds:
            for rate in sorted(set(self.config.rates)):
                for kind in (self.config.kinds if rate else self.config.kinds[:1]):
                    for method in self.config.methods:
                        key = ("clean" if rate == 0 else kind, rate, method, seed, self.config.variant(method))
                        if key not in seen:
                            seen.add(key)
                            todo.append((kind, rate, seed, method))
        return todo

    def run(self, progress=None) -> list[dict]:
        write_json(self.out / "config.json", to_dict(self.config))
        done = self.finished()
        plan = [(cell, self.cell(*cell).digest) for cell in self.plan()]
        todo = [(cell, key) for cell, key in plan if key not in done]

        def record(key: str, row: dict) -> None:  # results.jsonl is written by this process only
            with open(self.results_path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
            done[key] = row
            if progress is not None:
                progress(row)

        if self.config.jobs > 1 and len(todo) > 1:
            self.run_parallel(todo, record)
        for (kind, rate, seed, method), key in todo:
            if key not in done:
                logger.info("noise-bench: %s at %s%%, seed %d, method %s", kind, _rate_tag(rate), seed, method)
                record(key, self.run_one(kind, rate, seed, method))
        rows = [done[key] for _, key in plan]
        # the report shows the runs of the current config (rows of other settings stay in results.jsonl)
        rows.sort(key=lambda r: (r["kind"], r["rate"], r["method"], r["seed"]))
        write_table(rows, self.out / "results.md", self.config.kinds)
        if self.config.plots:
            plot_results(rows, self.out / "results.png", self.config.kinds)
        return rows


def _run_cell(config: NoiseBenchConfig, cell: tuple, threads: int) -> dict:
    """One run in a worker process of :meth:`_Bench.run_parallel` (its data already made by the parent)."""
    import torch

    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING)
    return _Bench(config).run_one(*cell)


def _filter_cell(config: NoiseBenchConfig, cell: tuple, threads: int) -> None:
    """The filtered copy one run trains on, in a worker process of :meth:`_Bench.run_parallel`."""
    import torch

    torch.set_num_threads(threads)
    bench = _Bench(config)
    bench.filtered(cell[3], bench.noisy(*cell[:3]))


def run_noise_bench(config: NoiseBenchConfig, progress=None) -> list[dict]:
    """Run (or resume) the grid; returns every finished row and writes ``results.md`` / ``results.png``."""
    return _Bench(config).run(progress)


# ----------------------------------------------------------------------------------------------- reporting

def _mean_std(values: list[float]) -> str:
    if not values:
        return "–"
    mean = statistics.mean(values)
    return f"{mean:.2f}" if len(values) == 1 else f"{mean:.2f} ± {statistics.stdev(values):.2f}"


def _ndcg_by_seed(rows: list[dict], kind: str, rate: float, method: str) -> dict[int, float]:
    wanted = "clean" if rate == 0 else kind
    return {r["seed"]: 100 * r["metrics"]["ndcg@10"] for r in rows
            if r["kind"] == wanted and r["rate"] == rate and r["method"] == method}


def _ndcg(rows: list[dict], kind: str, rate: float, method: str) -> list[float]:
    return list(_ndcg_by_seed(rows, kind, rate, method).values())


def paired_change(noisy: dict[int, float], clean: dict[int, float]) -> float | None:
    """Mean change from clean to noisy over the seeds that have both (a cell run with fewer seeds than the clean
    column is compared with the clean runs of *its* seeds, not with the mean of every clean seed)."""
    seeds = sorted(set(noisy) & set(clean))
    return statistics.mean(noisy[s] - clean[s] for s in seeds) if seeds else None


def write_table(rows: list[dict], path: Path, kinds: list[str] | None = None) -> str:
    """Markdown: NDCG@10 (mean ± std over seeds) per method and (kind, rate), the loss vs clean, filter scores."""
    kinds = kinds or sorted({r["kind"] for r in rows if r["kind"] != "clean"})
    rates = sorted({r["rate"] for r in rows})
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    columns = [(k, rate) for k in kinds for rate in rates if rate > 0]
    lines = ["| method | clean | " + " | ".join(f"{k} {_rate_tag(rate)}%" for k, rate in columns) + " |",
             "|---|---:|" + "---:|" * len(columns)]
    for method in methods:
        clean = _ndcg_by_seed(rows, kinds[0] if kinds else "", 0.0, method)
        cells = [_mean_std(list(clean.values()))]
        for kind, rate in columns:
            values = _ndcg_by_seed(rows, kind, rate, method)
            change = paired_change(values, clean)
            delta = f" ({change:+.2f})" if change is not None else ""
            cells.append(_mean_std(list(values.values())) + delta)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("NDCG@10 on the evaluation split, mean ± std over seeds (a value without ± is one seed); (±x) = "
                 "change against the same method on clean data with the same seeds (mean of the per-seed changes).")
    filt = [r for r in rows if r.get("filter")]
    if filt:
        lines += ["", "| filter run | kind | rate | seed | removed neg. | FN precision | FN recall | removed pos. | "
                      "FP precision | FP recall |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in filt:
            f = r["filter"]
            fmt = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
            lines.append(f"| {r['method']} | {r['kind']} | {_rate_tag(r['rate'])}% | {r['seed']} | "
                         f"{f['removed_negatives']} | {fmt(f['fn_precision'])} | {fmt(f['fn_recall'])} | "
                         f"{f['removed_positives']} | {fmt(f['fp_precision'])} | {fmt(f['fp_recall'])} |")
    text = "\n".join(lines) + "\n"
    with atomic_write(path) as handle:
        handle.write(text)
    return text


def plot_results(rows: list[dict], path: Path, kinds: list[str] | None = None) -> Path | None:
    """NDCG@10 against noise rate: one panel per kind, one line per method (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = kinds or sorted({r["kind"] for r in rows if r["kind"] != "clean"})
    if not kinds:
        return None
    rates = sorted({r["rate"] for r in rows})
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.6), sharey=True, squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for method in methods:
            xs, ys = [], []
            for rate in rates:
                values = _ndcg(rows, kind, rate, method)
                if values:
                    xs.append(100 * rate)
                    ys.append(statistics.mean(values))
            if xs:
                anchor = METHOD_TABLE[method].trainer == "st"
                ax.plot(xs, ys, marker="o", label=method, linestyle="--" if anchor else "-")
        ax.set_title(kind)
        ax.set_xlabel("noisy training queries (%)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("NDCG@10 (test)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
