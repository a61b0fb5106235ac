"""``robustir run``: the whole pipeline end to end on a tiny model and a tiny BEIR folder; stage caching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from robustir.cli.main import main as cli_main
from robustir.pipeline import load_pipeline_config, run_pipeline

REPO = Path(__file__).resolve().parents[1]
TOPICS = ["photosynthesis in plant cells", "dense retrieval models", "river floods in spring",
          "cats chasing mice", "vaccine trials in children", "solar panels efficiency"]


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def tiny_beir(root: Path) -> Path:
    """24 three-sentence abstracts whose sentences share long substrings (so LCS pairs exist), 12 queries."""
    (root / "qrels").mkdir(parents=True)
    docs = []
    for i in range(24):
        topic = TOPICS[i % 6]
        docs.append({"_id": f"d{i}", "title": f"About {topic}",
                     "text": f"This study {i} describes {topic} in detail. We found that {topic} matters for case "
                             f"{i}. Further work on {topic} is planned for year {2000 + i}."})
    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    queries = [{"_id": f"q{i}", "text": f"what about {TOPICS[i % 6]} case {i}"} for i in range(12)]
    (root / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    qrels = "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(12))
    (root / "qrels" / "test.tsv").write_text(qrels)
    return root


def tiny_config(model: str, tmp_path: Path) -> Path:
    config = {
        "work_dir": str(tmp_path / "work"),
        "model": model,
        "corpus": str(tiny_beir(tmp_path / "beir")),
        "queries": {"source": "pairs", "max_examples": 40},
        "pretrain": {"mode": "gur", "max_steps": 2, "batch_size": 4, "max_length": 32, "lr": 1e-3},
        "mine": {"method": "bm25", "num_negatives": 3},
        "train": {"max_steps": 2, "batch_size": 4, "query_max_length": 16, "passage_max_length": 32,
                  "probe_size": 8, "report": False},
        "eval": {"split": "test", "query_max_length": 16, "passage_max_length": 64},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_pipeline_end_to_end_then_cached(tiny_model_dir, tmp_path, capsys):
    path = tiny_config(tiny_model_dir, tmp_path)
    assert cli_main(["run", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "stages: corpus ran, chunk off, queries ran, pretrain ran, mine ran, filter off, train ran, eval ran" in printed
    for system in ("base", "pretrained", "finetuned"):
        assert system in printed
    work = tmp_path / "work"
    pairs = [json.loads(x) for x in (work / "queries" / "train.jsonl").read_text().splitlines()]
    assert 0 < len(pairs) <= 40
    mined = [json.loads(x) for x in (work / "mine" / "train.jsonl").read_text().splitlines()]
    assert len(mined) == len(pairs) and all(len(r["neg"]) == 3 for r in mined)
    assert (work / "pretrain" / "model" / "modules.json").exists()
    train_config = json.loads((work / "train" / "model" / "training_config.json").read_text())
    assert train_config["model"] == str(work / "pretrain" / "model")  # fine-tuning starts from the pre-trained encoder
    results = json.loads((work / "results.json").read_text())
    assert set(results["metrics"]) == {"base", "pretrained", "finetuned"}
    assert 0 <= results["metrics"]["finetuned"]["ndcg@10"] <= 1

    config = load_pipeline_config(path)
    again = run_pipeline(config)  # everything complete: nothing runs
    assert set(again.stages.values()) == {"skipped", "off"}
    assert again.metrics == results["metrics"]

    changed = run_pipeline(load_pipeline_config(path, ["train.lr=1e-4"]))  # only fine-tuning and evaluation redo
    assert changed.stages == {"corpus": "skipped", "chunk": "off", "queries": "skipped", "pretrain": "skipped",
                              "mine": "skipped", "filter": "off", "train": "ran", "eval": "ran"}

    # a stage output cut short or edited in place is made again, and what follows it too (issue 35: a truncated
    # mine/train.jsonl was trained on, a truncated model reported complete with the old metrics)
    mined_file = work / "mine" / "train.jsonl"
    mined_file.write_text("".join(mined_file.read_text().splitlines(keepends=True)[:3]))
    cut = run_pipeline(load_pipeline_config(path, ["train.lr=1e-4"]))
    assert cut.stages["mine"] == "ran" and cut.stages["train"] == "ran"
    assert len(mined_file.read_text().splitlines()) == len(pairs)
    weights = next((work / "train" / "model").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, other content
    weights.write_bytes(bytes(data))
    edited = run_pipeline(load_pipeline_config(path, ["train.lr=1e-4"]))
    assert edited.stages["train"] == "ran" and edited.stages["mine"] == "skipped"


def test_run_redoes_stages_after_a_corpus_edit_and_not_after_an_operational_change(tiny_model_dir, tmp_path):
    """The corpus file edited in place (same path) redoes every stage; a change of operational fields only
    (prefetching, encoding batch sizes, the device) redoes none. (On 5245875 the edit skipped every stage and
    reported the old model, and the operational change redid mine, train and eval.)"""
    path = tiny_config(tiny_model_dir, tmp_path)
    config = yaml.safe_load(path.read_text())
    config.pop("pretrain")  # the point is the bookkeeping: fewer stages, same rules
    path.write_text(yaml.safe_dump(config))
    first = run_pipeline(load_pipeline_config(path))
    assert set(first.stages.values()) == {"ran", "off"}

    operational = ["train.prefetch_batches=0", "train.eval_batch_size=8", "eval.batch_size=8",
                   "mine.query_batch_size=7", "device=cpu"]
    same = run_pipeline(load_pipeline_config(path, operational))
    assert set(same.stages.values()) == {"skipped", "off"} and same.metrics == first.metrics

    corpus = Path(config["corpus"]) / "corpus.jsonl"
    with open(corpus, "a") as handle:  # one more document, same file
        handle.write(json.dumps({"_id": "d99", "title": "About cats chasing mice",
                                 "text": "A new study of cats chasing mice in the garden."}) + "\n")
    edited = run_pipeline(load_pipeline_config(path))
    assert {k: v for k, v in edited.stages.items() if v != "off"} == {
        "corpus": "ran", "queries": "ran", "mine": "ran", "train": "ran", "eval": "ran"}
    documents = (tmp_path / "work" / "corpus" / "corpus.jsonl").read_text().splitlines()
    assert len(documents) == 25 and "d99" in documents[-1]


def test_example_config_is_valid_and_uses_bundled_data():
    from robustir.resources import dataset_path
    from robustir.pretraining.pretrain import resolve_data_path

    config = load_pipeline_config(REPO / "configs" / "pipeline-example.yaml")
    assert resolve_data_path(config.corpus) == dataset_path("scifact")
    assert config.pretrain is not None and config.pretrain.mode == "gur"
    assert config.train.epochs == 1 and config.train.passage_max_length <= 128
    assert config.eval.data == "bundled:scifact" and config.eval.split == "test"
    for name in ("pretrain-retromae.yaml", "pretrain-gur.yaml"):
        from robustir.config import load_config
        from robustir.pretraining.pretrain import PretrainConfig

        assert load_config(PretrainConfig, REPO / "configs" / name).mode in ("retromae", "gur")


def test_pipeline_generated_queries_retromae_and_teacher_filter(tiny_model_dir, tmp_path):
    """The other branches: LLM queries (fake server), RetroMAE, mining against the corpus, a filter stage."""
    from fake_llm_server import FakeLLMServer, last_user

    def reply(messages):
        prompt = last_user(messages)
        topic = next((t for t in TOPICS if t in prompt), "something")
        return f"1. What is known about {topic}?\n2. Why study {topic}?"

    with FakeLLMServer(reply) as server:
        config = load_pipeline_config(tiny_config(tiny_model_dir, tmp_path), [
            "queries.source=generate", "queries.max_examples=null",
            f"queries.generate={{llm: {{base_url: '{server.url}', model: fake-model}}, num_queries: 2, progress: false}}",
            "pretrain.mode=retromae", "pretrain.max_steps=1",
            f"filter={{method: teacher, teacher: {{model: '{tiny_model_dir}', relative_margin: 0.05, progress: false}}}}",
            "eval.base=false"])
        result = run_pipeline(config)
    assert result.stages == {"corpus": "ran", "chunk": "off", "queries": "ran", "pretrain": "ran", "mine": "ran",
                             "filter": "ran", "train": "ran", "eval": "ran"}
    work = tmp_path / "work"
    generated = [json.loads(x) for x in (work / "queries" / "train.jsonl").read_text().splitlines()]
    assert len(generated) == 24 * 2 and generated[0]["query"].startswith("What is known about")
    from robustir.runs import Artifact

    assert Artifact(work / "mine").report["outputs"]["pool"] == "corpus"
    assert (work / "filter" / "train.jsonl").exists() and (work / "pretrain" / "decoder_head").is_dir()
    assert set(result.metrics) == {"pretrained", "finetuned"}


def test_example_config_runs_end_to_end_as_shipped_shrunk_to_a_tiny_model(tiny_model_dir, tmp_path):
    """configs/pipeline-example.yaml as shipped (every stage it turns on), with sizes shrunk by overrides only."""
    overrides = [f"work_dir={tmp_path / 'work'}", f"model={tiny_model_dir}", "max_documents=60",
                 "queries.max_examples=40", "pretrain.max_steps=2", "pretrain.batch_size=4", "pretrain.max_length=32",
                 "pretrain.pooling=cls", "train.max_steps=2", "train.batch_size=4", "train.query_max_length=16",
                 "train.passage_max_length=32", "train.probe_size=8", "train.report=false",
                 "eval.query_max_length=16", "eval.passage_max_length=32", "eval.batch_size=256"]
    config = load_pipeline_config(REPO / "configs" / "pipeline-example.yaml", overrides)
    result = run_pipeline(config)
    assert result.stages == {"corpus": "ran", "chunk": "off", "queries": "ran", "pretrain": "ran", "mine": "ran",
                             "filter": "off", "train": "ran", "eval": "ran"}
    assert set(result.metrics) == {"base", "pretrained", "finetuned"}
    mined = [json.loads(x) for x in (tmp_path / "work" / "mine" / "train.jsonl").read_text().splitlines()]
    assert 0 < len(mined) <= 40 and all(len(r["neg"]) <= 7 for r in mined)


def test_a_second_run_on_the_same_work_dir_is_refused_while_the_first_holds_it(tmp_path, tiny_model_dir):
    """Two robustir run on one work dir raced (issue 35): the second is refused with a clear error; the lock goes
    with the process that held it."""
    from robustir.errors import ConfigError
    from robustir.io import try_lock

    path = tiny_config(tiny_model_dir, tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    held = try_lock(work / "run.lock")  # another run in progress
    assert held is not None
    try:
        with pytest.raises(ConfigError, match="being used by another robustir run"):
            run_pipeline(load_pipeline_config(path, ["train.max_steps=1"]))
    finally:
        import os

        os.close(held)
    assert try_lock(work / "run.lock") is not None  # free again
