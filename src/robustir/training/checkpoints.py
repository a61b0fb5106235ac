"""The run folder of the training loop (:mod:`robustir.training.loop`, fine-tuning and pre-training): checkpoints
written and read without pickle, and the run fingerprint that keeps one folder to one run.

Checkpoints
-----------
``<root>/step-N/`` holds::

    model.safetensors              the unwrapped model's state_dict (tied weights stored once)
    optimizer.json (+ .safetensors) the optimizer's state_dict: tensors in safetensors, the rest JSON
    scheduler.json                 the learning-rate schedule's state_dict (scalars and lists)
    state_I.json (+ .safetensors)  state_dict of the I-th checkpointed object (e.g. PEG's running bias t)
    random_states_R.json (+ .safetensors)  process R's RNG states: python ``random``, numpy's global generator,
                                   torch (CPU) and CUDA
    trainer_state.json             the step and what the loop adds (examples consumed, total steps)

Everything is JSON or safetensors, written by this module and read back by it: **nothing is unpickled on resume**
(accelerate's ``save_state`` / ``load_state`` are not used: they read ``optimizer.bin``, ``scheduler.bin``,
``custom_checkpoint_N.pkl`` and ``random_states_N.pkl`` through ``torch.load``/pickle, so a planted file there ran
code). Any other file in a step folder is ignored. The main process writes the shared files, every process its own
``random_states_R``. A folder without ``trainer_state.json`` is not a checkpoint (a crash mid-save leaves only a
``.step-N.tmp`` folder, which is ignored and replaced by the next save).

Run fingerprint
---------------
``<output>/run.json`` (the run folder's :class:`robustir.runs.Artifact` record of :func:`run_fingerprint`) records what determines a run's result: its settings (the
whole configuration minus the fields marked operational on the config itself, plus the number of processes) and a digest of every input it reads (:func:`input_digest`). The loop writes it when a run starts afresh
and compares it before resuming from a checkpoint or reusing a finished model, so an output folder never mixes two
runs (:meth:`~robustir.training.loop.TrainingLoop.open_output`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import ConfigError
from ..io import input_digest, write_json  # input_digest: part of this module's API (run fingerprints)

__all__ = ["FINGERPRINT_FILE", "input_digest", "list_checkpoints",
           "load_checkpoint", "load_state_files", "resume_latest", "run_fingerprint", "save_checkpoint",
           "save_state_files"]

if TYPE_CHECKING:
    from ..runs import Fingerprint

logger = logging.getLogger(__name__)

FINGERPRINT_FILE = "run.json"  # the run folder's record (robustir.runs.Artifact, kept inside the folder)


# ---------------------------------------------------------------------------- checkpoints

def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as ``(step, path)``, oldest first."""
    found = []
    for path in Path(root).glob("step-*"):
        suffix = path.name.split("-", 1)[1]
        if path.is_dir() and suffix.isdigit() and (path / "trainer_state.json").exists():
            found.append((int(suffix), path))
    return sorted(found)


def _encode(obj: Any, tensors: dict[str, torch.Tensor], key: str) -> Any:
    """``obj`` as JSON, its tensors moved to ``tensors`` (under ``key``-derived names) and referenced by name.

    Tuples, numpy arrays and dicts with non-string keys are tagged so :func:`_decode` rebuilds them exactly."""
    if torch.is_tensor(obj):
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, (bool, str)) or obj is None:
        return obj
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj)
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{key}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{key}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{key}/{k}") for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors, f"{key}/k{i}"), _encode(v, tensors, f"{key}/v{i}")]
                              for i, (k, v) in enumerate(obj.items())]}
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} at {key!r} (JSON values and tensors only)")


def _decode(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return np.asarray(obj["__ndarray__"], dtype=np.dtype(obj["dtype"]))
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def save_state_files(folder: Path, name: str, state: Any) -> None:
    """Write ``state`` (a state_dict: JSON values and tensors, nested) as ``name.json`` + ``name.safetensors``."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, tensors, name)
    if tensors:
        save_file(tensors, str(Path(folder) / f"{name}.safetensors"))
    write_json(Path(folder) / f"{name}.json", skeleton)


def load_state_files(folder: Path, name: str) -> Any:
    """Read what :func:`save_state_files` wrote (JSON and safetensors only: nothing is unpickled)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    skeleton = json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))
    weights = folder / f"{name}.safetensors"
    tensors = load_file(str(weights)) if weights.exists() else {}
    return _decode(skeleton, tensors)


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: Mapping[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(accelerator, root: Path, step: int, keep: int, *, model: torch.nn.Module, optimizer,
                    scheduler, objects: Sequence[Any] = (), state: dict[str, Any] | None = None) -> Path:
    """Write ``step-N`` via a temporary folder (a crash mid-save never leaves a half checkpoint behind).

    ``model``: the unwrapped model; ``objects``: more objects with ``state_dict`` (e.g. a loss with state);
    ``state``: extra JSON written into ``trainer_state.json`` next to the step (e.g. examples consumed);
    ``keep``: how many checkpoints to keep (older ones are deleted; ``<= 0`` keeps all).
    """
    from safetensors.torch import save_model

    root = Path(root)
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    save_state_files(tmp, f"random_states_{accelerator.process_index}", _rng_states())
    if accelerator.is_main_process:
        save_model(model, str(tmp / "model.safetensors"))
        save_state_files(tmp, "optimizer", optimizer.state_dict())
        save_state_files(tmp, "scheduler", scheduler.state_dict())
        for index, obj in enumerate(objects):
            save_state_files(tmp, f"state_{index}", obj.state_dict())
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json(tmp / "trainer_state.json", {"step": step, **(state or {})})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path, *, model: torch.nn.Module, optimizer, scheduler,
                    objects: Sequence[Any] = ()) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (unwrapped), ``optimizer``,
    ``scheduler``, ``objects`` and this process's RNGs. Only JSON and safetensors files are read."""
    from safetensors.torch import load_model

    path = Path(path)
    rank = accelerator.process_index
    needed = ["model.safetensors", "optimizer.json", "scheduler.json", f"random_states_{rank}.json",
              *(f"state_{i}.json" for i in range(len(objects)))]
    missing = [name for name in needed if not (path / name).exists()]
    if missing:
        raise ConfigError(
            f"checkpoint {path} lacks {', '.join(missing)}: it was written by an older robustir (whose checkpoints "
            "are pickle files, which are never loaded: they can run code) or by another number of processes. "
            "Fix: start this run over with resume=false (clears the folder's checkpoints), or use a new --output")
    # read on the CPU (safetensors refuses device names such as "cpu:0"); load_state_dict copies onto the model's
    load_model(model, str(path / "model.safetensors"), strict=True, device="cpu")
    optimizer.load_state_dict(load_state_files(path, "optimizer"))
    scheduler.load_state_dict(load_state_files(path, "scheduler"))
    for index, obj in enumerate(objects):
        obj.load_state_dict(load_state_files(path, f"state_{index}"))
    _set_rng_states(load_state_files(path, f"random_states_{rank}"))


def resume_latest(accelerator, root: Path, log_path: Path, total_steps: int, *, model: torch.nn.Module, optimizer,
                  scheduler, objects: Sequence[Any] = ()) -> int:
    """Load the newest complete checkpoint under ``root`` (:func:`load_checkpoint`) and return its step (0: none).

    Log lines past that step were written after the checkpoint and will be redone, so the main process drops
    them from ``log_path`` (one line per step, with a ``step`` field).
    """
    existing = list_checkpoints(root)
    if not existing:
        return 0
    step, path = existing[-1]
    if step > total_steps:
        raise ConfigError(f"{path} is past the run's {total_steps} steps: the checkpoints belong to another run. "
                          "Fix: use a new --output, or start over with resume=false")
    load_checkpoint(accelerator, path, model=model, optimizer=optimizer, scheduler=scheduler, objects=objects)
    if step == total_steps:
        logger.info("%s: the run is complete (step %d of %d): nothing left to train, writing its outputs",
                    path, step, total_steps)
    else:
        logger.info("resumed from %s (step %d of %d)", path, step, total_steps)
    if accelerator.is_main_process and Path(log_path).exists():
        kept = [line for line in Path(log_path).read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        Path(log_path).write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    return step


# ---------------------------------------------------------------------------- run fingerprint

def run_fingerprint(config: Any, *, processes: int, inputs: Mapping[str, Any] | None = None) -> "Fingerprint":
    """The fingerprint of a run (:func:`robustir.runs.fingerprint`): ``config`` without the fields marked
    operational on the config itself (``epochs`` dropped when ``max_steps`` is set), the number of ``processes``,
    and ``inputs`` (name -> :func:`input_digest`, digested by the stage, which reuses them)."""
    from ..runs import fingerprint, settings_of

    settings = settings_of(config)
    if settings.get("max_steps") is not None:
        settings.pop("epochs", None)
    settings["processes"] = int(processes)
    return fingerprint(type(config).__name__, settings, digested=inputs)
