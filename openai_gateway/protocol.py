"""OpenAI's request and response bodies <-> the public gRPC API's messages. Pure functions: no I/O.

Requests are checked here for what gRPC cannot say in OpenAI's terms (types, `n`, the options this
server does not offer); everything the coordinator checks anyway (ranges, lengths, token ids) is
left to it, so that both APIs refuse the same input for the same reason.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from openai_gateway import tools as tool_calls
from openai_gateway.errors import RequestError, invalid
from openai_gateway.structured import structured
from specdec.client import DRAFT_METHODS
from specdec.v1 import common_pb2
from specdec.v1 import generation_pb2 as pb

MAX_N = 16  # most choices per request (each is a session of its own)
FINISH = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP_TOKEN: "stop",
          pb.FINISH_REASON_STOP_STRING: "stop", pb.FINISH_REASON_CONTEXT: "length"}
# Fields OpenAI defines that this server does not implement: refused, never silently ignored.
UNSUPPORTED = {
    "chat": ("functions", "function_call", "audio", "prediction", "web_search_options"),
    "completions": ("suffix", "echo", "best_of"),
}


@dataclass(frozen=True)
class Job:
    """One choice to generate: its gRPC input, its index in the response, and how to report it."""

    index: int
    input: pb.GenerationInput


@dataclass(frozen=True)
class Parsed:
    kind: str  # "chat" or "completions"
    model: str
    jobs: list[Job]
    n: int  # choices per prompt
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives per token when log-probabilities were asked for
    keep_session: bool
    return_token_ids: bool  # extension (as vLLM's): each choice also lists its token ids
    tools: tool_calls.Tools | None = None  # chat with tools: the output is parsed for calls when tools.parses
    constraint_param: str | None = None  # the parameter the request's constraint came from (for errors)

    @property
    def parses_tool_calls(self) -> bool:
        return self.tools is not None and self.tools.parses


def parse(kind: str, body, served_model: str) -> Parsed:
    """An OpenAI chat or completions request body -> the gRPC inputs of its choices."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "is required")
    if model != served_model:
        raise RequestError(404, f"The model `{model}` does not exist; this server serves `{served_model}`",
                           "model", "model_not_found")
    for name in UNSUPPORTED[kind]:
        if body.get(name) not in (None, False, [], 1 if name == "best_of" else None):
            raise invalid(name, "is not supported by this server")
    n = _int(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise invalid("n", f"must be in 1..{MAX_N}, got {n}")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("stream_options", "must be an object")
    include_usage = bool(options.get("include_usage")) and stream
    session_id = _str(body, "session_id", "")
    keep_session = _bool(body, "keep_session", False) or bool(session_id)
    if keep_session and n > 1:
        raise invalid("n", "a session continues one conversation: n must be 1 with session_id or keep_session")

    template = pb.GenerationInput(session_id=session_id, end_session=not keep_session)
    template.sampling.CopyFrom(_sampling(kind, body))
    tools = tool_calls.parse_tools(body) if kind == "chat" else None
    constraint = structured(body)
    if tools is not None:
        constraint = tools.constraint(constraint)
        template.tools.extend(tools.to_proto())
    if constraint is not None:
        template.sampling.constraint.CopyFrom(constraint.constraint)
    logprobs = template.sampling.logprobs if template.sampling.HasField("logprobs") else None
    max_tokens = body.get("max_completion_tokens") if kind == "chat" else None
    param = "max_completion_tokens" if max_tokens is not None else "max_tokens"
    max_tokens = _int(body, param, None)
    if max_tokens is not None:
        if max_tokens < 1:
            raise invalid(param, f"must be >= 1, got {max_tokens}")
        template.max_new_tokens = max_tokens
    template.stop.extend(_stop(body))
    _speculation(body, template.speculation)

    prompts = _chat_prompts(body) if kind == "chat" else _completion_prompts(body)
    seed = template.sampling.seed if template.sampling.HasField("seed") else None
    jobs = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            msg = pb.GenerationInput()
            msg.CopyFrom(template)
            msg.MergeFrom(prompt)
            msg.request_id = uuid.uuid4().hex  # each choice's retries are idempotent
            if seed is not None:
                msg.sampling.seed = (seed + i) % 2**64  # n choices of one seeded request differ
            jobs.append(Job(p * n + i, msg))
    return Parsed(kind, model, jobs, n, stream, include_usage, logprobs, keep_session,
                  _bool(body, "return_token_ids", False), tools, constraint.param if constraint else None)


def _sampling(kind: str, body: dict) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams()
    # OpenAI's default temperature is 1 (sampling); 0 is greedy.
    s.temperature = _float(body, "temperature", 1.0)
    for name in ("top_p", "repetition_penalty"):
        if body.get(name) is not None:
            setattr(s, name, _float(body, name, None))
    s.top_k = max(0, _int(body, "top_k", 0))  # vLLM's -1 means off, as 0 does here
    for name in ("min_p", "presence_penalty", "frequency_penalty"):
        setattr(s, name, _float(body, name, 0.0))
    if body.get("seed") is not None:
        s.seed = _int(body, "seed", None) % 2**64
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise invalid("logit_bias", "must be an object mapping token ids to biases")
    for token, value in bias.items():
        try:
            s.logit_bias[int(token)] = float(value)
        except (TypeError, ValueError):
            raise invalid("logit_bias", f"{token!r}: {value!r} is not a token id and a number") from None
    if kind == "chat":
        top = _int(body, "top_logprobs", None)
        if _bool(body, "logprobs", False):
            s.logprobs = top or 0
        elif top is not None:
            raise invalid("top_logprobs", "needs logprobs: true")
    elif body.get("logprobs") is not None:
        s.logprobs = _int(body, "logprobs", None)
    return s


def _speculation(body: dict, spec: pb.SpeculationParams) -> None:
    """The `speculation` extension: {"method": "model"|"suffix"|"none" ("ngram": "suffix"), "num_speculative_tokens",
    "adaptive", "overlap", "decode_steps"}."""
    given = body.get("speculation") or {}
    if not isinstance(given, dict):
        raise invalid("speculation", "must be an object")
    method = given.get("method", "default")
    if method not in DRAFT_METHODS:
        raise invalid("speculation.method", f"must be one of {', '.join(DRAFT_METHODS)}")
    spec.method = DRAFT_METHODS[method]
    if given.get("num_speculative_tokens") is not None:
        spec.num_speculative_tokens = _int(given, "num_speculative_tokens", None, "speculation.")
    spec.adaptive = _bool(given, "adaptive", False, "speculation.")
    if given.get("overlap") is not None:
        spec.overlap = _bool(given, "overlap", True, "speculation.")
    if given.get("decode_steps") is not None:
        spec.decode_steps = _int(given, "decode_steps", None, "speculation.")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise invalid("stop", "must be a string or a list of strings")


def _chat_prompts(body: dict) -> list[pb.GenerationInput]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list")
    out = pb.GenerationInput()
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", "must be an object")
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for system
            role = "system"
        msg = out.messages.messages.add(role=role if isinstance(role, str) else "")
        if role == "assistant" and m.get("content") is None:  # an assistant's turn of tool calls only
            msg.content = ""
        else:
            msg.content = _content(m.get("content"), i)
        msg.tool_calls.extend(_tool_calls(m.get("tool_calls"), i))
        for name in ("tool_call_id", "name"):
            if m.get(name) is not None:
                setattr(msg, name, _str(m, name, "", f"messages[{i}]."))
    return [out]


def _tool_calls(calls, i: int) -> list[pb.ToolCall]:
    """An assistant message's `tool_calls` (OpenAI's shape) -> ToolCalls (arguments as JSON text)."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise invalid(f"messages[{i}].tool_calls", "must be a list")
    out = []
    for j, call in enumerate(calls):
        param = f"messages[{i}].tool_calls[{j}]"
        f = call.get("function") if isinstance(call, dict) else None
        if not isinstance(f, dict) or call.get("type", "function") != "function" or not isinstance(f.get("name"), str):
            raise invalid(param, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
        arguments = f.get("arguments") or "{}"
        if isinstance(arguments, dict):  # OpenAI's are JSON text; some clients send the object
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise invalid(f"{param}.function.arguments", "must be a string (JSON text)")
        out.append(pb.ToolCall(id=_str(call, "id", "", f"{param}."), name=f["name"], arguments=arguments))
    return out


def _content(content, i: int) -> str:
    """A message's text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"messages[{i}].content", "only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"messages[{i}].content", "must be a string or a list of text parts")


def _completion_prompts(body: dict) -> list[pb.GenerationInput]:
    """A prompt is text, or token ids; a list of them is a batch (one choice set per prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt", "must be a string, a list of token ids, or a non-empty list of either")
    out = []
    for p in prompt:
        msg = pb.GenerationInput()
        if isinstance(p, str):
            msg.prompt = p
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            msg.token_ids.ids.extend(p)
        else:
            raise invalid("prompt", "each prompt must be a string or a non-empty list of token ids")
        out.append(msg)
    return out


def _int(body: dict, name: str, default, prefix: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise invalid(prefix + name, f"must be an integer, got {value!r}")
    return int(value)


def _float(body: dict, name: str, default, prefix: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(prefix + name, f"must be a finite number, got {value!r}")
    return float(value)


def _bool(body: dict, name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(prefix + name, f"must be true or false, got {value!r}")
    return value


def _str(body: dict, name: str, default: str, prefix: str = "") -> str:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise invalid(prefix + name, f"must be a string, got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------
# Responses


def response_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculation(stats: list[pb.SpeculationStats]) -> dict:
    """The `speculation` extension of a response: the choices' speculation stats, summed. Accepted
    counts only draft tokens the target accepted (never the recovered or bonus token)."""
    rounds = sum(s.rounds for s in stats)
    drafted = sum(s.drafted for s in stats)
    accepted = sum(s.accepted for s in stats)
    return {
        "rounds": rounds, "drafted_tokens": drafted, "accepted_tokens": accepted,
        "decoded_tokens": sum(s.decoded for s in stats),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": (accepted + rounds) / rounds if rounds else 0.0,
        "draft_ms": sum(s.draft_ms for s in stats), "verify_ms": sum(s.verify_ms for s in stats),
        "wall_ms": max((s.wall_ms for s in stats), default=0.0),
    }


def _entry(lp: common_pb2.Logprob) -> dict:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode())}


def chat_logprobs(logprobs) -> dict:
    """OpenAI's chat `logprobs` object for some TokenLogprobs."""
    return {"content": [{**_entry(t.chosen), "top_logprobs": [_entry(a) for a in t.top]} for t in logprobs]}


def completion_logprobs(logprobs, offset: int) -> dict:
    """The legacy completions `logprobs` object; offset: characters of text before these tokens."""
    tokens = [t.chosen.token for t in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [t.chosen.logprob for t in logprobs],
            "top_logprobs": [{a.token: a.logprob for a in t.top} for t in logprobs], "text_offset": offsets}


def first_delta(index: int, tool_calls: bool) -> dict:
    """A streamed chat choice's first entry, as OpenAI sends it: the role (and, unless the choice
    may turn out to be tool calls, empty content)."""
    delta = {"role": "assistant"} if tool_calls else {"role": "assistant", "content": ""}
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


def choice(kind: str, index: int, text: str, finish: str | None, logprobs, want_logprobs: bool,
           offset: int = 0, delta: bool = False, tool_names: frozenset[str] | None = None) -> dict:
    """One entry of `choices`: whole (delta=False) or a streamed chunk's. tool_names: the functions
    a whole chat answer is parsed for (calls streamed are `tool_call_choices`')."""
    lp = None
    if want_logprobs:
        lp = chat_logprobs(logprobs) if kind == "chat" else completion_logprobs(logprobs, offset)
    if kind == "completions":
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
    if delta:
        body = {"content": text} if text or not finish else {}
        return {"index": index, "delta": body, "logprobs": lp, "finish_reason": finish}
    message = {"role": "assistant", "content": text}
    if tool_names is not None:
        message["content"], calls = tool_calls.message(text, tool_names)
        if calls:
            message["tool_calls"] = calls
        finish = tool_calls.finish_reason(finish, bool(calls))
    return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}


def tool_call_choices(parser: tool_calls.ToolCallParser, index: int, text: str, finish: str | None, logprobs,
                      want_logprobs: bool, always: bool = False) -> list[dict]:
    """One streamed chunk of a chat choice parsed for tool calls -> its `choices` entries, one event
    each, as OpenAI streams them: content and tool-call deltas, the log-probabilities with the
    first, then the finish reason in an entry of its own. always: at least one entry."""
    deltas = tool_calls.merge(parser.feed(text) + (parser.finish() if finish else []))
    if not deltas and not finish and (always or (want_logprobs and logprobs)):
        deltas = [{}]
    entries = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    if finish:
        entries.append({"index": index, "delta": {}, "logprobs": None,
                        "finish_reason": tool_calls.finish_reason(finish, bool(parser.calls))})
    if want_logprobs and entries:
        entries[0]["logprobs"] = chat_logprobs(logprobs)
    return entries


def envelope(kind: str, rid: str, created: int, model: str, choices: list[dict], stream: bool) -> dict:
    if kind == "chat":
        obj = "chat.completion.chunk" if stream else "chat.completion"
    else:
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
