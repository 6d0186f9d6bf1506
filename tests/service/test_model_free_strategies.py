"""The model-free strategies (retriever, inverse, shuffle, litm) and the strategy port's checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.backends.fakes.fake import FakeBackend
from service.config.settings import Settings
from service.errors import InvalidRequest, LimitExceeded
from service.passage import Passage
from service.pipeline import DesignSpec, Reorderer, ReorderRequest, StrategyOptions
from service.state.profile_store import ProfileStore
from service.strategies import STRATEGIES, get_strategy, strategy_names
from service.strategies.model_free import litm_order

TEXTS = ["alpha one", "bravo two", "charlie three", "delta four", "echo five"]


def _reorderer(tmp_path: Path, **settings: object) -> tuple[Reorderer, FakeBackend]:
    backend = FakeBackend({t: float(i) for i, t in enumerate(TEXTS)})
    s = Settings(cache_dir=tmp_path, **settings)  # type: ignore[arg-type]
    return Reorderer(backend, s, ProfileStore(tmp_path / "profiles")), backend


def _passages(scores: list[float] | None = None) -> list[Passage]:
    return [
        Passage(text=t, score=None if scores is None else scores[i]) for i, t in enumerate(TEXTS)
    ]


@pytest.mark.parametrize(
    ("ranking", "expected"),
    [
        ([0], [0]),
        ([0, 1], [0, 1]),
        ([0, 1, 2], [0, 2, 1]),
        ([0, 1, 2, 3], [0, 2, 3, 1]),
        ([0, 1, 2, 3, 4], [0, 2, 4, 3, 1]),
        ([4, 3, 2, 1, 0, 5], [4, 2, 0, 5, 1, 3]),
    ],
)
def test_litm_puts_the_best_first_and_the_second_best_last_for_any_length(
    ranking: list[int], expected: list[int]
) -> None:
    assert litm_order(ranking) == expected


async def test_retriever_inverse_litm_follow_scores_when_every_passage_has_one(
    tmp_path: Path,
) -> None:
    r, backend = _reorderer(tmp_path)
    # Retriever order by descending score: 2, 4, 0, 3, 1.
    passages = _passages([0.5, 0.1, 0.9, 0.2, 0.7])
    got = {
        name: await r.reorder(ReorderRequest("q?", passages, strategy=name))  # type: ignore[arg-type]
        for name in ("retriever", "inverse", "litm")
    }
    assert got["retriever"].order == got["retriever"].ranking == [2, 4, 0, 3, 1]
    assert got["inverse"].order == [1, 3, 0, 4, 2]
    assert got["inverse"].ranking == [2, 4, 0, 3, 1]
    assert got["litm"].order == [2, 0, 1, 3, 4]
    for res in got.values():
        # No model call at all, and the cost says so.
        assert res.usage.prompts == res.usage.prompts_scored == res.usage.generations == 0
        assert res.usage.prompt_tokens == 0 and res.fit is None and res.scores is None
    assert backend.stats.score_calls == backend.stats.generate_calls == 0


async def test_without_scores_the_input_order_is_the_retriever_order(tmp_path: Path) -> None:
    r, _ = _reorderer(tmp_path)
    res = await r.reorder(ReorderRequest("q?", _passages(), strategy="inverse"))
    assert res.order == [4, 3, 2, 1, 0]
    # A partial set of scores is not a ranking: the input order is used.
    partial = [*_passages([1.0, 2.0, 3.0, 4.0, 5.0])[:4], Passage(text=TEXTS[4])]
    res = await r.reorder(ReorderRequest("q?", partial, strategy="retriever"))
    assert res.order == [0, 1, 2, 3, 4]


async def test_shuffle_is_seeded_per_query_and_reproducible(tmp_path: Path) -> None:
    r, _ = _reorderer(tmp_path)
    passages = _passages()

    async def shuffle(query: str, seed: int | None = None) -> list[int]:
        req = ReorderRequest(
            query, passages, strategy="shuffle", options=StrategyOptions(seed=seed)
        )
        return (await r.reorder(req)).order

    import zlib

    expected = np.random.default_rng([0, zlib.crc32(b"q one?")]).permutation(5).tolist()
    assert await shuffle("q one?") == expected == await shuffle("q one?")
    assert await shuffle("q one?", seed=0) == expected
    orders = {tuple(await shuffle(f"question {k}?")) for k in range(12)}
    assert len(orders) > 6  # different queries get different shuffles
    assert {tuple(await shuffle("q one?", seed=s)) for s in range(12)} != {tuple(expected)}


async def test_options_a_strategy_does_not_read_are_refused(tmp_path: Path) -> None:
    r, backend = _reorderer(tmp_path)
    passages = _passages()
    with pytest.raises(InvalidRequest) as exc:
        await r.reorder(
            ReorderRequest("q?", passages, strategy="retriever", options=StrategyOptions(seed=3))
        )
    assert exc.value.param == "seed" and "shuffle" in exc.value.message
    with pytest.raises(InvalidRequest) as exc:
        await r.reorder(
            ReorderRequest("q?", passages, strategy="litm", design=DesignSpec(kind="random"))
        )
    assert exc.value.param == "design"
    with pytest.raises(InvalidRequest) as exc:
        await r.reorder(ReorderRequest("q?", passages, strategy="shuffle", joint=True))
    assert exc.value.param == "joint"
    with pytest.raises(InvalidRequest) as exc:
        await r.reorder(ReorderRequest("q?", passages, strategy="nope"))  # type: ignore[arg-type]
    assert exc.value.param == "strategy" and "moi" in exc.value.message
    assert backend.stats.score_calls == 0


async def test_moi_over_the_prompt_limit_is_refused_before_scoring(tmp_path: Path) -> None:
    r, backend = _reorderer(tmp_path, max_prompts_per_request=8)
    with pytest.raises(LimitExceeded) as exc:
        await r.reorder(ReorderRequest("q?", _passages(), design=DesignSpec(num_prompts=9)))
    assert exc.value.param == "design.num_prompts" and exc.value.value == 9
    assert backend.stats.score_calls == 0


def test_the_registry_names_every_strategy_once() -> None:
    names = strategy_names()
    assert names[0] == "moi" and len(set(names)) == len(names) == len(STRATEGIES)
    for name in names:
        s = get_strategy(name)
        assert s.name == name
        assert s.uses_design == (name == "moi")
