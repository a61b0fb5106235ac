"""One precision rule and the CPU count the process really has (issue 21).

The rule (``robustir.precision.resolve_precision``) is tested with its two seams mocked: the CPU's native bf16
(``robustir.hardware.cpu_has_native_bf16``) and the GPU's (``robustir.precision.gpu_has_native_bf16``). The
detection itself reads a fake ``/proc/cpuinfo``, and the CPU count a fake cgroup tree, both in a temporary folder.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

import robustir.hardware as hardware
import robustir.precision as precision
from robustir.config import load_config
from robustir.errors import ConfigError
from robustir.precision import resolve_precision

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it


@pytest.fixture
def native_cpu(monkeypatch):
    """Set what the CPU seam reports: ``native_cpu(True)``."""
    def set_native(value: bool) -> None:
        monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: value)
    return set_native


# ------------------------------------------------------------------------------------------ the rule

def test_auto_is_fp32_on_a_cpu_without_native_bf16_and_bf16_with_it(native_cpu):
    native_cpu(False)
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision(None, torch.device("cpu")) == "fp32"
    native_cpu(True)
    assert resolve_precision("auto", "cpu") == "bf16"


def test_auto_on_a_gpu_follows_its_bf16_support(monkeypatch, native_cpu):
    native_cpu(False)  # the CPU does not matter for a GPU
    monkeypatch.setattr(precision, "gpu_has_native_bf16", lambda device: True)
    assert resolve_precision("auto", CUDA) == "bf16"
    monkeypatch.setattr(precision, "gpu_has_native_bf16", lambda device: False)
    assert resolve_precision("auto", CUDA) == "fp32"


def test_explicit_fp16_on_a_cpu_warns_unless_it_has_native_fp16(native_cpu, monkeypatch, caplog):
    native_cpu(True)  # native bf16 says nothing about fp16
    for has_fp16, warned in ((False, True), (True, False)):
        monkeypatch.setattr(hardware, "cpu_has_native_fp16", lambda: has_fp16)
        precision._warn_emulated.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="robustir.precision"):
            assert resolve_precision("fp16", "cpu") == "fp16"
        assert ("AVX512-FP16" in caplog.text) is warned


def test_fp16_detection_reads_the_cpu_flags(tmp_path):
    assert not hardware.cpu_has_native_fp16(write_cpuinfo(tmp_path, AVX2_FLAGS + " avx512f avx512_bf16"))
    assert hardware.cpu_has_native_fp16(write_cpuinfo(tmp_path, AVX2_FLAGS + " avx512f avx512_fp16"))


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("spec, expected", [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"),
                                            ("FP32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16")])
def test_explicit_choices_are_honoured_on_any_hardware(native_cpu, monkeypatch, native, spec, expected):
    native_cpu(native)
    monkeypatch.setattr(precision, "gpu_has_native_bf16", lambda device: native)
    assert resolve_precision(spec, "cpu") == expected
    assert resolve_precision(spec, CUDA) == expected


def test_explicit_bf16_on_a_cpu_without_it_runs_with_one_warning(native_cpu, caplog):
    native_cpu(False)
    precision._warn_emulated.cache_clear()
    with caplog.at_level(logging.WARNING, logger="robustir.precision"):
        for _ in range(3):
            assert resolve_precision("bf16", "cpu") == "bf16"
    warnings = [r.getMessage() for r in caplog.records if r.name == "robustir.precision"]
    assert len(warnings) == 1 and "emulated" in warnings[0] and "slower than fp32" in warnings[0]
    native_cpu(True)
    precision._warn_emulated.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="robustir.precision"):
        resolve_precision("bf16", "cpu")
    assert not [r for r in caplog.records if r.name == "robustir.precision"]


@pytest.mark.parametrize("spec", ["fp8", "true", "", "bf 16"])
def test_a_bad_precision_says_what_is_valid(spec):
    with pytest.raises(ConfigError, match="auto.*fp32.*bf16.*fp16"):
        resolve_precision(spec, "cpu")


# ------------------------------------------------------------------------------------------ detection

AVX2_FLAGS = "fpu sse sse2 avx fma avx2 bmi2"
cpuinfo_text = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {}\n\nprocessor\t: 1\nflags\t\t: {}\n".format


def write_cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo_text(flags, flags))
    return path


@pytest.mark.parametrize("flags, native", [(AVX2_FLAGS, False), (AVX2_FLAGS + " avx512f avx512bw", False),
                                           (AVX2_FLAGS + " avx512f avx512_bf16", True),
                                           (AVX2_FLAGS + " avx512f amx_tile amx_bf16", True)])
def test_x86_native_bf16_is_avx512_bf16_or_amx(tmp_path, flags, native):
    found, why = hardware.cpu_bf16_report(write_cpuinfo(tmp_path, flags), environ={}, machine="x86_64")
    assert found is native
    assert ("AVX512-BF16" in why) is not native  # says what is missing, or which flag it found


@pytest.mark.parametrize("environ", [{"ATEN_CPU_CAPABILITY": "avx2"}, {"ATEN_CPU_CAPABILITY": "default"},
                                     {"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"DNNL_MAX_CPU_ISA": "avx512_core"}])
def test_an_isa_cap_below_bf16_makes_it_emulated(tmp_path, environ):
    cpuinfo = write_cpuinfo(tmp_path, AVX2_FLAGS + " avx512f avx512_bf16")
    native, why = hardware.cpu_bf16_report(cpuinfo, environ=environ, machine="x86_64")
    assert not native and next(iter(environ)) in why
    assert hardware.cpu_bf16_report(cpuinfo, environ={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"},
                                    machine="x86_64")[0]


def test_arm_native_bf16_is_the_bf16_feature(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert hardware.cpu_bf16_report(path, environ={}, machine="aarch64")[0]
    path.write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert not hardware.cpu_bf16_report(path, environ={}, machine="aarch64")[0]


def test_the_environment_overrides_the_detection(monkeypatch, caplog):
    monkeypatch.setenv("ROBUSTIR_CPU_BF16", "1")
    assert hardware.cpu_has_native_bf16() and resolve_precision("auto", "cpu") == "bf16"
    monkeypatch.setenv("ROBUSTIR_CPU_BF16", "0")
    assert not hardware.cpu_has_native_bf16() and resolve_precision("auto", "cpu") == "fp32"
    monkeypatch.setenv("ROBUSTIR_CPU_BF16", "yes please")
    hardware._warn_bad_override.cache_clear()
    with caplog.at_level(logging.WARNING, logger="robustir.hardware"):
        assert hardware.cpu_has_native_bf16() == hardware._detected_native_bf16()
    assert "ignored" in caplog.text


# ------------------------------------------------------------------------------------------ CPU count

def cgroup_v2(tmp_path: Path, limits: dict[str, str], own: str = "/kubepods/pod1/ctr") -> tuple[Path, Path]:
    """A cgroup v2 tree with ``cpu.max`` files at the given paths, and a /proc/self/cgroup naming ``own``."""
    root = tmp_path / "cgroup"
    (root / own.strip("/")).mkdir(parents=True)
    for where, value in limits.items():
        folder = root / where.strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cpu.max").write_text(value + "\n")
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text(f"0::{own}\n")
    return root, self_cgroup


def test_a_quota_of_one_and_a_half_cpus_gives_one_or_two_threads(tmp_path):
    root, self_cgroup = cgroup_v2(tmp_path, {"/kubepods/pod1/ctr": "150000 100000"})
    assert hardware.cgroup_cpu_limit(root, self_cgroup) == pytest.approx(1.5)
    assert hardware.available_cpus(root, self_cgroup, affinity=64) in (1, 2)
    assert hardware.available_cpus(root, self_cgroup, affinity=1) == 1


def test_the_smallest_quota_up_the_tree_counts_and_max_is_none(tmp_path):
    root, self_cgroup = cgroup_v2(tmp_path, {"/kubepods/pod1/ctr": "max 100000", "/kubepods/pod1": "400000 100000",
                                             "/kubepods": "max 100000"})
    assert hardware.available_cpus(root, self_cgroup, affinity=64) == 4
    root, self_cgroup = cgroup_v2(tmp_path / "none", {"/kubepods/pod1/ctr": "max 100000"})
    assert hardware.cgroup_cpu_limit(root, self_cgroup) is None
    assert hardware.available_cpus(root, self_cgroup, affinity=6) == 6  # the affinity mask alone


def test_a_container_sees_its_own_cgroup_as_the_root(tmp_path):
    root, self_cgroup = cgroup_v2(tmp_path, {"/": "200000 100000"}, own="/")
    assert hardware.available_cpus(root, self_cgroup, affinity=32) == 2


def test_cgroup_v1_quota_and_unreadable_files(tmp_path):
    root = tmp_path / "cgroup"
    folder = root / "cpu,cpuacct" / "docker" / "abc"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("300000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text("4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n")
    assert hardware.available_cpus(root, self_cgroup, affinity=16) == 3
    (folder / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert hardware.available_cpus(root, self_cgroup, affinity=16) == 16
    (folder / "cpu.cfs_quota_us").write_text("garbage\n")
    assert hardware.cgroup_cpu_limit(root, self_cgroup) is None
    assert hardware.available_cpus(tmp_path / "missing", tmp_path / "missing-too", affinity=5) == 5


def test_torch_threads_are_capped_never_raised(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(hardware, "available_cpus", lambda: 1)
        torch.set_num_threads(2)
        assert hardware.configure_torch_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(hardware, "available_cpus", lambda: 8)
        assert hardware.configure_torch_threads() == 1 and torch.get_num_threads() == 1  # not raised
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        monkeypatch.setattr(hardware, "available_cpus", lambda: 1)
        assert hardware.configure_torch_threads() is None and torch.get_num_threads() == 2  # the user's choice
    finally:
        torch.set_num_threads(before)


def test_before_torch_loads_the_cap_goes_to_openmp_without_importing_torch(monkeypatch):
    import sys

    monkeypatch.setenv("OMP_NUM_THREADS", "")  # unset for the function, and restored after the test (it sets it)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.delitem(sys.modules, "torch")  # as in a CLI process whose stage has not imported it
    monkeypatch.setattr(hardware, "_affinity_cpus", lambda: 8)
    monkeypatch.setattr(hardware, "available_cpus", lambda: 8)
    assert hardware.configure_torch_threads() == 8 and os.environ["OMP_NUM_THREADS"] == ""  # nothing to cap
    monkeypatch.setattr(hardware, "available_cpus", lambda: 2)
    assert hardware.configure_torch_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    assert "torch" not in sys.modules


def test_serve_sizes_its_workers_from_the_available_cpus(monkeypatch):
    from robustir.serving import service
    from robustir.serving.config import ServeConfig

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(hardware, "available_cpus", lambda: 3)
        workers, _ = service._workers(ServeConfig(), torch.device("cpu"), "fp32")  # one worker, every CPU's thread
        assert (workers, torch.get_num_threads()) == (1, 3)
        workers, _ = service._workers(ServeConfig(), torch.device("cpu"), "bf16")  # one single-threaded worker per CPU
        assert (workers, torch.get_num_threads()) == (3, 1)
        workers, _ = service._workers(ServeConfig(workers=2), torch.device("cpu"), "fp32")  # the flag wins
        assert (workers, torch.get_num_threads()) == (2, 1)
        monkeypatch.setattr(hardware, "available_cpus", lambda: 1)
        assert service._workers(ServeConfig(), torch.device("cpu"), "bf16")[0] == 1
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------ every stage takes it

def test_the_older_bf16_spellings_are_aliases(tmp_path):
    from robustir.evaluation.retrieval import EvalConfig
    from robustir.training.arguments import TrainConfig

    assert load_config(EvalConfig, None, ["bf16=true"]).precision == "bf16"
    assert load_config(EvalConfig, None, ["bf16=false"]).precision == "fp32"
    assert load_config(EvalConfig).precision == "auto"
    assert load_config(TrainConfig, None, ["eval_bf16=false"]).eval_precision == "fp32"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("bf16: true\n")
    assert load_config(EvalConfig, cfg, ["precision=fp32"]).precision == "fp32"  # a higher layer wins
    cfg.write_text("bf16: true\nprecision: fp32\n")
    with pytest.raises(ConfigError, match="bf16 and precision are both given"):
        load_config(EvalConfig, cfg)
    with pytest.raises(ConfigError, match="fp8"):
        load_config(EvalConfig, None, ["precision=fp8"])


def test_every_stage_config_defaults_to_auto():
    from robustir.evaluation.classify import ClassifyConfig
    from robustir.evaluation.retrieval import EvalConfig
    from robustir.filtering.sieve import SieveConfig
    from robustir.filtering.teacher import TeacherFilterConfig
    from robustir.negatives.mining import MiningConfig
    from robustir.pipeline import EvalStage
    from robustir.pretraining.pretrain import PretrainConfig
    from robustir.robustness.sidebyside import PRESETS
    from robustir.serving.config import ServeConfig
    from robustir.index.store import IndexConfig
    from robustir.training.arguments import TrainConfig

    for cls in (ClassifyConfig, EvalConfig, SieveConfig, TeacherFilterConfig, MiningConfig, EvalStage,
                PretrainConfig, ServeConfig, IndexConfig, TrainConfig):
        assert cls().precision == "auto", cls
    assert TrainConfig().eval_precision == "auto" and SieveConfig().train_precision == "auto"
    assert {name: budget.precision for name, budget in PRESETS.items()} == {"cpu": "auto", "gpu": "auto"}


def test_encoder_runs_in_the_resolved_precision(tiny_model_dir, native_cpu):
    from robustir.models.encoder import Encoder

    encoder = Encoder.from_pretrained(tiny_model_dir)
    native_cpu(False)
    fp32 = encoder.encode(["a cat", "heart attacks"], "query", precision="auto")
    assert encoder._half_cache is None  # auto = fp32 here: no low-precision copy
    native_cpu(True)
    bf16 = encoder.encode(["a cat", "heart attacks"], "query", precision="auto")
    assert next(encoder._half_cache[1].parameters()).dtype == torch.bfloat16
    assert bf16.dtype == fp32.dtype == "float32" and abs(bf16 - fp32).max() < 0.05
    fp16 = encoder.encode(["a cat", "heart attacks"], "query", precision="fp16")
    assert next(encoder._half_cache[1].parameters()).dtype == torch.float16 and abs(fp16 - fp32).max() < 0.05


def test_training_resolves_precision_and_refuses_fp16_on_the_cpu(tmp_path, native_cpu):
    from robustir.training.loop import LoopConfig, TrainingLoop

    native_cpu(True)
    loop = TrainingLoop(LoopConfig(output=str(tmp_path / "a"), device="cpu"), config_file="c.json")
    assert loop.precision == "bf16" and loop.accelerator.mixed_precision == "bf16"
    native_cpu(False)
    loop = TrainingLoop(LoopConfig(output=str(tmp_path / "b"), device="cpu"), config_file="c.json")
    assert loop.precision == "fp32" and loop.accelerator.mixed_precision == "no"
    with pytest.raises(ConfigError, match="fp16.*CPU"):
        TrainingLoop(LoopConfig(output=str(tmp_path / "c"), device="cpu", precision="fp16"), config_file="c.json")


def test_noise_bench_budget_takes_the_alias_and_checks_the_value():
    from robustir.robustness.bench import NoiseBenchConfig

    assert NoiseBenchConfig(budget={"bf16": False, "epochs": 2}).budget_obj().precision == "fp32"
    assert NoiseBenchConfig().budget_obj().precision == "auto"
    with pytest.raises(ConfigError, match="budget.precision.*fp8"):
        NoiseBenchConfig(budget={"precision": "fp8"}).budget_obj()


def test_corpus_cache_is_keyed_by_the_resolved_precision(tiny_model_dir, native_cpu, tmp_path):
    """A bf16 cache is never served for an fp32 request (or the reverse); ``auto`` shares the cache of what it
    resolves to, and the older ``bf16=True`` that of ``bf16``."""
    from robustir.models.encoder import Encoder

    encoder = Encoder.from_pretrained(tiny_model_dir)
    texts = ["a cat", "heart attacks"]
    key = lambda **kw: encoder.corpus_cache_file(texts, tmp_path, **kw)  # noqa: E731
    native_cpu(False)
    assert key(precision="fp32") != key(precision="bf16") != key(precision="fp16")
    assert key(precision="auto") == key(precision="fp32") and key(bf16=True) == key(precision="bf16")
    native_cpu(True)
    assert key(precision="auto") == key(precision="bf16")
    fp32 = encoder.encode_corpus(texts, cache_dir=tmp_path, precision="fp32")
    bf16 = encoder.encode_corpus(texts, cache_dir=tmp_path, precision="bf16")
    assert sorted(p.name for p in tmp_path.glob("*.npy")) == sorted({key(precision="fp32").name,
                                                                     key(precision="bf16").name})
    assert not (fp32 == bf16).all()
