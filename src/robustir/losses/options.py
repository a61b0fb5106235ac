"""The options of each loss as a typed section (pydantic v2), checked when a config loads.

``loss: peg`` with ``loss_options: {beta: 0.2}`` is validated as :class:`PEGOptions` through one discriminated
union (:data:`LossOptions`, discriminator ``loss``): an unknown key fails with its path and the closest valid
name (``train.loss_options.bta: unknown option (did you mean 'beta'?)``), a value of the wrong type or out of
range with the field's own rule -- before any data is read or model loaded.

These models are the one declaration of each option (its default, type and range): a loss class is built from its
model (``PEGLoss(PEGOptions(beta=0.2))``, or ``PEGLoss(beta=0.2)`` / ``get_loss("peg", beta=0.2)``, whose keywords
go through :func:`loss_options`), and keeps only the rules that tie two options together.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from ..errors import ConfigError

__all__ = ["CCROptions", "InfoNCEOptions", "LossOptions", "PEGOptions", "check_loss_options", "loss_options"]


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InfoNCEOptions(_Options):
    loss: Literal["infonce"] = "infonce"
    temperature: float = Field(0.05, gt=0, allow_inf_nan=False, description="softmax temperature tau")
    in_batch_negatives: bool = True
    symmetric: bool = False
    similarity: Literal["cosine", "dot"] = "cosine"
    denominator: Literal["standard", "gte"] = Field(
        "standard", description="standard: the query against passages; gte: GTE's improved contrastive loss, the "
                                "positive also against query-query, passage-query and passage-passage pairs")
    false_negative_margin: float | None = Field(
        None, ge=0, allow_inf_nan=False,
        description="drop any negative scored above the positive + this margin (Qwen3-Embedding: 0.1); null: off")


class PEGOptions(_Options):
    loss: Literal["peg"] = "peg"
    temperature: float = Field(0.05, gt=0, allow_inf_nan=False)
    alpha: float = Field(0.5, ge=0, le=1, description="momentum of the running mean t")
    beta: float = Field(0.1, ge=0, allow_inf_nan=False, description="weight of a_n, the hard-negative term")
    detach_negative_scale: bool = True
    in_batch_negatives: bool = True


class CCROptions(_Options):
    loss: Literal["ccr"] = "ccr"
    temperature: float = Field(0.05, gt=0, allow_inf_nan=False)
    beta: float = Field(0.02, ge=0, allow_inf_nan=False, description="confidence-regulariser weight")
    variant: Literal["paper", "authors_code"] = "paper"
    in_batch_negatives: bool | None = None


LossOptions = Annotated[Union[InfoNCEOptions, PEGOptions, CCROptions], Field(discriminator="loss")]
_ADAPTER: TypeAdapter = TypeAdapter(LossOptions)
_MODELS = {"infonce": InfoNCEOptions, "peg": PEGOptions, "ccr": CCROptions}


def check_loss_options(loss: str, options: Any, where: str = "loss_options") -> dict:
    """Validate ``options`` (a mapping) for ``loss``; returns them as given (a plain dict), or raises
    :class:`ConfigError` naming the key path, what is wrong and the valid keys."""
    if not isinstance(options, dict):
        raise ConfigError(f"{where}: expected a mapping of the {loss} loss's options, e.g. {{temperature: 0.02}}, "
                          f"got {options!r}")
    if "loss" in options:
        raise ConfigError(f"{where}.loss: the loss is chosen by the 'loss' field beside loss_options; remove it here")
    try:
        _ADAPTER.validate_python({**options, "loss": loss})
    except ValidationError as exc:
        model = _MODELS.get(loss)
        valid = [name for name in model.model_fields if name != "loss"] if model else []
        problems = []
        for error in exc.errors():
            key = ".".join(str(part) for part in error["loc"][1:])  # [0] is the union member's tag
            if error["type"] == "extra_forbidden":
                close = difflib.get_close_matches(key, valid, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(f"{where}.{key}: unknown option of the {loss} loss{hint}; valid: {', '.join(valid)}")
            else:
                value = options.get(key, error.get("input"))
                problems.append(f"{where}.{key} = {value!r}: {error['msg'].lower()}")
        raise ConfigError("; ".join(problems)) from None
    return dict(options)


def loss_options(loss: str, options: Any = None, keywords: dict | None = None) -> Any:
    """The options model of ``loss``: ``options`` itself (an instance of that model), or one made from ``keywords``
    (checked by :func:`check_loss_options`: a :class:`ConfigError` naming the key); not both."""
    model = _MODELS[loss]
    if options is not None:
        if keywords:
            raise ConfigError(f"{loss}: give the options as {model.__name__} or as keywords, not both")
        if not isinstance(options, model):
            raise ConfigError(f"{loss}: options must be {model.__name__}, got {type(options).__name__}")
        return options
    return model(**check_loss_options(loss, dict(keywords or {}), loss))
