"""Checkpoint folders of the training loop (:mod:`robustir.training.loop`, fine-tuning and pre-training).

Layout: ``<root>/step-N/`` holds the :mod:`accelerate` state (model, optimizer, registered objects such as the
scheduler, RNG states) plus ``trainer_state.json``; a folder without that file is not a checkpoint (a crash
mid-save leaves only a ``.step-N.tmp`` folder, which is ignored and replaced by the next save).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from ..io import write_json

__all__ = ["list_checkpoints", "resume_latest", "save_checkpoint"]

logger = logging.getLogger(__name__)


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as ``(step, path)``, oldest first."""
    found = []
    for path in Path(root).glob("step-*"):
        if path.is_dir() and (path / "trainer_state.json").exists():
            found.append((int(path.name.split("-")[1]), path))
    return sorted(found)


def save_checkpoint(accelerator, root: Path, step: int, keep: int, state: dict[str, Any] | None = None,
                    **save_kwargs: Any) -> Path:
    """Write ``step-N`` via a temporary folder (a crash mid-save never leaves a half checkpoint behind).

    ``state``: extra JSON written into ``trainer_state.json`` next to the step (e.g. examples consumed);
    ``keep``: how many checkpoints to keep (older ones are deleted; ``<= 0`` keeps all);
    ``save_kwargs`` go to ``accelerator.save_state``.
    """
    root = Path(root)
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), **save_kwargs)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json(tmp / "trainer_state.json", {"step": step, **(state or {})})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def resume_latest(accelerator, root: Path, log_path: Path, total_steps: int) -> int:
    """Load the newest complete checkpoint under ``root`` into ``accelerator`` and return its step (0: none).

    Log lines past that step were written after the checkpoint and will be redone, so the main process drops
    them from ``log_path`` (one line per step, with a ``step`` field).
    """
    existing = list_checkpoints(root)
    if not existing:
        return 0
    step, path = existing[-1]
    accelerator.load_state(str(path))
    logger.info("resumed from %s (step %d of %d)", path, step, total_steps)
    if accelerator.is_main_process and Path(log_path).exists():
        kept = [line for line in Path(log_path).read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        Path(log_path).write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    return step
