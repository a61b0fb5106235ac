"""The container recipe (Dockerfile, .dockerignore): read, not built (no Docker here), for what makes it run
``robustir serve`` from a mounted index folder -- the base image's Python, torch's CPU build at the constraints' pin,
the entrypoint parsed by the real command line, the port, no hub download at run time, and a build context that
holds what the COPY lines need."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of the Dockerfile, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for line in (ROOT / "Dockerfile").read_text(encoding="utf-8").splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            lines.append(current)
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def one(name: str) -> str:
    found = [args for instruction, args in instructions() if instruction == name]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def env() -> dict[str, str]:
    values = {}
    for instruction, args in instructions():
        if instruction == "ENV":
            values.update(item.split("=", 1) for item in shlex.split(args))
    return values


def test_the_base_image_runs_a_python_robustir_supports():
    image = one("FROM")
    match = re.fullmatch(r"python:(3\.\d+)-slim(-\w+)?", image)
    assert match, image
    project = (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # (tomllib is 3.11+; robustir runs on 3.10)
    least = re.search(r'^requires-python = ">=(3\.\d+)"$', project, re.M).group(1)
    assert tuple(map(int, match.group(1).split("."))) >= tuple(map(int, least.split(".")))
    assert re.search(r'^robustir = "robustir\.cli\.main:main"$', project, re.M)  # the entrypoint's command


def test_torch_is_the_cpu_build_at_the_constraints_pin_before_robustir():
    runs = [args for instruction, args in instructions() if instruction == "RUN"]
    torch = next(i for i, run in enumerate(runs) if re.search(r"pip install .* torch\b", run))
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs[torch] and "-c constraints.txt" in runs[torch]
    pin = re.search(r"^torch==\S+", (ROOT / "constraints.txt").read_text(encoding="utf-8"), re.M)
    assert pin, "constraints.txt pins torch"
    project = next(i for i, run in enumerate(runs) if re.search(r"pip install -c constraints.txt \.", run))
    assert torch < project  # robustir's own requirements then keep the CPU torch
    assert "torch.version.cuda" in runs[project]  # the build fails if a CUDA torch got in


def test_nothing_is_downloaded_from_the_hub_at_run_time():
    values = env()
    assert values["HF_HUB_OFFLINE"] == "1" and values["TRANSFORMERS_OFFLINE"] == "1"


def test_the_entrypoint_is_robustir_serve_on_the_exposed_default_port():
    from robustir.cli.common import stage_config
    from robustir.cli.main import parse
    from robustir.serving.config import DEFAULT_PORT, ServeConfig

    entrypoint, command = json.loads(one("ENTRYPOINT")), json.loads(one("CMD"))
    assert entrypoint[:2] == ["robustir", "serve"]
    _, bound = parse(entrypoint[1:] + command)  # the real command line reads it: flags exist, values parse
    assert bound.kwargs["index"] == "/index" and bound.kwargs["model"] == "/model"
    config = stage_config(ServeConfig)
    assert config.host == "0.0.0.0" and config.port == DEFAULT_PORT
    assert one("EXPOSE").split() == [str(DEFAULT_PORT)]
    check = json.loads(re.sub(r"^(--\S+\s+)*CMD\s+", "", one("HEALTHCHECK")))
    assert f"http://127.0.0.1:{DEFAULT_PORT}/health" in " ".join(check)


def _ignored(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, pattern.lstrip("/")) for pattern in patterns)


def test_the_build_context_holds_what_the_copy_lines_need():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.startswith("#")]
    copied = [source for instruction, args in instructions() if instruction == "COPY" for source in args.split()[:-1]]
    assert set(copied) >= {"constraints.txt", "pyproject.toml", "README.md", "src"}
    for source in copied:
        assert (ROOT / source).exists() and not _ignored(source, patterns), source
    for heavy in (".git", "runs", "tests"):
        assert _ignored(heavy, patterns), heavy


def test_it_does_not_run_as_root():
    assert one("USER") not in ("root", "0")
