"""`specdec generate`: the request its flags build (through a stand-in client: no server)."""

from __future__ import annotations

import json

import pytest

from specdec import cli
from specdec.client import build_input
from specdec.v1 import common_pb2
from specdec.v1 import generation_pb2 as pb

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"]}


class FakeClient:
    """Builds each request as the real client would and records it; answers one chunk."""

    sent: list[pb.GenerationInput] = []

    def __init__(self, address, **_):
        self.address = address

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def stream(self, prompt, **kwargs):
        FakeClient.sent.append(build_input(prompt, **kwargs))
        lp = common_pb2.TokenLogprobs(chosen=common_pb2.Logprob(token_id=7, logprob=-0.25, token="yes"),
                                      top=[common_pb2.Logprob(token_id=8, logprob=-1.5, token="no")])
        yield pb.GenerateStreamResponse(session_id="s1", text="yes", token_ids=[7], logprobs=[lp],
                                        finish_reason=pb.FINISH_REASON_STOP_TOKEN, usage=pb.Usage(completion_tokens=1))

    def end_session(self, session_id):
        raise AssertionError("the CLI ends a session in its request, not with a second call")


@pytest.fixture
def generate(monkeypatch):
    monkeypatch.setattr(cli, "Client", FakeClient)
    FakeClient.sent = []

    def run(*argv: str) -> pb.GenerationInput:
        assert cli.main(["generate", *argv]) == 0
        (msg,) = FakeClient.sent
        FakeClient.sent = []
        return msg

    return run


def refused(*argv: str) -> int:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", *argv])
    return exit_.value.code


def test_a_one_shot_generate_ends_its_session(generate):
    msg = generate("Hi")
    assert msg.end_session and not msg.session_id
    assert [(m.role, m.content) for m in msg.messages.messages] == [("user", "Hi")]


@pytest.mark.parametrize("flags,end", [
    ((), True),
    (("--keep-session",), False),
    (("--session", "s0"), False),
    (("--session", "s0", "--end-session"), True),
    (("--end-session",), True),
])
def test_which_sessions_end(generate, flags, end):
    msg = generate("Hi", *flags)
    assert msg.end_session is end
    assert msg.session_id == ("s0" if "--session" in flags else "")


def test_keep_and_end_are_exclusive():
    assert refused("Hi", "--keep-session", "--end-session") == 2


@pytest.mark.parametrize("flags,kind,value", [
    (("--json-object",), "json_object", True),
    (("--regex", "[0-9]+"), "regex", "[0-9]+"),
    (("--choice", "yes", "--choice", "no, thanks"), "choice", ["yes", "no, thanks"]),
    (("--grammar", 'start: "a"+'), "grammar", 'start: "a"+'),
    (("--json-schema", json.dumps(SCHEMA)), "json_schema", SCHEMA),
])
def test_each_constraint_flag(generate, flags, kind, value):
    constraint = generate("Hi", *flags).sampling.constraint
    assert constraint.WhichOneof("kind") == kind
    got = getattr(constraint, kind)
    assert (json.loads(got) if kind == "json_schema" else list(got.choices) if kind == "choice" else got) == value


def test_schema_and_grammar_files(generate, tmp_path):
    schema = tmp_path / "n.schema.json"
    schema.write_text(json.dumps(SCHEMA, indent=1))
    assert generate("Hi", "--json-schema", str(schema)).sampling.constraint.json_schema == schema.read_text()
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    assert generate("Hi", "--grammar", str(grammar)).sampling.constraint.grammar == 'root ::= "yes" | "no"\n'


def test_a_schema_that_is_neither_a_file_nor_json_is_refused(capsys):
    assert refused("Hi", "--json-schema", "{not json") == 2
    assert "--json-schema" in capsys.readouterr().err


def test_two_constraints_are_refused(capsys):
    assert refused("Hi", "--regex", "a+", "--choice", "a") == 2
    assert "not allowed with" in capsys.readouterr().err


def test_the_other_request_fields(generate, capsys):
    msg = generate("Hi", "--stop-token-id", "5", "--stop-token-id", "9", "--request-id", "req-7",
                   "--logit-bias", "42=-100", "--logit-bias", "7=1.5", "--logprobs", "2", "--stop", "END",
                   "--max-new-tokens", "8", "--min-p", "0.1", "--seed", "3", "--draft", "suffix", "-k", "5",
                   "--no-overlap", "--decode-steps", "0")
    assert list(msg.stop_token_ids) == [5, 9] and msg.request_id == "req-7" and list(msg.stop) == ["END"]
    assert dict(msg.sampling.logit_bias) == {42: -100.0, 7: 1.5} and msg.sampling.logprobs == 2
    assert msg.max_new_tokens == 8 and msg.sampling.seed == 3 and msg.sampling.min_p == pytest.approx(0.1)
    sp = msg.speculation
    assert (sp.method, sp.num_speculative_tokens, sp.overlap, sp.decode_steps) == (pb.DRAFT_METHOD_SUFFIX, 5, False, 0)
    assert sp.HasField("overlap") and sp.HasField("decode_steps")
    err = capsys.readouterr().err
    assert "'yes'\t-0.2500\t| 'no' -1.500" in err  # --logprobs prints each token's


def test_tools_and_messages(generate, tmp_path):
    tool = {"type": "function", "function": {"name": "weather", "description": "Weather in a city.",
                                             "parameters": SCHEMA}}
    tool_file = tmp_path / "weather.json"
    tool_file.write_text(json.dumps(tool))
    conversation = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    msg = generate("And tomorrow?", "--messages", json.dumps(conversation), "--tool", str(tool_file),
                   "--tool", json.dumps([{"name": "now"}]))
    assert [(t.name, t.description) for t in msg.tools] == [("weather", "Weather in a city."), ("now", "")]
    assert json.loads(msg.tools[0].parameters) == SCHEMA
    msgs = msg.messages.messages
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "user"] and msgs[-1].content == "And tomorrow?"
    assert (msgs[1].tool_calls[0].id, msgs[1].tool_calls[0].name, msgs[2].tool_call_id) == ("call_1", "weather",
                                                                                             "call_1")
    assert generate("--messages", json.dumps({"messages": conversation})).messages.messages[-1].role == "tool"


def test_prompt_forms(generate):
    assert generate("Hi", "--raw").prompt == "Hi"
    assert list(generate("1,2 3", "--token-ids").token_ids.ids) == [1, 2, 3]
    assert refused("--raw") != 0  # no prompt
    assert refused("x y", "--token-ids") != 0
