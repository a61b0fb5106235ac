"""Hard-negative mining (``robustir mine``): exclusions, score/rank rules, sampling, resume, shards + merge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from robustir.cli.main import main
from robustir.errors import ConfigError, DataError
from robustir.negatives import mining as negatives_module
from robustir.outputs import StageOutput
from robustir.negatives.mining import MiningConfig, MiningQuery, load_jsonl_for_mining, mine_jsonl, mine_negatives

WORDS = "cell protein gene virus cancer brain heart lung blood immune".split()


def toy_corpus(n: int = 40) -> tuple[list[str], list[str]]:
    """Documents that all share vocabulary with the queries, so every one is retrieved."""
    ids = [f"d{i}" for i in range(n)]
    texts = [f"{WORDS[i % 10]} {WORDS[(i * 3) % 10]} {WORDS[(i * 7) % 10]} study number {i}" for i in range(n)]
    return ids, texts


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_never_returns_positive_duplicate_or_query(tmp_path):
    ids, texts = toy_corpus()
    texts[5] = texts[1]  # d5 is a duplicate of positive d1 under another id
    texts[6] = "  " + texts[2] + " "  # whitespace-only difference from positive d2
    texts[7] = "cell protein gene query"  # the query text itself, as a document
    queries = [MiningQuery("q1", "cell protein gene query", ["d1", "d2"]),
               MiningQuery("d9", "virus cancer brain", ["d3"])]  # a document id equal to the query id
    report = mine_negatives(queries, ids, texts, tmp_path / "out.jsonl",
                            MiningConfig(num_negatives=30, range_max=40), show_progress=False)
    rows = read(tmp_path / "out.jsonl")
    first, second = rows
    assert first["pos_ids"] == ["d1", "d2"] and len(first["pos_scores"]) == 2
    assert not {"d1", "d2", "d5", "d6", "d7"} & set(first["neg_ids"])
    assert texts[1] not in first["neg"] and "cell protein gene query" not in first["neg"]
    assert "d9" not in second["neg_ids"] and "d3" not in second["neg_ids"]
    assert len(first["neg"]) == len(set(first["neg"])) == len(first["neg_scores"])
    assert report.excluded_positive >= 5
    saved = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    assert saved["queries"] == 2 and saved["config"]["method"] == "bm25"


def test_rank_window_and_margins(tmp_path):
    ids, texts = toy_corpus()
    queries = [MiningQuery("q", "cell protein gene", ["d0"])]
    full = mine_negatives(queries, ids, texts, tmp_path / "all.jsonl", MiningConfig(num_negatives=40),
                          show_progress=False)
    ranked = read(tmp_path / "all.jsonl")[0]
    assert full.negatives == len(ranked["neg"])
    mine_negatives(queries, ids, texts, tmp_path / "w.jsonl", MiningConfig(num_negatives=3, range_min=2, range_max=10),
                   show_progress=False)
    assert read(tmp_path / "w.jsonl")[0]["neg_ids"] == ranked["neg_ids"][2:5]

    pos = min(ranked["pos_scores"])
    for name, config, ok in [
        ("abs", MiningConfig(num_negatives=40, absolute_margin=0.5), lambda s: s <= pos - 0.5),
        ("rel", MiningConfig(num_negatives=40, relative_margin=0.2), lambda s: s <= pos * 0.8),
        ("max", MiningConfig(num_negatives=40, max_score=pos * 0.9), lambda s: s <= pos * 0.9),
        ("min", MiningConfig(num_negatives=40, min_score=pos * 0.5), lambda s: s >= pos * 0.5),
    ]:
        mine_negatives(queries, ids, texts, tmp_path / f"{name}.jsonl", config, show_progress=False)
        row = read(tmp_path / f"{name}.jsonl")[0]
        expected = [i for i, s in zip(ranked["neg_ids"], ranked["neg_scores"]) if ok(s)]
        assert row["neg_ids"] == expected, name
        assert all(ok(s) for s in row["neg_scores"])
    with pytest.raises(ConfigError):
        MiningConfig(range_min=5, range_max=5).validate()


def test_relative_margin_is_the_teacher_filters_rule_for_negative_scores():
    # Dense scores can be negative: the threshold must stay below the positive (-2.0 - 0.1 = -2.1), not
    # move above it (-2.0 * 0.95 = -1.9 would keep -2.0 < s <= -1.9, negatives that outscore the positive).
    import random

    from robustir.negatives.mining import MiningReport, select_negatives

    candidates = [(0, -1.95), (1, -2.05), (2, -2.2)]
    kept = select_negatives(candidates, -2.0, MiningConfig(num_negatives=5, relative_margin=0.05),
                            random.Random(0), MiningReport())
    assert [row for row, _ in kept] == [2]


def test_random_sampling_is_deterministic_by_seed(tmp_path):
    ids, texts = toy_corpus()
    queries = [MiningQuery(f"q{i}", f"{WORDS[i]} {WORDS[i + 1]}", [f"d{i}"]) for i in range(5)]

    def run(name: str, seed: int) -> list[list[str]]:
        mine_negatives(queries, ids, texts, tmp_path / name,
                       MiningConfig(num_negatives=4, sampling="random", seed=seed), show_progress=False)
        return [r["neg_ids"] for r in read(tmp_path / name)]

    a, b, c = run("a.jsonl", 7), run("b.jsonl", 7), run("c.jsonl", 8)
    assert a == b and a != c
    top = [r["neg_ids"] for r in (mine_negatives(queries, ids, texts, tmp_path / "t.jsonl", MiningConfig(num_negatives=4),
                                                 show_progress=False) and read(tmp_path / "t.jsonl"))]
    assert a != top  # sampled, not simply the top 4


def test_resume_after_crash_gives_the_uninterrupted_output(tmp_path, monkeypatch):
    ids, texts = toy_corpus()
    queries = [MiningQuery(f"q{i}", f"{WORDS[i % 10]} {WORDS[(i + 3) % 10]}", [f"d{i}"]) for i in range(12)]
    config = MiningConfig(num_negatives=3, query_batch_size=4)
    mine_negatives(queries, ids, texts, tmp_path / "ref.jsonl", config, show_progress=False)

    class Crashing(negatives_module.ResumableJsonlWriter):
        def write(self, record: dict) -> None:
            if self.count >= 5:
                raise RuntimeError("simulated crash")
            super().write(record)

    monkeypatch.setattr(negatives_module, "ResumableJsonlWriter", Crashing)
    with pytest.raises(RuntimeError):
        mine_negatives(queries, ids, texts, tmp_path / "out.jsonl", config, show_progress=False)
    partial = tmp_path / "out.jsonl.partial"
    assert not (tmp_path / "out.jsonl").exists() and len(read(partial)) == 5
    with open(partial, "a", encoding="utf-8") as handle:
        handle.write('{"query": "torn')  # a half-written line from the crash
    monkeypatch.undo()
    mine_negatives(queries, ids, texts, tmp_path / "out.jsonl", config, show_progress=False)
    assert (tmp_path / "out.jsonl").read_text() == (tmp_path / "ref.jsonl").read_text()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_jsonl_input_uses_file_pool_or_corpus(tmp_path):
    ids, texts = toy_corpus(20)
    rows = [{"query": f"{WORDS[i]} {WORDS[i + 2]}", "pos": [texts[i]], "neg": [texts[i + 10]], "doc_id": f"x{i}"}
            for i in range(6)]
    rows.append({"query": "cell protein", "pos": [texts[0]]})  # positive shared with record 0
    source = write_jsonl(tmp_path / "train.jsonl", rows)
    queries, pool_ids, pool_texts = load_jsonl_for_mining(source)
    assert len(pool_texts) == 12 and queries[0].query_id == "L1" and queries[0].extra == {"doc_id": "x0"}
    mine_jsonl(source, tmp_path / "mined.jsonl", MiningConfig(num_negatives=20))
    for row, original in zip(read(tmp_path / "mined.jsonl"), rows):
        assert original["pos"][0] not in row["neg"] and row["query"] not in row["neg"]
        assert set(row["neg"]) <= set(pool_texts)
    assert read(tmp_path / "mined.jsonl")[0]["doc_id"] == "x0"
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, [{"_id": i, "title": "", "text": t} for i, t in zip(ids, texts)])
    mine_jsonl(source, tmp_path / "mined-c.jsonl", MiningConfig(num_negatives=30), corpus=corpus)
    out = read(tmp_path / "mined-c.jsonl")
    assert out[0]["pos_ids"] == ["d0"] and "d0" not in out[0]["neg_ids"] and len(out[0]["neg"]) == 19


def test_malformed_input_names_file_and_line(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"query": "a", "pos": ["x"]}\n{"query": "b", "pos": "not a list"}\n', encoding="utf-8")
    with pytest.raises(DataError) as info:
        mine_jsonl(source, tmp_path / "out.jsonl")
    assert "bad.jsonl" in str(info.value) and "line 2" in str(info.value) and "pos" in str(info.value)
    source.write_text('{"query": "a", "pos": ["x"]}\n{not json\n', encoding="utf-8")
    with pytest.raises(DataError, match="line 2"):
        mine_jsonl(source, tmp_path / "out.jsonl")


def beir_folder(root: Path, n_queries: int = 9) -> Path:
    ids, texts = toy_corpus()
    (root / "qrels").mkdir(parents=True)
    write_jsonl(root / "corpus.jsonl", [{"_id": i, "title": "", "text": t} for i, t in zip(ids, texts)])
    write_jsonl(root / "queries.jsonl", [{"_id": f"q{i}", "text": f"{WORDS[i % 10]} {WORDS[(i + 4) % 10]}"}
                                         for i in range(n_queries)])
    (root / "qrels" / "train.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(n_queries)))
    return root


def test_cli_shards_and_merge_equal_unsharded(tmp_path, capsys):
    data = beir_folder(tmp_path / "beir")
    common = ["mine", "--data", str(data), "--num-negatives", "3"]
    assert main(common + ["--output", str(tmp_path / "full.jsonl")]) == 0
    assert "queries 9" in capsys.readouterr().out
    for i in (1, 2, 3):
        assert main(common + ["--output", str(tmp_path / "sh.jsonl"), "--shard", f"{i}/3"]) == 0
    assert (tmp_path / "sh.shard-00002-of-00003.jsonl").exists()
    assert main(["merge", "--output", str(tmp_path / "sh.jsonl")]) == 0
    key = lambda r: r["query_id"]  # noqa: E731  (shard order differs from input order)
    assert sorted(read(tmp_path / "sh.jsonl"), key=key) == sorted(read(tmp_path / "full.jsonl"), key=key)
    merged = json.loads((tmp_path / "sh.jsonl.report.json").read_text())
    assert merged["queries"] == 9 and len(merged["shard_reports"]) == 3
    # a complete output is left alone
    assert main(common + ["--output", str(tmp_path / "full.jsonl")]) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_merge_refuses_missing_and_incomplete_shards(tmp_path):
    data = beir_folder(tmp_path / "beir")
    out = tmp_path / "m.jsonl"
    for i in (1, 2, 3, 4):
        assert main(["mine", "--data", str(data), "--output", str(out), "--shard", f"{i}/4"]) == 0
    shard2 = tmp_path / "m.shard-00002-of-00004.jsonl"
    shard4 = tmp_path / "m.shard-00004-of-00004.jsonl"
    shard2.rename(shard2.with_name(shard2.name + ".partial"))  # shard 2 interrupted
    (tmp_path / "m.shard-00003-of-00004.jsonl.report.json").unlink()  # shard 3 died before its report
    shard4.unlink()  # shard 4 never ran
    (tmp_path / "m.shard-00004-of-00004.jsonl.report.json").unlink()
    with pytest.raises(ConfigError) as info:
        StageOutput(out).merge()
    message = str(info.value)
    assert "3 of 4 shards" in message and "shard 2/4" in message and "shard 3/4" in message and "shard 4/4" in message
    assert "missing" in message and not out.exists()
    assert main(["merge", "--output", str(out)]) == 2
    with pytest.raises(ConfigError, match="no shard files"):
        StageOutput(tmp_path / "other.jsonl").merge()


def test_merge_of_document_stages_checks_done_files(tmp_path):
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"_id": f"doc{i}", "title": "T", "text": f"Sentence {i}. Another one."}
                                                 for i in range(6)])
    for i in (1, 2):
        assert main(["chunk", "--input", str(docs), "--output", str(tmp_path / "p.jsonl"), "--shard", f"{i}/2"]) == 0
    result = StageOutput(tmp_path / "p.jsonl").merge()
    assert result.lines == 6 and result.report is None
    (tmp_path / "p.shard-00001-of-00002.jsonl.done").write_text('"doc0"\n')
    with pytest.raises(ConfigError, match=r"\.done"):
        StageOutput(tmp_path / "p.jsonl").merge()


def test_dense_mining_with_tiny_model(tmp_path, tiny_model_dir):
    data = beir_folder(tmp_path / "beir", n_queries=4)
    assert main(["mine", "--data", str(data), "--method", "dense", "--model", tiny_model_dir, "--num-negatives", "5",
                 "--cache-dir", str(tmp_path / "cache"), "--output", str(tmp_path / "d.jsonl")]) == 0
    rows = read(tmp_path / "d.jsonl")
    assert len(rows) == 4 and all(len(r["neg"]) == 5 and r["pos_ids"][0] not in r["neg_ids"] for r in rows)
    assert list((tmp_path / "cache").glob("*.npy"))


def test_a_model_retrained_in_place_is_a_changed_input_for_dense_mining_and_the_teacher(tmp_path, tiny_model_dir,
                                                                                       capsys):
    """Issue 34: mine --method dense and filter --method teacher keyed the model by its path, so a model retrained
    in place (same folder, new weights) reused the old output; an operational change (batch size) still reuses."""
    import shutil

    import torch
    from transformers import BertModel

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    data = beir_folder(tmp_path / "beir", n_queries=4)
    mine = ["mine", "--data", str(data), "--method", "dense", "--model", str(model), "--num-negatives", "3",
            "--output", str(tmp_path / "d.jsonl")]
    teacher = ["filter", "--method", "teacher", "--model", str(model), "--input", str(tmp_path / "d.jsonl"),
               "--output", str(tmp_path / "f.jsonl"), "--no-progress"]
    assert main(mine) == 0 and main(teacher) == 0
    capsys.readouterr()
    assert main(mine + ["--batch-size", "7"]) == 0 and main(teacher + ["--batch-size", "7"]) == 0  # operational
    assert capsys.readouterr().out.count("nothing to do") == 2
    retrained = BertModel.from_pretrained(model)
    with torch.no_grad():
        for p in retrained.parameters():
            p.add_(0.01)
    retrained.save_pretrained(model)  # same path, new weights
    for argv in (mine, teacher):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "model" in err and "other settings or inputs" in err and "--overwrite" in err, err


def test_ray_engine_without_the_scale_extra_is_a_clear_error(monkeypatch, capsys, tmp_path):
    """Where `robustir[scale]` is not installed (CI), `--engine ray` names the extra instead of a traceback."""
    import importlib.util

    from robustir.cli.main import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("ray", "lance_ray") else real(name, *a))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"_id": "d1", "text": "x"}\n')
    assert main(["encode", "--engine", "ray", "--input", str(corpus), "--output", str(tmp_path / "v.lance")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'robustir[scale]'" in err and "ray" in err
