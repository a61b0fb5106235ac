"""One precision rule for every stage that runs a model: ``auto``, ``fp32``, ``bf16`` or ``fp16``.

Every stage (eval, encode, mine, filter, index, serve, train, pretrain, noise-bench, demo, classify) takes a
``precision`` (config field ``precision``, flag ``--precision``; the older ``bf16: true`` / ``--bf16`` are aliases
for ``bf16``, ``bf16: false`` / ``--no-bf16`` for ``fp32``) and turns it into the precision it runs in with
:func:`resolve_precision`, for the device it runs on:

* ``auto`` (the default): **bf16** on a GPU that computes it natively (Ampere and later) and on a CPU with native
  bf16 (AMX or AVX512-BF16, detected at run time by :func:`robustir.hardware.cpu_has_native_bf16`); **fp32**
  everywhere else -- an AVX2-only CPU, most laptops and cloud VMs, where PyTorch emulates bf16 and MiniLM encodes
  ~10x slower than in fp32 (docs/benchmarks.md), and an older GPU;
* ``fp32``, ``bf16``, ``fp16``: that precision, wherever it runs. ``bf16`` or ``fp16`` on a CPU without native
  support runs as asked but logs one warning saying what it costs.

What a precision means per stage: inference (encode, eval, mine, filter, index, serve, classify) runs the forward
pass on a copy of the weights in that dtype, pooling and normalisation in fp32; training runs the forward passes
under autocast (:mod:`accelerate`'s ``mixed_precision``) with fp32 master weights, and every loss in fp32.

Fingerprints and caches keep the *spec* a user wrote (``auto``), like the device: where a run is resumed on other
hardware ``auto`` may resolve differently, which changes floating-point rounding, not the method. Reports (the model
card, the server's ``/health``) state the resolved precision; corpus-embedding caches key on it.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Literal

from .errors import ConfigError

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

__all__ = ["Precision", "Resolved", "PRECISIONS", "PRECISION_HELP", "resolve_precision", "precision_dtype",
           "legacy_bf16", "gpu_has_native_bf16", "accelerate_mixed_precision"]

Precision = Literal["auto", "fp32", "bf16", "fp16"]
Resolved = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")
PRECISION_HELP = ("numeric precision of the model: auto = bf16 on a GPU or CPU that computes it natively (AMX / "
                  "AVX512-BF16), else fp32; fp32; bf16; fp16")

#: The measured cost named in the warning (docs/benchmarks.md, "Precision and threads").
_EMULATED_COST = ("measured: MiniLM encodes 10.6x slower in bf16 than in fp32 on an AVX2-only AMD EPYC, "
                  "docs/benchmarks.md")


def gpu_has_native_bf16(device: torch.device) -> bool:
    """Whether GPU ``device`` computes bf16 natively (compute capability 8.0+: Ampere, Hopper, ...). The GPU seam of
    the rule, mocked in tests."""
    import torch

    try:
        return torch.cuda.get_device_capability(device)[0] >= 8
    except Exception:  # noqa: BLE001 - no driver answers: not native
        return False


def _cpu_native_bf16() -> bool:
    from .hardware import cpu_has_native_bf16

    return cpu_has_native_bf16()


def _cpu_native_fp16() -> bool:
    from .hardware import cpu_has_native_fp16

    return cpu_has_native_fp16()


def resolve_precision(spec: str | None, device: torch.device | str = "cpu") -> Resolved:
    """The precision ``spec`` (``auto``, ``fp32``, ``bf16``, ``fp16``; None = ``auto``) means on ``device``.

    Raises :class:`~robustir.errors.ConfigError` for any other spec. An explicit ``bf16`` / ``fp16`` on a CPU
    without native support is honoured and warned about once per process.
    """
    text = "auto" if spec is None else str(spec).strip().lower()
    text = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(text, text)
    if text not in PRECISIONS:
        raise ConfigError(f"precision {spec!r} is not a precision: use auto (bf16 where the hardware computes it "
                          "natively, else fp32), fp32, bf16 or fp16")
    import torch

    device = torch.device(device)
    if text == "auto":
        if device.type == "cuda":
            return "bf16" if gpu_has_native_bf16(device) else "fp32"
        if device.type == "cpu":
            return "bf16" if _cpu_native_bf16() else "fp32"
        return "fp32"
    if device.type == "cpu" and ((text == "bf16" and not _cpu_native_bf16()) or
                                 (text == "fp16" and not _cpu_native_fp16())):
        _warn_emulated(text)
    return text  # type: ignore[return-value]


@functools.lru_cache(maxsize=None)
def _warn_emulated(precision: str) -> None:
    import os

    from .hardware import FORCE_ENV, cpu_bf16_report

    if precision == "fp16":
        why = "the CPU has neither AVX512-FP16 nor AMX-FP16"
    elif os.environ.get(FORCE_ENV, "").strip() == "0":
        why = f"{FORCE_ENV}=0 says the CPU has no native bf16"
    else:
        why = cpu_bf16_report()[1]
    logger.warning("precision %s on this CPU runs emulated: %s; it is several times slower than fp32 (%s). "
                   "Use --precision auto (or fp32) unless you need %s numerics.", precision, why, _EMULATED_COST,
                   precision)


def precision_dtype(precision: Resolved) -> torch.dtype:
    """The torch dtype of a resolved precision."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def accelerate_mixed_precision(precision: Resolved) -> str:
    """:class:`accelerate.Accelerator`'s ``mixed_precision`` for a resolved precision."""
    return {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision]


def legacy_bf16(value: bool) -> str:
    """The precision the older ``bf16`` switch meant: true = ``bf16``, false = ``fp32``."""
    return "bf16" if value else "fp32"
