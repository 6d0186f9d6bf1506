"""SGLang's native ``/generate``, as ``RemoteBackend`` speaks it (``engine_dialect=sglang``).

The wire format, from SGLang's own definitions (``sgl-project/sglang``, release 0.5.23:
``python/sglang/srt/managers/io_struct.py`` ``GenerateReqInput``,
``python/sglang/srt/managers/scheduler_components/logprob_result_processor.py``,
``python/sglang/srt/managers/tokenizer_manager.py``; docs/remote-engine.md#sglang):

- a request holds ``input_ids`` as a list of token-id lists (a batch: the answer is a JSON
  array, one item per prompt, in order), ``return_logprob: true``, ``logprob_start_len`` per
  prompt and ``sampling_params`` per prompt. ``max_new_tokens: 0`` is allowed
  (``sampling_params.py`` refuses only < 0) and is how SGLang's own ``test_logprob_match``
  scores a sequence;
- an item's ``meta_info.input_token_logprobs`` holds ``[logprob, token_id, text|null]`` rows
  for the prompt's tokens from ``logprob_start_len`` on: the log-prob of each token given
  those before it, the first row's log-prob ``null`` (the logits before the start are not
  computed). So a span ``[a, b)`` is asked with ``logprob_start_len = a - 1``.

Rows are aligned by the token id each carries, never by position alone: SGLang's tests state
two lengths for the same list (``prompt_tokens == logprob_start_len + 1 + len(rows)`` in
``test/srt/test_srt_endpoint.py`` at 2fce449b, ``logprob_start_len + len(rows)`` since), and a
client reported rows missing on radix-cache hits (the scheduler starts the rows at
``max(logprob_start_len, cached prefix)``). The rows are placed where their ids equal the
prompt's (at the start asked, one later, or ending at the prompt's end); placements that
disagree, rows naming other tokens, or rows that do not cover the span fail the prompt
(``PromptFailure``), never a wrong score.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from service.backends.base import (
    GenerateResult,
    Generation,
    PromptFailure,
    ScoreResult,
    SpanRequest,
    checked_span,
)

ROUTE = "/generate"


def score_body(requests: Sequence[SpanRequest]) -> dict[str, Any]:
    """The ``/generate`` body scoring ``requests``' spans: each prompt cut at its span's end,
    its log-probs asked from the token before the span (``logprob_start_len``), which is also
    as far as SGLang may reuse its radix cache for that prompt."""
    return {
        "input_ids": [list(r.token_ids[: r.span_end]) for r in requests],
        "return_logprob": True,
        "logprob_start_len": [r.span_start - 1 for r in requests],
        "sampling_params": [{"max_new_tokens": 0} for _ in requests],
    }


def text_probe_body(text: str) -> dict[str, Any]:
    """The ``/generate`` body scoring ``text`` as the server tokenizes it: its rows name the
    server's token ids, which is how its tokenizer is checked (SGLang's ``text`` prompts are
    encoded with the tokenizer's special tokens, as ``tokenizer.encode`` does by default)."""
    return {
        "text": [text],
        "return_logprob": True,
        "logprob_start_len": [0],
        "sampling_params": [{"max_new_tokens": 0}],
    }


def generate_body(
    prompts: Sequence[Sequence[int]], steps: int, stops: Sequence[int]
) -> dict[str, Any]:
    """The ``/generate`` body for greedy continuations of ``prompts``: at most ``steps``
    tokens each, ending at any of ``stops``; the chosen tokens' log-probs only
    (``logprob_start_len: -1``, which also leaves the radix cache unbounded)."""
    params = {
        "max_new_tokens": steps,
        "temperature": 0.0,
        "stop_token_ids": list(stops),
        "skip_special_tokens": False,
    }
    return {
        "input_ids": [list(p) for p in prompts],
        "return_logprob": True,
        "logprob_start_len": [-1 for _ in prompts],
        "sampling_params": [dict(params) for _ in prompts],
    }


def items(answer: Sequence[Any], count: int) -> list[dict[str, Any]] | None:
    """The answer's items in prompt order, or ``None`` unless there are ``count`` objects,
    each with a ``meta_info`` object."""
    found = [a for a in answer if isinstance(a, dict) and isinstance(a.get("meta_info"), dict)]
    return found if len(found) == count == len(answer) else None


def _row(row: Any) -> tuple[float | None, int] | None:
    """A ``[logprob, token_id, text]`` row as (log-prob or ``None``, token id); ``None`` if
    it is not one."""
    if not isinstance(row, (list, tuple)) or len(row) < 2:
        return None
    value, token = row[0], row[1]
    if not isinstance(token, int) or isinstance(token, bool):
        return None
    if value is None:
        return None, token
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), token
    return None


def row_token_ids(rows: Any) -> list[int] | None:
    """The token ids ``input_token_logprobs`` rows name, in order; ``None`` unless every
    row is a ``[logprob, token_id, text]`` row."""
    if not isinstance(rows, list):
        return None
    cells = [_row(r) for r in rows]
    return [c[1] for c in cells if c is not None] if all(c is not None for c in cells) else None


def placed_rows(token_ids: Sequence[int], start: int, rows: Any) -> dict[int, float | None] | str:
    """Place ``input_token_logprobs`` rows on the prompt's positions by their token ids.

    Args:
        token_ids: the prompt as sent.
        start: the ``logprob_start_len`` asked.
        rows: the item's ``meta_info.input_token_logprobs``.

    Returns:
        Position -> log-prob (``None`` for a row without one), or why the rows cannot be
        placed: not rows, no placement whose ids all agree, or two that do and disagree.
    """
    if not isinstance(rows, list):
        return "engine returned no input_token_logprobs"
    parsed = [_row(r) for r in rows]
    if any(p is None for p in parsed):
        return "an input_token_logprobs row is not [logprob, token_id, text]"
    cells = [p for p in parsed if p is not None]
    n = len(token_ids)
    # As asked; one later (SGLang releases that drop the null first row); ending at the
    # prompt's end (rows cut at the front, as on a cache hit).
    candidates = sorted({start, start + 1, n - len(cells)})
    fits = [
        at
        for at in candidates
        if at >= 0
        and at + len(cells) <= n
        and all(token == token_ids[at + k] for k, (_, token) in enumerate(cells))
    ]
    if not fits:
        wrong = [
            (k, t) for k, (_, t) in enumerate(cells) if start + k >= n or token_ids[start + k] != t
        ]
        detail = f"row {wrong[0][0]} names token {wrong[0][1]}" if wrong else f"{len(cells)} rows"
        return f"engine's log-prob rows do not match the prompt's tokens ({detail})"
    placements = [{at + k: value for k, (value, _) in enumerate(cells)} for at in fits]
    if len(placements) > 1:
        return f"engine's log-prob rows fit the prompt at {len(fits)} places ({fits})"
    return placements[0]


def span_from_item(req: SpanRequest, item: dict[str, Any]) -> ScoreResult:
    """Span log-probs out of one ``/generate`` item scored by ``score_body``, checked.

    Returns:
        ``SpanLogprobs``, or ``PromptFailure`` when the rows cannot be placed by their token
        ids, or do not cover the span, or a value is non-finite or positive.
    """
    tokens = req.token_ids[: req.span_end]
    placed = placed_rows(tokens, req.span_start - 1, item["meta_info"].get("input_token_logprobs"))
    if isinstance(placed, str):
        return PromptFailure(req.request_id, placed)
    values: list[float] = []
    for pos in range(req.span_start, req.span_end):
        value = placed.get(pos)
        if value is None:
            covered = sorted(p for p, v in placed.items() if v is not None)
            have = f"{covered[0]}..{covered[-1]}" if covered else "none"
            return PromptFailure(
                req.request_id,
                f"engine's log-probs do not cover the span {req.span_start}..{req.span_end - 1} "
                f"(position {pos} missing; rows with values: {have})",
            )
        values.append(value)
    return checked_span(req.request_id, values)


def generation_from_item(request_id: str, item: dict[str, Any]) -> GenerateResult:
    """A ``Generation`` out of one ``/generate`` item asked by ``generate_body``.

    Returns:
        ``Generation``, or ``PromptFailure`` on missing ids or log-probs, rows naming other
        tokens than ``output_ids``, a non-finite or positive log-prob, or a finish other than
        ``stop``/``length``.
    """
    meta = item["meta_info"]
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    if reason not in ("stop", "length"):
        return PromptFailure(request_id, f"generation ended with {reason!r}")
    ids = item.get("output_ids")
    rows = meta.get("output_token_logprobs")
    if not isinstance(ids, list) or not isinstance(rows, list) or len(ids) != len(rows):
        return PromptFailure(request_id, "engine returned no output ids or log-probs")
    cells = [_row(r) for r in rows]
    values: list[float] = []
    for k, (cell, token) in enumerate(zip(cells, ids, strict=True)):
        if cell is None or cell[1] != token:
            return PromptFailure(request_id, f"output log-prob row {k} is not for its token")
        values.append(math.nan if cell[0] is None else cell[0])
    checked = checked_span(request_id, values)
    if isinstance(checked, PromptFailure):
        return checked
    return Generation(request_id, tuple(int(t) for t in ids), checked.logprobs, str(reason))
