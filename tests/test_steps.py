"""Issue 34: every stage is a :class:`robustir.runs.Step` run by :func:`robustir.runs.execute`, and one rule
(:meth:`robustir.runs.Artifact.decide`) answers "done, with these settings and inputs?" for all of them.

The matrix below runs each registered step on tiny data and checks, for every one:

* run again unchanged -> nothing to do;
* a setting marked operational changed (a batch size, a device, concurrency) -> still nothing to do;
* a setting that matters changed -> refused naming the key (the CLI's rule), or redone saying why (the runner's);
* a model retrained *in place* (same path, other weights) -> the steps that read it redo their work.

Training, pre-training and the index are steps too, run by the same ``execute``; they answer "done?" inside their
run (a run folder's record, a LanceDB manifest) through the same rule. The audit and a noise-bench cell keep their
own outputs and are tested below the matrix.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_llm_server import FakeLLMServer, last_user  # noqa: E402

from robustir.errors import ConfigError  # noqa: E402
from robustir.runs import Job, execute  # noqa: E402
from robustir.steps import STEPS, get_step  # noqa: E402

DOCS = [{"_id": f"d{i}", "title": f"Topic {i}",
         "text": f"Topic {i} is about subject {i}. It has many facts about subject {i} and topic {i}. "
                 f"Researchers studied subject {i} for years. The results on topic {i} were mixed."}
        for i in range(8)]
RECORDS = [{"query": f"what is subject {i}", "pos": [f"subject {i} is a thing studied for years"],
            "neg": [f"subject {(i + 1) % 8} is another thing", f"topic {(i + 2) % 8} facts",
                    f"unrelated text number {i}"]} for i in range(8)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _model_copy(tiny_model_dir: str, where: Path) -> Path:
    target = where / "model"
    if not target.exists():
        shutil.copytree(tiny_model_dir, target)
    return target


def _retrain_in_place(model: Path) -> None:
    """Other weights at the same path, as a model retrained in place leaves them."""
    import torch
    from transformers import AutoModel

    loaded = AutoModel.from_pretrained(model)
    with torch.no_grad():
        for parameter in loaded.parameters():
            parameter.add_(0.01)
    loaded.save_pretrained(model)


def _cases(tmp: Path, tiny_model_dir: str, server_url: str | None) -> dict:
    """name -> (step, config, job, operational change, meaningful change (key, config), uses a model)."""
    from robustir.data.chunking import ChunkConfig
    from robustir.filtering.llm_judge import JudgeConfig
    from robustir.filtering.sieve import SieveConfig
    from robustir.filtering.teacher import TeacherFilterConfig
    from robustir.negatives.mining import MiningConfig
    from robustir.queries.generate import GenerateConfig
    from robustir.queries.pairs import PairMiningConfig

    corpus = _jsonl(tmp / "corpus.jsonl", DOCS)
    train = _jsonl(tmp / "train.jsonl", RECORDS)
    model = _model_copy(tiny_model_dir, tmp)
    out = lambda name: str(tmp / "out" / f"{name}.jsonl")  # noqa: E731
    llm = {"base_url": server_url or "http://127.0.0.1:9/v1", "model": "fake-model", "max_retries": 0}
    cases = {
        "chunk": (ChunkConfig(max_tokens=24, min_tokens=4), Job(out("chunk"), {"input": str(corpus)}), None,
                  ("max_tokens", ChunkConfig(max_tokens=32, min_tokens=4)), False),
        "pairs": (PairMiningConfig(), Job(out("pairs"), {"input": str(corpus)}), None,
                  ("seed", PairMiningConfig(seed=1)), False),
        "mine bm25": (MiningConfig(num_negatives=2), Job(out("mine-bm25"), {"input": str(train)}),
                      MiningConfig(num_negatives=2, query_batch_size=3),
                      ("num_negatives", MiningConfig(num_negatives=1)), False),
        "mine dense": (MiningConfig(method="dense", num_negatives=2, precision="fp32"),
                       Job(out("mine-dense"), {"input": str(train), "model": str(model)}),
                       MiningConfig(method="dense", num_negatives=2, precision="fp32", encode_batch_size=2),
                       ("range_min", MiningConfig(method="dense", num_negatives=2, precision="fp32", range_min=1)),
                       True),
        "filter teacher": (TeacherFilterConfig(model=str(model), precision="fp32", progress=False),
                           Job(out("teacher"), {"input": str(train)}),
                           TeacherFilterConfig(model=str(model), precision="fp32", progress=False, batch_size=2),
                           ("relative_margin", TeacherFilterConfig(model=str(model), precision="fp32",
                                                                   progress=False, relative_margin=0.2)), True),
        "filter sieve": (SieveConfig(model=str(model), train=False, num_negatives=2, precision="fp32", progress=False,
                                     plot=False),
                         Job(out("sieve"), {"input": str(train)}),
                         SieveConfig(model=str(model), train=False, num_negatives=2, precision="fp32",
                                     progress=False, plot=False, batch_size=3),
                         ("strict", SieveConfig(model=str(model), train=False, num_negatives=2, precision="fp32",
                                                progress=False, plot=False, strict=True)), True),
    }
    from robustir.pretraining.pretrain import PretrainConfig
    from robustir.index.store import IndexConfig
    from robustir.training.arguments import TrainConfig

    trained = lambda **kw: TrainConfig(**{  # noqa: E731
        "model": str(model), "train_data": str(train), "max_steps": 1, "batch_size": 2, "num_negatives": 1,
        "mine": "none", "precision": "fp32", "report": False, **kw})
    pretrained = lambda **kw: PretrainConfig(**{  # noqa: E731
        "mode": "retromae", "model": str(model), "data": str(corpus), "max_steps": 1, "batch_size": 2,
        "max_length": 32, "precision": "fp32", "report": False, **kw})
    index_job = lambda length: Job(str(tmp / "out" / "index"), {"corpus": str(corpus), "model": str(model)},  # noqa: E731
                                   settings={"encoder": {"passage_max_length": length}})
    cases.update({
        "train": (trained(), Job(str(tmp / "out" / "train")), trained(logging_steps=5), ("lr", trained(lr=1e-3)),
                  True),
        "pretrain": (pretrained(), Job(str(tmp / "out" / "pretrain")), pretrained(logging_steps=5),
                     ("lr", pretrained(lr=1e-3)), True),
        # the index's result is decided by its inputs and the encoder (the job's), not by IndexConfig's fields
        "index": (IndexConfig(show_progress=False), index_job(32), IndexConfig(show_progress=False, batch_size=3),
                  ("encoder", IndexConfig(show_progress=False), index_job(24)), True),
    })
    if server_url is not None:
        generate = lambda **llm_changes: GenerateConfig(llm={**llm, **llm_changes}, num_queries=2,  # noqa: E731
                                                        progress=False, preflight=False)
        judge = lambda **llm_changes: JudgeConfig(llm={**llm, **llm_changes}, progress=False,  # noqa: E731
                                                  preflight=False)
        cases["generate"] = (generate(), Job(out("generate"), {"input": str(corpus)}), generate(concurrency=2),
                             ("llm.temperature", generate(temperature=0.5)), False)
        cases["filter llm"] = (judge(), Job(out("judge"), {"input": str(train)}), judge(timeout_s=30.0),
                               ("llm.model", judge(model="judge-b")), False)
    return cases


def _reply(messages: list[dict]) -> str:
    user = last_user(messages)
    if "Query:" in user:  # the judge
        return "Yes" if "unrelated" in user else "No"
    return "1. what is this topic about\n2. which subject was studied for years"


CHANGED_MODEL = r"input model \(.*\): content of (config.json, )?model.safetensors changed"
STEP_NAMES = ["chunk", "pairs", "mine bm25", "mine dense", "filter teacher", "filter sieve", "generate", "filter llm",
              "train", "pretrain", "index"]


def _snapshot(path: Path) -> dict[str, bytes]:
    """The bytes of an output: its file, or every file of its folder by relative name."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("name", STEP_NAMES)
def test_each_step_reruns_only_when_what_decides_its_result_changed(name, tmp_path, tiny_model_dir, caplog):
    with FakeLLMServer(_reply) as server:
        config, job, operational, (key, changed, *other), uses_model = \
            _cases(tmp_path, tiny_model_dir, server.url)[name]
        changed_job = other[0] if other else job  # a setting of the job (the index's encoder), not of the config
        step = get_step(name.split()[0] if name.startswith("mine") else name)
        first = execute(step, config, job, say=None)
        assert not first.skipped and Path(first.artifact.path).exists()
        made = _snapshot(Path(first.artifact.path))
        requests = server.count
        # unchanged -> nothing to do (and, for the LLM stages, not one request)
        assert execute(step, config, job, say=None).skipped and server.count == requests
        if operational is not None:  # a field marked operational on the config: not part of the result
            assert execute(step, operational, job, say=None).skipped and server.count == requests
        # a setting that matters: refused naming it (the CLI's rule) ...
        with pytest.raises(ConfigError, match=rf"other settings or inputs than this run( \(it holds .*\))?: "
                                              rf"{key}\b.*(--overwrite|resume=false)"):
            execute(step, changed, changed_job, say=None)
        assert _snapshot(Path(first.artifact.path)) == made  # refused: the output is untouched
        # ... or made again saying why (the runner's rule)
        with caplog.at_level(logging.WARNING, logger="robustir"):
            again = execute(step, changed, changed_job, on_change="redo", say=None)
        assert not again.skipped and f"made with other settings or inputs ({key}" in caplog.text
        assert execute(step, changed, changed_job, say=None).skipped
        if uses_model:  # a model retrained in place (same path): its content is an input
            model = Path(job.inputs.get("model") or changed.model)
            _retrain_in_place(model)
            with pytest.raises(ConfigError, match=CHANGED_MODEL):
                execute(step, changed, changed_job, say=None)
            assert not execute(step, changed, changed_job, on_change="redo", say=None).skipped


def test_every_registered_step_is_in_the_matrix():
    """A new step cannot be registered without this matrix covering it."""
    covered = {name.split()[0] if name.startswith("mine") else name for name in STEP_NAMES}
    assert set(STEPS) == covered


def test_an_interrupted_step_resumes_only_with_the_same_settings(tmp_path, tiny_model_dir):
    from robustir.negatives.mining import MiningConfig
    from robustir.outputs import StageOutput

    train = _jsonl(tmp_path / "train.jsonl", RECORDS)
    job = Job(str(tmp_path / "mined.jsonl"), {"input": str(train)})
    step = get_step("mine")
    first = execute(step, MiningConfig(num_negatives=2), job, say=None)
    stage = StageOutput(job.output, reports=True)
    whole = stage.path.read_text()
    stage.path.rename(stage.partial)  # as if killed before the rename: started, same fingerprint
    assert first.artifact.check().state == "started"
    assert not execute(step, MiningConfig(num_negatives=2), job, say=None).skipped  # resumed
    assert stage.path.read_text() == whole
    stage.path.rename(stage.partial)
    with pytest.raises(ConfigError, match=r"was started \(a .partial file\) with other settings.*num_negatives: 2 "
                                          r"-> 3"):
        execute(step, MiningConfig(num_negatives=3), job, say=None)


def test_retraining_a_model_in_place_redoes_every_pipeline_stage_that_read_it(tmp_path, tiny_model_dir, caplog):
    """``robustir run``: the base model is read by dense mining, training and evaluation; retrained in place, each
    of those stages runs again (the corpus and query stages, which do not read it, are skipped)."""
    from robustir.pipeline import load_pipeline_config, run_pipeline

    model = _model_copy(tiny_model_dir, tmp_path)
    corpus = _jsonl(tmp_path / "docs.jsonl", DOCS)
    config_file = tmp_path / "p.yaml"
    config_file.write_text(
        f"work_dir: {tmp_path / 'work'}\nmodel: {model}\ncorpus: {corpus}\n"
        "queries: {source: pairs}\nmine: {method: dense, num_negatives: 1, precision: fp32}\n"
        "train: {max_steps: 1, batch_size: 2, num_negatives: 1, precision: fp32, report: false}\n", encoding="utf-8")
    config = load_pipeline_config(config_file)
    first = run_pipeline(config, until="train")
    assert first.stages["mine"] == "ran" and first.stages["train"] == "ran"
    assert set(run_pipeline(config, until="train").stages.values()) <= {"skipped", "off", "not run (--until)"}
    _retrain_in_place(model)
    again = run_pipeline(config, until="train")
    assert again.stages["corpus"] == "skipped" and again.stages["queries"] == "skipped"
    assert again.stages["mine"] == "ran" and again.stages["train"] == "ran"


def test_training_answers_through_the_one_rule(tmp_path, tiny_model_dir):
    """The run folder's record is decided by Artifact.decide: an operational change resumes/reuses, a setting
    that matters is refused naming it, a model retrained in place is refused as a changed input."""
    from robustir.training.arguments import TrainConfig
    from robustir.training.trainer import train

    model = _model_copy(tiny_model_dir, tmp_path)
    data = _jsonl(tmp_path / "train.jsonl", RECORDS)
    base = dict(model=str(model), train_data=str(data), output=str(tmp_path / "run"), max_steps=1, batch_size=2,
                num_negatives=1, mine="none", precision="fp32", report=False)
    assert not train(TrainConfig(**base)).already_complete
    assert train(TrainConfig(**base, logging_steps=5)).already_complete  # operational (the log's cadence)
    with pytest.raises(ConfigError, match="lr: 2e-05 -> 0.001"):
        train(TrainConfig(**{**base, "lr": 1e-3}))
    _retrain_in_place(model)
    with pytest.raises(ConfigError, match=CHANGED_MODEL):
        train(TrainConfig(**base))


def test_the_index_answers_through_the_one_rule(tmp_path, tiny_model_dir):
    """A search index: the same corpus and model -> nothing to do; an operational setting (the encoding batch
    size) -> nothing to do; a model retrained in place -> refused, naming the model's files."""
    from robustir.index.store import IndexConfig, SearchIndex

    model = _model_copy(tiny_model_dir, tmp_path)
    corpus = _jsonl(tmp_path / "corpus.jsonl", DOCS)
    index, report = SearchIndex.build(tmp_path / "idx", str(model), corpus, config=IndexConfig(show_progress=False))
    index.close()
    assert not report.nothing_to_do
    again, report = SearchIndex.build(tmp_path / "idx", str(model), corpus,
                                      config=IndexConfig(show_progress=False, batch_size=3))
    again.close()
    assert report.nothing_to_do
    _retrain_in_place(model)
    with pytest.raises(ConfigError, match=CHANGED_MODEL):
        SearchIndex.build(tmp_path / "idx", str(model), corpus, config=IndexConfig(show_progress=False))


def test_the_audit_answers_through_the_one_rule(tmp_path, tiny_model_dir, caplog):
    """``robustir audit``: an operational change (batch size) reuses the report; a setting that matters (the
    seed) audits again saying why; a teacher model retrained in place audits again."""
    from robustir.audit import AuditConfig, audit

    model = _model_copy(tiny_model_dir, tmp_path)
    data = _jsonl(tmp_path / "train.jsonl", RECORDS)
    config = lambda **kw: AuditConfig(**{  # noqa: E731
        "data": str(data), "output": str(tmp_path / "audit"), "model": str(model), "progress": False, "bootstrap": 40,
        "random_passages": 20, "precision": "fp32", **kw})
    assert not audit(config()).already_complete
    assert audit(config(batch_size=3)).already_complete
    with caplog.at_level(logging.WARNING, logger="robustir"):
        assert not audit(config(seed=1)).already_complete
    assert "seed: 0 -> 1" in caplog.text
    _retrain_in_place(model)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="robustir"):
        assert not audit(config(seed=1)).already_complete
    assert "input model" in caplog.text and "model.safetensors changed" in caplog.text
