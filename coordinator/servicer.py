"""gRPC adapter for the public Generation API: protobuf <-> domain, nothing else."""

from __future__ import annotations

import time
from types import MappingProxyType

from coordinator.generation import Generation
from coordinator.request import Chunk, DraftMethod, Finish, GenerationRequest, Stats
from coordinator.tenancy import Tenants
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc
from specdec_core.errors import grpc_errors
from specdec_core.limits import validate_session_id
from specdec_core.engine.sampling import sampling_from_dict
from specdec_core.serving.wire import logprobs_to_proto, sampling_from_proto, sampling_to_proto

_METHODS = MappingProxyType({  # DRAFT_METHOD_UNSPECIFIED: None, the server's policy chooses
    pb.DRAFT_METHOD_MODEL: DraftMethod.MODEL,
    pb.DRAFT_METHOD_SUFFIX: DraftMethod.SUFFIX,
    pb.DRAFT_METHOD_NGRAM: DraftMethod.SUFFIX,  # its old name
    pb.DRAFT_METHOD_NONE: DraftMethod.NONE,
    pb.DRAFT_METHOD_HEAD: DraftMethod.HEAD,
})
_FINISH = MappingProxyType({
    Finish.LENGTH: pb.FINISH_REASON_LENGTH,
    Finish.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
    Finish.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
    Finish.CONTEXT: pb.FINISH_REASON_CONTEXT,
})


def request_from_proto(msg: pb.GenerationInput) -> GenerationRequest:
    which = msg.WhichOneof("input")
    spec = msg.speculation
    return GenerationRequest(
        prompt=msg.prompt if which == "prompt" else None,
        messages=[message_from_proto(m) for m in msg.messages.messages] if which == "messages" else None,
        token_ids=list(msg.token_ids.ids) if which == "token_ids" else None,
        sampling=sampling_from_proto(msg.sampling),
        seed=msg.sampling.seed if msg.sampling.HasField("seed") else None,
        max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else None,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        method=_METHODS.get(spec.method),
        num_speculative_tokens=spec.num_speculative_tokens if spec.HasField("num_speculative_tokens") else None,
        adaptive=spec.adaptive,
        overlap=spec.overlap if spec.HasField("overlap") else None,
        decode_steps=spec.decode_steps if spec.HasField("decode_steps") else None,
        min_draft_confidence=spec.min_draft_confidence,
        session_id=msg.session_id,
        request_id=msg.request_id,
        end_session=msg.end_session,
        tools=[{"name": t.name, "description": t.description, "parameters": t.parameters} for t in msg.tools] or None,
    )


def message_from_proto(m: pb.ChatMessage) -> dict:
    """A chat message as the coordinator keeps it: role and content, and its tool fields when set."""
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def message_to_proto(m: dict) -> pb.ChatMessage:
    return pb.ChatMessage(role=m["role"], content=m["content"], tool_call_id=m.get("tool_call_id", ""),
                          name=m.get("name", ""), tool_calls=[pb.ToolCall(**c) for c in m.get("tool_calls", [])])


def stats_to_proto(s: Stats) -> pb.SpeculationStats:
    overhead = max(0.0, s.wall_ms - s.draft_ms - s.verify_ms)
    return pb.SpeculationStats(
        rounds=s.rounds, drafted=s.drafted, accepted=s.accepted,
        acceptance_rate=s.accepted / s.drafted if s.drafted else 0.0,
        mean_accepted_length=(s.accepted + s.rounds) / s.rounds if s.rounds else 0.0,
        wall_ms=s.wall_ms, draft_ms=s.draft_ms, verify_ms=s.verify_ms, overhead_ms=overhead,
        last_k=s.last_k, max_verify_batch_size=s.max_verify_batch_size, model_rounds=s.model_rounds,
        suffix_rounds=s.suffix_rounds, head_rounds=s.head_rounds, decoded=s.decoded,
    )


def chunk_to_proto(chunk: Chunk, token_text=None) -> pb.GenerateStreamResponse:
    """token_text: token id -> its text, for the log-probabilities."""
    msg = pb.GenerateStreamResponse(session_id=chunk.session_id, text=chunk.text, token_ids=chunk.token_ids,
                                    logprobs=logprobs_to_proto(chunk.logprobs, token_text))
    if chunk.finish is not None:
        msg.finish_reason = _FINISH[chunk.finish]
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=chunk.prompt_tokens, completion_tokens=chunk.completion_tokens,
                                    session_tokens=chunk.session_tokens))
        msg.stats.CopyFrom(stats_to_proto(chunk.stats))
    return msg


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, generation: Generation, describe: pb.DescribeModelsResponse, tenants: Tenants | None = None):
        self.generation = generation
        self.describe = describe
        self.tenants = tenants or Tenants()

    def _run(self, request, context):
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        return self.generation.run(request_from_proto(request.input), lambda: not context.is_active(),
                                   self.tenants(context), deadline)

    @grpc_errors
    def GenerateStream(self, request, context):
        for chunk in self._run(request, context):
            yield chunk_to_proto(chunk, self.generation.codec.token_text)

    @grpc_errors
    def Generate(self, request, context):
        text, ids, logprobs, last = [], [], [], None
        for chunk in self._run(request, context):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            last = chunk
        return pb.GenerateResponse(
            session_id=last.session_id, text="".join(text), token_ids=ids, finish_reason=_FINISH[last.finish],
            usage=pb.Usage(prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
                           session_tokens=last.session_tokens),
            stats=stats_to_proto(last.stats), logprobs=logprobs_to_proto(logprobs, self.generation.codec.token_text),
        )

    @grpc_errors
    def GetSession(self, request, context):
        validate_session_id(request.session_id)
        s = self.generation.store.load(request.session_id, self.tenants(context))
        return pb.GetSessionResponse(
            session_id=s.session_id, token_ids=s.token_ids,
            messages=[message_to_proto(m) for m in s.messages],
            sampling=sampling_to_proto(sampling_from_dict(s.sampling or {}), s.seed), seed=s.seed,
            stats=stats_to_proto(s.stats), version=s.version,
        )

    @grpc_errors
    def EndSession(self, request, context):
        validate_session_id(request.session_id)
        session = self.generation.store.load(request.session_id, self.tenants(context))  # NOT_FOUND: not theirs
        self.generation.end(session)
        return pb.EndSessionResponse()

    @grpc_errors
    def DescribeModels(self, request, context):
        return self.describe

