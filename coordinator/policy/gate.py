"""Which draft methods may be used at the current load, decided by measuring a session's tokens per
millisecond of its rounds with each, not by the cost model: an online A/B test per load level.

A mode is the set of draft methods a gate allows (plain decoding, K = 0, is always allowed). Its
name in logs joins the methods' values: "plain", "suffix", "model+suffix".
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from coordinator.request import DraftMethod

log = logging.getLogger(__name__)

Mode = frozenset[DraftMethod]

PLAIN: Mode = frozenset()
SUFFIX_ONLY: Mode = frozenset({DraftMethod.SUFFIX})
ALL: Mode = frozenset({DraftMethod.SUFFIX, DraftMethod.MODEL})
MODES = (PLAIN, SUFFIX_ONLY, ALL)  # what a gate may allow, plainest first
# What the coordinator's gate chooses between: suffix decoding is always allowed, its rounds chosen by the cost
# model, which values its runs (Runs); the gate decides whether the draft model may be used as well.
GATED = (SUFFIX_ONLY, ALL)


def mode_name(mode: Mode) -> str:
    return "+".join(sorted(m.value for m in mode)) or "plain"


class MethodGate:
    """Alone, a round costs what its parts add up to, and the cost model predicts it. Under load it
    does not: sessions fall out of step and wait in each other's batches, draft and target share the
    cores with the coordinator, and a session's suffix block cuts short the others' multi-step calls.
    So at each load level (requests running here: 2, 3-4, 5-8, 9-16, ...) the gate measures a
    session's tokens per ms of its rounds in tests of each of its modes (for the coordinator, GATED;
    any sequence of modes, plainest first, e.g. MODES) and keeps the best.

    - A cycle of tests runs each mode twice, in mirrored order (plain, suffix, model, model,
      suffix, plain), and judges each by its two tests together: a level's traffic changes within
      seconds (contexts grow, requests end), and a mode tested later than another would otherwise
      win or lose by when it was tested.
    - A test lasts EPOCH_S and MIN_ROUNDS rounds that began in it after SETTLE_S (bets in flight and
      the target's threads change with the mode), and longer (up to MAX_EPOCH_S) until its
      measurement is within PRECISION (the standard error of tokens per ms over its rounds), or
      shorter once it serves under half the best beyond doubt (then its second test is skipped).
    - A mode that drafts more is kept only if it serves MARGIN more than a plainer one and beyond
      SIGNIFICANCE standard errors of the two measurements: where they cannot be told apart, the
      plainer one (which costs the other sessions nothing) stays.
    - After EXPLOIT_ROUNDS rounds (traffic, not seconds: an idle level learns nothing) the others
      are tested again, in a cycle with the kept mode: the traffic may have changed. A mode that
      lost by more than LOSER waits twice as many exploitations for each such loss in a row (up to
      MAX_WAIT): testing the draft model where it loses costs its prefill of every context.
    - Sooner, and every mode again (waits forgotten, the kept one measured afresh), when the kept
      mode serves under DRIFT of what it served when it was chosen, beyond SIGNIFICANCE standard
      errors (a noisy dip is not a change): the traffic changed under it (chat whose text repeats,
      then code that does not).

    With one request running, every mode is allowed (the last). Greedy requests only: what it
    decides depends on timing."""

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

    def __init__(self, clock: Callable[[], float] = time.monotonic, modes: tuple[Mode, ...] = MODES):
        self.clock, self.modes = clock, modes
        self._levels: dict[int, _Level] = {}
        self._lock = threading.Lock()

    def allowed(self, running: int) -> Mode:
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

    def __init__(self, level: int, now: float, modes: tuple[Mode, ...]):
        self.level, self.modes = level, modes
        self.rate: dict[Mode, Measure] = {}  # each mode's last measurement (test cycle or exploitation)
        self.losses = dict.fromkeys(modes, 0)  # tests in a row lost by more than LOSER
        self.wait = dict.fromkeys(modes, 0)  # exploitations before the next test
        self._plan(list(modes))
        self.allowed = self.untested.pop()  # plain first
        self.exploiting = False
        self._start(now)

    def _plan(self, modes: list[Mode]) -> None:
        """A cycle of tests of these modes (plainest first), each twice in mirrored order (A B C C B
        A), so that traffic that slowly gets faster or slower favours none of them."""
        self.untested = (modes + modes[::-1])[::-1]  # popped from the end
        self.cycle: dict[Mode, Measure] = {}

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

    def mode(self, now: float) -> Mode:
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
        else:
            self.allowed, self.exploiting = self._keep_best(), True
        self._start(now)
        return self.allowed

    def _keep_best(self) -> Mode:
        """The cycle is over: the best of what it measured (older measurements are of other traffic),
        and each mode's wait before its next test."""
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
        log.info("method gate at %d-%d requests running: %s (tokens per s of a session's rounds: %s)",
                 self.level // 2 + 1, self.level, mode_name(best),
                 ", ".join(f"{mode_name(m)} {self.cycle[m]}" for m in tested))
        return best

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
