"""Merging concurrent requests from different sessions into one model step.

Handler threads `submit` tasks and wait. One engine thread takes everything queued (waiting at
most `window_s` for more after the first task, up to `max_batch` tasks) and runs them as one batch;
requests that arrive while a batch runs form the next one, so at concurrency 1 nothing waits and
at high concurrency batches fill by themselves.

Regrouping: the sessions of one batch come back at slightly different times (each goes through
its coordinator round first), and taking only those back first would split them into two batches
that alternate for good, each paying the step's fixed cost (reading the weights): 8 plain decodes
as batches of 3 and 5 cost ~1.6x one batch of 8. So while a member of the last batch is still
missing, the engine waits for it a little longer than the window: a quarter of the mean batch
time, at most 20 ms (or `regroup_s`). A session that ended is missed once: the batch formed without
it is the next one's reference.

A task may take several batches: a step that answers `Again` for it has done a part of it (a chunk
of a long prefill, one of several decoding steps) and runs it, or the rest it names, in the next
batch, ahead of anything queued, so that a long task shares the engine with the short ones instead
of stalling them.

Admission: a full queue answers RESOURCE_EXHAUSTED at once instead of growing latency without
bound, and so does a task whose deadline the work ahead of it would miss: the rest of the batch
running now, plus the batches queued ahead and its own, each at the recent mean batch time. With
nothing running or queued a task is always admitted (so one slow batch cannot shut the door for
good). A task whose caller has gone away is dropped unrun. The engine thread survives anything a
batch raises.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from specdec_core import metrics
from specdec_core.errors import Cancelled, ResourceExhausted

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Again:
    """A step's result for a task that it has only partly done: run it again in the next batch, as
    `rest` if given (what is left of it), else as it is."""

    rest: object = None


AGAIN = Again()


@dataclass
class _Pending(Generic[T]):
    task: T
    key: str  # tasks with the same key never share a batch (one session's cache)
    is_cancelled: Callable[[], bool]
    future: Future = field(default_factory=Future)


class BatchQueue(Generic[T, R]):
    def __init__(self, process: Callable[[list[T]], list[R | BaseException | Again]], window_s: float = 0.001,
                 max_batch: int = 32, max_queue: int = 256, name: str = "batch", regroup_s: float | None = None):
        self.process = process
        self.window_s = window_s
        self.max_batch = max_batch
        self.regroup_s = regroup_s  # None: a quarter of the mean batch time, at most 20 ms
        self._last_keys: set[str] = set()
        self._queue: queue.Queue[_Pending[T]] = queue.Queue(maxsize=max_queue)
        self._deferred: list[_Pending[T]] = []
        self._batch_s = 0.0  # moving average of a batch's run time
        self._running_since: float | None = None  # time.monotonic() when the running batch began
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def submit(self, task: T, key: str, is_cancelled: Callable[[], bool] = lambda: False,
               deadline: float | None = None) -> R:
        """Run task in a batch and return its result. `deadline`: time.monotonic() by which the
        caller needs the answer, or None."""
        if deadline is not None:
            wait_s = self.expected_wait_s()
            if time.monotonic() + wait_s > deadline:
                raise ResourceExhausted(
                    f"worker busy: about {wait_s * 1e3:.0f} ms of work is queued, past the request's deadline")
        pending = _Pending(task, key, is_cancelled)
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            raise ResourceExhausted(f"worker overloaded: {self._queue.maxsize} requests queued") from None
        metrics.QUEUE_DEPTH.set(self._queue.qsize())
        return pending.future.result()

    def expected_wait_s(self) -> float:
        """Until a task submitted now would be done: the rest of the running batch, the batches
        queued ahead, its own; 0 when nothing is running or queued."""
        running_since, queued = self._running_since, self._queue.qsize() + len(self._deferred)
        if running_since is None and not queued:
            return 0.0
        rest = max(0.0, self._batch_s - (time.monotonic() - running_since)) if running_since is not None else 0.0
        return rest + self._batch_s * (1 + -(-queued // self.max_batch))

    def _run(self) -> None:
        while True:
            batch = self._collect()
            try:
                self._process([p for p in batch if not self._dropped(p)])
            except BaseException as exc:  # noqa: BLE001 - never let the engine thread die
                log.exception("%s: batch failed outside the model step", self._thread.name)
                for pending in batch:
                    if not pending.future.done():
                        pending.future.set_exception(exc)

    @staticmethod
    def _dropped(pending: _Pending[T]) -> bool:
        if not pending.is_cancelled():
            return False
        pending.future.set_exception(Cancelled("the caller went away"))
        return True

    def _process(self, live: list[_Pending[T]]) -> None:
        if not live:
            return
        started = self._running_since = time.monotonic()
        try:
            results = self.process([p.task for p in live])
        except BaseException as exc:  # noqa: BLE001 - the whole batch failed
            results = [exc] * len(live)
        finally:
            self._running_since = None
        elapsed = time.monotonic() - started
        self._batch_s = elapsed if not self._batch_s else 0.8 * self._batch_s + 0.2 * elapsed
        for pending, result in zip(live, results):
            if isinstance(result, Again):
                if result.rest is not None:
                    pending.task = result.rest
                self._deferred.append(pending)
            elif isinstance(result, BaseException):
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)

    def _collect(self) -> list[_Pending[T]]:
        batch, keys = [], set()
        waiting, self._deferred = self._deferred, []
        if not waiting:
            waiting.append(self._queue.get())
        now = time.monotonic()
        deadline = now + self.window_s
        regroup = self.regroup_s if self.regroup_s is not None else min(0.25 * self._batch_s, 0.02)
        regroup_deadline = now + max(self.window_s, regroup)
        while len(batch) < self.max_batch:
            if not waiting:
                missing = any(k not in keys for k in self._last_keys)
                try:
                    until = regroup_deadline if missing else deadline
                    waiting.append(self._queue.get(timeout=max(0.0, until - time.monotonic())))
                except queue.Empty:
                    break
            pending = waiting.pop(0)
            if pending.key in keys:
                self._deferred.append(pending)
            else:
                keys.add(pending.key)
                batch.append(pending)
        self._deferred += waiting
        self._last_keys = keys
        metrics.QUEUE_DEPTH.set(self._queue.qsize())
        return batch
