"""``/health`` (liveness), ``/ready`` (readiness) and ``/metrics``.

Liveness and readiness are separate (docs/operations.md): ``/health`` fails only when the engine is
dead or its canary keeps failing (restart me); ``/ready`` also fails while loading, warming up
and draining (send me no traffic). Neither needs the API key.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.dependencies import Ctx
from app.errors import GET_ERRORS, PROBE_ERRORS
from app.schemas.info import ProbeStatus
from serving.admission.errors import Unhealthy

router = APIRouter(tags=["probes"])


@router.get("/health", response_model=ProbeStatus, responses=PROBE_ERRORS, summary="Liveness")
async def health(ctx: Ctx) -> ProbeStatus:
    """200 while the process can serve or is getting there; 503 once the engine is dead."""
    if not ctx.lifecycle.alive:
        raise Unhealthy(f"the scoring engine failed: {ctx.lifecycle.fatal}")
    return ProbeStatus(status="ok")


@router.get("/ready", response_model=ProbeStatus, responses=PROBE_ERRORS, summary="Readiness")
async def ready(ctx: Ctx) -> ProbeStatus:
    """200 once the model has loaded and a warm-up request has scored, until draining."""
    await ctx.check_serving()
    return ProbeStatus(status="ready")


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {"text/plain": {}}, "description": "Prometheus exposition"},
        **GET_ERRORS,
    },
    summary="Prometheus metrics",
)
async def metrics(request: Request, ctx: Ctx) -> Response:
    """Service metrics (`rag_reorder_*`), the engine's own and the process's."""
    body, content_type = ctx.metrics.render(request.headers.get("accept", ""))
    return Response(body, media_type=content_type)
