"""What the vLLM backend asks of the engine and how it reads the answers: the score modes
(``prompt_logprobs`` rows, or the log-probs of named token ids with vLLM >= 0.32), the
``SamplingParams`` of a scoring and a generation request, and the checks every engine output
passes before it becomes a result (pure functions, unit-tested on synthetic outputs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from vllm import RequestOutput, SamplingParams
from vllm.logprobs import FlatLogprobs
from vllm.sampling_params import RequestOutputKind

from service.backends.base import (
    GenerateResult,
    Generation,
    GenerationRequest,
    PromptFailure,
    ScoreResult,
    SpanRequest,
    checked_span,
)

ScoreMode = Literal["auto", "token_ids", "prompt_logprobs"]
"""How span log-probs are asked of vLLM (see the module docstring); ``auto`` picks the best."""

# Feature-detected, not read from vLLM's version: on 2026-11-26 an H200 ran vLLM 0.26.0 (the
# newest release on the lent machines' torch 2.11), whose Model Runner V2 lacks them.
TOKEN_ID_PARAMS = "prompt_logprob_token_ids" in SamplingParams.__struct_fields__

# Kept short: a failure reason travels into response diagnostics and logs.
MAX_REASON_CHARS = 200


def resolve_score_mode(
    requested: ScoreMode, *, v2_runner: bool, token_id_params: bool
) -> Literal["token_ids", "prompt_logprobs"]:
    """The score mode an engine runs: ``token_ids`` needs Model Runner V2 and the vLLM fields.

    Raises:
        ValueError: ``token_ids`` asked of an engine that cannot run it (the message says why).
    """
    can = v2_runner and token_id_params
    if requested == "auto":
        return "token_ids" if can else "prompt_logprobs"
    if requested == "token_ids" and not can:
        missing = (
            "vLLM's Model Runner V2"
            if not v2_runner
            else "SamplingParams.prompt_logprob_token_ids (vLLM >= 0.32)"
        )
        raise ValueError(f"score_mode 'token_ids' needs {missing}")
    return requested


def score_params(req: SpanRequest, *, token_id_mode: bool) -> SamplingParams:
    """The engine request that scores ``req``'s span in the given score mode."""
    if token_id_mode:
        # Row i scores its ids as predictions of prompt token start + i + 1: rows from
        # span_start - 1 to the end of the cut prompt are exactly the span's tokens.
        span = req.token_ids[req.span_start : req.span_end]
        return SamplingParams(
            prompt_logprob_token_ids=np.array(span, dtype=np.int32).reshape(-1, 1),
            prompt_logprob_start=req.span_start - 1,
            max_tokens=1,
            temperature=0.0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
    return SamplingParams(
        prompt_logprobs=0,
        # A few flat lists per prompt instead of a dict and a Logprob object per row: far
        # less work for the garbage collector at thousands of rows per call.
        flat_logprobs=True,
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def generation_params(req: GenerationRequest, eos_token_ids: frozenset[int]) -> SamplingParams:
    """Greedy decoding that stops on the request's stop ids or the tokenizer's eos ids (vLLM's
    own eos rule off, so every backend stops on the same ids)."""
    return SamplingParams(
        max_tokens=req.max_new_tokens,
        temperature=0.0,
        logprobs=0,
        stop_token_ids=sorted(req.stop_token_ids | eos_token_ids),
        ignore_eos=True,
        detokenize=False,
        flat_logprobs=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def span_from_prompt_logprobs(req: SpanRequest, prompt_logprobs: object) -> ScoreResult:
    """Span log-probs out of vLLM ``prompt_logprobs`` (``prompt_logprobs=0``), checked.

    Args:
        req: the request; ``prompt_logprobs`` must cover ``token_ids[:span_end]`` at least.
        prompt_logprobs: ``FlatLogprobs`` or a list of ``{token_id: Logprob}`` (``None`` for
            the first position), as vLLM returns them.

    Returns:
        ``SpanLogprobs``, or ``PromptFailure`` when a row is missing, holds another token than
        the prompt's, or a value is non-finite or positive.
    """
    if prompt_logprobs is None:
        return PromptFailure(req.request_id, "engine returned no prompt log-probs")
    if not isinstance(prompt_logprobs, Sequence):
        return PromptFailure(req.request_id, "prompt log-probs are not a sequence")
    if len(prompt_logprobs) < req.span_end:
        return PromptFailure(
            req.request_id,
            f"engine returned {len(prompt_logprobs)} prompt rows, need {req.span_end}",
        )
    values: list[float] = []
    for pos in range(req.span_start, req.span_end):
        want = req.token_ids[pos]
        value = _row_value(prompt_logprobs, pos, want)
        if value is None:
            return PromptFailure(
                req.request_id, f"prompt row {pos} has no log-prob for its token {want}"
            )
        values.append(value)
    return checked_span(req.request_id, values)


def span_from_token_id_scores(req: SpanRequest, scores: object) -> ScoreResult:
    """Span log-probs out of vLLM ``prompt_token_id_logprobs`` (one id per row), checked.

    Args:
        req: the request; one row per span token was asked for.
        scores: array ``[span_end - span_start, 1]``, or ``None`` when vLLM dropped the rows.

    Returns:
        ``SpanLogprobs``, or ``PromptFailure`` on a wrong shape or a bad value.
    """
    if scores is None:
        return PromptFailure(req.request_id, "engine returned no prompt token-id log-probs")
    array = np.asarray(scores, dtype=np.float64)
    rows = req.span_end - req.span_start
    if array.shape != (rows, 1):
        return PromptFailure(
            req.request_id, f"token-id log-probs have shape {array.shape}, need {(rows, 1)}"
        )
    return checked_span(req.request_id, [float(v) for v in array[:, 0]])


def generation_from_output(request_id: str, out: RequestOutput) -> GenerateResult:
    """A ``Generation`` out of one finished vLLM request output, checked.

    Args:
        request_id: the caller's request id.
        out: the final ``RequestOutput`` of a request with ``logprobs=0``.

    Returns:
        ``Generation``, or ``PromptFailure`` on a missing or mismatched log-prob, a non-finite
        or positive one, or a finish reason other than ``stop``/``length``.
    """
    if len(out.outputs) != 1:
        return PromptFailure(request_id, f"engine returned {len(out.outputs)} completions")
    completion = out.outputs[0]
    reason = completion.finish_reason
    if reason not in ("stop", "length"):
        return PromptFailure(request_id, f"generation ended with {reason!r}")
    token_ids = tuple(int(t) for t in completion.token_ids)
    logprobs = completion.logprobs
    if logprobs is None or len(logprobs) != len(token_ids):
        return PromptFailure(request_id, "engine returned no log-prob for some generated token")
    values: list[float] = []
    for pos, token in enumerate(token_ids):
        value = _row_value(logprobs, pos, token)
        if value is None:
            return PromptFailure(request_id, f"generated token {pos} has no log-prob")
        values.append(value)
    checked = checked_span(request_id, values)
    if isinstance(checked, PromptFailure):
        return checked
    return Generation(request_id, token_ids, checked.logprobs, str(reason))


def with_score_logprobs(generated: GenerateResult, scored: ScoreResult) -> GenerateResult:
    """A generation with score ids, out of its generation's and its scoring's results.

    Returns:
        The generation with ``score_logprobs`` from ``scored``, or ``PromptFailure`` when
        either failed (the generation's failure first).
    """
    if isinstance(generated, PromptFailure):
        return generated
    if isinstance(scored, PromptFailure):
        reason = f"score_ids: {scored.reason}"
        return PromptFailure(generated.request_id, reason[:MAX_REASON_CHARS])
    return dataclasses.replace(generated, score_logprobs=scored.logprobs)


def _row_value(rows: Sequence[Any], pos: int, token: int) -> float | None:
    """The log-prob of ``token`` at position ``pos``, or None when that row lacks it."""
    if isinstance(rows, FlatLogprobs):
        # Read the flat lists directly: indexing a FlatLogprobs builds a dict per row.
        for k in range(rows.start_indices[pos], rows.end_indices[pos]):
            if rows.token_ids[k] == token:
                return float(rows.logprobs[k])
        return None
    row = rows[pos]
    if not row or token not in row:
        return None
    return float(row[token].logprob)


def echo_problem(request_id: str, sent: Sequence[int], out: RequestOutput) -> PromptFailure | None:
    # The output must be for the prompt we sent: a mix-up here would silently swap scores.
    echoed = out.prompt_token_ids
    if echoed is not None and tuple(echoed) != tuple(sent):
        return PromptFailure(request_id, "engine output is for another prompt")
    return None


def failure_reason(prefix: str, exc: BaseException) -> str:
    text = f"{prefix}: {exc}" if str(exc) else prefix
    return text[:MAX_REASON_CHARS]
