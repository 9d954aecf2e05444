"""What each durability level costs a round: the latency of one session commit (the coordinator
commits every round before its tokens go to the client) against real redis-server processes, side
by side in one run.

Levels:
- memory:         no persistence (what `specdec up` runs)
- aof_everysec:   append-only file, fsync once a second (the chart's bundled default)
- aof_always:     append-only file, fsync before every reply
- replica:        a primary with one replica, commits not waiting for it
- replica_wait1:  the same, each commit waiting for the replica (--redis-wait-replicas 1)

Each sample commits one round (K + 1 = 5 tokens, and a chat session's meta of about 2 KB) through
the coordinator's own SessionStore. Levels take turns in blocks, so that a noisy moment of a shared
machine falls on all of them. Run:

    .venv/bin/python benchmarks/durability.py [--commits 3000] [--out benchmarks/results/durability.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec_core.serving.redis_client import connect_redis  # noqa: E402
from coordinator.sessions import SessionStore  # noqa: E402
from specdec.launcher import redis_server_binary  # noqa: E402
from specdec.loadtest import percentiles  # noqa: E402 (does not import locust)
from stacks import RedisProcess  # noqa: E402

ROUND = [504, 3458, 282, 4649, 314]
MESSAGES = [{"role": "user", "content": "Summarise the following paragraph. " * 20},
            {"role": "assistant", "content": "The paragraph says. " * 40}]


def wait_replicated(primary: RedisProcess, timeout_s: float = 60) -> None:
    client = redis.Redis.from_url(primary.url)
    deadline = time.monotonic() + timeout_s
    while client.info("replication").get("slave0", {}).get("state") != "online":
        if time.monotonic() > deadline:
            raise TimeoutError("the replica did not connect")
        time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commits", type=int, default=3000, help="commits per level (default 3000)")
    p.add_argument("--block", type=int, default=100, help="commits per turn of a level")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/durability.json"))
    a = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        servers = {
            "memory": RedisProcess(root / "memory", "--appendonly", "no").start(),
            "aof_everysec": RedisProcess(root / "everysec", "--appendonly", "yes", "--appendfsync", "everysec").start(),
            "aof_always": RedisProcess(root / "always", "--appendonly", "yes", "--appendfsync", "always").start(),
            "replica": RedisProcess(root / "primary", "--appendonly", "no", "--repl-diskless-sync-delay", "0").start(),
        }
        replica = RedisProcess(root / "replica", "--appendonly", "no", "--replicaof", "127.0.0.1",
                               str(servers["replica"].port)).start()
        try:
            wait_replicated(servers["replica"])
            stores = {name: SessionStore(connect_redis(s.url), ttl_seconds=600) for name, s in servers.items()}
            stores["replica_wait1"] = SessionStore(connect_redis(servers["replica"].url), ttl_seconds=600,
                                                   wait_replicas=1, wait_timeout_ms=1000)
            sessions = {}
            for name, store in stores.items():
                sessions[name] = store.new(seed=1)
                sessions[name].messages = list(MESSAGES)
                store.commit(sessions[name], ROUND * 20)  # a prompt
            samples: dict[str, list[float]] = {name: [] for name in stores}
            done = 0
            while done < a.commits:
                n = min(a.block, a.commits - done)
                for name, store in stores.items():
                    session = sessions[name]
                    for _ in range(n):
                        started = time.perf_counter()
                        store.commit(session, ROUND)
                        samples[name].append((time.perf_counter() - started) * 1e3)
                done += n
                print(f"{done}/{a.commits} commits per level", file=sys.stderr, flush=True)
        finally:
            for s in [*servers.values(), replica]:
                s.stop()

    stats = {name: percentiles(v) for name, v in samples.items()}
    results = {name: {"p50_ms": round(q["p50"], 3), "p99_ms": round(q["p99"], 3), "mean_ms": round(q["mean"], 3),
                      "p50_vs_memory": round(q["p50"] / stats["memory"]["p50"], 2)} for name, q in stats.items()}
    wait_cost = results["replica_wait1"]["p50_ms"] - results["replica"]["p50_ms"]
    report = {
        "what": "latency of one round's session commit (5 tokens + ~2 KB chat meta), by durability level",
        "commits_per_level": a.commits,
        "levels": results,
        "wait_cost_per_round_ms": round(wait_cost, 3),
        "wait_cost_p99_ms": round(results["replica_wait1"]["p99_ms"] - results["replica"]["p99_ms"], 3),
        "redis_server": subprocess.run([redis_server_binary(), "--version"], capture_output=True,
                                       text=True).stdout.split()[2],
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    width = max(map(len, results))
    print(f"{'level':<{width}}  p50 ms  p99 ms  p50 vs memory")
    for name, r in results.items():
        print(f"{name:<{width}}  {r['p50_ms']:6.3f}  {r['p99_ms']:6.3f}  {r['p50_vs_memory']:.2f}x")
    print(f"WAIT 1 costs {wait_cost:.3f} ms per round (p50); results in {a.out}")


if __name__ == "__main__":
    main()
