"""Redis killed again and again under traffic: does any client lose or repeat a token?

Users stream chat requests through the client library (which retries with its request id) while a
killer SIGKILLs the Redis server every `--kill-every` seconds and restarts it on the same port and
append-only file (appendfsync everysec, the chart's default). The coordinator gives up on Redis
after `--redis-retry` seconds, so outages reach the clients and their retries resume the requests.
Every reply is checked against the same prompt's output taken before the chaos (greedy: it must be
identical), and the session in Redis against what the client received (prompt + output, exactly).

    .venv/bin/python benchmarks/redis_chaos.py                    # embedded pair, 8 users, 10 min
    .venv/bin/python benchmarks/redis_chaos.py --tiny --minutes 1 --out /tmp/chaos.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from prompts import take  # noqa: E402
from soak import machine, prepare_models  # noqa: E402
from specdec import Client  # noqa: E402
from specdec.launcher import Stack  # noqa: E402
from specdec.loadtest import percentiles  # noqa: E402
from stacks import RedisProcess  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--minutes", type=float, default=10.0, help="minutes during which requests start")
    p.add_argument("--kill-every", type=float, default=20.0, help="seconds between Redis kills")
    p.add_argument("--down-for", type=float, default=3.0, help="seconds Redis stays down after each kill")
    p.add_argument("--redis-retry", type=float, default=1.0, help="the coordinator's --redis-retry")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=8, help="distinct chat prompts (references taken before)")
    p.add_argument("--tiny", action="store_true", help="a tiny random pair instead of the embedded one (smoke)")
    p.add_argument("--out", default=str(HERE / "results" / "redis_chaos.json"))
    a = p.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="specdec-chaos-"))
    target, draft = prepare_models(a, scratch)
    store = RedisProcess(scratch / "redis", "--appendonly", "yes", "--appendfsync", "everysec").start()
    stack = Stack(target_model=target, draft_model=draft, redis_url=store.url, log_dir=scratch / "logs",
                  args={"coordinator": ["--redis-retry", str(a.redis_retry)]})
    print(f"chaos: starting the stack ({'tiny pair' if a.tiny else 'embedded pair'}); logs in {scratch}", flush=True)
    stack.up(wait_s=600)
    prompts = [m for group in ("chat", "code") for m in take(group, a.prompts)][:a.prompts]
    address = stack.address("coordinator")
    outcomes: list[dict] = []
    kills: list[float] = []
    lock = threading.Lock()
    stop = threading.Event()
    try:
        with Client(address, timeout_s=600) as client:
            references = [client.generate(m, max_new_tokens=a.max_new_tokens, draft="none").token_ids
                          for m in prompts]  # the target alone, before any fault
        print(f"chaos: {len(references)} references taken; {a.users} users for {a.minutes} min, Redis killed "
              f"every {a.kill_every:.0f} s for {a.down_for:.0f} s", flush=True)
        admin = redis.Redis.from_url(store.url)

        def user(n: int) -> None:
            with Client(address, timeout_s=600, retry_s=120) as client:
                i = n
                while not stop.is_set():
                    i = (i + 1) % len(prompts)
                    started, received, session_id, error = time.monotonic(), [], "", ""
                    try:
                        for chunk in client.stream(prompts[i], max_new_tokens=a.max_new_tokens):
                            session_id = session_id or chunk.session_id
                            received += chunk.token_ids
                            prompt_tokens = chunk.usage.prompt_tokens
                        stored = [int(t) for t in admin.lrange(f"specdec:session:{session_id}:ids", 0, -1)]
                        in_redis = stored[prompt_tokens:] == received and len(stored) == prompt_tokens + len(received)
                    except Exception as exc:  # noqa: BLE001 - counted, and the run goes on
                        error, in_redis = f"{type(exc).__name__}: {getattr(exc, 'details', lambda: exc)()}", False
                    ended = time.monotonic()
                    with lock:
                        spanned = any(started <= k <= ended for k in kills)
                        outcomes.append({"ok": not error, "identical": received == references[i],
                                         "in_redis": in_redis, "spanned_kill": spanned, "s": ended - started,
                                         "lost": max(0, len(references[i]) - len(received)) if not error else 0,
                                         "extra": max(0, len(received) - len(references[i])), "error": error})

        threads = [threading.Thread(target=user, args=(n,), daemon=True) for n in range(a.users)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + a.minutes * 60
        while time.monotonic() + a.kill_every < deadline:
            time.sleep(a.kill_every)
            store.kill()
            with lock:
                kills.append(time.monotonic())
            time.sleep(a.down_for)
            store.start()
            with lock:
                done = len(outcomes)
            print(f"chaos: kill {len(kills)}: {done} requests so far", flush=True)
        stop.set()
        for t in threads:
            t.join(timeout=900)
    finally:
        stack.down()
        store.kill()

    spanned = [o for o in outcomes if o["spanned_kill"]]
    report = {
        "what": "Redis SIGKILLed repeatedly under streaming traffic (AOF everysec); every reply checked against "
                "the target alone and against Redis",
        "model": "tiny random pair" if a.tiny else "embedded pair (SmolLM2-135M-Instruct; draft Q4_1 GGUF)",
        "users": a.users, "minutes": a.minutes, "kill_every_s": a.kill_every, "down_for_s": a.down_for,
        "redis_retry_s": a.redis_retry, "max_new_tokens": a.max_new_tokens,
        "kills": len(kills),
        "requests": len(outcomes),
        "requests_spanning_a_kill": len(spanned),
        "failed": sum(not o["ok"] for o in outcomes),
        "not_identical": sum(o["ok"] and not o["identical"] for o in outcomes),
        "not_exactly_in_redis": sum(o["ok"] and not o["in_redis"] for o in outcomes),
        "tokens_lost": sum(o["lost"] for o in outcomes),
        "tokens_duplicated_or_extra": sum(o["extra"] for o in outcomes),
        "latency_s_spanning_kill": percentiles([o["s"] for o in spanned]),
        "latency_s_other": percentiles([o["s"] for o in outcomes if not o["spanned_kill"]]),
        "errors": sorted({o["error"] for o in outcomes if o["error"]})[:10],
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("machine",)}, indent=2))
    return 0 if report["requests"] and not (report["failed"] or report["not_identical"]
                                            or report["not_exactly_in_redis"]) else 1


if __name__ == "__main__":
    sys.exit(main())
