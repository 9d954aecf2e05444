"""Prometheus metrics on every service and structured JSON logs with request context."""

from __future__ import annotations

import json

import pytest

from specdec import Client
from specdec.launcher import free_port
from specdec_core.logs import short_id
from stacks import scrape, start_stack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tiny_pair, tmp_path_factory):
    ports = {role: free_port() for role in ("coordinator", "draft", "target")}
    args = {role: ["--metrics-port", str(port), "--log-format", "json"] for role, port in ports.items()}
    stack = start_stack(*tiny_pair, tmp_path_factory.mktemp("logs"), args=args)
    stack.metrics_ports = ports
    yield stack
    stack.down()


def test_every_service_exports_its_metrics(stack):
    with Client(stack.address("coordinator"), timeout_s=120) as client:
        result = client.generate([5, 6, 7, 8], max_new_tokens=20, k=4)
    coordinator = scrape(stack.metrics_ports["coordinator"])
    assert coordinator['specdec_requests_total{code="OK",method="Generate"}'] >= 1
    assert coordinator["specdec_generated_tokens_total"] >= 20
    assert coordinator["specdec_rounds_total"] >= result.stats["rounds"]
    assert coordinator["specdec_draft_tokens_total"] >= result.stats["drafted"]
    assert coordinator["specdec_accepted_tokens_total"] >= result.stats["accepted"]
    assert any(k.startswith('specdec_round_seconds_count{phase="verify"}') for k in coordinator)
    target = scrape(stack.metrics_ports["target"])
    assert target["specdec_verify_batch_size_count"] >= result.stats["rounds"]
    assert target['specdec_cache_sessions{role="target"}'] >= 1
    assert target['specdec_requests_total{code="OK",method="Verify"}'] >= result.stats["rounds"]
    draft = scrape(stack.metrics_ports["draft"])
    assert draft['specdec_requests_total{code="OK",method="Propose"}'] >= 1
    assert draft['specdec_cache_tokens{role="draft"}'] > 0


def test_logs_are_json_lines_with_the_session_digest(stack):
    stack.stop("draft")  # requests now log that they decode without the draft
    try:
        with Client(stack.address("coordinator"), timeout_s=120) as client:
            result = client.generate([9, 9], max_new_tokens=3, k=2)
    finally:
        stack.start("draft")
    lines = (stack.log_dir / "coordinator.log").read_text().splitlines()
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    assert entries and all({"ts", "level", "logger", "msg"} <= e.keys() for e in entries)
    about_request = [e for e in entries if e.get("session") == short_id(result.session_id)]  # never the id
    assert about_request and any(e["level"] == "warning" and "draft" in e["msg"] for e in about_request)
