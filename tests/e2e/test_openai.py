"""The OpenAI-compatible HTTP API, driven by the official `openai` SDK against a running stack
(Redis, draft, target, coordinator and the gateway, each its own process), and the new sampling
parameters exact under speculation through the running services.

- the SDK's own calls: chat and completions, streamed and not, usage, stop, seed, n, sessions;
- errors as the SDK's own exception classes (401, 400, 404, 429);
- greedy output through HTTP identical to gRPC and to the target alone (transformers' generate),
  with and without repetition penalty and logit bias;
- log-probabilities equal to the target alone's log-softmax after processing, to 1e-5;
- a chi-square test: the first two tokens of many seeded sampled requests (with penalties that make
  the second token's distribution depend on the first) against their exact distribution.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import Counter

import openai
import pytest
import torch

from specdec import Client
from specdec.client import build_input
from specdec.v1 import generation_pb2 as pb
from specdec_core.engine.sampling import SamplingConfig
from stacks import chi_square_p_value, exact_two_token_distribution, start_stack

pytestmark = [pytest.mark.openai, pytest.mark.e2e]

TOKENS = {"alice": "tok-alice", "bob": "tok-bob"}
MAX_SESSIONS = 64  # per tenant
IDS = [504, 3458, 282, 4649, 314, 1073, 2102]
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def stack(tiny_pair, tmp_path_factory):
    folder = tmp_path_factory.mktemp("openai")
    tokens = folder / "tokens"
    tokens.write_text("".join(f"{tenant}:{token}\n" for tenant, token in TOKENS.items()))
    stack = start_stack(*tiny_pair, folder / "logs", openai=True, args={
        "coordinator": ["--auth-tokens-file", str(tokens), "--tenant-max-sessions", str(MAX_SESSIONS)]})
    yield stack
    stack.down()


@pytest.fixture(scope="module")
def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url(), api_key=TOKENS["alice"], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(stack) -> Client:
    with Client(stack.address("coordinator"), token=TOKENS["alice"], timeout_s=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(sdk) -> str:
    return sdk.models.list().data[0].id


def completion(sdk, model, prompt, **kwargs):
    return sdk.completions.create(model=model, prompt=prompt, extra_body={"return_token_ids": True, **kwargs.pop(
        "extra_body", {})}, **kwargs)


# ----------------------------------------------------------------------------------------------
# The SDK's calls


def test_models_lists_the_target(sdk, tiny_pair):
    models = sdk.models.list().data
    assert [m.id for m in models] == ["target"]  # the target folder's name
    assert models[0].owned_by == "specdec"


def test_greedy_completion_identical_to_grpc_and_to_the_target_alone(sdk, model, grpc_client, hf_greedy):
    # The method and K are fixed: the default policy may rightly decode plainly on the tiny pair.
    r = completion(sdk, model, IDS, max_tokens=24, temperature=0,
                   extra_body={"speculation": {"method": "model", "num_speculative_tokens": 4}})
    ids = r.choices[0].model_extra["token_ids"]
    assert ids == hf_greedy(IDS, 24)
    by_grpc = grpc_client.generate(IDS, max_new_tokens=24)
    assert ids == by_grpc.token_ids and r.choices[0].text == by_grpc.text
    assert r.usage.prompt_tokens == len(IDS) and r.usage.completion_tokens == 24
    assert r.usage.total_tokens == len(IDS) + 24
    assert r.choices[0].finish_reason == "length"
    spec = r.model_extra["speculation"]  # speculation ran (the draft proposed, the target accepted some)
    assert spec["drafted_tokens"] > 0 and 0 < spec["accepted_tokens"] <= spec["drafted_tokens"]


def test_chat_streamed_and_not_agree_with_grpc(sdk, model, grpc_client):
    whole = sdk.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=0)
    by_grpc = grpc_client.generate(CHAT, max_new_tokens=20)
    assert whole.choices[0].message.content == by_grpc.text
    assert whole.choices[0].message.role == "assistant"
    chunks = list(sdk.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == by_grpc.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len(chunks) > 3  # it did stream


def test_streamed_completion_without_usage(sdk, model):
    chunks = list(sdk.completions.create(model=model, prompt=IDS, max_tokens=10, temperature=0, stream=True))
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == completion(sdk, model, IDS, max_tokens=10, temperature=0) \
        .choices[0].text


def test_stop_string_ends_the_output(sdk, model):
    full = completion(sdk, model, IDS, max_tokens=24, temperature=0).choices[0].text
    stop = full[8:12]
    r = completion(sdk, model, IDS, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]


def test_seed_reproducible_and_n_choices(sdk, model):
    kwargs = dict(max_tokens=16, temperature=1.0, top_p=0.95)
    first = sdk.chat.completions.create(model=model, messages=CHAT, seed=1234, **kwargs)
    again = sdk.chat.completions.create(model=model, messages=CHAT, seed=1234, **kwargs)
    assert first.choices[0].message.content == again.choices[0].message.content
    other = [sdk.chat.completions.create(model=model, messages=CHAT, seed=s, **kwargs).choices[0].message.content
             for s in (1, 2, 3)]
    assert len({first.choices[0].message.content, *other}) > 1  # the seed matters
    three = sdk.chat.completions.create(model=model, messages=CHAT, seed=1234, n=3, **kwargs)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].message.content == first.choices[0].message.content  # choice i uses seed + i
    many = completion(sdk, model, IDS, seed=7, n=3, max_tokens=5, temperature=1.0)
    assert many.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in many.choices) == 15
    assert many.usage.prompt_tokens == len(IDS)  # the prompt counts once, as OpenAI counts it


def test_session_kept_and_continued(sdk, model, grpc_client):
    first = sdk.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0,
                                        extra_body={"keep_session": True})
    session_id = first.model_extra["session_id"]
    second = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "And two more."}],
                                         max_tokens=6, temperature=0, extra_body={"session_id": session_id})
    assert second.model_extra["session_id"] == session_id
    third = list(sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "Thanks."}],
                                             max_tokens=4, temperature=0, stream=True,
                                             extra_body={"session_id": session_id}))
    assert {c.model_extra["session_id"] for c in third} == {session_id}  # streamed chunks name it too
    session = grpc_client.get_session(session_id)
    assert [m.role for m in session.messages] == ["user", "assistant"] * 3
    assert session.messages[1].content == first.choices[0].message.content
    assert second.usage.prompt_tokens < first.usage.prompt_tokens + 6 + 20  # only the new turn was added
    grpc_client.end_session(session_id)


def test_unkept_sessions_are_ended(sdk, model, stack):
    """A request that does not keep its session leaves none behind (the gateway ends it)."""
    import redis

    r = redis.Redis.from_url(stack.redis_url)
    before = r.zrange("specdec:tenant:alice:sessions", 0, -1)  # the gRPC tests' sessions
    for stream in (False, True):
        list(completion(sdk, model, IDS, max_tokens=3, temperature=0, n=2, stream=stream)) if stream else \
            completion(sdk, model, IDS, max_tokens=3, temperature=0, n=2)
    for _ in range(200):  # ended off the response's path: wait for it
        if r.zrange("specdec:tenant:alice:sessions", 0, -1) == before:
            break
        time.sleep(0.05)
    assert r.zrange("specdec:tenant:alice:sessions", 0, -1) == before


# ----------------------------------------------------------------------------------------------
# Errors, as the SDK's own exception classes


def test_errors_are_the_sdks_exceptions(stack, sdk, model):
    for key in ("", "wrong-token"):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=stack.url(), api_key=key or "none", max_retries=0).chat.completions.create(
                model=model, messages=CHAT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=model, messages=CHAT, max_tokens=2, temperature=-1)
    assert err.value.body["param"] == "temperature" and err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=model, messages=CHAT, max_tokens=2, presence_penalty=3)
    assert err.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=model, messages=CHAT, tools=[{"type": "code_interpreter"}])
    assert err.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model=model, prompt=[10 ** 7], max_tokens=2)
    assert "outside the vocabulary" in err.value.message
    with pytest.raises(openai.NotFoundError) as err:
        sdk.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model=model, messages=CHAT, extra_body={"session_id": "no-such-session"})


def test_over_the_tenant_cap_is_a_rate_limit_error(stack, model):
    """bob keeps MAX_SESSIONS sessions; one more is refused with 429 (and Retry-After)."""
    bob = openai.OpenAI(base_url=stack.url(), api_key=TOKENS["bob"], max_retries=0)
    kept = [bob.completions.create(model=model, prompt=IDS, max_tokens=1, temperature=0,
                                   extra_body={"keep_session": True}).model_extra["session_id"]
            for _ in range(MAX_SESSIONS)]
    with pytest.raises(openai.RateLimitError) as err:
        bob.completions.create(model=model, prompt=IDS, max_tokens=1, temperature=0)
    assert err.value.response.headers["retry-after"] == "1"
    with Client(stack.address("coordinator"), token=TOKENS["bob"]) as client:
        for session_id in kept:
            client.end_session(session_id)
    bob.completions.create(model=model, prompt=IDS, max_tokens=1, temperature=0)  # room again


def test_health_models_and_metrics_endpoints(stack):
    base = f"http://{stack.address('openai')}"
    for path in ("/health", "/health/live"):
        with urllib.request.urlopen(base + path, timeout=5) as response:
            assert json.loads(response.read()) == {"status": "ok"}
    with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'specdec_http_requests_total{route="/v1/completions",status="200"}' in text


def test_bad_json_is_a_400(stack):
    request = urllib.request.Request(f"{stack.url()}/chat/completions", data=b"{not json", method="POST",
                                     headers={"Authorization": f"Bearer {TOKENS['alice']}",
                                              "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 400
    assert json.loads(err.value.read())["error"]["type"] == "invalid_request_error"


# ----------------------------------------------------------------------------------------------
# Greedy identity with penalties and bias, and log-probabilities, against transformers


def hf_generate(hf_greedy, ids, n, **kwargs) -> list[int]:
    with torch.inference_mode():
        out = hf_greedy.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                       attention_mask=torch.ones(1, len(ids), dtype=torch.long), **kwargs)
    return out[0, len(ids):].tolist()


@pytest.mark.lossless
def test_greedy_with_repetition_penalty_identical_to_transformers(sdk, model, hf_greedy):
    plain = hf_greedy(IDS, 32)
    expected = hf_generate(hf_greedy, IDS, 32, repetition_penalty=0.5)
    assert expected != plain  # the penalty changes the output
    r = completion(sdk, model, IDS, max_tokens=32, temperature=0, extra_body={"repetition_penalty": 0.5})
    assert r.choices[0].model_extra["token_ids"] == expected
    ngram = completion(sdk, model, IDS, max_tokens=32, temperature=0, extra_body={
        "repetition_penalty": 0.5, "speculation": {"method": "ngram", "num_speculative_tokens": 6}})
    assert ngram.choices[0].model_extra["token_ids"] == expected


@pytest.mark.lossless
def test_greedy_with_logit_bias_identical_to_transformers(sdk, model, hf_greedy):
    plain = hf_greedy(IDS, 24)
    bias = {plain[3]: -100.0, plain[10]: 4.0}
    expected = hf_generate(hf_greedy, IDS, 24, sequence_bias={(t,): b for t, b in bias.items()})
    assert expected != plain and plain[3] not in expected
    r = completion(sdk, model, IDS, max_tokens=24, temperature=0, logit_bias={str(t): b for t, b in bias.items()})
    assert r.choices[0].model_extra["token_ids"] == expected


@pytest.mark.lossless
@pytest.mark.parametrize("penalties", [{}, {"repetition_penalty": 1.5, "frequency_penalty": 0.7,
                                            "presence_penalty": 0.4}])
def test_logprobs_equal_the_target_alones(sdk, model, grpc_client, hf_greedy, penalties):
    """Every emitted token's log-probability (accepted, recovered or bonus) and its top 5, against the
    target's own logits after the same processing; HTTP reports what gRPC does."""
    from transformers import RepetitionPenaltyLogitsProcessor

    n = 20
    r = grpc_client.generate(IDS, max_new_tokens=n, logprobs=5, k=4, **penalties)
    assert r.stats["accepted"] > 0 and r.stats["rounds"] < n  # blocks of several tokens were verified
    ids = r.token_ids
    with torch.inference_mode():  # the target alone, decoding with its KV cache (raw logits per step)
        out = hf_greedy.model.generate(torch.tensor([IDS]), max_new_tokens=n, do_sample=False, output_logits=True,
                                       return_dict_in_generate=True, **_hf_penalties(penalties),
                                       attention_mask=torch.ones(1, len(IDS), dtype=torch.long))
    assert out.sequences[0, len(IDS):].tolist() == ids
    logits = torch.cat(out.logits).to(torch.float64)  # [n, V]
    response = grpc_client.stub.Generate(pb.GenerateRequest(input=_input(IDS, n, penalties)),
                                         metadata=[("authorization", f"Bearer {TOKENS['alice']}")])
    assert list(response.token_ids) == ids and len(response.logprobs) == n
    for j, (token, lp) in enumerate(zip(ids, response.logprobs)):
        row = logits[j]
        context = IDS + ids[:j]
        if penalties.get("repetition_penalty"):
            row = RepetitionPenaltyLogitsProcessor(penalties["repetition_penalty"])(
                torch.tensor([context]), row[None])[0]
        for t in set(ids[:j]):
            row[t] -= penalties.get("frequency_penalty", 0) * ids[:j].count(t) + penalties.get("presence_penalty", 0)
        expected = torch.log_softmax(row, dim=-1)
        assert lp.chosen.token_id == token and int(row.argmax()) == token
        # The tiny model's logits are huge (its weights are scaled up), and float32 rounds them
        # differently in a verify block than in a one-token step (up to 5e-5 seen, 1.6e-5
        # relative; block boundaries depend on timing): 2e-4 here. In float64 the same comparison
        # holds to 1e-9 (below).
        assert lp.chosen.logprob == pytest.approx(float(expected[token]), abs=2e-4, rel=1e-4)
        top = torch.topk(expected, 5)
        assert [a.token_id for a in lp.top] == top.indices.tolist()
        assert [a.logprob for a in lp.top] == pytest.approx(top.values.tolist(), abs=2e-4, rel=1e-4)
        assert lp.chosen.token  # the token's text is filled in
    http = completion(sdk, model, IDS, max_tokens=n, temperature=0, logprobs=5,
                      extra_body={"speculation": {"num_speculative_tokens": 4}, **penalties})
    assert http.choices[0].logprobs.token_logprobs == pytest.approx([lp.chosen.logprob for lp in response.logprobs],
                                                                    abs=1e-5)
    assert http.choices[0].logprobs.tokens == [lp.chosen.token for lp in response.logprobs]


def _hf_penalties(penalties: dict) -> dict:
    return {"repetition_penalty": penalties["repetition_penalty"]} if "repetition_penalty" in penalties else {}


def _input(ids, n, penalties) -> pb.GenerationInput:
    from specdec.client import build_input

    return build_input(ids, max_new_tokens=n, logprobs=5, k=4, **penalties)


# ----------------------------------------------------------------------------------------------
# Sampled output has exactly the target's distribution, through the running services

STAT_IDS = [504, 3458, 282, 4649, 314]
STAT_CFG = dict(temperature=1.6, top_k=4, presence_penalty=-1.5, frequency_penalty=0.5, repetition_penalty=0.4)
STAT_SAMPLES = 2400
STAT_N = 16  # choices per request (seeds seed .. seed + 15)


@pytest.mark.lossless
def test_sampled_first_two_tokens_follow_the_exact_distribution(stack, model, hf_greedy):
    """STAT_SAMPLES seeded requests through HTTP, gRPC, draft and target (K = 1 drafted, verified,
    recovered or bonus), with penalties that change the second token's distribution according to
    the first. The counts fit the exact distribution; the same counts reject the distribution
    without the penalties (so the test can tell)."""
    sdk = openai.OpenAI(base_url=stack.url(), api_key=TOKENS["alice"], max_retries=0, timeout=300)

    def batch(seed: int) -> list[tuple[int, int]]:
        r = sdk.completions.create(model=model, prompt=STAT_IDS, max_tokens=2, n=STAT_N, seed=seed,
                                   temperature=STAT_CFG["temperature"], presence_penalty=STAT_CFG["presence_penalty"],
                                   frequency_penalty=STAT_CFG["frequency_penalty"], extra_body={
                                       "top_k": STAT_CFG["top_k"], "repetition_penalty": STAT_CFG["repetition_penalty"],
                                       "return_token_ids": True, "speculation": {"num_speculative_tokens": 4}})
        assert r.model_extra["speculation"]["drafted_tokens"] > 0
        return [tuple(c.model_extra["token_ids"]) for c in r.choices]

    samples = [s for seed in range(0, STAT_SAMPLES, STAT_N) for s in batch(seed)]
    assert len(samples) == STAT_SAMPLES and len(set(samples)) > 4
    counts = Counter(samples)
    cfg = SamplingConfig(**STAT_CFG, output_start=len(STAT_IDS))
    exact = exact_two_token_distribution(hf_greedy.model, STAT_IDS, cfg)
    assert abs(sum(exact.values()) - 1) < 1e-9
    p_value = chi_square_p_value(counts, exact, STAT_SAMPLES)
    print(f"chi-square p = {p_value:.3f} over {len(exact)} cells, {STAT_SAMPLES} samples")
    assert p_value > 1e-3, (p_value, counts.most_common(8), sorted(exact.items(), key=lambda kv: -kv[1])[:8])
    unpenalised = exact_two_token_distribution(hf_greedy.model, STAT_IDS, SamplingConfig(
        temperature=STAT_CFG["temperature"], top_k=STAT_CFG["top_k"], output_start=len(STAT_IDS)))
    assert chi_square_p_value(counts, unpenalised, STAT_SAMPLES) < 1e-6


@pytest.fixture(scope="module")
def float64_stack(tiny_pair, tmp_path_factory):
    """The target in float64: float32's rounding out of the way, what is left is the processing."""
    stack = start_stack(*tiny_pair, tmp_path_factory.mktemp("float64"), args={"target": ["--dtype", "float64"]})
    yield stack
    stack.down()


@pytest.mark.lossless
def test_logprobs_exact_in_float64(float64_stack, tiny_pair):
    """With a float64 target, every token's log-probability and its top 5 (greedy, with all the
    penalties and a bias, verified in blocks of K = 4) equal transformers' float64 generate
    followed by the same processing written out by hand, to 1e-9."""
    from transformers import LlamaForCausalLM, RepetitionPenaltyLogitsProcessor

    penalties = {"repetition_penalty": 1.5, "frequency_penalty": 0.7, "presence_penalty": 0.4}
    bias = {IDS[0]: 2.0, 17: -3.0}
    with Client(float64_stack.address("coordinator"), timeout_s=120) as client:
        request = build_input(IDS, max_new_tokens=20, logprobs=5, k=4, logit_bias=bias, **penalties)
        response = client.stub.Generate(pb.GenerateRequest(input=request))
    assert response.stats.accepted > 0 and response.stats.rounds < 20
    ids = list(response.token_ids)
    model = LlamaForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float64).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([IDS]), max_new_tokens=20, do_sample=False,
                             return_dict_in_generate=True, attention_mask=torch.ones(1, len(IDS), dtype=torch.long),
                             repetition_penalty=1.5, sequence_bias={(t,): b for t, b in bias.items()},
                             logits_processor=[_OpenAIPenalties(len(IDS), 0.7, 0.4)])
        # (generate's own output_logits are rounded to float32: the logits of one forward pass instead)
        logits = model(torch.tensor([IDS + ids])).logits[0, len(IDS) - 1:-1]
    worst = 0.0
    for j, lp in enumerate(response.logprobs):
        row = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([IDS + ids[:j]]), logits[j:j + 1].clone())[0]
        for t in set(ids[:j]):
            row[t] -= 0.7 * ids[:j].count(t) + 0.4
        for t, b in bias.items():
            row[t] += b
        expected = torch.log_softmax(row, dim=-1)
        assert lp.chosen.token_id == ids[j] == int(expected.argmax())
        top = torch.topk(expected, 5)
        assert [a.token_id for a in lp.top] == top.indices.tolist()
        worst = max(worst, abs(lp.chosen.logprob - float(expected[ids[j]])),
                    *(abs(a.logprob - v) for a, v in zip(lp.top, top.values.tolist())))
    assert ids == out.sequences[0, len(IDS):].tolist()
    assert worst < 1e-9, worst


class _OpenAIPenalties:
    """transformers has no presence/frequency penalty: OpenAI's formula as a logits processor, so
    that generate's greedy path is the penalised one."""

    def __init__(self, start: int, frequency: float, presence: float):
        self.start, self.frequency, self.presence = start, frequency, presence

    def __call__(self, input_ids, scores):
        generated = input_ids[0, self.start:].tolist()
        for t in set(generated):
            scores[0, t] -= self.frequency * generated.count(t) + self.presence
        return scores
