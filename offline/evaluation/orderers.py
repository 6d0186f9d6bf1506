"""Where ``eval --generator-url`` takes its orders from: the variants as reorder requests name
them (``targets``), and the two orderers: a running rag-reorder server through its public API
(``ServerOrderer``: the deployment exactly as callers get it) or the in-process pipeline
(``InProcessOrderer``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from offline.evaluation.runner import EvalQuestion
from offline.evaluation.variants import select_variants
from service.backends.engine_client import EngineClient, EngineHTTPError
from service.errors import InvalidRequest
from service.pipeline import DesignSpec, Reorderer, ReorderRequest

DEFAULT = "default"
"""The variant that names no strategy: the server's default (``RAG_REORDER_STRATEGY``)."""
BASELINES = ("retriever", "shuffle")
"""Always evaluated: what the team has today, and no order at all."""


@dataclass(frozen=True)
class Target:
    """One variant as a reorder request names it: the request's fields beyond the passages."""

    label: str
    body: dict[str, Any]


def targets(spec: Sequence[str] | None) -> list[Target]:
    """The variants named (``default`` for the server's default strategy, else the labels
    ``eval --strategies`` takes), then the baselines; default: ``default`` and the baselines.

    Raises:
        InvalidRequest: a name that is no strategy or variant.
    """
    names = [s.strip() for s in (spec or [DEFAULT]) if s.strip()]
    out: list[Target] = []
    for name in [*names, *BASELINES]:
        if name == DEFAULT:
            found = [Target(DEFAULT, {})]
        else:
            found = []
            for v in select_variants([name]):
                body: dict[str, Any] = {"strategy": v.strategy}
                if v.design is not None:
                    body["design"] = {"kind": v.design}
                if v.placement is not None:
                    body["placement"] = v.placement
                found.append(Target(v.label, body))
        out.extend(t for t in found if t.label not in {o.label for o in out})
    return out


@dataclass(frozen=True)
class Ordered:
    """What the orderer made of one (question, variant)."""

    order: list[int]
    strategy: str
    path: str | None
    """``auto``'s path (``profile``, ``flat``, ``moi``, ``explore``); None for other strategies."""
    prompts: int
    """Model calls the order cost (prompts scored and answers generated)."""
    prompt_tokens: int
    seconds: float


class OrderRefused(Exception):
    """The orderer cannot serve this variant for this question (recorded, the run goes on)."""


class Orderer(Protocol):
    """Where orders come from: a rag-reorder server, or the in-process pipeline."""

    @property
    def describe(self) -> str: ...

    async def order(self, q: EvalQuestion, target: Target) -> Ordered: ...

    async def aclose(self) -> None: ...


class ServerOrderer:
    """Orders from a running rag-reorder server (``POST /v1/reorder``), as its callers get them."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        timeout_s: float,
        retries: int,
        concurrency: int,
        transport: Any = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = EngineClient(
            self.base_url,
            api_key=api_key,
            timeout_s=timeout_s,
            max_concurrency=concurrency,
            retries=retries,
            transport=transport,
        )

    @property
    def describe(self) -> str:
        return f"server {self.base_url}"

    async def order(self, q: EvalQuestion, target: Target) -> Ordered:
        passages = []
        for p in q.passages:
            item: dict[str, Any] = {"text": p.text}
            if p.title:
                item["title"] = p.title
            if p.score is not None:
                item["score"] = p.score
            passages.append(item)
        body = {"query": q.question, "passages": passages, **target.body}
        start = time.perf_counter()
        try:
            data = await self._client.post(
                "/v1/reorder", body, request_id=f"eval-{q.id}-{target.label}"
            )
        except EngineHTTPError as exc:
            if exc.status in (401, 403, 404):
                why = "has no /v1/reorder" if exc.status == 404 else "refused the API key"
                raise InvalidRequest(
                    f"the rag-reorder server at {self.base_url} {why} (the key is read from "
                    f"the variable --reorder-key-env names): HTTP {exc.status}: {exc.detail}",
                    param="reorder_url",
                ) from exc
            raise OrderRefused(f"HTTP {exc.status}: {exc.detail}") from exc
        seconds = time.perf_counter() - start
        try:
            usage = data["usage"]
            order = [int(i) for i in data["order"]]
            auto = data.get("auto") or {}
            return Ordered(
                order=order,
                strategy=str(data["strategy"]),
                path=auto.get("path"),
                prompts=int(usage["prompts_scored"]) + int(usage["generations"]),
                prompt_tokens=int(usage["prompt_tokens"]),
                seconds=seconds,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(
                f"{self.base_url}/v1/reorder did not answer a reorder response: {exc!r}",
                param="reorder_url",
            ) from exc

    async def aclose(self) -> None:
        await self._client.aclose()


class InProcessOrderer:
    """Orders from the in-process pipeline (the scorer this command loads). ``default`` is the
    configured strategy; ``auto`` here reads the stored profiles but learns none (learning runs
    in a server, beside its traffic)."""

    def __init__(self, reorderer: Reorderer) -> None:
        self._reorderer = reorderer

    @property
    def describe(self) -> str:
        return f"in-process {self._reorderer.settings.model}"

    async def order(self, q: EvalQuestion, target: Target) -> Ordered:
        from service.errors import ClientError

        body = target.body
        design = body.get("design")
        req = ReorderRequest(
            query=q.question,
            passages=q.passages,
            strategy=body.get("strategy", self._reorderer.settings.strategy),
            design=DesignSpec(kind=design["kind"]) if design else DesignSpec(),
            placement=body.get("placement"),
            request_id=f"eval-{q.id}-{target.label}",
        )
        start = time.perf_counter()
        try:
            result = await self._reorderer.reorder(req)
        except ClientError as exc:
            raise OrderRefused(f"{exc.code}: {exc}") from exc
        return Ordered(
            order=list(result.order),
            strategy=result.strategy,
            path=result.auto.path if result.auto is not None else None,
            prompts=result.usage.prompts_scored + result.usage.generations,
            prompt_tokens=result.usage.prompt_tokens,
            seconds=time.perf_counter() - start,
        )

    async def aclose(self) -> None:
        return None
