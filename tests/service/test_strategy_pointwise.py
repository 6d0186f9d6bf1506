"""The pointwise baselines of paper 000 (QG, Bayes saliency, LongLLMLingua) on the fake backend.

Expected numbers come from the fake's documented scoring rule. A prompt showing passage ``p``
alone has bias weight 1 on it, so its scored span sums to
``s = lam * n - max(0, max_u) + u_p`` with ``n`` the span's tokens outside the passage; that is
``fake.expected_score([p], n)``. Without ``joint`` the span is the query (``n = n_q``), each
query token carrying ``s / n_q``. With ``joint`` (Bayes saliency) the span starts at the
passage: the passage's tokens get ``passage_logprob_per_token`` each and the ``n`` other tokens
share ``s``, the query's ``n_q`` of them ``s * n_q / n``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from service.backends.fakes.fake import FakeBackend
from service.config.settings import DEFAULT_TEMPLATE, Settings
from service.errors import InvalidRequest, LimitExceeded, ScoringFailed
from service.passage import Passage
from service.pipeline import Reorderer, ReorderRequest, ReorderResult, StrategyOptions
from service.prompting.prompts import build_prompts
from service.state.profile_store import ProfileStore
from tests.support.pipeline import reorderer_in

QUERY = "which passage helps?"
N_Q = len(QUERY.encode())  # ByteTokenizer: one token per byte
# Lengths differ so that Bayes saliency's log P(p) (a length penalty) changes the order.
TEXTS = ["alpha", "bravo bravo bravo bravo", "charlie", "delta delta"]
UTILS = [1.0, 3.0, 0.0, 2.5]
TRUTH = dict(zip(TEXTS, UTILS, strict=True))
POINTWISE = ("query_generation", "bayes_saliency", "longllmlingua")


def _passages(texts: Sequence[str] = TEXTS, scores: Sequence[float] | None = None) -> list[Passage]:
    return [
        Passage(text=t, score=None if scores is None else scores[i]) for i, t in enumerate(texts)
    ]


async def _run(
    r: Reorderer, strategy: str, passages: list[Passage], **options: object
) -> ReorderResult:
    req = ReorderRequest(QUERY, passages, strategy=strategy, options=StrategyOptions(**options))  # type: ignore[arg-type]
    return await r.reorder(req)


def _by_desc(values: Sequence[float]) -> list[int]:
    return sorted(range(len(values)), key=lambda i: (-values[i], i))


async def test_query_generation_is_the_log_likelihood_of_the_query_given_each_passage(
    tmp_path: Path,
) -> None:
    fake = FakeBackend(TRUTH)
    passages = _passages()
    res = await _run(reorderer_in(tmp_path, fake), "query_generation", passages)
    expected = [fake.expected_score([t], N_Q) for t in TEXTS]  # = -2 n_q - 3 + u
    np.testing.assert_allclose(res.scores, expected, rtol=0, atol=1e-9)
    assert res.score_name == "log_p_query"
    assert res.order == res.ranking == _by_desc(UTILS) == [1, 3, 0, 2]
    u = res.usage
    assert u.prompts == u.prompts_scored == fake.stats.prompts_scored == 4
    assert u.scored_tokens == 4 * N_Q and u.generations == u.generated_tokens == 0
    built = build_prompts(
        fake.tokenizer, DEFAULT_TEMPLATE, QUERY, passages, [[i] for i in range(4)]
    )
    assert u.prompt_tokens == sum(b.query_span[1] for b in built)
    assert res.warnings == () and res.details == {}


async def test_bayes_saliency_adds_the_passages_own_log_likelihood(tmp_path: Path) -> None:
    fake = FakeBackend(TRUTH)
    passages = _passages()
    res = await _run(reorderer_in(tmp_path, fake), "bayes_saliency", passages)
    built = build_prompts(
        fake.tokenizer, DEFAULT_TEMPLATE, QUERY, passages, [[i] for i in range(4)]
    )
    expected = []
    for t, b in zip(TEXTS, built, strict=True):
        start, end = b.scored_span(joint=True)
        n_passage = len(t.encode())
        assert b.passage_spans[0][1] - b.passage_spans[0][0] == n_passage
        n = end - start - n_passage  # template tokens between passage and query, and the query
        s = fake.expected_score([t], n)
        expected.append(s * N_Q / n + n_passage * fake.passage_logprob_per_token)
    np.testing.assert_allclose(res.scores, expected, rtol=0, atol=1e-9)
    assert res.score_name == "bayes_saliency"
    # log P(p) costs 1 nat per passage byte here, more than the utility gaps: the order is by
    # length (5, 7, 11, 23 bytes), and the most useful passage (bravo, 23 bytes) comes last.
    assert res.order == res.ranking == _by_desc(expected) == [0, 2, 3, 1]
    u = res.usage
    assert u.prompts == u.prompts_scored == 4
    assert u.scored_tokens == sum(b.query_span[1] - b.scored_span(joint=True)[0] for b in built)


async def test_longllmlingua_sums_p_log_p_and_its_direction_depends_on_p(tmp_path: Path) -> None:
    def expected(fake: FakeBackend) -> list[float]:
        lp = [fake.expected_score([t], N_Q) / N_Q for t in TEXTS]
        return [N_Q * math.exp(v) * v for v in lp]

    # Query tokens at log-prob about -2 (P < 1/e): P log P falls as P rises, so the passage
    # that makes the query most likely ranks LAST: the reverse of QG.
    low = FakeBackend(TRUTH, query_logprob_per_token=-2.0)
    res = await _run(reorderer_in(tmp_path, low), "longllmlingua", _passages())
    np.testing.assert_allclose(res.scores, expected(low), rtol=0, atol=1e-9)
    assert res.score_name == "longllmlingua"
    assert res.order == res.ranking == _by_desc(expected(low)) == [2, 0, 3, 1]
    # Query tokens at log-prob about -0.3 (P > 1/e): the same order as QG.
    high = FakeBackend(TRUTH, query_logprob_per_token=-0.3)
    res = await _run(reorderer_in(tmp_path, high), "longllmlingua", _passages())
    np.testing.assert_allclose(res.scores, expected(high), rtol=0, atol=1e-9)
    assert res.order == [1, 3, 0, 2]
    assert res.usage.prompts_scored == 4 and res.usage.scored_tokens == 4 * N_Q


@pytest.mark.parametrize("strategy", POINTWISE)
async def test_one_passage_and_ties(tmp_path: Path, strategy: str) -> None:
    fake = FakeBackend(TRUTH)
    r = reorderer_in(tmp_path, fake)
    one = await _run(r, strategy, _passages(TEXTS[:1]))
    assert one.order == one.ranking == [0] and one.usage.prompts == one.usage.prompts_scored == 1
    assert one.scores is not None and np.isfinite(one.scores).all()
    # Two passages with the same text: one prompt scored, equal scores, retriever order.
    twins = _passages([TEXTS[0], TEXTS[2], TEXTS[0]], scores=[0.1, 0.2, 0.3])
    res = await _run(r, strategy, twins)
    assert res.usage.prompts == 3 and res.usage.prompts_scored == 2
    assert res.scores is not None and res.scores[0] == res.scores[2]
    assert res.ranking.index(2) < res.ranking.index(0)  # tie: retriever score 0.3 > 0.1


@pytest.mark.parametrize("strategy", POINTWISE)
async def test_a_failed_prompt_ranks_its_passage_last(tmp_path: Path, strategy: str) -> None:
    fake = FakeBackend(TRUTH, fail_rule=lambda p: p.passages == (TEXTS[1],))
    res = await _run(reorderer_in(tmp_path, fake), strategy, _passages())
    assert res.scores is not None and math.isnan(res.scores[1])
    assert np.isfinite(np.delete(res.scores, 1)).all()
    assert res.ranking[-1] == 1 and res.order == res.ranking
    assert res.usage.prompts_failed == 1
    assert any("1 of 4 passage prompts failed" in w for w in res.warnings)
    dead = FakeBackend(TRUTH, fail_rule=lambda p: True)
    with pytest.raises(ScoringFailed, match="all 4 passage prompts failed"):
        await _run(reorderer_in(tmp_path, dead), strategy, _passages())


@pytest.mark.parametrize("strategy", POINTWISE)
async def test_no_option_applies_and_n_prompts_count_against_the_limit(
    tmp_path: Path, strategy: str
) -> None:
    fake = FakeBackend(TRUTH)
    r = reorderer_in(tmp_path, fake, max_prompts_per_request=3)
    with pytest.raises(InvalidRequest) as exc:
        await _run(r, strategy, _passages(TEXTS[:3]), samples=4)
    assert exc.value.param == "samples" and "query_likelihood" in exc.value.message
    with pytest.raises(InvalidRequest) as exc:
        await _run(r, strategy, _passages(TEXTS[:3]), seed=1)
    assert exc.value.param == "seed"
    with pytest.raises(InvalidRequest) as exc:
        await r.reorder(ReorderRequest(QUERY, _passages(), strategy=strategy, joint=True))  # type: ignore[arg-type]
    assert exc.value.param == "joint"
    with pytest.raises(LimitExceeded) as lim:
        await _run(r, strategy, _passages())
    assert lim.value.param == "passages" and lim.value.value == 4
    assert fake.stats.score_calls == 0


async def test_pointwise_baselines_run_on_a_tiny_real_model(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from service.backends.engines.transformers_backend import TransformersBackend

    backend = TransformersBackend.load(tiny_model_dir, model_id="tiny", device="cpu")
    r = Reorderer(backend, Settings(cache_dir=tmp_path), ProfileStore(tmp_path / "profiles"))
    passages = [
        Passage(text="J. R. R. Tolkien wrote The Lord of the Rings.", title="Tolkien"),
        Passage(text="C. S. Lewis wrote The Chronicles of Narnia."),
        Passage(text="The Hobbit was published in 1937."),
    ]
    q = "who wrote the lord of the rings"
    got = {
        name: await r.reorder(ReorderRequest(q, passages, strategy=name))  # type: ignore[arg-type]
        for name in POINTWISE
    }
    for res in got.values():
        assert sorted(res.order) == [0, 1, 2] and res.usage.prompts_scored == 3
        assert res.scores is not None and np.isfinite(res.scores).all()
    qg, bayes, lingua = (got[n].scores for n in POINTWISE)
    assert qg is not None and bayes is not None and lingua is not None
    # Same query log-probs in both requests: Bayes adds log P(p) <= 0.
    assert (bayes <= qg + 1e-4).all() and (qg < 0).all()
    # Each query token's P log P lies in [-1/e, 0].
    built = build_prompts(backend.tokenizer, DEFAULT_TEMPLATE, q, passages, [[0]])[0]
    n_q = len(built.query_token_ids)
    assert (lingua <= 0).all() and (lingua >= -n_q / math.e - 1e-9).all()
