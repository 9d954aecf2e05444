"""gRPC adapter for the target worker: protobuf <-> `VerifyTask`/`VerifyResult`, nothing else."""

from __future__ import annotations

from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec_core.errors import grpc_errors
from specdec_core.limits import validate_session_id
from specdec_core.serving.server import call_deadline
from specdec_core.serving.wire import logprobs_to_proto, model_info_to_proto, sampling_from_proto
from target_service.verifier import BatchVerifier, VerifyTask


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, verifier: BatchVerifier, model_name: str, tensor_parallel_size: int = 1, head: str | None = None):
        self.verifier = verifier
        self.model_info = model_info_to_proto(verifier.caches.backend, model_name, tensor_parallel_size)
        if verifier.head is not None:
            self.model_info.head = head or ""
            self.model_info.head_parameters = verifier.head.head.num_parameters

    @grpc_errors
    def Verify(self, request, context):
        validate_session_id(request.session_id)
        result = self.verifier.verify(
            VerifyTask(
                session_id=request.session_id,
                committed_ids=list(request.committed_ids),
                draft_ids=list(request.draft_ids),
                sampling=sampling_from_proto(request.sampling),
                seed=request.seed,
                draft_dists=[(list(d.token_ids), list(d.probs)) for d in request.draft_distributions],
                draft_in_flight=request.draft_in_flight,
                decode_steps=request.decode_steps,
                stop_ids=frozenset(request.stop_token_ids),
                head_tokens=request.head_tokens,
            ),
            lambda: not context.is_active(),
            call_deadline(context),
        )
        return target_pb2.VerifyResponse(
            num_accepted=result.num_accepted,
            next_token_id=result.next_token_id,
            prefill_tokens=result.prefill_tokens,
            compute_ms=result.compute_ms,
            batch_size=result.batch_size,
            logprobs=logprobs_to_proto(result.logprobs),
            batch_tokens=result.batch_tokens,
            threads=result.threads,
            batch_prefill_tokens=result.batch_prefill_tokens,
            decoded_ids=result.decoded_ids,
            passes=result.passes,
            pass_tokens=result.pass_tokens,
            head_ids=result.head_ids,
            head_distributions=[common_pb2.SparseDistribution(token_ids=ids, probs=probs)
                                for ids, probs in result.head_dists],
            head_ms=result.head_ms,
        )

    @grpc_errors
    def ReleaseTargetCache(self, request, context):
        validate_session_id(request.session_id)
        return target_pb2.ReleaseTargetCacheResponse(released=self.verifier.caches.release(request.session_id))

    @grpc_errors
    def GetTargetModel(self, request, context):
        return target_pb2.GetTargetModelResponse(model=self.model_info)
