"""Each round's draft method and K, and the round itself: the request's fixed choice, or the
speculation policy's round by round (`coordinator/policy/`).

A head round (the target worker's EAGLE-3 head) is one Verify call: its draft is the proposal the
head made with the verdict before it (`HeadProposals`), and it asks the head for the next one. A
round whose verdict brought none (the first of a request, or after another method) is plain."""

from __future__ import annotations

from coordinator.loop import NO_DECODE, NO_DRAFT, Bet, Decode, Draft, Proposer, Round, Speculator, Verdict
from coordinator.policy import SpeculationPolicy
from coordinator.policy.chooser import Lookup
from coordinator.request import DraftMethod, GenerationRequest, RequestContext

HEAD_K = 4  # head tokens a round asks for when its own K says nothing (a plain round warming the head up)


class HeadProposals:
    """A request's head proposals: the one the last verdict brought, made after the committed tokens
    of that round (a `Bet` on them, which the next round's committed tokens are)."""

    def __init__(self):
        self._bet: Bet | None = None

    def keep(self, committed_ids: list[int], verdict: Verdict | None) -> None:
        head = verdict.head if verdict is not None else None
        self._bet = Bet.made_after(committed_ids, head) if head else None

    def propose(self, ctx: RequestContext, committed_ids: list[int], num_tokens: int) -> Draft:
        block = self._bet.block_after(committed_ids) if self._bet is not None else None
        return NO_DRAFT if block is None else block.first(num_tokens)


def fixed_choice(req: GenerationRequest, default_k: int, has_model: bool) -> tuple[DraftMethod, int]:
    """The method and K of a request that fixes them (without the draft model, K = 0)."""
    k = default_k if req.num_speculative_tokens is None else req.num_speculative_tokens
    if req.method is DraftMethod.NONE or k == 0:
        return DraftMethod.NONE, 0
    if req.method in (DraftMethod.SUFFIX, DraftMethod.HEAD):
        return req.method, k
    return DraftMethod.MODEL, k if has_model else 0


class Drafting:
    """Chooses a round's method and K, asks the target for plain decoding steps after rounds whose
    next block is not drafting meanwhile, runs the round, and lets the policy learn from it."""

    def __init__(self, speculator: Speculator, proposers: dict[DraftMethod, Proposer | None],
                 policy: SpeculationPolicy | None, fixed: tuple[DraftMethod, int], decode_steps: int,
                 stop_ids: frozenset[int], lookup: Lookup):
        self.speculator = speculator
        self.proposers = proposers
        self.lookup = lookup  # what a suffix round would propose
        self.policy = policy  # None: every round drafts `fixed`
        self.fixed = fixed
        self.decode_steps = decode_steps
        self.stop_ids = stop_ids

    def round(self, committed_ids: list[int], room: int, first: bool) -> Round:
        """One round of at most `room` draft tokens; `first`: the request's first (it prefills, and
        takes no plain decoding steps: its first token would wait)."""
        method, k, steps = self._choose(committed_ids, room, first)
        steps = 0 if first else min(steps, room - k)
        # the next round's proposal (this round commits at least one token: it can use room - 1)
        head = max(0, min(k or HEAD_K, room - 1)) if method is DraftMethod.HEAD else 0
        decode = Decode(0, self.stop_ids, head) if head else Decode(steps, self.stop_ids) if steps > 0 else NO_DECODE
        rnd = self.speculator.round(committed_ids, k, self.proposers.get(method), decode)
        heads = self.proposers.get(DraftMethod.HEAD)
        if isinstance(heads, HeadProposals):
            heads.keep(committed_ids + rnd.new_ids, rnd.verdict)
        if self.policy is not None:
            self.policy.observe(rnd)
        return rnd

    def _choose(self, committed_ids: list[int], room: int, first: bool) -> tuple[DraftMethod, int, int]:
        """(method, K, plain decoding steps after the verdict). A fixed choice takes steps after plain
        rounds only (a model round's next block is drafting, a suffix round's next lookup may draft
        again); the policy plans them with its choice; a stand-in for the draft model takes none (the
        draft's warm-up may end within a step)."""
        if self.policy is None:
            method, k = self.fixed[0], max(0, min(self.fixed[1], room))
            if method is DraftMethod.SUFFIX and not self.lookup(committed_ids, k):
                return DraftMethod.NONE, 0, self.decode_steps  # nothing to propose: a plain round
            return method, k, self.decode_steps if k == 0 else 0
        # not the draft model in a request's first round: that round prefills, and a warm-up started
        # with it would keep the target to its share of the cores for the prefill of every session in
        # its batch; on long prompts the draft prefills for longer than the target anyway
        ready = not first and not self.speculator.warming_up
        choice = self.policy.choose(committed_ids, room, model_ready=ready)
        if choice.method is not DraftMethod.MODEL and not choice.stand_in:
            self.speculator.drop_warm_up()
        return choice.method, choice.k, 0 if choice.stand_in else choice.steps
