"""Every stage of robustir as a :class:`~robustir.runs.Step`, by name: each step is defined next to the stage it
runs (``CHUNK`` in :mod:`robustir.data.chunking`, ``MINE`` in :mod:`robustir.negatives.mining`, ...) and registered
when its module is imported; importing this module imports them all.

The CLI's commands that make an output (chunk, pairs, generate, mine, filter, train, pretrain, index) run these
steps through :func:`robustir.runs.execute`, the one start rule, and so does the pipeline runner.
``get_step("mine")`` is the step of ``robustir mine``. Training, pre-training and the index answer "done?" inside
their run, through the same rule on their own record (:attr:`robustir.runs.Step.decides`).
"""

from __future__ import annotations

from .data.chunking import CHUNK
from .errors import ConfigError
from .filtering.llm_judge import JUDGE
from .pretraining.pretrain import PRETRAIN
from .index.store.step import INDEX
from .training.sieve import SIEVE
from .training.trainer import TRAIN
from .filtering.teacher import TEACHER
from .negatives.mining import MINE
from .queries.generate import GENERATE
from .queries.pairs import PAIRS
from .runs import STEPS, Step

__all__ = ["CHUNK", "GENERATE", "INDEX", "JUDGE", "MINE", "PAIRS", "PRETRAIN", "SIEVE", "STEPS", "TEACHER", "TRAIN",
           "get_step"]


def get_step(name: str) -> Step:
    """The registered step ``name`` (``chunk``, ``pairs``, ``generate``, ``mine``, ``filter teacher``, ...)."""
    try:
        return STEPS[name]
    except KeyError:
        raise ConfigError(f"unknown step {name!r}; steps: {', '.join(sorted(STEPS))}") from None
