"""Each round's draft method and K, and the round itself: the request's fixed choice, or the
speculation policy's round by round (`coordinator/policy/`)."""

from __future__ import annotations

from coordinator.loop import NO_DECODE, Decode, Proposer, Round, Speculator
from coordinator.policy import SpeculationPolicy
from coordinator.policy.chooser import Lookup
from coordinator.request import DraftMethod, GenerationRequest


def fixed_choice(req: GenerationRequest, default_k: int, has_model: bool) -> tuple[DraftMethod, int]:
    """The method and K of a request that fixes them (without the draft model, K = 0)."""
    k = default_k if req.num_speculative_tokens is None else req.num_speculative_tokens
    if req.method is DraftMethod.NONE or k == 0:
        return DraftMethod.NONE, 0
    if req.method is DraftMethod.SUFFIX:
        return DraftMethod.SUFFIX, k
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
        """One round of at most `room` draft tokens; `first`: the request's first (it prefills)."""
        method, k, stand_in = self._choose(committed_ids, room, first)
        # multi-step plain decoding after a plain round (not after a drafted one: a model round's next
        # block is drafting, and a suffix round's next lookup may draft again), but not in a request's
        # first round (its first token would wait) nor in a stand-in's (the draft's warm-up may end
        # within a step)
        steps = min(self.decode_steps, room) if k == 0 and not first and not stand_in else 0
        decode = Decode(steps, self.stop_ids) if steps > 0 else NO_DECODE
        rnd = self.speculator.round(committed_ids, k, self.proposers.get(method), decode)
        if self.policy is not None:
            self.policy.observe(rnd)
        return rnd

    def _choose(self, committed_ids: list[int], room: int, first: bool) -> tuple[DraftMethod, int, bool]:
        """(method, K, whether another method stands in for the draft model while it warms up)."""
        if self.policy is None:
            method, k = self.fixed[0], max(0, min(self.fixed[1], room))
            if method is DraftMethod.SUFFIX and not self.lookup(committed_ids, k):
                return DraftMethod.NONE, 0, False  # nothing to propose: a plain round, with its steps
            return method, k, False
        # not the draft model in a request's first round: that round prefills, and a warm-up started
        # with it would keep the target to its share of the cores for the prefill of every session in
        # its batch; on long prompts the draft prefills for longer than the target anyway
        ready = not first and not self.speculator.warming_up
        choice = self.policy.choose(committed_ids, room, model_ready=ready)
        if choice.method is not DraftMethod.MODEL and not choice.stand_in:
            self.speculator.drop_warm_up()
        return choice.method, choice.k, choice.stand_in
