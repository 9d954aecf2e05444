"""Helpers the tests share: a reference decoder (the target alone, with transformers' generate)
and starting a stack whose logs are printed when it fails to come up."""

from __future__ import annotations

import grpc
import pytest

from specdec.client import build_input
from specdec.launcher import Stack
from specdec.launcher import scrape_metrics as scrape  # noqa: F401 - shared with the tests
from specdec.v1 import draft_pb2, draft_pb2_grpc, generation_pb2, target_pb2, target_pb2_grpc


class ReferenceDecoder:
    def __init__(self, model_ref: str):
        from specdec_core.engine.models import load_causal_lm
        from tiny_models import ENGINE

        self.model = load_causal_lm(model_ref, ENGINE)

    def __call__(self, input_ids: list[int], max_new_tokens: int) -> list[int]:
        import torch

        with torch.inference_mode():
            out = self.model.generate(torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                      attention_mask=torch.ones(1, len(input_ids), dtype=torch.long))
        return out[0, len(input_ids):].tolist()


def start_stack(target: str, draft: str, log_dir, **kwargs) -> Stack:
    stack = Stack(target_model=target, draft_model=draft, log_dir=log_dir, **kwargs)
    try:
        stack.up(wait_s=300)
    except BaseException:
        stack.down()
        for log in log_dir.glob("*.log"):
            print(f"==== {log.name}\n{log.read_text()[-3000:]}")
        raise
    return stack


def in_parallel(fn, items, workers: int = 8) -> list:
    """fn over items, `workers` at a time (requests to a stack at that concurrency), in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def raw_stream(client, prompt, timeout_s: float = 300.0, **kwargs):
    """The raw GenerateStream call of a `specdec.Client` (iterable, cancellable with .cancel(); no
    retries); kwargs as for `build_input`."""
    return client.stub.GenerateStream(generation_pb2.GenerateStreamRequest(input=build_input(prompt, **kwargs)),
                                      timeout=timeout_s)


def status_of(call) -> tuple[grpc.StatusCode, str]:
    """The status code and details a call fails with (a stream is read until it fails)."""
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if isinstance(result, grpc.Call):
            list(result)
    return err.value.code(), err.value.details()


def committed(r, session_id: str) -> list[int]:
    """A session's committed tokens, as Redis (client `r`) holds them."""
    return [int(t) for t in r.lrange(f"specdec:session:{session_id}:ids", 0, -1)]


def end_stream(stream) -> None:
    """Read an ended session's stream to its end: it stops with the session gone (or, if its last
    round had committed already, normally)."""
    try:
        for _ in stream:
            pass
    except grpc.RpcError as exc:
        assert exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND), exc


def assert_no_cache_left(stack, session_ids: list[str]) -> None:
    """Neither worker holds a cache for these sessions (a release finds nothing to release)."""
    with grpc.insecure_channel(stack.address("target")) as channel:
        stub = target_pb2_grpc.TargetStub(channel)
        for session_id in session_ids:
            assert not stub.ReleaseTargetCache(target_pb2.ReleaseTargetCacheRequest(session_id=session_id)).released
    if "draft" in stack.processes:
        with grpc.insecure_channel(stack.address("draft")) as channel:
            stub = draft_pb2_grpc.DraftStub(channel)
            for session_id in session_ids:
                assert not stub.ReleaseDraftCache(draft_pb2.ReleaseDraftCacheRequest(session_id=session_id)).released


def exact_two_token_distribution(model, prompt_ids: list[int], cfg) -> dict[tuple[int, int], float]:
    """P(t1, t2) of the target alone after prompt_ids and `cfg`'s processing (t2's row penalised for t1)."""
    import torch

    from specdec_core.engine.sampling import process_logits

    start = len(prompt_ids)
    with torch.inference_mode():
        first = model(torch.tensor([prompt_ids])).logits[0, -1:]
        p1 = process_logits(first, cfg, prompt_ids)[0]
        out = {}
        for t1 in (p1 > 0).nonzero().flatten().tolist():
            second = model(torch.tensor([prompt_ids + [t1]])).logits[0, -1:]
            p2 = process_logits(second, cfg, prompt_ids + [t1])[0]
            for t2 in (p2 > 0).nonzero().flatten().tolist():
                out[(t1, t2)] = float(p1[t1] * p2[t2])
    assert start == cfg.output_start
    return out


def assert_target_distribution(counts: dict, model, prompt_ids: list[int], temperature: float, top_k: int,
                               samples: int) -> None:
    """The first two output tokens' counts fit the target's exact distribution at this temperature and
    top-k, and reject the one at half the temperature (so the test can tell them apart)."""
    from specdec_core.engine.sampling import SamplingConfig

    exact = exact_two_token_distribution(model, prompt_ids, SamplingConfig(
        temperature=temperature, top_k=top_k, output_start=len(prompt_ids)))
    p_value = chi_square_p_value(counts, exact, samples)
    print(f"chi-square p = {p_value:.3f} over {len(exact)} cells, {samples} samples")
    assert p_value > 1e-3, (p_value, sorted(counts.items(), key=lambda kv: -kv[1])[:8],
                            sorted(exact.items(), key=lambda kv: -kv[1])[:8])
    colder = exact_two_token_distribution(model, prompt_ids, SamplingConfig(
        temperature=temperature / 2, top_k=top_k, output_start=len(prompt_ids)))
    assert chi_square_p_value(counts, colder, samples) < 1e-6


def chi_square_p_value(counts: dict, expected: dict, total: int) -> float:
    """Pearson's test; cells expected fewer than 5 times are pooled (and anything never expected
    counts against the fit)."""
    stat, cells, pooled_obs, pooled_exp = 0.0, 0, 0, 0.0
    for cell, p in expected.items():
        e = p * total
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(cell, 0), pooled_exp + e
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        cells += 1
    unexpected = sum(n for cell, n in counts.items() if cell not in expected)
    if unexpected:
        return 0.0
    if pooled_exp:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    df = cells - 1
    import torch

    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
