"""Per-session KV caches that are only caches.

A worker never trusts its cache: each request carries the committed sequence, the cache is cut
back to the longest prefix it shares with it (rolled-back draft tokens and anything a restart or a
re-route left behind disappear here), and the rest is recomputed. Caches are bounded by a token
budget; least-recently-used sessions that are not in flight are evicted first.

A `CacheBackend` owns the actual tensors (a transformers `DynamicCache`, a llama.cpp sequence
slot, ...); `SessionCaches` does the bookkeeping that is the same for all of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specdec_core import metrics
from specdec_core.errors import FailedPrecondition, ResourceExhausted


class CacheBackend(Protocol):
    """A model whose KV cache can be held per sequence, extended, and cut back."""

    vocab_size: int

    def allocate(self) -> Any:
        """A new, empty cache handle."""

    def crop(self, handle: Any, length: int) -> None:
        """Cut the handle's cache back to its first `length` tokens."""

    def free(self, handle: Any) -> None:
        """Release the handle's memory."""

    def forward(self, handle: Any, token_ids: list[int], start: int, num_logits: int | None = None) -> torch.Tensor:
        """Append token_ids at positions start.. (the cache holds exactly `start` tokens) and
        return the next-token logits of the last `num_logits` of them (default all)
        [num_logits, V] (float32)."""


def logits_per_item(items: list[tuple[Any, list[int], int]], num_logits: list[int] | None) -> list[int]:
    """For a backend's forward_batch: per item (handle, token_ids, start), how many trailing rows of
    logits to return, num_logits[i] clamped to [0, len(token_ids)] (all of them when not given)."""
    if num_logits is None:
        return [len(ids) for _, ids, _ in items]
    if len(num_logits) != len(items):
        raise ValueError(f"num_logits has {len(num_logits)} entries for {len(items)} items")
    return [max(0, min(int(k), len(ids))) for (_, ids, _), k in zip(items, num_logits)]


@dataclass
class CachedSequence:
    handle: Any
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV the handle holds
    last_used: float = 0.0
    is_in_use: bool = False


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: one C-level comparison
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class SessionCaches:
    def __init__(self, backend: CacheBackend, max_tokens: int, max_sessions: int | None = None, role: str = "worker"):
        self.backend = backend
        self.role = role
        self.max_tokens = max_tokens
        self.max_sessions = max_sessions  # for backends with a fixed number of sequence slots
        self._sequences: dict[str, CachedSequence] = {}
        self._lock = threading.Lock()

    @contextmanager
    def lease(self, session_id: str, committed_ids: list[int]) -> Iterator[CachedSequence]:
        """The session's cache, cut back to what agrees with committed_ids, with at least the last
        committed token left uncached (its logits are needed to predict what follows)."""
        with self._lock:
            seq = self._sequences.get(session_id)
            if seq is None:
                if self.max_sessions is not None and len(self._sequences) >= self.max_sessions:
                    self._evict_idle(len(self._sequences) - self.max_sessions + 1)
                seq = CachedSequence(handle=self.backend.allocate())
                self._sequences[session_id] = seq
            elif seq.is_in_use:
                raise FailedPrecondition(f"session {session_id!r} is busy on this worker")
            seq.is_in_use = True
        try:
            keep = min(common_prefix_len(seq.token_ids, committed_ids), len(committed_ids) - 1)
            self.crop(seq, keep)
            yield seq
        except BaseException:
            self.crop(seq, 0)  # a half-done forward pass leaves the cache in an unknown state
            raise
        finally:
            with self._lock:
                seq.is_in_use = False
                seq.last_used = time.monotonic()
                self._evict_over_budget()
                metrics.CACHE_TOKENS.labels(self.role).set(self.num_tokens)
                metrics.CACHE_SESSIONS.labels(self.role).set(len(self._sequences))

    def extend(self, seq: CachedSequence, token_ids: list[int], num_logits: int | None = None) -> torch.Tensor:
        """Feed token_ids after the cached ones; the next-token logits of the last `num_logits`
        of them (default all) [num_logits, V]."""
        logits = self.backend.forward(seq.handle, token_ids, len(seq.token_ids), num_logits)
        seq.token_ids.extend(token_ids)
        return logits

    def extend_batch(self, items: list[tuple[CachedSequence, list[int]]],
                     num_logits: list[int] | None = None) -> list[torch.Tensor]:
        """Several sessions' extensions in one model step when the backend can batch; per item the
        logits of its last `num_logits[i]` tokens (default all)."""
        keep = num_logits or [None] * len(items)
        forward_batch = getattr(self.backend, "forward_batch", None)
        if forward_batch is None:
            return [self.extend(seq, ids, k) for (seq, ids), k in zip(items, keep)]
        logits = forward_batch([(seq.handle, ids, len(seq.token_ids)) for seq, ids in items], num_logits)
        for seq, ids in items:
            seq.token_ids.extend(ids)
        return logits

    def crop(self, seq: CachedSequence, length: int) -> None:
        if length < len(seq.token_ids):
            self.backend.crop(seq.handle, length)
            del seq.token_ids[length:]

    def release(self, session_id: str) -> bool:
        with self._lock:
            seq = self._sequences.pop(session_id, None)
        if seq is None:
            return False
        self.backend.free(seq.handle)
        return True

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self._sequences.values())

    @property
    def num_sessions(self) -> int:
        return len(self._sequences)

    def _idle_oldest_first(self) -> list[str]:
        return [sid for _, sid in sorted((s.last_used, sid) for sid, s in self._sequences.items() if not s.is_in_use)]

    def _evict(self, session_id: str) -> CachedSequence:
        seq = self._sequences.pop(session_id)
        self.backend.free(seq.handle)
        metrics.CACHE_EVICTIONS.labels(self.role).inc()
        return seq

    def _evict_idle(self, count: int) -> None:
        idle = self._idle_oldest_first()
        if len(idle) < count:
            raise ResourceExhausted(f"all {len(self._sequences)} cache slots are in use")
        for sid in idle[:count]:
            self._evict(sid)

    def _evict_over_budget(self) -> None:
        total = self.num_tokens
        if total <= self.max_tokens:
            return
        for sid in self._idle_oldest_first():
            if total <= self.max_tokens:
                break
            total -= len(self._evict(sid).token_ids)
