"""Suffix decoding through the running services (tiny random pair, real Redis, separate processes):
drafts from other sessions' finished requests keep greedy output identical to the target alone,
under batching; sampled output keeps the target's exact distribution; a tenant's requests are never
proposed to another tenant; and two coordinators share the index through Redis, a coordinator that
starts later warming up from it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec import Client
from specdec.launcher import free_port, scrape_metrics
from stacks import assert_target_distribution, start_stack

pytestmark = pytest.mark.e2e

PROMPTS = [[504, 3458, 282, 4649, 314], [1073, 2102, 30, 9, 17, 3365, 11, 4500], [42, 7, 900, 3001],
           [77, 2400, 18, 3020, 640, 12]]
N = 24
TOKENS = {"alpha": "tok-suffix-alpha", "beta": "tok-suffix-beta"}
METRICS_PORT = free_port()
STAT_IDS = [2033, 148, 3907, 61, 2710, 2033, 148]  # "2033 148" again: the lookup proposes "3907 61"
STAT_CFG = dict(temperature=1.0, top_k=6)
STAT_SAMPLES = 2400


@pytest.fixture(scope="module")
def stack(tiny_pair, tmp_path_factory):
    folder = tmp_path_factory.mktemp("suffix")
    tokens = folder / "tokens"
    tokens.write_text("".join(f"{tenant}:{token}\n" for tenant, token in TOKENS.items()))
    stack = start_stack(*tiny_pair, folder / "logs", args={
        "coordinator#tenants": ["--auth-tokens-file", str(tokens)],
        "coordinator#2": ["--metrics-port", str(METRICS_PORT)],
    })
    yield stack
    stack.down()


def generate(stack, prompt: list[int], name: str = "coordinator", token: str = "", **kwargs):
    with Client(stack.address(name), timeout_s=300, token=token) as client:
        return client.generate(prompt, end_session=True, **kwargs)


def without_repeats(hf_greedy, candidates: list[list[int]], n: int) -> list[int]:
    """A prompt whose text and greedy continuation repeat no pair of tokens: a suffix lookup in the
    session's own tokens finds nothing, so whatever it drafts came from the index."""
    for prompt in candidates:
        ids = prompt + hf_greedy(prompt, n)
        if len(set(zip(ids, ids[1:]))) == len(ids) - 1:
            return prompt
    pytest.skip("no candidate prompt without repeated pairs for this tiny model")


def candidates(first: int) -> list[list[int]]:
    return [[first + 97 * i, 2 * first + 13 * i + 5, 3111 - 7 * i, 400 + 31 * i] for i in range(40)]


@pytest.mark.lossless
def test_greedy_identical_with_suffix_drafts_from_other_sessions_under_batching(stack, hf_greedy):
    """Four requests finish (and are indexed); then the same prompts, twice each, eight sessions at
    once: their suffix drafts come from the earlier sessions' outputs, and are accepted."""
    for prompt in PROMPTS:
        assert generate(stack, prompt, max_new_tokens=N, draft="suffix", k=8).token_ids == hf_greedy(prompt, N)
    start = threading.Barrier(2 * len(PROMPTS))

    def run(prompt: list[int]):
        start.wait()
        return generate(stack, prompt, max_new_tokens=N, draft="suffix", k=8)

    with ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
        results = list(pool.map(run, PROMPTS * 2))
    for prompt, result in zip(PROMPTS * 2, results):
        assert result.token_ids == hf_greedy(prompt, N)
    assert sum(r.stats["accepted"] for r in results) > N * len(results) // 2  # drafted from the index
    assert max(r.stats["max_verify_batch_size"] for r in results) > 1  # verified in shared passes
    for prompt in PROMPTS:  # and under the default policy, which chooses among none, suffix and model
        assert generate(stack, prompt, max_new_tokens=N).token_ids == hf_greedy(prompt, N)


@pytest.mark.lossless
def test_sampled_tokens_with_suffix_drafts_follow_the_exact_distribution(stack, hf_greedy):
    """STAT_SAMPLES seeded requests at T = 1 whose first two tokens are drafted by suffix decoding
    (one-hot q: accepted with probability p(d), else the recovered token from p without d); a
    sampled request drafts from its own tokens (here its prompt) alone. The counts fit the target's
    exact distribution, and reject the distribution at another temperature (so the test can tell)."""
    def sample(seed: int) -> tuple[tuple[int, int], int]:
        r = generate(stack, STAT_IDS, max_new_tokens=2, draft="suffix", k=2, seed=seed, **STAT_CFG)
        return tuple(r.token_ids), r.stats["drafted"]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(sample, range(STAT_SAMPLES)))
    assert all(drafted > 0 for _, drafted in results)
    counts = Counter(pair for pair, _ in results)
    assert_target_distribution(counts, hf_greedy.model, STAT_IDS, samples=STAT_SAMPLES, **STAT_CFG)


@pytest.mark.security
def test_a_tenants_requests_are_never_proposed_to_another_tenant(stack, hf_greedy):
    stack.start("coordinator#tenants")
    try:
        prompt = without_repeats(hf_greedy, candidates(1201), N)

        def run(tenant: str):
            return generate(stack, prompt, "coordinator#tenants", TOKENS[tenant], max_new_tokens=N, draft="suffix",
                            k=8)

        first, again = run("alpha"), run("alpha")
        other = run("beta")
    finally:
        stack.stop("coordinator#tenants")
    assert first.token_ids == again.token_ids == other.token_ids == hf_greedy(prompt, N)
    assert first.stats["drafted"] == 0 and again.stats["accepted"] > N // 2  # alpha's own earlier request
    assert other.stats["drafted"] == 0  # beta never sees it


@pytest.mark.durability
def test_two_coordinators_share_the_index_through_redis_and_a_new_one_warms_up(stack, hf_greedy):
    """A request finished on one coordinator drafts a request on another (they share only Redis),
    once the other's metrics say it has received it; a coordinator started afterwards has it from
    the start."""
    shared, warm = without_repeats(hf_greedy, candidates(1733), N), without_repeats(hf_greedy, candidates(2411), N)
    stack.start("coordinator#2")
    try:
        received = scrape_metrics(METRICS_PORT).get('specdec_suffix_shared_total{direction="received"}', 0.0)
        # (the index has other requests' text too, which a lookup may match here and there)
        assert generate(stack, shared, max_new_tokens=N, draft="suffix", k=8).stats["accepted"] < N // 2
        deadline = time.monotonic() + 60
        while scrape_metrics(METRICS_PORT).get('specdec_suffix_shared_total{direction="received"}', 0) <= received:
            assert time.monotonic() < deadline, "the other coordinator never received the finished request"
            time.sleep(0.1)
        on_other = generate(stack, shared, "coordinator#2", max_new_tokens=N, draft="suffix", k=8)
        assert on_other.token_ids == hf_greedy(shared, N) and on_other.stats["accepted"] > N // 2
        assert generate(stack, warm, max_new_tokens=N, draft="suffix", k=8).stats["accepted"] < N // 2
    finally:
        stack.stop("coordinator#2")
    stack.start("coordinator#3")
    try:
        late = generate(stack, warm, "coordinator#3", max_new_tokens=N, draft="suffix", k=8)
    finally:
        stack.stop("coordinator#3")
    assert late.token_ids == hf_greedy(warm, N) and late.stats["accepted"] > N // 2
