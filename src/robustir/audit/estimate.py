"""The false-positive rate of a training set, estimated from teacher scores and calibrated on planted nulls.

Every (query, positive) pair gets two statistics from the teacher (:mod:`robustir.audit.run` computes them):

``u``   the pair's *random p-value*: ``(1 + #{r in R : s(q, r) >= s(q, p)}) / (K + 1)`` over a sample ``R`` of
        ``K`` random passages. If the positive is itself a random passage (a mislabelled pair, a failed
        generation), its rank among ``R`` is uniform, so ``u`` is uniform on ``(0, 1]``; a true positive
        outscores nearly every random passage (``u`` near ``1 / (K + 1)``).
``gap`` how far the best *other* passage of the search pool (the corpus, else the audited passages) scores above
        the positive: ``max_{x not a positive} s(q, x) - s(q, p)``. A hard false positive (a lexical neighbour
        standing in for the real answer) has the real answer, or something as good, above it.

Random-like false positives (:func:`random_rate`) are Storey's null share of the ``u`` values: clean pairs
(almost) never fall in ``u > lambda``, nulls do with probability ``1 - lambda`` exactly, so
``pi_r = P(u > lambda) / (1 - lambda)``.

Hard-like false positives (:func:`hard_rate`) are the share of pairs in the region ``gap > t, u <= MU`` beyond
what the other components put there. ``t`` is the median ``gap`` of *planted hard nulls* -- each record's first negative
standing in as its positive -- so ``F_h = P(gap > t | hard null) = 1/2``; ``F_r`` is the same share for planted
random nulls (a random passage standing in); ``c`` is the share of *trusted* pairs (a clean reference, the
evaluation split's qrels) in the region -- how often the teacher ranks a true positive below another passage by
that much. Then ``P(gap > t) = pi_r F_r + pi_h F_h + (1 - pi_r - pi_h) c``, solved for ``pi_h``. Without a
reference ``c = 0``: a weak teacher's misses are then counted as false positives, so ``pi_h`` is an upper bound
and is reported as one.

The interval is a percentile bootstrap over the pairs, the planted nulls and the reference together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["LAMBDA", "random_rate", "hard_rate", "RateEstimate", "estimate_rates", "null_tail", "near_miss_reading",
           "MIN_SEPARATION"]

#: Storey's lambda: a pair counts towards the random-like rate when half of the random passages outscore it
LAMBDA = 0.5
#: the hard-like region also asks ``u <= MU`` (the positive beats 90 % of random passages): random nulls rarely land
#: there (10 %), so an error in the random-like share barely moves the hard-like one (with ``u`` unrestricted it was
#: amplified about 3x: +7.5 points hard-like at 40 % planted random false positives on SciFact)
MU = 0.1


#: how much more often a planted null must land in the hard-like region than a trusted positive for its share to be
#: read (``F_h - c``): the estimate's standard error is about the reference share's divided by this (0.02-0.027 /
#: 0.2 ~ 0.1-0.13 with SciFact's 339 reference pairs) -- below it an estimate is noise and the audit says it cannot
#: tell. Measured with the bundled MiniLM on SciFact (docs/audit.md): first-negative nulls of BM25 pools 0.25-0.29
#: (read), of dense pools mined by the teacher itself -0.02-0.11 (their estimates ranged 0-26 % with intervals up to
#: 81 % on the same data: noise), near-miss nulls -0.06-0.0
MIN_SEPARATION = 0.2


def null_tail(k: int, lam: float = LAMBDA) -> float:
    """``P(u > lam)`` when the positive is exchangeable with the ``k`` random passages: its rank among the
    ``k + 1`` is uniform, so ``u = (1 + j) / (k + 1)`` for ``j`` uniform on ``0..k``."""
    j = np.arange(k + 1)
    return float(((1 + j) / (k + 1) > lam).mean())


def random_rate(u: np.ndarray, k: int, lam: float = LAMBDA) -> float:
    """Storey's estimate of the share of pairs whose positive is a random passage (clipped to [0, 1])."""
    u = np.asarray(u, dtype=np.float64)
    if u.size == 0:
        return float("nan")
    return float(min(1.0, (u > lam).mean() / null_tail(k, lam)))


def _pairs(x) -> np.ndarray:
    """``(n, 2)`` rows of ``(gap, u)``; a 1-D array of gaps gets ``u = 0``."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 1:
        return np.stack([x, np.zeros_like(x)], axis=1)
    return x.reshape(-1, 2)


def _share(x: np.ndarray, t: float) -> float:
    return float(((x[:, 0] > t) & (x[:, 1] <= MU)).mean()) if len(x) else float("nan")


def hard_rate(gap: np.ndarray, hard_null: np.ndarray, random_null: np.ndarray, reference: np.ndarray | None,
              pi_r: float) -> tuple[float, float, dict]:
    """``(pi_h, threshold t, parts)``: the hard-like share of pairs beyond the random-like share ``pi_r``.

    Each argument is ``(gap, u)`` rows (or gaps alone, read as ``u = 0``); the region is ``gap > t`` and
    ``u <= MU``, ``t`` the hard nulls' median gap."""
    gap, hard_null = _pairs(gap), _pairs(hard_null)
    random_null = _pairs(random_null)
    if len(gap) == 0 or len(hard_null) == 0:
        return float("nan"), float("nan"), {}
    t = float(np.median(hard_null[:, 0]))
    observed = _share(gap, t)
    f_h = _share(hard_null, t)
    f_r = _share(random_null, t) if len(random_null) else 1.0
    c = _share(_pairs(reference), t) if reference is not None and len(reference) else 0.0
    parts = {"threshold": t, "observed": observed, "hard_null": f_h, "random_null": f_r, "reference": c}
    if f_h - c < MIN_SEPARATION:  # the teacher cannot tell a hard null from a trusted positive: not identifiable
        return float("nan"), t, parts
    pi_h = (observed - pi_r * f_r - (1.0 - pi_r) * c) / (f_h - c)
    return float(min(max(pi_h, 0.0), max(0.0, 1.0 - pi_r))), t, parts


@dataclass
class RateEstimate:
    """The estimated false-positive share of the pairs, with its parts and 95 % bootstrap intervals."""

    rate: float
    low: float
    high: float
    random_like: float
    random_like_low: float
    random_like_high: float
    hard_like: float
    hard_like_low: float
    hard_like_high: float
    upper_bound: bool
    """True when no clean reference was given: the hard-like part counts the teacher's misses too."""
    lower_bound: bool
    """True when the hard-like part could not be estimated: ``rate`` is the random-like part alone (issue 50: never
    read it as "clean")."""
    pairs: int
    random_passages: int
    hard_nulls: int
    reference_pairs: int
    parts: dict
    """The terms of the hard-like equation (threshold, observed share, null and reference shares)."""
    check: dict
    """Calibration check: the share of planted random nulls with ``u > lambda`` (expected :func:`null_tail`)."""

    def to_json(self) -> dict:
        """JSON-ready: floats rounded, a value that could not be estimated None (JSON has no NaN)."""
        def clean(v):
            if isinstance(v, float):
                return round(v, 6) if np.isfinite(v) else None
            return {k: clean(x) for k, x in v.items()} if isinstance(v, dict) else v

        return {k: clean(v) for k, v in asdict(self).items()}

    def text(self) -> str:
        """``"31.2 % (95 % interval 27.0-35.1)"``, with the parts."""
        bound = " (an upper bound: no clean reference)" if self.upper_bound else ""
        hard = (f"{100 * self.hard_like:.1f} % hard-like{bound}" if np.isfinite(self.hard_like) else
                "hard-like not estimated (" + ("no negatives to plant hard nulls from" if not self.hard_nulls else
                                                "the teacher scores hard nulls like the reference's positives")
                + ": the rate is a lower bound)")
        return (f"{100 * self.rate:.1f} % (95 % interval {100 * self.low:.1f}-{100 * self.high:.1f}) of "
                f"{self.pairs} pairs: {100 * self.random_like:.1f} % random-like, {hard}")


def estimate_rates(u: np.ndarray, gap: np.ndarray, *, k: int, hard_null: np.ndarray, random_null_gap: np.ndarray,
                   random_null_u: np.ndarray | None = None, reference: np.ndarray | None = None,
                   bootstrap: int = 1000, seed: int = 0) -> RateEstimate:
    """Both rates and their sum, each with a 95 % percentile-bootstrap interval (``bootstrap`` resamples; 0 = none).

    ``u`` / ``gap``: per pair of the data; ``hard_null`` / ``random_null_gap`` / ``reference``: ``(gap, u)`` rows of
    the planted nulls and of trusted pairs (None: no reference; gaps alone are read with ``u = 0``);
    ``random_null_u``: ``u`` of the planted random nulls (only for the calibration check).
    """
    u = np.asarray(u, dtype=np.float64)
    gap = np.stack([np.asarray(gap, dtype=np.float64), u], axis=1)
    hard_null = _pairs(hard_null)
    random_null_gap = _pairs(random_null_gap)
    ref = None if reference is None or len(reference) == 0 else _pairs(reference)

    def point(ui, gi, hi, ri, fi) -> tuple[float, float]:
        pi_r = random_rate(ui, k)
        pi_h, _, _ = hard_rate(gi, hi, ri, fi, pi_r)
        return pi_r, pi_h

    pi_r = random_rate(u, k)
    pi_h, _, parts = hard_rate(gap, hard_null, random_null_gap, ref, pi_r)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(bootstrap if u.size else 0):
        rows = rng.integers(0, u.size, u.size)
        hard = hard_null[rng.integers(0, len(hard_null), len(hard_null))] if len(hard_null) else hard_null
        rand = random_null_gap[rng.integers(0, len(random_null_gap), len(random_null_gap))] \
            if len(random_null_gap) else random_null_gap
        refs = ref[rng.integers(0, len(ref), len(ref))] if ref is not None else None
        draws.append(point(u[rows], gap[rows], hard, rand, refs))
    draws_arr = np.asarray(draws, dtype=np.float64).reshape(-1, 2)

    def interval(values: np.ndarray, fallback: float) -> tuple[float, float]:
        values = values[np.isfinite(values)]
        if values.size == 0:
            return fallback, fallback
        return float(np.quantile(values, 0.025)), float(np.quantile(values, 0.975))

    hard_ok = np.isfinite(pi_h)
    total = pi_r + (pi_h if hard_ok else 0.0)
    r_low, r_high = interval(draws_arr[:, 0], pi_r)
    h_low, h_high = interval(draws_arr[:, 1], pi_h)
    # without a hard-like estimate the total is the random-like part alone, and so is its interval
    t_low, t_high = interval(draws_arr[:, 0] + np.nan_to_num(draws_arr[:, 1]), total) if hard_ok else (r_low, r_high)
    check = {}
    if random_null_u is not None and len(random_null_u):
        check = {"random_nulls_over_lambda": float((np.asarray(random_null_u) > LAMBDA).mean()),
                 "expected": null_tail(k)}
    return RateEstimate(rate=total, low=t_low, high=t_high, random_like=pi_r, random_like_low=r_low,
                        random_like_high=r_high, hard_like=pi_h, hard_like_low=h_low, hard_like_high=h_high,
                        upper_bound=ref is None, lower_bound=not hard_ok, pairs=int(u.size), random_passages=k, hard_nulls=len(hard_null),
                        reference_pairs=0 if ref is None else len(ref), parts=parts, check=check)


def near_miss_reading(near: RateEstimate) -> dict:
    """Whether the teacher can read *near-miss* false positives -- a positive replaced by a passage as near the query
    as the teacher's own nearest non-positive (what an LLM query too generic for its passage, a wrong click or a dense
    miner's top hit gives) -- and the estimate when it can.

    ``near`` is :func:`estimate_rates` calibrated on near-miss nulls (each record's best other pool passage standing
    in as its positive). Those have the smallest gaps any wrong positive can have, so where the teacher ranks trusted
    positives below their nearest other passage about as often as it ranks a near-miss null there (``F_h - c`` under
    :data:`MIN_SEPARATION`), near misses are invisible to it: their share is *unknown*, and the audit says so instead
    of counting it as 0. Measured with the bundled MiniLM on SciFact: near-miss nulls 50 % over the threshold, trusted
    positives 56 % (docs/audit.md)."""
    parts = near.parts or {}
    f_h, c = parts.get("hard_null"), parts.get("reference")
    separation = (f_h - c) if f_h is not None and c is not None else float("nan")
    readable = bool(np.isfinite(near.hard_like) and not near.upper_bound)  # hard_rate applies MIN_SEPARATION
    if readable:
        why = (f"near misses read: {100 * near.hard_like:.1f} % (95 % interval {100 * near.hard_like_low:.1f}-"
               f"{100 * near.hard_like_high:.1f})")
    elif near.upper_bound or c is None:
        why = ("near misses cannot be read without a clean reference (give --eval-data with trusted qrels): their "
               "share is unknown")
    elif not np.isfinite(separation):
        why = "near misses cannot be read: the search pool has no other passage to stand in for one"
    else:
        why = (f"near misses cannot be read by this teacher: it ranks trusted positives below their nearest other "
               f"passage {100 * c:.0f} % of the time and a planted near miss {100 * f_h:.0f} % of the time, so a "
               "near-miss positive looks like a true one to it; their share is unknown, not 0")
    return {**near.to_json(), "readable": readable,
            "separation": round(float(separation), 6) if np.isfinite(separation) else None, "why": why}
