"""The optional extras the suite can use, and the one way a test skips when one is missing (issue 56).

A test or module that needs an extra -- ``robustir[scale]`` (ray, pylance, lance-ray, boto3, moto), ``robustir[langchain]``,
``robustir[llamaindex]`` -- asks for *every* module it imports, here, so that a machine with only part of an extra
(moto and boto3 without pylance, as many AWS users' machines have) skips with the reason instead of failing:

    require("boto3", "moto.server", extra="dev")              # at module level: the whole module skips
    @needs("lance", extra="scale")                             # one test skips

A module counts as present only if it imports (a broken install skips too, with its error in the reason). Where a
test reaches an extra only through a helper, the helper calls :func:`require` itself.
"""

from __future__ import annotations

import importlib
import sys
from functools import cache

import pytest

#: which extra installs which importable module (``pip install 'robustir[<extra>]'``); "dev" is the test extra
EXTRAS: dict[str, tuple[str, ...]] = {
    "scale": ("ray", "ray.data", "lance", "lance_ray", "boto3"),
    "langchain": ("langchain_core",),
    "llamaindex": ("llama_index.core",),
    "dev": ("langchain_openai", "llama_index.embeddings.openai", "moto.server"),
}


@cache
def _import_error(module: str) -> str | None:
    """None when ``module`` imports, else why not (one line)."""
    try:
        importlib.import_module(module)
    except ImportError as error:  # not installed, or installed without something it needs
        return f"{module}: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    return None


def missing(*modules: str) -> list[str]:
    """The modules of ``modules`` that do not import, each with its error."""
    return [why for why in map(_import_error, modules) if why is not None]


def _reason(extra: str, problems: list[str]) -> str:
    return f"needs robustir[{extra}] (pip install 'robustir[{extra}]'): " + "; ".join(problems)


def require(*modules: str, extra: str) -> None:
    """Skip the calling module (at import) or test (inside it) unless every one of ``modules`` imports."""
    problems = missing(*modules)
    if problems:
        caller = sys._getframe(1).f_globals.get("__name__", "")  # the report names the skipping file, not this one
        pytest.skip(f"{caller}: " + _reason(extra, problems), allow_module_level=True)


def needs(*modules: str, extra: str) -> pytest.MarkDecorator:
    """A ``skipif`` mark for one test: skipped, with the reason, unless every one of ``modules`` imports."""
    problems = missing(*modules)
    return pytest.mark.skipif(bool(problems), reason=_reason(extra, problems) if problems else "")
