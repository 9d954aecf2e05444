"""From measured rows to latest.json (everything + "summary"), latest.md and latest.png."""

from __future__ import annotations

import json
import platform
from pathlib import Path

from measure import config_stats

SPECULATIVE = ("model_k5_overlap", "model_k5_no_overlap", "model_adaptive", "ngram_k10")
HF = ("hf_greedy", "hf_prompt_lookup")
NOTES = [
    "Greedy; one stack serves every specdec configuration (per-request K / overlap / draft method / adaptive).",
    "c1 rows: every prompt through every configuration in turn (order rotated per prompt); aggregate tokens/s = "
    "tokens / sum of request wall times. c>1 rows: c client threads, aggregate = tokens / batch wall time.",
    "hf_* rows run transformers generate in the benchmark process, one request at a time: transformers cannot batch "
    "assisted generation, so serving N requests is N sequential calls and their aggregate at any c equals c1's.",
    "llama_cpp_prompt_lookup runs the Q4_1 GGUF (quantized, not the fp32 target): different output, reference only.",
    "Under overlap the draft ms per round is only the draft time left on the critical path.",
    "model_adaptive: K chosen per round by Leviathan's formula from measured alpha and cost, at most 8; its "
    "Leviathan column uses the mean K it drafted.",
    "Peak RSS (VmHWM, MB, reset per configuration): d draft, t target, c coordinator, r redis; bench = the benchmark "
    "process, which holds the transformers model and the llama.cpp reference at once. CPU memory only: GPU memory "
    "is not measured.",
    "pinned layout: draft on one core (1 llama.cpp thread), target on the other (1 torch thread); coordinator and "
    "Redis unpinned.",
]


def build(rows: list[dict], meta: dict) -> dict:
    reference = {(r["prompt_set"], req.prompt_index): req.token_ids for r in rows
                 if (r["layout"], r["config"], r["concurrency"]) == ("main", "target_k0", 1) for req in r["requests"]}
    for r in rows:
        r["stats"] = config_stats(r["requests"], r["wall_s"], r["k"])
        same = [reference[(r["prompt_set"], q.prompt_index)] == q.token_ids for q in r["requests"]
                if (r["prompt_set"], q.prompt_index) in reference]
        r["stats"]["identical_to_target_k0"] = sum(same) / len(same) if same else None
    for r in rows:
        base = find(rows, r["layout"], r["prompt_set"], "target_k0", r["concurrency"])
        r["stats"]["vs_target_k0"] = ratio(r["stats"]["tokens_per_s"], base and base["tokens_per_s"])
    summary, notes = summarize(rows)
    meta = {**meta, "python": platform.python_version(), "versions": versions(), "notes": NOTES,
            "models": {"target": "SmolLM2-135M-Instruct, transformers fp32 (dequantized from the Q4_1 GGUF)",
                       "draft": "SmolLM2-135M-Instruct Q4_1 GGUF, llama.cpp"}}
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


def summarize(rows: list[dict]) -> tuple[dict, dict]:
    top = max((r["concurrency"] for r in rows), default=1)
    at_top = {c: tps(rows, "main", "grounded", c, top) for c in SPECULATIVE} if top > 1 else {}
    best = max((c for c in at_top if at_top[c]), key=at_top.get, default=None)
    hf = {c: tps(rows, "main", "grounded", c, 1) for c in HF}
    hf_best = max((c for c in hf if hf[c]), key=hf.get, default=None)
    summary = {
        "model_draft_c1_vs_target": ratio(tps(rows, "main", "chat", "model_k5_no_overlap", 1),
                                          tps(rows, "main", "chat", "target_k0", 1)),
        "ngram_c1_vs_hf_prompt_lookup": ratio(tps(rows, "main", "grounded", "ngram_k10", 1),
                                              tps(rows, "main", "grounded", "hf_prompt_lookup", 1)),
        "c8_vs_hf_assisted": ratio(best and at_top[best], hf_best and hf[hf_best]),
        "c8_vs_own_c1": ratio(best and at_top[best], best and tps(rows, "main", "grounded", best, 1)),
        "overhead_ms_per_round": overhead_per_round(rows),
        "overlap_pinned_vs_no_overlap": ratio(tps(rows, "pinned", "chat", "model_k5_overlap", 1),
                                              tps(rows, "pinned", "chat", "model_k5_no_overlap", 1)),
    }
    return summary, summary_notes(top, best, hf_best, hf)


def overhead_per_round(rows: list[dict]) -> float | None:
    stats = [q.stats for r in rows if (r["layout"], r["config"], r["concurrency"]) == ("main", "model_k5_no_overlap", 1)
             for q in r["requests"]]
    rounds = sum(s["rounds"] for s in stats)
    return sum(s["overhead_ms"] for s in stats) / rounds if rounds else None


def summary_notes(top: int, best: str | None, hf_best: str | None, hf: dict) -> dict:
    hf_values = ", ".join(f"{k} {v:.1f}" for k, v in hf.items() if v)
    return {
        "model_draft_c1_vs_target": "chat set, c1: model draft K=5 overlap off / target_k0 (K=0, same path), "
                                    "aggregate tokens/s",
        "ngram_c1_vs_hf_prompt_lookup": "input-grounded set, c1: ngram_k10 / transformers generate with "
                                        "prompt_lookup_num_tokens=10, same prompts",
        "c8_vs_hf_assisted": f"input-grounded set: best speculative config at c{top} ({best}) aggregate tokens/s / "
                             f"what transformers achieves serving the same requests sequentially, the better of "
                             f"greedy and prompt lookup ({hf_best}; {hf_values} tok/s)."
                             " An HF assisted generate with the llama.cpp draft is impossible (GGUF-only).",
        "c8_vs_own_c1": f"input-grounded set: {best} aggregate tokens/s at c{top} / the same config at c1",
        "overhead_ms_per_round": "model draft K=5 overlap off, c1, all prompt sets pooled: (wall - draft - verify) "
                                 "per round as the coordinator measures it (network + Redis + coordinator)",
        "overlap_pinned_vs_no_overlap": "pinned layout (draft core 0 / 1 thread, target core 1 / 1 thread), chat "
                                        "set, c1: model draft K=5 overlap on / overlap off",
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
    from report_md import markdown
    from report_png import chart

    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_suffix(".json"), out.with_suffix(".md"), out.with_suffix(".png")]
    paths[0].write_text(json.dumps(result, indent=1, default=str))
    paths[1].write_text(markdown(result))
    chart(result, paths[2])
    return paths

