"""Token masking for retrieval-oriented pre-training: whole-word MLM masks and GUR span masks.

Everything here is numpy-only and driven by an explicit ``numpy.random.Generator`` so that a collator
seeded once is reproducible. A "mask" is a boolean array over token positions (``True`` = selected for
prediction); turning a selection into model inputs is a separate step (:func:`replace_masked_tokens`).

* :func:`whole_word_mask` - the selection rule of HF's (pre-v5) ``DataCollatorForWholeWordMask`` that
  RetroMAE's collator subclasses (docs/methods.md#retromae-masking): shuffle the words, greedily take whole words
  until ``round(num_tokens * p)`` tokens are covered, skipping a word that would overshoot.
* :func:`replace_masked_tokens` - BERT's 80 % ``[MASK]`` / 10 % random token / 10 % unchanged.
* :class:`SpanMasker` - GUR's hump-geometric span masking (docs/methods.md#gur-span-masking).

Special tokens are never selected. "Special" means any id in ``tokenizer.all_special_ids`` except
``[UNK]``: an unknown word still stands for text, so it may be masked and predicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "SpanMasker",
    "maskable_positions",
    "replace_masked_tokens",
    "sample_whole_word_mask",
    "span_length_probabilities",
    "whole_word_mask",
    "word_groups",
]


def _special_ids(tokenizer: Any) -> set[int]:
    special = set(int(i) for i in getattr(tokenizer, "all_special_ids", []))
    if getattr(tokenizer, "unk_token_id", None) is not None:
        special.discard(int(tokenizer.unk_token_id))
    return special


def maskable_positions(token_ids: Sequence[int] | np.ndarray, tokenizer: Any) -> np.ndarray:
    """Boolean array: ``True`` where a token may be masked (not [CLS]/[SEP]/[PAD]/[MASK]/..., [UNK] allowed)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    special = np.fromiter(_special_ids(tokenizer), dtype=np.int64)
    return ~np.isin(ids, special)


def word_groups(
    token_ids: Sequence[int] | np.ndarray,
    tokenizer: Any,
    *,
    word_ids: Sequence[int | None] | None = None,
    maskable: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Split the maskable positions of one sequence into words (lists of token positions).

    With ``word_ids`` (from a fast tokenizer's ``BatchEncoding.word_ids()``), consecutive positions with
    the same word id form a word. Otherwise WordPiece's ``##`` prefix marks a continuation of the
    previous word (what HF's whole-word collator does); for a tokenizer without ``##`` pieces each token
    is its own word. Special positions never belong to a word.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    if maskable is None:
        maskable = maskable_positions(ids, tokenizer)
    if word_ids is not None:
        if len(word_ids) != len(ids):
            raise ValueError(f"word_ids has {len(word_ids)} entries for {len(ids)} tokens")
        continues = [
            i > 0 and word_ids[i] is not None and word_ids[i] == word_ids[i - 1] for i in range(len(ids))
        ]
    else:
        tokens = tokenizer.convert_ids_to_tokens(ids.tolist())
        continues = [i > 0 and str(tok).startswith("##") for i, tok in enumerate(tokens)]

    groups: list[list[int]] = []
    for i in range(len(ids)):
        if not maskable[i]:
            continue
        # A continuation only joins the previous word if that word ends right before it.
        if continues[i] and groups and groups[-1][-1] == i - 1:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [np.asarray(g, dtype=np.int64) for g in groups]


def sample_whole_word_mask(
    groups: Sequence[np.ndarray], length: int, num_to_predict: int, rng: np.random.Generator
) -> np.ndarray:
    """Greedy whole-word selection (HF ``_whole_word_mask`` rule, docs/methods.md#retromae-masking).

    Words are visited in random order; a word is taken if it still fits into ``num_to_predict``
    tokens, otherwise skipped (a shorter word later may still fit). Stops once the budget is met.
    """
    mask = np.zeros(length, dtype=bool)
    covered = 0
    for k in rng.permutation(len(groups)):
        if covered >= num_to_predict:
            break
        group = groups[k]
        if covered + len(group) > num_to_predict:
            continue
        mask[group] = True
        covered += len(group)
    return mask


def whole_word_mask(
    token_ids: Sequence[int] | np.ndarray,
    tokenizer: Any,
    probability: float,
    rng: np.random.Generator,
    *,
    word_ids: Sequence[int | None] | None = None,
    max_predictions: int = 512,
) -> np.ndarray:
    """Select whole words covering ``round(num_tokens * probability)`` tokens of one sequence.

    ``num_tokens`` counts every non-padding token *including* [CLS]/[SEP], exactly as HF's whole-word
    collator (which RetroMAE uses, docs/methods.md#retromae-masking) does; at least one token is always requested.
    The selected fraction of *maskable* tokens is therefore slightly above ``probability`` for short
    sequences. Returns a boolean array of ``len(token_ids)``.
    """
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"probability must be in [0, 1], got {probability}")
    ids = np.asarray(token_ids, dtype=np.int64)
    maskable = maskable_positions(ids, tokenizer)
    groups = word_groups(ids, tokenizer, word_ids=word_ids, maskable=maskable)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    num_tokens = int((ids != pad_id).sum()) if pad_id is not None else len(ids)
    # Python's round (banker's rounding) on purpose: it is what the HF collator uses.
    num_to_predict = min(max_predictions, max(1, int(round(num_tokens * probability))))
    return sample_whole_word_mask(groups, len(ids), num_to_predict, rng)


def replace_masked_tokens(
    token_ids: np.ndarray,
    mask: np.ndarray,
    tokenizer: Any,
    rng: np.random.Generator,
    *,
    mask_replace_prob: float = 0.8,
    random_replace_prob: float = 0.1,
) -> tuple[np.ndarray, np.ndarray]:
    """BERT corruption of selected positions: 80 % [MASK], 10 % random token, 10 % unchanged.

    Works on arrays of any shape. Returns ``(input_ids, labels)`` where ``labels`` holds the original id
    at selected positions and -100 elsewhere. Random tokens are drawn uniformly from ``len(tokenizer)``
    like HF's collator (special ids included; they are rare).
    """
    if mask_replace_prob < 0 or random_replace_prob < 0 or mask_replace_prob + random_replace_prob > 1:
        raise ValueError("need mask_replace_prob, random_replace_prob >= 0 and their sum <= 1")
    ids = np.asarray(token_ids, dtype=np.int64)
    mask = np.asarray(mask, dtype=bool)
    labels = np.where(mask, ids, -100)
    inputs = ids.copy()
    # One uniform draw per position decides between the three outcomes.
    u = rng.random(ids.shape)
    to_mask = mask & (u < mask_replace_prob)
    to_random = mask & (u >= mask_replace_prob) & (u < mask_replace_prob + random_replace_prob)
    inputs[to_mask] = tokenizer.mask_token_id
    inputs[to_random] = rng.integers(0, len(tokenizer), size=int(to_random.sum()))
    return inputs, labels


def span_length_probabilities(p: float = 0.66, mode: int = 3, max_len: int = 10) -> np.ndarray:
    """P(L) ∝ p^|L - mode| for L = 1..max_len (GUR's hump-geometric span lengths, docs/methods.md#gur-span-masking).

    Defaults give ≈ [.111, .168, .254, .168, .111, .073, .048, .032, .021, .014], E[L] ≈ 3.795.
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"p must be in (0, 1], got {p}")
    if not 1 <= mode <= max_len:
        raise ValueError(f"need 1 <= mode <= max_len, got mode={mode}, max_len={max_len}")
    lengths = np.arange(1, max_len + 1)
    weights = p ** np.abs(lengths - mode).astype(float)
    return weights / weights.sum()


class SpanMasker:
    """GUR span masking over token positions (docs/methods.md#gur-span-masking; paper: 15 % of tokens in spans).

    Algorithm, applied to every maximal run of maskable positions (so spans never touch special tokens):

    1. Cut the run into consecutive *segments*: draw a span length L from
       :func:`span_length_probabilities`, give it a segment of ``cover = max(round(L / ratio), L + 1)``
       positions, and repeat. The last segment is whatever remains, with ``L = round(cover * ratio)``;
       if that is 0 the remainder joins the previous segment (or, in a run too short for any span,
       nothing is masked).
    2. Shuffle the segment order (so the truncated segment is not always last), then place each span
       uniformly inside its segment without touching the segment's last position. Spans are therefore
       disjoint and separated by at least one unmasked token.

    Each full segment masks L of ~L/ratio positions, so the masked fraction of a long run is
    ``E[L] / E[cover]`` ≈ ``ratio`` (0.150 for the defaults) and the span lengths follow P(L) exactly
    except for the one truncated span per run. This is the authors' segment scheme minus their
    ``merge_spans`` step (which joins pairs of length-1 spans); we keep the length law intact instead.

    ``mask_ratio_range=(0.10, 0.29)`` reproduces the authors' code: each call draws the ratio uniformly
    from the 0.01 grid ``0.10, 0.11, ..., 0.29`` (their 20 maskers) instead of using ``mask_ratio``.
    """

    def __init__(
        self,
        mask_ratio: float = 0.15,
        p: float = 0.66,
        mode: int = 3,
        max_len: int = 10,
        mask_ratio_range: tuple[float, float] | None = None,
    ) -> None:
        if not 0.0 < mask_ratio < 1.0:
            raise ValueError(f"mask_ratio must be in (0, 1), got {mask_ratio}")
        self.mask_ratio = float(mask_ratio)
        self.p = float(p)
        self.mode = int(mode)
        self.max_len = int(max_len)
        self.lengths = np.arange(1, self.max_len + 1)
        self.probs = span_length_probabilities(self.p, self.mode, self.max_len)
        self._cdf = np.cumsum(self.probs)
        self.mask_ratio_range = mask_ratio_range
        self._ratio_grid: np.ndarray | None = None
        if mask_ratio_range is not None:
            lo, hi = (float(x) for x in mask_ratio_range)
            if not 0.0 < lo <= hi < 1.0:
                raise ValueError(f"mask_ratio_range must satisfy 0 < lo <= hi < 1, got {mask_ratio_range}")
            self._ratio_grid = np.arange(round(lo * 100), round(hi * 100) + 1) / 100.0

    def __repr__(self) -> str:
        return (
            f"SpanMasker(mask_ratio={self.mask_ratio}, p={self.p}, mode={self.mode}, "
            f"max_len={self.max_len}, mask_ratio_range={self.mask_ratio_range})"
        )

    @property
    def expected_span_length(self) -> float:
        return float((self.lengths * self.probs).sum())

    def sample_ratio(self, rng: np.random.Generator) -> float:
        """The mask ratio used for one sentence (fixed, or drawn from the authors' 0.01 grid)."""
        if self._ratio_grid is None:
            return self.mask_ratio
        return float(self._ratio_grid[rng.integers(len(self._ratio_grid))])

    def _sample_length(self, rng: np.random.Generator) -> int:
        return int(self.lengths[min(np.searchsorted(self._cdf, rng.random(), side="right"), self.max_len - 1)])

    def _mask_run(self, n: int, ratio: float, rng: np.random.Generator) -> np.ndarray:
        segments: list[list[int]] = []  # [cover, span_length]
        remaining = n
        while remaining > 0:
            length = self._sample_length(rng)
            cover = max(int(round(length / ratio)), length + 1)
            if cover >= remaining:
                cover = remaining
                length = min(int(round(cover * ratio)), cover, self.max_len)
                if length == 0:
                    if segments:
                        segments[-1][0] += cover
                    break
            segments.append([cover, length])
            remaining -= cover
        out = np.zeros(n, dtype=bool)
        left = 0
        for k in rng.permutation(len(segments)):
            cover, length = segments[k]
            # Start in [left, left + cover - length - 1]: the segment's last position stays unmasked.
            start = left + int(rng.integers(0, max(cover - length, 1)))
            out[start : start + length] = True
            left += cover
        return out

    def __call__(self, maskable: Sequence[bool] | np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Span mask for one sequence. ``maskable``: bool per position (see :func:`maskable_positions`)."""
        maskable = np.asarray(maskable, dtype=bool)
        ratio = self.sample_ratio(rng)
        mask = np.zeros(len(maskable), dtype=bool)
        # Maximal runs of maskable positions: [starts[k], ends[k]).
        padded = np.concatenate([[False], maskable, [False]]).astype(np.int8)
        edges = np.flatnonzero(np.diff(padded))
        for start, end in zip(edges[0::2], edges[1::2]):
            mask[start:end] = self._mask_run(int(end - start), ratio, rng)
        return mask
