"""``query_likelihood`` and ``convex_score`` (paper 002) on the known-truth fake backend.

Expected numbers come from the fake's documented scoring rule: with noise 0 and a query of
``n_q`` tokens, every query token of a prompt showing passages ``P`` in slot order has log-prob
``fake.expected_score(P, n_q) / n_q``, which is therefore also the prompt's per-token mean.
The random orders are re-drawn here from the documented sampling rules (``rng_for``: a
``default_rng([seed, crc32(query)])`` stream).
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from service.backends.fakes.fake import FakeBackend, FakePrompt
from service.config.settings import DEFAULT_TEMPLATE, Settings
from service.errors import InvalidRequest, LimitExceeded, ScoringFailed
from service.passage import Passage
from service.pipeline import Reorderer, ReorderRequest, ReorderResult, StrategyOptions
from service.prompting.prompts import build_prompts
from service.state.profile_store import ProfileStore
from tests.support.pipeline import reorderer_in

QUERY = "which passage helps?"
N_Q = len(QUERY.encode())  # ByteTokenizer: one token per byte
TEXTS = ["alpha one", "bravo two two", "charlie three", "delta four"]
UTILS = [1.0, 3.0, 0.0, 2.0]
TRUTH = dict(zip(TEXTS, UTILS, strict=True))
U_BIAS = (0.4, 0.1, 0.1, 0.4)  # a U-shaped positional curve, as paper 002 measures


def _u_bias(n: int) -> tuple[float, ...]:
    if n == 4:
        return U_BIAS
    return tuple(1.0 if j in (0, n - 1) else 0.5 for j in range(n))


def _passages(texts: Sequence[str] = TEXTS, scores: Sequence[float] | None = None) -> list[Passage]:
    return [
        Passage(text=t, score=None if scores is None else scores[i]) for i, t in enumerate(texts)
    ]


def _rng(seed: int = 0, query: str = QUERY) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(query.encode())])


def _loglik(fake: FakeBackend, texts: Sequence[str], order: Sequence[int]) -> float:
    """Per-token mean log p(query) of the prompt showing ``order`` (fake's rule)."""
    return fake.expected_score([texts[i] for i in order], N_Q) / N_Q


def _prompt_tokens(
    fake: FakeBackend, passages: list[Passage], orders: Sequence[Sequence[int]]
) -> int:
    """Tokens sent for scoring: each prompt up to the end of its query."""
    built = build_prompts(fake.tokenizer, DEFAULT_TEMPLATE, QUERY, passages, orders)
    return sum(b.query_span[1] for b in built)


async def _run(
    r: Reorderer, strategy: str, passages: list[Passage], **options: object
) -> ReorderResult:
    return await r.reorder(
        ReorderRequest(QUERY, passages, strategy=strategy, options=StrategyOptions(**options))  # type: ignore[arg-type]
    )


# --- query_likelihood -----------------------------------------------------------------------


async def test_query_likelihood_picks_the_most_likely_of_k_seeded_shuffles(tmp_path: Path) -> None:
    fake = FakeBackend(TRUTH, bias=_u_bias)
    passages = _passages()
    res = await _run(reorderer_in(tmp_path, fake), "query_likelihood", passages)
    # Default K = N = 4 distinct shuffles, drawn as uniform permutations in order.
    rng = _rng()
    drawn: list[tuple[int, ...]] = []
    while len(drawn) < 4:
        p = tuple(int(x) for x in rng.permutation(4))
        if p not in drawn:
            drawn.append(p)
    ll = [_loglik(fake, TEXTS, o) for o in drawn]
    best = int(np.argmax(ll))
    assert res.order == res.ranking == list(drawn[best])
    assert res.scores is None and res.score_name is None and res.warnings == ()
    d = res.details
    assert d["samples"] == d["samples_scored"] == 4
    assert d["loglik_chosen"] == pytest.approx(max(ll), abs=1e-9)
    assert d["loglik_mean"] == pytest.approx(float(np.mean(ll)), abs=1e-9)
    assert d["loglik_std"] == pytest.approx(float(np.std(ll)), abs=1e-9)
    assert d["loglik_min"] == pytest.approx(min(ll), abs=1e-9)
    u = res.usage
    assert u.prompts == u.prompts_scored == fake.stats.prompts_scored == 4
    assert u.scored_tokens == 4 * N_Q and u.generations == u.generated_tokens == 0
    assert u.prompt_tokens == _prompt_tokens(fake, passages, drawn)
    # Reproducible; another seed draws other shuffles.
    again = await _run(
        reorderer_in(tmp_path, FakeBackend(TRUTH, bias=_u_bias)), "query_likelihood", passages
    )
    assert again.order == res.order and again.details == res.details
    other = await _run(
        reorderer_in(tmp_path, fake), "query_likelihood", passages, seed=7, samples=8
    )
    assert other.details["samples"] == 8


async def test_query_likelihood_searches_every_order_when_k_reaches_n_factorial(
    tmp_path: Path,
) -> None:
    texts = TEXTS[:3]
    fake = FakeBackend({t: TRUTH[t] for t in texts})  # primacy bias (3, 2, 1) / 6
    res = await _run(reorderer_in(tmp_path, fake), "query_likelihood", _passages(texts), samples=50)
    # 3! = 6 distinct orders: all are scored, and the best pairs utility with bias by rank
    # (rearrangement inequality): descending utility, bravo (3) > alpha (1) > charlie (0).
    assert res.order == [1, 0, 2]
    assert res.details["samples"] == res.usage.prompts == res.usage.prompts_scored == 6
    all_ll = [_loglik(fake, texts, o) for o in itertools.permutations(range(3))]
    assert res.details["loglik_chosen"] == pytest.approx(max(all_ll), abs=1e-9)
    assert res.details["loglik_mean"] == pytest.approx(float(np.mean(all_ll)), abs=1e-9)


async def test_query_likelihood_takes_a_random_subset_when_k_is_over_half_of_n_factorial(
    tmp_path: Path,
) -> None:
    texts = TEXTS[:3]
    fake = FakeBackend({t: TRUTH[t] for t in texts}, bias=_u_bias)
    res = await _run(reorderer_in(tmp_path, fake), "query_likelihood", _passages(texts), samples=4)
    # 3! = 6 <= 2 K: K of the 6 lexicographic orders, at rng.permutation(6)[:4].
    every = list(itertools.permutations(range(3)))
    chosen = [every[int(j)] for j in _rng().permutation(6)[:4]]
    ll = [_loglik(fake, texts, o) for o in chosen]
    assert res.order == list(chosen[int(np.argmax(ll))])
    assert res.details["loglik_mean"] == pytest.approx(float(np.mean(ll)), abs=1e-9)
    assert res.usage.prompts == res.usage.prompts_scored == 4


async def test_query_likelihood_with_one_passage_scores_its_only_order(tmp_path: Path) -> None:
    fake = FakeBackend(TRUTH)
    res = await _run(
        reorderer_in(tmp_path, fake), "query_likelihood", _passages(TEXTS[:1]), samples=5
    )
    assert res.order == res.ranking == [0]
    assert res.usage.prompts == res.usage.prompts_scored == 1
    assert res.details["loglik_chosen"] == pytest.approx(_loglik(fake, TEXTS, [0]), abs=1e-9)
    assert res.details["loglik_std"] == 0.0 and res.details["samples"] == 1


async def test_query_likelihood_drops_failed_shuffles_and_fails_when_none_is_left(
    tmp_path: Path,
) -> None:
    texts = TEXTS[:3]
    truth = {t: TRUTH[t] for t in texts}
    # The best order (bravo, alpha, charlie) fails: the second best is chosen.
    fake = FakeBackend(truth, fail_rule=lambda p: p.passages == (texts[1], texts[0], texts[2]))
    res = await _run(reorderer_in(tmp_path, fake), "query_likelihood", _passages(texts), samples=6)
    ranked = sorted(itertools.permutations(range(3)), key=lambda o: -_loglik(fake, texts, o))
    assert ranked[0] == (1, 0, 2)
    assert res.order == list(ranked[1])
    assert res.details["samples"] == 6 and res.details["samples_scored"] == 5
    assert res.usage.prompts_failed == 1 and any(
        "1 of 6 shuffles failed" in w for w in res.warnings
    )
    dead = FakeBackend(truth, fail_rule=lambda p: True)
    with pytest.raises(ScoringFailed, match="all 6 shuffles failed"):
        await _run(reorderer_in(tmp_path, dead), "query_likelihood", _passages(texts), samples=6)


async def test_query_likelihood_options_and_limit(tmp_path: Path) -> None:
    fake = FakeBackend({f"passage {i}": float(i) for i in range(8)})
    r = reorderer_in(tmp_path, fake, max_prompts_per_request=20)
    passages = _passages([f"passage {i}" for i in range(8)])
    with pytest.raises(InvalidRequest) as exc:
        await _run(r, "query_likelihood", passages, samples=0)
    assert exc.value.param == "samples"
    with pytest.raises(InvalidRequest) as exc:
        await _run(r, "query_likelihood", passages, rankings=((0, 1),))
    assert exc.value.param == "rankings"
    with pytest.raises(LimitExceeded) as exc:
        await _run(r, "query_likelihood", passages, samples=21)
    assert exc.value.param == "samples" and exc.value.value == 21
    # K above N! is capped at N! before the limit: 3 passages never need more than 6 prompts.
    assert (
        r.planned_prompts(
            ReorderRequest(
                QUERY,
                passages[:3],
                strategy="query_likelihood",
                options=StrategyOptions(samples=500),
            )
        )
        == 6
    )
    assert fake.stats.score_calls == 0


# --- convex_score ---------------------------------------------------------------------------


def _position_orders(n: int, rng: np.random.Generator) -> list[tuple[int, ...]]:
    """The documented draw: per passage d, one permutation of the others; d at every slot."""
    orders = []
    for d in range(n):
        others = [j for j in range(n) if j != d]
        rest = [others[int(k)] for k in rng.permutation(n - 1)]
        orders += [(*rest[:i], d, *rest[i:]) for i in range(n)]
    return orders


async def test_convex_score_matches_eq_3_and_moves_the_top_passage_first(tmp_path: Path) -> None:
    fake = FakeBackend(TRUTH, bias=_u_bias)
    # Retriever order by score: 2, 0, 3, 1.
    passages = _passages(scores=[0.8, 0.1, 0.9, 0.5])
    res = await _run(reorderer_in(tmp_path, fake), "convex_score", passages)
    orders = _position_orders(4, _rng())
    for d in range(4):
        for i in range(4):
            assert orders[4 * d + i][i] == d
    ll = np.array([[_loglik(fake, TEXTS, orders[4 * d + i]) for i in range(4)] for d in range(4)])
    expected = 2 * (ll[:, 0] + ll[:, 3] - ll[:, 1] - ll[:, 2])
    np.testing.assert_allclose(res.scores, expected, rtol=0, atol=1e-9)
    assert res.score_name == "convex_score"
    ranking = sorted(range(4), key=lambda i: (-expected[i], [2, 0, 3, 1].index(i)))
    assert res.ranking == ranking
    top = ranking[0]
    assert res.order == [top, *(i for i in [2, 0, 3, 1] if i != top)]
    assert res.details["top"] == top
    np.testing.assert_allclose(res.details["position_loglik"], ll.mean(axis=0), atol=1e-9)
    distinct = set(orders)
    u = res.usage
    assert u.prompts == 16 and u.prompts_scored == fake.stats.prompts_scored == len(distinct)
    assert u.scored_tokens == len(distinct) * N_Q and u.generations == 0
    assert u.prompt_tokens == _prompt_tokens(fake, passages, sorted(distinct))
    assert res.warnings == ()


async def test_convex_score_signal_is_the_bias_curvature(tmp_path: Path) -> None:
    # Under the fake, l~(d, i) = (c + sum_j a_j u[slot j]) / n_q, and for k = 4 the weights of
    # eq. 3 (+1, -1, -1, +1) sum to 0, so c cancels. The U bias gives d's own term
    # 2 (a_1 + a_4 - a_2 - a_3) u_d / n_q = 1.2 u_d / n_q; another passage in slot 1 or 3 of d's
    # shared order contributes 2 (a_2 - a_1) or 2 (a_3 - a_4) times its utility / n_q, i.e.
    # -0.6 u / n_q, and 0 from slot 2. So with one useful passage (u = 2) among three with
    # u = 0, whatever the draws: it scores 2.4 / n_q, the others 0 or -1.2 / n_q.
    texts = ["hay three", "hay two", "hay one", "needle"]
    truth = {"needle": 2.0, "hay one": 0.0, "hay two": 0.0, "hay three": 0.0}
    fake = FakeBackend(truth, bias=_u_bias)
    res = await _run(reorderer_in(tmp_path, fake), "convex_score", _passages(texts))
    assert res.order[0] == res.ranking[0] == 3
    assert res.scores is not None
    assert res.scores[3] == pytest.approx(2.4 / N_Q, abs=1e-9)
    for s in res.scores[:3]:
        assert s == pytest.approx(0.0, abs=1e-9) or s == pytest.approx(-1.2 / N_Q, abs=1e-9)


async def test_convex_score_small_n(tmp_path: Path) -> None:
    fake = FakeBackend(TRUTH)
    r = reorderer_in(tmp_path, fake)
    # N = 1: one prompt; positions 1 and k coincide, so eq. 3 gives 4 l~.
    one = await _run(r, "convex_score", _passages(TEXTS[:1]))
    assert one.order == one.ranking == [0] and one.usage.prompts == one.usage.prompts_scored == 1
    np.testing.assert_allclose(one.scores, [4 * _loglik(fake, TEXTS, [0])], atol=1e-9)
    # N = 2: both passages are scored on [0, 1] and [1, 0]: equal scores, retriever order.
    two = await _run(r, "convex_score", _passages(TEXTS[:2], scores=[0.1, 0.9]))
    both = 2 * (_loglik(fake, TEXTS, [0, 1]) + _loglik(fake, TEXTS, [1, 0]))
    np.testing.assert_allclose(two.scores, [both, both], atol=1e-9)
    assert two.order == two.ranking == [1, 0]
    assert two.usage.prompts == 4 and two.usage.prompts_scored == 2


async def test_convex_score_failed_prompts_leave_nan_scores_ranked_last(tmp_path: Path) -> None:
    orders = _position_orders(4, _rng())
    dead_order = tuple(TEXTS[i] for i in orders[0])  # passage 0 in slot 1

    def fail(p: FakePrompt) -> bool:
        return p.passages == dead_order

    fake = FakeBackend(TRUTH, bias=_u_bias, fail_rule=fail)
    res = await _run(reorderer_in(tmp_path, fake), "convex_score", _passages())
    # Every passage one of whose prompts is that order loses its score.
    lost = {d for d in range(4) if orders[0] in orders[4 * d : 4 * d + 4]}
    assert 0 in lost and len(lost) < 4
    assert res.scores is not None
    assert {i for i in range(4) if math.isnan(res.scores[i])} == lost
    assert set(res.ranking[-len(lost) :]) == lost
    assert res.usage.prompts_failed == 1
    assert any("no convex_score" in w for w in res.warnings)
    # Each of two passages losing a prompt leaves nothing to order by.
    two = FakeBackend(TRUTH, fail_rule=lambda p: p.passages == (TEXTS[0], TEXTS[1]))
    with pytest.raises(ScoringFailed, match="no passage"):
        await _run(reorderer_in(tmp_path, two), "convex_score", _passages(TEXTS[:2]))
    dead = FakeBackend(TRUTH, fail_rule=lambda p: True)
    with pytest.raises(ScoringFailed, match="all"):
        await _run(reorderer_in(tmp_path, dead), "convex_score", _passages())


async def test_convex_score_refuses_n_squared_over_the_limit_before_scoring(
    tmp_path: Path,
) -> None:
    fake = FakeBackend(TRUTH)
    r = reorderer_in(tmp_path, fake, max_prompts_per_request=15)
    with pytest.raises(LimitExceeded) as exc:
        await _run(r, "convex_score", _passages())
    assert exc.value.param == "passages" and exc.value.value == 16 and exc.value.limit == 15
    with pytest.raises(InvalidRequest) as exc2:
        await _run(r, "convex_score", _passages(TEXTS[:3]), samples=3)
    assert exc2.value.param == "samples"
    assert fake.stats.score_calls == 0
    ok = await _run(r, "convex_score", _passages(TEXTS[:3]), seed=5)
    assert ok.usage.prompts == 9


# --- a real model ---------------------------------------------------------------------------


async def test_both_run_on_a_tiny_real_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    from service.backends.engines.transformers_backend import TransformersBackend

    backend = TransformersBackend.load(tiny_model_dir, model_id="tiny", device="cpu")
    r = Reorderer(backend, Settings(cache_dir=tmp_path), ProfileStore(tmp_path / "profiles"))
    passages = [
        Passage(text="J. R. R. Tolkien wrote The Lord of the Rings.", title="Tolkien"),
        Passage(text="C. S. Lewis wrote The Chronicles of Narnia."),
        Passage(text="The Hobbit was published in 1937."),
    ]
    req = ReorderRequest("who wrote the lord of the rings", passages, strategy="query_likelihood")
    ql = await r.reorder(req)
    assert sorted(ql.order) == [0, 1, 2] and ql.usage.prompts_scored == 3
    d = ql.details
    assert d["loglik_min"] <= d["loglik_mean"] <= d["loglik_chosen"] < 0
    cs = await r.reorder(
        ReorderRequest("who wrote the lord of the rings", passages, strategy="convex_score")
    )
    assert sorted(cs.ranking) == [0, 1, 2] and cs.order[0] == cs.ranking[0]
    assert cs.scores is not None and np.isfinite(cs.scores).all() and cs.usage.prompts == 9
