"""Flags generated from the stage configs, and the few flags shared by commands without one.

Why this stays hand-written beside pydantic (issue 34 asked for jsonargparse, tyro or pydantic-settings; tried on
2026-11-26 against ``TrainConfig`` with jsonargparse 4.53.0 and tyro 1.0.17, as the issue 34 note describes):

* **jsonargparse** (LightningCLI's parser) names every flag with underscores (``--batch_size``; it has no setting
  for dashes): 61 dashed flags in README/docs and 149 in the tests would change, ``--no-progress``-style switches
  become ``--progress false``, and a flattened section's flags (``--base-url``) become ``--llm.base_url``. Its
  help shows no field description unless attribute-docstring parsing is switched on, and no range. A parser over
  ``TrainConfig`` builds in 0.04 s (ours: 0.006 s), so speed is not the objection: the CLI every document and
  user script uses is.
* **tyro** keeps dashes, ``--x/--no-x`` and reads our attribute docstrings, but has no config files nor
  ``a.b=c`` overrides, turns ``train_data: str | list[TrainSource]`` into subcommands and cannot build a parser
  for ``TrainConfig`` at all (``UnsupportedTypeAnnotationError`` from ``tyro.extras.get_parser``).
* **pydantic-settings** (2.16.3, re-tried on 2026-11-26 in a later session; the first note's "needs
  ``BaseSettings``" was wrong for this version): ``CliApp.run(TrainConfig, cli_args=...)`` does build a parser from
  the pydantic dataclass in 0.08 s, with ``--batch-size`` and ``--x/--no-x`` flags listed in its usage; but
  ``--train-data x.jsonl`` fails validation (the ``str | list[TrainSource]`` field is read as the list
  ``['x.jsonl']``), and it has no ``a.b=c`` overrides.
* **cyclopts** (5.5.2, tried on 2026-11-26 in a third session) is the candidate that fits: ``App.command`` over
  ``config: Annotated[TrainConfig | None, Parameter(name="*")] = None`` builds in 0.03-0.07 s, keeps dashes
  (``--batch-size``) and ``--x/--no-x``, reads the attribute docstrings and ``Literal`` choices into its help, parses
  ``--train-data x.jsonl`` into the ``str | list[TrainSource]`` field correctly, suggests ``--batch-size`` for a
  typo, and takes ``--loss-options.temperature 0.02`` as the dotted override. What moving onto it still needs:
  pydantic's own errors replace the short ones (``Input should be greater than or equal to 1 [type=...]``), so the
  one translator here stays; values under a free ``dict`` field arrive as strings (``{'temperature': '0.02'}``)
  until the loss's Options model validates them; list fields get an extra ``--empty-x`` flag unless
  ``Parameter(negative="")``; its YAML config source (``cyclopts.config.Yaml``) in place of
  :func:`robustir.config.load_config`. Not moved yet: the 20 commands and their ~150 CLI tests are a change of
  its own.

So the flags stay generated from the configs' own pydantic field info (below): the type, range, choices and help
of a field are still written once, on the field.

:func:`add_config_flags` gives every field of a stage's config a flag (name, type, choices and help all read from
the config's pydantic field info, so they cannot drift from it; no command keeps a field list);
:func:`flags_from_args` turns the flags that were given into the ``flags`` layer of
:func:`robustir.config.load_config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Mapping

from pydantic_core import PydanticUndefined

from ..errors import ConfigError
from ..resources import dataset_path, default_model_path
from ..validation import field_help


def add_encoder_args(parser: argparse.ArgumentParser, model_required: bool = False, *,
                     title: str = "model", model_help: str | None = None) -> None:
    """``--model`` and a flag for each :class:`~robustir.models.encoder.EncoderConfig` field (their values override
    the model folder's; :func:`encoder_options` reads them back). ``--batch-size``, ``--precision`` and ``--device``
    come from the stage's config (:func:`add_config_flags`), or :func:`add_encoding_args` where there is none."""
    from ..models.encoder import EncoderConfig

    group = parser.add_argument_group(title)
    group.add_argument("--model", required=model_required, default=None,
                       help=model_help or "model folder or Hugging Face hub id (default: the bundled all-MiniLM-L6-v2)")
    keys = add_config_flags(group, EncoderConfig, default_text="the model folder's")
    parser.set_defaults(_encoder_keys=keys)


def add_encoding_args(parser: argparse.ArgumentParser) -> None:
    """``--batch-size``, ``--precision`` and ``--device`` for a command without a stage config (``robustir encode``)."""
    group = parser.add_argument_group("encoding")
    group.add_argument("--batch-size", type=int, default=64, help="encoding batch size (default: 64)")
    add_precision_arg(group)
    add_device_arg(group)


def add_precision_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, dest: str = "precision",
                      generated: bool = False) -> None:
    """``--precision`` (unless ``generated`` from a config field already) and the older ``--bf16`` / ``--no-bf16``,
    aliases of ``--precision bf16`` / ``--precision fp32``; all default to None (the config's, ``auto``)."""
    from ..precision import PRECISION_HELP, PRECISIONS

    if "--bf16" in parser._option_string_actions:
        return  # added with the generated --precision flag already
    if not generated:
        parser.add_argument("--precision", dest=dest, choices=PRECISIONS, default=None,
                            help=f"{PRECISION_HELP} (default: auto)")
    parser.add_argument("--bf16", dest=dest, action="store_const", const="bf16", help="alias of --precision bf16")
    parser.add_argument("--no-bf16", dest=dest, action="store_const", const="fp32", help="alias of --precision fp32")


def add_device_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--device`` for stages whose device is not a generated config flag (default None: the config's, ``auto``)."""
    from ..device import DEVICE_HELP

    parser.add_argument("--device", default=None, help=f"{DEVICE_HELP} (default: auto)")


def add_storage_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--storage-option KEY=VALUE`` (repeatable): the object store of an ``s3://`` index
    (:mod:`robustir.serving.storage`)."""
    parser.add_argument("--storage-option", action="append", default=None, metavar="KEY=VALUE",
                        help="for an index on S3 (s3://bucket/prefix): an object-store option such as "
                             "aws_endpoint=http://127.0.0.1:9000, aws_region=eu-west-1, aws_access_key_id=...; "
                             "repeatable; credentials otherwise come from the AWS environment (AWS_ACCESS_KEY_ID, a "
                             "profile, a role)")


def storage_options(args: argparse.Namespace) -> dict | None:
    """The ``--storage-option`` flags as a dict (None when none were given); a malformed or unknown one is
    refused."""
    from ..serving.storage import parse_storage_options

    return parse_storage_options(args.storage_option) or None


def encoder_options(args: argparse.Namespace) -> dict:
    """The :class:`~robustir.models.encoder.EncoderConfig` overrides of :func:`add_encoder_args` (None: the model
    folder's value)."""
    return {path: getattr(args, dest, None) for dest, path in args._encoder_keys.items()}


def model_or_default(value: str | None) -> str:
    if value is not None and not value.strip():  # --model "" (an unset shell variable): not the bundled model
        raise ConfigError("--model is empty; name a model folder or hub id, or leave --model out for the bundled "
                          "all-MiniLM-L6-v2")
    return value if value else default_model_path()


def data_or_default(value: str | None) -> Path:
    return Path(value) if value else dataset_path("scifact")


def flags_from_args(args: argparse.Namespace, names: dict[str, str]) -> dict:
    """Config values from the flags that were given: ``{dest: "a.b"}`` → ``{"a": {"b": value}}``.

    Flags left at ``None`` are omitted, so a config file's value stands unless the flag is given.
    """
    flags: dict = {}
    for dest, key in names.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        node = flags
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return flags



def config_from_flags(cls: type, args: argparse.Namespace) -> Any:
    """A stage's config from its generated flags (:func:`add_config_flags`)."""
    from ..config import load_config

    return load_config(cls, None, None, flags_from_args(args, args._flag_keys))

# ------------------------------------------------------------------------------------------ generated flags

def add_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
                     default_text: str | None = None) -> dict[str, str]:
    """A flag for every field of config ``cls`` that can be one; return ``{dest: field path}``.

    Everything is read from the config's own field info, so flags cannot drift from it: the flag is
    ``--<field, _ -> ->`` unless the field's metadata renames it (:func:`robustir.validation.cli`); its type is the
    field's annotation (``int``, ``float``, ``str``; ``X | None`` unwrapped), a ``Literal[...]`` gives ``choices``,
    a list takes one or more values, a ``bool`` is a ``--x`` / ``--no-x`` switch; the help is the field's
    description (its attribute docstring, read by pydantic) and its default (or ``default_text``). A section field
    marked ``flatten`` contributes its own fields' flags (``llm.base_url`` → ``--base-url``); other sections,
    mappings and fields marked ``hidden`` have no flag (a config file or ``key=value`` sets them). A flag the
    command already defines is left to it. Every flag defaults to ``None``, so an absent flag leaves the config
    file's value (:func:`flags_from_args`).
    """
    keys: dict[str, str] = {}
    for path, owner, name, kind, default, flag in _flaggable(parser, cls):
        shown = default_text if default_text is not None else _show_default(default)
        dest = flag.replace("-", "_")
        parser.add_argument(f"--{flag}", dest=dest, default=None, help=_help(field_help(owner, name), shown), **kind)
        keys[dest] = path
    if "precision" in keys:  # the older spellings of --precision fp32 / bf16
        add_precision_arg(parser, "precision", generated=True)
    return keys


def add_method_flags(parser: argparse.ArgumentParser, configs: Mapping[str, type]) -> dict[str, dict[str, str]]:
    """Flags for several alternative configs (``robustir filter --method llm|teacher|sieve``): a flag of every
    method goes in the main group, one of some methods in a group named by them; a flag shared by methods whose
    fields mean different things says so in its help. Returns ``{method: {dest: field path}}``."""
    fields: dict[str, list[tuple[str, str, type, str, dict, Any]]] = {}
    for method, cls in configs.items():
        for path, owner, name, kind, default, flag in _flaggable(parser, cls):
            fields.setdefault(flag, []).append((method, path, owner, name, kind, default))
    groups: dict[tuple[str, ...], Any] = {}
    keys: dict[str, dict[str, str]] = {method: {} for method in configs}
    for flag, users in fields.items():
        methods = tuple(m for m in configs if m in {u[0] for u in users})
        if len(methods) == len(configs):
            group = parser
        else:
            group = groups.get(methods) or groups.setdefault(methods, parser.add_argument_group(" / ".join(methods)))
        texts = {method: field_help(owner, name) for method, _, owner, name, _, _ in users}
        known = next((t for t in texts.values() if t), "")
        texts = {method: text or known for method, text in texts.items()}  # an undocumented twin reads the same
        defaults = {method: _show_default(default) for method, *_, default in users}
        if len(set(texts.values())) == 1 and len(set(defaults.values())) == 1:
            text = _help(known, next(iter(defaults.values())))
        else:
            text = "; ".join(f"{m}: {_help(texts[m], defaults[m])}" for m in methods)
        kinds = [u[4] for u in users]
        kind = kinds[0] if all(k == kinds[0] for k in kinds) else {"type": str}
        dest = flag.replace("-", "_")
        group.add_argument(f"--{flag}", dest=dest, default=None, help=text, **kind)
        for method, path, *_ in users:
            keys[method][dest] = path
    return keys


def _flaggable(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type):
    """:func:`config_flags` of ``cls`` that can be a flag and that the command does not define itself, each with its
    argparse keywords in place of the type hint."""
    for path, owner, name, hint, default, flag in config_flags(cls):
        kind = _argparse_kind(hint)
        if kind is not None and f"--{flag}" not in parser._option_string_actions:
            yield path, owner, name, kind, default, flag


def _help(text: str, default: str) -> str:
    """A field's description (its final period dropped) and its default, ``%`` escaped for argparse."""
    text = text[:-1] if text.endswith(".") and not text.endswith("..") else text
    return (f"{text} (default: {default})" if text else f"default: {default}").replace("%", "%%")


def config_flags(cls: type, prefix: str = "", default: Any = None):
    """``(path, owning class, field name, type hint, default, flag name)`` for each field of config ``cls`` that is
    not hidden, the fields of ``flatten`` sections in their place."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("cli") or {}
        if meta.get("hidden"):
            continue
        if default is not None:  # a flattened section: the containing config's default section
            value = getattr(default, f.name)
        else:
            value = cls.__pydantic_fields__[f.name].get_default(call_default_factory=True)
            value = dataclasses.MISSING if value is PydanticUndefined else value
        if meta.get("flatten"):
            section = _without_none(hints[f.name])
            yield from config_flags(section, f"{prefix}{f.name}.",
                                    value if dataclasses.is_dataclass(value) else None)
            continue
        flag = meta.get("flag") or f.name.replace("_", "-")
        yield f"{prefix}{f.name}", cls, f.name, hints[f.name], value, flag


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _without_none(args[0])
    return hint


def _argparse_kind(hint: Any) -> dict[str, Any] | None:
    """argparse keywords (type/choices/action/nargs) for a field's type hint; None when it cannot be a flag."""
    hint = _without_none(hint)
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and str in typing.get_args(hint):
        return {"type": str}  # text or a richer form (train_data: a path, or sources in a config file)
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        args = typing.get_args(hint)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return None  # a fixed-length tuple: key=value
        inner = _without_none(args[0]) if args else str
        scalar = _scalar_kind(inner)
        return None if inner is bool or scalar is None else {"nargs": "+", **scalar}
    return _scalar_kind(hint)


def _scalar_kind(hint: Any) -> dict[str, Any] | None:
    if typing.get_origin(hint) is typing.Literal:
        values = typing.get_args(hint)
        kinds = {type(v) for v in values}
        if len(kinds) != 1 or not kinds <= {str, int, float}:
            return None
        return {"type": kinds.pop(), "choices": list(values)}
    if hint in (int, float, str):
        return {"type": hint}
    return None


def _show_default(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "required"
    if isinstance(value, str):
        return value if value else "''"
    return str(value)
