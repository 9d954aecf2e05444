"""specdec.Client and build_input: the request each call sends carries every field of the public API
(checked on the built proto, through a stand-in stub: no server)."""

from __future__ import annotations

import json

import grpc
import pytest

from specdec import Client
from specdec.client import build_constraint, build_input
from specdec.v1 import common_pb2
from specdec.v1 import generation_pb2 as pb

SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
          "required": ["colour"]}


class Colour:
    """Stands in for a pydantic model class (the client must not need pydantic)."""

    @classmethod
    def model_json_schema(cls) -> dict:
        return SCHEMA


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


class FakeStub:
    """Records every request; answers with one token (and its logprobs), after `failures` UNAVAILABLEs."""

    def __init__(self, failures: int = 0):
        self.failures = failures
        self.requests: list = []

    def _attempt(self, request):
        self.requests.append(request)
        if self.failures:
            self.failures -= 1
            raise Unavailable()

    def Generate(self, request, timeout=None):
        self._attempt(request)
        lp = common_pb2.TokenLogprobs(chosen=common_pb2.Logprob(token_id=7, logprob=-0.5))
        return pb.GenerateResponse(session_id="s1", text="x", token_ids=[7], finish_reason=pb.FINISH_REASON_LENGTH,
                                   logprobs=[lp])

    def GenerateStream(self, request, timeout=None):
        self._attempt(request)
        yield pb.GenerateStreamResponse(session_id="s1", text="x", token_ids=[7], finish_reason=pb.FINISH_REASON_LENGTH)


@pytest.fixture
def client():
    with Client("localhost:1", retry_s=5.0) as c:  # the channel connects lazily: never, here
        c.stub = FakeStub()
        yield c


def sent(client) -> pb.GenerationInput:
    (request,) = client.stub.requests
    return request.input


def test_a_one_shot_generate_ends_its_session(client):
    client.generate("Hi", max_new_tokens=4, end_session=True)
    assert sent(client).end_session


def test_a_generate_keeps_its_session_unless_asked(client):
    client.generate("Hi", max_new_tokens=4)
    assert not sent(client).end_session


def test_stream_sends_the_same_fields_as_generate(client):
    chunks = list(client.stream("Hi", end_session=True, regex="[a-z]+", tools=[{"name": "f"}], session_id="s0"))
    assert [c.text for c in chunks] == ["x"]
    msg = sent(client)
    assert msg.end_session and msg.session_id == "s0" and msg.sampling.constraint.regex == "[a-z]+"
    assert [t.name for t in msg.tools] == ["f"]


def test_every_sampling_field_reaches_the_request(client):
    client.generate("Hi", temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=2**64 - 1, presence_penalty=0.5,
                    frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={42: -100.0, 7: 2.5}, logprobs=3)
    s = sent(client).sampling
    assert (s.temperature, s.top_p, s.min_p, s.repetition_penalty) == pytest.approx((0.7, 0.9, 0.05, 1.2))
    assert (s.top_k, s.seed, s.logprobs, s.presence_penalty, s.frequency_penalty) == (20, 2**64 - 1, 3, 0.5, -0.5)
    assert dict(s.logit_bias) == {42: -100.0, 7: 2.5}


def test_unset_optional_fields_stay_unset():
    msg = build_input("Hi")
    s = msg.sampling
    assert not any(s.HasField(f) for f in ("temperature", "top_p", "seed", "repetition_penalty", "logprobs",
                                           "constraint"))
    assert not msg.HasField("max_new_tokens") and not msg.end_session and not msg.tools
    assert not any(msg.speculation.HasField(f) for f in ("num_speculative_tokens", "overlap", "decode_steps"))


def test_length_stopping_speculation_and_session_fields_reach_the_request(client):
    client.generate([1, 2, 3], max_new_tokens=9, stop=["END"], stop_token_ids=[5, 6], draft="suffix", k=6,
                    adaptive=True, overlap=False, min_draft_confidence=0.25, decode_steps=0, session_id="s0",
                    request_id="req-1")
    msg = sent(client)
    assert list(msg.token_ids.ids) == [1, 2, 3] and msg.max_new_tokens == 9
    assert list(msg.stop) == ["END"] and list(msg.stop_token_ids) == [5, 6]
    sp = msg.speculation
    assert (sp.method, sp.num_speculative_tokens, sp.adaptive) == (pb.DRAFT_METHOD_SUFFIX, 6, True)
    assert sp.HasField("overlap") and not sp.overlap and sp.HasField("decode_steps") and sp.decode_steps == 0
    assert sp.min_draft_confidence == pytest.approx(0.25)
    assert (msg.session_id, msg.request_id) == ("s0", "req-1")


def test_a_retried_call_resends_its_request_id_and_each_call_gets_a_fresh_one(client):
    client.stub = FakeStub(failures=1)
    result = client.generate("Hi", json_object=True, end_session=True)
    first, retry = client.stub.requests
    assert first.input.request_id and retry == first  # the same request, request id included
    assert retry.input.sampling.constraint.json_object and retry.input.end_session
    client.generate("Hi")
    assert client.stub.requests[2].input.request_id != first.input.request_id
    assert [lp.chosen.logprob for lp in result.logprobs] == [-0.5]  # Result carries the logprobs


@pytest.mark.parametrize("kwargs,kind,value", [
    ({"json_schema": SCHEMA}, "json_schema", SCHEMA),
    ({"json_schema": json.dumps(SCHEMA, indent=2)}, "json_schema", SCHEMA),
    ({"json_schema": Colour}, "json_schema", SCHEMA),
    ({"json_object": True}, "json_object", True),
    ({"regex": r"\d{3}-\d{4}"}, "regex", r"\d{3}-\d{4}"),
    ({"choice": ["yes", "no"]}, "choice", ["yes", "no"]),
    ({"grammar": 'start: "a"+'}, "grammar", 'start: "a"+'),
])
def test_each_constraint_reaches_the_request(client, kwargs, kind, value):
    client.generate("Hi", **kwargs)
    constraint = sent(client).sampling.constraint
    assert constraint.WhichOneof("kind") == kind
    got = getattr(constraint, kind)
    if kind == "json_schema":
        got = json.loads(got)
    elif kind == "choice":
        got = list(got.choices)
    assert got == value


def test_a_json_schema_text_is_sent_as_written():
    text = '{"type":  "integer", "minimum": 0}'
    assert build_input("Hi", json_schema=text).sampling.constraint.json_schema == text


def test_a_pydantic_model_is_sent_as_its_json_schema():
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: float | None = None

    sent_schema = json.loads(build_input("Hi", json_schema=Point).sampling.constraint.json_schema)
    assert sent_schema == Point.model_json_schema() and sent_schema["required"] == ["x"]


def test_two_constraints_are_refused_naming_both():
    with pytest.raises(ValueError, match="json_schema and regex"):
        build_input("Hi", json_schema=SCHEMA, regex="a+")
    with pytest.raises(ValueError, match="json_object and choice"):
        build_constraint(json_object=True, choice=["a"])


def test_no_constraint_unless_asked():
    assert build_constraint() is None and build_constraint(json_object=False) is None


def test_malformed_constraints_are_refused_before_sending():
    with pytest.raises(TypeError, match="choice"):
        build_input("Hi", choice="yes")  # a string, not a list of them
    with pytest.raises(TypeError, match="json_schema"):
        build_input("Hi", json_schema=42)
    with pytest.raises(TypeError, match="regex"):
        build_input("Hi", regex=3)


def test_tools_in_openais_shape_and_flat():
    tools = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city.",
                                               "parameters": SCHEMA, "strict": True}},
             {"name": "now", "parameters": '{"type": "object"}'},
             {"name": "colour", "parameters": Colour},
             pb.Tool(name="raw")]
    msg = build_input([{"role": "user", "content": "Hi"}], tools=tools)
    assert [(t.name, t.description) for t in msg.tools] == [("weather", "Weather in a city."), ("now", ""),
                                                             ("colour", ""), ("raw", "")]
    assert json.loads(msg.tools[0].parameters) == SCHEMA and msg.tools[1].parameters == '{"type": "object"}'
    assert json.loads(msg.tools[2].parameters) == SCHEMA and msg.tools[3].parameters == ""
    with pytest.raises(ValueError, match="only function tools"):
        build_input("Hi", tools=[{"type": "code_interpreter"}])
    with pytest.raises(ValueError, match="name"):
        build_input("Hi", tools=[{"description": "nameless"}])


def test_messages_with_tool_calls_in_openais_shape_and_the_protos():
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "refusal": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "weather", "content": "18 C"},
        {"role": "assistant", "tool_calls": [{"id": "call_2", "name": "weather", "arguments": {"city": "Oslo"}}]},
    ]
    msgs = build_input(conversation).messages.messages
    assert [(m.role, m.content) for m in msgs] == [("user", "Weather in Paris?"), ("assistant", ""),
                                                   ("tool", "18 C"), ("assistant", "")]
    assert [(c.id, c.name, json.loads(c.arguments)) for c in msgs[1].tool_calls] == [
        ("call_1", "weather", {"city": "Paris"})]
    assert (msgs[2].tool_call_id, msgs[2].name) == ("call_1", "weather")
    assert [(c.id, json.loads(c.arguments)) for c in msgs[3].tool_calls] == [("call_2", {"city": "Oslo"})]
    assert build_input([pb.ChatMessage(role="user", content="x")]).messages.messages[0].content == "x"
    with pytest.raises(ValueError, match="unknown fields"):
        build_input([{"role": "user", "content": "x", "contnet": "typo"}])


def test_the_chat_flag_and_raw_text():
    assert build_input("Hi").prompt == "Hi"
    msgs = build_input("Hi", chat=True).messages.messages
    assert [(m.role, m.content) for m in msgs] == [("user", "Hi")]
