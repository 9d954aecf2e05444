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
        """One round of at most `room` draft tokens; `first`: the request's first (it prefills, and
        takes no plain decoding steps: its first token would wait)."""
        method, k, steps = self._choose(committed_ids, room, first)
        steps = 0 if first else min(steps, room - k)
        decode = Decode(steps, self.stop_ids) if steps > 0 else NO_DECODE
        rnd = self.speculator.round(committed_ids, k, self.proposers.get(method), decode)
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
