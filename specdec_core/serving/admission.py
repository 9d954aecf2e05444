"""Bounded concurrency for a gRPC server: every call that can hold a handler thread is admitted
into a lane of fixed size, and beyond it answered RESOURCE_EXHAUSTED at once; the thread pool is
sized to the lanes plus threads kept for health checks, so nothing ever waits in the pool's
invisible queue and a health Check always finds a thread.

Lanes of every server:
- `work`: the service's heavy calls (Generate/GenerateStream, Verify, Propose), sized by the
  service (--max-concurrent-requests, --max-queue);
- `streams`: long-lived streams anyone may open without a token (health Watch, reflection), a few
  at once, so that they cannot take the handler threads;
- `control`: everything else but health Check (session lookups, cache releases, model info);
- health Check is not limited: it answers from memory in microseconds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc

from specdec_core import metrics

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
LONG_LIVED = frozenset({
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
})
STREAMS_LIMIT = 4
CONTROL_LIMIT = 8
HEALTH_THREADS = 4  # kept free for health Check


@dataclass(frozen=True)
class Lanes:
    """How many calls each lane admits at once; `work_methods` are full method names
    ("/specdec.v1.Target/Verify")."""

    work_methods: frozenset[str]
    work: int
    streams: int = STREAMS_LIMIT
    control: int = CONTROL_LIMIT

    def __post_init__(self):
        if min(self.work, self.streams, self.control) < 1:
            raise ValueError(f"every lane needs room for at least one call: {self}")

    @property
    def threads(self) -> int:
        """Handler threads that serve every admitted call at once and still answer health checks."""
        return self.work + self.streams + self.control + HEALTH_THREADS

    def lane(self, method: str) -> tuple[str, int] | None:
        if method == HEALTH_CHECK:
            return None
        if method in self.work_methods:
            return "work", self.work
        if method in LONG_LIVED:
            return "streams", self.streams
        return "control", self.control


class AdmissionInterceptor(grpc.ServerInterceptor):
    def __init__(self, lanes: Lanes):
        self.lanes = lanes
        self._slots = {name: threading.BoundedSemaphore(limit)
                       for name, limit in (("work", lanes.work), ("streams", lanes.streams), ("control", lanes.control))}

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        lane = self.lanes.lane(details.method)
        if handler is None or lane is None:
            return handler
        return _admitted(handler, lane[0], lane[1], self._slots[lane[0]])


def _admitted(handler, lane: str, limit: int, slots: threading.BoundedSemaphore):
    """The handler with its behaviour run only while holding a slot of the lane (taken when the
    call starts on a handler thread, given back when it ends however it ends)."""
    message = f"server busy: all {limit} {lane} slots are in use; retry with backoff"

    def refuse(context):
        metrics.ADMISSION_REFUSED.labels(lane).inc()
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    def unary(behavior):
        def run(request, context):
            if not slots.acquire(blocking=False):
                refuse(context)
            try:
                return behavior(request, context)
            finally:
                slots.release()
        return run

    def streaming(behavior):
        def run(request, context):
            if not slots.acquire(blocking=False):
                refuse(context)
            try:
                yield from behavior(request, context)
            finally:
                slots.release()
        return run

    kinds = {
        (False, False): ("unary_unary", unary, grpc.unary_unary_rpc_method_handler),
        (False, True): ("unary_stream", streaming, grpc.unary_stream_rpc_method_handler),
        (True, False): ("stream_unary", unary, grpc.stream_unary_rpc_method_handler),
        (True, True): ("stream_stream", streaming, grpc.stream_stream_rpc_method_handler),
    }
    attribute, wrap, make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(wrap(getattr(handler, attribute)), handler.request_deserializer, handler.response_serializer)
