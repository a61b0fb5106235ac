"""RetroMAE: retrieval-oriented masked auto-encoder pre-training (docs/methods.md#retromae-pre-training).

Xiao et al., "RetroMAE: Pre-Training Retrieval-oriented Language Models Via Masked Auto-Encoder",
EMNLP 2022. The encoder (a BERT masked LM) reads a sentence with 30 % of its words masked and squeezes
it into the [CLS] vector h. A one-layer "enhanced" decoder must rebuild *every* token from h plus a
heavily masked view of the sentence (50 %), which forces h to carry the sentence's content.

Pipeline: ``RetroMAECollator(examples) -> batch``; ``RetroMAEModel(**batch) -> {"loss", ...}``.

Choices made explicit (docs/methods.md#retromae-choices):

* Query stream = ``h + P_i`` (raw position-embedding lookup, **no LayerNorm, no dropout**): the
  original staoxiao/RetroMAE form, not FlagEmbedding's ``LayerNorm(h + P_i + T_0)``.
* Key/value stream = ``[h, E(x_1), ..., E(x_L)]`` with E = the encoder's own embeddings module applied
  to the unmasked ids (shared weights), position 0 replaced by h.
* Row i of the decoder attention hides a whole-word mask drawn from a per-example pool of
  ``min(L, 256)`` masks at p = 0.5, plus position i itself; position 0 (h) stays visible for i != 0.
* Loss = ``decoder_loss_weight * CE_decoder + encoder_loss_weight * CE_encoder_mlm`` (1 : 1 default).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from robustir.pretraining.masking import (
    maskable_positions,
    replace_masked_tokens,
    sample_whole_word_mask,
    whole_word_mask,
    word_groups,
)
from robustir.errors import ConfigError
from robustir.models.tokens import head_texts
from robustir.pretraining.mlm_encoder import (
    MaskedLMPretrainModel,
    load_masked_lm,
    load_tokenizer,
    masked_lm_loss,
    pool,
)

__all__ = ["EnhancedDecoderLayer", "RetroMAECollator", "RetroMAEModel"]

DECODER_HEAD_FORMAT = "robustir.retromae.decoder_head"
_WEIGHTS_NAME = "model.safetensors"
_CONFIG_NAME = "config.json"


# ----------------------------------------------------------------------------------------------------
# Collator (docs/methods.md#retromae-masking)
# ----------------------------------------------------------------------------------------------------


class RetroMAECollator:
    """Turn raw texts into RetroMAE encoder and decoder inputs.

    Examples may be ``str``, ``{"text": str}``, or pre-tokenised ``{"token_ids": [int, ...]}`` /
    ``list[int]`` *without* special tokens (the original repository's format; [CLS]/[SEP] are added).

    Returns a dict of tensors (B = batch, L = longest sequence in the batch):

    * ``encoder_input_ids`` (B, L) long - whole-word masked at ``encoder_mlm_probability``, then
      80 % [MASK] / 10 % random / 10 % unchanged.
    * ``encoder_attention_mask`` (B, L) long - 1 for real tokens.
    * ``encoder_labels`` (B, L) long - original id at selected positions, -100 elsewhere.
    * ``decoder_input_ids`` (B, L) long - the *unmasked* ids.
    * ``decoder_attention_mask`` (B, L, L) bool - ``True`` where query row i may attend to key j.
    * ``decoder_labels`` (B, L) long - every real non-special token; -100 for [CLS]/[SEP]/padding.

    ``seed`` makes the masks reproducible (one generator for the collator's lifetime; give each
    data-loader worker its own seed, e.g. via ``reseed``).
    """

    def __init__(
        self,
        tokenizer: Any,
        max_length: int = 512,
        encoder_mlm_probability: float = 0.3,
        decoder_mlm_probability: float = 0.5,
        decoder_mask_pool: int = 256,
        *,
        mask_replace_prob: float = 0.8,
        random_replace_prob: float = 0.1,
        seed: int | None = None,
    ) -> None:
        if None in (tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.cls_token_id, tokenizer.sep_token_id):
            raise ConfigError("RetroMAE needs a tokenizer with [CLS], [SEP], [MASK] and [PAD] tokens")
        if max_length < 3:
            raise ConfigError(f"max_length must be >= 3, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.encoder_mlm_probability = float(encoder_mlm_probability)
        self.decoder_mlm_probability = float(decoder_mlm_probability)
        self.decoder_mask_pool = int(decoder_mask_pool)
        self.mask_replace_prob = float(mask_replace_prob)
        self.random_replace_prob = float(random_replace_prob)
        self.rng = np.random.default_rng(seed)

    def reseed(self, seed: int) -> None:
        """Restart the mask generator (e.g. per data-loader worker or when resuming)."""
        self.rng = np.random.default_rng(seed)

    def _tokenize(self, examples: Sequence[Any]) -> list[tuple[np.ndarray, list[int | None] | None]]:
        texts: list[str] = []
        out: list[tuple[np.ndarray, list[int | None] | None] | None] = []
        for ex in examples:
            if isinstance(ex, Mapping):
                ex = ex["text"] if "text" in ex else ex["token_ids"]
            if isinstance(ex, str):
                texts.append(ex)
                out.append(None)
            else:
                body = [int(t) for t in ex][: self.max_length - 2]
                # [CLS] x [SEP] by hand: transformers 5 tokenizers no longer all offer
                # build_inputs_with_special_tokens.
                ids = [self.tokenizer.cls_token_id, *body, self.tokenizer.sep_token_id]
                # No word_ids for pre-tokenised input: words come from the '##' continuation marks.
                out.append((np.asarray(ids, dtype=np.int64), None))
        if texts:
            enc = self.tokenizer(head_texts(self.tokenizer, texts, self.max_length), truncation=True,
                                 max_length=self.max_length, add_special_tokens=True)
            fast = getattr(enc, "is_fast", False)
            encoded = iter(
                (np.asarray(ids, dtype=np.int64), enc.word_ids(k) if fast else None)
                for k, ids in enumerate(enc["input_ids"])
            )
            out = [item if item is not None else next(encoded) for item in out]
        return out  # type: ignore[return-value]

    def decoder_attention(
        self, token_ids: np.ndarray, word_ids: Sequence[int | None] | None = None
    ) -> np.ndarray:
        """The (L, L) decoder attention matrix of one unpadded sequence (``True`` = visible).

        A pool of ``min(L, decoder_mask_pool)`` whole-word masks at ``decoder_mlm_probability`` is drawn
        once; row i uses a random member of the pool, also hides itself, and always sees position 0
        unless i == 0 (docs/methods.md#retromae-masking).
        """
        length = len(token_ids)
        maskable = maskable_positions(token_ids, self.tokenizer)
        groups = word_groups(token_ids, self.tokenizer, word_ids=word_ids, maskable=maskable)
        num_to_predict = max(1, int(round(length * self.decoder_mlm_probability)))
        pool_size = min(length, self.decoder_mask_pool)
        pool = np.stack([sample_whole_word_mask(groups, length, num_to_predict, self.rng) for _ in range(pool_size)])
        hidden = pool[self.rng.integers(0, pool_size, size=length)]
        rows = np.arange(length)
        hidden[rows, rows] = True
        hidden[1:, 0] = False
        return ~hidden

    def __call__(self, examples: Sequence[Any]) -> dict[str, Tensor]:
        sequences = self._tokenize(examples)
        batch = len(sequences)
        width = max(len(ids) for ids, _ in sequences)
        pad_id = int(self.tokenizer.pad_token_id)

        enc_ids = np.full((batch, width), pad_id, dtype=np.int64)
        enc_labels = np.full((batch, width), -100, dtype=np.int64)
        attention = np.zeros((batch, width), dtype=np.int64)
        dec_ids = np.full((batch, width), pad_id, dtype=np.int64)
        dec_labels = np.full((batch, width), -100, dtype=np.int64)
        dec_attention = np.zeros((batch, width, width), dtype=bool)

        for b, (ids, word_ids) in enumerate(sequences):
            n = len(ids)
            selected = whole_word_mask(ids, self.tokenizer, self.encoder_mlm_probability, self.rng, word_ids=word_ids)
            masked, labels = replace_masked_tokens(
                ids,
                selected,
                self.tokenizer,
                self.rng,
                mask_replace_prob=self.mask_replace_prob,
                random_replace_prob=self.random_replace_prob,
            )
            enc_ids[b, :n] = masked
            enc_labels[b, :n] = labels
            attention[b, :n] = 1
            dec_ids[b, :n] = ids
            dec_labels[b, :n] = np.where(maskable_positions(ids, self.tokenizer), ids, -100)
            dec_attention[b, :n, :n] = self.decoder_attention(ids, word_ids)

        return {
            "encoder_input_ids": torch.from_numpy(enc_ids),
            "encoder_attention_mask": torch.from_numpy(attention),
            "encoder_labels": torch.from_numpy(enc_labels),
            "decoder_input_ids": torch.from_numpy(dec_ids),
            "decoder_attention_mask": torch.from_numpy(dec_attention),
            "decoder_labels": torch.from_numpy(dec_labels),
        }


# ----------------------------------------------------------------------------------------------------
# Enhanced decoder (docs/methods.md#retromae-enhanced-decoding)
# ----------------------------------------------------------------------------------------------------


class EnhancedDecoderLayer(nn.Module):
    """One BERT-style transformer layer with separate query and key/value streams.

    ``forward(query, key_value, attention)``: multi-head attention of ``query`` (B, L, D) over
    ``key_value`` (B, L, D) under a boolean (B, L, L) visibility matrix, residual to the *query* stream,
    LayerNorm, then BERT's FFN (dense -> activation -> dense, residual, LayerNorm). Post-LN and
    initialisation as in BERT. Written with plain torch so it does not depend on transformers internals.
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        intermediate_size: int,
        *,
        hidden_act: str = "gelu",
        hidden_dropout_prob: float = 0.1,
        attention_probs_dropout_prob: float = 0.1,
        layer_norm_eps: float = 1e-12,
        initializer_range: float = 0.02,
    ) -> None:
        super().__init__()
        if hidden_size % num_attention_heads:
            raise ConfigError(f"hidden_size {hidden_size} is not divisible by {num_attention_heads} heads")
        from transformers.activations import ACT2FN

        self.config = {
            "hidden_size": int(hidden_size),
            "num_attention_heads": int(num_attention_heads),
            "intermediate_size": int(intermediate_size),
            "hidden_act": str(hidden_act),
            "hidden_dropout_prob": float(hidden_dropout_prob),
            "attention_probs_dropout_prob": float(attention_probs_dropout_prob),
            "layer_norm_eps": float(layer_norm_eps),
            "initializer_range": float(initializer_range),
        }
        self.num_heads = int(num_attention_heads)
        self.head_dim = hidden_size // num_attention_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.attention_dropout = float(attention_probs_dropout_prob)
        self.attention_output = nn.Linear(hidden_size, hidden_size)
        self.attention_norm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.intermediate = nn.Linear(hidden_size, intermediate_size)
        self.activation = ACT2FN[hidden_act]
        self.output = nn.Linear(intermediate_size, hidden_size)
        self.output_norm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.reset_parameters()

    @classmethod
    def from_encoder_config(cls, config: Any) -> EnhancedDecoderLayer:
        """A layer shaped like one layer of the encoder (BERT config attributes)."""
        return cls(
            config.hidden_size,
            config.num_attention_heads,
            config.intermediate_size,
            hidden_act=config.hidden_act if isinstance(config.hidden_act, str) else "gelu",
            hidden_dropout_prob=config.hidden_dropout_prob,
            attention_probs_dropout_prob=config.attention_probs_dropout_prob,
            layer_norm_eps=config.layer_norm_eps,
            initializer_range=config.initializer_range,
        )

    def reset_parameters(self) -> None:
        """BERT's ``_init_weights``: N(0, initializer_range) weights, zero biases, unit LayerNorm."""
        std = self.config["initializer_range"]
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def _split(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, query: Tensor, key_value: Tensor, attention: Tensor) -> Tensor:
        b, n, d = query.shape
        q = self._split(self.query(query))
        k = self._split(self.key(key_value))
        v = self._split(self.value(key_value))
        # Additive mask with a finite minimum: fully hidden (padding) rows give a uniform softmax instead
        # of NaN; their outputs carry no label.
        bias = torch.zeros(attention.shape, dtype=q.dtype, device=q.device)
        bias.masked_fill_(~attention.bool(), torch.finfo(q.dtype).min)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + bias[:, None]
        probs = F.dropout(scores.softmax(-1), p=self.attention_dropout, training=self.training)
        context = (probs @ v).transpose(1, 2).reshape(b, n, d)
        attended = self.attention_norm(self.dropout(self.attention_output(context)) + query)
        ffn = self.output(self.activation(self.intermediate(attended)))
        return self.output_norm(self.dropout(ffn) + attended)


# ----------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------


class RetroMAEModel(MaskedLMPretrainModel):
    """Encoder (masked LM) + one-layer enhanced decoder; ``forward(**collator_batch)`` returns losses.

    Args:
        encoder: a BERT-family ``AutoModelForMaskedLM`` (its embeddings and MLM head are shared with
            the decoder).
        decoder: the :class:`EnhancedDecoderLayer`; a new one shaped like an encoder layer if ``None``.
        encoder_loss_weight / decoder_loss_weight: loss = dw * CE_decoder + ew * CE_encoder (1 : 1).
        pooling: how h is read off the encoder: "cls" (RetroMAE) or "mean" (the mask-weighted mean of the
            token states, for models that were trained mean-pooled, e.g. all-MiniLM-L6-v2: the bottleneck
            then trains the vector that fine-tuning and inference actually use).
        tokenizer: kept only so that :meth:`save_pretrained` can write it next to the encoder.
    """

    def __init__(
        self,
        encoder: nn.Module,
        decoder: EnhancedDecoderLayer | None = None,
        *,
        encoder_loss_weight: float = 1.0,
        decoder_loss_weight: float = 1.0,
        pooling: str = "cls",
        tokenizer: Any | None = None,
    ) -> None:
        super().__init__(encoder, pooling=pooling, tokenizer=tokenizer)
        embeddings = getattr(encoder.base_model, "embeddings", None)
        if embeddings is None or not hasattr(embeddings, "position_embeddings"):
            raise ConfigError(f"{type(encoder).__name__}: RetroMAE needs BERT-style absolute position embeddings")
        self.decoder = decoder if decoder is not None else EnhancedDecoderLayer.from_encoder_config(encoder.config)
        if self.decoder.config["hidden_size"] != encoder.config.hidden_size:
            raise ConfigError("decoder head hidden_size does not match the encoder")
        self.encoder_loss_weight = float(encoder_loss_weight)
        self.decoder_loss_weight = float(decoder_loss_weight)

    @classmethod
    def from_pretrained(
        cls,
        encoder_path: str | Path,
        decoder_head_path: str | Path | None = None,
        *,
        encoder_loss_weight: float | None = None,
        decoder_loss_weight: float | None = None,
        pooling: str | None = None,
        **model_kwargs: Any,
    ) -> RetroMAEModel:
        """Load the encoder (any BERT-family HF folder or hub id) and, optionally, a saved decoder head.

        Loss weights and pooling not given here come from the decoder head's config (else 1.0 and "cls").
        ``model_kwargs`` go to ``AutoModelForMaskedLM.from_pretrained``.
        """
        encoder = load_masked_lm(encoder_path, **model_kwargs)
        decoder = None
        saved: dict[str, Any] = {}
        if decoder_head_path is not None:
            decoder, saved = _load_decoder_head(Path(decoder_head_path))
        if encoder_loss_weight is None:
            encoder_loss_weight = saved.get("encoder_loss_weight", 1.0)
        if decoder_loss_weight is None:
            decoder_loss_weight = saved.get("decoder_loss_weight", 1.0)
        if pooling is None:
            pooling = saved.get("pooling", "cls")
        return cls(
            encoder,
            decoder,
            encoder_loss_weight=encoder_loss_weight,
            decoder_loss_weight=decoder_loss_weight,
            pooling=pooling,
            tokenizer=load_tokenizer(encoder_path),
        )

    def encode(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """Sentence embedding h: the [CLS] state, or the mean of the token states with ``pooling="mean"``."""
        out = self.encoder.base_model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return pool(out.last_hidden_state, attention_mask, self.pooling)

    def decode(self, h: Tensor, decoder_input_ids: Tensor, decoder_attention_mask: Tensor) -> Tensor:
        """Enhanced decoding (two streams, docs/methods.md#retromae-enhanced-decoding); returns (B, L, D) states."""
        embeddings = self.encoder.base_model.embeddings
        length = decoder_input_ids.shape[1]
        # Key/value stream: the encoder's own embeddings of the unmasked ids, slot 0 replaced by h.
        token_embeddings = embeddings(input_ids=decoder_input_ids)
        key_value = torch.cat([h.unsqueeze(1), token_embeddings[:, 1:]], dim=1)
        # Query stream (original RetroMAE): h + P_i, no LayerNorm, no dropout.
        positions = torch.arange(length, device=decoder_input_ids.device)
        query = h.unsqueeze(1) + embeddings.position_embeddings(positions).unsqueeze(0)
        return self.decoder(query, key_value, decoder_attention_mask)

    def forward(
        self,
        encoder_input_ids: Tensor,
        encoder_attention_mask: Tensor,
        encoder_labels: Tensor,
        decoder_input_ids: Tensor,
        decoder_attention_mask: Tensor,
        decoder_labels: Tensor,
        encoder_token_type_ids: Tensor | None = None,
    ) -> dict[str, Tensor]:
        out = self.encoder.base_model(
            input_ids=encoder_input_ids, attention_mask=encoder_attention_mask, token_type_ids=encoder_token_type_ids
        )
        hidden = out.last_hidden_state
        h = pool(hidden, encoder_attention_mask, self.pooling)
        encoder_mlm_loss = masked_lm_loss(self.head, hidden, encoder_labels)
        decoded = self.decode(h, decoder_input_ids, decoder_attention_mask)
        decoder_loss = masked_lm_loss(self.head, decoded, decoder_labels)
        loss = self.decoder_loss_weight * decoder_loss + self.encoder_loss_weight * encoder_mlm_loss
        return {"loss": loss, "encoder_mlm_loss": encoder_mlm_loss.detach(), "decoder_loss": decoder_loss.detach()}

    def save_pretrained(
        self, save_dir: str | Path, *, tokenizer: Any | None = None, max_seq_length: int | None = None,
        encoder_config: Any | None = None, model_card: str | None = None,
    ) -> Path:
        """Write ``save_dir/encoder`` (HF + sentence-transformers folder with this model's pooling and tokenizer) and
        ``save_dir/decoder_head`` (decoder weights + config) so pre-training can continue."""
        root = Path(save_dir)
        self.save_encoder(root / "encoder", tokenizer=tokenizer, max_seq_length=max_seq_length,
                          encoder_config=encoder_config, model_card=model_card)
        head_dir = root / "decoder_head"
        head_dir.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        state = {k: v.detach().contiguous().cpu() for k, v in self.decoder.state_dict().items()}
        save_file(state, str(head_dir / _WEIGHTS_NAME))
        config = {
            "format": DECODER_HEAD_FORMAT,
            "format_version": 1,
            "query_stream": "h + position_embedding (original RetroMAE, no LayerNorm)",
            "encoder_loss_weight": self.encoder_loss_weight,
            "decoder_loss_weight": self.decoder_loss_weight,
            "pooling": self.pooling,
            "layer": self.decoder.config,
        }
        (head_dir / _CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        return root


def _load_decoder_head(path: Path) -> tuple[EnhancedDecoderLayer, dict[str, Any]]:
    config_file = path / _CONFIG_NAME
    if not config_file.is_file():
        raise ConfigError(f"{path}: no {_CONFIG_NAME}; expected a folder written by RetroMAEModel.save_pretrained")
    config = json.loads(config_file.read_text())
    if config.get("format") != DECODER_HEAD_FORMAT:
        raise ConfigError(f"{config_file}: not a RetroMAE decoder head (format={config.get('format')!r})")
    layer_config = dict(config["layer"])
    layer = EnhancedDecoderLayer(
        layer_config.pop("hidden_size"),
        layer_config.pop("num_attention_heads"),
        layer_config.pop("intermediate_size"),
        **layer_config,
    )
    from safetensors.torch import load_file

    layer.load_state_dict(load_file(str(path / _WEIGHTS_NAME)))
    return layer, config
