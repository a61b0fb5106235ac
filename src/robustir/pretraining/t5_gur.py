"""GUR as the paper builds it: a T5 encoder-decoder (docs/methods.md#gur-on-t5-the-papers-architecture).

Xue et al., "Generate to Understand for Representation" (§III-A, §III-C, Fig. 3; the authors' ``GurT5ForPretraining``
in ``laohur/GUR``, compared with the paper in the table of docs/methods.md#gur-on-t5-the-papers-architecture):

* **language modelling through the decoder**, as T5 does: every sentence of a pair is span-corrupted
  (:func:`span_corrupt`): each masked span (hump-geometric lengths, :class:`~robustir.pretraining.masking.SpanMasker`,
  the masking GUR already uses) becomes one sentinel ``<extra_id_j>`` in the encoder input, and the decoder
  reconstructs ``<extra_id_0> span_0 <extra_id_1> span_1 ... </s>`` (teacher forcing, labels shifted right);
  the LM loss is the cross-entropy over those target tokens (padding excluded);
* **contrastive learning through the encoder**: the encoder's states over the same corrupted input, mean-pooled
  (T5 has no [CLS] token), then a non-linear projection head (128-d by default, as the paper's vector dim), give
  the sentence vectors; GUR's symmetric InfoNCE (τ = 0.1, cosine: :meth:`T5GURModel.contrastive_loss`, the
  :class:`~robustir.losses.infonce.InfoNCELoss` fine-tuning uses) pulls a_k towards b_k;
* loss = mlm_weight · LM + alpha · CL, both weights 1 (paper eq. 1).

Pre-training (:mod:`robustir.pretraining.pretrain`, ``robustir pretrain --mode gur`` with a T5-family model) runs
it through the one batch engine exactly as the encoder-only GUR (:class:`~robustir.pretraining.gur.GURModel`):
``T5GURModel(features) -> (vectors, AuxLoss)``, the LM loss as the engine's auxiliary loss (a sum over target
tokens and their count), so GradCache (``chunk_size``) and cross-process in-batch negatives (``torchrun``) apply.

At test time the encoder alone is used (paper §III-C): :meth:`T5GURModel.save_pretrained` writes it as a
sentence-transformers folder (T5 encoder + mean pooling + normalisation; ``SentenceTransformer(path)`` and
:class:`robustir.models.encoder.Encoder` load it), and next to it the whole ``T5ForConditionalGeneration`` and the
projection head, from which pre-training continues.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from robustir.errors import ConfigError
from robustir.models.tokens import head_texts
from robustir.losses.base import SIMILARITIES, AuxLoss, ContrastiveBatch
from robustir.losses.infonce import InfoNCELoss
from robustir.pretraining.gur import (
    MLM_LOSS_NAME,
    ProjectionHead,
    interleaved_texts,
    load_projection_state,
    read_projection_head,
    write_projection_head,
)
from robustir.pretraining.masking import SpanMasker, maskable_positions
from robustir.pretraining.mlm_encoder import load_tokenizer, pool

logger = logging.getLogger(__name__)

__all__ = ["T5GURCollator", "T5GURModel", "fill_spans", "is_seq2seq_model", "load_seq2seq", "sentinel_token_ids",
           "span_corrupt"]

#: the paper's vector dim (Table I): the projection head's output size unless ``projection_dim`` says otherwise
DEFAULT_PROJECTION_DIM = 128
_MAX_SENTINELS = 1000


# ---------------------------------------------------------------------------- T5 span corruption

def sentinel_token_ids(tokenizer: Any) -> list[int]:
    """Ids of ``<extra_id_0>``, ``<extra_id_1>``, ... in order, as far as the tokenizer has them.

    A tokenizer without any (not a T5 tokenizer) is a :class:`ConfigError`."""
    unk = getattr(tokenizer, "unk_token_id", None)
    ids: list[int] = []
    for index in range(_MAX_SENTINELS):
        token_id = tokenizer.convert_tokens_to_ids(f"<extra_id_{index}>")
        if token_id is None or token_id == unk:
            break
        ids.append(int(token_id))
    if not ids:
        raise ConfigError("GUR on an encoder-decoder needs a T5 tokenizer with sentinel tokens <extra_id_0>, "
                          "<extra_id_1>, ... (T5's extra_ids); this tokenizer has none: save the model with its T5 "
                          "tokenizer")
    return ids


def span_corrupt(token_ids: Sequence[int] | np.ndarray, mask: Sequence[bool] | np.ndarray, sentinels: Sequence[int],
                 eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """T5 span corruption of one tokenised text: ``(encoder input, decoder target)``.

    Each maximal run of ``True`` in ``mask`` (a span) is replaced by the next sentinel in the input; the target is
    ``sentinel_0 span_0 sentinel_1 span_1 ... eos``, the spans in order (the authors' ``SpanMasker`` output; T5's
    ``noise_span_to_unique_sentinel``). With more spans than sentinels the spans past the last sentinel stay
    unmasked. A text without a span has the target ``eos`` alone.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    selected = np.asarray(mask, dtype=bool)
    if selected.shape != ids.shape:
        raise ValueError(f"mask has shape {selected.shape} for {ids.shape} tokens")
    padded = np.concatenate([[False], selected, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    spans = list(zip(edges[0::2].tolist(), edges[1::2].tolist()))[: len(sentinels)]
    inputs: list[int] = []
    targets: list[int] = []
    position = 0
    for sentinel, (start, end) in zip(sentinels, spans):
        inputs.extend(ids[position:start].tolist())
        inputs.append(int(sentinel))
        targets.append(int(sentinel))
        targets.extend(ids[start:end].tolist())
        position = end
    inputs.extend(ids[position:].tolist())
    targets.append(int(eos_id))
    return np.asarray(inputs, dtype=np.int64), np.asarray(targets, dtype=np.int64)


def fill_spans(inputs: Sequence[int], targets: Sequence[int], sentinels: Sequence[int],
               eos_id: int | None = None) -> list[int]:
    """Undo :func:`span_corrupt`: put every span of ``targets`` back in place of its sentinel in ``inputs``.

    ``targets`` may carry -100 padding (skipped) and ends at ``eos_id`` when given; ``inputs`` may carry trailing
    padding, which is kept as it is. A target that does not start with a sentinel is a ``ValueError``.
    """
    known = set(int(s) for s in sentinels)
    spans: dict[int, list[int]] = {}
    current: int | None = None
    for token in (int(t) for t in targets):
        if token == -100:
            continue
        if eos_id is not None and token == eos_id:
            break
        if token in known:
            current = token
            spans[current] = []
        elif current is None:
            raise ValueError(f"the target starts with token {token}, not with a sentinel")
        else:
            spans[current].append(token)
    restored: list[int] = []
    for token in (int(t) for t in inputs):
        restored.extend(spans[token] if token in spans else [token])
    return restored


class T5GURCollator:
    """Span-corrupt sentence pairs for T5 GUR.

    Examples: ``(a, b)`` / ``[a, b]`` or ``{"a": ..., "b": ...}``. Each sentence is tokenised with its ``</s>``,
    truncated to ``max_length`` tokens, span-masked independently (special tokens never; :class:`SpanMasker`,
    15 % in hump-geometric spans by default) and corrupted by :func:`span_corrupt`.

    Returns (2B rows, interleaved ``[a1, b1, a2, b2, ...]``): ``input_ids`` / ``attention_mask`` (2B, L), the
    corrupted encoder inputs padded with the pad token; ``labels`` (2B, T), the decoder targets padded with -100
    (padding is not a target; the authors' code counted it: the table of
    docs/methods.md#gur-on-t5-the-papers-architecture).
    """

    def __init__(self, tokenizer: Any, max_length: int = 128, masker: SpanMasker | None = None, *,
                 seed: int | None = None) -> None:
        self.sentinels = sentinel_token_ids(tokenizer)  # first: a tokenizer without them is not T5's at all
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ConfigError("GUR on T5 needs a tokenizer with a pad and an end-of-sequence (</s>) token")
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.masker = masker if masker is not None else SpanMasker()
        self.rng = np.random.default_rng(seed)
        self._warned = False

    def reseed(self, seed: int) -> None:
        """Restart the mask generator (e.g. per step, so that resuming redraws the same masks)."""
        self.rng = np.random.default_rng(seed)

    def corrupt(self, token_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Draw a span mask for one tokenised text and corrupt it: ``(encoder input, decoder target)``."""
        ids = np.asarray(token_ids, dtype=np.int64)
        selected = self.masker(maskable_positions(ids, self.tokenizer), self.rng)
        if not self._warned:
            padded = np.concatenate([[False], selected, [False]]).astype(np.int8)
            if int(np.count_nonzero(np.diff(padded))) // 2 > len(self.sentinels):
                logger.warning("a text has more masked spans than the tokenizer's %d sentinels: the spans past the "
                               "last sentinel stay unmasked (a lower max_length or mask_ratio avoids it)",
                               len(self.sentinels))
                self._warned = True
        return span_corrupt(ids, selected, self.sentinels, int(self.tokenizer.eos_token_id))

    def __call__(self, examples: Sequence[Any]) -> dict[str, Tensor]:
        texts = interleaved_texts(examples)
        encoded = self.tokenizer(head_texts(self.tokenizer, texts, self.max_length), truncation=True,
                                 max_length=self.max_length, add_special_tokens=True)
        rows = [self.corrupt(ids) for ids in encoded["input_ids"]]
        width = max(len(inputs) for inputs, _ in rows)
        target_width = max(len(targets) for _, targets in rows)
        input_ids = np.full((len(rows), width), int(self.tokenizer.pad_token_id), dtype=np.int64)
        attention = np.zeros((len(rows), width), dtype=np.int64)
        labels = np.full((len(rows), target_width), -100, dtype=np.int64)
        for i, (inputs, targets) in enumerate(rows):
            input_ids[i, : len(inputs)] = inputs
            attention[i, : len(inputs)] = 1
            labels[i, : len(targets)] = targets
        return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention),
                "labels": torch.from_numpy(labels)}


# ---------------------------------------------------------------------------- the model

def _supported_types() -> dict[str, str]:
    from ..models.encoder import ENCODER_ONLY_CLASSES

    return ENCODER_ONLY_CLASSES


def is_seq2seq_model(name_or_path: str | Path) -> bool:
    """True when the model folder holds an encoder-decoder (``config.is_encoder_decoder`` or a T5-family
    ``model_type``); read from its ``config.json`` only."""
    from transformers import AutoConfig

    from ..models.encoder import cannot_load, is_encoder_decoder, model_load_errors

    try:
        config = AutoConfig.from_pretrained(str(name_or_path))
    except model_load_errors() as exc:
        raise cannot_load(name_or_path, exc) from None
    return is_encoder_decoder(config)


def load_seq2seq(name_or_path: str | Path, **kwargs: Any) -> nn.Module:
    """``AutoModelForSeq2SeqLM.from_pretrained`` for the T5 family (t5, mt5, umt5), anything else refused.

    A folder with the encoder alone (e.g. the ``model/`` folder a T5 GUR run writes) loads too, with a freshly
    initialised decoder and a warning: continuing a run keeps its decoder only from the run's ``full/`` folder.
    """
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from ..models.encoder import cannot_load, model_load_errors

    try:
        config = AutoConfig.from_pretrained(str(name_or_path))
        model_type = getattr(config, "model_type", "")
        if model_type not in _supported_types():
            raise ConfigError(f"model {name_or_path} is of type {model_type!r}; GUR on an encoder-decoder supports "
                              f"the T5 family ({', '.join(_supported_types())}): use a T5 checkpoint, or an "
                              "encoder-only model (BERT, RoBERTa, MiniLM, ...) for the encoder-only GUR")
        model, info = AutoModelForSeq2SeqLM.from_pretrained(str(name_or_path), output_loading_info=True, **kwargs)
    except ConfigError:
        raise
    except model_load_errors() as exc:
        raise cannot_load(name_or_path, exc) from None
    missing = [k for k in info.get("missing_keys", ()) if k.startswith("decoder.")]
    if missing:
        logger.warning("%s has no decoder weights (%d missing, e.g. %s): the decoder starts from random weights. To "
                       "continue a T5 GUR run with its decoder, pass its full/ folder as the model", name_or_path,
                       len(missing), missing[0])
    return model


class T5GURModel(nn.Module):
    """A T5 ``ForConditionalGeneration`` model trained with span-corruption LM (decoder) + in-pair contrastive
    learning (encoder, pooled and projected).

    Two call forms, as :class:`~robustir.pretraining.gur.GURModel`: ``model(features)`` (``input_ids``,
    ``attention_mask``, ``labels``; any rows, e.g. a batch engine chunk) returns ``(vectors, AuxLoss)``;
    ``model(**collator_batch)`` (interleaved pairs) returns ``{"loss", "mlm_loss", "cl_loss", "cl_accuracy"}``.
    ``mlm_loss`` is the decoder's span-reconstruction loss (the name is shared with the encoder-only GUR, so logs,
    reports and ``mlm_weight`` mean the same in both).

    Args:
        t5: a ``T5ForConditionalGeneration`` (or mT5 / UMT5).
        pooling: "mean" over the encoder states (the only one: T5 has no [CLS] token).
        projection: the non-linear :class:`ProjectionHead` on the pooled vector (paper: on; default on).
        projection_dim: the head's output size (default 128, the paper's vector dim).
        similarity: "cosine" (paper) or "dot" (authors' code). temperature 0.1; alpha (CL weight) 1;
        mlm_weight (LM weight) 1.
        tokenizer: written next to the saved models.
    """

    def __init__(self, t5: nn.Module, *, pooling: str = "mean", projection: bool = True,
                 projection_dim: int | None = None, similarity: str = "cosine", temperature: float = 0.1,
                 alpha: float = 1.0, mlm_weight: float = 1.0, tokenizer: Any | None = None) -> None:
        super().__init__()
        if pooling != "mean":
            raise ConfigError(f"pooling {pooling!r} does not apply to a T5 encoder: it has no [CLS] token (the "
                              "authors' code reads the last </s>); use pooling mean (or leave it unset)")
        if similarity not in SIMILARITIES:
            raise ConfigError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}")
        if temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {temperature}")
        if not callable(getattr(t5, "get_encoder", None)) or getattr(t5, "lm_head", None) is None:
            raise ConfigError(f"{type(t5).__name__} is not an encoder-decoder LM (expected T5ForConditionalGeneration)")
        self.t5 = t5
        self.tokenizer = tokenizer
        self.pooling = pooling
        hidden_size = self.hidden_size
        if projection:
            self.projection_dim = int(projection_dim) if projection_dim is not None else DEFAULT_PROJECTION_DIM
        else:
            self.projection_dim = hidden_size
        self.projection: ProjectionHead | None = ProjectionHead(hidden_size, self.projection_dim) if projection \
            else None
        self.similarity = similarity
        self.temperature = float(temperature)
        self.alpha = float(alpha)
        self.mlm_weight = float(mlm_weight)

    @property
    def backbone(self) -> nn.Module:
        """The Hugging Face model being trained (the whole encoder-decoder)."""
        return self.t5

    @property
    def hidden_size(self) -> int:
        return int(self.t5.config.d_model)

    @classmethod
    def from_pretrained(cls, model_path: str | Path, projection_head_path: str | Path | None = None, *,
                        model_kwargs: dict[str, Any] | None = None, **options: Any) -> T5GURModel:
        """Load the T5 model (:func:`load_seq2seq`) and, optionally, a saved projection head whose settings are the
        defaults; ``options`` (the constructor's keywords) override them."""
        t5 = load_seq2seq(model_path, **(model_kwargs or {}))
        settings, state = ({}, None) if projection_head_path is None else read_projection_head(
            projection_head_path, int(t5.config.d_model), encoder_decoder=True)
        settings.update(options)
        settings.setdefault("tokenizer", load_tokenizer(model_path))
        model = cls(t5, **settings)
        load_projection_state(model, settings, state)
        return model

    # ------------------------------------------------------------------ vectors and losses

    def _vectors(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        vectors = pool(hidden, attention_mask, self.pooling)
        return self.projection(vectors) if self.projection is not None else vectors

    def encode(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Sentence vectors from the encoder alone (mean-pooled, then projected when the model has a head)."""
        hidden = self.t5.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self._vectors(hidden, attention_mask)

    def encode_with_lm(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, int]:
        """One encoder forward over span-corrupted texts and one decoder forward over their targets:
        ``(vectors, lm_total, lm_count)``.

        ``lm_total`` is the **sum** of the decoder's cross-entropies over the target tokens (``labels != -100``;
        the decoder input is the labels shifted right, as T5 trains) and ``lm_count`` their number, so that the LM
        loss of several forwards (chunks, a- and b-rows) is ``sum(totals) / sum(counts)``.
        """
        encoder_out = self.t5.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
        vectors = self._vectors(encoder_out.last_hidden_state, attention_mask)
        decoder_input_ids = self.t5.prepare_decoder_input_ids_from_labels(labels=labels)
        logits = self.t5(encoder_outputs=encoder_out, attention_mask=attention_mask,
                         decoder_input_ids=decoder_input_ids, use_cache=False).logits
        # float32 logits: the sum over many tokens must not round in bf16
        total = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return vectors, total, int((labels != -100).sum())

    def contrastive_loss(self) -> InfoNCELoss:
        """GUR's contrastive term as a loss of :mod:`robustir.losses`: symmetric InfoNCE, a_k vs b_k (eq. 2)."""
        return InfoNCELoss(temperature=self.temperature, symmetric=True, similarity=self.similarity)

    def forward(self, features: Mapping[str, Tensor] | None = None, *, input_ids: Tensor | None = None,
                attention_mask: Tensor | None = None, labels: Tensor | None = None
                ) -> tuple[Tensor, AuxLoss] | dict[str, Tensor]:
        """``model(features)``: the batch engine's form, ``(vectors, AuxLoss(lm_total, lm_count, "mlm_loss",
        mlm_weight))``; ``model(**collator_batch)``: ``{"loss": mlm_weight * LM + alpha * CL, "mlm_loss",
        "cl_loss", "cl_accuracy"}`` on one interleaved pair batch (a single-process plain engine step's objective)."""
        if features is not None:
            if not isinstance(features, Mapping):
                raise TypeError("T5GURModel(features) takes a feature dict; pass the collator's batch as "
                                "T5GURModel(**batch)")
            unknown = set(features) - {"input_ids", "attention_mask", "labels"}
            if unknown:
                raise TypeError(f"T5GURModel features are input_ids, attention_mask and labels; got {sorted(unknown)}")
            vectors, total, count = self.encode_with_lm(**dict(features))
            return vectors, AuxLoss(total, count, name=MLM_LOSS_NAME, weight=self.mlm_weight)
        if input_ids is None or attention_mask is None or labels is None:
            raise TypeError("T5GURModel(**batch) needs input_ids, attention_mask and labels")
        if input_ids.shape[0] % 2:
            raise ValueError("GUR batches hold pairs as interleaved rows [a1, b1, a2, b2, ...]; got an odd row count")
        vectors, total, count = self.encode_with_lm(input_ids, attention_mask, labels)
        lm_loss = total / max(count, 1)
        cl = self.contrastive_loss()(ContrastiveBatch.from_groups(vectors[0::2], vectors[1::2]))
        loss = self.mlm_weight * lm_loss + self.alpha * cl.loss
        return {"loss": loss, "mlm_loss": lm_loss.detach(), "cl_loss": cl.loss.detach(),
                "cl_accuracy": torch.tensor(cl.components["accuracy"])}

    # ------------------------------------------------------------------ saving

    def save_pretrained(self, save_dir: str | Path, *, tokenizer: Any | None = None,
                        encoder_config: Any | None = None, model_card: str | None = None) -> Path:
        """Write three folders under ``save_dir``:

        * ``encoder/``: the T5 encoder alone as a sentence-transformers folder (``T5EncoderModel`` + mean pooling
          + normalisation unless ``encoder_config`` says otherwise), what retrieval, classification and fine-tuning
          load; the projection head is not part of it (paper: the encoder alone at test time);
        * ``full/``: the whole ``T5ForConditionalGeneration`` + tokenizer (the decoder, to continue pre-training
          or generate);
        * ``projection_head/``: the GUR settings and the head's weights.
        """
        import transformers

        from ..models.encoder import ENCODER_ONLY_CLASSES, Encoder, EncoderConfig

        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        if tokenizer is None:
            raise ConfigError("saving the T5 GUR model needs a tokenizer: pass tokenizer=...")
        root = Path(save_dir)
        full = root / "full"
        self.t5.save_pretrained(full)
        tokenizer.save_pretrained(full)
        # the encoder alone, read back from the folder just written: transformers' own loader picks the encoder's
        # weights (and ties the embeddings) exactly as SentenceTransformer(path) will
        encoder_cls = getattr(transformers, ENCODER_ONLY_CLASSES[self.t5.config.model_type])
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # its load report lists the decoder weights left out: expected
        try:
            encoder_only = encoder_cls.from_pretrained(full)
        finally:
            transformers.logging.set_verbosity(verbosity)
        if encoder_config is None:
            limit = getattr(tokenizer, "model_max_length", None)
            length = int(limit) if isinstance(limit, int) and 0 < limit < 10**6 else 512
            encoder_config = EncoderConfig(pooling=self.pooling, normalize=True, query_max_length=min(64, length),
                                           passage_max_length=length)
        Encoder(encoder_only, tokenizer, encoder_config).save(root / "encoder", model_card=model_card)
        write_projection_head(root / "projection_head", self, self.hidden_size, encoder_decoder=True)
        return root
