"""latest.md: the summary and one table per prompt set (plus the pinned layout), from latest.json."""

from __future__ import annotations

SERVICES = {"draft": "d", "target": "t", "coordinator": "c", "redis": "r", "benchmark_process": "bench"}
SUMMARY_FORMAT = {"overhead_ms_per_round": "{:.1f} ms", "target_peak_rss_c8_mb": "{:.0f} MB",
                  "target_rss_bound_c8_mb": "{:.0f} MB", "c8_chat_roofline_fraction": "{:.2f}",
                  "suffix_lookup_ms_p99": "{:.2f} ms", "_head_c1_chat_best_k": "K = {:.0f}",
                  "head_acceptance_length_k4": "{:.2f} tokens", "head_step_vs_target_pass": "{:.1%}"}
QUICK = ["**--quick run: a harness check (2 prompts per set, 32 new tokens), not a measurement.**", ""]
COLUMNS = ("configuration", "c", "tok/s aggregate", "tok/s per request", "vs target_k0", "TTFT p50 / p99 ms",
           "ITL p50 / p99 ms", "acceptance", "tokens per pass: measured / Leviathan",
           "ms per round: draft / verify / overhead", "roofline tok/s", "identical to target_k0", "peak RSS MB")


def markdown(result: dict) -> str:
    meta, plan = result["meta"], result["meta"]["plan"]
    lines = [
        "# specdec benchmark: embedded pair, greedy",
        "",
        f"{meta['started']}, {meta['wall_s'] / 60:.1f} min; device {plan['device']}; "
        f"{meta['machine_at_start']['cpus']} CPUs (load at start {_load(meta['machine_at_start'])}); "
        f"{plan['max_new_tokens']} new tokens; concurrency {', '.join(map(str, plan['levels']))}; "
        f"target: {meta['models']['target']}; draft: {meta['models']['draft']}. "
        f"Load at the end {_load(meta['machine_at_end'])}. Command: `benchmarks/run.py {' '.join(meta['argv'])}`.",
        "",
        *(QUICK if "--quick" in meta["argv"] else []),
        *(["**Partial results: the run is still going or stopped early.**", ""]
          if meta.get("complete") is False else []),
        "## Summary",
        "",
        "| metric | value | basis |",
        "|---|---|---|",
    ]
    for key, value in result["summary"].items():
        if isinstance(value, dict) and all(v is None or isinstance(v, (int, float)) for v in value.values()):
            shown = ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}x'}" for k, v in value.items())  # ratios
        elif isinstance(value, dict):  # figures of several kinds (e.g. a training's)
            shown = "; ".join(f"{k} {_figure(v)}" for k, v in value.items())
        elif isinstance(value, str):
            shown = value
        else:
            shown = "n/a" if value is None else SUMMARY_FORMAT.get(key, "{:.2f}x").format(value)
        lines.append(f"| {key} | {shown} | {result['summary_notes'].get(key, '')} |")
    groups = {}
    for r in result["results"]:
        groups.setdefault((r["layout"], r["prompt_set"]), []).append(r)
    for (layout, prompt_set), rows in groups.items():
        n = max(len({q["prompt_index"] for q in r["requests"]}) for r in rows)
        where = {"pinned": " (pinned layout)", "mixed": " (mixed load)",
                 "fresh_stack": " (fresh stacks: their first requests)"}.get(layout, "")
        lines += ["", f"## {prompt_set} prompts{where}, {n} per pass", ""]
        lines += table(sorted(rows, key=lambda r: r["concurrency"]))
    lines += ["", "## Notes", ""] + [f"- {note}" for note in meta["notes"]]
    return "\n".join(lines) + "\n"


def table(rows: list[dict]) -> list[str]:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        s, spec = r["stats"], r["stats"]["speculation"] or {}
        per = spec.get("ms_per_round")
        lev = spec.get("leviathan_at_mean_k" if r["k"] is None else "leviathan_expected_length")
        passes = f"{_f(spec.get('mean_accepted_length'), 2)} / {_f(lev, 2)}"
        cells = [
            r["config"], r["concurrency"], _f(s["tokens_per_s"], 1), _f(s["tokens_per_s_per_request"], 1),
            _f(s["vs_target_k0"], 2, "x"), _pair(s["ttft_ms"], 0), _pair(s["itl_ms"], 1),
            _f(spec.get("acceptance_rate"), 3),
            passes if spec.get("acceptance_rate") is not None else "-",
            " / ".join(_f(per[k], 1) for k in ("draft", "verify", "overhead")) if per else "-",
            _f(s.get("roofline_tokens_per_s"), 1),
            _f(s["identical_to_target_k0"] and 100 * s["identical_to_target_k0"], 0, "%"),
            _memory(r["memory_mb"]),
        ]
        out.append("| " + " | ".join(map(str, cells)) + " |")
    return out


def _f(value, digits: int, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _pair(p: dict, digits: int) -> str:
    return f"{_f(p['p50'], digits)} / {_f(p['p99'], digits)}"


def _memory(memory: dict) -> str:
    order = list(SERVICES)
    names = sorted(memory, key=lambda k: order.index(k) if k in order else len(order))
    return " · ".join(f"{SERVICES.get(k, k)} {memory[k]:.0f}" for k in names if memory[k] is not None) or "-"


def _load(m: dict) -> str:
    return ", ".join(f"{x:.1f}" for x in m["loadavg"])


def _figure(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_figure(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_figure(x) for x in v) + "]"
    return str(v)
