"""The one training loop under fine-tuning (:func:`robustir.training.trainer.train`) and pre-training
(:func:`robustir.pretraining.pretrain.pretrain`).

A stage builds its data, model and loss; :class:`TrainingLoop` does everything else:

* set-up: :mod:`accelerate` (device placement, DDP with ``find_unused_parameters``, autocast in the resolved
  precision), ``set_seed``.
  The device is ``config.device`` (:func:`robustir.device.resolve_device`): ``cpu`` forces the CPU
  (``Accelerator(cpu=True)``); ``auto`` takes the GPU when there is one; ``cuda:N`` in a single process makes GPU N
  the current device (``torch.cuda.set_device``) before accelerate places the model there. Under ``torchrun`` the
  launcher decides: each process takes the GPU of its ``LOCAL_RANK``, so ``device`` must be ``auto``, ``cuda`` or
  ``cpu`` there (``cuda:N`` is a :class:`~robustir.errors.ConfigError`; restrict the GPUs with
  ``CUDA_VISIBLE_DEVICES`` instead);
* :meth:`TrainingLoop.open_output`: the run fingerprint (the folder's record ``run.json``: the settings that determine
  the result and a digest of every input, :func:`~robustir.training.checkpoints.run_fingerprint`). An output
  folder holds one run: a folder with checkpoints or a finished model is resumed or reused only when its
  fingerprint equals this run's, otherwise a :class:`~robustir.errors.ConfigError` names what differs;
  ``resume=false`` starts over (the folder's checkpoints, log and stage outputs are deleted first). A finished run
  re-run with the same fingerprint is reported complete and not trained again. The stage calls it before its
  data preparation (which may cache files in the folder); :meth:`~TrainingLoop.prepare` calls it otherwise;
* :meth:`TrainingLoop.prepare`: AdamW and the linear schedule
  (:func:`~robustir.training.optim.adamw_with_linear_schedule`), ``accelerator.prepare``, the checkpointed
  objects (the scheduler, stepped by hand once per optimizer step, and whatever state the stage adds, e.g.
  PEG's ``t``), resume from the latest ``checkpoints/step-N``
  (:func:`~robustir.training.checkpoints.resume_latest`: JSON and safetensors only, nothing is unpickled; it also
  drops log lines past that step), and, on a fresh start, the run's configuration file and an empty
  ``train_log.jsonl``;
* :meth:`TrainingLoop.run`: the step loop. The stage's ``step_fn(step)`` does one step's forward and backward and
  returns its log values; the loop clips the gradients (``max_grad_norm``), steps the optimizer and the schedule,
  logs every ``logging_steps`` steps (and at the last one) a ``train_log.jsonl`` line (``step``, ``epoch``, ``lr``,
  ``grad_norm``, the throughput, then the step's values averaged over the processes), and checkpoints every
  ``save_steps`` steps, at the end and on ``stop_after`` (leave as if interrupted; the next run resumes and ends
  with the same weights). Checkpoints record ``examples_per_process`` and ``total_steps`` next to the step.
  With ``batches`` (an :class:`~robustir.training.input_pipeline.InputPipeline`, fine-tuning's) the step's batch is
  made ahead in the background and handed to ``step_fn``; the loop logs the time it waited for it
  (``data_wait_seconds``, ``data_wait_share``) and closes the pipeline however it leaves.

The fields the loop reads are :class:`LoopConfig`, the base of :class:`~robustir.training.arguments.TrainConfig`
and :class:`~robustir.pretraining.pretrain.PretrainConfig`, so each is declared (and documented) once.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ..config import to_dict
from ..runs import Artifact, Fingerprint, Job, Step, operational
from ..errors import ConfigError
from ..io import write_json
from ..precision import Precision, accelerate_mixed_precision, resolve_precision
from ..validation import (config_dataclass, Epochs, MAX_STEPS, NonNegativeFloat, OpenFraction, PositiveFloat,
                          PositiveInt, Seed, Steps)
from .checkpoints import (list_checkpoints, resume_latest,
                          run_fingerprint, save_checkpoint)
from .input_pipeline import InputPipeline
from .optim import adamw_with_linear_schedule

__all__ = ["LoopConfig", "LoopResult", "TrainingLoop", "loop_step", "steps_for_epochs"]

logger = logging.getLogger(__name__)


def steps_for_epochs(epochs: float, steps_per_epoch: float) -> int:
    """The optimizer steps of ``epochs`` passes of ``steps_per_epoch`` steps (at least 1); more than
    :data:`~robustir.validation.MAX_STEPS` is a :class:`ConfigError` naming both numbers (a progress bar or a
    schedule of 10**300 steps fails deep inside a library)."""
    steps = epochs * steps_per_epoch
    if not math.isfinite(steps) or steps > MAX_STEPS:
        raise ConfigError(f"epochs = {epochs:g} x {steps_per_epoch:g} steps per epoch = {steps:.3g} optimizer steps; a "
                          f"run takes at most {MAX_STEPS:,}: lower epochs, or set max_steps")
    return max(1, math.ceil(steps))


@config_dataclass
class LoopConfig:
    """What the training loop reads, shared by fine-tuning and pre-training. The defaults are fine-tuning's;
    :class:`~robustir.pretraining.pretrain.PretrainConfig` redeclares ``lr`` and ``output`` with its own.

    Fields marked :func:`~robustir.runs.operational` never change a run's result and stay out of its fingerprint:
    where it is written and whether it resumes, how often it logs and checkpoints, the report figures, activation
    recomputation (same forward, same dropout masks) and the device (a run may move between machines and resume;
    the CPU and a GPU draw other dropout masks, as with any change of hardware). Everything else counts,
    ``chunk_size`` included (GradCache draws other dropout masks than one plain forward); ``epochs`` counts only
    without ``max_steps``."""

    # optimisation
    batch_size: PositiveInt = 32
    """Examples per process per step: queries (train), texts (retromae) or pairs (gur)"""
    epochs: Epochs = 1.0
    """Passes over the training data (max_steps overrides)"""
    max_steps: Steps | None = None
    """Total optimizer steps; overrides epochs (pre-training: skips counting the data)"""
    lr: PositiveFloat = 2e-5
    """Peak learning rate (linear warm-up, then linear decay to 0)"""
    warmup_ratio: OpenFraction = 0.1
    """Share of the steps that warm the learning rate up."""
    weight_decay: NonNegativeFloat = 0.01
    """AdamW weight decay (none on biases and normalisation weights)"""
    max_grad_norm: PositiveFloat | None = 1.0
    """Clip the gradient norm to this (None = no clipping)"""
    seed: Seed = 42
    """Seed of the data order, the model's new weights and every sampler."""
    precision: Precision = "auto"
    """Forward-pass autocast; auto: bf16 where native, else fp32; fp16: GPU only."""
    device: str = operational("auto")
    """Where it trains: auto (first GPU if any, else CPU), cpu, cuda, cuda:N (torchrun: not cuda:N)"""
    gradient_checkpointing: bool = operational(False)
    """Recompute activations in the backward pass (less memory, slower)"""
    # output, checkpoints, logging
    output: str = operational("runs/train")
    """Run folder: model/, checkpoints, train_log.jsonl, report."""
    save_steps: PositiveInt | None = operational(None)
    """Checkpoint every N steps; None = every epoch (train), at the end only (pretrain)"""
    save_total_limit: int = operational(2)
    """Checkpoints kept (older ones are deleted; <= 0 keeps all)"""
    logging_steps: PositiveInt = operational(1)
    """Write a train_log.jsonl line every N steps (and at the last step)"""
    resume: bool = operational(True)
    """Continue from the latest checkpoint in the output folder."""
    on_change: Literal["refuse", "redo"] = operational("refuse")
    """An output folder holding another run (other settings or inputs): refuse, naming what differs, or redo (start
    afresh there; for work folders a stage owns, such as the passage sieve's model)."""
    report: bool = operational(True)
    """Write the report (figures) at the end."""
    process_timeout_s: PositiveInt | None = operational(None)
    """Under torchrun: how long a process waits in a collective for the others before it fails (a node killed or
    frozen mid-run); None = PyTorch's default (30 min). Must exceed the longest phase one process runs alone while
    the others wait: dense mining and evaluation on the main process."""

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.max_steps is None and self.epochs <= 0:
            raise ConfigError(f"epochs must be > 0, got {self.epochs}")
        if self.logging_steps < 1:
            raise ConfigError("logging_steps must be >= 1")
        if not str(self.output).strip():  # "" would be the current folder: the run's files would land in it
            raise ConfigError("output is empty; name the run folder, e.g. output=runs/my-run")


@dataclass
class LoopResult:
    steps: int  # optimizer steps done (all of them, resumed ones included)
    interrupted: bool  # left early on stop_after (a checkpoint holds the state; the stage saves no outputs)
    last: dict[str, float] = field(default_factory=dict)  # the last logged values (averaged over processes)
    step_seconds: float = 0.0  # wall time of the steps run by this call (data, forward, backward, optimizer)
    data_wait_seconds: float = 0.0  # of which blocked waiting for the next batch (only with ``batches``)

    @property
    def data_wait_share(self) -> float:
        return self.data_wait_seconds / self.step_seconds if self.step_seconds > 0 else 0.0


def loop_step(name: str, config: type, stage: Callable[[Any], Any]) -> Step:
    """A stage run by the training loop (fine-tuning, pre-training) as a :class:`~robustir.runs.Step`: its output
    is the run folder (``job.output``, else the config's ``output``) with its record ``run.json``; the loop's
    :meth:`TrainingLoop.open_output` answers "done?" through :meth:`Artifact.decide` (every process, the same
    answer), with ``on_change`` (None: the config's) and ``overwrite`` (start over: ``resume=false``);
    ``stage(config)`` returns a result whose ``already_complete`` says it found the run finished."""
    import dataclasses

    def run(options: Any, job: Job, *, on_change: str | None = None, overwrite: bool = False) -> Any:
        changes: dict[str, Any] = {"output": job.output} if job.output else {}
        if on_change is not None:
            changes["on_change"] = on_change
        if overwrite:
            changes["resume"] = False
        return stage(dataclasses.replace(options, **changes) if changes else options)

    return Step(name, config, run=run, decides=lambda result: bool(result.already_complete),
                output=lambda options, job: Artifact(job.output or options.output, what=f"{name} run", inside=True))


def _launched_distributed() -> bool:
    """Whether this process was started by a launcher (``torchrun``, ``accelerate launch``) with others."""
    import os

    return int(os.environ.get("LOCAL_RANK", "-1")) != -1 or int(os.environ.get("WORLD_SIZE", "1")) > 1


def _select_device(spec: str) -> bool:
    """Check ``spec`` and make its GPU the current one; returns accelerate's ``cpu`` flag (see the module docstring)."""
    from ..device import resolve_device

    text = str(spec).strip().lower()
    if _launched_distributed() and text.startswith("cuda:"):
        resolve_device(spec)  # a malformed spec or a missing GPU says so first
        raise ConfigError(
            f"device {spec!r}: under torchrun each process trains on the GPU of its LOCAL_RANK, so a GPU number cannot "
            "be chosen. Fix: use device auto (or cuda), and choose the GPUs the launcher hands out with "
            "CUDA_VISIBLE_DEVICES, e.g. CUDA_VISIBLE_DEVICES=2,3 torchrun --nproc_per_node 2 ...")
    device = resolve_device(spec)
    if device.type == "cpu":
        return True
    if not _launched_distributed():
        torch.cuda.set_device(device)  # accelerate's single-process device is "cuda": the current GPU
    return False


def _training_precision(spec: str, cpu: bool) -> str:
    """The resolved precision a run trains in (:mod:`robustir.precision`). fp16 on the CPU is refused: accelerate
    has no CPU fp16 autocast and would train in fp32 without a word."""
    resolved = resolve_precision(spec, torch.device("cpu") if cpu else torch.device("cuda"))
    if cpu and resolved == "fp16":
        raise ConfigError("precision fp16: training on the CPU has no fp16 autocast (accelerate would silently train "
                          "in fp32). Fix: use precision auto, bf16 or fp32 on the CPU, or train on a GPU")
    return resolved


def _forget_other_accelerator_state(cpu: bool, mixed_precision: str) -> None:
    """accelerate keeps one state per process and refuses an ``Accelerator`` with another device or precision than
    the first one's; in a single process (not under a launcher) a new run forgets the earlier run's state instead, so
    every run in one process (the pipeline's stages, tests) gets its own ``device`` and ``precision``."""
    if _launched_distributed():
        return
    from accelerate.state import AcceleratorState, PartialState

    if not PartialState._shared_state:
        return
    device = PartialState._shared_state.get("device")
    precision = AcceleratorState._shared_state.get("_mixed_precision")
    if (device is not None and device.type != ("cpu" if cpu else "cuda")) or \
            (precision is not None and precision != mixed_precision):
        AcceleratorState._reset_state(reset_partial_state=True)


class TrainingLoop:
    """Set-up, optimiser, checkpoints, resume, logging and the step loop of one run (see the module docstring).

    ``config_file``: name of the configuration written to the output folder when a run starts afresh.
    """

    #: what :meth:`open_output` found: "fresh" (a new run), "resume" (this run's folder: continue from its latest
    #: checkpoint, if any) or "complete" (this run finished here already: nothing to do)
    output_state: str | None

    def __init__(self, config: LoopConfig, *, config_file: str) -> None:
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, set_seed

        config.validate()
        self.config = config
        self.config_file = config_file
        cpu = _select_device(config.device)
        self.precision = _training_precision(config.precision, cpu)
        mixed_precision = accelerate_mixed_precision(self.precision)
        _forget_other_accelerator_state(cpu, mixed_precision)
        handlers: list = [DistributedDataParallelKwargs(find_unused_parameters=True)]
        if config.process_timeout_s is not None:  # the process group's collectives fail after this long
            from datetime import timedelta

            handlers.append(InitProcessGroupKwargs(timeout=timedelta(seconds=config.process_timeout_s)))
        self.accelerator = Accelerator(mixed_precision=mixed_precision, cpu=cpu, kwargs_handlers=handlers)
        self.out = Path(config.output)
        self.out.mkdir(parents=True, exist_ok=True)
        set_seed(config.seed)
        self.started = time.perf_counter()
        self.checkpoint_root = self.out / "checkpoints"
        self.log_path = self.out / "train_log.jsonl"
        self.model: torch.nn.Module | None = None
        self.optimizer = None
        self.scheduler = None
        self.total_steps = 0
        self.start_step = 0
        self.checkpointed: tuple[Any, ...] = ()
        self.output_state = None
        self.fingerprint: Fingerprint | None = None
        self._log_handle = None

    # ------------------------------------------------------------------------ conveniences

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def seconds(self) -> float:
        """Seconds since the loop was set up."""
        return time.perf_counter() - self.started

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The prepared model without its DDP wrapper (for encoding, evaluation and saving)."""
        return self.accelerator.unwrap_model(self.model)

    # ------------------------------------------------------------------------ set-up and resume

    @property
    def run_record(self) -> Artifact:
        """The run folder's record (``<output>/run.json``): the run's fingerprint, whether it finished, its steps."""
        return Artifact(self.out, what="training run", inside=True)

    @property
    def fingerprint_path(self) -> Path:
        return self.run_record.record_path

    @property
    def completed_steps(self) -> int | None:
        """Steps of the finished run this folder holds (``output_state == "complete"``), else None."""
        return self.run_record.report.get("steps") if self.output_state == "complete" else None

    def open_output(self, inputs: Mapping[str, Any] | None = None, *, outputs: tuple[str, ...] = (),
                    finished: tuple[str, ...] = ()) -> str:
        """Check that the output folder is this run's, before anything is written into it; returns
        :attr:`output_state` ("fresh", "resume" or "complete").

        ``inputs``: name -> :func:`~robustir.training.checkpoints.input_digest` of every file the run reads (model,
        data, heads); ``outputs``: names (glob patterns) of what the stage writes into the folder, deleted with the
        checkpoints, the log and the configuration file when the run starts afresh; ``finished``: the outputs a
        finished run leaves (e.g. ``model``). The configuration's operational fields (marked on the field) are not
        part of the fingerprint.

        * ``resume`` true and the folder's fingerprint equal to this run's: "complete" when the run finished here
          (its fingerprint says so and every ``finished`` output is there; the stage returns them as they are),
          else "resume";
        * ``resume`` true, a different fingerprint (or none, from an older robustir) and checkpoints or a finished
          output in the folder: :class:`~robustir.errors.ConfigError` naming what differs and how to go on;
        * otherwise "fresh": the earlier run's checkpoints, log and outputs are deleted, the fingerprint written.

        Every process computes the fingerprint and the decision (the same one); the main process writes.
        """
        if self.output_state is not None:
            return self.output_state
        config, accelerator = self.config, self.accelerator
        made = run_fingerprint(config, processes=accelerator.num_processes, inputs=inputs)
        record = self._read_record()
        checkpoints = list_checkpoints(self.checkpoint_root)
        present = [name for name in finished if (self.out / name).exists()]
        earlier = ([f"{len(checkpoints)} checkpoint(s) (latest step {checkpoints[-1][0]})"] if checkpoints else []) \
            + [f"a finished {name}/" for name in present]
        accelerator.wait_for_everyone()  # every process has looked at the folder before the main one changes it
        fix = (f"Fix: give this run a new --output, or start over in {self.out} by adding resume=false to the "
               "command (or resume: false to the config file), which deletes the earlier run's checkpoints, log and "
               "outputs there.")
        if not config.resume and (earlier or record is not None):
            logger.warning("resume=false: starting over in %s (deleting the earlier run's checkpoints, log and "
                           "outputs)", self.out)
        # the one "done?" rule (robustir.runs.Artifact.decide); what the run left in the folder (checkpoints, a
        # finished model) is the work another fingerprint must not silently take over
        decision = self.run_record.decide(made, on_change=config.on_change, overwrite=not config.resume,
                                          work=earlier, fix=fix)
        state = {"reuse": "complete", "resume": "resume", "fresh": "fresh"}[decision.state]
        if state == "complete" and not (finished and len(present) == len(finished)):
            state = "resume"  # recorded complete, but a finished output is gone: rebuilt from the last checkpoint
        if state == "fresh" and self.is_main:
            self._clear(outputs)
            self.run_record.start(made)
        elif state == "complete":
            logger.info("%s already holds this run, complete after %s steps (same settings and inputs): nothing to "
                        "do. To train it again, add resume=false", self.out, self.run_record.report.get("steps"))
        accelerator.wait_for_everyone()
        self.fingerprint, self.output_state = made, state
        return state

    def _read_record(self) -> dict[str, Any] | None:
        path = self.fingerprint_path
        if not path.exists():
            return None
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path} is unreadable ({exc}): the output folder's run cannot be identified. Fix: "
                              "use a new --output, or start over there with resume=false") from None
        if not isinstance(saved, dict) or Fingerprint.from_json(saved.get("fingerprint")) is None:
            raise ConfigError(f"{path} is not a run record. Fix: use a new --output, or start over there with "
                              "resume=false")
        return saved

    def _clear(self, outputs: tuple[str, ...]) -> None:
        """Delete an earlier run's checkpoints, log, configuration and the stage's outputs (main process)."""
        import shutil

        targets = [self.checkpoint_root, self.log_path, self.out / self.config_file, self.fingerprint_path]
        for pattern in outputs:
            targets.extend(sorted(self.out.glob(pattern)))
        for target in targets:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()

    def prepare(self, model: torch.nn.Module, total_steps: int, checkpointed: tuple[Any, ...] = ()) -> int:
        """Build AdamW and the schedule for ``total_steps``, prepare ``model`` (then :attr:`model`; the bare one is
        :attr:`unwrapped`), checkpoint the scheduler and ``checkpointed`` (objects with ``state_dict`` and
        ``load_state_dict``, e.g. a loss with state) with them, and resume from the latest checkpoint when the
        output folder is this run's (:meth:`open_output`, called here with no inputs if the stage has not).

        Returns the step to start from (0 = a fresh run: the configuration is written, the log emptied).
        """
        self.open_output()
        config, accelerator = self.config, self.accelerator
        # named_parameters lists tied weights (embeddings / MLM decoder) once
        optimizer, scheduler = adamw_with_linear_schedule(model, config.lr, config.weight_decay,
                                                          config.warmup_ratio, total_steps)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.scheduler = scheduler
        self.total_steps = total_steps
        # the scheduler is stepped by hand once per optimizer step (accelerate would step it per process); it and
        # the stage's objects are checkpointed by robustir.training.checkpoints (JSON + safetensors), not registered
        # with accelerate (whose save_state / load_state pickle them)
        self.checkpointed = tuple(checkpointed)
        start_step = 0
        if self.output_state != "fresh":
            start_step = resume_latest(accelerator, self.checkpoint_root, self.log_path, total_steps,
                                       model=self.unwrapped, optimizer=self.optimizer, scheduler=scheduler,
                                       objects=self.checkpointed)
        if start_step == 0 and self.output_state == "complete":
            raise ConfigError(f"{self.out} holds this run, already complete, and no checkpoint to rebuild it from: "
                              "nothing to do. To train it again, add resume=false")
        if start_step == 0 and self.is_main:
            write_json(self.out / self.config_file, to_dict(config))
            self.log_path.unlink(missing_ok=True)
        accelerator.wait_for_everyone()
        self.start_step = start_step
        return start_step

    # ------------------------------------------------------------------------ the loop

    def log(self, record: Mapping[str, Any]) -> None:
        """Append one line to ``train_log.jsonl`` (main process only; others ignore the call)."""
        if not self.is_main:
            return
        if self._log_handle is not None:
            self._log_handle.write(json.dumps(record) + "\n")
            self._log_handle.flush()
        else:
            with open(self.log_path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")

    def run(self, step_fn: Callable[..., Mapping[str, Any]], *, save_steps: int, desc: str,
            throughput_key: str = "examples_per_s", epoch: Callable[[int], float | None] | None = None,
            stop_after: int | None = None, after_step: Callable[[int], None] | None = None,
            batches: InputPipeline | None = None) -> LoopResult:
        """Run the steps from :attr:`start_step` to :attr:`total_steps`.

        ``step_fn(step)`` (0-based) does one step's forward and backward on this process and returns its log
        values (floats or scalar tensors, averaged over the processes; or text, such as the step's training
        source, logged as it is; read only on logging steps). Logged as ``throughput_key``: examples per
        second over all processes (``batch_size`` x processes per step). ``epoch(done)``: the ``epoch`` field of
        the log line after ``done`` steps (None or absent: no field). ``after_step(done)``: called on every
        process after each step's log line and before its checkpoint (e.g. a periodic evaluation, which may
        :meth:`log`). ``stop_after``: leave after that many steps, with a checkpoint, as if interrupted.

        ``batches``: an :class:`~robustir.training.input_pipeline.InputPipeline` (not started) making each step's
        batch, in the background; the loop starts it at :attr:`start_step`, calls ``step_fn(step, batch)``, and
        closes it when it leaves, by an error too. The time blocked in ``batches.get`` is logged with each line as
        ``data_wait_seconds`` (over the steps since the previous line, this process) and ``data_wait_share`` (of
        their wall time), and summed in the result.
        """
        from tqdm.auto import tqdm

        if self.model is None:
            raise RuntimeError("TrainingLoop.run before prepare")
        config, accelerator = self.config, self.accelerator
        model, optimizer, scheduler, total_steps = self.model, self.optimizer, self.scheduler, self.total_steps
        world = accelerator.num_processes
        examples_per_step = config.batch_size * world
        model.train()
        bar = tqdm(total=total_steps, initial=self.start_step, desc=desc, disable=not self.is_main, unit="step",
                   dynamic_ncols=True)
        self._log_handle = open(self.log_path, "a", encoding="utf-8") if self.is_main else None
        last: dict[str, float] = {}
        step_seconds = wait_seconds = 0.0  # the whole call
        line_seconds = line_wait = 0.0  # since the previous log line
        try:
            if batches is not None:
                batches.start(self.start_step, total_steps)
            for step in range(self.start_step, total_steps):
                tick = time.perf_counter()
                if batches is not None:
                    batch = batches.get(step)
                    waited = time.perf_counter() - tick
                    outputs = step_fn(step, batch)
                    del batch
                else:
                    waited = 0.0
                    outputs = step_fn(step)
                grad_norm = None
                if config.max_grad_norm:
                    grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                took = time.perf_counter() - tick
                step_seconds, wait_seconds = step_seconds + took, wait_seconds + waited
                line_seconds, line_wait = line_seconds + took, line_wait + waited
                done = step + 1
                if done % config.logging_steps == 0 or done == total_steps:
                    # text values (the step's training source) are logged as they are, numbers averaged
                    values = {k: v if isinstance(v, str) else float(v.detach()) if torch.is_tensor(v) else float(v)
                              for k, v in outputs.items()}
                    if world > 1:  # per-process means: average them
                        numbers = [k for k, v in values.items() if not isinstance(v, str)]
                        stacked = accelerator.reduce(torch.tensor([values[k] for k in numbers],
                                                                  device=accelerator.device), reduction="mean")
                        values.update(zip(numbers, stacked.tolist()))
                    last = values
                    record: dict[str, Any] = {"step": done}
                    epoch_value = epoch(done) if epoch is not None else None
                    if epoch_value is not None:
                        record["epoch"] = epoch_value
                    record.update({"lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                                   throughput_key: examples_per_step / (time.perf_counter() - tick)})
                    if batches is not None:
                        record.update({"data_wait_seconds": round(line_wait, 6),
                                       "data_wait_share": round(line_wait / line_seconds, 6) if line_seconds else 0.0})
                    record.update(values)
                    self.log(record)
                    line_seconds = line_wait = 0.0
                    if self.is_main and "loss" in values:
                        bar.set_postfix(loss=f"{values['loss']:.4f}", refresh=False)
                if after_step is not None:
                    after_step(done)
                interrupted = stop_after is not None and done >= stop_after and done < total_steps
                if done % save_steps == 0 or done == total_steps or interrupted:
                    save_checkpoint(accelerator, self.checkpoint_root, done, config.save_total_limit,
                                    model=self.unwrapped, optimizer=optimizer, scheduler=scheduler,
                                    objects=self.checkpointed, state={"examples_per_process": done * config.batch_size,
                                                                      "total_steps": total_steps})
                bar.update(1)
                if interrupted:
                    accelerator.end_training()
                    return LoopResult(done, True, last, step_seconds, wait_seconds)
        finally:
            if batches is not None:
                batches.close()
            bar.close()
            if self._log_handle is not None:
                self._log_handle.close()
                self._log_handle = None
        if batches is not None and step_seconds:
            logger.info("waited %.1f s for training batches in %.1f s of steps (%.1f%%)", wait_seconds, step_seconds,
                        100 * wait_seconds / step_seconds)
        return LoopResult(total_steps, False, last, step_seconds, wait_seconds)

    def finish(self) -> None:
        """After the stage saved its outputs (on the main process): mark the run complete in its fingerprint (a
        re-run with the same one then has nothing to do), wait for every process, end the run."""
        self.accelerator.wait_for_everyone()
        if self.is_main and self.fingerprint is not None and self.output_state != "complete":
            self.run_record.finish({"steps": self.total_steps}, files=[])
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
