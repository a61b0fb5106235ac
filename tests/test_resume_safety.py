"""An output folder holds one run (issue 11): stale runs are never resumed or reused, resume loads no pickle, and
data that cannot give a negative or a batch is refused up front instead of hanging."""

from __future__ import annotations

import json
import pickle
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from robustir.cli.main import main as cli_main
from robustir.data.training_data import TrainingExample
from robustir.errors import ConfigError
from robustir.training.arguments import TrainConfig
from robustir.training.checkpoints import FINGERPRINT_FILE, list_checkpoints
from robustir.training.data import GroupSampler
from robustir.training.trainer import train

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SRC = Path(__file__).resolve().parents[1] / "src" / "robustir"


def write_train_file(path: Path, n: int = 16) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(n):
            handle.write(json.dumps({"query": f"what does report {i} say about topic {i % 5}",
                                     "pos": [f"report {i} explains topic {i % 5} with detail number {i * 13}"],
                                     "neg": [f"report {i + 1} is about something else {i}"]}) + "\n")
    return path


def small_config(model: str, data: Path, output: Path, **overrides) -> TrainConfig:
    values = dict(model=model, train_data=str(data), output=str(output), batch_size=4, max_steps=2, save_steps=1,
                  save_total_limit=0, passage_max_length=32, query_max_length=16, probe_size=4, lr=1e-3, loss="peg",
                  num_negatives=1, seed=7, report=False)
    values.update(overrides)
    return TrainConfig(**values)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@pytest.fixture(scope="module")
def finished(tiny_model_dir, tmp_path_factory):
    """A finished fine-tuning run (2 steps, a checkpoint after each) and the data it was trained on."""
    root = tmp_path_factory.mktemp("finished")
    data = write_train_file(root / "train.jsonl")
    result = train(small_config(tiny_model_dir, data, root / "run"))
    assert result.steps == 2 and not result.already_complete
    return {"data": data, "out": root / "run", "model": tiny_model_dir}


def copy_run(finished, tmp_path: Path) -> Path:
    """A copy of the finished run folder (the output path is not part of the fingerprint)."""
    target = tmp_path / "run"
    shutil.copytree(finished["out"], target)
    return target


# ---------------------------------------------------------------------------- stale output (class 7)

@pytest.mark.parametrize("change, shown", [
    ({"lr": 2e-3}, "lr: 0.001 -> 0.002"),
    ({"seed": 8}, "seed: 7 -> 8"),
    ({"loss": "infonce"}, 'loss: "peg" -> "infonce"'),
    ({"max_steps": 1}, "max_steps: 2 -> 1"),
    ({"loss_options": {"beta": 0.2}}, "loss_options: {} -> {\"beta\": 0.2}"),
])
def test_changed_setting_over_a_finished_run_is_refused(finished, change, shown):
    before = (finished["out"] / FINGERPRINT_FILE).read_text()
    model_bytes = (finished["out"] / "model" / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError) as info:
        train(small_config(finished["model"], finished["data"], finished["out"], **change))
    message = str(info.value)
    assert str(finished["out"]) in message and shown in message, message
    assert "--output" in message and "resume=false" in message
    # nothing in the folder changed
    assert (finished["out"] / FINGERPRINT_FILE).read_text() == before
    assert (finished["out"] / "model" / "model.safetensors").read_bytes() == model_bytes


def test_changed_data_is_refused_and_named(tiny_model_dir, tmp_path):
    data = write_train_file(tmp_path / "train.jsonl")
    train(small_config(tiny_model_dir, data, tmp_path / "run", max_steps=1))
    with open(data, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"query": "one more query", "pos": ["one more passage"], "neg": ["other"]}) + "\n")
    with pytest.raises(ConfigError, match=r"input train_data .*content of train\.jsonl changed"):
        train(small_config(tiny_model_dir, data, tmp_path / "run", max_steps=1))
    other = write_train_file(tmp_path / "other.jsonl", n=12)
    with pytest.raises(ConfigError, match="train_data: .*train.jsonl.* -> .*other.jsonl"):
        train(small_config(tiny_model_dir, other, tmp_path / "run", max_steps=1))


def test_changed_setting_over_an_interrupted_run_is_refused_on_the_command_line(finished, tmp_path, capsys):
    data = finished["data"]
    first = train(small_config(finished["model"], data, tmp_path / "run"), stop_after=1)
    assert first.steps == 1 and [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [1]
    code = cli_main(["train", "--model", finished["model"], "--train-data", str(data), "--output",
                     str(tmp_path / "run"), "--batch-size", "4", "--max-steps", "2", "--lr", "0.005", "--seed", "7",
                     "--loss", "peg", "save_steps=1", "save_total_limit=0", "passage_max_length=32",
                     "query_max_length=16", "probe_size=4", "report=false"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "lr: 0.001 -> 0.005" in err and "1 checkpoint(s) (latest step 1)" in err and "resume=false" in err


def test_identical_rerun_is_complete_without_training(finished, tmp_path, monkeypatch):
    run = copy_run(finished, tmp_path)
    log = (run / "train_log.jsonl").read_text()
    model_bytes = (run / "model" / "model.safetensors").read_bytes()
    from robustir.training.loop import TrainingLoop

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(TrainingLoop, "prepare", no_training)
    monkeypatch.setattr(TrainingLoop, "run", no_training)
    result = train(small_config(finished["model"], finished["data"], run))
    assert result.already_complete and result.steps == 2 and result.model_path == run / "model"
    assert (run / "model" / "model.safetensors").read_bytes() == model_bytes
    assert (run / "train_log.jsonl").read_text() == log
    # the same once its checkpoints are deleted to save space: still complete, not retrained
    shutil.rmtree(run / "checkpoints")
    again = train(small_config(finished["model"], finished["data"], run))
    assert again.already_complete and again.steps == 2
    assert (run / "model" / "model.safetensors").read_bytes() == model_bytes


def test_lost_model_is_rewritten_from_the_final_checkpoint(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    shutil.rmtree(run / "model")
    result = train(small_config(finished["model"], finished["data"], run))
    assert not result.already_complete and result.steps == 2
    assert_same_weights(finished["out"] / "model", run / "model")
    assert [json.loads(x)["step"] for x in (run / "train_log.jsonl").read_text().splitlines()] == [1, 2]


def test_resume_false_starts_over_without_the_old_checkpoints(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    stale = run / "checkpoints" / "step-7"  # a checkpoint from some other run: must not survive a fresh start
    shutil.copytree(run / "checkpoints" / "step-2", stale)
    (run / "mined-bm25.jsonl").write_text("stale cache\n")
    result = train(small_config(finished["model"], finished["data"], run, lr=2e-3, max_steps=3, save_steps=3,
                                resume=False))
    assert result.steps == 3 and not result.already_complete
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [3]
    assert not (run / "mined-bm25.jsonl").exists()
    assert [json.loads(x)["step"] for x in (run / "train_log.jsonl").read_text().splitlines()] == [1, 2, 3]
    saved = json.loads((run / FINGERPRINT_FILE).read_text())
    settings = saved["fingerprint"]["settings"]
    assert settings["lr"] == 2e-3 and settings["max_steps"] == 3 and saved["complete"]
    assert json.loads((run / "model" / "training_config.json").read_text())["lr"] == 2e-3
    # and the new run is now the folder's run: the same settings again are complete
    assert train(small_config(finished["model"], finished["data"], run, lr=2e-3, max_steps=3,
                              save_steps=3)).already_complete


def test_folder_from_an_older_version_is_refused(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    (run / FINGERPRINT_FILE).unlink()
    with pytest.raises(ConfigError, match=f"no {FINGERPRINT_FILE}.*older robustir.*resume=false"):
        train(small_config(finished["model"], finished["data"], run))
    # an old accelerate-layout checkpoint only (pickles): refused too, and starting over clears it
    legacy = tmp_path / "legacy"
    (legacy / "checkpoints" / "step-2").mkdir(parents=True)
    (legacy / "checkpoints" / "step-2" / "trainer_state.json").write_text('{"step": 2}')
    (legacy / "checkpoints" / "step-2" / "random_states_0.pkl").write_bytes(pickle.dumps({"step": 0}))
    with pytest.raises(ConfigError, match="1 checkpoint.*older robustir"):
        train(small_config(finished["model"], finished["data"], legacy))
    result = train(small_config(finished["model"], finished["data"], legacy, resume=False))
    assert result.steps == 2 and not (legacy / "checkpoints" / "step-2" / "random_states_0.pkl").exists()
    assert_same_weights(finished["out"] / "model", legacy / "model")  # a clean, deterministic run


def test_pretrain_output_holds_one_run(tiny_model_dir, tmp_path):
    from robustir.pretraining.pretrain import PretrainConfig, pretrain

    data = tmp_path / "texts.txt"
    data.write_text("".join(f"document number {i} about the river and the garden\n" for i in range(12)))

    def config(**overrides) -> PretrainConfig:
        values = dict(mode="retromae", model=tiny_model_dir, data=str(data), output=str(tmp_path / "pre"),
                      batch_size=2, max_steps=2, max_length=32, lr=1e-3, seed=3, report=False, shuffle_buffer=4)
        values.update(overrides)
        return PretrainConfig(**values)

    first = pretrain(config())
    assert first.steps == 2 and not first.already_complete
    again = pretrain(config(logging_steps=5, save_total_limit=1))  # operational fields only: still this run
    assert again.already_complete and again.steps == 2 and "loss" in again.last_losses
    with pytest.raises(ConfigError, match="encoder_mask_ratio: 0.3 -> 0.4"):
        pretrain(config(encoder_mask_ratio=0.4))
    with pytest.raises(ConfigError, match="mode: \"retromae\" -> \"gur\""):
        pretrain(config(mode="gur", data=str(data)))


# ---------------------------------------------------------------------------- no pickle on resume (class 10)

class _Payload:
    """Unpickling this runs code: it writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pickle ran')",))


def test_resume_never_unpickles_planted_files(finished, tmp_path):
    marker = tmp_path / "PICKLE_RAN"
    payload = pickle.dumps(_Payload(marker))
    pickle.loads(payload)  # the payload works: loading it anywhere would leave the marker
    assert marker.exists()
    marker.unlink()

    run = tmp_path / "run"
    first = train(small_config(finished["model"], finished["data"], run), stop_after=1)
    assert first.steps == 1
    step = run / "checkpoints" / "step-1"
    assert not [p.name for p in step.iterdir() if p.suffix in (".pkl", ".bin", ".pt", ".pth")]
    for name in ("custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl", "random_states_0.pkl", "optimizer.bin",
                 "scheduler.bin", "pytorch_model.bin", "sampler.bin", "scaler.pt"):
        (step / name).write_bytes(payload)
    result = train(small_config(finished["model"], finished["data"], run))
    assert result.steps == 2 and not marker.exists()
    # and the resumed run is the uninterrupted one, bit for bit (model, optimizer, PEG's t and RNG restored)
    assert_same_weights(finished["out"] / "model", run / "model")
    log_full = [json.loads(x) for x in (finished["out"] / "train_log.jsonl").read_text().splitlines()]
    log_resumed = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["t"]) for r in log_full] == [(r["step"], r["loss"], r["t"]) for r in log_resumed]


def _resume_worker(rank: int, port: int, output: str, stop_after: int | None, weights_file: str) -> None:
    import os

    import numpy as np
    from safetensors.torch import save_file

    from robustir.training.loop import LoopConfig, TrainingLoop

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    torch.set_num_threads(1)
    loop = TrainingLoop(LoopConfig(output=output, batch_size=2, max_steps=4, lr=0.05, seed=5, save_steps=1,
                                   save_total_limit=0), config_file="c.json")
    torch.manual_seed(0)
    loop.prepare(torch.nn.Linear(3, 1), 4)

    def step(index: int) -> dict:
        # every RNG, drawn at a different rate per process: a resume must give each process its own states back
        x = torch.randn(2 + rank, 3)[:2]
        scale = [random.random() for _ in range(rank + 1)][-1] + float(np.random.rand(rank + 1)[-1])
        loss = ((loop.model(x).squeeze(-1) - scale * torch.rand(2)) ** 2).mean()
        loop.accelerator.backward(loss)
        return {"loss": loss}

    result = loop.run(step, save_steps=1, desc="test", stop_after=stop_after)
    if not result.interrupted:
        if loop.is_main:
            save_file({k: v.contiguous() for k, v in loop.unwrapped.state_dict().items()}, weights_file)
        loop.finish()


def test_two_process_resume_restores_each_process_state(tmp_path):
    """Two CPU processes (gloo): killed after step 2 and resumed, the run ends with the uninterrupted weights; each
    process's RNG states are stored on their own, as JSON and safetensors only."""
    import socket

    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    def spawn(output: Path, stop_after: int | None, weights_file: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_resume_worker, args=(port, str(output), stop_after, str(weights_file)), nprocs=2, join=True)

    spawn(tmp_path / "full", None, tmp_path / "full.safetensors")
    spawn(tmp_path / "resumed", 2, tmp_path / "unused.safetensors")
    step = tmp_path / "resumed" / "checkpoints" / "step-2"
    names = sorted(p.name for p in step.iterdir())
    assert {"random_states_0.json", "random_states_1.json", "model.safetensors", "optimizer.json",
            "scheduler.json"} <= set(names)
    assert all(n.endswith((".json", ".safetensors")) for n in names), names
    assert (step / "random_states_0.json").read_text() != (step / "random_states_1.json").read_text()
    spawn(tmp_path / "resumed", None, tmp_path / "resumed.safetensors")
    full, resumed = load_file(str(tmp_path / "full.safetensors")), load_file(str(tmp_path / "resumed.safetensors"))
    assert full.keys() == resumed.keys()
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
    log_full = (tmp_path / "full" / "train_log.jsonl").read_text().splitlines()
    log_resumed = (tmp_path / "resumed" / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in log_full] == [json.loads(x)["loss"] for x in log_resumed]


def test_no_pickle_loading_in_the_package():
    """No torch.load, pickle or accelerate save_state/load_state (which pickle) anywhere in robustir."""
    patterns = [r"\btorch\.load\(", r"\bpickle\.loads?\(", r"\bimport pickle\b", r"register_for_checkpointing\(",
                r"\.save_state\(", r"\.load_state\(", r"allow_pickle\s*=\s*True", r"weights_only\s*=\s*False"]
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        found += [f"{path.relative_to(SRC)}: {p}" for p in patterns if re.search(p, text)]
    assert not found, found


# ---------------------------------------------------------------------------- data checks (class 8)

def test_no_negative_to_draw_is_refused_not_a_hang(tiny_model_dir, tmp_path):
    # every record has the same positive and no negatives: the pool holds nothing but that positive
    examples = [TrainingExample(f"query {i}", ["the one passage"], []) for i in range(8)]
    with pytest.raises(ConfigError, match=r"training example 1 \(query 'query 0'\).*num_negatives 0"):
        GroupSampler(examples, 1, 4, 1, seed=0)
    assert GroupSampler(examples, 0, 4, 1, seed=0).batch(0, 0)[0].passages == ["the one passage"]  # in-batch only
    data = tmp_path / "same.jsonl"
    data.write_text("".join(json.dumps({"query": f"query {i}", "pos": ["the one passage"]}) + "\n" for i in range(8)))
    with pytest.raises(ConfigError, match="no hard negatives.*robustir mine"):
        train(small_config(tiny_model_dir, data, tmp_path / "run", mine="none"))


def test_negative_sampling_is_bounded_when_the_pool_is_mostly_own_positives(monkeypatch):
    examples = [TrainingExample(f"q{i}", ["shared"], []) for i in range(300)] + [TrainingExample("q", ["other"], [])]
    sampler = GroupSampler(examples, 2, 4, 1, seed=0, epoch_unit="queries")
    draws = []
    original = random.Random.choice

    def counting(self, seq):
        draws.append(len(seq))
        return original(self, seq)

    monkeypatch.setattr(random.Random, "choice", counting)
    group = sampler.group(0, epoch=0)  # example 0: its only possible negative is "other", 1 passage in 301
    assert group.passages == ["shared", "other", "other"]
    assert len(draws) <= 1 + 64 + 2  # the positive, at most 64 draws from the whole pool, then direct draws


def test_too_little_data_for_one_batch_the_sampler_refuses_and_the_trainer_caps(tiny_model_dir, tmp_path, capsys,
                                                                                 caplog):
    examples = [TrainingExample(f"q{i}", [f"p{i}"], [f"n{i}"]) for i in range(5)]
    with pytest.raises(ConfigError, match=r"5 \(query, positive\) pairs .*batch_size 4 x 2 process\(es\) = 8.*"
                                          r"lower batch_size to 2"):
        GroupSampler(examples, 1, 4, 2, seed=0, epoch_unit="pairs")
    data = write_train_file(tmp_path / "small.jsonl", n=3)
    code = cli_main(["train", "--model", tiny_model_dir, "--train-data", str(data), "--output", str(tmp_path / "o"),
                     "--batch-size", "8", "--max-steps", "1", "--no-mine", "passage_max_length=32",
                     "query_max_length=16"])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err  # training (fit_batch_size) caps the batch at the data's size
    assert "has 3 (query, positive) pairs (epoch_unit pairs), fewer than one batch of 8: batch_size capped at 3" \
        in caplog.text


def test_on_change_redo_starts_afresh_where_refuse_names_the_difference(finished, tmp_path):
    """``on_change: redo`` (a work folder a stage owns, e.g. the passage sieve's model): another setting trains
    again in the same folder instead of being refused; the same settings are still reused."""
    run = copy_run(finished, tmp_path)
    with pytest.raises(ConfigError, match="lr: 0.001 -> 0.002"):
        train(small_config(finished["model"], finished["data"], run, lr=2e-3))
    again = train(small_config(finished["model"], finished["data"], run, lr=2e-3, on_change="redo"))
    assert not again.already_complete and again.steps == 2
    assert json.loads((run / "run.json").read_text())["fingerprint"]["settings"]["lr"] == 2e-3
    reused = train(small_config(finished["model"], finished["data"], run, lr=2e-3, on_change="redo"))
    assert reused.already_complete
