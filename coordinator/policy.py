"""The speculation policy: per session and per round, which draft method and how many draft tokens
(K), for every request that does not fix them (Leviathan et al., arXiv 2211.17192, section 3.4,
with each round's cost predicted from costs measured at the current load).

A block of K tokens from a method whose tokens the target accepts with probability alpha yields
E(alpha, K) = (1 - alpha^(K+1)) / (1 - alpha) tokens per round. The policy picks the method and K
with the most expected tokens per millisecond of the round's predicted wall time:

    none     (s + 1) V_solo(n) + o_v, serving s + 1 tokens: s plain decoding steps follow the verdict
             in the same call (multi-step decoding, the coordinator's --decode-steps)
    n-gram   V_solo(n + K) + o_v, serving n - 1 + E tokens: this session's block joins a pass of n
    model    V(n (K + 1)) + o_v + D(n) K + o_d
             with overlap, when the bet wins (probability alpha^(K+1)): the larger of the two parts,
             and V_shared (the next block drafts during the pass), else V_solo; a switch to the
             model from another method has no bet to find

- V(t): the target's forward pass over t tokens (all sessions together), a line fitted to what the
  target reports about every pass, one line per thread count: with --solo-threads the target uses
  more cores while no draft worker drafts (V_solo) than while one does (V_shared).
- D(s): the draft worker's milliseconds per proposed token with s sessions in its batch, a power
  law fitted the same way in log space (a prior of linear growth, as on a CPU; data from several
  batch sizes decide the exponent, near 0 on a GPU).
- o_v, o_d: what a call costs beyond the model (RPC, queueing), measured.
- n: sessions per target pass (smoothed), or the requests running in this coordinator now if more
  (a burst is known before its passes are measured). The model draft is weighed as if every session
  at this load drafted alike: the draft worker is shared, and one session's drafting slows everyone.

Under load the parts stop adding up: sessions fall out of step and wait in each other's batches,
and a model round at c8 here took up to 3x its predicted time. So whether the draft model may be
used at all, with two or more requests running, is measured rather than predicted: the MethodGate
below. n-gram rounds cost the target a few more tokens in a pass and nothing else, and are chosen
by the cost model at every load, round by round, with their acceptance valued in runs (Runs): a
copied passage accepts everything, free text nothing, where Leviathan's formula assumes independent
tokens. An earlier policy valued n-gram by one mean rate and let the gate measure plain decoding
against n-gram in epochs of a second or more: on input-grounded prompts, whose copying comes and
goes within seconds, the gate kept plain decoding and the policy served 0.70x n-gram K=10 at 4
requests.

Acceptance is per session and per method, starting from what this coordinator's sessions have seen
lately (a new request does not relearn that the draft loses here). n-gram's is scored on every round
for free: its lookup for the committed tokens is compared with what the target commits, and kept
by position in the lookup and by whether the last lookup's first token was accepted. The model
draft's is learnt when it drafts; while something else wins, it is retried for one round every
PROBE_EVERY, and only if an optimistic acceptance would make it the best choice at the current costs.

K = 0 needs no acceptance: its cost is V_solo, which every plain pass measures (a call of several
passes reports their mean).

Seeded sampling stays reproducible: which positions were drafted decides which keyed draws make a
sampled token, so a sampled request's choices must depend on nothing that timing or other sessions
change. It uses the fixed prior costs at n = 1, no gate, and its own acceptance, which are functions
of its tokens and seed alone.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from coordinator.loop import Round
from coordinator.ngram import NgramProposer

log = logging.getLogger(__name__)

MODEL = "model"
NGRAM = "ngram"
NONE = "none"
MODEL_KS = range(1, 9)
NGRAM_KS = range(1, 11)
PROBE_EVERY = 16
OPTIMISTIC_ALPHA = 0.7  # the model's prior acceptance, and what a retry hopes for
SWITCH_MARGIN = 0.03  # keep the current method unless another is this much better (a switch drops a bet)
# A pass or draft batch that prefilled more than this per session says little of a round's cost.
PREFILL_PER_SESSION = 2


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens committed per round for a block of K drafts accepted with probability alpha each."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


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
    """n-gram acceptance by position in the lookup, and by whether the session's last lookup had its
    first token accepted. A lookup either copies a passage (every token of it matches, and so does
    the next lookup's) or guesses in free text (none does): acceptance comes in runs, where
    Leviathan's formula assumes independent tokens. On the input-grounded set one mean rate of 0.34
    made a lookup worth 0.5 tokens, while lookups right after one that matched were accepted 6
    tokens deep; so the policy chose plain rounds at 4 requests and served 0.70x n-gram K=10.

    rates[hit][j]: the probability that token j + 1 of a lookup matches given that tokens 1..j did,
    after a lookup whose first token matched (hit) or did not. Every round scores the lookup for
    free against what the target committed (as deep as the round committed: a deeper token's rate
    is only learnt when it is seen)."""

    PRIOR = {False: (0.3, 0.7), True: (0.7, 0.8)}  # (first token, each later one given the earlier)

    def __init__(self, start: Runs | None = None, forget: float = 0.9):
        def rate(hit: bool, j: int) -> Rate:
            return Rate(start.rates[hit][j].value if start else self.PRIOR[hit][min(j, 1)], forget=forget)
        self.rates = {hit: [rate(hit, j) for j in range(max(NGRAM_KS))] for hit in (False, True)}

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


@dataclass(frozen=True)
class Prior:
    """Costs before anything is measured, and always for sampled requests (milliseconds)."""

    verify_ms: float = 20.0  # per pass
    verify_ms_per_token: float = 1.5
    draft_ms_per_token: float = 4.0  # one session
    draft_growth: float = 1.0  # per token with s sessions: draft_ms_per_token * s^draft_growth (CPU: linear)
    verify_overhead_ms: float = 3.0
    draft_overhead_ms: float = 2.0


PLAIN, NGRAM_ONLY, ALL = frozenset(), frozenset({NGRAM}), frozenset({NGRAM, MODEL})
MODES = (PLAIN, NGRAM_ONLY, ALL)  # what a gate may allow, plainest first
# What the coordinator's gate chooses between: n-gram is always allowed, its rounds chosen by the cost
# model, which values its runs (Runs); the gate decides whether the draft model may be used as well.
GATED = (NGRAM_ONLY, ALL)


class MethodGate:
    """Which drafting methods may be used at the current load, decided by measuring tokens, not by
    the cost model. Alone, a round costs what its parts add up to, and the cost model predicts it.
    Under load it does not: sessions fall out of step and wait in each other's batches, draft and
    target share the cores with the coordinator, a session's n-gram block cuts short the others'
    multi-step calls, and a round at c8 here cost up to 3x its parts. So at each load level
    (requests running here: 2, 3-4, 5-8, 9-16, ...) the coordinator measures a session's tokens per
    ms of its rounds in epochs of each of its modes (for the coordinator, GATED: n-gram alone, and
    the draft model too; any sequence of modes, plainest first, e.g. MODES with plain decoding only)
    and keeps the best (a mode that drafts more only if it serves MARGIN more).

    - A cycle of tests runs each mode twice, in mirrored order (plain, n-gram, model, model,
      n-gram, plain), and judges each by its two tests together: the traffic of one level changes
      within seconds (contexts grow, requests end), plain decoding alone measured 14 and 21 tokens
      per s in two tests a minute apart, and a mode tested later than another would win or lose
      by when it was tested.
    - A test lasts EPOCH_S and MIN_ROUNDS rounds that began in it after SETTLE_S (bets in flight and
      the target's threads change with the mode), and longer (up to MAX_EPOCH_S) until its
      measurement is within PRECISION (the standard error of tokens per ms over its rounds: n-gram
      rounds serve 1 to 11 tokens, and at 4 sessions 1-s epochs of the same mode measured 5 to 36
      tokens per s), or shorter once it serves under half the best beyond doubt (then its second
      test is skipped).
    - A mode that drafts more is kept only if it serves MARGIN more than a plainer one and beyond
      SIGNIFICANCE standard errors of the two measurements: where they cannot be told apart, the
      plainer one (which costs the other sessions nothing) stays.
    - After EXPLOIT_ROUNDS rounds (traffic, not seconds: an idle level learns nothing) the others
      are tested again, in a cycle with the kept mode: the traffic may have changed. A
      mode that lost by more than LOSER waits twice as many exploitations for each such loss in a
      row (up to MAX_WAIT): testing the draft model where it loses costs its prefill of every context.
    - Sooner, and every mode again (waits forgotten, the kept one measured afresh), when the kept
      mode serves under DRIFT of what it served when it was chosen, beyond SIGNIFICANCE standard
      errors (a noisy dip is not a change; in one benchmark run the gate re-tested on noise every
      few seconds, and each test of the draft model cost its prefill): the traffic changed under it
      (chat whose text repeats, then code that does not), and a drafting mode kept for 400 rounds
      of the wrong traffic serves less than plain decoding all that time.

    Greedy requests only: what it decides depends on timing."""

    EPOCH_S = 1.0
    MAX_EPOCH_S = 4.0
    SETTLE_S = 0.3
    MIN_ROUNDS = 16
    PRECISION = 0.07  # relative standard error a test aims for
    SIGNIFICANCE = 1.0  # standard errors a difference must exceed to count
    EXPLOIT_ROUNDS = 400
    MARGIN = 0.05  # drafting also costs the other sessions
    LOSER = 0.8
    MAX_WAIT = 8
    DRIFT = 0.8

    def __init__(self, clock: Callable[[], float] = time.monotonic, modes: tuple[frozenset[str], ...] = MODES):
        self.clock, self.modes = clock, modes
        self._levels: dict[int, _Level] = {}
        self._lock = threading.Lock()

    def allowed(self, running: int) -> frozenset[str]:
        if running <= 1:
            return self.modes[-1]
        with self._lock:
            return self._level(running).mode(self.clock())

    def observe(self, running: int, tokens: int, round_ms: float) -> None:
        if running <= 1:
            return
        with self._lock:
            self._level(running).observe(self.clock(), tokens, round_ms)

    def _level(self, running: int) -> _Level:
        level = 1 << (running - 1).bit_length()  # 2, 4, 8, 16, ...
        if level not in self._levels:
            self._levels[level] = _Level(level, self.clock(), self.modes)
        return self._levels[level]


class _Level:
    """One load level's tests and exploitations: each mode's measured tokens per ms of a session's round."""

    def __init__(self, level: int, now: float, modes: tuple[frozenset[str], ...]):
        self.level, self.modes = level, modes
        self.rate: dict[frozenset[str], Measure] = {}  # each mode's last measurement (test cycle or exploitation)
        self.losses = dict.fromkeys(modes, 0)  # tests in a row lost by more than LOSER
        self.wait = dict.fromkeys(modes, 0)  # exploitations before the next test
        self._plan(list(modes))
        self.allowed = self.untested.pop()  # plain first
        self.exploiting = False
        self._start(now)

    def _plan(self, modes: list[frozenset[str]]) -> None:
        """A cycle of tests of these modes (plainest first), each twice in mirrored order (A B C C B
        A), so that traffic that slowly gets faster or slower favours none of them."""
        self.untested = (modes + modes[::-1])[::-1]  # popped from the end
        self.cycle: dict[frozenset[str], Measure] = {}

    def _start(self, now: float) -> None:
        self.started, self.current = now, Measure()  # the running test or exploitation

    def _losing(self) -> bool:
        """The running test serves under half the best of this cycle beyond doubt."""
        m = self.current
        best = max((x.rate for x in self.cycle.values()), default=0.0)
        return m.rounds >= 4 and m.rate + MethodGate.SIGNIFICANCE * m.error < 0.5 * best

    def _done(self, now: float) -> bool:
        m = self.current
        if self.exploiting:
            return m.rounds >= MethodGate.EXPLOIT_ROUNDS
        if now < self.started + MethodGate.EPOCH_S or not m.rounds:
            return False
        if self._losing():
            return True
        precise = m.error <= MethodGate.PRECISION * m.rate or now >= self.started + MethodGate.MAX_EPOCH_S
        return m.rounds >= MethodGate.MIN_ROUNDS and precise

    def _drifted(self, now: float) -> bool:
        """The kept mode, over enough rounds, serves well under what it served when it was chosen."""
        chosen = self.rate.get(self.allowed)
        return (chosen is not None and now >= self.started + MethodGate.EPOCH_S
                and self.current.rounds >= 2 * MethodGate.MIN_ROUNDS
                and self.current.below(MethodGate.DRIFT * chosen.rate, MethodGate.DRIFT * chosen.error))

    def mode(self, now: float) -> frozenset[str]:
        drifted = self.exploiting and self._drifted(now)
        if not (drifted or self._done(now)):
            return self.allowed
        if not self.exploiting:  # a test ended: its rounds join the mode's others of this cycle
            if self._losing():  # and its second half is not needed
                self.untested = [m for m in self.untested if m != self.allowed]
            self.cycle[self.allowed] = self.cycle.get(self.allowed, Measure()).merged(self.current)
        else:  # test the others again (those whose wait is over; all, if the traffic changed), and the kept one
            if drifted:
                self.losses = dict.fromkeys(self.modes, 0)
            for m in self.modes:
                self.wait[m] = 0 if drifted else max(0, self.wait[m] - 1)
            others = [m for m in self.modes if (drifted or m != self.allowed) and not self.wait[m]]
            if not others:  # all wait: keep the mode for another exploitation
                self.rate[self.allowed] = self.current
                self._start(now)
                return self.allowed
            self._plan([m for m in self.modes if m in others or m == self.allowed])
        if self.untested:
            self.allowed, self.exploiting = self.untested.pop(), False
        else:  # the cycle is over: the best of what it measured (older measurements are of other traffic)
            self.rate.update(self.cycle)
            tested = [m for m in self.modes if m in self.cycle]
            best = tested[0]
            for m in tested[1:]:
                if self.cycle[m].above((1 + MethodGate.MARGIN) * self.cycle[best].rate, self.cycle[best].error):
                    best = m
            for m in tested:
                lost = self.cycle[m].rate < MethodGate.LOSER * self.cycle[best].rate
                self.losses[m] = self.losses[m] + 1 if lost else 0
                self.wait[m] = min(MethodGate.MAX_WAIT, 2 ** self.losses[m])
            self.allowed, self.exploiting = best, True
            log.info("method gate at %d-%d requests running: %s (tokens per s of a session's rounds: %s)",
                     self.level // 2 + 1, self.level, _name(best),
                     ", ".join(f"{_name(m)} {self.cycle[m]}" for m in tested))
        self._start(now)
        return self.allowed

    def observe(self, now: float, tokens: int, round_ms: float) -> None:
        if now - round_ms / 1e3 >= self.started + MethodGate.SETTLE_S:  # the round ran in this epoch
            self.current.add(tokens, round_ms)


class Measure:
    """Tokens per ms over rounds (a ratio of sums) and its standard error, from the rounds' spread
    around it (the ratio estimator's: sqrt(sum (t - R m)^2 / (n (n - 1))) / mean m)."""

    __slots__ = ("rounds", "tokens", "ms", "tt", "tm", "mm")

    def __init__(self):
        self.rounds, self.tokens, self.ms, self.tt, self.tm, self.mm = 0, 0.0, 0.0, 0.0, 0.0, 0.0

    def add(self, tokens: float, ms: float) -> None:
        self.rounds += 1
        self.tokens += tokens
        self.ms += ms
        self.tt += tokens * tokens
        self.tm += tokens * ms
        self.mm += ms * ms

    @property
    def rate(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else 0.0

    @property
    def error(self) -> float:
        n, r = self.rounds, self.rate
        if n < 2 or self.ms <= 0:
            return math.inf if n else 0.0
        spread = max(0.0, self.tt - 2 * r * self.tm + r * r * self.mm)  # sum of (t - R m)^2
        return math.sqrt(spread * n / (n - 1)) / self.ms

    def merged(self, other: Measure) -> Measure:
        both = Measure()
        for name in self.__slots__:
            setattr(both, name, getattr(self, name) + getattr(other, name))
        return both

    def above(self, rate: float, error: float) -> bool:
        """Serves more than `rate` (measured with `error`), beyond SIGNIFICANCE standard errors."""
        return self.rate > rate and self.rate - rate > MethodGate.SIGNIFICANCE * math.hypot(self.error, error)

    def below(self, rate: float, error: float) -> bool:
        return self.rate < rate and rate - self.rate > MethodGate.SIGNIFICANCE * math.hypot(self.error, error)

    def __str__(self) -> str:
        return f"{1e3 * self.rate:.1f} +- {1e3 * self.error:.1f}" if self.rounds else "-"


def _name(mode: frozenset[str]) -> str:
    return "+".join(sorted(mode)) or "plain"


class Costs:
    """The workers' costs as this coordinator measures them, shared by all its sessions."""

    def __init__(self, prior: Prior = Prior(), learns: bool = True, smoothing: float = 0.1):
        self.prior, self.learns, self.smoothing = prior, learns, smoothing
        self._verify: dict[int, Line] = {}  # threads -> V
        self._draft = PowerLaw(prior.draft_ms_per_token, prior.draft_growth)
        self.verify_overhead_ms = prior.verify_overhead_ms
        self.draft_overhead_ms = prior.draft_overhead_ms
        self.batch = 1.0
        self.active = 0  # requests running now (the coordinator keeps it)
        self.gate = MethodGate(modes=GATED)
        # acceptance over every session here: where a new session starts from
        self.acceptance = Rate(OPTIMISTIC_ALPHA, forget=0.98)  # the draft model's
        self.runs = Runs(forget=0.98)
        self._lock = threading.Lock()

    def observe(self, rnd: Round) -> None:
        if not self.learns:
            return
        v, d, s = rnd.verdict, rnd.draft, self.smoothing
        with self._lock:
            if v is not None and 0 < v.batch_tokens and v.batch_prefill_tokens <= PREFILL_PER_SESSION * v.batch_size:
                # a pass's mean cost at its mean tokens (the line is linear, so the mean of the costs is
                # the cost of the mean): the verdict's pass alone would charge an n-gram block's
                # tokens to the plain decoding steps after it, and underrate what a token costs
                tokens = v.pass_tokens / v.passes if v.pass_tokens else v.batch_tokens
                self._line(v.threads).observe(tokens, v.compute_ms / v.passes)
                self.verify_overhead_ms += s * (max(0.0, rnd.verify_ms - v.compute_ms) - self.verify_overhead_ms)
                self.batch += s * (v.batch_size - self.batch)
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
        return max(self.batch, self.active) if self.learns else 1.0

    def observe_acceptance(self, successes: int, trials: int) -> None:
        if self.learns and trials:
            with self._lock:
                self.acceptance.add(successes, trials)

    def observe_lookup(self, hit: bool, matched: int, seen: int) -> None:
        if self.learns:
            with self._lock:
                self.runs.add(hit, matched, seen)

    def prior_acceptance(self) -> float:
        with self._lock:
            return self.acceptance.value

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
            line = self._line((seen[-1] if solo else seen[0]) if seen else 0)
            return passes * line(tokens) + self.verify_overhead_ms

    def draft_ms(self, k: int, sessions: float) -> float:
        with self._lock:
            return k * self._draft(sessions) + self.draft_overhead_ms


FIXED = Costs(learns=False)  # for sampled requests: the same every time


@dataclass(frozen=True)
class Choice:
    method: str  # NONE, NGRAM or MODEL
    k: int
    gain: float = 0.0  # expected tokens per millisecond
    stand_in: bool = False  # the draft model's turn, taken by another method while the draft warms up


class SpeculationPolicy:
    """One session's choices. `methods`: what it may draft with (K = 0 is always a candidate)."""

    def __init__(self, costs: Costs, methods: frozenset[str], overlap: bool, max_k: int | None = None,
                 ngram: NgramProposer | None = None, decode_steps: int = 0):
        self.costs, self.methods, self.overlap, self.max_k = costs, methods, overlap, max_k
        self.decode_steps = decode_steps  # plain steps a round without a draft takes after its verdict
        self.ngram = ngram or NgramProposer()  # whose lookup n-gram rounds would propose
        self.alpha = Rate(costs.prior_acceptance())  # the draft model's acceptance
        self.runs = costs.prior_runs()  # n-gram's
        self._hit = False  # the last lookup's first token was accepted
        self._lookup: list[int] = []
        self._since_model = 0
        self._method = NONE
        self._rounds = 0
        self._last_round: float | None = None  # when the previous round was observed (the gate's clock)

    def choose(self, committed_ids: list[int], max_k: int, model_ready: bool = True) -> Choice:
        """This round's method and K, at most max_k (and the policy's own ceiling). Where the draft
        model cannot serve the round (`model_ready` false: while it prefills the session's context,
        its warm-up when the policy first turns to it), a round it wins goes to the best of the other
        methods instead (a stand-in), and the model keeps its turn: the round would otherwise be plain
        decoding, one token a pass, for as long as the draft prefills (on long input-grounded
        prompts, a third of a 128-token reply at one request), where n-gram copying from the prompt
        serves more."""
        steps = min(self.decode_steps, max(0, max_k))  # what the coordinator asks a plain round for
        max_k = max_k if self.max_k is None else min(max_k, self.max_k)
        self._lookup = self.ngram.continuation(committed_ids, max(NGRAM_KS)) if NGRAM in self.methods else []
        best = Choice(NONE, 0, (steps + 1) / self.costs.verify_ms(self.costs.load, solo=True, passes=steps + 1))
        if max_k <= 0:
            return best
        options = [best]
        gate = self.costs.gate.allowed(self.costs.active) if self.costs.learns else ALL
        allowed = self.methods & gate
        if self._lookup and NGRAM in allowed:
            options += [self._ngram(k, max_k) for k in NGRAM_KS if k <= min(max_k, len(self._lookup))]
        model = MODEL in allowed
        if model:
            alpha = self.alpha.value
            options += [self._model(k, alpha) for k in MODEL_KS if k <= max_k]
        best = max(options, key=lambda c: (c.gain, -c.k))
        current = max((c for c in options if c.method == self._method), key=lambda c: c.gain, default=None)
        if current is not None and current.gain >= best.gain * (1 - SWITCH_MARGIN):
            best = current
        if model and best.method != MODEL:
            self._since_model += 1
            if self._since_model >= PROBE_EVERY:
                self._since_model = 0
                hope = max((self._model(k, OPTIMISTIC_ALPHA) for k in MODEL_KS if k <= max_k), key=lambda c: c.gain)
                if hope.gain > best.gain:
                    best = hope
        if best.method == MODEL:
            self._since_model = 0
            if not model_ready:
                self._method = MODEL
                stand_in = max((c for c in options if c.method != MODEL), key=lambda c: (c.gain, -c.k))
                return replace(stand_in, stand_in=True)
        if log.isEnabledFor(logging.DEBUG):
            n = self.costs.load
            log.debug("policy: %s K=%d at n=%.1f: %.4f tok/ms (none %.4f); alpha model %.2f; n-gram %.2f of 10; "
                      "V solo %.1f shared %.1f ms, D %.1f ms/token", best.method, best.k, n, best.gain,
                      options[0].gain, self.alpha.value, self.runs.expected(self._hit, max(NGRAM_KS)),
                      self.costs.verify_ms(n, solo=True), self.costs.verify_ms(n * (best.k + 1), solo=False),
                      self.costs.draft_ms(1, n) - self.costs.draft_overhead_ms)
        self._method = best.method
        return best

    def observe(self, rnd: Round) -> None:
        """Learn from the round just verified: the costs (shared), each method's acceptance."""
        self.costs.observe(rnd)
        now = self.costs.gate.clock()
        if self.costs.learns and self._rounds:  # not the first round: it prefilled
            # the session's time since its previous round, when longer than the round's own parts:
            # what the session waited between its rounds is time the mode cost it too (a draft model
            # under load: the coordinator's turn, the queue for the draft worker's batches)
            since = (now - self._last_round) * 1e3 if self._last_round is not None else 0.0
            self.costs.gate.observe(self.costs.active, len(rnd.new_ids), max(rnd.draft_ms + rnd.verify_ms, since))
        self._last_round = now
        self._rounds += 1
        if rnd.num_drafted and rnd.draft.from_worker:
            successes, trials = rnd.num_accepted, min(rnd.num_drafted, rnd.num_accepted + 1)
            self.alpha.add(successes, trials)
            self.costs.observe_acceptance(successes, trials)
        if self._lookup:  # scored for free, whatever the round drafted
            seen = min(len(self._lookup), len(rnd.new_ids))
            matched = next((i for i in range(seen) if self._lookup[i] != rnd.new_ids[i]), seen)
            self.runs.add(self._hit, matched, seen)
            self.costs.observe_lookup(self._hit, matched, seen)
        self._hit = bool(self._lookup) and rnd.new_ids[:1] == self._lookup[:1]

    def _ngram(self, k: int, max_k: int) -> Choice:
        """This session's K tokens join a pass of n sessions, and its plain decoding steps follow as
        after a plain round: what the call serves per session, the (n - 1) others' tokens (one per
        pass) plus this one's, over the passes all of them wait for, the first longer by K tokens (the
        lookup matched now, which the others' may not have: a symmetric guess would overrate it)."""
        n, steps = self.costs.load, min(self.decode_steps, max_k - k)
        tokens = n * (steps + 1) + self.runs.expected(self._hit, k)
        ms = self.costs.verify_ms(n + k, solo=True) + self.costs.verify_ms(n, solo=True, passes=steps) - self.costs.verify_overhead_ms
        return Choice(NGRAM, k, tokens / (n * ms))

    def _model(self, k: int, alpha: float) -> Choice:
        """With overlap, a round after a model round finds its block drafted during the last pass when
        that pass's bet won; a round after another method's has none to find (it drafts, then
        verifies): valued as a bet, a switch to the model looked up to twice as good as its first
        round is, and the policy went back and forth between n-gram and the model on input-grounded
        prompts, serving less than either alone."""
        n = self.costs.load
        verify = self.costs.verify_ms(n * (k + 1), solo=not self.overlap)  # with overlap a bet drafts meanwhile
        draft = self.costs.draft_ms(k, n)
        ms = verify + draft
        if self.overlap and self._method == MODEL:
            wins = alpha ** (k + 1)
            ms = wins * max(verify, draft) + (1 - wins) * ms
        return Choice(MODEL, k, expected_tokens(alpha, k) / ms)
