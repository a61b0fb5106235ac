"""Pre-training pieces: masking statistics, RetroMAE / GUR collators and models, save + reload."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from robustir.pretraining.masking import (
    SpanMasker,
    maskable_positions,
    replace_masked_tokens,
    span_length_probabilities,
    whole_word_mask,
    word_groups,
)
from robustir.pretraining.gur import GURCollator, GURModel
from robustir.errors import ConfigError
from robustir.losses import ContrastiveBatch
from robustir.pretraining.retromae import RetroMAECollator, RetroMAEModel

SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the riverbank.",
    "Unbelievably, photosynthesis converts electromagnetic radiation into chemical energy.",
    "Retrieval models encode queries and passages into dense vectors.",
    "A cat is chasing a mouse around the kitchen table.",
    "Hydroxychloroquine was evaluated in randomized controlled trials.",
    "Transformers use self-attention to contextualize every token.",
]
PAIRS = [
    ("a cat is chasing a mouse", "the cat is chasing the dog in the garden"),
    ("dense retrieval encodes passages", "passages are encoded by dense retrieval models"),
    ("photosynthesis happens in chloroplasts", "chloroplasts host photosynthesis in plant cells"),
    ("the river floods every spring", "every spring the river floods the valley"),
]
WORDS = (
    "the a of retrieval unbelievably photosynthesis hydroxychloroquine cat mouse dense vector passage "
    "query electromagnetic randomized kitchen riverbank contextualize model token encode"
).split()


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(4, 30))) for _ in range(n)]


def quiet_load(cls, *args, **kwargs):
    """Load a model with transformers' load report silenced (tiny checkpoints are complete anyway)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return cls.from_pretrained(*args, **kwargs)
    finally:
        transformers.logging.set_verbosity(verbosity)


# ----------------------------------------------------------------------------------------------------
# masking.py
# ----------------------------------------------------------------------------------------------------


def test_span_length_probabilities_match_notes():
    probs = span_length_probabilities(0.66, 3, 10)
    expected = [0.111, 0.168, 0.254, 0.168, 0.111, 0.073, 0.048, 0.032, 0.021, 0.014]
    np.testing.assert_allclose(probs, expected, atol=1.5e-3)
    assert SpanMasker().expected_span_length == pytest.approx(3.795, abs=1e-3)


def test_whole_word_mask_rate_words_and_specials(tokenizer):
    rng = np.random.default_rng(0)
    masked = tokens = 0
    for text in random_texts(400):
        enc = tokenizer(text)
        ids = np.asarray(enc["input_ids"])
        mask = whole_word_mask(ids, tokenizer, 0.3, rng, word_ids=enc.word_ids())
        assert not mask[0] and not mask[-1]  # [CLS], [SEP]
        # Whole words: every word is either fully selected or not at all.
        for group in word_groups(ids, tokenizer):
            assert mask[group].all() or not mask[group].any()
        # Never more than the budget round(n * p) (HF rule counts [CLS]/[SEP] in n).
        assert mask.sum() <= max(1, round(len(ids) * 0.3))
        masked += mask.sum()
        tokens += len(ids)
    assert masked / tokens == pytest.approx(0.3, abs=0.015)


def test_word_groups_follow_wordpiece_continuations(tokenizer):
    ids = tokenizer("unbelievably hydroxychloroquine cat")["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    groups = word_groups(ids, tokenizer)
    assert len(groups) == 3
    assert all(not tokens[g[0]].startswith("##") for g in groups)
    assert all(tokens[i].startswith("##") for g in groups for i in g[1:])
    # The fast tokenizer's word_ids give the same words.
    enc = tokenizer("unbelievably hydroxychloroquine cat")
    assert [g.tolist() for g in word_groups(ids, tokenizer, word_ids=enc.word_ids())] == [g.tolist() for g in groups]


def test_replace_masked_tokens_80_10_10(tokenizer):
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 20000, size=200_000)
    mask = rng.random(ids.shape) < 0.5
    inputs, labels = replace_masked_tokens(ids, mask, tokenizer, rng)
    assert (labels[~mask] == -100).all() and (labels[mask] == ids[mask]).all()
    assert (inputs[~mask] == ids[~mask]).all()
    sel_in, sel_ids = inputs[mask], ids[mask]
    frac_mask = (sel_in == tokenizer.mask_token_id).mean()
    frac_keep = (sel_in == sel_ids).mean()
    frac_random = 1 - frac_mask - frac_keep
    assert frac_mask == pytest.approx(0.8, abs=0.01)
    assert frac_keep == pytest.approx(0.1, abs=0.01)
    assert frac_random == pytest.approx(0.1, abs=0.01)


def _runs(mask: np.ndarray) -> list[int]:
    padded = np.concatenate([[0], mask.astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(padded))
    return list(edges[1::2] - edges[0::2])


def test_span_masker_lengths_and_rate():
    masker = SpanMasker()  # 0.15, p=0.66, mode 3, max 10
    rng = np.random.default_rng(0)
    lengths: list[int] = []
    masked = maskable_total = 0
    for _ in range(300):
        maskable = np.ones(1000, dtype=bool)
        maskable[[0, 400, 999]] = False  # specials, one in the middle splits the sequence in two runs
        mask = masker(maskable, rng)
        assert not mask[~maskable].any()
        lengths += _runs(mask)
        masked += mask.sum()
        maskable_total += maskable.sum()
    counts = np.bincount(lengths, minlength=11)[1:11]
    assert len(lengths) > 10_000 and max(lengths) <= 10
    empirical = counts / counts.sum()
    assert np.abs(empirical - masker.probs).max() < 0.01
    assert masked / maskable_total == pytest.approx(0.15, abs=0.003)


def test_span_masker_short_sentences_rate_and_determinism(tokenizer):
    masker = SpanMasker()
    texts = random_texts(500, seed=1)
    masks_a, masks_b = [], []
    for seed, out in ((0, masks_a), (0, masks_b)):
        rng = np.random.default_rng(seed)
        for text in texts:
            ids = tokenizer(text)["input_ids"]
            out.append(masker(maskable_positions(ids, tokenizer), rng))
    assert all((a == b).all() for a, b in zip(masks_a, masks_b))
    assert not any(m[0] or m[-1] for m in masks_a)
    fraction = sum(m.sum() for m in masks_a) / sum(len(m) - 2 for m in masks_a)
    assert fraction == pytest.approx(0.15, abs=0.02)  # short runs round the last span's length


def test_span_masker_authors_ratio_range():
    masker = SpanMasker(mask_ratio_range=(0.10, 0.29))
    rng = np.random.default_rng(0)
    ratios = {masker.sample_ratio(rng) for _ in range(2000)}
    assert ratios == {round(0.10 + 0.01 * k, 2) for k in range(20)}
    mask = np.concatenate([masker(np.ones(2000, dtype=bool), rng) for _ in range(300)])
    assert mask.mean() == pytest.approx(0.195, abs=0.01)


# ----------------------------------------------------------------------------------------------------
# RetroMAE
# ----------------------------------------------------------------------------------------------------


def test_retromae_collator_fields(tokenizer):
    collator = RetroMAECollator(tokenizer, max_length=32, seed=0)
    batch = collator(SENTENCES[:3] + [{"text": "short"}])
    ids, attention = batch["decoder_input_ids"], batch["encoder_attention_mask"]
    expected = tokenizer(SENTENCES[:3] + ["short"], truncation=True, max_length=32, padding=True, return_tensors="pt")
    assert torch.equal(ids, expected["input_ids"]) and torch.equal(attention, expected["attention_mask"])
    special = torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
    dec_labels = batch["decoder_labels"]
    assert torch.equal(dec_labels[~special], ids[~special]) and (dec_labels[special] == -100).all()
    enc_labels = batch["encoder_labels"]
    selected = enc_labels != -100
    assert not selected[special].any()
    assert torch.equal(enc_labels[selected], ids[selected])
    assert torch.equal(batch["encoder_input_ids"][~selected], ids[~selected])
    # Same seed, same batch.
    again = RetroMAECollator(tokenizer, max_length=32, seed=0)(SENTENCES[:3] + [{"text": "short"}])
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    # Pre-tokenised input (original repository format) gives the same ids.
    pre = collator([{"token_ids": tokenizer(SENTENCES[0], add_special_tokens=False)["input_ids"]}])
    assert torch.equal(pre["decoder_input_ids"][0], ids[0, : pre["decoder_input_ids"].shape[1]])


def test_retromae_encoder_mask_rate(tokenizer):
    collator = RetroMAECollator(tokenizer, max_length=64, seed=1)
    batch = collator(random_texts(300, seed=2))
    selected = (batch["encoder_labels"] != -100).sum().item()
    tokens = batch["encoder_attention_mask"].sum().item()
    assert selected / tokens == pytest.approx(0.3, abs=0.015)
    inputs = batch["encoder_input_ids"][batch["encoder_labels"] != -100]
    originals = batch["decoder_input_ids"][batch["encoder_labels"] != -100]
    assert (inputs == tokenizer.mask_token_id).float().mean().item() == pytest.approx(0.8, abs=0.04)
    assert (inputs == originals).float().mean().item() == pytest.approx(0.1, abs=0.03)


def test_retromae_decoder_attention_structure(tokenizer):
    collator = RetroMAECollator(tokenizer, max_length=64, seed=0)
    texts = random_texts(60, seed=3)
    batch = collator(texts)
    visible = batch["decoder_attention_mask"]
    lengths = batch["encoder_attention_mask"].sum(1)
    hidden_fraction = []
    for b, n in enumerate(lengths.tolist()):
        v = visible[b]
        assert not v[n:].any() and not v[:, n:].any()  # padding hidden (rows and columns)
        assert not torch.diagonal(v)[:n].any()  # row i never sees position i
        assert v[1:n, 0].all()  # h (slot 0) visible for every other row
        assert v[:n, n - 1][: n - 1].all()  # [SEP] is never in a sampled word mask
        ids = batch["decoder_input_ids"][b, :n].numpy()
        groups = word_groups(ids, tokenizer)
        for i in range(n):
            row_hidden = ~v[i, :n].numpy()
            row_hidden[i] = False
            for group in groups:  # the sampled mask is whole-word (the row's own word may be cut by i)
                if i in group:
                    continue
                assert row_hidden[group].all() or not row_hidden[group].any()
            hidden_fraction.append(row_hidden.sum() / n)
    # HF rule: round(n * 0.5) tokens (n counts [CLS]/[SEP]) per sampled mask, plus the row itself.
    assert np.mean(hidden_fraction) == pytest.approx(0.5, abs=0.03)


def test_retromae_decoder_mask_is_functional(tiny_model_dir, tokenizer):
    """Changing a token that row i must not see leaves row i's decoder output unchanged."""
    torch.manual_seed(0)
    model = quiet_load(RetroMAEModel, tiny_model_dir).eval()
    batch = RetroMAECollator(tokenizer, max_length=32, seed=0)(SENTENCES[:2])
    h = torch.randn(2, model.encoder.config.hidden_size)
    ids, visible = batch["decoder_input_ids"], batch["decoder_attention_mask"]
    with torch.no_grad():
        reference = model.decode(h, ids, visible)
        n = int(batch["encoder_attention_mask"][0].sum())
        for i in range(1, n - 1):
            hidden_cols = [j for j in range(1, n) if not visible[0, i, j]]
            visible_cols = [j for j in range(1, n) if visible[0, i, j]]
            assert i in hidden_cols
            changed = ids.clone()
            changed[0, hidden_cols] = tokenizer.convert_tokens_to_ids("zebra")
            out = model.decode(h, changed, visible)
            torch.testing.assert_close(out[0, i], reference[0, i], rtol=0, atol=1e-6)
            if visible_cols:  # sanity: a visible token does change row i
                changed = ids.clone()
                changed[0, visible_cols[0]] = tokenizer.convert_tokens_to_ids("zebra")
                assert not torch.allclose(model.decode(h, changed, visible)[0, i], reference[0, i])
        # Row 0 of the other example is untouched by edits in example 0.
        torch.testing.assert_close(out[1], reference[1])


def _train(model: torch.nn.Module, batch: dict, steps: int = 30, lr: float = 1e-2) -> list[dict]:
    """AdamW steps on one fixed batch. Dropout is off (eval mode; gradients still flow) so the loss curve
    is deterministic: with dropout, CLS vectors of a random 2-layer BERT need ~40 noisy steps to separate."""
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.eval()
    history = []
    for _ in range(steps):
        out = model(**batch)
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
        history.append({k: float(v.detach()) for k, v in out.items()})
    return history


def test_retromae_losses_decrease(tiny_model_dir, tokenizer):
    torch.manual_seed(0)
    model = quiet_load(RetroMAEModel, tiny_model_dir)
    batch = RetroMAECollator(tokenizer, max_length=32, seed=0)(SENTENCES)
    history = _train(model, batch)
    for key in ("loss", "encoder_mlm_loss", "decoder_loss"):
        assert np.mean([h[key] for h in history[-3:]]) < 0.8 * history[0][key], key
    assert history[0]["loss"] == pytest.approx(history[0]["encoder_mlm_loss"] + history[0]["decoder_loss"], rel=1e-5)


def test_retromae_save_reload(tiny_model_dir, tokenizer, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    torch.manual_seed(0)
    model = quiet_load(RetroMAEModel, tiny_model_dir, encoder_loss_weight=0.5)
    batch = RetroMAECollator(tokenizer, max_length=32, seed=0)(SENTENCES)
    _train(model, batch, steps=3)  # move away from the initial weights
    model.eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "encoder" / "tokenizer.json").exists()

    encoded = tokenizer(SENTENCES[:3], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = model.encoder.base_model(**encoded).last_hidden_state
        hf = quiet_load(AutoModel, tmp_path / "encoder").eval()
        torch.testing.assert_close(hf(**encoded).last_hidden_state, expected, rtol=1e-5, atol=1e-5)
        st = SentenceTransformer(str(tmp_path / "encoder"), device="cpu")
        torch.testing.assert_close(
            st.encode(SENTENCES[:3], convert_to_tensor=True), model.encode(**encoded), rtol=1e-5, atol=1e-5
        )

        reloaded = quiet_load(RetroMAEModel, tmp_path / "encoder", tmp_path / "decoder_head").eval()
        assert reloaded.encoder_loss_weight == 0.5
        before, after = model(**batch), reloaded(**batch)
        for key in ("loss", "encoder_mlm_loss", "decoder_loss"):
            torch.testing.assert_close(after[key], before[key], rtol=1e-5, atol=1e-5)
    _train(reloaded, batch, steps=2)  # continues training


def test_retromae_loads_sentence_transformers_minilm(minilm_path, tokenizer):
    """MiniLM ships no MLM head: it is created, initialised like BERT and tied to the word embeddings."""
    model = quiet_load(RetroMAEModel, minilm_path)
    head = model.encoder.cls.predictions
    assert head.decoder.weight is model.encoder.base_model.embeddings.word_embeddings.weight
    assert float(head.bias.detach().abs().max()) == 0.0
    assert float(head.transform.dense.weight.detach().std()) == pytest.approx(0.02, abs=0.003)
    batch = RetroMAECollator(tokenizer, max_length=32, seed=0)(SENTENCES[:2])
    with torch.no_grad():
        out = model.eval()(**batch)
    assert torch.isfinite(out["loss"])


# ----------------------------------------------------------------------------------------------------
# GUR
# ----------------------------------------------------------------------------------------------------


def test_gur_collator_layout_and_labels(tokenizer):
    collator = GURCollator(tokenizer, max_length=32, masker=SpanMasker(mask_ratio=0.3), seed=0)
    batch = collator(PAIRS[:2] + [{"a": "short text", "b": "another short text"}])
    texts = [t for pair in PAIRS[:2] for t in pair] + ["short text", "another short text"]
    expected = tokenizer(texts, truncation=True, max_length=32, padding=True, return_tensors="pt")
    assert torch.equal(batch["attention_mask"], expected["attention_mask"])
    labels, ids = batch["labels"], expected["input_ids"]
    selected = labels != -100
    assert selected.any()
    assert torch.equal(labels[selected], ids[selected])
    assert (batch["input_ids"][selected] == tokenizer.mask_token_id).all()
    assert torch.equal(batch["input_ids"][~selected], ids[~selected])
    special = torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
    assert not selected[special].any()


def test_gur_contrastive_loss_hand_computed(tiny_model_dir):
    """GUR's contrastive term (GURModel.contrastive_loss: symmetric InfoNCELoss) on a_k vs b_k."""
    import math

    def symmetric_ce(logits: list[list[float]]) -> float:  # (CE over rows + CE over columns) / 2
        n = len(logits)
        rows = sum(math.log(sum(math.exp(x) for x in logits[i])) - logits[i][i] for i in range(n)) / n
        cols = sum(math.log(sum(math.exp(logits[k][j]) for k in range(n))) - logits[j][j] for j in range(n)) / n
        return (rows + cols) / 2

    def contrastive(similarity: str):
        loss = quiet_load(GURModel, tiny_model_dir, similarity=similarity).contrastive_loss()
        assert loss.config() == {"name": "infonce", "temperature": 0.1, "in_batch_negatives": True,
                                 "symmetric": True, "similarity": similarity, "denominator": "standard",
                                 "false_negative_margin": None}
        return loss(ContrastiveBatch.from_groups(a, b))

    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    b = torch.tensor([[1.0, 0.0], [2.0, 1.0]])
    # dot / 0.1: a @ b.T = [[1, 2], [0, 1]]
    out = contrastive("dot")
    assert float(out.loss) == pytest.approx(symmetric_ce([[10.0, 20.0], [0.0, 10.0]]), rel=1e-6)
    assert out.components["accuracy"] == 0.5  # a->b: row 0 wrong (20 > 10), row 1 right
    # cosine / 0.1: |b_2| = sqrt(5)
    r5 = math.sqrt(5.0)
    out = contrastive("cosine")
    assert float(out.loss) == pytest.approx(symmetric_ce([[10.0, 20.0 / r5], [0.0, 10.0 / r5]]), rel=1e-6)


@pytest.mark.parametrize("options", [{}, {"pooling": "mean", "projection": True, "similarity": "dot"}])
def test_gur_losses_decrease(tiny_model_dir, tokenizer, options):
    torch.manual_seed(0)
    model = quiet_load(GURModel, tiny_model_dir, **options)
    batch = GURCollator(tokenizer, max_length=32, masker=SpanMasker(mask_ratio=0.3), seed=0)(PAIRS)
    history = _train(model, batch)
    for key in ("loss", "mlm_loss", "cl_loss"):
        assert np.mean([h[key] for h in history[-3:]]) < 0.8 * history[0][key], key
    assert history[-1]["cl_accuracy"] == 1.0


def test_gur_save_reload(tiny_model_dir, tokenizer, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    torch.manual_seed(0)
    model = quiet_load(GURModel, tiny_model_dir, pooling="mean", projection=True, projection_dim=16)
    batch = GURCollator(tokenizer, max_length=32, seed=0)(PAIRS)
    _train(model, batch, steps=3)
    model.eval()
    model.save_pretrained(tmp_path)

    encoded = tokenizer(SENTENCES[:3], padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model.encoder.base_model(**encoded).last_hidden_state
        hf = quiet_load(AutoModel, tmp_path / "encoder").eval()
        torch.testing.assert_close(hf(**encoded).last_hidden_state, hidden, rtol=1e-5, atol=1e-5)
        st = SentenceTransformer(str(tmp_path / "encoder"), device="cpu")
        mask = encoded["attention_mask"].unsqueeze(-1).float()
        torch.testing.assert_close(
            st.encode(SENTENCES[:3], convert_to_tensor=True), (hidden * mask).sum(1) / mask.sum(1), rtol=1e-5, atol=1e-5
        )
        reloaded = quiet_load(GURModel, tmp_path / "encoder", tmp_path / "projection_head").eval()
        assert (reloaded.pooling, reloaded.projection_dim, reloaded.similarity) == ("mean", 16, "cosine")
        torch.testing.assert_close(reloaded.encode(**encoded), model.encode(**encoded))
        before, after = model(**batch), reloaded(**batch)
        for key in ("loss", "mlm_loss", "cl_loss"):
            torch.testing.assert_close(after[key], before[key], rtol=1e-5, atol=1e-5)


def test_retromae_mean_pooling_feeds_decoder_and_is_saved(tiny_model_dir, tokenizer, tmp_path):
    """With pooling="mean" the decoder reads the mean of the token states, and the saved encoder and head say so."""
    torch.manual_seed(0)
    model = quiet_load(RetroMAEModel, tiny_model_dir, pooling="mean").eval()
    batch = RetroMAECollator(tokenizer, max_length=32, seed=0)(SENTENCES[:2])
    seen = {}
    original = model.decode

    def spy(h, *args):
        seen["h"] = h
        return original(h, *args)

    model.decode = spy
    with torch.no_grad():
        model(**batch)
        hidden = model.encoder.base_model(input_ids=batch["encoder_input_ids"],
                                          attention_mask=batch["encoder_attention_mask"]).last_hidden_state
    mask = batch["encoder_attention_mask"].unsqueeze(-1).float()
    expected = (hidden * mask).sum(1) / mask.sum(1)
    torch.testing.assert_close(seen["h"], expected)
    assert not torch.allclose(seen["h"], hidden[:, 0])

    model.decode = original
    model.save_pretrained(tmp_path / "out")
    from robustir.models.encoder import Encoder

    assert quiet_load(Encoder, tmp_path / "out" / "encoder").config.pooling == "mean"
    reloaded = quiet_load(RetroMAEModel, tiny_model_dir, tmp_path / "out" / "decoder_head")
    assert reloaded.pooling == "mean"
    with pytest.raises(ConfigError):
        RetroMAEModel(model.encoder, pooling="max")
