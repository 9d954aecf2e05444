"""Merging concurrent requests from different sessions into one model step.

Handler threads `submit` tasks and wait. One engine thread takes everything queued (waiting at
most `window_s` for more after the first task, up to `max_batch` tasks) and runs them as one batch;
requests that arrive while a batch runs form the next one, so at concurrency 1 nothing waits and
at high concurrency batches fill by themselves. A full queue answers RESOURCE_EXHAUSTED at once
instead of growing latency without bound; a task whose caller has gone away is dropped unrun.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from specdec_core import metrics
from specdec_core.errors import Cancelled, ResourceExhausted

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Pending(Generic[T]):
    task: T
    key: str  # tasks with the same key never share a batch (one session's cache)
    is_cancelled: Callable[[], bool]
    future: Future = field(default_factory=Future)


class BatchQueue(Generic[T, R]):
    def __init__(self, process: Callable[[list[T]], list[R | BaseException]], window_s: float = 0.001,
                 max_batch: int = 32, max_queue: int = 256, name: str = "batch"):
        self.process = process
        self.window_s = window_s
        self.max_batch = max_batch
        self._queue: queue.Queue[_Pending[T]] = queue.Queue(maxsize=max_queue)
        self._deferred: list[_Pending[T]] = []
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def submit(self, task: T, key: str, is_cancelled: Callable[[], bool] = lambda: False) -> R:
        pending = _Pending(task, key, is_cancelled)
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            raise ResourceExhausted(f"worker overloaded: {self._queue.maxsize} requests queued") from None
        metrics.QUEUE_DEPTH.set(self._queue.qsize())
        return pending.future.result()

    def _run(self) -> None:
        while True:
            live = []
            for pending in self._collect():
                if pending.is_cancelled():
                    pending.future.set_exception(Cancelled("the caller went away"))
                else:
                    live.append(pending)
            if not live:
                continue
            try:
                results = self.process([p.task for p in live])
            except BaseException as exc:  # noqa: BLE001 - the whole batch failed
                results = [exc] * len(live)
            for pending, result in zip(live, results):
                if isinstance(result, BaseException):
                    pending.future.set_exception(result)
                else:
                    pending.future.set_result(result)

    def _collect(self) -> list[_Pending[T]]:
        batch, keys = [], set()
        waiting, self._deferred = self._deferred, []
        if not waiting:
            waiting.append(self._queue.get())
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_batch:
            if not waiting:
                try:
                    waiting.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            pending = waiting.pop(0)
            if pending.key in keys:
                self._deferred.append(pending)
            else:
                keys.add(pending.key)
                batch.append(pending)
        self._deferred += waiting
        metrics.QUEUE_DEPTH.set(self._queue.qsize())
        return batch
