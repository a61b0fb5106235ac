"""What an output depends on, in one value: its settings (minus operational fields), its inputs' content and
the fingerprints of the outputs it was made from.

A config field that does not change the result (a batch size for encoding, a progress bar, where a cache lives,
the device) says so itself: ``field(..., metadata=OPERATIONAL)`` or :func:`operational`. :func:`settings_of`
leaves those out, recursively through nested sections; nothing else keeps a list of them.

Inputs are digested by content (:func:`robustir.io.input_digest`: every data file hashed whole, model weights
sampled), so an input edited in place changes the fingerprint even when its path does not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..io import describe_changes, input_digest

__all__ = ["OPERATIONAL", "added", "operational", "is_operational", "settings_of", "Fingerprint", "fingerprint",
           "digest_inputs"]

#: field metadata of a config field that does not change what the stage produces
OPERATIONAL = {"operational": True}
_SECRETS = ("api_key",)


def operational(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
                metadata: dict | None = None) -> Any:
    """A dataclass field marked operational: it is left out of every fingerprint (``metadata``: more field metadata,
    such as :func:`robustir.validation.cli`)."""
    return field(default=default, default_factory=default_factory, metadata={**OPERATIONAL, **(metadata or {})})


def is_operational(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("operational"))


def added(default: Any) -> Any:
    """A result field added to a config after outputs were made without it: left out of the fingerprint while it
    holds this ``default`` -- the behaviour before it existed -- so finished outputs stay finished on upgrade, and
    counted as soon as it is set to anything else."""
    return field(default=default, metadata={"added_default": default})


def _left_out(f: dataclasses.Field, value: Any) -> bool:
    return is_operational(f) or ("added_default" in f.metadata and value == f.metadata["added_default"])


def settings_of(config: Any, *, skip: tuple[str, ...] = ()) -> Any:
    """``config`` as JSON-ready data without its operational fields (and the names in ``skip``): a dataclass
    becomes a dict of its other fields, nested sections likewise; secrets (``api_key``) become ``"<set>"`` or
    None, so changing a key never re-runs anything and no key lands on disk."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: (_secret(getattr(config, f.name)) if f.name in _SECRETS else
                         settings_of(getattr(config, f.name)))
                for f in dataclasses.fields(config)
                if not _left_out(f, getattr(config, f.name)) and f.name not in skip}
    if isinstance(config, Mapping):
        return {str(k): (_secret(v) if k in _SECRETS else settings_of(v)) for k, v in config.items() if k not in skip}
    if isinstance(config, (list, tuple)):
        return [settings_of(v) for v in config]
    if isinstance(config, Path):
        return str(config)
    if config is None or isinstance(config, (str, int, float, bool)):
        return config
    return str(config)


def _secret(value: Any) -> str | None:
    return "<set>" if value else None


def digest_inputs(inputs: Mapping[str, Any], cache: dict | None = None) -> dict[str, dict]:
    """``name -> input_digest(path)`` for every input that is given; a model folder (a name ending in ``model``)
    is digested as a model (its large weight files sampled). Names that are not local paths (hub ids) are kept by
    name. ``cache``: digests already taken by the same caller (a pipeline run, a benchmark grid), keyed by path --
    for inputs that do not change while it runs, so one model or data folder is read once, not once per stage."""
    out: dict[str, dict] = {}
    for name, item in inputs.items():
        if item is None or item == "":
            continue
        if isinstance(item, (list, tuple)) or Path(str(item)).expanduser().exists():
            target = item if isinstance(item, (list, tuple)) else Path(str(item)).expanduser()
            key = (str(target), name.endswith("model"))
            if cache is None or key not in cache:
                # a model folder's card (README.md) is not the model; a data folder's every file is data
                digest = input_digest(target, model=key[1], skip=("README.md",) if key[1] else ())
                if cache is None:
                    out[name] = digest
                    continue
                cache[key] = digest
            out[name] = cache[key]
        else:
            out[name] = {"paths": [str(item)], "files": {"name": str(item)}}
    return out


@dataclass(frozen=True)
class Fingerprint:
    """What an output was (or will be) made from: ``stage``, ``settings``, ``inputs`` (content digests) and
    ``upstream`` (name -> digest of the fingerprint of an output this one reads)."""

    stage: str
    settings: Any = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    upstream: dict = field(default_factory=dict)

    @property
    def digest(self) -> str:
        blob = json.dumps(self.to_json(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return json.loads(json.dumps({"stage": self.stage, "settings": self.settings, "inputs": self.inputs,
                                      "upstream": self.upstream}, default=str))

    @classmethod
    def from_json(cls, data: Any) -> "Fingerprint | None":
        if not isinstance(data, dict) or not isinstance(data.get("stage"), str):
            return None
        return cls(data["stage"], data.get("settings", {}), data.get("inputs", {}) or {},
                   data.get("upstream", {}) or {})

    def differences(self, other: "Fingerprint") -> list[str]:
        """What differs from ``other`` (an earlier one), one phrase each; empty when the digests are equal."""
        if self.digest == other.digest:
            return []
        old, new = other.to_json(), self.to_json()
        diffs = [] if old["stage"] == new["stage"] else [f"stage: {old['stage']} -> {new['stage']}"]
        old_settings = old["settings"] if isinstance(old["settings"], dict) else {"settings": old["settings"]}
        new_settings = new["settings"] if isinstance(new["settings"], dict) else {"settings": new["settings"]}
        diffs += describe_changes(*_flat_pair(old_settings, new_settings), old["inputs"], new["inputs"])
        for name in dict.fromkeys([*old["upstream"], *new["upstream"]]):
            if old["upstream"].get(name) != new["upstream"].get(name):
                diffs.append(f"the {name} it is made from changed")
        return diffs or ["its record differs (written by another robustir version)"]


def _flat_pair(old: dict, new: dict, prefix: str = "") -> tuple[dict, dict]:
    """Both settings with the sections present on both sides flattened to ``a.b.c: value``, so a difference names
    its key path (``mining.num_negatives: 20 -> 30``); a section on one side only is shown whole."""
    flat_old: dict = {}
    flat_new: dict = {}
    for key in dict.fromkeys([*old, *new]):
        a, b = old.get(key, _MISSING), new.get(key, _MISSING)
        if isinstance(a, dict) and isinstance(b, dict) and a and b:
            sub_old, sub_new = _flat_pair(a, b, f"{prefix}{key}.")
            flat_old.update(sub_old)
            flat_new.update(sub_new)
            continue
        if a is not _MISSING:
            flat_old[f"{prefix}{key}"] = a
        if b is not _MISSING:
            flat_new[f"{prefix}{key}"] = b
    return flat_old, flat_new


_MISSING = object()


def fingerprint(stage: str, settings: Any, inputs: Mapping[str, Any] | None = None,
                upstream: Mapping[str, "Fingerprint | str | None"] | None = None, *,
                skip: tuple[str, ...] = (), cache: dict | None = None,
                digested: Mapping[str, Any] | None = None) -> Fingerprint:
    """The fingerprint of ``stage`` run with ``settings`` (a config: operational fields and ``skip`` left out; a
    mapping of several) on ``inputs`` (name -> path, digested by content; ``cache``: see :func:`digest_inputs`)
    after ``upstream`` outputs (name -> their fingerprint). ``digested``: inputs the caller digested already
    (name -> :func:`robustir.io.input_digest`), for a producer that reuses the digest (the training data's Arrow
    cache is keyed by it).

    This is the only fingerprint builder: every stage, the runner, the training and pre-training runs, the index
    and the noise bench's cells call it."""
    ups = {name: (value.digest if isinstance(value, Fingerprint) else str(value))
           for name, value in (upstream or {}).items() if value is not None}
    made = {**digest_inputs(inputs or {}, cache), **dict(digested or {})}
    return Fingerprint(stage, settings_of(settings, skip=skip), json.loads(json.dumps(made, default=str)), ups)
