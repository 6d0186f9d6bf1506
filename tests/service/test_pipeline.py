"""The whole MoI pipeline on the fake backend: known utilities and bias recovered end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy.stats import kendalltau

from service.backends.fake import FakeBackend
from service.errors import InvalidRequest, ScoringFailed, UnidentifiableRequest
from service.passage import Passage
from service.pipeline import DesignSpec, Reorderer, ReorderRequest
from service.profile_store import ProfileStore
from service.settings import Settings

N = 12


def _world(n: int = N, seed: int = 0) -> tuple[list[Passage], dict[str, float]]:
    rng = np.random.default_rng(seed)
    utilities = rng.standard_normal(n)
    passages = [
        Passage(text=f"passage number {i} says {'abc'[i % 3]} {i * 7}", title=f"T{i}", score=-i)
        for i in range(n)
    ]
    return passages, {p.text: float(u) for p, u in zip(passages, utilities, strict=True)}


def _reorderer(backend: FakeBackend, tmp_path: Path) -> Reorderer:
    settings = Settings(cache_dir=tmp_path)
    return Reorderer(backend, settings, ProfileStore(tmp_path / "profiles"))


@pytest.mark.parametrize("kind", ["pruned_random", "random", "hybrid"])
async def test_known_truth_is_recovered_through_the_pipeline(kind: str, tmp_path: Path) -> None:
    passages, truth = _world()
    backend = FakeBackend(truth, noise=0.001)
    r = _reorderer(backend, tmp_path)
    res = await r.reorder(
        ReorderRequest("which passage helps?", passages, design=DesignSpec(kind=kind))  # type: ignore[arg-type]
    )
    u_true = np.array([truth[p.text] for p in passages])
    assert kendalltau(res.fit.utilities, u_true)[0] > 0.95
    assert res.ranking == sorted(range(N), key=lambda i: -res.fit.utilities[i])
    assert res.order == res.ranking  # descending_utility placement
    assert res.usage.prompts == res.usage.prompts_scored == backend.stats.prompts_scored
    assert res.usage.scored_tokens > 0 and res.usage.prompt_tokens > res.usage.scored_tokens
    assert res.timing.total_s >= res.timing.scoring_s > 0
    if kind == "pruned_random":
        assert res.fit.orientation == "data"
        np.testing.assert_allclose(res.fit.position_bias, backend.bias_for(res.slots), atol=0.02)


async def test_default_design_is_pruned_random(tmp_path: Path) -> None:
    passages, truth = _world()
    res = await _reorderer(FakeBackend(truth), tmp_path).reorder(ReorderRequest("q", passages))
    assert res.design == "pruned_random"
    assert res.slots == N // 2 and res.prompts == 2 * N


async def test_failed_prompts_degrade_instead_of_failing(tmp_path: Path) -> None:
    passages, truth = _world()
    backend = FakeBackend(truth, fail_rule=lambda p: p.request_id.endswith(("-3", "-5")))
    res = await _reorderer(backend, tmp_path).reorder(ReorderRequest("q", passages))
    assert res.usage.prompts_failed == 2 and res.fit.prompts_dropped == 2
    assert any("failed to score" in w for w in res.warnings)
    u_true = np.array([truth[p.text] for p in passages])
    assert kendalltau(res.fit.utilities, u_true)[0] > 0.95


async def test_nan_logprobs_are_dropped_like_failures(tmp_path: Path) -> None:
    passages, truth = _world()
    backend = FakeBackend(truth, nan_rule=lambda p: p.request_id.endswith("-0"))
    res = await _reorderer(backend, tmp_path).reorder(ReorderRequest("q", passages))
    assert res.usage.prompts_failed == 1


async def test_too_many_failures_is_a_scoring_failure(tmp_path: Path) -> None:
    passages, truth = _world()
    backend = FakeBackend(truth, fail_rule=lambda p: int(p.request_id.rsplit("-", 1)[1]) % 2 == 0)
    with pytest.raises(ScoringFailed, match="failed to score"):
        await _reorderer(backend, tmp_path).reorder(ReorderRequest("q", passages))


async def test_cyclic_needs_a_calibrated_profile(tmp_path: Path) -> None:
    passages, truth = _world()
    backend = FakeBackend(truth)
    r = _reorderer(backend, tmp_path)
    req = ReorderRequest("q", passages, design=DesignSpec(kind="cyclic"))
    with pytest.raises(UnidentifiableRequest, match="calibrate"):
        await r.reorder(req)
    assert backend.stats.score_calls == 0  # refused before spending compute
    r.profiles.put(
        model=backend.model_id,
        template=r.settings.chat_template,
        coefficients=backend.bias_for(N),
        identification="full",
        runs=1,
        prompts=1,
        r2=1.0,
        source="test",
    )
    res = await r.reorder(req)
    assert res.profile is not None and res.fit.orientation == "reference"
    u_true = np.array([truth[p.text] for p in passages])
    assert kendalltau(res.fit.utilities, u_true)[0] > 0.95


async def test_identical_prompts_are_scored_once(tmp_path: Path) -> None:
    passages, truth = _world(n=1)
    twins = [passages[0], Passage(text=passages[0].text, title=passages[0].title, score=1.0)]
    backend = FakeBackend(truth)
    res = await _reorderer(backend, tmp_path).reorder(
        ReorderRequest("q", twins, design=DesignSpec(kind="random"))
    )
    # [0, 1] and [1, 0] render the same prompt: one forward pass, and equal scores.
    assert (res.usage.prompts, res.usage.prompts_scored) == (2, 1)
    assert backend.stats.prompts_scored == 1
    assert res.ranking == [1, 0]  # tie broken by the retriever score
    assert any("all scores are equal" in w for w in res.warnings)


async def test_generate_and_score_is_both_calls_in_one_prefill(tmp_path: Path) -> None:
    passages, truth = _world(n=3)
    orders = [[0, 1, 2], [2, 1, 0], [0, 1, 2]]  # the third repeats the first
    separate_backend, fused_backend = FakeBackend(truth), FakeBackend(truth)
    separate = _reorderer(separate_backend, tmp_path).work("s")
    fused = _reorderer(fused_backend, tmp_path).work("f")
    prompts = await separate.generation_prompts("q?", passages, orders)
    answers = await separate.generate(prompts, max_new_tokens=8)
    rows = await separate.continuation_logprobs(prompts, "gold answer")
    got = await fused.generate_and_score(prompts, "gold answer", max_new_tokens=8)
    assert got == list(zip(answers, rows, strict=True))
    assert got[0] == got[2] and got[0][1] is not None and len(got[0][1]) == 11
    # One generation call; two distinct prompts, each prefilled once with the 11 gold tokens
    # after it; the third order is the first one's prompt, sent once.
    assert (fused_backend.stats.generate_calls, fused_backend.stats.score_calls) == (1, 0)
    usage = fused.usage()
    distinct = len(prompts[0].token_ids) + len(prompts[1].token_ids)
    assert (usage.prompts, usage.prompts_scored, usage.generations) == (3, 2, 2)
    assert usage.prompt_tokens == distinct + 2 * 11 == fused_backend.stats.prompt_tokens
    assert usage.scored_tokens == 2 * 11 and usage.prompts_failed == 0
    assert usage.generated_tokens == separate.usage().generated_tokens
    # The separate calls counted two model calls per order and two prefills per prompt.
    assert separate.usage().prompts == 6 and separate.usage().prompt_tokens == 2 * distinct + 22
    with pytest.raises(InvalidRequest, match="continuation is empty"):
        await fused.generate_and_score(prompts, "", max_new_tokens=8)


async def test_variable_pruning_needs_scores(tmp_path: Path) -> None:
    passages, truth = _world()
    r = _reorderer(FakeBackend(truth), tmp_path)
    res = await r.reorder(
        ReorderRequest("q", passages, design=DesignSpec(variable_pruning=True, num_prompts=30))
    )
    assert res.prompts == 30
    bare = [Passage(text=p.text) for p in passages]
    with pytest.raises(InvalidRequest, match="retriever score"):
        await r.reorder(ReorderRequest("q", bare, design=DesignSpec(variable_pruning=True)))


async def test_bad_design_is_an_invalid_request(tmp_path: Path) -> None:
    passages, truth = _world()
    r = _reorderer(FakeBackend(truth), tmp_path)
    with pytest.raises(InvalidRequest, match="exceeds") as exc:
        await r.reorder(ReorderRequest("q", passages[:3], design=DesignSpec(num_prompts=99)))
    assert exc.value.param == "design"
    with pytest.raises(UnidentifiableRequest):
        await r.reorder(
            ReorderRequest("q", passages, design=DesignSpec(kind="random", num_prompts=5))
        )


async def test_single_passage_and_bias_matched_placement(tmp_path: Path) -> None:
    passages, truth = _world()
    r = _reorderer(FakeBackend(truth, bias=lambda L: [1.0] * (L - 1) + [5.0]), tmp_path)
    one = await r.reorder(ReorderRequest("q", passages[:1]))
    assert one.order == [0]
    res = await r.reorder(ReorderRequest("q", passages, placement="bias_matched"))
    assert res.order[-1] == res.ranking[0]  # recency-heavy bias: best passage last


async def test_confidence_method_setting_picks_the_covariance_estimate(tmp_path: Path) -> None:
    passages, truth = _world()
    results = {}
    for method in ("jackknife", "delta"):
        backend = FakeBackend(truth, noise=0.05)
        settings = Settings(cache_dir=tmp_path, confidence_method=method)  # type: ignore[arg-type]
        r = Reorderer(backend, settings, ProfileStore(tmp_path / "profiles"))
        results[method] = (await r.reorder(ReorderRequest("q", passages))).fit
    jack, delta = results["jackknife"], results["delta"]
    assert jack.order == delta.order  # the point fit does not depend on it
    assert jack.utility_stderr is not None and delta.utility_stderr is not None
    assert not np.allclose(jack.utility_stderr, delta.utility_stderr)
    assert Settings().confidence_method == "jackknife"
