"""GUR: joint span-masked language modelling and in-pair contrastive learning (docs/methods.md#gur-joint-pre-training).

Xue et al., "Generate to Understand for Representation" (shared/papers/gur-generate-to-understand.txt).
The authors train a T5 encoder-decoder; here the recipe is adapted to an encoder-only BERT masked LM:

* every sentence of a mined pair (a, b) is span-masked (:class:`~robustir.data.masking.SpanMasker`) and
  the masked tokens are predicted by the MLM head (the T5 span-infilling objective's BERT analogue);
* the *same* forward over the masked sentences gives sentence vectors (the authors also pool the
  corrupted input, §3.4), and a symmetric InfoNCE over the pairs pulls a_k towards b_k;
* loss = mlm_weight * MLM + alpha * CL, alpha = 1 (paper and code).

Paper vs code (§3.5), and what the defaults pick: pooling "cls" (paper; code uses the last EOS, which a
BERT input does not have); similarity "cosine" (paper; ``similarity="dot"`` reproduces the code's raw dot
product); temperature 0.1 (both); mask ratio 15 % (paper; ``SpanMasker(mask_ratio_range=(0.10, 0.29))``
reproduces the code).

Pipeline: ``GURCollator(pairs) -> batch``; ``GURModel(**batch) -> {"loss", ...}``. Batch rows are
interleaved ``[a1, b1, a2, b2, ...]`` (as the authors' data loader does), so rows 2k and 2k+1 are a pair.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from robustir.data.masking import SpanMasker, maskable_positions, replace_masked_tokens
from robustir.errors import ConfigError
from robustir.models.mlm_encoder import (
    MaskedLMPretrainModel,
    load_masked_lm,
    load_tokenizer,
    masked_lm_loss,
    pool,
)

__all__ = ["GURCollator", "GURModel", "ProjectionHead", "symmetric_info_nce"]

PROJECTION_HEAD_FORMAT = "robustir.gur.projection_head"
SIMILARITIES = ("cosine", "dot")
_WEIGHTS_NAME = "model.safetensors"
_CONFIG_NAME = "config.json"


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

    @staticmethod
    def _pair(example: Any) -> tuple[str, str]:
        if isinstance(example, Mapping):
            return str(example["a"]), str(example["b"])
        if isinstance(example, (tuple, list)) and len(example) == 2:
            return str(example[0]), str(example[1])
        raise ValueError(f"GUR examples are (a, b) pairs or {{'a': ..., 'b': ...}}, got {type(example).__name__}")

    def __call__(self, examples: Sequence[Any]) -> dict[str, Tensor]:
        texts = [text for ex in examples for text in self._pair(ex)]  # interleaved a1, b1, a2, b2, ...
        encoded = self.tokenizer(texts, truncation=True, max_length=self.max_length, add_special_tokens=True)
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


def symmetric_info_nce(
    a: Tensor, b: Tensor, *, temperature: float = 0.1, similarity: str = "cosine"
) -> tuple[Tensor, Tensor]:
    """GUR's contrastive loss (paper eq. 2; code ``compute_clip_loss``; docs/methods.md#gur-joint-pre-training).

    ``logits = sim(a, b) / temperature`` over the (B, B) in-batch matrix, positives on the diagonal;
    loss = (CE(logits, arange) + CE(logits.T, arange)) / 2. Returns ``(loss, accuracy)``, accuracy being
    the fraction of both directions whose top-scoring column is the true partner.
    """
    if similarity not in SIMILARITIES:
        raise ConfigError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}")
    if similarity == "cosine":
        a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    logits = (a @ b.T).float() / temperature
    target = torch.arange(len(a), device=a.device)
    loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
    with torch.no_grad():
        accuracy = ((logits.argmax(1) == target).float().mean() + (logits.argmax(0) == target).float().mean()) / 2
    return loss, accuracy


class GURModel(MaskedLMPretrainModel):
    """BERT masked LM trained with span-MLM + in-pair contrastive loss; ``forward(**collator_batch)``.

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
        settings: dict[str, Any] = {}
        state = None
        if projection_head_path is not None:
            path = Path(projection_head_path)
            config_file = path / _CONFIG_NAME
            if not config_file.is_file():
                raise ConfigError(f"{path}: no {_CONFIG_NAME}; expected a folder written by GURModel.save_pretrained")
            saved = json.loads(config_file.read_text())
            if saved.get("format") != PROJECTION_HEAD_FORMAT:
                raise ConfigError(f"{config_file}: not a GUR projection head (format={saved.get('format')!r})")
            settings = {k: saved[k] for k in ("pooling", "projection", "projection_dim", "similarity",
                                             "temperature", "alpha", "mlm_weight")}
            if saved["projection"]:
                from safetensors.torch import load_file

                state = load_file(str(path / _WEIGHTS_NAME))
        settings.update(options)
        settings.setdefault("tokenizer", load_tokenizer(encoder_path))
        model = cls(encoder, **settings)
        if state is not None:
            if model.projection is None or model.projection_dim != settings.get("projection_dim"):
                raise ConfigError("the saved projection head does not match the requested projection settings")
            model.projection.load_state_dict(state)
        return model

    def encode(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """Sentence vectors (pooled, then projected when the model has a projection head)."""
        out = self.encoder.base_model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return self._vectors(out.last_hidden_state, attention_mask)

    def _vectors(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        vectors = pool(hidden, attention_mask, self.pooling)
        return self.projection(vectors) if self.projection is not None else vectors

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        labels: Tensor,
        token_type_ids: Tensor | None = None,
    ) -> dict[str, Tensor]:
        if input_ids.shape[0] % 2:
            raise ValueError("GUR batches hold pairs as interleaved rows [a1, b1, a2, b2, ...]; got an odd row count")
        out = self.encoder.base_model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        hidden = out.last_hidden_state
        mlm_loss = masked_lm_loss(self.head, hidden, labels)
        vectors = self._vectors(hidden, attention_mask)
        cl_loss, cl_accuracy = symmetric_info_nce(
            vectors[0::2], vectors[1::2], temperature=self.temperature, similarity=self.similarity
        )
        loss = self.mlm_weight * mlm_loss + self.alpha * cl_loss
        return {
            "loss": loss,
            "mlm_loss": mlm_loss.detach(),
            "cl_loss": cl_loss.detach(),
            "cl_accuracy": cl_accuracy,
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
        head_dir = root / "projection_head"
        head_dir.mkdir(parents=True, exist_ok=True)
        if self.projection is not None:
            from safetensors.torch import save_file

            state = {k: v.detach().contiguous().cpu() for k, v in self.projection.state_dict().items()}
            save_file(state, str(head_dir / _WEIGHTS_NAME))
        config = {
            "format": PROJECTION_HEAD_FORMAT,
            "format_version": 1,
            "hidden_size": int(self.encoder.config.hidden_size),
            "projection": self.projection is not None,
            "projection_dim": self.projection_dim,
            "pooling": self.pooling,
            "similarity": self.similarity,
            "temperature": self.temperature,
            "alpha": self.alpha,
            "mlm_weight": self.mlm_weight,
        }
        (head_dir / _CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        return root
