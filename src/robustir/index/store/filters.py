"""A small JSON filter language for search: parsed into a typed tree, evaluated in Python, compiled to LanceDB.

It is independent of any store: :func:`parse_filter` checks a request's ``filter`` against the field names an index
knows and returns a :data:`Filter` (frozen dataclasses); :func:`matches` evaluates one on a record (the reference
semantics, and a post-filter for stores without a query language);
:func:`~robustir.index.store.lance_sql.to_lance_sql` compiles one to a LanceDB
``.where()`` expression over a table of ``id``, ``title`` and ``fields`` (the extra fields as a ``lance.json``
column), as :mod:`robustir.index.store` writes it.

**Grammar.** A filter is a JSON object; its keys are ANDed.

* ``{"lang": "en"}`` equality; ``{"lang": ["en", "de"]}`` any of (shorthand for ``$in``);
* ``{"price": {"$eq": v}}``, ``{"$ne": v}``, ``{"$in": [v, ...]}``, ``{"$nin": [v, ...]}`` (non-empty lists),
  ``{"$gt" | "$gte" | "$lt" | "$lte": v}``; several operators in one object are ANDed:
  ``{"price": {"$gte": 1, "$lt": 5}}``;
* ``{"meta.year": {"$gte": 2020}}``: a nested field, ``fields["meta"]["year"]``;
* ``{"url": {"$exists": true}}``: the field has a value (``{"$ne": null}``); ``false``: it is missing or null;
* ``{"$$price": 3}``: the field named ``$price`` (a top-level key beginning with ``$`` is an operator, so a field
  name beginning with ``$`` is written with one more ``$``);
* ``{"$and": [f, ...]}``, ``{"$or": [f, ...]}`` (non-empty lists), ``{"$not": f}``: sub-filters of the same grammar;
* ``{}``: every document.

Fields are ``id`` (``_id`` too), ``title`` and the extra fields of the indexed records; a dotted name is a path
under a known top-level field (a known name containing dots is taken whole first, then the longest known prefix).
``text`` cannot be filtered on. Names with ``"``, ``\\``, control characters or empty segments (``a..b``) are refused,
so a name can always be written into a JSON path safely. Values are strings, finite numbers (integers within 64
bits), ``true``, ``false`` and ``null``; ranges take a number or a string.

**Semantics** (:func:`matches` and ``to_lance_sql`` agree exactly, checked by randomised tests on real LanceDB
tables):

* a missing field, or a path through something that is not an object, is ``null``; so ``{"x": null}`` matches
  documents where ``x`` is missing or null, and ``{"x": {"$ne": null}}`` those where it has a value;
* ``$ne`` / ``$nin`` are the negation of ``$eq`` / ``$in``: ``{"lang": {"$ne": "en"}}`` also matches documents
  without a ``lang`` (``{"lang": {"$nin": ["en", null]}}`` asks for another value);
* equality is by JSON kind: ``true`` equals only ``true`` (not ``1``); ``1`` equals ``1.0``; a string never equals a
  number (``"1"`` is not ``1``); objects and arrays equal no value;
* ranges match only values of the operand's kind: numbers with numbers, strings with strings in code-point order
  (booleans are not numbers); ``{"year": {"$gt": 2020}}`` never matches ``"2021"``;
* ``id`` and ``title`` are strings.

**Limits**, so no request makes the process do unbounded work: at most :data:`MAX_DEPTH` levels of
``$and``/``$or``/``$not``, :data:`MAX_CONDITIONS` conditions in all (each field test, logical operator and empty object
counts one) and :data:`MAX_LIST_ITEMS` values in all ``$in``/``$nin`` lists.

Every problem is a :class:`~robustir.errors.ConfigError` of one line naming the place in the filter
(``filter.$or[1].price.$gt``), what is wrong and how to fix it.

Compiled to LanceDB by :mod:`robustir.index.store.lance_sql` (:func:`~robustir.index.store.lance_sql.to_lance_sql`).
"""

from __future__ import annotations

import difflib
import json
import math
import operator
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from ...errors import ConfigError

__all__ = ["FIELD_OPERATORS", "LOGICAL_OPERATORS", "MAX_CONDITIONS", "MAX_DEPTH", "MAX_LIST_ITEMS",
           "And", "Condition", "Filter", "Not", "Or", "Scalar", "matches", "parse_filter"]

MAX_DEPTH = 8
MAX_CONDITIONS = 256
MAX_LIST_ITEMS = 1000

Scalar = str | int | float | bool | None
Operator = Literal["$eq", "$ne", "$in", "$nin", "$gt", "$gte", "$lt", "$lte"]
#: what a field test may say: the operators above and ``$exists`` (read as ``$ne`` / ``$eq`` null)
FIELD_OPERATORS: tuple[str, ...] = (*get_args(Operator), "$exists")
#: operators of other filter languages (MongoDB, Chroma, Qdrant) that this one has not, and what to do instead
_FOREIGN = {"$regex": "pattern matching", "$like": "pattern matching", "$contains": "substring tests",
            "$text": "full-text search", "$all": "array tests", "$size": "array tests", "$elemMatch": "array tests",
            "$mod": "arithmetic", "$type": "type tests", "$where": "code", "$expr": "expressions"}
LOGICAL_OPERATORS: tuple[str, ...] = ("$and", "$or", "$not")
_LISTS = ("$in", "$nin")
_RANGES: dict[str, Callable[[Any, Any], bool]] = {"$gt": operator.gt, "$gte": operator.ge, "$lt": operator.lt,
                                                  "$lte": operator.le}
_SQL_RANGES = {"$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}
_INT64 = (-(2 ** 63), 2 ** 63 - 1)
_ALIASES = {"_id": "id"}  # BEIR's name for the id
_STRING_FIELDS = ("id", "title")  # always strings, never nested
_VALUES = "a string, a finite number, true, false or null"


@dataclass(frozen=True)
class Condition:
    """One test of one field: ``path`` is the top-level field then the nested keys (``("meta", "year")``),
    ``value`` a scalar, or a tuple of scalars for ``$in`` / ``$nin``."""

    path: tuple[str, ...]
    op: Operator
    value: Scalar | tuple[Scalar, ...]


@dataclass(frozen=True)
class And:
    """Every part matches (no parts: every record)."""

    parts: tuple[Filter, ...]


@dataclass(frozen=True)
class Or:
    """At least one part matches (no parts: no record)."""

    parts: tuple[Filter, ...]


@dataclass(frozen=True)
class Not:
    """The part does not match."""

    part: Filter


Filter = Condition | And | Or | Not


# ---------------------------------------------------------------------------------------------------------- parsing

def parse_filter(obj: Any, fields: Iterable[str]) -> Filter:
    """Check ``obj`` (a request's ``filter``) against the grammar and the index's field names ``fields`` (``id``,
    ``title`` and the extra fields) and return its tree; a :class:`ConfigError` naming the place otherwise."""
    return _Parser(fields).filter(obj, "filter", 0)


class _Parser:
    """One parse: the known fields and what the filter has used of its budget so far."""

    def __init__(self, fields: Iterable[str]) -> None:
        self.fields = list(dict.fromkeys(fields))
        self.known = set(self.fields)
        self.conditions = 0
        self.items = 0

    def filter(self, obj: Any, at: str, depth: int) -> Filter:
        if not isinstance(obj, Mapping):
            raise _error(at, f"expected a filter object such as {{\"lang\": \"en\"}}, got {_show(obj)}")
        if not obj:
            self.count(at)
            return And(())
        parts: list[Filter] = []
        for key, value in obj.items():
            if not isinstance(key, str):
                raise _error(at, f"keys are field names or $and/$or/$not, got {_show(key)}")
            if key.startswith("$$"):  # a field whose name begins with '$' ("$$price" tests the field "$price")
                parts.extend(self.field(key[1:], value, at))
            elif key.startswith("$"):
                parts.append(self.logical(key, value, f"{at}.{_name(key)}", depth))
            else:
                parts.extend(self.field(key, value, at))
        return parts[0] if len(parts) == 1 else And(tuple(parts))

    def logical(self, key: str, value: Any, at: str, depth: int) -> Filter:
        if key not in LOGICAL_OPERATORS:
            if key in FIELD_OPERATORS:
                raise _error(at, f"{key} tests a field: write {{\"price\": {{\"{key}\": ...}}}}")
            raise _error(at, f"unknown operator {_quoted(key)}{_did_you_mean(key, LOGICAL_OPERATORS)}; here a key is a "
                             f"field name or one of {', '.join(LOGICAL_OPERATORS)} (a field named {_quoted(key)} is "
                             f"written {_quoted('$' + key)})")
        if depth >= MAX_DEPTH:
            raise _error(at, f"the filter nests more than {MAX_DEPTH} levels of $and/$or/$not; flatten it (an $and "
                             "inside an $and is one $and; {\"$not\": {\"$not\": f}} is f)")
        self.count(at)
        if key == "$not":
            return Not(self.filter(value, at, depth + 1))
        if not isinstance(value, list) or not value:
            raise _error(at, f"expected a non-empty list of filters such as [{{\"lang\": \"en\"}}, {{\"year\": 2020}}], "
                             f"got {_show(value)}")
        if self.conditions + len(value) > MAX_CONDITIONS:
            raise self.too_many(at)
        parts = tuple(self.filter(item, f"{at}[{i}]", depth + 1) for i, item in enumerate(value))
        return And(parts) if key == "$and" else Or(parts)

    def field(self, key: str, value: Any, at: str) -> list[Condition]:
        at = f"{at}.{_name(key)}"
        path = self.resolve(key, at)
        if isinstance(value, list):
            if not value:
                raise _error(at, "an empty list matches nothing; give at least one value")
            return [self.condition(path, "$in", value, at)]
        if not isinstance(value, Mapping):
            return [self.condition(path, "$eq", value, at)]
        if not value:
            raise _error(at, "an empty object tests nothing; give a value or operators such as {\"$gte\": 2020}")
        conditions = []
        for op, operand in value.items():
            if not isinstance(op, str) or not op.startswith("$"):
                nested = f"; a nested field is written {json.dumps(f'{key}.{op}')}" if isinstance(op, str) else ""
                raise _error(at, f"expected a value or an object of operators ({', '.join(FIELD_OPERATORS)}), got the "
                                 f"key {_quoted(op) if isinstance(op, str) else _show(op)}{nested}")
            conditions.append(self.condition(path, op, operand, f"{at}.{_name(op)}"))
        return conditions

    def resolve(self, key: str, at: str) -> tuple[str, ...]:
        """The field path of ``key``: a known field, or a known field then nested keys (dotted)."""
        key = _ALIASES.get(key, key) if key not in self.known else key
        if key == "text" or key.startswith("text."):
            raise _error(at, "filtering on 'text' is not supported: filter on id, title or a metadata field")
        bad = next((c for c in key if c in '"\\' or unicodedata.category(c) in ("Cc", "Cs")), None)
        if bad is not None:
            raise _error(at, f"field names with quotes, backslashes or control characters cannot be filtered on "
                             f"(found {_show(bad)}); rename the field in the corpus")
        if "" in key.split("."):
            raise _error(at, "a field name is empty or has an empty segment (a leading, trailing or double dot); write "
                             "\"parent.child\"")
        if key in self.known:
            return (key,)
        top = max((f for f in self.known if key.startswith(f + ".")), key=len, default=None)
        if top is None:
            names = ", ".join(self.fields[:50]) + (f", ... ({len(self.fields) - 50} more)" if len(self.fields) > 50
                                                   else "")
            first = key.split(".")[0]
            hint = _did_you_mean(key, self.fields) or _did_you_mean(first, self.fields)
            raise _error(at, f"{_quoted(key)} is in no document of this index{hint}; fields: {names}")
        if top in _STRING_FIELDS:
            raise _error(at, f"'{top}' is a string and has no nested fields; filter on '{top}' itself")
        return (top, *key[len(top) + 1:].split("."))

    def condition(self, path: tuple[str, ...], op: str, operand: Any, at: str) -> Condition:
        if op not in FIELD_OPERATORS:
            if op in LOGICAL_OPERATORS:
                raise _error(at, f"{op} combines filters, not values: write {{\"{op}\": ...}} around whole filters, "
                                 f"e.g. {{\"$not\": {{\"{'.'.join(path)}\": ...}}}}")
            if op in _FOREIGN:
                raise _error(at, f"{op} is not supported: robustir filters compare whole values, with no "
                                 f"{_FOREIGN[op]}; operators: {', '.join(FIELD_OPERATORS)} (for text, search with "
                                 "mode lexical or hybrid)")
            raise _error(at, f"unknown operator {_quoted(op)}{_did_you_mean(op, FIELD_OPERATORS)}; operators: "
                             f"{', '.join(FIELD_OPERATORS)}")
        self.count(at)
        if op == "$exists":  # has a value (not missing, not null) / has none: the $ne / $eq null tests
            if not isinstance(operand, bool):
                raise _error(at, f"expected true or false, got {_show(operand)}: {{\"$exists\": true}} matches documents "
                                 "where the field has a value (not missing, not null)")
            return Condition(path, "$ne" if operand else "$eq", None)
        if op in _LISTS:
            if not isinstance(operand, list) or not operand:
                raise _error(at, f"expected a non-empty list of values such as [\"en\", \"de\"], got {_show(operand)}")
            if self.items + len(operand) > MAX_LIST_ITEMS:
                raise _error(at, f"the filter's lists hold more than {MAX_LIST_ITEMS} values in all; filter on fewer "
                                 "values (or on a field that groups them)")
            self.items += len(operand)
            return Condition(path, op, tuple(self.scalar(v, f"{at}[{i}]") for i, v in enumerate(operand)))
        if op in _RANGES and (operand is None or isinstance(operand, bool) or not isinstance(operand, (int, float, str))):
            raise _error(at, f"expected a number or a string, got {_show(operand)}; a range compares numbers with "
                             f"numbers and strings with strings, e.g. {{\"{op}\": 2020}}")
        return Condition(path, op, self.scalar(operand, at))  # type: ignore[arg-type]

    def scalar(self, value: Any, at: str) -> Scalar:
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            if not _INT64[0] <= value <= _INT64[1]:
                raise _error(at, "an integer beyond 64 bits cannot be compared exactly; write it as a float or a string")
            return int(value)
        if isinstance(value, float):
            if not math.isfinite(value):
                raise _error(at, f"expected a finite number, got {_show(value)}; NaN and infinities equal nothing")
            return float(value)
        if isinstance(value, str):
            _check_text(value, at)
            return str(value)
        raise _error(at, f"expected {_VALUES}, got {_show(value)}; a list of values is written {{\"$in\": [...]}}")

    def count(self, at: str) -> None:
        self.conditions += 1
        if self.conditions > MAX_CONDITIONS:
            raise self.too_many(at)

    @staticmethod
    def too_many(at: str) -> ConfigError:
        return _error(at, f"the filter has more than {MAX_CONDITIONS} conditions; use $in with a list of values, or "
                          "split the request")


def _check_text(value: str, at: str) -> None:
    """A string value must be comparable in every store: no NUL (stores written in C stop reading there), valid
    Unicode."""
    if "\x00" in value:
        raise _error(at, "a string with a NUL character (\\u0000) cannot be compared; remove it")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _error(at, "a string with a lone surrogate (\\ud800-\\udfff) is not valid Unicode; send the character "
                         "itself or a surrogate pair") from None


def _error(at: str, problem: str) -> ConfigError:
    return ConfigError(f"{at}: {problem}")


def _name(key: str) -> str:
    """A key as it appears in an error's path: itself when short and printable, else JSON-quoted (one line)."""
    return key if key and len(key) <= 60 and key.isprintable() else json.dumps(key[:60] + ("..." if key[60:] else ""))


def _quoted(key: str) -> str:
    """A name quoted in an error message, Python-style (``'colour'``), at most ~60 characters, one line."""
    return repr(key[:60] + ("..." if key[60:] else ""))


def _show(value: Any) -> str:
    """A value in an error message: compact JSON, at most 60 characters, always one line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = f"a Python {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------------------------------------------------- evaluation

def matches(f: Filter, record: Mapping[str, Any]) -> bool:
    """Whether ``record`` (``{"id": ..., "title": ..., **extra_fields}``) passes ``f``, by the module's semantics."""
    if isinstance(f, Condition):
        return _test(f, _lookup(record, f.path))
    if isinstance(f, And):
        return all(matches(part, record) for part in f.parts)
    if isinstance(f, Or):
        return any(matches(part, record) for part in f.parts)
    if isinstance(f, Not):
        return not matches(f.part, record)
    raise TypeError(f"not a filter: {f!r}")


def _lookup(record: Any, path: tuple[str, ...]) -> Any:
    value = record
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None  # missing, or a path through a non-object: null
        value = value[key]
    return value


def value_kind(value: Any) -> str:
    """The JSON kind of a value as the filter semantics compare it: string, number, bool, null, array or object."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, (list, tuple)) else "object"


def _kind(value: Any) -> str:
    kind = value_kind(value)
    return "other" if kind in ("array", "object") else kind  # objects and arrays equal no value


def _number(value: Any) -> Any:
    """A JSON integer beyond 64 bits is read as a float (±inf beyond the float range), as LanceDB reads it."""
    if isinstance(value, int) and not isinstance(value, bool) and not _INT64[0] <= value <= _INT64[1]:
        try:
            return float(value)
        except OverflowError:
            return math.copysign(math.inf, value)
    return value


def _equal(value: Any, wanted: Scalar) -> bool:
    kind = _kind(value)
    return kind == _kind(wanted) and (kind == "null" or _number(value) == wanted)


def _test(c: Condition, value: Any) -> bool:
    if c.op == "$eq":
        return _equal(value, c.value)  # type: ignore[arg-type]
    if c.op == "$ne":
        return not _equal(value, c.value)  # type: ignore[arg-type]
    if c.op in _LISTS:
        found = any(_equal(value, v) for v in c.value)  # type: ignore[union-attr]
        return found if c.op == "$in" else not found
    kind = _kind(c.value)
    return _kind(value) == kind and kind in ("number", "string") and _RANGES[c.op](_number(value), c.value)


# ---------------------------------------------------------------------------------------------------------- LanceDB
