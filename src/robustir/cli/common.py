"""What every command shares: cyclopts builds the flags from the signatures and the stage configs; the layers.

**The command line comes from cyclopts** (https://cyclopts.readthedocs.io; issue 34 asked for a library and named
jsonargparse, tyro and pydantic-settings). Each command is a function whose signature is its flags; a stage's
config enters as one parameter, ``config: Annotated[TrainConfig | None, CONFIG] = None``, and cyclopts gives every
field of it a flag -- name (``--batch-size``), type, ``Literal`` choices, ``--x/--no-x`` switches, nested sections
(``--index.kind``), a dict's keys (``--loss-options.temperature``) and the help text read from the field's attribute
docstring -- and suggests the closest flag for a typo. Field metadata renames a flag or gives a section's fields
flags of their own, as ``Annotated[..., Parameter(name=...)]`` on the field. Why this library (tried 2026-11-26/27
against ``TrainConfig``): jsonargparse names every flag with underscores and has no ``--x/--no-x`` (61 dashed flags
in the docs, 149 in the tests would change); tyro cannot build a parser for ``TrainConfig``
(``UnsupportedTypeAnnotationError`` on ``str | list[TrainSource]``); pydantic-settings reads ``--train-data x.jsonl``
as the list ``['x.jsonl']`` and has no ``a.b=c``; cyclopts 5.5 handles all three and builds in 0.03-0.2 s.

**What stays ours, and why** (measured with cyclopts 5.5.2):

* The layers -- defaults < ``--config`` file < flags < ``key=value`` overrides -- are
  :func:`robustir.config.load_config`'s. cyclopts would build the config from the flags alone: a flag left out
  would take the field's default over the file's value, and a config valid only with its file's values would be
  refused before the file is read. :func:`record_flags` (a cyclopts config source: cyclopts calls it with the
  parsed arguments before converting them) takes the values of a config's flags out of the parse into the
  ``flags`` layer, so cyclopts passes ``None`` and the command calls :func:`stage_config`. One validation, one
  error text (pydantic's, translated to name the key path by :mod:`robustir.validation`, the same for the Python
  API), whichever layer a value came from.
* The config file's reader (:func:`robustir.config.read_config_file`): a key given twice, a YAML alias bomb, a
  folder or a non-UTF-8 file are refused with the line; cyclopts' Yaml source would keep the last key silently.
* ``bundled:NAME`` paths and the older spellings ``--bf16`` / ``--no-bf16`` / ``--fp32`` / ``--no-mine`` are
  rewritten in :mod:`robustir.cli.main` before parsing (one table).
"""

from __future__ import annotations

import contextvars
import dataclasses
import types
import typing
from pathlib import Path
from typing import Annotated, Any

import yaml
from cyclopts import UNSET, Parameter

from ..device import DEVICE_HELP
from ..errors import ConfigError
from ..precision import PRECISION_HELP
from ..precision import Precision as PrecisionChoice
from ..resources import dataset_path, default_model_path
from ..validation import PositiveInt, config_dataclass

#: a stage config's parameter: its fields are the command's flags (``config: Annotated[X | None, CONFIG] = None``)
CONFIG = Parameter(name="*")

ConfigFile = Annotated[str | None, Parameter(name="--config", help="YAML or JSON file of the config's fields; flags "
                                                                   "and key=value overrides take precedence")]
Overrides = Annotated[str, Parameter(show=False)]  # *overrides: Overrides -- trailing key=value items
Model = Annotated[str | None, Parameter(help="model folder or Hugging Face hub id (default: the bundled "
                                             "all-MiniLM-L6-v2)")]
StorageOption = Annotated[tuple[str, ...], Parameter(
    name="--storage-option", consume_multiple=False,
    help="for an index on S3 (s3://bucket/prefix): an object-store option KEY=VALUE such as "
         "aws_endpoint=http://127.0.0.1:9000, aws_region=eu-west-1, aws_access_key_id=...; repeatable; credentials "
         "otherwise come from the AWS environment (AWS_ACCESS_KEY_ID, a profile, a role)")]
Shard = Annotated[str | None, Parameter(help="process shard I of N (round-robin), e.g. 2/8; the output's name gets "
                                             ".shard-0000I-of-0000N before its suffix (robustir merge joins them)")]
Overwrite = Annotated[bool, Parameter(help="redo even if the output is complete")]
DocumentFormat = Annotated[typing.Literal["auto", "jsonl", "text", "beir"], Parameter(
    help="input format (auto: folder -> beir, .jsonl/.json -> jsonl, else text)")]
TextUnit = Annotated[typing.Literal["block", "line"], Parameter(
    help="plain text: one document per blank-line-separated block, or per line")]
Precision = Annotated[PrecisionChoice | None,
                      Parameter(help=f"{PRECISION_HELP} (default: auto); --bf16 / --no-bf16 / --fp32 are the older "
                                     "spellings of bf16 / fp32")]
Device = Annotated[str | None, Parameter(help=f"{DEVICE_HELP} (default: auto)")]



@config_dataclass
class EncoderOverrides:
    """The encoder settings a command that loads a saved model may override (``encoder: Annotated[EncoderOverrides |
    None, CONFIG] = None``): each left out is the model's own (its ``robustir_config.json`` or sentence-transformers
    settings), so the help shows that, not :class:`~robustir.models.encoder.EncoderConfig`'s defaults for a new
    model -- which a loaded model does not use."""

    pooling: typing.Literal["cls", "mean"] | None = None  # robustir.models.encoder.Pooling (it imports torch)
    """Sentence vector: the [CLS] token or the mean of the tokens [default: the model's own]"""
    normalize: bool | None = None
    """Unit-length vectors (cosine similarity) [default: the model's own]"""
    query_max_length: PositiveInt | None = None
    """Queries are cut to this many tokens [default: the model's own]"""
    passage_max_length: PositiveInt | None = None
    """Passages are cut to this many tokens [default: the model's own]"""
    query_instruction: str | None = None
    """Prefix added to every query (BGE style) [default: the model's own]"""
    passage_instruction: str | None = None
    """Prefix added to every passage [default: the model's own]"""


# ------------------------------------------------------------------------------------------ the flags layer

_GIVEN: contextvars.ContextVar[dict[str, dict]] = contextvars.ContextVar("robustir_cli_given", default={})
_FLAGS: contextvars.ContextVar[dict[str, dict[str, str]]] = contextvars.ContextVar("robustir_cli_flags", default={})


def record_flags(app: Any, commands: tuple[str, ...], arguments: Any) -> None:
    """cyclopts config source that fills nothing: the values given for each config parameter's flags (a parameter
    whose type is a dataclass) go into that parameter's ``flags`` layer (:func:`given`), and out of the parse, so
    cyclopts passes ``None`` for it and the command builds the config from every layer (:func:`stage_config`)."""
    layers: dict[str, dict] = {}
    names: dict[str, dict[str, str]] = {}
    for root in arguments:
        if root.keys or _section(root.hint) is None:
            continue
        layer = layers.setdefault(root.field_info.name, {})
        for child in root.children_recursive:
            if not child.tokens:
                continue
            names.setdefault(root.field_info.name, {})[".".join(child.keys)] = child.tokens[0].keyword or child.name
            keyed = [t for t in child.tokens if t.keys]  # a free mapping's keys: --loss-options.temperature 0.02
            for token in keyed:
                _put(layer, (*child.keys, *token.keys), _yaml_scalar(token.value))
            plain = [t for t in child.tokens if not t.keys]
            if plain:
                _put(layer, child.keys, _value(child.hint, plain))
            child.tokens.clear()
    _GIVEN.set(layers)
    _FLAGS.set(names)


def _put(layer: dict, keys: tuple[str, ...], value: Any) -> None:
    node = layer
    *parents, leaf = keys
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--{'.'.join(keys).replace('_', '-')}: {part} is given a value and sub-keys")
    node[leaf] = value


def _value(hint: Any, tokens: list) -> Any:
    """The given value of one flag: the token (``--x/--no-x``: True/False), or a list for a list field; a mapping
    field's value is read as YAML (``--loss-options '{beta: 0.2}'``)."""
    values = [token.value if token.implicit_value is UNSET else token.implicit_value for token in tokens]
    if _without_none(hint) is dict or typing.get_origin(_without_none(hint)) is dict:
        values = [_yaml_scalar(v) if isinstance(v, str) else v for v in values]
    if typing.get_origin(_without_none(hint)) in (list, tuple, set) or len(values) > 1:
        return values
    return values[0]


def _yaml_scalar(raw: str) -> Any:
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw
    return raw if isinstance(value, (dict, list)) and not raw.lstrip().startswith(("{", "[")) else value


def _section(hint: Any) -> type | None:
    hint = _without_none(hint)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _without_none(args[0])
    return hint


def given(name: str = "config") -> dict:
    """The flags given for config parameter ``name``, nested as the config's fields (``{"index": {"kind": ...}}``)."""
    return _GIVEN.get().get(name, {})


def given_flags(name: str = "config") -> dict[str, str]:
    """The flags given for config parameter ``name``, as typed: ``{"ann.kind": "--ann"}``."""
    return _FLAGS.get().get(name, {})


def stage_config(cls: type, config_file: str | None = None, overrides: typing.Iterable[str] = (),
                 name: str = "config") -> Any:
    """Config ``cls`` from every layer: defaults < ``config_file`` < the flags < ``key=value`` overrides."""
    from ..config import load_config

    return load_config(cls, config_file, list(overrides), flags=given(name))


def encoder_options(name: str = "encoder") -> dict:
    """The :class:`~robustir.models.encoder.EncoderConfig` flags given (``--pooling mean``), every field named, None
    for those left out: the model folder's value stands."""
    from ..models.encoder import EncoderConfig

    options = given(name)
    return {f.name: options.get(f.name) for f in dataclasses.fields(EncoderConfig)}


def storage_options(values: typing.Iterable[str]) -> dict | None:
    """The ``--storage-option`` flags as a dict (None when none were given); a malformed or unknown one is
    refused."""
    from ..index.store.storage import parse_storage_options

    return parse_storage_options(list(values) or None) or None


def model_or_default(value: str | None) -> str:
    if value is not None and not value.strip():  # --model "" (an unset shell variable): not the bundled model
        raise ConfigError("--model is empty; name a model folder or hub id, or leave --model out for the bundled "
                          "all-MiniLM-L6-v2")
    return value if value else default_model_path()


def data_or_default(value: str | None) -> Path:
    return Path(value) if value else dataset_path("scifact")
