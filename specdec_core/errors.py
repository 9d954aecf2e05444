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

from specdec_core import metrics

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


class DeadlineExceeded(SpecdecError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(SpecdecError):
    code = grpc.StatusCode.CANCELLED


class Aborted(SpecdecError):
    """A concurrency conflict (another writer won a race): retrying the whole request is safe."""

    code = grpc.StatusCode.ABORTED


class Unauthenticated(SpecdecError):
    code = grpc.StatusCode.UNAUTHENTICATED


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    code = exc.code if isinstance(exc, SpecdecError) else grpc.StatusCode.INTERNAL
    metrics.REQUESTS.labels(method, code.name).inc()
    if isinstance(exc, SpecdecError):
        context.abort(code, str(exc))
    log.exception("unhandled error in %s", method)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see server log")


def grpc_errors(handler):
    """Map domain errors raised by a servicer method (unary or server-streaming) to status codes,
    and count every call by method and status.

    Handlers never call `context.abort` themselves, so every exception seen here is a real error.
    """
    method = handler.__name__
    in_flight = metrics.IN_FLIGHT.labels(method)
    if inspect.isgeneratorfunction(handler):

        @functools.wraps(handler)
        def stream_wrapper(self, request, context):
            in_flight.inc()
            try:
                yield from handler(self, request, context)
                metrics.REQUESTS.labels(method, "OK").inc()
            except GeneratorExit:  # the client went away; the stream is closed under us
                metrics.REQUESTS.labels(method, "CANCELLED").inc()
                raise
            except Exception as exc:  # noqa: BLE001 - every error must become a status
                _abort(context, exc, method)
            finally:
                in_flight.dec()

        return stream_wrapper

    @functools.wraps(handler)
    def unary_wrapper(self, request, context):
        in_flight.inc()
        try:
            response = handler(self, request, context)
            metrics.REQUESTS.labels(method, "OK").inc()
            return response
        except Exception as exc:  # noqa: BLE001
            _abort(context, exc, method)
        finally:
            in_flight.dec()

    return unary_wrapper
