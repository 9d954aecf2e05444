"""Sustained traffic and overload against a real stack (tiny pair, real processes, real Redis), with
budgets scaled down so that every bound is crossed many times over:

- single-turn sessions that are never ended cycle through KV caches that hold a handful of them:
  no request fails and greedy output stays identical to the target alone after many evictions;
- 3x the coordinator's handler threads at once: health answers throughout, the excess gets
  RESOURCE_EXHAUSTED promptly, the admitted requests finish without error; open health Watch
  streams cannot take the threads either;
- EndSession while the session's rounds run: other sessions unaffected, caches freed.
"""

from __future__ import annotations

import subprocess
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec import Client
from specdec.launcher import free_port, redis_server_binary, spawn
from specdec_core.serving.admission import Lanes
from stacks import assert_no_cache_left, end_stream, scrape, start_stack

pytestmark = [pytest.mark.capacity, pytest.mark.e2e]

MAX_CONCURRENT = 4  # coordinator --max-concurrent-requests
COORDINATOR_THREADS = Lanes(frozenset(), work=MAX_CONCURRENT).threads  # as the coordinator sizes its pool
CACHE_TOKENS = 256  # each worker's KV cache: 16 blocks of 16 tokens
HEALTH_BOUND_S = 1.0  # a health check normally takes a few ms; only a defect crosses this


@pytest.fixture(scope="module")
def stack(tiny_pair, tmp_path_factory):
    ports = {"target": free_port(), "draft": free_port()}
    stack = start_stack(*tiny_pair, tmp_path_factory.mktemp("logs"), args={
        "coordinator": ["--max-concurrent-requests", str(MAX_CONCURRENT)],
        "target": ["--max-cache-tokens", str(CACHE_TOKENS), "--metrics-port", str(ports["target"])],
        "draft": ["--max-cache-tokens", str(CACHE_TOKENS), "--metrics-port", str(ports["draft"])],
    })
    stack.metrics_ports = ports
    yield stack
    stack.down()


def metric(stack, role: str, name: str) -> float:
    """A metric summed over its labels."""
    return sum(v for key, v in scrape(stack.metrics_ports[role]).items() if key == name or key.startswith(name + "{"))


def prompt(i: int) -> list[int]:
    """Distinct prompts of 5..40 tokens: sessions hold 2..4 blocks each."""
    return [(i * 7919 + j * 104729) % 40000 + 100 for j in range(5 + i % 36)]


def test_sessions_never_ended_cycle_through_the_caches_with_identical_output(stack, hf_greedy):
    num_sessions, users, new_tokens = 48, 3, 12
    results: dict[int, list[int]] = {}
    failures: list[BaseException] = []
    evictions_before = metric(stack, "target", "specdec_cache_evictions_total")

    def user(u: int) -> None:
        with Client(stack.address("coordinator"), timeout_s=120) as client:
            for i in range(u, num_sessions, users):
                try:
                    results[i] = client.generate(prompt(i), max_new_tokens=new_tokens, k=4).token_ids
                except grpc.RpcError as exc:
                    failures.append(exc)

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]
    for i in range(num_sessions):
        assert results[i] == hf_greedy(prompt(i), new_tokens), f"session {i}"
    held = sum(-(-(len(prompt(i)) + new_tokens) // 16) for i in range(num_sessions))  # blocks all sessions want
    assert held >= 5 * CACHE_TOKENS // 16  # the pools were cycled 5x over at least
    assert metric(stack, "target", "specdec_cache_evictions_total") - evictions_before >= num_sessions - 16
    assert metric(stack, "draft", "specdec_cache_evictions_total") > 0
    assert 0 <= metric(stack, "target", "specdec_cache_free_units") <= CACHE_TOKENS // 16


def _health_prober(address: str, stop: threading.Event, latencies: list[float], errors: list) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            started = time.monotonic()
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
                if status != health_pb2.HealthCheckResponse.SERVING:
                    errors.append(status)
            except grpc.RpcError as exc:
                errors.append(exc.code())
            latencies.append(time.monotonic() - started)
            stop.wait(0.02)


def test_three_times_the_handler_threads_at_once(stack):
    clients = 3 * COORDINATOR_THREADS
    go = threading.Barrier(clients)
    outcomes: list[tuple[str, float]] = []
    health_latencies: list[float] = []
    health_errors: list = []
    stop = threading.Event()
    prober = threading.Thread(target=_health_prober,
                              args=(stack.address("coordinator"), stop, health_latencies, health_errors))
    prober.start()

    def client(i: int) -> None:
        with Client(stack.address("coordinator"), timeout_s=300) as c:
            grpc.channel_ready_future(c.channel).result(timeout=60)  # time the call, not the connect
            go.wait()
            started = time.monotonic()
            try:
                for _ in c.stream(prompt(i), max_new_tokens=96, k=0):
                    pass
                outcomes.append(("ok", time.monotonic() - started))
            except grpc.RpcError as exc:
                outcomes.append((exc.code().name, time.monotonic() - started))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    prober.join()

    codes = {code for code, _ in outcomes}
    assert codes <= {"ok", "RESOURCE_EXHAUSTED"}, outcomes
    refused = [s for code, s in outcomes if code == "RESOURCE_EXHAUSTED"]
    assert len(outcomes) == clients and MAX_CONCURRENT <= clients - len(refused) and refused
    assert max(refused) < HEALTH_BOUND_S  # refused at once, not after queueing
    assert not health_errors and len(health_latencies) > 5
    assert max(health_latencies) < HEALTH_BOUND_S
    refused_ms = sorted(s * 1e3 for code, s in outcomes if code == "RESOURCE_EXHAUSTED")
    health_ms = sorted(s * 1e3 for s in health_latencies)
    print(f"\n{clients} clients: {clients - len(refused_ms)} admitted, {len(refused_ms)} refused "
          f"(refusal p50 {refused_ms[len(refused_ms) // 2]:.1f} ms, max {refused_ms[-1]:.1f} ms); "
          f"health checks {len(health_ms)}, p50 {health_ms[len(health_ms) // 2]:.1f} ms, "
          f"p99 {health_ms[int(0.99 * (len(health_ms) - 1))]:.1f} ms, max {health_ms[-1]:.1f} ms")


def test_open_watch_streams_cannot_starve_health_or_requests(stack):
    with grpc.insecure_channel(stack.address("coordinator")) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(2 * COORDINATOR_THREADS)]
        try:
            opened, refused = 0, 0
            for w in watches:
                try:
                    next(w)
                    opened += 1
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    refused += 1
            assert opened <= 4 and refused >= COORDINATOR_THREADS  # the streams lane holds a few
            started = time.monotonic()
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
            assert time.monotonic() - started < HEALTH_BOUND_S
            with Client(stack.address("coordinator"), timeout_s=60) as client:
                assert client.generate(prompt(1), max_new_tokens=4, k=2).token_ids
        finally:
            for w in watches:
                w.cancel()


def test_end_session_during_its_rounds_leaves_others_unaffected_and_frees_caches(stack, hf_greedy):
    ended: list[str] = []
    with Client(stack.address("coordinator"), timeout_s=120) as client:
        bystander_out: dict[int, list[int]] = {}

        def bystander(i: int) -> None:
            with Client(stack.address("coordinator"), timeout_s=120) as c:
                bystander_out[i] = c.generate(prompt(100 + i), max_new_tokens=48, k=4).token_ids

        others = [threading.Thread(target=bystander, args=(i,)) for i in range(2)]
        for t in others:
            t.start()
        for i in range(6):
            stream = client.stream(prompt(200 + i), max_new_tokens=400, k=4)
            first = next(stream)  # rounds are running now (nearly always: the stream has 400 tokens to go)
            client.end_session(first.session_id)
            ended.append(first.session_id)
            end_stream(stream)
        for t in others:
            t.join()
        for i in range(2):  # ...the others are not touched
            assert bystander_out[i] == hf_greedy(prompt(100 + i), 48)
        for session_id in ended:
            with pytest.raises(grpc.RpcError) as err:
                client.get_session(session_id)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

    assert_no_cache_left(stack, ended)



def _status(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _wait_status(address: str, status: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while _status(address) != status:
        assert time.monotonic() < deadline, f"coordinator health never became {status}"
        time.sleep(0.2)


@pytest.mark.parametrize("dependency", ["target", "redis"])
def test_health_says_not_serving_while_a_dependency_is_gone_and_liveness_stays_up(stack, dependency):
    """Last in the module: it stops the target, then Redis, and brings each back."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    coordinator = stack.address("coordinator")
    assert _status(coordinator) == serving
    redis_port = stack.redis_url.rsplit(":", 1)[1].split("/")[0]
    stack.stop(dependency)
    _wait_status(coordinator, not_serving)
    assert _status(coordinator, "liveness") == serving  # a liveness probe must not restart the pod for it
    if dependency == "redis":  # the same server again, on the same port
        stack.processes["redis"] = spawn([redis_server_binary(), "--port", redis_port, "--bind", "127.0.0.1",
                                          "--save", "", "--appendonly", "no"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        stack.start(dependency)
    _wait_status(coordinator, serving)
    with Client(coordinator, timeout_s=60) as client:
        assert client.generate(prompt(3), max_new_tokens=4, k=2).token_ids
