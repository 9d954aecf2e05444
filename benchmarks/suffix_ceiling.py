"""How far suffix decoding can go on the repetitive set, offline: the target's greedy answers to the
set (and to the history a benchmark row's tenant serves first) replayed through `SuffixProposer`
round by round, against an oracle that knows the answer.

For each request, in the set's order (as at c1, each indexed once it finishes):
- proposer: at every round the proposer's continuation (K <= --k) from the session and the tenant's
  index; the tokens it gets right, plus the target's own, are the round's tokens;
- oracle: the longest prefix of the rest of the answer (<= K) that occurs anywhere in the index or
  the session so far: what a chain drafted from existing text could serve at best, knowing which
  occurrence to copy.
Tokens per round for both, by kind of request; and, from benchmarks/results/repetitive.json (if
present), the share of a K = 0 request's wall that is its prefill (time to first token), which no
draft shortens: the speedup left to decoding is bounded by it.

    .venv/bin/python benchmarks/suffix_ceiling.py [--k 10] [--history 8]

Writes benchmarks/results/suffix_ceiling.json. The answers come from transformers' generate (the
target's greedy tokens; the service's may differ in a rare near-tie, which does not matter here).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from prompts import REPETITIVE_HISTORY_START, REPETITIVE_KINDS, REPETITIVE_SIZE, repetitive, repetitive_kind  # noqa: E402


def answers(items: list[list[dict]], max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec_core.engine.models import resolve_model
    from specdec_core.engine.options import EngineOptions

    path = resolve_model("smollm2", EngineOptions.from_env().cache_dir)
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    out = []
    for messages in items:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            new = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(ids):]
        out.append((list(ids), new.tolist()))
    return out


def occurs(haystacks: list[str], tokens: list[int]) -> bool:
    needle = "," + ",".join(map(str, tokens)) + ","
    return any(needle in h for h in haystacks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--history", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=HERE / "results" / "suffix_ceiling.json")
    a = p.parse_args()
    from coordinator.suffix import SuffixProposer

    started = time.time()
    history = answers(repetitive(a.history, REPETITIVE_HISTORY_START), a.max_new_tokens)
    measured = answers(repetitive(REPETITIVE_SIZE), a.max_new_tokens)
    proposer = SuffixProposer()
    index = []  # the oracle's haystacks: ",id,id,...," per finished request
    for prompt, answer in history:
        proposer.finished("t", prompt + answer)
        index.append("," + ",".join(map(str, prompt + answer)) + ",")
    kinds = {kind: {"tokens": 0, "rounds": 0, "oracle_rounds": 0, "prompt_tokens": 0} for kind in REPETITIVE_KINDS}
    for i, (prompt, answer) in enumerate(measured):
        t = kinds[repetitive_kind(i)]
        t["tokens"] += len(answer)
        t["prompt_tokens"] += len(prompt)
        pos = 0
        while pos < len(answer):  # the proposer
            draft = proposer.continuation(prompt + answer[:pos], a.k, "t")
            ok = next((j for j, d in enumerate(draft) if pos + j >= len(answer) or d != answer[pos + j]), len(draft))
            t["rounds"] += 1
            pos += ok + 1
        pos = 0
        while pos < len(answer):  # the oracle
            seen = index + ["," + ",".join(map(str, prompt + answer[:pos])) + ","]
            ok = 0
            while ok < a.k and pos + ok < len(answer) and occurs(seen, answer[pos:pos + ok + 1]):
                ok += 1
            t["oracle_rounds"] += 1
            pos += ok + 1
        proposer.finished("t", prompt + answer)
        index.append("," + ",".join(map(str, prompt + answer)) + ",")
    result = {"generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "k": a.k, "history": a.history,
              "seconds": time.time() - started, "by_kind": {}}
    for kind, t in kinds.items():
        result["by_kind"][kind] = {**t, "proposer_tokens_per_round": t["tokens"] / t["rounds"],
                                   "oracle_tokens_per_round": t["tokens"] / t["oracle_rounds"]}
    total = {key: sum(t[key] for t in kinds.values()) for key in ("tokens", "rounds", "oracle_rounds")}
    result["proposer_tokens_per_round"] = total["tokens"] / total["rounds"]
    result["oracle_tokens_per_round"] = total["tokens"] / total["oracle_rounds"]
    bench = HERE / "results" / "repetitive.json"
    if bench.exists():  # the prefill's share of a plain request's wall, per kind, at c1
        rows = json.loads(bench.read_text())["results"]
        k0 = next(r for r in rows if (r["prompt_set"], r["config"], r["concurrency"]) == ("repetitive", "target_k0", 1))
        share = {}
        for kind in REPETITIVE_KINDS:
            reqs = [q for q in k0["requests"] if repetitive_kind(q["prompt_index"]) == kind]
            share[kind] = sum(q["ttft_ms"] for q in reqs) / 1e3 / sum(q["wall_s"] for q in reqs)
        reqs = k0["requests"]
        share["all"] = sum(q["ttft_ms"] for q in reqs) / 1e3 / sum(q["wall_s"] for q in reqs)
        result["k0_prefill_share_of_wall"] = share
        result["best_speedup_at_infinite_decoding"] = 1 / share["all"]
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
