"""Argument dataclasses loaded from YAML/JSON files with ``key=value`` command-line overrides.

Every stage has a dataclass of its arguments (Tevatron style). ``load_config`` reads a file, applies
overrides such as ``loss.temperature=0.02`` or ``batch_size=64`` (values parsed as YAML, so numbers,
booleans and lists work), and builds the dataclass, rejecting unknown keys with a helpful message.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .errors import ConfigError
from .validation import RangeError

T = TypeVar("T")


def read_config_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} not found")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; pass a YAML or JSON file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is allowed
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as "
                          "UTF-8") from None
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys) if path.suffix == ".json" else \
            yaml.load(text, Loader=_UniqueKeyLoader)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot parse ({exc})") from None
    except _DuplicateKey as exc:
        raise ConfigError(f"{path}: option {exc.key!r} is given twice{exc.where}; only one value can count: "
                          "remove the other") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of option: value")
    return data


class _DuplicateKey(Exception):
    def __init__(self, key: Any, where: str = "") -> None:
        super().__init__(key)
        self.key, self.where = key, where


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads`` hook: a key given twice in one object is an error (JSON keeps the last one silently)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base class reports it
                break
            if duplicate:
                raise _DuplicateKey(key, f" (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """Apply ``a.b=value`` overrides (values parsed as YAML) to a nested dict, in place."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. lr=2e-5 or loss.beta=0.2")
        key, raw = item.split("=", 1)
        if not key.strip():
            raise ConfigError(f"override {item!r}: no key before '='; expected key=value, e.g. lr=2e-5")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, dict) and not raw.lstrip().startswith("{"):
            value = raw  # "Represent this query: " is text with a colon, not a YAML mapping ({a: 1} is one)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = value
    return data


def from_dict(cls: type[T], data: dict, *, where: str = "config") -> T:
    """Build dataclass ``cls`` from ``data``; nested dataclass fields take nested dicts."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    data = precision_aliases(data, fields, where)
    unknown = [k for k in data if k not in fields]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, fields, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"{where}: unknown option(s) {', '.join(hints)}; known: {', '.join(sorted(fields))}")
    hints_by_name = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        field = fields[key]
        if isinstance(value, dict) and field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
            if dataclasses.is_dataclass(default):
                # a section given in part keeps the *field's* defaults for the rest (JudgeConfig.llm defaults to
                # temperature 0 and 16 tokens, not LLMConfig's generation defaults)
                value = _deep_merge(_shallow_fields(default), value)
        kwargs[key] = _coerce(hints_by_name[key], value, f"{where}.{key}")
    try:
        return cls(**kwargs)
    except RangeError as exc:  # name the key by its path: train.lr, filter.teacher.relative_margin
        raise exc.under(where.removeprefix("config").lstrip(".")) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def precision_aliases(data: dict, fields: dict, where: str) -> dict:
    """The older switches ``bf16`` / ``eval_bf16`` / ``train_bf16`` as the ``precision`` fields that replaced them:
    true = ``bf16``, false = ``fp32`` (:func:`robustir.precision.legacy_bf16`). Giving both is an error."""
    from .precision import legacy_bf16

    out = data
    for key in [k for k in data if isinstance(k, str) and k.endswith("bf16") and k not in fields]:
        target = key[:-len("bf16")] + "precision"
        if target not in fields:
            continue
        if target in data:
            raise ConfigError(f"{where}: {key} and {target} are both given; {key} is the older spelling of "
                              f"{target}: keep only {target}")
        value = _coerce(bool, data[key], f"{where}.{key}")
        out = {(target if k == key else k): (legacy_bf16(value) if k == key else v) for k, v in out.items()}
    return out


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: is a section of options (a mapping such as {{key: value}}), got {value!r}")
        return from_dict(hint, value, where=where)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        sections = [a for a in args if dataclasses.is_dataclass(a)]
        if isinstance(value, dict) and len(sections) == 1:
            return from_dict(sections[0], value, where=where)  # a section: its own error names the key path
        lists = [a for a in args if typing.get_origin(a) in (list, tuple)]
        if isinstance(value, (list, tuple)) and len(lists) == 1:
            return _coerce(lists[0], value, where)  # e.g. a list of sections: its items' errors name their path
        for arg in args:
            try:
                return _coerce(arg, value, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: cannot use {value!r} as {hint}")
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{where}: {value!r} is not one of {list(typing.get_args(hint))}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (inner, *_) = typing.get_args(hint) or (Any,)
        if dataclasses.is_dataclass(inner):  # a list of sections: name the item, train_data[1].weight
            return [_coerce(inner, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return [_coerce(inner, v, where) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in {"true", "false", "1", "0", "yes", "no"}:
            return value.lower() in {"true", "1", "yes"}
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            as_float = float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
        if as_float != int(as_float):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(as_float)
    if hint is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if hint is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return value
    return value


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None,
                flags: dict | None = None) -> T:
    """Precedence, lowest first: dataclass defaults < config file < explicit ``flags`` < ``key=value`` overrides."""
    data: dict = {}
    if path:
        data = read_config_file(path)
    # each layer's older ``bf16`` switches become ``precision`` first, so a higher layer's --no-bf16 (precision) wins
    # over a file's ``bf16: true`` instead of meeting it as a second spelling
    layers = [_aliases_deep(cls, layer, where) for layer, where in
              ((data, f"config file {path}" if path else "config"), (flags or {}, "flags"),
               (apply_overrides({}, overrides), "overrides"))]
    merged = _deep_merge(_deep_merge(layers[0], layers[1]), layers[2])
    return from_dict(cls, merged)


def _aliases_deep(cls: type, data: Any, where: str) -> Any:
    """:func:`precision_aliases` on ``data`` and, recursively, on its sections of dataclass type."""
    if not isinstance(data, dict) or not dataclasses.is_dataclass(cls):
        return data
    fields = {f.name: f for f in dataclasses.fields(cls)}
    data = precision_aliases(data, fields, where)
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for key, value in data.items():
        if key in fields and isinstance(value, dict):
            hint = hints[key]
            options = [hint, *typing.get_args(hint)]
            section = next((a for a in options if dataclasses.is_dataclass(a)), None)
            if section is not None:
                out[key] = _aliases_deep(section, value, f"{where}.{key}")
    return out


def _deep_merge(low: dict, high: dict) -> dict:
    out = dict(low)
    for key, value in high.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _shallow_fields(obj: Any) -> dict:
    """A dataclass instance as a dict of its fields, nested sections as dicts (values not deep-copied)."""
    return {f.name: (_shallow_fields(v) if dataclasses.is_dataclass(v := getattr(obj, f.name)) else v)
            for f in dataclasses.fields(obj)}


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)
