"""Hybrid retrieval: reciprocal rank fusion (robustir.index.fusion) and ``robustir eval --mode dense|lexical|hybrid``."""

from __future__ import annotations

import pytest

from robustir.cli.main import main as cli_main
from robustir.errors import ConfigError
from robustir.evaluation.retrieval import EvalConfig, evaluate, fuse_runs
from robustir.data.beir import load_beir
from robustir.index.fusion import FusionConfig, reciprocal_rank_fusion
from test_serving_index import write_beir  # a BEIR folder of helpers.DOCS / QUERIES

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_rrf_by_hand():
    dense, lexical = ["a", "b", "c"], ["c", "d", "a"]
    fused = dict(reciprocal_rank_fusion([dense, lexical], k=60))
    assert fused["a"] == pytest.approx(1 / 61 + 1 / 63)
    assert fused["c"] == pytest.approx(1 / 63 + 1 / 61)
    assert fused["b"] == pytest.approx(1 / 62) and fused["d"] == pytest.approx(1 / 62)
    # equal scores: the first list's order first (a before c, b before d), the same every time
    assert [doc for doc, _ in reciprocal_rank_fusion([dense, lexical], k=60)] == ["a", "c", "b", "d"]
    # weights: a lexical-only fusion is the lexical order
    assert [d for d, _ in reciprocal_rank_fusion([dense, lexical], [0.0, 1.0], top_k=3)] == ["c", "d", "a"]
    assert reciprocal_rank_fusion([dense, lexical], top_k=2) == reciprocal_rank_fusion([dense, lexical])[:2]
    with pytest.raises(ValueError, match="2 lists but 1 weights"):
        reciprocal_rank_fusion([dense, lexical], [1.0])


def test_fusion_options_are_checked_and_generated_as_flags():
    with pytest.raises(ConfigError, match="fusion.rrf_k = 0 is out of range"):
        EvalConfig(fusion={"rrf_k": 0})
    with pytest.raises(ConfigError, match="mode: 'sparse' is not one of"):
        EvalConfig(mode="sparse")
    assert EvalConfig(fusion={"dense_weight": 2}).fusion == FusionConfig(dense_weight=2.0)


def test_hybrid_run_is_the_fusion_of_the_dense_and_lexical_runs(tmp_path, tiny_model_dir):
    data = write_beir(tmp_path / "beir")
    config = dict(top_k=5, show_progress=False, fusion={"candidates": 5})
    dense = evaluate(tiny_model_dir, data, "test", EvalConfig(mode="dense", **config)).run
    lexical = evaluate(tiny_model_dir, data, "test", EvalConfig(mode="lexical", **config)).run
    assert lexical == evaluate("bm25", data, "test", EvalConfig(**config)).run  # --model bm25 = --mode lexical
    hybrid = evaluate(tiny_model_dir, data, "test", EvalConfig(mode="hybrid", **config))
    assert hybrid.run == fuse_runs(dense, lexical, EvalConfig(**config))
    for qid, hits in hybrid.run.items():
        ranked = sorted(hits, key=lambda d: -hits[d])
        expected = reciprocal_rank_fusion([sorted(dense[qid], key=lambda d: -dense[qid][d]),
                                           sorted(lexical[qid], key=lambda d: -lexical[qid][d])], k=60, top_k=5)
        assert ranked == [doc for doc, _ in expected]
    assert hybrid.run != dense and hybrid.run != lexical
    assert set(hybrid.metrics) == set(evaluate(tiny_model_dir, data, "test", EvalConfig(**config)).metrics)


def test_cli_modes(tmp_path, tiny_model_dir, capsys):
    data = write_beir(tmp_path / "beir")
    for mode in ("dense", "lexical", "hybrid"):
        out = tmp_path / mode
        assert cli_main(["eval", "--model", tiny_model_dir, "--data", str(data), "--mode", mode, "--top-k", "5",
                         "--candidates", "5", "--no-show-progress", "--output", str(out)]) == 0
        assert (out / "run.trec").exists()
    text = capsys.readouterr().out
    assert "bm25 (rrf)" in text
    assert cli_main(["eval", "--data", str(data), "--mode", "hybrid", "--rrf-k", "0"]) == 2
    assert "rrf_k = 0 is out of range" in capsys.readouterr().err


def test_cli_eval_through_a_search_index(tmp_path, tiny_model_dir, capsys):
    from robustir.index.store import IndexConfig, SearchIndex

    data = write_beir(tmp_path / "beir")
    SearchIndex.build(tmp_path / "idx", tiny_model_dir, data, config=IndexConfig(show_progress=False))[0].close()
    for mode in ("dense", "lexical", "hybrid"):
        assert cli_main(["eval", "--data", str(data), "--search-index", str(tmp_path / "idx"), "--mode", mode,
                         "--top-k", "5", "--output", str(tmp_path / mode)]) == 0
        assert f"via {tmp_path / 'idx'} ({mode})" in capsys.readouterr().out
    # the same ranking as the in-memory engines for dense (both exact inner product)
    dense = evaluate(tiny_model_dir, data, "test", EvalConfig(top_k=5, show_progress=False)).run
    through = evaluate(None, data, "test", EvalConfig(top_k=5, search_index=str(tmp_path / "idx"),
                                                      show_progress=False)).run
    assert {q: list(d) for q, d in dense.items()} == {q: list(d) for q, d in through.items()}
    assert cli_main(["eval", "--data", str(data), "--search-index", str(tmp_path / "idx"), "--pooling", "mean"]) == 2
    assert "encoder options come from the index's manifest" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="holds 6 documents, the corpus of the dataset"):
        other = write_beir(tmp_path / "other")
        with open(other / "corpus.jsonl", "a", encoding="utf-8") as handle:
            handle.write('{"_id": "d7", "title": "", "text": "one more"}\n')
        evaluate(None, other, "test", EvalConfig(search_index=str(tmp_path / "idx"), show_progress=False))


def test_eval_hybrid_fuses_as_deep_as_search_does(tmp_path, tiny_model_dir):
    """Issue 36: eval --mode hybrid fused 1000-deep lists while /search fuses fusion.candidates-deep ones (71.81 vs
    71.71 NDCG@10 on SciFact). One depth now: eval's hybrid ranking is /search's, in memory and through an index."""
    from robustir.index.store import IndexConfig, SearchIndex

    data = write_beir(tmp_path / "beir")
    fusion = {"candidates": 2}
    SearchIndex.build(tmp_path / "idx", tiny_model_dir, data, config=IndexConfig(show_progress=False))[0].close()
    in_memory = evaluate(tiny_model_dir, data, "test", EvalConfig(mode="hybrid", fusion=fusion, show_progress=False))
    through = evaluate(None, data, "test", EvalConfig(mode="hybrid", fusion=fusion, search_index=str(tmp_path / "idx"),
                                                      show_progress=False))
    index = SearchIndex.open(tmp_path / "idx", model=tiny_model_dir)
    with index:
        for qid, text in load_beir(data, "test").queries.items():
            served = [h.id for h in index.search(text, top_k=2, mode="hybrid", fusion=FusionConfig(candidates=2))[0]]
            for run in (in_memory.run, through.run):
                assert sorted(run[qid], key=lambda d: -run[qid][d])[:2] == served, qid
