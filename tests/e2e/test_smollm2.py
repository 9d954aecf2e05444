"""The embedded default for real: SmolLM2-135M-Instruct as target (transformers, from the GGUF
shipped on PyPI) and the same GGUF run by llama.cpp as draft, through all three services."""

from __future__ import annotations

import time

import pytest

from stacks import ReferenceDecoder, scrape, start_stack
from specdec import Client
from specdec.launcher import free_port
from specdec_core.engine.models import load_tokenizer
from tiny_models import ENGINE

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short Python function that checks whether a number is prime.",
    "Give me three tips for staying focused while studying.",
]


@pytest.fixture(scope="module")
def smollm2_stack(tmp_path_factory):
    ports = {role: free_port() for role in ("draft", "target")}
    kv = ["--kv-chunk-tokens", "16"]
    stack = start_stack("smollm2", "smollm2", tmp_path_factory.mktemp("logs"), openai=True, kv_store_mb=256,
                        args={"draft": ["--backend", "llama.cpp", "--metrics-port", str(ports["draft"]), *kv],
                              "target": ["--metrics-port", str(ports["target"]), *kv]})
    stack.metrics_ports = ports
    yield stack
    stack.down()


@pytest.fixture(scope="module")
def reference():
    return ReferenceDecoder("smollm2")


@pytest.mark.lossless
def test_greedy_identical_to_transformers_generate(smollm2_stack, reference):
    tokenizer = load_tokenizer("smollm2", ENGINE.cache_dir)
    with Client(smollm2_stack.address("coordinator"), timeout_s=300) as client:
        assert client.describe().draft.backend == "llama.cpp"
        for prompt in PROMPTS:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]
            result = client.generate(ids, max_new_tokens=64, k=5, stop_token_ids=[])
            expected = reference(ids, 64)
            assert result.token_ids == expected, (prompt, tokenizer.decode(result.token_ids), tokenizer.decode(expected))
            assert result.stats["acceptance_rate"] > 0.5  # the quantized copy agrees with its target most of the time
            chat = client.generate([{"role": "user", "content": prompt}], max_new_tokens=64, k=5)
            assert chat.token_ids == expected  # the chat template applied by the coordinator is the same


@pytest.mark.lossless
def test_the_shipped_head_drafts_and_keeps_greedy_output_identical(smollm2_stack, reference):
    """The EAGLE-3 head shipped for the embedded model (target_service/heads/smollm2, loaded by
    --head auto): head rounds, three sessions at once, give transformers' greedy answer token for
    token, and the head's drafts are accepted as a trained head's are (held-out: benchmarks/README.md)."""
    from concurrent.futures import ThreadPoolExecutor

    tokenizer = load_tokenizer("smollm2", ENGINE.cache_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for p in PROMPTS]
    with Client(smollm2_stack.address("coordinator"), timeout_s=300) as client:
        assert client.describe().target.head.endswith("heads/smollm2")
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda ids: client.generate(ids, max_new_tokens=64, draft="head", k=4,
                                                                stop_token_ids=[], end_session=True), prompts))
    for ids, result in zip(prompts, results):
        assert result.token_ids == reference(ids, 64)
    # a trained head's first token is right in ~30% of the rounds on such prompts, a random head's
    # almost never (a 49k-token vocabulary)
    rounds, accepted = (sum(r.stats[key] for r in results) for key in ("head_rounds", "accepted"))
    assert rounds > 0 and accepted > 0.1 * rounds, (accepted, rounds)


@pytest.mark.lossless
@pytest.mark.openai
def test_openai_api_logprobs_and_greedy_identity_on_the_real_model(smollm2_stack, reference):
    """Through the OpenAI SDK, greedy output with a repetition penalty is transformers' own; every
    token's log-probability (and its top 5) is the target alone's log-softmax after the penalty (to
    float32's rounding, below), whether the token was an accepted draft token or the recovered or
    bonus one."""
    import openai
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    tokenizer = load_tokenizer("smollm2", ENGINE.cache_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    sdk = openai.OpenAI(base_url=smollm2_stack.url(), api_key="none", max_retries=0, timeout=300)
    r = sdk.completions.create(model="smollm2", prompt=ids, max_tokens=48, temperature=0, logprobs=5,
                               extra_body={"repetition_penalty": 1.2, "return_token_ids": True,
                                           "speculation": {"num_speculative_tokens": 5, "overlap": False}})
    # without overlap every round waits for the draft (with it, rounds decode plainly while the draft
    # warms up, as many as a busy machine makes them): most tokens came from accepted drafts
    assert r.model_extra["speculation"]["accepted_tokens"] > 10
    out = r.choices[0].model_extra["token_ids"]
    with torch.inference_mode():
        generated = reference.model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                             repetition_penalty=1.2, output_logits=True, return_dict_in_generate=True,
                                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert out == generated.sequences[0, len(ids):].tolist()
    # float32 rounds a verify block's logits differently from generate's one-token steps (2e-5 at
    # most seen; which rounds carry blocks depends on timing, with overlap), and transformers' own
    # logprobs for these tokens differ by up to 2.3e-5 between generate and one forward pass over
    # the whole sequence. Hence 5e-5 here, far below what a processing error moves (a penalty
    # missed: > 1e-2); in float64 it is exact to 1e-9 (test_openai.py::test_logprobs_exact_in_float64).
    worst_chosen = worst_top = 0.0
    for j, (token, chosen, top) in enumerate(zip(out, r.choices[0].logprobs.token_logprobs,
                                                 r.choices[0].logprobs.top_logprobs)):
        row = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([ids + out[:j]]),
                                                   generated.logits[j].to(torch.float64))[0]
        expected = torch.log_softmax(row, dim=-1)
        worst_chosen = max(worst_chosen, abs(chosen - float(expected[token])))
        values = torch.topk(expected, 5).values.tolist()
        got = sorted(top.values(), reverse=True)
        assert got == pytest.approx(values, abs=5e-5)
        worst_top = max(worst_top, *(abs(g - v) for g, v in zip(got, values)))
    print(f"logprobs vs transformers: chosen tokens {worst_chosen:.2e}, top 5 {worst_top:.2e} (absolute)")
    assert worst_chosen < 5e-5, worst_chosen


@pytest.mark.lossless
@pytest.mark.kvstore
def test_kv_restored_by_restarted_workers_on_the_real_model(smollm2_stack, reference):
    """The KV tier with the real pair: the llama.cpp draft and the float32 target both restore a
    session's KV after a restart of both, and the continuation is what transformers gives."""
    tokenizer = load_tokenizer("smollm2", ENGINE.cache_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(PROMPTS)}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    chunks = len(ids) // 16

    def kv(role: str, name: str, outcome: str = "") -> float:
        labels = f'outcome="{outcome}",role="{role}"' if outcome else f'role="{role}"'
        return scrape(smollm2_stack.metrics_ports[role]).get(f"specdec_kv_store_{name}{{{labels}}}", 0.0)

    def wait_for(check, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert check()

    before = {role: kv(role, "chunks_total", "stored") for role in ("draft", "target")}
    with Client(smollm2_stack.address("coordinator"), timeout_s=300) as client:
        first = client.generate(ids, max_new_tokens=16, k=5, stop_token_ids=[])
    # written behind the rounds (chunks of the chat template's start may be there from earlier tests:
    # what a worker knows is stored it does not write again)
    wait_for(lambda: all(kv(r, "chunks_total", "stored") > before[r] and not kv(r, "pending_bytes") for r in before))
    for name in ("draft", "target", "coordinator"):
        smollm2_stack.restart(name)
    more = tokenizer("Thanks. And one more tip?")["input_ids"]
    with Client(smollm2_stack.address("coordinator"), timeout_s=300) as client:
        second = client.generate(more, max_new_tokens=24, k=5, stop_token_ids=[], session_id=first.session_id)
    assert second.token_ids == reference(ids + first.token_ids + more, 24)
    assert kv("target", "restored_tokens_total") >= chunks * 16
    wait_for(lambda: kv("draft", "restored_tokens_total") >= chunks * 16)  # its warm-up proposal runs behind
