"""The routes' dependencies: the serving context and the request id, as typed parameters."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from serving.context import AppContext, context_of, request_id_of


# The two dependencies are ``async def`` though they never await: FastAPI runs a plain ``def``
# dependency in its thread pool: two thread hand-offs on every request for a dictionary lookup
# (cProfile of a server on the no-model path: every worker-thread run of a request was one).
async def get_context(request: Request) -> AppContext:
    ctx = context_of(request.scope)
    assert ctx is not None, "create_app sets app.state.ctx"
    return ctx


async def get_request_id(request: Request) -> str:
    rid = request_id_of(request.scope)
    assert rid is not None, "RequestContextMiddleware sets the request id"
    return rid


Ctx = Annotated[AppContext, Depends(get_context)]
RequestId = Annotated[str, Depends(get_request_id)]
