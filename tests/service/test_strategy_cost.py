"""Each strategy's stated ``Cost`` against the calls it then makes (issue 77).

Admission prices a request from its strategy's ``Cost`` before the first prompt is built
(``Work.admit``); a cost that disagrees with the calls lets through work that ends in a 504,
or refuses work that would have fit. Every named strategy runs here through a backend that
records what reached it, with a gate that records the estimate admission was asked to admit,
on the fake backend (byte tokens) and on the tiny real model behind the real SmolLM2 tokenizer
and chat template. The estimate must match the calls:

- prompts: the distinct prompts sent (``Work`` merges identical ones), exactly; a budgeted
  design (MoI's ``adaptive``) states the most it may send: at most that, at least half;
- prompt tokens: within ``TOKEN_TOLERANCE`` of the tokens sent (the estimate renders one
  prompt and each passage once, a shuffle or design row of k < N passages at their average
  length);
- answer budget: the ``max_new_tokens`` sent, summed, exactly; the tokens generated never
  exceed it;
- the planned calls (``Cost.prompts``) are the ones the usage reports (``usage.prompts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from service.backends.base import (
    GenerateResult,
    GenerationRequest,
    LogprobBackend,
    PromptTokenizer,
    ScoreResult,
    SpanRequest,
)
from service.backends.fakes.fake import FakeBackend
from service.config.settings import Settings
from service.passage import Passage
from service.pipeline import DesignSpec, Reorderer, ReorderRequest, StrategyOptions
from service.state.positional_store import PositionalStore
from service.state.profile_store import ProfileStore
from service.strategies import strategy_names
from service.strategies.request import Estimate
from tests.service.test_distraction import make_record

TOKEN_TOLERANCE = 0.05
"""Relative error allowed on the prompt tokens (measured: at most 2% on these requests)."""

QUERY = "who wrote the novel that the film was based on?"
# Ten passages of clearly different lengths: a design row or shuffle of k < N passages is
# estimated at the average length, which only holds if the test does not make them equal.
TEXTS = [
    f"Passage {i} tells of the writer number {i}. " + "A detail. " * (1 + 2 * i) for i in range(10)
]


@dataclass
class Recorded:
    """What reached the backend: per distinct prompt, its tokens and its answer budget."""

    prompt_tokens: list[int] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)


class RecordingBackend:
    """A ``LogprobBackend`` that passes every call to ``inner`` and records it."""

    def __init__(self, inner: LogprobBackend) -> None:
        self.inner = inner
        self.calls = Recorded()

    @property
    def model_id(self) -> str:
        return self.inner.model_id

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def tokenizer(self) -> PromptTokenizer:
        return self.inner.tokenizer

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        for r in requests:
            self.calls.prompt_tokens.append(len(r.token_ids))
            self.calls.new_tokens.append(0)
        return await self.inner.score(requests)

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        for r in requests:
            # Score ids are prefilled after the prompt, in the same forward.
            self.calls.prompt_tokens.append(len(r.token_ids) + len(r.score_ids))
            self.calls.new_tokens.append(r.max_new_tokens)
        return await self.inner.generate(requests)

    async def aclose(self) -> None:
        await self.inner.aclose()


class RecordingGate:
    """A ``RequestGate`` that admits everything and keeps the estimates it was asked."""

    def __init__(self) -> None:
        self.estimates: list[Estimate] = []

    def admit(self, estimate: Estimate) -> float | None:
        self.estimates.append(estimate)
        return None

    def release(self) -> None:
        pass

    def estimate_s(self, estimate: Estimate) -> float | None:
        # No measured rate: ``auto`` then runs its MoI path in the caller's time, admitted.
        return None


# (strategy, options, design): every named strategy with its defaults, and the options that
# change what it sends (samples, answer budgets, MoI's designs).
CASES: list[tuple[str, dict[str, Any], DesignSpec]] = [
    *((name, {}, DesignSpec()) for name in strategy_names()),
    ("query_likelihood", {"samples": 3}, DesignSpec()),
    ("self_consistency", {"samples": 5, "max_answer_tokens": 7}, DesignSpec()),
    ("lore", {"max_answer_tokens": 5}, DesignSpec()),
    ("moi", {}, DesignSpec(kind="pruned_random")),
    ("moi", {}, DesignSpec(kind="adaptive")),
    ("moi", {}, DesignSpec(kind="random")),
]
BUDGETED = {("moi", None), ("moi", "adaptive")}
"""MoI's default design is adaptive: it states its budget, the most its rounds may send."""


def _reorderer(backend: LogprobBackend, tmp_path: Path, n: int) -> tuple[Reorderer, RecordingGate]:
    profiles = ProfileStore(tmp_path / "profiles")
    # The positional strategies need a profile for n slots; its values do not change the calls.
    PositionalStore.beside(profiles).put(
        make_record(
            model=backend.model_id,
            accuracy=tuple(0.5 + 0.01 * j for j in range(n)),
            effect=tuple(0.3 + 0.01 * j for j in range(n)),
        )
    )
    gate = RecordingGate()
    return Reorderer(backend, Settings(cache_dir=tmp_path), profiles, gate=gate), gate


async def _check(
    inner: LogprobBackend,
    tmp_path: Path,
    n: int,
    name: str,
    opts: dict[str, Any],
    design: DesignSpec,
) -> None:
    backend = RecordingBackend(inner)
    reorderer, gate = _reorderer(backend, tmp_path, n)
    request = ReorderRequest(
        QUERY,
        [Passage(text=t, title=f"Title {i}") for i, t in enumerate(TEXTS[:n])],
        strategy=name,  # type: ignore[arg-type]
        options=StrategyOptions(**opts),
        design=design,
    )
    cost = reorderer.cost(request)
    result = await reorderer.reorder(request)
    sent = backend.calls
    case = f"{name} {opts} {design.kind}"
    if not cost.calls:
        assert not sent.prompt_tokens and not gate.estimates, case
        return
    # auto states the most it may need and admits its MoI path when it takes it (a fresh
    # store: it does); every other strategy is admitted once, before its first call.
    assert len(gate.estimates) == 1, case
    est = gate.estimates[0]
    budgeted = (name, design.kind) in BUDGETED or name == "auto"
    if budgeted:
        assert est.prompts / 2 <= len(sent.prompt_tokens) <= est.prompts, case
        assert sum(sent.prompt_tokens) <= est.prompt_tokens * (1 + TOKEN_TOLERANCE), case
    else:
        assert len(sent.prompt_tokens) == est.prompts, case
        assert result.usage.prompts == cost.prompts, case
        assert sum(sent.prompt_tokens) == pytest.approx(est.prompt_tokens, rel=TOKEN_TOLERANCE), (
            case,
            sum(sent.prompt_tokens),
            est.prompt_tokens,
        )
    assert sum(sent.new_tokens) == est.new_tokens, case
    assert result.usage.generated_tokens <= est.new_tokens, case
    assert result.usage.prompt_tokens == sum(sent.prompt_tokens), case


@pytest.mark.parametrize(("name", "opts", "design"), CASES)
async def test_fake_backend_calls_match_the_stated_cost(
    tmp_path: Path, name: str, opts: dict[str, Any], design: DesignSpec
) -> None:
    fake = FakeBackend({t: float(i % 4) for i, t in enumerate(TEXTS)})
    await _check(fake, tmp_path, 10, name, opts, design)


@pytest.fixture(scope="module")
def tiny_backend(tiny_model_dir: Path) -> LogprobBackend:
    from service.backends.engines.transformers_backend import TransformersBackend

    return TransformersBackend.load(tiny_model_dir, model_id="tiny", device="cpu")


@pytest.mark.parametrize(("name", "opts", "design"), CASES)
async def test_tiny_model_calls_match_the_stated_cost(
    tmp_path: Path,
    tiny_backend: LogprobBackend,
    name: str,
    opts: dict[str, Any],
    design: DesignSpec,
) -> None:
    # Six passages: the real tokenizer and chat template at a fraction of ten's convex_score.
    await _check(tiny_backend, tmp_path, 6, name, opts, design)


def test_the_cases_name_every_strategy() -> None:
    assert {name for name, _, _ in CASES} == set(strategy_names())
