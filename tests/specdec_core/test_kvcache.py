"""KV-cache bookkeeping: prefix rollback, the token budget with LRU eviction (never a session in
flight), slot limits, and busy sessions."""

from __future__ import annotations

import pytest
import torch

from specdec_core.errors import FailedPrecondition, ResourceExhausted
from specdec_core.kvcache import SessionCaches, common_prefix_len


class RecordingBackend:
    """A stand-in for a model (the bookkeeping is what is under test): logits are a function of
    (position, token) and every call is recorded."""

    vocab_size = 16

    def __init__(self):
        self.lengths: dict[int, int] = {}
        self.freed: list[int] = []
        self._next = 0

    def allocate(self):
        self._next += 1
        self.lengths[self._next] = 0
        return self._next

    def crop(self, handle, length):
        assert length <= self.lengths[handle]
        self.lengths[handle] = length

    def free(self, handle):
        self.freed.append(handle)
        del self.lengths[handle]

    def forward(self, handle, token_ids, start, num_logits=None):
        assert self.lengths[handle] == start
        self.lengths[handle] += len(token_ids)
        return torch.zeros(len(token_ids) if num_logits is None else num_logits, self.vocab_size)


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0


def test_lease_rolls_back_to_the_committed_prefix_and_keeps_the_last_token_uncached():
    backend = RecordingBackend()
    caches = SessionCaches(backend, max_tokens=1000)
    with caches.lease("s", [1, 2, 3]) as seq:
        caches.extend(seq, [1, 2, 3, 9, 9])  # committed + two drafts
    with caches.lease("s", [1, 2, 3, 9, 5]) as seq:  # one draft accepted, one rejected
        assert seq.token_ids == [1, 2, 3, 9]
        assert backend.lengths[seq.handle] == 4
    with caches.lease("s", [1, 2, 3, 9]) as seq:  # fully cached: the last token is recomputed
        assert seq.token_ids == [1, 2, 3]


def test_budget_evicts_least_recently_used_idle_sessions_only():
    backend = RecordingBackend()
    caches = SessionCaches(backend, max_tokens=10)
    for name in ("a", "b"):
        with caches.lease(name, [1, 2, 3, 4]) as seq:
            caches.extend(seq, [1, 2, 3, 4])
    with caches.lease("c", [5, 6, 7, 8]) as seq:
        caches.extend(seq, [5, 6, 7, 8])
        with caches.lease("d", [1, 2]) as other:  # c is in flight while d finishes
            caches.extend(other, [1, 2])
        assert caches.num_tokens <= 10 and "c" in caches._sequences
    assert "a" not in caches._sequences  # the oldest idle one went first
    assert caches.num_tokens <= 10


def test_slot_limit_evicts_idle_and_refuses_when_all_are_busy():
    caches = SessionCaches(RecordingBackend(), max_tokens=1000, max_sessions=2)
    with caches.lease("a", [1]):
        pass
    with caches.lease("b", [1]):
        with caches.lease("c", [1]):  # evicts a (idle)
            assert set(caches._sequences) == {"b", "c"}
            with pytest.raises(ResourceExhausted):
                with caches.lease("d", [1]):
                    pass


def test_a_session_in_flight_is_busy():
    caches = SessionCaches(RecordingBackend(), max_tokens=1000)
    with caches.lease("a", [1]):
        with pytest.raises(FailedPrecondition, match="busy"):
            with caches.lease("a", [1]):
                pass


def test_a_failed_forward_empties_the_cache():
    backend = RecordingBackend()
    caches = SessionCaches(backend, max_tokens=1000)
    with pytest.raises(RuntimeError):
        with caches.lease("a", [1, 2, 3]) as seq:
            caches.extend(seq, [1, 2])
            raise RuntimeError("forward blew up")
    with caches.lease("a", [1, 2, 3]) as seq:
        assert seq.token_ids == []


def test_release_frees():
    backend = RecordingBackend()
    caches = SessionCaches(backend, max_tokens=1000)
    with caches.lease("a", [1, 2]) as seq:
        caches.extend(seq, [1])
    assert caches.release("a") and not caches.release("a")
    assert backend.freed == [1]
