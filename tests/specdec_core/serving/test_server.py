"""Readiness reporting: NOT_SERVING after two failed dependency checks in a row (one slow answer
from a busy dependency is not an outage), SERVING again at the first good one."""

from __future__ import annotations

import threading

import pytest
from grpc_health.v1 import health_pb2

from specdec_core.serving import server

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Servicer:
    def __init__(self):
        self.status: dict[str, int] = {}

    def set(self, name, status):
        self.status[name] = status


@pytest.mark.capacity
def test_readiness_needs_two_failures_in_a_row_to_say_not_serving(monkeypatch):
    monkeypatch.setattr(server, "HEALTH_EVERY_S", 0.001)
    servicer, stopping, done = Servicer(), threading.Event(), threading.Event()
    script = [True, False, True, False, False, False, True, True]
    seen = []  # the status when each check after the first ran: what the checks before it decided

    def readiness() -> bool:
        if servicer.status:
            seen.append(servicer.status[""])
        if len(seen) == 7:
            stopping.set()
            done.set()
        return script.pop(0) if script else True

    server._report_readiness(servicer, ["", "svc"], readiness, stopping)
    assert done.wait(10)
    assert seen == [SERVING, SERVING, SERVING, SERVING, NOT_SERVING, NOT_SERVING, SERVING]
    assert servicer.status["svc"] == servicer.status[""]
