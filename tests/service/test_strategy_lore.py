"""``lore`` on the fake backend, every number hand-computed from the fake's generation rule.

Fake rule (``service.backends.fakes.fake``): a prompt holding one passage is answered with that
passage's first ``answer_words`` (3) words, every token at log-prob ``log(sigmoid(u))``, then
the end-of-turn token. So a passage's mean token probability is exactly ``sigmoid(u)``, and an
answer costs its UTF-8 bytes plus one end-of-turn token (ByteTokenizer).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from service.backends.fakes.fake import FakeBackend
from service.config.settings import Settings
from service.errors import InvalidRequest, LimitExceeded, ScoringFailed
from service.passage import Passage
from service.pipeline import Reorderer, ReorderRequest, ReorderResult, StrategyOptions
from service.state.profile_store import ProfileStore
from service.strategies.lore import context_ranks, rrf_scores

TEXTS = [
    "alpha apple one extra",
    "bravo banana two extra",
    "charlie cherry three extra",
    "delta date four extra",
    "echo elderberry five extra",
]
ANSWERS = [" ".join(t.split()[:3]) for t in TEXTS]  # the fake's default answer: 3 words
UTILITY = [1.0, 1.1, -2.0, 0.2, 0.0]
QUERY = "which fruit is it?"


def sigmoid(u: float) -> float:
    return 1.0 / (1.0 + math.exp(-u))


def details(res: ReorderResult) -> dict[str, Any]:
    return cast(dict[str, Any], res.details)


def _setup(tmp_path: Path, **settings: object) -> tuple[Reorderer, FakeBackend]:
    backend = FakeBackend(dict(zip(TEXTS, UTILITY, strict=True)))
    s = Settings(cache_dir=tmp_path, **settings)  # type: ignore[arg-type]
    return Reorderer(backend, s, ProfileStore(tmp_path / "profiles")), backend


def _passages(scores: list[float] | None = None) -> list[Passage]:
    return [
        Passage(text=t, score=None if scores is None else scores[i]) for i, t in enumerate(TEXTS)
    ]


def _lore(passages: list[Passage], **options: object) -> ReorderRequest:
    return ReorderRequest(
        QUERY,
        passages,
        strategy="lore",
        options=StrategyOptions(**options),  # type: ignore[arg-type]
    )


async def test_default_fuses_the_retriever_ranking_alone(tmp_path: Path) -> None:
    r, backend = _setup(tmp_path)
    # Retriever order by descending score: 0, 1, 3, 4, 2, so context ranks 1, 2, 5, 3, 4.
    res = await r.reorder(_lore(_passages([9.0, 8.0, 1.0, 7.0, 5.0])))
    ranks = [1, 2, 5, 3, 4]
    prob = [sigmoid(u) for u in UTILITY]
    lor = [0.8 * p + 0.2 / k for p, k in zip(prob, ranks, strict=True)]
    # 0: 0.8*0.731059+0.2 = 0.784847; 1: 0.8*0.750260+0.1 = 0.700208; 3: 0.8*0.549834+0.2/3
    # = 0.506534; 4: 0.8*0.5+0.05 = 0.45; 2: 0.8*0.119203+0.04 = 0.135362.
    assert res.scores is not None
    np.testing.assert_allclose(res.scores, lor, rtol=0, atol=1e-9)
    assert res.score_name == "lor"
    assert res.order == res.ranking == [0, 1, 3, 4, 2]
    # Passage 1 is the most confident, but the rank term makes passage 0's answer the best.
    assert res.answer is not None
    assert res.answer.text == ANSWERS[0] and res.answer.passage == 0
    assert res.answer.probability == pytest.approx(prob[0], abs=1e-12)
    assert res.answer.votes is None and res.answer.samples is None
    assert res.passage_answers == tuple(ANSWERS)
    assert details(res)["context_rank"] == ranks
    np.testing.assert_allclose(details(res)["mean_probability"], prob, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        details(res)["rrf"], [1 / (60 + k) for k in ranks], rtol=0, atol=1e-15
    )
    assert details(res)["input_rankings"] == 1
    # Cost: one generation per passage, no scored prompt; answer bytes + end-of-turn each.
    u = res.usage
    assert u.prompts == u.generations == 5 and u.prompts_scored == u.scored_tokens == 0
    assert u.generated_tokens == sum(len(a.encode()) + 1 for a in ANSWERS)
    assert u.generated_tokens == backend.stats.generated_tokens
    assert u.prompt_tokens == backend.stats.prompt_tokens > 0 and u.prompts_failed == 0
    assert backend.stats.generate_calls == 1 and backend.stats.score_calls == 0
    assert res.warnings == ()


async def test_without_retriever_scores_the_input_order_is_the_context_order(
    tmp_path: Path,
) -> None:
    r, _ = _setup(tmp_path)
    res = await r.reorder(_lore(_passages()))
    lor = [0.8 * sigmoid(u) + 0.2 / (i + 1) for i, u in enumerate(UTILITY)]
    assert res.scores is not None
    np.testing.assert_allclose(res.scores, lor, rtol=0, atol=1e-9)
    assert res.ranking == sorted(range(5), key=lambda i: -lor[i]) == [0, 1, 3, 4, 2]


async def test_custom_rankings_weights_and_k(tmp_path: Path) -> None:
    r, _ = _setup(tmp_path)
    # Paper 003's example (7.2): BM25 [D1, D2, D3, D4], dense [D3, D1, D5, D2], k = 60.
    # RRF: D1 1/61+1/62 = .032522, D3 1/63+1/61 = .032266, D2 1/62+1/64 = .031754,
    # D5 1/63 = .015873, D4 1/64 = .015625 -> context ranks D1 1, D2 3, D3 2, D4 5, D5 4.
    # (The paper's Table 5 mis-adds D2 and D3 and orders D4 before D5; the formula wins.)
    rankings = ((0, 1, 2, 3), (2, 0, 4, 1))
    res = await r.reorder(
        _lore(_passages(), rankings=rankings, probability_weight=0.5, rank_weight=1.0)
    )
    rrf = [1 / 61 + 1 / 62, 1 / 62 + 1 / 64, 1 / 63 + 1 / 61, 1 / 64, 1 / 63]
    ranks = [1, 3, 2, 5, 4]
    lor = [0.5 * sigmoid(u) + 1.0 / k for u, k in zip(UTILITY, ranks, strict=True)]
    assert details(res)["context_rank"] == ranks and details(res)["input_rankings"] == 2
    np.testing.assert_allclose(details(res)["rrf"], rrf, rtol=0, atol=1e-15)
    assert res.scores is not None
    np.testing.assert_allclose(res.scores, lor, rtol=0, atol=1e-9)
    # 0: .365529+1 = 1.365529; 2: .059601+.5 = .559601; 1: .375130+.333333 = .708463;
    # 4: .25+.25 = .5; 3: .274917+.2 = .474917.
    assert res.ranking == [0, 1, 2, 4, 3]

    # k = 0 and one partial ranking: [4, 2]; the others get no term (RRF 0) and follow in
    # retriever (input) order: context ranks 4 -> 1, 2 -> 2, 0 -> 3, 1 -> 4, 3 -> 5.
    res = await r.reorder(_lore(_passages(), rankings=((4, 2),), rrf_k=0, rank_weight=0.0))
    assert details(res)["context_rank"] == [3, 4, 2, 5, 1]
    np.testing.assert_allclose(details(res)["rrf"], [0, 0, 1 / 2, 0, 1], rtol=0, atol=0)
    # rank_weight 0: LoR is 0.8 * sigmoid(u) alone, the most confident answer wins.
    assert res.scores is not None
    np.testing.assert_allclose(res.scores, [0.8 * sigmoid(u) for u in UTILITY], atol=1e-12)
    assert res.ranking == [1, 0, 3, 4, 2]
    assert res.answer is not None and res.answer.passage == 1 and res.answer.text == ANSWERS[1]


def test_rrf_ties_are_exact_and_broken_by_retriever_order() -> None:
    # Three rotations: every passage gets 1/61 + 1/62 + 1/63, summed in different orders.
    rankings = [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    rrf = rrf_scores(rankings, 3, 60)
    assert rrf[0] == rrf[1] == rrf[2]
    assert context_ranks(rrf, tiebreak=[2, 0, 1]) == [2, 3, 1]
    assert context_ranks(rrf, tiebreak=[0, 1, 2]) == [1, 2, 3]


async def test_lor_ties_follow_the_context_rank(tmp_path: Path) -> None:
    backend = FakeBackend({"same text a": 0.3, "same text b": 0.3, "other text c": 0.3})
    r = Reorderer(backend, Settings(cache_dir=tmp_path), ProfileStore(tmp_path / "p"))
    passages = [Passage(t) for t in ("same text a", "same text b", "other text c")]
    # rank_weight 0: equal probabilities, equal LoR; the context ranking [2, 0, 1] decides.
    res = await r.reorder(_lore(passages, rankings=((2, 0, 1),), rank_weight=0.0))
    assert res.ranking == [2, 0, 1]


@pytest.mark.parametrize(
    ("rankings", "message"),
    [
        (((0, 5),), "rankings[0] lists passage 5, out of range"),
        (((0, 1), (-1,)), "rankings[1] lists passage -1, out of range"),
        (((0, 1, 0),), "rankings[0] lists passage 0 twice"),
        (((0,), ()), "rankings[1] is empty"),
        ((), "at least one ranking"),
    ],
)
async def test_invalid_rankings_are_refused_before_any_generation(
    tmp_path: Path, rankings: tuple[tuple[int, ...], ...], message: str
) -> None:
    r, backend = _setup(tmp_path)
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        await r.reorder(_lore(_passages(), rankings=rankings))
    assert backend.stats.generate_calls == 0


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"probability_weight": -0.1}, "probability_weight"),
        ({"rank_weight": math.inf}, "rank_weight"),
        ({"rank_weight": math.nan}, "rank_weight"),
        ({"rrf_k": -1}, "rrf_k"),
        ({"max_answer_tokens": 0}, "max_answer_tokens"),
        ({"samples": 3}, "samples"),  # not a LoRE option
        ({"seed": 3}, "seed"),
    ],
)
async def test_invalid_options_are_refused(
    tmp_path: Path, options: dict[str, object], param: str
) -> None:
    r, backend = _setup(tmp_path)
    with pytest.raises(InvalidRequest) as exc:
        await r.reorder(_lore(_passages(), **options))
    assert exc.value.param == param
    assert backend.stats.generate_calls == 0


async def test_planned_prompts_are_n_and_checked_against_the_limit(tmp_path: Path) -> None:
    r, backend = _setup(tmp_path, max_prompts_per_request=4)
    assert r.planned_prompts(_lore(_passages()[:4])) == 4
    with pytest.raises(LimitExceeded) as exc:
        await r.reorder(_lore(_passages()))
    assert exc.value.param == "passages" and exc.value.value == 5
    assert backend.stats.generate_calls == 0


async def test_answer_budget_truncates_answers(tmp_path: Path) -> None:
    r, backend = _setup(tmp_path)
    res = await r.reorder(_lore(_passages(), max_answer_tokens=2))
    # Two byte tokens each and no end-of-turn; the probability of each token is unchanged.
    assert res.passage_answers == tuple(a[:2] for a in ANSWERS)
    assert res.usage.generated_tokens == 2 * 5 == backend.stats.generated_tokens
    assert res.answer is not None and res.answer.text == "al"
    assert details(res)["mean_probability"][0] == pytest.approx(sigmoid(1.0), abs=1e-12)


async def test_identical_passages_are_generated_once(tmp_path: Path) -> None:
    r, _ = _setup(tmp_path)
    passages = [*_passages(), Passage(text=TEXTS[1])]
    res = await r.reorder(_lore(passages))
    assert res.usage.prompts == 6 and res.usage.generations == 5
    assert res.passage_answers is not None and res.passage_answers[5] == ANSWERS[1]
    assert details(res)["mean_probability"][5] == details(res)["mean_probability"][1]


async def test_a_failed_generation_leaves_its_passage_unscored_and_last(tmp_path: Path) -> None:
    r, backend = _setup(tmp_path)
    # Passage 0 (the default winner) fails; passage 3 (context rank 4 of 5) fails too.
    backend.fail_rule = lambda p: p.passages in ((TEXTS[0],), (TEXTS[3],))
    res = await r.reorder(_lore(_passages()))
    prob = [math.nan, sigmoid(1.1), sigmoid(-2.0), math.nan, sigmoid(0.0)]
    lor = [0.8 * p + 0.2 / (i + 1) for i, p in enumerate(prob)]
    assert res.scores is not None
    np.testing.assert_allclose(res.scores, lor, rtol=0, atol=1e-9)  # NaN where failed
    # Scored: 1 (.700208), 4 (.44), 2 (.162029); then the failed ones by context rank: 0, 3.
    assert res.ranking == [1, 4, 2, 0, 3]
    assert res.answer is not None and res.answer.passage == 1 and res.answer.text == ANSWERS[1]
    assert res.passage_answers == (None, ANSWERS[1], ANSWERS[2], None, ANSWERS[4])
    assert res.usage.prompts_failed == 2 and res.usage.generations == 5
    assert res.usage.generated_tokens == sum(len(ANSWERS[i].encode()) + 1 for i in (1, 2, 4))
    assert any("2 of 5 passage answers failed" in w for w in res.warnings)


async def test_all_generations_failing_is_a_scoring_failure(tmp_path: Path) -> None:
    r, backend = _setup(tmp_path)
    backend.fail_rule = lambda p: True
    with pytest.raises(ScoringFailed):
        await r.reorder(_lore(_passages()))


async def test_nan_logprobs_count_as_failures(tmp_path: Path) -> None:
    r, backend = _setup(tmp_path)
    backend.nan_rule = lambda p: p.passages == (TEXTS[2],)
    res = await r.reorder(_lore(_passages()))
    assert res.scores is not None and math.isnan(res.scores[2]) and res.ranking[-1] == 2
    assert res.usage.prompts_failed == 1


# --- a real model ----------------------------------------------------------------------------


async def test_runs_on_a_tiny_real_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    from service.backends.engines.transformers_backend import TransformersBackend

    backend = TransformersBackend.load(tiny_model_dir, model_id="tiny", device="cpu")
    r = Reorderer(backend, Settings(cache_dir=tmp_path), ProfileStore(tmp_path / "p"))
    passages = [
        Passage(text="J. R. R. Tolkien wrote The Lord of the Rings.", score=3.0),
        Passage(text="C. S. Lewis wrote The Chronicles of Narnia.", score=2.0),
        Passage(text="The Hobbit was published in 1937.", score=1.0),
    ]
    req = ReorderRequest(
        "who wrote the lord of the rings",
        passages,
        strategy="lore",
        options=StrategyOptions(max_answer_tokens=4),
    )
    res = await r.reorder(req)
    assert sorted(res.ranking) == [0, 1, 2] and res.order == res.ranking
    prob = np.asarray(details(res)["mean_probability"])
    assert np.all((prob >= 0) & (prob <= 1))
    assert res.scores is not None
    np.testing.assert_allclose(res.scores, 0.8 * prob + 0.2 / np.array([1, 2, 3]), atol=1e-12)
    assert res.answer is not None and res.answer.passage == res.ranking[0]
    assert res.usage.generations == 3 and 3 <= res.usage.generated_tokens <= 12
    await backend.aclose()
