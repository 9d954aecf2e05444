"""A small typed client over the public `specdec.v1.Generation` API (grpcio + protobuf only)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from specdec.v1 import common_pb2
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc

DRAFT_METHODS = {"default": pb.DRAFT_METHOD_UNSPECIFIED, "model": pb.DRAFT_METHOD_MODEL,
                 "suffix": pb.DRAFT_METHOD_SUFFIX, "ngram": pb.DRAFT_METHOD_NGRAM,  # ngram: suffix's old name
                 "none": pb.DRAFT_METHOD_NONE, "head": pb.DRAFT_METHOD_HEAD}
FINISH_REASONS = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP_TOKEN: "stop_token",
                  pb.FINISH_REASON_STOP_STRING: "stop_string", pb.FINISH_REASON_CONTEXT: "context"}
CONSTRAINTS = ("json_schema", "json_object", "regex", "choice", "grammar")  # Constraint's oneof, in its order

Message = Mapping[str, Any] | pb.ChatMessage
Prompt = str | Sequence[Message] | Sequence[int]
# A JSON schema: JSON text, a dict, or a pydantic model class (anything with `model_json_schema()`).
Schema = str | Mapping[str, Any] | type


@dataclass
class Result:
    session_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict = field(default_factory=dict)
    # When `logprobs` was asked for: one entry per token id (a retried request's output from
    # before the retry is replayed without them).
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)


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
    logit_bias: Mapping[int, float] | None = None,
    logprobs: int | None = None,
    tools: Sequence[Mapping[str, Any] | pb.Tool] = (),
    json_schema: Schema | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
) -> pb.GenerationInput:
    """The `GenerationInput` of a request: every field of the public API, as keyword arguments.
    (`protos/specdec/v1/generation.proto` and `common.proto` say what each field means.)

    Input:
      prompt: text (sent raw, or as one user message with chat=True), chat messages, or token ids.
        A message is a dict in the proto's shape ({"role", "content", "tool_calls": [{"id",
        "name", "arguments"}], "tool_call_id", "name"}) or in OpenAI's (tool calls as {"id",
        "type": "function", "function": {"name", "arguments"}}; content None or a list of text
        parts; arguments a dict or JSON text), or a `pb.ChatMessage`.
      tools: functions the model may call (only with messages): OpenAI's {"type": "function",
        "function": {...}} entries or flat {"name", "description", "parameters"} dicts, parameters
        a JSON schema (dict, JSON text or pydantic model class; `strict` is ignored), or `pb.Tool`s.
        To force a call, also pass a constraint (e.g. json_schema=the function's parameters).

    Length and stopping: max_new_tokens (unset: the server default), stop (strings),
      stop_token_ids (the model's end-of-sequence tokens always stop).

    Sampling (unset temperature, or 0: greedy): temperature, top_k (0: off), top_p, min_p (0: off),
      seed (unset: the server picks one and records it in the session), presence_penalty and
      frequency_penalty (OpenAI's, [-2, 2]), repetition_penalty (transformers'; unset: off),
      logit_bias ({token id: bias in [-100, 100]}), logprobs (report each token's log-probability
      and this many most likely alternatives, 0..20; unset: none).

    Structured output, at most one of (ValueError naming them if more): json_schema (the output is
      JSON that validates against it: a dict, JSON text, or a pydantic model class, whose
      `model_json_schema()` is used), json_object=True (any JSON object), regex (the whole output
      matches it), choice (exactly one of these strings), grammar (a context-free grammar: Lark,
      or GBNF/EBNF with `name ::= ...` rules). The server answers INVALID_ARGUMENT if it does not
      compile.

    Speculation: draft ("default": the coordinator's policy; "model", "suffix", "ngram", "none"),
      k (draft tokens per round; without draft: the draft model with this K), adaptive, overlap
      (unset: the server's), min_draft_confidence, decode_steps (unset: the server's).

    Session: session_id (continue this session; empty: a new one), end_session (end the session
      once the request has finished, so that a one-shot request leaves nothing behind; its id
      cannot be continued), request_id (makes retries idempotent; `Client` sets a fresh one per
      call unless given)."""
    msg = pb.GenerationInput(session_id=session_id, stop=list(stop), stop_token_ids=list(stop_token_ids),
                             request_id=request_id, end_session=end_session)
    if isinstance(prompt, str):
        if chat:
            msg.messages.messages.add(role="user", content=prompt)
        else:
            msg.prompt = prompt
    elif prompt and isinstance(prompt[0], (Mapping, pb.ChatMessage)):
        msg.messages.CopyFrom(pb.ChatMessages(messages=[chat_message(m) for m in prompt]))
    else:
        msg.token_ids.ids.extend(prompt)
    msg.tools.extend(tool(t) for t in tools)
    sampling = common_pb2.SamplingParams(top_k=top_k, min_p=min_p, presence_penalty=presence_penalty,
                                         frequency_penalty=frequency_penalty, logit_bias=dict(logit_bias or {}))
    for name, value in (("temperature", temperature), ("top_p", top_p), ("seed", seed),
                        ("repetition_penalty", repetition_penalty), ("logprobs", logprobs)):
        if value is not None:
            setattr(sampling, name, value)
    constraint = build_constraint(json_schema=json_schema, json_object=json_object, regex=regex, choice=choice,
                                  grammar=grammar)
    if constraint is not None:
        sampling.constraint.CopyFrom(constraint)
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


def build_constraint(*, json_schema: Schema | None = None, json_object: bool = False, regex: str | None = None,
                     choice: Sequence[str] | None = None, grammar: str | None = None) -> common_pb2.Constraint | None:
    """The `Constraint` of at most one of these (None for none; ValueError naming them for more):
    json_schema (dict, JSON text or pydantic model class), json_object, regex, choice, grammar."""
    given = {"json_schema": json_schema is not None, "json_object": bool(json_object), "regex": regex is not None,
             "choice": choice is not None, "grammar": grammar is not None}
    named = [name for name in CONSTRAINTS if given[name]]
    if len(named) > 1:
        raise ValueError(f"at most one constraint per request; got {' and '.join(named)}")
    if not named:
        return None
    if json_schema is not None:
        return common_pb2.Constraint(json_schema=schema_text(json_schema, "json_schema"))
    if json_object:
        return common_pb2.Constraint(json_object=True)
    if regex is not None:
        return common_pb2.Constraint(regex=_text(regex, "regex"))
    if choice is not None:
        if isinstance(choice, (str, bytes)) or not all(isinstance(c, str) for c in choice):
            raise TypeError(f"choice must be a list of strings, not {choice!r}")
        return common_pb2.Constraint(choice=common_pb2.Choices(choices=list(choice)))
    return common_pb2.Constraint(grammar=_text(grammar, "grammar"))


def schema_text(schema: Schema, what: str = "json_schema") -> str:
    """A JSON schema as JSON text: text is sent as is, a dict is serialized, and a pydantic model
    (anything with `model_json_schema()`) gives its schema (pydantic is never imported here)."""
    if isinstance(schema, str):
        return schema
    if callable(getattr(schema, "model_json_schema", None)):
        schema = schema.model_json_schema()
    if isinstance(schema, (Mapping, bool)):  # true and false are schemas too
        return json.dumps(schema)
    raise TypeError(f"{what} must be a dict, JSON text or a pydantic model class, not {type(schema).__name__}")


def chat_message(m: Message) -> pb.ChatMessage:
    """One chat message from a dict in the proto's shape or OpenAI's (see `build_input`)."""
    if isinstance(m, pb.ChatMessage):
        return m
    m = {key: value for key, value in m.items() if value is not None}  # OpenAI's SDK writes unset fields as None
    unknown = set(m) - {"role", "content", "tool_calls", "tool_call_id", "name"}
    if unknown:
        raise ValueError(f"chat message with unknown fields {sorted(unknown)}")
    content = m.get("content", "")
    if not isinstance(content, str):  # OpenAI's content parts
        if any(part.get("type") != "text" for part in content):
            raise ValueError("chat message content parts must be text parts")
        content = "".join(part["text"] for part in content)
    return pb.ChatMessage(role=m.get("role", ""), content=content, tool_call_id=m.get("tool_call_id", ""),
                          name=m.get("name", ""), tool_calls=[tool_call(c) for c in m.get("tool_calls", ())])


def tool_call(c: Mapping[str, Any] | pb.ToolCall) -> pb.ToolCall:
    """An assistant message's tool call: {"id", "name", "arguments"}, or OpenAI's {"id", "type":
    "function", "function": {"name", "arguments"}}; arguments a dict or JSON text."""
    if isinstance(c, pb.ToolCall):
        return c
    if c.get("type", "function") != "function":
        raise ValueError(f"tool call of type {c['type']!r}: only function calls")
    fn = c.get("function", c)
    arguments = fn.get("arguments", "")
    return pb.ToolCall(id=c.get("id", ""), name=fn.get("name", ""),
                       arguments=arguments if isinstance(arguments, str) else json.dumps(arguments))


def tool(t: Mapping[str, Any] | pb.Tool) -> pb.Tool:
    """A function the model may call: OpenAI's {"type": "function", "function": {"name",
    "description", "parameters", "strict"}} or a flat {"name", "description", "parameters"};
    parameters a dict, JSON text or pydantic model class (unset: any object)."""
    if isinstance(t, pb.Tool):
        return t
    if t.get("type", "function") != "function":
        raise ValueError(f"tool of type {t['type']!r}: only function tools")
    fn = t.get("function", t)
    if not fn.get("name"):
        raise ValueError(f"a tool needs a name: {dict(t)!r}")
    parameters = fn.get("parameters")
    return pb.Tool(name=fn["name"], description=fn.get("description") or "",
                   parameters="" if parameters is None else schema_text(parameters, f"tool {fn['name']!r} parameters"))


def _text(value: str, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, not {type(value).__name__}")
    return value


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

    def generate(self, prompt: Prompt, **options) -> Result:
        """Generate a completion and return it whole.

        prompt: text, chat messages or token ids; options: any field of the request, as keyword
        arguments of `build_input` (sampling, max_new_tokens, stop, stop_token_ids, speculation,
        session_id, request_id, end_session, tools, and a constraint: json_schema, json_object,
        regex, choice or grammar). A session is kept unless end_session=True: pass it for a
        one-shot request, or end the session later with `end_session(result.session_id)`.

            client.generate("List three colours as JSON.", chat=True, json_schema=Colours,
                            max_new_tokens=64, end_session=True)"""
        request = pb.GenerateRequest(input=build_input(prompt, **_with_request_id(options)))
        retries = Retries(self.retry_s)
        while True:
            try:
                r = self.stub.Generate(request, timeout=self.timeout_s)
                break
            except grpc.RpcError as exc:
                time.sleep(retries.after(exc))
        return Result(r.session_id, r.text, list(r.token_ids), FINISH_REASONS.get(r.finish_reason, "unspecified"),
                      r.usage.prompt_tokens, r.usage.completion_tokens, stats_dict(r.stats), list(r.logprobs))

    def stream(self, prompt: Prompt, **options) -> Iterator[pb.GenerateStreamResponse]:
        """Generate a completion, yielding chunks (text, token_ids, logprobs) as rounds are
        committed; the last carries finish_reason, usage and stats. prompt and options: as for
        `generate` (every field of the request, as keyword arguments of `build_input`)."""
        request = pb.GenerateStreamRequest(input=build_input(prompt, **_with_request_id(options)))
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
        """End a session: its record and the workers' caches are freed."""
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


def _with_request_id(options: dict) -> dict:
    """A fresh request id unless one is given: every attempt of a call sends the same one."""
    return options if options.get("request_id") else {**options, "request_id": uuid.uuid4().hex}


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
