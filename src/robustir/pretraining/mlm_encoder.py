"""Helpers shared by the pre-training models (RetroMAE, GUR): an encoder-only masked LM and its folder.

* :func:`load_masked_lm` loads any BERT-family checkpoint as ``AutoModelForMaskedLM``. A checkpoint
  without MLM head weights (e.g. sentence-transformers' all-MiniLM-L6-v2, saved as ``BertModel``) gets a
  freshly initialised head whose decoder is tied to the word embeddings; transformers prints a load
  report listing the head weights as MISSING (and the unused pooler as UNEXPECTED) - that is expected.
* :func:`mlm_head` returns the module mapping hidden states to vocabulary logits.
* :func:`masked_lm_loss` applies that head only at labelled positions (cheaper than full logits).
* :meth:`MaskedLMPretrainModel.save_encoder` writes the masked LM + tokenizer through the one model-folder
  writer, :meth:`robustir.models.encoder.Encoder.save` (a folder ``AutoModel``, ``SentenceTransformer`` and
  robustir all load).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from robustir.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["MaskedLMPretrainModel", "load_masked_lm", "load_tokenizer", "masked_lm_loss", "mlm_head"]

POOLING_MODES = ("cls", "mean")


def load_masked_lm(name_or_path: str | Path, **kwargs: Any) -> nn.Module:
    """``AutoModelForMaskedLM.from_pretrained`` plus a check that the MLM head is usable and tied."""
    from transformers import AutoModelForMaskedLM

    from ..models.encoder import cannot_load, model_load_errors

    try:
        model, info = AutoModelForMaskedLM.from_pretrained(str(name_or_path), output_loading_info=True, **kwargs)
    except model_load_errors() as exc:
        raise cannot_load(name_or_path, exc) from None
    head = mlm_head(model)  # fail early on an architecture we cannot drive
    head_prefix = next(name for name, module in model.named_children() if module is head)
    missing_head = sorted(k for k in info.get("missing_keys", ()) if k.startswith(head_prefix + "."))
    if missing_head:
        # e.g. sentence-transformers checkpoints: expected, and why transformers prints a load report.
        logger.warning(
            "%s has no MLM head weights (%d missing, e.g. %s): using a newly initialised head tied to the "
            "word embeddings. Fine for pre-training from an embedding model.",
            name_or_path, len(missing_head), missing_head[0],
        )
    if getattr(model.config, "tie_word_embeddings", True):
        # A newly created head must share the input embedding matrix, as in BERT pre-training.
        model.tie_weights()
    return model


def load_tokenizer(name_or_path: str | Path) -> Any | None:
    """The folder's tokenizer, or ``None`` when it has none (the caller may pass one to ``save_pretrained``)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(name_or_path))
    except (OSError, ValueError):
        return None


def mlm_head(model: nn.Module) -> nn.Module:
    """The hidden-state -> vocabulary-logits head of a masked LM (BERT ``cls``, RoBERTa ``lm_head``)."""
    for name in ("cls", "lm_head"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ConfigError(
        f"{type(model).__name__} has no 'cls' or 'lm_head' MLM head; robustir's pre-training models "
        "support encoder-only BERT-family checkpoints (BERT, RoBERTa, MiniLM, ...)."
    )


def masked_lm_loss(head: nn.Module, hidden: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy of ``head(hidden)`` at positions with ``labels != -100``: their mean, or with
    ``reduction="sum"`` their sum (GUR hands the sum and the count to the batch engine, which divides once
    per step so that chunked and plain steps agree).

    With no labelled position the loss is an exact 0 that still belongs to the graph, so a batch of very
    short texts cannot produce NaN.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    selected = labels != -100
    if not bool(selected.any()):
        return hidden.sum() * 0.0
    logits = head(hidden[selected])
    return F.cross_entropy(logits.float(), labels[selected], reduction=reduction)


class MaskedLMPretrainModel(nn.Module):
    """What RetroMAE and GUR share: a masked-LM ``encoder`` (its MLM head reused as ``head``), the pooling that
    reads the sentence vector off it, and the tokenizer written next to the saved encoder."""

    def __init__(self, encoder: nn.Module, *, pooling: str, tokenizer: Any | None) -> None:
        super().__init__()
        if pooling not in POOLING_MODES:
            raise ConfigError(f"pooling must be one of {POOLING_MODES}, got {pooling!r}")
        self.encoder = encoder
        mlm_head(encoder)  # fail early on an unsupported architecture
        self.pooling = pooling
        self.tokenizer = tokenizer

    @property
    def backbone(self) -> nn.Module:
        """The Hugging Face model being trained (here the masked LM; T5 GUR: the seq2seq model)."""
        return self.encoder

    @property
    def head(self) -> nn.Module:
        """The encoder's MLM head (a property, not a second registration, so state_dict has no duplicates)."""
        return mlm_head(self.encoder)

    def save_encoder(self, out: str | Path, *, tokenizer: Any | None = None, max_seq_length: int | None = None,
                     encoder_config: Any | None = None, model_card: str | None = None) -> Path:
        """Write the encoder (with its MLM head weights, which ``AutoModel`` and sentence-transformers ignore)
        as a model folder, once, through :meth:`~robustir.models.encoder.Encoder.save`.

        ``encoder_config`` (an :class:`~robustir.models.encoder.EncoderConfig`) sets pooling, normalisation,
        lengths and prompts; without it: this model's pooling, no normalisation, and ``max_seq_length`` (default:
        the tokenizer's limit capped by the position embeddings) for both lengths.
        """
        from ..models.encoder import Encoder, EncoderConfig

        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        if tokenizer is None:
            raise ConfigError("saving the encoder needs a tokenizer: pass tokenizer=...")
        if encoder_config is None:
            if max_seq_length is None:
                limit = getattr(tokenizer, "model_max_length", None)
                positions = int(getattr(self.encoder.config, "max_position_embeddings", 512))
                max_seq_length = min(int(limit), positions) if limit and limit < 10**6 else positions
            encoder_config = EncoderConfig(pooling=self.pooling, normalize=False, query_max_length=int(max_seq_length),
                                           passage_max_length=int(max_seq_length))
        return Encoder(self.encoder, tokenizer, encoder_config).save(out, model_card=model_card)


def pool(hidden: Tensor, attention_mask: Tensor, mode: str) -> Tensor:
    """Sentence vector from token states: the first ([CLS]) token, or the mask-weighted mean."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "mean":
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    raise ConfigError(f"pooling must be one of {POOLING_MODES}, got {mode!r}")
