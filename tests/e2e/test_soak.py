"""Soak: `specdec loadtest` (locust, 8 streaming chat users, 60 s, two turns per session) against a
tiny local stack. No request may fail, and for every request the tokens the client received must
be exactly the ones the session committed to Redis at that point of the session (none lost, none
duplicated, none the client was not told about).

Run: pytest -m soak tests/e2e/test_soak.py -s   (prints the summary figures)
The long soak on the embedded pair (SmolLM2 target, llama.cpp draft), ten minutes:
    SPECDEC_SOAK_MODEL=smollm2 SPECDEC_SOAK_SECONDS=600 pytest -m soak tests/e2e/test_soak.py -s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest
import redis

from stacks import committed, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.soak]

USERS = 8
DURATION_S = int(os.environ.get("SPECDEC_SOAK_SECONDS", "60"))
MODEL = os.environ.get("SPECDEC_SOAK_MODEL", "")  # empty: the tiny pair
MAX_NEW_TOKENS = 48
TURNS = 2


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory):
    if MODEL:
        stack = start_stack(MODEL, MODEL, tmp_path_factory.mktemp("logs"), args={"draft": ["--backend", "llama.cpp"]})
    else:
        stack = start_stack(*request.getfixturevalue("tiny_pair"), tmp_path_factory.mktemp("logs"))
    yield stack
    stack.down()


def test_soak_no_errors_no_lost_or_duplicated_tokens(stack, tmp_path, capsys):
    summary_path, record_path = tmp_path / "summary.json", tmp_path / "records.jsonl"
    # A subprocess: locust monkey-patches the standard library for gevent, which pytest must not get.
    cmd = [sys.executable, "-m", "specdec.cli", "loadtest", "--address", stack.address("coordinator"),
           "--users", str(USERS), "--spawn-rate", str(USERS), "--duration", str(DURATION_S),
           "--max-new-tokens", str(MAX_NEW_TOKENS), "--turns", str(TURNS), "--request-timeout", "120",
           "--progress-interval", "10", "--json", str(summary_path), "--record", str(record_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DURATION_S + 300)
    with capsys.disabled():
        print(f"\n{proc.stderr}{proc.stdout}")
    assert proc.returncode == 0, proc.stderr[-3000:]

    summary = json.loads(summary_path.read_text())
    records = [json.loads(line) for line in record_path.read_text().splitlines()]
    assert summary["failed"] == 0 and summary["errors_by_code"] == {} and summary["client_errors"] == {}
    assert summary["ok"] >= USERS * TURNS, summary  # every user finished at least one whole session
    assert len(records) == summary["requests"]
    assert summary["ttft_ms"]["n"] == summary["ok"] and summary["itl_ms"]["n"] > 0

    r = redis.Redis.from_url(stack.redis_url)
    lost = duplicated = mismatched = 0
    by_session: dict[str, list[dict]] = defaultdict(list)
    for rec in records:
        assert rec["ok"] and not rec["cancelled"], rec
        by_session[rec["session_id"]].append(rec)
    for session_id, recs in by_session.items():
        ids = committed(r, session_id)
        recs.sort(key=lambda rec: rec["turn"])
        assert [rec["turn"] for rec in recs] == list(range(TURNS)), recs
        assert len(ids) == recs[-1]["session_tokens"], "Redis holds tokens no client was told about"
        previous_end = 0
        for rec in recs:
            received, end = rec["token_ids"], rec["session_tokens"]
            assert rec["completion_tokens"] == len(received)
            # the session before this request, this request's input, then exactly what was received
            assert end - len(received) - rec["prompt_tokens"] == previous_end
            server = ids[end - len(received):end]
            lost += max(0, len(server) - len(received))
            duplicated += max(0, len(received) - len(server))
            mismatched += server != received
            previous_end = end
        last = recs[-1]["token_ids"]
        assert ids[len(ids) - len(last):] == last  # the session ends with what the client got

    with capsys.disabled():
        print(f"soak: {summary['requests']} requests over {len(by_session)} sessions checked against Redis: "
              f"lost {lost}, duplicated {duplicated}, mismatched requests {mismatched}")
    assert lost == duplicated == mismatched == 0
