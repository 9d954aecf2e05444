"""A small typed client over the public `specdec.v1.Generation` API (grpcio + protobuf only)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from specdec.v1 import common_pb2
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc

DRAFT_METHODS = {"default": pb.DRAFT_METHOD_UNSPECIFIED, "model": pb.DRAFT_METHOD_MODEL,
                 "suffix": pb.DRAFT_METHOD_SUFFIX, "ngram": pb.DRAFT_METHOD_NGRAM,  # ngram: suffix's old name
                 "none": pb.DRAFT_METHOD_NONE}
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
    decode_steps: int | None = None,
    session_id: str = "",
    request_id: str = "",
    end_session: bool = False,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    logprobs: int | None = None,
) -> pb.GenerationInput:
    """prompt: text (sent raw, or as one user message with chat=True), chat messages
    ([{"role": ..., "content": ...}]), or token ids. request_id: makes retries idempotent.
    end_session: end the session once the request has finished (a one-shot request leaves nothing).
    logprobs: report each token's log-probability and this many alternatives."""
    msg = pb.GenerationInput(session_id=session_id, stop=list(stop), stop_token_ids=list(stop_token_ids),
                             request_id=request_id, end_session=end_session)
    if isinstance(prompt, str):
        if chat:
            msg.messages.messages.add(role="user", content=prompt)
        else:
            msg.prompt = prompt
    elif prompt and isinstance(prompt[0], dict):
        msg.messages.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in prompt]))
    else:
        msg.token_ids.ids.extend(prompt)
    sampling = common_pb2.SamplingParams(top_k=top_k, min_p=min_p, presence_penalty=presence_penalty,
                                         frequency_penalty=frequency_penalty, logit_bias=logit_bias or {})
    for name, value in (("temperature", temperature), ("top_p", top_p), ("seed", seed),
                        ("repetition_penalty", repetition_penalty), ("logprobs", logprobs)):
        if value is not None:
            setattr(sampling, name, value)
    msg.sampling.CopyFrom(sampling)
    if max_new_tokens is not None:
        msg.max_new_tokens = max_new_tokens
    msg.speculation.method = DRAFT_METHODS[draft]
    msg.speculation.adaptive = adaptive
    msg.speculation.min_draft_confidence = min_draft_confidence
    if overlap is not None:
        msg.speculation.overlap = overlap
    if decode_steps is not None:
        msg.speculation.decode_steps = decode_steps
    if k is not None:
        msg.speculation.num_speculative_tokens = k
    return msg


def stats_dict(stats: pb.SpeculationStats) -> dict:
    return {f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields}


class Client:
    """address: host:port of a coordinator. credentials: e.g. `grpc.ssl_channel_credentials(ca)`
    for a TLS endpoint (or tls_ca: a CA file path). token: sent as `authorization: Bearer <token>`.

    Every generation carries a request id (a fresh one unless given), and a call that fails
    UNAVAILABLE (a coordinator restarting, Redis failing over) or ABORTED (it raced an earlier
    attempt of itself) is retried with it while the failures last no longer than `retry_s`
    seconds: the server then appends nothing twice, and a stream resumes where it broke: what the
    failed attempt already yielded is not yielded again (the server replays the request's output
    from its start; this client skips what it has seen)."""

    def __init__(self, address: str = "localhost:50050", timeout_s: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None, token: str = "", tls_ca: str = "",
                 retry_s: float = 30.0):
        if credentials is None and tls_ca:
            with open(tls_ca, "rb") as f:
                credentials = grpc.ssl_channel_credentials(f.read())
        self.channel = (grpc.secure_channel(address, credentials) if credentials
                        else grpc.insecure_channel(address))
        if token:
            self.channel = grpc.intercept_channel(self.channel, _BearerToken(token))
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.timeout_s = timeout_s
        self.retry_s = retry_s

    def generate(self, prompt: Prompt, **kwargs) -> Result:
        request = pb.GenerateRequest(input=build_input(prompt, **_with_request_id(kwargs)))
        retries = Retries(self.retry_s)
        while True:
            try:
                r = self.stub.Generate(request, timeout=self.timeout_s)
                break
            except grpc.RpcError as exc:
                time.sleep(retries.after(exc))
        return Result(r.session_id, r.text, list(r.token_ids), FINISH_REASONS.get(r.finish_reason, "unspecified"),
                      r.usage.prompt_tokens, r.usage.completion_tokens, stats_dict(r.stats))

    def stream(self, prompt: Prompt, **kwargs) -> Iterator[pb.GenerateStreamResponse]:
        """Yields chunks as rounds are committed; the last carries finish_reason, usage and stats."""
        request = pb.GenerateStreamRequest(input=build_input(prompt, **_with_request_id(kwargs)))
        resume = StreamResume()
        retries = Retries(self.retry_s)
        while True:
            resume.new_attempt()
            try:
                for chunk in self.stub.GenerateStream(request, timeout=self.timeout_s):
                    retries.recovered()  # a long stream may break late: the bound is per outage
                    chunk = resume.unseen(chunk)
                    if chunk is None:
                        continue
                    yield chunk
                    if chunk.finish_reason:  # done, even if the stream breaks before its status arrives
                        return
                return
            except grpc.RpcError as exc:
                time.sleep(retries.after(exc))

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


def _with_request_id(kwargs: dict) -> dict:
    return kwargs if kwargs.get("request_id") else {**kwargs, "request_id": uuid.uuid4().hex}


class StreamResume:
    """What of a retried stream is new: the server replays a retried request's output from its
    start, and what earlier attempts yielded is cut off."""

    def __init__(self):
        self.seen_ids = self.seen_chars = 0  # what the call has yielded, over all attempts
        self.ids = self.chars = 0  # what this attempt has received

    def new_attempt(self) -> None:
        self.ids = self.chars = 0

    def unseen(self, chunk: pb.GenerateStreamResponse) -> pb.GenerateStreamResponse | None:
        """chunk without what was yielded before (None if nothing is left of it)."""
        skip_ids, skip_chars = max(0, self.seen_ids - self.ids), max(0, self.seen_chars - self.chars)
        self.ids, self.chars = self.ids + len(chunk.token_ids), self.chars + len(chunk.text)
        if skip_ids or skip_chars:
            if self.ids <= self.seen_ids and self.chars <= self.seen_chars and not chunk.finish_reason:
                return None
            new = pb.GenerateStreamResponse()
            new.CopyFrom(chunk)
            del new.token_ids[:skip_ids]
            del new.logprobs[:max(0, skip_ids - (len(chunk.token_ids) - len(chunk.logprobs)))]
            new.text = chunk.text[skip_chars:]
            chunk = new
        self.seen_ids, self.seen_chars = max(self.seen_ids, self.ids), max(self.seen_chars, self.chars)
        return chunk


class Retries:
    """When a call is tried again: after UNAVAILABLE (the server or its store is briefly gone) or
    ABORTED (the request's own earlier attempt won a race with this one), with backoff, while the
    outage has lasted less than `retry_s`."""

    def __init__(self, retry_s: float):
        self.retry_s = retry_s
        self.failing_since: float | None = None
        self.attempt = 0

    def recovered(self) -> None:
        self.failing_since = None

    def after(self, exc: grpc.RpcError) -> float:
        """Seconds to wait before the next attempt, or raise exc if there is to be none."""
        self.failing_since = self.failing_since or time.monotonic()
        retryable = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
        if not retryable or time.monotonic() - self.failing_since >= self.retry_s:
            raise exc
        self.attempt += 1
        return min(2.0, 0.2 * 2 ** (self.attempt - 1))


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self.metadata = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self.metadata])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)
