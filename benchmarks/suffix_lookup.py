"""The suffix proposer (coordinator/suffix.py) on synthetic repetitive traffic: what a lookup costs at
the index's full default size, what the index holds in memory, and what it would accept.

Data (made here, seeded; no benchmark prompts): each tenant has a system prompt and a few templates;
a request is system prompt + template instruction + a document (Zipf-distributed ids from a
vocabulary of 49152, so frequent ids make short matches ambiguous, as in text), and its output is a
JSON-like record: fixed keys and punctuation, each value either copied from the document, one of a
few per-field choices, or fresh Zipf ids.

1. Memory: `--tenants` tenants' requests are added until the index is at its default bounds (64k
   tokens a tenant, 1M in total); tracemalloc measures what the index holds.
2. Lookup cost: on that full index, `continuation(committed, 10, tenant)` at random points of new
   requests' outputs (p50/p99/max ms). The index is fixed meanwhile; `--repeats` passes over the
   same lookups, and each lookup's fastest counts, so that other processes on a shared machine do
   not (the first pass is reported too). Then `finished` (add) for each, for reference.
3. Replay: each tenant's requests in turn; at every round the proposal (10 tokens at most) is
   compared with the true output: accepted tokens per round and a speedup at a verify cost of
   1 + c * proposed tokens decoding steps (c = 0.02 like a GPU, 0.1 like this CPU), against
   n-gram lookup and the session's own tokens alone. `--tune` sweeps alpha and min_prob (what chose
   the defaults).

    .venv/bin/python benchmarks/suffix_lookup.py [--tenants 16] [--lookups 2000] [--replay 120] [--tune]

Writes benchmarks/results/suffix_lookup.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.suffix import SuffixIndex, SuffixProposer  # noqa: E402
from measure import percentiles  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "suffix_lookup.json"
VOCAB = 49152
PUNCT = (123, 125, 1, 25, 11)  # {  }  "  :  ,
LOOKUP_TOKENS = 10
COSTS = (0.02, 0.1)


def ngram_continuation(ids: list[int], num_tokens: int, max_ngram: int = 4, min_ngram: int = 2) -> list[int]:
    """Prompt lookup (the n-gram method suffix decoding replaced), as the baseline: the tokens after the
    most recent earlier occurrence of the longest trailing n-gram, min_ngram <= n <= max_ngram."""
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        tail = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == tail:
                return ids[start + n:start + n + num_tokens]
    return []


class Tenant:
    """One tenant's synthetic traffic: requests as (prompt ids, output ids)."""

    def __init__(self, rng: random.Random, cum_weights: list[float], num_templates: int = 8):
        self.rng, self.cum = rng, cum_weights
        self.system = self.zipf(64)
        self.templates = [self.template() for _ in range(num_templates)]

    def zipf(self, n: int) -> list[int]:
        return self.rng.choices(range(VOCAB), cum_weights=self.cum, k=n)

    def template(self) -> tuple[list[int], list[tuple[list[int], list[list[int]]]]]:
        fields = [(self.zipf(self.rng.randint(1, 3)), [self.zipf(self.rng.randint(1, 4)) for _ in range(4)])
                  for _ in range(self.rng.randint(5, 10))]
        return self.zipf(32), fields

    def request(self, doc_tokens: int) -> tuple[list[int], list[int]]:
        instruction, fields = self.rng.choice(self.templates)
        doc = self.zipf(doc_tokens)
        out = [PUNCT[0]]
        for key, choices in fields:
            kind = self.rng.random()
            if kind < 0.3:
                start = self.rng.randrange(len(doc) - 8)
                value = doc[start:start + self.rng.randint(3, 8)]
            elif kind < 0.7:
                value = self.rng.choice(choices)
            else:
                value = self.zipf(self.rng.randint(1, 6))
            out += [PUNCT[2], *key, PUNCT[2], PUNCT[3], PUNCT[2], *value, PUNCT[2], PUNCT[4]]
        return self.system + instruction + doc, out + [PUNCT[1]]


def zipf_weights(s: float = 1.1) -> list[float]:
    return list(itertools.accumulate(1 / (rank + 1) ** s for rank in range(VOCAB)))


def fill(index: SuffixIndex, tenants: dict[str, Tenant], doc_tokens: int) -> None:
    """Add requests round-robin until every tenant is at its token bound."""
    while any(index.num_tokens(name) < index.max_tokens - 512 for name in tenants):
        for name, tenant in tenants.items():
            prompt, out = tenant.request(doc_tokens)
            index.add(name, prompt + out)


def measure(a: argparse.Namespace, cum: list[float]) -> dict:
    rng = random.Random(1)
    tenants = {f"t{i}": Tenant(rng, cum) for i in range(a.tenants)}
    tracemalloc.start()
    index = SuffixIndex()
    fill(index, tenants, a.doc_tokens)
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    proposer = SuffixProposer(index)
    names = list(tenants)
    queries = []
    for _ in range(a.lookups):
        name = rng.choice(names)
        prompt, out = tenants[name].request(a.doc_tokens)
        queries.append((name, prompt + out[:rng.randrange(len(out))], prompt + out))
    passes = [lookups(proposer, queries) for _ in range(a.repeats)]
    fastest = [min(times) for times in zip(*passes)]
    proposed = sum(bool(proposer.continuation(ids, LOOKUP_TOKENS, tenant=name)) for name, ids, _ in queries)
    add_ms = []
    for name, _, seq in queries:
        t = time.perf_counter()
        proposer.finished(name, seq)
        add_ms.append((time.perf_counter() - t) * 1e3)
    return {"tenants": a.tenants, "tokens_indexed": index.num_tokens(),
            "index_memory_mb": round(memory / 2**20, 2), "lookups": a.lookups, "passes": a.repeats,
            "lookup_ms": quantiles(fastest), "lookup_ms_first_pass": quantiles(passes[0]),
            "add_ms": {"p50": round(statistics.median(add_ms), 4), "max": round(max(add_ms), 4)},
            "proposed_fraction": round(proposed / a.lookups, 3)}


def lookups(proposer: SuffixProposer, queries: list[tuple[str, list[int], list[int]]]) -> list[float]:
    """One pass over the queries, in turn across tenants (their tapes as cold as in a server): ms each."""
    times = []
    for name, ids, _ in queries:
        t = time.perf_counter()
        proposer.continuation(ids, LOOKUP_TOKENS, tenant=name)
        times.append((time.perf_counter() - t) * 1e3)
    return times


def quantiles(ms: list[float]) -> dict[str, float]:
    """measure.percentiles (the benchmarks' one definition), with the max, to 0.1 µs."""
    return {name: round(value, 4) for name, value in {**percentiles(ms), "max": max(ms)}.items()}


def replay(propose, requests: list[tuple[str, list[int], list[int]]], finished) -> dict:
    """Rounds over each request's output: (tokens per round, speedup at each verify cost c)."""
    rounds = tokens = 0
    cost = dict.fromkeys(COSTS, 0.0)
    for name, prompt, out in requests:
        pos, seq = 0, prompt + out
        while pos < len(out):
            draft = propose(seq[:len(prompt) + pos], name)
            truth = out[pos:pos + len(draft)]
            accepted = next((i for i, t in enumerate(truth) if draft[i] != t), len(truth))
            pos += accepted + 1
            rounds, tokens = rounds + 1, tokens + accepted + 1
            for c in COSTS:
                cost[c] += 1 + c * len(draft)
        finished(name, seq)
    return {"tokens_per_round": round(tokens / rounds, 3),
            **{f"speedup_c{c}": round(tokens / cost[c], 3) for c in COSTS}}


def replays(a: argparse.Namespace, cum: list[float], sweep: list[tuple[float, float]]) -> dict:
    rng = random.Random(2)
    tenants = {f"t{i}": Tenant(rng, cum) for i in range(4)}
    requests = [(name, *tenant.request(a.doc_tokens))
                for _ in range(a.replay) for name, tenant in tenants.items()]
    rows = {"ngram": replay(lambda ids, _: ngram_continuation(ids, LOOKUP_TOKENS), requests, lambda *_: None)}
    for alpha, min_prob in sweep:
        p = SuffixProposer(SuffixIndex(), alpha=alpha, min_prob=min_prob)
        rows[f"suffix alpha={alpha} min_prob={min_prob}"] = replay(
            lambda ids, name: p.continuation(ids, LOOKUP_TOKENS, tenant=name), requests, p.finished)
        own = SuffixProposer(SuffixIndex(), alpha=alpha, min_prob=min_prob)  # never told of finished requests
        rows[f"suffix, own tokens only, alpha={alpha} min_prob={min_prob}"] = replay(
            lambda ids, name: own.continuation(ids, LOOKUP_TOKENS, tenant=name), requests, lambda *_: None)
    return rows


def defaults(p: SuffixProposer) -> dict:
    names = ("max_match", "min_match", "alpha", "min_prob", "max_occurrences")
    bounds = ("max_sequences", "max_tokens", "max_total_tokens")
    return {**{n: getattr(p, n) for n in names}, **{n: getattr(p.index, n) for n in bounds}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tenants", type=int, default=16, help="tenants filled to their bound (16 x 64k: the 1M total)")
    p.add_argument("--lookups", type=int, default=2000, help="timed lookups on the full index")
    p.add_argument("--repeats", type=int, default=3, help="passes over the lookups (each one's fastest counts)")
    p.add_argument("--doc-tokens", type=int, default=120, help="each request's document")
    p.add_argument("--replay", type=int, default=120, help="requests per tenant (4 tenants) replayed")
    p.add_argument("--tune", action="store_true", help="sweep alpha and min_prob in the replay")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args()
    cum = zipf_weights()
    default = SuffixProposer(SuffixIndex())
    results = {"generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": platform.processor(),
               "cpus": os.cpu_count(), "python": platform.python_version(), "defaults": defaults(default),
               "full_index": measure(a, cum)}
    print(json.dumps(results["full_index"], indent=1))
    sweep = ([(alpha, prob) for alpha in (1.0, 2.0, 4.0, 8.0) for prob in (0.05, 0.1, 0.2, 0.3)] if a.tune
             else [(default.alpha, default.min_prob)])
    results["replay"] = replays(a, cum, sweep)
    for name, row in results["replay"].items():
        print(f"{name:55s} {row}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
