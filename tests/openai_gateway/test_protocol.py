"""openai_gateway.protocol: OpenAI request bodies -> gRPC inputs, and the response shapes (pure
functions, no server)."""

from __future__ import annotations

import json
from typing import Literal

import pytest

from openai_gateway import protocol, tools
from openai_gateway.app import model_name, rpc_error
from openai_gateway.protocol import RequestError
from specdec.v1 import generation_pb2 as pb

pytestmark = pytest.mark.openai

MODEL = "SmolLM2"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


def parse(kind="chat", **body):
    return protocol.parse(kind, {**(CHAT if kind == "chat" else {"model": MODEL, "prompt": "Hi"}), **body}, MODEL)


def refused(kind="chat", **body) -> RequestError:
    with pytest.raises(RequestError) as err:
        parse(kind, **body)
    return err.value


def test_chat_maps_onto_one_generation_input():
    p = parse(max_tokens=7, temperature=0.3, top_p=0.9, seed=5, stop="END", presence_penalty=0.5,
              frequency_penalty=-0.5, logit_bias={"42": -100}, logprobs=True, top_logprobs=3,
              top_k=20, min_p=0.1, repetition_penalty=1.2)
    (job,) = p.jobs
    msg = job.input
    assert [(m.role, m.content) for m in msg.messages.messages] == [("user", "Hi")]
    assert msg.max_new_tokens == 7 and list(msg.stop) == ["END"]
    s = msg.sampling
    assert (s.temperature, s.top_k, s.seed, s.logprobs) == (pytest.approx(0.3), 20, 5, 3)
    assert (s.top_p, s.min_p, s.repetition_penalty) == (pytest.approx(0.9), pytest.approx(0.1), pytest.approx(1.2))
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.5) and dict(s.logit_bias) == {42: -100.0}
    assert msg.request_id and msg.end_session  # idempotent retries; a one-shot session
    assert p.logprobs == 3 and not p.stream and not p.keep_session


def test_defaults_follow_openai():
    (job,) = parse().jobs
    assert job.input.sampling.temperature == 1.0  # OpenAI samples by default
    assert not job.input.HasField("max_new_tokens") and not job.input.sampling.HasField("logprobs")


def test_n_choices_get_consecutive_seeds_and_their_own_request_ids():
    p = parse(n=3, seed=2**64 - 1)
    assert [j.index for j in p.jobs] == [0, 1, 2]
    assert [j.input.sampling.seed for j in p.jobs] == [2**64 - 1, 0, 1]
    assert len({j.input.request_id for j in p.jobs}) == 3


def test_completions_prompt_forms():
    assert parse("completions", prompt="text").jobs[0].input.prompt == "text"
    assert list(parse("completions", prompt=[1, 2, 3]).jobs[0].input.token_ids.ids) == [1, 2, 3]
    batch = parse("completions", prompt=["a", [4, 5]], n=2)
    assert [(j.index, j.input.WhichOneof("input")) for j in batch.jobs] == [
        (0, "prompt"), (1, "prompt"), (2, "token_ids"), (3, "token_ids")]
    assert parse("completions", logprobs=2).jobs[0].input.sampling.logprobs == 2


def test_sessions_and_speculation_extensions():
    p = parse(session_id="abc", speculation={"method": "ngram", "num_speculative_tokens": 6, "overlap": False,
                                             "decode_steps": 0})
    msg = p.jobs[0].input
    assert msg.speculation.HasField("decode_steps") and msg.speculation.decode_steps == 0
    assert msg.session_id == "abc" and not msg.end_session and p.keep_session
    assert (msg.speculation.method, msg.speculation.num_speculative_tokens) == (pb.DRAFT_METHOD_NGRAM, 6)
    assert msg.speculation.HasField("overlap") and not msg.speculation.overlap
    assert not parse(keep_session=True).jobs[0].input.end_session


@pytest.mark.parametrize("body,status,param", [
    ({"model": "gpt-4o"}, 404, "model"),
    ({"n": 0}, 400, "n"),
    ({"n": 2, "keep_session": True}, 400, "n"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_completion_tokens": 1.5}, 400, "max_completion_tokens"),
    ({"stop": [1]}, 400, "stop"),
    ({"logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"functions": [{"name": "f"}]}, 400, "functions"),
    ({"response_format": {"type": "xml"}}, 400, "response_format.type"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    ({"speculation": {"method": "magic"}}, 400, "speculation.method"),
    ({"stream": "yes"}, 400, "stream"),
])
def test_refused_requests_name_the_parameter(body, status, param):
    err = refused(**body)
    assert (err.status, err.param) == (status, param)
    assert param in err.message or status == 404


def test_completions_refuse_echo_and_bad_prompts():
    assert refused("completions", echo=True).param == "echo"
    assert refused("completions", prompt=[]).param == "prompt"
    assert refused("completions", prompt=[[1], {"a": 1}]).param == "prompt"


def test_text_parts_and_the_developer_role():
    p = parse(messages=[{"role": "developer", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}])
    assert [(m.role, m.content) for m in p.jobs[0].input.messages.messages] == [("system", "Be brief."),
                                                                                   ("user", "Hi there")]


def test_logprob_shapes():
    lp = pb.GenerateResponse(logprobs=[{"chosen": {"token_id": 1, "logprob": -0.5, "token": "Hé"},
                                        "top": [{"token_id": 1, "logprob": -0.5, "token": "Hé"},
                                                {"token_id": 2, "logprob": -1.5, "token": " x"}]}]).logprobs
    chat = protocol.chat_logprobs(lp)
    assert chat == {"content": [{"token": "Hé", "logprob": -0.5, "bytes": list("Hé".encode()), "top_logprobs": [
        {"token": "Hé", "logprob": -0.5, "bytes": list("Hé".encode())},
        {"token": " x", "logprob": -1.5, "bytes": [32, 120]}]}]}
    legacy = protocol.completion_logprobs(list(lp) * 2, offset=10)
    assert legacy == {"tokens": ["Hé", "Hé"], "token_logprobs": [-0.5, -0.5],
                      "top_logprobs": [{"Hé": -0.5, " x": -1.5}] * 2, "text_offset": [10, 12]}


def test_speculation_stats_sum_the_choices():
    stats = [pb.SpeculationStats(rounds=4, drafted=12, accepted=6, draft_ms=10, verify_ms=20, wall_ms=40),
             pb.SpeculationStats(rounds=6, drafted=8, accepted=4, draft_ms=5, verify_ms=30, wall_ms=50, decoded=3)]
    s = protocol.speculation(stats)
    assert (s["rounds"], s["drafted_tokens"], s["accepted_tokens"], s["decoded_tokens"]) == (10, 20, 10, 3)
    assert s["acceptance_rate"] == 0.5 and s["mean_accepted_length"] == 2.0 and s["wall_ms"] == 50


class FakeRpcError:
    """Stands in for grpc.aio.AioRpcError (which needs a channel to be made): code and details."""

    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_grpc_statuses_become_openai_errors():
    import grpc

    assert rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1]")) == (
        400, "sampling.top_p: must be in (0, 1]", "top_p", None)
    assert rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens: 9999 exceeds"))[2] == "max_tokens"
    assert rpc_error(FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "no token"))[:1] == (401,)
    assert rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"))[0] == 429
    assert rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down"))[0] == 503
    assert rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "bug"))[0] == 500


def test_model_names():
    assert model_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert model_name("/tmp/x/target/") == "target"
    assert model_name("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"


# ----------------------------------------------------------------------------------------------
# Structured outputs and tool calling

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def constraint(**body):
    s = parse(**body).jobs[0].input.sampling
    return s.constraint if s.HasField("constraint") else None


@pytest.mark.parametrize("body,kind,value", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", SCHEMA),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_object", True),
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"regex": "a|b", "disable_fallback": True}}, "regex", "a|b"),
    ({"structured_outputs": {"choice": ["x"]}}, "choice", ["x"]),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, "grammar", 'start: "a"'),
    ({"structured_outputs": {"json_object": True}}, "json_object", True),
])
def test_output_constraints_map_onto_the_constraint(body, kind, value):
    c = constraint(**body)
    assert c.WhichOneof("kind") == kind
    got = getattr(c, kind)
    got = json.loads(got) if kind == "json_schema" else list(got.choices) if kind == "choice" else got
    assert got == value
    assert constraint(kind="completions", **body).WhichOneof("kind") == kind  # vLLM takes them on completions too


def test_text_format_and_no_format_are_unconstrained():
    assert constraint(response_format={"type": "text"}) is None and constraint() is None


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format, guided_regex"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "guided_choice, structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.regex, structured_outputs.choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
])
def test_bad_constraints_are_refused_naming_the_parameters(body, param):
    err = refused(**body)
    assert (err.status, err.param) == (400, param) and param in err.message


def test_the_sdks_parse_helper_sends_a_schema_that_compiles():
    """client.chat.completions.parse(response_format=PydanticModel) sends a strict json_schema with
    $defs, $ref, additionalProperties: false and every property required: it maps unchanged and
    llguidance compiles it."""
    import llguidance
    from openai.lib._parsing._completions import type_to_response_format_param
    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: str
        zip: str | None = None

    class Person(BaseModel):
        name: str
        age: int = Field(ge=0, le=150)
        kind: Literal["a", "b"]
        addresses: list[Address]
        manager: Person | None = None

    sent = type_to_response_format_param(Person)
    assert sent["json_schema"]["strict"] and "$defs" in sent["json_schema"]["schema"]
    c = constraint(response_format=sent)
    assert json.loads(c.json_schema) == sent["json_schema"]["schema"]
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(c.json_schema)) == ""


def test_tools_map_onto_the_request_and_auto_parses_without_a_constraint():
    p = parse(tools=[WEATHER, TIME])
    msg = p.jobs[0].input
    assert [(t.name, t.description) for t in msg.tools] == [("get_weather", "The weather in a city."), ("get_time", "")]
    assert json.loads(msg.tools[0].parameters) == WEATHER["function"]["parameters"]
    assert not msg.sampling.HasField("constraint")
    assert p.parses_tool_calls and p.tools.names == {"get_weather", "get_time"} and p.tools.choice == "auto"


def test_tool_choice_none_renders_the_tools_but_neither_constrains_nor_parses():
    p = parse(tools=[WEATHER], tool_choice="none")
    assert len(p.jobs[0].input.tools) == 1 and not p.parses_tool_calls
    assert not p.jobs[0].input.sampling.HasField("constraint")


def test_required_and_named_tool_choice_constrain_to_calls():
    required = parse(tools=[WEATHER, TIME], tool_choice="required")
    grammar = required.jobs[0].input.sampling.constraint.grammar
    assert '"get_weather' in grammar and '"get_time' in grammar and 'call ("\\n" call)*' in grammar
    assert required.constraint_param == "tools"
    single = parse(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert "calls: call\n" in single.jobs[0].input.sampling.constraint.grammar
    named = parse(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    grammar = named.jobs[0].input.sampling.constraint.grammar
    assert "get_time" in grammar and "get_weather" not in grammar and "calls: call\n" in grammar
    assert named.parses_tool_calls


def test_auto_with_a_json_format_constrains_to_calls_or_that_json():
    p = parse(tools=[WEATHER], response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    grammar = p.jobs[0].input.sampling.constraint.grammar
    assert grammar.startswith("start: calls | answer") and f"answer: %json{json.dumps(SCHEMA)}" in grammar
    assert p.constraint_param == "response_format"


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice, response_format"),
    ({"tools": [WEATHER], "guided_regex": "a+"}, "tool_choice, guided_regex"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]}, "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]}, "messages[0].tool_call_id"),
])
def test_bad_tool_requests_are_refused_naming_the_parameter(body, param):
    err = refused(**body)
    assert (err.status, err.param) == (400, param) and param in err.message


def test_tool_calls_and_tool_results_in_the_conversation():
    p = parse(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}])
    user, assistant, tool = p.jobs[0].input.messages.messages
    assert (assistant.role, assistant.content) == ("assistant", "")
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [("call_1", "get_weather", '{"city": "Paris"}')]
    assert (tool.role, tool.content, tool.tool_call_id, tool.name) == ("tool", "sunny", "call_1", "get_weather")
    assert not user.tool_calls and not user.tool_call_id


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
NAMES = frozenset({"get_weather", "get_time"})
UNCLOSED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>\nThen text.'


def calls_of(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = tools.message(text, NAMES)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("text,expected", [
    ("Plain answer.\n", ("Plain answer.\n", [])),
    ("", ("", [])),
    (CALL, (None, [("get_weather", '{"city": "Paris", "days": 2}')])),
    ("\n" + CALL + "\n", (None, [("get_weather", '{"city": "Paris", "days": 2}')])),
    ("Let me check.\n" + CALL, ("Let me check.", [("get_weather", '{"city": "Paris", "days": 2}')])),
    (CALL + "\n" + CALL.replace("get_weather", "get_time").replace('"city": "Paris", "days": 2', ""),
     (None, [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}")])),
    ('<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_weather"}\n</tool_call>',
     (None, [("get_weather", '{"city": "Rome"}')])),  # keys in another order: parsed whole
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
     (None, [("get_weather", '{"city": "Rome"}')])),  # arguments as JSON text
    ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
     ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', [])),  # not a given function: text
    ("<tool_call>not json</tool_call> ok", ("<tool_call>not json</tool_call> ok", [])),
    ("a <tool_ b", ("a <tool_ b", [])),
    ('x {"name": "get_weather"} <tool_call', ('x {"name": "get_weather"} <tool_call', [])),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}b\\"<"}}\n</tool_call>',
     (None, [("get_weather", '{"city": "a}b\\"<"}')])),  # braces and quotes inside strings
    (UNCLOSED, ("Then text.", [("get_weather", '{"city": "Paris"\n')])),  # the close tag ends a call
])
def test_tool_calls_are_parsed_from_the_output(text, expected):
    assert calls_of(text) == expected


def stream(text: str, sizes: list[int]) -> list[dict]:
    """Feed text in pieces of the given sizes (cycled), as chunks arrive; the deltas, merged per chunk."""
    parser, deltas, i, k = tools.ToolCallParser(NAMES), [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        deltas += tools.merge(parser.feed(text[i:i + n]))
        i, k = i + n, k + 1
    return deltas + tools.merge(parser.finish())


def assemble(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:  # a call's first delta (its first piece of arguments merged in, if any)
                assert c["index"] == len(calls) and c["type"] == "function"
                calls[c["index"]] = [c["function"]["name"], c["function"]["arguments"]]
            else:
                calls[c["index"]][1] += c["function"]["arguments"]
    return content if content or not calls else None, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("sizes", [[1], [2, 5], [3], [7, 1, 13]])
def test_streamed_deltas_assemble_to_the_whole_answer(sizes):
    text = "Checking.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo") + "\nDone <tool_ maybe."
    whole = calls_of(text)
    assert whole[1] == [("get_weather", '{"city": "Paris", "days": 2}'), ("get_weather", '{"city": "Oslo", "days": 2}')]
    assert assemble(stream(text, sizes)) == whole
    assert whole[0] == "Checking.Done <tool_ maybe."
    assert assemble(stream(UNCLOSED, sizes)) == calls_of(UNCLOSED)


def test_a_chunks_deltas_are_merged():
    parser = tools.ToolCallParser(NAMES)
    assert tools.merge(parser.feed("a <tool_call>x</tool_call> b")) == [{"content": "a <tool_call>x</tool_call> b"}]


def test_arguments_stream_as_they_are_generated():
    deltas = stream(CALL, [4])
    header = next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]
    assert header["index"] == 0 and header["id"].startswith("call_") and header["function"]["name"] == "get_weather"
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d]
    assert pieces[:2] == ["", '{"c']  # the header alone (arguments ""), as OpenAI streams it, then the pieces
    assert len(pieces) >= 5 and "".join(pieces) == '{"city": "Paris", "days": 2}'
    assert not any("content" in d for d in deltas)


def test_text_that_may_open_a_call_is_held_back():
    parser = tools.ToolCallParser(NAMES)
    assert parser.feed("Sure <tool") == [{"content": "Sure"}]  # " <tool" may be a call's start
    assert parser.feed("box>") == [{"content": " <toolbox>"}]
    assert parser.feed("\n<tool_call>\n") == [] and parser.feed('{"name": "get_weather", "arguments": {') != []


def test_streamed_chunks_follow_openais_shape_and_the_sdk_assembles_them():
    """The events of a streamed answer with calls, read by the openai SDK's own stream accumulator."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    parser = tools.ToolCallParser(NAMES)
    text = CALL + "\n" + CALL.replace("Paris", "Oslo")
    pieces = [text[i:i + 9] for i in range(0, len(text), 9)]
    entries = [protocol.first_delta(0, tool_calls=True)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        entries += protocol.tool_call_choices(parser, 0, piece, "stop" if last else None, [], False)
    assert entries[-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    assert all(e["finish_reason"] is None for e in entries[:-1])
    state = ChatCompletionStreamState()
    for e in entries:
        state.handle_chunk(ChatCompletionChunk.model_validate(
            protocol.envelope("chat", "chatcmpl-1", 0, MODEL, [e], stream=True)))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Oslo", "days": 2})]
    assert len({c.id for c in final.message.tool_calls}) == 2


def test_whole_answers_with_calls():
    entry = protocol.choice("chat", 0, CALL, "stop", [], False, tool_names=NAMES)
    assert entry["finish_reason"] == "tool_calls" and entry["message"]["content"] is None
    (call,) = entry["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    plain = protocol.choice("chat", 0, "Hello", "stop", [], False, tool_names=NAMES)
    assert plain["message"] == {"role": "assistant", "content": "Hello"} and plain["finish_reason"] == "stop"
    cut = protocol.choice("chat", 0, CALL, "length", [], False, tool_names=NAMES)
    assert cut["finish_reason"] == "length"  # OpenAI's reason when the tokens ran out
    unparsed = protocol.choice("chat", 0, CALL, "stop", [], False)  # tool_choice none
    assert unparsed["message"]["content"] == CALL and "tool_calls" not in unparsed["message"]


@pytest.fixture(scope="module")
def matcher():
    """An llguidance matcher for a grammar over SmolLM2's vocabulary: does the grammar accept a text?"""
    import llguidance
    import llguidance.hf

    from specdec_core.engine.models import load_tokenizer
    from tiny_models import ENGINE

    tokenizer = load_tokenizer("smollm2", ENGINE.cache_dir)
    ll = llguidance.hf.from_tokenizer(tokenizer)

    def accepts(grammar: str, text: str) -> bool:
        compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
        assert llguidance.LLMatcher.validate_grammar(compiled, ll) == ""
        m = llguidance.LLMatcher(ll, compiled)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    return accepts


def test_the_call_grammar_compiles_and_accepts_exactly_valid_calls(matcher):
    from coordinator.text import tool_call_text

    grammar = parse(tools=[WEATHER, TIME], tool_choice="required").jobs[0].input.sampling.constraint.grammar
    rendered = tool_call_text("get_weather", '{"city": "Paris", "days": 2}')
    assert rendered == CALL  # the default rendering of a call is what the grammar forces
    assert matcher(grammar, CALL)
    assert matcher(grammar, CALL + "\n" + '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not matcher(grammar, CALL.replace('"city"', '"town"'))  # not in the schema
    assert not matcher(grammar, CALL.replace('"Paris", "days"', '"Paris","days"'))  # written as json.dumps writes
    assert not matcher(grammar, CALL.replace("2}", '"2"}'))  # days is an integer
    assert not matcher(grammar, CALL.replace("get_weather", "get_wether"))
    assert not matcher(grammar, "Sure. " + CALL)
    single = parse(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert not matcher(single.jobs[0].input.sampling.constraint.grammar, CALL + "\n" + CALL)
    either = parse(tools=[WEATHER], response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    grammar = either.jobs[0].input.sampling.constraint.grammar
    assert matcher(grammar, CALL) and matcher(grammar, '{"a": 1}') and not matcher(grammar, '{"b": 1}')


def test_a_pydantic_tool_schema_with_defs_compiles_in_the_call_grammar(matcher):
    from openai import pydantic_function_tool
    from pydantic import BaseModel

    class Item(BaseModel):
        sku: str
        quantity: int

    class Order(BaseModel):
        items: list[Item]
        note: str | None

    tool = pydantic_function_tool(Order)
    assert "$defs" in tool["function"]["parameters"]
    grammar = parse(tools=[tool], tool_choice="required").jobs[0].input.sampling.constraint.grammar
    args = {"items": [{"sku": "a", "quantity": 2}], "note": None}
    assert matcher(grammar, f'<tool_call>\n{{"name": "Order", "arguments": {json.dumps(args)}}}\n</tool_call>')
    assert not matcher(grammar, '<tool_call>\n{"name": "Order", "arguments": {"items": [{"sku": "a"}], '
                                '"note": null}}\n</tool_call>')


def test_constraint_errors_name_the_parameter_they_came_from():
    import grpc

    bad = FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "sampling.constraint.grammar: does not compile")
    assert rpc_error(bad, "tools")[2] == "tools"
    assert rpc_error(bad, "guided_grammar")[2] == "guided_grammar"
    assert rpc_error(bad)[2] == "response_format"
    tool = FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "tools[1].parameters: is not JSON")
    assert rpc_error(tool)[2] == "tools[1].function.parameters"
