"""The KV tier through the running services: workers restarted (their caches gone) restore a
session's KV from Redis instead of prefilling it, a new session restores a prefix another session
stored, and corrupted values are ignored; output stays identical to the target alone throughout."""

from __future__ import annotations

import random
import time

import pytest
import redis

from specdec import Client
from specdec.launcher import free_port
from stacks import scrape, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.kvstore]

CHUNK = 32


@pytest.fixture(scope="module")
def stack(tiny_pair, tmp_path_factory):
    ports = {role: free_port() for role in ("draft", "target")}
    args = {role: ["--metrics-port", str(port), "--kv-chunk-tokens", str(CHUNK)] for role, port in ports.items()}
    stack = start_stack(*tiny_pair, tmp_path_factory.mktemp("logs"), args=args, kv_store_mb=64)
    stack.metrics_ports = ports
    yield stack
    stack.down()


@pytest.fixture
def kv(stack):
    r = redis.Redis.from_url(stack.kv_store_url)
    r.flushall()
    return r


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 5000) for _ in range(n)]


def restart_workers(stack) -> None:
    """Both workers restarted (nothing cached), then the coordinator (fresh channels to them)."""
    for name in ("draft", "target", "coordinator"):
        stack.restart(name)


def kv_metric(stack, role: str, name: str, outcome: str = "") -> float:
    labels = f'outcome="{outcome}",role="{role}"' if outcome else f'role="{role}"'
    return scrape(stack.metrics_ports[role]).get(f"specdec_kv_store_{name}{{{labels}}}", 0.0)


def wait_stored(kv: redis.Redis, chunks: int, timeout_s: float = 60.0) -> None:
    """Chunks are written behind the rounds: wait until both workers' are in Redis."""
    deadline = time.monotonic() + timeout_s
    while len(kv.keys("specdec:kv:*")) < 2 * chunks and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(kv.keys("specdec:kv:*")) >= 2 * chunks


@pytest.mark.lossless
def test_session_continued_on_restarted_workers_is_restored_and_identical(stack, kv, hf_greedy):
    ids = prompt(300, seed=1)
    with Client(stack.address("coordinator"), timeout_s=120) as c:
        first = c.generate(ids, max_new_tokens=24, k=4)
    wait_stored(kv, 300 // CHUNK)
    restart_workers(stack)
    with Client(stack.address("coordinator"), timeout_s=120) as c:
        second = c.generate([24], max_new_tokens=16, k=4, session_id=first.session_id)
    history = ids + first.token_ids + [24]
    assert second.token_ids == hf_greedy(history, 16)
    for role in ("target", "draft"):  # both restored (at least) the prompt's whole chunks
        assert kv_metric(stack, role, "restored_tokens_total") >= 300 // CHUNK * CHUNK, role


@pytest.mark.lossless
def test_new_session_restores_a_shared_prefix(stack, kv, hf_greedy):
    system = prompt(200, seed=2)
    with Client(stack.address("coordinator"), timeout_s=120) as c:
        c.generate(system + prompt(10, seed=3), max_new_tokens=8, k=4)
    wait_stored(kv, 200 // CHUNK)
    restart_workers(stack)
    other = system + prompt(12, seed=4)
    with Client(stack.address("coordinator"), timeout_s=120) as c:
        result = c.generate(other, max_new_tokens=16, k=4)
    assert result.token_ids == hf_greedy(other, 16)
    assert kv_metric(stack, "target", "restored_tokens_total") >= 200 // CHUNK * CHUNK
    assert kv_metric(stack, "target", "chunks_total", "hit") >= 200 // CHUNK


@pytest.mark.lossless
def test_corrupted_chunks_are_ignored(stack, kv, hf_greedy):
    ids = prompt(160, seed=5)
    with Client(stack.address("coordinator"), timeout_s=120) as c:
        first = c.generate(ids, max_new_tokens=12, k=4)
    wait_stored(kv, 160 // CHUNK)
    for key in kv.keys("specdec:kv:*"):
        value = bytearray(kv.get(key))
        value[len(value) // 2] ^= 0x01  # one bit inside the KV payload
        kv.set(key, bytes(value))
    restart_workers(stack)
    with Client(stack.address("coordinator"), timeout_s=120) as c:
        second = c.generate([7], max_new_tokens=16, k=4, session_id=first.session_id)
    assert second.token_ids == hf_greedy(ids + first.token_ids + [7], 16)
    for role in ("target", "draft"):
        assert kv_metric(stack, role, "chunks_total", "invalid") >= 1, role
        assert kv_metric(stack, role, "restored_tokens_total") == 0, role
