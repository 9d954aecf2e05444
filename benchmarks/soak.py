"""The soak of issue 9: the embedded pair (SmolLM2-135M target via transformers, the same GGUF as
draft via llama.cpp) at `specdec up`'s default settings, under N users of single-turn traffic whose
sessions are never ended (as most clients do), for M minutes.

Reproduce the issue's figures (16 users, 10 minutes; ~12 minutes in all, most of a 2-core machine):

    .venv/bin/python benchmarks/soak.py            # writes benchmarks/results/soak.json

A smoke run on a tiny random pair (a minute): --tiny --users 4 --minutes 0.5 --out /tmp/soak.json

The stack is `specdec.launcher.Stack` exactly as `specdec up` builds it (draft --backend auto, the
core split, --overlap; only the ports differ: free ones, plus a --metrics-port per service). The
traffic is `specdec loadtest --turns 1` (locust, closed loop, no EndSession), run as a subprocess.
Meanwhile a thread per service calls grpc.health.v1 Check every 0.25 s (5 s deadline) and another
samples each worker's VmRSS. Written: requests, failures, tokens/s, TTFT / ITL p50 and p99 (from the
load test's summary), KV-cache evictions per worker (Prometheus counters, after minus before),
peak RSS (VmHWM, whole life) and RSS after the first minute and at the end, health latency
p50/p99/max and failures, error lines in the service logs, the command lines and the machine.
Exit code 0 only when no request failed and every health Check answered SERVING.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT)]

from specdec.launcher import Stack, free_port, scrape_metrics, spawn  # noqa: E402
from specdec.loadtest import percentiles  # noqa: E402 (does not import locust)

SERVICES = ("coordinator", "draft", "target")
WORKERS = ("draft", "target")
PROGRESS_S = 30.0
PROGRESS_LINE = re.compile(r"\|\s*(\d+) ok, (\d+) failed \|")


def build_stack(target: str, draft: str, log_dir: Path,
                target_cache_tokens: int = 0) -> tuple[Stack, dict[str, int]]:
    """`specdec up`'s Stack (see cli._start_stack), with a metrics port per service (and, when
    given, a smaller target KV cache, so that a short soak cycles it)."""
    metrics = {name: free_port() for name in SERVICES}
    args = {"draft": ["--backend", "auto"]}
    if target_cache_tokens:
        args["target"] = ["--max-cache-tokens", str(target_cache_tokens)]
    for name, port in metrics.items():
        args[name] = args.get(name, []) + ["--metrics-port", str(port)]
    stack = Stack(target_model=target, draft_model=draft, redis_url=os.environ.get("REDIS_URL", ""),
                  log_dir=log_dir, args=args)
    return stack, metrics


def scrape(port: int) -> dict[str, float]:
    """A service's metrics; {} when it does not answer."""
    try:
        return scrape_metrics(port, timeout_s=5)
    except OSError:
        return {}


def counter_delta(before: dict, after: dict, name: str) -> dict[str, float]:
    """Increase of every labelled series of a counter (a series not there before counts from 0)."""
    return {key[len(name):]: value - before.get(key, 0.0) for key, value in after.items()
            if key.startswith(name + "{") and value - before.get(key, 0.0)}


def mean_ms(before: dict, after: dict, pattern: str) -> float | None:
    """Mean of a histogram over the run, in ms; pattern has {} where _sum / _count go."""
    count = after.get(pattern.format("count"), 0.0) - before.get(pattern.format("count"), 0.0)
    total = after.get(pattern.format("sum"), 0.0) - before.get(pattern.format("sum"), 0.0)
    return total / count * 1e3 if count else None


class HealthProbe:
    """One thread per address calling Check every `interval_s`; keeps every latency and every
    answer other than SERVING (a status, or an RPC error)."""

    def __init__(self, addresses: dict[str, str], interval_s: float = 0.25, timeout_s: float = 5.0):
        self.addresses, self.interval_s, self.timeout_s = addresses, interval_s, timeout_s
        self.latencies_ms: dict[str, list[float]] = {name: [] for name in addresses}
        self.failures: list[dict] = []
        self.stopping = threading.Event()
        self.started = time.monotonic()
        self.threads = [threading.Thread(target=self._run, args=(name,), daemon=True) for name in addresses]

    def __enter__(self) -> HealthProbe:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join()

    def _run(self, name: str) -> None:
        with grpc.insecure_channel(self.addresses[name]) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self.stopping.is_set():
                began = time.perf_counter()
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s).status
                    failure = None if status == health_pb2.HealthCheckResponse.SERVING else \
                        health_pb2.HealthCheckResponse.ServingStatus.Name(status)
                except grpc.RpcError as exc:
                    failure = exc.code().name if exc.code() else "UNKNOWN"
                elapsed_ms = (time.perf_counter() - began) * 1e3
                self.latencies_ms[name].append(elapsed_ms)
                if failure:
                    self.failures.append({"service": name, "at_s": round(time.monotonic() - self.started, 1),
                                          "answer": failure, "ms": round(elapsed_ms, 1)})
                self.stopping.wait(max(0.0, self.interval_s - elapsed_ms / 1e3))

    def summary(self) -> dict:
        every = [ms for values in self.latencies_ms.values() for ms in values]
        p = percentiles(every)
        return {"health_checks": p["n"], "health_p50_ms": p["p50"], "health_p99_ms": p["p99"],
                "health_max_ms": p["max"], "health_failures": len(self.failures),
                "health_over_100ms": sum(ms > 100 for ms in every), "health_over_1s": sum(ms > 1000 for ms in every),
                "health_by_service": {name: {k: percentiles(v)[k] for k in ("n", "p50", "p99", "max")}
                                      for name, v in self.latencies_ms.items()},
                "health_failure_examples": self.failures[:20]}


def model_pid(pid: int) -> int:
    """The process that holds the model: pid, or (under a wrapper such as torchrun) the descendant
    with the largest resident set."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return max(found, key=lambda p: status_mb(p, "VmRSS") or 0.0) if found else pid


def status_mb(pid: int, field: str) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class RssSampler(threading.Thread):
    """VmRSS of each process every `interval_s`: the latest, the maximum, and the value at 60 s."""

    def __init__(self, pids: dict[str, int], interval_s: float = 1.0):
        super().__init__(daemon=True)
        self.pids, self.interval_s = pids, interval_s
        self.latest: dict[str, float | None] = {}
        self.max: dict[str, float] = {}
        self.after_first_minute: dict[str, float | None] = {}
        self.stopping = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self.stopping.wait(self.interval_s):
            self.latest = {name: status_mb(pid, "VmRSS") for name, pid in self.pids.items()}
            for name, mb in self.latest.items():
                self.max[name] = max(self.max.get(name, 0.0), mb or 0.0)
            if not self.after_first_minute and time.monotonic() - started >= 60:
                self.after_first_minute = dict(self.latest)


def scan_logs(log_dir: Path) -> dict[str, dict]:
    """Lines that look like errors in each service's log: a count and the first few."""
    found = {}
    for log in sorted(log_dir.glob("*.log")):
        lines = [line for line in log.read_text(errors="replace").splitlines()
                 if re.search(r"\b(ERROR|CRITICAL|Traceback)\b", line)]
        if lines:
            found[log.stem] = {"count": len(lines), "first": lines[:5]}
    return found


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None
    return {"cpus": len(os.sched_getaffinity(0)), "cpu_model": cpu, "loadavg_at_end": os.getloadavg()}


def prepare_models(a: argparse.Namespace, scratch: Path) -> tuple[str, str]:
    if a.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_models import make_tiny_pair

        return make_tiny_pair(scratch / "models")
    from specdec_core.engine.models import resolve_model
    from specdec_core.engine.options import EngineOptions

    resolve_model("smollm2", EngineOptions.from_env().cache_dir)  # converts the GGUF once, as `specdec up` does before starting anything
    return "smollm2", "smollm2"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=16, help="concurrent users (default 16)")
    p.add_argument("--minutes", type=float, default=10.0, help="minutes during which requests start (default 10)")
    p.add_argument("--spawn-rate", type=float, default=2.0, help="users started per second (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="per request (default 64, the load test's)")
    p.add_argument("--tiny", action="store_true", help="a tiny random pair instead of the embedded one (smoke)")
    p.add_argument("--target-cache-tokens", type=int, default=0,
                   help="the target's --max-cache-tokens (default: its own default, 65536, which ten minutes "
                        "of this traffic do not fill; e.g. 4096 makes the target evict all the time)")
    p.add_argument("--out", default=str(HERE / "results" / "soak.json"), help="the JSON (default %(default)s)")
    p.add_argument("--log-dir", default=None, help="service and load-test logs (default: a new temp folder)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)
    scratch = Path(tempfile.mkdtemp(prefix="specdec-soak-"))
    log_dir = Path(a.log_dir) if a.log_dir else scratch / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"soak: {a.users} users, {a.minutes:g} min, max_new_tokens {a.max_new_tokens}, "
          f"{'tiny pair' if a.tiny else 'embedded pair'}; logs in {log_dir}", flush=True)
    target, draft = prepare_models(a, scratch)
    stack, metrics_ports = build_stack(target, draft, log_dir, a.target_cache_tokens)
    loadtest = None
    try:
        started = time.perf_counter()
        stack.up()
        print(f"soak: stack up in {time.perf_counter() - started:.0f} s", flush=True)
        settings = {name: stack.command(name) for name in SERVICES}
        pids = {name: model_pid(stack.processes[name].pid) for name in WORKERS}
        if "redis" in stack.processes:
            pids["redis"] = stack.processes["redis"].pid
        before = {name: scrape(port) for name, port in metrics_ports.items()}
        settings["loadtest"] = [
            sys.executable, "-m", "specdec.cli", "loadtest", "--address", stack.address("coordinator"),
            "--users", str(a.users), "--spawn-rate", str(a.spawn_rate), "--duration", str(a.minutes * 60),
            "--max-new-tokens", str(a.max_new_tokens), "--turns", "1", "--progress-interval", "10",
            "--json", str(log_dir / "loadtest.json"), "--record", str(log_dir / "records.jsonl")]
        rss = RssSampler(pids)
        rss.start()
        counts = {"ok": 0, "failed": 0}
        lt_log = open(log_dir / "loadtest.log", "w")  # noqa: SIM115 - closed once its follower is done
        # started before the probes: forking while their threads are in gRPC skips gRPC's fork handlers
        loadtest = spawn(settings["loadtest"], cwd=ROOT, stdout=lt_log, stderr=subprocess.PIPE, text=True)
        with HealthProbe({name: stack.address(name) for name in SERVICES}) as health:
            follower = threading.Thread(target=follow, args=(loadtest.stderr, lt_log, counts), daemon=True)
            follower.start()
            t0 = next_report = time.monotonic()
            while loadtest.poll() is None:
                time.sleep(1)
                if time.monotonic() - next_report >= PROGRESS_S:
                    next_report += PROGRESS_S
                    h = health.summary()
                    print(f"[{time.monotonic() - t0:5.0f} s] requests {counts['ok'] + counts['failed']} "
                          f"({counts['failed']} failed) | health p99 {fmt(h['health_p99_ms'])} ms, max "
                          f"{fmt(h['health_max_ms'])} ms, {h['health_failures']} failures | RSS MB "
                          + ", ".join(f"{n} {fmt(mb)}" for n, mb in rss.latest.items()), flush=True)
            follower.join()
        lt_log.close()
        rss.stopping.set()
        after = {name: scrape(port) for name, port in metrics_ports.items()}
        hwm = {name: status_mb(pid, "VmHWM") for name, pid in pids.items()}
        alive = {name: proc.poll() is None for name, proc in stack.processes.items()}
    except KeyboardInterrupt:
        print("soak: interrupted", file=sys.stderr)
        return 130
    finally:
        if loadtest is not None and loadtest.poll() is None:
            os.killpg(loadtest.pid, signal.SIGTERM)
            loadtest.wait()
        stack.down()

    lt = json.loads((log_dir / "loadtest.json").read_text()) if (log_dir / "loadtest.json").exists() else {}
    result = {
        "requests": lt.get("requests", 0), "failures": lt.get("failed"), "minutes": a.minutes, "users": a.users,
        "tokens_per_s": lt.get("tokens_per_s"),
        "ttft_p50_ms": lt.get("ttft_ms", {}).get("p50"), "ttft_p99_ms": lt.get("ttft_ms", {}).get("p99"),
        "itl_p50_ms": lt.get("itl_ms", {}).get("p50"), "itl_p99_ms": lt.get("itl_ms", {}).get("p99"),
        "sessions_opened": lt.get("sessions"), "tokens": lt.get("tokens"), "elapsed_s": lt.get("elapsed_s"),
        "errors_by_code": lt.get("errors_by_code"), "client_errors": lt.get("client_errors"),
        "evictions": {n: sum(counter_delta(before[n], after[n], "specdec_cache_evictions_total").values())
                      for n in WORKERS},
        "admission_refused": {n: counter_delta(before[n], after[n], "specdec_admission_refused_total")
                              for n in SERVICES},
        "server_errors": {n: {k: v for k, v in counter_delta(before[n], after[n], "specdec_requests_total").items()
                              if 'code="OK"' not in k} for n in SERVICES},
        "forward_ms_mean": {n: mean_ms(before[n], after[n], f'specdec_forward_seconds_{{}}{{{{role="{n}"}}}}')
                            for n in WORKERS},
        "cache_sessions_at_end": {n: after[n].get(f'specdec_cache_sessions{{role="{n}"}}') for n in WORKERS},
        "peak_rss_mb": hwm, "rss_after_first_minute_mb": rss.after_first_minute or None,
        "rss_max_sampled_mb": rss.max, "rss_at_end_mb": rss.latest,
        **health.summary(),
        "services_alive_at_end": alive, "log_errors": scan_logs(log_dir),
        "model": "tiny random pair" if a.tiny else "embedded pair (SmolLM2-135M-Instruct; draft Q4_1 GGUF)",
        "settings": settings, "loadtest_exit_code": loadtest.returncode, "max_new_tokens": a.max_new_tokens,
        "machine": machine(), "commit": git_commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "loadtest": lt,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(summary_text(result), flush=True)
    print(f"soak: wrote {a.out}; logs in {log_dir}", flush=True)
    ok = result["failures"] == 0 and result["requests"] > 0 and not result["health_failures"]
    return 0 if ok and all(alive.values()) else 1


def interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def follow(stream, log, counts: dict) -> None:
    """Copy the load test's stderr to its log, keeping its latest ok / failed counts."""
    for line in stream:
        log.write(line)
        log.flush()
        if m := PROGRESS_LINE.search(line):
            counts["ok"], counts["failed"] = int(m[1]), int(m[2])


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return None


def fmt(value) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def summary_text(r: dict) -> str:
    return "\n".join([
        f"soak: {r['users']} users x {r['minutes']:g} min, single turn, sessions never ended",
        f"  requests {r['requests']} ({r['failures']} failed; {r['sessions_opened']} sessions), "
        f"{fmt(r['tokens_per_s'])} tokens/s",
        f"  TTFT p50 {fmt(r['ttft_p50_ms'])} p99 {fmt(r['ttft_p99_ms'])} ms | "
        f"ITL p50 {fmt(r['itl_p50_ms'])} p99 {fmt(r['itl_p99_ms'])} ms",
        f"  evictions {r['evictions']}",
        f"  peak RSS MB {r['peak_rss_mb']}; after 1 min {r['rss_after_first_minute_mb']}; at end {r['rss_at_end_mb']}",
        f"  health p50 {fmt(r['health_p50_ms'])} p99 {fmt(r['health_p99_ms'])} max {fmt(r['health_max_ms'])} ms, "
        f"{r['health_failures']} failures of {r['health_checks']}",
        f"  error lines in logs: {({k: v['count'] for k, v in r['log_errors'].items()}) or 'none'}",
    ])


if __name__ == "__main__":
    sys.exit(main())
