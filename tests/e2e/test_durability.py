"""Sessions that survive Redis faults and belong to the client that made them, shown on running
services (tiny random pair) and real redis-server processes:

- Redis SIGKILLed mid-stream with the append-only file on (appendfsync everysec): after its restart
  every token a client received is in Redis, and the stream goes on to the uninterrupted output;
- the coordinator SIGKILLed mid-stream: the client library retries with its request id and resumes;
- a failed request retried through raw gRPC with the same request id: its output replayed from the
  start, then continued; nothing appended twice;
- Redis at maxmemory (noeviction): RESOURCE_EXHAUSTED, before and during a stream, and no session
  changed;
- tenants: another tenant's session is NOT_FOUND for get, continue and end, live-session and
  concurrent-request quotas, and no session id in any log line of any service;
- Redis over TLS (mutual TLS), for real;
- Sentinel (a primary, two replicas, three sentinels): the primary SIGKILLed mid-stream, commits
  waiting for both replicas (WAIT 2): 0 acknowledged tokens lost, 0 duplicated.

One stack (workers and a coordinator) for the module; the other coordinators (tenants, TLS,
Sentinel) are further processes on the same workers.
"""

from __future__ import annotations

import re
import threading
import uuid

import grpc
import pytest
import redis

from redis_servers import RedisServer, RedisUnavailable, SentinelCluster, TlsRedisServer
from stacks import committed, raw_stream, start_stack, status_of
from specdec import Client
from specdec.client import build_input
from specdec.v1 import generation_pb2 as pb

pytestmark = [pytest.mark.durability, pytest.mark.e2e]

K = 4
N = 120
PROMPT = [504, 3458, 282, 4649, 314]  # the tiny pair decodes 300+ tokens from it without hitting eos
OTHER = [1073, 2102, 30, 9, 17, 3365, 11, 4500]
CALL_S = 300.0
TOKENS = {"alpha": "tok-alpha-7f3a9c", "beta": "tok-beta-21e0d4"}
BARE_TOKEN = "tok-default-c4d1"  # a bare line: the tenant "default"
SESSION_IDS: set[str] = set()  # every session this module creates: none may appear in a log


@pytest.fixture(scope="module")
def aof_redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis-aof"), appendonly=True, appendfsync="everysec",
                         extra_args=("--maxmemory-policy", "noeviction"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stack(tiny_pair, aof_redis, tmp_path_factory):
    """Workers and a coordinator on the append-only Redis. The coordinator gives up on Redis after
    1 s (so that a Redis outage reaches the client, which then retries with its request id)."""
    log_dir = tmp_path_factory.mktemp("logs")
    tokens = log_dir.parent / "tokens"
    tokens.write_text("".join(f"{tenant}:{token}\n" for tenant, token in TOKENS.items()) + BARE_TOKEN + "\n")
    debug = ["--log-level", "debug", "--log-format", "json"]
    stack = start_stack(*tiny_pair, log_dir, redis_url=aof_redis.url, args={
        "coordinator": ["--redis-retry", "1", *debug], "draft": debug, "target": debug,
        "coordinator#tenants": ["--auth-tokens-file", str(tokens), "--tenant-max-sessions", "2",
                                "--tenant-max-requests", "1"],
    })
    yield stack
    stack.down()


@pytest.fixture(scope="module")
def reference(hf_greedy):
    return hf_greedy(PROMPT, N)


def client_for(stack, name: str = "coordinator", **kwargs) -> Client:
    return Client(stack.address(name), timeout_s=CALL_S, **kwargs)


def take(stream, n_tokens: int, into: list[int]) -> str:
    """Read chunks until `into` holds n_tokens more; the session id."""
    goal = len(into) + n_tokens
    session_id = ""
    while len(into) < goal:
        chunk = next(stream)
        session_id = session_id or chunk.session_id
        into.extend(chunk.token_ids)
        assert chunk.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    SESSION_IDS.add(session_id)
    return session_id


def drain(stream, into: list[int]):
    last = None
    for chunk in stream:
        into.extend(chunk.token_ids)
        last = chunk
    return last


# ---- the append-only file: Redis SIGKILLed mid-stream ------------------------------------------

def test_redis_sigkilled_mid_stream_loses_no_received_token(stack, aof_redis, reference, hf_greedy):
    """everysec suffices against a killed process: Redis write()s the AOF before it replies, so what
    a client was acknowledged is in the file; only a machine crash can lose the last second."""
    with client_for(stack, retry_s=120) as client:
        received: list[int] = []
        stream = client.stream(PROMPT, max_new_tokens=N, k=K)
        session_id = take(stream, 12, received)
        aof_redis.kill()
        aof_redis.restart()
        stored = committed(aof_redis.client(), session_id)
        assert stored[:len(PROMPT)] == PROMPT
        assert stored[len(PROMPT):len(PROMPT) + len(received)] == received  # every received token
        last = drain(stream, received)  # the request goes on (the coordinator's retry or the client's)
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert received == reference  # nothing lost, nothing twice, identical to an uninterrupted run
        assert committed(aof_redis.client(), session_id) == PROMPT + reference
        more = client.generate(OTHER, session_id=session_id, max_new_tokens=24, k=K)  # the session goes on
        assert more.token_ids == hf_greedy(PROMPT + reference + OTHER, 24)


def test_a_failed_request_retried_with_its_id_resumes_through_raw_grpc(stack, aof_redis, reference):
    """Redis down for longer than the coordinator retries: the stream fails UNAVAILABLE. Its retry
    with the same request id replays the committed output as its first chunk and goes on; the turn's
    input is not appended again."""
    with client_for(stack, retry_s=0) as client:
        received: list[int] = []
        stream = raw_stream(client, PROMPT, max_new_tokens=N, k=K, request_id="raw-resume-1")
        session_id = take(stream, 8, received)
        aof_redis.kill()
        with pytest.raises(grpc.RpcError) as failed:
            drain(stream, received)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
        aof_redis.restart()
        stored = committed(aof_redis.client(), session_id)
        assert stored[len(PROMPT):len(PROMPT) + len(received)] == received
        retry = raw_stream(client, PROMPT, max_new_tokens=N, k=K, request_id="raw-resume-1")
        first = next(retry)
        assert first.session_id == session_id
        assert list(first.token_ids) == stored[len(PROMPT):]  # the replay: everything committed before
        output = list(first.token_ids)
        last = drain(retry, output)
        assert output == reference and last.usage.completion_tokens == N
        assert committed(aof_redis.client(), session_id) == PROMPT + reference  # the input once
        again = client.generate(PROMPT, max_new_tokens=N, k=K, request_id="raw-resume-1")  # finished: replayed
        assert again.token_ids == reference and again.finish_reason == "length"
        assert committed(aof_redis.client(), session_id) == PROMPT + reference


# ---- idempotent requests -----------------------------------------------------------------------

def test_the_coordinator_killed_mid_stream_the_client_library_resumes(stack, aof_redis, reference):
    with client_for(stack, retry_s=300) as client:
        received: list[int] = []
        stream = client.stream(PROMPT, max_new_tokens=N, k=K)  # the library's own request id
        session_id = take(stream, 8, received)
        stack.stop("coordinator", sig=9)
        stack.start("coordinator")
        last = drain(stream, received)
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert received == reference  # 0 lost, 0 duplicated
        assert committed(aof_redis.client(), session_id) == PROMPT + reference


def test_a_repeated_request_id_appends_its_turn_once(stack, aof_redis, hf_greedy):
    with client_for(stack) as client:
        first = client.generate(PROMPT, max_new_tokens=16, k=K)
        SESSION_IDS.add(first.session_id)
        turn = dict(session_id=first.session_id, max_new_tokens=16, k=K)
        request = pb.GenerateRequest(input=build_input(OTHER, request_id="turn-2", **turn))
        a = client.stub.Generate(request, timeout=CALL_S)  # raw gRPC, twice
        b = client.stub.Generate(request, timeout=CALL_S)
        assert (list(a.token_ids), a.text, a.usage.prompt_tokens) == (list(b.token_ids), b.text, b.usage.prompt_tokens)
        expected = PROMPT + first.token_ids + OTHER + list(a.token_ids)
        assert committed(aof_redis.client(), first.session_id) == expected
        assert list(a.token_ids) == hf_greedy(PROMPT + first.token_ids + OTHER, 16)
        c = client.generate(OTHER, request_id="turn-2", **turn)  # the client library, same id
        assert c.token_ids == list(a.token_ids)
        assert committed(aof_redis.client(), first.session_id) == expected
        with pytest.raises(grpc.RpcError) as reused:  # the same id for other input
            client.generate(PROMPT, request_id="turn-2", **turn)
        assert reused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in reused.value.details()
        with pytest.raises(grpc.RpcError) as bad:
            client.generate(PROMPT, request_id="no spaces allowed", max_new_tokens=2)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in bad.value.details()


def test_a_retry_that_read_the_record_before_its_request_finished_only_replays_it(stack, monkeypatch, reference):
    """A retry reads the request record, then the first attempt finishes, then the retry takes the
    lease: the retry must see the finish (it reads the record again under the lease) and replay it,
    not generate past its end. The interleaving is forced by handing the retry's first read a record
    from before the finish; the coordinator runs in this process, on the stack's workers and Redis."""
    from coordinator.__main__ import worker_pools
    from coordinator.config import CoordinatorConfig
    from coordinator.generation import Generation
    from coordinator.suffix import SuffixProposer
    from coordinator.request import GenerationRequest, Limits
    from specdec_core.serving.redis_client import connect_redis
    from coordinator.sessions import SessionStore
    from coordinator.text import TextCodec
    from specdec_core.engine.models import load_tokenizer
    from tiny_models import ENGINE

    cfg = CoordinatorConfig.from_args(["--redis-url", stack.redis_url, "--target", stack.address("target"),
                                       "--draft", stack.address("draft")])
    target, draft = worker_pools(cfg)
    info = target.model_info(60)
    store = SessionStore(connect_redis(stack.redis_url))
    codec = TextCodec(load_tokenizer(stack.target_model, ENGINE.cache_dir), "tiny")
    generation = Generation(store, codec, draft, SuffixProposer(), target, Limits(info.vocab_size, info.max_context, 64, K))
    request = GenerationRequest(token_ids=PROMPT, max_new_tokens=N, num_speculative_tokens=K,
                                request_id="finished-meanwhile")
    first = [t for chunk in generation.run(request) for t in chunk.token_ids]
    assert first == reference
    finished = store.request("default", "finished-meanwhile")
    session_before = store.load(finished.session_id)
    reads = []
    real_request = store.request

    def first_read_is_stale(tenant, request_id):
        record = real_request(tenant, request_id)
        reads.append(record)
        return record.__class__(**{**record.__dict__, "finish": "", "end": 0}) if len(reads) == 1 else record

    monkeypatch.setattr(store, "request", first_read_is_stale)
    chunks = list(generation.run(request))
    assert len(reads) == 2  # once before the lease, once under it
    assert [t for c in chunks for t in c.token_ids] == reference and chunks[-1].finish is not None
    after = store.load(finished.session_id)
    assert (after.token_ids, after.version) == (session_before.token_ids, session_before.version)


# ---- a full Redis ------------------------------------------------------------------------------

def test_redis_at_maxmemory_is_resource_exhausted_and_corrupts_nothing(stack, aof_redis, reference):
    admin = aof_redis.client()
    with client_for(stack, retry_s=0) as client:
        done = client.generate(PROMPT, max_new_tokens=16, k=K)
        SESSION_IDS.add(done.session_id)
        before = client.get_session(done.session_id)
        received: list[int] = []
        stream = raw_stream(client, PROMPT, max_new_tokens=N, k=K, request_id="oom-1")
        session_id = take(stream, 8, received)
        admin.config_set("maxmemory", 1)  # every write from now on is over
        try:
            with pytest.raises(grpc.RpcError) as mid:
                drain(stream, received)
            assert mid.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "full" in mid.value.details()
            for call in (lambda: client.generate(PROMPT, max_new_tokens=4),
                         lambda: client.generate(OTHER, session_id=done.session_id, max_new_tokens=4)):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
            after = client.get_session(done.session_id)  # reading still works, and nothing changed
            assert (list(after.token_ids), after.version) == (list(before.token_ids), before.version)
            assert committed(admin, session_id)[len(PROMPT):] == received  # what the client saw, exactly
        finally:
            admin.config_set("maxmemory", 0)
        output: list[int] = []
        drain(raw_stream(client, PROMPT, max_new_tokens=N, k=K, request_id="oom-1"), output)
        assert output == reference  # resumed once there is room
        assert committed(admin, session_id) == PROMPT + reference


# ---- tenants -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tenants(stack):
    stack.start("coordinator#tenants")
    clients = {name: client_for(stack, "coordinator#tenants", token=token) for name, token in TOKENS.items()}
    clients["default"] = client_for(stack, "coordinator#tenants", token=BARE_TOKEN)
    yield clients
    for c in clients.values():
        c.close()
    stack.stop("coordinator#tenants")


def test_another_tenants_session_is_not_found(tenants):
    alpha, beta = tenants["alpha"], tenants["beta"]
    mine = alpha.generate(PROMPT, max_new_tokens=8, k=K)
    SESSION_IDS.add(mine.session_id)
    unknown = uuid.uuid4().hex
    for other in (beta, tenants["default"]):
        for call in (lambda s: other.get_session(s),
                     lambda s: other.generate(OTHER, session_id=s, max_new_tokens=4),
                     lambda s: raw_stream(other, OTHER, session_id=s, max_new_tokens=4),
                     lambda s: other.end_session(s)):
            code, message = status_of(lambda: call(mine.session_id))
            unknown_code, unknown_message = status_of(lambda: call(unknown))
            assert code == unknown_code == grpc.StatusCode.NOT_FOUND
            assert re.sub(r"s:[0-9a-f]+", "s:X", message) == re.sub(r"s:[0-9a-f]+", "s:X", unknown_message)
            assert mine.session_id not in message
    still = alpha.get_session(mine.session_id)  # untouched by the others' attempts
    assert list(still.token_ids) == PROMPT + mine.token_ids
    alpha.end_session(mine.session_id)


def test_tenant_quotas(tenants, stack):
    alpha, beta = tenants["alpha"], tenants["beta"]
    first, second = (alpha.generate(PROMPT, max_new_tokens=2, k=K) for _ in range(2))
    SESSION_IDS.update((first.session_id, second.session_id))
    code, message = status_of(lambda: alpha.generate(PROMPT, max_new_tokens=2))  # a third live session
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "live sessions" in message
    alpha.generate(OTHER, session_id=first.session_id, max_new_tokens=2, k=K)  # its own go on
    beta_session = beta.generate(PROMPT, max_new_tokens=2).session_id  # other tenants are not affected
    SESSION_IDS.add(beta_session)
    alpha.end_session(second.session_id)
    third = alpha.generate(PROMPT, max_new_tokens=2)  # room again
    SESSION_IDS.add(third.session_id)

    running = raw_stream(alpha, OTHER, session_id=first.session_id, max_new_tokens=250, k=0)
    take(running, 1, [])  # alpha has one generation running, its limit ...
    try:
        code, message = status_of(lambda: alpha.generate(OTHER, session_id=third.session_id, max_new_tokens=2))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "generations running" in message
        beta.generate(OTHER, session_id=beta_session, max_new_tokens=2)  # ... beta is not limited by it
    finally:
        running.cancel()
    for s in (first.session_id, third.session_id):
        alpha.end_session(s)
    beta.end_session(beta_session)


# ---- Redis over TLS ----------------------------------------------------------------------------

def test_redis_over_mutual_tls(stack, tmp_path_factory, hf_greedy):
    server = TlsRedisServer(tmp_path_factory.mktemp("redis-tls"))
    try:
        server.start()
    except RedisUnavailable as exc:
        pytest.skip(f"this redis-server cannot serve TLS: {exc}")
    try:
        stack.args["coordinator#tls"] = ["--redis-url", server.url, "--redis-tls-ca", str(server.ca_file),
                                         "--redis-tls-cert", str(server.client_cert_file),
                                         "--redis-tls-key", str(server.client_key_file)]
        stack.start("coordinator#tls")
        with client_for(stack, "coordinator#tls") as client:
            result = client.generate(PROMPT, max_new_tokens=16, k=K)
            SESSION_IDS.add(result.session_id)
            assert result.token_ids == hf_greedy(PROMPT, 16)
            assert committed(server.client(), result.session_id) == PROMPT + result.token_ids
        with pytest.raises(redis.ConnectionError):  # the port speaks TLS only
            redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2).ping()
    finally:
        stack.stop("coordinator#tls")
        server.stop()


# ---- Sentinel ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_sentinel_failover_mid_stream_loses_and_repeats_nothing(stack, tmp_path_factory, reference):
    """Every commit waits for both replicas (WAIT 2), so whichever one Sentinel promotes holds every
    token a client saw. (WAIT 1 with two replicas survives a replica's loss too, but then relies on
    Sentinel promoting the more advanced replica, its usual but not certain choice.)"""
    cluster = SentinelCluster(tmp_path_factory.mktemp("sentinel"), replicas=2, sentinels=3, down_after_ms=2000)
    cluster.start()
    try:
        stack.args["coordinator#sentinel"] = ["--redis-url", cluster.url, "--redis-wait-replicas", "2",
                                              "--redis-wait-timeout-ms", "2000", "--redis-retry", "20"]
        stack.start("coordinator#sentinel")
        with client_for(stack, "coordinator#sentinel", retry_s=180) as client:
            received: list[int] = []
            stream = client.stream(PROMPT, max_new_tokens=N, k=K)
            session_id = take(stream, 12, received)
            old = cluster.kill_primary()
            new = cluster.wait_failover(old)
            cluster.restart(old)  # until it is back as a replica, commits cannot reach 2 replicas: UNAVAILABLE
            last = drain(stream, received)
            assert last.finish_reason == pb.FINISH_REASON_LENGTH
            assert received == reference  # 0 acknowledged tokens lost, 0 duplicated
            assert new != old
            host, port = cluster.master_address()  # now (Sentinel may have moved it again since)
            primary = redis.Redis(host=host, port=port)
            assert primary.role()[0] == b"master"
            assert committed(primary, session_id) == PROMPT + reference
    finally:
        stack.stop("coordinator#sentinel")
        cluster.stop()


def test_concurrent_retries_of_one_request_commit_it_once(stack, aof_redis, reference):
    """Two attempts of the same new-session request at once (a client that retried too early):
    exactly one session gets the input, and both attempts end with the same output or ABORTED (the
    race lost, which the client library retries)."""
    outcomes: list = []

    def attempt():
        with client_for(stack, retry_s=0) as client:
            try:
                outcomes.append(client.generate(PROMPT, max_new_tokens=N, k=K, request_id="twice-at-once"))
            except grpc.RpcError as exc:
                outcomes.append(exc)

    threads = [threading.Thread(target=attempt) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = [o for o in outcomes if not isinstance(o, grpc.RpcError)]
    assert results, outcomes
    assert all(o.code() == grpc.StatusCode.ABORTED for o in outcomes if isinstance(o, grpc.RpcError)), outcomes
    assert all(r.token_ids == reference for r in results)
    SESSION_IDS.update(r.session_id for r in results)
    assert len({r.session_id for r in results}) == 1
    assert committed(aof_redis.client(), results[0].session_id) == PROMPT + reference


# ---- logs (last: it reads what every test above wrote) ---------------------------------------

def test_no_session_id_in_any_log(stack, tenants):
    """Every session the tests above made, looked for in every log line of every service (the
    main coordinator and the workers log at debug level)."""
    assert len(SESSION_IDS) >= 8
    logs = {p.name: p.read_text(errors="replace") for p in stack.log_dir.glob("*.log")}
    assert {"coordinator.log", "draft.log", "target.log", "coordinator#tenants.log"} <= set(logs)
    assert '"session": "s:' in logs["coordinator.log"]  # requests are logged, under the digest
    for name, text in logs.items():
        for session_id in SESSION_IDS:
            assert session_id not in text, f"session id in {name}"
