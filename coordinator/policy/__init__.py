"""The speculation policy: per session and per round, which draft method and how many draft tokens
(K), for every request that does not fix them.

    acceptance.py  how many draft tokens the target accepts: E(alpha, K), and the suffix lookup's runs
    costs.py       what a round costs: the target's passes and the draft's tokens, measured at load
    gate.py        which methods may be used under load at all, measured by an online A/B test
    chooser.py     one session's choice each round: the most expected tokens per millisecond
"""

from coordinator.policy.acceptance import expected_tokens
from coordinator.policy.chooser import Choice, SpeculationPolicy
from coordinator.policy.costs import FIXED, Costs, Prior, PriorCosts
from coordinator.policy.gate import MethodGate

__all__ = ["FIXED", "Choice", "Costs", "MethodGate", "Prior", "PriorCosts", "SpeculationPolicy", "expected_tokens"]
