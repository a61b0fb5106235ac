"""Encoding's input path: token ids made as arrays, length-sorted batches made as tensors, ahead of the model.

:meth:`robustir.models.encoder.Encoder.encode` used to tokenize a block into Python lists of ids, pad each batch with
``tokenizer.pad`` (Python, per row), copy it to the device and copy each batch's vectors back (a sync per batch); the
model waited for all of it. Measured with a null model (the forward replaced by zeros, ``bench/encode.py
--null-model``) on the 2-core box, that path made 0.6-1.0x the texts/s of the ``transformers`` tokenizer call alone;
this one makes 1.4-1.5x (its padding of ready ids, what the server runs: 6x the old), with the same vectors
(docs/benchmarks.md, "Issue 54: the input path"). Hand-written beside the tokenizer call and ``tokenizer.pad``
because those build Python lists of ids per row and convert them to tensors. Here:

* :class:`FastTokens`: a private copy of the fast tokenizer's Rust backend, set up once per max length (truncation
  as the ``transformers`` call sets it), checked at construction to give the tokenizer call's ids on probe texts.
  ``encode_batch_fast`` runs without the GIL, so a block is tokenized by several threads at once; the ids go
  straight into one flat numpy array (no list of lists). A long text is tokenized once: its head is found as
  :func:`robustir.models.tokens.head_texts` finds it, and the head's count encoding becomes its ids through the
  backend's ``post_process`` (truncation + special tokens), not a second ``encode``.
* :class:`TokenBlock` + :func:`padded_batch`: a batch of rows sorted by length is padded with one numpy gather
  (input ids and attention mask only, as ``tokenizer.pad`` gives them), so the tensors are the old path's,
  element for element, and the vectors identical (``tests/test_encoder_input_path.py``).
* :func:`prefetch`: a generator run on a background thread through a bounded queue, so the next batches (and the
  next block's tokens) are made while the model runs; an error raised there is raised again in the caller.
  (Training's :class:`~robustir.training.input_pipeline.InputPipeline` is indexed by step, for resuming; encoding
  only needs an iterator.)
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generator, Iterable, Sequence

import numpy as np
import torch

from .tokens import CHARS_PER_TOKEN, MAX_CHARS_PER_TOKEN, _before_whitespace

__all__ = ["FastTokens", "TokenBlock", "padded_batch", "prefetch", "private_backend", "PROBE_TEXTS"]

#: texts the fast path is checked on: empty, special-token strings, accents and CJK, a text far longer than any max
#: length (truncation, and the long-text head), whitespace runs, emoji
PROBE_TEXTS = ("", "a", "Hello, World!", "[SEP] [CLS] [PAD] [MASK] <s> </s> <pad>", "naïve café déjà vu",
               "東京は日本の首都です", "   spaced   out\t\ttext\n", "emoji 😀 and symbols ∑ ≤ →",
               " ".join(f"word{i} ##piece-{i}" for i in range(400)))

#: below this many texts a block is tokenized on the calling thread (a pool costs more than it saves)
_PARALLEL_MIN = 256


@dataclass
class TokenBlock:
    """Token ids of ``n`` texts, unpadded: row ``i`` is ``ids[offsets[i]:offsets[i] + lengths[i]]``."""

    ids: np.ndarray
    lengths: np.ndarray

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]]) -> "TokenBlock":
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
        return cls(ids, lengths)

    @classmethod
    def concat(cls, blocks: Sequence["TokenBlock"]) -> "TokenBlock":
        if len(blocks) == 1:
            return blocks[0]
        return cls(np.concatenate([b.ids for b in blocks]), np.concatenate([b.lengths for b in blocks]))

    def by_length(self) -> np.ndarray:
        """Row order longest first, ties in input order (the order the old path batched in)."""
        return np.argsort(-self.lengths, kind="stable")


def padded_batch(block: TokenBlock, rows: np.ndarray, pad_id: int, *, multiple: int | None = None,
                 left: bool = False, pin: bool = False) -> dict[str, torch.Tensor]:
    """``tokenizer.pad({"input_ids": rows' ids}, pad_to_multiple_of=multiple, return_tensors="pt")`` in one numpy
    gather: ``input_ids`` padded with ``pad_id`` to the longest row (rounded up to ``multiple``) on the right (or the
    left), and the ``attention_mask``; ``pin``: in page-locked memory (for a non-blocking copy to a GPU)."""
    lengths = block.lengths[rows]
    width = int(lengths.max()) if len(rows) else 0
    if multiple and width % multiple:
        width += multiple - width % multiple
    positions = np.arange(width)
    mask = positions >= (width - lengths)[:, None] if left else positions < lengths[:, None]
    start = block.offsets[rows] - (width - lengths if left else 0)
    index = np.where(mask, start[:, None] + positions, 0)
    input_ids = np.where(mask, block.ids[index] if block.ids.size else 0, pad_id)
    features = {"input_ids": torch.from_numpy(input_ids.astype(np.int64, copy=False)),
                "attention_mask": torch.from_numpy(mask.astype(np.int64))}
    return {k: v.pin_memory() for k, v in features.items()} if pin else features


def private_backend(tokenizer: Any, max_length: int) -> Any:
    """A private copy of ``tokenizer``'s Rust backend that encodes as ``tokenizer(texts, truncation=True,
    max_length=max_length)`` does, unpadded: its truncation side and its way with special-token strings. Private, so
    it can run on another thread while the original is in use (the training collator's and the encoder's)."""
    from tokenizers import Tokenizer

    made = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    made.no_padding()
    made.enable_truncation(max_length, stride=0, strategy="longest_first",
                           direction=getattr(tokenizer, "truncation_side", "right"))
    if hasattr(made, "encode_special_tokens"):
        made.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return made


class FastTokens:
    """``tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]`` (after
    :func:`~robustir.models.tokens.head_texts`) as a :class:`TokenBlock`, from private copies of the Rust backend.

    :meth:`create` returns None for a tokenizer this cannot mirror (slow, or ids that differ on the probe texts):
    the caller then uses the tokenizer call."""

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self.max_length = max_length
        self.backend = private_backend(tokenizer, max_length)
        self.counter = private_backend(tokenizer, 2 * max_length)  # counts a long text's head (no special tokens)

    @classmethod
    def create(cls, tokenizer: Any, max_length: int) -> "FastTokens | None":
        if not getattr(tokenizer, "is_fast", False) or tokenizer.pad_token_id is None:
            return None
        fast = cls(tokenizer, max_length)
        from .tokens import head_texts

        probe = list(PROBE_TEXTS) + [" ".join(["tok"] * (max_length * CHARS_PER_TOKEN))]
        expected = tokenizer(head_texts(tokenizer, probe, max_length), truncation=True, max_length=max_length,
                             padding=False, return_attention_mask=False, return_token_type_ids=False)["input_ids"]
        got = fast.encode(probe, threads=1)
        return fast if np.array_equal(got.ids, TokenBlock.from_lists(expected).ids) and \
            got.lengths.tolist() == [len(e) for e in expected] else None

    def encode(self, texts: Sequence[str], threads: int = 1) -> TokenBlock:
        """The ids of ``texts``; ``threads`` > 1 splits them into that many slices tokenized at once."""
        if threads <= 1 or len(texts) < _PARALLEL_MIN:
            return self._encode(texts)
        size = -(-len(texts) // threads)
        with ThreadPoolExecutor(threads, thread_name_prefix="robustir-tokenize") as pool:
            return TokenBlock.concat(list(pool.map(self._encode, [texts[i:i + size]
                                                                  for i in range(0, len(texts), size)])))

    def _encode(self, texts: Sequence[str]) -> TokenBlock:
        limit = self.max_length * CHARS_PER_TOKEN
        encodings = self.backend.encode_batch_fast([t if len(t) <= limit else "" for t in texts])
        long = [i for i, text in enumerate(texts) if len(text) > limit]
        for i, encoding in zip(long, self._long([texts[i] for i in long])):
            encodings[i] = encoding
        lengths = np.fromiter((len(e) for e in encodings), dtype=np.int64, count=len(encodings))
        ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int64,
                          count=int(lengths.sum()))
        return TokenBlock(ids, lengths)

    def _long(self, texts: Sequence[str]) -> list[Any]:
        """Long texts' encodings from their heads, each head tokenized once (:func:`robustir.models.tokens._head`'s
        search, a batch per head length): the count's encoding becomes the ids through ``post_process``
        (truncation and special tokens), as ``encode`` of the head would make them."""
        length = self.max_length
        cut, cap = length * CHARS_PER_TOKEN, length * MAX_CHARS_PER_TOKEN
        out: list[Any] = [None] * len(texts)
        pending = list(range(len(texts)))
        while pending:
            heads = [(texts[i], True) if cut >= len(texts[i]) else _before_whitespace(texts[i], cut) for i in pending]
            counted = self.counter.encode_batch_fast([head for head, _ in heads], add_special_tokens=False)
            rest = []
            for i, (_, whole_words), encoding in zip(pending, heads, counted):
                if cut >= len(texts[i]) or len(encoding) >= (length if whole_words else 2 * length) or cut >= cap:
                    out[i] = self.backend.post_process(encoding, add_special_tokens=True)
                else:
                    rest.append(i)
            pending, cut = rest, cut * 4
        return out


_DONE = object()


def prefetch(items: Iterable[Any], depth: int) -> Generator[Any, None, None]:
    """``items``, made on a background thread up to ``depth`` ahead (a bounded queue); ``depth`` 0: made here, when
    asked for. An exception raised while making an item is raised here; leaving the loop early stops the thread."""
    if depth <= 0:
        yield from items
        return
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in items:
                if not put((True, item)):
                    return
            put((True, _DONE))
        except BaseException as exc:  # handed to the consumer, raised there
            put((False, exc))

    thread = threading.Thread(target=run, name="robustir-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = ready.get()
            if not ok:
                raise item
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        thread.join()
