"""The whole MoI pipeline on the fake backend: known utilities and bias recovered end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy.stats import kendalltau

from service.backends.fakes.fake import FakeBackend
from service.config.settings import Settings
from service.errors import InvalidRequest, ScoringFailed, UnidentifiableRequest
from service.passage import Passage
from service.pipeline import DesignSpec, Reorderer, ReorderRequest, ReorderResult
from service.state.profile_store import ProfileStore

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


async def test_default_design_is_adaptive(tmp_path: Path) -> None:
    passages, truth = _world()
    res = await _reorderer(FakeBackend(truth), tmp_path).reorder(ReorderRequest("q", passages))
    assert res.design == "adaptive" and res.adaptive is not None
    assert res.slots == 4 and res.adaptive.max_prompts == 17  # N = 12: 0.3 N, half the tokens
    assert res.adaptive.stopped != "small_request"
    # Too few passages to adapt: pruned random's design in one round, labelled as such.
    small = await _reorderer(FakeBackend(truth), tmp_path / "s").reorder(
        ReorderRequest("q", passages[:3])
    )
    assert small.design == "adaptive" and small.adaptive is not None
    assert small.adaptive.stopped == "small_request" and small.prompts == 6 and small.slots == 2


async def test_failed_prompts_degrade_instead_of_failing(tmp_path: Path) -> None:
    passages, truth = _world()
    backend = FakeBackend(truth, fail_rule=lambda p: p.request_id.endswith(("-3", "-5")))
    res = await _reorderer(backend, tmp_path).reorder(
        ReorderRequest("q", passages, design=DesignSpec(kind="pruned_random"))
    )
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
    _store_bias(r, backend, N)
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


def _store_bias(r: Reorderer, backend: FakeBackend, slots: int) -> None:
    r.profiles.put(
        model=backend.model_id,
        template=r.settings.chat_template,
        coefficients=backend.bias_for(slots),
        identification="full",
        runs=1,
        prompts=1,
        r2=1.0,
        source="test",
    )


@pytest.mark.parametrize("profiled", [False, True])
async def test_adaptive_design_runs_in_rounds_within_its_budget(
    profiled: bool, tmp_path: Path
) -> None:
    """Without a profile the bias is fitted with the utilities (14 prompts first); with one
    for its slots the bias is fixed (12 first) and bias_matched places by the profile of the
    request's N slots. Either way the truth is recovered at a fraction of the default's
    prompt tokens, and the diagnostics say how it ran."""
    passages, truth = _world(n=10)

    async def run(folder: Path) -> ReorderResult:
        backend = FakeBackend(truth, noise=0.1, seed=1)
        r = _reorderer(backend, folder)
        if profiled:
            _store_bias(r, backend, 3)
            _store_bias(r, backend, 10)
        res = await r.reorder(req)
        assert res.usage.prompts_scored == backend.stats.prompts_scored
        return res

    req = ReorderRequest("q", passages, design=DesignSpec(kind="adaptive"))
    res = await run(tmp_path)
    rep = res.adaptive
    assert rep is not None and res.design == "adaptive" and res.slots == 3
    assert rep.bias == ("profile" if profiled else "fitted")
    assert rep.max_prompts == 15 and rep.prompts <= 15
    assert rep.prompts == res.usage.prompts_scored
    assert rep.prompts >= (12 if profiled else 14)
    assert rep.stopped in ("settled", "budget") and rep.target == 0.9
    assert (rep.stopped == "settled") == (rep.confidence >= 0.9)
    assert rep.rounds == 1 + (rep.prompts - (12 if profiled else 14)) // 2
    u_true = np.array([truth[p.text] for p in passages])
    assert kendalltau(res.fit.utilities, u_true)[0] > 0.7
    default = await _reorderer(FakeBackend(truth), tmp_path / "d").reorder(
        ReorderRequest("q", passages, design=DesignSpec(kind="pruned_random"))
    )
    # Passage-slots at most half the default's (the fake's passages are a few tokens, so its
    # template dominates prompt_tokens; real passages' tokens are in docs/evaluation.md).
    assert rep.prompts * res.slots <= 0.5 * default.usage.prompts * default.slots
    assert res.usage.prompt_tokens < 0.6 * default.usage.prompt_tokens
    if profiled:
        assert res.details["placement_profile"].endswith("L10")
    # The same request gives the same rounds (the pairs' fillers are seeded by the query).
    again = await run(tmp_path / "again")
    assert again.order == res.order and again.adaptive == rep


async def test_a_clear_leader_stops_the_adaptive_design_early(tmp_path: Path) -> None:
    passages, truth = _world(n=10)
    truth = {k: 0.0 for k in truth}
    truth[passages[6].text] = 20.0
    backend = FakeBackend(truth, noise=0.01)
    r = _reorderer(backend, tmp_path)
    _store_bias(r, backend, 3)
    res = await r.reorder(ReorderRequest("q", passages, design=DesignSpec(kind="adaptive")))
    assert res.adaptive is not None
    assert (res.adaptive.stopped, res.adaptive.rounds, res.adaptive.prompts) == ("settled", 1, 12)
    assert res.ranking[0] == 6


async def test_adaptive_design_never_fixes_a_profile_auto_rejected(tmp_path: Path) -> None:
    """A profile auto learned and then rejected after a drift stays stored (as undecided):
    the adaptive design must fit the bias instead of fixing it there, and say why; a trusted
    or data-oriented one is fixed, and the diagnostics say on which ground."""
    from service.state.profile_store import ProfileTrust

    passages, truth = _world(n=10)
    backend = FakeBackend(truth, noise=0.1, seed=1)
    r = _reorderer(backend, tmp_path)
    req = ReorderRequest("q", passages, design=DesignSpec(kind="adaptive"))

    def trust(verdict: str) -> ProfileTrust:
        return ProfileTrust(
            verdict=verdict, reason=f"{verdict}: test", runs=8, flat_p=0.5, spread=0.1,  # type: ignore[arg-type]
            spread_upper=0.2, stability=0.5, top_slots=(0, 1), placement_slots=6,
            resamples=10, covariance=((0.0,) * 3,) * 3, assessed_at=0.0, source="traffic",
        )  # fmt: skip

    def store(slots: int, verdict: str | None) -> None:
        r.profiles.put(
            model=backend.model_id, template=r.settings.chat_template,
            coefficients=list(reversed(backend.bias_for(slots))), identification="full",
            runs=8, prompts=96, r2=0.9, source="learned by auto", oriented_by="data",
            trust=trust(verdict) if verdict else None,
        )  # fmt: skip

    store(3, "undecided")  # its slots' profile, rejected after a drift
    store(5, "undecided")  # and one of another slot count, not trusted either
    res = await r.reorder(req)
    assert res.adaptive is not None and res.adaptive.bias == "fitted"
    assert res.adaptive.bias_profile is None and res.adaptive.bias_basis is None
    assert any("__L3' is not trusted (undecided: test)" in w for w in res.warnings)
    assert any("__L5' is not trusted" in w for w in res.warnings)
    store(5, "shaped")  # a trusted one of another slot count is resampled and fixed
    res = await r.reorder(req)
    assert res.adaptive is not None and res.adaptive.bias == "resampled_profile"
    assert res.adaptive.bias_profile is not None and res.adaptive.bias_profile.endswith("L5")
    assert res.adaptive.bias_basis == "trusted"
    store(3, None)  # an operator's calibration, oriented by data, no verdict
    res = await r.reorder(req)
    assert res.adaptive is not None and res.adaptive.bias == "profile"
    assert res.adaptive.bias_basis == "data_oriented"
    assert not any("not trusted" in w for w in res.warnings)


async def test_adaptive_options_are_checked_before_any_call(tmp_path: Path) -> None:
    passages, truth = _world(n=10)
    backend = FakeBackend(truth)
    r = _reorderer(backend, tmp_path)
    for spec, match in [
        (DesignSpec(kind="adaptive", num_prompts=5), "num_prompts >= "),
        (DesignSpec(kind="adaptive", variable_pruning=True), "variable_pruning"),
        (DesignSpec(kind="pruned_random", stop_confidence=0.95), "stop_confidence"),
        (DesignSpec(kind="adaptive", prompt_passages=10), "prompt_passages"),
    ]:
        with pytest.raises(InvalidRequest, match=match):
            await r.reorder(ReorderRequest("q", passages, design=spec))
    assert backend.stats.score_calls == 0
