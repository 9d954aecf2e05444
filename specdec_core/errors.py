"""Domain errors and their gRPC status codes.

Domain code raises these; servicers never build status codes by hand. `grpc_errors` wraps a
handler (unary or server-streaming) and turns them into `context.abort(code, message)`; anything
else becomes INTERNAL with a generic message and a logged traceback.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

log = logging.getLogger(__name__)


class SpecdecError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(SpecdecError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(SpecdecError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(SpecdecError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(SpecdecError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SpecdecError):
    code = grpc.StatusCode.UNAVAILABLE


def _abort(context: grpc.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, SpecdecError):
        context.abort(exc.code, str(exc))
    log.exception("unhandled error in handler")
    context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see server log")


def grpc_errors(handler):
    """Map domain errors raised by a servicer method (unary or server-streaming) to status codes.

    Handlers never call `context.abort` themselves, so every exception seen here is a real error.
    """
    if inspect.isgeneratorfunction(handler):

        @functools.wraps(handler)
        def stream_wrapper(self, request, context):
            try:
                yield from handler(self, request, context)
            except Exception as exc:  # noqa: BLE001 - every error must become a status
                _abort(context, exc)

        return stream_wrapper

    @functools.wraps(handler)
    def unary_wrapper(self, request, context):
        try:
            return handler(self, request, context)
        except Exception as exc:  # noqa: BLE001
            _abort(context, exc)

    return unary_wrapper
