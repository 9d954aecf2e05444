"""A locust user that streams chat completions from a specdec coordinator over gRPC.

Run it with locust directly (web UI or headless):

    locust -f specdec/locustfile.py --host 127.0.0.1:50050 --headless -u 8 -r 2 -t 60s \\
        --max-new-tokens 64 --draft model -k 5

or through `specdec loadtest` (headless, a summary with percentiles, --json and --record).

Every request is one `GenerateStream` call and reports three kinds of locust request metrics
(request type "grpc"):

- `ttft`:   time to the first chunk that carries a token (response_length: tokens in that chunk)
- `itl`:    inter-token latency, one sample per token after the first chunk; a chunk of n tokens
            that arrives g ms after the previous one gives n samples of g / n ms (speculative rounds
            commit several tokens at once)
- `stream`: the whole call (response_length: tokens received, so locust's content-length totals
            are token totals); a failed call carries the `grpc.RpcError` (its status code names the
            error)

The `stream` event's `context` holds what the client received (session id, token ids, usage,
speculation stats), so a listener can compare it with the server's record of the session.

gRPC's C core does its own I/O, which gevent cannot monkey-patch; `grpc.experimental.gevent`
makes it cooperate with gevent. It has to be initialised after gevent patched the standard
library (importing locust does that) and before any channel exists, so this file does it on import.
"""

from __future__ import annotations

import itertools
import os
import random
import time

import locust  # noqa: F401  (first: gevent.monkey.patch_all)
import grpc
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

from gevent import GreenletExit  # noqa: E402
from locust import User, constant, events, task  # noqa: E402

from specdec.client import DRAFT_METHODS, build_input, stats_dict  # noqa: E402
from specdec.v1 import generation_pb2 as pb  # noqa: E402
from specdec.v1 import generation_pb2_grpc  # noqa: E402

# Chat prompts of the kind a chat assistant gets: a mix of short answers, explanations and rewrites.
PROMPTS = [
    "Why is the sky blue?",
    "Explain in a few sentences how a hash map works.",
    "Write a haiku about GPUs.",
    "What is the difference between a process and a thread?",
    "Give me three tips for writing clear commit messages.",
    "Rewrite this more formally: hey, the meeting got moved to friday, can u make it?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What does the Python keyword `yield` do?",
    "List the planets of the solar system in order from the sun.",
    "How do I reverse a linked list? Answer briefly.",
    "Translate to French: The weather is nice today.",
    "What is speculative decoding in language models?",
]
FOLLOW_UPS = [
    "Can you say that more briefly?",
    "Give me an example.",
    "Why?",
    "Thanks! Anything else I should know?",
]

ENV_DEFAULTS = {  # locust option -> environment variable (used when the option is not given)
    "max_new_tokens": ("SPECDEC_LOADTEST_MAX_NEW_TOKENS", 64),
    "draft": ("SPECDEC_LOADTEST_DRAFT", "default"),
    "num_speculative_tokens": ("SPECDEC_LOADTEST_K", None),
    "temperature": ("SPECDEC_LOADTEST_TEMPERATURE", None),
    "turns": ("SPECDEC_LOADTEST_TURNS", 1),
    "request_timeout": ("SPECDEC_LOADTEST_TIMEOUT", 300.0),
    "prompts_file": ("SPECDEC_LOADTEST_PROMPTS", ""),
}


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    g = parser.add_argument_group("specdec", "what each simulated user asks the coordinator")
    g.add_argument("--max-new-tokens", type=int, env_var="SPECDEC_LOADTEST_MAX_NEW_TOKENS", default=64,
                   help="max_new_tokens of every request")
    g.add_argument("--draft", choices=sorted(DRAFT_METHODS), env_var="SPECDEC_LOADTEST_DRAFT", default="default",
                   help="drafting method (none = the target alone, K = 0)")
    g.add_argument("-k", "--num-speculative-tokens", type=int, env_var="SPECDEC_LOADTEST_K", default=None,
                   help="draft tokens per round (unset: the server default)")
    g.add_argument("--temperature", type=float, env_var="SPECDEC_LOADTEST_TEMPERATURE", default=None,
                   help="sampling temperature (unset or 0: greedy)")
    g.add_argument("--turns", type=int, env_var="SPECDEC_LOADTEST_TURNS", default=1,
                   help="requests per session: a chat prompt, then follow-ups in the same session")
    g.add_argument("--request-timeout", type=float, env_var="SPECDEC_LOADTEST_TIMEOUT", default=300.0,
                   help="deadline of each gRPC call, seconds")
    g.add_argument("--prompts-file", env_var="SPECDEC_LOADTEST_PROMPTS", default="",
                   help="a text file with one chat prompt per line (default: a built-in list)")


def option(environment, name: str):
    """A specdec option: from locust's parsed options when there are any, else the environment."""
    parsed = getattr(environment, "parsed_options", None)
    value = getattr(parsed, name, None) if parsed is not None else None
    if value is not None:
        return value
    env_name, default = ENV_DEFAULTS[name]
    raw = os.environ.get(env_name)
    if raw in (None, ""):
        return default
    kind = {"max_new_tokens": int, "num_speculative_tokens": int, "turns": int, "temperature": float,
            "request_timeout": float}.get(name, str)
    return kind(raw)


def load_prompts(path: str) -> list[str]:
    if not path:
        return PROMPTS
    with open(path, encoding="utf-8") as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def address_of(host: str | None) -> str:
    host = host or os.environ.get("SPECDEC_ADDRESS", "localhost:50050")
    for scheme in ("grpc://", "http://", "dns:///"):
        host = host.removeprefix(scheme)
    return host.rstrip("/")


class GenerationClient:
    """Streams one request and reports ttft / itl / stream to locust's request event."""

    def __init__(self, address: str, environment):
        self.environment = environment
        self.channel = grpc.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def _fire(self, name: str, response_time: float, response_length: int = 0, exception=None,
              context: dict | None = None) -> None:
        self.environment.events.request.fire(request_type="grpc", name=name, response_time=response_time,
                                             response_length=response_length, exception=exception,
                                             context=context or {}, response=None)

    def stream(self, messages: list[dict], *, timeout: float, turn: int = 0, **kwargs) -> dict:
        """One GenerateStream call; returns the record of what was received. Errors are reported to
        locust and recorded, not raised."""
        request = pb.GenerateStreamRequest(input=build_input(messages, **kwargs))
        record = {"session_id": kwargs.get("session_id", ""), "turn": turn, "token_ids": [], "ok": False,
                  "error": None,
                  "finish_reason": None, "prompt_tokens": None, "completion_tokens": None,
                  "session_tokens": None, "stats": None, "ttft_ms": None, "wall_ms": None, "cancelled": False}
        started = time.perf_counter()
        previous = None  # when the last token-bearing chunk arrived
        exception = None
        call = self.stub.GenerateStream(request, timeout=timeout)
        try:
            for chunk in call:
                now = time.perf_counter()
                if chunk.session_id:
                    record["session_id"] = chunk.session_id
                n = len(chunk.token_ids)
                if n:
                    record["token_ids"].extend(chunk.token_ids)
                    if previous is None:
                        record["ttft_ms"] = (now - started) * 1e3
                        self._fire("ttft", record["ttft_ms"], n)
                    else:
                        gap_ms = (now - previous) * 1e3 / n
                        for _ in range(n):
                            self._fire("itl", gap_ms, 1)
                    previous = now
                if chunk.finish_reason:
                    record.update(finish_reason=pb.FinishReason.Name(chunk.finish_reason),
                                  prompt_tokens=chunk.usage.prompt_tokens,
                                  completion_tokens=chunk.usage.completion_tokens,
                                  session_tokens=chunk.usage.session_tokens, stats=stats_dict(chunk.stats))
            record["ok"] = True
        except grpc.RpcError as err:
            exception = err
            record["error"] = {"code": err.code().name if err.code() else "UNKNOWN", "details": err.details()}
        except GreenletExit:  # locust stopping this user past --stop-timeout: not the server's fault
            call.cancel()
            record["cancelled"] = True
            raise
        except Exception as exc:  # noqa: BLE001 - a client-side failure is still a failed request
            exception = exc
            record["error"] = {"code": type(exc).__name__, "details": str(exc)}
        finally:
            record["wall_ms"] = (time.perf_counter() - started) * 1e3
            if not record["cancelled"]:
                self._fire("stream", record["wall_ms"], len(record["token_ids"]), exception, {"record": record})
        return record

    def close(self) -> None:
        self.channel.close()


class SpecdecUser(User):
    """One chat user: a prompt from the list, then `turns - 1` follow-ups in the same session."""

    wait_time = constant(0)  # closed loop: the next request as soon as the last one finished
    _ids = itertools.count()

    def on_start(self) -> None:
        env = self.environment
        self.client = GenerationClient(address_of(self.host or env.host), env)
        self.prompts = load_prompts(option(env, "prompts_file"))
        self.rng = random.Random(next(self._ids))
        temperature = option(env, "temperature")
        self.kwargs = dict(max_new_tokens=option(env, "max_new_tokens"), draft=option(env, "draft"),
                           k=option(env, "num_speculative_tokens"), temperature=temperature,
                           timeout=option(env, "request_timeout"))
        self.turns = max(1, option(env, "turns"))

    def on_stop(self) -> None:
        self.client.close()

    @task
    def chat(self) -> None:
        session_id = ""
        content = self.rng.choice(self.prompts)
        for turn in range(self.turns):
            record = self.client.stream([{"role": "user", "content": content}], session_id=session_id, turn=turn,
                                        **self.kwargs)
            if not record["ok"] or not record["session_id"]:
                return
            session_id = record["session_id"]
            content = self.rng.choice(FOLLOW_UPS)
