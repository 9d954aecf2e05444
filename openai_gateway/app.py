"""The HTTP side: Starlette routes over the coordinator's public gRPC API (grpc.aio, so a stream
holds no thread).

Each choice is one gRPC call with a request id of its own, retried (idempotently: the coordinator
appends nothing twice, and a stream resumes where it broke) while UNAVAILABLE or ABORTED last less
than `retry_s`. A response starts only after the first chunk of every choice has arrived, so that a
refused request gets its HTTP status; an error after that ends the event stream with an `error`
event. A session the client did not ask to keep is ended by the coordinator when its request ends
(`end_session`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from openai_gateway import protocol
from openai_gateway.protocol import RequestError
from openai_gateway.tools import ToolCallParser
from specdec.client import Retries, StreamResume
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc

# gRPC status -> (HTTP status, OpenAI error type)
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
              429: "rate_limit_error", 503: "service_unavailable_error"}
# Our field names -> OpenAI's, for an error's `param`.
PARAMS = {"max_new_tokens": "max_tokens", "sampling.logprobs": "top_logprobs", "input": "messages"}


@dataclass(frozen=True)
class Settings:
    coordinator: str = "127.0.0.1:50050"
    credentials: grpc.ChannelCredentials | None = None  # None: plaintext to the coordinator
    server_name: str = ""  # the name to check in the coordinator's certificate, if not the host
    served_model_name: str = ""  # "": the target model's file or folder name
    retry_s: float = 30.0
    timeout_s: float | None = None  # per gRPC call; None: none


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("specdec_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=self.registry)
        self.seconds = Histogram("specdec_http_request_seconds", "HTTP request latency (to the last byte)",
                                 ["route"], registry=self.registry,
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.tokens = Counter("specdec_http_completion_tokens", "Tokens generated for HTTP requests",
                              registry=self.registry)


class Gateway:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self._channel: grpc.aio.Channel | None = None
        self._model: tuple[str, pb.DescribeModelsResponse] | None = None

    # -- the coordinator

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:  # made in the server's event loop, on first use
            s = self.settings
            if s.credentials is None:
                self._channel = grpc.aio.insecure_channel(s.coordinator)
            else:
                options = [("grpc.ssl_target_name_override", s.server_name)] if s.server_name else []
                self._channel = grpc.aio.secure_channel(s.coordinator, s.credentials, options=options)
        return self._channel

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)

    async def model(self, metadata=()) -> tuple[str, pb.DescribeModelsResponse]:
        """The served model's name and description (asked once, with the first caller's token)."""
        if self._model is None:
            described = await self.stub.DescribeModels(pb.DescribeModelsRequest(), metadata=metadata, timeout=10)
            name = self.settings.served_model_name or model_name(described.target.name)
            self._model = (name, described)
        return self._model

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    # -- routes

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/health/live", self.live, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ], lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        yield
        await self.close()

    async def chat(self, request: Request) -> Response:
        return await self._generate("chat", request)

    async def completions(self, request: Request) -> Response:
        return await self._generate("completions", request)

    async def models(self, request: Request) -> Response:
        try:
            name, described = await self.model(auth_metadata(request))
        except grpc.aio.AioRpcError as exc:
            return self._error_response("/v1/models", *rpc_error(exc))
        self.metrics.requests.labels("/v1/models", "200").inc()
        return JSONResponse({"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "specdec",
            "max_model_len": described.target.max_context, "root": described.target.name,
        }]})

    async def health(self, request: Request) -> Response:
        """Ready: the coordinator says SERVING (it checks Redis and the targets)."""
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            ok = False
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- generation

    async def _generate(self, kind: str, request: Request) -> Response:
        route = request.url.path
        started = time.perf_counter()
        metadata = auth_metadata(request)
        calls: list[_Choice] = []
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise RequestError(400, "the request body is not valid JSON") from None
            name, _ = await self.model(metadata)
            parsed = protocol.parse(kind, body, name)
            calls = [_Choice(self, job, metadata) for job in parsed.jobs]
            await asyncio.gather(*(c.start() for c in calls))  # every choice's first chunk: errors are statuses
        except RequestError as exc:
            return self._error_response(route, exc.status, exc.message, exc.param, exc.code)
        except grpc.aio.AioRpcError as exc:
            await asyncio.gather(*(c.cancel() for c in calls))
            return self._error_response(route, *rpc_error(exc, parsed.constraint_param if calls else None))
        if parsed.stream:
            return StreamingResponse(self._events(parsed, calls, route, started), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            results = await asyncio.gather(*(c.rest() for c in calls))
        except grpc.aio.AioRpcError as exc:
            await asyncio.gather(*(c.cancel() for c in calls))
            return self._error_response(route, *rpc_error(exc, parsed.constraint_param))
        names = parsed.tools.names if parsed.parses_tool_calls else None
        choices = [protocol.choice(kind, c.job.index, r.text, protocol.FINISH[r.finish_reason], r.logprobs,
                                   parsed.logprobs is not None, tool_names=names) for c, r in zip(calls, results)]
        if parsed.return_token_ids:
            for entry, r in zip(choices, results):
                entry["token_ids"] = list(r.token_ids)
        body = protocol.envelope(kind, protocol.response_id(kind), protocol.now(), parsed.model, choices, stream=False)
        body["usage"] = protocol.usage(  # a prompt counts once, however many choices it has (as OpenAI's)
            sum(r.usage.prompt_tokens for c, r in zip(calls, results) if c.job.index % parsed.n == 0),
            sum(r.usage.completion_tokens for r in results))
        body["speculation"] = protocol.speculation([r.stats for r in results])
        if parsed.keep_session:
            body["session_id"] = results[0].session_id
        self._count(route, 200, started, body["usage"]["completion_tokens"])
        return JSONResponse(body)

    async def _events(self, parsed: protocol.Parsed, calls: list[_Choice], route: str,
                      started: float) -> AsyncIterator[bytes]:
        kind, rid, created = parsed.kind, protocol.response_id(parsed.kind), protocol.now()
        want_lp = parsed.logprobs is not None
        stats, prompt_tokens, completion_tokens = [], 0, 0
        session_id = calls[0].first_session_id  # kept sessions are named in every event (n is 1 then)

        def event(choices: list[dict]) -> dict:
            e = protocol.envelope(kind, rid, created, parsed.model, choices, stream=True)
            if parsed.keep_session:
                e["session_id"] = session_id
            return e

        if parsed.parses_tool_calls:
            for c in calls:
                c.tool_parser = ToolCallParser(parsed.tools.names)
        merged = _merged(calls)
        try:
            if kind == "chat":  # the role first, as OpenAI does
                for c in calls:
                    yield sse(event([protocol.first_delta(c.job.index, parsed.parses_tool_calls)]))
            async for c, chunk in merged:
                if isinstance(chunk, grpc.aio.AioRpcError):
                    status, message, param, code = rpc_error(chunk, parsed.constraint_param)
                    yield sse({"error": error_body(status, message, param, code)["error"]})
                    self._count(route, status, started, completion_tokens)
                    return
                finish = protocol.FINISH.get(chunk.finish_reason) if chunk.finish_reason else None
                if c.tool_parser is not None:
                    with_ids = parsed.return_token_ids and bool(chunk.token_ids)
                    entries = protocol.tool_call_choices(c.tool_parser, c.job.index, chunk.text, finish,
                                                         chunk.logprobs, want_lp, always=with_ids)
                    if with_ids:
                        entries[0]["token_ids"] = list(chunk.token_ids)
                    for entry in entries:
                        yield sse(event([entry]))
                elif chunk.text or finish or (want_lp and chunk.logprobs) or (parsed.return_token_ids and chunk.token_ids):
                    entry = protocol.choice(kind, c.job.index, chunk.text, finish, chunk.logprobs, want_lp,
                                            offset=c.chars, delta=True)
                    if parsed.return_token_ids:
                        entry["token_ids"] = list(chunk.token_ids)
                    yield sse(event([entry]))
                    c.chars += len(chunk.text)
                if finish:
                    stats.append(chunk.stats)
                    prompt_tokens += chunk.usage.prompt_tokens if c.job.index % parsed.n == 0 else 0
                    completion_tokens += chunk.usage.completion_tokens
            if parsed.include_usage:
                last = event([])
                last["usage"] = protocol.usage(prompt_tokens, completion_tokens)
                last["speculation"] = protocol.speculation(stats)
                yield sse(last)
            yield b"data: [DONE]\n\n"
            self._count(route, 200, started, completion_tokens)
        finally:
            await merged.aclose()
            await asyncio.gather(*(c.cancel() for c in calls))

    def _count(self, route: str, status: int, started: float, tokens: int = 0) -> None:
        self.metrics.requests.labels(route, str(status)).inc()
        self.metrics.seconds.labels(route).observe(time.perf_counter() - started)
        self.metrics.tokens.inc(tokens)

    def _error_response(self, route: str, status: int, message: str, param: str | None = None,
                        code: str | None = None) -> Response:
        self.metrics.requests.labels(route, str(status)).inc()
        headers = {"Retry-After": "1"} if status in (429, 503) else None
        return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


async def _merged(calls: list[_Choice]) -> AsyncIterator[tuple[_Choice, object]]:
    """(choice, chunk) from every choice's stream as chunks arrive; (choice, error) ends it. One
    choice (the common case) is read directly, without a task and a queue per chunk."""
    if len(calls) == 1:
        try:
            async for chunk in calls[0].chunks():
                yield calls[0], chunk
        except grpc.aio.AioRpcError as exc:
            yield calls[0], exc
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: _Choice) -> None:
        try:
            async for chunk in c.chunks():
                await queue.put((c, chunk))
            await queue.put((c, None))
        except grpc.aio.AioRpcError as exc:
            await queue.put((c, exc))

    tasks = [asyncio.create_task(pump(c)) for c in calls]
    try:
        open_choices = len(calls)
        while open_choices:
            c, chunk = await queue.get()
            if chunk is None:
                open_choices -= 1
            else:
                yield c, chunk
    finally:
        for task in tasks:
            task.cancel()


class _Choice:
    """One choice's gRPC call, with retries: a stream, or (not streaming) the stream read whole."""

    def __init__(self, gateway: Gateway, job: protocol.Job, metadata):
        self.gateway = gateway
        self.job = job
        self.metadata = metadata
        self.request = pb.GenerateStreamRequest(input=job.input)
        self.chars = 0  # text streamed so far
        self.tool_parser: ToolCallParser | None = None  # streaming a chat choice parsed for tool calls
        self._call = None
        self._first: pb.GenerateStreamResponse | None = None
        self._resume = StreamResume()
        self._retries = Retries(gateway.settings.retry_s)

    async def start(self) -> None:
        """Wait for the first chunk (errors surface here, before any response is sent)."""
        async for chunk in self._attempts():
            self._first = chunk
            return

    @property
    def first_session_id(self) -> str:
        return self._first.session_id if self._first is not None else ""

    async def chunks(self) -> AsyncIterator[pb.GenerateStreamResponse]:
        if self._first is not None:
            yield self._first
            if self._first.finish_reason:
                return
        async for chunk in self._attempts():
            yield chunk

    async def _attempts(self) -> AsyncIterator[pb.GenerateStreamResponse]:
        while True:
            if self._call is None:
                self._resume.new_attempt()
                self._call = self.gateway.stub.GenerateStream(self.request, metadata=self.metadata,
                                                              timeout=self.gateway.settings.timeout_s)
            try:
                async for chunk in self._call:
                    self._retries.recovered()
                    chunk = self._resume.unseen(chunk)
                    if chunk is not None:
                        yield chunk
                        if chunk.finish_reason:
                            return
                return
            except grpc.aio.AioRpcError as exc:
                self._call = None
                await asyncio.sleep(self._retries.after(exc))

    async def rest(self) -> pb.GenerateResponse:
        """The whole result (not streaming)."""
        out = pb.GenerateResponse()
        text = []
        async for chunk in self.chunks():
            text.append(chunk.text)
            out.token_ids.extend(chunk.token_ids)
            out.logprobs.extend(chunk.logprobs)
            if chunk.finish_reason:
                out.session_id, out.finish_reason = chunk.session_id, chunk.finish_reason
                out.usage.CopyFrom(chunk.usage)
                out.stats.CopyFrom(chunk.stats)
        out.text = "".join(text)
        return out

    async def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def auth_metadata(request: Request) -> tuple:
    """The client's bearer token, passed on: the coordinator checks it and maps it to a tenant."""
    header = request.headers.get("authorization", "")
    return (("authorization", header),) if header else ()


def rpc_error(exc: grpc.aio.AioRpcError, constraint_param: str | None = None
              ) -> tuple[int, str, str | None, str | None]:
    """(HTTP status, message, param, code) for a failed gRPC call. constraint_param: the parameter
    the request's constraint came from (`response_format`, `guided_regex`, `tools`, ...), named
    for an invalid `sampling.constraint.*`."""
    status, _ = STATUS.get(exc.code(), (500, "api_error"))
    message = exc.details() or exc.code().name
    param = None
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and ": " in message:
        field = message.split(": ", 1)[0]
        if field.startswith("sampling.constraint"):
            param = constraint_param or "response_format"
        else:
            param = PARAMS.get(field, field.removeprefix("sampling.").removeprefix("input."))
            param = re.sub(r"^tools\[(\d+)\]\.(?!function)", r"tools[\1].function.", param)
    code = {401: "invalid_api_key", 404: "not_found", 429: "rate_limit_exceeded"}.get(status)
    return status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "api_error"), "param": param,
                      "code": code}}


def model_name(reference: str) -> str:
    """A model's name from its reference: a hub id as is, a file or folder by its last part."""
    if reference.startswith("/") or reference.startswith("."):
        name = reference.rstrip("/").rsplit("/", 1)[-1]
        return name.removesuffix(".gguf")
    return reference
