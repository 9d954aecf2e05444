"""gRPC adapter for the draft worker: protobuf <-> `ProposeTask`/`Proposal`, nothing else."""

from __future__ import annotations

from draft_service.proposer import ModelProposer, ProposeTask
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdec_core.errors import grpc_errors
from specdec_core.limits import validate_session_id
from specdec_core.serving.server import call_deadline
from specdec_core.serving.wire import model_info_to_proto, sampling_from_proto


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, proposer: ModelProposer, model_name: str):
        self.proposer = proposer
        self.model_info = model_info_to_proto(proposer.caches.backend, model_name)

    @grpc_errors
    def Propose(self, request, context):
        validate_session_id(request.session_id)
        proposal = self.proposer.propose(
            ProposeTask(
                session_id=request.session_id,
                committed_ids=list(request.committed_ids),
                num_tokens=request.num_tokens,
                sampling=sampling_from_proto(request.sampling),
                seed=request.seed,
                min_confidence=request.min_confidence,
            ),
            lambda: not context.is_active(),
            call_deadline(context),
        )
        return draft_pb2.ProposeResponse(
            token_ids=proposal.token_ids,
            distributions=[common_pb2.SparseDistribution(token_ids=i, probs=p) for i, p in proposal.dists],
            prefill_tokens=proposal.prefill_tokens,
            compute_ms=proposal.compute_ms,
            batch_size=proposal.batch_size,
            batch_prefill_tokens=proposal.batch_prefill_tokens,
        )

    @grpc_errors
    def ReleaseDraftCache(self, request, context):
        validate_session_id(request.session_id)
        return draft_pb2.ReleaseDraftCacheResponse(released=self.proposer.caches.release(request.session_id))

    @grpc_errors
    def GetDraftModel(self, request, context):
        return draft_pb2.GetDraftModelResponse(model=self.model_info)
