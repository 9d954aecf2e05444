"""Structured outputs through the running services (gRPC): the embedded SmolLM2 model answers 22
JSON schemas with output that parses and validates, greedy and sampled; greedy output under a
constraint is the same with every draft method, under batching and overlap; a constrained
request interrupted mid-output and resumed on a restarted coordinator, or across a worker
restart, ends the same and valid. On the tiny pair: the χ² of a constrained sampled output
against its exactly enumerated distribution."""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import torch

from stacks import chi_square_p_value, in_parallel, start_stack
from specdec import Client
from specdec_core.engine.grammar import Constraint, Grammars
from specdec_core.engine.models import load_tokenizer
from specdec_core.engine.sampling import SamplingConfig, process_logits
from tiny_models import ENGINE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from schemas import SCHEMAS, messages as ask  # noqa: E402

pytestmark = [pytest.mark.structured, pytest.mark.e2e]

MAX_TOKENS = 200


@pytest.fixture(scope="module")
def smollm2_stack(tmp_path_factory):
    stack = start_stack("smollm2", "smollm2", tmp_path_factory.mktemp("logs"))
    yield stack
    stack.down()


@pytest.fixture(scope="module")
def client(smollm2_stack):
    with Client(smollm2_stack.address("coordinator"), timeout_s=600) as c:
        yield c


@pytest.mark.slow
def test_every_schema_validates_greedy_and_sampled_at_c8(client):
    """22 schemas, greedy and sampled (T = 0.8), 8 requests at a time with the default policy:
    every output ends by itself, parses, and validates against its schema."""
    jobs = [(name, prompt, schema, temperature) for name, prompt, schema in SCHEMAS for temperature in (None, 0.8)]

    def run(job):
        name, prompt, schema, temperature = job
        r = client.generate(ask(prompt), json_schema=schema, max_new_tokens=MAX_TOKENS, temperature=temperature,
                            seed=7, end_session=True)
        return name, temperature, r

    failures = []
    for name, temperature, r in in_parallel(run, jobs):
        try:
            assert r.finish_reason == "stop_token", r.finish_reason
            jsonschema.validate(json.loads(r.text), SCHEMAS[[s[0] for s in SCHEMAS].index(name)][2])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append((name, temperature, r.text[:200], str(exc)[:200]))
    assert len(jobs) == 44 and not failures, failures


@pytest.mark.slow
@pytest.mark.lossless
def test_greedy_output_under_a_constraint_is_the_same_with_every_method(client):
    """Plain decoding (K = 0) is the reference; the model draft with overlap, suffix drafts and the
    default policy give the same tokens, 8 requests at a time (batched verify passes)."""
    picked = SCHEMAS[:8]

    def run(options):
        def one(item):
            _, prompt, schema = item
            return client.generate(ask(prompt), json_schema=schema, max_new_tokens=MAX_TOKENS, end_session=True,
                                   **options)
        return in_parallel(one, picked)

    reference = run({"draft": "none"})
    assert all(r.finish_reason == "stop_token" for r in reference)
    drafted = 0
    for options in ({"draft": "model", "k": 4, "overlap": True}, {"draft": "suffix", "k": 8}, {}):
        results = run(options)
        for (name, _, _), r, ref in zip(picked, results, reference):
            assert r.token_ids == ref.token_ids, (name, options, r.text, ref.text)
        drafted += sum(r.stats["drafted"] for r in results)
    assert drafted > 0  # speculation did run


@pytest.mark.slow
def test_a_constrained_request_resumes_on_a_restarted_coordinator(smollm2_stack, client):
    """The stream is cut after its first chunks, the coordinator restarts, and the retry with the
    same request id continues the output from Redis: the grammar is rebuilt from the committed
    tokens, and the whole output is the uninterrupted one."""
    name, prompt, schema = SCHEMAS[5]
    whole = client.generate(ask(prompt), json_schema=schema, max_new_tokens=MAX_TOKENS, draft="model", k=4)
    request = dict(json_schema=schema, max_new_tokens=MAX_TOKENS, draft="model", k=4, request_id="resume-me")
    stream = client.stream(ask(prompt), decode_steps=0, **request)
    first = [next(stream) for _ in range(3)]
    stream.close()
    assert sum(len(c.token_ids) for c in first) < len(whole.token_ids)  # cut mid-output
    smollm2_stack.restart("coordinator")
    with Client(smollm2_stack.address("coordinator"), timeout_s=600) as fresh:
        resumed = fresh.generate(ask(prompt), decode_steps=0, **request)
    assert resumed.token_ids == whole.token_ids
    jsonschema.validate(json.loads(resumed.text), schema)


@pytest.mark.slow
@pytest.mark.parametrize("worker", ["target", "draft"])
def test_a_session_continues_valid_across_a_worker_restart(smollm2_stack, worker):
    """A worker restarts between two constrained turns of a session and while a third is streamed:
    its grammar state is gone with it, and is rebuilt from the committed tokens the next call carries."""
    name, prompt, schema = SCHEMAS[11]
    with Client(smollm2_stack.address("coordinator"), timeout_s=600) as c:
        first = c.generate(ask(prompt), json_schema=schema, max_new_tokens=MAX_TOKENS, draft="model", k=4)
        smollm2_stack.restart(worker)
        follow = [{"role": "user", "content": "Another one, please."}]
        second = c.generate(follow, json_schema=schema, max_new_tokens=MAX_TOKENS, session_id=first.session_id,
                            draft="model", k=4)
        restarted = threading.Event()
        chunks = []
        for chunk in c.stream(follow, json_schema=schema, max_new_tokens=MAX_TOKENS, session_id=first.session_id,
                              draft="model", k=4, decode_steps=0):
            chunks.append(chunk)
            if len(chunks) == 2 and not restarted.is_set():
                restarted.set()
                smollm2_stack.restart(worker)
    third = "".join(ch.text for ch in chunks)
    for text in (first.text, second.text, third):
        jsonschema.validate(json.loads(text), schema)
    assert chunks[-1].finish_reason  # the stream ended with a finish reason, not an error


@pytest.mark.slow
def test_bad_constraints_are_invalid_argument_naming_the_field(client):
    """Refused by the coordinator's check, before the request's input is committed or any worker called."""
    import grpc

    from specdec.v1 import common_pb2, generation_pb2

    cases = [(common_pb2.Constraint(json_schema='{"type": "wat"}'), "sampling.constraint.json_schema"),
             (common_pb2.Constraint(json_schema="{not json"), "sampling.constraint.json_schema"),
             (common_pb2.Constraint(regex="a["), "sampling.constraint.regex"),
             (common_pb2.Constraint(grammar="start: nowhere"), "sampling.constraint.grammar"),
             (common_pb2.Constraint(grammar="start: " + " | ".join(f'"w{i}"' for i in range(20_000))),
              "sampling.constraint.grammar")]
    for constraint, field in cases:
        request = generation_pb2.GenerateRequest(input=generation_pb2.GenerationInput(
            prompt="Hello", max_new_tokens=4, sampling=common_pb2.SamplingParams(constraint=constraint)))
        with pytest.raises(grpc.RpcError) as err:
            client.stub.Generate(request, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field), err.value.details()


@pytest.mark.slow
def test_a_constraint_unfinished_within_max_tokens_ends_with_length(client):
    """What was generated so far comes back (a prefix the constraint allows), never a hang."""
    schema = {"type": "object", "properties": {"essay": {"type": "string", "minLength": 400}}, "required": ["essay"]}
    r = client.generate(ask("Write an essay."), json_schema=schema, max_new_tokens=12, end_session=True)
    assert r.finish_reason == "length" and r.completion_tokens == 12
    assert r.text.startswith("{")


# -- the exact constrained distribution, on the tiny pair --------------------------------------

CHOICES = ["yes", "no", "maybe", "never"]
PROMPT = [504, 3458, 282, 4649, 314]
SAMPLES = 3000
TEMPERATURE = 1.0
EOS = 2


def exact_constrained_distribution(model, grammars: Grammars, cfg: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(output) of the tiny target alone under the constraint, every output (token sequence up to
    and including the end token) enumerated."""
    out: dict[tuple[int, ...], float] = {}

    def walk(tokens: list[int], p: float) -> None:
        with torch.inference_mode():
            logits = model(torch.tensor([PROMPT + tokens])).logits[0, -1:]
        probs = process_logits(logits, cfg, PROMPT + tokens, grammars)[0]
        for t in (probs > 0).nonzero().flatten().tolist():
            q = p * float(probs[t])
            if t == EOS:
                out[tuple(tokens + [t])] = q
            else:
                walk(tokens + [t], q)

    walk([], 1.0)
    return out


@pytest.mark.lossless
def test_sampled_constrained_output_has_the_exact_distribution(tiny_pair, hf_greedy, tmp_path_factory):
    """3,000 seeded requests with a choice constraint at T = 1 through coordinator, draft (K = 4,
    its steps masked) and target (every row masked): the outputs' counts fit the target's exact
    constrained distribution (all tokenizations of every choice, enumerated), and reject the
    distribution where every allowed output is equally likely."""
    tokenizer = load_tokenizer("smollm2", ENGINE.cache_dir)
    grammars = Grammars(lambda: tokenizer, len(tokenizer))
    constraint = Constraint("choice", json.dumps(CHOICES), (EOS,))
    cfg = SamplingConfig(temperature=TEMPERATURE, output_start=len(PROMPT), constraint=constraint)
    exact = exact_constrained_distribution(hf_greedy.model, grammars, cfg)
    assert abs(sum(exact.values()) - 1) < 1e-9
    assert {tokenizer.decode(list(o[:-1])) for o in exact} == set(CHOICES)
    stack = start_stack(*tiny_pair, tmp_path_factory.mktemp("logs"))
    try:
        with Client(stack.address("coordinator"), timeout_s=300) as c:
            def one(seed: int):
                r = c.generate(PROMPT, choice=CHOICES, temperature=TEMPERATURE, seed=seed, max_new_tokens=12,
                               draft="model", k=4, stop_token_ids=[], end_session=True)
                return tuple(r.token_ids), r.stats["drafted"]

            results = in_parallel(one, range(SAMPLES), workers=4)
    finally:
        stack.down()
    counts = Counter(tokens for tokens, _ in results)
    assert sum(d for _, d in results) > SAMPLES  # the draft proposed (accepted and rejected tokens both)
    p_value = chi_square_p_value(counts, exact, SAMPLES)
    print(f"chi-square p = {p_value:.3f} over {len(exact)} outputs, {SAMPLES} samples")
    assert p_value > 1e-3, (p_value, counts.most_common(8), sorted(exact.items(), key=lambda kv: -kv[1])[:8])
    uniform = {o: 1 / len(exact) for o in exact}
    assert chi_square_p_value(counts, uniform, SAMPLES) < 1e-6
