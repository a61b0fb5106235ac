"""Ranges of config fields, declared next to the field and checked in one place.

A numeric field of a stage config declares its range in its type::

    batch_size: PositiveInt = 64
    relative_margin: Annotated[float, Range(ge=0, lt=1)] | None = 0.05

:func:`check_ranges` checks every field of a config (nested sections too): values out of range, and any float
that is not finite (NaN, inf), are a :class:`~robustir.errors.ConfigError` naming the key (``--batch-size`` is ``batch_size``), the value
and the allowed range. Configs derived from :class:`Checked` run it on construction, so the CLI (flags), config
files, ``key=value`` overrides, the pipeline runner and the Python API all get the same check;
:func:`robustir.config.from_dict` adds the key path (``filter.teacher.relative_margin``). Relations between
fields (``min_score <= max_score``) stay in each config's ``validate()``.

``typing.get_type_hints`` without ``include_extras`` drops the ``Annotated`` part, so flags, coercion and help
see plain ``int``/``float``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any

from .errors import ConfigError

__all__ = ["Range", "RangeError", "Checked", "check_ranges", "check_value", "PositiveInt", "NonNegativeInt", "PositiveFloat",
           "NonNegativeFloat", "Fraction", "OpenFraction", "Probability"]


@dataclass(frozen=True)
class Range:
    """Allowed values of a number: ``ge``/``gt`` lower and ``le``/``lt`` upper bounds (None = unbounded)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = True  # NaN and +-inf are out of range

    def describe(self) -> str:
        parts = []
        if self.ge is not None:
            parts.append(f">= {_num(self.ge)}")
        if self.gt is not None:
            parts.append(f"> {_num(self.gt)}")
        if self.le is not None:
            parts.append(f"<= {_num(self.le)}")
        if self.lt is not None:
            parts.append(f"< {_num(self.lt)}")
        return " and ".join(parts) if parts else "a finite number"

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return not self.finite
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


PositiveInt = Annotated[int, Range(ge=1)]
NonNegativeInt = Annotated[int, Range(ge=0)]
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegativeFloat = Annotated[float, Range(ge=0)]
Fraction = Annotated[float, Range(ge=0, le=1)]  # a share: 0..1
OpenFraction = Annotated[float, Range(ge=0, lt=1)]  # 0 <= x < 1 (a warm-up share, a relative margin)
Probability = Fraction
_FINITE = Range()


class RangeError(ConfigError):
    """A number outside its field's range; ``key`` is the field's path (a section prefix is added by
    :func:`robustir.config.from_dict`)."""

    def __init__(self, key: str, value: Any, rng: Range) -> None:
        self.key, self.value, self.range = key, value, rng
        what = "is not a finite number" if isinstance(value, float) and not math.isfinite(value) else "is out of range"
        super().__init__(f"{key} = {value!r} {what}: it must be {rng.describe()}")

    def under(self, section: str) -> "RangeError":
        return RangeError(f"{section}.{self.key}" if section else self.key, self.value, self.range)


def check_value(value: Any, where: str, rng: Range = _FINITE) -> None:
    """Raise :class:`RangeError` when number ``value`` (named ``where``) is outside ``rng`` (or not finite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if not rng.contains(value):
        raise RangeError(where, value, rng)


@functools.lru_cache(maxsize=None)
def _ranges(cls: type) -> tuple[tuple[str, Range | None, bool], ...]:
    """``(field, its Range or None, is_float)`` for the numeric fields of dataclass ``cls``."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        rng, kind = _unpack(hint)
        if kind in (int, float):
            out.append((f.name, rng, kind is float))
    return tuple(out)


def _unpack(hint: Any) -> tuple[Range | None, Any]:
    """The Range of ``hint`` (``Annotated[int, Range(..)]``, optionally ``| None``) and its base type."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            return None, None
        hint = args[0]
    if typing.get_origin(hint) is Annotated:
        base, *meta = typing.get_args(hint)
        ranges = [m for m in meta if isinstance(m, Range)]
        return (ranges[0] if ranges else None), base
    return None, hint


def check_ranges(config: Any, where: str | None = None) -> None:
    """Check every numeric field of dataclass ``config`` (and of its nested sections) against its range."""
    prefix = f"{where}." if where else ""
    for name, rng, is_float in _ranges(type(config)):
        value = getattr(config, name)
        if value is None:
            continue
        if rng is None and not is_float:
            continue
        check_value(value, prefix + name, rng or _FINITE)
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_ranges(value, prefix + f.name)


class Checked:
    """Mixin for config dataclasses: field ranges are checked on construction (and by ``dataclasses.replace``).

    A subclass with its own ``__post_init__`` calls ``super().__post_init__()``.
    """

    def __post_init__(self) -> None:
        check_ranges(self)
