"""What the KV tier (session KV in Redis) buys and costs, on the embedded default (SmolLM2-135M:
target in float32 on our paged backend, the draft as `specdec up` runs it), all services real.

1. Restore against re-prefill: a session with a `--prompt-tokens` prompt is served; its workers
   (both) and the coordinator are restarted, so nothing is cached; the session is continued and the
   time to its first new token (TTFT) is measured, once with the tier holding the session's KV
   (restore) and once with the tier emptied before the restart (re-prefill), `--reps` times each,
   alternating. Each run uses a prompt of its own.
2. Shared prefix: one session with a `--shared-tokens` system prompt is served, then `--sessions`
   new sessions with the same system prompt and questions of their own arrive together; their
   mean TTFT with the tier (and prefix sharing in the target's pool) against a stack without either
   (`--no-prefix-sharing`, no tier), and, for reference, with sharing in the pool but no tier.
3. Bytes per token of each model's stored KV (from the values in Redis), restore throughput (the
   workers' own restore timings), zlib's ratio and speed on stored chunks.
4. Steady-state cost: a long session decodes `--steady-tokens` tokens with the tier on, crossing
   many chunk boundaries; the time the tier adds on each worker's engine thread (the workers'
   `specdec_kv_store_round_seconds`) divided by the session's rounds.

Results: benchmarks/results/kvstore.json (benchmarks/README.md quotes it).

    .venv/bin/python benchmarks/kvstore.py [--prompt-tokens 1500] [--shared-tokens 1000] [--sessions 8] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import redis  # noqa: E402

from prompts import GROUNDED  # noqa: E402
from specdec import Client  # noqa: E402
from specdec.launcher import Stack, free_port, scrape_metrics  # noqa: E402
from specdec_core.engine.models import load_tokenizer  # noqa: E402
from specdec_core.engine.options import EngineOptions  # noqa: E402
from specdec_core.serving.kvstore import _HEADER  # noqa: E402

# Every request drafts with the model, so that both workers hold (and store) each session's KV: under
# the default policy a session here decodes plainly, the draft never sees its prompt, and a wait for
# the draft's chunks ran out (300 s).
DRAFTED = {"draft": "model", "k": 5}

OUT = ROOT / "benchmarks" / "results" / "kvstore.json"


def log(message: str) -> None:
    print(f"[kvstore {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        tokenizer = load_tokenizer("smollm2", EngineOptions.from_env().cache_dir)
        text = "\n\n".join(GROUNDED[i % len(GROUNDED)] + f" (part {i})" for i in range(400))
        self.corpus = tokenizer(text)["input_ids"]
        self.log_root = Path(tempfile.mkdtemp(prefix="specdec-kvstore-"))

    def ids(self, n: int, offset: int) -> list[int]:
        """n tokens of real text, different for each offset."""
        return self.corpus[offset * 997 % (len(self.corpus) - n):][:n]

    def start(self, name: str, tier: bool, sharing: bool) -> Stack:
        ports = {role: free_port() for role in ("draft", "target")}
        extra = [] if sharing else ["--no-prefix-sharing"]
        args = {role: ["--metrics-port", str(port), "--kv-chunk-tokens", str(self.a.chunk), *extra]
                for role, port in ports.items()}
        stack = Stack(args=args, log_dir=self.log_root / name, kv_store_mb=self.a.kv_mb if tier else 0)
        stack.metrics_ports = ports
        log(f"starting the {name} stack (tier {'on' if tier else 'off'}, prefix sharing {'on' if sharing else 'off'})")
        stack.up(wait_s=600)
        return stack

    # ------------------------------------------------------------------------------------------

    def ttft(self, stack: Stack, prompt, **kwargs) -> tuple[float, str]:
        """Seconds to the first streamed token, and the session id (the stream is read to its end)."""
        with Client(stack.address("coordinator"), timeout_s=900) as client:
            started = time.perf_counter()
            first, session = None, ""
            for chunk in client.stream(prompt, max_new_tokens=kwargs.pop("max_new_tokens", 8), **DRAFTED, **kwargs):
                session = session or chunk.session_id
                if first is None and chunk.token_ids:
                    first = time.perf_counter() - started
        return first, session

    def wait_written(self, stack: Stack, timeout_s: float = 120) -> None:
        """Until both workers have written every queued chunk."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pending = sum(self.metric(stack, role, "specdec_kv_store_pending_bytes") for role in ("draft", "target"))
            if pending == 0:
                time.sleep(0.5)  # a chunk being handed over between the two reads
                if sum(self.metric(stack, r, "specdec_kv_store_pending_bytes") for r in ("draft", "target")) == 0:
                    return
            time.sleep(0.2)
        raise TimeoutError("the workers' KV writes did not finish")

    def wait_stored(self, stack: Stack, before: dict[str, float], chunks: int, timeout_s: float = 300) -> None:
        """Until each worker has stored `chunks` more chunks than `before` (the draft prefills a long
        prompt behind the target's plain rounds, so it may finish well after the request)."""
        deadline = time.monotonic() + timeout_s
        while any(self.stored_chunks(stack, r) - before[r] < chunks for r in before):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers did not store {chunks} chunks")
            time.sleep(0.5)
        self.wait_written(stack)

    def stored_chunks(self, stack: Stack, role: str) -> float:
        return self.metric(stack, role, "specdec_kv_store_chunks_total", outcome="stored")

    def draft_ready_s(self, stack: Stack, timeout_s: float = 300) -> float:
        """The draft's first batch since it started, lease (and restore) included: how long the
        session waited for its draft."""
        deadline = time.monotonic() + timeout_s
        while self.metric(stack, "draft", "specdec_forward_seconds_count") < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.metric(stack, "draft", "specdec_forward_seconds_sum")

    @staticmethod
    def metric(stack: Stack, role: str, name: str, **labels) -> float:
        labels = {**labels, "role": role}
        key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        return scrape_metrics(stack.metrics_ports[role]).get(key, 0.0)

    @staticmethod
    def restart_all(stack: Stack) -> None:
        for name in ("draft", "target", "coordinator"):
            stack.restart(name, wait_s=600)

    # ------------------------------------------------------------------------------------------

    def restore_vs_prefill(self, stack: Stack) -> dict:
        kv = redis.Redis.from_url(stack.kv_store_url)
        times: dict[str, list[float]] = defaultdict(list)
        restore_s = {role: [] for role in ("draft", "target")}
        restored = {role: [] for role in ("draft", "target")}
        draft_ready: dict[str, list[float]] = defaultdict(list)
        for rep in range(self.a.reps):
            for mode in ("restore", "prefill") if rep % 2 == 0 else ("prefill", "restore"):
                prompt = self.ids(self.a.prompt_tokens, offset=10 * rep + (mode == "prefill"))
                before = {r: self.stored_chunks(stack, r) for r in ("draft", "target")}
                _, session = self.ttft(stack, prompt)
                self.wait_stored(stack, before, self.a.prompt_tokens // self.a.chunk)
                if mode == "prefill":
                    kv.flushall()
                self.restart_all(stack)
                seconds, _ = self.ttft(stack, self.ids(4, offset=999), session_id=session)
                times[mode].append(seconds)
                draft_ready[mode].append(self.draft_ready_s(stack))
                if mode == "restore":  # the restarted workers' counters hold this restore alone
                    for r in restore_s:
                        restore_s[r].append(self.metric(stack, r, "specdec_kv_store_restore_seconds_sum"))
                        restored[r].append(self.metric(stack, r, "specdec_kv_store_restored_tokens_total"))
                log(f"  {mode}: TTFT {seconds:.2f} s, draft ready after {draft_ready[mode][-1]:.2f} s, on restarted "
                    f"workers ({self.a.prompt_tokens}-token session)")
        return {
            "prompt_tokens": self.a.prompt_tokens,
            "ttft_restore_s": times["restore"], "ttft_reprefill_s": times["prefill"],
            "restore_s_by_role": restore_s, "restored_tokens_by_role": restored,
            "draft_ready_restore_s": draft_ready["restore"], "draft_ready_reprefill_s": draft_ready["prefill"],
            "restore_ttft_speedup": round(statistics.median(times["prefill"]) / statistics.median(times["restore"]), 2),
            "draft_ready_speedup": round(statistics.median(draft_ready["prefill"])
                                         / statistics.median(draft_ready["restore"]), 2),
        }

    def shared_prefix(self, stack: Stack, label: str) -> dict:
        system = self.ids(self.a.shared_tokens, offset=500)
        before = {r: self.stored_chunks(stack, r) for r in ("draft", "target")} if stack.kv_store_url else {}
        self.ttft(stack, system + self.ids(20, offset=600))  # the first session with it
        if stack.kv_store_url:
            self.wait_stored(stack, before, self.a.shared_tokens // self.a.chunk)
        self.draft_ready_s(stack)  # its draft prefill done: the workers idle when the sessions arrive
        results: list[float] = [0.0] * self.a.sessions
        def one(i: int) -> None:
            results[i] = self.ttft(stack, system + self.ids(30, offset=700 + i))[0]
        threads = [threading.Thread(target=one, args=(i,)) for i in range(self.a.sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        log(f"  shared prefix, {label}: mean TTFT {statistics.mean(results):.2f} s over {self.a.sessions} new sessions")
        return {"ttft_s": results, "mean_ttft_s": statistics.mean(results)}

    def stored(self, stack: Stack) -> dict:
        """Bytes per token of each model's chunks, and zlib on a sample of them."""
        kv = redis.Redis.from_url(stack.kv_store_url)
        by_model: dict[str, list[bytes]] = defaultdict(list)
        for key in kv.scan_iter("specdec:kv:*", count=1000):
            by_model[key.split(b":")[2].decode()].append(key)
        models, sample = {}, []
        owners = kv_owners(stack)
        for digest, keys in by_model.items():
            sizes = [kv.strlen(k) for k in keys]
            per_token = (statistics.mean(sizes) - _HEADER.size) / self.a.chunk
            models[owners.get(digest[:12], digest[:12])] = {"bytes_per_token": round(per_token), "chunks": len(keys),
                            "megabytes": round(sum(sizes) / 2**20, 1)}
            sample += [kv.get(k)[_HEADER.size:] for k in keys[:8]]
        started = time.perf_counter()
        packed = sum(len(zlib.compress(v, 1)) for v in sample)
        seconds = time.perf_counter() - started
        raw = sum(len(v) for v in sample)
        return {"models": models, "zlib_level1": {"ratio": round(raw / packed, 3),
                                                  "mb_per_s": round(raw / 2**20 / seconds, 1)}}

    def steady(self, stack: Stack) -> dict:
        """The tier's time per round while a long session decodes (its prompt already restored)."""
        names = ("specdec_kv_store_round_seconds_sum", "specdec_kv_store_round_seconds_count")
        with Client(stack.address("coordinator"), timeout_s=900) as client:
            first = client.generate(self.ids(self.a.prompt_tokens, offset=800), max_new_tokens=4, **DRAFTED)
            self.wait_written(stack)  # the prompt's chunks: a prefill's cost, not a steady round's
            before = {r: [self.metric(stack, r, n) for n in names] for r in ("draft", "target")}
            result = client.generate(self.ids(4, offset=801), max_new_tokens=self.a.steady_tokens, **DRAFTED,
                                     session_id=first.session_id)
        rounds = result.stats["rounds"]
        out = {"tokens": len(result.token_ids), "rounds": rounds}
        for role, (s0, c0) in before.items():  # per round of the session (a draft batch may serve several)
            s1, c1 = (self.metric(stack, role, n) for n in names)
            out[f"{role}_ms_per_round"] = round((s1 - s0) / rounds * 1e3, 3)
            out[f"{role}_batches"] = int(c1 - c0)
            out[f"{role}_ms_per_batch"] = round((s1 - s0) / max(1, c1 - c0) * 1e3, 3)
        return out


def kv_owners(stack: Stack) -> dict[str, str]:
    """The first 12 hex digits of each worker's KV model digest -> "role (layout)", from the line each
    worker logs when its tier starts ("KV tier on (draft): 64-token chunks, <layout>, model <digest>"):
    the draft and the target may store as many bytes per token (both float32 on our engine)."""
    owners = {}
    for path in Path(stack.log_dir).glob("*.log"):
        for m in re.finditer(r"KV tier on \((\w+)\): \d+-token chunks, (.*), model ([0-9a-f]{12})", path.read_text()):
            owners[m.group(3)] = f"{m.group(1)} ({m.group(2)})"
    return owners


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=1500, help="the restored session's length")
    p.add_argument("--shared-tokens", type=int, default=1000, help="the shared system prompt's length")
    p.add_argument("--sessions", type=int, default=8, help="new sessions sharing the system prompt")
    p.add_argument("--reps", type=int, default=2, help="restore / re-prefill pairs")
    p.add_argument("--chunk", type=int, default=64, help="--kv-chunk-tokens")
    p.add_argument("--kv-mb", type=int, default=2048, help="the KV tier's Redis maxmemory")
    p.add_argument("--steady-tokens", type=int, default=256, help="tokens decoded for the steady-state cost")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args()
    bench = Bench(a)
    results: dict = {"generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "config": {k: v for k, v in vars(a).items() if k != "out"},
                     "machine": "2 cores, no GPU", "models": "SmolLM2-135M (the embedded default): target float32 (paged), draft as `specdec up` runs it"}
    stack = bench.start("tier", tier=True, sharing=True)
    try:
        log("1. restore against re-prefill")
        results["restore"] = bench.restore_vs_prefill(stack)
        log("2. shared prefix with the tier")
        results["shared_prefix"] = {"tier": bench.shared_prefix(stack, "tier and pool sharing")}
        log("3. stored bytes")
        results["stored"] = bench.stored(stack)
        per_token = {r: next((m["bytes_per_token"] for n, m in results["stored"]["models"].items() if r in n), 0)
                     for r in ("draft", "target")}
        results["restore_throughput"] = {}
        for r in ("draft", "target"):
            tokens, seconds = sum(results["restore"]["restored_tokens_by_role"][r]), sum(results["restore"]["restore_s_by_role"][r])
            results["restore_throughput"][r] = {
                "tokens_per_s": round(tokens / seconds) if seconds else None,
                "mb_per_s": round(tokens * per_token[r] / 2**20 / seconds, 1) if seconds else None}
        log("4. steady-state cost per round")
        results["steady_round"] = bench.steady(stack)
    finally:
        stack.down()
    for label, sharing in (("none", False), ("pool sharing only", True)):
        stack = bench.start(label.replace(" ", "-"), tier=False, sharing=sharing)
        try:
            log(f"2. shared prefix, {label}")
            results["shared_prefix"][label] = bench.shared_prefix(stack, label)
        finally:
            stack.down()
    sp = results["shared_prefix"]
    results["restore_ttft_speedup"] = results["restore"]["restore_ttft_speedup"]
    results["shared_prefix_ttft_speedup"] = round(sp["none"]["mean_ttft_s"] / sp["tier"]["mean_ttft_s"], 2)
    results["steady_round_overhead_ms"] = max(results["steady_round"]["draft_ms_per_round"],
                                              results["steady_round"]["target_ms_per_round"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=2) + "\n")
    log(f"restore TTFT speedup {results['restore_ttft_speedup']}x, shared prefix {results['shared_prefix_ttft_speedup']}x, "
        f"steady cost {results['steady_round_overhead_ms']} ms/round; written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
