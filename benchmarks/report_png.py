"""latest.png: aggregate tokens/s per configuration and concurrency, one panel per prompt set
(the pinned layout's rows go into the chat panel, prefixed "pinned:")."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def panels(result: dict) -> dict[str, dict[str, dict[int, float]]]:
    """prompt set -> configuration -> concurrency -> aggregate tokens/s."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for r in result["results"]:
        name = r["config"] if r["layout"] == "main" else f"{r['layout']}:{r['config']}"
        value = r["stats"]["tokens_per_s"]
        if value is not None:
            out.setdefault(r["prompt_set"], {}).setdefault(name, {})[r["concurrency"]] = value
    return out


def chart(result: dict, path: Path) -> None:
    data = panels(result)
    levels = result["meta"]["plan"]["levels"]
    fig, axes = plt.subplots(1, max(1, len(data)), figsize=(6.5 * max(1, len(data)), 5.5), squeeze=False)
    for ax, (prompt_set, configs) in zip(axes[0], data.items()):
        draw_panel(ax, prompt_set, configs, levels)
    fig.suptitle(f"specdec, embedded pair, greedy, {result['meta']['plan']['max_new_tokens']} new tokens: "
                 "aggregate tokens/s (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_panel(ax, prompt_set: str, configs: dict[str, dict[int, float]], levels: list[int]) -> None:
    names = list(configs)
    width = 0.8 / len(levels)
    for j, c in enumerate(levels):
        xs = [i + (j - (len(levels) - 1) / 2) * width for i, n in enumerate(names) if c in configs[n]]
        ys = [configs[n][c] for n in names if c in configs[n]]
        ax.bar(xs, ys, width, label=f"c = {c}")
    baseline = configs.get("target_k0", {}).get(1)
    if baseline:
        ax.axhline(baseline, color="gray", linestyle="--", linewidth=1, label="target_k0, c = 1")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.set_title(f"{prompt_set} prompts")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
