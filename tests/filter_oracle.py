"""The filter DSL's test oracle, shared by the SQLite and LanceDB compiler tests: seeded random records (nested
objects, mixed kinds, missing fields, nulls) and filters, the Python evaluator's answers, and the documented cases."""

from __future__ import annotations

import random
from typing import Any

from robustir.index.store.filters import matches


def known_fields(records: list[dict]) -> list[str]:
    return ["id", "title", *sorted({key for r in records for key in r["fields"]})]


def python_ids(records: list[dict], f) -> list[str]:
    return [r["id"] for r in records if matches(f, {"id": r["id"], "title": r["title"], **r["fields"]})]


# ------------------------------------------------------------------------------------ random records and filters

STRINGS = ["", "a", "ab", "b", "B", "é", "😀", "1", "true", "null", "x') OR 1=1 --", 'q"uote', "back\\slash",
           "line\nbreak", "tab\there", "\u2028", "zz"]
NUMBERS = [-3, -1, 0, 1, 2, 3, 0.0, 1.0, 2.5, -1.5, 1e-9, 1e300, 2 ** 53 + 1, float(2 ** 53), -(2 ** 63),
           2 ** 63 - 1]
STORED_ONLY = [2 ** 63 + 5, -(2 ** 70)]  # beyond 64 bits: SQLite reads them as floats
TOP = ["a", "b", "c", "n", "s", "meta", "a.b", "é"]
PATHS = ["id", "title", *TOP, "meta.x", "meta.y", "meta.y.z", "meta.y.w", "a.b.c", "a.z"]
OPS = ["$eq", "$ne", "$in", "$nin", "$gt", "$gte", "$lt", "$lte", "=", "[]"]  # "=" / "[]": the shorthands


def random_scalar(rng: random.Random, stored: bool = False) -> Any:
    kind = rng.random()
    if kind < 0.35:
        return rng.choice(NUMBERS + (STORED_ONLY if stored and rng.random() < 0.2 else []))
    if kind < 0.7:
        return rng.choice(STRINGS)
    if kind < 0.85:
        return rng.choice([True, False])
    return None


def random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth < 2 and roll < 0.2:  # nested objects two levels deep
        return {key: random_value(rng, depth + 1) for key in rng.sample(["x", "y", "z", "w"], rng.randint(0, 3))}
    if roll < 0.27:
        return [random_scalar(rng, True) for _ in range(rng.randint(0, 2))]
    return random_scalar(rng, stored=True)


def random_records(rng: random.Random, n: int) -> list[dict]:
    records = []
    for i in range(n):
        fields = {key: random_value(rng) for key in TOP if rng.random() < 0.75}  # the rest: missing
        records.append({"id": f"r{i}", "title": rng.choice(["", "a", "b", "Coffee", "é", "1"]), "fields": fields})
    records[0]["fields"].update({key: 1 for key in TOP})  # every field in at least one record
    return records


def random_filter(rng: random.Random, depth: int = 0) -> dict:
    roll = rng.random()
    if depth < 3 and roll < 0.3:
        kind = rng.choice(["$and", "$or", "$not", "keys"])
        if kind == "$not":
            return {"$not": random_filter(rng, depth + 1)}
        parts = [random_filter(rng, depth + 1) for _ in range(rng.randint(1, 3))]
        if kind == "keys":  # several keys in one object: AND
            merged: dict = {}
            for part in parts:
                merged.update(part)
            return merged
        return {kind: parts}
    path, op = rng.choice(PATHS), rng.choice(OPS)
    if op in ("$gt", "$gte", "$lt", "$lte"):
        operand: Any = rng.choice(NUMBERS + STRINGS)
        if rng.random() < 0.3:  # two operators on one field: AND
            other = rng.choice(["$gt", "$gte", "$lt", "$lte"])
            return {path: {op: operand, other: rng.choice(NUMBERS + STRINGS)}}
        return {path: {op: operand}}
    if op in ("$in", "$nin", "[]"):
        values = [random_scalar(rng) for _ in range(rng.randint(1, 4))]
        return {path: values} if op == "[]" else {path: {op: values}}
    value = random_scalar(rng)
    return {path: value} if op == "=" else {path: {op: value}}


# ----------------------------------------------------------------------------------------- documented semantics

SEMANTIC_RECORDS = [
    {"id": "int1", "title": "t", "fields": {"v": 1}},
    {"id": "float1", "title": "t", "fields": {"v": 1.0}},
    {"id": "true", "title": "t", "fields": {"v": True}},
    {"id": "str1", "title": "t", "fields": {"v": "1"}},
    {"id": "null", "title": "t", "fields": {"v": None}},
    {"id": "missing", "title": "t", "fields": {}},
    {"id": "list", "title": "t", "fields": {"v": [1]}},
    {"id": "obj", "title": "t", "fields": {"v": {"w": 1}}},
    {"id": "str2", "title": "t", "fields": {"v": "2"}},
    {"id": "two", "title": "t", "fields": {"v": 2}},
]

SEMANTIC_CASES: list[tuple[dict, list[str]]] = [
    ({"v": 1}, ["int1", "float1"]),                                   # 1 equals 1.0, not true, not "1"
    ({"v": True}, ["true"]),                                          # true equals only true
    ({"v": "1"}, ["str1"]),
    ({"v": None}, ["null", "missing"]),                               # missing is null
    ({"v": {"$ne": None}}, ["int1", "float1", "true", "str1", "list", "obj", "str2", "two"]),
    ({"v": {"$ne": 1}}, ["true", "str1", "null", "missing", "list", "obj", "str2", "two"]),  # missing included
    ({"v": {"$gte": 1}}, ["int1", "float1", "two"]),                  # numbers only; booleans are not numbers
    ({"v": {"$gte": "1"}}, ["str1", "str2"]),                         # strings only
    ({"v": {"$gt": 1, "$lte": 2}}, ["two"]),
    ({"v": {"$nin": [1, None]}}, ["true", "str1", "list", "obj", "str2", "two"]),
    ({"v": {"$exists": True}}, ["int1", "float1", "true", "str1", "list", "obj", "str2", "two"]),  # = $ne null
    ({"v": {"$exists": False}}, ["null", "missing"]),                  # = null (missing or null)
    ({"v.w": {"$exists": True}}, ["obj"]),
    ({"v.w": 1}, ["obj"]),                                            # a nested field
    ({"v.w": None}, [r["id"] for r in SEMANTIC_RECORDS if r["id"] != "obj"]),  # through a non-object: null
    ({"$or": [{"v": True}, {"v": "2"}]}, ["true", "str2"]),
    ({"$not": {"v": {"$in": [1, "1"]}}}, ["true", "null", "missing", "list", "obj", "str2", "two"]),
    ({"id": ["int1", "two"], "title": "t"}, ["int1", "two"]),
    ({"id": {"$gt": "str"}}, ["str1", "str2", "true", "two"]),        # ids are strings, code-point order
    ({"id": {"$gt": 1}}, []),
    ({}, [r["id"] for r in SEMANTIC_RECORDS]),
]
