"""Tool calling in the chat API: `tools` / `tool_choice` / `parallel_tool_calls` -> the gRPC request,
and the model's text -> OpenAI's `tool_calls`. Pure functions and one small parser: no I/O.

The model calls a function by writing, Hermes/Qwen style (the coordinator's default rendering of
tools asks for exactly this; templates that take tools, Qwen's and Hermes', ask for it too):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, separated by a newline. With `tool_choice` `auto` the output is parsed and may
hold calls, text, or both; `required` or a named function adds a grammar constraint (`grammar`),
so the output is nothing but such blocks, naming a given function with arguments that validate
against its schema. `none` renders the tools but neither constrains nor parses.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from types import MappingProxyType

from openai_gateway.errors import invalid
from openai_gateway.structured import Structured
from specdec.v1 import common_pb2
from specdec.v1 import generation_pb2 as pb

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
MAX_TOOLS = 128  # OpenAI's
# The arguments inside a constrained call are written compactly, as json.dumps writes them (and as
# the prompt shows them), so that a model cannot wander off into whitespace.
COMPACT = MappingProxyType({"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "})


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict | None  # a JSON schema of an object; None: any object


@dataclass(frozen=True)
class Tools:
    """A chat request's functions and how it lets the model use them."""

    functions: tuple[Function, ...]
    choice: str  # "none", "auto", "required", or the name of the function that must be called
    parallel: bool  # with "required": one call or more (a named function is called once)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

    @property
    def parses(self) -> bool:
        """Whether the output is parsed for calls (all but `none`)."""
        return self.choice != "none"

    def to_proto(self) -> list[pb.Tool]:
        return [pb.Tool(name=f.name, description=f.description,
                        parameters=json.dumps(f.parameters, ensure_ascii=False) if f.parameters is not None else "")
                for f in self.functions]

    def constraint(self, given: Structured | None) -> Structured | None:
        """The request's constraint, given its own (`response_format` and the like) or none:
        `required` / named: calls only; `auto` with a JSON constraint: calls or that JSON."""
        if self.choice == "none":
            return given
        if self.choice == "auto":
            if given is None:
                return None
            if not given.is_json:
                raise invalid(f"tool_choice, {given.param}", "tools with a regex, choice or grammar constraint "
                                                             "need tool_choice none")
            c = given.constraint
            schema = c.json_schema if c.WhichOneof("kind") == "json_schema" else '{"type": "object"}'
            return Structured(common_pb2.Constraint(grammar=grammar(self.functions, self.parallel, schema)),
                              given.param)
        if given is not None:
            raise invalid(f"tool_choice, {given.param}", "a required tool call excludes an output constraint")
        if self.choice == "required":
            return Structured(common_pb2.Constraint(grammar=grammar(self.functions, self.parallel)), "tools")
        named = tuple(f for f in self.functions if f.name == self.choice)
        return Structured(common_pb2.Constraint(grammar=grammar(named, parallel=False)), "tools")


def parse_tools(body: dict) -> Tools | None:
    """The body's tools, or None (no tools: `tool_choice` may then only be `none`)."""
    given, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", f"must be true or false, got {parallel!r}")
    if given is None or given == []:
        if choice not in (None, "none"):
            raise invalid("tool_choice", "needs tools")
        return None
    if not isinstance(given, list):
        raise invalid("tools", "must be a list")
    if len(given) > MAX_TOOLS:
        raise invalid("tools", f"{len(given)} tools; at most {MAX_TOOLS}")
    functions = tuple(_function(t, i) for i, t in enumerate(given))
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"tools[{i}].function.name", f"{name!r} is given twice")
    return Tools(functions, _choice(choice, set(names)), parallel)


def _function(tool, i: int) -> Function:
    if not isinstance(tool, dict):
        raise invalid(f"tools[{i}]", "must be an object")
    if tool.get("type") != "function":
        raise invalid(f"tools[{i}].type", f"only function tools are supported, got {tool.get('type')!r}")
    f = tool.get("function")
    if not isinstance(f, dict):
        raise invalid(f"tools[{i}].function", "must be an object")
    name = f.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid(f"tools[{i}].function.name", "must be 1 to 64 letters, digits, underscores or dashes")
    description = f.get("description") or ""
    if not isinstance(description, str):
        raise invalid(f"tools[{i}].function.description", "must be a string")
    parameters = f.get("parameters")
    if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
        raise invalid(f"tools[{i}].function.parameters", "must be a JSON schema of an object")
    return Function(name, description, parameters)


def _choice(choice, names: set[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name in names:
            return name
        raise invalid("tool_choice", f"names the function {name!r}, which is not in tools")
    raise invalid("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name"}}')


def grammar(functions: tuple[Function, ...], parallel: bool, answer_schema: str | None = None) -> str:
    """A Lark grammar (llguidance's, with `%json` schemas) for tool-call blocks only: one, or one or
    more with `parallel`; or, given `answer_schema` (JSON text), that or a JSON answer."""
    lines = ["start: calls | answer" if answer_schema is not None else "start: calls",
             'calls: call ("\\n" call)*' if parallel else "calls: call",
             f"call: {_literal(OPEN + chr(10))} ({' | '.join(f'fn_{i}' for i in range(len(functions)))}) "
             f"{_literal(chr(10) + CLOSE)}"]
    for i, f in enumerate(functions):
        schema = {"type": "object", **(f.parameters or {})}
        schema.setdefault("x-guidance", dict(COMPACT))
        head = "{" + f'"name": {json.dumps(f.name)}, "arguments": '
        lines.append(f"fn_{i}: {_literal(head)} %json{json.dumps(schema, ensure_ascii=False)} {_literal('}')}")
    if answer_schema is not None:
        lines.append(f"answer: %json{answer_schema}")
    return "\n".join(lines) + "\n"


def _literal(text: str) -> str:
    return json.dumps(text)  # a JSON string is a Lark string literal


# ----------------------------------------------------------------------------------------------
# The output


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


class ToolCallParser:
    """Splits a choice's text, fed as it streams, into content and tool calls: OpenAI's chat deltas
    (`{"content"}`, a call's `{"tool_calls": [{index, id, type, function: {name, arguments: ""}}]}`,
    then its `{"tool_calls": [{index, function: {arguments}}]}` pieces).

    A block is a call when its JSON starts `{"name": <a given function>, "arguments": {` (the
    arguments then stream as they come: their raw text, up to the object's closing brace), or,
    failing that, when the whole block is a JSON object with such a name and an `arguments` (or
    `parameters`) object. Anything else is content, the tags included. Text that may be the start
    of `<tool_call>` is held back until the next text decides it; whitespace next to a call is
    dropped. Fed everything at once, it gives the non-streamed answer: both agree by construction.
    """

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.calls: list[ToolCall] = []
        self._state = self._text
        self._buf = ""  # text not yet given out
        self._ws = ""  # whitespace withheld from content: dropped if a call comes next
        self._after_call = False  # drop the whitespace that starts the content after a call
        self._depth, self._in_string, self._escaped = 0, False, False  # the arguments' JSON so far

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        self._buf += text
        while self._state(out):
            pass
        return out

    def finish(self) -> list[dict]:
        out: list[dict] = []
        if self._state == self._text:
            self._content(out, self._buf)
            if not self.calls and self._ws:
                out.append({"content": self._ws})
        elif self._state == self._header:
            self._block(out, self._buf, closed=False)
        self._buf, self._ws = "", ""
        return out

    # Each state takes what it can from _buf; True: it moved to another state, look again.

    def _text(self, out: list[dict]) -> bool:
        i = self._buf.find(OPEN)
        if i >= 0:
            self._content(out, self._buf[:i])
            self._buf, self._state = self._buf[i + len(OPEN):], self._header
            return True
        hold = _partial_suffix(self._buf, OPEN)
        self._content(out, self._buf[:len(self._buf) - hold])
        self._buf = self._buf[len(self._buf) - hold:]
        return False

    def _header(self, out: list[dict]) -> bool:
        m = _HEADER.match(self._buf)
        if m and (name := _json_string(m.group(1))) in self.names:
            self._start_call(out, name)
            self._buf, self._state = self._buf[m.end():], self._arguments
            self._depth, self._in_string, self._escaped = 0, False, False
            return True
        i = self._buf.find(CLOSE)
        if i < 0:
            return False
        self._block(out, self._buf[:i], closed=True)
        self._buf, self._state = self._buf[i + len(CLOSE):], self._text
        return True

    def _arguments(self, out: list[dict]) -> bool:
        """The arguments' raw text, up to the brace that closes their object (or a stray close tag)."""
        buf, i, done = self._buf, 0, False
        while i < len(buf) and not done:
            ch = buf[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                done = self._depth == 0
            elif ch == "<" and CLOSE.startswith(buf[i:i + len(CLOSE)]):
                done = buf.startswith(CLOSE, i)  # malformed: the close tag ends the call; else wait and see
                break
            i += 1
        if i:
            self._add_arguments(out, buf[:i])
        self._buf = buf[i:]
        if done:
            self._state = self._tail
        return done

    def _tail(self, out: list[dict]) -> bool:
        """After the arguments: the rest of the block (`}` and the close tag) is dropped."""
        i = self._buf.find(CLOSE)
        if i < 0:
            self._buf = self._buf[len(self._buf) - _partial_suffix(self._buf, CLOSE):]
            return False
        self._buf, self._state = self._buf[i + len(CLOSE):], self._text
        return True

    def _block(self, out: list[dict], body: str, closed: bool) -> None:
        """A whole block that did not start as a call streams: a call if its JSON says one, else text."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = None
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if isinstance(obj, dict) and obj.get("name") in self.names and isinstance(args, dict):
            self._start_call(out, obj["name"])
            self._add_arguments(out, json.dumps(args, ensure_ascii=False))
        else:
            self._content(out, OPEN + body + (CLOSE if closed else ""))

    def _start_call(self, out: list[dict], name: str) -> None:
        call = ToolCall(len(self.calls), "call_" + uuid.uuid4().hex[:24], name)
        self.calls.append(call)
        self._after_call = True  # the withheld whitespace before it goes too
        out.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})

    def _add_arguments(self, out: list[dict], piece: str) -> None:
        call = self.calls[-1]
        call.arguments += piece
        out.append({"tool_calls": [{"index": call.index, "function": {"arguments": piece}}]})

    def _content(self, out: list[dict], text: str) -> None:
        text = self._ws + text
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            out.append({"content": body})


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper start of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _json_string(inner: str) -> str | None:
    try:
        return json.loads(f'"{inner}"')
    except json.JSONDecodeError:
        return None


def merge(deltas: list[dict]) -> list[dict]:
    """Consecutive deltas of one kind as one: content with content, a call's argument pieces with
    its earlier pieces. A call's header (id, name, arguments "") stays a delta of its own, as OpenAI
    streams it."""
    merged: list[dict] = []
    for d in deltas:
        last = merged[-1] if merged else None
        if last is not None and "content" in d and "content" in last:
            last["content"] += d["content"]
        elif (last is not None and "tool_calls" in d and "tool_calls" in last and "id" not in d["tool_calls"][0]
              and "id" not in last["tool_calls"][0] and last["tool_calls"][0]["index"] == d["tool_calls"][0]["index"]):
            last["tool_calls"][0]["function"]["arguments"] += d["tool_calls"][0]["function"]["arguments"]
        else:
            merged.append(json.loads(json.dumps(d)))  # a copy: merging appends to it
    return merged


def message(text: str, names: frozenset[str]) -> tuple[str | None, list[dict]]:
    """A whole output -> (content, tool_calls): content is None when there are calls and no text."""
    parser = ToolCallParser(names)
    deltas = parser.feed(text) + parser.finish()
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls = [c.to_openai() for c in parser.calls]
    return (content or None) if calls else content, calls


def finish_reason(finish: str | None, calls: bool) -> str | None:
    """OpenAI's: `tool_calls` when the model stopped after calling."""
    return "tool_calls" if finish == "stop" and calls else finish
