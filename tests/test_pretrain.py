"""Pre-training loop (RetroMAE, GUR): outputs, continuation from saved heads, resume, streaming data."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from robustir.errors import DataError
from robustir.pretraining.pretrain import PretrainConfig, StreamingExamples, pretrain, read_pairs, read_texts

WORDS = ("the cat dog river model retrieval dense passage query vector spring flood garden mouse kitchen "
         "photosynthesis chloroplast vaccine trial solar panel").split()


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def sentence(rng: np.random.Generator, low: int = 5, high: int = 20) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(low, high))))


def write_texts(path: Path, n: int = 40) -> Path:
    rng = np.random.default_rng(0)
    path.write_text("".join(json.dumps({"text": sentence(rng), "title": f"title {i}"}) + "\n" for i in range(n)))
    return path


def write_pairs(path: Path, n: int = 40) -> Path:
    rng = np.random.default_rng(1)
    path.write_text("".join(json.dumps({"query": sentence(rng, 4, 10), "pos": [sentence(rng, 4, 10)], "neg": []}) + "\n"
                            for _ in range(n)))
    return path


def small_config(model: str, mode: str, data: Path, output: Path, **overrides) -> PretrainConfig:
    values = dict(mode=mode, model=model, data=str(data), output=str(output), batch_size=4, max_steps=4,
                  max_length=32, lr=1e-3, warmup_ratio=0.0, seed=3, report=False)
    values.update(overrides)
    return PretrainConfig(**values)


def read_log(output: Path) -> list[dict]:
    return [json.loads(x) for x in (output / "train_log.jsonl").read_text().splitlines()]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


# ---------------------------------------------------------------------------- outputs and continuation

def test_retromae_outputs_load_and_heads_continue(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer

    from robustir.models.encoder import Encoder
    from robustir.pretraining.retromae import RetroMAEModel

    data = write_texts(tmp_path / "texts.jsonl")
    out = tmp_path / "retromae"
    result = pretrain(small_config(tiny_model_dir, "retromae", data, out, max_steps=5, report=True))
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5]
    assert {"loss", "encoder_mlm_loss", "decoder_loss", "lr", "grad_norm"} <= set(log[0])
    assert all(np.isfinite(r["loss"]) for r in log)
    assert log[-1]["loss"] < log[0]["loss"]  # lr 1e-3 on a random tiny BERT: reconstruction improves at once
    assert (out / "pretrain_report.png").stat().st_size > 0 and (out / "pretrain_config.json").exists()

    encoder = Encoder.from_pretrained(result.model_path)
    assert encoder.config.pooling == "cls" and encoder.encode(["a cat"]).shape == (1, 32)
    st = SentenceTransformer(str(result.model_path), device="cpu")
    np.testing.assert_allclose(st.encode(["a cat and a dog"]), encoder.encode(["a cat and a dog"]), atol=1e-5)

    # the decoder head reloads, and pre-training continues from it (heads = the previous output folder)
    reloaded = RetroMAEModel.from_pretrained(result.model_path, result.heads_path)
    saved = load_file(str(result.heads_path / "model.safetensors"))
    for key, value in reloaded.decoder.state_dict().items():
        torch.testing.assert_close(value, saved[key])
    more = pretrain(small_config(str(result.model_path), "retromae", data, tmp_path / "more", heads=str(out),
                                 max_steps=2))
    first = read_log(tmp_path / "more")[0]
    assert first["decoder_loss"] < log[0]["decoder_loss"]  # starts where the first run left off, not afresh
    assert (more.heads_path / "model.safetensors").exists()


@pytest.mark.parametrize("mode", ["gur", "retromae"])
def test_resume_equals_uninterrupted(tiny_model_dir, tmp_path, mode):
    data = write_pairs(tmp_path / "pairs.jsonl") if mode == "gur" else write_texts(tmp_path / "texts.jsonl")
    extra = {"projection": True, "projection_dim": 16, "shuffle_buffer": 8} if mode == "gur" else {"shuffle_buffer": 8}
    full = pretrain(small_config(tiny_model_dir, mode, data, tmp_path / "full", save_steps=2, **extra))
    first = pretrain(small_config(tiny_model_dir, mode, data, tmp_path / "resumed", **extra), stop_after=2)
    assert first.steps == 2 and not (tmp_path / "resumed" / "model").exists()
    second = pretrain(small_config(tiny_model_dir, mode, data, tmp_path / "resumed", **extra))
    assert second.steps == 4
    for folder in ("model", "projection_head" if mode == "gur" else "decoder_head"):
        a, b = weights(tmp_path / "full" / folder), weights(tmp_path / "resumed" / folder)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)
    log_full, log_resumed = read_log(tmp_path / "full"), read_log(tmp_path / "resumed")
    assert [r["step"] for r in log_resumed] == [1, 2, 3, 4]
    for x, y in zip(log_full, log_resumed):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
    if mode == "gur":
        assert {"mlm_loss", "cl_loss", "cl_accuracy"} <= set(log_full[0])
        from sentence_transformers import SentenceTransformer

        from robustir.pretraining.gur import GURModel

        assert SentenceTransformer(str(full.model_path), device="cpu").encode(["x"]).shape == (1, 32)
        model = GURModel.from_pretrained(full.model_path, full.heads_path)
        assert model.projection is not None and model.projection_dim == 16


@pytest.fixture(scope="module")
def no_dropout_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny BERT with dropout off (chunked and plain forwards would draw different dropout masks)."""
    from transformers import AutoConfig, AutoTokenizer, BertForMaskedLM

    model_dir = tmp_path_factory.mktemp("tiny-bert-no-dropout")
    config = AutoConfig.from_pretrained(tiny_model_dir, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    BertForMaskedLM.from_pretrained(tiny_model_dir, config=config).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(model_dir)
    return str(model_dir)


def test_gur_steps_go_through_the_batch_engine_with_grad_cache(no_dropout_model_dir, tiny_model_dir, tmp_path):
    """GUR pre-training with chunk_size (GradCache) logs the same first-step losses and gradient norm as without."""
    from robustir.errors import ConfigError

    model_dir = no_dropout_model_dir
    data = write_pairs(tmp_path / "pairs.jsonl")
    logs = {}
    for name, chunk_size in (("plain", None), ("cached", 3)):  # 4 pairs per step: chunks of 3 + 1 sentences
        pretrain(small_config(str(model_dir), "gur", data, tmp_path / name, max_steps=1, chunk_size=chunk_size,
                              projection=True, projection_dim=16, alpha=0.7, mlm_weight=1.3))
        logs[name] = read_log(tmp_path / name)[0]
    plain, cached = logs["plain"], logs["cached"]
    assert {"loss", "mlm_loss", "cl_loss", "cl_accuracy", "cl_loss_q2p", "cl_loss_p2q"} <= set(plain)
    assert plain.keys() == cached.keys()
    for key in ("loss", "mlm_loss", "cl_loss", "grad_norm"):
        assert cached[key] == pytest.approx(plain[key], rel=1e-4), key
    assert plain["loss"] == pytest.approx(0.7 * plain["cl_loss"] + 1.3 * plain["mlm_loss"], rel=1e-5)
    with pytest.raises(ConfigError, match="gur only"):
        small_config(tiny_model_dir, "retromae", data, tmp_path / "x", chunk_size=2).validate()


def test_cli_flags_overrides_and_errors(tiny_model_dir, tmp_path, capsys):
    from robustir.cli.main import main, parse
    from robustir.cli.pretrain import build_config

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("mode: gur\nlr: 5.0e-5\nbatch_size: 16\ntemperature: 0.05\n")
    _, bound = parse(["pretrain", "--config", str(cfg), "--batch-size", "8", "--resume-heads", "h", "alpha=0.5",
                      "mask_ratio_range=[0.1, 0.29]"])
    config = build_config(bound.args, bound.kwargs["config_file"])
    assert (config.mode, config.lr, config.batch_size, config.temperature, config.alpha) == ("gur", 5e-5, 8, 0.05, 0.5)
    assert config.heads == "h" and config.mask_ratio_range == [0.1, 0.29]
    assert config.resolved_max_length() == 128
    # a retromae run on a pairs file: a clear data error, no traceback
    pairs = write_pairs(tmp_path / "pairs.jsonl", 4)
    code = main(["pretrain", "--mode", "retromae", "--model", tiny_model_dir, "--data", str(pairs),
                 "--output", str(tmp_path / "o"), "--max-steps", "1"])
    assert code == 2 and "text" in capsys.readouterr().err


# ---------------------------------------------------------------------------- streaming data

def test_streaming_every_example_once_per_epoch_and_deterministic():
    items = list(range(103))

    def reader():
        return iter(items)

    ranks = [StreamingExamples(reader, rank=r, world_size=2, seed=5, buffer_size=10) for r in (0, 1)]
    for epoch in (0, 1):
        seen = [x for s in ranks for x in s.epoch(epoch)]
        assert sorted(seen) == items  # every example exactly once across the ranks
        assert set(ranks[0].epoch(epoch)) == set(range(0, 103, 2))  # round-robin sharding
    assert list(ranks[0].epoch(0)) == list(StreamingExamples(reader, rank=0, world_size=2, seed=5,
                                                            buffer_size=10).epoch(0))
    assert list(ranks[0].epoch(0)) != list(ranks[0].epoch(1))  # reshuffled each epoch
    assert list(ranks[0].epoch(0)) != list(StreamingExamples(reader, rank=0, world_size=2, seed=6,
                                                            buffer_size=10).epoch(0))
    assert list(ranks[0].epoch(0)) != sorted(ranks[0].epoch(0))  # actually shuffled

    def take(iterator, n):
        return [next(iterator) for _ in range(n)]

    # endless across epochs, and skip=k continues exactly where a consumer of k examples stopped
    whole = take(ranks[1].stream(), 130)
    assert whole[:51] == list(ranks[1].epoch(0)) and whole[51:102] == list(ranks[1].epoch(1))
    assert take(ranks[1].stream(skip=77), 53) == whole[77:]
    with pytest.raises(DataError, match="no example"):
        next(StreamingExamples(lambda: iter([1]), rank=1, world_size=2).stream())


def test_text_readers_stream_every_format(tmp_path):
    plain = tmp_path / "docs.txt"
    plain.write_text("first document\n\n  second document  \nthird\n")
    assert list(read_texts(plain)) == ["first document", "second document", "third"]
    packed = tmp_path / "docs.jsonl.gz"
    with gzip.open(packed, "wt") as handle:
        handle.write(json.dumps({"text": "body one", "title": "Title"}) + "\n" + json.dumps({"text": "body two"}) + "\n")
    assert list(read_texts(packed)) == ["Title body one", "body two"]
    beir = tmp_path / "beir"
    beir.mkdir()
    with gzip.open(beir / "corpus.jsonl.gz", "wt") as handle:
        handle.write(json.dumps({"_id": "d1", "title": "", "text": "only text"}) + "\n")
    assert list(read_texts(beir)) == ["only text"]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"query": "a", "pos": ["b", "c"]}) + "\n" + json.dumps({"a": "x", "b": "y"}) + "\n")
    assert list(read_pairs(pairs)) == [("a", "b"), ("x", "y")]
    with pytest.raises(DataError, match="text"):
        list(read_texts(pairs))


def torchrun_pretrain(args: list[str]):
    """``torchrun --nproc_per_node 2 -m robustir.cli.main pretrain ARGS`` on CPU (gloo, 127.0.0.1)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port), "-m", "robustir.cli.main", "pretrain", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_two_processes_with_torchrun(tiny_model_dir, tmp_path):
    """DDP on CPU (gloo): both ranks stream their own share, the main rank logs and saves."""
    data = write_texts(tmp_path / "texts.jsonl", 12)
    out = tmp_path / "ddp"
    done = torchrun_pretrain(["--mode", "retromae", "--model", tiny_model_dir, "--data", str(data), "--output",
                              str(out), "--epochs", "1", "--batch-size", "2", "max_length=32", "report=false"])
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2, 3]  # 12 texts / (2 processes x 2) per step
    assert log[-1]["epoch"] == pytest.approx(1.0)
    assert (out / "model" / "model.safetensors").exists() and (out / "decoder_head" / "config.json").exists()
    assert done.stdout.count("pre-trained encoder saved") == 1


def test_gur_two_processes_with_torchrun_and_grad_cache(no_dropout_model_dir, tmp_path):
    """GUR under torchrun: the batch engine gathers both ranks' sentence vectors (DDP, GradCache chunks of one)."""
    data = write_pairs(tmp_path / "pairs.jsonl", 12)
    out = tmp_path / "ddp-gur"
    done = torchrun_pretrain(["--mode", "gur", "--model", no_dropout_model_dir, "--data", str(data), "--output",
                              str(out), "--epochs", "1", "--batch-size", "2", "chunk_size=1", "max_length=32",
                              "report=false"])
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2, 3]  # 12 pairs / (2 processes x 2) per step
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["cl_loss"]) and np.isfinite(r["mlm_loss"]) for r in log)
    # the random tiny BERT's sentence vectors ([CLS], no dropout) are all but identical at step 1, so InfoNCE is
    # log(candidates):
    # log 4 = both ranks' pairs (gathered); each rank alone would give log 2
    assert log[0]["cl_loss"] == pytest.approx(np.log(4), rel=0.02)
    assert (out / "model" / "model.safetensors").exists() and (out / "projection_head" / "config.json").exists()
    assert done.stdout.count("pre-trained encoder saved") == 1
