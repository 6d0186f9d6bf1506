"""``PacedBackend``: a benchmark engine that takes the time a GPU would and no CPU (issue 57).

Device time comes rarely (15 minutes a session when a GPU is lent at all), so the service's
own work at GPU speed (tokenising, building, solving, confidences, JSON) could not be measured
or improved where it matters. This backend answers every forward after the seconds a measured
GPU engine took for that work, sleeping on the event loop (no thread, no CPU), with
deterministic log-probs. Everything else is real: the configured model's own tokenizer (loaded
from its folder, no weights), the same ``ForwardScheduler`` as the transformers backend, so
admission, packing and deadlines see GPU-speed forwards.

**For benchmarks only.** Its scores are not a model's: ``backend=paced`` must be named
explicitly (``auto`` never picks it), its ``model_id`` starts with ``paced/`` and the app logs
a warning at start. The log-probs are a hash of each prompt's tokens (every prompt its own
numbers, the same prompt always the same), so the solver has real work and no signal.

The cost model (``PacedProfile``): one forward of ``rows`` prompts takes
``overhead_s + tokens / tokens_per_s`` seconds, ``tokens`` padded (rows x longest) where the
engine pads (transformers) and summed where it does not (vLLM). Each profile's figures and the
files they come from are in ``PROFILES``; ``python -m bench.paced_fit`` recomputes them from the
committed GPU results and prints the model's error on each measured query.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import numpy as np

from service.backends.base import (
    GenerateResult,
    Generation,
    GenerationRequest,
    PromptTokenizer,
    ScoreResult,
    SpanLogprobs,
    SpanRequest,
    check_generations,
    check_scoring,
)
from service.backends.scheduling.scheduler import ForwardScheduler
from service.config.settings import Settings
from service.errors import BackendUnavailable


@dataclass(frozen=True, slots=True)
class PacedProfile:
    """A measured engine's forward cost: ``overhead_s + tokens / tokens_per_s`` seconds."""

    name: str
    tokens_per_s: float
    overhead_s: float
    padded: bool
    """Tokens counted as rows x longest prompt (transformers pads) or summed (vLLM)."""
    decode_step_s: float
    """Seconds per greedy decode step of a generation batch."""
    source: str
    """Where the figures come from (committed under ``results/bench/``)."""

    def forward_s(self, lengths: Sequence[int]) -> float:
        """Seconds one forward of prompts of these lengths takes on the profiled engine."""
        if not lengths:
            return 0.0
        tokens = len(lengths) * max(lengths) if self.padded else sum(lengths)
        return self.overhead_s + tokens / self.tokens_per_s


# `python -m bench.paced_fit` prints these from the files named in `source`. The generation
# step is the H100's float32 lockstep figure (results/bench/generation_cuda_float32.json: 32
# answers of up to 32 tokens in 1.94 s, about 60 ms a step with its prefill): the only
# generation timing measured on a GPU; scoring, not generation, is what these benchmarks load.
_DECODE_STEP_S = 0.06
PROFILES: dict[str, PacedProfile] = {
    profile.name: profile
    for profile in (
        PacedProfile(
            "h200-transformers-bf16",
            tokens_per_s=341_921.0,
            overhead_s=0.0,
            padded=False,
            decode_step_s=_DECODE_STEP_S,
            source="results/bench/gpu_h200_20261127_2/scoring_transformers.json (engine alone, "
            "8 queries of 20 prompts one call each: 119,510 tokens in 0.350 s)",
        ),
        PacedProfile(
            "h100-transformers-bf16",
            tokens_per_s=354_405.0,
            overhead_s=0.0069,
            padded=False,
            decode_step_s=_DECODE_STEP_S,
            source="results/bench/gpu_h100_20261127/load_transformers.json ceiling (160 prompts, "
            "120,130 tokens in 0.339 s); overhead: scoring_transformers.json's per-query median",
        ),
        PacedProfile(
            "h100-vllm-16384",
            tokens_per_s=300_209.0,
            overhead_s=0.0739,
            padded=False,
            decode_step_s=_DECODE_STEP_S,
            source="results/bench/gpu_h100_20261127/load_vllm_16384.json ceiling (120,130 tokens "
            "in 0.400 s); overhead: scoring_vllm.json's per-query median",
        ),
        PacedProfile(
            "h100-transformers-float32",
            tokens_per_s=83_537.0,
            overhead_s=0.0,
            padded=False,
            decode_step_s=_DECODE_STEP_S,
            source="results/bench/scoring_cuda_float32.json (engine alone, 6 queries of 20 "
            "prompts, 92,180 tokens in 1.103 s)",
        ),
    )
}
DEFAULT_PROFILE = "h200-transformers-bf16"
_ROW_BUDGET = 1 << 30  # the profiles' engines bound a forward by tokens, not LM-head rows


class PacedBackend:
    """Deterministic log-probs after a profiled GPU's forward time (see the module docstring)."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        profile: PacedProfile,
        *,
        model: str,
        max_model_len: int,
        vocab_size: int,
        batch_token_budget: int,
    ) -> None:
        self._tokenizer = tokenizer
        self.profile = profile
        self._model_id = f"paced/{profile.name}/{model}"
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size
        self._lock = anyio.Lock()
        self._closed = False
        self.busy_s = 0.0
        """Seconds of modelled engine time so far (the engine-alone figure of a benchmark)."""
        self._scheduler = ForwardScheduler(
            self._run_score_batch,
            token_budget=batch_token_budget,
            row_budget=_ROW_BUDGET,
            head_mode="mask",
            engine_lock=self._lock,
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> PacedBackend:
        """The configured model's tokenizer (no weights) behind ``settings.paced_profile``.

        Raises:
            BackendUnavailable: the tokenizer cannot be loaded.
        """
        from service.backends.tokenizers.tokenizer_files import load_prompt_tokenizer
        from service.model_assets import resolve_model

        tokenizer = load_prompt_tokenizer(resolve_model(settings), name=settings.model)
        return cls(
            tokenizer,
            PROFILES[settings.paced_profile],
            model=settings.model,
            max_model_len=settings.max_model_len or 8192,
            vocab_size=len(tokenizer.hf_tokenizer),
            # The transformers backend's CUDA default: the profiles were measured on GPUs.
            batch_token_budget=settings.batch_token_budget or 16384,
        )

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def tokenizer(self) -> PromptTokenizer:
        return self._tokenizer

    @property
    def scheduler(self) -> ForwardScheduler:
        return self._scheduler

    async def score(self, requests: Sequence[SpanRequest]) -> list[ScoreResult]:
        """Deterministic span log-probs, each after its share of a paced forward.

        Raises:
            InvalidRequest: a span out of range or a token id outside the vocabulary.
            LimitExceeded: a prompt longer than ``max_model_len``.
            BackendUnavailable: the backend is closed.
        """
        self._require_open()
        check_scoring(requests, limit=self._max_model_len, vocab_size=self._vocab_size)
        return await self._scheduler.score(list(requests))

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        """Each prompt's answer: its own last tokens before the template's turn end, up to
        ``max_new_tokens``, after a prefill and that many decode steps of paced time.

        Raises:
            InvalidRequest, LimitExceeded, BackendUnavailable: as ``score``.
        """
        self._require_open()
        reqs = list(requests)
        check_generations(
            reqs,
            limit=self._max_model_len - 1,
            scored_limit=self._max_model_len,
            vocab_size=self._vocab_size,
        )
        if not reqs:
            return []
        steps = max(min(r.max_new_tokens, 4) for r in reqs)
        async with self._lock:
            seconds = self.profile.forward_s([len(r.token_ids) for r in reqs])
            seconds += steps * self.profile.decode_step_s
            self.busy_s += seconds
            await asyncio.sleep(seconds)
        eos = min(self._tokenizer.eos_token_ids, default=0)
        out: list[GenerateResult] = []
        for req in reqs:
            ids = tuple(req.token_ids[-min(req.max_new_tokens, 4) :])
            if len(ids) < req.max_new_tokens:
                ids = (*ids[: req.max_new_tokens - 1], eos)
            values = _values(req.token_ids, len(ids))
            score = (
                _values((*req.token_ids, *req.score_ids), len(req.score_ids))
                if req.score_ids
                else None
            )
            reason = "stop" if ids and ids[-1] == eos else "length"
            out.append(Generation(req.request_id, ids, values, reason, score))
        return out

    async def aclose(self) -> None:
        async with self._lock:
            self._closed = True

    async def _run_score_batch(self, batch: list[SpanRequest]) -> list[ScoreResult]:
        # The scheduler holds the engine lock for the forward: one at a time, as on the GPU.
        seconds = self.profile.forward_s([len(r.token_ids) for r in batch])
        self.busy_s += seconds
        await asyncio.sleep(seconds)
        return [
            SpanLogprobs(
                r.request_id, _values(r.token_ids[: r.span_end], r.span_end - r.span_start)
            )
            for r in batch
        ]

    def _require_open(self) -> None:
        if self._closed:
            raise BackendUnavailable("the paced backend is closed")


# Log-probs in [-4, -0.05]; a prompt's values are a slice of this table at an offset hashed from
# its tokens: the engine's stand-in must cost next to nothing of the service's CPU (a generator
# seeded per prompt took 11% of it, issue 57).
_TABLE = -np.random.default_rng(0).uniform(0.05, 4.0, size=1 << 16)


def _values(token_ids: Sequence[int], count: int) -> tuple[float, ...]:
    """``count`` log-probs, a function of the whole prefix: the same prompt the same numbers,
    another order of the same passages others."""
    seed = zlib.crc32(np.asarray(token_ids, dtype=np.int32).tobytes())
    start = seed % (_TABLE.size - count) if count < _TABLE.size else 0
    return tuple(_TABLE[start : start + count].tolist())
