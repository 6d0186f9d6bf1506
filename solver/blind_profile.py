"""A generator's position profile from its answers alone, without gold labels.

The signal: which passage an answer came from. For a question whose passages were shown in a
randomised order, the answer is *attributed* (``attribute``) to the passages that support it:

- **containment**: the passages holding the whole normalised answer (lower case, punctuation
  and articles dropped, whitespace collapsed: the SQuAD/NQ normalisation);
- else **token overlap**: the answer's content tokens (not a stop word, not already in the
  question: a token the question holds points at no passage) are looked up in each passage;
  the passages holding the largest share, if that share reaches ``threshold``, support it.

One supporting passage takes the answer's whole weight; ``m`` of them take ``1/m`` each, unless
a scoring model breaks the tie (``break_tie``: the passage under which it finds the answer most
likely); none (a refusal, an answer from the model's own memory, a paraphrase) carries no
weight. All are counted, so a report says how much of the traffic was informative.

The estimate: a position-based model (the click model of unbiased learning to rank,
Joachims et al. 2017; Agarwal et al. 2019): an answer comes from the passage in slot ``k``
with probability proportional to ``theta_k * r_d``, the slot's weight times the passage's
usefulness. Because every question's placement is uniformly random, a passage's usefulness is
independent of its slot, so the expected attributed weight in slot ``k`` is proportional to
``theta_k``: the estimate is each slot's share of the attributed weight, with a bootstrap over
questions for its intervals and covariance. Whether it may place passages is decided by the
rule ``auto`` applies to the profiles it learns (``solver.trust.verdict``): distinguishable
from flat with stable top slots, or shown flat, else undecided.

Flatness is tested by randomisation, not by a Wald test on the bootstrap covariance: with few
attributed answers, a slot no answer came from has zero bootstrap variance, and the Wald test
read p = 2e-10 on 15 answers that showed no preference (45 live SmolLM2 questions). Because
each placement was uniformly random, under "no slot preference" each answer's slot weights are
a uniformly random permutation of themselves; the p-value is the share of
``FLAT_TEST_RESAMPLES`` such permutations whose chi-square distance from flat reaches the
observed one. The test is exact at any number of answers (its false-positive rate is alpha).
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from solver.trust import Drift, TrustRules, Verdict, top_slots, verdict

FloatArray = NDArray[np.float64]
AttributionKind = Literal["contained", "overlap", "none"]

DEFAULT_THRESHOLD = 0.6
"""Share of an answer's content tokens a passage must hold to support it (no containment)."""
FLAT_TEST_RESAMPLES = 999
"""Permutations in the flatness test: p-values in steps of 1/1000."""
CHUNK_BYTES = 16 << 20
"""About the most the bootstrap and the flatness test copy at once (``_chunk``): their
peak allocation is bounded by this, not by resamples x answers x slots."""
_FLOOR = 1e-3
"""Smallest stored slot weight: a slot no answer came from yet still ranks."""
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans(dict.fromkeys(string.punctuation, " "))
# Function words carry no evidence of where an answer came from (every passage has them).
_STOP_WORDS = (
    "a an the of in on at to for from by with and or but is are was were be been being it its",
    "this that these those as not no yes i you he she they we his her their our my your which",
    "who whom what when where why how there here do does did has have had will would can could",
    "may might shall should than then so if about into over under after before during between",
    "out up down also only very just any some all each other such own same too more most s t",
    "don know answer document documents passage passages question according based provided",
)
_STOP = frozenset(" ".join(_STOP_WORDS).split())


def normalize(text: str) -> str:
    """Lower case, punctuation and articles removed, whitespace collapsed."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


@dataclass(frozen=True)
class Attribution:
    """The passages (indices into the question's passages) an answer is attributed to."""

    passages: tuple[int, ...]
    kind: AttributionKind
    overlap: float
    """The best passage's share of the answer's content tokens (1.0 when contained)."""
    tied: int = 0
    """Passages that held the answer equally before ``break_tie`` chose among them (0: no
    tie was broken)."""

    @property
    def weight(self) -> float:
        """The answer's weight: 1 spread over its passages, 0 when none supports it."""
        return 1.0 if self.passages else 0.0


def break_tie(found: Attribution, loglik: Sequence[float]) -> Attribution:
    """``found`` with its tie broken: of the passages that hold the answer equally, the one
    under which the scoring model finds the answer most likely (``loglik[j]``: ``log P(answer |
    passage found.passages[j], question)``); passages within 1e-9 of the best stay split.

    On the labelled runs' answers (``eval/attribution_tiebreak.py``, every call a uniformly
    random placement) the pick was a gold passage +0.30 [+0.18, +0.43] (SmolLM2's answers) and
    +0.10 [+0.01, +0.18] (Gemma's) more often than the equal split's share.

    Raises:
        ValueError: not one likelihood per attributed passage, or one not finite.
    """
    if len(found.passages) < 2:
        return found
    ll = np.asarray(loglik, dtype=np.float64)
    if ll.shape != (len(found.passages),) or not np.isfinite(ll).all():
        raise ValueError(f"need {len(found.passages)} finite log-likelihoods, got {list(loglik)}")
    keep = tuple(p for p, v in zip(found.passages, ll, strict=True) if v >= ll.max() - 1e-9)
    return Attribution(keep, found.kind, found.overlap, tied=len(found.passages))


def attribute(
    answer: str,
    passages: Sequence[str],
    *,
    question: str = "",
    threshold: float = DEFAULT_THRESHOLD,
) -> Attribution:
    """The passages that support ``answer`` (module docstring).

    Raises:
        ValueError: ``threshold`` outside (0, 1].
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    norm = normalize(answer)
    if not norm:
        return Attribution((), "none", 0.0)
    texts = [normalize(p) for p in passages]
    asked = set(normalize(question).split())
    content = [t for t in dict.fromkeys(norm.split()) if t not in _STOP and t not in asked]
    if not content:
        # Nothing the question does not already say: the answer points at no passage.
        return Attribution((), "none", 0.0)
    padded = f" {norm} "
    hits = tuple(i for i, t in enumerate(texts) if padded in f" {t} ")
    if hits:
        return Attribution(hits, "contained", 1.0)
    shares = [len(set(content) & set(t.split())) / len(content) for t in texts]
    best = max(shares, default=0.0)
    if best < threshold:
        return Attribution((), "none", best)
    return Attribution(tuple(i for i, s in enumerate(shares) if s == best), "overlap", best)


def slot_weights(
    orders: Sequence[Sequence[int]], attributed: Sequence[Sequence[int]]
) -> FloatArray:
    """Questions x slots: each question's answer weight spread over the slots its supporting
    passages were shown in (``orders[i][k]`` is the passage in slot ``k``).

    Raises:
        ValueError: orders of different lengths, or an attributed passage not shown.
    """
    if len(orders) != len(attributed):
        raise ValueError(f"{len(orders)} orders for {len(attributed)} attributions")
    slots = {len(o) for o in orders}
    if len(slots) > 1:
        raise ValueError(f"placements of different slot counts {sorted(slots)}")
    n = slots.pop() if slots else 0
    out = np.zeros((len(orders), n))
    for i, (order, hits) in enumerate(zip(orders, attributed, strict=True)):
        where = {p: k for k, p in enumerate(order)}
        missing = [p for p in hits if p not in where]
        if missing:
            raise ValueError(f"question {i}: passages {missing} were not shown")
        for p in hits:
            out[i, where[p]] += 1.0 / len(hits)
    return out


def _chunk(resamples: int, rows: int, slots: int) -> int:
    """Resamples drawn at once so that one chunk's rows x slots copies stay near
    ``CHUNK_BYTES`` (at least one resample)."""
    return max(1, min(resamples, CHUNK_BYTES // max(1, rows * slots * 8)))


def flat_test(weights: FloatArray, rng: np.random.Generator) -> float:
    """Randomisation p-value of "no slot preference" for answers placed uniformly at random
    (module docstring): each row's slot weights permuted independently, the chi-square distance
    of the summed weights from flat compared with the observed one.

    The permutations are drawn ``_chunk`` resamples at a time, so the peak allocation is
    about ``CHUNK_BYTES`` whatever ``FLAT_TEST_RESAMPLES`` (all at once it was resamples x
    answers x slots: 1.5 GB at 2,000 answers x 100 slots). ``Generator.permuted`` shuffles
    the rows in order, so the chunks draw the same permutations as one call: the p-value of
    a seed is unchanged."""
    m, slots = weights.shape
    expected = weights.sum() / slots

    def distance(totals: FloatArray) -> FloatArray:
        return np.asarray(((totals - expected) ** 2).sum(axis=-1) / expected, dtype=np.float64)

    observed = distance(weights.sum(axis=0))
    step = _chunk(FLAT_TEST_RESAMPLES, m, slots)
    as_far = 0
    for start in range(0, FLAT_TEST_RESAMPLES, step):
        n = min(step, FLAT_TEST_RESAMPLES - start)
        null = rng.permuted(np.broadcast_to(weights, (n, m, slots)), axis=2)
        as_far += int((distance(null.sum(axis=1)) >= observed - 1e-12).sum())
        del null
    return (1 + as_far) / (1 + FLAT_TEST_RESAMPLES)


def _bootstrap_sums(
    informative: FloatArray, resamples: int, rng: np.random.Generator
) -> FloatArray:
    """Each bootstrap resample's summed slot weights (the answers drawn with replacement),
    ``_chunk`` resamples at a time: the same draws and sums as
    ``informative[rng.integers(0, m, (resamples, m))].sum(axis=1)`` without its resamples x
    answers x slots copy (320 MB at 200 x 2,000 x 100)."""
    m, slots = informative.shape
    out = np.empty((resamples, slots))
    step = _chunk(resamples, m, slots)
    for start in range(0, resamples, step):
        picks = rng.integers(0, m, size=(min(step, resamples - start), m))
        out[start : start + picks.shape[0]] = informative[picks].sum(axis=1)
    return out


@dataclass(frozen=True)
class BlindProfile:
    """The position-based estimate of a generator's slot weights and its verdict."""

    slots: int
    questions: int
    """Questions answered (attributed or not)."""
    attributed: float
    """Summed answer weight: questions whose answer was attributed to some passage."""
    single: int
    """Questions attributed to exactly one passage."""
    multiple: int
    """Questions attributed to several passages (their weight split)."""
    share: tuple[float, ...]
    """Each slot's share of the attributed weight: the estimate of ``theta`` (sums to 1)."""
    low: tuple[float, ...]
    high: tuple[float, ...]
    """Percentile bootstrap interval (1 - alpha) of each slot's share, questions resampled."""
    coefficients: tuple[float, ...]
    """The placement weights: ``share`` floored at 0.001, summing to 1."""
    covariance: tuple[tuple[float, ...], ...]
    verdict: Verdict
    reason: str
    flat_p: float
    spread: float
    spread_upper: float
    stability: float
    top_slots: tuple[int, ...]
    placement_slots: int
    resamples: int

    @property
    def trusted(self) -> bool:
        return self.verdict != "undecided"


def fit_blind_profile(
    weights: ArrayLike,
    *,
    placement_slots: int | None = None,
    rules: TrustRules | None = None,
    seed: int = 0,
) -> BlindProfile:
    """The slot shares of a questions x slots weight matrix (``slot_weights``), their bootstrap
    intervals and the trust verdict (module docstring). Rows of zero weight (unattributed
    answers) count as questions but carry no information.

    Raises:
        ValueError: not a matrix of >= 2 slots, negative weights, or a row summing above 1.
    """
    rules = rules or TrustRules()
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 2 or w.shape[1] < 2:
        raise ValueError(f"need a questions x slots matrix with >= 2 slots, got {w.shape}")
    if (w < 0).any() or (w.sum(axis=1) > 1.0 + 1e-9).any():
        raise ValueError("each question's weights must be >= 0 and sum to at most 1")
    n_q, L = w.shape
    placement = placement_slots or L
    rows = w.sum(axis=1)
    informative = w[rows > 0]
    m = informative.shape[0]
    k = min(rules.top_slots, placement)
    flat = np.full(L, 1.0 / L)
    if m == 0:
        return BlindProfile(
            L, n_q, 0.0, 0, 0, tuple(flat), (0.0,) * L, (1.0,) * L, tuple(flat),
            tuple(tuple(0.0 for _ in range(L)) for _ in range(L)), "undecided",
            "no answer was attributed to a passage yet", 1.0, 0.0, float("inf"), 0.0,
            top_slots(flat, placement, k), placement, rules.resamples,
        )  # fmt: skip
    share = informative.sum(axis=0) / informative.sum()
    rng = np.random.default_rng(seed)
    sums = _bootstrap_sums(informative, rules.resamples, rng)  # resamples x slots
    boot = sums / sums.sum(axis=1, keepdims=True)
    cov = np.cov(boot, rowvar=False)
    low, high = np.percentile(boot, [50 * rules.alpha, 100 - 50 * rules.alpha], axis=0)
    flat_p = flat_test(informative, rng)
    spread = float(L * (share.max() - share.min()))
    spread_upper = float(np.quantile(L * (boot.max(axis=1) - boot.min(axis=1)), 1 - rules.alpha))
    top = top_slots(share, placement, k)
    stability = float(np.mean([top_slots(b, placement, k) == top for b in boot]))
    decided, reason = verdict(
        runs=m, flat_p=flat_p, stability=stability, spread_upper=spread_upper, k=k, rules=rules,
        unit="attributed answer(s)",
    )  # fmt: skip
    floored = np.maximum(share, _FLOOR)
    counts = (informative > 0).sum(axis=1)
    return BlindProfile(
        slots=L,
        questions=n_q,
        attributed=float(rows.sum()),
        single=int((counts == 1).sum()),
        multiple=int((counts > 1).sum()),
        share=tuple(float(s) for s in share),
        low=tuple(float(v) for v in low),
        high=tuple(float(v) for v in high),
        coefficients=tuple(float(c) for c in floored / floored.sum()),
        covariance=tuple(tuple(float(v) for v in row) for row in np.atleast_2d(cov)),
        verdict=decided,
        reason=reason,
        flat_p=flat_p,
        spread=spread,
        spread_upper=spread_upper,
        stability=stability,
        top_slots=top,
        placement_slots=placement,
        resamples=rules.resamples,
    )


def _homogeneity(newer: FloatArray, total: FloatArray) -> FloatArray:
    """The chi-square statistic of a 2 x slots table (the newer answers' slot weights
    ``newer``, resamples x slots, against the rest of ``total``): 0 where one side holds no
    weight."""
    big = total.sum()
    t = newer.sum(axis=-1)
    used = total > 0
    d = newer[..., used] - t[..., None] * total[used] / big
    inside = (t > 0) & (t < big)
    scale = np.where(inside, big**2 / np.where(inside, t * (big - t), 1.0), 0.0)
    return np.asarray((d**2 / total[used]).sum(axis=-1) * scale, dtype=np.float64)


def drift(
    older: ArrayLike,
    newer: ArrayLike,
    *,
    held: Verdict,
    held_top: Sequence[int],
    placement_slots: int | None = None,
    rules: TrustRules | None = None,
    seed: int = 0,
) -> Drift:
    """Whether a trusted label-free profile's ``newer`` answers (questions x slots, as
    ``fit_blind_profile`` takes) disagree with the ``older`` ones, decided as
    ``solver.trust.drift`` decides it for ``auto``'s explore runs against its profile: a test
    of equal profiles at ``drift_alpha``, and a change that matters: for a ``shaped``
    profile (top slots ``held_top``), the newer answers put other top slots first; for a
    ``flat`` one, the newer answers are not flat (``flat_test``).

    The test of equal profiles is by randomisation, as the flatness test is and for its
    reason (a Wald test on bootstrap covariances reads sparse slots as certain): the
    chi-square homogeneity statistic of the newer answers' slot weights against the older
    ones', compared with random splits of all the answers into sets of the same sizes (9,999
    at ``drift_alpha`` 0.001: p-values in steps of 0.0001). While the generator is unchanged
    its answers are exchangeable, so the p-value is exact. Either set with
    fewer than ``drift_min_runs`` attributed answers is no evidence: no drift.

    Raises:
        ValueError: not two matrices of the same >= 2 slots.
    """
    rules = rules or TrustRules()
    old = np.asarray(older, dtype=np.float64)
    new = np.asarray(newer, dtype=np.float64)
    if old.ndim != 2 or new.ndim != 2 or old.shape[1] != new.shape[1] or old.shape[1] < 2:
        raise ValueError(f"need two questions x slots matrices, got {old.shape} and {new.shape}")
    L = old.shape[1]
    placement = placement_slots or L
    k = min(rules.top_slots, placement)
    n_old, n_new = int((old.sum(axis=1) > 0).sum()), int((new.sum(axis=1) > 0).sum())
    sums = new.sum(axis=0)
    a_new = sums / sums.sum() if sums.sum() > 0 else np.full(L, 1.0 / L)
    new_top = top_slots(a_new, placement, k)
    if min(n_old, n_new) < rules.drift_min_runs:
        return Drift(
            False, 1.0, n_new, a_new, new_top,
            f"{n_old} older and {n_new} newer attributed answer(s): fewer than "
            f"{rules.drift_min_runs}",
        )  # fmt: skip
    both = np.concatenate([old, new])
    total = both.sum(axis=0)
    observed = float(_homogeneity(sums[None, :], total)[0])
    rng = np.random.default_rng(seed)
    m, w = both.shape[0], new.shape[0]
    # Enough splits that p <= drift_alpha is a resolution of ten, not the smallest p-value.
    resamples = max(FLAT_TEST_RESAMPLES, math.ceil(10 / rules.drift_alpha) - 1)
    step = max(1, min(_chunk(resamples, w, L), _chunk(resamples, m, 1)))
    as_far = 0
    for start in range(0, resamples, step):
        n = min(step, resamples - start)
        # n random sets of w answers: the w smallest of m uniform draws a row.
        picks = np.argpartition(rng.random((n, m)), w - 1, axis=1)[:, :w]
        as_far += int((_homogeneity(both[picks].sum(axis=1), total) >= observed - 1e-12).sum())
    p = (1 + as_far) / (1 + resamples)
    if p > rules.drift_alpha:
        return Drift(False, p, n_new, a_new, new_top, f"agree with the older (p = {p:.2g})")
    if held == "flat":
        flat_p = flat_test(new[new.sum(axis=1) > 0], rng)
        if flat_p <= rules.drift_alpha:
            return Drift(
                True, p, n_new, a_new, new_top,
                f"differ from the older (p = {p:.2g}) and are no longer flat "
                f"(p = {flat_p:.2g})",
            )  # fmt: skip
        return Drift(False, p, n_new, a_new, new_top, "differ but are still flat")
    if new_top != tuple(held_top):
        return Drift(
            True, p, n_new, a_new, new_top,
            f"differ from the older (p = {p:.2g}) and place slots {list(new_top)} first, "
            f"not {list(held_top)}",
        )  # fmt: skip
    return Drift(False, p, n_new, a_new, new_top, "differ but place the same top slots")
