"""A small typed client over the public `specdec.v1.Generation` API (grpcio + protobuf only)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from specdec.v1 import common_pb2
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc

DRAFT_METHODS = {"default": pb.DRAFT_METHOD_UNSPECIFIED, "model": pb.DRAFT_METHOD_MODEL,
                 "ngram": pb.DRAFT_METHOD_NGRAM, "none": pb.DRAFT_METHOD_NONE}
FINISH_REASONS = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP_TOKEN: "stop_token",
                  pb.FINISH_REASON_STOP_STRING: "stop_string", pb.FINISH_REASON_CONTEXT: "context"}

Prompt = str | Sequence[dict] | Sequence[int]


@dataclass
class Result:
    session_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict = field(default_factory=dict)


def build_input(
    prompt: Prompt,
    *,
    chat: bool = False,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    draft: str = "default",
    k: int | None = None,
    adaptive: bool = False,
    overlap: bool | None = None,
    min_draft_confidence: float = 0.0,
    session_id: str = "",
) -> pb.GenerationInput:
    """prompt: text (sent raw, or as one user message with chat=True), chat messages
    ([{"role": ..., "content": ...}]), or token ids."""
    msg = pb.GenerationInput(session_id=session_id, stop=list(stop), stop_token_ids=list(stop_token_ids))
    if isinstance(prompt, str):
        if chat:
            msg.messages.messages.add(role="user", content=prompt)
        else:
            msg.prompt = prompt
    elif prompt and isinstance(prompt[0], dict):
        msg.messages.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in prompt]))
    else:
        msg.token_ids.ids.extend(prompt)
    sampling = common_pb2.SamplingParams(top_k=top_k)
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    msg.sampling.CopyFrom(sampling)
    if max_new_tokens is not None:
        msg.max_new_tokens = max_new_tokens
    msg.speculation.method = DRAFT_METHODS[draft]
    msg.speculation.adaptive = adaptive
    msg.speculation.min_draft_confidence = min_draft_confidence
    if overlap is not None:
        msg.speculation.overlap = overlap
    if k is not None:
        msg.speculation.num_speculative_tokens = k
    return msg


def stats_dict(stats: pb.SpeculationStats) -> dict:
    return {f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields}


class Client:
    """address: host:port of a coordinator. credentials: e.g. `grpc.ssl_channel_credentials(ca)`
    for a TLS endpoint (or tls_ca: a CA file path). token: sent as `authorization: Bearer <token>`."""

    def __init__(self, address: str = "localhost:50050", timeout_s: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None, token: str = "", tls_ca: str = ""):
        if credentials is None and tls_ca:
            with open(tls_ca, "rb") as f:
                credentials = grpc.ssl_channel_credentials(f.read())
        self.channel = (grpc.secure_channel(address, credentials) if credentials
                        else grpc.insecure_channel(address))
        if token:
            self.channel = grpc.intercept_channel(self.channel, _BearerToken(token))
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.timeout_s = timeout_s

    def generate(self, prompt: Prompt, **kwargs) -> Result:
        r = self.stub.Generate(pb.GenerateRequest(input=build_input(prompt, **kwargs)), timeout=self.timeout_s)
        return Result(r.session_id, r.text, list(r.token_ids), FINISH_REASONS.get(r.finish_reason, "unspecified"),
                      r.usage.prompt_tokens, r.usage.completion_tokens, stats_dict(r.stats))

    def stream(self, prompt: Prompt, **kwargs) -> Iterator[pb.GenerateStreamResponse]:
        """Yields chunks as rounds are committed; the last carries finish_reason, usage and stats."""
        request = pb.GenerateStreamRequest(input=build_input(prompt, **kwargs))
        yield from self.stub.GenerateStream(request, timeout=self.timeout_s)

    def get_session(self, session_id: str) -> pb.GetSessionResponse:
        return self.stub.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=self.timeout_s)

    def end_session(self, session_id: str) -> None:
        self.stub.EndSession(pb.EndSessionRequest(session_id=session_id), timeout=self.timeout_s)

    def describe(self) -> pb.DescribeModelsResponse:
        return self.stub.DescribeModels(pb.DescribeModelsRequest(), timeout=self.timeout_s)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self.metadata = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self.metadata])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)
