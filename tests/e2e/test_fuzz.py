"""Fuzzing the public API of a running coordinator: thousands of random, malformed and hostile
requests (typed protobuf requests built by hypothesis, and raw garbage bytes sent straight to the
methods) must each get an answer within a deadline, never INTERNAL or UNKNOWN, and the
coordinator must still serve a good request afterwards.

Most generated requests are valid or nearly so (each field is usually a sensible value and only
sometimes a hostile one), so that the generation path itself, not only validation, is fuzzed:
continuing live sessions with any kind of input, context-boundary lengths, odd sampling values,
stop strings, unknown enum values. Generation is kept cheap: a tiny random model pair and a
coordinator whose default max_new_tokens is 8; requested lengths are mostly 1..4.

Run: pytest -m fuzz -o addopts="" tests/e2e/test_fuzz.py -s   (prints example counts and timing)
"""

from __future__ import annotations

import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stacks import start_stack
from specdec.v1 import common_pb2
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.fuzz]

VOCAB = 49152  # the SmolLM2 tokenizer of the tiny pair
CONTEXT = 1024  # the tiny models' max_position_embeddings
DEFAULT_MAX_NEW = 8  # the fuzzed coordinator's default, so that unset max_new_tokens stays cheap
CALL_TIMEOUT_S = 30.0  # an answer later than this is a hang
TYPED_EXAMPLES = 1500
GARBAGE_EXAMPLES = 500

# Codes a well-behaved coordinator may answer to arbitrary input. INTERNAL / UNKNOWN are bugs;
# DEADLINE_EXCEEDED means it hung; UNAVAILABLE here (nothing is down) means it crashed.
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}
METHODS = ["Generate", "GenerateStream", "GetSession", "EndSession", "DescribeModels"]

SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example, HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def stack(tiny_pair, tmp_path_factory):
    stack = start_stack(*tiny_pair, tmp_path_factory.mktemp("logs"),
                        args={"coordinator": ["--max-new-tokens", str(DEFAULT_MAX_NEW)]})
    yield stack
    stack.down()


@pytest.fixture(scope="module")
def channel(stack):
    with grpc.insecure_channel(stack.address("coordinator")) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def live_sessions(stub) -> list[str]:
    """Sessions started by each kind of input, for fuzzed requests to continue."""
    inputs = [pb.GenerationInput(token_ids=pb.TokenIds(ids=[5, 6, 7, 8])),
              pb.GenerationInput(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi!")])),
              pb.GenerationInput(prompt="Once upon a time")]
    ids = []
    for i in inputs:
        i.max_new_tokens = 3
        ids.append(stub.Generate(pb.GenerateRequest(input=i), timeout=CALL_TIMEOUT_S).session_id)
    return ids


# ---- strategies --------------------------------------------------------------------------------

INT32 = st.integers(-2**31, 2**31 - 1)
UINT64 = st.integers(0, 2**64 - 1)


def mix(*weighted):
    """One of the strategies, picked with the given integer weights: mix((9, common), (1, rare))."""
    table = [s for w, s in weighted for _ in range(w)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


def repeated(units: list[str], sizes) -> st.SearchStrategy[str]:
    return st.builds(lambda unit, n: unit * n, st.sampled_from(units), sizes)


SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\x00", "\ufffd", "\U0001f642", "\u200b", "\r\n"]
small_text = st.text(max_size=40)
tricky_text = st.lists(st.one_of(st.sampled_from(SPECIAL), st.text(max_size=5)), max_size=8).map("".join)
huge_text = repeated(["a", "hello ", "\U0001f642", "\u00e9", "<|im_start|>user\n", "\x00", " "], st.integers(1000, 40000))
text = mix((10, small_text), (4, tricky_text), (1, huge_text))

valid_id = st.integers(0, VOCAB - 1)
hostile_id = mix((2, INT32), (1, st.sampled_from([-1, VOCAB, VOCAB + 1, 2**31 - 1, -2**31])))


def cheap_long_ids(lengths) -> st.SearchStrategy[list[int]]:
    """Long valid id lists without drawing each element (fast to generate)."""
    return st.builds(lambda start, n: [(start + 7919 * i) % VOCAB for i in range(n)], valid_id, lengths)


token_ids = mix(
    (10, st.lists(valid_id, min_size=1, max_size=24)),
    (1, st.just([])),
    (2, st.lists(mix((4, valid_id), (1, hostile_id)), min_size=1, max_size=8)),
    (1, cheap_long_ids(st.integers(CONTEXT - 12, CONTEXT + 4))),  # at and around the context boundary
    (1, cheap_long_ids(st.integers(2000, 20000))),
)

role = mix((12, st.sampled_from(["user", "system", "assistant"])),
           (1, st.sampled_from(["", "USER", "tool", "function", "developer", " user"])), (1, small_text))
messages = st.lists(st.builds(lambda r, c: pb.ChatMessage(role=r, content=c), role, text), min_size=0, max_size=4)

any_float = st.floats(allow_nan=True, allow_infinity=True)
temperature = mix((4, st.just(0.0)), (6, st.floats(0.0, 3.0)), (1, st.floats(0.0, 1e-30)),
                  (2, any_float), (1, st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0, -1.0, 1e38])))
top_k = mix((6, st.just(0)), (4, st.integers(1, 100)), (1, st.sampled_from([VOCAB - 1, VOCAB, VOCAB + 1])),
            (2, INT32))
top_p = mix((6, st.floats(0.0, 1.0, exclude_min=True)), (1, st.floats(0.0, 1e-30, exclude_min=True)),
            (2, any_float), (1, st.sampled_from([0.0, -0.0, 1.0, 1.0000001, float("nan")])))


@st.composite
def sampling(draw):
    msg = common_pb2.SamplingParams(top_k=draw(top_k))
    if draw(st.booleans()):
        msg.temperature = draw(temperature)
    if draw(st.booleans()):
        msg.top_p = draw(top_p)
    if draw(st.booleans()):
        msg.seed = draw(mix((3, st.integers(0, 1000)), (1, UINT64)))
    return msg


max_new_tokens = mix(
    (24, st.integers(1, 4)),
    (3, st.integers(5, 24)),
    (2, st.none()),  # the coordinator's default (8 here)
    (2, st.integers(-2**31, 0)),
    (2, st.integers(CONTEXT, 2**31 - 1)),  # always beyond the room left in the context
)
num_k = mix((6, st.integers(0, 8)), (2, st.integers(9, 32)), (2, INT32))
method = mix((8, st.sampled_from([0, 1, 2, 3])), (1, INT32))
stop = st.lists(mix((6, small_text.filter(bool)), (2, tricky_text), (1, st.just("")), (1, huge_text)), max_size=3)
stop_token_ids = st.lists(mix((6, valid_id), (1, st.just(2)), (2, hostile_id)), max_size=4)


@st.composite
def generation_input(draw, live: list[str]):
    msg = pb.GenerationInput()
    which = draw(mix((1, st.just(None)), (4, st.just("prompt")), (4, st.just("messages")), (5, st.just("token_ids"))))
    if which == "prompt":
        msg.prompt = draw(mix((1, st.just("")), (8, text)))
    elif which == "messages":
        msg.messages.CopyFrom(pb.ChatMessages(messages=draw(messages)))
    elif which == "token_ids":
        msg.token_ids.ids.extend(draw(token_ids))
    if draw(st.integers(0, 3)):
        msg.sampling.CopyFrom(draw(sampling()))
    n = draw(max_new_tokens)
    if n is not None:
        msg.max_new_tokens = n
    msg.stop.extend(draw(mix((4, st.just([])), (1, stop))))
    msg.stop_token_ids.extend(draw(mix((4, st.just([])), (1, stop_token_ids))))
    if draw(st.integers(0, 2)):
        spec = msg.speculation
        spec.method = draw(method)
        if draw(st.booleans()):
            spec.num_speculative_tokens = draw(num_k)
        spec.adaptive = draw(st.booleans())
    msg.session_id = draw(mix(
        (12, st.just("")),
        (4, st.sampled_from(live)),
        (2, small_text),
        (1, st.text(min_size=129, max_size=300)),
        (1, st.sampled_from(["no-such-session", "0" * 32, "*", "specdec:session:x", "a\x00b"])),
    ))
    return msg


@st.composite
def calls(draw, live: list[str]):
    """(method name, request message)."""
    kind = draw(mix((8, st.just("Generate")), (8, st.just("GenerateStream")), (1, st.just("GetSession")),
                    (1, st.just("EndSession")), (1, st.just("DescribeModels"))))
    if kind == "Generate":
        return kind, pb.GenerateRequest(input=draw(generation_input(live)))
    if kind == "GenerateStream":
        return kind, pb.GenerateStreamRequest(input=draw(generation_input(live)))
    if kind == "DescribeModels":
        return kind, pb.DescribeModelsRequest()
    # EndSession never gets a live session: the others keep continuing those.
    ids = st.sampled_from(live) if kind == "GetSession" else st.just("")
    session_id = draw(mix((2, ids), (3, small_text), (1, st.text(min_size=129, max_size=300))))
    request_class = pb.GetSessionRequest if kind == "GetSession" else pb.EndSessionRequest
    return kind, request_class(session_id=session_id)


# ---- checks ------------------------------------------------------------------------------------

def call_and_check(stub, method: str, request) -> grpc.StatusCode:
    """Call; check the status code and, on success, the invariants of the answer."""
    try:
        if method == "GenerateStream":
            chunks = list(stub.GenerateStream(request, timeout=CALL_TIMEOUT_S))
            check_stream(request.input, chunks)
        elif method == "Generate":
            check_response(request.input, stub.Generate(request, timeout=CALL_TIMEOUT_S))
        else:
            getattr(stub, method)(request, timeout=CALL_TIMEOUT_S)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
        assert code in ALLOWED, f"{method} answered {code.name}: {err.details()!r}\nrequest: {request!r}"
        assert err.details(), f"{method} answered {code.name} without a message\nrequest: {request!r}"
        return code


def _check_output(inp: pb.GenerationInput, ids: list[int], text: str, finish: int, usage: pb.Usage) -> None:
    assert all(0 <= t < VOCAB for t in ids), ids
    assert finish != pb.FINISH_REASON_UNSPECIFIED
    assert usage.completion_tokens == len(ids)
    limit = inp.max_new_tokens if inp.HasField("max_new_tokens") else DEFAULT_MAX_NEW
    assert len(ids) <= limit
    if finish == pb.FINISH_REASON_LENGTH and inp.HasField("max_new_tokens"):
        assert len(ids) == limit
    if finish == pb.FINISH_REASON_STOP_TOKEN:
        assert ids and (ids[-1] in inp.stop_token_ids or ids[-1] in (0, 2)), ids  # the tiny pair's eos: 2
    assert usage.session_tokens <= CONTEXT
    for s in inp.stop:
        assert s not in text, f"stop string {s!r} in the output {text!r}"


def check_response(inp: pb.GenerationInput, r: pb.GenerateResponse) -> None:
    assert r.session_id
    if inp.session_id:
        assert r.session_id == inp.session_id
    _check_output(inp, list(r.token_ids), r.text, r.finish_reason, r.usage)


def check_stream(inp: pb.GenerationInput, chunks: list[pb.GenerateStreamResponse]) -> None:
    assert chunks, "a stream that succeeded sent nothing"
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    assert len({c.session_id for c in chunks}) == 1 and chunks[0].session_id
    last = chunks[-1]
    ids = [t for c in chunks for t in c.token_ids]
    _check_output(inp, ids, "".join(c.text for c in chunks), last.finish_reason, last.usage)


# ---- the tests ---------------------------------------------------------------------------------

def test_typed_requests_never_internal_never_hang(stack, stub, live_sessions):
    codes: dict[str, int] = {}
    started = time.perf_counter()

    @settings(max_examples=TYPED_EXAMPLES, **SETTINGS)
    @given(call=calls(live_sessions))
    def check(call):
        method, request = call
        code = call_and_check(stub, method, request)
        key = f"{method}:{code.name}"
        codes[key] = codes.get(key, 0) + 1
        assert stack.processes["coordinator"].poll() is None, "the coordinator exited"

    try:
        check()
    finally:
        total = sum(codes.values())
        print(f"\ntyped fuzz: {total} calls in {time.perf_counter() - started:.1f} s; "
              + ", ".join(f"{k} {v}" for k, v in sorted(codes.items())))
    assert codes.get("Generate:OK", 0) + codes.get("GenerateStream:OK", 0) > total // 10  # the deep path ran


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply (kind, position, byte) edits: 0 flip a byte, 1 insert one, 2 delete one, 3 truncate."""
    buf = bytearray(data)
    for kind, pos, value in edits:
        if not buf and kind != 1:
            continue
        i = pos % (len(buf) + (kind == 1))
        if kind == 0:
            buf[i] ^= value or 1
        elif kind == 1:
            buf.insert(i, value)
        elif kind == 2:
            del buf[i]
        else:
            del buf[i:]
    return bytes(buf)


def valid_bytes() -> st.SearchStrategy[bytes]:
    small = pb.GenerationInput(max_new_tokens=2)
    requests = [
        pb.GenerateRequest(input=pb.GenerationInput(token_ids=pb.TokenIds(ids=[5, 6, 7]), max_new_tokens=2)),
        pb.GenerateRequest(input=pb.GenerationInput(prompt="Hello there", max_new_tokens=3, stop=["x"])),
        pb.GenerateRequest(input=pb.GenerationInput(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")]), max_new_tokens=2,
            sampling=common_pb2.SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3),
            speculation=pb.SpeculationParams(method=pb.DRAFT_METHOD_NGRAM, num_speculative_tokens=3))),
        pb.GetSessionRequest(session_id="0123456789abcdef"),
        small,
    ]
    return st.sampled_from([r.SerializeToString() for r in requests])


edits = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**16), st.integers(0, 255)), min_size=1, max_size=4)
payloads = mix(
    (4, st.binary(max_size=64)),
    (1, st.binary(min_size=1000, max_size=5000)),
    (5, st.builds(mutate, valid_bytes(), edits)),
)


def test_garbage_bytes_never_internal_never_hang(stack, channel):
    codes: dict[str, int] = {}
    started = time.perf_counter()

    @settings(max_examples=GARBAGE_EXAMPLES, **SETTINGS)
    @given(method=st.sampled_from(METHODS + ["Nope"]), payload=payloads)
    def check(method, payload):
        path = f"/specdec.v1.Generation/{method}"
        try:  # no serializers: the bytes go on the wire as they are
            if method == "GenerateStream":
                list(channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT_S))
            else:
                channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT_S)
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
            allowed = {grpc.StatusCode.UNIMPLEMENTED} if method == "Nope" else ALLOWED
            assert code in allowed, f"{path} answered {code.name}: {err.details()!r} to the bytes {payload!r}"
        codes[f"{method}:{code.name}"] = codes.get(f"{method}:{code.name}", 0) + 1
        assert stack.processes["coordinator"].poll() is None, "the coordinator exited"

    try:
        check()
    finally:
        print(f"\ngarbage fuzz: {sum(codes.values())} calls in {time.perf_counter() - started:.1f} s; "
              + ", ".join(f"{k} {v}" for k, v in sorted(codes.items())))


def test_still_serves_a_good_request_afterwards(stack, stub):
    assert stack.processes["coordinator"].poll() is None
    r = stub.Generate(pb.GenerateRequest(input=pb.GenerationInput(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                                                  max_new_tokens=5)), timeout=CALL_TIMEOUT_S)
    assert len(r.token_ids) == 5 and r.finish_reason == pb.FINISH_REASON_LENGTH
    chunks = list(stub.GenerateStream(pb.GenerateStreamRequest(input=pb.GenerationInput(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hello")]), max_new_tokens=4)),
        timeout=CALL_TIMEOUT_S))
    assert sum(len(c.token_ids) for c in chunks) == chunks[-1].usage.completion_tokens > 0
