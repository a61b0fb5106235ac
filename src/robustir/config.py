"""Stage configs loaded from YAML/JSON files, flags and ``key=value`` command-line overrides.

Every stage has a config dataclass (Tevatron style; pydantic v2 validates it, see :mod:`robustir.validation`).
``load_config`` reads a file (a key given twice is an error), merges the flags and the overrides such as
``loss_options.beta=0.2`` or ``batch_size=64`` (values parsed as YAML, so numbers, booleans and lists work),
and builds the config; pydantic rejects unknown keys and bad values, named by their key path.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .errors import ConfigError
from .validation import OptionError

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
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to read; a config is a few levels of options") from None
    except _DuplicateKey as exc:
        raise ConfigError(f"{path}: option {exc.key!r} is given twice{exc.where}; only one value can count: "
                          "remove the other") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of option: value")
    try:
        expanded = _expanded_size(data)
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to read; a config is a few levels of options") from None
    if expanded > MAX_CONFIG_VALUES:
        raise ConfigError(f"{path}: expands to more than {MAX_CONFIG_VALUES:,} values through YAML aliases (&anchor / "
                          "*alias used inside one another): write the values out, or use fewer nested aliases")
    return data


#: values a config file may expand to: a YAML alias may point at a list of aliases, so 1 kB of YAML can stand for
#: billions of values that validating (copying) them would allocate -- 2 GB measured for a 1 kB file
MAX_CONFIG_VALUES = 100_000


def _expanded_size(value: Any) -> int:
    """How many values ``value`` stands for once every alias is written out, counted without expanding (a shared
    list or mapping is counted once per reference, its size computed once)."""
    sizes: dict[int, int] = {}

    def size(item: Any) -> int:
        if not isinstance(item, (dict, list)):
            return 1
        known = sizes.get(id(item))
        if known is None:
            sizes[id(item)] = MAX_CONFIG_VALUES + 1  # until known: a value that contains itself counts as too many
            children = item.values() if isinstance(item, dict) else item
            known = 1 + sum(size(child) for child in children)
            sizes[id(item)] = min(known, MAX_CONFIG_VALUES + 1)  # capped: the sum cannot grow without bound
        return known

    return size(value)


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
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the last one silently). Merge
    keys (``<<: *defaults``) work as in YAML 1.1: the merged keys are defaults that the mapping's own keys override."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # merged by the base class (flatten_mapping)
                continue
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


def from_dict(cls: type[T], data: Any, *, where: str = "") -> T:
    """Build config ``cls`` from mapping ``data`` (pydantic validates it); errors name keys under ``where``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of option: value, got {type(data).__name__}")
    try:
        return cls(**data)
    except OptionError as exc:
        raise exc.under(where) from None


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
        value = data[key]
        if isinstance(value, str) and value.lower() in {"true", "false", "yes", "no", "1", "0"}:
            value = value.lower() in {"true", "yes", "1"}
        if not isinstance(value, bool):
            raise ConfigError(f"{where}.{key}: expected true/false, got {value!r}")
        out = {(target if k == key else k): (legacy_bf16(value) if k == key else v) for k, v in out.items()}
    return out


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


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)
