"""Session state in a real Redis server: atomic commits, the busy lease, expiry, errors."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from coordinator.__main__ import connect_redis
from coordinator.sessions import SessionStore
from specdec.launcher import Stack
from specdec_core.errors import FailedPrecondition, NotFound, Unavailable


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
    with pytest.raises(FailedPrecondition):
        store.commit(stale, [99])
    assert store.load(s.session_id).token_ids == [1, 2]


def test_racing_writers_exactly_one_wins(store):
    s = store.new(seed=1)
    store.commit(s, [0])
    copies = [store.load(s.session_id) for _ in range(8)]
    outcomes = []

    def write(copy, token):
        try:
            store.commit(copy, [token])
            outcomes.append(token)
        except FailedPrecondition:
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
        f"lease on session {s.session_id} lost (expired, another request may hold it); no longer renewing it"]
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
    assert store.delete(s.session_id)
    with pytest.raises(NotFound):
        store.load(s.session_id)


def test_redis_down_is_unavailable():
    dead = SessionStore(connect_redis("redis://127.0.0.1:1/0"))
    with pytest.raises(Unavailable, match="Redis"):
        dead.load("x")
    with pytest.raises(Unavailable):
        dead.commit(dead.new(seed=1), [1])


def test_redis_auth(tmp_path):
    import subprocess

    from specdec.launcher import _wait_port, free_port, redis_server_binary

    port = free_port()
    server = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--requirepass", "s3cret", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, 10)
        good = SessionStore(connect_redis(f"redis://:s3cret@127.0.0.1:{port}/0"))
        s = good.new(seed=1)
        good.commit(s, [1, 2])
        assert good.load(s.session_id).token_ids == [1, 2]
        with pytest.raises(Unavailable):
            SessionStore(connect_redis(f"redis://:wrong@127.0.0.1:{port}/0")).load(s.session_id)
    finally:
        server.terminate()
        server.wait()
