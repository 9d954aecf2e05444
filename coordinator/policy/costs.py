"""The workers' costs, as this coordinator measures them at the current load (milliseconds):

- V(t): the target's forward pass over t tokens (all sessions together), a line fitted to what the
  target reports about every pass, one line per thread count: with --solo-threads the target uses
  more cores while no draft worker drafts (V_solo) than while one does (V_shared).
- D(s): the draft worker's milliseconds per proposed token with s sessions in its batch, a power
  law fitted the same way in log space (a prior of linear growth, as on a CPU; data from several
  batch sizes decide the exponent, near 0 on a GPU).
- o_v, o_d: what a call costs beyond the model (RPC, queueing), measured.
- n: sessions per target pass (smoothed), or the requests running in this coordinator now if more
  (a burst is known before its passes are measured).

`Costs` also holds what every session here shares: the method gate, and the acceptance a new
session starts from. `PriorCosts` (`FIXED`) answers the same questions from the prior alone, at
n = 1, whatever is observed: for sampled requests, whose choices must depend on nothing that timing
or other sessions change.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from coordinator.policy.acceptance import OPTIMISTIC_ALPHA, Rate, Runs
from coordinator.policy.gate import GATED, MethodGate
from coordinator.request import DraftMethod

if TYPE_CHECKING:
    from coordinator.loop import Round

# A pass or draft batch that prefilled more than this per session says little of a round's cost.
PREFILL_PER_SESSION = 2


class Line:
    """y = a + b x by least squares over exponentially forgotten observations, with the slope pulled
    towards a prior slope (which decides it while every x seen is the same); the prior line until
    something is seen."""

    def __init__(self, a: float, b: float, slope_weight: float = 1.0, forget: float = 0.97):
        self.a, self.b, self.slope_weight, self.forget = a, b, slope_weight, forget
        self._sums = [0.0] * 5  # sum of w, wx, wxx, wy, wxy over observations
        self.count = 0

    def observe(self, x: float, y: float) -> None:
        s = [v * self.forget for v in self._sums]
        self._sums = [s[0] + 1, s[1] + x, s[2] + x * x, s[3] + y, s[4] + x * y]
        self.count += 1

    def fit(self) -> tuple[float, float]:
        """(a, b): the prior's until something is seen."""
        w, wx, wxx, wy, wxy = self._sums
        if not self.count:
            return self.a, self.b
        # minimise sum w (a + b x - y)^2 + slope_weight (b - b0)^2, with a = (wy - b wx) / w
        slope = (wxy - wx * wy / w + self.slope_weight * self.b) / (wxx - wx * wx / w + self.slope_weight)
        return (wy - slope * wx) / w, slope

    def __call__(self, x: float) -> float:
        a, b = self.fit()
        b = max(0.0, b)  # a cost never falls with more work
        return max(0.01, a + b * x) if self.count else a + b * x


class PowerLaw(Line):
    """y = a x^b, a Line through (log x, log y): a cost that grows with the sessions of a batch,
    linearly (b = 1) where compute bounds it, hardly at all (b near 0) where memory does."""

    def observe(self, x: float, y: float) -> None:
        super().observe(math.log(x), math.log(max(y, 1e-3)))

    def __call__(self, x: float) -> float:
        if not self.count:
            return self.a * x ** self.b
        log_a, b = self.fit()
        return math.exp(log_a + b * math.log(x))


@dataclass(frozen=True)
class Prior:
    """Costs before anything is measured, and always for sampled requests (milliseconds)."""

    verify_ms: float = 20.0  # per pass
    verify_ms_per_token: float = 1.5
    draft_ms_per_token: float = 4.0  # one session
    draft_growth: float = 1.0  # per token with s sessions: draft_ms_per_token * s^draft_growth (CPU: linear)
    verify_overhead_ms: float = 3.0
    draft_overhead_ms: float = 2.0
    # A draft token's cost against a one-token target pass, from the two models' sizes; where known it
    # replaces draft_ms_per_token: until the draft is measured, its token costs this share of what the
    # target's pass costs (measured or not), so a draft as large as its target is never expected to pay.
    draft_cost_ratio: float | None = None
    head_ms_per_token: float = 0.5  # the target worker's head, per draft token (a layer's pass and its sampling)

    @classmethod
    def for_models(cls, target_parameters: int, draft_parameters: int) -> Prior:
        """The prior for a draft and a target of these sizes (0: unknown, the default prior)."""
        if target_parameters <= 0 or draft_parameters <= 0:
            return cls()
        return cls(draft_cost_ratio=draft_parameters / target_parameters)


class Costs:
    """The workers' costs as this coordinator measures them, shared by all its sessions."""

    learns: ClassVar[bool] = True

    def __init__(self, prior: Prior = Prior(), smoothing: float = 0.1):
        self.prior, self.smoothing = prior, smoothing
        self._verify: dict[int, Line] = {}  # threads -> V
        self._unmeasured = Line(prior.verify_ms, prior.verify_ms_per_token)  # V before any pass is seen
        self._draft = PowerLaw(prior.draft_ms_per_token, prior.draft_growth)
        self.verify_overhead_ms = prior.verify_overhead_ms
        self.draft_overhead_ms = prior.draft_overhead_ms
        self.batch = 1.0
        self.active = 0  # requests running now (the coordinator keeps it)
        self.gate = MethodGate(modes=GATED)
        # acceptance over every session here: where a new session starts from
        # the draft model's and the target's head's (the methods whose acceptance is learnt as they draft)
        self.acceptance = {m: Rate(OPTIMISTIC_ALPHA, forget=0.98) for m in (DraftMethod.MODEL, DraftMethod.HEAD)}
        self.head_ms_per_token = prior.head_ms_per_token
        self.runs = Runs(forget=0.98)
        self._lock = threading.Lock()

    def observe(self, rnd: Round) -> None:
        v, d, s = rnd.verdict, rnd.draft, self.smoothing
        with self._lock:
            if v is not None and 0 < v.batch_tokens and v.batch_prefill_tokens <= PREFILL_PER_SESSION * v.batch_size:
                # a pass's mean cost at its mean tokens (the line is linear, so the mean of the costs is
                # the cost of the mean): the verdict's pass alone would charge a suffix block's
                # tokens to the plain decoding steps after it, and underrate what a token costs
                tokens = v.pass_tokens / v.passes if v.pass_tokens else v.batch_tokens
                self._line(v.threads).observe(tokens, v.compute_ms / v.passes)
                self.verify_overhead_ms += s * (max(0.0, rnd.verify_ms - v.compute_ms) - self.verify_overhead_ms)
                self.batch += s * (v.batch_size - self.batch)
            if v is not None and v.head is not None:
                self.head_ms_per_token += s * (v.head_ms / len(v.head.token_ids) - self.head_ms_per_token)
            if (d.from_worker and d.batch_size > 0 and rnd.num_drafted > 0
                    and d.batch_prefill_tokens <= PREFILL_PER_SESSION * d.batch_size):
                self._draft.observe(d.batch_size, d.compute_ms / max(d.proposed, rnd.num_drafted))
                if rnd.draft_ms > d.compute_ms:  # a proposal waited for (not a bet that was ready)
                    self.draft_overhead_ms += s * (rnd.draft_ms - d.compute_ms - self.draft_overhead_ms)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Count a request as running while it is inside."""
        with self._lock:
            self.active += 1
        try:
            yield
        finally:
            with self._lock:
                self.active -= 1

    @property
    def load(self) -> float:
        """Sessions per pass to plan for."""
        return max(self.batch, self.active)

    def observe_acceptance(self, successes: int, trials: int, method: DraftMethod = DraftMethod.MODEL) -> None:
        if trials:
            with self._lock:
                self.acceptance[method].add(successes, trials)

    def observe_lookup(self, hit: bool, matched: int, seen: int) -> None:
        with self._lock:
            self.runs.add(hit, matched, seen)

    def prior_acceptance(self, method: DraftMethod = DraftMethod.MODEL) -> float:
        with self._lock:
            return self.acceptance[method].value

    def head_ms(self, k: int) -> float:
        """What the head's proposal of k tokens adds to a call."""
        return k * self.head_ms_per_token

    def prior_runs(self) -> Runs:
        with self._lock:
            return Runs(self.runs)

    def _line(self, threads: int) -> Line:
        if threads not in self._verify:
            self._verify[threads] = Line(self.prior.verify_ms, self.prior.verify_ms_per_token)
        return self._verify[threads]

    def verify_ms(self, tokens: float, solo: bool, passes: int = 1) -> float:
        """A call of `passes` passes over `tokens` tokens each: on the most threads the target has used
        (`solo`, while no draft worker is busy) or the fewest, with the call's overhead."""
        with self._lock:
            seen = sorted(t for t, line in self._verify.items() if line.count)
            line = self._verify[seen[-1] if solo else seen[0]] if seen else self._unmeasured
            return passes * line(tokens) + self.verify_overhead_ms

    def draft_ms(self, k: int, sessions: float) -> float:
        with self._lock:
            if self._draft.count or self.prior.draft_cost_ratio is None:
                return k * self._draft(sessions) + self.draft_overhead_ms
        per_token = self.prior.draft_cost_ratio * (self.verify_ms(1, solo=True) - self.verify_overhead_ms)
        return k * per_token * sessions ** self.prior.draft_growth + self.draft_overhead_ms


@dataclass(frozen=True)
class PriorCosts:
    """What a `Costs` predicts before it has seen anything, forever: one session per pass, the
    prior's lines, the prior acceptance. Nothing it is told changes it."""

    prior: Prior = Prior()
    learns: ClassVar[bool] = False
    batch: ClassVar[float] = 1.0
    load: ClassVar[float] = 1.0  # sessions per pass to plan for
    active: ClassVar[int] = 0

    @property
    def verify_overhead_ms(self) -> float:
        return self.prior.verify_overhead_ms

    @property
    def draft_overhead_ms(self) -> float:
        return self.prior.draft_overhead_ms

    def observe(self, rnd: Round) -> None:
        pass

    def observe_acceptance(self, successes: int, trials: int, method: DraftMethod = DraftMethod.MODEL) -> None:
        pass

    def observe_lookup(self, hit: bool, matched: int, seen: int) -> None:
        pass

    def prior_acceptance(self, method: DraftMethod = DraftMethod.MODEL) -> float:
        return OPTIMISTIC_ALPHA

    def head_ms(self, k: int) -> float:
        return k * self.prior.head_ms_per_token

    def prior_runs(self) -> Runs:
        return Runs()

    def verify_ms(self, tokens: float, solo: bool, passes: int = 1) -> float:
        """The prior line, as `Line` evaluates it before any observation (one line for any threads)."""
        p = self.prior
        return passes * (p.verify_ms + max(0.0, p.verify_ms_per_token) * tokens) + p.verify_overhead_ms

    def draft_ms(self, k: int, sessions: float) -> float:
        """The prior power law, as `Costs` evaluates it before any observation."""
        p = self.prior
        per_token = p.draft_ms_per_token
        if p.draft_cost_ratio is not None:
            per_token = p.draft_cost_ratio * (p.verify_ms + p.verify_ms_per_token)
        return k * (per_token * sessions ** p.draft_growth) + p.draft_overhead_ms


FIXED = PriorCosts()  # for sampled requests: the same every time (Generation's own, from the models' sizes)
