"""The shared backend as admission lets one request, or the service's own work, use it.

``AdmittedBackend`` (one per request): checks the request's size limits before the engine
sees anything (characters rendered into prompts, distinct prompts, prompts x tokens: 422),
admits its work through ``Admission`` (its whole estimate, or each call), and sends a long
call in parts, stopping it early once its own pace shows it would miss its deadline.
``MeteredBackend`` (the service's own work: the rate canary, ``auto``'s background runs): no
admission and no request limits, but every call timed into the engine's meter.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeVar

from service.backends.base import (
    ChatMessage,
    Encoding,
    GenerateResult,
    GenerationRequest,
    LogprobBackend,
    PromptTokenizer,
    ScoreResult,
    SpanRequest,
    generation_tokens,
    prompt_tokens,
)
from service.config.settings import Settings
from service.errors import DeadlineUnreachable, LimitExceeded
from service.strategies.request import Estimate
from serving.admission.control import Admission, Reservation
from serving.admission.deadline import Deadline
from serving.admission.errors import Overloaded

_PART_SHARE = 0.2
"""A call of an admitted request estimated over this share of its deadline is sent in parts
of about this share each, its progress checked between them (``AdmittedBackend._in_parts``):
four checks for a request that fills its deadline; on a GPU, where a request takes a fraction
of a second, no call is split."""


_R = TypeVar("_R")
_T = TypeVar("_T")


class MeteredBackend:
    """The shared backend as the service's own work sees it (the rate canary, ``auto``'s
    background runs): no admission, no request limits, but every call timed into the meter
    (``Admission.measured``), so what the service learns about itself also re-measures the
    engine's rate."""

    def __init__(self, inner: LogprobBackend, admission: Admission) -> None:
        self._inner = inner
        self._admission = admission

    @property
    def model_id(self) -> str:
        return self._inner.model_id

    @property
    def max_model_len(self) -> int:
        return self._inner.max_model_len

    @property
    def tokenizer(self) -> PromptTokenizer:
        return self._inner.tokenizer

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        with self._admission.measured(prompt_tokens(requests)):
            return await self._inner.score(requests)

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        prefilled, budget = generation_tokens(requests)
        with self._admission.measured(prefilled + budget, new_tokens=budget):
            return await self._inner.generate(requests)

    async def aclose(self) -> None:
        """Nothing: the lifespan owns and closes the shared backend."""


class AdmittedBackend:
    """The process's backend as one request sees it: its limits checked, its tokens admitted.

    Built per request (cheap); closing it does not close the shared backend.
    """

    def __init__(
        self,
        inner: LogprobBackend,
        admission: Admission,
        settings: Settings,
        *,
        deadline: Deadline | None = None,
    ) -> None:
        """Args:
        inner: the shared backend.
        admission: the service's admission.
        settings: the limits.
        deadline: the request's (admission refuses work that would not finish by then);
            ``None``: not checked.
        """
        self._inner = inner
        self._admission = admission
        self._settings = settings
        self._deadline = deadline
        self._reservation: Reservation | None = None
        self.estimated_s: float | None = None
        """The request's estimate when it was admitted as a whole (``None``: not, or no
        rate), kept after it is released: a 504's message gives it."""
        self._sent_tokens = 0  # prompt tokens this request sent so far, scored or generated
        self._tokenizer: _ChargedTokenizer | None = None

    @property
    def model_id(self) -> str:
        return self._inner.model_id

    @property
    def max_model_len(self) -> int:
        return self._inner.max_model_len

    @property
    def tokenizer(self) -> PromptTokenizer:
        """The backend's tokenizer, charging what this request renders into prompts to its
        ``max_prompt_chars_x_prompts`` before each prompt is rendered (422 over it)."""
        if self._tokenizer is None:
            self._tokenizer = _ChargedTokenizer(
                self._inner.tokenizer, self._settings.max_prompt_chars_x_prompts
            )
        return self._tokenizer

    def admit(self, estimate: Estimate) -> float | None:
        """Admit the request's whole estimated work (``Admission.reserve``); its calls then
        draw on the reservation. Returns its estimated seconds on an idle engine.

        Raises:
            DeadlineUnreachable, Overloaded: as ``Admission.reserve``.
        """
        self.release()
        self._reservation = self._admission.reserve(estimate, self._deadline)
        self.estimated_s = self._reservation.estimated_s
        return self.estimated_s

    def estimate_s(self, estimate: Estimate) -> float | None:
        """``Admission.estimate_s``: when the work would be done if admitted now."""
        return self._admission.estimate_s(estimate)

    def release(self) -> None:
        """Give back what the request's calls did not take (when it ends, however)."""
        if self._reservation is not None:
            self._admission.release(self._reservation)
            self._reservation = None

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        """Check the request's limits (422), admit its tokens (503), then score (in parts,
        ``_in_parts``, when the request is long).

        Raises:
            LimitExceeded: too many distinct prompts, or prompts x tokens over the limit.
            Overloaded: the in-flight token budget is full, the call would not finish
                before the request's deadline, or its first parts show it will not.
        """
        n = len(requests)
        max_prompts = self._settings.max_prompts_per_request
        if n > max_prompts:
            raise LimitExceeded(
                "design.num_prompts", max_prompts, n, what="distinct prompts to score"
            )
        tokens = prompt_tokens(requests)
        self._count_prompt_tokens(tokens, n)

        async def part(reqs: Sequence[SpanRequest]) -> list[ScoreResult]:
            with self._admission.tokens(
                prompt_tokens(reqs),
                self._deadline,
                reservation=self._reservation,
            ):
                return await self._inner.score(reqs)

        return await self._in_parts(requests, [len(r.token_ids) for r in requests], None, part)

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        """Check the request's prompts x tokens limit (422), admit the prompts' tokens plus
        their answer budgets (503), then generate (in parts, ``_in_parts``, when the request
        is long). A prompt's score ids are prefilled with it, so they count as its tokens.

        Raises:
            LimitExceeded: prompts x tokens over the limit.
            Overloaded: the in-flight token budget is full, or the first parts of a long
                request show it will not finish before its deadline.
        """
        prefilled, _ = generation_tokens(requests)
        self._count_prompt_tokens(prefilled, len(requests))

        async def part(reqs: Sequence[GenerationRequest]) -> list[GenerateResult]:
            tokens, budget = generation_tokens(reqs)
            with self._admission.tokens(
                tokens + budget,
                self._deadline,
                new_tokens=budget,
                reservation=self._reservation,
            ):
                return await self._inner.generate(reqs)

        return await self._in_parts(
            requests,
            [len(r.token_ids) + len(r.score_ids) for r in requests],
            [r.max_new_tokens for r in requests],
            part,
        )

    async def _in_parts(
        self,
        requests: Sequence[_R],
        tokens: Sequence[int],
        new_tokens: Sequence[int] | None,
        call: Callable[[Sequence[_R]], Awaitable[list[_T]]],
    ) -> list[_T]:
        """Send a call of a request admitted as a whole in parts of about ``_PART_SHARE`` of
        its deadline each, at the measured rates, and stop it early once its own parts show
        it would end after its deadline (issue 77): a rate measured quiet, then a busy
        neighbour, admitted work that then ran into a 504 after burning the whole deadline.
        One part (the call as it is) for a request not admitted as a whole, one estimated
        within a part, or without a deadline or a rate: a GPU's calls are never split.

        Raises:
            Overloaded: the parts so far ran slower than estimated by so much that the rest,
                at that pace, would end after the request's deadline.
        """
        parts = self._parts(tokens, new_tokens)
        if len(parts) == 1:
            return await call(requests)
        meter = self._admission.meter
        estimates = [
            meter.seconds_for(sum(tokens[p]), sum(new_tokens[p]) if new_tokens else 0) or 0.0
            for p in parts
        ]
        out: list[_T] = []
        spent_s = 0.0
        for k, p in enumerate(parts):
            if k:
                self._check_progress(k, len(parts), spent_s, sum(estimates[:k]), estimates[k:])
            t0 = time.monotonic()
            out.extend(await call(requests[p]))
            spent_s += time.monotonic() - t0
        return out

    def _parts(self, tokens: Sequence[int], new_tokens: Sequence[int] | None) -> list[slice]:
        """Contiguous parts of a call of about ``_PART_SHARE`` of the deadline each, at the
        measured rates (the package docstring, 6); ``[everything]`` where it is not split."""
        whole = [slice(0, len(tokens))]
        if self._reservation is None or self._deadline is None or len(tokens) < 2:
            return whole
        budget = sum(new_tokens) if new_tokens else 0
        total_s = self._admission.meter.seconds_for(sum(tokens), budget)
        part_s = _PART_SHARE * self._deadline.length_s
        if total_s is None or total_s <= part_s:
            return whole
        n = min(len(tokens), math.ceil(total_s / part_s))
        # Cut where the running estimate passes each n-th of the whole: parts of about equal
        # seconds.
        meter = self._admission.meter
        budgets = new_tokens or [0] * len(tokens)
        seconds = [meter.seconds_for(t, b) or 0.0 for t, b in zip(tokens, budgets, strict=True)]
        cuts = [0]
        run = 0.0
        for i, sec in enumerate(seconds[:-1]):
            run += sec
            if run >= total_s * len(cuts) / n:
                cuts.append(i + 1)
        cuts.append(len(tokens))
        return [slice(a, b) for a, b in itertools.pairwise(cuts) if b > a]

    def _check_progress(
        self, done: int, parts: int, spent_s: float, estimated_s: float, rest: Sequence[float]
    ) -> None:
        """``Overloaded`` if the rest of a call, at the pace its first ``done`` parts ran
        (``spent_s`` against ``estimated_s``), would end after the request's deadline."""
        deadline = self._deadline
        assert deadline is not None
        if estimated_s <= 0:
            return
        pace = spent_s / estimated_s
        rest_s = pace * sum(rest)
        left_s = deadline.left_s(time.monotonic())
        if rest_s <= left_s:
            return
        self._admission.progress_refused()
        reservation = self._reservation
        if reservation is not None and reservation.doubted:
            # Admitted over its deadline on a rate in doubt, on an idle engine, to re-measure
            # it: its own parts are that re-measurement, and they say it cannot finish. A 503
            # to retry was refused at once the next time (issue 90: self_consistency on a
            # fresh server, after 26 s of work), so this is the answer for good.
            meter = self._admission.meter
            now = time.monotonic()
            why = meter.unconfirmed_because(now)
            total_s = spent_s + rest_s
            raise DeadlineUnreachable(
                reservation.param,
                round(deadline.length_s, 3),
                round(total_s, 3),
                f"this request was admitted on an idle engine to re-measure its rate (it was "
                f"estimated over its deadline on a rate not yet confirmed); the first {done} "
                f"of {parts} parts of its model calls took {spent_s:.1f} s against "
                f"{estimated_s:.1f} s estimated ({pace:.1f}x), so all of them would take about "
                f"{total_s:.0f} s, past its deadline ({deadline.named}, "
                f"{max(left_s, 0):.0f} s left); the rate is now "
                + ("confirmed" if why is None else f"not confirmed ({why})")
                + f" at {meter.tokens_per_s or 0:.0f} prompt tokens/s: send fewer passages, "
                f"prompts or samples ({reservation.param}), or raise {deadline.setting}",
            )
        wait_s = self._admission.estimated_wait_s or 0.0
        raise Overloaded(
            f"stopped early: the first {done} of {parts} parts of this request's model calls "
            f"took {spent_s:.1f} s against {estimated_s:.1f} s estimated ({pace:.1f}x: the "
            f"engine is slower than when its rate was measured), and the other {parts - done} "
            f"would take about {rest_s:.0f} s more, past its deadline ({max(left_s, 0):.0f} s "
            f"left); the engine's rates are re-measured from these parts",
            retry_after_s=max(1, math.ceil(wait_s)),
        )

    def _count_prompt_tokens(self, tokens: int, n: int) -> None:
        """Add a call's prompt tokens to the request's total; 422 over the limit.

        The limit is per request, not per call: generating prompts (lore, self_consistency)
        prefill like scored ones, and a strategy with several model calls must not get the
        limit once per call.
        """
        total = self._sent_tokens + tokens
        max_tokens = self._settings.max_prompt_tokens_x_prompts
        if total > max_tokens:
            raise LimitExceeded(
                "prompt_tokens_x_prompts",
                max_tokens,
                total,
                what=f"summed over the request's prompts ({n} in this call); send fewer or "
                "shorter passages or fewer prompts",
            )
        self._sent_tokens = total

    async def aclose(self) -> None:
        """Release the request's reservation; the lifespan owns and closes the shared
        backend."""
        self.release()


class _ChargedTokenizer:
    """A backend's tokenizer as one request sees it: the characters of each prompt it is asked
    to render are added to the request's total, and a total over ``limit`` is refused
    (``LimitExceeded``, 422) before that prompt is rendered or anything is tokenised.

    Characters, not tokens: tokens exist only after tokenising, which is what costs the memory
    (about 300 bytes a token while a batch is encoded, up to 3 tokens a character), so the
    prompts x tokens check comes too late to bound it. Prompt building runs in worker
    threads, hence the lock.
    """

    def __init__(self, inner: PromptTokenizer, limit: int) -> None:
        self._inner = inner
        self._limit = limit
        self._chars = 0
        self._lock = threading.Lock()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._inner.eos_token_ids

    @property
    def line_break_ids(self) -> frozenset[int]:
        return self._inner.line_break_ids

    def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        self._charge(sum(len(m.content) for m in messages))
        return self._inner.render_chat(messages, add_generation_prompt=add_generation_prompt)

    def render_completion(self, text: str) -> str:
        self._charge(len(text))
        return self._inner.render_completion(text)

    def encode(self, text: str) -> Encoding:
        return self._inner.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[Encoding]:
        return self._inner.encode_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        return self._inner.decode(ids)

    def _charge(self, chars: int) -> None:
        with self._lock:
            total = self._chars + chars
            if total > self._limit:
                raise LimitExceeded(
                    "prompt_chars_x_prompts",
                    self._limit,
                    total,
                    what=_CHARS_WHAT,
                )
            self._chars = total


_CHARS_WHAT: Final = (
    "characters of passages, titles, query and template text summed over the request's "
    "prompts so far; send fewer or shorter passages or fewer prompts"
)
