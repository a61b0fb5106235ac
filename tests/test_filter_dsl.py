"""robustir.index.store.filters: the JSON filter language -- the parsed tree and its documented semantics, hostile
names, limits and bad values refused naming the place, error messages, and filters through SearchIndex and POST /search
(the LanceDB compiler against the Python evaluator: tests/test_lance_filters.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from helpers import httpx  # noqa: E402  (tests/ is on sys.path)
from filter_oracle import SEMANTIC_CASES, SEMANTIC_RECORDS, known_fields, python_ids  # tests/ is on sys.path
from helpers import DOCS
from test_serving_index import beir, quiet  # noqa: F401  (beir is a fixture)

from robustir.errors import ConfigError
from robustir.index.store.filters import (MAX_CONDITIONS, MAX_DEPTH, MAX_LIST_ITEMS, And, Condition, Not, Or,
                                          parse_filter)

pytestmark = pytest.mark.usefixtures("single_torch_thread")

@pytest.mark.parametrize("obj, expected", SEMANTIC_CASES)
def test_documented_semantics_in_python(obj, expected):
    f = parse_filter(obj, known_fields(SEMANTIC_RECORDS))
    order = [r["id"] for r in SEMANTIC_RECORDS]
    assert python_ids(SEMANTIC_RECORDS, f) == sorted(expected, key=order.index)


def test_parse_builds_a_typed_tree():
    fields = ["id", "title", "lang", "price", "meta"]
    assert parse_filter({"lang": "en"}, fields) == Condition(("lang",), "$eq", "en")
    assert parse_filter({"_id": ["d1", "d2"]}, fields) == Condition(("id",), "$in", ("d1", "d2"))
    assert parse_filter({"price": {"$gte": 1, "$lt": 5}, "meta.year": 2020}, fields) == And((
        Condition(("price",), "$gte", 1), Condition(("price",), "$lt", 5), Condition(("meta", "year"), "$eq", 2020)))
    assert parse_filter({"$or": [{"lang": "en"}, {"$not": {"lang": None}}]}, fields) == Or((
        Condition(("lang",), "$eq", "en"), Not(Condition(("lang",), "$eq", None))))
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse_filter({"lang": "en"}, fields).op = "$ne"  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------ hostile input

HOSTILE = ["x') OR 1=1 --", "\"; DROP TABLE docs; --", '$."a"', 'a"b', "a\nb", "' OR ''='", "1; DELETE FROM docs",
           "\\", "%", "_", "*"]


@pytest.fixture()
def hostile_db():
    """Known field names and records with hostile values (values matched literally in LanceDB:
    tests/test_lance_filters.py)."""
    records = [{"id": f"h{i}", "title": value, "fields": {"s": value, "x') OR 1=1 --": value, "n": i}}
               for i, value in enumerate(HOSTILE)]
    records.append({"id": "plain", "title": "plain", "fields": {"s": "plain", "n": -1}})
    return None, known_fields(records), records


@pytest.mark.parametrize("name, path, message", [
    ("\"; DROP TABLE docs; --", 'filter.\"; DROP TABLE docs; --', "quotes, backslashes or control characters"),
    ('$."a"', "filter.$.\"a\"", "unknown operator"),
    ('a"b', 'filter.a"b', "quotes, backslashes or control characters"),
    ("a\\b", "filter.a\\b", "quotes, backslashes or control characters"),
    ("a\nb", 'filter."a\\nb"', "quotes, backslashes or control characters"),
    ("s\x00", 'filter."s\\u0000"', "quotes, backslashes or control characters"),
    ("s..x", "filter.s..x", "empty segment"),
    (".s", "filter..s", "empty segment"),
    ("s.", "filter.s.", "empty segment"),
    ("x') OR 1=1 --.y", "filter.x') OR 1=1 --.y", None),  # a nested path under a known field: fine
    ("y') OR 1=1 --", "filter.y') OR 1=1 --", "is in no document"),
])
def test_hostile_field_names_are_refused_naming_the_path(hostile_db, name, path, message):
    db, fields, records = hostile_db
    if message is None:
        f = parse_filter({name: 1}, fields)
        assert python_ids(records, f) == []
        return
    with pytest.raises(ConfigError) as exc:
        parse_filter({name: "x"}, fields)
    text = str(exc.value)
    assert text.startswith(path + ": ") and message in text and "\n" not in text


def nested(levels: int, key: str = "$not") -> dict:
    f: dict = {"s": "a"}
    for _ in range(levels):
        f = {key: f} if key == "$not" else {key: [f]}
    return f


@pytest.mark.parametrize("obj, path, message", [
    (nested(MAX_DEPTH + 1), "filter" + ".$not" * (MAX_DEPTH + 1), f"more than {MAX_DEPTH} levels"),
    (nested(MAX_DEPTH + 1, "$or"), "filter" + ".$or[0]" * MAX_DEPTH + ".$or", f"more than {MAX_DEPTH} levels"),
    (nested(100_000), "filter" + ".$not" * (MAX_DEPTH + 1), "levels"),  # stops at the limit, no RecursionError
    ({"s": {"$in": list(range(MAX_LIST_ITEMS + 1))}}, "filter.s.$in", f"more than {MAX_LIST_ITEMS} values"),
    ({"s": list(range(600)), "n": {"$nin": list(range(600))}}, "filter.n.$nin", f"more than {MAX_LIST_ITEMS}"),
    ({"$or": [{"s": 1}] * 10 ** 6}, "filter.$or", f"more than {MAX_CONDITIONS} conditions"),
    ({"$and": [{"s": i, "n": i} for i in range(200)]}, "filter.$and[127].n", f"more than {MAX_CONDITIONS}"),
    ({"$or": [{}] * 300}, "filter.$or", f"more than {MAX_CONDITIONS}"),
    ({"n": float("nan")}, "filter.n", "finite number"),
    ({"n": {"$gt": float("inf")}}, "filter.n.$gt", "finite number"),
    (json.loads('{"n": {"$in": [1, -Infinity]}}'), "filter.n.$in[1]", "finite number"),
    ({"n": 2 ** 64}, "filter.n", "beyond 64 bits"),
    ({"s": {"$eq": {"a": 1}}}, "filter.s.$eq", "expected a string, a finite number, true, false or null"),
    ({"s": {"$in": ["a", ["b"]]}}, "filter.s.$in[1]", "expected a string, a finite number"),
    ({"s": [{"a": 1}]}, "filter.s[0]", "expected a string, a finite number"),
    ({"s": {"$gt": {"a": 1}}}, "filter.s.$gt", "expected a number or a string, got {\"a\": 1}"),
    ({"s": {"$lt": None}}, "filter.s.$lt", "expected a number or a string, got null"),
    ({"s": {"$eq": object()}}, "filter.s.$eq", "got a Python object"),
    ({"s": "a\x00b"}, "filter.s", "NUL"),
    ({"s": "\ud800"}, "filter.s", "lone surrogate"),
])
def test_limits_and_bad_values_are_refused_naming_the_path(hostile_db, obj, path, message):
    with pytest.raises(ConfigError) as exc:
        parse_filter(obj, hostile_db[1])
    text = str(exc.value)
    assert text.startswith(path + ": ") and message in text and "\n" not in text and len(text) < 400


# ------------------------------------------------------------------------------------------------ messages

FIELDS = ["id", "title", "lang", "price", "meta"]


@pytest.mark.parametrize("obj, message", [
    ({"colour": "red"}, "filter.colour: 'colour' is in no document of this index; fields: id, title, lang, price, "
                        "meta"),
    ({"lnag": "en"}, "filter.lnag: 'lnag' is in no document of this index (did you mean 'lang'?); fields: id, "),
    ({"price": {"$gtt": 1}}, "filter.price.$gtt: unknown operator '$gtt' (did you mean '$gt'?); operators: $eq, $ne, "
                             "$in, $nin, $gt, $gte, $lt, $lte, $exists"),
    ({"$or": [{"lang": "en"}, {"price": {"$gt": {"a": 1}}}]},
     "filter.$or[1].price.$gt: expected a number or a string, got {\"a\": 1}; a range compares numbers with numbers"),
    ({"$nor": []}, "filter.$nor: unknown operator '$nor' (did you mean '$or'?); here a key is a field name or one of "
                   "$and, $or, $not"),
    ({"$gte": 3}, "filter.$gte: $gte tests a field: write {\"price\": {\"$gte\": ...}}"),
    # issue 36: another language's operator is named as such, not "did you mean '$gte'?"
    ({"title": {"$regex": "^Aspirin"}}, "filter.title.$regex: $regex is not supported: robustir filters compare whole "
                                        "values, with no pattern matching; operators: $eq, "),
    ({"lang": {"$exists": "yes"}}, "filter.lang.$exists: expected true or false, got \"yes\""),
    ({"price": {"$not": {"$gt": 3}}}, "filter.price.$not: $not combines filters, not values: write"),
    ({"meta": {"year": 2020}}, "filter.meta: expected a value or an object of operators ($eq, $ne, $in, $nin, $gt, "
                               "$gte, $lt, $lte, $exists), got the key 'year'; a nested field is written \"meta.year\""),
    ({"text": "aspirin"}, "filter.text: filtering on 'text' is not supported: filter on id, title or a metadata "
                          "field"),
    ({"title.x": "a"}, "filter.title.x: 'title' is a string and has no nested fields"),
    ({"lang": []}, "filter.lang: an empty list matches nothing; give at least one value"),
    ({"lang": {}}, "filter.lang: an empty object tests nothing; give a value or operators"),
    ({"$and": {"lang": "en"}}, "filter.$and: expected a non-empty list of filters such as [{\"lang\": \"en\"}"),
    ({"$not": ["lang"]}, "filter.$not: expected a filter object such as {\"lang\": \"en\"}, got [\"lang\"]"),
    ({"lang": {"$in": "en"}}, "filter.lang.$in: expected a non-empty list of values such as [\"en\", \"de\"], got "
                              "\"en\""),
    ({"lang": {"$in": ["x" * 100]}}, None),  # long values are fine
])
def test_error_messages_name_the_path_and_the_fix(obj, message):
    if message is None:
        parse_filter(obj, FIELDS)
        return
    with pytest.raises(ConfigError) as exc:
        parse_filter(obj, FIELDS)
    assert str(exc.value).startswith(message), str(exc.value)


def test_a_long_value_in_a_message_is_cut():
    with pytest.raises(ConfigError) as exc:
        parse_filter({"lang": {"$gt": ["y" * 10_000]}}, FIELDS)
    assert len(str(exc.value)) < 300 and "..." in str(exc.value)


# ------------------------------------------------------------------------------------------------ SearchIndex, server

EXTRA = {  # d1..d6 of helpers.DOCS
    "d1": {"lang": "en", "year": 2019, "open": True, "meta": {"source": "pubmed", "cites": 12}},
    "d2": {"lang": "en", "year": 2021, "open": 1, "meta": {"source": "arxiv", "cites": 3}},
    "d3": {"lang": "de", "year": 2020.0, "meta": {"source": "pubmed", "cites": 40}},
    "d4": {"lang": "fr", "year": "2022", "open": False, "meta": "n/a"},
    "d5": {"year": None, "meta": {"source": "arxiv"}},
    "d6": {"lang": "de", "year": 2023, "open": True, "meta": {"source": "pubmed", "cites": 7.5}},
}


@pytest.fixture()
def rich_beir(beir) -> Path:  # noqa: F811
    """The BEIR folder of test_serving_index with numbers, booleans, nulls and nested objects in its documents."""
    (beir / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "title": t, "text": x, **EXTRA[i]}) + "\n"
                                               for i, t, x in DOCS), encoding="utf-8")
    return beir


def test_filters_through_search_index(tmp_path, rich_beir, tiny_model_dir):
    from robustir.index.store import SearchIndex

    with SearchIndex.build(tmp_path / "idx", tiny_model_dir, rich_beir, config=quiet())[0] as index:
        def found(f: dict) -> list[str]:
            return sorted(h.id for h in index.search(["sleep and exercise"], 6, f)[0])

        assert found({"lang": {"$ne": "en"}}) == ["d3", "d4", "d5", "d6"]  # d5 has no lang
        assert found({"lang": {"$in": ["de", "fr"]}}) == ["d3", "d4", "d6"]
        assert found({"year": {"$gte": 2020, "$lt": 2023}}) == ["d2", "d3"]  # "2022" is a string; 2020.0 = 2020
        assert found({"meta.source": "pubmed", "meta.cites": {"$gt": 10}}) == ["d1", "d3"]
        assert found({"$or": [{"open": True}, {"meta.cites": {"$lte": 3}}]}) == ["d1", "d2", "d6"]  # 1 is not true
        assert found({"$not": {"year": None}, "title": {"$lt": "F"}}) == ["d1", "d4"]
        assert found({"lang": ["de"], "id": {"$nin": ["d3"]}}) == ["d6"]
        index.check_filter({"meta.source": {"$in": ["arxiv"]}})
        with pytest.raises(ConfigError, match=r"filter\.meta\.cites\.\$gte: expected a number or a string"):
            index.check_filter({"meta.cites": {"$gte": [1]}})
        with pytest.raises(ConfigError, match="'colour' is in no document.*fields: id, title, lang, meta, open, year"):
            index.search(["x"], 3, {"colour": "red"})


def test_filters_through_post_search(tmp_path, rich_beir, tiny_model_dir):
    from robustir.index.store import SearchIndex
    from robustir.serving import ServeConfig, create_app, running_server

    SearchIndex.build(tmp_path / "idx", tiny_model_dir, rich_beir, config=quiet())[0].close()
    app = create_app(None, tmp_path / "idx", ServeConfig(max_wait_ms=0))
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        reply = client.post("/search", json={"query": "sleep", "top_k": 6,
                                             "filter": {"year": {"$gt": 2019, "$lte": 2021}}})
        assert reply.status_code == 200
        assert sorted(h["id"] for h in reply.json()["hits"]) == ["d2", "d3"]
        reply = client.post("/search", json={"query": "sleep", "filter": {"$or": [{"year": {"$gt": 2020}},
                                                                                   {"meta.cites": {"$gtt": 5}}]}})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == "filter"
        assert error["message"].startswith("filter.$or[1].meta.cites.$gtt: unknown operator '$gtt' (did you mean "
                                           "'$gt'?); operators: $eq, ")


def test_exists_is_has_a_value_and_its_negation():
    """``$exists: true`` is ``$ne: null`` (a value, not missing, not null), ``false`` is ``$eq: null`` -- parsed into
    those tests, so the Python and the LanceDB semantics agree by construction."""
    from robustir.index.store.filters import Condition, matches, parse_filter

    assert parse_filter({"lang": {"$exists": True}}, FIELDS) == parse_filter({"lang": {"$ne": None}}, FIELDS)
    assert parse_filter({"lang": {"$exists": False}}, FIELDS) == parse_filter({"lang": None}, FIELDS)
    has = parse_filter({"meta.year": {"$exists": True}}, FIELDS)
    records = [{"id": "a", "meta": {"year": 2020}}, {"id": "b", "meta": {"year": None}}, {"id": "c", "meta": {}},
               {"id": "d"}, {"id": "e", "meta": "not an object"}]
    assert [r["id"] for r in records if matches(has, r)] == ["a"]
    assert all(c.op in ("$ne", "$eq") for c in has.parts if isinstance(c, Condition)) if hasattr(has, "parts") \
        else has.op == "$ne"  # the parsed tree holds only the operators every store compiles
