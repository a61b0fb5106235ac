"""False-negative removal: teacher margin, passage sieve, LLM judge (through ``robustir filter``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from robustir.cli.main import main
from robustir.errors import ConfigError, DataError
from robustir.filtering import teacher as teacher_module
from robustir.filtering.sieve import SieveConfig, sieve_decision, sieve_negatives
from robustir.filtering.teacher import TeacherFilterConfig, load_teacher, margin_reason, teacher_filter


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class TableTeacher:
    """Scores looked up from the passage text: ``"<score>|..."``."""

    def __init__(self) -> None:
        self.calls = 0

    def score(self, queries, passages):
        self.calls += 1
        return np.array([float(p.split("|")[0]) for p in passages])


def test_margin_rules():
    assert margin_reason(0.96, 1.0, None, 0.05) == "teacher_relative_margin"
    assert margin_reason(0.95, 1.0, None, 0.05) is None  # equal to pos * (1 - r): kept
    assert margin_reason(0.85, 1.0, 0.2, None) == "teacher_absolute_margin"
    assert margin_reason(0.8, 1.0, 0.2, None) is None
    assert margin_reason(-1.0, -2.0, None, 0.05) == "teacher_relative_margin"  # above a negative positive
    assert margin_reason(-2.2, -2.0, None, 0.05) is None


def test_teacher_filter_hand_made_case(tmp_path):
    rows = [
        {"query": "q1", "pos": ["1.0|pos a", "0.9|pos b"], "neg": ["0.2|far", "0.88|too close", "0.9|pos b", "0.85|ok"],
         "neg_scores": [1, 2, 3, 4], "neg_ids": ["n1", "n2", "n3", "n4"], "qid": "x",
         "removed": [{"text": "earlier", "reason": "llm_judge"}]},
        {"query": "q2", "pos": ["0.5|p"], "neg": []},
        {"query": "q3", "pos": ["0.5|p"], "neg": ["0.49|close"]},
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    original = source.read_bytes()
    report = teacher_filter(source, tmp_path / "out.jsonl", TeacherFilterConfig(relative_margin=0.05, progress=False),
                            teacher=TableTeacher())
    assert source.read_bytes() == original
    out = read(tmp_path / "out.jsonl")
    # positive score = min(1.0, 0.9) = 0.9 -> threshold 0.855: 0.88 goes, 0.85 stays
    assert out[0]["neg"] == ["0.2|far", "0.85|ok"] and out[0]["neg_scores"] == [1, 4] and out[0]["neg_ids"] == ["n1", "n4"]
    assert out[0]["qid"] == "x"
    assert [r["reason"] for r in out[0]["removed"]] == ["llm_judge", "teacher_relative_margin", "equals_positive"]
    assert out[0]["removed"][1]["score"] == pytest.approx(0.88)
    assert out[1]["neg"] == [] and out[2]["neg"] == [] and out[2]["removed"][0]["reason"] == "teacher_relative_margin"
    assert (report.removed, report.kept, report.queries_with_removals) == (3, 2, 2)
    assert report.removed_by_reason == {"equals_positive": 1, "teacher_relative_margin": 2}
    assert report.queries_left_without_negatives == 1
    saved = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    assert saved["removed"] == 3 and saved["scores"]["kept"]["count"] == 2
    # absolute margin, no removed list; never the input, never a complete output without overwrite
    teacher_filter(source, tmp_path / "abs.jsonl", TeacherFilterConfig(absolute_margin=0.1, relative_margin=None,
                                                                       keep_removed=False, progress=False),
                   teacher=TableTeacher())
    first = read(tmp_path / "abs.jsonl")[0]
    assert first["neg"] == ["0.2|far"] and first["removed"] == [{"text": "earlier", "reason": "llm_judge"}]
    with pytest.raises(ConfigError, match="never overwrite"):
        teacher_filter(source, source, teacher=TableTeacher())
    with pytest.raises(ConfigError, match="already exists"):
        teacher_filter(source, tmp_path / "out.jsonl", teacher=TableTeacher())


def test_teacher_filter_resumes_after_crash(tmp_path, monkeypatch):
    rows = [{"query": f"q{i}", "pos": ["1.0|p"], "neg": [f"0.{i}|n", "0.99|close"]} for i in range(7)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    teacher_filter(source, tmp_path / "ref.jsonl", TeacherFilterConfig(batch_records=2, progress=False),
                   teacher=TableTeacher())

    class Crashing(teacher_module.ResumableJsonlWriter):
        def write(self, record):
            if self.count >= 3:
                raise RuntimeError("crash")
            super().write(record)

    monkeypatch.setattr(teacher_module, "ResumableJsonlWriter", Crashing)
    with pytest.raises(RuntimeError):
        teacher_filter(source, tmp_path / "out.jsonl", TeacherFilterConfig(batch_records=2, progress=False),
                       teacher=TableTeacher())
    monkeypatch.undo()
    report = teacher_filter(source, tmp_path / "out.jsonl", TeacherFilterConfig(batch_records=2, progress=False),
                            teacher=TableTeacher())
    assert report.resumed == 3 and report.records == 4
    assert (tmp_path / "out.jsonl").read_text() == (tmp_path / "ref.jsonl").read_text()


def test_teacher_filter_with_embedding_model_and_cli(tmp_path, minilm_path, capsys):
    positive = "Aspirin reduces the risk of heart attack in adults with cardiovascular disease."
    rows = [{"query": "Does aspirin prevent heart attacks?", "pos": [positive],
             "neg": ["The Eiffel Tower is in Paris.", "Aspirin lowers the risk of heart attacks in adults with "
                                                      "cardiovascular disease.", "Bananas are rich in potassium."]}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    assert main(["filter", "--method", "teacher", "--input", str(source), "--output", str(tmp_path / "o.jsonl"),
                 "--model", minilm_path, "--max-length", "64", "--no-progress"]) == 0
    assert "1 removed" in capsys.readouterr().out
    out = read(tmp_path / "o.jsonl")[0]
    assert out["neg"] == ["The Eiffel Tower is in Paris.", "Bananas are rich in potassium."]
    assert main(["filter", "--method", "teacher", "--input", str(source), "--output", str(tmp_path / "o.jsonl"),
                 "--model", minilm_path, "--max-length", "64", "--batch-size", "8"]) == 0  # batch size: operational
    assert "nothing to do" in capsys.readouterr().out
    assert main(["filter", "--method", "teacher", "--input", str(source), "--output", str(tmp_path / "o.jsonl"),
                 "--model", minilm_path]) == 2  # another max_length: the output is not reused
    assert "max_length: 64 -> null" in capsys.readouterr().err
    assert main(["filter", "--method", "teacher", "--input", str(source), "--output", str(source)]) == 2


def test_cross_encoder_teacher(tmp_path, minilm_path):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    folder = tmp_path / "tiny-ce"
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64, num_labels=1)
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    teacher = load_teacher(str(folder), max_length=32)
    assert type(teacher).__name__ == "CrossEncoder"
    scores = teacher.score(["a question", "a question"], ["first passage", "second passage"])
    assert scores.shape == (2,) and np.all((scores > 0) & (scores < 1))  # sigmoid of one logit
    rows = [{"query": "a question", "pos": ["first passage"], "neg": ["second passage", "third passage"]}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    report = teacher_filter(source, tmp_path / "o.jsonl", TeacherFilterConfig(absolute_margin=10.0,
                                                                              relative_margin=None, progress=False),
                            teacher=teacher)
    assert report.removed == 2  # a margin of 10 removes everything: scores are only in (0, 1)


class VectorEncoder:
    """Fake encoder: texts are ``"name"`` looked up in a table of 2-d vectors (the query is [1, 0])."""

    def __init__(self, table: dict[str, list[float]]) -> None:
        self.table = table

    def encode(self, texts, kind="passage", **kwargs):
        return np.array([self.table.get(t, [1.0, 0.0]) for t in texts], dtype=np.float32)


def angle(degrees: float) -> list[float]:
    return [float(np.cos(np.radians(degrees))), float(np.sin(np.radians(degrees)))]


def test_sieve_mean_rule_hand_made(tmp_path):
    # cosines to the query: pos 1.0 (0 deg), a 0.98 (11.5 deg), b 0.5, c 0.0, d -0.5 -> mean over pos+4 = 0.396
    table = {"pos": angle(0), "a": [0.98, float(np.sqrt(1 - 0.98 ** 2))], "b": angle(60), "c": angle(90),
             "d": angle(120), "e": angle(30)}
    keep, cos, pos_cos = sieve_decision(np.array([1.0, 0.0]), np.array(table["pos"]),
                                        np.array([table[k] for k in "abcd"]), wanted=10)
    assert keep == ["sieve", "sieve", None, None] and pos_cos == pytest.approx(1.0)
    assert cos == pytest.approx([0.98, 0.5, 0.0, -0.5], abs=1e-6)
    # a tie with the mean is kept, unless strict: pool {pos 1, x 0, y 0.5} has mean 0.5 = cos(y)
    tie = np.array([angle(90), angle(60)])
    assert sieve_decision(np.array([1.0, 0.0]), np.array(angle(0)), tie, 5)[0] == [None, None]
    assert sieve_decision(np.array([1.0, 0.0]), np.array(angle(0)), tie, 5, strict=True)[0] == [None, "sieve"]
    # all removed -> the lowest-scored candidate is kept
    alike = np.array([angle(0), angle(0)])
    assert sieve_decision(np.array([1.0, 0.0]), np.array(angle(90)), alike, 5)[0] in ([None, "sieve"], ["sieve", None])

    rows = [{"query": "q", "pos": ["pos"], "neg": ["a", "pos", "b", "c", "d", "e"], "neg_ids": [1, 2, 3, 4, 5, 6]}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    original = source.read_bytes()
    # num_negatives 1 -> pool = first 2 non-positive negatives (a, b); c, d, e are beyond the pool
    report = sieve_negatives(source, tmp_path / "s1.jsonl", SieveConfig(num_negatives=1, progress=False),
                             encoder=VectorEncoder(table))
    out = read(tmp_path / "s1.jsonl")[0]
    # pool {pos 1.0, a 0.98, b 0.5}: mean 0.827 -> a removed, b kept
    assert out["neg"] == ["b"] and out["neg_ids"] == [3]
    assert {r["text"]: r["reason"] for r in out["removed"]} == {"a": "sieve", "pos": "equals_positive",
                                                                 "c": "beyond_pool", "d": "beyond_pool",
                                                                 "e": "beyond_pool"}
    assert report.removed_by_reason == {"beyond_pool": 3, "equals_positive": 1, "sieve": 1}
    # num_negatives 2 -> pool a, b, c, d: a, b removed; c, d kept; e beyond
    sieve_negatives(source, tmp_path / "s2.jsonl", SieveConfig(num_negatives=2, progress=False),
                    encoder=VectorEncoder(table))
    assert read(tmp_path / "s2.jsonl")[0]["neg"] == ["c", "d"]
    # more survivors than wanted: the first ones in the record's order are kept
    rows2 = [{"query": "q", "pos": ["pos"], "neg": ["c", "d", "a"]}]
    src2 = write_jsonl(tmp_path / "in2.jsonl", rows2)
    rep = sieve_negatives(src2, tmp_path / "s3.jsonl", SieveConfig(num_negatives=2, progress=False),
                          encoder=VectorEncoder(table))
    assert read(tmp_path / "s3.jsonl")[0]["neg"] == ["c", "d"] and rep.removed_by_reason == {"sieve": 1}
    rep = sieve_negatives(src2, tmp_path / "s4.jsonl", SieveConfig(num_negatives=1, progress=False),
                          encoder=VectorEncoder(table))
    assert read(tmp_path / "s4.jsonl")[0]["neg"] == ["c"]  # pool c, d (both kept by the sieve), a beyond it
    assert rep.removed_by_reason == {"beyond_pool": 1, "over_limit": 1}
    assert source.read_bytes() == original
    saved = json.loads((tmp_path / "s1.jsonl.report.json").read_text())
    sims = saved["details"]["similarities"]
    assert sims["kept"] == [0.5] and sims["removed"] == [0.98] and sims["positive"] == [1.0]
    assert Path(saved["details"]["plot"]).stat().st_size > 1000
    with pytest.raises(ConfigError, match="never overwrite"):
        sieve_negatives(source, source, SieveConfig(progress=False), encoder=VectorEncoder(table))


def test_sieve_without_an_encoder_needs_its_trainer(tmp_path, tiny_model_dir):
    # the filters sit below the trainer: the training sieve is robustir.training.sieve's, and the bare pass over
    # the file says so instead of training through an import that points back up
    source = write_jsonl(tmp_path / "in.jsonl", [{"query": "q", "pos": ["p"], "neg": ["a", "b"]}])
    with pytest.raises(ConfigError, match="robustir.training.sieve.sieve_negatives"):
        sieve_negatives(source, tmp_path / "out.jsonl", SieveConfig(model=str(tiny_model_dir), progress=False))
    assert not (tmp_path / "out.jsonl").exists()
    from robustir.training.sieve import sieve_negatives as sieve_with_training

    called = []

    def trainer(input_path, config, work_dir):
        called.append(Path(input_path).name)
        return str(tiny_model_dir), {"model": str(tiny_model_dir)}

    report = sieve_negatives(source, tmp_path / "out.jsonl", SieveConfig(model=str(tiny_model_dir), progress=False),
                             trainer=trainer)
    assert called == ["in.jsonl"] and report.records == 1
    assert sieve_with_training.__module__ == "robustir.training.sieve"


def test_sieve_cli_no_train_and_brief_training(tmp_path, tiny_model_dir):
    rows = [{"query": f"question {i} about cells", "pos": [f"cells answer {i}"],
             "neg": [f"other passage {j} on topic {i}" for j in range(6)]} for i in range(6)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    assert main(["filter", "--method", "sieve", "--input", str(source), "--output", str(tmp_path / "nt.jsonl"),
                 "--model", tiny_model_dir, "--no-train", "--num-negatives", "3", "--no-progress"]) == 0
    out = read(tmp_path / "nt.jsonl")
    assert all(1 <= len(r["neg"]) <= 3 for r in out)
    assert main(["filter", "--method", "sieve", "--input", str(source), "--output", str(tmp_path / "t.jsonl"),
                 "--model", tiny_model_dir, "--num-negatives", "3", "--max-steps", "2", "--no-progress",
                 "train_batch_size=2", "train_negatives=2", "query_max_length=16", "passage_max_length=16"]) == 0
    saved = json.loads((tmp_path / "t.jsonl.report.json").read_text())
    assert saved["details"]["training"]["steps"] == 2
    assert (tmp_path / "t.jsonl.sieve-work" / "train" / "model").is_dir()


def test_sieve_overwrite_with_another_beta_trains_its_work_model_again(tmp_path, tiny_model_dir):
    """``--overwrite --beta 0.9`` after a run with beta 0.02 trains the sieve's work model with 0.9; the same beta
    reuses it. (On 5245875 the 0.02 model was reused and the report named both betas.)"""
    rows = [{"query": f"question {i} about cells", "pos": [f"cells answer {i}"],
             "neg": [f"other passage {j} on topic {i}" for j in range(6)]} for i in range(6)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    args = ["filter", "--method", "sieve", "--input", str(source), "--output", str(tmp_path / "t.jsonl"),
            "--model", tiny_model_dir, "--num-negatives", "3", "--max-steps", "2", "--no-progress",
            "train_batch_size=2", "train_negatives=2", "query_max_length=16", "passage_max_length=16"]
    work_model = tmp_path / "t.jsonl.sieve-work" / "train" / "model" / "model.safetensors"

    def trained(beta: float) -> tuple[dict, bytes]:
        assert main([*args, "--overwrite", f"beta={beta}"]) == 0
        report = json.loads((tmp_path / "t.jsonl.report.json").read_text())
        return report["details"]["training"], work_model.read_bytes()

    first, weights = trained(0.02)
    again, same = trained(0.02)
    assert again["loss"]["beta"] == 0.02 and same == weights  # reused, not trained again
    other, changed = trained(0.9)
    assert other["loss"]["beta"] == 0.9 and changed != weights


def test_filter_malformed_input_names_file_and_line(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"query": "q", "pos": ["1|p"], "neg": []}\n{"query": "q", "pos": ["1|p"], "neg": "x"}\n')
    with pytest.raises(DataError) as info:
        teacher_filter(source, tmp_path / "o.jsonl", TeacherFilterConfig(progress=False), teacher=TableTeacher())
    assert "bad.jsonl" in str(info.value) and "line 2" in str(info.value) and "'neg'" in str(info.value)
    assert not (tmp_path / "o.jsonl").exists()


def test_every_reader_of_the_training_format_refuses_the_same_record(tmp_path):
    # One validator (data/training_data.py:check_record): training, mining, the teacher filter, the LLM
    # judge and pre-training pairs all refuse "pos" given as a single string, naming file, line and field.
    from fake_llm_server import FakeLLMServer

    from robustir.data.training_data import load_training_data
    from robustir.llm import LLMClient, LLMConfig
    from robustir.filtering.llm_judge import judge_negatives
    from robustir.negatives.mining import load_jsonl_for_mining
    from robustir.pretraining.pretrain import read_pairs

    source = tmp_path / "bad.jsonl"
    source.write_text('{"query": "a", "pos": ["x"], "neg": ["y"]}\n{"query": "b", "pos": "text", "neg": ["z"]}\n')
    messages = []
    with FakeLLMServer(lambda m: "No") as server, LLMClient(LLMConfig(base_url=server.url, model="fake-model")) as client:
        for read in (load_training_data, load_jsonl_for_mining, lambda p: list(read_pairs(p)),
                     lambda p: teacher_filter(p, tmp_path / "t.jsonl", TeacherFilterConfig(progress=False),
                                              teacher=TableTeacher()),
                     lambda p: judge_negatives(p, tmp_path / "j.jsonl", client, progress=False)):
            with pytest.raises(DataError) as info:
                read(source)
            messages.append(str(info.value))
    assert len(set(messages)) == 1, messages
    assert "bad.jsonl" in messages[0] and "line 2" in messages[0] and "'pos'" in messages[0]
    assert "single string" in messages[0]


def test_llm_filter_cli_with_fake_server(tmp_path, capsys):
    from fake_llm_server import FakeLLMServer, last_user

    rows = [{"query": "q1", "pos": ["p1"], "neg": ["RELEVANT one", "unrelated", "p1"]},
            {"query": "q2", "pos": ["p2"], "neg": ["nothing"]}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    with FakeLLMServer(lambda m: "Yes" if "RELEVANT" in last_user(m) else "No") as server:
        assert main(["filter", "--method", "llm", "--input", str(source), "--output", str(tmp_path / "o.jsonl"),
                     "--base-url", server.url, "--model", "fake-model", "--no-progress"]) == 0
    out = read(tmp_path / "o.jsonl")
    assert out[0]["neg"] == ["unrelated"] and out[1]["neg"] == ["nothing"]
    assert [r["reason"] for r in out[0]["removed"]] == ["llm_judge", "equals_positive"]
    assert json.loads((tmp_path / "o.jsonl.report.json").read_text())["removed"] == 1


def test_teacher_filter_suspect_positives(tmp_path):
    rows = [
        # the positive is outscored by 3 of 4 negatives (> 0.5): removed; the record is kept with no positive
        {"query": "q1", "pos": ["0.1|wrong pos"], "pos_ids": ["p1"], "neg": ["0.3|a", "0.4|b", "0.5|c", "0.05|d"],
         "neg_ids": ["a", "b", "c", "d"]},
        # two positives: only the outscored one goes, and the margin rule then uses the trusted one (0.9)
        {"query": "q2", "pos": ["0.9|good", "0.2|bad"], "pos_ids": ["g", "b"], "pos_scores": [1.0, 2.0],
         "neg": ["0.3|x", "0.4|y", "0.88|close"]},
        # exactly half the negatives above: kept (the rule needs more than the share)
        {"query": "q3", "pos": ["0.35|p"], "neg": ["0.3|x", "0.4|y"]},
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    report = teacher_filter(source, tmp_path / "out.jsonl",
                            TeacherFilterConfig(suspect_positive_share=0.5, progress=False), teacher=TableTeacher())
    out = read(tmp_path / "out.jsonl")
    assert out[0]["pos"] == [] and out[0]["pos_ids"] == [] and out[0]["neg"] == rows[0]["neg"]
    assert out[0]["removed"] == [{"text": "0.1|wrong pos", "reason": "suspect_positive", "positive": True}]
    assert out[1]["pos"] == ["0.9|good"] and out[1]["pos_ids"] == ["g"] and out[1]["pos_scores"] == [1.0]
    assert out[1]["neg"] == ["0.3|x", "0.4|y"]  # 0.88 is within 5 % of 0.9
    assert out[2]["pos"] == ["0.35|p"]
    assert (report.positives_removed, report.records_without_positives) == (2, 1)
    # training skips the record without positives; a later filter passes it on unchanged
    from robustir.data.training_data import load_training_data

    examples, stats = load_training_data(tmp_path / "out.jsonl")
    assert len(examples) == 2 and stats["skipped_empty"] == 1
    teacher_filter(tmp_path / "out.jsonl", tmp_path / "again.jsonl", TeacherFilterConfig(progress=False),
                   teacher=TableTeacher())
    assert read(tmp_path / "again.jsonl")[0] == out[0]
    with pytest.raises(ConfigError, match="suspect_positive_share"):
        TeacherFilterConfig(suspect_positive_share=1.5).validate()


def test_random_like_rule_is_the_audits_random_p_value():
    from robustir.filtering.teacher import random_like_positives

    randoms = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])  # 9 random passages
    # p-value (1 + #{r >= s}) / (1 + R): 0.95 -> 1/10, 0.85 -> 2/10, 0.05 -> 10/10
    scores = [0.95, 0.85, 0.05]
    assert random_like_positives(scores, np.tile(randoms, (3, 1)), 0.15) == [None, "random_like_positive",
                                                                             "random_like_positive"]
    assert random_like_positives(scores, np.tile(randoms, (3, 1)), 0.25) == [None, None, "random_like_positive"]
    assert random_like_positives(scores, np.tile(randoms, (3, 1)), None) is None
    # a random passage that is the positive itself is not counted: 0.85 against the other 8 -> (1 + 1) / 9 = 0.22
    own = np.zeros((3, 9), dtype=bool)
    own[1, 7] = True  # the 0.8 passage "is" the second positive
    assert random_like_positives(scores, np.tile(randoms, (3, 1)), 0.25, own)[1] is None
    assert random_like_positives([0.8], randoms[None], 0.25, own[1:2])[0] is None  # own column excluded
    assert random_like_positives([0.8], randoms[None], 0.25)[0] == "random_like_positive"  # 3 / 10


def test_teacher_filter_drops_random_like_positives_and_keeps_the_rest(tmp_path):
    rows = [{"query": f"q{i}", "pos": [f"0.9{i}|clean {i}"], "neg": [f"0.{i}|n{i}a", f"0.{i}5|n{i}b"]}
            for i in range(1, 9)]
    rows[3]["pos"] = ["0.12|planted random positive"]  # scores like a random passage of the file
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    config = TeacherFilterConfig(random_like_share=0.3, random_passages=50, progress=False)
    report = teacher_filter(source, tmp_path / "out.jsonl", config, teacher=TableTeacher())
    out = read(tmp_path / "out.jsonl")
    assert out[3]["pos"] == [] and out[3]["removed"][-1] == {"text": "0.12|planted random positive",
                                                             "reason": "random_like_positive", "positive": True}
    assert all(r["pos"] for i, r in enumerate(out) if i != 3)
    assert report.positives_removed == 1 and report.removed_by_reason["random_like_positive"] == 1
    # judging positives alone: the same verdicts, negatives untouched and never scored
    class PairCounter(TableTeacher):
        pairs = 0

        def score(self, queries, passages):
            PairCounter.pairs += len(passages)
            return super().score(queries, passages)

    alone = teacher_filter(source, tmp_path / "alone.jsonl",
                           TeacherFilterConfig(relative_margin=None, random_like_share=0.3, random_passages=50,
                                               progress=False), teacher=PairCounter())
    assert [r["pos"] for r in read(tmp_path / "alone.jsonl")] == [r["pos"] for r in out]
    assert [r["neg"] for r in read(tmp_path / "alone.jsonl")] == [r["neg"] for r in rows] and alone.removed == 0
    assert PairCounter.pairs == 8 * (1 + 24)  # each positive and the 24 random passages, no negative
    # the sample of random passages is seeded: the same file and seed give the same sample
    from robustir.filtering.teacher import sample_passages

    assert sample_passages(source, 5, 0) == sample_passages(source, 5, 0) != sample_passages(source, 5, 1)
    assert len(sample_passages(source, 1000, 0)) == 8 + 16  # every distinct passage when the file has fewer
    # a file too small for the share: refused, not every positive dropped
    with pytest.raises(ConfigError, match="random_like_share"):
        teacher_filter(source, tmp_path / "small.jsonl", TeacherFilterConfig(random_like_share=0.01, progress=False),
                       teacher=TableTeacher())
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ConfigError, match="random_like_share"):
            TeacherFilterConfig(random_like_share=bad).validate()
