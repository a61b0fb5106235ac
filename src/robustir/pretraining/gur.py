"""GUR: joint span-masked language modelling and in-pair contrastive learning (docs/methods.md#gur-joint-pre-training).

Xue et al., "Generate to Understand for Representation" (the paper and the authors' code: docs/methods.md#gur).
The authors train a T5 encoder-decoder (that form: :mod:`robustir.pretraining.t5_gur`, chosen by pre-training for a
T5-family model); here the recipe is adapted to an encoder-only BERT masked LM:

* every sentence of a mined pair (a, b) is span-masked (:class:`~robustir.pretraining.masking.SpanMasker`) and
  the masked tokens are predicted by the MLM head (the T5 span-infilling objective's BERT analogue);
* the *same* forward over the masked sentences gives sentence vectors (the authors also pool the
  corrupted input, §3.4), and a symmetric InfoNCE over the pairs pulls a_k towards b_k: the contrastive
  term is :class:`robustir.losses.infonce.InfoNCELoss` (``symmetric=True``, this model's ``similarity`` and
  ``temperature``; :meth:`GURModel.contrastive_loss`), a pure function of the vectors like every loss;
* loss = mlm_weight * MLM + alpha * CL, alpha = 1 (paper and code).

Paper vs code (§3.5), and what the defaults pick: pooling "cls" (paper; code uses the last EOS, which a
BERT input does not have); similarity "cosine" (paper; ``similarity="dot"`` reproduces the code's raw dot
product); temperature 0.1 (both); mask ratio 15 % (paper; ``SpanMasker(mask_ratio_range=(0.10, 0.29))``
reproduces the code).

Pipeline: ``GURCollator(pairs) -> batch``, rows interleaved ``[a1, b1, a2, b2, ...]`` (as the authors'
data loader does), so rows 2k and 2k+1 are a pair. Pre-training (:mod:`robustir.pretraining.pretrain`) hands
the a-rows as queries and the b-rows as passages to :meth:`robustir.training.batch_engine.BatchEngine.step`
(no hard negatives) with the model in its engine form ``GURModel(features) -> (vectors, AuxLoss)``: the MLM
loss is an auxiliary loss (sum of the masked tokens' cross-entropies and their count), the contrastive loss
is the engine's, so GUR gets GradCache (``chunk_size``) and, under ``torchrun``, the vectors of every
process as in-batch negatives. ``GURModel(**batch) -> {"loss", ...}`` computes the same objective on one
process's interleaved batch in one call (tests, quick experiments).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from robustir.pretraining.masking import SpanMasker, maskable_positions, replace_masked_tokens
from robustir.errors import ConfigError
from robustir.models.tokens import head_texts
from robustir.losses.base import SIMILARITIES, AuxLoss, ContrastiveBatch
from robustir.losses.infonce import InfoNCELoss
from robustir.pretraining.mlm_encoder import (
    MaskedLMPretrainModel,
    load_masked_lm,
    load_tokenizer,
    masked_lm_loss,
    pool,
)

__all__ = ["GURCollator", "GURModel", "ProjectionHead", "interleaved_texts", "pair_texts",
           "read_projection_head", "write_projection_head"]

PROJECTION_HEAD_FORMAT = "robustir.gur.projection_head"
#: name of the MLM loss among the batch engine's components (and in the pre-training log)
MLM_LOSS_NAME = "mlm_loss"
_WEIGHTS_NAME = "model.safetensors"
_CONFIG_NAME = "config.json"


def pair_texts(example: Any) -> tuple[str, str]:
    """The two sentences of one GUR example: ``(a, b)`` / ``[a, b]`` or ``{"a": ..., "b": ...}``."""
    if isinstance(example, Mapping):
        return str(example["a"]), str(example["b"])
    if isinstance(example, (tuple, list)) and len(example) == 2:
        return str(example[0]), str(example[1])
    raise ValueError(f"GUR examples are (a, b) pairs or {{'a': ..., 'b': ...}}, got {type(example).__name__}")


def interleaved_texts(examples: Sequence[Any]) -> list[str]:
    """The rows of a GUR batch, interleaved ``[a1, b1, a2, b2, ...]`` as the authors' loader flattens them."""
    return [text for example in examples for text in pair_texts(example)]


class GURCollator:
    """Span-mask sentence pairs for GUR.

    Examples: ``(a, b)`` / ``[a, b]`` or ``{"a": ..., "b": ...}``. Each sentence is tokenised with
    [CLS]/[SEP], truncated to ``max_length`` (the authors truncate too), span-masked independently.
    Selected positions become [MASK] by default (``mask_replace_prob=1.0``): the T5 original replaces a
    whole span with a sentinel, so the model never sees the hidden tokens; pass 0.8 / 0.1 for BERT's
    80/10/10 corruption.

    Returns (2B rows, interleaved ``[a1, b1, a2, b2, ...]``, padded to the longest row):
    ``input_ids`` (2B, L), ``attention_mask`` (2B, L), ``labels`` (2B, L; original id at masked
    positions, -100 elsewhere).
    """

    def __init__(
        self,
        tokenizer: Any,
        max_length: int = 128,
        masker: SpanMasker | None = None,
        *,
        mask_replace_prob: float = 1.0,
        random_replace_prob: float = 0.0,
        seed: int | None = None,
    ) -> None:
        if tokenizer.mask_token_id is None or tokenizer.pad_token_id is None:
            raise ConfigError("GUR needs a tokenizer with a [MASK] and a [PAD] token")
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.masker = masker if masker is not None else SpanMasker()
        self.mask_replace_prob = float(mask_replace_prob)
        self.random_replace_prob = float(random_replace_prob)
        self.rng = np.random.default_rng(seed)

    def reseed(self, seed: int) -> None:
        """Restart the mask generator (e.g. per data-loader worker or when resuming)."""
        self.rng = np.random.default_rng(seed)

    def __call__(self, examples: Sequence[Any]) -> dict[str, Tensor]:
        texts = interleaved_texts(examples)
        encoded = self.tokenizer(head_texts(self.tokenizer, texts, self.max_length), truncation=True,
                                 max_length=self.max_length, add_special_tokens=True)
        rows = [np.asarray(ids, dtype=np.int64) for ids in encoded["input_ids"]]
        width = max(len(r) for r in rows)
        input_ids = np.full((len(rows), width), int(self.tokenizer.pad_token_id), dtype=np.int64)
        labels = np.full((len(rows), width), -100, dtype=np.int64)
        attention = np.zeros((len(rows), width), dtype=np.int64)
        for i, ids in enumerate(rows):
            selected = self.masker(maskable_positions(ids, self.tokenizer), self.rng)
            masked, row_labels = replace_masked_tokens(
                ids,
                selected,
                self.tokenizer,
                self.rng,
                mask_replace_prob=self.mask_replace_prob,
                random_replace_prob=self.random_replace_prob,
            )
            input_ids[i, : len(ids)] = masked
            labels[i, : len(ids)] = row_labels
            attention[i, : len(ids)] = 1
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention),
            "labels": torch.from_numpy(labels),
        }


class ProjectionHead(nn.Module):
    """Linear -> GELU -> Linear -> LayerNorm (the authors' head is a T5 FFN + RMSNorm, §3.4)."""

    def __init__(self, hidden_size: int, projection_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(hidden_size, hidden_size),
            nn.GELU(),
            nn.Linear(hidden_size, projection_dim),
            nn.LayerNorm(projection_dim),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class GURModel(MaskedLMPretrainModel):
    """BERT masked LM trained with span-MLM + in-pair contrastive loss.

    Two call forms: ``model(features)`` (a feature dict of any rows, e.g. a batch engine chunk) returns
    ``(vectors, AuxLoss)`` for :class:`~robustir.training.batch_engine.BatchEngine`;
    ``model(**collator_batch)`` (interleaved pairs) returns ``{"loss", "mlm_loss", "cl_loss", "cl_accuracy"}``.

    Args:
        encoder: a BERT-family ``AutoModelForMaskedLM``.
        pooling: "cls" (paper, default) or "mean" over the masked input's last hidden states.
        projection: add a :class:`ProjectionHead` (``projection_dim`` defaults to the hidden size).
        similarity: "cosine" (paper) or "dot" (authors' code).
        temperature: 0.1. alpha: CL weight (1.0). mlm_weight: MLM weight (1.0).
        tokenizer: kept only so that :meth:`save_pretrained` can write it next to the encoder.
    """

    def __init__(
        self,
        encoder: nn.Module,
        *,
        pooling: str = "cls",
        projection: bool = False,
        projection_dim: int | None = None,
        similarity: str = "cosine",
        temperature: float = 0.1,
        alpha: float = 1.0,
        mlm_weight: float = 1.0,
        tokenizer: Any | None = None,
    ) -> None:
        super().__init__(encoder, pooling=pooling, tokenizer=tokenizer)
        if similarity not in SIMILARITIES:
            raise ConfigError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}")
        if temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {temperature}")
        hidden_size = int(encoder.config.hidden_size)
        self.projection_dim = int(projection_dim) if projection_dim is not None else hidden_size
        self.projection: ProjectionHead | None = (
            ProjectionHead(hidden_size, self.projection_dim) if projection else None
        )
        self.similarity = similarity
        self.temperature = float(temperature)
        self.alpha = float(alpha)
        self.mlm_weight = float(mlm_weight)

    @classmethod
    def from_pretrained(
        cls,
        encoder_path: str | Path,
        projection_head_path: str | Path | None = None,
        *,
        model_kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> GURModel:
        """Load the encoder and, optionally, a saved projection head (whose config supplies defaults).

        ``options`` are the constructor's keyword arguments; given ones override the saved config.
        ``model_kwargs`` go to ``AutoModelForMaskedLM.from_pretrained``.
        """
        encoder = load_masked_lm(encoder_path, **(model_kwargs or {}))
        settings, state = ({}, None) if projection_head_path is None else read_projection_head(
            projection_head_path, int(encoder.config.hidden_size), encoder_decoder=False)
        settings.update(options)
        settings.setdefault("tokenizer", load_tokenizer(encoder_path))
        model = cls(encoder, **settings)
        load_projection_state(model, settings, state)
        return model

    def encode(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """Sentence vectors (pooled, then projected when the model has a projection head)."""
        out = self.encoder.base_model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return self._vectors(out.last_hidden_state, attention_mask)

    def _vectors(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        vectors = pool(hidden, attention_mask, self.pooling)
        return self.projection(vectors) if self.projection is not None else vectors

    def encode_with_mlm(
        self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor, int]:
        """One encoder forward over span-masked sentences: ``(vectors, mlm_total, mlm_count)``.

        ``mlm_total`` is the **sum** of the cross-entropies at the masked positions (``labels != -100``) and
        ``mlm_count`` their number, so that the MLM loss of several forwards (chunks, a- and b-rows) is
        ``sum(totals) / sum(counts)``, the mean over every masked token of the batch.
        """
        out = self.encoder.base_model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        hidden = out.last_hidden_state
        mlm_total = masked_lm_loss(self.head, hidden, labels, reduction="sum")
        return self._vectors(hidden, attention_mask), mlm_total, int((labels != -100).sum())

    def contrastive_loss(self) -> InfoNCELoss:
        """GUR's contrastive term as a loss of :mod:`robustir.losses`: symmetric InfoNCE, a_k vs b_k."""
        return InfoNCELoss(temperature=self.temperature, symmetric=True, similarity=self.similarity)

    def forward(
        self,
        features: Mapping[str, Tensor] | None = None,
        *,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> tuple[Tensor, AuxLoss] | dict[str, Tensor]:
        """``model(features)``: the batch engine's model form; ``model(**collator_batch)``: the whole loss.

        * ``features`` (``input_ids``, ``attention_mask``, ``labels``, optional ``token_type_ids``; any rows):
          ``(vectors, AuxLoss(mlm_total, mlm_count, name="mlm_loss", weight=mlm_weight))``. The engine adds
          ``alpha`` (its ``loss_weight``) times :meth:`contrastive_loss` of the vectors.
        * keyword tensors of one interleaved pair batch ``[a1, b1, a2, b2, ...]``:
          ``{"loss": mlm_weight * MLM + alpha * CL, "mlm_loss", "cl_loss", "cl_accuracy"}`` (``cl_accuracy``:
          the fraction of a-rows whose partner scores highest, ties counted as correct), the same objective
          as a single-process plain engine step on that batch.
        """
        if features is not None:
            if not isinstance(features, Mapping):
                raise TypeError("GURModel(features) takes a feature dict; pass the collator's batch as "
                                "GURModel(**batch)")
            vectors, mlm_total, mlm_count = self.encode_with_mlm(**features)
            return vectors, AuxLoss(mlm_total, mlm_count, name=MLM_LOSS_NAME, weight=self.mlm_weight)
        if input_ids is None or attention_mask is None or labels is None:
            raise TypeError("GURModel(**batch) needs input_ids, attention_mask and labels")
        if input_ids.shape[0] % 2:
            raise ValueError("GUR batches hold pairs as interleaved rows [a1, b1, a2, b2, ...]; got an odd row count")
        vectors, mlm_total, mlm_count = self.encode_with_mlm(input_ids, attention_mask, labels, token_type_ids)
        mlm_loss = mlm_total / max(mlm_count, 1)
        cl = self.contrastive_loss()(ContrastiveBatch.from_groups(vectors[0::2], vectors[1::2]))
        loss = self.mlm_weight * mlm_loss + self.alpha * cl.loss
        return {
            "loss": loss,
            "mlm_loss": mlm_loss.detach(),
            "cl_loss": cl.loss.detach(),
            "cl_accuracy": torch.tensor(cl.components["accuracy"]),
        }

    def save_pretrained(
        self, save_dir: str | Path, *, tokenizer: Any | None = None, max_seq_length: int | None = None,
        encoder_config: Any | None = None, model_card: str | None = None,
    ) -> Path:
        """Write ``save_dir/encoder`` (HF + sentence-transformers folder using this model's pooling; the
        projection head is not part of it) and ``save_dir/projection_head`` (config, weights if any)."""
        root = Path(save_dir)
        self.save_encoder(root / "encoder", tokenizer=tokenizer, max_seq_length=max_seq_length,
                          encoder_config=encoder_config, model_card=model_card)
        write_projection_head(root / "projection_head", self, int(self.encoder.config.hidden_size),
                              encoder_decoder=False)
        return root


# ---------------------------------------------------------------------------- the projection head folder
# (shared by GURModel and robustir.pretraining.t5_gur.T5GURModel)

_HEAD_SETTINGS = ("pooling", "projection", "projection_dim", "similarity", "temperature", "alpha", "mlm_weight")


def write_projection_head(folder: str | Path, model: Any, hidden_size: int, *, encoder_decoder: bool) -> Path:
    """``folder/config.json`` (the GUR settings of ``model``) and, with a head, ``folder/model.safetensors``."""
    head_dir = Path(folder)
    head_dir.mkdir(parents=True, exist_ok=True)
    if model.projection is not None:
        from safetensors.torch import save_file

        state = {k: v.detach().contiguous().cpu() for k, v in model.projection.state_dict().items()}
        save_file(state, str(head_dir / _WEIGHTS_NAME))
    config = {
        "format": PROJECTION_HEAD_FORMAT,
        "format_version": 1,
        "hidden_size": int(hidden_size),
        "encoder_decoder": bool(encoder_decoder),
        "projection": model.projection is not None,
        "projection_dim": model.projection_dim,
        "pooling": model.pooling,
        "similarity": model.similarity,
        "temperature": model.temperature,
        "alpha": model.alpha,
        "mlm_weight": model.mlm_weight,
    }
    (head_dir / _CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return head_dir


def read_projection_head(folder: str | Path, hidden_size: int, *, encoder_decoder: bool
                         ) -> tuple[dict[str, Any], dict[str, Tensor] | None]:
    """The saved settings and head weights (``None`` without a head) of a folder :func:`write_projection_head`
    wrote (or of the run folder that holds it as ``projection_head/``), checked against the model they are to
    continue: its hidden size and architecture."""
    path = Path(folder)
    if (path / "projection_head").is_dir():
        path = path / "projection_head"
    config_file = path / _CONFIG_NAME
    if not config_file.is_file():
        raise ConfigError(f"{path}: no {_CONFIG_NAME}; expected a projection_head folder written by a GUR "
                          "pre-training run")
    try:
        saved = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{config_file}: not valid JSON ({exc}); write the head folder again") from None
    if not isinstance(saved, dict) or saved.get("format") != PROJECTION_HEAD_FORMAT:
        raise ConfigError(f"{config_file}: not a GUR projection head (format="
                          f"{saved.get('format') if isinstance(saved, dict) else None!r})")
    missing = [k for k in _HEAD_SETTINGS if k not in saved]
    if missing:
        raise ConfigError(f"{config_file}: field(s) {missing} missing; write the head folder again")
    if int(saved.get("hidden_size", hidden_size)) != int(hidden_size):
        raise ConfigError(f"{config_file}: the head was trained on a model of hidden size {saved['hidden_size']}, "
                          f"this model has {hidden_size}: continue with the model the head was saved with")
    if bool(saved.get("encoder_decoder", False)) != bool(encoder_decoder):
        kinds = {True: "an encoder-decoder (T5)", False: "an encoder-only"}
        raise ConfigError(f"{config_file}: the head belongs to {kinds[bool(saved.get('encoder_decoder', False))]} "
                          f"GUR run, this model is {kinds[bool(encoder_decoder)]} one: continue with its own model")
    state = None
    if saved["projection"]:
        from safetensors.torch import load_file

        weights = path / _WEIGHTS_NAME
        if not weights.is_file():
            raise ConfigError(f"{path}: the config says the run had a projection head, but {_WEIGHTS_NAME} is "
                              "missing; copy the whole projection_head folder")
        state = load_file(str(weights))
    return {k: saved[k] for k in _HEAD_SETTINGS}, state


def load_projection_state(model: Any, settings: dict[str, Any], state: dict[str, Tensor] | None) -> None:
    """Put saved head weights into ``model.projection`` (refused when the requested head differs)."""
    if state is None:
        return
    if model.projection is None or model.projection_dim != settings.get("projection_dim"):
        raise ConfigError("the saved projection head does not match the requested projection settings "
                          f"(saved: projection_dim {settings.get('projection_dim')}; asked: projection "
                          f"{model.projection is not None}, projection_dim {model.projection_dim}); leave them unset "
                          "to continue with the saved head")
    model.projection.load_state_dict(state)
