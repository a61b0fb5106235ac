"""Flags shared by several stages, so each means the same everywhere, and flags generated from config dataclasses.

:func:`add_config_flags` turns fields of a stage's config dataclass into argparse flags (name, type, choices and
help all read from the dataclass, so they cannot drift from it); :func:`flags_from_args` turns the flags that
were given into the ``flags`` layer of :func:`robustir.config.load_config`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import re
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..errors import ConfigError
from ..resources import dataset_path, default_model_path


def add_encoder_args(parser: argparse.ArgumentParser, model_required: bool = False) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", required=model_required, default=None,
                       help="model folder or Hugging Face hub id (default: the bundled all-MiniLM-L6-v2)")
    group.add_argument("--pooling", choices=["cls", "mean"], default=None,
                       help="override the pooling read from the model folder")
    group.add_argument("--query-instruction", default=None, help="prefix added to every query (BGE style)")
    group.add_argument("--passage-instruction", default=None, help="prefix added to every passage")
    group.add_argument("--query-max-length", type=int, default=None)
    group.add_argument("--passage-max-length", type=int, default=None)
    group.add_argument("--batch-size", type=int, default=64, help="encoding batch size")
    add_precision_arg(group)
    add_device_arg(group)


def add_precision_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, dest: str = "precision",
                      generated: bool = False) -> None:
    """``--precision`` (unless ``generated`` from a config field already) and the older ``--bf16`` / ``--no-bf16``,
    aliases of ``--precision bf16`` / ``--precision fp32``; all default to None (the config's, ``auto``)."""
    from ..precision import PRECISION_HELP, PRECISIONS

    if not generated:
        parser.add_argument("--precision", dest=dest, choices=PRECISIONS, default=None,
                            help=f"{PRECISION_HELP} (default: auto)")
    parser.add_argument("--bf16", dest=dest, action="store_const", const="bf16", help="alias of --precision bf16")
    parser.add_argument("--no-bf16", dest=dest, action="store_const", const="fp32", help="alias of --precision fp32")


def add_device_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--device`` for stages whose device is not a generated config flag (default None: the config's, ``auto``)."""
    from ..device import DEVICE_HELP

    parser.add_argument("--device", default=None, help=f"{DEVICE_HELP} (default: auto)")


def encoder_options(args: argparse.Namespace) -> dict:
    return {
        "pooling": args.pooling,
        "query_instruction": args.query_instruction,
        "passage_instruction": args.passage_instruction,
        "query_max_length": args.query_max_length,
        "passage_max_length": args.passage_max_length,
    }


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



def config_with_encoder_flags(cls: type, args: argparse.Namespace, batch_field: str = "batch_size") -> Any:
    """A stage's config from its generated flags plus the shared encoder flags of :func:`add_encoder_args`
    (``--batch-size`` into ``batch_field``, and ``--precision`` / ``--device`` when given)."""
    from ..config import load_config

    flags = flags_from_args(args, args._flag_keys)
    flags[batch_field] = args.batch_size
    for name in ("precision", "device"):
        if getattr(args, name) is not None:
            flags[name] = getattr(args, name)
    return load_config(cls, None, None, flags)

# ------------------------------------------------------------------------------------------ generated flags

def add_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, fields: Iterable[str], *,
                     rename: Mapping[str, str] | None = None, help: Mapping[str, str] | None = None,
                     extra: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, str]:
    """Add a flag for each field path of dataclass ``cls`` (``"lr"``, ``"llm.base_url"``); return ``{dest: path}``.

    The flag is ``--<last part, _ -> ->`` (or ``--<rename[path]>``); its type is the field's annotation (``int``,
    ``float``, ``str``; ``X | None`` unwrapped), a ``Literal[...]`` gives ``choices``, a ``list[X]`` takes one or
    more values, and a ``bool`` becomes a ``--x`` / ``--no-x`` switch. Every flag defaults to ``None``, so an absent
    flag leaves the config file's value (see :func:`flags_from_args`). The help is the field's attribute
    docstring (the string right after it in the class body) or its trailing ``# comment`` -- or ``help[path]``
    -- followed by the dataclass default. ``extra[path]`` adds or replaces argparse keywords (``choices``,
    ``metavar``, ...). Fields that cannot be a flag (sections, dicts) raise ``TypeError``: set them with
    ``key=value`` overrides instead.
    """
    fields = list(fields)
    rename, help, extra = dict(rename or {}), dict(help or {}), dict(extra or {})
    for name, option in (("rename", rename), ("help", help), ("extra", extra)):
        stray = sorted(set(option) - set(fields))
        if stray:
            raise ValueError(f"add_config_flags({cls.__name__}): {name} names field(s) {stray} that are not listed")
    keys: dict[str, str] = {}
    for path in fields:
        owner, hint, default = _resolve_field(cls, path)
        flag = (rename.get(path) or path.rsplit(".", 1)[-1]).lstrip("-").replace("_", "-")
        dest = flag.replace("-", "_")
        text = help[path] if path in help else field_help(owner, path.rsplit(".", 1)[-1])
        text = text[:-1] if text.endswith(".") and not text.endswith("..") else text
        text = f"{text} (default: {_show_default(default)})" if text else f"default: {_show_default(default)}"
        kwargs: dict[str, Any] = {"dest": dest, "default": None, "help": text.replace("%", "%%")}
        kwargs.update(_argparse_kind(hint, f"{cls.__name__}.{path}"))
        kwargs.update(extra.get(path, {}))
        parser.add_argument(f"--{flag}", **kwargs)
        keys[dest] = path
    return keys


def field_help(cls: type, name: str) -> str:
    """The attribute docstring of field ``name`` of dataclass ``cls`` (or a base), else its trailing comment."""
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass):
            text = _field_docs(klass).get(name)
            if text is not None:
                return text
    return ""


@functools.lru_cache(maxsize=None)
def _field_docs(cls: type) -> dict[str, str]:
    """``{field: help}`` from the class source, parsed once: attribute docstrings win over trailing comments."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                comments[token.start[0]] = token.string.lstrip("#").strip()
            elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                code_lines.update(range(token.start[0], token.end[0] + 1))
    except (tokenize.TokenError, IndentationError):
        pass
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.ClassDef):
        return {}
    docs: dict[str, str] = {}
    body = node.body
    for index, stmt in enumerate(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        after = body[index + 1] if index + 1 < len(body) else None
        if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = _clean_doc(after.value.value)
            continue
        line = stmt.end_lineno or stmt.lineno
        if line in comments and line in code_lines:  # a trailing comment, not a comment line of its own
            docs[stmt.target.id] = _clean_doc(comments[line])
    return docs


def _clean_doc(text: str) -> str:
    text = " ".join(inspect.cleandoc(text).split())
    text = re.sub(r":[a-z]+:`~?([^`]*)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)  # Sphinx roles
    return text.replace("``", "")


def _resolve_field(cls: type, path: str) -> tuple[type, Any, Any]:
    """``(dataclass owning the field, its resolved type hint, its default)`` for a dotted field path."""
    owner, value = cls, _default_instance(cls)
    parts = path.split(".")
    for depth, part in enumerate(parts):
        names = {f.name for f in dataclasses.fields(owner)}
        if part not in names:
            raise ValueError(f"add_config_flags: {cls.__name__} has no field {path!r} ({owner.__name__} fields: "
                             f"{', '.join(sorted(names))})")
        hint = typing.get_type_hints(owner)[part]
        value = getattr(value, part, dataclasses.MISSING) if value is not dataclasses.MISSING else value
        if depth == len(parts) - 1:
            return owner, hint, value
        section = [a for a in (_without_none(hint),) if dataclasses.is_dataclass(a)]
        if not section:
            raise ValueError(f"add_config_flags: {cls.__name__}.{path}: {part} is not a section")
        owner = section[0]
        if value is None or value is dataclasses.MISSING:
            value = _default_instance(owner)
    raise AssertionError("unreachable")


def _default_instance(cls: type) -> Any:
    try:
        return cls()
    except Exception:  # a class with required fields or a failing check: read the field defaults instead
        values = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                values[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                values[f.name] = f.default_factory()
            else:
                values[f.name] = dataclasses.MISSING
        return types.SimpleNamespace(**values)


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _argparse_kind(hint: Any, where: str) -> dict[str, Any]:
    """argparse keywords (type/choices/action/nargs) for a field's type hint."""
    hint = _without_none(hint)
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and str in typing.get_args(hint):
        return {"type": str}  # text or a richer form (train_data: a path, or sources in a config file)
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        args = typing.get_args(hint)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"{where}: a fixed-length tuple cannot be a flag; set it with key=value")
        inner = _without_none(args[0]) if args else str
        if inner is bool:
            raise TypeError(f"{where}: a list of booleans cannot be a flag; set it with key=value")
        return {"nargs": "+", **_scalar_kind(inner, where)}
    return _scalar_kind(hint, where)


def _scalar_kind(hint: Any, where: str) -> dict[str, Any]:
    if typing.get_origin(hint) is typing.Literal:
        values = typing.get_args(hint)
        kinds = {type(v) for v in values}
        if len(kinds) != 1 or not kinds <= {str, int, float}:
            raise TypeError(f"{where}: Literal{list(values)} mixes types; it cannot be a flag")
        return {"type": kinds.pop(), "choices": list(values)}
    if hint in (int, float, str):
        return {"type": hint}
    raise TypeError(f"{where}: a {hint!r} field cannot be a flag; set it with key=value overrides")


def _show_default(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "required"
    if isinstance(value, str):
        return value if value else "''"
    return str(value)
