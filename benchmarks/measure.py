"""What one request looked like from the client's side (when each chunk of tokens arrived), peak
memory of processes, and the statistics of one configuration built from its requests.

Definitions (the same for every runner, ours or a baseline):
- tokens/s aggregate = all tokens / wall time of the whole batch (sequential runs: the sum of the
  requests' wall times); per request = the mean over requests of tokens / that request's wall time;
- TTFT = request start to the arrival of the first chunk holding a token;
- ITL = for every later chunk, the gap since the previous chunk divided by the chunk's tokens,
  counted once per token (the extra tokens of the first chunk have no ITL);
- acceptance = accepted / drafted; target passes = rounds + decoded (a round is one Verify call: its
  verdict's pass, plus one pass per token of its plain decoding steps); mean accepted length =
  committed tokens / passes = (accepted + passes) / passes (tokens per target pass); tokens per
  round = (accepted + passes) / rounds; Leviathan's prediction = (1 - a^(K+1)) / (1 - a) from the
  measured a;
- ms per round = the coordinator's own split: draft (the draft time on the critical path; with
  overlap, only what was not hidden), verify, overhead = wall - draft - verify (network, Redis,
  coordinator); verify ms per pass = verify ms / passes.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from coordinator.policy import expected_tokens as expected_tokens_per_pass

SPEC_KEYS = ("rounds", "drafted", "accepted", "decoded", "draft_ms", "verify_ms", "overhead_ms", "head_rounds")


@dataclass
class Request:
    prompt_index: int
    started: float = field(default_factory=time.perf_counter)
    ended: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in the chunk)
    token_ids: list[int] = field(default_factory=list)
    stats: dict | None = None  # the coordinator's speculation stats (specdec runs only)

    def arrive(self, token_ids: list[int]) -> None:
        if token_ids:
            self.arrivals.append((time.perf_counter(), len(token_ids)))
            self.token_ids += token_ids

    def finish(self) -> Request:
        self.ended = time.perf_counter()
        return self

    @property
    def wall_s(self) -> float:
        return self.ended - self.started

    @property
    def ttft_ms(self) -> float | None:
        return (self.arrivals[0][0] - self.started) * 1e3 if self.arrivals else None

    def itl_ms(self) -> list[float]:
        out = []
        for (before, _), (at, n) in zip(self.arrivals, self.arrivals[1:]):
            out += [(at - before) * 1e3 / n] * n
        return out

    def record(self) -> dict:
        return {"prompt_index": self.prompt_index, "num_tokens": len(self.token_ids), "wall_s": self.wall_s,
                "tokens_per_s": len(self.token_ids) / self.wall_s if self.wall_s > 0 else None,
                "ttft_ms": self.ttft_ms, "output_sha1": digest(self.token_ids), "stats": self.stats}


def digest(token_ids: list[int]) -> str:
    return hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:12]


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(values, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}


class MemoryProbe:
    """Peak resident memory (VmHWM) of named processes; reset() restarts the peaks at the current
    resident size (writing 5 to /proc/PID/clear_refs), so that a peak belongs to one configuration."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids

    def reset(self) -> None:
        for pid in self.pids.values():
            try:
                with open(f"/proc/{pid}/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass  # not Linux, or not ours: the peak then covers the process' whole life

    def peak_mb(self) -> dict[str, float | None]:
        return {name: _vm_hwm_mb(pid) for name, pid in self.pids.items()}


def _vm_hwm_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def max_memory(a: dict, b: dict) -> dict:
    return {k: max((v for v in (a.get(k), b.get(k)) if v is not None), default=None) for k in {**a, **b}}


def config_stats(requests: list[Request], wall_s: float, k: int | None) -> dict:
    """Everything a table row needs, from the requests of one configuration."""
    tokens = sum(len(r.token_ids) for r in requests)
    itl = [x for r in requests for x in r.itl_ms()]
    ttft = [r.ttft_ms for r in requests if r.ttft_ms is not None]
    return {
        "num_requests": len(requests),
        "num_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "tokens_per_s_per_request": float(np.mean([len(r.token_ids) / r.wall_s for r in requests])),
        "ttft_ms": percentiles(ttft),
        "itl_ms": percentiles(itl),
        "speculation": speculation_stats(requests, k),
    }


def speculation_stats(requests: list[Request], k: int | None) -> dict | None:
    if not requests or any(r.stats is None for r in requests):
        return None
    t = {key: sum(r.stats.get(key, 0) for r in requests) for key in SPEC_KEYS}
    rounds = max(1, t["rounds"])
    passes = rounds + t["decoded"]
    alpha = t["accepted"] / t["drafted"] if t["drafted"] else None
    mean_k = t["drafted"] / rounds
    return {
        **{key: t[key] for key in ("rounds", "drafted", "accepted", "decoded")},
        "passes": passes,
        "acceptance_rate": alpha,
        "mean_accepted_length": (t["accepted"] + passes) / passes,
        "tokens_per_round": (t["accepted"] + passes) / rounds,
        # a row of head rounds only (head_kK): tokens a round that verified a head proposal commits
        "head_acceptance_length": (t["accepted"] + t["head_rounds"]) / t["head_rounds"] if t["head_rounds"] else None,
        "verify_ms_per_pass": t["verify_ms"] / passes,
        "mean_k": mean_k,
        "leviathan_expected_length": expected_tokens_per_pass(alpha, k) if alpha is not None and k else None,
        "leviathan_at_mean_k": _leviathan_real_k(alpha, mean_k) if alpha is not None else None,
        "ms_per_round": {"draft": t["draft_ms"] / rounds, "verify": t["verify_ms"] / rounds,
                         "overhead": t["overhead_ms"] / rounds},
    }


def _leviathan_real_k(alpha: float, k: float) -> float:
    """(1 - a^(K+1)) / (1 - a) for a non-integer mean K (adaptive runs, blocks cut at the end)."""
    return k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)


class Progress:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {message}", file=sys.stderr, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def machine() -> dict:
    return {"cpus": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else None, "loadavg": os.getloadavg()}
