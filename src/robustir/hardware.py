"""What the machine this process runs on really has: native bf16 on the CPU, and how many CPUs it may use.

Two questions every stage that runs a model asks before it picks a precision (:mod:`robustir.precision`) or a
thread count:

* :func:`cpu_has_native_bf16` -- does this CPU compute bfloat16 natively (AMX or AVX512-BF16 on x86, the BF16
  extension on Arm)? Where it does not, PyTorch *emulates* bf16 and a forward pass is several times slower than
  fp32 (measured in docs/benchmarks.md: MiniLM encode at 256 tokens, 10.6x slower on an AVX2-only AMD EPYC; 3x
  slower with the ISA capped to AVX2 on an AVX512-BF16 EPYC; 3.2x *faster* than fp32 with native bf16). This is the
  one seam the precision rule reads, so tests mock it here.
* :func:`available_cpus` -- the CPUs this process may use: its affinity mask (``taskset``, cpusets) and the cgroup
  CPU quota (``docker --cpus``, Kubernetes limits, CI runners), not the host's core count that ``os.cpu_count()``
  and OpenMP report. A 2-CPU container on a 64-core host otherwise starts 64 torch threads that the quota then
  throttles.

Both are plain functions of files and environment variables whose locations are parameters, so tests build a fake
``/proc/cpuinfo`` or cgroup tree in a temporary folder.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import platform
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["cpu_has_native_bf16", "cpu_has_native_fp16", "cpu_bf16_report", "available_cpus", "cgroup_cpu_limit", "configure_torch_threads"]

#: oneDNN's ISA names in increasing order (``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA``); a cap below
#: ``AVX512_CORE_BF16`` leaves oneDNN without native bf16 kernels even where the CPU has them.
_ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
                "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "ALL")
_X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_report(cpuinfo: str | Path = "/proc/cpuinfo", environ: dict | None = None,
                    machine: str | None = None) -> tuple[bool, str]:
    """``(native, why)``: whether bf16 runs natively on this CPU, with the flag or cap that decided it.

    x86: the ``avx512_bf16`` or ``amx_bf16`` CPU flag (from ``cpuinfo``; where that file is missing, PyTorch's own
    cpuinfo probe), and no ISA cap below it (``ATEN_CPU_CAPABILITY`` other than ``avx512``, or
    ``ONEDNN_MAX_CPU_ISA`` below ``AVX512_CORE_BF16``: both make PyTorch take its emulated bf16 kernels). Arm: the
    ``bf16`` feature (Armv8.6, e.g. AWS Graviton 3). Anything else: not native.
    """
    env = os.environ if environ is None else environ
    machine = (machine or platform.machine()).lower()
    flags = cpu_flags(cpuinfo)
    if machine in ("x86_64", "amd64", "i386", "i686"):
        if flags is None:
            try:
                import torch

                found = [name for name, probe in (("avx512_bf16", "_is_avx512_bf16_supported"),
                                                  ("amx_bf16", "_is_amx_tile_supported"))
                         if getattr(torch.cpu, probe, lambda: False)()]
            except Exception:  # noqa: BLE001 - an old or odd torch: treat as unknown = not native
                found = []
        else:
            found = [f for f in _X86_BF16_FLAGS if f in flags]
        if not found:
            return False, "the CPU has neither AVX512-BF16 nor AMX (bf16 is emulated there)"
        aten = (env.get("ATEN_CPU_CAPABILITY") or "").strip().lower()
        if aten and aten not in ("avx512", "avx512_vnni", "avx512_bf16"):
            return False, f"ATEN_CPU_CAPABILITY={aten} caps PyTorch below AVX-512 (bf16 is emulated there)"
        name = "ONEDNN_MAX_CPU_ISA" if env.get("ONEDNN_MAX_CPU_ISA") else "DNNL_MAX_CPU_ISA"
        cap = (env.get(name) or "").strip().upper()
        if cap in _ONEDNN_ISAS and _ONEDNN_ISAS.index(cap) < _ONEDNN_ISAS.index("AVX512_CORE_BF16"):
            return False, f"{name}={cap} caps oneDNN below AVX512_CORE_BF16 (bf16 is emulated there)"
        return True, f"the CPU has {' and '.join(found)}"
    if machine in ("aarch64", "arm64"):
        if flags is not None and "bf16" in flags:
            return True, "the CPU has the Arm BF16 extension"
        return False, "the CPU lacks the Arm BF16 extension (or it cannot be read here)"
    return False, f"no native bf16 is known for a {machine} CPU"


def cpu_has_native_fp16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes fp16 natively (x86: AVX512-FP16 or AMX-FP16; Arm: the ``fphp``/``asimdhp``
    half-precision extensions). Where it does not, PyTorch emulates fp16 on the CPU, as bf16 above."""
    flags = cpu_flags(cpuinfo) or set()
    return bool(flags & {"avx512_fp16", "amx_fp16", "asimdhp"})


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 natively: :func:`cpu_bf16_report` for this process (read once), unless the
    environment variable ``ROBUSTIR_CPU_BF16`` is ``1`` or ``0``, which overrides the detection (a VM whose
    hypervisor hides CPU flags; the test suite, so ``auto`` means the same on every CI machine)."""
    forced = os.environ.get(FORCE_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        _warn_bad_override(forced)
    return _detected_native_bf16()


FORCE_ENV = "ROBUSTIR_CPU_BF16"


@functools.lru_cache(maxsize=1)
def _detected_native_bf16() -> bool:
    native, why = cpu_bf16_report()
    logger.debug("native CPU bf16: %s (%s)", native, why)
    return native


@functools.lru_cache(maxsize=None)
def _warn_bad_override(value: str) -> None:
    logger.warning("%s=%r is ignored: set it to 1 (the CPU has native bf16) or 0 (it has not), or unset it to "
                   "detect", FORCE_ENV, value)


def cpu_flags(cpuinfo: str | Path) -> set[str] | None:
    """The CPU feature flags of the first processor in ``cpuinfo`` (x86 ``flags``, Arm ``Features``); None when the
    file cannot be read (not Linux)."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


# ----------------------------------------------------------------------------------------------- CPU count

def cgroup_cpu_limit(root: str | Path = "/sys/fs/cgroup", self_cgroup: str | Path = "/proc/self/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in CPUs (``1.5`` = 150 ms per 100 ms), None when there is none.

    cgroup v2: ``cpu.max`` (``"150000 100000"`` or ``"max 100000"``) of the process's cgroup and each parent up to
    ``root`` (the smallest counts, as the kernel enforces); cgroup v1: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
    of the ``cpu`` controller. Unreadable or malformed files count as no quota.
    """
    root = Path(root)
    limits: list[float] = []
    try:
        lines = Path(self_cgroup).read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    v2_path, v1_path = None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = path
    # cgroup v2: the process's own cgroup and its parents (inside a container the namespace root is "/")
    for folder in _ancestors(root, v2_path or "/"):
        limit = _read_v2(folder / "cpu.max")
        if limit is not None:
            limits.append(limit)
    # cgroup v1: the cpu controller's hierarchy (mounted as cpu,cpuacct or cpu)
    for base in (root / "cpu,cpuacct", root / "cpu"):
        if base.is_dir():
            for folder in _ancestors(base, v1_path or "/"):
                limit = _read_v1(folder)
                if limit is not None:
                    limits.append(limit)
            break
    return min(limits) if limits else None


def _ancestors(root: Path, path: str) -> list[Path]:
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read_v2(file: Path) -> float | None:
    try:
        quota, _, period = file.read_text(encoding="utf-8").strip().partition(" ")
        if quota == "max":
            return None
        return float(quota) / float(period or 100000) if float(quota) > 0 else None
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _read_v1(folder: Path) -> float | None:
    try:
        quota = float((folder / "cpu.cfs_quota_us").read_text(encoding="utf-8").strip())
        period = float((folder / "cpu.cfs_period_us").read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cpus(root: str | Path = "/sys/fs/cgroup", self_cgroup: str | Path = "/proc/self/cgroup",
                   affinity: int | None = None) -> int:
    """How many CPUs this process may keep busy: the CPUs of its affinity mask, capped by the cgroup quota rounded
    down (a quota of 1.5 CPUs gives 1: a second thread would only be throttled; never less than 1).

    ``affinity`` overrides the affinity count (tests)."""
    if affinity is None:
        affinity = _affinity_cpus()
    limit = cgroup_cpu_limit(root, self_cgroup)
    cpus = affinity if limit is None else min(affinity, math.floor(limit + 1e-9))
    return max(1, cpus)


def _affinity_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def configure_torch_threads() -> int | None:
    """Cap torch's intra-op threads at :func:`available_cpus` and return the count in force (None: the user chose
    it). PyTorch (OpenMP) starts one thread per CPU of the affinity mask and ignores the cgroup quota, so in a 2-CPU
    container on a 64-core host it would run 64 threads that the quota throttles. A count the user chose
    (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``) or one already below the cap is left alone. Called by the CLI before
    any stage runs: before torch is imported (stages such as merge or chunk never import it, and importing it here
    would add ~0.75 s to them) the cap goes to ``OMP_NUM_THREADS``, which torch and FAISS read when they load."""
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return None
    cpus = available_cpus()
    torch = sys.modules.get("torch")
    if torch is None:
        if cpus < _affinity_cpus():
            os.environ["OMP_NUM_THREADS"] = str(cpus)
        return cpus
    current = torch.get_num_threads()
    if current > cpus:
        logger.info("torch threads: %d -> %d (the CPUs this process may use: affinity and cgroup quota)", current, cpus)
        torch.set_num_threads(cpus)
        return cpus
    return current
