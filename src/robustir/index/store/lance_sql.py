"""A filter of :mod:`robustir.index.store.filters` compiled to a LanceDB ``.where()`` expression (:func:`to_lance_sql`),
the typed columns it reads (:func:`column_kind`) and the kinds an index records of its fields (:func:`check_kinds`).

**LanceDB** (lancedb 0.40, DataFusion SQL) has no bound parameters and no ``CASE`` in filters, and its JSON functions
are uneven: ``json_extract(fields, '$."a"."b"')`` follows a JSONPath (quoted names: object keys only, never an array
index) and returns JSON text (``"x"`` quoted, ``1.0``, ``true``); ``json_extract_with_type(...)['type_tag']`` gives the
kind (0 null or missing, 1 bool, 2 int64, 3 float, 4 string, 5 array, 6 object, 7 uint64); ``json_get`` takes one key
(chainable; a numeric key indexes an array); ``json_get_string`` / ``_int`` / ``_float`` / ``_bool`` take one key, no
path, and fail the whole query on a value of another kind. So :func:`to_lance_sql` reads the kind from the type tag;
compares an int64 as ``TRY_CAST(text AS BIGINT)`` and any other number as ``DOUBLE``, each against a bound of the same
type computed here (DataFusion would compare an int with a float as floats: ``9007199254740993 = 9007199254740992.0``
is true there; integers beyond int64 compare as floats, as in :func:`matches`); reads a string with
``json_get_string`` of its parent object (``json_get`` per level) under a key that is ``NULL`` unless the type tag says
string; and wraps every test in ``coalesce(..., false)`` so it is two-valued. Values are written as ``'...'`` literals
(``'`` doubled; backslashes are literal there) and ``repr`` of checked numbers; names only inside such literals, when
made of allowed characters. One limit of its own: a nested field path of at most :data:`MAX_LANCE_PATH` segments
(LanceDB's SQL parser gives up near 25 levels of nesting under 8 ``$not``); a longer one is refused with a
:class:`ConfigError` naming the field, not answered differently.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, get_args

from ...errors import ConfigError
from .filters import (And, Condition, Filter, MAX_DEPTH, Not, Operator, Or, Scalar, _INT64, _LISTS, _SQL_RANGES,
                      _STRING_FIELDS, _VALUES, _check_text, _error, _kind, _name, _quoted, _show, value_kind)

__all__ = ["MAX_LANCE_PATH", "COLUMN_KINDS", "column_kind", "exact_kind", "column_value", "fits_column", "to_lance_sql",
           "record_kinds",
           "check_kinds", "MAX_RECORDED_PATHS"]

# The Unicode categories a field-name segment may be made of in a Lance JSON path or key (everything but control
# characters and surrogates; '"' and '\' are refused on their own): inside $."..." the JSONPath parser ends a name at
# '"' and reads '\' as an escape, nothing else is special there; tests write a name of each category.
_LANCE_KEY_CATEGORIES = frozenset({"Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd", "Ps",
                                   "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cf", "Co", "Cn"})
MAX_LANCE_PATH = 16  # segments in a nested field path: LanceDB's SQL parser stops at ~50 levels of nesting
_LANCE_NULL, _LANCE_INT, _LANCE_STRING = 0, 2, 4  # json_extract_with_type's type_tag (1 bool, 3 float, 7 uint64)
_LANCE_FLOAT = "(3, 7)"  # float64; uint64 (newer Lance; 0.40 tags integers beyond int64 3): matches reads as floats



#: the kinds of a typed column (:func:`column_kind`) and their Arrow types
COLUMN_KINDS = ("string", "int", "float", "bool")
_FLOAT_EXACT = 2 ** 53  # an int a float64 column holds exactly


def column_kind(kinds: Iterable[str]) -> str | None:
    """The typed column a top-level field can have, from the exact kinds its values hold (:func:`exact_kind`), or
    ``None`` (kept in the JSON column only): strings, booleans, int64 integers, or floats (with integers a float64
    holds exactly). Nulls and missing values fit any column (stored as ``NULL``, as :func:`matches` reads them)."""
    held = set(kinds) - {"null"}
    for kind, fits in (("string", {"string"}), ("bool", {"bool"}), ("int", {"int", "int64"}),
                       ("float", {"float", "int"})):
        if held and held <= fits:
            return kind
    return None


def exact_kind(value: Any) -> str:
    """A value's kind for typing a column: null, bool, string, float, int (exactly a float64 too), int64 (beyond
    2**53 within 64 bits) or other (arrays, objects, integers beyond 64 bits)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, str):
        return "string"
    if isinstance(value, float):
        return "float"
    if isinstance(value, int):
        return "int" if abs(value) <= _FLOAT_EXACT else "int64" if _INT64[0] <= value <= _INT64[1] else "other"
    return "other"


def column_value(kind: str, value: Any) -> Any:
    """What a typed column of ``kind`` stores for ``value``: the value (a float in a float column), or ``None`` when it
    is null, missing or does not fit (a writer stops using a column that a value does not fit)."""
    held = exact_kind(value)
    if kind == "float" and held in ("float", "int"):
        return float(value)
    return value if (kind, held) in {("string", "string"), ("bool", "bool"), ("int", "int"), ("int", "int64")} else None


def fits_column(kind: str, value: Any) -> bool:
    """Whether a typed column of ``kind`` holds ``value`` exactly (null and missing fit every column)."""
    return value is None or column_value(kind, value) is not None


def to_lance_sql(f: Filter, columns: Mapping[str, tuple[str, str]] | None = None) -> str:
    """A LanceDB ``WHERE`` expression (DataFusion SQL, for ``.where(sql)``) over a table of ``id`` and ``title``
    (strings) and ``fields`` (the extra fields, Arrow ``json_`` = ``lance.json``), with the semantics of
    :func:`matches`.

    LanceDB has no bound parameters, so values are written into the SQL: strings only as ``'...'`` literals with ``'``
    doubled (LanceDB reads ``\\`` literally), numbers as the ``repr`` of a checked int64 or finite float, booleans as
    ``true``/``false``; field names only inside such literals, as ``$."a"."b"`` JSON paths or ``json_get`` keys, and
    only when every character is of an allowed Unicode category (:class:`ConfigError` naming the field otherwise).
    Every test is two-valued (never SQL ``NULL``), so ``NOT`` is exact.

    ``columns`` (top-level field -> (column, kind)) names the typed columns the table holds beside ``fields``: a test
    of such a field reads its column directly (an Arrow string / int64 / float64 / bool column that LanceDB's scalar
    indexes serve), with the same semantics; every other field is read from the JSON."""
    columns = columns or {}
    if isinstance(f, Condition):
        return _LanceField(f.path, columns.get(f.path[0]) if len(f.path) == 1 else None).test(f)
    if isinstance(f, (And, Or)):
        if not f.parts:
            return "true" if isinstance(f, And) else "false"
        return "(" + (" AND " if isinstance(f, And) else " OR ").join(to_lance_sql(part, columns)
                                                                      for part in f.parts) + ")"
    if isinstance(f, Not):
        return f"(NOT {to_lance_sql(f.part, columns)})"
    raise TypeError(f"not a filter: {f!r}")


class _LanceField:
    """The SQL that reads one field: a string column (``id``, ``title``), or a path into ``fields``.

    For a JSON path: the kind is ``json_extract_with_type(...)['type_tag']`` (0 also when missing or through a
    non-object); a number is compared as ``BIGINT`` when stored as an int64 and as ``DOUBLE`` otherwise, each against a
    bound of its own type worked out here, never a mixed int/float comparison (DataFusion would round the int to a
    float); a boolean by its ``json_extract`` text (``true``/``false``); a string as ``json_get_string`` of its parent
    object (``json_get`` per level), whose key is ``NULL`` unless the value is a string, because ``json_get_string``
    fails on other kinds and LanceDB's filters have no ``CASE`` (so that read is ``NULL`` for every other kind, and is
    the kind test too). Each function call parses its JSONPath again for every row: fewer calls, faster filters."""

    def __init__(self, path: tuple[str, ...], typed: tuple[str, str] | None = None) -> None:
        self.at = "filter." + _name(".".join(path))
        self.column = path[0] if len(path) == 1 and path[0] in _STRING_FIELDS else None
        self.typed_kind = "string"
        if self.column is None and typed is not None:
            column, self.typed_kind = typed
            if not column.isidentifier() or self.typed_kind not in COLUMN_KINDS:
                raise _error(self.at, f"the typed column {column!r} ({self.typed_kind}) cannot be written into SQL")
            self.column = column
        if self.column is not None:
            return
        if not path or len(path) > MAX_LANCE_PATH:
            raise _error(self.at, f"a field path of {len(path)} levels cannot be filtered on in LanceDB (at most "
                                  f"{MAX_LANCE_PATH}); filter on a field nested less deeply")
        for key in path:
            bad = next((ch for ch in key if ch in '"\\' or unicodedata.category(ch) not in _LANCE_KEY_CATEGORIES),
                       None)
            if not key or bad is not None:
                raise _error(self.at, f"the field name segment {_quoted(key)} cannot be written into a LanceDB JSON "
                                      f"path (found {_show(bad) if bad else 'an empty segment'}); rename the field")
        json_path = _sql_string("$" + "".join(f'."{key}"' for key in path))
        self.tag = f"coalesce(json_extract_with_type(fields, {json_path})['type_tag'], {_LANCE_NULL})"
        self.text = f"json_extract(fields, {json_path})"
        parent = "fields"
        for key in path[:-1]:
            parent = f"json_get({parent}, {_sql_string(key)})"
        key = f"nullif(repeat({_sql_string(path[-1])}, CAST({self.tag} = {_LANCE_STRING} AS INT)), '')"
        self.string = f"json_get_string({parent}, {key})"

    def test(self, c: Condition) -> str:
        if c.op not in get_args(Operator):  # a Condition built by hand ($exists is parsed into $ne / $eq null)
            raise _error(self.at, f"unknown operator {_quoted(c.op)}; operators: {', '.join(get_args(Operator))}")
        values = c.value if c.op in _LISTS else (c.value,)
        if not isinstance(values, tuple) or not values:
            raise _error(f"{self.at}.{c.op}", "expected a non-empty tuple of values")
        for value in values:
            self.check(value, f"{self.at}.{c.op}")
        if c.op in _SQL_RANGES:
            return self.range(_SQL_RANGES[c.op], c.value, f"{self.at}.{c.op}")  # type: ignore[arg-type]
        sql = self.equal_any(values)  # type: ignore[arg-type]
        return f"(NOT {sql})" if c.op in ("$ne", "$nin") else sql

    @staticmethod
    def check(value: Any, at: str) -> None:
        """Refuse a value that cannot be written exactly (a Condition not made by :func:`parse_filter`)."""
        if value is None or isinstance(value, bool):
            return
        if isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]:
            raise _error(at, "an integer beyond 64 bits cannot be compared exactly; write it as a float or a string")
        if isinstance(value, float) and not math.isfinite(value):
            raise _error(at, f"expected a finite number, got {_show(value)}")
        if isinstance(value, str):
            _check_text(value, at)
        elif not isinstance(value, (int, float)):
            raise _error(at, f"expected {_VALUES}, got {_show(value)}")

    def equal_any(self, values: tuple[Scalar, ...]) -> str:
        """Equal to one of ``values``, by JSON kind."""
        strings = list(dict.fromkeys(v for v in values if isinstance(v, str)))
        if self.column is not None:
            return self.typed_equal_any(values, strings)
        parts = []
        if any(v is None for v in values):
            parts.append(f"{self.tag} = {_LANCE_NULL}")
        bools = [text for flag, text in ((True, "'true'"), (False, "'false'")) if any(v is flag for v in values)]
        if bools:
            parts.append(f"coalesce({_sql_in(self.text, bools)}, false)")
        numbers = [v for v in values if _kind(v) == "number"]
        ints = list(dict.fromkeys(n for n in map(_as_int64, numbers) if n is not None))  # type: ignore[arg-type]
        floats = list(dict.fromkeys(x for x in map(_as_float, numbers) if x is not None))  # type: ignore[arg-type]
        if ints:
            parts.append(f"({self.tag} = {_LANCE_INT} AND coalesce({_sql_in(self.as_int, map(repr, ints))}, false))")
        if floats:
            parts.append(f"({self.tag} IN {_LANCE_FLOAT} AND coalesce({_sql_in(self.as_float, map(repr, floats))}, "
                         "false))")
        if strings:
            parts.append(f"coalesce({_sql_in(self.string, map(_sql_string, strings))}, false)")
        if not parts:
            return "false"  # numbers with no int64 and no float equal to them
        return parts[0] if len(parts) == 1 else "(" + " OR ".join(parts) + ")"

    def typed_equal_any(self, values: tuple[Scalar, ...], strings: list[str]) -> str:
        """``equal_any`` on a typed column: every non-null value there is of the column's kind."""
        kind, column = self.typed_kind, self.column
        literals: list[str] = []
        if kind == "string":
            literals = [_sql_string(v) for v in strings]
        elif kind == "bool":
            literals = [text for flag, text in ((True, "true"), (False, "false")) if any(v is flag for v in values)]
        else:
            numbers = [v for v in values if _kind(v) == "number"]
            convert = _as_int64 if kind == "int" else _as_float
            literals = [repr(n) for n in dict.fromkeys(convert(v) for v in numbers) if n is not None]  # type: ignore
        parts = [f"coalesce({_sql_in(column, literals)}, false)"] if literals else []  # type: ignore[arg-type]
        if any(v is None for v in values) and column not in _STRING_FIELDS:
            parts.append(f"{column} IS NULL")
        if not parts:
            return "false"
        return parts[0] if len(parts) == 1 else "(" + " OR ".join(parts) + ")"

    def range(self, op: str, value: Any, at: str) -> str:
        """``field op value`` for a value of the same kind (number or string)."""
        if isinstance(value, str):
            if self.column is not None:
                if self.typed_kind != "string":
                    return "false"
                return f"coalesce({self.column} {op} {_sql_string(value)}, false)"
            return f"coalesce({self.string} {op} {_sql_string(value)}, false)"
        if value is None or isinstance(value, bool):
            raise _error(at, f"expected a number or a string, got {_show(value)}")
        if self.column is not None:
            if self.typed_kind == "int":
                bound = _int64_bound(op, value)
                if isinstance(bound, bool):
                    return f"{self.column} IS NOT NULL" if bound else "false"
                return f"coalesce({self.column} {bound[0]} {bound[1]!r}, false)"
            if self.typed_kind == "float":
                float_op, float_bound = _float_bound(op, value)
                return f"coalesce({self.column} {float_op} {float_bound!r}, false)"
            return "false"
        parts = []
        bound = _int64_bound(op, value)
        if bound is True:
            parts.append(f"{self.tag} = {_LANCE_INT}")
        elif bound is not False:
            parts.append(f"({self.tag} = {_LANCE_INT} AND coalesce({self.as_int} {bound[0]} {bound[1]!r}, false))")
        float_op, float_bound = _float_bound(op, value)
        parts.append(f"({self.tag} IN {_LANCE_FLOAT} AND coalesce({self.as_float} {float_op} {float_bound!r}, false))")
        return parts[0] if len(parts) == 1 else "(" + " OR ".join(parts) + ")"

    @property
    def as_int(self) -> str:
        return f"TRY_CAST({self.text} AS BIGINT)"

    @property
    def as_float(self) -> str:
        return f"TRY_CAST({self.text} AS DOUBLE)"


def _sql_string(text: str) -> str:
    """A SQL string literal: ``'`` doubled; LanceDB's dialect reads backslashes literally (no escapes)."""
    return "'" + text.replace("'", "''") + "'"


def _sql_in(expr: str, literals: Iterable[str]) -> str:
    items = list(literals)
    return f"{expr} = {items[0]}" if len(items) == 1 else f"{expr} IN ({', '.join(items)})"


def _as_int64(value: int | float) -> int | None:
    """The int64 equal to ``value``, if any (for comparing with integers stored as int64)."""
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    return value if _INT64[0] <= value <= _INT64[1] else None


def _as_float(value: int | float) -> float | None:
    """The float equal to ``value``, if any (for comparing with stored floats)."""
    if isinstance(value, float):
        return value
    x = float(value)
    return x if x == value else None  # Python compares an int and a float exactly


def _int64_bound(op: str, value: int | float) -> tuple[str, int] | bool:
    """``x op value`` for every int64 ``x`` as ``x op n`` with an int64 ``n``, or a constant where no int64 bound is
    needed: ``x > 2.5`` is ``x > 2``, ``x >= 2.5`` is ``x >= 3``, ``x < 1e300`` is true."""
    n = value if isinstance(value, int) else math.floor(value) if op in (">", "<=") else math.ceil(value)
    if n < _INT64[0]:
        return op in (">", ">=")
    if n > _INT64[1]:
        return op in ("<", "<=")
    return op, n


def _float_bound(op: str, value: int | float) -> tuple[str, float]:
    """``y op value`` for every finite float ``y`` as ``y op' b`` with a float ``b``: an int with no exact float sits
    between two neighbouring floats, so ``y > value`` is ``y >= the float above``, ``y < value`` ``y <= the one
    below``."""
    if isinstance(value, float):
        return op, value
    x = float(value)  # an int64: finite
    if x == value:
        return op, x
    below = x if x < value else math.nextafter(x, -math.inf)
    above = x if x > value else math.nextafter(x, math.inf)
    return (">=", above) if op in (">", ">=") else ("<=", below)


# ---------------------------------------------------------------------------------------------------------- field kinds

#: distinct field paths whose kinds an index records (a corpus with more keeps the first ones; the rest go unchecked)
MAX_RECORDED_PATHS = 512


def record_kinds(kinds: dict[str, list[str]], fields: Mapping[str, Any], prefix: str = "", depth: int = 0) -> bool:
    """Add the kinds of ``fields`` (a document's extra fields; nested objects by dotted path) to ``kinds`` (path ->
    sorted kinds, as an index's manifest keeps them); True when something was added."""
    changed = False
    for key, value in fields.items():
        path = f"{prefix}{key}"
        known = kinds.get(path)
        if known is None and len(kinds) >= MAX_RECORDED_PATHS:
            continue
        kind = value_kind(value)
        if known is None or kind not in known:
            kinds[path] = sorted({*(known or []), kind})
            changed = True
        if kind == "object" and depth < MAX_DEPTH:
            changed |= record_kinds(kinds, value, f"{path}.", depth + 1)
    return changed


def check_kinds(f: Filter, kinds: Mapping[str, Sequence[str]]) -> None:
    """Refuse a test that can match nothing because of the field's kind in this index (``kinds``: path -> the kinds
    its documents hold; ``id`` and ``title`` are strings): ``{"year": {"$gt": 2020}}`` where every ``year`` is a
    string, ``{"lang": 1}`` where ``lang`` holds strings. A :class:`~robustir.errors.ConfigError` names the field, the
    kinds it holds and the fix. ``$ne`` / ``$nin``, null tests and anything under ``$not`` are not checked (they match
    by design: ``{"$not": {"year": "2020"}}`` where every ``year`` is a number matches every document); a path the
    index did not record is not checked."""
    if isinstance(f, (And, Or)):
        for part in f.parts:
            check_kinds(part, kinds)
        return
    if isinstance(f, Not):  # a test that matches nothing, negated, matches every document: valid, never refused
        return
    if f.op in ("$ne", "$nin"):
        return
    name = ".".join(f.path)
    held = ["string"] if name in ("id", "title") else kinds.get(name)
    if not held:
        return
    values = f.value if isinstance(f.value, tuple) else (f.value,)
    wanted = {value_kind(v) for v in values if v is not None}
    if not wanted or wanted & set(held):
        return
    shown = ", ".join(held)
    given = f"a {'/'.join(sorted(wanted))} ({_show(values[0] if len(values) == 1 else list(values))})"
    usable = [kind for kind in held if kind not in ("null", "object", "array")]
    if not usable:  # nothing a scalar test can match: say what the field holds, suggest no comparison that cannot help
        raise ConfigError(f"filter.{_name(name)}.{f.op}: '{name}' holds only {shown} values in this index, so "
                          f"comparing it with {given} matches no document; test whether it is set with "
                          f'{{"{name}": {{"$exists": true}}}}')
    example = {"string": '"2020"', "number": "2020", "bool": "true"}.get(usable[0], "a value of that kind")
    raise ConfigError(f"filter.{_name(name)}.{f.op}: '{name}' holds {shown} values in this index, so comparing it with "
                      f"{given} matches no document; compare it with a {usable[0]} value (e.g. {example})")
