"""The speculation policy's choices, from costs and acceptance fed as the rounds' reports would
(no workers, no clock: what it chooses is a function of what it was told)."""

from __future__ import annotations

import pytest

from coordinator.loop import Draft, Round, Verdict
from coordinator.policy import FIXED, Choice, Costs, MethodGate, Prior, SpeculationPolicy, expected_tokens
from coordinator.policy.chooser import PROBE_EVERY
from coordinator.policy.costs import Line
from coordinator.policy.gate import ALL, SUFFIX_ONLY, PLAIN, Measure
from coordinator.request import DraftMethod

BOTH = frozenset({DraftMethod.MODEL, DraftMethod.SUFFIX})


def a_round(new_ids: list[int], drafted: int = 0, accepted: int = 0, *, batch: int = 1, tokens: int = 1,
            verify_ms: float = 20.0, threads: int = 1, draft_ms_per_token: float = 4.0,
            from_worker: bool = True) -> Round:
    draft = Draft(list(range(drafted)), [], draft_ms_per_token * drafted, batch if from_worker else 0, from_worker)
    verdict = Verdict(accepted, new_ids[-1], verify_ms, batch, [], tokens, threads)
    return Round(new_ids, drafted, accepted, draft.compute_ms + 2, verify_ms + 3, batch, [], draft, verdict)


def test_expected_tokens_is_leviathans_formula():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)


def test_line_fits_what_it_sees_and_keeps_the_prior_slope_where_it_sees_one_x():
    line = Line(10.0, 1.0)
    for _ in range(50):
        for x in (1, 9, 17):
            line.observe(x, 30 + 2 * x)
    assert line(9) == pytest.approx(48, rel=0.02) and line(40) == pytest.approx(110, rel=0.05)
    flat = Line(10.0, 1.0)
    for _ in range(50):
        flat.observe(8, 100)
    assert flat(8) == pytest.approx(100, rel=0.02)
    assert 1.0 <= flat(16) - flat(8) <= 12.0  # the slope comes from the prior, not from nothing


def feed(costs: Costs, *, batch: int, verify: dict[int, tuple[float, float]], draft_ms_per_token: float,
         ks=(0, 1, 3, 5)) -> None:
    """Rounds at `batch` sessions per pass; verify[threads] = (a, b): a pass over t tokens costs a + b t."""
    for _ in range(60):
        for threads, (a, b) in verify.items():
            for k in ks:
                t = batch * (k + 1)
                costs.observe(a_round([1] * (k + 1), k, k, batch=batch, tokens=t, verify_ms=a + b * t,
                                      threads=threads, draft_ms_per_token=draft_ms_per_token))


def trained(policy: SpeculationPolicy, accepted_of_5: int, **costs) -> SpeculationPolicy:
    """Twenty model rounds of K = 5 with this acceptance (and these costs, as `a_round` takes them)."""
    for _ in range(20):
        policy.observe(a_round([1] * (accepted_of_5 + 1), 5, accepted_of_5, **costs))
    return policy


def test_alone_with_a_cheap_draft_that_is_right_it_speculates_with_the_model():
    costs = Costs()
    feed(costs, batch=1, verify={1: (20.0, 2.0), 2: (15.0, 2.0)}, draft_ms_per_token=4.0)
    policy = trained(SpeculationPolicy(costs, frozenset({DraftMethod.MODEL}), overlap=True), accepted_of_5=5)
    choice = policy.choose([1, 2, 3], max_k=100)
    assert choice.method == DraftMethod.MODEL and choice.k >= 5
    assert policy.choose([1, 2, 3], max_k=2).k <= 2  # the round's cap (tokens left, context) holds


def test_while_the_draft_warms_up_the_models_rounds_go_to_the_best_other_method():
    """The model wins, but the draft is still prefilling the session's context: its round would be
    plain decoding, so suffix lookup (whose lookup matches here) stands in, and the model keeps its turn."""
    costs = Costs()
    feed(costs, batch=1, verify={1: (20.0, 2.0), 2: (15.0, 2.0)}, draft_ms_per_token=4.0)
    policy = trained(SpeculationPolicy(costs, BOTH, overlap=True), accepted_of_5=5)
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    committed = [1, 2] + text + [3] + text[:2]
    assert policy.choose(committed, max_k=100).method == DraftMethod.MODEL
    stand_in = policy.choose(committed, max_k=100, model_ready=False)
    assert stand_in.method == DraftMethod.SUFFIX and stand_in.stand_in and stand_in.k > 0
    plain = policy.choose([40, 41, 42], max_k=100, model_ready=False)  # no lookup: plain decoding stands in
    assert (plain.method, plain.k, plain.stand_in) == (DraftMethod.NONE, 0, True)
    assert policy.choose(committed, max_k=100).method == DraftMethod.MODEL  # ready: the model's turn again


def test_a_switch_to_the_model_is_valued_without_a_bet_to_find():
    """With overlap, a model round after a model round may find its block drafted during the last
    pass; the first after another method's drafts, then verifies."""
    costs = Costs()
    feed(costs, batch=1, verify={1: (20.0, 2.0), 2: (15.0, 2.0)}, draft_ms_per_token=4.0)
    policy = SpeculationPolicy(costs, BOTH, overlap=True)
    policy._method = DraftMethod.SUFFIX
    switching = policy._model(5, 0.9).gain
    sequential = costs.verify_ms(6, solo=False) + costs.draft_ms(5, 1)
    assert switching == pytest.approx(expected_tokens(0.9, 5) / sequential)
    policy._method = DraftMethod.MODEL
    assert policy._model(5, 0.9).gain > 1.2 * switching


def test_under_load_it_decodes_plainly_and_spends_nothing_on_retrying_the_draft():
    """c8 on this machine: the draft's batch costs 60 ms per token, the target's plain pass on both
    cores 36 ms. However well the draft guesses, drafting for everyone serves fewer tokens."""
    costs = Costs()
    feed(costs, batch=8, verify={1: (30.0, 1.5), 2: (24.0, 1.5)}, draft_ms_per_token=60.0)
    policy = trained(SpeculationPolicy(costs, frozenset({DraftMethod.MODEL}), overlap=True), accepted_of_5=4, batch=8,
                     tokens=48, verify_ms=30 + 1.5 * 48, draft_ms_per_token=60.0)
    choices = [policy.choose(list(range(50)), max_k=100) for _ in range(4 * PROBE_EVERY)]
    assert {c.method for c in choices} == {DraftMethod.NONE}


def test_a_draft_that_is_wrong_is_turned_off_and_retried_now_and_then():
    costs = Costs()
    feed(costs, batch=1, verify={1: (20.0, 2.0)}, draft_ms_per_token=4.0)
    policy = trained(SpeculationPolicy(costs, frozenset({DraftMethod.MODEL}), overlap=False), accepted_of_5=0)
    choices = []
    for _ in range(3 * PROBE_EVERY):
        choice = policy.choose(list(range(50)), max_k=100)
        choices.append(choice.method)
        policy.observe(a_round([7], min(choice.k, 5), 0) if choice.method == DraftMethod.MODEL else a_round([7]))
    assert choices.count(DraftMethod.MODEL) == 3  # one round in PROBE_EVERY
    assert choices[PROBE_EVERY - 1] == DraftMethod.MODEL
    assert trained(policy, accepted_of_5=5).choose([1], max_k=100).method == DraftMethod.MODEL  # right again: back on


def test_suffix_lookup_is_scored_on_every_round_and_chosen_where_the_text_repeats():
    costs = Costs()
    feed(costs, batch=1, verify={1: (20.0, 2.0)}, draft_ms_per_token=30.0)  # a slow draft model
    policy = SpeculationPolicy(costs, BOTH, overlap=False)
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    committed = [1, 2] + text + [3] + text[:2]  # "5 6" came before: the lookup proposes "7 8 9 ..."
    for _ in range(12):  # plain rounds that commit what the lookup proposed: scored without drafting
        assert policy.choose(committed, max_k=0).k == 0
        policy.observe(a_round(text[2:3]))
    assert policy.runs.rates[True][0].value > 0.8 and policy.alpha.value == pytest.approx(0.7)
    choice = policy.choose(committed, max_k=100)
    assert choice.method == DraftMethod.SUFFIX and choice.k > 1
    assert policy.choose([40, 41, 42, 43], max_k=100).method != DraftMethod.SUFFIX  # no match: nothing to propose


def test_suffix_acceptance_is_learnt_in_runs_and_values_a_lookup_by_what_came_before_it():
    """A lookup either copies a passage (all of it matches, and the next one too) or guesses in free
    text (nothing matches). Half the rounds of each kind make one mean rate of 0.5 per token, which
    values an 8-token lookup at 1 token; the runs value it by what the last lookup did."""
    costs = Costs()
    feed(costs, batch=4, verify={1: (40.0, 4.0)}, draft_ms_per_token=30.0)
    policy = SpeculationPolicy(costs, frozenset({DraftMethod.SUFFIX}), overlap=False)
    passage = list(range(100, 111))
    committed = [1] + passage + [1] + passage[:3]  # the lookup proposes passage[3:] + [1, 100]
    pass_of_8 = {"batch": 4, "tokens": 4 + 8, "verify_ms": 40.0 + 4.0 * 12}
    for _ in range(4):
        for _ in range(16):  # copying: the target commits 8 tokens of the lookup and one more
            policy.choose(committed, max_k=100)
            policy.observe(a_round(passage[3:] + [7], 8, 8, **pass_of_8))
        for _ in range(16):  # free text: the lookup's first token is wrong
            policy.choose(committed, max_k=100)
            policy.observe(a_round([9], 8, 0, **pass_of_8))
    assert policy.runs.expected(True, 8) > 6 > 1.5 > policy.runs.expected(False, 8)
    after_a_miss = policy.choose(committed, max_k=100)
    assert after_a_miss.method == DraftMethod.NONE
    policy.observe(a_round(passage[3:5], 0, 0, batch=4, tokens=4, verify_ms=56.0))  # plain, matching the lookup
    after_a_hit = policy.choose(committed, max_k=100)
    assert after_a_hit.method == DraftMethod.SUFFIX and after_a_hit.k == 8
    # starts from what the others learnt
    fresh = SpeculationPolicy(costs, frozenset({DraftMethod.SUFFIX}), overlap=False)
    assert fresh.runs.expected(True, 8) > 6


def test_sampled_requests_choose_from_fixed_costs():
    """A seed must give the same tokens at any load: the fixed costs learn nothing."""
    before = FIXED.verify_ms(1, solo=True), FIXED.draft_ms(4, 1), FIXED.batch
    feed(FIXED, batch=8, verify={1: (300.0, 5.0)}, draft_ms_per_token=90.0, ks=(0, 5))
    assert (FIXED.verify_ms(1, solo=True), FIXED.draft_ms(4, 1), FIXED.batch) == before
    model_only = frozenset({DraftMethod.MODEL})
    choices = [SpeculationPolicy(FIXED, model_only, overlap=True).choose([1, 2], 100) for _ in range(2)]
    assert choices[0] == choices[1] and choices[0].method == DraftMethod.MODEL  # the prior speculates alone


def test_a_new_session_starts_from_what_the_sessions_before_it_learnt():
    costs = Costs()
    feed(costs, batch=1, verify={1: (20.0, 2.0)}, draft_ms_per_token=4.0)
    first = SpeculationPolicy(costs, frozenset({DraftMethod.MODEL}), overlap=False)
    for _ in range(40):
        first.observe(a_round([7], 5, 0))  # the draft is always wrong here
    second = SpeculationPolicy(costs, frozenset({DraftMethod.MODEL}), overlap=False)
    assert second.choose([1, 2], 100).method == DraftMethod.NONE
    assert FIXED.prior_acceptance() == pytest.approx(0.7)  # sampled requests: always the same start


def test_the_method_gate_keeps_the_mode_that_serves_more_and_retests_the_others():
    """Under load the gate measures, per load level, a session's tokens per ms with each mode (plain
    only, suffix lookup too, the model too), in epochs of a fake clock, and keeps the best; when the
    traffic changes, the next tests find it."""
    now = [0.0]
    gate = MethodGate(clock=lambda: now[0])
    speeds = {PLAIN: 1 / 50, SUFFIX_ONLY: 1 / 70, ALL: 1 / 250}  # tokens per ms: at c8 here, drafting loses

    def run(seconds: float, running: int = 8) -> list[frozenset]:
        return drive(gate, now, speeds, seconds, running)

    explored = run(8)  # a new level tests each mode, plain first, and again in mirrored order...
    assert phases(explored) == [PLAIN, SUFFIX_ONLY, ALL, SUFFIX_ONLY, PLAIN]
    assert explored.count(SUFFIX_ONLY) > MethodGate.MIN_ROUNDS  # ...for MIN_ROUNDS rounds...
    assert explored.count(ALL) < MethodGate.MIN_ROUNDS  # ...or fewer where it serves under half the best
    assert gate._level(8).rate[ALL].rounds == 4  # (once: the 4 rounds of that rule; a second test would add its own)
    assert set(run(35)) == {PLAIN}  # keeps what served more, and tests the losers less often...
    speeds[SUFFIX_ONLY] = 1 / 20  # (the traffic changes: text that repeats)
    retested = phases(run(30))
    assert retested[:6] == [PLAIN, SUFFIX_ONLY, ALL, SUFFIX_ONLY, PLAIN, SUFFIX_ONLY]  # ...but tests them again
    assert retested.count(ALL) == 1  # (the model lost twice in a row: it waits four exploitations)
    speeds[SUFFIX_ONLY] = 1 / 49  # not MARGIN more than plain: plain, which costs the others nothing
    assert phases(run(150))[-1] == PLAIN
    assert gate.allowed(1) == ALL  # alone, the cost model decides
    assert gate.allowed(3) == PLAIN  # another level starts afresh (its tests, plain first)


def drive(gate: MethodGate, now: list[float], speeds: dict, seconds: float, running: int = 8) -> list[frozenset]:
    """One session's rounds for `seconds` of a fake clock, each serving one token at its mode's speed
    (tokens per ms), or the (tokens, ms) of the mode's rounds in turn where the speed is a list of
    them: the modes the gate allowed, round by round."""
    modes = []
    turn = dict.fromkeys(speeds, 0)
    end = now[0] + seconds
    while now[0] < end:
        mode = gate.allowed(running)
        modes.append(mode)
        speed = speeds[mode]
        if isinstance(speed, list):
            tokens, ms = speed[turn[mode] % len(speed)]
            turn[mode] += 1
        else:
            tokens, ms = 1, 1 / speed
        now[0] += ms / 1e3
        gate.observe(running, tokens, ms)
    return modes


def phases(modes: list[frozenset]) -> list[frozenset]:
    return [m for i, m in enumerate(modes) if i == 0 or modes[i - 1] != m]


def test_the_method_gate_tests_every_mode_again_when_the_kept_one_serves_far_less_than_it_did():
    """suffix lookup kept where the text repeats; then the traffic turns to text that does not repeat and
    suffix lookup serves under DRIFT of its test: the gate tests every mode again after at most
    2 x MIN_ROUNDS rounds, not EXPLOIT_ROUNDS, plain included (although it lost before and was
    waiting) and suffix lookup afresh, and keeps plain."""
    now = [0.0]
    gate = MethodGate(clock=lambda: now[0])
    speeds = {PLAIN: 1 / 50, SUFFIX_ONLY: 1 / 20, ALL: 1 / 250}
    assert phases(drive(gate, now, speeds, 8)) == [PLAIN, SUFFIX_ONLY, ALL, SUFFIX_ONLY, PLAIN, SUFFIX_ONLY]
    assert gate._level(8).wait[PLAIN] > 0  # plain lost by more than LOSER: it would wait
    speeds[SUFFIX_ONLY] = 1 / 80
    after = drive(gate, now, speeds, 12)
    assert 0 < after.index(PLAIN) <= 2 * MethodGate.MIN_ROUNDS  # (the exploitation's faster rounds count too)
    assert phases(after) == [SUFFIX_ONLY, PLAIN, SUFFIX_ONLY, ALL, SUFFIX_ONLY, PLAIN]  # the kept one afresh too
    assert len(after) < MethodGate.EXPLOIT_ROUNDS / 2


def test_the_method_gate_tests_noisy_modes_longer_and_keeps_plain_unless_drafting_wins_beyond_noise():
    """suffix lookup rounds alternate between fast and slow ones: 5.3% more tokens per ms than plain on
    average (above MARGIN), but within the noise of a test. The gate measures suffix lookup until its
    standard error is within PRECISION (more than MIN_ROUNDS rounds, where plain, steady, needs
    MIN_ROUNDS only) and keeps plain; when suffix lookup's advantage is real (the same noise, a third more
    tokens), it keeps suffix lookup."""
    now = [0.0]
    gate = MethodGate(clock=lambda: now[0])
    noisy = [(2, 60.0), (2, 130.0)]  # 4 tokens per 190 ms: 0.02105 tokens per ms
    speeds = {PLAIN: 1 / 50, SUFFIX_ONLY: noisy, ALL: 1 / 250}
    modes = drive(gate, now, speeds, 16)
    assert phases(modes) == [PLAIN, SUFFIX_ONLY, ALL, SUFFIX_ONLY, PLAIN]
    level = gate._level(8)
    assert level.rate[PLAIN].rounds == 2 * MethodGate.MIN_ROUNDS  # two tests
    assert level.rate[SUFFIX_ONLY].rounds > 2 * MethodGate.MIN_ROUNDS  # two tests, each longer than MIN_ROUNDS
    assert level.rate[SUFFIX_ONLY].error <= MethodGate.PRECISION * level.rate[SUFFIX_ONLY].rate
    assert level.rate[SUFFIX_ONLY].rate > (1 + MethodGate.MARGIN) * level.rate[PLAIN].rate  # better, not surely

    now = [0.0]
    gate = MethodGate(clock=lambda: now[0])
    speeds[SUFFIX_ONLY] = [(3, 60.0), (3, 130.0)]  # 6 tokens per 190 ms: 1.58x plain
    assert phases(drive(gate, now, speeds, 16)) == [PLAIN, SUFFIX_ONLY, ALL, SUFFIX_ONLY, PLAIN, SUFFIX_ONLY]


def test_the_method_gates_mirrored_tests_favour_no_mode_when_the_traffic_speeds_up():
    """Plain and suffix lookup serve alike, and every round gets faster as time goes on (shorter contexts,
    requests ending): tested one after the other, suffix lookup would seem 10% better for being tested
    later; tested plain, suffix lookup, model, suffix lookup, plain, neither is favoured and plain is kept."""
    now = [0.0]
    gate = MethodGate(clock=lambda: now[0])
    while now[0] < 12:
        mode = gate.allowed(8)
        ms = 250.0 if mode == ALL else 50.0 / (1 + now[0] / 10)
        now[0] += ms / 1e3
        gate.observe(8, 1, ms)
    level = gate._level(8)
    assert level.exploiting and level.allowed == PLAIN
    assert level.rate[SUFFIX_ONLY].rate == pytest.approx(level.rate[PLAIN].rate, rel=MethodGate.MARGIN)


def test_the_method_gate_does_not_take_a_noisy_dip_for_a_change_of_traffic():
    """The drift re-test needs the kept mode to serve under DRIFT of its test beyond the noise of
    both measurements: the same mean from rounds that spread widely is no evidence of a change."""
    level = MethodGate(clock=lambda: 0.0)._level(8)
    chosen = Measure()
    for _ in range(20):
        chosen.add(1, 20.0)  # 0.05 tokens per ms, steady
    level.rate[SUFFIX_ONLY], level.allowed, level.exploiting = chosen, SUFFIX_ONLY, True
    steady, noisy = Measure(), Measure()
    for i in range(40):
        steady.add(1, 28.0)  # 0.036: 0.71 of what it served when chosen
        noisy.add(3 if i % 2 else 0, 42.0)  # the same 0.036 on average, 0 or 3 tokens a round
    level.current = noisy
    assert not level._drifted(now=10.0)
    level.current = steady
    assert level._drifted(now=10.0)


def test_a_measure_is_a_ratio_of_sums_with_the_ratio_estimators_standard_error():
    rounds = [(1, 40.0), (4, 80.0), (0, 30.0), (6, 90.0), (2, 50.0)]
    m = Measure()
    for t, ms in rounds:
        m.add(t, ms)
    n, rate = len(rounds), sum(t for t, _ in rounds) / sum(ms for _, ms in rounds)
    mean_ms = sum(ms for _, ms in rounds) / n
    residuals = sum((t - rate * ms) ** 2 for t, ms in rounds) / (n - 1)
    assert m.rate == pytest.approx(rate)
    assert m.error == pytest.approx((residuals / n) ** 0.5 / mean_ms)
    assert Measure().rate == 0.0 and Measure().error == 0.0


def test_a_gated_method_is_neither_chosen_nor_retried():
    now = [0.0]
    costs = Costs()
    costs.gate = MethodGate(clock=lambda: now[0])
    level = costs.gate._level(8)
    level.allowed, level.exploiting = PLAIN, True
    feed(costs, batch=1, verify={1: (20.0, 2.0)}, draft_ms_per_token=1.0)  # the cost model loves the draft
    policy = trained(SpeculationPolicy(costs, BOTH, overlap=True), accepted_of_5=5)
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    committed = [1, 2] + text + [3] + text[:2]  # the lookup has a match
    with costs.running():
        assert policy.choose(committed, 100).method == DraftMethod.MODEL
    for _ in range(8):
        costs.active += 1
    assert {policy.choose(committed, 100).method for _ in range(3 * PROBE_EVERY)} == {DraftMethod.NONE}
    level.allowed = SUFFIX_ONLY
    for _ in range(12):  # plain rounds that commit what the lookup proposed: suffix lookup scored meanwhile
        policy.choose(committed, 0)
        policy.observe(a_round(text[2:3]))
    assert policy.choose(committed, 100).method == DraftMethod.SUFFIX


def test_under_load_the_gate_decides_the_model_draft_and_the_cost_model_decides_suffix():
    """The coordinator's gate chooses between suffix decoding alone and with the model: it never takes
    suffix decoding away, whose rounds the cost model chooses from its runs (measuring plain against
    lookup modes in epochs misjudged traffic whose copying comes and goes within seconds)."""
    now = [0.0]
    costs = Costs()
    assert all(DraftMethod.SUFFIX in mode for mode in costs.gate.modes) and costs.gate.modes[-1] == ALL
    costs.gate = MethodGate(clock=lambda: now[0], modes=costs.gate.modes)
    level = costs.gate._level(8)
    level.allowed, level.exploiting = SUFFIX_ONLY, True
    feed(costs, batch=8, verify={1: (40.0, 2.0)}, draft_ms_per_token=1.0)  # a draft model that would pay
    policy = SpeculationPolicy(costs, BOTH, overlap=True)
    text = list(range(5, 20))
    committed = [1, 2] + text + [3] + text[:5]  # the lookup: text[5:], 10 tokens (a 5-token match buys 10)
    costs.active = 8
    for _ in range(12):  # rounds whose next token the lookup got wrong
        policy.choose(committed, 100)
        policy.observe(a_round([99], batch=8, tokens=8, verify_ms=56.0))
    assert policy.choose(committed, 100).method == DraftMethod.NONE  # the model is gated off, the lookup loses
    for _ in range(12):  # rounds that commit the lookup
        choice = policy.choose(committed, 100)
        policy.observe(a_round(text[5:] + [7], choice.k, choice.k, batch=8, tokens=8 + choice.k,
                               verify_ms=40.0 + 2.0 * (8 + choice.k)))
    assert policy.choose(committed, 100) == Choice(DraftMethod.SUFFIX, 10, policy.choose(committed, 100).gain)
    costs.active = 1
    assert policy.choose([40, 41, 42, 43], 100).method == DraftMethod.MODEL  # alone the gate allows everything


def test_the_gate_measures_a_sessions_time_between_rounds_not_only_the_rounds_parts():
    """Under load a session waits between its rounds too (the coordinator's turn, the draft worker's
    queue): the gate counts the time since the session's previous round when that is longer than
    the round's draft and verify parts (the draft model's per-session rate looked better than
    suffix lookup's at 8 requests while the model configurations served under half of plain decoding)."""
    now = [0.0]
    costs = Costs()
    costs.gate = MethodGate(clock=lambda: now[0], modes=costs.gate.modes)
    costs.active = 8
    policy = SpeculationPolicy(costs, BOTH, overlap=True)
    costs.gate.allowed(8)  # the level's first test starts at 0
    for t in (1.0, 1.1, 1.2):  # rounds 100 ms apart whose parts took 25 ms
        now[0] = t
        policy.observe(a_round([7], batch=8, tokens=8, verify_ms=20.0))
    level = costs.gate._level(8)
    assert level.current.rounds == 2 and level.current.ms == pytest.approx(200.0)


def test_plain_rounds_with_decoding_steps_are_valued_per_token():
    """With --decode-steps, a plain round is s + 1 passes in one call: it pays the call's overhead
    once. A draft whose gain lies between one plain pass and s + 1 of them loses to it, and a
    call's mean pass (compute over passes) is what the line learns."""
    costs = Costs()
    for _ in range(60):  # passes at 8 sessions: 40 ms each, and 30 ms of overhead per call
        costs.observe(Round([1], 0, 0, 0.0, 70.0, 8, [], Draft([]), Verdict(0, 1, 40.0, 8, [], 8, 2)))
        costs.observe(Round([1] * 5, 0, 0, 0.0, 190.0, 8, [], Draft([]),
                            Verdict(0, 1, 160.0, 8, [], 8, 2, decoded_ids=[1] * 3, passes=4)))
    assert costs.verify_ms(8, solo=True) == pytest.approx(40 + 30, rel=0.05)
    assert costs.verify_ms(8, solo=True, passes=4) == pytest.approx(4 * 40 + 30, rel=0.05)
    one = SpeculationPolicy(costs, frozenset(), overlap=False).choose([1, 2, 3], max_k=100)
    four = SpeculationPolicy(costs, frozenset(), overlap=False, decode_steps=3).choose([1, 2, 3], max_k=100)
    assert one.method == four.method == DraftMethod.NONE
    assert one.gain == pytest.approx(1 / 70, rel=0.05) and four.gain == pytest.approx(4 / 190, rel=0.05)
    capped = SpeculationPolicy(costs, frozenset(), overlap=False, decode_steps=3).choose([1, 2, 3], max_k=1)
    assert capped.gain == pytest.approx(2 / 110, rel=0.05)  # one token left after the verdict's: one step


def test_a_calls_passes_are_learnt_at_their_mean_tokens():
    """An suffix lookup block makes a call's first pass longer than its decoding steps: the line learns the
    call's mean pass at the mean of its passes' tokens (pass_tokens / passes), not at the verdict
    pass's tokens, which would make a token look several times cheaper than it is."""
    costs = Costs()
    for _ in range(60):  # passes cost 10 ms + 2 ms per token: 8 sessions plain, and with a 10-token block
        costs.observe(Round([1] * 5, 0, 0, 0.0, 100.0, 8, [], Draft([]),
                            Verdict(0, 1, 5 * 26.0, 8, [], 8, 2, decoded_ids=[1] * 4, passes=5, pass_tokens=40)))
        costs.observe(Round([1] * 5, 0, 0, 0.0, 100.0, 8, [], Draft([]),
                            Verdict(0, 1, 46.0 + 4 * 26.0, 8, [], 18, 2, decoded_ids=[1] * 4, passes=5,
                                    pass_tokens=18 + 4 * 8)))
    overhead = costs.verify_overhead_ms
    assert costs.verify_ms(8, solo=True) - overhead == pytest.approx(26.0, rel=0.05)
    assert costs.verify_ms(18, solo=True) - overhead == pytest.approx(46.0, rel=0.05)


def test_before_the_draft_is_measured_its_size_decides_whether_the_model_may_pay():
    """On a fresh stack (the target's passes measured, the draft's tokens not yet): a draft as large
    as its target (the embedded pair: the same model) is never chosen, not even as a probe, so a
    user's first requests never pay for it; a draft a tenth of its target's size is chosen, and its
    cost, once measured, replaces the size's guess."""
    same = Costs(Prior.for_models(135_000_000, 135_000_000))
    small = Costs(Prior.for_models(7_000_000_000, 500_000_000))
    for costs in (same, small):
        for _ in range(30):
            costs.observe(a_round([1], verify_ms=10.0))  # plain passes: 10 ms
    for costs, chosen in ((same, False), (small, True)):
        policy = SpeculationPolicy(costs, BOTH, overlap=False)
        choices = [policy.choose([40 + i for i in range(20)], max_k=100) for _ in range(3 * PROBE_EVERY)]
        assert any(c.method == DraftMethod.MODEL for c in choices) == chosen
    assert same.draft_ms(1, 1) - same.draft_overhead_ms == pytest.approx(same.verify_ms(1, solo=True)
                                                                          - same.verify_overhead_ms)
    feed(small, batch=1, verify={1: (10.0, 1.5)}, draft_ms_per_token=30.0)  # measured: slow after all
    policy = SpeculationPolicy(small, BOTH, overlap=False)
    assert policy.choose([40 + i for i in range(20)], max_k=100).method != DraftMethod.MODEL
    assert Costs().draft_ms(1, 1) == Costs(Prior.for_models(0, 500)).draft_ms(1, 1)  # sizes unknown: the old prior
