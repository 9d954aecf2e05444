"""What the OpenAI-compatible HTTP API costs over gRPC, and load from OpenAI-compatible clients
that nobody here wrote. One run, one stack (Redis, draft, target, coordinator, gateway):

1. Streaming overhead per token. The same greedy request is streamed through gRPC
   (GenerateStream, the specdec client) and through HTTP (the gateway's server-sent events, read a
   line at a time and JSON-decoded, as clients read them), in alternation, with K = 0 so that every round sends a chunk of one
   token: the most chunks, so the most transport cost, per token. Overhead per token = the median
   over pairs of (HTTP wall time - gRPC wall time) / tokens; and, less noisy, the gateway process's
   own CPU time per streamed token.
2. Load with locust's HTTP user (benchmarks/openai_locustfile.py): streamed chat completions,
   `--users` at once for `--load-seconds`; then the same load over gRPC (`specdec loadtest`).
3. Load with guidellm (a standard LLM serving benchmark, vLLM's project), when `--guidellm` names
   its executable: it lives in a virtual environment of its own (benchmarks/setup_guidellm.sh
   makes benchmarks/.guidellm-venv).

The model: the tiny test pair by default (a token every few milliseconds, so that transport is
what shows), or `--model smollm2` (the embedded default). Results: benchmarks/results/openai.json.

    .venv/bin/python benchmarks/openai_api.py [--pairs 30] [--tokens 128] [--users 8] [--load-seconds 60]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import openai  # noqa: E402

from specdec import Client  # noqa: E402
from specdec.launcher import Stack  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from prompts import CHAT  # noqa: E402

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
LOAD_PROMPTS = CHAT  # the benchmark's chat set: both load runs send these, in this order


def overhead(stack: Stack, pairs: int, tokens: int) -> dict:
    model = openai.OpenAI(base_url=stack.url(), api_key="none", max_retries=0).models.list().data[0].id
    body = json.dumps({"model": model, "messages": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True},
                       "speculation": {"method": "none"}}).encode()
    kwargs = dict(max_new_tokens=tokens, draft="none")
    with Client(stack.address("coordinator"), timeout_s=600) as client:

        def by_grpc() -> tuple[float, int, int]:
            started = time.perf_counter()
            chunks = list(client.stream(PROMPT, **kwargs))
            return time.perf_counter() - started, chunks[-1].usage.completion_tokens, len(chunks)

        def by_http() -> tuple[float, int, int]:
            """Server-sent events read as any client reads them: a line at a time, JSON-decoded."""
            started = time.perf_counter()
            request = urllib.request.Request(f"{stack.url()}/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            events, usage = 0, None
            with urllib.request.urlopen(request, timeout=600) as response:
                for line in response:
                    if line.startswith(b"data: {"):
                        events += 1
                        usage = json.loads(line[6:]).get("usage") or usage
            return time.perf_counter() - started, usage["completion_tokens"], events

        for warm in (by_grpc, by_http):
            warm()
        gateway = stack.processes["openai"].pid
        grpc_s, http_s, per_token, counts, cpu_s = [], [], [], [], []
        for i in range(pairs):
            order = (by_grpc, by_http) if i % 2 == 0 else (by_http, by_grpc)  # neither always goes first
            result = {}
            for f in order:
                cpu = cpu_seconds(gateway)
                result[f] = f()
                if f is by_http:
                    cpu_s.append(cpu_seconds(gateway) - cpu)
            (g, g_tokens, g_chunks), (h, h_tokens, h_chunks) = result[by_grpc], result[by_http]
            if g_tokens != h_tokens:
                raise AssertionError(f"different outputs: {g_tokens} vs {h_tokens} tokens")
            grpc_s.append(g)
            http_s.append(h)
            per_token.append((h - g) / g_tokens * 1e3)
            counts.append((g_tokens, g_chunks, h_chunks))
            print(f"  pair {i + 1}/{pairs}: grpc {g * 1e3:.0f} ms, http {h * 1e3:.0f} ms, "
                  f"{(h - g) / g_tokens * 1e3:+.3f} ms/token", file=sys.stderr)
    deciles = statistics.quantiles(per_token, n=10)
    tokens_total = sum(c[0] for c in counts)
    return {
        "http_stream_overhead_ms_per_token": statistics.median(per_token),
        # What the gateway itself spends per streamed token (its process's CPU time over the HTTP
        # requests): on a busy machine, the cost every token pays; far less noisy than wall times.
        "gateway_cpu_ms_per_token": sum(cpu_s) / tokens_total * 1e3,
        "overhead_ms_per_token_p10_p90": [deciles[0], deciles[-1]],
        "grpc_ms_per_token_median": statistics.median(grpc_s) / counts[0][0] * 1e3,
        "http_ms_per_token_median": statistics.median(http_s) / counts[0][0] * 1e3,
        "tokens_per_request": counts[0][0], "grpc_chunks": counts[0][1], "http_events": counts[0][2],
        "pairs": pairs,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def locust_load(stack: Stack, users: int, seconds: int, max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / "run")
        prompts = Path(tmp) / "prompts.txt"
        prompts.write_text("\n".join(LOAD_PROMPTS) + "\n")
        subprocess.run([sys.executable, "-m", "locust", "-f", str(ROOT / "benchmarks/openai_locustfile.py"),
                        "--host", f"http://{stack.address('openai')}", "--headless", "-u", str(users),
                        "-r", str(users), "-t", f"{seconds}s", "--csv", prefix, "--only-summary",
                        "--loglevel", "WARNING"], check=False, cwd=ROOT,
                       env={**os.environ, "MAX_TOKENS": str(max_tokens), "PROMPTS_FILE": str(prompts)})
        with open(prefix + "_stats.csv") as f:
            rows = {r["Name"]: r for r in csv.DictReader(f)}
    whole, ttft = rows["chat (stream)"], rows["ttft"]
    requests = int(whole["Request Count"])
    return {
        "tool": "locust HttpUser over HTTP (benchmarks/openai_locustfile.py)", "users": users, "seconds": seconds,
        "max_tokens": max_tokens, "requests": requests, "failures": int(whole["Failure Count"]),
        "tokens_per_s": float(whole["Average Content Size"]) * requests / seconds,
        "request_ms_p50": float(whole["50%"]), "request_ms_p99": float(whole["99%"]),
        "ttft_ms_p50": float(ttft["50%"]), "ttft_ms_p99": float(ttft["99%"]),
    }


def grpc_load(stack: Stack, users: int, seconds: int, max_tokens: int) -> dict:
    """The same load over gRPC (`specdec loadtest`), for comparison."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "grpc.json"
        prompts = Path(tmp) / "prompts.txt"
        prompts.write_text("\n".join(LOAD_PROMPTS) + "\n")
        subprocess.run([sys.executable, "-c", "from specdec.cli import main; main()", "loadtest",
                        "--address", stack.address("coordinator"), "-u", str(users), "-r", str(users),
                        "-t", str(seconds), "--max-new-tokens", str(max_tokens), "--json", str(out),
                        "--prompts-file", str(prompts), "--progress-interval", "0"],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        s = json.loads(out.read_text())
    return {"tool": "specdec loadtest over gRPC", "users": users, "seconds": seconds, "max_tokens": max_tokens,
            "requests": s["requests"], "failures": s["failed"], "tokens_per_s": s["tokens"] / seconds,
            "request_ms_p50": s["stream_ms"]["p50"], "request_ms_p99": s["stream_ms"]["p99"],
            "ttft_ms_p50": s["ttft_ms"]["p50"], "ttft_ms_p99": s["ttft_ms"]["p99"]}


def guidellm_load(stack: Stack, executable: str, tokenizer: str, users: int, requests: int, max_tokens: int) -> dict:
    """guidellm's concurrent profile: `users` streams, synthetic 64-token prompts."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "guidellm.json"
        command = [executable, "run", "--backend", f"kind=openai_http,target=http://{stack.address('openai')}",
                   "--profile", f"kind=concurrent,streams={users}", "--constraint", f"kind=max_requests,count={requests}",
                   "--data", f"kind=synthetic_text,prompt_tokens=64,output_tokens={max_tokens}",
                   "--tokenizer", f"kind=hf_auto,model={tokenizer}", "--output", f"kind=json,path={out}",
                   "--disable-progress"]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0 or not out.exists():
            raise RuntimeError(f"guidellm failed ({run.returncode}): {run.stderr[-2000:]}")
        metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]

    def median(name: str) -> float:
        return metrics[name]["successful"]["median"]

    return {"tool": "guidellm 0.8 (openai_http backend, concurrent profile)", "streams": users,
            "max_tokens": max_tokens, "requests": metrics["request_totals"],
            "requests_per_s_mean": metrics["requests_per_second"]["successful"]["mean"],
            "output_tokens_per_s_mean": metrics["output_tokens_per_second"]["successful"]["mean"],
            "ttft_ms_median": median("time_to_first_token_ms"), "itl_ms_median": median("inter_token_latency_ms"),
            "request_latency_s_median": median("request_latency")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (the test pair, default) or smollm2")
    p.add_argument("--pairs", type=int, default=30, help="gRPC/HTTP request pairs (default 30)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per overhead request (default 128)")
    p.add_argument("--users", type=int, default=8, help="concurrent users of the load runs (default 8)")
    p.add_argument("--load-seconds", type=int, default=60, help="locust run length (default 60)")
    p.add_argument("--load-tokens", type=int, default=64, help="max_tokens of the load runs (default 64)")
    default_guidellm = ROOT / "benchmarks/.guidellm-venv/bin/guidellm"
    p.add_argument("--guidellm", default=str(default_guidellm) if default_guidellm.exists() else "",
                   help="guidellm executable (default: benchmarks/.guidellm-venv's, from benchmarks/setup_guidellm.sh, "
                        "if it exists; empty: skip)")
    p.add_argument("--guidellm-requests", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/openai.json"))
    a = p.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="specdec-openai-bench-"))
    if a.model == "tiny":
        from tiny_models import make_tiny_pair

        target, draft = make_tiny_pair(log_dir / "models")
        stack = Stack(target_model=target, draft_model=draft, log_dir=log_dir, openai=True)
    else:
        stack = Stack(target_model=a.model, draft_model=a.model, log_dir=log_dir, openai=True,
                      args={"draft": ["--backend", "auto"]})  # as `specdec up` runs it
    print(f"starting the stack ({a.model}); logs in {log_dir}", file=sys.stderr)
    stack.up(wait_s=900)
    try:
        result = {"model": a.model, "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores"}
        print("1. streaming overhead (gRPC vs HTTP, alternating)", file=sys.stderr)
        result.update(overhead(stack, a.pairs, a.tokens))
        print(f"   {result['http_stream_overhead_ms_per_token']:.3f} ms per token", file=sys.stderr)
        print(f"2. locust, {a.users} users, {a.load_seconds} s", file=sys.stderr)
        result["locust_http"] = locust_load(stack, a.users, a.load_seconds, a.load_tokens)
        print(f"   {result['locust_http']}", file=sys.stderr)
        result["grpc_same_load"] = grpc_load(stack, a.users, a.load_seconds, a.load_tokens)
        print(f"   gRPC: {result['grpc_same_load']}", file=sys.stderr)
        if a.guidellm:
            print(f"3. guidellm, {a.users} concurrent, {a.guidellm_requests} requests", file=sys.stderr)
            result["guidellm"] = guidellm_load(stack, a.guidellm, stack.target_model, a.users, a.guidellm_requests,
                                               a.load_tokens)
            print(f"   {result['guidellm']}", file=sys.stderr)
    finally:
        stack.down()
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
