"""Bad input gets INVALID_ARGUMENT naming the field (never INTERNAL, never a hang), an unknown
session NOT_FOUND, and the service keeps serving afterwards."""

from __future__ import annotations

import math

import grpc
import pytest

from stacks import status_of
from specdec import Client
from specdec.v1 import generation_pb2 as pb

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def client(tiny_stack):
    with Client(tiny_stack.address("coordinator"), timeout_s=60) as c:
        yield c


@pytest.mark.parametrize(
    "prompt, kwargs, field",
    [
        ("", {}, "prompt"),
        ("hi", {"temperature": -0.5}, "sampling.temperature"),
        ("hi", {"temperature": math.nan}, "sampling.temperature"),
        ("hi", {"temperature": math.inf}, "sampling.temperature"),
        ("hi", {"temperature": 1.0, "top_p": 0.0}, "sampling.top_p"),
        ("hi", {"temperature": 1.0, "top_p": 1.5}, "sampling.top_p"),
        ("hi", {"temperature": 1.0, "top_k": -1}, "sampling.top_k"),
        ("hi", {"max_new_tokens": 0}, "max_new_tokens"),
        ("hi", {"max_new_tokens": -3}, "max_new_tokens"),
        ("hi", {"max_new_tokens": 10**6}, "max_new_tokens"),
        ([5, 49152], {}, "token_ids"),
        ([5, -1], {}, "token_ids"),
        ("hi", {"k": 33}, "speculation.num_speculative_tokens"),
        ("hi", {"min_draft_confidence": 1.5}, "speculation.min_draft_confidence"),
        ("hi", {"decode_steps": 65}, "speculation.decode_steps"),
        ("hi", {"decode_steps": -1}, "speculation.decode_steps"),
        ("hi", {"stop": [""]}, "stop"),
        ("hi", {"stop_token_ids": [10**7]}, "stop_token_ids"),
        ([{"role": "wizard", "content": "x"}], {}, "messages[0].role"),
    ],
)
def test_invalid_argument_names_the_field(client, prompt, kwargs, field):
    for call in (client.generate, lambda p, **kw: list(client.stream(p, **kw))):
        code, details = status_of(lambda: call(prompt, **kwargs))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(field + ":"), details


def test_missing_input(client):
    code, details = status_of(lambda: client.stub.Generate(pb.GenerateRequest()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("input:")


def test_unknown_session_is_not_found(client):
    for call in (lambda: client.generate("hi", session_id="no-such-session"),
                 lambda: client.get_session("no-such-session"),
                 lambda: client.end_session("no-such-session")):
        code, details = status_of(call)
        assert code == grpc.StatusCode.NOT_FOUND, details


def test_still_serves_after_bad_input(client):
    assert len(client.generate([1, 2, 3], max_new_tokens=5).token_ids) == 5


def test_oversized_message_is_refused_by_grpc_limits(client):
    huge = "x" * (17 * 1024 * 1024)  # over the 16 MiB receive limit
    code, details = status_of(lambda: client.generate(huge, max_new_tokens=1))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert len(client.generate([1, 2, 3], max_new_tokens=2).token_ids) == 2  # still serving
