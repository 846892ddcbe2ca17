"""The one place where domain errors become gRPC status codes.

Messages name the field and say what was expected; no traceback ever reaches a client.
"""

from __future__ import annotations

import grpc
from grpc import aio

from server.validation import InvalidRequest


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, "internal error"


async def abort(context: aio.ServicerContext, exc: BaseException) -> None:  # type: ignore[type-arg]
    """Abort the call with the status mapped from ``exc`` (raises, as ``context.abort`` does)."""
    code, message = status_for(exc)
    await context.abort(code, message)
