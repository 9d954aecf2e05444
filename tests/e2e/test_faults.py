"""Faults injected into real processes (draft, target and coordinator services, a real Redis
server), each with its outcome asserted: a worker or the coordinator killed mid-stream, Redis
stopped and restarted, two requests racing on one session, overload, a client deadline, and a
graceful drain on SIGTERM.

What must hold throughout (DESIGN.md): greedy output token-identical to the target decoding alone,
nothing the client has seen is lost (commit before send), errors are status codes with a clear
message, never INTERNAL and never a hang.

One stack for the whole module (tiny random pair). Its Redis is our own `redis-server` with an
append-only file, so that its data survives a clean restart on the same port. The coordinator runs
with a short draft retry budget (each round with the draft down pays that budget) and a long target
retry budget (a killed target must come back within it).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
import redis

from stacks import raw_stream, start_stack
from specdec import Client
from specdec.client import build_input
from specdec.launcher import free_port, redis_server_binary, wait_serving
from specdec.v1 import generation_pb2 as pb

pytestmark = [pytest.mark.fault, pytest.mark.e2e]

K = 4
PROMPT = [504, 3458, 282, 4649, 314]  # the tiny pair decodes 300+ tokens from it without hitting eos
OTHER = [1073, 2102, 30, 9, 17, 3365, 11, 4500]
DRAIN_S = 60.0
TARGET_RETRY_S = 180.0
DRAFT_RETRY_S = 0.1
CALL_S = 300.0  # bound on every call that should succeed


class PersistentRedis:
    """A redis-server with an append-only file in its own folder, on a fixed port."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        deadline = time.monotonic() + 20
        while True:  # also waits out LOADING after a restart
            try:
                if client.ping():
                    return
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM: a clean shutdown (the append-only file is flushed)."""
        if self.running:
            self.proc.terminate()
            self.proc.wait(20)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = PersistentRedis(tmp_path_factory.mktemp("redis-data"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stack(tiny_pair, redis_server, tmp_path_factory):
    stack = start_stack(*tiny_pair, tmp_path_factory.mktemp("logs"), redis_url=redis_server.url, args={
        "coordinator": ["--draft-retry", str(DRAFT_RETRY_S), "--target-retry", str(TARGET_RETRY_S),
                        "--drain-seconds", str(DRAIN_S)],
    })
    yield stack
    stack.down()


def alive(stack, name: str) -> bool:
    proc = stack.processes.get(name)
    return proc is not None and proc.poll() is None


def restore(stack, redis_server, names) -> None:
    """Bring back whatever an earlier test left down."""
    if not redis_server.running:
        redis_server.start()
    for name in names:
        if not alive(stack, name):
            stack.processes.pop(name, None)
            stack.start(name, wait_s=300)


@pytest.fixture
def healthy(stack, redis_server):
    restore(stack, redis_server, ["draft", "target", "coordinator"])
    return stack


@pytest.fixture
def healthy_without_draft(stack, redis_server):
    """Target, coordinator and Redis up; the draft left as it is (these tests kill it anyway)."""
    restore(stack, redis_server, ["target", "coordinator"])
    return stack


def make_client(stack, name: str = "coordinator") -> Client:
    return Client(stack.address(name), timeout_s=CALL_S)


def ids_of(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def committed(stack, session_id: str) -> list[int]:
    r = redis.Redis.from_url(stack.redis_url)
    return [int(t) for t in r.lrange(f"specdec:session:{session_id}:ids", 0, -1)]


def lease_ttl(stack, session_id: str) -> int:
    return redis.Redis.from_url(stack.redis_url).ttl(f"specdec:session:{session_id}:lease")


def rpc_error(call, *args, **kwargs) -> tuple[grpc.RpcError, float]:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        result = call(*args, **kwargs)
        if isinstance(result, grpc.Call):  # a stream: the error comes while reading it
            list(result)
    return err.value, time.monotonic() - started


def continue_when_free(client: Client, wait_s: float, prompt, **kwargs):
    """Continue a session, retrying while it is busy (FAILED_PRECONDITION) for up to wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.generate(prompt, **kwargs)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@contextlib.contextmanager
def extra_coordinator(stack, name: str, extra_args: list[str], wait_s: float = 300):
    """Another coordinator process on the same workers and Redis, with extra flags."""
    cmd = stack.command(name) + extra_args
    log = open(stack.log_dir / f"{name}.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_serving(stack.address(name), wait_s, proc, name)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()


# ---- a. the target worker killed mid-stream, then restarted --------------------------------------

def test_target_killed_mid_stream_and_restarted(healthy, hf_greedy):
    stack, n = healthy, 200
    with make_client(stack) as client:
        call = raw_stream(client, PROMPT, max_new_tokens=n, k=K)
        before = [next(call) for _ in range(3)]
        assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in before)
        old_pid = stack.processes["target"].pid
        stack.stop("target", signal.SIGKILL)
        restarter = threading.Thread(target=stack.start, args=("target",), kwargs={"wait_s": 300})
        restarter.start()
        try:
            after = list(call)
        finally:
            restarter.join()
    assert alive(stack, "target") and stack.processes["target"].pid != old_pid
    streamed = ids_of(before + after)
    assert len(ids_of(after)) > 0 and after[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(streamed) == n  # nothing lost, nothing duplicated
    assert streamed == hf_greedy(PROMPT, n)
    assert committed(stack, before[0].session_id) == PROMPT + streamed
    assert after[-1].usage.completion_tokens == n and after[-1].stats.rounds == len(before) + len(after)


# ---- c. Redis stopped and restarted ------------------------------------------------------------

def test_redis_down_is_unavailable_and_data_survives_restart(healthy, redis_server, hf_greedy):
    stack = healthy
    with make_client(stack) as client:
        first = client.generate(OTHER, max_new_tokens=20, k=K)
        sid = first.session_id
        assert committed(stack, sid) == OTHER + first.token_ids
        redis_server.stop()
        try:
            calls = {
                "Generate (new session)": lambda: client.stub.Generate(
                    pb.GenerateRequest(input=build_input(PROMPT, max_new_tokens=5)), timeout=20),
                "Generate (continue)": lambda: client.stub.Generate(
                    pb.GenerateRequest(input=build_input([7], max_new_tokens=5, session_id=sid)), timeout=20),
                "GenerateStream (new session)": lambda: client.stub.GenerateStream(
                    pb.GenerateStreamRequest(input=build_input(PROMPT, max_new_tokens=5)), timeout=20),
                "GenerateStream (continue)": lambda: client.stub.GenerateStream(
                    pb.GenerateStreamRequest(input=build_input([7], max_new_tokens=5, session_id=sid)), timeout=20),
                "GetSession": lambda: client.stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=20),
                "EndSession": lambda: client.stub.EndSession(pb.EndSessionRequest(session_id=sid), timeout=20),
            }
            for what, call in calls.items():
                err, elapsed = rpc_error(call)
                assert err.code() == grpc.StatusCode.UNAVAILABLE, (what, err.code(), err.details())
                assert "redis" in err.details().lower(), (what, err.details())
                assert elapsed < 10, (what, elapsed)  # an answer, not a hang
        finally:
            redis_server.start()  # same port, same append-only file
        assert alive(stack, "coordinator")
        assert committed(stack, sid) == OTHER + first.token_ids  # intact, nothing half-written
        session = client.get_session(sid)
        assert list(session.token_ids) == OTHER + first.token_ids
        second = client.generate([7, 8], max_new_tokens=20, k=K, session_id=sid)
    history = OTHER + first.token_ids + [7, 8]
    assert second.token_ids == hf_greedy(history, 20)
    assert committed(stack, sid) == history + second.token_ids


# ---- d. the coordinator killed mid-stream ------------------------------------------------------

def test_coordinator_killed_mid_stream_session_continues(healthy, hf_greedy):
    stack = healthy
    received = []
    with make_client(stack) as client:
        call = raw_stream(client, PROMPT, max_new_tokens=300, k=K)
        received += [next(call) for _ in range(3)]
        sid = received[0].session_id
        stack.stop("coordinator", signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as err:
            for chunk in call:  # whatever was already on the wire
                received.append(chunk)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    streamed = ids_of(received)
    history = committed(stack, sid)
    # Commit happens before send: what the client saw is a prefix of the committed tokens, and at most
    # one round (K + 1 tokens) more was committed and not yet sent.
    assert history[:len(PROMPT) + len(streamed)] == PROMPT + streamed
    assert 0 <= len(history) - len(PROMPT) - len(streamed) <= K + 1
    output = history[len(PROMPT):]
    assert output == hf_greedy(PROMPT, len(output))

    stack.start("coordinator", wait_s=300)
    ttl = lease_ttl(stack, sid)
    with make_client(stack) as client:
        # The dead coordinator's lease on the session must not lock it out for long.
        try:
            second = continue_when_free(client, 20.0, [9, 10], max_new_tokens=30, k=K, session_id=sid)
        except grpc.RpcError as e:
            pytest.fail(f"session {sid} still unusable 20 s after the coordinator restarted: "
                        f"{e.code().name}: {e.details()} (its lease had {ttl} s left at restart)")
    history += [9, 10]
    assert second.token_ids == hf_greedy(history, 30)
    assert committed(stack, sid) == history + second.token_ids


# ---- e. two requests racing on one session -----------------------------------------------------

def test_second_request_on_a_busy_session_is_refused(healthy, hf_greedy):
    stack, n = healthy, 100
    with make_client(stack) as client:
        call = raw_stream(client, PROMPT, max_new_tokens=n, k=K)
        chunks = [next(call)]
        sid = chunks[0].session_id
        for rival in (lambda: client.stub.Generate(
                          pb.GenerateRequest(input=build_input([5, 6], max_new_tokens=5, session_id=sid)), timeout=20),
                      lambda: client.stub.GenerateStream(
                          pb.GenerateStreamRequest(input=build_input([5, 6], max_new_tokens=5, session_id=sid)),
                          timeout=20)):
            err, elapsed = rpc_error(rival)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, (err.code(), err.details())
            assert "busy" in err.details(), err.details()
            assert elapsed < 5
        # A reader during the run sees a consistent prefix, never a torn state.
        seen = list(client.get_session(sid).token_ids)
        chunks += list(call)
        out = ids_of(chunks)
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH and len(out) == n
        assert out == hf_greedy(PROMPT, n)
        assert committed(stack, sid) == PROMPT + out  # the refused requests wrote nothing
        assert (PROMPT + out)[:len(seen)] == seen
        more = client.generate([5, 6], max_new_tokens=10, k=K, session_id=sid)  # free again
    history = PROMPT + out + [5, 6]
    assert more.token_ids == hf_greedy(history, 10)
    assert committed(stack, sid) == history + more.token_ids


# ---- f. overload -------------------------------------------------------------------------------

def test_overload_is_resource_exhausted_immediately(healthy):
    stack, name = healthy, "coordinator#limited"
    with extra_coordinator(stack, name, ["--max-concurrent-requests", "1"]), make_client(stack, name) as client:
        call = raw_stream(client, PROMPT, max_new_tokens=300, k=K)
        next(call)
        for other in (lambda: client.stub.Generate(
                          pb.GenerateRequest(input=build_input(OTHER, max_new_tokens=5)), timeout=20),
                      lambda: client.stub.GenerateStream(
                          pb.GenerateStreamRequest(input=build_input(OTHER, max_new_tokens=5)), timeout=20)):
            err, elapsed = rpc_error(other)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
            assert elapsed < 2.0, elapsed  # refused at once, not queued
        assert client.describe().target.vocab_size > 0  # metadata calls are not generations
        call.cancel()  # the client goes away: the slot must come free
        deadline = time.monotonic() + 5
        while True:
            try:
                assert len(client.generate(OTHER, max_new_tokens=5).token_ids) == 5
                break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise


# ---- g. the client's deadline ------------------------------------------------------------------

def test_deadline_exceeded_frees_the_session(healthy, hf_greedy):
    stack = healthy
    with make_client(stack) as client:
        first = client.generate(PROMPT, max_new_tokens=2, k=K)
        sid, start = first.session_id, PROMPT + first.token_ids
        request = pb.GenerateRequest(input=build_input([7], max_new_tokens=600, k=K, session_id=sid))
        err, elapsed = rpc_error(client.stub.Generate, request, timeout=0.3)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (err.code(), err.details())
        assert elapsed < 2
        expired = time.monotonic()
        # The coordinator stops working on it: the session is free again within 2 s.
        while True:
            try:
                result = client.generate([8], max_new_tokens=5, k=K, session_id=sid)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, (e.code(), e.details())
                assert time.monotonic() - expired < 2.0, "the session is still busy 2 s after the deadline"
                time.sleep(0.1)
        history = committed(stack, sid)
        time.sleep(1.0)
        assert committed(stack, sid) == history  # nothing is still writing to it
    # The session: start, then (if the abandoned request got that far) [7] and its greedy continuation,
    # then [8] and the last request's 5 tokens. Nothing corrupted.
    assert history[:len(start)] == start
    assert history[-6:] == [8, *result.token_ids]
    abandoned = history[len(start):-6]
    if abandoned:
        assert abandoned[0] == 7
        if len(abandoned) > 1:
            assert abandoned[1:] == hf_greedy(start + [7], len(abandoned) - 1)
        assert len(abandoned) - 1 < 600  # it did stop
    assert result.token_ids == hf_greedy(history[:-5], 5)


# ---- b. the draft worker killed (late: these leave it down) -------------------------------------

def test_draft_killed_mid_stream_degrades_to_k0(healthy, hf_greedy):
    stack, n = healthy, 50
    with make_client(stack) as client:
        call = raw_stream(client, OTHER, max_new_tokens=n, k=K)
        before = [next(call) for _ in range(3)]
        stack.stop("draft", signal.SIGKILL)
        after = list(call)
        out = ids_of(before + after)
        assert after[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert len(out) == n and out == hf_greedy(OTHER, n)
        assert committed(stack, before[0].session_id) == OTHER + out
        stats = after[-1].stats
        assert stats.rounds == len(before) + len(after)
        assert len(after) >= 10
        # Rounds after the kill ran without a draft (K = 0: one token each), allowing for the round or
        # two already in flight when it died.
        assert stats.drafted <= K * (len(before) + 2)
        assert sum(len(c.token_ids) == 1 for c in after) >= len(after) - 2

        # With the draft down from the start of a request: it succeeds, drafted == 0, same output.
        fresh = client.generate(PROMPT, max_new_tokens=30, k=K)
        assert fresh.stats["drafted"] == 0 and fresh.stats["rounds"] == 30
        assert fresh.token_ids == hf_greedy(PROMPT, 30)
        chunks = list(raw_stream(client, [5], max_new_tokens=10, k=K, session_id=fresh.session_id))
        assert chunks[-1].stats.drafted == 0
        assert ids_of(chunks) == hf_greedy(PROMPT + fresh.token_ids + [5], 10)


def test_dead_draft_costs_one_retry_budget_not_one_per_round(healthy_without_draft, hf_greedy):
    """With the draft down, K = 0 decoding must stay about as fast as K = 0 itself: a request may pay
    the draft retry budget once or twice (noticing the outage), not on every round."""
    stack, n = healthy_without_draft, 40
    stack.stop("draft", signal.SIGKILL)
    with make_client(stack) as client:
        client.generate(PROMPT, max_new_tokens=3, k=K)  # the outage is noticed here
        result = client.generate(OTHER, max_new_tokens=n, k=K)
    assert result.token_ids == hf_greedy(OTHER, n) and result.stats["drafted"] == 0
    budget_ms = DRAFT_RETRY_S * 1e3
    assert result.stats["draft_ms"] <= 2 * budget_ms + 200, (
        f"{result.stats['draft_ms']:.0f} ms waiting for a dead draft over {result.stats['rounds']} rounds "
        f"(retry budget {budget_ms:.0f} ms)")


def test_coordinator_starts_while_the_draft_is_down(healthy_without_draft, hf_greedy):
    """The draft is an optimisation: a coordinator (re)started during a draft outage must still serve
    (K = 0), not refuse to start."""
    stack = healthy_without_draft
    stack.stop("draft", signal.SIGKILL)
    name = "coordinator#nodraft"
    with extra_coordinator(stack, name, ["--startup-timeout", "10"], wait_s=120), make_client(stack, name) as client:
        result = client.generate(PROMPT, max_new_tokens=10, k=K)
    assert result.stats["drafted"] == 0 and result.token_ids == hf_greedy(PROMPT, 10)


# ---- h. graceful drain on SIGTERM (last: it leaves the coordinator stopped) ------------------------

def test_sigterm_drains_in_flight_streams(healthy_without_draft, hf_greedy):
    # K = 0 (one round per token, no draft involved, so the same whether the draft is up or not): a
    # long stream that is still running when the signal comes.
    stack, n = healthy_without_draft, 400
    with make_client(stack) as client:
        call = raw_stream(client, PROMPT, max_new_tokens=n, k=0)
        chunks = [next(call) for _ in range(2)]
        proc = stack.processes["coordinator"]
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.5)
        assert proc.poll() is None  # still draining
        with make_client(stack) as fresh:  # a new request after the SIGTERM is refused
            err, elapsed = rpc_error(fresh.stub.Generate, pb.GenerateRequest(
                input=build_input(OTHER, max_new_tokens=3)), timeout=10)
            assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
        err, _ = rpc_error(client.stub.Generate, pb.GenerateRequest(input=build_input(OTHER, max_new_tokens=3)),
                           timeout=10)
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
        chunks += list(call)  # the in-flight stream completes normally
    out = ids_of(chunks)
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(out) == n and out == hf_greedy(PROMPT, n)
    assert committed(stack, chunks[0].session_id) == PROMPT + out
    assert proc.wait(DRAIN_S + 10) == 0
    assert time.monotonic() - signalled <= DRAIN_S
    stack.processes.pop("coordinator")
