"""Score statistics for stage reports (mining, the filters) in bounded memory.

A report gives the mean, min, quartiles and max of every positive and negative score a run saw. Kept as a Python
list that is 32 bytes a score -- half a gigabyte for a million queries with fifteen negatives each. ``ScoreStats``
keeps every value up to ``limit`` (8 bytes each, so the statistics are exactly those of a list), and past it a
uniform sample of ``limit`` values (reservoir sampling, seeded, so the same run gives the same report) for the
quartiles, while count, mean, min and max stay exact.
"""

from __future__ import annotations

import random
from array import array
from typing import Iterable

import numpy as np

__all__ = ["ScoreStats"]


class ScoreStats:
    """Collects scores (``append`` / ``extend``, like a list); :meth:`summary` gives their statistics."""

    def __init__(self, limit: int = 1_000_000, seed: int = 0) -> None:
        self.limit = int(limit)
        self._values = array("d")
        self._rng = random.Random(seed)
        self.count = 0
        self._sum = 0.0
        self._min = float("inf")
        self._max = float("-inf")

    def append(self, value: float) -> None:
        value = float(value)
        self.count += 1
        self._sum += value
        self._min = min(self._min, value)
        self._max = max(self._max, value)
        if len(self._values) < self.limit:
            self._values.append(value)
        else:  # Algorithm R: the kept values stay a uniform sample of all seen
            slot = self._rng.randrange(self.count)
            if slot < self.limit:
                self._values[slot] = value

    def extend(self, values: Iterable[float]) -> None:
        for value in values:
            self.append(value)

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    @property
    def sampled(self) -> bool:
        """True once more values came than are kept (the quartiles are then those of the sample)."""
        return self.count > len(self._values)

    def __getitem__(self, index: slice) -> list[float]:
        """Kept values as a list (``stats[:n]``: the first ``n`` values, or ``n`` of the sample once sampled)."""
        return self._values[index].tolist()

    def array(self) -> np.ndarray:
        """The kept values (all of them unless :attr:`sampled`), float64."""
        return np.frombuffer(self._values, dtype=np.float64).copy()

    def summary(self, count: bool = True) -> dict:
        """``{"count", "mean", "min", "p25", "median", "p75", "max"}`` (``count`` only if asked; an empty
        collection gives ``{"count": 0}`` or ``{}``); a sampled one adds ``"quartiles_from_sample": n``."""
        if not self.count:
            return {"count": 0} if count else {}
        arr = self.array()
        out = {"count": self.count} if count else {}
        if self.sampled:
            out.update(mean=self._sum / self.count, min=self._min)
        else:
            out.update(mean=float(arr.mean()), min=float(arr.min()))
        out.update(p25=float(np.percentile(arr, 25)), median=float(np.median(arr)), p75=float(np.percentile(arr, 75)),
                   max=self._max if self.sampled else float(arr.max()))
        if self.sampled:
            out["quartiles_from_sample"] = len(self._values)
        return out
