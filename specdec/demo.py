"""`specdec demo`'s requests, on a running stack: a chat answer and a repetitive extraction, each
measured with speculation and then with the target alone, compared token by token.

The coordinator's suffix index holds each finished request of the tenant (prompt and output), so a
speculative run must come before the target-alone run of the same prompt: the other way round, it
would draft from its own answer and look faster than any real request could. That order favours the
target alone in one way: it restores the prompt's prefill that the speculative run paid (the KV
tier), so a speedup compares the decoding after the first tokens, which is what speculation changes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from specdec.client import Client
from specdec.terminal import format_stats, stream_to_terminal

EXTRACTION = "Extract the name, city and age as JSON from: {text}"
# Invented people; the first ones are asked before the measured one, the last is new.
EXTRACTION_TEXTS = [
    "Maria Lopez, 34, moved to Madrid last spring to work as a nurse.",
    "Our new intern is Kenji Sato; he is 22 and shares a flat in Osaka.",
    "Born 41 years ago in a village, Amara Okafor now runs a bakery in Lagos.",
    "Lukas Berg (29) teaches chemistry at a secondary school in Oslo.",
]
SLOW = 0.95  # below this speedup the summary explains why


@dataclass
class Comparison:
    """One prompt answered with speculation and with the target alone (stream_to_terminal's dicts)."""

    spec: dict
    base: dict
    greedy: bool

    @property
    def speedup(self) -> float:
        """Decoding speed (prefill excluded: see the module docstring) with speculation over without."""
        spec, base = self.spec["decode_tokens_per_s"], self.base["decode_tokens_per_s"]
        return spec / base if base else 0.0

    @property
    def differs_at(self) -> int | None:
        """The first position where the two answers' token ids differ (None: identical)."""
        return first_difference(self.spec["token_ids"], self.base["token_ids"])


def run(client: Client, prompt: str, gen_kwargs: dict) -> int:
    """The whole demo on `client`'s stack; 1 if a greedy answer changed under speculation (a bug).
    Every request is one-shot: it ends its session (nothing is left behind in Redis or the workers)."""
    gen_kwargs = {**gen_kwargs, "end_session": True}
    for draft in ("default", "none"):  # warm both paths up (first calls pay one-off costs)
        client.generate("Hi!", chat=True, max_new_tokens=4, draft=draft, end_session=True)
    chat = compare(client, prompt, gen_kwargs)
    print(f"\nspecdec: {len(EXTRACTION_TEXTS) - 1} earlier extractions, each a new session (their prompts and "
          "answers enter the tenant's suffix index):", file=sys.stderr)
    for text in EXTRACTION_TEXTS[:-1]:
        r = client.generate(EXTRACTION.format(text=text), chat=True, **gen_kwargs)
        print(f"  {text}  -> {r.completion_tokens} tokens, {policy_used(r.stats)}", file=sys.stderr)
    extraction = compare(client, EXTRACTION.format(text=EXTRACTION_TEXTS[-1]), gen_kwargs)
    summarize({"chat": chat, f"extraction after {len(EXTRACTION_TEXTS) - 1} similar requests": extraction})
    return 1 if any(c.greedy and c.differs_at is not None for c in (chat, extraction)) else 0


def compare(client: Client, prompt: str, gen_kwargs: dict) -> Comparison:
    """Stream `prompt` with speculation, then (never before: see the module docstring) alone."""
    print(f"\n>>> {prompt}\n", file=sys.stderr)
    spec = stream_to_terminal(client, prompt, chat=True, **gen_kwargs)
    print(f"{policy_used(spec)}", file=sys.stderr)
    print("\n--- the same request with the target alone (K = 0, same path) ---", file=sys.stderr)
    base = stream_to_terminal(client, prompt, chat=True, quiet=True, **{**gen_kwargs, "draft": "none"})
    print(format_stats(base), file=sys.stderr)
    c = Comparison(spec, base, greedy=not gen_kwargs.get("temperature"))
    print(f"\n{identity(c)}; speedup {c.speedup:.2f}x (decoding {spec['decode_tokens_per_s']:.1f} vs "
          f"{base['decode_tokens_per_s']:.1f} tokens/s after the first tokens; end to end {spec['tokens_per_s']:.1f} "
          f"vs {base['tokens_per_s']:.1f})", file=sys.stderr)
    return c


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ, counting a missing token as a difference."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def identity(c: Comparison) -> str:
    """The verdict on the two answers' token ids."""
    spec_ids, base_ids = c.spec["token_ids"], c.base["token_ids"]
    if not c.greedy:
        return "sampled: two independent draws, not compared token by token"
    i = c.differs_at
    if i is None:
        return f"output identical ({len(spec_ids)} tokens)"

    def at(ids: list[int]) -> str:
        return str(ids[i]) if i < len(ids) else "end"

    return (f"!!! OUTPUT DIFFERS from the target alone at token {i} (speculative {at(spec_ids)}, target "
            f"{at(base_ids)}; {len(spec_ids)} vs {len(base_ids)} tokens): greedy speculation must reproduce the "
            "target's answer exactly, so this is a bug; please report it with the logs")


def policy_used(stats: dict) -> str:
    """Which drafting method the rounds used, e.g. "policy: suffix for 31 of 40 rounds, ..."."""
    rounds, suffix, model, head = (stats.get(key, 0) for key in ("rounds", "suffix_rounds", "model_rounds",
                                                                  "head_rounds"))
    return (f"policy: the target's draft head for {head} of {rounds} rounds, suffix for {suffix}, the draft model "
            f"for {model}, no draft for {rounds - suffix - model - head}")


def summarize(comparisons: dict[str, Comparison]) -> None:
    print("\nsummary (decoding speed with speculation over the target alone, one run each):", file=sys.stderr)
    for name, c in comparisons.items():
        verdict = "" if c.greedy and c.differs_at is None else f"; {identity(c)}"
        print(f"  {name}: {c.speedup:.2f}x{verdict}", file=sys.stderr)
    slow = [name for name, c in comparisons.items() if c.speedup < SLOW]
    if slow:
        print(f"({' and '.join(slow)}: slower than the target alone. The embedded draft model costs about what the "
              "target does on a CPU (both read the same 4-bit codes), so the policy drafts with it only where its "
              "measured costs say it pays, and drafts nothing where no free proposal exists; a suffix draft costs "
              "almost nothing and pays where text repeats. benchmarks/README.md: \"Why speculation with this "
              "draft cannot pay much here\")", file=sys.stderr)
