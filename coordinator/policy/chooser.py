"""One session's choice, round by round, of the draft method and K: the one with the most expected
tokens per millisecond of the round's predicted wall time (Leviathan et al., arXiv 2211.17192,
section 3.4, with the costs of `costs.py` at the current load n):

    none     (s + 1) V_solo(n) + o_v, serving s + 1 tokens: s plain decoding steps follow the verdict
             in the same call (multi-step decoding, the coordinator's --decode-steps)
    suffix   V_solo(n + K) + o_v, serving n - 1 + E tokens: this session's block joins a pass of n;
             beside other sessions (n > 1) s plain steps follow, as after a plain round, which keeps
             its calls in step with theirs; alone, none do: the next round looks up again
    model    V(n (K + 1)) + o_v + D(n) K + o_d
             with overlap, when the bet wins (probability alpha^(K+1)): the larger of the two parts,
             and V_shared (the next block drafts during the pass), else V_solo; a switch to the
             model from another method has no bet to find
    head     V_solo(n (K + 1)) + o_v + H n K: one call, the target worker's head drafting the next
             block after the verdict (H: its ms per token, measured), as if every session drafted
             with it; a switch to the head from another method has no proposal to find (that round
             is plain)

E is the expected tokens of `acceptance.py`: E(alpha, K) for the model and the head (each its own
alpha), the runs for suffix decoding. The
model draft is weighed as if every session at this load drafted alike: the draft worker is shared,
and one session's drafting slows everyone. K = 0 needs no acceptance: its cost is V_solo, which every
plain pass measures (a call of several passes reports their mean).

Acceptance is per session and per method, starting from what this coordinator's sessions have seen
lately. Suffix decoding's is scored on every round for free: its lookup for the committed tokens is compared
with what the target commits. The model draft's and the head's are learnt when they draft; while something else
wins, each is retried for one round every PROBE_EVERY, and only if an optimistic acceptance would make
it the best choice at the current costs.

With two or more requests running, the costs' gate says whether the draft model may be used at all.
A sampled request uses FIXED costs, no gate, and its own acceptance, which are functions of its tokens
and seed alone: which positions were drafted decides which keyed draws make a sampled token, so its
choices must not depend on timing or on other sessions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from coordinator.policy.acceptance import LOOKUP_TOKENS, OPTIMISTIC_ALPHA, Rate, expected_tokens
from coordinator.policy.costs import Costs, PriorCosts
from coordinator.policy.gate import ALL
from coordinator.request import DraftMethod
from coordinator.suffix import SuffixProposer

if TYPE_CHECKING:
    from coordinator.loop import Round

log = logging.getLogger(__name__)

MODEL_KS = range(1, 9)
HEAD_KS = range(1, 9)
SUFFIX_KS = range(1, LOOKUP_TOKENS + 1)
PROBE_EVERY = 16
SWITCH_MARGIN = 0.03  # keep the current method unless another is this much better (a switch drops a bet)


Lookup = Callable[[list[int], int], list[int]]  # (committed ids, at most n) -> a suffix proposal


@dataclass(frozen=True)
class Choice:
    method: DraftMethod
    k: int
    gain: float = 0.0  # expected tokens per millisecond
    stand_in: bool = False  # the draft model's turn, taken by another method while the draft warms up
    steps: int = 0  # plain decoding steps the target takes after the round's verdict, in the same call


def _rank(choice: Choice) -> tuple[float, int]:
    """The most tokens per ms, then the shorter block."""
    return choice.gain, -choice.k


class SpeculationPolicy:
    """One session's choices. `methods`: what it may draft with (K = 0 is always a candidate)."""

    def __init__(self, costs: Costs | PriorCosts, methods: frozenset[DraftMethod], overlap: bool,
                 max_k: int | None = None, lookup: Lookup | None = None, decode_steps: int = 0):
        self.costs, self.methods, self.overlap, self.max_k = costs, methods, overlap, max_k
        self.decode_steps = decode_steps  # plain steps a round without a draft takes after its verdict
        self.lookup = lookup or SuffixProposer().continuation  # what a suffix round would propose
        self.alpha = Rate(costs.prior_acceptance())  # the draft model's acceptance
        self.head_alpha = Rate(costs.prior_acceptance(DraftMethod.HEAD))  # the head's
        self.runs = costs.prior_runs()  # suffix decoding's
        self._hit = False  # the last lookup's first token was accepted
        self._lookup: list[int] = []
        self._since_model = 0
        self._since_head = 0
        self._head_probe = False  # the last round was a probe of the head: this one verifies its proposal
        self._method = DraftMethod.NONE
        self._last_round: float | None = None  # when the previous round was observed (the gate's clock)

    def choose(self, committed_ids: list[int], max_k: int, model_ready: bool = True) -> Choice:
        """This round's method and K, at most max_k (and the policy's own ceiling). Where the draft
        model cannot serve the round (`model_ready` false: while it prefills the session's context,
        its warm-up when the policy first turns to it), a round it wins goes to the best of the other
        methods instead (a stand-in), and the model keeps its turn: the round would otherwise be plain
        decoding, one token a pass, for as long as the draft prefills, where suffix copying from the
        prompt serves more."""
        steps = min(self.decode_steps, max(0, max_k))  # what the coordinator asks a plain round for
        max_k = max_k if self.max_k is None else min(max_k, self.max_k)
        self._lookup = self.lookup(committed_ids, LOOKUP_TOKENS) if DraftMethod.SUFFIX in self.methods else []
        plain = self.costs.verify_ms(self.costs.load, solo=True, passes=steps + 1)
        options = [Choice(DraftMethod.NONE, 0, (steps + 1) / plain, steps=steps)]
        if max_k <= 0:
            return options[0]
        allowed = self.methods & (self.costs.gate.allowed(self.costs.active) if self.costs.learns else ALL)
        allowed |= self.methods & {DraftMethod.HEAD}  # the head costs no draft worker: no gate
        options += self._drafting(allowed, max_k)
        best = self._keep_or_switch(options)
        if DraftMethod.MODEL in allowed and best.method != DraftMethod.MODEL:
            best = self._probe(best, max_k)
        probing, self._head_probe = self._head_probe, False
        if probing and DraftMethod.HEAD in allowed:  # a probe's second round: the proposal it asked for
            best = self._hope_head(max_k)
        elif DraftMethod.HEAD in allowed and best.method not in (DraftMethod.HEAD, DraftMethod.MODEL):
            best = self._probe_head(best, max_k)
        if best.method == DraftMethod.MODEL:
            self._since_model = 0
            if not model_ready:
                self._method = DraftMethod.MODEL
                stand_in = max((c for c in options if c.method != DraftMethod.MODEL), key=_rank)
                return replace(stand_in, stand_in=True)
        if log.isEnabledFor(logging.DEBUG):
            self._log(best, options[0])
        self._method = best.method
        return best

    def observe(self, rnd: Round) -> None:
        """Learn from the round just verified: the costs (shared), each method's acceptance."""
        self.costs.observe(rnd)
        if self.costs.learns:
            self._time(rnd)
        if rnd.num_drafted and (rnd.draft.from_worker or rnd.draft.from_head):
            successes, trials = rnd.num_accepted, min(rnd.num_drafted, rnd.num_accepted + 1)
            (self.head_alpha if rnd.draft.from_head else self.alpha).add(successes, trials)
            self.costs.observe_acceptance(successes, trials, DraftMethod.HEAD if rnd.draft.from_head else DraftMethod.MODEL)
        if self._lookup:  # scored for free, whatever the round drafted
            seen = min(len(self._lookup), len(rnd.new_ids))
            matched = next((i for i in range(seen) if self._lookup[i] != rnd.new_ids[i]), seen)
            self.runs.add(self._hit, matched, seen)
            self.costs.observe_lookup(self._hit, matched, seen)
        self._hit = bool(self._lookup) and rnd.new_ids[:1] == self._lookup[:1]

    def _time(self, rnd: Round) -> None:
        """Tell the gate the round's tokens and the session's time for it: the time since its previous
        round, when longer than the round's own parts (what the session waited between its rounds is
        time the mode cost it too: under load, the coordinator's turn, the draft worker's queue)."""
        now = self.costs.gate.clock()
        if self._last_round is not None:  # not the first round: it prefilled
            since = (now - self._last_round) * 1e3
            self.costs.gate.observe(self.costs.active, len(rnd.new_ids), max(rnd.draft_ms + rnd.verify_ms, since))
        self._last_round = now

    def _drafting(self, allowed: frozenset[DraftMethod], max_k: int) -> list[Choice]:
        """Every allowed method's candidates, K by K."""
        options = []
        if self._lookup and DraftMethod.SUFFIX in allowed:
            options += [self._suffix(k, max_k) for k in SUFFIX_KS if k <= min(max_k, len(self._lookup))]
        if DraftMethod.MODEL in allowed:
            alpha = self.alpha.value
            options += [self._model(k, alpha) for k in MODEL_KS if k <= max_k]
        if DraftMethod.HEAD in allowed:
            alpha = self.head_alpha.value
            options += [self._head(k, alpha) for k in HEAD_KS if k <= max_k]
        return options

    def _keep_or_switch(self, options: list[Choice]) -> Choice:
        """The best option, or the current method's best within SWITCH_MARGIN of it."""
        best = max(options, key=_rank)
        current = max((c for c in options if c.method == self._method), key=lambda c: c.gain, default=None)
        if current is not None and current.gain >= best.gain * (1 - SWITCH_MARGIN):
            return current
        return best

    def _probe(self, best: Choice, max_k: int) -> Choice:
        """Every PROBE_EVERY rounds the model loses, one model round if OPTIMISTIC_ALPHA would win."""
        self._since_model += 1
        if self._since_model < PROBE_EVERY:
            return best
        self._since_model = 0
        hope = max((self._model(k, OPTIMISTIC_ALPHA) for k in MODEL_KS if k <= max_k), key=lambda c: c.gain)
        return hope if hope.gain > best.gain else best

    def _probe_head(self, best: Choice, max_k: int) -> Choice:
        """Every PROBE_EVERY rounds the head loses, one head round (it asks for a proposal; the round
        after it verifies it) if OPTIMISTIC_ALPHA would win."""
        self._since_head += 1
        if self._since_head < PROBE_EVERY:
            return best
        self._since_head = 0
        hope = self._hope_head(max_k)
        if hope.gain <= best.gain:
            return best
        self._head_probe = True
        return hope

    def _hope_head(self, max_k: int) -> Choice:
        return max((self._head(k, OPTIMISTIC_ALPHA) for k in HEAD_KS if k <= max_k), key=lambda c: c.gain)

    def _head(self, k: int, alpha: float) -> Choice:
        """One call: the block verified in a pass of n sessions' blocks, then the head's next proposal
        (k steps, for each session of the pass)."""
        n = self.costs.load
        ms = self.costs.verify_ms(n * (k + 1), solo=True) + self.costs.head_ms(k) * n
        return Choice(DraftMethod.HEAD, k, expected_tokens(alpha, k) / ms)

    def _suffix(self, k: int, max_k: int) -> Choice:
        """This session's K tokens join a pass of n sessions: what the call serves per session, the
        (n - 1) others' tokens (one per pass) plus this one's, over the passes all of them wait for,
        the first longer by K tokens (the lookup matched now, which the others' may not have: a
        symmetric guess would overrate it). Beside other sessions its plain decoding steps follow, as
        after a plain round, so that its calls keep in step with theirs; alone, none do: the next
        round looks up again, and where the text goes on repeating, drafts again."""
        n = self.costs.load
        steps = min(self.decode_steps, max_k - k) if n > 1 else 0
        tokens = n * (steps + 1) + self.runs.expected(self._hit, k)
        first = self.costs.verify_ms(n + k, solo=True)  # one call: its overhead once
        ms = first + self.costs.verify_ms(n, solo=True, passes=steps) - self.costs.verify_overhead_ms
        return Choice(DraftMethod.SUFFIX, k, tokens / (n * ms), steps=steps)

    def _model(self, k: int, alpha: float) -> Choice:
        """With overlap, a round after a model round finds its block drafted during the last pass when
        that pass's bet won; a round after another method's has none to find (it drafts, then
        verifies), and is valued so."""
        n = self.costs.load
        verify = self.costs.verify_ms(n * (k + 1), solo=not self.overlap)  # with overlap a bet drafts meanwhile
        draft = self.costs.draft_ms(k, n)
        ms = verify + draft
        if self.overlap and self._method == DraftMethod.MODEL:
            wins = alpha ** (k + 1)
            ms = wins * max(verify, draft) + (1 - wins) * ms
        return Choice(DraftMethod.MODEL, k, expected_tokens(alpha, k) / ms)

    def _log(self, best: Choice, plain: Choice) -> None:
        n = self.costs.load
        log.debug("policy: %s K=%d at n=%.1f: %.4f tok/ms (none %.4f); alpha model %.2f; suffix %.2f of %d; "
                  "V solo %.1f shared %.1f ms, D %.1f ms/token", best.method.value, best.k, n, best.gain,
                  plain.gain, self.alpha.value, self.runs.expected(self._hit, LOOKUP_TOKENS), LOOKUP_TOKENS,
                  self.costs.verify_ms(n, solo=True), self.costs.verify_ms(n * (best.k + 1), solo=False),
                  self.costs.draft_ms(1, n) - self.costs.draft_overhead_ms)
