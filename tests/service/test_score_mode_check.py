"""vLLM's fast score path against the slow one at start-up: each outcome on synthetic rows."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from service.backends.base import PromptFailure, ScoreResult, SpanLogprobs, SpanRequest
from service.backends.engines.score_mode_check import (
    TOLERANCE_NATS,
    Mode,
    ScoreIn,
    ScoreModeCheck,
    ScoreModeMismatch,
    check_score_mode,
    compare,
    probe_requests,
)
from service.backends.tokenizers.byte_tokenizer import ByteTokenizer

PROBES = probe_requests(ByteTokenizer(), 4096)


def truth(req: SpanRequest, shift: int = 0) -> tuple[float, ...]:
    """A per-position log-prob, distinct for neighbouring positions (as a real model's are)."""
    return tuple(-1.0 - 3.0 * ((k + shift) % 3) for k in range(req.span_start, req.span_end))


def scorer(candidate: str) -> ScoreIn:
    async def score_in(mode: Mode, reqs: Sequence[SpanRequest]) -> list[ScoreResult]:
        if mode == "prompt_logprobs" or candidate == "right":
            return [SpanLogprobs(r.request_id, truth(r)) for r in reqs]
        if candidate == "noise":  # within bf16's tolerance
            return [SpanLogprobs(r.request_id, tuple(v + 0.1 for v in truth(r))) for r in reqs]
        if candidate == "off_by_one":  # each value the next row's
            return [SpanLogprobs(r.request_id, truth(r, shift=1)) for r in reqs]
        if candidate == "other_token":  # one token's value for another token
            out = []
            for r in reqs:
                vals = list(truth(r))
                vals[-1] -= 4.0
                out.append(SpanLogprobs(r.request_id, tuple(vals)))
            return out
        if candidate == "failure":
            return [PromptFailure(r.request_id, "vLLM rejected the request") for r in reqs]
        raise RuntimeError("engine error in token_ids mode")

    return score_in


def run(candidate: str, requested: str = "auto", dtype: str = "bfloat16") -> ScoreModeCheck:
    return asyncio.run(
        check_score_mode(
            scorer(candidate),
            PROBES,
            requested=requested,
            tolerance=TOLERANCE_NATS[dtype],  # type: ignore[arg-type]
        )
    )


def test_probes_cover_lengths_and_span_places() -> None:
    assert len({len(r.token_ids) for r in PROBES}) >= 3
    assert any(r.span_end == len(r.token_ids) for r in PROBES)
    assert any(r.span_end < len(r.token_ids) for r in PROBES)
    assert any(r.span_end - r.span_start == 1 for r in PROBES)
    assert all(r.span_start >= 1 for r in PROBES)


@pytest.mark.parametrize("candidate", ["right", "noise"])
def test_agreement_keeps_token_ids(candidate: str) -> None:
    check = run(candidate)
    assert (check.outcome, check.mode) == ("agreed", "token_ids")
    assert check.max_abs_diff == pytest.approx(0.0 if candidate == "right" else 0.1)


@pytest.mark.parametrize("candidate", ["off_by_one", "other_token", "failure"])
def test_a_difference_falls_back_to_prompt_logprobs(candidate: str) -> None:
    check = run(candidate)
    assert (check.outcome, check.mode) == ("disagreed", "prompt_logprobs")
    assert check.detail


def test_an_engine_error_falls_back_and_says_why() -> None:
    check = run("error")
    assert (check.outcome, check.mode) == ("failed", "prompt_logprobs")
    assert "RuntimeError" in check.detail


def test_float32_is_held_tighter_than_bfloat16() -> None:
    assert run("noise", dtype="bfloat16").outcome == "agreed"
    assert run("noise", dtype="float32").outcome == "disagreed"


@pytest.mark.parametrize("candidate", ["off_by_one", "error"])
def test_token_ids_set_explicitly_fails_the_start_naming_the_difference(candidate: str) -> None:
    with pytest.raises(ScoreModeMismatch, match="token_ids"):
        run(candidate, requested="token_ids")
    assert run("right", requested="token_ids").mode == "token_ids"


def test_compare_reports_the_first_difference() -> None:
    req = PROBES[0]
    ok, worst, detail = compare(
        [SpanLogprobs(req.request_id, (-1.0, -2.0))],
        [SpanLogprobs(req.request_id, (-1.0, -2.5))],
        0.4,
    )
    assert not ok and worst == pytest.approx(0.5) and "token 1" in detail
