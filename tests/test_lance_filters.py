"""robustir.index.store.lance_sql.to_lance_sql: the LanceDB compiler against the Python evaluator on real LanceDB
tables -- random records and filters, the documented semantics, number and string edges, hostile names and values, the
limits, and a prefiltered vector search."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest

lancedb = pytest.importorskip("lancedb")
pa = pytest.importorskip("pyarrow")

from filter_oracle import (SEMANTIC_CASES, SEMANTIC_RECORDS, known_fields, python_ids, random_filter,  # noqa: E402
                           random_records)  # tests/ is on sys.path

from robustir.errors import ConfigError  # noqa: E402
from robustir.index.store import filters as filters_module  # noqa: E402
from robustir.index.store import lance_sql as lance_sql_module  # noqa: E402
from robustir.index.store.filters import MAX_DEPTH, Condition, Not, Or, parse_filter  # noqa: E402
from robustir.index.store.lance_sql import MAX_LANCE_PATH, to_lance_sql  # noqa: E402

DIM = 4

# ------------------------------------------------------------------------------------------------ helpers


def lance_table(root: Path, records: list[dict], vectors: np.ndarray | None = None):
    """A LanceDB ``docs`` table as the search index stores documents: ``id``, ``title``, ``text``, ``fields`` (the extra
    fields as Arrow JSON, ensure_ascii=False) and a ``vector`` (a dummy one unless given)."""
    if vectors is None:
        vectors = np.zeros((len(records), DIM), dtype=np.float32)
    schema = pa.schema([("id", pa.string()), ("title", pa.string()), ("text", pa.string()),
                        ("fields", pa.json_(pa.string())), ("vector", pa.list_(pa.float32(), DIM))])
    data = pa.table({"id": [r["id"] for r in records], "title": [r["title"] for r in records],
                     "text": [""] * len(records),
                     "fields": [json.dumps(r["fields"], ensure_ascii=False) for r in records],
                     "vector": list(np.asarray(vectors, dtype=np.float32))}, schema=schema)
    return lancedb.connect(root).create_table("docs", data)


def lance_ids(table, f, records: list[dict]) -> list[str]:
    """The ids ``to_lance_sql(f)`` selects, in the records' order (a scan has no order of its own)."""
    order = {r["id"]: i for i, r in enumerate(records)}
    found = table.search().where(to_lance_sql(f)).select(["id"]).limit(len(records) + 1).to_arrow()
    return sorted(found["id"].to_pylist(), key=order.__getitem__)


# ------------------------------------------------------------------------------------------------ random oracle

def disagreements(root: Path, seed: int, n_records: int = 300, n_filters: int = 200) -> tuple[list, int]:
    """Filters on which LanceDB and the Python evaluator disagree, and how many filters selected some but not all
    (the same records and filters as test_filter_dsl's SQLite oracle for the same seed)."""
    rng = random.Random(seed)
    records = random_records(rng, n_records)
    table, fields = lance_table(root, records), known_fields(records)
    wrong, informative = [], 0
    for _ in range(n_filters):
        obj = random_filter(rng)
        f = parse_filter(obj, fields)
        expected, got = python_ids(records, f), lance_ids(table, f, records)
        informative += 0 < len(expected) < len(records)
        if got != expected:
            wrong.append((obj, sorted(set(expected) ^ set(got))[:5]))
    assert table.count_rows() == n_records
    return wrong, informative


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lance_agrees_with_the_python_evaluator_on_random_records_and_filters(tmp_path, seed):
    wrong, informative = disagreements(tmp_path, seed)
    assert not wrong, f"{len(wrong)} filters disagree, e.g. {wrong[:3]}"
    assert informative > 100  # most filters select some documents but not all: the comparison has power


@pytest.mark.parametrize("op, broken", [("$gte", ">"), ("$lt", "<=")])
def test_the_random_oracle_catches_a_broken_operator(tmp_path, monkeypatch, op, broken):
    monkeypatch.setitem(filters_module._SQL_RANGES, op, broken)
    wrong, _ = disagreements(tmp_path, 0, n_filters=100)
    assert wrong


# ------------------------------------------------------------------------------------------------ semantics

@pytest.fixture(scope="module")
def semantic_table(tmp_path_factory):
    return lance_table(tmp_path_factory.mktemp("semantic"), SEMANTIC_RECORDS)


@pytest.mark.parametrize("obj, expected", SEMANTIC_CASES)
def test_documented_semantics_in_lance(semantic_table, obj, expected):
    f = parse_filter(obj, known_fields(SEMANTIC_RECORDS))
    order = [r["id"] for r in SEMANTIC_RECORDS]
    assert lance_ids(semantic_table, f, SEMANTIC_RECORDS) == sorted(expected, key=order.index)


# Values where int / float / string handling can go wrong: beyond 2**53, the int64 ends, beyond int64 (read as
# floats, like SQLite), signed zeros, subnormals, floats that print with exponents, and strings that JSON escapes.
EDGE_NUMBERS = [0, -0.0, 0.0, 1, 1.0, -1, 0.1, 2.5, -1.5, 1e-9, 5e-324, 1e16, 1e300, -1e300, 1.7976931348623157e308,
                2 ** 53, 2 ** 53 + 1, float(2 ** 53), float(2 ** 53 + 2), 2 ** 62 + 1, float(2 ** 62),
                2 ** 63 - 1, -(2 ** 63), -(2 ** 63) + 1, float(2 ** 63), -float(2 ** 63), 9.223372036854775e18]
STORED_NUMBERS = [2 ** 63, 2 ** 63 + 5, 2 ** 64 - 1, 2 ** 64 + 1, -(2 ** 63) - 1, -(2 ** 70), 10 ** 25 + 1]
EDGE_STRINGS = ["", " ", "0", "1", "-1", "1.0", "a", "A", "é", "e\u0301", "😀", "\uffff", "\U0010ffff", "true",
                "null", 'q"uote', "back\\slash", "\\", "it's", "''", "line\nbreak", "\r\t\x0b\x0c\x1b\x7f", "\x01",
                "\u2028", "\u2029", "/", "</script>", "\u201cquoted\u201d"]
EDGE_OTHER: list[Any] = [True, False, None, [], [1], ["a"], {}, {"0": "a"}, {"w": 1}]


@pytest.fixture(scope="module")
def edge_records() -> list[dict]:
    stored = EDGE_NUMBERS + STORED_NUMBERS + EDGE_STRINGS + EDGE_OTHER
    records = [{"id": f"e{i}", "title": EDGE_STRINGS[i % len(EDGE_STRINGS)], "fields": {"v": v}}
               for i, v in enumerate(stored)]
    records.append({"id": "missing", "title": "t", "fields": {}})
    return records


@pytest.fixture(scope="module")
def edge_table(tmp_path_factory, edge_records):
    return lance_table(tmp_path_factory.mktemp("edges"), edge_records)


@pytest.mark.parametrize("op", ["$eq", "$ne", "$gt", "$gte", "$lt", "$lte"])
def test_every_operator_on_every_edge_value_agrees_with_python(edge_table, edge_records, op):
    fields = known_fields(edge_records)
    operands = EDGE_NUMBERS + EDGE_STRINGS + ([] if op in ("$gt", "$gte", "$lt", "$lte") else [True, False, None])
    wrong = []
    for path in ("v", "title", "v.0"):  # v.0: never an array's item
        for operand in operands:
            f = parse_filter({path: {op: operand}}, fields)
            expected, got = python_ids(edge_records, f), lance_ids(edge_table, f, edge_records)
            if got != expected:
                wrong.append((path, operand, sorted(set(expected) ^ set(got))))
    assert not wrong, f"{len(wrong)} disagree, e.g. {wrong[:5]}"


def test_lists_of_mixed_kinds_agree_with_python(edge_table, edge_records):
    fields = known_fields(edge_records)
    rng = random.Random(7)
    values = EDGE_NUMBERS + EDGE_STRINGS + [True, False, None]
    for _ in range(60):
        chosen = rng.sample(values, rng.randint(1, 6))
        for op in ("$in", "$nin"):
            f = parse_filter({"v": {op: chosen}}, fields)
            assert lance_ids(edge_table, f, edge_records) == python_ids(edge_records, f), (op, chosen)


def test_numbers_compare_exactly_across_int_and_float(edge_table, edge_records):
    fields = known_fields(edge_records)

    def stored(obj: dict) -> list:
        ids = lance_ids(edge_table, parse_filter(obj, fields), edge_records)
        return [r["fields"]["v"] for r in edge_records if r["id"] in ids]

    assert stored({"v": 2 ** 53 + 1}) == [2 ** 53 + 1]  # not float(2**53): DataFusion alone would round the int
    assert stored({"v": float(2 ** 53)}) == [2 ** 53, float(2 ** 53)]
    assert stored({"v": 0}) == [0, -0.0, 0.0]  # -0.0 equals 0
    assert stored({"v": {"$gt": 2 ** 63 - 2, "$lt": 1e300}}) == [2 ** 63 - 1, float(2 ** 63), 2 ** 63, 2 ** 63 + 5,
                                                                 2 ** 64 - 1, 2 ** 64 + 1, 10 ** 25 + 1]
    assert stored({"v": {"$gt": 2 ** 53, "$lt": 2 ** 53 + 2}}) == [2 ** 53 + 1]
    assert stored({"v": {"$gte": 2.5, "$lt": 3}}) == [2.5]
    assert stored({"v": {"$gt": 1e300}}) == [1.7976931348623157e308]


# ------------------------------------------------------------------------------------------------ hostile input

HOSTILE = ["x' OR '1'='1", "'; DROP TABLE docs; --", "') OR true OR ('", "x') OR 1=1 --", "\\", "\\'", "'", "''",
           "'\\''", "\u2018x\u2019", "\u201cx\u201d", "\uff07", "\u02bc", "a\nb", "a\r\nb' OR '1'='1", "\t\x0b\x0c",
           "\x1b[31m", "\x7f", "\u2028", "$.\"a\"", "%", "_", "*", "/* x */", "-- x", ";", "\"; DROP TABLE docs; --"]
HOSTILE_NAMES = ["x') OR 1=1 --", "'; DROP TABLE docs; --", "it's", "x$", "a[*]", "a b", "[0]", "\u2018q\u2019"]


@pytest.fixture()
def hostile(tmp_path):
    records = [{"id": f"h{i}", "title": value, "fields": {"s": value, "n": i, "o": {"k": value},
                                                          **{name: value for name in HOSTILE_NAMES}}}
               for i, value in enumerate(HOSTILE)]
    records.append({"id": "plain", "title": "plain", "fields": {"s": "plain", "n": -1}})
    db = lancedb.connect(tmp_path / "hostile")
    table = lance_table(tmp_path / "hostile", records)
    yield table, known_fields(records), records
    assert table.count_rows() == len(records)  # the table is still there, whole
    assert db.list_tables().tables == ["docs"]


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_are_matched_literally(hostile, value):
    table, fields, records = hostile
    wanted = [r["id"] for r in records if r["fields"]["s"] == value]
    assert len(wanted) == 1
    for obj in ({"s": value}, {"title": value}, {"id": value}, {"o.k": value}, {"s": {"$in": [value, "nothing"]}},
                {"s": {"$gte": value, "$lte": value}}, {"title": {"$gte": value, "$lte": value}},
                *({name: value} for name in HOSTILE_NAMES)):
        f = parse_filter(obj, fields)
        assert lance_ids(table, f, records) == python_ids(records, f), obj
        assert obj == {"id": value} or lance_ids(table, f, records) == wanted, obj
    assert len(lance_ids(table, parse_filter({"s": {"$ne": value}}, fields), records)) == len(records) - 1
    assert table.count_rows() == len(records)


def test_field_names_of_every_allowed_unicode_category_are_matched_exactly(tmp_path):
    rng = random.Random(3)
    by_category: dict[str, list[str]] = {}
    for code in range(0x20, 0x30000):
        ch = chr(code)
        if ch not in '"\\' and unicodedata.category(ch) not in ("Cc", "Cs"):
            by_category.setdefault(unicodedata.category(ch), []).append(ch)
    assert set(by_category) == lance_sql_module._LANCE_KEY_CATEGORIES
    names = [ch for chars in by_category.values() for ch in rng.sample(chars, min(3, len(chars)))]
    names += [chr(code) for code in range(0x20, 0x7f) if chr(code) not in '"\\'] + HOSTILE_NAMES + ["K", "\u212a"]
    # parse_filter reads a leading "$" as an operator and "." as nesting
    names = [name for name in dict.fromkeys(names) if not name.startswith("$") and "." not in name]
    records = [{"id": f"r{i}", "title": "", "fields": {name: {"k": i, "s": name}}} for i, name in enumerate(names)]
    table, fields = lance_table(tmp_path, records), known_fields(records)
    for i, name in enumerate(names):
        for obj in ({f"{name}.k": i}, {f"{name}.s": {"$gte": name, "$lte": name}}):  # a JSON path, a json_get key
            assert lance_ids(table, parse_filter(obj, fields), records) == [f"r{i}"], (name, obj)


@pytest.mark.parametrize("f, at, message", [
    (Condition(("a\"b",), "$eq", 1), 'filter.a"b', "cannot be written into a LanceDB JSON path (found \"\\\"\")"),
    (Condition(("meta", "x\\y"), "$eq", 1), "filter.meta.x\\y", "cannot be written into a LanceDB JSON path"),
    (Condition(("x\x01",), "$eq", 1), 'filter."x\\u0001"', "cannot be written into a LanceDB JSON path"),
    (Condition(("meta", ""), "$eq", 1), "filter.meta.", "an empty segment"),
    (Condition(("a",) * (MAX_LANCE_PATH + 1), "$eq", 1), "filter." + ".".join("a" * (MAX_LANCE_PATH + 1)),
     f"at most {MAX_LANCE_PATH}"),
    (Condition(("n",), "$eq", float("nan")), "filter.n.$eq", "finite number"),
    (Condition(("n",), "$gt", float("inf")), "filter.n.$gt", "finite number"),
    (Condition(("n",), "$in", (1, 2 ** 64)), "filter.n.$in", "beyond 64 bits"),
    (Condition(("s",), "$eq", "a\x00b"), "filter.s.$eq", "NUL"),
    (Condition(("s",), "$eq", "\ud800"), "filter.s.$eq", "lone surrogate"),
    (Condition(("s",), "$eq", [1]), "filter.s.$eq", "expected a string, a finite number"),  # type: ignore[arg-type]
    (Condition(("s",), "$lt", True), "filter.s.$lt", "expected a number or a string, got true"),
    (Or((Condition(("s",), "$like", "a"),)), "filter.s", "unknown operator '$like'"),  # type: ignore[arg-type]
])
def test_what_cannot_be_written_safely_is_refused_naming_the_path(f, at, message):
    with pytest.raises(ConfigError) as exc:
        to_lance_sql(f)
    text = str(exc.value)
    assert text.startswith(at + ": ") and message in text and "\n" not in text, text


def outside_literals(sql: str) -> str:
    """``sql`` with each string literal (``'...'``, ``''`` a quote inside) replaced by ``?``."""
    code, i = [], 0
    while i < len(sql):
        if sql[i] != "'":
            code.append(sql[i])
            i += 1
            continue
        i += 1
        while sql[i] != "'" or sql[i + 1:i + 2] == "'":
            i += 2 if sql[i] == "'" else 1
        code.append("?")
        i += 1
    return "".join(code)


@pytest.mark.parametrize("name, value", [("x') OR 1=1 --", "'; DROP TABLE docs; --"), ("it's", "\\'"),
                                         ("a'b", "' OR ''='"), ("\u2018q\u2019", "x\n' OR true --")])
def test_user_text_is_only_inside_string_literals(name, value):
    def sql(name: str, value: str) -> str:
        return to_lance_sql(parse_filter({"$or": [{name: value}, {f"{name}.k": {"$gt": value}}, {"title": [value, "b"]},
                                                  {"n": {"$in": [1e-9, -0.0, 2 ** 63 - 1, -(2 ** 63), value]}}]},
                                         ["id", "title", "n", name]))

    hostile, plain = sql(name, value), sql("plain", "v")
    assert outside_literals(hostile) == outside_literals(plain)  # the same SQL around the literals
    assert "'" + value.replace("'", "''") + "'" in hostile
    assert "'$.\"" + name.replace("'", "''") + "\"'" in hostile
    for number in ("1e-09", "-0.0", "9223372036854775807", "-9223372036854775808"):
        assert number in outside_literals(hostile)


# ------------------------------------------------------------------------------------------------ limits

def test_a_filter_at_every_limit_still_runs_in_lance(tmp_path):
    deep_path = ".".join(f"k{i}" for i in range(MAX_LANCE_PATH))
    deep_value: Any = "x"
    for i in reversed(range(1, MAX_LANCE_PATH)):
        deep_value = {f"k{i}": deep_value}
    records = [{"id": "a", "title": "t", "fields": {"s": "a", "k0": deep_value}},
               {"id": "b", "title": "t", "fields": {"s": "v3", "k0": {"k1": 1}}},
               {"id": "c", "title": "t", "fields": {}}]
    table, fields = lance_table(tmp_path, records), known_fields(records)
    # 250 conditions over all four kinds of value (4 x 250 = the most list items); the deepest nesting with the
    # longest path, and a $nin (one more NOT) at the bottom
    wide = parse_filter({"$or": [{"s": {"$nin": [None, True, i, f"v{i}"]}} for i in range(250)]}, fields)
    deep: dict = {deep_path: {"$nin": ["y", 1, None]}}
    for _ in range(MAX_DEPTH):
        deep = {"$not": deep}
    deep_f = parse_filter(deep, fields)
    assert isinstance(deep_f, Not)
    for f, expected in ((wide, ["a", "b"]), (deep_f, ["a"]), (parse_filter({deep_path: "x"}, fields), ["a"]),
                        (parse_filter({deep_path: {"$gt": "w"}}, fields), ["a"])):
        assert lance_ids(table, f, records) == python_ids(records, f) == expected


# ------------------------------------------------------------------------------------------------ vector search

def test_a_prefiltered_vector_search_returns_only_matching_rows_and_the_nearest(tmp_path):
    rng = random.Random(11)
    records = random_records(rng, 200)
    vectors = np.random.default_rng(11).standard_normal((len(records), DIM)).astype(np.float32)
    table, fields = lance_table(tmp_path, records, vectors), known_fields(records)
    query = np.random.default_rng(12).standard_normal(DIM).astype(np.float32)
    distance = ((vectors - query) ** 2).sum(axis=1)
    index = {r["id"]: i for i, r in enumerate(records)}
    sizes = []
    filters = [{"n": {"$gte": 0}}, {"s": {"$ne": None}}, {"id": ["r1", "r2", "r3"]}, {"meta.x": {"$in": [1, "a"]}},
               *(random_filter(rng) for _ in range(12))]
    for obj in filters:
        f = parse_filter(obj, fields)
        matching = python_ids(records, f)
        sizes.append(len(matching))
        for k in (1, 5, 40):
            hits = (table.search(query).where(to_lance_sql(f), prefilter=True).limit(k).select(["id"]).to_arrow())
            got = hits["id"].to_pylist()
            assert len(got) == min(k, len(matching)), (obj, k)
            assert set(got) <= set(matching), obj
            nearest = sorted(matching, key=lambda i: distance[index[i]])[:k]  # prefiltered, not post-filtered
            assert sorted(got) == sorted(nearest), (obj, k)
    assert any(0 < n < 5 for n in sizes) and any(n > 40 for n in sizes)  # fewer than k, and more than k


# ------------------------------------------------------------------------------------------------ typed columns

from robustir.index.store.lance_sql import column_kind, column_value, exact_kind  # noqa: E402

TYPED_VALUES = {
    "s": EDGE_STRINGS + [None],
    "i": [0, 1, -1, 7, 2 ** 53, 2 ** 53 + 1, -(2 ** 53) - 1, 2 ** 63 - 1, -(2 ** 63), 1234567890123, None],
    "x": [0.0, -0.0, 0.5, 2.5, 3, -7, 1e300, -1e-300, 1.7976931348623157e308, float(2 ** 53), 2 ** 53, None],
    "b": [True, False, None],
}


@pytest.fixture(scope="module")
def typed(tmp_path_factory):
    """A table as the index writes one with typed columns (t_s string, t_i int64, t_x float64, t_b bool) beside the
    JSON ``fields``; one record per combination of a value of each field (some missing instead of null)."""
    rng = random.Random(11)
    records = []
    for n in range(240):
        fields = {}
        for name, values in TYPED_VALUES.items():
            value = rng.choice(values)
            if value is not None or rng.random() < 0.5:  # a null, or missing
                fields[name] = value
        records.append({"id": f"r{n}", "title": f"t{n % 7}", "fields": fields})
    kinds = {name: column_kind({exact_kind(r["fields"].get(name)) for r in records}) for name in TYPED_VALUES}
    assert kinds == {"s": "string", "i": "int", "x": "float", "b": "bool"}
    columns = {name: (f"t_{name}", kind) for name, kind in kinds.items()}
    arrow = {"string": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_()}
    schema = pa.schema([("id", pa.string()), ("title", pa.string()), ("fields", pa.json_(pa.string())),
                        *[(column, arrow[kind]) for column, kind in columns.values()],
                        ("vector", pa.list_(pa.float32(), DIM))])
    data = pa.table({"id": [r["id"] for r in records], "title": [r["title"] for r in records],
                     "fields": [json.dumps(r["fields"], ensure_ascii=False) for r in records],
                     **{column: [column_value(kind, r["fields"].get(name)) for r in records]
                        for name, (column, kind) in columns.items()},
                     "vector": list(np.zeros((len(records), DIM), dtype=np.float32))}, schema=schema)
    table = lancedb.connect(tmp_path_factory.mktemp("typed")).create_table("docs", data)
    return table, records, columns


def typed_ids(table, f, records, columns) -> list[str]:
    order = {r["id"]: i for i, r in enumerate(records)}
    found = table.search().where(to_lance_sql(f, columns)).select(["id"]).limit(len(records) + 1).to_arrow()
    return sorted(found["id"].to_pylist(), key=order.__getitem__)


@pytest.mark.parametrize("op", ["$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin"])
def test_typed_columns_agree_with_python_for_every_operator_and_edge_operand(typed, op):
    table, records, columns = typed
    fields = known_fields(records)
    operands = EDGE_NUMBERS + EDGE_STRINGS + [2.5, -0.0, 2 ** 53 + 1, 2 ** 63 - 1]
    if op not in ("$gt", "$gte", "$lt", "$lte"):
        operands += [True, False, None]
    wrong, informative = [], 0
    for name in TYPED_VALUES:
        for operand in operands:
            value = [operand, "en"] if op in ("$in", "$nin") else operand
            f = parse_filter({name: {op: value}}, fields)
            sql = to_lance_sql(f, columns)
            assert "fields" not in sql  # the column is read (or the test is a constant), never the JSON
            expected, got = python_ids(records, f), typed_ids(table, f, records, columns)
            informative += 0 < len(expected) < len(records)
            if got != expected:
                wrong.append((name, op, operand, sorted(set(expected) ^ set(got))[:4]))
    assert not wrong, f"{len(wrong)} disagree, e.g. {wrong[:5]}"
    assert informative > 10


def test_typed_columns_agree_with_python_on_random_combined_filters(typed):
    table, records, columns = typed
    fields = known_fields(records)
    rng = random.Random(5)
    values = {name: [v for v in vals if v is not None] for name, vals in TYPED_VALUES.items()}

    def leaf():
        name = rng.choice(list(TYPED_VALUES))
        op = rng.choice(["$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$exists"])
        pick = rng.choice(values[name] if rng.random() < 0.8 else values[rng.choice(list(values))])
        if op == "$exists":
            return {name: {op: rng.random() < 0.5}}
        if op in ("$gt", "$gte", "$lt", "$lte") and isinstance(pick, bool):
            pick = 1
        return {name: {op: [pick, rng.choice(values[name])] if op in ("$in", "$nin") else pick}}

    wrong = []
    for _ in range(150):
        obj = rng.choice([lambda: leaf(), lambda: {"$or": [leaf(), leaf()]}, lambda: {"$not": leaf()},
                          lambda: {"$and": [leaf(), {"$or": [leaf(), {"$not": leaf()}]}]}])()
        f = parse_filter(obj, fields)
        if typed_ids(table, f, records, columns) != python_ids(records, f):
            wrong.append(obj)
    assert not wrong, f"{len(wrong)} disagree, e.g. {wrong[:3]}"


def test_a_value_that_does_not_fit_leaves_the_field_untyped():
    assert column_kind(["string", "null"]) == "string"
    assert column_kind(["int", "int64"]) == "int" and column_kind(["int", "float"]) == "float"
    assert column_kind(["int64", "float"]) is None  # an int beyond 2**53 would not fit a float64 exactly
    assert column_kind(["string", "int"]) is None and column_kind(["other"]) is None and column_kind(["null"]) is None
    assert column_value("float", 3) == 3.0 and column_value("int", 2.0) is None and column_value("bool", 1) is None
