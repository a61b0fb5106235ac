"""GUR on T5 (the paper's architecture): sentinel span corruption, decoder targets, both losses, saving the encoder
as a sentence-transformers model, continuing from the saved decoder and head, resume, GradCache and cross-process
negatives. The T5 is tiny and built from a config here; its tokenizer is a T5 Unigram tokenizer (transformers'
``T5Tokenizer`` on the ``tokenizers`` backend) over a small word list plus single letters, with sentinels."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch import Tensor

from robustir.errors import ConfigError
from robustir.pretraining.masking import SpanMasker, maskable_positions
from robustir.pretraining.t5_gur import T5GURCollator, T5GURModel, fill_spans, sentinel_token_ids, span_corrupt

from helpers import gloo_process, multiprocess_engine_step  # tests/ is on sys.path

pytestmark = pytest.mark.usefixtures("single_torch_thread")

WORDS = ("the a of cat dog mouse river flood spring garden kitchen model retrieval dense passage query vector "
         "photosynthesis chloroplast vaccine trial solar panel energy plant cell table chasing around every").split()
PAIRS = [
    ("a cat is chasing a mouse", "the cat is chasing the dog in the garden"),
    ("dense retrieval encodes passages", "passages are encoded by dense retrieval models"),
    ("photosynthesis happens in chloroplasts", "chloroplasts host photosynthesis in plant cells"),
    ("the river floods every spring", "every spring the river floods the valley"),
]
NUM_SENTINELS = 100  # as T5


def build_tokenizer():
    """A T5 tokenizer: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, whole words, single letters (any lower-case text
    tokenises), and ``<extra_id_0..99>``."""
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + word, -3.0) for word in WORDS]
    vocab += [(letter, -6.0) for letter in "abcdefghijklmnopqrstuvwxyz"]
    return T5Tokenizer(vocab=vocab, extra_ids=NUM_SENTINELS)


def save_tiny_t5(folder: Path, dropout: float) -> str:
    from transformers import T5Config, T5ForConditionalGeneration

    tokenizer = build_tokenizer()
    config = T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=4, dropout_rate=dropout, decoder_start_token_id=tokenizer.pad_token_id,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tiny_t5_dir(tmp_path_factory) -> str:
    """A 2 + 2 layer, 32-wide random T5 with T5's default dropout (0.1)."""
    return save_tiny_t5(tmp_path_factory.mktemp("tiny-t5"), dropout=0.1)


@pytest.fixture(scope="module")
def no_dropout_t5_dir(tmp_path_factory) -> str:
    """The same T5 with dropout off (chunked / multi-process forwards cannot share one dropout stream)."""
    return save_tiny_t5(tmp_path_factory.mktemp("tiny-t5-no-dropout"), dropout=0.0)


def quiet(fn, *args, **kwargs):
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return fn(*args, **kwargs)
    finally:
        transformers.logging.set_verbosity(verbosity)


def random_texts(n: int, low: int, high: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(low, high)))) for _ in range(n)]


def write_pairs(path: Path, n: int = 40) -> Path:
    texts = random_texts(2 * n, 4, 10, seed=1)
    path.write_text("".join(json.dumps({"a": texts[2 * i], "b": texts[2 * i + 1]}) + "\n" for i in range(n)))
    return path


def read_log(output: Path) -> list[dict]:
    return [json.loads(x) for x in (output / "train_log.jsonl").read_text().splitlines()]


def weights(folder: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


# ---------------------------------------------------------------------------- span corruption

def test_span_corrupt_by_hand():
    ids = [5, 6, 7, 8, 9, 10, 1]
    mask = [False, True, True, False, True, False, False]
    inputs, targets = span_corrupt(ids, mask, sentinels=[100, 101, 102], eos_id=1)
    assert inputs.tolist() == [5, 100, 8, 101, 10, 1]
    assert targets.tolist() == [100, 6, 7, 101, 9, 1]
    assert fill_spans(inputs, targets, [100, 101, 102], eos_id=1) == ids
    # more spans than sentinels: the spans past the last sentinel stay in the input
    inputs, targets = span_corrupt(ids, mask, sentinels=[100], eos_id=1)
    assert inputs.tolist() == [5, 100, 8, 9, 10, 1] and targets.tolist() == [100, 6, 7, 1]
    # no span: the input unchanged, the target </s> alone
    inputs, targets = span_corrupt(ids, [False] * len(ids), sentinels=[100], eos_id=1)
    assert inputs.tolist() == ids and targets.tolist() == [1]
    with pytest.raises(ValueError, match="sentinel"):
        fill_spans([5, 6], [7, 100, 8], [100])


def test_sentinel_masking_matches_its_definition(tokenizer):
    """Seeded statistics over many long texts: the hidden share of the tokens is the mask ratio (15 %), the spans
    follow the hump-geometric lengths (mean E[L] = 3.795, none longer than 10), every span has its own sentinel in
    order, and </s> is never hidden."""
    masker = SpanMasker()  # 15 %, P(L) ∝ 0.66^|L-3|, L <= 10
    collator = T5GURCollator(tokenizer, max_length=4096, masker=masker, seed=0)
    sentinels = sentinel_token_ids(tokenizer)
    assert sentinels == [tokenizer.convert_tokens_to_ids(f"<extra_id_{i}>") for i in range(NUM_SENTINELS)]
    # long texts (1500-2000 tokens, about 70 spans each): the one truncated span per text barely moves the mean
    texts = random_texts(60, 1500, 2000, seed=2)
    span_lengths: list[int] = []
    hidden = maskable = 0
    for ids in tokenizer(texts)["input_ids"]:
        inputs, targets = collator.corrupt(ids)
        assert inputs[-1] == tokenizer.eos_token_id and targets[-1] == tokenizer.eos_token_id
        in_input = [int(t) for t in inputs if t in sentinels]
        in_target = [int(t) for t in targets if t in sentinels]
        assert in_input == in_target == sentinels[: len(in_input)]  # <extra_id_0>, <extra_id_1>, ... in order
        boundaries = [i for i, t in enumerate(targets) if t in sentinels] + [len(targets) - 1]
        span_lengths += [b - a - 1 for a, b in zip(boundaries[:-1], boundaries[1:])]
        hidden += len(targets) - len(in_target) - 1
        maskable += int(maskable_positions(ids, tokenizer).sum())
    lengths = np.asarray(span_lengths)
    assert len(lengths) > 3500 and lengths.min() >= 1 and lengths.max() <= 10
    assert hidden / maskable == pytest.approx(0.15, abs=0.003)
    # standard error ~0.03 for ~4000 spans; the truncated spans pull the mean ~0.03 below E[L]
    assert lengths.mean() == pytest.approx(masker.expected_span_length, abs=0.12)
    assert masker.expected_span_length == pytest.approx(3.795, abs=1e-3)
    counts = np.bincount(lengths, minlength=11)[1:11] / len(lengths)
    assert np.abs(counts - masker.probs).max() < 0.03


def test_decoder_targets_reconstruct_exactly_the_masked_spans(tokenizer):
    collator = T5GURCollator(tokenizer, max_length=16, masker=SpanMasker(mask_ratio=0.3), seed=0)
    batch = collator(PAIRS + [{"a": "energy", "b": "the solar panel"}])
    texts = [t for pair in PAIRS for t in pair] + ["energy", "the solar panel"]
    originals = tokenizer(texts, truncation=True, max_length=16)["input_ids"]
    sentinels = sentinel_token_ids(tokenizer)
    assert batch["input_ids"].shape[0] == batch["labels"].shape[0] == len(texts)
    spans = 0
    for row, original in enumerate(originals):
        length = int(batch["attention_mask"][row].sum())
        inputs, labels = batch["input_ids"][row, :length].tolist(), batch["labels"][row].tolist()
        assert batch["input_ids"][row, length:].eq(tokenizer.pad_token_id).all()
        assert fill_spans(inputs, labels, sentinels, eos_id=tokenizer.eos_token_id) == original
        real = [t for t in labels if t != -100]
        assert real[-1] == tokenizer.eos_token_id and labels[len(real):] == [-100] * (len(labels) - len(real))
        spans += sum(t in sentinels for t in inputs)
    assert spans >= len(texts)  # 30 %: (nearly) every sentence has a span; "energy" alone is too short for one
    # same seed, same masks; another seed, others
    examples = PAIRS + [{"a": "energy", "b": "the solar panel"}]
    again = T5GURCollator(tokenizer, max_length=16, masker=SpanMasker(mask_ratio=0.3), seed=0)(examples)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    other = T5GURCollator(tokenizer, max_length=16, masker=SpanMasker(mask_ratio=0.3), seed=1)(examples)
    assert any(other[k].shape != batch[k].shape or not torch.equal(other[k], batch[k]) for k in batch)


def test_bad_models_and_tokenizers_are_clear_errors(tiny_t5_dir, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from robustir.pretraining.pretrain import PretrainConfig, build_model

    with pytest.raises(ConfigError, match="sentinel"):
        T5GURCollator(AutoTokenizer.from_pretrained(tiny_model_dir))  # a WordPiece tokenizer: no <extra_id_0>
    with pytest.raises(ConfigError, match="no \\[CLS\\]"):
        quiet(T5GURModel.from_pretrained, tiny_t5_dir, pooling="cls")
    data = write_pairs(tmp_path / "pairs.jsonl", 4)
    with pytest.raises(ConfigError, match="RetroMAE pre-trains an encoder-only"):
        build_model(PretrainConfig(mode="retromae", model=tiny_t5_dir, data=str(data)), tiny_t5_dir)
    # an encoder-only run's projection head cannot continue a T5 run
    head = tmp_path / "bert-head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({
        "format": "robustir.gur.projection_head", "format_version": 1, "hidden_size": 32, "projection": False,
        "projection_dim": 32, "pooling": "cls", "similarity": "cosine", "temperature": 0.1, "alpha": 1.0,
        "mlm_weight": 1.0}))
    with pytest.raises(ConfigError, match="encoder-only"):
        quiet(T5GURModel.from_pretrained, tiny_t5_dir, head)


# ---------------------------------------------------------------------------- the model

def test_both_losses_fall_on_a_tiny_corpus(tiny_t5_dir, tokenizer):
    torch.manual_seed(0)
    model = quiet(T5GURModel.from_pretrained, tiny_t5_dir)
    assert (model.pooling, model.projection_dim, model.similarity, model.temperature, model.alpha) == \
        ("mean", 128, "cosine", 0.1, 1.0)
    collator = T5GURCollator(tokenizer, max_length=32, masker=SpanMasker(mask_ratio=0.3), seed=0)
    batch = collator(PAIRS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    history = []
    model.train()
    for _ in range(25):
        out = model(**batch)
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
        history.append({k: float(v.detach()) for k, v in out.items()})
    for key in ("loss", "mlm_loss", "cl_loss"):
        assert np.mean([h[key] for h in history[-3:]]) < 0.7 * history[0][key], key
    assert history[-1]["loss"] == pytest.approx(history[-1]["mlm_loss"] + history[-1]["cl_loss"], rel=1e-5)
    assert history[-1]["cl_accuracy"] == 1.0


def test_model_form_equals_the_batch_engine_step(no_dropout_t5_dir, tokenizer):
    """model(**batch) and one plain batch-engine step (the pre-training path) compute the same objective."""
    from robustir.training.batch_engine import BatchEngine

    model = quiet(T5GURModel.from_pretrained, no_dropout_t5_dir, alpha=0.7, mlm_weight=1.3, projection_dim=8)
    batch = T5GURCollator(tokenizer, max_length=32, masker=SpanMasker(mask_ratio=0.3), seed=0)(PAIRS)
    direct = model(**batch)
    engine = BatchEngine(model.contrastive_loss(), loss_weight=model.alpha)
    a_rows, b_rows = ({k: v[i::2] for k, v in batch.items()} for i in (0, 1))
    out = engine.step(model, a_rows, b_rows, 0, backward=False)
    assert float(out.loss.detach()) == pytest.approx(float(direct["loss"].detach()), rel=1e-5)
    assert out.components["mlm_loss"] == pytest.approx(float(direct["mlm_loss"]), rel=1e-5)


# ---------------------------------------------------------------------------- pre-training runs

def small_config(model: str, data: Path, output: Path, **overrides):
    from robustir.pretraining.pretrain import PretrainConfig

    values = dict(mode="gur", model=model, data=str(data), output=str(output), batch_size=4, max_steps=4,
                  max_length=32, lr=1e-3, warmup_ratio=0.0, seed=3, report=False)
    values.update(overrides)
    return PretrainConfig(**values)


def test_pretrain_saves_an_encoder_that_reloads_with_identical_embeddings(tiny_t5_dir, tmp_path):
    """``robustir pretrain --mode gur`` on a T5: model/ is the encoder alone as a sentence-transformers folder
    (T5 encoder + mean pooling + normalisation) that SentenceTransformer and robustir's Encoder load with the
    trained encoder's embeddings; full/ + projection_head/ continue pre-training from where it stopped."""
    from sentence_transformers import SentenceTransformer

    from robustir.models.encoder import Encoder
    from robustir.pretraining.pretrain import pretrain

    data = write_pairs(tmp_path / "pairs.jsonl")
    out = tmp_path / "run"
    result = quiet(pretrain, small_config(tiny_t5_dir, data, out, max_steps=6))
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "mlm_loss", "cl_loss", "cl_accuracy", "cl_loss_q2p", "cl_loss_p2q"} <= set(log[0])
    assert result.model_path == out / "model" and (out / "full" / "config.json").exists()
    modules = json.loads((out / "model" / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    assert json.loads((out / "model" / "config.json").read_text())["architectures"] == ["T5EncoderModel"]
    assert not any(k.startswith("decoder.") for k in weights(out / "model"))

    texts = ["the cat is chasing a mouse", "every spring the river floods", "solar panel energy"]
    st = SentenceTransformer(str(out / "model"), device="cpu")
    encoder = Encoder.from_pretrained(out / "model")
    assert (encoder.config.pooling, encoder.config.normalize) == ("mean", True)
    # the trained encoder itself (read back from the run's full/ folder, the decoder's checkpoint)
    trained = quiet(T5GURModel.from_pretrained, out / "full", out).eval()
    assert trained.projection is not None and trained.projection_dim == 128
    features = trained.tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = trained.t5.get_encoder()(**features).last_hidden_state
    mask = features["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()
    np.testing.assert_allclose(st.encode(texts), expected, atol=1e-5)
    np.testing.assert_allclose(encoder.encode(texts), expected, atol=1e-5)
    # robustir's training path (Encoder.forward) runs on it too, and so does zero-shot classification
    assert encoder(encoder.tokenize(texts, "query")).shape == (3, 32)
    from robustir.evaluation.classify import LabelSet, classify

    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"text": t, "label": label}) + "\n"
                               for t, label in zip(texts, ["animals", "weather", "energy"])))
    classified = classify(out / "model", samples, LabelSet(["animals", "weather", "energy"]))
    assert classified.report["num_examples"] == 3 and len(classified.predictions) == 3

    # continue from the saved decoder and head: it starts where the first run stopped, not afresh
    more = tmp_path / "more"
    quiet(pretrain, small_config(str(out / "full"), data, more, heads=str(out), max_steps=2))
    first, continued = log[0], read_log(more)[0]
    assert continued["mlm_loss"] < first["mlm_loss"] and continued["loss"] < first["loss"]
    assert json.loads((more / "projection_head" / "config.json").read_text())["encoder_decoder"] is True


def test_t5_resume_equals_uninterrupted(tiny_t5_dir, tmp_path):
    """Checkpoints hold the whole encoder-decoder and the head (tied embeddings once): an interrupted run resumed
    ends with the same weights and log as an uninterrupted one (dropout on: the RNG states are restored too)."""
    from robustir.pretraining.pretrain import pretrain

    data = write_pairs(tmp_path / "pairs.jsonl")
    options = {"projection_dim": 16, "shuffle_buffer": 8}
    quiet(pretrain, small_config(tiny_t5_dir, data, tmp_path / "full", save_steps=2, **options))
    first = quiet(pretrain, small_config(tiny_t5_dir, data, tmp_path / "resumed", **options), stop_after=2)
    assert first.steps == 2 and not (tmp_path / "resumed" / "full").exists()
    second = quiet(pretrain, small_config(tiny_t5_dir, data, tmp_path / "resumed", **options))
    assert second.steps == 4
    for folder in ("model", "full", "projection_head"):
        a, b = weights(tmp_path / "full" / folder), weights(tmp_path / "resumed" / folder)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)
    for x, y in zip(read_log(tmp_path / "full"), read_log(tmp_path / "resumed")):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)


def test_t5_grad_cache_equals_plain(no_dropout_t5_dir, tmp_path):
    """chunk_size (GradCache in the batch engine) gives the plain step's first losses and gradient norm."""
    from robustir.pretraining.pretrain import pretrain

    data = write_pairs(tmp_path / "pairs.jsonl")
    logs = {}
    for name, chunk_size in (("plain", None), ("cached", 3)):
        quiet(pretrain, small_config(no_dropout_t5_dir, data, tmp_path / name, max_steps=1, chunk_size=chunk_size,
                                     alpha=0.7, mlm_weight=1.3))
        logs[name] = read_log(tmp_path / name)[0]
    for key in ("loss", "mlm_loss", "cl_loss", "grad_norm"):
        assert logs["cached"][key] == pytest.approx(logs["plain"][key], rel=1e-4), key
    assert logs["plain"]["loss"] == pytest.approx(0.7 * logs["plain"]["cl_loss"] + 1.3 * logs["plain"]["mlm_loss"],
                                                  rel=1e-5)


def test_cli_refuses_retromae_on_t5_without_traceback(tiny_t5_dir, tmp_path, capsys):
    from robustir.cli.main import main

    data = tmp_path / "texts.txt"
    data.write_text("the cat\nthe dog\n")
    code = main(["pretrain", "--mode", "retromae", "--model", tiny_t5_dir, "--data", str(data), "--output",
                 str(tmp_path / "o"), "--max-steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "encoder-decoder" in err and "Traceback" not in err


# ---------------------------------------------------------------------------- two processes (gloo)

WORLD = 2
PAIRS_PER_RANK = 2
OPTIONS = {"alpha": 0.7, "mlm_weight": 1.3, "projection_dim": 8}
MODES = (("plain", None, False), ("plain_ddp", None, True), ("cached_ddp", 1, True))


def t5_model(model_dir: str) -> T5GURModel:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return T5GURModel.from_pretrained(model_dir, **OPTIONS).double().eval()


def global_batch(model_dir: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """a-rows and b-rows of WORLD * PAIRS_PER_RANK corrupted pairs (the same on every process)."""
    from transformers import AutoTokenizer

    texts = random_texts(2 * WORLD * PAIRS_PER_RANK, 4, 9, seed=3)
    pairs = [(texts[2 * i], texts[2 * i + 1]) for i in range(WORLD * PAIRS_PER_RANK)]
    batch = T5GURCollator(AutoTokenizer.from_pretrained(model_dir), max_length=16,
                          masker=SpanMasker(mask_ratio=0.3), seed=0)(pairs)
    return {k: v[0::2] for k, v in batch.items()}, {k: v[1::2] for k, v in batch.items()}


def shard(features: dict[str, Tensor], rank: int) -> dict[str, Tensor]:
    rows = slice(rank * PAIRS_PER_RANK, (rank + 1) * PAIRS_PER_RANK)
    return {k: v[rows] for k, v in features.items()}


def _worker(rank: int, init_file: str, out_dir: str, model_dir: str) -> None:
    from robustir.training.batch_engine import BatchEngine

    def rank_results(rank: int) -> dict[str, object]:
        a_rows, b_rows = (shard(f, rank) for f in global_batch(model_dir))
        results: dict[str, object] = {}
        for label, chunk_size, use_ddp in MODES:
            model = t5_model(model_dir)
            engine = BatchEngine(model.contrastive_loss(), chunk_size=chunk_size, loss_weight=model.alpha)
            out, loss = multiprocess_engine_step(model, engine, a_rows, b_rows, use_ddp, WORLD)
            results[label] = {"loss": loss, "mlm_loss": out.components["mlm_loss"],
                              "cl_loss": out.components["nce"],
                              "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
        return results

    gloo_process(rank, WORLD, init_file, os.path.join(out_dir, f"t5-rank{rank}.pt"), rank_results)


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory, no_dropout_t5_dir) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dist-t5")
    mp.spawn(_worker, args=(str(tmp / "init"), str(tmp), no_dropout_t5_dir), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"t5-rank{r}.pt", weights_only=False) for r in range(WORLD)]


def reference(model_dir: str) -> tuple[Tensor, float, list[float], dict[str, Tensor]]:
    """One process, by hand: the symmetric InfoNCE over the vectors of *all* pairs (both processes' pairs are
    negatives), plus each process's own LM mean averaged over the processes (the aux loss stays local)."""
    from robustir.losses import ContrastiveBatch

    model = t5_model(model_dir)
    a_rows, b_rows = global_batch(model_dir)
    vectors_a, vectors_b, lm_means = [], [], []
    for rank in range(WORLD):
        va, total_a, count_a = model.encode_with_lm(**shard(a_rows, rank))
        vb, total_b, count_b = model.encode_with_lm(**shard(b_rows, rank))
        vectors_a.append(va)
        vectors_b.append(vb)
        lm_means.append((total_a + total_b) / (count_a + count_b))
    contrastive = model.contrastive_loss()(ContrastiveBatch.from_groups(torch.cat(vectors_a), torch.cat(vectors_b)))
    loss = model.alpha * contrastive.loss + model.mlm_weight * torch.stack(lm_means).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().double(), float(contrastive.loss.detach()), [float(m.detach()) for m in lm_means], grads


@pytest.mark.parametrize("mode", [m[0] for m in MODES])
def test_two_processes_gather_negatives_for_the_t5_contrastive_term(rank_results, no_dropout_t5_dir, mode):
    """Under two gloo processes the T5 GUR contrastive term sees both processes' pairs as negatives (plain, DDP,
    DDP + GradCache), its LM aux loss is each process's own mean, and the gradients equal one process's."""
    ref_loss, ref_cl, ref_lm, ref_grads = reference(no_dropout_t5_dir)
    assert ref_lm[0] != pytest.approx(ref_lm[1])  # per-process LM means differ: the test tells local from global
    for rank, result in enumerate(rank_results):
        got = result[mode]
        assert torch.allclose(got["loss"], ref_loss, atol=1e-6), (got["loss"], ref_loss)
        assert got["mlm_loss"] == pytest.approx(ref_lm[rank], rel=1e-6)
        assert got["grads"].keys() == ref_grads.keys()
        for name, grad in ref_grads.items():
            scale = float(grad.abs().max())
            assert torch.allclose(got["grads"][name], grad, atol=1e-6 * scale + 1e-12, rtol=0), name
    # each process's contrastive loss is over its own rows against every process's columns: their mean is the
    # contrastive loss of the whole batch
    assert np.mean([r[mode]["cl_loss"] for r in rank_results]) == pytest.approx(ref_cl, rel=1e-6)
    # guard: each process's pairs alone would give a clearly different contrastive loss
    from robustir.losses import ContrastiveBatch

    model = t5_model(no_dropout_t5_dir)
    a_rows, b_rows = global_batch(no_dropout_t5_dir)
    with torch.no_grad():
        local = np.mean([float(model.contrastive_loss()(ContrastiveBatch.from_groups(
            model.encode_with_lm(**shard(a_rows, r))[0], model.encode_with_lm(**shard(b_rows, r))[0])).loss)
            for r in range(WORLD)])
    assert abs(local - ref_cl) > 1e-3
