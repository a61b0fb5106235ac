"""Hostile input to every stage, through the CLI in-process: each case names what it tries, the exit code it must
end with, a substring of the message, and that no traceback escapes (an exception leaving ``main`` fails the test).

Classes (issue 11): 1 numbers out of range, 2 paths, 3 output = input, 4 a folder that is not a model,
5 records, 6 valid input that must be accepted (byte-order mark, CRLF). Stale runs (7), the sampler hang (8) and
unsafe loads (10) are in tests/test_resume_safety.py; LLM replies and failures (9) in tests/test_llm_failures.py.
"""

from __future__ import annotations

import errno
import gzip
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from robustir.cli.main import main, path_error

pytestmark = pytest.mark.usefixtures("single_torch_thread")

from helpers import DOCS, QUERIES  # noqa: E402  (tests/ is on sys.path)


def _beir(folder: Path, *, bom: bool = False, crlf: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    end = "\r\n" if crlf else "\n"
    mark = "\ufeff" if bom else ""
    (folder / "corpus.jsonl").write_text(mark + end.join(json.dumps({"_id": i, "title": t, "text": x})
                                                          for i, t, x in DOCS) + end, encoding="utf-8")
    (folder / "queries.jsonl").write_text(mark + end.join(json.dumps({"_id": i, "text": x}) for i, x in QUERIES) + end,
                                          encoding="utf-8")
    (folder / "qrels").mkdir(exist_ok=True)
    rows = [f"q{i}\td{i}\t1" for i in range(1, 5)]
    for split in ("train", "test"):
        (folder / "qrels" / f"{split}.tsv").write_text(
            mark + end.join(["query-id\tcorpus-id\tscore", *rows]) + end, encoding="utf-8")
    return folder


def _train_rows(n: int = 8) -> list[dict]:
    return [{"query": QUERIES[i % 4][1] + f" ({i})", "pos": [DOCS[i % 6][2]], "neg": [DOCS[(i + 3) % 6][2]]}
            for i in range(n)]


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad-inputs")
    data = _beir(root / "beir")
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _train_rows()), encoding="utf-8")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "title": t, "text": x}) + "\n" for i, t, x in DOCS), encoding="utf-8")
    nan = root / "nan.jsonl"
    nan.write_text(json.dumps({"query": "q", "pos": ["p"], "neg": ["n"], "pos_scores": [1.0]}).replace(
        "[1.0]", "[NaN]") + "\n", encoding="utf-8")
    small = root / "small.jsonl"
    small.write_text("".join(json.dumps(r) + "\n" for r in _train_rows(3)), encoding="utf-8")
    plain = root / "file.txt"
    plain.write_text("a plain file\n", encoding="utf-8")
    empty_dir = root / "empty-dir"
    empty_dir.mkdir()
    config_dir = root / "config-dir"
    config_dir.mkdir()
    pipeline = root / "pipeline.yaml"
    pipeline.write_text(f"corpus: {data}\nwork_dir: {root / 'pipeline'}\nqueries: {{source: beir}}\n", encoding="utf-8")
    latin1 = root / "latin1.yaml"
    latin1.write_bytes("lr: 2e-5 # \xe9t\xe9\n".encode("latin-1"))
    # the second campaign (bench/hostile_campaign.py)
    not_gzip = root / "plain.jsonl.gz"
    not_gzip.write_bytes(train.read_bytes())
    cut_gzip = root / "cut.jsonl.gz"
    cut_gzip.write_bytes(gzip.compress(train.read_bytes() * 20)[:80])
    half = _beir(root / "beir-half")
    (half / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t0.5\nq2\td2\t1\n", encoding="utf-8")
    empty = root / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    dup = root / "dup.yaml"
    dup.write_text("lr: 1e-5\nbatch_size: 4\nlr: 1e-3\n", encoding="utf-8")
    template = root / "latin1-template.txt"
    template.write_bytes("Write {n} questions about {text} (caf\xe9).\n".encode("latin-1"))
    damaged = {}
    for name, broken, content in (("badconfig", "config.json", b"{not json"), ("badweights", "model.safetensors", b"\0" * 64)):
        folder = root / f"model-{name}"
        shutil.copytree(tiny_model_dir, folder)
        (folder / broken).write_bytes(content)
        damaged[name] = str(folder)
    # issue 35: valid JSON that is no text -- a lone surrogate -- or that the parser cannot take: 3,000 levels deep, a
    # 5,000-digit number; in a BEIR corpus (index, eval), a training file (train, audit, filter)
    defects = {"surrogate": '"ab\\ud800c"', "deep": "[" * 3000 + "]" * 3000, "bignum": "9" * 5000}
    for name, value in defects.items():
        folder = _beir(root / f"beir-{name}")
        corpus = (folder / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
        corpus[1] = corpus[1][:-1] + f', "extra": {value}}}'
        (folder / "corpus.jsonl").write_text("\n".join(corpus) + "\n", encoding="utf-8")
        damaged[f"corpus_{name}"] = str(folder)
        rows = [json.dumps(r) for r in _train_rows()]
        rows[2] = rows[2][:-1] + f', "extra": {value}}}'
        (root / f"train-{name}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
        damaged[f"train_{name}"] = str(root / f"train-{name}.jsonl")
    (root / "train-surrogate-text.jsonl").write_text(
        (root / "train.jsonl").read_text(encoding="utf-8").replace('"query": "', '"query": "\\udfff', 1),
        encoding="utf-8")
    damaged["train_surrogate_text"] = str(root / "train-surrogate-text.jsonl")
    bomb = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    bomb += [f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")]
    (root / "bomb.yaml").write_text("\n".join(bomb) + "\n", encoding="utf-8")  # 9^9 values in 1 kB
    (root / "cycle.yaml").write_text("a: &a [*a]\n", encoding="utf-8")
    (root / "deep.yaml").write_text("a: " + "[" * 5000 + "]" * 5000 + "\n", encoding="utf-8")
    damaged.update({name: str(root / f"{name}.yaml") for name in ("bomb", "cycle", "deep")})
    return {"data": str(data), "train": str(train), "docs": str(docs), "nan": str(nan), "small": str(small),
            "file": str(plain), "dir": str(empty_dir), "cfgdir": str(config_dir), "latin1": str(latin1), "pipeline": str(pipeline),
            "tiny": tiny_model_dir, "root": str(root), "not_gzip": str(not_gzip), "cut_gzip": str(cut_gzip),
            "half": str(half), "empty": str(empty), "dup": str(dup), "latin1_template": str(template), **damaged}


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        return int(exc.code or 0)


# (case id, argv with {placeholders}, exit code, substring of stderr)
CASES = [
    # --- 1. numbers out of range -------------------------------------------------------------------------------
    ("eval-batch-0", ["eval", "--model", "{tiny}", "--data", "{data}", "--batch-size", "0"], 2, "batch_size = 0"),
    ("eval-batch-negative", ["eval", "--model", "{tiny}", "--data", "{data}", "--batch-size", "-1"], 2,
     "batch_size = -1"),
    ("eval-top-k-negative", ["eval", "--model", "bm25", "--data", "{data}", "--top-k", "-5"], 2, "top_k = -5"),
    ("eval-nprobe-0", ["eval", "--model", "{tiny}", "--data", "{data}", "--index", "ivf", "--nprobe", "0"], 2,
     "nprobe = 0"),
    ("eval-max-length-0", ["eval", "--model", "{tiny}", "--data", "{data}", "--query-max-length", "0"], 2,
     "query_max_length = 0"),
    ("eval-max-length-above-model", ["eval", "--model", "{tiny}", "--data", "{data}", "--passage-max-length", "861"],
     2, "use at most 128"),
    ("encode-batch-0", ["encode", "--model", "{tiny}", "--input", "{data}/corpus.jsonl", "--output", "{out}/e",
                        "--batch-size", "0"], 2, "batch_size = 0"),
    ("rerank-batch-0", ["rerank-eval", "--model", "{tiny}", "--data", "{train}", "--batch-size", "0"], 2,
     "batch_size = 0"),
    ("mine-negatives-0", ["mine", "--data", "{data}", "--output", "{out}/m.jsonl", "--num-negatives", "0"], 2,
     "num_negatives = 0"),
    ("mine-batch-0", ["mine", "--data", "{data}", "--output", "{out}/m.jsonl", "--method", "dense", "--model",
                      "{tiny}", "--batch-size", "0"], 2, "encode_batch_size = 0"),
    ("mine-min-above-max", ["mine", "--data", "{data}", "--output", "{out}/m.jsonl", "--min-score", "5",
                            "--max-score", "1"], 2, "min_score (5.0) is above max_score"),
    ("mine-relative-margin-2", ["mine", "--data", "{data}", "--output", "{out}/m.jsonl", "--relative-margin", "2"], 2,
     "relative_margin = 2 is out of range"),
    ("mine-relative-margin-negative", ["mine", "--input", "{train}", "--output", "{out}/m.jsonl",
                                       "--relative-margin", "-0.1"], 2, "relative_margin = -0.1"),
    ("filter-teacher-batch-0", ["filter", "--method", "teacher", "--input", "{train}", "--output", "{out}/f.jsonl",
                                "--model", "{tiny}", "--batch-size", "0"], 2, "batch_size = 0"),
    ("filter-teacher-margin-nan", ["filter", "--method", "teacher", "--input", "{train}", "--output",
                                   "{out}/f.jsonl", "--absolute-margin", "nan"], 2, "not a finite number"),
    ("filter-sieve-batch-0", ["filter", "--method", "sieve", "--input", "{train}", "--output", "{out}/f.jsonl",
                              "--batch-size", "0"], 2, "batch_size = 0"),
    ("filter-sieve-lr-negative", ["filter", "--method", "sieve", "--input", "{train}", "--output", "{out}/f.jsonl",
                                  "--lr", "-1"], 2, "lr = -1 is out of range"),
    ("chunk-overlap-above-chunk", ["chunk", "--input", "{docs}", "--output", "{out}/c.jsonl", "--max-tokens", "10",
                                   "--overlap", "20"], 2, "overlap (20 sentences) must be smaller"),
    ("chunk-max-tokens-0", ["chunk", "--input", "{docs}", "--output", "{out}/c.jsonl", "--max-tokens", "0"], 2,
     "max_tokens = 0"),
    ("chunk-shard-0", ["chunk", "--input", "{docs}", "--output", "{out}/c.jsonl", "--shard", "0/2"], 2, "shard"),
    ("pairs-repeat-0", ["pairs", "--input", "{docs}", "--output", "{out}/p.jsonl", "--repeat", "0"], 2,
     "repeat = 0"),
    ("pairs-factor-0", ["pairs", "--input", "{docs}", "--output", "{out}/p.jsonl", "max_pairs_factor=0"], 2,
     "max_pairs_factor = 0"),
    ("merge-shards-0", ["merge", "--output", "{out}/m.jsonl", "--shards", "0"], 2, "shards = 0"),
    ("train-lr-nan", ["train", "--train-data", "{train}", "--model", "{tiny}", "--output", "{out}/t", "--lr", "nan"],
     2, "lr = nan is not a finite number"),
    ("train-lr-negative", ["train", "--train-data", "{train}", "--model", "{tiny}", "--output", "{out}/t",
                           "--lr=-1e-5"], 2, "lr = -1e-5 is out of range"),
    ("train-max-steps-negative", ["train", "--train-data", "{train}", "--model", "{tiny}", "--output", "{out}/t",
                                  "--max-steps", "-3"], 2, "max_steps = -3"),
    ("train-epochs-0", ["train", "--train-data", "{train}", "--model", "{tiny}", "--output", "{out}/t",
                        "--epochs", "0"], 2, "epochs = 0"),
    ("train-save-steps-0", ["train", "--train-data", "{train}", "--model", "{tiny}", "--output", "{out}/t",
                            "save_steps=0"], 2, "save_steps = 0"),
    ("train-warmup-2", ["train", "--train-data", "{train}", "--model", "{tiny}", "--output", "{out}/t",
                        "warmup_ratio=2"], 2, "warmup_ratio = 2"),
    ("train-batch-0", ["train", "--train-data", "{train}", "--model", "{tiny}", "--output", "{out}/t",
                       "--batch-size", "0"], 2, "batch_size = 0"),
    ("pretrain-mask-ratio-negative", ["pretrain", "--data", "{docs}", "--model", "{tiny}", "--output", "{out}/p",
                                      "encoder_mask_ratio=-0.1"], 2, "encoder_mask_ratio = -0.1"),
    ("pretrain-lr-negative", ["pretrain", "--data", "{docs}", "--model", "{tiny}", "--output", "{out}/p",
                              "--lr", "-1"], 2, "lr = -1 is out of range"),
    ("pretrain-mask-range", ["pretrain", "--mode", "gur", "--data", "{train}", "--model", "{tiny}", "--output",
                             "{out}/p", "mask_ratio_range=[0.5,0.2]"], 2, "mask_ratio_range must be"),
    ("run-nested-range", ["run", "{pipeline}", "--until", "mine", "mine.index.nprobe=0"], 2,
     "mine.index.nprobe = 0"),
    ("run-train-lr-nan", ["run", "{pipeline}", "train.lr=nan"], 2, "train.lr = nan"),
    ("noise-bench-rate", ["noise-bench", "--data", "{data}", "--rates", "1.5", "--output", "{out}/nb"], 2,
     "rates must be in [0, 1]"),
    # --- 2. paths ----------------------------------------------------------------------------------------------
    ("chunk-output-under-file", ["chunk", "--input", "{docs}", "--output", "{file}/c.jsonl"], 2, "fix the path"),
    ("mine-output-under-file", ["mine", "--data", "{data}", "--output", "{file}/m.jsonl"], 2, "fix the path"),
    ("eval-output-under-file", ["eval", "--model", "bm25", "--data", "{data}", "--output", "{file}/e"], 2,
     "fix the path"),
    ("encode-output-under-file", ["encode", "--model", "{tiny}", "--input", "{data}/queries.jsonl", "--queries",
                                  "--output", "{file}/e"], 2, "fix the path"),
    ("train-output-under-file", ["train", "--train-data", "{train}", "--model", "{tiny}", "--output", "{file}/t",
                                 "--max-steps", "1", "--batch-size", "2"], 2, "fix the path"),
    ("pairs-input-missing", ["pairs", "--input", "{root}/nope.jsonl", "--output", "{out}/p.jsonl"], 2,
     "file not found"),
    ("filter-input-is-empty-folder", ["filter", "--method", "teacher", "--input", "{dir}", "--output",
                                      "{out}/f.jsonl"], 2, "is a folder; a filter reads one"),
    ("eval-data-is-file", ["eval", "--model", "bm25", "--data", "{file}"], 2, "{file}"),
    ("run-config-is-folder", ["run", "{cfgdir}"], 2, "is a folder"),
    ("train-config-latin1", ["train", "--config", "{latin1}"], 2, "not UTF-8"),
    # --- 3. output = input -------------------------------------------------------------------------------------
    ("mine-output-is-input", ["mine", "--input", "{train_copy}", "--output", "{train_copy}"], 2,
     "is the input"),
    ("mine-output-is-corpus", ["mine", "--input", "{train}", "--corpus", "{docs_copy}", "--output", "{docs_copy}"], 2,
     "is the input"),
    ("mine-output-in-beir-corpus", ["mine", "--data", "{data_copy}", "--output", "{data_copy}/corpus.jsonl"], 2,
     "is read from"),
    ("chunk-output-is-input", ["chunk", "--input", "{docs_copy}", "--output", "{docs_copy}"], 2, "is the input"),
    ("pairs-output-is-input", ["pairs", "--input", "{docs_copy}", "--output", "{docs_copy}"], 2, "is the input"),
    ("filter-output-is-input", ["filter", "--method", "teacher", "--input", "{train_copy}", "--output",
                                "{train_copy}"], 2, "is the input"),
    ("encode-output-is-input", ["encode", "--model", "{tiny}", "--input", "{out}/q.npy", "--output", "{out}/q"], 2,
     "is the input"),
    # --- 4. a folder that is not a model -----------------------------------------------------------------------
    ("eval-model-data-folder", ["eval", "--model", "{data}", "--data", "{data}"], 2, "holds no model"),
    ("encode-model-empty", ["encode", "--model", "{dir}", "--input", "{data}/corpus.jsonl", "--output", "{out}/e"],
     2, "holds no model"),
    ("mine-model-data-folder", ["mine", "--data", "{data}", "--method", "dense", "--model", "{data}", "--output",
                                "{out}/m.jsonl"], 2, "holds no model"),
    ("filter-teacher-not-model", ["filter", "--method", "teacher", "--input", "{train}", "--output", "{out}/f.jsonl",
                                  "--model", "{data}"], 2, "holds no model"),
    ("train-model-data-folder", ["train", "--train-data", "{train}", "--model", "{data}", "--output", "{out}/t"], 2,
     "holds no model"),
    ("pretrain-model-data-folder", ["pretrain", "--data", "{docs}", "--model", "{data}", "--output", "{out}/p"], 2,
     "holds no model"),
    ("train-model-typo-not-hub", ["train", "--train-data", "{train}", "--model", "{root}/no-such/model", "--output",
                                  "{out}/t"], 2, "not tried as a Hugging Face hub id"),
    ("eval-model-relative-typo", ["eval", "--model", "./runs/no-such-model", "--data", "{data}"], 2, "does not exist"),
    # --- 5. records --------------------------------------------------------------------------------------------
    ("train-nan-score", ["train", "--train-data", "{nan}", "--model", "{tiny}", "--output", "{out}/t"], 2,
     "not a finite number"),
    ("filter-nan-score", ["filter", "--method", "teacher", "--input", "{nan}", "--output", "{out}/f.jsonl",
                          "--model", "{tiny}"], 2, "not a finite number"),
    # === the second campaign (bench/hostile_campaign.py) ========================================================
    # 1. numbers: lengths above the model where the first round did not look
    ("pretrain-max-length-above-model", ["pretrain", "--data", "{docs}", "--model", "{tiny}", "--output", "{out}/p",
                                         "--max-length", "1000", "--max-steps", "1"], 2, "use at most 128"),
    ("train-passage-length-above-model", ["train", "--train-data", "{train}", "--model", "{tiny}", "--output",
                                          "{out}/t", "--no-mine", "train_passage_max_length=1000"], 2,
     "use at most 128"),
    # 2. paths: an output that cannot be the file a stage writes
    ("chunk-output-is-folder", ["chunk", "--input", "{docs}", "--output", "{dir}"], 2, "is a folder"),
    ("mine-output-is-folder", ["mine", "--data", "{data}", "--output", "{dir}"], 2, "is a folder"),
    ("mine-output-empty", ["mine", "--data", "{data}", "--output", ""], 2, "names no file"),
    ("mine-output-gz", ["mine", "--input", "{train}", "--output", "{out}/m.jsonl.gz"], 2, "written uncompressed"),
    ("encode-output-is-folder", ["encode", "--model", "{tiny}", "--input", "{data}/corpus.jsonl", "--output",
                                 "{dir}"], 2, "not a folder"),
    ("train-override-output-empty", ["train", "--train-data", "{train}", "--model", "{tiny}", "output="], 2,
     "output is empty"),
    ("generate-template-latin1", ["generate", "--input", "{docs}", "--output", "{out}/g.jsonl", "--model", "m",
                                  "--base-url", "http://127.0.0.1:9/v1", "--prompt-template", "{latin1_template}"], 2,
     "is not UTF-8"),
    # 3. output = input: a run folder over what the run reads
    ("train-output-is-model", ["train", "--train-data", "{train}", "--model", "{tiny_copy}", "--output",
                               "{tiny_copy}"], 2, "is the model folder"),
    ("train-output-inside-model", ["train", "--train-data", "{train}", "--model", "{tiny_copy}", "--output",
                                   "{tiny_copy}/run"], 2, "is inside the model folder"),
    ("train-output-is-training-data", ["train", "--train-data", "{data_copy}", "--model", "{tiny}", "--output",
                                       "{data_copy}"], 2, "is the training data"),
    ("pretrain-output-is-model", ["pretrain", "--data", "{docs}", "--model", "{tiny_copy}", "--output",
                                  "{tiny_copy}"], 2, "is the model folder"),
    # 4. a model folder whose files are damaged; an empty --model
    ("eval-model-damaged-config", ["eval", "--model", "{badconfig}", "--data", "{data}"], 2, "is not a valid JSON file"),
    ("eval-model-damaged-weights", ["eval", "--model", "{badweights}", "--data", "{data}"], 2, "cannot be loaded"),
    ("pretrain-model-damaged-weights", ["pretrain", "--data", "{docs}", "--model", "{badweights}", "--output",
                                        "{out}/p"], 2, "cannot be loaded"),
    ("eval-model-empty", ["eval", "--model", "", "--data", "{data}"], 2, "--model is empty"),
    ("train-model-empty", ["train", "--train-data", "{train}", "--model", "", "--output", "{out}/t"], 2,
     "model is empty"),
    # 5. records: .gz that is not gzip, qrels grades that are not integers, an empty file to filter
    ("train-not-gzip", ["train", "--train-data", "{not_gzip}", "--model", "{tiny}", "--output", "{out}/t"], 2,
     "is not gzip-compressed"),
    ("mine-cut-gzip", ["mine", "--input", "{cut_gzip}", "--output", "{out}/m.jsonl"], 2, "is a damaged gzip file"),
    ("eval-qrels-fraction", ["eval", "--model", "bm25", "--data", "{half}"], 2, "score '0.5' is not an integer"),
    ("generate-empty-input", ["generate", "--input", "{empty}", "--output", "{out}/g.jsonl", "--model", "m",
                              "--base-url", "http://127.0.0.1:9/v1", "--no-preflight"], 2, "no passages"),
    ("filter-llm-empty-input", ["filter", "--method", "llm", "--input", "{empty}", "--output", "{out}/j.jsonl",
                                "--model", "m", "--base-url", "http://127.0.0.1:9/v1", "preflight=false"], 2,
     "no records"),
    ("filter-teacher-empty-input", ["filter", "--method", "teacher", "--input", "{empty}", "--output",
                                    "{out}/f.jsonl", "--model", "{tiny}"], 2, "no records"),
    # 6. config files and flags: a key given twice, a section given a value, another method's flag
    ("train-config-duplicate-key", ["train", "--config", "{dup}"], 2, "option 'lr' is given twice (line 3)"),
    ("run-section-is-a-value", ["run", "{pipeline}", "--until", "corpus", "train=5"], 2,
     "train: is a section of options"),
    # 7. issue 35: a lone surrogate, nesting 3,000 deep, a 5,000-digit number -- a clear error before any work
    ("index-corpus-lone-surrogate", ["index", "--corpus", "{corpus_surrogate}", "--model", "{tiny}", "--output",
                                     "{out}/idx"], 2, "line 2, field 'extra': a lone UTF-16 surrogate"),
    ("index-corpus-too-deep", ["index", "--corpus", "{corpus_deep}", "--model", "{tiny}", "--output", "{out}/idx"], 2,
     "line 2: JSON nested too deeply"),
    ("index-corpus-long-number", ["index", "--corpus", "{corpus_bignum}", "--model", "{tiny}", "--output", "{out}/idx"],
     2, "line 2: a JSON number has more than 4,300 digits"),
    ("eval-corpus-lone-surrogate", ["eval", "--model", "bm25", "--data", "{corpus_surrogate}"], 2,
     "a lone UTF-16 surrogate"),
    ("train-lone-surrogate-in-query", ["train", "--train-data", "{train_surrogate_text}", "--model", "{tiny}",
                                       "--output", "{out}/t"], 2, "line 1, field 'query': a lone UTF-16 surrogate"),
    ("audit-too-deep", ["audit", "--data", "{train_deep}", "--model", "{tiny}", "--output", "{out}/a"], 2,
     "line 3: JSON nested too deeply"),
    ("audit-long-number", ["audit", "--data", "{train_bignum}", "--model", "{tiny}", "--output", "{out}/a"], 2,
     "line 3: a JSON number has more than 4,300 digits"),
    ("filter-lone-surrogate", ["filter", "--method", "teacher", "--input", "{train_surrogate}", "--output",
                               "{out}/f.jsonl", "--model", "{tiny}"], 2, "line 3, field 'extra': a lone UTF-16"),
    ("train-config-alias-bomb", ["train", "--config", "{bomb}"], 2, "expands to more than 100,000 values"),
    ("noise-bench-config-alias-cycle", ["noise-bench", "--config", "{cycle}"], 2, "expands to more than 100,000"),
    ("train-config-too-deep", ["train", "--config", "{deep}"], 2, "nested too deeply to read"),
    ("filter-flag-of-another-method", ["filter", "--method", "teacher", "--input", "{train}", "--output",
                                       "{out}/f.jsonl", "--beta", "0.5"], 2,
     "--method teacher does not use --beta (an option of --method sieve)"),
]


def _materialise(argv: list[str], env: dict[str, str], out: Path) -> list[str]:
    values = dict(env, out=str(out))
    if any("_copy}" in a for a in argv):  # cases that try to overwrite an input get a private copy of it
        values["train_copy"] = shutil.copy(env["train"], out / "train.jsonl")
        values["docs_copy"] = shutil.copy(env["docs"], out / "docs.jsonl")
        values["data_copy"] = shutil.copytree(env["data"], out / "beir")
        values["tiny_copy"] = shutil.copytree(env["tiny"], out / "tiny")
    if any("{out}/q.npy" in a for a in argv):
        (out / "q.npy").write_bytes(b"not really")
    return [a.format(**values) for a in argv]


@pytest.mark.parametrize("argv, code, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error(argv, code, message, env, tmp_path, capsys):
    argv = _materialise(argv, env, tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert run_cli(argv) == code
    err = capsys.readouterr().err
    assert message.format(**env) in err, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()[-1]) > 20  # one line that says something
    for path, content in before.items():  # no input was touched
        assert path.read_bytes() == content, f"{path} was modified"


def test_every_stage_has_a_case():
    stages = {c[1][0] for c in CASES}
    expected = {"chunk", "pairs", "mine", "filter", "eval", "encode", "rerank-eval", "merge", "train", "pretrain",
                "run", "noise-bench"}
    assert expected <= stages, expected - stages  # generate: tests/test_llm_failures.py (needs an endpoint)


# --- 6. valid input that must be accepted -----------------------------------------------------------------------

def test_byte_order_mark_and_crlf_are_accepted(tmp_path, capsys):
    data = _beir(tmp_path / "beir-bom", bom=True, crlf=True)
    assert run_cli(["eval", "--model", "bm25", "--data", str(data), "--output", str(tmp_path / "e")]) == 0
    metrics = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert metrics["ndcg@10"] > 0.5  # every query found its document: the ids were read without the BOM
    train = tmp_path / "bom.jsonl"
    train.write_text("\ufeff" + "".join(json.dumps(r) + "\r\n" for r in _train_rows()), encoding="utf-8")
    out = tmp_path / "mined.jsonl"
    assert run_cli(["mine", "--input", str(train), "--output", str(out), "--num-negatives", "2"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 8 and rows[0]["query"].startswith("does aspirin")
    config = tmp_path / "bom.yaml"
    config.write_text("\ufefftop_k: 5\n", encoding="utf-8")
    from robustir.config import load_config
    from robustir.evaluation.retrieval import EvalConfig

    assert load_config(EvalConfig, config).top_k == 5


def test_defaults_above_a_small_model_are_capped_not_refused(tiny_model_dir):
    from robustir.models.encoder import Encoder

    encoder = Encoder.from_pretrained(tiny_model_dir)  # 128 positions; the default passage length is 256
    assert encoder.config.passage_max_length == 128


def test_tokenizer_max_length_is_a_hint_not_a_limit(tiny_model_dir, tmp_path):
    """sentence-transformers writes its training length (e.g. 128) as the tokenizer's model_max_length: a longer
    length asked for explicitly is still allowed up to the position embeddings; a default is capped at the hint."""
    import shutil

    from robustir.errors import ConfigError
    from robustir.models.encoder import Encoder

    folder = tmp_path / "st-trained-at-64"
    shutil.copytree(tiny_model_dir, folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "model_max_length": 64}))
    assert Encoder.from_pretrained(folder, passage_max_length=128).config.passage_max_length == 128
    assert Encoder.from_pretrained(folder).config.passage_max_length == 64
    with pytest.raises(ConfigError, match="takes \\(128 tokens\\)"):
        Encoder.from_pretrained(folder, passage_max_length=129)


def test_unknown_record_fields_are_warned_once_per_file(tmp_path, caplog):
    from robustir.data.training_data import load_training_data

    path = tmp_path / "typo.jsonl"
    path.write_text("".join(json.dumps({"query": f"q{i}", "pos": ["p"], "negs": ["n"], "query_id": i}) + "\n"
                            for i in range(3)), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="robustir.data.training_data"):
        examples, _ = load_training_data(path)
    warnings = [r.getMessage() for r in caplog.records if "not training fields" in r.getMessage()]
    assert len(warnings) == 1 and "'negs' (did you mean 'neg'?)" in warnings[0] and "query_id" not in warnings[0]
    assert examples[0].neg == []


# --- 2 (unit). OS errors about a path, and a genuine bug -------------------------------------------------------

def test_os_errors_about_paths_become_one_line_and_bugs_keep_their_traceback(monkeypatch, capsys):
    assert "Permission denied" in path_error(PermissionError(errno.EACCES, "Permission denied", "/x/out.jsonl"))
    assert "read-only" in path_error(OSError(errno.EROFS, "Read-only file system", "/x"))
    assert path_error(OSError(errno.EACCES, "no file name")) is None  # not about a path the user gave
    import robustir.cli.evaluate as stage

    def bug(*args, **kwargs):
        raise OSError(errno.EBADF, "Bad file descriptor")  # no file name: a bug, shown with its traceback

    monkeypatch.setattr(stage, "evaluate", bug)
    with pytest.raises(OSError):
        main(["eval", "--model", "bm25"])

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", "/readonly/metrics.json")

    monkeypatch.setattr(stage, "evaluate", denied)
    assert main(["eval", "--model", "bm25"]) == 2
    assert "/readonly/metrics.json: Permission denied; check its permissions" in capsys.readouterr().err
    monkeypatch.setenv("ROBUSTIR_DEBUG", "1")
    with pytest.raises(PermissionError):
        main(["eval", "--model", "bm25"])


# --- 3 (encode). two outputs never share a file -----------------------------------------------------------------

def test_encode_outputs_with_different_suffixes_are_different_files(env, tmp_path):
    prefix = tmp_path / "emb"
    assert run_cli(["encode", "--model", env["tiny"], "--input", env["data"] + "/corpus.jsonl",
                    "--output", f"{prefix}.corpus"]) == 0
    assert run_cli(["encode", "--model", env["tiny"], "--input", env["data"] + "/queries.jsonl", "--queries",
                    "--output", f"{prefix}.queries"]) == 0
    import numpy as np

    assert np.load(f"{prefix}.corpus.npy").shape[0] == len(DOCS)
    assert np.load(f"{prefix}.queries.npy").shape[0] == len(QUERIES)


# --- 10 (umask). files are written with the process umask, like any other file ----------------------------------

def test_atomic_write_respects_the_umask(tmp_path):
    from robustir.io import write_json

    old = os.umask(0o022)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
        os.umask(0o077)
        write_json(tmp_path / "b.json", {"x": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o600


# --- 1 (API). the Python API gets the same checks as the CLI -----------------------------------------------------

def test_configs_check_ranges_when_built_in_python():
    from robustir.errors import ConfigError
    from robustir.filtering.teacher import TeacherFilterConfig
    from robustir.index.dense import DenseIndexConfig
    from robustir.negatives.mining import MiningConfig
    from robustir.training.arguments import TrainConfig

    with pytest.raises(ConfigError, match="warmup_ratio = 2"):
        TrainConfig(warmup_ratio=2)
    with pytest.raises(ConfigError, match="relative_margin = 2"):
        TeacherFilterConfig(relative_margin=2)
    with pytest.raises(ConfigError, match="nprobe = 0"):
        DenseIndexConfig(nprobe=0)
    with pytest.raises(ConfigError, match="min_score"):
        MiningConfig(min_score=2, max_score=1).validate()
    assert TrainConfig(lr=1e-4).lr == 1e-4


# --- 10 (secrets). an API key given in a config never lands in any file a stage writes ---------------------------

def test_api_key_never_written_to_disk(tmp_path):
    from fake_llm_server import FakeLLMServer, write_passages

    secret = "sk-test-SECRET-123456"
    passages = write_passages(tmp_path / "passages.jsonl", 3)
    out = tmp_path / "gen" / "queries.jsonl"
    with FakeLLMServer(api_key=secret) as server:
        assert run_cli(["generate", "--input", str(passages), "--output", str(out), "--base-url", server.url,
                        "--model", "fake-model", "--no-progress", f"llm.api_key={secret}"]) == 0
    assert out.exists()
    for path in tmp_path.rglob("*"):
        if path.is_file() and path != passages:
            assert secret.encode() not in path.read_bytes(), f"{path} holds the API key"


# --- the second campaign (bench/hostile_campaign.py): stale outputs of the data stages, inputs in stage folders ---

def test_data_stage_output_made_with_other_settings_or_inputs_is_refused(env, tmp_path, capsys):
    out = tmp_path / "mined.jsonl"
    mine = ["mine", "--input", env["train"], "--output", str(out), "--num-negatives", "2"]
    assert run_cli(mine) == 0
    first = out.read_bytes()
    capsys.readouterr()
    assert run_cli(mine + ["--query-batch-size", "3"]) == 0  # operational: the output stands
    assert "is complete; nothing to do" in capsys.readouterr().out
    assert run_cli(mine[:-1] + ["3"]) == 2  # another setting: refused, not reused
    err = capsys.readouterr().err
    assert "is complete with other settings or inputs than this run: num_negatives: 2 -> 3" in err and "--overwrite" in err
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in _train_rows(6)), encoding="utf-8")
    assert run_cli(["mine", "--input", str(other), "--output", str(out), "--num-negatives", "2"]) == 2
    assert "input input (" in capsys.readouterr().err  # another input file: refused too
    assert out.read_bytes() == first
    out.rename(out.with_name(out.name + ".partial"))  # an unfinished run is not resumed with other settings either
    assert run_cli(mine[:-1] + ["3"]) == 2
    assert "was started (a .partial file) with other settings" in capsys.readouterr().err
    assert run_cli(mine[:-1] + ["3", "--overwrite"]) == 0
    assert all(len(json.loads(line)["neg"]) == 3 for line in out.read_text().splitlines())


def test_runner_refuses_inputs_inside_its_stage_folders(env, tmp_path, capsys):
    work = tmp_path / "work"
    corpus = work / "corpus" / "corpus.jsonl"  # the corpus stage's own output
    corpus.parent.mkdir(parents=True)
    shutil.copy(env["docs"], corpus)
    before = corpus.read_bytes()
    assert run_cli(["run", env["pipeline"], "--until", "corpus", f"corpus={corpus}", f"work_dir={work}"]) == 2
    assert "lies in the stage folder" in capsys.readouterr().err
    assert corpus.read_bytes() == before


def test_override_text_with_a_colon_is_text():
    from robustir.config import load_config
    from robustir.training.arguments import TrainConfig

    bge = "Represent this sentence for searching relevant passages: "
    config = load_config(TrainConfig, None, [f"query_instruction={bge}", "loss_options={temperature: 0.02}"])
    assert config.query_instruction == bge and config.loss_options == {"temperature": 0.02}


def test_pretrain_default_length_is_capped_at_the_model_for_long_texts(tiny_model_dir, tmp_path):
    data = tmp_path / "long.txt"
    data.write_text(" ".join(f"word{i} is here." for i in range(400)) + "\n", encoding="utf-8")  # > 128 tokens
    code = run_cli(["pretrain", "--data", str(data), "--model", tiny_model_dir, "--output", str(tmp_path / "p"),
                    "--max-steps", "1", "--batch-size", "1", "report=false"])
    assert code == 0 and (tmp_path / "p" / "model" / "config.json").exists()  # 512 (retromae default) -> 128


def test_damaged_progress_file_redoes_the_documents(env, tmp_path):
    out = tmp_path / "c.jsonl"
    (tmp_path / "c.jsonl.partial").write_text(json.dumps({"_id": "d1-0", "doc_id": "d1", "text": "stale"}) + "\n")
    (tmp_path / "c.jsonl.done").write_text("d1\n")  # not JSON: damaged
    assert run_cli(["chunk", "--input", env["docs"], "--output", str(out)]) == 0
    assert "stale" not in out.read_text() and len(out.read_text().splitlines()) == len(DOCS)


@pytest.mark.parametrize("cli", [["train", "--train-data", "missing.jsonl", "--model", "missing-model"],
                                 ["run", "/dev/null"]])
def test_a_typo_in_loss_options_fails_at_load_naming_the_key(cli, tmp_path, monkeypatch, capsys):
    """``loss_options.bta`` is refused when the config loads -- before any data is read or model loaded (neither
    exists here) -- with the key path and the closest option; on 5245875 it loaded and failed after mining."""
    from robustir.cli.main import main

    monkeypatch.chdir(tmp_path)
    prefix = "train." if cli[0] == "run" else ""
    assert main([*cli, f"{prefix}loss=peg", f"{prefix}loss_options.bta=0.2"]) == 2
    err = capsys.readouterr().err
    assert "loss_options.bta" in err and "did you mean 'beta'" in err and "Traceback" not in err
    assert main([*cli, f"{prefix}loss=ccr", f"{prefix}loss_options.variant=papr"]) == 2
    assert "loss_options.variant" in capsys.readouterr().err
