"""Issue 54: encoding's input path (robustir.models.batching) gives the old path's vectors, bit for bit.

The old path is kept here as the reference: the tokenizer call into lists of ids (after head_texts), rows sorted
longest first (stable), ``tokenizer.pad`` per batch, a forward per batch, each batch's vectors copied back."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch import nn

from robustir.errors import ConfigError
from robustir.models import batching
from robustir.models.batching import FastTokens, TokenBlock, padded_batch, prefetch
from robustir.models.encoder import Encoder
from robustir.models.tokens import head_texts

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _old_token_ids(encoder, texts, kind, limit, instruction=None):
    texts = head_texts(encoder.tokenizer, encoder.config.with_instruction(texts, kind, instruction), limit)
    return encoder.tokenizer(texts, truncation=True, max_length=limit, padding=False, return_attention_mask=False,
                             return_token_type_ids=False)["input_ids"]


@torch.inference_mode()
def _old_encode_ids(encoder, ids, batch_size, pad_to_multiple_of=None):
    encoder.eval()
    out = np.zeros((len(ids), encoder.dim), dtype=np.float32)
    order = np.argsort([-len(x) for x in ids], kind="stable")
    for b in range(0, len(order), batch_size):
        rows = order[b:b + batch_size]
        batch = encoder.tokenizer.pad({"input_ids": [ids[i] for i in rows]}, return_tensors="pt",
                                      pad_to_multiple_of=pad_to_multiple_of)
        hidden = encoder.transformer(**batch).last_hidden_state
        emb = encoder.pool(hidden.float(), batch["attention_mask"])
        out[rows] = nn.functional.normalize(emb, dim=-1).numpy() if encoder.config.normalize else emb.numpy()
    return out


def _texts():
    """Lengths in every order, ties (the stable sort), an empty text, accents, CJK, and long texts (> 16 chars per
    token of the limit: the head search), one of them a giant word."""
    rng = np.random.default_rng(0)
    words = ["protein", "cell", "naïve", "東京", "the", "of", "tumour", "β-catenin", "x"]
    texts = [" ".join(rng.choice(words, size=int(n))) for n in rng.integers(0, 60, size=37)]
    return texts + ["", "same length", "same length", "word " * 900, "a" * 5000, "cell " * 3 + "z" * 3000]


@pytest.fixture(scope="module")
def encoder(tiny_model_dir):
    return Encoder.from_pretrained(tiny_model_dir, passage_max_length=32, query_max_length=16)


@pytest.mark.parametrize("kind,batch_size", [("passage", 4), ("passage", 64), ("query", 5)])
def test_encode_gives_the_old_paths_vectors_bit_for_bit(encoder, kind, batch_size):
    texts = _texts()
    limit = encoder.config.max_length(kind)
    old = _old_encode_ids(encoder, _old_token_ids(encoder, texts, kind, limit), batch_size)
    new = encoder.encode(texts, kind, batch_size=batch_size)
    assert encoder._fast_tokens[(id(encoder.tokenizer), limit)][1] is not None  # the fast path ran
    np.testing.assert_array_equal(new, old)


def test_encode_with_instruction_threads_and_a_small_block(encoder, monkeypatch):
    """Several blocks (tokenized ahead on the prefetch thread) and several tokenizing threads: same vectors."""
    from robustir.models import encoder as encoder_module

    texts = _texts() * 8  # 344 texts: above the threshold where tokenizing is split across threads
    monkeypatch.setattr(encoder_module, "ENCODE_BLOCK", 100)
    monkeypatch.setattr(batching, "_PARALLEL_MIN", 10)
    limit = encoder.config.passage_max_length
    old = np.concatenate([_old_encode_ids(encoder, _old_token_ids(encoder, texts[s:s + 100], "passage", limit,
                                                                  "passage: "), 8)
                          for s in range(0, len(texts), 100)])
    new = encoder.encode(texts, batch_size=8, instruction="passage: ", tokenize_threads=3)
    np.testing.assert_array_equal(new, old)


@pytest.mark.parametrize("multiple,side", [(None, "right"), (16, "right"), (None, "left"), (8, "left")])
def test_encode_ids_gives_the_old_paths_vectors(encoder, multiple, side, monkeypatch):
    monkeypatch.setattr(encoder.tokenizer, "padding_side", side)
    ids = _old_token_ids(encoder, _texts(), "passage", 32)
    new = encoder.encode_ids(ids, batch_size=6, pad_to_multiple_of=multiple)
    np.testing.assert_array_equal(new, _old_encode_ids(encoder, ids, 6, multiple))


@pytest.mark.parametrize("multiple,side", [(None, "right"), (16, "right"), (None, "left"), (8, "left")])
def test_padded_batch_is_tokenizer_pad(encoder, multiple, side, monkeypatch):
    monkeypatch.setattr(encoder.tokenizer, "padding_side", side)
    ids = _old_token_ids(encoder, _texts(), "passage", 32)
    block = TokenBlock.from_lists(ids)
    rows = block.by_length()[3:11]
    got = padded_batch(block, rows, encoder.tokenizer.pad_token_id, multiple=multiple, left=side == "left")
    want = encoder.tokenizer.pad({"input_ids": [ids[i] for i in rows]}, return_tensors="pt",
                                 pad_to_multiple_of=multiple)
    assert list(got) == ["input_ids", "attention_mask"]
    for key in got:
        assert torch.equal(got[key], want[key]), key


def test_by_length_is_longest_first_ties_in_input_order():
    block = TokenBlock.from_lists([[1, 2], [1, 2, 3], [4, 5], [6], [7, 8, 9]])
    assert block.by_length().tolist() == [1, 4, 0, 2, 3]
    assert block.offsets.tolist() == [0, 2, 5, 7, 8]


@pytest.mark.parametrize("kind", ["wordpiece", "unigram", "byte-bpe"])
def test_fast_tokens_give_the_tokenizer_calls_ids_on_long_texts(kind, minilm_path):
    from transformers import AutoTokenizer

    from test_encoder import _byte_level_bpe, _long_texts

    if kind == "wordpiece":
        tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    elif kind == "unigram":
        from test_gur_t5 import build_tokenizer

        tokenizer = build_tokenizer()
    else:
        tokenizer = _byte_level_bpe()
    texts = _long_texts() + ["short one", ""]
    for max_length in (16, 64):
        want = tokenizer(head_texts(tokenizer, texts, max_length), truncation=True, max_length=max_length)["input_ids"]
        got = FastTokens(tokenizer, max_length).encode(texts)
        assert got.lengths.tolist() == [len(w) for w in want]
        assert got.ids.tolist() == [i for w in want for i in w]


def test_a_long_text_is_tokenized_once_and_only_its_head(encoder):
    """The old path tokenized a long text's head to count it, then the head again for its ids."""
    fast = FastTokens.create(encoder.tokenizer, 32)
    calls: list[tuple[str, int]] = []

    class Spy:
        def __init__(self, name, real):
            self.name, self.real = name, real

        def __getattr__(self, attr):
            method = getattr(self.real, attr)

            def call(arg, *args, **kwargs):
                texts = [arg] if isinstance(arg, str) else arg if isinstance(arg, list) else []
                calls.extend((f"{self.name}.{attr}", len(t)) for t in texts)
                return method(arg, *args, **kwargs)
            return call

    fast.backend, fast.counter = Spy("backend", fast.backend), Spy("counter", fast.counter)
    long = "aspirin " * 100_000
    block = fast.encode([long, "short"])
    tokenized = [(name, size) for name, size in calls if size > 0]
    assert [name for name, _ in tokenized] == ["backend.encode_batch_fast", "counter.encode_batch_fast"], tokenized
    assert tokenized[0][1] == len("short") and 0 < tokenized[1][1] <= 32 * 16  # the head alone, counted once
    assert block.lengths.tolist() == [32, 3]


def test_a_tokenizer_the_fast_path_cannot_mirror_uses_the_tokenizer_call(encoder, monkeypatch):
    monkeypatch.setattr(FastTokens, "create", classmethod(lambda cls, tokenizer, length: None))
    fresh = Encoder(encoder.transformer, encoder.tokenizer, encoder.config)
    texts = _texts()
    np.testing.assert_array_equal(fresh.encode(texts, batch_size=4),
                                  _old_encode_ids(encoder, _old_token_ids(encoder, texts, "passage", 32), 4))
    assert fresh._fast_tokens == {(id(encoder.tokenizer), 32): (encoder.tokenizer, None)}


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_tokenize_threads_is_a_clear_error(encoder, value):
    with pytest.raises(ConfigError, match="tokenize_threads"):
        encoder.encode(["a"], tokenize_threads=value)


def test_prefetch_keeps_order_and_raises_the_producers_error():
    assert list(prefetch(iter(range(50)), depth=3)) == list(range(50))
    assert list(prefetch(iter(range(5)), depth=0)) == list(range(5))

    def failing():
        yield 1
        raise ValueError("bad batch")

    seen = []
    with pytest.raises(ValueError, match="bad batch"):
        for item in prefetch(failing(), depth=2):
            seen.append(item)
    assert seen == [1]


def test_prefetch_stops_its_thread_when_the_consumer_leaves_early():
    made = []

    def endless():
        i = 0
        while True:
            made.append(i)
            yield i
            i += 1

    before = threading.active_count()
    items = prefetch(endless(), depth=2)
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    items.close()  # what leaving a for loop early does
    assert threading.active_count() == before
    assert len(made) <= 3 + 2 + 1  # at most depth ahead (+ the one waiting to be queued)


def test_a_model_error_stops_the_batching_thread_at_once(encoder, monkeypatch):
    """The prefetch thread is stopped in encode's ``finally``, not when the traceback is collected."""
    calls = []

    def broken(**features):
        calls.append(1)
        raise RuntimeError("device lost")

    monkeypatch.setattr(encoder, "_inference_transformer", lambda precision: broken)
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="device lost") as caught:
        encoder.encode(_texts() * 4, batch_size=2)
    assert calls == [1] and threading.active_count() == before, caught
