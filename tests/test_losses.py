"""Loss values against hand-computed cases (plain python math), PEG's pieces one by one, CCR variants, sieve rule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from robustir.errors import ConfigError
from robustir.losses import (
    LOSSES,
    CCRLoss,
    ContrastiveBatch,
    InfoNCELoss,
    LossOutput,
    PEGLoss,
    get_loss,
    sieve_keep_mask,
)

# --- a tiny fixed batch: 3 queries, 2-d embeddings, one hard negative each ------------------------------

Q = [[1.0, 0.0], [0.6, 0.8], [-1.0, 0.5]]
P = [[0.9, 0.3], [0.5, 1.0], [-0.2, 1.0]]
N = [[[0.8, -0.6]], [[1.0, 0.4]], [[-1.0, -0.2]]]
PASSAGES = P + [n[0] for n in N]  # the layout of from_groups: positives (cols 0-2), then hard negatives (3-5)


def fixed_batch(**overrides) -> ContrastiveBatch:
    batch = ContrastiveBatch.from_groups(torch.tensor(Q), torch.tensor(P), torch.tensor(N))
    for key, value in overrides.items():
        setattr(batch, key, value)
    return batch


def cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def nce_row(query: list[float], positive: int, columns: list[int], tau: float, passages=PASSAGES) -> float:
    """-log softmax of the positive over the given columns (which include the positive)."""
    return logsumexp([cos(query, passages[j]) / tau for j in columns]) - cos(query, passages[positive]) / tau


def own_columns(i: int) -> list[int]:
    return [i, 3 + i]


ALL = list(range(6))


# --- InfoNCE -----------------------------------------------------------------------------------------

def test_infonce_matches_hand_formula_with_in_batch_negatives():
    out = InfoNCELoss(temperature=0.1)(fixed_batch())
    expected = sum(nce_row(Q[i], i, ALL, 0.1) for i in range(3)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.components["nce"] == pytest.approx(expected, rel=1e-5)


def test_infonce_without_in_batch_negatives_uses_only_own_group():
    out = InfoNCELoss(temperature=0.1, in_batch_negatives=False)(fixed_batch())
    expected = sum(nce_row(Q[i], i, own_columns(i), 0.1) for i in range(3)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)


def test_candidate_mask_excludes_columns_but_never_the_positive():
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, 1] = False  # row 0 must not use column 1 (e.g. a duplicate of its positive)
    mask[2, 5] = False
    mask[1, 1] = False  # row 1's own positive: ignored, the positive is always kept
    out = InfoNCELoss(temperature=0.1)(fixed_batch(candidate_mask=mask))
    columns = [[0, 2, 3, 4, 5], ALL, [0, 1, 2, 3, 4]]
    expected = sum(nce_row(Q[i], i, columns[i], 0.1) for i in range(3)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)


def test_infonce_components():
    out = InfoNCELoss(temperature=0.1)(fixed_batch())
    assert isinstance(out, LossOutput)
    assert set(out.components) == {"nce", "pos_sim", "neg_sim", "accuracy"}
    assert all(type(v) is float for v in out.components.values())
    assert out.components["pos_sim"] == pytest.approx(sum(cos(Q[i], P[i]) for i in range(3)) / 3, rel=1e-5)
    negs = [cos(Q[i], PASSAGES[j]) for i in range(3) for j in ALL if j != i]
    assert out.components["neg_sim"] == pytest.approx(sum(negs) / len(negs), rel=1e-5)
    top = [max(ALL, key=lambda j: cos(Q[i], PASSAGES[j])) == i for i in range(3)]
    assert out.components["accuracy"] == pytest.approx(sum(top) / 3)


def test_symmetric_infonce_adds_passage_to_query_term():
    out = InfoNCELoss(temperature=0.1, symmetric=True)(fixed_batch())
    q2p = sum(nce_row(Q[i], i, ALL, 0.1) for i in range(3)) / 3
    p2q = sum(logsumexp([cos(P[i], q) / 0.1 for q in Q]) - cos(P[i], Q[i]) / 0.1 for i in range(3)) / 3
    assert out.loss.item() == pytest.approx((q2p + p2q) / 2, rel=1e-5)
    assert out.components["nce_q2p"] == pytest.approx(q2p, rel=1e-5)
    assert out.components["nce_p2q"] == pytest.approx(p2q, rel=1e-5)


def test_symmetric_infonce_uses_global_queries_and_offset():
    # process 1 of 2: local rows are global queries 1-2, their positives are global columns 1-2
    all_q = torch.tensor(Q + [[0.3, -0.9]])
    batch = ContrastiveBatch(queries=all_q[1:3], passages=torch.tensor(PASSAGES), positive_index=torch.tensor([1, 2]),
                             all_queries=all_q, query_offset=1)
    out = InfoNCELoss(temperature=0.1, symmetric=True)(batch)
    queries = Q + [[0.3, -0.9]]
    q2p = sum(nce_row(Q[i], i, ALL, 0.1) for i in (1, 2)) / 2
    p2q = sum(logsumexp([cos(P[i], q) / 0.1 for q in queries]) - cos(P[i], Q[i]) / 0.1 for i in (1, 2)) / 2
    assert out.loss.item() == pytest.approx((q2p + p2q) / 2, rel=1e-5)


def gte_row(i: int, negatives: list[int], queries: list[int], tau: float) -> float:
    """GTE's improved contrastive loss for row i of the fixed batch, written out term by term."""
    terms = [cos(Q[i], PASSAGES[i]) / tau]
    terms += [cos(Q[i], PASSAGES[j]) / tau for j in negatives]           # q_i . d_j
    terms += [cos(Q[i], Q[j]) / tau for j in queries]                    # q_i . q_j
    terms += [cos(PASSAGES[i], Q[j]) / tau for j in queries]             # d_i . q_j
    terms += [cos(PASSAGES[i], PASSAGES[j]) / tau for j in negatives]    # d_i . d_j
    return logsumexp(terms) - cos(Q[i], PASSAGES[i]) / tau


def test_gte_denominator_matches_hand_formula():
    out = InfoNCELoss(temperature=0.1, denominator="gte")(fixed_batch())
    expected = sum(gte_row(i, [j for j in ALL if j != i], [j for j in range(3) if j != i], 0.1)
                   for i in range(3)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    plain = InfoNCELoss(temperature=0.1)(fixed_batch())
    assert out.loss.item() > plain.loss.item()  # more terms in every denominator


def test_gte_denominator_never_pushes_away_a_query_whose_positive_is_masked():
    # row 0 may not use column 1 (say query 1 is query 0 again, or shares its positive): then neither
    # passage 1 nor query 1 is a negative of row 0, in any of the four terms
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, 1] = False
    out = InfoNCELoss(temperature=0.1, denominator="gte")(fixed_batch(candidate_mask=mask))
    rows = [gte_row(0, [2, 3, 4, 5], [2], 0.1), gte_row(1, [0, 2, 3, 4, 5], [0, 2], 0.1),
            gte_row(2, [0, 1, 3, 4, 5], [0, 1], 0.1)]
    assert out.loss.item() == pytest.approx(sum(rows) / 3, rel=1e-5)


def test_gte_denominator_rules():
    with pytest.raises(ConfigError, match="symmetric=False"):
        InfoNCELoss(denominator="gte", symmetric=True)
    with pytest.raises(ConfigError, match="in_batch_negatives=True"):
        InfoNCELoss(denominator="gte", in_batch_negatives=False)
    # a batch whose positives are not laid out as the engine lays them out is refused, not mis-scored
    batch = fixed_batch(positive_index=torch.tensor([1, 0, 2]))
    with pytest.raises(ConfigError, match="laid out"):
        InfoNCELoss(denominator="gte")(batch)


def test_false_negative_margin_drops_negatives_scored_above_the_positive():
    # margin 0: any negative scored above the row's positive is dropped
    margin = 0.0
    dropped = {(i, j) for i in range(3) for j in ALL
               if j != i and cos(Q[i], PASSAGES[j]) > cos(Q[i], PASSAGES[i]) + margin}
    assert dropped  # the fixed batch has such a column, else this test proves nothing
    out = InfoNCELoss(temperature=0.1, false_negative_margin=margin)(fixed_batch())
    expected = sum(nce_row(Q[i], i, [j for j in ALL if (i, j) not in dropped], 0.1) for i in range(3)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.components["false_negatives_dropped"] == pytest.approx(len(dropped) / 3)
    # a margin no negative reaches changes nothing
    wide = InfoNCELoss(temperature=0.1, false_negative_margin=2.5)(fixed_batch())
    assert wide.loss.item() == pytest.approx(InfoNCELoss(temperature=0.1)(fixed_batch()).loss.item(), rel=1e-6)
    assert wide.components["false_negatives_dropped"] == 0.0


def test_false_negative_margin_applies_to_every_gte_term():
    margin = 0.05
    out = InfoNCELoss(temperature=0.1, denominator="gte", false_negative_margin=margin)(fixed_batch())
    total, count = 0.0, 0
    for i in range(3):
        ceiling = cos(Q[i], PASSAGES[i]) + margin
        terms = [cos(Q[i], PASSAGES[i]) / 0.1]
        pairs = ([(Q[i], PASSAGES[j]) for j in ALL if j != i] + [(Q[i], Q[j]) for j in range(3) if j != i]
                 + [(PASSAGES[i], Q[j]) for j in range(3) if j != i]
                 + [(PASSAGES[i], PASSAGES[j]) for j in ALL if j != i])
        kept = [cos(a, b) for a, b in pairs if cos(a, b) <= ceiling]
        count += len(pairs) - len(kept)
        total += logsumexp(terms + [c / 0.1 for c in kept]) - terms[0]
    assert count > 0
    assert out.loss.item() == pytest.approx(total / 3, rel=1e-5)
    assert out.components["false_negatives_dropped"] == pytest.approx(count / 3)


def test_symmetric_needs_in_batch_negatives():
    with pytest.raises(ConfigError):
        InfoNCELoss(symmetric=True, in_batch_negatives=False)


def test_dot_similarity_scores_raw_inner_products():
    out = InfoNCELoss(temperature=0.1, similarity="dot")(fixed_batch())

    def dot(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b))

    rows = [logsumexp([dot(Q[i], PASSAGES[j]) / 0.1 for j in ALL]) - dot(Q[i], P[i]) / 0.1 for i in range(3)]
    assert out.loss.item() == pytest.approx(sum(rows) / 3, rel=1e-5)
    assert out.components["pos_sim"] == pytest.approx(sum(dot(Q[i], P[i]) for i in range(3)) / 3, rel=1e-5)
    assert InfoNCELoss(similarity="dot").config()["similarity"] == "dot"
    with pytest.raises(ConfigError, match="similarity"):
        InfoNCELoss(similarity="l2")


def gur_symmetric_info_nce(a: torch.Tensor, b: torch.Tensor, temperature: float, similarity: str) -> torch.Tensor:
    """GUR's former in-model contrastive loss (robustir.pretraining.gur.symmetric_info_nce before it moved into
    losses/; the authors' ``compute_clip_loss``), kept here as the reference."""
    if similarity == "cosine":
        a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    logits = (a @ b.T).float() / temperature
    target = torch.arange(len(a))
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


@pytest.mark.parametrize("similarity", ["cosine", "dot"])
def test_symmetric_infonce_equals_gurs_symmetric_info_nce(similarity):
    """GUR's contrastive term is InfoNCELoss(symmetric=True) on a_k (queries) vs b_k (positives), no hard
    negatives: the mean of the a->b and b->a cross-entropies, with cosine or dot similarity."""
    torch.manual_seed(3)
    a, b = torch.randn(6, 8), torch.randn(6, 8)
    b[4] = b[1]  # an in-batch duplicate stays a negative, as in GUR (no duplicate mask without passage ids)
    out = InfoNCELoss(temperature=0.1, symmetric=True, similarity=similarity)(ContrastiveBatch.from_groups(a, b))
    expected = gur_symmetric_info_nce(a, b, temperature=0.1, similarity=similarity)
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=1e-6)
    assert out.components["nce"] == pytest.approx(float(expected), rel=1e-6)


# --- PEG: a batch whose cosines are set directly (every query is e1, no in-batch negatives) ---------------

BETA = 0.1
POS_COS = [0.9, 0.7, 0.2, -0.1]          # mean 0.425 -> sigma 0.325
NEG_COS = [[0.95, 0.5],                  # 0.95 >= 0.9 and 0.9 >= sigma: scaled; 0.5 < 0.9: a_n = 1
           [0.7, 0.1],                   # tie with the positive counts as "not below": scaled
           [0.8, 0.0],                   # positive below sigma: nothing scaled even though 0.8 > 0.2
           [0.3, -0.5]]                  # positive below sigma (and negative): w_q clamps to 0


def unit(c: float) -> list[float]:
    return [c, math.sqrt(1 - c * c)]


def peg_batch(pos_cos=POS_COS, neg_cos=NEG_COS, requires_grad: bool = False) -> ContrastiveBatch:
    b = len(pos_cos)
    queries = torch.tensor([[1.0, 0.0]] * b, requires_grad=requires_grad)
    positives = torch.tensor([unit(c) for c in pos_cos], requires_grad=requires_grad)
    negatives = torch.tensor([[unit(c) for c in row] for row in neg_cos], requires_grad=requires_grad)
    return ContrastiveBatch.from_groups(queries, positives, negatives)


def peg_reference(pos_cos, neg_cos, t_old: float, tau: float, alpha: float = 0.5, beta: float = BETA,
                  training: bool = True) -> tuple[float, float, list[float], list[list[float]]]:
    """Eq. 3-6 spelled out: returns (loss, t used, w_q per row, a_n per row and negative)."""
    mean = sum(pos_cos) / len(pos_cos)
    t = alpha * mean + (1 - alpha) * t_old if training else t_old
    sigma = mean - beta
    weights, scales, total = [], [], 0.0
    for s_qp, row in zip(pos_cos, neg_cos):
        if s_qp >= sigma:
            w = 1.0
        elif sigma <= 0:
            w = 0.0
        else:
            w = min(max(s_qp / sigma, 0.0), 1.0)
        a = [1.0 if (s_qp < sigma or s_qn < s_qp) else t + s_qp for s_qn in row]
        denominator = math.exp(s_qp / tau) + sum(math.exp(a_n * s_qn / tau) for a_n, s_qn in zip(a, row))
        total += -w * math.log(math.exp(s_qp / tau) / denominator)
        weights.append(w)
        scales.append(a)
    return total / len(pos_cos), t, weights, scales


def test_peg_cases_match_hand_formula():
    loss_fn = PEGLoss(temperature=0.1, beta=BETA, in_batch_negatives=False)
    out = loss_fn(peg_batch())
    expected, t, weights, scales = peg_reference(POS_COS, NEG_COS, t_old=0.0, tau=0.1)
    assert weights == pytest.approx([1.0, 1.0, 0.2 / 0.325, 0.0])
    assert scales[0] == pytest.approx([t + 0.9, 1.0]) and scales[1] == pytest.approx([t + 0.7, 1.0])
    assert scales[2] == [1.0, 1.0] and scales[3] == [1.0, 1.0]
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    c = out.components
    assert set(c) == {"loss", "t", "sigma", "mean_w_q", "share_scaled_negatives", "pos_sim", "neg_sim"}
    assert all(type(v) is float for v in c.values())
    assert c["t"] == pytest.approx(0.5 * 0.425, abs=1e-6)
    assert c["sigma"] == pytest.approx(0.325, abs=1e-6)
    assert c["mean_w_q"] == pytest.approx(sum(weights) / 4, abs=1e-6)
    assert c["share_scaled_negatives"] == pytest.approx(2 / 8)
    assert c["pos_sim"] == pytest.approx(0.425, abs=1e-6)
    assert c["neg_sim"] == pytest.approx(sum(sum(r) for r in NEG_COS) / 8, abs=1e-6)


def test_peg_with_in_batch_negatives_scales_them_too():
    loss_fn = PEGLoss(temperature=0.1, beta=BETA)
    out = loss_fn(fixed_batch())
    pos = [cos(Q[i], P[i]) for i in range(3)]
    negs = [[cos(Q[i], PASSAGES[j]) for j in ALL if j != i] for i in range(3)]
    expected, *_ = peg_reference(pos, negs, t_old=0.0, tau=0.1)
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)


def test_peg_query_weights():
    w = PEGLoss.query_weights(torch.tensor([0.1, 0.4, 0.5, -0.2]), torch.tensor(0.4))
    assert w.tolist() == pytest.approx([0.25, 1.0, 1.0, 0.0])  # below / at / above sigma; negative clamps to 0
    # sigma <= 0: the ratio is meaningless, a positive below sigma gets weight 0, at or above gets 1
    w = PEGLoss.query_weights(torch.tensor([-0.5, -0.2, 0.3]), torch.tensor(-0.2))
    assert w.tolist() == [0.0, 1.0, 1.0]
    assert PEGLoss.query_weights(torch.tensor([-0.1, 0.0]), torch.tensor(0.0)).tolist() == [0.0, 1.0]


def test_peg_t_updates_in_training_only_and_is_used_in_eval():
    loss_fn = PEGLoss(temperature=0.1, alpha=0.3, beta=BETA, in_batch_negatives=False)
    assert loss_fn.t.item() == 0.0
    batches = [(POS_COS, NEG_COS), ([0.8, 0.6, 0.5, 0.4], NEG_COS), ([0.3, 0.9, 0.6, 0.2], NEG_COS)]
    t = 0.0
    for pos, neg in batches:
        out = loss_fn(peg_batch(pos, neg))
        expected, t, *_ = peg_reference(pos, neg, t_old=t, tau=0.1, alpha=0.3)
        assert loss_fn.t.item() == pytest.approx(t, abs=1e-6)
        assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    loss_fn.eval()
    for _ in range(2):
        out = loss_fn(peg_batch())
        expected, t_used, *_ = peg_reference(POS_COS, NEG_COS, t_old=t, tau=0.1, alpha=0.3, training=False)
        assert loss_fn.t.item() == pytest.approx(t, abs=1e-6)
        assert out.components["t"] == pytest.approx(t, abs=1e-6)
        assert out.loss.item() == pytest.approx(expected, rel=1e-5)


def test_peg_t_is_saved_and_restored_with_state_dict():
    loss_fn = PEGLoss(in_batch_negatives=False)
    loss_fn(peg_batch())
    loss_fn(peg_batch([0.8, 0.6, 0.5, 0.4]))
    state = loss_fn.state_dict()
    assert "t" in state and state["t"].item() == pytest.approx(loss_fn.t.item())
    fresh = PEGLoss(in_batch_negatives=False)
    assert fresh.t.item() == 0.0
    fresh.load_state_dict(state)
    assert fresh.t.item() == loss_fn.t.item()
    fresh.set_t(0.25)
    assert fresh.t.item() == 0.25


def test_peg_batch_statistics_come_from_global_mean():
    batch = peg_batch()
    batch.global_mean = lambda values: torch.tensor(0.8)  # e.g. the other processes' positives score higher
    out = PEGLoss(temperature=0.1, beta=BETA, in_batch_negatives=False)(batch)
    assert out.components["sigma"] == pytest.approx(0.7, abs=1e-6)
    assert out.components["t"] == pytest.approx(0.4, abs=1e-6)


def _grads(loss: torch.Tensor, batch: ContrastiveBatch) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, [batch.queries, batch.passages]))


def _peg_torch_reference(batch: ContrastiveBatch, tau: float, detach_scale: bool) -> torch.Tensor:
    """Eq. 3 in torch with w_q, sigma and the masks taken from the hand formula as constants."""
    _, t, weights, _ = peg_reference(POS_COS, NEG_COS, t_old=0.0, tau=tau)
    sigma = sum(POS_COS) / 4 - BETA
    s = F.normalize(batch.queries, dim=-1) @ F.normalize(batch.passages, dim=-1).T
    total = 0.0
    for i in range(4):
        s_qp = s[i, i]
        terms = [s_qp / tau]
        for j in (4 + 2 * i, 5 + 2 * i):
            hard = POS_COS[i] >= sigma and NEG_COS[i][j - 4 - 2 * i] >= POS_COS[i]
            a = (t + (s_qp.detach() if detach_scale else s_qp)) if hard else 1.0
            terms.append(a * s[i, j] / tau)
        total = total + weights[i] * (torch.logsumexp(torch.stack(terms), 0) - s_qp / tau)
    return total / 4


@pytest.mark.parametrize("detach_scale", [True, False])
def test_peg_gradient_skips_w_q_and_sigma_and_follows_detach_option(detach_scale: bool):
    batch = peg_batch(requires_grad=True)
    out = PEGLoss(temperature=0.1, beta=BETA, in_batch_negatives=False, detach_negative_scale=detach_scale)(batch)
    got = _grads(out.loss, batch)
    same = _grads(_peg_torch_reference(batch, 0.1, detach_scale), batch)
    other = _grads(_peg_torch_reference(batch, 0.1, not detach_scale), batch)
    for g, r in zip(got, same):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(got[1], other[1], atol=1e-4)  # the option really changes the gradient


# --- CCR ---------------------------------------------------------------------------------------------

def ccr_row(query, positive: int, columns: list[int], tau: float) -> tuple[float, float]:
    """(nce of the positive, mean nce over the row's columns)."""
    nce = [nce_row(query, j, columns, tau) for j in columns]
    return nce_row(query, positive, columns, tau), sum(nce) / len(nce)


def test_ccr_paper_matches_hand_formula():
    out = CCRLoss(temperature=0.1, beta=0.5)(fixed_batch())
    rows = [ccr_row(Q[i], i, ALL, 0.1) for i in range(3)]
    expected = sum(nce - 0.5 * ccr for nce, ccr in rows) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.components["nce"] == pytest.approx(sum(r[0] for r in rows) / 3, rel=1e-5)
    assert out.components["ccr"] == pytest.approx(sum(r[1] for r in rows) / 3, rel=1e-5)
    assert set(out.components) == {"nce", "ccr", "loss", "pos_sim", "neg_sim"}
    assert all(type(v) is float for v in out.components.values())


def test_ccr_paper_equals_appendix_listing():
    batch = fixed_batch()
    s = F.normalize(batch.queries, dim=-1) @ F.normalize(batch.passages, dim=-1).T / 0.2
    s_ = F.log_softmax(s, dim=1)
    listing = (F.nll_loss(s_, batch.positive_index, reduction="none") - 0.3 * (-1) * s_.mean(dim=1)).mean()
    assert CCRLoss(temperature=0.2, beta=0.3)(batch).loss.item() == pytest.approx(listing.item(), rel=1e-5)


def test_ccr_paper_respects_candidate_mask():
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, 4] = False
    out = CCRLoss(temperature=0.1, beta=0.5)(fixed_batch(candidate_mask=mask))
    rows = [ccr_row(Q[i], i, [0, 1, 2, 3, 5] if i == 0 else ALL, 0.1) for i in range(3)]
    assert out.loss.item() == pytest.approx(sum(n - 0.5 * c for n, c in rows) / 3, rel=1e-5)


def test_ccr_authors_code_variant():
    out = CCRLoss(temperature=1.0, beta=0.1, variant="authors_code")(fixed_batch())
    group = 2  # k = 1 hard negative + the positive; no in-batch negatives
    rows = [ccr_row(Q[i], i, own_columns(i), 1.0) for i in range(3)]
    expected = sum(nce / group for nce, _ in rows) / 3 - 0.1 * sum(ccr for _, ccr in rows) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    # the reduction quirk: relative to NCE the regulariser weight is G * beta
    paper_own = CCRLoss(temperature=1.0, beta=0.1 * group, in_batch_negatives=False)(fixed_batch())
    assert out.loss.item() == pytest.approx(paper_own.loss.item() / group, rel=1e-5)
    # and it really is the authors' sum(v * L) / sum(v) over a (Q, G) matrix
    s = torch.stack([torch.tensor([cos(Q[i], PASSAGES[j]) for j in own_columns(i)]) for i in range(3)])
    logp = F.log_softmax(s, dim=1)
    matrix = torch.zeros(3, group)
    matrix[:, 0] = -logp[:, 0]
    matrix = matrix - 0.1 * (-logp.mean(dim=1, keepdim=True))
    assert out.loss.item() == pytest.approx((matrix.sum() / matrix.numel()).item(), rel=1e-5)


def test_ccr_options_are_validated():
    with pytest.raises(ConfigError):
        CCRLoss(variant="authors_code", in_batch_negatives=True)
    with pytest.raises(ConfigError):
        CCRLoss(variant="code")  # type: ignore[arg-type]
    assert CCRLoss(variant="authors_code").in_batch_negatives is False
    assert CCRLoss().in_batch_negatives is True


# --- passage sieve rule ------------------------------------------------------------------------------

@pytest.mark.parametrize("tau", [1.0, 0.05])
def test_sieve_keep_mask_equals_nce_rule(tau: float):
    torch.manual_seed(0)
    q, p, c = torch.randn(6, 8), torch.randn(6, 8), torch.randn(6, 10, 8)
    group = torch.cat([p.unsqueeze(1), c], dim=1).double()
    cosine = F.cosine_similarity(q.double().unsqueeze(1), group, dim=-1)
    nce = -F.log_softmax(cosine / tau, dim=1)
    paper = nce[:, 1:] >= nce.mean(dim=1, keepdim=True)
    authors = (nce - nce.mean(dim=1, keepdim=True))[:, 1:] > 0
    assert torch.equal(sieve_keep_mask(q, p, c), paper)
    assert torch.equal(sieve_keep_mask(q, p, c, strict=True), authors)
    assert 0 < int(paper.sum()) < paper.numel()


def test_sieve_ties_kept_by_paper_rule_removed_by_strict():
    q, p = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.6, 0.8]])
    c = p.unsqueeze(1).clone()  # a candidate identical to the positive sits exactly on the mean
    assert sieve_keep_mask(q, p, c).tolist() == [[True]]
    assert sieve_keep_mask(q, p, c, strict=True).tolist() == [[False]]


# --- registry ----------------------------------------------------------------------------------------

def test_get_loss_and_registry():
    assert set(LOSSES) == {"infonce", "peg", "ccr"}
    loss = get_loss("peg", beta=0.2)
    assert isinstance(loss, PEGLoss) and loss.config()["beta"] == 0.2
    assert isinstance(get_loss("ccr", variant="authors_code", temperature=1.0), CCRLoss)
    with pytest.raises(ConfigError, match="ccr, infonce, peg"):
        get_loss("triplet")
    with pytest.raises(ConfigError, match="temperature"):
        get_loss("infonce", temprature=0.1)


# --- every loss learns: one gradient step raises the positives' similarity ------------------------------

@pytest.mark.parametrize("make_loss", [
    lambda: InfoNCELoss(),
    lambda: InfoNCELoss(symmetric=True),
    lambda: PEGLoss(),
    lambda: PEGLoss(detach_negative_scale=False, in_batch_negatives=False),
    lambda: CCRLoss(),
    lambda: CCRLoss(temperature=1.0, beta=0.1, variant="authors_code"),
])
def test_gradient_step_raises_positive_similarity(make_loss):
    torch.manual_seed(1)
    q = torch.randn(8, 16, requires_grad=True)
    p = torch.randn(8, 16, requires_grad=True)
    n = torch.randn(8, 2, 16, requires_grad=True)
    loss_fn = make_loss()

    def pos_sim() -> float:
        return F.cosine_similarity(q, p, dim=-1).mean().item()

    before = pos_sim()
    optimizer = torch.optim.SGD([q, p, n], lr=0.05)
    for _ in range(3):
        optimizer.zero_grad()
        loss_fn(ContrastiveBatch.from_groups(q, p, n)).loss.backward()
        optimizer.step()
    assert pos_sim() > before


# --- memory-bounded (blocked) evaluation: same values, gradients, statistics and PEG state ---------------

from dataclasses import replace  # noqa: E402


from robustir.losses.base import AUTO_BLOCK_SCORES, RowMask, resolve_block_rows  # noqa: E402

BLOCK_B, BLOCK_K, BLOCK_D = 10, 2, 8
BLOCK_LOSSES = {
    "infonce": lambda: InfoNCELoss(),
    "infonce_own_group": lambda: InfoNCELoss(in_batch_negatives=False),
    "infonce_symmetric": lambda: InfoNCELoss(symmetric=True, temperature=0.1),
    "infonce_symmetric_dot": lambda: InfoNCELoss(symmetric=True, similarity="dot", temperature=0.5),
    "infonce_gte": lambda: InfoNCELoss(denominator="gte", temperature=0.1),
    "infonce_false_negative_margin": lambda: InfoNCELoss(false_negative_margin=0.0, temperature=0.1),
    "infonce_gte_false_negative_margin": lambda: InfoNCELoss(denominator="gte", false_negative_margin=0.1),
    "peg": lambda: PEGLoss(temperature=0.1, beta=0.1),
    "peg_grad_scale_own_group": lambda: PEGLoss(detach_negative_scale=False, in_batch_negatives=False),
    "ccr_paper": lambda: CCRLoss(beta=0.1),
    "ccr_authors_code": lambda: CCRLoss(temperature=1.0, beta=0.1, variant="authors_code"),
}


def blocked_inputs(seed: int = 0, b: int = BLOCK_B, k: int = BLOCK_K, d: int = BLOCK_D):
    """Queries, positives near their query, hard negatives a bit further: PEG then scales some negatives."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=g)
    p = q + 0.8 * torch.randn(b, d, generator=g)
    n = q.unsqueeze(1) + 1.0 * torch.randn(b, k, d, generator=g)
    return q, p, n


def make_blocked_batch(q, p, n, mask: str | None = None, block_rows=None, all_queries_extra: int = 0):
    q, p, n = (x.detach().clone().requires_grad_() for x in (q, p, n))
    batch = ContrastiveBatch.from_groups(q, p, n)
    leaves = [q, p, n]
    if mask is not None:
        b, cols = q.shape[0], batch.passages.shape[0]
        keep = torch.rand(b, cols, generator=torch.Generator().manual_seed(5)) > 0.25
        batch.candidate_mask = keep if mask == "tensor" else RowMask((b, cols), lambda s, e: keep[s:e])
    if all_queries_extra:  # this process's queries sit inside a larger global batch (offset > 0)
        other = torch.randn(all_queries_extra, q.shape[1], generator=torch.Generator().manual_seed(9))
        other.requires_grad_()
        batch.all_queries = torch.cat([other[:2], q, other[2:]])
        batch.query_offset = 2
        leaves.append(other)
    return replace(batch, block_rows=block_rows), leaves


def run_blocked(name: str, block_rows, mask=None, t0: float = 0.3, training: bool = True, all_queries_extra=0):
    loss_fn = BLOCK_LOSSES[name]()
    loss_fn.train(training)
    if isinstance(loss_fn, PEGLoss):
        loss_fn.set_t(t0)
    batch, leaves = make_blocked_batch(*blocked_inputs(), mask=mask, block_rows=block_rows,
                                       all_queries_extra=all_queries_extra)
    out = loss_fn(batch)
    grads = torch.autograd.grad(out.loss, leaves, allow_unused=True)
    return out, [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)], loss_fn


def assert_blocked_equal(name: str, block_rows, **kw) -> None:
    ref, ref_grads, ref_fn = run_blocked(name, None, **kw)
    got, got_grads, got_fn = run_blocked(name, block_rows, **kw)
    torch.testing.assert_close(got.loss, ref.loss, atol=1e-6, rtol=1e-6)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
    assert got.components.keys() == ref.components.keys()
    for key, value in ref.components.items():
        assert got.components[key] == pytest.approx(value, rel=1e-6, abs=1e-6, nan_ok=True), key
    if isinstance(ref_fn, PEGLoss):
        assert torch.equal(got_fn.t, ref_fn.t)  # the momentum state ends identical, bit for bit


@pytest.mark.parametrize("block_rows", [1, 3, 4, BLOCK_B, 64])  # 3 and 4 do not divide 10 rows
@pytest.mark.parametrize("name", list(BLOCK_LOSSES))
def test_blocked_loss_equals_whole_batch(name: str, block_rows: int) -> None:
    assert_blocked_equal(name, block_rows)


@pytest.mark.parametrize("mask", ["tensor", "row_mask"])
@pytest.mark.parametrize("block_rows", [1, 3])
@pytest.mark.parametrize("name", list(BLOCK_LOSSES))
def test_blocked_loss_equals_whole_batch_with_candidate_mask(name: str, block_rows: int, mask: str) -> None:
    assert_blocked_equal(name, block_rows, mask=mask)


@pytest.mark.parametrize("name", ["infonce_symmetric", "infonce_symmetric_dot"])
def test_blocked_symmetric_infonce_with_global_queries_and_offset(name: str) -> None:
    for block_rows in (1, 3):
        assert_blocked_equal(name, block_rows, all_queries_extra=5)


@pytest.mark.parametrize("name", ["peg", "peg_grad_scale_own_group"])
def test_blocked_peg_eval_mode_and_statistics_exercised(name: str) -> None:
    assert_blocked_equal(name, 3, training=False)
    out, _, loss_fn = run_blocked(name, 3)
    # both branches of eq. 4 and 5 are really exercised by the blocked batch
    assert out.components["share_scaled_negatives"] > 0 and out.components["mean_w_q"] < 1
    assert float(loss_fn.t) != 0.3  # t moved, once
    _, _, eval_fn = run_blocked(name, 3, training=False)
    assert float(eval_fn.t) == pytest.approx(0.3)


def test_blocked_loss_without_grad_and_with_a_row_mask_is_the_tensor_masks_loss() -> None:
    for name in BLOCK_LOSSES:
        with torch.no_grad():
            whole = BLOCK_LOSSES[name]()(make_blocked_batch(*blocked_inputs(), mask="tensor")[0])
            blocked = BLOCK_LOSSES[name]()(make_blocked_batch(*blocked_inputs(), mask="row_mask", block_rows=2)[0])
        assert float(blocked.loss) == pytest.approx(float(whole.loss), rel=1e-6, abs=1e-6), name


def test_resolve_block_rows() -> None:
    assert resolve_block_rows(10, 36, None) == 10  # small: whole batch
    assert resolve_block_rows(10, 36, 3) == 3 and resolve_block_rows(10, 36, 64) == 10
    big_columns = 98_304
    rows = resolve_block_rows(16_384, big_columns, None)
    assert rows == AUTO_BLOCK_SCORES // big_columns and rows * big_columns <= AUTO_BLOCK_SCORES
    assert resolve_block_rows(4, 10 * AUTO_BLOCK_SCORES, None) == 1
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="block_rows"):
            resolve_block_rows(10, 36, bad)


from helpers import LargestTensor  # noqa: E402


@pytest.mark.parametrize("name", list(BLOCK_LOSSES))
def test_blocked_loss_never_creates_a_rows_by_columns_tensor(name: str) -> None:
    b, k, d, block = 12, 2, 4, 3
    full = b * b * (1 + k)  # the (b, N) score matrix

    def largest(block_rows, mask: str | None) -> LargestTensor:
        batch, leaves = make_blocked_batch(*blocked_inputs(b=b, k=k, d=d), mask=mask, block_rows=block_rows)
        loss_fn = BLOCK_LOSSES[name]()
        with LargestTensor() as mode:
            out = loss_fn(batch)
            out.loss.backward()
        assert all(x.grad is not None for x in leaves)
        return mode

    assert largest(None, "tensor").numel >= full  # the whole-batch computation does build it (instrument check)
    for mask in (None, "row_mask"):
        mode = largest(block, mask)
        assert mode.numel < full, (mode.numel, mode.shape)
        # a block's logits: its rows x every column (GTE's denominator: q-d, q-q, d-q, d-d columns)
        columns = 2 * (b * (1 + k) + b) if "gte" in name else b * (1 + k)
        assert mode.numel <= max(block * columns, b * (1 + k) * d), (mode.numel, mode.shape)


@pytest.mark.parametrize("name", list(BLOCK_LOSSES))
def test_blocked_loss_keeps_no_block_intermediates_for_backward(name: str) -> None:
    """What autograd keeps between forward and backward: whole batch, several (b, N) tensors; blocked, only the
    (b, d) / (N, d) embeddings and per-row vectors (checkpointing recomputes each block in the backward)."""
    b, k, d = 24, 2, 4
    n = b * (1 + k)

    def saved_bytes(block_rows) -> int:
        """Bytes of the distinct storages autograd saves for backward (a block's inputs are views of them)."""
        batch, _ = make_blocked_batch(*blocked_inputs(b=b, k=k, d=d), mask="tensor", block_rows=block_rows)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = BLOCK_LOSSES[name]()(batch)
        out.loss.backward()
        return sum(saved.values())

    score_matrix = 4 * b * n  # bytes of one float32 (b, N) matrix
    assert saved_bytes(None) > score_matrix  # whole batch: (b, N) logits, softmax, masks
    blocked = saved_bytes(3)
    assert blocked == saved_bytes(1) == saved_bytes(5)  # independent of the block size: nothing per block
    assert blocked < score_matrix  # the embeddings (raw and normalised), their norms, the labels
