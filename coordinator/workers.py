"""gRPC clients for the draft and target workers, behind the `Proposer`/`Verifier` interfaces.

Transient failures (UNAVAILABLE, DEADLINE_EXCEEDED, a worker's cache slot busy) are retried with
exponential backoff for a bounded time; then the call fails with UNAVAILABLE. A worker that
restarts in the meantime simply rebuilds its cache from the committed tokens each request carries.

A worker's RESOURCE_EXHAUSTED ("no room for this session right now", "queue full") is not
"replica down": the target's is retried within the same budget and then answered
RESOURCE_EXHAUSTED; the draft's is not retried at all (the round goes on without a draft).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.cancel import call_cancel
from coordinator.loop import NO_DECODE, Decode, Draft, Verdict
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec_core.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SpecdecError,
    Unavailable,
)
from specdec_core.sampling import SamplingConfig
from specdec_core.wire import logprobs_from_proto, sampling_to_proto

log = logging.getLogger(__name__)

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION}
_MESSAGE_LIMIT = 64 * 1024 * 1024

# The deadline (time.monotonic()) of the client request being served, so that worker calls made on
# its behalf never outlive it: the client's deadline propagates to the workers.
request_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("request_deadline", default=None)


def call_timeout(default_s: float) -> float:
    deadline = request_deadline.get()
    if deadline is None:
        return default_s
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded("the request's deadline passed")
    return min(default_s, remaining)


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

    def call(self, method: Callable, request, retry_budget_s: float | None = None):
        budget = self.retry_budget_s if retry_budget_s is None else retry_budget_s
        deadline = time.monotonic() + budget
        delay = 0.05
        token = call_cancel.get()
        while True:
            try:
                if token is None:
                    return method(request, timeout=call_timeout(self.timeout_s))
                if token.is_cancelled:
                    raise Cancelled(f"{self.role} call cancelled")
                call = method.future(request, timeout=call_timeout(self.timeout_s))
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


class _InFlight:
    """Calls to draft workers in flight from this process: the target is told, so that where it shares
    cores with a draft worker it keeps to its share while one drafts."""

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


DRAFTS_IN_FLIGHT = _InFlight()


class DraftClient(WorkerClient):
    def __init__(self, address: str, timeout_s: float = 60.0, retry_budget_s: float = 2.0,
                 channel: ChannelSettings = ChannelSettings()):
        super().__init__("draft", address, timeout_s, retry_budget_s, channel, retry_exhausted=False)
        self.stub = draft_pb2_grpc.DraftStub(self.channel)

    def propose(self, session_id, committed_ids, num_tokens, sampling: SamplingConfig, seed,
                min_confidence: float = 0.0) -> Draft:
        with DRAFTS_IN_FLIGHT:
            response = self.call(self.stub.Propose, draft_pb2.ProposeRequest(
                session_id=session_id, committed_ids=committed_ids, num_tokens=num_tokens,
                sampling=sampling_to_proto(sampling), seed=seed, min_confidence=min_confidence,
            ))
        dists = [(list(d.token_ids), list(d.probs)) for d in response.distributions]
        return Draft(list(response.token_ids), dists, response.compute_ms, response.batch_size,
                     response.batch_prefill_tokens, len(response.token_ids))

    def release(self, session_id: str) -> None:
        self.call(self.stub.ReleaseDraftCache, draft_pb2.ReleaseDraftCacheRequest(session_id=session_id))

    def model_info(self, retry_budget_s: float | None = None) -> common_pb2.ModelInfo:
        return self.call(self.stub.GetDraftModel, draft_pb2.GetDraftModelRequest(), retry_budget_s).model


class TargetClient(WorkerClient):
    def __init__(self, address: str, timeout_s: float = 120.0, retry_budget_s: float = 30.0,
                 channel: ChannelSettings = ChannelSettings()):
        super().__init__("target", address, timeout_s, retry_budget_s, channel)
        self.stub = target_pb2_grpc.TargetStub(self.channel)

    def verify(self, session_id, committed_ids, draft: Draft, sampling: SamplingConfig, seed,
               decode: Decode = NO_DECODE) -> Verdict:
        response = self.call(self.stub.Verify, target_pb2.VerifyRequest(
            session_id=session_id, committed_ids=committed_ids, draft_ids=draft.token_ids,
            draft_distributions=[common_pb2.SparseDistribution(token_ids=i, probs=p) for i, p in draft.dists],
            sampling=sampling_to_proto(sampling), seed=seed,
            draft_in_flight=draft.drafting_meanwhile or DRAFTS_IN_FLIGHT.busy,
            decode_steps=decode.steps, stop_token_ids=sorted(decode.stop_ids),
        ))
        return Verdict(response.num_accepted, response.next_token_id, response.compute_ms, response.batch_size,
                       logprobs_from_proto(response.logprobs), response.batch_tokens, response.threads,
                       response.batch_prefill_tokens, list(response.decoded_ids), max(1, response.passes),
                       response.pass_tokens)

    def release(self, session_id: str) -> None:
        self.call(self.stub.ReleaseTargetCache, target_pb2.ReleaseTargetCacheRequest(session_id=session_id))

    def model_info(self, retry_budget_s: float | None = None) -> common_pb2.ModelInfo:
        return self.call(self.stub.GetTargetModel, target_pb2.GetTargetModelRequest(), retry_budget_s).model
