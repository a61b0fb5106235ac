"""Planted noise (each kind plants exactly what it says), the same-rows side-by-side, and the resumable bench."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from robustir.data.training_data import TrainingExample, load_training_data
from robustir.errors import ConfigError
from robustir.robustness.noise import NOISE_KINDS, near_duplicate, plant_noise, split_into_passages

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SENTENCES = [f"Sentence {i} talks about topic {i} with several plain words in it." for i in range(200)]


def _examples(n: int = 50, multi_every: int = 3) -> list[TrainingExample]:
    out = []
    for q in range(n):
        pos_count = 2 if q % multi_every == 0 else 1
        pos = [" ".join(SENTENCES[(q * 7 + p * 3 + s) % 200] for s in range(6)) for p in range(pos_count)]
        neg = [f"negative {q}-{j} " + SENTENCES[(q + j) % 200] for j in range(8)]
        out.append(TrainingExample(f"query {q}", pos, neg, extra={
            "query_id": f"q{q}", "pos_ids": [f"d{q}-{p}" for p in range(pos_count)],
            "neg_ids": [f"n{q}-{j}" for j in range(8)]}))
    return out


CORPUS = ([f"c{i}" for i in range(300)], [f"corpus passage number {i} " + SENTENCES[i % 200] for i in range(300)])


@pytest.mark.parametrize("kind", list(NOISE_KINDS))
def test_each_kind_plants_exactly_the_requested_count_and_is_seeded(kind):
    clean = _examples()
    snapshot = json.dumps([e.to_json() for e in clean])
    noisy = plant_noise(clean, kind, 0.4, seed=7, corpus=CORPUS)
    assert json.dumps([e.to_json() for e in clean]) == snapshot  # input untouched
    assert len(noisy.plants) == 20  # round(0.4 * 50)
    changed = [i for i, (a, b) in enumerate(zip(clean, noisy.examples)) if a.to_json() != b.to_json()]
    assert len(changed) == 20
    assert {noisy.examples[i].extra["query_id"] for i in changed} == {p.query_id for p in noisy.plants}
    again = plant_noise(clean, kind, 0.4, seed=7, corpus=CORPUS)
    assert [p.to_json() for p in again.plants] == [p.to_json() for p in noisy.plants]
    other = plant_noise(clean, kind, 0.4, seed=8, corpus=CORPUS)
    assert {p.query_id for p in other.plants} != {p.query_id for p in noisy.plants}
    assert plant_noise(clean, kind, 0.0, seed=7, corpus=CORPUS).plants == []
    for example in noisy.examples:
        assert len(example.extra["neg_ids"]) == len(example.neg)
        assert len(example.extra["pos_ids"]) == len(example.pos) >= 1


def test_chunk_fn_puts_other_passages_of_the_relevant_document_on_top_of_the_negatives():
    clean = {e.extra["query_id"]: e for e in _examples()}
    noisy = plant_noise(list(clean.values()), "chunk-fn", 0.2, seed=1, per_query=2)
    by_id = {e.extra["query_id"]: e for e in noisy.examples}
    for plant in noisy.plants:
        before, after = clean[plant.query_id], by_id[plant.query_id]
        assert len(plant.false_negatives) == 2
        assert after.neg[:2] == plant.false_negatives
        assert all(any(text in p for p in before.pos) for text in plant.false_negatives)
        assert after.pos == before.pos and len(after.neg) == len(before.neg)  # pool size unchanged
        assert after.extra["neg_ids"][0].startswith("planted:chunk-fn:d")


def test_label_fn_moves_positives_and_falls_back_to_near_duplicates():
    clean = _examples()  # 17 of 50 queries have two positives
    noisy = plant_noise(clean, "label-fn", 0.5, seed=3)
    kinds = [p.kind for p in noisy.plants]
    assert kinds.count("label-fn") == 17 and kinds.count("dup-fn") == 8
    by_id = {e.extra["query_id"]: e for e in clean}
    noisy_by_id = {e.extra["query_id"]: e for e in noisy.examples}
    for plant in noisy.plants:
        before, after = by_id[plant.query_id], noisy_by_id[plant.query_id]
        if plant.kind == "label-fn":
            (moved,) = plant.false_negatives
            assert moved in before.pos and moved not in after.pos and after.neg[0] == moved
            assert len(after.pos) == 1 and len(after.extra["pos_ids"]) == 1
        else:
            assert all(dup not in before.pos and dup in after.neg for dup in plant.false_negatives)


def test_false_positive_kinds_replace_the_positive():
    clean = _examples()
    by_id = {e.extra["query_id"]: e for e in clean}
    rand = plant_noise(clean, "fp-random", 0.2, seed=1, corpus=CORPUS)
    for plant in rand.plants:
        after = next(e for e in rand.examples if e.extra["query_id"] == plant.query_id)
        assert after.pos == plant.false_positives and after.pos[0] in CORPUS[1]
        assert plant.replaced_positives == by_id[plant.query_id].pos
        assert after.extra["pos_ids"][0].startswith("planted:fp-random:c")
    hard = plant_noise(clean, "fp-hard", 0.2, seed=1)
    for plant in hard.plants:
        before = by_id[plant.query_id]
        after = next(e for e in hard.examples if e.extra["query_id"] == plant.query_id)
        assert after.pos == [before.neg[0]]  # the top-ranked mined negative now stands as the positive
        assert before.neg[0] not in after.neg and len(after.neg) == len(before.neg) - 1
        assert after.extra["pos_ids"] == [f"planted:fp-hard:{before.extra['neg_ids'][0]}"]


def test_fp_swap_plants_both_halves_of_a_near_miss_label():
    """Issue 50: the near miss stands as the positive *and* the true positive is the top negative (where a miner run
    on the wrong label ranks it); the pool is as fp-hard leaves it; the plant names both halves."""
    clean = _examples()
    by_id = {e.extra["query_id"]: e for e in clean}
    swap = plant_noise(clean, "fp-swap", 0.2, seed=1)
    assert len(swap.plants) == 10
    for plant in swap.plants:
        before = by_id[plant.query_id]
        after = next(e for e in swap.examples if e.extra["query_id"] == plant.query_id)
        assert plant.kind == "fp-swap" and after.pos == [before.neg[0]] == plant.false_positives
        assert after.neg[: len(before.pos)] == before.pos == plant.false_negatives == plant.replaced_positives
        assert before.neg[0] not in after.neg and len(after.neg) == len(before.neg) - 1  # as fp-hard leaves it
        assert after.extra["pos_ids"] == [f"planted:fp-swap:{before.extra['neg_ids'][0]}"]
        assert after.extra["neg_ids"][: len(before.pos)] == [f"planted:fp-swap:{i}" for i in before.extra["pos_ids"]]
    assert swap.summary()["planted_false_negatives"] == sum(len(by_id[p.query_id].pos) for p in swap.plants)


def test_noise_arguments_are_checked():
    with pytest.raises(ConfigError, match="unknown noise kind"):
        plant_noise(_examples(), "typo", 0.2, seed=1)
    with pytest.raises(ConfigError, match="rate"):
        plant_noise(_examples(), "chunk-fn", 1.5, seed=1)
    with pytest.raises(ConfigError, match="corpus"):
        plant_noise(_examples(), "fp-random", 0.2, seed=1)


def test_helpers():
    rng = random.Random(0)
    text = " ".join(SENTENCES[:3])
    dup = near_duplicate(text, rng)
    assert dup != text and abs(len(dup.split()) - len(text.split())) <= len(text.split()) // 4
    pieces = split_into_passages(" ".join(SENTENCES[:10]), max_words=30)
    assert len(pieces) >= 3 and all(p in " ".join(SENTENCES[:10]) for p in pieces)


# ----------------------------------------------------------------------------------- side by side

def test_materialized_rows_cover_every_pair_per_epoch():
    from robustir.robustness.sidebyside import materialize_rows

    examples = _examples(20)
    pairs = sum(len(e.pos) for e in examples)
    rows = materialize_rows(examples, 3, 2.0, seed=5)
    assert len(rows) == 2 * pairs
    assert rows == materialize_rows(examples, 3, 2.0, seed=5)
    assert rows != materialize_rows(examples, 3, 2.0, seed=6)
    for row in rows:
        assert len(row["pos"]) == 1 and len(row["neg"]) == 3 and len(set(row["neg"])) == 3
        assert row["pos"][0] not in row["neg"]
    assert len(materialize_rows(examples, 3, 0.5, seed=5)) == round(0.5 * pairs)
    # a pool smaller than k is completed from the filler
    short = [TrainingExample("q", ["p"], ["n1"])] + examples
    row = materialize_rows(short, 3, 1.0, seed=1)[0]
    assert row["neg"][0] == "n1" or "n1" in row["neg"]


def test_side_by_side_trains_both_sides_on_the_same_rows_and_steps(tiny_model_dir, tmp_path, monkeypatch):
    from robustir.robustness import sidebyside
    from robustir.robustness.sidebyside import Budget, materialize_rows, write_rows

    budget = Budget(batch_size=4, num_negatives=2, pool=4, epochs=1.0, precision="fp32", query_max_length=16,
                    train_passage_max_length=24, passage_max_length=32)
    rows_path = write_rows(materialize_rows(_examples(10), 2, 1.0, seed=1), tmp_path / "rows.jsonl")
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]

    st_data = sidebyside._st_dataset(rows_path, 2)
    assert [(r["query"], r["pos"][0], r["neg"]) for r in rows] == \
        [(a, p, [n1, n2]) for a, p, n1, n2 in zip(st_data["anchor"], st_data["positive"], st_data["negative_1"],
                                                  st_data["negative_2"])]
    ours_examples, _ = load_training_data(rows_path)
    assert [(e.query, e.pos, e.neg) for e in ours_examples] == [(r["query"], r["pos"], r["neg"]) for r in rows]

    st = sidebyside.train_sentence_transformers(rows_path, tmp_path / "st", budget, 1, model=tiny_model_dir)
    ours = sidebyside.train_robustir(rows_path, tmp_path / "ours", budget, 1, model=tiny_model_dir)
    assert st.steps == ours.steps == len(rows) // 4
    log = [json.loads(line) for line in (tmp_path / "ours" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == ours.steps
    from robustir.runs import Artifact

    assert Artifact(tmp_path / "st").complete() and Artifact(tmp_path / "st").report["steps"] == st.steps
    from sentence_transformers import SentenceTransformer

    assert SentenceTransformer(str(st.model_path)).encode(["x"]).shape[1] == 32


# ----------------------------------------------------------------------------------- the bench

def _tiny_beir(root: Path) -> Path:
    root.mkdir(parents=True)
    docs = {f"d{i}": " ".join(SENTENCES[(i * 5 + s) % 200] for s in range(5)) for i in range(60)}
    with open(root / "corpus.jsonl", "w") as handle:
        for doc_id, text in docs.items():
            handle.write(json.dumps({"_id": doc_id, "title": "", "text": text}) + "\n")
    with open(root / "queries.jsonl", "w") as handle:
        for i in range(40):
            handle.write(json.dumps({"_id": f"q{i}", "text": f"what about topic {(i * 5) % 200}"}) + "\n")
    (root / "qrels").mkdir()
    for split, ids in (("train", range(0, 30)), ("test", range(30, 40))):
        lines = ["query-id\tcorpus-id\tscore"] + [f"q{i}\td{i}\t1" for i in ids]
        lines += [f"q{i}\td{i + 20}\t1" for i in ids if i % 4 == 0 and i + 20 < 60]
        (root / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return root


def test_bench_runs_the_grid_writes_table_and_plot_and_resumes_without_redoing(tiny_model_dir, tmp_path, monkeypatch):
    from robustir.robustness import bench
    from robustir.robustness.bench import NoiseBenchConfig, run_noise_bench

    data = _tiny_beir(tmp_path / "beir")
    calls: list[str] = []
    real_train = bench.train_robustir

    def counting_train(rows_path, output, *args, **kwargs):
        calls.append(str(output))
        return real_train(rows_path, output, *args, **kwargs)

    monkeypatch.setattr(bench, "train_robustir", counting_train)
    config = NoiseBenchConfig(data=str(data), model=tiny_model_dir, kinds=["chunk-fn", "fp-random"],
                              rates=[0.0, 0.5], methods=["infonce", "teacher"], seeds=[1], output=str(tmp_path / "out"),
                              budget={"batch_size": 4, "num_negatives": 2, "pool": 4, "epochs": 1.0, "precision": "fp32",
                                      "query_max_length": 16, "train_passage_max_length": 32,
                                      "passage_max_length": 32})
    rows = run_noise_bench(config)
    # clean once + 2 kinds at 50 %, two methods each
    assert sorted((r["kind"], r["rate"], r["method"]) for r in rows) == sorted(
        [("clean", 0.0, "infonce"), ("clean", 0.0, "teacher"), ("chunk-fn", 0.5, "infonce"),
         ("chunk-fn", 0.5, "teacher"), ("fp-random", 0.5, "infonce"), ("fp-random", 0.5, "teacher")])
    assert len(calls) == 6
    noisy = [r for r in rows if r["rate"] == 0.5]
    assert all(r["noise"]["noisy_queries"] == 15 for r in noisy)  # round(0.5 * 30)
    chunk_teacher = next(r for r in rows if r["kind"] == "chunk-fn" and r["method"] == "teacher")
    assert chunk_teacher["filter"]["planted_negatives"] > 0
    out = tmp_path / "out"
    assert (out / "results.png").stat().st_size > 0
    table = (out / "results.md").read_text()
    assert "| infonce |" in table and "chunk-fn 50%" in table

    calls.clear()
    again = run_noise_bench(config)
    assert calls == [] and len(again) == 6  # nothing redone
    with open(out / "results.jsonl") as handle:
        assert len(handle.readlines()) == 6

    # other filter options: only the methods that use the filter run again, on a new filtered file
    from dataclasses import replace

    calls.clear()
    variant = replace(config, teacher={"relative_margin": 0.1, "suspect_positive_share": 0.7})
    rows = run_noise_bench(variant)
    assert len(calls) == 3 and all("/teacher-" in c for c in calls)
    assert {r["variant"] for r in rows if r["method"] == "teacher"} == {variant.variant("teacher")}
    assert variant.variant("teacher") != config.variant("teacher") and config.variant("infonce") == ""
    assert len(list((out / "data" / "clean-s1").glob("teacher-*.jsonl"))) == 2
    assert len([json.loads(line) for line in open(out / "results.jsonl")]) == 9  # both variants are kept


def test_table_compares_a_cell_with_the_clean_runs_of_its_own_seeds(tmp_path):
    from robustir.robustness.bench import write_table

    def row(kind, rate, seed, ndcg):
        return {"kind": kind, "rate": rate, "method": "infonce", "seed": seed, "metrics": {"ndcg@10": ndcg}}

    rows = [row("clean", 0.0, 1, 0.70), row("clean", 0.0, 2, 0.60), row("clean", 0.0, 3, 0.62),
            row("fp-random", 0.4, 1, 0.65), row("fp-random", 0.4, 2, 0.57), row("fp-random", 0.4, 3, 0.59),
            row("fp-random", 0.2, 1, 0.69)]  # one seed: its change is against clean seed 1 (70.00), not the mean
    text = write_table(rows, tmp_path / "t.md")
    line = next(x for x in text.splitlines() if x.startswith("| infonce"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "64.00 ± 5.29"
    assert cells[2] == "69.00 (-1.00)"  # the unpaired figure would be +4.33
    assert cells[3].startswith("60.33 ± 4.16") and cells[3].endswith("(-3.67)")


def test_bench_config_typos_fail_at_load():
    from robustir.config import load_config
    from robustir.robustness.bench import NoiseBenchConfig

    with pytest.raises(ConfigError, match="did you mean 'kinds'"):
        load_config(NoiseBenchConfig, None, ["kindz=chunk-fn"])
    with pytest.raises(ConfigError, match=r"methods\[0\]: 'infonse' is not one of \['infonce'"):
        NoiseBenchConfig(methods=["infonse"])  # refused when built, not when the grid is resolved
    with pytest.raises(ConfigError, match=r"kinds\[1\]: 'fp-randm' is not one of"):
        load_config(NoiseBenchConfig, None, ["kinds=chunk-fn,fp-randm"])
    with pytest.raises(ConfigError, match="budget field"):
        NoiseBenchConfig(budget={"epoch": 1}).resolved()
    with pytest.raises(ConfigError, match="needs an endpoint"):
        NoiseBenchConfig(methods=["llm"]).resolved()


def test_cli_rejects_a_config_typo_without_traceback(tmp_path, capsys):
    from robustir.cli.main import main

    code = main(["noise-bench", "--output", str(tmp_path / "o"), "budget.epoch=2"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown budget field" in err and "Traceback" not in err
    code = main(["noise-bench", "--output", str(tmp_path / "o"), "kindz=chunk-fn"])
    assert code == 2 and "did you mean 'kinds'" in capsys.readouterr().err


def test_bench_llm_judge_method_against_a_local_fake_endpoint(tiny_model_dir, tmp_path):
    """The judge says every negative is relevant: it removes them all, so it finds every planted one."""
    from fake_llm_server import FakeLLMServer

    from robustir.robustness.bench import NoiseBenchConfig, run_noise_bench

    data = _tiny_beir(tmp_path / "beir")
    with FakeLLMServer(lambda messages: "Yes") as server:
        config = NoiseBenchConfig(data=str(data), model=tiny_model_dir, kinds=["chunk-fn"], rates=[0.5],
                                  methods=["llm"], seeds=[2], output=str(tmp_path / "out"), plots=False,
                                  llm={"base_url": server.url, "model": "fake-judge"},
                                  budget={"batch_size": 4, "num_negatives": 2, "pool": 4, "epochs": 1.0,
                                          "precision": "fp32", "query_max_length": 16, "train_passage_max_length": 32,
                                          "passage_max_length": 32})
        (row,) = run_noise_bench(config)
        assert server.count > 0
    stats = row["filter"]
    assert stats["planted_negatives"] > 0 and stats["fn_recall"] == 1.0
    assert stats["fn_precision"] == pytest.approx(stats["planted_negatives"] / stats["removed_negatives"], abs=1e-4)
    with pytest.raises(ConfigError, match="noise-bench.llm"):
        NoiseBenchConfig(methods=["llm"], llm={"modle": "x"}).resolved()


def test_bench_llm_pos_corrects_planted_near_misses_with_dense_pools(tiny_model_dir, tmp_path):
    """Issue 50: ``mining: dense`` mines the pools with the benchmark's model, so fp-hard plants its own nearest
    non-relevant passage; ``llm-pos`` asks the judge about positives too. The fake judge knows the truth (a passage
    is relevant when the qrels say so): it removes every planted near miss and nothing else."""
    from fake_llm_server import FakeLLMServer, last_user

    from robustir.robustness.bench import NoiseBenchConfig, _Bench, run_noise_bench

    data = _tiny_beir(tmp_path / "beir")
    relevant = {}  # query text -> its relevant documents' texts
    queries = {json.loads(l)["_id"]: json.loads(l)["text"] for l in (data / "queries.jsonl").read_text().splitlines()}
    corpus = {json.loads(l)["_id"]: json.loads(l) for l in (data / "corpus.jsonl").read_text().splitlines()}
    for line in (data / "qrels" / "train.tsv").read_text().splitlines()[1:]:
        qid, did, _ = line.split("\t")
        relevant.setdefault(queries[qid], set()).add(corpus[did]["text"])

    def judge(messages):
        prompt = last_user(messages)
        query = prompt.split("Query: ", 1)[1].split("\n", 1)[0]
        passage = prompt.split("Passage: ", 1)[1].rsplit("\n\nIs the passage", 1)[0]
        return "yes" if any(passage.strip() in text or text in passage for text in relevant.get(query, ())) else "no"

    budget = {"batch_size": 4, "num_negatives": 2, "pool": 4, "epochs": 1.0, "precision": "fp32",
              "query_max_length": 16, "train_passage_max_length": 32, "passage_max_length": 32}
    with FakeLLMServer(judge) as server:
        config = NoiseBenchConfig(data=str(data), model=tiny_model_dir, kinds=["fp-hard"], rates=[0.5],
                                  methods=["llm-pos"], seeds=[2], output=str(tmp_path / "out"), plots=False,
                                  mining="dense", llm={"base_url": server.url, "model": "fake-judge"}, budget=budget)
        (row,) = run_noise_bench(config)
    stats = row["filter"]
    assert stats["planted_positives"] > 0 and stats["fp_recall"] == 1.0 and stats["fp_precision"] == 1.0
    mined = [json.loads(l) for l in (tmp_path / "out" / "data" / "mined.jsonl").read_text().splitlines()]
    bm25 = _Bench(NoiseBenchConfig(data=str(data), model=tiny_model_dir, output=str(tmp_path / "bm25"), budget=budget))
    assert [e.neg for e in bm25.clean()] != [r["neg"] for r in mined]  # the dense pools are not BM25's
    assert config.resolved().methods == ["llm-pos"]
    with pytest.raises(ConfigError, match="llm-pos"):
        NoiseBenchConfig(methods=["llm-pos"]).resolved()


def test_bench_reruns_a_cell_when_its_model_budget_or_data_change(tiny_model_dir, tmp_path, monkeypatch):
    """A result is reused only for the same cell: another budget or model trains again, and an edited data folder
    (same path) is mined again first. (On 5245875 all three re-runs reported the first result.)"""
    from dataclasses import replace

    from robustir.robustness import bench
    from robustir.robustness.bench import NoiseBenchConfig, run_noise_bench

    data = _tiny_beir(tmp_path / "beir")
    calls: list[str] = []
    mined: list[str] = []
    real_train, real_mine = bench.train_robustir, None

    def counting_train(rows_path, output, *args, **kwargs):
        calls.append(str(output))
        return real_train(rows_path, output, *args, **kwargs)

    import robustir.negatives.mining as mining

    real_mine = mining.mine_beir

    def counting_mine(*args, **kwargs):
        mined.append(str(args[0]))
        return real_mine(*args, **kwargs)

    monkeypatch.setattr(bench, "train_robustir", counting_train)
    monkeypatch.setattr(mining, "mine_beir", counting_mine)
    budget = {"batch_size": 4, "num_negatives": 2, "pool": 4, "epochs": 1.0, "precision": "fp32",
              "query_max_length": 16, "train_passage_max_length": 32, "passage_max_length": 32}
    config = NoiseBenchConfig(data=str(data), model=tiny_model_dir, kinds=["fp-random"], rates=[0.0],
                              methods=["infonce"], seeds=[1], output=str(tmp_path / "out"), budget=budget, plots=False)
    first = run_noise_bench(config)
    assert len(calls) == 1 and len(mined) == 1
    assert run_noise_bench(config) == first and len(calls) == 1  # unchanged: reused

    faster = run_noise_bench(replace(config, budget={**budget, "lr": 1e-3}))
    assert len(calls) == 2 and faster[0]["budget"]["lr"] == 1e-3

    import shutil

    from safetensors.torch import load_file, save_file

    other = shutil.copytree(tiny_model_dir, tmp_path / "other-model")
    weights = load_file(other / "model.safetensors")
    save_file({k: v * 1.01 for k, v in weights.items()}, other / "model.safetensors", metadata={"format": "pt"})
    other_model = run_noise_bench(replace(config, model=str(other)))
    assert len(calls) == 3 and other_model[0]["cell"] != first[0]["cell"]

    with open(data / "qrels" / "train.tsv", "a") as handle:  # one more training pair, same path
        handle.write("q5\td50\t1\n")
    edited = run_noise_bench(config)
    assert len(mined) == 2 and len(calls) == 4
    assert edited[0]["cell"] != first[0]["cell"]
    assert edited[0]["rows"] != first[0]["rows"] or edited[0]["metrics"] != first[0]["metrics"]


@pytest.mark.parametrize("override, key", [("teacher.relative_margn=0.1", "relative_margin"),
                                           ("sieve.bta=0.5", "beta"), ("teacher_peg.suspect_positive_shar=0.5",
                                                                        "suspect_positive_share"),
                                           ("llm.temperatur=0", "temperature")])
def test_method_options_are_typed_and_a_typo_fails_at_load(override, key):
    from robustir.config import load_config
    from robustir.robustness.bench import NoiseBenchConfig

    with pytest.raises(ConfigError, match=f"did you mean '{key}'"):
        load_config(NoiseBenchConfig, None, [override])


def test_parallel_runs_give_the_rows_of_serial_runs_and_dev_and_subset_hold_out_their_queries(tiny_model_dir,
                                                                                               tmp_path):
    """jobs=2 (worker processes, data made first) gives the very rows jobs=1 gives; ``dev`` trains without the
    held-out queries and evaluates on them; ``train_queries`` trains on a seeded subset; ``robust`` filters."""
    from dataclasses import replace

    from robustir.robustness.bench import NoiseBenchConfig, _Bench, run_noise_bench

    data = _tiny_beir(tmp_path / "beir")
    budget = {"batch_size": 4, "num_negatives": 2, "pool": 4, "epochs": 2.0, "precision": "fp32",
              "query_max_length": 16, "train_passage_max_length": 32, "passage_max_length": 32, "train_queries": 20}
    config = NoiseBenchConfig(data=str(data), model=tiny_model_dir, kinds=["fp-random"], rates=[0.0, 0.5],
                              methods=["infonce", "robust"], seeds=[1], output=str(tmp_path / "serial"), dev=6,
                              budget=budget, plots=False, robust={"relative_margin": 0.05, "random_like_share": 0.2})
    serial = run_noise_bench(config)
    parallel = run_noise_bench(replace(config, output=str(tmp_path / "parallel"), jobs=2))
    key = lambda r: (r["kind"], r["rate"], r["method"])  # noqa: E731
    assert len(serial) == len(parallel) == 4
    for a, b in zip(sorted(serial, key=key), sorted(parallel, key=key)):
        assert a["cell"] == b["cell"] and a["metrics"] == b["metrics"] and a["rows"] == b["rows"]
    assert all(r["peak_gpu_bytes"] is None for r in serial + parallel)  # recorded on CUDA only (issue 54)
    bench = _Bench(config)
    dev = bench.dev_ids()
    assert len(dev) == 6
    trained = {e.extra["query_id"] for e in bench.clean()}
    assert len(trained) == 20 and not trained & dev  # 30 train queries - 6 dev, then a subset of 20
    assert all(r["rows"] > 0 for r in serial)
    robust = next(r for r in serial if r["method"] == "robust" and r["rate"] == 0.5)
    assert robust["filter"]["planted_positives"] == 10 and robust["filter"]["removed_positives"] >= 0
    # the dev queries are what the model is evaluated on: another dev size is another cell
    assert replace(config, dev=5).resolved() and _Bench(replace(config, dev=5)).cell("fp-random", 0.5, 1, "robust").digest \
        != bench.cell("fp-random", 0.5, 1, "robust").digest
