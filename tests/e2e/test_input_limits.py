"""Oversized and hostile input is refused with INVALID_ARGUMENT naming the field and the limit,
before any work: counts are checked before a list is read, text lengths before tokenizing, and a
malformed session id is refused by the coordinator and by both workers."""

from __future__ import annotations

import time
import types

import grpc
import pytest
import redis

from coordinator.generation import Generation
from coordinator.request import GenerationRequest, Limits
from coordinator.validation import CHARS_PER_TOKEN, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from stacks import status_of
from specdec import Client
from specdec.client import build_input
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.v1 import generation_pb2 as pb
from specdec_core.errors import InvalidArgument
from specdec_core.limits import MAX_SESSION_ID_CHARS, validate_session_id

pytestmark = pytest.mark.capacity

CONTEXT = 1024  # the tiny models' max_position_embeddings
MAX_CHARS = CONTEXT * CHARS_PER_TOKEN
BAD_SESSION_IDS = ["a b", "../etc", "specdec:session:x", "a\x00b", "ключ", "x" * (MAX_SESSION_ID_CHARS + 1)]
TEN_MB = 10 * 1024 * 1024


# ---- the validation itself: nothing is read, tokenized or stored before the limits are checked --

class Untouchable:
    """A collaborator that fails the test when a request reaches it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        raise AssertionError(f"{self._name}.{attr} used by a request that is over a limit")


class Unreadable(list):
    """A list whose length may be read, but not its items."""

    def __iter__(self):
        raise AssertionError("the items were read before the count was checked")

    def __getitem__(self, index):
        raise AssertionError("the items were read before the count was checked")


@pytest.fixture(scope="module")
def generation() -> Generation:
    codec = types.SimpleNamespace(name="tiny", has_chat_template=True)  # no encode_*: tokenizing fails
    return Generation(Untouchable("store"), codec, Untouchable("proposer"), Untouchable("suffix"),
                      Untouchable("verifier"), Limits(vocab_size=49152, max_context=CONTEXT,
                                                      default_max_new_tokens=8, default_k=4))


def refused(generation: Generation, **request) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as err:
        next(generation.run(GenerationRequest(**request)))
    return err.value


@pytest.mark.parametrize(
    "request_, field, limit",
    [
        (dict(prompt="hi", stop=Unreadable(["stop"] * (TEN_MB // 5))), "stop", MAX_STOP_STRINGS),  # a 10 MB list
        (dict(prompt="hi", stop=["x" * TEN_MB]), "stop", MAX_STOP_CHARS),
        (dict(prompt="hi", stop=Unreadable(["x"] * (MAX_STOP_STRINGS + 1))), "stop", MAX_STOP_STRINGS),
        (dict(prompt="hi", stop=["x"] * 3 + ["x" * (MAX_STOP_CHARS + 1)]), "stop", MAX_STOP_CHARS),
        (dict(prompt="hi", stop_token_ids=Unreadable([1] * (MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids",
         MAX_STOP_TOKEN_IDS),
        (dict(prompt="x" * (MAX_CHARS + 1)), "prompt", MAX_CHARS),
        (dict(token_ids=Unreadable([1] * (CONTEXT + 1))), "token_ids", CONTEXT),
        (dict(messages=Unreadable([{"role": "user", "content": "x"}] * (CONTEXT + 1))), "messages", CONTEXT),
        (dict(messages=[{"role": "user", "content": "x" * (MAX_CHARS // 2 + 1)}] * 2), "messages", MAX_CHARS),
        *[(dict(prompt="hi", session_id=s), "session_id", MAX_SESSION_ID_CHARS) for s in BAD_SESSION_IDS],
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_over_a_limit_is_refused_before_any_work(generation, request_, field, limit):
    err = refused(generation, **request_)
    assert err.field == field, err
    assert f"{limit}" in str(err), err


def test_at_the_limits_is_accepted(generation):
    """Exactly at every limit, validation passes and the request goes on to the store."""
    with pytest.raises(AssertionError, match="store"):
        next(generation.run(GenerationRequest(
            prompt="x" * MAX_CHARS, stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS,
            stop_token_ids=[1] * MAX_STOP_TOKEN_IDS, session_id="x" * MAX_SESSION_ID_CHARS)))


@pytest.mark.parametrize("session_id", ["0123456789abcdef0123456789abcdef", "6f1c2a9e-4b7d-4c1e-9f3a-2d8e5b7c1a0f",
                                        "my_session-1", "x"])
def test_session_id_format_accepts_what_clients_use(session_id):
    validate_session_id(session_id)


@pytest.mark.parametrize("session_id", ["", *BAD_SESSION_IDS])
def test_session_id_format_refuses_the_rest(session_id):
    with pytest.raises(InvalidArgument) as err:
        validate_session_id(session_id)
    assert err.value.field == "session_id"


# ---- through the running services ----------------------------------------------------------------

@pytest.fixture(scope="module")
def client(tiny_stack):
    with Client(tiny_stack.address("coordinator"), timeout_s=60) as c:
        assert c.describe().target.max_context == CONTEXT
        yield c


@pytest.mark.e2e
@pytest.mark.parametrize(
    "prompt, kwargs, field, limit",
    [
        ("hi", {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop", MAX_STOP_STRINGS),
        ("hi", {"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop", MAX_STOP_CHARS),
        ("hi", {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids", MAX_STOP_TOKEN_IDS),
        ("x" * (MAX_CHARS + 1), {}, "prompt", MAX_CHARS),
        ([7] * (CONTEXT + 1), {}, "token_ids", CONTEXT),
        ([{"role": "user", "content": "x"}] * (CONTEXT + 1), {}, "messages", CONTEXT),
        ([{"role": "user", "content": "x" * (MAX_CHARS // 2 + 1)}] * 2, {}, "messages", MAX_CHARS),
        *[("hi", {"session_id": s}, "session_id", MAX_SESSION_ID_CHARS) for s in BAD_SESSION_IDS],
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 20 else None,
)
def test_each_limit_is_invalid_argument_naming_the_field(client, prompt, kwargs, field, limit):
    for call in (client.generate, lambda p, **kw: list(client.stream(p, **kw))):
        code, details = status_of(lambda: call(prompt, max_new_tokens=2, **kwargs))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(field + ":") and f"{limit}" in details, details


@pytest.mark.e2e
@pytest.mark.parametrize("session_id", ["", *BAD_SESSION_IDS])
def test_get_and_end_session_check_the_id(client, session_id):
    for call in (client.get_session, client.end_session):
        code, details = status_of(lambda: call(session_id))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith("session_id:"), details


def session_keys(stack) -> int:
    return sum(1 for _ in redis.Redis.from_url(stack.redis_url).scan_iter("specdec:session:*"))


@pytest.mark.e2e
@pytest.mark.parametrize("stop", [["sixteen chars..."] * (TEN_MB // 16), ["x" * TEN_MB]], ids=["many", "long"])
def test_a_10_mb_stop_list_is_refused_at_once(tiny_stack, client, stop):
    request = pb.GenerateRequest(input=build_input("hi", max_new_tokens=2, stop=stop))
    assert TEN_MB <= request.ByteSize() < 16 * 1024 * 1024  # under gRPC's message limit: it reaches us
    sessions = session_keys(tiny_stack)
    started = time.monotonic()
    code, details = status_of(lambda: client.stub.Generate(request, timeout=30))
    elapsed = time.monotonic() - started
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("stop:"), details
    assert elapsed < 2.0, elapsed
    assert session_keys(tiny_stack) == sessions  # no session was opened
    assert len(client.generate([1, 2, 3], max_new_tokens=2).token_ids) == 2  # still serving


@pytest.mark.e2e
@pytest.mark.parametrize("session_id", ["", *BAD_SESSION_IDS])
def test_workers_check_the_session_id(tiny_stack, session_id):
    with grpc.insecure_channel(tiny_stack.address("target")) as t, \
            grpc.insecure_channel(tiny_stack.address("draft")) as d:
        target, draft = target_pb2_grpc.TargetStub(t), draft_pb2_grpc.DraftStub(d)
        for call in (
            lambda: target.Verify(target_pb2.VerifyRequest(session_id=session_id, committed_ids=[1, 2]), timeout=10),
            lambda: target.ReleaseTargetCache(target_pb2.ReleaseTargetCacheRequest(session_id=session_id), timeout=10),
            lambda: draft.Propose(draft_pb2.ProposeRequest(session_id=session_id, committed_ids=[1, 2], num_tokens=2),
                                  timeout=10),
            lambda: draft.ReleaseDraftCache(draft_pb2.ReleaseDraftCacheRequest(session_id=session_id), timeout=10),
        ):
            code, details = status_of(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert details.startswith("session_id:"), details


@pytest.mark.e2e
@pytest.mark.parametrize("request_fields, field", [
    ({"decode_steps": 65}, "decode_steps"),
    ({"decode_steps": -2}, "decode_steps"),
    ({"decode_steps": 3, "stop_token_ids": [49152]}, "stop_token_ids"),
])
def test_the_target_checks_decoding_steps(tiny_stack, request_fields, field):
    with grpc.insecure_channel(tiny_stack.address("target")) as channel:
        target = target_pb2_grpc.TargetStub(channel)
        code, details = status_of(lambda: target.Verify(
            target_pb2.VerifyRequest(session_id="s", committed_ids=[1, 2], **request_fields), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith(field + ":"), details
