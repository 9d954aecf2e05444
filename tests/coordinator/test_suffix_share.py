"""Every coordinator replica's finished requests in every replica's suffix index, through a real
redis-server: exchange, warm-up of a replica that starts later, tenants kept apart, the streams'
bound, and Redis down (publishing never blocks or raises, lookups keep the local index, and what
was published meanwhile arrives once Redis is back)."""

from __future__ import annotations

import time

import pytest
import redis

from coordinator.suffix import SuffixIndex, SuffixProposer
from coordinator.suffix_share import TENANTS_KEY, SuffixShare, stream_key
from redis_servers import RedisServer
from specdec_core.serving.redis_client import connect_redis

pytestmark = pytest.mark.durability

PROMPT = [11, 12, 13, 14]
OUTPUT = [501, 502, 503, 504, 505, 506]


@pytest.fixture
def server(tmp_path):
    with RedisServer(tmp_path / "redis", appendonly=True) as server:
        yield server


def replica(url: str, **index_bounds) -> tuple[SuffixProposer, SuffixShare]:
    index = SuffixIndex(**index_bounds)
    share = SuffixShare(connect_redis(url, retry_s=0.5, timeout_s=2.0), index)
    return SuffixProposer(index, publish=share.publish), share


def eventually(condition, timeout_s: float = 30.0) -> None:
    """Wait for a background thread's effect (bounded: a defect fails, a slow machine only waits)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time limit"
        time.sleep(0.05)


def test_a_finished_request_reaches_the_other_replica_and_a_later_one_warms_up(server):
    a, share_a = replica(server.url)
    b, share_b = replica(server.url)
    a.finished("alpha", PROMPT + OUTPUT)
    share_a.sync(block_ms=0)
    assert share_b.sync(block_ms=0) == 1
    assert b.continuation([9, *PROMPT], 6, tenant="alpha") == OUTPUT
    assert share_a.sync(block_ms=0) == 0 and a.index.num_sequences("alpha") == 1  # its own, once
    c, share_c = replica(server.url)
    share_c.start()  # a replica that starts (or scales out) reads what was published before it
    try:
        assert c.continuation([9, *PROMPT], 6, tenant="alpha") == OUTPUT
    finally:
        share_c.stop()


@pytest.mark.security
def test_a_tenants_requests_reach_only_that_tenants_index(server):
    a, share_a = replica(server.url)
    b, share_b = replica(server.url)
    a.finished("alpha", PROMPT + OUTPUT)
    share_a.sync(block_ms=0)
    share_b.sync(block_ms=0)
    assert b.continuation([9, *PROMPT], 6, tenant="beta") == []
    assert b.index.num_tokens("beta") == 0 and b.index.num_tokens("alpha") == len(PROMPT + OUTPUT)


def test_each_tenants_stream_holds_about_what_its_index_holds_and_expires(server):
    a, share_a = replica(server.url, max_sequences=4, max_tokens=100)
    for i in range(600):
        a.finished("alpha", [i, i + 1, i + 2])
        if i % 50 == 0:
            share_a.sync(block_ms=0)
    share_a.sync(block_ms=0)
    client = redis.Redis.from_url(server.url)
    assert client.xlen(stream_key("alpha")) == 4 and a.index.num_sequences("alpha") == 4  # the sequence bound
    a.finished("alpha", list(range(1000, 1500)))  # longer than the token bound: its last 100 tokens
    a.finished("alpha", list(range(2000, 2040)))
    share_a.sync(block_ms=0)
    assert client.xlen(stream_key("alpha")) == 2  # the newest two: the bound of 100 tokens over requests of 40
    assert len(client.xrange(stream_key("alpha"))[0][1][b"ids"]) == 4 * 100
    assert client.smembers(TENANTS_KEY) == {b"alpha"}
    assert 0 < client.ttl(stream_key("alpha")) <= 86400 and 0 < client.ttl(TENANTS_KEY) <= 86400


def test_a_malformed_or_foreign_key_stops_nothing(server):
    """A tenant named like the tenants' set, and a malformed entry: the others' entries still arrive."""
    a, share_a = replica(server.url)
    b, share_b = replica(server.url)
    a.finished("tenants", PROMPT + OUTPUT)
    redis.Redis.from_url(server.url).xadd(stream_key("alpha"), {"ids": b"abc", "from": b"elsewhere"})
    a.finished("alpha", PROMPT + OUTPUT)
    share_a.sync(block_ms=0)
    assert share_b.sync(block_ms=0) == 2
    assert b.continuation([9, *PROMPT], 6, tenant="tenants") == OUTPUT
    assert b.continuation([9, *PROMPT], 6, tenant="alpha") == OUTPUT


def test_redis_down_keeps_the_local_index_and_delivers_what_was_published_meanwhile(server):
    a, share_a = replica(server.url)
    b, share_b = replica(server.url)
    share_a.start()
    share_b.start()
    try:
        server.kill()
        started = time.monotonic()
        for i in range(2000):  # more than the publishing queue holds: the oldest are dropped
            a.finished("alpha", [7, 7, 7, i + 1000])
        a.finished("alpha", PROMPT + OUTPUT)
        assert time.monotonic() - started < 5  # publishing only queues, whatever Redis does
        assert a.continuation([9, *PROMPT], 6, tenant="alpha") == OUTPUT  # the local index serves
        assert b.continuation([9, *PROMPT], 6, tenant="alpha") == []
        server.restart()
        eventually(lambda: b.continuation([9, *PROMPT], 6, tenant="alpha") == OUTPUT)
    finally:
        share_a.stop()
        share_b.stop()
