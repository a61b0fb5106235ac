"""One device choice for every stage: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

Every stage that runs a model takes a ``device`` (config field ``device``, flag ``--device``) and turns it into a
:class:`torch.device` with :func:`resolve_device`, before it loads anything:

* ``auto`` (the default): the current GPU -- the first one unless ``torch.cuda.set_device`` chose another -- when
  PyTorch sees one, else the CPU;
* ``cpu``: the CPU, even on a GPU machine;
* ``cuda``: the current GPU, as ``auto``, but an error when no GPU is visible (no silent fall-back to the CPU);
* ``cuda:N``: GPU number N (counted from 0 among the GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible).

A malformed spec, ``cuda`` without a visible GPU and a GPU number beyond the visible ones are
:class:`~robustir.errors.ConfigError`, each saying how to fix it. Training under ``torchrun`` is the exception:
the launcher gives each process its own GPU (its ``LOCAL_RANK``), so there ``device`` may be ``auto``, ``cuda`` or
``cpu`` but not ``cuda:N`` (:func:`robustir.training.loop.TrainingLoop`).

The device is where things *run*, not what they compute (up to floating-point rounding and, in training, the random
draws of another device's generator), so it is left out of run fingerprints and pipeline stage caches: a run moved
to another device resumes there.
"""

from __future__ import annotations

import re

import torch

from .errors import ConfigError

__all__ = ["DEVICE_HELP", "VALID_FORMS", "resolve_device", "device_string"]

VALID_FORMS = ("auto (the first GPU if there is one, else the CPU), cpu, cuda (the first GPU, an error without "
               "one) or cuda:N (GPU number N, counted from 0)")
DEVICE_HELP = ("where models run: auto = the first GPU if there is one, else the CPU; cpu; cuda; cuda:N "
               "(GPU number N)")

_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """The :class:`torch.device` that ``spec`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``; None = ``auto``) names.

    A GPU device always carries its index (``cuda`` → ``cuda:<current>``), so FAISS and ``torch.cuda`` calls can
    use it. Raises :class:`~robustir.errors.ConfigError` for a malformed spec, for ``cuda`` / ``cuda:N`` when no
    GPU is visible, and for an index beyond ``torch.cuda.device_count()``.
    """
    if spec is None:
        spec = "auto"
    text = str(spec).strip().lower()
    match = _SPEC.match(text)
    if not match or (match.group(2) is not None and match.group(1) != "cuda"):
        raise ConfigError(f"device {str(spec)!r} is not a device: use {VALID_FORMS}")
    kind, index = match.group(1), match.group(2)
    if kind == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if kind == "auto":
        return torch.device("cuda", _current_gpu()) if available else torch.device("cpu")
    if not available:
        build = ("this PyTorch is a CPU-only build" if getattr(torch.version, "cuda", None) is None
                 else f"this PyTorch is built for CUDA {torch.version.cuda}, but no GPU or driver answers")
        raise ConfigError(
            f"device {str(spec)!r} asks for a GPU, but no GPU is visible to PyTorch here ({build}). Fix: run on the "
            "CPU with --device cpu (or auto, which uses a GPU only when there is one); or, to use the GPU, check that "
            "nvidia-smi lists it, that CUDA_VISIBLE_DEVICES does not hide it, and that PyTorch is a CUDA build "
            "(python -c \"import torch; print(torch.version.cuda, torch.cuda.is_available())\")")
    if index is None:
        return torch.device("cuda", _current_gpu())
    count = torch.cuda.device_count()
    if int(index) >= count:
        names = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise ConfigError(
            f"device {str(spec)!r} names GPU {index}, but PyTorch sees {count} GPU{'s' if count != 1 else ''} "
            f"({names}; CUDA_VISIBLE_DEVICES renumbers the visible ones from 0). Fix: use one of {names}, or cuda / "
            "auto for the first")
    return torch.device("cuda", int(index))


def _current_gpu() -> int:
    """The current GPU's number; 0 before CUDA is initialised (asking would initialise it here, and under torchrun
    before the launcher's device is set)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


def device_string(device: torch.device | str) -> str:
    """``device`` as a spec :func:`resolve_device` takes back (``cpu``, ``cuda:1``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else _current_gpu()}"
    return device.type
