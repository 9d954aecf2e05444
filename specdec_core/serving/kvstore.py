"""A content-addressed KV tier in Redis: a worker that misses a session's KV restores it instead
of computing it again, and sessions that begin alike compute their common prefix once.

It lives in `serving`, not `engine`: it is the worker's Redis I/O (a writer thread, timeouts,
backoff), which the engine sees only as `SessionCaches`' tier.

Keys. A sequence is cut into chunks of `chunk_tokens` tokens; chunk j of a sequence is stored
under `<prefix>kv:<model>:<h_j>` where h_j hashes the whole token prefix up to the chunk's end
(h_j = blake2b(h_{j-1} + chunk j's tokens)), and <model> is a digest of the model's identity: its
weights' fingerprint, the backend's byte layout (dtype, layers, heads; a tensor-parallel shard has
its own), the tensor-parallel size and rank, and the chunk size. The KV of a prefix is a function
of the prefix alone, so whoever computed it, under whichever session, stored it for everyone; two
sessions that share a 1,000-token system prompt share its chunks.

Writing never holds a round: after a round, the chunks the committed tokens completed are copied
out of the backend (on the engine thread, while the pool still holds them) and queued; a writer
thread compresses, checksums and stores them. The queue is bounded in bytes; past the bound
chunks are dropped (counted), since this is a cache. Chunks a worker stored or restored lately are
remembered and not copied again.

Reading happens when a lease finds a session's cache short of its committed tokens: the chunks
after the cached part are fetched in one round trip, and the longest run of consecutive valid ones
is imported; the rest is prefilled as before.

Safety: every value carries a header with the model digest and the chunk's own prefix hash, its
token count, its length and a checksum of its payload; a value that does not match in every way
is ignored (and deleted, so that it is written again). Losing any value costs time, never
correctness. Redis errors never fail a request: the tier logs, counts, and stays out of the way for
`backoff_s`. Size the Redis with `maxmemory` and `allkeys-lru` (the chart and `specdec up` do),
apart from the session store, which must never evict.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specdec_core import metrics
from specdec_core.engine.kvcache import prefix_hash

log = logging.getLogger(__name__)

_MAGIC = b"SDKV"
_VERSION = 1
# magic, version, compression, model digest, prefix hash, tokens, payload bytes, payload CRC-32
# (CRC-32 rather than a cryptographic hash: it catches corruption at 3x blake2b's speed, ~2 GB/s)
_HEADER = struct.Struct("<4sBB16s16sIQI")
COMPRESSIONS = ("none", "zlib")


@dataclass(frozen=True)
class KVStoreOptions:
    """How a worker keeps session KV beyond its own cache: the KV tier (flags `--kv-store-url` and
    friends), and prefix blocks shared between sessions in its paged pool (`--prefix-sharing`)."""

    url: str = ""  # empty: no tier
    chunk_tokens: int = 64
    compression: str = "none"
    max_pending_mb: int = 256
    ttl_s: int = 0  # 0: no expiry (Redis evicts least recently used under maxmemory)
    prefix: str = "specdec:"
    prefix_sharing: bool = True

    def __post_init__(self):
        if self.chunk_tokens < 1:
            raise ValueError(f"kv_store chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"kv_store compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.max_pending_mb < 1 or self.ttl_s < 0:
            raise ValueError("kv_store max_pending_mb must be >= 1 and ttl_s >= 0")

    @classmethod
    def add_flags(cls, parser, env_prefix: str) -> None:
        import argparse
        import os

        env = os.environ.get
        g = parser.add_argument_group("session KV: prefix sharing, and the KV tier in Redis")
        g.add_argument("--prefix-sharing", action=argparse.BooleanOptionalAction, default=cls.prefix_sharing,
                       help="paged KV cache: sessions whose tokens begin alike hold the common blocks once, and a "
                            "new session adopts them instead of computing them")
        g.add_argument("--kv-store-url", default=env(f"{env_prefix}_KV_STORE_URL", env("SPECDEC_KV_STORE_URL", "")),
                       help="Redis (or Valkey) URL of the KV tier, apart from the session store, with maxmemory and "
                            "allkeys-lru: a worker restores a session's KV from it instead of prefilling again, and "
                            "sessions with a common prefix compute it once. Empty: off")
        g.add_argument("--kv-chunk-tokens", type=int, default=cls.chunk_tokens,
                       help="tokens per stored KV chunk (a restore brings back whole chunks)")
        g.add_argument("--kv-compression", choices=COMPRESSIONS, default=cls.compression,
                       help="compress stored chunks (zlib saves little on float KV; see benchmarks/results/kvstore.json)")
        g.add_argument("--kv-max-pending-mb", type=int, default=cls.max_pending_mb,
                       help="bound on chunks waiting to be written; past it chunks are dropped")
        g.add_argument("--kv-ttl", type=int, default=cls.ttl_s, help="seconds a stored chunk lives (0: until evicted)")

    @classmethod
    def from_args(cls, a) -> KVStoreOptions:
        return cls(a.kv_store_url, a.kv_chunk_tokens, a.kv_compression, a.kv_max_pending_mb, a.kv_ttl,
                   prefix_sharing=a.prefix_sharing)


def prefix_hashes(token_ids: list[int], chunk_tokens: int, num_chunks: int) -> list[bytes]:
    """h_0..h_{num_chunks-1}: chunk j's hash covers tokens 0 .. (j+1)*chunk_tokens."""
    hashes, h = [], b""
    for j in range(num_chunks):
        h = prefix_hash(h, token_ids[j * chunk_tokens:(j + 1) * chunk_tokens])
        hashes.append(h)
    return hashes


class KVTier:
    """One worker's (one rank's) view of the KV tier, over its local backend.

    `backend` needs `kv_layout()`, `export_kv(handle, ranges)` and `import_kv(handle, start, blobs,
    token_ids)` (the tokens the blobs hold: a backend that shares prefix blocks indexes them).
    `agree(n)`: under tensor parallelism, the number of chunks every rank can restore (the minimum
    over ranks; identity for one rank), so that all shards restore the same tokens."""

    def __init__(self, client, backend, model_fingerprint: str, options: KVStoreOptions, role: str = "worker",
                 tp_size: int = 1, tp_rank: int = 0, agree: Callable[[int], int] = lambda n: n,
                 remember: int = 65536):
        self.client = client
        self.backend = backend
        self.options = options
        self.chunk = options.chunk_tokens
        self.role = role
        self.agree = agree
        self.layout = backend.kv_layout()
        # chunks to gather before an export: a backend whose export copies the whole sequence
        # (llama.cpp) exports less often, so that its cost per round stays small
        self.save_every = max(1, int(getattr(backend, "kv_export_chunks", 1)))
        identity = f"{model_fingerprint}|{self.layout}|tp={tp_size}/{tp_rank}|chunk={self.chunk}"
        self.model_digest = hashlib.blake2b(identity.encode(), digest_size=16).digest()
        self._key_prefix = f"{options.prefix}kv:{self.model_digest.hex()}:".encode()
        self._known: OrderedDict[bytes, None] = OrderedDict()  # prefix hashes stored or restored lately
        self._remember = remember
        self._known_lock = threading.Lock()
        self._pending: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._max_pending = options.max_pending_mb << 20
        self._down_until = 0.0
        self._writer = threading.Thread(target=self._write_loop, name=f"kv-writer-{role}", daemon=True)
        self._writer.start()
        metrics.KV_PENDING_BYTES.labels(role).set_function(lambda: self._pending_bytes)
        log.info("KV tier on (%s): %d-token chunks, %s, model %s", role, self.chunk, self.layout,
                 self.model_digest.hex()[:12])

    def key(self, prefix_hash: bytes) -> bytes:
        return self._key_prefix + prefix_hash.hex().encode()

    # ------------------------------------------------------------------------------------------
    # The engine thread's side: cheap, never blocks on Redis when saving

    def save(self, handle: Any, token_ids: list[int], saved: int, upto: int) -> int:
        """Queue the chunks that tokens saved..upto completed (the handle holds at least `upto`
        of token_ids); returns how far chunks are now saved (a multiple of the chunk size)."""
        first, last = saved // self.chunk, upto // self.chunk
        if last <= first:
            return saved
        hashes = prefix_hashes(token_ids, self.chunk, last)[first:]
        todo = [(first + i, h) for i, h in enumerate(hashes) if not self._is_known(h)]
        if todo and self._is_up() and self._pending_bytes < self._max_pending:
            try:
                blobs = self.backend.export_kv(handle, [(j * self.chunk, (j + 1) * self.chunk) for j, _ in todo])
            except Exception:  # noqa: BLE001 - a cache: never fail the round
                log.exception("KV tier: export failed")
                return last * self.chunk
            for (_, h), blob in zip(todo, blobs):
                self._enqueue(h, blob)
        elif todo:
            metrics.KV_CHUNKS.labels(self.role, "dropped").inc(len(todo))
        return last * self.chunk

    def restore(self, handle: Any, token_ids: list[int], have: int, limit: int) -> int:
        """Bring the handle, which holds `have` tokens of token_ids, up to as many whole chunks
        of token_ids[:limit] as the tier holds; returns the tokens it holds now (>= have unless a
        restore began at a chunk boundary below `have` and failed: then that boundary)."""
        first, last = have // self.chunk, limit // self.chunk
        if last * self.chunk <= have or not self._is_up():
            self.agree(0)  # every rank takes part in `agree` exactly once
            return have
        started = time.perf_counter()
        hashes = prefix_hashes(token_ids, self.chunk, last)[first:]
        try:
            values = self.client.mget([self.key(h) for h in hashes])
        except Exception as exc:  # noqa: BLE001 - a cache: never fail the request
            self._went_down(exc)
            values = []
        blobs = []
        for h, value in zip(hashes, values):
            payload = self._decode(h, value)
            if payload is None:
                break
            blobs.append(payload)
        metrics.KV_CHUNKS.labels(self.role, "hit").inc(len(blobs))
        metrics.KV_CHUNKS.labels(self.role, "miss").inc(len(hashes) - len(blobs))
        count = self.agree(len(blobs))
        start = first * self.chunk
        if count == 0 or start + count * self.chunk <= have:
            return have
        if have > start:
            self.backend.crop(handle, start)
        try:
            new_len = self.backend.import_kv(handle, start, blobs[:count], token_ids[start:start + count * self.chunk])
        except Exception:  # noqa: BLE001 - all or nothing: the handle holds `start`; prefill the rest
            log.exception("KV tier: import failed")
            return start
        for h in hashes[:count]:
            self._remember_key(h)
        metrics.KV_RESTORED_TOKENS.labels(self.role).inc(new_len - have)
        metrics.KV_RESTORE_SECONDS.labels(self.role).observe(time.perf_counter() - started)
        return new_len

    # ------------------------------------------------------------------------------------------
    # Values

    def encode(self, prefix_hash: bytes, blob: bytes) -> bytes:
        compression = self.options.compression
        body = zlib.compress(blob, 1) if compression == "zlib" else blob
        header = _HEADER.pack(_MAGIC, _VERSION, COMPRESSIONS.index(compression), self.model_digest, prefix_hash,
                              self.chunk, len(blob), zlib.crc32(blob))
        return header + body

    def _decode(self, prefix_hash: bytes, value: bytes | None) -> bytes | None:
        """The payload, or None when the value is missing or does not match in every way (a
        mismatch is counted, logged, and deleted so that it is written again)."""
        if value is None:
            return None
        try:
            magic, version, compression, digest, stored_hash, tokens, size, checksum = _HEADER.unpack_from(value)
            body = value[_HEADER.size:]
            if (magic, version, digest, stored_hash, tokens) != (_MAGIC, _VERSION, self.model_digest, prefix_hash,
                                                                  self.chunk):
                raise ValueError("header does not match (model, prefix or chunk size)")
            if compression >= len(COMPRESSIONS):
                raise ValueError(f"unknown compression {compression}")
            payload = zlib.decompress(body) if COMPRESSIONS[compression] == "zlib" else body
            if len(payload) != size or zlib.crc32(payload) != checksum:
                raise ValueError("payload length or checksum does not match")
            if size == 0 or size % self.chunk:
                raise ValueError(f"{size} bytes are not {self.chunk} tokens")
            return payload
        except (struct.error, zlib.error, ValueError) as exc:
            metrics.KV_CHUNKS.labels(self.role, "invalid").inc()
            log.warning("KV tier: ignoring an invalid chunk %s: %s", prefix_hash.hex()[:12], exc)
            try:
                self.client.delete(self.key(prefix_hash))
            except Exception:  # noqa: BLE001
                pass
            return None

    # ------------------------------------------------------------------------------------------
    # The writer thread

    def _enqueue(self, prefix_hash: bytes, blob: bytes) -> None:
        with self._pending_lock:
            self._pending_bytes += len(blob)
        self._remember_key(prefix_hash)
        self._pending.put((prefix_hash, blob))

    def _write_loop(self) -> None:
        while True:
            batch = [self._pending.get()]
            while len(batch) < 16:
                try:
                    batch.append(self._pending.get_nowait())
                except queue.Empty:
                    break
            try:
                if self._is_up():
                    pipe = self.client.pipeline(transaction=False)
                    written = 0
                    for h, blob in batch:
                        value = self.encode(h, blob)
                        written += len(value)
                        pipe.set(self.key(h), value, ex=self.options.ttl_s or None)
                    pipe.execute()
                    metrics.KV_CHUNKS.labels(self.role, "stored").inc(len(batch))
                    metrics.KV_BYTES.labels(self.role, "written").inc(written)
                else:
                    self._forget([h for h, _ in batch])
                    metrics.KV_CHUNKS.labels(self.role, "dropped").inc(len(batch))
            except Exception as exc:  # noqa: BLE001 - a cache: drop and go on
                self._went_down(exc)
                self._forget([h for h, _ in batch])
                metrics.KV_CHUNKS.labels(self.role, "dropped").inc(len(batch))
            finally:
                with self._pending_lock:
                    self._pending_bytes -= sum(len(b) for _, b in batch)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued chunk is written (tests and benchmarks); whether it was."""
        deadline = time.monotonic() + timeout_s
        while self._pending_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._pending_bytes

    # ------------------------------------------------------------------------------------------
    # Bookkeeping

    def _is_known(self, prefix_hash: bytes) -> bool:
        with self._known_lock:
            if prefix_hash in self._known:
                self._known.move_to_end(prefix_hash)
                return True
            return False

    def _remember_key(self, prefix_hash: bytes) -> None:
        with self._known_lock:
            self._known[prefix_hash] = None
            self._known.move_to_end(prefix_hash)
            if len(self._known) > self._remember:
                self._known.popitem(last=False)

    def _forget(self, hashes: list[bytes]) -> None:
        with self._known_lock:
            for h in hashes:
                self._known.pop(h, None)

    def _is_up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _went_down(self, exc: BaseException, backoff_s: float = 5.0) -> None:
        metrics.KV_ERRORS.labels(self.role).inc()
        if self._is_up():
            log.warning("KV tier: Redis failed (%s); skipping it for %.0f s", exc, backoff_s)
        self._down_until = time.monotonic() + backoff_s


def open_tier(options: KVStoreOptions, backend, model_path: str, role: str, tp_size: int = 1, tp_rank: int = 0,
              agree: Callable[[int], int] = lambda n: n) -> KVTier | None:
    """The worker's KV tier when `options.url` names one (None otherwise). Its Redis calls time out
    after a second and are not retried: a slow cache must not hold a round."""
    if not options.url:
        return None
    if not all(hasattr(backend, m) for m in ("kv_layout", "export_kv", "import_kv")):
        log.warning("KV tier: the %s backend cannot export KV; the tier stays off", getattr(backend, "name", "?"))
        return None
    from specdec_core.serving.redis_client import connect_redis

    client = connect_redis(options.url, retry_s=0, timeout_s=1.0)
    return KVTier(client, backend, model_fingerprint(model_path), options, role, tp_size, tp_rank, agree)


def model_fingerprint(path: str, samples: int = 16, sample_bytes: int = 1 << 16) -> str:
    """A cheap fingerprint of a model's weights: for each weight file (a .gguf, or a folder's
    *.safetensors / *.bin / *.gguf), its name, size and blake2b of `samples` slices spread over
    it. Hashing every byte of a 100 GB model at start-up would take minutes."""
    from pathlib import Path

    root = Path(path)
    if not root.exists():  # a hub id that transformers resolves itself: its name is what we know
        return hashlib.blake2b(path.encode(), digest_size=16).hexdigest()
    files = [root] if root.is_file() else sorted(
        p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".json"))
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}|{size}|".encode())
        with open(f, "rb") as fh:
            for i in range(samples):
                fh.seek(max(0, (size - sample_bytes) * i // max(1, samples - 1)))
                h.update(fh.read(sample_bytes))
    return h.hexdigest()
