"""gRPC clients for the draft and target workers, behind the `Proposer`/`Verifier` interfaces.

Transient failures (UNAVAILABLE, DEADLINE_EXCEEDED, a worker's cache slot busy) are retried with
exponential backoff for a bounded time; then the call fails with UNAVAILABLE. A worker that
restarts in the meantime simply rebuilds its cache from the committed tokens each request carries.

A worker's RESOURCE_EXHAUSTED ("no room for this session right now", "queue full") is not
"replica down": the target's is retried within the same budget and then answered
RESOURCE_EXHAUSTED; the draft's is not retried at all (the round goes on without a draft).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.loop import NO_DECODE, Decode, Draft, Verdict
from coordinator.request import RequestContext
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec_core.errors import (
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SpecdecError,
    Unavailable,
)
from specdec_core.serving.wire import logprobs_from_proto, sampling_to_proto

log = logging.getLogger(__name__)

_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.FAILED_PRECONDITION})
_MESSAGE_LIMIT = 64 * 1024 * 1024

@dataclass(frozen=True)
class ChannelSettings:
    credentials: grpc.ChannelCredentials | None = None  # None: plaintext
    server_name: str = ""  # the name to check in the worker's certificate, if not the host

    def open(self, address: str) -> grpc.Channel:
        options = [("grpc.max_receive_message_length", _MESSAGE_LIMIT),
                   ("grpc.max_send_message_length", _MESSAGE_LIMIT)]
        if self.credentials is None:
            return grpc.insecure_channel(address, options=options)
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.secure_channel(address, self.credentials, options=options)


class WorkerClient:
    def __init__(self, role: str, address: str, timeout_s: float, retry_budget_s: float,
                 channel: ChannelSettings = ChannelSettings(), retry_exhausted: bool = True):
        self.role = role
        self.address = address
        self.timeout_s = timeout_s
        self.retry_budget_s = retry_budget_s
        self.retry_exhausted = retry_exhausted  # retry RESOURCE_EXHAUSTED within the budget
        self.channel = channel.open(address)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def is_serving(self, timeout_s: float = 1.0) -> bool:
        """Whether the worker's health service says SERVING within timeout_s."""
        try:
            response = self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def call(self, method: Callable, request, ctx: RequestContext | None = None,
             retry_budget_s: float | None = None):
        """method(request) with retries; never past the request's deadline, and cancelled with its
        cancel token (ctx None: a call for no request, such as model info)."""
        budget = self.retry_budget_s if retry_budget_s is None else retry_budget_s
        deadline = time.monotonic() + budget
        delay = 0.05
        token = ctx.cancel if ctx is not None else None
        while True:
            timeout = ctx.timeout(self.timeout_s) if ctx is not None else self.timeout_s
            try:
                if token is None:
                    return method(request, timeout=timeout)
                if token.is_cancelled:
                    raise Cancelled(f"{self.role} call cancelled")
                call = method.future(request, timeout=timeout)
                token.watch(call)
                return call.result()
            except grpc.FutureCancelledError:
                raise Cancelled(f"{self.role} call cancelled") from None
            except grpc.RpcError as err:
                code, details = err.code(), err.details()
                if code == grpc.StatusCode.CANCELLED and token is not None and token.is_cancelled:
                    raise Cancelled(f"{self.role} call cancelled") from None
                exhausted = code == grpc.StatusCode.RESOURCE_EXHAUSTED
                if code not in _RETRYABLE and not (exhausted and self.retry_exhausted):
                    raise _domain_error(self.role, code, details) from err
                if time.monotonic() + delay > deadline:
                    if exhausted:
                        raise ResourceExhausted(f"{self.role} worker at {self.address} busy after {budget:.1f} s "
                                                f"of retries: {details}") from err
                    raise Unavailable(
                        f"{self.role} worker at {self.address} unavailable after {budget:.1f} s of retries: "
                        f"{code.name}: {details}"
                    ) from err
                log.info("%s worker %s: %s, retrying in %.2f s", self.role, self.address, code.name, delay)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def close(self) -> None:
        self.channel.close()


def _domain_error(role: str, code: grpc.StatusCode, details: str) -> SpecdecError:
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(f"{role} worker", details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(f"{role} worker: {details}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return FailedPrecondition(f"{role} worker: {details}")
    if code == grpc.StatusCode.NOT_FOUND:  # the session was ended while this request ran
        return NotFound(f"{role} worker: {details}")
    return SpecdecError(f"{role} worker failed: {code.name}: {details}")


class DraftsInFlight:
    """Calls to draft workers in flight from this coordinator (one counter, given to its draft and
    target clients): the target is told, so that where it shares cores with a draft worker it keeps
    to its share while one drafts."""

    def __init__(self):
        self._count = 0
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        with self._lock:
            self._count += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._count -= 1

    @property
    def busy(self) -> bool:
        return self._count > 0


class DraftClient(WorkerClient):
    def __init__(self, address: str, timeout_s: float = 60.0, retry_budget_s: float = 2.0,
                 channel: ChannelSettings = ChannelSettings(), in_flight: DraftsInFlight | None = None):
        super().__init__("draft", address, timeout_s, retry_budget_s, channel, retry_exhausted=False)
        self.stub = draft_pb2_grpc.DraftStub(self.channel)
        self.in_flight = in_flight or DraftsInFlight()

    def propose(self, ctx: RequestContext, committed_ids: list[int], num_tokens: int) -> Draft:
        with self.in_flight:
            response = self.call(self.stub.Propose, draft_pb2.ProposeRequest(
                session_id=ctx.session_id, committed_ids=committed_ids, num_tokens=num_tokens,
                sampling=sampling_to_proto(ctx.sampling), seed=ctx.seed, min_confidence=ctx.min_draft_confidence,
            ), ctx)
        dists = [(list(d.token_ids), list(d.probs)) for d in response.distributions]
        return Draft(list(response.token_ids), dists, response.compute_ms, response.batch_size,
                     response.batch_prefill_tokens, len(response.token_ids))

    def release(self, session_id: str, deadline: float | None = None) -> None:
        self.call(self.stub.ReleaseDraftCache, draft_pb2.ReleaseDraftCacheRequest(session_id=session_id),
                  RequestContext(session_id, deadline=deadline))

    def model_info(self, retry_budget_s: float | None = None) -> common_pb2.ModelInfo:
        return self.call(self.stub.GetDraftModel, draft_pb2.GetDraftModelRequest(),
                         retry_budget_s=retry_budget_s).model


class TargetClient(WorkerClient):
    def __init__(self, address: str, timeout_s: float = 120.0, retry_budget_s: float = 30.0,
                 channel: ChannelSettings = ChannelSettings(), drafts: DraftsInFlight | None = None):
        super().__init__("target", address, timeout_s, retry_budget_s, channel)
        self.stub = target_pb2_grpc.TargetStub(self.channel)
        self.drafts = drafts or DraftsInFlight()  # the draft clients' counter: told to the target

    def verify(self, ctx: RequestContext, committed_ids: list[int], draft: Draft, decode: Decode = NO_DECODE
               ) -> Verdict:
        response = self.call(self.stub.Verify, target_pb2.VerifyRequest(
            session_id=ctx.session_id, committed_ids=committed_ids, draft_ids=draft.token_ids,
            draft_distributions=[common_pb2.SparseDistribution(token_ids=i, probs=p) for i, p in draft.dists],
            sampling=sampling_to_proto(ctx.sampling), seed=ctx.seed,
            draft_in_flight=draft.drafting_meanwhile or self.drafts.busy,
            decode_steps=decode.steps, stop_token_ids=sorted(decode.stop_ids), head_tokens=decode.head_tokens,
        ), ctx)
        head = None
        if response.head_ids:
            head = Draft(list(response.head_ids), [(list(d.token_ids), list(d.probs)) for d in response.head_distributions],
                         from_worker=False, from_head=True)
        return Verdict(response.num_accepted, response.next_token_id, response.compute_ms, response.batch_size,
                       logprobs_from_proto(response.logprobs), response.batch_tokens, response.threads,
                       response.batch_prefill_tokens, list(response.decoded_ids), max(1, response.passes),
                       response.pass_tokens, head, response.head_ms)

    def release(self, session_id: str, deadline: float | None = None) -> None:
        self.call(self.stub.ReleaseTargetCache, target_pb2.ReleaseTargetCacheRequest(session_id=session_id),
                  RequestContext(session_id, deadline=deadline))

    def model_info(self, retry_budget_s: float | None = None) -> common_pb2.ModelInfo:
        return self.call(self.stub.GetTargetModel, target_pb2.GetTargetModelRequest(),
                         retry_budget_s=retry_budget_s).model
