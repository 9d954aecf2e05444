"""openai_gateway.protocol: OpenAI request bodies -> gRPC inputs, and the response shapes (pure
functions, no server)."""

from __future__ import annotations

import pytest

from openai_gateway import protocol
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
    ({"tools": [{"type": "function"}]}, 400, "tools"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
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
