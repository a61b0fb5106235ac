"""The encoder: pooling, normalisation, order-preserving sorted batching, caching, and the
sentence-transformers round trip (SentenceTransformer(path) must give the same embeddings)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from robustir.errors import ConfigError
from robustir.models.encoder import Encoder

TEXTS = ["short", "a somewhat longer sentence about retrieval models", "x y z",
         "Chinese text works too: 这是一个测试句子。", "the last one, of medium length here"]


def test_order_preserved_and_matches_single(tiny_model_dir):
    enc = Encoder.from_pretrained(tiny_model_dir, pooling="mean")
    batched = enc.encode(TEXTS, batch_size=2)
    single = np.stack([enc.encode([t])[0] for t in TEXTS])
    np.testing.assert_allclose(batched, single, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)


def test_cls_pooling_and_no_normalize(tiny_model_dir):
    enc = Encoder.from_pretrained(tiny_model_dir, pooling="cls", normalize=False)
    features = enc.tokenize(TEXTS[:2], "passage")
    with torch.no_grad():
        hidden = enc.transformer(**features).last_hidden_state
    np.testing.assert_allclose(enc.encode(TEXTS[:2]), hidden[:, 0].numpy(), atol=1e-5)


def test_query_instruction_and_lengths(tiny_model_dir):
    enc = Encoder.from_pretrained(tiny_model_dir, query_instruction="query: ", query_max_length=4)
    q = enc.encode(["hello world and more words"], "query")
    manual = enc.encode(["query: hello world and more words"], "passage", max_length=4, instruction="")
    np.testing.assert_allclose(q, manual, atol=1e-6)
    assert enc.tokenize(["a b c d e f g"], "query")["input_ids"].shape[1] == 4


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_sentence_transformers_roundtrip_tiny(tiny_model_dir, tmp_path, pooling):
    from sentence_transformers import SentenceTransformer

    enc = Encoder.from_pretrained(tiny_model_dir, pooling=pooling, query_instruction="Represent this query: ",
                                  passage_max_length=32)
    out = enc.save(tmp_path / "model", model_card="# card")
    st = SentenceTransformer(str(out), device="cpu")
    assert st.max_seq_length == 32
    np.testing.assert_allclose(st.encode(TEXTS), enc.encode(TEXTS), atol=1e-5)
    np.testing.assert_allclose(st.encode(TEXTS, prompt_name="query"), enc.encode(TEXTS, "query"), atol=1e-5)
    again = Encoder.from_pretrained(out)
    assert again.config == enc.config
    assert (out / "README.md").read_text() == "# card"


def test_sentence_transformers_roundtrip_real_model(minilm_path, tmp_path):
    from sentence_transformers import SentenceTransformer

    enc = Encoder.from_pretrained(minilm_path)
    assert enc.config.pooling == "mean" and enc.config.normalize  # read from the ST folder
    out = enc.save(tmp_path / "minilm")
    ours = enc.encode(TEXTS)
    np.testing.assert_allclose(SentenceTransformer(str(out), device="cpu").encode(TEXTS), ours, atol=1e-5)
    np.testing.assert_allclose(SentenceTransformer(minilm_path, device="cpu").encode(TEXTS), ours, atol=1e-5)


def test_bf16_agrees_with_fp32(minilm_path):
    enc = Encoder.from_pretrained(minilm_path)
    fp32 = enc.encode(TEXTS * 4)
    bf16 = enc.encode(TEXTS * 4, bf16=True)
    assert (fp32 * bf16).sum(1).min() > 0.995


def test_corpus_cache(tiny_model_dir, tmp_path):
    enc = Encoder.from_pretrained(tiny_model_dir)
    first = enc.encode_corpus(TEXTS, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.npy"))) == 1
    second = enc.encode_corpus(TEXTS, cache_dir=tmp_path)
    np.testing.assert_array_equal(first, second)
    with torch.no_grad():  # changed weights -> new key, never a stale cache hit
        next(enc.transformer.parameters()).add_(0.1)
    enc.encode_corpus(TEXTS, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.npy"))) == 2


def test_clear_errors(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="not a local folder and could not be fetched"):
        Encoder.from_pretrained("no-such-org/no-such-model-xyz")
    with pytest.raises(ConfigError, match="unknown encoder option"):
        Encoder.from_pretrained(tiny_model_dir, poolin="cls")
    with pytest.raises(ConfigError, match="pooling"):
        Encoder.from_pretrained(tiny_model_dir, pooling="max")


def test_training_forward_matches_encode(tiny_model_dir):
    enc = Encoder.from_pretrained(tiny_model_dir, pooling="mean")
    enc.eval()
    with torch.no_grad():
        emb = enc(enc.tokenize(TEXTS, "passage")).numpy()
    np.testing.assert_allclose(emb, enc.encode(TEXTS), atol=1e-5)


def test_bf16_copy_follows_weight_updates(tiny_model_dir):
    enc = Encoder.from_pretrained(tiny_model_dir)
    first = enc.encode(TEXTS, bf16=True)
    copy_before = enc._half_cache[1]
    assert enc.encode(TEXTS, bf16=True) is not None and enc._half_cache[1] is copy_before  # reused
    assert not any("bf16" in k for k in enc.state_dict())  # the copy is not part of the model
    with torch.no_grad():
        for p in enc.transformer.parameters():
            p.mul_(1.5)
    second = enc.encode(TEXTS, bf16=True)
    assert enc._half_cache[1] is not copy_before
    assert not np.allclose(first, second, atol=1e-3)
    np.testing.assert_allclose(second, enc.encode(TEXTS), atol=0.05)


def test_with_instruction_is_the_one_rule_for_instructions():
    from robustir.models.encoder import EncoderConfig

    config = EncoderConfig(query_instruction="query: ", passage_instruction="passage: ")
    assert config.with_instruction(["a", "b"], "query") == ["query: a", "query: b"]
    assert config.with_instruction(["a"], "passage") == ["passage: a"]
    assert config.with_instruction(["a"], "query", None) == ["query: a"]  # None: the config's own
    assert config.with_instruction(["a"], "query", "") == ["a"]  # "": none, even where the config has one
    assert config.with_instruction(["a"], "passage", "topic: ") == ["topic: a"]  # given: replaces the config's
    assert config.with_instruction(iter(["a"]), "query") == ["query: a"]  # any iterable; a list comes back
    plain = EncoderConfig()  # empty instructions: the texts unchanged
    assert plain.with_instruction(["a"], "query") == ["a"] and plain.with_instruction(["a"], "passage") == ["a"]
    assert plain.with_instruction([], "query") == []


def test_every_path_that_adds_an_instruction_goes_through_with_instruction(tiny_model_dir, tmp_path, monkeypatch):
    """Encoding, the training batches (reference collate and Collator) and the ST baseline's rows all prefix through
    ``EncoderConfig.with_instruction``: one replaced by a marker shows up in each."""
    import json

    from robustir.models.encoder import EncoderConfig
    from robustir.robustness.sidebyside import _st_dataset
    from robustir.training.data import Collator, Group, collate

    enc = Encoder.from_pretrained(tiny_model_dir, query_instruction="query: ")
    reference = enc.encode(["marker hello"], "passage")
    original = EncoderConfig.with_instruction
    monkeypatch.setattr(EncoderConfig, "with_instruction",
                        lambda self, texts, kind, instruction=None: ["marker " + t for t in
                                                                     original(self, texts, kind, instruction)])
    decode = enc.tokenizer.decode
    assert decode(enc.tokenize(["hello"], "query")["input_ids"][0], skip_special_tokens=True) == "marker query : hello"
    np.testing.assert_allclose(enc.encode(["hello"], "passage"), reference, atol=1e-6)

    groups = [Group("what", None, ["yes", "no"]), Group("who", "own: ", ["me", "you"], passage_prompt="p: ")]
    for q, p, *_ in (collate(groups, enc, 16, 16), Collator.for_encoder(enc, 16, 16)(groups)):
        assert [decode(x, skip_special_tokens=True) for x in q["input_ids"]] == ["marker query : what",
                                                                                  "marker own : who"]
        assert [decode(x, skip_special_tokens=True) for x in p["input_ids"]] == ["marker yes", "marker no",
                                                                                  "marker p : me", "marker p : you"]

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"query": "q", "pos": ["p"], "neg": ["n"], "prompt": "own: "}) + "\n")
    assert _st_dataset(rows, 1)["anchor"] == ["marker own: q"]


def test_fingerprint_is_the_same_at_every_load_of_a_folder_without_pooler_weights(tiny_model_dir):
    """The tiny folder is a masked-LM checkpoint: its pooler is initialised at random on every load. The encoder
    never uses it, so the embedding-cache key must not depend on it (it did: no cache was ever reused)."""
    from robustir.models.encoder import Encoder

    first, second = Encoder.from_pretrained(tiny_model_dir), Encoder.from_pretrained(tiny_model_dir)
    assert not torch.equal(first.transformer.pooler.dense.weight, second.transformer.pooler.dense.weight)
    assert first.fingerprint() == second.fingerprint()
    changed = Encoder.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        changed.transformer.embeddings.word_embeddings.weight[5] += 1.0
    assert changed.fingerprint() != first.fingerprint()



def test_fingerprint_does_not_depend_on_the_thread_count():
    """The embedding-cache key of the bundled model is the same with 1 and 2 torch threads (it was not: torch's
    parallel sums round with the thread count, so another machine or OMP setting silently re-encoded a corpus)."""
    from robustir.resources import default_model_path

    encoder, threads = Encoder.from_pretrained(default_model_path()), torch.get_num_threads()
    try:
        keys = []
        for n in (1, 2):
            torch.set_num_threads(n)
            keys.append(encoder.fingerprint())
    finally:
        torch.set_num_threads(threads)
    assert keys[0] == keys[1]

def _long_texts() -> list[str]:
    """Texts far past any cut: prose, whitespace runs and tabs, long 'words' (base64-like, URLs), CJK without spaces,
    one giant word, accents and emoji, a text just past the untouched length."""
    import random

    rng = random.Random(0)
    words = "the retrieval of dense passages naïve café 東京 emoji 😀 chloroplast photosynthesis".split()
    prose = " ".join(rng.choice(words) for _ in range(6000))
    return [prose, "  \t".join(rng.choice(words) for _ in range(5000)) + "\n\n",
            " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789+/") for _ in range(rng.randint(90, 400)))
                     for _ in range(600)),
            "東京は日本の首都です" * 3000, "x" * 300_000, "word " * 820, "a" * 4100 + " tail"]


def _byte_level_bpe():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(_long_texts()[:2], trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<s>")


@pytest.mark.parametrize("kind", ["wordpiece", "unigram", "byte-bpe"])
def test_long_texts_are_cut_before_tokenizing_to_the_same_ids(kind, minilm_path):
    """Issue 35: whole texts were tokenized before the cut (100-120 bytes of RAM per byte of text). The tokenizer now
    sees a bounded head, and the ids are those of the whole text."""
    from transformers import AutoTokenizer

    from robustir.models.tokens import CHARS_PER_TOKEN, MAX_CHARS_PER_TOKEN, head_texts

    if kind == "wordpiece":
        tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    elif kind == "unigram":
        from test_gur_t5 import build_tokenizer

        tokenizer = build_tokenizer()
    else:
        tokenizer = _byte_level_bpe()
    texts = _long_texts()
    for max_length in (16, 64, 256):
        heads = head_texts(tokenizer, texts, max_length)
        assert all(len(h) <= max(max_length * MAX_CHARS_PER_TOKEN, max_length * CHARS_PER_TOKEN) for h in heads)
        assert len(heads[0]) <= max_length * CHARS_PER_TOKEN  # prose: one head, no growth
        whole = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
        cut = tokenizer(heads, truncation=True, max_length=max_length)["input_ids"]
        assert cut == whole, [i for i, (a, b) in enumerate(zip(cut, whole)) if a != b]


def test_the_encoder_tokenizer_never_sees_a_whole_long_text(tiny_model_dir):
    """The encoder's paths (encode, the server's token_ids, the training forward's tokenize) hand the tokenizer a
    bounded head: a spy records the longest text it was given (8 MB before)."""
    encoder = Encoder.from_pretrained(tiny_model_dir, passage_max_length=32, query_max_length=16)
    seen = []
    real = encoder.tokenizer.__class__.__call__

    def spy(self, text, *args, **kwargs):
        seen.append(max(len(t) for t in ([text] if isinstance(text, str) else text)))
        return real(self, text, *args, **kwargs)

    long = "aspirin " * 1_000_000  # 8 MB
    import unittest.mock as mock

    with mock.patch.object(encoder.tokenizer.__class__, "__call__", spy):
        vector = encoder.encode([long, "short"], "passage")
        encoder.token_ids([long], "query")
        encoder.tokenize([long], "passage")
    assert seen and max(seen) <= 32 * 1024, max(seen)
    np.testing.assert_allclose(vector[0], encoder.encode(["aspirin " * 40], "passage")[0], atol=1e-6)


def test_encode_ids_pads_to_a_multiple_and_gives_the_same_vectors(tiny_model_dir):
    """Issue 35: the server pads each forward pass to a multiple of 16 tokens (a bounded set of shapes keeps its
    memory flat); the vectors are those of padding to the longest text (fp32)."""
    encoder = Encoder.from_pretrained(tiny_model_dir)
    ids = encoder.token_ids(["a", "a longer text about retrieval", "x " * 40, "mid length text here"], "passage")
    shapes = []
    hook = encoder.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    padded = encoder.encode_ids(ids, batch_size=2, pad_to_multiple_of=16)
    hook.remove()
    assert shapes and all(length % 16 == 0 for _, length in shapes), shapes
    np.testing.assert_allclose(padded, encoder.encode_ids(ids, batch_size=2), atol=1e-5)


def test_cutting_long_texts_says_nothing_about_sequence_lengths(minilm_path):
    """Counting a head's tokens must not make transformers warn that a sequence is 'longer than the specified
    maximum sequence length ... indexing errors' (the head is only counted, never fed to the model)."""
    import logging

    from transformers import AutoTokenizer

    from robustir.models.tokens import head_texts

    class Keep(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)  # a fresh one: transformers warns once per tokenizer
    keep = Keep()
    logger = logging.getLogger("transformers")  # its own handler, not propagated to the root logger
    logger.addHandler(keep)
    try:
        head_texts(tokenizer, ["word " * 5000], 256)
    finally:
        logger.removeHandler(keep)
    assert not any("longer than the specified maximum" in m for m in keep.messages), keep.messages
