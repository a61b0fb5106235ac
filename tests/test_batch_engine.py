"""BatchEngine: gradient caching equals the plain step (with and without aux losses, GUR included), column layout,
duplicate masking, RNG replay."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from robustir.losses import get_loss
from robustir.losses.base import AuxLoss, ContrastiveBatch, ContrastiveLoss, LossOutput
from robustir.training.batch_engine import BatchEngine, RandContext

LOSS_NAMES = ["infonce", "peg", "ccr"]


class TinyEncoder(nn.Module):
    """Embedding + token dropout + masked mean pooling + linear: small, but with real dropout."""

    def __init__(self, vocab: int = 40, dim: int = 12, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.dropout = nn.Dropout(dropout)
        self.proj = nn.Linear(dim, dim)

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        mask = features["attention_mask"].unsqueeze(-1).to(self.embed.weight.dtype)
        tokens = self.dropout(self.embed(features["input_ids"])) * mask
        return self.proj(tokens.sum(1) / mask.sum(1).clamp_min(1.0))


class ChunkedForward(nn.Module):
    """Runs the wrapped model chunk by chunk *with* grad: the same RNG consumption as the cached pass.

    For models with several dropout layers (BERT) a single full-batch forward draws different masks
    than chunk-wise forwards, so the fair plain reference is one graph over the same chunks.
    """

    def __init__(self, model: nn.Module, chunk_size: int) -> None:
        super().__init__()
        self.model, self.chunk_size = model, chunk_size

    def forward(self, features: dict[str, Tensor]) -> Tensor | tuple[Tensor, AuxLoss]:
        n = next(iter(features.values())).shape[0]
        outputs = [self.model({k: v[s:s + self.chunk_size] for k, v in features.items()})
                   for s in range(0, n, self.chunk_size)]
        if isinstance(outputs[0], Tensor):
            return torch.cat(outputs)
        # (embeddings, AuxLoss) per chunk: one AuxLoss whose total and count are the chunks' sums
        aux = [out[1] for out in outputs]
        return torch.cat([out[0] for out in outputs]), AuxLoss(
            sum(a.total for a in aux), sum(float(a.count) for a in aux), aux[0].name, aux[0].weight)


class DotLoss(ContrastiveLoss):
    """Minimal dot-product InfoNCE, independent of the losses package (layout tests)."""

    name = "dot"

    def forward(self, batch: ContrastiveBatch) -> LossOutput:
        scores = batch.queries @ batch.passages.T
        if batch.candidate_mask is not None:
            scores = scores.masked_fill(~batch.candidate_mask, float("-inf"))
        return LossOutput(F.cross_entropy(scores, batch.positive_index), {})


def random_features(n: int, seq_len: int = 6, vocab: int = 40, seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, seq_len), generator=g)
    lengths = torch.randint(1, seq_len + 1, (n,), generator=g)
    mask = (torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def make_batch(b: int = 6, k: int = 2) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor]:
    queries = random_features(b, seed=1)
    passages = random_features(b * (1 + k), seed=2)
    ids = torch.arange(b * (1 + k), dtype=torch.int64) + 100
    # query 2's positive is the same text as query 0's positive, and query 1's last hard negative
    # is the last query's positive: both would be false negatives unless masked.
    for dst, src in ((2 * (1 + k), 0), ((1 + k) + k, (b - 1) * (1 + k))):
        ids[dst] = ids[src]
        for key in passages:
            passages[key][dst] = passages[key][src]
    return queries, passages, ids


def grads(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def run_step(model: nn.Module, loss: ContrastiveLoss, chunk_size: int | None, seed: int = 123, **step_kw):
    torch.manual_seed(seed)  # same dropout stream for both modes
    engine = BatchEngine(loss, chunk_size=chunk_size)
    return engine.step(model, *step_kw.pop("inputs"), **step_kw)


def assert_same_grads(a: dict[str, Tensor], b: dict[str, Tensor], atol: float = 1e-6, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.allclose(a[name], b[name], atol=atol, rtol=rtol), (name, (a[name] - b[name]).abs().max())


# ---------------------------------------------------------------------------------- (a) cached == plain


@pytest.mark.parametrize("chunk_size", [3, 4])  # 3 divides 6 queries / 18 passages, 4 divides neither
@pytest.mark.parametrize("loss_name", LOSS_NAMES)
def test_cached_equals_plain_with_dropout(loss_name: str, chunk_size: int) -> None:
    b, k = 6, 2
    queries, passages, ids = make_batch(b, k)
    torch.manual_seed(0)
    plain_model = TinyEncoder().double().train()
    cached_model = copy.deepcopy(plain_model)
    plain_loss, cached_loss = get_loss(loss_name), get_loss(loss_name)
    layout = BatchEngine(DotLoss()).build_batch(torch.zeros(b, 1), torch.zeros(b * (1 + k), 1), k, ids)
    assert layout.candidate_mask is not None and (~layout.candidate_mask).sum() == 3  # the duplicates matter

    plain = run_step(plain_model, plain_loss, None, inputs=(queries, passages, k), passage_ids=ids)
    cached = run_step(cached_model, cached_loss, chunk_size, inputs=(queries, passages, k), passage_ids=ids)

    assert not cached.loss.requires_grad and not plain.loss.requires_grad
    assert torch.allclose(plain.loss.double(), cached.loss.double(), atol=1e-6, rtol=1e-6)
    assert_same_grads(grads(plain_model), grads(cached_model))
    assert plain.components.keys() == cached.components.keys()
    if loss_name == "peg":
        # the loss ran exactly once per step in both modes: t moved once, to the same value
        assert float(plain_loss.t) != 0.0
        assert torch.equal(plain_loss.t, cached_loss.t)


def test_dropout_is_really_on() -> None:
    """Guard for the test above: two plain steps with different seeds differ (dropout is active)."""
    b, k = 6, 2
    queries, passages, _ = make_batch(b, k)
    torch.manual_seed(0)
    model = TinyEncoder().double().train()
    first = run_step(model, get_loss("infonce"), None, seed=1, inputs=(queries, passages, k))
    second = run_step(model, get_loss("infonce"), None, seed=2, inputs=(queries, passages, k))
    assert not torch.allclose(first.loss, second.loss)


@pytest.mark.parametrize("loss_name", LOSS_NAMES)
def test_deferred_backward_scales_like_plain(loss_name: str) -> None:
    """backward=False: the caller back-propagates (here 3 * loss); the cached replay gets the scale too."""
    b, k = 4, 1
    queries, passages, ids = make_batch(b, k)
    torch.manual_seed(0)
    plain_model = TinyEncoder().double().train()
    cached_model = copy.deepcopy(plain_model)

    plain = run_step(plain_model, get_loss(loss_name), None, inputs=(queries, passages, k), backward=False)
    cached = run_step(cached_model, get_loss(loss_name), 3, inputs=(queries, passages, k), backward=False)
    assert plain.loss.requires_grad and cached.loss.requires_grad
    assert all(p.grad is None for p in cached_model.parameters())  # nothing ran yet
    (3 * plain.loss).backward()
    (3 * cached.loss).backward()
    assert torch.allclose(plain.loss, cached.loss)
    assert_same_grads(grads(plain_model), grads(cached_model))


def test_cached_equals_plain_on_tiny_bert(tiny_model_dir: str) -> None:
    """A real transformer (several dropout layers, attention dropout), reference over the same chunks."""
    from transformers import AutoModel, AutoTokenizer

    class MeanPooled(nn.Module):
        def __init__(self, path: str) -> None:
            super().__init__()
            self.bert = AutoModel.from_pretrained(path)

        def forward(self, features: dict[str, Tensor]) -> Tensor:
            hidden = self.bert(**features).last_hidden_state
            mask = features["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            return (hidden * mask).sum(1) / mask.sum(1)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    b, k, chunk = 4, 1, 3
    query_texts = ["what is a cat", "capital of france", "how do planes fly", "boiling point of water"]
    passage_texts = ["a cat is a small animal", "dogs bark", "paris is the capital of france", "rome",
                     "wings produce lift", "trains run on rails", "water boils at 100 degrees", "ice is cold"]
    queries = dict(tokenizer(query_texts, padding=True, return_tensors="pt"))
    passages = dict(tokenizer(passage_texts, padding=True, return_tensors="pt"))

    torch.manual_seed(0)
    cached_model = MeanPooled(tiny_model_dir).train()
    reference_model = copy.deepcopy(cached_model)
    cached = run_step(cached_model, get_loss("peg"), chunk, inputs=(queries, passages, k))
    reference = run_step(ChunkedForward(reference_model, chunk), get_loss("peg"), None, inputs=(queries, passages, k))

    assert torch.allclose(cached.loss, reference.loss, atol=1e-5)
    assert_same_grads(grads(reference_model), grads(cached_model), atol=1e-5, rtol=1e-4)


def test_bf16_autocast_on_cpu() -> None:
    """The autocast factory wraps both passes; the loss runs in float32 on the embeddings."""
    b, k = 4, 1
    queries, passages, _ = make_batch(b, k)
    torch.manual_seed(0)
    plain_model = TinyEncoder().train()
    cached_model = copy.deepcopy(plain_model)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    seen: list[torch.dtype] = []

    class Spy(ContrastiveLoss):
        def forward(self, batch: ContrastiveBatch) -> LossOutput:
            seen.append(batch.queries.dtype)
            return get_loss("infonce")(batch)

    results = []
    for model, chunk in ((plain_model, None), (cached_model, 3)):
        torch.manual_seed(5)
        results.append(BatchEngine(Spy(), chunk_size=chunk, autocast=autocast).step(model, queries, passages, k))
    assert seen == [torch.float32, torch.float32]
    assert torch.allclose(results[0].loss, results[1].loss, atol=1e-2)
    for name, g in grads(plain_model).items():
        other = grads(cached_model)[name]
        assert torch.isfinite(other).all()
        assert torch.allclose(g, other, atol=2e-2 * float(g.abs().max()) + 1e-6), name


def test_no_sync_wraps_all_but_last_chunk() -> None:
    b, k, chunk = 4, 1, 3  # 2 query chunks + 3 passage chunks
    queries, passages, _ = make_batch(b, k)
    entered: list[int] = []

    class Counter:
        def __enter__(self) -> None:
            entered.append(1)

        def __exit__(self, *exc) -> None:
            return None

    model = TinyEncoder().double()
    BatchEngine(DotLoss(), chunk_size=chunk).step(model, queries, passages, k, no_sync=Counter)
    assert len(entered) == 2 + 3 - 1


# ---------------------------------------------------------------------------------- (b) layout and mask


def test_column_layout_single_process() -> None:
    b, k, d = 3, 2, 4
    queries = torch.randn(b, d)
    passages = torch.randn(b * (1 + k), d)
    batch = BatchEngine(DotLoss()).build_batch(queries, passages, k)
    groups = passages.view(b, 1 + k, d)
    assert torch.equal(batch.passages[:b], groups[:, 0])  # positives first
    assert torch.equal(batch.passages[b:], groups[:, 1:].reshape(b * k, d))  # then hard negatives
    assert batch.positive_index.tolist() == [0, 1, 2]
    assert batch.hard_negative_index.tolist() == [[3, 4], [5, 6], [7, 8]]
    for i in range(b):
        assert torch.equal(batch.passages[batch.positive_index[i]], groups[i, 0])
        for j in range(k):
            assert torch.equal(batch.passages[batch.hard_negative_index[i, j]], groups[i, 1 + j])
    assert batch.query_offset == 0 and torch.equal(batch.all_queries, queries)
    assert batch.candidate_mask is None
    assert float(batch.global_mean(torch.tensor([1.0, 2.0, 6.0]))) == 3.0


def test_no_hard_negatives() -> None:
    queries, passages = torch.randn(3, 4), torch.randn(3, 4)
    batch = BatchEngine(DotLoss()).build_batch(queries, passages, 0)
    assert batch.hard_negative_index is None and batch.positive_index.tolist() == [0, 1, 2]
    assert torch.equal(batch.passages, passages)


def test_candidate_mask_masks_duplicates_of_the_positive() -> None:
    b, k, d = 3, 1, 4
    # rows (grouped): q0: pos 10, neg 11 | q1: pos 10 (same text as q0's pos), neg 12 | q2: pos 13, neg 13
    ids = torch.tensor([10, 11, 10, 12, 13, 13])
    batch = BatchEngine(DotLoss()).build_batch(torch.randn(b, d), torch.randn(b * (1 + k), d), k, ids)
    # columns: positives [10, 10, 13], negatives [11, 12, 13]
    expected = torch.tensor([
        [True, False, True, True, True, True],   # q0: q1's positive duplicates its own
        [False, True, True, True, True, True],   # q1: q0's positive duplicates its own
        [True, True, True, True, True, False],   # q2: its own hard negative is its positive's text
    ])
    assert torch.equal(batch.candidate_mask, expected)
    # own positive column is always kept
    assert batch.candidate_mask[torch.arange(b), batch.positive_index].all()

    unmasked = BatchEngine(DotLoss(), mask_duplicate_positives=False).build_batch(
        torch.randn(b, d), torch.randn(b * (1 + k), d), k, ids)
    assert unmasked.candidate_mask is None
    distinct = BatchEngine(DotLoss()).build_batch(torch.randn(b, d), torch.randn(b * (1 + k), d), k,
                                                  torch.arange(6))
    assert distinct.candidate_mask is None  # nothing to mask


def test_shape_errors_are_explained() -> None:
    engine = BatchEngine(DotLoss(), chunk_size=2)
    model = TinyEncoder()
    with pytest.raises(ValueError, match="passage rows"):
        engine.step(model, random_features(3), random_features(5), num_hard_negatives=1)
    with pytest.raises(ValueError, match="chunk_size"):
        BatchEngine(DotLoss(), chunk_size=0)


# ---------------------------------------------------------------------------------- (c) RandContext


def test_rand_context_replays_dropout_and_keeps_outer_stream() -> None:
    x = torch.ones(1000)
    torch.manual_seed(0)
    state = RandContext(x)
    first = F.dropout(x, 0.5)
    second = F.dropout(x, 0.5)
    assert not torch.equal(first, second)
    outer = torch.get_rng_state()
    with state:
        replayed = F.dropout(x, 0.5)
    assert torch.equal(first, replayed)
    assert torch.equal(torch.get_rng_state(), outer)  # the fork left the outer stream untouched
    with state:  # reusable
        assert torch.equal(F.dropout(x, 0.5), first)


def test_positive_ids_mask_every_known_positive_of_the_query():
    """Two rows of one query (two positives) in a batch: each row's other positive is masked, nothing else."""
    from robustir.training.batch_engine import BatchEngine

    torch.manual_seed(0)
    engine = BatchEngine(get_loss("infonce"))
    queries, passages = torch.randn(3, 8), torch.randn(3 * 2, 8)
    # rows 0 and 1: the same query with positives 10 and 11; row 2 another query (positive 12)
    passage_ids = torch.tensor([10, 20, 11, 21, 12, 22])
    positive_ids = torch.tensor([[10, 11], [10, 11], [12, -1]])
    batch = engine.build_batch(queries, passages, 1, passage_ids, positive_ids)
    mask = batch.candidate_mask
    assert mask is not None and mask.shape == (3, 6)
    assert not mask[0, 1] and not mask[1, 0]  # the other positive of the same query
    assert mask[0, 0] and mask[1, 1] and mask[2].all()
    assert mask[0, 2:].all() and mask[1, 2:].all()
    plain = engine.build_batch(queries, passages, 1, passage_ids)
    assert plain.candidate_mask is None  # without positive_ids nothing is a duplicate here


# ---------------------------------------------------------------------------------- (d) aux losses


class AuxEncoder(TinyEncoder):
    """TinyEncoder that also returns a token-level aux loss from the same forward: the sum over real tokens of
    ||dropout(embedding)||^2 and the number of tokens (which differs per chunk: the weighting matters)."""

    def forward(self, features: dict[str, Tensor]) -> tuple[Tensor, AuxLoss]:
        mask = features["attention_mask"].unsqueeze(-1).to(self.embed.weight.dtype)
        tokens = self.dropout(self.embed(features["input_ids"])) * mask
        embeddings = self.proj(tokens.sum(1) / mask.sum(1).clamp_min(1.0))
        return embeddings, AuxLoss((tokens ** 2).sum(), features["attention_mask"].sum(), "token_norm", weight=0.5)


@pytest.mark.parametrize("backward", [True, False])
@pytest.mark.parametrize("chunk_size", [3, 4])
def test_aux_loss_cached_equals_plain(chunk_size: int, backward: bool) -> None:
    """total = loss_weight * contrastive + weight * sum(totals) / sum(counts), equal in both modes, also when
    the caller back-propagates a scaled loss (backward=False: the replay gets the aux gradient scaled too)."""
    b, k = 6, 2
    queries, passages, ids = make_batch(b, k)
    torch.manual_seed(0)
    plain_model = AuxEncoder().double().train()
    cached_model = copy.deepcopy(plain_model)
    results = []
    for model, chunk in ((plain_model, None), (cached_model, chunk_size)):
        torch.manual_seed(123)
        engine = BatchEngine(get_loss("infonce"), chunk_size=chunk, loss_weight=0.7)
        out = engine.step(model, queries, passages, k, passage_ids=ids, backward=backward)
        if not backward:
            assert out.loss.requires_grad
            (3 * out.loss).backward()
        results.append(out)
    plain, cached = results
    assert "token_norm" in plain.components and plain.components.keys() == cached.components.keys()
    assert torch.allclose(plain.loss.double(), cached.loss.double(), atol=1e-6, rtol=1e-6)
    assert plain.components["token_norm"] == pytest.approx(cached.components["token_norm"], rel=1e-9)
    assert float(plain.loss.detach()) == pytest.approx(
        0.7 * plain.components["nce"] + 0.5 * plain.components["token_norm"], rel=1e-6)
    assert_same_grads(grads(plain_model), grads(cached_model))


def test_aux_loss_is_the_mean_over_all_units_of_the_step() -> None:
    """Without dropout the aux component is sum over every query and passage token / their number."""
    b, k = 4, 1
    queries, passages, _ = make_batch(b, k)
    torch.manual_seed(0)
    model = AuxEncoder(dropout=0.0).double()
    out = BatchEngine(get_loss("infonce"), chunk_size=3).step(model, queries, passages, k)
    with torch.no_grad():
        sums = [float(((model.embed(f["input_ids"]) * f["attention_mask"].unsqueeze(-1)) ** 2).sum())
                for f in (queries, passages)]
    count = int(queries["attention_mask"].sum() + passages["attention_mask"].sum())
    assert out.components["token_norm"] == pytest.approx(sum(sums) / count, rel=1e-9)


def test_model_output_errors_are_explained() -> None:
    queries, passages = random_features(2, seed=1), random_features(2, seed=2)

    def bad(features: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"embeddings": TinyEncoder()(features)}

    with pytest.raises(TypeError, match="AuxLoss"):
        BatchEngine(DotLoss()).step(bad, queries, passages, 0)

    def clash(features: dict[str, Tensor]) -> tuple[Tensor, AuxLoss]:
        embeddings = TinyEncoder()(features)
        return embeddings, AuxLoss(embeddings.sum(), 1, name="nce")

    with pytest.raises(ValueError, match="collides"):
        BatchEngine(get_loss("infonce")).step(clash, queries, passages, 0)


# ---------------------------------------------------------------------------------- (e) GUR through the engine

GUR_PAIRS = [
    ("a cat is chasing a mouse", "the cat is chasing the dog in the garden"),
    ("dense retrieval encodes passages", "passages are encoded by dense retrieval models"),
    ("photosynthesis happens in chloroplasts", "chloroplasts host photosynthesis in plant cells"),
    ("the river floods every spring", "every spring the river floods the valley"),
    ("vaccines were tested in a trial", "a randomized trial tested the vaccine"),
]


def gur_inputs(tiny_model_dir: str) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """An interleaved GUR collator batch and its a-rows (queries) and b-rows (passages), as pre-training splits it."""
    from transformers import AutoTokenizer

    from robustir.pretraining.masking import SpanMasker
    from robustir.pretraining.gur import GURCollator

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = GURCollator(tokenizer, max_length=24, masker=SpanMasker(mask_ratio=0.3), seed=0)(GUR_PAIRS)
    return batch, {k: v[0::2] for k, v in batch.items()}, {k: v[1::2] for k, v in batch.items()}


def gur_model(tiny_model_dir: str, **options):
    import transformers

    from robustir.pretraining.gur import GURModel

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        torch.manual_seed(0)
        return GURModel.from_pretrained(tiny_model_dir, **options).double()
    finally:
        transformers.logging.set_verbosity(verbosity)


def gur_step(model, a_rows, b_rows, chunk_size: int | None, seed: int = 11):
    """A GUR pre-training step as robustir.pretraining.pretrain runs it: a-rows are the queries, b-rows the passages."""
    gur = model.model if isinstance(model, ChunkedForward) else model
    engine = BatchEngine(gur.contrastive_loss(), chunk_size=chunk_size, loss_weight=gur.alpha)
    torch.manual_seed(seed)
    return engine.step(model, a_rows, b_rows, 0)


GUR_OPTIONS = [{"alpha": 0.7, "mlm_weight": 1.3},
               {"alpha": 0.7, "mlm_weight": 1.3, "similarity": "dot", "projection": True, "pooling": "mean"}]


@pytest.mark.parametrize("options", GUR_OPTIONS)
def test_gur_step_cached_equals_plain_and_the_models_own_loss(tiny_model_dir: str, options: dict) -> None:
    """Dropout off: GURModel(**interleaved batch) (alpha * CL + mlm_weight * MLM in one call), a plain engine
    step on a-rows vs b-rows, and GradCache steps (chunks 2 and 3 of 5 pairs) give one loss and one gradient."""
    batch, a_rows, b_rows = gur_inputs(tiny_model_dir)
    reference = gur_model(tiny_model_dir, **options).eval()
    models = {name: copy.deepcopy(reference) for name in ("plain", "chunk2", "chunk3")}
    own = reference(**batch)
    own["loss"].backward()
    outs = {name: gur_step(model, a_rows, b_rows, {"plain": None, "chunk2": 2, "chunk3": 3}[name])
            for name, model in models.items()}
    for name, out in outs.items():
        assert float(out.loss) == pytest.approx(float(own["loss"].detach()), rel=1e-6), name
        assert out.components["mlm_loss"] == pytest.approx(float(own["mlm_loss"]), rel=1e-6)
        assert out.components["nce"] == pytest.approx(float(own["cl_loss"]), rel=1e-6)
        assert_same_grads(grads(reference), grads(models[name]), atol=1e-7, rtol=1e-5)


def test_gur_step_cached_equals_plain_with_dropout(tiny_model_dir: str) -> None:
    """Dropout on (RNG replay): the reference encodes the same chunks with a graph, MLM totals and counts summed."""
    _, a_rows, b_rows = gur_inputs(tiny_model_dir)
    cached_model = gur_model(tiny_model_dir, **GUR_OPTIONS[1]).train()
    reference_model = copy.deepcopy(cached_model)
    cached = gur_step(cached_model, a_rows, b_rows, 3)
    reference = gur_step(ChunkedForward(reference_model, 3), a_rows, b_rows, None)
    assert float(cached.loss) == pytest.approx(float(reference.loss), rel=1e-6)
    assert cached.components.keys() == reference.components.keys()
    assert_same_grads(grads(reference_model), grads(cached_model), atol=1e-7, rtol=1e-5)
    again = gur_step(copy.deepcopy(reference_model), a_rows, b_rows, None, seed=12)
    assert float(again.loss) != pytest.approx(float(reference.loss), rel=1e-6)  # dropout really is on


def test_rng_snapshot_covers_the_models_devices_too():
    # CPU features with a GPU model: the snapshot must include the model's device (one anchor per device)
    from robustir.training.batch_engine import _device_anchors

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    anchors = _device_anchors(model)
    assert len(anchors) == 1 and anchors[0].device == torch.device("cpu")
    assert _device_anchors(lambda features: features) == []


# ---------------------------------------------------------------------------------- (e) memory-bounded losses


from robustir.losses.base import RowMask  # noqa: E402

BLOCKED_LOSSES = {
    "infonce": {},
    "infonce_symmetric": {"symmetric": True},
    "peg": {"temperature": 0.1},
    "ccr": {"beta": 0.1},
    "ccr_authors_code": {"variant": "authors_code", "temperature": 1.0, "beta": 0.1},
}


def blocked_loss(name: str) -> ContrastiveLoss:
    return get_loss(name.split("_")[0], **BLOCKED_LOSSES[name])


def blocked_step(name: str, block_rows, chunk_size, backward: bool = True, scale: float = 1.0):
    b, k = 6, 2
    queries, passages, ids = make_batch(b, k)
    positive_ids = torch.full((b, 2), -1, dtype=torch.int64)
    positive_ids[:, 0] = ids.view(b, 1 + k)[:, 0]
    positive_ids[3, 1] = ids[(1 + k) * 4]  # query 3 also knows query 4's positive: masked for row 3
    torch.manual_seed(0)
    model = TinyEncoder().double().train()
    loss = blocked_loss(name)
    torch.manual_seed(123)
    engine = BatchEngine(loss, chunk_size=chunk_size, block_rows=block_rows)
    out = engine.step(model, queries, passages, k, passage_ids=ids, positive_ids=positive_ids, backward=backward)
    if not backward:
        (scale * out.loss).backward()
    return out, grads(model), loss


def assert_float32_close_grads(ref: dict[str, Tensor], got: dict[str, Tensor]) -> None:
    """Blocking changes only the float32 summation order of the loss: agreement to a few float32 ulps of the
    gradient's scale (measured: <= 3e-7 x max|grad|, 1/tau = 20 amplifies the rounding)."""
    assert ref.keys() == got.keys() and ref
    for name, g in ref.items():
        assert torch.allclose(got[name], g, atol=1e-6 * float(g.abs().max()), rtol=0), \
            (name, float((got[name] - g).abs().max()), float(g.abs().max()))


@pytest.mark.parametrize("block_rows", [1, 4])  # 4 does not divide 6 rows
@pytest.mark.parametrize("name", list(BLOCKED_LOSSES))
def test_blocked_loss_in_plain_cached_and_deferred_steps(name: str, block_rows: int) -> None:
    ref, ref_grads, ref_loss = blocked_step(name, None, None)
    blocked_plain = {}
    for chunk_size, backward in ((None, True), (4, True), (4, False), (None, False)):
        scale = 1.0 if backward else 3.0
        ref_scaled = ref_grads if backward else blocked_step(name, None, None, False, scale)[1]
        got, got_grads, got_loss = blocked_step(name, block_rows, chunk_size, backward, scale)
        assert torch.allclose(got.loss.double(), ref.loss.double(), atol=1e-6, rtol=1e-6)
        assert_float32_close_grads(ref_scaled, got_grads)
        # GradCache stays exact with blocking on: cached == plain, both blocked (same float32 computation)
        if chunk_size is None:
            blocked_plain[backward] = got_grads
        else:
            assert_same_grads(blocked_plain.get(backward) or blocked_step(name, block_rows, None, backward, scale)[1],
                              got_grads)
        assert got.components.keys() == ref.components.keys()
        for key, value in ref.components.items():
            assert got.components[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
        if name == "peg":
            assert torch.equal(got_loss.t, ref_loss.t) and float(ref_loss.t) != 0.0


def test_blocked_duplicate_mask_is_a_row_mask_with_the_same_rows() -> None:
    b, k = 6, 2
    _, _, ids = make_batch(b, k)
    positive_ids = torch.tensor([[int(ids[0]), -1]] * b)  # every row knows query 0's positive
    queries, passages = torch.randn(b, 4), torch.randn(b * (1 + k), 4)
    for pos_ids in (None, positive_ids):
        whole = BatchEngine(DotLoss()).build_batch(queries, passages, k, ids, pos_ids)
        blocked = BatchEngine(DotLoss(), block_rows=4).build_batch(queries, passages, k, ids, pos_ids)
        assert isinstance(whole.candidate_mask, Tensor) and isinstance(blocked.candidate_mask, RowMask)
        assert blocked.block_rows == 4 and blocked.candidate_mask.shape == whole.candidate_mask.shape
        assert torch.equal(blocked.candidate_mask.materialize(), whole.candidate_mask)
        assert torch.equal(blocked.candidate_mask[1:5], whole.candidate_mask[1:5])
    distinct = BatchEngine(DotLoss(), block_rows=4).build_batch(queries, passages, k, torch.arange(b * (1 + k)))
    assert distinct.candidate_mask is None  # nothing to mask, decided block by block
    with pytest.raises(ValueError, match="block_rows"):
        BatchEngine(DotLoss(), block_rows=0)


def test_blocked_bf16_autocast_recomputes_in_float32() -> None:
    """Blocks are recomputed in the backward pass in the forward's precision, even if the caller's backward
    runs under autocast; the embeddings (bf16 forward) are identical, so blocked == whole to float32 precision."""
    b, k = 4, 1
    queries, passages, ids = make_batch(b, k)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    results = {}
    for block_rows in (None, 1, 3):
        for chunk in (None, 3):
            torch.manual_seed(0)
            model = TinyEncoder().train()
            torch.manual_seed(5)
            engine = BatchEngine(get_loss("peg"), chunk_size=chunk, autocast=autocast, block_rows=block_rows)
            out = engine.step(model, queries, passages, k, passage_ids=ids, backward=False)
            with autocast():
                out.loss.backward()
            results[block_rows, chunk] = (out.loss.detach(), grads(model))
    for chunk in (None, 3):
        ref_loss, ref_grads = results[None, chunk]
        for block_rows in (1, 3):
            loss, got = results[block_rows, chunk]
            assert loss.dtype == torch.float32 and torch.allclose(loss, ref_loss, atol=1e-6, rtol=1e-6)
            for name, g in ref_grads.items():
                assert torch.isfinite(got[name]).all()
                assert torch.allclose(got[name], g, atol=1e-2 * float(g.abs().max()) + 1e-6), name


from helpers import LargestTensor  # noqa: E402


@pytest.mark.parametrize("chunk_size", [None, 5])
@pytest.mark.parametrize("name", list(BLOCKED_LOSSES))
def test_blocked_step_never_builds_a_queries_by_columns_tensor(name: str, chunk_size) -> None:
    """Whole step (encode, duplicate mask with positive_ids, loss, backward, GradCache replay): with
    block_rows < b nothing of b x N elements is ever produced; without blocking the instrument sees it."""
    b, k, width, d, block = 12, 2, 6, 4, 3
    n = b * (1 + k)
    g = torch.Generator().manual_seed(0)
    queries, passages = {"x": torch.randn(b, width, generator=g)}, {"x": torch.randn(n, width, generator=g)}
    ids = torch.arange(n)
    ids[(1 + k) * 5] = ids[0]  # a duplicate positive: the mask is needed
    positive_ids = torch.stack([ids.view(b, 1 + k)[:, 0], torch.full((b,), -1)], dim=1)

    def largest(block_rows) -> LargestTensor:
        torch.manual_seed(0)
        encoder = nn.Linear(width, d, bias=False)
        engine = BatchEngine(blocked_loss(name), chunk_size=chunk_size, block_rows=block_rows)
        with LargestTensor() as mode:
            engine.step(lambda f: encoder(f["x"]), queries, passages, k, passage_ids=ids, positive_ids=positive_ids)
        assert encoder.weight.grad is not None and torch.isfinite(encoder.weight.grad).all()
        return mode

    assert largest(None).numel >= b * n  # the whole-batch step builds (b, N) tensors: the instrument sees them
    mode = largest(block)
    assert mode.numel < b * n and mode.numel <= max(block * n, n * width), (mode.numel, mode.shape)
