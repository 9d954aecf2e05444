"""Cancelling a worker call from another thread: the overlapped draft of a block that the target
has just rejected. The call's `RequestContext` carries a `CancelToken`; `WorkerClient.call` then
makes it as a gRPC future the token can cancel."""

from __future__ import annotations

import threading
from typing import Any


class CancelToken:
    """Lets one thread cancel the worker call another thread is making on its behalf (the
    overlapped draft of a block the target has just rejected): the gRPC call is cancelled, the
    worker sees its client gone and stops, and the caller gets `Cancelled`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cancelled = False
        self._calls: list[Any] = []

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            calls, self._calls = self._calls, []
        for call in calls:
            call.cancel()

    def watch(self, call: Any) -> None:
        with self._lock:
            if not self._cancelled:
                self._calls.append(call)
                return
        call.cancel()

