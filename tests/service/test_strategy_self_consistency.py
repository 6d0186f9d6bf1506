"""``self_consistency`` on the fake backend, votes hand-counted from the fake's generation rule.

Fake rule (``service.backends.fakes.fake``): a prompt is answered from its highest-utility passage,
the earliest slot on ties, with ``answers[text]`` (or its first 3 words), every token at
log-prob ``log(sigmoid(u))``, then the end-of-turn token. Three passages tied at the top
utility make the answer depend on the order: it is that of whichever of them comes first.
The permutations are replayed from the documented seed rule (``rng_for``: numpy's
``default_rng([seed, crc32(query)])``, one ``permutation(N)`` per sample).
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
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

TEXTS = [
    "alpha apple one extra",  # top utility, answers "Paris."
    "bravo banana two extra",  # low utility
    "charlie cherry three extra",  # top utility, answers "paris" (same normalised form)
    "delta date four extra",  # top utility, answers "London"
    "echo elderberry five extra",  # low utility
]
UTILITY = [1.5, -1.0, 1.5, 1.5, 0.0]
RAW = {0: "Paris.", 2: "paris", 3: "London"}
FORM = {0: "paris", 2: "paris", 3: "london"}
QUERY = "what is the capital?"


def sigmoid(u: float) -> float:
    return 1.0 / (1.0 + math.exp(-u))


def details(res: ReorderResult) -> dict[str, Any]:
    return cast(dict[str, Any], res.details)


def _setup(tmp_path: Path, **settings: object) -> tuple[Reorderer, FakeBackend]:
    backend = FakeBackend(
        dict(zip(TEXTS, UTILITY, strict=True)), answers={TEXTS[i]: a for i, a in RAW.items()}
    )
    s = Settings(cache_dir=tmp_path, **settings)  # type: ignore[arg-type]
    return Reorderer(backend, s, ProfileStore(tmp_path / "profiles")), backend


def _sc(passages: list[Passage] | None = None, /, **options: object) -> ReorderRequest:
    return ReorderRequest(
        QUERY,
        passages if passages is not None else [Passage(t) for t in TEXTS],
        strategy="self_consistency",
        options=StrategyOptions(**options),  # type: ignore[arg-type]
    )


def _perms(k: int, n: int = 5, seed: int = 0, query: str = QUERY) -> list[list[int]]:
    rng = np.random.default_rng([seed, zlib.crc32(query.encode("utf-8"))])
    return [[int(i) for i in rng.permutation(n)] for _ in range(k)]


def _speaker(perm: list[int]) -> int:
    """The passage the fake answers from: the first of the tied top passages 0, 2, 3."""
    return next(i for i in perm if i in RAW)


def _expected_vote(perms: list[list[int]], dropped: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Hand count: votes per form, the winner (ties: earliest sample), its first sample."""
    kept = [(s, _speaker(p)) for s, p in enumerate(perms) if s not in dropped]
    votes = Counter(FORM[i] for _, i in kept)
    first: dict[str, tuple[int, int]] = {}
    for s, i in kept:
        first.setdefault(FORM[i], (s, i))
    winner = min(votes, key=lambda f: (-votes[f], first[f][0]))
    sample, passage = first[winner]
    return {"votes": votes, "winner": winner, "sample": sample, "text": RAW[passage]}


async def test_majority_vote_over_seeded_permutations(tmp_path: Path) -> None:
    r, backend = _setup(tmp_path)
    k = 12
    perms = _perms(k)
    exp = _expected_vote(perms)
    # The order decides the answer, so this case really votes (both forms occur).
    assert set(exp["votes"]) == {"paris", "london"}
    res = await r.reorder(_sc(samples=k))
    assert res.answer is not None
    assert res.answer.text == exp["text"]
    assert res.answer.votes == exp["votes"][exp["winner"]] and res.answer.samples == k
    assert res.answer.passage is None
    # All tied passages share u = 1.5: every answer's mean token probability is sigmoid(1.5).
    assert res.answer.probability == pytest.approx(sigmoid(1.5), abs=1e-12)
    # The order is the first sampled permutation that gave the winning form.
    assert res.order == res.ranking == perms[exp["sample"]]
    assert details(res)["permutation"] == exp["sample"]
    assert res.scores is None and res.score_name is None and res.passage_answers is None
    assert details(res)["samples"] == details(res)["counted"] == k
    assert details(res)["distinct_answers"] == 2
    top = exp["winner"]
    other = "london" if top == "paris" else "paris"
    assert [v["votes"] for v in details(res)["votes"]] == [exp["votes"][top], exp["votes"][other]]
    # Cost: K planned generations, each distinct permutation generated once.
    distinct = {tuple(p) for p in perms}
    assert res.usage.prompts == k and res.usage.generations == len(distinct)
    tokens = sum(len(RAW[_speaker(list(p))].encode()) + 1 for p in distinct)
    assert res.usage.generated_tokens == tokens == backend.stats.generated_tokens
    assert res.usage.prompts_scored == res.usage.scored_tokens == 0
    assert backend.stats.generate_calls == 1 and res.warnings == ()


async def test_a_vote_and_a_tie_counted_by_hand(tmp_path: Path) -> None:
    r, backend = _setup(tmp_path)
    # The seed-0 stream for QUERY, and the passage that answers (the first of 0, 2, 3):
    #   0 [1,3,0,4,2] 3 London    1 [2,3,4,1,0] 2 paris     2 [2,0,4,3,1] 2 paris
    #   3 [4,1,0,3,2] 0 Paris.    4 [4,3,0,1,2] 3 London    5 [0,1,3,4,2] 0 Paris.
    #   6 [1,0,3,4,2] 0 Paris.    7 [4,2,3,0,1] 2 paris     8 [0,3,1,4,2] 0 Paris.
    #   9 [4,3,1,0,2] 3 London   10 [0,4,3,1,2] 0 Paris.   11 [4,2,3,1,0] 2 paris
    assert _perms(12)[:2] == [[1, 3, 0, 4, 2], [2, 3, 4, 1, 0]]
    res = await r.reorder(_sc(samples=12))
    # "Paris." and "paris" normalise alike: 9 votes against 3 for "London". The text is the
    # first raw answer of that form (sample 1, "paris"), the order that sample's permutation.
    assert res.answer is not None
    assert (res.answer.text, res.answer.votes, res.answer.samples) == ("paris", 9, 12)
    assert res.order == res.ranking == [2, 3, 4, 1, 0]
    assert details(res)["votes"] == [
        {"answer": "paris", "votes": 9},
        {"answer": "London", "votes": 3},
    ]
    # 12 distinct prompts: 5 x "Paris." (6 bytes) + 4 x "paris" (5) + 3 x "London" (6),
    # each answer plus its end-of-turn token: 35 + 24 + 21.
    assert res.usage.generations == 12 and res.usage.generated_tokens == 80
    # The first two samples alone: one vote each; the tie goes to the form sampled first.
    tie = await r.reorder(_sc(samples=2))
    assert tie.answer is not None
    assert (tie.answer.text, tie.answer.votes, tie.answer.samples) == ("London", 1, 2)
    assert tie.order == [1, 3, 0, 4, 2]
    assert backend.stats.generate_calls == 2


async def test_default_is_thirty_samples_and_the_seed_is_reproducible(tmp_path: Path) -> None:
    r, _ = _setup(tmp_path)
    assert r.planned_prompts(_sc()) == 30
    res = await r.reorder(_sc())
    exp = _expected_vote(_perms(30))
    assert res.usage.prompts == 30 and res.answer is not None and res.answer.samples == 30
    assert res.answer.text == exp["text"] and res.order == _perms(30)[exp["sample"]]
    again = await r.reorder(_sc(seed=0))
    assert again.order == res.order and again.answer == res.answer
    seeded = await r.reorder(_sc(samples=8, seed=7))
    exp7 = _expected_vote(_perms(8, seed=7))
    assert seeded.order == _perms(8, seed=7)[exp7["sample"]]
    assert seeded.answer is not None and seeded.answer.votes == exp7["votes"][exp7["winner"]]


async def test_duplicate_permutations_are_generated_once_but_vote_each_time(
    tmp_path: Path,
) -> None:
    r, _ = _setup(tmp_path)
    two = [Passage(TEXTS[0]), Passage(TEXTS[3])]  # tied: the first slot answers
    res = await r.reorder(_sc(two, samples=10))
    perms = _perms(10, n=2)
    first_slot = Counter(p[0] for p in perms)  # passage 0 -> "Paris.", passage 1 -> "London"
    assert res.usage.prompts == 10 and res.usage.generations == len({tuple(p) for p in perms})
    assert res.usage.generations <= 2
    assert res.answer is not None and res.answer.samples == 10
    winner = min(first_slot, key=lambda i: (-first_slot[i], [p[0] for p in perms].index(i)))
    assert res.answer.votes == first_slot[winner]
    assert res.answer.text == ("Paris." if winner == 0 else "London")
    # One passage: every permutation is the same prompt, generated once, K votes.
    res = await r.reorder(_sc([Passage(TEXTS[1])], samples=7))
    assert res.usage.generations == 1 and res.order == [0]
    assert res.answer is not None and res.answer.votes == res.answer.samples == 7
    assert res.answer.text == "bravo banana two"
    assert res.answer.probability == pytest.approx(sigmoid(-1.0), abs=1e-12)


async def test_failed_generations_are_dropped_from_the_vote(tmp_path: Path) -> None:
    r, backend = _setup(tmp_path)
    k = 12
    perms = _perms(k)
    # Every prompt answered from passage 0 fails: the Paris. voters lose their samples with it.
    tied = {TEXTS[i] for i in RAW}
    backend.fail_rule = lambda p: next(t for t in p.passages if t in tied) == TEXTS[0]
    dropped = frozenset(s for s, p in enumerate(perms) if _speaker(p) == 0)
    assert 0 < len(dropped) < k
    exp = _expected_vote(perms, dropped)
    res = await r.reorder(_sc(samples=k))
    assert res.answer is not None and res.answer.samples == k - len(dropped)
    assert res.answer.text == exp["text"] and res.answer.votes == exp["votes"][exp["winner"]]
    assert res.order == perms[exp["sample"]]
    assert details(res)["counted"] == k - len(dropped)
    assert res.usage.prompts_failed == len({tuple(perms[s]) for s in dropped})
    assert any(f"{len(dropped)} of {k} permutation answers failed" in w for w in res.warnings)


async def test_all_generations_failing_is_a_scoring_failure(tmp_path: Path) -> None:
    r, backend = _setup(tmp_path)
    backend.fail_rule = lambda p: True
    with pytest.raises(ScoringFailed):
        await r.reorder(_sc(samples=4))


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"samples": 0}, "samples"),
        ({"max_answer_tokens": 0}, "max_answer_tokens"),
        ({"rankings": ((0, 1),)}, "rankings"),  # a LoRE option
        ({"rrf_k": 5}, "rrf_k"),
    ],
)
async def test_invalid_options_are_refused(
    tmp_path: Path, options: dict[str, object], param: str
) -> None:
    r, backend = _setup(tmp_path)
    with pytest.raises(InvalidRequest) as exc:
        await r.reorder(_sc(**options))
    assert exc.value.param == param and backend.stats.generate_calls == 0


async def test_samples_over_the_prompt_limit_are_refused(tmp_path: Path) -> None:
    r, backend = _setup(tmp_path, max_prompts_per_request=10)
    with pytest.raises(LimitExceeded) as exc:
        await r.reorder(_sc(samples=11))
    assert exc.value.param == "samples" and exc.value.value == 11
    with pytest.raises(LimitExceeded):
        await r.reorder(_sc())  # the default K = 30
    assert backend.stats.generate_calls == 0


async def test_answer_budget_applies_to_every_sample(tmp_path: Path) -> None:
    r, backend = _setup(tmp_path)
    res = await r.reorder(_sc(samples=6, max_answer_tokens=3))
    assert backend.stats.generated_tokens == res.usage.generated_tokens
    assert res.answer is not None and res.answer.text in ("Par", "par", "Lon")
    assert res.usage.generated_tokens == 3 * res.usage.generations


# --- a real model ----------------------------------------------------------------------------


async def test_runs_on_a_tiny_real_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    from service.backends.engines.transformers_backend import TransformersBackend

    backend = TransformersBackend.load(tiny_model_dir, model_id="tiny", device="cpu")
    r = Reorderer(backend, Settings(cache_dir=tmp_path), ProfileStore(tmp_path / "p"))
    passages = [
        Passage(text="J. R. R. Tolkien wrote The Lord of the Rings."),
        Passage(text="C. S. Lewis wrote The Chronicles of Narnia."),
        Passage(text="The Hobbit was published in 1937."),
    ]
    req = ReorderRequest(
        "who wrote the lord of the rings",
        passages,
        strategy="self_consistency",
        options=StrategyOptions(samples=4, max_answer_tokens=4),
    )
    res = await r.reorder(req)
    assert sorted(res.order) == [0, 1, 2] and res.ranking == res.order
    assert res.answer is not None and res.answer.samples == 4
    assert 1 <= res.answer.votes <= 4  # type: ignore[operator]
    assert res.answer.probability is not None and 0.0 <= res.answer.probability <= 1.0
    assert sum(v["votes"] for v in details(res)["votes"]) <= 4
    assert res.usage.prompts == 4 and 1 <= res.usage.generations <= 4
    await backend.aclose()
