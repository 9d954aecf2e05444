"""A request's input checked against the limits before anything reads it further: every oversized
or malformed field is INVALID_ARGUMENT naming the field, at no cost (counts before a list is read,
text lengths before tokenizing)."""

from __future__ import annotations

import json

from coordinator.request import DraftMethod, GenerationRequest, Limits
from coordinator.text import TextCodec
from specdec_core.errors import InvalidArgument
from specdec_core.limits import (
    MAX_DECODE_STEPS,
    MAX_HEAD_TOKENS,
    MAX_SPECULATIVE_TOKENS,
    check_token_ids,
    validate_request_id,
    validate_session_id,
)
from specdec_core.engine.sampling import validate_sampling

ROLES = ("system", "user", "assistant", "tool")
MAX_TOOLS = 128  # functions a request gives, and calls a message makes (OpenAI's limit on tools)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# Text is bounded per token of the model's context: text longer than CHARS_PER_TOKEN characters for
# every token of the context could not fit in it.
CHARS_PER_TOKEN = 32


def validate_request(req: GenerationRequest, limits: Limits, codec: TextCodec) -> None:
    _validate_input(req, limits, codec)
    _validate_ids("stop_token_ids", req.stop_token_ids, MAX_STOP_TOKEN_IDS, limits.vocab_size)
    _validate_stop(req.stop)
    validate_sampling(req.sampling, vocab_size=limits.vocab_size)
    if req.max_new_tokens is not None and req.max_new_tokens < 1:
        raise InvalidArgument("max_new_tokens", f"must be >= 1, got {req.max_new_tokens}")
    _validate_speculation(req, limits)
    _validate_tools(req.tools, req.messages is not None, limits.max_context)
    if req.session_id:  # empty: a new session
        validate_session_id(req.session_id)
    if req.request_id:
        validate_request_id(req.request_id)


def _validate_input(req: GenerationRequest, limits: Limits, codec: TextCodec) -> None:
    max_chars = limits.max_context * CHARS_PER_TOKEN
    per_context = f"{CHARS_PER_TOKEN} per token of the {limits.max_context}-token context"
    if all(x is None for x in (req.prompt, req.messages, req.token_ids)):
        raise InvalidArgument("input", "one of prompt, messages or token_ids is required")
    if req.prompt is not None:
        if not req.prompt:
            raise InvalidArgument("prompt", "must not be empty")
        if len(req.prompt) > max_chars:
            raise InvalidArgument("prompt", f"{len(req.prompt)} characters; at most {max_chars} ({per_context})")
    if req.messages is not None:
        _validate_messages(req.messages, limits.max_context, codec)
        size = sum(len(m["content"]) for m in req.messages)
        if size > max_chars:
            raise InvalidArgument("messages", f"{size} characters of content; at most {max_chars} ({per_context})")
    if req.token_ids is not None:
        if not req.token_ids:
            raise InvalidArgument("token_ids", "must not be empty")
        _validate_ids("token_ids", req.token_ids, limits.max_context, limits.vocab_size)


def _validate_messages(messages: list[dict], max_context: int, codec: TextCodec) -> None:
    if not messages:
        raise InvalidArgument("messages", "must not be empty")
    if len(messages) > max_context:
        raise InvalidArgument("messages", f"{len(messages)} messages; at most {max_context}, "
                                          "the model's context in tokens")
    if not codec.has_chat_template:
        raise InvalidArgument("messages", f"the tokenizer {codec.name} has no chat template")
    max_chars = max_context * CHARS_PER_TOKEN
    tool_chars = 0
    for i, m in enumerate(messages):
        if m["role"] not in ROLES:
            raise InvalidArgument(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")
        calls = m.get("tool_calls", [])
        if calls and m["role"] != "assistant":
            raise InvalidArgument(f"messages[{i}].tool_calls", "only an assistant message makes tool calls")
        if len(calls) > MAX_TOOLS:
            raise InvalidArgument(f"messages[{i}].tool_calls", f"{len(calls)} calls; at most {MAX_TOOLS}")
        for j, c in enumerate(calls):
            if not c["name"]:
                raise InvalidArgument(f"messages[{i}].tool_calls[{j}].name", "must not be empty")
            tool_chars += len(c["id"]) + len(c["name"]) + len(c["arguments"])
        if (m["role"] == "tool") != bool(m.get("tool_call_id")):
            raise InvalidArgument(f"messages[{i}].tool_call_id", "a tool message, and only a tool message, "
                                                                 "names the call it answers")
        tool_chars += len(m.get("tool_call_id", "")) + len(m.get("name", ""))
    if tool_chars > max_chars:
        raise InvalidArgument("messages", f"{tool_chars} characters of tool calls; at most {max_chars}")


def _validate_tools(tools: list[dict] | None, has_messages: bool, max_context: int) -> None:
    """Functions the model may call: only with messages, named once each, parameters a JSON object
    (the constraint built from them is checked as any constraint is)."""
    if not tools:
        return
    if not has_messages:
        raise InvalidArgument("tools", "only with messages (the chat template renders them)")
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument("tools", f"{len(tools)} tools; at most {MAX_TOOLS}")
    size = sum(len(t["name"]) + len(t["description"]) + len(t["parameters"]) for t in tools)
    if size > max_context * CHARS_PER_TOKEN:
        raise InvalidArgument("tools", f"{size} characters; at most {max_context * CHARS_PER_TOKEN}")
    names = set()
    for i, t in enumerate(tools):
        if not t["name"] or t["name"] in names:
            raise InvalidArgument(f"tools[{i}].name", "must be given, and differ from the other tools'")
        names.add(t["name"])
        try:
            parameters = json.loads(t["parameters"]) if t["parameters"] else {}
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"tools[{i}].parameters", f"is not JSON: {exc}") from None
        if not isinstance(parameters, dict):
            raise InvalidArgument(f"tools[{i}].parameters", "must be a JSON schema (an object)")


def _validate_stop(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("stop", f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS}")
    for i, s in enumerate(stop):
        if not s:
            raise InvalidArgument("stop", "stop strings must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidArgument("stop", f"stop string {i} has {len(s)} characters; at most {MAX_STOP_CHARS}")


def _validate_speculation(req: GenerationRequest, limits: Limits) -> None:
    k = req.num_speculative_tokens
    if req.method is DraftMethod.HEAD and not limits.has_head:
        raise InvalidArgument("speculation.method", "head: the target workers have no draft head (their --head)")
    if req.method is DraftMethod.HEAD and k is not None and k > MAX_HEAD_TOKENS:
        raise InvalidArgument("speculation.num_speculative_tokens", f"at most {MAX_HEAD_TOKENS} with the head, got {k}")
    if not 0.0 <= req.min_draft_confidence < 1.0:  # also rejects NaN
        raise InvalidArgument("speculation.min_draft_confidence", f"must be in [0, 1), got {req.min_draft_confidence}")
    if k is not None and not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise InvalidArgument("speculation.num_speculative_tokens", f"must be in 0..{MAX_SPECULATIVE_TOKENS}, got {k}")
    if req.decode_steps is not None and not 0 <= req.decode_steps <= MAX_DECODE_STEPS:
        raise InvalidArgument("speculation.decode_steps", f"must be in 0..{MAX_DECODE_STEPS}, got {req.decode_steps}")


def _validate_ids(name: str, ids: list[int], max_count: int, vocab_size: int) -> None:
    if len(ids) > max_count:
        raise InvalidArgument(name, f"{len(ids)} ids; at most {max_count}")
    check_token_ids(name, ids, vocab_size)
