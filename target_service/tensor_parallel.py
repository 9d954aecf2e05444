"""Tensor parallelism for the target: N ranks under torchrun, weights sharded by transformers'
tensor-parallel plan (`DistributedConfig(tp_plan="auto")`), NCCL on GPUs and gloo on CPU.

Every rank holds its shard of every session's KV cache, so every cache operation (allocate, crop,
free, forward) must run on all ranks in the same order. Rank 0 serves gRPC and drives a
`ReplicatedBackend`: each call is broadcast to the other ranks (over a gloo group, whatever the
data backend) before it runs locally; the other ranks sit in `follow()` and replay the calls.
Logits come out replicated on every rank; rank 0 uses its own.

KV tier: every rank stores and restores its own shard's chunks (its own keys: the rank is part
of the model identity). A restore is broadcast like any call; the ranks then agree on the number
of chunks all of them found (an all-reduce MIN) before any imports, so the shards stay in step.

Failure: a collective that fails (a rank died) or times out makes rank 0 report NOT_SERVING and
exit non-zero; torchrun then stops the remaining ranks. Nothing hangs: rank 0 pings the followers
while idle so that their receive never outlives the group timeout by accident.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this rank when torchrun dies, however it dies (Linux): a rank
    must not outlive the service it belongs to."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # torchrun died before the call above
            os.kill(os.getpid(), signal.SIGTERM)


def init(device: str, timeout_s: float) -> tuple[str, dist.ProcessGroup]:
    """Join the process group torchrun set up; returns this rank's device and a gloo control group."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return device, control


class ReplicatedBackend:
    """Rank 0's backend: runs each call on every rank. Same interface as the local backend."""

    def __init__(self, local, control: dist.ProcessGroup, on_failure: Callable[[BaseException], None],
                 ping_every_s: float = 5.0, tier=None):
        self.local = local
        self.tier = None if tier is None else ReplicatedTier(self, tier)
        self.control = control
        self.on_failure = on_failure
        self.name, self.vocab_size, self.num_parameters = local.name, local.vocab_size, local.num_parameters
        self.max_context, self.dtype, self.device = local.max_context, local.dtype, local.device
        self.capacity, self.units_for = local.capacity, local.units_for  # rank 0's state mirrors every rank's
        if not hasattr(local, "share_prefix"):  # a backend that shares no blocks (SessionCaches checks)
            self.share_prefix = self.blocks_needed = None
        self._handles: dict[int, object] = {}
        self._next_handle = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pinger = threading.Thread(target=self._ping, args=(ping_every_s,), daemon=True)
        self._pinger.start()

    def allocate(self) -> int:
        with self._lock:
            handle = self._next_handle
            self._next_handle += 1
            self._broadcast(("allocate", handle))
            self._handles[handle] = self.local.allocate()
            return handle

    def crop(self, handle: int, length: int) -> None:
        self._call("crop", handle, length)

    def free(self, handle: int) -> None:
        self._call("free", handle)
        self._handles.pop(handle, None)

    def forward(self, handle: int, token_ids: list[int], start: int, num_logits: int | None = None) -> torch.Tensor:
        return self._call("forward", handle, token_ids, start, num_logits)

    def share_prefix(self, handle: int, token_ids: list[int], limit: int) -> int:
        return self._call("share_prefix", handle, token_ids, limit)

    def blocks_needed(self, handle: int, length: int) -> int:
        return self.local.blocks_needed(self._handles[handle], length)  # bookkeeping only: rank 0's suffices

    @property
    def num_free_blocks(self) -> int:
        return self.local.num_free_blocks  # rank 0's pool mirrors every rank's

    def forward_batch(self, items: list[tuple[int, list[int], int]],
                      num_logits: list[int] | None = None) -> list[torch.Tensor]:
        with self._lock:
            self._check_handles([h for h, _, _ in items])
            self._broadcast(("forward_batch", items, num_logits))
            return self.local.forward_batch([(self._handles[h], ids, start) for h, ids, start in items], num_logits)

    def shutdown(self) -> None:
        self._stop.set()
        with self._lock:
            self._broadcast(("stop",))

    def _call(self, op: str, handle: int, *args, on=None):
        with self._lock:
            self._check_handles([handle])
            self._broadcast((op, handle, *args))
            return getattr(on or self.local, op.removeprefix("kv_"))(self._handles[handle], *args)

    def _check_handles(self, handles: list[int]) -> None:
        """Refuse a call on rank 0 before any rank sees it: followers only replay calls that
        rank 0 accepted."""
        unknown = [h for h in handles if h not in self._handles]
        if unknown:
            raise ValueError(f"cache handle {unknown[0]} is not allocated")

    def _broadcast(self, message: tuple) -> None:
        try:
            dist.broadcast_object_list([message], src=0, group=self.control)
        except Exception as exc:  # noqa: BLE001 - any collective failure is fatal for the service
            self.on_failure(exc)
            raise

    def _ping(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            with self._lock:
                try:
                    self._broadcast(("ping",))
                except Exception:  # noqa: BLE001 - on_failure already ran
                    return


class ReplicatedTier:
    """Rank 0's KV tier: each save and restore runs on every rank, on that rank's own tier."""

    def __init__(self, backend: ReplicatedBackend, local_tier):
        self.backend, self.local = backend, local_tier
        self.chunk, self.save_every = local_tier.chunk, local_tier.save_every

    def save(self, handle: int, token_ids: list[int], saved: int, upto: int) -> int:
        return self.backend._call("kv_save", handle, token_ids, saved, upto, on=self.local)

    def restore(self, handle: int, token_ids: list[int], have: int, limit: int) -> int:
        return self.backend._call("kv_restore", handle, token_ids, have, limit, on=self.local)


def agree_min(control: dist.ProcessGroup) -> Callable[[int], int]:
    """For the KV tier: the smallest of every rank's number (each rank calls it once, in step)."""
    def agree(n: int) -> int:
        t = torch.tensor([n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control)
        return int(t)
    return agree


def follow(local, control: dist.ProcessGroup, tier=None) -> None:
    """Ranks > 0: replay rank 0's calls on the local shard (and its KV tier) until told to stop."""
    handles: dict[int, object] = {}
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        op, *args = box[0]
        if op == "stop":
            return
        if op == "ping":
            continue
        try:
            _replay(tier if op.startswith("kv_") else local, handles, op.removeprefix("kv_"), args)
        except Exception:  # noqa: BLE001 - rank 0 met the same error and answered it; stay in step
            log.exception("rank %d: %s failed", rank(), op)


def _replay(local, handles: dict[int, object], op: str, args: list) -> None:
    if op == "allocate":
        handles[args[0]] = local.allocate()
    elif op == "forward_batch":
        local.forward_batch([(handles[h], ids, start) for h, ids, start in args[0]], args[1])
    elif op == "free":
        local.free(handles.pop(args[0]))
    else:
        getattr(local, op)(handles[args[0]], *args[1:])
