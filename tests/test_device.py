"""One device choice for every stage (issue 12, item 1) and BM25 that never touches the GPU (item 4).

On a CPU-only machine: ``resolve_device`` (with ``torch.cuda`` monkeypatched where a GPU is pretended), every stage
taking ``--device cpu`` through the CLI in-process on tiny data (and refusing a malformed or unavailable device with
a clear error), the torch exact top-k search (the GPU path without FAISS-GPU, run on the CPU here) against FAISS flat
search, and BM25 in subprocesses with JAX blocked, absent, or present as a stand-in package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from robustir.cli.main import main
from robustir.device import resolve_device
from robustir.errors import ConfigError

pytestmark = pytest.mark.usefixtures("single_torch_thread")

REPO = Path(__file__).resolve().parents[1]
from helpers import DOCS, QUERIES  # noqa: E402  (tests/ is on sys.path)


# ------------------------------------------------------------------------------------------ resolve_device

def test_auto_and_cpu_resolve_to_the_cpu_here():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        assert resolve_device(None) == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cuda", "cuda:1", "cuda:0"])
def test_cuda_without_a_visible_gpu_is_a_clear_error(spec, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as info:
        resolve_device(spec)
    message = str(info.value)
    assert f"device '{spec}'" in message and "no GPU is visible" in message
    assert "--device cpu" in message and "CUDA_VISIBLE_DEVICES" in message  # how to fix it
    assert resolve_device("auto") == torch.device("cpu")  # auto falls back, silently and by design


def test_a_gpu_number_beyond_the_count_names_the_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match=r"names GPU 1, but PyTorch sees 1 GPU \(cuda:0") as info:
        resolve_device("cuda:1")
    assert "CUDA_VISIBLE_DEVICES" in str(info.value)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("auto") == torch.device("cuda", 0)


@pytest.mark.parametrize("spec", ["gpu0", "gpu", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "mps", "", "auto:1"])
def test_a_malformed_device_lists_the_valid_forms(spec):
    with pytest.raises(ConfigError) as info:
        resolve_device(spec)
    message = str(info.value)
    assert f"device {spec!r} is not a device" in message
    for form in ("auto", "cpu", "cuda", "cuda:N"):
        assert form in message


def test_under_torchrun_a_gpu_number_is_refused(monkeypatch):
    from robustir.training.loop import _select_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="torchrun") as info:
        _select_device("cuda:1")
    assert "CUDA_VISIBLE_DEVICES" in str(info.value)
    assert _select_device("cuda") is False  # accelerate places each process on its LOCAL_RANK's GPU
    assert _select_device("cpu") is True


def test_a_later_run_in_the_same_process_may_change_device_or_precision(tmp_path):
    """accelerate keeps one state per process and refuses a second Accelerator with another device or precision; a
    new run forgets the earlier one's (in a subprocess: the state is process-wide)."""
    script = textwrap.dedent("""
        from accelerate import Accelerator
        from robustir.training.loop import _forget_other_accelerator_state

        Accelerator(mixed_precision="no", cpu=True)
        _forget_other_accelerator_state(True, "bf16")
        print(Accelerator(mixed_precision="bf16", cpu=True).mixed_precision)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "bf16"


# ------------------------------------------------------------------------------------------ every stage, --device

@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("device")
    beir = root / "beir"
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "title": t, "text": x}) + "\n"
                                               for i, t, x in DOCS))
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": i, "text": x}) + "\n" for i, x in QUERIES))
    qrels = "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(1, 5))
    for split in ("train", "test"):
        (beir / "qrels" / f"{split}.tsv").write_text(qrels)
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps({"query": QUERIES[i % 4][1] + f" ({i})", "pos": [DOCS[i % 6][2]],
                                         "neg": [DOCS[(i + 3) % 6][2], DOCS[(i + 4) % 6][2]]}) + "\n"
                             for i in range(8)))
    pipeline = root / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump({
        "corpus": str(beir), "queries": {"source": "beir"},
        "mine": {"method": "dense", "num_negatives": 2, "encode_batch_size": 8},
        "train": {"max_steps": 1, "batch_size": 2, "query_max_length": 16, "passage_max_length": 32,
                  "probe_size": 4, "report": False},
        "eval": {"base": False, "query_max_length": 16, "passage_max_length": 32}}))
    return {"beir": str(beir), "train": str(train), "pipeline": str(pipeline), "root": str(root)}


def stage_argv(stage: str, data: dict[str, str], model: str, out: Path) -> list[str]:
    """A quick run of ``stage`` on the tiny data (without ``--device``)."""
    beir, train = data["beir"], data["train"]
    return {
        "eval": ["eval", "--model", model, "--data", beir, "--batch-size", "4", "--output", str(out / "eval")],
        "eval-bm25": ["eval", "--model", "bm25", "--data", beir],
        "encode": ["encode", "--model", model, "--input", f"{beir}/corpus.jsonl", "--output", str(out / "emb")],
        "rerank-eval": ["rerank-eval", "--model", model, "--data", train],
        "mine": ["mine", "--data", beir, "--split", "train", "--method", "dense", "--model", model, "--num-negatives",
                 "2", "--output", str(out / "mined.jsonl")],
        "filter-teacher": ["filter", "--method", "teacher", "--model", model, "--input", train, "--output",
                           str(out / "teacher.jsonl"), "--no-progress"],
        "filter-sieve": ["filter", "--method", "sieve", "--model", model, "--input", train, "--output",
                         str(out / "sieve.jsonl"), "--num-negatives", "1", "--max-steps", "1", "--no-progress",
                         "train_batch_size=2", "train_negatives=1", "query_max_length=16", "passage_max_length=32",
                         "plot=false"],
        "pretrain": ["pretrain", "--mode", "retromae", "--model", model, "--data", f"{beir}/corpus.jsonl", "--output",
                     str(out / "pretrain"), "--max-steps", "1", "--batch-size", "2", "--max-length", "32",
                     "report=false"],
        "train": ["train", "--model", model, "--train-data", train, "--output", str(out / "train"), "--max-steps", "1",
                  "--batch-size", "2", "--query-max-length", "16", "--passage-max-length", "32", "report=false",
                  "probe_size=4"],
        "run": ["run", data["pipeline"], f"model={model}", f"work_dir={out / 'pipeline'}"],
        "demo": ["demo", "--output", str(out / "demo"), "--fp32"],
    }[stage]


STAGES = ["eval", "eval-bm25", "encode", "rerank-eval", "mine", "filter-teacher", "filter-sieve", "pretrain", "train",
          "run", "demo"]


@pytest.fixture
def tiny_demo(monkeypatch, data, tiny_model_dir):
    """``robustir demo`` on the tiny BEIR folder and model instead of the bundled SciFact and MiniLM."""
    import robustir.cli.demo as demo

    monkeypatch.setattr(demo, "dataset_path", lambda name: Path(data["beir"]))
    monkeypatch.setattr(demo, "default_model_path", lambda: tiny_model_dir)


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        return int(exc.code or 0)


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_runs_with_device_cpu(stage, data, tiny_model_dir, tiny_demo, tmp_path, capsys, monkeypatch):
    import robustir.device

    asked: list[str] = []  # every device a stage resolves (the callers import resolve_device when they run)
    resolve = robustir.device.resolve_device
    monkeypatch.setattr(robustir.device, "resolve_device", lambda spec="auto": asked.append(str(spec)) or resolve(spec))
    assert run_cli(stage_argv(stage, data, tiny_model_dir, tmp_path) + ["--device", "cpu"]) == 0, \
        capsys.readouterr().err
    assert asked and set(asked) == {"cpu"}, asked  # the flag reached every place that picks a device
    if stage in ("train", "pretrain"):  # the run records its device; the fingerprint leaves it out
        folder = tmp_path / stage
        written = json.loads((folder / ("training_config.json" if stage == "train" else "pretrain_config.json"))
                             .read_text())
        assert written["device"] == "cpu"
        assert "device" not in json.loads((folder / "run.json").read_text())["fingerprint"]["settings"]
    if stage == "run":  # the pipeline's device reaches its stages, and is no part of their caches
        work = tmp_path / "pipeline"
        assert json.loads((work / "pipeline_config.json").read_text())["device"] == "cpu"
        assert json.loads((work / "train" / "model" / "training_config.json").read_text())["device"] == "cpu"
        capsys.readouterr()
        assert run_cli(stage_argv(stage, data, tiny_model_dir, tmp_path) + ["--device", "auto"]) == 0
        assert "corpus skipped, chunk off, queries skipped, pretrain off, mine skipped, filter off, train skipped, " \
               "eval skipped" in capsys.readouterr().out


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_refuses_a_malformed_device(stage, data, tiny_model_dir, tiny_demo, tmp_path, capsys):
    assert run_cli(stage_argv(stage, data, tiny_model_dir, tmp_path) + ["--device", "gpu0"]) == 2
    err = capsys.readouterr().err
    assert "device 'gpu0' is not a device" in err and "cuda:N" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a visible GPU")
@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_says_when_no_gpu_is_visible(stage, data, tiny_model_dir, tiny_demo, tmp_path, capsys):
    assert run_cli(stage_argv(stage, data, tiny_model_dir, tmp_path) + ["--device", "cuda:1"]) == 2
    err = capsys.readouterr().err
    assert "no GPU is visible" in err and "--device cpu" in err


def test_pipeline_stage_devices(tmp_path):
    from robustir.pipeline import load_pipeline_config

    config = load_pipeline_config(None, ["device=cpu", "train.device=auto"])
    assert config.stage_device(config.train.device) == "cpu"  # auto in a section: the pipeline's
    assert config.stage_device("cuda:3") == "cuda:3"  # a section's own device wins
    with pytest.raises(ConfigError, match=r"^mine\.device: device 'gpu0' is not a device"):
        load_pipeline_config(None, ["mine.device=gpu0"])


def test_encoder_moves_to_the_device_and_bf16_follows(tiny_model_dir):
    from robustir.models.encoder import Encoder

    encoder = Encoder.from_pretrained(tiny_model_dir, device="cpu", query_max_length=16, passage_max_length=32)
    assert encoder.device == torch.device("cpu")
    fp32 = encoder.encode(["a cat", "heart attacks"], "query")
    bf16 = encoder.encode(["a cat", "heart attacks"], "query", bf16=True)
    assert np.allclose(fp32, bf16, atol=0.05)
    cached = encoder._half_cache
    assert cached is not None and str(encoder.device) in cached[0]  # the copy is keyed by the device it lives on
    with pytest.raises(ConfigError, match="is not a device"):
        Encoder.from_pretrained(tiny_model_dir, device="gpu0")


# ------------------------------------------------------------------------------------------ dense search

@pytest.mark.parametrize("n, k, chunk", [(500, 10, 37), (300, 64, 1000), (50, 80, 7), (1, 3, None)])
def test_torch_exact_top_k_equals_faiss_flat_search(n, k, chunk):
    from robustir.index.dense import DenseIndex, TorchFlatIndex, exact_search_torch

    rng = np.random.default_rng(n + k)
    corpus = rng.standard_normal((n, 24)).astype(np.float32)
    corpus /= np.linalg.norm(corpus, axis=1, keepdims=True)
    queries = rng.standard_normal((45, 24)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    index = DenseIndex(device="cpu").index(corpus)
    assert index.backend == "faiss-cpu"
    want_scores, want_rows = index.search(queries, k)
    got_scores, got_rows = exact_search_torch(corpus, queries, k, "cpu", query_batch=16, corpus_chunk=chunk)
    assert got_rows.shape == want_rows.shape == (45, min(k, n))
    assert np.array_equal(got_rows, want_rows)
    assert np.allclose(got_scores, want_scores, atol=1e-5)
    scores, rows = TorchFlatIndex(corpus, "cpu").search(queries, k)  # the default chunking
    assert np.array_equal(rows, want_rows) and np.allclose(scores, want_scores, atol=1e-5)


def test_dense_index_refuses_a_gpu_it_cannot_see(monkeypatch):
    from robustir.index.dense import DenseIndex, DenseIndexConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no GPU is visible"):
        DenseIndex(DenseIndexConfig(), device="cuda")
    assert DenseIndex(DenseIndexConfig()).device == torch.device("cpu")  # no device given: the CPU, as before


# ------------------------------------------------------------------------------------------ BM25 and JAX

BM25_SCRIPT = textwrap.dedent("""
    import json, sys
    {prelude}
    from robustir.index.bm25 import BM25Index

    index = BM25Index().index(["the cat sat on the mat", "dogs run in the park", "a cat and a dog"])
    scores, rows = index.search(["cat", "park dog"], k=2)
    import bm25s.selection
    print(json.dumps({{"rows": rows.tolist(), "jax_loaded": "jax" in sys.modules and sys.modules["jax"] is not None,
                      "bm25s_jax": bm25s.selection.JAX_IS_AVAILABLE,
                      "prealloc": __import__("os").environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")}}))
    {after}
""")


def run_bm25(tmp_path: Path, prelude: str = "", after: str = "", pythonpath: str | None = None) -> dict:
    script = tmp_path / "bm25_job.py"
    script.write_text(BM25_SCRIPT.format(prelude=prelude, after=after))
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    return {**json.loads(lines[0]), "after": lines[1:]}


EXPECTED_ROWS = [[2, 0], [1, 2]]


def test_bm25_works_when_jax_cannot_be_imported(tmp_path):
    result = run_bm25(tmp_path, prelude='sys.modules["jax"] = None  # import jax raises ImportError')
    assert result["rows"] == EXPECTED_ROWS
    assert result["bm25s_jax"] is False


def test_bm25_does_not_import_an_installed_jax(tmp_path):
    """A stand-in ``jax`` package on the path (as if JAX were installed): bm25s would import it and run a top-k at
    import time; robustir's BM25 keeps it out, and leaves it importable for others afterwards."""
    fake = tmp_path / "fakejax"
    (fake / "jax").mkdir(parents=True)
    (fake / "jax" / "__init__.py").write_text("import os\nos.environ['FAKE_JAX_IMPORTED'] = '1'\n")
    (fake / "jax" / "lax.py").write_text(
        "import numpy as np\ndef top_k(x, k):\n    x = np.asarray(x)\n    i = np.argsort(-x)[:k]\n    return x[i], i\n")
    result = run_bm25(tmp_path, pythonpath=str(fake),
                      after='import jax, os; print(jax.__file__, os.environ.get("FAKE_JAX_IMPORTED"))')
    assert result["rows"] == EXPECTED_ROWS
    assert result["jax_loaded"] is False and result["bm25s_jax"] is False
    assert result["prealloc"] == "false"  # the safety net for JAX imported by anyone else
    path, imported = result["after"][0].split()
    assert path.startswith(str(fake)) and imported == "1"  # still importable after bm25s is in


def test_bm25_retrieval_leaves_a_real_jax_unimported(tmp_path):
    import importlib.util

    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax is not installed here")
    result = run_bm25(tmp_path)
    assert result["rows"] == EXPECTED_ROWS
    assert result["jax_loaded"] is False
