"""`specdec loadtest`: drive a running coordinator with simulated chat users, headless.

    specdec loadtest --address localhost:50050 --users 8 --spawn-rate 2 --duration 60 \\
        --max-new-tokens 64 --draft model -k 5 --json summary.json --record sessions.jsonl

Locust is used as a library (an `Environment` and a local runner on gevent); the users are
`specdec.locustfile.SpecdecUser`, which stream `GenerateStream` calls (see that file for what the
`ttft`, `itl` and `stream` metrics mean). After `--duration` seconds no new request starts and the
ones in flight are allowed to finish (up to `--stop-timeout`); the summary covers the whole run:
requests and tokens per second, TTFT / ITL / whole-stream percentiles, speculation stats and
errors by gRPC status code. `--json` writes the summary, `--record` one JSON line per request
(session id, turn, the token ids the client received, usage) so that they can be checked against
the session's committed tokens in Redis.

Needs `pip install locust` (the client library does not); locust is imported only when a load
test runs, because importing it monkey-patches the standard library for gevent.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter

from specdec.client import DRAFT_METHODS

METRICS = ("ttft", "itl", "stream")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("SPECDEC_ADDRESS", "localhost:50050"),
                   help="the coordinator (host:port)")
    p.add_argument("-u", "--users", type=int, default=8, help="concurrent simulated users (default 8)")
    p.add_argument("-r", "--spawn-rate", type=float, default=1.0, help="users started per second (default 1)")
    p.add_argument("-t", "--duration", type=float, default=60.0,
                   help="seconds during which requests are started (default 60); in-flight ones then finish")
    p.add_argument("--max-new-tokens", type=int, default=64, help="max_new_tokens of every request (default 64)")
    p.add_argument("--draft", choices=sorted(DRAFT_METHODS), default="default",
                   help="drafting method; none = the target alone (K = 0)")
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=None,
                   help="draft tokens per round (default: the server's)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: greedy)")
    p.add_argument("--turns", type=int, default=1,
                   help="requests per session: a chat prompt, then follow-ups in the same session (default 1)")
    p.add_argument("--prompts-file", default="", help="one chat prompt per line (default: a built-in list)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="deadline of each call, seconds")
    p.add_argument("--stop-timeout", type=float, default=None,
                   help="seconds in-flight requests get to finish after --duration (default: --request-timeout)")
    p.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress lines (0: none)")
    p.add_argument("--json", dest="json_path", default=None, help="write the summary as JSON to this file")
    p.add_argument("--record", dest="record_path", default=None,
                   help="write one JSON line per request: session_id, turn, token_ids received, usage, error")


def percentiles(values: list[float]) -> dict:
    """n, mean, p50/p90/p95/p99 (linear interpolation between closest ranks) and max."""
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p95": None, "p99": None, "max": None}
    xs = sorted(values)

    def q(p: float) -> float:
        pos = (len(xs) - 1) * p
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": q(0.50), "p90": q(0.90), "p95": q(0.95),
            "p99": q(0.99), "max": xs[-1]}


class Collector:
    """Listens to locust's request event; keeps every sample (for exact percentiles) and record."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {name: [] for name in METRICS}
        self.ok = 0
        self.failed = 0
        self.tokens = 0
        self.errors: Counter[str] = Counter()
        self.error_examples: dict[str, str] = {}
        self.records: list[dict] = []
        self.stream_rates: list[float] = []
        self.spec = Counter()
        self.client_errors: Counter[str] = Counter()

    def on_request(self, request_type, name, response_time, response_length, exception=None, context=None,
                   **_kwargs) -> None:
        if name in ("ttft", "itl"):
            self.samples[name].append(response_time)
            return
        if name != "stream":
            return
        self.samples["stream"].append(response_time)
        self.tokens += response_length
        record = (context or {}).get("record")
        if record is not None:
            self.records.append(record)
        if exception is None:
            self.ok += 1
            if record and record.get("wall_ms"):
                self.stream_rates.append(len(record["token_ids"]) / (record["wall_ms"] / 1e3))
            stats = (record or {}).get("stats") or {}
            for key in ("rounds", "drafted", "accepted"):
                self.spec[key] += stats.get(key, 0)
            return
        self.failed += 1
        code = (record or {}).get("error", {}).get("code") or _code_of(exception)
        self.errors[code] += 1
        self.error_examples.setdefault(code, str((record or {}).get("error", {}).get("details") or exception)[:500])

    def on_user_error(self, user_instance, exception, tb, **_kwargs) -> None:
        self.client_errors[type(exception).__name__] += 1

    def summary(self, elapsed_s: float, config: dict) -> dict:
        requests = self.ok + self.failed
        drafted, accepted, rounds = self.spec["drafted"], self.spec["accepted"], self.spec["rounds"]
        return {
            **config,
            "elapsed_s": elapsed_s,
            "requests": requests,
            "ok": self.ok,
            "failed": self.failed,
            "errors_by_code": dict(self.errors),
            "error_examples": self.error_examples,
            "client_errors": dict(self.client_errors),
            "sessions": len({r["session_id"] for r in self.records if r.get("session_id")}),
            "req_per_s": requests / elapsed_s if elapsed_s > 0 else 0.0,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / elapsed_s if elapsed_s > 0 else 0.0,
            "ttft_ms": percentiles(self.samples["ttft"]),
            "itl_ms": percentiles(self.samples["itl"]),
            "stream_ms": percentiles(self.samples["stream"]),
            "stream_tokens_per_s": percentiles(self.stream_rates),
            "speculation": {"rounds": rounds, "drafted": drafted, "accepted": accepted,
                            "acceptance_rate": accepted / drafted if drafted else 0.0,
                            "tokens_per_round": (accepted + rounds) / rounds if rounds else 0.0},
        }


def _code_of(exception) -> str:
    code = getattr(exception, "code", None)
    if callable(code):
        try:
            return code().name
        except Exception:  # noqa: BLE001
            pass
    return type(exception).__name__


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _pcts(p: dict) -> str:
    return f"p50 {_ms(p['p50'])}  p95 {_ms(p['p95'])}  p99 {_ms(p['p99'])}  max {_ms(p['max'])}  (n={p['n']})"


def progress_line(c: Collector, elapsed_s: float, users: int) -> str:
    ttft, itl = percentiles(c.samples["ttft"]), percentiles(c.samples["itl"])
    rate = c.tokens / elapsed_s if elapsed_s > 0 else 0.0
    return (f"[{elapsed_s:5.0f} s] {users} users | {c.ok} ok, {c.failed} failed | {rate:.1f} tokens/s | "
            f"TTFT p50 {_ms(ttft['p50'])} p95 {_ms(ttft['p95'])} ms | ITL p50 {_ms(itl['p50'])} "
            f"p95 {_ms(itl['p95'])} ms")


def format_summary(s: dict) -> str:
    k = "server default" if s["k"] is None else s["k"]
    errors = ", ".join(f"{code}: {n}" for code, n in sorted(s["errors_by_code"].items())) or "none"
    spec = s["speculation"]
    lines = [
        f"specdec loadtest against {s['address']}: {s['users']} users (spawn rate {s['spawn_rate']}/s), "
        f"{s['duration_s']:.0f} s + drain = {s['elapsed_s']:.1f} s; max_new_tokens {s['max_new_tokens']}, "
        f"draft {s['draft']}, K {k}, {s['turns']} turn(s) per session",
        f"requests   {s['requests']} ({s['ok']} ok, {s['failed']} failed) = {s['req_per_s']:.2f} req/s "
        f"over {s['sessions']} sessions",
        f"tokens     {s['tokens']} = {s['tokens_per_s']:.1f} tokens/s; per stream "
        f"p50 {s['stream_tokens_per_s']['p50'] or 0:.1f} tokens/s",
        f"TTFT ms    {_pcts(s['ttft_ms'])}",
        f"ITL ms     {_pcts(s['itl_ms'])}",
        f"stream ms  {_pcts(s['stream_ms'])}",
        f"speculation acceptance {spec['acceptance_rate']:.0%} ({spec['accepted']}/{spec['drafted']}), "
        f"{spec['tokens_per_round']:.2f} tokens per target pass",
        f"errors     {errors}",
    ]
    for code, example in sorted(s["error_examples"].items()):
        lines.append(f"  {code}: {example}")
    if s["client_errors"]:
        lines.append(f"client errors (exceptions in the load generator): {s['client_errors']}")
    return "\n".join(lines)


def run(a: argparse.Namespace, out=sys.stderr) -> dict:
    """Run the load test described by the parsed flags; return the summary dict."""
    try:
        from specdec import locustfile  # imports locust (gevent monkey-patching) and inits grpc for gevent
    except ImportError as exc:
        raise SystemExit(f"specdec loadtest needs locust: pip install locust ({exc})") from exc
    import gevent
    import locust
    from locust.argument_parser import get_parser
    from locust.env import Environment

    stop_timeout = a.request_timeout if a.stop_timeout is None else a.stop_timeout
    argv = ["--headless", "--host", a.address, "--users", str(a.users), "--spawn-rate", str(a.spawn_rate),
            "--max-new-tokens", str(a.max_new_tokens), "--draft", a.draft, "--turns", str(a.turns),
            "--request-timeout", str(a.request_timeout), "--stop-timeout", str(math.ceil(stop_timeout))]
    if a.k is not None:
        argv += ["--num-speculative-tokens", str(a.k)]
    if a.temperature is not None:
        argv += ["--temperature", str(a.temperature)]
    if a.prompts_file:
        argv += ["--prompts-file", a.prompts_file]
    options = get_parser(default_config_files=[]).parse_args(argv)

    env = Environment(user_classes=[locustfile.SpecdecUser], host=a.address, parsed_options=options,
                      stop_timeout=stop_timeout)
    collector = Collector()
    env.events.request.add_listener(collector.on_request)
    env.events.user_error.add_listener(collector.on_user_error)
    runner = env.create_local_runner()

    def progress() -> None:
        while True:
            gevent.sleep(a.progress_interval)
            print(progress_line(collector, time.perf_counter() - started, runner.user_count), file=out, flush=True)

    config = {"address": a.address, "users": a.users, "spawn_rate": a.spawn_rate, "duration_s": a.duration,
              "max_new_tokens": a.max_new_tokens, "draft": a.draft, "k": a.k, "temperature": a.temperature,
              "turns": a.turns, "locust_version": locust.__version__}
    print(f"specdec loadtest: {a.users} users at {a.spawn_rate}/s for {a.duration:.0f} s against {a.address} "
          f"(locust {locust.__version__})", file=out, flush=True)
    started = time.perf_counter()
    printer = gevent.spawn(progress) if a.progress_interval > 0 else None
    try:
        runner.start(a.users, spawn_rate=a.spawn_rate)
        gevent.sleep(a.duration)
        print(f"[{time.perf_counter() - started:5.0f} s] duration reached; letting in-flight requests finish",
              file=out, flush=True)
        runner.stop()  # graceful: users finish their current request (up to stop_timeout)
    finally:
        elapsed = time.perf_counter() - started
        if printer is not None:
            printer.kill()
        runner.quit()
    summary = collector.summary(elapsed, config)
    if a.json_path:
        with open(a.json_path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    if a.record_path:
        with open(a.record_path, "w", encoding="utf-8") as f:
            for record in collector.records:
                f.write(json.dumps(record) + "\n")
    return summary


def run_cli(a: argparse.Namespace) -> int:
    """`specdec loadtest`: run, print the summary; exit code 1 when any request failed or none finished."""
    summary = run(a)
    print(format_summary(summary), flush=True)
    return 0 if summary["failed"] == 0 and summary["ok"] > 0 and not summary["client_errors"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
