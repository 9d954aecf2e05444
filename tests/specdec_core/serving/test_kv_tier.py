"""specdec_core.serving.kvstore over a real redis-server and the paged backend of a tiny Llama: what one
worker stored, a fresh worker restores bit for bit; a shared prefix is computed once; values that
are corrupted, truncated or from another model are detected and ignored; a Redis that is down or
full costs time, never a request."""

from __future__ import annotations

import pytest
import redis
import torch

from specdec_core import metrics
from specdec_core.engine.batched_backend import BatchedBackend
from specdec_core.engine.kvcache import SessionCaches
from specdec_core.serving.kvstore import KVStoreOptions, KVTier, prefix_hashes
from redis_servers import RedisServer, free_port
from tiny_models import tiny_llama

pytestmark = pytest.mark.kvstore

VOCAB = 256
CHUNK = 16


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("kv-redis"), appendonly=False, maxmemory="64mb",
                     extra_args=["--maxmemory-policy", "allkeys-lru"]) as srv:
        yield srv


@pytest.fixture
def client(server):
    c = server.client()
    c.flushall()
    return c


def worker(model, client, fingerprint="tiny", compression="none"):
    """A fresh worker's caches: a new paged pool (nothing cached) over the shared tier."""
    backend = BatchedBackend(model, max_tokens=2048, block_size=8)
    tier = KVTier(client, backend, fingerprint, KVStoreOptions(url="x", chunk_tokens=CHUNK, compression=compression),
                  role="test")
    return SessionCaches(backend, role="test", tier=tier), tier


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(caches: SessionCaches, session: str, committed: list[int], extra: list[int]) -> tuple[int, torch.Tensor]:
    """One round as a worker runs it: lease (restoring what the tier has), feed the uncached tail
    plus `extra`, and return (tokens the lease found or restored, the logits of every fed token)."""
    with caches.lease(session, committed) as seq:
        had = len(seq.token_ids)
        logits = caches.extend(seq, committed[had:] + extra)
    return had, logits


def counted(outcome: str) -> float:
    return metrics.KV_CHUNKS.labels("test", outcome)._value.get()


def test_fresh_worker_restores_bit_for_bit(model, client):
    prompt = tokens(100, seed=1)
    a, tier_a = worker(model, client)
    had, _ = run(a, "s", prompt, [])
    assert had == 0 and tier_a.flush()
    assert len(client.keys("specdec:kv:*")) == 100 // CHUNK  # committed whole chunks, no more

    b, _ = worker(model, client)  # a restarted worker: nothing cached
    follow = tokens(5, seed=2)
    had_b, got = run(b, "s", prompt + follow, [])
    assert had_b == 6 * CHUNK  # 96 of the first 104 tokens restored; the 9 after them prefilled

    ref = SessionCaches(BatchedBackend(model, max_tokens=2048, block_size=8), role="ref")  # no tier
    with ref.lease("s", prompt + follow) as seq:
        ref.extend(seq, prompt[:96])
        want = ref.extend(seq, (prompt + follow)[96:])
    assert torch.equal(got, want)  # the restored KV is the stored bytes: logits bit-identical


def test_shared_prefix_is_restored_by_a_new_session(model, client):
    """Another worker (say, a replica) restores the prefix a session stored; inside one worker a
    new session adopts the blocks that hold it (one copy in memory, nothing fetched)."""
    system = tokens(64, seed=3)
    a, tier_a = worker(model, client)
    run(a, "first", system + tokens(20, seed=4), [])
    tier_a.flush()
    hits = counted("hit")
    b, _ = worker(model, client)
    had, _ = run(b, "second", system + tokens(30, seed=5), [])
    assert had == 64 and counted("hit") - hits == 4  # the 5th chunk differs: a miss

    free = a.backend.num_free_blocks
    hits = counted("hit")
    had, _ = run(a, "third", system + tokens(30, seed=6), [])
    assert had == 64 and counted("hit") == hits  # shared in the pool, not restored
    assert a.backend.shared_blocks == 64 // 8  # the pool's blocks of 8 tokens, held by both sessions
    assert free - a.backend.num_free_blocks == -(-(94 - 64) // 8)  # only the new tail took blocks


def test_corrupted_truncated_and_foreign_values_are_ignored(model, client):
    prompt = tokens(80, seed=6)
    a, tier_a = worker(model, client)
    run(a, "s", prompt, [])
    tier_a.flush()
    keys = [tier_a.key(h) for h in prefix_hashes(prompt, CHUNK, 5)]
    value = bytearray(client.get(keys[2]))
    value[-1] ^= 0xFF  # one flipped bit of payload: the checksum catches it
    client.set(keys[2], bytes(value))
    client.set(keys[3], client.get(keys[3])[:-8])  # truncated
    invalid = counted("invalid")
    b, _ = worker(model, client)
    had, _ = run(b, "s", prompt, [])
    assert had == 2 * CHUNK  # the chunks before the corrupted one; nothing after it
    assert counted("invalid") - invalid == 1 and not client.exists(keys[2])  # deleted, to be written again

    c, _ = worker(model, client, fingerprint="other weights")
    assert run(c, "s", prompt, [])[0] == 0  # another model's chunks are other keys
    assert c.tier.flush()  # (its own chunks are written now, not after the value set below)
    client.set(tier_a.key(prefix_hashes(prompt, CHUNK, 1)[0]).replace(tier_a.model_digest.hex().encode(),
                                                                      c.tier.model_digest.hex().encode()),
               client.get(keys[0]))  # a value copied under another model's key: its header says so
    invalid = counted("invalid")
    d, _ = worker(model, client, fingerprint="other weights")
    assert run(d, "s", prompt, [])[0] == 0 and counted("invalid") - invalid == 1


def test_compressed_chunks_restore_the_same(model, client):
    prompt = tokens(40, seed=7)
    a, tier_a = worker(model, client, compression="zlib")
    run(a, "s", prompt, [])
    tier_a.flush()
    b, _ = worker(model, client, compression="zlib")
    assert run(b, "s", prompt + [1], [])[0] == 32


def test_redis_down_costs_time_not_requests(model):
    dead = redis.Redis(port=free_port(), socket_timeout=0.5, socket_connect_timeout=0.5)
    caches, tier = worker(model, dead)
    prompt = tokens(50, seed=8)
    had, logits = run(caches, "s", prompt, [])  # the read fails: prefilled as without a tier
    assert had == 0 and logits.shape == (50, VOCAB)
    assert tier.flush()
    caches, _ = worker(model, dead)
    caches.tier._went_down(ConnectionError("test"))
    had, _ = run(caches, "t", prompt, [])  # skipped while it is down: no wait
    assert had == 0


def test_full_redis_evicts_chunks_not_requests(model, tmp_path):
    """A KV Redis at its maxmemory with allkeys-lru evicts old chunks: restores get shorter, never wrong."""
    with RedisServer(tmp_path, appendonly=False, maxmemory="2mb",
                     extra_args=["--maxmemory-policy", "allkeys-lru"]) as small:
        client = small.client()
        a, tier_a = worker(model, client)
        for i in range(40):  # 40 x 64 tokens x 2 KiB/token: far past 2 MB
            run(a, f"s{i}", tokens(64, seed=100 + i), [])
        assert tier_a.flush()
        assert client.info("stats")["evicted_keys"] > 0
        b, _ = worker(model, client)
        last = tokens(64, seed=139)
        had, logits = run(b, "s39", last + [1], [])
        assert had == 64 and logits.shape == (1, VOCAB)  # the newest session is still there
