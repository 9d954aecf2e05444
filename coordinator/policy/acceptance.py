"""How many of a round's draft tokens the target accepts, as the policy estimates it.

A block of K draft tokens, each accepted with probability alpha independently of the others, commits

    E(alpha, K) = (1 - alpha^(K+1)) / (1 - alpha)

tokens per round: the accepted ones and the target's next (Leviathan et al., arXiv 2211.17192,
section 3.4). The draft model's alpha is a `Rate`, learnt from the rounds it drafts.

suffix lookups are not independent from token to token: a lookup either copies a passage (every
token of it matches, and so does the next lookup's) or guesses in free text (none does), so
acceptance comes in runs. `Runs` values a lookup by position and by whether the last lookup's first
token was accepted, instead of by one mean rate.
"""

from __future__ import annotations

OPTIMISTIC_ALPHA = 0.7  # the draft model's prior acceptance, and what a retry of it hopes for
LOOKUP_TOKENS = 10  # the longest suffix lookup the policy values (and proposes)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens committed per round for a block of K drafts accepted with probability alpha each."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class Rate:
    """A per-position acceptance rate: successes over trials, forgetting old rounds, with a prior."""

    def __init__(self, prior: float, weight: float = 2.0, forget: float = 0.9):
        self.successes, self.trials, self.forget = prior * weight, weight, forget

    def add(self, successes: int, trials: int) -> None:
        self.successes = self.successes * self.forget + successes
        self.trials = self.trials * self.forget + trials

    @property
    def value(self) -> float:
        return self.successes / self.trials if self.trials > 0 else 0.0


class Runs:
    """Suffix-lookup acceptance by position in the lookup, and by whether the session's last lookup had its
    first token accepted.

    rates[hit][j]: the probability that token j + 1 of a lookup matches given that tokens 1..j did,
    after a lookup whose first token matched (hit) or did not. Every round scores the lookup for
    free against what the target committed (as deep as the round committed: a deeper token's rate
    is only learnt when it is seen)."""

    PRIOR = {False: (0.3, 0.7), True: (0.7, 0.8)}  # (first token, each later one given the earlier)

    def __init__(self, start: Runs | None = None, forget: float = 0.9):
        def rate(hit: bool, j: int) -> Rate:
            return Rate(start.rates[hit][j].value if start else self.PRIOR[hit][min(j, 1)], forget=forget)
        self.rates = {hit: [rate(hit, j) for j in range(LOOKUP_TOKENS)] for hit in (False, True)}

    def expected(self, hit: bool, k: int) -> float:
        """Tokens accepted of a K-token lookup."""
        tokens, p = 0.0, 1.0
        for rate in self.rates[hit][:k]:
            p *= rate.value
            tokens += p
        return tokens

    def add(self, hit: bool, matched: int, seen: int) -> None:
        """A lookup after `hit` matched its first `matched` tokens of the `seen` the round committed."""
        for j, rate in enumerate(self.rates[hit][:min(seen, matched + 1)]):
            rate.add(int(j < matched), 1)
