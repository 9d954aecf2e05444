"""Speculative decoding vs the same target alone, on the embedded pair, through the full service
path (Redis, draft, target and coordinator as separate processes), greedy, one request at a time.

    .venv/bin/python benchmarks/embedded_pair.py [--max-new-tokens 128] [--k 5] [--repeats 1]

Both configurations run in the same process tree, interleaved prompt by prompt, so that the ratio
is fair on a noisy shared machine. Writes benchmarks/results/embedded_pair.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.policy import expected_tokens as expected_tokens_per_pass  # noqa: E402
from draft_service.config import resolve_backend  # noqa: E402
from report import DRAFTS  # noqa: E402 - this script's folder is on the path, as for run.py
from specdec import Client  # noqa: E402
from specdec.launcher import Stack  # noqa: E402
from specdec_core.engine.options import EngineOptions  # noqa: E402

CHAT_PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between Python lists and tuples?",
]


def timed(client: Client, prompt: str, **kwargs) -> dict:
    started = time.perf_counter()
    first = None
    tokens = []
    last = None
    for chunk in client.stream([{"role": "user", "content": prompt}], **kwargs):
        if first is None and chunk.token_ids:
            first = time.perf_counter()
        tokens += chunk.token_ids
        last = chunk
    wall = time.perf_counter() - started
    s = last.stats
    return {"tokens": tokens, "wall_s": wall, "ttft_ms": (first - started) * 1e3, "tokens_per_s": len(tokens) / wall,
            "rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted, "draft_ms": s.draft_ms,
            "verify_ms": s.verify_ms, "overhead_ms": s.overhead_ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--draft-backend", choices=["auto", "transformers", "llama.cpp"], default="auto",
                   help="the draft worker's backend (auto: what `specdec up` runs)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "embedded_pair"))
    a = p.parse_args()
    a.draft_backend = resolve_backend(a.draft_backend, "smollm2", EngineOptions.from_env())

    stack = Stack(log_dir=Path(tempfile.mkdtemp(prefix="specdec-bench-")),
                  args={"draft": ["--backend", a.draft_backend]})
    print("starting the stack ...", file=sys.stderr)
    stack.up()
    runs = []
    try:
        with Client(stack.address("coordinator"), timeout_s=600) as client:
            for k in (0, a.k):  # warm-up both paths
                client.generate("Hello!", chat=True, max_new_tokens=8, k=k)
            for r in range(a.repeats):
                for prompt in CHAT_PROMPTS:
                    kw = dict(max_new_tokens=a.max_new_tokens, stop_token_ids=[])
                    base = timed(client, prompt, k=0, **kw)
                    spec = timed(client, prompt, k=a.k, **kw)
                    identical = base["tokens"] == spec["tokens"]
                    runs.append({"prompt": prompt, "repeat": r, "identical": identical,
                                 "target_alone": base, "speculative": spec})
                    print(f"{prompt[:40]!r}: {spec['tokens_per_s']:.1f} vs {base['tokens_per_s']:.1f} tok/s "
                          f"({spec['tokens_per_s'] / base['tokens_per_s']:.2f}x), identical={identical}",
                          file=sys.stderr)
    finally:
        stack.down()
    write(summarize(runs, a), Path(a.out))


def summarize(runs: list[dict], a) -> dict:
    def total(kind: str, key: str) -> float:
        return sum(r[kind][key] for r in runs)

    tokens = {kind: sum(len(r[kind]["tokens"]) for r in runs) for kind in ("target_alone", "speculative")}
    tps = {kind: tokens[kind] / total(kind, "wall_s") for kind in tokens}
    alpha = total("speculative", "accepted") / max(1, total("speculative", "drafted"))
    rounds = total("speculative", "rounds")
    for r in runs:
        for kind in ("target_alone", "speculative"):
            r[kind]["num_tokens"] = len(r[kind].pop("tokens"))
    return {
        "config": {"target": "SmolLM2-135M-Instruct (transformers, fp32, from the Q4_1 GGUF)",
                   "draft": DRAFTS[a.draft_backend], "k": a.k, "max_new_tokens": a.max_new_tokens,
                   "prompts": len(CHAT_PROMPTS), "repeats": a.repeats, "greedy": True, "concurrency": 1,
                   "machine": f"{platform.machine()} {platform.processor() or ''} cpus={__import__('os').cpu_count()}"},
        "summary": {
            "target_alone_tokens_per_s": tps["target_alone"],
            "speculative_tokens_per_s": tps["speculative"],
            "speedup": tps["speculative"] / tps["target_alone"],
            "acceptance_rate": alpha,
            "mean_accepted_length": (total("speculative", "accepted") + rounds) / rounds,
            "leviathan_expected_length": expected_tokens_per_pass(alpha, a.k),
            "all_identical": all(r["identical"] for r in runs),
            "ms_per_round": {"draft": total("speculative", "draft_ms") / rounds,
                             "verify": total("speculative", "verify_ms") / rounds,
                             "overhead": total("speculative", "overhead_ms") / rounds},
        },
        "runs": runs,
    }


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    s, c = result["summary"], result["config"]
    md = [
        f"Embedded pair, greedy, concurrency 1, {c['prompts']} chat prompts x {c['repeats']}, "
        f"{c['max_new_tokens']} new tokens, K = {c['k']}, {c['machine']}",
        "",
        "| configuration | tokens/s | speedup | acceptance | tokens per target pass (measured / Leviathan) |",
        "|---|---|---|---|---|",
        f"| target alone (K = 0, same path) | {s['target_alone_tokens_per_s']:.1f} | 1.00x | - | 1.00 |",
        f"| speculative, model draft ({c['draft']}) | {s['speculative_tokens_per_s']:.1f} | {s['speedup']:.2f}x | "
        f"{s['acceptance_rate']:.1%} | {s['mean_accepted_length']:.2f} / {s['leviathan_expected_length']:.2f} |",
        "",
        f"Per round: draft {s['ms_per_round']['draft']:.1f} ms, verify {s['ms_per_round']['verify']:.1f} ms, "
        f"network + Redis + coordinator {s['ms_per_round']['overhead']:.1f} ms. "
        f"Output identical to the target alone: {s['all_identical']}.",
    ]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
