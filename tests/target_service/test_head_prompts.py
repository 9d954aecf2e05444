"""Draft-head training prompts: built offline from installed text, deterministic for a seed, distinct,
well-formed chat messages, and disjoint from the benchmark prompts when their exclusions are passed."""

from __future__ import annotations

from target_service.head_prompts import benchmark_exclusions, sources, training_prompts


def texts(prompts: list[list[dict]]) -> list[str]:
    return [m["content"] for p in prompts for m in p]


def test_sources_produce_snippets():
    """Package READMEs and stdlib docstrings are always there; each yields snippets."""
    counts = sources()
    assert counts["metadata"] > 0 and counts["stdlib"] > 0
    assert sum(counts.values()) > 1000


def test_deterministic_for_a_seed():
    assert training_prompts(500, seed=3) == training_prompts(500, seed=3)
    assert training_prompts(500, seed=3) != training_prompts(500, seed=4)


def test_n_distinct_well_formed_prompts():
    prompts = training_prompts(20_000)
    assert len(prompts) == 20_000
    assert len(set(texts(prompts))) == 20_000
    for p in prompts:
        assert len(p) == 1 and set(p[0]) == {"role", "content"} and p[0]["role"] == "user"
        assert isinstance(p[0]["content"], str) and p[0]["content"].strip()


def test_kinds_interleave():
    """The first prompts already mix templates rather than running through one kind."""
    starts = {t.split()[0] for t in texts(training_prompts(100))}
    assert len(starts) >= 10


def test_excluded_strings_never_appear():
    plain = texts(training_prompts(2000))
    banned = ["Summarize", "Python", plain[7][:30], plain[1500][5:25]]
    kept = texts(training_prompts(2000, exclude=banned))
    assert len(kept) == 2000
    assert not [t for t in kept if any(b in t for b in banned)]


def test_benchmark_prompts_do_not_leak():
    """No prompt contains, or shares its first 60 characters with, a benchmark prompt."""
    exclusions = benchmark_exclusions()
    assert len(exclusions) > 20
    prompts = texts(training_prompts(20_000, exclude=exclusions))
    assert len(prompts) == 20_000
    assert not set(exclusions) & {t[:60] for t in prompts}
    assert not [t for t in prompts if any(e in t for e in exclusions)]
