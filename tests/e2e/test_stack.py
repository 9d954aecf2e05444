"""The whole path for real: Redis, draft, target and coordinator as separate processes on
localhost ports, tiny random Llama-style models loaded by the services' own loading code."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import redis

from specdec import Client

pytestmark = pytest.mark.e2e

PROMPT_IDS = [[504, 3458, 282, 4649, 314], [1073, 2102, 30, 9, 17, 3365, 11, 4500], [42, 7, 900]]


@pytest.fixture(scope="module")
def client(tiny_stack):
    with Client(tiny_stack.address("coordinator"), timeout_s=120) as c:
        yield c


def committed_in_redis(stack, session_id: str) -> list[int]:
    r = redis.Redis.from_url(stack.redis_url)
    return [int(t) for t in r.lrange(f"specdec:session:{session_id}:ids", 0, -1)]


@pytest.mark.lossless
@pytest.mark.parametrize("k", [0, 1, 4, 8])
@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_identical_to_target_alone(client, hf_greedy, k, overlap):
    for ids in PROMPT_IDS:
        result = client.generate(ids, max_new_tokens=40, k=k, overlap=overlap)
        assert result.token_ids == hf_greedy(ids, 40)
        if k and not overlap:  # with overlap, greedy rounds never wait for the draft: it may miss them all
            assert result.stats["drafted"] > 0
        elif not k:  # plain rounds after the first decode a few more tokens in the target (--decode-steps 4)
            assert result.stats["drafted"] == 0 and result.stats["decoded"] > 0
            assert result.stats["rounds"] + result.stats["decoded"] == len(result.token_ids)  # a pass a token


@pytest.mark.lossless
def test_ngram_drafting_is_lossless(client, hf_greedy):
    ids = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    result = client.generate(ids, max_new_tokens=30, draft="ngram", k=4)
    assert result.token_ids == hf_greedy(ids, 30)
    assert result.stats["drafted"] > 0


@pytest.mark.lossless
def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(max_new_tokens=30, temperature=0.9, top_k=50, top_p=0.95, seed=1234, k=4)
    first = client.generate(PROMPT_IDS[0], **kwargs)
    second = client.generate(PROMPT_IDS[0], **kwargs)
    no_overlap = client.generate(PROMPT_IDS[0], **kwargs, overlap=False)
    other_seed = client.generate(PROMPT_IDS[0], **{**kwargs, "seed": 99})
    assert first.token_ids == second.token_ids == no_overlap.token_ids  # keyed draws: overlap changes nothing
    assert other_seed.token_ids != first.token_ids
    assert first.stats["drafted"] > 0


@pytest.mark.lossless
def test_adaptive_k_and_confidence_stop_are_lossless(client, hf_greedy):
    for ids in PROMPT_IDS:
        adaptive = client.generate(ids, max_new_tokens=40, k=6, adaptive=True)
        confident = client.generate(ids, max_new_tokens=40, k=6, min_draft_confidence=0.6)
        assert adaptive.token_ids == confident.token_ids == hf_greedy(ids, 40)
        assert confident.stats["drafted"] < 6 * confident.stats["rounds"]  # blocks were cut short


def test_stream_delivers_rounds_and_persists_before_sending(client, tiny_stack):
    chunks = list(client.stream(PROMPT_IDS[1], max_new_tokens=32, k=3))
    assert len(chunks) > 1
    streamed = [t for c in chunks for t in c.token_ids]
    assert len(streamed) == 32
    assert all(c.finish_reason == 0 for c in chunks[:-1]) and chunks[-1].finish_reason != 0
    last = chunks[-1]
    assert last.usage.completion_tokens == 32 and last.stats.rounds == len(chunks)
    assert "".join(c.text for c in chunks) == client.generate(PROMPT_IDS[1], max_new_tokens=32, k=3).text
    assert committed_in_redis(tiny_stack, last.session_id) == PROMPT_IDS[1] + streamed


def test_stop_string_and_stop_token_truncate_inside_a_block(client, hf_greedy):
    ids = PROMPT_IDS[0]
    reference = hf_greedy(ids, 40)
    full = client.generate(ids, max_new_tokens=40, k=6)
    stop_token = reference[10]
    cut = client.generate(ids, max_new_tokens=40, k=6, stop_token_ids=[stop_token])
    assert cut.finish_reason == "stop_token"
    assert cut.token_ids == reference[: reference.index(stop_token) + 1]
    stop_text = full.text[len(full.text) // 2:][:4]
    if stop_text.strip():
        by_string = client.generate(ids, max_new_tokens=40, k=6, stop=[stop_text])
        assert by_string.finish_reason == "stop_string"
        assert by_string.text == full.text[: full.text.index(stop_text)]
        assert stop_text not in by_string.text


def test_two_turn_session_survives_coordinator_restart(client, tiny_stack, hf_greedy):
    first = client.generate([11, 12, 13, 14], max_new_tokens=12, k=4)
    tiny_stack.restart("coordinator")
    with Client(tiny_stack.address("coordinator"), timeout_s=120) as fresh:
        second = fresh.generate([15, 16], max_new_tokens=12, k=4, session_id=first.session_id)
        session = fresh.get_session(first.session_id)
    history = [11, 12, 13, 14] + first.token_ids + [15, 16]
    assert second.session_id == first.session_id
    assert second.token_ids == hf_greedy(history, 12)
    assert list(session.token_ids) == history + second.token_ids
    assert committed_in_redis(tiny_stack, first.session_id) == history + second.token_ids


@pytest.mark.parametrize("worker", ["draft", "target"])
def test_worker_restart_mid_session_keeps_greedy_output(tiny_stack, hf_greedy, worker):
    with Client(tiny_stack.address("coordinator"), timeout_s=120) as c:
        first = c.generate([21, 22, 23], max_new_tokens=16, k=4)
        tiny_stack.restart(worker)
        second = c.generate([24], max_new_tokens=16, k=4, overlap=False, session_id=first.session_id)
        # The draft is back, not silently skipped for good: a call that found the restarted draft's
        # channel still reconnecting marks it down for a backoff (1 s, doubling), and a short
        # request can end inside it, so later requests are what must draft again.
        drafted = second.stats["drafted"]
        deadline = time.monotonic() + 60
        while not drafted and time.monotonic() < deadline:
            time.sleep(0.5)
            drafted = c.generate([21, 22, 23], max_new_tokens=8, k=4, overlap=False).stats["drafted"]
    history = [21, 22, 23] + first.token_ids + [24]
    assert second.token_ids == hf_greedy(history, 16)
    assert drafted > 0


def test_two_sessions_at_once(client, hf_greedy):
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = client.generate(PROMPT_IDS[i], max_new_tokens=24, k=4).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: hf_greedy(PROMPT_IDS[i], 24) for i in range(2)}


@pytest.mark.lossless
@pytest.mark.parametrize("k, draft", [(0, "none"), (4, "model"), (4, "ngram")])
def test_greedy_identical_under_batching(tiny_stack, hf_greedy, k, draft):
    """Eight sessions of different lengths at once: their verify blocks share target passes."""
    prompts = [[(7 * i + j) % 4000 + 30 for j in range(3 + 9 * i)] for i in range(8)]
    results: dict[int, object] = {}
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        with Client(tiny_stack.address("coordinator"), timeout_s=120) as c:
            start.wait()
            results[i] = c.generate(prompts[i], max_new_tokens=24, k=k, draft=draft)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, ids in enumerate(prompts):
        assert results[i].token_ids == hf_greedy(ids, 24), i
    assert max(r.stats["max_verify_batch_size"] for r in results.values()) > 1  # batching happened


def test_chat_session_multi_turn(client):
    first = client.generate([{"role": "user", "content": "Hello"}], max_new_tokens=8)
    second = client.generate([{"role": "user", "content": "And again"}], max_new_tokens=8,
                             session_id=first.session_id)
    session = client.get_session(first.session_id)
    assert [m.role for m in session.messages] == ["user", "assistant", "user", "assistant"]
    assert session.messages[1].content == first.text and session.messages[3].content == second.text
    assert second.prompt_tokens > 0


def test_end_session_deletes_it(client, tiny_stack):
    result = client.generate([1, 2, 3], max_new_tokens=4)
    client.end_session(result.session_id)
    assert committed_in_redis(tiny_stack, result.session_id) == []
    with pytest.raises(grpc.RpcError) as err:
        client.get_session(result.session_id)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_describe_models(client):
    info = client.describe()
    assert info.target.vocab_size == info.draft.vocab_size == 49152
    assert info.target.backend == "transformers-paged" and info.default_num_speculative_tokens == 5


# ---- the default policy: method and K chosen per round ---------------------------------------

POLICY_PROMPTS = [[(7 * i + j) % 4000 + 30 for j in range(3 + 9 * i)] for i in range(4)] + \
                 [[40 + i] + [5, 6, 7, 8, 9] * (2 + i) + [5, 6] for i in range(4)]  # repeating: n-gram matches


def generate_at_once(address: str, prompts: list[list[int]], **kwargs) -> dict[int, object]:
    """Every prompt in a session of its own, all started together (their rounds share target passes)."""
    results: dict[int, object] = {}
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        with Client(address, timeout_s=120) as c:
            start.wait()
            results[i] = c.generate(prompts[i], **kwargs)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.lossless
@pytest.mark.parametrize("overlap", [True, False])
def test_default_policy_is_lossless_under_batching(tiny_stack, hf_greedy, overlap):
    """No method, no K: the policy chooses every round from measured costs, whatever they are."""
    results = generate_at_once(tiny_stack.address("coordinator"), POLICY_PROMPTS, max_new_tokens=32, overlap=overlap)
    for i, ids in enumerate(POLICY_PROMPTS):
        assert results[i].token_ids == hf_greedy(ids, 32), i
        stats = results[i].stats
        assert stats["model_rounds"] + stats["suffix_rounds"] <= stats["rounds"]


def in_process_coordinator(stack, default_k: int, overlap: bool = False):
    """A coordinator's Generation in this process, on the stack's workers and Redis."""
    from coordinator.__main__ import worker_pools
    from coordinator.config import CoordinatorConfig
    from coordinator.generation import Generation
    from coordinator.request import Limits
    from coordinator.sessions import SessionStore
    from coordinator.suffix import SuffixProposer
    from coordinator.text import TextCodec
    from specdec_core.engine.models import load_tokenizer
    from specdec_core.serving.redis_client import connect_redis
    from tiny_models import ENGINE

    cfg = CoordinatorConfig.from_args(["--redis-url", stack.redis_url, "--target", stack.address("target"),
                                       "--draft", stack.address("draft")])
    target, draft = worker_pools(cfg)
    info = target.model_info(60)
    return Generation(SessionStore(connect_redis(stack.redis_url)),
                      TextCodec(load_tokenizer(stack.target_model, ENGINE.cache_dir), "tiny"), draft, SuffixProposer(),
                      target, Limits(info.vocab_size, info.max_context, 64, default_k, overlap=overlap))


@pytest.mark.lossless
def test_switching_method_and_k_mid_request_is_lossless(tiny_stack, hf_greedy, monkeypatch):
    """The policy's choices forced to rotate through every method and K, round by round, so that every
    request switches many times whatever the timing (which choice the policy makes is
    tests/coordinator/test_policy.py's). A coordinator in this process, on the stack's workers and
    Redis; eight sessions at once, overlap on: bets are made, won and dropped by switches."""
    from concurrent.futures import ThreadPoolExecutor, wait

    from coordinator.loop import Speculator
    from coordinator.policy import Choice, SpeculationPolicy
    from coordinator.request import DraftMethod, GenerationRequest

    script = [Choice(DraftMethod.MODEL, 3), Choice(DraftMethod.SUFFIX, 4), Choice(DraftMethod.NONE, 0),
              Choice(DraftMethod.MODEL, 1), Choice(DraftMethod.MODEL, 6), Choice(DraftMethod.SUFFIX, 2),
              Choice(DraftMethod.MODEL, 2)]

    def scripted(self, ids: list[int], max_k: int, model_ready: bool = True) -> Choice:
        self.calls = getattr(self, "calls", 0) + 1  # the first round drafts by suffix lookup
        choice = script[self.calls % len(script)]
        if choice.method == DraftMethod.MODEL and not model_ready:  # the draft warms up: suffix stands in,
            return Choice(DraftMethod.SUFFIX, min(4, max_k), stand_in=True)  # as the policy does
        return Choice(choice.method, min(choice.k, max_k))

    def settled(self) -> bool:  # a warm-up ends before the next choice, however busy the machine: a
        # script rotating every round would otherwise cancel each one before it finished (CI: no model round in 40)
        if self._warmup is not None:
            wait([self._warmup.proposal], timeout=60)
        return warming_up(self)

    warming_up = Speculator.warming_up.fget
    monkeypatch.setattr(SpeculationPolicy, "choose", scripted)
    monkeypatch.setattr(Speculator, "warming_up", property(settled))
    generation = in_process_coordinator(tiny_stack, default_k=5, overlap=True)
    start = threading.Barrier(len(POLICY_PROMPTS))

    def run(ids: list[int]):
        start.wait()
        chunks = list(generation.run(GenerationRequest(token_ids=ids, max_new_tokens=40, end_session=True)))
        return [t for c in chunks for t in c.token_ids], chunks[-1].stats

    with ThreadPoolExecutor(len(POLICY_PROMPTS)) as pool:
        results = list(pool.map(run, POLICY_PROMPTS))
    for ids, (tokens, stats) in zip(POLICY_PROMPTS, results):
        assert tokens == hf_greedy(ids, 40)
        assert stats.model_rounds > 0 and stats.model_rounds + stats.suffix_rounds < stats.rounds  # switched
    assert sum(stats.suffix_rounds for _, stats in results) > 0  # the repeating prompts' lookups matched


@pytest.mark.lossless
def test_seeded_sampling_under_the_default_policy_is_reproducible_at_any_concurrency(tiny_stack):
    """A sampled request's choices depend only on its tokens and seed (fixed costs, its own
    acceptance, suffix lookups in its own tokens: not in what other requests have said, which the
    second round of requests finds in the index), so the same seed gives the same tokens alone,
    again, and among seven others. The prompts repeat themselves, so that the lookup drafts (the
    tiny pair's draft is as large as its target: the policy never expects the model to pay)."""
    kwargs = dict(max_new_tokens=30, temperature=0.9, top_k=50, top_p=0.95, seed=4321)  # no method, no K
    address, prompts = tiny_stack.address("coordinator"), POLICY_PROMPTS[4:6]
    with Client(address, timeout_s=120) as c:
        alone = [c.generate(ids, **kwargs) for ids in prompts]
        again = [c.generate(ids, **kwargs) for ids in prompts]
    crowded = generate_at_once(address, [prompts[i % 2] for i in range(8)], **kwargs)
    for i in range(8):
        assert crowded[i].token_ids == alone[i % 2].token_ids == again[i % 2].token_ids, i
    assert all(r.stats["drafted"] > 0 for r in alone)  # the policy speculated


@pytest.mark.lossless
@pytest.mark.parametrize("speculation", [{}, {"draft": "model", "k": 4}], ids=["policy", "model_draft"])
def test_long_prompts_prefilled_in_chunks_beside_decoding_sessions_are_lossless(tiny_stack, hf_greedy, speculation):
    """The target prefills prompts in chunks (--prefill-chunk, 16, or more as its measured costs
    allow) between the other sessions' rounds, and the draft worker at most its --prefill-chunk (32) per batch, beside
    the other sessions' proposals (every request drafts with the model in the second case): two long
    prompts among four short ones, all at once."""
    prompts = [[(11 * i + 3 * j) % 3000 + 40 for j in range(n)] for i, n in enumerate((300, 450, 5, 9, 14, 20))]
    results = generate_at_once(tiny_stack.address("coordinator"), prompts, max_new_tokens=24, **speculation)
    for i, ids in enumerate(prompts):
        assert results[i].token_ids == hf_greedy(ids, 24), i


def test_a_generate_request_passes_each_coordinator_file_in_one_stretch(tiny_stack, hf_greedy, monkeypatch):
    """The request path, traced: a Generate call to the public servicer (served here, in-process, on
    the stack's workers and Redis), and at each of its worker calls the stack of coordinator files
    it went through. Each file is one stretch of that stack, so the path reads top to bottom and
    back up the same way: every coordinator file is visited at most twice (down and up)."""
    import traceback
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from coordinator.servicer import GenerationServicer
    from coordinator.workers import WorkerClient
    from specdec.v1 import generation_pb2 as pb
    from specdec.v1 import generation_pb2_grpc

    root = Path(__file__).resolve().parents[2] / "coordinator"
    paths: dict[str, set[tuple[str, ...]]] = {}  # request type -> the paths it was sent along
    call = WorkerClient.call

    def traced(self, method, request, ctx=None, retry_budget_s=None):
        if ctx is not None:  # a call made for a request
            files = [Path(f.filename).relative_to(root).as_posix() for f in traceback.extract_stack()
                     if Path(f.filename).is_relative_to(root)]
            path = tuple(f for i, f in enumerate(files) if i == 0 or files[i - 1] != f)
            paths.setdefault(type(request).__name__, set()).add(path)
        return call(self, method, request, ctx, retry_budget_s)

    monkeypatch.setattr(WorkerClient, "call", traced)
    generation = in_process_coordinator(tiny_stack, default_k=4)
    server = grpc.server(ThreadPoolExecutor(4))
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(generation, pb.DescribeModelsResponse()),
                                                          server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", timeout_s=120) as c:
            result = c.generate(PROMPT_IDS[0], max_new_tokens=24, draft="model", k=4)
    finally:
        server.stop(None)
    assert result.token_ids == hf_greedy(PROMPT_IDS[0], 24)
    assert {"ProposeRequest", "VerifyRequest"} <= set(paths)
    for kind, path in ((kind, path) for kind in paths for path in paths[kind]):
        print(kind, ":", " -> ".join(path))
        assert path[0] == "servicer.py" and path[-1] == "workers.py"
        assert len(path) == len(set(path)), f"a coordinator file visited twice on the way down: {path}"
