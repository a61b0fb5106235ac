"""``robustir audit``: the rate estimator, the streamed audit, the report files, the recommendation, train --loss auto."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from robustir.audit import AuditConfig, audit, estimate_rates, hard_rate, random_rate, recommend
from robustir.audit.checks import TextChecks, degenerate_reasons, normalize
from robustir.audit.estimate import null_tail
from robustir.audit.recommend import loss_from_audit, measured_loss
from robustir.errors import ConfigError, DataError

pytestmark = pytest.mark.usefixtures("single_torch_thread")


# ------------------------------------------------------------------------------------------ the estimator

def _synthetic(rate_random: float, rate_hard: float, n: int, seed: int, k: int = 200):
    """Scores drawn from known components: clean pairs beat random passages and mostly the pool; random nulls
    are uniform among random passages; hard nulls sit where the planted hard nulls do."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice(3, size=n, p=[1 - rate_random - rate_hard, rate_random, rate_hard])
    u = np.where(kinds == 1, (1 + rng.integers(0, k + 1, n)) / (k + 1), (1 + rng.integers(0, 3, n)) / (k + 1))
    clean_gap = rng.normal(-0.05, 0.1, n)
    hard_gap = rng.normal(0.12, 0.1, n)
    random_gap = rng.normal(0.5, 0.1, n)
    gap = np.choose(kinds, [clean_gap, random_gap, hard_gap])
    nulls = {"hard_null": rng.normal(0.12, 0.1, n),  # gaps alone: u = 0, as a hard null's is small
             "random_null_gap": np.stack([rng.normal(0.5, 0.1, n), (1 + rng.integers(0, k + 1, n)) / (k + 1)], 1),
             "reference": rng.normal(-0.05, 0.1, 400)}
    return u, gap, nulls


@pytest.mark.parametrize("rate", [0.0, 0.2, 0.4])
def test_random_rate_recovers_a_known_share(rate):
    u, _, _ = _synthetic(rate, 0.0, 5000, seed=1)
    assert random_rate(u, 200) == pytest.approx(rate, abs=0.03)


def test_null_tail_is_the_exact_share_of_a_uniform_rank():
    assert null_tail(1) == 0.5  # u in {1/2, 1}: one of two over 0.5
    assert null_tail(200) == pytest.approx(101 / 201)  # j = 100..200 of 0..200


@pytest.mark.parametrize("random_share,hard_share", [(0.0, 0.0), (0.0, 0.3), (0.2, 0.2), (0.4, 0.0)])
def test_estimate_recovers_known_random_and_hard_shares(random_share, hard_share):
    u, gap, nulls = _synthetic(random_share, hard_share, 4000, seed=2)
    est = estimate_rates(u, gap, k=200, hard_null=nulls["hard_null"], random_null_gap=nulls["random_null_gap"],
                         reference=nulls["reference"], bootstrap=200, seed=0)
    assert est.random_like == pytest.approx(random_share, abs=0.03)
    assert est.hard_like == pytest.approx(hard_share, abs=0.05)
    assert est.rate == pytest.approx(random_share + hard_share, abs=0.06)
    assert est.low <= est.rate <= est.high
    assert not est.upper_bound


@pytest.mark.parametrize("near_gap, readable", [(0.12, True), (-0.04, False)])
def test_near_misses_are_read_only_where_the_teacher_separates_them_from_true_positives(near_gap, readable):
    """Issue 50: near-miss nulls that sit where trusted positives do (a teacher that confuses its nearest passage with
    the answer) give no estimate and a plain "unknown, not 0"; well separated ones give the share."""
    from robustir.audit.estimate import near_miss_reading

    rng = np.random.default_rng(5)
    u, gap, nulls = _synthetic(0.0, 0.3, 4000, seed=5)
    near = estimate_rates(u, gap, k=200, hard_null=rng.normal(near_gap, 0.1, 4000),
                          random_null_gap=nulls["random_null_gap"], reference=nulls["reference"], bootstrap=50)
    reading = near_miss_reading(near)
    assert reading["readable"] is readable and near.lower_bound is (not readable)  # a rate without it is a floor
    if readable:
        assert reading["hard_like"] == pytest.approx(0.3, abs=0.05) and "near misses read" in reading["why"]
    else:
        assert "unknown, not 0" in reading["why"] and reading["separation"] < 0.2


def test_without_a_reference_the_hard_share_is_an_upper_bound():
    u, gap, nulls = _synthetic(0.0, 0.0, 4000, seed=3)
    with_ref = estimate_rates(u, gap, k=200, hard_null=nulls["hard_null"], random_null_gap=nulls["random_null_gap"],
                              reference=nulls["reference"], bootstrap=0)
    without = estimate_rates(u, gap, k=200, hard_null=nulls["hard_null"], random_null_gap=nulls["random_null_gap"],
                             reference=None, bootstrap=0)
    assert without.upper_bound and "upper bound" in without.text()
    assert without.hard_like > with_ref.hard_like + 0.05  # the clean pairs' misses are counted


def test_the_bootstrap_interval_narrows_with_more_pairs():
    widths = []
    for n in (300, 3000):
        u, gap, nulls = _synthetic(0.2, 0.0, n, seed=4)
        est = estimate_rates(u, gap, k=200, hard_null=nulls["hard_null"], random_null_gap=nulls["random_null_gap"],
                             reference=nulls["reference"], bootstrap=300, seed=1)
        widths.append(est.random_like_high - est.random_like_low)
    assert widths[1] < widths[0] / 2


def test_hard_rate_is_not_identifiable_when_nulls_look_like_trusted_pairs():
    same = np.linspace(-0.1, 0.1, 101)
    pi_h, _, _ = hard_rate(same, same, np.ones(10), same, 0.0)
    assert np.isnan(pi_h)


# ------------------------------------------------------------------------------------------ text checks

def test_degenerate_reasons():
    reasons = {r for r, _ in degenerate_reasons("  ?? ", ["ok passage with enough words here"], [], min_query_words=2,
                                                min_passage_words=5)}
    assert reasons == {"empty_query"}
    reasons = [r for r, _ in degenerate_reasons("What is X?", ["what is x", "too short"], ["What  is X", ""],
                                                min_query_words=2, min_passage_words=5)]
    assert sorted(reasons) == sorted(["short_positive", "query_equals_positive", "short_positive",
                                      "negative_equals_positive", "empty_negative"])
    assert normalize("What  is X?!") == "what is x"


def test_duplicates_and_reuse_are_counted_over_all_records():
    checks = TextChecks()
    rows = [("q one", ["p"]), ("Q one!", ["p"]), ("q one", ["other"]), ("q two", ["p"]), ("q three", ["z"])]
    for i, (q, pos) in enumerate(rows):
        checks.add(i, q, pos)
    same_record, same_query = checks.duplicates()
    assert same_record == {1: 0}
    assert same_query == {2: 0}
    assert checks.reused_positives(2) == {0: 3, 1: 3, 3: 3}
    assert checks.reused_positives(3) == {}


# ------------------------------------------------------------------------------------------ the streamed audit

def _world(tmp_path: Path, n: int = 40, fp_share: float = 0.25, seed: int = 0) -> tuple[Path, set[int]]:
    """A training JSONL whose positives share words with their queries; ``fp_share`` of them replaced by another
    record's passage. Returns the file and the lines with a planted false positive."""
    rng = random.Random(seed)
    topics = [f"topic{i} alpha{i} beta{i} gamma{i}" for i in range(n)]
    passages = [f"{t} is described in this passage with words about {t.split()[1]} and more text" for t in topics]
    planted = set(rng.sample(range(n), int(n * fp_share)))
    lines = []
    for i, topic in enumerate(topics):
        positive = passages[(i + n // 2) % n] if i in planted else passages[i]
        negatives = [passages[(i + d) % n] for d in (1, 2, 3)]
        lines.append(json.dumps({"query": f"what about {topic}", "pos": [positive], "neg": negatives}))
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, {i + 1 for i in planted}


def _config(data: Path, out: Path, **kw) -> AuditConfig:
    return AuditConfig(**{"data": str(data), "output": str(out), "progress": False, "bootstrap": 50,
                          "random_passages": 20, **kw})


@pytest.fixture(scope="module")
def tiny_encoder(tiny_model_dir):
    from robustir.models.encoder import Encoder

    return Encoder.from_pretrained(tiny_model_dir)


def test_streamed_in_small_blocks_equals_all_at_once(tmp_path, tiny_encoder, monkeypatch):
    """Blocks of 3 records, pool chunks of 2 queries and a folder of 3 files give the report of one block over one
    file: the streaming changes nothing."""
    import robustir.audit.pool as pool
    import robustir.audit.run as run

    data, _ = _world(tmp_path)
    whole = audit(_config(data, tmp_path / "whole"), encoder=tiny_encoder).report
    folder = tmp_path / "parts"
    folder.mkdir()
    lines = data.read_text().splitlines(keepends=True)
    for i, start in enumerate((0, 13, 27)):
        (folder / f"part{i}.jsonl").write_text("".join(lines[start:[13, 27, 40][i]]))
    monkeypatch.setattr(run._Audit, "block", 3)
    monkeypatch.setattr(pool._Pool, "chunk", 2)
    monkeypatch.setattr(pool._Pool, "depth", 2)  # the fallback past the top-k is taken too
    parts = audit(_config(folder, tmp_path / "blocks"), encoder=tiny_encoder).report
    for key in ("records", "pairs", "negatives", "scored_pairs", "false_negatives", "distributions", "flagged_share"):
        assert parts[key] == whole[key], key
    assert parts["false_positives"]["estimate"] == whole["false_positives"]["estimate"]


def test_the_statistics_match_a_brute_force_computation(tmp_path, tiny_encoder):
    """The random p-value and the gap of every pair, recomputed with full matrices, give the same estimate."""
    from robustir.audit.run import _Audit

    data, _ = _world(tmp_path)
    config = _config(data, tmp_path / "out")
    job = _Audit(config, tiny_encoder)
    job.out.mkdir(parents=True)
    job.counts = {}
    with open(tmp_path / "other", "w") as job.other:
        job.read()
        job.pool()
        scored = job.score()
    q = job.queries
    p = job.passages
    pool = p.of(job.pool_.texts)
    rand = p.of(job.random_texts)
    for pair in scored["pairs"]:
        record = pair["record"]
        qv = q.of([record.query])[0].astype(np.float64)
        s = float(p.of([record.pos[pair["positive"]]])[0].astype(np.float64) @ qv)
        positives = [normalize(x) for x in record.pos]
        keep = [i for i, t in enumerate(job.pool_.texts) if not any(normalize(t) in x for x in positives)]
        assert pair["gap"] == pytest.approx(float((pool[keep].astype(np.float64) @ qv).max()) - s, abs=1e-5)
        own = np.array([normalize(t) == normalize(record.pos[pair["positive"]]) for t in job.random_texts])
        above = (rand.astype(np.float64) @ qv >= s) & ~own
        assert pair["u"] == pytest.approx((1 + int(above.sum())) / (len(job.random_texts) + 1 - int(own.sum())))


def test_report_files_and_flags_point_at_lines(tmp_path, tiny_encoder):
    data, _ = _world(tmp_path)
    with open(data, "a") as handle:  # a degenerate record and a duplicate of line 1
        handle.write(json.dumps({"query": "x", "pos": ["x"], "neg": []}) + "\n")
        handle.write(data.read_text().splitlines()[0] + "\n")
    result = audit(_config(data, tmp_path / "out"), encoder=tiny_encoder)
    out = tmp_path / "out"
    for name in ("report.json", "report.md", "audit.png", "flagged.jsonl", "run.json"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "report.json").read_text())
    assert report["records"] == 42 and report["pairs"] == 42
    assert report["degenerate"] == {"short_query": 1, "short_positive": 1, "query_equals_positive": 1}
    assert report["duplicates"]["duplicate_record"] == 1
    flags = [json.loads(line) for line in (out / "flagged.jsonl").read_text().splitlines()]
    lines = data.read_text().splitlines()
    for flag in flags:
        record = json.loads(lines[flag["line"] - 1])
        if flag["kind"] == "false_positive":
            assert flag["text"] in record["pos"]
        if flag["kind"] == "false_negative":
            assert flag["text"] in record["neg"]
    dup = next(f for f in flags if f["reason"] == "duplicate_record")
    assert (dup["line"], dup["first"]["line"]) == (42, 1)
    md = (out / "report.md").read_text()
    assert "## Recommendation" in md and result.recommendation["loss"] in md
    assert result.report["recommendation"]["command"].startswith("robustir train --train-data")
    near = report["false_positives"]["near_miss"]  # issue 50: near misses read, or said to be unknown
    assert isinstance(near["readable"], bool) and near["why"] in md and "**Near misses**" in md
    if not near["readable"]:
        assert near["why"] in report["false_positives"]["text"] and "near_miss" in report["recommendation"]["unknown"]


def test_a_rerun_is_reused_and_an_edited_input_is_audited_again(tmp_path, tiny_encoder):
    data, _ = _world(tmp_path)
    first = audit(_config(data, tmp_path / "out"), encoder=tiny_encoder)
    assert not first.already_complete
    again = audit(_config(data, tmp_path / "out"), encoder=tiny_encoder)
    assert again.already_complete and again.report == first.report
    with open(data, "a") as handle:
        handle.write(json.dumps({"query": "a new query here", "pos": ["a new passage with several words"]}) + "\n")
    edited = audit(_config(data, tmp_path / "out"), encoder=tiny_encoder)
    assert not edited.already_complete and edited.report["records"] == first.report["records"] + 1


def test_sampling_bounds_the_scored_records_and_reads_every_record(tmp_path, tiny_encoder):
    data, _ = _world(tmp_path, n=40)
    report = audit(_config(data, tmp_path / "out", max_records=10), encoder=tiny_encoder).report
    assert report["records"] == 40 and report["scored_records"] == 10 and report["sampled"]


def test_leakage_into_the_evaluation_split(tmp_path, tiny_encoder):
    data, _ = _world(tmp_path, n=30)
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    first = json.loads(data.read_text().splitlines()[0])
    docs = [{"_id": "d0", "title": "", "text": first["pos"][0]}] + [
        {"_id": f"d{i}", "title": "", "text": f"unrelated document number {i} about nothing in particular"}
        for i in range(1, 30)]
    (beir / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (beir / "queries.jsonl").write_text(json.dumps({"_id": "q0", "text": first["query"].upper() + " ?"}) + "\n")
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq0\td0\t1\n")
    report = audit(_config(data, tmp_path / "out", eval_data=str(beir)), encoder=tiny_encoder).report
    assert report["leakage"]["query_in_eval"] == 1  # the same query, up to case and punctuation
    assert report["leakage"]["positive_in_eval"] >= 1
    assert report["reference"]["pairs"] == 1 and not report["false_positives"]["estimate"]["upper_bound"]
    assert any("evaluation" in w for w in report["recommendation"]["warnings"])


def test_bad_input_is_a_clear_error(tmp_path, tiny_encoder):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "q", "pos": ["p"]}) + "\n" + json.dumps({"query": "q", "pos": "p"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl.*line 2.*pos"):
        audit(_config(bad, tmp_path / "out"), encoder=tiny_encoder)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"query": "q", "pos": []}) + "\n")
    with pytest.raises(DataError, match="empty positive list"):
        audit(_config(empty, tmp_path / "out2"), encoder=tiny_encoder)
    with pytest.raises(DataError, match="not found"):
        audit(_config(tmp_path / "missing.jsonl", tmp_path / "out3"), encoder=tiny_encoder)
    data, _ = _world(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        audit(_config(data, tmp_path / "file"), encoder=tiny_encoder)
    with pytest.raises(ConfigError, match="unknown option"):
        from robustir.config import load_config

        load_config(AuditConfig, None, ["random_pasages=10", "data=x", "output=y"], {})


def test_cli_prints_the_recommendation(tmp_path, tiny_model_dir, capsys):
    from robustir.cli.main import main

    data, _ = _world(tmp_path)
    code = main(["audit", "--data", str(data), "--output", str(tmp_path / "out"), "--model", tiny_model_dir,
                 "--no-progress", "--random-passages", "20", "bootstrap=40"])
    printed = capsys.readouterr().out
    assert code == 0 and "recommendation: --loss" in printed and "false positives:" in printed
    # a typo in a flag fails at once
    assert main(["audit", "--data", str(data), "--output", str(tmp_path / "out2"), "--random-pasages", "20"]) == 2
    assert "Did you mean --random-passages?" in capsys.readouterr().err
    assert main(["audit", "--data", str(data), "--output", str(tmp_path / "out3"), "random_pasages=20"]) == 2
    assert "did you mean 'random_passages'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ the recommendation

def _report(rate: float, low: float, high: float, **extra) -> dict:
    return {"data": "train.jsonl", "config": {"max_positive_reuse": 20},
            "false_positives": {"estimate": {"rate": rate, "low": low, "high": high, "upper_bound": False}},
            "false_negatives": {"share_of_records": 0.0}, **extra}


def test_recommendation_never_calls_data_clean_when_near_misses_cannot_be_read():
    """Issue 50 item 4: 0 % random-like false positives with near misses the teacher cannot read is "unknown", with
    the LLM judge of positives to find them -- not "0 %, your data is clean"."""
    near = {"readable": False, "why": "near misses cannot be read by this teacher: ... their share is unknown, not 0"}
    report = _report(0.0, 0.0, 0.02)
    report["false_positives"].update(near_miss=near)
    report["false_positives"]["estimate"].update(random_like=0.0, random_like_high=0.01, hard_like=None,
                                                 hard_nulls=800)
    rec = recommend(report)
    assert rec["unknown"] == ["near_miss"] and "unknown, not 0" in rec["reason"]
    assert "the teacher scores hard nulls like trusted positives" in rec["reason"]
    assert any("--judge-positives" in item for item in rec["also"])
    readable = _report(0.0, 0.0, 0.02)
    readable["false_positives"]["near_miss"] = {"readable": True, "why": "near misses read: 1.0 %"}
    assert recommend(readable)["unknown"] == [] and not recommend(readable)["also"]


def test_recommendation_per_noise_kind():
    """Random-like false positives call for the recipe; hard-like ones alone for the plain loss (no method protected
    against them, the recipe's filter does not catch them) and the LLM judge of positives."""
    random = _report(0.31, 0.27, 0.35)
    random["false_positives"]["estimate"].update(random_like=0.30, random_like_high=0.34, hard_like=0.01,
                                                 hard_like_high=0.03)
    assert recommend(random)["loss"] == "peg" and recommend(random)["filter_positives"]
    hard = _report(0.31, 0.17, 0.44)
    hard["false_positives"]["estimate"].update(random_like=0.005, random_like_high=0.01, hard_like=0.306,
                                               hard_like_high=0.43)
    rec = recommend(hard)
    assert rec["loss"] == "infonce" and not rec["filter_positives"] and "hard-like" in rec["reason"]
    assert any("--judge-positives" in item for item in rec["also"])


def test_recommendation_rule():
    assert recommend(_report(0.01, 0.0, 0.04))["loss"] == "infonce"
    assert recommend(_report(0.03, 0.0, 0.12))["loss"] == "peg"  # clean-looking, but the interval reaches 12 %
    rec = recommend(_report(0.31, 0.27, 0.35))
    assert rec["loss"] == "peg" and rec["config_line"] == "loss: peg, filter_positives: true"
    assert rec["filter_positives"] is True
    assert "31 %" in rec["reason"] and f"{measured_loss('infonce', 0.31):.2f}" in rec["reason"]
    assert rec["command"] == "robustir train --train-data train.jsonl --loss peg --filter-positives"
    assert recommend(_report(0.01, 0.0, 0.04))["filter_positives"] is False
    assert recommend(_report(float("nan"), float("nan"), float("nan")))["loss"] == "peg"
    fn = recommend(_report(0.0, 0.0, 0.02, false_negatives={"share_of_records": 0.3}))
    assert fn["loss"] == "infonce" and "filter --method teacher" in fn["also"][0]
    leak = recommend(_report(0.0, 0.0, 0.02, leakage={"query_in_eval": 3}))
    assert "3 training queries" in leak["warnings"][0]


def test_measured_loss_follows_the_table():
    from robustir.audit.recommend import MEASURED

    assert measured_loss("infonce", 0.4) == pytest.approx(MEASURED["infonce"][2])
    assert measured_loss("robust", 0.2) == pytest.approx(MEASURED["robust"][1])
    assert measured_loss("robust", 0.1) == pytest.approx(MEASURED["robust"][1] / 2)
    assert measured_loss("robust", 0.4) < measured_loss("infonce", 0.4) / 2  # why the recipe is recommended


def test_train_loss_auto_takes_the_audit_recommendation(tmp_path, tiny_encoder):
    """``loss: auto`` is resolved by the train step (resolve_recipe, the first thing train() does), not when the
    config is built: building a config reads nothing from disk."""
    from robustir.training.arguments import TrainConfig
    from robustir.training.trainer import resolve_recipe

    data, _ = _world(tmp_path)
    result = audit(_config(data, tmp_path / "audit"), encoder=tiny_encoder)
    unresolved = TrainConfig(train_data=str(data), loss="auto", audit=str(tmp_path / "audit"))
    assert unresolved.loss == "auto"  # the constructor does not read the audit
    config = resolve_recipe(unresolved)
    assert config.loss == result.recommendation["loss"] and resolve_recipe(config) == config
    assert config.filter_positives == result.recommendation["filter_positives"]
    with pytest.raises(ConfigError, match="needs audit"):
        TrainConfig(train_data=str(data), loss="auto")  # no audit named: refused when the config loads
    with pytest.raises(ConfigError, match="no complete audit"):
        resolve_recipe(TrainConfig(train_data=str(data), loss="auto", audit=str(tmp_path / "nothing")))
    with pytest.raises(ConfigError, match="not the training data"):
        resolve_recipe(TrainConfig(train_data=str(tmp_path / "other.jsonl"), loss="auto",
                                   audit=str(tmp_path / "audit")))
    with pytest.raises(ConfigError, match="no complete audit"):  # train() resolves first, before any output
        from robustir.training.trainer import train

        train(TrainConfig(train_data=str(data), loss="auto", audit=str(tmp_path / "nothing"),
                          output=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()
    assert loss_from_audit(str(tmp_path / "audit"), "auto", str(data))[0] == config.loss
    # the same path with other content: refused (issue 35)
    data.write_text(data.read_text() + json.dumps({"query": "a new query", "pos": ["a new passage"]}) + "\n")
    with pytest.raises(ConfigError, match="before it changed"):
        resolve_recipe(TrainConfig(train_data=str(data), loss="auto", audit=str(tmp_path / "audit")))


# ------------------------------------------------------------------------------------------ the real model

@pytest.mark.slow
def test_planted_random_false_positives_on_scifact_with_the_bundled_model(tmp_path, minilm_path, scifact_dir):
    """160 SciFact training queries, 40 of them given a random corpus passage as positive: the real teacher's
    estimate brackets the planted share and its flags are mostly the planted pairs."""
    from helpers import scifact_with_planted_positives

    path = tmp_path / "train.jsonl"
    planted = scifact_with_planted_positives(scifact_dir, path, 160, 40)
    from robustir.models.encoder import Encoder

    teacher = Encoder.from_pretrained(minilm_path, query_max_length=64, passage_max_length=96)
    report = audit(_config(path, tmp_path / "out", random_passages=100), encoder=teacher).report
    pairs = report["pairs"]
    planted_share = 40 / pairs
    est = report["false_positives"]["estimate"]
    assert est["random_like_low"] <= planted_share <= est["random_like_high"]
    assert est["random_like"] == pytest.approx(planted_share, abs=0.1)
    flags = [json.loads(x) for x in (tmp_path / "out" / "flagged.jsonl").read_text().splitlines()]
    random_like = {f["line"] for f in flags if f["reason"] == "random_like"}
    hits = len(random_like & {i + 1 for i in planted})
    assert hits >= 30 and hits / max(1, len(random_like)) >= 0.8
