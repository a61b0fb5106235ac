"""Stage configs are pydantic v2 dataclasses: types, ranges and unknown keys are checked by pydantic, in one place.

Every stage config is declared with :func:`config_dataclass`::

    @config_dataclass
    class MiningConfig:
        num_negatives: PositiveInt = 15
        \"\"\"Negatives kept per query.\"\"\"
        relative_margin: Annotated[float, Range(ge=0, lt=1)] | None = None

It is a ``pydantic.dataclasses.dataclass`` with ``extra="forbid"``, non-finite floats refused and field
descriptions read from the attribute docstrings (they are the CLI's help text). Construction validates, so the
CLI's flags, config files, ``key=value`` overrides, the pipeline runner and the Python API all get the same
checks; a :class:`pydantic.ValidationError` becomes one :class:`OptionError` (a
:class:`~robustir.errors.ConfigError`) naming each key by its path, the value, what is wrong and -- for an unknown
key -- the closest known one. Relations between fields (``min_score <= max_score``) stay in each config's
``__post_init__`` / ``validate()``; a ``ConfigError`` raised there keeps its message, prefixed by its section.

Paths may be given as :class:`os.PathLike` for ``str`` fields (they become ``str``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import types
import typing
from typing import Annotated, Any, TypeVar

import annotated_types
from pydantic import AfterValidator, BeforeValidator, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic.dataclasses import dataclass as _pydantic_dataclass

from .errors import ConfigError

__all__ = ["config_dataclass", "Range", "Because", "OptionError", "cli", "field_range", "PositiveInt",
           "NonNegativeInt", "PositiveFloat", "NonNegativeFloat", "Fraction", "OpenFraction", "Probability", "Items",
           "Seed", "MAX_SEED", "Epochs", "MAX_EPOCHS", "Steps", "MAX_STEPS", "ModelName"]

T = TypeVar("T")

CONFIG = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False, coerce_numbers_to_str=True,
                    arbitrary_types_allowed=True)


def Range(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
          lt: float | None = None) -> annotated_types.Interval:
    """The allowed values of a number field: ``Annotated[int, Range(ge=0, le=64)]`` (pydantic checks it)."""
    return annotated_types.Interval(ge=ge, gt=gt, le=le, lt=lt)


class Because:
    """Why a field has its :func:`Range`, said after a value out of it: ``Annotated[int, Range(le=2**32 - 1),
    Because("numpy's random generators take no larger seed")]``."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _split_commas(value: Any) -> Any:
    """``"fp,fn"`` (a ``key=value`` override or a YAML scalar) is the list ``["fp", "fn"]``; so is each string of a
    list (the CLI gives ``--seeds 1,2`` as ``["1,2"]``)."""
    if isinstance(value, str):
        return [item for item in value.split(",") if item]
    if isinstance(value, (list, tuple)) and any(isinstance(item, str) and "," in item for item in value):
        return [part for item in value for part in (_split_commas(item) if isinstance(item, str) else [item])]
    return value


Items = Annotated[list[T], BeforeValidator(_split_commas)]  # a list, also given as "a,b,c"
PositiveInt = Annotated[int, Range(ge=1)]
NonNegativeInt = Annotated[int, Range(ge=0)]
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegativeFloat = Annotated[float, Range(ge=0)]
Fraction = Annotated[float, Range(ge=0, le=1)]  # a share: 0..1
OpenFraction = Annotated[float, Range(ge=0, lt=1)]  # 0 <= x < 1 (a warm-up share, a relative margin)
Probability = Fraction
def _named(value: Any) -> Any:
    if isinstance(value, str) and not value.strip():
        raise ConfigError("is empty (an unset shell variable?); name a model folder or hub id, or leave it out for "
                          "the default")
    return value


#: a model folder or hub id: an empty one (``--rerank-model "$UNSET"``) is refused, not read as "the default"
ModelName = Annotated[str, AfterValidator(_named)]
#: numpy's seed range (``np.random.seed`` / ``default_rng`` through ``transformers.set_seed``): 0 .. 2**32 - 1
MAX_SEED = 2**32 - 1
Seed = Annotated[int, Range(ge=0, le=MAX_SEED), Because("numpy's random generators take seeds from 0 to 2**32 - 1")]
#: more optimizer steps than any run takes (a step a millisecond would run 11 days); bounds epochs x steps per epoch
MAX_STEPS = 10**9
MAX_EPOCHS = 1e6
Epochs = Annotated[float, Range(gt=0, le=MAX_EPOCHS), Because(
    f"a training run takes at most {MAX_STEPS:,} steps; for a step budget set max_steps")]
Steps = Annotated[int, Range(ge=1, le=MAX_STEPS), Because(f"a training run takes at most {MAX_STEPS:,} steps")]


def cli(flag: str | None = None, *, flatten: bool = False) -> Any:
    """A config field's command-line form, put in its type: ``kind: Annotated[IndexKind, cli("index")] = "flat"``.
    ``flag`` renames the flag (``--index`` instead of ``--kind``); ``flatten`` gives a section's fields flags of
    their own (``llm.base_url`` → ``--base-url`` instead of ``--llm.base-url``). It is cyclopts' ``Parameter``
    (:mod:`robustir.cli.common`)."""
    from cyclopts import Parameter

    return Parameter(name="*") if flatten else Parameter(name=f"--{flag}") if flag else Parameter()


def config_dataclass(cls: type[T]) -> type[T]:
    """Make ``cls`` a pydantic dataclass (see the module docstring) whose validation errors are :class:`OptionError`."""
    cls._refuse_true_as_a_number = field_validator("*", mode="before")(_refuse_true_as_a_number)  # type: ignore
    cls = _pydantic_dataclass(cls, config=CONFIG)
    # the help of each field's flag: pydantic's description (the attribute docstring, dedented); cyclopts would
    # otherwise parse the docstring from the source itself and keep the indentation of its continuation lines
    for f in dataclasses.fields(cls):
        description = cls.__pydantic_fields__[f.name].description
        if description and "help" not in f.metadata:
            f.metadata = types.MappingProxyType({**f.metadata, "help": description})
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs = {k: (os.fspath(v) if isinstance(v, os.PathLike) else v) for k, v in kwargs.items()}
        try:
            init(self, *args, **kwargs)
        except ValidationError as exc:
            raise OptionError.from_validation(exc, type(self)) from None

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


def _refuse_true_as_a_number(cls: type, value: Any, info: ValidationInfo) -> Any:
    """pydantic's lax mode reads ``true`` as the number 1 (``batch_size=true``): refused, as a number is meant."""
    if isinstance(value, bool) and info.field_name:
        members = _members(cls.__pydantic_fields__[info.field_name].annotation)
        if bool not in members and any(m in (int, float) for m in members):
            raise ConfigError(f"expected {'an integer' if int in members else 'a number'}, got {value!r}")
    return value


class OptionError(ConfigError):
    """Bad config values: ``problems`` is a list of ``(key path, what is wrong)``. A text that follows its key
    (``" = 0 is out of range ..."``, ``": expected ..."``) is shown after the key (``config`` for the top level); any
    other text -- a config's own check at the top level -- is shown as it is. :meth:`under` puts them under a
    section."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{key or 'config'}{text}" if _follows_key(text) else text
                                   for key, text in problems))

    def under(self, section: str) -> "OptionError":
        join = lambda key: f"{section}{key}" if key.startswith("[") else f"{section}.{key}" if key else section
        return OptionError([(join(key), text if _follows_key(text) else f": {text}")
                            for key, text in self.problems]) if section else self

    @classmethod
    def from_validation(cls, exc: ValidationError, config: type) -> "OptionError":
        return cls([problem for error in _deepest(exc.errors(include_url=False))
                    for problem in _explain(error, config)])


def _follows_key(text: str) -> bool:
    return text.startswith((":", " = ", " is "))


def _deepest(errors: list[dict]) -> list[dict]:
    """Of the errors for one field, those with the longest location: a union such as ``str | list[TrainSource]``
    reports one error per member; the member that got furthest names the real problem."""
    best: dict[Any, int] = {}
    for error in errors:
        head = error["loc"][0] if error["loc"] else None
        best[head] = max(best.get(head, 0), len(error["loc"]))
    out, seen = [], set()
    for error in errors:
        head = error["loc"][0] if error["loc"] else None
        key = (head, error["type"], error["loc"])
        if len(error["loc"]) == best[head] and key not in seen:
            seen.add(key)
            out.append(error)
    return out


def _walk(config: type, loc: tuple) -> tuple[str, type | None, str | None, Any]:
    """``(key path, the config class owning the last field, that field's name, the type there)`` for a pydantic
    error location.

    Union member tags in the location (``'list[TrainSource]'``) are dropped; list positions become ``[i]``."""
    key, owner, name = "", config, None
    current: Any = config
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
            current = _item_type(current)
            continue
        fields = _fields(current)
        if fields is not None and part in fields:
            owner, name = current, part
            key = f"{key}.{part}" if key else part
            current = _section_type(fields[part])
        # else: a union member tag, or an unknown key (handled by the caller)
    return key, owner, name, current


def _fields(cls: Any) -> dict[str, Any] | None:
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        return {f.name: hints.get(f.name) for f in dataclasses.fields(cls)}
    return None


def _section_type(hint: Any) -> Any:
    """The dataclass (or list of dataclasses) inside a field's type hint, else the hint (``Annotated`` removed)."""
    members = _members(hint)
    for arg in members:
        if dataclasses.is_dataclass(arg) or typing.get_origin(arg) in (list, tuple):
            return arg
    return members[0] if len(members) == 1 else hint


def _item_type(hint: Any) -> Any:
    for arg in _members(hint):
        if typing.get_origin(arg) in (list, tuple) and typing.get_args(arg):
            return _section_type(typing.get_args(arg)[0])
    return None


def _members(hint: Any) -> list[Any]:
    if typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [_members(a)[0] for a in typing.get_args(hint) if a is not type(None)]
    return [hint]


_BOUNDS = {"greater_than_equal", "greater_than", "less_than_equal", "less_than"}
_KINDS = {"int": "an integer", "float": "a number", "bool": "true/false", "string": "a string", "list": "a list",
          "dict": "a mapping", "tuple": "a list"}


def _explain(error: dict, config: type) -> list[tuple[str, str]]:
    """``(key path, what is wrong)`` for one pydantic error; the text follows the key (``" = 0 is out of ..."``)."""
    kind, loc, value = error["type"], tuple(error["loc"]), error.get("input")
    ctx = error.get("ctx") or {}
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        key, _, _, section = _walk(config, loc[:-1])
        known = sorted(_fields(section) or {})
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return [(key, f": unknown option {str(loc[-1])!r}{hint}; known: {', '.join(known)}")]
    key, owner, name, current = _walk(config, loc)
    if kind in ("value_error", "assertion_error") and isinstance(ctx.get("error"), ConfigError):
        inner = ctx["error"]  # raised by a config's own checks (__post_init__) or a type's (ModelName)
        if isinstance(inner, OptionError):
            return inner.under(key).problems
        return [(key, (f" {inner}" if str(inner).startswith("is ") else f": {inner}") if key else str(inner))]
    shown = f"{value!r}" if not isinstance(value, dict) or len(repr(value)) < 200 else "a mapping"
    if kind in _BOUNDS:
        rng = field_range(owner, name) if owner is not None and name else None
        why = _because(owner, name) if owner is not None and name else None
        return [(key, f" = {value} is out of range: it must be {_describe(rng, ctx)}" + (f" ({why})" if why else ""))]
    if kind == "finite_number":
        return [(key, f" = {value} is not a finite number")]  # a number, or its text (``lr=nan``)
    if kind == "literal_error":
        values = list(typing.get_args(current)) if typing.get_origin(current) is typing.Literal else None
        return [(key, f": {shown} is not one of {values or ctx.get('expected', '')}")]
    if kind in ("missing", "missing_argument", "missing_keyword_only_argument", "missing_positional_only_argument"):
        return [(key, ": missing; give a value")]
    if kind in ("dataclass_type", "dataclass_args_type", "model_type"):
        return [(key, f": is a section of options (a mapping such as {{key: value}}), got {shown}")]
    stem = kind.split("_")[0]
    if stem in _KINDS and kind.endswith(("_type", "_parsing", "_from_float", "parsing_size")):
        return [(key, f": expected {_KINDS[stem]}, got {shown}")]
    return [(key, f": {error.get('msg', kind)} (got {shown})")]


def _metadata(cls: type, name: str) -> list[Any]:
    """The annotations (:func:`Range`, :class:`Because`) of field ``name`` of config ``cls``, also those of an
    optional field's type (``Seed | None``)."""
    info = getattr(cls, "__pydantic_fields__", {}).get(name)
    if info is None:
        return []
    metadata = list(info.metadata)
    for member in typing.get_args(info.annotation):
        if typing.get_origin(member) is Annotated:
            metadata += typing.get_args(member)[1:]
    return metadata


def _because(cls: type, name: str) -> str | None:
    """The :class:`Because` declared on field ``name`` of config ``cls`` (None if it has none)."""
    return next((m.reason for m in _metadata(cls, name) if isinstance(m, Because)), None)


def field_range(cls: type, name: str) -> annotated_types.Interval | None:
    """The :func:`Range` declared on field ``name`` of config ``cls`` (None if it has none)."""
    bounds: dict[str, Any] = {}
    for meta in _metadata(cls, name):
        for bound in ("ge", "gt", "le", "lt"):
            if getattr(meta, bound, None) is not None:
                bounds[bound] = getattr(meta, bound)
    return annotated_types.Interval(**bounds) if bounds else None


def _describe(rng: annotated_types.Interval | None, ctx: dict) -> str:
    bounds = {b: getattr(rng, b) for b in ("ge", "gt", "le", "lt") if rng is not None and getattr(rng, b) is not None}
    bounds = bounds or {b: ctx[b] for b in ("ge", "gt", "le", "lt") if b in ctx}
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return " and ".join(f"{signs[b]} {_num(v)}" for b, v in bounds.items()) or "a finite number"


def _num(value: float) -> str:
    return str(int(value)) if isinstance(value, (int, float)) and math.isfinite(value) and float(value).is_integer() \
        else str(value)
